//! The ccw-loop workflow: init → develop → debug → validate → complete (CONTRACT §4).
//!
//! Selection is derived from durable facts in `skill_state` rather than from the action history
//! window: `initialized_at` (init ran, even if it planned nothing), the task statuses, and for each
//! action the `seq` at which it last finished. That is what keeps the seed's defects away: init
//! never runs twice, develop never runs without a task, and the iteration limit always completes.

use serde_json::{Map, Value, json};

pub mod state;
mod view;

use super::{Dispatch, Finish, Inputs, LoopEnd, Outcome, Workflow, opt_str};
use crate::protocol::ActionResult;
use crate::state::ListedTask;
use crate::state::{LoopState, MAX_DESCRIPTION, SkillState, trim_window};
use state::{
    CcwState, DevelopTask, FAILED_TESTS_WINDOW, FILES_CHANGED_WINDOW, HYPOTHESES_WINDOW,
    Hypothesis, MAX_TASKS, TEST_RESULTS_WINDOW, TaskStatus, TestResult,
};

pub struct CcwLoop;

pub const NAME: &str = "ccw-loop";

pub const ACTIONS: &[&str] = &["init", "develop", "debug", "validate", "complete"];

impl CcwLoop {
    fn seq_of(skill: &SkillState, action: &str) -> Option<u64> {
        skill.finished.get(action).map(|f| f.seq)
    }

    /// Validation passed after the last develop and no task waits.
    fn passed(skill: &SkillState) -> bool {
        let ccw: CcwState = skill.part();
        let validated_after_develop = match skill.finished.get("validate") {
            Some(v) => v.ok && Some(v.seq) > Self::seq_of(skill, "develop"),
            // A state prepared by the CCW skill itself, without loopd's clock.
            None => Self::seq_of(skill, "develop").is_none(),
        };
        ccw.validate.passed && validated_after_develop && first_open_task(&ccw).is_none()
    }
}

fn first_open_task(ccw: &CcwState) -> Option<&DevelopTask> {
    ccw.develop
        .tasks
        .iter()
        .find(|t| matches!(t.status, TaskStatus::Pending | TaskStatus::InProgress))
}

