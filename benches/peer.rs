//! Benchmark: loopd against its peer ralph-orchestrator (ralph-cli 2.10.1) and against the bare
//! backend, side by side, on the disk and on tmpfs.
//!
//! The backend is one trivial shell script for all three, shell builtins only: it counts its
//! runs in a file, appends an event to ralph's event file and, at the last run, publishes and
//! prints ralph's completion promise. loopd runs it as the
//! executor of every action (format `text`; validate never passes, so the loop goes on to its
//! iteration limit), and a second time as an executor of the `json` result protocol. Every run of
//! the backend, in every round, writes a result with `state_updates` (planned tasks at init, a
//! failed validation, a debug's findings) to a file: to `$LOOPD_RESULT_FILE` in loopd's `json`
//! round, which loopd reads and applies, and to a file nobody reads in the other rounds, so that
//! all rounds pay the backend's same work and the differences are the orchestrators'. ralph runs it as a
//! `custom` backend (`ralph run --no-tui`, prompt as an
//! argument) until the promise, twice: its prompt from `PROMPT.md`, and at its leanest (the prompt
//! inline, `-p`; its preflight checks skipped; quiet; memories and tasks off in both); the bare
//! round spawns it N times as loopd does (a process group of its own, pipes read to EOF). Rounds
//! interleave the systems, so that a slow moment of the machine hits them alike. Every round's directory is removed at the end, not after the round (see
//! [`Leftovers`]).
//!
//! Per system: wall time per action; its own CPU per action (the CPU of the run with its
//! children, from `getrusage(RUSAGE_CHILDREN)`, less the bare round's: the backend's own CPU);
//! its peak RSS (`VmHWM`, polled). Medians over the rounds, and the ratios loopd/bare,
//! ralph/bare and loopd/ralph, of the wall time and of the own CPU.
//!
//! ralph is installed once into a cache directory (`cargo install ralph-cli --version 2.10.1
//! --locked --root DIR`); no code of it is part of loopd. When it cannot be installed the
//! benchmark says why and measures loopd and the bare backend alone.
//!
//! Run: `cargo bench --bench peer`. Environment:
//!   LOOPD_BENCH_ACTIONS  actions per run, N (default 300)
//!   LOOPD_BENCH_ROUNDS   rounds per filesystem (default 5)
//!   LOOPD_BENCH_DIR      the disk's temporary directory (default: the system's)
//!   LOOPD_BENCH_TMPFS    the tmpfs directory (default /dev/shm; empty: skip tmpfs)
//!   LOOPD_RALPH          a ralph binary to use instead of the cached install

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Project, config, env_num, median};

const RALPH_VERSION: &str = "2.10.1";

/// The backend: counts its runs and appends one event to ralph's event file (`.ralph/`, as
/// ralph's docs say an agent does; a distinct payload each time, or ralph takes the loop for
/// stale); the last run publishes and prints ralph's completion promise. Every run writes a
/// result to `$BENCH_RESULT_FILE`, or where that is unset (loopd's `json` round) to
/// `$LOOPD_RESULT_FILE`.
fn backend(n: usize) -> String {
    format!(
        r#"n=0
if [ -e runs ]; then read -r n < runs; fi
n=$((n + 1))
echo "$n" > runs
case "$LOOPD_ACTION" in
  init) r='{{"status":"success","summary":"planned","state_updates":{{"tasks":[{{"description":"make the tests pass","tool":"bash"}}]}}}}' ;;
  validate) r='{{"status":"success","summary":"2 of 4 pass","state_updates":{{"passed":false,"pass_rate":50,"failed_tests":["t3","t4"]}}}}' ;;
  debug) r='{{"status":"success","summary":"found it","state_updates":{{"active_bug":"t3 fails","confirmed_hypothesis":"H1"}}}}' ;;
  *) r='{{"status":"success","summary":"step '"$n"'","files_changed":["src/lib.rs"]}}' ;;
esac
echo "$r" > "${{BENCH_RESULT_FILE:-$LOOPD_RESULT_FILE}}"
events=.ralph/events.jsonl
if [ -e .ralph/current-events ]; then read -r events < .ralph/current-events; fi
if [ "$n" -ge {n} ]; then
  echo '{{"topic":"LOOP_COMPLETE","payload":"done","ts":"2026-01-01T00:00:00Z"}}' >> "$events"
  echo LOOP_COMPLETE
else
  echo '{{"topic":"task.progress","payload":"step '"$n"'","ts":"2026-01-01T00:00:00Z"}}' >> "$events"
  echo ok
fi
"#
    )
}

/// A directory for a backend: its script, and the `.ralph/` it writes its events to.
fn backend_dir(root: &Path, n: usize) {
    std::fs::create_dir_all(root.join(".ralph")).expect("mkdir .ralph");
    std::fs::write(root.join("backend.sh"), backend(n)).expect("backend");
}

/// Where the backend writes its result in the rounds that do not read it.
const UNREAD_RESULT: &str = "unread-result.json";

