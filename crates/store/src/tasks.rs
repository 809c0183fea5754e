//! A loop's task list: the tasks people and other programs give a loop to run.
//!
//! Theory of operation: two programs write a loop's tasks. The CCW dashboard keeps them in
//! `{id}/tasks.jsonl` (its `LoopTask` records, one JSON object a line), which it appends to or
//! rewrites whole without a lock, copying it to `tasks.jsonl.backup` first. loopd writes each task
//! it adds twice: into CCW's file, where both programs read it, and into its own record
//! `{id}.tasks.jsonl` (the file earlier versions wrote, and which only loopd writes), so that a
//! rewrite by CCW from a copy it read before loopd's write loses nothing for good.
//!
//! Reading ([`Store::read_tasks`]): both files, merged by task id — CCW's version of a record
//! first, as CCW edits its records — in a stable order (by `order`, then CCW's file before
//! loopd's record, then where they stand). A line that does not parse is reported, never dropped
//! silently; records glued on one line (CCW's rewrite leaves no final newline, and its next
//! append glues onto it) are all read; a torn record (a write cut short) is skipped to the next
//! record on its line, and the records of CCW's backup that the torn file lacks are read too.
//! The tasks of loopd's record that CCW's file lacks are reported ([`TaskList::unshared`]) and
//! written there again ([`Store::share_tasks`]): whoever removed them, they were never run.
//!
//! Writing ([`Store::add_tasks`]), under the loop's lock for the read and the exchange: the new
//! version of a file is written to a temporary file and exchanged with it
//! (`renameat2(RENAME_EXCHANGE)`): a reader sees the old list or the new one. In CCW's file, the
//! version it replaced is then left until no process has it open and it is
//! `ORPHAN_LIFE_SHORT` old (while a writer holds it open, until it closes it; at most
//! `OPEN_LIFE` while a reader does), the lock let go meanwhile,
//! and read once more: a lockless write that landed between loopd's read and the exchange, or into
//! the replaced version just after it (a writer that opened the file just before), shows there,
//! and what it added or changed is merged into the file in place, by another exchange. Merging is
//! a union: a record someone added or changed is taken, none is dropped, and bytes that are not a
//! record are kept as they were. (loopd's own record has no lockless writer: its replaced version
//! is removed at once.)

use std::collections::HashSet;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use loopd_core::state::{ListedTask, MAX_DESCRIPTION};
use serde_json::{Map, Value};

use crate::now_rfc3339;
use crate::store::{ORPHAN_LIFE, ORPHAN_LIFE_SHORT, Store, StoreError, WRITER_HOLD_MAX, io_err};
use loopd_fs::Dir;

/// How many tasks a loop's list holds at most; the records beyond are skipped with a warning.
pub const MAX_LISTED: usize = 200;
/// A task list file larger than this is refused rather than read.
pub const MAX_TASKS_FILE_SIZE: u64 = 16 << 20;
/// CCW's task list, in the directory named after the loop.
pub const SHARED: &str = "tasks.jsonl";
/// The copy CCW makes of its task list before each write.
const SHARED_BACKUP: &str = "tasks.jsonl.backup";
/// How many times a write merges what a lockless writer wrote meanwhile before it gives up.
const MERGE_ROUNDS: usize = 5;
/// How long a replaced version a reader keeps open is waited for, at most, before it is read.
/// One a writer holds open is waited for until the writer closes it, however slow
/// ([`WRITER_HOLD_MAX`] aside): it opened the file before the exchange and may be descheduled
/// before its write. (A task is added by a person or a dashboard, seldom: a write may wait this
/// long when a reader keeps the file open.)
const OPEN_LIFE: Duration = Duration::from_secs(2);

/// A loop's task list, read.
#[derive(Debug, Default)]
pub struct TaskList {
    /// Every task, in order.
    pub tasks: Vec<ListedTask>,
    /// Lines that do not parse, records skipped: one line each, naming the file and the line.
    pub warnings: Vec<String>,
    /// How many tasks of loopd's own record CCW's file lacks (see [`Store::share_tasks`]).
    pub unshared: usize,
    /// The files as they were read: whether they changed since.
    pub stamp: TasksStamp,
}

/// What identifies a version of each task list file (inode, length, modification time): a
/// write, or a file replaced, changes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TasksStamp([Option<(u64, i64, i64, i64)>; 2]);

impl TasksStamp {
    /// Whether the loop has a task list file at all.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }
}

/// One of the two files.
#[derive(Clone, Copy, Debug, PartialEq)]
enum File {
    /// CCW's `{id}/tasks.jsonl`.
    Shared,
    /// loopd's own record, `{id}.tasks.jsonl`.
    Own,
}

