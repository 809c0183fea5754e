//! What happens, as Server-Sent Events: every change of a served loop's state file, a loop's
//! events (resumable by event number), and the last of its attempt's output (`tail`).

use std::convert::Infallible;
use std::path::PathBuf;
use std::time::Duration;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Json, Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt as _;
use serde::Deserialize;
use serde_json::{Value, json};

use super::shared::{ApiError, ApiResult, Shared, held_by};
use loopd_core::driver::Events;

/// Every change of a served loop's state file, as Server-Sent Events: `{root, loop_id}` each
/// (a `rescan` event when some were missed). The dashboard refreshes on them.
pub(super) async fn stream(State(shared): State<Shared>) -> impl IntoResponse {
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

/// `?after=N`: events after the Nth (what `Last-Event-ID` says, for clients that cannot set
/// headers).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct After {
    root: Option<PathBuf>,
    after: Option<u64>,
}

/// The events of a loop as Server-Sent Events, as its driver tells them: each event's id is its
/// number in the event log (from 1), so that a client that reconnects with `Last-Event-ID` gets
/// what it missed and nothing twice.
pub(super) async fn events(
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
    let root = query.root.as_deref();
    let after = last.or(query.after).unwrap_or(0);
    let id = id.as_str();
    let events = held_by(&shared, id, |driver| async move {
        driver.events(id, root, after).await
    })
    .await?;
    let event = |(n, line): (u64, String)| SseEvent::default().id(n.to_string()).data(line);
    Ok(match events {
        Events::Live(events) => {
            let events = events.map(move |e| Ok::<_, Infallible>(event(e)));
            Sse::new(events)
                .keep_alive(KeepAlive::default())
                .into_response()
        }
        // The stream ends with those so far, and the client's reconnection (every
        // [`SO_FAR_RETRY`], with `Last-Event-ID`) brings what came since.
        Events::SoFar(so_far) => {
            let retry = SseEvent::default()
                .retry(SO_FAR_RETRY)
                .comment("held elsewhere");
            let events = std::iter::once(retry).chain(so_far.into_iter().map(event));
            Sse::new(futures_util::stream::iter(events.map(Ok::<_, Infallible>))).into_response()
        }
    })
}

/// How soon a client reconnects to the events of a loop whose driver tells them only so far.
pub(super) const SO_FAR_RETRY: Duration = Duration::from_secs(2);

/// `?bytes=N`: how much of the tail (at most 1 MiB).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TailQuery {
    root: Option<PathBuf>,
    bytes: Option<u64>,
}

/// The tail of the log of the attempt in flight (`null` text when none is in flight).
pub(super) async fn tail(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    query: std::result::Result<Query<TailQuery>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let (UrlPath(id), Query(query)) = (id?, query?);
    let want = query.bytes.unwrap_or(16 * 1024).min(1 << 20);
    let root = query.root.as_deref();
    let id = id.as_str();
    let tail = held_by(&shared, id, |driver| async move {
        driver.tail(id, root, want).await
    })
    .await?;
    Ok(Json(tail))
}
