//! The ccw-loop workflow: init → develop → debug → validate → complete (CONTRACT §4).
//!
//! Selection is derived from durable facts in `skill_state` rather than from the action history
//! window: `initialized_at` (init ran, even if it planned nothing), the task statuses, and for each
//! action the `seq` at which it last finished. That is what keeps the seed's defects away: init
//! never runs twice, develop never runs without a task, and the iteration limit always completes.
//!
//! The parts: the workflow's choices and rules here; what each result does to the state in
//! `apply`; the state's own part in `state`; what people see in `view`; the tests in `tests`.

use serde_json::Value;

mod apply;
pub mod state;
mod view;

use apply::{debugged, developed, one_line, planned, summary, task_spec, validated};

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

#[cfg(test)]
mod tests;