impl File {
    /// The name of the file in its directory, and the directory: the loop's own subdirectory for
    /// CCW's file.
    fn name(self, id: &str) -> String {
        match self {
            File::Shared => SHARED.to_owned(),
            File::Own => format!("{id}.tasks.jsonl"),
        }
    }

    /// The id of a record without one, from where it stands (appending never moves it).
    fn place_id(self, line: usize, k: usize) -> String {
        let prefix = match self {
            File::Shared => "ccw-",
            File::Own => "",
        };
        match k {
            0 => format!("{prefix}jsonl-{line}"),
            k => format!("{prefix}jsonl-{line}-{k}"),
        }
    }
}

/// A piece of a task list file: a record, or bytes that are not one.
#[derive(Clone, Debug)]
enum Item {
    Record(Record),
    Garbage(String),
}

#[derive(Clone, Debug)]
struct Record {
    /// Its id: `task_id`, else `id`, else [`File::place_id`].
    id: String,
    /// Its text as it was written (one JSON object).
    raw: String,
    map: Map<String, Value>,
    /// The line it stands on.
    line: usize,
}

/// A task list file, parsed.
#[derive(Clone, Debug, Default)]
struct Parsed {
    items: Vec<Item>,
    warnings: Vec<String>,
}

impl Parsed {
    fn parse(file: File, path: &Path, text: &str) -> Parsed {
        let mut parsed = Parsed::default();
        let mut ids = HashSet::new();
        for (n, line) in text.lines().enumerate() {
            let lineno = n + 1;
            let mut rest = line;
            let mut k = 0;
            while !rest.trim().is_empty() {
                let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                let (value, end) = (stream.next(), stream.byte_offset());
                let start = rest.len() - rest.trim_start().len();
                match value {
                    Some(Ok(Value::Object(map))) => {
                        let raw = rest[start..end].to_owned();
                        let id = record_id(&map).unwrap_or_else(|| file.place_id(lineno, k));
                        if ids.insert(id.clone()) {
                            parsed.items.push(Item::Record(Record {
                                id,
                                raw,
                                map,
                                line: lineno,
                            }));
                        } else {
                            parsed.warnings.push(format!(
                                "{}:{lineno}: task id {id:?} appears again; this record is skipped",
                                path.display()
                            ));
                        }
                        k += 1;
                        rest = &rest[end..];
                    }
                    Some(Ok(other)) => {
                        parsed.warnings.push(format!(
                            "{}:{lineno}: a task must be a JSON object, not {other}",
                            path.display()
                        ));
                        parsed
                            .items
                            .push(Item::Garbage(rest[start..end].to_owned()));
                        rest = &rest[end..];
                    }
                    Some(Err(e)) => {
                        // Torn, or not JSON: skipped to the next record on the line, if any.
                        let bad = &rest[start..];
                        let next = bad[1..].find('{').map_or(bad.len(), |i| i + 1);
                        parsed.warnings.push(format!(
                            "{}:{lineno}: {e}; {} skipped",
                            path.display(),
                            if next < bad.len() {
                                "the bytes up to the next record are"
                            } else {
                                "the rest of the line is"
                            }
                        ));
                        parsed.items.push(Item::Garbage(bad[..next].to_owned()));
                        rest = &bad[next..];
                    }
                    None => break,
                }
            }
        }
        parsed
    }

    fn records(&self) -> impl Iterator<Item = &Record> {
        self.items.iter().filter_map(|item| match item {
            Item::Record(r) => Some(r),
            Item::Garbage(_) => None,
        })
    }

    fn record(&self, id: &str) -> Option<&Record> {
        self.records().find(|r| r.id == id)
    }

    fn is_torn(&self) -> bool {
        self.items.iter().any(|i| matches!(i, Item::Garbage(_)))
    }

    /// The file's text: one record or piece a line, each line ending in a newline.
    fn render(&self) -> String {
        let mut text = String::new();
        for item in &self.items {
            let (Item::Record(Record { raw: line, .. }) | Item::Garbage(line)) = item;
            text.push_str(line);
            text.push('\n');
        }
        text
    }

    /// Adds `record` at the end, or in place of the record with its id.
    fn put(&mut self, record: Record) {
        let place = self.items.iter_mut().find_map(|item| match item {
            Item::Record(r) if r.id == record.id => Some(r),
            _ => None,
        });
        match place {
            Some(r) => *r = record,
            None => self.items.push(Item::Record(record)),
        }
    }

    /// Adds the records of `backup` this list lacks; returns how many.
    fn restore_from(&mut self, backup: &Parsed) -> usize {
        let lost: Vec<Record> = backup
            .records()
            .filter(|r| self.record(&r.id).is_none())
            .cloned()
            .collect();
        let count = lost.len();
        self.items.extend(lost.into_iter().map(Item::Record));
        count
    }

