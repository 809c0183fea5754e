//! Process groups: finding their live members in `/proc` and ending them.
//!
//! Stop sequence (as nextest and watchexec do it): SIGTERM to the whole group, a grace timer,
//! SIGKILL to the group, and a bounded wait until no live member is left. Zombies do not count as
//! alive: they hold no resources but a pid and cannot be killed, only reaped by their parent. A
//! process whose main thread ended alone shows as a zombie too, yet lives on in its other threads
//! and holds its children: it counts as alive ([`ProcStat::is_alive`]).
//!
//! The attempts in flight are known by their process groups ([`attempt_started`]): a second
//! signal ends them all, and reaping a zombie never takes one of their executors from the task
//! that waits for it, so that one process can run the attempts of several loops.
//!
//! The process group alone is not enough: a child can leave it (`setsid`, `setpgid`). The daemon
//! is therefore a child subreaper, so such a child, once its parent exits, is reparented to the
//! daemon rather than to init; an attempt's processes are its group, the orphans reparented to the
//! daemon that hold its marker, and their descendants ([`attempt_processes`]). A daemon that died
//! leaves its executors to init; the next one finds them by the marker every executor inherits,
//! which `setsid env -i` keeps, or by the `LOOPD_STATE_FILE` in their environment
//! ([`leftovers`]), never by a pid the state file names.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// The attempts in flight in this process, by process group (which is also the executor's pid):
/// for a second signal that must end them at once, and so that ending one attempt never reaps
/// another's executor, whose owner waits for it.
static RUNNING: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Children of this process that are no attempt's (a worker's guard, see [`crate::guard`]):
/// never taken for an attempt's orphans.
static SPARED: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Marks `pid`, a child of this process, as no attempt's: ending an attempt never ends it.
pub fn spare(pid: u32) {
    SPARED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(pid);
}

fn spared(pid: u32) -> bool {
    SPARED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(&pid)
}

/// Forgets a child [`spare`]d while it lived, once its owner has reaped it (its pid may be
/// another's next).
pub fn unspare(pid: u32) {
    SPARED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .retain(|p| *p != pid);
}

/// Spawns `cmd`, a process of loopd's own (git, a notification command) that is no attempt's:
/// [`spare`]d from its birth, so that an attempt ending meanwhile neither takes it for one of its
/// orphans nor reaps it from its owner, who waits for it and then calls [`unspare`].
pub fn spawn_own(cmd: &mut std::process::Command) -> std::io::Result<std::process::Child> {
    born_spared(|| cmd.spawn(), |child| Some(child.id()))
}

/// Runs `with` on `cmd` spawned as a process of loopd's own (spared by every orphan sweep until
/// `with` returns, having waited for it).
pub fn own_child<T>(
    cmd: &mut std::process::Command,
    with: impl FnOnce(&mut std::process::Child) -> std::io::Result<T>,
) -> std::io::Result<T> {
    let mut child = born_spared(|| cmd.spawn(), |child| Some(child.id()))?;
    let _spared = Spared(child.id());
    let done = with(&mut child);
    let _ = child.kill();
    let _ = child.wait();
    done
}

/// [`own_output`] for tokio, which waits without a thread.
pub async fn own_output_async(
    cmd: &mut tokio::process::Command,
) -> std::io::Result<std::process::Output> {
    use std::process::Stdio;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = born_spared(|| cmd.spawn(), tokio::process::Child::id)?;
    let _spared = child.id().map(Spared);
    child.wait_with_output().await
}

/// Spawns with `spawn` and spares the child's pid before any sweep may see it (under the spawn
/// lock, which the orphan sweep takes too).
pub(crate) fn born_spared<C>(
    spawn: impl FnOnce() -> std::io::Result<C>,
    pid: impl Fn(&C) -> Option<u32>,
) -> std::io::Result<C> {
    let _seen_by_no_sweep_unspared = spawning();
    let child = spawn()?;
    if let Some(pid) = pid(&child) {
        spare(pid);
    }
    Ok(child)
}

/// [`unspare`]s its pid when dropped: when its owner has waited for it, or gave up waiting.
pub(crate) struct Spared(pub(crate) u32);

impl Drop for Spared {
    fn drop(&mut self) {
        unspare(self.0);
    }
}

/// How many times this process has begun ending an attempt's processes: a signal handler compares
/// it before and after, to tell whether a first signal has been acted on.
static ENDINGS: AtomicU64 = AtomicU64::new(0);

