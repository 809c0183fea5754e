//! The service's local API through the real binary, with a real HTTP client (hyper): every
//! route of the OpenAPI document, over the Unix socket and over TCP with the token; bad requests
//! get a 4xx with a JSON error and change nothing.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use common::http::{To, call, fetch, runtime, send};
use common::*;
use http_body_util::BodyExt as _;
use serde_json::{Value, json};

/// A stream of Server-Sent Events, open: the server has answered (and subscribed).
struct Events {
    rt: tokio::runtime::Runtime,
    response: hyper::Response<hyper::body::Incoming>,
    text: String,
}

impl Events {
    fn open(to: &To<'_>, path: &str, last_id: Option<&str>) -> Events {
        let rt = runtime();
        let headers: Vec<(&str, &str)> = last_id
            .map(|id| ("last-event-id", id))
            .into_iter()
            .collect();
        let response = rt.block_on(send(to, "GET", path, None, &headers));
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        Events {
            rt,
            response,
            text: String::new(),
        }
    }

    /// The next `n` events with data: each one's id (empty when it has none) and data.
    fn next(&mut self, n: usize) -> Vec<(String, Value)> {
        self.next_events(n)
            .into_iter()
            .map(|e| (e.id, e.data))
            .collect()
    }

    /// The next `n` events with data, named.
    fn next_events(&mut self, n: usize) -> Vec<Sse> {
        let Events { rt, response, text } = self;
        rt.block_on(async {
            let mut events = Vec::new();
            while events.len() < n {
                while let Some(end) = text.find("\n\n") {
                    let block: String = text.drain(..end + 2).collect();
                    let (mut event, mut id, mut data) = ("message".to_owned(), String::new(), None);
                    for line in block.lines() {
                        if let Some(v) = line.strip_prefix("event:") {
                            event = v.trim().to_owned();
                        }
                        if let Some(v) = line.strip_prefix("id:") {
                            id = v.trim().to_owned();
                        }
                        if let Some(v) = line.strip_prefix("data:") {
                            data = Some(serde_json::from_str(v.trim()).expect("data is JSON"));
                        }
                    }
                    if let Some(data) = data {
                        events.push(Sse { event, id, data });
                    }
                }
                if events.len() >= n {
                    break;
                }
                let frame = tokio::time::timeout(DEADLINE, response.body_mut().frame())
                    .await
                    .expect("no event within the deadline")
                    .expect("the stream ended")
                    .expect("frame");
                if let Some(data) = frame.data_ref() {
                    text.push_str(&String::from_utf8_lossy(data));
                }
            }
            events
        })
    }

    /// The events up to the first that `done` holds of, that one included, within [`DEADLINE`].
    fn until(&mut self, what: &str, mut done: impl FnMut(&Sse) -> bool) -> Vec<Sse> {
        let deadline = std::time::Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        loop {
            let names: Vec<&str> = seen.iter().map(|e: &Sse| e.event.as_str()).collect();
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}; seen: {names:?}"
            );
            let event = self.next_events(1).remove(0);
            let found = done(&event);
            seen.push(event);
            if found {
                return seen;
            }
        }
    }
}

/// One Server-Sent Event: its name (`message` when it has none), its id (empty when it has
/// none) and its data.
#[derive(Clone, Debug)]
struct Sse {
    event: String,
    id: String,
    data: Value,
}

impl Sse {
    /// An `output` event's text, else nothing.
    fn output(&self) -> &str {
        match self.event.as_str() {
            "output" => self.data["text"].as_str().unwrap_or(""),
            _ => "",
        }
    }
}

/// The first `n` events of `path`.
fn sse(to: &To<'_>, path: &str, last_id: Option<&str>, n: usize) -> Vec<(String, Value)> {
    Events::open(to, path, last_id).next(n)
}

fn socket(service: &Service) -> PathBuf {
    PathBuf::from(
        service.info().expect("info")["socket"]
            .as_str()
            .expect("socket"),
    )
}

/// Asks `needs_input` at its first develop; answered, it succeeds. Validate waits for `go`.
fn asking_agent() -> String {
    format!(
        "prompt=$(cat)\n\
         if [ \"$LOOPD_ACTION\" = develop ] && [ ! -f asked ]; then touch asked; \
           echo '{{\"status\":\"needs_input\",\"summary\":\"a choice\",\"question\":\"Postgres or SQLite?\"}}' > \"$LOOPD_RESULT_FILE\"; exit 0; fi\n\
         if [ \"$LOOPD_ACTION\" = validate ]; then echo validating; echo $$ > agent.pid; {}; fi\n\
         echo \"$prompt\" > /dev/null\n{GOOD_AGENT}",
        wait_for_file("go")
    )
}

