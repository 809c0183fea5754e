//! Who drives what: the lock files of the state directory that a loop's daemon, a loop running
//! in the project root, and the service hold for their lifetime. A holder writes what it is in
//! its lock (`PID`, `PID LOOP`, `PID serve`) right after taking it, so anyone can say who holds
//! one, and whether that process still lives, without taking it.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use loopd_store::store::Store;

/// The refusal of a loop another daemon drives.
pub fn already_driven(id: &str, pid: u32) -> anyhow::Error {
    crate::error::usage(format!(
        "loop {id} is already driven by a daemon (pid {pid})"
    ))
}

/// Who holds a lock file of the state dir, if anyone: what the holder wrote in it.
pub(crate) fn holder(store: &Store, name: &str) -> Option<String> {
    holder_of(store.existing_lock(name)?)
}

/// Who holds the lock of `file` (opened anew, for reading), if anyone: what the holder wrote in
/// it. A holder writes right after it takes the lock; an empty file is read again for up to
/// 100 ms.
pub fn holder_of(mut file: File) -> Option<String> {
    let deadline = Instant::now() + Duration::from_millis(100);
    loop {
        file.try_lock_shared().err()?;
        let mut text = String::new();
        file.seek(SeekFrom::Start(0)).ok()?;
        file.read_to_string(&mut text).ok()?;
        if !text.trim().is_empty() || Instant::now() > deadline {
            return Some(text.trim().to_owned());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The process a lock's holder text names (its first word), or 0 when it names none.
pub fn holder_pid(text: &str) -> u32 {
    text.split_whitespace()
        .next()
        .and_then(|pid| pid.parse().ok())
        .unwrap_or(0)
}

/// Who holds a loop's daemon lock, if anyone: the pid written in it.
pub fn daemon_pid(store: &Store, id: &str) -> Option<u32> {
    loopd_store::store::validate_id(id).ok()?;
    holder(store, &daemon_lock(id)).map(|text| holder_pid(&text))
}

/// The lock file of a loop's daemon.
fn daemon_lock(id: &str) -> String {
    format!("{id}.daemon")
}

pub fn pid_alive(pid: u32) -> bool {
    pid > 0 && loopd_exec::procs::ProcStat::read(pid).is_some_and(|p| p.is_alive())
}

/// The daemon driving a loop, if one does. A holder of the lock whose process is gone is passing
/// through (the last threads of a killed daemon closing its files, a probe of `status`): it is
/// waited out for up to 2 s, so that a daemon killed a moment ago never refuses a new one.
pub fn driving_daemon(store: &Store, id: &str) -> Option<u32> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let pid = daemon_pid(store, id)?;
        if pid_alive(pid) || Instant::now() > deadline {
            return Some(pid);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An exclusive lock on a file of the state dir, held until it is dropped.
pub struct Held {
    _file: File,
}

impl Held {
    /// Takes the lock of `file` and writes `me` in it (`PID`, `PID serve`, or `PID LOOP`), or
    /// returns `busy(holder)` with what its holder wrote. A holder whose process is gone is
    /// passing through: `status` or `resume` probing the lock, or a dead daemon's executor
    /// between fork and exec. It is waited out for up to 2 s.
    pub fn take(mut file: File, me: &str, busy: impl Fn(&str) -> anyhow::Error) -> Result<Held> {
        let deadline = Instant::now() + Duration::from_secs(2);
        while file.try_lock().is_err() {
            let mut text = String::new();
            file.seek(SeekFrom::Start(0))?;
            file.read_to_string(&mut text)?;
            if pid_alive(holder_pid(&text)) || Instant::now() > deadline {
                return Err(busy(text.trim()));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        file.set_len(0)?;
        file.seek(SeekFrom::Start(0))?;
        write!(file, "{me}")?;
        file.flush()?;
        Ok(Held { _file: file })
    }

    /// The lock that says "a daemon drives this loop", held for the daemon's lifetime.
    pub fn daemon(store: &Store, id: &str, me: &str) -> Result<Held> {
        loopd_store::store::validate_id(id)?;
        Held::take(store.open_lock(&daemon_lock(id))?, me, |holder| {
            already_driven(id, holder_pid(holder))
        })
    }

    /// The lock that says "a loop runs in the project root", held for the daemon's lifetime by
    /// a loop without a worktree of its own: two loops never edit one work tree at once.
    pub fn work_tree(store: &Store, id: &str, root: &Path, me: &str) -> Result<Held> {
        let pid = holder_pid(me);
        Held::take(
            store.open_lock(WORK_TREE_LOCK)?,
            &format!("{pid} {id}"),
            |holder| work_tree_busy(id, root, holder),
        )
    }
}

/// The lock file of the loop running in the project root.
pub(crate) const WORK_TREE_LOCK: &str = "worktree.lock";

pub(crate) fn work_tree_busy(id: &str, root: &Path, holder: &str) -> anyhow::Error {
    crate::error::WorkTreeBusy {
        id: id.to_owned(),
        root: root.to_owned(),
        holder: holder.split_whitespace().nth(1).map(str::to_owned),
        pid: holder_pid(holder),
    }
    .into()
}
