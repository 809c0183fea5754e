//! `loopd doctor`: what this project's loops would run, and whether it is there.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Result;

use loopd_file_driver::project::Project;

/// How long `--version` may take (gemini-cli takes about 7 s on 2 cores).
const VERSION_TIMEOUT: Duration = Duration::from_secs(15);

/// What `doctor` found: rendered as text, or printed as it is with `--json`.
#[derive(Debug, serde::Serialize)]
struct Report {
    version: &'static str,
    root: PathBuf,
    state_dir: PathBuf,
    /// The config layers over the built-in one, each with whether it exists.
    config_files: Vec<ConfigFile>,
    workflow: &'static str,
    /// `nothing to trust`, `trusted (N project files)`, or why a file is not trusted.
    trust: String,
    /// The sandbox this machine offers.
    sandbox: loopd_exec::sandbox::Support,
    executors: Vec<ExecutorReport>,
    actions: Vec<ActionReport>,
    /// What keeps a loop from running; empty when ready.
    problems: Vec<String>,
    /// Notes that keep nothing from running.
    notes: Vec<String>,
    ready: bool,
}

#[derive(Debug, serde::Serialize)]
struct ConfigFile {
    path: PathBuf,
    present: bool,
}

#[derive(Debug, serde::Serialize)]
struct ExecutorReport {
    name: String,
    command: Vec<String>,
    /// Where the program is; `None` when it is not on PATH.
    path: Option<PathBuf>,
    version: Option<String>,
    login: Option<String>,
}

#[derive(Debug, serde::Serialize)]
struct ActionReport {
    action: &'static str,
    executor: String,
    argv: Vec<String>,
    format: &'static str,
    timeout_secs: f64,
    idle_timeout_secs: f64,
    prompt_from: String,
    /// What its attempts may do, in a few words.
    sandbox: String,
}

/// Prints the report; exit code 0 when every executor the actions use is installed and the
/// project's files are trusted, else 1.
pub fn run(p: &Project, executor: Option<String>, as_json: bool) -> Result<i32> {
    let report = examine(p, executor)?;
    if as_json {
        crate::outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        crate::out!("{}", render(&report))?;
    }
    Ok(if report.ready { 0 } else { 1 })
}

fn examine(p: &Project, executor: Option<String>) -> Result<Report> {
    let workflow = loopd_core::workflow::by_name(&p.config.workflow)
        .ok_or_else(|| anyhow::anyhow!("unknown workflow {}", p.config.workflow))?;
    let daemon = loopd_file_driver::daemon::build(p, workflow, executor, false)?;
    let config_files =
        loopd_project::config::Config::layer_files(Some(&p.root), p.config_flag.as_deref())
            .into_iter()
            .map(|(path, _)| ConfigFile {
                present: path.exists(),
                path,
            })
            .collect();
    let mut problems = Vec::new();
    let trust = match loopd_project::trust::verdict(&p.root, &daemon.project_files()) {
        loopd_project::trust::Verdict::NothingToTrust => {
            "nothing to trust (no project config or action files)".to_owned()
        }
        loopd_project::trust::Verdict::Trusted(n) => {
            format!(
                "trusted ({n} project file{})",
                if n == 1 { "" } else { "s" }
            )
        }
        loopd_project::trust::Verdict::Untrusted(u) => {
            problems.push(format!(
                "{} is not trusted; run `{}`",
                u.file.display(),
                loopd_project::trust::trust_command(&p.root)
            ));
            u.to_string()
        }
    };

    // `--version` of every installed executor at once: some CLIs take seconds to answer.
    let found: Vec<Option<PathBuf>> = p
        .config
        .executors
        .values()
        .map(|e| find_program(&e.command[0]))
        .collect();
    let mut versions = versions(found.iter().flatten()).into_iter();
    let executors = p
        .config
        .executors
        .iter()
        .zip(found)
        .map(|((name, e), path)| ExecutorReport {
            name: name.clone(),
            command: e.command.clone(),
            version: path.as_ref().and_then(|_| versions.next()),
            login: path.as_ref().and_then(|_| login(e)),
            path,
        })
        .collect();

    let mut missing = Vec::new();
    let sources: std::collections::BTreeMap<&str, &str> = daemon.action_sources().collect();
    let mut actions = Vec::new();
    for action in workflow.actions() {
        let (Some(plan), Some(source)) = (daemon.plans().get(*action), sources.get(action)) else {
            continue;
        };
        let sup = &plan.supervision;
        actions.push(ActionReport {
            action,
            executor: plan.executor.clone(),
            argv: plan.argv.clone(),
            format: plan.format.name(),
            timeout_secs: sup.timeout.as_secs_f64(),
            idle_timeout_secs: sup.idle_timeout.as_secs_f64(),
            prompt_from: (*source).to_owned(),
            sandbox: sandbox_text(&plan.sandbox),
        });
        if find_program(&plan.argv[0]).is_none() && !missing.contains(&plan.argv[0]) {
            missing.push(plan.argv[0].clone());
        }
    }
    if !missing.is_empty() {
        problems.push(format!("missing {}", missing.join(", ")));
    }
    let mut notes = Vec::new();
    if nix::unistd::geteuid().is_root()
        && daemon.plans().values().any(|plan| {
            plan.argv
                .iter()
                .any(|a| a == "--dangerously-skip-permissions")
        })
    {
        notes.push(
            "running as root, Claude Code refuses --dangerously-skip-permissions unless \
             IS_SANDBOX=1 is in its environment ([executors.claude.env])"
                .to_owned(),
        );
    }
    Ok(Report {
        version: env!("CARGO_PKG_VERSION"),
        root: p.root.clone(),
        state_dir: p.store.dir().to_owned(),
        config_files,
        workflow: workflow.name(),
        trust,
        sandbox: loopd_exec::sandbox::Support::probe(),
        executors,
        actions,
        ready: problems.is_empty(),
        problems,
        notes,
    })
}

