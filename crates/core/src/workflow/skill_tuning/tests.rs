use super::apply::grade;
use super::state::*;
use super::*;
use crate::state::{ErrorEntry, Status};
use crate::workflow::{Decision, Limits, check, decide, record_attempt, record_finish};
use serde_json::Value;
use serde_json::json;
use state::{Severity, Severity::*, SeverityCounts};

const LIMITS: Limits = Limits {
    max_iterations: 5,
    max_errors: 3,
    max_cost_usd: None,
    max_tokens: None,
    no_progress: crate::no_progress::Rule {
        rounds: 0,
        then: crate::no_progress::Then::Pause,
    },
};

fn issue(id: &str, severity: Severity) -> Issue {
    Issue {
        id: id.into(),
        category: "context".into(),
        severity,
        description: format!("issue {id}"),
        ..Issue::default()
    }
}

fn done(status: &str) -> Option<DiagnosisResult> {
    Some(DiagnosisResult {
        status: status.into(),
        ..DiagnosisResult::default()
    })
}

/// Initialised, requirements analysed (satisfied), no diagnosis yet.
fn analysed() -> TuningState {
    let mut t = TuningState::new("s".into(), "skills/s".into(), Vec::new(), None);
    t.initialized_at = Some("2026-01-01T00:00:00.000Z".into());
    t.requirement_analysis.status = "completed".into();
    t.requirement_analysis.coverage = Some("satisfied".into());
    t
}

/// Every diagnosis of the round done, the report written.
fn reported(issues: Vec<Issue>) -> TuningState {
    let mut t = analysed();
    for area in DIAGNOSES {
        t.diagnosis.set(area, done("completed"));
    }
    t.issues = issues;
    grade(&mut t);
    t.report = Some(Report {
        status: "completed".into(),
        ..Report::default()
    });
    t
}

fn state(t: &TuningState) -> LoopState {
    let mut s = LoopState {
        loop_id: "l".into(),
        status: Status::Running,
        ..LoopState::default()
    };
    s.skill().workflow = Some(NAME.into());
    s.skill().set_part(t);
    s
}

fn action(t: &TuningState) -> String {
    select(t).action
}

#[test]
fn termination_follows_the_seeds_order() {
    let serious = reported(vec![issue("ISS-001", Critical)]);
    let passing = reported(vec![issue("ISS-001", Medium)]);
    // (state, errors, iteration, expected)
    let cases: Vec<(&TuningState, u64, u64, &str)> = vec![
        (&serious, 3, 0, "abort"),
        (&passing, 3, 5, "abort"), // the error limit before everything else
        (&serious, 0, 5, "complete:iteration_limit"),
        (&passing, 0, 5, "complete:passed"), // the limit, with the gate passing
        (&passing, 0, 1, "complete:passed"), // the gate passes
        (&serious, 0, 1, "select"),
    ];
    for (t, errors, iteration, expected) in cases {
        let mut s = state(t);
        s.current_iteration = iteration;
        s.skill().error_count = errors;
        s.skill().errors.push(ErrorEntry {
            action: "verify".into(),
            message: "boom".into(),
            timestamp: "t".into(),
            extra: Default::default(),
        });
        let got = match check(&SkillTuning, &s, LIMITS) {
            None => "select".to_owned(),
            Some(Decision::Abort(_)) => "abort".to_owned(),
            Some(Decision::Run(d)) => format!("{}:{}", d.action, d.outcome.unwrap().as_str()),
            Some(other) => format!("{other:?}"),
        };
        assert_eq!(got, expected, "errors {errors}, iteration {iteration}");
    }
}

