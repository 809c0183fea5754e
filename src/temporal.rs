//! The commands of loops on Temporal (`--temporal HOST:PORT`, cargo feature `temporal`):
//! `worker`, and `create`, `status` and the changes (`pause`, `resume`, `stop`, `next`, `task
//! add`, `answer`, `set`) of a loop there.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use loopd_core::state::{ListedTask, LoopState};
use loopd_exec::guard::Guard;
use loopd_file_driver::create::{CreateArgs, Limits};
use loopd_file_driver::error::usage;
use loopd_file_driver::project::Project;
use loopd_project::config::Config;
use loopd_project::project_file::sha256_hex;
use loopd_temporal::change::Change;
use loopd_temporal::{GitSource, LoopInput, TemporalConfig, client, workspace};
use serde_json::json;

use crate::output::print_result;

/// `loopd worker`'s options, over the config's `[temporal]`.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// The task queue of loopd's workflows and activities [default: the config's, `loopd`]
    #[arg(long)]
    pub task_queue: Option<String>,
    /// This worker's name: its own task queue is TASK_QUEUE@NAME, where the actions of the
    /// loops whose work trees it keeps go first [default: the config's, else the host name]
    #[arg(long)]
    pub name: Option<String>,
    /// Where it keeps its clones and work trees, a directory no other worker uses
    /// [default: the config's, else ~/.cache/loopd/worker/NAME]
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// Actions it runs at once; the rest wait in Temporal's queue [default: the config's, 4]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_actions: Option<u32>,
    /// Serve its metrics (the Temporal SDK's and loopd's) for Prometheus at HOST:PORT,
    /// `GET /metrics` [default: the config's `metrics`, else none]
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics: Option<std::net::SocketAddr>,
}

/// How to reach Temporal, on the command line: over the config's `[temporal]`, which is over the
/// Temporal CLI's environment and profile.
#[derive(Debug, Default, clap::Args)]
#[command(
    next_help_heading = "Temporal connection (over the config's [temporal], the $TEMPORAL_* \
                                environment and the Temporal CLI's profile)"
)]
pub struct ConnectArgs {
    /// The Temporal namespace [default: the config's, else $TEMPORAL_NAMESPACE, else `default`]
    #[arg(long, global = true, value_name = "NAME")]
    pub namespace: Option<String>,
    /// The Temporal CLI's profile to read (in ~/.config/temporalio/temporal.toml or
    /// $TEMPORAL_CONFIG_FILE) [default: $TEMPORAL_PROFILE, else `default`]
    #[arg(long, global = true, value_name = "NAME")]
    pub profile: Option<String>,
    /// Connect with TLS [default: for an address that is not loopback, or with a CA, a client
    /// certificate, a server name or an API key]
    #[arg(long, global = true, overrides_with = "no_tls")]
    pub tls: bool,
    /// Connect in plaintext, whatever the address
    #[arg(long, global = true, overrides_with = "tls")]
    pub no_tls: bool,
    /// The PEM file of the CA that signed the server's certificate [default: the system's]
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_ca_path: Option<PathBuf>,
    /// The client's certificate (PEM), for a server that asks for one (mutual TLS)
    #[arg(long, global = true, value_name = "FILE", requires = "tls_key_path")]
    pub tls_cert_path: Option<PathBuf>,
    /// The client certificate's private key (PEM)
    #[arg(long, global = true, value_name = "FILE", requires = "tls_cert_path")]
    pub tls_key_path: Option<PathBuf>,
    /// The name the server's certificate carries, when it is not the address's host
    #[arg(long, global = true, value_name = "NAME")]
    pub tls_server_name: Option<String>,
    /// A file holding the API key (never shown) [default: the config's api_key_file, else
    /// $TEMPORAL_API_KEY, else the profile's]
    #[arg(long, global = true, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
}

