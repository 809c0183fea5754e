//! Hostile executors: numbers that overflow, result files that are FIFOs or devices, output that
//! nests without end. Each ends as a failed attempt, the daemon stays small and `stop` works.

mod common;

use common::*;
use serde_json::Value;

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
        // The result file is there, empty: a hostile executor puts something else in its place.
        (
            "a FIFO",
            "rm -f \"$LOOPD_RESULT_FILE\"; mkfifo \"$LOOPD_RESULT_FILE\"",
            "FIFO",
        ),
        (
            "/dev/zero",
            "ln -sf /dev/zero \"$LOOPD_RESULT_FILE\"",
            "symlink",
        ),
        (
            "a hard link",
            "echo '{\"status\":\"success\"}' > mine; ln -f mine \"$LOOPD_RESULT_FILE\"",
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
    let error = failed["error"].as_str().unwrap();
    assert!(error.starts_with("exit code 1"), "{error}");
    assert!(
        error.chars().count() < 300,
        "the quoted line is cut: {error}"
    );
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

fn mkfifo(path: &std::path::Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
}

#[test]
fn fifos_and_hard_links_under_the_state_dir_are_refused_never_followed() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    let progress = p.progress(&id);
    std::fs::create_dir_all(&progress).unwrap();
    for name in ["develop.md", "validate.md", "changes.log"] {
        mkfifo(&progress.join(name));
    }
    mkfifo(&p.root.join(format!(".loop/{id}.json.bak")));
    // Files elsewhere that hard links under the state dir point at.
    let outside = tempfile::tempdir().unwrap();
    for name in ["summary.md", "debug.md"] {
        let target = outside.path().join(name);
        std::fs::write(&target, "mine\n").unwrap();
        std::fs::hard_link(&target, progress.join(name)).unwrap();
    }
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    for name in ["summary.md", "debug.md"] {
        assert_eq!(
            std::fs::read_to_string(outside.path().join(name)).unwrap(),
            "mine\n",
            "{name} was written through a hard link"
        );
    }
    assert!(
        stderr(&out).contains("is a FIFO"),
        "the refusals are logged: {}",
        stderr(&out)
    );
    // Config and action files that are FIFOs: one clear line, at once, for every command.
    let q = Project::new(GOOD_AGENT);
    let id = q.create(&["--title", "t"]);
    std::fs::create_dir_all(q.root.join(".loop/actions/ccw-loop")).unwrap();
    mkfifo(&q.root.join(".loop/actions/ccw-loop/develop.md"));
    let out = q.run(&id, &[]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("FIFO"), "{}", stderr(&out));
    std::fs::remove_file(q.root.join(".loop/config.toml")).unwrap();
    mkfifo(&q.root.join(".loop/config.toml"));
    // One line, at once: a refusal for what runs, a warning for what only looks.
    for (cmd, expected) in [("status", 0), ("run", 2)] {
        let out = q.output(&[cmd, &id]);
        assert_eq!(code(&out), expected, "{cmd}: {}", stderr(&out));
        assert!(stderr(&out).contains("FIFO"), "{cmd}: {}", stderr(&out));
        assert_eq!(
            stderr(&out).trim_end().lines().count(),
            1,
            "{}",
            stderr(&out)
        );
    }
}

#[test]
fn a_symlinked_progress_dir_or_file_is_refused_and_nothing_outside_changes() {
    let outside = tempfile::tempdir().unwrap();
    let profile = outside.path().join("profile");
    std::fs::write(&profile, "mine\n").unwrap();
    // The progress dir is a symlink to a directory elsewhere.
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    std::os::unix::fs::symlink(outside.path(), p.progress(&id)).unwrap();
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert_eq!(
        stderr(&out).trim_end().lines().count(),
        1,
        "{}",
        stderr(&out)
    );
    assert!(stderr(&out).contains("symlink"), "{}", stderr(&out));
    let names: Vec<_> = std::fs::read_dir(outside.path()).unwrap().collect();
    assert_eq!(names.len(), 1, "loopd wrote into the symlinked directory");
    // A progress file is a symlink to a file elsewhere.
    let q = Project::new(GOOD_AGENT);
    let id = q.create(&["--title", "t"]);
    std::fs::create_dir_all(q.progress(&id)).unwrap();
    for name in ["develop.md", "events.jsonl", "changes.log"] {
        std::os::unix::fs::symlink(&profile, q.progress(&id).join(name)).unwrap();
    }
    let out = q.run(&id, &[]);
    assert!(
        code(&out) != 0 || stderr(&out).contains("symlink"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::read_to_string(&profile).unwrap(), "mine\n");
    // What loopd creates is private.
    let r = Project::new(GOOD_AGENT);
    let id = r.create(&["--title", "t"]);
    assert_eq!(code(&r.run(&id, &[])), 0);
    let mut stack = vec![r.root.join(".loop")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            // The test's own config, and the result files the executor writes (under its own
            // umask, inside the private actions/ directory).
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name == "config.toml" || name.ends_with(".result.json") {
                continue;
            }
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::symlink_metadata(&path)
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(
                mode & 0o077,
                0,
                "{} is mode {:o}",
                path.display(),
                mode & 0o777
            );
            if path.is_dir() {
                stack.push(path);
            }
        }
    }
}

