//! The process's watchers of directories: one inotify instance for all of them, read on a thread
//! of its own (`Inotify`, which asks for no event when a file is only opened), or a polling
//! watcher for a directory inotify cannot watch; and the subscriptions that hand each directory's
//! events to its subscribers ([`subscribe`]), the events read at once together.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
use notify::{EventKind, RecursiveMode, Watcher as _};

use crate::helper::Helper;
use crate::lock;

/// How often the state is re-read even without a file event, in case one was lost.
pub(super) const RECHECK: Duration = Duration::from_secs(30);
/// The polling interval when inotify is not available.
pub(super) const POLL: Duration = Duration::from_millis(100);

/// What a subscriber of a directory is told: an event of notify, or its error (events may have
/// been lost: look again).
pub type Handler = Arc<dyn Fn(&notify::Result<notify::Event>) + Send + Sync>;

/// What a subscriber of a directory that takes its events together is told: the events of its
/// directory read at once, in order.
pub(super) type BatchHandler = Arc<dyn Fn(&[&notify::Result<notify::Event>]) + Send + Sync>;

/// The handlers of each watched directory. Kept apart from [`WATCHERS`]: notify's thread takes
/// this lock to deliver an event while a subscriber, holding [`WATCHERS`], waits for notify's
/// thread to add a watch.
pub(super) static HANDLERS: LazyLock<Mutex<Handlers>> = LazyLock::new(Default::default);

/// Each watched directory's handlers, by subscription key.
type Handlers = HashMap<PathBuf, Vec<(u64, BatchHandler)>>;

/// The process's watchers: one inotify instance for every directory, and a polling watcher for
/// each directory inotify cannot watch (its limits reached, or `LOOPD_WATCH=poll`).
static WATCHERS: LazyLock<Mutex<Watchers>> = LazyLock::new(|| Mutex::new(Watchers::new()));

struct Watchers {
    inotify: Option<Inotify>,
    polls: HashMap<PathBuf, Box<dyn notify::Watcher + Send>>,
    next_key: u64,
}

/// Hands the events read at once to the handlers of the directories they name (an error or a
/// rescan to all), each handler its own events in one call.
pub(super) fn dispatch(events: &[notify::Result<notify::Event>]) {
    let mut told: Vec<(BatchHandler, Vec<&notify::Result<notify::Event>>)> = Vec::new();
    {
        let all = lock(&HANDLERS);
        // Each handler's place in `told`, by subscription key.
        let mut place: HashMap<u64, usize> = HashMap::new();
        let mut tell = |key: u64, handler: &BatchHandler, event| {
            let at = *place.entry(key).or_insert_with(|| {
                told.push((handler.clone(), Vec::new()));
                told.len() - 1
            });
            told[at].1.push(event);
        };
        for event in events {
            let everyone = match event {
                Ok(e) => e.need_rescan() || e.paths.is_empty(),
                Err(_) => true,
            };
            if everyone {
                for (key, handler) in all.values().flatten() {
                    tell(*key, handler, event);
                }
                continue;
            }
            let paths = event
                .as_ref()
                .map(|e| e.paths.as_slice())
                .unwrap_or_default();
            let mut dirs: Vec<&Path> = paths.iter().filter_map(|p| p.parent()).collect();
            dirs.dedup();
            for (key, handler) in dirs.iter().filter_map(|d| all.get(*d)).flatten() {
                tell(*key, handler, event);
            }
        }
    }
    for (handler, events) in told {
        handler(&events);
    }
}

impl Watchers {
    fn new() -> Watchers {
        // LOOPD_WATCH=poll: no inotify (filesystems that do not report changes, such as NFS).
        let forced = std::env::var("LOOPD_WATCH").is_ok_and(|w| w == "poll");
        let inotify = if forced {
            None
        } else {
            Inotify::start()
                .inspect_err(|e| tracing::warn!("cannot use inotify ({e}); polling instead"))
                .ok()
        };
        Watchers {
            inotify,
            polls: HashMap::new(),
            next_key: 0,
        }
    }

