//! loopd's pure core: what a loop is and how it decides, with no I/O.
//!
//! A loop is a [`state::LoopState`], the CCW `{id}.json` typed, every field it does not know
//! kept. A [`workflow::Workflow`] (ccw-loop, skill-tuning) holds a loop's rules: after the
//! termination checks ([`workflow::check`]) it picks the next action ([`workflow::decide`]),
//! checks an action's result ([`protocol::ActionResult`]) and applies it, and the bookkeeping
//! every workflow shares (attempts, sliding windows of history and errors, limits) is kept by
//! [`workflow::record_attempt`] and [`workflow::record_finish`]. What a person may change of a living loop (pause, resume, stop,
//! the next action, a task, an answer) is decided by [`control`], for every driver.
//!
//! Nothing here reads a file, starts a process, waits or looks at the clock: a driver reads the
//! state and the task list, runs the action, and passes in what it saw and the time (`now`). The
//! same inputs give the same decisions, so a driver that replays a loop's history gets the
//! loop it had. This crate depends on serde, serde_json and chrono's date types, and for the
//! trait a front asks drivers through ([`driver::Driver`]: the loops a driver holds, listed,
//! shown, changed, created and followed) on anyhow, async-trait and futures-core.
//!
//! Which layer may use which: this crate uses none of loopd's; the store, the executors, the
//! drivers and the binary use it.

pub mod attempt;
pub mod control;
pub mod driver;
pub mod no_progress;
pub mod protocol;
pub mod state;
pub mod still;
pub mod test_output;
pub mod workflow;
