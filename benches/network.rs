//! Benchmark: what the network by name costs a request. One action makes N HTTP requests (one
//! Python process, a new connection each, as `urllib` does) to a server of the bench's on
//! 127.0.0.1: through loopd's proxy by name (`sandbox_network = ["bench.test:PORT"]`, the name
//! resolved by the proxy from a hosts file, `LOOPD_HOSTS_FILE`), and straight with
//! `sandbox_network = "any"`. The action's time over N, both ways, and their difference: the
//! proxy's cost per request. Sandboxed as by default otherwise; one loop under `loopd run` (the
//! service and workers serve the same proxy).
//!
//! Run: `cargo bench --bench network`. Environment:
//!   LOOPD_BENCH_REQUESTS  requests per action (default 300)
//!   LOOPD_BENCH_ROUNDS    rounds, the median is reported (default 5)

mod common;

use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::process::Stdio;

use common::{Project, env_num, median};

/// An HTTP server on 127.0.0.1 answering `ok` to every request; its port.
fn server() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("port").port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                let _ = stream.write_all(
                    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                );
            });
        }
    });
    port
}

/// One action of `requests` GETs of `url`, with `network` as its `sandbox_network`: its time per
/// request, in ms (from its `duration_ms`).
fn round(network: &str, url: &str, requests: usize, hosts: &std::path::Path) -> f64 {
    let config = format!(
        r#"
executor = "agent"
max_iterations = 1
no_progress_rounds = 0
[executor_defaults]
sandbox_network = {network}
[executors.agent]
command = ["sh", "bin/agent.sh"]
prompt = "stdin"
format = "json"
"#
    );
    let agent = format!(
        r#"cat > /dev/null
if [ "$LOOPD_ACTION" = develop ]; then python3 bin/get.py {url} {requests} || exit 1; fi
echo '{{"status":"success","state_updates":{{"tasks":[{{"description":"get"}}]}}}}' > "$LOOPD_RESULT_FILE"
"#
    );
    let p = Project::new(&config, Some(&agent));
    std::fs::write(
        p.root.join("bin/get.py"),
        "import sys, urllib.request\nfor _ in range(int(sys.argv[2])):\n    assert urllib.request.urlopen(sys.argv[1], timeout=10).read() == b\"ok\"\n",
    )
    .expect("write get.py");
    let id = p.create(1);
    let status = p
        .loopd()
        .args(["run", &id])
        .env("LOOPD_HOSTS_FILE", hosts)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("loopd run");
    assert!(
        status.code().is_some_and(|c| c == 0 || c == 3),
        "{status:?}"
    );
    let develop = p
        .events(&id)
        .into_iter()
        .find(|e| e["event"] == "action_finished" && e["action"] == "develop")
        .expect("the develop finished");
    develop["duration_ms"].as_f64().expect("duration_ms") / requests as f64
}

fn main() {
    let requests = env_num("LOOPD_BENCH_REQUESTS", 300);
    let rounds = env_num("LOOPD_BENCH_ROUNDS", 5);
    let port = server();
    let dir = common::tempdir();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.1 bench.test\n").expect("write hosts");
    let (mut proxied, mut straight) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        proxied.push(round(
            &format!("[\"bench.test:{port}\"]"),
            &format!("http://bench.test:{port}/"),
            requests,
            &hosts,
        ));
        straight.push(round(
            "\"any\"",
            &format!("http://127.0.0.1:{port}/"),
            requests,
            &hosts,
        ));
    }
    let (p, s) = (median(&mut proxied), median(&mut straight));
    println!("loopd network: {requests} requests an action, {rounds} rounds, medians");
    println!("| path | ms per request |");
    println!("|---|---|");
    println!("| through loopd's proxy, by name (`[\"bench.test:PORT\"]`) | {p:.3} |");
    println!("| straight (`\"any\"`) | {s:.3} |");
    println!("| the proxy's cost per request | {:.3} |", p - s);
}
