//! What Temporal's visibility store knows of each loop, so that loops are listed and searched
//! without asking each one: four search attributes the workflow keeps up to date.
//!
//! | attribute | type | value |
//! |---|---|---|
//! | `LoopdStatus` | Keyword | the loop's status (`running`, `paused`, `completed`, ...) |
//! | `LoopdWorkflow` | Keyword | its workflow (`ccw-loop`, `skill-tuning`) |
//! | `LoopdProject` | Keyword | its project root |
//! | `LoopdIteration` | Int | its iteration |
//!
//! `temporal workflow list --query "LoopdStatus = 'paused'"` finds the paused loops. A workflow
//! that sets an attribute its namespace does not know fails its task, so `loopd create` and
//! `loopd worker` register them first ([`register`]).

use std::collections::HashMap;

use anyhow::{Context as _, Result};
use loopd_core::state::LoopState;
use temporalio_common::protos::temporal::api::enums::v1::IndexedValueType;
use temporalio_common::protos::temporal::api::operatorservice::v1::{
    AddSearchAttributesRequest, ListSearchAttributesRequest,
};
use temporalio_common::search_attributes::{
    SearchAttributeKey, SearchAttributeUpdate, SearchAttributes,
};

use temporalio_client::tonic::{Code, Request};

use crate::LoopInput;
use crate::client::Client;
use crate::workflow::workflow_of;

pub const STATUS: SearchAttributeKey<String> = SearchAttributeKey::keyword("LoopdStatus");
pub const WORKFLOW: SearchAttributeKey<String> = SearchAttributeKey::keyword("LoopdWorkflow");
pub const PROJECT: SearchAttributeKey<String> = SearchAttributeKey::keyword("LoopdProject");
pub const ITERATION: SearchAttributeKey<i64> = SearchAttributeKey::int("LoopdIteration");

/// What changes as a loop goes: its status and iteration.
pub fn moving(state: &LoopState) -> (String, i64) {
    let iteration = i64::try_from(state.current_iteration).unwrap_or(i64::MAX);
    (state.status.as_str().to_owned(), iteration)
}

/// The updates that show `moving` values.
pub fn updates((status, iteration): (String, i64)) -> [SearchAttributeUpdate; 2] {
    [STATUS.value_set(status), ITERATION.value_set(iteration)]
}

/// Every attribute of a loop, as it starts.
pub fn of(input: &LoopInput) -> SearchAttributes {
    let [status, iteration] = updates(moving(&input.state));
    SearchAttributes::new([
        status,
        iteration,
        WORKFLOW.value_set(workflow_of(&input.state).name().to_owned()),
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
}

impl Listed {
    pub fn from(id: &str, attributes: &SearchAttributes) -> Listed {
        Listed {
            loop_id: id.to_owned(),
            status: attributes.get(&STATUS).unwrap_or_default(),
            workflow: attributes.get(&WORKFLOW).unwrap_or_default(),
            project: attributes.get(&PROJECT).unwrap_or_default(),
            iteration: attributes.get(&ITERATION).unwrap_or_default(),
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

/// Registers the attributes in `namespace` where they are missing.
pub async fn register(client: &Client, namespace: &str) -> Result<()> {
    let mut operator = client.connection().operator_service();
    let known = operator
        .list_search_attributes(Request::new(ListSearchAttributesRequest {
            namespace: namespace.to_owned(),
        }))
        .await
        .context("cannot list the namespace's search attributes")?
        .into_inner();
    let wanted = [
        (STATUS.name(), IndexedValueType::Keyword),
        (WORKFLOW.name(), IndexedValueType::Keyword),
        (PROJECT.name(), IndexedValueType::Keyword),
        (ITERATION.name(), IndexedValueType::Int),
    ];
    let missing: HashMap<String, i32> = wanted
        .into_iter()
        .filter(|(name, _)| !known.custom_attributes.contains_key(*name))
        .map(|(name, kind)| (name.to_owned(), kind as i32))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let names: Vec<&String> = missing.keys().collect();
    let names = format!("{names:?}");
    let added = operator
        .add_search_attributes(Request::new(AddSearchAttributesRequest {
            search_attributes: missing,
            namespace: namespace.to_owned(),
        }))
        .await;
    match added {
        // Another worker registered them meanwhile.
        Err(e) if e.code() == Code::AlreadyExists => return Ok(()),
        added => {
            added.with_context(|| format!("cannot register loopd's search attributes {names}"))?
        }
    };
    tracing::info!("registered the search attributes {names} in namespace {namespace}");
    Ok(())
}
