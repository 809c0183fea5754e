//! Benchmark: whether an action costs the daemon more as the loop grows longer.
//!
//! One `loopd run` of N actions (default 1000) with a trivial shell agent (format `text`, a
//! validate that never passes, so the loop runs to its iteration limit). While it runs, the
//! daemon's own CPU time (every thread's, from `/proc/PID/task/*/schedstat`, in nanoseconds) is
//! sampled each time the event log shows another `action_finished`; the CPU per action of the
//! first hundred actions is then compared with that of the last hundred. The daemon's children
//! (the agent) are not counted.
//!
//! Run: `cargo bench --bench long`. Environment:
//!   LOOPD_BENCH_ACTIONS  actions of the loop (default 1000, at least 200)
//!   LOOPD_BENCH_ROUNDS   rounds, the median is reported (default 5)
//!   LOOPD_BENCH_DIR      where the temporary project goes (default: the system temp dir)

mod common;

use std::io::{Read as _, Seek as _, SeekFrom};
use std::time::Duration;

use common::{Project, config, env_num, median};

/// The CPU time of every thread of `pid` so far, in nanoseconds; `None` once it is gone.
fn cpu_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        if let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) {
            total += text
                .split_whitespace()
                .next()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Some(total)
}

/// Counts `action_finished` lines appended to an event log, reading only what is new.
struct Finished {
    file: Option<std::fs::File>,
    pos: u64,
    partial: String,
    count: usize,
}

impl Finished {
    fn poll(&mut self, path: &std::path::Path) -> usize {
        if self.file.is_none() {
            self.file = std::fs::File::open(path).ok();
        }
        let Some(file) = &mut self.file else {
            return self.count;
        };
        let mut text = String::new();
        if file.seek(SeekFrom::Start(self.pos)).is_ok() && file.read_to_string(&mut text).is_ok() {
            self.pos += text.len() as u64;
            self.partial.push_str(&text);
            let complete = self.partial.rfind('\n').map_or(0, |i| i + 1);
            let lines: String = self.partial.drain(..complete).collect();
            self.count += lines
                .lines()
                .filter(|l| l.contains(r#""event":"action_finished""#))
                .count();
        }
        self.count
    }
}

/// One run: the daemon's CPU per action (µs) over the first and the last hundred actions, and
/// its project, removed when the benchmark ends: on ext4 without a journal a new file's inode is
/// searched for past every inode released in the last minutes, so a round would otherwise pay for
/// the files of the rounds before it.
fn round(actions: usize) -> (f64, f64, Project) {
    let p = Project::new(
        &config(
            &["sh", "-c", "cat > /dev/null; echo ok"],
            "stdin",
            "text",
            Some("false"),
        ),
        None,
    );
    let id = p.create(actions.saturating_sub(2));
    let events = p.progress(&id).join("events.jsonl");
    let mut child = p.spawn_run(&id);
    let pid = child.id();
    let marks = [1, 101, actions - 100, actions];
    let mut at = Vec::new();
    let mut finished = Finished {
        file: None,
        pos: 0,
        partial: String::new(),
        count: 0,
    };
    while at.len() < marks.len() {
        let n = finished.poll(&events);
        while at.len() < marks.len() && n >= marks[at.len()] {
            at.push(cpu_ns(pid).expect("the daemon ended early"));
        }
        if child.try_wait().expect("try_wait").is_some() {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(3), "loopd run should stop at its limit");
    assert_eq!(
        at.len(),
        marks.len(),
        "only {} actions seen",
        finished.count
    );
    let per = |a: u64, b: u64| (b - a) as f64 / 1000.0 / 100.0;
    (per(at[0], at[1]), per(at[2], at[3]), p)
}

fn main() {
    let actions = env_num("LOOPD_BENCH_ACTIONS", 1000).max(200);
    let rounds = env_num("LOOPD_BENCH_ROUNDS", 5).max(1);
    let (mut first, mut last, mut leftovers) = (Vec::new(), Vec::new(), Vec::new());
    println!("\nthe daemon's own CPU per action, {actions} actions, {rounds} rounds:\n");
    println!(
        "| round | actions 1–100 | actions {}–{actions} | ratio |",
        actions - 99
    );
    println!("|---|---|---|---|");
    for r in 1..=rounds {
        let (a, b, project) = round(actions);
        leftovers.push(project);
        println!("| {r} | {a:.0} µs | {b:.0} µs | {:.2} |", b / a);
        first.push(a);
        last.push(b);
    }
    let (a, b) = (median(&mut first), median(&mut last));
    println!("| median | {a:.0} µs | {b:.0} µs | {:.2} |", b / a);
}
