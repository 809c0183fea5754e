//! A loop's tasks: one more, as `loopd task add` adds it.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Json, Path as UrlPath, Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::Value;

use super::shared::{ApiResult, Shared, Where};
use loopd_core::control::Change;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct NewTask {
    text: String,
    #[serde(default)]
    after: Vec<String>,
    #[serde(default)]
    race: Vec<String>,
}

pub(super) async fn add_task(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<NewTask>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let (UrlPath(id), Query(place), Json(task)) = (id?, place?, body?);
    let task = Change::Task(loopd_core::control::NewTask::new(
        task.text,
        &task.after,
        &task.race,
    ));
    let added = super::loops::change(&shared, &id, place.root.as_deref(), task).await?;
    Ok((StatusCode::CREATED, added))
}
