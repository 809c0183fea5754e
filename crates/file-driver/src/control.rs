//! What anyone may change of a loop while it lives, from the command line or the API: its status
//! (pause, resume, stop), the next action of an interactive loop, one more task, the answer to an
//! executor's question, its limits and budgets, and a retry of a loop that failed or was stopped.
//!
//! Each writes the state file as the CCW dashboard does: read-modify-write under the loop's lock,
//! only the fields it means to change, refused with one line where it makes no sense.

use anyhow::Result;
pub use loopd_core::control::Control;
use loopd_core::control::{self as rules};
use loopd_core::state::{Status, StatusBy};
use serde_json::{Value, json};

use crate::error::usage;
use crate::project::{Project, loop_workflow};
use loopd_store::now_rfc3339;

/// What a status change did.
pub struct Controlled {
    pub from: Status,
    pub to: Status,
    /// False when the loop had that status already.
    pub changed: bool,
    /// A resumed loop that no daemon drives: the executor it was started with, to start one.
    pub needs_daemon: Option<Option<String>>,
}

/// The service's API, as the writer of a status ([`StatusBy`]).
pub const BY_API: &str = "the API of loopd serve";
/// loopd's MCP server (`loopd mcp`, `/mcp` on `loopd serve`), as the writer of a status.
pub const BY_MCP: &str = "the MCP server of loopd";

/// Records beside the status that `by` (this process) set it (`status_by`), so that a daemon
/// whose attempt it ends says who did.
fn stamp_status(raw: &mut serde_json::Map<String, Value>, status: &Status, by: &str) {
    let stamp = StatusBy {
        status: status.clone(),
        by: by.to_owned(),
        pid: Some(std::process::id()),
        at: Some(now_rfc3339()),
    };
    raw.insert("status_by".into(), json!(stamp));
}

/// Writes a status change under the loop's lock, refused in one line where it makes no sense
/// ([`Control::check`]), recorded as set `by` that controller (`loopd pause`, [`BY_API`]).
/// Starts nothing.
pub fn set_control(p: &Project, id: &str, what: Control, by: &str) -> Result<Controlled> {
    let state = p.load(id)?;
    let status = state.status.clone();
    let target = what.target();
    if !what.check(&state, id, p.config.limits()).map_err(usage)? {
        return Ok(Controlled {
            from: status,
            to: target,
            changed: false,
            needs_daemon: None,
        });
    }
    let executor = state.skill_state.as_ref().and_then(|s| s.executor.clone());
    let start_daemon =
        what == Control::Resume && crate::locks::driving_daemon(&p.store, id).is_none();
    if start_daemon {
        crate::daemon::check_runnable(p, &state, executor.as_deref())?;
    }
    let mut refused = None;
    p.store.update(id, true, |raw, current| {
        refused = None;
        if current.status == target {
            return; // someone else wrote the same meanwhile
        }
        if !what.allowed().contains(&current.status) && current.status != status {
            refused = Some(current.status.clone());
            return;
        }
        what.apply_raw(raw);
        stamp_status(raw, &target, by);
    })?;
    if let Some(now) = refused {
        return Err(usage(format!(
            "cannot {} loop {id}: it became {now} meanwhile",
            what.verb()
        )));
    }
    Ok(Controlled {
        from: status,
        to: target,
        changed: true,
        needs_daemon: start_daemon.then_some(executor),
    })
}

/// Chooses the next action of a loop in interactive mode ([`rules::check_next`]); returns
/// `{loop_id, next_action}`.
pub fn choose_next(p: &Project, id: &str, action: &str) -> Result<Value> {
    let state = p.load(id)?;
    let workflow = loop_workflow(p, &state)?;
    rules::check_next(workflow, &state, id, action, p.config.limits()).map_err(usage)?;
    p.store.update(id, true, |raw, _| {
        raw.insert("next_action".into(), json!(action));
    })?;
    Ok(json!({ "loop_id": id, "next_action": action }))
}

/// Appends a task to a loop's task list ([`rules::check_task`]), needing the tasks `after` names
/// done first (each a task of the loop), tried by each executor of `race`; returns `{loop_id,
/// task_id}`.
pub fn add_task(
    p: &Project,
    id: &str,
    text: &str,
    after: &[String],
    race: &[String],
) -> Result<Value> {
    crate::worktree::check_race(p, race)?;
    let state = p.load(id)?;
    let workflow = loop_workflow(p, &state)?;
    let text = rules::check_task(&state, id, text).map_err(usage)?;
    // Numbered past every task the loop or its task list has had.
    let taken = state
        .skill_state
        .as_ref()
        .map(|s| workflow.task_ids(s))
        .unwrap_or_default();
    if !after.is_empty() {
        let listed = p.store.read_tasks(id)?.tasks;
        let known = |t: &str| taken.iter().any(|k| k == t) || listed.iter().any(|l| l.id == t);
        rules::check_after(id, after, known).map_err(usage)?;
    }
    let how = loopd_store::tasks::NewTasks { after, race };
    let task_id = p.store.add_tasks(id, &[text], &how, &taken)?.remove(0);
    Ok(json!({ "loop_id": id, "task_id": task_id }))
}

