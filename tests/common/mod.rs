//! Test helpers: a temporary project driven through the real `loopd` binary, with fake executors
//! written as small shell scripts.
#![allow(dead_code)]

pub mod http;
pub mod prometheus;
#[cfg(feature = "temporal")]
pub mod temporal;
pub mod tries;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A generous bound for any wait in a test: it catches a hang, it measures nothing.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Config for tests: short backoff and grace so failures are quick.
pub const TEST_CONFIG: &str = r#"
retry_backoff = 0.01
executor = "fake"

[executor_defaults]
kill_grace = 0.5

[executors.fake]
command = ["sh", "bin/agent.sh"]
prompt = "stdin"
format = "json"
"#;

/// An agent that plans two tasks, develops them (each adds a line to `f.txt`, as it says), and
/// passes validation.
pub const GOOD_AGENT: &str = r#"
cat > /dev/null
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","summary":"planned","state_updates":{"tasks":[{"description":"first"},{"description":"second"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop) echo "$LOOPD_TASK_ID" >> f.txt; echo "{\"status\":\"success\",\"summary\":\"did $LOOPD_TASK_ID\",\"files_changed\":[\"f.txt\"]}" > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","summary":"ok","state_updates":{"passed":true,"pass_rate":100}}' > "$LOOPD_RESULT_FILE" ;;
  debug) echo '{"status":"success","summary":"nothing"}' > "$LOOPD_RESULT_FILE" ;;
  complete) echo '{"status":"success","summary":"done","state_updates":{"summary":"all done"}}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

/// A scripted agent for every skill-tuning action: nothing found, so the gate passes at the
/// report. `diagnose-memory` first waits for `go` in the project root when `hold` exists there,
/// writing its pid to `agent.pid`.
pub const TUNING_AGENT: &str = r#"
cat > /dev/null
if [ "$LOOPD_ACTION" = diagnose-memory ] && [ -f hold ]; then
  echo $$ > agent.pid
  i=0; while [ ! -f go ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done
fi
case "$LOOPD_ACTION" in
  analyze-requirements) r='{"status":"success","summary":"clear","state_updates":{"coverage":"satisfied"}}' ;;
  diagnose-*) r='{"status":"success","summary":"nothing","state_updates":{"issues":[]}}' ;;
  propose-fixes) r='{"status":"success","state_updates":{"fixes":[]}}' ;;
  *) r='{"status":"success","summary":"done"}' ;;
esac
echo "$r" > "$LOOPD_RESULT_FILE"
"#;

/// A project with the skill `skills/s` to tune, and `agent` as its executor.
pub fn tuning_project(agent: &str) -> Project {
    let p = Project::new(agent);
    std::fs::create_dir_all(p.root.join("skills/s")).unwrap();
    std::fs::write(p.root.join("skills/s/SKILL.md"), "# s\n").unwrap();
    p
}

pub struct Project {
    _dir: Option<tempfile::TempDir>,
    pub root: PathBuf,
    /// `$HOME` of its commands: the root, or another project's, to share one user's service.
    pub home: PathBuf,
}

/// A project's daemons (`loopd start`, `resume`, `retry`, a daemon a test left behind) end with
/// it: every loop's daemon lock still held names a live daemon of the project.
impl Drop for Project {
    fn drop(&mut self) {
        if self._dir.is_none() {
            return;
        }
        let Ok(entries) = std::fs::read_dir(self.root.join(".loop")) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "daemon") {
                continue;
            }
            let held =
                |path: &Path| std::fs::File::open(path).is_ok_and(|f| f.try_lock_shared().is_err());
            if !held(&path) {
                continue;
            }
            let pid = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| t.split_whitespace().next()?.parse::<u32>().ok());
            if let Some(pid) = pid.filter(|&pid| pid > 1 && pid != std::process::id()) {
                end_pid(pid, || !held(&path) || !alive(pid));
            }
        }
    }
}

impl Project {
    /// Another handle on the project in `root` (of the user whose `$HOME` is `home`), for a
    /// thread of the test: it removes nothing when dropped.
    pub fn at(root: PathBuf, home: PathBuf) -> Project {
        Project {
            _dir: None,
            root,
            home,
        }
    }

