//! What anyone may change of a loop while it lives, from the command line or the API: its status
//! (pause, resume, stop), the next action of an interactive loop, one more task, the answer to an
//! executor's question.
//!
//! Each writes the state file as the CCW dashboard does: read-modify-write under the loop's lock,
//! only the fields it means to change, refused with one line where it makes no sense.

use anyhow::Result;
use loopd_core::state::{MAX_DESCRIPTION, Mode, Status};
use serde_json::{Value, json};

use crate::error::usage;
use crate::project::{Project, loop_workflow};
use crate::view::standing;
use loopd_store::now_rfc3339;

/// A status change a person asks for.
#[derive(Clone, Copy, Debug)]
pub enum Control {
    Pause,
    Resume,
    Stop,
}

/// What a status change did.
pub struct Controlled {
    pub from: Status,
    pub to: Status,
    /// False when the loop had that status already.
    pub changed: bool,
    /// A resumed loop that no daemon drives: the executor it was started with, to start one.
    pub needs_daemon: Option<Option<String>>,
}

/// Writes a status change under the loop's lock, refused in one line where it makes no sense
/// (a completed loop paused, a loop at its error limit resumed). Starts nothing.
pub fn set_control(p: &Project, id: &str, what: Control) -> Result<Controlled> {
    let state = p.load(id)?;
    let status = state.status.clone();
    let allowed: &[Status] = match what {
        Control::Pause => &[Status::Running, Status::Created],
        Control::Resume => &[
            Status::Paused,
            Status::Failed,
            Status::UserExit,
            Status::Created,
        ],
        Control::Stop => &[Status::Running, Status::Paused, Status::Created],
    };
    let verb = match what {
        Control::Pause => "pause",
        Control::Resume => "resume",
        Control::Stop => "stop",
    };
    let target = match what {
        Control::Pause => Status::Paused,
        Control::Resume => Status::Running,
        Control::Stop => Status::Failed,
    };
    let resumable = |s: &Status| allowed.contains(s) || matches!(what, Control::Resume);
    if status == target && !matches!(what, Control::Resume) {
        return Ok(Controlled {
            from: status,
            to: target,
            changed: false,
            needs_daemon: None,
        });
    }
    // A loop completed without meeting its goal goes on once there is room: a raised
    // iteration limit, or tasks added to one that had nothing left to try.
    let outcome = state
        .skill_state
        .as_ref()
        .and_then(|s| s.outcome.as_deref());
    let room = match outcome {
        Some("iteration_limit") => {
            state.current_iteration < state.max_iterations_or(p.config.max_iterations)
        }
        Some("incomplete") => true,
        _ => false,
    };
    let goes_on = matches!(what, Control::Resume) && status == Status::Completed && room;
    if !goes_on
        && (!resumable(&status) || (matches!(what, Control::Resume) && status == Status::Completed))
    {
        let hint = match (&what, outcome) {
            (Control::Resume, Some("iteration_limit")) => format!(
                "; to go on, raise its limit with `loopd set {id} --max-iterations N`, then resume"
            ),
            _ => String::new(),
        };
        return Err(usage(format!(
            "cannot {verb} loop {id}: it is {}{hint}",
            standing(&state, None)
        )));
    }
    // A loop the daemon failed at its error limit would fail again at once.
    let errors = state.skill_state.as_ref().map_or(0, |s| s.error_count);
    let max_errors = state.max_errors_or(p.config.max_errors);
    if matches!(what, Control::Resume) && status == Status::Failed && errors >= max_errors {
        return Err(usage(format!(
            "cannot resume loop {id}: it failed at its error limit ({errors} of {max_errors}) and \
             would fail again at once; `loopd retry {id}` resets the count, or raise the limit \
             with `loopd set {id} --max-errors N`"
        )));
    }
    let executor = state.skill_state.as_ref().and_then(|s| s.executor.clone());
    let start_daemon =
        matches!(what, Control::Resume) && crate::locks::driving_daemon(&p.store, id).is_none();
    if start_daemon {
        crate::daemon::check_runnable(p, &state, executor.as_deref())?;
    }
    let mut refused = None;
    p.store.update(id, true, |raw, current| {
        refused = None;
        if current.status == target {
            return; // someone else wrote the same meanwhile
        }
        if !allowed.contains(&current.status) && current.status != status {
            refused = Some(current.status.clone());
            return;
        }
        raw.insert("status".into(), json!(target.as_str()));
        match what {
            Control::Stop => {
                raw.insert("failure_reason".into(), json!("Manually stopped by user"));
            }
            Control::Resume => {
                raw.remove("failure_reason");
                raw.remove("completed_at");
            }
            Control::Pause => {}
        }
    })?;
    if let Some(now) = refused {
        return Err(usage(format!(
            "cannot {verb} loop {id}: it became {now} meanwhile"
        )));
    }
    Ok(Controlled {
        from: status,
        to: target,
        changed: true,
        needs_daemon: start_daemon.then_some(executor),
    })
}

