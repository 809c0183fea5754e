//! Notifications: the `[[notify]]` receivers, webhooks and commands told of the events of a loop
//! that call for a person (it asks a question, it is stuck, it failed, it is done).
//!
//! Theory of operation: a loop's [`EventLog`] hands every event to the loop's [`Notifier`]
//! ([`EventLog::set_sink`]), which names it for people (`notify_name`) and offers it to each
//! receiver that wants it with a `try_send` on that receiver's bounded queue: the loop never
//! waits for a receiver, and an event that a full queue cannot take is dropped, with a log line.
//! Each distinct receiver has one queue and one delivery thread in the process, shared by every
//! loop that names it (in `loopd serve`, loops of many projects), so a slow receiver holds up only
//! itself, and a failing one is said once in the log, however many loops and events it fails
//! for, until it works again (which is said too).
//!
//! A webhook gets the event POSTed as JSON, within its timeout, tried again after a growing pause
//! when the failure may pass (no connection, a time-out, a 5xx, 408 or 429); a command is run
//! without a shell in the project root, the event one JSON line on its stdin, its output
//! discarded, and killed with its process group past its timeout. A receiver already failing is
//! tried once per event, so a dead one costs little.
//!
//! A daemon (`loopd run`, `start`) exits right after its loop ends, most likely with the loop's
//! last event (`completed`, `failed`) still queued: [`settle`] gives the deliveries
//! [`SETTLE_GRACE`] to be made before it exits. A service lives on, and so do its delivery
//! threads: there a loop's end waits for nothing (it still holds its work tree, which the
//! project's next loop may be waiting for).
//!
//! A URL may carry a secret (a token in its user info, path or query): the log names a webhook by
//! `scheme://host[:port]` alone, and what its HTTP client says of a failure is shown without the
//! URL's other parts. A command is named by its program alone, for the same reason.
//!
//! Loops on Temporal (`loopd-temporal`) do not notify: their events are not written through an
//! [`EventLog`] of this driver.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use loopd_exec::procs;
use loopd_project::config::NotifyConfig;
use loopd_store::events::{EventLog, name};
use serde_json::{Value, json};
use ureq::http::Uri;

/// Events a receiver's queue holds while its deliveries are under way; more are dropped.
const QUEUE_LEN: usize = 64;

/// Tries of one event at a webhook that is not known to be failing.
const WEBHOOK_TRIES: u32 = 3;

/// The pause before a webhook's second try; doubled before each further one.
const FIRST_PAUSE: Duration = Duration::from_millis(250);

/// How long a daemon whose loop ended waits for the loop's last notifications to be delivered.
pub const SETTLE_GRACE: Duration = Duration::from_secs(5);

/// The name people know `event` by, if a receiver may want it (see
/// [`loopd_project::config::NOTIFY_EVENTS`]): a failure because the budget ran out is
/// `budget_reached`, any other `failed`.
fn notify_name(event: &Value) -> Option<&'static str> {
    let failure = || event.get("error").and_then(Value::as_str).unwrap_or("");
    Some(match event.get("event")?.as_str()? {
        name::AWAITING_ANSWER => "needs_input",
        name::NO_PROGRESS => "no_progress",
        name::FAILED if failure().starts_with("budget exceeded") => "budget_reached",
        name::FAILED => "failed",
        name::COMPLETED => "completed",
        name::RATE_LIMITED => "rate_limited",
        _ => return None,
    })
}

/// Where a receiver's deliveries go, and how long each may take: one queue and one thread per
/// distinct endpoint in the process.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Endpoint {
    target: Target,
    timeout: Duration,
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum Target {
    Webhook(Uri),
    Command(Vec<String>),
}

impl Target {
    /// What the log may say of it: never a URL's user info, path or query, nor a command's
    /// arguments.
    fn label(&self) -> String {
        match self {
            Target::Webhook(uri) => format!("webhook {}", origin(uri)),
            Target::Command(argv) => format!("command {:?}", argv[0]),
        }
    }
}

/// `scheme://host[:port]` of a URL.
fn origin(uri: &Uri) -> String {
    let host = uri.host().unwrap_or("");
    match (uri.scheme_str(), uri.port_u16()) {
        (Some(scheme), Some(port)) => format!("{scheme}://{host}:{port}"),
        (Some(scheme), None) => format!("{scheme}://{host}"),
        (None, _) => host.to_owned(),
    }
}

