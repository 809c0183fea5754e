//! The service under load, on 127.0.0.1 only: 50 loops, 50 event-stream clients of which 10
//! never read, 20 API clients reading and pausing and resuming in a loop, the systemd notify
//! socket never drained, and (where a mount namespace can be made) one project whose disk is
//! full. Every request is answered, every loop that can finish finishes, the service's memory
//! and descriptors stay bounded, nothing is lost.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use serde_json::{Value, json};

const LOOPS: usize = 50;
const STREAMS: usize = 50;
const STALLED: usize = 10;
const API_CLIENTS: usize = 20;
const API_ROUNDS: usize = 8;

/// Quick actions: init plans two tasks, each action takes 50 ms, validation passes.
const AGENT: &str = r#"
cat > /dev/null
sleep 0.05
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"a"},{"description":"b"}]}}' > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","state_updates":{"passed":true}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success","summary":"done"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

/// An HTTP client of the service's TCP API, with its token.
#[derive(Clone)]
struct Api {
    addr: String,
    token: String,
}

impl Api {
    /// A request, with `body` as JSON where there is one.
    async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> hyper::Response<hyper::body::Incoming> {
        let stream = tokio::net::TcpStream::connect(&self.addr)
            .await
            .expect("connect");
        let io = hyper_util::rt::TokioIo::new(stream);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .expect("handshake");
        tokio::spawn(conn);
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "loopd")
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", self.token))
            .body(Full::new(Bytes::from(
                body.map(Value::to_string).unwrap_or_default(),
            )))
            .expect("request");
        sender.send_request(request).await.expect("send")
    }

    /// A whole request, answered within a generous bound: its status.
    async fn call(&self, method: &str, path: &str) -> u16 {
        let answered = tokio::time::timeout(DEADLINE, async {
            let response = self.send(method, path, None).await;
            let status = response.status().as_u16();
            let _ = response.into_body().collect().await;
            status
        })
        .await;
        answered.unwrap_or_else(|_| panic!("{method} {path}: no answer within {DEADLINE:?}"))
    }
}

/// The service's peak RSS (KiB) and open descriptors, now.
fn rss_and_fds(pid: u32) -> (u64, usize) {
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count);
    (rss, fds)
}

