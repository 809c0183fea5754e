//! Durable state: crashes, concurrent writers, corruption, hostile input.

mod common;

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// A small deterministic pseudo-random sequence (xorshift), seeded from the clock and printed so
/// that a failure can be replayed with `LOOPD_TEST_SEED`.
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        let seed = std::env::var("LOOPD_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            })
            | 1;
        eprintln!("LOOPD_TEST_SEED={seed}");
        Rng(seed)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Develop leaves a long-lived grandchild behind and records every pid it starts.
const CRASH_AGENT: &str = r#"cat > /dev/null
echo $$ >> pids
case "$LOOPD_ACTION" in
  init) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
  develop)
    sleep 1000 & echo $! >> pids
    touch in-develop
    [ -f fast ] || sleep 0.05
    echo "{\"status\":\"success\",\"summary\":\"$LOOPD_TASK_ID\"}" > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","state_updates":{"passed":true}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

#[test]
fn sigkill_at_random_moments_loses_nothing_and_orphans_nothing() {
    let kills: usize = std::env::var("LOOPD_CRASH_KILLS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(50);
    let p = Project::new(CRASH_AGENT);
    let tasks: Vec<String> = (1..=60).map(|i| format!("task number {i}")).collect();
    let mut args = vec!["--title", "crash", "--max-iterations", "1000"];
    for t in &tasks {
        args.extend(["--task", t.as_str()]);
    }
    let id = p.create(&args);
    let mut rng = Rng::new();
    let mut last_iteration = 0;
    let mut killed = 0;
    while killed < kills {
        // Every fifth kill lands in the middle of a develop, whatever the machine's load: the
        // next daemon then has an attempt (and its grandchild) to recover.
        let mid_develop = killed % 5 == 4;
        let _ = std::fs::remove_file(p.root.join("in-develop"));
        let mut child = p.spawn_run(&id, &[]);
        if mid_develop {
            wait_for("a develop to be under way", || {
                p.root.join("in-develop").exists() || child.try_wait().unwrap().is_some()
            });
        }
        let pause = if mid_develop {
            rng.below(5)
        } else {
            3 + rng.below(40)
        };
        std::thread::sleep(Duration::from_millis(pause));
        if child.try_wait().unwrap().is_some() {
            let out = wait_output(child, DEADLINE);
            assert_eq!(code(&out), 0, "after {killed} kills: {}", stderr(&out));
            break; // the loop completed before this kill
        }
        child.kill().unwrap();
        child.wait().unwrap();
        killed += 1;
        let state = p.state(&id); // parses, whatever instant the kill hit
        let iteration = state["current_iteration"].as_u64().unwrap();
        assert!(
            iteration >= last_iteration,
            "iteration went back: {last_iteration} -> {iteration}"
        );
        last_iteration = iteration;
    }
    assert!(
        killed >= kills,
        "the loop completed after only {killed} kills"
    );
    // The rest of the work, quickly.
    std::fs::write(p.root.join("fast"), "").unwrap();
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let state = p.state(&id);
    let done = state["skill_state"]["develop"]["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["status"] == "completed")
        .count();
    assert_eq!(done, tasks.len());
    for pid in std::fs::read_to_string(p.root.join("pids"))
        .unwrap()
        .lines()
    {
        let pid: u32 = pid.parse().unwrap();
        assert!(
            !alive(pid),
            "executor process {pid} of a killed daemon is still alive"
        );
    }
    let temp: Vec<_> = std::fs::read_dir(p.root.join(".loop"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(temp.is_empty(), "temporary files left: {temp:?}");
    assert!(p.event_names(&id).iter().any(|n| n == "recovered"));
}

#[test]
fn a_stale_external_write_is_repaired_and_keeps_its_own_edit() {
    let p = Project::new(&format!(
        "[ \"$LOOPD_TASK_ID\" = task-003 ] && {{ touch waiting; i=0; while [ ! -f go ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; }}\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t", "--task", "a", "--task", "b", "--task", "c"]);
    let stale = std::fs::read_to_string(p.state_path(&id)).unwrap();
    let child = p.spawn_run(&id, &[]);
    wait_for("task-003 to start", || p.root.join("waiting").exists());
    // Another program writes back the copy it read before the loop ran, with its own edit.
    let mut old: Value = serde_json::from_str(&stale).unwrap();
    old["notes"] = json!("edited by the dashboard");
    old["status"] = json!("running");
    std::fs::write(p.state_path(&id), serde_json::to_vec_pretty(&old).unwrap()).unwrap();
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = wait_output(child, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let state = p.state(&id);
    assert_eq!(state["notes"], "edited by the dashboard");
    // No task was developed twice: the reverted progress was put back, not redone.
    assert_eq!(p.developed(&id), ["task-001", "task-002", "task-003"]);
    assert_eq!(state["current_iteration"], 4);
}

#[test]
fn a_resume_from_a_stale_copy_is_repaired_and_the_warning_says_what_was_put_back() {
    let p = Project::new(&format!(
        "[ \"$LOOPD_TASK_ID\" = task-002 ] && [ ! -f go ] && {{ touch waiting; i=0; while [ ! -f go ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; }}\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t", "--task", "a", "--task", "b"]);
    let stale = std::fs::read_to_string(p.state_path(&id)).unwrap();
    let child = p.spawn_run(&id, &[]);
    wait_for("task-002 to start", || p.root.join("waiting").exists());
    assert_eq!(code(&p.output(&["pause", &id])), 0);
    wait_for("the pause", || {
        p.event_names(&id).iter().any(|e| e == "paused")
    });
    std::fs::write(p.root.join("go"), "").unwrap();
    // The dashboard resumes the loop from the copy it read before the loop ran.
    let mut old: Value = serde_json::from_str(&stale).unwrap();
    old["status"] = json!("running");
    std::fs::write(p.state_path(&id), serde_json::to_vec_pretty(&old).unwrap()).unwrap();
    let out = wait_output(child, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(p.developed(&id), ["task-001", "task-002"]);
    let warning = p
        .events(&id)
        .into_iter()
        .filter_map(|e| e["message"].as_str().map(str::to_owned))
        .find(|m| m.contains("stale"))
        .expect("a warning about the stale write");
    assert!(warning.contains("current_iteration: 0 → 1"), "{warning}");
    assert!(
        warning.contains("skill_state.develop.completed: 0 → 1"),
        "{warning}"
    );
}

#[test]
fn loopd_writers_and_a_ccw_style_writer_lose_no_update() {
    lose_no_update(false);
}

/// The same, the loop driven by a service: loopd's commands exit without waiting for late
/// writes into the versions they replaced, which the service takes over and settles.
#[test]
fn loopd_writers_and_a_ccw_style_writer_lose_no_update_with_a_service() {
    lose_no_update(true);
}

fn lose_no_update(service: bool) {
    let p = Project::new(&format!("sleep 0.005\n{GOOD_AGENT}"));
    let tasks: Vec<String> = (1..=30).map(|i| format!("t{i}")).collect();
    let mut args = vec!["--title", "t", "--max-iterations", "100"];
    for t in &tasks {
        args.extend(["--task", t.as_str()]);
    }
    let id = p.create(&args);
    let (child, service) = match service {
        false => {
            let child = p.spawn_run(&id, &[]);
            // Driven by this daemon before the first resume, which would start one of its own.
            wait_for("the daemon to drive the loop", || {
                p.event_names(&id).iter().any(|e| e == "loop_started")
            });
            (Some(child), None)
        }
        true => {
            let service = p.serve(&["--root", p.root.to_str().unwrap()]);
            let out = p.output(&["start", &id]);
            assert!(out.status.success(), "start: {}", stderr(&out));
            (None, Some(service))
        }
    };
    let path = p.state_path(&id);
    let external_done = Arc::new(AtomicBool::new(false));
    // A CCW-style writer: read, a moment later truncate and write the whole file, no lock.
    let external = {
        let (path, done) = (path.clone(), external_done.clone());
        std::thread::spawn(move || {
            let mut rng = Rng::new();
            let mut last = String::new();
            for i in 0..200 {
                let Ok(text) = std::fs::read(&path) else {
                    continue;
                };
                let Ok(mut v) = serde_json::from_slice::<Value>(&text) else {
                    continue;
                };
                last = format!("external edit {i}");
                v["notes"] = json!(last);
                std::thread::sleep(Duration::from_micros(rng.below(500)));
                let mut file = std::fs::File::create(&path).unwrap();
                file.write_all(&serde_json::to_vec_pretty(&v).unwrap())
                    .unwrap();
                drop(file);
                std::thread::sleep(Duration::from_micros(500 + rng.below(1000)));
            }
            done.store(true, Ordering::SeqCst);
            last
        })
    };
    // loopd's own CLI writer: pause and resume, ending with a resume after the external writer.
    let mut cycles = 0;
    let deadline = Instant::now() + DEADLINE;
    while !external_done.load(Ordering::SeqCst) || cycles < 5 {
        assert!(Instant::now() < deadline, "writers did not finish");
        for verb in ["pause", "resume"] {
            let out = p.output(&[verb, &id]);
            assert!(out.status.success(), "{verb}: {}", stderr(&out));
        }
        cycles += 1;
    }
    let last_note = external.join().unwrap();
    // The external writer may have reverted the last status from a stale copy; resume once more
    // now that it is gone, as its user would.
    let _ = p.output(&["resume", &id]);
    match child {
        Some(child) => {
            let out = wait_output(child, DEADLINE);
            assert_eq!(code(&out), 0, "{}", stderr(&out));
        }
        None => wait_for("the loop to complete", || {
            p.state(&id)["status"] == "completed"
        }),
    }
    drop(service);
    assert_nothing_left(&p);
    let state = p.state(&id);
    assert_eq!(
        state["notes"],
        json!(last_note),
        "the external writer's last edit was lost"
    );
    assert_eq!(state["status"], "completed");
    let developed = p.developed(&id).len();
    assert_eq!(developed, tasks.len(), "a task was lost or developed twice");
    assert_eq!(state["skill_state"]["error_count"], 0);
}

/// A loop whose develop waits for `go` in the project root, driven by `loopd run` or a service,
/// once develop has started: its daemon's child, or the service.
fn waiting_loop(p: &Project, service: bool) -> (String, Option<Running>, Option<Service>) {
    let id = p.create(&["--title", "t", "--task", "a"]);
    let (child, service) = match service {
        false => (Some(p.spawn_run(&id, &[])), None),
        true => {
            let service = p.serve(&["--root", p.root.to_str().unwrap()]);
            let out = p.output(&["start", &id]);
            assert!(out.status.success(), "start: {}", stderr(&out));
            (None, Some(service))
        }
    };
    wait_for("develop to start", || {
        p.events_named(&id, "action_started")
            .iter()
            .any(|e| e["action"] == "develop")
    });
    (id, child, service)
}

/// Lets the loop of [`waiting_loop`] end; the state it ended with, and no temporary file left.
fn ends(p: &Project, id: &str, child: Option<Running>, service: Option<Service>) -> Value {
    std::fs::write(p.root.join("go"), "").unwrap();
    match child {
        Some(child) => {
            let out = wait_output(child, DEADLINE);
            assert_eq!(code(&out), 0, "{}", stderr(&out));
        }
        None => wait_for("the loop to complete", || {
            p.state(id)["status"] == "completed"
        }),
    }
    drop(service);
    assert_nothing_left(p);
    p.state(id)
}

/// No temporary file of a write, and no unusable version put aside, is left in the state
/// directory once every writer is gone.
fn assert_nothing_left(p: &Project) {
    let left: Vec<String> = std::fs::read_dir(p.root.join(".loop"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp") || n.ends_with(".corrupt"))
        .collect();
    assert!(left.is_empty(), "files left: {left:?}");
}

/// A lockless writer that opened the state file, then was descheduled before it wrote (truncating
/// it then) for longer than any time loopd might wait, here a second, while loopd pauses and
/// resumes the loop, replacing the version it opened: its edit is merged once it writes, whenever
/// that is.
fn a_writer_descheduled_after_its_open(service: bool) {
    let p = Project::new(WAITING_AGENT);
    let (id, child, service) = waiting_loop(&p, service);
    let path = p.state_path(&id);
    let mut edited: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edited["notes"] = json!("the late edit");
    let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    for verb in ["pause", "resume"] {
        let out = p.output(&[verb, &id]);
        assert!(out.status.success(), "{verb}: {}", stderr(&out));
    }
    // The writer's time off the processor: what this test is about, not a wait for a condition.
    std::thread::sleep(Duration::from_secs(1));
    file.set_len(0).unwrap();
    file.write_all(&serde_json::to_vec_pretty(&edited).unwrap())
        .unwrap();
    drop(file);
    let state = ends(&p, &id, child, service);
    assert_eq!(state["notes"], "the late edit", "the late write was lost");
    assert_eq!(state["status"], "completed");
}

#[test]
fn a_lockless_writer_descheduled_after_its_open_loses_nothing() {
    a_writer_descheduled_after_its_open(false);
}

#[test]
fn a_lockless_writer_descheduled_after_its_open_loses_nothing_with_a_service() {
    a_writer_descheduled_after_its_open(true);
}

/// A lockless writer that truncated the state file and was descheduled before it wrote: a
/// command meanwhile waits for its write rather than call the file corrupt, and the daemon puts
/// no older version back; both edits are kept.
#[test]
fn a_state_file_half_written_by_a_descheduled_writer_is_waited_for() {
    let p = Project::new(WAITING_AGENT);
    let (id, child, service) = waiting_loop(&p, false);
    let path = p.state_path(&id);
    let mut edited: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edited["notes"] = json!("the edit");
    let mut file = std::fs::File::create(&path).unwrap();
    let mut pause = p.loopd();
    pause.args(["pause", &id]);
    let pause = std::thread::spawn(move || pause.output().unwrap());
    // The writer's time off the processor: what this test is about, not a wait for a condition.
    std::thread::sleep(Duration::from_secs(1));
    file.write_all(&serde_json::to_vec_pretty(&edited).unwrap())
        .unwrap();
    drop(file);
    let out = pause.join().unwrap();
    assert!(out.status.success(), "pause: {}", stderr(&out));
    wait_for("the pause", || p.state(&id)["status"] == "paused");
    assert_eq!(p.state(&id)["notes"], "the edit");
    let out = p.output(&["resume", &id]);
    assert!(out.status.success(), "resume: {}", stderr(&out));
    let state = ends(&p, &id, child, service);
    assert_eq!(state["notes"], "the edit", "the edit was lost");
    assert!(
        !p.event_names(&id).iter().any(|e| e == "warning"),
        "{:?}",
        p.events_named(&id, "warning")
    );
}

/// A copy of the state file read before loopd's last actions, put back while no daemon drove the
/// loop (a lockless dashboard's stale write, then a command's read-modify-write of it, which made
/// it look newer): the next daemon takes loopd's own fields from its last durable write, so no
/// task is developed twice, and keeps what others wrote since.
#[test]
fn a_stale_copy_put_back_between_daemons_develops_no_task_twice() {
    // The copy is read while the second task is developed: the first is done then.
    let p = Project::new(&agent(&[(
        "develop",
        r#"[ "$LOOPD_TASK_ID" = task-002 ] && cp "$LOOPD_STATE_FILE" stale.json"#,
    )]));
    let id = p.create(&["--title", "t", "--task", "a", "--task", "b", "--task", "c"]);
    assert_eq!(code(&p.run(&id, &[])), 0);
    let all = ["task-001", "task-002", "task-003"];
    assert_eq!(p.developed(&id), all);
    let put_back_at = |note: &str, dated: bool| {
        std::fs::copy(p.root.join("stale.json"), p.state_path(&id)).unwrap();
        // As the dashboard writes it: its own edit, and the time of its write.
        edit_raw(&p, &id, |v| {
            v["notes"] = json!(note);
            if dated {
                v["updated_at"] = json!(chrono::Utc::now().to_rfc3339());
            }
        });
    };
    let put_back = |note: &str| put_back_at(note, true);
    let said = "another writer put back a copy it had read before";

    // Found by the next daemon.
    put_back("written since");
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stderr(&out).contains(said), "{}", stderr(&out));
    assert_eq!(p.developed(&id), all, "no task again");
    assert_eq!(p.state(&id)["notes"], "written since");

    // Found by a command's write first, which would make the copy the backup's too.
    put_back("and again");
    let out = p.output(&["set", &id, "--max-iterations", "12"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stderr(&out).contains(said), "{}", stderr(&out));
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(p.developed(&id), all, "no task again");
    let state = p.state(&id);
    assert_eq!(
        (&state["notes"], &state["max_iterations"]),
        (&json!("and again"), &json!(12))
    );

    // By a writer that leaves `updated_at` as it read it: the copy looks older than the backup,
    // as a file whose last writes never reached the disk would, but the machine has not
    // stopped since the backup was written. The edit stays.
    put_back_at("undated", false);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stderr(&out).contains(said), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains("machine stopped"),
        "{}",
        stderr(&out)
    );
    assert_eq!(p.developed(&id), all, "no task again");
    assert_eq!(p.state(&id)["notes"], "undated");
}

/// Makes `path` look written before the machine last started (its modification time an hour
/// before the boot): as a file is after a power loss.
fn written_before_boot(path: &std::path::Path) {
    let uptime = std::fs::read_to_string("/proc/uptime").unwrap();
    let up: f64 = uptime.split_whitespace().next().unwrap().parse().unwrap();
    let before =
        std::time::SystemTime::now() - Duration::from_secs_f64(up) - Duration::from_secs(3600);
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.set_modified(before).unwrap();
}

/// A loop that stopped at its iteration limit with two of its three tasks done.
fn two_of_three_tasks_done() -> (Project, String) {
    let p = Project::new(GOOD_AGENT);
    let args = ["--title", "t", "--max-iterations", "2"];
    let tasks = ["--task", "a", "--task", "b", "--task", "c"];
    let id = p.create(&[&args[..], &tasks[..]].concat());
    assert_eq!(code(&p.run(&id, &[])), 3);
    (p, id)
}

#[test]
fn a_state_file_spoilt_between_runs_is_restored_and_done_work_is_kept() {
    let (p, id) = two_of_three_tasks_done();
    let path = p.state_path(&id);
    std::fs::write(&path, b"{\"loop_id\": \"trunc").unwrap();
    let out = p.output(&["status", &id]);
    assert_eq!(code(&out), 2, "status reports, it does not repair");
    // Continue the loop: the run restores the file and says so in one line.
    let out = p.run(&id, &[]);
    let err = stderr(&out);
    assert!(
        err.contains("restored from") && err.contains(".json.bak"),
        "{err}"
    );
    let mut state = p.state(&id);
    let done: Vec<&str> = state["skill_state"]["develop"]["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["status"] == "completed")
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert_eq!(done, ["task-001", "task-002"]);
    // Raise the limit and go on: the completed tasks are not redone.
    state["max_iterations"] = json!(10);
    state["status"] = json!("running");
    std::fs::write(&path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
    assert_eq!(code(&p.run(&id, &[])), 0);
    assert_eq!(p.developed(&id), ["task-001", "task-002", "task-003"]);
    assert!(p.event_names(&id).iter().any(|n| n == "recovered"));
}

#[test]
fn a_broken_skill_state_without_backup_is_rebuilt_from_the_progress_files() {
    let (p, id) = two_of_three_tasks_done();
    let mut state = p.state(&id);
    state["skill_state"]["develop"]["tasks"][1]["id"] = json!("task-001"); // a duplicate id
    state["max_iterations"] = json!(10);
    state["status"] = json!("running");
    std::fs::write(
        p.state_path(&id),
        serde_json::to_vec_pretty(&state).unwrap(),
    )
    .unwrap();
    std::fs::remove_file(p.root.join(format!(".loop/{id}.json.bak"))).unwrap();
    let out = p.output(&["status", &id]);
    assert!(stderr(&out).contains("appears twice"), "{}", stderr(&out));
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("restored from the progress files"),
        "{}",
        stderr(&out)
    );
    assert_eq!(p.developed(&id), ["task-001", "task-002", "task-003"]);
    assert_eq!(p.state(&id)["title"], "t");
}

#[test]
fn hostile_state_files_are_refused_cleanly_and_left_alone() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    let path = p.state_path(&id);
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let mut huge = b"{\"loop_id\": \"".to_vec();
    huge.extend(std::iter::repeat_n(b'x', 64 << 20));
    huge.extend(b"\", \"status\": \"running\"}");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", Vec::new(), "EOF"),
        ("null", b"null".to_vec(), "not a JSON object"),
        ("array", b"[1, 2]".to_vec(), "not a JSON object"),
        (
            "binary",
            vec![0, 159, 146, 150, 255, 0, 1],
            "expected value",
        ),
        (
            "wrong types",
            br#"{"status": 3, "current_iteration": "x"}"#.to_vec(),
            "invalid type",
        ),
        (
            "negative limit",
            br#"{"status": "running", "max_iterations": -5}"#.to_vec(),
            "-5",
        ),
        (
            "zero limit",
            br#"{"status": "running", "max_errors": 0}"#.to_vec(),
            "max_errors must be at least 1",
        ),
        ("deep", deep.into_bytes(), "recursion limit"),
        (
            "invalid utf-8",
            b"{\"title\": \"\xff\xfe\", \"status\": \"running\"}".to_vec(),
            "invalid unicode",
        ),
        ("64 MiB", huge, "over the 16 MiB limit"),
    ];
    for (what, bytes, needle) in &cases {
        std::fs::write(&path, bytes).unwrap();
        for cmd in ["status", "run"] {
            let out = p.output(&[cmd, &id]);
            let err = stderr(&out);
            assert_eq!(code(&out), 2, "{what} / {cmd}: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{what} / {cmd}: {err}");
            assert!(
                err.len() < 1000,
                "{what} / {cmd}: a long error line: {} bytes",
                err.len()
            );
            assert!(err.contains(needle), "{what} / {cmd}: {err}");
            assert_eq!(
                &std::fs::read(&path).unwrap(),
                bytes,
                "{what} / {cmd} changed the file"
            );
        }
    }
    // A symlink that leads out of the state directory: loopd follows no symlink there.
    let outside = p.root.join("outside.json");
    std::fs::write(&outside, br#"{"status": "running"}"#).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&outside, &path).unwrap();
    let out = p.output(&["run", &id]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("is a symlink"), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(&outside).unwrap(),
        br#"{"status": "running"}"#
    );
}

#[test]
fn an_unknown_status_is_a_stop_with_a_reason() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    let mut state = p.state(&id);
    state["status"] = json!("hibernating");
    std::fs::write(p.state_path(&id), serde_json::to_vec(&state).unwrap()).unwrap();
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 5, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("unknown status \"hibernating\""),
        "{}",
        stderr(&out)
    );
    assert_eq!(p.state(&id)["status"], "hibernating");
}

#[test]
fn state_files_are_readable_by_their_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    // As if another program had created it, readable by all.
    std::fs::set_permissions(p.state_path(&id), std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(code(&p.run(&id, &[])), 0);
    for file in [
        p.state_path(&id),
        p.root.join(format!(".loop/{id}.json.bak")),
    ] {
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", file.display());
    }
}

#[test]
fn a_flood_of_output_keeps_the_daemon_small() {
    let p = Project::new(&GOOD_AGENT.replace(
        "develop) echo",
        "develop) head -c 268435456 /dev/zero; echo",
    ));
    let id = p.create(&["--title", "t", "--task", "flood"]);
    let (out, peak_kib) = wait_watching_rss(p.spawn_run(&id, &[]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    eprintln!("daemon peak RSS during a 256 MiB flood: {peak_kib} KiB");
    assert!(
        peak_kib > 0 && peak_kib < 64 * 1024,
        "peak RSS {peak_kib} KiB"
    );
    let log = std::fs::read_dir(p.progress(&id).join("actions"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|f| {
            f.to_string_lossy().contains("develop") && f.extension().is_some_and(|e| e == "log")
        })
        .unwrap();
    assert!(std::fs::metadata(log).unwrap().len() < 11 << 20);
}

#[test]
fn a_reader_never_sees_a_torn_or_empty_state_file() {
    let p = Project::new(GOOD_AGENT);
    // Round after round of the same failing validation, on purpose.
    p.config(&format!(
        "no_progress_rounds = 0\n{TEST_CONFIG}\n[actions.validate]\ncommand = \"false\"\n"
    ));
    let id = p.create(&["--title", "t", "--max-iterations", "150"]);
    let child = p.spawn_run(&id, &[]);
    let path = p.state_path(&id);
    let done = Arc::new(AtomicBool::new(false));
    // Like a dashboard's asynchronous read: open, yield, then read.
    let reader = {
        let (path, done) = (path.clone(), done.clone());
        std::thread::spawn(move || {
            let (mut reads, mut bad) = (0, Vec::new());
            while !done.load(Ordering::SeqCst) {
                let Ok(mut file) = std::fs::File::open(&path) else {
                    continue;
                };
                std::thread::sleep(Duration::from_millis(1));
                let mut bytes = Vec::new();
                use std::io::Read as _;
                file.read_to_end(&mut bytes).unwrap();
                reads += 1;
                if serde_json::from_slice::<Value>(&bytes).is_err() {
                    bad.push(bytes.len());
                }
            }
            (reads, bad)
        })
    };
    let out = wait_output(child, DEADLINE);
    done.store(true, Ordering::SeqCst);
    let (reads, bad) = reader.join().unwrap();
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    assert!(reads > 50, "only {reads} reads");
    assert!(
        bad.is_empty(),
        "{} of {reads} reads saw a torn file: sizes {bad:?}",
        bad.len()
    );
}

#[test]
fn fields_another_program_adds_inside_skill_state_are_kept() {
    let p = Project::new(&format!(
        "[ \"$LOOPD_TASK_ID\" = task-001 ] && {{ touch waiting; i=0; while [ ! -f go ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; }}\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t", "--task", "a", "--task", "b"]);
    let child = p.spawn_run(&id, &[]);
    wait_for("task-001 to start", || p.root.join("waiting").exists());
    let mut state = p.state(&id);
    state["skill_state"]["dashboard_note"] = json!({"pinned": true});
    state["skill_state"]["develop"]["tasks"][1]["label"] = json!("urgent");
    std::fs::write(
        p.state_path(&id),
        serde_json::to_vec_pretty(&state).unwrap(),
    )
    .unwrap();
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = wait_output(child, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let state = p.state(&id);
    assert_eq!(
        state["skill_state"]["dashboard_note"],
        json!({"pinned": true})
    );
    assert_eq!(
        state["skill_state"]["develop"]["tasks"][1]["label"],
        "urgent"
    );
    assert_eq!(p.developed(&id), ["task-001", "task-002"]);
    // Not mistaken for a stale write.
    assert!(
        !p.events(&id)
            .iter()
            .any(|e| e["message"].as_str().is_some_and(|m| m.contains("stale")))
    );
}

#[test]
fn a_state_file_that_is_not_a_regular_file_is_refused_at_once() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    std::fs::remove_file(p.state_path(&id)).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(p.state_path(&id))
        .status()
        .unwrap();
    assert!(made.success());
    for cmd in ["status", "run"] {
        let child = p
            .loopd()
            .args([cmd, &id])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_output(child, DEADLINE);
        assert_eq!(code(&out), 2, "{cmd}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("not a regular file"),
            "{}",
            stderr(&out)
        );
    }
}

/// The stress command for lockless writers: `LOOPD_STRESS_EDITS=300 cargo test --test durability
/// in_place_edits_stress -- --ignored --nocapture` prints `edits lost: 0 of 300`. A writer edits
/// `notes` in place (read, truncate, write; no lock, as the CCW dashboard API does) while the
/// daemon commits every few milliseconds, and reads each edit back 60 ms later.
#[test]
#[ignore = "a stress run of about 20 s; run it on purpose"]
fn in_place_edits_stress() {
    let edits: usize = std::env::var("LOOPD_STRESS_EDITS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300);
    // Validation never passes: the loop goes validate → debug → validate... committing each time.
    let p = Project::new(
        r#"cat > /dev/null
sleep 0.002
case "$LOOPD_ACTION" in
  validate) echo '{"status":"success","state_updates":{"passed":false}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#,
    );
    let id = p.create(&["--title", "t", "--max-iterations", "1000000", "--task", "a"]);
    let child = p.spawn_run(&id, &[]);
    let path = p.state_path(&id);
    wait_for("the loop to run", || {
        p.state(&id)["current_iteration"].as_u64().unwrap_or(0) > 2
    });
    let mut lost = 0;
    for i in 0..edits {
        let note = format!("edit {i}");
        let mut state: Value = loop {
            if let Ok(v) = serde_json::from_slice(&std::fs::read(&path).unwrap()) {
                break v;
            }
        };
        state["notes"] = json!(note);
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(&serde_json::to_vec_pretty(&state).unwrap())
            .unwrap();
        drop(file);
        std::thread::sleep(Duration::from_millis(60));
        let back: Value = loop {
            if let Ok(v) = serde_json::from_slice(&std::fs::read(&path).unwrap()) {
                break v;
            }
        };
        if back["notes"] != json!(note) {
            lost += 1;
        }
    }
    let iterations = p.state(&id)["current_iteration"].as_u64().unwrap_or(0);
    println!("edits lost: {lost} of {edits} ({iterations} iterations meanwhile)");
    assert!(p.output(&["stop", &id]).status.success());
    wait_output(child, DEADLINE);
    assert_eq!(lost, 0, "edits lost: {lost} of {edits}");
}

/// Develop waits for `go` in the project root before it reports, so that a test can spoil things
/// while an action is in flight.
const WAITING_AGENT: &str = r#"cat > /dev/null
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"a"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop)
    touch waiting
    i=0; while [ ! -f go ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done
    echo '{"status":"success","summary":"done"}' ;;
  validate) echo '{"status":"success","state_updates":{"passed":true}}' ;;
  *) echo '{"status":"success"}' ;;
esac
"#;

#[test]
fn a_state_file_older_than_its_backup_after_a_power_loss_is_replaced_by_it() {
    let p = Project::new(GOOD_AGENT);
    let args = ["--title", "t", "--max-iterations", "2"];
    let id = p.create(&[&args[..], &["--task", "a", "--task", "b", "--task", "c"]].concat());
    let created: Value =
        serde_json::from_slice(&std::fs::read(p.state_path(&id)).unwrap()).unwrap();
    assert_eq!(code(&p.run(&id, &[])), 3);
    // The machine stopped before the last versions of the state file reached the disk: the
    // file is as it was created, but the backup was fdatasynced at every durable write.
    std::fs::write(p.state_path(&id), created.to_string()).unwrap();
    written_before_boot(&p.root.join(format!(".loop/{id}.json.bak")));
    let out = p.run(&id, &[]);
    let err = stderr(&out);
    assert_eq!(code(&out), 3, "{err}");
    assert!(
        err.contains("older than its last durable write") && err.contains(".json.bak"),
        "{err}"
    );
    assert_eq!(p.state(&id)["current_iteration"], 2, "{err}");
    assert_eq!(
        p.developed(&id),
        ["task-001", "task-002"],
        "done work was redone"
    );
    // A state file as new as its backup is left alone.
    let out = p.run(&id, &[]);
    assert!(!stderr(&out).contains("restored"), "{}", stderr(&out));
}

#[test]
fn a_deleted_state_file_is_restored_from_its_backup() {
    let (p, id) = two_of_three_tasks_done();
    std::fs::remove_file(p.state_path(&id)).unwrap();
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    assert!(stderr(&out).contains("it was missing"), "{}", stderr(&out));
    assert_eq!(
        p.developed(&id),
        ["task-001", "task-002"],
        "done work was redone"
    );
}

#[test]
fn a_spoilt_state_file_and_a_removed_progress_dir_mid_run_are_outlived() {
    for spoil in ["garbage", "delete"] {
        let p = Project::new(WAITING_AGENT);
        let id = p.create(&["--title", "t"]);
        let child = p.spawn_run(&id, &[]);
        wait_for("develop to wait", || p.root.join("waiting").exists());
        match spoil {
            "garbage" => std::fs::write(p.state_path(&id), "{ not json").unwrap(),
            _ => std::fs::remove_file(p.state_path(&id)).unwrap(),
        }
        std::fs::remove_dir_all(p.progress(&id)).unwrap();
        std::fs::write(p.root.join("go"), "").unwrap();
        let out = wait_output(child, DEADLINE);
        assert_eq!(code(&out), 0, "{spoil}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("put back the last good version"),
            "{spoil}: {}",
            stderr(&out)
        );
        assert_eq!(p.state(&id)["status"], "completed", "{spoil}");
        if spoil == "garbage" {
            let kept = std::fs::read_to_string(p.root.join(format!(".loop/{id}.json.corrupt")));
            assert_eq!(kept.unwrap(), "{ not json");
        }
        assert!(p.progress(&id).join("events.jsonl").exists(), "{spoil}");
    }
}

#[test]
fn a_lock_held_past_the_lock_timeout_delays_the_daemon_but_does_not_end_it() {
    let p = Project::new(WAITING_AGENT);
    let id = p.create(&["--title", "t"]);
    let child = p.spawn_run(&id, &[]);
    wait_for("develop to wait", || p.root.join("waiting").exists());
    let lock = std::fs::File::open(p.root.join(format!(".loop/{id}.lock"))).unwrap();
    lock.lock().unwrap();
    std::fs::write(p.root.join("go"), "").unwrap();
    wait_for("the daemon to say it waits", || {
        p.events(&id).iter().any(|e| {
            e["message"]
                .as_str()
                .is_some_and(|m| m.contains("waiting for the lock"))
        })
    });
    lock.unlock().unwrap();
    let out = wait_output(child, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
}

#[test]
fn a_full_disk_is_waited_out_and_nothing_is_lost() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let mount = tempfile::tempdir().unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m,mode=0700", "loopd-test"])
        .arg(mount.path())
        .status();
    if !mounted.is_ok_and(|s| s.success()) {
        eprintln!("skipped: cannot mount a tmpfs here");
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mount.path().to_owned());
    // The project on the small filesystem; the agent's signal file outside it. Develop's result
    // makes the state some 10 KiB larger: written on the full disk it needs new pages, whichever
    // earlier version of the file the store reuses for it (those hold their pages).
    let signals = tempfile::tempdir().unwrap();
    let files: Vec<String> = (0..50)
        .map(|i| format!("\"src/{i:03}/{}.rs\"", "f".repeat(190)))
        .collect();
    let agent = WAITING_AGENT
        .replace(
            r#"'{"status":"success","summary":"done"}'"#,
            &format!(
                r#"'{{"status":"success","summary":"done","files_changed":[{}]}}'"#,
                files.join(",")
            ),
        )
        .replace(
            "touch waiting",
            &format!("touch {}/waiting", signals.path().display()),
        )
        .replace(
            "[ ! -f go ]",
            &format!("[ ! -f {}/go ]", signals.path().display()),
        );
    let root = mount.path().join("project");
    std::fs::create_dir_all(root.join(".loop")).unwrap();
    std::fs::create_dir_all(root.join("bin")).unwrap();
    // The agent's signal files are the test's, outside the work tree: declared writable.
    let config = format!(
        "{TEST_CONFIG}sandbox_writable = [{:?}]\n",
        signals.path().display().to_string()
    );
    std::fs::write(root.join(".loop/config.toml"), config).unwrap();
    std::fs::write(root.join("bin/agent.sh"), format!("#!/bin/sh\n{agent}")).unwrap();
    let loopd = || {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_loopd"));
        cmd.arg("--root")
            .arg(&root)
            .env("HOME", signals.path())
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("XDG_STATE_HOME");
        cmd
    };
    assert!(loopd().arg("trust").output().unwrap().status.success());
    let out = loopd().args(["create", "--title", "t"]).output().unwrap();
    let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let mut child = loopd()
        .args(["run", &id])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The daemon's log, read as it comes: while the disk is full it is the only place it can say so.
    let log = Arc::new(std::sync::Mutex::new(String::new()));
    let reader = {
        let (log, stderr) = (log.clone(), child.stderr.take().unwrap());
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                log.lock().unwrap().push_str(&line);
                log.lock().unwrap().push('\n');
            }
        })
    };
    let child = Running::from(child);
    wait_for("develop to wait", || {
        signals.path().join("waiting").exists()
    });
    // Fill the filesystem, then let develop finish: its result cannot be written yet.
    let filler = mount.path().join("filler");
    let _ = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=64k"])
        .arg(format!("of={}", filler.display()))
        .stderr(std::process::Stdio::null())
        .status();
    std::fs::write(signals.path().join("go"), "").unwrap();
    let state_path = root.join(format!(".loop/{id}.json"));
    let waiting = std::time::Instant::now();
    while !log.lock().unwrap().contains("retrying until it goes away") {
        assert!(
            waiting.elapsed() < DEADLINE,
            "the daemon never said it waits for space; its log:\n{}",
            log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::remove_file(&filler).unwrap();
    let status = wait_output(child, DEADLINE).status;
    reader.join().unwrap();
    let log = log.lock().unwrap().clone();
    assert_eq!(status.code(), Some(0), "{log}");
    assert_eq!(
        log.matches("retrying until it goes away").count(),
        1,
        "said once: {log}"
    );
    let state: Value = serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    assert_eq!(state["status"], "completed");
    assert_eq!(
        state["skill_state"]["develop"]["tasks"][0]["status"],
        "completed"
    );
    assert_eq!(state["skill_state"]["error_count"], 0);
}

/// Every attempt finds the action before it recorded in the backup (`{id}.json.bak`, the record
/// a durable write is fdatasynced to) when it starts: no attempt starts before the last action's
/// finish is written there (a finish written without its durable record fails it). The check is
/// the agent's own, at its start; it sees the record written, not its fdatasync, which no process
/// can see.
#[test]
fn each_attempt_starts_after_the_last_action_is_in_the_backup() {
    let p = Project::new(
        r#"cat > /dev/null
if [ -f last ] && ! grep -aq "$(cat last)" "$LOOPD_STATE_FILE.bak"; then
  echo "$(cat last) was not in the backup when $LOOPD_ACTION started" >> missing
fi
n=$(cat n 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > n
said="finished-$n"; echo "$said" > last
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","summary":"'"$said"'","state_updates":{"tasks":[{"description":"a"},{"description":"b"}]}}' > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","summary":"'"$said"'","state_updates":{"passed":false,"pass_rate":50}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success","summary":"'"$said"'"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#,
    );
    let id = p.create(&["--title", "t", "--max-iterations", "12"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    let started: usize = std::fs::read_to_string(p.root.join("n"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(started > 10, "{started} attempts");
    assert!(
        !p.root.join("missing").exists(),
        "{}",
        std::fs::read_to_string(p.root.join("missing")).unwrap_or_default()
    );
}
