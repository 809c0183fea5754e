//! The event log (`{id}.progress/events.jsonl`) and the progress files written for people.
//!
//! Every event is one NDJSON line appended with a single `write` (O_APPEND), and the same event
//! is logged through `tracing` in its human form ([`render`]), which is also what `loopd logs`
//! prints. Neither is fsynced: they are the story of the loop, the state file is its truth.
//!
//! Both go through a [`ProgressDir`]: the loop's progress directory opened safely (see
//! [`loopd_fs`]) and opened again, recreated, if someone removes it while the loop runs.

use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, Mutex};

use loopd_core::state::LoopState;
use loopd_core::still::Still;
use serde_json::{Map, Value, json};

use crate::lock;
use crate::now_rfc3339;
use crate::store::{Store, StoreError};
use loopd_fs::Dir;

/// Event names, CONTRACT §7 plus loopd's own (documented in docs/files.md, "Events").
pub mod name {
    pub const DAEMON_STARTED: &str = "daemon_started";
    pub const LOOP_STARTED: &str = "loop_started";
    pub const ACTION_STARTED: &str = "action_started";
    pub const ACTION_FINISHED: &str = "action_finished";
    pub const ACTION_FAILED: &str = "action_failed";
    pub const ACTION_INTERRUPTED: &str = "action_interrupted";
    pub const PAUSED: &str = "paused";
    pub const RESUMED: &str = "resumed";
    pub const STOPPED: &str = "stopped";
    pub const COMPLETED: &str = "completed";
    pub const FAILED: &str = "failed";
    pub const DAEMON_EXITED: &str = "daemon_exited";
    /// loopd's: interactive mode waits for a choice.
    pub const AWAITING_CHOICE: &str = "awaiting_choice";
    /// loopd's: tasks appended to the task list joined the loop.
    pub const TASKS_ADDED: &str = "tasks_added";
    /// loopd's: a previous daemon's attempt was found in flight at start and cleaned up.
    pub const RECOVERED: &str = "recovered";
    /// loopd's: the agent hit its provider's rate limit; the loop waits `until`, then retries.
    pub const RATE_LIMITED: &str = "rate_limited";
    /// loopd's: the executor cannot run here (no login, no key, a missing program); the loop is
    /// paused until a person fixes it and resumes it.
    pub const BLOCKED: &str = "blocked";
    /// loopd's: the loop went `no_progress_rounds` rounds without changing a file, its
    /// validation, its tasks or its error; it is paused (`reason`: what stayed the same) until a
    /// person resumes it.
    pub const NO_PROGRESS: &str = "no_progress";
    pub const AWAITING_ANSWER: &str = "awaiting_answer";
    pub const ANSWERED: &str = "answered";
    /// loopd's: the agent retries a failed API request on its own (`retry` of `max_retries`,
    /// after `delay_ms`, for `status`), which it would otherwise do in silence.
    pub const AGENT_RETRYING: &str = "agent_retrying";
    /// loopd's: the work tree was put back as it was at a checkpoint (`checkpoint`, `commit`),
    /// by `loopd rollback` or, with `reason: "regression"`, after a validation got worse.
    pub const ROLLED_BACK: &str = "rolled_back";
    /// loopd's: a copy of a checkpoint in the work tree's repository (`ref`) was not what loopd
    /// recorded in its vault: it pointed at `found` (`null`: removed) rather than `recorded`
    /// (checkpoint `checkpoint`); it was put back.
    pub const TAMPERED: &str = "tampered";
    /// loopd's: a sandboxed attempt's output says it was refused something (`lines`, its own
    /// words, at most three), as the kernel tells a program that Landlock said no.
    pub const SANDBOX_REFUSED: &str = "sandbox_refused";
    /// loopd's: the sandbox's proxy refused an attempt a host (`host`, `port`, `count`, `error`:
    /// why, and which setting would allow it).
    pub const NETWORK_REFUSED: &str = "network_refused";
    /// loopd's: a validation succeeded and measured `pass_rate` (percent), for pictures of the
    /// loop over time.
    pub const VALIDATED: &str = "validated";
    /// loopd's: tasks developed at once (`parallel`) start, each in a work tree of its own at
    /// checkpoint `base` (`tasks`).
    pub const BATCH_STARTED: &str = "batch_started";
    /// loopd's: a task's result was merged into the loop's tree (`task_id`, `checkpoint`: the
    /// merge's, with its `files`, `insertions`, `deletions`).
    pub const MERGED: &str = "merged";
    /// loopd's: a task's result could not be merged (`task_id`, `files` in conflict, `error`):
    /// the task is developed again on the merged tree, or fails after its retries.
    pub const MERGE_CONFLICT: &str = "merge_conflict";
    /// loopd's: several executors (`executors`) each try a task (`task_id`) in a work tree of its
    /// own, from checkpoint `base`.
    pub const RACE_STARTED: &str = "race_started";
    /// loopd's: a race's `winner` (none when every entry failed), and its `entries`: each
    /// executor's outcome, its check's `pass_rate` and its `checkpoint`, kept.
    pub const RACE_DECIDED: &str = "race_decided";
    /// loopd's: something worth a person's attention that changes nothing.
    pub const WARNING: &str = "warning";
}

