//! Process groups: finding their live members in `/proc` and ending them.
//!
//! Stop sequence (as nextest and watchexec do it): SIGTERM to the whole group, a grace timer,
//! SIGKILL to the group, and a bounded wait until no live member is left. Zombies do not count as
//! alive: they hold no resources but a pid and cannot be killed, only reaped by their parent.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// The process group of the attempt in flight, for a second signal that must end it at once.
static CURRENT_GROUP: AtomicU32 = AtomicU32::new(0);

/// Records (or, with 0, clears) the process group of the attempt in flight.
pub fn set_current_group(pgid: u32) {
    CURRENT_GROUP.store(pgid, Ordering::SeqCst);
}

/// SIGKILLs the process group of the attempt in flight, if there is one.
pub fn kill_current_group() {
    let pgid = CURRENT_GROUP.load(Ordering::SeqCst);
    if pgid > 1 {
        signal_group(pgid, Signal::SIGKILL);
    }
}

/// One line of `/proc/PID/stat`, the fields loopd needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: u32,
    pub state: char,
    pub ppid: u32,
    pub pgid: u32,
    pub sid: u32,
    /// Start time in clock ticks after boot: with the pid, it names a process uniquely.
    pub start: u64,
}

impl ProcStat {
    pub fn read(pid: u32) -> Option<ProcStat> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Self::parse(&text)
    }

    fn parse(text: &str) -> Option<ProcStat> {
        // `pid (comm) state ppid pgrp session ...`; comm may hold spaces and parentheses.
        let close = text.rfind(')')?;
        let pid = text[..text.find('(')?].trim().parse().ok()?;
        let fields: Vec<&str> = text[close + 1..].split_whitespace().collect();
        Some(ProcStat {
            pid,
            state: fields.first()?.chars().next()?,
            ppid: fields.get(1)?.parse().ok()?,
            pgid: fields.get(2)?.parse().ok()?,
            sid: fields.get(3)?.parse().ok()?,
            start: fields.get(19)?.parse().ok()?,
        })
    }

    pub fn is_alive(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Every process visible in `/proc`.
pub fn all() -> Vec<ProcStat> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(ProcStat::read)
        .collect()
}

/// Whether any live (non-zombie) process is in group `pgid`.
pub fn group_alive(pgid: u32) -> bool {
    // Cheap first: no process at all in the group.
    if killpg(Pid::from_raw(pgid as i32), None) == Err(Errno::ESRCH) {
        return false;
    }
    all().iter().any(|p| p.pgid == pgid && p.is_alive())
}

fn signal_group(pgid: u32, signal: Signal) -> bool {
    killpg(Pid::from_raw(pgid as i32), signal) != Err(Errno::ESRCH)
}

/// Ends every process of group `pgid`: SIGTERM, up to `grace` for them to go, then SIGKILL.
/// Returns whether SIGKILL was needed.
pub async fn end_group(pgid: u32, grace: Duration) -> bool {
    if pgid <= 1 || !signal_group(pgid, Signal::SIGTERM) {
        return false;
    }
    let deadline = Instant::now() + grace;
    let mut pause = Duration::from_millis(1);
    while Instant::now() < deadline {
        if !group_alive(pgid) {
            return false;
        }
        tokio::time::sleep(pause.min(deadline.saturating_duration_since(Instant::now()))).await;
        pause = (pause * 2).min(Duration::from_millis(20));
    }
    signal_group(pgid, Signal::SIGKILL);
    // SIGKILL cannot be ignored; the wait is bounded anyway in case of uninterruptible sleep.
    let deadline = Instant::now() + Duration::from_secs(5);
    while group_alive(pgid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_awkward_comm() {
        let line = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 98765 0 0";
        let stat = ProcStat::parse(line).unwrap();
        assert_eq!(
            stat,
            ProcStat {
                pid: 4242,
                state: 'S',
                ppid: 1,
                pgid: 4242,
                sid: 4242,
                start: 98765
            }
        );
    }

    #[test]
    fn reads_own_stat() {
        let me = ProcStat::read(std::process::id()).unwrap();
        assert_eq!(me.pid, std::process::id());
        assert!(me.is_alive());
    }
}
