//! Agent executors through the real binary, with stand-in `claude`, `codex`, `gemini` and `qwen`
//! programs first on PATH that replay recorded transcripts (tests/fixtures/agents/, see its
//! README) in each documented format, with the default config's invocations.

mod common;

use std::process::{Output, Stdio};

use common::*;
use serde_json::Value;

/// Short graces, so lingering and killing are quick; everything else is the default config.
const AGENT_CONFIG: &str = r#"
retry_backoff = 0.01
rate_limit_wait = 0.2

[executor_defaults]
kill_grace = 0.5
final_grace = 0.3
"#;

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/agents/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// A project whose `bin/NAME` replays `transcript` (a fixture file) on `stream`, then runs
/// `after` and exits with `exit`. It reads its prompt to the end first: if loopd left stdin
/// open, it would hang there. The recorded result's `greeting_written` becomes `passed`, so a
/// validate accepts it.
fn stand_in(name: &str, transcript: &str, stream: &str, exit: i32, after: &str) -> Project {
    let p = Project::new("");
    p.config(AGENT_CONFIG);
    let redirect = if stream == "stderr" { " >&2" } else { "" };
    p.script(
        name,
        &format!(
            "cat > /dev/null\necho \"$*\" >> {name}.args\nsed 's/greeting_written/passed/g' '{}'{redirect}\n{after}\nexit {exit}\n",
            fixture(transcript)
        ),
    );
    p
}

