//! loopd's MCP server through real clients: PyPI's `mcp` (the official Python SDK) over stdio
//! (`loopd mcp`) and over streamable HTTP (`/mcp` on `loopd serve`), each creating a loop on a
//! real project with a scripted agent, following it to its end, reading its diff and rolling
//! it back, and stopping a loop mid-action; the HTTP endpoint's token and `Host` checks; and the
//! real Claude Code CLI, with nothing but `loopd mcp`, against a scripted model on 127.0.0.1 that
//! makes a loop, waits for it and reads its diff; and the MCP conformance suite's server
//! scenarios against `/mcp`.

mod common;

use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::http::{To, fetch};
use common::{DEADLINE, GOOD_AGENT, Project, alive, code, git, read_pid, stderr, stdout, wait_for};
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
    let reason = seen["after"]["status_reason"].as_str().expect("a reason");
    assert!(
        reason.starts_with("stopped by the MCP server of loopd"),
        "{reason}"
    );
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

/// The real Claude Code, as `.ci/run` installs it for tests/real_agents.rs.
fn claude() -> Option<PathBuf> {
    let dir = std::env::var_os("LOOPD_AGENTS_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/loopd/agents")))?;
    let claude = dir.join("node_modules/.bin/claude");
    if claude.exists() {
        return Some(claude);
    }
    common::not_installed(
        "Claude Code",
        &claude,
        "docs/development.md, \"The real agent CLIs\"",
    );
    None
}

