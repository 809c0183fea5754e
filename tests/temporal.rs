//! Loops on Temporal through the real binary: a real Temporal dev server per test
//! ([`common::temporal`]), `loopd worker` processes, and the commands a user types. Built with
//! `--features temporal`.
#![cfg(feature = "temporal")]

mod common;

use std::path::PathBuf;
use std::process::Stdio;

use common::http::{To, call, fetch};
use common::temporal::{Temporal, actions, free_port, runtime, temporal_bin};
use common::{
    DEADLINE, GOOD_AGENT, Project, Running, alive, code, read_pid, stderr, stdout, wait_for,
    wait_output,
};
use serde_json::Value;

#[test]
fn a_loop_runs_to_completion_through_two_workers() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "two tasks"]);
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed");
    let done: Vec<String> = actions(&state)
        .into_iter()
        .map(|(action, outcome)| {
            assert_eq!(outcome, "success", "{action} failed: {state}");
            action
        })
        .collect();
    assert_eq!(done, ["init", "develop", "develop", "validate", "complete"]);
    let tasks = state["skill_state"]["develop"]["tasks"].as_array().unwrap();
    assert!(
        tasks.iter().all(|t| t["status"] == "completed"),
        "{tasks:?}"
    );
    // Listed from the visibility store, by the search attributes the workflow keeps.
    let expected = serde_json::json!([{
        "loop_id": id, "status": "completed", "workflow": "ccw-loop",
        "project": p.root.display().to_string(), "iteration": state["current_iteration"],
        "worker": "", "status_reason": null, "next_step": null,
    }]);
    let mut listed = Value::Null;
    wait_for("the list to show the completed loop", || {
        let out = temporal.command(&p, &["--json", "list"]);
        assert_eq!(code(&out), 0, "list: {}", stderr(&out));
        listed = serde_json::from_str(&stdout(&out)).expect("JSON");
        listed == expected
    });
    let out = temporal.command(&p, &["list"]);
    assert!(stdout(&out).contains(&id), "{}", stdout(&out));
}

#[test]
fn a_stop_ends_the_running_executor_and_its_child_and_a_resume_starts_a_new_run() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(&common::agent(&[(
        "develop",
        "if [ ! -f stopped-once ]; then touch stopped-once; echo working on it; \
         echo $$ > develop.pid; sleep 300 & echo $! > child.pid; wait; fi",
    )]));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "stopped mid-action"]);
    wait_for("the develop action to start its child", || {
        p.root.join("child.pid").exists()
    });
    let (executor, child) = (
        read_pid(&p.root.join("develop.pid")),
        read_pid(&p.root.join("child.pid")),
    );
    // Its heartbeat tells what runs, and what it printed last.
    wait_for("the heartbeat to carry the output", || {
        let state = temporal.state(&p, &id);
        state["heartbeat"]["action"] == "develop"
            && state["heartbeat"]["output"]
                .as_str()
                .is_some_and(|o| o.contains("working on it"))
    });
    let out = temporal.command(&p, &["stop", &id]);
    assert_eq!(code(&out), 0, "stop: {}", stderr(&out));
    wait_for("the executor and its child to be gone", || {
        !alive(executor) && !alive(child)
    });
    let state = temporal.wait_for_status(&p, &id, "failed");
    assert_eq!(state["failure_reason"], "Manually stopped by user");
    assert_eq!(
        actions(&state)
            .last()
            .map(|(a, o)| (a.as_str(), o.as_str())),
        Some(("develop", "interrupted"))
    );
    // The stopped loop's workflow has ended; a resume starts its next run from its last state.
    let out = temporal.command(&p, &["resume", &id]);
    assert_eq!(code(&out), 0, "resume: {}", stderr(&out));
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed");
    assert_eq!(state["failure_reason"], Value::Null);
}