impl Workflow for CcwLoop {
    fn name(&self) -> &'static str {
        NAME
    }

    fn actions(&self) -> &'static [&'static str] {
        ACTIONS
    }

    fn counts_iteration(&self, action: &str) -> bool {
        matches!(action, "develop" | "debug" | "validate")
    }

    fn changes_work_tree(&self, action: &str) -> bool {
        matches!(action, "develop" | "debug")
    }

    fn pass_rate(&self, state: &LoopState, action: &str) -> Option<f64> {
        let skill = state.skill_state.as_ref()?;
        (action == "validate").then(|| skill.part::<CcwState>().validate.pass_rate)
    }

    /// The pass rate and the failing tests, by name (some), of the last validation.
    fn validation(&self, state: &LoopState) -> Option<String> {
        let v = state.skill_state.as_ref()?.part::<CcwState>().validate;
        v.last_run_at.as_ref()?;
        let mut failing = v.failed_tests;
        failing.sort();
        let more = failing
            .len()
            .saturating_sub(crate::no_progress::FAILING_NAMED);
        failing.truncate(crate::no_progress::FAILING_NAMED);
        let mut text = format!("{}% passed", v.pass_rate);
        if !failing.is_empty() {
            text.push_str(&format!(", failing: {}", failing.join(", ")));
        }
        if more > 0 {
            text.push_str(&format!(" and {more} more"));
        }
        Some(text)
    }

    /// debug: the fix it proposed; validate: what failed.
    fn round_note(&self, state: &LoopState, action: &str, finish: &Finish) -> Option<String> {
        match action {
            "debug" => {
                let fixes: Vec<String> = finish
                    .result()?
                    .state_updates
                    .get("fix_tasks")?
                    .as_array()?
                    .iter()
                    .filter_map(|f| f.get("description")?.as_str())
                    .map(|d| format!("'{}'", one_line(d, 80)))
                    .collect();
                (!fixes.is_empty()).then(|| format!("debug proposed {}", fixes.join(" and ")))
            }
            "validate" => {
                let v = state.skill_state.as_ref()?.part::<CcwState>().validate;
                if v.passed {
                    return Some("validation passed".to_owned());
                }
                let mut failing = v.failed_tests;
                failing.sort();
                Some(match failing.len() {
                    0 => format!("validation did not pass ({}% passed)", v.pass_rate),
                    n if n <= 3 => format!("validation failed {}", failing.join(", ")),
                    n => format!(
                        "validation failed {} and {} more",
                        failing[..3].join(", "),
                        n - 3
                    ),
                })
            }
            _ => None,
        }
    }

    fn done_tasks(&self, state: &LoopState) -> Vec<String> {
        let Some(skill) = state.skill_state.as_ref() else {
            return Vec::new();
        };
        let ccw: CcwState = skill.part();
        ccw.develop
            .tasks
            .iter()
            .filter(|t| t.status == TaskStatus::Completed)
            .map(|t| t.id.clone())
            .collect()
    }

    fn redo_after_rollback(
        &self,
        state: &mut LoopState,
        kept: &[String],
        note: &str,
    ) -> Vec<String> {
        let skill = state.skill();
        let mut ccw: CcwState = skill.part();
        let mut redone = Vec::new();
        for task in &mut ccw.develop.tasks {
            if task.status == TaskStatus::Completed && !kept.contains(&task.id) {
                task.status = TaskStatus::Pending;
                task.completed_at = None;
                redone.push(task.id.clone());
            }
        }
        ccw.validate.regression = Some(note.to_owned());
        ccw.develop.recount();
        skill.set_part(&ccw);
        redone
    }

    fn goal_met(&self, state: &LoopState) -> bool {
        state.skill_state.as_ref().is_some_and(Self::passed)
    }

    fn select(&self, state: &LoopState) -> Dispatch {
        let Some(skill) = state.skill_state.as_ref() else {
            return Dispatch::new("init");
        };
        let ccw: CcwState = skill.part();
        // 1. Not initialised.
        if ccw.initialized_at.is_none() && ccw.develop.tasks.is_empty() {
            return Dispatch::new("init");
        }
        // 2. A task waits (pending, or in progress when an attempt was interrupted).
        if let Some(task) = first_open_task(&ccw) {
            return Dispatch {
                task_id: Some(task.id.clone()),
                ..Dispatch::new("develop")
            };
        }
        let debug_seq = Self::seq_of(skill, "debug");
        // 3. A develop failed a task and no debug ran since.
        if ccw.develop_failed_seq.is_some() && ccw.develop_failed_seq > debug_seq {
            return Dispatch::new("debug");
        }
        // 4. The last action was debug.
        if skill.last_action.as_deref() == Some("debug") {
            return Dispatch::new("validate");
        }
        // 5. Every task completed and no validate since the last develop.
        let all_completed = ccw
            .develop
            .tasks
            .iter()
            .all(|t| t.status == TaskStatus::Completed);
        let validate_seq = Self::seq_of(skill, "validate");
        if all_completed
            && !(validate_seq.is_some() && validate_seq > Self::seq_of(skill, "develop"))
        {
            return Dispatch::new("validate");
        }
        // 6. The last validate did not pass.
        let validated = validate_seq.is_some() || ccw.validate.last_run_at.is_some();
        if validated && !ccw.validate.passed {
            return Dispatch::new("debug");
        }
        // 7. Nothing else to do.
        Dispatch::complete_if_done(Self::passed(skill))
    }

    fn batch(&self, state: &LoopState, first: &Dispatch, max: usize) -> Vec<Dispatch> {
        let (Some(skill), Some(first_id)) = (state.skill_state.as_ref(), &first.task_id) else {
            return Vec::new();
        };
        let ccw: CcwState = skill.part();
        let tasks = &ccw.develop.tasks;
        let ready: Vec<Dispatch> = tasks
            .iter()
            .enumerate()
            .filter(|(i, t)| {
                matches!(t.status, TaskStatus::Pending | TaskStatus::InProgress)
                    && t.ready(*i, tasks)
                    // A task its own executors race runs as a race of its own, when it comes
                    // first.
                    && (t.race.is_empty() || t.id == *first_id)
            })
            .take(max)
            .map(|(_, t)| Dispatch {
                task_id: Some(t.id.clone()),
                ..Dispatch::new("develop")
            })
            .collect();
        let first_in = ready.iter().any(|d| d.task_id.as_ref() == Some(first_id));
        if first_in { ready } else { Vec::new() }
    }

    fn racers(&self, state: &LoopState, dispatch: &Dispatch, loop_race: &[String]) -> Vec<String> {
        let (Some(skill), Some(id)) = (state.skill_state.as_ref(), &dispatch.task_id) else {
            return Vec::new();
        };
        if dispatch.action != "develop" {
            return Vec::new();
        }
        // Looked up in place: asked before every develop, it parses no task but this one's race.
        let own = skill
            .part
            .get("develop")
            .and_then(|d| d.get("tasks"))
            .and_then(Value::as_array)
            .and_then(|tasks| tasks.iter().find(|t| t["id"].as_str() == Some(id.as_str())))
            .and_then(|task| serde_json::from_value::<Vec<String>>(task.get("race")?.clone()).ok())
            .unwrap_or_default();
        match own.is_empty() {
            true => loop_race.to_vec(),
            false => own,
        }
    }

    fn check_action(&self) -> Option<&'static str> {
        Some("validate")
    }

    fn merge_failed(&self, state: &mut LoopState, task_id: &str, why: &str, fail: bool) {
        let skill = state.skill();
        let mut ccw: CcwState = skill.part();
        if let Some(task) = ccw.develop.task_mut(task_id) {
            task.status = if fail {
                TaskStatus::Failed
            } else {
                TaskStatus::Pending
            };
            task.merge_conflict = Some(why.into());
        }
        if fail {
            ccw.develop_failed_seq = Some(skill.seq + 1);
        }
        ccw.develop.recount();
        skill.set_part(&ccw);
    }

    fn choose(&self, state: &LoopState, action: &str) -> Result<Dispatch, String> {
        let skill = state.skill_state.as_ref();
        let ccw: CcwState = skill.map(SkillState::part).unwrap_or_default();
        let initialised = ccw.initialized_at.is_some() || !ccw.develop.tasks.is_empty();
        match action {
            "init" if initialised => Err("the loop is planned already".into()),
            "init" => Ok(Dispatch::new("init")),
            _ if !initialised => Err("the loop is not planned yet: init first".into()),
            "develop" => match first_open_task(&ccw) {
                Some(task) => Ok(Dispatch {
                    task_id: Some(task.id.clone()),
                    ..Dispatch::new("develop")
                }),
                None => Err("no task is pending".into()),
            },
            "complete" => Ok(Dispatch::complete_if_done(self.goal_met(state))),
            other => Ok(Dispatch::new(other)),
        }
    }

    fn begin(&self, state: &mut LoopState, dispatch: &Dispatch, _now: &str) {
        let skill = state.skill();
        if let Some(id) = &dispatch.task_id {
            let mut ccw: CcwState = skill.part();
            ccw.develop.current_task = Some(id.clone());
            if let Some(task) = ccw.develop.task_mut(id) {
                task.status = TaskStatus::InProgress;
            }
            skill.set_part(&ccw);
        }
    }

    fn validate(&self, action: &str, result: &ActionResult) -> Result<(), String> {
        let updates = &result.state_updates;
        match action {
            "init" => {
                if let Some(tasks) = updates.get("tasks") {
                    let Value::Array(tasks) = tasks else {
                        return Err("state_updates.tasks must be an array".into());
                    };
                    if tasks.len() > MAX_TASKS {
                        return Err(format!(
                            "state_updates.tasks has {} tasks, over the limit of {MAX_TASKS}",
                            tasks.len()
                        ));
                    }
                    for (i, task) in tasks.iter().enumerate() {
                        task_spec(task).map_err(|e| format!("state_updates.tasks[{i}]: {e}"))?;
                    }
                }
            }
            "debug" => {
                opt_str(updates, "active_bug")?;
                opt_str(updates, "confirmed_hypothesis")?;
                if let Some(h) = updates.get("hypotheses") {
                    serde_json::from_value::<Vec<Hypothesis>>(h.clone())
                        .map_err(|e| format!("state_updates.hypotheses: {e}"))?;
                }
                if let Some(fix) = updates.get("fix_tasks") {
                    let Value::Array(fix) = fix else {
                        return Err("state_updates.fix_tasks must be an array".into());
                    };
                    if fix.len() > MAX_TASKS {
                        return Err(format!(
                            "state_updates.fix_tasks has {} tasks, over the limit of {MAX_TASKS}",
                            fix.len()
                        ));
                    }
                    for (i, task) in fix.iter().enumerate() {
                        task_spec(task)
                            .map_err(|e| format!("state_updates.fix_tasks[{i}]: {e}"))?;
                    }
                }
            }
            "validate" => {
                match updates.get("passed") {
                    Some(Value::Bool(_)) => {}
                    Some(other) => {
                        return Err(format!(
                            "state_updates.passed must be a boolean, not {other}"
                        ));
                    }
                    None => return Err("state_updates.passed is required for validate".into()),
                }
                for key in ["pass_rate", "coverage"] {
                    if let Some(v) = updates.get(key)
                        && !v.is_number()
                    {
                        return Err(format!("state_updates.{key} must be a number, not {v}"));
                    }
                }
                if let Some(r) = updates.get("test_results") {
                    serde_json::from_value::<Vec<TestResult>>(r.clone())
                        .map_err(|e| format!("state_updates.test_results: {e}"))?;
                }
                if let Some(f) = updates.get("failed_tests") {
                    serde_json::from_value::<Vec<String>>(f.clone())
                        .map_err(|e| format!("state_updates.failed_tests: {e}"))?;
                }
            }
            "complete" => {
                opt_str(updates, "summary")?;
            }
            _ => {}
        }
        Ok(())
    }

    fn apply(
        &self,
        state: &mut LoopState,
        dispatch: &Dispatch,
        finish: &Finish,
        inputs: &Inputs,
    ) -> Option<LoopEnd> {
        let result = finish.result();
        let description = if state.description.trim().is_empty() {
            state.title.clone()
        } else {
            state.description.clone()
        };
        let iterations = state.current_iteration;
        let skill = state.skill();
        let mut ccw: CcwState = skill.part();
        let end = self.apply_part(
            &mut ccw,
            skill,
            dispatch,
            result,
            &description,
            iterations,
            inputs,
        );
        skill.set_part(&ccw);
        end
    }

    fn absorb_tasks(&self, state: &mut LoopState, listed: &[ListedTask], now: &str) -> usize {
        let Some(skill) = state.skill_state.as_mut() else {
            return 0;
        };
        let mut ccw: CcwState = skill.part();
        if ccw.initialized_at.is_none() && ccw.develop.tasks.is_empty() {
            return 0; // init takes the whole list
        }
        let mut joined = 0;
        for task in listed {
            if ccw.develop.task(&task.id).is_none() {
                if !ccw.develop.add_task(DevelopTask::listed(task, Some(now))) {
                    break; // the list is full of open tasks
                }
                joined += 1;
            }
        }
        if joined > 0 {
            ccw.develop.recount();
            skill.set_part(&ccw);
        }
        joined
    }

    fn task(&self, state: &LoopState, dispatch: &Dispatch) -> Option<(String, String)> {
        view::task(state, dispatch)
    }

    fn prompt_vars(&self, state: &LoopState, _: &Dispatch) -> Vec<(&'static str, String)> {
        view::prompt_vars(state)
    }

    fn view(&self, state: &LoopState) -> super::View {
        view::view(state)
    }

    fn notes(
        &self,
        state: &LoopState,
        dispatch: &Dispatch,
        finish: &Finish,
        now: &str,
    ) -> Vec<super::Note> {
        view::notes(state, dispatch, finish, now)
    }

    fn report(&self, state: &LoopState) -> (Option<String>, String) {
        view::report(state)
    }

    fn reset_failed(&self, skill: &mut SkillState) -> usize {
        let mut ccw: CcwState = skill.part();
        let mut reset = 0;
        for task in &mut ccw.develop.tasks {
            if task.status == TaskStatus::Failed {
                task.status = TaskStatus::Pending;
                reset += 1;
            }
        }
        if reset > 0 {
            ccw.develop.recount();
            skill.set_part(&ccw);
        }
        reset
    }

    fn task_ids(&self, skill: &SkillState) -> Vec<String> {
        let ccw: CcwState = skill.part();
        ccw.develop.tasks.into_iter().map(|t| t.id).collect()
    }

    fn reads_task_list(&self, action: &str) -> bool {
        action == "init"
    }

    fn init_part(&self, skill: &mut SkillState) {
        let ccw: CcwState = skill.part();
        skill.set_part(&ccw);
    }

    fn rebuild(
        &self,
        skill: &mut SkillState,
        listed: Vec<ListedTask>,
        read: &dyn Fn(&str) -> Option<String>,
        now: &str,
    ) -> Result<(), String> {
        let mut tasks: Vec<DevelopTask> = listed
            .iter()
            .map(|t| DevelopTask::listed(t, None))
            .collect();
        // Each develop left a line in changes.log: the task's last result wins.
        for line in read("changes.log").unwrap_or_default().lines() {
            let Ok(change) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let (Some(task_id), Some(result)) =
                (change["task_id"].as_str(), change["result"].as_str())
            else {
                continue;
            };
            let status = match result {
                "completed" => TaskStatus::Completed,
                "failed" => TaskStatus::Failed,
                _ => continue,
            };
            let position = tasks
                .iter()
                .position(|t| t.id == task_id)
                .unwrap_or_else(|| {
                    tasks.push(DevelopTask {
                        id: task_id.to_owned(),
                        description: change["description"].as_str().unwrap_or("").to_owned(),
                        ..DevelopTask::default()
                    });
                    tasks.len() - 1
                });
            let task = &mut tasks[position];
            task.status = status;
            task.completed_at = change["timestamp"].as_str().map(str::to_owned);
            if let Ok(files) = serde_json::from_value(change["files_changed"].clone()) {
                task.files_changed = files;
            }
        }
        let mut ccw: CcwState = skill.part();
        ccw.initialized_at = (!tasks.is_empty()).then(|| now.to_owned());
        ccw.develop.tasks = tasks;
        ccw.develop.recount();
        skill.set_part(&ccw);
        Ok(())
    }

    fn problems(&self, skill: &SkillState) -> Vec<String> {
        let ccw: CcwState = match skill.try_part() {
            Ok(ccw) => ccw,
            Err(e) => return vec![format!("skill_state: {e}")],
        };
        let mut problems = Vec::new();
        let mut ids = std::collections::HashSet::new();
        for task in &ccw.develop.tasks {
            if task.id.is_empty() {
                problems.push("a develop task has an empty id".to_owned());
            } else if !ids.insert(task.id.as_str()) {
                problems.push(format!("develop task id {:?} appears twice", task.id));
            }
        }
        problems
    }
}

