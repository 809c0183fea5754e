//! The orphan merge: versions of the state file replaced by an exchange are kept for a while, a
//! late write into one (a lockless writer that opened the file just before) is merged into the
//! state file, and settled versions are reused as spares; a short-lived command hands its
//! replaced versions over to a process that watches the directory.

use super::*;

use std::collections::VecDeque;
use std::time::SystemTime;

/// How long a replaced version is kept for a late write into it by a writer that takes no lock,
/// where the kernel cannot tell whether a writer has it open (no leases); and how often one that
/// a writer holds open is looked at again. A version a writer holds open is kept, however long
/// the writer takes to write, until it closes it ([`WRITER_HOLD_MAX`] aside).
pub const ORPHAN_LIFE: Duration = Duration::from_millis(300);

/// How many settled versions of one loop are left for the next writes to reuse.
pub(super) const MAX_SPARES: usize = 8;

/// How long a short-lived command keeps its replaced versions before it exits ([`Store::close`]):
/// a lockless writer that opened the file before the exchange writes within microseconds. Also
/// how long a replaced version that no process has open is kept: an open of the state file begun
/// before the exchange (its name looked up) and not yet done is over well within it.
pub(crate) const ORPHAN_LIFE_SHORT: Duration = Duration::from_millis(30);

/// How long a replaced version that a writer holds open is kept for its write, at most: not a
/// guess at how fast a writer is (one descheduled for seconds is waited for), but a bound for one
/// that never writes nor closes it, so that no command waits on it for ever.
pub const WRITER_HOLD_MAX: Duration = Duration::from_secs(60);

/// The replaced versions kept in one state directory by this process.
pub(super) type Orphans = Arc<Mutex<Kept>>;

/// The replaced versions kept in one state directory, and what this process's watchers saw
/// written into them.
#[derive(Debug, Default)]
pub(super) struct Kept {
    pub(super) orphans: Vec<Orphan>,
    /// Replaced versions a watcher saw written into before they were kept (the late write's event
    /// can overtake the writer's bookkeeping), and when.
    pub(super) early: Vec<(String, Instant)>,
    /// The loops whose writes into replaced versions a watcher of this process reports
    /// ([`Store::watch_orphans`]), and by how many watchers. A settle reads their versions only
    /// when one was written into or its time is up; any other loop's, every time.
    pub(super) watched: HashMap<String, usize>,
    /// Woken when a version is kept: a watcher sleeps until the oldest one's time is up.
    pub(super) added: Arc<tokio::sync::Notify>,
    /// Settled versions, nobody's any more, left in place for the next writes to reuse (no inode
    /// allocated or released per write: see [`Dir::open_existing_rw`]): by loop, their
    /// temporary names.
    pub(super) spares: Vec<(String, String)>,
    /// Spares taken for a write, and when: the writes into them are the writer's own, not late
    /// writes, until a watcher sees them renamed into place ([`Store::reusing`]).
    pub(super) reusing: Vec<(String, Instant)>,
    /// The last edits late writes made, merged here, of each loop, oldest first (see [`Merged`]).
    pub(super) merged: Vec<Merged>,
    /// The versions loopd's writers put in place lately (this process's, and those handed over),
    /// of every loop, oldest first (see [`Placed`]).
    pub(super) placed: VecDeque<Placed>,
}

/// How long a version put in place is remembered (see [`Placed`]): longer than a replaced
/// version waits for its merge ([`ORPHAN_LIFE`]); and how many are, of all loops at most (a
/// lockless writer reads a version a few writes before the one it goes into; a loop that writes
/// hundreds of versions a second must not keep them all).
const PLACED_LIFE: Duration = Duration::from_secs(1);
const MAX_PLACED: usize = 32;

/// A version of a loop that one of loopd's writers put in place: the version a late write was
/// read from, when it is not the one it went into. A lockless writer reads the file, then
/// opens it to write: if versions were put in place meanwhile, it writes into a later one than
/// it read, and what it wrote differs from that one by its edit and by every change made in
/// between (a pause, then a resume, which its stale copy would undo). Its edit is what it
/// changed from the version it read: the one whose `updated_at` (set by every write of loopd's,
/// and kept by such a writer) its own holds.
#[derive(Debug, Clone)]
pub(super) struct Placed {
    id: String,
    /// When it was put in place (the version before it replaced).
    at: SystemTime,
    bytes: Arc<Vec<u8>>,
}