/// When the event log reaches this size it is moved to `events.1.jsonl` (replacing the one
/// before) and a new one starts.
pub const EVENT_LOG_ROTATE: u64 = 16 << 20;

/// The event log, in the progress directory.
pub const EVENTS: &str = "events.jsonl";
/// The event log's previous part, after a rotation.
pub const ROTATED: &str = "events.1.jsonl";

/// Actions whose attempt files `actions/` keeps (the oldest go).
pub const KEEP_ACTIONS: u64 = 200;
/// How many logs of pruned attempts are kept for reuse.
const MAX_SPARE_LOGS: usize = 64;

/// A loop's progress directory (`{id}.progress`), opened on first use and again after it was
/// removed. Its clones (the event log's, the progress files', the attempts') share what they
/// open: one descriptor of each directory a loop, in a service of a thousand.
#[derive(Clone)]
pub struct ProgressDir {
    store: Store,
    id: String,
    dir: Arc<Mutex<Option<Dir>>>,
    /// `actions/`, once opened: each attempt uses it twice.
    actions: Arc<Mutex<Option<Dir>>>,
}

impl ProgressDir {
    pub fn new(store: &Store, id: &str) -> ProgressDir {
        ProgressDir {
            store: store.clone(),
            id: id.to_owned(),
            dir: Arc::default(),
            actions: Arc::default(),
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Option<Dir>> {
        lock(&self.dir)
    }

    fn cached(&self) -> Option<Dir> {
        self.cache().clone()
    }

    /// The directory, created (0700) if missing.
    pub fn dir(&self) -> Result<Dir, StoreError> {
        if let Some(dir) = self.cached() {
            return Ok(dir);
        }
        let dir = self.store.progress(&self.id)?;
        *self.cache() = Some(dir.clone());
        Ok(dir)
    }

    pub fn path(&self) -> PathBuf {
        self.store.progress_dir(&self.id)
    }

    /// Runs `f` on the directory; if the directory is gone (`NotFound`), once more on a new one.
    pub fn with<T>(&self, f: impl Fn(&Dir) -> io::Result<T>) -> io::Result<T> {
        let dir = self.dir().map_err(StoreError::into_io)?;
        match f(&dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                *self.cache() = None;
                let dir = self.dir().map_err(StoreError::into_io)?;
                f(&dir)
            }
            other => other,
        }
    }

    /// The attempts' directory, `actions/`, created if missing (opened again if it was removed).
    pub fn actions(&self) -> io::Result<Dir> {
        let mut cached = lock(&self.actions);
        if let Some(actions) = cached.as_ref()
            && !actions.removed()
        {
            return Ok(actions.clone());
        }
        let actions = self.with(|d| {
            let actions = d.subdir("actions", true)?;
            actions.make_private();
            Ok(actions)
        })?;
        *cached = Some(actions.clone());
        Ok(actions)
    }
}

/// Appends events of one loop.
pub struct EventLog {
    loop_id: String,
    dir: ProgressDir,
    file: Option<File>,
    size: u64,
    /// Lines the log could not take yet (a full disk), oldest first: written before the next
    /// event's, at most [`MAX_UNWRITTEN`] bytes of them (beyond, the oldest are dropped, and
    /// counted in `dropped`).
    unwritten: std::collections::VecDeque<String>,
    unwritten_bytes: usize,
    dropped: u64,
    /// A write failed, and was said in the log once.
    failing: bool,
    /// Told of every event as it is written (see [`EventLog::set_sink`]).
    sink: Option<Sink>,
}

/// Where an [`EventLog`] hands each event, as written to the log, besides the log: the file
/// driver's notifications. It runs on the loop's path, so it must return at once.
pub type Sink = Box<dyn Fn(&Value) + Send + Sync>;

/// How many bytes of events wait at most for a log that cannot be written.
const MAX_UNWRITTEN: usize = 1 << 20;

/// One event being built.
pub struct Event {
    fields: Map<String, Value>,
}

impl Event {
    pub fn new(event: &str) -> Event {
        let mut fields = Map::new();
        fields.insert("event".into(), json!(event));
        Event { fields }
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Event {
        let value = value.into();
        if !value.is_null() {
            self.fields.insert(key.to_owned(), value);
        }
        self
    }

    /// Says why the loop now stands still and what moves it on, under the names `status
    /// --json` gives them (`status_reason`, `next_step`): what a notification of the event tells
    /// a person. Nothing when the loop does not stand still.
    pub fn still(self, still: Option<Still>) -> Event {
        match still {
            Some(still) => self
                .with("status_reason", still.reason)
                .with("next_step", still.next),
            None => self,
        }
    }
}

impl EventLog {
    pub fn open(loop_id: &str, dir: &ProgressDir) -> std::io::Result<EventLog> {
        let file = dir.with(|d| d.append(EVENTS))?;
        let size = file.metadata()?.len();
        Ok(EventLog {
            loop_id: loop_id.to_owned(),
            dir: dir.clone(),
            file: Some(file),
            size,
            unwritten: Default::default(),
            unwritten_bytes: 0,
            dropped: 0,
            failing: false,
            sink: None,
        })
    }

