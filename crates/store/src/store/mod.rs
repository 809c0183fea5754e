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
//! open and it is `ORPHAN_LIFE_SHORT` old (a write lease tells: [`loopd_fs::open_elsewhere`]), or
//! for [`ORPHAN_LIFE`] at most, and a late write into it is merged into the state file
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
//! The parts, a file each: the loop's lock (`lock`), writing a version (`write`: the
//! read-modify-write, the exchange, the daemon's commit), the orphan merge (`orphans`), and
//! durability (`durable`: the backup thread, restore and rebuild; `backup`: the backup file's
//! format). Reading, paths and ids are here.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, LazyLock, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use chrono::DateTime;
use loopd_core::state::{Control, LoopState, Status};
use serde::Deserialize as _;
use serde_json::{Map, Value};

mod backup;
mod durable;
mod lock;
mod orphans;
mod write;

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

/// How long a writer waits for the lock before giving up.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a read-modify-write starts over when a writer that takes no lock changed the file
/// under it.
const WRITE_RACE_RETRIES: usize = 5;
/// How long a read retries a file that does not parse (another writer may be half-way).
const PARSE_RETRY: Duration = Duration::from_millis(250);
/// A state file larger than this is refused rather than read.
pub const MAX_STATE_SIZE: u64 = 16 << 20;
/// A progress file read back (`changes.log`) larger than this is not read.
const MAX_PROGRESS_READ: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "bad loop id {0:?}: ids are 1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
    )]
    BadId(String),
    #[error("unknown loop {id}: {path} does not exist")]
    NotFound { id: String, path: PathBuf },
    #[error("loop {id} already exists at {path}")]
    Exists { id: String, path: PathBuf },
    #[error("corrupt state file {path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("timed out after {}s waiting for the lock {path}", LOCK_TIMEOUT.as_secs())]
    Locked { path: PathBuf },
    /// A file or directory that is not what it should be (a symlink, a FIFO, a hard link): bad
    /// input, refused.
    #[error("{0}")]
    Refused(String),
    /// The cause follows in the error chain.
    #[error("{}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

impl StoreError {
    /// Errors of the user's input (exit code 2), as opposed to the machine failing.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            StoreError::BadId(_)
                | StoreError::NotFound { .. }
                | StoreError::Exists { .. }
                | StoreError::Corrupt { .. }
                | StoreError::Refused(_)
        )
    }

    /// As an `io::Error` of the same kind: a refusal stays `InvalidInput`.
    pub fn into_io(self) -> io::Error {
        match self {
            StoreError::Io { source, .. } => source,
            StoreError::Refused(why) => io::Error::new(io::ErrorKind::InvalidInput, why),
            other => io::Error::other(other.to_string()),
        }
    }

    /// Errors that may go away by themselves: a full disk, a lock held by someone else.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Locked { .. } => true,
            StoreError::Io { source, .. } => is_transient_io(source),
            _ => false,
        }
    }
}

/// A full disk or quota, or a resource that may come back.
pub fn is_transient_io(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded | io::ErrorKind::WouldBlock
    )
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| {
        if loopd_fs::is_refusal(&source) {
            StoreError::Refused(source.to_string())
        } else {
            StoreError::Io {
                path: path.to_owned(),
                source,
            }
        }
    }
}

pub fn validate_id(id: &str) -> Result<(), StoreError> {
    if loopd_core::state::is_loop_id(id) {
        Ok(())
    } else {
        Err(StoreError::BadId(id.to_owned()))
    }
}

/// A new id: `loop-v2-YYYYMMDDTHHMMSS-xxxxxxxx` (UTC, 8 hex digits).
pub fn new_id() -> String {
    format!(
        "loop-v2-{}-{:08x}",
        chrono::Utc::now().format("%Y%m%dT%H%M%S"),
        fastrand::u32(..)
    )
}

/// A state file read from disk: the raw JSON object (what gets written back) and its typed view.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub raw: Map<String, Value>,
    pub state: LoopState,
}