/// Sets a loop's limits and budgets (`loopd set`, the API), those given only; returns `{loop_id,
/// set: {KEY: VALUE}}`.
pub fn set_limits(p: &Project, id: &str, limits: &crate::create::Limits) -> Result<Value> {
    p.load(id)?;
    limits.check()?;
    crate::worktree::check_parallel(p, limits.parallel)?;
    let changes: serde_json::Map<String, Value> = [
        ("max_iterations", limits.max_iterations.map(|n| json!(n))),
        ("max_errors", limits.max_errors.map(|n| json!(n))),
        ("max_cost_usd", limits.max_cost_usd.map(|usd| json!(usd))),
        ("max_tokens", limits.max_tokens.map(|n| json!(n))),
        ("parallel", limits.parallel.map(|n| json!(n))),
    ]
    .into_iter()
    .filter_map(|(key, value)| Some((key.to_owned(), value?)))
    .collect();
    if changes.is_empty() {
        return Err(usage(
            "nothing to set: give --max-iterations, --max-errors, --max-cost-usd, --max-tokens or \
             --parallel",
        ));
    }
    p.store.update(id, true, |raw, _| {
        raw.extend(changes.clone());
    })?;
    Ok(json!({ "loop_id": id, "set": changes }))
}

/// Answers the question a loop's executor asked ([`rules::check_answer`]); returns `{loop_id,
/// action, question, answer}`.
pub fn give_answer(p: &Project, id: &str, text: &str) -> Result<Value> {
    let state = p.load(id)?;
    // Refused before anything is written (and again under the lock, if it changed meanwhile).
    rules::check_answer(&state, id, text).map_err(usage)?;
    let mut question = None;
    p.store.update(id, true, |raw, current| {
        question = rules::waiting_question(current);
        if question.is_some() {
            rules::apply_answer_raw(raw, text, &now_rfc3339());
        }
    })?;
    let Some(question) = question else {
        return Err(usage(format!("loop {id} is waiting for no answer")));
    };
    Ok(json!({
        "loop_id": id, "action": question.action, "question": question.text, "answer": text
    }))
}

/// What a retry did: the status the loop had, how many failed tasks are pending again, and the
/// executor it was started with (to start it again with).
pub struct Retried {
    pub from: Status,
    pub tasks_reset: usize,
    pub executor: Option<String>,
}

/// `retry`: a failed or stopped loop is set running again, with its error count at 0, its failure
/// and outcome cleared, and its failed tasks pending again ([`Workflow::reset_failed`]). Refused
/// in one line for a loop a daemon drives or that has not ended that way. Starts nothing: the
/// command line starts a daemon, the service takes the loop up itself.
///
/// [`Workflow::reset_failed`]: loopd_core::workflow::Workflow::reset_failed
pub fn retry_loop(p: &Project, id: &str, by: &str) -> Result<Retried> {
    let state = p.load(id)?;
    if let Some(pid) = crate::locks::driving_daemon(&p.store, id) {
        return Err(usage(format!(
            "loop {id} is driven by a daemon (pid {pid}); retry is for a loop that has ended"
        )));
    }
    if !matches!(state.status, Status::Failed | Status::UserExit) {
        return Err(usage(format!(
            "cannot retry loop {id}: it is {}; retry is for a failed or stopped loop",
            crate::view::standing(&state, None)
        )));
    }
    let executor = state.skill_state.as_ref().and_then(|s| s.executor.clone());
    crate::daemon::check_runnable(p, &state, executor.as_deref())?;
    let workflow = loop_workflow(p, &state)?;
    let mut tasks_reset = 0;
    let mut moved_on = None;
    p.store.update(id, true, |raw, current| {
        tasks_reset = 0;
        moved_on = None;
        if !matches!(current.status, Status::Failed | Status::UserExit) {
            moved_on = Some(current.status.clone());
            return;
        }
        raw.insert("status".into(), json!(Status::Running.as_str()));
        stamp_status(raw, &Status::Running, by);
        raw.remove("failure_reason");
        raw.remove("completed_at");
        if let (Some(mut typed), Some(Value::Object(skill))) =
            (current.skill_state.clone(), raw.get_mut("skill_state"))
        {
            skill.insert("error_count".into(), json!(0));
            skill.remove("outcome");
            tasks_reset = workflow.reset_failed(&mut typed);
            // The workflow's own fields, as it left them (the others are the file's, verbatim).
            skill.extend(typed.part);
        }
    })?;
    if let Some(now) = moved_on {
        return Err(usage(format!(
            "cannot retry loop {id}: it became {now} meanwhile"
        )));
    }
    Ok(Retried {
        from: state.status,
        tasks_reset,
        executor,
    })
}
