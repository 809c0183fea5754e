//! One drive of a loop: its start (recovery of an attempt a dead daemon left, checkpoints), then
//! the selections: a fresh look at the status, the workflow's decision, the action, until the
//! loop ends, is paused with `--exit-on-pause`, or the daemon is told to stop.

use super::*;

impl LoopRun<'_> {
    pub(super) async fn drive(&mut self) -> Result<Exit> {
        self.start_up().await?;
        let mut paused = false;
        loop {
            if let Some(sig) = self.signalled() {
                return Ok(Exit::Signalled(sig));
            }
            let mut state = self.refresh()?;
            let was_paused = paused;
            match self.on_status(&state, &mut paused).await? {
                // A person resumed the loop: its rounds without progress count afresh.
                Next::Select if was_paused => loopd_core::no_progress::afresh(&mut state),
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
    pub(super) async fn start_up(&mut self) -> Result<()> {
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
        // The loop's progress as its last durable write left it, should another writer have put
        // back an older copy (even just now: a writer that takes no lock may undo a repair of
        // the file at once).
        let (loaded, repaired) = self.survive(|store| store.load_own(id))?;
        if let Some(reason) = &repaired {
            let (file, backup) = (self.store().state_path(id), self.store().backup_path(id));
            self.events.emit(Event::new(name::WARNING).with(
                "message",
                format!(
                    "{}: {reason}; they were taken from {}",
                    file.display(),
                    backup.display()
                ),
            ));
        }
        let mut state = LoopState::clone(&loaded);
        // A state a controller wrote may lack the workflow's fields (the CCW dashboard writes
        // none): they are written now, so that the daemon's copy is never ahead of the file's
        // without a write of its own.
        self.engine.workflow.init_part(state.skill());
        // Remembered, so that `loopd resume` restarts the loop with the same executor.
        state.skill().executor = self.engine.executor_override.clone();
        let unchanged = repaired.is_none() && state.skill_state == loaded.skill_state;
        self.ours = Some(loaded);
        if !unchanged {
            state = Arc::unwrap_or_clone(self.commit(&state, None, None, false)?);
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
    pub(super) async fn on_status(&mut self, state: &LoopState, paused: &mut bool) -> Result<Next> {
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
    pub(super) async fn act(
        &mut self,
        mut state: LoopState,
        decision: Decision,
    ) -> Result<Option<Exit>> {
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
                self.events.emit(
                    Event::new(name::FAILED)
                        .with("error", reason.clone())
                        .still(after.still()),
                );
                Ok(Some(Exit::Failed(reason)))
            }
            Decision::Pause(reason) => self.stall(state, reason),
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
                let racers = self.racers(&state, &dispatch);
                // A race's and a batch's futures are boxed: inline, their size (12 KiB for a
                // batch) would be every loop's for its whole life, in a service of hundreds.
                if !racers.is_empty() {
                    return Box::pin(self.run_race(state, dispatch, racers)).await;
                }
                let batch = self.batch_of(&state, &dispatch);
                if !batch.is_empty() {
                    return Box::pin(self.run_batch(state, batch)).await;
                }
                let consumed = state.next_action.clone();
                self.run_action(state, &dispatch, consumed).await
            }
        }
    }

    /// A status that is neither running nor paused: record the stop and say why.
    pub(super) fn stopped(&mut self, state: &LoopState) -> Result<Exit> {
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
    pub(super) async fn wait_for_change(&mut self, seen: &LoopState) -> Option<i32> {
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
    pub(super) async fn await_choice(
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
    pub(super) fn absorb_tasks(&mut self, state: &mut LoopState) -> Result<()> {
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
            // Tasks a person added: the rounds without progress count afresh.
            loopd_core::no_progress::afresh(state);
            *state = Arc::unwrap_or_clone(self.commit(state, None, None, true)?);
            self.events
                .emit(Event::new(name::TASKS_ADDED).with("count", joined));
        }
        Ok(())
    }

    /// The task list, its warnings told; the version read is then seen.
    pub(super) fn read_tasks(&mut self) -> Result<loopd_store::tasks::TaskList> {
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
    pub(super) async fn recover(&mut self, state: &mut LoopState) -> Result<()> {
        let skill = state.skill_state.as_mut();
        let flights: Vec<InFlight> = skill
            .map(|s| {
                s.in_flight
                    .take()
                    .into_iter()
                    .chain(s.lanes.drain(..))
                    .collect()
            })
            .unwrap_or_default();
        let ended = self
            .end_leftovers(flights.first().map_or("", |f| f.action.as_str()))
            .await;
        let trees = blocking(|| self.remove_lanes());
        if flights.is_empty() {
            if ended > 0 || trees > 0 {
                self.events.emit(Event::new(name::RECOVERED).with(
                    "message",
                    format!(
                        "ended {ended} executor process(es) and removed {trees} task work tree(s) \
                         of a daemon that died"
                    ),
                ));
            }
            return Ok(());
        }
        for flight in &flights {
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
        }
        state.skill().current_action = None;
        *state = Arc::unwrap_or_clone(self.commit(state, None, None, true)?);
        for flight in flights {
            let mut event = Event::new(name::RECOVERED)
                .with("action", flight.action)
                .with("iteration", flight.iteration)
                .with("attempt", flight.attempt)
                .with("task_id", flight.task_id)
                .with("pid", flight.pid)
                .with(
                    "message",
                    "an attempt of a daemon that died was in flight; recorded as interrupted",
                );
            if trees > 0 {
                event = event.with("work_trees_removed", trees);
            }
            self.events.emit(event);
        }
        Ok(())
    }

    /// Ends the processes a daemon that died left of this loop (see
    /// [`Executor::end_leftovers`]); returns how many.
    pub(super) async fn end_leftovers(&self, action: &str) -> usize {
        let grace = self
            .engine
            .plans
            .get(action)
            .map_or(Duration::from_secs(5), |(_, p)| p.supervision.kill_grace);
        let state_file = self.store().state_path(self.id);
        self.engine.executor.end_leftovers(&state_file, grace).await
    }
}
