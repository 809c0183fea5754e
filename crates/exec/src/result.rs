//! From a finished [`Run`] to an attempt's verdict: find the result (the result file, else the
//! output according to the executor's format, else the exit code) and classify the attempt.

use loopd_core::attempt::{AttemptOutcome, Verdict};
use loopd_core::protocol::{ActionResult, ResultStatus, last_json_object};
use loopd_core::test_output::test_result;
use serde_json::Value;

use super::{Cut, Run};
use crate::settings::Format;
use loopd_fs::Dir;

/// A result file larger than this is refused rather than read.
const RESULT_FILE_CAP: u64 = 4 << 20;

/// The longest question kept, in characters.
const MAX_QUESTION: usize = 4000;

fn failed(outcome: AttemptOutcome, message: impl Into<String>) -> Verdict {
    Verdict::Failed {
        outcome,
        message: message.into(),
    }
}

/// What the executor reported in `$LOOPD_RESULT_FILE`, if it wrote it (see [`read_result_file`]).
pub type Reported = Option<Result<ActionResult, String>>;

/// Classifies a finished run. Summaries and messages come out as one line each.
pub fn verdict(format: Format, reported: Reported, run: &Run) -> Verdict {
    match classify(format, reported, run) {
        Verdict::Success(mut result) => {
            result.summary = one_line(&result.summary);
            Verdict::Success(result)
        }
        Verdict::Failed { outcome, message } => Verdict::Failed {
            outcome,
            message: one_line(&message),
        },
        Verdict::RateLimited { until, message } => Verdict::RateLimited {
            until,
            message: one_line(&message),
        },
        Verdict::Interrupted => Verdict::Interrupted,
        Verdict::Blocked { message } => Verdict::Blocked {
            message: one_line(&message),
        },
        Verdict::NeedsInput { question } => Verdict::NeedsInput {
            question: question.trim().chars().take(MAX_QUESTION).collect(),
        },
    }
}

/// `text` with each gRPC status's debug dump (`Status { code: Unavailable, message: "...",
/// source: ... }`, as a Temporal client's errors print it) said in words: `the server answered
/// unavailable (...)`. No such dump reaches a person.
pub fn without_dumps(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("Status {") {
        out.push_str(&rest[..at]);
        let dump = &rest[at..];
        // The dump ends at its brace's match.
        let mut depth = 0usize;
        let end = dump
            .char_indices()
            .find_map(|(i, c)| match c {
                '{' => {
                    depth += 1;
                    None
                }
                '}' if depth == 1 => Some(i + 1),
                '}' => {
                    depth -= 1;
                    None
                }
                _ => None,
            })
            .unwrap_or(dump.len());
        let dump = &dump[..end];
        let field = |name: &str| {
            let value = &dump[dump.find(name)? + name.len()..];
            let value = value.trim_start();
            let value = match value.strip_prefix('"') {
                Some(quoted) => &quoted[..quoted.find('"').unwrap_or(quoted.len())],
                None => &value[..value.find([',', '}']).unwrap_or(value.len())],
            };
            Some(value.trim().to_owned())
        };
        let code = field("code:").unwrap_or_else(|| "an error".to_owned());
        match field("message:").filter(|m| !m.is_empty()) {
            Some(message) => out.push_str(&format!(
                "the server answered {} ({message})",
                code.to_lowercase()
            )),
            None => out.push_str(&format!("the server answered {}", code.to_lowercase())),
        }
        rest = &rest[at + end..];
    }
    out.push_str(rest);
    // A status as it displays itself: `code: 'The operation was cancelled', message: "...",
    // source: tonic::transport::Error(...)`.
    if let Some(at) = out.find("code: '") {
        let after = &out[at + "code: '".len()..];
        let code = &after[..after.find('\'').unwrap_or(after.len())];
        let message = after
            .find("message: \"")
            .map(|m| &after[m + "message: \"".len()..])
            .map(|m| &m[..m.find('"').unwrap_or(m.len())])
            .filter(|m| !m.is_empty());
        let said = match message {
            Some(message) => format!("the server answered {} ({message})", code.to_lowercase()),
            None => format!("the server answered {}", code.to_lowercase()),
        };
        out = format!("{}{said}", &out[..at]);
    }
    out
}

/// A text made one line for logs and status: line breaks become ` / `, and it is cut at 500
/// characters.
pub fn one_line(text: &str) -> String {
    const MAX: usize = 500;
    let joined = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" / ");
    if joined.chars().count() <= MAX {
        joined
    } else {
        let mut cut: String = joined.chars().take(MAX).collect();
        cut.push('…');
        cut
    }
}