#[test]
fn a_pause_holds_the_loop_and_a_resume_lets_it_finish() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(&common::agent(&[("develop", &common::wait_for_file("go"))]));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "paused and resumed"]);
    // Followed from the start: the events come as they happen, and it ends with the loop.
    let follow: Running = p
        .loopd()
        .args([
            "--temporal",
            &temporal.address,
            "logs",
            "--follow",
            "--json",
            &id,
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("logs --follow")
        .into();
    let out = temporal.command(&p, &["pause", &id]);
    assert_eq!(code(&out), 0, "pause: {}", stderr(&out));
    temporal.wait_for_status(&p, &id, "paused");
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = temporal.command(&p, &["resume", &id]);
    assert_eq!(code(&out), 0, "resume: {}", stderr(&out));
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed");
    let followed = wait_output(follow, DEADLINE);
    let names: Vec<String> = stdout(&followed)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("an event per line")["event"].to_string())
        .collect();
    assert_eq!(
        names.first().map(String::as_str),
        Some("\"loop_started\""),
        "{names:?}"
    );
    assert_eq!(
        names.last().map(String::as_str),
        Some("\"loop_ended\""),
        "{names:?}"
    );
    assert_eq!(
        names.iter().filter(|n| *n == "\"changed\"").count(),
        2,
        "pause, resume: {names:?}"
    );
    // A change that makes no sense now is refused by the loop, in one line.
    let out = temporal.command(&p, &["pause", &id]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("cannot pause loop") && err.contains("passed"),
        "{err}"
    );
    for args in [
        &["logs", "no-such-loop"][..],
        &["stop", "no-such-loop"],
        &["status", "no-such-loop"],
    ] {
        let out = temporal.command(&p, args);
        assert_eq!(code(&out), 2, "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("no loop no-such-loop"), "{err}");
    }
}

#[test]
fn a_loop_without_progress_pauses_and_a_resume_counts_afresh() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(&GOOD_AGENT.replace("\"passed\":true", "\"passed\":false"));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "going round"]);
    let state = temporal.wait_for_status(&p, &id, "paused");
    let reason = state["skill_state"]["no_progress"]["paused"]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    // No checkpoints in a shared directory: its worker fingerprints the tree's files, and
    // debug changed none.
    assert!(
        reason.starts_with("no progress in 3 rounds: debug changed no file each time"),
        "{state}"
    );
    let done = actions(&state).len();
    assert_eq!(
        done, 7,
        "init, develop ×2, validate, then debug/validate ×3: {state}"
    );
    let out = temporal.command(&p, &["status", &id]);
    assert!(stdout(&out).contains("no progress"), "{}", stdout(&out));

    let out = temporal.command(&p, &["resume", &id]);
    assert_eq!(code(&out), 0, "resume: {}", stderr(&out));
    let mut state = Value::Null;
    wait_for("the second pause, three rounds on", || {
        state = temporal.state(&p, &id);
        state["status"] == "paused" && actions(&state).len() > done
    });
    assert_eq!(actions(&state).len(), done + 3, "{state}");
}

#[test]
fn a_server_that_is_not_there_is_waited_for_then_one_line_and_exit_2() {
    let p = Project::new(GOOD_AGENT);
    let address = format!("127.0.0.1:{}", free_port());
    let out = p.output(&["create", "--temporal", &address, "--title", "nowhere"]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    let err = stderr(&out);
    let lines: Vec<&str> = err.trim().lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[0].contains(&format!("waiting up to 10s for Temporal at {address}")),
        "{err}"
    );
    assert!(
        lines[1].contains(&address) && lines[1].contains("nothing listens there"),
        "{err}"
    );
    assert!(!err.contains("Status {"), "{err}");
}