/// How many merged edits of one loop are remembered (see [`Merged`]).
const MAX_MERGED: usize = 16;

/// An edit of one key that a late write into a replaced version made, merged into the state
/// file. A late write into a version replaced later was begun after it (that version was put in
/// place after this one was replaced, and opened while in place), so it is the newer edit: the
/// merge of this one, though written after the later version was replaced, is no change made
/// since, and does not keep the newer edit out (see [`Store::as_if_merged`]).
#[derive(Debug, Clone)]
pub(super) struct Merged {
    id: String,
    key: String,
    /// When the version the late write went into was replaced.
    replaced: SystemTime,
    /// When the merge was in place.
    at: SystemTime,
    /// The key's value before and after the merge (`None`: absent).
    before: Option<Value>,
    after: Option<Value>,
}

/// The replaced versions kept by this process's stores of the state directory `path`: one list
/// however many stores the process has of it (the service's loops and its API each have one), so
/// that a sweep by one never removes a version another keeps for a late write.
pub(super) fn shared_orphans(path: &Path) -> Orphans {
    static ALL: std::sync::LazyLock<Mutex<HashMap<PathBuf, Orphans>>> =
        std::sync::LazyLock::new(Default::default);
    let mut all = lock(&ALL);
    all.entry(path.to_owned()).or_default().clone()
}

#[derive(Debug, Clone)]
pub(super) struct Orphan {
    pub(super) id: String,
    pub(super) name: String,
    /// What it held when it was replaced: a late write is what differs from it.
    pub(super) base: Arc<Vec<u8>>,
    /// What replaced it: a key the state file no longer holds as written there was changed by
    /// someone since, and is theirs to keep.
    pub(super) written: Arc<Vec<u8>>,
    pub(super) since: Instant,
    /// When it is to be looked at again if no write into it is seen: [`ORPHAN_LIFE`] after it
    /// was kept, then as long again each time a writer still holds it open.
    pub(super) due: Instant,
    /// When it was replaced, by the clock of every process (`None`: not known, handed over by an
    /// older loopd): orders late writes into versions replaced by different processes.
    pub(super) replaced: Option<SystemTime>,
    /// A watcher saw a write into it since it was last read.
    pub(super) touched: bool,
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

impl Kept {
    /// Remembers a version put in place (see [`Placed`]), forgetting the oldest past the bounds:
    /// a look at the front of the list, not at every loop's versions, at every write.
    fn place(&mut self, version: Placed) {
        let now = SystemTime::now();
        let expired = |p: &Placed| now.duration_since(p.at).is_ok_and(|age| age >= PLACED_LIFE);
        while self
            .placed
            .front()
            .is_some_and(|p| expired(p) || self.placed.len() >= MAX_PLACED)
        {
            self.placed.pop_front();
        }
        self.placed.push_back(version);
    }
}

/// The top-level keys a lockless writer changed from `base` in `theirs`, but for the daemon's own
/// fields and `updated_at`.
pub(super) fn changed_keys(base: &Map<String, Value>, theirs: &Map<String, Value>) -> Vec<String> {
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

/// Whether `pid` is another process that still runs (a zombie, killed and not yet reaped,
/// does not).
fn another_living(pid: u32) -> bool {
    if pid == 0 || pid == std::process::id() {
        return false;
    }
    // `/proc/PID/stat`: `PID (COMM) STATE ...`, COMM possibly holding spaces and parentheses.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
    })
}

/// The hand-over note of the replaced version `orphan` (`.{id}.json.PID-XXXXXX.tmp`).
pub(super) fn handover_name(orphan: &str) -> String {
    format!(
        "{}{HANDOVER_SUFFIX}",
        orphan.strip_suffix(TEMP_SUFFIX).unwrap_or(orphan)
    )
}

/// The suffix of a hand-over note.
pub const HANDOVER_SUFFIX: &str = ".handover";

/// The loop and the replaced version a hand-over note names, from its name alone.
pub(super) fn handed_over(name: &str) -> Option<(&str, String)> {
    let stem = name.strip_prefix('.')?.strip_suffix(HANDOVER_SUFFIX)?;
    let (id, _) = stem.split_once(".json.")?;
    (!stem.contains('/')).then(|| (id, format!(".{stem}{TEMP_SUFFIX}")))
}

/// `t` in nanoseconds since the epoch, as a hand-over note says it.
fn nanos(t: SystemTime) -> Option<u64> {
    let ns = t.duration_since(SystemTime::UNIX_EPOCH).ok()?.as_nanos();
    u64::try_from(ns).ok()
}