    /// Takes in what `theirs` (a version another writer made of `base`) added or changed: its
    /// records new to this list or not as `base` had them, and its bytes that are not a record.
    fn merge(&mut self, base: &Parsed, theirs: &Parsed) {
        for item in &theirs.items {
            match item {
                Item::Record(r) => {
                    let changed = base.record(&r.id).is_none_or(|b| b.raw != r.raw);
                    let known = self.record(&r.id).is_some_and(|mine| mine.raw == r.raw);
                    if changed && !known {
                        self.put(r.clone());
                    }
                }
                Item::Garbage(g) => {
                    let known = |p: &Parsed| {
                        p.items
                            .iter()
                            .any(|i| matches!(i, Item::Garbage(mine) if mine == g))
                    };
                    if !known(base) && !known(self) {
                        self.items.push(item.clone());
                    }
                }
            }
        }
    }
}

/// A record's own id: `task_id`, else `id`, when it is a non-empty string.
fn record_id(map: &Map<String, Value>) -> Option<String> {
    ["task_id", "id"].iter().find_map(|key| {
        map.get(*key)
            .and_then(Value::as_str)
            .filter(|s| !s.trim().is_empty())
            .map(str::to_owned)
    })
}

/// A record as a new line of CCW's file: its id written out, and CCW's required `LoopTask` fields
/// filled in where it lacks them (`tool`, `mode`, `prompt_template`, `order`, `created_at`,
/// `updated_at`), so that CCW lists and edits it like its own.
fn shared_form(record: &Record, order: u64, now: &str) -> Record {
    let mut map = Map::new();
    map.insert("task_id".into(), record.id.clone().into());
    let text = |key: &str| record.map.get(key).and_then(Value::as_str);
    let description = text("description").or_else(|| text("title")).unwrap_or("");
    map.insert("description".into(), description.into());
    map.insert("tool".into(), text("tool").unwrap_or("bash").into());
    map.insert("mode".into(), text("mode").unwrap_or("write").into());
    map.insert(
        "prompt_template".into(),
        text("prompt_template").unwrap_or(description).into(),
    );
    map.insert("order".into(), order.into());
    let created = text("created_at").unwrap_or(now).to_owned();
    map.insert("created_at".into(), created.into());
    map.insert("updated_at".into(), now.into());
    for (key, value) in &record.map {
        if key != "id" && key != "title" && !map.contains_key(key) {
            map.insert(key.clone(), value.clone());
        }
    }
    Record::new(record.id.clone(), map)
}

impl Record {
    fn new(id: String, map: Map<String, Value>) -> Record {
        Record {
            raw: Value::Object(map.clone()).to_string(),
            id,
            map,
            line: 0,
        }
    }
}

/// The highest `order` of `records`, when any has one.
fn last_order<'a>(records: impl Iterator<Item = &'a Record>) -> Option<u64> {
    records
        .filter_map(|r| r.map.get("order").and_then(Value::as_f64))
        .filter(|o| o.is_finite() && *o >= 0.0)
        .map(|o| o.ceil() as u64)
        .max()
}

/// Both files merged: the tasks in order, within the limits.
struct Merged<'a> {
    tasks: Vec<ListedTask>,
    /// The records taken, and whether each is of loopd's own record only.
    taken: Vec<(&'a Record, bool)>,
    warnings: Vec<String>,
}

impl<'a> Merged<'a> {
    fn of(id: &str, shared: &'a Parsed, own: &'a Parsed) -> Merged<'a> {
        // CCW's file first: its version of a record wins, and its records come first at an
        // equal `order`.
        let mut records: Vec<(&Record, bool)> = shared.records().map(|r| (r, false)).collect();
        records.extend(
            own.records()
                .filter(|r| shared.record(&r.id).is_none())
                .map(|r| (r, true)),
        );
        // Stable: records without an `order` keep their place after those with one.
        let order = |r: &Record| r.map.get("order").and_then(Value::as_f64);
        records.sort_by(|(a, a_own), (b, b_own)| match (order(a), order(b)) {
            (Some(x), Some(y)) => x.total_cmp(&y).then(a_own.cmp(b_own)),
            (x, y) => y.is_some().cmp(&x.is_some()).then(a_own.cmp(b_own)),
        });
        let mut merged = Merged {
            tasks: Vec::new(),
            taken: Vec::new(),
            warnings: shared
                .warnings
                .iter()
                .chain(&own.warnings)
                .cloned()
                .collect(),
        };
        for (record, only_own) in records {
            let path = || match only_own {
                false => format!("{id}/{SHARED}"),
                true => File::Own.name(id),
            };
            let text = |key: &str| {
                record
                    .map
                    .get(key)
                    .and_then(Value::as_str)
                    .filter(|s| !s.trim().is_empty())
                    .map(str::to_owned)
            };
            let description = text("description")
                .or_else(|| text("title"))
                .unwrap_or_default();
            if description.len() > MAX_DESCRIPTION {
                merged.warnings.push(format!(
                    "{}:{}: the description of task {:?} is {} bytes, over the limit of \
                     {MAX_DESCRIPTION}; this record is skipped",
                    path(),
                    record.line,
                    record.id,
                    description.len()
                ));
                continue;
            }
            if merged.tasks.len() == MAX_LISTED {
                merged.warnings.push(format!(
                    "{}:{}: over the limit of {MAX_LISTED} tasks; this record and the rest are \
                     skipped",
                    path(),
                    record.line
                ));
                break;
            }
            merged.tasks.push(ListedTask {
                id: record.id.clone(),
                description,
                tool: text("tool"),
                mode: text("mode"),
                created_at: text("created_at"),
                order: record.map.get("order").cloned(),
                after: record
                    .map
                    .get("after")
                    .and_then(|a| serde_json::from_value(a.clone()).ok()),
                race: record
                    .map
                    .get("race")
                    .and_then(|r| serde_json::from_value(r.clone()).ok())
                    .unwrap_or_default(),
            });
            merged.taken.push((record, only_own));
        }
        merged
    }

    /// The tasks taken from loopd's own record that CCW's file lacks.
    fn unshared(&self) -> impl Iterator<Item = &'a Record> + '_ {
        self.taken
            .iter()
            .filter(|(_, only_own)| *only_own)
            .map(|(r, _)| *r)
    }
}

