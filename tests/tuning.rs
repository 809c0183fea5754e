//! The skill-tuning workflow through the real binary: its demo, a whole loop with a scripted
//! executor, and the control paths every loop has (pause, resume, stop, a question, a daemon
//! killed mid-action) on a loop of this workflow.

mod common;

use common::*;
use serde_json::Value;

fn create(p: &Project, extra: &[&str]) -> String {
    let mut args = vec!["--workflow", "skill-tuning", "--target-skill", "skills/s"];
    args.extend_from_slice(extra);
    p.create(&args)
}

fn actions_started(p: &Project, id: &str) -> Vec<String> {
    p.events(id)
        .iter()
        .filter(|e| e["event"] == "action_started")
        .map(|e| e["action"].as_str().unwrap_or("").to_owned())
        .collect()
}

#[test]
fn the_demo_tunes_its_skill_until_the_gate_passes() {
    let dir = tempfile::tempdir().unwrap();
    let out = demo(dir.path(), &["--workflow", "skill-tuning"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stdout(&out).contains("quality gate pass"),
        "{}",
        stdout(&out)
    );
    let path = demo_state_file(&out);
    let state: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let skill = &state["skill_state"];
    assert_eq!(skill["quality_gate"], "pass");
    assert_eq!(skill["quality_score"], 100);
    assert_eq!(skill["resolved_issues"], 4);
    assert_eq!(state["current_iteration"], 1, "only verify counts");
    let verdicts: Vec<&Value> = skill["applied_fixes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| &f["verification_result"])
        .collect();
    assert_eq!(verdicts, [&Value::from("pass"); 4]);
    // The agent's edits are in the skill's files for real.
    let root = std::path::Path::new(&path)
        .parent()
        .unwrap()
        .parent()
        .unwrap();
    let md = std::fs::read_to_string(root.join("skills/changelog-writer/SKILL.md")).unwrap();
    assert!(!md.contains("again") && !md.contains("03-publish"), "{md}");
    // The demo of the other workflow is still there.
    assert_eq!(code(&demo(dir.path(), &["--workflow", "nope"])), 2);
}

#[test]
fn a_skill_tuning_loop_runs_whole_and_is_shown_as_its_workflow() {
    let p = tuning_project(TUNING_AGENT);
    let id = create(&p, &["--focus", "memory,docs", "--issue", "it forgets"]);
    let state = p.state(&id);
    assert_eq!(state["max_iterations"], 5, "the workflow's own default");
    assert_eq!(state["max_errors"], 3);
    assert_eq!(state["title"], "Tune the s skill");
    assert!(state["skill_state"].get("develop").is_none(), "{state}");
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(
        actions_started(&p, &id),
        [
            "init",
            "analyze-requirements",
            "diagnose-memory",
            "diagnose-docs",
            "generate-report",
            "complete"
        ],
        "the focus limits the diagnoses; nothing found, the gate passes at the report"
    );
    let state = p.state(&id);
    assert_eq!(state["skill_state"]["outcome"], "passed");
    assert_eq!(state["skill_state"]["quality_gate"], "pass");
    let shown = stdout(&p.output(&["status", &id]));
    assert!(shown.contains("gate       pass (score 100)"), "{shown}");
    assert!(shown.contains("skill      s (skills/s)"), "{shown}");
    let listed = stdout(&p.output(&["list"]));
    assert!(
        listed.contains("PROGRESS") && listed.contains(" pass "),
        "{listed}"
    );
    let tuning = std::fs::read_to_string(p.progress(&id).join("tuning.md")).unwrap();
    assert!(tuning.contains("## diagnose-docs (round 1"), "{tuning}");
}

#[test]
fn create_refuses_what_a_skill_tuning_loop_cannot_take_in_one_line() {
    let p = tuning_project(TUNING_AGENT);
    std::fs::create_dir_all(p.root.join("not-a-skill")).unwrap();
    for (args, says) in [
        (
            vec!["--workflow", "skill-tuning"],
            "--target-skill PATH is required",
        ),
        (
            vec![
                "--workflow",
                "skill-tuning",
                "--target-skill",
                "not-a-skill",
            ],
            "no SKILL.md",
        ),
        (
            vec![
                "--workflow",
                "skill-tuning",
                "--target-skill",
                "skills/s",
                "--focus",
                "memroy",
            ],
            "did you mean \"memory\"",
        ),
        (
            vec!["--title", "t", "--target-skill", "skills/s"],
            "are for --workflow skill-tuning",
        ),
    ] {
        let mut all = vec!["create"];
        all.extend(args.iter().copied());
        let out = p.output(&all);
        assert_eq!(code(&out), 2, "{args:?}");
        assert_eq!(stderr(&out).trim().lines().count(), 1, "{}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
    assert_eq!(stdout(&p.output(&["list", "--json"])).trim(), "[]");
}

#[test]
fn pause_resume_stop_and_a_daemon_killed_mid_action_work_the_same_on_skill_tuning() {
    let p = tuning_project(TUNING_AGENT);
    std::fs::write(p.root.join("hold"), "").unwrap();
    let id = create(&p, &[]);
    let out = p.output(&["start", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let daemon: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("diagnose-memory to be in flight", || {
        p.root.join("agent.pid").exists()
    });
    let agent = read_pid(&p.root.join("agent.pid"));

    // Pause ends the action in flight at once; the loop waits.
    assert_eq!(code(&p.output(&["pause", &id])), 0);
    wait_for("the agent to be ended", || !alive(agent));
    wait_for("the attempt to be recorded", || {
        p.state(&id)["skill_state"]["in_flight"].is_null()
    });
    assert_eq!(p.state(&id)["status"], "paused");
    assert!(alive(daemon));

    // Resume runs it again; the daemon killed in the middle leaves it for the next one.
    std::fs::remove_file(p.root.join("agent.pid")).unwrap();
    assert_eq!(code(&p.output(&["resume", &id])), 0);
    wait_for("diagnose-memory again", || {
        p.root.join("agent.pid").exists()
    });
    let agent = read_pid(&p.root.join("agent.pid"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("the daemon to be gone", || !alive(daemon));
    std::fs::remove_file(p.root.join("agent.pid")).unwrap();
    let out = p.output(&["start", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let daemon: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("the orphaned agent to be ended", || !alive(agent));
    wait_for("the interrupted attempt to be recorded", || {
        p.events(&id).iter().any(|e| e["event"] == "recovered")
    });
    wait_for("diagnose-memory a third time", || {
        p.root.join("agent.pid").exists()
    });

    // Stop ends the action and the loop.
    let agent = read_pid(&p.root.join("agent.pid"));
    assert_eq!(code(&p.output(&["stop", &id])), 0);
    wait_for("the agent to be ended", || !alive(agent));
    wait_for("the daemon to exit", || !alive(daemon));
    let state = p.state(&id);
    assert_eq!(state["status"], "failed");
    assert_eq!(state["failure_reason"], "Manually stopped by user");
    assert_eq!(
        state["skill_state"]["error_count"], 0,
        "no attempt was an error"
    );
    let diagnosis = &state["skill_state"]["diagnosis"];
    assert_eq!(diagnosis["context"]["status"], "completed");
    assert!(diagnosis["memory"].is_null(), "never finished: {diagnosis}");
}

#[test]
fn a_requirement_analysis_that_asks_waits_for_the_answer() {
    let p = tuning_project(&format!(
        "prompt=$(cat)\n\
         if [ \"$LOOPD_ACTION\" = analyze-requirements ]; then case \"$prompt\" in\n\
           *'The answer:'*) ;;\n\
           *) echo '{{\"status\":\"needs_input\",\"question\":\"Must it support monorepos?\"}}' > \"$LOOPD_RESULT_FILE\"; exit 0 ;;\n\
         esac; fi\n{TUNING_AGENT}"
    ));
    let id = create(&p, &["--focus", "docs"]);
    let out = p.output(&["start", &id]);
    let daemon: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("the question", || {
        p.state(&id)["skill_state"]["requirement_analysis"]["status"] == "needs_clarification"
    });
    assert_eq!(
        p.state(&id)["skill_state"]["question"]["text"],
        "Must it support monorepos?"
    );
    // Answered as a dashboard would: the documented field, the whole file rewritten in place.
    let mut state = p.state(&id);
    state["skill_state"]["question"]["answer"] = Value::from("no");
    std::fs::write(
        p.state_path(&id),
        serde_json::to_vec_pretty(&state).unwrap(),
    )
    .unwrap();
    wait_for("the loop to complete", || {
        p.state(&id)["status"] == "completed"
    });
    wait_for("its daemon to exit", || !alive(daemon));
    let state = p.state(&id);
    assert_eq!(
        state["skill_state"]["requirement_analysis"]["status"],
        "completed"
    );
    assert_eq!(state["skill_state"]["error_count"], 0);
}

#[test]
fn a_broken_skill_tuning_state_comes_back_from_its_backup_and_never_as_another_workflow() {
    let p = tuning_project(TUNING_AGENT);
    let id = create(&p, &["--focus", "docs"]);
    assert_eq!(code(&p.run(&id, &[])), 0);
    let good = p.state(&id);
    let mut broken = good.clone();
    broken["skill_state"]["issues"] = serde_json::json!("not a list");
    let write = |v: &Value| {
        std::fs::write(p.state_path(&id), serde_json::to_vec_pretty(v).unwrap()).unwrap()
    };
    // With its backup: restored, as it was.
    write(&broken);
    let out = p.output(&["stop", &id]);
    assert!(stderr(&out).contains("restored from"), "{}", stderr(&out));
    assert_eq!(p.state(&id)["skill_state"], good["skill_state"]);
    // Without: refused in one line, left as it is; never rebuilt as a ccw-loop.
    write(&broken);
    std::fs::remove_file(p.root.join(format!(".loop/{id}.json.bak"))).unwrap();
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot be rebuilt"),
        "{}",
        stderr(&out)
    );
    assert_eq!(p.state(&id), broken);
}
