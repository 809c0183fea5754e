//! A loopd project's settings: what its loops run and whether they may.
//!
//! A project is a directory with a state directory (`.loop/` by default). What runs there is set
//! in layers ([`config`]): loopd's built-in `config.toml`, the user's, the project's own
//! `.loop/config.toml` and a `--config` file, each over the one before; an action's prompt comes
//! from a built-in template or from the project's `.loop/actions/{workflow}/{action}.md`
//! ([`actions`]). The project's own files arrive with a cloned repository and can set any command
//! loopd runs, so each is read with its digest ([`project_file`]) and runs only once the user
//! trusts it ([`trust`]), as `direnv allow` does.
//!
//! Which layer may use which: this crate uses [`loopd_core`] (the workflows' names and limits),
//! [`loopd_exec`] (the settings an executor runs by) and [`loopd_fs`], nothing else of loopd's.
//! The drivers and the binary use it.

pub mod actions;
pub mod config;
pub mod plan;
pub mod project_file;
pub mod trust;
