//! The tools: each a short description, a small schema of plain fields, and one call of the
//! drivers' ([`Driver`]). A failure is a tool error in one line, as the command line says it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use futures_util::StreamExt as _;
use rmcp::model::{CallToolResult, ContentBlock, JsonObject, ProgressNotificationParam, Tool};
use rmcp::service::{RequestContext, RoleServer};
use serde_json::{Map, Value, json};

use loopd_core::control::{Change, Control, NewTask};
use loopd_core::driver::{Driver, Events, Local, NewLoop};
use loopd_core::state::{LoopState, Status};
use loopd_core::still::Still;

use crate::Front;

/// The longest `wait_for_loop` waits, and how long when the call does not say.
const WAIT_MAX: u64 = 600;
const WAIT_DEFAULT: u64 = 60;
/// How often a wait looks at its loop.
const WAIT_LOOK: Duration = Duration::from_millis(300);
/// The most events one `loop_events` call returns, and how many when it does not say.
const EVENTS_MAX: u64 = 500;
const EVENTS_DEFAULT: u64 = 50;
/// How long `loop_events` waits for one more event of a loop whose log it follows.
const EVENTS_QUIET: Duration = Duration::from_millis(100);
/// The most of a loop's output `loop_output` returns, and how much when it does not say.
const OUTPUT_MAX: u64 = 64 * 1024;
const OUTPUT_DEFAULT: u64 = 4096;

