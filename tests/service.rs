//! `loopd serve` through the real binary: one service drives the loops of several projects,
//! picks up loops set to `running` by anyone, respects the lock of a loop driven elsewhere,
//! queues loops beyond its limit, survives SIGKILL, ends cleanly on SIGTERM, reloads on SIGHUP,
//! and tells systemd how it is doing.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::Path;

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

/// An agent that records its pid in `agent-<action>.pid` (in its loop's project) and waits for
/// the file `go` there before it does its work.
fn held_agent() -> String {
    agent(&[(
        "develop",
        &format!("echo $$ > agent-develop.pid; {}", wait_for_file("go")),
    )])
}

/// `--root DIR` for each project.
fn roots(projects: &[&Project]) -> Vec<String> {
    projects
        .iter()
        .flat_map(|p| ["--root".to_owned(), p.root.display().to_string()])
        .collect()
}

fn status(p: &Project, id: &str) -> Value {
    p.state(id)["status"].clone()
}

fn wait_status(p: &Project, id: &str, want: &str) {
    wait_for(&format!("loop {id} to be {want}"), || status(p, id) == want);
}

fn daemon_started_pids(p: &Project, id: &str) -> Vec<u64> {
    p.events(id)
        .iter()
        .filter(|e| e["event"] == "daemon_started")
        .filter_map(|e| e["pid"].as_u64())
        .collect()
}

#[test]
fn a_loop_resumed_by_a_raw_file_write_is_driven_to_completion_by_the_service() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    set_status(&p, &id, "running");
    wait_status(&p, &id, "completed");
    assert_eq!(p.state(&id)["skill_state"]["outcome"], "passed");
    // Driven inside the service, by no process of its own.
    assert_eq!(
        daemon_started_pids(&p, &id),
        vec![u64::from(service.child.id())]
    );
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let log = stderr(&out);
    assert!(log.contains(&format!("driving loop {id}")), "{log}");
    assert!(log.contains("passed (exit 0)"), "{log}");
}

