//! git, run as a program with its arguments: never through a shell, and without the `GIT_*`
//! variables that would point it at another repository or index.

use std::path::Path;
use std::process::{Command, Stdio};

/// `git -C dir`, with no standard input.
pub fn command(dir: &Path) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("-C").arg(dir);
    for var in [
        "GIT_DIR",
        "GIT_WORK_TREE",
        "GIT_INDEX_FILE",
        "GIT_OBJECT_DIRECTORY",
    ] {
        cmd.env_remove(var);
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// `git -C dir` ([`command`]) that commits as loopd, in the C locale (messages as the code reads
/// them).
pub fn as_loopd(dir: &Path) -> Command {
    let mut cmd = command(dir);
    cmd.env("GIT_AUTHOR_NAME", "loopd")
        .env("GIT_AUTHOR_EMAIL", "loopd@localhost")
        .env("GIT_COMMITTER_NAME", "loopd")
        .env("GIT_COMMITTER_EMAIL", "loopd@localhost")
        .env("LC_ALL", "C");
    cmd
}

/// Runs `cmd` as a process of loopd's own ([`crate::procs::own_output`]: no attempt's end takes
/// it for an orphan): its standard output without the trailing newline, or why it failed (the
/// last line git printed on stderr, or why it did not run).
pub fn output(cmd: &mut Command) -> Result<String, String> {
    let output = crate::procs::own_output(cmd).map_err(|e| format!("cannot run git: {e}"))?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout)
            .trim_end()
            .to_owned());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    Err(stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map_or_else(
            || format!("git failed ({})", output.status),
            |l| l.trim().to_owned(),
        ))
}
