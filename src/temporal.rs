//! The commands of loops on Temporal (`--temporal HOST:PORT`, cargo feature `temporal`):
//! `worker`, and `create`, `status`, `pause`, `resume` and `stop` of a loop there.

use anyhow::Result;
use loopd_core::state::ListedTask;
use loopd_file_driver::create::CreateArgs;
use loopd_file_driver::error::usage;
use loopd_file_driver::project::Project;
use loopd_temporal::workflow::Control;
use loopd_temporal::{LoopInput, TemporalConfig, client};
use serde_json::json;

use crate::output::print_result;

/// `loopd worker`'s options.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// The Temporal namespace
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// The task queue of loopd's workflows and activities
    #[arg(long, default_value = "loopd")]
    pub task_queue: String,
}

/// Where the service is: `--temporal`, else a local dev server's default.
pub fn config(address: Option<&str>) -> TemporalConfig {
    let mut config = TemporalConfig::default();
    if let Some(address) = address {
        config.address = address.to_owned();
    }
    config
}

/// A client of the service; a service that cannot be reached is the user's to fix (exit 2).
async fn connect(config: &TemporalConfig) -> Result<client::Client> {
    client::connect(config)
        .await
        .map_err(|e| usage(format!("{e:#}")))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// `loopd worker`: runs loops' workflows and their actions until SIGINT or SIGTERM.
pub fn worker(address: Option<&str>, args: &WorkerArgs) -> Result<i32> {
    let config = TemporalConfig {
        namespace: args.namespace.clone(),
        task_queue: args.task_queue.clone(),
        ..config(address)
    };
    runtime()?.block_on(async {
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("a SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("signal: the worker stops");
        };
        tracing::info!(
            "worker on {} (namespace {}, task queue {})",
            config.address,
            config.namespace,
            config.task_queue
        );
        client::run_worker(&config, shutdown).await
    })?;
    Ok(0)
}

/// `loopd create --temporal`: the loop's state made as `create` makes it, started as a workflow.
pub fn create(p: &Project, address: Option<&str>, args: &CreateArgs, json: bool) -> Result<i32> {
    if args.worktree {
        return Err(usage(
            "--worktree is for loops in the file store; a loop on Temporal runs in its root",
        ));
    }
    let id = loopd_store::store::new_id();
    let state = loopd_file_driver::create::new_state(p, args, &id, None)?;
    let tasks = args
        .tasks
        .iter()
        .enumerate()
        .map(|(i, text)| ListedTask {
            id: loopd_core::state::task_id(i as u64 + 1),
            description: text.clone(),
            ..ListedTask::default()
        })
        .collect();
    let input = LoopInput {
        root: p.root.clone(),
        state,
        tasks,
        executor: None,
        limits: p.config.limits(),
        retry: p.config.retry_policy(),
    };
    let config = config(address);
    runtime()?.block_on(async {
        let client = connect(&config).await?;
        client::start(&client, &config, input).await
    })?;
    print_result(
        json,
        &json!({ "loop_id": id, "temporal": config.address }),
        &id,
    )?;
    Ok(0)
}

/// `loopd status --temporal`: the loop's state as its workflow holds it.
pub fn status(address: Option<&str>, id: &str, json: bool) -> Result<i32> {
    let config = config(address);
    let state = runtime()?.block_on(async {
        let client = connect(&config).await?;
        client::state(&client, id).await
    })?;
    let value = serde_json::to_value(&state)?;
    let iteration = state.current_iteration;
    print_result(
        json,
        &value,
        &format!("loop {id}: {} (iteration {iteration})", state.status),
    )?;
    Ok(0)
}

/// `loopd pause|resume|stop --temporal`.
pub fn control(address: Option<&str>, id: &str, what: Control, json: bool) -> Result<i32> {
    let config = config(address);
    runtime()?.block_on(async {
        let client = connect(&config).await?;
        client::control(&client, id, what).await
    })?;
    print_result(
        json,
        &json!({ "loop_id": id, "sent": format!("{what:?}").to_lowercase() }),
        "",
    )?;
    Ok(0)
}
