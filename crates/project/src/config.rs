//! Layered configuration: the built-in `config.toml`, then the user's `config.toml` (in
//! `$XDG_CONFIG_HOME/loopd/`, else `~/.config/loopd/`), then
//! `<root>/.loop/config.toml`, then `$LOOPD_CONFIG` or `--config FILE`, key by key.
//!
//! Each layer is parsed on its own first, so a type error or an unknown key is reported against the
//! file that has it; the merged result is then checked as a whole (limits, executors that exist),
//! and a problem there names the last layer that set the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use loopd_exec::sandbox::{HostRule, Mode as SandboxMode, Network, Policy};
use loopd_exec::{Format, PromptMode, Supervision};
use serde::Deserialize;

/// The documented defaults.
pub const DEFAULT_CONFIG: &str = include_str!("../../../config.toml");

#[derive(Debug, thiserror::Error)]
#[error("bad config {file}{}: {reason}", key.as_ref().map(|k| format!(", key `{k}`")).unwrap_or_default())]
pub struct ConfigError {
    pub file: String,
    pub key: Option<String>,
    pub reason: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub state_dir: String,
    pub workflow: String,
    pub max_iterations: u64,
    pub max_errors: u64,
    pub action_retries: u32,
    pub retry_backoff: f64,
    pub executor: String,
    /// Budgets of loops that do not set their own; absent means none.
    pub max_cost_usd: Option<f64>,
    pub max_tokens: Option<u64>,
    /// Seconds to wait after a rate limit that gave no reset time.
    pub rate_limit_wait: f64,
    /// The longest wait for a rate limit's reset, in seconds.
    pub rate_limit_max_wait: f64,
    /// `loopd serve`: how many loops run at once; the others wait in a queue.
    pub max_running_loops: u64,
    /// How many tasks of a loop are developed at once (each in a git work tree of its own,
    /// merged back in task order), for loops that do not set their own.
    pub parallel: u64,
    /// Executors that each try every develop task of loops that do not set their own, the best
    /// result kept; empty: none race.
    pub race: Vec<String>,
    /// `git`: a checkpoint of the work tree after each action that changes it; `off`: none.
    pub checkpoint: Checkpoints,
    /// How many checkpoints of each loop are kept (the oldest go; the start stays).
    pub checkpoint_keep: u64,
    /// Roll the work tree back to the best validation's checkpoint when a validation's pass rate
    /// drops below it.
    pub rollback_on_regression: bool,
    /// Rounds in a row without progress after which a loop pauses (or fails, see
    /// `on_no_progress`); 0: never.
    pub no_progress_rounds: u64,
    pub on_no_progress: loopd_core::no_progress::Then,
    pub executor_defaults: ExecutorDefaults,
    pub temporal: TemporalConfig,
    pub executors: BTreeMap<String, ExecutorConfig>,
    pub actions: BTreeMap<String, ActionConfig>,
    /// `[[notify]]`: who is told of a loop's events that want a person (a later layer's list
    /// replaces an earlier one's).
    pub notify: Vec<NotifyConfig>,
    /// The project layer as it was read, when there is one: it needs `loopd trust`.
    #[serde(skip)]
    pub project_file: Option<crate::project_file::ProjectFile>,
}

/// The smallest `[temporal] history_limit`: a run must hold a few actions' events.
pub const MIN_HISTORY_LIMIT: u32 = 30;

/// `[temporal]`: where loops on Temporal live, and which of its queues loopd uses.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TemporalConfig {
    /// Every command of the project's loops goes to Temporal, without `--temporal`.
    pub enabled: bool,
    /// `host:port` (or a URL) of the frontend. Empty: `$TEMPORAL_ADDRESS`, else the Temporal
    /// CLI's profile, else `127.0.0.1:7233` (a dev server: `temporal server start-dev`).
    pub address: String,
    /// Empty: `$TEMPORAL_NAMESPACE`, else the profile's, else `default`.
    pub namespace: String,
    /// The Temporal CLI's profile (in `$TEMPORAL_CONFIG_FILE`, else
    /// `~/.config/temporalio/temporal.toml`) that fills what these settings leave empty. Empty:
    /// `$TEMPORAL_PROFILE`, else `default`.
    pub profile: String,
    /// TLS to the frontend. Unset: on for an address that is not loopback, for a CA, client
    /// certificate or server name, for an API key, or as the profile says.
    pub tls: Option<bool>,
    /// The PEM file of the CA that signed the server's certificate. Empty: the system's roots.
    pub ca_cert: String,
    /// The PEM files of the client's certificate and key, for a server that asks for one
    /// (mutual TLS).
    pub client_cert: String,
    pub client_key: String,
    /// The name the server's certificate must carry, when it is not the address's host.
    pub server_name: String,
    /// A file holding the API key (Temporal Cloud's `Bearer` token). Empty:
    /// `$TEMPORAL_API_KEY`, else the profile's.
    pub api_key_file: String,
    /// Where a worker serves its metrics for Prometheus (`HOST:PORT`). Empty: nowhere.
    pub metrics: String,
    /// The task queue of loopd's workflows and activities.
    pub task_queue: String,
    /// Events a loop's run keeps in its history before it continues as a new run.
    pub history_limit: u32,
    /// This worker's name: its own task queue (`TASK_QUEUE@NAME`), where the actions of the
    /// loops it holds go first, and its cache's directory. Empty: the machine's host name.
    pub worker_name: String,
    /// Where a worker keeps its clones and work trees. Empty: `~/.cache/loopd/worker/NAME`.
    pub cache_dir: String,
    /// Actions a worker runs at once; the rest wait in Temporal's queue.
    pub max_actions: u32,
    /// Seconds a work tree no action used is kept before the worker removes it.
    pub tree_grace: f64,
}

