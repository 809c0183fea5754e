//! loopd's side of a Temporal service: connecting, starting a loop, controlling and reading it,
//! and running a worker.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, Result};
use loopd_core::state::{LoopState, Status};
use loopd_core::still::Still;
use serde_json::Value;
use std::collections::HashMap;
pub use temporalio_client::Client;
use temporalio_client::errors::{
    WorkflowGetResultError, WorkflowInteractionError, WorkflowQueryError, WorkflowUpdateError,
};
use temporalio_client::tonic::{Code, Request};
use temporalio_client::{
    ClientOptions, Connection, NamespacedClient as _, WorkflowDescribeOptions,
    WorkflowExecuteUpdateOptions, WorkflowFetchHistoryOptions, WorkflowGetResultOptions,
    WorkflowHistory, WorkflowListOptions, WorkflowQueryOptions, WorkflowStartOptions,
};

use temporalio_common::protos::temporal::api::enums::v1::TaskQueueType;
use temporalio_common::protos::temporal::api::operatorservice::v1::{
    AddSearchAttributesRequest, ListSearchAttributesRequest,
};
use temporalio_common::protos::temporal::api::taskqueue::v1::TaskQueue;
use temporalio_common::protos::temporal::api::workflowservice::v1::{
    DescribeNamespaceRequest, DescribeTaskQueueRequest,
};
use temporalio_common::telemetry::TelemetryOptions;
use temporalio_sdk::runtime::RuntimeOptions;
use temporalio_sdk::workflow_replayer::{WorkflowReplayer, WorkflowReplayerOptions};
use temporalio_sdk::{Runtime, Worker, WorkerOptions};

use crate::activity::{LoopActivities, Progress};
use crate::change::Change;
use crate::connection::Endpoint;
use crate::visibility::{self, Listed};
use crate::workflow::LoopWorkflow;
use crate::workspace::Cache;
use crate::{Holder, LoopInput, TemporalConfig};
use loopd_exec::guard::Guard;
use std::sync::Arc;
use temporalio_sdk::runtime::PollerBehavior;
use temporalio_sdk::runtime::worker_tuner::{FixedSizeSlotSupplier, TunerHolder};

/// The longest a worker holds back an attempt's heartbeat (Temporal's default is 60 s).
const HEARTBEAT_THROTTLE: Duration = Duration::from_millis(300);
/// How long a connection may take before loopd says the service is not there.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a server that refuses connections or is not ready yet (just started) is waited for.
const CONNECT_WAIT: Duration = Duration::from_secs(10);
/// The pause between two tries of such a server.
const CONNECT_RETRY: Duration = Duration::from_millis(250);
/// How long a loop's next workflow task waits for the worker that ran its last one.
const STICKY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a change may wait for a worker to take it into the loop.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// A client of the service `config` names (over the Temporal CLI's environment and profile,
/// [`Endpoint`]), its namespace known there; one clear line when it cannot be reached.
pub async fn connect(config: &TemporalConfig) -> Result<Client> {
    let endpoint = Endpoint::resolve(config)?;
    let deadline = tokio::time::Instant::now() + CONNECT_WAIT;
    let mut told = false;
    let connection = loop {
        let options = endpoint.options(format!("loopd@{}", std::process::id()), CONNECT_TIMEOUT);
        match Connection::connect(options).await {
            Ok(connection) => break connection,
            // A server that is starting refuses connections, then answers "unavailable".
            Err(e) if Endpoint::may_pass(&e) && tokio::time::Instant::now() < deadline => {
                if !std::mem::replace(&mut told, true) {
                    tracing::info!(
                        "waiting up to {}s for Temporal at {} to answer",
                        CONNECT_WAIT.as_secs(),
                        endpoint.address
                    );
                }
                tokio::time::sleep(CONNECT_RETRY).await;
            }
            Err(e) => return Err(endpoint.explain(&e)),
        }
    };
    let client = Client::new(
        connection,
        ClientOptions::new(endpoint.namespace.clone()).build(),
    )?;
    // The first call of the namespace: an unknown one, or credentials that reach the server
    // but not the namespace, are told here rather than as a worker's endless retries.
    let request = DescribeNamespaceRequest {
        namespace: endpoint.namespace.clone(),
        ..Default::default()
    };
    match client
        .connection()
        .workflow_service()
        .describe_namespace(Request::new(request))
        .await
    {
        Ok(_) => Ok(client),
        Err(status) if status.code() == Code::NotFound => Err(anyhow::anyhow!(
            "cannot use Temporal at {}: namespace {:?} is not there",
            endpoint.address,
            endpoint.namespace
        )),
        Err(status) => Err(endpoint.explain(&status)),
    }
}

