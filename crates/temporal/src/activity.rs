//! An attempt as a Temporal activity: the executor run on whichever worker takes it, as the
//! file driver runs it: in the loop's project root, or, for a loop whose project is a git
//! remote, in the worker's work tree of the loop, put at its last checkpoint before and pushed
//! after ([`crate::workspace`]).

use loopd_exec::metrics::metrics;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use loopd_core::attempt::{AttemptOutcome, Verdict};
use loopd_core::state::{Checkpoint, LoopState, Usage};
use loopd_core::workflow::{self, Dispatch};
use loopd_exec::agent::{AgentStream, Told};
use loopd_exec::guard::Guard;
use loopd_exec::result::{RESULT_FILE, empty_result_file, stock_result_file};
use loopd_exec::{Budget, Executor as _, Spec, Subprocess, procs};
use loopd_fs::Dir;
use loopd_project::config::Config;
use loopd_project::plan::{self, Paths, Plans, Step};
use serde::{Deserialize, Serialize};
use temporalio_macros::activities;
use temporalio_sdk::activities::{ActivityContext, ActivityError};
use tokio_util::sync::CancellationToken;

use crate::workspace::Cache;
use crate::{GitSource, Holder};

/// How often a running attempt tells Temporal it lives (and hears of a cancellation).
const HEARTBEAT_EVERY: Duration = Duration::from_millis(200);

/// One attempt to run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AttemptInput {
    pub root: PathBuf,
    /// The loop's state when the attempt starts: what its prompt is made of.
    pub state: LoopState,
    pub dispatch: Dispatch,
    pub iteration: u64,
    pub attempt: u32,
    pub executor: Option<String>,
    /// The loop's remote, and the commit of its last checkpoint there (its base before the
    /// first), when its work tree comes from one.
    #[serde(default)]
    pub git: Option<(GitSource, String)>,
    /// Its lane, when it is one of the tasks its loop develops at once: it runs in a work tree
    /// of its own, and its checkpoint is pushed as a ref only, for the batch's merge.
    #[serde(default)]
    pub lane: Option<u32>,
    /// What tells its checkpoint apart from the other lanes' of the same iteration: a racing
    /// executor's name.
    #[serde(default)]
    pub label: Option<String>,
}

/// A batch's tasks to merge into its loop's tree, on a worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MergeInput {
    pub loop_id: String,
    /// The loop's remote, and the batch's base: the checkpoint every task started from.
    pub git: (GitSource, String),
    /// Each task's checkpoint, in task order: `(task id, merge's name, checkpoint commit)`.
    pub tasks: Vec<(String, String, String)>,
}

/// How a batch's merge went.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MergeReport {
    /// The tasks merged, in order, each with its merge's checkpoint.
    pub merged: Vec<(String, Checkpoint)>,
    /// The tasks that could not be, with why and the files in conflict.
    pub conflicts: Vec<(String, String, Vec<String>)>,
}

/// What a running attempt tells Temporal with each heartbeat (`loopd status --temporal` shows
/// it): which attempt it is, and the last of what its executor printed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub action: String,
    pub iteration: u64,
    pub attempt: u32,
    /// Its task, and its lane among the tasks (or tries) of a batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<u32>,
    /// The last [`PROGRESS_TAIL`] bytes of the attempt's log.
    pub output: String,
    /// What an agent has spent so far (0 and `None` for an executor that does not say).
    pub tokens: u64,
    pub cost_usd: Option<f64>,
}

/// How much of an attempt's log each heartbeat carries.
pub const PROGRESS_TAIL: u64 = 1024;

/// How an attempt ended, and what its executor spent.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AttemptReport {
    /// The executor that ran it, by name (`command: ...` for an action's own command).
    pub executor: String,
    pub verdict: Verdict,
    pub spent: Option<(Usage, Option<f64>)>,
    /// The checkpoint pushed to the loop's remote after a successful action that changes the
    /// work tree: where the loop's next action starts.
    #[serde(default)]
    pub checkpoint: Option<Checkpoint>,
    /// The worker that keeps the loop's work tree now, when it has one.
    #[serde(default)]
    pub holder: Option<Holder>,
    /// Without a git remote (a shared directory), a fingerprint of the work tree's files after
    /// the attempt (see [`loopd_exec::checkpoint::files_fingerprint`]): whether a round changed
    /// a file, for no-progress detection.
    #[serde(default)]
    pub files: Option<u64>,
}