#[test]
fn selection_follows_the_seeds_thirteen_priorities() {
    let fresh = TuningState::new("s".into(), "p".into(), Vec::new(), None);
    let mut unclear = analysed();
    unclear.requirement_analysis.status = "needs_clarification".into();
    let mut unsatisfied = analysed();
    unsatisfied.requirement_analysis.coverage = Some("unsatisfied".into());
    let mut requested = analysed();
    requested.gemini_analysis_requested = true;
    let mut architecture = analysed();
    architecture.focus_areas = vec!["architecture".into()];
    let mut critical = analysed();
    critical.issues = vec![issue("ISS-001", Critical)];
    grade(&mut critical);
    let mut running = analysed();
    running.gemini_analysis.status = "running".into();
    running.gemini_analysis.round = 1;
    let mut second_opinion_done = critical.clone();
    second_opinion_done.gemini_analysis.round = 1;
    let mut memory_next = analysed();
    memory_next.diagnosis.context = done("completed");
    let mut focused = analysed();
    focused.focus_areas = vec!["docs".into()];
    let mut failed_counts_as_done = analysed();
    for area in DIAGNOSES {
        failed_counts_as_done.diagnosis.set(area, done("failed"));
    }
    let with_issues = reported(vec![issue("ISS-001", High), issue("ISS-002", High)]);
    let mut high = reported(vec![issue("ISS-001", High), issue("ISS-002", High)]);
    high.gemini_analysis.round = 1;
    let mut proposed = high.clone();
    proposed.proposed_round = 1;
    proposed.pending_fixes = vec!["FIX-001".into()];
    let mut applied = proposed.clone();
    applied.pending_fixes.clear();
    applied.applied_fixes.push(AppliedFix {
        id: "FIX-001".into(),
        verification_result: "pending".into(),
        round: 1,
        ..AppliedFix::default()
    });
    let mut nothing_left = applied.clone();
    nothing_left.applied_fixes[0].verification_result = "fail".into();
    let no_issues = reported(Vec::new());
    let mut requirements = analysed();
    requirements.requirement_analysis.status = "pending".into();
    let diagnosis = analysed();

    let cases: Vec<(&str, &TuningState, &str)> = vec![
        ("1 init", &fresh, "init"),
        ("2 requirements", &requirements, "analyze-requirements"),
        ("3 clarified", &unclear, "analyze-requirements"),
        ("4 coverage unsatisfied", &unsatisfied, "gemini-analysis"),
        ("5 requested", &requested, "gemini-analysis"),
        ("5 focus area", &architecture, "gemini-analysis"),
        ("5 critical issue", &critical, "gemini-analysis"),
        ("6 running", &running, "gemini-analysis"),
        ("5 once a round", &second_opinion_done, "diagnose-context"),
        ("7 first diagnosis", &diagnosis, "diagnose-context"),
        ("7 in order", &memory_next, "diagnose-memory"),
        ("7 focus", &focused, "diagnose-docs"),
        ("8 report", &failed_counts_as_done, "generate-report"),
        ("9 propose", &high, "propose-fixes"),
        ("9 second opinion first", &with_issues, "propose-fixes"),
        ("10 apply", &proposed, "apply-fix"),
        ("11 verify", &applied, "verify"),
        ("13 nothing left", &nothing_left, "complete"),
        ("13 no issues", &no_issues, "complete"),
    ];
    for (name, t, expected) in cases {
        assert_eq!(action(t), expected, "{name}");
    }
    assert_eq!(select(&proposed).task_id.as_deref(), Some("FIX-001"));
}

#[test]
fn the_gate_is_computed_from_the_issues_at_each_threshold() {
    let counts = |critical, high, medium, low| SeverityCounts {
        critical,
        high,
        medium,
        low,
    };
    let cases = [
        (counts(0, 0, 0, 0), 100, Gate::Pass),
        (counts(0, 2, 0, 0), 70, Gate::Pass),
        (counts(0, 2, 2, 0), 60, Gate::Pass), // a score of 60 passes
        (counts(0, 2, 2, 1), 59, Gate::Review), // 59 does not
        (counts(0, 3, 0, 0), 55, Gate::Review), // 3 high never pass
        (counts(1, 0, 0, 0), 75, Gate::Review), // a critical issue never passes
        (counts(0, 4, 0, 0), 40, Gate::Review), // 40 is review
        (counts(0, 4, 0, 1), 39, Gate::Fail), // 39 fails
        (counts(3, 3, 3, 3), 0, Gate::Fail),  // floored at 0
    ];
    for (c, score, gate) in cases {
        assert_eq!(quality(c), (score, gate), "{c:?}");
    }
}

fn finish(updates: Value) -> Finish {
    Finish::Success(ActionResult {
        state_updates: serde_json::from_value(updates).unwrap(),
        ..ActionResult::bare_success()
    })
}

fn apply_result(t: &mut TuningState, action: &str, task: Option<&str>, f: &Finish) {
    let d = Dispatch {
        task_id: task.map(str::to_owned),
        ..Dispatch::new(action)
    };
    let result = match f {
        Finish::Success(r) => Some(r),
        Finish::Failed(_) => None,
    };
    apply(t, &d, result, "2026-01-01T00:00:00.000Z");
}

