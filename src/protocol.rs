//! The executor's result, as CONTRACT §5 defines it: what an action reports back.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `status` of a result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResultStatus {
    Success,
    Failed,
    NeedsInput,
}

/// `{"status", "summary", "state_updates", "files_changed"}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ActionResult {
    pub status: ResultStatus,
    #[serde(default)]
    pub summary: String,
    #[serde(default)]
    pub state_updates: Map<String, Value>,
    #[serde(default)]
    pub files_changed: Vec<String>,
    /// With `needs_input`: what the executor asks a person; the loop waits for the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<String>,
}

impl ActionResult {
    /// The result of an executor that exited 0 without reporting anything.
    pub fn bare_success() -> ActionResult {
        ActionResult {
            status: ResultStatus::Success,
            summary: String::new(),
            state_updates: Map::new(),
            files_changed: Vec::new(),
            question: None,
        }
    }

    /// Parses a result object; a clear one-line reason when it does not fit the protocol.
    pub fn from_value(value: Value) -> Result<ActionResult, String> {
        serde_json::from_value(value).map_err(|e| format!("result does not fit the protocol: {e}"))
    }
}