/// The activities of loopd's workers.
pub struct LoopActivities {
    /// Ends the executors of this worker's attempts if the worker dies (see [`Guard`]).
    pub guard: Option<Arc<Guard>>,
    /// The worker's clones and work trees, for loops whose project is a git remote.
    pub cache: Option<Arc<Cache>>,
    /// This worker, as a loop it runs will know it.
    pub holder: Option<Holder>,
    /// The actions this worker may run at once (`[temporal] max_actions`), whichever of its
    /// task queues they came from.
    pub slots: Arc<tokio::sync::Semaphore>,
}

impl LoopActivities {
    /// Why this worker cannot run an attempt of loop `id`, said once in its log and returned for
    /// the loop's block: a person must know where and as whom it could not run (trust is each
    /// user's, a program each machine's).
    fn cannot_run(&self, id: &str, why: String) -> String {
        let worker = self
            .holder
            .as_ref()
            .map_or("this worker", |h| h.name.as_str());
        let said = format!("worker {worker} (user {}) cannot run it: {why}", user());
        tracing::warn!("loop {id}: {said}");
        said
    }
}

#[activities]
impl LoopActivities {
    /// Runs one attempt of an action: the project's config and action files are read on this
    /// worker, the prompt rendered, the executor started in a process group of its own and
    /// supervised; a cancellation (the loop paused or stopped) ends its processes.
    #[activity]
    pub async fn attempt(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: AttemptInput,
    ) -> Result<AttemptReport, ActivityError> {
        let id = input.state.loop_id.clone();
        let mut report = match run_attempt(&ctx, &self, input).await {
            Ok(report) => report,
            Err(e) => return Err(anyhow::anyhow!(self.cannot_run(&id, format!("{e:#}"))).into()),
        };
        // An executor that cannot run here (a program missing on this machine, an agent not
        // logged in as this user) blocks the loop the same way.
        if let Verdict::Blocked { message } = &mut report.verdict {
            *message = self.cannot_run(&id, std::mem::take(message));
        }
        // Cancelled, its executor ended: by its loop (paused, stopped), which no longer waits
        // for it, or by this worker's shutdown, which gives it to another worker at once.
        match ctx.is_cancelled() {
            true => Err(ActivityError::cancelled()),
            false => Ok(report),
        }
    }

    /// Merges the checkpoints of a batch's tasks into the loop's tree, in task order, with git's
    /// three-way merge from the batch's base, and pushes the merges (each a checkpoint, the last
    /// the loop's branch) at once.
    #[activity]
    pub async fn merge(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: MergeInput,
    ) -> Result<MergeReport, ActivityError> {
        Ok(run_merge(&ctx, &self, input).await?)
    }
}

async fn run_merge(
    ctx: &ActivityContext,
    worker: &LoopActivities,
    input: MergeInput,
) -> anyhow::Result<MergeReport> {
    let MergeInput {
        loop_id: id,
        git: (source, base),
        tasks,
    } = input;
    let cache = worker
        .cache
        .as_ref()
        .context("this worker keeps no work trees")?;
    let waiting = Progress {
        action: "merge".into(),
        ..Progress::default()
    };
    let tree = beating(ctx, &waiting, cache.check_out(&source, &id, None, &base))
        .await
        .context("cancelled")??;
    let (path, base_at) = (tree.path.clone(), base.clone());
    // The merges read and write no index (nothing is checked out).
    let (report, merges) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let repo = loopd_exec::checkpoint::Repo::open(&path, &path.join(".loop"), &id, "merge")
            .context("the work tree is not in a git repository")?;
        let mut report = MergeReport::default();
        let mut merges = Vec::new();
        let mut ours = base_at.clone();
        for (task, name, theirs) in tasks {
            match repo.merge(&name, &base_at, &ours, &theirs)? {
                loopd_exec::checkpoint::Merge::Clean(checkpoint) => {
                    ours = checkpoint.commit.clone();
                    merges.push((checkpoint.clone(), theirs));
                    report.merged.push((task, checkpoint));
                }
                loopd_exec::checkpoint::Merge::Conflict(files) => {
                    let why = loopd_exec::checkpoint::conflict_reason(&files);
                    report.conflicts.push((task, why, files));
                }
            }
        }
        Ok((report, merges))
    })
    .await??;
    let merges = match beating(ctx, &waiting, tree.notes_of_merges(&base, merges)).await {
        None => anyhow::bail!("cancelled"),
        Some(merges) => merges?,
    };
    match beating(ctx, &waiting, tree.push_merges(&source, &merges)).await {
        None => anyhow::bail!("cancelled"),
        Some(pushed) => pushed?,
    }
    Ok(report)
}