fn ralph_config(n: usize) -> String {
    format!(
        "cli:\n  backend: custom\n  command: sh\n  args: [\"backend.sh\"]\n  prompt_mode: arg\n\
         event_loop:\n  completion_promise: LOOP_COMPLETE\n  max_iterations: {}\n\
         memories:\n  enabled: false\ntasks:\n  enabled: false\n",
        n + 10
    )
}

/// The CPU time of this process's waited-for descendants so far.
fn children_cpu() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let usage = getrusage(UsageWho::RUSAGE_CHILDREN).expect("getrusage");
    let us = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    us(usage.user_time()) + us(usage.system_time())
}

/// What one run cost.
#[derive(Clone, Copy, Default)]
struct Run {
    wall: Duration,
    cpu: Duration,
    peak_kib: u64,
    actions: usize,
}

/// Waits for `child`, polling its peak RSS.
fn watch(mut child: Child, started: Instant, cpu0: Duration) -> (std::process::ExitStatus, Run) {
    let pid = child.id();
    let mut peak = 0;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status"))
            && let Some(kib) = text
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        {
            peak = u64::max(peak, kib);
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let run = Run {
        wall: started.elapsed(),
        cpu: children_cpu() - cpu0,
        peak_kib: peak,
        actions: 0,
    };
    (status, run)
}

/// What a round leaves on the filesystem, removed when the benchmark ends: on ext4 without a
/// journal a new file's inode is searched for past every inode released in the last minutes,
/// so a round would otherwise pay for the files of the rounds before it.
type Leftovers = Box<dyn std::any::Any>;

/// A loopd run: its executor of format `text` (validate: the command `false`), or `json` (the
/// backend's results read from its result file).
fn loopd_round(dir: &Path, n: usize, json: bool) -> (Run, Leftovers) {
    let format = if json { "json" } else { "text" };
    let mut config = config(&["sh", "backend.sh"], "arg", format, None);
    if !json {
        config.push_str(&format!(
            "env = {{ BENCH_RESULT_FILE = \"{UNREAD_RESULT}\" }}\n\n[actions.validate]\ncommand = \"false\"\n"
        ));
    }
    let p = Project::in_dir(&config, None, dir);
    backend_dir(&p.root, usize::MAX);
    // init + (n - 2) iterations + complete.
    let id = p.create(n.saturating_sub(2).max(1));
    let cpu0 = children_cpu();
    let started = Instant::now();
    let child = p.spawn_run(&id);
    let (status, mut run) = watch(child, started, cpu0);
    assert_eq!(
        status.code(),
        Some(3),
        "loopd run should stop at its iteration limit"
    );
    run.actions = p
        .events(&id)
        .iter()
        .filter(|e| e["event"] == "action_finished")
        .count();
    (run, Box::new(p))
}

/// A ralph run: its prompt from `PROMPT.md`, or with `lean` inline (`-p`), its preflight checks
/// skipped and its output quiet, as ralph at its leanest.
fn ralph_round(ralph: &Path, dir: &Path, n: usize, lean: bool) -> (Run, Leftovers) {
    let tmp = tempfile::tempdir_in(dir).expect("tempdir");
    let root = tmp.path();
    backend_dir(root, n);
    std::fs::write(root.join("ralph.yml"), ralph_config(n)).expect("config");
    let mut cmd = Command::new(ralph);
    cmd.args(["run", "--no-tui", "-c", "ralph.yml"]);
    if lean {
        cmd.args(["-p", "Say ok.", "--skip-preflight", "--quiet"]);
    } else {
        std::fs::write(root.join("PROMPT.md"), "Say ok.\n").expect("prompt");
    }
    let cpu0 = children_cpu();
    let started = Instant::now();
    let child = cmd
        .current_dir(root)
        .env("HOME", root)
        .env("BENCH_RESULT_FILE", UNREAD_RESULT)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("ralph run");
    let (status, mut run) = watch(child, started, cpu0);
    assert!(status.success(), "ralph run failed: {status}");
    run.actions = std::fs::read_to_string(root.join("runs"))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    (run, Box::new(tmp))
}

fn bare_round(dir: &Path, n: usize) -> (Run, Leftovers) {
    use std::os::unix::process::CommandExt as _;
    let tmp = tempfile::tempdir_in(dir).expect("tempdir");
    let root = tmp.path();
    backend_dir(root, usize::MAX);
    let cpu0 = children_cpu();
    let started = Instant::now();
    for _ in 0..n {
        Command::new("sh")
            .args(["backend.sh", "the prompt"])
            .current_dir(root)
            .process_group(0)
            .env("BENCH_RESULT_FILE", UNREAD_RESULT)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn")
            .wait_with_output()
            .expect("wait");
    }
    let run = Run {
        wall: started.elapsed(),
        cpu: children_cpu() - cpu0,
        peak_kib: 0,
        actions: n,
    };
    (run, Box::new(tmp))
}

/// The ralph binary: `$LOOPD_RALPH`, else the cached install, else a new one.
fn ralph() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("LOOPD_RALPH") {
        return Ok(PathBuf::from(path));
    }
    let home = std::env::var_os("HOME").ok_or("no $HOME")?;
    let root = PathBuf::from(home).join(format!(".cache/loopd/ralph-{RALPH_VERSION}"));
    let bin = root.join("bin/ralph");
    if bin.is_file() {
        return Ok(bin);
    }
    eprintln!(
        "installing ralph-cli {RALPH_VERSION} into {} (once)...",
        root.display()
    );
    let status = Command::new("cargo")
        .args([
            "install",
            "ralph-cli",
            "--version",
            RALPH_VERSION,
            "--locked",
            "--root",
        ])
        .arg(&root)
        .status()
        .map_err(|e| format!("cannot run cargo install: {e}"))?;
    if status.success() && bin.is_file() {
        Ok(bin)
    } else {
        Err(format!(
            "cargo install ralph-cli {RALPH_VERSION} failed ({status})"
        ))
    }
}

