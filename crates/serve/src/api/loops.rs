//! The loops: listed, shown, created, and changed (pause, resume, stop, the next action, an
//! answer, limits, a retry), as the CLI does.

use std::path::Path;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Json, Path as UrlPath, Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::shared::{ApiError, ApiResult, Shared, Where, blocking, held_by};
use loopd_core::control::{Change, Control};
use loopd_core::driver::{Driver, Local, NewLoop};
use loopd_core::still::Still;
use loopd_file_driver::front::Files;
use loopd_file_driver::project::Project;
use loopd_file_driver::service::ServiceInfo;

/// A loop as the API shows it: where it is, its status and usage, and its view.
pub(super) fn summary(
    p: &Project,
    state: &loopd_core::state::LoopState,
    info: &ServiceInfo,
) -> Value {
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
pub(super) fn last_event(p: &Project, id: &str) -> Option<Value> {
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

pub(super) async fn service(State(shared): State<Shared>) -> Json<ServiceInfo> {
    Json(shared.files.info())
}

pub(super) async fn list_loops(State(shared): State<Shared>) -> ApiResult<Json<Value>> {
    let mut loops = Vec::new();
    for driver in &shared.drivers {
        let listed = driver.list().await?;
        let (files, driver) = (shared.files.clone(), driver.clone());
        loops.extend(
            blocking(move || {
                let info = files.info();
                Ok(listed
                    .into_iter()
                    .map(|l| match l.state {
                        Ok(state) => shown(
                            &files,
                            driver.as_ref(),
                            (&l.root, &state, l.still.as_ref()),
                            &info,
                        ),
                        Err(error) => json!({
                            "root": l.root, "status": "unreadable", "error": error,
                            "view": { "loop_id": l.id },
                        }),
                    })
                    .collect::<Vec<_>>())
            })
            .await?,
        );
    }
    Ok(Json(Value::Array(loops)))
}

/// A loop as the API shows it ([`summary`]): one of a driver that drives it here with its
/// project as the service serves it, any other with `driver` naming where it lives and its
/// project's settings read where its root is on this machine, and why it stands still where
/// only its driver knows (`still`).
fn shown(
    files: &Files,
    driver: &dyn Driver,
    (root, state, still): (&Path, &loopd_core::state::LoopState, Option<&Still>),
    info: &ServiceInfo,
) -> Value {
    if driver.here()
        && let Some(p) = files.project(root)
    {
        return summary(&p, state, info);
    }
    let mut value = match Project::open_for_inspection(Some(root), None) {
        Ok(p) => summary(&p, state, info),
        Err(_) => json!({
            "root": root,
            "status": state.status.as_str(),
            "view": { "loop_id": state.loop_id, "title": state.title,
                      "iteration": state.current_iteration },
        }),
    };
    value["driver"] = json!(driver.name());
    // No daemon of this service drives it: its standing is its own, and so is why it stands
    // still.
    value["view"]["standing"] = json!(state.standing());
    value["view"]["daemon_pid"] = Value::Null;
    let still = still.cloned().or_else(|| state.still());
    value["view"]["status_reason"] = json!(still.as_ref().map(|w| &w.reason));
    value["view"]["next_step"] = json!(still.as_ref().map(|w| &w.next));
    value
}

pub(super) async fn one_loop(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place)) = (id?, place?);
    let root = place.root.as_deref();
    let (driver, loaded) = held_by(&shared, &id, |driver| async {
        Ok(driver.show(&id, root).await?.map(|s| (driver, s)))
    })
    .await?;
    let files = shared.files.clone();
    blocking(move || {
        let mut value = shown(
            &files,
            driver.as_ref(),
            (&loaded.root, &loaded.state, loaded.still.as_ref()),
            &files.info(),
        );
        value["state"] = Value::Object(loaded.raw);
        Ok(Json(value))
    })
    .await
}

pub(super) async fn create(
    State(shared): State<Shared>,
    body: std::result::Result<Json<NewLoop>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let Json(new) = body?;
    for driver in &shared.drivers {
        if let Some(made) = driver.create(&new).await? {
            let made = json!({ "loop_id": made.id, "root": made.root });
            return Ok((StatusCode::CREATED, Json(made)));
        }
    }
    Err(loopd_file_driver::front::not_served(&new.root).into())
}

/// A change to loop `id`, made by the driver that holds it.
pub(super) async fn change(
    shared: &Shared,
    id: &str,
    root: Option<&Path>,
    change: Change,
) -> ApiResult<Json<Value>> {
    let said = held_by(shared, id, |driver| {
        let change = change.clone();
        async move { driver.change(id, root, change).await }
    })
    .await?;
    Ok(Json(said))
}

/// What only a loop in a work tree of this machine has, of the driver that holds loop `id`.
pub(super) async fn local(
    shared: &Shared,
    id: &str,
    root: Option<&Path>,
    ask: Local,
) -> ApiResult<Json<Value>> {
    let said = held_by(shared, id, |driver| {
        let ask = ask.clone();
        async move { driver.local(id, root, ask).await }
    })
    .await?;
    Ok(Json(said))
}

/// pause, resume, stop: as the CLI does; the service takes up a resumed loop itself.
pub(super) async fn control(
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
    change(&shared, &id, place.root.as_deref(), Change::Control(what)).await
}

/// A body of one text: `{"action": ...}` or `{"text": ...}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Choice {
    action: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Text {
    text: String,
}

pub(super) async fn next(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<Choice>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place), Json(choice)) = (id?, place?, body?);
    let next = Change::Next(choice.action);
    change(&shared, &id, place.root.as_deref(), next).await
}

/// `loopd set`: a loop's limits and budgets, those given only.
pub(super) async fn set_limits(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<loopd_file_driver::create::Limits>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place), Json(limits)) = (id?, place?, body?);
    let set = Change::Set(limits.into());
    change(&shared, &id, place.root.as_deref(), set).await
}

pub(super) async fn answer(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    body: std::result::Result<Json<Text>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place), Json(text)) = (id?, place?, body?);
    let answer = Change::Answer(text.text);
    change(&shared, &id, place.root.as_deref(), answer).await
}

/// `loopd retry`, the state change only: the service takes the loop up itself, as after a
/// resume. The project is opened as the command line opens it: a config that does not load is
/// refused rather than replaced by the defaults.
pub(super) async fn retry(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(place)) = (id?, place?);
    local(&shared, &id, place.root.as_deref(), Local::Retry).await
}
