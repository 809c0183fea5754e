//! A newcomer's dead ends (issue 10): what stops a loop before it starts is said at once, in one
//! line per problem, and changes nothing.

mod common;

use common::*;
use serde_json::json;

#[test]
fn a_loop_whose_programs_are_missing_is_refused_before_it_starts() {
    // The default executor (claude) is not installed here, and validate's command is a typo.
    let p = Project::new(GOOD_AGENT);
    p.config("[actions.validate]\ncommand = \"pytset -q\"\n");
    let id = p.create(&["--title", "t"]);
    let before = std::fs::read(p.state_path(&id)).unwrap();
    let path = "/usr/bin:/bin";
    for args in [vec!["run", id.as_str()], vec!["start", id.as_str()]] {
        let out = p.loopd().env("PATH", path).args(&args).output().unwrap();
        let err = stderr(&out);
        assert_eq!(code(&out), 2, "{args:?}: {err}");
        assert!(err.contains(&format!("loop {id} cannot run here")), "{err}");
        // One line per problem: four actions on the default executor, and validate's command.
        for action in ["init", "develop", "debug", "complete"] {
            assert!(
                err.lines().any(|l| l
                    .trim_start()
                    .starts_with(&format!("{action}: executor claude needs `claude`"))
                    && l.contains("default executor")),
                "{action}: {err}"
            );
        }
        assert!(
            err.lines()
                .any(|l| l.contains("validate: `pytset` (of `pytset -q`) is not found")),
            "{err}"
        );
    }
    assert_eq!(
        std::fs::read(p.state_path(&id)).unwrap(),
        before,
        "nothing changed"
    );
    assert!(
        !p.progress(&id).join("events.jsonl").exists(),
        "nothing ran"
    );
    // Paused, then resumed: refused the same way, before the status is touched.
    assert_eq!(code(&p.output(&["pause", &id])), 0);
    let out = p
        .loopd()
        .env("PATH", path)
        .args(["resume", &id])
        .output()
        .unwrap();
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert_eq!(p.state(&id)["status"], "paused");
}

#[test]
fn an_unknown_action_in_the_config_is_refused_with_a_suggestion() {
    let p = Project::new(GOOD_AGENT);
    std::fs::write(
        p.root.join(".loop/config.toml"),
        format!("{TEST_CONFIG}\n[actions.valdate]\ncommand = \"true\"\n"),
    )
    .unwrap();
    let out = p.output(&["doctor"]);
    let err = stderr(&out);
    assert_eq!(code(&out), 2, "{err}");
    assert!(err.contains("`actions.valdate`"), "{err}");
    assert!(err.contains("did you mean \"validate\"?"), "{err}");
}

#[test]
fn a_command_that_is_not_found_at_run_time_blocks_the_loop_rather_than_failing_tests() {
    // The check sees `sh`; the script it runs calls a program that is not there (exit 127).
    let p = Project::new(GOOD_AGENT);
    p.config(&format!(
        "{TEST_CONFIG}\n[actions.validate]\ncommand = \"sh bin/check.sh\"\n"
    ));
    p.script("check.sh", "pytset -q\n");
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &["--exit-on-pause"]);
    assert_eq!(code(&out), 6, "paused: {}", stderr(&out));
    let state = p.state(&id);
    assert_eq!(state["skill_state"]["error_count"], 0);
    let blocked = &state["skill_state"]["blocked"];
    assert_eq!(blocked["action"], "validate", "{blocked}");
    let reason = blocked["reason"].as_str().unwrap();
    assert!(reason.starts_with("exit code 127: "), "{reason}");
    assert!(reason.contains("pytset"), "{reason}");
    assert_eq!(state["skill_state"]["validate"]["passed"], false);
    assert!(
        state["skill_state"]["validate"]["last_run_at"].is_null(),
        "no test run recorded"
    );
    // Fixed and resumed, the loop completes, and the block is cleared from the state.
    p.script("check.sh", "true\n");
    let out = p.output(&["resume", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let pid: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("the loop to complete", || {
        p.state(&id)["status"] == "completed"
    });
    wait_for("its daemon to exit", || !alive(pid));
    let state = p.state(&id);
    assert!(state["skill_state"].get("blocked").is_none(), "{state}");
}

#[test]
fn a_mistyped_command_gets_a_suggestion_in_one_line() {
    let p = Project::new(GOOD_AGENT);
    let out = p.output(&["statsu"]);
    let err = stderr(&out);
    assert_eq!(code(&out), 2);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("'status'"), "{err}");
}

