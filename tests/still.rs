//! A loop that is not moving always says why and what moves it on (issue 64): in `status`, in
//! `status --json` and `list --json` (`status_reason`, `next_step`, never null for such a loop),
//! and in the API's view, through the real binary. Each state is the one the engine leaves (see
//! the tests of each feature for how it gets there); here, what a person is shown of it.

mod common;

use common::*;
use serde_json::{Value, json};

/// `status --json`'s reason and next step of loop `id`.
fn still(p: &Project, id: &str) -> (Value, Value) {
    let out = p.output(&["status", id, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let shown: Value = serde_json::from_str(&stdout(&out)).expect("status --json");
    (shown["status_reason"].clone(), shown["next_step"].clone())
}

/// `status`'s rows `why` and `next`.
fn rows(p: &Project, id: &str) -> (Option<String>, Option<String>) {
    let shown = stdout(&p.output(&["status", id]));
    let row = |label: &str| {
        shown
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{label} ")))
            .map(|l| l.trim_start()[label.len()..].trim().to_owned())
    };
    (row("why"), row("next"))
}

/// Checks that loop `id` says `reason` (its start) and `next` (a part of it) everywhere.
fn says(p: &Project, id: &str, reason: &str, next: &str) {
    let (why, then) = still(p, id);
    let why = why
        .as_str()
        .unwrap_or_else(|| panic!("{id}: no status_reason"));
    let then = then
        .as_str()
        .unwrap_or_else(|| panic!("{id}: no next_step"));
    assert!(why.starts_with(reason), "{why:?} is not {reason:?}");
    assert!(then.contains(next), "{then:?} does not say {next:?}");
    let (row_why, row_next) = rows(p, id);
    assert_eq!(row_why.as_deref(), Some(why), "the status row");
    assert_eq!(row_next.as_deref(), Some(then), "the next row");
}

#[test]
fn every_loop_that_stands_still_says_why_and_what_moves_it() {
    let p = Project::new(GOOD_AGENT);
    let made = |edit: &dyn Fn(&mut Value)| {
        let id = p.create(&["--title", "still"]);
        edit_raw(&p, &id, |s| edit(s));
        id
    };
    let created = p.create(&["--title", "not started"]);
    says(
        &p,
        &created,
        "created, not started",
        &format!("`loopd start {created}`"),
    );

    let paused = p.create(&["--title", "paused"]);
    assert_eq!(code(&p.output(&["pause", &paused])), 0);
    says(
        &p,
        &paused,
        "paused by loopd pause",
        &format!("`loopd resume {paused}`"),
    );

    let stopped = p.create(&["--title", "stopped"]);
    assert_eq!(code(&p.output(&["stop", &stopped])), 0);
    says(
        &p,
        &stopped,
        "stopped by loopd stop",
        &format!("`loopd resume {stopped}`"),
    );

    let blocked = made(&|s| {
        s["status"] = json!("paused");
        s["skill_state"]["blocked"] = json!({
            "since": "2026-11-28T00:00:00Z", "action": "develop", "executor": "claude",
            "reason": "not logged in: run claude /login",
        });
    });
    says(
        &p,
        &blocked,
        "blocked: claude: not logged in",
        "fix that, then `loopd resume",
    );

    let stalled = made(&|s| {
        s["status"] = json!("paused");
        s["skill_state"]["no_progress"] = json!({
            "rounds": 3,
            "paused": { "since": "2026-11-28T00:00:00Z", "reason": "3 rounds left the same failing tests" },
        });
    });
    says(
        &p,
        &stalled,
        "no progress: 3 rounds",
        &format!("`loopd logs {stalled}`"),
    );

    let waiting = made(&|s| {
        s["status"] = json!("running");
        s["skill_state"]["rate_limit"] =
            json!({ "account": "claude", "until": "2026-11-28T09:00:00Z" });
    });
    says(
        &p,
        &waiting,
        "waiting for the rate limit of claude until 2026-11-28T09:00:00Z",
        "by itself",
    );

    let asking = made(&|s| {
        s["status"] = json!("running");
        s["skill_state"]["question"] = json!({
            "action": "develop", "text": "Which database?", "since": "2026-11-28T00:00:00Z",
        });
    });
    says(
        &p,
        &asking,
        "waiting for an answer: Which database?",
        &format!("`loopd answer {asking} TEXT`"),
    );

    let failed = made(&|s| {
        s["status"] = json!("failed");
        s["failure_reason"] = json!("too many errors: 3 of 3");
        s["skill_state"]["outcome"] = json!("failed");
    });
    says(
        &p,
        &failed,
        "failed: too many errors",
        &format!("`loopd retry {failed}`"),
    );

    let spent = made(&|s| {
        s["status"] = json!("failed");
        s["failure_reason"] = json!("budget exceeded: $0.5000 spent, max_cost_usd is $0.1");
        s["skill_state"]["outcome"] = json!("failed");
    });
    says(
        &p,
        &spent,
        "out of budget: budget exceeded",
        "--max-cost-usd",
    );

    let limited = made(&|s| {
        s["status"] = json!("completed");
        s["skill_state"]["outcome"] = json!("iteration_limit");
    });
    says(
        &p,
        &limited,
        "completed at its iteration limit",
        "--max-iterations",
    );

    // Set to run with nothing to drive it (no daemon, no service).
    let orphan = made(&|s| s["status"] = json!("running"));
    says(
        &p,
        &orphan,
        "running, but nothing drives it",
        &format!("`loopd start {orphan}`"),
    );

    // A loop that met its goal, and one that moves, have nothing to say.
    let passed = made(&|s| {
        s["status"] = json!("completed");
        s["skill_state"]["outcome"] = json!("passed");
    });
    assert_eq!(still(&p, &passed), (Value::Null, Value::Null));

    // `list --json` says the same of each.
    let listed: Value =
        serde_json::from_str(&stdout(&p.output(&["list", "--json"]))).expect("list");
    let listed = listed.as_array().expect("an array");
    for id in [&created, &paused, &blocked, &failed, &orphan] {
        let l = listed
            .iter()
            .find(|l| l["loop_id"] == id.as_str())
            .expect("listed");
        assert_eq!(
            (l["status_reason"].clone(), l["next_step"].clone()),
            still(&p, id)
        );
    }
}

#[test]
fn the_api_and_the_service_say_why_a_loop_waits() {
    let p = Project::new(&agent(&[("develop", &wait_for_file("go"))]));
    let service = p.serve(&["--max-running-loops", "1"]);
    let socket =
        std::path::PathBuf::from(service.info().expect("info")["socket"].as_str().unwrap());
    let first = p.create(&["--title", "runs"]);
    let second = p.create(&["--title", "waits"]);
    assert_eq!(code(&p.output(&["start", &first])), 0);
    wait_for("the first loop's develop", || {
        p.state(&first)["skill_state"]["in_flight"]["action"] == "develop"
    });
    assert_eq!(code(&p.output(&["start", &second])), 0);
    wait_for("the second loop to be queued", || {
        still(&p, &second)
            .0
            .as_str()
            .is_some_and(|r| r.starts_with("queued"))
    });
    let (why, next) = still(&p, &second);
    assert!(why.as_str().unwrap().contains("at most 1"), "{why}");
    assert!(next.as_str().unwrap().contains("nothing"), "{next}");
    let (status, shown) = common::http::call(
        &common::http::To::Socket(&socket),
        "GET",
        &format!("/v1/loops/{second}"),
        None,
    );
    assert_eq!(status, 200);
    assert_eq!(
        (
            shown["view"]["status_reason"].clone(),
            shown["view"]["next_step"].clone()
        ),
        (why, next)
    );
    // The running one moves: nothing to say.
    assert_eq!(still(&p, &first).0, Value::Null);
    std::fs::write(p.root.join("go"), "").unwrap();
}