impl CcwLoop {
    /// [`Workflow::apply`] on the workflow's own fields.
    #[expect(
        clippy::too_many_arguments,
        reason = "one call site, each argument a distinct fact"
    )]
    fn apply_part(
        &self,
        ccw: &mut CcwState,
        skill: &mut SkillState,
        dispatch: &Dispatch,
        result: Option<&ActionResult>,
        description: &str,
        iterations: u64,
        inputs: &Inputs,
    ) -> Option<LoopEnd> {
        let now = inputs.now.as_str();
        let updates = result.map(|r| &r.state_updates);
        match dispatch.action.as_str() {
            "init" => planned(ccw, updates, &inputs.listed_tasks, description, now),
            "develop" => developed(ccw, skill.seq, dispatch, result, now),
            "debug" => debugged(ccw, updates, now),
            "validate" => validated(ccw, updates, now),
            "complete" => {
                let outcome = dispatch.outcome.unwrap_or(Outcome::Incomplete);
                let text = updates
                    .and_then(|u| opt_str(u, "summary").ok().flatten())
                    .map(str::to_owned)
                    .or_else(|| result.map(|r| r.summary.clone()).filter(|s| !s.is_empty()));
                skill.outcome = Some(outcome.as_str().to_owned());
                ccw.summary = Some(summary(ccw, skill, iterations, outcome, text));
                return Some(LoopEnd::Completed(outcome));
            }
            _ => {}
        }
        None
    }
}

