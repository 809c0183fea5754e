//! Daemons: the lock that says a daemon drives a loop, starting one detached, and running one in
//! this process (signals, the runtime, the exit code).

use std::os::unix::process::CommandExt as _;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use loopd_core::state::{LoopState, Status};
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::locks::{
    Held, WORK_TREE_LOCK, already_driven, daemon_pid, driving_daemon, holder, holder_pid,
    pid_alive, work_tree_busy,
};
use crate::orchestrator::{Engine, Exit};
use crate::project::{Project, loop_workflow};
use loopd_exec::Subprocess;

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
    let taken = take(
        p,
        id,
        executor,
        exit_on_pause,
        &std::process::id().to_string(),
    )?;
    loopd_exec::procs::become_subreaper();
    // Signals are taken on a worker of their own, so that a wait for a full disk or a held lock
    // still sees one.
    let signals = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (tx, rx) = watch::channel(None);
    signals.spawn(forward_signals(tx, None));
    // The loop runs on this thread, which also waits for what it waits for: an executor's exit or
    // output wakes it directly, not through another thread.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let exit = taken.engine.run(id, rx).await;
        // The loop's last notifications go before the process does.
        crate::notify::settle().await;
        exit
    })
}

/// A loop taken by a daemon: its engine, and the locks that say so, held until it is dropped.
pub struct Taken {
    pub engine: Engine,
    _locks: Vec<Held>,
}

/// Takes a loop for a daemon whose lock text is `me` (`PID`, or `PID serve`): refuses what it
/// could not run (another daemon drives it, a bad action file or executor, untrusted project
/// files, missing programs, a work tree another loop runs in), restores a state file spoilt
/// since the last run from its backup, and takes the loop's locks. Blocking: up to 2 s for the
/// lock of a daemon that was just killed.
pub fn take(
    p: &Project,
    id: &str,
    executor: Option<String>,
    exit_on_pause: bool,
    me: &str,
) -> Result<Taken> {
    loopd_store::store::validate_id(id)?;
    // Before touching anything: another daemon may be driving this loop.
    if let Some(pid) = daemon_pid(&p.store, id)
        && pid_alive(pid)
    {
        return Err(already_driven(id, pid));
    }
    // A state file spoilt since the last run is restored from its backup before anything else.
    let restored = p.store.restore(id)?.map(|(reason, from)| {
        let message = format!(
            "{} was unusable ({reason}); restored from {from}",
            p.store.state_path(id).display()
        );
        tracing::warn!("loopd: {message}");
        message
    });
    let state = p.load(id)?;
    let (mut engine, work_tree) = build_for(p, &state, executor, exit_on_pause)?;
    preflight(p, id, &engine)?;
    engine.restored = restored;
    // The work tree first: a loop that cannot have it never looks driven, not even for a
    // moment (a `start` handing it to the service reads the daemon lock to tell).
    let mut locks = Vec::new();
    if !work_tree.own {
        locks.push(Held::work_tree(&p.store, id, &p.root, me)?);
    }
    locks.push(Held::daemon(&p.store, id, me)?);
    Ok(Taken {
        engine,
        _locks: locks,
    })
}

/// A daemon for a project's loops, with real subprocess executors; a bad action file or executor
/// is bad input.
pub fn build(
    p: &Project,
    workflow: &'static dyn loopd_core::workflow::Workflow,
    executor: Option<String>,
    exit_on_pause: bool,
) -> Result<Engine> {
    Engine::new(
        p.root.clone(),
        p.store.clone(),
        p.config.clone(),
        workflow,
        Box::new(Subprocess),
        executor,
        exit_on_pause,
    )
    .map_err(|e| crate::error::UsageError(format!("{e:#}")).into())
}

/// A repeat of a signal that comes before the daemon acted on the first, and within this long of
/// it, is the same request: `timeout` and a terminal signal the process and then its group, a
/// burst of two. A person's second Ctrl-C comes after the daemon began ending the attempt.
const SAME_REQUEST: Duration = Duration::from_millis(200);
/// How long an escalated shutdown may take to record the attempt before the process exits anyway.
const ESCALATED_EXIT: Duration = Duration::from_secs(2);