/// A field of a tool's schema: its name, JSON type and what it is.
type Field = (&'static str, &'static str, &'static str);

const ID: Field = ("id", "string", "The loop's id");
const ROOT: Field = (
    "root",
    "string",
    "The project's root directory, where two projects have a loop of this id",
);

/// Every tool, as `tools/list` shows them.
pub fn all() -> Vec<Tool> {
    let loop_tool = |name: &'static str, description: &'static str| {
        tool(name, description, &[ID, ROOT], &["id"])
    };
    vec![
        tool(
            "list_loops",
            "List loops: their ids, titles and how each stands.",
            &[("root", "string", "Only this project's loops")],
            &[],
        ),
        tool(
            "create_loop",
            "Create a loop that works toward a goal, and start it (unless start is false).",
            &[
                ("title", "string", "The goal, in one line"),
                (
                    "description",
                    "string",
                    "More about the goal; its agents see it",
                ),
                ("tasks", "array", "Tasks to develop, in order"),
                (
                    "root",
                    "string",
                    "The project's root directory [default: the server's]",
                ),
                (
                    "workflow",
                    "string",
                    "ccw-loop or skill-tuning [default: the project's]",
                ),
                (
                    "executor",
                    "string",
                    "The executor to run it with, by its name in the config",
                ),
                (
                    "race",
                    "array",
                    "Executors that each try every task; the first to pass is kept",
                ),
                ("worktree", "boolean", "Work in a git work tree of its own"),
                (
                    "parallel",
                    "integer",
                    "Develop up to this many tasks at once",
                ),
                (
                    "max_iterations",
                    "integer",
                    "Complete after this many actions",
                ),
                (
                    "max_cost_usd",
                    "number",
                    "Fail once its agents have cost this much",
                ),
                ("start", "boolean", "Start it now [default: true]"),
            ],
            &["title"],
        ),
        loop_tool(
            "loop_status",
            "How a loop stands: its status, iteration, and what it waits for.",
        ),
        loop_tool("pause_loop", "Pause a loop: its action in flight ends now."),
        loop_tool("resume_loop", "Resume a paused or stopped loop."),
        loop_tool("stop_loop", "Stop a loop: its action in flight ends now."),
        tool(
            "add_task",
            "Add a task to a loop's task list.",
            &[
                ID,
                ("text", "string", "What the task is"),
                ("after", "array", "Ids of the tasks it needs done first"),
                ("race", "array", "Executors that each try it"),
                ROOT,
            ],
            &["id", "text"],
        ),
        tool(
            "answer",
            "Answer the question a loop's agent asked.",
            &[ID, ("text", "string", "The answer"), ROOT],
            &["id", "text"],
        ),
        loop_tool(
            "retry_loop",
            "Run a failed loop again from where it failed.",
        ),
        tool(
            "loop_diff",
            "What a loop changed in its work tree: in all, or at one checkpoint.",
            &[
                ID,
                (
                    "checkpoint",
                    "string",
                    "One checkpoint's name [default: all]",
                ),
                ROOT,
            ],
            &["id"],
        ),
        loop_tool(
            "list_checkpoints",
            "A loop's checkpoints, oldest first, with what each changed.",
        ),
        tool(
            "rollback",
            "Put a loop's work tree back as it was at a checkpoint.",
            &[
                ID,
                ("checkpoint", "string", "The checkpoint's name"),
                ("force", "boolean", "Even over changes no checkpoint holds"),
                ROOT,
            ],
            &["id", "checkpoint"],
        ),
        tool(
            "loop_events",
            "A loop's events after a cursor; call again with next_after to read on.",
            &[
                ID,
                (
                    "after",
                    "integer",
                    "The last event number already read [default: 0]",
                ),
                (
                    "limit",
                    "integer",
                    "The most events to return [default: 50, at most 500]",
                ),
                ROOT,
            ],
            &["id"],
        ),
        tool(
            "loop_output",
            "The end of the output of a loop's action in flight.",
            &[
                ID,
                (
                    "bytes",
                    "integer",
                    "How much [default: 4096, at most 65536]",
                ),
                ROOT,
            ],
            &["id"],
        ),
        tool(
            "wait_for_loop",
            "Wait until a loop ends or needs a person (a question, a block, a pause), with \
             progress notifications, for at most timeout_seconds.",
            &[
                ID,
                (
                    "timeout_seconds",
                    "integer",
                    "The longest wait [default: 60, at most 600]",
                ),
                ROOT,
            ],
            &["id"],
        ),
    ]
}

fn tool(
    name: &'static str,
    description: &'static str,
    fields: &[Field],
    required: &[&str],
) -> Tool {
    let properties: Map<String, Value> = fields
        .iter()
        .map(|&(field, kind, what)| {
            let mut schema = json!({ "type": kind, "description": what });
            if kind == "array" {
                schema["items"] = json!({ "type": "string" });
            }
            (field.to_owned(), schema)
        })
        .collect();
    let schema = json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    });
    let Value::Object(schema) = schema else {
        unreachable!("a schema is an object")
    };
    Tool::new(name, description, Arc::new(schema))
}

/// Runs tool `name`: its answer, or what went wrong in one line.
pub async fn call(
    front: &Front,
    name: &str,
    arguments: JsonObject,
    context: &RequestContext<RoleServer>,
) -> CallToolResult {
    let args = Args(arguments);
    match run(front, name, &args, context).await {
        Ok(value) => CallToolResult::structured(value),
        Err(e) => {
            let said = loopd_exec::result::without_dumps(&format!("{e:#}"));
            tracing::info!("mcp: {name} refused: {said}");
            CallToolResult::error(vec![ContentBlock::text(said)])
        }
    }
}