impl TemporalConfig {
    /// The files of its credentials, which no attempt may read.
    pub fn secrets(&self) -> impl Iterator<Item = PathBuf> + '_ {
        [&self.api_key_file, &self.client_key]
            .into_iter()
            .filter(|f| !f.is_empty())
            .map(PathBuf::from)
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExecutorDefaults {
    pub timeout: f64,
    pub idle_timeout: f64,
    pub kill_grace: f64,
    pub output_cap: u64,
    pub final_grace: f64,
    /// Every attempt's sandbox: `workspace-write`, `read-only` or `off`.
    pub sandbox: String,
    pub sandbox_network: SandboxNetwork,
    /// Paths no action reads, besides [`loopd_exec::sandbox::HIDDEN_IN_HOME`].
    pub sandbox_hidden: Vec<String>,
}

/// `sandbox_network`: `"model"` (an agent CLI's own model endpoint, nothing for any other
/// executor), `"any"`, `"none"`, the hosts with their ports an action may reach through loopd's
/// proxy (`["api.anthropic.com:443", "*.npmjs.org:443", "127.0.0.1:8080"]`), or the TCP ports it
/// may connect to (`[443]`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum SandboxNetwork {
    Named(String),
    /// (Before `Ports`: an empty list is no host.)
    Hosts(Vec<String>),
    Ports(Vec<u16>),
}

impl Default for SandboxNetwork {
    fn default() -> SandboxNetwork {
        SandboxNetwork::Named("model".into())
    }
}

impl SandboxNetwork {
    /// The network it says; `model` gives the hosts of `"model"`.
    fn resolve(&self, model: impl FnOnce() -> Vec<HostRule>) -> Result<Network, String> {
        match self {
            SandboxNetwork::Named(name) if name == "any" => Ok(Network::Any),
            SandboxNetwork::Named(name) if name == "none" => Ok(Network::None),
            SandboxNetwork::Named(name) if name == "model" => Ok(Network::Hosts(model())),
            SandboxNetwork::Named(name) => Err(format!(
                "{name:?}: must be \"model\", \"any\", \"none\", a list of host:port, or a list \
                 of TCP ports"
            )),
            SandboxNetwork::Ports(ports) if ports.contains(&0) => {
                Err("port 0 is no port to connect to".into())
            }
            SandboxNetwork::Ports(ports) => Ok(Network::Ports(ports.clone())),
            SandboxNetwork::Hosts(hosts) => hosts
                .iter()
                .map(|h| HostRule::parse(h))
                .collect::<Result<_, _>>()
                .map(Network::Hosts),
        }
    }

    /// Checks it, as it would be resolved for any executor.
    fn check(&self) -> Result<(), String> {
        self.resolve(Vec::new).map(drop)
    }
}

/// The model endpoints of an agent CLI, by its program's name, following the variables (and for
/// Codex its config file) that point it elsewhere, as the CLI itself does: the executor's `env`
/// first, then loopd's environment. Nothing for any other program.
pub fn model_hosts(executor: &ExecutorConfig, home: &Path) -> Vec<HostRule> {
    let program = executor
        .command
        .first()
        .map(|c| {
            Path::new(c)
                .file_name()
                .map_or(c.as_str(), |n| n.to_str().unwrap_or(""))
        })
        .unwrap_or("");
    let var = |name: &str| {
        executor
            .env
            .get(name)
            .cloned()
            .or_else(|| std::env::var(name).ok())
            .filter(|v| !v.is_empty())
    };
    let (base, defaults): (Option<String>, &[&str]) = match program {
        "claude" => (var("ANTHROPIC_BASE_URL"), &["api.anthropic.com:443"]),
        "codex" => (
            var("OPENAI_BASE_URL").or_else(|| codex_base_url(&var("CODEX_HOME"), home)),
            &["api.openai.com:443", "chatgpt.com:443"],
        ),
        "gemini" => (
            var("GOOGLE_GEMINI_BASE_URL"),
            &[
                "generativelanguage.googleapis.com:443",
                "oauth2.googleapis.com:443",
                "cloudcode-pa.googleapis.com:443",
            ],
        ),
        "qwen" => (
            var("OPENAI_BASE_URL"),
            &[
                "dashscope.aliyuncs.com:443",
                "dashscope-intl.aliyuncs.com:443",
                "chat.qwen.ai:443",
                "portal.qwen.ai:443",
            ],
        ),
        _ => (None, &[]),
    };
    match base.as_deref().and_then(url_host) {
        Some(rule) => vec![rule],
        None => defaults
            .iter()
            .filter_map(|d| HostRule::parse(d).ok())
            .collect(),
    }
}