impl Store {
    /// Keeps the version `name` of `id` for a late write into it; `replaced`: when (see
    /// [`Orphan::replaced`]).
    pub(super) fn keep_orphan(
        &self,
        id: &str,
        name: String,
        base: Arc<Vec<u8>>,
        written: Arc<Vec<u8>>,
        replaced: Option<SystemTime>,
    ) {
        let mut kept = lock(&self.orphans);
        let touched = match kept.early.iter().position(|(n, _)| *n == name) {
            Some(i) => {
                kept.early.swap_remove(i);
                true
            }
            None => false,
        };
        if let Some(at) = replaced {
            kept.place(Placed {
                id: id.to_owned(),
                at,
                bytes: written.clone(),
            });
        }
        kept.orphans.push(Orphan {
            id: id.to_owned(),
            name,
            base,
            written,
            since: Instant::now(),
            due: Instant::now() + ORPHAN_LIFE,
            replaced,
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
            .map(|o| o.due)
            .min()
    }

    /// The loops this process keeps replaced versions of, in order.
    fn orphan_ids(&self) -> Vec<String> {
        let kept = lock(&self.orphans);
        let mut ids: Vec<String> = kept.orphans.iter().map(|o| o.id.clone()).collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Settles the replaced versions of every loop that has some (see [`Store::settle`]).
    pub fn settle_every_loop(&self) {
        let ids = self.orphan_ids();
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
    pub(super) fn spare(&self, id: &str, name: &str) -> bool {
        let mut kept = lock(&self.orphans);
        let room = kept.spares.iter().filter(|(of, _)| of == id).count() < MAX_SPARES;
        if room {
            kept.spares.push((id.to_owned(), name.to_owned()));
        }
        room
    }

    /// A settled version of `id` to write the next version into, if one is left.
    pub(super) fn take_spare(&self, id: &str) -> Option<String> {
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
    /// process (`Store::hand_over`); the others are settled here, as `close` does. A command
    /// that wrote the state file of a loop a daemon or the service watches therefore exits as
    /// soon as its write is durable.
    pub fn close_with(&self, mut settler: impl FnMut(&str) -> Settler) {
        self.wait_durable();
        let Ok(dir) = self.state_dir(false) else {
            return;
        };
        let ids = self.orphan_ids();
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
    pub(super) fn leave(&self, id: &str) {
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
    /// directory: for each, a note `.{id}.json.PID-XXXXXX.handover` says what it held when it was
    /// replaced and what replaced it, and that process keeps and settles it as its own
    /// ([`Store::adopt`]). A version whose note cannot be written stays here, to be settled
    /// before the writer exits. Called with the loop's lock held.
    pub(super) fn hand_over(&self, dir: &Dir, id: &str) {
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
                "replaced": orphan.replaced.and_then(nanos),
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
    /// `Store::hand_over`): kept and settled as this process's own. Returns whether there was
    /// a note to take (another watch of this process may have taken it first).
    pub fn adopt(&self, name: &str) -> bool {
        let Some((id, _)) = handed_over(name) else {
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
        self.adopt_locked(&dir, name)
    }

    /// [`Store::adopt`] with the loop's lock held.
    fn adopt_locked(&self, dir: &Dir, name: &str) -> bool {
        let Some((id, orphan)) = handed_over(name) else {
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
        let replaced = note["replaced"]
            .as_u64()
            .map(|ns| SystemTime::UNIX_EPOCH + Duration::from_nanos(ns));
        self.keep_orphan(id, orphan, Arc::new(base), Arc::new(written), replaced);
        // Read at its settle whatever the events said: its writes came before this process knew
        // it.
        self.touch_orphans(id);
        true
    }

    /// Settles every replaced version before a short-lived process exits (or a loop is let go):
    /// each is kept until it is `ORPHAN_LIFE_SHORT` old, then merged if written into, else
    /// removed, with the spares left for reuse.
    pub fn close(&self) {
        self.wait_durable();
        self.settle_all(&[]);
    }

    /// Settles the replaced versions of every loop but those of `except`, waiting for them
    /// (see [`Store::close`]).
    pub(super) fn settle_all(&self, except: &[String]) {
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
    pub(super) fn settle_locked(&self, dir: &Dir, id: &str, all: bool) -> usize {
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
        let mut held = Vec::new();
        for orphan in mine {
            let Orphan {
                name,
                base,
                written,
                since,
                replaced,
                touched,
                ..
            } = orphan;
            let age = since.elapsed();
            let Ok(file) = dir.open_read(&name) else {
                done.push(name); // gone, or made into something else: nothing to merge
                continue;
            };
            // Whether a writer has it open, as the kernel tells (`None`: it cannot).
            let mut writing = loopd_fs::open_for_writing(&file);
            // Settled now (the process ends, or the loop is let go): a writer that holds it open
            // is half-way through its write, however slow, and is waited for until it closes it.
            while all && writing == Some(true) && since.elapsed() < WRITER_HOLD_MAX {
                std::thread::sleep(Duration::from_millis(5));
                writing = loopd_fs::open_for_writing(&file);
            }
            // Whether it is open anywhere else, a reader's open included.
            let elsewhere = match writing {
                Some(true) => Some(true),
                _ => loopd_fs::open_elsewhere(&file),
            };
            // Held open by a writer: it may still write into it, whenever it is scheduled again.
            // Open nowhere else: no writer is half-way through it, and none that opened the state
            // file before it was replaced can still come, once it is older than such an open
            // takes. A reader's open is waited for until the version's time is up.
            let settled = match (writing, elsewhere) {
                (Some(true), _) => age >= WRITER_HOLD_MAX,
                (_, Some(false)) => all || age >= ORPHAN_LIFE_SHORT,
                _ => all || age >= ORPHAN_LIFE,
            };
            if writing == Some(true) && !settled {
                held.push(name.clone());
            }
            // Under a watcher, a version not reported written into is read once it is settled.
            if watched && !touched && !settled {
                continue;
            }
            let read = || dir.read(&name, MAX_STATE_SIZE).ok();
            let Ok(mut now) = loopd_fs::read_capped(file, MAX_STATE_SIZE) else {
                done.push(name);
                continue;
            };
            // Where the kernel cannot tell whether a writer is half-way through it (it truncated
            // the file, and is descheduled before its write), one that must settle now gives it
            // the orphan's life to finish.
            while all
                && writing.is_none()
                && now != *base
                && serde_json::from_slice::<Value>(&now).is_err()
                && since.elapsed() < ORPHAN_LIFE
            {
                std::thread::sleep(Duration::from_millis(5));
                now = read().unwrap_or_default();
            }
            if now == *base {
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
                    late.push((base, theirs, written, replaced));
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
            for orphan in kept.orphans.iter_mut().filter(|o| held.contains(&o.name)) {
                orphan.due = Instant::now() + ORPHAN_LIFE;
            }
            if all {
                kept.spares.retain(|(of, name)| {
                    of != id || {
                        let _ = dir.remove(name);
                        false
                    }
                });
            }
        }
        if late.is_empty() {
            return 0;
        }
        // The versions other writers put in place since, and handed over: known before the
        // merge (see [`Placed`]).
        self.adopt_all(dir, id);
        let mut merged = 0;
        for (base, theirs, written, replaced) in late {
            let object = |bytes: &[u8]| match serde_json::from_slice::<Value>(bytes) {
                Ok(Value::Object(map)) => map,
                _ => Map::new(),
            };
            let (base, written) = (object(&base), object(&written));
            let read = self.read_from(id, base, &theirs);
            let changed = changed_keys(&read, &theirs);
            if changed.is_empty() {
                continue;
            }
            // A key someone changed in the state file since it replaced this version is theirs to
            // keep: a late write into a replaced version was begun before the exchange, so a
            // writer's later write of the same key went to the state file after it. (File times
            // cannot say which came first: they tick by the jiffy, and a file loopd renames in
            // bears its own time.) But for the merges of older late writes, made since: those
            // edits are older than this one ([`Merged`]).
            tracing::debug!(
                "a late write into a replaced version of {} changed {changed:?}; merging",
                path.display()
            );
            let mut edits = Vec::new();
            // A durable write like any other of loopd's: one made on a copy another writer put
            // back must not make that copy's loopd fields the backup's.
            let result = self.update_repaired(
                dir,
                id,
                true,
                &mut |raw, _| {
                    edits.clear();
                    for key in &changed {
                        let unchanged = self.as_if_merged(id, replaced, key, written.get(key));
                        if raw.get(key) != unchanged.as_ref() {
                            continue;
                        }
                        let before = match theirs.get(key) {
                            Some(v) => raw.insert(key.clone(), v.clone()),
                            None => raw.remove(key),
                        };
                        edits.push((key.clone(), before, theirs.get(key).cloned()));
                    }
                },
                &mut |_, _| None,
            );
            match result {
                Ok(_) => {
                    merged += 1;
                    if let Some(replaced) = replaced {
                        self.remember_merged(id, replaced, edits);
                    }
                }
                Err(e) => tracing::warn!(
                    "warning: cannot merge a late write into {}: {e}",
                    path.display()
                ),
            }
        }
        merged
    }

    /// The version of `id` a late write holding `theirs` was read from: `base`, the one it went
    /// into, unless it holds another `updated_at`, that of a version put in place before (see
    /// [`Placed`]).
    fn read_from(
        &self,
        id: &str,
        base: Map<String, Value>,
        theirs: &Map<String, Value>,
    ) -> Map<String, Value> {
        let stamp = theirs.get("updated_at");
        if stamp.is_none() || base.get("updated_at") == stamp {
            return base;
        }
        let placed: Vec<Arc<Vec<u8>>> = lock(&self.orphans)
            .placed
            .iter()
            .rev()
            .filter(|p| p.id == id)
            .map(|p| p.bytes.clone())
            .collect();
        placed
            .iter()
            .filter_map(|bytes| serde_json::from_slice::<Map<String, Value>>(bytes).ok())
            .find(|version| version.get("updated_at") == stamp)
            .unwrap_or(base)
    }

    /// Takes over every version of `id` handed over and not yet taken (see [`Store::adopt`]).
    /// Called with the loop's lock held.
    fn adopt_all(&self, dir: &Dir, id: &str) {
        let notes = format!(".{}.", state_name(id));
        for name in dir.entries().unwrap_or_default() {
            if name.starts_with(&notes) && name.ends_with(HANDOVER_SUFFIX) {
                self.adopt_locked(dir, &name);
            }
        }
    }

    /// What the version that replaced a version at `replaced` holds under `key` (`written`), as
    /// if the edits of late writes into versions replaced before (older edits) that were merged
    /// after it had been in it already: the key is unchanged since that version if the state
    /// file holds this.
    fn as_if_merged(
        &self,
        id: &str,
        replaced: Option<SystemTime>,
        key: &str,
        written: Option<&Value>,
    ) -> Option<Value> {
        let mut value = written.cloned();
        let Some(replaced) = replaced else {
            return value;
        };
        let kept = lock(&self.orphans);
        let older = kept
            .merged
            .iter()
            .filter(|m| m.id == id && m.key == key && m.replaced < replaced && replaced < m.at);
        for merge in older {
            if value == merge.before {
                value.clone_from(&merge.after);
            }
        }
        value
    }

    /// Remembers the `edits` (key, value before, value after) that a late write into a version of
    /// `id` replaced at `replaced` made, just merged (see [`Merged`]).
    fn remember_merged(
        &self,
        id: &str,
        replaced: SystemTime,
        edits: Vec<(String, Option<Value>, Option<Value>)>,
    ) {
        let at = SystemTime::now();
        let mut kept = lock(&self.orphans);
        for (key, before, after) in edits {
            if before == after {
                continue;
            }
            let of_id = kept.merged.iter().filter(|m| m.id == id).count();
            if of_id >= MAX_MERGED
                && let Some(oldest) = kept.merged.iter().position(|m| m.id == id)
            {
                kept.merged.remove(oldest);
            }
            kept.merged.push(Merged {
                id: id.to_owned(),
                key,
                replaced,
                at,
                before,
                after,
            });
        }
    }

    /// Removes temporary files that an interrupted write left behind (under the loop's lock, so
    /// no write of another loopd is in progress), and replaced versions no living writer keeps:
    /// not this process's, not one a hand-over note names, not one whose writer (its name says,
    /// [`loopd_fs::temp_writer`]) still runs, which keeps it until it hands it over or settles
    /// it. Returns how many were removed.
    pub fn sweep_temp_files(&self, id: &str) -> Result<usize, StoreError> {
        let dir = self.state_dir(false)?;
        let _lock = self.lock(id)?;
        // Versions another writer handed over, and nobody took: this process's now.
        self.adopt_all(&dir, id);
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
                    name.starts_with(&prefix)
                        && !kept.contains(&name)
                        && !dir.exists(&handover_name(&name))
                        && !loopd_fs::temp_writer(&name).is_some_and(another_living)
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
}
