//! Benchmark: a loop of independent tasks developed at once (`parallel`) against one at a time,
//! on the file driver.
//!
//! A git project whose scripted agent takes `LOOPD_BENCH_TASK_SECS` (2 s) per develop and writes
//! a file of its own, `out-TASK.txt`; the last two tasks also put their line in place of the base
//! line of `shared.txt` (after the other's, when it is there), so one of them conflicts when they
//! run in one batch and is developed again on the merged tree. Validation passes at once. The loop (8 tasks) runs with
//! `parallel = 1` and with `parallel = 4` (`LOOPD_BENCH_PARALLEL`), the sandbox on as by
//! default; for each: the wall time of `loopd run` to the loop's end, and for the parallel one
//! loopd's own time per merge (from the last attempt of a batch finished to its last `merged`
//! event, over the merges). Every task's file must be in the final tree exactly once, and
//! `shared.txt` must hold both conflicting tasks' lines.
//!
//! With `--features temporal` and the Temporal server installed, the same loop runs on Temporal
//! too, its work tree on a git remote (a bare repository beside it), over 3 workers (each taking
//! up to 4 actions at once, as by default): the time from `loopd create` to the loop's end.
//!
//! Run: `cargo bench --bench parallel [--features temporal]`. Environment:
//!   LOOPD_BENCH_TASKS      tasks of the loop (default 8)
//!   LOOPD_BENCH_PARALLEL   parallel of the second run (default 4)
//!   LOOPD_BENCH_TASK_SECS  seconds each develop takes (default 2)
//!   LOOPD_BENCH_ROUNDS     rounds, the median is reported (default 3)

mod common;

use std::path::Path;
use std::time::Instant;

use common::{Project, config, env_num, git, median};

const AGENT: &str = r#"
prompt=$(cat)
case "$LOOPD_ACTION" in
  develop)
    sleep "$LOOPD_BENCH_TASK_SECS"
    echo "$LOOPD_TASK_ID" > "out-$LOOPD_TASK_ID.txt"
    case "$LOOPD_TASK" in
      *shared*)
        # Its line in place of the base's, else after the other task's.
        if grep -q base shared.txt; then
          echo "$LOOPD_TASK_ID" > shared.txt
        else
          echo "$LOOPD_TASK_ID" >> shared.txt
        fi ;;
    esac
    echo '{"status":"success","summary":"done"}' > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","state_updates":{"passed":true,"pass_rate":100}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

struct Round {
    secs: f64,
    /// loopd's time per merge, in ms (parallel runs of the file driver only).
    merge_ms: Option<f64>,
}

fn ts(event: &serde_json::Value) -> Option<chrono::DateTime<chrono::FixedOffset>> {
    chrono::DateTime::parse_from_rfc3339(event["ts"].as_str()?).ok()
}

/// A git project whose agent takes `task_secs` per develop; its state dir ignored, or, for a loop
/// on a remote, committed (its workers take the project's config from there).
fn project(task_secs: usize, state_committed: bool) -> Project {
    let mut config = config(&["sh", "bin/agent.sh"], "stdin", "json", None);
    config.push_str(&format!(
        "\n[executors.agent.env]\nLOOPD_BENCH_TASK_SECS = \"{task_secs}\"\n"
    ));
    let p = Project::new(&config, Some(AGENT));
    let ignored = if state_committed { "" } else { ".loop/\n" };
    std::fs::write(p.root.join(".gitignore"), ignored).unwrap();
    std::fs::write(p.root.join("shared.txt"), "base\n").unwrap();
    git(&p.root, &["init", "--quiet", "--initial-branch=main"]);
    git(&p.root, &["add", "."]);
    git(&p.root, &["commit", "--quiet", "-m", "base"]);
    p
}