/// Starts loop `input.state.loop_id` as a workflow of that id, shown in the visibility store
/// ([`visibility`]) from its start.
pub async fn start(client: &Client, config: &TemporalConfig, input: LoopInput) -> Result<()> {
    register_attributes(client, &config.namespace).await?;
    let id = input.state.loop_id.clone();
    let options = WorkflowStartOptions::new(config.task_queue.clone(), id.clone())
        .search_attributes(visibility::of(&input))
        .build();
    client
        .start_workflow(LoopWorkflow::run, input, options)
        .await
        .with_context(|| format!("cannot start loop {id} on Temporal"))?;
    Ok(())
}

/// The loops on Temporal, newest first: of the project `root`, or all of them.
pub async fn list(client: &Client, root: Option<&std::path::Path>) -> Result<Vec<Listed>> {
    use futures::StreamExt as _;
    let mut query = "WorkflowType = 'LoopWorkflow'".to_owned();
    if let Some(root) = root {
        // A Keyword compared whole; a quote in the path is doubled as the query language asks.
        let root = root.display().to_string().replace('\'', "''");
        query.push_str(&format!(" AND {} = '{root}'", visibility::PROJECT.name()));
    }
    let mut runs = client.list_workflows(query, WorkflowListOptions::default());
    let mut listed = Vec::new();
    while let Some(run) = runs.next().await {
        let run = run.context("cannot list the loops on Temporal")?;
        // A loop's earlier runs (continued as new, or resumed) come after its newest.
        if !listed.iter().any(|l: &Listed| l.loop_id == run.id()) {
            listed.push(Listed::from(run.id(), &run.search_attributes()));
        }
    }
    Ok(listed)
}

/// Makes a change to a loop ([`Change`]); returns what the command prints, or why the loop
/// refused it, in one line. A loop whose workflow has ended (completed, failed, stopped) takes
/// the change into its last state, from which its next run starts.
pub async fn change(
    client: &Client,
    config: &TemporalConfig,
    id: &str,
    change: &Change,
    at: &str,
) -> Result<Value> {
    let handle = client.get_workflow_handle::<LoopWorkflow>(id);
    let update = handle.execute_update(
        LoopWorkflow::change,
        change.clone(),
        WorkflowExecuteUpdateOptions::default(),
    );
    match tokio::time::timeout(ANSWER_TIMEOUT, update).await {
        Ok(Ok(said)) => Ok(said),
        Ok(Err(WorkflowUpdateError::Failed(failure))) => Err(anyhow::anyhow!(
            "{}",
            loopd_exec::result::one_line(&failure.message)
        )),
        Ok(Err(WorkflowUpdateError::NotFound(_))) => {
            // The changed state becomes the next run: one that goes on (a resume), or one that
            // ends at once and keeps the change (a raised limit, a task) for the next command.
            let mut input = finished(client, id).await?;
            let said = input.change(change, at).map_err(anyhow::Error::msg)?;
            start(client, config, input).await?;
            Ok(said)
        }
        Ok(Err(e)) => Err(e).with_context(|| format!("cannot change loop {id} on Temporal")),
        Err(_) => anyhow::bail!(
            "loop {id} did not answer within {}s: is a `loopd worker` running for it?",
            ANSWER_TIMEOUT.as_secs()
        ),
    }
}

/// Waits until loop `id`'s workflow has ended (through every run it continued as); returns what
/// its next run would start from.
pub async fn finished(client: &Client, id: &str) -> Result<LoopInput> {
    client
        .get_workflow_handle::<LoopWorkflow>(id)
        .get_result(WorkflowGetResultOptions::default())
        .await
        .map_err(|e| match e {
            WorkflowGetResultError::NotFound(_) => anyhow::anyhow!("no loop {id} on Temporal"),
            e => anyhow::anyhow!("cannot read loop {id} on Temporal: {e}"),
        })
}

/// A loop's state as its workflow holds it now.
pub async fn state(client: &Client, id: &str) -> Result<LoopState> {
    client
        .get_workflow_handle::<LoopWorkflow>(id)
        .query(LoopWorkflow::state, (), WorkflowQueryOptions::default())
        .await
        .with_context(|| format!("cannot read loop {id} on Temporal"))
}

