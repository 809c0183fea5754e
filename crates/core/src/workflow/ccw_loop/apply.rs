//! What each action's result does to a ccw-loop's part of the state: tasks planned, developed,
//! debugged, validated; a task's spec checked; the summary.

use super::*;
use serde_json::{Map, Value, json};

/// init: the task list's tasks, else the planned ones, else one made from the loop's goal.
pub(super) fn planned(
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
pub(super) fn developed(
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
pub(super) fn debugged(ccw: &mut CcwState, updates: Option<&Map<String, Value>>, now: &str) {
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
pub(super) fn validated(ccw: &mut CcwState, updates: Option<&Map<String, Value>>, now: &str) {
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
pub(super) fn task_spec(spec: &Value) -> Result<(&str, Option<&str>, Option<&str>), String> {
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
pub(super) fn planned_after(spec: &Value) -> Option<Vec<String>> {
    serde_json::from_value(spec.get("after")?.clone()).ok()
}

pub(super) fn new_task(
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

pub(super) fn summary(
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
pub(super) fn one_line(text: &str, max: usize) -> String {
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &line[..end]),
        None => line,
    }
}
