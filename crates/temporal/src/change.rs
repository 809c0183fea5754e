//! What a person may change of a loop on Temporal: the file driver's commands (`pause`,
//! `resume`, `stop`, `next`, `task add`, `answer`, `set`), decided by the same rules
//! ([`loopd_core::control`]) and written into the state the workflow holds.

use loopd_core::control::{self as rules};
pub use loopd_core::control::{Change, SetLimits};
use loopd_core::state::{ListedTask, next_task_number, task_id};
use serde_json::{Value, json};

use crate::LoopInput;

impl LoopInput {
    /// Makes `change` to the loop at time `at`, or says in one line why it makes no sense;
    /// returns what the command prints, the same JSON as the file driver's.
    pub fn change(&mut self, change: &Change, at: &str) -> Result<Value, String> {
        let id = self.state.loop_id.clone();
        let limits = self.limits;
        let state = &mut self.state;
        Ok(match change {
            Change::Control(what) => {
                let from = state.status.clone();
                let changed = what.check(state, &id, limits)?;
                if changed {
                    what.apply(state);
                }
                json!({ "loop_id": id, "from": from, "status": what.target(), "changed": changed })
            }
            Change::Next(action) => {
                rules::check_next(loopd_core::workflow::of(state), state, &id, action, limits)?;
                state.next_action = Some(action.clone());
                json!({ "loop_id": id, "next_action": action })
            }
            Change::Task(new) => {
                rules::check_race_size(&new.race)?;
                if !new.race.is_empty() && self.git.is_none() {
                    return Err(format!(
                        "--race: loop {id} on Temporal has no git remote, which each \
                         executor's try would travel through"
                    ));
                }
                let text = rules::check_task(state, &id, &new.text)?;
                // Numbered past every task the loop or its task list has had.
                let wf = loopd_core::workflow::of(state);
                let taken = state
                    .skill_state
                    .as_ref()
                    .map(|s| wf.task_ids(s))
                    .unwrap_or_default();
                let listed = |t: &str| self.tasks.iter().any(|l| l.id == t);
                rules::check_after(&id, new.after.as_deref().unwrap_or_default(), |t| {
                    taken.iter().any(|k| k == t) || listed(t)
                })?;
                let number = next_task_number(
                    taken
                        .iter()
                        .map(String::as_str)
                        .chain(self.tasks.iter().map(|t| t.id.as_str())),
                );
                let task = ListedTask {
                    id: task_id(number),
                    description: text.to_owned(),
                    after: new.after.clone(),
                    race: new.race.clone(),
                    ..ListedTask::default()
                };
                let value = json!({ "loop_id": id, "task_id": task.id });
                self.tasks.push(task);
                value
            }
            Change::Answer(text) => {
                let question = rules::check_answer(state, &id, text)?;
                rules::apply_answer(state, text, at);
                json!({
                    "loop_id": id, "action": question.action, "question": question.text,
                    "answer": text
                })
            }
            Change::Set(set) => {
                let mut said = serde_json::Map::new();
                let mut put = |key: &str, value: Value| said.insert(key.to_owned(), value);
                if let Some(n) = set.max_iterations {
                    state.max_iterations = Some(n);
                    put("max_iterations", json!(n));
                }
                if let Some(n) = set.max_errors {
                    state.max_errors = Some(n);
                    put("max_errors", json!(n));
                }
                if let Some(usd) = set.max_cost_usd {
                    state.max_cost_usd = Some(usd);
                    put("max_cost_usd", json!(usd));
                }
                if let Some(n) = set.max_tokens {
                    state.max_tokens = Some(n);
                    put("max_tokens", json!(n));
                }
                if let Some(n) = set.parallel {
                    if n > 1 && self.git.is_none() {
                        return Err(
                            "parallel over 1 needs a loop on a git remote (`loopd create \
                                    --remote`): each task travels through it"
                                .into(),
                        );
                    }
                    state.parallel = Some(n);
                    put("parallel", json!(n));
                }
                if said.is_empty() {
                    return Err("nothing to set: give --max-iterations, --max-errors, \
                                --max-cost-usd, --max-tokens or --parallel"
                        .into());
                }
                json!({ "loop_id": id, "set": said })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use loopd_core::control::{Control, NewTask};
    use loopd_core::state::{Mode, SkillState, Status};

    use super::*;

    fn input(status: Status) -> LoopInput {
        let mut input = LoopInput::default();
        input.state.loop_id = "L".into();
        input.state.status = status;
        input.state.skill_state = Some(SkillState::default());
        input.limits.max_iterations = 10;
        input.limits.max_errors = 3;
        input
    }

    #[test]
    fn a_stop_is_the_file_drivers_stop() {
        let mut input = input(Status::Running);
        let said = input.change(&Change::Control(Control::Stop), "T").unwrap();
        assert_eq!(said["changed"], true);
        assert_eq!(input.state.status, Status::Failed);
        assert_eq!(
            input.state.failure_reason.as_deref(),
            Some(rules::STOPPED_BY_USER)
        );
    }

    #[test]
    fn tasks_are_numbered_past_every_task_the_loop_had() {
        let mut input = input(Status::Running);
        input.tasks.push(ListedTask {
            id: task_id(2),
            ..ListedTask::default()
        });
        let said = input
            .change(&Change::Task(NewTask::new(" more ", &[], &[])), "T")
            .unwrap();
        assert_eq!(said["task_id"], "task-003");
        assert_eq!(input.tasks[1].description, "more");
    }

    #[test]
    fn the_next_action_is_for_interactive_loops_only() {
        let mut input = input(Status::Running);
        let refused = input.change(&Change::Next("develop".into()), "T");
        assert!(refused.unwrap_err().contains("auto mode"));
        input.state.skill().mode = Mode::Interactive;
        assert!(input.change(&Change::Next("nonsense".into()), "T").is_err());
    }

    #[test]
    fn set_without_a_limit_is_refused() {
        let mut input = input(Status::Paused);
        assert!(
            input
                .change(&Change::Set(SetLimits::default()), "T")
                .is_err()
        );
        let set = SetLimits {
            max_iterations: Some(20),
            ..SetLimits::default()
        };
        input.change(&Change::Set(set), "T").unwrap();
        assert_eq!(input.state.max_iterations, Some(20));
    }

    #[test]
    fn tasks_at_once_need_a_loop_on_a_git_remote() {
        let mut input = input(Status::Running);
        let parallel = |n| {
            Change::Set(SetLimits {
                parallel: Some(n),
                ..SetLimits::default()
            })
        };
        let refused = input.change(&parallel(2), "T").unwrap_err();
        assert!(refused.contains("git remote"), "{refused}");
        input.change(&parallel(1), "T").unwrap();
        assert_eq!(input.state.parallel, Some(1));
        input.git = Some(crate::GitSource::default());
        input.change(&parallel(3), "T").unwrap();
        assert_eq!(input.state.parallel, Some(3));
    }
}
