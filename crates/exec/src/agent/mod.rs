//! Agent output formats: Claude Code's `stream-json` (also Qwen Code's), Codex's `exec --json`
//! JSONL, and Gemini CLI's `--output-format json`.
//!
//! Theory of operation: an [`AgentStream`] is fed the agent's stdout as it arrives. It keeps only
//! what matters — the last message the agent wrote, token usage and cost so far, structured
//! errors, and the final event — never the whole transcript, so memory stays bounded however much
//! the agent prints. Seeing the final event is a [`Signal::Final`]: the executor then gives the
//! agent a short grace to exit and ends its process tree (agents are known to linger). When the
//! run is over, [`AgentStream::classify`] puts the attempt into the one taxonomy of
//! [`AttemptOutcome`], deciding from the final event first, then from structured errors, then
//! from the exit code.

use chrono::{DateTime, Utc};
use loopd_core::attempt::AttemptOutcome;
use loopd_core::state::Usage;
use serde_json::Value;

use crate::settings::Format;

mod classify;

pub use classify::{classify_error_text, last_meaningful_line, reset_time, with_reason};
use classify::{classify_status, http_status};

/// What a chunk of output told the executor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Continue,
    /// The agent's final event: it has nothing more to say.
    Final,
    /// Nothing but the agent saying it retries or reconnects: no progress, so the idle timer
    /// keeps running (Codex reconnects without end when its model is unreachable).
    Noise,
}

impl Signal {
    /// Progress wins over noise.
    fn max_progress(self) -> Signal {
        match self {
            Signal::Noise => Signal::Continue,
            other => other,
        }
    }
}

/// An API request the agent retries on its own, as it announced it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Retry {
    pub attempt: Option<u64>,
    pub max_retries: Option<u64>,
    /// The HTTP status that failed, when the agent says.
    pub status: Option<i64>,
    pub delay_ms: Option<u64>,
    pub error: Option<String>,
}

/// What an agent's stream tells while the attempt runs.
#[derive(Clone, Debug, PartialEq)]
pub enum Told {
    /// It retries an API request on its own.
    Retry(Retry),
    /// What it has spent so far, when that changed: tokens, and dollars where it says.
    Spent { tokens: u64, cost_usd: Option<f64> },
}

/// The final event, reduced.
#[derive(Clone, Debug, PartialEq)]
struct FinalEvent {
    outcome: AttemptOutcome,
    /// The error text, for a final event that is not a success.
    error: Option<String>,
}

/// Longest line kept while waiting for its end; a longer one is skipped.
const MAX_LINE: usize = 4 << 20;

/// The agent's output, read as it comes.
#[derive(Clone, Debug)]
pub struct AgentStream {
    format: Format,
    line: Vec<u8>,
    skipping_long_line: bool,
    /// The last text the agent addressed to its user.
    pub last_message: Option<String>,
    /// Tokens so far (for formats that report them as they go) or in all (after the final event).
    pub usage: Usage,
    pub cost_usd: Option<f64>,
    final_event: Option<FinalEvent>,
    /// The last structured error seen before any final event.
    error: Option<String>,
    /// When a rate limit resets, if the agent said.
    pub reset_at: Option<DateTime<Utc>>,
    /// The kind of API error the agent's stream named, if any (Claude Code's
    /// `"error": "authentication_failed"`).
    error_kind: Option<String>,
    /// Retries announced since the executor last took them.
    retries: Vec<Retry>,
    /// The delay of the agent's last retry of a rate limit: the server's `retry-after`, which
    /// stands for the reset time when the agent gives up without one.
    retry_after: Option<chrono::TimeDelta>,
}

impl AgentStream {
    /// A stream for `format`, or `None` for the formats that are not an agent's.
    pub fn for_format(format: Format) -> Option<AgentStream> {
        matches!(
            format,
            Format::ClaudeStreamJson | Format::CodexJsonl | Format::GeminiJson
        )
        .then(|| AgentStream {
            format,
            line: Vec::new(),
            skipping_long_line: false,
            last_message: None,
            usage: Usage::default(),
            cost_usd: None,
            final_event: None,
            error: None,
            reset_at: None,
            error_kind: None,
            retries: Vec::new(),
            retry_after: None,
        })
    }

