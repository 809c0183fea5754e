//! `loopd doctor`: what this project's loops would run, and whether it is there.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::cli::Project;

/// How long `--version` may take.
const VERSION_TIMEOUT: Duration = Duration::from_secs(5);

/// Prints the report; exit code 0 when every executor the actions use is installed and the
/// project's files are trusted, else 1.
pub fn run(p: &Project, executor: Option<String>) -> Result<i32> {
    let workflow = crate::workflow::by_name(&p.config.workflow)
        .ok_or_else(|| anyhow::anyhow!("unknown workflow {}", p.config.workflow))?;
    let daemon = crate::daemon::build(p, workflow, executor, false)?;

    let mut out = String::new();
    let _ = writeln!(out, "loopd {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(out, "  root       {}", p.root.display());
    let _ = writeln!(out, "  state dir  {}", p.store.dir().display());
    let _ = writeln!(out, "  config     built-in config.toml");
    for (file, _) in crate::config::Config::layer_files(&p.root, p.config_flag.as_deref()) {
        let present = if file.exists() { "" } else { " (absent)" };
        let _ = writeln!(out, "             {}{present}", file.display());
    }
    let _ = writeln!(out, "  workflow   {}", workflow.name());
    let untrusted = match crate::trust::verdict(&p.root, &daemon.project_files()) {
        crate::trust::Verdict::NothingToTrust => {
            let _ = writeln!(
                out,
                "  trust      nothing to trust (no project config or action files)"
            );
            None
        }
        crate::trust::Verdict::Trusted(n) => {
            let _ = writeln!(
                out,
                "  trust      trusted ({n} project file{})",
                if n == 1 { "" } else { "s" }
            );
            None
        }
        crate::trust::Verdict::Untrusted(u) => {
            let _ = writeln!(out, "  trust      {u}");
            Some(u)
        }
    };

    let _ = writeln!(out, "\nexecutors");
    let width = p
        .config
        .executors
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(0);
    for (name, e) in &p.config.executors {
        let program = &e.command[0];
        let line = match find_program(program) {
            Some(path) => format!("{}  {}", path.display(), version(&path)),
            None => format!("{program}: not found on PATH"),
        };
        let _ = writeln!(out, "  {name:<width$}  {line}");
    }

    let _ = writeln!(out, "\nactions");
    let mut missing = Vec::new();
    let sources: std::collections::BTreeMap<&str, &str> = daemon.action_sources().collect();
    for action in workflow.actions() {
        let (Some(plan), Some(source)) = (daemon.plans().get(*action), sources.get(action)) else {
            continue;
        };
        let sup = &plan.supervision;
        let _ = writeln!(
            out,
            "  {action:<9} {:<8} {}\n            format {}, timeout {}s, idle {}s; prompt from {source}",
            plan.executor,
            plan.argv.join(" "),
            plan.format.name(),
            sup.timeout.as_secs_f64(),
            sup.idle_timeout.as_secs_f64()
        );
        if find_program(&plan.argv[0]).is_none() && !missing.contains(&plan.argv[0]) {
            missing.push(plan.argv[0].clone());
        }
    }
    if nix::unistd::geteuid().is_root()
        && daemon.plans().values().any(|plan| {
            plan.argv
                .iter()
                .any(|a| a == "--dangerously-skip-permissions")
        })
    {
        let _ = writeln!(
            out,
            "\nnote: running as root, Claude Code refuses --dangerously-skip-permissions unless \
             IS_SANDBOX=1 is in its environment ([executors.claude.env])"
        );
    }
    if let Some(u) = &untrusted {
        let _ = writeln!(
            out,
            "\nnot ready: {} is not trusted; run `{}`",
            u.file.display(),
            crate::trust::trust_command(&p.root)
        );
    } else if missing.is_empty() {
        let _ = writeln!(out, "\nready: every action's executor is installed");
    }
    if !missing.is_empty() {
        let _ = writeln!(out, "\nnot ready: missing {}", missing.join(", "));
    }
    crate::out!("{out}")?;
    Ok(if missing.is_empty() && untrusted.is_none() {
        0
    } else {
        1
    })
}

/// Where `program` is: itself if it has a slash, else the first executable on PATH.
pub fn find_program(program: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return executable(&p).then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
}

/// The first line `PROGRAM --version` prints, within [`VERSION_TIMEOUT`].
fn version(program: &Path) -> String {
    let child = Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else {
        return "(cannot run it)".into();
    };
    let deadline = Instant::now() + VERSION_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return "(no answer to --version)".into();
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
}
