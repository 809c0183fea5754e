//! No executor process outlives its attempt, even one that left the process group or session.

mod common;

use std::os::unix::process::CommandExt as _;

use common::*;

/// An agent whose develop starts a process in a session of its own (`setsid`), records its pid,
/// and then either returns or waits to be stopped.
fn escaping_agent(wait: bool) -> String {
    format!(
        r#"cat > /dev/null
case "$LOOPD_ACTION" in
  init) echo '{{"status":"success","state_updates":{{"tasks":[{{"description":"x"}}]}}}}' > "$LOOPD_RESULT_FILE" ;;
  develop)
    setsid sh -c 'echo $$ > escaped.pid; exec sleep 1000' > /dev/null 2>&1 < /dev/null &
    while [ ! -s escaped.pid ]; do sleep 0.01; done
    {}
    echo '{{"status":"success"}}' > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{{"status":"success","state_updates":{{"passed":true}}}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{{"status":"success"}}' > "$LOOPD_RESULT_FILE" ;;
esac
"#,
        if wait {
            "touch waiting; sleep 1000"
        } else {
            ""
        }
    )
}

#[test]
fn a_process_that_escaped_the_group_is_ended_when_its_action_returns() {
    let p = Project::new(&escaping_agent(false));
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let escaped = read_pid(&p.root.join("escaped.pid"));
    assert!(
        !alive(escaped),
        "escaped process {escaped} outlived its action"
    );
}

#[test]
fn a_process_that_escaped_the_session_is_ended_on_stop() {
    let p = Project::new(&escaping_agent(true));
    let id = p.create(&["--title", "t"]);
    let child = p.spawn_run(&id, &[]);
    wait_for("the develop to wait", || p.root.join("waiting").exists());
    let escaped = read_pid(&p.root.join("escaped.pid"));
    assert!(alive(escaped));
    let stop = p.output(&["stop", &id]);
    assert!(stop.status.success(), "{}", stderr(&stop));
    let out = wait_output(child, DEADLINE);
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
    assert!(
        !alive(escaped),
        "escaped process {escaped} outlived the stop"
    );
}

#[test]
fn an_escape_with_a_clean_environment_is_ended_after_the_daemon_is_killed() {
    // `setsid env -i`: its own session and no LOOPD_* variable; only the inherited marker is left.
    let p = Project::new(&escaping_agent(true).replace(
        "setsid sh -c 'echo $$ > escaped.pid; exec sleep 1000'",
        "setsid env -i sh -c 'echo $$ > escaped.pid; exec sleep 1000'",
    ));
    let id = p.create(&["--title", "t"]);
    let mut run = p.spawn_run(&id, &[]);
    wait_for("develop to wait", || p.root.join("waiting").exists());
    let escaped = read_pid(&p.root.join("escaped.pid"));
    run.kill().unwrap();
    run.wait().unwrap();
    assert!(alive(escaped), "the escape died with the daemon");
    // The next daemon finds it and ends it; then stop the loop.
    let mut again = p.spawn_run(&id, &[]);
    wait_for("the escape to be ended", || !alive(escaped));
    assert!(p.output(&["stop", &id]).status.success());
    let status = again.wait().unwrap();
    assert_eq!(status.code(), Some(5));
}

/// An agent whose develop starts two processes, orphaned in sessions of their own, that end their
/// main thread alone (`threaded.py`): one without `LOOPD_STATE_FILE` (it keeps the marker), one
/// that closes the marker (it keeps the variable). Then it waits to be stopped.
const THREADED_ESCAPES: &str = r#"cat > /dev/null
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"x"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop)
    setsid sh -c 'env -u LOOPD_STATE_FILE python3 threaded.py marker.pid &' > /dev/null 2>&1 < /dev/null
    setsid sh -c 'python3 threaded.py environ.pid close-fds &' > /dev/null 2>&1 < /dev/null
    touch waiting; sleep 1000 ;;
  *) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

/// `python3 threaded.py PIDFILE [close-fds]`: closes its inherited descriptors if told, starts a
/// thread, writes its pid, and ends its main thread alone (`exit(2)`): its `/proc/PID/fd` and
/// `/proc/PID/environ` are then empty, its thread's are not.
const THREADED: &str = r#"import ctypes, os, sys, threading, time
if sys.argv[2:] == ["close-fds"]:
    os.closerange(3, 65536)
threading.Thread(target=time.sleep, args=(1000,)).start()
open(sys.argv[1], "w").write(str(os.getpid()))
ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[os.uname().machine], 0)
"#;

#[test]
fn escapes_whose_main_thread_ended_alone_are_ended_after_the_daemon_is_killed() {
    let p = Project::new(THREADED_ESCAPES);
    std::fs::write(p.root.join("threaded.py"), THREADED).unwrap();
    let id = p.create(&["--title", "t"]);
    let mut run = p.spawn_run(&id, &[]);
    wait_for("develop to wait", || p.root.join("waiting").exists());
    let escapes = ["marker.pid", "environ.pid"].map(|f| read_pid(&p.root.join(f)));
    wait_for("the escapes' main threads to end alone", || {
        escapes.iter().all(|pid| main_thread_ended_alone(*pid))
    });
    run.kill().unwrap();
    run.wait().unwrap();
    assert!(
        escapes.iter().all(|pid| alive(*pid)),
        "the escapes died with the daemon"
    );
    // The next daemon finds each by what it kept, through its live thread, and ends it.
    let mut again = p.spawn_run(&id, &[]);
    wait_for("the escapes to be ended", || {
        escapes.iter().all(|pid| !alive(*pid))
    });
    assert!(p.output(&["stop", &id]).status.success());
    let status = again.wait().unwrap();
    assert_eq!(status.code(), Some(5));
}

#[test]
fn a_state_file_naming_a_foreign_process_in_flight_kills_nothing() {
    let p = Project::new(
        "cat > /dev/null\necho '{\"status\":\"success\",\"state_updates\":{\"passed\":true}}' > \"$LOOPD_RESULT_FILE\"\n",
    );
    let id = p.create(&["--title", "t"]);
    // A process that is none of loopd's, in a group of its own, as any program of the user's.
    let mut foreign: Running = std::process::Command::new("sleep")
        .arg("1000")
        .process_group(0)
        .spawn()
        .unwrap()
        .into();
    let pid = foreign.id();
    let start: u64 = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap()
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap();
    for proc_start in [serde_json::Value::Null, serde_json::json!(start)] {
        let mut state = p.state(&id);
        state["status"] = "running".into();
        state["skill_state"]["in_flight"] = serde_json::json!({
            "action": "develop", "iteration": 1, "attempt": 1, "started_at": "2026-01-01T00:00:00.000Z",
            "pid": pid, "pgid": pid, "proc_start": proc_start, "daemon_pid": 1
        });
        state["max_iterations"] = 1.into();
        std::fs::write(p.state_path(&id), serde_json::to_vec(&state).unwrap()).unwrap();
        let out = p.run(&id, &[]);
        assert!(out.status.code().is_some(), "{}", stderr(&out));
        assert!(
            alive(pid),
            "loopd killed a foreign process on the file's word"
        );
    }
    foreign.kill().unwrap();
    foreign.wait().unwrap();
}
