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
//!
//! A file a resource: `loops`, `tasks`, `checkpoints`, `events` (and the page's stream
//! of changes), `output`, `metrics`, `page`; who may call is `auth`'s; what every route
//! shares (the state, an error, the loop a request names) is `shared`'s, below them all. This
//! file listens and routes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};

use loopd_fs::Dir;
use tokio_util::sync::CancellationToken;

mod auth;
mod checkpoints;
mod events;
mod loops;
mod metrics;
mod output;
mod page;
mod shared;
mod tasks;

pub use page::OPENAPI;
pub use shared::{ApiError, Shared};

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
        let token = auth::new_token()?;
        runtime_dir.write_atomic("token", token.as_bytes(), false)?;
        let tcp = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let addr = tcp.local_addr()?;
        let guarded = router(shared).layer(axum::middleware::from_fn_with_state(
            Arc::<str>::from(token.as_str()),
            auth::require_token,
        ));
        // As Jupyter does: the link that logs a browser in.
        tracing::info!("dashboard: http://{}/?token={token}", tcp.local_addr()?);
        tokio::spawn(async move {
            // Each response goes out at once, not held back for the ACK of the last (Nagle's
            // algorithm against the client's delayed ACK cost every request 40 ms).
            let tcp = axum::serve::ListenerExt::tap_io(tcp, |stream| {
                let _ = stream.set_nodelay(true);
            });
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

fn router(shared: Shared) -> Router {
    Router::new()
        .route(
            "/",
            get(|| async { page::page("text/html; charset=utf-8", page::INDEX) }),
        )
        .route(
            "/app.js",
            get(|| async { page::page("text/javascript; charset=utf-8", page::APP_JS) }),
        )
        .route(
            "/app.css",
            get(|| async { page::page("text/css; charset=utf-8", page::APP_CSS) }),
        )
        .route("/openapi.json", get(page::openapi))
        .route("/metrics", get(metrics::metrics))
        .route("/v1/stream", get(events::stream))
        .route("/v1/service", get(loops::service))
        .route("/v1/loops", get(loops::list_loops).post(loops::create))
        .route("/v1/loops/{id}", get(loops::one_loop))
        // pause, resume and stop; the other routes' names come first.
        .route("/v1/loops/{id}/{control}", post(loops::control))
        .route("/v1/loops/{id}/next", post(loops::next))
        .route("/v1/loops/{id}/answer", post(loops::answer))
        .route("/v1/loops/{id}/limits", post(loops::set_limits))
        .route("/v1/loops/{id}/tasks", post(tasks::add_task))
        .route("/v1/loops/{id}/events", get(events::events))
        .route("/v1/loops/{id}/tail", get(events::tail))
        .route("/v1/loops/{id}/output", get(output::output))
        .route(
            "/v1/loops/{id}/checkpoints",
            get(checkpoints::list_checkpoints),
        )
        .route(
            "/v1/loops/{id}/checkpoints/{name}/diff",
            get(checkpoints::checkpoint_diff),
        )
        .route("/v1/loops/{id}/rollback", post(checkpoints::rollback))
        .route("/v1/loops/{id}/retry", post(loops::retry))
        .nest_service(
            "/mcp",
            loopd_mcp::http(shared.mcp(), CancellationToken::new()),
        )
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed on this route",
            )
        })
        .with_state(shared)
}