/// What a receiver's thread is handed.
enum Message {
    /// An event to deliver: its JSON, and the project root (where a command runs).
    Deliver { body: Arc<str>, root: Arc<Path> },
    /// Said back once everything queued before it is delivered (or given up).
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// A receiver's queue, fed by the loops and drained by its delivery thread.
struct Queue {
    tx: SyncSender<Message>,
    label: String,
}

/// The queues of this process, one per endpoint; their threads live as long as the process.
static QUEUES: LazyLock<Mutex<HashMap<Endpoint, Arc<Queue>>>> = LazyLock::new(Mutex::default);

impl Queue {
    /// The queue of `endpoint`, its thread started on first use.
    fn of(endpoint: Endpoint) -> std::io::Result<Arc<Queue>> {
        let mut queues = QUEUES.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(queue) = queues.get(&endpoint) {
            return Ok(queue.clone());
        }
        let (tx, rx) = mpsc::sync_channel(QUEUE_LEN);
        let label = endpoint.target.label();
        let delivery = Delivery::new(endpoint.clone(), label.clone());
        std::thread::Builder::new()
            .name("loopd-notify".into())
            .spawn(move || delivery.run(rx))?;
        let queue = Arc::new(Queue { tx, label });
        queues.insert(endpoint, queue.clone());
        Ok(queue)
    }
}

/// One `[[notify]]` entry of a loop: its queue and the events it wants.
struct Route {
    queue: Arc<Queue>,
    config: NotifyConfig,
}

/// A loop's receivers (see the module's documentation).
pub struct Notifier {
    /// The project root, as the receivers are told and where commands run.
    root: Arc<Path>,
    routes: Vec<Route>,
}

impl Notifier {
    /// The receivers of `receivers` for a loop of the project in `root`, each one's delivery
    /// thread started if need be; `None` when there are none.
    fn new(receivers: &[NotifyConfig], root: &Path) -> Option<Notifier> {
        let routes: Vec<Route> = receivers.iter().filter_map(route).collect();
        (!routes.is_empty()).then(|| Notifier {
            root: root.into(),
            routes,
        })
    }

    /// Makes `events` hand its events to the loop's receivers, if it has any.
    pub fn attach(receivers: &[NotifyConfig], root: &Path, events: &mut EventLog) {
        if let Some(notifier) = Notifier::new(receivers, root) {
            events.set_sink(Box::new(move |event| notifier.offer(event)));
        }
    }

    /// Queues `event`, as written to the event log, for each receiver that wants it. Never waits.
    fn offer(&self, event: &Value) {
        let Some(kind) = notify_name(event) else {
            return;
        };
        let mut body = None;
        for route in self.routes.iter().filter(|r| r.config.wants(kind)) {
            let body = body.get_or_insert_with(|| self.body(event, kind)).clone();
            let message = Message::Deliver {
                body,
                root: self.root.clone(),
            };
            match route.queue.tx.try_send(message) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => tracing::warn!(
                    "notification receiver {} is behind: a `{kind}` notification was dropped",
                    route.queue.label
                ),
                Err(TrySendError::Disconnected(_)) => tracing::warn!(
                    "notification receiver {} is gone: a `{kind}` notification was dropped",
                    route.queue.label
                ),
            }
        }
    }

    /// What a receiver is sent: the event as logged, with its notify name and the project root.
    fn body(&self, event: &Value, kind: &str) -> Arc<str> {
        let mut body = event.clone();
        if let Some(fields) = body.as_object_mut() {
            fields.insert("notify".into(), json!(kind));
            fields.insert("root".into(), json!(self.root.display().to_string()));
        }
        body.to_string().into()
    }
}

/// Waits up to [`SETTLE_GRACE`] until every notification queued in this process is delivered
/// (or given up): a daemon exits right after its loop, and would take its last notifications
/// with it. A service lives on, and never waits for its receivers.
pub async fn settle() {
    let queues: Vec<Arc<Queue>> = QUEUES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .values()
        .cloned()
        .collect();
    let mut acks = Vec::new();
    for queue in queues {
        let (done, ack) = tokio::sync::oneshot::channel();
        if queue.tx.try_send(Message::Flush(done)).is_ok() {
            acks.push(ack);
        }
    }
    let all = async {
        for ack in acks {
            let _ = ack.await;
        }
    };
    if tokio::time::timeout(SETTLE_GRACE, all).await.is_err() {
        tracing::info!(
            "notifications still undelivered after {}s are given up",
            SETTLE_GRACE.as_secs()
        );
    }
}

