//! `loopd serve`: one background service that drives every loop of the projects it knows.
//!
//! Theory of operation: the supervisor is one task that owns the service's bookkeeping (the
//! projects, the loops it drives, the queue). Everything that happens reaches it as a `Wake`
//! on one channel: a state file changed (one subscription per state directory, all on the
//! process's one inotify instance), the registry of projects changed, a loop's task ended,
//! SIGHUP, the safety tick. A loop whose status is `running` and that no daemon drives is taken
//! with the locks `loopd run` takes (the lock is the one truth: a loop driven in a terminal is
//! never also driven here) and driven by a task of its own, with the engine of a daemon. Beyond
//! `max_running_loops` it waits in the queue, in order. A loop that pauses ends its task and
//! frees its place; resumed, it is taken again. A loop that errs or panics ends alone.
//!
//! SIGTERM ends every action in flight, records it as interrupted and leaves the loops
//! `running`, so that the next start takes them up again, as it takes up every loop it finds
//! `running` whose daemon died (its executors found by their marker and ended first).
//!
//! The routes ask drivers for loops ([`loopd_core::driver::Driver`]), in order: the file store
//! of the projects served ([`loopd_file_driver::front::Files`]), then those the binary gives
//! (loops on Temporal, in a build with that feature), listed, shown and changed alike.
//!
//! Which layer may use which: this crate is the front over the file driver
//! ([`loopd_file_driver`]: a loop's engine, its locks, what people do to a loop) and uses every
//! crate below it; only the binary uses it.

pub mod api;
pub mod systemd;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use tokio::sync::{mpsc, watch};

use loopd_core::state::Status;
use loopd_file_driver::orchestrator::Exit;
use loopd_file_driver::project::Project;
use loopd_file_driver::service::{self, LoopKey, ServiceInfo};
use loopd_fs::Dir;
use loopd_store::watch::Subscription;

/// `loopd serve`'s own options (the roots come from the global `--root`, repeatable here).
#[derive(Debug, Default, clap::Args)]
pub struct ServeArgs {
    /// How many loops run at once; others wait in a queue [default: max_running_loops]
    #[arg(long, value_name = "N")]
    pub max_running_loops: Option<u64>,
    /// Serve the API and the dashboard on this loopback address too (127.0.0.1:PORT; port 0
    /// picks one); every request needs the token, and the log prints the dashboard's login link
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<std::net::SocketAddr>,
}

/// The most threads for blocking sections at once, per core (at least four in all). A loop's
/// blocking section (a state write, a lock wait, a checkpoint's git) hands its worker's place to
/// a thread of this pool ([`tokio::task::block_in_place`]), so every one of them ends up running
/// loops and holding the allocator's pages of every size it allocates: each thread costs about
/// a megabyte of memory, however few bytes it uses. Two per core keep both cores busy while some
/// wait on a disk, and four sections that never end are still not enough to stall the others.
/// The service bench at 200 loops on two cores (`cargo bench --bench service`): 16 threads,
/// 84 MiB of RSS; 4 threads, 70 MiB, at the same CPU per action (with git repositories: 69 and
/// 63 MiB, and 43 against 53 actions per second).
const BLOCKING_THREADS_PER_CORE: usize = 2;

/// How often every known loop is looked at even without an event, in case one was missed
/// (inotify says when it dropped events: then every loop is looked at at once).
const RESCAN: Duration = Duration::from_secs(60);
/// How long a loop that could not be taken is left alone before a change of its state file is
/// looked at again (its project's next loop to end, or the rescan, look anyway).
const REFUSED_HOLD: Duration = Duration::from_secs(2);
/// How long a loop whose task failed or panicked is left alone before it is tried again.
const FAILED_HOLD: Duration = Duration::from_secs(30);

/// What the supervisor hears.
enum Wake {
    /// A loop's state file changed.
    Changed(LoopKey),
    /// Events may have been lost: look at every loop.
    Rescan,
    /// The registry of projects changed.
    Projects,
    /// A loop's task ended.
    Ended(LoopKey, Ending),
    /// SIGHUP: reload the configuration.
    Reload,
}