    /// Starts watching `dir`: with inotify, else by polling, else only the periodic re-checks.
    fn watch(&mut self, dir: &Path) {
        let inotify = match &mut self.inotify {
            Some(w) => w.watch(dir),
            None => Err(std::io::Error::other("LOOPD_WATCH=poll")),
        };
        let Err(e) = inotify else { return };
        tracing::warn!(
            "cannot watch {} with inotify ({e}); polling every {}ms instead",
            dir.display(),
            POLL.as_millis()
        );
        let config = notify::Config::default().with_poll_interval(POLL);
        let each = |event| dispatch(std::slice::from_ref(&event));
        match notify::PollWatcher::new(each, config).and_then(|mut w| {
            w.watch(dir, RecursiveMode::NonRecursive)?;
            Ok(w)
        }) {
            Ok(w) => {
                self.polls.insert(dir.to_owned(), Box::new(w));
            }
            Err(e) => tracing::warn!(
                "cannot poll {} either ({e}); relying on the {}s re-check",
                dir.display(),
                RECHECK.as_secs()
            ),
        }
    }

    fn unwatch(&mut self, dir: &Path) {
        if self.polls.remove(dir).is_none()
            && let Some(w) = &mut self.inotify
        {
            w.unwatch(dir);
        }
    }
}

/// The process's inotify instance, read on a thread of its own, its events told to [`dispatch`]
/// as notify would tell them. Not notify's own inotify watcher: that one also asks for an event
/// at every opening of every file in the directory, which wakes the watcher at each of the
/// daemon's own reads, for nothing (an opening changes nothing).
struct Inotify {
    watches: inotify::Watches,
    /// The directory of each watch; its lock is held from adding a watch to knowing its directory.
    dirs: Arc<Mutex<HashMap<inotify::WatchDescriptor, PathBuf>>>,
}

impl Inotify {
    fn start() -> std::io::Result<Inotify> {
        let mut inotify = inotify::Inotify::init()?;
        let watches = inotify.watches();
        let dirs: Arc<Mutex<HashMap<_, PathBuf>>> = Arc::default();
        let known = dirs.clone();
        Helper::spawn("loopd-inotify", &crate::helper::INOTIFY_READER, move || {
            let mut buffer = vec![0u8; 16 << 10];
            // A rename is told as its two halves, then as a whole once both are seen.
            let mut moved_from: Option<(u32, PathBuf)> = None;
            loop {
                let events = match inotify.read_events_blocking(&mut buffer) {
                    Ok(events) => events,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::warn!("inotify stopped ({e}); relying on the re-checks");
                        dispatch(&[Err(notify::Error::io(e))]);
                        return;
                    }
                };
                let told: Vec<_> = events
                    .flat_map(|event| translate(&event, &known, &mut moved_from))
                    .map(Ok)
                    .collect();
                dispatch(&told);
            }
        })?;
        Ok(Inotify { watches, dirs })
    }

    fn watch(&mut self, dir: &Path) -> std::io::Result<()> {
        use inotify::WatchMask as M;
        let mask = M::CREATE
            | M::DELETE
            | M::MODIFY
            | M::CLOSE_WRITE
            | M::ATTRIB
            | M::MOVED_FROM
            | M::MOVED_TO
            | M::DELETE_SELF
            | M::MOVE_SELF;
        let mut dirs = lock(&self.dirs);
        let wd = self.watches.add(dir, mask)?;
        dirs.insert(wd, dir.to_owned());
        Ok(())
    }

    fn unwatch(&mut self, dir: &Path) {
        let mut dirs = lock(&self.dirs);
        let wds: Vec<_> = dirs
            .iter()
            .filter(|(_, d)| d.as_path() == dir)
            .map(|(wd, _)| wd.clone())
            .collect();
        for wd in wds {
            dirs.remove(&wd);
            let _ = self.watches.remove(wd);
        }
    }
}