#[test]
fn a_create_right_after_the_server_starts_waits_for_it() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    let mut create = None;
    // As a person would: `temporal server start-dev &`, then at once `loopd create`.
    let mut temporal = Temporal::start_with(&p, &bin, |address| {
        let spawned = p
            .loopd()
            .args(["create", "--temporal", address, "--title", "early"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("loopd create");
        create = Some(spawned);
    });
    let out = wait_output(create.expect("spawned"), DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let id = stdout(&out).trim().to_owned();
    assert!(
        stderr(&out).contains("waiting up to 10s for Temporal"),
        "{}",
        stderr(&out)
    );
    temporal.worker(&p);
    temporal.wait_for_status(&p, &id, "completed");
}

#[test]
fn an_untrusted_project_blocks_the_loop_with_the_reason() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    // Changed after `loopd trust`: no worker may run what it says.
    let config = p.root.join(".loop/config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}\n# changed\n")).unwrap();
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "untrusted"]);
    let state = temporal.wait_for_status(&p, &id, "paused");
    let reason = state["skill_state"]["blocked"]["reason"]
        .as_str()
        .unwrap_or_default();
    assert!(reason.contains("trust"), "{state}");
    // What a person sees: where and as whom it cannot run, and the command that fixes it.
    let out = temporal.command(&p, &["status", &id, "--json"]);
    let shown: Value = serde_json::from_str(&stdout(&out)).expect("status --json");
    let why = shown["status_reason"].as_str().expect("a status_reason");
    assert!(
        why.starts_with("blocked: ") && why.contains("worker ") && why.contains("(user "),
        "{why}"
    );
    assert!(why.contains("loopd trust"), "{why}");
    assert!(
        shown["next_step"]
            .as_str()
            .unwrap()
            .contains(&format!("`loopd resume {id}`"))
    );
    let out = temporal.command(&p, &["status", &id]);
    assert!(stdout(&out).contains("why   blocked: "), "{}", stdout(&out));
}

