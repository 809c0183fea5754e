//! systemd: the notify protocol (`Type=notify`), through the sd-notify crate. Without
//! `NOTIFY_SOCKET` every call does nothing.

use std::time::Duration;

use sd_notify::NotifyState;

/// Tells the service manager how the service is doing.
pub struct Notifier {
    /// How often the manager wants `WATCHDOG=1`, when `WatchdogSec` is set.
    pub watchdog: Option<Duration>,
}

impl Notifier {
    pub fn from_env() -> Notifier {
        Notifier {
            watchdog: sd_notify::watchdog_enabled(),
        }
    }

    fn send(&self, states: &[NotifyState]) {
        if let Err(e) = sd_notify::notify(states) {
            tracing::debug!("cannot notify the service manager: {e}");
        }
    }

    /// Start-up is done: every loop found running was taken up again.
    pub fn ready(&self) {
        self.send(&[NotifyState::Ready]);
    }

    /// A one-line summary, shown by `systemctl status`.
    pub fn status(&self, line: &str) {
        self.send(&[NotifyState::Status(line)]);
    }

    /// The supervisor is alive.
    pub fn watchdog(&self) {
        self.send(&[NotifyState::Watchdog]);
    }

    /// A reload begins (`ready` ends it).
    pub fn reloading(&self) {
        let mut states = vec![NotifyState::Reloading];
        // systemd 253 and later want the time of the reload with it.
        if let Ok(now) = NotifyState::monotonic_usec_now() {
            states.push(now);
        }
        self.send(&states);
    }

    pub fn stopping(&self) {
        self.send(&[NotifyState::Stopping]);
    }
}
