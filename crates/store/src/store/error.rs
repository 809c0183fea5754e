//! What goes wrong with a loop's files, in one type: a bad id, a loop that is not there or already
//! is, a state file that does not load, a lock that is not to be had, a refusal, the I/O.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a writer waits for the lock before giving up.
pub(super) const LOCK_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "bad loop id {0:?}: ids are 1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
    )]
    BadId(String),
    #[error("unknown loop {id}: {path} does not exist")]
    NotFound { id: String, path: PathBuf },
    #[error("loop {id} already exists at {path}")]
    Exists { id: String, path: PathBuf },
    #[error("corrupt state file {path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("timed out after {}s waiting for the lock {path}", LOCK_TIMEOUT.as_secs())]
    Locked { path: PathBuf },
    /// A file or directory that is not what it should be (a symlink, a FIFO, a hard link): bad
    /// input, refused.
    #[error("{0}")]
    Refused(String),
    /// The cause follows in the error chain.
    #[error("{}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

impl StoreError {
    /// Errors of the user's input (exit code 2), as opposed to the machine failing.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            StoreError::BadId(_)
                | StoreError::NotFound { .. }
                | StoreError::Exists { .. }
                | StoreError::Corrupt { .. }
                | StoreError::Refused(_)
        )
    }

    /// As an `io::Error` of the same kind: a refusal stays `InvalidInput`.
    pub fn into_io(self) -> io::Error {
        match self {
            StoreError::Io { source, .. } => source,
            StoreError::Refused(why) => io::Error::new(io::ErrorKind::InvalidInput, why),
            other => io::Error::other(other.to_string()),
        }
    }

    /// Errors that may go away by themselves: a full disk, a lock held by someone else.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Locked { .. } => true,
            StoreError::Io { source, .. } => is_transient_io(source),
            _ => false,
        }
    }
}

/// A full disk or quota, or a resource that may come back.
pub fn is_transient_io(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded | io::ErrorKind::WouldBlock
    )
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| {
        if loopd_fs::is_refusal(&source) {
            StoreError::Refused(source.to_string())
        } else {
            StoreError::Io {
                path: path.to_owned(),
                source,
            }
        }
    }
}
