//! The loops of the projects a service serves, as a front asks for them ([`Driver`]): a loop is
//! found by its id among those projects, read through the project opened once, and changed as
//! the command line changes it (through [`crate::control`], with the project's configuration as
//! it is now).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Result;
use serde_json::{Value, json};

use loopd_core::control::Change;
use loopd_core::driver::{Created, Driver, Events, Listed, Local, NewLoop, Refused, Shown};
use loopd_store::events::EventTail;
use loopd_store::store::StoreError;

use crate::control::{BY_API, set_control};
use crate::project::Project;
use crate::service::ServiceInfo;

/// The projects a service serves, and the service's status as its supervisor last published it
/// (which of their loops its daemons drive). Its clones share them.
#[derive(Clone)]
pub struct Files {
    /// Who its changes are recorded as made by ([`BY_API`], `mcp`).
    by: &'static str,
    info: Arc<RwLock<ServiceInfo>>,
    /// Opened once: a request reads through them rather than open every project (its
    /// configuration read, its directory opened) to find one loop.
    projects: Arc<RwLock<BTreeMap<PathBuf, Arc<Project>>>>,
}

impl Default for Files {
    fn default() -> Files {
        Files::by(BY_API)
    }
}

impl Files {
    /// No project yet, its changes recorded as made `by` this front.
    pub fn by(by: &'static str) -> Files {
        Files {
            by,
            info: Arc::default(),
            projects: Arc::default(),
        }
    }

    /// The same projects and status, its changes recorded as made `by` another front.
    pub fn recorded_as(&self, by: &'static str) -> Files {
        Files { by, ..self.clone() }
    }

    /// The service's status as last published.
    pub fn info(&self) -> ServiceInfo {
        self.info.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn publish(&self, info: ServiceInfo) {
        *self.info.write().unwrap_or_else(|e| e.into_inner()) = info;
    }

    /// Serves `project` from now on.
    pub fn serve(&self, project: Arc<Project>) {
        self.projects
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(project.root.clone(), project);
    }

    /// The projects served, in the order of their roots.
    pub fn projects(&self) -> Vec<Arc<Project>> {
        let projects = self.projects.read().unwrap_or_else(|e| e.into_inner());
        projects.values().cloned().collect()
    }

    /// The project served at `root`.
    pub fn project(&self, root: &Path) -> Option<Arc<Project>> {
        let projects = self.projects.read().unwrap_or_else(|e| e.into_inner());
        projects.get(root).cloned()
    }

    /// The project served that holds loop `id` (the one at `root`, where two hold one of that
    /// id); `None` when none does. It reads the projects' directories: call it off the runtime.
    pub fn find(&self, id: &str, root: Option<&Path>) -> Result<Option<Arc<Project>>> {
        loopd_store::store::validate_id(id)?;
        if let Some(root) = root
            && !self.info().serves(root)
        {
            return Err(crate::error::usage(format!(
                "{} is not a project of this service",
                root.display()
            )));
        }
        let mut found: Vec<_> = self
            .projects()
            .into_iter()
            .filter(|p| root.is_none_or(|root| root == p.root))
            .filter(|p| p.store.state_path(id).exists())
            .collect();
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop()),
            _ => Err(crate::error::usage(format!(
                "loop {id} is in more than one project; name one with ?root="
            ))),
        }
    }

    /// Runs `f` on a blocking thread (the store waits for locks, reads and writes files) with
    /// the project that holds loop `id`, opened as `open` says; `None` when none holds it.
    async fn on_loop<T: Send + 'static>(
        &self,
        id: &str,
        root: Option<&Path>,
        open: Open,
        f: impl FnOnce(&Project, &str) -> Result<T> + Send + 'static,
    ) -> Result<Option<T>> {
        let (files, id, root) = (self.clone(), id.to_owned(), root.map(Path::to_owned));
        blocking(move || {
            let Some(found) = files.find(&id, root.as_deref())? else {
                return Ok(None);
            };
            let opened;
            let p = match open {
                Open::Served => &*found,
                Open::Anew => {
                    opened = Project::open_for_inspection(Some(&found.root), None)?;
                    &opened
                }
                Open::Strictly => {
                    opened = Project::open(Some(&found.root), None)?;
                    &opened
                }
            };
            f(p, &id).map(Some)
        })
        .await
    }
}

