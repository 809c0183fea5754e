//! A batch: tasks developed at once (`parallel`), each attempt in a git work tree of its own (a
//! lane) at the loop's last checkpoint, then merged back into the loop's tree in task order.
//!
//! Theory of operation: the batch runs in rounds. A round spawns an attempt in every lane whose
//! task still wants one, records them all in flight (`skill_state.lanes`), arms the watcher to
//! end them all, and supervises them together: a pause, a stop or a signal cancels every one.
//! Each finished attempt is concluded as a lone one is (its history entry, its spending, its
//! checkpoint: a commit of its lane's tree, the child of the batch's base); a failed one is tried
//! again in the next round, after its backoff, as the action's retries allow. Once no lane wants
//! another attempt, the successes are merged into the loop's last checkpoint in task order with
//! git's three-way merge from the base (`git merge-tree`, nothing checked out), each merge a
//! checkpoint of its own; the loop's work tree is then moved to the last merge in one step (`git
//! read-tree -m -u`, which refuses to write over a change it does not know). A task whose result
//! conflicts with the tasks merged before it goes back to pending with the conflicting files in
//! its next prompt, and fails once its merges have used the action's retries. Only then are the
//! results applied to the state, in task order, as the lone action's are: whatever ends the batch
//! before that (a stop, a crash) leaves the tasks to be developed again, never half merged. The
//! lanes' work trees are removed when the batch ends, and by the next daemon's start after a
//! crash.
//!
//! A race is a batch of one task: a lane per racing executor, the same rounds, then the check
//! action in each lane that succeeded (a round of its own), and only the best lane merged; the
//! others stay as checkpoints.

use std::sync::{Arc, Mutex};

use futures_util::future::join_all;
use loopd_core::attempt::{AfterAttempt, Attempts, RetryPolicy};
use loopd_exec::checkpoint::Merge;
use loopd_exec::metrics::metrics;

use super::attempt::{Attempted, Done, Lane, Prepared};
use super::*;
use crate::worktree;

/// One task of a batch (or one executor's try of a raced task, or the check of it) and how it
/// stands.
struct Entry<'p> {
    dispatch: Dispatch,
    iteration: u64,
    lane: Arc<Lane>,
    how: How<'p>,
    attempts: Attempts,
    /// How its attempts ended, once they did.
    end: Option<AfterAttempt>,
    /// The pause before its next attempt, when it wants one.
    pause: Duration,
}

/// How the batch's action runs: its definition and plan.
#[derive(Clone, Copy)]
struct How<'a> {
    def: &'a loopd_project::actions::ActionDef,
    plan: &'a Plan,
}

impl<'p> Entry<'p> {
    fn new(
        dispatch: Dispatch,
        iteration: u64,
        lane: Arc<Lane>,
        how: How<'p>,
        policy: RetryPolicy,
    ) -> Self {
        Entry {
            dispatch,
            iteration,
            lane,
            how,
            attempts: Attempts::new(policy),
            end: None,
            pause: Duration::ZERO,
        }
    }

    fn step(&self) -> Step<'_> {
        Step {
            dispatch: &self.dispatch,
            plan: self.how.plan,
            def: self.how.def,
            iteration: self.iteration,
        }
    }

    /// Its attempt that started at `started_at`.
    fn done<'e>(&'e self, started_at: &'e str) -> Done<'e> {
        Done {
            dispatch: &self.dispatch,
            iteration: self.iteration,
            attempt: self.attempts.attempt,
            started_at,
            lane: Some(&self.lane),
        }
    }
}

/// An attempt of a round, spawned.
struct Spawned {
    entry: usize,
    files: super::attempt::AttemptFiles,
    started_at: String,
    pid: loopd_exec::Spawned,
}