/// See `ENDINGS`.
pub fn endings() -> u64 {
    ENDINGS.load(Ordering::SeqCst)
}

fn running() -> std::sync::MutexGuard<'static, Vec<u32>> {
    RUNNING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Held while an executor is spawned and counted in flight, and while zombies are reaped: a
/// reap never runs between an executor's birth and its count, when it would take its exit status
/// from its owner.
static SPAWN: Mutex<()> = Mutex::new(());

/// See `SPAWN`.
pub fn spawning() -> std::sync::MutexGuard<'static, ()> {
    SPAWN.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Records an attempt in flight, by its process group.
pub fn attempt_started(pgid: u32) {
    running().push(pgid);
}

/// Forgets an attempt that ended.
pub fn attempt_ended(pgid: u32) {
    running().retain(|g| *g != pgid);
}

/// SIGTERMs the process group `pgid` if it is an attempt in flight whose executor, the group's
/// leader, is the process that started at `start` (so never a group whose leader was reaped and
/// whose number went to another); returns whether it did.
pub fn terminate_in_flight(pgid: u32, start: Option<u64>) -> bool {
    let running = running();
    let ours = pgid > 1
        && running.contains(&pgid)
        && ProcStat::read(pgid).is_some_and(|p| p.is_alive() && Some(p.start) == start);
    ours && signal_group(pgid, Signal::SIGTERM)
}