    /// A project whose `.loop/config.toml` is [`TEST_CONFIG`] and whose agent is `agent`.
    pub fn new(agent: &str) -> Project {
        Project::make(agent, None)
    }

    /// A project of the same user as `other` (its `$HOME`): one service serves both.
    pub fn beside(other: &Project, agent: &str) -> Project {
        Project::make(agent, Some(&other.home))
    }

    fn make(agent: &str, home: Option<&Path>) -> Project {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().canonicalize().expect("canonical tempdir");
        std::fs::create_dir_all(root.join(".loop")).expect("mkdir .loop");
        std::fs::create_dir_all(root.join("bin")).expect("mkdir bin");
        let p = Project {
            _dir: Some(dir),
            home: home.map_or_else(|| root.clone(), Path::to_owned),
            root,
        };
        p.config(TEST_CONFIG);
        p.agent(agent);
        p
    }

    /// Writes `.loop/config.toml` and trusts it, as its author would (a config that does not load
    /// cannot be trusted; the commands under test then report why).
    pub fn config(&self, toml: &str) {
        std::fs::write(self.root.join(".loop/config.toml"), toml).expect("write config");
        self.trust();
    }

    /// Writes the project's action file `.loop/actions/ccw-loop/NAME.md` and trusts it.
    pub fn action_file(&self, name: &str, text: &str) -> PathBuf {
        let dir = self.root.join(".loop/actions/ccw-loop");
        std::fs::create_dir_all(&dir).expect("mkdir actions");
        let path = dir.join(format!("{name}.md"));
        std::fs::write(&path, text).expect("write action file");
        self.trust();
        path
    }

    /// `loopd trust`; returns whether it succeeded.
    pub fn trust(&self) -> bool {
        self.output(&["trust"]).status.success()
    }

    pub fn agent(&self, body: &str) {
        self.script("agent.sh", body);
    }

    /// Writes `bin/NAME` (a shell script) and returns its path.
    pub fn script(&self, name: &str, body: &str) -> PathBuf {
        let path = self.root.join("bin").join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}")).expect("write script");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
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
            .env_remove("NOTIFY_SOCKET")
            .env_remove("JOURNAL_STREAM")
            .env_remove("LOOPD_CONFIG")
            .env_remove("LOOPD_ROOT")
            .env_remove("LOOPD_TEMPORAL")
            .env_remove("LOOPD_LOG")
            .stdin(Stdio::null());
        // Nor the Temporal CLI's settings of whoever runs the tests.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("TEMPORAL_") {
                cmd.env_remove(name);
            }
        }
        cmd
    }

    pub fn output(&self, args: &[&str]) -> Output {
        self.loopd().args(args).output().expect("run loopd")
    }

    /// `loopd create ARGS...`; returns the id.
    pub fn create(&self, args: &[&str]) -> String {
        let mut all = vec!["create"];
        all.extend_from_slice(args);
        let out = self.output(&all);
        assert!(out.status.success(), "create failed: {}", stderr(&out));
        String::from_utf8(out.stdout)
            .expect("utf8")
            .trim()
            .to_owned()
    }

    /// `loopd run ID ARGS...` to its end, bounded by [`DEADLINE`].
    pub fn run(&self, id: &str, args: &[&str]) -> Output {
        let child: Child = self
            .loopd()
            .args(["run", id])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn loopd run");
        wait_output(child, DEADLINE)
    }

    /// `loopd run ID ARGS...` in the background, its output drained as it comes.
    pub fn spawn_run(&self, id: &str, args: &[&str]) -> Running {
        self.loopd()
            .args(["run", id])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn loopd run")
            .into()
    }

    pub fn state_path(&self, id: &str) -> PathBuf {
        self.root.join(".loop").join(format!("{id}.json"))
    }

    pub fn state(&self, id: &str) -> Value {
        let text = std::fs::read(self.state_path(id)).expect("read state");
        serde_json::from_slice(&text).expect("state parses")
    }

    pub fn progress(&self, id: &str) -> PathBuf {
        self.root.join(".loop").join(format!("{id}.progress"))
    }

    /// The events of a loop, parsed.
    pub fn events(&self, id: &str) -> Vec<Value> {
        let text =
            std::fs::read_to_string(self.progress(id).join("events.jsonl")).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str(l).expect("event parses"))
            .collect()
    }

    /// The events of the loop called `name`, in order.
    pub fn events_named(&self, id: &str, name: &str) -> Vec<Value> {
        self.events(id)
            .into_iter()
            .filter(|e| e["event"] == name)
            .collect()
    }

    /// The tasks whose develop finished, in the order they finished (repeats included).
    pub fn developed(&self, id: &str) -> Vec<String> {
        self.events(id)
            .iter()
            .filter(|e| e["event"] == "action_finished" && e["action"] == "develop")
            .map(|e| e["task_id"].as_str().unwrap_or("").to_owned())
            .collect()
    }

    pub fn event_names(&self, id: &str) -> Vec<String> {
        self.events(id)
            .iter()
            .map(|e| e["event"].as_str().unwrap_or("").to_owned())
            .collect()
    }
}

