//! No-progress detection (docs/control.md, "No progress"), through the real binary: a loop whose agent
//! changes nothing pauses after `no_progress_rounds` rounds with reason `no_progress`, says what
//! each kind of round did, shows it in `status` and `list`, and goes on counting afresh once
//! resumed; a round that changes a file is progress (its checkpoint says, or without git the
//! fingerprint of the tree's files), a fix task added and done that changed none is not;
//! `on_no_progress = "fail"` fails the loop instead.

mod common;

use common::*;

/// Plans one task and develops it; validation always fails the same test; debug finds nothing
/// and changes nothing, unless `debug.sh` in the root says otherwise (it may set the result,
/// `r`), nor does develop but for `develop.sh`; once `fixed` exists in the root, validation
/// passes.
const STUCK_AGENT: &str = r#"
cat > /dev/null
case "$LOOPD_ACTION" in
  init) r='{"status":"success","state_updates":{"tasks":[{"description":"one"}]}}' ;;
  develop) r='{"status":"success","summary":"did it"}'; [ -f develop.sh ] && . ./develop.sh ;;
  validate)
    if [ -f fixed ]; then r='{"status":"success","state_updates":{"passed":true,"pass_rate":100}}'
    else r='{"status":"success","state_updates":{"passed":false,"pass_rate":50,"failed_tests":["t_login"]}}'; fi ;;
  debug) r='{"status":"success","summary":"no idea"}'; [ -f debug.sh ] && . ./debug.sh ;;
  *) r='{"status":"success","state_updates":{"summary":"done"}}' ;;
esac
echo "$r" > "$LOOPD_RESULT_FILE"
"#;

fn stuck_project(extra_config: &str) -> Project {
    let p = Project::new(STUCK_AGENT);
    // Top-level keys before the config's tables.
    p.config(&format!("{extra_config}\n{TEST_CONFIG}"));
    p
}

