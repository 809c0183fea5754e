//! One action: its attempts, with a backoff between failed ones; the waits around them (a rate
//! limit's reset), and what an attempt may ask for instead of a result (a block, a question).

use super::attempt::Attempted;
use loopd_core::attempt::AfterAttempt;
use loopd_core::state::RateLimitWait;
use loopd_core::still::Still;
use loopd_exec::metrics::metrics;

use super::*;

impl LoopRun<'_> {
    /// Runs one action with its retries; returns how the loop ends, if it does.
    ///
    /// The retries are states: after each attempt the verdict decides whether the action is
    /// done (a success, a block, a question), waits for a rate limit and tries the same attempt
    /// again, backs off and tries the next one ([`Backoff`]), or fails after its last.
    pub(super) async fn run_action(
        &mut self,
        mut state: LoopState,
        dispatch: &Dispatch,
        consumed_choice: Option<String>,
    ) -> Result<Option<Exit>> {
        let engine = self.engine;
        let (def, plan) = engine
            .plans
            .get(&dispatch.action)
            .with_context(|| format!("no plan for action {}", dispatch.action))?;
        let step = Step {
            dispatch,
            plan,
            def,
            iteration: state.current_iteration.saturating_add(u64::from(
                engine.workflow.counts_iteration(&dispatch.action),
            )),
        };
        self.begin(&mut state, dispatch);
        let mut attempts = attempt_rules::Attempts::new(self.engine.config.retry_policy());
        let mut consumed_choice = consumed_choice;
        loop {
            if let Some(interrupt) = self.wait_for_account(&mut state, &step).await? {
                return Ok(interrupt.exit());
            }
            let attempt = attempts.attempt;
            let attempted = self
                .attempt(&mut state, &step, attempt, consumed_choice.take())
                .await?;
            let verdict = match attempted {
                Attempted::Done(verdict) => verdict,
                Attempted::Interrupted(interrupt) => return Ok(interrupt.exit()),
            };
            let interrupt = match attempts.next(verdict, Utc::now()) {
                AfterAttempt::Finish(finish) => {
                    return self.finish(state, dispatch, step.iteration, finish);
                }
                AfterAttempt::Block(message) => {
                    return self.block(state, dispatch, step.plan, message);
                }
                AfterAttempt::Ask(question) => return self.ask(state, dispatch, question),
                AfterAttempt::Interrupted => unreachable!("handled as Attempted::Interrupted"),
                AfterAttempt::WaitRateLimit { wait, message } => {
                    self.rate_limited(&mut state, &step, attempt, wait, message)
                        .await?
                }
                AfterAttempt::Retry { pause } => self.sleep_unless_interrupted(pause).await,
            };
            if let Some(interrupt) = interrupt {
                return Ok(interrupt.exit());
            }
        }
    }

    /// Marks the state as an action starts: what runs, the workflow's own marks, and what no
    /// longer holds (a choice waited for, a block, how a previous run ended).
    pub(super) fn begin(&mut self, state: &mut LoopState, dispatch: &Dispatch) {
        let answered = attempt_rules::begin(self.engine.workflow, state, dispatch, &now_rfc3339());
        if let Some((question, answer)) = answered {
            self.events.emit(
                Event::new(name::ANSWERED)
                    .with("action", dispatch.action.clone())
                    .with("question", question)
                    .with("answer", answer),
            );
        }
    }

    /// A rate limit: holds the executor's account until its reset (or the configured wait),
    /// says so, and waits.
    pub(super) async fn rate_limited(
        &mut self,
        state: &mut LoopState,
        step: &Step<'_>,
        attempt: u32,
        wait: Duration,
        message: String,
    ) -> Result<Option<Interrupt>> {
        let until = self.hold_account(step, attempt, wait, message);
        self.wait_rate_limit(state, &step.plan.account, until).await
    }

    /// Holds the executor's account for `wait` (or until a later reset another loop of it
    /// saw), and says so; returns until when.
    pub(super) fn hold_account(
        &mut self,
        step: &Step<'_>,
        attempt: u32,
        wait: Duration,
        message: String,
    ) -> chrono::DateTime<Utc> {
        let account = &step.plan.account;
        let until = Utc::now() + chrono::Duration::from_std(wait).unwrap_or_default();
        let until = self.engine.accounts.hold(account, until);
        metrics().rate_limit_wait(&step.plan.executor, account);
        let until_ts = format_ts(until);
        self.events.emit(
            Event::new(name::RATE_LIMITED)
                .with("iteration", step.iteration)
                .with("action", step.dispatch.action.clone())
                .with("attempt", attempt)
                .with("task_id", step.dispatch.task_id.clone())
                .with("account", account.clone())
                .with("until", until_ts.clone())
                .with("message", message)
                .still(Some(Still::rate_limited(account, &until_ts))),
        );
        until
    }

    /// Another loop of the executor's account was rate limited: waits for the reset before
    /// starting an attempt that would be refused the same way.
    pub(super) async fn wait_for_account(
        &mut self,
        state: &mut LoopState,
        step: &Step<'_>,
    ) -> Result<Option<Interrupt>> {
        let account = &step.plan.account;
        while let Some(until) = self.engine.accounts.held(account, Utc::now()) {
            metrics().rate_limit_wait(&step.plan.executor, account);
            let until_ts = format_ts(until);
            self.events.emit(
                Event::new(name::RATE_LIMITED)
                    .with("iteration", step.iteration)
                    .with("action", step.dispatch.action.clone())
                    .with("account", account.clone())
                    .with("until", until_ts.clone())
                    .with(
                        "message",
                        format!("{account} is rate limited: no attempt before its reset"),
                    )
                    .still(Some(Still::rate_limited(account, &until_ts))),
            );
            if let Some(interrupt) = self.wait_rate_limit(state, account, until).await? {
                return Ok(Some(interrupt));
            }
        }
        Ok(None)
    }

    /// Waits until `until` for `account`'s rate limit to reset, unless the loop is paused or
    /// stopped first; the state says so meanwhile (`skill_state.rate_limit`).
    async fn wait_rate_limit(
        &mut self,
        state: &mut LoopState,
        account: &str,
        until: chrono::DateTime<Utc>,
    ) -> Result<Option<Interrupt>> {
        state.skill().rate_limit = Some(RateLimitWait {
            account: account.to_owned(),
            until: format_ts(until),
        });
        self.commit(state, None, None, false)?;
        let wait = (until - Utc::now()).to_std().unwrap_or_default();
        let interrupt = self.sleep_unless_interrupted(wait).await;
        state.skill().rate_limit = None;
        self.commit(state, None, None, false)?;
        Ok(interrupt)
    }

    /// The executor cannot run here: pause the loop (from `running` only) with the reason in
    /// `skill_state.blocked`, say once what to do, and let the main loop wait for a person. The
    /// attempt used no retry, counted no error and no iteration; it runs again on resume.
    pub(super) fn block(
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
        attempt_rules::block(&mut state, dispatch, &plan.executor, reason, &now_rfc3339());
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

    /// The loop made no progress for too many rounds: pause it (from `running` only) with what
    /// stayed the same in `skill_state.no_progress`, and say it once. A resume goes on, counting
    /// afresh.
    pub(super) fn stall(&mut self, mut state: LoopState, reason: String) -> Result<Option<Exit>> {
        loopd_core::no_progress::pause(&mut state, reason.clone(), &now_rfc3339());
        let pause = Transition {
            from: &[Status::Running],
            to: Status::Paused,
            failure_reason: None,
            completed_at: false,
        };
        let after = self.commit(&state, Some(&pause), None, true)?;
        if after.status == Status::Paused {
            self.events.emit(
                Event::new(name::NO_PROGRESS)
                    .with("iteration", after.current_iteration)
                    .with("reason", reason.clone())
                    .with(
                        "message",
                        format!(
                            "{reason} — paused; look at it, then `loopd resume {}`",
                            self.id
                        ),
                    )
                    .still(after.still()),
            );
        }
        Ok(None)
    }

    /// The executor asks a person: keep the question in `skill_state.question`, say it once, and
    /// let the main loop wait for the answer. Like a block, the attempt used no retry, counted no
    /// error and no iteration; the action runs again once answered, its prompt with the answer.
    pub(super) fn ask(
        &mut self,
        mut state: LoopState,
        dispatch: &Dispatch,
        question: String,
    ) -> Result<Option<Exit>> {
        attempt_rules::ask(
            self.engine.workflow,
            &mut state,
            dispatch,
            question.clone(),
            &now_rfc3339(),
        );
        let after = self.commit(&state, None, None, true)?;
        self.events.emit(
            Event::new(name::AWAITING_ANSWER)
                .with("action", dispatch.action.clone())
                .with(
                    "message",
                    format!("{question} (answer with `loopd answer {} TEXT`)", self.id),
                )
                .with("question", question)
                .still(after.still()),
        );
        Ok(None)
    }

    /// Sleeps, unless the status leaves `running` or a signal arrives first.
    pub(super) async fn sleep_unless_interrupted(
        &mut self,
        duration: Duration,
    ) -> Option<Interrupt> {
        let mut rx = self.watch.subscribe();
        let sleep = tokio::time::sleep(duration);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                () = &mut sleep => return None,
                _ = rx.changed() => {
                    if !still_running(&rx) {
                        return Some(stopped_by(&rx));
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
}