/// The exit code, or -1 for a death by signal.
pub fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A child process whose stdout and stderr are read as they come (a full pipe would block it).
pub struct Running {
    child: Child,
    stdout: Option<std::thread::JoinHandle<Vec<u8>>>,
    stderr: Option<std::thread::JoinHandle<Vec<u8>>>,
}

fn drain(
    pipe: Option<impl std::io::Read + Send + 'static>,
) -> Option<std::thread::JoinHandle<Vec<u8>>> {
    pipe.map(|mut pipe| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    })
}

/// Ends a child of the test that is still running, and reaps it: SIGTERM (a daemon then ends its
/// executor's process group and exits), a bound, then SIGKILL.
pub fn end_child(child: &mut Child) {
    // Reaped already (waited for by the test): its pid may be another process's by now.
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    end_pid(child.id(), || matches!(child.try_wait(), Ok(Some(_))));
    let _ = child.kill();
    let _ = child.wait();
}

/// Ends process `pid` (SIGTERM, then SIGKILL past [`DEADLINE`]); `gone` tells when it has.
fn end_pid(pid: u32, mut gone: impl FnMut() -> bool) {
    use nix::sys::signal::{Signal, kill};
    let pid_t = nix::unistd::Pid::from_raw(pid as i32);
    let _ = kill(pid_t, Signal::SIGTERM);
    let deadline = Instant::now() + DEADLINE;
    while Instant::now() < deadline {
        if gone() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = kill(pid_t, Signal::SIGKILL);
}

/// A child that ends when its handle is dropped, whether the test passed or panicked.
impl Drop for Running {
    fn drop(&mut self) {
        end_child(&mut self.child);
    }
}

impl From<Child> for Running {
    fn from(mut child: Child) -> Running {
        let stdout = drain(child.stdout.take());
        let stderr = drain(child.stderr.take());
        Running {
            child,
            stdout,
            stderr,
        }
    }
}

impl std::ops::Deref for Running {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.child
    }
}