/// The base URL of Codex's model provider in its config file (`$CODEX_HOME/config.toml`, else
/// `~/.codex/config.toml`): `model_providers.<model_provider>.base_url`.
fn codex_base_url(codex_home: &Option<String>, home: &Path) -> Option<String> {
    let dir = codex_home
        .as_ref()
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".codex"));
    let text = std::fs::read_to_string(dir.join("config.toml")).ok()?;
    let config: toml::Table = text.parse().ok()?;
    let provider = config.get("model_provider")?.as_str()?;
    config
        .get("model_providers")?
        .get(provider)?
        .get("base_url")?
        .as_str()
        .map(str::to_owned)
}

/// The host and port of a URL (`https://api.example.com/v1` is `api.example.com:443`).
fn url_host(url: &str) -> Option<HostRule> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit('@').next()?;
    let default = match scheme {
        "https" => 443,
        "http" => 80,
        _ => return None,
    };
    let has_port = match authority.rfind(']') {
        Some(end) => authority[end..].contains(':'),
        None => authority.contains(':'),
    };
    let text = if has_port {
        authority.to_owned()
    } else {
        format!("{authority}:{default}")
    };
    HostRule::parse(&text).ok()
}

/// A sandbox mode by its name, or why not.
fn sandbox_mode(name: &str) -> Result<SandboxMode, String> {
    SandboxMode::parse(name)
        .ok_or_else(|| format!("{name:?}: must be \"workspace-write\", \"read-only\" or \"off\""))
}

/// A path a sandbox setting names: absolute, or in the home directory (`~/...`).
fn sandbox_path(path: &str, home: &Path) -> Result<PathBuf, String> {
    match path.strip_prefix("~/") {
        Some(rest) => Ok(home.join(rest)),
        None if path == "~" => Ok(home.to_owned()),
        None if Path::new(path).is_absolute() => Ok(PathBuf::from(path)),
        None => Err(format!("{path:?}: must be absolute or start with ~/")),
    }
}

/// Whether loops record git checkpoints of their work tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Checkpoints {
    /// In a git work tree, after every action that changes it; elsewhere, none.
    #[default]
    Git,
    Off,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExecutorConfig {
    pub command: Vec<String>,
    pub prompt: PromptMode,
    pub format: Format,
    pub env: BTreeMap<String, String>,
    pub timeout: Option<f64>,
    pub idle_timeout: Option<f64>,
    pub kill_grace: Option<f64>,
    pub output_cap: Option<u64>,
    pub final_grace: Option<f64>,
    /// The account whose limits its agent spends (default: the executor's name): a rate limit
    /// of one loop holds the service's other loops of that account.
    pub account: Option<String>,
    /// Its attempts' sandbox, if not `[executor_defaults]`'s.
    pub sandbox: Option<String>,
    pub sandbox_network: Option<SandboxNetwork>,
    /// Where its attempts may write besides their work tree (absolute or `~/...`).
    pub sandbox_writable: Vec<String>,
    /// Hidden paths its attempts may read anyway (an agent's own key file).
    pub sandbox_readable: Vec<String>,
    /// Unix sockets of programs outside the sandbox its attempts may connect to (absolute or
    /// `~/...`).
    pub sandbox_sockets: Vec<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActionConfig {
    pub executor: Option<String>,
    pub timeout: Option<f64>,
    pub idle_timeout: Option<f64>,
    /// A shell command run with `sh -c` instead of an executor.
    pub command: Option<String>,
    /// Its attempts' sandbox mode, if not its executor's.
    pub sandbox: Option<String>,
    /// Its attempts' network, if not its executor's.
    pub sandbox_network: Option<SandboxNetwork>,
}

/// The events a `[[notify]]` receiver may ask for, by the names people use for them.
pub const NOTIFY_EVENTS: [&str; 6] = [
    "needs_input",
    "no_progress",
    "failed",
    "completed",
    "budget_reached",
    "rate_limited",
];

/// Seconds one delivery to a `[[notify]]` receiver may take by default.
pub const NOTIFY_TIMEOUT: f64 = 10.0;

/// One `[[notify]]` receiver: a webhook (`url`) or a program (`command`), told of the `events` it
/// names, else of all of [`NOTIFY_EVENTS`].
#[derive(Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NotifyConfig {
    /// `http://` or `https://`: each event is POSTed to it as JSON.
    pub url: Option<String>,
    /// A program and its arguments, run without a shell, with the event as one JSON line on
    /// its stdin.
    pub command: Option<Vec<String>>,
    pub events: Option<Vec<String>>,
    /// Seconds one delivery may take (a request, or the program's run); default
    /// [`NOTIFY_TIMEOUT`].
    pub timeout: Option<f64>,
}