    /// Hands every event emitted from now on to `sink` too (replacing any sink before).
    pub fn set_sink(&mut self, sink: Sink) {
        self.sink = Some(sink);
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join(EVENTS)
    }

    pub fn emit(&mut self, event: Event) {
        let now = chrono::Utc::now();
        let mut line = Map::new();
        line.insert("ts".into(), json!(loopd_core::state::format_ts(now)));
        line.insert("loop_id".into(), json!(self.loop_id));
        line.extend(event.fields);
        let value = Value::Object(line);
        let is_warning = value["event"] == name::WARNING;
        // Shown at the time it was taken, not at its text's parse.
        if is_warning {
            tracing::warn!("{}", render_at(&value, Clock::Local.at(now)));
        } else {
            tracing::info!("{}", render_at(&value, Clock::Local.at(now)));
        }
        if let Some(sink) = &self.sink {
            sink(&value);
        }
        let mut text = value.to_string();
        text.push('\n');
        self.unwritten_bytes += text.len();
        self.unwritten.push_back(text);
        while self.unwritten_bytes > MAX_UNWRITTEN
            && let Some(old) = self.unwritten.pop_front()
        {
            self.unwritten_bytes -= old.len();
            self.dropped += 1;
        }
        self.flush();
    }

    /// Writes the lines waiting, oldest first, until one cannot be written (said once, until
    /// the log can be written again).
    fn flush(&mut self) {
        if self.dropped > 0 {
            let line = json!({
                "ts": now_rfc3339(),
                "loop_id": self.loop_id,
                "event": name::WARNING,
                "message": format!(
                    "{} events were dropped: the event log could not be written for a while",
                    self.dropped
                ),
            });
            let line = format!("{line}\n");
            self.unwritten_bytes += line.len();
            self.unwritten.push_front(line);
            self.dropped = 0;
        }
        while let Some(line) = self.unwritten.pop_front() {
            if let Err(e) = self.write_line(&line) {
                if !std::mem::replace(&mut self.failing, true) {
                    tracing::warn!(
                        path = %self.path().display(),
                        "cannot append to the event log ({e}); events wait in memory until it \
                         can be written"
                    );
                }
                self.unwritten.push_front(line);
                return;
            }
            self.unwritten_bytes -= line.len();
        }
        if std::mem::replace(&mut self.failing, false) {
            tracing::info!(path = %self.path().display(), "the event log can be written again");
        }
    }

