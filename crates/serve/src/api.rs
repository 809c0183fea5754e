//! The service's local API: HTTP/JSON over a Unix socket in the runtime directory (mode 0600,
//! in a directory only its user can enter) and, with `--listen`, over TCP on a loopback address,
//! where every request needs the bearer token the service writes to `token` (0600) beside it.
//!
//! Every route is in `openapi.json` (served at `/openapi.json`). Loops are named by id, found in
//! the projects the service serves (`?root=` tells two of the same id apart). Handlers call the
//! same functions as the CLI (`set_control`, `choose_next`, `give_answer`, `add_task`,
//! `create_loop`, `retry_loop`, the checkpoints' `list`, `diff` and `rollback`), on a blocking
//! thread. A bad request gets a 4xx with `{"error": "..."}` and changes nothing.
//!
//! Two routes stream Server-Sent Events: a loop's events (`/events`, its event log, resumable by
//! event number) and the output of its attempt in flight (`/output`, its log read as it grows,
//! resumable by `LOG:OFFSET`, bounded whatever the executor writes: see `output`).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{Context as _, Result};
use axum::Router;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Json, Path as UrlPath, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use super::ServiceInfo;
use loopd_core::control::Change;
use loopd_file_driver::control::Control;
use loopd_file_driver::project::Project;
use loopd_fs::Dir;
use loopd_store::store::StoreError;

/// The OpenAPI document of this API, kept in the repository beside this file.
pub const OPENAPI: &str = include_str!("openapi.json");

/// What the handlers share: the service's status, as the supervisor last published it, and
/// every change of a served loop's state file, as the supervisor hears it.
#[derive(Clone)]
pub struct Shared {
    pub info: Arc<RwLock<ServiceInfo>>,
    pub changes: tokio::sync::broadcast::Sender<super::LoopKey>,
    /// The projects the service serves, opened once: a request reads through them rather than
    /// open every project (its configuration read, its directory opened) to find one loop.
    pub projects: Arc<RwLock<BTreeMap<PathBuf, Arc<Project>>>>,
    /// Loops another driver holds, listed and changed beside the projects' ([`super::Elsewhere`]).
    pub elsewhere: Option<Arc<dyn super::Elsewhere>>,
}

impl Default for Shared {
    fn default() -> Shared {
        Shared {
            info: Arc::default(),
            changes: tokio::sync::broadcast::channel(1024).0,
            projects: Arc::default(),
            elsewhere: None,
        }
    }
}

impl Shared {
    fn info(&self) -> ServiceInfo {
        self.info.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The projects served, in the order of their roots.
    fn projects(&self) -> Vec<Arc<Project>> {
        self.projects
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

/// How long a write to a client may make no progress before its connection is closed: a
/// client that stops reading (an event stream left open in a tab that sleeps) costs its own
/// connection only, and not for long.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How many connections each listener serves at once; the next waits to be accepted.
const MAX_CONNECTIONS: usize = 256;

/// A listener whose connections time out on writes that make no progress ([`WRITE_TIMEOUT`])
/// and whose number is bounded ([`MAX_CONNECTIONS`]).
struct Guarded<L> {
    listener: L,
    slots: Arc<tokio::sync::Semaphore>,
}

impl<L: axum::serve::Listener> Guarded<L> {
    fn new(listener: L) -> Guarded<L> {
        Guarded {
            listener,
            slots: Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS)),
        }
    }
}

/// An accepted connection: its stream, and its place among the connections served.
struct Connection<S> {
    stream: std::pin::Pin<Box<tokio_io_timeout::TimeoutStream<S>>>,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl<L: axum::serve::Listener> axum::serve::Listener for Guarded<L> {
    type Io = Connection<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (io, addr) = self.listener.accept().await;
        let mut stream = tokio_io_timeout::TimeoutStream::new(io);
        stream.set_write_timeout(Some(WRITE_TIMEOUT));
        let connection = Connection {
            stream: Box::pin(stream),
            _slot: slot,
        };
        (connection, addr)
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite> tokio::io::AsyncRead for Connection<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.stream.as_mut().poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite> tokio::io::AsyncWrite for Connection<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.stream.as_mut().poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.stream.as_mut().poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.stream.as_mut().poll_shutdown(cx)
    }
}

/// Where the API listens.
pub struct Listening {
    pub socket: PathBuf,
    pub listen: Option<SocketAddr>,
}

/// Starts the API: on the Unix socket `api.sock` of `runtime_dir`, and on `listen` (loopback
/// only) with the token, which is made anew and written to `token` (0600) there.
pub async fn start(
    shared: Shared,
    runtime_dir: &Dir,
    listen: Option<SocketAddr>,
) -> Result<Listening> {
    let socket = runtime_dir.join("api.sock");
    // A socket left by a service that died; the directory is the user's own (0700).
    if std::fs::symlink_metadata(&socket)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
    {
        let _ = runtime_dir.remove("api.sock");
    }
    let unix = tokio::net::UnixListener::bind(&socket)
        .with_context(|| format!("cannot listen on {}", socket.display()))?;
    std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    let local = router(shared.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(Guarded::new(unix), local).await {
            tracing::error!("the API's socket failed: {e}");
        }
    });
    let mut bound = None;
    if let Some(addr) = listen {
        let token = new_token()?;
        runtime_dir.write_atomic("token", token.as_bytes(), false)?;
        let tcp = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let addr = tcp.local_addr()?;
        let guarded = router(shared).layer(axum::middleware::from_fn_with_state(
            Arc::<str>::from(token.as_str()),
            require_token,
        ));
        // As Jupyter does: the link that logs a browser in.
        tracing::info!("dashboard: http://{}/?token={token}", tcp.local_addr()?);
        tokio::spawn(async move {
            if let Err(e) = axum::serve(Guarded::new(tcp), guarded).await {
                tracing::error!("the API's listener failed: {e}");
            }
        });
        tracing::info!(
            "API on http://{addr}/ (token in {})",
            runtime_dir.join("token").display()
        );
        bound = Some(addr);
    }
    tracing::info!("API on {}", socket.display());
    Ok(Listening {
        socket,
        listen: bound,
    })
}

/// Refuses an address that is not loopback: the API drives processes on this machine.
pub fn check_listen(addr: &SocketAddr) -> Result<()> {
    if addr.ip().is_loopback() {
        return Ok(());
    }
    Err(loopd_file_driver::error::usage(format!(
        "--listen {addr}: the API listens on a loopback address only (127.0.0.1 or [::1])"
    )))
}

/// 32 random bytes from the kernel, in hex.
fn new_token() -> Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot make a token")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The cookie a browser logged in with the token holds.
const SESSION_COOKIE: &str = "loopd_token";
/// The header every state-changing request of the dashboard sends: a cross-site form cannot.
const REQUEST_HEADER: &str = "x-loopd-request";

