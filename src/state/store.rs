//! Where loop files live and how they are read and written.
//!
//! Theory of operation: every writer (the daemon, the CLI's control commands) changes a state file
//! by read-modify-write under an exclusive `flock` on the sidecar `{id}.lock`, which is never
//! renamed or deleted, so the lock and the file it guards cannot come apart. The new version is
//! written to a temporary file in the same directory (`.{id}.json.XXXXXX.tmp`, mode 0600) and
//! exchanged with the state file (`renameat2(RENAME_EXCHANGE)`, else a plain rename): a reader
//! sees the old file or the new one, never a mix. Durable writes also fsync the file before and
//! the directory after the exchange, and refresh the backup `{id}.json.bak`.
//!
//! The daemon never writes a copy of the whole state: [`Store::commit`] re-reads the file under the
//! lock and replaces only the fields the daemon owns ([`DAEMON_FIELDS`]), plus a status transition
//! the daemon itself makes, and only from the status it expects. A control field written by anyone
//! else in the meantime therefore survives.
//!
//! Writers that do not take the lock (the CCW dashboard truncates and rewrites the file in place)
//! can be seen half-way; a read that does not parse is retried for a moment before the file is
//! called corrupt. Their writes are not lost to ours either: see [`Store::update`].

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use super::model::{Control, DevelopTask, LoopState, Status, TaskStatus, now_rfc3339};

/// Top-level fields the daemon owns and writes back from its own copy.
pub const DAEMON_FIELDS: &[&str] = &["current_iteration", "skill_state"];

/// How long a writer waits for the lock before giving up.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a read retries a file that does not parse (another writer may be half-way).
const PARSE_RETRY: Duration = Duration::from_millis(250);
/// A state file larger than this is refused rather than read.
pub const MAX_STATE_SIZE: u64 = 16 << 20;
/// How often a read-modify-write starts over when a writer that takes no lock changed the file
/// under it.
const WRITE_RACE_RETRIES: usize = 5;

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
        )
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Checks a loop id: `^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`.
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
        let value: Value = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        let Value::Object(raw) = value else {
            return Err("not a JSON object".to_owned());
        };
        let state: LoopState =
            serde_json::from_value(Value::Object(raw.clone())).map_err(|e| e.to_string())?;
        let id = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"));
        if let Some(problem) = state.problems(id).into_iter().next() {
            return Err(problem);
        }
        Ok(Loaded { raw, state })
    }
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
    dir: PathBuf,
    /// The last version of each state file this store read or wrote, bytes and parse: a read
    /// that finds the same bytes again skips the parse.
    last: Arc<Mutex<HashMap<String, Arc<Seen>>>>,
}

/// A version of a state file, and its parse.
#[derive(Debug)]
struct Seen {
    bytes: Vec<u8>,
    loaded: Loaded,
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

fn lock_file(path: &Path) -> io::Result<Rc<File>> {
    LOCK_FILES.with(|files| {
        if let Some(file) = files.borrow().get(path) {
            return Ok(file.clone());
        }
        let file = Rc::new(
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(path)?,
        );
        files.borrow_mut().insert(path.to_owned(), file.clone());
        Ok(file)
    })
}

impl Store {
    pub fn new(dir: impl Into<PathBuf>) -> Store {
        Store {
            dir: dir.into(),
            last: Arc::default(),
        }
    }

    /// The parse of `bytes` if they are the last version seen of `id`.
    fn remembered(&self, id: &str, bytes: &[u8]) -> Option<Loaded> {
        let last = self.last.lock().ok()?;
        let seen = last.get(id)?;
        (seen.bytes == bytes).then(|| seen.loaded.clone())
    }

    fn remember(&self, id: &str, bytes: Vec<u8>, loaded: &Loaded) {
        if let Ok(mut last) = self.last.lock() {
            let loaded = loaded.clone();
            last.insert(id.to_owned(), Arc::new(Seen { bytes, loaded }));
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn state_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    pub fn lock_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.lock"))
    }

    /// Held by a daemon for its whole life: "a daemon drives this loop".
    pub fn daemon_lock_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.daemon"))
    }

