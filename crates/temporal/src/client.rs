//! loopd's side of a Temporal service: connecting, starting a loop, controlling and reading it,
//! and running a worker.

use std::time::Duration;

use anyhow::{Context as _, Result};
use loopd_core::state::LoopState;
pub use temporalio_client::Client;
use temporalio_client::{
    ClientOptions, Connection, ConnectionOptions, Url, WorkflowQueryOptions, WorkflowSignalOptions,
    WorkflowStartOptions,
};
use temporalio_sdk::{Runtime, Worker, WorkerOptions};

use crate::activity::LoopActivities;
use crate::workflow::{Control, LoopWorkflow};
use crate::{LoopInput, TemporalConfig};

/// The longest a worker holds back an attempt's heartbeat (Temporal's default is 60 s).
const HEARTBEAT_THROTTLE: Duration = Duration::from_millis(300);
/// How long a connection may take before loopd says the service is not there.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A client of the service `config` names; one clear line when it cannot be reached.
pub async fn connect(config: &TemporalConfig) -> Result<Client> {
    let url = Url::parse(&format!("http://{}", config.address))
        .with_context(|| format!("bad Temporal address {:?}", config.address))?;
    let options = ConnectionOptions::new(url)
        .identity(format!("loopd@{}", std::process::id()))
        .connect_timeout(CONNECT_TIMEOUT)
        .build();
    let connection = Connection::connect(options)
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach Temporal at {}: {e}", config.address))?;
    Ok(Client::new(
        connection,
        ClientOptions::new(config.namespace.clone()).build(),
    )?)
}

/// Starts loop `input.state.loop_id` as a workflow of that id.
pub async fn start(client: &Client, config: &TemporalConfig, input: LoopInput) -> Result<()> {
    let id = input.state.loop_id.clone();
    client
        .start_workflow(
            LoopWorkflow::run,
            input,
            WorkflowStartOptions::new(config.task_queue.clone(), id.clone()).build(),
        )
        .await
        .with_context(|| format!("cannot start loop {id} on Temporal"))?;
    Ok(())
}

/// Pauses, resumes or stops a loop.
pub async fn control(client: &Client, id: &str, what: Control) -> Result<()> {
    client
        .get_workflow_handle::<LoopWorkflow>(id)
        .signal(
            LoopWorkflow::control,
            what,
            WorkflowSignalOptions::default(),
        )
        .await
        .with_context(|| format!("cannot reach loop {id} on Temporal"))
}

/// A loop's state as its workflow holds it now.
pub async fn state(client: &Client, id: &str) -> Result<LoopState> {
    client
        .get_workflow_handle::<LoopWorkflow>(id)
        .query(LoopWorkflow::state, (), WorkflowQueryOptions::default())
        .await
        .with_context(|| format!("cannot read loop {id} on Temporal"))
}

/// Runs a worker of loopd's workflows and activities until `shutdown` resolves; the attempt it
/// runs then is cancelled (its executor ended) and given back to the service.
pub async fn run_worker(
    config: &TemporalConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let runtime = Runtime::from_current_tokio(Default::default())
        .map_err(|e| anyhow::anyhow!("cannot start the Temporal runtime: {e}"))?;
    let client = connect(config).await?;
    let options = WorkerOptions::new(config.task_queue.clone())
        // A heartbeat is how a pause or stop reaches the attempt: none is held back long.
        .max_heartbeat_throttle_interval(HEARTBEAT_THROTTLE)
        .register_workflow::<LoopWorkflow>()?
        .register_activities(LoopActivities)
        .build();
    let mut worker = Worker::new(&runtime, client, options)?;
    let stop = worker.shutdown_handle();
    let run = worker.run();
    tokio::pin!(run);
    tokio::pin!(shutdown);
    tokio::select! {
        ended = &mut run => return ended.context("the worker stopped"),
        () = &mut shutdown => stop(),
    }
    run.await.context("the worker stopped")
}