/// init: the task list's tasks, else the planned ones, else one made from the loop's goal.
fn planned(
    ccw: &mut CcwState,
    updates: Option<&Map<String, Value>>,
    listed: &[ListedTask],
    description: &str,
    now: &str,
) {
    let mut tasks: Vec<DevelopTask> = listed
        .iter()
        .map(|t| DevelopTask::listed(t, Some(now)))
        .collect();
    if tasks.is_empty() {
        let planned = updates
            .and_then(|u| u.get("tasks"))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for spec in &planned {
            if let Ok((desc, tool, mode)) = task_spec(spec) {
                let mut task = new_task(&ccw.develop.tasks, &tasks, desc, tool, mode, now);
                task.after = planned_after(spec);
                tasks.push(task);
            }
        }
    }
    if tasks.is_empty() {
        tasks.push(new_task(&[], &[], description, None, None, now));
    }
    ccw.develop.tasks = tasks;
    ccw.develop.recount();
    ccw.initialized_at = Some(now.to_owned());
}

/// develop: its task completed or failed, with the files it changed.
fn developed(
    ccw: &mut CcwState,
    seq: u64,
    dispatch: &Dispatch,
    result: Option<&ActionResult>,
    now: &str,
) {
    let ok = result.is_some();
    if let Some(task) = dispatch
        .task_id
        .as_deref()
        .and_then(|id| ccw.develop.task_mut(id))
    {
        task.status = if ok {
            TaskStatus::Completed
        } else {
            TaskStatus::Failed
        };
        task.completed_at = Some(now.to_owned());
        if ok && task.merge_conflict.is_some() {
            task.merge_conflict = Some(Value::Null);
        }
        if let Some(r) = result {
            task.files_changed = r.files_changed.clone();
            trim_window(&mut task.files_changed, FILES_CHANGED_WINDOW);
        }
    }
    if !ok {
        ccw.develop_failed_seq = Some(seq + 1);
    }
    ccw.develop.last_progress_at = Some(now.to_owned());
    ccw.develop.recount();
}

