//! Where loop files live and how they are read and written.
//!
//! Theory of operation: every writer (the daemon, the CLI's control commands) changes a state file
//! by read-modify-write under an exclusive `flock` on the sidecar `{id}.lock`, which is never
//! renamed or deleted, so the lock and the file it guards cannot come apart. The new version is
//! written to a temporary file in the same directory (`.{id}.json.XXXXXX.tmp`, mode 0600) and
//! exchanged with the state file (`renameat2(RENAME_EXCHANGE)`, else a plain rename): a reader
//! sees the old file or the new one, never a mix. A durable write is made durable by its backup
//! `{id}.json.bak` ([`backup`]): the same bytes, written there with a checksum and
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
//! open and it is [`ORPHAN_LIFE_SHORT`] old (a write lease tells: [`loopd_fs::open_elsewhere`]), or
//! for [`ORPHAN_LIFE`] at most, and a late write into it is merged into the state file
//! ([`Store::settle`]: the keys it changed, against the version it replaced). The daemon's watcher
//! marks an orphan written into (by the order of its file events: a write after the exchange
//! renamed it) and settles it; every writer settles the orphans so marked, and those whose time is
//! up, before it writes; a short-lived
//! command settles all of them before it exits ([`Store::close`]), unless a process that watches
//! the directory (the loop's daemon, the service) takes them over: then it leaves a note for each
//! and exits at once ([`Store::close_with`], [`Store::adopt`]). A settled orphan nobody wrote
//! into is kept as a *spare*, the file the next write is written into (no inode allocated or
//! released per write), under its own name: the watcher takes the writes into a spare taken for a
//! write as the writer's own until it sees it renamed into place ([`Store::reusing`]).

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

use crate::lock;
use crate::now_rfc3339;
use loopd_fs::{Dir, TEMP_SUFFIX};

/// Top-level fields the daemon owns and writes back from its own copy.
pub const DAEMON_FIELDS: &[&str] = &["current_iteration", "skill_state"];

/// The [`DAEMON_FIELDS`] of `state`, as the whole state serializes them (without serializing the
/// rest).
fn daemon_fields(state: &LoopState) -> serde_json::Result<Map<String, Value>> {
    let mut fields = Map::new();
    fields.insert("current_iteration".into(), state.current_iteration.into());
    if let Some(skill) = &state.skill_state {
        fields.insert("skill_state".into(), Value::Object(skill.to_map()?));
    }
    Ok(fields)
}

/// Keys of `skill_state` the daemon writes only while they hold something: when the daemon's
/// state lacks one, it was cleared, and it is removed rather than kept as another writer's.
const CLEARABLE_SKILL_KEYS: &[&str] = &["blocked", "question"];

/// How long a writer waits for the lock before giving up.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a read retries a file that does not parse (another writer may be half-way).
const PARSE_RETRY: Duration = Duration::from_millis(250);
/// A state file larger than this is refused rather than read.
pub const MAX_STATE_SIZE: u64 = 16 << 20;
/// A progress file read back (`changes.log`) larger than this is not read.
const MAX_PROGRESS_READ: u64 = 16 << 20;
/// How often a read-modify-write starts over when a writer that takes no lock changed the file
/// under it.
const WRITE_RACE_RETRIES: usize = 5;
/// How long a replaced version is kept for a late write into it by a writer that takes no lock
/// (which writes within microseconds of opening the file, unless it is descheduled), at most.
/// One still open elsewhere then is not written into again.
pub const ORPHAN_LIFE: Duration = Duration::from_millis(300);
/// How many settled versions of one loop are left for the next writes to reuse.
const MAX_SPARES: usize = 8;
/// How long a short-lived command keeps its replaced versions before it exits ([`Store::close`]):
/// a lockless writer that opened the file before the exchange writes within microseconds. Also
/// how long a replaced version that no process has open is kept: an open of the state file begun
/// before the exchange (its name looked up) and not yet done is over well within it.
pub(super) const ORPHAN_LIFE_SHORT: Duration = Duration::from_millis(30);

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
    let ok = !id.is_empty()
        && id.len() <= 128
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
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

/// The state directory of a project.
#[derive(Clone, Debug)]
pub struct Store {
    root: PathBuf,
    /// The state directory relative to the root (config `state_dir`).
    rel: PathBuf,
    path: PathBuf,
    /// The state directory, once opened.
    dir: Arc<Mutex<Option<Dir>>>,
    /// The last version of each state file this store read or wrote, bytes and parse: a read
    /// that finds the same bytes again skips the parse.
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
}

/// The process's backup threads, one per filesystem its stores are on (a service drives many
/// loops, and a slow or full disk must hold up no loop of another), each started on first use:
/// it records the backups it is handed, in order.
static BACKUP_THREADS: LazyLock<Mutex<HashMap<u64, mpsc::Sender<BackupJob>>>> =
    LazyLock::new(Default::default);

/// The backup thread of the filesystem `dev`; `None` if it cannot start.
fn backup_thread(dev: u64) -> Option<mpsc::Sender<BackupJob>> {
    let mut threads = lock(&BACKUP_THREADS);
    if let Some(jobs) = threads.get(&dev) {
        return Some(jobs.clone());
    }
    let (jobs, queue) = mpsc::channel::<BackupJob>();
    let started = std::thread::Builder::new()
        .name("loopd-backup".into())
        .spawn(move || {
            for job in queue {
                job.store.record_backup(&job.id, &job.bytes);
                let _ = job.done.send(());
            }
        });
    match started {
        Ok(_) => {
            threads.insert(dev, jobs.clone());
            Some(jobs)
        }
        Err(e) => {
            tracing::warn!("cannot start a backup thread ({e}); writing backups at once");
            None
        }
    }
}

/// A version to record in the backup of loop `id` of `store`; `done` is told when it is durable.
#[derive(Debug)]
struct BackupJob {
    store: Store,
    id: String,
    bytes: Vec<u8>,
    done: mpsc::SyncSender<()>,
}

/// A version of a state file, and its typed view (shared with the daemon's copy of its fields:
/// a service keeps one per loop, not several).
#[derive(Debug)]
struct Seen {
    bytes: Vec<u8>,
    state: Arc<LoopState>,
    /// The inode of the file, when this store wrote it.
    ino: Option<u64>,
    /// Its control fields, once a watcher asked for them.
    control: std::sync::OnceLock<Option<Control>>,
}

/// The replaced versions kept in one state directory by this process.
type Orphans = Arc<Mutex<Kept>>;

/// The replaced versions kept in one state directory, and what this process's watchers saw
/// written into them.
#[derive(Debug, Default)]
struct Kept {
    orphans: Vec<Orphan>,
    /// Replaced versions a watcher saw written into before they were kept (the late write's event
    /// can overtake the writer's bookkeeping), and when.
    early: Vec<(String, Instant)>,
    /// The loops whose writes into replaced versions a watcher of this process reports
    /// ([`Store::watch_orphans`]), and by how many watchers. A settle reads their versions only
    /// when one was written into or its time is up; any other loop's, every time.
    watched: HashMap<String, usize>,
    /// Woken when a version is kept: a watcher sleeps until the oldest one's time is up.
    added: Arc<tokio::sync::Notify>,
    /// Settled versions, nobody's any more, left in place for the next writes to reuse (no inode
    /// allocated or released per write: see [`Dir::open_existing_rw`]): by loop, their
    /// temporary names.
    spares: Vec<(String, String)>,
    /// Spares taken for a write, and when: the writes into them are the writer's own, not late
    /// writes, until a watcher sees them renamed into place ([`Store::reusing`]).
    reusing: Vec<(String, Instant)>,
}

