//! Watching a loop's state file for control changes written by anyone.
//!
//! Theory of operation: notify watches the state *directory* (an atomic write replaces the file's
//! inode, which would end a watch on the file itself). Any event naming the loop's state or task
//! file means "maybe changed": the file is re-read on notify's thread and reduced to a
//! [`Snapshot`] of what a controller can change. The snapshot is published on a
//! `tokio::sync::watch` channel only when it differs, so the daemon's own writes, which never
//! change those fields, wake nobody. A slow periodic re-check covers missed or overflowed events,
//! and when inotify cannot be used (its limits reached, or `LOOPD_WATCH=poll`) a polling watcher
//! takes over.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use notify::event::{AccessKind, AccessMode};
use notify::{EventKind, RecursiveMode, Watcher as _};
use tokio::sync::watch;

use crate::state::model::Control;
use crate::state::store::Store;

/// How often the state is re-read even without a file event.
const RECHECK: Duration = Duration::from_secs(1);
/// The polling interval when inotify is not available.
const POLL: Duration = Duration::from_millis(100);

/// What a controller can change, as last read.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub control: Control,
    /// Length and modification time of the task list file.
    pub tasks_file: Option<(u64, SystemTime)>,
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
}

/// A running watch of one loop; dropping it stops watching.
pub struct Watch {
    rx: watch::Receiver<Option<Snapshot>>,
    _watcher: Box<dyn notify::Watcher + Send>,
    recheck: tokio::task::JoinHandle<()>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.recheck.abort();
    }
}

impl Watch {
    pub fn start(store: &Store, id: &str) -> Watch {
        let (tx, rx) = watch::channel(Snapshot::read(store, id));
        let tx = Arc::new(tx);
        let refresh = {
            let (store, id, tx) = (store.clone(), id.to_owned(), tx.clone());
            move || {
                if let Some(snapshot) = Snapshot::read(&store, &id) {
                    tx.send_if_modified(|old| {
                        let changed = old.as_ref() != Some(&snapshot);
                        *old = Some(snapshot);
                        changed
                    });
                }
            }
        };
        let names = Names::of(id);
        let on_event = {
            let refresh = refresh.clone();
            let (store, id) = (store.clone(), id.to_owned());
            move |event: notify::Result<notify::Event>| match event {
                Ok(event) => {
                    // Opening or reading the file is no change; closing it after writing is.
                    let no_change = matches!(event.kind, EventKind::Access(kind)
                        if kind != AccessKind::Close(AccessMode::Write));
                    if no_change {
                        return;
                    }
                    // A late write into a version the daemon replaced: merge it.
                    if event.paths.iter().any(|p| names.is_orphan(p)) {
                        let _ = store.settle(&id);
                    }
                    if event.need_rescan() || event.paths.iter().any(|p| names.is_watched(p)) {
                        refresh();
                    }
                }
                Err(_) => refresh(),
            }
        };
        let watcher = watch_dir(store.dir(), on_event);
        let recheck = {
            let (store, id) = (store.clone(), id.to_owned());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(RECHECK);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let (refresh, store, id) = (refresh.clone(), store.clone(), id.clone());
                    let _ = tokio::task::spawn_blocking(move || {
                        // Replaced versions past their time go.
                        let _ = store.settle(&id);
                        refresh();
                    })
                    .await;
                }
            })
        };
        Watch {
            rx,
            _watcher: watcher,
            recheck,
        }
    }

    /// A receiver of snapshots; `changed()` fires when a controller changed something.
    pub fn subscribe(&self) -> watch::Receiver<Option<Snapshot>> {
        self.rx.clone()
    }
}

/// The file names in the state directory that concern one loop.
#[derive(Clone)]
struct Names {
    state: String,
    tasks: String,
    /// Temporary names of the state file: `.{id}.json.XXXXXX.tmp`, replaced versions among them.
    temp_prefix: String,
}

impl Names {
    fn of(id: &str) -> Names {
        Names {
            state: format!("{id}.json"),
            tasks: format!("{id}.tasks.jsonl"),
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

    fn is_orphan(&self, p: &Path) -> bool {
        let name = Self::name(p);
        name.starts_with(&self.temp_prefix) && name.ends_with(crate::safe_fs::TEMP_SUFFIX)
    }
}

/// Watches `dir` with inotify, or by polling when inotify is unavailable.
fn watch_dir<F>(dir: &Path, on_event: F) -> Box<dyn notify::Watcher + Send>
where
    F: notify::EventHandler + Clone,
{
    // LOOPD_WATCH=poll: no inotify (filesystems that do not report changes, such as NFS).
    let forced = std::env::var("LOOPD_WATCH").is_ok_and(|w| w == "poll");
    let inotify = if forced {
        Err(notify::Error::generic("LOOPD_WATCH=poll"))
    } else {
        notify::recommended_watcher(on_event.clone()).and_then(|mut w| {
            w.watch(dir, RecursiveMode::NonRecursive)?;
            Ok(w)
        })
    };
    match inotify {
        Ok(w) => Box::new(w),
        Err(e) => {
            tracing::warn!(
                "cannot watch {} with inotify ({e}); polling every {}ms instead",
                dir.display(),
                POLL.as_millis()
            );
            let config = notify::Config::default().with_poll_interval(POLL);
            match notify::PollWatcher::new(on_event, config).and_then(|mut w| {
                w.watch(dir, RecursiveMode::NonRecursive)?;
                Ok(w)
            }) {
                Ok(w) => Box::new(w),
                Err(e) => {
                    tracing::warn!(
                        "cannot poll {} either ({e}); relying on the {}s re-check",
                        dir.display(),
                        RECHECK.as_secs()
                    );
                    Box::new(NoWatcher)
                }
            }
        }
    }
}

/// The watcher of last resort: nothing but the periodic re-check.
struct NoWatcher;

impl notify::Watcher for NoWatcher {
    fn new<F: notify::EventHandler>(_: F, _: notify::Config) -> notify::Result<Self> {
        Ok(NoWatcher)
    }
    fn watch(&mut self, _: &Path, _: RecursiveMode) -> notify::Result<()> {
        Ok(())
    }
    fn unwatch(&mut self, _: &Path) -> notify::Result<()> {
        Ok(())
    }
    fn kind() -> notify::WatcherKind {
        notify::WatcherKind::NullWatcher
    }
}