/// `loopd ARGS...` with the project's `bin/` first on PATH.
fn loopd_with_agents(p: &Project, args: &[&str]) -> Output {
    let path = format!(
        "{}:{}",
        p.root.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let child = p
        .loopd()
        .env("PATH", path)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn loopd");
    wait_output(child, DEADLINE)
}

#[test]
fn each_agent_runs_a_loop_to_completion_with_its_tokens() {
    for (agent, transcript, flags) in [
        (
            "claude",
            "claude-success.jsonl",
            "-p --output-format stream-json --verbose",
        ),
        ("codex", "codex-success.jsonl", "exec --json"),
        ("gemini", "gemini-success.json", "--output-format json"),
        ("qwen", "qwen-success.jsonl", "--output-format stream-json"),
    ] {
        let p = stand_in(agent, transcript, "stdout", 0, "");
        let id = p.create(&["--title", "t", "--task", "one"]);
        let out = loopd_with_agents(&p, &["run", &id, "--executor", agent]);
        assert_eq!(out.status.code(), Some(0), "{agent}: {}", stderr(&out));
        let args = std::fs::read_to_string(p.root.join(format!("{agent}.args"))).unwrap();
        assert!(
            args.lines().all(|l| l.contains(flags)),
            "{agent} was run as {args}"
        );
        let state = p.state(&id);
        let usage = &state["skill_state"]["usage"];
        let tokens = usage_tokens(usage);
        assert!(tokens > 0, "{agent}: no tokens recorded: {usage}");
        let finished = p.events_named(&id, "action_finished");
        assert!(
            finished.iter().all(|e| e["outcome"] == "success"),
            "{agent}"
        );
        assert!(
            finished.iter().all(|e| e["tokens_out"].as_u64().is_some()),
            "{agent}"
        );
        // The summary came from the fenced JSON in the agent's final message.
        assert!(
            finished[0]["summary"]
                .as_str()
                .is_some_and(|s| !s.is_empty()),
            "{agent}"
        );
        if agent == "claude" {
            let cost = usage["cost_usd"].as_f64().unwrap();
            assert!(cost > 0.0, "claude's cost was not recorded");
            assert!(finished.iter().all(|e| e["cost_usd"].as_f64().is_some()));
        }
    }
}

#[test]
fn every_failure_is_classified_and_recorded() {
    for (agent, transcript, stream, exit, outcome) in [
        (
            "claude",
            "claude-error.jsonl",
            "stdout",
            1,
            "transient_api_error",
        ),
        ("claude", "claude-max-turns.jsonl", "stdout", 1, "max_turns"),
        // Older Claude Code builds stopped at max turns with exit 0.
        ("claude", "claude-max-turns.jsonl", "stdout", 0, "max_turns"),
        (
            "claude",
            "claude-is-error-exit0.jsonl",
            "stdout",
            0,
            "transient_api_error",
        ),
        (
            "codex",
            "codex-error.jsonl",
            "stdout",
            1,
            "transient_api_error",
        ),
        ("gemini", "gemini-max-turns.json", "stderr", 53, "max_turns"),
        ("qwen", "qwen-error.jsonl", "stdout", 1, "agent_error"),
        ("claude", "README.md", "stdout", 0, "no_result"),
        ("codex", "README.md", "stdout", 3, "agent_error"),
    ] {
        let p = stand_in(agent, transcript, stream, exit, "");
        p.config(&format!("action_retries = 0\n{AGENT_CONFIG}"));
        let id = p.create(&["--title", "t", "--max-errors", "1"]);
        let out = loopd_with_agents(&p, &["run", &id, "--executor", agent]);
        let case = format!("{agent} {transcript}");
        assert_eq!(out.status.code(), Some(4), "{case}: {}", stderr(&out));
        let failed = p.events_named(&id, "action_failed");
        assert_eq!(failed.len(), 1, "{case}");
        assert_eq!(failed[0]["outcome"], outcome, "{case}: {}", failed[0]);
        let state = p.state(&id);
        assert_eq!(
            state["skill_state"]["action_history"][0]["outcome"], outcome,
            "{case}"
        );
        assert!(
            state["failure_reason"]
                .as_str()
                .unwrap()
                .contains("max_errors"),
            "{case}"
        );
    }
}

#[test]
fn a_rejected_api_key_blocks_the_loop_instead_of_failing_it() {
    // Gemini CLI's answer to a bad key: the environment's fault, not the task's.
    let p = stand_in("gemini", "gemini-error.json", "stderr", 144, "");
    p.config(&format!("action_retries = 2\n{AGENT_CONFIG}"));
    let id = p.create(&["--title", "t", "--max-errors", "1"]);
    let out = loopd_with_agents(&p, &["run", &id, "--executor", "gemini", "--exit-on-pause"]);
    assert_eq!(out.status.code(), Some(6), "paused: {}", stderr(&out));
    let state = p.state(&id);
    assert_eq!(state["status"], "paused");
    assert_eq!(state["skill_state"]["error_count"], 0);
    assert_eq!(state["current_iteration"], 0);
    assert_eq!(p.events_named(&id, "action_started").len(), 1, "no retry");
    let blocked = &state["skill_state"]["blocked"];
    assert_eq!(blocked["action"], "init");
    assert_eq!(
        blocked["reason"], "API key not valid. Please pass a valid API key.",
        "the API's own message, unwrapped: {blocked}"
    );
    let history = &state["skill_state"]["action_history"][0];
    assert_eq!(history["outcome"], "environment_error");
    let hint = &p.events_named(&id, "blocked")[0]["message"];
    assert_eq!(
        hint.as_str().unwrap(),
        format!(
            "gemini: API key not valid. Please pass a valid API key. — fix it, then `loopd resume {id}`"
        )
    );
}

#[test]
fn a_rate_limit_waits_for_its_reset_then_goes_on_without_an_error() {
    let p = Project::new("");
    p.config(AGENT_CONFIG);
    // The first call is refused until one second from now; the others succeed.
    p.script(
        "claude",
        &format!(
            r#"cat > /dev/null
if [ ! -f limited ]; then
  touch limited
  reset=$(( $(date +%s) + 1 ))
  echo '{{"type":"result","subtype":"success","is_error":true,"result":"Claude AI usage limit reached|'$reset'"}}'
  exit 1
fi
sed 's/greeting_written/passed/g' '{}'
"#,
            fixture("claude-success.jsonl")
        ),
    );
    let id = p.create(&["--title", "t", "--task", "one"]);
    let out = loopd_with_agents(&p, &["run", &id, "--executor", "claude"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let limited = p.events_named(&id, "rate_limited");
    assert_eq!(limited.len(), 1);
    assert!(
        limited[0]["until"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );
    let state = p.state(&id);
    assert_eq!(state["skill_state"]["error_count"], 0);
    let history = state["skill_state"]["action_history"].as_array().unwrap();
    assert!(history.iter().any(|h| h["outcome"] == "rate_limited"));
    // The same attempt ran again: no retry was spent.
    let init: Vec<Value> = p
        .events_named(&id, "action_finished")
        .into_iter()
        .filter(|e| e["action"] == "init")
        .collect();
    assert_eq!(init[0]["attempt"], 1);
}

#[test]
fn an_agent_lingering_after_its_final_event_is_ended_and_succeeds() {
    let p = stand_in(
        "claude",
        "claude-success.jsonl",
        "stdout",
        0,
        "sleep 1000 & echo $! >> lingering.pids\necho $$ >> lingering.pids\nwait",
    );
    let id = p.create(&["--title", "t", "--task", "one"]);
    let out = loopd_with_agents(&p, &["run", &id, "--executor", "claude"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        p.events_named(&id, "action_finished")
            .iter()
            .all(|e| e["outcome"] == "success")
    );
    for pid in std::fs::read_to_string(p.root.join("lingering.pids"))
        .unwrap()
        .lines()
    {
        assert!(
            !alive(pid.parse().unwrap()),
            "process {pid} outlived its attempt"
        );
    }
}

#[test]
fn a_spent_budget_fails_the_loop_with_a_clear_reason() {
    let p = stand_in("claude", "claude-success.jsonl", "stdout", 0, "");
    let id = p.create(&["--title", "t", "--task", "one", "--max-tokens", "100"]);
    let out = loopd_with_agents(&p, &["run", &id, "--executor", "claude"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    let state = p.state(&id);
    let reason = state["failure_reason"].as_str().unwrap();
    assert!(
        reason.contains("budget exceeded") && reason.contains("max_tokens is 100"),
        "{reason}"
    );
    // init ran and spent it; nothing ran after.
    assert_eq!(p.events_named(&id, "action_started").len(), 1);
}

#[test]
fn an_agent_crossing_the_budget_while_it_streams_is_stopped() {
    let p = Project::new("");
    p.config(AGENT_CONFIG);
    p.script(
        "claude",
        r#"cat > /dev/null
echo $$ > agent.pid
echo '{"type":"assistant","message":{"content":[{"type":"text","text":"thinking hard"}],"usage":{"input_tokens":90000,"output_tokens":20000}}}'
exec sleep 1000
"#,
    );
    let id = p.create(&["--title", "t", "--max-tokens", "50000"]);
    let out = loopd_with_agents(&p, &["run", &id, "--executor", "claude"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    let failed = p.events_named(&id, "action_failed");
    assert_eq!(failed[0]["outcome"], "budget_exceeded");
    assert_eq!(failed.len(), 1, "no retry once the budget is spent");
    assert!(!alive(read_pid(&p.root.join("agent.pid"))));
    let reason = p.state(&id)["failure_reason"].as_str().unwrap().to_owned();
    assert!(reason.contains("budget exceeded"), "{reason}");
}

#[test]
fn doctor_shows_what_would_run_and_what_is_missing() {
    let p = Project::new("");
    p.config(AGENT_CONFIG);
    let out = loopd_with_agents(&p, &["doctor"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("claude: not found on PATH") && text.contains("not ready: missing claude"),
        "{text}"
    );
    p.script(
        "claude",
        "[ \"$1\" = --version ] && echo '2.0.14 (Claude Code)'\n",
    );
    let out = loopd_with_agents(&p, &["doctor"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("2.0.14 (Claude Code)"), "{text}");
    assert!(text.contains("format claude-stream-json"), "{text}");
    assert!(
        text.contains(&p.root.join(".loop/config.toml").display().to_string()),
        "{text}"
    );
    // A project's action file and --executor show up in the plan.
    let develop = p.action_file("develop", "develop {{task_description}}\n");
    let actions = develop.parent().unwrap();
    let text = stdout(&loopd_with_agents(&p, &["doctor", "--executor", "bash"]));
    assert!(
        text.contains(&actions.join("develop.md").display().to_string()),
        "{text}"
    );
    assert!(text.contains("bash -s"), "{text}");
    // A broken action file is bad input.
    std::fs::write(actions.join("develop.md"), "develop {{nope}}\n").unwrap();
    let out = loopd_with_agents(&p, &["doctor"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

/// A project whose `bin/NAME` replays a transcript captured from the real CLI
/// (`tests/fixtures/agents/real/STEM.{stdout,stderr,exit}`, see `capture_fixtures_from_the_real_clis`
/// in tests/real_agents.rs): stdout and stderr as they were, then its exit code.
fn replay(name: &str, stem: &str) -> Project {
    let p = Project::new("");
    p.config(&format!("action_retries = 0\n{AGENT_CONFIG}"));
    let file = |ext: &str| fixture(&format!("real/{stem}.{ext}"));
    let exit = std::fs::read_to_string(file("exit")).unwrap();
    p.script(
        name,
        &format!(
            "cat > /dev/null\ncat '{}'\ncat '{}' >&2\nexit {}\n",
            file("stdout"),
            file("stderr"),
            exit.trim()
        ),
    );
    p
}

#[test]
fn transcripts_of_the_real_clis_are_read_as_they_happened() {
    for (agent, stem, outcome) in [
        ("claude", "claude-2.1.197-success", "success"),
        ("claude", "claude-2.1.197-no-key", "environment_error"),
        ("claude", "claude-2.1.197-rejected-key", "environment_error"),
        ("claude", "claude-2.1.197-rate-limit", "rate_limited"),
        ("codex", "codex-0.169.0-success", "success"),
        ("codex", "codex-0.169.0-no-key", "environment_error"),
        ("codex", "codex-0.169.0-rejected-key", "environment_error"),
        ("codex", "codex-0.169.0-rate-limit", "rate_limited"),
        ("gemini", "gemini-0.61.0-success", "success"),
        ("gemini", "gemini-0.61.0-no-key", "environment_error"),
        ("gemini", "gemini-0.61.0-rejected-key", "environment_error"),
        ("qwen", "qwen-0.15.10-success", "success"),
        ("qwen", "qwen-0.15.10-no-key", "environment_error"),
        ("qwen", "qwen-0.15.10-rejected-key", "environment_error"),
    ] {
        let p = replay(agent, stem);
        let id = p.create(&["--title", "t", "--max-errors", "1"]);
        // The transcripts are of a develop; here each plays the init, and only that attempt
        // matters: the daemon is ended once it is over.
        let path = format!(
            "{}:{}",
            p.root.join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut daemon: Running = p
            .loopd()
            .env("PATH", path)
            .args(["run", &id, "--executor", agent, "--exit-on-pause"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
            .into();
        let ended = |e: &Value| e["event"] == "action_finished" || e["event"] == "action_failed";
        wait_for("the first attempt to end", || {
            p.events(&id).iter().any(ended)
        });
        let first = p.events(&id).into_iter().find(ended).unwrap();
        assert_eq!(first["outcome"], outcome, "{stem}: {first}");
        match outcome {
            "success" => {
                assert_eq!(first["summary"], "wrote task-001.txt", "{stem}: {first}");
                assert!(
                    first["tokens_in"].as_u64().unwrap() >= 1000,
                    "{stem}: {first}"
                );
                assert!(
                    first["tokens_out"].as_u64().unwrap() >= 50,
                    "{stem}: {first}"
                );
            }
            "environment_error" => {
                let status = daemon.wait().unwrap();
                assert_eq!(status.code(), Some(6), "{stem}: paused, blocked");
                assert_eq!(p.state(&id)["skill_state"]["error_count"], 0, "{stem}");
            }
            _ => {}
        }
        if stem == "claude-2.1.197-rate-limit" {
            // Claude Code's own retry of the 429, which it would otherwise make in silence.
            let retry = p.events_named(&id, "agent_retrying");
            assert_eq!(retry[0]["status"], 429, "{stem}: {retry:?}");
            assert_eq!(retry[0]["delay_ms"], 1000, "{stem}: {retry:?}");
        }
        let _ = daemon.kill();
        let _ = daemon.wait();
    }
}
