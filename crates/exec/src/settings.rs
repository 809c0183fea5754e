//! How an executor is run, as the config says: where its prompt goes, how its result is read
//! from its output, and how long and how loud it may be.

use std::time::Duration;

use serde::Deserialize;

/// How the prompt reaches the executor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptMode {
    #[default]
    Stdin,
    Arg,
    File,
}

/// How a result is read from the executor's output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// The last JSON object printed.
    #[default]
    Json,
    /// The exit code alone.
    Text,
    /// A test command: exit 0 passed, else not passed; counts from the runner's summary.
    Test,
    /// Claude Code's (and Qwen Code's) `--output-format stream-json`.
    ClaudeStreamJson,
    /// Codex's `exec --json` events.
    CodexJsonl,
    /// Gemini CLI's `--output-format json` (or `stream-json`).
    GeminiJson,
}

impl Format {
    /// The name the config uses.
    pub fn name(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Text => "text",
            Format::Test => "test",
            Format::ClaudeStreamJson => "claude-stream-json",
            Format::CodexJsonl => "codex-jsonl",
            Format::GeminiJson => "gemini-json",
        }
    }
}

/// Supervision limits of one attempt, resolved.
#[derive(Clone, Copy, Debug)]
pub struct Supervision {
    pub timeout: Duration,
    pub idle_timeout: Duration,
    pub kill_grace: Duration,
    pub output_cap: u64,
    /// How long an agent may linger after its final event.
    pub final_grace: Duration,
}
