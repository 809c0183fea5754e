//! loopd: an autonomous orchestrator daemon for coding-agent loops, compatible with the CCW loop.
//!
//! The flow of one loop: the state file is read ([`state::store`]), a pure workflow of
//! [`loopd_core`] decides the next action, an [`executor`] runs it as a subprocess, the workflow
//! applies its result, and the [`orchestrator`] writes the daemon's fields back — while [`watch`]
//! reports control changes written by anyone, which cancel the attempt in flight.

pub mod checkpoint;
pub mod cli;
pub mod create;
pub mod daemon;
pub mod demo;
pub mod doctor;
pub mod error;
pub mod init;
pub mod logging;
pub mod orchestrator;
pub mod recovery;
pub mod registry;
pub mod serve;
pub mod view;
pub mod worktree;
