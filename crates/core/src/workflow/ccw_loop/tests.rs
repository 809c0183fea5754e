use super::*;
use crate::state::{Finished, Mode, Status};
use crate::workflow::{Decision, Limits, decide, record_finish};
use serde_json::json;

/// Edits the workflow's own fields of a state.
fn ccw(s: &mut LoopState, edit: impl FnOnce(&mut CcwState)) {
    let skill = s.skill();
    let mut part: CcwState = skill.part();
    edit(&mut part);
    skill.set_part(&part);
}

fn part(s: &LoopState) -> CcwState {
    s.skill_state.as_ref().unwrap().part()
}

/// A success with these state updates.
fn with(updates: Value) -> ActionResult {
    ActionResult {
        state_updates: updates.as_object().cloned().unwrap_or_default(),
        ..ActionResult::bare_success()
    }
}

const LIMITS: Limits = Limits {
    max_iterations: 10,
    max_errors: 3,
    max_cost_usd: None,
    max_tokens: None,
    no_progress: crate::no_progress::Rule {
        rounds: 0,
        then: crate::no_progress::Then::Pause,
    },
};

fn task(id: &str, status: TaskStatus) -> DevelopTask {
    DevelopTask {
        id: id.into(),
        description: format!("do {id}"),
        status,
        ..DevelopTask::default()
    }
}

/// A running loop, initialised, with these tasks and these finished actions (name, seq, ok).
fn state(tasks: &[(&str, TaskStatus)], finished: &[(&str, u64, bool)]) -> LoopState {
    let mut s = LoopState {
        loop_id: "l".into(),
        status: Status::Running,
        ..LoopState::default()
    };
    ccw(&mut s, |c| {
        c.initialized_at = Some("2026-01-01T00:00:00.000Z".into());
        c.develop.tasks = tasks.iter().map(|(id, st)| task(id, *st)).collect();
    });
    let skill = s.skill();
    for (action, seq, ok) in finished {
        skill
            .finished
            .insert((*action).into(), Finished { seq: *seq, ok: *ok });
        skill.seq = skill.seq.max(*seq);
    }
    let last = finished.iter().max_by_key(|f| f.1).map(|f| f.0.to_owned());
    skill.last_action = last;
    s
}

fn run(decision: Decision) -> Dispatch {
    match decision {
        Decision::Run(d) => d,
        other => panic!("expected an action, got {other:?}"),
    }
}

fn selected(s: &LoopState) -> (String, Option<String>, Option<Outcome>) {
    let d = run(decide(&CcwLoop, s, LIMITS));
    (d.action, d.task_id, d.outcome)
}

use TaskStatus::*;

#[test]
fn check_errors_abort_and_name_the_last_error() {
    let mut s = state(&[("t1", Pending)], &[]);
    s.skill().error_count = 3;
    s.skill().errors.push(crate::state::ErrorEntry {
        action: "develop".into(),
        message: "exit code 1".into(),
        ..Default::default()
    });
    let Decision::Abort(reason) = decide(&CcwLoop, &s, LIMITS) else {
        panic!("expected abort");
    };
    assert!(reason.contains("max_errors (3)") && reason.contains("develop: exit code 1"));
    // The loop's own max_errors wins over the default.
    s.max_errors = Some(5);
    assert_eq!(selected(&s).0, "develop");
}

#[test]
fn check_errors_before_iterations() {
    let mut s = state(&[("t1", Pending)], &[]);
    s.skill().error_count = 3;
    s.current_iteration = 10;
    assert!(matches!(decide(&CcwLoop, &s, LIMITS), Decision::Abort(_)));
}

#[test]
fn check_iteration_limit_completes() {
    let mut s = state(&[("t1", Pending)], &[]);
    s.current_iteration = 10;
    assert_eq!(
        selected(&s),
        ("complete".into(), None, Some(Outcome::IterationLimit))
    );
    s.max_iterations = Some(11);
    assert_eq!(selected(&s).0, "develop");
}