    /// Appends one line; a write cut short (a full disk) is cut off the file again.
    fn write_line(&mut self, text: &str) -> std::io::Result<()> {
        // A log removed meanwhile (with its directory) is opened anew, once.
        if self.file.as_ref().is_none_or(removed) {
            self.file = Some(self.dir.with(|d| d.append(EVENTS))?);
            self.size = self
                .file
                .as_ref()
                .and_then(|f| f.metadata().ok())
                .map_or(0, |m| m.len());
        }
        let Some(file) = &mut self.file else {
            unreachable!("opened above")
        };
        if let Err(e) = file.write_all(text.as_bytes()) {
            let _ = file.set_len(self.size);
            return Err(e);
        }
        self.size += text.len() as u64;
        if self.size >= EVENT_LOG_ROTATE {
            self.rotate();
        }
        Ok(())
    }
}

/// The events still waiting are written, if the log can take them now.
impl Drop for EventLog {
    fn drop(&mut self) {
        if !self.unwritten.is_empty() {
            self.flush();
        }
    }
}

/// Whether an open file has no name left.
fn removed(file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    file.metadata().is_ok_and(|m| m.nlink() == 0)
}

impl EventLog {
    fn rotate(&mut self) {
        let reopened = self.dir.with(|d| {
            d.rename(EVENTS, ROTATED)?;
            d.append(EVENTS)
        });
        match reopened {
            Ok(file) => {
                self.file = Some(file);
                self.size = 0;
            }
            Err(e) => {
                tracing::warn!(path = %self.path().display(), "cannot rotate the event log: {e}");
            }
        }
    }
}

/// Reads a loop's event log from its start and then as it grows, across rotations: once the
/// name `events.jsonl` moves to a new file, the rest of the old one (now `events.1.jsonl`) is read
/// before the new one, so a follower misses nothing.
pub struct EventTail {
    store: Store,
    id: String,
    /// The file being read and its inode.
    file: Option<(File, u64)>,
    /// Bytes of a line not yet complete (the daemon may be writing it).
    pending: Vec<u8>,
}

impl EventTail {
    pub fn new(store: &Store, id: &str) -> EventTail {
        EventTail {
            store: store.clone(),
            id: id.to_owned(),
            file: None,
            pending: Vec::new(),
        }
    }

    /// The complete lines written since the last call (none while there is no log yet).
    pub fn read_lines(&mut self) -> Result<Vec<String>, StoreError> {
        let Some(dir) = self.store.existing_progress(&self.id)? else {
            return Ok(Vec::new());
        };
        let io_err = |e: io::Error| StoreError::Io {
            path: dir.join(EVENTS),
            source: e,
        };
        let mut bytes = Vec::new();
        let first = self.file.is_none();
        loop {
            if let Some((file, _)) = &mut self.file {
                io::Read::read_to_end(file, &mut bytes).map_err(io_err)?;
            }
            let now = dir.stat(EVENTS).map_err(io_err)?.map(|s| s.st_ino);
            if now.is_none() || now == self.file.as_ref().map(|(_, ino)| *ino) {
                break;
            }
            // A new file under the name: the old one was read to its end just now (its writer
            // moved on before renaming it), so switch.
            let file = dir.open_read(EVENTS).map_err(io_err)?;
            let ino = nix::sys::stat::fstat(&file)
                .map_err(|e| io_err(e.into()))?
                .st_ino;
            if first && self.file.is_none() {
                // From the start: what rotated away comes first, unless it is this very file.
                if let Ok(old) = dir.open_read(ROTATED)
                    && nix::sys::stat::fstat(&old).is_ok_and(|s| s.st_ino != ino)
                {
                    io::Read::read_to_end(&mut &old, &mut bytes).map_err(io_err)?;
                }
            }
            self.file = Some((file, ino));
        }
        self.pending.extend_from_slice(&bytes);
        let complete = match self.pending.iter().rposition(|b| *b == b'\n') {
            Some(nl) => self.pending.drain(..=nl).collect::<Vec<u8>>(),
            None => return Ok(Vec::new()),
        };
        Ok(String::from_utf8_lossy(&complete)
            .lines()
            .map(str::trim_end)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect())
    }
}

/// The output of one attempt (its log in `actions/`), read as it is written, line by line.
pub struct OutputTail {
    store: Store,
    id: String,
    name: String,
    file: Option<File>,
    pending: Vec<u8>,
}

/// The longest output line shown whole.
const MAX_SHOWN_LINE: usize = 1000;

impl OutputTail {
    /// The attempt whose log is `log` (a path in the loop's `actions/`).
    pub fn new(store: &Store, id: &str, log: &str) -> OutputTail {
        OutputTail {
            store: store.clone(),
            id: id.to_owned(),
            name: std::path::Path::new(log)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            file: None,
            pending: Vec::new(),
        }
    }