#[test]
fn a_loop_no_worker_runs_says_it_waits_for_one_then_goes_when_one_starts() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    let mut temporal = Temporal::start(&p, &bin);
    let id = temporal.create(&p, &["--title", "alone"]);
    let waiting = |shown: &Value| {
        let why = shown["status_reason"].as_str().unwrap_or_default();
        let next = shown["next_step"].as_str().unwrap_or_default();
        why.starts_with("waiting for a worker: none polls task queue ")
            && next.contains(&format!("`loopd worker --temporal {}`", temporal.address))
    };
    // Within a second, not after a query's time-out: no workflow answers without a worker.
    let shown = temporal.state(&p, &id);
    assert!(waiting(&shown), "{shown}");
    let out = p.output(&["list", "--temporal", &temporal.address, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let listed: Value = serde_json::from_str(&stdout(&out)).expect("list --json");
    let row = listed
        .as_array()
        .and_then(|l| l.iter().find(|l| l["loop_id"] == id.as_str()))
        .unwrap_or_else(|| panic!("{listed}"));
    assert!(waiting(row), "{row}");
    let out = temporal.command(&p, &["status", &id]);
    assert!(
        stdout(&out).contains("why   waiting for a worker"),
        "{}",
        stdout(&out)
    );
    // The service's API (and so the page) says the same, in the loop and in the list.
    let service = p.serve(&["--temporal", &temporal.address, "--listen", "127.0.0.1:0"]);
    let info = service.info().expect("the service's info");
    let addr = info["listen"].as_str().expect("listen").to_owned();
    let token = std::fs::read_to_string(p.home.join(".local/state/loopd/run/token")).unwrap();
    let to = To::Tcp(&addr, Some(token.trim()));
    let (status, shown) = call(&to, "GET", &format!("/v1/loops/{id}"), None);
    assert_eq!(status, 200, "{shown}");
    assert!(waiting(&shown["view"]), "{shown}");
    let (status, listed) = call(&to, "GET", "/v1/loops", None);
    assert_eq!(status, 200, "{listed}");
    let row = listed
        .as_array()
        .and_then(|l| l.iter().find(|l| l["view"]["loop_id"] == id.as_str()))
        .unwrap_or_else(|| panic!("{listed}"));
    assert!(waiting(&row["view"]), "{row}");
    drop(service);

    temporal.worker(&p);
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert!(state["status_reason"].is_null(), "{state}");
}

#[test]
fn a_worker_without_the_executor_s_program_blocks_the_loop_naming_itself() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    // Missing on the worker: the program itself (it cannot start), or the one a wrapper runs
    // (the shell's exit 127, as `npx` or a script meets it).
    for command in [
        r#"["loopd-test-no-such-agent"]"#,
        r#"["sh", "-c", "exec loopd-test-no-such-agent"]"#,
    ] {
        p.config(&common::TEST_CONFIG.replace(r#"["sh", "bin/agent.sh"]"#, command));
        let id = &temporal.create(&p, &["--title", command]);
        temporal.wait_for_status(&p, id, "paused");
        let out = temporal.command(&p, &["status", id, "--json"]);
        let shown: Value = serde_json::from_str(&stdout(&out)).expect("status --json");
        let why = shown["status_reason"].as_str().expect("a status_reason");
        assert!(
            why.starts_with("blocked: ")
                && why.contains("worker w0 (user ")
                && why.contains("loopd-test-no-such-agent"),
            "{why}"
        );
        // The worker said so in its log, in one line naming the loop.
        let said = std::fs::read_to_string(common::temporal::side_dir(&p).join("worker-w0.log"))
            .expect("the worker's log");
        assert!(
            said.lines()
                .any(|l| l.contains(&format!("loop {id}: worker w0 (user "))
                    && l.contains("cannot run it")),
            "{said}"
        );
    }
}

#[test]
fn a_skill_tuning_loop_runs_to_completion_through_two_workers() {
    let Some(bin) = temporal_bin() else { return };
    let p = common::tuning_project(common::TUNING_AGENT);
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    temporal.worker(&p);
    let id = temporal.create(
        &p,
        &[
            "--workflow",
            "skill-tuning",
            "--target-skill",
            "skills/s",
            "--focus",
            "memory,docs",
        ],
    );
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed", "{state}");
    assert_eq!(state["skill_state"]["quality_gate"], "pass", "{state}");
    let done: Vec<String> = actions(&state).into_iter().map(|(a, _)| a).collect();
    assert_eq!(
        done,
        [
            "init",
            "analyze-requirements",
            "diagnose-memory",
            "diagnose-docs",
            "generate-report",
            "complete"
        ]
    );
}

#[test]
fn a_question_is_answered_and_a_task_added_from_the_command_line() {
    let Some(bin) = temporal_bin() else { return };
    // The first develop asks; the answer reaches the next prompt. Validate waits for `go`.
    let p = Project::new(&format!(
        "prompt=$(cat)\n\
         if [ \"$LOOPD_ACTION\" = develop ] && [ ! -f asked ]; then touch asked; \
           echo '{{\"status\":\"needs_input\",\"summary\":\"a choice\",\"question\":\"Postgres or SQLite?\"}}' > \"$LOOPD_RESULT_FILE\"; exit 0; fi\n\
         case \"$prompt\" in *SQLite,\\ please*) touch answer-seen ;; esac\n\
         if [ \"$LOOPD_ACTION\" = validate ]; then {}; fi\n{GOOD_AGENT}",
        common::wait_for_file("go")
    ));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "asks once"]);
    wait_for("the question", || {
        temporal.state(&p, &id)["skill_state"]["question"]["text"] == "Postgres or SQLite?"
    });
    let out = temporal.command(&p, &["answer", &id, "SQLite, please"]);
    assert_eq!(code(&out), 0, "answer: {}", stderr(&out));
    let out = temporal.command(&p, &["answer", &id, "again"]);
    assert_eq!(code(&out), 2, "a second answer: {}", stderr(&out));
    assert!(
        stderr(&out).contains("waiting for no answer"),
        "{}",
        stderr(&out)
    );
    // Added while the loop works: developed before it validates again.
    let out = temporal.command(&p, &["--json", "task", "add", &id, "a third"]);
    assert_eq!(code(&out), 0, "task add: {}", stderr(&out));
    let added: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(added["task_id"], "task-003", "{added}");
    let out = temporal.command(&p, &["set", &id, "--max-iterations", "30"]);
    assert_eq!(code(&out), 0, "set: {}", stderr(&out));
    std::fs::write(p.root.join("go"), "").unwrap();
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["max_iterations"], 30);
    assert!(
        p.root.join("answer-seen").exists(),
        "the answer reached the prompt"
    );
    let tasks = state["skill_state"]["develop"]["tasks"].as_array().unwrap();
    assert!(
        tasks
            .iter()
            .any(|t| t["description"] == "a third" && t["status"] == "completed"),
        "{tasks:?}"
    );
    // Its events, read from its history: every change a person made among them.
    let out = temporal.command(&p, &["--json", "logs", &id]);
    assert_eq!(code(&out), 0, "logs: {}", stderr(&out));
    let events: Vec<Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).expect("an event per line"))
        .collect();
    let names: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(names.first(), Some(&"loop_started"), "{names:?}");
    assert_eq!(names.last(), Some(&"loop_ended"), "{names:?}");
    assert_eq!(
        names.iter().filter(|n| **n == "changed").count(),
        3,
        "{names:?}"
    );
    let out = temporal.command(&p, &["logs", "--utc", &id]);
    let shown = stdout(&out);
    assert!(
        shown.contains("action finished") && shown.contains("needs_input"),
        "{shown}"
    );
    assert!(shown.contains("answer: SQLite, please"), "{shown}");
    assert!(shown.contains("set: max_iterations = 30"), "{shown}");
    // `LOOPD_RECORD_HISTORIES=1`: this history becomes one that every later build must replay.
    if std::env::var_os("LOOPD_RECORD_HISTORIES").is_some() {
        let history = temporal.histories(&id).remove(0);
        std::fs::write(histories_dir().join("updates.json"), history).unwrap();
    }
}