/// A loop left alone for a while.
struct Hold {
    until: Instant,
    /// What was said about it, said again only when it changes.
    message: String,
    /// It could not be taken (rather than failed while it ran): another loop's end may be what
    /// it waits for.
    refused: bool,
    /// The loop whose work tree it waits for: a change of that loop's state file (it ended, or
    /// paused), or its end here, lets it be tried again at once, and in any case it is tried
    /// again at `until`.
    behind: Option<String>,
    /// Its state file changed during the hold: it is looked at again when the hold ends.
    changed: bool,
}

/// How a loop's task ended.
enum Ending {
    Exit(Exit),
    /// The loop could not be taken (driven elsewhere, untrusted files, a missing program...).
    Refused(String),
    /// The loop could not be taken because another loop runs in its work tree.
    Busy(loopd_file_driver::error::WorkTreeBusy),
    Error(String),
    Panicked(String),
    /// The service began to stop before the loop was driven: it was left as it was.
    NotTaken,
}

/// A project the service watches.
struct Watched {
    /// Shared with the API, which reads through it.
    project: Arc<Project>,
    _events: Subscription,
    /// Settles the versions its writers replaced (the service's own, and those handed over by
    /// commands that exit at once: see [`loopd_store::store::Store::close_with`]).
    settler: tokio::task::JoinHandle<()>,
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.settler.abort();
    }
}

struct Supervisor {
    config_flag: Option<PathBuf>,
    root_flags: Vec<PathBuf>,
    max_flag: Option<u64>,
    max_running: usize,
    projects: BTreeMap<PathBuf, Watched>,
    /// The loops whose task runs (taking them, driving them, or ending).
    active: BTreeSet<LoopKey>,
    queue: VecDeque<LoopKey>,
    /// Loops not to try again before a time, with what was said about them.
    held: HashMap<LoopKey, Hold>,
    /// Each loop's status as last read.
    statuses: BTreeMap<LoopKey, Status>,
    /// The rate limits of executors' accounts, which every loop of an account waits out.
    accounts: loopd_file_driver::accounts::Accounts,
    tx: mpsc::UnboundedSender<Wake>,
    shutdown: watch::Receiver<Option<i32>>,
    notifier: systemd::Notifier,
    runtime_dir: Dir,
    info: ServiceInfo,
    /// `info` as the API shows it.
    shared: api::Shared,
    /// `info` as last written.
    published: Option<String>,
    _registry: Option<Subscription>,
}

/// `loopd serve`: runs until SIGTERM or SIGINT; returns the exit code.
pub fn run(
    roots: &[PathBuf],
    config_flag: Option<&Path>,
    args: &ServeArgs,
    others: Vec<Arc<dyn loopd_core::driver::Driver>>,
) -> Result<i32> {
    let root_flags = roots
        .iter()
        .map(|r| loopd_file_driver::project::resolve_root(Some(r)))
        .collect::<Result<Vec<_>>>()?;
    if let Some(addr) = &args.listen {
        api::check_listen(addr)?;
    }
    let config = loopd_project::config::Config::load_service(config_flag)?;
    let runtime_dir = loopd_file_driver::registry::runtime_dir(true)
        .context("cannot make the service's runtime directory")?;
    let _lock = service::lock(&runtime_dir)?;
    loopd_exec::procs::become_subreaper();
    raise_open_file_limit();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .max_blocking_threads((BLOCKING_THREADS_PER_CORE * cores).max(4))
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let (tx, rx) = mpsc::unbounded_channel();
        let (signals, shutdown) = watch::channel(None);
        let (hangup, mut hangups) = mpsc::unbounded_channel();
        take_signals(signals, hangup)?;
        let reload = tx.clone();
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                let _ = reload.send(Wake::Reload);
            }
        });
        let mut supervisor = Supervisor {
            config_flag: config_flag.map(Path::to_owned),
            root_flags,
            max_flag: args.max_running_loops,
            max_running: 0,
            projects: BTreeMap::new(),
            active: BTreeSet::new(),
            queue: VecDeque::new(),
            held: HashMap::new(),
            statuses: BTreeMap::new(),
            accounts: Default::default(),
            tx,
            shutdown,
            notifier: systemd::Notifier::from_env(),
            runtime_dir,
            info: ServiceInfo {
                pid: std::process::id(),
                started_at: loopd_store::now_rfc3339(),
                ..ServiceInfo::default()
            },
            shared: api::Shared::new(others),
            published: None,
            _registry: None,
        };
        supervisor.configure(&config);
        let listening = api::start(
            supervisor.shared.clone(),
            &supervisor.runtime_dir,
            args.listen,
        )
        .await?;
        supervisor.info.socket = Some(listening.socket);
        supervisor.info.listen = listening.listen.map(|a| a.to_string());
        supervisor.run(rx).await
    })
}