    /// The complete lines written since the last call, and with `to_end` the last one too.
    pub fn read_lines(&mut self, to_end: bool) -> Vec<String> {
        if self.file.is_none() {
            self.file = self
                .store
                .existing_progress(&self.id)
                .ok()
                .flatten()
                .and_then(|d| d.subdir("actions", false).ok())
                .and_then(|d| d.open_read(&self.name).ok());
        }
        if let Some(file) = &mut self.file {
            let _ = io::Read::read_to_end(file, &mut self.pending);
        }
        let cut = match self.pending.iter().rposition(|b| *b == b'\n') {
            _ if to_end => self.pending.len(),
            Some(nl) => nl + 1,
            None => return Vec::new(),
        };
        let complete: Vec<u8> = self.pending.drain(..cut).collect();
        String::from_utf8_lossy(&complete)
            .lines()
            .map(|l| match l.char_indices().nth(MAX_SHOWN_LINE) {
                Some((at, _)) => format!("{}…", &l[..at]),
                None => l.to_owned(),
            })
            .collect()
    }
}

/// Text from executors and state files made safe to show on a terminal: every control character
/// (escape sequences, carriage returns, newlines, C1 controls) is shown escaped, as `\u{1b}`.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return text.into();
    }
    let mut shown = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            shown.extend(c.escape_debug());
        } else {
            shown.push(c);
        }
    }
    shown.into()
}

/// How times are shown to people.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Clock {
    /// The machine's local time with its offset: `2026-11-23 12:52:08.123 +01:00`.
    #[default]
    Local,
    /// UTC: `2026-11-23 11:52:08.123Z`.
    Utc,
}

impl Clock {
    /// An RFC 3339 timestamp as this clock shows it (as it was, if it does not parse).
    pub fn show(self, ts: &str) -> String {
        match loopd_core::state::parse_ts(ts) {
            Some(t) => self.at(t),
            None => ts.to_owned(),
        }
    }

