//! From a finished [`Run`] to an attempt's verdict: find the result (the result file, else the
//! output according to the executor's format, else the exit code) and classify the attempt.

use std::path::Path;

use serde_json::{Map, Value, json};

use super::{Cut, Run};
use crate::config::Format;
use crate::protocol::{ActionResult, ResultStatus};

/// A result file larger than this is refused rather than read.
const RESULT_FILE_CAP: u64 = 4 << 20;

/// How an attempt ended.
#[derive(Clone, Debug)]
pub enum Verdict {
    Success(ActionResult),
    Failed {
        message: String,
        /// The result the executor reported, if any.
        result: Option<ActionResult>,
    },
    /// Ended from outside (pause, stop, shutdown): neither a success nor an error.
    Interrupted,
}

/// Classifies a finished run.
pub fn verdict(format: Format, result_file: &Path, run: &Run) -> Verdict {
    match run.cut {
        Some(Cut::Cancelled) => return Verdict::Interrupted,
        Some(Cut::Timeout(d)) => return failed(format!("timed out after {}", secs(d))),
        Some(Cut::Idle(d)) => return failed(format!("no output for {}", secs(d))),
        None => {}
    }
    let exit_code = run.status.and_then(|s| s.code());
    let exit_failure = match (exit_code, run.status) {
        (Some(0), _) => None,
        (Some(code), _) => Some(format!("exit code {code}")),
        (None, Some(status)) => {
            use std::os::unix::process::ExitStatusExt;
            Some(match status.signal() {
                Some(sig) => format!("killed by signal {sig}"),
                None => "ended abnormally".to_owned(),
            })
        }
        (None, None) => Some("ended without an exit status".to_owned()),
    };
    let reported = match read_result_file(result_file) {
        Some(r) => Some(r),
        None => match format {
            Format::Json => last_json_object(&run.stdout_tail).map(ActionResult::from_value),
            Format::Text => None,
            Format::Test => {
                return Verdict::Success(test_result(exit_code == Some(0), &run.output_tail));
            }
        },
    };
    match reported {
        Some(Err(reason)) => failed(reason),
        Some(Ok(result)) => match (result.status, exit_failure) {
            (ResultStatus::Success, None) => Verdict::Success(result),
            (ResultStatus::Success, Some(exit)) => Verdict::Failed {
                message: format!("{exit} after reporting success"),
                result: Some(result),
            },
            (ResultStatus::Failed, _) => Verdict::Failed {
                message: if result.summary.is_empty() {
                    "the executor reported failure".to_owned()
                } else {
                    format!("reported failure: {}", result.summary)
                },
                result: Some(result),
            },
            (ResultStatus::NeedsInput, _) => Verdict::Failed {
                message: format!("needs input: {}", result.summary),
                result: Some(result),
            },
        },
        None => match exit_failure {
            None => Verdict::Success(ActionResult::bare_success()),
            Some(exit) => failed(exit),
        },
    }
}

fn failed(message: String) -> Verdict {
    Verdict::Failed {
        message,
        result: None,
    }
}

fn secs(d: std::time::Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

/// The result the executor wrote to `$LOOPD_RESULT_FILE`, if it wrote one.
fn read_result_file(path: &Path) -> Option<Result<ActionResult, String>> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.len() > RESULT_FILE_CAP {
        return Some(Err(format!(
            "result file is {} bytes, over the {} byte cap",
            meta.len(),
            RESULT_FILE_CAP
        )));
    }
    let text = std::fs::read(path).ok()?;
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

/// The last top-level JSON object in some output, wherever it sits (alone on a line, inside a
/// fenced code block, after prose).
pub fn last_json_object(bytes: &[u8]) -> Option<Value> {
    let text = String::from_utf8_lossy(bytes);
    let mut last = None;
    let mut pos = 0;
    while let Some(offset) = text[pos..].find('{') {
        let start = pos + offset;
        let mut stream = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
        match stream.next() {
            Some(Ok(value @ Value::Object(_))) => {
                pos = start + stream.byte_offset();
                last = Some(value);
            }
            _ => pos = start + 1,
        }
    }
    last
}

/// Counts read from a test runner's output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TestCounts {
    pub passed: u64,
    pub failed: u64,
    pub failed_tests: Vec<String>,
}

/// The validate result of a plain test command: exit 0 means passed; counts where recognisable.
pub fn test_result(passed: bool, output: &[u8]) -> ActionResult {
    let text = String::from_utf8_lossy(output);
    let counts = parse_test_output(&text);
    let mut updates = Map::new();
    updates.insert("passed".into(), json!(passed));
    let summary = match &counts {
        Some(c) => {
            let total = c.passed + c.failed;
            if total > 0 {
                let rate = (c.passed as f64 * 1000.0 / total as f64).round() / 10.0;
                updates.insert("pass_rate".into(), json!(rate));
            }
            updates.insert("failed_tests".into(), json!(c.failed_tests));
            format!("{} passed, {} failed", c.passed, c.failed)
        }
        None if passed => "tests passed".to_owned(),
        None => "tests failed".to_owned(),
    };
    if counts.is_none() {
        updates.insert("pass_rate".into(), json!(if passed { 100.0 } else { 0.0 }));
    }
    ActionResult {
        status: ResultStatus::Success,
        summary,
        state_updates: updates,
        files_changed: Vec::new(),
    }
}