/// The config's `[temporal]` under the command line's settings (`--temporal`'s address and
/// [`ConnectArgs`]), with what both leave empty resolved from the Temporal CLI's environment and
/// profile; a setting that cannot be used is the user's to fix (exit 2).
pub fn settings(
    config: &Config,
    address: Option<&str>,
    flags: &ConnectArgs,
) -> Result<TemporalConfig> {
    let mut settings = config.temporal.clone();
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    let over = |setting: &mut String, flag: Option<String>| {
        if let Some(flag) = flag {
            *setting = flag;
        }
    };
    over(&mut settings.address, address.map(str::to_owned));
    over(&mut settings.namespace, flags.namespace.clone());
    over(&mut settings.profile, flags.profile.clone());
    over(&mut settings.ca_cert, path(&flags.tls_ca_path));
    over(&mut settings.client_cert, path(&flags.tls_cert_path));
    over(&mut settings.client_key, path(&flags.tls_key_path));
    over(&mut settings.server_name, flags.tls_server_name.clone());
    over(&mut settings.api_key_file, path(&flags.api_key_file));
    if flags.tls || flags.no_tls {
        settings.tls = Some(flags.tls);
    }
    let endpoint = loopd_temporal::connection::Endpoint::resolve(&settings)
        .map_err(|e| usage(format!("{e:#}")))?;
    // No attempt this process runs reads its credentials.
    let named = ["TEMPORAL_CONFIG_FILE", "TEMPORAL_TLS_CLIENT_KEY_PATH"]
        .into_iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from);
    loopd_exec::sandbox::keep_secret(settings.secrets().chain(named));
    settings.tls = Some(endpoint.tls());
    settings.address = endpoint.address;
    settings.namespace = endpoint.namespace;
    Ok(settings)
}

/// A client of the service; a service that cannot be reached is the user's to fix (exit 2).
async fn connect(config: &TemporalConfig) -> Result<client::Client> {
    client::connect(config)
        .await
        .map_err(|e| usage(format!("{e:#}")))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// `loopd worker`: runs loops' workflows and their actions until SIGINT or SIGTERM, with a guard
/// that ends the executors of its attempts should it die (`loopd worker-guard`).
pub fn worker(settings: TemporalConfig, args: &WorkerArgs) -> Result<i32> {
    let config = TemporalConfig {
        task_queue: args.task_queue.clone().unwrap_or(settings.task_queue),
        ..settings
    };
    let name = match (&args.name, config.worker_name.as_str()) {
        (Some(name), _) => name.clone(),
        (None, "") => nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "worker".to_owned()),
        (None, name) => name.to_owned(),
    };
    // It names a task queue and a directory: the rule of loop ids serves.
    if !loopd_core::state::is_loop_id(&name) {
        return Err(usage(format!(
            "worker name {name:?}: up to 128 letters, digits, '.', '_' and '-', from a letter or digit"
        )));
    }
    let cache = match (&args.cache, config.cache_dir.as_str()) {
        (Some(dir), _) => dir.clone(),
        (None, "") => cache_home()
            .context("neither $XDG_CACHE_HOME nor $HOME is set: give the worker --cache DIR")?
            .join("loopd/worker")
            .join(&name),
        (None, dir) => PathBuf::from(dir),
    };
    let cache = std::sync::Arc::new(loopd_temporal::workspace::Cache::open(&cache)?);
    // An executor's child that escapes its session is reparented here, and ended with it.
    loopd_exec::procs::become_subreaper();
    let guard = std::env::current_exe()
        .and_then(|me| Guard::start(&me, &["worker-guard"]))
        .context("cannot start the guard of this worker's executors")?;
    let metrics = match (args.metrics, config.metrics.as_str()) {
        (Some(addr), _) => Some(addr),
        (None, "") => None,
        (None, addr) => Some(addr.parse::<std::net::SocketAddr>().map_err(|_| {
            usage(format!(
                "[temporal] metrics = {addr:?}: not an IP address and port"
            ))
        })?),
    };
    // Like the service's listener: this machine's only (a scraper elsewhere goes through a
    // proxy that asks who it is).
    if let Some(addr) = metrics.filter(|a| !a.ip().is_loopback()) {
        return Err(usage(format!(
            "--metrics {addr}: a loopback address only (127.0.0.1 or [::1])"
        )));
    }
    let mut setup = client::WorkerSetup {
        guard: Some(std::sync::Arc::new(guard)),
        name: name.clone(),
        cache: cache.clone(),
        max_actions: args.max_actions.unwrap_or(config.max_actions) as usize,
        tree_grace: std::time::Duration::from_secs_f64(config.tree_grace),
        metrics: None,
        ready: None,
    };
    // As `serve` does under systemd (`Type=notify`): ready once connected, a watchdog from the
    // runtime's tick, stopping at the signal.
    let notifier = std::sync::Arc::new(loopd_serve::systemd::Notifier::from_env());
    let told = notifier.clone();
    let status = format!(
        "worker {name} on {}, task queue {}",
        config.address, config.task_queue
    );
    let (is_ready, ready) = tokio::sync::oneshot::channel();
    setup.ready = Some(Box::new(move || {
        told.ready();
        told.status(&status);
        let _ = is_ready.send(());
    }));
    let exit = runtime()?.block_on(async {
        if let Some(addr) = metrics {
            let exporter = loopd_temporal::metrics::Exporter::bind(addr)
                .await
                .map_err(|e| usage(format!("{e:#}")))?;
            tracing::info!("metrics at http://{}/metrics", exporter.local_addr()?);
            setup.metrics = Some(exporter);
        }
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("a SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("signal: the worker stops");
            notifier.stopping();
        };
        let watchdog = async {
            match notifier.watchdog {
                Some(every) if ready.await.is_ok() => {
                    let mut tick = tokio::time::interval(every / 2);
                    loop {
                        tick.tick().await;
                        notifier.watchdog();
                    }
                }
                _ => std::future::pending().await,
            }
        };
        tracing::info!(
            "worker {name} on {}{} (namespace {}, task queues {q} and {q}@{name}, {} actions at \
             once, cache {})",
            config.address,
            if config.tls == Some(true) {
                " with TLS"
            } else {
                ""
            },
            config.namespace,
            setup.max_actions,
            cache.dir().display(),
            q = config.task_queue,
        );
        tokio::select! {
            ran = client::run_worker(&config, setup, shutdown) => ran,
            () = watchdog => unreachable!("the watchdog ticks for ever"),
        }
    });
    notifier.stopping();
    notifier.flush(std::time::Duration::from_secs(2));
    exit?;
    Ok(0)
}

