//! The service's local API through the real binary, with a real HTTP client (hyper): every
//! route of the OpenAPI document, over the Unix socket and over TCP with the token; bad requests
//! get a 4xx with a JSON error and change nothing.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use common::http::{To, call, runtime, send};
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
        let Events { rt, response, text } = self;
        rt.block_on(async {
            let mut events = Vec::new();
            while events.len() < n {
                while let Some(end) = text.find("\n\n") {
                    let block: String = text.drain(..end + 2).collect();
                    let (mut id, mut data) = (String::new(), None);
                    for line in block.lines() {
                        if let Some(v) = line.strip_prefix("id:") {
                            id = v.trim().to_owned();
                        }
                        if let Some(v) = line.strip_prefix("data:") {
                            data = Some(serde_json::from_str(v.trim()).expect("data is JSON"));
                        }
                    }
                    if let Some(data) = data {
                        events.push((id, data));
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
        serde_json::from_str(include_str!("../crates/file-driver/src/serve/openapi.json")).unwrap();
    assert_eq!(doc, kept);
    hit("/openapi.json");

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
    ];
    for (method, route, body, want) in cases {
        let (status, value) = call(&to, method, &route, body.clone());
        assert_eq!(status, want, "{method} {route} {body:?}: {value}");
        assert!(
            value["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{value}"
        );
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
