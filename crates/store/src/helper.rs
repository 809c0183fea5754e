//! Helper threads of this process that its other threads wake, placed by their waker.
//!
//! A virtual machine's scheduler tends to wake a thread on the CPU of the thread that woke it,
//! even while another CPU is idle, or on the CPU it last ran on, even while that one is busy:
//! there it waits, or preempts what runs. loopd's helper threads are woken by the daemon's own
//! writes: the backup thread by a record handed over at an action's end, the inotify reader by
//! every write to the state directory. Between two actions the daemon is what the next one waits
//! for, and the other CPU is free: a helper woken then is kept off the daemon's CPU. While an
//! attempt runs, the executor is what the loop waits for, and the daemon's CPU is free: the
//! inotify reader, woken by the record of the attempt in flight, is kept on the daemon's CPU.
//!
//! Measured with `perf record -e sched:sched_switch -a`, one 300-action loop each: the backup
//! thread, woken on the daemon's CPU, waited 153 µs at the median to start a record the next
//! attempt waits for (kept off it: 1 µs). Left where the scheduler put it, the inotify reader
//! preempted the daemon 425 times (6.2 ms) and the executor 212 times (10.9 ms); placed, it
//! preempted the executor no more, and the daemon mostly while an attempt runs.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering::Relaxed};

use nix::sched::{CpuSet, sched_getaffinity, sched_getcpu, sched_setaffinity};
use nix::unistd::Pid;

/// A helper thread: its thread id, the CPUs it may run on, and where it was last placed.
#[derive(Debug)]
pub(crate) struct Helper {
    /// Its thread id; 0 while it is not known (nothing is done then).
    tid: AtomicI32,
    /// The CPUs it was started on: those it is placed among.
    cpus: OnceLock<CpuSet>,
    /// Where it was last placed, as one number (`2 * cpu`: kept off `cpu`, `2 * cpu + 1`: kept on
    /// it; -1: not yet): nothing is done while its waker asks the same again.
    placed: AtomicI32,
}

impl Helper {
    /// A helper whose thread is not started yet ([`Helper::started`]).
    pub(crate) const fn unknown() -> Helper {
        Helper {
            tid: AtomicI32::new(0),
            cpus: OnceLock::new(),
            placed: AtomicI32::new(-1),
        }
    }

    /// Starts thread `name` as `helper`, running `body`; returns once it is known (its id and
    /// CPUs), so that the first wake-up is already placed.
    pub(crate) fn spawn(
        name: &str,
        helper: impl std::ops::Deref<Target = Helper> + Send + 'static,
        body: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<()> {
        let (up, is_up) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                helper.started();
                let _ = up.send(());
                body();
            })?;
        let _ = is_up.recv();
        Ok(())
    }

    /// The calling thread is the helper.
    fn started(&self) {
        if let Ok(cpus) = sched_getaffinity(Pid::from_raw(0)) {
            let _ = self.cpus.set(cpus);
        }
        self.tid.store(nix::unistd::gettid().as_raw(), Relaxed);
    }

    /// Its thread id (0: not known).
    pub(crate) fn tid(&self) -> i32 {
        self.tid.load(Relaxed)
    }

    /// Keeps the helper off the calling thread's CPU, where it may run on another.
    pub(crate) fn keep_off_callers_cpu(&self) {
        self.place(false);
    }

    /// Keeps the helper on the calling thread's CPU.
    pub(crate) fn keep_on_callers_cpu(&self) {
        self.place(true);
    }

    /// One system call when the caller has moved or asks otherwise than the last time, else none.
    fn place(&self, on: bool) {
        let (tid, Some(cpus)) = (self.tid(), self.cpus.get()) else {
            return;
        };
        let Ok(here) = sched_getcpu() else {
            return;
        };
        let code = i32::try_from(2 * here + usize::from(on)).unwrap_or(-1);
        // Asked once per placement, whatever comes of it: a machine that allows no affinity is
        // not asked again at every write. (Two wakers at once may leave it placed as the first
        // asked while the second is remembered: a placement, not a rule; the next change of
        // placement puts it right.)
        if tid <= 0 || self.placed.swap(code, Relaxed) == code {
            return;
        }
        let set = match on {
            true => {
                let mut one = CpuSet::new();
                one.set(here).map(|()| one)
            }
            false => {
                let mut elsewhere = *cpus;
                elsewhere.unset(here).map(|()| elsewhere)
            }
        };
        if let Ok(set) = set
            && (0..CpuSet::count()).any(|c| set.is_set(c).unwrap_or(false))
        {
            let _ = sched_setaffinity(Pid::from_raw(tid), &set);
        }
    }
}

