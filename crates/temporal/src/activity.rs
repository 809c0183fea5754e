//! An attempt as a Temporal activity: the executor run on whichever worker takes it, in the
//! loop's project root, as the file driver runs it.

use std::path::PathBuf;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use loopd_core::attempt::Verdict;
use loopd_core::state::{LoopState, Usage};
use loopd_core::workflow::{self, Dispatch};
use loopd_exec::agent::{AgentStream, Told};
use loopd_exec::guard::Guard;
use loopd_exec::result::{RESULT_FILE, empty_result_file};
use loopd_exec::{Budget, Executor as _, Spec, Subprocess, procs};
use loopd_fs::Dir;
use loopd_project::config::Config;
use loopd_project::plan::{self, Paths, Plans, Step};
use serde::{Deserialize, Serialize};
use temporalio_macros::activities;
use temporalio_sdk::activities::{ActivityContext, ActivityError};
use tokio_util::sync::CancellationToken;

/// How often a running attempt tells Temporal it lives (and hears of a cancellation).
const HEARTBEAT_EVERY: Duration = Duration::from_millis(200);

/// One attempt to run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AttemptInput {
    pub root: PathBuf,
    /// The loop's state when the attempt starts: what its prompt is made of.
    pub state: LoopState,
    pub dispatch: Dispatch,
    pub iteration: u64,
    pub attempt: u32,
    pub executor: Option<String>,
}

/// What a running attempt tells Temporal with each heartbeat (`loopd status --temporal` shows
/// it): which attempt it is, and the last of what its executor printed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub action: String,
    pub iteration: u64,
    pub attempt: u32,
    /// The last [`PROGRESS_TAIL`] bytes of the attempt's log.
    pub output: String,
    /// What an agent has spent so far (0 and `None` for an executor that does not say).
    pub tokens: u64,
    pub cost_usd: Option<f64>,
}

/// How much of an attempt's log each heartbeat carries.
pub const PROGRESS_TAIL: u64 = 1024;

/// How an attempt ended, and what its executor spent.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AttemptReport {
    /// The executor that ran it, by name (`command: ...` for an action's own command).
    pub executor: String,
    pub verdict: Verdict,
    pub spent: Option<(Usage, Option<f64>)>,
}

/// The activities of loopd's workers.
pub struct LoopActivities {
    /// Ends the executors of this worker's attempts if the worker dies (see [`Guard`]).
    pub guard: Option<Guard>,
}

#[activities]
impl LoopActivities {
    /// Runs one attempt of an action: the project's config and action files are read on this
    /// worker, the prompt rendered, the executor started in a process group of its own and
    /// supervised; a cancellation (the loop paused or stopped) ends its processes.
    #[activity]
    pub async fn attempt(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: AttemptInput,
    ) -> Result<AttemptReport, ActivityError> {
        let report = run_attempt(&ctx, self.guard.as_ref(), input).await?;
        // Cancelled, its executor ended: by its loop (paused, stopped), which no longer waits
        // for it, or by this worker's shutdown, which gives it to another worker at once.
        match ctx.is_cancelled() {
            true => Err(ActivityError::cancelled()),
            false => Ok(report),
        }
    }
}

async fn run_attempt(
    ctx: &ActivityContext,
    guard: Option<&Guard>,
    input: AttemptInput,
) -> anyhow::Result<AttemptReport> {
    let AttemptInput {
        root,
        state,
        dispatch,
        iteration,
        attempt,
        executor,
    } = input;
    let config = Config::load(&root, None)?;
    let name = state
        .skill_state
        .as_ref()
        .and_then(|s| s.workflow.as_deref())
        .unwrap_or(workflow::DEFAULT);
    let wf = workflow::by_name(name).with_context(|| format!("unknown workflow {name:?}"))?;
    let plans = Plans::load(&root, &config, wf, executor.as_deref())?;
    loopd_project::trust::check(&root, &plans.project_files(&config))?;
    let (def, plan) = plans
        .get(&dispatch.action)
        .with_context(|| format!("no plan for action {}", dispatch.action))?;
    let id = state.loop_id.as_str();
    let state_dir = root.join(&config.state_dir);
    let progress_dir = state_dir.join(format!("{id}.progress"));
    let actions = Dir::open(&root)?
        .subdir(&config.state_dir, true)?
        .subdir(&format!("{id}.progress"), true)?
        .subdir("actions", true)?;
    let result_file = actions.join(RESULT_FILE);
    empty_result_file(&actions);
    let step = Step {
        dispatch: &dispatch,
        plan,
        def,
        iteration,
    };
    let state_file = state_dir.join(format!("{id}.json"));
    let marker = procs::marker_name(&state_file);
    let paths = Paths {
        root: &root,
        state_file: &state_file,
        progress_dir: &progress_dir,
        result_file: &result_file,
    };
    let task = wf.task(&state, &dispatch);
    let max_iterations = state.max_iterations_or(config.max_iterations);
    let prompt = plan::prompt(
        wf,
        max_iterations,
        &state,
        &step,
        attempt,
        &paths,
        task.clone(),
    );
    let env = plan::environment(id, &step, attempt, &paths, task);
    let (tokens, cost_usd) = config.limits().remaining(&state);
    let spec = Spec {
        argv: plan.argv.clone(),
        prompt,
        prompt_mode: plan.prompt_mode,
        env,
        cwd: root.clone(),
        supervision: plan.supervision,
        dir: actions.clone(),
        stem: format!("{iteration:04}-{}-{attempt}", dispatch.action),
        marker: marker.clone(),
        agent: AgentStream::for_format(plan.format),
        budget: Budget { tokens, cost_usd },
    };
    let log = format!("{}.log", spec.stem);
    let progress = |output, (tokens, cost_usd)| Progress {
        action: dispatch.action.clone(),
        iteration,
        attempt,
        output,
        tokens,
        cost_usd,
    };
    let _guarded = guard.map(|g| g.attempt(&marker));
    let running = Subprocess.spawn(spec)?;
    let cancel = CancellationToken::new();
    // What the agent has spent so far, for the heartbeats.
    let spent = std::sync::Mutex::new((0, None));
    let mut told = |told| {
        if let Told::Spent { tokens, cost_usd } = told {
            *spent.lock().unwrap_or_else(PoisonError::into_inner) = (tokens, cost_usd);
        }
    };
    let supervised = running.supervise(cancel.clone(), &mut told);
    tokio::pin!(supervised);
    let run = loop {
        tokio::select! {
            run = &mut supervised => break run?,
            () = ctx.cancelled(), if !cancel.is_cancelled() => cancel.cancel(),
            () = tokio::time::sleep(HEARTBEAT_EVERY) => {
                let output = actions.read_tail(&log, PROGRESS_TAIL).unwrap_or_default();
                let spent = *spent.lock().unwrap_or_else(PoisonError::into_inner);
                let _ = ctx.record_heartbeat(progress(output, spent)).await;
            }
        }
    };
    let reported = loopd_exec::result::read_result_file(&actions, RESULT_FILE);
    let verdict = loopd_exec::result::verdict(plan.format, reported, &run);
    let spent = run.agent.map(|a| (a.usage, a.cost_usd));
    Ok(AttemptReport {
        executor: plan.executor.clone(),
        verdict,
        spent,
    })
}
