//! Watching a loop's state file for control changes written by anyone.
//!
//! Theory of operation: inotify watches the state *directory* (an atomic write replaces the file's
//! inode, which would end a watch on the file itself), read by loopd's own thread (`Inotify`,
//! which asks for no event when a file is only opened) and told as notify's events. Any event
//! naming the loop's state or task file means "maybe changed": the file is re-read on the
//! watcher's thread (once for the events read together) and reduced to a
//! [`Snapshot`] of what a controller can change. The snapshot is published on a
//! `tokio::sync::watch` channel only when it differs, so the daemon's own writes, which never
//! change those fields, wake nobody. A slow periodic re-check covers missed or overflowed events,
//! and when inotify cannot be used (its limits reached, or `LOOPD_WATCH=poll`) a polling watcher
//! takes over, and each watch reads its loop's state at every poll too (the polling watcher
//! compares modification times in whole seconds).
//!
//! One process may watch many loops (`loopd serve`): every directory is watched by one inotify
//! instance ([`subscribe`]), whose events are handed to the subscribers of the directory they
//! name; each subscriber filters the names it cares about before reading anything.
//!
//! This file arms a loop's watch and reads what its events say; `directory` keeps the process's
//! watchers of directories and hands their events out.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use loopd_core::state::{Control, Status};
use notify::EventKind;
use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
use tokio::sync::watch;

use crate::lock;
use crate::store::Store;
use crate::tasks::TasksStamp;

mod directory;

pub use directory::{Handler, Subscription, subscribe};
use directory::{POLL, RECHECK, polled, subscribe_batches};

/// The least time between two settles of a watch's own (replaced versions past their time).
const SETTLE_GAP: Duration = Duration::from_millis(50);
/// How many renamed temporary names a watch remembers at most.
const MAX_RENAMED: usize = 4096;

/// What a controller can change, as last read.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub control: Control,
    /// The task list files, as last seen.
    pub tasks_file: TasksStamp,
}

impl Snapshot {
    fn read(store: &Store, id: &str) -> Option<Snapshot> {
        let control = store.read_control(id)?;
        let tasks_file = store.tasks_stamp(id);
        Some(Snapshot {
            control,
            tasks_file,
        })
    }

    /// This snapshot after `change`.
    fn after(&self, change: Change, store: &Store, id: &str) -> Option<Snapshot> {
        match change {
            Change::Any => Snapshot::read(store, id),
            Change::Renamed => Some(Snapshot {
                control: store.read_control(id)?,
                tasks_file: self.tasks_file,
            }),
        }
    }
}

/// What an event says of the loop's files.
#[derive(Clone, Copy)]
enum Change {
    /// Anything may have changed.
    Any,
    /// The state file was renamed into place, and nothing was written.
    Renamed,
}

impl Change {
    /// What two events say together.
    fn and(self, other: Change) -> Change {
        match (self, other) {
            (Change::Renamed, Change::Renamed) => Change::Renamed,
            _ => Change::Any,
        }
    }
}

/// A running watch of one loop; dropping it stops watching.
pub struct Watch {
    rx: watch::Receiver<Option<Snapshot>>,
    looks: Arc<Looks>,
    _subscription: Subscription,
    _nested: Arc<Nested>,
    recheck: tokio::task::JoinHandle<()>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.recheck.abort();
    }
}

/// The looks at one loop's files, from whichever thread makes them (the watcher's, a re-check,
/// the daemon's when it arms an attempt), and what they publish and end.
struct Looks {
    store: Store,
    id: String,
    tx: watch::Sender<Option<Snapshot>>,
    /// The attempt in flight, ended by the watcher itself when the status leaves `running`.
    armed: Armed,
    /// Held from a look's read of the file to its publication and the end of the attempt it
    /// calls for: looks are published in the order they read, so an older version is never
    /// published after a newer one, and an attempt armed after the daemon's own write is never
    /// ended by a look that read the file before that write.
    order: Mutex<()>,
}

impl Looks {
    fn look(&self, change: Change) {
        let _order = lock(&self.order);
        self.look_in_order(change);
    }

