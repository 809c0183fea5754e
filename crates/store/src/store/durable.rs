//! Durability: a durable write's version recorded in the loop's backup `{id}.json.bak` (on a
//! backup thread of the state directory's filesystem, so the loop goes on while it is fdatasynced),
//! and a state file restored or rebuilt from it.

use super::*;
use crate::helper::Helper;

use std::borrow::Cow;
use std::time::SystemTime;

/// The process's backup threads, one per filesystem its stores are on (a service drives many
/// loops, and a slow or full disk must hold up no loop of another), each started on first use:
/// it records the backups it is handed, in order.
pub(super) static BACKUP_THREADS: LazyLock<Mutex<HashMap<u64, BackupThread>>> =
    LazyLock::new(Default::default);

/// A backup thread: its jobs, and the thread (see [`Helper`]).
#[derive(Clone)]
pub(super) struct BackupThread {
    jobs: mpsc::Sender<BackupJob>,
    thread: Arc<Helper>,
}

impl BackupThread {
    /// Hands `job` over, on another CPU than the caller's where there is one: the caller goes on
    /// to ready the next attempt, which then waits for this job.
    fn hand(&self, job: BackupJob) -> bool {
        self.thread.keep_off_callers_cpu();
        self.jobs.send(job).is_ok()
    }

    #[cfg(test)]
    pub(super) fn tid(&self) -> i32 {
        self.thread.tid()
    }
}

/// The backup thread of the filesystem `dev`; `None` if it cannot start.
pub(super) fn backup_thread(dev: u64) -> Option<BackupThread> {
    let mut threads = lock(&BACKUP_THREADS);
    if let Some(thread) = threads.get(&dev) {
        return Some(thread.clone());
    }
    let (jobs, queue) = mpsc::channel::<BackupJob>();
    let thread = Arc::new(Helper::unknown());
    let started = Helper::spawn("loopd-backup", thread.clone(), move || {
        for job in queue {
            job.store.record_backup(&job.id, &job.bytes, job.progress);
            let _ = job.done.send(());
        }
    });
    match started {
        Ok(()) => {
            let thread = BackupThread { jobs, thread };
            threads.insert(dev, thread.clone());
            Some(thread)
        }
        Err(e) => {
            tracing::warn!("cannot start a backup thread ({e}); writing backups at once");
            None
        }
    }
}

/// A version to record in the backup of loop `id` of `store`; `done` is told when it is durable.
#[derive(Debug)]
pub(super) struct BackupJob {
    store: Store,
    id: String,
    bytes: Arc<Vec<u8>>,
    /// How far the loop had come in it (see [`backup::Recorded::Behind`]).
    progress: u64,
    done: mpsc::SyncSender<()>,
}

/// Whether `state` is older than `backed`, a version a durable write recorded in the backup: the
/// later `updated_at` (every loopd writer sets it) is the newer.
pub(super) fn is_older(state: &LoopState, backed: &LoopState) -> bool {
    older_time(state, backed)
}

/// Whether loopd's own fields of `state` are older than those of `backed` (see [`is_older`]): its
/// count of finished actions (`skill_state.seq`), which only ever grows, is lower. Another writer
/// put back a copy it read before (a lockless writer's stale read, a command's read-modify-write
/// of that copy since), whatever its `updated_at` says.
/// Only of the same loop: a loop made anew under the id of a removed one (its `created_at`
/// differs) has nothing to take from the old one's backup; and a state without `skill_state`
/// (lost, or taken away on purpose) is rebuilt, not put back.
pub(super) fn fields_older(state: &LoopState, backed: &LoopState) -> bool {
    match (&state.skill_state, &backed.skill_state) {
        (Some(now), Some(then)) => state.created_at == backed.created_at && now.seq < then.seq,
        _ => false,
    }
}

/// Why loopd's fields of `current` were taken from `backed`, a later durable write.
fn put_back_older(current: &LoopState, backed: &LoopState) -> String {
    let seq = |s: &LoopState| s.skill_state.as_ref().map_or(0, |k| k.seq);
    format!(
        "its loopd fields were older than its last durable write ({} actions finished, not {}): \
         another writer put back a copy it had read before",
        seq(current),
        seq(backed)
    )
}

/// Whether the machine started after `written` (by the boot time the kernel keeps, suspends
/// included): a file written before may have lost writes that never reached the disk; one
/// written since has lost none. `true` when that cannot be told.
fn started_since(written: SystemTime) -> bool {
    let Ok(up) = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME) else {
        return true;
    };
    let up = Duration::from(up);
    SystemTime::now()
        .checked_sub(up)
        .is_none_or(|booted| written < booted)
}

