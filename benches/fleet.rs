//! Benchmark: loops whose work trees follow them between workers through a git remote (a bare
//! repository in a temporary directory), against a real Temporal dev server on 127.0.0.1, with
//! `loopd worker` processes of the release binary, each with a cache of its own.
//!
//! Trials:
//!   a) one loop of `STEPS` short shell actions (an init that plans `STEPS - 3` tasks, a develop
//!      each that appends a line to a file, a validate, a complete) with one worker: time per
//!      action with its work tree on the remote (fetched and put at the last checkpoint before
//!      each action, the checkpoint pushed after each develop), against the same loop on
//!      Temporal in a shared directory and on the file driver (`loopd run`);
//!   b) throughput: `LOOPS` such loops of 5 actions each on the remote over 3 workers: actions
//!      per second;
//!   c) a worker SIGKILLed while its loop's develop runs: from the kill to that develop running
//!      again on the other worker (Temporal gives the attempt up at its heartbeat timeout).
//!
//! Run: `cargo bench --bench fleet --features temporal`. Environment:
//!   LOOPD_TEMPORAL_BIN   the `temporal` program (default: ~/.cache/loopd/temporal-1.9.1/bin/temporal)
//!   LOOPD_BENCH_STEPS    actions of trial a (default 50)
//!   LOOPD_BENCH_LOOPS    loops of trial b (default 100)
//!   LOOPD_BENCH_TRIALS   trials of c (default 5)

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::temporal::{Workers, finished};
use common::{Project, env_num, git, median, ms};

/// Plans `$TASKS` tasks at init; every action succeeds at once; develop appends a line to
/// `work.txt`. With `$MARKS/hold`, the first develop writes its pid to `$MARKS/develop.pid` and
/// sleeps; the next one to run writes `$MARKS/resumed`.
const AGENT: &str = r#"#!/bin/sh
cat > /dev/null
case "$LOOPD_ACTION" in
  init)
    tasks=$(seq -s, -f '{"description":"t%g"}' 1 "$TASKS")
    echo "{\"status\":\"success\",\"state_updates\":{\"tasks\":[$tasks]}}" > "$LOOPD_RESULT_FILE" ;;
  develop)
    if [ -f "$MARKS/hold" ]; then
      if [ -f "$MARKS/develop.pid" ]; then touch "$MARKS/resumed"
      else echo $$ > "$MARKS/develop.pid"; exec sleep 1000; fi
    fi
    echo "$LOOPD_TASK_ID" >> work.txt
    echo '{"status":"success","summary":"did it"}' > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","state_updates":{"passed":true,"pass_rate":100}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success","summary":"done"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

