//! Hostile executors: numbers that overflow, result files that are FIFOs or devices, output that
//! nests without end. Each ends as a failed attempt, the daemon stays small and `stop` works.

mod common;

use common::*;
use serde_json::Value;

fn code(out: &std::process::Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

/// One attempt, no retry, one error fails the loop: each case ends quickly.
fn project(format: &str, develop: &str) -> Project {
    let p = Project::new(&format!(
        "cat > /dev/null\ncase \"$LOOPD_ACTION\" in\n  init) echo '{{\"status\":\"success\",\"state_updates\":{{\"tasks\":[{{\"description\":\"a\"}}]}}}}' > \"$LOOPD_RESULT_FILE\" ;;\n  develop) {develop} ;;\n  *) echo '{{\"status\":\"success\"}}' > \"$LOOPD_RESULT_FILE\" ;;\nesac\n"
    ));
    p.config(&format!(
        "retry_backoff = 0.01\naction_retries = 0\nrate_limit_max_wait = 3600.0\nexecutor = \"fake\"\n\
         [executor_defaults]\nkill_grace = 0.5\n\
         [executors.fake]\ncommand = [\"sh\", \"bin/agent.sh\"]\nformat = \"{format}\"\n"
    ));
    p
}

fn failed_attempt(p: &Project, id: &str) -> Value {
    p.events(id)
        .into_iter()
        .find(|e| e["event"] == "action_failed" && e["action"] == "develop")
        .expect("the develop attempt failed")
}

#[test]
fn result_files_that_are_fifos_devices_or_links_fail_the_attempt_at_once() {
    for (what, develop, needle) in [
        ("a FIFO", "mkfifo \"$LOOPD_RESULT_FILE\"", "FIFO"),
        (
            "/dev/zero",
            "ln -s /dev/zero \"$LOOPD_RESULT_FILE\"",
            "symlink",
        ),
        (
            "a hard link",
            "echo '{\"status\":\"success\"}' > mine; ln mine \"$LOOPD_RESULT_FILE\"",
            "hard link",
        ),
    ] {
        let p = project("json", develop);
        let id = p.create(&["--title", "t", "--max-errors", "1"]);
        let (out, peak_kib) = wait_watching_rss(p.spawn_run(&id, &[]));
        assert_eq!(code(&out), 4, "{what}: {}", stderr(&out));
        let failed = failed_attempt(&p, &id);
        let error = failed["error"].as_str().unwrap_or("");
        assert!(error.contains(needle), "{what}: {error}");
        assert!(peak_kib < 50 * 1024, "{what}: peak RSS {peak_kib} KiB");
    }
}

#[test]
fn deeply_nested_output_is_scanned_in_linear_time() {
    // 1.2 MB of `{"a":` that never closes, then a failing exit.
    let p = project(
        "json",
        "awk 'BEGIN { for (i = 0; i < 240000; i++) printf \"{\\\"a\\\":\" }'; exit 1",
    );
    let id = p.create(&["--title", "t", "--max-errors", "1"]);
    let (out, peak_kib) = wait_watching_rss(p.spawn_run(&id, &[]));
    assert_eq!(code(&out), 4, "{}", stderr(&out));
    let failed = failed_attempt(&p, &id);
    assert_eq!(failed["error"], "exit code 1");
    // A generous bound that catches the quadratic scan (seconds), not a measurement.
    let ms = failed["duration_ms"].as_u64().unwrap();
    assert!(ms < 5000, "the attempt took {ms} ms");
    assert!(peak_kib < 50 * 1024, "peak RSS {peak_kib} KiB");
}

#[test]
fn reset_times_beyond_any_calendar_wait_at_most_the_limit_and_stop_works() {
    for (what, line) in [
        (
            "days",
            r#"{"type":"turn.failed","error":{"message":"rate limit reached, retry in 99999999999999 days"}}"#,
        ),
        (
            "retry_after",
            r#"{"type":"turn.failed","error":{"message":"rate limited","retry_after":1e300}}"#,
        ),
        (
            "epoch",
            r#"{"type":"turn.failed","error":{"message":"usage limit reached|99999999999999999"}}"#,
        ),
    ] {
        let p = project("codex-jsonl", &format!("echo '{line}'; exit 1"));
        let id = p.create(&["--title", "t"]);
        let child = p.spawn_run(&id, &[]);
        wait_for("the rate limit", || {
            p.events(&id).iter().any(|e| e["event"] == "rate_limited")
        });
        let limited = p
            .events(&id)
            .into_iter()
            .find(|e| e["event"] == "rate_limited")
            .unwrap();
        let until = limited["until"].as_str().unwrap();
        let until = chrono::DateTime::parse_from_rfc3339(until).unwrap();
        let wait = until.signed_duration_since(chrono::Utc::now());
        assert!(
            wait <= chrono::Duration::seconds(3601),
            "{what}: waits until {until}"
        );
        assert!(p.output(&["stop", &id]).status.success());
        let out = wait_output(child, DEADLINE);
        assert_eq!(code(&out), 5, "{what}: {}", stderr(&out));
        assert_eq!(p.state(&id)["status"], "failed", "{what}");
    }
}
