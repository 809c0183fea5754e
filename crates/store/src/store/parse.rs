//! What a state file holds, read: a loop's id, checked or made, and the file's bytes parsed into
//! its raw object (what is written back) and its typed view, refused when unusable.

use std::path::Path;

use loopd_core::state::LoopState;
use serde::Deserialize as _;
use serde_json::{Map, Value};

use super::StoreError;

pub fn validate_id(id: &str) -> Result<(), StoreError> {
    if loopd_core::state::is_loop_id(id) {
        Ok(())
    } else {
        Err(StoreError::BadId(id.to_owned()))
    }
}

/// A new id: `loop-v2-YYYYMMDDTHHMMSS-xxxxxxxx` (UTC, 8 hex digits).
pub fn new_id() -> String {
    format!(
        "loop-v2-{}-{:08x}",
        chrono::Utc::now().format("%Y%m%dT%H%M%S"),
        fastrand::u32(..)
    )
}

/// A state file read from disk: the raw JSON object (what gets written back) and its typed view.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub raw: Map<String, Value>,
    pub state: LoopState,
}

impl Loaded {
    pub(super) fn parse(path: &Path, bytes: &[u8]) -> Result<Loaded, String> {
        let raw = parse_object(bytes)?;
        let state = typed(path, &raw)?;
        Ok(Loaded { raw, state })
    }
}

/// The JSON object of a state file's bytes.
pub(super) fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice(bytes).map_err(|e| e.to_string())? {
        Value::Object(raw) => Ok(raw),
        _ => Err("not a JSON object".to_owned()),
    }
}

/// The typed view of a state file's object, refused when it is unusable (see
/// [`loopd_core::workflow::problems`]).
fn typed(path: &Path, raw: &Map<String, Value>) -> Result<LoopState, String> {
    let state = LoopState::deserialize(raw).map_err(|e| e.to_string())?;
    let id = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".json"));
    match loopd_core::workflow::problems(&state, id)
        .into_iter()
        .next()
    {
        Some(problem) => Err(problem),
        None => Ok(state),
    }
}

/// The typed view of a state file's bytes (see [`typed`]).
pub(super) fn parse_state(path: &Path, bytes: &[u8]) -> Result<LoopState, String> {
    typed(path, &parse_object(bytes)?)
}