#[test]
fn every_route_works_over_the_unix_socket() {
    let p = Project::new(&asking_agent());
    // A git project: the loop's checkpoints are served too.
    // The state dir, and the user's (`$HOME` is the root) where the service keeps its files.
    std::fs::write(p.root.join(".gitignore"), ".loop/\n.local/\n").unwrap();
    git(&p.root, &["init", "--quiet"]);
    git(&p.root, &["add", "."]);
    git(&p.root, &["commit", "--quiet", "-m", "base"]);
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    let path = socket(&service);
    let to = To::Socket(&path);
    let mut tested = BTreeSet::new();
    let mut hit = |route: &str| {
        tested.insert(route.to_owned());
    };

    let (status, doc) = call(&to, "GET", "/openapi.json", None);
    assert_eq!(status, 200);
    let kept: Value =
        serde_json::from_str(include_str!("../crates/serve/src/openapi.json")).unwrap();
    assert_eq!(doc, kept);
    hit("/openapi.json");
    let (status, metrics) = fetch(&to, "GET", "/metrics", None, &[]);
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics.contains("# TYPE loopd_control_to_executor_gone_seconds histogram"),
        "{metrics}"
    );
    hit("/metrics");

    // Changes of served loops, live: one comes when a loop is created below.
    let mut changes = Events::open(&to, "/v1/stream", None);
    let (status, info) = call(&to, "GET", "/v1/service", None);
    assert_eq!((status, info["roots"][0].as_str()), (200, p.root.to_str()));
    hit("/v1/service");

    let root = p.root.to_str().unwrap();
    let (status, created) = call(
        &to,
        "POST",
        "/v1/loops",
        Some(json!({ "root": root, "title": "from the API", "tasks": ["first"] })),
    );
    assert_eq!(status, 201, "{created}");
    let id = created["loop_id"].as_str().expect("id").to_owned();
    assert_eq!(p.state(&id)["title"], "from the API");
    let change = changes.next(1);
    assert_eq!(change[0].1["loop_id"], id.as_str(), "{change:?}");
    assert_eq!(change[0].1["root"], root, "{change:?}");
    hit("/v1/stream");
    let (status, listed) = call(&to, "GET", "/v1/loops", None);
    assert_eq!(status, 200);
    assert_eq!(listed[0]["view"]["loop_id"], id.as_str());
    assert_eq!(listed[0]["status"], "created");
    hit("/v1/loops");

    let (status, added) = call(
        &to,
        "POST",
        &format!("/v1/loops/{id}/tasks"),
        Some(json!({ "text": "second" })),
    );
    assert_eq!(
        (status, added["task_id"].as_str()),
        (201, Some("task-002")),
        "{added}"
    );
    // A task may say which it needs done first: a task of the loop.
    let tasks = format!("/v1/loops/{id}/tasks");
    let (status, refused) = call(
        &to,
        "POST",
        &tasks,
        Some(json!({ "text": "third", "after": ["task-009"] })),
    );
    assert_eq!(status, 400, "{refused}");
    assert!(refused.to_string().contains("no such task"), "{refused}");
    let (status, added) = call(
        &to,
        "POST",
        &tasks,
        Some(json!({ "text": "third", "after": ["task-002"] })),
    );
    assert_eq!((status, added["task_id"].as_str()), (201, Some("task-003")));
    hit("/v1/loops/{id}/tasks");

    let (status, set) = call(
        &to,
        "POST",
        &format!("/v1/loops/{id}/limits"),
        Some(json!({ "max_cost_usd": 2.5, "max_tokens": 1_000_000 })),
    );
    assert_eq!(
        (status, &set["set"]),
        (
            200,
            &json!({ "max_cost_usd": 2.5, "max_tokens": 1_000_000 })
        ),
        "{set}"
    );
    let state = p.state(&id);
    assert_eq!(
        (&state["max_cost_usd"], &state["max_tokens"]),
        (&json!(2.5), &json!(1_000_000))
    );
    hit("/v1/loops/{id}/limits");

    let (status, resumed) = call(&to, "POST", &format!("/v1/loops/{id}/resume"), None);
    assert_eq!(
        (status, &resumed["status"]),
        (200, &json!("running")),
        "{resumed}"
    );
    hit("/v1/loops/{id}/resume");
    wait_for("the question", || {
        p.state(&id)["skill_state"]["question"]["text"] == "Postgres or SQLite?"
    });
    let (status, answered) = call(
        &to,
        "POST",
        &format!("/v1/loops/{id}/answer"),
        Some(json!({ "text": "SQLite" })),
    );
    assert_eq!(
        (status, &answered["answer"]),
        (200, &json!("SQLite")),
        "{answered}"
    );
    hit("/v1/loops/{id}/answer");

    // Validate waits for `go`: its output is the attempt's tail.
    read_pid(&p.root.join("agent.pid"));
    let mut tail = Value::Null;
    wait_for("the tail of validate's log", || {
        let (status, t) = call(&to, "GET", &format!("/v1/loops/{id}/tail"), None);
        tail = t;
        status == 200
            && tail["text"]
                .as_str()
                .is_some_and(|t| t.contains("validating"))
    });
    assert_eq!(tail["in_flight"]["action"], "validate", "{tail}");
    hit("/v1/loops/{id}/tail");

    // The same output, pushed: the attempt, then its log.
    let mut output = Events::open(&to, &format!("/v1/loops/{id}/output"), None);
    let seen = output.until("validate's output", |e| e.output().contains("validating"));
    assert_eq!(
        (seen[0].event.as_str(), &seen[0].data["action"]),
        ("attempt", &json!("validate")),
        "{seen:?}"
    );
    hit("/v1/loops/{id}/output");
    drop(output);

    let (status, one) = call(&to, "GET", &format!("/v1/loops/{id}"), None);
    assert_eq!(status, 200);
    assert_eq!(one["state"]["loop_id"], id.as_str());
    assert_eq!(
        one["view"]["action"]
            .as_str()
            .map(|a| a.starts_with("validate")),
        Some(true)
    );
    hit("/v1/loops/{id}");

    let (status, paused) = call(&to, "POST", &format!("/v1/loops/{id}/pause"), None);
    assert_eq!(
        (status, &paused["status"]),
        (200, &json!("paused")),
        "{paused}"
    );
    assert_eq!(p.state(&id)["status"], "paused");
    hit("/v1/loops/{id}/pause");

    // Its checkpoints, from where it started, and what the last one changed.
    let (status, listed) = call(&to, "GET", &format!("/v1/loops/{id}/checkpoints"), None);
    assert_eq!(status, 200, "{listed}");
    let checkpoints = listed["checkpoints"]
        .as_array()
        .expect("checkpoints")
        .clone();
    assert_eq!(checkpoints[0]["name"], "0-start", "{listed}");
    hit("/v1/loops/{id}/checkpoints");
    let last = checkpoints.last().expect("a checkpoint");
    let name = last["name"].as_str().expect("name");
    let (status, diff) = call(
        &to,
        "GET",
        &format!("/v1/loops/{id}/checkpoints/{name}/diff"),
        None,
    );
    assert_eq!(status, 200, "{diff}");
    assert_eq!(
        (&diff["checkpoint"], &diff["to"]),
        (&last["name"], &last["commit"])
    );
    assert!(diff["files"].is_array(), "{diff}");
    hit("/v1/loops/{id}/checkpoints/{name}/diff");

    // The events so far, then from the middle on with Last-Event-ID: nothing twice.
    let events_path = format!("/v1/loops/{id}/events");
    let first = sse(&to, &events_path, None, 4);
    assert_eq!(first[0].1, p.events(&id)[0], "{first:?}");
    let rest = sse(&to, &events_path, Some(&first[1].0), 2);
    assert_eq!(rest[0], first[2]);
    assert_eq!(rest[1], first[3]);
    hit("/v1/loops/{id}/events");

    // Live: an event written after the stream opened comes on it. The paused loop's task has
    // ended first (its last event), so nothing of the pause comes after the stream opens.
    wait_for("the service to let the paused loop go", || {
        p.event_names(&id).last().map(String::as_str) == Some("daemon_exited")
    });
    let count = p.events(&id).len();
    let last = {
        let all = sse(&to, &events_path, None, count);
        all.last().expect("events").0.clone()
    };
    let mut stream = Events::open(&to, &events_path, Some(&last));
    let (status, _) = call(&to, "POST", &format!("/v1/loops/{id}/resume"), None);
    assert_eq!(status, 200);
    let live = stream.next(1);
    assert!(
        ["resumed", "daemon_started"].contains(&live[0].1["event"].as_str().unwrap_or("")),
        "{live:?}"
    );

    let (status, stopped) = call(&to, "POST", &format!("/v1/loops/{id}/stop"), None);
    assert_eq!(
        (status, &stopped["status"]),
        (200, &json!("failed")),
        "{stopped}"
    );
    hit("/v1/loops/{id}/stop");
    wait_for("the stop to end the attempt", || {
        p.state(&id)["skill_state"]["in_flight"].is_null()
    });

    // Stopped: its work tree back where it started, and on again.
    let_go(&to, &id);
    let (status, back) = call(
        &to,
        "POST",
        &format!("/v1/loops/{id}/rollback"),
        Some(json!({ "checkpoint": "0-start", "force": true })),
    );
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["commit"], checkpoints[0]["commit"], "{back}");
    assert!(!p.root.join("asked").exists(), "made after the start");
    hit("/v1/loops/{id}/rollback");
    // A validate run again ends at once.
    std::fs::write(p.root.join("go"), "").unwrap();
    let (status, retried) = call(&to, "POST", &format!("/v1/loops/{id}/retry"), None);
    assert_eq!(
        (status, &retried["from"], &retried["status"]),
        (200, &json!("failed"), &json!("running")),
        "{retried}"
    );
    hit("/v1/loops/{id}/retry");

    let (status, _) = call(
        &to,
        "POST",
        "/v1/loops",
        Some(json!({ "root": root, "title": "interactive", "interactive": true })),
    );
    assert_eq!(status, 201);
    let interactive = p.output(&["--json", "list"]).stdout;
    let interactive: Value = serde_json::from_slice(&interactive).expect("list");
    let iid = interactive
        .as_array()
        .and_then(|l| l.iter().find(|s| s["title"] == "interactive"))
        .and_then(|s| s["loop_id"].as_str())
        .expect("the interactive loop")
        .to_owned();
    let (status, chosen) = call(
        &to,
        "POST",
        &format!("/v1/loops/{iid}/next"),
        Some(json!({ "action": "init" })),
    );
    assert_eq!(
        (status, &chosen["next_action"]),
        (200, &json!("init")),
        "{chosen}"
    );
    assert_eq!(p.state(&iid)["next_action"], "init");
    hit("/v1/loops/{id}/next");

    let documented: BTreeSet<String> = doc["paths"]
        .as_object()
        .expect("paths")
        .keys()
        .cloned()
        .collect();
    assert_eq!(tested, documented, "every route in the document has a test");
}