#[test]
fn start_hands_the_loop_to_a_running_service_and_list_all_shows_every_project() {
    let a = Project::new(GOOD_AGENT);
    let b = Project::beside(&a, GOOD_AGENT);
    let service = a.serve::<&str>(&[]);
    let (ia, ib) = (a.create(&["--title", "a"]), b.create(&["--title", "b"]));
    for (p, id) in [(&a, &ia), (&b, &ib)] {
        let out = p.output(&["start", id]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout(&out).trim(), service.child.id().to_string());
        assert!(stderr(&out).contains("service"), "{}", stderr(&out));
    }
    wait_status(&a, &ia, "completed");
    wait_status(&b, &ib, "completed");
    let pid = u64::from(service.child.id());
    assert_eq!(daemon_started_pids(&a, &ia), vec![pid]);
    assert_eq!(daemon_started_pids(&b, &ib), vec![pid]);
    // `resume` hands a paused loop over the same way.
    let ic = a.create(&["--title", "c"]);
    assert_eq!(code(&a.output(&["pause", &ic])), 0);
    let out = a.output(&["resume", &ic]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), service.child.id().to_string());
    wait_status(&a, &ic, "completed");
    assert_eq!(daemon_started_pids(&a, &ic), vec![pid]);
    let out = a.output(&["list", "--all"]);
    let table = stdout(&out);
    assert!(table.starts_with("PROJECT"), "{table}");
    for (p, id) in [(&a, &ia), (&b, &ib)] {
        let row = table
            .lines()
            .find(|l| l.contains(id.as_str()))
            .unwrap_or_else(|| panic!("{id} missing from\n{table}"));
        assert!(row.starts_with(p.root.to_str().unwrap()), "{row}");
        assert!(row.contains("passed"), "{row}");
    }
    let out = a.output(&["--json", "list", "--all"]);
    let all: Value = serde_json::from_slice(&out.stdout).expect("json");
    let loops: usize = all
        .as_array()
        .expect("array")
        .iter()
        .map(|p| p["loops"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(loops, 3, "{all}");
}

#[test]
fn a_loop_driven_in_a_terminal_is_never_also_driven_by_the_service() {
    let p = Project::new(&held_agent());
    let id = p.create(&["--title", "t"]);
    let run = p.spawn_run(&id, &[]);
    let run_pid = u64::from(run.id());
    read_pid(&p.root.join("agent-develop.pid"));
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    // The service has looked at the loop (running, driven by `loopd run`) and left it alone.
    wait_for("the service to have scanned the project", || {
        service
            .info()
            .is_some_and(|i| i["roots"][0] == p.root.to_str().unwrap())
    });
    set_status(&p, &id, "running");
    std::fs::write(p.root.join("go"), "").expect("go");
    let out = wait_output(run, DEADLINE);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(daemon_started_pids(&p, &id), vec![run_pid]);
    let log = stderr(&service.stop());
    assert!(!log.contains("driving loop"), "{log}");
}

#[test]
fn loops_beyond_max_running_loops_wait_in_a_queue_in_order() {
    let a = Project::new(&held_agent());
    let mut others = Vec::new();
    for _ in 0..2 {
        let p = Project::beside(&a, &held_agent());
        others.push(p);
    }
    let projects: Vec<&Project> = std::iter::once(&a).chain(&others).collect();
    let ids: Vec<String> = projects
        .iter()
        .map(|p| p.create(&["--title", "q"]))
        .collect();
    let mut args = roots(&projects);
    args.extend(["--max-running-loops".to_owned(), "1".to_owned()]);
    let service = a.serve(&args);
    // Made running one after the other: the queue keeps that order.
    for (i, (p, id)) in projects.iter().zip(&ids).enumerate() {
        set_status(p, id, "running");
        wait_for("the service to see the loop", || {
            service.info().is_some_and(|info| {
                let known = |k: &str| {
                    info[k]
                        .as_array()
                        .is_some_and(|l| l.iter().any(|e| e["loop_id"] == id.as_str()))
                };
                known("running") || known("queued")
            })
        });
        if i == 0 {
            read_pid(&p.root.join("agent-develop.pid"));
        }
    }
    let info = service.info().expect("info");
    assert_eq!(info["summary"], "1 running, 0 paused, 2 queued", "{info}");
    let out = others[1].output(&["status", &ids[2]]);
    assert!(stdout(&out).contains("queued (2)"), "{}", stdout(&out));
    let out = others[0].output(&["list"]);
    assert!(stdout(&out).contains("queued (1)"), "{}", stdout(&out));
    // Released one by one: each runs only once the one before it is done.
    for (i, (p, id)) in projects.iter().zip(&ids).enumerate() {
        read_pid(&p.root.join("agent-develop.pid"));
        for later in &projects[i + 1..] {
            assert!(!later.root.join("agent-develop.pid").exists());
        }
        std::fs::write(p.root.join("go"), "").expect("go");
        wait_status(p, id, "completed");
    }
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("waits in the queue"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn stopping_one_loop_ends_its_processes_and_leaves_the_other_loops_alone() {
    // Loop A's agent starts a child that escapes into a session of its own, then its parent
    // exits: the escapee is reparented to the service, as B's executor is its child too.
    let escape = "setsid sh -c 'echo $$ > escaped.pid; exec sleep 100' & \
                  echo $$ > agent-develop.pid; sleep 100";
    let a = Project::new(&agent(&[("develop", escape)]));
    let b = Project::beside(&a, &held_agent());
    let (ia, ib) = (a.create(&["--title", "a"]), b.create(&["--title", "b"]));
    let service = a.serve(&roots(&[&a, &b]));
    set_status(&a, &ia, "running");
    set_status(&b, &ib, "running");
    let a_agent = read_pid(&a.root.join("agent-develop.pid"));
    let escaped = read_pid(&a.root.join("escaped.pid"));
    let b_agent = read_pid(&b.root.join("agent-develop.pid"));
    let out = a.output(&["stop", &ia]);
    assert!(out.status.success(), "{}", stderr(&out));
    wait_for("loop A's processes to end", || {
        !alive(a_agent) && !alive(escaped)
    });
    wait_for("the stop to be recorded", || {
        a.state(&ia)["skill_state"]["in_flight"].is_null()
    });
    assert!(alive(b_agent), "stopping loop A ended loop B's executor");
    assert_eq!(status(&b, &ib), "running");
    std::fs::write(b.root.join("go"), "").expect("go");
    wait_status(&b, &ib, "completed");
    drop(service);
}

/// A pause and a resume written one right after the other (a page's, told to the watcher
/// together when it is slow to wake): the attempt in flight ends, as the pause alone would end
/// it, and the service drives the loop on with the interrupted action.
#[test]
fn a_pause_undone_at_once_ends_the_attempt_and_the_service_drives_the_loop_on() {
    let p = Project::new(&agent(&[(
        "develop",
        "echo $$ >> starts.log; [ -e second.go ] || sleep 100",
    )]));
    let id = p.create(&["--title", "t"]);
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    set_status(&p, &id, "running");
    let starts = p.root.join("starts.log");
    let started = || std::fs::read_to_string(&starts).map_or(0, |s| s.lines().count());
    wait_for("the first develop", || started() == 1);
    wait_for("its attempt recorded in flight", || {
        !p.state(&id)["skill_state"]["in_flight"].is_null()
    });
    std::fs::write(p.root.join("second.go"), "").expect("second.go");
    // Stamped after the attempt was armed (the record in flight comes after the arming).
    wait_for_the_next_millisecond();
    set_status_stamped(&p, &id, "paused", "the page");
    set_status_stamped(&p, &id, "running", "the page");
    wait_status(&p, &id, "completed");
    let names = p.event_names(&id);
    let interrupted = names.iter().filter(|n| *n == "action_interrupted").count();
    assert_eq!(interrupted, 1, "{names:?}");
    // The plan's two develops, and the interrupted one again.
    assert_eq!(started(), 3, "the interrupted develop ran again");
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn a_service_killed_mid_action_leaves_no_orphan_once_started_again_and_finishes_the_loop() {
    // The first develop hangs with a grandchild; later ones succeed.
    let hang_once = "if [ ! -e hung ]; then touch hung; sleep 100 & echo $! > grandchild.pid; \
                     echo $$ > agent.pid; wait; fi";
    let p = Project::new(&agent(&[("develop", hang_once)]));
    let id = p.create(&["--title", "t"]);
    let root = p.root.to_str().unwrap().to_owned();
    let service = p.serve(&["--root", &root]);
    set_status(&p, &id, "running");
    let agent_pid = read_pid(&p.root.join("agent.pid"));
    let grandchild = read_pid(&p.root.join("grandchild.pid"));
    // Mid-action: the attempt is recorded in flight (the executor starts a moment before its
    // record is written; killed in between, the next start ends it all the same, but has no
    // attempt to record as interrupted).
    wait_for("the develop in flight", || {
        p.state(&id)["skill_state"]["in_flight"]["action"] == "develop"
    });
    service.signal(Signal::SIGKILL);
    drop(service);
    assert!(
        alive(agent_pid) && alive(grandchild),
        "nothing was left to find"
    );
    let again = p.serve(&["--root", &root]);
    wait_status(&p, &id, "completed");
    assert!(!alive(agent_pid), "the old executor is still alive");
    assert!(
        !alive(grandchild),
        "the old executor's child is still alive"
    );
    let history = p.state(&id)["skill_state"]["action_history"].clone();
    assert!(
        history
            .as_array()
            .expect("history")
            .iter()
            .any(|h| h["outcome"] == "interrupted"),
        "{history}"
    );
    assert_eq!(p.state(&id)["skill_state"]["outcome"], "passed");
    drop(again);
}

#[test]
fn sigterm_interrupts_every_action_records_it_and_leaves_the_loops_running() {
    let a = Project::new(&held_agent());
    let b = Project::beside(&a, &held_agent());
    let (ia, ib) = (a.create(&["--title", "a"]), b.create(&["--title", "b"]));
    let service = a.serve(&roots(&[&a, &b]));
    set_status(&a, &ia, "running");
    set_status(&b, &ib, "running");
    let agents = [
        read_pid(&a.root.join("agent-develop.pid")),
        read_pid(&b.root.join("agent-develop.pid")),
    ];
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    for (p, id) in [(&a, &ia), (&b, &ib)] {
        let state = p.state(id);
        assert_eq!(
            state["status"],
            "running",
            "{state:#}\n{:#?}\n{}",
            p.events(id),
            stderr(&out)
        );
        assert!(state["skill_state"]["in_flight"].is_null(), "{state}");
        let last = state["skill_state"]["action_history"]
            .as_array()
            .and_then(|h| h.last().cloned())
            .expect("history");
        assert_eq!(last["outcome"], "interrupted", "{last}");
    }
    for pid in agents {
        assert!(!alive(pid), "executor {pid} outlived the service");
    }
    assert!(!a.home.join(".local/state/loopd/run/serve.json").exists());
}

#[test]
fn a_sigterm_while_loops_are_being_taken_leaves_every_one_to_run_again() {
    let first = Project::new(&held_agent());
    let mut projects = vec![first];
    for _ in 1..24 {
        let next = Project::beside(&projects[0], &held_agent());
        projects.push(next);
    }
    let ids: Vec<String> = projects
        .iter()
        .map(|p| p.create(&["--title", "t"]))
        .collect();
    let all: Vec<&Project> = projects.iter().collect();
    let service = projects[0].serve(&roots(&all));
    for (p, id) in projects.iter().zip(&ids) {
        set_status(p, id, "running");
    }
    // At once: some loops are driven by now, some are being taken, some not even seen.
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    for (p, id) in projects.iter().zip(&ids) {
        let state = p.state(id);
        assert_eq!(state["status"], "running", "{state:#}\n{}", stderr(&out));
        assert!(state["skill_state"]["in_flight"].is_null(), "{state}");
    }
    // Nothing of the stop holds a loop back: the next service drives each one to its end.
    for p in &projects {
        std::fs::write(p.root.join("go"), "").expect("write go");
    }
    let service = projects[0].serve(&roots(&all));
    for (p, id) in projects.iter().zip(&ids) {
        wait_status(p, id, "completed");
    }
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn loops_whose_writes_wait_on_their_locks_leave_the_service_free_to_stop_another() {
    let free = Project::new(&held_agent());
    let stuck: Vec<Project> = (0..4)
        .map(|_| Project::beside(&free, &held_agent()))
        .collect();
    let free_id = free.create(&["--title", "free"]);
    let ids: Vec<String> = stuck
        .iter()
        .map(|p| p.create(&["--title", "stuck"]))
        .collect();
    let all: Vec<&Project> = std::iter::once(&free).chain(&stuck).collect();
    let service = free.serve(&roots(&all));
    set_status(&free, &free_id, "running");
    for (p, id) in stuck.iter().zip(&ids) {
        set_status(p, id, "running");
    }
    let agent = read_pid(&free.root.join("agent-develop.pid"));
    for p in &stuck {
        read_pid(&p.root.join("agent-develop.pid"));
    }
    // Each stuck loop's lock held by another program, then its action let finish: the write of
    // its result waits for the lock, a blocking section that lasts as long as the lock is held.
    let locks: Vec<std::fs::File> = stuck
        .iter()
        .zip(&ids)
        .map(|(p, id)| {
            let lock = std::fs::File::open(p.root.join(format!(".loop/{id}.lock")))
                .expect("open the lock");
            lock.lock().expect("take the lock");
            lock
        })
        .collect();
    for p in &stuck {
        std::fs::write(p.root.join("go"), "").expect("write go");
    }
    for (p, id) in stuck.iter().zip(&ids) {
        wait_for("the loop to say it waits for its lock", || {
            p.events(id).iter().any(|e| {
                e["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("waiting for the lock"))
            })
        });
    }
    // Four sections that do not end: the service still stops another loop's executor.
    set_status(&free, &free_id, "paused");
    wait_for("the free loop's executor to be stopped", || !alive(agent));
    drop(locks);
    for (p, id) in stuck.iter().zip(&ids) {
        wait_status(p, id, "completed");
    }
    assert_eq!(status(&free, &free_id), "paused");
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn a_loop_that_cannot_run_is_reported_and_the_others_go_on() {
    let a = Project::new(GOOD_AGENT);
    let b = Project::beside(&a, GOOD_AGENT);
    let (ia, ib) = (a.create(&["--title", "a"]), b.create(&["--title", "b"]));
    // B's project config changes after it was trusted: B must not run.
    std::fs::write(
        b.root.join(".loop/config.toml"),
        format!("{TEST_CONFIG}\nmax_iterations = 9\n"),
    )
    .expect("config");
    let service = a.serve(&roots(&[&a, &b]));
    set_status(&b, &ib, "running");
    wait_for("loop B to be refused", || {
        service
            .info()
            .is_some_and(|i| i["refused"][0]["loop_id"] == ib.as_str())
    });
    set_status(&a, &ia, "running");
    wait_status(&a, &ia, "completed");
    assert_eq!(status(&b, &ib), "running");
    let log = stderr(&service.stop());
    assert!(
        log.contains(&format!(
            "loop {ib} in {} cannot be driven here",
            b.root.display()
        )),
        "{log}"
    );
}

#[test]
fn sighup_reloads_the_configuration() {
    let a = Project::new(&held_agent());
    let b = Project::beside(&a, &held_agent());
    let user_config = a.home.join(".config/loopd/config.toml");
    std::fs::create_dir_all(user_config.parent().unwrap()).expect("mkdir");
    std::fs::write(&user_config, "max_running_loops = 1\n").expect("config");
    let (ia, ib) = (a.create(&["--title", "a"]), b.create(&["--title", "b"]));
    let service = a.serve(&roots(&[&a, &b]));
    set_status(&a, &ia, "running");
    read_pid(&a.root.join("agent-develop.pid"));
    set_status(&b, &ib, "running");
    wait_for("loop B to be queued", || {
        service
            .info()
            .is_some_and(|i| i["summary"] == "1 running, 0 paused, 1 queued")
    });
    std::fs::write(&user_config, "max_running_loops = 2\n").expect("config");
    service.signal(Signal::SIGHUP);
    read_pid(&b.root.join("agent-develop.pid"));
    for p in [&a, &b] {
        std::fs::write(p.root.join("go"), "").expect("go");
    }
    wait_status(&a, &ia, "completed");
    wait_status(&b, &ib, "completed");
    let log = stderr(&service.stop());
    assert!(log.contains("at most 2 loops at once"), "{log}");
}

#[test]
fn systemd_hears_ready_status_watchdog_reloading_and_stopping_in_order() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    let path = p.root.join("notify.sock");
    let socket = UnixDatagram::bind(&path).expect("bind the notify socket");
    socket
        .set_read_timeout(Some(DEADLINE))
        .expect("read timeout");
    let service = p.serve_with(&["--root", p.root.to_str().unwrap()], |cmd| {
        cmd.env("NOTIFY_SOCKET", &path)
            .env("WATCHDOG_USEC", "200000");
    });
    let mut seen = notifications(&socket, "READY=1");
    seen.extend(notifications(&socket, "WATCHDOG=1"));
    set_status(&p, &id, "running");
    wait_status(&p, &id, "completed");
    service.signal(Signal::SIGHUP);
    seen.extend(notifications(&socket, "RELOADING=1"));
    seen.extend(notifications(&socket, "READY=1"));
    // Read while the service stops (the watchdog still ticks): STOPPING comes.
    let reader = std::thread::spawn(move || notifications(&socket, "STOPPING=1"));
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0));
    seen.extend(reader.join().expect("reader"));
    let first = |prefix: &str| common::first_of(&seen, prefix);
    assert!(first("READY=1") < first("WATCHDOG=1"), "{seen:?}");
    assert!(first("STATUS=") < first("RELOADING=1"), "{seen:?}");
    assert!(first("RELOADING=1") < first("STOPPING=1"), "{seen:?}");
    assert!(
        seen.iter()
            .any(|s| s == "STATUS=1 running, 0 paused, 0 queued"),
        "{seen:?}"
    );
    assert!(
        seen.iter().any(|s| s.starts_with("MONOTONIC_USEC=")),
        "{seen:?}"
    );
    assert_eq!(
        seen.last().map(String::as_str),
        Some("STOPPING=1"),
        "{seen:?}"
    );
}

#[test]
fn log_lines_carry_journal_priorities_when_stderr_is_the_journal() {
    use std::os::unix::fs::MetadataExt as _;
    let p = Project::new(GOOD_AGENT);
    let log_path = p.root.join("journal.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let meta = log.metadata().expect("stat");
    let stream = format!("{}:{}", meta.dev(), meta.ino());
    let service = p.serve_with::<&str>(&[], |cmd| {
        cmd.env("JOURNAL_STREAM", &stream).stderr(log);
    });
    service.stop();
    let text = std::fs::read_to_string(&log_path).expect("read log");
    assert!(!text.is_empty());
    for line in text.lines() {
        assert!(
            line.starts_with("<6>") || line.starts_with("<4>"),
            "{line:?}"
        );
    }
}

#[test]
fn a_second_service_for_the_same_user_is_refused() {
    let p = Project::new(GOOD_AGENT);
    let service = p.serve::<&str>(&[]);
    let out = p.output(&["serve"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!(
            "a service already runs (pid {})",
            service.child.id()
        )),
        "{}",
        stderr(&out)
    );
    let out = p.output(&["--json", "serve"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        service.info().is_some(),
        "the first service's status is gone"
    );
}

#[test]
fn the_user_units_pass_systemd_analyze_verify() {
    let Some(analyze) = which("systemd-analyze") else {
        eprintln!("skipped: systemd-analyze is not installed");
        return;
    };
    // The unit runs ~/.cargo/bin/loopd: a home where that is this build.
    let home = tempfile::tempdir().expect("tempdir");
    let bin = home.path().join(".cargo/bin");
    std::fs::create_dir_all(&bin).expect("mkdir");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_loopd"), bin.join("loopd")).expect("link");
    let runtime = home.path().join("run");
    std::fs::create_dir_all(&runtime).expect("mkdir");
    for unit in ["loopd.service", "loopd-worker.service"] {
        let out = std::process::Command::new(&analyze)
            .args(["verify", "--user"])
            .arg(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("contrib")
                    .join(unit),
            )
            .env("HOME", home.path())
            .env("XDG_RUNTIME_DIR", &runtime)
            .output()
            .expect("run systemd-analyze");
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "{unit}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_loop_whose_work_tree_is_busy_is_queued_behind_the_other_and_runs_once_it_ends() {
    let p = Project::new(&held_agent());
    let (first, second) = (p.create(&["--title", "a"]), p.create(&["--title", "b"]));
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    let out = p.output(&["start", &first]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    read_pid(&p.root.join("agent-develop.pid"));
    // Started while the first runs in the project root: queued behind it, not refused.
    let out = p.output(&["start", &second]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("behind loop {first}")),
        "{}",
        stderr(&out)
    );
    let info = service.info().expect("info");
    assert_eq!(info["waiting"][0]["loop_id"], second.as_str(), "{info}");
    assert_eq!(info["waiting"][0]["behind"], first.as_str(), "{info}");
    assert_eq!(info["refused"], serde_json::json!([]), "{info}");
    assert_eq!(info["summary"], "1 running, 0 paused, 1 queued", "{info}");
    assert!(p.events(&second).is_empty());
    let shown = stdout(&p.output(&["status", &second]));
    assert!(shown.contains(&format!("queued behind {first}")), "{shown}");
    let listed = stdout(&p.output(&["list"]));
    assert!(
        listed.contains(&format!("queued behind {first}")),
        "{listed}"
    );
    std::fs::write(p.root.join("go"), "").expect("go");
    wait_status(&p, &first, "completed");
    wait_status(&p, &second, "completed");
    let info = service.info().expect("info");
    assert_eq!(info["waiting"], serde_json::json!([]), "{info}");
    let log = stderr(&service.stop());
    assert!(
        log.contains(&format!(
            "waits for loop {first}, which runs in its work tree"
        )),
        "{log}"
    );
}

#[test]
fn a_loop_that_can_never_be_taken_is_refused_and_says_why() {
    // An untrusted project config: the service cannot take the loop, and says so until fixed.
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    std::fs::write(
        p.root.join(".loop/config.toml"),
        format!("{TEST_CONFIG}\n# changed after trust\n"),
    )
    .expect("write config");
    set_status(&p, &id, "running");
    let mut reason = String::new();
    wait_for("the loop to be refused", || {
        let refused = service
            .info()
            .map(|i| i["refused"].clone())
            .unwrap_or_default();
        reason = refused[0]["reason"].as_str().unwrap_or_default().to_owned();
        refused[0]["loop_id"] == id.as_str()
    });
    assert!(reason.contains("trust"), "{reason}");
    let shown = stdout(&p.output(&["status", &id]));
    assert!(shown.contains("service    cannot take it: "), "{shown}");
    assert!(p.trust());
    set_status(&p, &id, "running");
    wait_status(&p, &id, "completed");
    drop(service);
}

#[test]
fn a_loop_set_running_right_after_another_of_its_project_completed_is_taken_up() {
    // The second loop is set running while the first one's task may still hold the work tree:
    // the service waits for it rather than for its next rescan.
    let p = Project::new(GOOD_AGENT);
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    for _ in 0..12 {
        let (a, b) = (ccw::create_loop(&p, "a"), ccw::create_loop(&p, "b"));
        ccw::set_status(&p, &a, "running");
        wait_status(&p, &a, "completed");
        ccw::set_status(&p, &b, "running");
        wait_status(&p, &b, "completed");
    }
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn a_notify_socket_nobody_reads_holds_no_loop_up() {
    // The receiver's queue fills at once (a watchdog tick every 10 ms) and stays full until
    // every loop is done: twenty loops still run to their end.
    let a = Project::new(GOOD_AGENT);
    let others: Vec<Project> = (0..19).map(|_| Project::beside(&a, GOOD_AGENT)).collect();
    let projects: Vec<&Project> = std::iter::once(&a).chain(&others).collect();
    let ids: Vec<String> = projects
        .iter()
        .map(|p| p.create(&["--title", "t"]))
        .collect();
    let path = a.root.join("notify.sock");
    let socket = UnixDatagram::bind(&path).expect("bind the notify socket");
    socket
        .set_read_timeout(Some(DEADLINE))
        .expect("read timeout");
    let service = a.serve_with(&roots(&projects), |cmd| {
        cmd.env("NOTIFY_SOCKET", &path)
            .env("WATCHDOG_USEC", "20000");
    });
    for (p, id) in projects.iter().zip(&ids) {
        set_status(p, id, "running");
    }
    for (p, id) in projects.iter().zip(&ids) {
        wait_status(p, id, "completed");
    }
    // Read now: READY came first, and what waited meanwhile comes, coalesced, the last status
    // saying every loop is done.
    let mut seen = notifications(&socket, "READY=1");
    seen.extend(notifications(
        &socket,
        "STATUS=0 running, 0 paused, 0 queued",
    ));
    // Read while the service stops (the watchdog still ticks): STOPPING comes.
    let reader = std::thread::spawn(move || notifications(&socket, "STOPPING=1"));
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    seen.extend(reader.join().expect("reader"));
    let statuses = seen.iter().filter(|s| s.starts_with("STATUS=")).count();
    assert!(
        statuses < 40,
        "status lines are coalesced while the receiver is stuck: {statuses}"
    );
}