/// `$XDG_CACHE_HOME`, else `~/.cache`.
fn cache_home() -> Option<PathBuf> {
    let absolute = |var| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    absolute("XDG_CACHE_HOME").or_else(|| absolute("HOME").map(|h| h.join(".cache")))
}

/// `loopd worker-guard`: the guard of a worker's executors, over the pipe on its stdin
/// ([`loopd_exec::guard`]).
pub fn guard() -> Result<i32> {
    let left = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(loopd_exec::guard::watch(tokio::io::BufReader::new(
            tokio::io::stdin(),
        )));
    if left > 0 {
        tracing::warn!("the worker is gone: ended {left} processes of its attempts");
    }
    Ok(0)
}

/// What `loopd serve` serves of Temporal: its loops where `--temporal` or the config's
/// `[temporal] enabled` says so.
pub fn driver(
    address: Option<&str>,
    connect: &ConnectArgs,
    config: Option<&Path>,
) -> Result<Option<std::sync::Arc<dyn loopd_core::driver::Driver>>> {
    let service = Config::load_service(config)?;
    if address.is_none() && !service.temporal.enabled {
        return Ok(None);
    }
    let config = settings(&service, address, connect)?;
    tracing::info!("serving the loops on Temporal at {} too", config.address);
    Ok(Some(std::sync::Arc::new(
        loopd_temporal::front::Fleet::new(config),
    )))
}