/// The worker that keeps loop `id`'s work tree, if one does.
pub async fn holder(client: &Client, id: &str) -> Result<Option<Holder>> {
    client
        .get_workflow_handle::<LoopWorkflow>(id)
        .query(LoopWorkflow::holder, (), WorkflowQueryOptions::default())
        .await
        .with_context(|| format!("cannot read loop {id} on Temporal"))
}

/// Loop `id`'s project root and state as its workflow holds them; `None` when there is no
/// such loop.
pub async fn held(client: &Client, id: &str) -> Result<Option<(PathBuf, LoopState)>> {
    let asked = client
        .get_workflow_handle::<LoopWorkflow>(id)
        .query(LoopWorkflow::held, (), WorkflowQueryOptions::default())
        .await;
    match asked {
        Ok(held) => Ok(Some(held)),
        Err(WorkflowQueryError::NotFound(_)) => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read loop {id} on Temporal")),
    }
}

/// How long a list waits for each loop's workflow to answer.
pub const LIST_WAIT: Duration = Duration::from_secs(2);

/// How long a workflow is asked all the same when the server lists no worker of its task queue:
/// a worker that has just started may not be listed yet (the server lists the pollers of the
/// queue's first partition), and it answers in milliseconds.
const UNLISTED_WAIT: Duration = Duration::from_secs(1);

/// Every loop on Temporal (of the project `root`, or all), with its state and why it stands
/// still: each asked of its workflow, and shown as the visibility store knows it where the
/// workflow does not answer within `wait` (see [`seen`]).
pub async fn seen_all(
    client: &Client,
    config: &TemporalConfig,
    root: Option<&std::path::Path>,
    wait: Duration,
) -> Result<Vec<(Listed, LoopState, Option<Still>)>> {
    let listed = list(client, root).await?;
    let no_worker = no_worker(client, config).await?;
    let wait = if no_worker.is_some() {
        UNLISTED_WAIT.min(wait)
    } else {
        wait
    };
    let asked = futures::future::join_all(listed.iter().map(|l| async {
        let asked = tokio::time::timeout(wait, held(client, &l.loop_id)).await;
        asked.ok()?.ok()?.map(|(_, state)| state)
    }))
    .await;
    Ok(listed
        .into_iter()
        .zip(asked)
        .map(|(listed, asked)| match asked {
            Some(state) => {
                let still = state.still();
                (listed, state, still)
            }
            None => {
                let (_, state) = listed.as_held();
                let still = unanswered(&state, no_worker.as_ref());
                (listed, state, still)
            }
        })
        .collect())
}

/// How long after the server last saw a worker's poll the worker counts as there: a poll waits
/// up to a minute for a task, and the server forgets a poller minutes after it went away.
const POLLED_WITHIN: i64 = 90;

/// Why the loops of `config`'s task queue stand still when no worker polls it (none started, or
/// all gone): `None` while one does.
pub async fn no_worker(client: &Client, config: &TemporalConfig) -> Result<Option<Still>> {
    let queue = config.task_queue.clone();
    let request = DescribeTaskQueueRequest {
        namespace: client.namespace(),
        task_queue: Some(TaskQueue {
            name: queue.clone(),
            ..TaskQueue::default()
        }),
        task_queue_type: TaskQueueType::Workflow as i32,
        ..DescribeTaskQueueRequest::default()
    };
    let pollers = client
        .connection()
        .workflow_service()
        .describe_task_queue(Request::new(request))
        .await
        .with_context(|| format!("cannot ask Temporal for the workers of task queue {queue}"))?
        .into_inner()
        .pollers;
    let now = chrono::Utc::now().timestamp();
    let polling = pollers.iter().any(|p| {
        p.last_access_time
            .as_ref()
            .is_some_and(|t| now - t.seconds < POLLED_WITHIN)
    });
    let address = Endpoint::resolve(config).map_or_else(|_| config.address.clone(), |e| e.address);
    Ok((!polling).then(|| {
        Still::new(
            format!("waiting for a worker: none polls task queue {queue}"),
            format!("start one where the project is: `loopd worker --temporal {address}`"),
        )
    }))
}

