//! Running a daemon in this process: the daemon lock, signals, the runtime, and the exit code.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context as _, Result};
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::cli::{DaemonLock, Project, loop_workflow};
use crate::executor::Subprocess;
use crate::orchestrator::{Daemon, Exit};

/// `loopd run`: drives a loop until it ends; returns the exit code.
pub fn run_foreground(
    p: &Project,
    id: &str,
    executor: Option<String>,
    exit_on_pause: bool,
) -> Result<i32> {
    let exit = drive(p, id, executor, exit_on_pause)?;
    Ok(exit.code())
}

/// Drives a loop in this process with a fresh runtime, holding its daemon lock.
pub fn drive(p: &Project, id: &str, executor: Option<String>, exit_on_pause: bool) -> Result<Exit> {
    crate::state::store::validate_id(id)?;
    // Before touching anything: another daemon may be driving this loop.
    if let Some(pid) = crate::cli::daemon_pid(&p.store, id)
        && crate::executor::procs::ProcStat::read(pid).is_some_and(|s| s.is_alive())
    {
        return Err(crate::cli::UsageError(format!(
            "loop {id} is already driven by a daemon (pid {pid})"
        ))
        .into());
    }
    // A state file spoilt since the last run is restored from its backup before anything else.
    let restored = p.store.restore(id)?.map(|(reason, from)| {
        let message = format!(
            "{} was unusable ({reason}); restored from {from}",
            p.store.state_path(id).display()
        );
        eprintln!("loopd: {message}");
        message
    });
    let state = p.load(id)?;
    let workflow = loop_workflow(p, &state)?;
    if let Some(name) = &executor {
        p.config
            .executor_named(name)
            .map_err(|reason| crate::cli::UsageError(format!("--executor: {reason}")))?;
    }
    let daemon = build(p, workflow, executor, exit_on_pause)?;
    let mut daemon = daemon;
    daemon.restored = restored;
    let _lock = DaemonLock::acquire(&p.store, id)?;
    crate::executor::procs::become_subreaper();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let (tx, rx) = watch::channel(None);
        tokio::spawn(forward_signals(tx));
        daemon.run(id, rx).await
    })
}

/// A daemon for a project's loops, with real subprocess executors; a bad action file or executor
/// is bad input.
pub fn build(
    p: &Project,
    workflow: &'static dyn crate::workflow::Workflow,
    executor: Option<String>,
    exit_on_pause: bool,
) -> Result<Daemon> {
    Daemon::new(
        p.root.clone(),
        p.store.clone(),
        p.config.clone(),
        workflow,
        Box::new(Subprocess),
        executor,
        exit_on_pause,
    )
    .map_err(|e| crate::cli::UsageError(format!("{e:#}")).into())
}

/// SIGINT and SIGTERM ask the daemon to stop (the attempt in flight is ended and recorded); a
/// second one ends the process at once. SIGHUP is ignored: a daemon outlives its terminal.
async fn forward_signals(tx: watch::Sender<Option<i32>>) {
    static SEEN: AtomicBool = AtomicBool::new(false);
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::warn!("warning: cannot install signal handlers");
        return;
    };
    loop {
        let sig = tokio::select! {
            _ = int.recv() => Signal::SIGINT as i32,
            _ = term.recv() => Signal::SIGTERM as i32,
            _ = hup.recv() => continue,
        };
        if SEEN.swap(true, Ordering::SeqCst) {
            tracing::warn!("warning: second signal {sig}: exiting now");
            crate::executor::procs::kill_current_group();
            std::process::exit(128 + sig);
        }
        tracing::info!("signal {sig}: ending the action in flight, then exiting");
        let _ = tx.send(Some(sig));
    }
}