    /// [`Looks::look`], with `order` held.
    fn look_in_order(&self, change: Change) {
        let last = self.tx.borrow().clone();
        let snapshot = match &last {
            Some(last) => last.after(change, &self.store, &self.id),
            None => Snapshot::read(&self.store, &self.id),
        };
        let Some(snapshot) = snapshot else { return };
        // A status set back to running since the last look, by a controller after the attempt
        // in flight started: the loop was paused or stopped meanwhile, though no look saw it (a
        // pause and a resume written together, read at once).
        let set_back = || {
            last.as_ref()
                .is_some_and(|l| l.control.status_by != snapshot.control.status_by)
                && self.armed.set_running_since(&snapshot.control)
        };
        let ends = snapshot.control.status != Status::Running || set_back();
        let control = ends.then(|| snapshot.control.clone());
        self.tx.send_if_modified(|old| {
            let changed = old.as_ref() != Some(&snapshot);
            *old = Some(snapshot);
            changed
        });
        // A stop or pause (or one undone already) ends the attempt in flight from here, at
        // once: the daemon's task, which may wait for a worker of a busy runtime, does the rest
        // (grace, SIGKILL, reaping, the record).
        if let Some(control) = control {
            self.armed.fire(control);
        }
    }
}

impl Watch {
    pub fn start(store: &Store, id: &str) -> Watch {
        let (tx, rx) = watch::channel(Snapshot::read(store, id));
        let looks = Arc::new(Looks {
            store: store.clone(),
            id: id.to_owned(),
            tx,
            armed: Armed::default(),
            order: Mutex::new(()),
        });
        let refresh = {
            let looks = looks.clone();
            move |change: Change| looks.look(change)
        };
        let names = Names::of(id);
        let refresh_now = refresh.clone();
        let replaced = Replaced::default();
        let nested = Arc::new(Nested {
            dir: store.dir().join(id),
            subscription: Mutex::new(None),
        });
        // What one event calls for (settles, a hand-over adopted, the nested directory
        // followed), and the look at the loop's files it asks for.
        let calls_for = {
            let refresh = refresh.clone();
            let nested = nested.clone();
            let (store, id) = (store.clone(), id.to_owned());
            move |event: &notify::Result<notify::Event>| -> Option<Change> {
                match event {
                    Ok(event) => {
                        if !is_change(event) {
                            return None;
                        }
                        if event.need_rescan() {
                            store.touch_orphans(&id);
                            let _ = store.settle(&id);
                        }
                        let late = replaced.late_write(event, &names, &store);
                        if late {
                            let _ = store.settle(&id);
                        }
                        // A version another writer replaced and handed over (it exits without
                        // waiting for a late write into it): kept and settled here.
                        if is_created(event) {
                            for name in event.paths.iter().map(|p| Names::name(p)) {
                                if names.is_handover(name) {
                                    store.adopt(name);
                                }
                            }
                        }
                        if event.need_rescan() || event.paths.iter().any(|p| names.is_nested(p)) {
                            nested.follow(&refresh);
                        }
                        if event.need_rescan() {
                            Some(Change::Any)
                        } else if event.paths.iter().any(|p| names.is_watched(p)) {
                            let renamed =
                                matches!(event.kind, EventKind::Modify(ModifyKind::Name(_)))
                                    && event.paths.iter().all(|p| Names::name(p) != names.tasks)
                                    && !event.paths.iter().any(|p| names.is_nested(p));
                            Some(if renamed {
                                Change::Renamed
                            } else {
                                Change::Any
                            })
                        } else {
                            None
                        }
                    }
                    Err(_) => {
                        store.touch_orphans(&id);
                        let _ = store.settle(&id);
                        nested.follow(&refresh);
                        Some(Change::Any)
                    }
                }
            }
        };
        // The events read together are taken in one by one, and the loop's files looked at once
        // after them: a look reads the files as they are then, which is what a look after each
        // event would have read or newer, and a change after it comes with an event of its own.
        // (The daemon's own write, an exchange of two names, is told as four events naming the
        // state file: one read of it, not four.)
        let on_events = {
            let refresh = refresh.clone();
            move |events: &[&notify::Result<notify::Event>]| {
                let mut look = None;
                for event in events {
                    if let Some(change) = calls_for(event) {
                        look = Some(look.map_or(change, |l: Change| l.and(change)));
                    }
                }
                if let Some(change) = look {
                    refresh(change);
                }
            }
        };
        let orphans = store.watch_orphans(id);
        let subscription = subscribe_batches(store.dir(), Arc::new(on_events));
        nested.follow(&refresh_now);
        // A change made before the subscription is seen now rather than at the re-check.
        refresh_now(Change::Any);
        // Replaced versions are settled when their time is up; the state is looked at again
        // now and then, in case an event was lost.
        let recheck = {
            let (store, id) = (store.clone(), id.to_owned());
            let kept = store.orphan_kept();
            tokio::spawn(async move {
                let _orphans = orphans;
                // Where the directory is polled, the loop's state is read each poll: a
                // polling watcher compares times in whole seconds, and misses a change made in
                // the same second as the one before.
                let every = if polled(store.dir()) { POLL } else { RECHECK };
                let mut next_look = Instant::now() + every;
                let mut settled = Instant::now();
                loop {
                    let added = kept.notified();
                    tokio::pin!(added);
                    added.as_mut().enable();
                    // Not more often than SETTLE_GAP, should a settle fail (a lock held long).
                    let due = store
                        .next_settle(Some(&id))
                        .map_or(next_look, |d| d.min(next_look))
                        .max(settled + SETTLE_GAP);
                    tokio::select! {
                        () = tokio::time::sleep_until(due.into()) => {}
                        () = added => continue,
                    }
                    settled = Instant::now();
                    let look = settled >= next_look;
                    if look {
                        next_look = Instant::now() + every;
                    }
                    let (refresh, store, id) = (refresh.clone(), store.clone(), id.clone());
                    let _ = tokio::task::spawn_blocking(move || {
                        let _ = store.settle(&id);
                        if look {
                            refresh(Change::Any);
                        }
                    })
                    .await;
                }
            })
        };
        Watch {
            rx,
            looks,
            _subscription: subscription,
            _nested: nested,
            recheck,
        }
    }