#[test]
fn bad_requests_get_a_4xx_with_a_json_error_and_change_nothing() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    let path = socket(&service);
    let to = To::Socket(&path);
    let before = std::fs::read(p.state_path(&id)).expect("state");
    let root = p.root.to_str().unwrap();
    let cases: Vec<(&str, String, Option<Value>, u16)> = vec![
        ("GET", "/v1/nothing".into(), None, 404),
        ("DELETE", "/v1/loops".into(), None, 405),
        ("GET", "/v1/loops/no-such-loop".into(), None, 404),
        ("POST", format!("/v1/loops/{id}/frobnicate"), None, 404),
        ("GET", "/v1/loops/..%2F..%2Fetc".into(), None, 400),
        (
            "POST",
            format!("/v1/loops/{id}/pause?root=/elsewhere"),
            None,
            400,
        ),
        ("GET", format!("/v1/loops/{id}?color=red"), None, 400),
        (
            "POST",
            "/v1/loops".into(),
            Some(json!({ "root": "/" , "title": "x" })),
            400,
        ),
        (
            "POST",
            "/v1/loops".into(),
            Some(json!({ "root": root })),
            400,
        ),
        (
            "POST",
            "/v1/loops".into(),
            Some(json!({ "root": root, "title": "x", "max_iterations": 0 })),
            400,
        ),
        (
            "POST",
            "/v1/loops".into(),
            Some(json!({ "root": root, "title": "x", "colour": 1 })),
            422,
        ),
        (
            "POST",
            "/v1/loops".into(),
            Some(json!("not an object")),
            422,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/next"),
            Some(json!({ "action": "develop" })),
            400,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/answer"),
            Some(json!({ "text": "why?" })),
            400,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/answer"),
            Some(json!({})),
            422,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/tasks"),
            Some(json!({ "text": "  " })),
            400,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/limits"),
            Some(json!({})),
            400,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/limits"),
            Some(json!({ "max_tokens": 0 })),
            400,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/limits"),
            Some(json!({ "budget": 1 })),
            422,
        ),
        ("GET", format!("/v1/loops/{id}/tail?bytes=-1"), None, 400),
        ("GET", format!("/v1/loops/{id}/events?after=x"), None, 400),
        // Not a git project: no checkpoints, in one line.
        ("GET", format!("/v1/loops/{id}/checkpoints"), None, 400),
        (
            "GET",
            format!("/v1/loops/{id}/checkpoints/0-start/diff"),
            None,
            400,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/rollback"),
            Some(json!({ "checkpoint": "0-start" })),
            400,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/rollback"),
            Some(json!({ "checkpoint": "0-start", "hard": true })),
            422,
        ),
        (
            "POST",
            format!("/v1/loops/{id}/rollback"),
            Some(json!({})),
            422,
        ),
        (
            "GET",
            "/v1/loops/no-such-loop/checkpoints".into(),
            None,
            404,
        ),
        ("POST", "/v1/loops/no-such-loop/retry".into(), None, 404),
        ("GET", "/v1/loops/no-such-loop/output".into(), None, 404),
        // Retry is for a loop that failed or was stopped.
        ("POST", format!("/v1/loops/{id}/retry"), None, 400),
    ];
    for (method, route, body, want) in cases {
        let (status, value) = call(&to, method, &route, body.clone());
        assert_eq!(status, want, "{method} {route} {body:?}: {value}");
        assert!(
            value["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{value}"
        );
    }
    for (path, why) in [
        (
            format!("/v1/loops/{id}/checkpoints"),
            "not in a git repository",
        ),
        (
            format!("/v1/loops/{id}/retry"),
            "retry is for a failed or stopped loop",
        ),
    ] {
        let method = if path.ends_with("retry") {
            "POST"
        } else {
            "GET"
        };
        let (_, value) = call(&to, method, &path, None);
        let error = value["error"].as_str().unwrap_or_default();
        assert!(error.contains(why) && !error.contains('\n'), "{value}");
    }
    // The output's Last-Event-ID is LOG:OFFSET.
    for bad in ["7", "x.log", "../x.log:1", "x.log:-1"] {
        let (status, text) = common::http::fetch(
            &to,
            "GET",
            &format!("/v1/loops/{id}/output"),
            None,
            &[("last-event-id", bad)],
        );
        assert_eq!(status, 400, "{bad}: {text}");
    }
    // A body that is not JSON at all, and one without its content type.
    let raw = runtime().block_on(async {
        let r = send(&to, "POST", "/v1/loops", Some("{"), &[]).await;
        r.status().as_u16()
    });
    assert_eq!(raw, 400);
    assert_eq!(std::fs::read(p.state_path(&id)).expect("state"), before);
    let (_, listed) = call(&to, "GET", "/v1/loops", None);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
}

