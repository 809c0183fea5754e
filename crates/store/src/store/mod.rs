//! Where loop files live and how they are read and written.
//!
//! Theory of operation: every writer (the daemon, the CLI's control commands) changes a state file
//! by read-modify-write under an exclusive `flock` on the sidecar `{id}.lock`, which is never
//! renamed or deleted, so the lock and the file it guards cannot come apart. The new version is
//! written to a temporary file in the same directory (`.{id}.json.PID-XXXXXX.tmp`, mode 0600)
//! and exchanged with the state file (`renameat2(RENAME_EXCHANGE)`, else a plain rename): a reader
//! sees the old file or the new one, never a mix. A durable write is made durable by its backup
//! `{id}.json.bak` (`backup`): the same bytes, written there with a checksum and
//! fdatasynced; the exchange itself is not fsynced. Every file is opened
//! relative to the checked state directory, never through a symlink ([`loopd_fs`]).
//!
//! The daemon never writes a copy of the whole state: [`Store::commit`] re-reads the file under the
//! lock and replaces only the fields the daemon owns ([`DAEMON_FIELDS`]), plus a status transition
//! the daemon itself makes, and only from the status it expects. A control field written by anyone
//! else in the meantime therefore survives.
//!
//! Writers that take no lock (the CCW dashboard truncates and rewrites the file in place) are
//! caught three ways. A write that lands before the exchange is handed back by it and the change
//! is made again on top. A write into the replaced version — the writer opened the file just before
//! the exchange and writes just after — lands in an inode that is no longer the state file: that
//! version is therefore not unlinked at once but kept, as an *orphan*, until no process has it
//! open and it is `ORPHAN_LIFE_SHORT` old (a write lease tells: [`loopd_fs::open_elsewhere`]);
//! while a writer holds it open (a read lease tells: [`loopd_fs::open_for_writing`]), until that
//! writer closes it, however long it takes ([`WRITER_HOLD_MAX`] aside); while only readers do,
//! [`ORPHAN_LIFE`] at most. A late write into it is merged into the state file
//! ([`Store::settle`]: the keys it changed, against the version it replaced, but for a key
//! changed in the state file since by a newer write; the merge of a late write into a version
//! replaced before is no newer write, whenever it is made). The daemon's watcher
//! marks an orphan written into (by the order of its file events: a write after the exchange
//! renamed it) and settles it; every writer settles the orphans so marked, and those whose time is
//! up, before it writes; a short-lived
//! command settles all of them before it exits ([`Store::close`]), unless a process that watches
//! the directory (the loop's daemon, the service) takes them over: then it leaves a note for each
//! and exits at once ([`Store::close_with`], [`Store::adopt`]). A settled orphan nobody wrote
//! into is kept as a *spare*, the file the next write is written into (no inode allocated or
//! released per write), under its own name: the watcher takes the writes into a spare taken for a
//! write as the writer's own until it sees it renamed into place ([`Store::reusing`]).
//!
//! The parts, a file each: what goes wrong (`error`), what a state file holds, parsed, and a
//! loop's id (`parse`), the loop's lock (`lock`), writing a version (`write`: the
//! read-modify-write, the exchange, the daemon's commit), the orphan merge (`orphans`), and
//! durability (`durable`: the backup thread, restore and rebuild; `backup`: the backup file's
//! format). The store itself, its paths and reading a version are here; its tests in `tests`.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use chrono::DateTime;
use loopd_core::state::{Control, LoopState, Status};
use serde::Deserialize as _;
use serde_json::{Map, Value};

mod backup;
mod durable;
mod error;
mod lock;
mod orphans;
mod parse;
mod write;

use error::LOCK_TIMEOUT;
pub(crate) use error::io_err;
pub use error::{StoreError, is_transient_io};
pub use parse::{Loaded, new_id, validate_id};
use parse::{parse_object, parse_state};
pub use write::Transition;

pub use lock::WriteLock;
pub(crate) use orphans::ORPHAN_LIFE_SHORT;
pub use orphans::{HANDOVER_SUFFIX, ORPHAN_LIFE, OrphanWatch, Settler, WRITER_HOLD_MAX};
use orphans::{Orphans, shared_orphans};
pub use write::keep_unknown;
use write::to_pretty;

use crate::lock;
use crate::now_rfc3339;
use loopd_fs::{Dir, TEMP_SUFFIX};

