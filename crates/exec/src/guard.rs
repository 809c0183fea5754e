//! A guard that outlives the process running attempts, only to end what its attempts left.
//!
//! A file driver's daemon that dies leaves its executors to the loop's next daemon, which finds
//! them by their marker ([`procs::with_marker`]). A process that runs attempts of loops held
//! elsewhere (a Temporal worker) has no next one: the loop goes on on another machine, and an
//! executor left behind would go on working in a tree that is no longer its own. Such a process
//! starts a guard ([`Guard::start`]: a child process that runs [`watch`]) and tells it, over a
//! pipe, the marker of each attempt it starts and ends. The pipe's write end is the runner's
//! alone (close-on-exec: no executor inherits it), so the guard reads its end of file exactly
//! when the runner is gone, however it went (SIGKILL included); then it ends every process of
//! the attempts still open (SIGTERM, [`GRACE`], SIGKILL) and exits. A runner that exits in order
//! closes the pipe with no attempt open, and the guard exits at once.

use std::collections::HashMap;
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncBufRead, AsyncBufReadExt as _};

use crate::procs;

/// How long the processes of an orphaned attempt get between SIGTERM and SIGKILL: short, as
/// nobody waits for their result any more.
pub const GRACE: Duration = Duration::from_millis(300);

/// The runner's end of a guard: a child process that ends the attempts left open when this
/// process is gone.
pub struct Guard {
    /// `None` once dropped.
    pipe: Mutex<Option<ChildStdin>>,
    child: Child,
}

impl Guard {
    /// Starts `program args...` as the guard; it must run [`watch`] over its stdin.
    pub fn start(program: &Path, args: &[&str]) -> std::io::Result<Guard> {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            // Its own process group: a signal to the runner's group (a terminal's Ctrl-C) must
            // not take the guard with it before it has done its job.
            .process_group(0)
            .spawn()?;
        procs::spare(child.id());
        let pipe = child.stdin.take();
        Ok(Guard {
            pipe: Mutex::new(pipe),
            child,
        })
    }

    /// An attempt whose processes will hold `marker` starts (told before its executor is
    /// spawned, so that no moment leaves one unguarded); it ends when the returned value is
    /// dropped, and its processes are the runner's business no more.
    pub fn attempt<'g>(&'g self, marker: &'g str) -> Guarded<'g> {
        self.tell('+', marker);
        Guarded {
            guard: self,
            marker,
        }
    }

    fn tell(&self, sign: char, marker: &str) {
        let mut pipe = self.pipe.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(pipe) = pipe.as_mut() else { return };
        if let Err(e) = writeln!(pipe, "{sign}{marker}") {
            tracing::warn!("warning: the guard of this process's executors is gone: {e}");
        }
    }
}

/// An attempt a [`Guard`] watches, until dropped.
pub struct Guarded<'g> {
    guard: &'g Guard,
    marker: &'g str,
}

impl Drop for Guarded<'_> {
    fn drop(&mut self) {
        self.guard.tell('-', self.marker);
    }
}

impl Drop for Guard {
    /// Closes the pipe; the guard, with no attempt open, exits at once.
    fn drop(&mut self) {
        drop(
            self.pipe
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        let _ = self.child.wait();
    }
}

/// The guard's side: reads `+MARKER` / `-MARKER` lines until the end of `input`, then ends the
/// processes of every attempt still open. Returns how many processes were left.
pub async fn watch(input: impl AsyncBufRead + Unpin) -> usize {
    let mut open: HashMap<String, usize> = HashMap::new();
    let mut lines = input.lines();
    while let Ok(Some(line)) = lines.next_line().await {
        match line.split_at_checked(1) {
            Some(("+", marker)) => *open.entry(marker.to_owned()).or_default() += 1,
            Some(("-", marker)) => {
                if let Some(n) = open.get_mut(marker) {
                    *n -= 1;
                    if *n == 0 {
                        open.remove(marker);
                    }
                }
            }
            _ => tracing::warn!("guard: ignored a line it does not know: {line:?}"),
        }
    }
    let mut left = 0;
    for marker in open.keys() {
        let pids = procs::with_marker(marker);
        left += pids.len();
        if !pids.is_empty() {
            procs::end_processes(&[], &pids, marker, GRACE).await;
        }
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn attempts_that_ended_leave_nothing_to_end() {
        let told = b"+loopd-attempt:guard-test-a\nnonsense\n-loopd-attempt:guard-test-a\n";
        assert_eq!(watch(&told[..]).await, 0);
    }

    #[tokio::test]
    async fn an_open_attempt_whose_processes_are_gone_ends_nothing() {
        let told = b"+loopd-attempt:guard-test-b\n+loopd-attempt:guard-test-b\n-loopd-attempt:guard-test-b\n";
        assert_eq!(watch(&told[..]).await, 0, "no process holds that marker");
    }
}
