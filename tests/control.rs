//! Status and control (CONTRACT §3 "Status and control", §4 interactive mode, §5 process groups,
//! §7 exit codes and events), through the real binary: pause, resume and stop written by the CLI
//! or by a plain whole-file rewrite take effect in the middle of an action, end the executor's
//! whole process tree, and leave the loop's bookkeeping right.
//!
//! The fake executors write their pid (and a background child's) to files in the project root, so
//! that a test can wait until an action is really in flight and then check that it is gone.

mod common;

use std::io::Write as _;
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// Fake executors
// ---------------------------------------------------------------------------------------------

/// Records its pid in `agent.pid` and hangs (for longer than any test).
const HANG: &str = "echo $$ > agent.pid; sleep 100";

/// Starts a background child (its pid in `grandchild.pid`), records its own pid, and waits.
const HANG_WITH_GRANDCHILD: &str =
    "sleep 100 & echo $! > grandchild.pid; echo $$ > agent.pid; wait";

/// Ignores SIGTERM (so does its `sleep`: an ignored signal stays ignored across exec) and hangs.
const HANG_IGNORING_TERM: &str = "trap '' TERM; echo $$ > agent.pid; sleep 100";

/// Ignores SIGTERM, starts a child that ignores it too (its pid in `grandchild.pid`) and a thread,
/// then ends its main thread alone: the executor shows as a zombie while it lives on in its
/// thread, which the kernel hands the child to.
const HANG_IN_A_THREAD: &str = r#"echo $$ > agent.pid; exec python3 -c '
import ctypes, os, signal, subprocess, threading, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "100"])
open("grandchild.pid", "w").write(str(child.pid))
threading.Thread(target=time.sleep, args=(100,)).start()
ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[os.uname().machine], 0)  # exit(2)
'"#;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// `loopd VERB ID` (pause, resume, stop); it must succeed.
fn control(p: &Project, verb: &str, id: &str) {
    let out = p.output(&[verb, id]);
    assert!(
        out.status.success(),
        "loopd {verb} {id} failed ({:?}): {}",
        out.status.code(),
        stderr(&out)
    );
}

/// How many events named `name` the loop has logged.
fn count(p: &Project, id: &str, name: &str) -> usize {
    p.event_names(id).iter().filter(|e| *e == name).count()
}

/// Waits until the loop has logged at least `n` events named `name`.
fn wait_events(p: &Project, id: &str, name: &str, n: usize) {
    wait_for(&format!("{n} `{name}` event(s)"), || {
        count(p, id, name) >= n
    });
}

/// Waits for the executor to record its pid in `agent.pid`, and for the daemon to have recorded
/// that attempt as in flight (so that a raw read-modify-write of the state file by the test
/// cannot race with the daemon's own write of the attempt).
fn wait_in_flight(p: &Project, id: &str) -> u32 {
    let pid = read_pid(&p.root.join("agent.pid"));
    wait_for("the attempt in flight in the state file", || {
        p.state(id)["skill_state"]["in_flight"]["pid"].as_u64() == Some(u64::from(pid))
    });
    pid
}

/// The exit code of a finished `loopd run`, with its stderr on failure.
fn assert_exit(out: &Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "loopd run exited with {:?}, expected {code}\nstderr:\n{}",
        out.status,
        stderr(out)
    );
}

/// Waits for a `loopd run` to end and checks its exit code.
fn finish(child: Running, code: i32) -> Output {
    let out = wait_output(child, DEADLINE);
    assert_exit(&out, code);
    out
}

/// The number of lines in a file (0 if it does not exist).
fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count())
}

