//! What an agent's error says: the outcome it puts an attempt in (a rate limit, an environment
//! that cannot run it, a transient failure, ...), by its HTTP status or its words; one line of
//! reason from its output; and when a limit resets.

use chrono::{DateTime, Utc};
use loopd_core::attempt::AttemptOutcome;
use serde_json::Value;

/// Classifies an error by its text: the environment's fault, rate or usage limits, transient API
/// trouble, or the agent's own error. Numbers count only as HTTP statuses in their usual places
/// ("HTTP 429", "status 503", "(401)", "API Error: 500"), never as any digits in the text: a port
/// or a byte count is not a status.
pub fn classify_error_text(text: &str) -> AttemptOutcome {
    let t = text.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| t.contains(n));
    if has(ENVIRONMENT_PHRASES) {
        return AttemptOutcome::EnvironmentError;
    }
    if let Some(code) = http_status(&t) {
        return classify_status(i64::from(code), text);
    }
    if has(&[
        "rate limit",
        "rate_limit",
        "ratelimit",
        "usage limit",
        "resource_exhausted",
        "quota",
        "too many requests",
        "hit your limit",
        "hit your session limit",
        "exhausted your capacity",
    ]) {
        AttemptOutcome::RateLimited
    } else if has(&[
        "max turns",
        "maximum number of turns",
        "turn limit",
        "max_turns",
    ]) {
        AttemptOutcome::MaxTurns
    } else if has(&["budget", "spend limit"]) {
        AttemptOutcome::BudgetExceeded
    } else if has(&[
        "overloaded",
        "internal server error",
        "service unavailable",
        "bad gateway",
        "timed out",
        "timeout",
        "econnreset",
        "econnrefused",
        "connection reset",
        "connection refused",
        "network error",
        "unavailable",
        "high demand",
        "stream disconnected",
    ]) {
        AttemptOutcome::TransientApiError
    } else {
        AttemptOutcome::AgentError
    }
}

/// Phrases by which the agent CLIs say they cannot work here at all.
const ENVIRONMENT_PHRASES: &[&str] = &[
    // Logins and keys.
    "not logged in",
    "please run /login",
    "authentication_failed",
    "authentication_error",
    "invalid api key",
    "invalid x-api-key",
    "incorrect api key",
    "invalid_api_key",
    "api key not valid",
    "no api key",
    "missing api key",
    "missing environment variable",
    "no auth type is selected",
    "please set an auth method",
    "invalid auth method",
    "must specify the gemini_api_key",
    "unauthenticated",
    "unauthorized",
    // Models.
    "model_not_found",
    "model not found",
    "unknown model",
    // Programs, flags, folders.
    "command not found",
    "no such file or directory",
    "cannot be used with root",
    "unknown option",
    "unknown argument",
    "unexpected argument",
    "unrecognized option",
    "not running in a trusted directory",
];

/// The outcome of an HTTP status an agent reported.
pub(super) fn classify_status(code: i64, text: &str) -> AttemptOutcome {
    match code {
        401 | 403 => AttemptOutcome::EnvironmentError,
        404 if text.to_ascii_lowercase().contains("model") => AttemptOutcome::EnvironmentError,
        429 => AttemptOutcome::RateLimited,
        500..=599 => AttemptOutcome::TransientApiError,
        _ => classify_error_text_without_status(text),
    }
}

/// [`classify_error_text`] for a text whose status was already read.
fn classify_error_text_without_status(text: &str) -> AttemptOutcome {
    let t = text.to_ascii_lowercase();
    if ENVIRONMENT_PHRASES.iter().any(|n| t.contains(n)) {
        AttemptOutcome::EnvironmentError
    } else {
        AttemptOutcome::AgentError
    }
}

/// An HTTP status (400–599) in a lowercased text, where texts put one: right after "http",
/// "status", "status code", "code", "error" (with an optional colon), or in parentheses or
/// brackets. A number inside a longer one, an address or a path is none.
pub(super) fn http_status(t: &str) -> Option<u16> {
    let bytes = t.as_bytes();
    let mut i = 0;
    while i + 3 <= bytes.len() {
        let number = &bytes[i..i + 3];
        let standalone = number.iter().all(u8::is_ascii_digit)
            && (i == 0 || !matches!(bytes[i - 1], b'0'..=b'9' | b'.' | b':' | b'/' | b'-'))
            && bytes
                .get(i + 3)
                .is_none_or(|b| !matches!(b, b'0'..=b'9' | b'.' | b'/'));
        if standalone {
            let before = t[..i].trim_end();
            let anchored = before.ends_with('(')
                || before.ends_with('[')
                || ["http", "status", "status code", "code", "error"]
                    .iter()
                    .any(|w| before.trim_end_matches(':').trim_end().ends_with(w));
            let code: u16 = t[i..i + 3].parse().unwrap_or(0);
            if anchored && (400..600).contains(&code) {
                return Some(code);
            }
        }
        i += 1;
    }
    None
}

