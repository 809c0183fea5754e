//! A newcomer's dead ends (issue 10): what stops a loop before it starts is said at once, in one
//! line per problem, and changes nothing.

mod common;

use common::*;

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
