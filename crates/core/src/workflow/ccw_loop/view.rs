//! What ccw-loop shows of its own fields: the prompt placeholders, the rows of `status`, the
//! progress files (`develop.md`, `changes.log`, `debug.md`, `validate.md`) and its sections of
//! `summary.md`. Text only; the engine writes and prints it.

use serde_json::{Value, json};

use super::state::{CcwState, TaskStatus};
use crate::state::LoopState;
use crate::workflow::{Dispatch, Finish, Note, Row, View};

fn part(state: &LoopState) -> CcwState {
    state
        .skill_state
        .as_ref()
        .map(|s| s.part())
        .unwrap_or_default()
}

/// The develop task a dispatch works on: its id and description.
pub fn task(state: &LoopState, dispatch: &Dispatch) -> Option<(String, String)> {
    let id = dispatch.task_id.as_deref()?;
    let ccw = part(state);
    let task = ccw.develop.task(id)?;
    let mut text = task.description.clone();
    if let Some(conflict) = task.merge_conflict() {
        text.push_str(&format!(
            "\n\nNOTE: your last result for this task could not be merged into the loop's tree, \
             which others' tasks changed meanwhile: {conflict}. Do the task again on the tree as \
             it is now, keeping their changes."
        ));
    }
    Some((task.id.clone(), text))
}

/// `{{tasks}}`, `{{validation}}`, `{{debug}}`.
pub fn prompt_vars(state: &LoopState) -> Vec<(&'static str, String)> {
    let ccw = part(state);
    let tasks = if ccw.develop.tasks.is_empty() {
        "(none yet)".to_owned()
    } else {
        ccw.develop.checklist().trim_end().to_owned()
    };
    let v = &ccw.validate;
    let validation = if v.last_run_at.is_none() {
        "not run yet".to_owned()
    } else {
        let mut text = format!(
            "{} (pass rate {}%, coverage {}%)",
            if v.passed { "passed" } else { "NOT passed" },
            v.pass_rate,
            v.coverage
        );
        if !v.failed_tests.is_empty() {
            text.push_str(&format!("; failed tests: {}", v.failed_tests.join(", ")));
        }
        if let Some(regression) = &v.regression {
            text.push_str(&format!("\nREGRESSION: {regression}"));
        }
        text
    };
    let d = &ccw.debug;
    let mut debug = format!(
        "active bug: {}; confirmed hypothesis: {}",
        d.active_bug.as_deref().unwrap_or("none"),
        d.confirmed_hypothesis.as_deref().unwrap_or("none")
    );
    for h in &d.hypotheses {
        debug.push_str(&format!("\n- {} [{}]: {}", h.id, h.status, h.description));
    }
    vec![
        ("tasks", tasks),
        ("validation", validation),
        ("debug", debug),
    ]
}

/// The task count for `list`, and the tasks and the last validation for `status`.
pub fn view(state: &LoopState) -> View {
    let ccw = part(state);
    let tasks = &ccw.develop.tasks;
    let done = tasks
        .iter()
        .filter(|t| t.status == TaskStatus::Completed)
        .count();
    let v = &ccw.validate;
    let validation = match &v.last_run_at {
        None => "not run".to_owned(),
        Some(at) => {
            let mut text = format!(
                "{} ({}% pass) at {at}",
                if v.passed { "passed" } else { "not passed" },
                v.pass_rate
            );
            if !v.failed_tests.is_empty() {
                text.push_str(&format!("; failing: {}", v.failed_tests.join(", ")));
            }
            text
        }
    };
    View {
        progress: format!("{done}/{}", tasks.len()),
        rows: vec![
            Row {
                label: "tasks",
                value: format!("{done}/{} completed", tasks.len()),
                lines: tasks
                    .iter()
                    .map(|t| format!("[{}] {}  {}", t.status.mark(), t.id, t.description))
                    .collect(),
            },
            Row {
                label: "validate",
                value: validation,
                lines: Vec::new(),
            },
        ],
    }
}