fn classify(format: Format, reported: Reported, run: &Run) -> Verdict {
    use AttemptOutcome as O;
    match run.cut {
        Some(Cut::Cancelled) => return Verdict::Interrupted,
        Some(Cut::Timeout(d)) => return failed(O::Timeout, format!("timed out after {}", secs(d))),
        Some(Cut::Idle(d)) => return failed(O::Timeout, format!("no output for {}", secs(d))),
        Some(Cut::Budget) => {
            return failed(
                O::BudgetExceeded,
                "the loop's budget ran out while the agent worked",
            );
        }
        Some(Cut::Lingered) | None => {}
    }
    let exit_code = run.status.and_then(|s| s.code());
    if let Some(agent) = &run.agent {
        return match agent.classify(exit_code, &run.output_tail) {
            (O::Success, _) => match reported {
                Some(reported) => judge(reported, None),
                // The result in the agent's final message, else a success with no updates.
                None => match agent
                    .last_message
                    .as_deref()
                    .and_then(|m| last_json_object(m.as_bytes()))
                {
                    Some(v) => judge(ActionResult::from_value(v), None),
                    None => Verdict::Success(ActionResult {
                        summary: first_line(agent.last_message.as_deref().unwrap_or("")),
                        ..ActionResult::bare_success()
                    }),
                },
            },
            (O::RateLimited, message) => Verdict::RateLimited {
                until: agent.reset_at,
                message: message.unwrap_or_else(|| "rate limited".into()),
            },
            (O::EnvironmentError, message) => Verdict::Blocked {
                message: message.unwrap_or_else(|| "the agent cannot run here".into()),
            },
            (outcome, message) => {
                failed(outcome, message.unwrap_or_else(|| outcome.as_str().into()))
            }
        };
    }
    let last_line = super::agent::last_meaningful_line(&run.output_tail);
    let said = |what: String| super::agent::with_reason(what, last_line.as_deref());
    let exit_failure = match (exit_code, run.status) {
        (Some(0), _) => None,
        // The shell's "not executable" and "command not found": nothing the task can fix, and
        // never "tests failed".
        (Some(code @ (126 | 127)), _) => {
            return Verdict::Blocked {
                message: said(format!("exit code {code}")),
            };
        }
        (Some(code), _) => Some((O::AgentError, said(format!("exit code {code}")))),
        (None, Some(status)) => {
            use std::os::unix::process::ExitStatusExt;
            Some(match status.signal() {
                Some(sig) => (O::Killed, format!("killed by signal {sig}")),
                None => (O::AgentError, "ended abnormally".to_owned()),
            })
        }
        (None, None) => Some((O::AgentError, "ended without an exit status".to_owned())),
    };
    let reported = match reported {
        Some(r) => Some(r),
        None => match format {
            Format::Test => {
                return Verdict::Success(test_result(exit_code == Some(0), &run.output_tail));
            }
            Format::Text => None,
            _ => last_json_object(&run.stdout_tail).map(ActionResult::from_value),
        },
    };
    match (reported, exit_failure) {
        (Some(reported), exit) => judge(reported, exit.map(|(_, e)| e)),
        (None, None) => Verdict::Success(ActionResult::bare_success()),
        (None, Some((outcome, message))) => failed(outcome, message),
    }
}

/// The verdict on a result the executor reported (and how it exited, if it failed).
fn judge(reported: Result<ActionResult, String>, exit_failure: Option<String>) -> Verdict {
    use AttemptOutcome as O;
    let result = match reported {
        Ok(result) => result,
        Err(reason) => return failed(O::AgentError, reason),
    };
    match (result.status, exit_failure) {
        (ResultStatus::Success, None) => Verdict::Success(result),
        (ResultStatus::Success, Some(exit)) => {
            failed(O::AgentError, format!("{exit} after reporting success"))
        }
        (ResultStatus::Failed, _) if result.summary.is_empty() => {
            failed(O::AgentError, "the executor reported failure")
        }
        (ResultStatus::Failed, _) => failed(
            O::AgentError,
            format!("reported failure: {}", result.summary),
        ),
        (ResultStatus::NeedsInput, _) => {
            let question = result.question.filter(|q| !q.trim().is_empty());
            match question.or_else(|| Some(result.summary).filter(|s| !s.trim().is_empty())) {
                Some(question) => Verdict::NeedsInput { question },
                None => failed(O::AgentError, "needs_input without a question"),
            }
        }
    }
}

/// The first line of a text.
fn first_line(text: &str) -> String {
    text.trim().lines().next().unwrap_or("").to_owned()
}