/// How tasks loopd adds are run: the tasks each needs done first, the executors that each try
/// it (`loopd task add --after`, `--race`).
#[derive(Clone, Copy, Debug, Default)]
pub struct NewTasks<'a> {
    pub after: &'a [String],
    pub race: &'a [String],
}

impl Store {
    /// The directory of CCW's task list (the loop's own subdirectory), if it exists; created
    /// (0700) when `create` is set.
    fn shared_dir(&self, dir: &Dir, id: &str, create: bool) -> Result<Option<Dir>, StoreError> {
        match dir.subdir(id, create) {
            Ok(sub) => Ok(Some(sub)),
            Err(e) if !create && e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&dir.join(id))(e)),
        }
    }

    /// The two files' directories: CCW's (if it exists), and the state directory.
    fn task_dirs(&self, id: &str) -> Result<Option<(Option<Dir>, Dir)>, StoreError> {
        crate::store::validate_id(id)?;
        let Some(dir) = self.existing_dir()? else {
            return Ok(None);
        };
        Ok(Some((self.shared_dir(&dir, id, false)?, dir)))
    }

    /// What identifies the task list files as they are now (see [`TasksStamp`]).
    pub fn tasks_stamp(&self, id: &str) -> TasksStamp {
        let Ok(Some((shared, own))) = self.task_dirs(id) else {
            return TasksStamp::default();
        };
        let stamp = |dir: Option<&Dir>, name: &str| {
            let stat = dir?.stat(name).ok()??;
            Some((stat.st_ino, stat.st_size, stat.st_mtime, stat.st_mtime_nsec))
        };
        TasksStamp([
            stamp(shared.as_ref(), SHARED),
            stamp(Some(&own), &File::Own.name(id)),
        ])
    }

    /// CCW's backup of its list (next to `path`), parsed; empty if there is none.
    fn parse_backup(dir: &Dir, path: &Path) -> Result<Parsed, StoreError> {
        Ok(Self::read_list(dir, SHARED_BACKUP)?
            .map(|text| Parsed::parse(File::Shared, &path.with_extension("jsonl.backup"), &text))
            .unwrap_or_default())
    }

    /// Reads one task list file: `None` if it does not exist.
    fn read_list(dir: &Dir, name: &str) -> Result<Option<String>, StoreError> {
        match dir.read(name, MAX_TASKS_FILE_SIZE) {
            Ok(bytes) => Ok(Some(String::from_utf8_lossy(&bytes).into_owned())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&dir.join(name))(e)),
        }
    }

    /// Both files, parsed: CCW's (with the records of its backup it lacks, when it is torn), and
    /// loopd's own record.
    fn parse_lists(&self, id: &str) -> Result<(Parsed, Parsed), StoreError> {
        let Some((shared_dir, own_dir)) = self.task_dirs(id)? else {
            return Ok(Default::default());
        };
        let read = |dir: &Dir, file: File, name: &str| -> Result<Parsed, StoreError> {
            Ok(Self::read_list(dir, name)?
                .map(|text| Parsed::parse(file, &dir.join(name), &text))
                .unwrap_or_default())
        };
        let mut shared = match &shared_dir {
            Some(dir) => read(dir, File::Shared, SHARED)?,
            None => Parsed::default(),
        };
        if let Some(dir) = shared_dir.as_ref().filter(|_| shared.is_torn()) {
            let restored = shared.restore_from(&Self::parse_backup(dir, &dir.join(SHARED))?);
            if restored > 0 {
                shared.warnings.push(format!(
                    "{}: a write was cut short; {restored} task(s) read from {SHARED_BACKUP}",
                    dir.join(SHARED).display(),
                ));
            }
        }
        let own = read(&own_dir, File::Own, &File::Own.name(id))?;
        Ok((shared, own))
    }

    /// Reads a loop's task list: both files merged (see the module's documentation).
    pub fn read_tasks(&self, id: &str) -> Result<TaskList, StoreError> {
        let stamp = self.tasks_stamp(id);
        let (shared, own) = self.parse_lists(id)?;
        let merged = Merged::of(id, &shared, &own);
        let unshared = merged.unshared().count();
        Ok(TaskList {
            tasks: merged.tasks,
            warnings: merged.warnings,
            unshared,
            stamp,
        })
    }

    /// Adds tasks to a loop's list, one per description, in loopd's own record and in CCW's
    /// file (see the module's documentation); returns their ids. Each gets the next `task-NNN`
    /// that neither the list nor `taken` (the ids the loop's state knows) has had, and is run
    /// as `how` says.
    pub fn add_tasks(
        &self,
        id: &str,
        descriptions: &[&str],
        how: &NewTasks<'_>,
        taken: &[String],
    ) -> Result<Vec<String>, StoreError> {
        crate::store::validate_id(id)?;
        let dir = self.state_dir(true)?;
        let shared_dir = self
            .shared_dir(&dir, id, true)?
            .expect("created when missing");
        let now = now_rfc3339();
        let added = {
            let _lock = self.lock(id)?;
            let (shared, own) = self.parse_lists(id)?;
            let first = loopd_core::state::next_task_number(
                shared
                    .records()
                    .chain(own.records())
                    .map(|r| r.id.as_str())
                    .chain(taken.iter().map(String::as_str)),
            );
            let next_order = last_order(shared.records().chain(own.records())).map_or(0, |o| o + 1);
            descriptions
                .iter()
                .enumerate()
                .map(|(i, description)| {
                    let id = loopd_core::state::task_id(first + i as u64);
                    let mut map = Map::new();
                    map.insert("task_id".into(), id.clone().into());
                    map.insert("description".into(), (*description).into());
                    // Written even when empty: loopd's tasks say what they need, where CCW's
                    // cannot.
                    map.insert("after".into(), how.after.into());
                    if !how.race.is_empty() {
                        map.insert("race".into(), how.race.into());
                    }
                    let record = Record::new(id, map);
                    shared_form(&record, next_order + i as u64, &now)
                })
                .collect::<Vec<Record>>()
        };
        self.write_list(&dir, id, File::Own, &added)?;
        self.write_list(&shared_dir, id, File::Shared, &added)?;
        // Those of loopd's record that CCW's file lost meanwhile go back there too.
        self.share_tasks(id)?;
        Ok(added.into_iter().map(|r| r.id).collect())
    }

    /// Writes into CCW's file the tasks of loopd's own record that it lacks (a rewrite by CCW
    /// from an older copy, a task added by an earlier loopd): returns how many.
    pub fn share_tasks(&self, id: &str) -> Result<usize, StoreError> {
        crate::store::validate_id(id)?;
        let dir = self.state_dir(true)?;
        let missing: Vec<Record> = {
            let _lock = self.lock(id)?;
            let (shared, own) = self.parse_lists(id)?;
            let mut order = last_order(shared.records().chain(own.records())).map_or(0, |o| o + 1);
            let now = now_rfc3339();
            Merged::of(id, &shared, &own)
                .unshared()
                .map(|r| {
                    order += 1;
                    // Its own order kept where it has one: its place among the others.
                    let place = r
                        .map
                        .get("order")
                        .and_then(Value::as_u64)
                        .unwrap_or(order - 1);
                    shared_form(r, place, &now)
                })
                .collect()
        };
        if missing.is_empty() {
            return Ok(0);
        }
        let shared_dir = self
            .shared_dir(&dir, id, true)?
            .expect("created when missing");
        self.write_list(&shared_dir, id, File::Shared, &missing)?;
        Ok(missing.len())
    }

    /// Puts `additions` into one task list file (those whose id it has are left as they are),
    /// merging what lockless writers write meanwhile (see the module's documentation).
    fn write_list(
        &self,
        dir: &Dir,
        id: &str,
        file: File,
        additions: &[Record],
    ) -> Result<(), StoreError> {
        let name = file.name(id);
        let path = dir.join(&name);
        // What a lockless writer wrote into the version replaced last, and that version as it
        // was replaced; nothing yet.
        let mut theirs: Option<(Parsed, Parsed)> = None;
        for _ in 0..MERGE_ROUNDS {
            let replaced = {
                let _lock = self.lock(id)?;
                let before = Self::read_list(dir, &name)?;
                let mut list = before
                    .as_deref()
                    .map(|t| Parsed::parse(file, &path, t))
                    .unwrap_or_default();
                if let Some((base, late)) = theirs.take() {
                    list.merge(&base, &late);
                }
                if file == File::Shared && list.is_torn() {
                    // A write of CCW's cut short: what it lost is in its backup.
                    list.restore_from(&Self::parse_backup(dir, &path)?);
                }
                for record in additions {
                    if list.record(&record.id).is_none() {
                        list.put(record.clone());
                    }
                }
                let text = list.render();
                if before.as_deref() == Some(text.as_str()) {
                    return Ok(());
                }
                if file == File::Shared
                    && let Some(before) = &before
                {
                    // CCW's habit: the list as it was, before each write.
                    dir.write_atomic(SHARED_BACKUP, before.as_bytes(), false)
                        .map_err(io_err(&dir.join(SHARED_BACKUP)))?;
                }
                match put_in_place(dir, &name, text.as_bytes(), before.as_deref())
                    .map_err(io_err(&path))?
                {
                    Placed::Replaced(tmp) => (tmp, before.unwrap_or_default()),
                    Placed::Renamed => return Ok(()),
                    // A lockless writer made or changed the file meanwhile: read it again.
                    Placed::Raced => continue,
                }
            };
            let (tmp, base) = replaced;
            if file == File::Own {
                // Only loopd writes its record, under the lock: no late write to wait for.
                let _ = dir.remove(&tmp);
                return Ok(());
            }
            let late = match settle_replaced(dir, &tmp) {
                Some(late) if late != base => late,
                _ => return Ok(()),
            };
            tracing::debug!(
                "another writer changed {} meanwhile; merging",
                path.display()
            );
            theirs = Some((
                Parsed::parse(file, &path, &base),
                Parsed::parse(file, &path, &late),
            ));
        }
        tracing::warn!(
            "warning: {} kept changing under loopd's write; what was written last stands",
            path.display()
        );
        Ok(())
    }
}

