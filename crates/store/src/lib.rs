//! loopd's file store: where a loop lives on one machine, and how it is read, written and watched.
//!
//! A loop is the file `.loop/{id}.json` in CCW's format, beside its task lists, its event log and
//! its progress files. Every file is opened relative to a directory that was checked once, never
//! through a symlink, and created private ([`loopd_fs`]). The state file is changed by
//! read-modify-write under the loop's lock, written atomically and made durable by a checksummed
//! backup; writers that take no lock (CCW's own tools) lose no update to it ([`store`]). The task
//! list merges CCW's file and loopd's own record ([`tasks`]); the event log is appended to and
//! capped ([`events`]); a watcher reports a change written by anyone at once and ends the
//! attempt in flight when a controller pauses or stops the loop ([`watch`]).
//!
//! Which layer may use which: this crate uses [`loopd_core`] (the state model) and [`loopd_fs`],
//! nothing else of loopd's; it knows no workflow, no executor and no command line. The drivers and
//! the binary use it; a driver that keeps its loops elsewhere (Temporal) does not.

pub mod events;
mod helper;
pub mod store;
pub mod tasks;
pub mod watch;

/// Now, as loopd writes timestamps: RFC 3339 UTC with milliseconds and `Z`. The one clock the
/// core's timestamps come from.
pub fn now_rfc3339() -> String {
    loopd_core::state::format_ts(chrono::Utc::now())
}

/// Takes `m`'s lock even if a holder panicked: a poisoned lock still guards usable data here
/// (lists and caches that every change leaves whole).
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
