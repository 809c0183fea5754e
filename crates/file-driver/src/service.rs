//! What a running service leaves for others to see, in its runtime directory (see
//! [`crate::registry::runtime_dir`]): `serve.lock`, held for the service's lifetime with its pid in
//! it, and `serve.json`, what it drives and what waits, rewritten atomically on every change.
//! The CLI reads them to hand a loop to the service and to show queued loops.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::locks::Held;
use loopd_fs::Dir;

const LOCK: &str = "serve.lock";
const STATUS: &str = "serve.json";

/// A loop, named by its project and id.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LoopKey {
    pub root: PathBuf,
    pub loop_id: String,
}

impl std::fmt::Display for LoopKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} in {}", self.loop_id, self.root.display())
    }
}

/// A loop the service could not take.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RefusedLoop {
    #[serde(flatten)]
    pub key: LoopKey,
    pub reason: String,
}

/// A loop set to run that waits for another loop of its project, which runs in its work tree.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WaitingLoop {
    #[serde(flatten)]
    pub key: LoopKey,
    /// The loop it waits for.
    pub behind: String,
}

/// What a running service says about itself.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ServiceInfo {
    pub pid: u32,
    pub started_at: String,
    /// The project roots it watches.
    pub roots: Vec<PathBuf>,
    /// The loops it drives.
    pub running: Vec<LoopKey>,
    /// The loops waiting for a place, first first.
    pub queued: Vec<LoopKey>,
    /// The loops waiting for their work tree, which another loop runs in; each runs once that
    /// loop ends or pauses.
    #[serde(default)]
    pub waiting: Vec<WaitingLoop>,
    /// The loops set to run that the service could not take, and why (another loop runs in
    /// their work tree, their project's files are not trusted...). They are tried again.
    #[serde(default)]
    pub refused: Vec<RefusedLoop>,
    /// One line: "4 running, 1 paused, 2 queued" (the queued counting those that wait for
    /// their work tree).
    pub summary: String,
    /// The API's Unix socket, and its TCP address when it listens on one.
    pub socket: Option<PathBuf>,
    pub listen: Option<String>,
}

impl ServiceInfo {
    pub fn serves(&self, root: &Path) -> bool {
        self.roots.iter().any(|r| r == root)
    }

    /// Where `key` stands in the queue (1 is next), if it waits there.
    pub fn queue_position(&self, key: &LoopKey) -> Option<usize> {
        self.queued.iter().position(|k| k == key).map(|i| i + 1)
    }

    /// The loop `key` waits for, if it waits for its work tree.
    pub fn waits_behind(&self, key: &LoopKey) -> Option<&str> {
        self.waiting
            .iter()
            .find(|w| w.key == *key)
            .map(|w| w.behind.as_str())
    }
}

/// The service lock, taken: only one service per user.
pub fn lock(dir: &Dir) -> anyhow::Result<Held> {
    let file = dir.open_rw(LOCK)?;
    Held::take(file, &std::process::id().to_string(), |holder| {
        crate::error::usage(format!(
            "a service already runs (pid {})",
            crate::locks::holder_pid(holder)
        ))
    })
}

/// Writes what the service says about itself (0600, atomically).
pub fn publish(dir: &Dir, info: &ServiceInfo) -> std::io::Result<()> {
    let text = serde_json::to_vec_pretty(info).map_err(std::io::Error::other)?;
    dir.write_atomic(STATUS, &text, false)
}

/// Removes what the service left for others at a clean exit: its status, the API's socket and
/// token.
pub fn withdraw(dir: &Dir) {
    for name in [STATUS, "api.sock", "token"] {
        let _ = dir.remove(name);
    }
}

/// The running service of this user, if one runs: what it last said about itself.
pub fn running() -> Option<ServiceInfo> {
    let dir = crate::registry::runtime_dir(false).ok()?;
    let holder = crate::locks::holder_of(dir.open_read(LOCK).ok()?)?;
    let pid = crate::locks::holder_pid(&holder);
    if !crate::locks::pid_alive(pid) {
        return None;
    }
    let bytes = dir.read(STATUS, loopd_fs::USER_FILE_CAP).ok()?;
    let info: ServiceInfo = serde_json::from_slice(&bytes).ok()?;
    (info.pid == pid).then_some(info)
}
