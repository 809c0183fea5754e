//! Errors as the user meets them: what is bad input (exit code 2) and what is loopd's own
//! failure (exit code 1).

use std::path::PathBuf;

/// A mistake in what the user asked for: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The exit code of an error: 2 for bad input (usage, config, action files, ids, unknown or
/// unusable loops), else 1.
pub fn exit_code_of(e: &anyhow::Error) -> i32 {
    let bad_input = e.chain().any(|cause| {
        cause.is::<UsageError>()
            || cause.is::<loopd_project::config::ConfigError>()
            || cause.is::<loopd_project::actions::ActionError>()
            || cause.is::<loopd_project::trust::Untrusted>()
            || cause.is::<WorkTreeBusy>()
            || cause.is::<loopd_exec::checkpoint::Refused>()
            || cause
                .downcast_ref::<loopd_store::store::StoreError>()
                .is_some_and(|s| s.is_bad_input())
            || cause
                .downcast_ref::<std::io::Error>()
                .is_some_and(loopd_fs::is_refusal)
    });
    if bad_input { 2 } else { 1 }
}

/// A [`UsageError`] with this message.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// The refusal of a loop whose work tree another loop's daemon holds: bad input (exit 2).
#[derive(Debug, thiserror::Error)]
#[error(
    "loop {id} cannot run in {}: loop {} runs there (daemon pid {pid}); wait for it or stop it, \
     or give a loop a work tree of its own with `loopd create --worktree`",
    root.display(),
    holder.as_deref().unwrap_or("another loop")
)]
pub struct WorkTreeBusy {
    pub id: String,
    pub root: PathBuf,
    /// The loop that runs there, when its lock says.
    pub holder: Option<String>,
    /// Its daemon.
    pub pid: u32,
}