/// `loopd create ... --parallel N` with `tasks` tasks, the last two conflicting: the loop's id.
fn create(p: &Project, extra: &[&str], tasks: usize, parallel: usize) -> String {
    let mut create = p.loopd();
    create.args(["create", "--title", "bench", "--max-iterations", "100"]);
    create.args(extra);
    create.args(["--parallel", &parallel.to_string()]);
    for n in 1..=tasks {
        let text = if n + 2 > tasks { "task shared" } else { "task" };
        create.args(["--task", text]);
    }
    let out = create.output().expect("loopd create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Every task's change is in the final tree (`files`, one a line) exactly once; neither side of
/// the conflict (`shared`, `shared.txt`) is lost.
fn check(tasks: usize, files: &str, shared: &str) {
    for n in 1..=tasks {
        let name = format!("out-task-{n:03}.txt");
        assert_eq!(files.lines().filter(|f| *f == name).count(), 1, "{files}");
    }
    let mut lines: Vec<&str> = shared.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        [format!("task-{:03}", tasks - 1), format!("task-{tasks:03}")],
        "{shared}"
    );
}

fn output(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `git -C dir ARGS`: its output.
fn git_out(dir: &Path, args: &[&str]) -> String {
    output(
        std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args),
    )
}

/// One loop on the file driver (`loopd run`).
fn round(tasks: usize, parallel: usize, task_secs: usize) -> Round {
    let p = project(task_secs, false);
    let id = create(&p, &[], tasks, parallel);
    let started = Instant::now();
    let out = p.loopd().args(["run", &id]).output().expect("loopd run");
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = git_out(
        &p.root,
        &["ls-files", "--others", "--cached", "--exclude-standard"],
    );
    let shared = std::fs::read_to_string(p.root.join("shared.txt")).unwrap();
    check(tasks, &files, &shared);
    let events = p.events(&id);
    let merge_ms = (parallel > 1).then(|| {
        // Per batch: its last attempt's end to its last merge.
        let mut total = 0.0;
        let mut merges = 0;
        let mut finished: Option<chrono::DateTime<chrono::FixedOffset>> = None;
        let mut last_merge: Option<chrono::DateTime<chrono::FixedOffset>> = None;
        for e in &events {
            match e["event"].as_str() {
                Some("batch_started") => {
                    if let (Some(f), Some(m)) = (finished, last_merge) {
                        total += (m - f).num_microseconds().unwrap_or(0) as f64 / 1000.0;
                    }
                    finished = None;
                    last_merge = None;
                }
                Some("action_finished") if last_merge.is_none() => finished = ts(e),
                Some("merged") => {
                    merges += 1;
                    last_merge = ts(e);
                }
                _ => {}
            }
        }
        if let (Some(f), Some(m)) = (finished, last_merge) {
            total += (m - f).num_microseconds().unwrap_or(0) as f64 / 1000.0;
        }
        total / f64::from(merges.max(1))
    });
    Round { secs, merge_ms }
}

/// The same loop on Temporal, its work tree on a git remote, over the workers of `temporal`: the
/// seconds from `loopd create` to its end.
#[cfg(feature = "temporal")]
fn on_temporal(
    temporal: &common::temporal::Started,
    tasks: usize,
    parallel: usize,
    task_secs: usize,
) -> f64 {
    let p = project(task_secs, true);
    let place = tempfile::tempdir_in(temporal.dir.path()).expect("tempdir");
    git(place.path(), &["init", "--quiet", "--bare", "remote.git"]);
    let remote = place.path().join("remote.git");
    let workers =
        common::temporal::Workers::start_with(&p, &temporal.server.address, 3, |cmd, name| {
            cmd.arg("--cache").arg(place.path().join(name));
        });
    let started = Instant::now();
    let remote_arg = remote.to_str().expect("a UTF-8 path");
    let address = temporal.server.address.as_str();
    let id = create(
        &p,
        &["--temporal", address, "--remote", remote_arg],
        tasks,
        parallel,
    );
    temporal
        .rt
        .block_on(common::temporal::finished(&temporal.config, &id));
    let secs = started.elapsed().as_secs_f64();
    drop(workers);
    let branch = format!("loopd/{id}");
    let files = git_out(&remote, &["ls-tree", "-r", "--name-only", &branch]);
    let shared = git_out(&remote, &["show", &format!("{branch}:shared.txt")]);
    check(tasks, &files, &shared);
    secs
}

fn main() {
    let tasks = env_num("LOOPD_BENCH_TASKS", 8);
    let parallel = env_num("LOOPD_BENCH_PARALLEL", 4);
    let task_secs = env_num("LOOPD_BENCH_TASK_SECS", 2);
    let rounds = env_num("LOOPD_BENCH_ROUNDS", 3);
    let (mut one, mut many, mut merge) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        one.push(round(tasks, 1, task_secs).secs);
        let r = round(tasks, parallel, task_secs);
        many.push(r.secs);
        merge.extend(r.merge_ms);
    }
    let (one, many) = (median(&mut one), median(&mut many));
    println!(
        "{tasks} tasks of {task_secs} s (the last two conflicting), the sandbox on, median of \
         {rounds} rounds:"
    );
    println!("  parallel = 1: {one:.2} s to the loop's end");
    println!(
        "  parallel = {parallel}: {many:.2} s ({:.2}x sequential), loopd's time per merge {:.1} ms",
        many / one,
        median(&mut merge)
    );
    #[cfg(feature = "temporal")]
    if let Some(temporal) = common::temporal::start() {
        let (mut one, mut many) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            one.push(on_temporal(&temporal, tasks, 1, task_secs));
            many.push(on_temporal(&temporal, tasks, parallel, task_secs));
        }
        let (one, many) = (median(&mut one), median(&mut many));
        println!("  on Temporal, a git remote, 3 workers:");
        println!("  parallel = 1: {one:.2} s from create to the loop's end");
        println!(
            "  parallel = {parallel}: {many:.2} s ({:.2}x sequential)",
            many / one
        );
    }
}
