//! Writing a version: a read-modify-write under the loop's lock, the new version written to a
//! temporary file and exchanged with the state file (`renameat2(RENAME_EXCHANGE)`), and the
//! daemon's commit of its own fields over what others wrote.

use super::*;

/// The [`DAEMON_FIELDS`] of `state`, as the whole state serializes them (without serializing the
/// rest).
pub(super) fn daemon_fields(state: &LoopState) -> serde_json::Result<Map<String, Value>> {
    let mut fields = Map::new();
    fields.insert("current_iteration".into(), state.current_iteration.into());
    if let Some(skill) = &state.skill_state {
        fields.insert("skill_state".into(), Value::Object(skill.to_map()?));
    }
    Ok(fields)
}

/// Keys of `skill_state` the daemon writes only while they hold something: when the daemon's
/// state lacks one, it was cleared, and it is removed rather than kept as another writer's.
pub(super) const CLEARABLE_SKILL_KEYS: &[&str] = &["blocked", "question", "rate_limit", "lanes"];

/// Copies into `ours` what `theirs` has and `ours` does not know: keys missing from an object
/// (at any depth) and, in lists of objects with an `id`, the unknown keys of the element with the
/// same id. Every known key is always in `ours`, so nothing the daemon dropped comes back.
/// Returns whether it copied anything.
pub fn keep_unknown(theirs: &Value, ours: &mut Value) -> bool {
    let mut copied = false;
    match (theirs, ours) {
        (Value::Object(t), Value::Object(o)) => {
            for (key, tv) in t {
                match o.get_mut(key) {
                    Some(ov) => copied |= keep_unknown(tv, ov),
                    None => {
                        o.insert(key.clone(), tv.clone());
                        copied = true;
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
                    copied |= keep_unknown(tv, ov);
                }
            }
        }
        _ => {}
    }
    copied
}

/// What tells a change's typed result without parsing the object it made: given that object
/// and the typed view of the version it was made on (the parse of the same bytes as the object
/// was, before the change), the typed result, or `None` to parse it.
pub(super) type Known<'a> = &'a mut dyn FnMut(&Map<String, Value>, &LoopState) -> Option<LoopState>;

/// A change to the raw JSON object of a loop's state, given the typed view of the version it is
/// made on. Passed as a trait object below [`Store::update`], so that the read, the parse and
/// the write are compiled once, in this crate, rather than once per caller's closure in each
/// crate that calls it.
pub(super) type Change<'a> = &'a mut dyn FnMut(&mut Map<String, Value>, &LoopState);

/// The typed result of the daemon's commit of `ours` made on `base`, once the commit's change
/// made `raw`: `base` with the daemon's fields of `ours` and the top-level fields the change may
/// set (a transition's, a consumed choice, the time) as `raw` has them. `None` where `raw` holds
/// one of those in a shape only the parse can judge.
fn committed(base: &LoopState, ours: &LoopState, raw: &Map<String, Value>) -> Option<LoopState> {
    let text = |key: &str| match raw.get(key) {
        None | Some(Value::Null) => Some(None),
        Some(Value::String(s)) => Some(Some(s.clone())),
        Some(_) => None,
    };
    // Every field named, so that a field added to the state is a decision here.
    let LoopState {
        loop_id,
        title,
        description,
        max_iterations,
        max_errors,
        status: _,
        current_iteration: _,
        created_at,
        updated_at: _,
        completed_at: _,
        failure_reason: _,
        next_action: _,
        max_cost_usd,
        max_tokens,
        parallel,
        race,
        status_by,
        skill_state: _,
    } = base;
    Some(LoopState {
        loop_id: loop_id.clone(),
        title: title.clone(),
        description: description.clone(),
        max_iterations: *max_iterations,
        max_errors: *max_errors,
        status: Status::deserialize(raw.get("status")?).ok()?,
        current_iteration: ours.current_iteration,
        created_at: created_at.clone(),
        updated_at: text("updated_at")?,
        completed_at: text("completed_at")?,
        failure_reason: text("failure_reason")?,
        next_action: text("next_action")?,
        max_cost_usd: *max_cost_usd,
        max_tokens: *max_tokens,
        parallel: *parallel,
        race: race.clone(),
        status_by: status_by.clone(),
        skill_state: ours.skill_state.clone(),
    })
}

/// A version's count of finished actions (`skill_state.seq`; 0 without one): how far the loop
/// had come in it.
fn progress_of(version: &Value) -> u64 {
    version["skill_state"]["seq"].as_u64().unwrap_or(0)
}

pub(super) fn to_pretty(path: &Path, value: &Value) -> Result<Vec<u8>, StoreError> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(|e| StoreError::Corrupt {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// What [`swap_in`] replaced.
pub(super) enum Swapped {
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
/// in place; `None` writes whatever is there. `written` is called once the new version is
/// written, before it is put in place. Returns what was replaced.
///
/// The exchange (`renameat2(RENAME_EXCHANGE)`) hands back exactly what it replaced, under the
/// temp file's name: a reader that opened the old version still reads it whole. (A version is
/// written into again only as a spare, once it has been settled: [`ORPHAN_LIFE`] after it stopped
/// being the state file.)
pub(super) fn swap_in(
    dir: &Dir,
    name: &str,
    bytes: &[u8],
    expected: Option<&[u8]>,
    spare: Option<String>,
    written: impl FnOnce(),
) -> io::Result<Swapped> {
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
    drop(file);
    if let Err(e) = done {
        let _ = dir.remove(&tmp);
        return Err(e);
    }
    written();
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

impl Store {
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
    ///
    /// loopd's own fields that another writer put back as an older copy had them (see
    /// [`Store::restore`]) are taken from the backup first, so that this write does not make the
    /// older copy the backup's too.
    pub fn update(
        &self,
        id: &str,
        durable: bool,
        mut change: impl FnMut(&mut Map<String, Value>, &LoopState),
    ) -> Result<Arc<LoopState>, StoreError> {
        self.update_with(id, durable, &mut change, &mut |_, _| None)
    }

    /// [`Store::update`], with what tells its typed result without a parse.
    fn update_with(
        &self,
        id: &str,
        durable: bool,
        change: Change<'_>,
        known: Known<'_>,
    ) -> Result<Arc<LoopState>, StoreError> {
        validate_id(id)?;
        let dir = self.existing_dir()?.ok_or_else(|| self.not_found(id))?;
        let _lock = self.lock(id)?;
        self.settle_locked(&dir, id, false);
        self.update_repaired(&dir, id, durable, change, known)
    }

    /// [`Store::update_repairing`], saying in the log when loopd's fields were repaired. Called
    /// with the loop's lock held.
    pub(super) fn update_repaired(
        &self,
        dir: &Dir,
        id: &str,
        durable: bool,
        change: Change<'_>,
        known: Known<'_>,
    ) -> Result<Arc<LoopState>, StoreError> {
        let (state, repaired) = self.update_repairing(dir, id, durable, change, known)?;
        if let Some(reason) = repaired {
            tracing::warn!(
                "{}: {reason}; they were taken from {}",
                self.state_path(id).display(),
                self.backup_path(id).display()
            );
        }
        Ok(state)
    }

    pub(super) fn update_locked(
        &self,
        dir: &Dir,
        id: &str,
        durable: bool,
        change: Change<'_>,
        known: Known<'_>,
    ) -> Result<Arc<LoopState>, StoreError> {
        let path = self.state_path(id);
        let name = state_name(id);
        // What is in place now, and the version to make the change on (its bytes and typed
        // view; its object, taken from this process's write of it, else parsed from the bytes).
        let (mut in_place, mut base) = self.read(id)?;
        let mut made_on = in_place.clone();
        let mut object = self.take_object(id, &in_place);
        for round in 1.. {
            let mut raw = match object.take() {
                Some(raw) => raw,
                None => parse_object(&made_on).map_err(|reason| StoreError::Corrupt {
                    path: path.clone(),
                    reason,
                })?,
            };
            change(&mut raw, &base);
            raw.insert("updated_at".into(), Value::String(now_rfc3339()));
            let typed = known(&raw, &base);
            let value = Value::Object(raw);
            let bytes = Arc::new(to_pretty(&path, &value)?);
            let progress = progress_of(&value);
            // The write (and its backup's) wakes the watcher's reader: placed first where it
            // costs the loop least.
            crate::helper::place_inotify_reader(durable);
            // A deferred backup's fdatasync overlaps the parse and the exchange. (A round that
            // starts over records its own version after this one; a write that fails records
            // the version in place again.)
            let deferred = durable && self.defer_backup(id, &bytes, progress);
            let not_written = |e: StoreError| {
                if deferred {
                    self.defer_backup(id, &in_place, 0);
                }
                e
            };
            let state = match typed {
                Some(typed) => {
                    debug_assert_eq!(
                        Some(&typed),
                        LoopState::deserialize(&value).ok().as_ref(),
                        "the typed result known unparsed is the parse's"
                    );
                    typed
                }
                None => LoopState::deserialize(&value).map_err(|e| {
                    not_written(StoreError::Corrupt {
                        path: path.clone(),
                        reason: e.to_string(),
                    })
                })?,
            };
            let Value::Object(written) = value else {
                unreachable!("made as an object")
            };
            let state = Arc::new(state);
            // The last round writes whatever happened, rather than fail the write.
            let expected = (round < WRITE_RACE_RETRIES).then_some(in_place.as_slice());
            // Known as this store's version before it is in place: a watcher that reads it
            // need not parse it again (see [`Store::read_control`]).
            let remember = || self.remember(id, bytes.clone(), state.clone(), Some(written));
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
                        Some(e) if e != old.as_slice() => parse_state(&path, &old).ok(),
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
                        made_on = Arc::new(old);
                        base = Arc::new(theirs);
                        continue;
                    }
                    // Kept for a late write. What it held is what this write replaced; a writer
                    // half-way through it is overwriting what was in place; and a complete
                    // version another writer put there on the last round (written whatever
                    // happened) differs from the version this change was made on by that
                    // writer's changes, merged when the orphan settles.
                    let base = if old == *in_place {
                        in_place
                    } else if parse_state(&path, &old).is_ok() {
                        made_on
                    } else {
                        in_place
                    };
                    let replaced = std::time::SystemTime::now();
                    self.keep_orphan(id, tmp, base, bytes.clone(), Some(replaced));
                }
                Swapped::Renamed => {}
            }
            if durable && !deferred {
                match self.record_version(dir, id, &bytes, progress) {
                    Ok(()) => self.backup_recorded(id),
                    Err(e) => self.sync_without_backup(dir, id, &e),
                }
            }
            return Ok(state);
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
        // Whether the change kept keys of the file's that `ours` lacks: its typed result is then
        // the parse's to tell.
        let kept = std::cell::Cell::new(false);
        let mut change = |raw: &mut Map<String, Value>, current: &LoopState| {
            kept.set(false);
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
                        if let Some(theirs) = raw.get(*key)
                            && keep_unknown(theirs, &mut v)
                        {
                            kept.set(true);
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
        };
        let mut known = |raw: &Map<String, Value>, base: &LoopState| {
            (!kept.get()).then(|| committed(base, ours, raw)).flatten()
        };
        self.update_with(&ours.loop_id, durable, &mut change, &mut known)
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
