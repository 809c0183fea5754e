//! A loop's events, read from its workflow's history: on Temporal the history is the loop's log,
//! so nothing else keeps one. The events take the file driver's names where they mean the same
//! (`loop_started`, `action_started`, `action_finished`, `action_interrupted`), with the few that
//! only Temporal has (`attempt_lost`: the worker gave no heartbeat; `changed`: a person's change;
//! `waiting`: a durable timer; `continued_as_new`), and those the workflow says itself, whole
//! (`race_started`, `race_decided`: see [`SAID`]).

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use temporalio_common::protos::temporal::api::common::v1::Payloads;
use temporalio_common::protos::temporal::api::history::v1::HistoryEvent;
use temporalio_common::protos::temporal::api::history::v1::history_event::Attributes;

use loopd_core::attempt::Verdict;

use crate::LoopInput;
use crate::activity::{AttemptInput, AttemptReport};
use crate::change::Change;

/// The events of one run's history, oldest first, each `{ts, event, ...}` as in the file
/// driver's `events.jsonl`.
pub fn events(history: &[HistoryEvent]) -> Vec<Value> {
    // Each activity's attempt, by the id of the event that scheduled it.
    let mut scheduled: Vec<(i64, AttemptInput)> = Vec::new();
    let action_of = |scheduled: &[(i64, AttemptInput)], id: i64| {
        scheduled
            .iter()
            .find(|(at, _)| *at == id)
            .map(|(_, a)| {
                let mut fields = json!({
                    "action": a.dispatch.action, "iteration": a.iteration, "attempt": a.attempt
                });
                // Where it ran: its task, and its lane among the tasks (or tries) of a batch.
                if let Some(task) = &a.dispatch.task_id {
                    fields["task_id"] = json!(task);
                }
                if let Some(lane) = a.lane {
                    fields["lane"] = json!(lane);
                }
                if let Some(label) = &a.label {
                    fields["label"] = json!(label);
                }
                fields
            })
            .unwrap_or_else(|| json!({}))
    };
    let mut out = Vec::new();
    for event in history {
        let Some(attributes) = &event.attributes else {
            continue;
        };
        // An event the workflow said itself, whole (see [`SAID`]).
        if let Attributes::WorkflowPropertiesModifiedEventAttributes(a) = attributes {
            let said = a.upserted_memo.as_ref().and_then(|m| m.fields.get(SAID));
            if let Some(Value::Object(mut fields)) =
                said.and_then(|p| serde_json::from_slice::<Value>(&p.data).ok())
            {
                let name = fields.remove("event").unwrap_or_default();
                out.push(stamped(event, name, Value::Object(fields)));
            }
            continue;
        }
        let (name, fields) = match attributes {
            Attributes::WorkflowExecutionStartedEventAttributes(a) => {
                let input: Option<LoopInput> = decode(a.input.as_ref());
                let status = input.map(|i| i.state.status.as_str().to_owned());
                ("loop_started", json!({ "status": status }))
            }
            Attributes::ActivityTaskScheduledEventAttributes(a) => {
                let Some(input) = decode::<AttemptInput>(a.input.as_ref()) else {
                    continue;
                };
                scheduled.push((event.event_id, input));
                ("action_started", action_of(&scheduled, event.event_id))
            }
            Attributes::ActivityTaskCompletedEventAttributes(a) => {
                let mut fields = action_of(&scheduled, a.scheduled_event_id);
                if let Some(report) = decode::<AttemptReport>(a.result.as_ref()) {
                    fields["executor"] = json!(report.executor);
                    fields["outcome"] = json!(report.verdict.outcome());
                    let said = match &report.verdict {
                        Verdict::Success(result) => result.summary.clone(),
                        Verdict::Failed { message, .. }
                        | Verdict::RateLimited { message, .. }
                        | Verdict::Blocked { message } => message.clone(),
                        Verdict::NeedsInput { question } => question.clone(),
                        Verdict::Interrupted => String::new(),
                    };
                    fields["summary"] = json!(said);
                }
                fields["worker"] = json!(a.identity);
                ("action_finished", fields)
            }
            Attributes::ActivityTaskFailedEventAttributes(a) => {
                let mut fields = action_of(&scheduled, a.scheduled_event_id);
                fields["message"] = json!(a.failure.as_ref().map(|f| f.message.clone()));
                ("attempt_failed", fields)
            }
            Attributes::ActivityTaskTimedOutEventAttributes(a) => {
                ("attempt_lost", action_of(&scheduled, a.scheduled_event_id))
            }
            Attributes::ActivityTaskCanceledEventAttributes(a) => (
                "action_interrupted",
                action_of(&scheduled, a.scheduled_event_id),
            ),
            Attributes::WorkflowExecutionUpdateAcceptedEventAttributes(a) => {
                let args = a
                    .accepted_request
                    .as_ref()
                    .and_then(|r| r.input.as_ref())
                    .and_then(|i| i.args.as_ref());
                let change: Option<Change> = decode(args);
                let said = change.as_ref().map(Change::to_string);
                ("changed", json!({ "change": change, "message": said }))
            }
            Attributes::TimerStartedEventAttributes(a) => {
                let seconds = a
                    .start_to_fire_timeout
                    .as_ref()
                    .map(|d| d.seconds as f64 + f64::from(d.nanos) / 1e9);
                let said = seconds.map(|s| format!("{s:.1}s"));
                ("waiting", json!({ "seconds": seconds, "message": said }))
            }
            Attributes::WorkflowExecutionContinuedAsNewEventAttributes(a) => {
                ("continued_as_new", json!({ "run": a.new_execution_run_id }))
            }
            Attributes::WorkflowExecutionCompletedEventAttributes(a) => {
                let ended: Option<LoopInput> = decode(a.result.as_ref());
                let (status, reason) = ended.map_or((None, None), |i| {
                    (Some(i.state.standing()), i.state.failure_reason)
                });
                (
                    "loop_ended",
                    json!({ "status": status, "outcome": status, "message": reason }),
                )
            }
            _ => continue,
        };
        out.push(stamped(event, json!(name), fields));
    }
    out
}

