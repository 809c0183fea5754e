//! What every route shares: the handlers' state, a request's failure in one line, the blocking
//! thread a handler works on, and the driver that holds the loop a request names.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use axum::extract::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use loopd_core::driver::Driver;
use loopd_file_driver::front::Files;
use loopd_file_driver::service::LoopKey;
use loopd_store::store::StoreError;

/// What the handlers share: the file store's loops (the projects the service serves, and its
/// status as the supervisor last published it), the drivers asked for a loop in order (the file
/// store first), and every change of a served loop's state file, as the supervisor hears it.
#[derive(Clone)]
pub struct Shared {
    pub files: Files,
    pub drivers: Vec<Arc<dyn Driver>>,
    pub changes: tokio::sync::broadcast::Sender<LoopKey>,
}

impl Shared {
    /// The file store's loops, then those of `others`.
    pub fn new(others: Vec<Arc<dyn Driver>>) -> Shared {
        let files = Files::default();
        let first: Arc<dyn Driver> = Arc::new(files.clone());
        Shared {
            files,
            drivers: std::iter::once(first).chain(others).collect(),
            changes: tokio::sync::broadcast::channel(1024).0,
        }
    }

    /// What `/mcp` serves: the same drivers (the file store's first, as [`Shared::new`] puts
    /// it), the file store's changes recorded as the MCP server's.
    pub fn mcp(&self) -> loopd_mcp::Front {
        let by = loopd_file_driver::control::BY_MCP;
        let files: Arc<dyn Driver> = Arc::new(self.files.recorded_as(by));
        loopd_mcp::Front {
            drivers: std::iter::once(files)
                .chain(self.drivers.iter().skip(1).cloned())
                .collect(),
            home: None,
        }
    }
}

impl Default for Shared {
    fn default() -> Shared {
        Shared::new(Vec::new())
    }
}

/// A failed request: its status and one line.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    message: String,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
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
            || e.is::<loopd_core::driver::Refused>()
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
        ApiError::new(status, loopd_exec::result::without_dumps(&format!("{e:#}")))
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

pub(super) type ApiResult<T> = std::result::Result<T, ApiError>;

/// Runs `f` on a blocking thread: the store waits for locks, and reads and writes files.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(ApiError::from)
}

/// `?root=DIR`: which project, where two have a loop of the same id.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Where {
    pub(super) root: Option<PathBuf>,
}

/// Asks each driver in turn about loop `id` (`ask` answers `None` for a driver that does not
/// hold it); the first answer is the request's, and none is a loop not found.
pub(super) async fn held_by<T, Asked: Future<Output = Result<Option<T>>>>(
    shared: &Shared,
    id: &str,
    ask: impl FnMut(Arc<dyn Driver>) -> Asked,
) -> ApiResult<T> {
    loopd_store::store::validate_id(id).map_err(anyhow::Error::from)?;
    loopd_core::driver::first(&shared.drivers, ask)
        .await?
        .ok_or_else(|| loopd_file_driver::front::not_found(id).into())
}