impl Loaded {
    fn parse(path: &Path, bytes: &[u8]) -> Result<Loaded, String> {
        let raw = parse_object(bytes)?;
        let state = typed(path, &raw)?;
        Ok(Loaded { raw, state })
    }
}

/// The JSON object of a state file's bytes.
fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice(bytes).map_err(|e| e.to_string())? {
        Value::Object(raw) => Ok(raw),
        _ => Err("not a JSON object".to_owned()),
    }
}

/// The typed view of a state file's object, refused when it is unusable (see
/// [`loopd_core::workflow::problems`]).
fn typed(path: &Path, raw: &Map<String, Value>) -> Result<LoopState, String> {
    let state = LoopState::deserialize(raw).map_err(|e| e.to_string())?;
    let id = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".json"));
    match loopd_core::workflow::problems(&state, id)
        .into_iter()
        .next()
    {
        Some(problem) => Err(problem),
        None => Ok(state),
    }
}

/// The typed view of a state file's bytes (see [`typed`]).
fn parse_state(path: &Path, bytes: &[u8]) -> Result<LoopState, String> {
    typed(path, &parse_object(bytes)?)
}

/// A status change the daemon makes, applied only if the file still has one of the `from` statuses.
#[derive(Clone, Debug)]
pub struct Transition {
    pub from: &'static [Status],
    pub to: Status,
    pub failure_reason: Option<String>,
    pub completed_at: bool,
}

