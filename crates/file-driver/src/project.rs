//! A project as the file driver opens it: its root, its layered config and its store, and the
//! workflow each of its loops runs.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use loopd_core::state::LoopState;
use loopd_project::config::Config;
use loopd_store::store::{Settler, Store, validate_id};

use crate::error::usage;

/// The project root: `--root`, `$LOOPD_ROOT`, the git top level, or the working directory.
pub fn resolve_root(flag: Option<&Path>) -> Result<PathBuf> {
    let root = match flag {
        Some(r) => r.to_owned(),
        None => match std::env::var_os("LOOPD_ROOT").filter(|v| !v.is_empty()) {
            Some(r) => PathBuf::from(r),
            None => {
                let cwd = std::env::current_dir().context("cannot read the working directory")?;
                cwd.ancestors()
                    .find(|d| d.join(".git").exists())
                    .map(Path::to_owned)
                    .unwrap_or(cwd)
            }
        },
    };
    if !root.is_dir() {
        return Err(usage(format!(
            "project root {} is not a directory",
            root.display()
        )));
    }
    root.canonicalize()
        .with_context(|| format!("cannot resolve {}", root.display()))
}

/// A project: its root, config and store.
pub struct Project {
    pub root: PathBuf,
    pub config: Config,
    pub store: Store,
    pub config_flag: Option<PathBuf>,
}

/// A short-lived command settles the versions its writes replaced before it exits (see
/// [`Store::close`]), unless a process that watches the state directory does it: the loop's
/// daemon, or the service that serves the project (this one, or another, which the versions are
/// handed over to: see [`Store::close_with`]).
impl Drop for Project {
    fn drop(&mut self) {
        let me = std::process::id();
        let mut service = None;
        self.store.close_with(|id| {
            let daemon = crate::locks::daemon_pid(&self.store, id);
            if daemon.is_some_and(|pid| pid != me && crate::locks::pid_alive(pid)) {
                return Settler::Another;
            }
            let service = service.get_or_insert_with(crate::service::running);
            match service {
                Some(s) if s.serves(&self.root) && s.pid == me => Settler::ThisProcess,
                Some(s) if s.serves(&self.root) => Settler::Another,
                _ => Settler::Nobody,
            }
        });
    }
}

impl Project {
    pub fn open(root: Option<&Path>, config: Option<&Path>) -> Result<Project> {
        let root = resolve_root(root)?;
        let config_flag = config.map(Path::to_owned);
        let config = Config::load(&root, config)?;
        let store = Store::new(&root, &config.state_dir);
        Ok(Project {
            root,
            config,
            store,
            config_flag,
        })
    }

    /// A project for a command that runs nothing (`status`, `list`, `logs`, `pause`, `stop`): a
    /// config that does not load is reported in one warning line and the built-in defaults are
    /// used instead, so a broken config never keeps anyone from looking at or stopping a loop.
    pub fn open_for_inspection(root: Option<&Path>, config: Option<&Path>) -> Result<Project> {
        match Project::open(root, config) {
            Err(e) if e.is::<loopd_project::config::ConfigError>() => {
                eprintln!("loopd: warning: {e:#}; using the built-in defaults for this command");
                let root = resolve_root(root)?;
                let config = Config::builtin_with("")?;
                let store = Store::new(&root, &config.state_dir);
                Ok(Project {
                    root,
                    config,
                    store,
                    config_flag: None,
                })
            }
            other => other,
        }
    }

    /// Loads a loop, validating the id first.
    pub fn load(&self, id: &str) -> Result<LoopState> {
        validate_id(id)?;
        Ok(self.store.load(id)?.state)
    }
}

/// The workflow a loop runs.
pub fn loop_workflow(
    p: &Project,
    state: &LoopState,
) -> Result<&'static dyn loopd_core::workflow::Workflow> {
    let name = state
        .skill_state
        .as_ref()
        .and_then(|s| s.workflow.clone())
        .unwrap_or_else(|| p.config.workflow.clone());
    loopd_core::workflow::by_name(&name).ok_or_else(|| {
        usage(format!(
            "loop {} uses unknown workflow {name:?} (known: {})",
            state.loop_id,
            loopd_core::workflow::WORKFLOWS.join(", ")
        ))
    })
}
