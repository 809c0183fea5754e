//! The loop: read state → check → select → run the executor → apply → write → repeat.
//!
//! Theory of operation: an [`Engine`] holds what driving a loop needs (the workflow, its action
//! files resolved into plans, the executor); a [`LoopRun`] is one drive of one loop by it, and
//! owns its copy of the daemon's fields. Each selection starts from a fresh read of the state file, so a control field written by anyone (status,
//! limits, title, a choice in interactive mode) takes effect at the next selection; the daemon's
//! writes go through [`Store::commit`], which only ever replaces the daemon's own fields. While an
//! executor runs, the task `select!`s over it, the [`Watch`] of the state file and shutdown: a
//! status that is no longer `running` cancels the attempt at once, which ends its process group.
//!
//! An attempt is a small state machine: prepared (names, prompt, environment), spawned, recorded
//! in flight, supervised, concluded; an action's retries and rate-limit waits are states around
//! it ([`LoopRun::run_action`]).
//!
//! Durability: the attempt in flight is recorded right after the spawn (with its pid, process
//! group and start time) by an atomic write that is not made durable — it only matters if the
//! daemon dies while the machine lives on — and every finished action is committed durably (its
//! version recorded in the fdatasynced backup: [`loopd_store::store`]) before the next one
//! starts: the fdatasync runs on the backup thread while the next attempt is readied
//! ([`Store::defer_durability`]), and the spawn waits for it.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use chrono::{DateTime, Utc};
use loopd_core::state::{
    AwaitingChoice, BestValidation, Checkpoint, HistoryEntry, InFlight, LoopState, Status,
    format_ts,
};
use loopd_core::workflow::{
    self, Decision, Dispatch, Finish, Inputs, Limits, LoopEnd, Outcome, Workflow,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use loopd_exec::agent::{AgentStream, AttemptOutcome};
use loopd_exec::checkpoint;
use loopd_exec::result::{Verdict, verdict};
use loopd_exec::{Budget, Executor, Spec, procs};
use loopd_exec::{Format, PromptMode, Supervision};
use loopd_project::actions::ActionDef;
use loopd_project::config::{Checkpoints, Config, ExecutorConfig};
use loopd_store::events::{Event, EventLog, Progress, ProgressDir, name};
use loopd_store::now_rfc3339;
use loopd_store::store::{Store, StoreError, Transition};
use loopd_store::watch::{Snapshot, Watch};

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

/// Rate limits in a row after which an attempt counts as failed.
const MAX_RATE_LIMITS: u32 = 20;

/// How one action runs: its executor, resolved.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The executor's name, or `command: ...` for an action's own shell command.
    pub executor: String,
    pub argv: Vec<String>,
    pub prompt_mode: PromptMode,
    pub format: Format,
    pub env: Vec<(String, OsString)>,
    pub supervision: Supervision,
}

/// Everything a daemon needs to drive a loop: the engine of a [`LoopRun`].
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
    actions: BTreeMap<String, ActionDef>,
    plans: BTreeMap<String, Plan>,
}

/// What ended the wait for an attempt or a backoff.
enum Interrupt {
    Control,
    Shutdown(i32),
}