/// How a request opens a loop's project.
#[derive(Clone, Copy)]
enum Open {
    /// As the service opened it: for a read.
    Served,
    /// Anew, its configuration as it is now, as the CLI would read it: for a change.
    Anew,
    /// Anew, and a configuration that does not load is refused rather than replaced by the
    /// defaults: for what starts a loop again.
    Strictly,
}

/// Runs `f` on a blocking thread.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await?
}

#[async_trait::async_trait]
impl Driver for Files {
    fn name(&self) -> &'static str {
        "file"
    }

    fn here(&self) -> bool {
        true
    }

    async fn list(&self) -> Result<Vec<Listed>> {
        let projects = self.projects();
        blocking(move || {
            let mut listed = Vec::new();
            for p in &projects {
                for id in p.store.list_ids()? {
                    let state = p.store.load(&id).map(|l| l.state);
                    listed.push(Listed {
                        root: p.root.clone(),
                        id,
                        state: state.map_err(|e| e.to_string()),
                        // This machine's view ([`crate::view`]) says what only it knows.
                        still: None,
                    });
                }
            }
            Ok(listed)
        })
        .await
    }

    async fn show(&self, id: &str, root: Option<&Path>) -> Result<Option<Shown>> {
        self.on_loop(id, root, Open::Served, |p, id| {
            let loaded = p.store.load(id)?;
            Ok(Shown {
                root: p.root.clone(),
                state: loaded.state,
                raw: loaded.raw,
                still: None,
            })
        })
        .await
    }

    async fn change(&self, id: &str, root: Option<&Path>, change: Change) -> Result<Option<Value>> {
        let by = self.by;
        self.on_loop(id, root, Open::Anew, move |p, id| match change {
            Change::Control(what) => {
                let done = set_control(p, id, what, by)?;
                Ok(json!({
                    "loop_id": id,
                    "from": done.from.as_str(),
                    "status": done.to.as_str(),
                    "changed": done.changed,
                }))
            }
            Change::Next(action) => crate::control::choose_next(p, id, &action),
            Change::Task(task) => {
                let after = task.after.unwrap_or_default();
                crate::control::add_task(p, id, &task.text, &after, &task.race)
            }
            Change::Answer(text) => crate::control::give_answer(p, id, &text),
            Change::Set(limits) => crate::control::set_limits(p, id, &limits.into()),
        })
        .await
    }

    async fn create(&self, new: &NewLoop) -> Result<Option<Created>> {
        if !self.info().serves(&new.root) {
            return Ok(None);
        }
        let args = crate::create::CreateArgs {
            title: new.title.clone(),
            description: new.description.clone(),
            limits: new.limits().into(),
            mode: if new.interactive {
                crate::create::ModeArg::Interactive
            } else {
                crate::create::ModeArg::Auto
            },
            workflow: new.workflow.clone(),
            tasks: new.tasks.clone(),
            race: new.race.clone(),
            worktree: new.worktree,
            ..Default::default()
        };
        let (root, start, executor) = (new.root.clone(), new.start, new.executor.clone());
        blocking(move || {
            let p = Project::open(Some(&root), None)?;
            let id = crate::create::create_loop(&p, &args)?;
            // As `loopd start` starts it: a running service takes it, else a daemon of its own.
            let pid = match start {
                true => {
                    let pid = crate::daemon::start(&p, &id, executor.as_deref())?;
                    crate::registry::note(&p.root);
                    Some(pid)
                }
                false => None,
            };
            Ok(Some(Created {
                id,
                root: p.root.clone(),
                pid,
            }))
        })
        .await
    }

    /// The event log read as `logs --follow` reads it ([`EventTail`], across rotations), new
    /// events as they are written (the progress directory is watched).
    async fn events(&self, id: &str, root: Option<&Path>, after: u64) -> Result<Option<Events>> {
        let found = self
            .on_loop(id, root, Open::Served, |p, id| {
                Ok((EventTail::new(&p.store, id), p.store.progress(id)?))
            })
            .await?;
        let Some((tail, dir)) = found else {
            return Ok(None);
        };
        let wake = Arc::new(tokio::sync::Notify::new());
        let subscription = {
            let wake = wake.clone();
            loopd_store::watch::subscribe(
                dir.path(),
                Arc::new(move |_: &notify::Result<notify::Event>| wake.notify_one()),
            )
        };
        let reader = EventReader {
            tail: Some(tail),
            after,
            seen: 0,
            pending: std::collections::VecDeque::new(),
            wake,
            _subscription: subscription,
        };
        let stream = futures_util::stream::unfold(reader, |mut reader| async move {
            let event = reader.next().await?;
            Some((event, reader))
        });
        Ok(Some(Events::Live(Box::pin(stream))))
    }

    async fn tail(&self, id: &str, root: Option<&Path>, bytes: u64) -> Result<Option<Value>> {
        self.on_loop(id, root, Open::Served, move |p, id| {
            let state = p.store.load(id)?.state;
            let flight = state.skill_state.as_ref().and_then(|s| s.in_flight.clone());
            let Some(flight) = flight else {
                return Ok(json!({ "loop_id": id, "in_flight": null, "text": null }));
            };
            // The attempt's log, by its name alone, in the progress directory.
            let text = flight
                .log
                .as_deref()
                .filter(|name| plain_name(name))
                .and_then(|name| {
                    let actions = p.store.progress(id).ok()?.subdir("actions", false).ok()?;
                    actions.read_tail(name, bytes)
                });
            Ok(json!({
                "loop_id": id,
                "in_flight": {
                    "action": flight.action,
                    "iteration": flight.iteration,
                    "attempt": flight.attempt,
                    "pid": flight.pid,
                    "started_at": flight.started_at,
                },
                "text": text,
            }))
        })
        .await
    }

    async fn local(&self, id: &str, root: Option<&Path>, ask: Local) -> Result<Option<Value>> {
        let open = match ask {
            Local::Retry => Open::Strictly,
            Local::Rollback { .. } => Open::Anew,
            Local::Checkpoints | Local::Diff(_) => Open::Served,
        };
        let by = self.by;
        self.on_loop(id, root, open, move |p, id| match ask {
            Local::Retry => {
                let retried = crate::control::retry_loop(p, id, by)?;
                Ok(json!({
                    "loop_id": id,
                    "from": retried.from.as_str(),
                    "status": loopd_core::state::Status::Running.as_str(),
                    "tasks_reset": retried.tasks_reset,
                }))
            }
            Local::Checkpoints => {
                let list = crate::checkpoints::list(p, id)?;
                Ok(json!({ "loop_id": id, "checkpoints": list }))
            }
            Local::Diff(Some(name)) => Ok(serde_json::to_value(crate::checkpoints::diff(
                p, id, &name,
            )?)?),
            Local::Diff(None) => {
                let diff = crate::checkpoints::diff_text(p, id, None)?;
                Ok(json!({ "loop_id": id, "diff": diff }))
            }
            Local::Rollback { checkpoint, force } => {
                let commit = crate::checkpoints::rollback(p, id, &checkpoint, force)?;
                Ok(json!({ "loop_id": id, "checkpoint": checkpoint, "commit": commit }))
            }
        })
        .await
    }
}