#[test]
fn a_new_round_needs_a_verified_fix_else_the_loop_completes() {
    // The seed looped on diagnose-context when no fix had been applied.
    let mut t = reported(vec![issue("ISS-001", Critical)]);
    t.gemini_analysis.round = 1;
    apply_result(&mut t, "propose-fixes", None, &finish(json!({"fixes": []})));
    assert_eq!(action(&t), "complete");

    // A fix that fails verification starts no round either.
    let mut t = reported(vec![issue("ISS-001", Critical), issue("ISS-002", High)]);
    t.gemini_analysis.round = 1;
    let fixes = json!({"fixes": [{"issue_ids": ["ISS-001"], "description": "trim it"}]});
    apply_result(&mut t, "propose-fixes", None, &finish(fixes));
    apply_result(&mut t, "apply-fix", Some("FIX-001"), &finish(json!({})));
    let failed = json!({"results": [{"fix_id": "FIX-001", "result": "fail"}]});
    apply_result(&mut t, "verify", None, &finish(failed));
    assert_eq!((t.round, action(&t).as_str()), (1, "complete"));
}

#[test]
fn a_new_round_resets_the_diagnosis_by_its_keys() {
    // The seed wrote `'diagnosis.context': null`, which became a literal key.
    let mut t = reported(vec![issue("ISS-001", Critical), issue("ISS-002", High)]);
    t.gemini_analysis.round = 1;
    let fixes = json!({"fixes": [{"issue_ids": ["ISS-001"], "description": "trim it"}]});
    apply_result(&mut t, "propose-fixes", None, &finish(fixes));
    apply_result(&mut t, "apply-fix", Some("FIX-001"), &finish(json!({})));
    let verified = json!({"results": [{"fix_id": "FIX-001", "result": "pass"}],
                          "resolved_issues": ["ISS-001"]});
    apply_result(&mut t, "verify", None, &finish(verified));
    assert_eq!(t.round, 2, "a high issue is left and a fix was verified");
    assert_eq!(t.issues.len(), 1);
    assert_eq!(t.resolved_issues, 1);
    let s = state(&t);
    let written = serde_json::to_value(s.skill_state.as_ref().unwrap()).unwrap();
    let keys = written.as_object().unwrap().keys();
    assert!(keys.clone().all(|k| !k.contains('.')), "{keys:?}");
    assert_eq!(
        written["diagnosis"],
        json!({"context": null, "memory": null, "dataflow": null, "agent": null,
               "docs": null, "token_consumption": null})
    );
    // The second opinion is due again (round 2 with issues left), then diagnose-context.
    assert_eq!(action(&t), "gemini-analysis");
    t.gemini_analysis.round = 2;
    assert_eq!(action(&t), "diagnose-context");
}

#[test]
fn a_running_second_opinion_is_finished_never_started_twice() {
    // The seed checked its triggers (5) before "running" (6) and started a second one.
    let mut t = analysed();
    t.gemini_analysis_requested = true;
    let mut s = state(&t);
    let d = Dispatch::new("gemini-analysis");
    assert_eq!(SkillTuning.select(&s), d);
    SkillTuning.begin(&mut s, &d, "now");
    let running: TuningState = s.skill_state.as_ref().unwrap().part();
    assert_eq!(running.gemini_analysis.status, "running");
    assert_eq!(select(&running), d, "left running: finished, once");
    let found = json!({"issues": [{"severity": "critical", "description": "x"}]});
    SkillTuning.apply(&mut s, &d, &finish(found), &Inputs::default());
    let after: TuningState = s.skill_state.as_ref().unwrap().part();
    assert_eq!(after.gemini_analysis.status, "completed");
    assert!(!after.gemini_analysis_requested);
    // Its own critical issue does not trigger it again in this round.
    assert_eq!(select(&after).action, "diagnose-context");
}

#[test]
fn each_finished_action_gets_its_own_history_entry_and_only_verify_counts() {
    // The seed overwrote the previous entry.
    let mut s = state(&analysed());
    for (n, a) in ["diagnose-context", "diagnose-memory", "verify"]
        .iter()
        .enumerate()
    {
        let d = Dispatch::new(a);
        record_attempt(
            &mut s,
            crate::state::HistoryEntry {
                action: (*a).into(),
                attempt: 1,
                outcome: "success".into(),
                ..Default::default()
            },
        );
        let f = finish(json!({"issues": []}));
        SkillTuning.apply(&mut s, &d, &f, &Inputs::default());
        record_finish(&SkillTuning, &mut s, &d, &f, "now");
        assert_eq!(s.skill_state.as_ref().unwrap().action_history.len(), n + 1);
    }
    let history = &s.skill_state.as_ref().unwrap().action_history;
    let names: Vec<&str> = history.iter().map(|h| h.action.as_str()).collect();
    assert_eq!(names, ["diagnose-context", "diagnose-memory", "verify"]);
    assert_eq!(s.current_iteration, 1);
}