/// Takes SIGTERM, SIGINT and SIGHUP on a thread of its own, with a runtime of its own: the
/// service's runtime, busy starting or stopping a thousand loops at once, would see a signal only
/// after seconds, while a loop not yet taken must see at once that the service stops.
fn take_signals(
    signals: watch::Sender<Option<i32>>,
    hangup: mpsc::UnboundedSender<()>,
) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the signals' runtime")?;
    std::thread::Builder::new()
        .name("loopd-signals".into())
        .spawn(move || {
            runtime.block_on(loopd_file_driver::daemon::forward_signals(
                signals,
                Some(hangup),
            ));
        })
        .context("cannot start the signals' thread")?;
    Ok(())
}

impl Supervisor {
    fn configure(&mut self, config: &loopd_project::config::Config) {
        let max = self.max_flag.unwrap_or(config.max_running_loops).max(1);
        self.max_running = usize::try_from(max).unwrap_or(usize::MAX);
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Wake>) -> Result<i32> {
        tracing::info!(
            "loopd serve (pid {}): at most {} loops at once",
            std::process::id(),
            self.max_running
        );
        self._registry = self.watch_registry();
        self.load_projects();
        self.publish();
        self.notifier.ready();
        let beat = self.notifier.watchdog.map(|w| w / 2);
        let mut tick = tokio::time::interval(beat.unwrap_or(RESCAN).min(RESCAN));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_scan = Instant::now();
        let mut shutdown = self.shutdown.clone();
        loop {
            let retry = self.next_retry();
            tokio::select! {
                () = tokio::time::sleep_until(retry.unwrap_or_else(Instant::now).into()),
                    if retry.is_some() =>
                {
                    self.retry_due();
                    self.publish();
                }
                Some(wake) = rx.recv() => {
                    let mut changed = self.on(wake);
                    // What came meanwhile is handled before the status is published.
                    while let Ok(wake) = rx.try_recv() {
                        changed |= self.on(wake);
                    }
                    if changed {
                        self.publish();
                    }
                }
                _ = tick.tick() => {
                    if beat.is_some() {
                        self.notifier.watchdog();
                    }
                    if last_scan.elapsed() >= RESCAN {
                        last_scan = Instant::now();
                        self.scan_all();
                        self.publish();
                    }
                }
                _ = shutdown.changed() => break,
            }
        }
        self.notifier.stopping();
        self.queue.clear();
        tracing::info!(
            "stopping: ending {} loop(s); their actions in flight are recorded as interrupted",
            self.active.len()
        );
        self.publish();
        while !self.active.is_empty() {
            match rx.recv().await {
                Some(Wake::Ended(key, ending)) => self.ended(key, ending),
                Some(_) => {}
                None => break,
            }
        }
        service::withdraw(&self.runtime_dir);
        tracing::info!("stopped");
        self.notifier.flush(Duration::from_secs(2));
        Ok(0)
    }

    fn stopping(&self) -> bool {
        self.shutdown.borrow().is_some()
    }

