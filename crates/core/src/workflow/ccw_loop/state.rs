//! ccw-loop's own fields of `skill_state`: the task list (`develop`), the debugging notes
//! (`debug`), the last validation (`validate`), the final `summary`, and the clocks its selection
//! rules read (`initialized_at`, `develop_failed_seq`). The engine never reads them; this
//! workflow reaches them through [`CcwState`], its typed view.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::state::ListedTask;
use crate::state::{Extra, WorkflowPart, part_of};

/// ccw-loop's part of `skill_state`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CcwState {
    #[serde(default)]
    pub develop: DevelopState,
    #[serde(default)]
    pub debug: DebugState,
    #[serde(default)]
    pub validate: ValidateState,
    #[serde(default)]
    pub summary: Option<Value>,
    /// When `init` finished ("planned"), even if it planned nothing.
    #[serde(default)]
    pub initialized_at: Option<String>,
    /// `seq` of the last develop that left a task failed.
    #[serde(default)]
    pub develop_failed_seq: Option<u64>,
}

impl CcwState {
    /// ccw-loop's fields among those of a `skill_state` object ([`part_of`]). Not generic: a crate
    /// above that reads them (the demo's agent) calls this rather than compile their
    /// deserializer again.
    pub fn from_fields(fields: &Extra) -> Result<CcwState, String> {
        part_of(fields)
    }
}

impl WorkflowPart for CcwState {
    const KEYS: &'static [&'static str] = &[
        "develop",
        "debug",
        "validate",
        "summary",
        "initialized_at",
        "develop_failed_seq",
    ];
}

/// How many hypotheses `skill_state.debug.hypotheses` keeps.
pub const HYPOTHESES_WINDOW: usize = 20;
/// How many test results `skill_state.validate.test_results` keeps.
pub const TEST_RESULTS_WINDOW: usize = 50;
/// How many names `skill_state.validate.failed_tests` keeps.
pub const FAILED_TESTS_WINDOW: usize = 50;
/// How many paths a task's `files_changed` keeps.
pub const FILES_CHANGED_WINDOW: usize = 50;
/// How many tasks `skill_state.develop.tasks` holds at most. A new task beyond it takes the place
/// of the oldest completed one; with none completed, it is refused.
pub const MAX_TASKS: usize = 200;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DevelopState {
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub completed: u64,
    #[serde(default)]
    pub current_task: Option<String>,
    #[serde(default)]
    pub tasks: Vec<DevelopTask>,
    #[serde(default)]
    pub last_progress_at: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The status of a develop task.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    #[default]
    Pending,
    InProgress,
    Completed,
    Failed,
}

