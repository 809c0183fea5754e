//! loopd's Temporal driver: a loop as a Temporal workflow, its action attempts as activities
//! that `loopd worker`s run on any machine.
//!
//! Theory of operation: one loop is one workflow, its id the loop id ([`workflow::LoopWorkflow`]).
//! The workflow holds the loop's state, the CCW `LoopState`, and decides with the same pure core
//! as the file driver ([`loopd_core::workflow`] and [`loopd_core::attempt`]): the termination
//! checks and the next action, the retries and rate-limit waits (durable timers here), what an
//! attempt leaves in the history and the books. Time comes from the workflow's clock, so a replay
//! decides the same. Each attempt is one activity ([`activity::LoopActivities::attempt`]): a
//! worker loads the project's config and action files from the loop's root (workers share the
//! project's file system), renders the prompt as the file driver does ([`loopd_project::plan`]),
//! and runs the executor with [`loopd_exec`], heartbeating while it runs; a cancelled activity
//! ends the executor's process group. A person's change (pause, resume, stop, next, a task, an
//! answer, new limits) arrives as an update that the loop checks by the core's rules
//! ([`change`]); the state is read by a query, the loops are listed by search attributes
//! ([`visibility`]) and their events read from their histories ([`history`]) ([`client`]).
//!
//! Which layer may use which: this crate uses the core, the executors and the project's settings
//! (and [`loopd_fs`] for an attempt's files), nothing of the file store or the file driver; only
//! the binary uses it, behind the cargo feature `temporal`.

pub mod activity;
pub mod change;
pub mod client;
pub mod history;
pub mod reference;
pub mod visibility;
pub mod workflow;

use std::path::PathBuf;

use loopd_core::attempt::RetryPolicy;
use loopd_core::state::{ListedTask, LoopState};
use loopd_core::workflow::Limits;
use serde::{Deserialize, Serialize};

pub use loopd_project::config::TemporalConfig;

/// What a loop's workflow starts from: the state `loopd create` made, and what the project's
/// config says that the workflow must not read itself (it reads no file).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LoopInput {
    /// The project root, where the actions run (on every worker's file system).
    pub root: PathBuf,
    pub state: LoopState,
    /// The loop's task list, as `create` was given it.
    pub tasks: Vec<ListedTask>,
    /// Every action's executor, when one was named (`--executor`).
    pub executor: Option<String>,
    pub limits: Limits,
    pub retry: RetryPolicy,
    /// How many events a run's history may reach before the loop continues as a new run
    /// (config `[temporal] history_limit`): checked before each action, so a run ends with at
    /// most one action's events past it.
    pub history_limit: u32,
}
