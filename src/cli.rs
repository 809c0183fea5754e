//! The command line (CONTRACT §7): clap definitions and the small commands.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use loopd_core::state::Status;
use serde_json::{Value, json};

use crate::output::print_result;
use loopd_file_driver::control::{Control, choose_next, set_control};
use loopd_file_driver::error::usage;
use loopd_file_driver::project::Project;
use loopd_file_driver::view::{self, LoopView};
use loopd_store::events::{self, name, printable, render};
use loopd_store::store::{StoreError, validate_id};

#[derive(Debug, Parser)]
#[command(
    name = "loopd",
    version,
    about = "Drives autonomous coding-agent loops (CCW-compatible) as a daemon",
    long_about = "Drives autonomous coding-agent loops (CCW-compatible) as a daemon.\n\n\
        A loop lives in <root>/.loop/<id>.json. loopd checks termination, picks the next action \
        (init, develop, debug, validate, complete), runs it as an executor subprocess, applies its \
        result and repeats, until the goal is met or a limit stops it. Pause, resume and stop \
        written by anyone to the state file take effect at once.\n\n\
        Exit codes, for every command: 0 done, 1 internal error, 2 bad input or a refusal \
        (usage, config, an unknown or unusable loop, untrusted project files, programs that \
        are not installed), and for doctor 1 when not ready. run (and a detached daemon) also: \
        3 iteration limit, 4 failed, 5 stopped by a user, 6 paused (--exit-on-pause), \
        130/143 ended by SIGINT/SIGTERM with the loop left running."
)]
pub struct Cli {
    /// The project root [default: $LOOPD_ROOT, else the git top level, else the current
    /// directory]; `serve` takes it more than once
    #[arg(long, global = true, value_name = "DIR")]
    pub root: Vec<PathBuf>,
    /// A config file layered over the others [default: $LOOPD_CONFIG]
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the result as JSON on stdout (one value; `logs` one event per line), for scripts
    #[arg(long, global = true)]
    pub json: bool,
    /// The loop is on Temporal, at HOST:PORT (create, status, list, logs, pause, resume, stop,
    /// next, answer, set, task add; serve shows them too; worker) [default: the config's `[temporal]`, when enabled]
    #[cfg(feature = "temporal")]
    #[arg(long, global = true, value_name = "HOST:PORT", env = "LOOPD_TEMPORAL")]
    pub temporal: Option<String>,
    #[cfg(feature = "temporal")]
    #[command(flatten)]
    pub connect: crate::temporal::ConnectArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the service that drives every loop of your projects: those `create` and `start`
    /// recorded (`loopd projects`), and each `--root DIR` (see docs/service.md)
    Serve(loopd_serve::ServeArgs),
    /// Write a new loop (status `created`) and print its id
    Create(Box<loopd_file_driver::create::CreateArgs>),
    /// Serve loopd's MCP server on stdin and stdout, for an agent that drives loops (see
    /// docs/mcp.md)
    Mcp,
    /// Run loops on Temporal: their workflows, and their actions as this machine's processes
    #[cfg(feature = "temporal")]
    Worker(crate::temporal::WorkerArgs),
    /// A worker's guard: ends its attempts' executors when the worker is gone (used by `worker`)
    #[cfg(feature = "temporal")]
    #[command(hide = true)]
    WorkerGuard,
    /// Drive a loop in the foreground until it ends
    Run {
        id: String,
        /// Make every action use this executor
        #[arg(long, value_name = "NAME")]
        executor: Option<String>,
        /// Exit with code 6 when the loop is paused, instead of waiting
        #[arg(long)]
        exit_on_pause: bool,
    },
    /// Drive a loop in the background; print the daemon's pid
    Start {
        id: String,
        /// Make every action use this executor
        #[arg(long, value_name = "NAME")]
        executor: Option<String>,
    },
    /// Pause a loop: the action in flight is interrupted now
    Pause { id: String },
    /// Resume a paused or stopped loop; starts a daemon if none drives it
    Resume { id: String },
    /// Stop a loop (status `failed`, "Manually stopped by user")
    Stop { id: String },
    /// Choose the next action of a loop waiting in interactive mode
    Next { id: String, action: String },
    /// Answer the question a loop's executor asked; the loop goes on with the answer
    Answer {
        id: String,
        /// The answer, for the agent that asked
        text: String,
    },
    /// Run a failed or stopped loop again: its error count reset, its failed tasks pending
    Retry { id: String },
    /// Change a loop's limits and budgets (a running daemon takes them at its next step)
    Set {
        id: String,
        #[command(flatten)]
        limits: loopd_file_driver::create::Limits,
    },
    /// Add to a loop's tasks
    #[command(subcommand)]
    Task(TaskCommand),
    /// Show one loop (with --json: its state file)
    Status { id: String },
    /// List every loop of the project
    List {
        /// Every loop of every project: yours, and those a running service serves
        #[arg(long)]
        all: bool,
    },
    /// Show a loop's events
    Logs {
        id: String,
        /// Keep printing new events, and the output of the action in flight, until the loop ends
        /// (waiting for a loop that has not started yet)
        #[arg(long, short)]
        follow: bool,
        /// With --follow, events only: not the output of the action in flight
        #[arg(long)]
        events_only: bool,
        /// Times in UTC, not the local time
        #[arg(long)]
        utc: bool,
    },
    /// List a loop's git checkpoints (one after each action that changes the work tree), oldest
    /// first, with what each changed
    Checkpoints { id: String },
    /// Show what an action changed in the work tree (CHECKPOINT, as `checkpoints` names it), or
    /// what the loop changed as a whole
    Diff {
        id: String,
        /// A checkpoint's name, as `loopd checkpoints` lists it (such as 3-develop)
        checkpoint: Option<String>,
    },
    /// Put the work tree back as it was at a checkpoint of the loop (its state dir and ignored
    /// files are left alone); refused while the loop runs, and when the work tree has changes no
    /// checkpoint holds, unless --force
    Rollback {
        id: String,
        /// A checkpoint's name, as `loopd checkpoints` lists it (such as 3-develop, or 0-start)
        checkpoint: String,
        /// Roll back even if changes no checkpoint holds are lost
        #[arg(long)]
        force: bool,
    },
    /// Show which agent CLIs are installed, whether the config and action files load, and what a
    /// loop would run for each action; exit 1 if an executor the actions use is missing
    Doctor {
        /// As `run --executor NAME` would
        #[arg(long, value_name = "NAME")]
        executor: Option<String>,
    },
    /// Write .loop/config.toml for a first loop without an agent: every action a shell command
    Init(crate::init::InitArgs),
    /// Let this project's .loop/config.toml and action files set what loopd runs
    ///
    /// A project's own config and action files can set any command, and they arrive with a cloned
    /// repository: `run`, `start` and `resume` refuse them until they are trusted. This records a
    /// SHA-256 digest of each in the user's config dir (~/.config/loopd/trusted/); a file changed
    /// afterwards must be trusted again.
    Trust {
        /// Forget the trust given to this project
        #[arg(long)]
        revoke: bool,
    },
    /// List the projects whose loops you created or started (recorded in
    /// $XDG_STATE_HOME/loopd/projects/), with their loops
    Projects {
        /// Forget this project (its loops stay where they are)
        #[arg(long, value_name = "DIR")]
        remove: Option<PathBuf>,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    ///
    /// For bash: `loopd completions bash > ~/.local/share/bash-completion/completions/loopd`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff): `loopd man | man -l -`
    Man,
    /// Run a complete example loop in a temporary project
    Demo {
        /// The workflow to show: ccw-loop (a calculator fixed) or skill-tuning (a skill tuned)
        #[arg(long, value_name = "NAME")]
        workflow: Option<String>,
    },
    /// The demo's scripted executor (used by `demo`)
    #[command(hide = true)]
    DemoAgent {
        #[arg(long)]
        workflow: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum TaskCommand {
    /// Append a develop task; prints its id
    Add {
        id: String,
        /// What the task is, for the agent that will do it
        text: String,
        /// A task this one needs done first (repeat for several); without it, the task may be
        /// developed at once with the others when the loop has `parallel` over 1
        #[arg(long, value_name = "TASK_ID")]
        after: Vec<String>,
        /// An executor that tries the task (repeat: at least two), each in a git work tree of its
        /// own; the check (validate on each tree) keeps the best, the others stay as checkpoints
        #[arg(long, value_name = "EXECUTOR")]
        race: Vec<String>,
    },
}

/// Runs a parsed command line; returns the exit code.
pub fn run(cli: Cli) -> Result<i32> {
    let Cli {
        root: roots,
        config,
        json,
        command,
        #[cfg(feature = "temporal")]
        temporal,
        #[cfg(feature = "temporal")]
        connect,
    } = cli;
    #[cfg(feature = "temporal")]
    if let Some(exit) = on_temporal(
        temporal.as_deref(),
        &connect,
        &command,
        json,
        &roots,
        config.as_deref(),
    )? {
        return Ok(exit);
    }
    let root = match (&command, roots.as_slice()) {
        (Command::Serve(_), _) | (_, []) => None,
        (_, [root]) => Some(root.clone()),
        _ => return Err(usage("--root is given once, except to serve")),
    };
    let project = || Project::open(root.as_deref(), config.as_deref());
    // Commands that run nothing work on a config that does not load: they need no executor.
    let inspect = || Project::open_for_inspection(root.as_deref(), config.as_deref());
    // What a front (the service, the MCP server) serves beside the file store's loops: those of
    // the other drivers the build has, where the configuration names them.
    let others = || -> Result<Vec<std::sync::Arc<dyn loopd_core::driver::Driver>>> {
        #[cfg(feature = "temporal")]
        return Ok(Vec::from_iter(crate::temporal::driver(
            temporal.as_deref(),
            &connect,
            config.as_deref(),
        )?));
        #[cfg(not(feature = "temporal"))]
        Ok(Vec::new())
    };
    match command {
        Command::Serve(_) if json => Err(usage("--json: serve prints a log, not a result")),
        Command::Serve(args) => loopd_serve::run(&roots, config.as_deref(), &args, others()?),
        Command::Mcp if json => Err(usage("--json: mcp speaks JSON-RPC on stdout already")),
        Command::Mcp => crate::mcp::stdio(root.as_deref(), config.as_deref(), others()?),
        #[cfg(feature = "temporal")]
        Command::Worker(_) | Command::WorkerGuard => unreachable!("run by on_temporal"),
        Command::Create(args) => {
            let p = project()?;
            let id = loopd_file_driver::create::create_loop(&p, &args)?;
            loopd_file_driver::registry::note(&p.root);
            print_result(json, &json!({ "loop_id": id }), &id)?;
            Ok(0)
        }
        Command::Run {
            id,
            executor,
            exit_on_pause,
        } => {
            let p = project()?;
            let code = loopd_file_driver::daemon::run_foreground(&p, &id, executor, exit_on_pause)?;
            if json {
                let state = p.load(&id)?;
                let outcome = state.skill_state.as_ref().and_then(|s| s.outcome.clone());
                crate::outln!(
                    "{}",
                    json!({
                        "loop_id": id,
                        "status": state.status.as_str(),
                        "outcome": outcome,
                        "failure_reason": state.failure_reason,
                        "exit_code": code,
                    })
                )?;
            }
            Ok(code)
        }
        Command::Start { id, executor } => {
            let p = project()?;
            let pid = loopd_file_driver::daemon::start(&p, &id, executor.as_deref())?;
            loopd_file_driver::registry::note(&p.root);
            print_result(
                json,
                &json!({ "loop_id": id, "pid": pid }),
                &pid.to_string(),
            )?;
            Ok(0)
        }
        Command::Pause { id } => control(&inspect()?, &id, Control::Pause, json),
        Command::Resume { id } => control(&project()?, &id, Control::Resume, json),
        Command::Stop { id } => control(&inspect()?, &id, Control::Stop, json),
        Command::Next { id, action } => next(&project()?, &id, &action, json),
        Command::Retry { id } => crate::recovery::retry(&project()?, &id, json),
        Command::Answer { id, text } => crate::recovery::answer(&inspect()?, &id, &text, json),
        Command::Set { id, limits } => crate::recovery::set(&project()?, &id, &limits, json),
        Command::Task(TaskCommand::Add {
            id,
            text,
            after,
            race,
        }) => crate::recovery::task_add(&project()?, &id, &text, &after, &race, json),
        Command::Status { id } => status(&inspect()?, &id, json),
        Command::Checkpoints { id } => crate::checkpoint::list_command(&inspect()?, &id, json),
        Command::Diff { id, checkpoint } => {
            crate::checkpoint::diff_command(&inspect()?, &id, checkpoint.as_deref())
        }
        Command::Rollback {
            id,
            checkpoint,
            force,
        } => crate::checkpoint::rollback_command(&inspect()?, &id, &checkpoint, force, json),
        Command::List { all } => list(&inspect()?, all, json),
        Command::Logs {
            id,
            follow,
            events_only,
            utc,
        } => {
            let clock = if utc {
                events::Clock::Utc
            } else {
                events::Clock::Local
            };
            let shown = LogsShown {
                follow,
                as_json: json,
                output: follow && !events_only && !json,
                clock,
            };
            logs(&inspect()?, &id, &shown)
        }
        Command::Projects { remove } => projects(remove.as_deref(), json),
        Command::Doctor { executor } => crate::doctor::run(&project()?, executor, json),
        Command::Trust { revoke } => trust(&project()?, revoke, json),
        Command::Init(args) => crate::init::run(&inspect()?, &args, json),
        Command::Completions { .. } | Command::Man | Command::Demo { .. } if json => Err(usage(
            "--json: completions, man and demo print text for people, not a result",
        )),
        Command::Completions { shell } => {
            // Made whole first: clap_complete panics on a write error, such as a closed pipe.
            let mut cmd = <Cli as clap::CommandFactory>::command();
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "loopd", &mut script);
            crate::out!("{}", String::from_utf8_lossy(&script))?;
            Ok(0)
        }
        Command::Man => {
            let cmd = <Cli as clap::CommandFactory>::command();
            clap_mangen::Man::new(cmd).render(&mut std::io::stdout())?;
            Ok(0)
        }
        Command::Demo { workflow } => crate::demo::run(workflow.as_deref()),
        Command::DemoAgent { workflow } => crate::demo::agent(workflow.as_deref()),
    }
}

/// `loopd projects`: the recorded projects and their loops, or `--remove DIR`.
fn projects(remove: Option<&Path>, as_json: bool) -> Result<i32> {
    if let Some(dir) = remove {
        let root = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
        let had =
            loopd_file_driver::registry::remove(&root).context("cannot forget the project")?;
        if !had {
            return Err(usage(format!(
                "{} is not among your projects",
                root.display()
            )));
        }
        let text = format!("forgot {}", root.display());
        print_result(as_json, &json!({ "root": root, "removed": true }), &text)?;
        return Ok(0);
    }
    let mut rows = Vec::new();
    for record in loopd_file_driver::registry::list().context("cannot read your projects")? {
        // Each project's own state dir, as its config says (or the default, if it does not load).
        let loops = Project::open_for_inspection(Some(&record.root), None)
            .ok()
            .and_then(|p| {
                let ids = p.store.list_ids().ok()?;
                let running = ids
                    .iter()
                    .filter(|id| loopd_file_driver::locks::daemon_pid(&p.store, id).is_some())
                    .count();
                Some((ids.len(), running))
            });
        rows.push(json!({
            "root": record.root,
            "added_at": record.added_at,
            "loops": loops.map(|l| l.0),
            "driven": loops.map(|l| l.1),
        }));
    }
    if as_json {
        crate::outln!("{}", serde_json::to_string_pretty(&rows)?)?;
        return Ok(0);
    }
    if rows.is_empty() {
        eprintln!("no projects yet: `loopd create` records a project's root");
        return Ok(0);
    }
    crate::outln!("{:<7} {:<7} ROOT", "LOOPS", "DRIVEN")?;
    for row in &rows {
        let count = |k: &str| row[k].as_u64().map_or("?".to_owned(), |n| n.to_string());
        let root = row["root"].as_str().unwrap_or_default();
        crate::outln!(
            "{:<7} {:<7} {}",
            count("loops"),
            count("driven"),
            printable(root)
        )?;
    }
    Ok(0)
}

/// `loopd trust`: records the project's files as trusted, or forgets them.
fn trust(p: &Project, revoke: bool, as_json: bool) -> Result<i32> {
    let root = p.root.display();
    if revoke {
        let had =
            loopd_project::trust::revoke(&p.root).context("cannot remove the trust record")?;
        let text = if had {
            format!("no longer trusted: {root}")
        } else {
            format!("{root} was not trusted")
        };
        let value = json!({ "root": p.root, "revoked": had });
        print_result(as_json, &value, &text)?;
        return Ok(0);
    }
    let files = loopd_project::trust::project_files(&p.root)?;
    let text = if files.is_empty() {
        format!(
            "nothing to trust in {root}: no .loop/config.toml and no action files; the built-in \
             and your own config need no trust"
        )
    } else {
        loopd_project::trust::allow(&p.root, &files).context("cannot write the trust record")?;
        let lines: Vec<String> = files
            .iter()
            .map(|f| format!("trusted {}", f.path.display()))
            .collect();
        lines.join("\n")
    };
    let trusted: Vec<&Path> = files.iter().map(|f| f.path.as_path()).collect();
    print_result(
        as_json,
        &json!({ "root": p.root, "trusted": trusted }),
        &text,
    )?;
    Ok(0)
}

/// pause / resume / stop: write the status the way the CCW dashboard API does.
fn control(p: &Project, id: &str, what: Control, as_json: bool) -> Result<i32> {
    let done = match set_control(p, id, what, &format!("loopd {}", what.verb())) {
        Ok(done) => done,
        Err(e) if matches!(what, Control::Stop) && p.load(id).is_err() => {
            return stop_unloadable(p, id, e, as_json);
        }
        Err(e) => return Err(e),
    };
    let report = |pid: Option<u32>| {
        let value = json!({
            "loop_id": id, "from": done.from.as_str(), "status": done.to.as_str(), "pid": pid
        });
        print_result(
            as_json,
            &value,
            &pid.map(|p| p.to_string()).unwrap_or_default(),
        )
    };
    if !done.changed {
        eprintln!("loop {id} is already {}", done.to);
        report(None)?;
        return Ok(0);
    }
    eprintln!("loop {id}: {} → {}", done.from, done.to);
    // The pid of what drives the resumed loop: a daemon started now, or a service that took it
    // as soon as the status changed.
    let mut started = None;
    if let Some(executor) = &done.needs_daemon {
        started = Some(match loopd_file_driver::locks::daemon_pid(&p.store, id) {
            Some(pid) => pid,
            None => match loopd_file_driver::daemon::start(p, id, executor.as_deref()) {
                Ok(pid) => {
                    eprintln!("started daemon pid {pid}");
                    pid
                }
                // The service took the loop up as soon as it read the new status (or another
                // command's daemon did): the resume did what it was for.
                Err(e) => loopd_file_driver::locks::daemon_pid(&p.store, id).ok_or(e)?,
            },
        });
    }
    report(started)?;
    Ok(0)
}

/// `stop` on a loop whose state file does not load: restored from its backup (or rebuilt) it is
/// stopped as usual; else its daemon, if one drives it, is told to end (SIGTERM: the attempt in
/// flight is ended and recorded). A stop never depends on the state being loadable.
fn stop_unloadable(p: &Project, id: &str, error: anyhow::Error, as_json: bool) -> Result<i32> {
    let corrupt = error
        .downcast_ref::<StoreError>()
        .is_some_and(|e| matches!(e, StoreError::Corrupt { .. }));
    if !corrupt {
        return Err(error);
    }
    if let Ok(Some((reason, from))) = p.store.restore(id) {
        eprintln!("loop {id}: the state file was unusable ({reason}); restored from {from}");
        return control(p, id, Control::Stop, as_json);
    }
    let Some(pid) = loopd_file_driver::locks::daemon_pid(&p.store, id).filter(|pid| *pid > 1)
    else {
        return Err(error);
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .with_context(|| format!("cannot signal the daemon of {id} (pid {pid})"))?;
    eprintln!(
        "loop {id}: the state file cannot be read ({error:#}); its daemon (pid {pid}) was told to end; repair or remove the file"
    );
    let value = json!({ "loop_id": id, "from": null, "status": null, "signalled_pid": pid });
    print_result(as_json, &value, "")?;
    Ok(0)
}

fn next(p: &Project, id: &str, action: &str, as_json: bool) -> Result<i32> {
    let value = choose_next(p, id, action)?;
    eprintln!("loop {id}: next action {action}");
    print_result(as_json, &value, "")?;
    Ok(0)
}

fn status(p: &Project, id: &str, as_json: bool) -> Result<i32> {
    validate_id(id)?;
    let loaded = p.store.load(id)?;
    let service = loopd_file_driver::service::running();
    let view = LoopView::of(p, &loaded.state, service.as_ref());
    if as_json {
        let shown = with_still(loaded.raw, &view);
        crate::outln!("{}", serde_json::to_string_pretty(&shown)?)?;
        return Ok(0);
    }
    // Values come from the state file and executors: shown with their control characters escaped.
    let mut out = format!("{}  {}\n", view.loop_id, printable(&view.title));
    for row in &view.rows {
        out.push_str(&format!("  {:<10} {}\n", row.label, printable(&row.value)));
        for line in &row.lines {
            out.push_str(&format!("             {}\n", printable(line)));
        }
    }
    crate::out!("{out}")?;
    Ok(0)
}

/// A loop's state file as `--json` prints it, with why it stands still and what moves it on
/// (`status_reason`, `next_step`: null while it moves), which the file does not hold.
fn with_still(mut raw: serde_json::Map<String, Value>, view: &LoopView) -> Value {
    raw.insert("status_reason".into(), json!(view.status_reason));
    raw.insert("next_step".into(), json!(view.next_step));
    Value::Object(raw)
}

/// `list`: the project's loops, or with `all` every loop of every project (yours, and those
/// a running service serves), with a PROJECT column; under the table, what each project's
/// loops spent today and overall.
fn list(p: &Project, all: bool, as_json: bool) -> Result<i32> {
    let service = loopd_file_driver::service::running();
    let roots = if all {
        let mut roots: Vec<PathBuf> = loopd_file_driver::registry::list()
            .context("cannot read your projects")?
            .into_iter()
            .map(|r| r.root)
            .collect();
        roots.extend(service.iter().flat_map(|s| s.roots.iter().cloned()));
        roots.push(p.root.clone());
        roots.sort();
        roots.dedup();
        roots
    } else {
        vec![p.root.clone()]
    };
    let mut values = Vec::new();
    let mut table = vec![vec![
        "LOOP".to_owned(),
        "STATUS".to_owned(),
        "ITER".to_owned(),
        "PROGRESS".to_owned(),
        "ACTION".to_owned(),
        "TOKENS".to_owned(),
        "COST".to_owned(),
        "TITLE".to_owned(),
    ]];
    let mut totals = Vec::new();
    if all {
        table[0].insert(0, "PROJECT".to_owned());
    }
    for root in &roots {
        let other;
        let project = if *root == p.root {
            p
        } else {
            other = Project::open_for_inspection(Some(root), None)?;
            &other
        };
        let (rows, loops, spent) = list_project(project, service.as_ref(), as_json)?;
        if !rows.is_empty() {
            totals.push((root, spent));
        }
        for mut row in rows {
            if all {
                row.insert(0, root.display().to_string());
            }
            table.push(row);
        }
        values.push(json!({ "root": root, "loops": loops }));
    }
    if as_json {
        let value = match values.pop() {
            Some(only) if !all => only["loops"].clone(),
            last => Value::Array(values.into_iter().chain(last).collect()),
        };
        crate::outln!("{}", serde_json::to_string_pretty(&value)?)?;
        return Ok(0);
    }
    if table.len() == 1 {
        eprintln!("no loops in {}", p.store.dir().display());
        return Ok(0);
    }
    // Columns as wide as their widest cell; the title (last) as it is.
    let cells: Vec<Vec<String>> = table
        .into_iter()
        .map(|row| row.iter().map(|c| printable(c).into_owned()).collect())
        .collect();
    let columns = cells[0].len();
    let widths: Vec<usize> = (0..columns - 1)
        .map(|i| {
            cells
                .iter()
                .map(|r| r[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in &cells {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            line.push_str(&format!("{cell:<width$}  "));
        }
        line.push_str(&row[columns - 1]);
        crate::outln!("{}", line.trim_end())?;
    }
    for (root, spent) in totals {
        let project = match all {
            true => format!(" in {}", root.display()),
            false => String::new(),
        };
        crate::outln!(
            "spent{project}: today {} tokens, ${:.2} · overall {} tokens, ${:.2}",
            view::tokens(spent.today_tokens),
            spent.today_cost_usd,
            view::tokens(spent.tokens),
            spent.cost_usd
        )?;
    }
    Ok(0)
}

/// One project's loops: the table's rows, the state files as they are (for `--json`), and what
/// they spent together.
fn list_project(
    p: &Project,
    service: Option<&loopd_file_driver::service::ServiceInfo>,
    as_json: bool,
) -> Result<(Vec<Vec<String>>, Vec<Value>, view::Spent)> {
    let (mut rows, mut values) = (Vec::new(), Vec::new());
    let mut spent = view::Spent::default();
    for id in &p.store.list_ids()? {
        match p.store.load(id) {
            Ok(loaded) if as_json => {
                let view = LoopView::of(p, &loaded.state, service);
                values.push(with_still(loaded.raw, &view));
            }
            Ok(loaded) => {
                let v = LoopView::of(p, &loaded.state, service);
                spent = spent.plus(v.spent);
                rows.push(vec![
                    v.loop_id,
                    v.standing,
                    format!("{}/{}", v.iteration, v.max_iterations),
                    v.progress,
                    v.action.unwrap_or_default(),
                    view::tokens(v.spent.tokens),
                    format!("${:.2}", v.spent.cost_usd),
                    v.title,
                ]);
            }
            Err(e) if as_json => values.push(json!({"loop_id": id, "error": e.to_string()})),
            Err(e) => rows.push(vec![
                id.clone(),
                "unreadable".to_owned(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                e.to_string(),
            ]),
        }
    }
    Ok((rows, values, spent))
}

/// What `logs` shows, and how.
pub struct LogsShown {
    pub follow: bool,
    pub as_json: bool,
    /// The output of the action in flight, as it is written.
    pub output: bool,
    pub clock: events::Clock,
}

/// How long the action in flight may be silent before `logs --follow` says it still runs.
const QUIET: Duration = Duration::from_secs(10);

fn logs(p: &Project, id: &str, shown: &LogsShown) -> Result<i32> {
    use anstyle::{AnsiColor, Style};
    use std::io::Write as _;
    p.load(id)?;
    // Colour only on a terminal, and never with NO_COLOR (anstream decides).
    let mut out = anstream::stdout();
    let dim = Style::new().dimmed();
    let mut tail = events::EventTail::new(&p.store, id);
    // The attempt in flight: its output, what it is, when it started and last spoke.
    let mut attempt: Option<(events::OutputTail, String, std::time::Instant)> = None;
    let mut last_spoke = std::time::Instant::now();
    let mut idle_polls = 0;
    loop {
        for line in tail.read_lines()? {
            let event = match serde_json::from_str::<Value>(&line) {
                Ok(_) if shown.as_json => {
                    writeln!(out, "{line}")?;
                    continue;
                }
                Ok(event) => event,
                Err(_) => {
                    writeln!(out, "(unreadable event) {}", printable(&line))?;
                    continue;
                }
            };
            let kind = event["event"].as_str().unwrap_or("");
            let ends_attempt = matches!(
                kind,
                name::ACTION_FINISHED | name::ACTION_FAILED | name::ACTION_INTERRUPTED
            );
            if ends_attempt && let Some((mut output, ..)) = attempt.take() {
                for l in output.read_lines(true) {
                    writeln!(out, "{dim}  │ {}{dim:#}", printable(&l))?;
                }
            }
            let colour = match kind {
                name::ACTION_FAILED | name::FAILED => Some(AnsiColor::Red),
                name::ACTION_FINISHED | name::COMPLETED => Some(AnsiColor::Green),
                name::WARNING | name::BLOCKED | name::RATE_LIMITED | name::AGENT_RETRYING => {
                    Some(AnsiColor::Yellow)
                }
                _ => None,
            };
            let style = Style::new().fg_color(colour.map(Into::into));
            writeln!(out, "{style}{}{style:#}", render(&event, shown.clock))?;
            if shown.output
                && kind == name::ACTION_STARTED
                && let Some(log) = event["log"].as_str()
            {
                let what = [event["action"].as_str(), event["task_id"].as_str()]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(" ");
                let output = events::OutputTail::new(&p.store, id, log);
                attempt = Some((output, what, std::time::Instant::now()));
                last_spoke = std::time::Instant::now();
            }
        }
        if let Some((output, what, started)) = &mut attempt {
            let lines = output.read_lines(false);
            if !lines.is_empty() {
                last_spoke = std::time::Instant::now();
            }
            for l in lines {
                writeln!(out, "{dim}  │ {}{dim:#}", printable(&l))?;
            }
            if last_spoke.elapsed() >= QUIET {
                last_spoke = std::time::Instant::now();
                let secs = started.elapsed().as_secs();
                writeln!(
                    out,
                    "{dim}  … {what} running for {}{dim:#}",
                    loopd_file_driver::view::age(chrono::TimeDelta::seconds(secs as i64))
                )?;
            }
        }
        out.flush()?;
        if !shown.follow {
            return Ok(0);
        }
        // Done once no daemon drives the loop (twice in a row: a daemon may be starting), unless
        // it has not started yet: then it is waited for.
        let not_started = p
            .store
            .read_control(id)
            .is_some_and(|c| c.status == Status::Created);
        idle_polls = if finished(p, id) && !not_started {
            idle_polls + 1
        } else {
            0
        };
        if idle_polls >= 2 {
            return Ok(0);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether no daemon drives the loop: nothing more will happen to it by itself.
fn finished(p: &Project, id: &str) -> bool {
    loopd_file_driver::locks::daemon_pid(&p.store, id).is_none()
}

/// The commands of a loop on Temporal (`--temporal`, or a project whose config's `[temporal]` is
/// enabled), and `worker`; `None` for the others.
#[cfg(feature = "temporal")]
fn on_temporal(
    address: Option<&str>,
    connect: &crate::temporal::ConnectArgs,
    command: &Command,
    json: bool,
    roots: &[PathBuf],
    config: Option<&Path>,
) -> Result<Option<i32>> {
    use crate::temporal;
    use loopd_temporal::change::Change;
    let root = roots.first().map(PathBuf::as_path);
    if let Command::WorkerGuard = command {
        return temporal::guard().map(Some);
    }
    if let Command::Worker(args) = command {
        // A worker belongs to no project: the built-in, user and `--config` layers.
        let service = loopd_project::config::Config::load_service(config)?;
        return temporal::worker(temporal::settings(&service, address, connect)?, args).map(Some);
    }
    let on_loops = matches!(
        command,
        Command::Create(_)
            | Command::Status { .. }
            | Command::Pause { .. }
            | Command::Resume { .. }
            | Command::Stop { .. }
            | Command::Next { .. }
            | Command::Answer { .. }
            | Command::Set { .. }
            | Command::Task(TaskCommand::Add { .. })
            | Command::List { .. }
            | Command::Logs { .. }
    );
    if !on_loops {
        return match address {
            // The service serves them beside the file store's.
            Some(_) if matches!(command, Command::Serve(_)) => Ok(None),
            Some(_) => Err(usage(
                "--temporal: only create, status, list, logs, pause, resume, stop, next, answer, \
                 set, task add, serve and worker know loops on Temporal yet",
            )),
            None => Ok(None),
        };
    }
    let project = match command {
        Command::Create(_) => Project::open(root, config),
        _ => Project::open_for_inspection(root, config),
    };
    let project = match (project, address) {
        (Ok(p), _) if address.is_some() || p.config.temporal.enabled => p,
        (Err(e), Some(_)) => return Err(e),
        // The file store's loops; a config that does not load is reported there.
        _ => return Ok(None),
    };
    let settings = temporal::settings(&project.config, address, connect)?;
    let change = |id: &str, change: Change| temporal::change(&settings, id, change, json);
    Ok(Some(match command {
        Command::Create(args) => temporal::create(&project, &settings, args, json)?,
        Command::Status { id } => temporal::status(&settings, id, json)?,
        Command::List { all } => {
            temporal::list(&settings, (!all).then_some(project.root.as_path()), json)?
        }
        Command::Logs {
            id, utc, follow, ..
        } => {
            let clock = match utc {
                true => loopd_store::events::Clock::Utc,
                false => loopd_store::events::Clock::Local,
            };
            temporal::logs(&settings, id, clock, *follow, json)?
        }
        Command::Pause { id } => change(id, Change::Control(Control::Pause))?,
        Command::Resume { id } => change(id, Change::Control(Control::Resume))?,
        Command::Stop { id } => change(id, Change::Control(Control::Stop))?,
        Command::Next { id, action } => change(id, Change::Next(action.clone()))?,
        Command::Answer { id, text } => change(id, Change::Answer(text.clone()))?,
        Command::Task(TaskCommand::Add {
            id,
            text,
            after,
            race,
        }) => {
            loopd_file_driver::worktree::check_race_names(&project, race)?;
            change(
                id,
                Change::Task(loopd_core::control::NewTask::new(text, after, race)),
            )?
        }
        Command::Set { id, limits } => change(id, temporal::set_limits(limits)?)?,
        _ => unreachable!("a command of a loop"),
    }))
}
