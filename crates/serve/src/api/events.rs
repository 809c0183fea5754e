//! What happens, as Server-Sent Events: every change of a served loop's state file, a loop's
//! events (resumable by event number), and the last of its attempt's output (`tail`).

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Json, Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::shared::{ApiError, ApiResult, Shared, blocking, find, on_loop};

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

/// The events of a loop as Server-Sent Events: each event's id is its number in the event log
/// (from 1), so that a client that reconnects with `Last-Event-ID` gets what it missed and
/// nothing twice. The log is read as `logs --follow` reads it ([`loopd_store::events::EventTail`],
/// across rotations); new events come as they are written (the progress directory is watched).
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
    let root = query.root;
    let skip = last.or(query.after).unwrap_or(0);
    let elsewhere = shared.elsewhere.clone();
    let found = blocking({
        let id = id.clone();
        move || {
            let p = find(&shared, &id, root.as_deref())?;
            let dir = p.store.progress(&id)?;
            Ok((loopd_store::events::EventTail::new(&p.store, &id), dir))
        }
    })
    .await;
    let (store, dir) = match (found, elsewhere) {
        (Err(e), Some(other)) if e.status == StatusCode::NOT_FOUND => {
            if other.get(&id).await?.is_none() {
                return Err(e);
            }
            return Ok(held_events(other.events(&id).await?, skip));
        }
        (found, _) => found?,
    };
    let wake = Arc::new(tokio::sync::Notify::new());
    let subscription = {
        let wake = wake.clone();
        loopd_store::watch::subscribe(
            dir.path(),
            Arc::new(move |_: &notify::Result<notify::Event>| wake.notify_one()),
        )
    };
    let events = Events {
        tail: Some(store),
        skip,
        seen: 0,
        pending: std::collections::VecDeque::new(),
        wake,
        _subscription: subscription,
    };
    let stream = futures_util::stream::unfold(events, |mut events| async move {
        let event = events.next().await?;
        Some((Ok::<_, Infallible>(event), events))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// The events of a loop another driver holds, after the `skip`th, as Server-Sent Events numbered
/// as in [`events`]; the stream ends there, and the client's reconnection (every
/// [`HELD_EVENTS_RETRY`], with `Last-Event-ID`) brings what came since.
pub(super) fn held_events(all: Vec<Value>, skip: u64) -> Response {
    let retry = SseEvent::default()
        .retry(HELD_EVENTS_RETRY)
        .comment("held elsewhere");
    let events = all
        .into_iter()
        .enumerate()
        .skip(usize::try_from(skip).unwrap_or(usize::MAX))
        .map(|(i, event)| {
            SseEvent::default()
                .id((i + 1).to_string())
                .data(event.to_string())
        });
    let stream = futures_util::stream::iter(
        std::iter::once(retry)
            .chain(events)
            .map(Ok::<_, Infallible>),
    );
    Sse::new(stream).into_response()
}

/// How soon a client reconnects to the events of a loop another driver holds.
pub(super) const HELD_EVENTS_RETRY: Duration = Duration::from_secs(2);

/// A loop's events for one client: the lines read, numbered, those it has seen left out.
pub(super) struct Events {
    /// Taken while a blocking thread reads.
    tail: Option<loopd_store::events::EventTail>,
    /// The client has seen the events up to this number.
    skip: u64,
    /// The number of the last line read.
    seen: u64,
    pending: std::collections::VecDeque<SseEvent>,
    wake: Arc<tokio::sync::Notify>,
    _subscription: loopd_store::watch::Subscription,
}

impl Events {
    /// The next event; `None` ends the stream (the log cannot be read).
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            let mut tail = self.tail.take()?;
            let (tail, read) = tokio::task::spawn_blocking(move || {
                let read = tail.read_lines();
                (tail, read)
            })
            .await
            .ok()?;
            self.tail = Some(tail);
            for line in read.ok()? {
                self.seen += 1;
                if self.seen > self.skip {
                    let event = SseEvent::default().id(self.seen.to_string()).data(line);
                    self.pending.push_back(event);
                }
            }
            if self.pending.is_empty() {
                // A rare look even without an event, in case one was missed.
                let _ = tokio::time::timeout(Duration::from_secs(5), self.wake.notified()).await;
            }
        }
    }
}

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
    let local = on_loop(&shared, id.clone(), query.root, move |p, id| {
        let state = p.store.load(id)?.state;
        let flight = state.skill_state.as_ref().and_then(|s| s.in_flight.clone());
        let Some(flight) = flight else {
            return Ok(Json(
                json!({ "loop_id": id, "in_flight": null, "text": null }),
            ));
        };
        // The attempt's log, by its name alone, in the progress directory.
        let text = flight
            .log
            .as_deref()
            .filter(|name| super::output::plain_name(name))
            .and_then(|name| {
                let actions = p.store.progress(id).ok()?.subdir("actions", false).ok()?;
                actions.read_tail(name, want)
            });
        Ok(Json(json!({
            "loop_id": id,
            "in_flight": {
                "action": flight.action,
                "iteration": flight.iteration,
                "attempt": flight.attempt,
                "pid": flight.pid,
                "started_at": flight.started_at,
            },
            "text": text,
        })))
    })
    .await;
    match (local, shared.elsewhere.clone()) {
        (Err(e), Some(other)) if e.status == StatusCode::NOT_FOUND => {
            if other.get(&id).await?.is_none() {
                return Err(e);
            }
            Ok(Json(other.tail(&id).await?))
        }
        (local, _) => local,
    }
}