#[test]
fn a_spent_budget_ends_a_skill_tuning_loop_as_any_other() {
    let mut s = state(&analysed());
    s.max_cost_usd = Some(1.0);
    s.skill().usage.cost_usd = 1.5;
    match decide(&SkillTuning, &s, LIMITS) {
        Decision::Abort(reason) => assert!(reason.contains("budget exceeded"), "{reason}"),
        other => panic!("expected the budget to end it, got {other:?}"),
    }
}

#[test]
fn the_error_limit_aborts_and_a_failed_action_is_skipped() {
    let mut s = state(&analysed());
    s.skill().error_count = 3;
    assert!(matches!(
        decide(&SkillTuning, &s, LIMITS),
        Decision::Abort(_)
    ));
    // Under the limit, a diagnosis that failed after its retries is passed over.
    let mut t = analysed();
    apply_result(
        &mut t,
        "diagnose-context",
        None,
        &Finish::Failed("boom".into()),
    );
    assert_eq!(t.diagnosis.context.as_ref().unwrap().status, "failed");
    assert_eq!(action(&t), "diagnose-memory");
    // And retry runs it again.
    let mut s = state(&t);
    assert_eq!(SkillTuning.reset_failed(s.skill_state.as_mut().unwrap()), 1);
    assert_eq!(SkillTuning.select(&s).action, "diagnose-context");
}

#[test]
fn results_that_do_not_fit_are_refused_before_anything_is_applied() {
    let with = |u: Value| ActionResult {
        state_updates: serde_json::from_value(u).unwrap(),
        ..ActionResult::bare_success()
    };
    let ok = [
        ("analyze-requirements", json!({"coverage": "partial"})),
        ("diagnose-docs", json!({"issues": []})),
        ("gemini-analysis", json!({})),
        ("propose-fixes", json!({"fixes": [{"description": "d"}]})),
        (
            "verify",
            json!({"results": [{"fix_id": "FIX-001", "result": "pass"}]}),
        ),
    ];
    for (a, u) in ok {
        assert_eq!(SkillTuning.validate(a, &with(u.clone())), Ok(()), "{a} {u}");
    }
    let bad = [
        ("analyze-requirements", json!({})),
        ("analyze-requirements", json!({"coverage": "mostly"})),
        ("diagnose-docs", json!({})),
        (
            "diagnose-docs",
            json!({"issues": [{"severity": "urgent", "description": "d"}]}),
        ),
        (
            "diagnose-docs",
            json!({"issues": [{"severity": "low", "description": " "}]}),
        ),
        ("propose-fixes", json!({"fixes": "all"})),
        (
            "verify",
            json!({"results": [{"fix_id": "FIX-001", "result": "maybe"}]}),
        ),
    ];
    for (a, u) in bad {
        assert!(
            SkillTuning.validate(a, &with(u.clone())).is_err(),
            "{a} {u}"
        );
    }
}

#[test]
fn issues_are_bounded_and_a_more_severe_one_takes_the_place_of_the_least() {
    let mut t = analysed();
    t.issues = (0..MAX_ISSUES)
        .map(|i| issue(&format!("ISS-{i:03}"), if i == 5 { Low } else { Medium }))
        .collect();
    let one = |s: &str| json!({"issues": [{"severity": s, "description": "new"}]});
    apply_result(&mut t, "diagnose-docs", None, &finish(one("low")));
    assert_eq!(t.issues.len(), MAX_ISSUES);
    assert!(
        t.issues.iter().all(|i| i.description != "new"),
        "a low one waits"
    );
    apply_result(&mut t, "diagnose-agent", None, &finish(one("critical")));
    assert_eq!(t.issues.len(), MAX_ISSUES);
    assert!(t.issues.iter().any(|i| i.severity == Critical));
    assert!(
        t.issues.iter().all(|i| i.id != "ISS-005"),
        "the low one made room"
    );
}