impl std::ops::DerefMut for Running {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

/// Waits for a child, killing it (and failing the test) past `limit`.
pub fn wait_output(child: impl Into<Running>, limit: Duration) -> Output {
    let mut run = child.into();
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = run.child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = run.child.kill();
            let _ = run.child.wait();
            let err = run.stderr.take().map(|h| h.join().unwrap_or_default());
            panic!(
                "loopd did not finish within {limit:?}\nstderr:\n{}",
                String::from_utf8_lossy(&err.unwrap_or_default())
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let join = |h: Option<std::thread::JoinHandle<Vec<u8>>>| {
        h.map(|h| h.join().unwrap_or_default()).unwrap_or_default()
    };
    Output {
        status,
        stdout: join(run.stdout.take()),
        stderr: join(run.stderr.take()),
    }
}

/// Waits for a running `loopd` to end, polling its peak RSS (`VmHWM`) meanwhile; returns its
/// output and the peak in KiB.
pub fn wait_watching_rss(mut child: Running) -> (Output, u64) {
    let pid = child.id();
    let mut peak_kib = 0u64;
    let deadline = Instant::now() + DEADLINE;
    while child.try_wait().expect("try_wait").is_none() {
        assert!(
            Instant::now() < deadline,
            "loopd did not end within {DEADLINE:?}"
        );
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status"))
            && let Some(kib) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        {
            peak_kib = peak_kib.max(kib);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    (wait_output(child, DEADLINE), peak_kib)
}

/// Polls `cond` until it holds, failing the test past [`DEADLINE`].
pub fn wait_for(what: &str, cond: impl FnMut() -> bool) {
    wait_for_telling(what, cond, String::new);
}

/// [`wait_for`], failing with what `tell` says (a daemon's log, say) past the deadline.
pub fn wait_for_telling(what: &str, mut cond: impl FnMut() -> bool, tell: impl Fn() -> String) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}\n{}",
            tell()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether process `pid` lives: any of its threads (a process whose main thread ended alone shows
/// as a zombie, yet runs on in its other threads).
pub fn alive(pid: u32) -> bool {
    let live = |stat: &str| {
        let state = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .unwrap_or("X");
        !matches!(state, "Z" | "X")
    };
    std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| {
        tasks.filter_map(Result::ok).any(|task| {
            std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| live(&stat))
        })
    })
}

/// Whether the main thread of process `pid` has ended alone: it shows as a zombie while the
/// process lives on in another thread.
pub fn main_thread_ended_alone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/stat"))
        .is_ok_and(|stat| stat.contains(") Z "))
        && alive(pid)
}

/// Reads a pid a fake executor wrote to a file, once it is there.
pub fn read_pid(path: &Path) -> u32 {
    let mut pid = 0;
    wait_for(&format!("pid in {}", path.display()), || {
        pid = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        pid != 0
    });
    pid
}

/// `loopd demo ARGS...` with its temporary project in `dir` and the user's environment isolated.
pub fn demo(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_loopd"))
        .arg("demo")
        .args(args)
        .env("TMPDIR", dir)
        .env("HOME", dir)
        .env_remove("XDG_CONFIG_HOME")
        .env_remove("XDG_STATE_HOME")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("LOOPD_CONFIG")
        .env_remove("LOOPD_ROOT")
        .stdin(Stdio::null())
        .output()
        .expect("run loopd demo")
}

/// The state file a demo names in its output.
pub fn demo_state_file(out: &Output) -> PathBuf {
    let path = stdout(out)
        .lines()
        .find_map(|l| l.trim().strip_prefix("state").map(|p| p.trim().to_owned()))
        .expect("the demo names its state file");
    PathBuf::from(path)
}

/// An agent like the harness's `GOOD_AGENT` (init plans two tasks, develop adds a line to `f.txt`
/// and succeeds, validation passes), except that action `A` first runs the shell snippet given
/// for it in `before`.
pub fn agent(before: &[(&str, &str)]) -> String {
    let hook = |action: &str| {
        before
            .iter()
            .find(|(a, _)| *a == action)
            .map_or(":", |(_, snippet)| *snippet)
    };
    format!(
        r#"
cat > /dev/null
case "$LOOPD_ACTION" in
  init)
    {init}
    echo '{{"status":"success","summary":"planned","state_updates":{{"tasks":[{{"description":"first"}},{{"description":"second"}}]}}}}' > "$LOOPD_RESULT_FILE" ;;
  develop)
    {develop}
    echo "$LOOPD_TASK_ID" >> f.txt
    echo "{{\"status\":\"success\",\"summary\":\"did $LOOPD_TASK_ID\",\"files_changed\":[\"f.txt\"]}}" > "$LOOPD_RESULT_FILE" ;;
  validate)
    {validate}
    echo '{{"status":"success","summary":"ok","state_updates":{{"passed":true,"pass_rate":100}}}}' > "$LOOPD_RESULT_FILE" ;;
  debug)
    {debug}
    echo '{{"status":"success","summary":"nothing"}}' > "$LOOPD_RESULT_FILE" ;;
  complete)
    {complete}
    echo '{{"status":"success","summary":"done","state_updates":{{"summary":"all done"}}}}' > "$LOOPD_RESULT_FILE" ;;