#[test]
fn over_tcp_every_request_needs_the_token() {
    let p = Project::new(GOOD_AGENT);
    let service = p.serve(&["--listen", "127.0.0.1:0"]);
    let info = service.info().expect("info");
    let addr = info["listen"].as_str().expect("listen").to_owned();
    let token_file = p.home.join(".local/state/loopd/run/token");
    let token = std::fs::read_to_string(&token_file).expect("token");
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&token_file)
        .expect("stat")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    for route in ["/v1/service", "/openapi.json", "/v1/loops"] {
        let (status, value) = call(&To::Tcp(&addr, None), "GET", route, None);
        assert_eq!(status, 401, "{route}: {value}");
        let (status, _) = call(&To::Tcp(&addr, Some("wrong")), "GET", route, None);
        assert_eq!(status, 401, "{route}");
        let (status, _) = call(&To::Tcp(&addr, Some(token.trim())), "GET", route, None);
        assert_eq!(status, 200, "{route}");
    }
    let out = p.output(&["serve", "--listen", "0.0.0.0:0"]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("loopback"), "{}", stderr(&out));
    drop(service);
}

/// Waits until no daemon drives loop `id` (the service let it go: its lock too).
fn let_go(to: &To<'_>, id: &str) {
    wait_for("the service to let the loop go", || {
        let (status, one) = call(to, "GET", &format!("/v1/loops/{id}"), None);
        status == 200 && one["view"]["daemon_pid"].is_null()
    });
}