/// Every request over TCP shows the token: `Authorization: Bearer TOKEN`, or the session cookie
/// a browser got from the login link (`/?token=TOKEN`, which sets it and leaves the token out of
/// the address). A request on the cookie that changes anything must also carry
/// `X-Loopd-Request`, which no cross-site form or image can send.
async fn require_token(State(token): State<Arc<str>>, request: Request, next: Next) -> Response {
    let valid = |given: &str| same(given.as_bytes(), token.as_bytes());
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if bearer.is_some_and(valid) {
        return next.run(request).await;
    }
    let login = request
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("token=")));
    if request.uri().path() == "/" && login.is_some_and(valid) {
        let cookie = format!("{SESSION_COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/");
        return (
            StatusCode::SEE_OTHER,
            [
                (header::LOCATION, "/"),
                (header::SET_COOKIE, cookie.as_str()),
            ],
        )
            .into_response();
    }
    let cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(SESSION_COOKIE)?.strip_prefix('='));
    if cookie.is_some_and(valid) {
        let safe = matches!(
            *request.method(),
            axum::http::Method::GET | axum::http::Method::HEAD
        );
        if safe || headers.contains_key(REQUEST_HEADER) {
            return next.run(request).await;
        }
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "a change from the dashboard must carry X-Loopd-Request (cross-site requests are refused)",
        )
        .into_response();
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "a token is required: open the login link the service printed (http://ADDR/?token=...), \
         or send Authorization: Bearer TOKEN",
    )
    .into_response()
}

/// Compares in time that does not depend on where the two differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

fn router(shared: Shared) -> Router {
    Router::new()
        .route(
            "/",
            get(|| async { page("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/app.js",
            get(|| async { page("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/app.css",
            get(|| async { page("text/css; charset=utf-8", APP_CSS) }),
        )
        .route("/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .route("/v1/stream", get(stream))
        .route("/v1/service", get(service))
        .route("/v1/loops", get(list_loops).post(create))
        .route("/v1/loops/{id}", get(one_loop))
        // pause, resume and stop; the other routes' names come first.
        .route("/v1/loops/{id}/{control}", post(control))
        .route("/v1/loops/{id}/next", post(next))
        .route("/v1/loops/{id}/answer", post(answer))
        .route("/v1/loops/{id}/limits", post(set_limits))
        .route("/v1/loops/{id}/tasks", post(add_task))
        .route("/v1/loops/{id}/events", get(events))
        .route("/v1/loops/{id}/tail", get(tail))
        .route("/v1/loops/{id}/output", get(output))
        .route("/v1/loops/{id}/checkpoints", get(list_checkpoints))
        .route(
            "/v1/loops/{id}/checkpoints/{name}/diff",
            get(checkpoint_diff),
        )
        .route("/v1/loops/{id}/rollback", post(rollback))
        .route("/v1/loops/{id}/retry", post(retry))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed on this route",
            )
        })
        .with_state(shared)
}

/// A failed request: its status and one line.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

/// A refusal (bad input, a status change that makes no sense, a checkpoint that is not there or
/// a rollback that would lose changes) is the caller's; an unknown loop is not found; a state
/// file that does not load is a conflict; the rest is the service's.
impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> ApiError {
        let status = if e.is::<loopd_file_driver::error::UsageError>()
            || e.is::<loopd_exec::checkpoint::Refused>()
        {
            StatusCode::BAD_REQUEST
        } else {
            match e.downcast_ref::<StoreError>() {
                Some(StoreError::BadId(_)) => StatusCode::BAD_REQUEST,
                Some(StoreError::NotFound { .. }) => StatusCode::NOT_FOUND,
                Some(StoreError::Corrupt { .. } | StoreError::Refused(_)) => StatusCode::CONFLICT,
                Some(StoreError::Locked { .. }) => StatusCode::SERVICE_UNAVAILABLE,
                _ if e.is::<loopd_project::config::ConfigError>() => StatusCode::CONFLICT,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            }
        };
        ApiError::new(status, format!("{e:#}"))
    }
}

macro_rules! rejection {
    ($($t:ty),*) => {$(
        impl From<$t> for ApiError {
            fn from(r: $t) -> ApiError {
                ApiError::new(r.status(), r.body_text())
            }
        }
    )*};
}
rejection!(JsonRejection, PathRejection, QueryRejection);

type ApiResult<T> = std::result::Result<T, ApiError>;

/// Runs `f` on a blocking thread: the store waits for locks, and reads and writes files.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(ApiError::from)
}

/// Runs `f` on a blocking thread with the project of the service that holds loop `id` ([`find`]),
/// for a read.
async fn on_loop<T: Send + 'static>(
    shared: &Shared,
    id: String,
    root: Option<PathBuf>,
    f: impl FnOnce(&Project, &str) -> Result<T> + Send + 'static,
) -> ApiResult<T> {
    let shared = shared.clone();
    blocking(move || f(&*find(&shared, &id, root.as_deref())?, &id)).await
}

/// [`on_loop`] for a change: with the project opened anew (its configuration as it is now, as
/// the CLI would read it).
async fn on_loop_to_change<T: Send + 'static>(
    shared: &Shared,
    id: String,
    root: Option<PathBuf>,
    f: impl FnOnce(&Project, &str) -> Result<T> + Send + 'static,
) -> ApiResult<T> {
    let shared = shared.clone();
    blocking(move || {
        let found = find(&shared, &id, root.as_deref())?;
        f(&Project::open_for_inspection(Some(&found.root), None)?, &id)
    })
    .await
}

/// `?root=DIR`: which project, where two have a loop of the same id.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Where {
    root: Option<PathBuf>,
}

/// The project of the service that holds loop `id`.
fn find(shared: &Shared, id: &str, root: Option<&Path>) -> Result<Arc<Project>> {
    loopd_store::store::validate_id(id)?;
    if let Some(root) = root
        && !shared.info().serves(root)
    {
        return Err(loopd_file_driver::error::usage(format!(
            "{} is not a project of this service",
            root.display()
        )));
    }
    let mut found = Vec::new();
    for p in shared
        .projects()
        .into_iter()
        .filter(|p| root.is_none_or(|root| root == p.root))
    {
        if p.store.state_path(id).exists() {
            found.push(p);
        }
    }
    match found.len() {
        0 => Err(StoreError::NotFound {
            id: id.to_owned(),
            path: PathBuf::from(id),
        }
        .into()),
        1 => Ok(found.remove(0)),
        _ => Err(loopd_file_driver::error::usage(format!(
            "loop {id} is in more than one project; name one with ?root="
        ))),
    }
}

/// A loop as the API shows it: where it is, its status and usage, and its view.
fn summary(p: &Project, state: &loopd_core::state::LoopState, info: &ServiceInfo) -> Value {
    let view = loopd_file_driver::view::LoopView::of(p, state, Some(info));
    let skill = state.skill_state.as_ref();
    json!({
        "root": p.root,
        "status": state.status.as_str(),
        "errors": skill.map_or(0, |s| s.error_count),
        "max_errors": state.max_errors_or(p.config.max_errors),
        "usage": skill.map(|s| &s.usage),
        "last_event": last_event(p, &state.loop_id),
        "view": view,
    })
}