esac
"#,
        init = hook("init"),
        develop = hook("develop"),
        validate = hook("validate"),
        debug = hook("debug"),
        complete = hook("complete"),
    )
}

/// Every kind of token a state's `skill_state.usage` counts, summed.
pub fn usage_tokens(usage: &Value) -> u64 {
    [
        "input_tokens",
        "output_tokens",
        "cache_read_tokens",
        "cache_write_tokens",
    ]
    .iter()
    .map(|k| usage[k].as_u64().unwrap_or(0))
    .sum()
}

/// Each entry of a `race_decided` event: its executor and the pass rate its check gave.
pub fn race_rates(decided: &Value) -> Vec<(String, f64)> {
    decided["entries"]
        .as_array()
        .expect("a race's entries")
        .iter()
        .map(|e| {
            let executor = e["executor"].as_str().expect("its executor").to_owned();
            (executor, e["pass_rate"].as_f64().expect("its pass rate"))
        })
        .collect()
}

/// Runs git in `dir` as a test's own setup or check (an identity of its own, no signing, no
/// input); its output, trimmed. Panics with git's words if it fails.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "commit.gpgsign=false"])
        .args(args)
        .env("GIT_AUTHOR_NAME", "test")
        .env("GIT_AUTHOR_EMAIL", "test@localhost")
        .env("GIT_COMMITTER_NAME", "test")
        .env("GIT_COMMITTER_EMAIL", "test@localhost")
        .env_remove("GIT_DIR")
        .env_remove("GIT_INDEX_FILE")
        .stdin(Stdio::null())
        .output()
        .expect("run git");
    assert!(
        out.status.success(),
        "git {args:?} in {}: {}",
        dir.display(),
        stderr(&out)
    );
    stdout(&out).trim_end().to_owned()
}

/// Waits (at most 20 s) until the file `$1` exists in the project root.
pub fn wait_for_file(name: &str) -> String {
    format!("i=0; while [ ! -e {name} ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done")
}

/// Rewrites the state file the way the CCW dashboard API does: read, edit, and a plain
/// truncate-and-write of the whole file (no temp file, no lock).
pub fn edit_raw(p: &Project, id: &str, edit: impl FnOnce(&mut Value)) {
    let mut state = p.state(id);
    edit(&mut state);
    std::fs::write(
        p.state_path(id),
        serde_json::to_vec_pretty(&state).expect("serialise"),
    )
    .expect("rewrite the state file");
}

/// A `loopd serve` of a test's user (`$HOME`), ended when dropped.
pub struct Service {
    pub child: Running,
    pub home: PathBuf,
}

impl Project {
    /// Starts `loopd serve ARGS...` for this project's user, and waits until it has published
    /// its status (it has looked at every loop it serves).
    pub fn serve<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> Service {
        self.serve_with(args, |_| {})
    }

    /// [`Project::serve`], with more of the command set by `with`.
    pub fn serve_with<S: AsRef<std::ffi::OsStr>>(
        &self,
        args: &[S],
        with: impl FnOnce(&mut Command),
    ) -> Service {
        let mut cmd = self.loopd();
        cmd.arg("serve")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        with(&mut cmd);
        let service = Service {
            child: cmd.spawn().expect("spawn loopd serve").into(),
            home: self.home.clone(),
        };
        wait_for("the service's status", || service.info().is_some());
        service
    }
}

impl Service {
    /// What the service says about itself in `serve.json`, once it is there.
    pub fn info(&self) -> Option<Value> {
        let path = self.home.join(".local/state/loopd/run/serve.json");
        let info: Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        (info["pid"] == self.child.id()).then_some(info)
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, signal).expect("signal the service");
    }

    /// SIGTERM, then its output once it exited.
    pub fn stop(mut self) -> Output {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let child = std::mem::replace(&mut self.child, dummy_running());
        wait_output(child, DEADLINE)
    }
}