    /// A receiver of snapshots; `changed()` fires when a controller changed something.
    pub fn subscribe(&self) -> watch::Receiver<Option<Snapshot>> {
        self.rx.clone()
    }

    /// Arms the watch with the attempt just spawned: until the returned guard is dropped, a
    /// status that leaves `running` calls `end` from the watcher's thread, at once (the driver
    /// passes what ends its attempt, e.g. a SIGTERM to its process group, and whether it did).
    /// The guard tells whether that happened, and for which control fields.
    ///
    /// A stop the watch published before is confirmed by a look at the file first: what was
    /// published may be older than the daemon's own last write (its start of a new loop, which
    /// the watcher's thread may not have heard of yet under load).
    pub fn arm(&self, end: impl FnOnce() -> bool + Send + 'static) -> ArmedAttempt {
        let looks = &self.looks;
        let _order = lock(&looks.order);
        *lock(&looks.armed.fired) = None;
        *lock(&looks.armed.attempt) = Some(Flight {
            end: Box::new(end),
            since: chrono::Utc::now(),
        });
        let stopped = looks
            .tx
            .borrow()
            .as_ref()
            .is_some_and(|s| s.control.status != Status::Running);
        if stopped {
            looks.look_in_order(Change::Any);
        }
        ArmedAttempt {
            looks: looks.clone(),
        }
    }
}

/// Ends an attempt in flight; true when it did.
type EndAttempt = Box<dyn FnOnce() -> bool + Send>;

/// An attempt in flight: what ends it, and when it was armed.
struct Flight {
    end: EndAttempt,
    since: chrono::DateTime<chrono::Utc>,
}

/// The attempt in flight of a watched loop, as the watcher may end it.
#[derive(Default)]
struct Armed {
    attempt: Mutex<Option<Flight>>,
    /// The control fields read when the watcher ended it.
    fired: Mutex<Option<Control>>,
}