/// Reads pass/fail counts from libtest (cargo test), pytest, jest, go test, TAP, or a plain
/// `N passed, N failed` line.
pub fn parse_test_output(text: &str) -> Option<TestCounts> {
    let mut libtest = TestCounts::default();
    let mut libtest_seen = false;
    let mut summary: Option<TestCounts> = None;
    let mut go = TestCounts::default();
    let mut tap = TestCounts::default();
    let mut failed_names = Vec::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("test result:") {
            libtest_seen = true;
            libtest.passed += number_before(rest, "passed").unwrap_or(0);
            libtest.failed += number_before(rest, "failed").unwrap_or(0);
        } else if let Some(name) = t
            .strip_prefix("test ")
            .and_then(|r| r.strip_suffix(" ... FAILED"))
        {
            failed_names.push(name.to_owned());
        } else if let Some(name) = t.strip_prefix("FAILED ") {
            // pytest: `FAILED tests/test_x.py::test_y - AssertionError`
            failed_names.push(name.split(" - ").next().unwrap_or(name).to_owned());
        } else if let Some(name) = t.strip_prefix("--- FAIL: ") {
            go.failed += 1;
            failed_names.push(name.split_whitespace().next().unwrap_or(name).to_owned());
        } else if t.starts_with("--- PASS: ") {
            go.passed += 1;
        } else if let Some(rest) = t.strip_prefix("not ok ") {
            tap.failed += 1;
            failed_names.push(tap_name(rest));
        } else if t.starts_with("ok ") && t[3..].starts_with(|c: char| c.is_ascii_digit()) {
            tap.passed += 1;
        } else if t.contains("passed") || t.contains("failed") {
            // pytest `=== 3 passed, 1 failed in 0.1s ===`, jest `Tests: 1 failed, 3 passed, 4 total`,
            // or a plain `3 passed, 1 failed`.
            let passed = number_before(t, "passed");
            let failed = number_before(t, "failed");
            if passed.is_some() || failed.is_some() {
                summary = Some(TestCounts {
                    passed: passed.unwrap_or(0),
                    failed: failed.unwrap_or(0),
                    failed_tests: Vec::new(),
                });
            }
        }
    }
    let mut counts = if libtest_seen {
        libtest
    } else if let Some(s) = summary {
        s
    } else if go.passed + go.failed > 0 {
        go
    } else if tap.passed + tap.failed > 0 {
        tap
    } else {
        return None;
    };
    failed_names.truncate(crate::state::model::FAILED_TESTS_WINDOW);
    counts.failed_tests = failed_names;
    Some(counts)
}

fn tap_name(rest: &str) -> String {
    // `3 - name # comment`
    let rest = rest
        .trim_start_matches(|c: char| c.is_ascii_digit())
        .trim_start();
    let rest = rest.strip_prefix("- ").unwrap_or(rest);
    rest.split(" # ").next().unwrap_or(rest).trim().to_owned()
}

/// The number just before `word` in `text` (`"3 passed"` → 3).
fn number_before(text: &str, word: &str) -> Option<u64> {
    let idx = text.find(word)?;
    let before = text[..idx].trim_end();
    let digits: String = before
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
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
    fn parses_test_runner_summaries() {
        let libtest = "running 3 tests\ntest a ... ok\ntest m::b ... FAILED\ntest c ... ok\n\ntest result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n";
        let c = parse_test_output(libtest).unwrap();
        assert_eq!(
            (c.passed, c.failed, c.failed_tests.clone()),
            (2, 1, vec!["m::b".to_owned()])
        );
        let pytest = "FAILED tests/test_x.py::test_y - assert 1 == 2\n==== 1 failed, 4 passed in 0.12s ====\n";
        let c = parse_test_output(pytest).unwrap();
        assert_eq!((c.passed, c.failed), (4, 1));
        assert_eq!(c.failed_tests, ["tests/test_x.py::test_y"]);
        let jest = "Tests:       1 failed, 3 passed, 4 total\n";
        assert_eq!(
            parse_test_output(jest).map(|c| (c.passed, c.failed)),
            Some((3, 1))
        );
        let go = "=== RUN   TestA\n--- PASS: TestA (0.00s)\n--- FAIL: TestB (0.00s)\nFAIL\n";
        let c = parse_test_output(go).unwrap();
        assert_eq!(
            (c.passed, c.failed, c.failed_tests.clone()),
            (1, 1, vec!["TestB".to_owned()])
        );
        let tap = "ok 1 - add\nnot ok 2 - mul # expected 12\n";
        let c = parse_test_output(tap).unwrap();
        assert_eq!(
            (c.passed, c.failed, c.failed_tests.clone()),
            (1, 1, vec!["mul".to_owned()])
        );
        assert!(parse_test_output("all good\n").is_none());
    }

    #[test]
    fn test_command_result_is_never_an_error() {
        let r = test_result(
            false,
            b"ok 1 - a\nnot ok 2 - b\n2 tests: 1 passed, 1 failed\n",
        );
        assert_eq!(r.status, ResultStatus::Success);
        assert_eq!(r.state_updates["passed"], false);
        assert_eq!(r.state_updates["pass_rate"], 50.0);
        assert_eq!(r.state_updates["failed_tests"], json!(["b"]));
    }
}
