//! `GET /metrics`: loopd's metrics, with the loops of the file store by status.

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::shared::{ApiResult, Shared, blocking};

/// `GET /metrics`: loopd's metrics ([`loopd_exec::metrics`]), with the loops of the file store
/// by status as they are now.
pub(super) async fn metrics(State(shared): State<Shared>) -> ApiResult<Response> {
    let projects = shared.files.projects();
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
