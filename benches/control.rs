//! Benchmark: control latency — how soon a pause, a stop or a resume written to the state file
//! takes effect on the executor's processes.
//!
//! The executor is a shell script that writes its pid, starts a grandchild (`sleep 1000 &`, pid
//! written too) and `exec`s `sleep 1000`: both die on SIGTERM, so the kill grace (0.5 s) is never
//! what is measured. Processes are polled every ~100 µs through `/proc/PID/stat` (a zombie counts
//! as gone). Trials:
//!   a) `loopd stop ID`, from the spawn of the CLI to the last executor process gone;
//!   b) a raw status write (read the JSON, set `"status":"failed"`, `std::fs::write`, i.e. truncate
//!      and write in place, as the CCW dashboard API does), from the write to the last process gone;
//!   c) `loopd pause ID`, from the spawn of the CLI to the last executor process gone;
//!   d) `loopd resume ID`, from the spawn of the CLI to the new executor's spawn (seen as a new live
//!      child of the daemon in `/proc/PID/task/*/children`) and to its pid file being written;
//!   e) the same as d) with a raw write of `"status":"running"` instead of the CLI;
//!   f) `loopd stop ID` of a loop a `loopd serve` drives (the loop handed to it by `loopd start`),
//!      from the spawn of the CLI to the executor gone and to the CLI's exit.
//! Stop trials use a fresh loop each (create + run); the pause/resume trials share one `loopd run`,
//! and each resume is sent once the daemon has logged `paused` (plus a short settle), so it
//! measures a resume of a settled pause.
//!
//! Run: `cargo bench --bench control`. Environment:
//!   LOOPD_BENCH_TRIALS   trials of each kind (default 100)
//!   LOOPD_BENCH_SETTLE_MS  settle time before each control write (default 10)
//!   LOOPD_BENCH_RACE_TRIALS  trials of the optional lost wake-up probe (default 0: off)
//!   LOOPD_BENCH_DUMP     set: print every sample, sorted, to stderr
//!   LOOPD_BENCH_DIR      where the temporary project goes (default: the system temp dir)

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{alive, env_num};

/// Writes its pid first (the resume trials wait for it), then starts and records a grandchild,
/// then becomes `sleep` itself.
const AGENT: &str = r#"#!/bin/sh
echo $$ > "$LOOPD_PROGRESS_DIR/agent.pid"
sleep 1000 &
echo $! > "$LOOPD_PROGRESS_DIR/agent.gpid"
exec sleep 1000
"#;

/// The poll interval of every measurement.
const POLL: Duration = Duration::from_micros(100);
/// A bound on every wait: it catches a hang, it measures nothing.
const DEADLINE: Duration = Duration::from_secs(10);
/// Time left to the daemon between an executor being up (or a pause logged) and the next control
/// write, in ms (LOOPD_BENCH_SETTLE_MS, default 10).
fn settle() -> Duration {
    Duration::from_millis(env_num("LOOPD_BENCH_SETTLE_MS", 10) as u64)
}

/// The live children of `pid`, from every thread's `children` list.
fn live_children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                out.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
        }
    }
    out.retain(|&c| alive(c));
    out
}

fn read_pid(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path)
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|&p| p != 0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Polls `cond` every [`POLL`] until it holds; `None` past [`DEADLINE`].
fn poll_until(mut cond: impl FnMut() -> bool) -> Option<Instant> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if cond() {
            return Some(Instant::now());
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(POLL);
    }
}

struct Project {
    base: common::Project,
    /// Executor pids seen, ended at drop if still alive (after a failed trial).
    seen: std::cell::RefCell<Vec<u32>>,
}