/// The memo key under which the workflow says an event of its own (`race_started`,
/// `race_decided`): `{"event": NAME, ...fields}`, as the file driver's.
pub const SAID: &str = "loopd_event";

/// `fields` as the event `name` that happened at `event`'s time.
fn stamped(event: &HistoryEvent, name: Value, mut fields: Value) -> Value {
    let ts = event.event_time.as_ref().and_then(|t| {
        DateTime::<Utc>::from_timestamp(t.seconds, u32::try_from(t.nanos).unwrap_or(0))
    });
    fields["ts"] = json!(ts.map(loopd_core::state::format_ts));
    fields["event"] = name;
    fields
}

/// The first payload of `payloads`, as JSON (the SDK's default converter).
fn decode<T: DeserializeOwned>(payloads: Option<&Payloads>) -> Option<T> {
    serde_json::from_slice(&payloads?.payloads.first()?.data).ok()
}

#[cfg(test)]
mod tests {
    use temporalio_common::protos::temporal::api::history::v1::History;

    use super::*;

    /// The recorded history the replay test uses: an answer, a task and a limit given as updates.
    fn recorded() -> Vec<HistoryEvent> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/histories/updates.json"
        );
        let json = std::fs::read(path).expect("the recorded history");
        serde_json::from_slice::<History>(&json)
            .expect("a history")
            .events
    }

    #[test]
    fn a_recorded_history_reads_as_the_loops_events() {
        let events = events(&recorded());
        let names: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
        assert_eq!(names.first(), Some(&"loop_started"), "{names:?}");
        assert_eq!(names.last(), Some(&"loop_ended"), "{names:?}");
        let started = names.iter().filter(|n| **n == "action_started").count();
        let finished = names.iter().filter(|n| **n == "action_finished").count();
        assert_eq!(started, finished, "{names:?}");
        assert!(
            events
                .iter()
                .any(|e| e["event"] == "changed" && e["change"]["Answer"] == "SQLite, please"),
            "{events:?}"
        );
        let first = events
            .iter()
            .find(|e| e["event"] == "action_started")
            .unwrap();
        assert_eq!(first["action"], "init");
        assert!(
            first["ts"].as_str().is_some_and(|t| t.ends_with('Z')),
            "{first}"
        );
        assert_eq!(events.last().unwrap()["status"], "passed");
    }
}
