//! The dashboard of `loopd serve` in a real browser: `tests/browser/dashboard.mjs` drives
//! Chromium (through playwright-core) against a real service on 127.0.0.1 with a scripted
//! executor. It logs in with the token's link, creates a loop from the form, watches it progress
//! live, pauses it (the state file says `paused`), resumes it, answers its question, stops it,
//! sees a raw write to the state file without a reload, and checks that a request without the
//! token is refused. Screenshots of the overview and of the loop's page go to `target/`.
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
    let service = p.serve(&[
        "--root",
        p.root.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    let info = service.info().expect("info");
    let url = format!("http://{}", info["listen"].as_str().expect("listen"));
    let token = std::fs::read_to_string(p.home.join(".local/state/loopd/run/token"))
        .expect("token")
        .trim()
        .to_owned();
    let shots = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    std::fs::create_dir_all(&shots).expect("target/");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/dashboard.mjs");
    let child = Command::new("node")
        .arg(&script)
        .env("LOOPD_URL", &url)
        .env("LOOPD_TOKEN", &token)
        .env("LOOPD_ROOT", &p.root)
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
    for shot in ["dashboard-overview.png", "dashboard-loop.png"] {
        let len = std::fs::metadata(shots.join(shot)).map_or(0, |m| m.len());
        assert!(len > 10_000, "{shot} is missing or empty");
    }
    eprintln!("{log}");
    drop(service);
}
