//! What an attempt does to a loop, the same for every driver: how it ended (its [`Verdict`], in
//! the one taxonomy of [`AttemptOutcome`]), and what follows from that ([`Attempts::next`]: the
//! action is finished, tried again after a backoff, waits for a rate limit's reset, parks the
//! loop as blocked, or asks a person). The state changes around an attempt are here too:
//! [`begin`] before the first, [`record`] after each, [`block`] and [`ask`] when the loop must
//! wait for someone, [`finish`] when the action is done (which also counts the rounds without
//! progress, [`no_progress`]). A driver runs the attempts and writes the state; it decides
//! nothing of this itself.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::no_progress;
use crate::protocol::ActionResult;
use crate::state::{Blocked, HistoryEntry, LoopState, Question, Usage};
use crate::workflow::{self, Dispatch, Finish, Inputs, LoopEnd, Workflow};

/// How an attempt ended, the same for every format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    Success,
    /// The agent (or the executor's result) reported an error.
    AgentError,
    /// The agent stopped at its turn limit.
    MaxTurns,
    /// The agent's own budget, or the loop's, was reached.
    BudgetExceeded,
    /// The provider's rate or usage limit; retried after the reset, not an error.
    RateLimited,
    /// An overloaded or failing API (5xx, network): an error of the attempt, retried.
    TransientApiError,
    /// Wall-clock or idle timeout.
    Timeout,
    /// Ended by a signal loopd did not send.
    Killed,
    /// The agent finished without a final message or result.
    NoResult,
    /// The environment cannot run the agent at all: not logged in, no or a wrong API key, an
    /// unknown model, a missing program, a rejected flag, an untrusted folder. Not the task's
    /// fault: no retry, no error counted; the loop waits for a person.
    EnvironmentError,
}

impl AttemptOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Success => "success",
            AttemptOutcome::AgentError => "agent_error",
            AttemptOutcome::MaxTurns => "max_turns",
            AttemptOutcome::BudgetExceeded => "budget_exceeded",
            AttemptOutcome::RateLimited => "rate_limited",
            AttemptOutcome::TransientApiError => "transient_api_error",
            AttemptOutcome::Timeout => "timeout",
            AttemptOutcome::Killed => "killed",
            AttemptOutcome::NoResult => "no_result",
            AttemptOutcome::EnvironmentError => "environment_error",
        }
    }
}

/// How an attempt ended.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Verdict {
    Success(ActionResult),
    Failed {
        outcome: AttemptOutcome,
        message: String,
    },
    /// The provider's limit: try again after `until` (when known); not an error.
    RateLimited {
        until: Option<DateTime<Utc>>,
        message: String,
    },
    /// Ended from outside (pause, stop, shutdown): neither a success nor an error.
    Interrupted,
    /// The environment cannot run the executor (see [`AttemptOutcome::EnvironmentError`]):
    /// neither a success nor an error of the task; the loop waits for a person to fix it.
    Blocked {
        message: String,
    },
    /// The executor asks a person `question`: neither a success nor an error; the loop waits
    /// for the answer and the next prompt gets it.
    NeedsInput {
        question: String,
    },
}

impl Verdict {
    /// The attempt's outcome in the one taxonomy (`interrupted` aside).
    pub fn outcome(&self) -> &'static str {
        match self {
            Verdict::Success(_) => AttemptOutcome::Success.as_str(),
            Verdict::Failed { outcome, .. } => outcome.as_str(),
            Verdict::RateLimited { .. } => AttemptOutcome::RateLimited.as_str(),
            Verdict::Interrupted => "interrupted",
            Verdict::Blocked { .. } => AttemptOutcome::EnvironmentError.as_str(),
            Verdict::NeedsInput { .. } => "needs_input",
        }
    }
}

/// Rate limits in a row after which an attempt counts as failed: an agent that says "rate
/// limited" forever is failing.
pub const MAX_RATE_LIMITS: u32 = 20;

/// How an action's attempts are tried again, from the config.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Failed attempts tried again, after the first.
    pub retries: u32,
    /// The pause before the first retry; each next one doubles it.
    pub first_pause: Duration,
    /// The wait after a rate limit that gave no reset time.
    pub rate_limit_wait: Duration,
    /// The longest wait for a rate limit's reset.
    pub rate_limit_max_wait: Duration,
}