fn secs(d: std::time::Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

/// The file each attempt of a loop may write its result to (`$LOOPD_RESULT_FILE`), in the loop's
/// actions directory: one for all its attempts, taking turns with its spare (see
/// [`empty_result_file`]), so that no attempt costs a file made and later removed (which on ext4
/// costs a search for a free inode).
pub const RESULT_FILE: &str = "result.json";

/// Empties the result file `name` ([`RESULT_FILE`], or one of the attempts run at once) before
/// an attempt, making it if it is missing; what is there that is not a plain file (an executor's
/// symlink) is removed first.
///
/// The file the last attempt wrote is not emptied here, between two attempts: emptying a file
/// frees its blocks, which on ext4 without a journal mounted with `discard` is a discard the
/// caller waits for (0.1 ms on this machine's disk). Its spare (`.NAME.spare.tmp`), emptied while
/// the last attempt ran ([`stock_result_file`]), is swapped in instead; the file that held the
/// result becomes the spare.
pub fn empty_result_file(actions: &loopd_fs::Dir, name: &str) {
    let spare = spare_of(name);
    let spare_empty = actions
        .open_rw(&spare)
        .and_then(|file| file.metadata())
        .is_ok_and(|meta| meta.len() == 0);
    if !(spare_empty && actions.exchange(&spare, name).is_ok()) {
        made_empty(actions, name);
    }
}

/// Empties the spare of the result file `name` while an attempt runs, for the next attempt
/// ([`empty_result_file`]), off the path between two attempts.
pub fn stock_result_file(actions: &loopd_fs::Dir, name: &str) {
    made_empty(actions, &spare_of(name));
}

/// The spare of result file `name`: the file the attempt before the last one wrote.
fn spare_of(name: &str) -> String {
    format!(".{name}.spare{}", loopd_fs::TEMP_SUFFIX)
}

/// Makes `name` an empty plain file, emptied in place, or made anew where something else was
/// (an executor's symlink, a hard link, a FIFO).
fn made_empty(actions: &loopd_fs::Dir, name: &str) {
    let emptied = || {
        let file = actions.open_rw(name)?;
        match file.metadata()?.len() {
            0 => Ok(()),
            _ => file.set_len(0),
        }
    };
    if emptied().is_err() {
        let _ = actions.remove(name);
        let _ = emptied();
    }
}

/// The result the executor wrote to `$LOOPD_RESULT_FILE` (`name` in the attempts' directory),
/// if it wrote one. Read without blocking and at most `RESULT_FILE_CAP` bytes: a FIFO, a
/// device, a symlink or a hard link there is a failed attempt, never a hang.
pub fn read_result_file(dir: &Dir, name: &str) -> Reported {
    let text = match dir.read(name, RESULT_FILE_CAP) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => {
            return Some(Err(format!(
                "result file is over the {RESULT_FILE_CAP} byte cap"
            )));
        }
        Err(e) => return Some(Err(format!("result file: {e}"))),
    };
    if text.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    Some(
        serde_json::from_slice::<Value>(&text)
            .map_err(|e| format!("result file is not JSON: {e}"))
            .and_then(|v| match v {
                Value::Object(_) => ActionResult::from_value(v),
                other => Err(format!("result file holds {}, not an object", kind(&other))),
            }),
    )
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_grpc_status_dump_is_said_in_words() {
        let dump = "cannot change loop x on Temporal: Status { code: Unavailable, message: \
                    \"not ready, {try} again\", source: Some(Transport(Error { a: 1 })) } (then more)";
        assert_eq!(
            without_dumps(dump),
            "cannot change loop x on Temporal: the server answered unavailable (not ready, {try} \
             again) (then more)"
        );
        assert_eq!(
            without_dumps("Status { code: Cancelled }"),
            "the server answered cancelled"
        );
        assert_eq!(without_dumps("no dump here"), "no dump here");
        let displayed = "cannot read loop x on Temporal: Server error: code: 'The operation was \
                         cancelled', message: \"Timeout expired\", source: \
                         tonic::transport::Error(Transport, TimeoutExpired(()))";
        assert_eq!(
            without_dumps(displayed),
            "cannot read loop x on Temporal: Server error: the server answered the operation \
             was cancelled (Timeout expired)"
        );
    }

    use super::*;

    #[test]
    fn last_json_object_is_the_outermost_last() {
        let out = b"thinking {not json}\n{\"a\": 1}\nmore\n```json\n{\"status\": \"success\", \"state_updates\": {\"x\": {\"y\": 2}}}\n```\nbye";
        let v = last_json_object(out).unwrap();
        assert_eq!(v["status"], "success");
        assert_eq!(v["state_updates"]["x"]["y"], 2);
        assert!(last_json_object(b"no json here [1, 2]").is_none());
        assert!(last_json_object(&[0xff, b'{', 0xfe]).is_none());
    }

    #[test]
    fn messages_are_one_line() {
        assert_eq!(
            one_line("line one\n\n  line two\r\n"),
            "line one / line two"
        );
        assert_eq!(one_line(&"x".repeat(600)).chars().count(), 501);
    }
}
