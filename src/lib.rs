//! loopd, the binary: the command line ([`cli`]: clap's definitions and the commands;
//! [`cli_docs`]: the reference made from them), what the commands print ([`output`]), and the
//! commands that only people run (`doctor`, `init`, `demo`, `checkpoints`/`diff`/`rollback`,
//! `retry`/`set`/`answer`), and `loopd mcp`'s wiring of the MCP server ([`mcp`]). Nothing imports
//! it.
//!
//! The flow of one loop lives in the crates below: a loop's state is read and written by the file
//! store ([`loopd_store`]), a pure workflow of [`loopd_core`] decides the next action, an executor
//! ([`loopd_exec`]) runs it as a subprocess, and the file driver ([`loopd_file_driver`]) ties
//! them together as a daemon per loop or one service for many.

pub mod checkpoint;
pub mod cli;
pub mod cli_docs;
pub mod demo;
pub mod doctor;
pub mod init;
pub mod logging;
pub mod mcp;
pub mod output;
pub mod recovery;
#[cfg(feature = "temporal")]
pub mod temporal;