/// What a driver does after an attempt.
#[derive(Clone, Debug)]
pub enum AfterAttempt {
    /// The action is done, succeeded or failed for good: [`finish`] it.
    Finish(crate::workflow::Finish),
    /// Try the action again after `pause` (a durable timer where the driver has one).
    Retry { pause: Duration },
    /// Wait `wait` for the provider's rate limit to reset, then try the same attempt again: not
    /// an error.
    WaitRateLimit { wait: Duration, message: String },
    /// The environment cannot run the executor: the loop waits for a person ([`block`]).
    Block(String),
    /// The executor asks a person: the loop waits for the answer ([`ask`]).
    Ask(String),
    /// Ended from outside (pause, stop, shutdown): nothing follows.
    Interrupted,
}

/// The attempts of one action so far, and what the next verdict leads to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attempts {
    policy: RetryPolicy,
    /// The attempt being run, from 1.
    pub attempt: u32,
    /// Failed attempts so far.
    failed: u32,
    /// Rate limits in a row so far.
    rate_limited: u32,
}

impl Attempts {
    pub fn new(policy: RetryPolicy) -> Attempts {
        Attempts {
            policy,
            attempt: 1,
            failed: 0,
            rate_limited: 0,
        }
    }

    /// What the verdict of the current attempt leads to; `now` is when it was reached. A retry
    /// counts the next attempt; a rate limit's wait tries the same one again.
    pub fn next(&mut self, verdict: Verdict, now: DateTime<Utc>) -> AfterAttempt {
        let error = match verdict {
            Verdict::Success(result) => return AfterAttempt::Finish(Finish::Success(result)),
            Verdict::Blocked { message } => return AfterAttempt::Block(message),
            Verdict::NeedsInput { question } => return AfterAttempt::Ask(question),
            Verdict::Interrupted => return AfterAttempt::Interrupted,
            Verdict::RateLimited { until, message } if self.rate_limited < MAX_RATE_LIMITS => {
                self.rate_limited += 1;
                return AfterAttempt::WaitRateLimit {
                    wait: self.rate_limit_wait(until, now),
                    message,
                };
            }
            Verdict::RateLimited { message, .. } => {
                format!(
                    "rate limited {} times in a row: {message}",
                    self.rate_limited
                )
            }
            // No retry can help.
            Verdict::Failed {
                outcome: AttemptOutcome::BudgetExceeded,
                message,
            } => return AfterAttempt::Finish(Finish::Failed(message)),
            Verdict::Failed { message, .. } => message,
        };
        if self.failed >= self.policy.retries {
            return AfterAttempt::Finish(Finish::Failed(error));
        }
        let pause = self
            .policy
            .first_pause
            .saturating_mul(2u32.saturating_pow(self.failed));
        self.failed += 1;
        self.attempt += 1;
        AfterAttempt::Retry { pause }
    }

    /// How long to wait for a rate limit that resets at `until` (or, unknown, the policy's wait,
    /// doubled for each rate limit in a row before): at least a second, so a confused agent
    /// cannot spin, and at most the policy's longest wait.
    fn rate_limit_wait(&self, until: Option<DateTime<Utc>>, now: DateTime<Utc>) -> Duration {
        let wait = match until {
            Some(t) => (t - now).to_std().unwrap_or_default(),
            None => self
                .policy
                .rate_limit_wait
                .saturating_mul(2u32.saturating_pow(self.rate_limited.saturating_sub(1))),
        };
        let floor = Duration::from_secs(1);
        wait.clamp(floor, self.policy.rate_limit_max_wait.max(floor))
    }
}

/// The verdict of an attempt once its workflow has checked a successful result: one the
/// workflow refuses is the agent's error.
pub fn checked(workflow: &dyn Workflow, action: &str, verdict: Verdict) -> Verdict {
    match verdict {
        Verdict::Success(result) => match workflow.validate(action, &result) {
            Ok(()) => Verdict::Success(result),
            Err(reason) => Verdict::Failed {
                outcome: AttemptOutcome::AgentError,
                message: format!("invalid result: {reason}"),
            },
        },
        other => other,
    }
}

