//! What the benchmarks share: a temporary project driven through the real binary.
#![allow(dead_code)]

#[cfg(feature = "temporal")]
pub mod temporal;

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// A number from the environment, or `default`.
pub fn env_num(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// A project config for a benchmark: short retry backoff and kill grace, and one executor, `agent`,
/// run as `argv` with the prompt passed as `prompt` (`stdin`, `arg`), its output read as `format`
/// (`json`, `text`); with `validate`, validate runs that shell command instead. Its attempts are
/// sandboxed as by default, or as `LOOPD_BENCH_SANDBOX` says (`off`), their network as by
/// default (for a plain command: nothing, through loopd's proxy), or as `LOOPD_BENCH_NETWORK`
/// says (a `sandbox_network` value: `'"any"'`).
pub fn config(argv: &[&str], prompt: &str, format: &str, validate: Option<&str>) -> String {
    let argv: Vec<String> = argv.iter().map(|a| format!("{a:?}")).collect();
    let mut text = format!(
        r#"
retry_backoff = 0.01
executor = "agent"
# The benches' loops go round on purpose (a validate that never passes), to time many actions.
no_progress_rounds = 0

[executor_defaults]
kill_grace = 0.5
sandbox = "{sandbox}"

[executors.agent]
command = [{}]
prompt = "{prompt}"
format = "{format}"
"#,
        argv.join(", "),
        sandbox = std::env::var("LOOPD_BENCH_SANDBOX").unwrap_or_else(|_| "workspace-write".into()),
    );
    if let Ok(network) = std::env::var("LOOPD_BENCH_NETWORK") {
        text = text.replacen(
            "[executor_defaults]\n",
            &format!("[executor_defaults]\nsandbox_network = {network}\n"),
            1,
        );
    }
    if let Some(command) = validate {
        text.push_str(&format!("\n[actions.validate]\ncommand = {command:?}\n"));
    }
    text
}

/// A temporary directory in `$LOOPD_BENCH_DIR`, else the system's.
pub fn tempdir() -> tempfile::TempDir {
    match std::env::var_os("LOOPD_BENCH_DIR") {
        Some(d) => tempfile::tempdir_in(d).expect("tempdir in LOOPD_BENCH_DIR"),
        None => tempfile::tempdir().expect("tempdir"),
    }
}

/// A project with `config` as its `.loop/config.toml` and, if given, `bin/agent.sh`.
pub struct Project {
    _dir: tempfile::TempDir,
    pub root: PathBuf,
    /// `$HOME` of its commands: the root, or a home shared by several projects (one service).
    pub home: PathBuf,
}

impl Project {
    pub fn new(config: &str, agent: Option<&str>) -> Project {
        Project::in_home(config, agent, None)
    }

    /// A project whose commands run with `$HOME` set to `home` (else its root).
    pub fn in_home(config: &str, agent: Option<&str>, home: Option<&std::path::Path>) -> Project {
        Project::make(config, agent, home, None)
    }

    /// A project in a new temporary directory of `parent` (a filesystem to measure).
    pub fn in_dir(config: &str, agent: Option<&str>, parent: &std::path::Path) -> Project {
        Project::make(config, agent, None, Some(parent))
    }

    fn make(
        config: &str,
        agent: Option<&str>,
        home: Option<&std::path::Path>,
        parent: Option<&std::path::Path>,
    ) -> Project {
        let dir = match parent {
            Some(parent) => tempfile::tempdir_in(parent).expect("tempdir"),
            None => tempdir(),
        };
        let root = dir.path().canonicalize().expect("canonical tempdir");
        std::fs::create_dir_all(root.join(".loop")).expect("mkdir .loop");
        std::fs::create_dir_all(root.join("bin")).expect("mkdir bin");
        std::fs::write(root.join(".loop/config.toml"), config).expect("write config");
        if let Some(agent) = agent {
            std::fs::write(root.join("bin/agent.sh"), agent).expect("write agent");
        }
        let p = Project {
            _dir: dir,
            home: home.map_or_else(|| root.clone(), ToOwned::to_owned),
            root,
        };
        let trusted = p.loopd().arg("trust").output().expect("run loopd trust");
        assert!(
            trusted.status.success(),
            "loopd trust failed: {}",
            String::from_utf8_lossy(&trusted.stderr)
        );
        p
    }

    /// `loopd --root ROOT`, isolated from the user's environment and config.
    pub fn loopd(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_loopd"));
        cmd.arg("--root")
            .arg(&self.root)
            .current_dir(&self.root)
            .env("HOME", &self.home)
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("XDG_STATE_HOME")
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove("LOOPD_CONFIG")
            .env_remove("LOOPD_ROOT")
            .env_remove("LOOPD_LOG")
            .stdin(Stdio::null());
        cmd
    }

    /// `loopd run ID` in the background, its output discarded.
    pub fn spawn_run(&self, id: &str) -> std::process::Child {
        self.loopd()
            .args(["run", id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("loopd run")
    }

    /// A new loop with this iteration limit; its id.
    pub fn create(&self, max_iterations: usize) -> String {
        let out = self
            .loopd()
            .args(["create", "--title", "t", "--max-iterations"])
            .arg(max_iterations.to_string())
            .output()
            .expect("run loopd create");
        assert!(
            out.status.success(),
            "create failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .expect("utf8")
            .trim()
            .to_owned()
    }

    pub fn progress(&self, id: &str) -> PathBuf {
        self.root.join(".loop").join(format!("{id}.progress"))
    }

    /// The loop's events, parsed.
    pub fn events(&self, id: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.progress(id).join("events.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

/// A `kB` figure of process `pid`'s `/proc/PID/status` (`key` with its colon: `VmHWM:`), 0 once
/// the process is gone.
pub fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The median of some measures (NaN for none).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Whether a process is alive (not a zombie).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .unwrap_or("X");
        !matches!(state, "Z" | "X" | "x")
    })
}

/// Milliseconds, as a float.
pub fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs git in `dir` as the benchmark's author; panics with git's words if it fails.
pub fn git(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "bench")
        .env("GIT_AUTHOR_EMAIL", "bench@localhost")
        .env("GIT_COMMITTER_NAME", "bench")
        .env("GIT_COMMITTER_EMAIL", "bench@localhost")
        .stdin(Stdio::null())
        .output()
        .expect("run git");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The CPU time of process `pid` in clock ticks ([`tick_ms`]): its own (utime + stime), and with
/// that of its children it has waited for (cutime + cstime).
pub fn cpu_ticks_with_children(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let fields: Vec<u64> = stat[stat.rfind(')').expect("comm") + 2..]
        .split_whitespace()
        .skip(11)
        .take(4)
        .map(|f| f.parse().expect("a CPU time"))
        .collect();
    let own = fields[0] + fields[1];
    (own, own + fields[2] + fields[3])
}

/// The CPU time of process `pid`, its own (utime + stime), in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    cpu_ticks_with_children(pid).0
}

/// A clock tick, in ms.
pub fn tick_ms() -> f64 {
    1000.0
        / nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .unwrap_or(100) as f64
}