/// A finished child in place of one taken out of a [`Service`].
fn dummy_running() -> Running {
    let mut child = Command::new("true").spawn().expect("spawn true");
    let _ = child.wait();
    child.into()
}

impl Drop for Service {
    fn drop(&mut self) {
        end_child(&mut self.child.child);
        // A failed test shows what the service logged.
        if std::thread::panicking()
            && let Some(log) = self.child.stderr.take().and_then(|h| h.join().ok())
        {
            eprintln!("the service's log:\n{}", String::from_utf8_lossy(&log));
        }
    }
}

/// Waits for the wall clock's next millisecond: a controller's stamp (`status_by.at`) counts in
/// milliseconds, so one made after this is later than anything the daemon did before it.
pub fn wait_for_the_next_millisecond() {
    let now = chrono::Utc::now().timestamp_millis();
    wait_for("the next millisecond", || {
        chrono::Utc::now().timestamp_millis() > now
    });
}

/// Sets a loop's status by an atomic rewrite of its state file stamped as loopd's controllers
/// stamp it (`status_by`: who set it, and when).
pub fn set_status_stamped(p: &Project, id: &str, status: &str, by: &str) {
    let mut state = p.state(id);
    state["status"] = status.into();
    state["status_by"] = serde_json::json!({
        "status": status,
        "by": by,
        "pid": std::process::id(),
        "at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    });
    replace_state(p, id, &state);
}

/// Sets a loop's status by an atomic rewrite of its state file, as a person's tool would.
pub fn set_status(p: &Project, id: &str, status: &str) {
    let mut state = p.state(id);
    state["status"] = status.into();
    replace_state(p, id, &state);
}

/// Puts `state` in place of the loop's state file, whole, by one rename.
fn replace_state(p: &Project, id: &str, state: &Value) {
    let tmp = p.root.join(".loop").join(format!(".{id}.edit"));
    std::fs::write(&tmp, serde_json::to_vec_pretty(state).expect("serialise")).expect("write");
    std::fs::rename(&tmp, p.state_path(id)).expect("rename");
}

/// The path of a program on `$PATH`.
pub fn which(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// What the CCW dashboard writes, exactly as it writes it (its v2 loop and task routes,
/// `loop-v2-routes.ts` and `loop-task-manager.ts`): whole files rewritten in place or appended
/// to, no temporary file, no lock.
pub mod ccw {
    use super::Project;
    use serde_json::{Value, json};
    use std::io::Write as _;
    use std::path::PathBuf;

    /// An id as CCW makes them: `loop-v2-YYYYMMDDTHHMMSS-xxxxxxxx`, `task-MILLIS-xxxxxxxx`.
    fn random_hex() -> String {
        use std::hash::{BuildHasher as _, Hasher as _};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(now_nanos());
        format!("{:08x}", h.finish() as u32)
    }

    fn now_nanos() -> u128 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    }

    fn now_iso() -> String {
        // `new Date().toISOString()` (UTC, milliseconds, `Z`), enough for the tests.
        let ms = now_nanos() / 1_000_000;
        format!("2026-11-25T00:00:{:02}.{:03}Z", (ms / 1000) % 60, ms % 1000)
    }

    /// `POST /api/loops/v2`: `JSON.stringify(loop, null, 2)`, no final newline.
    pub fn create_loop(p: &Project, title: &str) -> String {
        let id = format!("loop-v2-20261125T000000-{}", random_hex());
        let now = now_iso();
        let state = json!({
            "loop_id": id,
            "title": title,
            "description": "",
            "max_iterations": 10,
            "status": "created",
            "current_iteration": 0,
            "created_at": now,
            "updated_at": now,
        });
        write_state(p, &id, &state);
        id
    }

    fn write_state(p: &Project, id: &str, state: &Value) {
        std::fs::write(
            p.state_path(id),
            serde_json::to_string_pretty(state).unwrap(),
        )
        .unwrap();
    }

    /// `POST /api/loops/v2/:id/start` and the other status routes: read, change, rewrite whole.
    pub fn set_status(p: &Project, id: &str, status: &str) {
        let mut state = p.state(id);
        state["status"] = status.into();
        state["updated_at"] = now_iso().into();
        write_state(p, id, &state);
    }

    pub fn tasks_path(p: &Project, id: &str) -> PathBuf {
        p.root.join(".loop").join(id).join("tasks.jsonl")
    }

    /// `readTasks`: every non-empty line `JSON.parse`d; a line that does not parse is left out
    /// (with an error on CCW's console).
    pub fn tasks(p: &Project, id: &str) -> Vec<Value> {
        std::fs::read_to_string(tasks_path(p, id))
            .unwrap_or_default()
            .split('\n')
            .filter(|l| !l.trim().is_empty())
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(Value::is_object)
            .collect()
    }

    /// Whether a record is a whole `LoopTask` as CCW's routes make and read them.
    pub fn is_loop_task(task: &Value) -> bool {
        let text = |k: &str| task[k].as_str().is_some_and(|s| !s.trim().is_empty());
        text("task_id")
            && text("description")
            && text("tool")
            && ["analysis", "write", "review"].contains(&task["mode"].as_str().unwrap_or(""))
            && text("prompt_template")
            && task["order"].is_number()
            && text("created_at")
            && text("updated_at")
    }

    /// The file copied to `tasks.jsonl.backup` before each write (`copyFile`, in place).
    fn backup(p: &Project, id: &str) {
        let path = tasks_path(p, id);
        if let Ok(bytes) = std::fs::read(&path) {
            std::fs::write(path.with_extension("jsonl.backup"), bytes).unwrap();
        }
    }

    /// A new task as `addTask` makes it: order one past the highest (0 for the first).
    pub fn new_task(p: &Project, id: &str, description: &str) -> Value {
        let order = tasks(p, id)
            .iter()
            .filter_map(|t| t["order"].as_f64())
            .fold(-1.0, f64::max)
            + 1.0;
        let now = now_iso();
        json!({
            "task_id": format!("task-{}-{}", now_nanos() / 1_000_000, random_hex()),
            "description": description,
            "tool": "gemini",
            "mode": "write",
            "prompt_template": format!("Execute: {description}"),
            "order": order as u64,
            "created_at": now,
            "updated_at": now,
        })
    }

    /// `POST /api/loops/v2/:id/tasks`: the directory made, the file backed up, the record
    /// appended (`writeFile(path, JSON.stringify(task) + '\n', {flag: 'a'})`). Returns its id.
    pub fn add_task(p: &Project, id: &str, description: &str) -> String {
        let task = new_task(p, id, description);
        std::fs::create_dir_all(tasks_path(p, id).parent().unwrap()).unwrap();
        backup(p, id);
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(tasks_path(p, id))
            .unwrap();
        file.write_all(format!("{task}\n").as_bytes()).unwrap();
        task["task_id"].as_str().unwrap().to_owned()
    }

    /// `writeTasks` (update, delete, reorder): backed up, then the whole list written in place,
    /// the records joined by `\n` with no final newline.
    pub fn rewrite_tasks(p: &Project, id: &str, list: &[Value]) {
        backup(p, id);
        let text: Vec<String> = list.iter().map(Value::to_string).collect();
        std::fs::write(tasks_path(p, id), text.join("\n")).unwrap();
    }
}

/// For a test whose tools (`what`, expected at `place`) are not installed: outside CI it says so
/// and the test passes without them; in CI (`CI=true`), where `.ci/run` installs them, it fails.
pub fn not_installed(what: &str, place: &Path, by_hand: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{what} not installed at {}: .ci/run installs it",
        place.display()
    );
    eprintln!(
        "skipped: {what} not installed at {} (.ci/run installs it; by hand: {by_hand})",
        place.display()
    );
}

/// A tool a test needs: at `$VAR`, else at `in_home` under `$HOME`; `None` (with a message)
/// where it is not there outside CI ([`not_installed`]).
pub fn installed(var: &str, in_home: &str, what: &str, by_hand: &str) -> Option<PathBuf> {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(in_home)))?;
    if path.exists() {
        return Some(path);
    }
    not_installed(what, &path, by_hand);
    None
}

