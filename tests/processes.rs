//! No executor process outlives its attempt, even one that left the process group or session.

mod common;

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