fn older_time(state: &LoopState, backed: &LoopState) -> bool {
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

impl Store {
    /// From now on, a durable write returns once its version is in place, and is made durable
    /// (its backup recorded: see `backup`) on the backup thread of its filesystem
    /// (`BACKUP_THREADS`) while the
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

    /// Hands the version `bytes` of loop `id`, that far (`progress`, see [`Store::record_version`]),
    /// to the backup thread, if durability is deferred and that thread runs; whether it did.
    pub(super) fn defer_backup(&self, id: &str, bytes: &Arc<Vec<u8>>, progress: u64) -> bool {
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
            bytes: bytes.clone(),
            progress,
            done,
        };
        let sent = jobs.hand(job);
        if sent {
            lock(deferred).push(recorded);
        }
        sent
    }

    /// Records `bytes` in the backup of loop `id`, on the backup thread: if that fails, the
    /// state file is fsynced instead, under the loop's lock (so after the write that handed
    /// `bytes` over has put them in place).
    pub(super) fn record_backup(&self, id: &str, bytes: &[u8], progress: u64) {
        let Ok(dir) = self.state_dir(false) else {
            return;
        };
        match self.record_version(&dir, id, bytes, progress) {
            Ok(()) => self.backup_recorded(id),
            Err(e) => {
                let _lock = self.lock(id);
                self.sync_without_backup(&dir, id, &e);
            }
        }
    }

    /// Records the version `bytes` of loop `id` in its backup (see [`backup`]); `progress` is its
    /// count of finished actions (0: not known). Where the newest record is further on (the
    /// daemon's record of later progress got there first, and this version was made on a copy
    /// another program put back), this version is recorded with that record's loopd fields: the
    /// backup's progress never goes back.
    pub(super) fn record_version(
        &self,
        dir: &Dir,
        id: &str,
        bytes: &[u8],
        progress: u64,
    ) -> io::Result<()> {
        let name = backup_name(id);
        let path = self.state_path(id);
        let mut version = Cow::Borrowed(bytes);
        let mut progress = progress;
        for _ in 0..WRITE_RACE_RETRIES {
            let newer = match backup::record(dir, &name, &version, progress)? {
                backup::Recorded::Done => return Ok(()),
                backup::Recorded::Behind(newer) => newer,
            };
            let (Ok(mine), Ok(newer)) =
                (Loaded::parse(&path, &version), Loaded::parse(&path, &newer))
            else {
                break;
            };
            if !fields_older(&mine.state, &newer.state) {
                break; // another loop's, made before this one under its id
            }
            let Ok(fields) = write::daemon_fields(&newer.state) else {
                break;
            };
            let mut raw = mine.raw;
            raw.extend(fields);
            version =
                Cow::Owned(write::to_pretty(&path, &Value::Object(raw)).map_err(io::Error::other)?);
            progress = newer.state.skill_state.as_ref().map_or(0, |k| k.seq);
        }
        backup::record(dir, &name, &version, 0).map(drop)
    }

    /// A backup of `id` was written: if it could not be before, that is said.
    pub(super) fn backup_recorded(&self, id: &str) {
        if lock(&self.backup_failing).remove(id) {
            tracing::info!(
                "the backup {} can be written again",
                self.backup_path(id).display()
            );
        }
    }

    /// The filesystem the state directory is on.
    pub(super) fn device(&self) -> Option<u64> {
        self.state_dir(false).ok()?.device()
    }

    /// The backup of a loop's state: the last durable writes of loopd's writers (see `backup`).
    pub fn backup_path(&self, id: &str) -> PathBuf {
        self.path.join(backup_name(id))
    }

    /// Repairs a state file that is missing, does not load, or is older than its backup (the
    /// machine stopped, since the backup was written, before the file reached the disk): from
    /// its backup if the backup loads, else by rebuilding `skill_state` from the progress files (the seed's "State Recovery") when
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
                // Older than the backup, after the machine stopped: the last writes never
                // reached the disk. Without a stop since the backup was written, another writer
                // put back a copy it had read before: its edits are kept, and loopd's own fields
                // repaired below.
                if is_older(&now.state, &backed.state) && self.stopped_since_backup(&dir, id) {
                    return self.restore_older(&dir, id, &bytes, &backed.state);
                }
                if fields_older(&now.state, &backed.state) {
                    let _lock = self.lock(id)?;
                    let (_, repaired) =
                        self.update_repairing(&dir, id, true, &mut |_, _| {}, &mut |_, _| None)?;
                    let from = self.backup_path(id).display().to_string();
                    return Ok(repaired.map(|reason| (reason, from)));
                }
                return Ok(None);
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

    /// The last durable write of loop `id` (see [`backup`]) and its loopd fields, when it loads.
    pub(super) fn backed(&self, dir: &Dir, id: &str) -> Option<(LoopState, Map<String, Value>)> {
        let bytes = backup::newest(dir, &backup_name(id), MAX_STATE_SIZE).ok()??;
        let backed = Loaded::parse(&self.state_path(id), &bytes).ok()?;
        let fields = write::daemon_fields(&backed.state).ok()?;
        Some((backed.state, fields))
    }

    /// Whether the machine may have stopped since the backup of `id` was last written.
    fn stopped_since_backup(&self, dir: &Dir, id: &str) -> bool {
        let written = dir.stat(&backup_name(id)).ok().flatten().map(|stat| {
            let since_epoch = Duration::new(
                u64::try_from(stat.st_mtime).unwrap_or(0),
                u32::try_from(stat.st_mtime_nsec).unwrap_or(0),
            );
            SystemTime::UNIX_EPOCH + since_epoch
        });
        written.is_none_or(started_since)
    }

    /// [`Store::restore`] of a state file older than its backup (`bytes`, of `backed`): the
    /// backup in its place, if it is still older under the lock.
    fn restore_older(
        &self,
        dir: &Dir,
        id: &str,
        bytes: &[u8],
        backed: &LoopState,
    ) -> Result<Option<(String, String)>, StoreError> {
        let path = self.state_path(id);
        let _lock = self.lock(id)?;
        if !self.load(id).is_ok_and(|now| is_older(&now.state, backed)) {
            return Ok(None);
        }
        dir.write_atomic(&state_name(id), bytes, true)
            .map_err(io_err(&path))?;
        let reason = format!(
            "it was older than its last durable write, of {}: the machine stopped before the \
             file reached the disk",
            backed.updated_at.as_deref().unwrap_or("?")
        );
        Ok(Some((reason, self.backup_path(id).display().to_string())))
    }

    /// [`Store::update_locked`], with loopd's fields first taken from the backup where another
    /// writer put them back older ([`fields_older`]); what others wrote since (a title, notes, a
    /// status) is kept. Returns why they were taken, when they were. Called with the loop's lock
    /// held.
    pub(super) fn update_repairing(
        &self,
        dir: &Dir,
        id: &str,
        durable: bool,
        change: write::Change<'_>,
        known: write::Known<'_>,
    ) -> Result<(Arc<LoopState>, Option<String>), StoreError> {
        // Read whole only when its header does not tell that the file is as far on (a file whose
        // progress is at least the newest record's is no older copy).
        let progress = backup::newest_progress(dir, &backup_name(id))
            .ok()
            .flatten();
        let mut backed = None;
        let repaired = std::cell::RefCell::new(None);
        let mut change = |raw: &mut Map<String, Value>, current: &LoopState| {
            repaired.replace(None);
            let seq = current.skill_state.as_ref().map_or(0, |k| k.seq);
            let as_far = progress.is_some_and(|p| p > 0 && seq >= p);
            if !as_far
                && let Some((backed, fields)) = backed.get_or_insert_with(|| self.backed(dir, id))
                && fields_older(current, backed)
            {
                repaired.replace(Some(put_back_older(current, backed)));
                raw.extend(fields.clone());
            }
            change(raw, current);
        };
        // A repaired version's typed result is the parse's to tell.
        let mut known = |raw: &Map<String, Value>, base: &LoopState| {
            repaired
                .borrow()
                .is_none()
                .then(|| known(raw, base))
                .flatten()
        };
        let state = self.update_locked(dir, id, durable, &mut change, &mut known)?;
        Ok((state, repaired.into_inner()))
    }

    /// The state of `id` for a daemon about to drive it: loopd's own fields taken from the
    /// backup where the file's are older (`fields_older`), and why. Read apart from any
    /// repair of the file, which a writer that takes no lock may undo at once: the daemon
    /// starts from its last durable progress whatever the file says, and its next write puts
    /// it back.
    pub fn load_own(&self, id: &str) -> Result<(Arc<LoopState>, Option<String>), StoreError> {
        let state = self.load_shared(id)?;
        let backed = self
            .existing_dir()?
            .and_then(|dir| self.backed(&dir, id))
            .filter(|(backed, _)| fields_older(&state, backed));
        let Some((backed, _)) = backed else {
            return Ok((state, None));
        };
        let why = put_back_older(&state, &backed);
        let mut own = LoopState::clone(&state);
        own.current_iteration = backed.current_iteration;
        own.skill_state = backed.skill_state;
        Ok((Arc::new(own), Some(why)))
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
    pub(super) fn rebuild(&self, dir: &Dir, id: &str) -> Result<Vec<u8>, String> {
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
        let workflow =
            loopd_core::workflow::by_name(name.as_deref().unwrap_or(loopd_core::workflow::DEFAULT))
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

    /// Makes the version just put in place of the state file durable when its backup (see
    /// [`backup`]) could not be written (`e`: a full disk, something planted in its place): by
    /// an fsync of the state file and of the directory.
    pub(super) fn sync_without_backup(&self, dir: &Dir, id: &str, e: &io::Error) {
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
}