#[test]
fn check_goal_met_completes_passed() {
    let mut s = state(
        &[("t1", Completed)],
        &[("develop", 1, true), ("validate", 2, true)],
    );
    ccw(&mut s, |c| c.validate.passed = true);
    assert_eq!(
        selected(&s),
        ("complete".into(), None, Some(Outcome::Passed))
    );
    // ... also at the iteration limit.
    s.current_iteration = 10;
    assert_eq!(selected(&s).2, Some(Outcome::Passed));
}

#[test]
fn check_goal_not_met_when_a_task_waits_or_validate_is_stale() {
    let mut s = state(
        &[("t1", Completed), ("t2", Pending)],
        &[("develop", 1, true), ("validate", 2, true)],
    );
    ccw(&mut s, |c| c.validate.passed = true);
    assert_eq!(selected(&s).0, "develop");
    let mut s = state(
        &[("t1", Completed)],
        &[("validate", 1, true), ("develop", 2, true)],
    );
    ccw(&mut s, |c| c.validate.passed = true);
    assert_eq!(selected(&s).0, "validate");
}

#[test]
fn select_1_init_when_not_initialised() {
    let mut s = LoopState::default();
    assert_eq!(selected(&s).0, "init");
    s.skill();
    assert_eq!(selected(&s).0, "init");
}

#[test]
fn select_2_first_pending_or_interrupted_task_by_order() {
    let s = state(
        &[("t1", Completed), ("t2", InProgress), ("t3", Pending)],
        &[],
    );
    assert_eq!(selected(&s), ("develop".into(), Some("t2".into()), None));
    let s = state(&[("t1", Failed), ("t2", Pending)], &[("develop", 1, false)]);
    assert_eq!(selected(&s).1.as_deref(), Some("t2"));
}

#[test]
fn select_3_debug_after_a_failed_develop() {
    let mut s = state(&[("t1", Failed)], &[("develop", 1, false)]);
    ccw(&mut s, |c| c.develop_failed_seq = Some(1));
    assert_eq!(selected(&s).0, "debug");
    // Not again once a debug ran since.
    let mut s = state(
        &[("t1", Failed)],
        &[
            ("develop", 1, false),
            ("debug", 2, true),
            ("validate", 3, true),
        ],
    );
    ccw(&mut s, |c| c.develop_failed_seq = Some(1));
    ccw(&mut s, |c| c.validate.passed = true);
    assert_eq!(selected(&s).2, Some(Outcome::Passed));
}

#[test]
fn select_4_validate_after_debug() {
    let s = state(
        &[("t1", Completed)],
        &[("develop", 1, true), ("debug", 2, true)],
    );
    assert_eq!(selected(&s).0, "validate");
}

#[test]
fn select_5_validate_when_all_tasks_completed() {
    let s = state(
        &[("t1", Completed), ("t2", Completed)],
        &[("develop", 2, true)],
    );
    assert_eq!(selected(&s).0, "validate");
}

#[test]
fn select_6_debug_when_validate_failed() {
    let mut s = state(
        &[("t1", Completed)],
        &[("develop", 1, true), ("validate", 2, true)],
    );
    ccw(&mut s, |c| c.validate.passed = false);
    assert_eq!(selected(&s).0, "debug");
}

#[test]
fn select_7_complete_otherwise() {
    // A failed task, debugged, validated and passed, nothing pending: the goal check completes.
    // Reaching rule 7 itself needs a state the rules above never leave: validate passed but
    // stale state written by another tool.
    let mut s = state(&[], &[("debug", 2, true), ("validate", 3, true)]);
    s.skill().last_action = Some("validate".into());
    ccw(&mut s, |c| c.validate.passed = false);
    s.skill().finished.remove("validate");
    ccw(&mut s, |c| c.validate.last_run_at = None);
    ccw(&mut s, |c| c.develop.tasks.push(task("t1", Failed)));
    assert_eq!(
        run(CcwLoop.select(&s).into_decision()).outcome,
        Some(Outcome::Incomplete)
    );
}