/// What an action's attempts may do, in a few words: `workspace-write, network any, also
/// writes ~/.claude`.
fn sandbox_text(policy: &loopd_exec::sandbox::Policy) -> String {
    if policy.mode == loopd_exec::sandbox::Mode::Off {
        return "off".to_owned();
    }
    let mut text = format!("{}, network {}", policy.mode.name(), policy.network);
    let list = |paths: &[PathBuf]| -> String {
        paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !policy.writable.is_empty() && policy.mode == loopd_exec::sandbox::Mode::WorkspaceWrite {
        let _ = write!(text, ", also writes {}", list(&policy.writable));
    }
    if !policy.readable.is_empty() {
        let _ = write!(text, ", reads {}", list(&policy.readable));
    }
    if !policy.sockets.is_empty() {
        let _ = write!(text, ", connects to {}", list(&policy.sockets));
    }
    text
}

/// The report as people read it.
fn render(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "loopd {}", r.version);
    let _ = writeln!(out, "  root       {}", r.root.display());
    let _ = writeln!(out, "  state dir  {}", r.state_dir.display());
    let _ = writeln!(out, "  config     built-in config.toml");
    for file in &r.config_files {
        let present = if file.present { "" } else { " (absent)" };
        let _ = writeln!(out, "             {}{present}", file.path.display());
    }
    let _ = writeln!(out, "  workflow   {}", r.workflow);
    let _ = writeln!(out, "  trust      {}", r.trust);
    let _ = writeln!(out, "  sandbox    {}", r.sandbox.describe());

    let _ = writeln!(out, "\nexecutors");
    let width = r.executors.iter().map(|e| e.name.len()).max().unwrap_or(0);
    for e in &r.executors {
        let line = match &e.path {
            Some(path) => format!(
                "{}  {}",
                path.display(),
                e.version.as_deref().unwrap_or_default()
            ),
            None => format!("{}: not found on PATH", e.command[0]),
        };
        let _ = writeln!(out, "  {:<width$}  {line}", e.name);
        let _ = writeln!(out, "  {:<width$}  runs {}", "", e.command.join(" "));
        if let Some(login) = &e.login {
            let _ = writeln!(out, "  {:<width$}  login: {login}", "");
        }
    }

    let _ = writeln!(out, "\nactions");
    for a in &r.actions {
        let _ = writeln!(
            out,
            "  {:<9} {:<8} {}\n            format {}, timeout {}s, idle {}s; prompt from {}\n            \
             sandbox {}",
            a.action,
            a.executor,
            a.argv.join(" "),
            a.format,
            a.timeout_secs,
            a.idle_timeout_secs,
            a.prompt_from,
            a.sandbox
        );
    }
    for note in &r.notes {
        let _ = writeln!(out, "\nnote: {note}");
    }
    if r.ready {
        let _ = writeln!(out, "\nready: every action's executor is installed");
    }
    for problem in &r.problems {
        let _ = writeln!(out, "\nnot ready: {problem}");
    }
    out
}