    /// Handles one wake; whether what the service publishes may have changed.
    fn on(&mut self, wake: Wake) -> bool {
        match wake {
            Wake::Changed(key) => {
                // For the dashboards: nobody listening is no error.
                let _ = self.shared.changes.send(key.clone());
                let released = self.release_behind(&key);
                // A loop this service drives writes its own file at every action: nothing to
                // look at, nothing to publish.
                if self.active.contains(&key) && !released {
                    return false;
                }
                self.consider(key);
            }
            Wake::Rescan => self.scan_all(),
            Wake::Projects => self.load_projects(),
            Wake::Ended(key, ending) => {
                // A loop that ran frees its work tree: its project's loops refused for it may
                // go now. (One that could not be taken freed nothing.)
                if !matches!(
                    ending,
                    Ending::Refused(_) | Ending::Busy(_) | Ending::NotTaken
                ) {
                    for (other, hold) in &mut self.held {
                        if hold.refused && other.root == key.root {
                            hold.until = Instant::now();
                        }
                    }
                }
                self.ended(key.clone(), ending);
                self.scan(&key.root);
                self.admit();
            }
            Wake::Reload => self.reload(),
        }
        true
    }

    /// The loops waiting for their work tree (neither running nor queued now), and whom for.
    fn waiting(&self) -> impl Iterator<Item = (&LoopKey, &Hold)> {
        self.held.iter().filter(|(key, hold)| {
            hold.behind.is_some() && !self.active.contains(*key) && !self.queue.contains(*key)
        })
    }

    /// The held loops to look at again when their hold ends: those waiting for their work tree,
    /// and those whose state file changed meanwhile.
    fn to_retry(&self) -> impl Iterator<Item = (&LoopKey, &Hold)> {
        self.held.iter().filter(|(key, hold)| {
            (hold.behind.is_some() || hold.changed)
                && !self.active.contains(*key)
                && !self.queue.contains(*key)
        })
    }

    /// When the first held loop is due to be looked at again.
    fn next_retry(&self) -> Option<Instant> {
        self.to_retry().map(|(_, h)| h.until).min()
    }

    /// Looks again at the held loops whose time is up.
    fn retry_due(&mut self) {
        let now = Instant::now();
        let due: Vec<LoopKey> = self
            .to_retry()
            .filter(|(_, h)| h.until <= now)
            .map(|(key, _)| key.clone())
            .collect();
        for key in due {
            if let Some(hold) = self.held.get_mut(&key) {
                hold.changed = false;
            }
            self.consider(key.clone());
            // Not taken now (its state file unreadable for a moment): tried again later.
            let taken = self.active.contains(&key) || self.queue.contains(&key);
            if let Some(hold) = self.held.get_mut(&key).filter(|_| !taken) {
                hold.until = Instant::now() + REFUSED_HOLD;
            }
        }
    }

    /// `key`'s state file changed: the loops waiting for its work tree are tried again at once
    /// (it may have ended or paused). Whether there were some.
    fn release_behind(&mut self, key: &LoopKey) -> bool {
        let now = Instant::now();
        let waiting: Vec<LoopKey> = self
            .held
            .iter_mut()
            .filter(|(other, h)| {
                other.root == key.root && h.behind.as_deref() == Some(key.loop_id.as_str())
            })
            .map(|(other, h)| {
                h.until = now;
                other.clone()
            })
            .collect();
        let released = !waiting.is_empty();
        for other in waiting {
            self.consider(other);
        }
        released
    }

    /// SIGHUP: the service's configuration and its projects, read again. Each loop's project
    /// configuration is read whenever the loop is taken.
    fn reload(&mut self) {
        self.notifier.reloading();
        match loopd_project::config::Config::load_service(self.config_flag.as_deref()) {
            Ok(config) => {
                self.configure(&config);
                tracing::info!(
                    "configuration reloaded: at most {} loops at once",
                    self.max_running
                );
            }
            Err(e) => tracing::warn!("warning: {e}; keeping the configuration as it was"),
        }
        self.load_projects();
        self.admit();
        self.notifier.ready();
    }

    /// Watches the registry of projects, so that a project recorded by `create` or `start` is
    /// served at once.
    fn watch_registry(&self) -> Option<Subscription> {
        let dir = loopd_file_driver::registry::projects_dir(true)
            .inspect_err(|e| tracing::warn!("warning: cannot watch your projects: {e}"))
            .ok()?;
        let tx = self.tx.clone();
        Some(loopd_store::watch::subscribe(
            dir.path(),
            Arc::new(move |event: &notify::Result<notify::Event>| {
                // Reading the records (as the service does) is no change.
                if event
                    .as_ref()
                    .is_ok_and(|e| !loopd_store::watch::is_change(e))
                {
                    return;
                }
                let _ = tx.send(Wake::Projects);
            }),
        ))
    }

