//! `[[notify]]` receivers through the real binary: a webhook on a local HTTP receiver and a
//! command get the events they asked for, as JSON; a failing receiver neither holds up a loop nor
//! fills the log, and its URL's secrets never reach the log; a bad `[[notify]]` is refused.
//!
//! The receiver is a tiny HTTP/1.1 server on 127.0.0.1 in the test ([`Hook`]): it records each
//! request, answers with a chosen status, and can hold its answers back until the test lets them
//! go, to show that a loop does not wait for its receivers.

mod common;

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// A webhook receiver
// ---------------------------------------------------------------------------------------------

/// One request a [`Hook`] received.
#[derive(Clone, Debug)]
struct Request {
    /// The request line and the headers.
    head: String,
    body: String,
}

impl Request {
    fn path(&self) -> &str {
        self.head.split_whitespace().nth(1).unwrap_or("")
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).expect("a JSON body")
    }
}

/// What the server's threads share with the test.
#[derive(Default)]
struct Shared {
    requests: Mutex<Vec<Request>>,
    /// While true, answers wait (see [`Hook::release`]).
    held: Mutex<bool>,
    released: Condvar,
    stop: AtomicBool,
}

/// A webhook receiver on 127.0.0.1 (a port of its own), stopped when dropped.
struct Hook {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: Option<JoinHandle<()>>,
}

