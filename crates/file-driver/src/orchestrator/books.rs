//! What a finished attempt leaves: the history entry, the totals and limits (the workflow's
//! `record_attempt` and `record_finish`), the loop's end, and the work tree's git checkpoint, with
//! a rollback when validation regresses.

use super::attempt::Done;
use super::*;

impl LoopRun<'_> {
    /// The loop's checkpoints, if they are on and its work tree is in a git repository; a
    /// warning if git fails.
    pub(super) fn start_checkpoints(&mut self) -> Option<checkpoint::Recorder> {
        let engine = self.engine;
        if engine.config.checkpoint == Checkpoints::Off {
            return None;
        }
        let repo =
            checkpoint::Repo::open(&engine.work_tree, self.store().dir(), self.id, "checkpoint");
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
    pub(super) fn guard_against_regression(&mut self, state: &mut LoopState, rate: f64) {
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

    /// Records checkpoint `name` of the work tree; a warning if git fails. First the copies of
    /// the loop's checkpoints in the repository are checked ([`checkpoint::Repo::check`]).
    pub(super) fn checkpoint(&mut self, name: &str) -> Option<Checkpoint> {
        self.check_checkpoints();
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

    /// Puts back the copies of the loop's checkpoints in the repository that an action moved or
    /// removed, each said (`tampered`); a warning if git fails.
    pub(super) fn check_checkpoints(&mut self) {
        let Some(recorder) = self.checkpoints.as_ref() else {
            return;
        };
        match recorder.repo().check() {
            Ok(tampered) => {
                for t in &tampered {
                    self.events.emit(crate::checkpoints::tampered_event(t));
                }
            }
            Err(e) => self.events.emit(Event::new(name::WARNING).with(
                "message",
                format!("cannot check the copies of the loop's checkpoints: {e:#}"),
            )),
        }
    }

    /// Records a finished attempt: in the history, its spending in the totals, and the in-flight
    /// record cleared. A success is written with its result, by [`LoopRun::finish`].
    pub(super) fn record(
        &mut self,
        state: &mut LoopState,
        done: &Done,
        v: &Verdict,
        agent: Option<&AgentStream>,
        checkpoint: Option<Checkpoint>,
    ) -> Result<()> {
        let finished_at = now_rfc3339();
        attempt_rules::record(
            state,
            attempt_rules::Attempted {
                dispatch: done.dispatch,
                iteration: done.iteration,
                attempt: done.attempt,
                started_at: done.started_at,
                finished_at: &finished_at,
                spent: agent.map(|a| (&a.usage, a.cost_usd)),
                checkpoint,
            },
            v,
        );
        match v {
            // Committed with the action's finish.
            Verdict::Success(_) => {}
            Verdict::Interrupted | Verdict::Blocked { .. } | Verdict::NeedsInput { .. } => {
                self.commit(state, None, None, true)?;
            }
            _ => {
                self.commit(state, None, None, false)?;
            }
        }
        Ok(())
    }

    /// Applies an action's final outcome, writes it durably, updates the progress files.
    pub(super) fn finish(
        &mut self,
        mut state: LoopState,
        dispatch: &Dispatch,
        iteration: u64,
        finish: Finish,
    ) -> Result<Option<Exit>> {
        let wf = self.engine.workflow;
        let inputs = self.inputs(dispatch)?;
        let now = inputs.now.clone();
        let end = attempt_rules::finish(wf, &mut state, dispatch, &finish, &inputs);
        let pass_rate = wf.pass_rate(&state, &dispatch.action);
        if let Some(rate) = pass_rate
            && self.engine.config.rollback_on_regression
            && self.checkpoints.is_some()
        {
            blocking(|| self.guard_against_regression(&mut state, rate));
        }
        let transition = end
            .as_ref()
            .map(|LoopEnd::Completed(_)| Transition::completion());
        let state = self.commit(&state, transition.as_ref(), None, true)?;
        // Now and then, not on every action: it lists the directory.
        if state.skill_state.as_ref().is_some_and(|s| s.seq % 50 == 0) {
            self.progress.prune_actions();
        }
        for note in wf.notes(&state, dispatch, &finish, &now) {
            self.progress.write(&note);
        }
        if let (Some(rate), Finish::Success(_)) = (pass_rate, &finish) {
            self.events.emit(
                Event::new(name::VALIDATED)
                    .with("iteration", iteration)
                    .with("action", dispatch.action.clone())
                    .with("pass_rate", rate),
            );
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
    pub(super) fn inputs(&mut self, dispatch: &Dispatch) -> Result<Inputs> {
        let engine = self.engine;
        // Whether a round changed a file: its checkpoint says, or without git (when no-progress
        // detection is on) a fingerprint of the tree's files.
        let tree = match &self.checkpoints {
            Some(_) => Tree::Checkpointed,
            None if engine.config.no_progress_rounds > 0
                && engine.workflow.counts_iteration(&dispatch.action) =>
            {
                let state_dir = engine.store.dir().to_owned();
                blocking(|| checkpoint::files_fingerprint(&engine.work_tree, &[&state_dir]))
                    .map_or(Tree::Unknown, Tree::Files)
            }
            None => Tree::Unknown,
        };
        let mut inputs = Inputs {
            now: now_rfc3339(),
            listed_tasks: Vec::new(),
            tree,
        };
        if self.engine.workflow.reads_task_list(&dispatch.action) {
            inputs.listed_tasks = self.read_tasks()?.tasks;
        }
        Ok(inputs)
    }

    /// The loop completed: `summary.md` and the `completed` event.
    pub(super) fn completed(&mut self, state: &LoopState, outcome: Outcome) -> Exit {
        let (text, sections) = self.engine.workflow.report(state);
        self.progress.summary(state, text.as_deref(), &sections);
        self.events.emit(
            Event::new(name::COMPLETED)
                .with("iteration", state.current_iteration)
                .with("outcome", outcome.as_str())
                .with("summary", text)
                .still(state.still()),
        );
        Exit::Completed(outcome)
    }
}
