//! What a driver offers a front (the service's API and page): the loops it holds, listed, shown,
//! changed, created and followed. The file driver (the projects a service serves) and the
//! Temporal driver each implement [`Driver`]; a front holds them in order and asks each in turn,
//! and the first that holds a loop answers for it.
//!
//! A method that names a loop answers `None` when its driver does not hold it, so that the next
//! may be asked. What a person asked for and cannot have is a [`Refused`] error; any other error
//! is the driver's.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use anyhow::Result;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::control::{Change, SetLimits};
use crate::state::LoopState;
use crate::still::Still;

/// What a front asks of the loops of one driver.
#[async_trait::async_trait]
pub trait Driver: Send + Sync {
    /// Where its loops live, as a front shows it: `file`, `temporal`.
    fn name(&self) -> &'static str;

    /// Whether this process drives its loops (their daemons are the front's to show), rather
    /// than some other place (their standing is their own).
    fn here(&self) -> bool {
        false
    }

    /// Every loop it holds.
    async fn list(&self) -> Result<Vec<Listed>>;

    /// Loop `id` (in the project at `root`, where two hold one of that id).
    async fn show(&self, id: &str, root: Option<&Path>) -> Result<Option<Shown>>;

    /// Makes a change a person asks for; the answer is the file store's shape for it (for a
    /// status change `{loop_id, from, status, changed}`).
    async fn change(&self, id: &str, root: Option<&Path>, change: Change) -> Result<Option<Value>>;

    /// Makes a loop in the project at `new.root`, started unless it is interactive: `None` when
    /// that project is none of this driver's.
    async fn create(&self, new: &NewLoop) -> Result<Option<Created>> {
        let _ = new;
        Ok(None)
    }

    /// Loop `id`'s events after the `after`th.
    async fn events(&self, id: &str, root: Option<&Path>, after: u64) -> Result<Option<Events>>;

    /// The attempt loop `id` runs now and up to `bytes` of the end of its output: `{loop_id,
    /// in_flight, text}`, `in_flight` and `text` null when none runs.
    async fn tail(&self, id: &str, root: Option<&Path>, bytes: u64) -> Result<Option<Value>>;

    /// What only the loops in a work tree of this machine have ([`Local`]): refused here for a
    /// loop this driver holds.
    async fn local(&self, id: &str, root: Option<&Path>, ask: Local) -> Result<Option<Value>> {
        match self.show(id, root).await? {
            Some(_) => Err(Refused(format!(
                "{}: {} holds loop {id}",
                ask.refusal(id),
                self.name()
            ))
            .into()),
            None => Ok(None),
        }
    }
}

/// Asks each of `drivers` in turn (`ask` answers `None` for one that does not hold what it
/// asks about); the first answer, if any gave one.
pub async fn first<T, Asked: Future<Output = Result<Option<T>>>>(
    drivers: &[Arc<dyn Driver>],
    mut ask: impl FnMut(Arc<dyn Driver>) -> Asked,
) -> Result<Option<T>> {
    for driver in drivers {
        if let Some(answer) = ask(driver.clone()).await? {
            return Ok(Some(answer));
        }
    }
    Ok(None)
}

/// A loop in a driver's list.
#[derive(Debug)]
pub struct Listed {
    /// The root of its project.
    pub root: PathBuf,
    pub id: String,
    /// Its state, or why it cannot be read.
    pub state: std::result::Result<LoopState, String>,
    /// Why it stands still where only its driver knows (no worker to run it); else its state's
    /// own reason ([`LoopState::still`]).
    pub still: Option<Still>,
}

/// A loop as a driver holds it.
#[derive(Debug)]
pub struct Shown {
    /// The root of its project.
    pub root: PathBuf,
    pub state: LoopState,
    /// The state as its driver keeps it, the fields this version does not know included.
    pub raw: Map<String, Value>,
    /// Why it stands still where only its driver knows (no worker to run it); else its state's
    /// own reason ([`LoopState::still`]).
    pub still: Option<Still>,
}

/// A loop a front asks a driver to make: `loopd create`'s options.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewLoop {
    /// The root of its project.
    pub root: PathBuf,
    pub title: Option<String>,
    #[serde(default)]
    pub description: String,
    /// Its workflow [default: the project's].
    pub workflow: Option<String>,
    /// Interactive: a person chooses each next action; the loop waits until then.
    #[serde(default)]
    pub interactive: bool,
    #[serde(default)]
    pub tasks: Vec<String>,
    /// Each task tried by each of these executors, the first to pass kept.
    #[serde(default)]
    pub race: Vec<String>,
    /// In a git work tree of its own.
    #[serde(default)]
    pub worktree: bool,
    /// Started at once (by the service where one runs), with `executor` if one is named.
    #[serde(default)]
    pub start: bool,
    pub executor: Option<String>,
    pub max_iterations: Option<u64>,
    pub max_errors: Option<u64>,
    pub max_cost_usd: Option<f64>,
    pub max_tokens: Option<u64>,
    pub parallel: Option<u64>,
}

impl NewLoop {
    /// Its limits and budgets, those not given the project's.
    pub fn limits(&self) -> SetLimits {
        SetLimits {
            max_iterations: self.max_iterations,
            max_errors: self.max_errors,
            max_cost_usd: self.max_cost_usd,
            max_tokens: self.max_tokens,
            parallel: self.parallel,
        }
    }
}

/// A loop a driver made.
#[derive(Debug)]
pub struct Created {
    pub id: String,
    /// The root of its project.
    pub root: PathBuf,
    /// The daemon that drives it, where it was started and one of its own does (a service
    /// drives it in its own process).
    pub pid: Option<u32>,
}

/// A loop's events, each with its number in the loop's event log (from 1) and its JSON line.
pub enum Events {
    /// As they are written, for as long as the log can be read.
    Live(Pin<Box<dyn futures_core::Stream<Item = (u64, String)> + Send>>),
    /// Those written so far: a follower asks again, after the last it saw, for the rest.
    SoFar(Vec<(u64, String)>),
}

/// What only a loop in a work tree of this machine has: its checkpoints, and what it takes them
/// and its files back.
#[derive(Clone, Debug)]
pub enum Local {
    /// The state change of `loopd retry`: a failed loop running again.
    Retry,
    /// Its checkpoints, oldest first.
    Checkpoints,
    /// What one checkpoint changed; without one, what the loop changed in all.
    Diff(Option<String>),
    /// The work tree back as it was at a checkpoint.
    Rollback { checkpoint: String, force: bool },
}

impl Local {
    /// Why a driver that cannot do it refuses, for loop `id`.
    pub fn refusal(&self, id: &str) -> String {
        match self {
            Local::Retry => format!("loop {id} is not retried here"),
            _ => format!("the checkpoints of loop {id} are not served here"),
        }
    }
}

/// What a person asked for and cannot have, in one line.
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}