/// The thread that reads the process's inotify instance ([`crate::watch`]): every write to a watched directory
/// wakes it (see [`place_inotify_reader`]).
pub(crate) static INOTIFY_READER: Helper = Helper::unknown();

/// Places the thread that reads inotify's events before the calling thread writes to a watched
/// directory, which wakes it (see [`crate::helper`]). A `durable` write ends an action: the
/// next waits for the writer, whose CPU the reader is kept off, to run beside it rather than in
/// its place. Another write is mostly the record of an attempt in flight, made while its
/// executor runs on another CPU: the reader is kept on the writer's, which then has nothing else
/// to do, rather than on the executor's.
pub(crate) fn place_inotify_reader(durable: bool) {
    match durable {
        true => INOTIFY_READER.keep_off_callers_cpu(),
        false => INOTIFY_READER.keep_on_callers_cpu(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The CPUs thread `tid` may run on (0: the caller).
    pub(crate) fn cpus(tid: i32) -> Vec<usize> {
        let set = sched_getaffinity(Pid::from_raw(tid)).unwrap();
        (0..CpuSet::count())
            .filter(|c| set.is_set(*c).unwrap_or(false))
            .collect()
    }

    /// Whether this machine lets a thread set affinities at all.
    pub(crate) fn affinity_allowed() -> bool {
        let own = sched_getaffinity(Pid::from_raw(0)).unwrap();
        sched_setaffinity(Pid::from_raw(0), &own).is_ok()
    }

    /// Asserts that helper thread `tid` may run on every CPU of the caller's but one, when the
    /// caller has more than one: the one the caller was on when it last woke the helper.
    pub(crate) fn assert_kept_off_one_cpu(tid: i32) {
        let mine = cpus(0);
        let theirs = cpus(tid);
        if mine.len() > 1 {
            assert_eq!(theirs.len(), mine.len() - 1, "{theirs:?} of {mine:?}");
            assert!(
                theirs.iter().all(|c| mine.contains(c)),
                "{theirs:?} of {mine:?}"
            );
        } else {
            assert_eq!(theirs, mine);
        }
    }

    /// A helper is kept off, or on, the CPU its caller is on, and placed again once the caller
    /// has moved: pinned to each of its CPUs in turn, the caller finds the helper elsewhere, then
    /// there alone.
    #[test]
    fn a_helper_is_kept_off_or_on_the_cpu_its_caller_is_on_wherever_the_caller_goes() {
        if !affinity_allowed() {
            return; // a machine that allows no affinity at all: nothing to place
        }
        let helper = std::sync::Arc::new(Helper::unknown());
        let (told, its_tid) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let (done, ended) = std::sync::mpsc::channel::<()>();
        Helper::spawn("helper-test", helper.clone(), move || {
            told.send(nix::unistd::gettid().as_raw()).unwrap();
            let _ = stopped.recv();
            let _ = done.send(());
        })
        .unwrap();
        // Known once started, before the body runs.
        let tid = helper.tid();
        assert_eq!(its_tid.recv().unwrap(), tid);
        let all = sched_getaffinity(Pid::from_raw(0)).unwrap();
        let mine = cpus(0);
        for cpu in &mine {
            let mut one = CpuSet::new();
            one.set(*cpu).unwrap();
            sched_setaffinity(Pid::from_raw(0), &one).unwrap();
            helper.keep_off_callers_cpu();
            let theirs = cpus(tid);
            if mine.len() > 1 {
                assert!(!theirs.contains(cpu), "{theirs:?} holds {cpu}");
                assert_eq!(theirs.len(), mine.len() - 1, "{theirs:?} of {mine:?}");
            }
            helper.keep_on_callers_cpu();
            assert_eq!(cpus(tid), [*cpu]);
        }
        sched_setaffinity(Pid::from_raw(0), &all).unwrap();
        helper.keep_off_callers_cpu();
        assert_kept_off_one_cpu(tid);
        stop.send(()).unwrap();
        ended.recv().unwrap();
    }
}
