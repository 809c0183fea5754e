//! The loop: read state → check → select → run the executor → apply → write → repeat.
//!
//! Theory of operation: an [`Engine`] holds what driving a loop needs (the workflow, its action
//! files resolved into plans, the executor); a `LoopRun` is one drive of one loop by it, and
//! owns its copy of the daemon's fields. Each selection starts from a fresh read of the state file, so a control field written by anyone (status,
//! limits, title, a choice in interactive mode) takes effect at the next selection; the daemon's
//! writes go through [`Store::commit`], which only ever replaces the daemon's own fields. While an
//! executor runs, the task `select!`s over it, the [`Watch`] of the state file and shutdown: a
//! status that is no longer `running` cancels the attempt at once, which ends its process group.
//!
//! An attempt is a small state machine: prepared (names, prompt, environment), spawned, recorded
//! in flight, supervised, concluded; an action's retries and rate-limit waits are states around
//! it (`LoopRun::run_action`).
//!
//! Durability: the attempt in flight is recorded right after the spawn (with its pid, process
//! group and start time) by an atomic write that is not made durable — it only matters if the
//! daemon dies while the machine lives on — and every finished action is committed durably (its
//! version recorded in the fdatasynced backup: [`loopd_store::store`]) before the next one
//! starts: the fdatasync runs on the backup thread while the next attempt is readied
//! ([`Store::defer_durability`]), and the spawn waits for it.
//!
//! The parts, a file each: the engine is here (its plans, prompts and environments come from
//! [`loopd_project::plan`], what an attempt does to the loop from [`loopd_core::attempt`]); `run`
//! is one drive of a loop (its start, the selections), `action` one action (attempts, backoff,
//! rate limits, blocks, questions), `attempt` one attempt (prepared, spawned, in flight,
//! supervised, concluded), and `books` what an attempt leaves (history, totals, the loop's end,
//! checkpoints).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use chrono::Utc;
use futures_util::FutureExt as _;
use futures_util::future::BoxFuture;
use loopd_core::state::{
    AwaitingChoice, BestValidation, Checkpoint, HistoryEntry, InFlight, LoopState, Status,
    format_ts,
};
use loopd_core::workflow::{
    self, Decision, Dispatch, Finish, Inputs, Limits, LoopEnd, Outcome, Tree, Workflow,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use loopd_core::attempt::{self as attempt_rules, Verdict};
use loopd_exec::agent::AgentStream;
use loopd_exec::checkpoint;
use loopd_exec::result::verdict;
use loopd_exec::{Budget, Executor, Spec, procs};
use loopd_project::config::{Checkpoints, Config};
use loopd_project::plan::{Paths, Plan, Plans, Step};
use loopd_store::events::{Event, EventLog, Progress, ProgressDir, name};
use loopd_store::now_rfc3339;
use loopd_store::store::{Store, StoreError, Transition};
use loopd_store::watch::{Snapshot, Watch};

use crate::notify::Notifier;

mod action;
mod attempt;
mod batch;
mod books;
mod run;

/// How a daemon's run of a loop ended; [`Exit::code`] is the process exit code (CONTRACT §7).
#[derive(Clone, Debug, PartialEq)]
pub enum Exit {
    Completed(Outcome),
    Failed(String),
    Stopped(String),
    Paused,
    /// SIGINT or SIGTERM to the daemon; the loop stays `running` for the next daemon.
    Signalled(i32),
}

impl Exit {
    /// One word for the event log: `passed`, `iteration_limit`, `incomplete`, `failed`,
    /// `stopped`, `paused` or `signal`.
    pub fn label(&self) -> &'static str {
        match self {
            Exit::Completed(outcome) => outcome.as_str(),
            Exit::Failed(_) => "failed",
            Exit::Stopped(_) => "stopped",
            Exit::Paused => "paused",
            Exit::Signalled(_) => "signal",
        }
    }

    pub fn code(&self) -> i32 {
        match self {
            Exit::Completed(Outcome::Passed) => 0,
            Exit::Completed(_) => 3,
            Exit::Failed(_) => 4,
            Exit::Stopped(_) => 5,
            Exit::Paused => 6,
            Exit::Signalled(sig) => 128 + sig,
        }
    }
}

/// The longest pause between tries of a write that failed for a reason that may go away.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(5);

/// Everything a daemon needs to drive a loop: the engine of a `LoopRun`.
pub struct Engine {
    pub root: PathBuf,
    /// Where the loop's actions run: the project root, or the loop's own git worktree.
    pub work_tree: PathBuf,
    pub store: Store,
    pub config: Config,
    pub workflow: &'static dyn Workflow,
    pub executor: Box<dyn Executor>,
    pub executor_override: Option<String>,
    pub exit_on_pause: bool,
    /// Set when the state file was restored from its backup before the start, saying why.
    pub restored: Option<String>,
    /// The rate limits of the executors' accounts, shared by a service's loops.
    pub accounts: crate::accounts::Accounts,
    plans: Plans,
}

/// What ended the wait for an attempt or a backoff.
#[derive(Clone)]
enum Interrupt {
    /// The status left `running`: why, and who set it.
    Control(String),
    Shutdown(i32),
}