impl TaskStatus {
    /// The status as a checkbox mark: `x` completed, `!` failed, `>` in progress, ` ` pending.
    pub fn mark(self) -> char {
        match self {
            TaskStatus::Completed => 'x',
            TaskStatus::Failed => '!',
            TaskStatus::InProgress => '>',
            TaskStatus::Pending => ' ',
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DevelopTask {
    pub id: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub tool: Option<String>,
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default)]
    pub status: TaskStatus,
    #[serde(default)]
    pub files_changed: Vec<String>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub completed_at: Option<String>,
    /// loopd's: the tasks it needs done first. Absent: its writer could not say (CCW's tasks),
    /// so it waits for every task before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Vec<String>>,
    /// loopd's: the executors that each try it in a tree of their own, the best result kept
    /// (`loopd task add --race`); empty: the loop's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub race: Vec<String>,
    /// loopd's: why its last result could not be merged into the loop's tree (developed at once
    /// with others, `parallel`); its next prompt says so. `null` once it completed: written as
    /// such, so that no writer takes the old reason for one it does not know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merge_conflict: Option<Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl DevelopTask {
    /// Why its last result could not be merged, while that stands.
    pub fn merge_conflict(&self) -> Option<&str> {
        self.merge_conflict.as_ref().and_then(Value::as_str)
    }

    /// Whether its needs are met in `tasks`, where it stands at `index`: the tasks it names are
    /// completed (a name of no task is no need), or, when it cannot say, every task before it.
    pub fn ready(&self, index: usize, tasks: &[DevelopTask]) -> bool {
        let done = |t: &DevelopTask| t.status == TaskStatus::Completed;
        match &self.after {
            Some(after) => tasks.iter().filter(|t| after.contains(&t.id)).all(done),
            None => tasks[..index].iter().all(done),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DebugState {
    #[serde(default)]
    pub active_bug: Option<String>,
    #[serde(default)]
    pub hypotheses_count: u64,
    /// The last [`HYPOTHESES_WINDOW`] hypotheses.
    #[serde(default)]
    pub hypotheses: Vec<Hypothesis>,
    #[serde(default)]
    pub confirmed_hypothesis: Option<String>,
    #[serde(default)]
    pub iteration: u64,
    #[serde(default)]
    pub last_analysis_at: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Hypothesis {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub testable_condition: String,
    #[serde(default)]
    pub logging_point: String,
    #[serde(default)]
    pub evidence_criteria: EvidenceCriteria,
    #[serde(default)]
    pub likelihood: u64,
    #[serde(default = "default_hypothesis_status")]
    pub status: String,
    #[serde(default)]
    pub evidence: Option<Value>,
    #[serde(default)]
    pub verdict_reason: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

fn default_hypothesis_status() -> String {
    "pending".to_owned()
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EvidenceCriteria {
    #[serde(default)]
    pub confirm: String,
    #[serde(default)]
    pub reject: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ValidateState {
    #[serde(default)]
    pub pass_rate: f64,
    #[serde(default)]
    pub coverage: f64,
    /// The last [`TEST_RESULTS_WINDOW`] results of the last run.
    #[serde(default)]
    pub test_results: Vec<TestResult>,
    #[serde(default)]
    pub passed: bool,
    /// At most [`FAILED_TESTS_WINDOW`] names from the last run.
    #[serde(default)]
    pub failed_tests: Vec<String>,
    #[serde(default)]
    pub last_run_at: Option<String>,
    /// Why the work tree was rolled back after this validation (`rollback_on_regression`), for
    /// the next prompts; cleared by the next validation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regression: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TestResult {
    #[serde(default)]
    pub test_name: String,
    #[serde(default)]
    pub suite: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub duration_ms: f64,
    #[serde(default)]
    pub error_message: Option<String>,
    #[serde(default)]
    pub stack_trace: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl DevelopTask {
    /// A task of the task list, pending (its `order` kept); made `now` where the list does not
    /// say when.
    pub fn listed(task: &ListedTask, now: Option<&str>) -> DevelopTask {
        let mut extra = Extra::default();
        if let Some(order) = &task.order {
            extra.insert("order".into(), order.clone());
        }
        DevelopTask {
            id: task.id.clone(),
            description: task.description.clone(),
            tool: task.tool.clone(),
            mode: task.mode.clone(),
            created_at: task.created_at.clone().or(now.map(str::to_owned)),
            after: task.after.clone(),
            race: task.race.clone(),
            extra,
            ..DevelopTask::default()
        }
    }
}

impl DevelopState {
    /// Recomputes `total` and `completed` from the task list.
    pub fn recount(&mut self) {
        self.total = self.tasks.len() as u64;
        self.completed = self
            .tasks
            .iter()
            .filter(|t| t.status == TaskStatus::Completed)
            .count() as u64;
    }

    /// The tasks as a Markdown checklist, one line each: `- [x] task-001: description`.
    pub fn checklist(&self) -> String {
        self.tasks
            .iter()
            .map(|t| format!("- [{}] {}: {}\n", t.status.mark(), t.id, t.description))
            .collect()
    }

    /// Adds a task within [`MAX_TASKS`]: at the limit the oldest completed task makes room;
    /// returns `false` (and adds nothing) when none can.
    pub fn add_task(&mut self, task: DevelopTask) -> bool {
        if self.tasks.len() >= MAX_TASKS {
            match self
                .tasks
                .iter()
                .position(|t| t.status == TaskStatus::Completed)
            {
                Some(done) => {
                    self.tasks.remove(done);
                }
                None => return false,
            }
        }
        self.tasks.push(task);
        true
    }

    pub fn task_mut(&mut self, id: &str) -> Option<&mut DevelopTask> {
        self.tasks.iter_mut().find(|t| t.id == id)
    }

    pub fn task(&self, id: &str) -> Option<&DevelopTask> {
        self.tasks.iter().find(|t| t.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_task_list_is_bounded_by_evicting_the_oldest_completed_task() {
        let task = |id: usize, status| DevelopTask {
            id: format!("task-{id:03}"),
            status,
            ..Default::default()
        };
        let mut develop = DevelopState::default();
        for i in 0..MAX_TASKS {
            let status = if i % 2 == 1 {
                TaskStatus::Completed
            } else {
                TaskStatus::Pending
            };
            assert!(develop.add_task(task(i, status)));
        }
        // Full: the oldest completed task (task-001) makes room; pending ones are never dropped.
        assert!(develop.add_task(task(MAX_TASKS, TaskStatus::Pending)));
        assert_eq!(develop.tasks.len(), MAX_TASKS);
        assert!(develop.task("task-001").is_none());
        assert!(develop.task("task-000").is_some());
        for t in &mut develop.tasks {
            t.status = TaskStatus::Pending;
        }
        assert!(!develop.add_task(task(MAX_TASKS + 1, TaskStatus::Pending)));
        assert_eq!(develop.tasks.len(), MAX_TASKS);
    }
}