impl Armed {
    fn fire(&self, control: Control) {
        let attempt = lock(&self.attempt).take();
        if attempt.is_some_and(|flight| (flight.end)()) {
            *lock(&self.fired) = Some(control);
        }
    }

    /// Whether a controller set the status `running` after the attempt in flight was armed
    /// (its stamp says when): only a loop that was not running can be resumed, retried or
    /// started, so the loop left `running` meanwhile. A stamp of the same millisecond as the
    /// arming, or of another program that stamps nothing, is not taken for one.
    fn set_running_since(&self, control: &Control) -> bool {
        let Some(at) = control
            .status_by
            .as_ref()
            .filter(|by| by.status == Status::Running)
            .and_then(|by| loopd_core::state::parse_ts(by.at.as_deref()?))
        else {
            return false;
        };
        lock(&self.attempt)
            .as_ref()
            .is_some_and(|flight| at > flight.since)
    }
}

/// An attempt the watch may end (see [`Watch::arm`]); disarmed when dropped.
pub struct ArmedAttempt {
    looks: Arc<Looks>,
}

impl ArmedAttempt {
    /// Whether the watcher ended the attempt (a controller paused or stopped the loop): the
    /// control fields it read then.
    pub fn fired(&self) -> Option<Control> {
        lock(&self.looks.armed.fired).clone()
    }
}

impl Drop for ArmedAttempt {
    fn drop(&mut self) {
        *lock(&self.looks.armed.attempt) = None;
    }
}

/// The watch of a loop's own subdirectory (`{id}/`, where the CCW dashboard keeps its task list),
/// made while the directory exists: inotify watches one directory, not its subdirectories.
struct Nested {
    dir: PathBuf,
    subscription: Mutex<Option<Subscription>>,
}

impl Nested {
    /// Starts watching the directory if it exists now, stops if it is gone (an event of the
    /// state directory named it, or events were lost). A change of its task list refreshes.
    fn follow(&self, refresh: &(impl Fn(Change) + Clone + Send + Sync + 'static)) {
        let mut subscription = lock(&self.subscription);
        let exists = std::fs::symlink_metadata(&self.dir).is_ok_and(|m| m.is_dir());
        if !exists {
            *subscription = None;
            return;
        }
        if subscription.is_some() {
            return;
        }
        let on_change = refresh.clone();
        let handler = move |events: &[&notify::Result<notify::Event>]| {
            let tasks = |e: &notify::Event| {
                e.need_rescan()
                    || e.paths
                        .iter()
                        .any(|p| Names::name(p) == crate::tasks::SHARED)
            };
            let changed = events.iter().any(|event| match event {
                Ok(e) => is_change(e) && tasks(e),
                Err(_) => true,
            });
            if changed {
                on_change(Change::Any);
            }
        };
        *subscription = Some(subscribe_batches(&self.dir, Arc::new(handler)));
        drop(subscription);
        // A change made before the subscription is seen now.
        refresh(Change::Any);
    }
}

/// The temporary names of a loop's state file that the state file was renamed to: each holds a
/// replaced version (the exchange that put a new version in place moved the old one there), and a
/// write into it is a late write. The writes before, which made the new version, those into a
/// version renamed to a new name, and those into a spare the store says it is writing
/// ([`Store::reusing`]) are the writer's own.
#[derive(Default)]
struct Replaced(Mutex<HashSet<String>>);

impl Replaced {
    /// Follows the names through `event`; whether it is a late write into a replaced version
    /// `store` keeps (then marked to be merged at the next settle).
    fn late_write(&self, event: &notify::Event, names: &Names, store: &Store) -> bool {
        let mut replaced = lock(&self.0);
        match event.kind {
            EventKind::Modify(ModifyKind::Name(mode)) => {
                if let (RenameMode::Both, [from, to]) = (mode, event.paths.as_slice()) {
                    replaced.remove(Names::name(from));
                    // A spare's writes were the writer's own up to this rename into place.
                    if Names::name(to) == names.state {
                        store.reusing(Names::name(from), true);
                    }
                    if Names::name(from) == names.state && names.is_orphan(to) {
                        // Names go when their versions are removed or reused; a bound in case
                        // those events are lost (the versions are then read when their time is
                        // up).
                        if replaced.len() >= MAX_RENAMED {
                            replaced.clear();
                        }
                        replaced.insert(Names::name(to).to_owned());
                    }
                }
                false
            }
            EventKind::Remove(_) => {
                for p in &event.paths {
                    replaced.remove(Names::name(p));
                }
                false
            }
            EventKind::Create(_) | EventKind::Modify(ModifyKind::Metadata(_)) => false,
            _ => event
                .paths
                .iter()
                .map(|p| Names::name(p))
                .filter(|name| replaced.contains(*name) && !store.reusing(name, false))
                .fold(false, |late, name| store.written_into(name) | late),
        }
    }
}

/// The file names in the state directory that concern one loop.
#[derive(Clone)]
struct Names {
    state: String,
    tasks: String,
    /// The loop's own subdirectory.
    nested: String,
    /// Temporary names of the state file: `.{id}.json.PID-XXXXXX.tmp`, replaced versions among
    /// them.
    temp_prefix: String,
}

impl Names {
    fn of(id: &str) -> Names {
        Names {
            state: format!("{id}.json"),
            tasks: format!("{id}.tasks.jsonl"),
            nested: id.to_owned(),
            temp_prefix: format!(".{id}.json."),
        }
    }