/// `loopd create --temporal`: the loop's state made as `create` makes it, started as a workflow.
pub fn create(p: &Project, config: &TemporalConfig, args: &CreateArgs, json: bool) -> Result<i32> {
    if args.worktree {
        return Err(usage(
            "--worktree is for loops in the file store; a loop on Temporal runs in its root",
        ));
    }
    refuse_parallel(&args.limits, args.remote.is_some())?;
    check_race(p, &args.race, args.remote.is_some())?;
    let id = loopd_store::store::new_id();
    let state = loopd_file_driver::create::new_state(p, args, &id, None)?;
    let git = match &args.remote {
        Some(remote) => Some(git_source(p, &state, remote, args.base.as_deref())?),
        None => None,
    };
    let tasks = args
        .tasks
        .iter()
        .enumerate()
        .map(|(i, text)| ListedTask {
            id: loopd_core::state::task_id(i as u64 + 1),
            description: text.clone(),
            // loopd's tasks say what they need: these, nothing.
            after: Some(Vec::new()),
            ..ListedTask::default()
        })
        .collect();
    let input = LoopInput {
        root: p.root.clone(),
        git: git.clone(),
        head: None,
        holder: None,
        state,
        tasks,
        executor: None,
        // Each try of a race travels through the remote.
        race: match git {
            Some(_) => p.config.race.clone(),
            None => Vec::new(),
        },
        limits: p.config.limits(),
        retry: p.config.retry_policy(),
        history_limit: config.history_limit,
    };
    runtime()?.block_on(async {
        let client = connect(config).await?;
        if let Some(git) = &git {
            workspace::publish(&p.root, &git.remote, &id, &git.base)
                .await
                .map_err(|e| usage(format!("{e:#}")))?;
        }
        client::start(&client, config, input).await
    })?;
    print_result(
        json,
        &json!({ "loop_id": id, "temporal": config.address }),
        &id,
    )?;
    Ok(0)
}

/// A loop's git remote: the commit it starts from, and the project's files as they are trusted
/// here (a worker runs them only as they are now).
fn git_source(
    p: &Project,
    state: &LoopState,
    remote: &str,
    base: Option<&str>,
) -> Result<GitSource> {
    if remote.is_empty() || remote.starts_with('-') {
        return Err(usage(format!("--remote {remote:?}: not a git remote")));
    }
    if has_password(remote) {
        return Err(usage(
            "--remote: a URL with a password would be kept in the loop's history; give git the \
             credential (a credential helper, an SSH key) and the URL without it",
        ));
    }
    let base = runtime()?
        .block_on(workspace::resolve(&p.root, base.unwrap_or("HEAD")))
        .map_err(|e| usage(format!("--base: {e:#}")))?;
    let wf = loopd_core::workflow::of(state);
    let plans = loopd_project::plan::Plans::load(&p.root, &p.config, wf, None)?;
    let files = plans.project_files(&p.config);
    loopd_project::trust::check(&p.root, &files)?;
    let trusted: std::collections::BTreeMap<PathBuf, String> = files
        .iter()
        .map(|f| {
            let path = f.path.strip_prefix(&p.root).unwrap_or(&f.path);
            (path.to_owned(), f.digest.clone())
        })
        .collect();
    // The workers take them from the base commit: they must be there as they are here.
    for (path, digest) in &trusted {
        let at_base = runtime()?.block_on(workspace::file_at(&p.root, &base, path));
        let same = at_base.is_ok_and(|bytes| sha256_hex(&bytes) == *digest);
        if !same {
            return Err(usage(format!(
                "{} is not in the base commit {} as it is here: commit it (the workers take \
                 the project's files from there), or give --base",
                path.display(),
                &base[..base.len().min(12)]
            )));
        }
    }
    Ok(GitSource {
        remote: remote.to_owned(),
        base,
        trusted,
    })
}

/// Whether a remote's URL carries a password (`https://user:secret@host/...`).
fn has_password(remote: &str) -> bool {
    let Some((_, rest)) = remote.split_once("://") else {
        return false;
    };
    let authority = rest.split('/').next().unwrap_or_default();
    authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
}