impl Hook {
    /// A receiver answering `status` to every request; with `held`, only once released.
    fn start(status: u16, held: bool) -> Hook {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let addr = listener.local_addr().expect("local address");
        let shared = Arc::new(Shared {
            held: Mutex::new(held),
            ..Shared::default()
        });
        let server = {
            let shared = shared.clone();
            std::thread::spawn(move || serve(&listener, &shared, status))
        };
        Hook {
            addr,
            shared,
            server: Some(server),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn requests(&self) -> Vec<Request> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// The requests to `path`.
    fn to(&self, path: &str) -> Vec<Request> {
        self.requests()
            .into_iter()
            .filter(|r| r.path() == path)
            .collect()
    }

    /// Lets every held answer (and every later one) go.
    fn release(&self) {
        *self.shared.held.lock().unwrap() = false;
        self.shared.released.notify_all();
    }
}

impl Drop for Hook {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.release();
        // Wakes the accept.
        let _ = TcpStream::connect(self.addr);
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

/// Accepts connections until stopped, each answered on a thread of its own (an answer held back
/// must not keep another receiver's request waiting).
fn serve(listener: &TcpListener, shared: &Arc<Shared>, status: u16) {
    let mut connections = Vec::new();
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        let shared = shared.clone();
        connections.push(std::thread::spawn(move || {
            let _ = answer(stream, &shared, status);
        }));
    }
    for connection in connections {
        let _ = connection.join();
    }
}

/// Reads one request, records it, waits while answers are held, and answers `status`.
fn answer(stream: TcpStream, shared: &Shared, status: u16) -> std::io::Result<()> {
    stream.set_read_timeout(Some(DEADLINE))?;
    let mut reader = BufReader::new(&stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    shared.requests.lock().unwrap().push(Request {
        head,
        body: String::from_utf8_lossy(&body).into_owned(),
    });
    let held = shared.held.lock().unwrap();
    drop(
        shared
            .released
            .wait_while(held, |held| *held)
            .expect("the hold"),
    );
    write!(
        &stream,
        "HTTP/1.1 {status} Whatever\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// How long a daemon whose loop ended waits for its last notifications.
const SETTLE_GRACE: Duration = Duration::from_secs(5);

/// A TOML string.
fn quoted(text: &str) -> String {
    serde_json::to_string(text).expect("a string")
}

/// [`TEST_CONFIG`] and `notify` (`[[notify]]` tables).
fn config_with(notify: &str) -> String {
    format!("{TEST_CONFIG}\n{notify}")
}

/// The loop's event named `name`, as `events.jsonl` has it.
fn logged(p: &Project, id: &str, name: &str) -> Value {
    p.events(id)
        .into_iter()
        .find(|e| e["event"] == name)
        .unwrap_or_else(|| panic!("no `{name}` event"))
}

/// What a receiver should have got of `event`: the event as logged, its notify name, the root.
fn sent(mut event: Value, notify: &str, p: &Project) -> Value {
    event["notify"] = notify.into();
    event["root"] = p.root.display().to_string().into();
    event
}

/// The lines of `log` that say `receiver` failed.
fn failures<'a>(log: &'a str, receiver: &str) -> Vec<&'a str> {
    log.lines()
        .filter(|l| l.contains(&format!("notification receiver {receiver} failed")))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn a_webhook_gets_the_events_it_asked_for_as_json() {
    let hook = Hook::start(204, false);
    let p = Project::new(GOOD_AGENT);
    p.config(&config_with(&format!(
        "[[notify]]\nurl = {}\nevents = [\"completed\"]\n\n\
         [[notify]]\nurl = {}\nevents = [\"failed\"]\n",
        quoted(&hook.url("/done")),
        quoted(&hook.url("/failures")),
    )));
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    // Delivered before the daemon exited.
    let done = hook.to("/done");
    assert_eq!(done.len(), 1, "{:?}", hook.requests());
    let head = done[0].head.to_ascii_lowercase();
    assert!(head.starts_with("post /done http/1.1\r\n"), "{head}");
    assert!(
        head.contains("content-type: application/json\r\n"),
        "{head}"
    );
    let got = done[0].json();
    assert_eq!(got, sent(logged(&p, &id, "completed"), "completed", &p));
    assert_eq!(got["loop_id"], id.as_str());
    assert_eq!(got["outcome"], "passed");
    assert!(
        got["ts"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{got}"
    );
    // Asked for failures only: told nothing.
    assert!(hook.to("/failures").is_empty(), "{:?}", hook.requests());
}

#[test]
fn a_notification_of_a_loop_left_standing_says_why_and_what_moves_it_on() {
    let hook = Hook::start(204, false);
    let p = Project::new(GOOD_AGENT);
    p.config(&config_with(&format!(
        "[[notify]]\nurl = {}\nevents = [\"completed\"]\n",
        quoted(&hook.url("/done")),
    )));
    let id = p.create(&["--title", "t", "--max-iterations", "1"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));

    let done = hook.to("/done");
    assert_eq!(done.len(), 1, "{:?}", hook.requests());
    let got = done[0].json();
    assert_eq!(got, sent(logged(&p, &id, "completed"), "completed", &p));
    // The words `status --json` has for the loop now, and the command that moves it on.
    let shown: Value = serde_json::from_str(&stdout(&p.output(&["status", &id, "--json"])))
        .expect("status --json");
    assert_eq!(got["outcome"], "iteration_limit", "{got}");
    assert_eq!(got["status_reason"], shown["status_reason"], "{got}");
    assert_eq!(got["next_step"], shown["next_step"], "{got}");
    assert!(
        got["next_step"]
            .as_str()
            .is_some_and(|s| s.contains(&format!("`loopd set {id} --max-iterations N`"))),
        "{got}"
    );
}

#[test]
fn a_command_gets_the_event_on_stdin_and_one_that_overruns_is_killed() {
    let p = Project::new(GOOD_AGENT);
    let record = p.script("record.sh", "cat >> \"$1\"\n");
    let received = p.root.join("received.jsonl");
    // Records its pid, then outlives its timeout.
    let hang = p.script("hang.sh", "echo $$ > \"$1\"\nexec sleep 100\n");
    let hang_pid = p.root.join("hang.pid");
    p.config(&config_with(&format!(
        "[[notify]]\ncommand = [\"sh\", {}, {}]\nevents = [\"completed\", \"failed\"]\n\n\
         [[notify]]\ncommand = [{}, {}]\nevents = [\"completed\"]\ntimeout = 0.5\n",
        quoted(&record.display().to_string()),
        quoted(&received.display().to_string()),
        quoted(&hang.display().to_string()),
        quoted(&hang_pid.display().to_string()),
    )));
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    let text = std::fs::read_to_string(&received).expect("the command's record");
    assert!(
        text.ends_with('\n') && text.lines().count() == 1,
        "{text:?}"
    );
    let got: Value = serde_json::from_str(&text).expect("one JSON line");
    assert_eq!(got, sent(logged(&p, &id, "completed"), "completed", &p));

    // The other one was killed at its timeout, and said so once.
    let pid = read_pid(&hang_pid);
    wait_for("the overrunning command to be killed", || !alive(pid));
    let log = stderr(&out);
    let said = failures(&log, &format!("command {:?}", hang.display().to_string()));
    assert_eq!(said.len(), 1, "{log}");
    assert!(
        said[0].contains("still running after 0.5s; killed"),
        "{log}"
    );
}

#[test]
fn a_failing_webhook_holds_up_no_loop_is_logged_once_and_never_shows_its_secrets() {
    const SECRET: &str = "T0K3N";
    let hook = Hook::start(500, true);
    let p = Project::new(GOOD_AGENT);
    let url = format!(
        "http://bot:{SECRET}-user@{}/hook/{SECRET}-path?key={SECRET}-query",
        hook.addr
    );
    p.config(&config_with(&format!(
        "[[notify]]\nurl = {}\ntimeout = 30.0\n",
        quoted(&url)
    )));
    // Loops in one service: one receiver for all of them.
    let ids: Vec<String> = (0..3).map(|_| p.create(&["--title", "t"])).collect();
    let service = p.serve(&["--root", p.root.to_str().unwrap()]);
    let start = Instant::now();
    for id in &ids {
        set_status(&p, id, "running");
    }
    // Every loop completes while the receiver still sits on the first notification. (They take
    // turns in the project's work tree, and none waits for its notifications to be delivered
    // before it lets the next one in, as a daemon about to exit would, up to 5 s.)
    for id in &ids {
        wait_for(&format!("loop {id} to complete"), || {
            p.state(id)["status"] == "completed"
        });
    }
    assert!(start.elapsed() < SETTLE_GRACE, "{:?}", start.elapsed());
    wait_for("the first notification", || !hook.requests().is_empty());
    assert_eq!(hook.requests().len(), 1, "{:?}", hook.requests());
    hook.release();
    // The first is tried again (500 may pass), the others once each, the receiver failing.
    wait_for("every loop's notification to be tried", || {
        let told: Vec<Value> = hook.requests().iter().map(Request::json).collect();
        ids.iter()
            .all(|id| told.iter().any(|t| t["loop_id"] == id.as_str()))
    });
    let requests = hook.requests();
    assert_eq!(requests.len(), ids.len() + 2, "{requests:?}");
    assert!(requests.iter().all(|r| r.json()["notify"] == "completed"));
    // The user info went as basic authentication, as the URL says.
    assert!(
        requests[0]
            .head
            .to_ascii_lowercase()
            .contains("authorization: basic ")
    );

    let out = service.stop();
    let log = stderr(&out);
    let said = failures(&log, &format!("webhook http://{}", hook.addr));
    assert_eq!(
        said.len(),
        1,
        "one warning for {} events:\n{log}",
        ids.len()
    );
    assert!(said[0].contains("HTTP status 500"), "{log}");
    assert!(!log.contains(SECRET), "{log}");
    for id in &ids {
        assert_eq!(p.state(id)["skill_state"]["outcome"], "passed");
        let events = std::fs::read_to_string(p.progress(id).join("events.jsonl")).unwrap();
        assert!(!events.contains(SECRET), "{events}");
    }
}

#[test]
fn a_bad_notify_entry_is_refused_in_one_line_naming_the_key() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t"]);
    for (notify, reason) in [
        (
            "url = \"http://127.0.0.1:9/T0K3N\"\ncommand = [\"true\"]",
            "entry 1: has both `url` and `command`",
        ),
        (
            "url = \"http://127.0.0.1:9/T0K3N\"\nevents = [\"complete\"]",
            "entry 1: `events` names an unknown event \"complete\"; did you mean \"completed\"?",
        ),
    ] {
        std::fs::write(
            p.root.join(".loop/config.toml"),
            config_with(&format!("[[notify]]\n{notify}\n")),
        )
        .unwrap();
        let out = p.output(&["run", &id]);
        assert_eq!(code(&out), 2, "{}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "one line: {err}");
        assert!(
            err.contains("config.toml, key `notify`: ") && err.contains(reason),
            "{err}"
        );
        assert!(!err.contains("T0K3N"), "{err}");
    }
}
