//! `loopd checkpoints`, `diff` and `rollback`: a loop's git checkpoints
//! ([`loopd_file_driver::checkpoints`]) printed as the user reads them.

use anyhow::Result;

use loopd_file_driver::checkpoints;
use loopd_file_driver::project::Project;

/// `loopd checkpoints ID`: the loop's checkpoints, oldest first, with what each changed.
pub fn list_command(p: &Project, id: &str, as_json: bool) -> Result<i32> {
    let shown = checkpoints::list(p, id)?;
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
pub fn diff_command(p: &Project, id: &str, name: Option<&str>) -> Result<i32> {
    let text = checkpoints::diff_text(p, id, name)?;
    if !text.is_empty() {
        crate::outln!("{text}")?;
    }
    Ok(0)
}

/// `loopd rollback ID CHECKPOINT`: refused while a daemon runs the loop's actions.
pub fn rollback_command(
    p: &Project,
    id: &str,
    name: &str,
    force: bool,
    as_json: bool,
) -> Result<i32> {
    let commit = checkpoints::rollback(p, id, name, force)?;
    crate::output::print_result(
        as_json,
        &serde_json::json!({ "loop_id": id, "checkpoint": name, "commit": commit }),
        &format!("loop {id}: the work tree is back as it was at checkpoint {name}"),
    )?;
    Ok(0)
}