impl Interrupt {
    /// How the loop ends after it: a shutdown ends the daemon; a control change goes back to
    /// the main loop, which reads the new status.
    fn exit(self) -> Option<Exit> {
        match self {
            Interrupt::Control(_) => None,
            Interrupt::Shutdown(sig) => Some(Exit::Signalled(sig)),
        }
    }
}

/// What the main loop does after looking at the status.
enum Next {
    Select,
    Again,
    End(Exit),
}

impl Engine {
    /// Loads the action files and resolves every action's executor, so that a bad name or file
    /// fails now, not in the middle of the loop.
    pub fn new(
        root: PathBuf,
        store: Store,
        config: Config,
        workflow: &'static dyn Workflow,
        executor: Box<dyn Executor>,
        executor_override: Option<String>,
        exit_on_pause: bool,
    ) -> Result<Engine> {
        let plans = Plans::load(&root, &config, workflow, executor_override.as_deref())?;
        Ok(Engine {
            work_tree: root.clone(),
            root,
            store,
            config,
            workflow,
            executor,
            executor_override,
            exit_on_pause,
            restored: None,
            accounts: Default::default(),
            plans,
        })
    }

    /// How each action would run, by action.
    pub fn plans(&self) -> &BTreeMap<String, Plan> {
        self.plans.plans()
    }

    /// What would stop the loop's actions from running at all, one line each (see
    /// [`Plans::preflight`]).
    pub fn preflight(&self) -> Vec<String> {
        self.plans.preflight(
            &self.work_tree,
            &self.config,
            self.executor_override.as_deref(),
        )
    }

    /// The project's own files this daemon loaded, which need `loopd trust`.
    pub fn project_files(&self) -> Vec<&loopd_project::project_file::ProjectFile> {
        self.plans.project_files(&self.config)
    }

    /// Where each action's definition comes from, by action.
    pub fn action_sources(&self) -> impl Iterator<Item = (&str, &str)> {
        self.plans.action_sources()
    }

    fn limits(&self) -> Limits {
        self.config.limits()
    }

    /// Drives the loop until it ends. `shutdown` carries the signal number that asked to stop.
    ///
    /// Boxed, so that the loop's code is compiled here only: a caller that awaited the future
    /// itself (the service's task for a loop) would compile all of it again.
    pub fn run<'a>(
        &'a self,
        id: &'a str,
        shutdown: watch::Receiver<Option<i32>>,
    ) -> BoxFuture<'a, Result<Exit>> {
        self.drive_loop(id, shutdown).boxed()
    }

    async fn drive_loop(&self, id: &str, shutdown: watch::Receiver<Option<i32>>) -> Result<Exit> {
        let progress_dir = ProgressDir::new(&self.store, id);
        let mut events = EventLog::open(id, &progress_dir)
            .with_context(|| format!("cannot open the event log of {id}"))?;
        Notifier::attach(&self.config.notify, &self.root, &mut events);
        let progress = Progress::new(&progress_dir);
        events.emit(
            Event::new(name::DAEMON_STARTED)
                .with("pid", std::process::id())
                .with("workflow", self.workflow.name())
                .with("executor", self.executor_override.clone()),
        );
        let mut turn = LoopRun {
            engine: self,
            id,
            events,
            progress,
            progress_dir,
            watch: Watch::start(&self.store, id),
            shutdown,
            tasks_seen: None,
            ours: None,
            checkpoints: None,
            said_sequential: false,
        };
        // The daemon's durable writes are made durable while it goes on (see `attempt`).
        self.store.defer_durability();
        let exit = turn.drive().await;
        blocking(|| self.store.wait_durable());
        let event = Event::new(name::DAEMON_EXITED).with("pid", std::process::id());
        turn.events.emit(match &exit {
            Ok(e) => event.with("exit_code", e.code()).with("outcome", e.label()),
            Err(e) => event
                .with("exit_code", crate::error::exit_code_of(e))
                .with("outcome", "error")
                .with("error", format!("{e:#}")),
        });
        exit
    }
}

/// One drive of one loop by an [`Engine`]: its events, progress files, watch, and its own copy
/// of the daemon's fields.
struct LoopRun<'a> {
    engine: &'a Engine,
    id: &'a str,
    events: EventLog,
    progress: Progress,
    progress_dir: ProgressDir,
    watch: Watch,
    shutdown: watch::Receiver<Option<i32>>,
    /// The task list files as last absorbed.
    tasks_seen: Option<loopd_store::tasks::TasksStamp>,
    /// The state as this daemon last wrote it: its own fields here are the truth, whatever
    /// another program writes back. (Shared with the store's memory of that version.)
    ours: Option<Arc<LoopState>>,
    /// The loop's git checkpoints, when its work tree is in a repository and they are on.
    checkpoints: Option<checkpoint::Recorder>,
    /// Whether it was said that the loop's `parallel` cannot be had here.
    said_sequential: bool,
}