    /// Feeds a chunk of stdout; returns [`Signal::Final`] once the final event has been read,
    /// [`Signal::Noise`] for a chunk of nothing but retry notices.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Signal {
        let mut signal = Signal::Noise;
        while let Some(nl) = chunk.iter().position(|b| *b == b'\n') {
            if !self.skipping_long_line {
                self.line.extend_from_slice(&chunk[..nl]);
                let line = std::mem::take(&mut self.line);
                signal = match (self.line_done(&line), signal) {
                    (Signal::Final, _) | (_, Signal::Final) => Signal::Final,
                    (Signal::Noise, Signal::Noise) => Signal::Noise,
                    _ => Signal::Continue,
                };
            } else {
                signal = signal.max_progress();
            }
            self.skipping_long_line = false;
            chunk = &chunk[nl + 1..];
        }
        if !chunk.is_empty() {
            // A line still being written counts as progress.
            signal = signal.max_progress();
        }
        if !self.skipping_long_line {
            self.line.extend_from_slice(chunk);
            if self.line.len() > MAX_LINE {
                self.line.clear();
                self.skipping_long_line = true;
            }
        }
        signal
    }

    /// The retries the agent announced since the last call.
    pub fn take_retries(&mut self) -> Vec<Retry> {
        std::mem::take(&mut self.retries)
    }

    /// Reads what is left once the agent's output has ended. `stdout` is the end of its stdout and
    /// `output` of its stdout and stderr together: Gemini CLI prints one object at the end, on
    /// stdout, or on stderr when it fails.
    pub fn finish(&mut self, stdout: &[u8], output: &[u8]) {
        let line = std::mem::take(&mut self.line);
        self.line_done(&line);
        if self.format == Format::GeminiJson && self.final_event.is_none() {
            let object = loopd_core::protocol::last_json_object(stdout)
                .or_else(|| loopd_core::protocol::last_json_object(output));
            if let Some(v) = object {
                self.gemini_object(&v);
            }
        }
    }

    /// Whether the final event has been seen.
    pub fn is_final(&self) -> bool {
        self.final_event.is_some()
    }

    fn line_done(&mut self, line: &[u8]) -> Signal {
        let trimmed = line.trim_ascii();
        if !trimmed.starts_with(b"{") {
            return Signal::Continue;
        }
        let Ok(event) = serde_json::from_slice::<Value>(trimmed) else {
            return Signal::Continue;
        };
        let was_final = self.final_event.is_some();
        let noise = match self.format {
            Format::ClaudeStreamJson => self.claude_event(&event),
            Format::CodexJsonl => self.codex_event(&event),
            Format::GeminiJson => {
                self.gemini_event(&event);
                false
            }
            _ => false,
        };
        if !was_final && self.final_event.is_some() {
            Signal::Final
        } else if noise {
            Signal::Noise
        } else {
            Signal::Continue
        }
    }

    /// Claude Code (and Qwen Code) `stream-json`: `system`, `assistant`, `user`, then `result`.
    /// Returns whether the event is only a retry notice.
    fn claude_event(&mut self, event: &Value) -> bool {
        match event["type"].as_str() {
            Some("system") if event["subtype"] == "api_retry" => {
                let status = event["error_status"].as_i64();
                let delay_ms = event["retry_delay_ms"].as_u64();
                if status == Some(429)
                    && let Some(ms) = delay_ms
                {
                    self.retry_after =
                        chrono::TimeDelta::try_milliseconds(i64::try_from(ms).unwrap_or(i64::MAX));
                }
                self.retries.push(Retry {
                    attempt: event["attempt"].as_u64(),
                    max_retries: event["max_retries"].as_u64(),
                    status,
                    delay_ms,
                    error: event["error"].as_str().map(str::to_owned),
                });
                return true;
            }
            Some("rate_limit_event") => {
                let info = &event["rate_limit_info"];
                if info["status"] == "rejected"
                    && let Some(at) = info["resetsAt"].as_i64()
                {
                    // Seconds in observed output; milliseconds in one description of it.
                    let secs = if at > 1_000_000_000_000 {
                        at / 1000
                    } else {
                        at
                    };
                    self.reset_at = DateTime::<Utc>::from_timestamp(secs, 0);
                }
            }
            Some("assistant") => {
                // An API failure comes as a synthetic assistant message with an `error` kind
                // ("authentication_failed", "rate_limit", ...) before the result.
                if let Some(kind) = event["error"].as_str() {
                    self.error_kind = Some(kind.to_owned());
                }
                let message = &event["message"];
                if let Some(text) = text_blocks(&message["content"]) {
                    self.last_message = Some(text);
                }
                // Running total while the agent works; the result event has the real one.
                if let Some(usage) = claude_usage(&message["usage"]) {
                    self.usage.add(&usage);
                }
            }
            Some("result") => {
                if let Some(usage) = claude_usage(&event["usage"]) {
                    self.usage = usage;
                }
                // `usage` leaves out side requests (titles, summaries) that `modelUsage`, like
                // `total_cost_usd`, includes: a budget sees the larger, true figure.
                if let Some(all) = claude_model_usage(&event["modelUsage"])
                    && all.total() > self.usage.total()
                {
                    self.usage = all;
                }
                self.cost_usd = event["total_cost_usd"]
                    .as_f64()
                    .or_else(|| event["cost_usd"].as_f64())
                    .or(self.cost_usd);
                let errors = event["errors"].as_array().map(|e| {
                    e.iter()
                        .filter_map(error_text)
                        .collect::<Vec<_>>()
                        .join("; ")
                });
                let text = event["result"]
                    .as_str()
                    .map(str::to_owned)
                    .or_else(|| error_text(&event["error"]))
                    .or(errors.filter(|e| !e.is_empty()));
                let subtype = event["subtype"].as_str().unwrap_or("");
                // `subtype: success` can come with `is_error: true`; Qwen Code has reported API
                // errors as a success whose text starts with "[API Error".
                let is_error = event["is_error"].as_bool().unwrap_or(false)
                    || subtype != "success"
                    || text.as_deref().is_some_and(|t| t.starts_with("[API Error"));
                let status = event["api_error_status"].as_i64();
                let outcome = match (subtype, status) {
                    ("error_max_turns", _) => AttemptOutcome::MaxTurns,
                    _ if event["terminal_reason"] == "max_turns" => AttemptOutcome::MaxTurns,
                    (s, _) if s.contains("budget") => AttemptOutcome::BudgetExceeded,
                    _ if !is_error => AttemptOutcome::Success,
                    (_, Some(code)) => classify_status(code, text.as_deref().unwrap_or(subtype)),
                    _ if self.error_kind.as_deref() == Some("authentication_failed") => {
                        AttemptOutcome::EnvironmentError
                    }
                    _ => classify_error_text(text.as_deref().unwrap_or(subtype)),
                };
                if outcome == AttemptOutcome::Success {
                    if let Some(t) = text.filter(|t| !t.trim().is_empty()) {
                        self.last_message = Some(t);
                    }
                    self.final_event = Some(FinalEvent {
                        outcome,
                        error: None,
                    });
                } else {
                    let error = text
                        .filter(|t| !t.is_empty())
                        .unwrap_or_else(|| subtype.to_owned());
                    self.note_reset(&error, event);
                    if outcome == AttemptOutcome::RateLimited && self.reset_at.is_none() {
                        // The server's retry-after, as the agent's last retry honoured it.
                        self.reset_at = self.retry_after.map(|d| Utc::now() + d);
                    }
                    self.final_event = Some(FinalEvent {
                        outcome,
                        error: Some(error),
                    });
                }
            }
            _ => {}
        }
        false
    }

    /// Codex `exec --json`: `thread.started`, `turn.started`, `item.*`, then `turn.completed` or
    /// `turn.failed`; `error` events on the way. Also the older `{"msg": {...}}` events.
    /// Returns whether the event is only a reconnect notice.
    fn codex_event(&mut self, event: &Value) -> bool {
        let msg = &event["msg"];
        let (kind, body) = match event["type"].as_str() {
            Some(kind) => (kind, event),
            None => (msg["type"].as_str().unwrap_or(""), msg),
        };
        match kind {
            "item.completed" => {
                let item = &body["item"];
                let is_message = matches!(
                    item["type"].as_str(),
                    Some("agent_message" | "assistant_message")
                );
                if is_message && let Some(text) = item["text"].as_str() {
                    self.last_message = Some(text.to_owned());
                }
            }
            "agent_message" => {
                if let Some(text) = body["message"].as_str() {
                    self.last_message = Some(text.to_owned());
                }
            }
            "turn.completed" => {
                if let Some(usage) = codex_usage(&body["usage"]) {
                    self.usage.add(&usage);
                }
                self.final_event = Some(FinalEvent {
                    outcome: AttemptOutcome::Success,
                    error: None,
                });
            }
            "token_count" => {
                let info = &body["info"]["total_token_usage"];
                if let Some(usage) = codex_usage(if info.is_null() { body } else { info }) {
                    self.usage = usage;
                }
            }
            "task_complete" => {
                if let Some(text) = body["last_agent_message"].as_str() {
                    self.last_message = Some(text.to_owned());
                }
                self.final_event = Some(FinalEvent {
                    outcome: AttemptOutcome::Success,
                    error: None,
                });
            }
            "turn.failed" => {
                let error = error_text(&body["error"]).unwrap_or_else(|| "turn failed".into());
                self.note_reset(&error, body);
                self.final_event = Some(FinalEvent {
                    outcome: classify_error_text(&error),
                    error: Some(error),
                });
            }
            "error" | "stream_error" => {
                let Some(error) = error_text(body) else {
                    return false;
                };
                // "Reconnecting... 2/5 (stream disconnected before completion: ...)": Codex
                // retrying on its own, which says nothing new about the attempt.
                if let Some(rest) = error.strip_prefix("Reconnecting...") {
                    let (attempt, max_retries) = rest
                        .trim_start()
                        .split_once(' ')
                        .map_or(rest.trim(), |(n, _)| n)
                        .split_once('/')
                        .map_or((None, None), |(a, m)| (a.parse().ok(), m.parse().ok()));
                    self.retries.push(Retry {
                        attempt,
                        max_retries,
                        status: http_status(&error.to_ascii_lowercase()).map(i64::from),
                        delay_ms: None,
                        error: Some(error.clone()),
                    });
                    self.error = Some(error);
                    return true;
                }
                self.note_reset(&error, body);
                self.error = Some(error);
            }
            _ => {}
        }
        false
    }

    /// Gemini CLI: one JSON object at the end (`--output-format json`); `stream-json` events
    /// (`message`, `result`) are understood too.
    fn gemini_event(&mut self, event: &Value) {
        match event["type"].as_str() {
            Some("message") if event["role"] == "assistant" => {
                if let Some(text) = event["content"].as_str() {
                    let delta = event["delta"].as_bool().unwrap_or(false);
                    match (&mut self.last_message, delta) {
                        (Some(m), true) => m.push_str(text),
                        _ => self.last_message = Some(text.to_owned()),
                    }
                }
            }
            Some("result") => {
                if let Some(usage) = gemini_usage(&event["stats"]) {
                    self.usage = usage;
                }
                let failed = event["status"].as_str().is_some_and(|s| s != "success");
                let error = error_text(&event["error"]);
                self.final_event = Some(match (failed || error.is_some(), error) {
                    (false, _) => FinalEvent {
                        outcome: AttemptOutcome::Success,
                        error: None,
                    },
                    (true, error) => {
                        let error = error.unwrap_or_else(|| "the agent reported an error".into());
                        self.note_reset(&error, &event["error"]);
                        FinalEvent {
                            outcome: classify_error_text(&error),
                            error: Some(error),
                        }
                    }
                });
            }
            Some("error") => {
                if let Some(error) = error_text(event) {
                    self.note_reset(&error, event);
                    self.error = Some(error);
                }
            }
            None if event.get("response").is_some() || event.get("error").is_some() => {
                self.gemini_object(event);
            }
            _ => {}
        }
    }

    /// `{"response", "stats", "error"}`.
    fn gemini_object(&mut self, v: &Value) {
        if let Some(usage) = gemini_usage(&v["stats"]) {
            self.usage = usage;
        }
        if let Some(text) = v["response"].as_str() {
            self.last_message = Some(text.to_owned());
        }
        let error = error_text(&v["error"]);
        self.final_event = Some(match error {
            None => FinalEvent {
                outcome: AttemptOutcome::Success,
                error: None,
            },
            Some(error) => {
                self.note_reset(&error, &v["error"]);
                let outcome = match v["error"]["code"].as_i64() {
                    // Gemini CLI's exit codes: 41 authentication, 53 turn limit.
                    Some(41) => AttemptOutcome::EnvironmentError,
                    Some(53) => AttemptOutcome::MaxTurns,
                    Some(code @ 400..=599) => classify_status(code, &error),
                    _ => classify_error_text(&error),
                };
                FinalEvent {
                    outcome,
                    error: Some(error),
                }
            }
        });
    }

    fn note_reset(&mut self, text: &str, event: &Value) {
        if self.reset_at.is_none() {
            self.reset_at = reset_time(text, event, Utc::now());
        }
    }

    /// The attempt's outcome and, if it failed, why: from the final event, else a structured
    /// error, else the exit code (`None` when a signal ended the agent) with the last meaningful
    /// line of its output (`output`: the end of stdout and stderr together).
    pub fn classify(
        &self,
        exit_code: Option<i32>,
        output: &[u8],
    ) -> (AttemptOutcome, Option<String>) {
        if let Some(f) = &self.final_event {
            return (f.outcome, f.error.clone());
        }
        // An error event alone is no failure (agents retry); with a failed exit, it says why.
        if let Some(error) = &self.error
            && exit_code != Some(0)
        {
            return (classify_error_text(error), Some(error.clone()));
        }
        let said = last_meaningful_line(output);
        let because = |what: String| with_reason(what, said.as_deref());
        match exit_code {
            Some(0) => (
                AttemptOutcome::NoResult,
                Some("the agent exited without a final message".into()),
            ),
            // Gemini CLI: authentication; and the shell's "not executable", "command not found".
            Some(41 | 126 | 127) => (
                AttemptOutcome::EnvironmentError,
                Some(because(format!("exit code {}", exit_code.unwrap_or(0)))),
            ),
            // Gemini CLI and Qwen Code: turn limit.
            Some(53) => (
                AttemptOutcome::MaxTurns,
                Some(because("turn limit reached (exit 53)".into())),
            ),
            Some(code) => {
                let outcome = match (&said, code) {
                    (Some(line), _) if classify_error_text(line) != AttemptOutcome::AgentError => {
                        classify_error_text(line)
                    }
                    // Exit 55: Qwen Code's session budget (Gemini CLI 0.61 uses it for an
                    // untrusted folder, which its message says and the line above catches).
                    (_, 55) => AttemptOutcome::BudgetExceeded,
                    _ => AttemptOutcome::AgentError,
                };
                (outcome, Some(because(format!("exit code {code}"))))
            }
            None => (AttemptOutcome::Killed, Some("ended by a signal".into())),
        }
    }
}

