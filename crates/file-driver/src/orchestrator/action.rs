//! One action: its attempts, with a backoff between failed ones; the waits around them (a rate
//! limit's reset), and what an attempt may ask for instead of a result (a block, a question).

use super::attempt::{Attempted, Step};
use super::*;

/// The pauses between the attempts of an action: `first`, doubled each time, `retries` of them.
pub(super) struct Backoff {
    left: u32,
    next: Duration,
}

impl Backoff {
    pub(super) fn new(retries: u32, first: Duration) -> Backoff {
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
    pub(super) fn begin(&mut self, state: &mut LoopState, dispatch: &Dispatch) {
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
    pub(super) async fn rate_limited(
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
    pub(super) fn ask(
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
    pub(super) fn rate_limit_wait(&self, until: Option<DateTime<Utc>>) -> chrono::Duration {
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
}
