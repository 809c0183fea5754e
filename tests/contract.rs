//! Lines of CONTRACT.md that the other suites do not reach: the project root, state_dir, config
//! layers, prompt modes and formats, statuses, task lists growing while a loop runs.

mod common;

use std::process::{Command, Stdio};

use common::*;
use serde_json::{Value, json};

/// `loopd` without `--root`, run from `dir`, with the user's environment isolated.
fn loopd_in(dir: &std::path::Path, home: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_loopd"));
    cmd.current_dir(dir)
        .env("HOME", home)
        .env_remove("XDG_STATE_HOME")
        .env_remove("LOOPD_CONFIG")
        .env_remove("LOOPD_ROOT")
        .stdin(Stdio::null());
    cmd
}

#[test]
fn the_root_is_the_flag_else_loopd_root_else_the_git_top_level_else_the_working_directory() {
    let p = Project::new(GOOD_AGENT);
    let sub = p.root.join("src/deep");
    std::fs::create_dir_all(&sub).unwrap();
    // No git: the working directory.
    let out = loopd_in(&sub, &p.root)
        .args(["create", "--title", "here"])
        .output()
        .unwrap();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(sub.join(".loop").is_dir());
    // A git top level above: there.
    std::fs::create_dir_all(p.root.join(".git")).unwrap();
    let out = loopd_in(&sub, &p.root)
        .args(["create", "--title", "top"])
        .output()
        .unwrap();
    let id = stdout(&out).trim().to_owned();
    assert!(
        p.state_path(&id).exists(),
        "the loop went to the git top level"
    );
    // LOOPD_ROOT wins over both; --root over LOOPD_ROOT.
    let other = tempfile::tempdir().unwrap();
    let out = loopd_in(&sub, &p.root)
        .env("LOOPD_ROOT", other.path())
        .args(["create", "--title", "env"])
        .output()
        .unwrap();
    let id = stdout(&out).trim().to_owned();
    assert!(other.path().join(format!(".loop/{id}.json")).exists());
    let out = loopd_in(&sub, &p.root)
        .env("LOOPD_ROOT", other.path())
        .arg("--root")
        .arg(&p.root)
        .args(["create", "--title", "flag"])
        .output()
        .unwrap();
    let id = stdout(&out).trim().to_owned();
    assert!(p.state_path(&id).exists());
    let out = loopd_in(&sub, &p.root)
        .args(["--root", "/nonexistent/x", "list"])
        .output()
        .unwrap();
    assert_eq!(code(&out), 2, "{}", stderr(&out));
}

#[test]
fn state_dir_moves_the_loop_files_and_config_layers_override_key_by_key() {
    let p = Project::new(GOOD_AGENT);
    // Project layer: the CCW dashboard's directory, and a limit.
    p.config(&format!(
        "state_dir = \".workflow/.loop\"\nmax_iterations = 7\n{TEST_CONFIG}"
    ));
    // User layer (under HOME): overridden by the project for max_iterations, kept for max_errors.
    let user = p.root.join(".config/loopd");
    std::fs::create_dir_all(&user).unwrap();
    std::fs::write(
        user.join("config.toml"),
        "max_iterations = 5\nmax_errors = 9\n",
    )
    .unwrap();
    let id = p.create(&["--title", "t"]);
    let state_file = p.root.join(format!(".workflow/.loop/{id}.json"));
    let state: Value = serde_json::from_slice(&std::fs::read(&state_file).unwrap()).unwrap();
    assert_eq!(state["max_iterations"], 7);
    assert_eq!(state["max_errors"], 9);
    // $LOOPD_CONFIG over the project, --config over $LOOPD_CONFIG.
    let env_layer = p.root.join("env.toml");
    std::fs::write(&env_layer, "max_iterations = 11\n").unwrap();
    let flag_layer = p.root.join("flag.toml");
    std::fs::write(&flag_layer, "max_iterations = 13\n").unwrap();
    let created = |cmd: &mut Command| {
        let out = cmd.output().unwrap();
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        let id = stdout(&out).trim().to_owned();
        let text = std::fs::read(p.root.join(format!(".workflow/.loop/{id}.json"))).unwrap();
        serde_json::from_slice::<Value>(&text).unwrap()["max_iterations"].clone()
    };
    let mut cmd = p.loopd();
    cmd.env("LOOPD_CONFIG", &env_layer)
        .args(["create", "--title", "t"]);
    assert_eq!(created(&mut cmd), 11);
    let mut cmd = p.loopd();
    cmd.env("LOOPD_CONFIG", &env_layer)
        .arg("--config")
        .arg(&flag_layer)
        .args(["create", "--title", "t"]);
    assert_eq!(created(&mut cmd), 13);
    // A loop in the moved directory runs; its progress is there too.
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        p.root
            .join(format!(".workflow/.loop/{id}.progress/events.jsonl"))
            .exists()
    );
    assert!(!p.state_path(&id).exists());
}