/// Recorded histories of loops (`LOOPD_RECORD_HISTORIES=1`), which this build's workflow must
/// replay: a change to it that loops already running could not take fails here.
fn histories_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/histories")
}

#[test]
fn recorded_histories_replay_on_this_build() {
    let mut replayed = 0;
    for entry in std::fs::read_dir(histories_dir()).expect("tests/histories") {
        let path = entry.unwrap().path();
        let history = std::fs::read(&path).unwrap();
        runtime()
            .block_on(loopd_temporal::client::replay(&history))
            .unwrap_or_else(|e| panic!("{} does not replay: {e:#}", path.display()));
        replayed += 1;
    }
    assert!(
        replayed > 0,
        "no recorded history in {}",
        histories_dir().display()
    );
}

#[test]
fn a_worker_killed_mid_action_leaves_no_executor_and_another_worker_finishes() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(&common::agent(&[(
        "develop",
        "if [ ! -f ran-once ]; then touch ran-once; echo $$ > develop.pid; \
         setsid sleep 300 & echo $! > child.pid; wait; fi",
    )]));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "its worker dies"]);
    let (executor, child) = (
        read_pid(&p.root.join("develop.pid")),
        read_pid(&p.root.join("child.pid")),
    );
    temporal.worker(&p);
    temporal.kill_worker(0);
    wait_for(
        "the dead worker's executor and its child to be gone",
        || !alive(executor) && !alive(child),
    );
    // Its activity, given up on at the heartbeat timeout, runs again on the other worker.
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed", "{state}");
    let done: Vec<(String, String)> = actions(&state);
    assert_eq!(
        done.iter().filter(|(a, _)| a == "develop").count(),
        2,
        "each task developed once, none lost: {done:?}"
    );
}

