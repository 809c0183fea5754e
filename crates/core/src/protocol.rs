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

/// How many candidate objects [`last_json_object`] parses at most: the scan stays linear in the
/// output's length, whatever an executor prints.
const MAX_OBJECT_ATTEMPTS: usize = 64;

/// The last top-level JSON object in some output, wherever it sits (alone on a line, inside a
/// fenced code block, after prose): of every balanced `{...}` that parses, the one that ends last.
///
/// One pass matches the braces (strings are tracked inside braces only: prose may hold quotes),
/// then the balanced spans are tried from the one that ends last, at most
/// `MAX_OBJECT_ATTEMPTS` of them: time linear in the output, however it nests.
pub fn last_json_object(bytes: &[u8]) -> Option<Value> {
    let text = String::from_utf8_lossy(bytes);
    let b = text.as_bytes();
    let mut open: Vec<usize> = Vec::new();
    // Balanced spans, in the order they close: by their end.
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let (mut in_string, mut escaped) = (false, false);
    for (i, &c) in b.iter().enumerate() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' if !open.is_empty() => in_string = true,
            b'{' => open.push(i),
            b'}' => {
                if let Some(start) = open.pop() {
                    spans.push((start, i));
                }
            }
            _ => {}
        }
    }
    spans
        .iter()
        .rev()
        .take(MAX_OBJECT_ATTEMPTS)
        .find_map(|&(start, end)| {
            serde_json::from_str::<Value>(&text[start..=end])
                .ok()
                .filter(Value::is_object)
        })
}
