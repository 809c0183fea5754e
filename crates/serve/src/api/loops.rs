//! The loops: listed, shown, created, and changed (pause, resume, stop, the next action, an
//! answer, limits, a retry), as the CLI does.

use std::path::{Path, PathBuf};

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Json, Path as UrlPath, Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::shared::{
    ApiError, ApiResult, Shared, Where, blocking, change_loop, not_held, on_loop, on_loop_to_change,
};
use loopd_core::control::Change;
use loopd_file_driver::control::Control;
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
    Json(shared.info())
}

pub(super) async fn list_loops(State(shared): State<Shared>) -> ApiResult<Json<Value>> {
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
pub(super) fn held_summary(
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

pub(super) async fn one_loop(
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

/// What `POST /v1/loops` takes: `loopd create`'s options.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CreateRequest {
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

pub(super) async fn create(
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
pub(super) async fn set_limits(
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

pub(super) async fn answer(
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

/// `loopd retry`, the state change only: the service takes the loop up itself, as after a
/// resume. The project is opened as the command line opens it: a config that does not load is
/// refused rather than replaced by the defaults.
pub(super) async fn retry(
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
