//! A loop's work tree: the project root, where the project's loops run one at a time, or a git
//! worktree of its own (`loopd create --worktree`), where it runs beside the others on a branch
//! of its own, as ralph-orchestrator and vibe-kanban do.
//!
//! git is run through [`loopd_exec::git`].

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use loopd_core::state::{LoopState, Worktree};

use crate::error::usage;
use crate::project::Project;
use loopd_store::store::Store;

/// Where a loop's actions run.
#[derive(Clone, Debug)]
pub struct WorkTree {
    pub path: PathBuf,
    /// The loop's own worktree, not the project root shared with the project's other loops.
    pub own: bool,
}

/// The work tree of a loop. A recorded worktree must be the one loopd made for the loop and must
/// still exist.
pub fn of(p: &Project, state: &LoopState) -> Result<WorkTree> {
    let Some(recorded) = state.skill_state.as_ref().and_then(|s| s.worktree.as_ref()) else {
        return Ok(WorkTree {
            path: p.root.clone(),
            own: false,
        });
    };
    let id = &state.loop_id;
    let path = p.store.worktree_path(id);
    if recorded.path != path {
        return Err(usage(format!(
            "loop {id} names {} as its worktree; loopd runs a loop only in the worktree it made \
             for it, {}",
            recorded.path.display(),
            path.display()
        )));
    }
    if !path.join(".git").is_file() {
        return Err(usage(format!(
            "loop {id}'s worktree {} is gone (removed with `git worktree remove`?); a loop of its \
             own needs it",
            path.display()
        )));
    }
    Ok(WorkTree { path, own: true })
}

/// Makes a git worktree for a new loop at [`Store::worktree_path`], on a new branch
/// `loopd/<id>` from the project's HEAD.
pub fn create(root: &Path, store: &Store, id: &str) -> Result<Worktree> {
    git(root, &["rev-parse", "--verify", "--quiet", "HEAD^{commit}"]).map_err(|_| {
        usage(format!(
            "--worktree needs a git repository with at least one commit; {} has none",
            root.display()
        ))
    })?;
    // The directory it goes in is the state dir's own, private and checked, never a link.
    store
        .state_dir(true)?
        .subdir("worktrees", true)
        .context("cannot make the state dir's worktrees directory")?;
    let path = store.worktree_path(id);
    let branch = format!("loopd/{id}");
    let target = path.to_str().context("the state dir's path is not UTF-8")?;
    git(
        root,
        &["worktree", "add", "--quiet", "-b", &branch, target, "HEAD"],
    )
    .map_err(|why| usage(format!("cannot make a worktree for loop {id}: {why}")))?;
    Ok(Worktree { path, branch })
}

/// Removes a worktree and its branch, for a loop whose creation failed after it was made.
pub fn remove(root: &Path, worktree: &Worktree) {
    if let Some(path) = worktree.path.to_str() {
        let _ = git(root, &["worktree", "remove", "--force", path]);
    }
    let _ = git(root, &["branch", "--quiet", "-D", &worktree.branch]);
}

/// Runs git in `root`; on failure, the last line it printed (or why it did not run).
fn git(root: &Path, args: &[&str]) -> Result<(), String> {
    loopd_exec::git::output(loopd_exec::git::command(root).args(args)).map(drop)
}
