//! Benchmark: the daemon's cost per action with a trivial executor, against spawning the same
//! commands bare.
//!
//! A temporary project whose executor is `/bin/true` (format `text`, prompt on stdin) and whose
//! validate is `command = "false"` (never passes, which is not an error), so the loop alternates
//! debug/validate until `max_iterations` and `loopd run` exits 3. The wall time of `loopd run` over
//! the number of `action_finished` events is the daemon's time per action; the baseline spawns
//! the same mix of commands (`/bin/true`, `sh -c false`) from Rust the same number of times, with
//! stdin piped and closed and stdout/stderr piped and read to EOF. For context it also times one
//! atomic write of the state file (temp file + write + fsync + rename + fsync of the directory),
//! which the daemon does once per action.
//!
//! Run: `cargo bench --bench overhead`. Environment:
//!   LOOPD_BENCH_ACTIONS  max_iterations of each loop (default 200; actions = that + init + complete)
//!   LOOPD_BENCH_ROUNDS   rounds, the median is reported (default 5)
//!   LOOPD_BENCH_WRITES   atomic writes timed per round (default 100)
//!   LOOPD_BENCH_DIR      where the temporary projects go (default: the system temp dir)
//!   LOOPD_BENCH_AGENT    `shell` to use a trivial shell agent (`sh -c 'cat >/dev/null; echo ok'`,
//!                        the kind of agent peers are measured with) instead of `/bin/true`
//!   LOOPD_BENCH_SANDBOX  `off` to run the actions without the sandbox (default: sandboxed, as
//!                        loopd runs them): the two runs give the sandbox's cost per action

mod common;

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

use common::{Project, config, env_num, median, tempdir};
use std::time::{Duration, Instant};

/// The trivial executor's argv: `/bin/true`, or a shell agent with `LOOPD_BENCH_AGENT=shell`.
fn agent() -> &'static [&'static str] {
    match std::env::var("LOOPD_BENCH_AGENT").as_deref() {
        Ok("shell") => &["sh", "-c", "cat > /dev/null; echo ok"],
        _ => &["/bin/true"],
    }
}

/// One timed `loopd run`.
struct DaemonRound {
    actions: usize,
    /// Actions by kind: (executor actions run as `/bin/true`, validates run as `sh -c false`).
    true_runs: usize,
    false_runs: usize,
    wall: Duration,
    /// From the first `action_started` to the last `action_finished`, per action (event stamps,
    /// millisecond resolution): the loop without the daemon's start and exit.
    steady_ms: f64,
    state_bytes: usize,
    /// The project, kept so the fsync'd write can be timed in the same directory.
    project: Project,
}

fn ts(event: &serde_json::Value) -> Option<chrono::DateTime<chrono::FixedOffset>> {
    chrono::DateTime::parse_from_rfc3339(event["ts"].as_str()?).ok()
}

fn daemon_round(max_iterations: usize) -> DaemonRound {
    let p = Project::new(&config(agent(), "stdin", "text", Some("false")), None);
    let id = p.create(max_iterations);
    let log = std::fs::File::create(p.root.join("daemon.log")).expect("daemon log");
    let started = Instant::now();
    let status = p
        .loopd()
        .args(["run", &id])
        .stdout(Stdio::null())
        .stderr(log)
        .status()
        .expect("run loopd run");
    let wall = started.elapsed();
    if status.code() != Some(3) {
        let log = std::fs::read_to_string(p.root.join("daemon.log")).unwrap_or_default();
        panic!("loopd run exited {status:?}, expected 3 (iteration limit)\n{log}");
    }
    let events = p.events(&id);
    let finished: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["event"] == "action_finished")
        .collect();
    let failed = events
        .iter()
        .filter(|e| e["event"] == "action_failed")
        .count();
    assert_eq!(failed, 0, "no attempt should fail in this setup");
    let false_runs = finished
        .iter()
        .filter(|e| e["action"] == "validate")
        .count();
    let actions = finished.len();
    assert!(actions > 0, "no action_finished event");
    let first_start = events
        .iter()
        .find(|e| e["event"] == "action_started")
        .and_then(ts);
    let last_finish = finished.last().and_then(|e| ts(e));
    let steady_ms = match (first_start, last_finish) {
        (Some(a), Some(b)) => {
            (b - a).num_microseconds().unwrap_or(0) as f64 / 1000.0 / actions as f64
        }
        _ => f64::NAN,
    };
    let state_bytes = std::fs::metadata(p.root.join(".loop").join(format!("{id}.json")))
        .map(|m| m.len() as usize)
        .unwrap_or(4096);
    DaemonRound {
        actions,
        true_runs: actions - false_runs,
        false_runs,
        wall,
        steady_ms,
        state_bytes,
        project: p,
    }
}

/// Spawns `true_runs` × `/bin/true` and `false_runs` × `sh -c false`, interleaved as the loop
/// does, each like the daemon does it (new process group, in the project root, stdin piped and
/// closed, stdout and stderr piped and read to EOF, waited); returns the total time.
fn bare_round(root: &Path, true_runs: usize, false_runs: usize) -> Duration {
    let spawn = |argv: &[&str]| {
        use std::os::unix::process::CommandExt as _;
        let child = Command::new(argv[0])
            .args(&argv[1..])
            .current_dir(root)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        // Drops stdin (closing it), reads both pipes to EOF, waits.
        child.wait_with_output().expect("wait");
    };
    let started = Instant::now();
    let (mut t, mut f) = (true_runs, false_runs);
    while t + f > 0 {
        if t > 0 {
            spawn(agent());
            t -= 1;
        }
        if f > 0 {
            spawn(&["sh", "-c", "false"]);
            f -= 1;
        }
    }
    started.elapsed()
}

