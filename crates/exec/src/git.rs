//! git, run as a program with its arguments: never through a shell, without the `GIT_*`
//! variables that would point it at another repository or index, and never running a program a
//! repository names ([`NO_REPOSITORY_PROGRAMS`]).

use std::path::Path;
use std::process::{Command, Stdio};

/// Settings that keep loopd's own git from running what a repository's files name: its hooks
/// (`.git/hooks/`, `core.hooksPath`), a file-system monitor, a pager, the `ext::` transport.
/// (An action cannot change a repository's config or hooks: the sandbox keeps them read-only.
/// These hold even for a repository someone else prepared.) A diff is asked without external
/// diff programs or text conversions (`--no-ext-diff --no-textconv`, see [`crate::checkpoint`]).
pub const NO_REPOSITORY_PROGRAMS: [&str; 4] = [
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.pager=cat",
    "protocol.ext.allow=never",
];

/// `git -C dir`, with no standard input, running nothing the repository names.
pub fn command(dir: &Path) -> Command {
    let mut cmd = Command::new("git");
    for setting in NO_REPOSITORY_PROGRAMS {
        cmd.arg("-c").arg(setting);
    }
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

/// The ssh command git runs for a remote: `$GIT_SSH_COMMAND`, else the user's own
/// (`core.sshCommand` of their global configuration), else `ssh`; never one a repository's config
/// names. Asked once a process.
pub fn ssh_command() -> std::ffi::OsString {
    static GLOBAL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(command) = std::env::var_os("GIT_SSH_COMMAND") {
        return command;
    }
    let global = GLOBAL.get_or_init(|| {
        let mut cmd = Command::new("git");
        cmd.args([
            "config",
            "--global",
            "--includes",
            "--get",
            "core.sshCommand",
        ])
        .stdin(Stdio::null());
        output(&mut cmd)
            .ok()
            .filter(|c| !c.trim().is_empty())
            .unwrap_or_else(|| "ssh".to_owned())
    });
    global.into()
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

/// Runs `cmd` to its end with no input, as a process of loopd's own (no attempt's end takes it
/// for an orphan, see [`crate::procs::spawn_own`]); what it printed, as
/// [`Command::output`] gives it. It is started as an attempt's executor is ([`crate::spawn`]):
/// with loopd's table of descriptors shared, not copied, so that a service holding a thousand
/// loops (and their descriptors) pays for none of them at each git command of a checkpoint.
pub fn own_output(cmd: &Command) -> std::io::Result<std::process::Output> {
    let started = crate::procs::born_spared(
        || crate::spawn::Command::from_std(cmd).start(),
        |started| Some(started.pid),
    )?;
    let _spared = crate::procs::Spared(started.pid);
    started.wait_with_output()
}

/// Runs `cmd` ([`own_output`]): its standard output without the trailing newline, or why it
/// failed (the last line git printed on stderr, or why it did not run).
pub fn output(cmd: &mut Command) -> Result<String, String> {
    let output = own_output(cmd).map_err(|e| format!("cannot run git: {e}"))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_output_gives_what_command_output_gives_and_no_descriptor_of_loopds() {
        let dir = tempfile::tempdir().unwrap();
        let held = std::fs::File::open(dir.path()).unwrap();
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            // Both pipes filled past their buffers at once, the directory and the
            // environment as asked, and the child's own descriptors.
            "head -c 300000 /dev/zero; head -c 300000 /dev/zero >&2; pwd >&2; \
             echo \"$GIVEN${HOME:-unset}\" >&2; ls /proc/$$/fd >&2; exit 3",
        ])
        .current_dir(dir.path())
        .env("GIVEN", "given")
        .env_remove("HOME");
        let out = own_output(&cmd).unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(out.stdout.len(), 300_000);
        let stderr = String::from_utf8_lossy(&out.stderr[300_000..]).into_owned();
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines[0], dir.path().to_str().unwrap(), "{stderr}");
        assert_eq!(lines[1], "givenunset", "{stderr}");
        // 0, 1, 2 and the one `ls` opened to read the directory: none of loopd's, such as
        // `held`.
        let fds: Vec<&str> = lines[2..].to_vec();
        assert!(fds.len() <= 4, "{fds:?} (loopd held {held:?})");
        assert!(["0", "1", "2"].iter().all(|fd| fds.contains(fd)), "{fds:?}");
    }
}