/// The text blocks of a Claude message's `content`, joined.
fn text_blocks(content: &Value) -> Option<String> {
    let blocks = content.as_array()?;
    let text: Vec<&str> = blocks
        .iter()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect();
    (!text.is_empty()).then(|| text.join("\n"))
}

fn claude_usage(u: &Value) -> Option<Usage> {
    u.is_object().then(|| Usage {
        input_tokens: u["input_tokens"].as_u64().unwrap_or(0),
        output_tokens: u["output_tokens"].as_u64().unwrap_or(0),
        cache_read_tokens: u["cache_read_input_tokens"].as_u64().unwrap_or(0),
        cache_write_tokens: u["cache_creation_input_tokens"].as_u64().unwrap_or(0),
    })
}

/// Claude Code's `modelUsage`: `{model: {inputTokens, outputTokens, cacheReadInputTokens,
/// cacheCreationInputTokens, ...}}`, summed over models.
fn claude_model_usage(models: &Value) -> Option<Usage> {
    let models = models.as_object().filter(|m| !m.is_empty())?;
    let mut usage = Usage::default();
    for m in models.values() {
        let n = |k: &str| m[k].as_u64().unwrap_or(0);
        usage.add(&Usage {
            input_tokens: n("inputTokens"),
            output_tokens: n("outputTokens"),
            cache_read_tokens: n("cacheReadInputTokens"),
            cache_write_tokens: n("cacheCreationInputTokens"),
        });
    }
    Some(usage)
}

