//! A whole loop through the real binary: outcomes, exit codes, files, the CCW dashboard's loops.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use serde_json::{Value, json};

#[test]
fn a_good_agent_completes_the_loop_with_exit_0() {
    let p = Project::new(&format!("env | grep '^LOOPD_' >> env.log\n{GOOD_AGENT}"));
    let id = p.create(&["--title", "Build it", "--description", "two things"]);
    assert!(id.starts_with("loop-v2-"), "{id}");
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    let s = p.state(&id);
    assert_eq!(s["status"], "completed");
    assert!(s["completed_at"].as_str().is_some_and(|t| t.ends_with('Z')));
    let skill = &s["skill_state"];
    assert_eq!(skill["outcome"], "passed");
    let tasks = skill["develop"]["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 2);
    assert!(tasks.iter().all(|t| t["status"] == "completed"));
    assert_eq!(tasks[0]["files_changed"], json!(["f.txt"]));
    assert_eq!(skill["validate"]["passed"], true);
    assert_eq!(skill["summary"]["text"], "all done");
    // develop, develop, validate
    assert_eq!(s["current_iteration"], 3);
    assert!(skill["in_flight"].is_null());

    let names = p.event_names(&id);
    for expected in [
        "daemon_started",
        "loop_started",
        "action_started",
        "action_finished",
        "completed",
        "daemon_exited",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} in {names:?}"
        );
    }
    for e in p.events(&id) {
        assert!(e["ts"].as_str().is_some_and(|t| t.ends_with('Z')), "{e}");
        assert_eq!(e["loop_id"], id.as_str());
    }
    let started = p
        .events(&id)
        .into_iter()
        .find(|e| e["event"] == "action_started")
        .unwrap();
    assert!(started["pid"].as_u64().is_some() && started["action"] == "init");

    // The executor saw the whole environment of CONTRACT section 5.
    let env = std::fs::read_to_string(p.root.join("env.log")).unwrap();
    for var in [
        "LOOPD_LOOP_ID",
        "LOOPD_ACTION",
        "LOOPD_ITERATION",
        "LOOPD_ATTEMPT",
        "LOOPD_ROOT",
        "LOOPD_STATE_FILE",
        "LOOPD_PROGRESS_DIR",
        "LOOPD_RESULT_FILE",
        "LOOPD_TASK_ID",
        "LOOPD_TASK",
    ] {
        assert!(env.contains(&format!("{var}=")), "{var} missing");
    }
    assert!(env.contains("LOOPD_TASK=first"));

    // Progress files for people, and changes.log as NDJSON.
    let progress = p.progress(&id);
    for file in ["develop.md", "validate.md", "summary.md", "changes.log"] {
        assert!(progress.join(file).exists(), "{file}");
    }
    let changes = std::fs::read_to_string(progress.join("changes.log")).unwrap();
    let lines: Vec<Value> = changes
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for key in [
        "timestamp",
        "task_id",
        "description",
        "files_changed",
        "result",
    ] {
        assert!(lines[0].get(key).is_some(), "{key}");
    }
    let logs = std::fs::read_dir(progress.join("actions")).unwrap().count();
    assert!(logs >= 5, "one log per attempt, got {logs}");

    // status and list show it.
    let status = stdout(&p.output(&["status", &id]));
    assert!(
        status.contains("completed") && status.contains("3/10") && status.contains("2/2"),
        "{status}"
    );
    // The state file's JSON, with why it stands still (nothing: it completed, its goal met).
    let mut json_status: Value =
        serde_json::from_slice(&p.output(&["status", &id, "--json"]).stdout).unwrap();
    let shown = json_status.as_object_mut().unwrap();
    assert_eq!(shown.remove("status_reason"), Some(Value::Null));
    assert_eq!(shown.remove("next_step"), Some(Value::Null));
    assert_eq!(json_status, s);
    let list = stdout(&p.output(&["list"]));
    assert!(list.contains(&id) && list.contains("Build it"), "{list}");
    let logs = stdout(&p.output(&["logs", &id]));
    assert!(
        logs.contains("action finished") && logs.contains("completed"),
        "{logs}"
    );
    let raw = stdout(&p.output(&["logs", &id, "--json"]));
    assert!(
        raw.lines()
            .all(|l| serde_json::from_str::<Value>(l).is_ok())
    );
}