/// The replaced versions kept by this process's stores of the state directory `path`: one list
/// however many stores the process has of it (the service's loops and its API each have one), so
/// that a sweep by one never removes a version another keeps for a late write.
fn shared_orphans(path: &Path) -> Orphans {
    static ALL: std::sync::LazyLock<Mutex<HashMap<PathBuf, Orphans>>> =
        std::sync::LazyLock::new(Default::default);
    let mut all = lock(&ALL);
    all.entry(path.to_owned()).or_default().clone()
}

#[derive(Debug, Clone)]
struct Orphan {
    id: String,
    name: String,
    /// What it held when it was replaced: a late write is what differs from it.
    base: Vec<u8>,
    /// What replaced it: a key the state file no longer holds as written there was changed by
    /// someone since, and is theirs to keep.
    written: Vec<u8>,
    since: Instant,
    /// A watcher saw a write into it since it was last read.
    touched: bool,
}

/// A watcher's report of the writes into one loop's replaced versions; dropping it ends that.
pub struct OrphanWatch {
    orphans: Orphans,
    id: String,
}

impl Drop for OrphanWatch {
    fn drop(&mut self) {
        let mut kept = lock(&self.orphans);
        if let Some(n) = kept.watched.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                kept.watched.remove(&self.id);
            }
        }
    }
}

/// An exclusive lock on a loop's sidecar lock file, released on drop.
pub struct WriteLock {
    file: Rc<File>,
}

impl Drop for WriteLock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

thread_local! {
    /// Lock files kept open, one per path and thread: a writer locks and unlocks its loop's lock
    /// file twice per action, and opening it each time is what costs. Per thread, because
    /// `flock` does not exclude holders of the same open file, and threads must exclude each
    /// other like processes do.
    static LOCK_FILES: RefCell<HashMap<PathBuf, Rc<File>>> = RefCell::new(HashMap::new());
}

impl Store {
    /// The store of `<root>/<state_dir>`; nothing is opened until it is used.
    pub fn new(root: &Path, state_dir: &str) -> Store {
        Store {
            root: root.to_owned(),
            rel: PathBuf::from(state_dir),
            path: root.join(state_dir),
            dir: Arc::default(),
            last: Arc::default(),
            orphans: shared_orphans(&root.join(state_dir)),
            deferred: Arc::default(),
            backup_failing: Arc::default(),
            memory: true,
        }
    }

    /// From now on, a durable write returns once its version is in place, and is made durable
    /// (its backup recorded: see [`backup`]) on the backup thread of its filesystem
    /// ([`BACKUP_THREADS`]) while the
    /// caller goes on; [`Store::wait_durable`] waits for it. The daemon defers, and waits before it starts the
    /// next attempt: the fdatasync overlaps with its work between two actions.
    pub fn defer_durability(&self) {
        self.deferred.get_or_init(Mutex::default);
    }

    /// Waits until every durable write of this store is durable (see
    /// [`Store::defer_durability`]).
    pub fn wait_durable(&self) {
        let Some(deferred) = self.deferred.get() else {
            return;
        };
        let pending = std::mem::take(&mut *lock(deferred));
        for done in pending {
            let _ = done.recv();
        }
    }

    /// Whether every durable write of this store is durable by now (see
    /// [`Store::defer_durability`]); those that are are forgotten.
    pub fn all_durable(&self) -> bool {
        let Some(deferred) = self.deferred.get() else {
            return true;
        };
        let mut pending = lock(deferred);
        pending.retain(|done| matches!(done.try_recv(), Err(mpsc::TryRecvError::Empty)));
        pending.is_empty()
    }

    /// Hands the version `bytes` of loop `id` to the backup thread, if durability is deferred
    /// and that thread runs; whether it did.
    fn defer_backup(&self, id: &str, bytes: &[u8]) -> bool {
        let Some(deferred) = self.deferred.get() else {
            return false;
        };
        let Some(jobs) = self.device().and_then(backup_thread) else {
            return false;
        };
        let (done, recorded) = mpsc::sync_channel(1);
        let job = BackupJob {
            store: self.clone(),
            id: id.to_owned(),
            bytes: bytes.to_vec(),
            done,
        };
        let sent = jobs.send(job).is_ok();
        if sent {
            lock(deferred).push(recorded);
        }
        sent
    }

    /// Records `bytes` in the backup of loop `id`, on the backup thread: if that fails, the
    /// state file is fsynced instead, under the loop's lock (so after the write that handed
    /// `bytes` over has put them in place).
    fn record_backup(&self, id: &str, bytes: &[u8]) {
        let Ok(dir) = self.state_dir(false) else {
            return;
        };
        match backup::record(&dir, &backup_name(id), bytes) {
            Ok(()) => self.backup_recorded(id),
            Err(e) => {
                let _lock = self.lock(id);
                self.sync_without_backup(&dir, id, &e);
            }
        }
    }

    /// A backup of `id` was written: if it could not be before, that is said.
    fn backup_recorded(&self, id: &str) {
        if lock(&self.backup_failing).remove(id) {
            tracing::info!(
                "the backup {} can be written again",
                self.backup_path(id).display()
            );
        }
    }