/// Where in `seen` (a service's notifications) the first line starting with `prefix` is.
pub fn first_of(seen: &[String], prefix: &str) -> usize {
    seen.iter()
        .position(|s| s.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in {seen:?}"))
}

/// Whether this machine lets a test make a mount namespace with a tmpfs in it.
pub fn can_mount() -> bool {
    Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg("d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs \"$d\" && umount \"$d\"; r=$?; rmdir \"$d\"; exit $r")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Makes `cmd` run in a mount namespace of its own with a tmpfs of `size` (`256k`, `2m`) on
/// `dir` (private, 0700): a disk that fills ([`can_mount`] says whether the machine allows it).
pub fn in_tmpfs(cmd: &mut Command, dir: &Path, size: &str) {
    let program = PathBuf::from(cmd.get_program());
    let args: Vec<_> = cmd.get_args().map(ToOwned::to_owned).collect();
    let mut wrapped = Command::new("unshare");
    wrapped
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs -o size={size},mode=0700 tmpfs \"$0\" && exec \"$@\""
        ))
        .arg(dir)
        .arg(program)
        .args(args);
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => wrapped.env(k, v),
            None => wrapped.env_remove(k),
        };
    }
    wrapped.current_dir(cmd.get_current_dir().unwrap_or(Path::new("/")));
    *cmd = wrapped;
}

