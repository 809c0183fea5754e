//! The output of a loop's attempt in flight as Server-Sent Events: its log read as it grows,
//! resumable by `LOG:OFFSET`, bounded whatever the executor writes.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::shared::{ApiError, ApiResult, Shared, Where, blocking, held_by};
use loopd_core::driver::Driver;
use loopd_file_driver::project::Project;
use loopd_fs::Dir;
use loopd_store::store::StoreError;

/// The most of a log one `output` event carries, and what a reader starts with (at connect, or
/// after a jump).
pub(super) const OUTPUT_CHUNK: u64 = 16 * 1024;
/// How far behind the end of a log a reader may fall before it jumps to its last
/// [`OUTPUT_CHUNK`]: what a client is sent is bounded whatever an executor writes.
pub(super) const OUTPUT_BEHIND: u64 = 256 * 1024;
/// How many chunks one look reads at most.
pub(super) const OUTPUT_CHUNKS_PER_LOOK: usize = 4;
/// The least time between two looks for one client: a log written line by line costs a read per
/// 100 ms, not one per line.
pub(super) const OUTPUT_GAP: Duration = Duration::from_millis(100);
/// The longest a client goes without a look, in case a file event was missed.
pub(super) const OUTPUT_FALLBACK: Duration = Duration::from_secs(1);
/// How often the output of a loop another driver holds is asked for.
pub(super) const HELD_OUTPUT_POLL: Duration = Duration::from_secs(1);
/// How much of a held loop's output is asked for at each look.
const TAIL: u64 = 16 * 1024;