    /// The filesystem the state directory is on.
    fn device(&self) -> Option<u64> {
        self.state_dir(false).ok()?.device()
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

    /// The parse of `bytes` if they are the last version seen of `id`.
    fn remembered(&self, id: &str, bytes: &[u8]) -> Option<Arc<LoopState>> {
        if !self.memory {
            return None;
        }
        let last = lock(&self.last);
        let seen = last.get(id)?;
        (seen.bytes == bytes).then(|| seen.state.clone())
    }

    fn remember(&self, id: &str, bytes: Vec<u8>, state: Arc<LoopState>, ino: Option<u64>) {
        if !self.memory {
            return;
        }
        let seen = Seen {
            bytes,
            state,
            ino,
            control: Default::default(),
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

    /// Opens a lock file of the state directory (a loop's `{id}.daemon`, `worktree.lock`),
    /// creating it (0600).
    pub fn open_lock(&self, name: &str) -> Result<File, StoreError> {
        self.state_dir(true)?
            .open_rw(name)
            .map_err(io_err(&self.path.join(name)))
    }

    /// Opens a lock file of the state directory if it exists.
    pub fn existing_lock(&self, name: &str) -> Option<File> {
        self.existing_dir().ok()??.open_read(name).ok()
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

    /// Takes the write lock of a loop, waiting a bounded time for another writer.
    pub fn lock(&self, id: &str) -> Result<WriteLock, StoreError> {
        let dir = self.state_dir(true)?;
        let name = format!("{id}.lock");
        let path = dir.join(&name);
        let file = LOCK_FILES
            .with(|files| {
                if let Some(file) = files.borrow().get(&path) {
                    return Ok(file.clone());
                }
                let file = Rc::new(dir.open_rw(&name)?);
                files.borrow_mut().insert(path.clone(), file.clone());
                Ok(file)
            })
            .map_err(io_err(&path))?;
        let deadline = Instant::now() + LOCK_TIMEOUT;
        // Holders keep the lock for a read or a write, tens of microseconds: the first looks
        // come soon, then less and less often.
        let mut pause = Duration::from_micros(10);
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(WriteLock { file }),
                Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
                Err(std::fs::TryLockError::WouldBlock) => return Err(StoreError::Locked { path }),
                Err(std::fs::TryLockError::Error(e)) => return Err(io_err(&path)(e)),
            }
        }
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
    /// but a regular file with one link, and (after a short retry, in case another program is
    /// half-way through rewriting it) a file that does not parse or fails validation.
    fn read(&self, id: &str) -> Result<(Vec<u8>, Arc<LoopState>), StoreError> {
        validate_id(id)?;
        let dir = self.existing_dir()?.ok_or_else(|| self.not_found(id))?;
        let path = self.state_path(id);
        let deadline = Instant::now() + PARSE_RETRY;
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
                Err(reason) => return Err(StoreError::Corrupt { path, reason }),
            }
        }
    }

    /// The control fields of a loop's state file, parsed alone, with no retry: `None` if the file
    /// cannot be read or does not parse right now (a writer may be half-way; its next event
    /// comes).
    pub fn read_control(&self, id: &str) -> Option<Control> {
        let dir = self.existing_dir().ok()??;
        let bytes = self.read_bytes(&dir, id).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// [`Store::read_control`] after a change that renamed files but wrote none: when the state
    /// file in place is the version this store last wrote (the same inode; a write into it would
    /// be a change of its own), that version's fields, without reading the file.
    pub fn control_after_rename(&self, id: &str) -> Option<Control> {
        let own = || {
            let seen = lock(&self.last).get(id)?.clone();
            let dir = self.existing_dir().ok()??;
            let stat = dir.stat(&state_name(id)).ok()??;
            (seen.ino == Some(stat.st_ino)).then_some(seen)
        };
        match own() {
            Some(seen) => seen
                .control
                .get_or_init(|| serde_json::from_slice(&seen.bytes).ok())
                .clone(),
            None => self.read_control(id),
        }
    }

    /// The backup of a loop's state: the last durable writes of loopd's writers (see [`backup`]).
    pub fn backup_path(&self, id: &str) -> PathBuf {
        self.path.join(backup_name(id))
    }

    /// Repairs a state file that is missing, does not load, or is older than its backup (the
    /// machine stopped before the file reached the disk): from its backup if the backup loads,
    /// else by rebuilding `skill_state` from the progress files (the seed's "State Recovery") when
    /// the rest of the file is sound. Returns why the file was refused and where it came back
    /// from, or `None` if it was fine; an error, touching nothing, if it cannot be repaired.
    pub fn restore(&self, id: &str) -> Result<Option<(String, String)>, StoreError> {
        let dir = self.state_dir(false)?;
        let path = self.state_path(id);
        let from_backup = || {
            backup::newest(&dir, &backup_name(id), MAX_STATE_SIZE)
                .map_err(|e| format!("no backup ({e})"))?
                .ok_or_else(|| "the backup is no good either (no whole record)".to_owned())
                .and_then(|bytes| {
                    Loaded::parse(&path, &bytes)
                        .map(|loaded| (bytes, loaded))
                        .map_err(|why| format!("the backup is no good either ({why})"))
                })
        };
        let missing = match self.load(id) {
            Ok(now) => {
                let Ok((bytes, backed)) = from_backup() else {
                    return Ok(None);
                };
                if !is_older(&now.state, &backed.state) {
                    return Ok(None);
                }
                let _lock = self.lock(id)?;
                if !self
                    .load(id)
                    .is_ok_and(|now| is_older(&now.state, &backed.state))
                {
                    return Ok(None);
                }
                dir.write_atomic(&state_name(id), &bytes, true)
                    .map_err(io_err(&path))?;
                let reason = format!(
                    "it was older than its last durable write, of {}: the machine stopped before \
                     the file reached the disk",
                    backed.state.updated_at.as_deref().unwrap_or("?")
                );
                return Ok(Some((reason, self.backup_path(id).display().to_string())));
            }
            Err(StoreError::Corrupt { reason, .. }) => Err(reason),
            Err(e @ StoreError::NotFound { .. }) => Ok(e),
            Err(e) => return Err(e),
        };
        if missing.is_ok() && !dir.exists(&backup_name(id)) {
            return Err(self.not_found(id));
        }
        let _lock = self.lock(id)?;
        let backup = self.backup_path(id).display().to_string();
        let (reason, bytes, from) = match (missing, from_backup()) {
            (Ok(_), Ok((bytes, _))) => ("it was missing".to_owned(), bytes, backup),
            // A loop that does not exist, and has no good backup: nothing to restore.
            (Ok(not_found), Err(_)) => return Err(not_found),
            (Err(reason), Ok((bytes, _))) => (reason, bytes, backup),
            (Err(reason), Err(no_backup)) => {
                let rebuilt = self.rebuild(&dir, id).map_err(|why| StoreError::Corrupt {
                    path: path.clone(),
                    reason: format!("{reason}; {no_backup}; cannot rebuild it: {why}"),
                })?;
                let from = format!("the progress files in {}", self.progress_dir(id).display());
                (reason, rebuilt, from)
            }
        };
        dir.write_atomic(&state_name(id), &bytes, true)
            .map_err(io_err(&path))?;
        Ok(Some((reason, from)))
    }

    /// Puts back the last version this store read or wrote in place of a state file that is
    /// missing or no longer loads, keeping what was there as `{id}.json.corrupt`. Does nothing if
    /// the file loads again by the time the lock is held; the error of the read if this store
    /// has no version of it.
    pub fn put_back(&self, id: &str) -> Result<Option<String>, StoreError> {
        let dir = self.state_dir(false)?;
        let _lock = self.lock(id)?;
        let read = self.read(id);
        let good = lock(&self.last)
            .get(id)
            .and_then(|seen| parse_object(&seen.bytes).ok());
        let Some(good) = good else {
            return read.map(|_| None);
        };
        let reason = match read {
            Ok(_) => return Ok(None),
            Err(StoreError::NotFound { .. }) => "it was deleted".to_owned(),
            Err(StoreError::Corrupt { reason, .. }) => {
                if let Ok(bytes) = self.read_bytes(&dir, id) {
                    let _ = dir.write_atomic(&format!("{id}.json.corrupt"), &bytes, false);
                }
                reason
            }
            Err(e) => return Err(e),
        };
        let mut raw = good;
        raw.insert("updated_at".into(), Value::String(now_rfc3339()));
        let bytes = to_pretty(&self.state_path(id), &Value::Object(raw))?;
        dir.write_atomic(&state_name(id), &bytes, true)
            .map_err(io_err(&self.state_path(id)))?;
        Ok(Some(reason))
    }

    /// The state file with `skill_state` rebuilt from the task list and `changes.log`.
    fn rebuild(&self, dir: &Dir, id: &str) -> Result<Vec<u8>, String> {
        let path = self.state_path(id);
        let bytes = self
            .read_bytes(dir, id)
            .map_err(|_| "the file cannot be read".to_owned())?;
        let Ok(Value::Object(mut raw)) = serde_json::from_slice::<Value>(&bytes) else {
            return Err("the file is not a JSON object".into());
        };
        // The workflow the broken part named, if it still says: its fields are its to rebuild.
        let name = raw
            .remove("skill_state")
            .and_then(|s| s.get("workflow")?.as_str().map(str::to_owned));
        let workflow = loopd_core::workflow::by_name(
            name.as_deref()
                .unwrap_or(loopd_core::workflow::ccw_loop::NAME),
        )
        .ok_or_else(|| format!("its workflow {name:?} is unknown"))?;
        let mut state: LoopState = serde_json::from_value(Value::Object(raw.clone()))
            .map_err(|e| format!("its top-level fields are broken too ({e})"))?;
        if let Some(problem) = loopd_core::workflow::problems(&state, Some(id))
            .into_iter()
            .next()
        {
            return Err(problem);
        }
        let tasks = self.read_tasks(id).map_err(|e| e.to_string())?.tasks;
        let progress = dir.subdir(&progress_name(id), false).ok();
        let read = |file: &str| {
            let bytes = progress.as_ref()?.read(file, MAX_PROGRESS_READ).ok()?;
            Some(String::from_utf8_lossy(&bytes).into_owned())
        };
        let skill = state.skill();
        skill.workflow = name;
        workflow.rebuild(skill, tasks, &read, &now_rfc3339())?;
        if let Some(problem) = loopd_core::workflow::problems(&state, Some(id))
            .into_iter()
            .next()
        {
            return Err(format!(
                "the rebuilt state would be unusable too: {problem}"
            ));
        }
        let skill = serde_json::to_value(&state.skill_state).map_err(|e| e.to_string())?;
        raw.insert("skill_state".into(), skill);
        to_pretty(&path, &Value::Object(raw)).map_err(|e| e.to_string())
    }

    /// Removes temporary files that an interrupted write left behind (under the loop's lock, so
    /// no write of another loopd is in progress), and replaced versions no living writer keeps.
    /// Returns how many were removed.
    pub fn sweep_temp_files(&self, id: &str) -> Result<usize, StoreError> {
        let dir = self.state_dir(false)?;
        // Versions another writer handed over, and nobody took: this process's now.
        let notes = format!(".{}.", state_name(id));
        for name in dir.entries().unwrap_or_default() {
            if name.starts_with(&notes) && name.ends_with(HANDOVER_SUFFIX) {
                self.adopt(&name);
            }
        }
        let _lock = self.lock(id)?;
        self.settle_locked(&dir, id, false);
        let prefix = format!(".{}.", state_name(id));
        let kept: Vec<String> = {
            let kept = lock(&self.orphans);
            let spares = kept.spares.iter().map(|(_, name)| name.clone());
            kept.orphans
                .iter()
                .map(|o| o.name.clone())
                .chain(spares)
                .collect()
        };
        let mut removed = 0;
        let progress = dir.subdir(&progress_name(id), false).ok();
        for (dir, ours) in [(Some(&dir), true), (progress.as_ref(), false)] {
            let Some(dir) = dir else { continue };
            for name in dir.entries().unwrap_or_default() {
                let temp = if ours {
                    name.starts_with(&prefix) && !kept.contains(&name)
                } else {
                    name.starts_with('.')
                };
                if temp && name.ends_with(TEMP_SUFFIX) && dir.remove(&name).is_ok() {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    /// Writes a new loop; refuses if one with that id exists.
    pub fn create(&self, state: &LoopState) -> Result<(), StoreError> {
        validate_id(&state.loop_id)?;
        let dir = self.state_dir(true)?;
        let _lock = self.lock(&state.loop_id)?;
        let path = self.state_path(&state.loop_id);
        if dir.exists(&state_name(&state.loop_id)) {
            return Err(StoreError::Exists {
                id: state.loop_id.clone(),
                path,
            });
        }
        let value = serde_json::to_value(state).map_err(|e| StoreError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let bytes = to_pretty(&path, &value)?;
        dir.write_atomic(&state_name(&state.loop_id), &bytes, true)
            .map_err(io_err(&path))
    }

    /// Read-modify-write under the lock: `change` edits the raw JSON object. Returns the new state.
    ///
    /// Writers that take no lock (the CCW dashboard rewrites the file in place) are caught: the
    /// new version is swapped in with `renameat2(RENAME_EXCHANGE)`, which hands back the version
    /// it replaced. If that is not the version the change was made on, another program wrote in
    /// between; the change is made again on top of what it wrote and swapped in once more, so its
    /// edit is kept. The replaced version is kept for a late write into it (see the module's
    /// documentation). (Where the exchange is not supported, the file is compared just before a
    /// plain rename instead, which leaves a window of microseconds.) A durable write also
    /// refreshes the backup ([`Store::backup_path`]).
    pub fn update(
        &self,
        id: &str,
        durable: bool,
        change: impl FnMut(&mut Map<String, Value>, &LoopState),
    ) -> Result<Arc<LoopState>, StoreError> {
        validate_id(id)?;
        let dir = self.existing_dir()?.ok_or_else(|| self.not_found(id))?;
        let _lock = self.lock(id)?;
        self.settle_locked(&dir, id, false);
        self.update_locked(&dir, id, durable, change)
    }

    fn update_locked(
        &self,
        dir: &Dir,
        id: &str,
        durable: bool,
        mut change: impl FnMut(&mut Map<String, Value>, &LoopState),
    ) -> Result<Arc<LoopState>, StoreError> {
        let path = self.state_path(id);
        let name = state_name(id);
        // What is in place now, and the version to make the change on (its bytes and typed
        // view: the object to change is parsed anew from the bytes, which costs no more than a
        // copy of a parse kept in memory, and a service keeps none per loop).
        let (mut in_place, mut base) = self.read(id)?;
        let mut made_on = in_place.clone();
        for round in 1.. {
            let mut raw = parse_object(&made_on).map_err(|reason| StoreError::Corrupt {
                path: path.clone(),
                reason,
            })?;
            change(&mut raw, &base);
            raw.insert("updated_at".into(), Value::String(now_rfc3339()));
            let value = Value::Object(raw);
            let bytes = to_pretty(&path, &value)?;
            // A deferred backup's fdatasync overlaps the parse and the exchange. (A round that
            // starts over records its own version after this one; a write that fails records
            // the version in place again.)
            let deferred = durable && self.defer_backup(id, &bytes);
            let not_written = |e: StoreError| {
                if deferred {
                    self.defer_backup(id, &in_place);
                }
                e
            };
            let state = LoopState::deserialize(&value).map_err(|e| {
                not_written(StoreError::Corrupt {
                    path: path.clone(),
                    reason: e.to_string(),
                })
            })?;
            drop(value);
            let state = Arc::new(state);
            // The last round writes whatever happened, rather than fail the write.
            let expected = (round < WRITE_RACE_RETRIES).then_some(in_place.as_slice());
            // Known as this store's version before it is in place: a watcher that sees it
            // renamed in need not read it (see [`Store::control_after_rename`]).
            let remember = |ino| self.remember(id, bytes.clone(), state.clone(), ino);
            let spare = self.take_spare(id);
            let replaced = swap_in(dir, &name, &bytes, expected, spare, remember)
                .map_err(|e| not_written(io_err(&path)(e)))?;
            match replaced {
                Swapped::Raced => {
                    (in_place, base) = self.read(id)?;
                    made_on = in_place.clone();
                    continue;
                }
                Swapped::Replaced { tmp, old } => {
                    let theirs = match expected {
                        Some(e) if e != old => parse_state(&path, &old).ok(),
                        _ => None,
                    };
                    if let Some(theirs) = theirs {
                        // Another writer's version, complete: start again from it.
                        tracing::debug!(
                            "another writer changed {} meanwhile; merging",
                            path.display()
                        );
                        let _ = dir.remove(&tmp);
                        in_place = bytes;
                        made_on = old;
                        base = Arc::new(theirs);
                        continue;
                    }
                    // Kept for a late write. What it held is what this write replaced; a writer
                    // half-way through it is overwriting what was in place; and a complete
                    // version another writer put there on the last round (written whatever
                    // happened) differs from the version this change was made on by that
                    // writer's changes, merged when the orphan settles.
                    let base = if old == in_place {
                        old
                    } else if parse_state(&path, &old).is_ok() {
                        made_on
                    } else {
                        in_place
                    };
                    self.keep_orphan(id, tmp, base, bytes.clone());
                }
                Swapped::Renamed => {}
            }
            if durable && !deferred {
                match backup::record(dir, &backup_name(id), &bytes) {
                    Ok(()) => self.backup_recorded(id),
                    Err(e) => self.sync_without_backup(dir, id, &e),
                }
            }
            return Ok(state);
        }
        unreachable!("the loop returns by its last round")
    }

    /// Makes the version just put in place of the state file durable when its backup (see
    /// [`backup`]) could not be written (`e`: a full disk, something planted in its place): by
    /// an fsync of the state file and of the directory.
    fn sync_without_backup(&self, dir: &Dir, id: &str, e: &io::Error) {
        if lock(&self.backup_failing).insert(id.to_owned()) {
            tracing::warn!(
                "warning: cannot write the backup {}: {e}; its state file is fsynced instead \
                 until it can",
                self.backup_path(id).display()
            );
        }
        let synced = dir
            .open_read(&state_name(id))
            .and_then(|file| file.sync_data())
            .and_then(|()| dir.sync());
        if let Err(e) = synced {
            tracing::warn!(
                "warning: cannot fsync {}: {e}",
                self.state_path(id).display()
            );
        }
    }

    fn keep_orphan(&self, id: &str, name: String, base: Vec<u8>, written: Vec<u8>) {
        let mut kept = lock(&self.orphans);
        let touched = match kept.early.iter().position(|(n, _)| *n == name) {
            Some(i) => {
                kept.early.swap_remove(i);
                true
            }
            None => false,
        };
        kept.orphans.push(Orphan {
            id: id.to_owned(),
            name,
            base,
            written,
            since: Instant::now(),
            touched,
        });
        kept.added.notify_waiters();
    }

    /// Merges late writes into this loop's replaced versions and removes the versions past their
    /// time (see the module's documentation). Returns how many late writes were merged.
    pub fn settle(&self, id: &str) -> Result<usize, StoreError> {
        if !self.has_orphans(Some(id)) {
            return Ok(0);
        }
        let dir = self.state_dir(false)?;
        let _lock = self.lock(id)?;
        Ok(self.settle_locked(&dir, id, false))
    }

    /// A watcher saw `name` (a file of the state directory) written into after it was renamed:
    /// a late write into a replaced version. Returns whether this store keeps that version (then
    /// [`Store::settle`] merges it); else it may not be kept yet, and is marked when it is.
    pub fn written_into(&self, name: &str) -> bool {
        let mut kept = lock(&self.orphans);
        if let Some(o) = kept.orphans.iter_mut().find(|o| o.name == name) {
            o.touched = true;
            return true;
        }
        kept.early.retain(|(_, at)| at.elapsed() < ORPHAN_LIFE);
        kept.early.push((name.to_owned(), Instant::now()));
        false
    }

    /// Events may have been lost: every replaced version of `id` is read at the next settle.
    pub fn touch_orphans(&self, id: &str) {
        let mut kept = lock(&self.orphans);
        kept.orphans
            .iter_mut()
            .filter(|o| o.id == id)
            .for_each(|o| o.touched = true);
    }

    /// Declares that a watcher of this process reports the writes into the replaced versions of
    /// `id` ([`Store::written_into`]) for as long as the returned value lives: a settle then reads
    /// only the versions written into and those whose time is up, not every kept version at
    /// every write.
    pub fn watch_orphans(&self, id: &str) -> OrphanWatch {
        *lock(&self.orphans)
            .watched
            .entry(id.to_owned())
            .or_default() += 1;
        OrphanWatch {
            orphans: self.orphans.clone(),
            id: id.to_owned(),
        }
    }

    /// When the oldest replaced version of `id` (of any loop, without one) this store keeps is
    /// due to be settled.
    pub fn next_settle(&self, id: Option<&str>) -> Option<Instant> {
        let kept = lock(&self.orphans);
        kept.orphans
            .iter()
            .filter(|o| id.is_none_or(|id| o.id == id))
            .map(|o| o.since + ORPHAN_LIFE)
            .min()
    }

    /// Settles the replaced versions of every loop that has some (see [`Store::settle`]).
    pub fn settle_every_loop(&self) {
        let ids: Vec<String> = {
            let kept = lock(&self.orphans);
            let mut ids: Vec<String> = kept.orphans.iter().map(|o| o.id.clone()).collect();
            ids.sort();
            ids.dedup();
            ids
        };
        for id in ids {
            let _ = self.settle(&id);
        }
    }

    /// Woken whenever a replaced version is kept in this state directory.
    pub fn orphan_kept(&self) -> Arc<tokio::sync::Notify> {
        lock(&self.orphans).added.clone()
    }

    /// Whether this store keeps replaced versions (of `id`, or of any loop).
    pub fn has_orphans(&self, id: Option<&str>) -> bool {
        lock(&self.orphans)
            .orphans
            .iter()
            .any(|o| id.is_none_or(|id| o.id == id))
    }

    /// Leaves the settled version `name` of `id` for a later write to reuse; false when enough
    /// are left already.
    fn spare(&self, id: &str, name: &str) -> bool {
        let mut kept = lock(&self.orphans);
        let room = kept.spares.iter().filter(|(of, _)| of == id).count() < MAX_SPARES;
        if room {
            kept.spares.push((id.to_owned(), name.to_owned()));
        }
        room
    }

    /// A settled version of `id` to write the next version into, if one is left.
    fn take_spare(&self, id: &str) -> Option<String> {
        let mut kept = lock(&self.orphans);
        let i = kept.spares.iter().position(|(of, _)| of == id)?;
        let name = kept.spares.swap_remove(i).1;
        // A watcher that lags this long reads the version at its settle anyway.
        kept.reusing
            .retain(|(_, since)| since.elapsed() < ORPHAN_LIFE);
        kept.reusing.push((name.clone(), Instant::now()));
        Some(name)
    }

    /// Whether `name` is a spare a write of this process is being made in: its writes are not
    /// late writes. (`renamed`: a watcher saw it renamed, into place; from then on they are.)
    pub fn reusing(&self, name: &str, renamed: bool) -> bool {
        let mut kept = lock(&self.orphans);
        let Some(i) = kept.reusing.iter().position(|(n, _)| n == name) else {
            return false;
        };
        if renamed {
            kept.reusing.swap_remove(i);
        }
        true
    }

    /// [`Store::close`] for a short-lived writer whose loops another watcher may settle: the
    /// replaced versions of a loop `settler` names [`Settler::ThisProcess`] are left to this
    /// process's watches; those of a loop it names [`Settler::Another`] are handed over to that
    /// process ([`Store::hand_over`]); the others are settled here, as `close` does. A command
    /// that wrote the state file of a loop a daemon or the service watches therefore exits as
    /// soon as its write is durable.
    pub fn close_with(&self, mut settler: impl FnMut(&str) -> Settler) {
        self.wait_durable();
        let Ok(dir) = self.state_dir(false) else {
            return;
        };
        let ids: Vec<String> = {
            let kept = lock(&self.orphans);
            let mut ids: Vec<String> = kept.orphans.iter().map(|o| o.id.clone()).collect();
            ids.sort();
            ids.dedup();
            ids
        };
        let mut left = Vec::new();
        for id in ids {
            match settler(&id) {
                Settler::Nobody => {}
                Settler::ThisProcess => {
                    self.leave(&id);
                    left.push(id);
                }
                Settler::Another => {
                    if let Ok(_lock) = self.lock(&id) {
                        self.hand_over(&dir, &id);
                    }
                }
            }
        }
        self.settle_all(&left);
    }

    /// Forgets the replaced versions of `id` this store's writes left, without settling them:
    /// another store of this process (a watch) keeps them (see [`Store::close_with`]). Its
    /// spares are removed: this writer is done.
    fn leave(&self, id: &str) {
        let Ok(dir) = self.state_dir(false) else {
            return;
        };
        let mut kept = lock(&self.orphans);
        kept.spares.retain(|(of, name)| {
            of != id || {
                let _ = dir.remove(name);
                false
            }
        });
        // The versions stay in the list this process's stores of the directory share, for its
        // watch to settle; nothing else to do.
    }

    /// Hands the replaced versions of `id` over to another process that watches the state
    /// directory: for each, a note `.{id}.json.XXXXXX.handover` says what it held when it was
    /// replaced and what replaced it, and that process keeps and settles it as its own
    /// ([`Store::adopt`]). A version whose note cannot be written stays here, to be settled
    /// before the writer exits. Called with the loop's lock held.
    fn hand_over(&self, dir: &Dir, id: &str) {
        let mine: Vec<Orphan> = {
            let mut kept = lock(&self.orphans);
            let (mine, rest) = std::mem::take(&mut kept.orphans)
                .into_iter()
                .partition(|o| o.id == id);
            kept.orphans = rest;
            kept.spares.retain(|(of, name)| {
                of != id || {
                    let _ = dir.remove(name);
                    false
                }
            });
            mine
        };
        for orphan in mine {
            let note = serde_json::json!({
                "orphan": orphan.name,
                "base": String::from_utf8_lossy(&orphan.base),
                "written": String::from_utf8_lossy(&orphan.written),
            });
            let written = serde_json::to_vec(&note)
                .map_err(io::Error::other)
                .and_then(|bytes| dir.write_atomic(&handover_name(&orphan.name), &bytes, false));
            if let Err(e) = written {
                tracing::debug!("cannot hand over {}: {e}; settling it here", orphan.name);
                lock(&self.orphans).orphans.push(orphan);
            }
        }
    }

    /// Takes over a replaced version another process handed over (its note `name`, see
    /// [`Store::hand_over`]): kept and settled as this process's own. Returns whether there was
    /// a note to take (another watch of this process may have taken it first).
    pub fn adopt(&self, name: &str) -> bool {
        let Some((id, orphan)) = handed_over(name) else {
            return false;
        };
        if validate_id(id).is_err() {
            return false;
        }
        let Ok(dir) = self.state_dir(false) else {
            return false;
        };
        let Ok(_lock) = self.lock(id) else {
            return false;
        };
        let Ok(bytes) = dir.read(name, 2 * MAX_STATE_SIZE + 4096) else {
            return false;
        };
        let _ = dir.remove(name);
        let note: Value = serde_json::from_slice(&bytes).unwrap_or_default();
        let text = |key: &str| note[key].as_str().map(|s| s.as_bytes().to_vec());
        let (Some(base), Some(written)) = (text("base"), text("written")) else {
            return false;
        };
        if note["orphan"].as_str() != Some(orphan.as_str()) || !dir.exists(&orphan) {
            return false;
        }
        self.keep_orphan(id, orphan, base, written);
        // Read at its settle whatever the events said: its writes came before this process knew
        // it.
        self.touch_orphans(id);
        true
    }

    /// Settles every replaced version before a short-lived process exits (or a loop is let go):
    /// each is kept until it is [`ORPHAN_LIFE_SHORT`] old, then merged if written into, else
    /// removed, with the spares left for reuse.
    pub fn close(&self) {
        self.wait_durable();
        self.settle_all(&[]);
    }

    /// Settles the replaced versions of every loop but those of `except`, waiting for them
    /// (see [`Store::close`]).
    fn settle_all(&self, except: &[String]) {
        // A merge writes a new version, itself kept: a few rounds settle everything.
        for _ in 0..WRITE_RACE_RETRIES {
            // The loops with kept versions or spares, and when the youngest version was kept.
            let (ids, youngest) = {
                let kept = lock(&self.orphans);
                let mine = |id: &String| !except.contains(id);
                let mut ids: Vec<String> = kept
                    .orphans
                    .iter()
                    .map(|o| o.id.clone())
                    .chain(kept.spares.iter().map(|(id, _)| id.clone()))
                    .filter(mine)
                    .collect();
                ids.sort();
                ids.dedup();
                let youngest = kept
                    .orphans
                    .iter()
                    .filter(|o| mine(&o.id))
                    .map(|o| o.since)
                    .max();
                (ids, youngest)
            };
            if ids.is_empty() {
                return;
            }
            if let Some(youngest) = youngest {
                std::thread::sleep(ORPHAN_LIFE_SHORT.saturating_sub(youngest.elapsed()));
            }
            let Ok(dir) = self.state_dir(false) else {
                return;
            };
            for id in ids {
                if let Ok(_lock) = self.lock(&id) {
                    self.settle_locked(&dir, &id, true);
                }
            }
        }
    }

    /// [`Store::settle`] with the lock held; `all` removes every unwritten version, whatever its
    /// age.
    fn settle_locked(&self, dir: &Dir, id: &str, all: bool) -> usize {
        // Looked at without taking them off the list, which another thread may read meanwhile.
        // Where a watcher reports the writes into them, only those written into and those settled
        // (their time is up, or nothing has them open) are read.
        let (watched, mine) = {
            let mut kept = lock(&self.orphans);
            let watched = !all && kept.watched.contains_key(id);
            let mine: Vec<Orphan> = kept
                .orphans
                .iter_mut()
                .filter(|o| o.id == id)
                .filter(|o| !watched || o.touched || o.since.elapsed() >= ORPHAN_LIFE_SHORT)
                .map(|o| {
                    let seen = o.clone();
                    o.touched = false;
                    seen
                })
                .collect();
            (watched, mine)
        };
        if mine.is_empty() {
            return 0;
        }
        let path = self.state_path(id);
        let mut late = Vec::new();
        let mut done = Vec::new();
        for orphan in mine {
            let Orphan {
                name,
                base,
                written,
                since,
                touched,
                ..
            } = orphan;
            let age = since.elapsed();
            let Ok(file) = dir.open_read(&name) else {
                done.push(name); // gone, or made into something else: nothing to merge
                continue;
            };
            // Open nowhere else (`Some(false)`): no writer is half-way through it, and none that
            // opened the state file before it was replaced can still come, once it is older than
            // such an open takes.
            let elsewhere = loopd_fs::open_elsewhere(&file);
            let settled =
                all || age >= ORPHAN_LIFE || (elsewhere == Some(false) && age >= ORPHAN_LIFE_SHORT);
            // Under a watcher, a version not reported written into is read once it is settled.
            if watched && !touched && !settled {
                continue;
            }
            let read = || dir.read(&name, MAX_STATE_SIZE).ok();
            let Ok(mut now) = loopd_fs::read_capped(file, MAX_STATE_SIZE) else {
                done.push(name);
                continue;
            };
            // A writer is half-way through it (it truncated the file, and is descheduled before
            // its write): one that must settle now gives it the orphan's life to finish.
            while all
                && elsewhere != Some(false)
                && now != base
                && serde_json::from_slice::<Value>(&now).is_err()
                && since.elapsed() < ORPHAN_LIFE
            {
                std::thread::sleep(Duration::from_millis(5));
                now = read().unwrap_or_default();
            }
            if now == base {
                if settled {
                    // One still open elsewhere is not written into again.
                    if all || elsewhere == Some(true) || !self.spare(id, &name) {
                        let _ = dir.remove(&name);
                    }
                    done.push(name);
                }
                continue;
            }
            match serde_json::from_slice::<Value>(&now) {
                Ok(Value::Object(theirs)) => {
                    late.push((base, theirs, written));
                    let _ = dir.remove(&name);
                    done.push(name);
                }
                // Still being written.
                _ if !settled => {}
                _ => {
                    tracing::warn!(
                        "warning: a late write into a replaced version of {} never completed; dropped",
                        path.display()
                    );
                    let _ = dir.remove(&name);
                    done.push(name);
                }
            }
        }
        {
            let mut kept = lock(&self.orphans);
            kept.orphans.retain(|o| !done.contains(&o.name));
            if all {
                kept.spares.retain(|(of, name)| {
                    of != id || {
                        let _ = dir.remove(name);
                        false
                    }
                });
            }
        }
        let mut merged = 0;
        for (base, theirs, written) in late {
            let object = |bytes: &[u8]| match serde_json::from_slice::<Value>(bytes) {
                Ok(Value::Object(map)) => map,
                _ => Map::new(),
            };
            let (base, written) = (object(&base), object(&written));
            let changed = changed_keys(&base, &theirs);
            if changed.is_empty() {
                continue;
            }
            // A key someone changed in the state file since it replaced this version is theirs to
            // keep: a late write into a replaced version was begun before the exchange, so a
            // writer's later write of the same key went to the state file after it. (File times
            // cannot say which came first: they tick by the jiffy, and a file loopd renames in
            // bears its own time.)
            tracing::debug!(
                "a late write into a replaced version of {} changed {changed:?}; merging",
                path.display()
            );
            let result = self.update_locked(dir, id, true, |raw, _| {
                for key in &changed {
                    if raw.get(key) != written.get(key) {
                        continue;
                    }
                    match theirs.get(key) {
                        Some(v) => raw.insert(key.clone(), v.clone()),
                        None => raw.remove(key),
                    };
                }
            });
            match result {
                Ok(_) => merged += 1,
                Err(e) => tracing::warn!(
                    "warning: cannot merge a late write into {}: {e}",
                    path.display()
                ),
            }
        }
        merged
    }

    /// The daemon's write: re-reads the file and replaces only the daemon's own fields with those of
    /// `ours`, then makes `transition` if the file's status still allows it.
    pub fn commit(
        &self,
        ours: &LoopState,
        transition: Option<&Transition>,
        durable: bool,
    ) -> Result<Arc<LoopState>, StoreError> {
        self.commit_with(ours, transition, None, durable)
    }

    /// [`Store::commit`] that also takes an interactive choice: `next_action` is removed if it
    /// still holds `choice` (a controller may have written a new one since).
    pub fn commit_with(
        &self,
        ours: &LoopState,
        transition: Option<&Transition>,
        choice: Option<&str>,
        durable: bool,
    ) -> Result<Arc<LoopState>, StoreError> {
        let ours_value = daemon_fields(ours).map_err(|e| StoreError::Corrupt {
            path: self.state_path(&ours.loop_id),
            reason: e.to_string(),
        })?;
        let mut first = Some(ours_value);
        self.update(&ours.loop_id, durable, |raw, current| {
            // The first round moves the daemon's fields in; a round that starts over (another
            // writer changed the file meanwhile) makes them again.
            let Some(mut fields) = first.take().or_else(|| daemon_fields(ours).ok()) else {
                return;
            };
            for key in DAEMON_FIELDS {
                match fields.remove(*key) {
                    Some(mut v) => {
                        // Cleared by the daemon: not to be kept as another writer's.
                        let cleared: Vec<&str> = match (&v, *key) {
                            (Value::Object(ours), "skill_state") => CLEARABLE_SKILL_KEYS
                                .iter()
                                .copied()
                                .filter(|k| !ours.contains_key(*k))
                                .collect(),
                            _ => Vec::new(),
                        };
                        if let Some(theirs) = raw.get(*key) {
                            keep_unknown(theirs, &mut v);
                        }
                        if let Value::Object(merged) = &mut v {
                            for k in cleared {
                                merged.remove(k);
                            }
                        }
                        raw.insert((*key).to_owned(), v)
                    }
                    None => raw.remove(*key),
                };
            }
            if let Some(t) = transition
                && t.from.contains(&current.status)
            {
                raw.insert("status".into(), Value::String(t.to.as_str().to_owned()));
                if let Some(reason) = &t.failure_reason {
                    raw.insert("failure_reason".into(), Value::String(reason.clone()));
                }
                if t.completed_at {
                    raw.insert("completed_at".into(), Value::String(now_rfc3339()));
                }
            }
            if choice.is_some() && current.next_action.as_deref() == choice {
                raw.remove("next_action");
            }
        })
    }
}

/// The top-level keys a lockless writer changed from `base` in `theirs`, but for the daemon's own
/// fields and `updated_at`.
/// Whether `state` is older than `backed`, a version a durable write recorded in the backup: the
/// later `updated_at` (every loopd writer sets it) is the newer.
fn is_older(state: &LoopState, backed: &LoopState) -> bool {
    let time = |s: &LoopState| {
        s.updated_at
            .as_deref()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
    };
    match (time(state), time(backed)) {
        (Some(now), Some(then)) => now < then,
        _ => false,
    }
}

fn changed_keys(base: &Map<String, Value>, theirs: &Map<String, Value>) -> Vec<String> {
    let mut keys: Vec<String> = base
        .keys()
        .chain(theirs.keys())
        .filter(|k| !DAEMON_FIELDS.contains(&k.as_str()) && *k != "updated_at")
        .filter(|k| base.get(*k) != theirs.get(*k))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// Who settles a loop's replaced versions once a short-lived writer is done with them (see
/// [`Store::close_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settler {
    /// The writer itself, before it exits.
    Nobody,
    /// A watch of this process.
    ThisProcess,
    /// Another process that watches the state directory: a daemon of the loop, or the service.
    Another,
}

/// The hand-over note of the replaced version `orphan` (`.{id}.json.XXXXXX.tmp`).
fn handover_name(orphan: &str) -> String {
    format!(
        "{}{HANDOVER_SUFFIX}",
        orphan.strip_suffix(TEMP_SUFFIX).unwrap_or(orphan)
    )
}

/// The suffix of a hand-over note.
pub const HANDOVER_SUFFIX: &str = ".handover";

/// The loop and the replaced version a hand-over note names, from its name alone.
fn handed_over(name: &str) -> Option<(&str, String)> {
    let stem = name.strip_prefix('.')?.strip_suffix(HANDOVER_SUFFIX)?;
    let (id, _) = stem.split_once(".json.")?;
    (!stem.contains('/')).then(|| (id, format!(".{stem}{TEMP_SUFFIX}")))
}

fn state_name(id: &str) -> String {
    format!("{id}.json")
}

fn backup_name(id: &str) -> String {
    format!("{id}.json.bak")
}

fn progress_name(id: &str) -> String {
    format!("{id}.progress")
}

/// Copies into `ours` what `theirs` has and `ours` does not know: keys missing from an object
/// (at any depth) and, in lists of objects with an `id`, the unknown keys of the element with the
/// same id. Every known key is always in `ours`, so nothing the daemon dropped comes back.
pub fn keep_unknown(theirs: &Value, ours: &mut Value) {
    match (theirs, ours) {
        (Value::Object(t), Value::Object(o)) => {
            for (key, tv) in t {
                match o.get_mut(key) {
                    Some(ov) => keep_unknown(tv, ov),
                    None => {
                        o.insert(key.clone(), tv.clone());
                    }
                }
            }
        }
        (Value::Array(t), Value::Array(o)) => {
            for ov in o.iter_mut() {
                let Some(id) = ov.get("id").filter(|id| id.is_string()).cloned() else {
                    continue;
                };
                if let Some(tv) = t.iter().find(|tv| tv.get("id") == Some(&id)) {
                    keep_unknown(tv, ov);
                }
            }
        }
        _ => {}
    }
}

fn to_pretty(path: &Path, value: &Value) -> Result<Vec<u8>, StoreError> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(|e| StoreError::Corrupt {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// What [`swap_in`] replaced.
enum Swapped {
    /// The replaced version, now named `tmp`, and what it held just after the exchange.
    Replaced { tmp: String, old: Vec<u8> },
    /// Not known (plain rename), but the file was as expected just before.
    Renamed,
    /// Nothing was written: the file changed before a plain rename could be made.
    Raced,
}

/// Puts `bytes` in place of `name` atomically: a new temp file in the same directory (mode 0600,
/// made of `spare` if given: see [`Dir::open_existing_rw`]), exchanged with `name`, without fsync
/// (a durable write is made durable by its backup: see [`backup`]). `expected` is what should be
/// in place; `None` writes whatever is there. `written` is told the new version's inode once it
/// is written, before it is put in place. Returns what was replaced.
///
/// The exchange (`renameat2(RENAME_EXCHANGE)`) hands back exactly what it replaced, under the
/// temp file's name: a reader that opened the old version still reads it whole. (A version is
/// written into again only as a spare, once it has been settled: [`ORPHAN_LIFE`] after it stopped
/// being the state file.)
fn swap_in(
    dir: &Dir,
    name: &str,
    bytes: &[u8],
    expected: Option<&[u8]>,
    spare: Option<String>,
    written: impl FnOnce(Option<u64>),
) -> io::Result<Swapped> {
    use std::os::unix::fs::MetadataExt as _;
    // Written under its own name: the watcher knows it as a spare being reused.
    let reused = spare.and_then(|spare| match dir.open_existing_rw(&spare) {
        Ok(file) => Some((spare, file)),
        Err(_) => {
            let _ = dir.remove(&spare);
            None
        }
    });
    let (tmp, file) = match reused {
        Some(reused) => reused,
        None => dir.temp_file(name)?,
    };
    let done = loopd_fs::overwrite(&file, bytes);
    let ino = file.metadata().ok().map(|m| m.ino());
    drop(file);
    if let Err(e) = done {
        let _ = dir.remove(&tmp);
        return Err(e);
    }
    written(ino);
    let swapped = match dir.exchange(&tmp, name) {
        Ok(()) => {
            let old = dir.read(&tmp, MAX_STATE_SIZE).unwrap_or_default();
            Swapped::Replaced { tmp, old }
        }
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {
            // No exchange here (another kernel or filesystem): compare, then a plain rename.
            if let Some(expected) = expected
                && !dir
                    .read(name, MAX_STATE_SIZE)
                    .is_ok_and(|now| now == expected)
            {
                let _ = dir.remove(&tmp);
                return Ok(Swapped::Raced);
            }
            if let Err(e) = dir.rename(&tmp, name) {
                let _ = dir.remove(&tmp);
                return Err(e);
            }
            Swapped::Renamed
        }
        Err(e) => {
            let _ = dir.remove(&tmp);
            return Err(e);
        }
    };
    Ok(swapped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::io::Write as _;

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

    /// The temporary files of a directory.
    fn temp_files(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(TEMP_SUFFIX))
            .collect()
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
        let done = Transition {
            from: &[Status::Running],
            to: Status::Completed,
            failure_reason: None,
            completed_at: true,
        };
        let after = store.commit(&state, Some(&done), true).unwrap();
        assert_eq!(after.status, Status::Paused);
        assert_eq!(after.title, "new");
        assert_eq!(store.load("l1").unwrap().raw["notes"], "mine");
        assert_eq!(after.current_iteration, 4);
        assert!(after.completed_at.is_none());
    }
}