/// The last line of a loop's event log, if it has one (the log is not made by looking).
fn last_event(p: &Project, id: &str) -> Option<Value> {
    let progress = p
        .store
        .state_dir(false)
        .ok()?
        .subdir(&format!("{id}.progress"), false)
        .ok()?;
    let text = progress.read_tail(loopd_store::events::EVENTS, 4096)?;
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?;
    serde_json::from_str(line).ok()
}

/// The dashboard, embedded in the binary.
const INDEX: &str = include_str!("web/index.html");
const APP_JS: &str = include_str!("web/app.js");
const APP_CSS: &str = include_str!("web/app.css");

fn page(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; frame-ancestors 'none'",
            ),
        ],
        body,
    )
        .into_response()
}

/// Every change of a served loop's state file, as Server-Sent Events: `{root, loop_id}` each
/// (a `rescan` event when some were missed). The dashboard refreshes on them.
async fn stream(State(shared): State<Shared>) -> impl IntoResponse {
    let changes = shared.changes.subscribe();
    let stream = futures_util::stream::unfold(changes, |mut changes| async move {
        let event = match changes.recv().await {
            Ok(key) => SseEvent::default().data(json!(key).to_string()),
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                SseEvent::default().event("rescan").data("{}")
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
        };
        Some((Ok::<_, Infallible>(event), changes))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

/// `GET /metrics`: loopd's metrics ([`loopd_exec::metrics`]), with the loops of the file store
/// by status as they are now.
async fn metrics(State(shared): State<Shared>) -> ApiResult<Response> {
    let projects = shared.projects();
    let statuses = blocking(move || {
        let mut statuses = Vec::new();
        for p in &projects {
            for id in p.store.list_ids()? {
                if let Ok(loaded) = p.store.load(&id) {
                    statuses.push(loaded.state.status.as_str().to_owned());
                }
            }
        }
        Ok(statuses)
    })
    .await?;
    let metrics = loopd_exec::metrics::metrics();
    metrics.set_loops(statuses.iter().map(String::as_str));
    let content_type = [(header::CONTENT_TYPE, loopd_exec::metrics::CONTENT_TYPE)];
    Ok((content_type, metrics.encode()).into_response())
}

async fn service(State(shared): State<Shared>) -> Json<ServiceInfo> {
    Json(shared.info())
}

async fn list_loops(State(shared): State<Shared>) -> ApiResult<Json<Value>> {
    let info = shared.info();
    let projects = shared.projects();
    let shown = info.clone();
    let mut loops = blocking(move || {
        let info = shown;
        let mut loops = Vec::new();
        for p in &projects {
            let root = &p.root;
            for id in p.store.list_ids()? {
                match p.store.load(&id) {
                    Ok(loaded) => loops.push(summary(p, &loaded.state, &info)),
                    Err(e) => loops.push(json!({
                        "root": root, "status": "unreadable", "error": e.to_string(),
                        "view": { "loop_id": id },
                    })),
                }
            }
        }
        Ok(loops)
    })
    .await?;
    if let Some(other) = shared.elsewhere.clone() {
        let held = other.loops().await?;
        let driver = other.name();
        loops.extend(
            blocking(move || {
                Ok(held
                    .iter()
                    .map(|(root, state)| held_summary(root, state, driver, &info))
                    .collect::<Vec<_>>())
            })
            .await?,
        );
    }
    Ok(Json(Value::Array(loops)))
}

/// A loop another driver holds, as the API shows a loop ([`summary`]), with `driver` naming
/// where it lives. Its project's settings are read where its root is on this machine.
fn held_summary(
    root: &Path,
    state: &loopd_core::state::LoopState,
    driver: &str,
    info: &ServiceInfo,
) -> Value {
    let mut value = match Project::open_for_inspection(Some(root), None) {
        Ok(p) => summary(&p, state, info),
        Err(_) => json!({
            "root": root,
            "status": state.status.as_str(),
            "view": { "loop_id": state.loop_id, "title": state.title,
                      "iteration": state.current_iteration },
        }),
    };
    value["driver"] = json!(driver);
    // No daemon of this service drives it: its standing is its own.
    value["view"]["standing"] = json!(state.standing());
    value["view"]["daemon_pid"] = Value::Null;
    value
}

async fn one_loop(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place), info) = (id?, place?, shared.info());
    let shown = info.clone();
    let local = on_loop(&shared, id.clone(), place.root, move |p, id| {
        let loaded = p.store.load(id)?;
        let mut value = summary(p, &loaded.state, &shown);
        value["state"] = Value::Object(loaded.raw);
        Ok(Json(value))
    })
    .await;
    match (local, shared.elsewhere.clone()) {
        (Err(e), Some(other)) if e.status == StatusCode::NOT_FOUND => {
            let Some((root, state)) = other.get(&id).await? else {
                return Err(e);
            };
            blocking(move || {
                let mut value = held_summary(&root, &state, other.name(), &info);
                value["state"] = serde_json::to_value(&state)?;
                Ok(Json(value))
            })
            .await
        }
        (local, _) => local,
    }
}

/// A change to loop `id`: made by `local` where a project of the service holds the loop, else
/// by the driver that holds it elsewhere, whose answer `remote` shapes.
async fn change_loop<T: Send + 'static>(
    shared: &Shared,
    id: String,
    root: Option<PathBuf>,
    change: Change,
    local: impl FnOnce(&Project, &str) -> Result<T> + Send + 'static,
    remote: impl FnOnce(Value) -> T,
) -> ApiResult<T> {
    match (
        on_loop_to_change(shared, id.clone(), root, local).await,
        &shared.elsewhere,
    ) {
        (Err(e), Some(other)) if e.status == StatusCode::NOT_FOUND => {
            if other.get(&id).await?.is_none() {
                return Err(e);
            }
            let said = other
                .change(&id, change)
                .await
                .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("{e:#}")))?;
            Ok(remote(said))
        }
        (local, _) => local,
    }
}

/// What `POST /v1/loops` takes: `loopd create`'s options.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    root: PathBuf,
    title: Option<String>,
    #[serde(default)]
    description: String,
    workflow: Option<String>,
    #[serde(default)]
    interactive: bool,
    #[serde(default)]
    tasks: Vec<String>,
    max_iterations: Option<u64>,
    max_errors: Option<u64>,
    max_cost_usd: Option<f64>,
    max_tokens: Option<u64>,
    parallel: Option<u64>,
}

async fn create(
    State(shared): State<Shared>,
    body: std::result::Result<Json<CreateRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let (Json(request), info) = (body?, shared.info());
    blocking(move || {
        if !info.serves(&request.root) {
            return Err(loopd_file_driver::error::usage(format!(
                "{} is not a project of this service",
                request.root.display()
            )));
        }
        let p = Project::open(Some(&request.root), None)?;
        let args = loopd_file_driver::create::CreateArgs {
            title: request.title,
            description: request.description,
            limits: loopd_file_driver::create::Limits {
                max_iterations: request.max_iterations,
                max_errors: request.max_errors,
                max_cost_usd: request.max_cost_usd,
                max_tokens: request.max_tokens,
                parallel: request.parallel,
            },
            mode: if request.interactive {
                loopd_file_driver::create::ModeArg::Interactive
            } else {
                loopd_file_driver::create::ModeArg::Auto
            },
            workflow: request.workflow,
            tasks: request.tasks,
            ..Default::default()
        };
        let id = loopd_file_driver::create::create_loop(&p, &args)?;
        Ok((
            StatusCode::CREATED,
            Json(json!({ "loop_id": id, "root": p.root })),
        ))
    })
    .await
}

