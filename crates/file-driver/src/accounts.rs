//! Rate limits shared by the loops of one account. When one loop's agent is told to wait, the
//! other loops of the same account in this process (a service's) wait until the same time,
//! instead of starting attempts that would be refused the same way; loops of other accounts go
//! on. An executor's account is its config's `account`, else its name.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::{DateTime, TimeDelta, Utc};

/// A hold that ends sooner than this is over: the wait for it has ended, give or take a timer's
/// granularity.
const OVER: TimeDelta = TimeDelta::milliseconds(5);

/// Each account's hold: until when its loops wait.
#[derive(Clone, Debug, Default)]
pub struct Accounts(Arc<Mutex<HashMap<String, DateTime<Utc>>>>);

impl Accounts {
    /// Until when `account`'s loops wait, if they do at `now`.
    pub fn held(&self, account: &str, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let mut holds = self.holds();
        holds.retain(|_, until| *until - now > OVER);
        holds.get(account).copied()
    }

    /// `account` is rate limited until `until`: its loops wait until then, or until a later
    /// hold already known ends. Returns when the hold ends.
    pub fn hold(&self, account: &str, until: DateTime<Utc>) -> DateTime<Utc> {
        let mut holds = self.holds();
        let held = holds.entry(account.to_owned()).or_insert(until);
        *held = (*held).max(until);
        *held
    }

    fn holds(&self) -> MutexGuard<'_, HashMap<String, DateTime<Utc>>> {
        // A panic while holding the lock left the map whole: it only changes entry by entry.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_keeps_its_account_waiting_until_it_ends_and_no_other() {
        let accounts = Accounts::default();
        let now = Utc::now();
        let later = now + TimeDelta::seconds(30);
        assert_eq!(accounts.hold("claude", later), later);
        assert_eq!(accounts.held("claude", now), Some(later));
        assert_eq!(accounts.held("codex", now), None);
        // An earlier reset does not shorten it; a later one extends it.
        assert_eq!(accounts.hold("claude", now + TimeDelta::seconds(5)), later);
        let latest = now + TimeDelta::seconds(60);
        assert_eq!(accounts.hold("claude", latest), latest);
        assert_eq!(accounts.held("claude", latest), None, "over when it ends");
        // Shared by every clone: one service, one map.
        let other = accounts.clone();
        other.hold("codex", later);
        assert_eq!(accounts.held("codex", now), Some(later));
    }
}