/// An agent whose init plans `n` tasks.
fn planning_agent(n: usize) -> String {
    let tasks: Vec<String> = (1..=n)
        .map(|i| format!(r#"{{"description":"task {i}"}}"#))
        .collect();
    GOOD_AGENT.replace(
        r#"{"description":"first"},{"description":"second"}"#,
        &tasks.join(","),
    )
}

#[test]
fn a_long_loop_continues_as_new_runs_whose_histories_replay() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(&planning_agent(12));
    let config = p.root.join(".loop/config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        format!("{text}\n[temporal]\nhistory_limit = {HISTORY_LIMIT}\n"),
    )
    .unwrap();
    assert!(p.trust(), "trust the changed config");
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "a long one", "--max-iterations", "40"]);
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed", "{state}");
    let tasks = state["skill_state"]["develop"]["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 12, "{tasks:?}");
    assert!(
        tasks.iter().all(|t| t["status"] == "completed"),
        "{tasks:?}"
    );
    // The loop's runs: each holds at most the limit and one action's events, and replays.
    let histories = temporal.histories(&id);
    let rt = runtime();
    assert!(
        histories.len() >= 3,
        "a loop of 16 actions in runs of {HISTORY_LIMIT} events: {} runs",
        histories.len()
    );
    for (i, history) in histories.iter().enumerate() {
        let events = serde_json::from_slice::<Value>(history).expect("a history")["events"]
            .as_array()
            .map_or(0, Vec::len);
        assert!(
            events <= HISTORY_LIMIT as usize + ONE_ACTION_EVENTS,
            "run {i} holds {events} events"
        );
        rt.block_on(loopd_temporal::client::replay(history))
            .unwrap_or_else(|e| panic!("run {i} does not replay: {e:#}"));
    }
}

/// The `[temporal] history_limit` of the test above, and the most events one action adds past it
/// (its workflow tasks, activity and timers).
const HISTORY_LIMIT: u32 = 40;
const ONE_ACTION_EVENTS: usize = 20;

#[test]
fn a_server_restarted_mid_loop_is_reconnected_to_and_the_loop_completes() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(&common::agent(&[("develop", &common::wait_for_file("go"))]));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "its server restarts"]);
    // A state read before its workflow's first task has no history yet.
    wait_for("the develop action", || {
        temporal.state(&p, &id)["skill_state"]["action_history"]
            .as_array()
            .is_some_and(|h| h.iter().any(|a| a["action"] == "init"))
    });
    temporal.restart(&p, &bin);
    std::fs::write(p.root.join("go"), "").unwrap();
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed", "{state}");
}

#[test]
fn a_loop_at_its_iteration_limit_goes_on_once_its_limit_is_raised() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "too short", "--max-iterations", "1"]);
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(
        state["skill_state"]["outcome"], "iteration_limit",
        "{state}"
    );
    // Its workflow has ended: the refusal, the raised limit and the resume reach its last state.
    let out = temporal.command(&p, &["resume", &id]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--max-iterations N"),
        "{}",
        stderr(&out)
    );
    let out = temporal.command(&p, &["set", &id, "--max-iterations", "10"]);
    assert_eq!(code(&out), 0, "set: {}", stderr(&out));
    let out = temporal.command(&p, &["resume", &id]);
    assert_eq!(code(&out), 0, "resume: {}", stderr(&out));
    let mut state = Value::Null;
    wait_for("the resumed loop to pass", || {
        state = temporal.state(&p, &id);
        state["skill_state"]["outcome"] == "passed"
    });
    assert_eq!(state["max_iterations"], 10, "{state}");
}