/// debug: the bug, the hypotheses (bounded), and fix tasks joining as pending.
fn debugged(ccw: &mut CcwState, updates: Option<&Map<String, Value>>, now: &str) {
    ccw.debug.iteration = ccw.debug.iteration.saturating_add(1);
    ccw.debug.last_analysis_at = Some(now.to_owned());
    let Some(u) = updates else {
        return;
    };
    if let Ok(Some(bug)) = opt_str(u, "active_bug") {
        ccw.debug.active_bug = Some(bug.to_owned());
    }
    if let Ok(Some(h)) = opt_str(u, "confirmed_hypothesis") {
        ccw.debug.confirmed_hypothesis = Some(h.to_owned());
    }
    if let Some(new) = u
        .get("hypotheses")
        .and_then(|h| serde_json::from_value::<Vec<Hypothesis>>(h.clone()).ok())
    {
        ccw.debug.hypotheses_count = ccw.debug.hypotheses_count.saturating_add(new.len() as u64);
        ccw.debug.hypotheses.extend(new);
        trim_window(&mut ccw.debug.hypotheses, HYPOTHESES_WINDOW);
    }
    let fixes = u.get("fix_tasks").and_then(Value::as_array).cloned();
    for spec in fixes.unwrap_or_default() {
        if let Ok((desc, tool, mode)) = task_spec(&spec) {
            let task = new_task(&ccw.develop.tasks, &[], desc, tool, mode, now);
            if !ccw.develop.add_task(task) {
                break; // the list is full of open tasks
            }
        }
    }
    ccw.develop.recount();
}