/// Loop `id` as the visibility store knows it (its status and iteration, its project), without
/// asking its workflow; `None` when there is no such loop.
pub async fn listed(client: &Client, id: &str) -> Result<Option<Listed>> {
    use futures::StreamExt as _;
    // An id is loopd's own (letters, digits, dashes); a quote would be doubled all the same.
    let query = format!(
        "WorkflowType = 'LoopWorkflow' AND WorkflowId = '{}'",
        id.replace('\'', "''")
    );
    let mut runs = client.list_workflows(query, WorkflowListOptions::default());
    match runs.next().await {
        Some(run) => {
            let run = run.with_context(|| format!("cannot read loop {id} on Temporal"))?;
            Ok(Some(Listed::from(run.id(), &run.search_attributes())))
        }
        None => Ok(None),
    }
}

/// Loop `id` as a person is shown it: asked of its workflow. Where the server lists no worker
/// of its task queue, the loop's workflow does not answer within a second (a workflow is only
/// answered by a worker) and the visibility store has it going, it is shown as that store knows
/// it, waiting for a worker. `None` when there is no such loop.
pub async fn seen(
    client: &Client,
    config: &TemporalConfig,
    id: &str,
) -> Result<Option<(PathBuf, LoopState, Option<Still>)>> {
    let asking = held(client, id);
    tokio::pin!(asking);
    let answered =
        |held: Option<(PathBuf, LoopState)>| held.map(|(root, state)| (root, state, None));
    if let Some(still) = no_worker(client, config).await? {
        match tokio::time::timeout(UNLISTED_WAIT, &mut asking).await {
            Ok(asked) => return Ok(answered(asked?)),
            Err(_) => {
                if let Some(listed) = listed(client, id).await? {
                    let (root, state) = listed.as_held();
                    if waits_for_a_worker(&state) {
                        return Ok(Some((root, state, Some(still))));
                    }
                }
            }
        }
    }
    Ok(answered(asking.await?))
}

/// Why a loop whose workflow did not answer stands still, from what the visibility store knows
/// of it (`state`) and whether any worker polls its queue.
fn unanswered(state: &LoopState, no_worker: Option<&Still>) -> Option<Still> {
    match no_worker {
        Some(still) if waits_for_a_worker(state) => Some(still.clone()),
        _ => state.still(),
    }
}

/// Whether a loop in `state` has work for a worker: one that is going.
fn waits_for_a_worker(state: &LoopState) -> bool {
    matches!(state.status, Status::Running | Status::Created)
}

/// The attempts loop `id` runs now (several for a batch or a race), each as its last heartbeat
/// told; none when none runs.
pub async fn progress(client: &Client, id: &str) -> Result<Vec<Progress>> {
    let description = client
        .get_workflow_handle::<LoopWorkflow>(id)
        .describe(WorkflowDescribeOptions::default())
        .await
        .with_context(|| format!("cannot read loop {id} on Temporal"))?;
    Ok(description
        .raw_description
        .pending_activities
        .iter()
        .filter_map(|a| a.heartbeat_details.as_ref()?.payloads.first())
        // A heartbeat's details are JSON (the SDK's default converter).
        .filter_map(|p| serde_json::from_slice(&p.data).ok())
        .collect())
}

/// A worker as `loopd worker` runs it.
pub struct WorkerSetup {
    /// Ends the executors of its attempts should the worker die.
    pub guard: Option<Arc<Guard>>,
    /// Its name: its own task queue is `TASK_QUEUE@NAME`.
    pub name: String,
    /// Its clones and work trees.
    pub cache: Arc<Cache>,
    /// Actions it runs at once.
    pub max_actions: usize,
    /// How long it keeps a work tree no action used.
    pub tree_grace: Duration,
    /// Its metrics endpoint, bound ([`crate::metrics`]).
    pub metrics: Option<crate::metrics::Exporter>,
    /// Called once it is connected and its workers are made, before they poll.
    pub ready: Option<Box<dyn FnOnce() + Send>>,
}