async fn run_attempt(
    ctx: &ActivityContext,
    worker: &LoopActivities,
    input: AttemptInput,
) -> anyhow::Result<AttemptReport> {
    let AttemptInput {
        root,
        state,
        dispatch,
        iteration,
        attempt,
        executor,
        git,
        lane,
        label,
    } = input;
    let waiting = Progress {
        action: dispatch.action.clone(),
        iteration,
        attempt,
        task_id: dispatch.task_id.clone(),
        lane,
        ..Progress::default()
    };
    let Some(_slot) = beating(ctx, &waiting, worker.slots.acquire()).await else {
        return Ok(AttemptReport::interrupted());
    };
    let id = state.loop_id.as_str();
    // The loop's work tree on this worker, at its last checkpoint.
    let tree = match (&git, &worker.cache) {
        (None, _) => None,
        (Some(_), None) => anyhow::bail!("this worker keeps no work trees"),
        (Some((source, commit)), Some(cache)) => {
            match beating(ctx, &waiting, cache.check_out(source, id, lane, commit)).await {
                None => return Ok(AttemptReport::interrupted()),
                Some(Err(e)) => return Ok(AttemptReport::git_failed(id, &e)),
                Some(Ok(tree)) => Some(tree),
            }
        }
    };
    let root = tree.as_ref().map_or(root, |t| t.path.clone());
    let config = Config::load(&root, None)?;
    let name = state
        .skill_state
        .as_ref()
        .and_then(|s| s.workflow.as_deref())
        .unwrap_or(workflow::DEFAULT);
    let wf = workflow::by_name(name).with_context(|| format!("unknown workflow {name:?}"))?;
    let plans = Plans::load(&root, &config, wf, executor.as_deref())?;
    match &git {
        Some((source, _)) => trusted_as_made(&root, source, &plans.project_files(&config))?,
        None => loopd_project::trust::check(&root, &plans.project_files(&config))?,
    }
    if let Some(tree) = &tree
        && let Err(e) = tree.clean(&config.state_dir).await
    {
        return Ok(AttemptReport::git_failed(id, &e));
    }
    let (def, plan) = plans
        .get(&dispatch.action)
        .with_context(|| format!("no plan for action {}", dispatch.action))?;
    let state_dir = root.join(&config.state_dir);
    let progress_dir = state_dir.join(format!("{id}.progress"));
    let notes = Dir::open(&root)?
        .subdir(&config.state_dir, true)?
        .subdir(&format!("{id}.progress"), true)?;
    let actions = notes.subdir("actions", true)?;
    // The notes its agents wrote on whichever worker ran them.
    if let (Some(tree), Some((_, commit))) = (&tree, &git)
        && let Err(e) = tree.restore_notes(&notes, commit).await
    {
        return Ok(AttemptReport::git_failed(id, &e));
    }
    let result_file = actions.join(RESULT_FILE);
    empty_result_file(&actions, RESULT_FILE);
    let step = Step {
        dispatch: &dispatch,
        plan,
        def,
        iteration,
    };
    let state_file = state_dir.join(format!("{id}.json"));
    let marker = procs::marker_name(&state_file);
    let paths = Paths {
        root: &root,
        state_file: &state_file,
        progress_dir: &progress_dir,
        result_file: &result_file,
    };
    let task = wf.task(&state, &dispatch);
    let max_iterations = state.max_iterations_or(config.max_iterations);
    let prompt = plan::prompt(
        wf,
        max_iterations,
        &state,
        &step,
        attempt,
        &paths,
        task.clone(),
    );
    let env = plan::environment(id, &step, attempt, &paths, task);
    let (tokens, cost_usd) = config.limits().remaining(&state);
    let spec = Spec {
        argv: plan.argv.clone(),
        prompt,
        prompt_mode: plan.prompt_mode,
        env,
        cwd: root.clone(),
        state_dir: state_dir.clone(),
        supervision: plan.supervision,
        dir: actions.clone(),
        stem: format!("{iteration:04}-{}-{attempt}", dispatch.action),
        marker: marker.clone(),
        agent: AgentStream::for_format(plan.format),
        budget: Budget { tokens, cost_usd },
        sandbox: plan.sandbox.clone(),
    };
    let log = format!("{}.log", spec.stem);
    let progress = |output, (tokens, cost_usd)| Progress {
        output,
        tokens,
        cost_usd,
        ..waiting.clone()
    };
    let _guarded = worker.guard.as_ref().map(|g| g.attempt(&marker));
    let running = Subprocess.spawn(spec)?;
    stock_result_file(&actions, RESULT_FILE);
    metrics().attempt_started(wf.name(), &dispatch.action, &plan.executor);
    let cancel = CancellationToken::new();
    // What the agent has spent so far, for the heartbeats.
    let spent = std::sync::Mutex::new((0, None));
    let mut told = |told| {
        if let Told::Spent { tokens, cost_usd } = told {
            *spent.lock().unwrap_or_else(PoisonError::into_inner) = (tokens, cost_usd);
        }
    };
    let supervised = running.supervise(cancel.clone(), &mut told);
    tokio::pin!(supervised);
    let run = loop {
        tokio::select! {
            run = &mut supervised => break run?,
            () = ctx.cancelled(), if !cancel.is_cancelled() => cancel.cancel(),
            () = tokio::time::sleep(HEARTBEAT_EVERY) => {
                let output = actions.read_tail(&log, PROGRESS_TAIL).unwrap_or_default();
                let spent = *spent.lock().unwrap_or_else(PoisonError::into_inner);
                let _ = ctx.record_heartbeat(progress(output, spent)).await;
            }
        }
    };
    let reported = loopd_exec::result::read_result_file(&actions, RESULT_FILE);
    let verdict = loopd_exec::result::verdict(plan.format, reported, &run);
    let attempt = loopd_exec::metrics::Attempt {
        workflow: wf.name(),
        action: &dispatch.action,
        executor: &plan.executor,
        account: &plan.account,
    };
    metrics().attempt_finished(&attempt, verdict.outcome(), &run);
    let spent = run.agent.map(|a| (a.usage, a.cost_usd));
    let files = match (&git, wf.counts_iteration(&dispatch.action)) {
        (None, true) => {
            let (root, state_dir) = (root.clone(), state_dir.clone());
            tokio::task::spawn_blocking(move || {
                loopd_exec::checkpoint::files_fingerprint(&root, &[&state_dir])
            })
            .await
            .ok()
            .flatten()
        }
        _ => None,
    };
    let mut report = AttemptReport {
        executor: plan.executor.clone(),
        verdict,
        spent,
        checkpoint: None,
        holder: None,
        files,
    };
    if let (Some(tree), Some((source, commit))) = (tree, &git) {
        // Only a success moves the loop on: what a failed or interrupted attempt left stays
        // here, and the next attempt starts from the checkpoint again.
        if matches!(report.verdict, Verdict::Success(_)) && wf.changes_work_tree(&dispatch.action) {
            let name = match &label {
                Some(label) => format!("{iteration}-{}-{label}", dispatch.action),
                None => format!("{iteration}-{}", dispatch.action),
            };
            let recorded = record(&tree.path, &state_dir, id, &name, commit);
            let checkpoint = match beating(ctx, &waiting, recorded).await {
                None => return Ok(AttemptReport::interrupted()),
                Some(Err(e)) => {
                    tree.forget().await;
                    return Ok(AttemptReport::git_failed(id, &e));
                }
                Some(Ok(checkpoint)) => checkpoint,
            };
            let notes = match tree.record_notes(&notes).await {
                Ok(notes) => notes,
                Err(e) => return Ok(AttemptReport::git_failed(id, &e)),
            };
            // A task developed at once with others: its checkpoint (and its notes) go to the
            // batch's merge, and its tree is no loop's to keep.
            let pushed = async {
                match lane {
                    Some(_) => {
                        tree.push_checkpoint(source, &checkpoint, notes.as_deref())
                            .await
                    }
                    None => tree.push(source, &checkpoint, notes.as_deref()).await,
                }
            };
            match beating(ctx, &waiting, pushed).await {
                None => return Ok(AttemptReport::interrupted()),
                Some(Err(e)) => return Ok(AttemptReport::git_failed(id, &e)),
                Some(Ok(())) => report.checkpoint = Some(checkpoint),
            }
            if lane.is_some() {
                return Ok(report);
            }
        }
        report.holder = worker.holder.clone();
    }
    Ok(report)
}

