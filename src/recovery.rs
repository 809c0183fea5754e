//! Ways on for a loop that stopped short or waits: `retry` (a failed loop, its error count and
//! failed tasks reset), `set` (its limits and budgets), `task add` (one more task), `answer` (to
//! an executor's question).
//!
//! Each writes the state file as `pause` does: read-modify-write under the loop's lock, only the
//! fields it means to change, refused with one line where it makes no sense.

use anyhow::Result;
use loopd_core::state::Status;
use serde_json::json;

use crate::output::print_result;
use loopd_file_driver::control::{add_task, give_answer, retry_loop, set_limits};
use loopd_file_driver::create::Limits;
use loopd_file_driver::project::Project;
use loopd_file_driver::view::standing;

/// `loopd retry ID`: a failed or stopped loop goes on, with its error count at 0 and its failed
/// tasks pending again ([`retry_loop`]); a daemon is started for it.
pub fn retry(p: &Project, id: &str, as_json: bool) -> Result<i32> {
    let retried = retry_loop(p, id, "loopd retry")?;
    eprintln!(
        "loop {id}: {} → running; error count reset, {} failed task(s) pending again",
        retried.from, retried.tasks_reset
    );
    let pid = loopd_file_driver::daemon::start(p, id, retried.executor.as_deref())?;
    eprintln!("started daemon pid {pid}");
    let value = json!({
        "loop_id": id,
        "from": retried.from.as_str(),
        "status": Status::Running.as_str(),
        "tasks_reset": retried.tasks_reset,
        "pid": pid,
    });
    print_result(as_json, &value, &pid.to_string())?;
    Ok(0)
}

/// `loopd set ID --max-iterations N ...`: changes a loop's limits and budgets. A daemon driving
/// the loop takes them at its next selection.
pub fn set(p: &Project, id: &str, limits: &Limits, as_json: bool) -> Result<i32> {
    let state = p.load(id)?;
    let done = set_limits(p, id, limits)?;
    let said: Vec<String> = done["set"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| format!("{k} = {v}"))
        .collect();
    eprintln!(
        "loop {id} ({}): {}",
        standing(&state, None),
        said.join(", ")
    );
    print_result(as_json, &done, "")?;
    Ok(0)
}

/// `loopd task add ID TEXT`: appends a task to the loop's task list, where a daemon driving the
/// loop picks it up before its next selection (event `tasks_added`); prints the task's id.
pub fn task_add(
    p: &Project,
    id: &str,
    text: &str,
    after: &[String],
    race: &[String],
    as_json: bool,
) -> Result<i32> {
    let value = add_task(p, id, text, after, race)?;
    print_result(
        as_json,
        &value,
        value["task_id"].as_str().unwrap_or_default(),
    )?;
    Ok(0)
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
