//! Benchmark: a status call (`loop_status`) through loopd's MCP server with LOOPD_BENCH_LOOPS
//! loops (200) in the project, over stdio (`loopd mcp`) and over streamable HTTP (`/mcp` on
//! `loopd serve`, which serves them): the round trip's p50 and p99 over LOOPD_BENCH_CALLS calls
//! (1000), and the peak memory of the process that serves them.
//!
//! `cargo bench --bench mcp`. The client is a plain JSON-RPC one (a line each way over stdio, a
//! POST each over HTTP), so the figures are the server's and the transport's.

mod common;

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Project, env_num, ms};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use serde_json::{Value, json};

const AGENT: &str = "cat > /dev/null\necho '{\"status\":\"success\"}' > \"$LOOPD_RESULT_FILE\"\n";

fn initialize() -> Value {
    json!({
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": { "name": "bench", "version": "1" },
        },
    })
}

fn initialized() -> Value {
    json!({ "jsonrpc": "2.0", "method": "notifications/initialized" })
}

fn status_call(n: usize, id: &str) -> Value {
    json!({
        "jsonrpc": "2.0", "id": n, "method": "tools/call",
        "params": { "name": "loop_status", "arguments": { "id": id } },
    })
}

/// p50 and p99 of `times`, in milliseconds.
fn percentiles(times: &mut [Duration]) -> (f64, f64) {
    times.sort();
    let at = |q: f64| ms(times[((times.len() as f64 - 1.0) * q).round() as usize]);
    (at(0.5), at(0.99))
}

/// The peak resident memory of process `pid`, in MiB.
fn peak_rss(pid: u32) -> f64 {
    common::status_kib(pid, "VmHWM:") as f64 / 1024.0
}

fn over_stdio(p: &Project, ids: &[String], calls: usize) -> (f64, f64, f64) {
    let mut child = p
        .loopd()
        .arg("mcp")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("loopd mcp");
    let mut input = child.stdin.take().expect("stdin");
    let mut output = BufReader::new(child.stdout.take().expect("stdout"));
    let mut send = |message: &Value| {
        writeln!(input, "{message}").expect("write");
        input.flush().expect("flush");
    };
    let mut answer = |n: usize| loop {
        let mut line = String::new();
        assert!(
            output.read_line(&mut line).expect("read") > 0,
            "loopd mcp ended"
        );
        let message: Value = serde_json::from_str(&line).expect("JSON");
        if message["id"] == n {
            assert!(message.get("error").is_none(), "{message}");
            return message;
        }
    };
    send(&initialize());
    answer(0);
    send(&initialized());
    let mut times = Vec::with_capacity(calls);
    for n in 1..=calls {
        let start = Instant::now();
        send(&status_call(n, &ids[n % ids.len()]));
        let said = answer(n);
        times.push(start.elapsed());
        assert_eq!(said["result"]["isError"], false, "{said}");
    }
    let rss = peak_rss(child.id());
    drop(child.stdin.take());
    let _ = child.kill();
    let _ = child.wait();
    let (p50, p99) = percentiles(&mut times);
    (p50, p99, rss)
}

fn over_http(p: &Project, ids: &[String], calls: usize) -> (f64, f64, f64) {
    let mut service = p
        .loopd()
        .args(["serve", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("loopd serve");
    let info_path = p.home.join(".local/state/loopd/run/serve.json");
    let deadline = Instant::now() + Duration::from_secs(30);
    let addr = loop {
        let info: Option<Value> = std::fs::read(&info_path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        if let Some(addr) = info.as_ref().and_then(|i| i["listen"].as_str()) {
            break addr.to_owned();
        }
        assert!(Instant::now() < deadline, "the service did not start");
        std::thread::sleep(Duration::from_millis(50));
    };
    let token = std::fs::read_to_string(p.home.join(".local/state/loopd/run/token"))
        .expect("token")
        .trim()
        .to_owned();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let times = runtime.block_on(async {
        let stream = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        // As HTTP clients do: a request is not held back for the last one's ACK.
        stream.set_nodelay(true).expect("nodelay");
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .expect("handshake");
        tokio::spawn(connection);
        let mut session: Option<String> = None;
        let mut post = async |message: Value| {
            let mut request = hyper::Request::post("/mcp")
                .header("host", addr.as_str())
                .header("authorization", format!("Bearer {token}"))
                .header("content-type", "application/json")
                .header("accept", "application/json, text/event-stream");
            if let Some(s) = &session {
                request = request.header("mcp-session-id", s);
            }
            let request = request
                .body(Full::new(Bytes::from(message.to_string())))
                .expect("request");
            let response = sender.send_request(request).await.expect("send");
            if let Some(s) = response.headers().get("mcp-session-id") {
                session = Some(s.to_str().expect("session").to_owned());
            }
            let body = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            let text = String::from_utf8_lossy(&body).into_owned();
            // An answer as JSON, or as the data of a server-sent event.
            text.lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .chain(std::iter::once(text.as_str()))
                .find_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        };
        post(initialize()).await.expect("initialized");
        post(initialized()).await;
        let mut times = Vec::with_capacity(calls);
        for n in 1..=calls {
            let start = Instant::now();
            let said = post(status_call(n, &ids[n % ids.len()]))
                .await
                .expect("an answer");
            times.push(start.elapsed());
            assert_eq!(said["result"]["isError"], false, "{said}");
        }
        times
    });
    let rss = peak_rss(service.id());
    let _ = service.kill();
    let _ = service.wait();
    let mut times = times;
    let (p50, p99) = percentiles(&mut times);
    (p50, p99, rss)
}

fn main() {
    let loops = env_num("LOOPD_BENCH_LOOPS", 200);
    let calls = env_num("LOOPD_BENCH_CALLS", 1000);
    let config = common::config(&["sh", "bin/agent.sh"], "stdin", "json", None);
    let p = Project::new(&config, Some(AGENT));
    let ids: Vec<String> = (0..loops).map(|_| p.create(1)).collect();
    println!(
        "\n`loop_status` through loopd's MCP server, {loops} loops in the project, {calls} calls:\n"
    );
    println!("| transport | p50 | p99 | peak RSS of the server |");
    println!("|---|---|---|---|");
    let (p50, p99, rss) = over_stdio(&p, &ids, calls);
    println!("| stdio (`loopd mcp`) | {p50:.2} ms | {p99:.2} ms | {rss:.1} MiB |");
    let (p50, p99, rss) = over_http(&p, &ids, calls);
    println!(
        "| HTTP (`/mcp` on `loopd serve`) | {p50:.2} ms | {p99:.2} ms | {rss:.1} MiB (the whole service) |"
    );
}