    /// Adds the projects of `--root` and of the registry that are not served yet, and looks at
    /// their loops.
    fn load_projects(&mut self) {
        let mut roots = self.root_flags.clone();
        match loopd_file_driver::registry::list() {
            Ok(records) => roots.extend(records.into_iter().map(|r| r.root)),
            Err(e) => tracing::warn!("warning: cannot read your projects: {e}"),
        }
        for root in roots {
            if self.projects.contains_key(&root) {
                continue;
            }
            let project = match Project::open_for_inspection(Some(&root), None) {
                Ok(mut p) => {
                    // It reads every loop of the project (for the API too): nothing is kept.
                    p.store = p.store.clone().without_memory();
                    p
                }
                Err(e) => {
                    tracing::warn!("warning: cannot serve {}: {e:#}", root.display());
                    continue;
                }
            };
            // The state directory is made now, so that it can be watched before its first loop.
            if let Err(e) = project.store.state_dir(true) {
                tracing::warn!("warning: cannot serve {}: {e}", root.display());
                continue;
            }
            let events = loopd_store::watch::subscribe(
                project.store.dir(),
                self.handler(&root, project.store.clone()),
            );
            tracing::info!("serving {}", root.display());
            let settler = loopd_store::watch::settle_in_background(&project.store);
            let project = Arc::new(project);
            self.shared.files.serve(project.clone());
            self.projects.insert(
                root.clone(),
                Watched {
                    project,
                    _events: events,
                    settler,
                },
            );
            self.scan(&root);
        }
        self.info.roots = self.projects.keys().cloned().collect();
    }

    /// The handler of a project's state directory: a loop's state file changed, or a command
    /// handed over the versions its writes replaced (taken over at once, settled by the
    /// project's settler).
    fn handler(
        &self,
        root: &Path,
        store: loopd_store::store::Store,
    ) -> loopd_store::watch::Handler {
        let (tx, root) = (self.tx.clone(), root.to_owned());
        Arc::new(move |event: &notify::Result<notify::Event>| {
            let event = match event {
                Ok(e) if !e.need_rescan() => e,
                _ => {
                    let _ = tx.send(Wake::Rescan);
                    return;
                }
            };
            if !loopd_store::watch::is_change(event) {
                return;
            }
            if loopd_store::watch::is_created(event) {
                for path in &event.paths {
                    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    if name.ends_with(loopd_store::store::HANDOVER_SUFFIX) {
                        store.adopt(name);
                    }
                }
            }
            for path in &event.paths {
                if let Some(id) = loop_of(path) {
                    let _ = tx.send(Wake::Changed(LoopKey {
                        root: root.clone(),
                        loop_id: id.to_owned(),
                    }));
                }
            }
        })
    }

    fn scan_all(&mut self) {
        let roots: Vec<PathBuf> = self.projects.keys().cloned().collect();
        for root in roots {
            self.scan(&root);
        }
    }