impl LoopRun<'_> {
    /// The tasks to develop at once, `first` (the selection's) among them, when the loop's
    /// `parallel` allows more than one and more than one is ready; else none.
    pub(super) fn batch_of(&mut self, state: &LoopState, first: &Dispatch) -> Vec<Dispatch> {
        let config = &self.engine.config;
        let parallel = state.parallel_or(config.parallel);
        if parallel < 2 || state.mode() != loopd_core::state::Mode::Auto {
            return Vec::new();
        }
        if self.checkpoints.is_none() {
            self.no_trees_here(format!(
                "parallel is {parallel}, but the loop's tasks are developed one at a time"
            ));
            return Vec::new();
        }
        let left = state
            .max_iterations_or(config.max_iterations)
            .saturating_sub(state.current_iteration);
        let max = usize::try_from(parallel.min(left)).unwrap_or(usize::MAX);
        let wf = self.engine.workflow;
        let batch = wf.batch(state, first, max);
        if batch.len() < 2 { Vec::new() } else { batch }
    }

    /// Develops `batch`'s tasks at once, each in a lane, and merges them back; returns how the
    /// loop ends, if it does.
    pub(super) async fn run_batch(
        &mut self,
        mut state: LoopState,
        batch: Vec<Dispatch>,
    ) -> Result<Option<Exit>> {
        let engine = self.engine;
        let action = batch[0].action.clone();
        let (def, plan) = engine
            .plans
            .get(&action)
            .with_context(|| format!("no plan for action {action}"))?;
        let labels = vec![None; batch.len()];
        let (base, lanes) = match self.open_lanes(state.current_iteration, &labels) {
            Ok(opened) => opened,
            Err(e) => return self.one_at_a_time(state, &batch[0], e).await,
        };
        let how = How { def, plan };
        let policy = engine.config.retry_policy();
        let mut entries = Vec::new();
        for (k, (dispatch, lane)) in batch.into_iter().zip(lanes).enumerate() {
            self.begin(&mut state, &dispatch);
            let iteration = state.current_iteration + 1 + k as u64;
            entries.push(Entry::new(dispatch, iteration, lane, how, policy));
        }
        let tasks: Vec<String> = entries
            .iter()
            .filter_map(|e| e.dispatch.task_id.clone())
            .collect();
        self.events.emit(
            Event::new(name::BATCH_STARTED)
                .with("action", action.clone())
                .with("tasks", tasks)
                .with("base", base.clone()),
        );
        let ended = self.rounds(&mut state, &mut entries).await;
        let exit = match ended {
            Ok(None) => self.merge(state, entries, &base, plan).await,
            Ok(Some(interrupt)) => Ok(interrupt.exit()),
            Err(e) => Err(e),
        };
        blocking(|| self.remove_lanes());
        exit
    }

    /// The executors that race on `dispatch`'s task: the task's own, else the loop's, else the
    /// config's; none when fewer than two, outside auto mode, or without checkpoints.
    pub(super) fn racers(&mut self, state: &LoopState, dispatch: &Dispatch) -> Vec<String> {
        let engine = self.engine;
        if state.mode() != loopd_core::state::Mode::Auto {
            return Vec::new();
        }
        let loop_race = state.race.as_deref().unwrap_or(&engine.config.race);
        let racers = engine.workflow.racers(state, dispatch, loop_race);
        if racers.len() < 2 {
            return Vec::new();
        }
        if self.checkpoints.is_none() {
            self.no_trees_here(format!(
                "the loop's tasks are developed by one executor, not raced by {}",
                racers.join(", ")
            ));
            return Vec::new();
        }
        racers
    }

    /// Says once that what the loop asks for (`what`) cannot be had here: its tasks would need
    /// work trees of their own, and the loop has no git checkpoints.
    fn no_trees_here(&mut self, what: String) {
        if !std::mem::replace(&mut self.said_sequential, true) {
            self.events.emit(Event::new(name::WARNING).with(
                "message",
                format!(
                    "{what}: each task needs a git work tree of its own, and {} has no git \
                     checkpoints",
                    self.engine.work_tree.display()
                ),
            ));
        }
    }

    /// Each of `racers` develops `dispatch`'s task in a lane of its own; the check action runs
    /// on each tree that succeeded, and the best (the highest pass rate, then the smaller diff,
    /// then the first) is merged; the others stay as checkpoints. Returns how the loop ends, if
    /// it does.
    pub(super) async fn run_race(
        &mut self,
        mut state: LoopState,
        dispatch: Dispatch,
        racers: Vec<String>,
    ) -> Result<Option<Exit>> {
        let engine = self.engine;
        let (def, _) = engine
            .plans
            .get(&dispatch.action)
            .with_context(|| format!("no plan for action {}", dispatch.action))?;
        let plans = racers
            .iter()
            .map(|r| Plan::resolve(&engine.config, def, Some(r)))
            .collect::<Result<Vec<Plan>>>()?;
        let labels: Vec<Option<String>> = racers.iter().cloned().map(Some).collect();
        let (base, lanes) = match self.open_lanes(state.current_iteration, &labels) {
            Ok(opened) => opened,
            Err(e) => return self.one_at_a_time(state, &dispatch, e).await,
        };
        self.begin(&mut state, &dispatch);
        let iteration = state.current_iteration + 1;
        let policy = engine.config.retry_policy();
        let mut entries: Vec<Entry<'_>> = lanes
            .into_iter()
            .zip(&plans)
            .map(|(lane, plan)| {
                Entry::new(dispatch.clone(), iteration, lane, How { def, plan }, policy)
            })
            .collect();
        self.events.emit(
            Event::new(name::RACE_STARTED)
                .with("iteration", iteration)
                .with("task_id", dispatch.task_id.clone())
                .with("executors", racers.clone())
                .with("base", base.clone()),
        );
        let exit = match self.rounds(&mut state, &mut entries).await {
            Ok(None) => self.decide_race(state, entries, &base).await,
            Ok(Some(interrupt)) => Ok(interrupt.exit()),
            Err(e) => Err(e),
        };
        blocking(|| self.remove_lanes());
        exit
    }

    /// The check of a race's entries that succeeded, the choice, and the winner merged.
    async fn decide_race(
        &mut self,
        mut state: LoopState,
        mut entries: Vec<Entry<'_>>,
        base: &str,
    ) -> Result<Option<Exit>> {
        let engine = self.engine;
        let succeeded: Vec<usize> = (0..entries.len())
            .filter(|&i| {
                matches!(
                    entries[i].end,
                    Some(AfterAttempt::Finish(Finish::Success(_)))
                )
            })
            .collect();
        // Each tree that succeeded is checked, when there is a choice to make.
        let mut rates: Vec<Option<f64>> = vec![None; entries.len()];
        let check = engine
            .workflow
            .check_action()
            .and_then(|a| engine.plans.get(a));
        if let (Some((def, plan)), true) = (check, succeeded.len() > 1) {
            let policy = engine.config.retry_policy();
            let mut checks: Vec<Entry<'_>> = succeeded
                .iter()
                .map(|&i| {
                    let e = &entries[i];
                    let dispatch = Dispatch::new(&def.name);
                    Entry::new(
                        dispatch,
                        e.iteration,
                        e.lane.clone(),
                        How { def, plan },
                        policy,
                    )
                })
                .collect();
            if let Some(interrupt) = self.rounds(&mut state, &mut checks).await? {
                return Ok(interrupt.exit());
            }
            for (&i, check) in succeeded.iter().zip(&checks) {
                rates[i] = self.pass_rate_of(&state, check);
            }
        }
        let entrants: Vec<attempt_rules::Entrant> = entries
            .iter()
            .zip(&rates)
            .map(|(e, &pass_rate)| attempt_rules::Entrant {
                succeeded: matches!(e.end, Some(AfterAttempt::Finish(Finish::Success(_)))),
                pass_rate,
                change: lock(&e.lane.recorded)
                    .as_ref()
                    .map_or(u64::MAX, |c| c.insertions + c.deletions),
            })
            .collect();
        let winner = attempt_rules::race_winner(&entrants);
        let said: Vec<serde_json::Value> = entries
            .iter()
            .zip(&rates)
            .map(|(e, rate)| {
                let checkpoint = lock(&e.lane.recorded).clone();
                serde_json::json!({
                    "executor": e.how.plan.executor,
                    "outcome": match &e.end {
                        Some(AfterAttempt::Finish(Finish::Success(_))) => "success",
                        _ => "failed",
                    },
                    "pass_rate": rate,
                    "checkpoint": checkpoint,
                })
            })
            .collect();
        let dispatch = entries[0].dispatch.clone();
        self.events.emit(
            Event::new(name::RACE_DECIDED)
                .with("iteration", entries[0].iteration)
                .with("task_id", dispatch.task_id.clone())
                .with(
                    "winner",
                    winner.map(|w| entries[w].how.plan.executor.clone()),
                )
                .with("entries", said),
        );
        let Some(winner) = winner else {
            // None succeeded: the task ends as its first executor's attempts did.
            let first = entries.into_iter().next().expect("a race has entries");
            let plan = first.how.plan;
            return match first.end {
                Some(AfterAttempt::Block(message)) => self.block(state, &dispatch, plan, message),
                Some(AfterAttempt::Ask(question)) => self.ask(state, &dispatch, question),
                Some(AfterAttempt::Finish(finish)) => {
                    self.finish(state, &dispatch, first.iteration, finish)
                }
                _ => Ok(None),
            };
        };
        let plan = entries[winner].how.plan;
        self.merge(state, vec![entries.swap_remove(winner)], base, plan)
            .await
    }

    /// The pass rate a check's result gives its tree.
    fn pass_rate_of(&self, state: &LoopState, check: &Entry<'_>) -> Option<f64> {
        let Some(AfterAttempt::Finish(finish)) = &check.end else {
            return None;
        };
        let wf = self.engine.workflow;
        attempt_rules::pass_rate_of(wf, state, &check.dispatch, finish, &now_rfc3339())
    }

    /// The base of a batch (the loop's last checkpoint, recorded first when the tree changed
    /// since) and a lane at it for each of `labels`; nothing left behind when it fails.
    fn open_lanes(
        &mut self,
        iteration: u64,
        labels: &[Option<String>],
    ) -> Result<(String, Vec<Arc<Lane>>)> {
        let base_name = format!("{iteration}-base");
        // The tasks' work trees start at the base's copy in the repository.
        self.check_checkpoints();
        let recorder = self
            .checkpoints
            .as_mut()
            .context("a batch needs checkpoints")?;
        let base = blocking(|| recorder.base(&base_name))?;
        match blocking(|| self.make_lanes(labels, &base)) {
            Ok(lanes) => Ok((base, lanes)),
            Err(e) => {
                blocking(|| self.remove_lanes());
                Err(e)
            }
        }
    }

    /// A batch could not start (git could not record its base or make its work trees): says
    /// why, and develops the first task alone.
    async fn one_at_a_time(
        &mut self,
        state: LoopState,
        first: &Dispatch,
        why: anyhow::Error,
    ) -> Result<Option<Exit>> {
        self.events.emit(Event::new(name::WARNING).with(
            "message",
            format!("cannot develop tasks at once ({why:#}); developing one at a time"),
        ));
        self.run_action(state, first, None).await
    }

    /// A work tree at `base` for each of `labels`.
    fn make_lanes(&self, labels: &[Option<String>], base: &str) -> Result<Vec<Arc<Lane>>> {
        let engine = self.engine;
        let mut lanes = Vec::new();
        for (number, label) in (1..).zip(labels) {
            let path = worktree::add_lane(&engine.work_tree, &engine.store, self.id, number, base)?;
            let index = format!("lane-{number}");
            let repo = checkpoint::Repo::open(&path, engine.store.dir(), self.id, &index)
                .with_context(|| format!("git does not see {} as a work tree", path.display()))?;
            // Its files from the vault, never from what an action may have written in `.git`.
            repo.fill(base)?;
            lanes.push(Arc::new(Lane {
                number,
                path,
                repo,
                base: base.to_owned(),
                label: label.clone(),
                recorded: Mutex::new(None),
            }));
        }
        Ok(lanes)
    }

    /// Removes the lanes' work trees and indexes; returns how many trees there were.
    pub(super) fn remove_lanes(&self) -> usize {
        let engine = self.engine;
        let removed = worktree::remove_lanes(&engine.work_tree, &engine.store, self.id);
        checkpoint::forget_lane_indexes(engine.store.dir(), self.id);
        removed
    }

    /// Records checkpoint `name` of a lane's tree, the child of the batch's base; a warning if
    /// git fails.
    pub(super) fn lane_checkpoint(&mut self, lane: &Lane, name: &str) -> Option<Checkpoint> {
        let name = match &lane.label {
            Some(label) => format!("{name}-{label}"),
            None => name.to_owned(),
        };
        match lane.repo.record(&name, Some(&lane.base)) {
            Ok(checkpoint) => {
                *lock(&lane.recorded) = Some(checkpoint.clone());
                Some(checkpoint)
            }
            Err(e) => {
                self.events.emit(
                    Event::new(name::WARNING)
                        .with("message", format!("cannot record checkpoint {name}: {e:#}")),
                );
                None
            }
        }
    }

    /// The batch's rounds, until no lane wants another attempt; the interruption that ended
    /// them early, if one did.
    async fn rounds(
        &mut self,
        state: &mut LoopState,
        entries: &mut [Entry<'_>],
    ) -> Result<Option<Interrupt>> {
        loop {
            let first = entries
                .iter()
                .find(|e| e.end.is_none())
                .expect("a round has an entry");
            if let Some(interrupt) = self.wait_for_account(state, &first.step()).await? {
                return Ok(Some(interrupt));
            }
            if let Some(interrupt) = self.round(state, entries).await? {
                return Ok(Some(interrupt));
            }
            let pause = entries
                .iter()
                .filter(|e| e.end.is_none())
                .map(|e| e.pause)
                .max();
            let Some(pause) = pause else {
                return Ok(None);
            };
            if let Some(interrupt) = self.sleep_unless_interrupted(pause).await {
                return Ok(Some(interrupt));
            }
        }
    }

    /// One round: an attempt in each lane that wants one, all supervised together, each
    /// concluded; the interruption that ended them, if one did.
    async fn round(
        &mut self,
        state: &mut LoopState,
        entries: &mut [Entry<'_>],
    ) -> Result<Option<Interrupt>> {
        let (mut rx, stopped) = self.look_before_start();
        if stopped.is_some() {
            return Ok(stopped);
        }
        if !self.store().all_durable() {
            blocking(|| self.store().wait_durable());
        }
        let mut spawned = Vec::new();
        let mut running = Vec::new();
        let mut refused = None;
        let wanting = entries.iter().filter(|e| e.end.is_none()).count();
        for (i, entry) in entries.iter().enumerate().filter(|(_, e)| e.end.is_none()) {
            let attempt = entry.attempts.attempt;
            let Prepared { mut spec, files } =
                self.prepare(state, &entry.step(), attempt, Some(&entry.lane))?;
            // The loop's budget is theirs together: each spends its share at most.
            spec.budget = spec.budget.share(wanting);
            let started_at = now_rfc3339();
            match self.engine.executor.spawn(spec) {
                Ok(r) => {
                    spawned.push(Spawned {
                        entry: i,
                        files,
                        started_at,
                        pid: r.spawned(),
                    });
                    running.push(r);
                }
                Err(e) => {
                    refused = Some((i, started_at, e));
                    break;
                }
            }
        }
        let pids: Vec<loopd_exec::Spawned> = spawned.iter().map(|s| s.pid).collect();
        // From now on a stop or pause ends them all from the watcher's thread.
        let armed = self
            .watch
            .arm(move || pids.iter().fold(false, |any, p| p.terminate() | any));
        let cancel = CancellationToken::new();
        if let Some((i, started_at, e)) = refused {
            // One could not start: the others end, and it is told as a lone attempt's would be.
            cancel.cancel();
            join_all(running.into_iter().map(|r| {
                let cancel = cancel.clone();
                async move { r.supervise(cancel, &mut |_| {}).await }
            }))
            .await;
            drop(armed);
            let attempted = self
                .not_started(state, &entries[i].done(&started_at), e)
                .await?;
            return Ok(match attempted {
                Attempted::Done(verdict) => {
                    let entry = &mut entries[i];
                    entry.end = Some(entry.attempts.next(verdict, Utc::now()));
                    None
                }
                Attempted::Interrupted(interrupt) => Some(interrupt),
            });
        }
        self.record_lanes(state, entries, &spawned)?;
        for s in &spawned {
            let entry = &entries[s.entry];
            let plan = entry.how.plan;
            metrics().attempt_started(
                self.engine.workflow.name(),
                &entry.dispatch.action,
                &plan.executor,
            );
            self.events.emit(
                entry
                    .done(&s.started_at)
                    .event(name::ACTION_STARTED)
                    .with("executor", plan.executor.clone())
                    .with("pid", s.pid.pid)
                    .with("log", s.files.log_path.display().to_string()),
            );
        }
        for s in &spawned {
            s.files.stock(&self.progress);
        }
        let mut heard: Vec<Vec<loopd_exec::agent::Retry>> = vec![Vec::new(); running.len()];
        let (runs, mut interrupt) = {
            let all = join_all(running.into_iter().zip(heard.iter_mut()).map(|(r, told)| {
                let cancel = cancel.clone();
                async move {
                    let mut heard = |t: loopd_exec::agent::Told| {
                        if let loopd_exec::agent::Told::Retry(retry) = t {
                            told.push(retry);
                        }
                    };
                    r.supervise(cancel, &mut heard).await
                }
            }));
            let mut all = std::pin::pin!(all);
            let mut interrupt = None;
            loop {
                tokio::select! {
                    runs = &mut all => break (runs, interrupt),
                    _ = rx.changed(), if interrupt.is_none() => {
                        if !still_running(&rx) {
                            interrupt = Some(stopped_by(&rx));
                            cancel.cancel();
                        }
                    }
                    _ = self.shutdown.changed(), if interrupt.is_none() => {
                        if let Some(sig) = *self.shutdown.borrow() {
                            interrupt = Some(Interrupt::Shutdown(sig));
                            cancel.cancel();
                        }
                    }
                }
            }
        };
        let fired = armed.fired();
        drop(armed);
        if fired.is_some() || matches!(interrupt, Some(Interrupt::Control(_))) {
            self.stop_took();
        }
        if let Some(control) = &fired {
            interrupt.get_or_insert(Interrupt::Control(control.interruption()));
        }
        state.skill().lanes.clear();
        for ((s, run), told) in spawned.into_iter().zip(runs).zip(heard) {
            let done = entries[s.entry].done(&s.started_at);
            for retry in told {
                self.events.emit(done.retrying(retry));
            }
            let attempted = match run {
                Ok(mut run) => {
                    if fired.is_some()
                        && run.cut.is_none()
                        && !run.status.is_some_and(|s| s.success())
                    {
                        run.cut = Some(loopd_exec::Cut::Cancelled);
                    }
                    self.conclude(
                        state,
                        &done,
                        entries[s.entry].how.plan,
                        &s.files,
                        run,
                        interrupt.clone(),
                    )?
                }
                Err(e) => self.not_started(state, &done, e).await?,
            };
            let entry = &mut entries[s.entry];
            match attempted {
                Attempted::Done(verdict) => match entry.attempts.next(verdict, Utc::now()) {
                    AfterAttempt::Retry { pause } => entry.pause = pause,
                    AfterAttempt::WaitRateLimit { wait, message } => {
                        let attempt = entry.attempts.attempt;
                        self.hold_account(&entry.step(), attempt, wait, message);
                        // Its next attempt waits for the account, at the next round's start.
                        entry.pause = Duration::ZERO;
                    }
                    after => entry.end = Some(after),
                },
                Attempted::Interrupted(i) => {
                    interrupt.get_or_insert(i);
                }
            }
        }
        Ok(interrupt)
    }

    /// Writes the round's attempts in flight, as a lone attempt's is ([`LoopRun::record_in_flight`]).
    fn record_lanes(
        &mut self,
        state: &mut LoopState,
        entries: &[Entry<'_>],
        spawned: &[Spawned],
    ) -> Result<()> {
        state.skill().lanes = spawned
            .iter()
            .map(|s| {
                let log = s.files.log_path.file_name();
                entries[s.entry]
                    .done(&s.started_at)
                    .in_flight(s.pid, log.map(|n| n.to_string_lossy().into_owned()))
            })
            .collect();
        self.commit_in_flight(state, None)
    }

    /// Merges the batch's successes into the loop's tree in task order, moves the work tree
    /// there, then applies each task's outcome; returns how the loop ends, if it does.
    async fn merge(
        &mut self,
        mut state: LoopState,
        entries: Vec<Entry<'_>>,
        base: &str,
        plan: &Plan,
    ) -> Result<Option<Exit>> {
        let mut applied = Vec::new();
        let mut conflicts = Vec::new();
        let mut held = None;
        for entry in entries {
            match entry.end {
                Some(AfterAttempt::Finish(Finish::Success(ref result))) => {
                    match self.merge_one(&entry, base) {
                        Ok(merge) => applied.push((
                            entry.dispatch,
                            entry.iteration,
                            Finish::Success(result.clone()),
                            Some(merge),
                        )),
                        Err((why, files)) => {
                            conflicts.push((entry.dispatch, entry.iteration, why, files))
                        }
                    }
                }
                Some(AfterAttempt::Finish(failed)) => {
                    applied.push((entry.dispatch, entry.iteration, failed, None));
                }
                Some(AfterAttempt::Block(message)) => {
                    held.get_or_insert((entry.dispatch, Err(message)));
                }
                Some(AfterAttempt::Ask(question)) => {
                    held.get_or_insert((entry.dispatch, Ok(question)));
                }
                Some(AfterAttempt::Retry { .. } | AfterAttempt::WaitRateLimit { .. })
                | Some(AfterAttempt::Interrupted)
                | None => {}
            }
        }
        let recorder = self
            .checkpoints
            .as_mut()
            .context("a batch needs checkpoints")?;
        blocking(|| recorder.catch_up(base))
            .context("cannot write the merged tasks into the loop's work tree")?;
        for (dispatch, iteration, finish, merge) in applied {
            // What changed the loop's tree is the merge: a round's progress, as a lone
            // attempt's checkpoint is.
            loopd_core::no_progress::touched(&mut state, merge.as_ref());
            if let Some(exit) = self.finish(state, &dispatch, iteration, finish)? {
                return Ok(Some(exit));
            }
            state = self.refresh()?;
        }
        for (dispatch, iteration, why, files) in conflicts {
            state = self.merge_failed(state, &dispatch, iteration, why, files)?;
        }
        match held {
            Some((dispatch, Err(message))) => self.block(state, &dispatch, plan, message),
            Some((dispatch, Ok(question))) => self.ask(state, &dispatch, question),
            None => Ok(None),
        }
    }

    /// Merges one task's checkpoint into the loop's last, returning the merge's checkpoint; why
    /// not, with the files in conflict.
    fn merge_one(
        &mut self,
        entry: &Entry<'_>,
        base: &str,
    ) -> std::result::Result<Checkpoint, (String, Vec<String>)> {
        let task = entry.dispatch.task_id.clone();
        let Some(theirs) = lock(&entry.lane.recorded)
            .as_ref()
            .map(|c| c.commit.clone())
        else {
            return Err(("its work tree could not be recorded".to_owned(), Vec::new()));
        };
        let name = format!("{}-merge", entry.iteration);
        let recorder = self.checkpoints.as_mut().expect("a batch has checkpoints");
        match blocking(|| recorder.merge(&name, base, &theirs)) {
            Ok(Merge::Clean(checkpoint)) => {
                self.events.emit(
                    Event::new(name::MERGED)
                        .with("iteration", entry.iteration)
                        .with("task_id", task)
                        .with(
                            "checkpoint",
                            serde_json::to_value(&checkpoint).unwrap_or_default(),
                        ),
                );
                Ok(checkpoint)
            }
            Ok(Merge::Conflict(files)) => Err((checkpoint::conflict_reason(&files), files)),
            Err(e) => Err((format!("git could not merge it: {e:#}"), Vec::new())),
        }
    }

    /// A task's result could not be merged: it goes back to its agent with why, or fails once
    /// its merges used the action's retries.
    fn merge_failed(
        &mut self,
        mut state: LoopState,
        dispatch: &Dispatch,
        iteration: u64,
        why: String,
        files: Vec<String>,
    ) -> Result<LoopState> {
        let (said, failed) = attempt_rules::merge_failed(
            self.engine.workflow,
            &mut state,
            dispatch,
            iteration,
            &why,
            self.engine.config.action_retries,
            &now_rfc3339(),
        );
        let state = Arc::unwrap_or_clone(self.commit(&state, None, None, true)?);
        self.events.emit(
            Event::new(name::MERGE_CONFLICT)
                .with("iteration", iteration)
                .with("task_id", dispatch.task_id.clone())
                .with("files", files)
                .with("failed", failed)
                .with("error", said),
        );
        Ok(state)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
