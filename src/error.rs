//! Errors as the user meets them: what is bad input (exit code 2) and what is loopd's own
//! failure (exit code 1).

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
            || cause.is::<crate::daemon::WorkTreeBusy>()
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
pub(crate) fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}