/// The line of `list`'s output about loop `id`.
fn row_of(listing: &str, id: &str) -> String {
    listing
        .lines()
        .find(|l| l.starts_with(id))
        .unwrap_or_else(|| panic!("{id}: {listing}"))
        .to_owned()
}

#[test]
fn list_has_a_header_and_tells_the_ways_loops_end_and_status_the_next_step() {
    // The wait for `go` is bounded: the test's directory may be gone before the agent looks.
    let p = Project::new(&format!(
        "if [ \"$LOOPD_ACTION\" = develop ] && grep -q HANGS-HERE \"$LOOPD_STATE_FILE\"; then\n\
           touch waiting; {}\n\
         fi\n{GOOD_AGENT}",
        wait_for_file("go")
    ));
    let passed = p.create(&["--title", "passes"]);
    assert_eq!(code(&p.run(&passed, &[])), 0);
    let limited = p.create(&["--title", "limited", "--max-iterations", "1"]);
    assert_eq!(code(&p.run(&limited, &[])), 3);
    let stopped = p.create(&["--title", "stopped"]);
    assert_eq!(code(&p.output(&["stop", &stopped])), 0);
    let fresh = p.create(&["--title", "fresh"]);
    // A loop whose daemon was killed in the middle of a develop.
    let orphan = p.create(&["--title", "HANGS-HERE"]);
    let out = p.output(&["start", &orphan]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let pid: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("the develop to start", || p.root.join("waiting").exists());
    // The daemon records the attempt in flight once it has its pid, a moment after the spawn.
    wait_for("the action in flight to be listed", || {
        row_of(&stdout(&p.output(&["list"])), &orphan).contains("develop ")
    });
    let listing = stdout(&p.output(&["list"]));
    assert!(
        listing.lines().next().unwrap().starts_with("LOOP"),
        "{listing}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("the daemon to die", || !alive(pid));
    // The kernel lets go of the dead daemon's lock a moment after the process is gone.
    wait_for("the loop to show no daemon", || {
        stdout(&p.output(&["list"])).contains("running (no daemon)")
    });
    let listing = stdout(&p.output(&["list"]));
    let row = |id: &str| row_of(&listing, id);
    assert!(row(&passed).contains("passed"), "{listing}");
    assert!(row(&limited).contains("iteration limit"), "{listing}");
    assert!(row(&stopped).contains("stopped"), "{listing}");
    assert!(row(&fresh).contains("created"), "{listing}");
    assert!(row(&orphan).contains("running (no daemon)"), "{listing}");

    let next = |id: &str| {
        let status = stdout(&p.output(&["status", id]));
        status
            .lines()
            .find(|l| l.trim_start().starts_with("next"))
            .map(str::to_owned)
    };
    assert!(
        next(&fresh)
            .unwrap()
            .contains(&format!("`loopd start {fresh}`"))
    );
    assert!(next(&orphan).unwrap().contains("nothing drives it"));
    assert!(
        next(&stopped)
            .unwrap()
            .contains(&format!("`loopd resume {stopped}`"))
    );
    assert_eq!(next(&passed), None, "nothing to do for a passed loop");
    // The killed daemon's executor is still waiting: let it end.
    std::fs::write(p.root.join("go"), "").unwrap();
}

#[test]
fn a_loop_failed_at_its_error_limit_is_recovered_with_retry() {
    // Develop fails until the problem is fixed (the file `fixed`).
    let p = Project::new(&format!(
        "if [ \"$LOOPD_ACTION\" = develop ] && [ ! -f fixed ]; then cat > /dev/null; \
         echo '{{\"status\":\"failed\",\"summary\":\"no compiler\"}}' > \"$LOOPD_RESULT_FILE\"; exit 0; fi\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t", "--max-errors", "1"]);
    assert_eq!(code(&p.run(&id, &[])), 4);
    // Resume alone would fail again at once: refused, with the ways out.
    let out = p.output(&["resume", &id]);
    let err = stderr(&out);
    assert_eq!(code(&out), 2, "{err}");
    assert!(err.contains(&format!("`loopd retry {id}`")), "{err}");
    assert!(err.contains("--max-errors"), "{err}");
    assert_eq!(p.state(&id)["status"], "failed");
    assert_eq!(
        p.state(&id)["skill_state"]["develop"]["tasks"][0]["status"],
        "failed"
    );
    // Retry is refused where it makes no sense.
    let fresh = p.create(&["--title", "fresh"]);
    let out = p.output(&["retry", &fresh]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("retry is for a failed or stopped loop"),
        "{}",
        stderr(&out)
    );

    std::fs::write(p.root.join("fixed"), "").unwrap();
    let out = p.output(&["retry", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("1 failed task(s) pending again"),
        "{}",
        stderr(&out)
    );
    let pid: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("the retried loop to complete", || {
        p.state(&id)["status"] == "completed"
    });
    wait_for("its daemon to exit", || !alive(pid));
    let state = p.state(&id);
    assert_eq!(state["skill_state"]["outcome"], "passed");
    assert_eq!(state["skill_state"]["error_count"], 0);
}

#[test]
fn set_raises_a_limit_and_task_add_gives_a_loop_more_work() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t", "--max-iterations", "1"]);
    assert_eq!(code(&p.run(&id, &[])), 3);
    let out = p.output(&["resume", &id]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains(&format!("loopd set {id} --max-iterations N")),
        "{}",
        stderr(&out)
    );
    for bad in [vec!["set", &id], vec!["set", &id, "--max-errors", "0"]] {
        let out = p.output(&bad);
        assert_eq!(code(&out), 2, "{bad:?}: {}", stderr(&out));
        assert_eq!(stderr(&out).trim().lines().count(), 1, "{}", stderr(&out));
    }
    let out = p.output(&[
        "set",
        &id,
        "--max-iterations",
        "10",
        "--max-cost-usd",
        "2.5",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let state = p.state(&id);
    assert_eq!(state["max_iterations"], 10);
    assert_eq!(state["max_cost_usd"], 2.5);
    // One more task before going on: the loop develops it too.
    let out = p.output(&["task", "add", &id, "write the docs"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "task-003");
    let out = p.output(&["resume", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    wait_for("the loop to complete", || {
        let s = p.state(&id);
        s["status"] == "completed" && s["skill_state"]["outcome"] == "passed"
    });
    let tasks = &p.state(&id)["skill_state"]["develop"]["tasks"];
    let added = tasks
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"] == "task-003")
        .expect("the added task joined");
    assert_eq!(added["status"], "completed");
    assert_eq!(added["description"], "write the docs");
    // A passed loop takes no more tasks.
    let out = p.output(&["task", "add", &id, "more"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("would never run"), "{}", stderr(&out));
}

#[test]
fn logs_follow_shows_the_output_of_the_action_in_flight_and_waits_for_a_loop_to_start() {
    let p = Project::new(&format!(
        "if [ \"$LOOPD_ACTION\" = develop ]; then echo \"building $LOOPD_TASK_ID\"; echo 'warning: on stderr' >&2; fi\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t"]);
    // Started before the loop: it waits for it rather than returning at once.
    let follow: Running = p
        .loopd()
        .args(["logs", &id, "--follow", "--utc"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap()
        .into();
    let quiet: Running = p
        .loopd()
        .args(["logs", &id, "--follow", "--events-only"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap()
        .into();
    // Each keeps polling (its read count grows) rather than returning, as it did before a loop
    // had started.
    let reads = |pid: u32| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/io"))
            .ok()
            .and_then(|io| {
                io.lines()
                    .find_map(|l| l.strip_prefix("syscr: ")?.parse().ok())
            })
            .unwrap_or(0)
    };
    for pid in [follow.id(), quiet.id()] {
        let before = reads(pid);
        wait_for("a follower to poll a few times", || {
            reads(pid) > before + 20 || !alive(pid)
        });
        assert!(
            alive(pid),
            "the follower of a loop not yet started waits for it"
        );
    }
    assert_eq!(code(&p.run(&id, &[])), 0);
    let text = stdout(&wait_output(follow, DEADLINE));
    let lines: Vec<&str> = text.lines().collect();
    // The develop's own output, between its start and its end.
    let started = lines
        .iter()
        .position(|l| {
            l.contains("develop") && l.contains("action started") && l.contains("task-001")
        })
        .unwrap_or_else(|| panic!("{text}"));
    let shown = lines
        .iter()
        .position(|l| *l == "  │ building task-001")
        .unwrap_or_else(|| panic!("{text}"));
    let finished = lines
        .iter()
        .position(|l| {
            l.contains("develop") && l.contains("action finished") && l.contains("task-001")
        })
        .unwrap_or_else(|| panic!("{text}"));
    assert!(started < shown && shown < finished, "{text}");
    assert!(text.contains("  │ warning: on stderr"), "{text}");
    assert!(text.contains("completed"), "{text}");
    // Full timestamps, here in UTC: 2026-11-23 11:52:08.123Z.
    let first = lines[0];
    assert_eq!(&first[4..5], "-", "{first}");
    assert_eq!(&first[10..11], " ", "{first}");
    assert_eq!(&first[23..24], "Z", "{first}");
    let quiet = stdout(&wait_output(quiet, DEADLINE));
    assert!(quiet.contains("completed"), "{quiet}");
    assert!(!quiet.contains("│"), "--events-only: {quiet}");
    // Local time by default, with its offset.
    let local = stdout(&p.output(&["logs", &id]));
    let first = local.lines().next().unwrap();
    assert!(
        first[24..30].starts_with('+') || first[24..30].starts_with('-'),
        "{first}"
    );
}

#[test]
fn a_broken_config_never_keeps_anyone_from_looking_at_or_stopping_a_loop() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    std::fs::write(p.root.join(".loop/config.toml"), "max_errors = \"three\"\n").unwrap();
    for args in [
        vec!["status", id.as_str()],
        vec!["list"],
        vec!["logs", id.as_str()],
        vec!["pause", id.as_str()],
        vec!["stop", id.as_str()],
    ] {
        let out = p.output(&args);
        let err = stderr(&out);
        assert_eq!(code(&out), 0, "{args:?}: {err}");
        assert!(
            err.starts_with("loopd: warning: bad config"),
            "{args:?}: {err}"
        );
    }
    assert_eq!(p.state(&id)["status"], "failed", "stopped");
    // What runs something still refuses it.
    let out = p.output(&["run", &id]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("max_errors"), "{}", stderr(&out));
}

#[test]
fn completions_a_man_page_and_one_exit_code_table() {
    let p = Project::new(GOOD_AGENT);
    for shell in ["bash", "zsh", "fish"] {
        let out = p.output(&["completions", shell]);
        assert_eq!(code(&out), 0, "{shell}");
        assert!(
            stdout(&out).contains("retry"),
            "{shell}: every command is there"
        );
    }
    let man = p.output(&["man"]);
    assert_eq!(code(&man), 0);
    assert!(stdout(&man).starts_with(".ie"), "roff");
    assert!(stdout(&man).contains("Exit codes, for every command"));
    let help = stdout(&p.output(&["--help"]));
    assert!(
        help.contains("Exit codes, for every command: 0 done, 1 internal error, 2 bad input"),
        "{help}"
    );
}

#[test]
fn a_first_loop_without_any_agent_does_real_work_and_completes() {
    // A project whose test needs one file per task; no agent anywhere.
    let p = Project::new("");
    std::fs::remove_file(p.root.join(".loop/config.toml")).unwrap();
    std::fs::write(
        p.root.join("fix.sh"),
        "# Does the task named in the environment.\necho \"$LOOPD_TASK\" > \"$LOOPD_TASK_ID.done\"\n",
    )
    .unwrap();
    std::fs::write(
        p.root.join("test.sh"),
        "for t in task-001 task-002; do [ -f $t.done ] && echo \"ok - $t\" || { echo \"not ok - $t\"; fail=1; }; done\nexit ${fail:-0}\n",
    )
    .unwrap();
    let out = p.output(&[
        "init",
        "--shell",
        "--develop",
        "sh fix.sh",
        "--validate",
        "sh test.sh",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stderr(&out).contains("(trusted)"), "{}", stderr(&out));
    // Written once; again only with --force.
    let again = p.output(&["init", "--shell", "--develop", "x", "--validate", "y"]);
    assert_eq!(code(&again), 2);
    assert!(stderr(&again).contains("--force"), "{}", stderr(&again));

    let id = p.create(&[
        "--title",
        "one file per task",
        "--task",
        "first",
        "--task",
        "second",
    ]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(
        std::fs::read_to_string(p.root.join("task-001.done")).unwrap(),
        "first\n"
    );
    assert_eq!(
        std::fs::read_to_string(p.root.join("task-002.done")).unwrap(),
        "second\n"
    );
    let state = p.state(&id);
    assert_eq!(state["skill_state"]["outcome"], "passed");
    assert_eq!(state["skill_state"]["validate"]["pass_rate"], 100.0);
}

/// The one JSON value a command printed on stdout, after checking it succeeded.
fn json_of(p: &Project, args: &[&str]) -> serde_json::Value {
    let out = p.output(args);
    assert_eq!(code(&out), 0, "{args:?}: {}", stderr(&out));
    serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| {
        panic!(
            "{args:?} printed no single JSON value ({e}): {}",
            stdout(&out)
        )
    })
}

#[test]
fn every_command_that_prints_a_result_prints_json_on_request() {
    let p = Project::new(GOOD_AGENT);
    let doctor = json_of(&p, &["doctor", "--json"]);
    assert_eq!(doctor["ready"], true, "{doctor}");
    assert_eq!(doctor["actions"].as_array().unwrap().len(), 5, "{doctor}");
    assert!(
        doctor["problems"].as_array().unwrap().is_empty(),
        "{doctor}"
    );
    let trusted = json_of(&p, &["trust", "--json"]);
    assert!(
        !trusted["trusted"].as_array().unwrap().is_empty(),
        "{trusted}"
    );

    let id = json_of(&p, &["create", "--title", "t", "--json"])["loop_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let added = json_of(&p, &["task", "add", &id, "one more", "--json"]);
    assert_eq!(
        (&added["loop_id"], &added["task_id"]),
        (&json!(id), &json!("task-001"))
    );
    let set = json_of(&p, &["--json", "set", &id, "--max-iterations", "9"]);
    assert_eq!(set["set"]["max_iterations"], 9);
    let paused = json_of(&p, &["pause", &id, "--json"]);
    assert_eq!(
        (&paused["from"], &paused["status"]),
        (&json!("created"), &json!("paused"))
    );
    let resumed = json_of(&p, &["resume", &id, "--json"]);
    assert_eq!(resumed["status"], "running");
    let pid = resumed["pid"].as_u64().expect("resume started a daemon") as u32;
    wait_for("the loop to complete", || {
        p.state(&id)["status"] == "completed"
    });
    wait_for("its daemon to exit", || !alive(pid));
    assert_eq!(
        json_of(&p, &["status", &id, "--json"])["loop_id"],
        id.as_str()
    );
    let listed = json_of(&p, &["list", "--json"]);
    assert_eq!(listed[0]["loop_id"], id.as_str());
    // logs: one event per line.
    let out = p.output(&["logs", &id, "--json"]);
    assert!(stdout(&out).lines().count() > 3);
    for line in stdout(&out).lines() {
        serde_json::from_str::<serde_json::Value>(line).unwrap();
    }

    let other = json_of(&p, &["create", "--title", "u", "--json"])["loop_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let stopped = json_of(&p, &["stop", &other, "--json"]);
    assert_eq!(stopped["status"], "failed");
    let retried = json_of(&p, &["retry", &other, "--json"]);
    assert_eq!(
        (&retried["from"], &retried["tasks_reset"]),
        (&json!("failed"), &json!(0))
    );
    let pid = retried["pid"].as_u64().unwrap() as u32;
    wait_for("the retried loop to complete", || {
        p.state(&other)["status"] == "completed"
    });
    wait_for("its daemon to exit", || !alive(pid));

    let third = p.create(&["--title", "v"]);
    let ran = json_of(&p, &["run", &third, "--json"]);
    assert_eq!(
        (&ran["status"], &ran["outcome"], &ran["exit_code"]),
        (&json!("completed"), &json!("passed"), &json!(0))
    );

    let fresh = Project::new("");
    std::fs::remove_file(fresh.root.join(".loop/config.toml")).unwrap();
    let init = json_of(
        &fresh,
        &[
            "init",
            "--shell",
            "--develop",
            "true",
            "--validate",
            "true",
            "--json",
        ],
    );
    assert!(
        init["config"]
            .as_str()
            .unwrap()
            .ends_with(".loop/config.toml"),
        "{init}"
    );
    // What prints text for people refuses --json in one line.
    for args in [&["man", "--json"][..], &["completions", "bash", "--json"]] {
        let out = p.output(args);
        assert_eq!(code(&out), 2, "{args:?}");
        assert_eq!(stderr(&out).trim().lines().count(), 1, "{}", stderr(&out));
    }
}

#[test]
fn two_loops_never_edit_one_work_tree_at_once_unless_one_has_a_worktree_of_its_own() {
    // Develop leaves a mark in the work tree it runs in (its working directory, and its
    // LOOPD_ROOT), then waits for `go` in the project root.
    let p = Project::new("");
    let go = p.root.join("go");
    p.agent(&format!(
        "if [ \"$LOOPD_ACTION\" = develop ]; then [ \"$(pwd -P)\" = \"$LOOPD_ROOT\" ] && touch \"$LOOPD_ROOT/mark-$LOOPD_LOOP_ID\"; \
         i=0; while [ ! -f '{}' ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done; fi\n{GOOD_AGENT}",
        go.display()
    ));
    git(&p.root, &["init", "-q"]);
    git(&p.root, &["add", "bin"]);
    git(&p.root, &["commit", "-q", "-m", "agent"]);
    let head = git(&p.root, &["rev-parse", "HEAD"]);

    let first = p.create(&["--title", "first"]);
    let out = p.output(&["start", &first]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let first_pid: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("the first loop to develop", || {
        p.root.join(format!("mark-{first}")).exists()
    });

    // A second loop of the same work tree is refused, in one line that names the first.
    let second = p.create(&["--title", "second"]);
    for args in [vec!["run", &second], vec!["start", &second]] {
        let out = p.output(&args);
        let err = stderr(&out);
        assert_eq!(code(&out), 2, "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(&first) && err.contains("--worktree"), "{err}");
    }
    assert_eq!(p.state(&second)["status"], "created");

    // One with a worktree of its own runs beside it, there and not in the project root.
    let third = p.create(&["--title", "third", "--worktree"]);
    let worktree = p.root.join(".loop/worktrees").join(&third);
    let out = p.output(&["status", &third]);
    assert!(
        stdout(&out).contains(&format!("{} (branch loopd/{third})", worktree.display())),
        "{}",
        stdout(&out)
    );
    let out = p.output(&["start", &third]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let third_pid: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("the third loop to develop in its worktree", || {
        worktree.join(format!("mark-{third}")).exists()
    });
    assert!(!p.root.join(format!("mark-{third}")).exists());

    std::fs::write(&go, "").unwrap();
    for (id, pid) in [(&first, first_pid), (&third, third_pid)] {
        wait_for("the loop to complete", || {
            p.state(id)["status"] == "completed"
        });
        wait_for("its daemon to exit", || !alive(pid));
    }
    // The work tree is free again; the user's branch never moved.
    assert_eq!(code(&p.run(&second, &[])), 0);
    assert_eq!(git(&p.root, &["rev-parse", "HEAD"]), head);
    assert!(git(&p.root, &["branch", "--list", "loopd/*"]).contains(&third));
}

#[test]
fn a_worktree_needs_a_git_repository_and_leaves_nothing_when_refused() {
    let p = Project::new(GOOD_AGENT);
    let out = p.output(&["create", "--title", "t", "--worktree"]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert_eq!(stderr(&out).trim().lines().count(), 1, "{}", stderr(&out));
    assert!(stderr(&out).contains("git repository"), "{}", stderr(&out));
    let out = p.output(&["list", "--json"]);
    assert_eq!(stdout(&out).trim(), "[]");
}

#[test]
fn a_fault_gets_one_exit_code_and_one_line_whichever_command_meets_it() {
    let p = Project::new("");
    let go = p.root.join("go");
    p.agent(&format!(
        "i=0; while [ ! -f '{}' ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done\n{GOOD_AGENT}",
        go.display()
    ));
    let id = p.create(&["--title", "t"]);
    for cmd in ["run", "start"] {
        let out = p.output(&[cmd, &id, "--executor", "nope"]);
        let err = stderr(&out);
        assert_eq!(code(&out), 2, "{cmd}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{cmd}: {err}");
        assert!(
            err.contains("--executor: unknown executor \"nope\""),
            "{err}"
        );
    }
    // Two starts at once: one daemon; the other is refused as if it had come second.
    let starts: Vec<_> = (0..2)
        .map(|_| {
            Running::from(
                p.loopd()
                    .args(["start", &id])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    let outs: Vec<_> = starts
        .into_iter()
        .map(|c| wait_output(c, DEADLINE))
        .collect();
    let (won, lost): (Vec<_>, Vec<_>) = outs.iter().partition(|o| code(o) == 0);
    assert_eq!(
        (won.len(), lost.len()),
        (1, 1),
        "{:?}",
        outs.iter().map(stderr).collect::<Vec<_>>()
    );
    let pid: u32 = stdout(won[0]).trim().parse().unwrap();
    assert_eq!(code(lost[0]), 2, "{}", stderr(lost[0]));
    assert!(
        stderr(lost[0]).contains(&format!("already driven by a daemon (pid {pid})")),
        "{}",
        stderr(lost[0])
    );
    std::fs::write(&go, "").unwrap();
    wait_for("the loop to complete", || {
        p.state(&id)["status"] == "completed"
    });
    wait_for("its daemon to exit", || !alive(pid));
}

#[test]
fn create_and_start_record_the_project_and_projects_lists_them() {
    // Two projects of one user (one home), a third created elsewhere and then deleted.
    let home = tempfile::tempdir().unwrap();
    let (a, b, gone) = (
        Project::new(GOOD_AGENT),
        Project::new(GOOD_AGENT),
        Project::new(GOOD_AGENT),
    );
    let loopd = |p: &Project, args: &[&str]| {
        p.loopd()
            .env("HOME", home.path())
            .args(args)
            .output()
            .unwrap()
    };
    for p in [&a, &b, &gone] {
        // Trusted for this home too: the projects run with it.
        assert_eq!(code(&loopd(p, &["trust"])), 0);
    }
    let id = stdout(&loopd(&a, &["create", "--title", "t"]))
        .trim()
        .to_owned();
    assert_eq!(code(&loopd(&a, &["run", &id])), 0);
    assert_eq!(code(&loopd(&b, &["create", "--title", "u"])), 0);
    assert_eq!(code(&loopd(&b, &["create", "--title", "v"])), 0);
    assert_eq!(code(&loopd(&gone, &["create", "--title", "w"])), 0);
    let records = home.path().join(".local/state/loopd/projects");
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        records.metadata().unwrap().permissions().mode() & 0o777,
        0o700
    );

    let listed = |p: &Project| -> Vec<(String, u64)> {
        let out = loopd(p, &["projects", "--json"]);
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        let rows: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        rows.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["root"].as_str().unwrap().to_owned(),
                    r["loops"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let root = |p: &Project| p.root.display().to_string();
    let mut expected = vec![(root(&a), 1), (root(&b), 2), (root(&gone), 1)];
    expected.sort();
    assert_eq!(listed(&a), expected);
    let text = stdout(&loopd(&a, &["projects"]));
    assert!(
        text.starts_with("LOOPS") && text.contains(&root(&b)),
        "{text}"
    );

    // A deleted project is forgotten at the next record; one can be forgotten by hand.
    let gone_root = root(&gone);
    drop(gone);
    assert_eq!(code(&loopd(&a, &["create", "--title", "x"])), 0);
    let out = loopd(&a, &["projects", "--remove", &root(&b)]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(listed(&a), vec![(root(&a), 2)]);
    assert!(!stdout(&loopd(&a, &["projects"])).contains(&gone_root));
    let out = loopd(&a, &["projects", "--remove", &root(&b)]);
    assert_eq!(code(&out), 2);
    assert_eq!(stderr(&out).trim().lines().count(), 1, "{}", stderr(&out));
}

#[test]
fn the_demo_run_from_a_clone_says_how_to_install_that_build_as_the_readme_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let without = dir.path().join("bin-without");
    let with = dir.path().join("bin-with");
    for d in [&without, &with] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_loopd"), with.join("loopd")).expect("link");
    let hint = "cargo install --locked --path . --target-dir target";
    let demo_on = |path: &std::path::Path| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_loopd"));
        cmd.arg("demo")
            .env("TMPDIR", dir.path())
            .env("HOME", dir.path())
            .env("PATH", format!("{}:/usr/bin:/bin", path.display()))
            .env_remove("LOOPD_CONFIG")
            .env_remove("LOOPD_ROOT")
            .stdin(std::process::Stdio::null());
        let out = cmd.output().expect("run loopd demo");
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        stdout(&out)
    };
    let shown = demo_on(&without);
    assert!(shown.contains(&format!("\n  {hint}\n")), "{shown}");
    assert!(!demo_on(&with).contains(hint));
    // The README's install step is the same command.
    let readme = include_str!("../README.md");
    let install = readme
        .split("## Install")
        .nth(1)
        .expect("an Install section");
    assert!(
        install.contains(&format!("    {hint}")),
        "README's Install: {install}"
    );
}