impl AttemptReport {
    /// An attempt ended from outside before its executor ran or finished.
    fn interrupted() -> AttemptReport {
        AttemptReport {
            executor: String::new(),
            verdict: Verdict::Interrupted,
            spent: None,
            checkpoint: None,
            holder: None,
            files: None,
        }
    }

    /// An attempt whose work tree could not be fetched, put at its checkpoint, recorded or
    /// pushed: a failed attempt (the loop's retries decide what follows), with git's reason,
    /// the next one for any worker.
    fn git_failed(id: &str, e: &anyhow::Error) -> AttemptReport {
        tracing::warn!("loop {id}: {e:#}");
        AttemptReport {
            verdict: Verdict::Failed {
                outcome: AttemptOutcome::TransientApiError,
                message: loopd_exec::result::one_line(&format!("{e:#}")),
            },
            ..AttemptReport::interrupted()
        }
    }
}

/// Waits for `work`, telling Temporal the attempt lives meanwhile; `None` if the attempt was
/// cancelled first (then `work` is dropped: a git it ran is killed).
async fn beating<T>(
    ctx: &ActivityContext,
    progress: &Progress,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            done = &mut work => return Some(done),
            () = ctx.cancelled() => return None,
            () = tokio::time::sleep(HEARTBEAT_EVERY) => {
                let _ = ctx.record_heartbeat(progress.clone()).await;
            }
        }
    }
}