/// A service of `p`'s own, and the path of its socket.
fn serve_alone(p: &Project) -> (Service, PathBuf) {
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    let path = socket(&service);
    (service, path)
}

/// The `output` events of `seen` whose log is `log`: each one's id is `LOG:END`, where END is
/// the offset after its text.
fn outputs_of<'a>(seen: &'a [Sse], log: &str) -> Vec<&'a Sse> {
    let of_log: Vec<&Sse> = seen
        .iter()
        .filter(|e| e.event == "output" && e.data["log"] == log)
        .collect();
    for e in &of_log {
        let start = e.data["offset"].as_u64().expect("offset");
        let end = start + e.output().len() as u64;
        assert_eq!(e.id, format!("{log}:{end}"), "{e:?}");
    }
    of_log
}

#[test]
fn an_attempts_output_comes_as_it_is_written_and_a_reconnection_goes_on_where_it_left() {
    let complete = format!(
        "echo 'first line'; {}; echo 'second line'; {}; echo 'third line'; {}",
        wait_for_file("go1"),
        wait_for_file("go2"),
        wait_for_file("go3")
    );
    let p = Project::new(&agent(&[("complete", &complete)]));
    git(&p.root, &["init", "--quiet"]);
    let id = p.create(&["--title", "t"]);
    let (_service, path) = serve_alone(&p);
    let to = To::Socket(&path);
    let route = format!("/v1/loops/{id}/output");

    // Nothing in flight yet; then the loop runs, attempt after attempt.
    let mut stream = Events::open(&to, &route, None);
    assert_eq!(stream.next_events(1)[0].event, "idle");
    let (status, _) = call(&to, "POST", &format!("/v1/loops/{id}/resume"), None);
    assert_eq!(status, 200);
    let seen = stream.until("the first line", |e| e.output().contains("first line"));
    let attempt = seen
        .iter()
        .rfind(|e| e.event == "attempt")
        .expect("the attempt came first");
    assert_eq!(attempt.data["action"], "complete", "{attempt:?}");
    let log = attempt.data["log"].as_str().expect("its log").to_owned();
    assert_eq!(outputs_of(&seen, &log).len(), 1);

    // While it runs, its work tree is not rolled back.
    let (status, refused) = call(
        &to,
        "POST",
        &format!("/v1/loops/{id}/rollback"),
        Some(json!({ "checkpoint": "0-start" })),
    );
    assert_eq!(status, 400, "{refused}");
    let error = refused["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&format!("loop {id} is running (daemon "))
            && error.ends_with(&format!("pause it first: loopd pause {id}")),
        "{refused}"
    );

    std::fs::write(p.root.join("go1"), "").unwrap();
    let seen = stream.until("the second line", |e| e.output().contains("second line"));
    let last = outputs_of(&seen, &log).last().expect("output").id.clone();
    drop(stream);

    // Written while nobody listens: a reconnection with Last-Event-ID gets it, and only it.
    std::fs::write(p.root.join("go2"), "").unwrap();
    wait_for("the third line in the log", || {
        std::fs::read_to_string(p.progress(&id).join("actions").join(&log))
            .is_ok_and(|t| t.contains("third line"))
    });
    let mut stream = Events::open(&to, &route, Some(&last));
    let seen = stream.until("the third line", |e| e.output().contains("third line"));
    assert_eq!(seen[0].event, "attempt", "{seen:?}");
    assert_eq!(seen[0].data["log"], log.as_str());
    assert!(!seen.iter().any(|e| e.event == "skipped"), "{seen:?}");
    let resumed = outputs_of(&seen, &log);
    let from: u64 = last.rsplit_once(':').unwrap().1.parse().unwrap();
    assert_eq!(resumed[0].data["offset"], from, "{seen:?}");
    let text: String = resumed.iter().map(|e| e.output()).collect();
    assert_eq!(text, "third line\n", "nothing twice: {seen:?}");

    // The attempt ends: the loop is done.
    std::fs::write(p.root.join("go3"), "").unwrap();
    stream.until("idle", |e| e.event == "idle");
    wait_for("the loop to complete", || {
        p.state(&id)["status"] == "completed"
    });
}

#[test]
fn a_flooding_executor_gives_a_bounded_stream_that_says_what_it_skipped() {
    const FLOOD: u64 = 6_000_000;
    let complete = format!(
        "echo 'before the flood'; {}; yes 'one more line of a flood' | head -c {FLOOD}; \
         echo; echo 'after the flood'; {}",
        wait_for_file("go"),
        wait_for_file("done")
    );
    let p = Project::new(&agent(&[("complete", &complete)]));
    let id = p.create(&["--title", "t"]);
    let (_service, path) = serve_alone(&p);
    let to = To::Socket(&path);
    let mut stream = Events::open(&to, &format!("/v1/loops/{id}/output"), None);
    let (status, _) = call(&to, "POST", &format!("/v1/loops/{id}/resume"), None);
    assert_eq!(status, 200);
    let seen = stream.until("the output before the flood", |e| {
        e.output().contains("before the flood")
    });
    let log = seen
        .iter()
        .rfind(|e| e.event == "attempt")
        .and_then(|e| e.data["log"].as_str())
        .expect("the attempt and its log")
        .to_owned();
    let offset_of = |e: &Sse| -> u64 { e.id.rsplit_once(':').unwrap().1.parse().unwrap() };
    let before = offset_of(outputs_of(&seen, &log).last().expect("output"));

    std::fs::write(p.root.join("go"), "").unwrap();
    let flood = stream.until("the output after the flood", |e| {
        e.output().contains("after the flood")
    });
    let skipped: u64 = flood
        .iter()
        .filter(|e| e.event == "skipped" && e.data["log"] == log.as_str())
        .map(|e| e.data["bytes"].as_u64().expect("bytes"))
        .sum();
    let outputs = outputs_of(&flood, &log);
    let sent: u64 = outputs.iter().map(|e| e.output().len() as u64).sum();
    assert!(skipped > 0, "nothing skipped of a flood");
    assert!(
        sent < FLOOD / 4,
        "{sent} bytes of a {FLOOD}-byte flood sent: not bounded"
    );
    // Every byte of the log is either sent or said to be skipped, once.
    let end = offset_of(outputs.last().expect("output"));
    assert_eq!(before + skipped + sent, end);
    assert!(outputs.iter().all(|e| e.output().len() <= 16 * 1024));

    std::fs::write(p.root.join("done"), "").unwrap();
    stream.until("idle", |e| e.event == "idle");
}

/// Develop changes the tree: the first task edits `code.txt`, the second edits it again, adds a
/// file and deletes one.
const CHANGING_AGENT: &str = r#"
cat > /dev/null
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"one"},{"description":"two"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop)
    echo "$LOOPD_TASK_ID" >> code.txt
    if [ "$LOOPD_TASK_ID" = task-002 ]; then printf 'made\n' > new.txt; rm -f old.txt; fi
    echo '{"status":"success","summary":"did it"}' > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","state_updates":{"passed":true,"pass_rate":100}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