#[test]
fn a_develop_that_always_fails_ends_failed_with_exit_4() {
    let p = Project::new(&GOOD_AGENT.replace(
        "develop) echo \"$LOOPD_TASK_ID\" >> f.txt;",
        "develop) echo 'compiler exploded' >&2; exit 1;",
    ));
    let id = p.create(&["--title", "t", "--max-errors", "2"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 4, "{}", stderr(&out));
    let s = p.state(&id);
    assert_eq!(s["status"], "failed");
    let reason = s["failure_reason"].as_str().unwrap();
    assert!(
        reason.contains("max_errors (2)") && reason.contains("exit code 1"),
        "{reason}"
    );
    let skill = &s["skill_state"];
    assert_eq!(skill["error_count"], 2);
    assert_eq!(skill["errors"][0]["action"], "develop");
    // Every attempt is in the history and the event log: 3 attempts (2 retries) per develop.
    let failed = p
        .events(&id)
        .iter()
        .filter(|e| e["event"] == "action_failed")
        .count();
    assert_eq!(failed, 6);
    assert_eq!(
        p.event_names(&id).iter().filter(|n| *n == "failed").count(),
        1
    );
    assert_eq!(skill["develop"]["tasks"][0]["status"], "failed");
}

#[test]
fn a_validate_that_never_passes_stops_at_max_iterations_with_exit_3() {
    let p = Project::new(&GOOD_AGENT.replace("\"passed\":true", "\"passed\":false"));
    // Rounds that change nothing, on purpose (tests/no_progress.rs has them pause).
    p.config(&format!("no_progress_rounds = 0\n{TEST_CONFIG}"));
    let id = p.create(&["--title", "t", "--max-iterations", "7"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    let s = p.state(&id);
    assert_eq!(s["status"], "completed");
    assert_eq!(s["current_iteration"], 7);
    assert_eq!(s["skill_state"]["outcome"], "iteration_limit");
    // The loop went develop, develop, validate, then debug/validate alternately.
    let actions: Vec<String> = p
        .events(&id)
        .iter()
        .filter(|e| e["event"] == "action_finished")
        .map(|e| e["action"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        actions,
        [
            "init", "develop", "develop", "validate", "debug", "validate", "debug", "validate",
            "complete"
        ]
    );
}

#[test]
fn the_state_file_stays_small_after_400_iterations() {
    let p = Project::new(GOOD_AGENT);
    // A cheap validate that never passes: debug and validate alternate until the limit.
    p.config(&format!(
        "no_progress_rounds = 0\n{TEST_CONFIG}\n[actions.validate]\ncommand = \"false\"\n"
    ));
    let id = p.create(&["--title", "t", "--max-iterations", "400"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    let s = p.state(&id);
    assert_eq!(s["current_iteration"], 400);
    let size = std::fs::metadata(p.state_path(&id)).unwrap().len();
    assert!(
        size < 16 * 1024,
        "state file is {size} bytes after 400 iterations"
    );
    let skill = &s["skill_state"];
    assert_eq!(skill["action_history"].as_array().unwrap().len(), 10);
    assert!(skill["completed_actions"].as_array().unwrap().len() <= 20);
}

#[test]
fn a_loop_made_by_the_ccw_dashboard_runs_in_task_order_and_keeps_every_field() {
    let p = Project::new(GOOD_AGENT);
    let id = "loop-v2-20260122-abc123";
    let original = json!({
        "loop_id": id,
        "title": "Implement user authentication",
        "description": "Add login/logout functionality",
        "max_iterations": 10,
        "status": "created",
        "current_iteration": 0,
        "created_at": "2026-01-22T10:00:00+08:00",
        "updated_at": "2026-01-22T10:00:00+08:00",
        "tags": ["auth", "p1"],
        "priority": "high",
        "notes": "from the dashboard",
        "executor_config": {"tool": "gemini", "nested": {"keep": [1, 2.5, null, "x"]}},
        "dashboard_only": true
    });
    std::fs::write(
        p.state_path(id),
        serde_json::to_string_pretty(&original).unwrap(),
    )
    .unwrap();
    let tasks_dir = p.root.join(".loop").join(id);
    std::fs::create_dir_all(&tasks_dir).unwrap();
    // Out of order, and no newline after the last record.
    let tasks = [
        json!({"task_id": "T-b", "description": "second", "tool": "bash", "mode": "write", "order": 2, "status": "pending"}),
        json!({"task_id": "T-c", "description": "third", "tool": "codex", "mode": "write", "order": 3, "status": "pending"}),
        json!({"task_id": "T-a", "description": "first", "tool": "gemini", "mode": "analysis", "order": 1, "status": "pending"}),
    ];
    let text = tasks
        .iter()
        .map(Value::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(tasks_dir.join("tasks.jsonl"), text).unwrap();

    let out = p.run(id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(p.developed(id), ["T-a", "T-b", "T-c"]);
    let after = p.state(id);
    for (key, value) in original.as_object().unwrap() {
        if ["status", "updated_at", "current_iteration"].contains(&key.as_str()) {
            continue;
        }
        assert_eq!(&after[key], value, "field {key} changed");
    }
    assert_eq!(after["status"], "completed");
    let tasks = after["skill_state"]["develop"]["tasks"].as_array().unwrap();
    assert_eq!(tasks[0]["tool"], "gemini");
    assert_eq!(tasks[0]["mode"], "analysis");
}

#[test]
fn tasks_given_at_create_are_developed_in_order() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&[
        "--title", "t", "--task", "one", "--task", "two", "--task", "three",
    ]);
    let list = std::fs::read_to_string(p.root.join(format!(".loop/{id}.tasks.jsonl"))).unwrap();
    assert!(list.ends_with('\n') && list.lines().count() == 3);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let s = p.state(&id);
    let descriptions: Vec<&str> = s["skill_state"]["develop"]["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["description"].as_str().unwrap())
        .collect();
    assert_eq!(descriptions, ["one", "two", "three"]);
}

#[test]
fn a_result_printed_on_stdout_is_read_and_garbage_is_an_error() {
    // The result on stdout among other output, inside a fenced block, and no result file.
    let p = Project::new(
        r#"cat > /dev/null
case "$LOOPD_ACTION" in
  init) printf 'thinking...\n```json\n{"status":"success","state_updates":{"tasks":[{"description":"x"}]}}\n```\n' ;;
  develop) printf '\x00\xff garbage {not json\n' ;;
  validate) echo '{"status":"success","state_updates":{"passed":"yes"}}' ;;
  *) echo '{"status":"success"}' ;;
esac
"#,
    );
    let id = p.create(&["--title", "t", "--max-errors", "2"]);
    let out = p.run(&id, &[]);
    // develop prints garbage but exits 0: success with no updates. validate's result has the wrong
    // shape: an error of each attempt, twice -> max_errors.
    assert_eq!(code(&out), 4, "{}", stderr(&out));
    let s = p.state(&id);
    assert_eq!(s["skill_state"]["develop"]["tasks"][0]["description"], "x");
    assert_eq!(
        s["skill_state"]["develop"]["tasks"][0]["status"],
        "completed"
    );
    let errors = s["skill_state"]["errors"].as_array().unwrap();
    assert!(errors.iter().all(|e| e["action"] == "validate"));
    assert!(
        errors[0]["message"]
            .as_str()
            .unwrap()
            .contains("passed must be a boolean"),
        "{errors:?}"
    );
}

#[test]
fn timeouts_end_the_executor_and_count_as_failures() {
    let p = Project::new(
        r#"cat > /dev/null
echo $$ >> pids
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"x"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop) sleep 1000 ;;
  *) echo '{"status":"success","state_updates":{"passed":true}}' > "$LOOPD_RESULT_FILE" ;;
esac
"#,
    );
    p.config(&format!(
        "action_retries = 0\n{TEST_CONFIG}\n[actions.develop]\ntimeout = 0.3\n"
    ));
    let id = p.create(&["--title", "t", "--max-errors", "1"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 4, "{}", stderr(&out));
    let s = p.state(&id);
    let message = s["skill_state"]["errors"][0]["message"].as_str().unwrap();
    assert!(message.contains("timed out after 0.3s"), "{message}");
    for pid in std::fs::read_to_string(p.root.join("pids"))
        .unwrap()
        .lines()
    {
        assert!(
            !alive(pid.parse().unwrap()),
            "executor {pid} outlived its attempt"
        );
    }
}

#[test]
fn the_idle_timeout_fires_without_output() {
    let p = Project::new(
        r#"cat > /dev/null
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"x"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop) echo working; sleep 1000 ;;
esac
"#,
    );
    p.config(&format!(
        "action_retries = 0\n{TEST_CONFIG}\n[actions.develop]\nidle_timeout = 0.3\n"
    ));
    let id = p.create(&["--title", "t", "--max-errors", "1"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 4, "{}", stderr(&out));
    let message = p.state(&id)["skill_state"]["errors"][0]["message"].clone();
    assert!(
        message.as_str().unwrap().contains("no output for 0.3s"),
        "{message}"
    );
}

#[test]
fn output_is_capped_in_the_attempt_log() {
    let p = Project::new(&GOOD_AGENT.replace(
        "develop) echo",
        "develop) head -c 3000000 /dev/zero | tr '\\0' 'x'; echo",
    ));
    p.config(&TEST_CONFIG.replace("kill_grace = 0.5", "kill_grace = 0.5\noutput_cap = 100000"));
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let logs = p.progress(&id).join("actions");
    let develop_log = std::fs::read_dir(&logs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.to_string_lossy().contains("develop") && p.extension().is_some_and(|e| e == "log")
        })
        .unwrap();
    let text = std::fs::read_to_string(&develop_log).unwrap();
    assert!(text.len() < 100_200, "log is {} bytes", text.len());
    assert!(
        text.contains("output capped at 100000 bytes; 3000000 bytes in all"),
        "{}",
        &text[text.len() - 200..]
    );
}

#[test]
fn a_validate_test_command_needs_no_json() {
    let p = Project::new(GOOD_AGENT);
    p.script(
        "tests.sh",
        "echo 'running 2 tests'\necho 'test a ... ok'\necho 'test b ... ok'\necho 'test result: ok. 2 passed; 0 failed; 0 ignored'\n",
    );
    p.config(&format!(
        "{TEST_CONFIG}\n[actions.validate]\ncommand = \"sh bin/tests.sh\"\n"
    ));
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = &p.state(&id)["skill_state"]["validate"];
    assert_eq!(v["passed"], true);
    assert_eq!(v["pass_rate"], 100.0);
}

/// Every file under the state directory with its contents.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.insert(path.display().to_string(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

#[track_caller]
fn refused(p: &Project, args: &[&str], needle: &str) {
    let before = snapshot(&p.root);
    let out = p.output(args);
    let err = stderr(&out);
    assert_eq!(code(&out), 2, "{args:?}: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: one line, got {err:?}"
    );
    assert!(
        err.contains(needle),
        "{args:?}: {err:?} should mention {needle:?}"
    );
    let after = snapshot(&p.root);
    let changed: Vec<&String> = before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k))
        .collect();
    assert!(changed.is_empty(), "{args:?} changed {changed:?}");
}