/// pause, resume, stop: as the CLI does; the service takes up a resumed loop itself.
async fn control(
    State(shared): State<Shared>,
    path: std::result::Result<UrlPath<(String, String)>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath((id, verb)), Query(place)) = (path?, place?);
    let what = match verb.as_str() {
        "pause" => Control::Pause,
        "resume" => Control::Resume,
        "stop" => Control::Stop,
        _ => return Err(ApiError::new(StatusCode::NOT_FOUND, "no such route")),
    };
    let local = move |p: &Project, id: &str| {
        let done = loopd_file_driver::control::set_control(
            p,
            id,
            what,
            loopd_file_driver::control::BY_API,
        )?;
        Ok(Json(json!({
            "loop_id": id,
            "from": done.from.as_str(),
            "status": done.to.as_str(),
            "changed": done.changed,
        })))
    };
    change_loop(&shared, id, place.root, Change::Control(what), local, Json).await
}

/// A body of one text: `{"action": ...}` or `{"text": ...}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Choice {
    action: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Text {
    text: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTask {
    text: String,
    #[serde(default)]
    after: Vec<String>,
    #[serde(default)]
    race: Vec<String>,
}

async fn next(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<Choice>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place), Json(choice)) = (id?, place?, body?);
    let change = Change::Next(choice.action.clone());
    let local = move |p: &Project, id: &str| {
        Ok(Json(loopd_file_driver::control::choose_next(
            p,
            id,
            &choice.action,
        )?))
    };
    change_loop(&shared, id, place.root, change, local, Json).await
}

/// `loopd set`: a loop's limits and budgets, those given only.
async fn set_limits(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<loopd_file_driver::create::Limits>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place), Json(limits)) = (id?, place?, body?);
    let change = Change::Set(loopd_core::control::SetLimits {
        max_iterations: limits.max_iterations,
        max_errors: limits.max_errors,
        max_cost_usd: limits.max_cost_usd,
        max_tokens: limits.max_tokens,
        parallel: limits.parallel,
    });
    let local = move |p: &Project, id: &str| {
        Ok(Json(loopd_file_driver::control::set_limits(
            p, id, &limits,
        )?))
    };
    change_loop(&shared, id, place.root, change, local, Json).await
}

async fn answer(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<Text>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place), Json(text)) = (id?, place?, body?);
    let change = Change::Answer(text.text.clone());
    let local = move |p: &Project, id: &str| {
        Ok(Json(loopd_file_driver::control::give_answer(
            p, id, &text.text,
        )?))
    };
    change_loop(&shared, id, place.root, change, local, Json).await
}

async fn add_task(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<NewTask>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let (UrlPath(id), Query(place), Json(task)) = (id?, place?, body?);
    let change = Change::Task(loopd_core::control::NewTask::new(
        &task.text,
        &task.after,
        &task.race,
    ));
    let local = move |p: &Project, id: &str| {
        let value =
            loopd_file_driver::control::add_task(p, id, &task.text, &task.after, &task.race)?;
        Ok((StatusCode::CREATED, Json(value)))
    };
    let remote = |said| (StatusCode::CREATED, Json(said));
    change_loop(&shared, id, place.root, change, local, remote).await
}

/// `?after=N`: events after the Nth (what `Last-Event-ID` says, for clients that cannot set
/// headers).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct After {
    root: Option<PathBuf>,
    after: Option<u64>,
}

/// The events of a loop as Server-Sent Events: each event's id is its number in the event log
/// (from 1), so that a client that reconnects with `Last-Event-ID` gets what it missed and
/// nothing twice. The log is read as `logs --follow` reads it ([`loopd_store::events::EventTail`],
/// across rotations); new events come as they are written (the progress directory is watched).
async fn events(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    query: std::result::Result<Query<After>, QueryRejection>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let (UrlPath(id), Query(query)) = (id?, query?);
    let last = headers
        .get("last-event-id")
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    ApiError::new(StatusCode::BAD_REQUEST, "Last-Event-ID: not an event id")
                })
        })
        .transpose()?;
    let root = query.root;
    let skip = last.or(query.after).unwrap_or(0);
    let elsewhere = shared.elsewhere.clone();
    let found = blocking({
        let id = id.clone();
        move || {
            let p = find(&shared, &id, root.as_deref())?;
            let dir = p.store.progress(&id)?;
            Ok((loopd_store::events::EventTail::new(&p.store, &id), dir))
        }
    })
    .await;
    let (store, dir) = match (found, elsewhere) {
        (Err(e), Some(other)) if e.status == StatusCode::NOT_FOUND => {
            if other.get(&id).await?.is_none() {
                return Err(e);
            }
            return Ok(held_events(other.events(&id).await?, skip));
        }
        (found, _) => found?,
    };
    let wake = Arc::new(tokio::sync::Notify::new());
    let subscription = {
        let wake = wake.clone();
        loopd_store::watch::subscribe(
            dir.path(),
            Arc::new(move |_: &notify::Result<notify::Event>| wake.notify_one()),
        )
    };
    let events = Events {
        tail: Some(store),
        skip,
        seen: 0,
        pending: std::collections::VecDeque::new(),
        wake,
        _subscription: subscription,
    };
    let stream = futures_util::stream::unfold(events, |mut events| async move {
        let event = events.next().await?;
        Some((Ok::<_, Infallible>(event), events))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// The events of a loop another driver holds, after the `skip`th, as Server-Sent Events numbered
/// as in [`events`]; the stream ends there, and the client's reconnection (every
/// [`HELD_EVENTS_RETRY`], with `Last-Event-ID`) brings what came since.
fn held_events(all: Vec<Value>, skip: u64) -> Response {
    let retry = SseEvent::default()
        .retry(HELD_EVENTS_RETRY)
        .comment("held elsewhere");
    let events = all
        .into_iter()
        .enumerate()
        .skip(usize::try_from(skip).unwrap_or(usize::MAX))
        .map(|(i, event)| {
            SseEvent::default()
                .id((i + 1).to_string())
                .data(event.to_string())
        });
    let stream = futures_util::stream::iter(
        std::iter::once(retry)
            .chain(events)
            .map(Ok::<_, Infallible>),
    );
    Sse::new(stream).into_response()
}

/// How soon a client reconnects to the events of a loop another driver holds.
const HELD_EVENTS_RETRY: Duration = Duration::from_secs(2);

/// A loop's events for one client: the lines read, numbered, those it has seen left out.
struct Events {
    /// Taken while a blocking thread reads.
    tail: Option<loopd_store::events::EventTail>,
    /// The client has seen the events up to this number.
    skip: u64,
    /// The number of the last line read.
    seen: u64,
    pending: std::collections::VecDeque<SseEvent>,
    wake: Arc<tokio::sync::Notify>,
    _subscription: loopd_store::watch::Subscription,
}

impl Events {
    /// The next event; `None` ends the stream (the log cannot be read).
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            let mut tail = self.tail.take()?;
            let (tail, read) = tokio::task::spawn_blocking(move || {
                let read = tail.read_lines();
                (tail, read)
            })
            .await
            .ok()?;
            self.tail = Some(tail);
            for line in read.ok()? {
                self.seen += 1;
                if self.seen > self.skip {
                    let event = SseEvent::default().id(self.seen.to_string()).data(line);
                    self.pending.push_back(event);
                }
            }
            if self.pending.is_empty() {
                // A rare look even without an event, in case one was missed.
                let _ = tokio::time::timeout(Duration::from_secs(5), self.wake.notified()).await;
            }
        }
    }
}