#[test]
fn escape_sequences_from_executors_and_state_reach_no_terminal() {
    // An executor whose summary and error carry terminal escapes, a carriage return and a newline.
    let p = project(
        "json",
        r#"printf '{"status":"failed","summary":"\\u001b]0;pwned\\u0007 \\u001b[2J\\rgone\\nfake line"}' > "$LOOPD_RESULT_FILE""#,
    );
    let id = p.create(&["--title", "title \u{1b}[31mred\u{9b}2J"]);
    assert_eq!(code(&p.run(&id, &[])), 4);
    for args in [
        vec!["logs", id.as_str()],
        vec!["status", id.as_str()],
        vec!["list"],
    ] {
        let out = p.output(&args);
        assert_eq!(code(&out), 0, "{args:?}: {}", stderr(&out));
        let text = stdout(&out);
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{args:?} printed a control character: {text:?}"
        );
        assert!(
            text.contains("\\u{1b}"),
            "{args:?} shows the escape: {text}"
        );
    }
    let logs = stdout(&p.output(&["logs", &id]));
    assert!(logs.contains("\\rgone / fake line"), "{logs}");
    // The machine-readable forms keep the text as it was.
    let json = stdout(&p.output(&["logs", &id, "--json"]));
    assert!(json.contains(r"\u001b[2J\rgone / fake line"), "{json}");
}

#[test]
fn oversized_inputs_are_refused_at_the_door_and_the_state_stays_small() {
    let p = Project::new(GOOD_AGENT);
    let refused = |args: &[&str], needle: &str| {
        let out = p.output(args);
        let err = stderr(&out);
        assert_eq!(code(&out), 2, "{err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(err.contains(needle), "{needle}: {err}");
    };
    // Under the kernel's 128 KiB limit on one argument, over loopd's 32 KiB on a description.
    let long = "d".repeat(100_000);
    refused(&["create", "--title", "t", "--description", &long], "limit");
    refused(&["create", "--title", "t", "--task", &long], "limit");
    let mut many = vec!["create", "--title", "t"];
    many.extend(std::iter::repeat_n(["--task", "x"], 201).flatten());
    refused(&many, "201 tasks");
    assert!(
        std::fs::read_dir(p.root.join(".loop")).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".json")),
        "no loop was written"
    );

    // An init result of 100k tasks (under the result file's cap) is an invalid result.
    let q = project(
        "json",
        r#"echo '{"status":"success"}' > "$LOOPD_RESULT_FILE""#,
    );
    q.agent(
        r#"cat > /dev/null
if [ "$LOOPD_ACTION" = init ]; then
  { printf '{"status":"success","state_updates":{"tasks":['
    i=0; while [ $i -lt 100000 ]; do printf '{"description":"t"},'; i=$((i+1)); done
    printf '{"description":"last"}]}}'; } > "$LOOPD_RESULT_FILE"
else echo '{"status":"success","state_updates":{"passed":true}}' > "$LOOPD_RESULT_FILE"; fi
"#,
    );
    let id = q.create(&["--title", "t", "--max-errors", "1"]);
    assert_eq!(code(&q.run(&id, &[])), 4);
    let failed = q
        .events(&id)
        .into_iter()
        .find(|e| e["event"] == "action_failed" && e["action"] == "init")
        .expect("the init attempt failed");
    assert!(
        failed["error"]
            .as_str()
            .unwrap()
            .contains("over the limit of 200"),
        "{failed}"
    );
    assert!(std::fs::metadata(q.state_path(&id)).unwrap().len() < 64 << 10);

    // A task list of 100k lines: the first 200 tasks are taken, the rest skipped with a warning.
    let r = Project::new(GOOD_AGENT);
    let id = r.create(&["--title", "t", "--max-iterations", "2"]);
    // The first line's description is 200 KB: over the limit, so skipped.
    let lines: String = std::iter::once(format!(
        "{{\"id\":\"huge\",\"description\":\"{}\"}}\n",
        "h".repeat(200_000)
    ))
    .chain(
        (0..100_000).map(|i| format!("{{\"id\":\"task-{i:06}\",\"description\":\"task {i}\"}}\n")),
    )
    .collect();
    std::fs::write(r.root.join(format!(".loop/{id}.tasks.jsonl")), lines).unwrap();
    let out = r.run(&id, &[]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("over the limit of 200 tasks"),
        "{}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("\"huge\" is 200000 bytes"),
        "{}",
        stderr(&out)
    );
    let state = r.state(&id);
    assert_eq!(
        state["skill_state"]["develop"]["tasks"]
            .as_array()
            .unwrap()
            .len(),
        200
    );
    assert!(std::fs::metadata(r.state_path(&id)).unwrap().len() < 1 << 20);
}