/// The output of a loop's attempt in flight as Server-Sent Events, pushed as its log grows:
///
/// - `attempt` `{action, iteration, attempt, task_id, pid, started_at, log}` when an attempt is
///   in flight at connect, and whenever another one is;
/// - `output` `{log, offset, text}`, id `LOG:END`: at most [`OUTPUT_CHUNK`] of the log from byte
///   `offset` to `END`, cut at a character's boundary (bytes that are not UTF-8 replaced);
/// - `skipped` `{log, bytes}`: what was left out, at connect (a reader starts at the log's last
///   [`OUTPUT_CHUNK`]) and when the reader fell more than [`OUTPUT_BEHIND`] behind;
/// - `idle` `{}` at connect when nothing is in flight, and when the attempt ends.
///
/// A client that reconnects with `Last-Event-ID: LOG:OFFSET` goes on at OFFSET while LOG is the
/// attempt in flight's log. Looks are woken by the loop's files (its progress directory and the
/// logs' `actions/`) and by its state file's changes, at most one per [`OUTPUT_GAP`] and at least
/// one per [`OUTPUT_FALLBACK`]. A log is opened by its name alone in `actions/`.
pub(super) async fn output(
    State(shared): State<Shared>,
    id: std::result::Result<UrlPath<String>, PathRejection>,
    place: std::result::Result<Query<Where>, QueryRejection>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let (UrlPath(id), Query(place)) = (id?, place?);
    let resume = headers
        .get("last-event-id")
        .map(|v| {
            v.to_str().ok().and_then(output_id).ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "Last-Event-ID: not an output id (LOG:OFFSET)",
                )
            })
        })
        .transpose()?;
    let root = place.root;
    let found = blocking({
        let (files, id, root) = (shared.files.clone(), id.clone(), root.clone());
        move || {
            let Some(p) = files.find(&id, root.as_deref())? else {
                return Ok(None);
            };
            let progress = p.store.progress(&id)?;
            Ok(Some((p, progress)))
        }
    })
    .await?;
    let Some((project, progress)) = found else {
        // Another driver's: from what it tells of its attempt in flight.
        let root = root.as_deref();
        let driver = held_by(&shared, &id, |driver| async {
            Ok(driver.show(&id, root).await?.map(|_| driver))
        })
        .await?;
        return Ok(held_output(driver, id));
    };
    let wake = Arc::new(tokio::sync::Notify::new());
    let look_at_state = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let subscription = {
        let (wake, look_at_state) = (wake.clone(), look_at_state.clone());
        loopd_store::watch::subscribe(
            progress.path(),
            Arc::new(move |_: &notify::Result<notify::Event>| {
                look_at_state.store(true, std::sync::atomic::Ordering::SeqCst);
                wake.notify_one();
            }),
        )
    };
    let key = loopd_file_driver::service::LoopKey {
        root: project.root.clone(),
        loop_id: id.clone(),
    };
    let stream = OutputStream {
        reader: Some(OutputReader {
            project,
            id,
            progress,
            actions: None,
            wake: wake.clone(),
            resume,
            following: None,
            idle: false,
        }),
        pending: std::collections::VecDeque::new(),
        wake,
        look_at_state,
        changes: Some(shared.changes.subscribe()),
        key,
        last_look: None,
        _subscription: subscription,
    };
    let stream = futures_util::stream::unfold(stream, |mut stream| async move {
        let event = stream.next().await?;
        Some((Ok::<_, Infallible>(event), stream))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// An output event's id, `LOG:OFFSET`: the log's name and a byte offset in it.
pub(super) fn output_id(id: &str) -> Option<(String, u64)> {
    let (log, offset) = id.trim().rsplit_once(':')?;
    if !loopd_file_driver::front::plain_name(log) {
        return None;
    }
    Some((log.to_owned(), offset.parse().ok()?))
}

/// One client's stream of a loop's output: what it waits on, and its reader.
pub(super) struct OutputStream {
    /// Taken while a blocking thread reads.
    reader: Option<OutputReader>,
    pending: std::collections::VecDeque<SseEvent>,
    /// Woken by a change in the progress directory or in `actions/`.
    wake: Arc<tokio::sync::Notify>,
    /// The state file may have changed (the attempt in flight with it): read it at the next look.
    look_at_state: Arc<std::sync::atomic::AtomicBool>,
    /// The changes of every served loop's state file; `None` once the service stops publishing.
    changes: Option<tokio::sync::broadcast::Receiver<loopd_file_driver::service::LoopKey>>,
    key: loopd_file_driver::service::LoopKey,
    last_look: Option<tokio::time::Instant>,
    _subscription: loopd_store::watch::Subscription,
}

impl OutputStream {
    /// The next event; `None` ends the stream (the loop is gone, or its files cannot be read).
    async fn next(&mut self) -> Option<SseEvent> {
        use std::sync::atomic::Ordering;
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if let Some(last) = self.last_look {
                tokio::time::sleep_until(last + OUTPUT_GAP).await;
            }
            let state = self.look_at_state.swap(false, Ordering::SeqCst);
            let mut reader = self.reader.take()?;
            let (reader, said) = tokio::task::spawn_blocking(move || {
                let said = reader.look(state);
                (reader, said)
            })
            .await
            .ok()?;
            self.reader = Some(reader);
            self.last_look = Some(tokio::time::Instant::now());
            self.pending.extend(said?);
            if self.pending.is_empty() {
                self.wait().await;
            }
        }
    }

    /// Waits for a change of the loop's files or of its state file, at most
    /// [`OUTPUT_FALLBACK`] (then the state is looked at too).
    async fn wait(&mut self) {
        use std::sync::atomic::Ordering;
        use tokio::sync::broadcast::error::RecvError;
        let deadline = tokio::time::Instant::now() + OUTPUT_FALLBACK;
        loop {
            let changed = async {
                match &mut self.changes {
                    Some(changes) => Some(changes.recv().await),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.wake.notified() => return,
                () = tokio::time::sleep_until(deadline) => break,
                heard = changed => match heard {
                    Some(Ok(key)) if key != self.key => continue,
                    Some(Err(RecvError::Closed)) => self.changes = None,
                    // This loop's state file, or some changes were missed.
                    _ => break,
                },
            }
        }
        self.look_at_state.store(true, Ordering::SeqCst);
    }
}

/// What one client has read of a loop's output: the attempt it follows and where it is in its
/// log. Moved to a blocking thread for each look.
pub(super) struct OutputReader {
    project: Arc<Project>,
    id: String,
    progress: Dir,
    /// The progress directory's `actions/` and its watch, once it exists.
    actions: Option<(Dir, loopd_store::watch::Subscription)>,
    wake: Arc<tokio::sync::Notify>,
    /// What `Last-Event-ID` asked for, until the first log is placed.
    resume: Option<(String, u64)>,
    following: Option<Followed>,
    /// `idle` is the last said of the attempts.
    idle: bool,
}

/// The attempt a reader follows.
pub(super) struct Followed {
    flight: loopd_core::state::InFlight,
    /// Where the next read of its log starts; `None` until the log is placed (it may not be
    /// there yet).
    offset: Option<u64>,
}

/// Whether two records of the attempt in flight are of the same attempt.
pub(super) fn same_attempt(
    a: &loopd_core::state::InFlight,
    b: &loopd_core::state::InFlight,
) -> bool {
    (&a.log, &a.action, a.iteration, a.attempt, &a.started_at)
        == (&b.log, &b.action, b.iteration, b.attempt, &b.started_at)
}

/// One read of a log: what was left out before it, and its chunks, each `(offset, end, text)`.
#[derive(Debug, Default, PartialEq)]
pub(super) struct LogRead {
    skipped: u64,
    chunks: Vec<(u64, u64, String)>,
    /// Where the next read starts.
    next: u64,
}

impl OutputReader {
    /// One look: at the state file's attempt in flight when `state` (it may have changed), then
    /// at its log. The events to send; `None` when the loop is gone.
    fn look(&mut self, state: bool) -> Option<Vec<SseEvent>> {
        let mut said = Vec::new();
        if state {
            match self.project.store.load(&self.id) {
                Ok(loaded) => {
                    let flight = loaded
                        .state
                        .skill_state
                        .as_ref()
                        .and_then(|s| s.in_flight.clone());
                    self.see(flight, &mut said);
                }
                Err(StoreError::NotFound { .. }) => return None,
                // Unreadable for now (being replaced by another program): looked at again.
                Err(_) => {}
            }
        }
        self.read(&mut said);
        Some(said)
    }

    /// Takes in the attempt in flight as the state file has it.
    fn see(&mut self, flight: Option<loopd_core::state::InFlight>, said: &mut Vec<SseEvent>) {
        match (flight, &self.following) {
            (Some(flight), Some(followed)) if same_attempt(&flight, &followed.flight) => {}
            (Some(flight), _) => {
                said.push(
                    SseEvent::default().event("attempt").data(
                        json!({
                            "action": flight.action,
                            "iteration": flight.iteration,
                            "attempt": flight.attempt,
                            "task_id": flight.task_id,
                            "pid": flight.pid,
                            "started_at": flight.started_at,
                            "log": flight.log,
                        })
                        .to_string(),
                    ),
                );
                self.following = Some(Followed {
                    flight,
                    offset: None,
                });
                self.idle = false;
            }
            (None, Some(_)) => {
                // What the attempt wrote last, then its end.
                self.read(said);
                self.following = None;
                said.push(idle_event());
                self.idle = true;
            }
            (None, None) if !self.idle => {
                said.push(idle_event());
                self.idle = true;
            }
            (None, None) => {}
        }
    }

    /// Reads what the followed attempt's log holds past where the reader is.
    fn read(&mut self, said: &mut Vec<SseEvent>) {
        let Some(followed) = &mut self.following else {
            return;
        };
        let Some(log) = followed
            .flight
            .log
            .clone()
            .filter(|l| loopd_file_driver::front::plain_name(l))
        else {
            return;
        };
        if self.actions.is_none() {
            let Ok(actions) = self.progress.subdir("actions", false) else {
                return; // not made yet
            };
            let wake = self.wake.clone();
            let subscription = loopd_store::watch::subscribe(
                actions.path(),
                Arc::new(move |_: &notify::Result<notify::Event>| wake.notify_one()),
            );
            self.actions = Some((actions, subscription));
        }
        let Some((actions, _)) = &self.actions else {
            return;
        };
        let Ok(file) = actions.open_read(&log) else {
            return; // not there yet, or not a plain file
        };
        let Ok(len) = file.metadata().map(|m| m.len()) else {
            return;
        };
        let from = match followed.offset {
            Some(offset) => Some(offset),
            None => self
                .resume
                .take()
                .filter(|(name, offset)| *name == log && *offset <= len)
                .map(|(_, offset)| offset),
        };
        let Ok(read) = read_log(&file, len, from) else {
            return;
        };
        followed.offset = Some(read.next);
        if read.skipped > 0 {
            said.push(
                SseEvent::default()
                    .event("skipped")
                    .data(json!({ "log": log, "bytes": read.skipped }).to_string()),
            );
        }
        for (offset, end, text) in read.chunks {
            said.push(
                SseEvent::default()
                    .event("output")
                    .id(format!("{log}:{end}"))
                    .data(json!({ "log": log, "offset": offset, "text": text }).to_string()),
            );
        }
    }
}

pub(super) fn idle_event() -> SseEvent {
    SseEvent::default().event("idle").data("{}")
}

/// Reads `file` (`len` bytes long) from `from`, or from its last [`OUTPUT_CHUNK`] when `None`,
/// past an offset beyond its end (the file was emptied and written anew), or when that is more
/// than [`OUTPUT_BEHIND`] behind: then what is left out is `skipped`. At most
/// [`OUTPUT_CHUNKS_PER_LOOK`] chunks of [`OUTPUT_CHUNK`], each ending at a character's boundary:
/// a character not written whole yet is read again with its end.
pub(super) fn read_log(
    file: &std::fs::File,
    len: u64,
    from: Option<u64>,
) -> std::io::Result<LogRead> {
    let start = from.map(|from| if from > len { 0 } else { from });
    let mut offset = match start {
        Some(start) if len - start <= OUTPUT_BEHIND => start,
        _ => len.saturating_sub(OUTPUT_CHUNK),
    };
    let mut read = LogRead {
        skipped: offset - start.unwrap_or(0),
        ..LogRead::default()
    };
    // Where the reader jumped, it may have landed inside a character.
    let mut align = read.skipped > 0;
    for _ in 0..OUTPUT_CHUNKS_PER_LOOK {
        if offset >= len {
            break;
        }
        let want = usize::try_from((len - offset).min(OUTPUT_CHUNK)).unwrap_or(0);
        let mut bytes = vec![0u8; want];
        let got = read_at(file, &mut bytes, offset)?;
        bytes.truncate(got);
        let mut start = 0;
        if std::mem::take(&mut align) {
            start = bytes
                .iter()
                .take(3)
                .take_while(|b| **b & 0xC0 == 0x80)
                .count();
            read.skipped += start as u64;
        }
        let end = bytes.len() - incomplete_tail(&bytes[start..]);
        if end <= start {
            offset += start as u64;
            break; // a character not written whole yet
        }
        let text = String::from_utf8_lossy(&bytes[start..end]).into_owned();
        read.chunks
            .push((offset + start as u64, offset + end as u64, text));
        offset += end as u64;
        if got < want {
            break;
        }
    }
    read.next = offset;
    Ok(read)
}

/// Reads into `buf` from `offset` until it is full or the file ends; how much was read.
pub(super) fn read_at(file: &std::fs::File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt as _;
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// How many bytes at the end of `bytes` begin a character whose end is not there yet (0 to 3).
pub(super) fn incomplete_tail(bytes: &[u8]) -> usize {
    for back in 1..=bytes.len().min(3) {
        let byte = bytes[bytes.len() - back];
        if byte & 0xC0 == 0x80 {
            continue; // inside a character: its first byte is further back
        }
        let width = match byte {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => 1,
        };
        return if width > back { back } else { 0 };
    }
    0
}

/// The output of a loop another driver holds, as [`output`] streams it, from what the driver
/// tells of its attempt in flight (asked every [`HELD_OUTPUT_POLL`]): `attempt` and `idle` as the
/// attempt changes, and `output` with the whole tail it has, `{log: null, offset: 0, text,
/// replace: true}`, whenever that changed. The stream ends when the driver cannot be asked.
pub(super) fn held_output(other: Arc<dyn Driver>, id: String) -> Response {
    let held = HeldOutput {
        other,
        id,
        attempt: None,
        idle: false,
        text: None,
        pending: std::collections::VecDeque::new(),
        asked: false,
    };
    let stream = futures_util::stream::unfold(held, |mut held| async move {
        let event = held.next().await?;
        Some((Ok::<_, Infallible>(event), held))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// What a client was told of a held loop's output.
pub(super) struct HeldOutput {
    other: Arc<dyn Driver>,
    id: String,
    /// The attempt told of: its action, iteration and attempt.
    attempt: Option<Value>,
    idle: bool,
    /// The tail last sent.
    text: Option<String>,
    pending: std::collections::VecDeque<SseEvent>,
    /// The driver was asked once: the next ask waits.
    asked: bool,
}

impl HeldOutput {
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if std::mem::replace(&mut self.asked, true) {
                tokio::time::sleep(HELD_OUTPUT_POLL).await;
            }
            let tail = self.other.tail(&self.id, None, TAIL).await.ok()??;
            self.take(&tail);
        }
    }

    /// Takes in what the driver told (`{in_flight, text}`, as the tail route answers).
    fn take(&mut self, tail: &Value) {
        let flight = tail.get("in_flight").filter(|f| f.is_object());
        let Some(flight) = flight else {
            if !self.idle {
                self.pending.push_back(idle_event());
                self.idle = true;
                self.attempt = None;
                self.text = None;
            }
            return;
        };
        let attempt = json!([flight["action"], flight["iteration"], flight["attempt"]]);
        if self.attempt.as_ref() != Some(&attempt) {
            let field = |name: &str| flight.get(name).cloned().unwrap_or(Value::Null);
            let said = json!({
                "action": field("action"),
                "iteration": field("iteration"),
                "attempt": field("attempt"),
                "task_id": field("task_id"),
                "pid": field("pid"),
                "started_at": field("started_at"),
                "log": null,
            });
            self.pending
                .push_back(SseEvent::default().event("attempt").data(said.to_string()));
            self.attempt = Some(attempt);
            self.idle = false;
            self.text = None;
        }
        let text = tail.get("text").and_then(Value::as_str);
        if let Some(text) = text
            && self.text.as_deref() != Some(text)
        {
            let said = json!({ "log": null, "offset": 0, "text": text, "replace": true });
            self.pending
                .push_back(SseEvent::default().event("output").data(said.to_string()));
            self.text = Some(text.to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log file holding `bytes`.
    fn log(bytes: &[u8]) -> (tempfile::TempDir, std::fs::File) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("l.log");
        std::fs::write(&path, bytes).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        (dir, file)
    }

    #[test]
    fn a_log_is_read_from_its_tail_then_on_and_what_was_left_out_is_said() {
        let text = "ab".repeat(40_000);
        let (_dir, file) = log(text.as_bytes());
        let len = text.len() as u64;
        let first = read_log(&file, len, None).expect("read");
        assert_eq!(first.skipped, len - OUTPUT_CHUNK);
        assert_eq!(first.chunks.len(), 1);
        assert_eq!(first.chunks[0].0, len - OUTPUT_CHUNK);
        assert_eq!(first.chunks[0].1, len);
        assert_eq!(first.next, len);
        // Resumed at an offset: from there, in chunks, nothing skipped.
        let resumed = read_log(&file, len, Some(100)).expect("read");
        assert_eq!(resumed.skipped, 0);
        assert_eq!(resumed.chunks.len(), OUTPUT_CHUNKS_PER_LOOK);
        assert_eq!(resumed.chunks[0].0, 100);
        assert_eq!(resumed.chunks[1].0, resumed.chunks[0].1);
        assert!(resumed.chunks.iter().all(|c| c.1 - c.0 <= OUTPUT_CHUNK));
        // Past the end: the file was written anew.
        let again = read_log(&file, len, Some(len + 5)).expect("read");
        assert_eq!((again.skipped, again.chunks[0].0), (0, 0));
    }

    #[test]
    fn a_reader_far_behind_jumps_to_the_tail() {
        let text = "x".repeat(usize::try_from(OUTPUT_BEHIND).unwrap() + 50_000);
        let (_dir, file) = log(text.as_bytes());
        let len = text.len() as u64;
        let read = read_log(&file, len, Some(10)).expect("read");
        assert_eq!(read.skipped, len - OUTPUT_CHUNK - 10);
        assert_eq!(read.chunks.len(), 1);
        assert_eq!(read.next, len);
    }

    #[test]
    fn chunks_end_at_a_characters_boundary() {
        // "é" is two bytes: a log that ends with its first byte waits for the second.
        let mut bytes = b"caf".to_vec();
        bytes.push(0xC3);
        let (_dir, file) = log(&bytes);
        let read = read_log(&file, 4, Some(0)).expect("read");
        assert_eq!(read.chunks, [(0, 3, "caf".to_owned())]);
        assert_eq!(read.next, 3);
        let mut bytes = bytes.clone();
        bytes.extend_from_slice(&[0xA9, 0xFF, b'!']);
        let (_dir, file) = log(&bytes);
        let read = read_log(&file, 7, Some(3)).expect("read");
        assert_eq!(read.chunks, [(3, 7, "é\u{FFFD}!".to_owned())]);
        // A jump that lands inside a character starts after it.
        let many = "é".repeat(20_000);
        let (_dir, file) = log(many.as_bytes());
        let len = many.len() as u64;
        let read = read_log(&file, len, None).expect("read");
        assert!(!read.chunks[0].2.contains('\u{FFFD}'));
        assert_eq!(read.skipped + read.chunks[0].1 - read.chunks[0].0, len);
    }

    #[test]
    fn output_ids_name_a_plain_log_and_an_offset() {
        assert_eq!(
            output_id("0003-develop-1.log:42"),
            Some(("0003-develop-1.log".to_owned(), 42))
        );
        assert_eq!(output_id("a:b:7"), Some(("a:b".to_owned(), 7)));
        for bad in [
            "", "7", "x.log", "x.log:-1", "../x:1", "..:1", ":1", "x\u{1}:1",
        ] {
            assert_eq!(output_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_incomplete_character_is_found_at_the_end() {
        assert_eq!(incomplete_tail(b"abc"), 0);
        assert_eq!(incomplete_tail("é".as_bytes()), 0);
        assert_eq!(incomplete_tail(&[b'a', 0xE2, 0x82]), 2);
        assert_eq!(incomplete_tail(&[0xF0, 0x9F, 0x98]), 3);
        assert_eq!(incomplete_tail(&[0x80, 0x80, 0x80]), 0);
    }
}