/// Records the work tree at `tree` as checkpoint `name`, the child of `parent`
/// ([`loopd_exec::checkpoint`]).
async fn record(
    tree: &Path,
    state_dir: &Path,
    id: &str,
    name: &str,
    parent: &str,
) -> anyhow::Result<Checkpoint> {
    let (tree, state_dir, id, name, parent) = (
        tree.to_owned(),
        state_dir.to_owned(),
        id.to_owned(),
        name.to_owned(),
        parent.to_owned(),
    );
    tokio::task::spawn_blocking(move || {
        let repo = loopd_exec::checkpoint::Repo::open(&tree, &state_dir, &id, "checkpoint")
            .context("the work tree is not in a git repository")?;
        // Made afresh from the last checkpoint, which another worker may have recorded.
        repo.forget_index();
        repo.record(&name, Some(&parent))
    })
    .await?
}

/// Who this worker runs as: its user's name, else its uid.
fn user() -> String {
    use std::os::unix::fs::MetadataExt as _;
    std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| match std::fs::metadata("/proc/self") {
            Ok(m) => format!("uid {}", m.uid()),
            Err(_) => "unknown".to_owned(),
        })
}

/// Refuses a project file of the work tree that is not as the person who made the loop trusted
/// it: the files of a remote run only as `loopd create` found them.
fn trusted_as_made(
    root: &Path,
    source: &GitSource,
    files: &[&loopd_project::project_file::ProjectFile],
) -> anyhow::Result<()> {
    for file in files {
        let path = file.path.strip_prefix(root).unwrap_or(&file.path);
        if source.trusted.get(path) != Some(&file.digest) {
            anyhow::bail!(
                "{} is not as it was when the loop was made (a loop on a remote runs its \
                 project's files only as `loopd create` trusted them)",
                path.display()
            );
        }
    }
    Ok(())
}