/// A person's Claude Code session with loopd's MCP server only: the scripted model has it make a
/// loop, wait for it to end and read its diff, and checks each tool result it is sent.
#[test]
fn a_real_claude_code_session_makes_a_loop_waits_for_it_and_reads_its_diff() {
    let Some(claude) = claude() else { return };
    let p = git_project(GOOD_AGENT);
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("checks.jsonl");
    let mut model = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/agents/mcp_model_server.py"))
        .arg("--log")
        .arg(&log)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs the model server");
    let mut port = String::new();
    std::io::BufReader::new(model.stdout.take().expect("stdout"))
        .read_line(&mut port)
        .expect("the server prints its port");
    let config = dir.path().join("mcp.json");
    let server = json!({ "mcpServers": { "loopd": {
        "command": env!("CARGO_BIN_EXE_loopd"),
        "args": ["--root", p.root, "mcp"],
        "env": { "HOME": p.home },
    }}});
    std::fs::write(&config, server.to_string()).expect("write the MCP config");
    let home = dir.path().join("claude-home");
    std::fs::create_dir_all(&home).expect("mkdir");
    let session = Command::new(claude)
        .args([
            "-p",
            "Make a loop that writes two files, wait for it, then show me its diff.",
        ])
        .arg("--mcp-config")
        .arg(&config)
        .args([
            "--strict-mcp-config",
            "--output-format",
            "json",
            "--allowedTools",
        ])
        .arg("mcp__loopd__create_loop mcp__loopd__wait_for_loop mcp__loopd__loop_diff")
        .current_dir(&p.root)
        .env("HOME", &home)
        .env(
            "ANTHROPIC_BASE_URL",
            format!("http://127.0.0.1:{}", port.trim()),
        )
        .env("ANTHROPIC_API_KEY", "sk-scripted")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("CLAUDE_CODE_MAX_RETRIES", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run claude");
    let out = common::wait_output(session, DEADLINE * 4);
    let _ = model.kill();
    let _ = model.wait();
    assert_eq!(code(&out), 0, "claude: {}\n{}", stdout(&out), stderr(&out));
    let result: Value = serde_json::from_str(&stdout(&out)).expect("claude's JSON result");
    assert!(
        result["result"]
            .as_str()
            .is_some_and(|r| r.starts_with("DONE")),
        "{result}"
    );
    let checks: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a check"))
        .collect();
    let names: Vec<&str> = checks
        .iter()
        .map(|c| c["check"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["created", "waited", "diff"], "{checks:?}");
    for check in &checks {
        assert_eq!(check["ok"], true, "{check}");
    }
    let id = checks[0]["seen"]["loop_id"].as_str().expect("id");
    assert_eq!(p.state(id)["status"], "completed");
}

/// The conformance suite's server scenarios that loopd's MCP server passes; every other one
/// exercises the suite's own reference server (its `test_*` tools, `test://` resources, prompts,
/// completions, logging, sampling and elicitation), none of which loopd has (docs/mcp.md).
const CONFORMANT: &[&str] = &[
    "server-initialize",
    "ping",
    "tools-list",
    "tools-call-simple-text",
    "tools-call-error",
    "server-sse-multiple-streams",
    "resources-list",
    "dns-rebinding-protection",
];

/// Why each other scenario fails, as the suite says it: the reference server's feature it asks
/// for.
const NOT_LOOPDS: &[(&str, &str)] = &[
    ("logging-set-level", "logging/setLevel"),
    ("completion-complete", "completion/complete"),
    ("tools-call-image", "No image content"),
    ("tools-call-audio", "No audio content"),
    ("tools-call-embedded-resource", "No resource content"),
    (
        "tools-call-mixed-content",
        "Expected multiple content items",
    ),
    ("tools-call-with-logging", "logging/setLevel"),
    ("tools-call-with-progress", "No progress notifications"),
    ("tools-call-sampling", "did not request sampling"),
    ("tools-call-elicitation", "did not request elicitation"),
    (
        "elicitation-sep1034-defaults",
        "did not request elicitation",
    ),
    ("elicitation-sep1330-enums", "did not request elicitation"),
    ("resources-read-text", "no resource test://"),
    ("resources-read-binary", "no resource test://"),
    ("resources-templates-read", "no resource test://"),
    ("resources-subscribe", "no resource test://"),
    ("resources-unsubscribe", "no resource test://"),
    ("prompts-list", "prompts/list"),
    ("prompts-get-simple", "prompts/get"),
    ("prompts-get-with-args", "prompts/get"),
    ("prompts-get-embedded-resource", "prompts/get"),
    ("prompts-get-with-image", "prompts/get"),
];

#[test]
fn the_conformance_suites_server_scenarios_pass_but_those_of_its_own_reference_server() {
    let Some(dir) = common::installed(
        "LOOPD_MCP_CONFORMANCE_DIR",
        ".cache/loopd/mcp-conformance",
        "the MCP conformance suite",
        "npm install --prefix ~/.cache/loopd/mcp-conformance @modelcontextprotocol/conformance@0.1.16 node@22",
    ) else {
        return;
    };
    let p = Project::new(GOOD_AGENT);
    let service = p.serve(&["--listen", "127.0.0.1:0"]);
    let (_, addr, token) = http(&p, &service);
    // The suite cannot be given a header: a proxy adds the token.
    let port = addr.rsplit_once(':').expect("a port").1;
    let mut proxy = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/token_proxy.py"))
        .args([port, &token])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs the proxy");
    let mut proxied = String::new();
    std::io::BufReader::new(proxy.stdout.take().expect("stdout"))
        .read_line(&mut proxied)
        .expect("the proxy prints its port");
    let out_dir = tempfile::tempdir().expect("tempdir");
    let modules = dir.join("node_modules");
    let run = Command::new(modules.join(".bin/node"))
        .arg(modules.join("@modelcontextprotocol/conformance/dist/index.js"))
        .args(["server", "--url"])
        .arg(format!("http://localhost:{}/mcp", proxied.trim()))
        .arg("-o")
        .arg(out_dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the conformance suite");
    let out = common::wait_output(run, DEADLINE * 4);
    let _ = proxy.kill();
    let _ = proxy.wait();
    // Each scenario's checks, by the scenario's name (`server-NAME-TIMESTAMP/checks.json`).
    let mut passed = Vec::new();
    let mut failed = Vec::new();
    for entry in std::fs::read_dir(out_dir.path()).expect("the suite's results") {
        let path = entry.expect("an entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let name = name.strip_prefix("server-").unwrap_or(&name);
        let name = name.split("-20").next().unwrap_or(name).to_owned();
        let checks: Vec<Value> =
            serde_json::from_slice(&std::fs::read(path.join("checks.json")).expect("checks.json"))
                .expect("checks");
        let failures: Vec<String> = checks
            .iter()
            .filter(|c| c["status"] == "FAILURE")
            .map(|c| c["errorMessage"].as_str().unwrap_or("").to_owned())
            .collect();
        match failures.is_empty() {
            true => passed.push(name),
            false => failed.push((name, failures.join("; "))),
        }
    }
    passed.sort();
    let mut conformant: Vec<String> = CONFORMANT.iter().map(|s| s.to_string()).collect();
    conformant.sort();
    assert_eq!(passed, conformant, "{}", stdout(&out));
    assert_eq!(failed.len(), NOT_LOOPDS.len(), "{failed:#?}");
    for (name, why) in &failed {
        let expected = NOT_LOOPDS.iter().find(|(n, _)| n == name);
        let (_, said) = expected.unwrap_or_else(|| panic!("{name} failed: {why}"));
        assert!(why.contains(said), "{name} failed otherwise: {why}");
    }
}