#[test]
fn bad_input_exits_2_with_one_line_and_changes_nothing() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    let long = "x".repeat(300);
    for bad in ["../x", "a/b", "", long.as_str(), ".hidden"] {
        for cmd in ["run", "status", "pause", "stop", "start", "logs"] {
            refused(&p, &[cmd, bad], "bad loop id");
        }
    }
    refused(&p, &["run", "loop-v2-nope"], "unknown loop");
    refused(&p, &["status", "loop-v2-nope"], "unknown loop");
    refused(&p, &["create", "--title", "  "], "--title");
    refused(
        &p,
        &["create", "--title", "t", "--max-iterations", "0"],
        "max-iterations",
    );
    refused(&p, &["run", &id, "--executor", "nope"], "unknown executor");

    // A truncated state file is refused, and left as it was.
    let path = p.state_path(&id);
    let text = std::fs::read(&path).unwrap();
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    refused(&p, &["run", &id], "corrupt state file");
    refused(&p, &["status", &id], "corrupt state file");
    std::fs::write(&path, &text).unwrap();

    // A bad config value names the file and the key.
    p.config(&format!("{TEST_CONFIG}\nmax_errors = -3\n"));
    refused(&p, &["run", &id], "config.toml");
    p.config(&format!("{TEST_CONFIG}\nmax_errors = 0\n"));
    refused(&p, &["run", &id], "`max_errors`");
    p.config(&TEST_CONFIG.replace("format = \"json\"", "format = \"yaml\""));
    refused(&p, &["run", &id], "format");
    // An unknown placeholder in a project's action file.
    p.config(TEST_CONFIG);
    let develop = p.action_file("develop", "do {{taks}}\n");
    refused(&p, &["run", &id], "{{taks}}");
    std::fs::remove_file(develop).unwrap();
    assert_eq!(code(&p.run(&id, &[])), 0);
}