impl Interrupt {
    /// How the loop ends after it: a shutdown ends the daemon; a control change goes back to
    /// the main loop, which reads the new status.
    fn exit(self) -> Option<Exit> {
        match self {
            Interrupt::Control => None,
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

/// The action being run: what, how, and the iteration it counts for.
struct Step<'a> {
    dispatch: &'a Dispatch,
    plan: &'a Plan,
    def: &'a ActionDef,
    iteration: u64,
}

/// An attempt ready to spawn, and where its files go.
struct Prepared {
    spec: Spec,
    files: AttemptFiles,
}

/// Where an attempt's files are: its directory, its result file's name, its log.
struct AttemptFiles {
    actions: loopd_fs::Dir,
    result_name: String,
    log_path: PathBuf,
}

/// The paths a prompt names.
struct Paths<'a> {
    root: &'a Path,
    state_file: &'a Path,
    progress_dir: &'a Path,
    result_file: &'a Path,
}

/// The file each attempt of a loop may write its result to (`$LOOPD_RESULT_FILE`), in the loop's
/// `actions/`: one for all its attempts, emptied before each, so that no attempt costs a file
/// made and later removed (which on ext4 costs a search for a free inode).
const RESULT_FILE: &str = "result.json";

/// Empties the result file before an attempt, making it if it is missing; what is there that is
/// not a plain file (an executor's symlink) is removed first.
fn empty_result_file(actions: &loopd_fs::Dir) {
    let emptied = |dir: &loopd_fs::Dir| {
        let file = dir.open_rw(RESULT_FILE)?;
        match file.metadata()?.len() {
            0 => Ok(()),
            _ => file.set_len(0),
        }
    };
    if emptied(actions).is_err() {
        let _ = actions.remove(RESULT_FILE);
        let _ = emptied(actions);
    }
}

/// The pauses between the attempts of an action: `first`, doubled each time, `retries` of them.
struct Backoff {
    left: u32,
    next: Duration,
}

impl Backoff {
    fn new(retries: u32, first: Duration) -> Backoff {
        Backoff {
            left: retries,
            next: first,
        }
    }
}

impl Iterator for Backoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.left = self.left.checked_sub(1)?;
        let pause = self.next;
        self.next = self.next.saturating_mul(2);
        Some(pause)
    }
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
        let actions = loopd_project::actions::load(workflow.name(), workflow.actions(), &root)?;
        let mut plans = BTreeMap::new();
        for (name, def) in &actions {
            plans.insert(
                name.clone(),
                plan(&config, def, executor_override.as_deref())?,
            );
        }
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
            actions,
            plans,
        })
    }

    /// How each action would run, by action.
    pub fn plans(&self) -> &BTreeMap<String, Plan> {
        &self.plans
    }

    /// What would stop the loop's actions from running at all, one line each: an executor
    /// program that is not installed, an action command whose program is not found. An action
    /// left to the config's default executor says so.
    pub fn preflight(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for action in self.workflow.actions() {
            let Some(plan) = self.plans.get(*action) else {
                continue;
            };
            let Some(program) = plan_program(plan) else {
                continue;
            };
            let path = plan
                .env
                .iter()
                .find(|(k, _)| k == "PATH")
                .map(|(_, v)| v.clone())
                .or_else(|| std::env::var_os("PATH"));
            if loopd_exec::find_program_in(&program, &self.work_tree, path.as_deref()).is_some() {
                continue;
            }
            let what = match plan.executor.strip_prefix("command: ") {
                Some(command) => format!(
                    "{action}: `{program}` (of `{command}`) is not found; check [actions.{action}] command"
                ),
                None => {
                    let default = self.executor_override.is_none()
                        && self
                            .config
                            .actions
                            .get(*action)
                            .is_none_or(|a| a.executor.is_none())
                        && self.actions[*action].front.executor.is_none();
                    format!(
                        "{action}: executor {} needs `{program}`, which is not installed (not on PATH){}",
                        plan.executor,
                        if default {
                            "; it is the default executor: set `executor` in .loop/config.toml, \
                             or pass --executor"
                        } else {
                            ""
                        }
                    )
                }
            };
            problems.push(what);
        }
        problems
    }

    /// The project's own files this daemon loaded, which need `loopd trust` (see [`loopd_project::trust`]).
    pub fn project_files(&self) -> Vec<&loopd_project::project_file::ProjectFile> {
        self.config
            .project_file
            .iter()
            .chain(
                self.actions
                    .values()
                    .filter_map(|a| a.project_file.as_ref()),
            )
            .collect()
    }

    /// Where each action's definition comes from, by action.
    pub fn action_sources(&self) -> impl Iterator<Item = (&str, &str)> {
        self.actions
            .iter()
            .map(|(name, def)| (name.as_str(), def.source.as_str()))
    }

    fn limits(&self) -> Limits {
        self.config.limits()
    }

    /// Drives the loop until it ends. `shutdown` carries the signal number that asked to stop.
    pub async fn run(&self, id: &str, shutdown: watch::Receiver<Option<i32>>) -> Result<Exit> {
        let progress_dir = ProgressDir::new(&self.store, id);
        let mut events = EventLog::open(id, &progress_dir)
            .with_context(|| format!("cannot open the event log of {id}"))?;
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

/// The program a plan runs, for a check that it exists: the executor's program, or the first
/// word of an action's shell command when that is a plain program name (not a builtin, a
/// keyword, an assignment or anything the shell must interpret first).
fn plan_program(plan: &Plan) -> Option<String> {
    let Some(command) = plan.executor.strip_prefix("command: ") else {
        return plan.argv.first().cloned();
    };
    let word = command.split_whitespace().next()?;
    const SHELL_OWN: &[&str] = &[
        "cd", "exec", "if", "for", "while", "until", "case", "{", "(", "!", "[", "[[", "test",
        "true", "false", "echo", "printf", "set", "export", "unset", ".", "source", ":", "eval",
        "exit", "read", "command", "time", "env",
    ];
    let plain = word
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._-+/".contains(c));
    (plain && !SHELL_OWN.contains(&word)).then(|| word.to_owned())
}

/// Resolves the executor of an action: `--executor`, else `[actions.NAME]` (its `executor`, or
/// its own shell `command`), else the action file's front matter, else the config's `executor`.
fn plan(config: &Config, def: &ActionDef, override_: Option<&str>) -> Result<Plan> {
    let action_config = config.actions.get(&def.name);
    let shell = ExecutorConfig::default();
    let (name, executor, argv, format) =
        match (action_config.and_then(|a| a.command.clone()), override_) {
            (Some(command), None) => {
                // A validate command is a test command; any other reports like a `json` executor.
                let format = if def.name == "validate" {
                    Format::Test
                } else {
                    Format::Json
                };
                let argv = vec!["sh".into(), "-c".into(), command.clone()];
                (format!("command: {command}"), &shell, argv, format)
            }
            _ => {
                let name = override_
                    .map(str::to_owned)
                    .or_else(|| action_config.and_then(|a| a.executor.clone()))
                    .or_else(|| def.front.executor.clone())
                    .unwrap_or_else(|| config.executor.clone());
                let executor = config.executor_named(&name).map_err(|reason| {
                    anyhow::anyhow!("action {} ({}): {reason}", def.name, def.source)
                })?;
                (name, executor, executor.command.clone(), executor.format)
            }
        };
    Ok(Plan {
        executor: name,
        argv,
        prompt_mode: executor.prompt,
        format,
        env: executor
            .env
            .iter()
            .map(|(k, v)| (k.clone(), OsString::from(v)))
            .collect(),
        supervision: config.supervision(
            executor,
            action_config,
            (def.front.timeout, def.front.idle_timeout),
        ),
    })
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
    ) -> Result<LoopState> {
        let after = self.survive(|store| store.commit_with(state, transition, choice, durable))?;
        self.ours = Some(after.clone());
        Ok(LoopState::clone(&after))
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
    }

    async fn drive(&mut self) -> Result<Exit> {
        self.start_up().await?;
        let mut paused = false;
        loop {
            if let Some(sig) = self.signalled() {
                return Ok(Exit::Signalled(sig));
            }
            let mut state = self.refresh()?;
            match self.on_status(&state, &mut paused).await? {
                Next::Select => {}
                Next::Again => continue,
                Next::End(exit) => return Ok(exit),
            }
            self.absorb_tasks(&mut state)?;
            let decision = workflow::decide(self.engine.workflow, &state, self.engine.limits());
            if let Some(exit) = self.act(state, decision).await? {
                return Ok(exit);
            }
        }
    }

    /// Before the loop: what the start found (a restored file, temporary files, an attempt of a
    /// daemon that died), the executor remembered for `resume`, then `loop_started`.
    async fn start_up(&mut self) -> Result<()> {
        if let Some(message) = &self.engine.restored {
            self.events
                .emit(Event::new(name::RECOVERED).with("message", message.clone()));
        }
        let store = self.store();
        let swept = blocking(|| store.sweep_temp_files(self.id))?;
        if swept > 0 {
            self.events.emit(Event::new(name::WARNING).with(
                "message",
                format!("removed {swept} temporary file(s) left by an interrupted write"),
            ));
        }
        let id = self.id;
        let loaded = self.survive(|store| store.load_shared(id))?;
        let mut state = LoopState::clone(&loaded);
        // A state a controller wrote may lack the workflow's fields (the CCW dashboard writes
        // none): they are written now, so that the daemon's copy is never ahead of the file's
        // without a write of its own.
        self.engine.workflow.init_part(state.skill());
        // Remembered, so that `loopd resume` restarts the loop with the same executor.
        state.skill().executor = self.engine.executor_override.clone();
        let unchanged = state.skill_state == loaded.skill_state;
        self.ours = Some(loaded);
        if !unchanged {
            state = self.commit(&state, None, None, false)?;
        }
        self.recover(&mut state).await?;
        self.checkpoints = blocking(|| self.start_checkpoints());
        self.events.emit(
            Event::new(name::LOOP_STARTED)
                .with("iteration", state.current_iteration)
                .with("status", state.status.as_str())
                .with("title", state.title.clone()),
        );
        Ok(())
    }

    /// What the status says to do: select an action (running), look again (a loop started, a
    /// pause waited out), or end.
    async fn on_status(&mut self, state: &LoopState, paused: &mut bool) -> Result<Next> {
        match &state.status {
            Status::Running => {
                if std::mem::take(paused) {
                    self.events.emit(Event::new(name::RESUMED));
                }
                Ok(Next::Select)
            }
            Status::Created => {
                // A new loop, or one someone reset: start it.
                let start = Transition {
                    from: &[Status::Created],
                    to: Status::Running,
                    failure_reason: None,
                    completed_at: false,
                };
                self.commit(state, Some(&start), None, true)?;
                Ok(Next::Again)
            }
            Status::Paused => {
                if !std::mem::replace(paused, true) {
                    self.events.emit(Event::new(name::PAUSED));
                }
                if self.engine.exit_on_pause {
                    return Ok(Next::End(Exit::Paused));
                }
                Ok(match self.wait_for_change(state).await {
                    Some(sig) => Next::End(Exit::Signalled(sig)),
                    None => Next::Again,
                })
            }
            Status::Completed => {
                let outcome = state
                    .skill_state
                    .as_ref()
                    .and_then(|s| s.outcome.as_deref())
                    .and_then(Outcome::parse)
                    .unwrap_or(Outcome::Passed);
                Ok(Next::End(Exit::Completed(outcome)))
            }
            Status::Failed | Status::UserExit | Status::Other(_) => {
                Ok(Next::End(self.stopped(state)?))
            }
        }
    }

    /// Carries out a decision; returns how the loop ends, if it does.
    async fn act(&mut self, mut state: LoopState, decision: Decision) -> Result<Option<Exit>> {
        let signalled = |sig: Option<i32>| sig.map(Exit::Signalled);
        match decision {
            Decision::Abort(reason) => {
                // Marked as the daemon's own failure, which a later run reports as such.
                state.skill().outcome = Some("failed".into());
                let fail = Transition {
                    from: &[Status::Running],
                    to: Status::Failed,
                    failure_reason: Some(reason.clone()),
                    completed_at: false,
                };
                let after = self.commit(&state, Some(&fail), None, true)?;
                if after.status != Status::Failed {
                    return Ok(None); // someone changed the status meanwhile
                }
                self.events
                    .emit(Event::new(name::FAILED).with("error", reason.clone()));
                Ok(Some(Exit::Failed(reason)))
            }
            Decision::AwaitAnswer => Ok(signalled(self.wait_for_change(&state).await)),
            Decision::Wait {
                choices,
                suggested,
                refused,
            } => Ok(signalled(
                self.await_choice(state, choices, suggested, refused)
                    .await?,
            )),
            Decision::Run(dispatch) => {
                let consumed = state.next_action.clone();
                self.run_action(state, &dispatch, consumed).await
            }
        }
    }

    /// A status that is neither running nor paused: record the stop and say why.
    fn stopped(&mut self, state: &LoopState) -> Result<Exit> {
        let own_failure = state.status == Status::Failed
            && state
                .skill_state
                .as_ref()
                .and_then(|s| s.outcome.as_deref())
                == Some("failed");
        if own_failure {
            let reason = state.failure_reason.clone().unwrap_or_default();
            return Ok(Exit::Failed(reason));
        }
        let reason = match &state.status {
            Status::Other(s) => format!("unknown status {s:?}, treated as a stop"),
            _ => match &state.failure_reason {
                Some(r) => r.clone(),
                None => {
                    blocking(|| {
                        self.store().update(self.id, true, |raw, current| {
                            if current.failure_reason.is_none() {
                                raw.insert("failure_reason".into(), "stopped by user".into());
                            }
                        })
                    })?;
                    "stopped by user".to_owned()
                }
            },
        };
        self.events.emit(
            Event::new(name::STOPPED)
                .with("status", state.status.as_str())
                .with("error", reason.clone()),
        );
        Ok(Exit::Stopped(reason))
    }

    /// Waits without using CPU until a controller changes something `seen` was read with, or a
    /// signal arrives.
    async fn wait_for_change(&mut self, seen: &LoopState) -> Option<i32> {
        let mut rx = self.watch.subscribe();
        // A change published between reading `seen` and subscribing is not waited for.
        let moved_on = rx.borrow_and_update().as_ref().is_some_and(|s| {
            let c = &s.control;
            let answer = seen
                .skill_state
                .as_ref()
                .and_then(|k| k.question.as_ref())
                .and_then(|q| q.answer.as_deref());
            c.status != seen.status
                || c.next_action != seen.next_action
                || c.mode() != seen.mode()
                || c.answer() != answer
        });
        if moved_on {
            return None;
        }
        tokio::select! {
            _ = rx.changed() => None,
            _ = self.shutdown.changed() => self.signalled(),
        }
    }

    /// Interactive mode: record what the loop waits for, then wait for a change.
    async fn await_choice(
        &mut self,
        mut state: LoopState,
        choices: Vec<String>,
        suggested: Option<String>,
        refused: Option<String>,
    ) -> Result<Option<i32>> {
        if let Some(bad) = &refused {
            self.events.emit(Event::new(name::WARNING).with(
                "message",
                format!(
                    "refused choice {bad:?}: valid choices are {}",
                    choices.join(", ")
                ),
            ));
        }
        let skill = state.skill();
        let unchanged = skill
            .awaiting_choice
            .as_ref()
            .is_some_and(|a| a.choices == choices && a.suggested == suggested);
        if !unchanged || refused.is_some() {
            skill.awaiting_choice = Some(AwaitingChoice {
                since: now_rfc3339(),
                choices: choices.clone(),
                suggested: suggested.clone(),
            });
            self.commit(&state, None, refused.as_deref(), true)?;
            self.events.emit(
                Event::new(name::AWAITING_CHOICE)
                    .with("choices", choices.join(","))
                    .with("suggested", suggested),
            );
        }
        Ok(self.wait_for_change(&state).await)
    }

    /// Tasks added to the task list since the last look join the loop as `pending`. Whether
    /// the list changed is told by its files' stamps. Tasks of loopd's own record that CCW's file
    /// lost (a rewrite from an older copy) are written there again.
    fn absorb_tasks(&mut self, state: &mut LoopState) -> Result<()> {
        // Looked at now, not as the watcher last saw it: a task added by the action that just
        // ended (its event may still be on its way) joins before the next choice.
        let stamp = self.store().tasks_stamp(self.id);
        if stamp.is_empty() || Some(stamp) == self.tasks_seen {
            return Ok(());
        }
        let list = self.read_tasks()?;
        if list.unshared > 0 {
            let store = self.store();
            let shared = blocking(|| store.share_tasks(self.id))?;
            if shared > 0 {
                self.events.emit(Event::new(name::RECOVERED).with(
                    "message",
                    format!(
                        "{shared} task(s) of {}.tasks.jsonl were missing from {}/tasks.jsonl \
                         (another program rewrote it from an older copy, or an older loopd \
                         wrote only its own list); written there again",
                        self.id, self.id
                    ),
                ));
            }
        }
        let joined = self
            .engine
            .workflow
            .absorb_tasks(state, &list.tasks, &now_rfc3339());
        if joined > 0 {
            *state = self.commit(state, None, None, true)?;
            self.events
                .emit(Event::new(name::TASKS_ADDED).with("count", joined));
        }
        Ok(())
    }

    /// The task list, its warnings told; the version read is then seen.
    fn read_tasks(&mut self) -> Result<loopd_store::tasks::TaskList> {
        let list = self.store().read_tasks(self.id)?;
        for w in &list.warnings {
            self.events
                .emit(Event::new(name::WARNING).with("message", w.clone()));
        }
        self.tasks_seen = Some(list.stamp);
        Ok(list)
    }

    /// A daemon that died may have left an attempt in flight: end whatever is left of it (every
    /// process holding this loop's inherited marker or carrying its state file in its
    /// environment, wherever it moved; never a pid on the file's word alone) and record the
    /// attempt as interrupted.
    async fn recover(&mut self, state: &mut LoopState) -> Result<()> {
        let flight = state.skill_state.as_mut().and_then(|s| s.in_flight.take());
        let ended = self
            .end_leftovers(flight.as_ref().map_or("", |f| f.action.as_str()))
            .await;
        let Some(flight) = flight else {
            if ended > 0 {
                self.events.emit(Event::new(name::RECOVERED).with(
                    "message",
                    format!("ended {ended} executor process(es) of a daemon that died"),
                ));
            }
            return Ok(());
        };
        workflow::record_attempt(
            state,
            HistoryEntry {
                action: flight.action.clone(),
                iteration: flight.iteration,
                attempt: flight.attempt,
                task_id: flight.task_id.clone(),
                started_at: flight.started_at.clone(),
                finished_at: Some(now_rfc3339()),
                outcome: "interrupted".into(),
                error: Some(format!(
                    "daemon {} ended during the attempt",
                    flight.daemon_pid
                )),
                ..HistoryEntry::default()
            },
        );
        state.skill().current_action = None;
        *state = self.commit(state, None, None, true)?;
        self.events.emit(
            Event::new(name::RECOVERED)
                .with("action", flight.action)
                .with("iteration", flight.iteration)
                .with("attempt", flight.attempt)
                .with("pid", flight.pid)
                .with(
                    "message",
                    "an attempt of a daemon that died was in flight; recorded as interrupted",
                ),
        );
        Ok(())
    }

    /// Ends the processes a daemon that died left of this loop (see
    /// [`Executor::end_leftovers`]); returns how many.
    async fn end_leftovers(&self, action: &str) -> usize {
        let grace = self
            .engine
            .plans
            .get(action)
            .map_or(Duration::from_secs(5), |p| p.supervision.kill_grace);
        let state_file = self.store().state_path(self.id);
        self.engine.executor.end_leftovers(&state_file, grace).await
    }

    /// Runs one action with its retries; returns how the loop ends, if it does.
    ///
    /// The retries are states: after each attempt the verdict decides whether the action is
    /// done (a success, a block, a question), waits for a rate limit and tries the same attempt
    /// again, backs off and tries the next one ([`Backoff`]), or fails after its last.
    async fn run_action(
        &mut self,
        mut state: LoopState,
        dispatch: &Dispatch,
        consumed_choice: Option<String>,
    ) -> Result<Option<Exit>> {
        let engine = self.engine;
        let step = Step {
            dispatch,
            plan: engine
                .plans
                .get(&dispatch.action)
                .with_context(|| format!("no plan for action {}", dispatch.action))?,
            def: &engine.actions[&dispatch.action],
            iteration: state.current_iteration.saturating_add(u64::from(
                engine.workflow.counts_iteration(&dispatch.action),
            )),
        };
        self.begin(&mut state, dispatch);
        let mut backoff = Backoff::new(
            engine.config.action_retries,
            Duration::from_secs_f64(engine.config.retry_backoff),
        );
        let mut consumed_choice = consumed_choice;
        let mut attempt = 1;
        let mut rate_limited = 0;
        let last_error = loop {
            let attempted = self
                .attempt(&mut state, &step, attempt, consumed_choice.take())
                .await?;
            let verdict = match attempted {
                Attempted::Done(verdict) => verdict,
                Attempted::Interrupted(interrupt) => return Ok(interrupt.exit()),
            };
            let error = match verdict {
                Verdict::Success(result) => {
                    return self.finish(state, dispatch, step.iteration, Finish::Success(result));
                }
                Verdict::Blocked { message } => {
                    return self.block(state, dispatch, step.plan, message);
                }
                Verdict::NeedsInput { question } => return self.ask(state, dispatch, question),
                Verdict::Interrupted => unreachable!("handled as Attempted::Interrupted"),
                Verdict::RateLimited { until, message } if rate_limited < MAX_RATE_LIMITS => {
                    // Wait for the reset and try the same attempt again: not an error.
                    rate_limited += 1;
                    if let Some(interrupt) = self.rate_limited(&step, attempt, until, message).await
                    {
                        return Ok(interrupt.exit());
                    }
                    continue;
                }
                // An agent that says "rate limited" forever is failing.
                Verdict::RateLimited { message, .. } => {
                    format!("rate limited {rate_limited} times in a row: {message}")
                }
                // No retry can help.
                Verdict::Failed {
                    outcome: AttemptOutcome::BudgetExceeded,
                    message,
                } => break message,
                Verdict::Failed { message, .. } => message,
            };
            let Some(pause) = backoff.next() else {
                break error;
            };
            if let Some(interrupt) = self.sleep_unless_interrupted(pause).await {
                return Ok(interrupt.exit());
            }
            attempt += 1;
        };
        self.finish(state, dispatch, step.iteration, Finish::Failed(last_error))
    }

    /// Marks the state as an action starts: what runs, the workflow's own marks, and what no
    /// longer holds (a choice waited for, a block, how a previous run ended).
    fn begin(&mut self, state: &mut LoopState, dispatch: &Dispatch) {
        state.skill().current_action = Some(dispatch.action.clone());
        self.engine.workflow.begin(state, dispatch, &now_rfc3339());
        if let Some(q) = state.skill_state.as_ref().and_then(|s| s.question.as_ref())
            && let Some(answer) = &q.answer
        {
            self.events.emit(
                Event::new(name::ANSWERED)
                    .with("action", dispatch.action.clone())
                    .with("question", q.text.clone())
                    .with("answer", answer.clone()),
            );
        }
        let skill = state.skill();
        skill.awaiting_choice = None;
        skill.blocked = None;
        skill.outcome = None;
    }

    /// A rate limit: says so and waits for its reset (or the configured wait).
    async fn rate_limited(
        &mut self,
        step: &Step<'_>,
        attempt: u32,
        until: Option<DateTime<Utc>>,
        message: String,
    ) -> Option<Interrupt> {
        let wait = self.rate_limit_wait(until);
        self.events.emit(
            Event::new(name::RATE_LIMITED)
                .with("iteration", step.iteration)
                .with("action", step.dispatch.action.clone())
                .with("attempt", attempt)
                .with("until", format_ts(Utc::now() + wait))
                .with("message", message),
        );
        self.sleep_unless_interrupted(wait.to_std().unwrap_or_default())
            .await
    }

    /// The executor cannot run here: pause the loop (from `running` only) with the reason in
    /// `skill_state.blocked`, say once what to do, and let the main loop wait for a person. The
    /// attempt used no retry, counted no error and no iteration; it runs again on resume.
    fn block(
        &mut self,
        mut state: LoopState,
        dispatch: &Dispatch,
        plan: &Plan,
        reason: String,
    ) -> Result<Option<Exit>> {
        let hint = format!(
            "{}: {reason} — fix it, then `loopd resume {}`",
            plan.executor, self.id
        );
        state.skill().blocked = Some(loopd_core::state::Blocked {
            since: now_rfc3339(),
            action: dispatch.action.clone(),
            executor: plan.executor.clone(),
            reason,
        });
        let pause = Transition {
            from: &[Status::Running],
            to: Status::Paused,
            failure_reason: None,
            completed_at: false,
        };
        self.commit(&state, Some(&pause), None, true)?;
        self.events.emit(
            Event::new(name::BLOCKED)
                .with("action", dispatch.action.clone())
                .with("message", hint),
        );
        Ok(None)
    }

    /// The executor asks a person: keep the question in `skill_state.question`, say it once, and
    /// let the main loop wait for the answer. Like a block, the attempt used no retry, counted no
    /// error and no iteration; the action runs again once answered, its prompt with the answer.
    fn ask(
        &mut self,
        mut state: LoopState,
        dispatch: &Dispatch,
        question: String,
    ) -> Result<Option<Exit>> {
        self.engine.workflow.asked(&mut state, dispatch);
        state.skill().question = Some(loopd_core::state::Question {
            since: now_rfc3339(),
            action: dispatch.action.clone(),
            text: question.clone(),
            answer: None,
            answered_at: None,
        });
        self.commit(&state, None, None, true)?;
        self.events.emit(
            Event::new(name::AWAITING_ANSWER)
                .with("action", dispatch.action.clone())
                .with(
                    "message",
                    format!("{question} (answer with `loopd answer {} TEXT`)", self.id),
                )
                .with("question", question),
        );
        Ok(None)
    }

    /// How long to wait for a rate limit to reset: until the time the agent gave, else the
    /// configured wait; never longer than `rate_limit_max_wait`.
    fn rate_limit_wait(&self, until: Option<DateTime<Utc>>) -> chrono::Duration {
        let config = &self.engine.config;
        let max = chrono::Duration::milliseconds((config.rate_limit_max_wait * 1000.0) as i64);
        let wait = match until {
            Some(t) => t - Utc::now(),
            None => chrono::Duration::milliseconds((config.rate_limit_wait * 1000.0) as i64),
        };
        // A reset time already past still gets a moment, so a confused agent cannot spin.
        wait.clamp(
            chrono::Duration::seconds(1),
            max.max(chrono::Duration::seconds(1)),
        )
    }

    /// Sleeps, unless the status leaves `running` or a signal arrives first.
    async fn sleep_unless_interrupted(&mut self, duration: Duration) -> Option<Interrupt> {
        let mut rx = self.watch.subscribe();
        let sleep = tokio::time::sleep(duration);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                () = &mut sleep => return None,
                _ = rx.changed() => {
                    if !still_running(&rx) {
                        return Some(Interrupt::Control);
                    }
                }
                _ = self.shutdown.changed() => {
                    if let Some(sig) = self.signalled() {
                        return Some(Interrupt::Shutdown(sig));
                    }
                }
            }
        }
    }

    /// One attempt, as a small state machine: prepared (names, prompt, environment), spawned,
    /// recorded in flight (a failed write is handled before supervision starts), supervised
    /// against control changes and shutdown, then classified and recorded.
    async fn attempt(
        &mut self,
        state: &mut LoopState,
        step: &Step<'_>,
        attempt: u32,
        consumed_choice: Option<String>,
    ) -> Result<Attempted> {
        // Subscribed before the last look, so no control change can fall in between: one the
        // watcher published is in its snapshot, one it has not yet will wake `rx`. The file is
        // read only to confirm a stop the snapshot shows (it may lag behind a resume).
        let mut rx = self.watch.subscribe();
        rx.borrow_and_update();
        if !still_running(&rx)
            && self
                .store()
                .read_control(self.id)
                .is_some_and(|c| c.status != Status::Running)
        {
            return Ok(Attempted::Interrupted(Interrupt::Control));
        }
        let Prepared { spec, files } = self.prepare(state, step, attempt)?;
        let started_at = now_rfc3339();
        let done = Done {
            dispatch: step.dispatch,
            iteration: step.iteration,
            attempt,
            started_at: &started_at,
        };
        // Every finished action is durable before the next one starts.
        if !self.store().all_durable() {
            blocking(|| self.store().wait_durable());
        }
        let running = match self.engine.executor.spawn(spec) {
            Ok(running) => running,
            Err(e) => return self.not_started(state, &done, e).await,
        };
        let spawned = running.spawned();
        // From now on a stop or pause ends it from the watcher's thread.
        let armed = self.watch.arm(move || spawned.terminate());
        let log = files
            .log_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        if let Err(e) =
            self.record_in_flight(state, &done, spawned, log, consumed_choice.as_deref())
        {
            // Nothing may run that the state file does not know of: end it, then fail.
            let cancel = CancellationToken::new();
            cancel.cancel();
            let _ = running.supervise(cancel, &mut |_| {}).await;
            return Err(e);
        }
        self.events.emit(
            done.event(name::ACTION_STARTED)
                .with("executor", step.plan.executor.clone())
                .with("pid", spawned.pid)
                .with("log", files.log_path.display().to_string()),
        );
        self.progress.stock_log();
        let (run, mut interrupt) = self.supervise(running, &done, &mut rx).await;
        let fired = armed.fired();
        drop(armed);
        let run = match run {
            // The watcher ended the attempt for a controller before this task heard of it: an
            // interruption, unless the executor had finished with success first.
            Ok(mut run)
                if fired && run.cut.is_none() && !run.status.is_some_and(|s| s.success()) =>
            {
                interrupt.get_or_insert(Interrupt::Control);
                run.cut = Some(loopd_exec::Cut::Cancelled);
                run
            }
            Ok(run) => run,
            Err(e) => {
                state.skill().in_flight = None;
                return self.not_started(state, &done, e).await;
            }
        };
        self.conclude(state, &done, step.plan, &files, run, interrupt)
    }

    /// The attempt's files' names, its prompt and its environment.
    fn prepare(&self, state: &LoopState, step: &Step<'_>, attempt: u32) -> Result<Prepared> {
        let engine = self.engine;
        let (id, store, dispatch) = (self.id, &engine.store, step.dispatch);
        let progress_dir = self.progress_dir.path();
        let actions = self
            .progress_dir
            .actions()
            .with_context(|| format!("cannot open {}/actions", progress_dir.display()))?;
        let seq = state.skill_state.as_ref().map_or(0, |s| s.seq);
        let stem = format!("{:04}-{}-{attempt}", seq.saturating_add(1), dispatch.action);
        // One file per attempt: a rerun (after an interruption or a rate limit) gets its own.
        let stem = (1..)
            .map(|n| match n {
                1 => stem.clone(),
                n => format!("{stem}.{n}"),
            })
            .find(|s| !actions.exists(&format!("{s}.log")))
            .unwrap_or(stem);
        let result_name = RESULT_FILE.to_owned();
        let result_path = actions.join(&result_name);
        empty_result_file(&actions);
        self.progress.reuse_log(&actions, &format!("{stem}.log"));
        let task = engine.workflow.task(state, dispatch);
        let paths = Paths {
            root: &engine.work_tree,
            state_file: &store.state_path(id),
            progress_dir: &progress_dir,
            result_file: &result_path,
        };
        let prompt = prompt(engine, state, step, attempt, &paths, task.clone());
        let env = environment(id, step, attempt, &paths, task);
        let (tokens, cost_usd) = engine.limits().remaining(state);
        let spec = Spec {
            argv: step.plan.argv.clone(),
            prompt,
            prompt_mode: step.plan.prompt_mode,
            env,
            cwd: engine.work_tree.clone(),
            supervision: step.plan.supervision,
            dir: actions.clone(),
            stem: stem.clone(),
            marker: procs::marker_name(&store.state_path(id)),
            agent: AgentStream::for_format(step.plan.format),
            budget: Budget { tokens, cost_usd },
        };
        Ok(Prepared {
            spec,
            files: AttemptFiles {
                log_path: actions.join(&format!("{stem}.log")),
                actions,
                result_name,
            },
        })
    }

    /// Writes the attempt in flight, so that a daemon that dies leaves it to be cleaned up.
    /// Durable against a daemon crash (the rename); an fsync buys nothing here, since after a
    /// power loss no executor is left to clean up. A full disk only costs that record.
    fn record_in_flight(
        &mut self,
        state: &mut LoopState,
        done: &Done<'_>,
        spawned: loopd_exec::Spawned,
        log: Option<String>,
        consumed_choice: Option<&str>,
    ) -> Result<()> {
        state.skill().in_flight = Some(InFlight {
            action: done.dispatch.action.clone(),
            iteration: done.iteration,
            attempt: done.attempt,
            task_id: done.dispatch.task_id.clone(),
            started_at: done.started_at.to_owned(),
            pid: spawned.pid,
            pgid: spawned.pgid,
            proc_start: spawned.proc_start,
            daemon_pid: std::process::id(),
            log,
            extra: Default::default(),
        });
        match self
            .store()
            .commit_with(state, None, consumed_choice, false)
        {
            Ok(committed) => self.ours = Some(committed),
            Err(e) if e.is_transient() => self.events.emit(Event::new(name::WARNING).with(
                "message",
                format!("cannot record the attempt in flight: {e:#}"),
            )),
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// Runs the attempt to its end, ending it early on a control change or a shutdown signal.
    async fn supervise(
        &mut self,
        running: Box<dyn loopd_exec::Attempt>,
        done: &Done<'_>,
        rx: &mut watch::Receiver<Option<Snapshot>>,
    ) -> (std::io::Result<loopd_exec::Run>, Option<Interrupt>) {
        let cancel = CancellationToken::new();
        let events = &mut self.events;
        let mut retrying = |retry: loopd_exec::agent::Retry| {
            events.emit(
                done.event(name::AGENT_RETRYING)
                    .with("retry", retry.attempt)
                    .with("max_retries", retry.max_retries)
                    .with("status", retry.status)
                    .with("delay_ms", retry.delay_ms)
                    .with("error", retry.error),
            );
        };
        let run = running.supervise(cancel.clone(), &mut retrying);
        tokio::pin!(run);
        let mut interrupt = None;
        let shutdown = &mut self.shutdown;
        loop {
            tokio::select! {
                run = &mut run => return (run, interrupt),
                _ = rx.changed(), if interrupt.is_none() => {
                    if !still_running(rx) {
                        interrupt = Some(Interrupt::Control);
                        cancel.cancel();
                    }
                }
                _ = shutdown.changed(), if interrupt.is_none() => {
                    if let Some(sig) = *shutdown.borrow() {
                        interrupt = Some(Interrupt::Shutdown(sig));
                        cancel.cancel();
                    }
                }
            }
        }
    }

    /// The executor could not start. No room for the attempt's files is the environment's
    /// fault: the daemon waits and tries again. A program that cannot start (missing, a working
    /// directory gone) blocks the loop: the environment's fault, not the task's.
    async fn not_started(
        &mut self,
        state: &mut LoopState,
        done: &Done<'_>,
        e: std::io::Error,
    ) -> Result<Attempted> {
        if loopd_store::store::is_transient_io(&e) {
            self.events.emit(done.event(name::WARNING).with(
                "message",
                format!(
                    "cannot start the attempt: {e}; waiting {}s",
                    MAX_RETRY_PAUSE.as_secs()
                ),
            ));
            return Ok(Attempted::Interrupted(
                self.sleep_unless_interrupted(MAX_RETRY_PAUSE)
                    .await
                    .unwrap_or(Interrupt::Control),
            ));
        }
        let v = Verdict::Blocked {
            message: e.to_string(),
        };
        self.record(state, done, &v, None, None)?;
        self.events.emit(
            done.event(name::ACTION_FAILED)
                .with("outcome", v.outcome())
                .with("error", e.to_string()),
        );
        Ok(Attempted::Done(v))
    }

    /// Classifies a finished run, records it, and says it.
    fn conclude(
        &mut self,
        state: &mut LoopState,
        done: &Done<'_>,
        plan: &Plan,
        files: &AttemptFiles,
        run: loopd_exec::Run,
        interrupt: Option<Interrupt>,
    ) -> Result<Attempted> {
        let engine = self.engine;
        let dispatch = done.dispatch;
        let log_path = &files.log_path;
        let reported = loopd_exec::result::read_result_file(&files.actions, &files.result_name);
        let mut v = verdict(plan.format, reported, &run);
        if let Verdict::Success(result) = &v
            && let Err(reason) = engine.workflow.validate(&dispatch.action, result)
        {
            v = Verdict::Failed {
                outcome: AttemptOutcome::AgentError,
                message: format!("invalid result: {reason}"),
            };
        }
        let checkpoint = match &v {
            Verdict::Interrupted => None,
            _ if !engine.workflow.changes_work_tree(&dispatch.action) => None,
            _ if self.checkpoints.is_none() => None,
            _ => blocking(|| self.checkpoint(&format!("{}-{}", done.iteration, dispatch.action))),
        };
        let mut event = attempt_event(done, &v, &run, log_path, interrupt.as_ref());
        if let Some(c) = &checkpoint {
            event = event.with("checkpoint", serde_json::to_value(c).unwrap_or_default());
        }
        self.record(state, done, &v, run.agent.as_ref(), checkpoint)?;
        self.events.emit(event);
        Ok(match v {
            Verdict::Interrupted => Attempted::Interrupted(interrupt.unwrap_or(Interrupt::Control)),
            v => Attempted::Done(v),
        })
    }

    /// The loop's checkpoints, if they are on and its work tree is in a git repository; a
    /// warning if git fails.
    fn start_checkpoints(&mut self) -> Option<checkpoint::Recorder> {
        let engine = self.engine;
        if engine.config.checkpoint == Checkpoints::Off {
            return None;
        }
        let index = self.progress_dir.path().join("checkpoint.index");
        let repo = checkpoint::Repo::open(&engine.work_tree, self.store().dir(), index, self.id);
        let keep = usize::try_from(engine.config.checkpoint_keep).unwrap_or(usize::MAX);
        match checkpoint::Recorder::start(repo, keep) {
            Ok(recorder) => recorder,
            Err(e) => {
                self.events.emit(Event::new(name::WARNING).with(
                    "message",
                    format!(
                        "cannot record git checkpoints of {}: {e:#}",
                        engine.work_tree.display()
                    ),
                ));
                None
            }
        }
    }

    /// `rollback_on_regression`: a validation with pass rate `rate` better than (or as good as) the
    /// best so far becomes the best; a worse one puts the work tree back as it was at the best
    /// one's checkpoint, and the tasks done since are to be done again.
    fn guard_against_regression(&mut self, state: &mut LoopState, rate: f64) {
        let wf = self.engine.workflow;
        let Some(recorder) = self.checkpoints.as_mut() else {
            return;
        };
        let best = match state.skill().best_validation.take() {
            Some(best) if rate < best.pass_rate => best,
            _ => {
                state.skill().best_validation = Some(BestValidation {
                    pass_rate: rate,
                    checkpoint: recorder.last().to_owned(),
                    done_tasks: wf.done_tasks(state),
                    ..BestValidation::default()
                });
                return;
            }
        };
        let rolled = recorder.rollback(&best.checkpoint);
        state.skill().best_validation = Some(best.clone());
        let commit = match rolled {
            Ok(commit) => commit,
            Err(e) => {
                self.events.emit(Event::new(name::WARNING).with(
                    "message",
                    format!(
                        "the pass rate fell from {}% to {rate}%, but the work tree cannot be put back as it was at checkpoint {}: {e:#}",
                        best.pass_rate, best.checkpoint
                    ),
                ));
                return;
            }
        };
        let note = format!(
            "the pass rate fell from {}% to {rate}% after the tasks done since checkpoint {}; the \
             work tree was put back as it was then, and those tasks are to be done again without \
             breaking what passed",
            best.pass_rate, best.checkpoint
        );
        let redone = wf.redo_after_rollback(state, &best.done_tasks, &note);
        self.events.emit(
            Event::new(name::ROLLED_BACK)
                .with("checkpoint", best.checkpoint.clone())
                .with("commit", commit)
                .with("reason", "regression")
                .with("best_pass_rate", best.pass_rate)
                .with("pass_rate", rate)
                .with("tasks", redone),
        );
    }

    /// Records checkpoint `name` of the work tree; a warning if git fails.
    fn checkpoint(&mut self, name: &str) -> Option<Checkpoint> {
        let result = self.checkpoints.as_mut()?.record(name);
        result
            .inspect_err(|e| {
                self.events.emit(
                    Event::new(name::WARNING)
                        .with("message", format!("cannot record checkpoint {name}: {e:#}")),
                );
            })
            .ok()
    }

    /// Records a finished attempt: in the history, its spending in the totals, and the in-flight
    /// record cleared. A success is written with its result, by [`LoopRun::finish`].
    fn record(
        &mut self,
        state: &mut LoopState,
        done: &Done,
        v: &Verdict,
        agent: Option<&AgentStream>,
        checkpoint: Option<Checkpoint>,
    ) -> Result<()> {
        let skill = state.skill();
        skill.in_flight = None;
        if let Some(agent) = agent {
            skill.usage.add(&agent.usage, agent.cost_usd);
        }
        let (summary, error) = match v {
            Verdict::Success(r) => ((!r.summary.is_empty()).then(|| r.summary.clone()), None),
            Verdict::Failed { message, .. }
            | Verdict::RateLimited { message, .. }
            | Verdict::Blocked { message } => (None, Some(message.clone())),
            Verdict::NeedsInput { question } => (Some(question.clone()), None),
            Verdict::Interrupted => (None, None),
        };
        workflow::record_attempt(
            state,
            HistoryEntry {
                action: done.dispatch.action.clone(),
                iteration: done.iteration,
                attempt: done.attempt,
                task_id: done.dispatch.task_id.clone(),
                started_at: done.started_at.to_owned(),
                finished_at: Some(now_rfc3339()),
                outcome: v.outcome().to_owned(),
                summary,
                error,
                checkpoint,
                ..HistoryEntry::default()
            },
        );
        match v {
            Verdict::Success(_) => {}
            Verdict::Interrupted | Verdict::Blocked { .. } | Verdict::NeedsInput { .. } => {
                // The attempt did not happen, as far as the workflow is concerned.
                state.skill().current_action = None;
                self.commit(state, None, None, true)?;
            }
            _ => {
                self.commit(state, None, None, false)?;
            }
        }
        Ok(())
    }

    /// Applies an action's final outcome, writes it durably, updates the progress files.
    fn finish(
        &mut self,
        mut state: LoopState,
        dispatch: &Dispatch,
        iteration: u64,
        finish: Finish,
    ) -> Result<Option<Exit>> {
        let wf = self.engine.workflow;
        let inputs = self.inputs(dispatch)?;
        let now = inputs.now.clone();
        let end = wf.apply(&mut state, dispatch, &finish, &inputs);
        workflow::record_finish(wf, &mut state, dispatch, &finish, &now);
        if let Some(rate) = wf.pass_rate(&state, &dispatch.action)
            && self.engine.config.rollback_on_regression
            && self.checkpoints.is_some()
        {
            blocking(|| self.guard_against_regression(&mut state, rate));
        }
        let transition = end.as_ref().map(|LoopEnd::Completed(_)| Transition {
            from: &[Status::Running],
            to: Status::Completed,
            failure_reason: None,
            completed_at: true,
        });
        let state = self.commit(&state, transition.as_ref(), None, true)?;
        // Now and then, not on every action: it lists the directory.
        if state.skill_state.as_ref().is_some_and(|s| s.seq % 50 == 0) {
            self.progress.prune_actions();
        }
        for note in wf.notes(&state, dispatch, &finish, &now) {
            self.progress.write(&note);
        }
        if let Finish::Failed(error) = &finish {
            let skill = state.skill_state.as_ref();
            self.events.emit(
                Event::new(name::WARNING)
                    .with("iteration", iteration)
                    .with("action", dispatch.action.clone())
                    .with(
                        "message",
                        format!(
                            "{} failed after its retries ({} of {} errors): {error}",
                            dispatch.action,
                            skill.map_or(0, |s| s.error_count),
                            state.max_errors_or(self.engine.config.max_errors)
                        ),
                    ),
            );
        }
        match end {
            Some(LoopEnd::Completed(outcome)) if state.status == Status::Completed => {
                Ok(Some(self.completed(&state, outcome)))
            }
            _ => Ok(None),
        }
    }

    /// What the workflow needs from outside to apply a result: the time, and where its rules
    /// take them, the tasks of the task list file (which are then seen).
    fn inputs(&mut self, dispatch: &Dispatch) -> Result<Inputs> {
        let mut inputs = Inputs {
            now: now_rfc3339(),
            listed_tasks: Vec::new(),
        };
        if self.engine.workflow.reads_task_list(&dispatch.action) {
            inputs.listed_tasks = self.read_tasks()?.tasks;
        }
        Ok(inputs)
    }

    /// The loop completed: `summary.md` and the `completed` event.
    fn completed(&mut self, state: &LoopState, outcome: Outcome) -> Exit {
        let (text, sections) = self.engine.workflow.report(state);
        self.progress.summary(state, text.as_deref(), &sections);
        self.events.emit(
            Event::new(name::COMPLETED)
                .with("iteration", state.current_iteration)
                .with("outcome", outcome.as_str())
                .with("summary", text),
        );
        Exit::Completed(outcome)
    }
}

enum Attempted {
    Done(Verdict),
    Interrupted(Interrupt),
}

/// Which attempt finished.
struct Done<'a> {
    dispatch: &'a Dispatch,
    iteration: u64,
    attempt: u32,
    started_at: &'a str,
}