async fn run(
    front: &Front,
    name: &str,
    args: &Args,
    context: &RequestContext<RoleServer>,
) -> Result<Value> {
    let root = args.path("root")?;
    let root = root.as_deref();
    let id = || args.string("id");
    let change = |change: Change| async move { changed(front, &id()?, root, change).await };
    let local = |ask: Local| async move { local(front, &id()?, root, ask).await };
    match name {
        "list_loops" => list(front, root).await,
        "create_loop" => create(front, args).await,
        "loop_status" => Ok(summary(&show(front, &id()?, root).await?)),
        "pause_loop" => change(Change::Control(Control::Pause)).await,
        "resume_loop" => change(Change::Control(Control::Resume)).await,
        "stop_loop" => change(Change::Control(Control::Stop)).await,
        "add_task" => {
            let task = NewTask::new(
                args.string("text")?,
                &args.strings("after")?,
                &args.strings("race")?,
            );
            change(Change::Task(task)).await
        }
        "answer" => change(Change::Answer(args.string("text")?)).await,
        "retry_loop" => local(Local::Retry).await,
        "loop_diff" => local(Local::Diff(args.optional_string("checkpoint")?)).await,
        "list_checkpoints" => local(Local::Checkpoints).await,
        "rollback" => {
            let checkpoint = args.string("checkpoint")?;
            let force = args.flag("force")?.unwrap_or(false);
            local(Local::Rollback { checkpoint, force }).await
        }
        "loop_events" => events(front, &id()?, root, args).await,
        "loop_output" => {
            let bytes = args
                .number("bytes")?
                .unwrap_or(OUTPUT_DEFAULT)
                .min(OUTPUT_MAX);
            let id = id()?;
            let id = id.as_str();
            held(front, id, |d| async move { d.tail(id, root, bytes).await }).await
        }
        "wait_for_loop" => wait(front, &id()?, root, args, context).await,
        _ => bail!("no tool {name}"),
    }
}

/// Asks each driver in turn about loop `id`; the first that holds it answers.
async fn held<T, Asked: Future<Output = Result<Option<T>>>>(
    front: &Front,
    id: &str,
    ask: impl FnMut(Arc<dyn Driver>) -> Asked,
) -> Result<T> {
    loopd_core::driver::first(&front.drivers, ask)
        .await?
        .ok_or_else(|| anyhow!("no loop {id}"))
}

async fn changed(front: &Front, id: &str, root: Option<&Path>, change: Change) -> Result<Value> {
    held(front, id, |d| {
        let change = change.clone();
        async move { d.change(id, root, change).await }
    })
    .await
}

async fn local(front: &Front, id: &str, root: Option<&Path>, ask: Local) -> Result<Value> {
    held(front, id, |d| {
        let ask = ask.clone();
        async move { d.local(id, root, ask).await }
    })
    .await
}

/// A loop as its driver holds it, with the driver's name.
struct Seen {
    driver: &'static str,
    root: PathBuf,
    state: LoopState,
    /// Why it stands still where only its driver knows ([`loopd_core::driver::Shown::still`]).
    still: Option<Still>,
}

async fn show(front: &Front, id: &str, root: Option<&Path>) -> Result<Seen> {
    held(front, id, |d| async move {
        let shown = d.show(id, root).await?;
        Ok(shown.map(|s| Seen {
            driver: d.name(),
            root: s.root,
            state: s.state,
            still: s.still,
        }))
    })
    .await
}

/// How a loop stands, for an agent: what it is, how far it got, and what it waits for.
fn summary(seen: &Seen) -> Value {
    let s = &seen.state;
    let skill = s.skill_state.as_ref();
    let question = skill
        .and_then(|k| k.question.as_ref())
        .filter(|q| q.waiting())
        .map(|q| json!({ "action": q.action, "text": q.text }));
    let in_flight = skill
        .and_then(|k| k.in_flight.as_ref())
        .map(|f| json!({ "action": f.action, "attempt": f.attempt, "started_at": f.started_at }));
    let still = seen.still.clone().or_else(|| s.still());
    json!({
        "loop_id": s.loop_id,
        "root": seen.root,
        "driver": seen.driver,
        "title": s.title,
        "status": s.status.as_str(),
        "standing": s.standing(),
        "status_reason": still.as_ref().map(|w| &w.reason),
        "next_step": still.as_ref().map(|w| &w.next),
        "iteration": s.current_iteration,
        "errors": skill.map_or(0, |k| k.error_count),
        "failure_reason": s.failure_reason,
        "question": question,
        "blocked": skill.and_then(|k| k.blocked.as_ref()).map(|b| &b.reason),
        "awaiting_choice": skill.and_then(|k| k.awaiting_choice.as_ref()).map(|w| &w.choices),
        "in_flight": in_flight,
        "ended": ended(s),
        "needs_person": needs_person(s),
    })
}

