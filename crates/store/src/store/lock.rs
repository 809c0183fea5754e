//! The loop's lock: an exclusive `flock` on the sidecar `{id}.lock`, never renamed or deleted,
//! taken by every writer for its read-modify-write; and the other lock files of the state
//! directory (a daemon's, the work tree's).

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// An exclusive lock on a loop's sidecar lock file, released on drop.
pub struct WriteLock {
    kept: Arc<KeptLock>,
}

impl Drop for WriteLock {
    fn drop(&mut self) {
        let _ = self.kept.file.unlock();
        self.kept.held.store(false, Ordering::Release);
    }
}

/// A loop's lock file, kept open once for the process: a writer locks and unlocks it twice per
/// action, and opening it each time is what costs. `flock` does not exclude holders of the same
/// open file, so threads exclude each other by `held` first, then the process takes the `flock`
/// that excludes other processes. One descriptor a loop, whatever threads write it.
struct KeptLock {
    file: File,
    held: AtomicBool,
}

static LOCK_FILES: LazyLock<Mutex<HashMap<PathBuf, Arc<KeptLock>>>> =
    LazyLock::new(Default::default);

impl Store {
    /// Opens a lock file of the state directory (a loop's `{id}.daemon`, `worktree.lock`),
    /// creating it (0600).
    pub fn open_lock(&self, name: &str) -> Result<File, StoreError> {
        self.state_dir(true)?
            .open_rw(name)
            .map_err(io_err(&self.path.join(name)))
    }

    /// Opens a lock file of the state directory if it exists.
    pub fn existing_lock(&self, name: &str) -> Option<File> {
        self.existing_dir().ok()??.open_read(name).ok()
    }

    /// Takes the write lock of a loop, waiting a bounded time for another writer.
    pub fn lock(&self, id: &str) -> Result<WriteLock, StoreError> {
        let dir = self.state_dir(true)?;
        let name = format!("{id}.lock");
        let path = dir.join(&name);
        let kept = {
            let mut files = LOCK_FILES.lock().unwrap_or_else(|e| e.into_inner());
            match files.get(&path) {
                Some(kept) => kept.clone(),
                None => {
                    let file = dir.open_rw(&name).map_err(io_err(&path))?;
                    let kept = Arc::new(KeptLock {
                        file,
                        held: AtomicBool::new(false),
                    });
                    files.insert(path.clone(), kept.clone());
                    kept
                }
            }
        };
        let deadline = Instant::now() + LOCK_TIMEOUT;
        // Holders keep the lock for a read or a write, tens of microseconds: the first looks
        // come soon, then less and less often.
        let mut pause = Duration::from_micros(10);
        loop {
            // This process's threads first, then other processes.
            if kept
                .held
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                match kept.file.try_lock() {
                    Ok(()) => return Ok(WriteLock { kept }),
                    Err(std::fs::TryLockError::WouldBlock) => {
                        kept.held.store(false, Ordering::Release);
                    }
                    Err(std::fs::TryLockError::Error(e)) => {
                        kept.held.store(false, Ordering::Release);
                        return Err(io_err(&path)(e));
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(StoreError::Locked { path });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}