#[test]
fn checkpoints_a_diff_and_a_rollback_through_the_api() {
    let p = Project::new(CHANGING_AGENT);
    // The state dir, and the user's (`$HOME` is the root) where the service keeps its files.
    std::fs::write(p.root.join(".gitignore"), ".loop/\n.local/\n").unwrap();
    std::fs::write(p.root.join("code.txt"), "v1\n").unwrap();
    std::fs::write(p.root.join("old.txt"), "to be deleted\n").unwrap();
    git(&p.root, &["init", "--quiet"]);
    git(&p.root, &["add", "."]);
    git(&p.root, &["commit", "--quiet", "-m", "base"]);
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let (_service, path) = serve_alone(&p);
    let to = To::Socket(&path);

    let (status, listed) = call(&to, "GET", &format!("/v1/loops/{id}/checkpoints"), None);
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["loop_id"], id.as_str());
    let checkpoints = listed["checkpoints"].as_array().expect("checkpoints");
    let names: Vec<&str> = checkpoints
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["0-start", "1-develop", "2-develop"]);
    let cli: Value =
        serde_json::from_str(&stdout(&p.output(&["--json", "checkpoints", &id]))).unwrap();
    assert_eq!(
        &listed["checkpoints"], &cli,
        "as `loopd checkpoints --json`"
    );
    assert_eq!(
        (&checkpoints[2]["files"], &checkpoints[2]["insertions"]),
        (&json!(3), &json!(2)),
        "{listed}"
    );

    let (status, diff) = call(
        &to,
        "GET",
        &format!("/v1/loops/{id}/checkpoints/2-develop/diff"),
        None,
    );
    assert_eq!(status, 200, "{diff}");
    assert_eq!(diff["from"], checkpoints[1]["commit"]);
    assert_eq!(diff["to"], checkpoints[2]["commit"]);
    assert_eq!(diff["cut"], Value::Null);
    assert_eq!(
        diff["files"],
        json!([
            {
                "path": "code.txt", "old_path": null, "status": "modified",
                "insertions": 1, "deletions": 0, "cut": false,
                "hunks": [{ "header": "@@ -1,2 +1,3 @@", "lines": [" v1", " task-001", "+task-002"] }],
            },
            {
                "path": "new.txt", "old_path": null, "status": "added",
                "insertions": 1, "deletions": 0, "cut": false,
                "hunks": [{ "header": "@@ -0,0 +1 @@", "lines": ["+made"] }],
            },
            {
                "path": "old.txt", "old_path": null, "status": "deleted",
                "insertions": 0, "deletions": 1, "cut": false,
                "hunks": [{ "header": "@@ -1 +0,0 @@", "lines": ["-to be deleted"] }],
            },
        ]),
        "{diff:#}"
    );
    let (status, missing) = call(
        &to,
        "GET",
        &format!("/v1/loops/{id}/checkpoints/9-develop/diff"),
        None,
    );
    assert_eq!(status, 400, "{missing}");
    assert!(
        missing["error"]
            .as_str()
            .is_some_and(|e| e.contains("2-develop")),
        "the names it has: {missing}"
    );

    let (status, back) = call(
        &to,
        "POST",
        &format!("/v1/loops/{id}/rollback"),
        Some(json!({ "checkpoint": "1-develop" })),
    );
    assert_eq!(status, 200, "{back}");
    assert_eq!(
        back,
        json!({ "loop_id": id, "checkpoint": "1-develop", "commit": checkpoints[1]["commit"] })
    );
    let read = |f: &str| std::fs::read_to_string(p.root.join(f)).ok();
    assert_eq!(read("code.txt").as_deref(), Some("v1\ntask-001\n"));
    assert_eq!(read("old.txt").as_deref(), Some("to be deleted\n"));
    assert_eq!(read("new.txt"), None, "made after the checkpoint");
    assert_eq!(p.events_named(&id, "rolled_back").len(), 1);

    // A change no checkpoint holds is kept, unless forced.
    std::fs::write(p.root.join("code.txt"), "mine\n").unwrap();
    let rollback = |force: bool| {
        call(
            &to,
            "POST",
            &format!("/v1/loops/{id}/rollback"),
            Some(json!({ "checkpoint": "0-start", "force": force })),
        )
    };
    let (status, refused) = rollback(false);
    assert_eq!(status, 400, "{refused}");
    assert_eq!(read("code.txt").as_deref(), Some("mine\n"));
    let (status, _) = rollback(true);
    assert_eq!(status, 200);
    assert_eq!(read("code.txt").as_deref(), Some("v1\n"));
}