/// `?bytes=N`: how much of the tail (at most 1 MiB).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TailQuery {
    root: Option<PathBuf>,
    bytes: Option<u64>,
}

/// The tail of the log of the attempt in flight (`null` text when none is in flight).
async fn tail(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    query: std::result::Result<Query<TailQuery>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(query)) = (id?, query?);
    let want = query.bytes.unwrap_or(16 * 1024).min(1 << 20);
    let local = on_loop(&shared, id.clone(), query.root, move |p, id| {
        let state = p.store.load(id)?.state;
        let flight = state.skill_state.as_ref().and_then(|s| s.in_flight.clone());
        let Some(flight) = flight else {
            return Ok(Json(
                json!({ "loop_id": id, "in_flight": null, "text": null }),
            ));
        };
        // The attempt's log, by its name alone, in the progress directory.
        let text = flight
            .log
            .as_deref()
            .filter(|name| plain_name(name))
            .and_then(|name| {
                let actions = p.store.progress(id).ok()?.subdir("actions", false).ok()?;
                actions.read_tail(name, want)
            });
        Ok(Json(json!({
            "loop_id": id,
            "in_flight": {
                "action": flight.action,
                "iteration": flight.iteration,
                "attempt": flight.attempt,
                "pid": flight.pid,
                "started_at": flight.started_at,
            },
            "text": text,
        })))
    })
    .await;
    match (local, shared.elsewhere.clone()) {
        (Err(e), Some(other)) if e.status == StatusCode::NOT_FOUND => {
            if other.get(&id).await?.is_none() {
                return Err(e);
            }
            Ok(Json(other.tail(&id).await?))
        }
        (local, _) => local,
    }
}

/// What only the loops of this service's projects have, asked of a loop another driver holds:
/// refused in one line (`what` says what, for loop `id`). Any other answer is `local`'s.
async fn not_held<T>(
    shared: &Shared,
    id: &str,
    local: ApiResult<T>,
    what: impl FnOnce(&str) -> String,
) -> ApiResult<T> {
    match (local, &shared.elsewhere) {
        (Err(e), Some(other)) if e.status == StatusCode::NOT_FOUND => {
            if other.get(id).await?.is_none() {
                return Err(e);
            }
            Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("{}: {} holds loop {id}", what(id), other.name()),
            ))
        }
        (local, _) => local,
    }
}

/// `loopd checkpoints --json`: the loop's checkpoints, oldest first, with what each changed.
async fn list_checkpoints(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place)) = (id?, place?);
    let local = on_loop(&shared, id.clone(), place.root, |p, id| {
        let list = loopd_file_driver::checkpoints::list(p, id)?;
        Ok(Json(json!({ "loop_id": id, "checkpoints": list })))
    })
    .await;
    not_held(&shared, &id, local, checkpoints_not_here).await
}

/// The refusal of checkpoints, a diff or a rollback of a loop another driver holds.
fn checkpoints_not_here(id: &str) -> String {
    format!("the checkpoints of loop {id} are not served here")
}

/// What one checkpoint changed, file by file and hunk by hunk, bounded
/// ([`loopd_file_driver::checkpoints::diff`]).
async fn checkpoint_diff(
    State(shared): State<Shared>,
    path: std::result::Result<UrlPath<(String, String)>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
) -> ApiResult<Json<loopd_file_driver::checkpoints::Diff>> {
    let (UrlPath((id, name)), Query(place)) = (path?, place?);
    let local = on_loop(&shared, id.clone(), place.root, move |p, id| {
        Ok(Json(loopd_file_driver::checkpoints::diff(p, id, &name)?))
    })
    .await;
    not_held(&shared, &id, local, checkpoints_not_here).await
}

/// What `POST .../rollback` takes: `loopd rollback`'s arguments.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RollbackRequest {
    checkpoint: String,
    #[serde(default)]
    force: bool,
}

/// `loopd rollback`: the work tree back as it was at a checkpoint; refused while a daemon drives
/// the running loop, or when the work tree holds changes no checkpoint holds (unless `force`).
async fn rollback(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<RollbackRequest>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place), Json(request)) = (id?, place?, body?);
    let local = on_loop_to_change(&shared, id.clone(), place.root, move |p, id| {
        let commit =
            loopd_file_driver::checkpoints::rollback(p, id, &request.checkpoint, request.force)?;
        Ok(Json(json!({
            "loop_id": id,
            "checkpoint": request.checkpoint,
            "commit": commit,
        })))
    })
    .await;
    not_held(&shared, &id, local, checkpoints_not_here).await
}

/// `loopd retry`, the state change only: the service takes the loop up itself, as after a
/// resume. The project is opened as the command line opens it: a config that does not load is
/// refused rather than replaced by the defaults.
async fn retry(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place)) = (id?, place?);
    let local = on_loop_to_change(&shared, id.clone(), place.root, |p, id| {
        let p = Project::open(Some(&p.root), None)?;
        let retried =
            loopd_file_driver::control::retry_loop(&p, id, loopd_file_driver::control::BY_API)?;
        Ok(Json(json!({
            "loop_id": id,
            "from": retried.from.as_str(),
            "status": loopd_core::state::Status::Running.as_str(),
            "tasks_reset": retried.tasks_reset,
        })))
    })
    .await;
    not_held(&shared, &id, local, |id| {
        format!("loop {id} is not retried here")
    })
    .await
}

/// The most of a log one `output` event carries, and what a reader starts with (at connect, or
/// after a jump).
const OUTPUT_CHUNK: u64 = 16 * 1024;
/// How far behind the end of a log a reader may fall before it jumps to its last
/// [`OUTPUT_CHUNK`]: what a client is sent is bounded whatever an executor writes.
const OUTPUT_BEHIND: u64 = 256 * 1024;
/// How many chunks one look reads at most.
const OUTPUT_CHUNKS_PER_LOOK: usize = 4;
/// The least time between two looks for one client: a log written line by line costs a read per
/// 100 ms, not one per line.
const OUTPUT_GAP: Duration = Duration::from_millis(100);
/// The longest a client goes without a look, in case a file event was missed.
const OUTPUT_FALLBACK: Duration = Duration::from_secs(1);
/// How often the output of a loop another driver holds is asked for.
const HELD_OUTPUT_POLL: Duration = Duration::from_secs(1);

