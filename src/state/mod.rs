//! The loop state on disk: its store, its backups and its task list (the model is
//! [`loopd_core::state`]).

pub mod backup;
pub mod store;
pub mod tasks;

/// Now, as loopd writes timestamps: RFC 3339 UTC with milliseconds and `Z`. The one clock the
/// core's timestamps come from.
pub fn now_rfc3339() -> String {
    loopd_core::state::format_ts(chrono::Utc::now())
}