    pub fn progress_dir(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.progress"))
    }

    /// The task list: `{id}.tasks.jsonl`, else the CCW dashboard's `{id}/tasks.jsonl`.
    pub fn tasks_path(&self, id: &str) -> PathBuf {
        let flat = self.dir.join(format!("{id}.tasks.jsonl"));
        let nested = self.dir.join(id).join("tasks.jsonl");
        if !flat.exists() && nested.exists() {
            nested
        } else {
            flat
        }
    }

    /// Every loop id in the directory, sorted.
    pub fn list_ids(&self) -> Result<Vec<String>, StoreError> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(&self.dir)(e)),
        };
        let mut ids: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
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
        let path = self.lock_path(id);
        let file = lock_file(&path).map_err(io_err(&path))?;
        let deadline = Instant::now() + LOCK_TIMEOUT;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(WriteLock { file }),
                Err(fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(fs::TryLockError::WouldBlock) => return Err(StoreError::Locked { path }),
                Err(fs::TryLockError::Error(e)) => return Err(io_err(&path)(e)),
            }
        }
    }

    /// Reads and parses a loop's state file.
    pub fn load(&self, id: &str) -> Result<Loaded, StoreError> {
        self.read(id).map(|(_, loaded)| loaded)
    }

    /// The state file's bytes and their parse. Refused: a file over [`MAX_STATE_SIZE`], a symlink
    /// that leads out of the state directory, and (after a short retry, in case another program
    /// is half-way through rewriting it) a file that does not parse or fails validation.
    fn read(&self, id: &str) -> Result<(Vec<u8>, Loaded), StoreError> {
        validate_id(id)?;
        let path = self.state_path(id);
        let corrupt = |reason: String| StoreError::Corrupt {
            path: path.clone(),
            reason,
        };
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound {
                    id: id.to_owned(),
                    path,
                });
            }
            Err(e) => return Err(io_err(&path)(e)),
        };
        if meta.file_type().is_symlink() {
            let target = fs::canonicalize(&path).map_err(io_err(&path))?;
            let dir = fs::canonicalize(&self.dir).map_err(io_err(&self.dir))?;
            if !target.starts_with(&dir) {
                return Err(corrupt(format!(
                    "a symlink to {}, outside the state directory",
                    target.display()
                )));
            }
        }
        let deadline = Instant::now() + PARSE_RETRY;
        loop {
            let bytes = match read_capped(&path) {
                Ok(bytes) => bytes,
                Err(e) if e.kind() == io::ErrorKind::FileTooLarge => {
                    return Err(corrupt(format!(
                        "{e}, over the {} MiB limit",
                        MAX_STATE_SIZE >> 20
                    )));
                }
                Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                    return Err(corrupt(e.to_string()));
                }
                Err(e) => return Err(io_err(&path)(e)),
            };
            if let Some(loaded) = self.remembered(id, &bytes) {
                return Ok((bytes, loaded));
            }
            match Loaded::parse(&path, &bytes) {
                Ok(loaded) => {
                    self.remember(id, bytes.clone(), &loaded);
                    return Ok((bytes, loaded));
                }
                // Another program may be half-way through rewriting the file in place.
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                Err(reason) => return Err(corrupt(reason)),
            }
        }
    }

    /// The control fields of a loop's state file, parsed alone, with no retry: `None` if the file
    /// cannot be read or does not parse right now (a writer may be half-way; its next event
    /// comes).
    pub fn read_control(&self, id: &str) -> Option<Control> {
        let bytes = read_capped(&self.state_path(id)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// The backup of a loop's state: a copy of the last durable write of a loopd writer.
    pub fn backup_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json.bak"))
    }

    /// Repairs a state file that does not load: from its backup if the backup loads, else by
    /// rebuilding `skill_state` from the progress files (the seed's "State Recovery") when the
    /// rest of the file is sound. Returns why the file was refused and where it came back from,
    /// or `None` if it was fine; an error, touching nothing, if it cannot be repaired.
    pub fn restore(&self, id: &str) -> Result<Option<(String, String)>, StoreError> {
        let reason = match self.load(id) {
            Ok(_) => return Ok(None),
            Err(StoreError::Corrupt { reason, .. }) => reason,
            Err(e) => return Err(e),
        };
        let _lock = self.lock(id)?;
        let path = self.state_path(id);
        let backup = self.backup_path(id);
        let from_backup = read_capped(&backup)
            .map_err(|e| format!("no backup ({e})"))
            .and_then(|bytes| {
                Loaded::parse(&path, &bytes)
                    .map(|_| bytes)
                    .map_err(|why| format!("the backup is no good either ({why})"))
            });
        let (bytes, from) = match from_backup {
            Ok(bytes) => (bytes, backup.display().to_string()),
            Err(no_backup) => {
                let rebuilt = self.rebuild(id).map_err(|why| StoreError::Corrupt {
                    path: path.clone(),
                    reason: format!("{reason}; {no_backup}; cannot rebuild it: {why}"),
                })?;
                (
                    rebuilt,
                    format!("the progress files in {}", self.progress_dir(id).display()),
                )
            }
        };
        write_atomic(&path, &bytes, true).map_err(io_err(&path))?;
        Ok(Some((reason, from)))
    }

    /// The state file with `skill_state` rebuilt from the task list and `changes.log`.
    fn rebuild(&self, id: &str) -> Result<Vec<u8>, String> {
        let path = self.state_path(id);
        let bytes = read_capped(&path).map_err(|e| e.to_string())?;
        let Ok(Value::Object(mut raw)) = serde_json::from_slice::<Value>(&bytes) else {
            return Err("the file is not a JSON object".into());
        };
        raw.remove("skill_state");
        let mut state: LoopState = serde_json::from_value(Value::Object(raw.clone()))
            .map_err(|e| format!("its top-level fields are broken too ({e})"))?;
        if let Some(problem) = state.problems(Some(id)).into_iter().next() {
            return Err(problem);
        }
        let (mut tasks, _) = self.read_tasks(id).map_err(|e| e.to_string())?;
        let changes =
            fs::read_to_string(self.progress_dir(id).join("changes.log")).unwrap_or_default();
        for line in changes.lines() {
            let Ok(change) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let (Some(task_id), Some(result)) =
                (change["task_id"].as_str(), change["result"].as_str())
            else {
                continue;
            };
            let status = match result {
                "completed" => TaskStatus::Completed,
                "failed" => TaskStatus::Failed,
                _ => continue,
            };
            let position = tasks
                .iter()
                .position(|t| t.id == task_id)
                .unwrap_or_else(|| {
                    tasks.push(DevelopTask {
                        id: task_id.to_owned(),
                        description: change["description"].as_str().unwrap_or("").to_owned(),
                        ..DevelopTask::default()
                    });
                    tasks.len() - 1
                });
            let task = &mut tasks[position];
            task.status = status;
            task.completed_at = change["timestamp"].as_str().map(str::to_owned);
            if let Ok(files) = serde_json::from_value(change["files_changed"].clone()) {
                task.files_changed = files;
            }
        }
        let skill = state.skill();
        skill.initialized_at = (!tasks.is_empty()).then(now_rfc3339);
        skill.develop.tasks = tasks;
        skill.develop.recount();
        if let Some(problem) = state.problems(Some(id)).into_iter().next() {
            return Err(format!(
                "the rebuilt state would be unusable too: {problem}"
            ));
        }
        let skill = serde_json::to_value(&state.skill_state).map_err(|e| e.to_string())?;
        raw.insert("skill_state".into(), skill);
        to_pretty(&path, &Value::Object(raw)).map_err(|e| e.to_string())
    }

    /// Removes temporary files that an interrupted write left behind (under the loop's lock, so
    /// no write of another loopd is in progress). Returns how many were removed.
    pub fn sweep_temp_files(&self, id: &str) -> Result<usize, StoreError> {
        let _lock = self.lock(id)?;
        let prefix = format!(".{id}.json.");
        let mut removed = 0;
        for dir in [self.dir.clone(), self.progress_dir(id)] {
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.filter_map(Result::ok) {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                let ours = if dir == self.dir {
                    name.starts_with(&prefix)
                } else {
                    name.starts_with('.')
                };
                if ours && name.ends_with(TEMP_SUFFIX) && fs::remove_file(entry.path()).is_ok() {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    /// Writes a new loop; refuses if one with that id exists.
    pub fn create(&self, state: &LoopState) -> Result<(), StoreError> {
        validate_id(&state.loop_id)?;
        fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        let _lock = self.lock(&state.loop_id)?;
        let path = self.state_path(&state.loop_id);
        if path.exists() {
            return Err(StoreError::Exists {
                id: state.loop_id.clone(),
                path,
            });
        }
        let value = serde_json::to_value(state).map_err(|e| StoreError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        write_json(&path, &value, true)
    }

    /// Read-modify-write under the lock: `change` edits the raw JSON object. Returns the new state.
    ///
    /// Writers that take no lock (the CCW dashboard rewrites the file in place) are caught: the
    /// new version is swapped in with `renameat2(RENAME_EXCHANGE)`, which hands back the version
    /// it replaced. If that is not the version the change was made on, another program wrote in
    /// between; the change is made again on top of what it wrote and swapped in once more, so its
    /// edit is kept. (Where the exchange is not supported, the file is compared just before a
    /// plain rename instead, which leaves a window of microseconds.) A durable write also
    /// refreshes the backup ([`Store::backup_path`]).
    pub fn update(
        &self,
        id: &str,
        durable: bool,
        mut change: impl FnMut(&mut Map<String, Value>, &LoopState),
    ) -> Result<Loaded, StoreError> {
        let _lock = self.lock(id)?;
        let path = self.state_path(id);
        // What is in place now, and the version to make the change on.
        let (mut in_place, mut base) = self.read(id)?;
        for round in 1.. {
            let Loaded { mut raw, state } = base;
            change(&mut raw, &state);
            raw.insert("updated_at".into(), Value::String(now_rfc3339()));
            let value = Value::Object(raw);
            let bytes = to_pretty(&path, &value)?;
            // The last round writes whatever happened, rather than fail the write.
            let expected = (round < WRITE_RACE_RETRIES).then_some(in_place.as_slice());
            let replaced = swap_in(&path, &bytes, durable, expected).map_err(io_err(&path))?;
            match replaced {
                Swapped::Raced => {
                    (in_place, base) = self.read(id)?;
                    continue;
                }
                Swapped::Replaced(other) if expected.is_some_and(|e| e != other) => {
                    match Loaded::parse(&path, &other) {
                        Ok(theirs) => {
                            tracing::debug!(
                                "another writer changed {} meanwhile; merging",
                                path.display()
                            );
                            in_place = bytes;
                            base = theirs;
                            continue;
                        }
                        Err(why) => tracing::warn!(
                            "warning: another writer left {} unreadable meanwhile ({why}); kept this write",
                            path.display()
                        ),
                    }
                }
                _ => {}
            }
            if durable {
                // A copy, not a link: a writer that truncates the state file in place must not
                // reach the backup. Written in place, without fsync: it is only read when the
                // state file was spoilt, which a crash cannot do (only another program can), and
                // a torn backup is refused when read.
                let backup = self.backup_path(id);
                if let Err(e) = write_in_place(&backup, &bytes) {
                    tracing::warn!("warning: cannot write the backup {}: {e}", backup.display());
                }
            }
            let Value::Object(raw) = value else {
                unreachable!("built as an object")
            };
            let state = serde_json::from_value(Value::Object(raw.clone())).map_err(|e| {
                StoreError::Corrupt {
                    path: path.clone(),
                    reason: e.to_string(),
                }
            })?;
            let loaded = Loaded { raw, state };
            self.remember(id, bytes, &loaded);
            return Ok(loaded);
        }
        unreachable!("the loop returns by its last round")
    }

    /// The daemon's write: re-reads the file and replaces only the daemon's own fields with those of
    /// `ours`, then makes `transition` if the file's status still allows it.
    pub fn commit(
        &self,
        ours: &LoopState,
        transition: Option<&Transition>,
        durable: bool,
    ) -> Result<Loaded, StoreError> {
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
    ) -> Result<Loaded, StoreError> {
        let ours_value = serde_json::to_value(ours).map_err(|e| StoreError::Corrupt {
            path: self.state_path(&ours.loop_id),
            reason: e.to_string(),
        })?;
        self.update(&ours.loop_id, durable, |raw, current| {
            for key in DAEMON_FIELDS {
                match ours_value.get(*key) {
                    Some(v) => {
                        let mut v = v.clone();
                        if let Some(theirs) = raw.get(*key) {
                            keep_unknown(theirs, &mut v);
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

    /// Reads the task list written by the API/CLI (`{id}.tasks.jsonl` or `{id}/tasks.jsonl`), in
    /// `order`. Lines that do not parse are returned as warnings, never silently dropped.
    pub fn read_tasks(&self, id: &str) -> Result<(Vec<DevelopTask>, Vec<String>), StoreError> {
        let path = self.tasks_path(id);
        let text = match fs::read(&path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), Vec::new())),
            Err(e) => return Err(io_err(&path)(e)),
        };
        Ok(parse_tasks(&path, &text))
    }

    /// Appends tasks to `{id}.tasks.jsonl` under the lock, each line ending in a newline.
    pub fn append_tasks(&self, id: &str, lines: &[Value]) -> Result<(), StoreError> {
        let _lock = self.lock(id)?;
        let path = self.dir.join(format!("{id}.tasks.jsonl"));
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io_err(&path))?;
        // A previous writer may have left the last line without its newline.
        let len = file.metadata().map_err(io_err(&path))?.len();
        let mut out = String::new();
        if len > 0 && !ends_with_newline(&path)? {
            out.push('\n');
        }
        for line in lines {
            out.push_str(&line.to_string());
            out.push('\n');
        }
        file.write_all(out.as_bytes()).map_err(io_err(&path))
    }
}

fn ends_with_newline(path: &Path) -> Result<bool, StoreError> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = File::open(path).map_err(io_err(path))?;
    file.seek(SeekFrom::End(-1)).map_err(io_err(path))?;
    let mut last = [0u8; 1];
    file.read_exact(&mut last).map_err(io_err(path))?;
    Ok(last[0] == b'\n')
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

/// Parses NDJSON task records (the CCW dashboard's `LoopTask`). Two records glued on one line (a
/// known defect of the dashboard's writer) are both recovered.
pub fn parse_tasks(path: &Path, text: &str) -> (Vec<DevelopTask>, Vec<String>) {
    // Each record with the place it came from: line, and index within the line.
    let mut records: Vec<(usize, usize, Map<String, Value>)> = Vec::new();
    let mut warnings = Vec::new();
    for (lineno, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let stream = serde_json::Deserializer::from_str(line).into_iter::<Value>();
        for (k, value) in stream.enumerate() {
            match value {
                Ok(Value::Object(map)) => records.push((lineno + 1, k, map)),
                Ok(other) => warnings.push(format!(
                    "{}:{}: a task must be a JSON object, not {other}",
                    path.display(),
                    lineno + 1
                )),
                Err(e) => {
                    warnings.push(format!("{}:{}: {e}", path.display(), lineno + 1));
                    break;
                }
            }
        }
    }
    // Stable: records without an `order` keep their place after those with one.
    let order = |m: &Map<String, Value>| m.get("order").and_then(Value::as_f64);
    records.sort_by(|(_, _, a), (_, _, b)| match (order(a), order(b)) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        (a, b) => b.is_some().cmp(&a.is_some()),
    });
    let now = now_rfc3339();
    let mut seen = std::collections::HashSet::new();
    let mut tasks = Vec::new();
    for (lineno, k, map) in records {
        let text_field = |key: &str| {
            map.get(key)
                .and_then(Value::as_str)
                .filter(|s| !s.trim().is_empty())
                .map(str::to_owned)
        };
        // A record without an id is named by where it stands, which appending never changes.
        let place = if k == 0 {
            format!("jsonl-{lineno}")
        } else {
            format!("jsonl-{lineno}-{k}")
        };
        let id = text_field("task_id")
            .or_else(|| text_field("id"))
            .unwrap_or(place);
        if !seen.insert(id.clone()) {
            warnings.push(format!(
                "{}:{lineno}: task id {id:?} appears again; this record is skipped",
                path.display()
            ));
            continue;
        }
        let mut extra = Map::new();
        if let Some(order) = map.get("order") {
            extra.insert("order".into(), order.clone());
        }
        tasks.push(DevelopTask {
            id,
            description: text_field("description")
                .or_else(|| text_field("title"))
                .unwrap_or_default(),
            tool: text_field("tool"),
            mode: text_field("mode"),
            created_at: Some(text_field("created_at").unwrap_or_else(|| now.clone())),
            extra,
            ..DevelopTask::default()
        });
    }
    (tasks, warnings)
}

/// Writes pretty JSON atomically: temp file in the same directory, rename; `durable` adds fsync of
/// the file before and of the directory after the rename.
pub fn write_json(path: &Path, value: &Value, durable: bool) -> Result<(), StoreError> {
    let bytes = to_pretty(path, value)?;
    write_atomic(path, &bytes, durable).map_err(io_err(path))
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
    /// This version, handed back by the exchange.
    Replaced(Vec<u8>),
    /// Not known (plain rename), but the file was as expected just before.
    Renamed,
    /// Nothing was written: the file changed before a plain rename could be made.
    Raced,
}

/// Puts `bytes` in place of `path` atomically: a new temp file in the same directory (mode
/// 0600), fsync if `durable`, exchanged with `path`, fsync of the directory if `durable`.
/// `expected` is what should be in place; `None` writes whatever is there.
///
/// The exchange (`renameat2(RENAME_EXCHANGE)`) hands back exactly what it replaced, under the
/// temp file's name, which is then unlinked: a reader that opened the old version still reads
/// it whole. (A version is never rewritten in place: that would tear it under such a reader.)
fn swap_in(
    path: &Path,
    bytes: &[u8],
    durable: bool,
    expected: Option<&[u8]>,
) -> io::Result<Swapped> {
    let mut tmp = temp_file(path)?;
    tmp.write_all(bytes)?;
    if durable {
        tmp.as_file().sync_data()?;
    }
    let swapped = match exchange(tmp.path(), path) {
        Ok(()) => {
            // `tmp` names the replaced version now. A writer that opened it before the exchange
            // may still be writing into it: give it a moment to finish.
            let deadline = Instant::now() + PARSE_RETRY;
            let mut old = fs::read(tmp.path())?;
            while expected.is_some_and(|e| e != old)
                && serde_json::from_slice::<serde::de::IgnoredAny>(&old).is_err()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(1));
                old = fs::read(tmp.path())?;
            }
            Swapped::Replaced(old)
        }
        Err(_) => {
            // No exchange here (another kernel or filesystem): compare, then a plain rename.
            if let Some(expected) = expected
                && !fs::read(path).is_ok_and(|now| now == expected)
            {
                return Ok(Swapped::Raced);
            }
            tmp.persist(path).map_err(|e| e.error)?;
            Swapped::Renamed
        }
    };
    if durable {
        File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()?;
    }
    Ok(swapped)
}

/// Swaps two paths atomically: afterwards `a` names what `b` named and the other way round.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    renameat2(AT_FDCWD, a, AT_FDCWD, b, RenameFlags::RENAME_EXCHANGE).map_err(io::Error::from)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn exchange(_: &Path, _: &Path) -> io::Result<()> {
    Err(io::ErrorKind::Unsupported.into())
}

fn temp_file(path: &Path) -> io::Result<tempfile::NamedTempFile> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("state");
    tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(TEMP_SUFFIX)
        .tempfile_in(dir)
}

/// A state file's bytes in one read, refused (`FileTooLarge`) past [`MAX_STATE_SIZE`], and
/// (`InvalidInput`) if it is not a regular file: a FIFO would block the open.
fn read_capped(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    if !fs::metadata(path)?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    if len > MAX_STATE_SIZE {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("{len} bytes"),
        ));
    }
    // One byte more than expected, to see the end of a file that grew meanwhile in one read.
    let mut bytes = Vec::with_capacity(len as usize + 1);
    file.take(MAX_STATE_SIZE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_STATE_SIZE {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            "the file grew".to_owned(),
        ));
    }
    Ok(bytes)
}