#[test]
fn a_failed_loop_is_retried_through_the_api_and_completes() {
    // Develop fails until the problem is fixed (the file `fixed`).
    let p = Project::new(&format!(
        "if [ \"$LOOPD_ACTION\" = develop ] && [ ! -f fixed ]; then cat > /dev/null; \
         echo '{{\"status\":\"failed\",\"summary\":\"no compiler\"}}' > \"$LOOPD_RESULT_FILE\"; exit 0; fi\n{GOOD_AGENT}"
    ));
    let id = p.create(&["--title", "t", "--max-errors", "1"]);
    assert_eq!(code(&p.run(&id, &[])), 4);
    assert_eq!(p.state(&id)["status"], "failed");
    let (_service, path) = serve_alone(&p);
    let to = To::Socket(&path);
    let retry = || call(&to, "POST", &format!("/v1/loops/{id}/retry"), None);

    std::fs::write(p.root.join("fixed"), "").unwrap();
    let (status, retried) = retry();
    assert_eq!(status, 200, "{retried}");
    assert_eq!(
        retried,
        json!({ "loop_id": id, "from": "failed", "status": "running", "tasks_reset": 1 })
    );
    wait_for("the retried loop to complete", || {
        p.state(&id)["status"] == "completed"
    });
    let state = p.state(&id);
    assert_eq!(state["skill_state"]["outcome"], "passed");
    assert_eq!(state["skill_state"]["error_count"], 0);

    // Completed: nothing to retry, and nothing changes.
    let_go(&to, &id);
    let before = std::fs::read(p.state_path(&id)).unwrap();
    let (status, refused) = retry();
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains("retry is for a failed or stopped loop")),
        "{refused}"
    );
    assert_eq!(std::fs::read(p.state_path(&id)).unwrap(), before);
}