    /// A time as this clock shows it.
    pub fn at(self, t: chrono::DateTime<chrono::Utc>) -> String {
        use chrono::format::{Item, StrftimeItems};
        // The formats parsed once: each event logged shows one.
        fn parsed(format: &'static str) -> Vec<Item<'static>> {
            StrftimeItems::new(format)
                .parse_to_owned()
                .expect("a valid format")
        }
        static LOCAL: LazyLock<Vec<Item<'static>>> =
            LazyLock::new(|| parsed("%Y-%m-%d %H:%M:%S%.3f %:z"));
        static UTC: LazyLock<Vec<Item<'static>>> =
            LazyLock::new(|| parsed("%Y-%m-%d %H:%M:%S%.3fZ"));
        match self {
            Clock::Local => t
                .with_timezone(&chrono::Local)
                .format_with_items(LOCAL.iter())
                .to_string(),
            Clock::Utc => t.format_with_items(UTC.iter()).to_string(),
        }
    }
}

/// One event for people: `DATE TIME ZONE  #iter  action  what  details`.
pub fn render(event: &Value, clock: Clock) -> String {
    let ts = event.get("ts").and_then(Value::as_str).unwrap_or("");
    render_at(event, clock.show(ts))
}

/// [`render`], its time shown as `time`.
fn render_at(event: &Value, time: String) -> String {
    let s = |k: &str| event.get(k).and_then(Value::as_str).unwrap_or("");
    let iteration = event
        .get("iteration")
        .and_then(Value::as_u64)
        .map(|i| format!("#{i}"))
        .unwrap_or_default();
    let mut details = Vec::new();
    if let Some(task) = event.get("task_id").and_then(Value::as_str) {
        details.push(task.to_owned());
    }
    if let Some(a) = event.get("attempt").and_then(Value::as_u64)
        && (a > 1 || s("event") == name::ACTION_FAILED)
    {
        details.push(format!("attempt {a}"));
    }
    if let Some(pid) = event.get("pid").and_then(Value::as_u64) {
        details.push(format!("pid {pid}"));
    }
    if let (host, Some(port)) = (s("host"), event.get("port").and_then(Value::as_u64))
        && !host.is_empty()
    {
        let times = event.get("count").and_then(Value::as_u64).unwrap_or(1);
        let times = if times > 1 {
            format!(" ×{times}")
        } else {
            String::new()
        };
        details.push(format!("{host}:{port}{times}"));
    }
    if !s("outcome").is_empty() {
        details.push(s("outcome").to_owned());
    }
    if let Some(ms) = event.get("duration_ms").and_then(Value::as_u64) {
        details.push(format!("{:.2}s", ms as f64 / 1000.0));
    }
    if let Some(code) = event.get("exit_code").and_then(Value::as_i64) {
        details.push(format!("exit {code}"));
    }
    if !s("summary").is_empty() {
        details.push(format!("— {}", s("summary")));
    }
    if !s("error").is_empty() {
        details.push(format!("— {}", s("error")));
    }
    if !s("message").is_empty() {
        details.push(s("message").to_owned());
    }
    let what = s("event").replace('_', " ");
    let line = format!(
        "{time}  {iteration:>4}  {:<9} {what:<19} {}",
        s("action"),
        details.join("  ")
    );
    printable(line.trim_end()).into_owned()
}

/// Whether `name` is a spare log of `actions/`: a pruned log (`.NAME.log.spare.tmp`) or one made
/// while an attempt ran (`.log.spare.PID-XXXXXX.tmp`).
fn is_spare_log(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(loopd_fs::TEMP_SUFFIX) && name.contains(".log.spare")
}

/// The Markdown and NDJSON files of `{id}.progress/` written for people.
pub struct Progress {
    dir: ProgressDir,
    /// Logs of pruned attempts, renamed to `.NAME.spare.tmp`, and empty logs made while an
    /// attempt runs ([`Progress::stock_log`]), for the next attempts' logs (see
    /// [`Dir::open_existing_rw`] for why).
    spare_logs: Mutex<Vec<String>>,
}

impl Progress {
    pub fn new(dir: &ProgressDir) -> Progress {
        Progress {
            dir: dir.clone(),
            spare_logs: Mutex::default(),
        }
    }

    /// Removes the files of all but the last [`KEEP_ACTIONS`] actions from `actions/` (their
    /// names start with the action's number). Their logs are kept, hidden, for the next attempts'
    /// logs ([`Progress::reuse_log`]), up to `MAX_SPARE_LOGS`.
    pub fn prune_actions(&self) {
        let Ok(dir) = self.dir.actions() else {
            return;
        };
        let names = dir.entries().unwrap_or_default();
        let mut spares = lock(&self.spare_logs);
        // Spare logs of an earlier run of the loop.
        for name in names.iter().filter(|n| is_spare_log(n)) {
            if !spares.contains(name) {
                let _ = dir.remove(name);
            }
        }
        let numbered: Vec<(u64, &String)> = names
            .iter()
            .filter_map(|name| Some((name.split('-').next()?.parse().ok()?, name)))
            .collect();
        let Some(newest) = numbered.iter().map(|(n, _)| *n).max() else {
            return;
        };
        for (n, name) in numbered {
            if n + KEEP_ACTIONS > newest {
                continue;
            }
            let spare = format!(".{name}.spare{}", loopd_fs::TEMP_SUFFIX);
            if name.ends_with(".log")
                && spares.len() < MAX_SPARE_LOGS
                && dir.rename(name, &spare).is_ok()
            {
                spares.push(spare);
            } else {
                let _ = dir.remove(name);
            }
        }
    }