/// Where `program` is: itself if it has a slash, else the first executable on PATH.
pub fn find_program(program: &str) -> Option<PathBuf> {
    loopd_exec::find_program_in(program, Path::new("."), std::env::var_os("PATH").as_deref())
}

/// The first line `PROGRAM --version` prints, for each program, all run at once within
/// [`VERSION_TIMEOUT`].
fn versions<'a>(programs: impl Iterator<Item = &'a PathBuf>) -> Vec<String> {
    let children: Vec<_> = programs
        .map(|program| {
            Command::new(program)
                .arg("--version")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
        })
        .collect();
    let deadline = Instant::now() + VERSION_TIMEOUT;
    children
        .into_iter()
        .map(|child| {
            let Ok(mut child) = child else {
                return "(cannot run it)".to_owned();
            };
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return "(no answer to --version)".to_owned();
                    }
                }
            }
            let output = child
                .wait_with_output()
                .map(|o| o.stdout)
                .unwrap_or_default();
            String::from_utf8_lossy(&output)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_owned()
        })
        .collect()
}

/// The variable that holds the key of Codex's chosen model provider (`model_provider` and its
/// `env_key` in `CODEX_HOME/config.toml`), if it names one.
fn codex_provider_key(codex_home: &Path) -> Option<String> {
    let text = loopd_fs::read_text(&codex_home.join("config.toml")).ok()?;
    let config: toml::Table = toml::from_str(&text).ok()?;
    let provider = config.get("model_provider")?.as_str()?;
    let key = config
        .get("model_providers")?
        .get(provider)?
        .get("env_key")?;
    key.as_str().map(str::to_owned)
}

/// Whether an agent CLI has a login or a key, as far as loopd can tell without asking it (and
/// without printing a secret): a key in its environment (the daemon's, then the executor's
/// `env`), else its login file under its home. `None` for an executor that is no agent CLI.
fn login(e: &loopd_project::config::ExecutorConfig) -> Option<String> {
    let program = Path::new(&e.command[0]).file_name()?.to_str()?;
    let var = |k: &str| {
        e.env
            .get(k)
            .cloned()
            .or_else(|| std::env::var(k).ok())
            .filter(|v| !v.is_empty())
    };
    let home = PathBuf::from(var("HOME").unwrap_or_default());
    let codex_home = var("CODEX_HOME").map_or_else(|| home.join(".codex"), PathBuf::from);
    let codex_key = codex_provider_key(&codex_home);
    let codex_keys: Vec<&str> = codex_key
        .as_deref()
        .into_iter()
        .chain(["OPENAI_API_KEY", "CODEX_API_KEY"])
        .collect();
    let (keys, files, how): (&[&str], Vec<PathBuf>, &str) = match program {
        "claude" => (
            &[
                "ANTHROPIC_API_KEY",
                "ANTHROPIC_AUTH_TOKEN",
                "CLAUDE_CODE_OAUTH_TOKEN",
            ],
            vec![home.join(".claude/.credentials.json")],
            "run `claude` once and /login, or set ANTHROPIC_API_KEY in [executors.claude.env]",
        ),
        "codex" => (
            &codex_keys,
            vec![codex_home.join("auth.json")],
            "run `codex login`, or set OPENAI_API_KEY in [executors.codex.env]",
        ),
        "gemini" => (
            &[
                "GEMINI_API_KEY",
                "GOOGLE_API_KEY",
                "GOOGLE_GENAI_USE_VERTEXAI",
                "GOOGLE_GENAI_USE_GCA",
            ],
            vec![home.join(".gemini/oauth_creds.json")],
            "run `gemini` once to log in, or set GEMINI_API_KEY in [executors.gemini.env]",
        ),
        "qwen" => (
            &["OPENAI_API_KEY", "DASHSCOPE_API_KEY"],
            vec![home.join(".qwen/oauth_creds.json")],
            "run `qwen` once to log in, or set OPENAI_API_KEY, OPENAI_BASE_URL and OPENAI_MODEL \
             in [executors.qwen.env]",
        ),
        _ => return None,
    };
    if let Some(key) = keys.iter().find(|k| var(k).is_some()) {
        return Some(format!("{key} is set"));
    }
    if let Some(file) = files.iter().find(|f| f.is_file()) {
        return Some(format!("logged in ({})", file.display()));
    }
    Some(format!("none found: {how}"))
}