/// validate: the run's result (a failed action: not passed), its lists bounded.
fn validated(ccw: &mut CcwState, updates: Option<&Map<String, Value>>, now: &str) {
    let v = &mut ccw.validate;
    v.last_run_at = Some(now.to_owned());
    v.regression = None;
    let Some(u) = updates else {
        v.passed = false;
        return;
    };
    v.passed = u.get("passed").and_then(Value::as_bool).unwrap_or(false);
    if let Some(rate) = u.get("pass_rate").and_then(Value::as_f64) {
        v.pass_rate = rate;
    }
    if let Some(cov) = u.get("coverage").and_then(Value::as_f64) {
        v.coverage = cov;
    }
    v.test_results = u
        .get("test_results")
        .and_then(|r| serde_json::from_value(r.clone()).ok())
        .unwrap_or_default();
    trim_window(&mut v.test_results, TEST_RESULTS_WINDOW);
    v.failed_tests = u
        .get("failed_tests")
        .and_then(|r| serde_json::from_value(r.clone()).ok())
        .unwrap_or_default();
    v.failed_tests.truncate(FAILED_TESTS_WINDOW);
}

/// `{"description", "tool"?, "mode"?}` of an init task or a fix task.
fn task_spec(spec: &Value) -> Result<(&str, Option<&str>, Option<&str>), String> {
    let Value::Object(map) = spec else {
        return Err(format!("a task must be an object, not {spec}"));
    };
    let description = match opt_str(map, "description")? {
        Some(d) if d.len() > MAX_DESCRIPTION => {
            return Err(format!(
                "a task description of {} bytes is over the limit of {MAX_DESCRIPTION}",
                d.len()
            ));
        }
        Some(d) if !d.trim().is_empty() => d,
        _ => return Err("a task needs a non-empty description".into()),
    };
    if let Some(after) = map.get("after")
        && serde_json::from_value::<Vec<String>>(after.clone()).is_err()
    {
        return Err(format!("after must be a list of task ids, not {after}"));
    }
    Ok((description, opt_str(map, "tool")?, opt_str(map, "mode")?))
}