/// How [`put_in_place`] put a new version in place.
enum Placed {
    /// Exchanged with the version in place, which now has this temporary name.
    Replaced(String),
    /// Renamed into place: the file was new, or (without an exchange) as expected just before.
    Renamed,
    /// Not placed: another writer made the file, or changed it, meanwhile. Read it again.
    Raced,
}

/// Puts `bytes` in place of `name`, which held `before` (`None`: it did not exist): a new
/// temporary file, exchanged with the file, or renamed to its name only if no file has it.
fn put_in_place(dir: &Dir, name: &str, bytes: &[u8], before: Option<&str>) -> io::Result<Placed> {
    let (tmp, file) = dir.temp_file(name)?;
    let written = loopd_fs::overwrite(&file, bytes);
    drop(file);
    let placed = written.and_then(|()| match before {
        Some(before) => match dir.exchange(&tmp, name) {
            Ok(()) => Ok(Placed::Replaced(tmp.clone())),
            Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                // No exchange here: compared just before a plain rename.
                if dir.read(name, MAX_TASKS_FILE_SIZE)? != before.as_bytes() {
                    return Ok(Placed::Raced);
                }
                dir.rename(&tmp, name).map(|()| Placed::Renamed)
            }
            Err(e) => Err(e),
        },
        None => match dir.rename_new(&tmp, name) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(Placed::Raced),
            other => other.map(|()| Placed::Renamed),
        },
    });
    if !matches!(placed, Ok(Placed::Replaced(_) | Placed::Renamed)) {
        let _ = dir.remove(&tmp);
    }
    placed
}

