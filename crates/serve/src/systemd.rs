//! systemd: the notify protocol (`Type=notify`), through the sd-notify crate. Without
//! `NOTIFY_SOCKET` every call does nothing.
//!
//! Theory of operation: a send to the notify socket blocks while its receiver's queue is full
//! (a busy PID 1, a debugging `socat`, a container's notify proxy that does not drain), so the
//! service never sends itself. It hands each notification to a thread of its own and goes on.
//! Pending notifications are coalesced: the latest `STATUS=` replaces one not sent yet, and a
//! `WATCHDOG=1` joins one already waiting; `READY=1`, `RELOADING=1` and `STOPPING=1` are sent
//! in the order they came, none dropped (a reload begun and ended while the receiver was stuck
//! is dropped whole, as it changed nothing, once many wait). A stuck receiver costs that thread
//! only, and memory that does not grow.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use sd_notify::NotifyState;

use loopd_store::lock;

/// How many state changes wait at most; beyond, completed reloads are dropped first.
const MAX_PENDING: usize = 64;

/// Tells the service manager how the service is doing.
pub struct Notifier {
    /// How often the manager wants `WATCHDOG=1`, when `WatchdogSec` is set.
    pub watchdog: Option<Duration>,
    /// The notifications not sent yet; `None` without a manager to tell.
    queue: Option<Arc<Queue>>,
}

/// A state change of the service, in the order the manager must hear them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    Ready,
    /// A reload began, at this `CLOCK_MONOTONIC` time in microseconds (systemd 253 and later
    /// want it).
    Reloading(Option<i128>),
    Stopping,
    Watchdog,
}

#[derive(Default)]
struct Pending {
    changes: VecDeque<Change>,
    status: Option<String>,
    /// The thread is sending what it took.
    sending: bool,
}

#[derive(Default)]
struct Queue {
    pending: Mutex<Pending>,
    wake: Condvar,
}

impl Pending {
    fn push(&mut self, change: Change) {
        if change == Change::Watchdog && self.changes.contains(&Change::Watchdog) {
            return;
        }
        if self.changes.len() >= MAX_PENDING {
            // A reload that began and ended while the receiver was stuck changed nothing.
            let pair = self
                .changes
                .iter()
                .zip(self.changes.iter().skip(1))
                .position(|(a, b)| matches!((a, b), (Change::Reloading(_), Change::Ready)));
            match pair {
                Some(i) => {
                    self.changes.drain(i..i + 2);
                }
                None => return,
            }
        }
        self.changes.push_back(change);
    }
}

impl Notifier {
    pub fn from_env() -> Notifier {
        let queue = std::env::var_os("NOTIFY_SOCKET").map(|_| {
            let queue = Arc::new(Queue::default());
            let sender = queue.clone();
            let started = std::thread::Builder::new()
                .name("loopd-notify".into())
                .spawn(move || sender.run());
            if let Err(e) = started {
                tracing::warn!("cannot start the thread that notifies systemd ({e})");
            }
            queue
        });
        Notifier {
            watchdog: sd_notify::watchdog_enabled(),
            queue,
        }
    }

    fn push(&self, change: Change) {
        if let Some(queue) = &self.queue {
            lock(&queue.pending).push(change);
            queue.wake.notify_all();
        }
    }

    /// Start-up is done: every loop found running was taken up again.
    pub fn ready(&self) {
        self.push(Change::Ready);
    }

    /// A one-line summary, shown by `systemctl status`.
    pub fn status(&self, line: &str) {
        if let Some(queue) = &self.queue {
            lock(&queue.pending).status = Some(line.to_owned());
            queue.wake.notify_all();
        }
    }

    /// The supervisor is alive.
    pub fn watchdog(&self) {
        self.push(Change::Watchdog);
    }

    /// A reload begins (`ready` ends it).
    pub fn reloading(&self) {
        let now = match NotifyState::monotonic_usec_now() {
            Ok(NotifyState::MonotonicUsec(t)) => Some(t),
            _ => None,
        };
        self.push(Change::Reloading(now));
    }

    pub fn stopping(&self) {
        self.push(Change::Stopping);
    }

    /// Waits until every notification is sent, for `limit` at most: before the process exits,
    /// which would end the thread with `STOPPING=1` unsent.
    pub fn flush(&self, limit: Duration) {
        let Some(queue) = &self.queue else { return };
        let deadline = std::time::Instant::now() + limit;
        let mut pending = lock(&queue.pending);
        while pending.sending || !pending.changes.is_empty() || pending.status.is_some() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    "systemd's notify socket takes no message; exiting without telling it all"
                );
                return;
            }
            pending = queue
                .wake
                .wait_timeout(pending, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Queue {
    /// Sends what is pending, in order, each change in a datagram of its own and the latest
    /// status last; then waits for more. A send may block: only this thread waits.
    fn run(&self) {
        loop {
            let (changes, status) = {
                let mut pending = lock(&self.pending);
                pending.sending = false;
                // A flush waits on the same condition.
                self.wake.notify_all();
                while pending.changes.is_empty() && pending.status.is_none() {
                    pending = self.wake.wait(pending).unwrap_or_else(|e| e.into_inner());
                }
                pending.sending = true;
                (std::mem::take(&mut pending.changes), pending.status.take())
            };
            for change in changes {
                match change {
                    Change::Ready => send(&[NotifyState::Ready]),
                    Change::Reloading(at) => {
                        let mut states = vec![NotifyState::Reloading];
                        if let Some(at) = at {
                            states.push(NotifyState::MonotonicUsec(at));
                        }
                        send(&states);
                    }
                    Change::Stopping => send(&[NotifyState::Stopping]),
                    Change::Watchdog => send(&[NotifyState::Watchdog]),
                }
            }
            if let Some(line) = status {
                send(&[NotifyState::Status(&line)]);
            }
        }
    }
}

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::debug!("cannot notify the service manager: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_changes_keep_their_order_and_stay_bounded() {
        let mut p = Pending::default();
        p.push(Change::Ready);
        p.push(Change::Watchdog);
        p.push(Change::Watchdog);
        assert_eq!(p.changes, [Change::Ready, Change::Watchdog]);
        // A stuck receiver and a storm of reloads: completed reloads make room, the order of
        // what is left holds, and the last reload's end is never lost.
        for _ in 0..1000 {
            p.push(Change::Reloading(Some(1)));
            p.push(Change::Ready);
        }
        p.push(Change::Stopping);
        assert!(p.changes.len() <= MAX_PENDING, "{}", p.changes.len());
        assert_eq!(p.changes.front(), Some(&Change::Ready));
        assert_eq!(p.changes.back(), Some(&Change::Stopping));
        let reloads = p
            .changes
            .iter()
            .filter(|c| matches!(c, Change::Reloading(_)))
            .count();
        let readies = p.changes.iter().filter(|c| **c == Change::Ready).count();
        assert_eq!(readies, reloads + 1, "{:?}", p.changes);
    }
}
