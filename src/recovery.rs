//! Ways on for a loop that stopped short or waits: `retry` (a failed loop, its error count and
//! failed tasks reset), `set` (its limits and budgets), `task add` (one more task), `answer` (to
//! an executor's question).
//!
//! Each writes the state file as `pause` does: read-modify-write under the loop's lock, only the
//! fields it means to change, refused with one line where it makes no sense.

use anyhow::Result;
use loopd_core::state::{MAX_DESCRIPTION, Status};
use serde_json::{Value, json};

use crate::cli::{Project, print_result, usage};
use crate::view::standing;
use loopd_store::now_rfc3339;

/// A loop's limits and budgets, as `create` and `set` take them; `None` leaves one as it is (for
/// a new loop: the config's).
#[derive(Clone, Copy, Debug, Default, clap::Args)]
pub struct Limits {
    /// Complete the loop after this many develop/debug/validate actions [create: the config's]
    #[arg(long, value_name = "N")]
    pub max_iterations: Option<u64>,
    /// Fail the loop after this many failed actions [create: the config's]
    #[arg(long, value_name = "N")]
    pub max_errors: Option<u64>,
    /// Fail the loop once its agents have cost this many dollars
    #[arg(long, value_name = "USD")]
    pub max_cost_usd: Option<f64>,
    /// Fail the loop once its agents have used this many tokens
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<u64>,
}

impl Limits {
    /// Refuses a limit of 0 and a budget that is not a positive number.
    pub fn check(&self) -> Result<()> {
        for (flag, value) in [
            ("--max-iterations", self.max_iterations),
            ("--max-errors", self.max_errors),
            ("--max-tokens", self.max_tokens),
        ] {
            if value == Some(0) {
                return Err(usage(format!("{flag} must be at least 1")));
            }
        }
        if self
            .max_cost_usd
            .is_some_and(|c| !(c.is_finite() && c > 0.0))
        {
            return Err(usage("--max-cost-usd must be a positive number"));
        }
        Ok(())
    }
}

/// `loopd retry ID`: a failed or stopped loop goes on, with its error count at 0 and its failed
/// tasks pending again; a daemon is started for it.
pub fn retry(p: &Project, id: &str, as_json: bool) -> Result<i32> {
    let state = p.load(id)?;
    if let Some(pid) = crate::daemon::driving_daemon(&p.store, id) {
        return Err(usage(format!(
            "loop {id} is driven by a daemon (pid {pid}); retry is for a loop that has ended"
        )));
    }
    if !matches!(state.status, Status::Failed | Status::UserExit) {
        return Err(usage(format!(
            "cannot retry loop {id}: it is {}; retry is for a failed or stopped loop",
            standing(&state, None)
        )));
    }
    let executor = state.skill_state.as_ref().and_then(|s| s.executor.clone());
    crate::daemon::check_runnable(p, &state, executor.as_deref())?;
    let workflow = crate::cli::loop_workflow(p, &state)?;
    let mut reset_tasks = 0;
    let mut moved_on = None;
    p.store.update(id, true, |raw, current| {
        reset_tasks = 0;
        moved_on = None;
        if !matches!(current.status, Status::Failed | Status::UserExit) {
            moved_on = Some(current.status.clone());
            return;
        }
        raw.insert("status".into(), json!(Status::Running.as_str()));
        raw.remove("failure_reason");
        raw.remove("completed_at");
        if let (Some(mut typed), Some(Value::Object(skill))) =
            (current.skill_state.clone(), raw.get_mut("skill_state"))
        {
            skill.insert("error_count".into(), json!(0));
            skill.remove("outcome");
            reset_tasks = workflow.reset_failed(&mut typed);
            // The workflow's own fields, as it left them (the others are the file's, verbatim).
            skill.extend(typed.part);
        }
    })?;
    if let Some(now) = moved_on {
        return Err(usage(format!(
            "cannot retry loop {id}: it became {now} meanwhile"
        )));
    }
    eprintln!(
        "loop {id}: {} → running; error count reset, {reset_tasks} failed task(s) pending again",
        state.status
    );
    let pid = crate::daemon::start(p, id, executor.as_deref())?;
    eprintln!("started daemon pid {pid}");
    let value = json!({
        "loop_id": id,
        "from": state.status.as_str(),
        "status": Status::Running.as_str(),
        "tasks_reset": reset_tasks,
        "pid": pid,
    });
    print_result(as_json, &value, &pid.to_string())?;
    Ok(0)
}

/// `loopd set ID --max-iterations N ...`: changes a loop's limits and budgets. A daemon driving
/// the loop takes them at its next selection.
pub fn set(p: &Project, id: &str, limits: &Limits, as_json: bool) -> Result<i32> {
    let state = p.load(id)?;
    limits.check()?;
    let changes: Vec<(&str, Value)> = [
        ("max_iterations", limits.max_iterations.map(|n| json!(n))),
        ("max_errors", limits.max_errors.map(|n| json!(n))),
        ("max_cost_usd", limits.max_cost_usd.map(|usd| json!(usd))),
        ("max_tokens", limits.max_tokens.map(|n| json!(n))),
    ]
    .into_iter()
    .filter_map(|(key, value)| Some((key, value?)))
    .collect();
    if changes.is_empty() {
        return Err(usage(
            "nothing to set: give --max-iterations, --max-errors, --max-cost-usd or --max-tokens",
        ));
    }
    p.store.update(id, true, |raw, _| {
        for (key, value) in &changes {
            raw.insert((*key).to_owned(), value.clone());
        }
    })?;
    let said: Vec<String> = changes.iter().map(|(k, v)| format!("{k} = {v}")).collect();
    eprintln!(
        "loop {id} ({}): {}",
        standing(&state, None),
        said.join(", ")
    );
    let set: serde_json::Map<String, Value> = changes
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value))
        .collect();
    print_result(as_json, &json!({ "loop_id": id, "set": set }), "")?;
    Ok(0)
}

/// `loopd task add ID TEXT`: appends a task to the loop's task list, where a daemon driving the
/// loop picks it up before its next selection (event `tasks_added`); prints the task's id.
pub fn task_add(p: &Project, id: &str, text: &str, as_json: bool) -> Result<i32> {
    let value = add_task(p, id, text)?;
    print_result(
        as_json,
        &value,
        value["task_id"].as_str().unwrap_or_default(),
    )?;
    Ok(0)
}

/// Appends a task to a loop's task list (see [`task_add`]); returns `{loop_id, task_id}`.
pub fn add_task(p: &Project, id: &str, text: &str) -> Result<Value> {
    let state = p.load(id)?;
    let workflow = crate::cli::loop_workflow(p, &state)?;
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

/// `loopd answer ID TEXT`: answers the question an executor asked (`needs_input`); the daemon
/// goes on, and the next prompt gets the question and the answer.
pub fn answer(p: &Project, id: &str, text: &str, as_json: bool) -> Result<i32> {
    let value = give_answer(p, id, text)?;
    eprintln!(
        "loop {id}: answered {}'s question",
        value["action"].as_str().unwrap_or_default()
    );
    print_result(as_json, &value, "")?;
    Ok(0)
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
