//! One attempt, as a small state machine: prepared (its files' names, its prompt and
//! environment), spawned, recorded in flight, supervised (while the watcher may end it), and
//! concluded (its result read and checked); or not started at all.

use std::sync::Mutex;

use loopd_exec::metrics::metrics;
use loopd_exec::result::{RESULT_FILE, empty_result_file, stock_result_file};
use loopd_project::plan;

use super::*;

/// A work tree of a batch's own, where one task's attempts run ([`super::batch`]; an attempt
/// runs in one, or in the loop's work tree).
pub(super) struct Lane {
    /// Its place in the batch, from 1: its directory's and its result file's name.
    pub(super) number: usize,
    pub(super) path: PathBuf,
    pub(super) repo: checkpoint::Repo,
    /// The checkpoint it started at.
    pub(super) base: String,
    /// What tells its checkpoints apart from the other lanes' of the same iteration: a racing
    /// executor's name.
    pub(super) label: Option<String>,
    /// Its last attempt's checkpoint.
    pub(super) recorded: Mutex<Option<Checkpoint>>,
}

impl Lane {
    /// The result file of its attempts, in the loop's actions directory.
    pub(super) fn result_name(&self) -> String {
        format!("result-{}.json", self.number)
    }
}

/// An attempt ready to spawn, and where its files go.
pub(super) struct Prepared {
    pub(super) spec: Spec,
    pub(super) files: AttemptFiles,
}

/// Where an attempt's files are: its directory, its result file's name, its log.
pub(super) struct AttemptFiles {
    actions: loopd_fs::Dir,
    result_name: String,
    pub(super) log_path: PathBuf,
}

impl AttemptFiles {
    /// Readies, while the attempt runs, what the next attempt of its place takes: its log and its
    /// result file, emptied now rather than between two attempts.
    pub(super) fn stock(&self, progress: &Progress) {
        progress.stock_log();
        stock_result_file(&self.actions, &self.result_name);
    }
}

pub(super) enum Attempted {
    Done(Verdict),
    Interrupted(Interrupt),
}

/// Which attempt finished.
pub(super) struct Done<'a> {
    pub(super) dispatch: &'a Dispatch,
    pub(super) iteration: u64,
    pub(super) attempt: u32,
    pub(super) started_at: &'a str,
    /// The work tree of its own it ran in, one of a batch's; `None`: the loop's.
    pub(super) lane: Option<&'a Lane>,
}

impl Done<'_> {
    pub(super) fn event(&self, event: &str) -> Event {
        let event = Event::new(event)
            .with("iteration", self.iteration)
            .with("action", self.dispatch.action.clone())
            .with("attempt", self.attempt)
            .with("task_id", self.dispatch.task_id.clone());
        match self.lane {
            Some(lane) => event.with("lane", lane.number),
            None => event,
        }
    }

    /// The event of an agent's own retry of a request during the attempt.
    pub(super) fn retrying(&self, retry: loopd_exec::agent::Retry) -> Event {
        self.event(name::AGENT_RETRYING)
            .with("retry", retry.attempt)
            .with("max_retries", retry.max_retries)
            .with("status", retry.status)
            .with("delay_ms", retry.delay_ms)
            .with("error", retry.error)
    }

    /// The record of the attempt in flight, once `spawned`; `log`: its log's name.
    pub(super) fn in_flight(&self, spawned: loopd_exec::Spawned, log: Option<String>) -> InFlight {
        InFlight {
            action: self.dispatch.action.clone(),
            iteration: self.iteration,
            attempt: self.attempt,
            task_id: self.dispatch.task_id.clone(),
            started_at: self.started_at.to_owned(),
            pid: spawned.pid,
            pgid: spawned.pgid,
            proc_start: spawned.proc_start,
            daemon_pid: std::process::id(),
            log,
            extra: Default::default(),
        }
    }
}

/// The event that says how an attempt ended: `action_finished`, `action_failed` or
/// `action_interrupted`, with its process, time, outcome, spending and words.
pub(super) fn attempt_event(
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
                Some(Interrupt::Control(why)) => why.clone(),
                None => LEFT_RUNNING.to_owned(),
            },
        ),
    }
}