/// Whether `name` is one plain file name (not `.` or `..`, no `/`, no control characters): a
/// log's name is opened in `actions/` and nowhere else (a loop's state, which names it, anyone
/// may write).
pub fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.chars().any(char::is_control)
}

/// A loop's events for one follower: the lines read, numbered, those it has seen left out.
struct EventReader {
    /// Taken while a blocking thread reads.
    tail: Option<EventTail>,
    /// The follower has seen the events up to this number.
    after: u64,
    /// The number of the last line read.
    seen: u64,
    pending: std::collections::VecDeque<(u64, String)>,
    wake: Arc<tokio::sync::Notify>,
    _subscription: loopd_store::watch::Subscription,
}

impl EventReader {
    /// The next event; `None` ends the stream (the log cannot be read).
    async fn next(&mut self) -> Option<(u64, String)> {
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
                if self.seen > self.after {
                    self.pending.push_back((self.seen, line));
                }
            }
            if self.pending.is_empty() {
                // A rare look even without an event, in case one was missed.
                let _ = tokio::time::timeout(Duration::from_secs(5), self.wake.notified()).await;
            }
        }
    }
}

/// No project of the service holds loop `id`, and no other driver: what a front answers.
pub fn not_found(id: &str) -> anyhow::Error {
    StoreError::NotFound {
        id: id.to_owned(),
        path: PathBuf::from(id),
    }
    .into()
}

/// Project `root` is none of the service's, and no other driver makes loops there.
pub fn not_served(root: &Path) -> anyhow::Error {
    Refused(format!(
        "{} is not a project of this service",
        root.display()
    ))
    .into()
}