#[test]
fn planned_tasks_that_say_what_they_need_run_together_and_the_others_keep_their_order() {
    let mut s = state(&[], &[]);
    ccw(&mut s, |c| c.initialized_at = None);
    let d = run(decide(&CcwLoop, &s, LIMITS));
    let plan = json!({"tasks": [
        {"description": "a", "after": []},
        {"description": "b", "after": []},
        {"description": "c", "after": ["task-001"]},
        {"description": "d"},
    ]});
    assert!(CcwLoop.validate("init", &with(plan.clone())).is_ok());
    let bad = json!({"tasks": [{"description": "a", "after": "task-001"}]});
    assert!(CcwLoop.validate("init", &with(bad)).is_err());
    let inputs = Inputs {
        now: "2026-01-01T00:00:00.000Z".into(),
        ..Inputs::default()
    };
    let planned = Finish::Success(with(plan));
    CcwLoop.apply(&mut s, &d, &planned, &inputs);
    record_finish(&CcwLoop, &mut s, &d, &planned, &inputs.now);
    let first = CcwLoop.select(&s);
    let ids = |batch: Vec<Dispatch>| -> Vec<String> {
        batch.into_iter().filter_map(|d| d.task_id).collect()
    };
    // c needs a; d cannot say, so it waits for every task before it.
    assert_eq!(ids(CcwLoop.batch(&s, &first, 4)), ["task-001", "task-002"]);
    ccw(&mut s, |c| c.develop.tasks[0].status = Completed);
    let next = CcwLoop.select(&s);
    assert_eq!(ids(CcwLoop.batch(&s, &next, 4)), ["task-002", "task-003"]);
    ccw(&mut s, |c| {
        c.develop.tasks[1].status = Completed;
        c.develop.tasks[2].status = Completed;
    });
    let last = CcwLoop.select(&s);
    assert_eq!(ids(CcwLoop.batch(&s, &last, 4)), ["task-004"]);
}

#[test]
fn seed_defect_init_never_runs_twice() {
    let mut s = state(&[], &[]);
    ccw(&mut s, |c| c.initialized_at = None);
    let d = run(decide(&CcwLoop, &s, LIMITS));
    assert_eq!(d.action, "init");
    // init planned nothing and the loop has no description: one task from the title.
    s.title = "the title".into();
    let inputs = Inputs {
        now: "2026-01-01T00:00:00.000Z".into(),
        ..Inputs::default()
    };
    let empty = Finish::Success(ActionResult::bare_success());
    CcwLoop.apply(&mut s, &d, &empty, &inputs);
    record_finish(&CcwLoop, &mut s, &d, &empty, &inputs.now);
    assert_eq!(part(&s).develop.tasks[0].description, "the title");
    assert_eq!(selected(&s).0, "develop");
    // Even with every task gone, init does not come back.
    ccw(&mut s, |c| c.develop.tasks.clear());
    assert_ne!(selected(&s).0, "init");
}

#[test]
fn seed_defect_no_develop_without_a_pending_task() {
    let s = state(
        &[("t1", Completed), ("t2", Failed)],
        &[("develop", 5, true)],
    );
    assert_ne!(selected(&s).0, "develop");
}

#[test]
fn seed_defect_iteration_limit_reaches_complete() {
    // A validate that never passes, driven through apply: complete at max_iterations.
    let mut s = state(&[("t1", Completed)], &[("develop", 1, true)]);
    s.current_iteration = 1;
    let inputs = Inputs {
        now: "2026-01-01T00:00:00.000Z".into(),
        ..Inputs::default()
    };
    let mut steps = 0;
    loop {
        let d = run(decide(&CcwLoop, &s, LIMITS));
        if d.action == "complete" {
            assert_eq!(d.outcome, Some(Outcome::IterationLimit));
            break;
        }
        let mut result = ActionResult::bare_success();
        if d.action == "validate" {
            result.state_updates.insert("passed".into(), false.into());
        }
        let finish = Finish::Success(result);
        CcwLoop.apply(&mut s, &d, &finish, &inputs);
        record_finish(&CcwLoop, &mut s, &d, &finish, &inputs.now);
        steps += 1;
        assert!(steps < 100, "no completion after 100 steps");
    }
    assert_eq!(s.current_iteration, 10);
}