/// What notify would tell of inotify's `event` (see [`Inotify`]).
fn translate(
    event: &inotify::Event<&std::ffi::OsStr>,
    dirs: &Mutex<HashMap<inotify::WatchDescriptor, PathBuf>>,
    moved_from: &mut Option<(u32, PathBuf)>,
) -> Vec<notify::Event> {
    use inotify::EventMask as E;
    use notify::event::{CreateKind, DataChange, Flag, MetadataKind, RemoveKind};
    if event.mask.contains(E::Q_OVERFLOW) {
        return vec![notify::Event::new(EventKind::Other).set_flag(Flag::Rescan)];
    }
    if event.mask.contains(E::IGNORED) {
        // The watch ended (its directory removed, or unwatched): forget it.
        lock(dirs).remove(&event.wd);
        return Vec::new();
    }
    let Some(dir) = lock(dirs).get(&event.wd).cloned() else {
        return Vec::new();
    };
    let path = match event.name {
        Some(name) => dir.join(name),
        None => dir,
    };
    let one = |kind| vec![notify::Event::new(kind).add_path(path.clone())];
    if event.mask.contains(E::MOVED_FROM) {
        *moved_from = Some((event.cookie, path.clone()));
        one(EventKind::Modify(ModifyKind::Name(RenameMode::From)))
    } else if event.mask.contains(E::MOVED_TO) {
        let mut told = one(EventKind::Modify(ModifyKind::Name(RenameMode::To)));
        if let Some((_, from)) = moved_from.take_if(|(cookie, _)| *cookie == event.cookie) {
            told.push(
                notify::Event::new(EventKind::Modify(ModifyKind::Name(RenameMode::Both)))
                    .add_path(from)
                    .add_path(path),
            );
        }
        told
    } else if event.mask.contains(E::MOVE_SELF) {
        one(EventKind::Modify(ModifyKind::Name(RenameMode::From)))
    } else if event.mask.contains(E::CREATE) {
        one(EventKind::Create(CreateKind::Any))
    } else if event.mask.intersects(E::DELETE | E::DELETE_SELF) {
        one(EventKind::Remove(RemoveKind::Any))
    } else if event.mask.contains(E::MODIFY) {
        one(EventKind::Modify(ModifyKind::Data(DataChange::Any)))
    } else if event.mask.contains(E::CLOSE_WRITE) {
        one(EventKind::Access(AccessKind::Close(AccessMode::Write)))
    } else if event.mask.contains(E::ATTRIB) {
        one(EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any)))
    } else {
        Vec::new()
    }
}

/// A subscription to the events of one directory; dropping it unsubscribes, and the directory
/// is no longer watched once nobody is subscribed to it.
pub struct Subscription {
    dir: PathBuf,
    key: u64,
}

/// Whether `dir` is watched by polling rather than by inotify.
pub(super) fn polled(dir: &Path) -> bool {
    lock(&WATCHERS).polls.contains_key(dir)
}

/// Calls `handler` for every event in `dir` (not recursive), and for every error of the
/// watcher. Every directory of the process is watched by one inotify instance.
pub fn subscribe(dir: &Path, handler: Handler) -> Subscription {
    subscribe_batches(
        dir,
        Arc::new(move |events: &[&notify::Result<notify::Event>]| {
            for event in events {
                handler(event);
            }
        }),
    )
}

/// [`subscribe`], the events read at once told in one call.
pub(super) fn subscribe_batches(dir: &Path, handler: BatchHandler) -> Subscription {
    let mut watchers = lock(&WATCHERS);
    let key = watchers.next_key;
    watchers.next_key += 1;
    let first = {
        let mut all = lock(&HANDLERS);
        let list = all.entry(dir.to_owned()).or_default();
        list.push((key, handler));
        list.len() == 1
    };
    if first {
        watchers.watch(dir);
    }
    Subscription {
        dir: dir.to_owned(),
        key,
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut watchers = lock(&WATCHERS);
        let last = {
            let mut all = lock(&HANDLERS);
            let list = all.entry(self.dir.clone()).or_default();
            list.retain(|(k, _)| *k != self.key);
            let empty = list.is_empty();
            if empty {
                all.remove(&self.dir);
            }
            empty
        };
        if last {
            watchers.unwatch(&self.dir);
        }
    }
}