/// The route of one `[[notify]]` entry, its thread started; `None` (said in the log) when its URL
/// does not parse or its thread cannot start.
fn route(config: &NotifyConfig) -> Option<Route> {
    let target = match (&config.url, &config.command) {
        (Some(url), _) => match url.parse::<Uri>() {
            Ok(uri) if uri.host().is_some() => Target::Webhook(uri),
            _ => {
                tracing::warn!("a [[notify]] url does not parse as a URL; it is left out");
                return None;
            }
        },
        (None, Some(argv)) if !argv.is_empty() => Target::Command(argv.clone()),
        // The config's check refuses it.
        (None, _) => return None,
    };
    let endpoint = Endpoint {
        target,
        timeout: config.timeout(),
    };
    let label = endpoint.target.label();
    match Queue::of(endpoint) {
        Ok(queue) => Some(Route {
            queue,
            config: config.clone(),
        }),
        Err(e) => {
            tracing::warn!("cannot start the notifications to {label}: {e}; it is left out");
            None
        }
    }
}

/// Why a delivery failed, and whether trying again may help.
struct Failure {
    message: String,
    passing: bool,
}

impl Failure {
    fn lasting(message: impl Into<String>) -> Failure {
        Failure {
            message: message.into(),
            passing: false,
        }
    }
}

/// One receiver's delivery thread: it delivers what its queue holds, in order.
struct Delivery {
    endpoint: Endpoint,
    label: String,
    /// The HTTP client of a webhook (its connections kept for the next event).
    agent: ureq::Agent,
    /// The last delivery failed (and that was said in the log).
    failing: bool,
}

impl Delivery {
    fn new(endpoint: Endpoint, label: String) -> Delivery {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(endpoint.timeout))
            // Every status is looked at here, and a redirect is a receiver's mistake: a POST
            // followed elsewhere would lose its body or go where nobody configured.
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(concat!("loopd/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Delivery {
            endpoint,
            label,
            agent,
            failing: false,
        }
    }

    fn run(mut self, rx: Receiver<Message>) {
        for message in rx {
            match message {
                Message::Deliver { body, root } => {
                    let delivered = self.deliver(&body, &root);
                    self.said(delivered);
                }
                Message::Flush(done) => {
                    let _ = done.send(());
                }
            }
        }
    }

    fn deliver(&self, body: &str, root: &Path) -> Result<(), Failure> {
        match &self.endpoint.target {
            Target::Webhook(uri) => {
                let tries = if self.failing { 1 } else { WEBHOOK_TRIES };
                self.post(uri, body, tries)
            }
            Target::Command(argv) => run_command(argv, self.endpoint.timeout, body, root),
        }
    }

    /// POSTs `body` to `uri`, up to `tries` times while the failure may pass.
    fn post(&self, uri: &Uri, body: &str, tries: u32) -> Result<(), Failure> {
        let mut pause = FIRST_PAUSE;
        let mut tried = 1;
        loop {
            match post_once(&self.agent, uri, body) {
                Err(failure) if failure.passing && tried < tries => {
                    std::thread::sleep(pause);
                    pause *= 2;
                    tried += 1;
                }
                result => return result,
            }
        }
    }

    /// Logs the first failure of a run of them, and the first success after one.
    fn said(&mut self, delivered: Result<(), Failure>) {
        match delivered {
            Ok(()) if self.failing => {
                self.failing = false;
                tracing::info!("notification receiver {} recovered", self.label);
            }
            Ok(()) => {}
            Err(failure) if !self.failing => {
                self.failing = true;
                tracing::warn!(
                    "notification receiver {} failed: {}; its failures are not logged again \
                     until it recovers",
                    self.label,
                    failure.message
                );
            }
            Err(_) => {}
        }
    }
}

fn post_once(agent: &ureq::Agent, uri: &Uri, body: &str) -> Result<(), Failure> {
    let response = agent
        .post(uri)
        .content_type("application/json")
        .send(body)
        .map_err(|e| client_failure(&e, uri))?;
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    Err(Failure {
        message: format!("HTTP status {}", status.as_u16()),
        passing: status.is_server_error() || matches!(status.as_u16(), 408 | 429),
    })
}

/// What the HTTP client says of a failure, without the parts of the URL that may be secret.
fn client_failure(error: &ureq::Error, uri: &Uri) -> Failure {
    use ureq::Error as E;
    let passing = matches!(
        error,
        E::Io(_) | E::Timeout(_) | E::ConnectionFailed | E::HostNotFound
    );
    Failure {
        message: hide_secrets(&error.to_string(), uri),
        passing,
    }
}