/// The tasks a planned task needs done first, when it says (`after`, ids as init numbers them).
fn planned_after(spec: &Value) -> Option<Vec<String>> {
    serde_json::from_value(spec.get("after")?.clone()).ok()
}

fn new_task(
    existing: &[DevelopTask],
    adding: &[DevelopTask],
    description: &str,
    tool: Option<&str>,
    mode: Option<&str>,
    now: &str,
) -> DevelopTask {
    let taken = |id: &str| existing.iter().chain(adding).any(|t| t.id == id);
    let id = (existing.len() + adding.len() + 1..)
        .map(|n| format!("task-{n:03}"))
        .find(|id| !taken(id))
        .unwrap_or_default();
    DevelopTask {
        id,
        description: description.to_owned(),
        tool: tool.map(str::to_owned),
        mode: mode.map(str::to_owned),
        created_at: Some(now.to_owned()),
        ..DevelopTask::default()
    }
}

fn summary(
    ccw: &CcwState,
    skill: &SkillState,
    iterations: u64,
    outcome: Outcome,
    text: Option<String>,
) -> Value {
    let count = |s: TaskStatus| ccw.develop.tasks.iter().filter(|t| t.status == s).count();
    let mut map = Map::new();
    if let Some(text) = text {
        map.insert("text".into(), Value::String(text));
    }
    map.insert("outcome".into(), json!(outcome.as_str()));
    map.insert("iterations".into(), json!(iterations));
    map.insert(
        "develop".into(),
        json!({
            "total": ccw.develop.tasks.len(),
            "completed": count(TaskStatus::Completed),
            "failed": count(TaskStatus::Failed),
        }),
    );
    map.insert(
        "debug".into(),
        json!({
            "iterations": ccw.debug.iteration,
            "hypotheses": ccw.debug.hypotheses_count,
            "confirmed_hypothesis": ccw.debug.confirmed_hypothesis,
        }),
    );
    map.insert(
        "validate".into(),
        json!({
            "passed": ccw.validate.passed,
            "pass_rate": ccw.validate.pass_rate,
            "coverage": ccw.validate.coverage,
        }),
    );
    map.insert("errors".into(), json!(skill.error_count));
    Value::Object(map)
}

/// `text` on one line (its whitespace runs made one space), cut at `max` characters.
fn one_line(text: &str, max: usize) -> String {
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &line[..end]),
        None => line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Finished, Mode, Status};
    use crate::workflow::{Decision, Limits, decide, record_finish};

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
        assert!(
            matches!(decide(&CcwLoop, &s, limits), Decision::Abort(r) if r.contains("max_tokens"))
        );
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
}
