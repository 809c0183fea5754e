//! A loop's checkpoints: the list, one's diff, and the rollback, as `loopd checkpoints`, `diff` and
//! `rollback` do.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Json, Path as UrlPath, Query, State};
use serde::Deserialize;
use serde_json::Value;

use super::loops::local;
use super::shared::{ApiResult, Shared, Where};
use loopd_core::driver::Local;

/// `loopd checkpoints --json`: the loop's checkpoints, oldest first, with what each changed.
pub(super) async fn list_checkpoints(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place)) = (id?, place?);
    local(&shared, &id, place.root.as_deref(), Local::Checkpoints).await
}

/// What one checkpoint changed, file by file and hunk by hunk, bounded
/// ([`loopd_file_driver::checkpoints::diff`]).
pub(super) async fn checkpoint_diff(
    State(shared): State<Shared>,
    path: std::result::Result<UrlPath<(String, String)>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath((id, name)), Query(place)) = (path?, place?);
    local(&shared, &id, place.root.as_deref(), Local::Diff(Some(name))).await
}

/// What `POST .../rollback` takes: `loopd rollback`'s arguments.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RollbackRequest {
    checkpoint: String,
    #[serde(default)]
    force: bool,
}

/// `loopd rollback`: the work tree back as it was at a checkpoint; refused while a daemon drives
/// the running loop, or when the work tree holds changes no checkpoint holds (unless `force`).
pub(super) async fn rollback(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<RollbackRequest>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place), Json(request)) = (id?, place?, body?);
    let ask = Local::Rollback {
        checkpoint: request.checkpoint,
        force: request.force,
    };
    local(&shared, &id, place.root.as_deref(), ask).await
}