/// Medians of a system's rounds: wall ms per action, total CPU ms per action, peak MiB.
fn medians(runs: &[Run]) -> (f64, f64, f64) {
    let per = |f: &dyn Fn(&Run) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
    (
        per(&|r| r.wall.as_secs_f64() * 1000.0 / r.actions as f64),
        per(&|r| r.cpu.as_secs_f64() * 1000.0 / r.actions as f64),
        per(&|r| r.peak_kib as f64 / 1024.0),
    )
}

fn main() {
    let n = env_num("LOOPD_BENCH_ACTIONS", 300);
    let rounds = env_num("LOOPD_BENCH_ROUNDS", 5).max(1);
    let disk = std::env::var_os("LOOPD_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let tmpfs = std::env::var("LOOPD_BENCH_TMPFS").unwrap_or_else(|_| "/dev/shm".into());
    let mut places = vec![("disk", disk)];
    if !tmpfs.is_empty() && Path::new(&tmpfs).is_dir() {
        places.push(("tmpfs", PathBuf::from(tmpfs)));
    }
    let ralph = ralph()
        .inspect_err(|why| eprintln!("skipping ralph: {why}"))
        .ok();

    println!("\n{n} actions per run, {rounds} rounds, medians; ms per action:\n");
    println!("| fs | system | wall | own CPU | peak RSS |");
    println!("|---|---|---|---|---|");
    let mut ratios = Vec::new();
    let mut leftovers = Vec::new();
    for (name, dir) in &places {
        let (mut l, mut j, mut r, mut rl, mut b) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut keep = |(run, left): (Run, Leftovers), runs: &mut Vec<Run>| {
            runs.push(run);
            leftovers.push(left);
        };
        for round in 1..=rounds {
            keep(loopd_round(dir, n, false), &mut l);
            keep(loopd_round(dir, n, true), &mut j);
            if let Some(ralph) = &ralph {
                keep(ralph_round(ralph, dir, n, false), &mut r);
                keep(ralph_round(ralph, dir, n, true), &mut rl);
            }
            keep(bare_round(dir, n), &mut b);
            eprintln!("{name}: round {round} of {rounds} done");
        }
        let (bw, bc, _) = medians(&b);
        let own = |runs: &[Run]| {
            let (w, c, m) = medians(runs);
            (w, c - bc, m)
        };
        let (lw, lc, lm) = own(&l);
        println!("| {name} | loopd | {lw:.2} | {lc:.2} | {lm:.1} MiB |");
        let (jw, jc, jm) = own(&j);
        println!("| {name} | loopd, json results | {jw:.2} | {jc:.2} | {jm:.1} MiB |");
        let ralph_rows = (!r.is_empty()).then(|| (own(&r), own(&rl)));
        if let Some(((rw, rc, rm), (sw, sc, sm))) = ralph_rows {
            println!("| {name} | ralph {RALPH_VERSION} | {rw:.2} | {rc:.2} | {rm:.1} MiB |");
            println!(
                "| {name} | ralph {RALPH_VERSION}, inline prompt, lean | {sw:.2} | {sc:.2} | \
                 {sm:.1} MiB |"
            );
        }
        println!("| {name} | bare backend | {bw:.2} | | |");
        ratios.push((
            name,
            lw / bw,
            ralph_rows.map(|((rw, rc, _), (sw, sc, _))| {
                [rw / bw, lw / rw, jw / rw, lw / sw, lc / rc, lc / sc]
            }),
        ));
    }
    println!(
        "\n| fs | loopd/bare | ralph/bare | loopd/ralph | loopd (json results)/ralph | \
         loopd/ralph lean | own CPU: loopd/ralph | own CPU: loopd/ralph lean |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (name, lb, r) in ratios {
        match r {
            Some(r) => println!(
                "| {name} | {lb:.2} | {} |",
                r.map(|x| format!("{x:.2}")).join(" | ")
            ),
            None => println!("| {name} | {lb:.2} | | | | | | |"),
        }
    }
}
