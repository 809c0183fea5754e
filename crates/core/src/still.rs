//! Why a loop stands still, and what moves it on: what every front shows of a loop that does not
//! progress (`status`, `list`, the API and the page, the MCP server), from its state alone. A
//! driver adds what only it knows (a service's queue, a loop it waits behind, nothing to drive
//! it).

use serde::Serialize;

use crate::state::{LoopState, Status, StatusBy};

/// Why a loop stands still and what moves it on, for people: never one without the other.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Still {
    /// Why it does not move, in one line.
    pub reason: String,
    /// What moves it on: a command, or what it waits for by itself.
    pub next: String,
}

impl Still {
    pub fn new(reason: impl Into<String>, next: impl Into<String>) -> Still {
        Still {
            reason: reason.into(),
            next: next.into(),
        }
    }

    /// Waiting for the reset of an account's rate limit, at `until`.
    pub fn rate_limited(account: &str, until: &str) -> Still {
        Still::new(
            format!("waiting for the rate limit of {account} until {until}"),
            format!("nothing: it goes on by itself at {until}"),
        )
    }
}

impl LoopState {
    /// Why this loop stands still, from its state alone (a driver adds what only it knows: a
    /// queue, a loop it waits behind, no daemon or worker); `None` while nothing holds it.
    pub fn still(&self) -> Option<Still> {
        let id = &self.loop_id;
        let skill = self.skill_state.as_ref();
        let who = || StatusBy::who(self.status_by.as_ref(), &self.status);
        let outcome = skill.and_then(|k| k.outcome.as_deref());
        if self.status == Status::Running {
            if let Some(wait) = skill.and_then(|k| k.rate_limit.as_ref()) {
                return Some(Still::rate_limited(&wait.account, &wait.until));
            }
            if let Some(q) = skill
                .and_then(|k| k.question.as_ref())
                .filter(|q| q.waiting())
            {
                return Some(Still::new(
                    format!("waiting for an answer: {}", q.text),
                    format!("`loopd answer {id} TEXT`"),
                ));
            }
            if let Some(wait) = skill.and_then(|k| k.awaiting_choice.as_ref()) {
                return Some(Still::new(
                    format!("waiting for its next action: {}", wait.choices.join(", ")),
                    format!(
                        "`loopd next {id} {}`",
                        wait.suggested.as_deref().unwrap_or("ACTION")
                    ),
                ));
            }
            return None;
        }
        let resume = format!("`loopd resume {id}`");
        Some(match &self.status {
            Status::Created => Still::new("created, not started", format!("`loopd start {id}`")),
            Status::Paused => {
                if let Some(b) = skill.and_then(|k| k.blocked.as_ref()) {
                    Still::new(
                        format!("blocked: {}: {}", b.executor, b.reason),
                        format!("fix that, then {resume}"),
                    )
                } else if let Some(s) = skill
                    .and_then(|k| k.no_progress.as_ref())
                    .and_then(|n| n.paused.as_ref())
                {
                    Still::new(
                        format!("no progress: {}", s.reason),
                        format!("look at what it did (`loopd logs {id}`), then {resume}"),
                    )
                } else {
                    Still::new(format!("paused by {}", who()), resume)
                }
            }
            Status::Completed => match outcome {
                Some("iteration_limit") => Still::new(
                    "completed at its iteration limit, the goal not met",
                    format!("`loopd set {id} --max-iterations N`, then {resume}"),
                ),
                Some("incomplete") => Still::new(
                    "completed with tasks left that no agent could do",
                    format!("`loopd task add {id} TEXT`, then {resume}"),
                ),
                _ => return None,
            },
            Status::Failed if outcome == Some("failed") => {
                let reason = self.failure_reason.as_deref().unwrap_or("no reason given");
                if reason.starts_with("budget exceeded") {
                    Still::new(
                        format!("out of budget: {reason}"),
                        format!(
                            "`loopd set {id} --max-cost-usd USD` (or --max-tokens), then {resume}"
                        ),
                    )
                } else {
                    Still::new(format!("failed: {reason}"), format!("`loopd retry {id}`"))
                }
            }
            Status::Failed | Status::UserExit => {
                Still::new(format!("stopped by {}", who()), resume)
            }
            Status::Running => return None,
            Status::Other(status) => Still::new(
                format!("its status {status:?} is none loopd knows"),
                format!("{resume}, or `loopd stop {id}`"),
            ),
        })
    }
}