    /// Readies the next attempt's log while this one runs, so that starting it costs a rename:
    /// an empty spare, made (a new file costs an inode, which on ext4 without a journal means a
    /// search past every inode released in the last minutes) or emptied (which may cost a
    /// discard) now rather than between two actions.
    pub fn stock_log(&self) {
        let Ok(dir) = self.dir.actions() else {
            return;
        };
        let mut spares = lock(&self.spare_logs);
        let ready = match spares.last() {
            Some(spare) => dir
                .open_rw(spare)
                .and_then(|file| match file.metadata()?.len() {
                    0 => Ok(()),
                    _ => file.set_len(0),
                })
                .is_ok(),
            None => false,
        };
        if !ready {
            spares.pop();
            if let Ok((spare, _)) = dir.temp_file("log.spare") {
                spares.push(spare);
            }
        }
    }

    /// Makes a spare log (see [`Progress::prune_actions`], [`Progress::stock_log`]) the file
    /// `name` of `actions/`, to be opened and emptied as a new one would be created.
    pub fn reuse_log(&self, actions: &Dir, name: &str) {
        let mut spares = lock(&self.spare_logs);
        while let Some(spare) = spares.pop() {
            if actions.rename(&spare, name).is_ok() {
                return;
            }
        }
    }

    fn append(&self, file: &str, text: &str) {
        let result = self.dir.with(|d| {
            d.append(file)
                .and_then(|mut f| f.write_all(text.as_bytes()))
        });
        if let Err(e) = result {
            tracing::warn!("cannot write progress file {file}: {e}");
        }
    }

    fn replace(&self, file: &str, text: &str) {
        if let Err(e) = self.dir.with(|d| d.replace_reusing(file, text.as_bytes())) {
            tracing::warn!("cannot write progress file {file}: {e}");
        }
    }

    /// Adds a workflow's note to its progress file.
    pub fn write(&self, note: &loopd_core::workflow::Note) {
        if note.replace {
            self.replace(note.file, &note.text);
        } else {
            self.append(note.file, &note.text);
        }
    }

