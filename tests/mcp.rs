//! loopd's MCP server through real clients: PyPI's `mcp` (the official Python SDK) over stdio
//! (`loopd mcp`) and over streamable HTTP (`/mcp` on `loopd serve`), each creating a loop on a
//! real project with a scripted agent, following it to its end, reading its diff and rolling
//! it back, and stopping a loop mid-action; the HTTP endpoint's token and `Host` checks.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::http::{To, fetch};
use common::{GOOD_AGENT, Project, alive, git, read_pid, wait_for};
use serde_json::{Value, json};

/// The Python of a virtual environment with PyPI's `mcp`, as `.ci/run` installs it.
fn python() -> Option<PathBuf> {
    common::installed(
        "LOOPD_MCP_PYTHON",
        ".cache/loopd/mcp-2.3.0/bin/python",
        "PyPI's mcp",
        "python3 -m venv ~/.cache/loopd/mcp-2.3.0 && ~/.cache/loopd/mcp-2.3.0/bin/pip install mcp==2.3.0",
    )
}

/// Runs the client's `scenario` over `transport` (the rest of `plan` says where); what it saw.
fn client(python: &PathBuf, mut plan: Value, scenario: &str) -> Value {
    plan["scenario"] = json!(scenario);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mcp_client.py");
    let out = Command::new(python)
        .arg(script)
        .arg(plan.to_string())
        .output()
        .expect("run the MCP client");
    assert!(
        out.status.success(),
        "the MCP client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "the client's output is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A project in git (its checkpoints need it) whose agent is `agent`. Its user's `$HOME` is the
/// project's root: what loopd keeps there is no change of the work tree's.
fn git_project(agent: &str) -> Project {
    let p = Project::new(agent);
    std::fs::write(p.root.join(".gitignore"), ".local/\n").expect("write .gitignore");
    git(&p.root, &["init", "--quiet"]);
    git(&p.root, &["add", "."]);
    git(&p.root, &["commit", "--quiet", "-m", "base"]);
    p
}

/// The plan of `loopd mcp` in `p`, as a client would start it (a user of `$HOME` only).
fn stdio(p: &Project) -> Value {
    json!({
        "transport": "stdio",
        "loopd": env!("CARGO_BIN_EXE_loopd"),
        "root": p.root,
        "env": { "HOME": p.home },
    })
}

/// Checks what a client saw of a loop it created and followed to its end.
fn check_followed(p: &Project, seen: &Value) {
    let tools = seen["tools"].as_object().expect("tools");
    for name in [
        "list_loops",
        "create_loop",
        "loop_status",
        "pause_loop",
        "resume_loop",
        "stop_loop",
        "add_task",
        "answer",
        "retry_loop",
        "loop_diff",
        "list_checkpoints",
        "rollback",
        "loop_events",
        "loop_output",
        "wait_for_loop",
    ] {
        let schema = &tools[name];
        assert_eq!(schema["type"], "object", "{name}: {schema}");
        // Small enough for any client: a handful of plain fields.
        let fields = schema["properties"].as_object().expect("properties").len();
        assert!(fields <= 12, "{name} has {fields} fields");
    }
    let id = seen["created"]["value"]["loop_id"].as_str().expect("an id");
    assert_eq!(seen["created"]["value"]["started"], true);
    let waited = &seen["waited"]["value"];
    assert_eq!(waited["status"], "completed", "{waited}");
    assert_eq!(
        (&waited["ended"], &waited["timed_out"]),
        (&json!(true), &json!(false))
    );
    assert!(
        !seen["progress"].as_array().expect("progress").is_empty(),
        "no progress notification: {seen}"
    );
    assert_eq!(seen["resource"]["status"], "completed");
    let uri = format!("loopd://loops/{id}");
    assert!(
        seen["updated"]
            .as_array()
            .expect("updates")
            .iter()
            .any(|u| u == uri.as_str()),
        "the subscription told nothing: {}",
        seen["updated"]
    );
    // The events, read on from a cursor: the first three, then the rest, nothing twice.
    let first = &seen["events"][0];
    assert_eq!(first["events"].as_array().expect("events").len(), 3);
    assert_eq!(first["next_after"], 3);
    let rest = seen["events"][1]["events"].as_array().expect("events");
    let logged = p.events(id);
    // The daemon may log its exit after the loop's end, which the client saw.
    assert_eq!(rest.as_slice(), &logged[3..3 + rest.len()]);
    assert!(rest.iter().any(|e| e["event"] == "completed"), "{rest:?}");
    // What the loop did: its two tasks' lines in f.txt.
    let diff = seen["diff"]["value"]["diff"].as_str().expect("a diff");
    assert!(diff.contains("+task-001\n+task-002"), "{diff}");
    let checkpoints = seen["checkpoints"]["value"]["checkpoints"]
        .as_array()
        .expect("checkpoints");
    assert!(checkpoints.len() >= 2, "{checkpoints:?}");
    // Rolled back to the first checkpoint: before the tasks were developed.
    assert_eq!(
        seen["rollback"]["error"],
        false,
        "{}; git status: {}",
        seen["rollback"],
        git(&p.root, &["status", "--porcelain", "--ignored"])
    );
    assert!(!p.root.join("f.txt").exists(), "f.txt is still there");
    let listed = seen["listed"]["value"]["loops"].as_array().expect("loops");
    assert!(listed.iter().any(|l| l["loop_id"] == id));
    // A refusal is a tool error in one line.
    assert_eq!(seen["refused"]["error"], true);
    assert!(
        seen["refused"]["text"]
            .as_str()
            .expect("text")
            .contains("no-such-loop"),
        "{}",
        seen["refused"]
    );
    assert_eq!(seen["bad_argument"]["error"], true);
    assert_eq!(seen["bad_argument"]["text"], "id: a string");
}

/// An agent whose `develop` writes its pid and hangs.
const HANGING_AGENT: &str = r#"
cat > /dev/null
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","summary":"planned","state_updates":{"tasks":[{"description":"first"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop) echo $$ > agent.pid; exec sleep 600 ;;
  *) echo '{"status":"success","summary":"ok"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

/// Checks what a client saw of a loop it stopped mid-action: the action's agent is gone.
fn check_stopped(p: &Project, seen: &Value) {
    assert_eq!(seen["running"]["in_flight"]["action"], "develop");
    assert_eq!(seen["stopped"]["error"], false, "{}", seen["stopped"]);
    assert_eq!(seen["stopped"]["value"]["status"], "failed");
    assert_eq!(seen["after"]["standing"], "stopped");
    let pid = read_pid(&p.root.join("agent.pid"));
    wait_for("the stopped loop's agent to be gone", || !alive(pid));
    let id = seen["after"]["loop_id"].as_str().expect("id");
    let by = &p.state(id)["status_by"];
    assert_eq!(by["by"], "the MCP server of loopd", "{by}");
}

#[test]
fn over_stdio_a_client_creates_follows_diffs_and_rolls_back_a_loop() {
    let Some(python) = python() else { return };
    let p = git_project(GOOD_AGENT);
    let seen = client(&python, stdio(&p), "follow");
    check_followed(&p, &seen);
}

#[test]
fn over_stdio_a_stop_ends_the_action_in_flight() {
    let Some(python) = python() else { return };
    let p = git_project(HANGING_AGENT);
    let seen = client(&python, stdio(&p), "stop");
    check_stopped(&p, &seen);
}

/// The HTTP plan of a service in `p`, listening on loopback with its token.
fn http(p: &Project, service: &common::Service) -> (Value, String, String) {
    let info = service.info().expect("the service's status");
    let addr = info["listen"].as_str().expect("listen").to_owned();
    let token = std::fs::read_to_string(p.home.join(".local/state/loopd/run/token"))
        .expect("token")
        .trim()
        .to_owned();
    let plan = json!({
        "transport": "http",
        "url": format!("http://{addr}/mcp"),
        "token": token,
        "root": p.root,
    });
    (plan, addr, token)
}

#[test]
fn over_http_a_client_creates_follows_diffs_and_rolls_back_and_stops_a_loop() {
    let Some(python) = python() else { return };
    let p = git_project(GOOD_AGENT);
    let hanging = Project::beside(&p, HANGING_AGENT);
    git(&hanging.root, &["init", "--quiet"]);
    let root = |p: &Project| p.root.to_str().unwrap().to_owned();
    let service = p.serve(&[
        "--listen",
        "127.0.0.1:0",
        "--root",
        &root(&p),
        "--root",
        &root(&hanging),
    ]);
    let (plan, _, _) = http(&p, &service);
    let seen = client(&python, plan.clone(), "follow");
    check_followed(&p, &seen);
    // The service drove it: no daemon of its own.
    let id = seen["created"]["value"]["loop_id"].as_str().expect("id");
    let started = p.events_named(id, "daemon_started");
    assert_eq!(started[0]["pid"], service.child.id(), "{started:?}");

    let mut plan = plan;
    plan["root"] = json!(hanging.root);
    let seen = client(&python, plan, "stop");
    check_stopped(&hanging, &seen);
}

#[test]
fn over_http_the_endpoint_asks_for_the_token_and_a_loopback_host() {
    let p = Project::new(GOOD_AGENT);
    let service = p.serve(&["--listen", "127.0.0.1:0"]);
    let (_, addr, token) = http(&p, &service);
    let initialize = json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": { "name": "t", "version": "1" },
        },
    })
    .to_string();
    let accept = ("accept", "application/json, text/event-stream");
    let (status, _) = fetch(
        &To::Tcp(&addr, None),
        "POST",
        "/mcp",
        Some(&initialize),
        &[accept],
    );
    assert_eq!(status, 401, "no token");
    // A name that is not this machine's loopback (as a DNS rebinding would send) is refused.
    let (status, body) = fetch(
        &To::Tcp(&addr, Some(&token)),
        "POST",
        "/mcp",
        Some(&initialize),
        &[accept],
    );
    assert_eq!(status, 403, "Host: loopd: {body}");
}