/// Waits until the replaced version `tmp` is open nowhere and [`ORPHAN_LIFE_SHORT`] old (while a
/// writer holds it open, until it closes it; at most [`OPEN_LIFE`] while a reader does;
/// [`ORPHAN_LIFE`] where the kernel cannot tell), then reads and removes it: what it holds then,
/// `None` if it is gone.
fn settle_replaced(dir: &Dir, tmp: &str) -> Option<String> {
    let since = Instant::now();
    loop {
        let file = dir.open_read(tmp).ok()?;
        let age = since.elapsed();
        let settled = match loopd_fs::open_for_writing(&file) {
            Some(true) => age >= WRITER_HOLD_MAX,
            _ => match loopd_fs::open_elsewhere(&file) {
                Some(false) => age >= ORPHAN_LIFE_SHORT,
                Some(true) => age >= OPEN_LIFE,
                None => age >= ORPHAN_LIFE,
            },
        };
        if settled {
            let text = loopd_fs::read_capped(file, MAX_TASKS_FILE_SIZE).ok();
            let _ = dir.remove(tmp);
            return text.map(|b| String::from_utf8_lossy(&b).into_owned());
        }
        drop(file);
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use loopd_core::state::{LoopState, Status};
    use std::fs;
    use std::io::Write as _;

    fn ids(list: &TaskList) -> Vec<&str> {
        list.tasks.iter().map(|t| t.id.as_str()).collect()
    }

    /// A store of a temporary directory holding loop `l1`.
    fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path(), ".");
        let state = LoopState {
            loop_id: "l1".into(),
            status: Status::Created,
            ..LoopState::default()
        };
        store.create(&state).unwrap();
        (dir, store)
    }

    /// Each line of CCW's file as CCW reads it (`JSON.parse` of each non-empty line).
    fn ccw_lines(dir: &Path) -> Vec<Value> {
        fs::read_to_string(dir.join("l1/tasks.jsonl"))
            .unwrap()
            .split('\n')
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or(Value::Null))
            .collect()
    }

    #[test]
    fn glued_and_torn_records_are_read_and_what_is_not_a_record_is_reported() {
        let text = concat!(
            r#"{"task_id":"b","description":"second","order":2}"#,
            "\n",
            r#"{"task_id":"a","description":"first","order":1}{"task_id":"c","description":"third","order":3}"#,
            "\nnot json\n",
            // A record cut short, and the next one appended onto it.
            r#"{"task_id":"e","descr{"task_id":"d","description":"last, no newline"}"#
        );
        let parsed = Parsed::parse(File::Shared, Path::new("t.jsonl"), text);
        let ids: Vec<&str> = parsed.records().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["b", "a", "c", "d"]);
        assert_eq!(parsed.warnings.len(), 2, "{:?}", parsed.warnings);
        assert!(parsed.warnings[0].starts_with("t.jsonl:3:"));
        assert!(parsed.warnings[1].contains("up to the next record"));
        assert!(parsed.is_torn());
        // Rendered one piece a line: CCW's parser now reads every record.
        let rendered = parsed.render();
        assert_eq!(rendered.lines().count(), 6, "{rendered}");
        assert!(rendered.lines().any(|l| l == r#"{"task_id":"e","descr"#));
        // Ids are unique and do not move when records are appended; each file its own.
        let text = "{\"description\":\"A\"}\n{\"task_id\":\"\",\"description\":\"B\"}\n{\"task_id\":\"x\"}\n{\"task_id\":\"x\"}\n";
        let own = Parsed::parse(File::Own, Path::new("t.jsonl"), text);
        let ids: Vec<&str> = own.records().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["jsonl-1", "jsonl-2", "x"]);
        assert!(own.warnings[0].contains("\"x\" appears again"));
        let shared = Parsed::parse(File::Shared, Path::new("t.jsonl"), text);
        assert_eq!(shared.records().next().unwrap().id, "ccw-jsonl-1");
    }

    #[test]
    fn both_files_are_one_list_in_order_with_ccws_version_first() {
        let (dir, store) = store();
        fs::create_dir(dir.path().join("l1")).unwrap();
        fs::write(
            dir.path().join("l1/tasks.jsonl"),
            concat!(
                r#"{"task_id":"t-2","description":"edited by CCW","order":1}"#,
                "\n",
                r#"{"task_id":"t-9","description":"CCW's own","order":0}"#
            ),
        )
        .unwrap();
        fs::write(
            dir.path().join("l1.tasks.jsonl"),
            concat!(
                r#"{"task_id":"t-1","description":"loopd's","order":1}"#,
                "\n",
                r#"{"task_id":"t-2","description":"as loopd wrote it","order":1}"#,
                "\n",
                r#"{"description":"no order, no id"}"#,
                "\n"
            ),
        )
        .unwrap();
        let list = store.read_tasks("l1").unwrap();
        assert_eq!(ids(&list), ["t-9", "t-2", "t-1", "jsonl-3"]);
        assert_eq!(list.tasks[1].description, "edited by CCW");
        assert_eq!(list.unshared, 2, "t-1 and jsonl-3 are loopd's only");
        assert!(list.warnings.is_empty(), "{:?}", list.warnings);
        assert!(!list.stamp.is_empty());
        // Written into CCW's file, in CCW's shape, with the ids they had.
        assert_eq!(store.share_tasks("l1").unwrap(), 2);
        let lines = ccw_lines(dir.path());
        let shared: Vec<&str> = lines
            .iter()
            .map(|l| l["task_id"].as_str().unwrap())
            .collect();
        assert_eq!(shared, ["t-2", "t-9", "t-1", "jsonl-3"]);
        for line in &lines[2..] {
            for key in [
                "description",
                "tool",
                "mode",
                "prompt_template",
                "created_at",
            ] {
                assert!(line[key].is_string(), "{key} in {line}");
            }
            assert!(line["order"].is_u64(), "{line}");
        }
        // CCW's habit: the list as it was, before the write.
        let backup = fs::read_to_string(dir.path().join("l1/tasks.jsonl.backup")).unwrap();
        assert!(backup.contains("CCW's own") && !backup.contains("loopd's"));
        assert_eq!(store.read_tasks("l1").unwrap().unshared, 0);
        assert_eq!(store.share_tasks("l1").unwrap(), 0);
    }

    #[test]
    fn added_tasks_go_to_both_files_numbered_past_every_id_known() {
        let (dir, store) = store();
        let added = store
            .add_tasks("l1", &["one", "two"], &NewTasks::default(), &[])
            .unwrap();
        assert_eq!(added, ["task-001", "task-002"]);
        let taken = vec!["task-007".to_owned()];
        assert_eq!(
            store
                .add_tasks("l1", &["three"], &NewTasks::default(), &taken)
                .unwrap(),
            ["task-008"]
        );
        let lines = ccw_lines(dir.path());
        let orders: Vec<u64> = lines.iter().map(|l| l["order"].as_u64().unwrap()).collect();
        assert_eq!(orders, [0, 1, 2]);
        assert_eq!(lines[2]["mode"], "write");
        assert_eq!(lines[2]["prompt_template"], "three");
        let own = fs::read_to_string(dir.path().join("l1.tasks.jsonl")).unwrap();
        assert_eq!(own.lines().count(), 3);
        assert!(own.ends_with('\n'));
        let list = store.read_tasks("l1").unwrap();
        assert_eq!(ids(&list), ["task-001", "task-002", "task-008"]);
        assert_eq!(list.unshared, 0);
        // Private, as every file loopd makes.
        use std::os::unix::fs::PermissionsExt as _;
        let mode = |p: &str| {
            fs::metadata(dir.path().join(p))
                .unwrap()
                .permissions()
                .mode()
        };
        assert_eq!(mode("l1") & 0o777, 0o700);
        assert_eq!(mode("l1/tasks.jsonl") & 0o777, 0o600);
        assert!(
            fs::read_dir(dir.path().join("l1")).unwrap().all(|e| !e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".tmp")),
            "no temporary file is left"
        );
    }

    #[test]
    fn a_lockless_append_that_lands_in_the_replaced_version_is_merged() {
        let (dir, store) = store();
        store
            .add_tasks("l1", &["one"], &NewTasks::default(), &[])
            .unwrap();
        let path = dir.path().join("l1/tasks.jsonl");
        // CCW opens the file to append just before loopd's write replaces it, and writes after.
        let mut late = fs::OpenOptions::new().append(true).open(&path).unwrap();
        let replaced = {
            use std::os::unix::fs::MetadataExt as _;
            let ino = fs::metadata(&path).unwrap().ino();
            let path = path.clone();
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                while fs::metadata(&path).unwrap().ino() == ino {
                    assert!(Instant::now() < deadline, "loopd's write never came");
                    std::thread::sleep(Duration::from_millis(1));
                }
                late.write_all(
                    b"{\"task_id\":\"ccw-late\",\"description\":\"late\",\"order\":5}\n",
                )
                .unwrap();
            })
        };
        store
            .add_tasks("l1", &["two"], &NewTasks::default(), &[])
            .unwrap();
        replaced.join().unwrap();
        let list = store.read_tasks("l1").unwrap();
        assert_eq!(ids(&list), ["task-001", "task-002", "ccw-late"]);
        let shared: Vec<String> = ccw_lines(dir.path())
            .iter()
            .map(|l| l["task_id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(shared, ["task-001", "task-002", "ccw-late"]);
    }

    #[test]
    fn a_merge_takes_what_they_added_or_changed_and_drops_nothing() {
        let parse = |t: &str| Parsed::parse(File::Shared, Path::new("t"), t);
        let base = parse("{\"task_id\":\"a\",\"v\":1}\n{\"task_id\":\"b\",\"v\":1}\n");
        // Theirs: `a` changed, `b` removed, `c` added; mine: `d` added.
        let theirs = parse("{\"task_id\":\"a\",\"v\":2}\n{\"task_id\":\"c\",\"v\":1}\n");
        let mut mine = parse(
            "{\"task_id\":\"a\",\"v\":1}\n{\"task_id\":\"b\",\"v\":1}\n{\"task_id\":\"d\",\"v\":1}\n",
        );
        mine.merge(&base, &theirs);
        assert_eq!(
            mine.render(),
            "{\"task_id\":\"a\",\"v\":2}\n{\"task_id\":\"b\",\"v\":1}\n{\"task_id\":\"d\",\"v\":1}\n{\"task_id\":\"c\",\"v\":1}\n"
        );
    }
}