/// One atomic write as the daemon's durable commit does it: temp file in the same directory,
/// write, fsync (data), rename over the target, fsync of the directory.
fn atomic_write(dir: &Path, target: &Path, bytes: &[u8], durable: bool) {
    let mut tmp = tempfile::Builder::new()
        .prefix(".state.")
        .suffix(".tmp")
        .tempfile_in(dir)
        .expect("temp file");
    tmp.write_all(bytes).expect("write");
    if durable {
        tmp.as_file().sync_data().expect("fsync");
    }
    tmp.persist(target).expect("rename");
    if durable {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .expect("fsync dir");
    }
}

/// Median time of `n` atomic writes of `size` bytes to `dir/NAME`, in ms.
fn write_ms(dir: &Path, size: usize, n: usize, durable: bool) -> f64 {
    let target = dir.join("bench-write.json");
    let bytes = vec![b'x'; size];
    let mut times: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            atomic_write(dir, &target, &bytes, durable);
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    median(&mut times)
}

fn fs_type(path: &Path) -> String {
    Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(path)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "?".into())
}

fn main() {
    let max_iterations = env_num("LOOPD_BENCH_ACTIONS", 200);
    let rounds = env_num("LOOPD_BENCH_ROUNDS", 5).max(1);
    let n_writes = env_num("LOOPD_BENCH_WRITES", 100).max(1);
    let probe = tempdir();
    println!(
        "loopd overhead: executor {:?} (format text), validate `sh -c false`; \
         max_iterations {max_iterations}, {rounds} rounds; temp dir {} (fs {})",
        agent(),
        probe.path().parent().unwrap_or(probe.path()).display(),
        fs_type(probe.path())
    );
    drop(probe);
    println!(
        "{:>5} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>6} {:>8} {:>8} {:>8}",
        "round",
        "actions",
        "daemon_s",
        "ms/act",
        "steady",
        "bare_s",
        "ms/spawn",
        "ratio",
        "added",
        "fsyncw",
        "plainw"
    );
    let mut per_action = Vec::new();
    let mut steady = Vec::new();
    let mut per_spawn = Vec::new();
    let mut added = Vec::new();
    let mut ratio = Vec::new();
    let mut actions_seen = Vec::new();
    let mut durable = Vec::new();
    let mut plain = Vec::new();
    let mut state_bytes = 0;
    let mut done = Vec::new();
    for _ in 1..=rounds {
        let d = daemon_round(max_iterations);
        let bare = bare_round(&d.project.root, d.true_runs, d.false_runs);
        done.push((d, bare));
    }
    // The writes are timed once every loop has run, and every project is removed only at the
    // end: on ext4 without a journal a new file's inode is searched for past every inode
    // released in the last minutes, so a round would otherwise pay for the files of the rounds
    // before it.
    for (round, (d, bare)) in (1..).zip(&done) {
        // In the loop's own state directory, as the daemon's writes are.
        let state_dir = d.project.root.join(".loop");
        let w_durable = write_ms(&state_dir, d.state_bytes, n_writes, true);
        let w_plain = write_ms(&state_dir, d.state_bytes, n_writes, false);
        let _ = std::fs::remove_file(state_dir.join("bench-write.json"));
        let ms_act = d.wall.as_secs_f64() * 1000.0 / d.actions as f64;
        let ms_spawn = bare.as_secs_f64() * 1000.0 / d.actions as f64;
        println!(
            "{:>5} {:>7} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>6.2} {:>8.3} {:>8.3} {:>8.3}",
            round,
            d.actions,
            d.wall.as_secs_f64(),
            ms_act,
            d.steady_ms,
            bare.as_secs_f64(),
            ms_spawn,
            ms_act / ms_spawn,
            ms_act - ms_spawn,
            w_durable,
            w_plain
        );
        per_action.push(ms_act);
        steady.push(d.steady_ms);
        per_spawn.push(ms_spawn);
        ratio.push(ms_act / ms_spawn);
        added.push(ms_act - ms_spawn);
        actions_seen.push(d.actions as f64);
        durable.push(w_durable);
        plain.push(w_plain);
        state_bytes = d.state_bytes;
    }
    println!();
    println!("| measure (median of {rounds} rounds) | value |");
    println!("|---|---|");
    println!(
        "| actions per `loopd run` | {:.0} |",
        median(&mut actions_seen)
    );
    println!(
        "| daemon: wall time of `loopd run` per action (ms) | {:.3} |",
        median(&mut per_action)
    );
    println!(
        "| daemon: steady state per action, first start to last finish in events.jsonl (ms) | {:.3} |",
        median(&mut steady)
    );
    println!(
        "| bare spawn of the same command (ms) | {:.3} |",
        median(&mut per_spawn)
    );
    println!("| ratio daemon / bare | {:.2} |", median(&mut ratio));
    println!(
        "| added by the daemon per action (ms) | {:.3} |",
        median(&mut added)
    );
    println!(
        "| one durable atomic write of {state_bytes} B in the state dir: tmp + write + fsync + rename + fsync dir (ms, median of {n_writes}) | {:.3} |",
        median(&mut durable)
    );
    println!(
        "| the same write without the two fsyncs (ms) | {:.3} |",
        median(&mut plain)
    );
}