#[test]
fn a_running_agents_heartbeat_carries_what_it_has_spent() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    // Develop is an agent whose stream says what it spent, then works on.
    p.script(
        "stream.sh",
        r#"cat > /dev/null
echo '{"type":"assistant","message":{"content":[{"type":"text","text":"on it"}],"usage":{"input_tokens":100,"output_tokens":23}}}'
echo $$ > develop.pid
exec sleep 300
"#,
    );
    p.config(&format!(
        "{}\n[executors.stream]\ncommand = [\"sh\", \"bin/stream.sh\"]\nprompt = \"stdin\"\n\
         format = \"claude-stream-json\"\n\n[actions.develop]\nexecutor = \"stream\"\n",
        common::TEST_CONFIG
    ));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "an agent at work"]);
    let executor = read_pid(&p.root.join("develop.pid"));
    let mut state = Value::Null;
    wait_for("the heartbeat to carry the agent's tokens", || {
        state = temporal.state(&p, &id);
        state["heartbeat"]["tokens"] == 123
    });
    let shown = stdout(&temporal.command(&p, &["status", &id]));
    assert!(shown.contains("123 tokens so far"), "{shown}");
    let out = temporal.command(&p, &["stop", &id]);
    assert_eq!(code(&out), 0, "stop: {}", stderr(&out));
    wait_for("the agent to be gone", || !alive(executor));
}

#[test]
fn the_service_lists_shows_and_changes_loops_on_temporal_beside_its_own() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(&common::agent(&[("develop", &common::wait_for_file("go"))]));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "on temporal"]);
    let local = p.create(&["--title", "in the file store"]);
    let service = p.serve(&["--temporal", &temporal.address, "--listen", "127.0.0.1:0"]);
    let info = service.info().expect("the service's info");
    let addr = info["listen"].as_str().expect("listen").to_owned();
    let token = std::fs::read_to_string(p.home.join(".local/state/loopd/run/token")).unwrap();
    let to = To::Tcp(&addr, Some(token.trim()));
    // Listed beside the project's own loop, with the driver that holds it.
    let mut listed = Value::Null;
    wait_for("the list to show both loops", || {
        let (status, value) = call(&to, "GET", "/v1/loops", None);
        assert_eq!(status, 200, "{value}");
        listed = value;
        let ids: Vec<&str> = listed
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|l| l["view"]["loop_id"].as_str())
            .collect();
        ids.contains(&id.as_str()) && ids.contains(&local.as_str())
    });
    let held = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["view"]["loop_id"] == id)
        .unwrap();
    assert_eq!(held["driver"], "temporal", "{held}");
    assert_eq!(held["view"]["title"], "on temporal", "{held}");
    let (status, shown) = call(&to, "GET", &format!("/v1/loops/{id}"), None);
    assert_eq!(status, 200, "{shown}");
    assert_eq!(shown["state"]["loop_id"], id.as_str(), "{shown}");
    // The attempt in flight (develop, waiting for `go`), as its heartbeat tells it.
    wait_for("the tail to show the running develop", || {
        let (status, tail) = call(&to, "GET", &format!("/v1/loops/{id}/tail"), None);
        assert_eq!(status, 200, "{tail}");
        tail["in_flight"]["action"] == "develop" && tail["text"].is_string()
    });
    // Changed through the API as a loop of the file store is.
    let (status, said) = call(&to, "POST", &format!("/v1/loops/{id}/pause"), None);
    assert_eq!(status, 200, "{said}");
    assert_eq!(said["status"], "paused", "{said}");
    temporal.wait_for_status(&p, &id, "paused");
    let (status, said) = call(
        &to,
        "POST",
        &format!("/v1/loops/{id}/tasks"),
        Some(serde_json::json!({ "text": "one more" })),
    );
    assert_eq!(status, 201, "{said}");
    assert_eq!(said["task_id"], "task-003", "{said}");
    let (status, said) = call(
        &to,
        "POST",
        &format!("/v1/loops/{id}/answer"),
        Some(serde_json::json!({ "text": "yes" })),
    );
    assert_eq!(status, 400, "no question waits: {said}");
    let (status, said) = call(&to, "POST", "/v1/loops/no-such-loop/pause", None);
    assert_eq!(status, 404, "{said}");
    // Its events, from its history, numbered as the file store's; the stream ends, and a client
    // that comes back with Last-Event-ID gets only what came since.
    let events = sse_body(&to, &format!("/v1/loops/{id}/events"), None);
    assert!(
        events.contains("id: 1\n") && events.contains("loop_started"),
        "{events}"
    );
    let after = sse_body(&to, &format!("/v1/loops/{id}/events"), Some("1"));
    assert!(
        !after.contains("id: 1\n") && after.contains("id: 2\n"),
        "{after}"
    );
    std::fs::write(p.root.join("go"), "").unwrap();
    let (status, said) = call(&to, "POST", &format!("/v1/loops/{id}/resume"), None);
    assert_eq!(status, 200, "{said}");

    assert_eq!(status, 200, "{said}");
    let state = temporal.wait_for_status(&p, &id, "completed");
    let tasks = state["skill_state"]["develop"]["tasks"].as_array().unwrap();
    assert!(
        tasks.iter().any(|t| t["description"] == "one more"),
        "{tasks:?}"
    );
}