/// The URL may hold a token (in its user info, path or query): it is never shown, not even by
/// `{:?}`.
impl std::fmt::Debug for NotifyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifyConfig")
            .field("url", &self.url.as_ref().map(|_| "(hidden)"))
            .field("command", &self.command)
            .field("events", &self.events)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl NotifyConfig {
    /// Whether it wants to hear of `event`, one of [`NOTIFY_EVENTS`].
    pub fn wants(&self, event: &str) -> bool {
        self.events
            .as_ref()
            .is_none_or(|events| events.iter().any(|e| e == event))
    }

    /// How long one delivery may take.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout.unwrap_or(NOTIFY_TIMEOUT))
    }

    /// What is wrong with it, if anything; never quotes the URL.
    fn check(&self) -> Result<(), String> {
        match (&self.url, &self.command) {
            (Some(_), Some(_)) => return Err("has both `url` and `command`; give one".into()),
            (None, None) => {
                return Err("needs `url` (a webhook) or `command` (a program to run)".into());
            }
            (Some(url), None) => {
                let rest = ["http://", "https://"]
                    .iter()
                    .find_map(|scheme| url.strip_prefix(scheme));
                if rest.is_none_or(|r| r.is_empty() || r.contains(char::is_whitespace)) {
                    return Err("`url` must be an http:// or https:// URL".into());
                }
            }
            (None, Some(command)) => {
                if command.first().is_none_or(String::is_empty) {
                    return Err("`command` must be a non-empty list of strings".into());
                }
            }
        }
        if let Some(events) = &self.events {
            if events.is_empty() {
                return Err("`events` is empty (leave it out for all events)".into());
            }
            if let Some(e) = events.iter().find(|e| !NOTIFY_EVENTS.contains(&e.as_str())) {
                return Err(format!(
                    "`events` names an unknown event {e:?}{} (known: {})",
                    did_you_mean(e, &NOTIFY_EVENTS),
                    NOTIFY_EVENTS.join(", ")
                ));
            }
        }
        match self.timeout {
            Some(t) if !seconds_ok(t) => Err(format!(
                "`timeout` must be a positive number of at most {MAX_SECONDS}, not {t}"
            )),
            _ => Ok(()),
        }
    }
}

/// The longest duration a setting may have, in seconds (about 31 years): more is surely a typo,
/// and would overflow a `Duration`.
pub const MAX_SECONDS: f64 = 1e9;

/// Whether `v` is a usable number of seconds.
pub fn seconds_ok(v: f64) -> bool {
    v.is_finite() && v > 0.0 && v <= MAX_SECONDS
}

/// The user's own loopd directory: `$XDG_CONFIG_HOME/loopd`, else `~/.config/loopd`.
pub fn user_dir() -> Option<PathBuf> {
    let absolute = |var| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    absolute("XDG_CONFIG_HOME")
        .map(|c| c.join("loopd"))
        .or_else(|| absolute("HOME").map(|h| h.join(".config/loopd")))
}

/// `; did you mean "X"?` for the known name closest to `name`, when one is close.
pub fn did_you_mean(name: &str, known: &[&str]) -> String {
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(name, k), k))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| format!("; did you mean {k:?}?"))
        .unwrap_or_default()
}

fn same_file(a: &Path, b: &Path) -> bool {
    matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b)
}

struct Layer {
    name: String,
    table: toml::Table,
}

impl Config {
    /// Loads every layer for a project root; `explicit` is `--config` (else `$LOOPD_CONFIG`).
    pub fn load(root: &Path, explicit: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_layers(Some(root), explicit)
    }

    /// The configuration of `loopd serve`, which belongs to no project: the built-in defaults,
    /// the user's file, then `$LOOPD_CONFIG` or `--config FILE`.
    pub fn load_service(explicit: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_layers(None, explicit)
    }

