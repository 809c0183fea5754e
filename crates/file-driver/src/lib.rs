//! loopd's file driver: loops driven on this machine against the file store.
//!
//! A loop's daemon ([`daemon`]) takes the loop's lock and runs an [`orchestrator::Engine`]: it
//! reads `{id}.json` through the store, lets the loop's workflow ([`loopd_core::workflow`])
//! decide the next action, runs it with an executor ([`loopd_exec`]), and writes the daemon's
//! fields back, while the store's watcher reports a pause or stop written by anyone and ends the
//! attempt in flight. The service (the `loopd-serve` crate, above this one) drives every loop of
//! many projects in one process with this crate's engine; [`service`] is how a command finds it.
//! What people change of a loop between actions
//! goes through [`control`] (status, next action, tasks, answers, retry), [`create`] and
//! [`checkpoints`] (the work tree's, and its rollback), from the command line and the API alike;
//! [`view`] is what they are shown. [`front::Files`] is this driver as a front asks it for the
//! loops of the projects a service serves ([`loopd_core::driver::Driver`]).
//!
//! Which layer may use which: this crate uses every crate below it ([`loopd_core`],
//! [`loopd_fs`], [`loopd_store`], [`loopd_exec`], [`loopd_project`]); only the service and the
//! binary use it.

pub mod accounts;
pub mod checkpoints;
pub mod control;
pub mod create;
pub mod daemon;
pub mod error;
pub mod front;
pub mod locks;
pub mod notify;
pub mod orchestrator;
pub mod project;
pub mod registry;
pub mod service;
pub mod view;
pub mod worktree;
