//! Benchmark: what a git checkpoint costs an action, in a repository of 10,000 files.
//!
//! A temporary repository with N files (default 10,000, in 100 directories, committed), then
//! checkpoints as a loop records them (`loopd_exec::checkpoint::Repo::record`, the code the daemon
//! runs: in the checkpoints' vault, each copied into the repository): the loop's first (the vault
//! is new and its index file too, so every file is hashed once), then one after each of R rounds
//! in which an "action" edits three files and adds one, each with the check of the repository's
//! copies the daemon makes before it (`Repo::check`).
//!
//! Run: `cargo bench --bench checkpoint`. Environment:
//!   LOOPD_BENCH_FILES   files in the repository (default 10000)
//!   LOOPD_BENCH_ROUNDS  checkpoints after edits (default 30)
//!   LOOPD_BENCH_DIR     where the repository goes (default: the system temp dir)

mod common;

use std::time::Instant;

use common::{env_num, git, median, tempdir};
use loopd_exec::checkpoint::Repo;

fn main() {
    let files = env_num("LOOPD_BENCH_FILES", 10_000);
    let rounds = env_num("LOOPD_BENCH_ROUNDS", 30).max(1);
    let dir = tempdir();
    let root = dir.path().canonicalize().expect("canonical");
    git(&root, &["init", "--quiet"]);
    for i in 0..files {
        let sub = root.join(format!("d{:02}", i % 100));
        std::fs::create_dir_all(&sub).expect("mkdir");
        std::fs::write(
            sub.join(format!("f{i}.txt")),
            format!("file {i}\n{}\n", "x".repeat(200)),
        )
        .expect("write");
    }
    git(&root, &["add", "."]);
    git(&root, &["commit", "--quiet", "-m", "base"]);
    std::fs::create_dir_all(root.join(".loop/l1.progress")).expect("state dir");
    let repo = Repo::open(&root, &root.join(".loop"), "l1", "checkpoint").expect("a repository");

    let started = Instant::now();
    let mut last = repo
        .record("0-start", None)
        .expect("first checkpoint")
        .commit;
    let first = started.elapsed().as_secs_f64() * 1000.0;
    let mut times = Vec::new();
    for round in 1..=rounds {
        for k in 0..3 {
            let i = (round * 7 + k * 1013) % files;
            let path = root.join(format!("d{:02}/f{i}.txt", i % 100));
            std::fs::write(&path, format!("file {i}, round {round}\n")).expect("edit");
        }
        std::fs::write(root.join(format!("new-{round}.txt")), "new\n").expect("add");
        let started = Instant::now();
        assert!(repo.check().expect("check").is_empty());
        let checkpoint = repo
            .record(&format!("{round}-develop"), Some(&last))
            .expect("checkpoint");
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(checkpoint.files, 4, "three edits and a new file");
        last = checkpoint.commit;
    }
    let p50 = median(&mut times.clone());
    times.sort_by(f64::total_cmp);
    let max = times.last().copied().unwrap_or(f64::NAN);
    println!("\ncheckpoints of a repository of {files} files ({rounds} after edits):\n");
    println!("| checkpoint | time |");
    println!("|---|---|");
    println!("| the loop's first (every file hashed) | {first:.0} ms |");
    println!("| after an action (3 files edited, 1 added): median | {p50:.1} ms |");
    println!("| after an action: slowest | {max:.1} ms |");
}