/// The actions that finished, in order, from the loop's events.
fn finished_actions(p: &Project, id: &str) -> Vec<String> {
    p.events_named(id, "action_finished")
        .iter()
        .map(|e| e["action"].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn git_project(extra_config: &str) -> Project {
    let p = stuck_project(extra_config);
    std::fs::write(p.root.join(".gitignore"), ".loop/\nbin/\n").unwrap();
    std::fs::write(p.root.join("code.txt"), "v1\n").unwrap();
    git(&p.root, &["init", "--quiet", "--initial-branch=main"]);
    git(&p.root, &["add", "."]);
    git(&p.root, &["commit", "--quiet", "-m", "base"]);
    p
}

#[test]
fn a_loop_that_changes_nothing_pauses_with_no_progress_and_resumes_counting_afresh() {
    let p = git_project("max_iterations = 30");
    let id = p.create(&["--title", "stuck"]);
    let out = p.run(&id, &["--exit-on-pause"]);
    assert_eq!(code(&out), 6, "paused: {}", stderr(&out));

    // init, develop, then validate → debug → validate → debug: the three rounds after the first
    // validation left everything as it was.
    assert_eq!(
        finished_actions(&p, &id),
        ["init", "develop", "validate", "debug", "validate", "debug"]
    );
    let s = p.state(&id);
    assert_eq!(s["status"], "paused");
    let stalled = &s["skill_state"]["no_progress"]["paused"];
    let reason = stalled["reason"].as_str().unwrap();
    assert_eq!(
        reason,
        "no progress in 3 rounds: debug changed no file each time; validation failed t_login"
    );
    let events = p.events_named(&id, "no_progress");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["reason"], reason);

    let status = stdout(&p.output(&["status", &id]));
    assert!(status.contains("no progress"), "{status}");
    assert!(
        status.contains("stalled    no progress in 3 rounds: debug changed no file"),
        "{status}"
    );
    let list = stdout(&p.output(&["list"]));
    let line = list.lines().find(|l| l.contains(&id)).unwrap();
    assert!(line.contains("no progress"), "{list}");

    // Resumed as it is (which starts a daemon): three more rounds without progress before it
    // pauses again.
    assert_eq!(code(&p.output(&["resume", &id])), 0);
    wait_for("the second pause", || {
        p.events_named(&id, "no_progress").len() == 2
    });
    let actions = finished_actions(&p, &id);
    assert_eq!(
        actions[6..],
        ["validate", "debug", "validate"],
        "{actions:?}"
    );
    assert_eq!(p.state(&id)["status"], "paused");

    // Fixed by a person: resumed, it passes.
    std::fs::write(p.root.join("fixed"), "").unwrap();
    assert_eq!(code(&p.output(&["resume", &id])), 0);
    wait_for("completion", || p.state(&id)["status"] == "completed");
    let s = p.state(&id);
    assert_eq!(s["skill_state"]["outcome"], "passed");
    assert!(s["skill_state"]["no_progress"]["paused"].is_null(), "{s}");
    wait_for("the daemon's exit", || {
        p.event_names(&id).last().map(String::as_str) == Some("daemon_exited")
    });
}

#[test]
fn a_debug_that_changes_a_file_each_round_is_progress() {
    let p = git_project("max_iterations = 12");
    std::fs::write(p.root.join("debug.sh"), "date +%s%N >> code.txt\n").unwrap();
    let id = p.create(&["--title", "stuck"]);
    let out = p.run(&id, &["--exit-on-pause"]);
    assert_eq!(code(&out), 3, "iteration limit: {}", stderr(&out));
    assert!(p.events_named(&id, "no_progress").is_empty());
    assert_eq!(p.state(&id)["skill_state"]["outcome"], "iteration_limit");
}

/// The stuck cycle: validation fails the same test, debug proposes a fix task, develop says it
/// applied it and changes no file. The task bookkeeping (a task added and done each round) is no
/// progress: with and without git, the fix worded the same or differently each time, the loop
/// pauses in three rounds and says what happened.
#[test]
fn a_fix_proposed_and_done_each_round_that_changes_no_file_is_no_progress() {
    for (with_git, worded_alike) in [(true, true), (true, false), (false, true), (false, false)] {
        let p = if with_git {
            git_project("max_iterations = 12")
        } else {
            stuck_project("max_iterations = 12")
        };
        let fix = match worded_alike {
            true => "fix the off by one",
            false => "fix the off by one, take $(date +%N)",
        };
        std::fs::write(
            p.root.join("debug.sh"),
            format!(
                "r=\"{{\\\"status\\\":\\\"success\\\",\\\"state_updates\\\":{{\\\"fix_tasks\\\":[{{\\\"description\\\":\\\"{fix}\\\"}}]}}}}\"\n"
            ),
        )
        .unwrap();
        let id = p.create(&["--title", "stuck"]);
        let out = p.run(&id, &["--exit-on-pause"]);
        let case = format!("git {with_git}, worded alike {worded_alike}");
        assert_eq!(code(&out), 6, "{case}: {}", stderr(&out));
        // init, develop, validate; then debug, develop, validate: three rounds alike.
        assert_eq!(
            finished_actions(&p, &id),
            [
                "init", "develop", "validate", "debug", "develop", "validate"
            ],
            "{case}"
        );
        let reason = p.events_named(&id, "no_progress")[0]["reason"]
            .as_str()
            .unwrap()
            .to_owned();
        let proposed = match worded_alike {
            true => "debug proposed 'fix the off by one'".to_owned(),
            false => "debug proposed 'fix the off by one, take ".to_owned(),
        };
        assert!(
            reason.starts_with(&format!("no progress in 3 rounds: {proposed}")),
            "{case}: {reason}"
        );
        assert!(
            reason.ends_with("develop changed no file; validation failed t_login"),
            "{case}: {reason}"
        );
        let status = stdout(&p.output(&["status", &id]));
        assert!(status.contains(&reason), "{case}: {status}");
    }
}

/// A loop that makes real progress slowly (one file changed every third round) is never paused,
/// with git and without.
#[test]
fn a_file_changed_every_third_round_is_progress() {
    for with_git in [true, false] {
        let p = if with_git {
            git_project("max_iterations = 12")
        } else {
            stuck_project("max_iterations = 12")
        };
        // Each debug proposes a fix; develop applies it (one file changed), validation still
        // fails: debug, develop, validate, so one round in three changes a file.
        std::fs::write(
            p.root.join("debug.sh"),
            "r='{\"status\":\"success\",\"state_updates\":{\"fix_tasks\":[{\"description\":\"fix\"}]}}'\n",
        )
        .unwrap();
        std::fs::write(
            p.root.join("develop.sh"),
            "[ \"$LOOPD_TASK\" = fix ] && date +%s%N >> code.txt\n",
        )
        .unwrap();
        let id = p.create(&["--title", "slow"]);
        let out = p.run(&id, &["--exit-on-pause"]);
        assert_eq!(code(&out), 3, "git {with_git}: {}", stderr(&out));
        assert!(
            p.events_named(&id, "no_progress").is_empty(),
            "git {with_git}: {:?}",
            p.events_named(&id, "no_progress")
        );
        assert_eq!(p.state(&id)["skill_state"]["outcome"], "iteration_limit");
    }
}

#[test]
fn the_same_error_round_after_round_is_no_progress_and_fail_fails_the_loop() {
    // Every debug fails the same way, but for the numbers and the path in its error.
    let p = stuck_project("action_retries = 0\nno_progress_rounds = 2\non_no_progress = \"fail\"");
    std::fs::write(
        p.root.join("debug.sh"),
        r#"r="{\"status\":\"failed\",\"summary\":\"build failed at $PWD/src/main.rs:$$ after $(date +%N) ms\"}""#,
    )
    .unwrap();
    let id = p.create(&["--title", "stuck"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 4, "failed: {}", stderr(&out));
    // validate, debug (a new error), validate, debug: two rounds alike.
    assert_eq!(
        finished_actions(&p, &id),
        ["init", "develop", "validate", "validate"]
    );
    let s = p.state(&id);
    let reason = s["failure_reason"].as_str().unwrap();
    assert!(reason.starts_with("no progress in 2 rounds"), "{reason}");
    assert!(
        reason.contains("debug failed: reported failure: build failed at <path> after # ms"),
        "{reason}"
    );
    assert!(
        p.events_named(&id, "no_progress").is_empty(),
        "failed, not paused"
    );
}

#[test]
fn zero_rounds_turns_it_off() {
    let p = stuck_project("max_iterations = 8\nno_progress_rounds = 0");
    let id = p.create(&["--title", "stuck"]);
    let out = p.run(&id, &["--exit-on-pause"]);
    assert_eq!(code(&out), 3, "iteration limit: {}", stderr(&out));
    assert!(p.events_named(&id, "no_progress").is_empty());
}

#[test]
fn a_bad_rule_is_refused_in_one_line() {
    let p = stuck_project("on_no_progress = \"explode\"");
    let out = p.output(&["create", "--title", "stuck"]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("on_no_progress"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