    fn name(p: &Path) -> &str {
        p.file_name().and_then(|n| n.to_str()).unwrap_or("")
    }

    fn is_watched(&self, p: &Path) -> bool {
        let name = Self::name(p);
        name == self.state || name == self.tasks
    }

    /// A hand-over note of this loop's (see [`Store::adopt`]).
    fn is_handover(&self, name: &str) -> bool {
        name.starts_with(&self.temp_prefix) && name.ends_with(crate::store::HANDOVER_SUFFIX)
    }

    fn is_nested(&self, p: &Path) -> bool {
        Self::name(p) == self.nested
    }

    fn is_orphan(&self, p: &Path) -> bool {
        let name = Self::name(p);
        name.starts_with(&self.temp_prefix) && name.ends_with(loopd_fs::TEMP_SUFFIX)
    }
}

/// Whether an event says a file appeared under its name: created there, or renamed to it.
pub fn is_created(event: &notify::Event) -> bool {
    matches!(
        event.kind,
        EventKind::Create(_)
            | EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both))
    )
}

/// Settles the replaced versions `store` keeps (of every loop of its directory) when they are
/// due, until the returned task is aborted: for a process that watches a state directory
/// without a [`Watch`] of each loop (the service, for the loops it does not drive).
pub fn settle_in_background(store: &Store) -> tokio::task::JoinHandle<()> {
    let store = store.clone();
    let kept = store.orphan_kept();
    tokio::spawn(async move {
        let mut settled = Instant::now();
        loop {
            let added = kept.notified();
            tokio::pin!(added);
            added.as_mut().enable();
            match store.next_settle(None) {
                Some(due) => {
                    let due = due.max(settled + SETTLE_GAP);
                    tokio::select! {
                        () = tokio::time::sleep_until(due.into()) => {}
                        () = added => continue,
                    }
                }
                None => {
                    added.await;
                    continue;
                }
            }
            settled = Instant::now();
            let store = store.clone();
            let _ = tokio::task::spawn_blocking(move || store.settle_every_loop()).await;
        }
    })
}

/// Whether an event may mean a changed file: opening or reading one is no change; closing it
/// after writing is.
pub fn is_change(event: &notify::Event) -> bool {
    !matches!(event.kind, EventKind::Access(kind) if kind != AccessKind::Close(AccessMode::Write))
}

#[cfg(test)]
mod tests {
    use super::directory::{BatchHandler, HANDLERS, dispatch};
    use super::*;
    use notify::event::{CreateKind, DataChange, RemoveKind};
    use std::sync::atomic::{AtomicBool, Ordering};