/// Whether a loop has ended: completed, failed or stopped.
fn ended(s: &LoopState) -> bool {
    matches!(
        s.status,
        Status::Completed | Status::Failed | Status::UserExit
    )
}

/// Whether a loop stands still until a person acts: paused (blocked, stalled, or by someone),
/// or waiting for an answer or for its next action.
fn needs_person(s: &LoopState) -> bool {
    let skill = s.skill_state.as_ref();
    s.status == Status::Paused
        || skill.is_some_and(|k| {
            k.awaiting_choice.is_some() || k.question.as_ref().is_some_and(|q| q.waiting())
        })
}

async fn list(front: &Front, root: Option<&Path>) -> Result<Value> {
    let mut loops = Vec::new();
    for driver in front.drivers.iter() {
        for l in driver.list().await? {
            if root.is_some_and(|root| root != l.root) {
                continue;
            }
            loops.push(match l.state {
                Ok(state) => summary(&Seen {
                    driver: driver.name(),
                    root: l.root,
                    state,
                    still: l.still,
                }),
                Err(error) => json!({ "loop_id": l.id, "root": l.root, "error": error }),
            });
        }
    }
    Ok(json!({ "loops": loops }))
}

async fn create(front: &Front, args: &Args) -> Result<Value> {
    let root = match args.path("root")? {
        Some(root) => root,
        None => front
            .home
            .clone()
            .context("name the project's root: this server has no default project")?,
    };
    let new = NewLoop {
        root,
        title: Some(args.string("title")?),
        description: args.optional_string("description")?.unwrap_or_default(),
        workflow: args.optional_string("workflow")?,
        tasks: args.strings("tasks")?,
        race: args.strings("race")?,
        worktree: args.flag("worktree")?.unwrap_or(false),
        start: args.flag("start")?.unwrap_or(true),
        executor: args.optional_string("executor")?,
        parallel: args.number("parallel")?,
        max_iterations: args.number("max_iterations")?,
        max_cost_usd: args.float("max_cost_usd")?,
        ..NewLoop::default()
    };
    for driver in front.drivers.iter() {
        if let Some(made) = driver.create(&new).await? {
            tracing::info!("mcp: created loop {} in {}", made.id, made.root.display());
            return Ok(json!({
                "loop_id": made.id,
                "root": made.root,
                "started": made.pid.is_some(),
            }));
        }
    }
    bail!("{} is not a project loopd serves here", new.root.display())
}

async fn events(front: &Front, id: &str, root: Option<&Path>, args: &Args) -> Result<Value> {
    let after = args.number("after")?.unwrap_or(0);
    let limit = args
        .number("limit")?
        .unwrap_or(EVENTS_DEFAULT)
        .clamp(1, EVENTS_MAX);
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let found = held(
        front,
        id,
        |d| async move { d.events(id, root, after).await },
    )
    .await?;
    let lines = match found {
        Events::SoFar(so_far) => so_far.into_iter().take(limit).collect(),
        Events::Live(mut live) => {
            let mut lines = Vec::new();
            while lines.len() < limit {
                match tokio::time::timeout(EVENTS_QUIET, live.next()).await {
                    Ok(Some(line)) => lines.push(line),
                    _ => break,
                }
            }
            lines
        }
    };
    let next_after = lines.last().map_or(after, |(n, _)| *n);
    let events: Vec<Value> = lines
        .into_iter()
        .map(|(_, line)| serde_json::from_str(&line).unwrap_or(Value::String(line)))
        .collect();
    Ok(json!({ "loop_id": id, "events": events, "next_after": next_after }))
}