/// Runs a worker of loopd's workflows and activities until `shutdown` resolves; the attempt it
/// runs then is cancelled (its executor ended) and given back to the service. The worker polls
/// two task queues: the loops' own, for their workflows and for attempts any worker may run,
/// and one of its own, for the attempts of the loops whose work trees it keeps.
pub async fn run_worker(
    config: &TemporalConfig,
    setup: WorkerSetup,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let mut setup = setup;
    let exporter = setup.metrics.take();
    let telemetry = TelemetryOptions::builder()
        .maybe_metrics(exporter.as_ref().map(|e| e.meter.clone()))
        .build();
    let options = RuntimeOptions::builder()
        .telemetry_options(telemetry)
        .build()
        .map_err(|e| anyhow::anyhow!("the Temporal runtime's options: {e}"))?;
    let runtime = Runtime::from_current_tokio(options)
        .map_err(|e| anyhow::anyhow!("cannot start the Temporal runtime: {e}"))?;
    let metrics = async {
        match exporter {
            Some(exporter) => exporter.serve().await,
            None => std::future::pending().await,
        }
    };
    let client = connect(config).await?;
    register_attributes(&client, &config.namespace).await?;
    let own_queue = format!("{}@{}", config.task_queue, setup.name);
    let slots = Arc::new(tokio::sync::Semaphore::new(setup.max_actions));
    let activities = || LoopActivities {
        guard: setup.guard.clone(),
        cache: Some(setup.cache.clone()),
        holder: Some(Holder {
            name: setup.name.clone(),
            queue: own_queue.clone(),
        }),
        slots: slots.clone(),
    };
    // Each queue's worker takes at most `max_actions` attempts at once (its slots), the rest
    // staying in Temporal's queue; `slots` bounds the two together. One poll at a time holds
    // one slot while it waits, leaving the others free for the attempts its workflow tasks
    // schedule, which the server then hands over at once (eager execution).
    let tuner = || {
        TunerHolder::builder()
            .workflow_task_slot_supplier(FixedSizeSlotSupplier::new(100))
            .activity_task_slot_supplier(FixedSizeSlotSupplier::new(setup.max_actions))
            .local_activity_task_slot_supplier(FixedSizeSlotSupplier::new(1))
            .nexus_task_slot_supplier(FixedSizeSlotSupplier::new(1))
            .build()
    };
    let one_poll = PollerBehavior::SimpleMaximum(1);
    let shared = WorkerOptions::new(config.task_queue.clone())
        // A heartbeat is how a pause or stop reaches the attempt: none is held back long.
        .max_heartbeat_throttle_interval(HEARTBEAT_THROTTLE)
        // A worker told to stop ends its attempts at once; each goes to another worker.
        .graceful_shutdown_period(Duration::ZERO)
        // A loop whose worker died is taken up by another within seconds, not Temporal's 10 s.
        .sticky_queue_schedule_to_start_timeout(STICKY_TIMEOUT)
        .tuner(tuner())
        .activity_task_poller_behavior(one_poll)
        .client_identity_override(format!("loopd worker {}", setup.name))
        .register_workflow::<LoopWorkflow>()?
        .register_activities(activities())
        .build();
    let own = WorkerOptions::new(own_queue.clone())
        .max_heartbeat_throttle_interval(HEARTBEAT_THROTTLE)
        .graceful_shutdown_period(Duration::ZERO)
        .tuner(tuner())
        .activity_task_poller_behavior(one_poll)
        .client_identity_override(format!("loopd worker {}", setup.name))
        .register_activities(activities())
        .build();
    let mut shared = Worker::new(&runtime, client.clone(), shared)?;
    let mut own = Worker::new(&runtime, client, own)?;
    if let Some(ready) = setup.ready.take() {
        ready();
    }
    let (stop_shared, stop_own) = (shared.shutdown_handle(), own.shutdown_handle());
    let sweep = sweep(&setup.cache, setup.tree_grace);
    let run = futures::future::try_join(shared.run(), own.run());
    tokio::pin!(run);
    tokio::pin!(shutdown);
    tokio::pin!(sweep);
    tokio::pin!(metrics);
    tokio::select! {
        ended = &mut run => return ended.map(|_| ()).context("the worker stopped"),
        () = &mut shutdown => {
            stop_shared();
            stop_own();
        }
        () = &mut sweep => {}
        served = &mut metrics => {
            if let Err(e) = served {
                tracing::error!("{e:#}");
            }
            stop_shared();
            stop_own();
        }
    }
    run.await.map(|_| ()).context("the worker stopped")
}