fn main() {
    let steps = env_num("LOOPD_BENCH_STEPS", 50);
    let loops = env_num("LOOPD_BENCH_LOOPS", 100);
    let trials = env_num("LOOPD_BENCH_TRIALS", 5);
    let Some(started) = common::temporal::start() else {
        return;
    };
    let (server, config, rt, dir) = (&started.server, &started.config, &started.rt, &started.dir);

    // a) One loop, per action: on a remote, in a shared directory, on the file driver.
    let fleet = Fleet::new(dir.path(), steps - 3);
    let per_action = |remote: bool| {
        let workers = fleet.workers(&server.address, 1);
        let mut runs = Vec::new();
        for _ in 0..3 {
            let started = Instant::now();
            let id = fleet.create(&server.address, remote);
            rt.block_on(finished(config, &id));
            runs.push(ms(started.elapsed()) / steps as f64);
        }
        drop(workers);
        median(&mut runs)
    };
    let on_remote = per_action(true);
    let shared = per_action(false);
    let mut on_files = Vec::new();
    for _ in 0..3 {
        let id = fleet.p.create(steps);
        let started = Instant::now();
        let out = fleet
            .p
            .loopd()
            .args(["run", &id])
            .output()
            .expect("loopd run");
        assert!(
            out.status.success(),
            "loopd run: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        on_files.push(ms(started.elapsed()) / steps as f64);
    }
    let on_files = median(&mut on_files);
    println!(
        "a) a loop of {steps} actions ({} develops): {on_remote:.1} ms per action with its work \
         tree on a git remote, {shared:.1} ms on Temporal in a shared directory, {on_files:.1} ms \
         on the file driver: fetch/checkout/push add {:.1} ms per action ({:.1} ms per develop) \
         (median of 3)",
        steps - 3,
        on_remote - shared,
        (on_remote - shared) * steps as f64 / (steps - 3) as f64,
    );

    // b) Throughput of loops on the remote over three workers.
    let fleet = Fleet::new(dir.path(), 2);
    let workers = fleet.workers(&server.address, 3);
    let started = Instant::now();
    let ids: Vec<String> = (0..loops)
        .map(|_| fleet.create(&server.address, true))
        .collect();
    for id in &ids {
        rt.block_on(finished(config, id));
    }
    let elapsed = started.elapsed().as_secs_f64();
    drop(workers);
    println!(
        "b) {loops} loops of 5 actions on a git remote over 3 workers: {elapsed:.1} s, {:.1} \
         actions/s",
        (loops * 5) as f64 / elapsed
    );

    // c) A worker's death: from the SIGKILL to its loop's develop running again elsewhere.
    let fleet = Fleet::new(dir.path(), 2);
    std::fs::write(fleet.marks.join("hold"), "").expect("hold");
    let mut workers = fleet.workers(&server.address, 2);
    let mut moved = Vec::new();
    for _ in 0..trials {
        for mark in ["develop.pid", "resumed"] {
            let _ = std::fs::remove_file(fleet.marks.join(mark));
        }
        let id = fleet.create(&server.address, true);
        let pid = wait_for(&fleet.marks.join("develop.pid"));
        let pid: u32 = std::fs::read_to_string(&pid)
            .expect("develop.pid")
            .trim()
            .parse()
            .expect("a pid");
        let worker = workers
            .processes
            .iter()
            .position(|w| ancestor(w.0.id(), pid))
            .expect("the develop's worker");
        let started = Instant::now();
        let mut dead = workers.processes.remove(worker);
        dead.0.kill().expect("SIGKILL the worker");
        dead.0.wait().expect("reap the worker");
        wait_for(&fleet.marks.join("resumed"));
        moved.push(started.elapsed().as_secs_f64());
        rt.block_on(finished(config, &id));
        workers
            .processes
            .extend(fleet.workers(&server.address, 1).processes);
    }
    drop(workers);
    println!(
        "c) a worker SIGKILLed mid-action → the action running on another worker: median {:.1} \
         s, max {:.1} s ({trials} trials)",
        median(&mut moved.clone()),
        moved.iter().copied().fold(0.0, f64::max),
    );
}

/// A project in a git repository whose loops' work goes to a bare repository beside it.
struct Fleet {
    p: Project,
    remote: PathBuf,
    marks: PathBuf,
    /// The workers' caches.
    caches: PathBuf,
}

impl Fleet {
    /// A project in `dir` whose loops plan `tasks` tasks.
    fn new(dir: &Path, tasks: usize) -> Fleet {
        let place = tempfile::tempdir_in(dir).expect("tempdir").keep();
        let marks = place.join("marks");
        let caches = place.join("caches");
        std::fs::create_dir_all(&marks).expect("mkdir marks");
        let mut config = common::config(&["sh", "bin/agent.sh"], "stdin", "json", None);
        config.push_str(&format!(
            "\n[executors.agent.env]\nTASKS = \"{tasks}\"\nMARKS = \"{}\"\n",
            marks.display()
        ));
        let p = Project::new(&config, Some(AGENT));
        std::fs::write(p.root.join(".gitignore"), "/.cache/\n").expect("write .gitignore");
        let remote = place.join("remote.git");
        git(&p.root, &["init", "--quiet", "--initial-branch=main"]);
        git(&p.root, &["add", "--all"]);
        git(&p.root, &["commit", "--quiet", "-m", "the project"]);
        git(&place, &["init", "--quiet", "--bare", "remote.git"]);
        Fleet {
            p,
            remote,
            marks,
            caches,
        }
    }

    /// `n` workers, each with a cache of its own.
    fn workers(&self, address: &str, n: usize) -> Workers {
        Workers::start_with(&self.p, address, n, |cmd, name| {
            cmd.arg("--cache").arg(self.caches.join(name));
        })
    }

    /// `loopd create --temporal ADDR [--remote REMOTE]`: the new loop's id.
    fn create(&self, address: &str, remote: bool) -> String {
        let mut cmd = self.p.loopd();
        cmd.args(["create", "--temporal", address, "--title", "t"])
            .args(["--max-iterations", "1000"]);
        if remote {
            cmd.arg("--remote").arg(&self.remote);
        }
        let out = cmd.output().expect("loopd create");
        assert!(
            out.status.success(),
            "create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

/// Waits until `path` exists; returns it.
fn wait_for(path: &Path) -> PathBuf {
    let started = Instant::now();
    while !path.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    path.to_owned()
}

/// Whether process `pid` descends from process `of`.
fn ancestor(of: u32, mut pid: u32) -> bool {
    while pid > 1 {
        if pid == of {
            return true;
        }
        pid = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(0);
    }
    false
}