    fn event(kind: EventKind, dir: &Path, names: &[&str]) -> notify::Event {
        let mut event = notify::Event::new(kind);
        for name in names {
            event = event.add_path(dir.join(name));
        }
        event
    }

    /// The writes into a temporary name count as late only after the state file was renamed to
    /// it; the writer's own writes before, and those into a spare it renamed first, do not.
    #[test]
    fn a_late_write_is_told_apart_by_the_order_of_events() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path(), ".");
        let state = loopd_core::state::LoopState {
            loop_id: "l1".into(),
            ..Default::default()
        };
        store.create(&state).unwrap();
        let _watch = store.watch_orphans("l1");
        // A write keeps the version it replaced under a temporary name.
        store.update("l1", false, |_, _| {}).unwrap();
        let kept = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .find(|n| n.ends_with(loopd_fs::TEMP_SUFFIX))
            .expect("a replaced version");
        let names = Names::of("l1");
        let replaced = Replaced::default();
        let d = dir.path();
        let (state, tmp, spare) = ("l1.json", kept.as_str(), ".l1.json.bbbbbb.tmp");
        let write = EventKind::Modify(ModifyKind::Data(DataChange::Any));
        let both = EventKind::Modify(ModifyKind::Name(RenameMode::Both));
        let late =
            |kind, paths: &[&str]| replaced.late_write(&event(kind, d, paths), &names, &store);

        // The writer made its new version under the temporary name: its own writes.
        assert!(!late(EventKind::Create(CreateKind::File), &[tmp]));
        assert!(!late(write, &[tmp]));
        // The exchange: the new version went in place, the old one to the temporary name.
        assert!(!late(both, &[tmp, state]));
        assert!(!late(both, &[state, tmp]));
        // A write into it now is late, and the store keeps it: to be merged.
        assert!(late(write, &[tmp]));
        // Reused as a spare under a new name (a writer renames it first; the store's own writes
        // are told apart by `Store::reusing`): its writes are the writer's again.
        assert!(!late(both, &[tmp, spare]));
        assert!(!late(write, &[spare]));
        assert!(!late(write, &[tmp]), "the old name is no longer followed");
        // Renamed to again, then removed: forgotten.
        assert!(!late(both, &[state, spare]));
        assert!(!late(EventKind::Remove(RemoveKind::File), &[spare]));
        assert!(lock(&replaced.0).is_empty());
    }

    /// The daemon's start of a loop (`created` → `running`, its own write) not yet told by the
    /// watcher's thread when its first attempt is armed: the attempt goes on. (Under load, the
    /// watcher's snapshot still said `created` at the arming, and the attempt was ended 3 ms in,
    /// "the loop's status left running", though nobody had paused or stopped the loop.)
    #[tokio::test]
    async fn an_attempt_armed_before_the_watcher_heard_of_the_daemons_own_write_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path(), ".");
        let state = loopd_core::state::LoopState {
            loop_id: "l1".into(),
            status: Status::Created,
            ..Default::default()
        };
        store.create(&state).unwrap();
        let watch = Watch::start(&store, "l1");
        let ended = Arc::new(AtomicBool::new(false));
        let armed = {
            // The watcher's thread hears of nothing until the attempt is armed.
            let _held = lock(&HANDLERS);
            store
                .update("l1", true, |raw, _| {
                    raw.insert("status".into(), "running".into());
                })
                .unwrap();
            let ended = ended.clone();
            watch.arm(move || {
                ended.store(true, Ordering::SeqCst);
                true
            })
        };
        // Now it hears of the write, and of a pause written after it.
        let mut rx = watch.subscribe();
        let deadline = Instant::now() + Duration::from_secs(10);
        while rx.borrow_and_update().as_ref().map(|s| &s.control.status) != Some(&Status::Running) {
            assert!(
                Instant::now() < deadline,
                "the watcher never saw the loop running"
            );
            let _ = tokio::time::timeout(Duration::from_millis(50), rx.changed()).await;
        }
        assert_eq!(
            armed.fired(),
            None,
            "the daemon's own start ended its attempt"
        );
        assert!(!ended.load(Ordering::SeqCst));
        store
            .update("l1", true, |raw, _| {
                raw.insert("status".into(), "paused".into());
            })
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while armed.fired().is_none() {
            assert!(Instant::now() < deadline, "a pause did not end the attempt");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(ended.load(Ordering::SeqCst));
    }

    /// The events read at once reach each subscriber of a batch in one call, its own events
    /// only, in the order they were read; a subscriber of single events is told each.
    #[test]
    fn the_events_read_at_once_reach_each_subscriber_together_and_in_order() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, b) = (a.path().to_owned(), b.path().to_owned());
        type Told = Arc<Mutex<Vec<Vec<(EventKind, Vec<String>)>>>>;
        let batches = |told: &Told| -> BatchHandler {
            let told = told.clone();
            Arc::new(move |events: &[&notify::Result<notify::Event>]| {
                let events = events
                    .iter()
                    .filter_map(|e| e.as_ref().ok())
                    .map(|e| {
                        (
                            e.kind,
                            e.paths.iter().map(|p| Names::name(p).to_owned()).collect(),
                        )
                    })
                    .collect();
                lock(&told).push(events);
            })
        };
        let (told_a, told_b, told_each): (Told, Told, Told) = Default::default();
        let _a = subscribe_batches(&a, batches(&told_a));
        let _b = subscribe_batches(&b, batches(&told_b));
        let _each = subscribe(&a, {
            let told = told_each.clone();
            Arc::new(move |e: &notify::Result<notify::Event>| {
                let e = e.as_ref().unwrap();
                let names = e.paths.iter().map(|p| Names::name(p).to_owned()).collect();
                lock(&told).push(vec![(e.kind, names)]);
            })
        });
        let write = EventKind::Modify(ModifyKind::Data(DataChange::Any));
        let both = EventKind::Modify(ModifyKind::Name(RenameMode::Both));
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        dispatch(&[
            Ok(event(write, &a, &["x"])),
            Ok(event(write, &b, &["y"])),
            Ok(event(both, &a, &["x", "z"])),
        ]);
        assert_eq!(
            *lock(&told_a),
            vec![vec![(write, names(&["x"])), (both, names(&["x", "z"]))]]
        );
        assert_eq!(*lock(&told_b), vec![vec![(write, names(&["y"]))]]);
        assert_eq!(
            *lock(&told_each),
            vec![
                vec![(write, names(&["x"]))],
                vec![(both, names(&["x", "z"]))]
            ]
        );
    }

    /// loopd's own inotify reader tells what notify would of a write and of a rename (both
    /// halves, then the whole), and nothing of a file being opened and read.
    #[test]
    fn inotify_tells_writes_and_renames_and_not_reads() {
        if std::env::var("LOOPD_WATCH").is_ok_and(|w| w == "poll") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().canonicalize().unwrap();
        std::fs::write(d.join("a"), "1").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = Mutex::new(tx);
        let _sub = subscribe(
            &d,
            Arc::new(move |e: &notify::Result<notify::Event>| {
                if let Ok(e) = e {
                    let names: Vec<String> =
                        e.paths.iter().map(|p| Names::name(p).to_owned()).collect();
                    let _ = lock(&tx).send((e.kind, names));
                }
            }),
        );
        // Read, then renamed: the reading is not told, so the rename is the first event.
        assert_eq!(std::fs::read(d.join("a")).unwrap(), b"1");
        std::fs::rename(d.join("a"), d.join("b")).unwrap();
        std::fs::write(d.join("b"), "2").unwrap();
        let mut told = Vec::new();
        while told.len() < 4 {
            told.push(rx.recv_timeout(Duration::from_secs(10)).expect("an event"));
        }
        let name = |mode| EventKind::Modify(ModifyKind::Name(mode));
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(told[0], (name(RenameMode::From), names(&["a"])));
        assert_eq!(told[1], (name(RenameMode::To), names(&["b"])));
        assert_eq!(told[2], (name(RenameMode::Both), names(&["a", "b"])));
        assert!(is_change(&notify::Event::new(told[3].0)), "{told:?}");
        assert_eq!(told[3].1, names(&["b"]));
    }
}
