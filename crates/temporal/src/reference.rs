//! The yardstick of loopd on Temporal: a bare workflow of the SDK that runs one activity per
//! step, each spawning `sh -c 'echo N'`, with a worker in the same process: what a step costs
//! through Temporal with nothing of loopd's (31.5 ms here, `../shared/TEMPORAL.md`). The
//! benchmark (`cargo bench --bench temporal --features temporal`) sets loopd's time per action
//! beside it.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use temporalio_client::{WorkflowGetResultOptions, WorkflowStartOptions};
use temporalio_macros::{activities, workflow, workflow_methods};
use temporalio_sdk::activities::{ActivityContext, ActivityError};
use temporalio_sdk::{
    ActivityOptions, Runtime, Worker, WorkerOptions, WorkflowContext, WorkflowResult,
};

use crate::TemporalConfig;
use crate::client::connect;

/// `steps` activities, one after another.
#[workflow]
#[derive(Default)]
pub struct BareWorkflow;

#[workflow_methods]
impl BareWorkflow {
    #[run]
    pub async fn run(ctx: &mut WorkflowContext<Self>, steps: u32) -> WorkflowResult<u32> {
        for step in 0..steps {
            let options =
                ActivityOptions::with_start_to_close_timeout(Duration::from_secs(60)).build();
            ctx.execute_activity(BareActivities::step, step, options)
                .await?;
        }
        Ok(steps)
    }
}

pub struct BareActivities;

#[activities]
impl BareActivities {
    /// Spawns `sh -c 'echo STEP'` and waits for it.
    #[activity]
    pub async fn step(_ctx: ActivityContext, step: u32) -> Result<(), ActivityError> {
        tokio::process::Command::new("sh")
            .args(["-c", &format!("echo {step}")])
            .output()
            .await
            .map_err(anyhow::Error::from)?;
        Ok(())
    }
}

/// Runs one bare workflow of `steps` steps on the service `config` names, with a worker of its
/// own task queue in this process; returns the time from its start to its result.
pub async fn run(config: &TemporalConfig, id: &str, steps: u32) -> Result<Duration> {
    let runtime = Runtime::from_current_tokio(Default::default())
        .map_err(|e| anyhow::anyhow!("cannot start the Temporal runtime: {e}"))?;
    let client = connect(config).await?;
    let queue = format!("{}-bare", config.task_queue);
    let options = WorkerOptions::new(queue.clone())
        .register_workflow::<BareWorkflow>()?
        .register_activities(BareActivities)
        .build();
    let mut worker = Worker::new(&runtime, client.clone(), options)?;
    let stop = worker.shutdown_handle();
    let measured = async {
        let started = Instant::now();
        let handle = client
            .start_workflow(
                BareWorkflow::run,
                steps,
                WorkflowStartOptions::new(queue.clone(), id.to_owned()).build(),
            )
            .await?;
        handle
            .get_result(WorkflowGetResultOptions::default())
            .await
            .context("the bare workflow failed")?;
        anyhow::Ok(started.elapsed())
    };
    let run = worker.run();
    tokio::pin!(run);
    tokio::pin!(measured);
    let elapsed = tokio::select! {
        ended = &mut run => {
            ended?;
            anyhow::bail!("the worker stopped before the workflow ended");
        }
        elapsed = &mut measured => elapsed?,
    };
    stop();
    run.await?;
    Ok(elapsed)
}