/// A Server-Sent Events response of the service that ends, whole.
fn sse_body(to: &To<'_>, path: &str, last_id: Option<&str>) -> String {
    let headers: Vec<(&str, &str)> = last_id
        .map(|id| ("last-event-id", id))
        .into_iter()
        .collect();
    let (status, text) = fetch(to, "GET", path, None, &headers);
    assert_eq!(status, 200, "{path}: {text}");
    text
}

/// A worker's agents reach what their `sandbox_network` lists and nothing else: not the Temporal
/// server the worker talks to.
#[test]
fn a_workers_agent_reaches_no_host_it_may_not_not_even_the_temporal_server() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new("");
    let mut temporal = Temporal::start(&p, &bin);
    let (host, port) = temporal.address.rsplit_once(':').unwrap();
    p.agent(&GOOD_AGENT.replace(
        "develop) ",
        &format!(
            "develop) python3 -c \"import socket; socket.create_connection((\\\"{host}\\\", {port}), 5)\" 2>/dev/null && touch reached; "
        ),
    ));
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "boxed"]);
    temporal.wait_for_status(&p, &id, "completed");
    assert!(
        !p.root.join("reached").exists(),
        "an agent reached the Temporal server"
    );
}

#[test]
fn a_worker_under_systemd_says_ready_keeps_its_watchdog_and_says_stopping() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    let mut temporal = Temporal::start(&p, &bin);
    let path = p.root.join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&path).expect("bind the notify socket");
    socket
        .set_read_timeout(Some(DEADLINE))
        .expect("read timeout");
    temporal.worker_with(&p, "w0", |cmd| {
        cmd.env("NOTIFY_SOCKET", &path)
            .env("WATCHDOG_USEC", "200000");
    });
    let mut seen = common::notifications(&socket, "READY=1");
    seen.extend(common::notifications(&socket, "WATCHDOG=1"));
    // It works once ready.
    let id = temporal.create(&p, &["--title", "under systemd"]);
    temporal.wait_for_status(&p, &id, "completed");
    let reader = std::thread::spawn(move || common::notifications(&socket, "STOPPING=1"));
    temporal.stop_worker(0);
    seen.extend(reader.join().expect("reader"));
    let first = |prefix: &str| common::first_of(&seen, prefix);
    assert!(first("READY=1") < first("WATCHDOG=1"), "{seen:?}");
    assert!(
        seen.iter()
            .any(|s| s.starts_with("STATUS=worker w0 on 127.0.0.1:")),
        "{seen:?}"
    );
    assert_eq!(
        seen.last().map(String::as_str),
        Some("STOPPING=1"),
        "{seen:?}"
    );
}