    fn load_layers(root: Option<&Path>, explicit: Option<&Path>) -> Result<Config, ConfigError> {
        let mut layers = vec![parse_layer("built-in config.toml", DEFAULT_CONFIG)?];
        let project = root.map(Self::project_file);
        let mut project_file = None;
        for (file, required) in Self::layer_files(root, explicit) {
            match loopd_fs::read_text(&file) {
                Ok(text) => {
                    layers.push(parse_layer(&file.display().to_string(), &text)?);
                    let is_project = project.as_ref().is_some_and(|p| same_file(&file, p));
                    if required && is_project {
                        // Named by `--config`: the user's own choice.
                        project_file = None;
                    } else if project.as_ref() == Some(&file) {
                        project_file = Some(crate::project_file::ProjectFile::new(&file, &text));
                    }
                }
                Err(e) if required || e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(ConfigError {
                        file: file.display().to_string(),
                        key: None,
                        reason: e.to_string(),
                    });
                }
                Err(_) => {}
            }
        }
        let mut config = Self::from_layers(&layers)?;
        config.project_file = project_file;
        Ok(config)
    }

    /// The project's own layer, `<root>/.loop/config.toml`; `state_dir` cannot move it.
    pub fn project_file(root: &Path) -> PathBuf {
        root.join(".loop/config.toml")
    }

    /// The config files layered over the built-in defaults, in order, and whether each must
    /// exist (`--config` / `$LOOPD_CONFIG` must; the others are optional).
    pub fn layer_files(root: Option<&Path>, explicit: Option<&Path>) -> Vec<(PathBuf, bool)> {
        let mut files = Vec::new();
        if let Some(user) = user_dir() {
            files.push((user.join("config.toml"), false));
        }
        files.extend(root.map(|root| (Self::project_file(root), false)));
        let explicit = explicit
            .map(Path::to_owned)
            .or_else(|| std::env::var_os("LOOPD_CONFIG").map(PathBuf::from));
        files.extend(explicit.map(|f| (f, true)));
        files
    }

    /// The built-in defaults alone, plus `extra` TOML on top (used by the demo and tests).
    pub fn builtin_with(extra: &str) -> Result<Config, ConfigError> {
        let layers = [
            parse_layer("built-in config.toml", DEFAULT_CONFIG)?,
            parse_layer("extra", extra)?,
        ];
        Self::from_layers(&layers)
    }

    fn from_layers(layers: &[Layer]) -> Result<Config, ConfigError> {
        let mut merged = toml::Table::new();
        for layer in layers {
            merge(&mut merged, &layer.table);
        }
        let config: Config =
            toml::Value::Table(merged)
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError {
                    file: "merged configuration".into(),
                    key: None,
                    reason: e.message().to_owned(),
                })?;
        config.check().map_err(|(key, reason)| ConfigError {
            file: layers
                .iter()
                .rev()
                .find(|l| has_key(&l.table, &key))
                .map_or_else(|| "configuration".to_owned(), |l| l.name.clone()),
            key: Some(key),
            reason,
        })?;
        Ok(config)
    }

    fn check(&self) -> Result<(), (String, String)> {
        let positive = |key: &str, v: f64| {
            if seconds_ok(v) {
                Ok(())
            } else {
                Err((
                    key.to_owned(),
                    format!("must be a positive number of at most {MAX_SECONDS}, not {v}"),
                ))
            }
        };
        if self.temporal.history_limit < MIN_HISTORY_LIMIT {
            return Err((
                "temporal.history_limit".into(),
                format!("must be at least {MIN_HISTORY_LIMIT} (events of a few actions)"),
            ));
        }
        if self.temporal.max_actions == 0 {
            return Err(("temporal.max_actions".into(), "must be at least 1".into()));
        }
        positive("temporal.tree_grace", self.temporal.tree_grace)?;
        self.check_race(&self.race)
            .map_err(|why| ("race".to_owned(), why))?;
        if self.parallel == 0 {
            return Err(("parallel".into(), "must be at least 1".into()));
        }
        if self.checkpoint_keep == 0 {
            return Err(("checkpoint_keep".into(), "must be at least 1".into()));
        }
        if self.max_running_loops == 0 {
            return Err(("max_running_loops".into(), "must be at least 1".into()));
        }
        if self.state_dir.trim().is_empty() {
            return Err(("state_dir".into(), "must not be empty".into()));
        }
        if loopd_core::workflow::by_name(&self.workflow).is_none() {
            return Err((
                "workflow".into(),
                format!(
                    "unknown workflow {:?} (known: {})",
                    self.workflow,
                    loopd_core::workflow::WORKFLOWS.join(", ")
                ),
            ));
        }
        for name in self.actions.keys() {
            let known: Vec<&str> = loopd_core::workflow::all()
                .flat_map(|w| w.actions().iter().copied())
                .collect();
            if !known.contains(&name.as_str()) {
                return Err((
                    format!("actions.{name}"),
                    format!(
                        "unknown action {name:?}{} (known: {})",
                        did_you_mean(name, &known),
                        known.join(", ")
                    ),
                ));
            }
        }
        if self.max_iterations == 0 {
            return Err(("max_iterations".into(), "must be at least 1".into()));
        }
        if self.max_errors == 0 {
            return Err(("max_errors".into(), "must be at least 1".into()));
        }
        if !(self.retry_backoff == 0.0 || seconds_ok(self.retry_backoff)) {
            return Err((
                "retry_backoff".into(),
                "must be a number of seconds >= 0".into(),
            ));
        }
        let d = &self.executor_defaults;
        positive("executor_defaults.timeout", d.timeout)?;
        positive("executor_defaults.idle_timeout", d.idle_timeout)?;
        positive("executor_defaults.kill_grace", d.kill_grace)?;
        positive("executor_defaults.final_grace", d.final_grace)?;
        positive("rate_limit_wait", self.rate_limit_wait)?;
        positive("rate_limit_max_wait", self.rate_limit_max_wait)?;
        if let Some(c) = self.max_cost_usd {
            positive("max_cost_usd", c)?;
        }
        if self.max_tokens == Some(0) {
            return Err(("max_tokens".into(), "must be at least 1".into()));
        }
        if d.output_cap == 0 {
            return Err((
                "executor_defaults.output_cap".into(),
                "must be at least 1".into(),
            ));
        }
        sandbox_mode(&d.sandbox).map_err(|r| ("executor_defaults.sandbox".to_owned(), r))?;
        d.sandbox_network
            .check()
            .map_err(|r| ("executor_defaults.sandbox_network".to_owned(), r))?;
        let anywhere = Path::new("/");
        for path in &d.sandbox_hidden {
            sandbox_path(path, anywhere)
                .map_err(|r| ("executor_defaults.sandbox_hidden".to_owned(), r))?;
        }
        for (name, a) in &self.actions {
            if let Some(mode) = &a.sandbox {
                sandbox_mode(mode).map_err(|r| (format!("actions.{name}.sandbox"), r))?;
            }
            if let Some(network) = &a.sandbox_network {
                network
                    .check()
                    .map_err(|r| (format!("actions.{name}.sandbox_network"), r))?;
            }
        }
        for (name, e) in &self.executors {
            let key = |k: &str| format!("executors.{name}.{k}");
            if let Some(mode) = &e.sandbox {
                sandbox_mode(mode).map_err(|r| (key("sandbox"), r))?;
            }
            if let Some(network) = &e.sandbox_network {
                network.check().map_err(|r| (key("sandbox_network"), r))?;
            }
            for (k, paths) in [
                ("sandbox_writable", &e.sandbox_writable),
                ("sandbox_readable", &e.sandbox_readable),
                ("sandbox_sockets", &e.sandbox_sockets),
            ] {
                for path in paths {
                    sandbox_path(path, anywhere).map_err(|r| (key(k), r))?;
                }
            }
        }
        self.executor_named(&self.executor)
            .map_err(|reason| ("executor".to_owned(), reason))?;
        for (name, e) in &self.executors {
            if e.command.is_empty() || e.command[0].is_empty() {
                return Err((
                    format!("executors.{name}.command"),
                    "must be a non-empty list of strings".into(),
                ));
            }
            for (key, v) in [
                ("timeout", e.timeout),
                ("idle_timeout", e.idle_timeout),
                ("kill_grace", e.kill_grace),
                ("final_grace", e.final_grace),
            ] {
                if let Some(v) = v {
                    positive(&format!("executors.{name}.{key}"), v)?;
                }
            }
        }
        for (name, a) in &self.actions {
            if let Some(executor) = &a.executor {
                self.executor_named(executor)
                    .map_err(|reason| (format!("actions.{name}.executor"), reason))?;
            }
            for (key, v) in [("timeout", a.timeout), ("idle_timeout", a.idle_timeout)] {
                if let Some(v) = v {
                    positive(&format!("actions.{name}.{key}"), v)?;
                }
            }
            if a.command.as_deref().is_some_and(|c| c.trim().is_empty()) {
                return Err((
                    format!("actions.{name}.command"),
                    "must not be empty".into(),
                ));
            }
        }
        for (n, notify) in self.notify.iter().enumerate() {
            notify
                .check()
                .map_err(|reason| ("notify".to_owned(), format!("entry {}: {reason}", n + 1)))?;
        }
        Ok(())
    }

    /// The limits of loops that do not set their own.
    /// How an action's failed attempts are tried again, and rate limits waited out.
    pub fn retry_policy(&self) -> loopd_core::attempt::RetryPolicy {
        let secs = |v: f64| Duration::try_from_secs_f64(v).unwrap_or_default();
        loopd_core::attempt::RetryPolicy {
            retries: self.action_retries,
            first_pause: secs(self.retry_backoff),
            rate_limit_wait: secs(self.rate_limit_wait),
            rate_limit_max_wait: secs(self.rate_limit_max_wait),
        }
    }

    pub fn limits(&self) -> loopd_core::workflow::Limits {
        loopd_core::workflow::Limits {
            max_iterations: self.max_iterations,
            max_errors: self.max_errors,
            max_cost_usd: self.max_cost_usd,
            max_tokens: self.max_tokens,
            no_progress: loopd_core::no_progress::Rule {
                rounds: self.no_progress_rounds,
                then: self.on_no_progress,
            },
        }
    }

    /// Why executors `race` cannot race on a task, if they cannot: fewer than two (none is no
    /// race), one not configured, or a name git cannot take into a checkpoint's ref.
    pub fn check_race(&self, race: &[String]) -> Result<(), String> {
        loopd_core::control::check_race_size(race)?;
        for name in race {
            self.executor_named(name)?;
            if !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(format!(
                    "executor name {name:?} can only race with letters, digits, - and _"
                ));
            }
        }
        Ok(())
    }

    /// The executor called `name`, or why there is none.
    pub fn executor_named(&self, name: &str) -> Result<&ExecutorConfig, String> {
        self.executors.get(name).ok_or_else(|| {
            format!(
                "unknown executor {name:?} (configured: {})",
                self.executors
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }

    /// The sandbox of an executor's attempts, with an action's mode; paths under `~/` are in
    /// the executor's home (its `env`'s `HOME`, else `home`). The settings were checked when the
    /// config loaded: a bad one here is the default.
    pub fn sandbox(
        &self,
        executor: &ExecutorConfig,
        action: Option<&ActionConfig>,
        home: &Path,
    ) -> Policy {
        let home = executor.env.get("HOME").map_or(home, Path::new);
        let d = &self.executor_defaults;
        let mode = action
            .and_then(|a| a.sandbox.as_deref())
            .or(executor.sandbox.as_deref())
            .unwrap_or(&d.sandbox);
        let paths = |list: &[String]| -> Vec<PathBuf> {
            list.iter()
                .filter_map(|p| sandbox_path(p, home).ok())
                .collect()
        };
        let hidden = loopd_exec::sandbox::HIDDEN_IN_HOME
            .iter()
            .map(|p| home.join(p))
            .chain(paths(&d.sandbox_hidden))
            .chain(self.temporal.secrets())
            .chain(loopd_exec::sandbox::secrets())
            .collect();
        Policy {
            mode: sandbox_mode(mode).unwrap_or_default(),
            writable: paths(&executor.sandbox_writable),
            hidden,
            readable: paths(&executor.sandbox_readable),
            sockets: paths(&executor.sandbox_sockets),
            // Checked when the config loaded; were it bad, nothing rather than anything.
            network: action
                .and_then(|a| a.sandbox_network.as_ref())
                .or(executor.sandbox_network.as_ref())
                .unwrap_or(&d.sandbox_network)
                .resolve(|| model_hosts(executor, home))
                .unwrap_or(Network::None),
        }
    }

    /// The supervision limits for an executor, with an action's overrides.
    /// The supervision limits of an action. Timeouts: the action's config, else the action
    /// file's front matter (`action_file`: timeout, idle timeout), else the executor's, else the
    /// defaults; the rest is the executor's, else the defaults.
    pub fn supervision(
        &self,
        executor: &ExecutorConfig,
        action: Option<&ActionConfig>,
        action_file: (Option<f64>, Option<f64>),
    ) -> Supervision {
        let d = &self.executor_defaults;
        let secs = |v: f64| Duration::from_secs_f64(v);
        Supervision {
            timeout: secs(
                action
                    .and_then(|a| a.timeout)
                    .or(action_file.0)
                    .or(executor.timeout)
                    .unwrap_or(d.timeout),
            ),
            idle_timeout: secs(
                action
                    .and_then(|a| a.idle_timeout)
                    .or(action_file.1)
                    .or(executor.idle_timeout)
                    .unwrap_or(d.idle_timeout),
            ),
            kill_grace: secs(executor.kill_grace.unwrap_or(d.kill_grace)),
            output_cap: executor.output_cap.unwrap_or(d.output_cap),
            final_grace: secs(executor.final_grace.unwrap_or(d.final_grace)),
        }
    }
}

fn parse_layer(name: &str, text: &str) -> Result<Layer, ConfigError> {
    let located = |e: toml::de::Error| {
        let (line, snippet) = e
            .span()
            .map(|span| {
                let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                let snippet = text.lines().nth(line - 1).unwrap_or("").trim();
                // A URL may hold a token (a `[[notify]]` webhook's): never quoted.
                let snippet = match snippet.contains("://") {
                    true => "a line with a URL, not shown".to_owned(),
                    false => snippet.to_owned(),
                };
                (line, snippet)
            })
            .unwrap_or((0, String::new()));
        ConfigError {
            file: name.to_owned(),
            key: None,
            reason: if line > 0 {
                format!("line {line} ({snippet}): {}", e.message().trim())
            } else {
                e.message().trim().to_owned()
            },
        }
    };
    let table: toml::Table = toml::from_str(text).map_err(located)?;
    // Types and unknown keys are checked per file, so the error names the file that has them.
    toml::from_str::<Config>(text).map_err(located)?;
    Ok(Layer {
        name: name.to_owned(),
        table,
    })
}

fn merge(into: &mut toml::Table, from: &toml::Table) {
    for (key, value) in from {
        match (into.get_mut(key), value) {
            (Some(toml::Value::Table(a)), toml::Value::Table(b)) => merge(a, b),
            _ => {
                into.insert(key.clone(), value.clone());
            }
        }
    }
}

fn has_key(table: &toml::Table, dotted: &str) -> bool {
    let mut current = table;
    let mut parts = dotted.split('.').peekable();
    while let Some(part) = parts.next() {
        match current.get(part) {
            Some(toml::Value::Table(t)) if parts.peek().is_some() => current = t,
            Some(_) if parts.peek().is_none() => return true,
            _ => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_defaults_load() {
        let c = Config::builtin_with("").unwrap();
        assert_eq!(c.state_dir, ".loop");
        assert_eq!(c.max_errors, 3);
        assert_eq!(c.action_retries, 2);
        for name in ["claude", "codex", "gemini", "qwen", "bash"] {
            assert!(c.executors.contains_key(name), "{name}");
        }
    }

    #[test]
    fn layers_override_key_by_key() {
        let c = Config::builtin_with("max_errors = 7\n[executors.claude]\nformat = \"text\"\n")
            .unwrap();
        assert_eq!(c.max_errors, 7);
        assert_eq!(c.max_iterations, 10);
        assert_eq!(c.executors["claude"].format, Format::Text);
        assert_eq!(c.executors["claude"].command[0], "claude");
    }

    #[test]
    fn errors_name_file_key_and_reason() {
        let e = Config::builtin_with("max_iterations = \"ten\"")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("extra") && e.contains("max_iterations") && e.contains("line 1"),
            "{e}"
        );
        let e = Config::builtin_with("max_iterationz = 3")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown field") && e.contains("max_iterationz"),
            "{e}"
        );
        let e = Config::builtin_with("max_errors = 0")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("extra") && e.contains("`max_errors`") && e.contains("at least 1"),
            "{e}"
        );
        let e = Config::builtin_with("[actions.develop]\nexecutor = \"nope\"")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("actions.develop.executor") && e.contains("unknown executor"),
            "{e}"
        );
        let e = Config::builtin_with("[executor_defaults]\ntimeout = 1e20")
            .unwrap_err()
            .to_string();
        assert!(e.contains("timeout") && e.contains("at most"), "{e}");
        let e = Config::builtin_with("[executor_defaults]\nkill_grace = -1.0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("kill_grace") && e.contains("positive"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }

    #[test]
    fn notify_receivers_are_checked_without_showing_their_url() {
        let c = Config::builtin_with(
            "[[notify]]\nurl = \"https://hooks.example/T0K3N\"\nevents = [\"failed\"]\n\
             [[notify]]\ncommand = [\"notify-send\"]\n",
        )
        .unwrap();
        assert!(c.notify[0].wants("failed") && !c.notify[0].wants("completed"));
        assert!(c.notify[1].wants("needs_input"));
        assert_eq!(c.notify[1].timeout(), Duration::from_secs(10));
        assert!(!format!("{c:?}").contains("T0K3N"));
        for (toml, expected) in [
            (
                "url = \"http://h/T0K3N\"\ncommand = [\"x\"]",
                "both `url` and `command`",
            ),
            ("events = [\"failed\"]", "needs `url`"),
            ("url = \"ftp://h/T0K3N\"", "http:// or https://"),
            ("command = []", "non-empty list"),
            (
                "url = \"http://h/T0K3N\"\nevents = [\"complete\"]",
                "unknown event \"complete\"; did you mean \"completed\"?",
            ),
            ("command = [\"x\"]\nevents = []", "`events` is empty"),
            ("command = [\"x\"]\ntimeout = 0.0", "`timeout` must be"),
        ] {
            let e = Config::builtin_with(&format!("[[notify]]\n{toml}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("extra, key `notify`: entry 1: ") && e.contains(expected),
                "{toml}: {e}"
            );
            assert!(!e.contains("T0K3N") && !e.contains('\n'), "{e}");
        }
        // A line the parser refuses is quoted, unless it holds a URL.
        let e = Config::builtin_with("[[notify]]\nurl = \"https://h/T0K3N\"\nurll = 1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 3 (urll = 1)"), "{e}");
        let e = Config::builtin_with("[[notify]]\nurl = \"https://h/T0K3N\" x\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2 (a line with a URL, not shown)"), "{e}");
        assert!(!e.contains("T0K3N"), "{e}");
    }
}