/// SIGINT and SIGTERM ask the daemon to stop (the attempt in flight is ended and recorded). A
/// second one, coming after the first was acted on, escalates: the attempt's processes are
/// SIGKILLed at once, the attempt is still recorded, and the process exits within
/// `ESCALATED_EXIT` whatever happens. SIGHUP is sent on `hangup` when given (the service
/// reloads its configuration), else ignored: a daemon outlives its terminal.
pub async fn forward_signals(
    tx: watch::Sender<Option<i32>>,
    hangup: Option<tokio::sync::mpsc::UnboundedSender<()>>,
) {
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::warn!("warning: cannot install signal handlers");
        return;
    };
    // When the first signal came, and how many attempt endings had begun by then.
    let mut first: Option<(Instant, u64)> = None;
    loop {
        let sig = tokio::select! {
            _ = int.recv() => Signal::SIGINT as i32,
            _ = term.recv() => Signal::SIGTERM as i32,
            _ = hup.recv() => {
                if let Some(hangup) = &hangup {
                    let _ = hangup.send(());
                }
                continue;
            }
        };
        match first {
            None => {
                first = Some((Instant::now(), loopd_exec::procs::endings()));
                tracing::info!("signal {sig}: ending the action in flight, then exiting");
                let _ = tx.send(Some(sig));
            }
            Some((at, endings))
                if at.elapsed() < SAME_REQUEST && loopd_exec::procs::endings() == endings => {}
            Some(_) => {
                tracing::warn!("warning: second signal {sig}: ending the action's processes now");
                loopd_exec::procs::kill_running_groups();
                std::thread::spawn(move || {
                    std::thread::sleep(ESCALATED_EXIT);
                    std::process::exit(128 + sig);
                });
            }
        }
    }
}