fn codex_usage(u: &Value) -> Option<Usage> {
    if !u.is_object() || u.get("input_tokens").is_none() {
        return None;
    }
    let cached = u["cached_input_tokens"].as_u64().unwrap_or(0);
    Some(Usage {
        // Codex counts cached tokens inside input_tokens.
        input_tokens: u["input_tokens"]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(cached),
        // Output tokens already include `reasoning_output_tokens`.
        output_tokens: u["output_tokens"].as_u64().unwrap_or(0),
        cache_read_tokens: cached,
        cache_write_tokens: 0,
    })
}

/// `stats.models.<name>.tokens` summed over models.
fn gemini_usage(stats: &Value) -> Option<Usage> {
    let models = stats["models"].as_object()?;
    let mut usage = Usage::default();
    for model in models.values() {
        let t = &model["tokens"];
        let cached = t["cached"].as_u64().unwrap_or(0);
        usage.add(&Usage {
            input_tokens: t["prompt"].as_u64().unwrap_or(0).saturating_sub(cached),
            cache_read_tokens: cached,
            output_tokens: t["candidates"]
                .as_u64()
                .unwrap_or(0)
                .saturating_add(t["thoughts"].as_u64().unwrap_or(0)),
            cache_write_tokens: 0,
        });
    }
    Some(usage)
}