#[test]
fn stop_works_on_a_state_too_big_or_broken() {
    let p = Project::new(&format!(
        "[ \"$LOOPD_ACTION\" = develop ] && {{ touch waiting; sleep 600; }}\n{GOOD_AGENT}"
    ));
    // A running loop whose state file and backup are both spoilt: stop ends its daemon.
    let id = p.create(&["--title", "t"]);
    let out = p.output(&["start", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let daemon: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("the develop to start", || p.root.join("waiting").exists());
    let junk = vec![b'{'; 17 << 20];
    let backup = p.root.join(format!(".loop/{id}.json.bak"));
    std::fs::write(&backup, &junk).unwrap();
    std::fs::write(p.state_path(&id), &junk).unwrap();
    let out = p.output(&["stop", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    wait_for("the daemon to end", || !alive(daemon));

    // Without a daemon, a state over the size limit with a good backup is restored and stopped.
    let id = p.create(&["--title", "big"]);
    let good = std::fs::read(p.state_path(&id)).unwrap();
    std::fs::write(p.root.join(format!(".loop/{id}.json.bak")), &good).unwrap();
    let mut big: serde_json::Map<String, Value> = serde_json::from_slice(&good).unwrap();
    big.insert("notes".into(), Value::String("n".repeat(17 << 20)));
    std::fs::write(p.state_path(&id), serde_json::to_vec(&big).unwrap()).unwrap();
    let out = p.output(&["stop", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stderr(&out).contains("restored"), "{}", stderr(&out));
    assert_eq!(p.state(&id)["status"], "failed");
    assert_eq!(p.state(&id)["failure_reason"], "Manually stopped by user");
}

#[test]
fn the_attempt_after_one_that_planted_a_fifo_gets_a_plain_result_file_again() {
    // The first develop puts a FIFO where its result goes; the retry writes a result there.
    let p = project(
        "json",
        "if [ ! -e planted ]; then touch planted; rm -f \"$LOOPD_RESULT_FILE\"; \
         mkfifo \"$LOOPD_RESULT_FILE\"; exit 0; fi; \
         echo '{\"status\":\"success\",\"summary\":\"second try\"}' > \"$LOOPD_RESULT_FILE\"",
    );
    p.config(
        "retry_backoff = 0.01\naction_retries = 1\nexecutor = \"fake\"\n[executor_defaults]\n\
         kill_grace = 0.5\n[executors.fake]\ncommand = [\"sh\", \"bin/agent.sh\"]\nformat = \"json\"\n\
         [actions.validate]\ncommand = \"true\"\n",
    );
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let summaries: Vec<String> = p
        .events(&id)
        .iter()
        .filter(|e| e["action"] == "develop" && e["event"] != "action_started")
        .map(|e| format!("{} {}", e["event"], e["summary"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        summaries,
        ["\"action_failed\" ", "\"action_finished\" second try"],
        "{summaries:?}"
    );
}

#[test]
fn each_attempt_finds_its_result_file_empty_and_links_an_executor_leaves_empty_nothing() {
    // Every attempt notes a result file it did not find empty; the first develop puts a hard
    // link to a file of the work tree in place of the result file, and a symlink to another one
    // in place of its spare (`.result.json.spare.tmp`), then fails; the rest write results.
    let p = Project::new(
        r#"cat > /dev/null
if [ -s "$LOOPD_RESULT_FILE" ]; then echo "$LOOPD_ACTION $LOOPD_ATTEMPT" >> dirty; fi
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"a"},{"description":"b"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop)
    if [ ! -e linked ]; then
      touch linked
      echo kept > hard; ln -f hard "$LOOPD_RESULT_FILE"
      echo kept > soft; ln -sf "$PWD/soft" "$(dirname "$LOOPD_RESULT_FILE")/.result.json.spare.tmp"
      exit 1
    fi
    echo '{"status":"success","summary":"done"}' > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","state_updates":{"passed":true,"pass_rate":100}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#,
    );
    p.config(
        "retry_backoff = 0.01\naction_retries = 1\nexecutor = \"fake\"\n\
         [executor_defaults]\nkill_grace = 0.5\n\
         [executors.fake]\ncommand = [\"sh\", \"bin/agent.sh\"]\nformat = \"json\"\n",
    );
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let failed = failed_attempt(&p, &id);
    assert!(
        failed["error"].as_str().unwrap_or("").contains("hard link"),
        "{failed}"
    );
    let finished = p
        .events(&id)
        .iter()
        .filter(|e| e["event"] == "action_finished")
        .count();
    assert!(finished >= 4, "init, two develops, validate: {finished}");
    assert!(
        !p.root.join("dirty").exists(),
        "attempts found a result in their result file: {}",
        std::fs::read_to_string(p.root.join("dirty")).unwrap_or_default()
    );
    for linked in ["hard", "soft"] {
        assert_eq!(
            std::fs::read_to_string(p.root.join(linked)).unwrap(),
            "kept\n",
            "{linked}"
        );
    }
}