#[test]
fn the_service_under_load_answers_every_request_and_finishes_every_loop() {
    let first = Project::new(AGENT);
    let others: Vec<Project> = (1..LOOPS).map(|_| Project::beside(&first, AGENT)).collect();
    let projects: Vec<&Project> = std::iter::once(&first).chain(&others).collect();
    let ids: Vec<String> = projects
        .iter()
        .map(|p| p.create(&["--title", "load"]))
        .collect();
    // One more project, whose state directory is a tiny tmpfs in the service's own mount
    // namespace, filled once its loop runs.
    let full = common::can_mount().then(|| {
        // Its results on stdout (the disk is full); its second develop waits for `go`.
        let p = Project::beside(
            &first,
            &AGENT
                .replace("> \"$LOOPD_RESULT_FILE\"", "")
                .replace(
                    "  *)",
                    &format!(
                        "  develop) [ \"$LOOPD_TASK_ID\" = task-002 ] && {{ touch waiting; {}; }}\n    echo '{{\"status\":\"success\"}}' ;;\n  *)",
                        wait_for_file("go")
                    ),
                ),
        );
        p.config(&format!("state_dir = \".full\"\n{TEST_CONFIG}"));
        std::fs::create_dir_all(p.root.join(".full")).expect("mkdir .full");
        p
    });
    if full.is_none() {
        eprintln!("no mount namespace here: the full disk is left out");
    }
    let notify_path = first.root.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("bind the notify socket");
    let mut roots: Vec<String> = projects
        .iter()
        .copied()
        .chain(full.iter())
        .flat_map(|p| ["--root".to_owned(), p.root.display().to_string()])
        .collect();
    roots.extend(["--listen".to_owned(), "127.0.0.1:0".to_owned()]);
    let full_state = full.as_ref().map(|p| p.root.join(".full"));
    let service = first.serve_with(&roots, |cmd| {
        cmd.env("NOTIFY_SOCKET", &notify_path)
            .env("WATCHDOG_USEC", "100000");
        if let Some(dir) = &full_state {
            common::in_tmpfs(cmd, dir, "256k");
            cmd.stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
        }
    });
    let info = service.info().expect("info");
    let pid = info["pid"].as_u64().expect("pid") as u32;
    let api = Api {
        addr: info["listen"].as_str().expect("listen").to_owned(),
        token: std::fs::read_to_string(first.home.join(".local/state/loopd/run/token"))
            .expect("token"),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");

    // The loop on the full disk: made and started through the API, then its disk filled.
    let full_loop = full.as_ref().map(|p| {
        let body = json!({"root": p.root, "title": "full"});
        let id = rt.block_on(async {
            let response = api.send("POST", "/v1/loops", Some(&body)).await;
            assert_eq!(response.status(), 201);
            let bytes = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            let created: Value = serde_json::from_slice(&bytes).expect("json");
            created["loop_id"].as_str().expect("loop_id").to_owned()
        });
        assert_eq!(
            rt.block_on(api.call("POST", &format!("/v1/loops/{id}/resume"))),
            200
        );
        // Seen from the service's namespace.
        let dir = PathBuf::from(format!("/proc/{pid}/root"))
            .join(p.root.join(".full").strip_prefix("/").expect("absolute"));
        wait_for("the full disk's loop to reach its second develop", || {
            p.root.join("waiting").exists()
        });
        // Filled to the last byte; then the action ends, and its record finds no room.
        let mut filler = std::fs::File::create(dir.join("filler")).expect("filler");
        let chunk = vec![0u8; 1024];
        while std::io::Write::write_all(&mut filler, &chunk).is_ok() {}
        std::fs::write(p.root.join("go"), "").expect("go");
        (id, dir)
    });

    let stop = Arc::new(AtomicBool::new(false));
    let events_read = Arc::new(AtomicUsize::new(0));
    let (stalled, readers) = rt.block_on(async {
        let mut stalled = Vec::new();
        let mut readers = Vec::new();
        for i in 0..STREAMS {
            let response = api.send("GET", "/v1/stream", None).await;
            assert_eq!(response.status(), 200);
            if i < STALLED {
                // Its body is never read: once the socket's buffers are full, the service's
                // writes to it make no progress.
                stalled.push(response);
                continue;
            }
            let (stop, read) = (stop.clone(), events_read.clone());
            readers.push(tokio::spawn(async move {
                let mut body = response.into_body();
                while !stop.load(Ordering::SeqCst) {
                    match tokio::time::timeout(Duration::from_millis(200), body.frame()).await {
                        Ok(Some(Ok(frame))) => {
                            if let Some(data) = frame.data_ref() {
                                read.fetch_add(data.len(), Ordering::SeqCst);
                            }
                        }
                        Ok(_) => break,
                        Err(_) => {}
                    }
                }
            }));
        }
        (stalled, readers)
    });

    // Every loop set running; then the API clients, each pausing and resuming its loops.
    for (p, id) in projects.iter().zip(&ids) {
        set_status(p, id, "running");
    }
    let mut peak = (0, 0);
    let clients = rt.block_on(async {
        let mut clients = Vec::new();
        for c in 0..API_CLIENTS {
            let (api, ids) = (api.clone(), ids.clone());
            clients.push(tokio::spawn(async move {
                let mut answers = Vec::new();
                for round in 0..API_ROUNDS {
                    let id = &ids[(c + round * API_CLIENTS) % ids.len()];
                    answers.push(api.call("GET", "/v1/loops").await);
                    answers.push(api.call("GET", &format!("/v1/loops/{id}")).await);
                    answers.push(api.call("POST", &format!("/v1/loops/{id}/pause")).await);
                    answers.push(api.call("POST", &format!("/v1/loops/{id}/resume")).await);
                }
                answers
            }));
        }
        clients
    });
    let deadline = Instant::now() + 4 * DEADLINE;
    while !clients.iter().all(tokio::task::JoinHandle::is_finished) {
        assert!(Instant::now() < deadline, "the API clients did not finish");
        let now = rss_and_fds(pid);
        peak = (peak.0.max(now.0), peak.1.max(now.1));
        std::thread::sleep(Duration::from_millis(20));
    }
    for client in clients {
        let answers = rt.block_on(client).expect("client");
        // A pause or resume may come after the loop completed: a refusal is an answer too.
        assert!(
            answers.iter().all(|s| *s == 200 || (400..500).contains(s)),
            "{answers:?}"
        );
    }
    // A loop a client paused last was resumed by it; any left paused by a race goes on now.
    for (p, id) in projects.iter().zip(&ids) {
        if p.state(id)["status"] == "paused" {
            assert!(p.output(&["resume", id]).status.success());
        }
    }
    for (p, id) in projects.iter().zip(&ids) {
        wait_for(&format!("loop {id} to complete"), || {
            let now = rss_and_fds(pid);
            peak = (peak.0.max(now.0), peak.1.max(now.1));
            p.state(id)["status"] == "completed"
        });
        assert_eq!(p.state(id)["skill_state"]["outcome"], "passed");
        let developed = p.developed(id);
        assert_eq!(developed, ["task-001", "task-002"], "{id}");
    }
    stop.store(true, Ordering::SeqCst);
    for reader in readers {
        rt.block_on(reader).expect("reader");
    }
    assert!(
        events_read.load(Ordering::SeqCst) > 0,
        "the reading clients heard the loops"
    );
    drop(stalled);

    // The loop on the full disk held nobody up; once there is room it goes on, and its
    // record has every event, the ones the full disk held back among them.
    if let Some((id, dir)) = &full_loop {
        let state: Value =
            serde_json::from_slice(&std::fs::read(dir.join(format!("{id}.json"))).unwrap())
                .expect("its state file parses");
        assert_ne!(state["status"], "failed", "{state}");
        std::fs::remove_file(dir.join("filler")).expect("free the disk");
        wait_for("the full disk's loop to complete", || {
            std::fs::read(dir.join(format!("{id}.json")))
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .is_some_and(|s| s["status"] == "completed")
        });
        let developed: Vec<String> =
            std::fs::read_to_string(dir.join(format!("{id}.progress/events.jsonl")))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).expect("every event line parses"))
                .filter(|e| e["event"] == "action_finished" && e["action"] == "develop")
                .map(|e| e["task_id"].as_str().unwrap_or("").to_owned())
                .collect();
        assert_eq!(developed, ["task-001", "task-002"]);
    }
    // Bounded: generous ceilings that catch a leak, not measurements.
    let (rss_kib, fds) = peak;
    assert!(
        rss_kib < 256 * 1024,
        "the service's peak RSS: {rss_kib} KiB"
    );
    assert!(fds < 4096, "the service's open descriptors: {fds}");
    eprintln!("load: peak RSS {} MiB, {fds} descriptors", rss_kib / 1024);
    drop(notify);
    let out = service.stop();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    if let Some(p) = &full {
        // Said in the service's log, once, naming the file: why that loop's writes failed.
        let log = stderr(&out);
        let said = log
            .lines()
            .filter(|l| l.contains("No space left on device"))
            .collect::<Vec<_>>();
        assert!(
            said.iter()
                .any(|l| l.contains(&p.root.display().to_string())),
            "{log}"
        );
    }
}