impl LoopRun<'_> {
    fn store(&self) -> &Store {
        &self.engine.store
    }

    fn signalled(&self) -> Option<i32> {
        *self.shutdown.borrow()
    }

    /// Writes the daemon's fields of `state` (see [`Store::commit_with`]) and remembers them.
    fn commit(
        &mut self,
        state: &LoopState,
        transition: Option<&Transition>,
        choice: Option<&str>,
        durable: bool,
    ) -> Result<Arc<LoopState>> {
        let after = self.survive(|store| store.commit_with(state, transition, choice, durable))?;
        self.ours = Some(after.clone());
        Ok(after)
    }

    /// Runs a read or write of the state file until it succeeds, outliving what a service
    /// should: a full disk or a lock held by someone else (retried with a backoff, said once in
    /// the log, until it goes away or a signal comes), and a state file another program spoilt or
    /// deleted (the last good version is put back, what was there kept as `{id}.json.corrupt`).
    ///
    /// It blocks (a lock wait, a backoff): see [`blocking`].
    fn survive<T>(&mut self, op: impl Fn(&Store) -> Result<T, StoreError>) -> Result<T> {
        blocking(|| self.survive_blocking(op))
    }

    fn survive_blocking<T>(&mut self, op: impl Fn(&Store) -> Result<T, StoreError>) -> Result<T> {
        let mut pause = Duration::from_millis(50);
        let mut waiting = false;
        let mut put_back = false;
        loop {
            let error = match op(self.store()) {
                Ok(loaded) => {
                    if waiting {
                        self.events.emit(
                            Event::new(name::WARNING)
                                .with("message", "the state file can be written again; going on"),
                        );
                    }
                    return Ok(loaded);
                }
                Err(e) => e,
            };
            match &error {
                e if e.is_transient() && self.signalled().is_none() => {
                    if !waiting {
                        waiting = true;
                        self.events.emit(Event::new(name::WARNING).with(
                            "message",
                            format!(
                                "{e:#}; keeping the last good state and retrying until it goes away"
                            ),
                        ));
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(MAX_RETRY_PAUSE);
                }
                StoreError::Corrupt { .. } | StoreError::NotFound { .. } if !put_back => {
                    put_back = true;
                    if let Some(why) = self.store().put_back(self.id)? {
                        self.events.emit(Event::new(name::WARNING).with(
                            "message",
                            format!(
                                "{} was unusable ({why}); put back the last good version, kept what was there as {}.json.corrupt",
                                self.store().state_path(self.id).display(),
                                self.id
                            ),
                        ));
                    }
                }
                _ => return Err(error.into()),
            }
        }
    }

    /// The state as it is now: controllers' fields from the file, the daemon's fields from its own
    /// copy. A write by another program that put back stale daemon fields (a read-modify-write
    /// racing the daemon) is repaired at once, keeping that program's own changes.
    fn refresh(&mut self) -> Result<LoopState> {
        let id = self.id;
        let shared = self.survive(|store| store.load_shared(id))?;
        let loaded = LoopState::clone(&shared);
        let Some(ours) = &self.ours else {
            self.ours = Some(shared);
            return Ok(loaded);
        };
        let reverted = !Arc::ptr_eq(ours, &shared)
            && (loaded.current_iteration != ours.current_iteration
                || loaded.skill_state != ours.skill_state);
        if !reverted {
            return Ok(loaded);
        }
        let progress = |s: &LoopState| {
            serde_json::json!({
                "current_iteration": s.current_iteration,
                "skill_state": s.skill_state,
            })
        };
        let theirs = progress(&loaded);
        let mut mine = progress(ours);
        // Fields someone added that the daemon does not know are no revert: keep them.
        loopd_store::store::keep_unknown(&theirs, &mut mine);
        if mine == theirs {
            self.ours = Some(shared);
            return Ok(loaded);
        }
        let ours = ours.clone();
        let changes = loopd_core::state::differences(&mine, &theirs, 6);
        self.events.emit(Event::new(name::WARNING).with(
            "message",
            format!(
                "another program wrote back stale loop progress; repaired: {}",
                changes.join("; ")
            ),
        ));
        self.commit(&ours, None, None, true)
            .map(Arc::unwrap_or_clone)
    }
}

/// Runs blocking work of a loop (a write that waits for a lock or a full disk, an fdatasync, a
/// checkpoint). On a multi-threaded runtime (`loopd serve`'s) the worker is handed over meanwhile
/// ([`tokio::task::block_in_place`]), so that one loop waiting for its disk never stalls the
/// others; a runtime of one thread (`loopd run`'s) is the loop's alone, and the work runs right
/// there.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

fn still_running(rx: &watch::Receiver<Option<Snapshot>>) -> bool {
    rx.borrow()
        .as_ref()
        .is_none_or(|s| s.control.status == Status::Running)
}

/// Why an attempt was interrupted when nothing more is known.
const LEFT_RUNNING: &str = "the loop's status left running";

/// The interruption a stop or pause the watch published calls for, naming who wrote it.
fn stopped_by(rx: &watch::Receiver<Option<Snapshot>>) -> Interrupt {
    Interrupt::Control(
        rx.borrow()
            .as_ref()
            .map_or_else(|| LEFT_RUNNING.to_owned(), |s| s.control.interruption()),
    )
}
