//! A loop's checkpoints: the list, one's diff, and the rollback, as `loopd checkpoints`, `diff` and
//! `rollback` do.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Json, Path as UrlPath, Query, State};
use serde::Deserialize;
use serde_json::{Value, json};

use super::shared::{ApiResult, Shared, Where, not_held, on_loop, on_loop_to_change};

/// `loopd checkpoints --json`: the loop's checkpoints, oldest first, with what each changed.
pub(super) async fn list_checkpoints(
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
pub(super) fn checkpoints_not_here(id: &str) -> String {
    format!("the checkpoints of loop {id} are not served here")
}

/// What one checkpoint changed, file by file and hunk by hunk, bounded
/// ([`loopd_file_driver::checkpoints::diff`]).
pub(super) async fn checkpoint_diff(
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