#[test]
fn the_prompt_goes_by_stdin_argument_or_file_and_the_text_format_reads_the_exit_code() {
    // Each executor saves the prompt it got, and reports nothing: the text format takes exit 0.
    let p = Project::new("");
    p.script("by-arg.sh", "printf '%s' \"$1\" > prompt-arg.txt\n");
    p.script("by-file.sh", "cp \"$1\" prompt-file.txt\n");
    p.script("by-stdin.sh", "cat > prompt-stdin.txt\n");
    p.config(
        r#"
retry_backoff = 0.01
executor = "stdin"
[executors.stdin]
command = ["sh", "bin/by-stdin.sh"]
format = "text"
[executors.arg]
command = ["sh", "bin/by-arg.sh"]
prompt = "arg"
format = "text"
[executors.file]
command = ["sh", "bin/by-file.sh"]
prompt = "file"
format = "text"
[actions.develop]
executor = "arg"
[actions.validate]
command = "true"
[actions.complete]
executor = "file"
"#,
    );
    let id = p.create(&["--title", "Prompted", "--task", "the task"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let read = |f: &str| std::fs::read_to_string(p.root.join(f)).unwrap();
    assert!(
        read("prompt-stdin.txt").contains("planning step"),
        "init by stdin"
    );
    assert!(
        read("prompt-arg.txt").contains("Your task now: task-001"),
        "develop by argument"
    );
    assert!(read("prompt-arg.txt").contains("the task"));
    assert!(
        read("prompt-file.txt").contains("final step"),
        "complete by file"
    );
}

#[test]
fn multi_line_reports_and_questions_without_a_question_are_failed_attempts_in_one_line() {
    for (report, expected) in [
        (
            r#"{"status":"failed","summary":"which database?\\nsql or not"}"#,
            "reported failure: which database? / sql or not",
        ),
        (
            r#"{"status":"needs_input","summary":" "}"#,
            "needs_input without a question",
        ),
    ] {
        let p = Project::new(&GOOD_AGENT.replace(
            "develop) echo",
            &format!("develop) printf '{report}' > \"$LOOPD_RESULT_FILE\"; exit 0; echo"),
        ));
        p.config(&format!("action_retries = 0\n{TEST_CONFIG}"));
        let id = p.create(&["--title", "t", "--max-errors", "1"]);
        let out = p.run(&id, &[]);
        assert_eq!(code(&out), 4, "{}", stderr(&out));
        let state = p.state(&id);
        let reason = state["failure_reason"].as_str().unwrap();
        assert!(reason.contains(expected), "{reason}");
        assert!(!reason.contains('\n'));
        // Run again: the loop the daemon failed is still a failure (4), not a user's stop (5).
        let again = p.run(&id, &[]);
        assert_eq!(code(&again), 4, "{}", stderr(&again));
    }
}

#[test]
fn user_exit_written_by_someone_else_stops_the_loop() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    let mut state = p.state(&id);
    state["status"] = json!("user_exit");
    std::fs::write(p.state_path(&id), serde_json::to_vec(&state).unwrap()).unwrap();
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 5, "{}", stderr(&out));
    assert_eq!(p.state(&id)["failure_reason"], "stopped by user");
}