    /// Looks at every loop of a project.
    fn scan(&mut self, root: &Path) {
        let Some(watched) = self.projects.get(root) else {
            return;
        };
        let ids = match watched.project.store.list_ids() {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!("warning: cannot list the loops of {}: {e}", root.display());
                return;
            }
        };
        for id in ids {
            self.consider(LoopKey {
                root: root.to_owned(),
                loop_id: id,
            });
        }
    }

    /// Looks at one loop: one whose status is `running` and that nobody drives joins the queue.
    fn consider(&mut self, key: LoopKey) {
        if self.stopping() || self.active.contains(&key) {
            return;
        }
        let Some(watched) = self.projects.get(&key.root) else {
            return;
        };
        let store = &watched.project.store;
        let (control, driver) = tokio::task::block_in_place(|| {
            let control = store.read_control(&key.loop_id);
            let running = control
                .as_ref()
                .is_some_and(|c| c.status == Status::Running);
            let driver = running
                .then(|| loopd_file_driver::locks::daemon_pid(store, &key.loop_id))
                .flatten()
                .filter(|pid| loopd_file_driver::locks::pid_alive(*pid));
            (control, driver)
        });
        // Unreadable now (a writer half-way, a file gone): its next event comes.
        let Some(control) = control else { return };
        let wanted = control.status == Status::Running && driver.is_none();
        self.statuses.insert(key.clone(), control.status);
        if !wanted {
            self.queue.retain(|k| *k != key);
            self.held.remove(&key);
            return;
        }
        if let Some(hold) = self
            .held
            .get_mut(&key)
            .filter(|hold| Instant::now() < hold.until)
        {
            // Looked at again when the hold ends: what changed may be what it waited for.
            hold.changed = true;
            return;
        }
        if !self.queue.contains(&key) {
            self.queue.push_back(key.clone());
            if self.active.len() >= self.max_running {
                tracing::info!(
                    "loop {key} waits in the queue (position {}; {} loops run, at most {})",
                    self.queue.len(),
                    self.active.len(),
                    self.max_running
                );
            }
        }
        self.admit();
    }

    /// Takes loops from the queue, in order, while there is room.
    fn admit(&mut self) {
        while self.active.len() < self.max_running && !self.stopping() {
            let Some(key) = self.queue.pop_front() else {
                return;
            };
            self.launch(key);
        }
    }

    /// Takes a loop and drives it in a task of its own.
    fn launch(&mut self, key: LoopKey) {
        self.active.insert(key.clone());
        let shutdown = self.shutdown.clone();
        let config_flag = self.config_flag.clone();
        let accounts = self.accounts.clone();
        let (root, id) = (key.root.clone(), key.loop_id.clone());
        // Every log line of the loop's task names the loop.
        let span = tracing::info_span!("loop", id = %key.loop_id);
        let task = tokio::spawn(tracing::Instrument::instrument(
            async move {
                let me = format!("{} serve", std::process::id());
                let stopping = shutdown.clone();
                let taken = tokio::task::spawn_blocking(move || {
                    // Waited for a thread while the service began to stop: taken only to be
                    // let go again, at a cost of its own for each of hundreds of loops.
                    if stopping.borrow().is_some() {
                        return Ok(None);
                    }
                    let mut p = Project::open(Some(&root), config_flag.as_deref())?;
                    // Hundreds of loops: no object of each one's last version is kept.
                    p.store = p.store.clone().without_objects();
                    let state = p.load(&id)?;
                    // The executor it was started with, as `resume` remembers it.
                    let executor = state.skill_state.as_ref().and_then(|s| s.executor.clone());
                    let taken = loopd_file_driver::daemon::take(&p, &id, executor, true, &me)?;
                    anyhow::Ok(Some((taken, id)))
                })
                .await;
                let (mut taken, id) = match taken {
                    Ok(Ok(Some(taken))) => taken,
                    Ok(Ok(None)) => return Ending::NotTaken,
                    Ok(Err(e)) => {
                        return match e.downcast::<loopd_file_driver::error::WorkTreeBusy>() {
                            Ok(busy) => Ending::Busy(busy),
                            Err(e) => Ending::Refused(format!("{e:#}")),
                        };
                    }
                    Err(e) => return Ending::Panicked(e.to_string()),
                };
                // Taken as the service began to stop: let go undriven.
                let ending = if shutdown.borrow().is_some() {
                    Ending::NotTaken
                } else {
                    taken.engine.accounts = accounts;
                    tracing::info!("driving loop {id} in {}", taken.engine.root.display());
                    match taken.engine.run(&id, shutdown).await {
                        Ok(exit) => Ending::Exit(exit),
                        Err(e) => Ending::Error(format!("{e:#}")),
                    }
                };
                // The versions its writes replaced are settled before the loop is let go, as
                // a daemon does before it exits.
                let _ = tokio::task::spawn_blocking(move || {
                    taken.engine.store.close();
                    drop(taken);
                })
                .await;
                ending
            },
            span,
        ));
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let ending = task
                .await
                .unwrap_or_else(|e| Ending::Panicked(e.to_string()));
            let _ = tx.send(Wake::Ended(key, ending));
        });
    }

    /// A loop's task ended: say how, and hold off one that failed.
    fn ended(&mut self, key: LoopKey, ending: Ending) {
        self.active.remove(&key);
        let hold = |this: &mut Self, pause: Duration, message: String, refused: bool| {
            let said = this.held.get(&key).is_some_and(|h| h.message == message);
            let hold = Hold {
                until: Instant::now() + pause,
                message,
                refused,
                behind: None,
                changed: false,
            };
            this.held.insert(key.clone(), hold);
            !said
        };
        match ending {
            Ending::Exit(exit) => {
                self.held.remove(&key);
                tracing::info!("loop {key}: {} (exit {})", exit.label(), exit.code());
            }
            Ending::Refused(message) => {
                if hold(self, REFUSED_HOLD, message.clone(), true) {
                    tracing::warn!("loop {key} cannot be driven here: {message}");
                }
            }
            Ending::Busy(busy) => {
                let holder = busy.holder.clone().unwrap_or_default();
                let message = busy.to_string();
                if hold(self, REFUSED_HOLD, message, true) {
                    tracing::info!(
                        "loop {key} waits for loop {holder}, which runs in its work tree"
                    );
                }
                // Whose end frees the tree; one of this service's that ended already (its end
                // came before this refusal) has freed it: tried again at once.
                let ended_here = busy.pid == std::process::id()
                    && !self
                        .active
                        .iter()
                        .any(|k| k.root == key.root && k.loop_id == holder);
                if let Some(h) = self.held.get_mut(&key) {
                    h.behind = Some(holder);
                    if ended_here {
                        h.until = Instant::now();
                    }
                }
                if ended_here {
                    self.consider(key);
                }
            }
            Ending::Error(message) => {
                hold(self, FAILED_HOLD, message.clone(), false);
                tracing::error!("loop {key} ended in an error: {message}; the others go on");
            }
            Ending::Panicked(message) => {
                hold(self, FAILED_HOLD, message.clone(), false);
                tracing::error!("loop {key} panicked: {message}; the others go on");
            }
            Ending::NotTaken => tracing::info!("loop {key}: not taken, the service stops"),
        }
    }

    /// Says what the service does, where the CLI and systemd read it, when it changed.
    fn publish(&mut self) {
        let paused = self
            .statuses
            .iter()
            .filter(|(k, s)| **s == Status::Paused && !self.active.contains(*k))
            .count();
        let summary = format!(
            "{} running, {paused} paused, {} queued",
            self.active.len(),
            self.queue.len() + self.waiting().count()
        );
        if summary != self.info.summary {
            self.notifier.status(&summary);
        }
        self.info.summary = summary;
        self.info.running = self.active.iter().cloned().collect();
        self.info.queued = self.queue.iter().cloned().collect();
        self.info.waiting = self
            .waiting()
            .map(|(key, hold)| service::WaitingLoop {
                key: key.clone(),
                behind: hold.behind.clone().unwrap_or_default(),
            })
            .collect();
        self.info.waiting.sort_by(|a, b| a.key.cmp(&b.key));
        self.info.refused = self
            .held
            .iter()
            .filter(|(key, hold)| {
                hold.refused && hold.behind.is_none() && !self.active.contains(*key)
            })
            .map(|(key, hold)| service::RefusedLoop {
                key: key.clone(),
                reason: hold.message.clone(),
            })
            .collect();
        self.info.refused.sort_by(|a, b| a.key.cmp(&b.key));
        let text = match serde_json::to_string(&self.info) {
            Ok(text) if Some(&text) != self.published.as_ref() => text,
            _ => return,
        };
        self.shared.files.publish(self.info.clone());
        match service::publish(&self.runtime_dir, &self.info) {
            Ok(()) => self.published = Some(text),
            Err(e) => tracing::warn!("warning: cannot write the service's status: {e}"),
        }
    }
}

/// Raises the soft limit of open files to the hard one: each loop keeps a few files open (its
/// locks, its event log), per thread that writes its state.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!("warning: cannot raise the limit of open files ({soft}): {e}");
    }
}

/// The loop whose state file `path` names, if it names one (`{id}.json`).
fn loop_of(path: &Path) -> Option<&str> {
    let id = path.file_name()?.to_str()?.strip_suffix(".json")?;
    loopd_store::store::validate_id(id).ok()?;
    Some(id)
}
