//! A Temporal dev server and `loopd worker`s for the benchmarks of loops on Temporal.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use loopd_temporal::{TemporalConfig, client};

use super::Project;

/// A dev server of the benchmark's own, in a temporary directory, with a client's settings and
/// a runtime to drive it.
pub struct Started {
    pub server: Server,
    pub config: TemporalConfig,
    pub rt: tokio::runtime::Runtime,
    /// Holds the server's database (and whatever else the benchmark puts there).
    pub dir: tempfile::TempDir,
}

/// Starts a dev server; `None`, with a message, where the server is not installed.
pub fn start() -> Option<Started> {
    let Some(bin) = temporal_bin() else {
        eprintln!(
            "the Temporal server is not installed (LOOPD_TEMPORAL_BIN, or ~/.cache/loopd/temporal-1.9.1): \
             see docs/temporal.md"
        );
        return None;
    };
    let dir = super::tempdir();
    let server = Server::start(&bin, dir.path());
    let config = TemporalConfig {
        address: server.address.clone(),
        namespace: "default".into(),
        task_queue: "loopd".into(),
        ..TemporalConfig::default()
    };
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    Some(Started {
        server,
        config,
        rt,
        dir,
    })
}

/// Waits until loop `id`'s workflow has ended, completed.
pub async fn finished(config: &TemporalConfig, id: &str) {
    let client = client::connect(config).await.expect("connect");
    let input = client::finished(&client, id).await.expect("the loop's end");
    assert_eq!(
        input.state.status,
        loopd_core::state::Status::Completed,
        "loop {id}: {:?}",
        input.state.failure_reason
    );
}

pub fn temporal_bin() -> Option<PathBuf> {
    let bin = std::env::var_os("LOOPD_TEMPORAL_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/loopd/temporal-1.9.1/bin/temporal"))
        })?;
    bin.exists().then_some(bin)
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A child process, ended (SIGTERM, then SIGKILL) when dropped.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A dev server on free ports of 127.0.0.1, its database in `dir`.
pub struct Server {
    pub address: String,
    _process: Process,
}

impl Server {
    pub fn start(bin: &Path, dir: &Path) -> Server {
        let port = free_port();
        let address = format!("127.0.0.1:{port}");
        let process = Command::new(bin)
            .args(["server", "start-dev", "--headless", "--ip", "127.0.0.1"])
            .args(["--port", &port.to_string(), "--log-level", "error"])
            .args(["--http-port", &free_port().to_string()])
            .args(["--metrics-port", &free_port().to_string()])
            .arg("--db-filename")
            .arg(dir.join("temporal.db"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the Temporal dev server");
        let started = Instant::now();
        while !Command::new(bin)
            .args(["operator", "cluster", "health", "--address", &address])
            .output()
            .is_ok_and(|out| out.status.success())
        {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the server did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Server {
            address,
            _process: Process(process),
        }
    }
}

/// `n` `loopd worker` processes of a project, ended when dropped.
pub struct Workers {
    pub processes: Vec<Process>,
}

impl Workers {
    /// SIGKILLs every worker, as a machine's death would.
    pub fn kill_all(&mut self) {
        for p in &mut self.processes {
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
    }

    /// Starts `n` workers of project `p`, each with a name and cache of its own.
    pub fn start(p: &Project, address: &str, n: usize) -> Workers {
        Workers::start_with(p, address, n, |_, _| {})
    }

    /// Starts `n` workers as [`Workers::start`] does, as `configure` changes each command (given
    /// the worker's name).
    pub fn start_with(
        p: &Project,
        address: &str,
        n: usize,
        configure: impl Fn(&mut Command, &str),
    ) -> Workers {
        // Names never given before: a worker's cache is its name's.
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        Workers {
            processes: (0..n)
                .map(|_| {
                    let name = format!("b{}", STARTED.fetch_add(1, Ordering::Relaxed));
                    let mut cmd = p.loopd();
                    cmd.args(["worker", "--temporal", address, "--name", &name]);
                    configure(&mut cmd, &name);
                    Process(
                        cmd.stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .spawn()
                            .expect("loopd worker"),
                    )
                })
                .collect(),
        }
    }
}
