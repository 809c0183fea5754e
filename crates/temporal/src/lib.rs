//! loopd's Temporal driver: a loop as a Temporal workflow, its action attempts as activities
//! that `loopd worker`s run on any machine.
//!
//! Theory of operation: one loop is one workflow, its id the loop id ([`workflow::LoopWorkflow`]).
//! The workflow holds the loop's state, the CCW `LoopState`, and decides with the same pure core as
//! the file driver ([`loopd_core::workflow`] and [`loopd_core::attempt`]): the termination checks
//! and the next action, the retries and rate-limit waits (durable timers here), what an attempt
//! leaves in the history and the books. Time comes from the workflow's clock, so a replay decides
//! the same. Each attempt is one activity ([`activity::LoopActivities::attempt`]): a worker loads
//! the project's config and action files from the loop's root (workers share the project's file
//! system), or, for a loop whose project is a git remote ([`GitSource`]), from the loop's work tree
//! in the worker's cache, put at the loop's last checkpoint and pushed back after a successful
//! action ([`workspace`]); it renders the prompt as the file driver does ([`loopd_project::plan`])
//! and runs the executor with [`loopd_exec`], heartbeating while it runs; a cancelled activity ends
//! the executor's process group. An attempt goes first to the worker that keeps the loop's work
//! tree, on that worker's own task queue, and to any worker when that one does not take it within
//! seconds ([`workflow`]). A person's change (pause, resume, stop, next, a task, an answer, new
//! limits) arrives as an update that the loop checks by the core's rules ([`change`]); the state is
//! read by a query, the loops are listed by search attributes ([`visibility`]) and their events
//! read from their histories ([`history`]) ([`client`]). A front (the service) asks for them as it
//! asks for every driver's ([`front::Fleet`], a [`loopd_core::driver::Driver`]).
//!
//! Which layer may use which: this crate uses the core, the executors and the project's settings
//! (and [`loopd_fs`] for an attempt's files), nothing of the file store or the file driver; only
//! the binary uses it, behind the cargo feature `temporal`.

pub mod activity;
pub mod change;
pub mod client;
pub mod connection;
pub mod front;
pub mod history;
pub mod metrics;
pub mod reference;
pub mod visibility;
pub mod workflow;
pub mod workspace;

use std::collections::BTreeMap;
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
    /// The project root, where the actions run (on every worker's file system), unless the
    /// loop's work tree comes from a git remote (`git`); then where `loopd create` ran.
    pub root: PathBuf,
    /// The git remote the loop's work tree comes from and goes back to after each action, when
    /// workers share no file system.
    #[serde(default)]
    pub git: Option<GitSource>,
    /// The commit of the loop's last checkpoint on the remote: where its next action starts.
    #[serde(default)]
    pub head: Option<String>,
    /// The worker that ran the loop's last action and keeps its work tree: the next action goes
    /// to it first.
    #[serde(default)]
    pub holder: Option<Holder>,
    pub state: LoopState,
    /// The loop's task list, as `create` was given it.
    pub tasks: Vec<ListedTask>,
    /// Every action's executor, when one was named (`--executor`).
    pub executor: Option<String>,
    /// The executors that race on each task when the loop names none of its own (the config's
    /// `race`, for a loop on a git remote).
    #[serde(default)]
    pub race: Vec<String>,
    pub limits: Limits,
    pub retry: RetryPolicy,
    /// How many events a run's history may reach before the loop continues as a new run
    /// (config `[temporal] history_limit`): checked before each action, so a run ends with at
    /// most one action's events past it.
    pub history_limit: u32,
}

/// Where a loop's work tree comes from when workers share no file system: a git remote, of
/// which the loop's work goes to branch `loopd/ID` and its checkpoints to `refs/loopd/ID/*`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GitSource {
    /// The remote repository, a URL or a path as git takes it (with git's own credentials).
    pub remote: String,
    /// The commit the loop starts from (its `0-start` checkpoint).
    pub base: String,
    /// The digests of the project's own files (its config and action files) by path in the
    /// work tree, as the person who made the loop trusted them: a worker runs them only as
    /// they were then (see [`loopd_project::trust`]).
    pub trusted: BTreeMap<PathBuf, String>,
}

/// A worker, as a loop's workflow knows it: by name, and by its own task queue.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    pub name: String,
    pub queue: String,
}
