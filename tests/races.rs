//! Races between a loop's writers, through the real binary under CPU load: a loop's own writes
//! (the `create` that made it, its daemon's start of it, each attempt's record) never interrupt
//! its attempts; only a pause or stop somebody wrote does, and the interruption names who.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::*;

/// Plans one task; every action takes a moment, as an agent's would.
const AGENT: &str = r#"
cat > /dev/null
sleep 0.03
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"a"}]}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success","summary":"done"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

/// Processes that keep every core busy while they live.
struct Burners(Vec<Child>);

impl Burners {
    fn start(n: usize) -> Burners {
        Burners(
            (0..n)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .stdin(Stdio::null())
                        .spawn()
                        .expect("spawn a CPU burner")
                })
                .collect(),
        )
    }
}

impl Drop for Burners {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `loops` loops, each created then run to its end, `parallel` projects at a time, with
/// `LOOPD_WATCH` set to `watch` (or unset); returns every `action_interrupted` event, with the
/// loop it happened in.
fn create_and_run(loops: usize, parallel: usize, watch: Option<&str>) -> Vec<String> {
    let next = Arc::new(AtomicUsize::new(0));
    let interrupted = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..parallel)
        .map(|_| {
            let (next, interrupted) = (next.clone(), interrupted.clone());
            let watch = watch.map(str::to_owned);
            std::thread::spawn(move || {
                let p = Project::new(AGENT);
                while next.fetch_add(1, Ordering::SeqCst) < loops {
                    let id = p.create(&["--title", "t", "--max-iterations", "1"]);
                    let mut run = p.loopd();
                    run.args(["run", &id])
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped());
                    if let Some(watch) = &watch {
                        run.env("LOOPD_WATCH", watch);
                    }
                    let out = wait_output(run.spawn().expect("spawn loopd run"), DEADLINE);
                    assert_eq!(code(&out), 3, "{}", stderr(&out));
                    for event in p.events_named(&id, "action_interrupted") {
                        lock(&interrupted).push(format!("{id}: {event}"));
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("a thread of loops");
    }
    Arc::try_unwrap(interrupted)
        .expect("every thread joined")
        .into_inner()
        .unwrap()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hundreds of loops created and run, eight projects at a time beside processes that keep both
/// cores busy, watched by inotify and by polling: not one attempt is interrupted, since nobody
/// paused or stopped a loop. (A loop's first attempt was once ended 3 ms in, "the loop's status
/// left running": the watcher's thread, behind under load, still had the `created` of the loop's
/// start when the attempt was armed. By polling, where the watcher hears of a write up to 100 ms
/// late, that happened to nearly every loop.)
#[test]
fn a_loops_own_writes_never_interrupt_its_attempts() {
    let _burners = Burners::start(4);
    let mut interrupted = create_and_run(200, 8, None);
    interrupted.extend(create_and_run(24, 4, Some("poll")));
    assert_eq!(interrupted, Vec::<String>::new());
}

/// An interruption says who wrote the status that caused it: a loopd command, or a program that
/// is not loopd (which records no writer).
#[test]
fn an_interruption_names_who_wrote_the_status() {
    let p = Project::new(&agent(&[("develop", "echo $$ > agent.pid; exec sleep 30")]));
    for (how, who) in [
        ("loopd pause", "set by loopd pause (pid "),
        ("a plain rewrite", "set by a program other than loopd"),
    ] {
        let id = p.create(&["--title", "t"]);
        let _ = std::fs::remove_file(p.root.join("agent.pid"));
        let run = p.spawn_run(&id, &["--exit-on-pause"]);
        wait_for("the develop action", || p.root.join("agent.pid").exists());
        if how == "loopd pause" {
            assert!(p.output(&["pause", &id]).status.success());
        } else {
            set_status(&p, &id, "paused");
        }
        let out = wait_output(run, DEADLINE);
        assert_eq!(code(&out), 6, "{how}: {}", stderr(&out));
        let events = p.events_named(&id, "action_interrupted");
        assert_eq!(events.len(), 1, "{how}: {events:?}");
        let message = events[0]["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with("the loop's status became paused, ") && message.contains(who),
            "{how}: {message}"
        );
    }
}