/// The output of a loop's attempt in flight as Server-Sent Events, pushed as its log grows:
///
/// - `attempt` `{action, iteration, attempt, task_id, pid, started_at, log}` when an attempt is
///   in flight at connect, and whenever another one is;
/// - `output` `{log, offset, text}`, id `LOG:END`: at most [`OUTPUT_CHUNK`] of the log from byte
///   `offset` to `END`, cut at a character's boundary (bytes that are not UTF-8 replaced);
/// - `skipped` `{log, bytes}`: what was left out, at connect (a reader starts at the log's last
///   [`OUTPUT_CHUNK`]) and when the reader fell more than [`OUTPUT_BEHIND`] behind;
/// - `idle` `{}` at connect when nothing is in flight, and when the attempt ends.
///
/// A client that reconnects with `Last-Event-ID: LOG:OFFSET` goes on at OFFSET while LOG is the
/// attempt in flight's log. Looks are woken by the loop's files (its progress directory and the
/// logs' `actions/`) and by its state file's changes, at most one per [`OUTPUT_GAP`] and at least
/// one per [`OUTPUT_FALLBACK`]. A log is opened by its name alone in `actions/`.
async fn output(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let (UrlPath(id), Query(place)) = (id?, place?);
    let resume = headers
        .get("last-event-id")
        .map(|v| {
            v.to_str().ok().and_then(output_id).ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "Last-Event-ID: not an output id (LOG:OFFSET)",
                )
            })
        })
        .transpose()?;
    let found = blocking({
        let (shared, id) = (shared.clone(), id.clone());
        move || {
            let p = find(&shared, &id, place.root.as_deref())?;
            let progress = p.store.progress(&id)?;
            Ok((p, progress))
        }
    })
    .await;
    let (project, progress) = match (found, shared.elsewhere.clone()) {
        (Err(e), Some(other)) if e.status == StatusCode::NOT_FOUND => {
            if other.get(&id).await?.is_none() {
                return Err(e);
            }
            return Ok(held_output(other, id));
        }
        (found, _) => found?,
    };
    let wake = Arc::new(tokio::sync::Notify::new());
    let look_at_state = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let subscription = {
        let (wake, look_at_state) = (wake.clone(), look_at_state.clone());
        loopd_store::watch::subscribe(
            progress.path(),
            Arc::new(move |_: &notify::Result<notify::Event>| {
                look_at_state.store(true, std::sync::atomic::Ordering::SeqCst);
                wake.notify_one();
            }),
        )
    };
    let key = loopd_file_driver::service::LoopKey {
        root: project.root.clone(),
        loop_id: id.clone(),
    };
    let stream = OutputStream {
        reader: Some(OutputReader {
            project,
            id,
            progress,
            actions: None,
            wake: wake.clone(),
            resume,
            following: None,
            idle: false,
        }),
        pending: std::collections::VecDeque::new(),
        wake,
        look_at_state,
        changes: Some(shared.changes.subscribe()),
        key,
        last_look: None,
        _subscription: subscription,
    };
    let stream = futures_util::stream::unfold(stream, |mut stream| async move {
        let event = stream.next().await?;
        Some((Ok::<_, Infallible>(event), stream))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// An output event's id, `LOG:OFFSET`: the log's name and a byte offset in it.
fn output_id(id: &str) -> Option<(String, u64)> {
    let (log, offset) = id.trim().rsplit_once(':')?;
    if !plain_name(log) {
        return None;
    }
    Some((log.to_owned(), offset.parse().ok()?))
}

/// Whether `name` is one plain file name (not `.` or `..`, no `/`, no control characters): a
/// log's name is opened in `actions/` and nowhere else.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.chars().any(char::is_control)
}

/// One client's stream of a loop's output: what it waits on, and its reader.
struct OutputStream {
    /// Taken while a blocking thread reads.
    reader: Option<OutputReader>,
    pending: std::collections::VecDeque<SseEvent>,
    /// Woken by a change in the progress directory or in `actions/`.
    wake: Arc<tokio::sync::Notify>,
    /// The state file may have changed (the attempt in flight with it): read it at the next look.
    look_at_state: Arc<std::sync::atomic::AtomicBool>,
    /// The changes of every served loop's state file; `None` once the service stops publishing.
    changes: Option<tokio::sync::broadcast::Receiver<loopd_file_driver::service::LoopKey>>,
    key: loopd_file_driver::service::LoopKey,
    last_look: Option<tokio::time::Instant>,
    _subscription: loopd_store::watch::Subscription,
}

impl OutputStream {
    /// The next event; `None` ends the stream (the loop is gone, or its files cannot be read).
    async fn next(&mut self) -> Option<SseEvent> {
        use std::sync::atomic::Ordering;
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if let Some(last) = self.last_look {
                tokio::time::sleep_until(last + OUTPUT_GAP).await;
            }
            let state = self.look_at_state.swap(false, Ordering::SeqCst);
            let mut reader = self.reader.take()?;
            let (reader, said) = tokio::task::spawn_blocking(move || {
                let said = reader.look(state);
                (reader, said)
            })
            .await
            .ok()?;
            self.reader = Some(reader);
            self.last_look = Some(tokio::time::Instant::now());
            self.pending.extend(said?);
            if self.pending.is_empty() {
                self.wait().await;
            }
        }
    }

    /// Waits for a change of the loop's files or of its state file, at most
    /// [`OUTPUT_FALLBACK`] (then the state is looked at too).
    async fn wait(&mut self) {
        use std::sync::atomic::Ordering;
        use tokio::sync::broadcast::error::RecvError;
        let deadline = tokio::time::Instant::now() + OUTPUT_FALLBACK;
        loop {
            let changed = async {
                match &mut self.changes {
                    Some(changes) => Some(changes.recv().await),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.wake.notified() => return,
                () = tokio::time::sleep_until(deadline) => break,
                heard = changed => match heard {
                    Some(Ok(key)) if key != self.key => continue,
                    Some(Err(RecvError::Closed)) => self.changes = None,
                    // This loop's state file, or some changes were missed.
                    _ => break,
                },
            }
        }
        self.look_at_state.store(true, Ordering::SeqCst);
    }
}

/// What one client has read of a loop's output: the attempt it follows and where it is in its
/// log. Moved to a blocking thread for each look.
struct OutputReader {
    project: Arc<Project>,
    id: String,
    progress: Dir,
    /// The progress directory's `actions/` and its watch, once it exists.
    actions: Option<(Dir, loopd_store::watch::Subscription)>,
    wake: Arc<tokio::sync::Notify>,
    /// What `Last-Event-ID` asked for, until the first log is placed.
    resume: Option<(String, u64)>,
    following: Option<Followed>,
    /// `idle` is the last said of the attempts.
    idle: bool,
}

/// The attempt a reader follows.
struct Followed {
    flight: loopd_core::state::InFlight,
    /// Where the next read of its log starts; `None` until the log is placed (it may not be
    /// there yet).
    offset: Option<u64>,
}

/// Whether two records of the attempt in flight are of the same attempt.
fn same_attempt(a: &loopd_core::state::InFlight, b: &loopd_core::state::InFlight) -> bool {
    (&a.log, &a.action, a.iteration, a.attempt, &a.started_at)
        == (&b.log, &b.action, b.iteration, b.attempt, &b.started_at)
}

/// One read of a log: what was left out before it, and its chunks, each `(offset, end, text)`.
#[derive(Debug, Default, PartialEq)]
struct LogRead {
    skipped: u64,
    chunks: Vec<(u64, u64, String)>,
    /// Where the next read starts.
    next: u64,
}

impl OutputReader {
    /// One look: at the state file's attempt in flight when `state` (it may have changed), then
    /// at its log. The events to send; `None` when the loop is gone.
    fn look(&mut self, state: bool) -> Option<Vec<SseEvent>> {
        let mut said = Vec::new();
        if state {
            match self.project.store.load(&self.id) {
                Ok(loaded) => {
                    let flight = loaded
                        .state
                        .skill_state
                        .as_ref()
                        .and_then(|s| s.in_flight.clone());
                    self.see(flight, &mut said);
                }
                Err(StoreError::NotFound { .. }) => return None,
                // Unreadable for now (being replaced by another program): looked at again.
                Err(_) => {}
            }
        }
        self.read(&mut said);
        Some(said)
    }

    /// Takes in the attempt in flight as the state file has it.
    fn see(&mut self, flight: Option<loopd_core::state::InFlight>, said: &mut Vec<SseEvent>) {
        match (flight, &self.following) {
            (Some(flight), Some(followed)) if same_attempt(&flight, &followed.flight) => {}
            (Some(flight), _) => {
                said.push(
                    SseEvent::default().event("attempt").data(
                        json!({
                            "action": flight.action,
                            "iteration": flight.iteration,
                            "attempt": flight.attempt,
                            "task_id": flight.task_id,
                            "pid": flight.pid,
                            "started_at": flight.started_at,
                            "log": flight.log,
                        })
                        .to_string(),
                    ),
                );
                self.following = Some(Followed {
                    flight,
                    offset: None,
                });
                self.idle = false;
            }
            (None, Some(_)) => {
                // What the attempt wrote last, then its end.
                self.read(said);
                self.following = None;
                said.push(idle_event());
                self.idle = true;
            }
            (None, None) if !self.idle => {
                said.push(idle_event());
                self.idle = true;
            }
            (None, None) => {}
        }
    }

    /// Reads what the followed attempt's log holds past where the reader is.
    fn read(&mut self, said: &mut Vec<SseEvent>) {
        let Some(followed) = &mut self.following else {
            return;
        };
        let Some(log) = followed.flight.log.clone().filter(|l| plain_name(l)) else {
            return;
        };
        if self.actions.is_none() {
            let Ok(actions) = self.progress.subdir("actions", false) else {
                return; // not made yet
            };
            let wake = self.wake.clone();
            let subscription = loopd_store::watch::subscribe(
                actions.path(),
                Arc::new(move |_: &notify::Result<notify::Event>| wake.notify_one()),
            );
            self.actions = Some((actions, subscription));
        }
        let Some((actions, _)) = &self.actions else {
            return;
        };
        let Ok(file) = actions.open_read(&log) else {
            return; // not there yet, or not a plain file
        };
        let Ok(len) = file.metadata().map(|m| m.len()) else {
            return;
        };
        let from = match followed.offset {
            Some(offset) => Some(offset),
            None => self
                .resume
                .take()
                .filter(|(name, offset)| *name == log && *offset <= len)
                .map(|(_, offset)| offset),
        };
        let Ok(read) = read_log(&file, len, from) else {
            return;
        };
        followed.offset = Some(read.next);
        if read.skipped > 0 {
            said.push(
                SseEvent::default()
                    .event("skipped")
                    .data(json!({ "log": log, "bytes": read.skipped }).to_string()),
            );
        }
        for (offset, end, text) in read.chunks {
            said.push(
                SseEvent::default()
                    .event("output")
                    .id(format!("{log}:{end}"))
                    .data(json!({ "log": log, "offset": offset, "text": text }).to_string()),
            );
        }
    }
}

fn idle_event() -> SseEvent {
    SseEvent::default().event("idle").data("{}")
}

/// Reads `file` (`len` bytes long) from `from`, or from its last [`OUTPUT_CHUNK`] when `None`,
/// past an offset beyond its end (the file was emptied and written anew), or when that is more
/// than [`OUTPUT_BEHIND`] behind: then what is left out is `skipped`. At most
/// [`OUTPUT_CHUNKS_PER_LOOK`] chunks of [`OUTPUT_CHUNK`], each ending at a character's boundary:
/// a character not written whole yet is read again with its end.
fn read_log(file: &std::fs::File, len: u64, from: Option<u64>) -> std::io::Result<LogRead> {
    let start = from.map(|from| if from > len { 0 } else { from });
    let mut offset = match start {
        Some(start) if len - start <= OUTPUT_BEHIND => start,
        _ => len.saturating_sub(OUTPUT_CHUNK),
    };
    let mut read = LogRead {
        skipped: offset - start.unwrap_or(0),
        ..LogRead::default()
    };
    // Where the reader jumped, it may have landed inside a character.
    let mut align = read.skipped > 0;
    for _ in 0..OUTPUT_CHUNKS_PER_LOOK {
        if offset >= len {
            break;
        }
        let want = usize::try_from((len - offset).min(OUTPUT_CHUNK)).unwrap_or(0);
        let mut bytes = vec![0u8; want];
        let got = read_at(file, &mut bytes, offset)?;
        bytes.truncate(got);
        let mut start = 0;
        if std::mem::take(&mut align) {
            start = bytes
                .iter()
                .take(3)
                .take_while(|b| **b & 0xC0 == 0x80)
                .count();
            read.skipped += start as u64;
        }
        let end = bytes.len() - incomplete_tail(&bytes[start..]);
        if end <= start {
            offset += start as u64;
            break; // a character not written whole yet
        }
        let text = String::from_utf8_lossy(&bytes[start..end]).into_owned();
        read.chunks
            .push((offset + start as u64, offset + end as u64, text));
        offset += end as u64;
        if got < want {
            break;
        }
    }
    read.next = offset;
    Ok(read)
}

/// Reads into `buf` from `offset` until it is full or the file ends; how much was read.
fn read_at(file: &std::fs::File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt as _;
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// How many bytes at the end of `bytes` begin a character whose end is not there yet (0 to 3).
fn incomplete_tail(bytes: &[u8]) -> usize {
    for back in 1..=bytes.len().min(3) {
        let byte = bytes[bytes.len() - back];
        if byte & 0xC0 == 0x80 {
            continue; // inside a character: its first byte is further back
        }
        let width = match byte {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => 1,
        };
        return if width > back { back } else { 0 };
    }
    0
}

/// The output of a loop another driver holds, as [`output`] streams it, from what the driver
/// tells of its attempt in flight (asked every [`HELD_OUTPUT_POLL`]): `attempt` and `idle` as the
/// attempt changes, and `output` with the whole tail it has, `{log: null, offset: 0, text,
/// replace: true}`, whenever that changed. The stream ends when the driver cannot be asked.
fn held_output(other: Arc<dyn super::Elsewhere>, id: String) -> Response {
    let held = HeldOutput {
        other,
        id,
        attempt: None,
        idle: false,
        text: None,
        pending: std::collections::VecDeque::new(),
        asked: false,
    };
    let stream = futures_util::stream::unfold(held, |mut held| async move {
        let event = held.next().await?;
        Some((Ok::<_, Infallible>(event), held))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// What a client was told of a held loop's output.
struct HeldOutput {
    other: Arc<dyn super::Elsewhere>,
    id: String,
    /// The attempt told of: its action, iteration and attempt.
    attempt: Option<Value>,
    idle: bool,
    /// The tail last sent.
    text: Option<String>,
    pending: std::collections::VecDeque<SseEvent>,
    /// The driver was asked once: the next ask waits.
    asked: bool,
}

impl HeldOutput {
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if std::mem::replace(&mut self.asked, true) {
                tokio::time::sleep(HELD_OUTPUT_POLL).await;
            }
            let tail = self.other.tail(&self.id).await.ok()?;
            self.take(&tail);
        }
    }

    /// Takes in what the driver told (`{in_flight, text}`, as the tail route answers).
    fn take(&mut self, tail: &Value) {
        let flight = tail.get("in_flight").filter(|f| f.is_object());
        let Some(flight) = flight else {
            if !self.idle {
                self.pending.push_back(idle_event());
                self.idle = true;
                self.attempt = None;
                self.text = None;
            }
            return;
        };
        let attempt = json!([flight["action"], flight["iteration"], flight["attempt"]]);
        if self.attempt.as_ref() != Some(&attempt) {
            let field = |name: &str| flight.get(name).cloned().unwrap_or(Value::Null);
            let said = json!({
                "action": field("action"),
                "iteration": field("iteration"),
                "attempt": field("attempt"),
                "task_id": field("task_id"),
                "pid": field("pid"),
                "started_at": field("started_at"),
                "log": null,
            });
            self.pending
                .push_back(SseEvent::default().event("attempt").data(said.to_string()));
            self.attempt = Some(attempt);
            self.idle = false;
            self.text = None;
        }
        let text = tail.get("text").and_then(Value::as_str);
        if let Some(text) = text
            && self.text.as_deref() != Some(text)
        {
            let said = json!({ "log": null, "offset": 0, "text": text, "replace": true });
            self.pending
                .push_back(SseEvent::default().event("output").data(said.to_string()));
            self.text = Some(text.to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log file holding `bytes`.
    fn log(bytes: &[u8]) -> (tempfile::TempDir, std::fs::File) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("l.log");
        std::fs::write(&path, bytes).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        (dir, file)
    }

    #[test]
    fn a_log_is_read_from_its_tail_then_on_and_what_was_left_out_is_said() {
        let text = "ab".repeat(40_000);
        let (_dir, file) = log(text.as_bytes());
        let len = text.len() as u64;
        let first = read_log(&file, len, None).expect("read");
        assert_eq!(first.skipped, len - OUTPUT_CHUNK);
        assert_eq!(first.chunks.len(), 1);
        assert_eq!(first.chunks[0].0, len - OUTPUT_CHUNK);
        assert_eq!(first.chunks[0].1, len);
        assert_eq!(first.next, len);
        // Resumed at an offset: from there, in chunks, nothing skipped.
        let resumed = read_log(&file, len, Some(100)).expect("read");
        assert_eq!(resumed.skipped, 0);
        assert_eq!(resumed.chunks.len(), OUTPUT_CHUNKS_PER_LOOK);
        assert_eq!(resumed.chunks[0].0, 100);
        assert_eq!(resumed.chunks[1].0, resumed.chunks[0].1);
        assert!(resumed.chunks.iter().all(|c| c.1 - c.0 <= OUTPUT_CHUNK));
        // Past the end: the file was written anew.
        let again = read_log(&file, len, Some(len + 5)).expect("read");
        assert_eq!((again.skipped, again.chunks[0].0), (0, 0));
    }

    #[test]
    fn a_reader_far_behind_jumps_to_the_tail() {
        let text = "x".repeat(usize::try_from(OUTPUT_BEHIND).unwrap() + 50_000);
        let (_dir, file) = log(text.as_bytes());
        let len = text.len() as u64;
        let read = read_log(&file, len, Some(10)).expect("read");
        assert_eq!(read.skipped, len - OUTPUT_CHUNK - 10);
        assert_eq!(read.chunks.len(), 1);
        assert_eq!(read.next, len);
    }

    #[test]
    fn chunks_end_at_a_characters_boundary() {
        // "é" is two bytes: a log that ends with its first byte waits for the second.
        let mut bytes = b"caf".to_vec();
        bytes.push(0xC3);
        let (_dir, file) = log(&bytes);
        let read = read_log(&file, 4, Some(0)).expect("read");
        assert_eq!(read.chunks, [(0, 3, "caf".to_owned())]);
        assert_eq!(read.next, 3);
        let mut bytes = bytes.clone();
        bytes.extend_from_slice(&[0xA9, 0xFF, b'!']);
        let (_dir, file) = log(&bytes);
        let read = read_log(&file, 7, Some(3)).expect("read");
        assert_eq!(read.chunks, [(3, 7, "é\u{FFFD}!".to_owned())]);
        // A jump that lands inside a character starts after it.
        let many = "é".repeat(20_000);
        let (_dir, file) = log(many.as_bytes());
        let len = many.len() as u64;
        let read = read_log(&file, len, None).expect("read");
        assert!(!read.chunks[0].2.contains('\u{FFFD}'));
        assert_eq!(read.skipped + read.chunks[0].1 - read.chunks[0].0, len);
    }

    #[test]
    fn output_ids_name_a_plain_log_and_an_offset() {
        assert_eq!(
            output_id("0003-develop-1.log:42"),
            Some(("0003-develop-1.log".to_owned(), 42))
        );
        assert_eq!(output_id("a:b:7"), Some(("a:b".to_owned(), 7)));
        for bad in [
            "", "7", "x.log", "x.log:-1", "../x:1", "..:1", ":1", "x\u{1}:1",
        ] {
            assert_eq!(output_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_incomplete_character_is_found_at_the_end() {
        assert_eq!(incomplete_tail(b"abc"), 0);
        assert_eq!(incomplete_tail("é".as_bytes()), 0);
        assert_eq!(incomplete_tail(&[b'a', 0xE2, 0x82]), 2);
        assert_eq!(incomplete_tail(&[0xF0, 0x9F, 0x98]), 3);
        assert_eq!(incomplete_tail(&[0x80, 0x80, 0x80]), 0);
    }
}