/// After a develop, a section in `develop.md` and a line in `changes.log`; after a debug, a
/// section in `debug.md`; after a validate, `validate.md` as the report of the last run.
pub fn notes(state: &LoopState, dispatch: &Dispatch, finish: &Finish, now: &str) -> Vec<Note> {
    let ccw = part(state);
    let (ok, summary, files) = match finish {
        Finish::Success(r) => (true, r.summary.as_str(), r.files_changed.as_slice()),
        Finish::Failed(e) => (false, e.as_str(), &[][..]),
    };
    let said = |text: &mut String| {
        if !summary.is_empty() {
            text.push_str(&format!("- summary: {summary}\n"));
        }
    };
    let iteration = state.current_iteration;
    match dispatch.action.as_str() {
        "develop" => match dispatch.task_id.as_deref() {
            Some(task_id) => develop_notes(&ccw, task_id, ok, files, iteration, now, said),
            None => Vec::new(),
        },
        "debug" => {
            let d = &ccw.debug;
            let mut text = format!(
                "\n## Debug round {} (iteration {iteration})\n\n- result: {}\n",
                d.iteration,
                if ok { "analysed" } else { "failed" }
            );
            said(&mut text);
            if let Some(bug) = &d.active_bug {
                text.push_str(&format!("- active bug: {bug}\n"));
            }
            if let Some(h) = &d.confirmed_hypothesis {
                text.push_str(&format!("- confirmed hypothesis: {h}\n"));
            }
            for h in d.hypotheses.iter().rev().take(5) {
                text.push_str(&format!("- {} [{}]: {}\n", h.id, h.status, h.description));
            }
            vec![Note::append("debug.md", text)]
        }
        "validate" => vec![Note::replace(
            "validate.md",
            validate_report(&ccw, ok, iteration, said),
        )],
        _ => Vec::new(),
    }
}

/// A develop's section in `develop.md` and its line in `changes.log`.
fn develop_notes(
    ccw: &CcwState,
    task_id: &str,
    ok: bool,
    files: &[String],
    iteration: u64,
    now: &str,
    said: impl Fn(&mut String),
) -> Vec<Note> {
    let description = ccw
        .develop
        .task(task_id)
        .map(|t| t.description.as_str())
        .unwrap_or("");
    let result = if ok { "completed" } else { "failed" };
    let mut text = format!(
        "\n## {task_id}: {description}\n\n- result: {result}\n- iteration: {iteration}\n- at: {now}\n"
    );
    said(&mut text);
    if !files.is_empty() {
        text.push_str(&format!("- files: {}\n", files.join(", ")));
    }
    let line = json!({
        "timestamp": now,
        "task_id": task_id,
        "description": description,
        "files_changed": files,
        "result": result,
    });
    vec![
        Note::append("develop.md", text),
        Note::append("changes.log", format!("{line}\n")),
    ]
}

/// `validate.md`: the report of the last run.
fn validate_report(ccw: &CcwState, ok: bool, iteration: u64, said: impl Fn(&mut String)) -> String {
    let v = &ccw.validate;
    let result = if !ok {
        "the validate action failed"
    } else if v.passed {
        "passed"
    } else {
        "not passed"
    };
    let mut text = format!(
        "# Validation report\n\n- run at: {}\n- iteration: {iteration}\n- result: {result}\n- pass rate: {}%\n- coverage: {}%\n",
        v.last_run_at.as_deref().unwrap_or("-"),
        v.pass_rate,
        v.coverage
    );
    said(&mut text);
    if !v.failed_tests.is_empty() {
        text.push_str("\n## Failed tests\n\n");
        for t in &v.failed_tests {
            text.push_str(&format!("- {t}\n"));
        }
    }
    text
}

/// The summary `complete` recorded, and the tasks and validation for `summary.md`.
pub fn report(state: &LoopState) -> (Option<String>, String) {
    let ccw = part(state);
    let text = ccw
        .summary
        .as_ref()
        .and_then(|s| s.get("text"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let v = &ccw.validate;
    let body = format!(
        "\n## Tasks\n\n{}\n## Validation\n\n- passed: {}\n- pass rate: {}%\n",
        ccw.develop.checklist(),
        v.passed,
        v.pass_rate
    );
    (text, body)
}
