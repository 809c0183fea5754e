//! What Temporal's visibility store knows of each loop, so that loops are listed and searched
//! without asking each one: five search attributes the workflow keeps up to date.
//!
//! | attribute | type | value |
//! |---|---|---|
//! | `LoopdStatus` | Keyword | the loop's status (`running`, `paused`, `completed`, ...) |
//! | `LoopdWorkflow` | Keyword | its workflow (`ccw-loop`, `skill-tuning`) |
//! | `LoopdProject` | Keyword | its project root |
//! | `LoopdIteration` | Int | its iteration |
//! | `LoopdWorker` | Keyword | the worker that keeps its work tree (a loop on a git remote) |
//!
//! `temporal workflow list --query "LoopdStatus = 'paused'"` finds the paused loops. A workflow
//! that sets an attribute its namespace does not know fails its task, so `loopd create` and
//! `loopd worker` register them first ([`wanted`]).

use loopd_core::state::LoopState;
use temporalio_common::protos::temporal::api::enums::v1::IndexedValueType;
use temporalio_common::search_attributes::{
    SearchAttributeKey, SearchAttributeUpdate, SearchAttributes,
};

use crate::LoopInput;

pub const STATUS: SearchAttributeKey<String> = SearchAttributeKey::keyword("LoopdStatus");
pub const WORKFLOW: SearchAttributeKey<String> = SearchAttributeKey::keyword("LoopdWorkflow");
pub const PROJECT: SearchAttributeKey<String> = SearchAttributeKey::keyword("LoopdProject");
pub const ITERATION: SearchAttributeKey<i64> = SearchAttributeKey::int("LoopdIteration");
pub const WORKER: SearchAttributeKey<String> = SearchAttributeKey::keyword("LoopdWorker");

/// What changes as a loop goes: its status, iteration and worker.
pub fn moving(input: &LoopInput) -> (String, i64, String) {
    let state = &input.state;
    let iteration = i64::try_from(state.current_iteration).unwrap_or(i64::MAX);
    let worker = input.holder.as_ref().map(|h| h.name.clone());
    (
        state.status.as_str().to_owned(),
        iteration,
        worker.unwrap_or_default(),
    )
}

/// The updates that show `moving` values.
pub fn updates((status, iteration, worker): (String, i64, String)) -> [SearchAttributeUpdate; 3] {
    [
        STATUS.value_set(status),
        ITERATION.value_set(iteration),
        WORKER.value_set(worker),
    ]
}

/// Every attribute of a loop, as it starts.
pub fn of(input: &LoopInput) -> SearchAttributes {
    let [status, iteration, worker] = updates(moving(input));
    SearchAttributes::new([
        status,
        iteration,
        worker,
        WORKFLOW.value_set(loopd_core::workflow::of(&input.state).name().to_owned()),
        PROJECT.value_set(input.root.display().to_string()),
    ])
}

/// One loop as the visibility store lists it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Listed {
    pub loop_id: String,
    pub status: String,
    pub workflow: String,
    pub project: String,
    pub iteration: i64,
    /// The worker that keeps the loop's work tree (empty if none).
    pub worker: String,
}

impl Listed {
    pub fn from(id: &str, attributes: &SearchAttributes) -> Listed {
        Listed {
            loop_id: id.to_owned(),
            status: attributes.get(&STATUS).unwrap_or_default(),
            workflow: attributes.get(&WORKFLOW).unwrap_or_default(),
            project: attributes.get(&PROJECT).unwrap_or_default(),
            iteration: attributes.get(&ITERATION).unwrap_or_default(),
            worker: attributes.get(&WORKER).unwrap_or_default(),
        }
    }
}

impl Listed {
    /// The loop's project root and what its state is known to be: its status and iteration.
    pub fn as_held(&self) -> (std::path::PathBuf, LoopState) {
        let status = serde_json::from_value(serde_json::json!(self.status)).unwrap_or_default();
        let state = LoopState {
            loop_id: self.loop_id.clone(),
            status,
            current_iteration: u64::try_from(self.iteration).unwrap_or(0),
            ..LoopState::default()
        };
        (self.project.clone().into(), state)
    }
}

/// The attributes and their types, as a namespace registers them
/// ([`crate::client`] registers those it is missing).
pub fn wanted() -> [(&'static str, IndexedValueType); 5] {
    [
        (STATUS.name(), IndexedValueType::Keyword),
        (WORKFLOW.name(), IndexedValueType::Keyword),
        (PROJECT.name(), IndexedValueType::Keyword),
        (ITERATION.name(), IndexedValueType::Int),
        (WORKER.name(), IndexedValueType::Keyword),
    ]
}