/// An error's message, whether it is a string or `{"message": ...}`.
fn error_text(v: &Value) -> Option<String> {
    match v {
        // An API error body passed on as a string (Gemini CLI does): its message.
        Value::String(s) if s.trim_start().starts_with('{') => {
            match serde_json::from_str::<Value>(s) {
                Ok(inner @ Value::Object(_)) => error_text(&inner).or_else(|| Some(s.clone())),
                _ => Some(s.clone()),
            }
        }
        Value::String(s) => Some(s.clone()),
        Value::Object(_) => error_text(&v["message"]).or_else(|| {
            (!v["error"].is_null())
                .then(|| error_text(&v["error"]))
                .flatten()
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_notices_are_noise_and_retries_are_reported() {
        let mut codex = AgentStream::for_format(Format::CodexJsonl).unwrap();
        let line = b"{\"type\":\"error\",\"message\":\"Reconnecting... 2/5 (stream disconnected before completion: error sending request)\"}\n";
        assert_eq!(codex.feed(line), Signal::Noise);
        let retry = codex.take_retries().remove(0);
        assert_eq!((retry.attempt, retry.max_retries), (Some(2), Some(5)));
        assert!(codex.take_retries().is_empty());
        // Anything else is progress, even in the same chunk.
        let mixed = [&line[..], b"{\"type\":\"turn.started\"}\n"].concat();
        assert_eq!(codex.feed(&mixed), Signal::Continue);
        // Given up: the network error, not a timeout.
        assert_eq!(
            codex.classify(Some(1), b"").0,
            AttemptOutcome::TransientApiError
        );

        // Claude Code 2.1.197's announcement of its own retry (captured).
        let mut claude = AgentStream::for_format(Format::ClaudeStreamJson).unwrap();
        let line = b"{\"type\":\"system\",\"subtype\":\"api_retry\",\"attempt\":1,\"max_retries\":1,\"retry_delay_ms\":1000,\"error_status\":429,\"error\":\"rate_limit\"}\n";
        assert_eq!(claude.feed(line), Signal::Noise);
        assert_eq!(
            claude.take_retries(),
            vec![Retry {
                attempt: Some(1),
                max_retries: Some(1),
                status: Some(429),
                delay_ms: Some(1000),
                error: Some("rate_limit".into()),
            }]
        );
        // When it gives up, the retry's delay stands for the reset time.
        let result = b"{\"type\":\"result\",\"subtype\":\"success\",\"is_error\":true,\"api_error_status\":429,\"result\":\"API Error: Request rejected (429)\"}\n";
        claude.feed(result);
        assert_eq!(claude.classify(Some(1), b"").0, AttemptOutcome::RateLimited);
        let wait = claude.reset_at.unwrap() - Utc::now();
        assert!(
            wait <= chrono::TimeDelta::seconds(1) && wait > chrono::TimeDelta::zero(),
            "{wait}"
        );
    }

    #[test]
    fn numbers_count_as_statuses_only_where_statuses_stand() {
        use AttemptOutcome as O;
        for (text, outcome) in [
            // Codex's 401 against a server on port 14290: a wrong key, not a rate limit.
            (
                "unexpected status 401 Unauthorized: invalid key, url: http://127.0.0.1:14290/v1/responses",
                O::EnvironmentError,
            ),
            (
                "request failed, url http://127.0.0.1:14290/x",
                O::AgentError,
            ),
            ("wrote 429 bytes to out.txt", O::AgentError),
            ("HTTP 429 Too Many Requests", O::RateLimited),
            ("request failed (429)", O::RateLimited),
            ("status: 503", O::TransientApiError),
            ("API Error: 500 status code (no body)", O::TransientApiError),
            ("API Error: 529 Overloaded", O::TransientApiError),
            ("[API Error: 401 invalid x-api-key]", O::EnvironmentError),
            (
                "error code 404: model gpt-9 does not exist",
                O::EnvironmentError,
            ),
            ("Not logged in · Please run /login", O::EnvironmentError),
            (
                "No auth type is selected. Please configure an auth type",
                O::EnvironmentError,
            ),
            (
                "error: unexpected argument '--skip-trust' found",
                O::EnvironmentError,
            ),
            (
                "We're currently experiencing high demand, which may cause temporary errors.",
                O::TransientApiError,
            ),
            ("You've hit your usage limit", O::RateLimited),
        ] {
            assert_eq!(classify_error_text(text), outcome, "{text}");
        }
    }

    #[test]
    fn without_a_final_event_the_reason_is_the_last_line_the_agent_printed() {
        let s = AgentStream::for_format(Format::ClaudeStreamJson).unwrap();
        let output = b"some progress\n--dangerously-skip-permissions cannot be used with root/sudo privileges for security reasons\n\n";
        let (outcome, message) = s.classify(Some(1), output);
        assert_eq!(outcome, AttemptOutcome::EnvironmentError);
        assert_eq!(
            message.unwrap(),
            "exit code 1: --dangerously-skip-permissions cannot be used with root/sudo privileges for security reasons"
        );
        // Gemini CLI 0.61's exit 55 is an untrusted folder, in red, not a budget.
        let g = AgentStream::for_format(Format::GeminiJson).unwrap();
        let output = b"\x1b[31mGemini CLI is not running in a trusted directory. To proceed, use `--skip-trust`\x1b[0m\n";
        let (outcome, message) = g.classify(Some(55), output);
        assert_eq!(outcome, AttemptOutcome::EnvironmentError);
        assert!(
            message
                .unwrap()
                .starts_with("exit code 55: Gemini CLI is not running")
        );
        assert_eq!(g.classify(Some(55), b"").0, AttemptOutcome::BudgetExceeded);
    }

    fn stream(format: Format, text: &str) -> AgentStream {
        let mut s = AgentStream::for_format(format).unwrap();
        // Fed in awkward pieces, as a pipe delivers them.
        for chunk in text.as_bytes().chunks(7) {
            s.feed(chunk);
        }
        s.finish(text.as_bytes(), text.as_bytes());
        s
    }

    #[test]
    fn claude_success_with_usage_and_cost() {
        let s = stream(
            Format::ClaudeStreamJson,
            concat!(
                r#"{"type":"system","subtype":"init","session_id":"x"}"#,
                "\n",
                r#"{"type":"assistant","message":{"content":[{"type":"text","text":"working"}],"usage":{"input_tokens":5,"output_tokens":2}}}"#,
                "\n",
                r#"{"type":"result","subtype":"success","is_error":false,"result":"done ```json\n{\"status\":\"success\"}\n```","total_cost_usd":0.25,"usage":{"input_tokens":10,"output_tokens":20,"cache_read_input_tokens":30,"cache_creation_input_tokens":40}}"#,
                "\n"
            ),
        );
        assert_eq!(s.classify(Some(0), b"").0, AttemptOutcome::Success);
        assert_eq!(s.usage.total(), 100);
        assert_eq!(s.cost_usd, Some(0.25));
        assert!(s.last_message.unwrap().contains("\"status\""));
    }

    #[test]
    fn claude_errors_are_classified_whatever_the_exit_code() {
        let result = |subtype: &str, is_error: bool, text: &str| {
            let line = serde_json::json!({"type": "result", "subtype": subtype, "is_error": is_error, "result": text});
            stream(Format::ClaudeStreamJson, &format!("{line}\n"))
                .classify(Some(0), b"")
                .0
        };
        assert_eq!(
            result("error_max_turns", true, ""),
            AttemptOutcome::MaxTurns
        );
        assert_eq!(
            result("success", true, "API Error: 529 Overloaded"),
            AttemptOutcome::TransientApiError
        );
        assert_eq!(
            result("success", true, "Claude AI usage limit reached|1767225600"),
            AttemptOutcome::RateLimited
        );
        assert_eq!(
            result("error_during_execution", true, "tool failed"),
            AttemptOutcome::AgentError
        );
        assert_eq!(
            result("error_max_budget_usd", true, ""),
            AttemptOutcome::BudgetExceeded
        );
    }

    #[test]
    fn codex_jsonl_new_and_old_events() {
        let s = stream(
            Format::CodexJsonl,
            concat!(
                r#"{"type":"thread.started","thread_id":"t"}"#,
                "\n",
                r#"{"type":"item.completed","item":{"id":"i","type":"agent_message","text":"the answer"}}"#,
                "\n",
                r#"{"type":"turn.completed","usage":{"input_tokens":100,"cached_input_tokens":40,"output_tokens":7}}"#,
                "\n"
            ),
        );
        assert_eq!(s.classify(Some(0), b"").0, AttemptOutcome::Success);
        assert_eq!(
            s.usage,
            Usage {
                input_tokens: 60,
                output_tokens: 7,
                cache_read_tokens: 40,
                cache_write_tokens: 0
            }
        );
        assert_eq!(s.last_message.as_deref(), Some("the answer"));
        let s = stream(
            Format::CodexJsonl,
            "{\"id\":\"0\",\"msg\":{\"type\":\"task_complete\",\"last_agent_message\":\"old style\"}}\n",
        );
        assert_eq!(s.last_message.as_deref(), Some("old style"));
        let s = stream(
            Format::CodexJsonl,
            "{\"type\":\"turn.failed\",\"error\":{\"message\":\"stream error: 429 Too Many Requests; try again in 2 minutes\"}}\n",
        );
        assert_eq!(s.classify(Some(1), b"").0, AttemptOutcome::RateLimited);
        assert!(s.reset_at.is_some());
    }

    #[test]
    fn gemini_json_object_at_the_end() {
        let text = r#"{
  "response": "ok ```json\n{\"status\": \"success\"}\n```",
  "stats": {"models": {"gemini-2.5-pro": {"tokens": {"prompt": 50, "candidates": 5, "total": 60, "cached": 10, "thoughts": 5}}}}
}"#;
        let s = stream(Format::GeminiJson, text);
        assert_eq!(s.classify(Some(0), b"").0, AttemptOutcome::Success);
        assert_eq!(s.usage.total(), 60);
        let err = r#"{"error": {"type": "ApiError", "message": "Quota exceeded. Please retry in 23.5s.", "code": 429}}"#;
        let s = stream(Format::GeminiJson, err);
        assert_eq!(s.classify(Some(1), b"").0, AttemptOutcome::RateLimited);
        assert!(s.reset_at.is_some());
    }

    #[test]
    fn no_final_event_falls_back_to_errors_then_the_exit_code() {
        let s = stream(Format::ClaudeStreamJson, "garbage\n{\"type\":\"system\"}\n");
        assert_eq!(s.classify(Some(0), b"").0, AttemptOutcome::NoResult);
        assert_eq!(s.classify(Some(2), b"").0, AttemptOutcome::AgentError);
        assert_eq!(s.classify(None, b"").0, AttemptOutcome::Killed);
        let s = stream(
            Format::CodexJsonl,
            "{\"type\":\"error\",\"message\":\"503 Service Unavailable\"}\n",
        );
        assert_eq!(
            s.classify(Some(1), b"").0,
            AttemptOutcome::TransientApiError
        );
    }

    #[test]
    fn reset_times() {
        let now = DateTime::<Utc>::from_timestamp(1_000_000, 0).unwrap();
        let at = |text: &str| reset_time(text, &Value::Null, now).map(|t| (t - now).num_seconds());
        assert_eq!(
            reset_time("usage limit reached|1767225600", &Value::Null, now).map(|t| t.timestamp()),
            Some(1_767_225_600)
        );
        assert_eq!(at("Please retry in 23.5s."), Some(23));
        assert_eq!(at("try again in 2 hours 5 minutes"), Some(7500));
        assert_eq!(at("try again in 1h30m"), Some(5400));
        assert_eq!(at("nothing here"), None);
        let event = serde_json::json!({"error": {"resets_in_seconds": 90}});
        assert_eq!(
            reset_time("limit", &event, now).map(|t| (t - now).num_seconds()),
            Some(90)
        );
    }

    #[test]
    fn a_huge_line_is_skipped_not_kept() {
        let mut s = AgentStream::for_format(Format::ClaudeStreamJson).unwrap();
        s.feed(&vec![b'x'; MAX_LINE + 10]);
        s.feed(b"yyy\n{\"type\":\"result\",\"subtype\":\"success\",\"is_error\":false,\"result\":\"r\"}\n");
        assert!(s.line.is_empty());
        assert!(s.is_final());
    }
}