/// Chooses the next action of a loop in interactive mode; returns `{loop_id, next_action}`.
pub fn choose_next(p: &Project, id: &str, action: &str) -> Result<Value> {
    let state = p.load(id)?;
    let workflow = loop_workflow(p, &state)?;
    if state.mode() != Mode::Interactive {
        return Err(usage(format!(
            "loop {id} is in auto mode; it chooses its own actions"
        )));
    }
    if !workflow.actions().contains(&action) {
        return Err(usage(format!(
            "invalid action {action:?}; valid choices: {}",
            workflow.actions().join(", ")
        )));
    }
    let mut chosen = state.clone();
    chosen.next_action = Some(action.to_owned());
    if let loopd_core::workflow::Decision::Wait {
        refused: Some(why), ..
    } = loopd_core::workflow::decide(workflow, &chosen, p.config.limits())
    {
        return Err(usage(format!("cannot choose {why}")));
    }
    p.store.update(id, true, |raw, _| {
        raw.insert("next_action".into(), json!(action));
    })?;
    Ok(json!({ "loop_id": id, "next_action": action }))
}

/// Appends a task to a loop's task list (see [`task_add`]); returns `{loop_id, task_id}`.
pub fn add_task(p: &Project, id: &str, text: &str) -> Result<Value> {
    let state = p.load(id)?;
    let workflow = loop_workflow(p, &state)?;
    // A loop that met its goal is done; one that stopped short can be resumed with more work.
    let passed = state.status == Status::Completed
        && !matches!(
            state
                .skill_state
                .as_ref()
                .and_then(|s| s.outcome.as_deref()),
            Some("iteration_limit" | "incomplete")
        );
    if passed {
        return Err(usage(format!(
            "loop {id} has met its goal; a new task would never run (create a new loop)"
        )));
    }
    let text = text.trim();
    if text.is_empty() {
        return Err(usage("the task's text is empty"));
    }
    if text.len() > MAX_DESCRIPTION {
        return Err(usage(format!(
            "the task is {} bytes, over the limit of {MAX_DESCRIPTION}",
            text.len()
        )));
    }
    // Numbered past every task the loop or its task list has had.
    let taken = state
        .skill_state
        .as_ref()
        .map(|s| workflow.task_ids(s))
        .unwrap_or_default();
    let task_id = p.store.add_tasks(id, &[text], &taken)?.remove(0);
    Ok(json!({ "loop_id": id, "task_id": task_id }))
}

/// Answers the question a loop's executor asked (see [`answer`]); returns `{loop_id, action,
/// question, answer}`.
pub fn give_answer(p: &Project, id: &str, text: &str) -> Result<Value> {
    let state = p.load(id)?;
    let waiting = |s: &loopd_core::state::LoopState| {
        s.skill_state
            .as_ref()
            .and_then(|k| k.question.clone())
            .filter(|q| q.waiting())
    };
    // Refused before anything is written (and again under the lock, if it changed meanwhile).
    if waiting(&state).is_none() {
        return Err(usage(format!("loop {id} is waiting for no answer")));
    }
    if text.trim().is_empty() {
        return Err(usage("the answer is empty"));
    }
    if text.len() > MAX_DESCRIPTION {
        return Err(usage(format!(
            "the answer is {} bytes, over the limit of {MAX_DESCRIPTION}",
            text.len()
        )));
    }
    let mut question = None;
    p.store.update(id, true, |raw, current| {
        question = waiting(current);
        if question.is_none() {
            return;
        }
        if let Some(Value::Object(q)) = raw
            .get_mut("skill_state")
            .and_then(|s| s.get_mut("question"))
        {
            q.insert("answer".into(), json!(text));
            q.insert("answered_at".into(), json!(now_rfc3339()));
        }
    })?;
    let Some(question) = question else {
        return Err(usage(format!("loop {id} is waiting for no answer")));
    };
    Ok(json!({
        "loop_id": id, "action": question.action, "question": question.text, "answer": text
    }))
}