/// A free port of 127.0.0.1 that no other test of this process was given: the servers of the
/// tests run at once, and each is given every port it listens on (none picked at random by the
/// server, which could take another server's port before it binds it). Taken below the kernel's
/// range of ephemeral ports, so that no outgoing connection (a worker's, a client's) takes it
/// between this look and the server's bind.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000, ephemeral.max(10_100));
    // Where to start looking: different in each test process.
    let mut port = low + (std::process::id() % u32::from(high - low)) as u16;
    loop {
        port = if port + 1 >= high { low } else { port + 1 };
        if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return port;
        }
    }
}

/// Receives the notify datagrams a service sends, until `until` is among them.
pub fn notifications(socket: &std::os::unix::net::UnixDatagram, until: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen.iter().any(|s: &String| s.starts_with(until)) {
        let n = socket
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("no {until} after {seen:?}: {e}"));
        seen.extend(
            String::from_utf8_lossy(&buf[..n])
                .lines()
                .map(str::to_owned),
        );
    }
    seen
}

/// Tests A, B and C of a project, as a validate counts them: A passes once `fixed_a` exists and
/// `broken_a` does not, B once `fixed_b` exists, C while `broken_c` does not. The first debug
/// adds the second task (fix B). Its first develop fixes B but breaks A and C (and runs
/// `bin/hostile.sh` when there is one); asked again with the regression in its prompt, it fixes B
/// alone.
pub const REGRESSION_AGENT: &str = r#"
prompt=$(cat)
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"fix A"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop)
    if [ "$LOOPD_TASK" = "fix A" ]; then
      touch fixed_a
    elif printf '%s' "$prompt" | grep -q REGRESSION; then
      mkdir -p markers && touch markers/told && touch fixed_b
    else
      touch fixed_b broken_a broken_c
      [ -f bin/hostile.sh ] && sh bin/hostile.sh
    fi
    echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
  validate)
    n=0
    [ -e fixed_a ] && [ ! -e broken_a ] && n=$((n + 1))
    [ -e fixed_b ] && n=$((n + 1))
    [ ! -e broken_c ] && n=$((n + 1))
    passed=false; [ $n -eq 3 ] && passed=true
    echo "{\"status\":\"success\",\"state_updates\":{\"passed\":$passed,\"pass_rate\":$((n * 100 / 3))}}" > "$LOOPD_RESULT_FILE" ;;
  debug)
    if [ ! -e markers/added ]; then
      mkdir -p markers && touch markers/added
      echo '{"status":"success","state_updates":{"fix_tasks":[{"description":"fix B"}]}}' > "$LOOPD_RESULT_FILE"
    else
      echo '{"status":"success"}' > "$LOOPD_RESULT_FILE"
    fi ;;
  *) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;
