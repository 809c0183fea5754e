//! The validate result of a plain test command (`[actions.validate] command`): its exit status
//! says whether the tests passed, and its output, where a known runner printed it (cargo test,
//! pytest, Jest, go test, TAP, or a plain `N passed, N failed` line), gives the counts and the
//! failed tests' names (the runners' real output is tested in `tests/runners.rs`).

use serde_json::{Map, json};

use crate::protocol::{ActionResult, ResultStatus};

/// Counts read from a test runner's output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TestCounts {
    /// `None` where the runner does not say (`go test` without `-v` prints only failures).
    pub passed: Option<u64>,
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
            if let Some(p) = c.passed
                && p.saturating_add(c.failed) > 0
            {
                let rate = (p as f64 * 1000.0 / (p as f64 + c.failed as f64)).round() / 10.0;
                updates.insert("pass_rate".into(), json!(rate));
            }
            updates.insert("failed_tests".into(), json!(c.failed_tests));
            match c.passed {
                Some(p) => format!("{p} passed, {} failed", c.failed),
                None => format!("{} failed", c.failed),
            }
        }
        None if passed => "tests passed".to_owned(),
        None => "tests failed".to_owned(),
    };
    if counts.as_ref().is_none_or(|c| c.passed.is_none()) {
        updates
            .entry("pass_rate")
            .or_insert(json!(if passed { 100.0 } else { 0.0 }));
    }
    ActionResult {
        status: ResultStatus::Success,
        summary,
        state_updates: updates,
        ..ActionResult::bare_success()
    }
}

/// Reads pass/fail counts and failed test names from libtest (cargo test), pytest, jest,
/// go test (`-v` or not), TAP, or a plain `N passed, N failed` line.
pub fn parse_test_output(text: &str) -> Option<TestCounts> {
    let mut libtest: Option<(u64, u64)> = None;
    let mut summary: Option<(u64, u64)> = None;
    let (mut go_passed, mut go_failed, mut go_verbose) = (0u64, Vec::new(), false);
    let (mut tap_passed, mut tap_failed) = (0u64, 0u64);
    let mut failed_names = Vec::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("test result:") {
            let (p, f) = libtest.unwrap_or_default();
            libtest = Some((
                p.saturating_add(number_before(rest, "passed").unwrap_or(0)),
                f.saturating_add(number_before(rest, "failed").unwrap_or(0)),
            ));
        } else if let Some(name) = t
            .strip_prefix("test ")
            .and_then(|r| r.strip_suffix(" ... FAILED"))
        {
            failed_names.push(name.to_owned());
        } else if let Some(name) = t.strip_prefix("FAILED ") {
            // pytest: `FAILED tests/test_x.py::test_y - AssertionError`
            failed_names.push(name.split(" - ").next().unwrap_or(name).to_owned());
        } else if let Some(name) = t.strip_prefix("● ") {
            // jest: `● describe › test name` heads each failure's details.
            if !matches!(name, "Test suite failed to run" | "Console") {
                failed_names.push(name.to_owned());
            }
        } else if let Some(name) = t.strip_prefix("--- FAIL: ") {
            go_failed.push(name.split_whitespace().next().unwrap_or(name).to_owned());
        } else if t.starts_with("--- PASS: ") {
            go_passed += 1;
        } else if t.starts_with("=== RUN ") {
            go_verbose = true;
        } else if let Some(rest) = t.strip_prefix("not ok ") {
            tap_failed += 1;
            failed_names.push(tap_name(rest));
        } else if t.starts_with("ok ") && t[3..].starts_with(|c: char| c.is_ascii_digit()) {
            tap_passed += 1;
        } else if t.starts_with("Tests:") || t.starts_with('=') || is_plain_summary(t) {
            // jest `Tests: 1 failed, 3 passed, 4 total`, pytest `=== 3 passed, 1 failed in 0.1s ===`
            // (`-q`: the same without the rules), or a plain `3 passed, 1 failed`.
            let passed = number_before(t, "passed");
            let failed = number_before(t, "failed");
            if passed.is_some() || failed.is_some() {
                summary = Some((passed.unwrap_or(0), failed.unwrap_or(0)));
            }
        }
    }
    // go: a failing subtest also fails its parent; count the leaves only.
    let go_leaves: Vec<String> = go_failed
        .iter()
        .filter(|n| !go_failed.iter().any(|m| m.starts_with(&format!("{n}/"))))
        .cloned()
        .collect();
    let mut counts = if let Some((passed, failed)) = libtest {
        TestCounts {
            passed: Some(passed),
            failed,
            failed_tests: Vec::new(),
        }
    } else if let Some((passed, failed)) = summary {
        TestCounts {
            passed: Some(passed),
            failed,
            failed_tests: Vec::new(),
        }
    } else if go_passed > 0 || !go_leaves.is_empty() {
        failed_names.extend(go_leaves.iter().cloned());
        TestCounts {
            // Without -v, go prints nothing for tests that pass.
            passed: (go_verbose || go_passed > 0).then_some(go_passed),
            failed: go_leaves.len() as u64,
            failed_tests: Vec::new(),
        }
    } else if tap_passed + tap_failed > 0 {
        TestCounts {
            passed: Some(tap_passed),
            failed: tap_failed,
            failed_tests: Vec::new(),
        }
    } else {
        return None;
    };
    failed_names.dedup();
    failed_names.truncate(crate::workflow::ccw_loop::state::FAILED_TESTS_WINDOW);
    counts.failed_tests = failed_names;
    Some(counts)
}

/// `3 passed, 1 failed`, `1 failed, 2 passed, 1 skipped in 0.02s`: a line that is a summary.
fn is_plain_summary(t: &str) -> bool {
    let first = t.split_whitespace().next().unwrap_or("");
    first.parse::<u64>().is_ok() && (t.contains(" passed") || t.contains(" failed"))
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
    fn parses_tap_plain_summaries_and_go_subtests() {
        // The real runners' output is tested in tests/runners.rs, on captured fixtures.
        let tap = "ok 1 - add\nnot ok 2 - mul # expected 12\n2 passed, 1 failed\n";
        let c = parse_test_output(tap).unwrap();
        assert_eq!(
            (c.passed, c.failed, c.failed_tests),
            (Some(2), 1, vec!["mul".to_owned()])
        );
        let tap = "ok 1 - add\nnot ok 2 - mul # expected 12\n";
        assert_eq!(
            parse_test_output(tap).map(|c| (c.passed, c.failed)),
            Some((Some(1), 1))
        );
        let go = "=== RUN   TestT\n--- FAIL: TestT (0.00s)\n    --- PASS: TestT/one (0.00s)\n    --- FAIL: TestT/two (0.00s)\nFAIL\n";
        let c = parse_test_output(go).unwrap();
        assert_eq!(
            (c.passed, c.failed, c.failed_tests),
            (Some(1), 1, vec!["TestT/two".to_owned()])
        );
        assert!(parse_test_output("all good\nbuilt 3 passed targets? no\n").is_none());
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