impl Done<'_> {
    fn event(&self, event: &str) -> Event {
        Event::new(event)
            .with("iteration", self.iteration)
            .with("action", self.dispatch.action.clone())
            .with("attempt", self.attempt)
            .with("task_id", self.dispatch.task_id.clone())
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

/// The event that says how an attempt ended: `action_finished`, `action_failed` or
/// `action_interrupted`, with its process, time, outcome, spending and words.
fn attempt_event(
    done: &Done<'_>,
    v: &Verdict,
    run: &loopd_exec::Run,
    log_path: &Path,
    interrupt: Option<&Interrupt>,
) -> Event {
    let mut event = done
        .event(match v {
            Verdict::Success(_) => name::ACTION_FINISHED,
            Verdict::Interrupted | Verdict::NeedsInput { .. } => name::ACTION_INTERRUPTED,
            Verdict::Failed { .. } | Verdict::RateLimited { .. } | Verdict::Blocked { .. } => {
                name::ACTION_FAILED
            }
        })
        .with("pid", run.spawned.pid)
        .with("duration_ms", run.duration.as_millis() as u64)
        .with("exit_code", run.status.and_then(|s| s.code()))
        .with("outcome", v.outcome())
        .with("log", log_path.display().to_string());
    if let Some(agent) = &run.agent {
        event = event
            .with("tokens_in", agent.usage.input_tokens)
            .with("tokens_out", agent.usage.output_tokens)
            .with(
                "tokens_cached",
                agent.usage.cache_read_tokens + agent.usage.cache_write_tokens,
            )
            .with("cost_usd", agent.cost_usd);
    }
    match v {
        Verdict::Success(result) => event.with(
            "summary",
            (!result.summary.is_empty()).then(|| result.summary.clone()),
        ),
        Verdict::Failed { message, .. }
        | Verdict::RateLimited { message, .. }
        | Verdict::Blocked { message } => event.with("error", message.clone()),
        Verdict::NeedsInput { question } => event.with("question", question.clone()),
        Verdict::Interrupted => event.with(
            "message",
            match interrupt {
                Some(Interrupt::Shutdown(sig)) => format!("daemon received signal {sig}"),
                _ => "the loop's status left running".to_owned(),
            },
        ),
    }
}

/// An attempt's environment: the `LOOPD_*` variables, then the plan's own.
fn environment(
    id: &str,
    step: &Step<'_>,
    attempt: u32,
    paths: &Paths<'_>,
    task: Option<(String, String)>,
) -> Vec<(String, OsString)> {
    let mut env: Vec<(String, OsString)> = vec![
        ("LOOPD_LOOP_ID".into(), id.into()),
        ("LOOPD_ACTION".into(), step.dispatch.action.clone().into()),
        ("LOOPD_ITERATION".into(), step.iteration.to_string().into()),
        ("LOOPD_ATTEMPT".into(), attempt.to_string().into()),
        ("LOOPD_ROOT".into(), paths.root.into()),
        ("LOOPD_STATE_FILE".into(), paths.state_file.into()),
        ("LOOPD_PROGRESS_DIR".into(), paths.progress_dir.into()),
        ("LOOPD_RESULT_FILE".into(), paths.result_file.into()),
    ];
    if let Some((task_id, description)) = task {
        env.push(("LOOPD_TASK_ID".into(), task_id.into()));
        env.push(("LOOPD_TASK".into(), description.into()));
    }
    env.extend(step.plan.env.iter().cloned());
    env
}

/// An attempt's prompt: its action file rendered with the engine's values, the task's and the
/// workflow's, and, after a question, the question and its answer.
fn prompt(
    engine: &Engine,
    state: &LoopState,
    step: &Step<'_>,
    attempt: u32,
    paths: &Paths<'_>,
    task: Option<(String, String)>,
) -> String {
    let max_iterations = state.max_iterations_or(engine.config.max_iterations);
    let mut vars = template_vars(state, step, attempt, paths, max_iterations);
    let (task_id, task_description) = task.unwrap_or_default();
    vars.insert("task_id", task_id);
    vars.insert("task_description", task_description);
    vars.extend(engine.workflow.prompt_vars(state, step.dispatch));
    let mut prompt = step.def.render(&vars);
    if let Some(q) = state.skill_state.as_ref().and_then(|s| s.question.as_ref())
        && let Some(answer) = &q.answer
    {
        prompt.push_str(&format!(
            "\n\n## Your question, answered\n\nAn earlier {} asked:\n\n{}\n\nThe answer:\n\n{answer}\n",
            q.action, q.text
        ));
    }
    prompt
}

/// The engine's values of the template placeholders (see [`loopd_project::actions::PLACEHOLDERS`]).
fn template_vars(
    state: &LoopState,
    step: &Step<'_>,
    attempt: u32,
    paths: &Paths<'_>,
    max_iterations: u64,
) -> BTreeMap<&'static str, String> {
    let (dispatch, iteration) = (step.dispatch, step.iteration);
    let (errors, history) = state.skill_state.as_ref().map_or((&[][..], &[][..]), |s| {
        (&s.errors[..], &s.action_history[..])
    });
    let errors = if errors.is_empty() {
        "none".to_owned()
    } else {
        errors
            .iter()
            .map(|e| format!("- {} {}: {}", e.timestamp, e.action, e.message))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let previous = if history.is_empty() {
        "none".to_owned()
    } else {
        history
            .iter()
            .map(|h| {
                let detail = h.summary.as_deref().or(h.error.as_deref()).unwrap_or("");
                format!(
                    "- #{} {} attempt {}: {} {detail}",
                    h.iteration, h.action, h.attempt, h.outcome
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let path = |p: &Path| p.display().to_string();
    BTreeMap::from([
        ("loop_id", state.loop_id.clone()),
        ("title", state.title.clone()),
        ("description", state.description.clone()),
        ("action", dispatch.action.clone()),
        ("iteration", iteration.to_string()),
        ("max_iterations", max_iterations.to_string()),
        ("attempt", attempt.to_string()),
        ("root", path(paths.root)),
        ("state_file", path(paths.state_file)),
        ("progress_dir", path(paths.progress_dir)),
        ("result_file", path(paths.result_file)),
        ("errors", errors),
        ("previous", previous),
        (
            "outcome",
            dispatch
                .outcome
                .map(Outcome::as_str)
                .unwrap_or("")
                .to_owned(),
        ),
    ])
}