/// Removes the work trees no action used for `grace`, looking every quarter of it (at most
/// every minute), for as long as the worker runs.
async fn sweep(cache: &Cache, grace: Duration) {
    let every = (grace / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
    loop {
        tokio::time::sleep(every).await;
        for id in cache.sweep(grace).await {
            tracing::info!("loop {id}: its work tree was not used for {grace:?}, removed");
        }
    }
}

/// Replays a loop's recorded history (JSON, as `temporal workflow show --output json` writes it)
/// through this build's workflow code; an error names the non-determinism it found: a change to
/// the workflow that the loops running now could not take.
pub async fn replay(history_json: &[u8]) -> Result<()> {
    let history = WorkflowHistory::from_json(history_json).context("not a workflow history")?;
    let options = WorkflowReplayerOptions::new()
        .register_workflow::<LoopWorkflow>()?
        .build();
    WorkflowReplayer::new(options)?
        .replay_workflow(history)
        .await
        .context("the history does not replay")
}

/// The recorded histories of every run of loop `id` (JSON, what [`replay`] takes), newest first.
pub async fn histories(client: &Client, id: &str) -> Result<Vec<Vec<u8>>> {
    let mut histories = Vec::new();
    for history in runs(client, id).await? {
        histories.push(history.to_json().await?);
    }
    Ok(histories)
}

/// Loop `id`'s events, oldest first, read from the histories of its runs ([`crate::history::events`]).
pub async fn events(client: &Client, id: &str) -> Result<Vec<Value>> {
    let mut events = Vec::new();
    for history in runs(client, id).await?.into_iter().rev() {
        let history = history
            .into_events()
            .await
            .with_context(|| format!("cannot read the history of loop {id}"))?;
        events.extend(crate::history::events(&history));
    }
    Ok(events)
}

/// The histories of every run of loop `id`, newest first, not fetched yet.
async fn runs(client: &Client, id: &str) -> Result<Vec<WorkflowHistory>> {
    use futures::StreamExt as _;
    use temporalio_client::{NamespacedClient as _, WorkflowExecutionInfo};
    let mut runs = client.list_workflows(
        format!("WorkflowId = '{id}'"),
        WorkflowListOptions::default(),
    );
    let mut histories = Vec::new();
    while let Some(run) = runs.next().await {
        let run = run.with_context(|| format!("cannot list the runs of loop {id}"))?;
        let info = WorkflowExecutionInfo::builder()
            .namespace(client.namespace())
            .workflow_id(id)
            .run_id(run.run_id())
            .build();
        histories.push(
            info.bind_untyped(client.clone())
                .fetch_history(WorkflowFetchHistoryOptions::default()),
        );
    }
    if histories.is_empty() {
        // The visibility store learns of a new workflow a moment after its start: its newest
        // run, if it has one, is asked for by id.
        let handle = client.get_workflow_handle::<LoopWorkflow>(id);
        handle
            .describe(WorkflowDescribeOptions::default())
            .await
            .map_err(|e| match e {
                WorkflowInteractionError::NotFound(_) => {
                    anyhow::anyhow!("no loop {id} on Temporal")
                }
                e => anyhow::anyhow!("cannot read loop {id} on Temporal: {e}"),
            })?;
        histories.push(handle.fetch_history(WorkflowFetchHistoryOptions::default()));
    }
    Ok(histories)
}

/// Registers loopd's search attributes ([`visibility`]) in `namespace` where they are missing.
async fn register_attributes(client: &Client, namespace: &str) -> Result<()> {
    let mut operator = client.connection().operator_service();
    let known = operator
        .list_search_attributes(Request::new(ListSearchAttributesRequest {
            namespace: namespace.to_owned(),
        }))
        .await
        .context("cannot list the namespace's search attributes")?
        .into_inner();
    let missing: HashMap<String, i32> = visibility::wanted()
        .into_iter()
        .filter(|(name, _)| !known.custom_attributes.contains_key(*name))
        .map(|(name, kind)| (name.to_owned(), kind as i32))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let names: Vec<&String> = missing.keys().collect();
    let names = format!("{names:?}");
    let added = operator
        .add_search_attributes(Request::new(AddSearchAttributesRequest {
            search_attributes: missing,
            namespace: namespace.to_owned(),
        }))
        .await;
    match added {
        // Another worker registered them meanwhile.
        Err(e) if e.code() == Code::AlreadyExists => return Ok(()),
        added => {
            added.with_context(|| format!("cannot register loopd's search attributes {names}"))?
        }
    };
    tracing::info!("registered the search attributes {names} in namespace {namespace}");
    Ok(())
}