/// An action begins: it is the loop's current action, the workflow marks it started, and what
/// waited for someone before it (a choice, a block) is over. Returns the question it answers,
/// when it was given an answer: `(question, answer)`.
pub fn begin(
    workflow: &dyn Workflow,
    state: &mut LoopState,
    dispatch: &Dispatch,
    now: &str,
) -> Option<(String, String)> {
    state.skill().current_action = Some(dispatch.action.clone());
    workflow.begin(state, dispatch, now);
    let answered = state
        .skill_state
        .as_ref()
        .and_then(|s| s.question.as_ref())
        .and_then(|q| Some((q.text.clone(), q.answer.clone()?)));
    let skill = state.skill();
    skill.awaiting_choice = None;
    skill.blocked = None;
    skill.outcome = None;
    no_progress::resumed(state);
    // A person's answer: the rounds count afresh.
    if answered.is_some() {
        no_progress::afresh(state);
    }
    answered
}

/// One attempt as the history keeps it.
#[derive(Clone, Debug)]
pub struct Attempted<'a> {
    pub dispatch: &'a Dispatch,
    pub iteration: u64,
    pub attempt: u32,
    pub started_at: &'a str,
    pub finished_at: &'a str,
    /// What the executor spent, with its cost in dollars when it says.
    pub spent: Option<(&'a Usage, Option<f64>)>,
    pub checkpoint: Option<crate::state::Checkpoint>,
}

/// Records a finished attempt: it is no longer in flight, its spending goes into the totals and
/// the attempt into the history. An attempt that did not happen as far as the workflow is
/// concerned (interrupted, blocked, asking) leaves no current action behind.
pub fn record(state: &mut LoopState, attempted: Attempted<'_>, verdict: &Verdict) {
    let skill = state.skill();
    skill.in_flight = None;
    if let Some((usage, cost_usd)) = attempted.spent {
        skill.usage.add(usage, cost_usd, attempted.finished_at);
    }
    no_progress::touched(state, attempted.checkpoint.as_ref());
    let (summary, error) = match verdict {
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
            action: attempted.dispatch.action.clone(),
            iteration: attempted.iteration,
            attempt: attempted.attempt,
            task_id: attempted.dispatch.task_id.clone(),
            started_at: attempted.started_at.to_owned(),
            finished_at: Some(attempted.finished_at.to_owned()),
            outcome: verdict.outcome().to_owned(),
            summary,
            error,
            checkpoint: attempted.checkpoint,
            tokens: attempted.spent.map(|(usage, _)| usage.total()),
            cost_usd: attempted
                .spent
                .and_then(|(_, cost)| cost)
                .filter(|c| c.is_finite() && *c >= 0.0),
            ..HistoryEntry::default()
        },
    );
    if matches!(
        verdict,
        Verdict::Interrupted | Verdict::Blocked { .. } | Verdict::NeedsInput { .. }
    ) {
        state.skill().current_action = None;
    }
}

/// The sandbox's proxy refused an attempt of `action` the hosts `refused` (`host:port` each):
/// counted, the last kept.
pub fn network_refused(state: &mut LoopState, action: &str, refused: &[String], now: &str) {
    let Some(last) = refused.last() else {
        return;
    };
    let network = state.skill().network.get_or_insert_with(Default::default);
    network.refused = network.refused.saturating_add(refused.len() as u64);
    network.last = last.clone();
    network.action = action.to_owned();
    network.at = now.to_owned();
}

/// The loop waits for a person to fix what keeps `executor` from running: the driver pauses it.
pub fn block(
    state: &mut LoopState,
    dispatch: &Dispatch,
    executor: &str,
    reason: String,
    now: &str,
) {
    state.skill().blocked = Some(Blocked {
        since: now.to_owned(),
        action: dispatch.action.clone(),
        executor: executor.to_owned(),
        reason,
    });
}

/// The loop waits for a person's answer to `question`; the next prompt of the action gets it.
pub fn ask(
    workflow: &dyn Workflow,
    state: &mut LoopState,
    dispatch: &Dispatch,
    question: String,
    now: &str,
) {
    workflow.asked(state, dispatch);
    state.skill().question = Some(Question {
        since: now.to_owned(),
        action: dispatch.action.clone(),
        text: question,
        answer: None,
        answered_at: None,
    });
}