/// Waits until loop `id` ends or needs a person, telling the client its progress (its
/// iteration) as it goes, for at most the call's `timeout_seconds`.
async fn wait(
    front: &Front,
    id: &str,
    root: Option<&Path>,
    args: &Args,
    context: &RequestContext<RoleServer>,
) -> Result<Value> {
    let timeout = args
        .number("timeout_seconds")?
        .unwrap_or(WAIT_DEFAULT)
        .min(WAIT_MAX);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
    let token = context.meta.get_progress_token();
    let mut told = None;
    loop {
        let seen = show(front, id, root).await?;
        let mut value = summary(&seen);
        let done = ended(&seen.state) || needs_person(&seen.state);
        if let Some(token) = &token {
            let now = (seen.state.current_iteration, seen.state.standing());
            if told.as_ref() != Some(&now) {
                let progress = ProgressNotificationParam::new(token.clone(), now.0 as f64)
                    .with_message(format!("iteration {}: {}", now.0, now.1));
                // A client that went away ends the wait below, at its cancellation.
                let _ = context.peer.notify_progress(progress).await;
                told = Some(now);
            }
        }
        let timed_out = tokio::time::Instant::now() >= deadline;
        if done || timed_out {
            value["timed_out"] = json!(!done);
            return Ok(value);
        }
        tokio::select! {
            () = context.ct.cancelled() => bail!("the wait was cancelled"),
            () = tokio::time::sleep(WAIT_LOOK) => {}
        }
    }
}

/// A loop's state as its resource reads: pretty JSON.
pub async fn state_text(front: &Front, id: &str) -> Result<String> {
    let seen = show(front, id, None).await?;
    Ok(serde_json::to_string_pretty(&summary(&seen))?)
}

/// A loop's events as its resource reads: one JSON line each, the most recent
/// [`EVENTS_MAX`].
pub async fn events_text(front: &Front, id: &str) -> Result<String> {
    let mut args = Map::new();
    args.insert("limit".into(), json!(u64::MAX));
    let mut lines = Vec::new();
    let mut after = 0;
    loop {
        args.insert("after".into(), json!(after));
        let read = events(front, id, None, &Args(args.clone())).await?;
        let events = read["events"].as_array().cloned().unwrap_or_default();
        if events.is_empty() {
            break;
        }
        lines.extend(events.iter().map(Value::to_string));
        after = read["next_after"].as_u64().unwrap_or(after);
    }
    let skip = lines.len().saturating_sub(EVENTS_MAX as usize);
    Ok(lines[skip..].join("\n"))
}

/// A call's arguments, read with a one-line refusal of a field of the wrong type.
struct Args(JsonObject);

impl Args {
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn optional_string(&self, name: &str) -> Result<Option<String>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => bail!("{name}: a string"),
        }
    }

    fn string(&self, name: &str) -> Result<String> {
        self.optional_string(name)?
            .with_context(|| format!("{name} is required"))
    }

    fn path(&self, name: &str) -> Result<Option<PathBuf>> {
        Ok(self.optional_string(name)?.map(PathBuf::from))
    }

    fn strings(&self, name: &str) -> Result<Vec<String>> {
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| i.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .with_context(|| format!("{name}: a list of strings")),
            Some(_) => bail!("{name}: a list of strings"),
        }
    }

    fn number(&self, name: &str) -> Result<Option<u64>> {
        self.get(name)
            .map(|v| {
                v.as_u64()
                    .with_context(|| format!("{name}: a whole number"))
            })
            .transpose()
    }

    fn float(&self, name: &str) -> Result<Option<f64>> {
        self.get(name)
            .map(|v| v.as_f64().with_context(|| format!("{name}: a number")))
            .transpose()
    }

    fn flag(&self, name: &str) -> Result<Option<bool>> {
        self.get(name)
            .map(|v| {
                v.as_bool()
                    .with_context(|| format!("{name}: true or false"))
            })
            .transpose()
    }
}