/// The status of every develop task of the loop, in order.
fn task_statuses(state: &Value) -> Vec<String> {
    state["skill_state"]["develop"]["tasks"]
        .as_array()
        .expect("develop.tasks")
        .iter()
        .map(|t| t["status"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// The checks every stop shares: the executor's processes are gone, the status is `failed` with
/// `reason`, and the interruption and the stop are in the event log.
fn assert_stopped(p: &Project, id: &str, pids: &[u32], reason: &str) {
    for &pid in pids {
        assert!(!alive(pid), "process {pid} of the stopped action is alive");
    }
    let state = p.state(id);
    assert_eq!(state["status"], "failed");
    assert_eq!(state["failure_reason"], reason);
    assert!(
        state["skill_state"]["in_flight"].is_null(),
        "the attempt is still recorded in flight: {}",
        state["skill_state"]["in_flight"]
    );
    let names = p.event_names(id);
    assert!(
        names.iter().any(|e| e == "action_interrupted"),
        "no action_interrupted event: {names:?}"
    );
    assert!(
        names.iter().any(|e| e == "stopped"),
        "no stopped event: {names:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Stop
// ---------------------------------------------------------------------------------------------

/// Runs a loop whose executor `script` records its pid and its child's (`agent.pid`,
/// `grandchild.pid`), waits for `what`: `ready` to hold of the executor's pid, stops the loop, and
/// checks that both processes are gone.
fn stop_ends_executor_and_grandchild(script: &str, what: &str, ready: fn(u32) -> bool) {
    let p = Project::new(&agent(&[("develop", script)]));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    let agent_pid = read_pid(&p.root.join("agent.pid"));
    let grandchild = read_pid(&p.root.join("grandchild.pid"));
    wait_for(what, || ready(agent_pid));
    assert!(alive(agent_pid) && alive(grandchild));

    control(&p, "stop", &id);
    finish(run, 5);
    assert_stopped(
        &p,
        &id,
        &[agent_pid, grandchild],
        "Manually stopped by user",
    );
}

#[test]
fn stop_ends_the_executor_and_its_grandchild() {
    stop_ends_executor_and_grandchild(HANG_WITH_GRANDCHILD, "the executor to run", alive);
}

#[test]
fn stop_kills_an_executor_that_ignores_sigterm_after_the_grace() {
    let p = Project::new(&agent(&[("develop", HANG_IGNORING_TERM)]));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    let agent_pid = read_pid(&p.root.join("agent.pid"));

    let stopped_at = Instant::now();
    control(&p, "stop", &id);
    finish(run, 5);
    // SIGTERM did nothing, so only SIGKILL after `kill_grace` (0.5 s) can have ended it.
    assert!(
        stopped_at.elapsed() >= Duration::from_millis(450),
        "the run ended after {:?}, before the kill grace",
        stopped_at.elapsed()
    );
    assert_stopped(&p, &id, &[agent_pid], "Manually stopped by user");
}

#[test]
fn stop_ends_an_executor_whose_main_thread_ended_alone() {
    stop_ends_executor_and_grandchild(
        HANG_IN_A_THREAD,
        "the executor's main thread to end alone",
        main_thread_ended_alone,
    );
}

#[test]
fn a_raw_whole_file_rewrite_to_failed_stops_the_loop() {
    let p = Project::new(&agent(&[("develop", HANG)]));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    let agent_pid = wait_in_flight(&p, &id);

    edit_raw(&p, &id, |state| {
        state["status"] = json!("failed");
        state.as_object_mut().unwrap().remove("failure_reason");
    });
    finish(run, 5);
    assert_stopped(&p, &id, &[agent_pid], "stopped by user");
}

// ---------------------------------------------------------------------------------------------
// Pause and resume
// ---------------------------------------------------------------------------------------------

#[test]
fn pause_and_resume_twenty_times_during_one_loop() {
    const CYCLES: usize = 20;
    // Each develop start is one line of `starts.log`; develop hangs until `cycles.done` exists.
    let p = Project::new(&agent(&[(
        "develop",
        "echo $$ >> starts.log; [ -e cycles.done ] || sleep 100",
    )]));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    let starts = p.root.join("starts.log");

    for cycle in 1..=CYCLES {
        wait_for(&format!("develop start #{cycle}"), || {
            lines(&starts) >= cycle
        });
        control(&p, "pause", &id);
        wait_events(&p, &id, "paused", cycle);
        assert_eq!(count(&p, &id, "action_interrupted"), cycle);
        if cycle == CYCLES {
            std::fs::write(p.root.join("cycles.done"), "").unwrap();
        }
        // `run` still holds the loop, so resume only writes the status.
        control(&p, "resume", &id);
        wait_events(&p, &id, "resumed", cycle);
    }
    finish(run, 0);

    let state = p.state(&id);
    assert_eq!(state["status"], "completed");
    // Two develops and one validate: the 20 interrupted attempts consumed nothing.
    assert_eq!(state["current_iteration"], 3);
    assert_eq!(state["skill_state"]["error_count"], 0);
    assert_eq!(
        task_statuses(&state),
        ["completed", "completed"],
        "no task may be lost"
    );
    let events = p.events(&id);
    let interrupted: Vec<&Value> = events
        .iter()
        .filter(|e| e["event"] == "action_interrupted")
        .collect();
    assert_eq!(interrupted.len(), CYCLES);
    for e in &interrupted {
        assert_eq!(e["action"], "develop", "{e}");
        assert_eq!(
            e["iteration"], 1,
            "an interruption moved the iteration: {e}"
        );
    }
    assert_eq!(count(&p, &id, "paused"), CYCLES);
    assert_eq!(count(&p, &id, "resumed"), CYCLES);
    assert_eq!(count(&p, &id, "action_failed"), 0);
}

/// A pause set back to `running` at once, before the daemon's watcher has read the file (a page's
/// pause and resume, seen together under load): the attempt in flight still ends, as a pause
/// ends it, and the loop goes on with the interrupted action, as after any resume.
#[test]
fn a_pause_undone_before_the_daemon_looks_still_ends_the_attempt_in_flight() {
    let p = Project::new(&agent(&[(
        "develop",
        "echo $$ >> starts.log; [ -e second.go ] || sleep 100",
    )]));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    let starts = p.root.join("starts.log");
    wait_for("the first develop", || lines(&starts) >= 1);
    wait_for("its attempt recorded in flight", || {
        !p.state(&id)["skill_state"]["in_flight"].is_null()
    });
    std::fs::write(p.root.join("second.go"), "").unwrap();
    // Stamped after the attempt was armed (the record in flight comes after the arming).
    wait_for_the_next_millisecond();
    // Two renames microseconds apart: the watcher mostly wakes to a file that says running.
    set_status_stamped(&p, &id, "paused", "a controller of this test");
    set_status_stamped(&p, &id, "running", "a controller of this test");
    wait_events(&p, &id, "action_interrupted", 1);
    let interrupted = p
        .events(&id)
        .into_iter()
        .find(|e| e["event"] == "action_interrupted")
        .unwrap();
    assert_eq!(interrupted["action"], "develop", "{interrupted}");
    let message = interrupted["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("a controller of this test"),
        "the interruption says who: {interrupted}"
    );
    wait_for("the develop run again", || lines(&starts) >= 2);
    finish(run, 0);
    let state = p.state(&id);
    assert_eq!(state["status"], "completed");
    assert_eq!(count(&p, &id, "action_interrupted"), 1);
    assert_eq!(count(&p, &id, "action_failed"), 0);
    assert_eq!(state["skill_state"]["error_count"], 0);
}

/// How often each thread of a process has gone to sleep so far (`voluntary_ctxt_switches`): a
/// thread that is woken and sleeps again adds one.
fn sleeps(pid: u32) -> std::collections::HashMap<String, u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("read /proc/PID/task");
    tasks
        .filter_map(|t| {
            let t = t.ok()?;
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let n = status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
                .trim()
                .parse()
                .ok()?;
            Some((t.file_name().into_string().ok()?, n))
        })
        .collect()
}

/// The wakeups of `pid`'s threads over `window` (threads that ended meanwhile are not counted).
fn wakeups_over(pid: u32, window: Duration) -> u64 {
    let before = sleeps(pid);
    std::thread::sleep(window);
    let after = sleeps(pid);
    after
        .iter()
        .filter_map(|(tid, n)| Some(n - before.get(tid)?))
        .sum()
}

/// Asserts that the daemon `pid` is not woken at all for two seconds, once the writes that led
/// to its wait have settled (the watcher reads them; a replaced version is let go after 300 ms).
fn assert_asleep(pid: u32, what: &str) {
    wait_for(&format!("the daemon to settle ({what})"), || {
        wakeups_over(pid, Duration::from_millis(500)) == 0
    });
    // Measuring, not synchronising: a daemon that looked at the file now and then would wake
    // up every time.
    let woken = wakeups_over(pid, Duration::from_secs(2));
    assert_eq!(woken, 0, "{what}: the daemon woke up {woken} times in 2 s");
}

#[test]
fn an_idle_daemon_sleeps_until_something_happens() {
    let p = Project::new(&agent(&[("develop", HANG)]));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    let agent_pid = wait_in_flight(&p, &id);
    assert_asleep(run.id(), "an executor that hangs");

    control(&p, "pause", &id);
    wait_events(&p, &id, "paused", 1);
    assert!(!alive(agent_pid), "pause left the action running");
    assert_asleep(run.id(), "paused");
    assert_eq!(p.state(&id)["status"], "paused");
    // And it wakes at once when something happens.
    control(&p, "stop", &id);
    finish(run, 5);

    let waiting = Project::new(&agent(&[]));
    let id = waiting.create(&["--title", "t", "--mode", "interactive"]);
    let run = waiting.spawn_run(&id, &[]);
    wait_for("the wait for a choice", || {
        !waiting.state(&id)["skill_state"]["awaiting_choice"].is_null()
    });
    assert_asleep(run.id(), "waiting for a choice");
    control(&waiting, "stop", &id);
    finish(run, 5);
}

#[test]
fn exit_on_pause_exits_with_6() {
    let p = Project::new(&agent(&[("develop", HANG_WITH_GRANDCHILD)]));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &["--exit-on-pause"]);
    let agent_pid = read_pid(&p.root.join("agent.pid"));
    let grandchild = read_pid(&p.root.join("grandchild.pid"));

    control(&p, "pause", &id);
    finish(run, 6);
    assert!(!alive(agent_pid) && !alive(grandchild));
    let state = p.state(&id);
    assert_eq!(state["status"], "paused");
    assert_eq!(state["current_iteration"], 0);
    let names = p.event_names(&id);
    assert!(names.iter().any(|e| e == "action_interrupted"), "{names:?}");
    assert!(names.iter().any(|e| e == "paused"), "{names:?}");
}

// ---------------------------------------------------------------------------------------------
// Other writers, signals, limits
// ---------------------------------------------------------------------------------------------

/// Rewrites the state file `writes` times like a careless dashboard: read, edit `notes` and
/// `tags`, truncate-and-write (every seventh time in two halves with a pause between). Returns
/// the last `notes` written.
fn careless_writer(path: &Path, writes: usize) -> String {
    let mut last = String::new();
    for i in 0..writes {
        // Only this writer ever leaves a half-written file, and it is done with it here.
        let mut state: Value =
            serde_json::from_slice(&std::fs::read(path).expect("read")).expect("state parses");
        last = format!("edit {i}");
        state["notes"] = json!(last);
        state["tags"] = json!(["writer", format!("n{i}")]);
        let bytes = serde_json::to_vec_pretty(&state).unwrap();
        if i % 7 == 3 {
            let mut file = std::fs::File::create(path).expect("truncate");
            let (a, b) = bytes.split_at(bytes.len() / 2);
            file.write_all(a).unwrap();
            file.flush().unwrap();
            std::thread::sleep(Duration::from_millis(2));
            file.write_all(b).unwrap();
        } else {
            std::fs::write(path, &bytes).expect("write");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    last
}

#[test]
fn a_concurrent_careless_writer_does_not_disturb_the_loop() {
    // Validation waits for the writer to finish, so all its writes land while the loop runs, the
    // last one while no daemon write can race with it.
    let p = Project::new(&agent(&[("validate", &wait_for_file("writer.done"))]));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    wait_for("the loop to run", || p.state(&id)["status"] == "running");

    let path = p.state_path(&id);
    let done = p.root.join("writer.done");
    let writer = std::thread::spawn(move || {
        let last = careless_writer(&path, 300);
        std::fs::write(done, "").unwrap();
        last
    });
    let last = writer.join().expect("the writer");
    let out = finish(run, 0);
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));

    let state = p.state(&id);
    assert_eq!(state["status"], "completed");
    assert_eq!(state["notes"], last.as_str());
    assert_eq!(state["tags"], json!(["writer", "n299"]));
    assert_eq!(state["skill_state"]["error_count"], 0);
    assert!(
        task_statuses(&state).iter().all(|s| s == "completed"),
        "{}",
        state["skill_state"]["develop"]["tasks"]
    );
}

#[test]
fn sigterm_to_the_daemon_interrupts_the_action_and_keeps_the_loop_running() {
    let p = Project::new(&agent(&[("develop", HANG_WITH_GRANDCHILD)]));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    let agent_pid = wait_in_flight(&p, &id);
    let grandchild = read_pid(&p.root.join("grandchild.pid"));

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(run.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("signal the daemon");
    finish(run, 143);

    assert!(!alive(agent_pid) && !alive(grandchild));
    let state = p.state(&id); // still parses
    assert_eq!(state["status"], "running", "the next daemon should go on");
    assert!(state["skill_state"]["in_flight"].is_null());
    assert_eq!(state["current_iteration"], 0);
    let history = state["skill_state"]["action_history"]
        .as_array()
        .expect("action_history");
    let last = history.last().expect("a history entry");
    assert_eq!(last["action"], "develop", "{last}");
    assert_eq!(last["outcome"], "interrupted", "{last}");
    assert_eq!(count(&p, &id, "action_interrupted"), 1);
    assert_eq!(count(&p, &id, "stopped"), 0);
}

#[test]
fn a_second_signal_ends_the_daemon_and_its_executor_at_once() {
    // The agent survives SIGTERM (its trap notes it), and the grace is long.
    let p = Project::new(&agent(&[(
        "develop",
        "trap 'echo got >> term.log' TERM; echo $$ > agent.pid; while :; do sleep 0.05; done",
    )]));
    p.config(&TEST_CONFIG.replace("kill_grace = 0.5", "kill_grace = 60"));
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    let agent_pid = wait_in_flight(&p, &id);
    let daemon = nix::unistd::Pid::from_raw(run.id() as i32);
    nix::sys::signal::kill(daemon, nix::sys::signal::Signal::SIGTERM).expect("signal");
    wait_for("the agent to get SIGTERM", || {
        p.root.join("term.log").exists()
    });
    let second = Instant::now();
    nix::sys::signal::kill(daemon, nix::sys::signal::Signal::SIGTERM).expect("signal");
    finish(run, 143);
    assert!(
        second.elapsed() < Duration::from_secs(30),
        "the second signal did not end the daemon at once"
    );
    wait_for("the agent to be killed", || !alive(agent_pid));
}

#[test]
fn control_works_by_polling_where_inotify_is_not_available() {
    let p = Project::new(&agent(&[("develop", HANG_WITH_GRANDCHILD)]));
    let id = p.create(&["--title", "t"]);
    let run: Running = p
        .loopd()
        .env("LOOPD_WATCH", "poll")
        .args(["run", &id])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn loopd run")
        .into();
    let agent_pid = wait_in_flight(&p, &id);
    let grandchild = read_pid(&p.root.join("grandchild.pid"));
    control(&p, "stop", &id);
    let out = finish(run, 5);
    assert!(
        stderr(&out).contains("polling every 100ms"),
        "{}",
        stderr(&out)
    );
    assert_stopped(
        &p,
        &id,
        &[agent_pid, grandchild],
        "Manually stopped by user",
    );
}

#[test]
fn lowering_max_iterations_below_the_current_one_ends_the_loop() {
    // The third develop (iteration 3) waits until the test has lowered the limit.
    let develop = format!(
        r#"if [ "$LOOPD_ITERATION" = 3 ]; then echo $$ > agent.pid; {}; fi"#,
        wait_for_file("go")
    );
    let p = Project::new(&agent(&[("develop", &develop)]));
    let id = p.create(&[
        "--title",
        "t",
        "--max-iterations",
        "10",
        "--task",
        "a",
        "--task",
        "b",
        "--task",
        "c",
        "--task",
        "d",
    ]);
    let run = p.spawn_run(&id, &[]);
    wait_in_flight(&p, &id);
    assert_eq!(p.state(&id)["current_iteration"], 2);

    edit_raw(&p, &id, |state| state["max_iterations"] = json!(1));
    std::fs::write(p.root.join("go"), "").unwrap();
    finish(run, 3);

    let state = p.state(&id);
    assert_eq!(state["status"], "completed");
    assert_eq!(
        state["max_iterations"], 1,
        "the daemon wrote back its own copy"
    );
    assert_eq!(state["current_iteration"], 3);
    assert_eq!(state["skill_state"]["outcome"], "iteration_limit");
    assert_eq!(
        task_statuses(&state),
        ["completed", "completed", "completed", "pending"]
    );
}

// ---------------------------------------------------------------------------------------------
// Interactive mode
// ---------------------------------------------------------------------------------------------

#[test]
fn interactive_mode_from_start_to_complete() {
    const ALL: [&str; 5] = ["init", "develop", "debug", "validate", "complete"];
    const PATH: [&str; 5] = ["init", "develop", "develop", "validate", "complete"];
    let p = Project::new(&agent(&[]));
    let id = p.create(&["--title", "t", "--mode", "interactive"]);
    let mut run = p.spawn_run(&id, &[]);

    let mut chosen: Vec<String> = Vec::new();
    loop {
        // The daemon waits for the next choice once every chosen action has finished.
        let mut ended = false;
        wait_for(&format!("the choice after {chosen:?}"), || {
            if run.try_wait().expect("try_wait").is_some() {
                ended = true;
                return true;
            }
            let state = p.state(&id);
            !state["skill_state"]["awaiting_choice"].is_null()
                && state["next_action"].is_null()
                && state["skill_state"]["seq"].as_u64() == Some(chosen.len() as u64)
        });
        if ended {
            break;
        }
        let state = p.state(&id);
        let waiting = &state["skill_state"]["awaiting_choice"];
        for action in ALL {
            assert!(
                waiting["choices"]
                    .as_array()
                    .unwrap()
                    .contains(&json!(action)),
                "{action} is not offered: {waiting}"
            );
        }
        if chosen.is_empty() {
            let shown = p.output(&["status", &id]);
            assert!(
                stdout(&shown).contains("waiting"),
                "status does not show the wait:\n{}",
                stdout(&shown)
            );
            let bad = p.output(&["next", &id, "explode"]);
            assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
            for action in ALL {
                assert!(stderr(&bad).contains(action), "{}", stderr(&bad));
            }
        }
        let suggested = waiting["suggested"]
            .as_str()
            .expect("a suggestion")
            .to_owned();
        assert!(chosen.len() < PATH.len(), "still waiting after {chosen:?}");
        assert_eq!(suggested, PATH[chosen.len()], "after {chosen:?}");
        let out = p.output(&["next", &id, &suggested]);
        assert!(out.status.success(), "{}", stderr(&out));
        chosen.push(suggested);
    }
    let out = wait_output(run, DEADLINE);
    assert_exit(&out, 0);
    // Once validation has passed, completing is a termination check, not a choice: the daemon
    // may complete by itself rather than wait for `next ID complete`.
    assert!(
        chosen.len() >= 4 && chosen[..] == PATH[..chosen.len()],
        "chosen: {chosen:?}"
    );
    let state = p.state(&id);
    assert_eq!(state["status"], "completed");
    assert_eq!(state["skill_state"]["outcome"], "passed");
    assert!(state["skill_state"]["awaiting_choice"].is_null());
    let started: Vec<String> = p
        .events(&id)
        .iter()
        .filter(|e| e["event"] == "action_started")
        .map(|e| e["action"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(started, PATH);
}

#[test]
fn timeout_signalling_process_and_group_leaves_the_attempt_recorded_as_interrupted() {
    let p = Project::new(&agent(&[("develop", "echo $$ > agent.pid; sleep 30")]));
    let id = p.create(&["--title", "t"]);
    // GNU timeout sends SIGTERM to loopd and then to its whole process group: two at once.
    let child = std::process::Command::new("timeout")
        .args(["--signal=TERM", "1"])
        .arg(env!("CARGO_BIN_EXE_loopd"))
        .arg("--root")
        .arg(&p.root)
        .args(["run", &id])
        .env("HOME", &p.root)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_output(child, DEADLINE);
    assert_eq!(out.status.code(), Some(124), "{}", stderr(&out));
    let state = p.state(&id);
    assert_eq!(state["status"], "running");
    assert!(state["skill_state"]["in_flight"].is_null(), "{state}");
    let last = state["skill_state"]["action_history"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(last["action"], "develop");
    assert_eq!(last["outcome"], "interrupted");
    let agent = read_pid(&p.root.join("agent.pid"));
    wait_for("the agent to be gone", || !alive(agent));
}

#[test]
fn a_question_waits_for_its_answer_and_the_next_prompt_gets_it() {
    // The first develop asks; given an answer, it keeps the prompt it got and succeeds.
    let p = Project::new(&format!(
        "prompt=$(cat)\n\
         if [ \"$LOOPD_ACTION\" = develop ] && [ ! -f answered-prompt.txt ]; then case \"$prompt\" in\n\
           *'The answer:'*) printf '%s' \"$prompt\" > answered-prompt.txt ;;\n\
           *) echo '{{\"status\":\"needs_input\",\"summary\":\"a choice\",\"question\":\"Postgres or SQLite?\"}}' > \"$LOOPD_RESULT_FILE\"; exit 0 ;;\n\
         esac; fi\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t"]);
    let other = p.create(&["--title", "asks nothing"]);
    let out = p.output(&["start", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let pid: u32 = stdout(&out).trim().parse().unwrap();
    wait_for("the question", || {
        p.state(&id)["skill_state"]["question"]["text"] == "Postgres or SQLite?"
    });
    // A question is no failure: nothing counted, nothing retried.
    let state = p.state(&id);
    assert_eq!(state["status"], "running");
    assert_eq!(state["skill_state"]["error_count"], 0);
    assert_eq!(state["current_iteration"], 0);
    let shown = stdout(&p.output(&["status", &id]));
    assert!(shown.contains("waiting for an answer"), "{shown}");
    assert!(
        shown.contains(&format!("`loopd answer {id} TEXT`")),
        "{shown}"
    );
    // Its event (and so a `needs_input` notification) says the same.
    let asked = || {
        p.events(&id)
            .into_iter()
            .find(|e| e["event"] == "awaiting_answer")
    };
    wait_for("the awaiting_answer event", || asked().is_some());
    let asked = asked().unwrap();
    assert_eq!(
        asked["status_reason"], "waiting for an answer: Postgres or SQLite?",
        "{asked}"
    );
    assert_eq!(
        asked["next_step"],
        format!("`loopd answer {id} TEXT`"),
        "{asked}"
    );

    let out = p.output(&["answer", &other, "sqlite"]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("waiting for no answer"),
        "{}",
        stderr(&out)
    );
    let out = p.output(&["answer", &id, "SQLite, in data/app.db", "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let said: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(said["question"], "Postgres or SQLite?");

    wait_for("the loop to complete", || {
        p.state(&id)["status"] == "completed"
    });
    wait_for("its daemon to exit", || !alive(pid));
    let prompt = std::fs::read_to_string(p.root.join("answered-prompt.txt")).unwrap();
    assert!(
        prompt.contains("Postgres or SQLite?") && prompt.contains("SQLite, in data/app.db"),
        "{prompt}"
    );
    let state = p.state(&id);
    assert!(state["skill_state"].get("question").is_none(), "{state}");
    assert_eq!(state["skill_state"]["error_count"], 0);
    let names = p.event_names(&id);
    for event in ["awaiting_answer", "answered"] {
        assert!(names.iter().any(|n| n == event), "{names:?}");
    }
    let asked = state["skill_state"]["action_history"]
        .as_array()
        .unwrap()
        .iter()
        .any(|h| h["outcome"] == "needs_input");
    assert!(asked, "{state}");
}
