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
                let mut theirs: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
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

/// A commit made on a version another program wrote, by a store that keeps no objects (the
/// service's), knows its typed result without a parse too: what the file parses to, with the
/// other program's fields.
#[test]
fn a_commit_on_another_writers_version_is_what_the_file_parses_to() {
    let (dir, store) = running_loop();
    let store = store.without_objects();
    let parsed = || LoopState::clone(&Store::new(dir.path(), ".").load_shared("l1").unwrap());
    let mut state = LoopState::clone(&store.load_shared("l1").unwrap());
    state.current_iteration = 1;
    state.skill().seq = 1;
    let after = store.commit(&state, None, false).unwrap();
    assert_eq!(*after, parsed());
    // Another program writes the file whole: a title, a limit, a field loopd does not know.
    let path = store.state_path("l1");
    let mut theirs: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    theirs["title"] = "theirs".into();
    theirs["max_iterations"] = 7.into();
    theirs["their_note"] = "kept".into();
    fs::write(&path, serde_json::to_vec(&theirs).unwrap()).unwrap();
    state.current_iteration = 2;
    state.skill().seq = 2;
    let after = store.commit(&state, None, true).unwrap();
    assert_eq!(
        (after.title.as_str(), after.max_iterations),
        ("theirs", Some(7))
    );
    assert_eq!(after.current_iteration, 2);
    assert_eq!(*after, parsed());
    assert_eq!(store.load("l1").unwrap().raw["their_note"], "kept");
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
