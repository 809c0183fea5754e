//! The dashboard of `loopd serve` in a real browser: `tests/browser/dashboard.mjs` drives
//! Chromium (through playwright-core) against a real service on 127.0.0.1 with scripted
//! executors. It logs in with the token's link, creates a loop from the form, watches its output
//! pushed live with the attempt's running time, pauses it (the state file says `paused`),
//! resumes it, answers its question, stops it, retries it, sees a raw write to the state file
//! without a reload, and checks that a request without the token is refused. On a second project,
//! a git repository whose agent (a Claude Code stand-in) reports what it spent, it runs a loop to
//! the end from the page, opens a develop's diff, rolls the work tree back to a checkpoint, and
//! counts the marks of the timeline and charts; then a loop of tasks developed at once, whose
//! history shows each merge, the conflict and a race's entries side by side, and whose timeline
//! has a lane per task. Screenshots of every page go to
//! `target/tmp/dashboard/` (Cargo's temporary directory for tests), for a reviewer to look at.
//!
//! `.ci/run` installs Debian's `chromium` and `playwright-core` (into `$LOOPD_BROWSER_DIR`, by
//! default `~/.cache/loopd/browser`) when they are missing. Without them this test says so and
//! passes, except in CI (`CI=true`), where it must run.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Develop: the first run works until it is paused; the next asks a question; once answered, it
/// works until it is stopped.
fn browser_agent() -> String {
    agent(&[(
        "develop",
        "if [ ! -e .paused-once ]; then touch .paused-once; echo \"working on $LOOPD_TASK_ID\"; \
         sleep 100; fi; \
         if [ ! -e .asked ]; then touch .asked; \
         echo '{\"status\":\"needs_input\",\"summary\":\"a choice\",\"question\":\"Postgres or SQLite?\"}' \
         > \"$LOOPD_RESULT_FILE\"; exit 0; fi; \
         echo still working; sleep 100",
    )])
}

/// A Claude Code stand-in for the git project: it does each action's work in the shell, writes
/// the result file, and reports tokens and dollars as the real CLI does in its last line.
/// Develop appends a line per task to `work.txt`; the first validation finds half the tests
/// failing, debug fixes them (`fixed.txt`), the second passes.
const SPENDING_AGENT: &str = r#"cat > /dev/null
spent() {
  echo "{\"type\":\"result\",\"subtype\":\"success\",\"is_error\":false,\"result\":\"done\",\"total_cost_usd\":$2,\"usage\":{\"input_tokens\":$1,\"output_tokens\":50}}"
}
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","summary":"planned","state_updates":{"tasks":[{"description":"start work.txt"},{"description":"extend it"}]}}' > "$LOOPD_RESULT_FILE"; spent 100 0.01 ;;
  develop) echo "line of $LOOPD_TASK_ID" >> work.txt
    echo "{\"status\":\"success\",\"summary\":\"wrote $LOOPD_TASK_ID\"}" > "$LOOPD_RESULT_FILE"; spent 1200 0.05 ;;
  validate) if [ -e fixed.txt ]; then r='"passed":true,"pass_rate":100'; else r='"passed":false,"pass_rate":50,"failed_tests":["t2"]'; fi
    echo "{\"status\":\"success\",\"state_updates\":{$r}}" > "$LOOPD_RESULT_FILE"; spent 300 0.02 ;;
  debug) echo fixed > fixed.txt
    echo '{"status":"success","summary":"fixed t2"}' > "$LOOPD_RESULT_FILE"; spent 700 0.04 ;;
  *) echo '{"status":"success","summary":"done"}' > "$LOOPD_RESULT_FILE"; spent 10 0.001 ;;
esac
"#;