/// Refuses a loop that would run in the project root while another loop runs there.
fn check_work_tree_free(
    p: &Project,
    state: &LoopState,
    work_tree: &crate::worktree::WorkTree,
) -> Result<()> {
    if work_tree.own {
        return Ok(());
    }
    match holder(&p.store, WORK_TREE_LOCK) {
        Some(text) if text.split_whitespace().nth(1) != Some(state.loop_id.as_str()) => {
            if pid_alive(holder_pid(&text)) {
                return Err(work_tree_busy(&state.loop_id, &p.root, &text));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Refuses now, where the user sees it, what a daemon would refuse at its start: a bad action
/// file or executor, project files that are not trusted, programs that are not installed, and,
/// when no service runs that would queue it, a work tree another loop runs in.
pub fn check_runnable(p: &Project, state: &LoopState, executor: Option<&str>) -> Result<()> {
    let (daemon, work_tree) = build_for(p, state, executor.map(str::to_owned), false)?;
    preflight(p, &state.loop_id, &daemon)?;
    if service_for(p).is_some() {
        return Ok(());
    }
    check_work_tree_free(p, state, &work_tree)
}

/// The running service that drives this project's loops for `start` and `resume`: none when
/// the command names a config file of its own, which the service does not know.
pub fn service_for(p: &Project) -> Option<crate::service::ServiceInfo> {
    match p.config_flag {
        Some(_) => None,
        None => crate::service::running(),
    }
}

/// A daemon for one loop: its workflow's, running its actions in the loop's work tree.
fn build_for(
    p: &Project,
    state: &LoopState,
    executor: Option<String>,
    exit_on_pause: bool,
) -> Result<(Engine, crate::worktree::WorkTree)> {
    if let Some(name) = &executor {
        p.config
            .executor_named(name)
            .map_err(|reason| crate::error::usage(format!("--executor: {reason}")))?;
    }
    let work_tree = crate::worktree::of(p, state)?;
    let mut daemon = build(p, loop_workflow(p, state)?, executor, exit_on_pause)?;
    daemon.work_tree = work_tree.path.clone();
    Ok((daemon, work_tree))
}

/// The checks before a daemon starts: the project's files are trusted, and every program the
/// loop's actions run is there. A failure changes nothing: exit 2, one line per problem.
fn preflight(p: &Project, id: &str, daemon: &crate::orchestrator::Engine) -> Result<()> {
    loopd_project::trust::check(&p.root, &daemon.project_files())?;
    let problems = daemon.preflight();
    if problems.is_empty() {
        return Ok(());
    }
    Err(crate::error::usage(format!(
        "loop {id} cannot run here:\n  {}",
        problems.join("\n  ")
    )))
}

/// Starts a detached daemon for a loop; returns its pid once it holds the loop's daemon lock.
pub fn start(p: &Project, id: &str, executor: Option<&str>) -> Result<u32> {
    let state = p.load(id)?;
    if let Some(pid) = driving_daemon(&p.store, id) {
        return Err(already_driven(id, pid));
    }
    if state.status == Status::Completed {
        return Err(crate::error::usage(format!(
            "loop {id} is completed; nothing to start"
        )));
    }
    check_runnable(p, &state, executor)?;
    // A running service drives the loop rather than a process of its own.
    if let Some(service) = service_for(p) {
        return hand_over(p, &state, executor, &service);
    }
    let progress = p.store.progress(id)?;
    let log_path = progress.join("daemon.log");
    let log = progress.append("daemon.log")?;
    let exe = std::env::current_exe().context("cannot find the loopd binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--root").arg(&p.root);
    if let Some(c) = &p.config_flag {
        cmd.arg("--config").arg(c);
    }
    cmd.args(["run", id]);
    if let Some(e) = executor {
        cmd.args(["--executor", e]);
    }
    // Its own process group: the terminal's signals are not for it.
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0);
    let mut child = cmd.spawn().context("cannot start the daemon")?;
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if daemon_pid(&p.store, id) == Some(pid) {
            return Ok(pid);
        }
        if let Some(status) = child.try_wait()? {
            // Another `start` won the race: the same refusal as when it had won before.
            if let Some(other) = daemon_pid(&p.store, id) {
                return Err(already_driven(id, other));
            }
            let tail = std::fs::read_to_string(&log_path).unwrap_or_default();
            let last = tail.lines().last().unwrap_or("").to_owned();
            let message = format!(
                "the daemon exited at once ({status}); {}: {last}",
                log_path.display()
            );
            // What the daemon refused as bad input is bad input here too.
            return Err(match status.code() {
                Some(2) => crate::error::usage(message),
                _ => anyhow::anyhow!(message),
            });
        }
        if Instant::now() > deadline {
            bail!(
                "the daemon (pid {pid}) did not take the loop within 10s; see {}",
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `loopd start` (and `resume`) where a service runs: the loop is made `running` (from
/// `created`; the executor named remembered for it) and the service takes it. Returns the
/// service's pid once it drives the loop or queues it.
pub fn hand_over(
    p: &Project,
    state: &loopd_core::state::LoopState,
    executor: Option<&str>,
    service: &crate::service::ServiceInfo,
) -> Result<u32> {
    let id = state.loop_id.as_str();
    crate::registry::note(&p.root);
    p.store.update(id, true, |raw, current| {
        if let Some(name) = executor
            && let Some(skill) = raw
                .entry("skill_state")
                .or_insert_with(|| serde_json::json!({}))
                .as_object_mut()
        {
            skill.insert("executor".into(), name.into());
        }
        if current.status == Status::Created {
            raw.insert("status".into(), Status::Running.as_str().into());
        }
    })?;
    let key = crate::service::LoopKey {
        root: p.root.clone(),
        loop_id: id.to_owned(),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = p.load(id)?.status;
        if status != Status::Running {
            eprintln!(
                "loop {id} is {status}; the service (pid {}) drives it once it is resumed",
                service.pid
            );
            return Ok(service.pid);
        }
        if crate::locks::daemon_pid(&p.store, id) == Some(service.pid) {
            eprintln!("loop {id}: driven by the service (pid {})", service.pid);
            return Ok(service.pid);
        }
        let now = crate::service::running();
        if let Some(position) = now.as_ref().and_then(|s| s.queue_position(&key)) {
            eprintln!(
                "loop {id}: queued by the service (pid {}), position {position}",
                service.pid
            );
            return Ok(service.pid);
        }
        if let Some(behind) = now.as_ref().and_then(|s| s.waits_behind(&key)) {
            eprintln!(
                "loop {id}: queued by the service (pid {}) behind loop {behind}, which runs in \
                 its work tree; it runs once that one ends or pauses",
                service.pid
            );
            return Ok(service.pid);
        }
        if now.is_none() || Instant::now() > deadline {
            anyhow::bail!(
                "the service (pid {}) did not take loop {id} within 10s; see its log                  (`journalctl --user -u loopd`)",
                service.pid
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