#[test]
fn logs_follow_reads_across_a_rotation_of_the_event_log() {
    let p = Project::new(&format!(
        "[ \"$LOOPD_ACTION\" = develop ] && [ ! -f go ] && {{ touch waiting; i=0; while [ ! -f go ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; }}\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t"]);
    // An event log a few events short of its rotation size (16 MiB).
    let progress = p.progress(&id);
    std::fs::create_dir_all(&progress).unwrap();
    let filler = format!(
        "{{\"event\":\"filler\",\"message\":\"{}\"}}\n",
        "x".repeat((16 << 20) - 3000)
    );
    std::fs::write(progress.join("events.jsonl"), &filler).unwrap();
    let out = p.output(&["start", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    wait_for("the develop to start", || p.root.join("waiting").exists());
    let follow: Running = p
        .loopd()
        .args(["logs", &id, "--follow", "--json"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap()
        .into();
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = wait_output(follow, DEADLINE);
    assert!(progress.join("events.1.jsonl").exists(), "the log rotated");

    let events = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| !l.contains("\"filler\""))
            .map(str::to_owned)
            .collect()
    };
    let written = [
        std::fs::read_to_string(progress.join("events.1.jsonl")).unwrap(),
        std::fs::read_to_string(progress.join("events.jsonl")).unwrap(),
    ]
    .concat();
    let shown = events(&stdout(&out));
    assert_eq!(shown, events(&written), "every event, once, in order");
    assert!(shown.last().unwrap().contains("daemon_exited"), "{shown:?}");
}

#[test]
fn start_detaches_one_daemon_per_loop_and_logs_follow_returns_at_the_end() {
    let p = Project::new(&format!(
        "[ \"$LOOPD_ACTION\" = develop ] && [ ! -f go ] && {{ touch waiting; i=0; while [ ! -f go ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; }}\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t"]);
    let out = p.output(&["start", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let pid: u32 = stdout(&out).trim().parse().unwrap();
    assert!(alive(pid));
    wait_for("the develop to start", || p.root.join("waiting").exists());
    let again = p.output(&["start", &id]);
    assert_eq!(code(&again), 2);
    assert!(
        stderr(&again).contains(&format!("pid {pid}")),
        "{}",
        stderr(&again)
    );
    let status = stdout(&p.output(&["status", &id]));
    assert!(
        status.contains(&format!("daemon pid {pid}")) && status.contains("develop"),
        "{status}"
    );

    let follow: Running = p
        .loopd()
        .args(["logs", &id, "--follow"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap()
        .into();
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = wait_output(follow, DEADLINE);
    let text = stdout(&out);
    assert!(
        text.contains("completed") && text.contains("daemon exited"),
        "{text}"
    );
    wait_for("the daemon to exit", || !alive(pid));
    assert_eq!(p.state(&id)["status"], "completed");
}

/// The CPUs a thread may run on, from its `status` file in `/proc` (`Cpus_allowed_list`).
fn cpus_allowed(status: &str) -> Vec<u32> {
    let status = std::fs::read_to_string(status).unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim();
    list.split(',')
        .flat_map(|range| match range.split_once('-') {
            Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<u32>>(),
            None => vec![range.parse().unwrap()],
        })
        .collect()
}

/// The daemon's thread that reads inotify's events is woken by each write to the state
/// directory: while an attempt runs (its in-flight record written), it is kept on one CPU, the
/// daemon's, rather than take the executor's. (On two CPUs, being kept off the daemon's leaves it
/// one too; which CPU each write keeps it on or off is the store's unit tests'.)
#[test]
fn the_watchers_reader_is_kept_on_one_cpu_while_an_attempt_runs() {
    let mine = cpus_allowed("/proc/thread-self/status");
    if mine.len() < 2 || std::env::var("LOOPD_WATCH").is_ok_and(|w| w == "poll") {
        return; // one CPU, or no inotify: nowhere else to keep it, or no reader
    }
    let p = Project::new(&GOOD_AGENT.replace(
        "develop)",
        "develop) touch developing; while [ ! -e go ]; do sleep 0.01; done;",
    ));
    let id = p.create(&["--title", "t"]);
    let child = p.spawn_run(&id, &[]);
    let pid = child.id();
    wait_for("the develop to run", || p.root.join("developing").exists());
    // The daemon records the attempt in flight once it has started it: the write that places
    // the reader.
    wait_for("the attempt in flight to be recorded", || {
        p.state(&id)["skill_state"]["in_flight"]["action"] == "develop"
    });
    let reader = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| t.ok())
        .map(|t| t.file_name().to_string_lossy().into_owned())
        .find(|tid| {
            std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                .is_ok_and(|c| c.trim() == "loopd-inotify")
        })
        .expect("the daemon has a thread reading inotify");
    let reader = cpus_allowed(&format!("/proc/{pid}/task/{reader}/status"));
    assert_eq!(reader.len(), 1, "{reader:?} during the attempt");
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = wait_output(child, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
}