/// SIGKILLs the process group of every attempt in flight.
pub fn kill_running_groups() {
    for pgid in running().iter().filter(|g| **g > 1) {
        signal_group(*pgid, Signal::SIGKILL);
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
        Self::read_from(&format!("/proc/{pid}/stat"))
    }

    /// Reads a `stat` file of `/proc`: a process's, or one of its threads'.
    fn read_from(path: &str) -> Option<ProcStat> {
        use std::io::Read;
        // One read: the file is short, and /proc reports its size as 0.
        let mut buf = [0u8; 1024];
        let n = std::fs::File::open(path).ok()?.read(&mut buf).ok()?;
        Self::parse(std::str::from_utf8(&buf[..n]).ok()?)
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

    /// Whether the process lives: its main thread does, or, where the main thread ended alone (a
    /// zombie, not reaped while the rest of its process lives on), another of its threads does.
    /// Such a process still runs, holds its children (the kernel hands the main thread's
    /// children to a live thread of the same process) and cannot be reaped: it must be ended as
    /// any other.
    pub fn is_alive(&self) -> bool {
        self.thread_lives() || (self.state == 'Z' && another_live_thread(self.pid).is_some())
    }

    /// The directory of `/proc` through which what the process's threads share (its descriptors
    /// in `fd`, its `environ`) is read: `/proc/PID`, or, where the main thread ended alone (and
    /// with it those files of `/proc/PID`), a live thread's `/proc/PID/task/TID`.
    fn shared_dir(&self) -> String {
        let pid = self.pid;
        let thread = if self.thread_lives() {
            None
        } else {
            another_live_thread(pid)
        };
        match thread {
            Some(tid) => format!("/proc/{pid}/task/{tid}"),
            None => format!("/proc/{pid}"),
        }
    }

    /// Whether the thread this line is of (a process's main thread, or another) lives.
    fn thread_lives(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// A live thread of process `pid` other than its main thread.
fn another_live_thread(pid: u32) -> Option<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .filter_map(|t| t.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|tid| *tid != pid)
        .find(|tid| {
            ProcStat::read_from(&format!("/proc/{pid}/task/{tid}/stat"))
                .is_some_and(|t| t.thread_lives())
        })
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

fn signal_group(pgid: u32, signal: Signal) -> bool {
    killpg(Pid::from_raw(pgid as i32), signal) != Err(Errno::ESRCH)
}

/// Makes this process the reaper of its orphaned descendants, so that an executor's child that
/// escaped into a session of its own is reparented here, not to init, and can still be found.
pub fn become_subreaper() {
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        tracing::warn!(
            "warning: cannot become a child subreaper ({e}); escaped executor processes may be missed"
        );
    }
}

/// The children of this process's main thread (`/proc/self/task/PID/children`): the orphans
/// reparented to this process, a subreaper, are given to the first live thread of its thread
/// group, its main thread (the kernel's `find_new_reaper`); an executor is the child of the
/// thread that spawned it, and is known by its owner. `None` where the kernel does not offer
/// that list. (Read once, not once per thread: a service has some twenty threads.)
fn own_children() -> Option<Vec<u32>> {
    let path = format!("/proc/self/task/{}/children", std::process::id());
    let text = std::fs::read_to_string(path).ok()?;
    Some(
        text.split_whitespace()
            .filter_map(|p| p.parse::<u32>().ok())
            .collect(),
    )
}

/// Whether this process has no child at all, alive or not.
fn no_children() -> bool {
    use nix::sys::wait::{Id, WaitPidFlag, waitid};
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    waitid(Id::All, flags) == Err(Errno::ECHILD)
}

/// Reaps this process's zombie children, except the executors of attempts in flight (their
/// owners reap them).
fn reap_zombies() {
    let children = own_children().unwrap_or_else(|| {
        let me = std::process::id();
        all()
            .into_iter()
            .filter(|p| p.ppid == me)
            .map(|p| p.pid)
            .collect()
    });
    reap_among(&children);
}

/// Reaps the zombies among `children`, except the executors of attempts in flight; returns the
/// children left.
fn reap_among(children: &[u32]) -> Vec<u32> {
    use nix::sys::wait::{WaitPidFlag, waitpid};
    let _no_spawn = spawning();
    let keep: HashSet<u32> = running().iter().copied().collect();
    let mut left = Vec::with_capacity(children.len());
    for &pid in children {
        if !keep.contains(&pid)
            && !spared(pid)
            && ProcStat::read(pid).is_some_and(|p| !p.is_alive())
        {
            let _ = waitpid(Pid::from_raw(pid as i32), Some(WaitPidFlag::WNOHANG));
        } else {
            left.push(pid);
        }
    }
    left
}

/// The live processes of an attempt: the members of its process groups, the processes reparented
/// to this process (a subreaper) that are the attempt's, and the descendants of all of them, so
/// that a child that left the group or the session is still found.
///
/// A process reparented here is the attempt's when it holds the attempt's `marker` (see
/// [`marker_name`]), or when no other attempt is in flight in this process: then nobody else's it
/// can be. The executors of other attempts, and whatever holds their markers, are never counted:
/// one process may run the attempts of many loops.
///
/// Its cost is that of the attempt's own processes and this process's children, never of every
/// process of the machine: the tree is walked down from the group's leader and the orphans
/// (`/proc/PID/task/TID/children`), and only where the kernel does not list children is `/proc`
/// read whole.
pub fn attempt_processes(pgids: &[u32], marker: &str) -> Vec<u32> {
    let me = std::process::id();
    // Every child of loopd's own that lives now was spared at its birth ([`spawn_own`]).
    let (tree, own) = {
        let _no_spawn = spawning();
        let tree = Tree::read();
        let own = tree.children(me);
        (tree, own)
    };
    let in_flight: HashSet<u32> = running().iter().copied().collect();
    let others = in_flight.iter().any(|g| !pgids.contains(g));
    let target = marker_link(marker);
    let orphans = own.into_iter().filter(|pid| {
        !in_flight.contains(pid)
            && !spared(*pid)
            && ProcStat::read(*pid).is_some_and(|p| {
                p.is_alive() && (pgids.contains(&p.pgid) || !others || holds_marker(&p, &target))
            })
    });
    let mut stack: Vec<u32> = tree.members(pgids).into_iter().chain(orphans).collect();
    let mut found = HashSet::new();
    while let Some(pid) = stack.pop() {
        if pid != me && found.insert(pid) {
            stack.extend(tree.children(pid));
        }
    }
    let mut alive: Vec<u32> = found
        .into_iter()
        .filter(|pid| ProcStat::read(*pid).is_some_and(|p| p.is_alive()))
        .collect();
    alive.sort_unstable();
    alive
}

/// Who is whose child: as the kernel lists each process's children, or, where it does not,
/// from every process in `/proc`.
enum Tree {
    Listed,
    Scanned(Vec<ProcStat>),
}

impl Tree {
    fn read() -> Tree {
        if own_children().is_some() {
            Tree::Listed
        } else {
            Tree::Scanned(all())
        }
    }

    /// The children of `pid`, of all its threads.
    fn children(&self, pid: u32) -> Vec<u32> {
        match self {
            Tree::Listed => {
                let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                    return Vec::new();
                };
                tasks
                    .filter_map(|t| {
                        let path = t.ok()?.path().join("children");
                        std::fs::read_to_string(path).ok()
                    })
                    .flat_map(|text| {
                        text.split_whitespace()
                            .filter_map(|p| p.parse().ok())
                            .collect::<Vec<u32>>()
                    })
                    .collect()
            }
            Tree::Scanned(procs) => procs
                .iter()
                .filter(|p| p.ppid == pid)
                .map(|p| p.pid)
                .collect(),
        }
    }

    /// The members of the groups `pgids` from which the others are found: each group's leader
    /// while it lives (its descendants are walked to), and with a scan every member.
    fn members(&self, pgids: &[u32]) -> Vec<u32> {
        match self {
            Tree::Listed => pgids
                .iter()
                .copied()
                .filter(|g| ProcStat::read(*g).is_some_and(|p| p.is_alive() && p.pgid == *g))
                .collect(),
            Tree::Scanned(procs) => procs
                .iter()
                .filter(|p| pgids.contains(&p.pgid))
                .map(|p| p.pid)
                .collect(),
        }
    }
}

/// The live processes left by a daemon that died of the loop whose state file is `state_file`:
/// those holding its marker `marker` (see [`marker_name`]) or naming the state file as
/// `LOOPD_STATE_FILE` in their environment.
///
/// Reading every process's descriptors and environment costs as much as the machine has
/// processes; a service taking a thousand loops at once would pay it a thousand times, over its
/// own executors. So it is read once for the loops taken within [`CENSUS_FRESH`] of each other
/// ([`Census`]), and never from this process's own attempts (the members of the groups in
/// flight, which are no dead daemon's); a process found is checked to be the same one (its start
/// time) and to hold what it held before it is named.
pub fn leftovers(marker: &str, state_file: &std::path::Path) -> Vec<u32> {
    let state_file = state_file.as_os_str().as_encoded_bytes();
    let census = Census::now();
    let mut pids: Vec<u32> = census
        .held
        .iter()
        .filter(|h| {
            h.markers.iter().any(|m| m == marker) || h.state_file.as_deref() == Some(state_file)
        })
        .filter(|h| {
            ProcStat::read(h.pid).is_some_and(|p| {
                p.is_alive()
                    && p.start == h.start
                    && (holds_marker(&p, &marker_link(marker))
                        || environ_has(&p, STATE_FILE_VAR, state_file))
            })
        })
        .map(|h| h.pid)
        .collect();
    pids.sort_unstable();
    pids
}

/// How long a [`Census`] serves the loops taken after it.
const CENSUS_FRESH: Duration = Duration::from_secs(1);

/// The variable every executor's environment names its loop's state file in.
const STATE_FILE_VAR: &str = "LOOPD_STATE_FILE";

/// What the processes of the machine other than this one's attempts hold that names a loop.
struct Census {
    taken: Instant,
    held: Vec<Held>,
}

/// One process's markers and state file, with its start time.
struct Held {
    pid: u32,
    start: u64,
    markers: Vec<String>,
    state_file: Option<Vec<u8>>,
}

static CENSUS: Mutex<Option<Arc<Census>>> = Mutex::new(None);

impl Census {
    /// The census taken less than [`CENSUS_FRESH`] ago, or a new one.
    fn now() -> Arc<Census> {
        let mut kept = CENSUS.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(census) = kept.as_ref()
            && census.taken.elapsed() < CENSUS_FRESH
        {
            return census.clone();
        }
        let census = Arc::new(Census::take());
        *kept = Some(census.clone());
        census
    }

    fn take() -> Census {
        let me = std::process::id();
        let in_flight: HashSet<u32> = running().iter().copied().collect();
        let taken = Instant::now();
        let held = all()
            .into_iter()
            .filter(|p| p.pid != me && p.is_alive() && !in_flight.contains(&p.pgid))
            .filter_map(|p| {
                let markers = markers_of(&p);
                let state_file = environ(&p).and_then(|env| {
                    env.split(|b| *b == 0)
                        .find_map(|var| {
                            var.strip_prefix(STATE_FILE_VAR.as_bytes())?
                                .strip_prefix(b"=")
                        })
                        .map(<[u8]>::to_vec)
                });
                (!markers.is_empty() || state_file.is_some()).then_some(Held {
                    pid: p.pid,
                    start: p.start,
                    markers,
                    state_file,
                })
            })
            .collect();
        Census { taken, held }
    }
}

/// The loopd markers process `p` holds open.
fn markers_of(p: &ProcStat) -> Vec<String> {
    let Ok(fds) = std::fs::read_dir(format!("{}/fd", p.shared_dir())) else {
        return Vec::new();
    };
    fds.filter_map(|fd| {
        let link = std::fs::read_link(fd.ok()?.path()).ok()?;
        let name = link
            .to_str()?
            .strip_prefix("/memfd:")?
            .strip_suffix(" (deleted)")?;
        name.starts_with("loopd-attempt:").then(|| name.to_owned())
    })
    .collect()
}

fn environ(p: &ProcStat) -> Option<Vec<u8>> {
    std::fs::read(format!("{}/environ", p.shared_dir())).ok()
}

/// Whether the environment of process `p` holds `key=value`.
fn environ_has(p: &ProcStat, key: &str, value: &[u8]) -> bool {
    let needle = [key.as_bytes(), b"=", value].concat();
    environ(p).is_some_and(|env| env.split(|b| *b == 0).any(|var| var == needle))
}

fn signal_each(pids: &[u32], signal: Signal) {
    for pid in pids {
        let _ = nix::sys::signal::kill(Pid::from_raw(*pid as i32), signal);
    }
}

/// Ends every process of an attempt whose process group is `pgid` (see [`attempt_processes`]).
/// The executors of attempts in flight, this one's included, are left for their owners to reap.
/// Returns whether SIGKILL was needed.
pub async fn end_attempt(pgid: u32, marker: &str, grace: Duration) -> bool {
    ENDINGS.fetch_add(1, Ordering::SeqCst);
    // The common case, in two system calls: the group is empty and this process has no child
    // left at all (the executor was reaped already).
    let group_empty = !signal_group(pgid, Signal::SIGTERM);
    if group_empty && no_children() {
        return false;
    }
    // Perhaps only zombies reparented here, or the executors of other attempts (being spawned,
    // or running): then nothing of this attempt is left. Only the orphans are looked at.
    if group_empty && let Some(children) = own_children() {
        let children = reap_among(&children);
        let in_flight: HashSet<u32> = running().iter().copied().collect();
        let others_in_flight = in_flight.iter().any(|g| *g != pgid);
        let link = marker_link(marker);
        let mine = |pid: &u32| {
            !in_flight.contains(pid)
                && !spared(*pid)
                && ProcStat::read(*pid)
                    .is_some_and(|p| p.is_alive() && (!others_in_flight || holds_marker(&p, &link)))
        };
        if !children.iter().any(mine) {
            return false;
        }
    }
    end_processes(&[pgid], &[], marker, grace).await
}

/// The name of the marker every executor of the loop whose state file is `state_file` inherits:
/// an open memfd, `loopd-attempt:<hash of the path>`, which `setsid` and `env -i` keep.
pub fn marker_name(state_file: &std::path::Path) -> String {
    // FNV-1a: stable across processes and versions, which a recovering daemon needs.
    let hash = state_file
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("loopd-attempt:{hash:016x}")
}

/// What `/proc/PID/fd/N` links to for a process that holds the marker `name`.
fn marker_link(name: &str) -> String {
    format!("/memfd:{name} (deleted)")
}

fn holds_marker(p: &ProcStat, link: &str) -> bool {
    std::fs::read_dir(format!("{}/fd", p.shared_dir())).is_ok_and(|fds| {
        fds.filter_map(Result::ok)
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == link))
    })
}

