//! Benchmark: one `loopd serve` driving many loops at once.
//!
//! N projects (one loop each: a loop without a worktree of its own has its project's work tree
//! to itself) share one user's service. Each action of each loop is a shell agent that records
//! its pid and sleeps 0.2 s. Measured:
//!   - the time from a raw write of `"status": "running"` to every loop at once to every one
//!     taken (in the service's list), and to every one's first executor started;
//!   - the service's memory while every loop runs (peak RSS, PSS, threads) and its inotify
//!     instances;
//!   - its own CPU per action (utime + stime of the service over a window, divided by the
//!     actions finished in it) and the throughput against the ideal N / 0.2 s, beside the CPU
//!     per action of one `loopd run` driving the same loop alone (measured first, over
//!     LOOPD_BENCH_RUN_WINDOW seconds), and their ratio;
//!   - a raw write of `"status": "paused"` or `"failed"` (as the dashboard does), from the write
//!     to the executor gone, while every loop runs;
//!   - its CPU ticks over 10 s once every loop is paused;
//!   - a raw write of `"status": "running"` to the executor spawned (its pid file written), with
//!     N loops known;
//!   - a SIGTERM to the service with every loop running, to its exit: every executor gone, no
//!     state left with an attempt in flight.
//!
//! With several sizes, a scale table follows: the same measures at each.
//!
//! Run: `cargo bench --bench service`. Environment:
//!   LOOPD_BENCH_LOOPS    loops, or sizes separated by commas (`10,200,1000`; default 200)
//!   LOOPD_BENCH_WINDOW   seconds of the measured window under load (default 10)
//!   LOOPD_BENCH_TRIALS   pause, stop and pick-up trials each (default 50)
//!   LOOPD_BENCH_RUN_WINDOW  seconds of the `loopd run` baseline (default 30)
//!   LOOPD_BENCH_DIR      where the temporary projects go (default: the system temp dir)
//!   LOOPD_BENCH_GIT      `1`: each project a git repository, each action checkpointed
//!   LOOPD_BENCH_SERVICE_LOG  a directory to keep each service's log in (`serve-N.log`)

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{Project, alive, config, cpu_ticks, env_num, git, status_kib, tempdir, tick_ms};

/// Plans 20 tasks, then every action records its pid, adds a line to `work.txt` and takes 0.2 s;
/// validation never passes, so the loop goes on (debug, develop...) until its iteration limit.
fn agent() -> String {
    let tasks = vec![r#"{"description":"t"}"#; 20].join(",");
    format!(
        r#"#!/bin/sh
echo $$ > "$LOOPD_PROGRESS_DIR/agent.pid"
cat > /dev/null
echo "$LOOPD_ACTION" >> work.txt
case "$LOOPD_ACTION" in
  init) echo '{{"status":"success","summary":"planned","state_updates":{{"tasks":[{tasks}]}}}}' ;;
  validate) sleep 0.2; echo '{{"status":"success","summary":"not yet","state_updates":{{"passed":false,"pass_rate":50}}}}' ;;
  *) sleep 0.2; echo '{{"status":"success","summary":"done"}}' ;;
esac
"#
    )
}

const POLL: Duration = Duration::from_micros(100);
const DEADLINE: Duration = Duration::from_secs(60);

struct Loop {
    project: Project,
    id: String,
}

impl Loop {
    fn state_path(&self) -> PathBuf {
        self.project
            .root
            .join(".loop")
            .join(format!("{}.json", self.id))
    }

    fn agent_pid_file(&self) -> PathBuf {
        self.project.progress(&self.id).join("agent.pid")
    }

    /// Sets the status by an atomic rewrite of the state file; returns when the rename is done.
    fn set_status(&self, status: &str) -> Instant {
        let path = self.state_path();
        let mut state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read state")).expect("parse");
        state["status"] = status.into();
        let tmp = path.with_extension("bench");
        std::fs::write(&tmp, serde_json::to_vec(&state).expect("json")).expect("write");
        std::fs::rename(&tmp, &path).expect("rename");
        Instant::now()
    }

    fn actions_finished(&self) -> usize {
        std::fs::read_to_string(self.project.progress(&self.id).join("events.jsonl"))
            .unwrap_or_default()
            .matches("\"action_finished\"")
            .count()
    }
}

fn wait(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(POLL);
    }
}

fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn inotify_instances(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.filter_map(Result::ok)
                .filter(|fd| {
                    std::fs::read_link(fd.path())
                        .is_ok_and(|l| l.to_string_lossy().contains("inotify"))
                })
                .count()
        })
        .unwrap_or(0)
}

fn service_info(home: &Path) -> Option<serde_json::Value> {
    let path = home.join(".local/state/loopd/run/serve.json");
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

fn running_count(home: &Path) -> usize {
    service_info(home)
        .and_then(|i| i["running"].as_array().map(Vec::len))
        .unwrap_or(0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Prints the p50, p99 and max of `ms`; returns the p99.
fn summary(name: &str, mut ms: Vec<f64>) -> f64 {
    ms.sort_by(f64::total_cmp);
    let p99 = percentile(&ms, 0.99);
    println!(
        "| {name} | {:.1} ms | {p99:.1} ms | {:.1} ms |",
        percentile(&ms, 0.5),
        ms.last().copied().unwrap_or(0.0)
    );
    p99
}

/// Waits for the executor of a loop to be up (its pid file names a live agent); returns it.
fn executor(l: &Loop) -> u32 {
    let mut pid = 0;
    wait("an executor", || {
        pid = std::fs::read_to_string(l.agent_pid_file())
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        pid != 0
            && alive(pid)
            && std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("agent.sh"))
    });
    pid
}

/// The CPU of one `loopd run` (its own, not its executors') per action, driving a loop of the
/// same agent alone for `window`: its utime + stime just before it is stopped, divided by the
/// actions it finished. Its project is returned, to be removed at the end: files released now
/// would make the service's new files dearer on some filesystems (ext4 without a journal
/// searches past recently released inodes).
/// A project of the bench's agent, sharing `home` if given; a git repository with a commit
/// under `LOOPD_BENCH_GIT=1` (every action that changes the tree then checkpointed).
fn project(agent: &str, home: Option<&Path>) -> Project {
    let project = Project::in_home(
        &config(&["sh", "bin/agent.sh"], "stdin", "json", None),
        Some(agent),
        home,
    );
    if std::env::var("LOOPD_BENCH_GIT").as_deref() == Ok("1") {
        git(&project.root, &["init", "--quiet"]);
        git(&project.root, &["add", "bin"]);
        git(&project.root, &["commit", "--quiet", "-m", "start"]);
    }
    project
}

fn run_baseline(agent: &str, window: Duration) -> (f64, Project) {
    let project = project(agent, None);
    let id = project.create(100_000);
    let child = project
        .loopd()
        .args(["run", &id])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn loopd run");
    let pid = child.id();
    let mut child = Guard(child);
    let l = Loop { project, id };
    // From its first action on: the start (config, action files) is no action's.
    wait("the first action", || l.actions_finished() > 0);
    let (ticks0, actions0) = (cpu_ticks(pid), l.actions_finished());
    std::thread::sleep(window);
    let (ticks1, actions1) = (cpu_ticks(pid), l.actions_finished());
    let _ = l.project.loopd().args(["stop", &l.id]).status();
    let _ = child.0.wait();
    let per_action = (ticks1 - ticks0) as f64 * tick_ms() / (actions1 - actions0).max(1) as f64;
    (per_action, l.project)
}

fn main() {
    let sizes: Vec<usize> = std::env::var("LOOPD_BENCH_LOOPS")
        .unwrap_or_else(|_| "200".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .unwrap_or_else(|_| panic!("LOOPD_BENCH_LOOPS: {n:?} is not a number"))
        })
        .collect();
    let window = Duration::from_secs(env_num("LOOPD_BENCH_WINDOW", 10) as u64);
    let agent = agent();
    let run_window = Duration::from_secs(env_num("LOOPD_BENCH_RUN_WINDOW", 30) as u64);
    let (run_cpu, _baseline) = run_baseline(&agent, run_window);
    eprintln!("`loopd run` alone: {run_cpu:.2} ms of CPU per action");
    let rows: Vec<Row> = sizes
        .iter()
        .map(|n| one_service(*n, &agent, window, run_cpu))
        .collect();
    if rows.len() > 1 {
        println!(
            "
Scale: the same loop, more of them in one service:
"
        );
        println!(
            "| loops | actions/s | service CPU per action | × `loopd run` | peak RSS | \
             `paused` p99 | `failed` p99 | SIGTERM → exited, every executor gone |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {:.0} | {:.2} ms | {:.2} | {:.1} MiB | {:.1} ms | {:.1} ms | {:.2} s |",
                r.loops,
                r.actions_per_s,
                r.cpu_per_action,
                r.cpu_per_action / run_cpu,
                r.peak_rss_mib,
                r.pause_p99,
                r.stop_p99,
                r.sigterm.as_secs_f64()
            );
        }
    }
}