impl std::ops::Deref for Project {
    type Target = common::Project;
    fn deref(&self) -> &common::Project {
        &self.base
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        for &pid in self.seen.borrow().iter() {
            let is_sleep = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with("sleep\0"));
            if alive(pid) && is_sleep {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

impl Project {
    fn new() -> Project {
        Project {
            base: common::Project::new(
                &common::config(&["sh", "bin/agent.sh"], "stdin", "text", None),
                Some(AGENT),
            ),
            seen: Default::default(),
        }
    }

    /// `loopd --root ROOT` with its output discarded.
    fn loopd(&self) -> Command {
        let mut cmd = self.base.loopd();
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        cmd
    }

    fn create(&self) -> String {
        self.base.create(100_000)
    }

    fn state_path(&self, id: &str) -> PathBuf {
        self.root.join(".loop").join(format!("{id}.json"))
    }

    fn daemon_log(&self, id: &str) -> PathBuf {
        self.root.join(format!("daemon-{id}.log"))
    }

    /// `loopd run ID` in the background, its stderr kept in a file.
    fn spawn_run(&self, id: &str) -> Daemon {
        let log = std::fs::File::create(self.daemon_log(id)).expect("daemon log");
        let child = self
            .loopd()
            .args(["run", id])
            .stderr(log)
            .spawn()
            .expect("spawn loopd run");
        Daemon { child: Some(child) }
    }

    /// Waits until the executor of `id` is up: both pid files written, both processes alive.
    fn executor_up(&self, id: &str) -> Result<(u32, u32), String> {
        let dir = self.progress(id);
        let mut pids = (0, 0);
        poll_until(|| {
            match (
                read_pid(&dir.join("agent.pid")),
                read_pid(&dir.join("agent.gpid")),
            ) {
                (Some(p), Some(g)) if alive(p) && alive(g) => {
                    pids = (p, g);
                    true
                }
                _ => false,
            }
        })
        .ok_or_else(|| format!("the executor of {id} did not come up"))?;
        self.seen.borrow_mut().extend([pids.0, pids.1]);
        Ok(pids)
    }

    fn clear_pids(&self, id: &str) {
        let dir = self.progress(id);
        let _ = std::fs::remove_file(dir.join("agent.pid"));
        let _ = std::fs::remove_file(dir.join("agent.gpid"));
    }

    fn count_events(&self, id: &str, name: &str) -> usize {
        let needle = format!("\"event\":\"{name}\"");
        std::fs::read_to_string(self.progress(id).join("events.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(&needle))
            .count()
    }

    fn status(&self, id: &str) -> String {
        std::fs::read(self.state_path(id))
            .ok()
            .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
            .and_then(|v| v["status"].as_str().map(str::to_owned))
            .unwrap_or_else(|| "?".into())
    }

    /// The names of the last `n` events.
    fn last_events(&self, id: &str, n: usize) -> String {
        let text =
            std::fs::read_to_string(self.progress(id).join("events.jsonl")).unwrap_or_default();
        let names: Vec<String> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|e| e["event"].as_str().unwrap_or("?").to_owned())
            .collect();
        names[names.len().saturating_sub(n)..].join(",")
    }

    /// A raw whole-file rewrite of the status, without temp file or lock. Returns the instant
    /// just before the write.
    fn raw_status(&self, id: &str, status: &str) -> Instant {
        let path = self.state_path(id);
        let text = std::fs::read(&path).expect("read state");
        let mut v: serde_json::Value = serde_json::from_slice(&text).expect("state parses");
        v["status"] = serde_json::Value::String(status.to_owned());
        let bytes = serde_json::to_vec_pretty(&v).expect("json");
        let t0 = Instant::now();
        std::fs::write(&path, bytes).expect("write state");
        t0
    }

    /// `loopd VERB ID` in the background; returns it and the instant just before its spawn.
    fn cli(&self, verb: &str, id: &str) -> (Instant, Child) {
        let mut cmd = self.loopd();
        cmd.args([verb, id]);
        let t0 = Instant::now();
        let child = cmd.spawn().expect("spawn loopd CLI");
        (t0, child)
    }
}

/// A `loopd run` that is killed if the bench leaves it behind.
struct Daemon {
    child: Option<Child>,
}

impl Daemon {
    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    fn wait(&mut self) -> Option<ExitStatus> {
        poll_until(|| self.try_wait().is_some())?;
        self.child.take()?.wait().ok()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[derive(Default)]
struct Samples {
    ms: Vec<f64>,
    failures: Vec<String>,
}

impl Samples {
    fn push(&mut self, r: Result<f64, String>) {
        match r {
            Ok(v) => self.ms.push(v),
            Err(e) => {
                eprintln!("trial failed: {e}");
                self.failures.push(e);
            }
        }
    }

    /// Nearest-rank percentile.
    fn pct(&self, p: f64) -> f64 {
        let mut v = self.ms.clone();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return f64::NAN;
        }
        let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
        v[rank.min(v.len()) - 1]
    }

    fn row(&self, what: &str) {
        if std::env::var_os("LOOPD_BENCH_DUMP").is_some() {
            let mut v = self.ms.clone();
            v.sort_by(f64::total_cmp);
            let v: Vec<String> = v.iter().map(|x| format!("{x:.1}")).collect();
            eprintln!("{what}: {}", v.join(" "));
        }
        println!(
            "| {what} | {} | {:.2} | {:.2} | {:.2} | {:.2} |{}",
            self.ms.len(),
            self.pct(0.0),
            self.pct(50.0),
            self.pct(99.0),
            self.pct(100.0),
            if self.failures.is_empty() {
                String::new()
            } else {
                format!(" {} failed", self.failures.len())
            }
        );
    }
}

/// What one kill measurement saw, in ms after the trigger.
struct KillTimes {
    gone: f64,
    cli_exit: Option<f64>,
    daemon_exit: Option<f64>,
    daemon_status: Option<ExitStatus>,
}

/// Polls until both executor processes are gone (and the CLI and, when `wait_daemon`, the daemon
/// have exited), timing each from `t0`.
fn time_kill(
    t0: Instant,
    pids: (u32, u32),
    mut cli: Option<Child>,
    daemon: &mut Daemon,
    wait_daemon: bool,
) -> Result<KillTimes, String> {
    let deadline = t0 + DEADLINE;
    let (mut gone, mut cli_exit, mut daemon_exit) = (None, None, None);
    let mut daemon_status = None;
    loop {
        let now = Instant::now();
        if gone.is_none() && !alive(pids.0) && !alive(pids.1) {
            gone = Some(now);
        }
        if let Some(c) = &mut cli
            && cli_exit.is_none()
            && let Ok(Some(status)) = c.try_wait()
        {
            cli_exit = Some(now);
            if !status.success() {
                return Err(format!("the CLI exited {status}"));
            }
        }
        if wait_daemon
            && daemon_exit.is_none()
            && let Some(s) = daemon.try_wait()
        {
            daemon_exit = Some(now);
            daemon_status = Some(s);
        }
        let done = gone.is_some()
            && (cli.is_none() || cli_exit.is_some())
            && (!wait_daemon || daemon_exit.is_some());
        if done {
            break;
        }
        if now > deadline {
            return Err(format!(
                "not done after {DEADLINE:?}: executor gone {}, CLI exited {}, daemon exited {}",
                gone.is_some(),
                cli_exit.is_some(),
                daemon_exit.is_some()
            ));
        }
        std::thread::sleep(POLL);
    }
    let after = |t: Option<Instant>| t.map(|t| ms(t - t0));
    Ok(KillTimes {
        gone: after(gone).unwrap_or(f64::NAN),
        cli_exit: after(cli_exit),
        daemon_exit: after(daemon_exit),
        daemon_status,
    })
}

/// One stop trial on a fresh loop: `raw` writes the status, else `loopd stop`.
fn stop_trial(
    p: &Project,
    raw: bool,
    cli_exit: &mut Samples,
    daemon_exit: &mut Samples,
) -> Result<f64, String> {
    let id = p.create();
    let mut daemon = p.spawn_run(&id);
    let pids = p.executor_up(&id)?;
    std::thread::sleep(settle());
    let (t0, cli) = if raw {
        (p.raw_status(&id, "failed"), None)
    } else {
        let (t0, c) = p.cli("stop", &id);
        (t0, Some(c))
    };
    let times = time_kill(t0, pids, cli, &mut daemon, true)?;
    if let Some(c) = times.cli_exit {
        cli_exit.ms.push(c);
    }
    if let Some(d) = times.daemon_exit {
        daemon_exit.ms.push(d);
    }
    match times.daemon_status.and_then(|s| s.code()) {
        Some(5) => Ok(times.gone),
        other => Err(format!(
            "loopd run exited {other:?}, expected 5\n{}",
            std::fs::read_to_string(p.daemon_log(&id)).unwrap_or_default()
        )),
    }
}

/// f) `trials` stops of loops driven by one `loopd serve`: (executor gone, `loopd stop` exited).
fn stop_with_service(trials: usize) -> Result<(Samples, Samples), String> {
    let p = Project::new();
    let mut service = Daemon {
        child: Some(
            p.loopd()
                .args(["serve", "--root"])
                .arg(&p.root)
                .spawn()
                .expect("spawn loopd serve"),
        ),
    };
    let (mut gone, mut exited) = (Samples::default(), Samples::default());
    let serving = p.home.join(".local/state/loopd/run/serve.json");
    poll_until(|| serving.exists()).ok_or("the service did not start")?;
    for _ in 0..trials {
        let id = p.create();
        let started = p.loopd().args(["start", &id]).status();
        if !started.as_ref().is_ok_and(|s| s.success()) {
            return Err(format!("loopd start {id}: {started:?}"));
        }
        let pids = p.executor_up(&id)?;
        std::thread::sleep(settle());
        let (t0, cli) = p.cli("stop", &id);
        let times = time_kill(t0, pids, Some(cli), &mut service, false)?;
        gone.ms.push(times.gone);
        exited.ms.extend(times.cli_exit);
        if let Some(s) = service.try_wait() {
            return Err(format!("the service exited {s}"));
        }
    }
    Ok((gone, exited))
}

struct PauseResume {
    pause: Samples,
    pause_cli_exit: Samples,
    resume_cli_spawn: Samples,
    resume_cli_pidfile: Samples,
    resume_cli_exit: Samples,
    resume_raw_spawn: Samples,
    resume_raw_pidfile: Samples,
}

/// `trials` pauses (by the CLI), each followed by a resume, alternately by the CLI and by a raw
/// write, all on one `loopd run`.
fn pause_resume(trials: usize) -> Result<PauseResume, String> {
    let p = Project::new();
    let id = p.create();
    let mut daemon = p.spawn_run(&id);
    let daemon_pid = daemon.pid();
    let mut out = PauseResume {
        pause: Samples::default(),
        pause_cli_exit: Samples::default(),
        resume_cli_spawn: Samples::default(),
        resume_cli_pidfile: Samples::default(),
        resume_cli_exit: Samples::default(),
        resume_raw_spawn: Samples::default(),
        resume_raw_pidfile: Samples::default(),
    };
    let mut pids = p.executor_up(&id)?;
    for i in 0..trials {
        std::thread::sleep(settle());
        // c) pause.
        let paused_before = p.count_events(&id, "paused");
        let (t0, cli) = p.cli("pause", &id);
        let times = time_kill(t0, pids, Some(cli), &mut daemon, false)?;
        out.pause.ms.push(times.gone);
        if let Some(c) = times.cli_exit {
            out.pause_cli_exit.ms.push(c);
        }
        if let Some(s) = daemon.try_wait() {
            return Err(format!("loopd run exited {s} while paused"));
        }
        // Resume a settled pause: once the daemon has logged it.
        poll_until(|| p.count_events(&id, "paused") > paused_before)
            .ok_or("the daemon did not log `paused`")?;
        std::thread::sleep(settle());
        p.clear_pids(&id);
        let old = live_children(daemon_pid);
        // d) or e): resume.
        let raw = i % 2 == 1;
        let (t0, mut cli) = if raw {
            (p.raw_status(&id, "running"), None)
        } else {
            let (t0, c) = p.cli("resume", &id);
            (t0, Some(c))
        };
        let deadline = t0 + DEADLINE;
        let (mut spawned, mut pidfile, mut cli_exit) = (None, None, None);
        let dir = p.progress(&id);
        loop {
            let now = Instant::now();
            if spawned.is_none() && live_children(daemon_pid).iter().any(|c| !old.contains(c)) {
                spawned = Some(now);
            }
            if pidfile.is_none() && read_pid(&dir.join("agent.pid")).is_some() {
                pidfile = Some(now);
                // A child that came and went between two polls still counts as spawned.
                spawned.get_or_insert(now);
            }
            if let Some(c) = &mut cli
                && cli_exit.is_none()
                && let Ok(Some(status)) = c.try_wait()
            {
                cli_exit = Some(now);
                if !status.success() {
                    return Err(format!("loopd resume exited {status}"));
                }
            }
            if pidfile.is_some() && (cli.is_none() || cli_exit.is_some()) {
                break;
            }
            if now > deadline {
                return Err(format!(
                    "resume trial {i} ({}): no new executor after {DEADLINE:?} (spawn seen {}, CLI exited {})\n{}",
                    if raw { "raw write" } else { "CLI" },
                    spawned.is_some(),
                    cli_exit.is_some(),
                    std::fs::read_to_string(p.daemon_log(&id)).unwrap_or_default()
                ));
            }
            std::thread::sleep(POLL);
        }
        let after = |t: Option<Instant>| t.map_or(f64::NAN, |t| ms(t - t0));
        if raw {
            out.resume_raw_spawn.ms.push(after(spawned));
            out.resume_raw_pidfile.ms.push(after(pidfile));
        } else {
            out.resume_cli_spawn.ms.push(after(spawned));
            out.resume_cli_pidfile.ms.push(after(pidfile));
            out.resume_cli_exit.ms.push(after(cli_exit));
        }
        pids = p.executor_up(&id)?;
    }
    // End the loop cleanly.
    let (_, mut cli) = p.cli("stop", &id);
    let _ = cli.wait();
    daemon.wait();
    Ok(out)
}

/// Optional probe of lost wake-ups (LOOPD_BENCH_RACE_TRIALS, default 0): control writes that land
/// just as the daemon changes phase. f1) a raw resume written 0–4 ms after a raw pause has ended
/// the executor: does a new executor start? f2) a raw pause written 0–1.5 ms after a raw resume: is
/// the executor it started ended? Each miss is waited for 2 s, then undone by another write.
fn race_probe(trials: usize) -> Result<(usize, usize, usize), String> {
    let p = Project::new();
    let id = p.create();
    let mut daemon = p.spawn_run(&id);
    let daemon_pid = daemon.pid();
    let (mut lost_resume, mut lost_pause) = (0, 0);
    let dir = p.progress(&id);
    let patience = Duration::from_secs(2);
    let mut pids = p.executor_up(&id)?;
    for i in 0..trials {
        std::thread::sleep(settle());
        // f1: pause, then resume right behind it.
        p.raw_status(&id, "paused");
        poll_until(|| !alive(pids.0) && !alive(pids.1)).ok_or("pause did not end the executor")?;
        std::thread::sleep(Duration::from_micros(fastrand::u64(0..4000)));
        p.clear_pids(&id);
        p.raw_status(&id, "running");
        let t = Instant::now();
        let mut came = false;
        while t.elapsed() < patience {
            if read_pid(&dir.join("agent.pid")).is_some() {
                came = true;
                break;
            }
            std::thread::sleep(POLL);
        }
        if !came {
            lost_resume += 1;
            eprintln!(
                "f1 trial {i}: resume written but no executor after {patience:?} (status in the file: {}, daemon children {:?}, last events: {})",
                p.status(&id),
                live_children(daemon_pid),
                p.last_events(&id, 3)
            );
            // Any change a controller can make wakes a waiting daemon.
            p.raw_status(&id, "paused");
            std::thread::sleep(Duration::from_millis(20));
            p.raw_status(&id, "running");
        }
        pids = p.executor_up(&id)?;
        // f2: the executor just started; pause right behind the resume.
        std::thread::sleep(settle());
        p.raw_status(&id, "paused");
        poll_until(|| !alive(pids.0) && !alive(pids.1)).ok_or("pause did not end the executor")?;
        std::thread::sleep(Duration::from_micros(fastrand::u64(0..4000)));
        p.clear_pids(&id);
        p.raw_status(&id, "running");
        std::thread::sleep(Duration::from_micros(fastrand::u64(0..1500)));
        p.raw_status(&id, "paused");
        // Whatever started must end soon.
        let t = Instant::now();
        let mut stuck = None;
        while t.elapsed() < patience {
            let kids = live_children(daemon_pid);
            if kids.is_empty() {
                stuck = None;
                // Stay a little longer: a spawn may be on its way.
                if t.elapsed() > Duration::from_millis(300) {
                    break;
                }
            } else {
                stuck = Some(kids);
            }
            std::thread::sleep(POLL);
        }
        if let Some(kids) = stuck {
            lost_pause += 1;
            eprintln!(
                "f2 trial {i}: pause written but the executor {kids:?} still runs after {patience:?} (status in the file: {}, last events: {})",
                p.status(&id),
                p.last_events(&id, 3)
            );
            p.raw_status(&id, "running");
            std::thread::sleep(Duration::from_millis(20));
            p.raw_status(&id, "paused");
            poll_until(|| live_children(daemon_pid).is_empty())
                .ok_or("the executor never ended")?;
        }
        p.clear_pids(&id);
        p.raw_status(&id, "running");
        pids = p.executor_up(&id)?;
        if let Some(s) = daemon.try_wait() {
            return Err(format!("loopd run exited {s}"));
        }
    }
    let (_, mut cli) = p.cli("stop", &id);
    let _ = cli.wait();
    daemon.wait();
    Ok((trials, lost_resume, lost_pause))
}

/// For context: the CLI alone, `loopd stop` of a loop that no daemon drives (its start, the
/// locked and fsync'd write, its exit), spawned → exited.
fn cli_alone(trials: usize) -> Samples {
    let p = Project::new();
    let mut s = Samples::default();
    for _ in 0..trials {
        let id = p.create();
        let (t0, mut c) = p.cli("stop", &id);
        match c.wait() {
            Ok(st) if st.success() => s.ms.push(ms(t0.elapsed())),
            other => s.failures.push(format!("loopd stop: {other:?}")),
        }
    }
    s
}

/// For context: a bare `sh bin/agent.sh` from spawn to its pid file (the shell's own start).
fn bare_pidfile(trials: usize) -> Samples {
    let p = Project::new();
    let dir = p.root.join("bare");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mut s = Samples::default();
    for _ in 0..trials {
        let _ = std::fs::remove_file(dir.join("agent.pid"));
        let _ = std::fs::remove_file(dir.join("agent.gpid"));
        use std::os::unix::process::CommandExt as _;
        let t0 = Instant::now();
        let mut child = Command::new("sh")
            .arg("bin/agent.sh")
            .current_dir(&p.root)
            .env("LOOPD_PROGRESS_DIR", &dir)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn agent");
        let seen = poll_until(|| read_pid(&dir.join("agent.pid")).is_some());
        match seen {
            Some(t) => s.ms.push(ms(t - t0)),
            None => s.failures.push("no pid file".into()),
        }
        // Make sure the grandchild exists before ending the group, so none is left.
        poll_until(|| read_pid(&dir.join("agent.gpid")).is_some());
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = child.wait();
    }
    s
}

fn main() {
    let trials = env_num("LOOPD_BENCH_TRIALS", 100).max(1);
    let started = Instant::now();
    let stops = Project::new();
    println!(
        "loopd control latency: {trials} trials each; poll {} µs; kill_grace 0.5 s; temp dir {}",
        POLL.as_micros(),
        stops.root.parent().unwrap_or(&stops.root).display()
    );

    let mut stop_cli = Samples::default();
    let mut stop_cli_exit = Samples::default();
    let mut stop_cli_daemon = Samples::default();
    let mut stop_raw = Samples::default();
    let mut stop_raw_daemon = Samples::default();
    let mut unused = Samples::default();
    for i in 0..2 * trials {
        // Alternate, so both see the same conditions.
        if i % 2 == 0 {
            let r = stop_trial(&stops, false, &mut stop_cli_exit, &mut stop_cli_daemon);
            stop_cli.push(r);
        } else {
            let r = stop_trial(&stops, true, &mut unused, &mut stop_raw_daemon);
            stop_raw.push(r);
        }
    }
    drop(stops);
    eprintln!(
        "stop trials done in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let t = Instant::now();
    let pr = match pause_resume(2 * trials) {
        Ok(pr) => pr,
        Err(e) => {
            eprintln!("pause/resume trials aborted: {e}");
            std::process::exit(1);
        }
    };
    eprintln!(
        "pause/resume trials done in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let served = stop_with_service(trials.min(50));
    let bare = bare_pidfile(trials.min(50));
    let cli = cli_alone(trials.min(50));

    println!();
    println!("| latency (ms) | n | min | p50 | p99 | max |");
    println!("|---|---|---|---|---|---|");
    stop_cli.row("a) `loopd stop` spawned → executor child + grandchild gone");
    stop_cli_exit.row("   … → `loopd stop` exited");
    stop_cli_daemon.row("   … → `loopd run` exited (code 5)");
    stop_raw.row("b) raw write `\"status\":\"failed\"` → executor gone");
    stop_raw_daemon.row("   … → `loopd run` exited (code 5)");
    pr.pause.row("c) `loopd pause` spawned → executor gone");
    pr.pause_cli_exit.row("   … → `loopd pause` exited");
    pr.resume_cli_spawn
        .row("d) `loopd resume` spawned → new executor forked");
    pr.resume_cli_pidfile
        .row("   … → new executor wrote its pid file");
    pr.resume_cli_exit.row("   … → `loopd resume` exited");
    pr.resume_raw_spawn
        .row("e) raw write `\"status\":\"running\"` → new executor forked");
    pr.resume_raw_pidfile
        .row("   … → new executor wrote its pid file");
    match served {
        Ok((gone, exited)) => {
            gone.row("f) `loopd stop` of a loop the service drives → executor gone");
            exited.row("   … → `loopd stop` exited");
        }
        Err(e) => eprintln!("service trials aborted: {e}"),
    }
    bare.row("context: bare `sh agent.sh` spawned → its pid file");
    cli.row("context: `loopd stop` with no daemon, spawned → exited");
    let race_trials = env_num("LOOPD_BENCH_RACE_TRIALS", 0);
    if race_trials > 0 {
        match race_probe(race_trials) {
            Ok((n, f1, f2)) => {
                println!();
                println!("| lost wake-up probe | trials | missed |");
                println!("|---|---|---|");
                println!("| f1) raw resume 0–4 ms after a pause ended the executor | {n} | {f1} |");
                println!("| f2) raw pause 0–1.5 ms after a raw resume | {n} | {f2} |");
            }
            Err(e) => eprintln!("race probe aborted: {e}"),
        }
    }
    println!();
    println!("total {:.1} s", started.elapsed().as_secs_f64());
    let failed = stop_cli.failures.len() + stop_raw.failures.len();
    if failed > 0 {
        eprintln!("{failed} stop trials failed");
        std::process::exit(1);
    }
}