/// Its project: a git repository with one commit, whose executors (`claude`, and `codex` to race
/// it) are the stand-in, named by its path: `bin/` is ignored, so the work trees of tasks
/// developed at once do not have it.
fn git_project(beside: &Project) -> Project {
    let g = Project::beside(beside, "");
    let stand_in = g.root.join("bin/claude");
    let stand_in = stand_in.to_str().expect("a UTF-8 path");
    g.config(&format!(
        r#"
retry_backoff = 0.01
executor = "claude"

[executor_defaults]
kill_grace = 0.5

[executors.claude]
command = ["sh", "{stand_in}"]

[executors.codex]
command = ["sh", "{stand_in}"]
format = "claude-stream-json"
"#
    ));
    g.script("claude", SPENDING_AGENT);
    std::fs::write(g.root.join(".gitignore"), ".loop/\nbin/\n").expect("write .gitignore");
    std::fs::write(g.root.join("README"), "a project\n").expect("write README");
    git(&g.root, &["init", "--quiet", "--initial-branch=main"]);
    git(&g.root, &["add", "."]);
    git(&g.root, &["commit", "--quiet", "-m", "base"]);
    g
}

/// What the browser test needs, or why it cannot run.
fn browser() -> Result<(PathBuf, PathBuf), String> {
    let chromium = ["chromium", "chromium-browser"]
        .into_iter()
        .find_map(which)
        .ok_or("chromium is not installed")?;
    let dir = std::env::var_os("LOOPD_BROWSER_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/loopd/browser")))
        .ok_or("no $HOME")?;
    if !dir
        .join("node_modules/playwright-core/package.json")
        .is_file()
    {
        return Err(format!(
            "playwright-core is not installed in {}",
            dir.display()
        ));
    }
    Ok((chromium, dir))
}

#[test]
fn the_dashboard_drives_a_loop_in_a_real_browser() {
    let (chromium, browser_dir) = match browser() {
        Ok(found) => found,
        Err(why) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped: {why} (.ci/run installs it)");
            return;
        }
        Err(why) => panic!("{why}: CI must run the browser test"),
    };
    let p = Project::new(&browser_agent());
    let g = git_project(&p);
    let charted = g.create(&["--title", "Charts loop"]);
    // Two tasks at once, which both write the end of work.txt (a conflict), then a race.
    let parallel = g.create(&[
        "--title",
        "Parallel loop",
        "--parallel",
        "2",
        "--task",
        "one",
        "--task",
        "two",
    ]);
    let raced = g.output(&[
        "task", "add", &parallel, "three", "--race", "claude", "--race", "codex",
    ]);
    assert!(raced.status.success(), "{}", stderr(&raced));
    let service = p.serve(&[
        "--root",
        p.root.to_str().unwrap(),
        "--root",
        g.root.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    let info = service.info().expect("info");
    let url = format!("http://{}", info["listen"].as_str().expect("listen"));
    let token = std::fs::read_to_string(p.home.join(".local/state/loopd/run/token"))
        .expect("token")
        .trim()
        .to_owned();
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&shots).expect("the screenshots' directory");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/dashboard.mjs");
    let child = Command::new("node")
        .arg(&script)
        .env("LOOPD_URL", &url)
        .env("LOOPD_TOKEN", &token)
        .env("LOOPD_ROOT", &p.root)
        .env("LOOPD_GIT_ROOT", &g.root)
        .env("LOOPD_GIT_LOOP", &charted)
        .env("LOOPD_PARALLEL_LOOP", &parallel)
        .env("LOOPD_SHOTS", &shots)
        .env("LOOPD_BROWSER_DIR", &browser_dir)
        .env("CHROMIUM", &chromium)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run node");
    let out = wait_output(child, std::time::Duration::from_secs(180));
    let log = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "the browser test failed:\n{log}");
    assert!(log.contains("dashboard test: passed"), "{log}");
    for shot in [
        "dashboard-overview.png",
        "dashboard-loop.png",
        "dashboard-charts.png",
        "dashboard-narrow.png",
        "dashboard-parallel.png",
    ] {
        let len = std::fs::metadata(shots.join(shot)).map_or(0, |m| m.len());
        assert!(len > 10_000, "{shot} is missing or empty");
    }
    eprintln!("{log}");
    drop(service);
}