/// One service's measures, for the scale table.
struct Row {
    loops: usize,
    actions_per_s: f64,
    cpu_per_action: f64,
    peak_rss_mib: f64,
    pause_p99: f64,
    stop_p99: f64,
    sigterm: Duration,
}

/// Measures one `loopd serve` driving `n` loops (see the module's documentation).
fn one_service(n: usize, agent: &str, window: Duration, run_cpu: f64) -> Row {
    // Pause trials and stop trials each take loops of their own.
    let trials = env_num("LOOPD_BENCH_TRIALS", 50).clamp(1, (n / 2).max(1));
    let home_dir = tempdir();
    let home = home_dir.path().canonicalize().expect("home");
    let setup = Instant::now();
    let loops: Vec<Loop> = (0..n)
        .map(|_| {
            let project = project(agent, Some(&home));
            let id = project.create(100_000);
            Loop { project, id }
        })
        .collect();
    eprintln!(
        "{n} projects with a loop each, made in {:.1}s",
        setup.elapsed().as_secs_f64()
    );

    let log = std::env::var_os("LOOPD_BENCH_SERVICE_LOG")
        .map(|dir| Path::new(&dir).join(format!("serve-{n}.log")));
    let mut service: Child = loops[0]
        .project
        .loopd()
        .args(["serve", "--max-running-loops"])
        .arg(n.to_string())
        .stdout(Stdio::null())
        .stderr(if log.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .spawn()
        .expect("spawn loopd serve");
    if let Some(log) = log {
        keep_log(&mut service, log);
    }
    let pid = service.id();
    let mut service = Guard(service);
    wait("the service", || {
        service_info(&home).is_some_and(|i| i["roots"].as_array().map(Vec::len) == Some(n))
    });

    let start = Instant::now();
    for l in &loops {
        l.set_status("running");
    }
    wait("every loop running", || running_count(&home) == n);
    let all_running = start.elapsed();
    // Taken is not yet driven: each loop's first executor, seen every 10 ms (a closer look
    // would take a core from the service).
    let mut spawned = 0;
    let deadline = Instant::now() + DEADLINE;
    while spawned < n {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for every executor"
        );
        if loops[spawned].agent_pid_file().exists() {
            spawned += 1;
        } else {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let all_driven = start.elapsed();
    std::thread::sleep(Duration::from_secs(3));

    // The window under load.
    let (ticks0, actions0) = (
        cpu_ticks(pid),
        loops.iter().map(Loop::actions_finished).sum::<usize>(),
    );
    let begun = Instant::now();
    let mut peak_rss = 0;
    while begun.elapsed() < window {
        peak_rss = peak_rss.max(status_kib(pid, "VmRSS:"));
        std::thread::sleep(Duration::from_millis(200));
    }
    let elapsed = begun.elapsed().as_secs_f64();
    let (ticks1, actions1) = (
        cpu_ticks(pid),
        loops.iter().map(Loop::actions_finished).sum::<usize>(),
    );
    let pss = pss_kib(pid);
    let threads = status_kib(pid, "Threads:");
    let actions = actions1 - actions0;
    let cpu_per_action = (ticks1 - ticks0) as f64 * tick_ms() / actions as f64;

    // Pause and stop under load: from the raw write to the executor gone.
    let mut paused: Vec<f64> = Vec::new();
    let mut stopped: Vec<f64> = Vec::new();
    for (i, l) in loops.iter().take(2 * trials).enumerate() {
        let agent = executor(l);
        let written = l.set_status(if i < trials { "paused" } else { "failed" });
        wait("the executor to go", || !alive(agent));
        let ms = written.elapsed().as_secs_f64() * 1000.0;
        if i < trials {
            &mut paused
        } else {
            &mut stopped
        }
        .push(ms);
    }

    // Idle: every loop paused.
    for l in loops.iter().skip(2 * trials) {
        l.set_status("paused");
    }
    wait("every loop to stop running", || running_count(&home) == 0);
    std::thread::sleep(Duration::from_secs(1));
    let idle0 = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(10));
    let idle_ticks = cpu_ticks(pid) - idle0;

    // Pick-up: a raw write of "running" to the executor's pid file, with N loops known.
    let mut picked = Vec::new();
    for l in loops.iter().take(trials) {
        let _ = std::fs::remove_file(l.agent_pid_file());
        let written = l.set_status("running");
        wait("the executor to start", || l.agent_pid_file().exists());
        picked.push(written.elapsed().as_secs_f64() * 1000.0);
        l.set_status("paused");
        wait("the loop to pause", || running_count(&home) == 0);
    }

    println!("\n{n} loops in one `loopd serve`, each action a 0.2 s shell agent:\n");
    println!("| measure | value |");
    println!("|---|---|");
    println!(
        "| every loop taken after its raw write of `running` | {:.2} s |",
        all_running.as_secs_f64()
    );
    println!(
        "| every loop's first executor started after it | {:.2} s |",
        all_driven.as_secs_f64()
    );
    println!(
        "| service RSS, peak under load | {:.1} MiB |",
        peak_rss as f64 / 1024.0
    );
    println!(
        "| service PSS under load | {:.1} MiB |",
        pss as f64 / 1024.0
    );
    println!("| service threads | {threads} |");
    println!("| inotify instances | {} |", inotify_instances(pid));
    println!(
        "| actions per second | {:.0} of an ideal {:.0} |",
        actions as f64 / elapsed,
        n as f64 / 0.2
    );
    println!("| service CPU per action | {cpu_per_action:.2} ms |");
    println!("| `loopd run` CPU per action, the same loop alone | {run_cpu:.2} ms |");
    println!(
        "| service / `loopd run`, CPU per action | {:.2} |",
        cpu_per_action / run_cpu
    );
    println!("| service CPU ticks over 10 s, every loop paused | {idle_ticks} |");
    println!("\n| raw write | p50 | p99 | max |");
    println!("|---|---|---|---|");
    let (pause_p99, stop_p99) = (
        summary("`paused` → executor gone, under load", paused),
        summary("`failed` (stop) → executor gone, under load", stopped),
    );
    summary(
        &format!("`running` → executor spawned, {n} loops known"),
        picked,
    );

    // SIGTERM with every loop running: until the service has exited, every executor gone and
    // every loop's state left with no attempt in flight.
    for l in &loops {
        l.set_status("running");
    }
    wait("every loop running again", || running_count(&home) == n);
    std::thread::sleep(Duration::from_secs(3));
    let agents: Vec<u32> = loops
        .iter()
        .filter_map(|l| {
            std::fs::read_to_string(l.agent_pid_file())
                .ok()?
                .trim()
                .parse()
                .ok()
        })
        .collect();
    let termed = Instant::now();
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let status = service.0.wait().expect("wait");
    let sigterm = termed.elapsed();
    let left = agents
        .iter()
        .filter(|a| {
            alive(**a)
                && std::fs::read(format!("/proc/{a}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("agent.sh"))
        })
        .count();
    let in_flight = loops
        .iter()
        .filter(|l| {
            let state: serde_json::Value =
                serde_json::from_slice(&std::fs::read(l.state_path()).expect("state"))
                    .expect("a state file that parses");
            !state["skill_state"]["in_flight"].is_null()
        })
        .count();
    println!(
        "| SIGTERM with {n} loops running → service exited ({status}) | {:.2} s; \
         executors left: {left}; states with an attempt in flight: {in_flight} |",
        sigterm.as_secs_f64()
    );
    Row {
        loops: n,
        actions_per_s: actions as f64 / elapsed,
        cpu_per_action,
        peak_rss_mib: peak_rss as f64 / 1024.0,
        pause_p99,
        stop_p99,
        sigterm,
    }
}

/// Keeps the service's log in `path`, each line stamped with the seconds since it started.
fn keep_log(service: &mut Child, path: PathBuf) {
    let mut file = std::fs::File::create(&path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    let stderr = service.stderr.take().expect("the service's stderr, piped");
    let started = Instant::now();
    std::thread::spawn(move || {
        use std::io::{BufRead as _, Write as _};
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let _ = writeln!(file, "{:9.3} {line}", started.elapsed().as_secs_f64());
        }
    });
}

/// The service, killed if the benchmark panics.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