/// An action is done, after its retries: the workflow applies its result and the books every
/// action gets are kept. Returns how the loop ends, when this ends it.
pub fn finish(
    workflow: &dyn Workflow,
    state: &mut LoopState,
    dispatch: &Dispatch,
    finish: &Finish,
    inputs: &Inputs,
) -> Option<LoopEnd> {
    let end = workflow.apply(state, dispatch, finish, inputs);
    workflow::record_finish(workflow, state, dispatch, finish, &inputs.now);
    workflow::round(workflow, state, &dispatch.action, finish, inputs.tree);
    end
}

/// The pass rate a check action's result gives a tree, as the workflow reads it once applied to
/// a copy of `state` (a race's check changes nothing of the loop's); none for a check that did
/// not succeed.
pub fn pass_rate_of(
    workflow: &dyn Workflow,
    state: &LoopState,
    check: &Dispatch,
    finish: &Finish,
    now: &str,
) -> Option<f64> {
    if !matches!(finish, Finish::Success(_)) {
        return None;
    }
    let mut scratch = state.clone();
    let inputs = Inputs {
        now: now.to_owned(),
        ..Inputs::default()
    };
    self::finish(workflow, &mut scratch, check, finish, &inputs);
    workflow.pass_rate(&scratch, &check.action)
}

/// One executor's try in a race of executors on a task, as the choice sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Entrant {
    pub succeeded: bool,
    /// What the check gave its tree, when one ran.
    pub pass_rate: Option<f64>,
    /// The size of its change (lines inserted and deleted).
    pub change: u64,
}

/// The winner of a race: of the entrants that succeeded, the highest pass rate, then the smaller
/// change, then the first; none when none succeeded.
pub fn race_winner(entrants: &[Entrant]) -> Option<usize> {
    (0..entrants.len())
        .filter(|&i| entrants[i].succeeded)
        .max_by(|&a, &b| {
            let (ea, eb) = (&entrants[a], &entrants[b]);
            let rate = |e: &Entrant| e.pass_rate.unwrap_or(-1.0);
            rate(ea)
                .total_cmp(&rate(eb))
                .then(eb.change.cmp(&ea.change))
                .then(b.cmp(&a))
        })
}

/// The outcome a history entry gives a task's result that could not be merged into the loop's
/// tree (tasks developed at once).
pub const MERGE_CONFLICT: &str = "merge_conflict";