/// `what` and, when there is one, the line that says why: `exit code 1: <line>`.
pub fn with_reason(what: String, line: Option<&str>) -> String {
    match line {
        Some(line) => format!("{what}: {line}"),
        None => what,
    }
}

/// The last line of an agent's output worth showing as the reason it failed: not blank, not a
/// piece of JSON, without terminal colours.
pub fn last_meaningful_line(output: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(output);
    text.lines()
        .rev()
        .map(|l| strip_ansi(l.trim()))
        .map(|l| l.trim().to_owned())
        .find(|l| !l.is_empty() && !l.starts_with(['{', '}', '[', ']', '"']))
        .map(|l| match l.char_indices().nth(MAX_REASON_CHARS) {
            Some((cut, _)) => format!("{}…", &l[..cut]),
            None => l,
        })
}

/// The longest line of output quoted as a reason.
const MAX_REASON_CHARS: usize = 200;

/// A line without its ANSI escape sequences (`ESC [ ... letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// When a rate limit resets: an epoch after a `|` (Claude's `usage limit reached|1700000000`),
/// a structured field (`resets_in_seconds`, `retry_after`, `reset_at`), or "retry in 23s",
/// "try again in 2 hours 5 minutes".
pub fn reset_time(text: &str, event: &Value, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
    let epoch = |secs: i64| DateTime::<Utc>::from_timestamp(secs, 0);
    if let Some((_, tail)) = text.rsplit_once('|')
        && let Ok(secs) = tail.trim().parse::<i64>()
    {
        return epoch(secs);
    }
    for key in ["resets_in_seconds", "retry_after", "retry_after_seconds"] {
        if let Some(secs) = find_number(event, key) {
            return after(now, secs);
        }
    }
    for key in ["reset_at", "resets_at"] {
        if let Some(v) = find_value(event, key) {
            if let Some(secs) = v.as_i64() {
                return epoch(secs);
            }
            if let Some(t) = v.as_str().and_then(loopd_core::state::parse_ts) {
                return Some(t);
            }
        }
    }
    let lower = text.to_ascii_lowercase();
    let after = [
        "retry in ",
        "try again in ",
        "retry after ",
        "resets in ",
        "reset after ",
    ]
    .iter()
    .find_map(|p| lower.find(p).map(|i| &lower[i + p.len()..]))?;
    parse_duration_words(after).and_then(|secs| self::after(now, secs))
}

/// The longest wait an agent's reset time is believed for (loopd's own `rate_limit_max_wait` is
/// the real bound); beyond it a number is garbage.
const MAX_RESET_SECS: f64 = 366.0 * 86_400.0;

/// `now` plus `secs` seconds: `None` for a negative or non-finite number, at most
/// [`MAX_RESET_SECS`] later, never an overflow.
fn after(now: DateTime<Utc>, secs: f64) -> Option<DateTime<Utc>> {
    if !(secs.is_finite() && secs >= 0.0) {
        return None;
    }
    let ms = (secs.min(MAX_RESET_SECS) * 1000.0) as i64;
    now.checked_add_signed(chrono::TimeDelta::try_milliseconds(ms)?)
}

/// "2 hours 5 minutes", "23.4s", "90 seconds", "1h30m": the leading duration of a text, in
/// seconds.
fn parse_duration_words(text: &str) -> Option<f64> {
    let mut total_ms = 0f64;
    let mut found = false;
    let mut rest = text.trim_start();
    loop {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 {
            break;
        }
        let Ok(n) = rest[..digits].parse::<f64>() else {
            break;
        };
        let after = rest[digits..].trim_start();
        let unit_len = after
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(after.len());
        let unit = &after[..unit_len];
        let ms = match unit {
            "ms" | "millisecond" | "milliseconds" => 1.0,
            "s" | "sec" | "secs" | "second" | "seconds" => 1000.0,
            "m" | "min" | "mins" | "minute" | "minutes" => 60_000.0,
            "h" | "hr" | "hrs" | "hour" | "hours" => 3_600_000.0,
            "d" | "day" | "days" => 86_400_000.0,
            _ => break,
        };
        total_ms += n * ms;
        found = true;
        rest = after[unit_len..]
            .trim_start_matches([' ', ','])
            .trim_start_matches("and ");
    }
    found.then_some(total_ms / 1000.0)
}

fn find_value<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    match v {
        Value::Object(map) => map
            .get(key)
            .or_else(|| map.values().find_map(|child| find_value(child, key))),
        Value::Array(items) => items.iter().find_map(|child| find_value(child, key)),
        _ => None,
    }
}

fn find_number(v: &Value, key: &str) -> Option<f64> {
    find_value(v, key).and_then(Value::as_f64)
}
