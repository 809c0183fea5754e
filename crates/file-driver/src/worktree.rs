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

/// Refuses `parallel` over 1 where the loop's tasks cannot each have a work tree of their own:
/// a project outside git, or checkpoints off.
pub fn check_parallel(p: &Project, parallel: Option<u64>) -> Result<()> {
    let Some(n) = parallel.filter(|n| *n > 1) else {
        return Ok(());
    };
    if p.config.checkpoint == loopd_project::config::Checkpoints::Off {
        return Err(usage(format!(
            "--parallel {n} needs git checkpoints, and the config says checkpoint = \"off\""
        )));
    }
    git(&p.root, &["rev-parse", "--is-inside-work-tree"]).map_err(|_| {
        usage(format!(
            "--parallel {n} needs a git repository (each task is developed in a work tree of its \
             own and merged back by git); {} is in none",
            p.root.display()
        ))
    })
}

/// Refuses a race that cannot be run: fewer than two executors, one that is not configured or
/// whose name git cannot take into a ref, or a project where tasks cannot have work trees of
/// their own.
pub fn check_race(p: &Project, race: &[String]) -> Result<()> {
    if race.is_empty() {
        return Ok(());
    }
    check_race_names(p, race)?;
    check_parallel(p, Some(2)).map_err(|_| {
        usage(format!(
            "--race needs a git repository with checkpoints (each executor tries the task in a \
             work tree of its own); {} has none",
            p.root.display()
        ))
    })
}

/// Refuses a race of fewer than two executors, or of one the project does not configure or
/// whose name git cannot take into a ref.
pub fn check_race_names(p: &Project, race: &[String]) -> Result<()> {
    p.config
        .check_race(race)
        .map_err(|why| usage(format!("--race: {why} (repeat --race for each)")))
}

/// Removes a worktree and its branch, for a loop whose creation failed after it was made.
pub fn remove(root: &Path, worktree: &Worktree) {
    if let Some(path) = worktree.path.to_str() {
        let _ = git(root, &["worktree", "remove", "--force", path]);
    }
    let _ = git(root, &["branch", "--quiet", "-D", &worktree.branch]);
}

/// Where the work trees of a loop's tasks developed at once live: `worktrees/{id}.lanes/N` in
/// the state dir, one per attempt of a batch.
pub fn lanes_path(store: &Store, id: &str) -> PathBuf {
    store.dir().join("worktrees").join(format!("{id}.lanes"))
}

/// Makes the work tree of lane `number` of loop `id`: a git worktree of the repository `repo`
/// is in, detached at `commit` (nothing on any branch changes), its files not yet written (the
/// caller writes them from the checkpoints' vault, [`loopd_exec::checkpoint::Repo::fill`]). What a
/// daemon that died left there is removed first.
pub fn add_lane(
    repo: &Path,
    store: &Store,
    id: &str,
    number: usize,
    commit: &str,
) -> Result<PathBuf> {
    // The directories it goes in are the state dir's own, private and checked, never a link.
    store
        .state_dir(true)?
        .subdir("worktrees", true)
        .and_then(|d| d.subdir(&format!("{id}.lanes"), true))
        .context("cannot make the state dir's directory of work trees")?;
    let path = lanes_path(store, id).join(number.to_string());
    let target = path.to_str().context("the state dir's path is not UTF-8")?;
    if path.symlink_metadata().is_ok() {
        remove_tree(repo, &path);
    }
    git(
        repo,
        &[
            "worktree",
            "add",
            "--detach",
            "--no-checkout",
            "--quiet",
            target,
            commit,
        ],
    )
    .map_err(|why| anyhow::anyhow!("cannot make a work tree for a task of loop {id}: {why}"))?;
    Ok(path)
}

/// Removes every lane's work tree of loop `id` (after a batch, or what a daemon that died left);
/// returns how many there were.
pub fn remove_lanes(repo: &Path, store: &Store, id: &str) -> usize {
    let dir = lanes_path(store, id);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        remove_tree(repo, &entry.path());
        removed += 1;
    }
    let _ = std::fs::remove_dir(&dir);
    removed
}

/// Removes a worktree git knows, or a directory it no longer does, and git's record of it.
fn remove_tree(repo: &Path, path: &Path) {
    if let Some(target) = path.to_str() {
        let _ = git(repo, &["worktree", "remove", "--force", "--force", target]);
    }
    if path.symlink_metadata().is_ok() {
        // Not a link followed: remove_dir_all removes a link itself, not what it points to.
        let _ = std::fs::remove_dir_all(path);
    }
    let _ = git(repo, &["worktree", "prune"]);
}

/// Runs git in `root`; on failure, the last line it printed (or why it did not run).
fn git(root: &Path, args: &[&str]) -> Result<(), String> {
    loopd_exec::git::output(loopd_exec::git::command(root).args(args)).map(drop)
}