#[test]
fn tasks_appended_while_the_loop_runs_join_as_pending() {
    let p = Project::new(&format!(
        "[ \"$LOOPD_TASK_ID\" = task-001 ] && [ ! -f go ] && {{ touch waiting; i=0; while [ ! -f go ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; }}\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t", "--task", "first"]);
    let run = p.spawn_run(&id, &[]);
    wait_for("the first develop", || p.root.join("waiting").exists());
    // The dashboard appends a record, without a final newline, with no id.
    let list = p.root.join(format!(".loop/{id}.tasks.jsonl"));
    let mut text = std::fs::read_to_string(&list).unwrap();
    text.push_str(r#"{"description": "added later", "order": 9}"#);
    std::fs::write(&list, text).unwrap();
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = wait_output(run, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(p.event_names(&id).iter().any(|e| e == "tasks_added"));
    assert_eq!(p.developed(&id), ["task-001", "jsonl-2"]);
    let tasks = p.state(&id)["skill_state"]["develop"]["tasks"].clone();
    assert_eq!(tasks[1]["description"], "added later");
}

#[test]
fn create_refuses_an_unknown_workflow_and_list_json_lists_every_loop() {
    let p = Project::new(GOOD_AGENT);
    let out = p.output(&["create", "--title", "t", "--workflow", "nope"]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("unknown workflow \"nope\""),
        "{}",
        stderr(&out)
    );
    let a = p.create(&["--title", "a"]);
    let b = p.create(&[
        "--title",
        "b",
        "--workflow",
        "ccw-loop",
        "--mode",
        "interactive",
    ]);
    let listed: Vec<Value> = serde_json::from_slice(&p.output(&["list", "--json"]).stdout).unwrap();
    let ids: Vec<&str> = listed
        .iter()
        .map(|l| l["loop_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&a.as_str()) && ids.contains(&b.as_str()));
    // An interactive loop refuses a choice that cannot run now, with the reason.
    let out = p.output(&["next", &b, "develop"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("not planned yet"), "{}", stderr(&out));
}

#[test]
fn every_printing_command_ends_quietly_when_its_reader_goes_away() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    assert_eq!(code(&p.run(&id, &[])), 0);
    let commands: &[&[&str]] = &[
        &["list"],
        &["list", "--json"],
        &["status", &id],
        &["status", &id, "--json"],
        &["logs", &id],
        &["logs", &id, "--json"],
        &["logs", &id, "--follow"],
        &["doctor"],
        &["create", "--title", "x"],
        &["--help"],
    ];
    for args in commands {
        // A pipe whose reader is gone before anything is written: every write fails (EPIPE).
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let child = p
            .loopd()
            .args(*args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_output(child, DEADLINE);
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "{args:?}: {:?} {err}",
            out.status
        );
    }
}

/// A state file with what changes from run to run made constant: timestamps, the loop id.
fn normalized(value: &mut Value, id: &str) {
    match value {
        Value::String(s) if chrono::DateTime::parse_from_rfc3339(s).is_ok() => *s = "T".into(),
        Value::String(s) => *s = s.replace(id, "ID"),
        Value::Array(items) => items.iter_mut().for_each(|v| normalized(v, id)),
        Value::Object(map) => map.values_mut().for_each(|v| normalized(v, id)),
        _ => {}
    }
}

#[test]
fn a_ccw_loop_state_file_is_written_key_for_key_as_before() {
    // The demo's loop, run by the real binary; the fixture is the same loop's file as loopd wrote
    // it before the workflow's fields moved out of the engine's (normalized the same way), with
    // loopd's later additions (`skill_state.no_progress` with its notes and the fingerprint of the
    // files, a validation's `pass_rate` in its history).
    let dir = tempfile::tempdir().unwrap();
    let out = demo(dir.path(), &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let path = demo_state_file(&out);
    let mut written: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let id = written["loop_id"].as_str().unwrap().to_owned();
    normalized(&mut written, &id);
    // The fingerprint of the demo's files (no git) changes with their times.
    let files = &mut written["skill_state"]["no_progress"]["fingerprint"]["files"];
    assert!(files.is_u64(), "{files}");
    *files = "F".into();
    let before = include_str!("fixtures/ccw-loop-demo-state.json");
    assert_eq!(
        serde_json::to_string_pretty(&written).unwrap(),
        before.trim_end()
    );
}