/// Overwrites `path` with `bytes` (mode 0600 when created), not atomically.
pub fn write_in_place(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)
}

/// Replaces `path` with `bytes` atomically (mode 0600): temp file in the same directory,
/// rename; `durable` adds fsync of the file before and of the directory after the rename.
pub fn write_atomic(path: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    let mut tmp = temp_file(path)?;
    tmp.write_all(bytes)?;
    if durable {
        tmp.as_file().sync_data()?;
    }
    tmp.persist(path).map_err(|e| e.error)?;
    if durable {
        File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()?;
    }
    Ok(())
}

/// The suffix of the temporary files of [`write_atomic`].
pub const TEMP_SUFFIX: &str = ".tmp";

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn tasks_in_order_glued_lines_recovered_and_garbage_reported() {
        let text = concat!(
            r#"{"task_id":"b","description":"second","order":2}"#,
            "\n",
            r#"{"task_id":"a","description":"first","order":1}{"task_id":"c","description":"third","order":3}"#,
            "\nnot json\n",
            r#"{"task_id":"d","description":"last, no newline"}"#
        );
        let (tasks, warnings) = parse_tasks(Path::new("t.jsonl"), text);
        let ids: Vec<&str> = tasks.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "c", "d"]);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("t.jsonl:3:"), "{warnings:?}");
        // Ids are unique and do not move when records are appended.
        let text = "{\"description\":\"A\"}\n{\"task_id\":\"\",\"description\":\"B\"}\n{\"task_id\":\"x\"}\n{\"task_id\":\"x\"}\n";
        let (tasks, warnings) = parse_tasks(Path::new("t.jsonl"), text);
        let ids: Vec<&str> = tasks.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["jsonl-1", "jsonl-2", "x"]);
        assert!(warnings[0].contains("\"x\" appears again"), "{warnings:?}");
        let more = format!("{text}{{\"description\":\"C\",\"order\":1}}\n");
        let (tasks, _) = parse_tasks(Path::new("t.jsonl"), &more);
        let ids: Vec<&str> = tasks.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["jsonl-5", "jsonl-1", "jsonl-2", "x"]);
    }

    #[test]
    fn an_in_place_write_during_an_update_is_merged_not_lost() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        let state = LoopState {
            loop_id: "l1".into(),
            status: Status::Running,
            ..LoopState::default()
        };
        store.create(&state).unwrap();
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
        assert_eq!(after.raw["notes"], "theirs");
        let on_disk: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk["notes"], "theirs");
        assert_eq!(on_disk["current_iteration"], 7);
        let leftovers: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(TEMP_SUFFIX))
            .collect();
        assert!(leftovers.is_empty());
    }

    #[test]
    fn commit_keeps_control_fields_written_by_others() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
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
        assert_eq!(after.state.status, Status::Paused);
        assert_eq!(after.state.title, "new");
        assert_eq!(after.raw["notes"], "mine");
        assert_eq!(after.state.current_iteration, 4);
        assert!(after.state.completed_at.is_none());
    }
}
