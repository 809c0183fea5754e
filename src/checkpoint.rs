//! `loopd checkpoints`, `diff` and `rollback`: a loop's git checkpoints ([`loopd_exec::checkpoint`]) as the
//! user sees and uses them.

use anyhow::Result;

use loopd_core::state::Checkpoint;
use loopd_exec::checkpoint::Repo;

/// The repository of loop `id`'s work tree, with the loop's own index file.
fn of_loop(p: &loopd_file_driver::project::Project, id: &str) -> Result<Repo> {
    let loaded = p.store.load(id)?;
    let tree = loopd_file_driver::worktree::of(p, &loaded.state)?;
    let index = p.store.progress_dir(id).join("checkpoint.index");
    Repo::open(&tree.path, p.store.dir(), index, id).ok_or_else(|| {
        loopd_file_driver::error::usage(format!(
            "loop {id} has no checkpoints: its work tree {} is not in a git repository",
            tree.path.display()
        ))
    })
}

/// `loopd checkpoints ID`: the loop's checkpoints, oldest first, with what each changed.
pub fn list_command(
    p: &loopd_file_driver::project::Project,
    id: &str,
    as_json: bool,
) -> Result<i32> {
    let repo = of_loop(p, id)?;
    let mut shown = Vec::new();
    let mut before: Option<String> = None;
    for (name, commit) in repo.list()? {
        let mut checkpoint = Checkpoint {
            name,
            commit,
            ..Checkpoint::default()
        };
        if let Some(before) = &before {
            repo.count_changes(before, &mut checkpoint)?;
        }
        before = Some(checkpoint.commit.clone());
        shown.push(checkpoint);
    }
    if as_json {
        crate::outln!("{}", serde_json::to_string(&shown)?)?;
        return Ok(0);
    }
    if shown.is_empty() {
        crate::outln!("loop {id} has no checkpoint yet")?;
    }
    for c in &shown {
        crate::outln!(
            "{:<16} {}  {} files  +{} -{}",
            c.name,
            &c.commit[..c.commit.len().min(12)],
            c.files,
            c.insertions,
            c.deletions
        )?;
    }
    Ok(0)
}

/// `loopd diff ID [CHECKPOINT]`: what one action changed (from the checkpoint before it), or the
/// loop as a whole (from where it started to its last checkpoint).
pub fn diff_command(
    p: &loopd_file_driver::project::Project,
    id: &str,
    name: Option<&str>,
) -> Result<i32> {
    let repo = of_loop(p, id)?;
    let list = repo.list()?;
    let (from, to) = match name {
        Some(name) => {
            let to = repo.find(name)?;
            let at = list.iter().position(|(n, _)| n == name).unwrap_or(0);
            let from = match at.checked_sub(1) {
                Some(before) => list[before].1.clone(),
                None => format!("{to}^"),
            };
            (from, to)
        }
        None => {
            let (Some((_, first)), Some((_, last))) = (list.first(), list.last()) else {
                return Err(loopd_file_driver::error::usage(format!(
                    "loop {id} has no checkpoint"
                )));
            };
            (first.clone(), last.clone())
        }
    };
    let text = repo.diff(&from, &to)?;
    if !text.is_empty() {
        crate::outln!("{text}")?;
    }
    Ok(0)
}

/// `loopd rollback ID CHECKPOINT`: refused while a daemon runs the loop's actions.
pub fn rollback_command(
    p: &loopd_file_driver::project::Project,
    id: &str,
    name: &str,
    force: bool,
    as_json: bool,
) -> Result<i32> {
    let repo = of_loop(p, id)?;
    let state = p.store.load(id)?.state;
    if state.status == loopd_core::state::Status::Running
        && let Some(pid) = loopd_file_driver::locks::driving_daemon(&p.store, id)
    {
        return Err(loopd_file_driver::error::usage(format!(
            "loop {id} is running (daemon {pid}); pause it first: loopd pause {id}"
        )));
    }
    let commit = repo.rollback(name, force)?;
    let dir = loopd_store::events::ProgressDir::new(&p.store, id);
    if let Ok(mut events) = loopd_store::events::EventLog::open(id, &dir) {
        events.emit(
            loopd_store::events::Event::new(loopd_store::events::name::ROLLED_BACK)
                .with("checkpoint", name)
                .with("commit", commit.clone())
                .with("forced", force),
        );
    }
    crate::output::print_result(
        as_json,
        &serde_json::json!({ "loop_id": id, "checkpoint": name, "commit": commit }),
        &format!("loop {id}: the work tree is back as it was at checkpoint {name}"),
    )?;
    Ok(0)
}