/// Top-level fields the daemon owns and writes back from its own copy.
pub const DAEMON_FIELDS: &[&str] = &["current_iteration", "skill_state"];

/// How often a read-modify-write starts over when a writer that takes no lock changed the file
/// under it.
const WRITE_RACE_RETRIES: usize = 5;
/// How long a read retries a file that does not parse (another writer may be half-way).
const PARSE_RETRY: Duration = Duration::from_millis(250);
/// A state file larger than this is refused rather than read.
pub const MAX_STATE_SIZE: u64 = 16 << 20;
/// A progress file read back (`changes.log`) larger than this is not read.
const MAX_PROGRESS_READ: u64 = 16 << 20;

/// The state directory of a project.
#[derive(Clone, Debug)]
pub struct Store {
    root: PathBuf,
    /// The state directory relative to the root (config `state_dir`).
    rel: PathBuf,
    path: PathBuf,
    /// The state directory, once opened.
    dir: Arc<Mutex<Option<Dir>>>,
    /// The last version of each state file this process's stores of the directory read or
    /// wrote, bytes and parse: a read that finds the same bytes again skips the parse. One for
    /// them all, as the spares they write into are ([`shared_last`]).
    last: Arc<Mutex<HashMap<String, Arc<Seen>>>>,
    /// Versions this store replaced, kept for a late write into them.
    orphans: Orphans,
    /// Set by [`Store::defer_durability`]: durable writes are made durable on the backup thread;
    /// those not known to be durable yet.
    deferred: Arc<OnceLock<Mutex<Vec<mpsc::Receiver<()>>>>>,
    /// The loops whose backup cannot be written now (a full disk): said once, not at every
    /// write.
    backup_failing: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Whether reads are remembered in `last` (see [`Store::without_memory`]).
    memory: bool,
    /// Whether the versions it writes are remembered with their objects (see
    /// [`Store::without_objects`]).
    objects: bool,
}

/// A version of a state file, and its typed view (shared with the daemon's copy of its fields:
/// a service keeps one per loop, not several).
#[derive(Debug)]
struct Seen {
    /// Shared with the replaced versions kept for late writes ([`orphans`]): a loop that
    /// writes often has a few of them, each the size of its state.
    bytes: Arc<Vec<u8>>,
    state: Arc<LoopState>,
    /// Its control fields, once a watcher asked for them: the typed view's.
    control: std::sync::OnceLock<Option<Control>>,
    /// The object it was written from, when this process wrote it: the next write on it takes
    /// it rather than parse the bytes again (a daemon's every write is made on its last one).
    object: Mutex<Option<Map<String, Value>>>,
}

/// The memory of the last versions ([`Store::last`]) of the state directory `path`, shared by
/// this process's stores of it: a store's memory of a file another store has written since
/// into the same spare inode would be stale (a stop written through the API, unseen by the
/// watcher of the loop's daemon until its re-check).
fn shared_last(path: &Path) -> Arc<Mutex<HashMap<String, Arc<Seen>>>> {
    type Last = Arc<Mutex<HashMap<String, Arc<Seen>>>>;
    static ALL: LazyLock<Mutex<HashMap<PathBuf, Last>>> = LazyLock::new(Default::default);
    lock(&ALL).entry(path.to_owned()).or_default().clone()
}

impl Store {
    /// The store of `<root>/<state_dir>`; nothing is opened until it is used.
    pub fn new(root: &Path, state_dir: &str) -> Store {
        Store {
            root: root.to_owned(),
            rel: PathBuf::from(state_dir),
            path: root.join(state_dir),
            dir: Arc::default(),
            last: shared_last(&root.join(state_dir)),
            orphans: shared_orphans(&root.join(state_dir)),
            deferred: Arc::default(),
            backup_failing: Arc::default(),
            memory: true,
            objects: true,
        }
    }

    /// The state directory, opened from the root one component at a time (none may be a
    /// symlink); created (0700) when `create` is set.
    pub fn state_dir(&self, create: bool) -> Result<Dir, StoreError> {
        let mut cached = lock(&self.dir);
        if let Some(dir) = &*cached {
            return Ok(dir.clone());
        }
        let dir = Dir::open(&self.root)
            .and_then(|root| root.open_nested(&self.rel, create))
            .map_err(io_err(&self.path))?;
        *cached = Some(dir.clone());
        Ok(dir)
    }