impl LoopRun<'_> {
    /// One attempt, as a small state machine: prepared (names, prompt, environment), spawned,
    /// recorded in flight (a failed write is handled before supervision starts), supervised
    /// against control changes and shutdown, then classified and recorded.
    pub(super) async fn attempt(
        &mut self,
        state: &mut LoopState,
        step: &Step<'_>,
        attempt: u32,
        consumed_choice: Option<String>,
    ) -> Result<Attempted> {
        let (mut rx, stopped) = self.look_before_start();
        if let Some(interrupt) = stopped {
            return Ok(Attempted::Interrupted(interrupt));
        }
        let Prepared { spec, files } = self.prepare(state, step, attempt, None)?;
        let started_at = now_rfc3339();
        let done = Done {
            dispatch: step.dispatch,
            iteration: step.iteration,
            attempt,
            started_at: &started_at,
            lane: None,
        };
        // Every finished action is durable before the next one starts: waited for once the
        // attempt is ready to start.
        let store = self.store();
        let mut durable = || {
            if !store.all_durable() {
                blocking(|| store.wait_durable());
            }
        };
        let running = match self.engine.executor.spawn_when(spec, &mut durable) {
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
        metrics().attempt_started(
            self.engine.workflow.name(),
            &step.dispatch.action,
            &step.plan.executor,
        );
        self.events.emit(
            done.event(name::ACTION_STARTED)
                .with("executor", step.plan.executor.clone())
                .with("pid", spawned.pid)
                .with("log", files.log_path.display().to_string()),
        );
        files.stock(&self.progress);
        let parked = self.park(state);
        let (run, mut interrupt) = self.supervise(running, &done, &mut rx).await;
        if let Some(written) = parked {
            state.skill_state.clone_from(&written.skill_state);
        }
        let fired = armed.fired();
        drop(armed);
        if fired.is_some() || matches!(interrupt, Some(Interrupt::Control(_))) {
            self.stop_took();
        }
        let run = match run {
            // The watcher ended the attempt for a controller before this task heard of it: an
            // interruption, unless the executor had finished with success first.
            Ok(mut run)
                if let Some(control) = fired
                    && run.cut.is_none()
                    && !run.status.is_some_and(|s| s.success()) =>
            {
                interrupt.get_or_insert(Interrupt::Control(control.interruption()));
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

    /// The watcher's looks, subscribed before the last look before an attempt starts, so that no
    /// control change can fall in between: one the watcher published is in its snapshot, one it
    /// has not yet will wake the receiver. With the interruption a stop the snapshot shows calls
    /// for, confirmed by the file (the snapshot may lag behind a resume).
    pub(super) fn look_before_start(
        &self,
    ) -> (watch::Receiver<Option<Snapshot>>, Option<Interrupt>) {
        let mut rx = self.watch.subscribe();
        rx.borrow_and_update();
        let stopped = match still_running(&rx) {
            true => None,
            false => self
                .store()
                .read_control(self.id)
                .filter(|c| c.status != Status::Running)
                .map(|control| Interrupt::Control(control.interruption())),
        };
        (rx, stopped)
    }

    /// The attempt's files' names, its prompt and its environment; in `lane`'s work tree when it
    /// is one of a batch.
    pub(super) fn prepare(
        &self,
        state: &LoopState,
        step: &Step<'_>,
        attempt: u32,
        lane: Option<&Lane>,
    ) -> Result<Prepared> {
        let engine = self.engine;
        let (id, store, dispatch) = (self.id, &engine.store, step.dispatch);
        let progress_dir = self.progress_dir.path();
        let actions = self
            .progress_dir
            .actions()
            .with_context(|| format!("cannot open {}/actions", progress_dir.display()))?;
        let seq = state.skill_state.as_ref().map_or(0, |s| s.seq);
        let stem = match lane {
            Some(lane) => format!(
                "{:04}-{}-{attempt}-lane{}",
                seq.saturating_add(1),
                dispatch.action,
                lane.number
            ),
            None => format!("{:04}-{}-{attempt}", seq.saturating_add(1), dispatch.action),
        };
        // One file per attempt: a rerun (after an interruption or a rate limit) gets its own.
        let stem = (1..)
            .map(|n| match n {
                1 => stem.clone(),
                n => format!("{stem}.{n}"),
            })
            .find(|s| !actions.exists(&format!("{s}.log")))
            .unwrap_or(stem);
        let result_name = lane.map_or_else(|| RESULT_FILE.to_owned(), Lane::result_name);
        let result_path = actions.join(&result_name);
        empty_result_file(&actions, &result_name);
        self.progress.reuse_log(&actions, &format!("{stem}.log"));
        let task = engine.workflow.task(state, dispatch);
        let tree = lane.map_or(engine.work_tree.as_path(), |l| l.path.as_path());
        let paths = Paths {
            root: tree,
            state_file: &store.state_path(id),
            progress_dir: &progress_dir,
            result_file: &result_path,
        };
        let max_iterations = state.max_iterations_or(engine.config.max_iterations);
        let prompt = plan::prompt(
            engine.workflow,
            max_iterations,
            state,
            step,
            attempt,
            &paths,
            task.clone(),
        );
        let env = plan::environment(id, step, attempt, &paths, task);
        let (tokens, cost_usd) = engine.limits().remaining(state);
        let spec = Spec {
            argv: step.plan.argv.clone(),
            prompt,
            prompt_mode: step.plan.prompt_mode,
            env,
            cwd: tree.to_owned(),
            state_dir: store.dir().to_owned(),
            supervision: step.plan.supervision,
            dir: actions.clone(),
            stem: stem.clone(),
            marker: procs::marker_name(&store.state_path(id)),
            agent: AgentStream::for_format(step.plan.format),
            budget: Budget { tokens, cost_usd },
            sandbox: step.plan.sandbox.clone(),
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
    pub(super) fn record_in_flight(
        &mut self,
        state: &mut LoopState,
        done: &Done<'_>,
        spawned: loopd_exec::Spawned,
        log: Option<String>,
        consumed_choice: Option<&str>,
    ) -> Result<()> {
        state.skill().in_flight = Some(done.in_flight(spawned, log));
        self.commit_in_flight(state, consumed_choice)
    }

    /// Writes what is in flight (see [`LoopRun::record_in_flight`]).
    pub(super) fn commit_in_flight(
        &mut self,
        state: &LoopState,
        consumed_choice: Option<&str>,
    ) -> Result<()> {
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

    /// Lets the working copy's `skill_state` go while the version just written holds the same
    /// (an executor may run for hours, with hundreds of loops in a service): the state is then
    /// held once, not twice. Returns that version, to take it back from when the attempt ends.
    fn park(&self, state: &mut LoopState) -> Option<Arc<LoopState>> {
        let written = self.ours.clone()?;
        (written.skill_state == state.skill_state).then(|| {
            state.skill_state = None;
            written
        })
    }

    /// Runs the attempt to its end, ending it early on a control change or a shutdown signal.
    pub(super) async fn supervise(
        &mut self,
        running: Box<dyn loopd_exec::Attempt>,
        done: &Done<'_>,
        rx: &mut watch::Receiver<Option<Snapshot>>,
    ) -> (std::io::Result<loopd_exec::Run>, Option<Interrupt>) {
        let cancel = CancellationToken::new();
        let events = &mut self.events;
        let mut told = |told: loopd_exec::agent::Told| {
            if let loopd_exec::agent::Told::Retry(retry) = told {
                events.emit(done.retrying(retry));
            }
        };
        let run = running.supervise(cancel.clone(), &mut told);
        tokio::pin!(run);
        let mut interrupt = None;
        let shutdown = &mut self.shutdown;
        loop {
            tokio::select! {
                run = &mut run => return (run, interrupt),
                _ = rx.changed(), if interrupt.is_none() => {
                    if !still_running(rx) {
                        interrupt = Some(stopped_by(rx));
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

    /// How long the pause or stop that ended an attempt took, from its write (when its writer
    /// stamped it, as loopd's commands do) to the executor gone: now.
    pub(super) fn stop_took(&self) {
        let at = self
            .store()
            .read_control(self.id)
            .and_then(|c| c.status_by?.at)
            .and_then(|at| chrono::DateTime::parse_from_rfc3339(&at).ok());
        if let Some(at) = at
            && let Ok(took) = (chrono::Utc::now() - at.to_utc()).to_std()
        {
            metrics().stopped(took);
        }
    }

    /// What the sandbox's proxy refused the attempt: an event for each host (with how many times,
    /// and the setting that would allow it), and the count in the state.
    fn network_refused(
        &mut self,
        state: &mut LoopState,
        done: &Done<'_>,
        plan: &Plan,
        refused: &[loopd_exec::sandbox::Refusal],
    ) {
        let mut hosts: Vec<(String, u16, &str, usize)> = Vec::new();
        for r in refused {
            match hosts
                .iter_mut()
                .find(|(h, p, _, _)| *h == r.host && *p == r.port)
            {
                Some(seen) => seen.3 += 1,
                None => hosts.push((r.host.clone(), r.port, &r.why, 1)),
            }
        }
        let action = &done.dispatch.action;
        for (host, port, why, count) in &hosts {
            let target = match host.contains(':') {
                true => format!("[{host}]:{port}"),
                false => format!("{host}:{port}"),
            };
            self.events.emit(
                done.event(name::NETWORK_REFUSED)
                    .with("host", host.clone())
                    .with("port", *port)
                    .with("count", *count)
                    .with(
                        "error",
                        format!(
                            "{why}; to allow it, add \"{target}\" to sandbox_network in \
                             [executors.{}] (or in [actions.{action}], for this action alone)",
                            plan.executor
                        ),
                    ),
            );
        }
        let refused: Vec<String> = refused
            .iter()
            .map(|r| format!("{}:{}", r.host, r.port))
            .collect();
        attempt_rules::network_refused(state, action, &refused, &now_rfc3339());
    }

    /// The executor could not start. No room for the attempt's files is the environment's
    /// fault: the daemon waits and tries again. A program that cannot start (missing, a working
    /// directory gone) blocks the loop: the environment's fault, not the task's.
    pub(super) async fn not_started(
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
                    .unwrap_or_else(|| Interrupt::Control("waited to start again".to_owned())),
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
    pub(super) fn conclude(
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
        let v = attempt_rules::checked(
            engine.workflow,
            &dispatch.action,
            verdict(plan.format, reported, &run),
        );
        let name = format!("{}-{}", done.iteration, dispatch.action);
        let checkpoint = match &v {
            Verdict::Interrupted => None,
            _ if !engine.workflow.changes_work_tree(&dispatch.action) => None,
            _ => match done.lane {
                Some(lane) => blocking(|| self.lane_checkpoint(lane, &name)),
                None if self.checkpoints.is_none() => None,
                None => blocking(|| self.checkpoint(&name)),
            },
        };
        if plan.sandbox.mode != loopd_exec::sandbox::Mode::Off {
            let lines = loopd_exec::sandbox::refusals(&run.output_tail);
            if !lines.is_empty() {
                self.events.emit(
                    done.event(name::SANDBOX_REFUSED)
                        .with(
                            "message",
                            format!(
                                "the sandbox ({}) refused something; see {}",
                                plan.sandbox.mode.name(),
                                log_path.display()
                            ),
                        )
                        .with("lines", lines),
                );
            }
        }
        self.network_refused(state, done, plan, &run.network_refused);
        let attempt = loopd_exec::metrics::Attempt {
            workflow: engine.workflow.name(),
            action: &dispatch.action,
            executor: &plan.executor,
            account: &plan.account,
        };
        metrics().attempt_finished(&attempt, v.outcome(), &run);
        let mut event = attempt_event(done, &v, &run, log_path, interrupt.as_ref());
        if let Some(c) = &checkpoint {
            event = event.with("checkpoint", serde_json::to_value(c).unwrap_or_default());
        }
        self.record(state, done, &v, run.agent.as_ref(), checkpoint)?;
        self.events.emit(event);
        Ok(match v {
            Verdict::Interrupted => Attempted::Interrupted(
                interrupt.unwrap_or_else(|| Interrupt::Control(LEFT_RUNNING.to_owned())),
            ),
            v => Attempted::Done(v),
        })
    }
}
