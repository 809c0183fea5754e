//! What every route shares: the handlers' state, a request's failure in one line, the blocking
//! thread a handler works on, and the loop a request names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::Result;
use axum::extract::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use loopd_core::control::Change;
use loopd_file_driver::project::Project;
use loopd_file_driver::service::{LoopKey, ServiceInfo};
use loopd_store::store::StoreError;

/// What the handlers share: the service's status, as the supervisor last published it, and
/// every change of a served loop's state file, as the supervisor hears it.
#[derive(Clone)]
pub struct Shared {
    pub info: Arc<RwLock<ServiceInfo>>,
    pub changes: tokio::sync::broadcast::Sender<LoopKey>,
    /// The projects the service serves, opened once: a request reads through them rather than
    /// open every project (its configuration read, its directory opened) to find one loop.
    pub projects: Arc<RwLock<BTreeMap<PathBuf, Arc<Project>>>>,
    /// Loops another driver holds, listed and changed beside the projects' ([`crate::Elsewhere`]).
    pub elsewhere: Option<Arc<dyn crate::Elsewhere>>,
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
    pub(super) fn info(&self) -> ServiceInfo {
        self.info.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The projects served, in the order of their roots.
    pub(super) fn projects(&self) -> Vec<Arc<Project>> {
        self.projects
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
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

/// Runs `f` on a blocking thread with the project of the service that holds loop `id` ([`find`]),
/// for a read.
pub(super) async fn on_loop<T: Send + 'static>(
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
pub(super) async fn on_loop_to_change<T: Send + 'static>(
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
pub(super) struct Where {
    pub(super) root: Option<PathBuf>,
}

/// The project of the service that holds loop `id`.
pub(super) fn find(shared: &Shared, id: &str, root: Option<&Path>) -> Result<Arc<Project>> {
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

/// What only the loops of this service's projects have, asked of a loop another driver holds:
/// refused in one line (`what` says what, for loop `id`). Any other answer is `local`'s.
pub(super) async fn not_held<T>(
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

/// A change to loop `id`: made by `local` where a project of the service holds the loop, else
/// by the driver that holds it elsewhere, whose answer `remote` shapes.
pub(super) async fn change_loop<T: Send + 'static>(
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