    /// At completion: `summary.md`, with the workflow's summary line and sections.
    pub fn summary(&self, state: &LoopState, line: Option<&str>, sections: &str) {
        let Some(skill) = state.skill_state.as_ref() else {
            return;
        };
        let mut text = format!(
            "# {}\n\n- loop: {}\n- outcome: {}\n- iterations: {}\n- errors: {}\n- completed at: {}\n",
            state.title,
            state.loop_id,
            skill.outcome.as_deref().unwrap_or("-"),
            state.current_iteration,
            skill.error_count,
            now_rfc3339()
        );
        if let Some(line) = line {
            text.push_str(&format!("\n{line}\n"));
        }
        text.push_str(sections);
        self.replace("summary.md", &text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt as _;

    /// A time taken shows as its written timestamp does when read back (`loopd logs`), in
    /// either clock.
    #[test]
    fn a_time_shows_as_its_timestamp_read_back_does() {
        let t = chrono::DateTime::parse_from_rfc3339("2026-11-23T11:52:08.123456Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        assert_eq!(Clock::Utc.at(t), "2026-11-23 11:52:08.123Z");
        let now = chrono::Utc::now();
        let ts = loopd_core::state::format_ts(now);
        for clock in [Clock::Utc, Clock::Local] {
            assert_eq!(clock.at(now), clock.show(&ts), "{clock:?}");
        }
        let line =
            json!({"ts": ts, "event": "action_started", "iteration": 3, "action": "develop"});
        assert_eq!(
            render_at(&line, Clock::Local.at(now)),
            render(&line, Clock::Local)
        );
    }

    /// The progress files of a loop of a store in a directory of its own (kept while the first
    /// is), and their `actions/`.
    fn progress_of_a_loop() -> (tempfile::TempDir, Progress, Dir) {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::new(tmp.path(), ".");
        let progress = Progress::new(&ProgressDir::new(&store, "l1"));
        let actions = progress.dir.actions().unwrap();
        (tmp, progress, actions)
    }

    #[test]
    fn pruned_logs_become_the_next_attempts_logs() {
        let (_tmp, progress, actions) = progress_of_a_loop();
        let path = actions.path().to_owned();
        let newest = KEEP_ACTIONS + 3;
        for n in 1..=newest {
            std::fs::write(path.join(format!("{n:04}-develop-1.log")), "out").unwrap();
            std::fs::write(path.join(format!("{n:04}-develop-1.result.json")), "{}").unwrap();
        }
        std::fs::write(path.join(".0001-old.log.spare.tmp"), "").unwrap();
        let first = std::fs::metadata(path.join("0001-develop-1.log"))
            .unwrap()
            .ino();
        progress.prune_actions();
        let mut names: Vec<String> = std::fs::read_dir(&path)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names.len() as u64, 2 * KEEP_ACTIONS + 3, "{names:?}");
        assert_eq!(
            names[..3],
            [
                ".0001-develop-1.log.spare.tmp",
                ".0002-develop-1.log.spare.tmp",
                ".0003-develop-1.log.spare.tmp",
            ]
        );
        assert!(names.contains(&"0004-develop-1.log".to_owned()));
        // The next attempt's log is a spare, renamed: the same file, no new one.
        let spares: Vec<(PathBuf, u64)> = names[..3]
            .iter()
            .map(|n| (path.join(n), std::fs::metadata(path.join(n)).unwrap().ino()))
            .collect();
        let next = format!("{:04}-validate-1.log", newest + 1);
        progress.reuse_log(&actions, &next);
        let reused = std::fs::metadata(path.join(&next)).unwrap().ino();
        let taken: Vec<u64> = spares
            .iter()
            .filter(|(p, _)| !p.exists())
            .map(|(_, ino)| *ino)
            .collect();
        assert_eq!(taken, [reused]);
        assert!(spares.iter().any(|(_, ino)| *ino == first));
    }

    #[test]
    fn the_spare_logs_of_an_earlier_run_are_removed_and_nothing_else_is() {
        let (_tmp, progress, actions) = progress_of_a_loop();
        let earlier = [".0001-develop-1.log.spare.tmp", ".log.spare.99-abcdef.tmp"];
        let kept = [
            ".result.json.spare.tmp",
            ".result-2.json.spare.tmp",
            "0002-validate-1.log",
        ];
        for name in earlier.iter().chain(&kept) {
            std::fs::write(actions.join(name), "").unwrap();
        }
        progress.prune_actions();
        for name in earlier {
            assert!(!actions.exists(name), "{name}");
        }
        for name in kept {
            assert!(actions.exists(name), "{name}");
        }
    }

    #[test]
    fn the_next_log_is_readied_while_an_attempt_runs() {
        let (_tmp, progress, actions) = progress_of_a_loop();
        let hidden = |actions: &Dir| -> Vec<String> {
            let mut names = actions.entries().unwrap();
            names.retain(|n| n.starts_with('.'));
            names
        };
        // No spare: one is made, empty, and is the next attempt's log.
        progress.stock_log();
        let made = hidden(&actions);
        assert_eq!(made.len(), 1, "{made:?}");
        let ino = std::fs::metadata(actions.join(&made[0])).unwrap().ino();
        progress.reuse_log(&actions, "0001-develop-1.log");
        let log = std::fs::metadata(actions.join("0001-develop-1.log")).unwrap();
        assert_eq!(log.ino(), ino);
        assert!(hidden(&actions).is_empty());
        // A pruned log kept as a spare is emptied beforehand, not made anew.
        std::fs::write(actions.join(".0001-old.log.spare.tmp"), "old output").unwrap();
        lock(&progress.spare_logs).push(".0001-old.log.spare.tmp".into());
        progress.stock_log();
        assert_eq!(hidden(&actions), [".0001-old.log.spare.tmp"]);
        let spare = std::fs::metadata(actions.join(".0001-old.log.spare.tmp")).unwrap();
        assert_eq!(spare.len(), 0);
    }

    #[test]
    fn the_actions_dir_is_opened_once_and_again_after_it_was_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::new(tmp.path(), ".");
        let progress = ProgressDir::new(&store, "l1");
        let first = progress.actions().unwrap();
        first.create("0001-develop-1.log").unwrap();
        assert!(!first.removed());
        assert!(progress.actions().unwrap().exists("0001-develop-1.log"));
        std::fs::remove_dir_all(tmp.path().join("l1.progress")).unwrap();
        assert!(first.removed());
        let again = progress.actions().unwrap();
        again.create("0002-develop-1.log").unwrap();
        assert!(
            tmp.path()
                .join("l1.progress/actions/0002-develop-1.log")
                .exists()
        );
    }
}
