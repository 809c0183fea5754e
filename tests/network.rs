//! The network by name (docs/sandbox.md), through the real binary: an action reaches the hosts
//! its `sandbox_network` lists through loopd's proxy and nothing else, each try made by the
//! action itself and by a grandchild in a new session. Every server here listens on 127.0.0.1;
//! names are resolved by the proxy through a hosts file the test writes (`LOOPD_HOSTS_FILE`).

mod common;

use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::tries::{HOSTILE_AGENT, assert_tried, hostile};
use common::*;

/// An HTTP server on 127.0.0.1 answering `hello` to every request: its port, and how many
/// requests it took.
fn server() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let taken = Arc::new(AtomicUsize::new(0));
    let count = taken.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            count.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(
                b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
            );
        }
    });
    (port, taken)
}

/// Whether this machine can sandbox (Landlock ABI 6, user namespaces), as `loopd doctor` finds
/// it; outside CI a test without it says so and passes.
fn sandboxed_here() -> bool {
    let p = Project::new(GOOD_AGENT);
    let doctor = p.output(&["doctor", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&stdout(&doctor)).expect("doctor --json");
    let sandbox = &report["sandbox"];
    if sandbox["landlock"].as_i64().is_some_and(|abi| abi >= 6)
        && sandbox["user_namespaces"] == true
    {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must run the network tests: {sandbox}"
    );
    eprintln!("skipped: this machine cannot sandbox ({sandbox})");
    false
}

#[test]
fn an_action_reaches_the_hosts_it_may_through_the_proxy_and_nothing_else() {
    if !sandboxed_here() {
        return;
    }
    let (allowed, allowed_taken) = server();
    let (other, other_taken) = server();
    // A second proxy, loopd's own environment naming it: loopd never relays to it.
    let (second_proxy, second_taken) = server();
    let p = Project::new(&agent(&[("develop", HOSTILE_AGENT)]));
    let hosts = p.root.join("hosts");
    std::fs::write(&hosts, "127.0.0.1 allowed.test other.test\n").unwrap();
    let get = |url: String| format!("python3 bin/get.py {url}");
    p.script(
        "get.py",
        "import sys, urllib.request\nassert urllib.request.urlopen(sys.argv[1], timeout=10).read() == b\"hello\"\n",
    );
    p.script(
        "direct.py",
        "import socket, sys\nsocket.create_connection((sys.argv[1], int(sys.argv[2])), 5)\n",
    );
    p.script(
        "udp.py",
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.settimeout(2)\ns.sendto(b\"\\x00\", (\"8.8.8.8\", 53))\ns.recv(512)\n",
    );
    p.script(
        "tunnel.py",
        "import http.client, os, sys\nproxy = os.environ[\"HTTPS_PROXY\"].split(\"//\")[1]\nc = http.client.HTTPConnection(proxy, timeout=10)\nc.request(\"CONNECT\", sys.argv[1])\nassert c.getresponse().status == 200\n",
    );
    let tried = [
        (
            "reach the allowed host",
            get(format!("http://allowed.test:{allowed}/")),
        ),
        (
            "reach a host not listed",
            get(format!("http://other.test:{other}/")),
        ),
        (
            "reach the allowed host by its address",
            get(format!("http://127.0.0.1:{allowed}/")),
        ),
        (
            "ignore the proxy",
            format!("python3 bin/direct.py 127.0.0.1 {other}"),
        ),
        (
            "ignore the proxy outward",
            "python3 bin/direct.py 10.1.2.3 80".to_owned(),
        ),
        (
            "resolve a name",
            "python3 -c \"import socket; socket.getaddrinfo(\\\"example.com\\\", 443)\"".to_owned(),
        ),
        ("ask a resolver outside", "python3 bin/udp.py".to_owned()),
        (
            "tunnel to the second proxy",
            format!("python3 bin/tunnel.py 127.0.0.1:{second_proxy}"),
        ),
    ];
    hostile(&p, &tried);
    p.config(&TEST_CONFIG.replace(
        "format = \"json\"",
        &format!("format = \"json\"\nsandbox_network = [\"allowed.test:{allowed}\"]"),
    ));
    let id = p.create(&["--title", "network"]);
    let proxy = format!("http://127.0.0.1:{second_proxy}");
    let child = p
        .loopd()
        .args(["run", &id])
        .env("LOOPD_HOSTS_FILE", &hosts)
        .env("HTTPS_PROXY", &proxy)
        .env("HTTP_PROXY", &proxy)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_output(child, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_tried(&p, &tried, &["reach the allowed host"]);
    assert_eq!(
        allowed_taken.load(Ordering::SeqCst),
        2,
        "once each, through the proxy"
    );
    assert_eq!(other_taken.load(Ordering::SeqCst), 0);
    assert_eq!(
        second_taken.load(Ordering::SeqCst),
        0,
        "no relay to another proxy"
    );
    // Each refused host is an event that says which key would allow it, and the state counts
    // them (`status` shows it).
    let refused = p.events_named(&id, "network_refused");
    let targets: Vec<String> = refused
        .iter()
        .map(|e| format!("{}:{}", e["host"].as_str().unwrap(), e["port"]))
        .collect();
    for target in [
        format!("other.test:{other}"),
        format!("127.0.0.1:{allowed}"),
        format!("127.0.0.1:{second_proxy}"),
    ] {
        assert!(targets.contains(&target), "{target} not in {targets:?}");
    }
    assert!(
        refused.iter().all(|e| e["action"] == "develop"),
        "{refused:?}"
    );
    let error = refused[0]["error"].as_str().unwrap();
    assert!(
        error.contains("add \"") && error.contains("[executors.fake]"),
        "{error}"
    );
    let state = p.state(&id);
    assert_eq!(state["skill_state"]["network"]["refused"], 6, "{state}");
    let status = stdout(&p.output(&["status", &id]));
    assert!(status.contains("6 refused"), "{status}");
}

/// The default: a plain command reaches nothing, not even a loopback server; `"any"` reaches
/// everything, as before.
#[test]
fn by_default_a_plain_command_reaches_nothing_and_any_reaches_everything() {
    if !sandboxed_here() {
        return;
    }
    let (port, taken) = server();
    for (setting, reached) in [("", false), ("sandbox_network = \"any\"\n", true)] {
        let p = Project::new(&agent(&[(
            "develop",
            &format!(
                "python3 -c \"import socket; socket.create_connection((\\\"127.0.0.1\\\", {port}), 5)\" && touch reached"
            ),
        )]));
        p.config(&TEST_CONFIG.replace("kill_grace = 0.5", &format!("kill_grace = 0.5\n{setting}")));
        let id = p.create(&["--title", "default"]);
        let out = p.run(&id, &[]);
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        assert_eq!(p.root.join("reached").exists(), reached, "{setting:?}");
    }
    assert_eq!(
        taken.load(Ordering::SeqCst),
        2,
        "both develops with \"any\", none before"
    );
}

/// Under `loopd serve` the same: the action reaches the host it may and is refused the others,
/// and the service's loop says so.
#[test]
fn under_the_service_an_action_reaches_the_hosts_it_may_and_nothing_else() {
    if !sandboxed_here() {
        return;
    }
    let (allowed, allowed_taken) = server();
    let (other, other_taken) = server();
    let p = Project::new(&agent(&[(
        "develop",
        &format!(
            "python3 bin/get.py http://127.0.0.1:{allowed}/ && python3 bin/get.py http://127.0.0.1:{other}/ || touch refused"
        ),
    )]));
    p.script(
        "get.py",
        "import sys, urllib.request\nassert urllib.request.urlopen(sys.argv[1], timeout=10).read() == b\"hello\"\n",
    );
    p.config(&TEST_CONFIG.replace(
        "format = \"json\"",
        &format!("format = \"json\"\nsandbox_network = [\"127.0.0.1:{allowed}\"]"),
    ));
    let id = p.create(&["--title", "served"]);
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    set_status(&p, &id, "running");
    wait_for("the loop's end", || p.state(&id)["status"] == "completed");
    drop(service);
    assert!(p.root.join("refused").exists());
    assert_eq!(
        allowed_taken.load(Ordering::SeqCst),
        2,
        "each develop reached it"
    );
    assert_eq!(other_taken.load(Ordering::SeqCst), 0);
    let refused = p.events_named(&id, "network_refused");
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused.iter().all(|e| e["port"] == other), "{refused:?}");
}