impl Transition {
    /// A running loop's completion, stamped with its time (`completed_at`).
    pub fn completion() -> Transition {
        Transition {
            from: &[Status::Running],
            to: Status::Completed,
            failure_reason: None,
            completed_at: true,
        }
    }
}

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
    bytes: Vec<u8>,
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
        if seen.bytes != bytes {
            return None;
        }
        lock(&seen.object).take()
    }

    /// The parse of `bytes` if they are the last version seen of `id`.
    fn remembered(&self, id: &str, bytes: &[u8]) -> Option<Arc<LoopState>> {
        if !self.memory {
            return None;
        }
        let last = lock(&self.last);
        let seen = last.get(id)?;
        (seen.bytes == bytes).then(|| seen.state.clone())
    }

    /// Remembers a version this process read or wrote: its bytes, its typed view, and the
    /// object that made them when it wrote them (unless [`Store::without_objects`]).
    fn remember(
        &self,
        id: &str,
        bytes: Vec<u8>,
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
    fn read(&self, id: &str) -> Result<(Vec<u8>, Arc<LoopState>), StoreError> {
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
            if let Some(state) = self.remembered(id, &bytes) {
                return Ok((bytes, state));
            }
            match parse_state(&path, &bytes) {
                Ok(state) => {
                    let state = Arc::new(state);
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
            .filter(|seen| seen.bytes == bytes);
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
mod tests {
    use super::write::daemon_fields;
    use super::*;
    use std::fs;
    use std::io::Write as _;

    /// A version handed to the backup thread wakes it on another CPU than the caller's, when
    /// the caller may run on more than one: woken on the caller's, it would wait there until the
    /// caller sleeps, and the daemon's next attempt waits for it.
    #[test]
    fn the_backup_thread_is_handed_its_work_away_from_the_callers_cpu() {
        if !crate::helper::tests::affinity_allowed() {
            return; // a machine that allows no affinity at all: nothing to hand over
        }
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path(), ".");
        store.defer_durability();
        let state = LoopState {
            loop_id: "l1".into(),
            ..Default::default()
        };
        store.create(&state).unwrap();
        store.update("l1", true, |_, _| {}).unwrap();
        store.wait_durable();
        let thread = durable::backup_thread(store.device().unwrap()).unwrap();
        crate::helper::tests::assert_kept_off_one_cpu(thread.tid());
    }

    #[test]
    fn ids() {
        for good in [
            "a",
            "loop-v2-20260122T021300-0badcafe",
            "A.b_c-1",
            &"x".repeat(128),
        ] {
            assert!(validate_id(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "..",
            "../x",
            "a/b",
            "-a",
            ".a",
            "a\0b",
            "a b",
            &"x".repeat(129),
        ] {
            assert!(validate_id(bad).is_err(), "{bad:?}");
        }
        let id = new_id();
        assert!(validate_id(&id).is_ok());
        assert_eq!(id.len(), "loop-v2-20260122T021300-0badcafe".len(), "{id}");
    }

    /// A store of a temporary directory holding loop `l1`, running.
    fn running_loop() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path(), ".");
        let state = LoopState {
            loop_id: "l1".into(),
            status: Status::Running,
            ..LoopState::default()
        };
        store.create(&state).unwrap();
        (dir, store)
    }

    /// A write made on the version this process wrote last starts from the object it was
    /// written from (the same object its bytes parse to), and another program's edit of the file
    /// in between is never lost to it; a store without objects (the service's) keeps none.
    #[test]
    fn a_write_on_this_processs_last_version_starts_from_its_object_and_only_then() {
        let (dir, store) = running_loop();
        let set = |key: &str, value: Value| {
            store
                .update("l1", false, |raw, _| {
                    raw.insert(key.into(), value.clone());
                })
                .unwrap();
        };
        set("current_iteration", 1.into());
        let path = store.state_path("l1");
        let bytes = fs::read(&path).unwrap();
        let object = store
            .take_object("l1", &bytes)
            .expect("the object of its last write");
        assert_eq!(
            Value::Object(object),
            serde_json::from_slice::<Value>(&bytes).unwrap()
        );
        assert!(
            store.take_object("l1", &bytes).is_none(),
            "one write takes it"
        );
        set("current_iteration", 2.into());
        // Another program's edit: the next write parses the file it finds.
        let mut edited: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        edited["their_field"] = "kept".into();
        fs::write(&path, serde_json::to_vec_pretty(&edited).unwrap()).unwrap();
        set("current_iteration", 3.into());
        let written: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            (&written["their_field"], &written["current_iteration"]),
            (&Value::from("kept"), &Value::from(3))
        );
        let service = Store::new(dir.path(), ".").without_objects();
        service.update("l1", false, |_, _| {}).unwrap();
        assert!(
            service
                .take_object("l1", &fs::read(&path).unwrap())
                .is_none()
        );
        drop(dir);
    }

    /// The temporary files of a directory.
    fn temp_files(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(TEMP_SUFFIX))
            .collect()
    }

    /// A daemon's start sweeps what dead writers left, not the replaced version a living writer
    /// (a command between its write and its hand-over) still keeps
    /// (`loopd_writers_and_a_ccw_style_writer_lose_no_update_with_a_service` lost an edit kept
    /// in such a version, swept in the ~1 ms before its writer handed it over).
    #[test]
    fn a_sweep_removes_what_dead_writers_left_and_nothing_a_living_one_keeps() {
        let (dir, store) = running_loop();
        let mut living = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        dead.wait().unwrap();
        // Killed and not reaped yet: dead too.
        let mut zombie = std::process::Command::new("true").spawn().unwrap();
        let stat = format!("/proc/{}/stat", zombie.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !fs::read_to_string(&stat).unwrap().contains(") Z") {
            assert!(Instant::now() < deadline, "no zombie");
            std::thread::sleep(Duration::from_millis(5));
        }
        let kept_by_living = format!(".l1.json.{}-aaaaaa{TEMP_SUFFIX}", living.id());
        let left_by_dead = format!(".l1.json.{}-bbbbbb{TEMP_SUFFIX}", dead.id());
        let left_by_zombie = format!(".l1.json.{}-cccccc{TEMP_SUFFIX}", zombie.id());
        let unnamed = format!(".l1.json.dddddd{TEMP_SUFFIX}");
        for name in [&kept_by_living, &left_by_dead, &left_by_zombie, &unnamed] {
            fs::write(dir.path().join(name), "{}").unwrap();
        }
        assert_eq!(store.sweep_temp_files("l1").unwrap(), 3);
        assert_eq!(temp_files(dir.path()), [kept_by_living]);
        zombie.wait().unwrap();
        living.kill().unwrap();
        living.wait().unwrap();
    }

    #[test]
    fn an_in_place_write_during_an_update_is_merged_not_lost() {
        let (dir, store) = running_loop();
        let path = store.state_path("l1");
        let mut rounds = 0;
        let after = store
            .update("l1", true, |raw, _| {
                rounds += 1;
                if rounds == 1 {
                    // Another program rewrites the file in place, between our read and our write.
                    let mut theirs: Value =
                        serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
                    theirs["notes"] = "theirs".into();
                    fs::write(&path, serde_json::to_vec(&theirs).unwrap()).unwrap();
                }
                raw.insert("current_iteration".into(), 7.into());
            })
            .unwrap();
        assert_eq!(
            rounds, 2,
            "the change is made again on top of their version"
        );
        assert_eq!(after.current_iteration, 7);
        let on_disk: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk["notes"], "theirs");
        assert_eq!(on_disk["current_iteration"], 7);
        store.close();
        assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    }

    /// A lockless writer reads `l1`'s state file and opens it for writing, then loopd writes a
    /// new version (`current_iteration` 3): returns the writer's copy and its open file, which
    /// is now the replaced version.
    fn opened_then_replaced(store: &Store) -> (Value, fs::File) {
        let path = store.state_path("l1");
        let theirs: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        let late = fs::OpenOptions::new().write(true).open(&path).unwrap();
        store
            .update("l1", true, |raw, _| {
                raw.insert("current_iteration".into(), 3.into());
            })
            .unwrap();
        (theirs, late)
    }

    /// The lockless writer's whole-file rewrite of its copy with `notes` set, through `late`.
    fn write_late(mut theirs: Value, mut late: fs::File) {
        theirs["notes"] = "late".into();
        late.set_len(0).unwrap();
        late.write_all(&serde_json::to_vec(&theirs).unwrap())
            .unwrap();
    }

    #[test]
    fn a_late_write_into_the_replaced_version_is_merged() {
        let (dir, store) = running_loop();
        let path = store.state_path("l1");
        let (theirs, late) = opened_then_replaced(&store);
        // The writer's bytes land in the version that is no longer the state file.
        write_late(theirs, late);
        assert_eq!(store.settle("l1").unwrap(), 1);
        let on_disk: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk["notes"], "late");
        assert_eq!(
            on_disk["current_iteration"], 3,
            "their stale copy of the daemon's fields is ignored"
        );
        store.close();
        assert!(!store.has_orphans(None));
        assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    }

    /// A command's durable write made on a copy another program put back (its loop at 1
    /// finished action), recorded after the daemon's record of 2 finished actions got there
    /// first (the daemon defers its backups): the command's change is recorded, the daemon's
    /// progress stays the backup's, and a daemon that starts takes it from there.
    #[test]
    fn a_backup_record_behind_the_newest_keeps_its_progress() {
        let (dir, store) = running_loop();
        let at = |seq: u64, status: &str| {
            let mut v: Value =
                serde_json::from_slice(&fs::read(store.state_path("l1")).unwrap()).unwrap();
            v["skill_state"] = serde_json::json!({"seq": seq, "current_action": null});
            v["status"] = status.into();
            to_pretty(&store.state_path("l1"), &v).unwrap()
        };
        let (daemon, command) = (at(2, "running"), at(1, "paused"));
        let d = Dir::open(dir.path()).unwrap();
        store.record_version(&d, "l1", &daemon, 2).unwrap();
        store.record_version(&d, "l1", &command, 1).unwrap();
        let (backed, _) = store.backed(&d, "l1").unwrap();
        assert_eq!(backed.status, Status::Paused, "the command's change");
        assert_eq!(
            backed.skill_state.as_ref().unwrap().seq,
            2,
            "the daemon's progress"
        );
        fs::write(store.state_path("l1"), &command).unwrap();
        let (own, why) = store.load_own("l1").unwrap();
        assert_eq!(own.skill_state.as_ref().unwrap().seq, 2);
        assert!(why.unwrap().contains("1 actions finished, not 2"));
    }

    /// A lockless writer reads the paused loop, a resume is written, the writer opens the state
    /// file, and another write replaces that version before the writer's copy lands in it: the
    /// copy holds the status it read, not the one of the version it went into. Its edit is what
    /// it changed from what it read (found by the `updated_at` it kept), its notes: the pause its
    /// stale copy would bring back is no edit of its (a status that came back after a final
    /// resume in `loopd_writers_and_a_ccw_style_writer_lose_no_update`).
    #[test]
    fn a_late_write_read_before_the_version_it_went_into_merges_its_own_edit_alone() {
        let (dir, store) = running_loop();
        let path = store.state_path("l1");
        // Each write in a millisecond of its own: `updated_at` tells the versions apart.
        let write = |key: &str, value: Value| {
            let before = now_rfc3339();
            while now_rfc3339() == before {
                std::hint::spin_loop();
            }
            store
                .update("l1", true, |raw, _| {
                    raw.insert(key.into(), value.clone());
                })
                .unwrap();
        };
        write("status", "paused".into());
        let theirs: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        write("status", "running".into());
        let late = fs::OpenOptions::new().write(true).open(&path).unwrap();
        write("current_iteration", 3.into());
        write_late(theirs, late);
        assert_eq!(store.settle("l1").unwrap(), 1);
        let on_disk: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk["notes"], "late");
        assert_eq!(on_disk["status"], "running", "the resume is not undone");
        assert_eq!(on_disk["current_iteration"], 3);
        store.close();
        assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    }

    /// A lockless writer's two edits in a row both land in replaced versions (it opened the
    /// state file just before each of two writes replaced it), and the second write was made
    /// without the first edit: another process made it, or the first late write was not yet
    /// reported. Here two short-lived writers hand their versions over to a watcher, which
    /// merges them in the order they were replaced: the older edit, merged first, is no change
    /// made since the newer one's version was replaced, and the newer edit wins (it was lost
    /// once in `loopd_writers_and_a_ccw_style_writer_lose_no_update_with_a_service`).
    #[test]
    fn late_writes_into_two_replaced_versions_keep_the_newer_edit() {
        let (dir, store) = running_loop();
        let path = store.state_path("l1");
        let handover_notes = || -> Vec<String> {
            fs::read_dir(dir.path())
                .unwrap()
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.ends_with(HANDOVER_SUFFIX))
                .collect()
        };
        // A short-lived writer: one write, its replaced version handed over; the note.
        let write = |n: u64, late: Option<(Value, fs::File, &str)>| {
            let before = handover_notes();
            store
                .update("l1", true, |raw, _| {
                    raw.insert("current_iteration".into(), n.into());
                })
                .unwrap();
            // The lockless writer's bytes land in the version just replaced.
            if let Some((mut theirs, mut file, note)) = late {
                theirs["notes"] = note.into();
                file.set_len(0).unwrap();
                file.write_all(&serde_json::to_vec(&theirs).unwrap())
                    .unwrap();
            }
            store.close_with(|_| Settler::Another);
            let mut new: Vec<String> = handover_notes();
            new.retain(|n| !before.contains(n));
            assert_eq!(new.len(), 1, "{new:?}");
            new.remove(0)
        };
        // It reads the state file and opens it to write its edit, which lands after a write.
        let open = || {
            let theirs: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
            let file = fs::OpenOptions::new().write(true).open(&path).unwrap();
            (theirs, file)
        };
        let (theirs, file) = open();
        let first = write(1, Some((theirs, file, "edit 1")));
        let (theirs, file) = open();
        assert_eq!(theirs["notes"], Value::Null, "edit 1 is not merged yet");
        let second = write(2, Some((theirs, file, "edit 2")));
        let watcher = Store::new(dir.path(), ".");
        assert!(watcher.adopt(&first));
        assert!(watcher.adopt(&second));
        assert_eq!(watcher.settle("l1").unwrap(), 2);
        let on_disk: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk["notes"], "edit 2", "the newer edit wins");
        assert_eq!(on_disk["current_iteration"], 2);
        watcher.close();
        assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn a_writer_that_hands_its_replaced_versions_over_loses_no_late_write() {
        let (dir, store) = running_loop();
        let path = store.state_path("l1");
        let (theirs, late) = opened_then_replaced(&store);
        // The writer exits at once, handing the version it replaced over to the watcher...
        store.close_with(|_| Settler::Another);
        let notes: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(HANDOVER_SUFFIX))
            .collect();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(!store.has_orphans(None), "nothing is left to this writer");
        // ...and the lockless writer's bytes land in that version afterwards.
        write_late(theirs, late);
        // The watcher takes it over (once: a second look finds no note) and settles it.
        let watcher = Store::new(dir.path(), ".");
        assert!(watcher.adopt(&notes[0]));
        assert!(!watcher.adopt(&notes[0]));
        assert_eq!(watcher.settle("l1").unwrap(), 1);
        let on_disk: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk["notes"], "late");
        assert_eq!(on_disk["current_iteration"], 3);
        watcher.close();
        assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn under_a_watcher_only_versions_written_into_are_read_and_settled_ones_are_reused() {
        use std::os::unix::fs::MetadataExt as _;
        let (dir, store) = running_loop();
        let _watch = store.watch_orphans("l1");
        let path = store.state_path("l1");
        let ino = |p: &Path| fs::metadata(p).unwrap().ino();
        let mut late = fs::OpenOptions::new().write(true).open(&path).unwrap();
        let replaced = ino(&path);
        let write = |n: u64| {
            store
                .update("l1", true, |raw, _| {
                    raw.insert("current_iteration".into(), n.into());
                })
                .unwrap()
        };
        write(1);
        let kept = lock(&store.orphans).orphans[0].name.clone();
        assert_eq!(ino(&dir.path().join(&kept)), replaced);
        late.set_len(0).unwrap();
        late.write_all(br#"{"loop_id":"l1","status":"running","notes":"late"}"#)
            .unwrap();
        // Not reported: not read, so not merged yet.
        assert_eq!(store.settle("l1").unwrap(), 0);
        assert!(store.written_into(&kept));
        assert_eq!(store.settle("l1").unwrap(), 1);
        let on_disk: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk["notes"], "late");
        // Once their time is up, unchanged versions are left for the next writes: no new file.
        let kept: Vec<u64> = lock(&store.orphans)
            .orphans
            .iter()
            .map(|o| ino(&dir.path().join(&o.name)))
            .collect();
        assert!(!kept.is_empty());
        std::thread::sleep(ORPHAN_LIFE);
        write(2);
        assert!(
            kept.contains(&ino(&path)),
            "the new version is written into a settled one"
        );
        // Under its own name, which a watcher takes as the writer's own until the rename into
        // place, and as a replaced version again from then on.
        let taken: Vec<String> = lock(&store.orphans)
            .reusing
            .iter()
            .map(|(n, _)| n.clone())
            .collect();
        assert_eq!(taken.len(), 1, "{taken:?}");
        assert!(store.reusing(&taken[0], false));
        assert!(store.reusing(&taken[0], true));
        assert!(!store.reusing(&taken[0], false));
        assert!(
            lock(&store.orphans)
                .orphans
                .iter()
                .any(|o| o.name == taken[0])
        );
        let on_disk: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            (
                on_disk["notes"].clone(),
                on_disk["current_iteration"].clone()
            ),
            ("late".into(), 2.into())
        );
        store.close();
        assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    }

    /// Two stores of one process (a service's daemon and its API): a stop the API writes into a
    /// spare whose inode the daemon's store wrote before is seen as written, not as the daemon's
    /// store remembered that inode (the dashboard's stop went unseen until the watch's re-check,
    /// 30 s later).
    #[test]
    fn a_version_another_store_wrote_into_an_inode_this_one_wrote_before_is_read() {
        use std::os::unix::fs::MetadataExt as _;
        let (dir, daemon) = running_loop();
        let _watch = daemon.watch_orphans("l1");
        let api = Store::new(dir.path(), ".");
        let path = daemon.state_path("l1");
        let ino = |p: &Path| fs::metadata(p).unwrap().ino();
        let set = |store: &Store, key: &str, value: Value| {
            store
                .update("l1", true, |raw, _| {
                    raw.insert(key.into(), value.clone());
                })
                .unwrap();
            // Its replaced version, settled, is the next write's spare.
            std::thread::sleep(ORPHAN_LIFE);
            store.settle("l1").unwrap();
        };
        set(&daemon, "current_iteration", 1.into());
        let daemons = ino(&path);
        assert_eq!(daemon.read_control("l1").unwrap().status, Status::Running);
        set(&api, "max_cost_usd", 4.5.into());
        set(&api, "status", "failed".into());
        assert_eq!(ino(&path), daemons, "the stop went into the daemon's inode");
        assert_eq!(daemon.read_control("l1").unwrap().status, Status::Failed);
    }

    /// A version is told by what it holds, never by its inode, size and modification time: the
    /// kernel's clock for a file's time ticks every 1 to 4 ms, the store writes into the inodes of
    /// replaced versions, and `created` and `running` have the same length, so another version
    /// can carry the same three (a watcher once took such a version for the one it knew).
    #[test]
    fn a_version_with_the_inode_size_and_time_of_one_written_before_is_read_as_itself() {
        let (_dir, store) = running_loop();
        store
            .update("l1", false, |raw, _| {
                raw.insert("title".into(), "abcdef".into());
            })
            .unwrap();
        assert_eq!(store.read_control("l1").unwrap().status, Status::Running);
        let path = store.state_path("l1");
        let before = fs::metadata(&path).unwrap();
        // Another writer puts a pause of the same length into the same inode, and its time
        // comes out the same.
        let paused = String::from_utf8(fs::read(&path).unwrap())
            .unwrap()
            .replace(r#""status": "running""#, r#""status": "paused""#)
            .replace("abcdef", "abcdefg");
        assert_eq!(paused.len() as u64, before.len());
        let mut file = fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all(paused.as_bytes()).unwrap();
        file.set_modified(before.modified().unwrap()).unwrap();
        drop(file);
        let after = fs::metadata(&path).unwrap();
        use std::os::unix::fs::MetadataExt as _;
        assert_eq!(
            (after.ino(), after.len(), after.modified().unwrap()),
            (before.ino(), before.len(), before.modified().unwrap())
        );
        assert_eq!(store.read_control("l1").unwrap().status, Status::Paused);
    }

    #[test]
    fn a_replaced_version_open_elsewhere_is_never_reused_and_one_let_go_is_reused_early() {
        use std::os::unix::fs::MetadataExt as _;
        let (dir, store) = running_loop();
        let _watch = store.watch_orphans("l1");
        let path = store.state_path("l1");
        let ino = |p: &Path| fs::metadata(p).unwrap().ino();
        let write = |n: u64| {
            store
                .update("l1", true, |raw, _| {
                    raw.insert("current_iteration".into(), n.into());
                })
                .unwrap();
            ino(&path)
        };
        // A reader holds the version in place open while it is replaced.
        let reader = fs::File::open(&path).unwrap();
        let held = ino(&path);
        let first = write(1);
        std::thread::sleep(ORPHAN_LIFE_SHORT);
        assert_ne!(
            write(2),
            held,
            "a version open elsewhere is not written into"
        );
        // The first write's version, replaced by the second and open nowhere, is written into
        // as soon as it is older than an open begun before its replacement could take, well
        // before its orphan's life is up.
        std::thread::sleep(ORPHAN_LIFE_SHORT);
        assert_eq!(write(3), first);
        // Once let go, the held one is settled too.
        let kept_held = || {
            lock(&store.orphans)
                .orphans
                .iter()
                .filter_map(|o| fs::metadata(dir.path().join(&o.name)).ok())
                .any(|m| m.ino() == held)
        };
        drop(reader);
        std::thread::sleep(ORPHAN_LIFE_SHORT);
        write(4);
        assert!(!kept_held(), "once let go, it is settled");
        let on_disk: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk["current_iteration"], 4);
        store.close();
        assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn the_daemon_fields_are_those_of_the_whole_state() {
        for skill_state in [None, Some(Default::default())] {
            let state = LoopState {
                loop_id: "l1".into(),
                current_iteration: 4,
                skill_state,
                ..LoopState::default()
            };
            let Value::Object(whole) = serde_json::to_value(&state).unwrap() else {
                panic!("a state is an object")
            };
            let whole: Map<String, Value> = whole
                .into_iter()
                .filter(|(k, _)| DAEMON_FIELDS.contains(&k.as_str()))
                .collect();
            assert_eq!(daemon_fields(&state).unwrap(), whole);
        }
    }

    /// A commit made on the store's own last write knows its typed result without parsing the
    /// file again: it is what another store parses from the file, through a consumed choice, the
    /// workflow's own fields and a transition; a key of the file's that the daemon's copy lacks
    /// is kept, and the parse's to tell.
    #[test]
    fn a_commit_on_its_own_write_is_what_the_file_parses_to() {
        let (dir, store) = running_loop();
        let parsed = || LoopState::clone(&Store::new(dir.path(), ".").load_shared("l1").unwrap());
        let mut state = LoopState::clone(&store.load_shared("l1").unwrap());
        // A controller's choice, then the daemon's write that consumes it.
        store
            .update("l1", false, |raw, _| {
                raw.insert("next_action".into(), "validate".into());
            })
            .unwrap();
        state.current_iteration = 1;
        state.skill().part.insert(
            "develop".into(),
            serde_json::json!({"tasks": [{"id": "T1", "description": "a", "mine": 1}]}),
        );
        state.skill().seq = 1;
        let after = store.commit(&state, None, false).unwrap();
        assert_eq!(*after, parsed());
        state.current_iteration = 2;
        state.skill().seq = 2;
        let after = store
            .commit_with(&state, None, Some("validate"), true)
            .unwrap();
        assert_eq!(after.next_action, None);
        assert_eq!(*after, parsed());
        // A field of the workflow's the daemon's copy no longer has comes back from the file.
        state.skill().part.remove("develop");
        let after = store.commit(&state, None, false).unwrap();
        assert!(
            after
                .skill_state
                .as_ref()
                .unwrap()
                .part
                .contains_key("develop")
        );
        assert_eq!(*after, parsed());
        let done = Transition::completion();
        let after = store.commit(&state, Some(&done), true).unwrap();
        assert_eq!(after.status, Status::Completed);
        assert!(after.completed_at.is_some());
        assert_eq!(*after, parsed());
    }

    #[test]
    fn commit_keeps_control_fields_written_by_others() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path(), ".");
        let mut state = LoopState {
            loop_id: "l1".into(),
            title: "t".into(),
            status: Status::Running,
            ..LoopState::default()
        };
        store.create(&state).unwrap();
        // Someone else pauses the loop and edits the title.
        store
            .update("l1", false, |raw, _| {
                raw.insert("status".into(), "paused".into());
                raw.insert("title".into(), "new".into());
                raw.insert("notes".into(), "mine".into());
            })
            .unwrap();
        // The daemon's stale copy still says running / "t".
        state.current_iteration = 4;
        let done = Transition::completion();
        let after = store.commit(&state, Some(&done), true).unwrap();
        assert_eq!(after.status, Status::Paused);
        assert_eq!(after.title, "new");
        assert_eq!(store.load("l1").unwrap().raw["notes"], "mine");
        assert_eq!(after.current_iteration, 4);
        assert!(after.completed_at.is_none());
    }
}