#[test]
fn a_spent_budget_fails_the_loop_first() {
    let mut s = state(&[("t1", Pending)], &[]);
    s.skill().usage.cost_usd = 2.5;
    s.max_cost_usd = Some(2.0);
    let Decision::Abort(reason) = decide(&CcwLoop, &s, LIMITS) else {
        panic!("expected abort");
    };
    assert!(reason.contains("max_cost_usd"), "{reason}");
    s.max_cost_usd = None;
    s.skill().usage.output_tokens = 100;
    let limits = Limits {
        max_tokens: Some(100),
        ..LIMITS
    };
    assert!(matches!(decide(&CcwLoop, &s, limits), Decision::Abort(r) if r.contains("max_tokens")));
    assert_eq!(limits.remaining(&s), (Some(0), None));
}

#[test]
fn interactive_waits_for_a_valid_choice() {
    let mut s = state(&[("t1", Pending)], &[]);
    s.skill().mode = Mode::Interactive;
    let Decision::Wait {
        choices, suggested, ..
    } = decide(&CcwLoop, &s, LIMITS)
    else {
        panic!("expected a wait");
    };
    assert_eq!(choices, ACTIONS);
    assert_eq!(suggested.as_deref(), Some("develop"));
    s.next_action = Some("explode".into());
    assert!(matches!(
        decide(&CcwLoop, &s, LIMITS),
        Decision::Wait { refused: Some(r), .. } if r == "explode"
    ));
    s.next_action = Some("validate".into());
    assert_eq!(selected(&s).0, "validate");
    // Choices that cannot run now are refused with the reason.
    s.next_action = Some("init".into());
    assert!(matches!(
        decide(&CcwLoop, &s, LIMITS),
        Decision::Wait { refused: Some(r), .. } if r.contains("planned already")
    ));
    ccw(&mut s, |c| c.develop.tasks[0].status = Completed);
    s.next_action = Some("develop".into());
    assert!(matches!(
        decide(&CcwLoop, &s, LIMITS),
        Decision::Wait { refused: Some(r), .. } if r.contains("no task is pending")
    ));
}

#[test]
fn results_are_validated_per_action() {
    assert!(
        CcwLoop
            .validate("validate", &with(json!({"passed": true})))
            .is_ok()
    );
    assert!(CcwLoop.validate("validate", &with(json!({}))).is_err());
    assert!(
        CcwLoop
            .validate("validate", &with(json!({"passed": "yes"})))
            .is_err()
    );
    assert!(
        CcwLoop
            .validate("validate", &with(json!({"passed": true, "pass_rate": "x"})))
            .is_err()
    );
    assert!(
        CcwLoop
            .validate("init", &with(json!({"tasks": [{"description": "a"}]})))
            .is_ok()
    );
    assert!(
        CcwLoop
            .validate("init", &with(json!({"tasks": [{"tool": "bash"}]})))
            .is_err()
    );
    assert!(
        CcwLoop
            .validate("init", &with(json!({"tasks": "many"})))
            .is_err()
    );
    assert!(
        CcwLoop
            .validate("debug", &with(json!({"fix_tasks": [{"description": "f"}]})))
            .is_ok()
    );
    assert!(
        CcwLoop
            .validate(
                "debug",
                &with(json!({"hypotheses": [{"likelihood": "high"}]}))
            )
            .is_err()
    );
    assert!(
        CcwLoop
            .validate("complete", &with(json!({"summary": 3})))
            .is_err()
    );
}

#[test]
fn debug_fix_tasks_join_as_pending_and_develop_follows() {
    let mut s = state(
        &[("task-001", Completed)],
        &[("develop", 1, true), ("validate", 2, true)],
    );
    let d = Dispatch::new("debug");
    let result = ActionResult {
        state_updates:
            json!({"fix_tasks": [{"description": "fix it"}], "hypotheses": [{"id": "H1"}]})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        ..ActionResult::bare_success()
    };
    let finish = Finish::Success(result);
    let inputs = Inputs::default();
    CcwLoop.apply(&mut s, &d, &finish, &inputs);
    record_finish(&CcwLoop, &mut s, &d, &finish, "");
    let c = part(&s);
    assert_eq!(c.develop.tasks[1].id, "task-002");
    assert_eq!(c.develop.tasks[1].status, Pending);
    assert_eq!(c.debug.hypotheses_count, 1);
    assert_eq!(
        selected(&s),
        ("develop".into(), Some("task-002".into()), None)
    );
}

impl Dispatch {
    fn into_decision(self) -> Decision {
        Decision::Run(self)
    }
}