/// The live processes that hold the marker `name` (see [`marker_name`]) open: an executor of
/// that loop and whatever it started, whatever session, group or environment they moved to.
pub fn with_marker(name: &str) -> Vec<u32> {
    let link = marker_link(name);
    let me = std::process::id();
    all()
        .into_iter()
        .filter(|p| p.pid != me && p.is_alive() && holds_marker(p, &link))
        .map(|p| p.pid)
        .collect()
}

/// Ends the processes `extra`, the members of the groups `pgids` and of the groups that a
/// process of `extra` leads, the processes reparented here that hold `marker`, and the
/// descendants of all of them (see [`attempt_processes`]): SIGTERM, up to `grace` for them to
/// go, then SIGKILL.
/// Returns whether SIGKILL was needed.
pub async fn end_processes(pgids: &[u32], extra: &[u32], marker: &str, grace: Duration) -> bool {
    ENDINGS.fetch_add(1, Ordering::SeqCst);
    let own = nix::unistd::getpgrp().as_raw() as u32;
    let mut groups: Vec<u32> = pgids
        .iter()
        .copied()
        .chain(
            extra
                .iter()
                .filter_map(|p| ProcStat::read(*p))
                .filter(|s| s.pgid == s.pid)
                .map(|s| s.pgid),
        )
        .filter(|g| *g > 1 && *g != own)
        .collect();
    groups.sort_unstable();
    groups.dedup();
    for g in &groups {
        signal_group(*g, Signal::SIGTERM);
    }
    let procs = |extra: &[u32]| {
        let mut pids = attempt_processes(&groups, marker);
        pids.extend(
            extra
                .iter()
                .filter(|p| ProcStat::read(**p).is_some_and(|s| s.is_alive())),
        );
        pids.sort_unstable();
        pids.dedup();
        pids
    };
    // A walk down the tree can miss a process whose parent is exiting as it reads (the kernel is
    // handing it to this subreaper: listed under neither): the attempt is taken for ended only
    // when a second walk, begun after the first, finds nothing either.
    let ended = |pids: &[u32]| pids.is_empty() && procs(extra).is_empty();
    let mut termed: HashSet<u32> = HashSet::new();
    let deadline = Instant::now() + grace;
    let mut pause = Duration::from_millis(1);
    loop {
        let pids = procs(extra);
        if ended(&pids) {
            reap_zombies();
            return false;
        }
        // Newcomers get their SIGTERM too.
        let new: Vec<u32> = pids.into_iter().filter(|p| termed.insert(*p)).collect();
        signal_each(&new, Signal::SIGTERM);
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(pause.min(deadline.saturating_duration_since(Instant::now()))).await;
        pause = (pause * 2).min(Duration::from_millis(20));
    }
    // SIGKILL cannot be ignored; rounds catch what forked meanwhile, bounded in case of
    // uninterruptible sleep.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        for g in &groups {
            signal_group(*g, Signal::SIGKILL);
        }
        let pids = procs(extra);
        if ended(&pids) || Instant::now() >= deadline {
            break;
        }
        signal_each(&pids, Signal::SIGKILL);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    reap_zombies();
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

    fn wait_until_zombie(pid: u32) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while ProcStat::read(pid).is_none_or(|p| p.is_alive()) {
            assert!(Instant::now() < deadline, "process {pid} did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_reap_takes_strays_but_never_the_executor_of_an_attempt_in_flight() {
        // Two children that exit at once: the executor of an attempt in flight, and a stray.
        let spawn = || std::process::Command::new("true").spawn().unwrap();
        let (mut executor, stray) = (spawn(), spawn());
        attempt_started(executor.id());
        wait_until_zombie(executor.id());
        wait_until_zombie(stray.id());
        let left = reap_among(&[executor.id(), stray.id()]);
        assert_eq!(left, [executor.id()]);
        assert!(
            ProcStat::read(stray.id()).is_none(),
            "the stray was not reaped"
        );
        // The executor's owner still gets its exit status.
        assert!(executor.wait().unwrap().success());
        attempt_ended(executor.id());
    }

    #[test]
    fn a_process_of_loopds_own_is_never_an_attempts_orphan_nor_reaped_from_its_owner() {
        // With no attempt in flight but the one that ends, every other child of this process
        // would be taken for that attempt's orphan: a git of the API, a notification command.
        let mut own = spawn_own(std::process::Command::new("sleep").arg("30")).unwrap();
        let pid = own.id();
        let found = attempt_processes(&[], "no-such-marker");
        assert!(!found.contains(&pid), "{found:?} has loopd's own child");
        // Its exit status is its owner's, whatever reaps meanwhile.
        own.kill().unwrap();
        wait_until_zombie(pid);
        assert_eq!(reap_among(&[pid]), [pid]);
        assert!(own.wait().is_ok());
        unspare(pid);
    }

    #[test]
    fn an_orphan_reparented_to_this_subreaper_is_reaped() {
        // An executor's child that outlives it is given to this process's main thread, whichever
        // thread spawned the executor.
        become_subreaper();
        let out = std::process::Command::new("sh")
            .args(["-c", "sleep 0.05 </dev/null >/dev/null 2>&1 & echo $!"])
            .output()
            .unwrap();
        let orphan: u32 = String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        wait_until_zombie(orphan);
        assert_eq!(
            ProcStat::read(orphan).map(|p| p.ppid),
            Some(std::process::id())
        );
        reap_zombies();
        assert!(
            ProcStat::read(orphan).is_none(),
            "the orphan was not reaped"
        );
    }

    #[test]
    fn reads_own_stat() {
        let me = ProcStat::read(std::process::id()).unwrap();
        assert_eq!(me.pid, std::process::id());
        assert!(me.is_alive());
    }
}