/// `loopd status --temporal`: the loop's state as its workflow holds it, and the attempts it runs
/// now as their last heartbeats told (with `--json`, `heartbeats` beside the state's keys, each
/// its action, iteration, attempt, task, lane and the last of its output; `heartbeat` the first).
pub fn status(config: &TemporalConfig, id: &str, json: bool) -> Result<i32> {
    let (state, still, holder, progress) = runtime()?.block_on(async {
        let client = connect(config).await?;
        let (_, state, still) = client::seen(&client, config, id)
            .await?
            .ok_or_else(|| usage(format!("no loop {id} on Temporal")))?;
        // Without a worker nothing more can be asked: no workflow answers.
        if still.is_some() {
            return anyhow::Ok((state, still, None, Vec::new()));
        }
        let holder = client::holder(&client, id).await?;
        // Best effort: the state is what was asked for. A loop that no longer runs has no
        // attempt in flight, whatever its last heartbeat said.
        let progress = match state.status {
            loopd_core::state::Status::Running => {
                client::progress(&client, id).await.unwrap_or_default()
            }
            _ => Vec::new(),
        };
        anyhow::Ok((state, None, holder, progress))
    })?;
    let worker = holder.map(|h| h.name);
    let mut value = serde_json::to_value(&state)?;
    value["heartbeat"] = serde_json::to_value(progress.first())?;
    value["heartbeats"] = serde_json::to_value(&progress)?;
    value["worker"] = serde_json::to_value(&worker)?;
    let still = still.or_else(|| state.still());
    value["status_reason"] = serde_json::json!(still.as_ref().map(|w| &w.reason));
    value["next_step"] = serde_json::json!(still.as_ref().map(|w| &w.next));
    let mut text = format!(
        "loop {id}: {} (iteration {})",
        state.standing(),
        state.current_iteration
    );
    if let Some(worker) = &worker {
        text.push_str(&format!(", its work tree on worker {worker}"));
    }
    if let Some(still) = &still {
        text.push_str(&format!(
            "
  why   {}
  next  {}",
            still.reason, still.next
        ));
    }
    for p in &progress {
        let output = match p.output.trim_end() {
            "" => "(none yet)",
            output => output,
        };
        let spent = match (p.tokens, p.cost_usd) {
            (0, None) => String::new(),
            (tokens, None) => format!(", {tokens} tokens so far"),
            (tokens, Some(usd)) => format!(", {tokens} tokens and ${usd:.2} so far"),
        };
        let task = match (&p.task_id, p.lane) {
            (Some(task), Some(lane)) => format!(" of {task} in lane {lane}"),
            (Some(task), None) => format!(" of {task}"),
            _ => String::new(),
        };
        text.push_str(&format!(
            "\nrunning {}{task} (iteration {}, attempt {}{spent}); its last output:\n{output}",
            p.action, p.iteration, p.attempt,
        ));
    }
    print_result(json, &value, &text)?;
    Ok(0)
}

/// `loopd list --temporal`: the project's loops on Temporal (every project's with `all`), as the
/// visibility store knows them, each with why it stands still (with `--json`, `status_reason`
/// and `next_step`, as `status --json` has them).
pub fn list(config: &TemporalConfig, root: Option<&Path>, json: bool) -> Result<i32> {
    let seen = runtime()?.block_on(async {
        let client = connect(config).await?;
        client::seen_all(&client, config, root, client::LIST_WAIT).await
    })?;
    let mut shown = Vec::new();
    for (listed, _, still) in &seen {
        let mut value = serde_json::to_value(listed)?;
        value["status_reason"] = json!(still.as_ref().map(|w| &w.reason));
        value["next_step"] = json!(still.as_ref().map(|w| &w.next));
        shown.push(value);
    }
    let mut text = format!(
        "{:<34} {:<10} {:>4}  {:<12} {:<12} PROJECT",
        "ID", "STATUS", "ITER", "WORKFLOW", "WORKER"
    );
    for (l, ..) in &seen {
        let worker = match l.worker.as_str() {
            "" => "-",
            worker => worker,
        };
        text.push_str(&format!(
            "\n{:<34} {:<10} {:>4}  {:<12} {:<12} {}",
            l.loop_id, l.status, l.iteration, l.workflow, worker, l.project
        ));
    }
    print_result(json, &serde_json::Value::Array(shown), &text)?;
    Ok(0)
}