    /// The state directory, or `None` if it does not exist yet.
    pub(super) fn existing_dir(&self) -> Result<Option<Dir>, StoreError> {
        match self.state_dir(false) {
            Ok(dir) => Ok(Some(dir)),
            Err(StoreError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn not_found(&self, id: &str) -> StoreError {
        StoreError::NotFound {
            id: id.to_owned(),
            path: self.state_path(id),
        }
    }

    /// A loop's progress directory (`{id}.progress`, 0700), created when missing.
    pub fn progress(&self, id: &str) -> Result<Dir, StoreError> {
        validate_id(id)?;
        let dir = self.state_dir(true)?;
        let progress = dir
            .subdir(&progress_name(id), true)
            .map_err(io_err(&self.progress_dir(id)))?;
        progress.make_private();
        Ok(progress)
    }

    /// This store, remembering nothing it reads: for a reader of every loop of a project (the
    /// service's API), which would otherwise keep a parse of each.
    pub fn without_memory(mut self) -> Store {
        self.memory = false;
        self
    }

    /// This store, remembering the versions it writes without the objects they were written
    /// from: for a process that drives many loops (the service), where an object of tens of KiB
    /// a loop adds up to MiBs for no gain its bench could tell apart.
    pub fn without_objects(mut self) -> Store {
        self.objects = false;
        self
    }

    /// The object the remembered version `bytes` was written from, taken (one write uses it).
    fn take_object(&self, id: &str, bytes: &[u8]) -> Option<Map<String, Value>> {
        let seen = lock(&self.last).get(id)?.clone();
        if seen.bytes.as_slice() != bytes {
            return None;
        }
        lock(&seen.object).take()
    }

    /// The last version seen of `id` and its parse, if `bytes` are that version.
    fn remembered(&self, id: &str, bytes: &[u8]) -> Option<(Arc<Vec<u8>>, Arc<LoopState>)> {
        if !self.memory {
            return None;
        }
        let last = lock(&self.last);
        let seen = last.get(id)?;
        (seen.bytes.as_slice() == bytes).then(|| (seen.bytes.clone(), seen.state.clone()))
    }

    /// Remembers a version this process read or wrote: its bytes, its typed view, and the
    /// object that made them when it wrote them (unless [`Store::without_objects`]).
    fn remember(
        &self,
        id: &str,
        bytes: Arc<Vec<u8>>,
        state: Arc<LoopState>,
        object: Option<Map<String, Value>>,
    ) {
        if !self.memory {
            return;
        }
        let seen = Seen {
            bytes,
            state,
            control: Default::default(),
            object: Mutex::new(object.filter(|_| self.objects)),
        };
        lock(&self.last).insert(id.to_owned(), Arc::new(seen));
    }

    /// The state directory's path, for people and other programs.
    pub fn dir(&self) -> &Path {
        &self.path
    }

    pub fn state_path(&self, id: &str) -> PathBuf {
        self.path.join(state_name(id))
    }

    /// Opens a loop's progress directory if it exists, creating nothing.
    pub fn existing_progress(&self, id: &str) -> Result<Option<Dir>, StoreError> {
        validate_id(id)?;
        let Some(dir) = self.existing_dir()? else {
            return Ok(None);
        };
        match dir.subdir(&progress_name(id), false) {
            Ok(progress) => Ok(Some(progress)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&self.progress_dir(id))(e)),
        }
    }

    pub fn progress_dir(&self, id: &str) -> PathBuf {
        self.path.join(progress_name(id))
    }

    /// Where a loop's own git worktree lives (`loopd create --worktree`): `worktrees/{id}` in the
    /// state directory.
    pub fn worktree_path(&self, id: &str) -> PathBuf {
        self.path.join("worktrees").join(id)
    }

    /// Every loop id in the directory, sorted.
    pub fn list_ids(&self) -> Result<Vec<String>, StoreError> {
        let Some(dir) = self.existing_dir()? else {
            return Ok(Vec::new());
        };
        let mut ids: Vec<String> = dir
            .entries()
            .map_err(io_err(&self.path))?
            .into_iter()
            .filter_map(|name| {
                let id = name.strip_suffix(".json")?;
                validate_id(id).ok()?;
                Some(id.to_owned())
            })
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Reads and parses a loop's state file.
    pub fn load(&self, id: &str) -> Result<Loaded, StoreError> {
        let (bytes, state) = self.read(id)?;
        let raw = parse_object(&bytes).map_err(|reason| StoreError::Corrupt {
            path: self.state_path(id),
            reason,
        })?;
        Ok(Loaded {
            raw,
            state: Arc::unwrap_or_clone(state),
        })
    }

    /// [`Store::load`], only the typed state.
    pub fn load_state(&self, id: &str) -> Result<LoopState, StoreError> {
        self.read(id).map(|(_, state)| Arc::unwrap_or_clone(state))
    }

    /// [`Store::load_state`], shared with this store's memory of the version: for a reader that
    /// keeps it unchanged.
    pub fn load_shared(&self, id: &str) -> Result<Arc<LoopState>, StoreError> {
        self.read(id).map(|(_, state)| state)
    }

    /// A state file's bytes: refused over [`MAX_STATE_SIZE`], or when it is not a regular file
    /// with one link.
    fn read_bytes(&self, dir: &Dir, id: &str) -> Result<Vec<u8>, StoreError> {
        let path = self.state_path(id);
        dir.read(&state_name(id), MAX_STATE_SIZE)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => self.not_found(id),
                io::ErrorKind::FileTooLarge => StoreError::Corrupt {
                    path: path.clone(),
                    reason: format!("over the {} MiB limit", MAX_STATE_SIZE >> 20),
                },
                io::ErrorKind::InvalidInput => StoreError::Corrupt {
                    path: path.clone(),
                    reason: e.to_string(),
                },
                _ => io_err(&path)(e),
            })
    }

    /// The state file's bytes and their parse. Refused: a file over [`MAX_STATE_SIZE`], anything
    /// but a regular file with one link, and a file that does not parse or fails validation,
    /// after a short retry in case another program is half-way through rewriting it; while a
    /// writer holds it open (the kernel tells), that writer is waited for, however slow
    /// ([`WRITER_HOLD_MAX`] aside).
    fn read(&self, id: &str) -> Result<(Arc<Vec<u8>>, Arc<LoopState>), StoreError> {
        validate_id(id)?;
        let dir = self.existing_dir()?.ok_or_else(|| self.not_found(id))?;
        let path = self.state_path(id);
        let started = Instant::now();
        let deadline = started + PARSE_RETRY;
        let writing = || {
            dir.open_read(&state_name(id))
                .ok()
                .and_then(|file| loopd_fs::open_for_writing(&file))
                == Some(true)
        };
        loop {
            let bytes = self.read_bytes(&dir, id)?;
            if let Some(seen) = self.remembered(id, &bytes) {
                return Ok(seen);
            }
            match parse_state(&path, &bytes) {
                Ok(state) => {
                    let (bytes, state) = (Arc::new(bytes), Arc::new(state));
                    self.remember(id, bytes.clone(), state.clone(), None);
                    return Ok((bytes, state));
                }
                // Another program may be half-way through rewriting the file in place.
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                Err(_) if started.elapsed() < WRITER_HOLD_MAX && writing() => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(reason) => return Err(StoreError::Corrupt { path, reason }),
            }
        }
    }

    /// The control fields of a loop's state file, parsed alone, with no retry: `None` if the file
    /// cannot be read or does not parse right now (a writer may be half-way; its next event
    /// comes). The file is always read: a version is told by what it holds, never by its inode,
    /// size and time, which another version can share (the kernel's clock for a file's time
    /// ticks every few milliseconds, and the store writes into the inodes of replaced versions).
    /// When it holds the version this process last read or wrote, that version's fields are
    /// taken from its typed view, once for every watcher, rather than parsed.
    pub fn read_control(&self, id: &str) -> Option<Control> {
        let dir = self.existing_dir().ok()??;
        let bytes = self.read_bytes(&dir, id).ok()?;
        let seen = self
            .memory
            .then(|| lock(&self.last).get(id).cloned())
            .flatten()
            .filter(|seen| *seen.bytes == bytes);
        match seen {
            Some(seen) => seen
                .control
                .get_or_init(|| {
                    let control = Control::of(&seen.state);
                    debug_assert_eq!(
                        Some(&control),
                        serde_json::from_slice::<Control>(&seen.bytes).ok().as_ref(),
                        "the control fields of a version's typed view are its parse's"
                    );
                    Some(control)
                })
                .clone(),
            None => serde_json::from_slice(&bytes).ok(),
        }
    }
}

fn backup_name(id: &str) -> String {
    format!("{id}.json.bak")
}

fn state_name(id: &str) -> String {
    format!("{id}.json")
}

fn progress_name(id: &str) -> String {
    format!("{id}.progress")
}

#[cfg(test)]
mod tests;