/// `text` with the URL, its user info and its path and query replaced by `…`.
fn hide_secrets(text: &str, uri: &Uri) -> String {
    let authority = uri.authority().map_or("", |a| a.as_str());
    let user_info = authority.rsplit_once('@').map_or("", |(info, _)| info);
    let tail = uri.path_and_query().map_or("", |p| p.as_str());
    let mut text = text.replace(&uri.to_string(), "…");
    for secret in [user_info, tail] {
        if secret.len() > 1 {
            text = text.replace(secret, "…");
        }
    }
    text
}

/// Runs a command receiver: `line` on its stdin, its output discarded, killed with its process
/// group past `timeout`.
///
/// It is a process of loopd's own ([`procs::spawn_own`]), so that the end of an attempt running
/// meanwhile neither reaps it (taking its exit status) nor ends it as one of the attempt's
/// orphans.
fn run_command(argv: &[String], timeout: Duration, line: &str, root: &Path) -> Result<(), Failure> {
    use std::os::unix::process::CommandExt as _;
    let mut command = Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .current_dir(root)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    let mut child = procs::spawn_own(&mut command)
        .map_err(|e| Failure::lasting(format!("cannot start it: {e}")))?;
    let ran = supervise(&mut child, timeout, format!("{line}\n"));
    procs::unspare(child.id());
    ran
}

/// Feeds the child its line and waits for it, up to `timeout`; then kills its group and reaps it.
fn supervise(child: &mut Child, timeout: Duration, line: String) -> Result<(), Failure> {
    let pid = child.id();
    let stdin = child.stdin.take();
    std::thread::scope(|scope| {
        // On a thread of its own: a program that does not read its stdin must not stop the wait
        // (its end, or its kill, ends the write).
        scope.spawn(move || {
            if let Some(mut stdin) = stdin {
                let _ = stdin.write_all(line.as_bytes());
            }
        });
        let (exited, exit) = mpsc::channel();
        scope.spawn(move || {
            let _ = exited.send(child.wait());
        });
        let status = match exit.recv_timeout(timeout) {
            Ok(status) => status,
            Err(RecvTimeoutError::Timeout) => {
                if let Ok(pgid) = i32::try_from(pid) {
                    let pgid = nix::unistd::Pid::from_raw(pgid);
                    let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
                }
                let _ = exit.recv();
                return Err(Failure::lasting(format!(
                    "still running after {:.1}s; killed",
                    timeout.as_secs_f64()
                )));
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(Failure::lasting("lost its exit status"));
            }
        };
        match status {
            Ok(status) if status.success() => Ok(()),
            Ok(status) => Err(Failure::lasting(format!("it ended with {status}"))),
            Err(e) => Err(Failure::lasting(format!("cannot wait for it: {e}"))),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_named_as_people_know_them() {
        let named = |event: Value| notify_name(&event);
        assert_eq!(
            named(json!({"event": "awaiting_answer"})),
            Some("needs_input")
        );
        assert_eq!(named(json!({"event": "no_progress"})), Some("no_progress"));
        assert_eq!(
            named(json!({"event": "failed", "error": "budget exceeded: $2 spent"})),
            Some("budget_reached")
        );
        assert_eq!(
            named(json!({"event": "failed", "error": "3 errors"})),
            Some("failed")
        );
        assert_eq!(named(json!({"event": "completed"})), Some("completed"));
        assert_eq!(
            named(json!({"event": "rate_limited"})),
            Some("rate_limited")
        );
        assert_eq!(named(json!({"event": "action_finished"})), None);
    }

    #[test]
    fn a_webhook_is_shown_without_its_secrets() {
        let uri: Uri = "https://bot:T0K3N@hooks.example:8443/hook/T0K3N?key=T0K3N"
            .parse()
            .unwrap();
        assert_eq!(
            Target::Webhook(uri.clone()).label(),
            "webhook https://hooks.example:8443"
        );
        let said = hide_secrets(
            &format!("bad uri: {uri}; user bot:T0K3N; at /hook/T0K3N?key=T0K3N"),
            &uri,
        );
        assert!(!said.contains("T0K3N"), "{said}");
        let plain: Uri = "http://127.0.0.1/".parse().unwrap();
        assert_eq!(origin(&plain), "http://127.0.0.1");
        assert_eq!(hide_secrets("io: refused", &plain), "io: refused");
    }
}
