//! The loop's lock: an exclusive `flock` on the sidecar `{id}.lock`, never renamed or deleted,
//! taken by every writer for its read-modify-write; and the other lock files of the state
//! directory (a daemon's, the work tree's).

use super::*;

/// An exclusive lock on a loop's sidecar lock file, released on drop.
pub struct WriteLock {
    file: Rc<File>,
}

impl Drop for WriteLock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

thread_local! {
    /// Lock files kept open, one per path and thread: a writer locks and unlocks its loop's lock
    /// file twice per action, and opening it each time is what costs. Per thread, because
    /// `flock` does not exclude holders of the same open file, and threads must exclude each
    /// other like processes do.
    static LOCK_FILES: RefCell<HashMap<PathBuf, Rc<File>>> = RefCell::new(HashMap::new());
}

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
        let file = LOCK_FILES
            .with(|files| {
                if let Some(file) = files.borrow().get(&path) {
                    return Ok(file.clone());
                }
                let file = Rc::new(dir.open_rw(&name)?);
                files.borrow_mut().insert(path.clone(), file.clone());
                Ok(file)
            })
            .map_err(io_err(&path))?;
        let deadline = Instant::now() + LOCK_TIMEOUT;
        // Holders keep the lock for a read or a write, tens of microseconds: the first looks
        // come soon, then less and less often.
        let mut pause = Duration::from_micros(10);
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(WriteLock { file }),
                Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
                Err(std::fs::TryLockError::WouldBlock) => return Err(StoreError::Locked { path }),
                Err(std::fs::TryLockError::Error(e)) => return Err(io_err(&path)(e)),
            }
        }
    }
}