/// `loopd logs --temporal ID [--follow]`: the loop's events, read from its workflow's history;
/// with `follow`, new ones as they come (looked for every [`FOLLOW_EVERY`]) until the loop ends.
pub fn logs(
    config: &TemporalConfig,
    id: &str,
    clock: loopd_store::events::Clock,
    follow: bool,
    json: bool,
) -> Result<i32> {
    runtime()?.block_on(async {
        let client = connect(config).await?;
        let mut shown = 0;
        loop {
            let events = client::events(&client, id)
                .await
                .map_err(|e| usage(format!("{e:#}")))?;
            for event in events.iter().skip(shown) {
                let line = match json {
                    true => event.to_string(),
                    false => loopd_store::events::render(event, clock),
                };
                crate::outln!("{line}")?;
            }
            shown = events.len().max(shown);
            let ended = events.last().is_some_and(|e| e["event"] == "loop_ended");
            if !follow || ended {
                return Ok(0);
            }
            tokio::time::sleep(FOLLOW_EVERY).await;
        }
    })
}

/// How often `logs --follow` looks for new events of a loop on Temporal.
const FOLLOW_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// `loopd pause|resume|stop|next|task add|answer|set --temporal`: the change made by the loop's
/// workflow (by the rules the file driver follows), refused in one line (exit 2) where it makes
/// no sense.
pub fn change(config: &TemporalConfig, id: &str, change: Change, json: bool) -> Result<i32> {
    let said = runtime()?.block_on(async {
        let client = connect(config).await?;
        client::change(&client, config, id, &change, &loopd_store::now_rfc3339())
            .await
            .map_err(|e| usage(format!("{e:#}")))
    })?;
    let text = match &change {
        Change::Control(_) => {
            let (from, to) = (&said["from"], &said["status"]);
            match said["changed"].as_bool() {
                Some(true) => format!("loop {id}: {} → {}", plain(from), plain(to)),
                _ => format!("loop {id} is already {}", plain(to)),
            }
        }
        Change::Next(action) => format!("loop {id}: next action {action}"),
        Change::Task(_) => plain(&said["task_id"]),
        Change::Answer(_) => format!("loop {id}: answered {}'s question", plain(&said["action"])),
        Change::Set(_) => format!("loop {id}: {}", said["set"]),
    };
    print_result(json, &said, &text)?;
    Ok(0)
}

/// The new limits `loopd set` gives, checked as for a loop in the file store.
pub fn set_limits(limits: &Limits) -> Result<Change> {
    limits.check()?;
    Ok(Change::Set((*limits).into()))
}

/// `parallel` over 1 on Temporal is for a loop on a git remote (`--remote`), whose tasks' work
/// trees travel through it.
fn refuse_parallel(limits: &Limits, remote: bool) -> Result<()> {
    match limits.parallel {
        Some(n) if n > 1 && !remote => Err(usage(format!(
            "--parallel {n} on Temporal needs --remote: each task developed at once travels \
             through the loop's git remote"
        ))),
        _ => Ok(()),
    }
}

/// Refuses a race the loop's workers could not run: executors this project does not configure
/// (as on this machine), or a loop without a git remote (each executor's try travels through
/// it).
pub fn check_race(p: &Project, race: &[String], remote: bool) -> Result<()> {
    loopd_file_driver::worktree::check_race_names(p, race)?;
    match race.is_empty() || remote {
        true => Ok(()),
        false => Err(usage(
            "--race on Temporal needs --remote: each executor's try travels through the loop's \
             git remote",
        )),
    }
}

/// A JSON string as it reads, without its quotes.
fn plain(value: &serde_json::Value) -> String {
    value
        .as_str()
        .map_or_else(|| value.to_string(), str::to_owned)
}