/// A task's result, developed at once with others, could not be merged into the loop's tree:
/// the history says so (outcome [`MERGE_CONFLICT`]), and the task goes back to its agent with
/// `why` in its next prompt, or fails once its merges used the `retries` of an action. Returns
/// what is said of it, and whether it failed.
pub fn merge_failed(
    workflow: &dyn Workflow,
    state: &mut LoopState,
    dispatch: &Dispatch,
    iteration: u64,
    why: &str,
    retries: u32,
    now: &str,
) -> (String, bool) {
    let task = dispatch.task_id.clone().unwrap_or_default();
    let before = state.skill_state.as_ref().map_or(0, |s| {
        s.action_history
            .iter()
            .filter(|h| h.outcome == MERGE_CONFLICT && h.task_id.as_deref() == Some(&task))
            .count()
    });
    let failed = before >= retries as usize;
    crate::workflow::record_attempt(
        state,
        HistoryEntry {
            action: dispatch.action.clone(),
            iteration,
            attempt: 1,
            task_id: dispatch.task_id.clone(),
            started_at: now.to_owned(),
            finished_at: Some(now.to_owned()),
            outcome: MERGE_CONFLICT.into(),
            error: Some(why.to_owned()),
            ..HistoryEntry::default()
        },
    );
    let said = match failed {
        true => format!("could not be merged after {} tries: {why}", before + 1),
        false => why.to_owned(),
    };
    workflow.merge_failed(state, &task, &said, failed);
    (said, failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workflow::ccw_loop::CcwLoop;

    const POLICY: RetryPolicy = RetryPolicy {
        retries: 2,
        first_pause: Duration::from_secs(3),
        rate_limit_wait: Duration::from_secs(60),
        rate_limit_max_wait: Duration::from_secs(600),
    };

    fn failed(outcome: AttemptOutcome) -> Verdict {
        Verdict::Failed {
            outcome,
            message: "boom".into(),
        }
    }

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-11-25T12:00:00Z")
            .unwrap()
            .to_utc()
    }

    #[test]
    fn failed_attempts_are_retried_with_doubling_pauses_then_the_action_fails() {
        let mut a = Attempts::new(POLICY);
        let pauses: Vec<_> = (0..2)
            .map(|_| match a.next(failed(AttemptOutcome::Timeout), now()) {
                AfterAttempt::Retry { pause } => pause,
                other => panic!("expected a retry, got {other:?}"),
            })
            .collect();
        assert_eq!(pauses, [Duration::from_secs(3), Duration::from_secs(6)]);
        assert_eq!(a.attempt, 3);
        assert!(matches!(
            a.next(failed(AttemptOutcome::AgentError), now()),
            AfterAttempt::Finish(Finish::Failed(m)) if m == "boom"
        ));
    }

    #[test]
    fn a_spent_budget_fails_the_action_without_a_retry() {
        let mut a = Attempts::new(POLICY);
        assert!(matches!(
            a.next(failed(AttemptOutcome::BudgetExceeded), now()),
            AfterAttempt::Finish(Finish::Failed(_))
        ));
    }

    #[test]
    fn a_rate_limit_waits_for_its_reset_within_bounds_and_is_not_an_error() {
        let mut a = Attempts::new(POLICY);
        let wait = |a: &mut Attempts, until: Option<DateTime<Utc>>| match a.next(
            Verdict::RateLimited {
                until,
                message: "slow down".into(),
            },
            now(),
        ) {
            AfterAttempt::WaitRateLimit { wait, .. } => wait,
            other => panic!("expected a wait, got {other:?}"),
        };
        let secs = |s: i64| Some(now() + chrono::Duration::seconds(s));
        assert_eq!(wait(&mut a, secs(90)), Duration::from_secs(90));
        assert_eq!(
            wait(&mut a, secs(-5)),
            Duration::from_secs(1),
            "a past reset"
        );
        assert_eq!(wait(&mut a, secs(86_400)), Duration::from_secs(600));
        assert_eq!(a.attempt, 1, "the same attempt is tried again");
        // Without a reset time: a growing wait.
        let mut a = Attempts::new(POLICY);
        let waits: Vec<_> = (0..5).map(|_| wait(&mut a, None).as_secs()).collect();
        assert_eq!(waits, [60, 120, 240, 480, 600]);
    }

    #[test]
    fn endless_rate_limits_count_as_a_failure() {
        let mut a = Attempts::new(POLICY);
        let limited = || Verdict::RateLimited {
            until: None,
            message: "429".into(),
        };
        for _ in 0..MAX_RATE_LIMITS {
            assert!(matches!(
                a.next(limited(), now()),
                AfterAttempt::WaitRateLimit { .. }
            ));
        }
        assert!(matches!(
            a.next(limited(), now()),
            AfterAttempt::Retry { .. }
        ));
    }

    #[test]
    fn success_block_question_and_interruption_lead_where_they_say() {
        let mut a = Attempts::new(POLICY);
        assert!(matches!(
            a.next(
                Verdict::Success(serde_json::from_str(r#"{"status": "success"}"#).unwrap()),
                now()
            ),
            AfterAttempt::Finish(Finish::Success(_))
        ));
        assert!(matches!(
            a.next(Verdict::Blocked { message: "no key".into() }, now()),
            AfterAttempt::Block(m) if m == "no key"
        ));
        assert!(matches!(
            a.next(Verdict::NeedsInput { question: "which db?".into() }, now()),
            AfterAttempt::Ask(q) if q == "which db?"
        ));
        assert!(matches!(
            a.next(Verdict::Interrupted, now()),
            AfterAttempt::Interrupted
        ));
    }

    #[test]
    fn an_attempt_is_recorded_with_its_spending_and_an_interrupted_one_leaves_no_action() {
        let mut state = LoopState::default();
        let dispatch = Dispatch::new("develop");
        let answered = begin(&CcwLoop, &mut state, &dispatch, "2026-11-25T12:00:00.000Z");
        assert_eq!(answered, None);
        assert_eq!(state.skill().current_action.as_deref(), Some("develop"));
        let usage = Usage {
            input_tokens: 10,
            output_tokens: 5,
            ..Usage::default()
        };
        let attempted = Attempted {
            dispatch: &dispatch,
            iteration: 1,
            attempt: 1,
            started_at: "2026-11-25T12:00:00.000Z",
            finished_at: "2026-11-25T12:00:01.000Z",
            spent: Some((&usage, Some(0.25))),
            checkpoint: None,
        };
        record(
            &mut state,
            attempted.clone(),
            &failed(AttemptOutcome::Timeout),
        );
        let skill = state.skill();
        let entry = skill.action_history.last().unwrap();
        assert_eq!(
            (entry.outcome.as_str(), entry.error.as_deref()),
            ("timeout", Some("boom"))
        );
        assert_eq!((skill.usage.tokens(), skill.usage.cost_usd), (15, 0.25));
        assert_eq!((entry.tokens, entry.cost_usd), (Some(15), Some(0.25)));
        assert_eq!(skill.current_action.as_deref(), Some("develop"));
        record(&mut state, attempted, &Verdict::Interrupted);
        assert_eq!(state.skill().current_action, None);
    }

    #[test]
    fn a_validation_that_succeeded_keeps_its_pass_rate_in_the_history() {
        let mut state = LoopState::default();
        let dispatch = Dispatch::new("validate");
        let at = "2026-11-25T12:00:00.000Z";
        begin(&CcwLoop, &mut state, &dispatch, at);
        let mut result = ActionResult::bare_success();
        result.state_updates = serde_json::from_value(serde_json::json!({
            "passed": false, "pass_rate": 62.5
        }))
        .unwrap();
        let attempted = Attempted {
            dispatch: &dispatch,
            iteration: 1,
            attempt: 1,
            started_at: at,
            finished_at: at,
            spent: None,
            checkpoint: None,
        };
        record(&mut state, attempted, &Verdict::Success(result.clone()));
        let inputs = Inputs {
            now: at.into(),
            ..Inputs::default()
        };
        finish(
            &CcwLoop,
            &mut state,
            &dispatch,
            &Finish::Success(result),
            &inputs,
        );
        let entry = state.skill().action_history.last().unwrap();
        assert_eq!((entry.pass_rate, entry.tokens), (Some(62.5), None));
    }

    #[test]
    fn a_block_and_a_question_are_cleared_when_the_action_begins_again() {
        let mut state = LoopState::default();
        let dispatch = Dispatch::new("develop");
        let now = "2026-11-25T12:00:00.000Z";
        block(&mut state, &dispatch, "claude", "not logged in".into(), now);
        assert_eq!(
            state.skill().blocked.as_ref().unwrap().reason,
            "not logged in"
        );
        ask(&CcwLoop, &mut state, &dispatch, "which db?".into(), now);
        let question = state.skill().question.as_mut().unwrap();
        question.answer = Some("sqlite".into());
        let answered = begin(&CcwLoop, &mut state, &dispatch, now);
        assert_eq!(answered, Some(("which db?".into(), "sqlite".into())));
        assert_eq!(state.skill().blocked, None);
    }

    #[test]
    fn a_race_is_won_by_the_best_pass_rate_then_the_smaller_change_then_the_first() {
        let e = |succeeded, pass_rate, change| Entrant {
            succeeded,
            pass_rate,
            change,
        };
        assert_eq!(race_winner(&[]), None);
        assert_eq!(race_winner(&[e(false, Some(100.0), 1)]), None);
        let rated = [e(true, Some(40.0), 1), e(true, Some(100.0), 9)];
        assert_eq!(race_winner(&rated), Some(1));
        let tied = [e(true, Some(80.0), 9), e(true, Some(80.0), 2)];
        assert_eq!(race_winner(&tied), Some(1));
        let same = [e(true, None, 3), e(true, None, 3)];
        assert_eq!(race_winner(&same), Some(0));
        // A failed entrant's rate does not count; an unchecked success beats no success.
        let failed = [e(false, Some(100.0), 1), e(true, None, 50)];
        assert_eq!(race_winner(&failed), Some(1));
    }
}
