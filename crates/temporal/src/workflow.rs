//! A loop as a Temporal workflow: the selections of the file driver's daemon, with the state in
//! the workflow and every decision from the core.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};
use loopd_core::attempt::{self, AfterAttempt, Attempts, RetryPolicy, Verdict};
use loopd_core::state::{LoopState, Status, format_ts};
use loopd_core::workflow::{self, Decision, Dispatch, Finish, Inputs, LoopEnd, Workflow};
use serde_json::{Value, json};
use temporalio_macros::{workflow, workflow_methods};
use temporalio_sdk::{
    ActivityOptions, ContinueAsNewOptions, MemoValue, SyncWorkflowContext, WorkflowContext,
    WorkflowContextView, WorkflowResult,
};

use crate::activity::{AttemptInput, AttemptReport, LoopActivities, MergeInput, MergeReport};
use crate::change::Change;
use crate::visibility;
use crate::{Holder, LoopInput};

/// How long an attempt may go without a heartbeat before Temporal gives it to another worker.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often Temporal gives an attempt that failed to run at all (not one whose executor failed:
/// that is the loop's to retry) to a worker: a worker that died while it ran counts.
const ACTIVITY_TRIES: u32 = 3;
/// The longest an attempt may take, whatever its executor's own timeout says.
const ATTEMPT_LIMIT: Duration = Duration::from_secs(24 * 3600);
/// How long an attempt waits for the worker that keeps the loop's work tree before it goes to
/// any worker.
const HOLDER_WAIT: Duration = Duration::from_secs(3);

/// One loop.
#[workflow]
pub struct LoopWorkflow {
    input: LoopInput,
    /// The status, iteration and worker the visibility store shows ([`visibility`]), once set
    /// this run.
    shown: Option<(String, i64, String)>,
}

#[workflow_methods]
impl LoopWorkflow {
    #[init]
    pub fn new(_ctx: &WorkflowContextView, input: LoopInput) -> Self {
        LoopWorkflow { input, shown: None }
    }

    /// Drives the loop until it ends (completed, failed or stopped), continuing as a new run
    /// whenever its history grows past [`LoopInput::history_limit`] events; returns what the
    /// loop's next run would start from.
    #[run]
    pub async fn run(ctx: &mut WorkflowContext<Self>) -> WorkflowResult<LoopInput> {
        loop {
            let (state, history_limit) =
                ctx.state(|s| (s.input.state.clone(), s.input.history_limit));
            if history_limit > 0 && ctx.history_length() >= history_limit {
                let input = ctx.state(|s| s.input.clone());
                ctx.continue_as_new(input, ContinueAsNewOptions::default())?;
            }
            show(ctx);
            match state.status {
                Status::Created => {
                    ctx.state_mut(|s| s.input.state.status = Status::Running);
                    continue;
                }
                Status::Paused => {
                    ctx.wait_condition(|s| s.input.state.status != Status::Paused)
                        .await?;
                    // A person resumed it: its rounds without progress count afresh.
                    ctx.state_mut(|s| loopd_core::no_progress::afresh(&mut s.input.state));
                    continue;
                }
                Status::Running => {}
                _ => return Ok(ctx.state(|s| s.input.clone())),
            }
            let (wf, limits) = (
                loopd_core::workflow::of(&state),
                ctx.state(|s| s.input.limits),
            );
            // Tasks added since the last look join the loop as pending, as in the file driver.
            let at = format_ts(now(ctx));
            let joined = ctx.state_mut(|s| {
                let input = &mut s.input;
                let joined = wf.absorb_tasks(&mut input.state, &input.tasks, &at);
                // Tasks a person added: the rounds without progress count afresh.
                if joined > 0 {
                    loopd_core::no_progress::afresh(&mut input.state);
                }
                joined
            });
            let state = match joined {
                0 => state,
                _ => ctx.state(|s| s.input.state.clone()),
            };
            match workflow::decide(wf, &state, limits) {
                Decision::Abort(reason) => ctx.state_mut(|s| {
                    let state = &mut s.input.state;
                    state.skill().outcome = Some("failed".into());
                    state.status = Status::Failed;
                    state.failure_reason = Some(reason);
                }),
                Decision::Pause(reason) => {
                    let at = format_ts(now(ctx));
                    ctx.state_mut(|s| {
                        let state = &mut s.input.state;
                        loopd_core::no_progress::pause(state, reason, &at);
                        state.status = Status::Paused;
                    });
                }
                Decision::AwaitAnswer => {
                    ctx.wait_condition(|s| {
                        let state = &s.input.state;
                        state.status != Status::Running
                            || loopd_core::control::waiting_question(state).is_none()
                    })
                    .await?;
                }
                Decision::Wait { .. } => {
                    ctx.wait_condition(|s| {
                        s.input.state.status != Status::Running
                            || s.input.state.next_action.is_some()
                    })
                    .await?;
                }
                Decision::Run(dispatch) => {
                    let racers = ctx.state(|s| racers_of(wf, &s.input, &dispatch));
                    if !racers.is_empty() {
                        run_race(ctx, wf, dispatch, racers).await?;
                        continue;
                    }
                    let batch = ctx.state(|s| batch_of(wf, &s.input, &dispatch));
                    match batch.is_empty() {
                        true => run_action(ctx, wf, dispatch).await?,
                        false => run_batch(ctx, wf, batch).await?,
                    }
                }
            }
        }
    }

    /// Refuses a change that makes no sense for the loop as it is now, in one line, before it
    /// is written to the loop's history.
    #[update_validator(change)]
    fn check_change(
        &self,
        _ctx: &WorkflowContextView,
        change: &Change,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.input.clone().change(change, "")?;
        Ok(())
    }

    /// Makes a change a person asks for (`loopd pause|resume|stop|next|task add|answer|set`);
    /// returns what the command prints.
    #[update]
    pub fn change(&mut self, ctx: &mut SyncWorkflowContext<Self>, change: Change) -> Value {
        let at = format_ts(time_of(ctx.workflow_time()));
        // Checked by the validator against this same state.
        self.input
            .change(&change, &at)
            .unwrap_or_else(|refused| json!({ "refused": refused }))
    }

    /// The loop's state as it is now.
    #[query]
    pub fn state(&self, _ctx: &WorkflowContextView) -> LoopState {
        self.input.state.clone()
    }

    /// The worker that keeps the loop's work tree, if one does.
    #[query]
    pub fn holder(&self, _ctx: &WorkflowContextView) -> Option<Holder> {
        self.input.holder.clone()
    }

    /// The loop's project root and state.
    #[query]
    pub fn held(&self, _ctx: &WorkflowContextView) -> (PathBuf, LoopState) {
        (self.input.root.clone(), self.input.state.clone())
    }
}

/// Says `event` (`{"event": NAME, ...}`) in the loop's log: a memo the history keeps, which
/// [`crate::history`] reads as the event it is.
fn say(ctx: &WorkflowContext<LoopWorkflow>, event: Value) {
    // JSON the default converter takes as it is: it cannot fail.
    let _ = ctx.upsert_memo([(crate::history::SAID, Some(MemoValue::new(event)))]);
}

/// Tells the visibility store the loop's status, iteration and worker, where they changed.
fn show(ctx: &mut WorkflowContext<LoopWorkflow>) {
    let now = ctx.state(|s| visibility::moving(&s.input));
    if ctx.state(|s| s.shown.as_ref() != Some(&now)) {
        ctx.upsert_search_attributes(visibility::updates(now.clone()));
        ctx.state_mut(|s| s.shown = Some(now));
    }
}

/// Why an activity failed, in one line: the innermost message of its failure (the worker's own
/// words, under Temporal's "activity task failed").
fn why(e: &temporalio_sdk::ActivityExecutionError) -> String {
    let mut message = e.to_string();
    let mut failure = e.failure();
    while let Some(f) = failure {
        if !f.message.is_empty() {
            message.clone_from(&f.message);
        }
        failure = f.cause.as_deref();
    }
    loopd_exec::result::one_line(&message)
}

/// The workflow's clock: the time of the workflow task, the same on every replay.
fn now(ctx: &WorkflowContext<LoopWorkflow>) -> DateTime<Utc> {
    time_of(ctx.workflow_time())
}

fn time_of(workflow_time: Option<SystemTime>) -> DateTime<Utc> {
    DateTime::<Utc>::from(workflow_time.unwrap_or(SystemTime::UNIX_EPOCH))
}

/// One action: its attempts as activities, with the core's retries and waits as durable timers,
/// until it is finished, the loop must wait for someone, or a person paused or stopped it.
async fn run_action(
    ctx: &mut WorkflowContext<LoopWorkflow>,
    wf: &'static dyn Workflow,
    dispatch: Dispatch,
) -> WorkflowResult<()> {
    let at = format_ts(now(ctx));
    ctx.state_mut(|s| attempt::begin(wf, &mut s.input.state, &dispatch, &at));
    let (root, executor, retry, git) = ctx.state(|s| {
        (
            s.input.root.clone(),
            s.input.executor.clone(),
            s.input.retry,
            s.input.git.clone(),
        )
    });
    let mut attempts = Attempts::new(retry);
    loop {
        let (state, head, holder) = ctx.state(|s| {
            let input = &s.input;
            (
                input.state.clone(),
                input.head.clone(),
                input.holder.clone(),
            )
        });
        let iteration = state
            .current_iteration
            .saturating_add(u64::from(wf.counts_iteration(&dispatch.action)));
        let started_at = format_ts(now(ctx));
        let input = AttemptInput {
            root: root.clone(),
            state,
            dispatch: dispatch.clone(),
            iteration,
            attempt: attempts.attempt,
            executor: executor.clone(),
            git: git
                .as_ref()
                .map(|g| (g.clone(), head.unwrap_or_else(|| g.base.clone()))),
            lane: None,
            label: None,
        };
        let report = {
            let activity = attempt(ctx, input, holder, attempts.attempt > 1);
            let controlled = ctx.wait_condition(|s| s.input.state.status != Status::Running);
            futures::pin_mut!(activity);
            futures::pin_mut!(controlled);
            match futures::future::select(activity, controlled).await {
                futures::future::Either::Left((report, _)) => Some(report),
                // The executor is ended by the activity's cancellation, at its next heartbeat.
                futures::future::Either::Right(_) => None,
            }
        };
        // Where the loop's work tree is now (a loop on a git remote): with the worker that
        // reported it, none after a failure; at its last checkpoint.
        if let Some(report) = &report {
            let report = report.as_ref().ok();
            let holder = report.and_then(|r| r.holder.clone());
            let head = report.and_then(|r| r.checkpoint.as_ref().map(|c| c.commit.clone()));
            ctx.state_mut(|s| {
                s.input.holder = holder;
                s.input.head = head.or(s.input.head.take());
            });
        }
        let files = report
            .as_ref()
            .and_then(|r| r.as_ref().ok())
            .and_then(|r| r.files);
        let (verdict, spent, ran_by, checkpoint) = match report {
            Some(Ok(report)) => (
                attempt::checked(wf, &dispatch.action, report.verdict),
                report.spent,
                report.executor,
                report.checkpoint,
            ),
            // No worker could run it (its project's files do not load or are not trusted, its
            // executor cannot start): the loop waits for a person, as a blocked executor does.
            Some(Err(message)) => (Verdict::Blocked { message }, None, String::new(), None),
            None => (Verdict::Interrupted, None, String::new(), None),
        };
        let finished_at = format_ts(now(ctx));
        ctx.state_mut(|s| {
            attempt::record(
                &mut s.input.state,
                attempt::Attempted {
                    dispatch: &dispatch,
                    iteration,
                    attempt: attempts.attempt,
                    started_at: &started_at,
                    finished_at: &finished_at,
                    spent: spent.as_ref().map(|(u, c)| (u, *c)),
                    checkpoint,
                },
                &verdict,
            )
        });
        match attempts.next(verdict, now(ctx)) {
            AfterAttempt::Finish(finish) => {
                finish_action(ctx, wf, &dispatch, finish, files);
                return Ok(());
            }
            AfterAttempt::Retry { pause: wait } | AfterAttempt::WaitRateLimit { wait, .. } => {
                sleep_unless_controlled(ctx, wait).await;
            }
            AfterAttempt::Block(reason) => {
                let at = format_ts(now(ctx));
                ctx.state_mut(|s| {
                    let state = &mut s.input.state;
                    attempt::block(state, &dispatch, &ran_by, reason, &at);
                    state.status = Status::Paused;
                });
                return Ok(());
            }
            AfterAttempt::Ask(question) => {
                let at = format_ts(now(ctx));
                ctx.state_mut(|s| attempt::ask(wf, &mut s.input.state, &dispatch, question, &at));
                return Ok(());
            }
            AfterAttempt::Interrupted => return Ok(()),
        }
        if ctx.state(|s| s.input.state.status != Status::Running) {
            return Ok(());
        }
    }
}

/// The tasks to develop at once with `first`, when the loop's `parallel` allows more than one,
/// its work tree comes from a git remote (each task's travels through it) and more than one is
/// ready; else none.
fn batch_of(wf: &'static dyn Workflow, input: &LoopInput, first: &Dispatch) -> Vec<Dispatch> {
    let state = &input.state;
    let parallel = state.parallel_or(1);
    if parallel < 2 || input.git.is_none() || state.mode() != loopd_core::state::Mode::Auto {
        return Vec::new();
    }
    let left = state
        .max_iterations_or(input.limits.max_iterations)
        .saturating_sub(state.current_iteration);
    let max = usize::try_from(parallel.min(left)).unwrap_or(usize::MAX);
    let batch = wf.batch(state, first, max);
    if batch.len() < 2 { Vec::new() } else { batch }
}

/// The executors that race on `dispatch`'s task (the task's own, else the loop's, else the
/// config's as `create` found it), when at least two do, the loop is in auto mode and its work
/// tree comes from a git remote (each try's travels through it); else none.
fn racers_of(wf: &'static dyn Workflow, input: &LoopInput, dispatch: &Dispatch) -> Vec<String> {
    let state = &input.state;
    if input.git.is_none() || state.mode() != loopd_core::state::Mode::Auto {
        return Vec::new();
    }
    let racers = wf.racers(
        state,
        dispatch,
        state.race.as_deref().unwrap_or(&input.race),
    );
    if racers.len() < 2 { Vec::new() } else { racers }
}

/// One task of a batch (or one executor's try of a raced task, or the check of it) and how it
/// stands.
struct Lane {
    dispatch: Dispatch,
    iteration: u64,
    /// Its work tree's number on a worker, from 1.
    number: u32,
    /// The executor of its attempts, when not the loop's.
    executor: Option<String>,
    /// What tells its checkpoints apart from the other lanes' of the iteration (a racer's name).
    label: Option<String>,
    /// The commit its attempts start from.
    base: String,
    attempts: Attempts,
    /// How its attempts ended, once they did.
    end: Option<AfterAttempt>,
    /// The pause before its next attempt, when it wants one.
    pause: Duration,
    /// Its last attempt's checkpoint, pushed as a ref for the merge.
    checkpoint: Option<loopd_core::state::Checkpoint>,
    /// The executor that ran its last attempt.
    ran_by: String,
}

impl Lane {
    /// Lane `number`, whose attempts run `dispatch` from commit `base` with `executor` (`None`:
    /// the loop's).
    fn new(
        number: u32,
        dispatch: Dispatch,
        iteration: u64,
        base: String,
        retry: RetryPolicy,
        executor: Option<String>,
    ) -> Lane {
        Lane {
            dispatch,
            iteration,
            number,
            executor,
            label: None,
            base,
            attempts: Attempts::new(retry),
            end: None,
            pause: Duration::ZERO,
            checkpoint: None,
            ran_by: String::new(),
        }
    }

    fn succeeded(&self) -> bool {
        matches!(self.end, Some(AfterAttempt::Finish(Finish::Success(_))))
    }
}

/// Tasks developed at once, as the file driver develops them (see its `batch`): each attempt an
/// activity in a work tree of its own at the loop's last checkpoint, on whichever workers take
/// them, all at once ([`rounds`]); then a worker merges their checkpoints into the loop's tree in
/// task order and pushes the merges; then each task's result is applied, in task order.
async fn run_batch(
    ctx: &mut WorkflowContext<LoopWorkflow>,
    wf: &'static dyn Workflow,
    batch: Vec<Dispatch>,
) -> WorkflowResult<()> {
    let at = format_ts(now(ctx));
    ctx.state_mut(|s| {
        for dispatch in &batch {
            attempt::begin(wf, &mut s.input.state, dispatch, &at);
        }
    });
    let Some((git, base, first, retry, executor)) = ctx.state(|s| lanes_at(&s.input)) else {
        return Ok(());
    };
    let mut lanes: Vec<Lane> = (1..)
        .zip((first..).zip(batch))
        .map(|(number, (iteration, dispatch))| {
            let executor = executor.clone();
            Lane::new(number, dispatch, iteration, base.clone(), retry, executor)
        })
        .collect();
    if !rounds(ctx, wf, &mut lanes, &git).await? {
        return Ok(());
    }
    merge_batch(ctx, wf, lanes, git, base).await
}

/// Each of `racers` develops `dispatch`'s task, as the file driver races them (see its
/// `batch`): a lane each, the same [`rounds`]; then the check action on each tree that
/// succeeded (a round of its own), and only the best ([`attempt::race_winner`]) merged; the
/// others stay on the remote as checkpoints (`ITERATION-develop-EXECUTOR`).
async fn run_race(
    ctx: &mut WorkflowContext<LoopWorkflow>,
    wf: &'static dyn Workflow,
    dispatch: Dispatch,
    racers: Vec<String>,
) -> WorkflowResult<()> {
    let at = format_ts(now(ctx));
    ctx.state_mut(|s| attempt::begin(wf, &mut s.input.state, &dispatch, &at));
    let Some((git, base, iteration, retry, executor)) = ctx.state(|s| lanes_at(&s.input)) else {
        return Ok(());
    };
    let mut lanes: Vec<Lane> = (1..)
        .zip(racers)
        .map(|(number, racer)| Lane {
            label: Some(racer.clone()),
            ..Lane::new(
                number,
                dispatch.clone(),
                iteration,
                base.clone(),
                retry,
                Some(racer),
            )
        })
        .collect();
    say(
        ctx,
        json!({
            "event": "race_started", "iteration": iteration, "task_id": dispatch.task_id,
            "executors": lanes.iter().map(|l| l.label.clone()).collect::<Vec<_>>(), "base": base,
        }),
    );
    if !rounds(ctx, wf, &mut lanes, &git).await? {
        return Ok(());
    }
    let succeeded: Vec<usize> = (0..lanes.len()).filter(|&i| lanes[i].succeeded()).collect();
    let mut rates = vec![None; lanes.len()];
    if let (Some(check), true) = (wf.check_action(), succeeded.len() > 1) {
        let mut checks: Vec<Lane> = succeeded
            .iter()
            .map(|&i| {
                let entry = &lanes[i];
                let tree = entry
                    .checkpoint
                    .as_ref()
                    .map_or_else(|| base.clone(), |c| c.commit.clone());
                let (number, executor) = (entry.number, executor.clone());
                Lane {
                    label: entry.label.clone(),
                    ..Lane::new(
                        number,
                        Dispatch::new(check),
                        entry.iteration,
                        tree,
                        retry,
                        executor,
                    )
                }
            })
            .collect();
        if !rounds(ctx, wf, &mut checks, &git).await? {
            return Ok(());
        }
        let (state, at) = (ctx.state(|s| s.input.state.clone()), format_ts(now(ctx)));
        for (&i, check) in succeeded.iter().zip(&checks) {
            if let Some(AfterAttempt::Finish(finish)) = &check.end {
                rates[i] = attempt::pass_rate_of(wf, &state, &check.dispatch, finish, &at);
            }
        }
    }
    let entrants: Vec<attempt::Entrant> = lanes
        .iter()
        .zip(&rates)
        .map(|(lane, &pass_rate)| attempt::Entrant {
            succeeded: lane.succeeded(),
            pass_rate,
            change: lane
                .checkpoint
                .as_ref()
                .map_or(u64::MAX, |c| c.insertions + c.deletions),
        })
        .collect();
    let winner = attempt::race_winner(&entrants);
    let said: Vec<Value> = lanes
        .iter()
        .zip(&rates)
        .map(|(lane, rate)| {
            json!({
                "executor": lane.label, "pass_rate": rate, "checkpoint": lane.checkpoint,
                "outcome": if lane.succeeded() { "success" } else { "failed" },
            })
        })
        .collect();
    say(
        ctx,
        json!({
            "event": "race_decided", "iteration": iteration, "task_id": dispatch.task_id,
            "winner": winner.map(|w| lanes[w].label.clone()), "entries": said,
        }),
    );
    // None succeeded: the task ends as its first executor's attempts did.
    let chosen = winner.unwrap_or(0);
    merge_batch(ctx, wf, vec![lanes.swap_remove(chosen)], git, base).await
}

/// Where a batch's lanes start: the loop's remote, its last checkpoint, the iteration of the
/// first lane, the retry policy and the loop's executor; none without a remote.
fn lanes_at(
    input: &LoopInput,
) -> Option<(crate::GitSource, String, u64, RetryPolicy, Option<String>)> {
    let git = input.git.clone()?;
    let base = input.head.clone().unwrap_or_else(|| git.base.clone());
    let first = input.state.current_iteration + 1;
    Some((git, base, first, input.retry, input.executor.clone()))
}

/// Runs `lanes`' attempts at once, round after round: each attempt an activity in its lane's
/// work tree at the lane's base, on whichever workers take them; a failed one tried again as the
/// action's retries allow, after the longest of the pauses they want. Returns false when a pause
/// or a stop ended them (every executor is ended by its activity's cancellation): nothing of
/// theirs is to be applied.
async fn rounds(
    ctx: &mut WorkflowContext<LoopWorkflow>,
    wf: &'static dyn Workflow,
    lanes: &mut [Lane],
    git: &crate::GitSource,
) -> WorkflowResult<bool> {
    let root = ctx.state(|s| s.input.root.clone());
    loop {
        let state = ctx.state(|s| s.input.state.clone());
        let started_at = format_ts(now(ctx));
        let wanting: Vec<usize> = (0..lanes.len())
            .filter(|&i| lanes[i].end.is_none())
            .collect();
        let inputs: Vec<AttemptInput> = wanting
            .iter()
            .map(|&i| {
                let lane = &lanes[i];
                AttemptInput {
                    root: root.clone(),
                    state: state.clone(),
                    dispatch: lane.dispatch.clone(),
                    iteration: lane.iteration,
                    attempt: lane.attempts.attempt,
                    executor: lane.executor.clone(),
                    git: Some((git.clone(), lane.base.clone())),
                    lane: Some(lane.number),
                    label: lane.label.clone(),
                }
            })
            .collect();
        let reports = {
            let all = futures::future::join_all(inputs.into_iter().map(|input| {
                let retry = input.attempt > 1;
                attempt(ctx, input, None, retry)
            }));
            let controlled = ctx.wait_condition(|s| s.input.state.status != Status::Running);
            futures::pin_mut!(all);
            futures::pin_mut!(controlled);
            match futures::future::select(all, controlled).await {
                futures::future::Either::Left((reports, _)) => {
                    reports.into_iter().map(Some).collect()
                }
                // Every executor is ended by its activity's cancellation.
                futures::future::Either::Right(_) => vec![None; wanting.len()],
            }
        };
        let finished_at = format_ts(now(ctx));
        for (&i, report) in wanting.iter().zip(reports) {
            let lane = &mut lanes[i];
            let (verdict, spent, ran_by, checkpoint) = match report {
                Some(Ok(report)) => (
                    attempt::checked(wf, &lane.dispatch.action, report.verdict),
                    report.spent,
                    report.executor,
                    report.checkpoint,
                ),
                Some(Err(message)) => (Verdict::Blocked { message }, None, String::new(), None),
                None => (Verdict::Interrupted, None, String::new(), None),
            };
            lane.checkpoint.clone_from(&checkpoint);
            lane.ran_by = ran_by;
            ctx.state_mut(|s| {
                attempt::record(
                    &mut s.input.state,
                    attempt::Attempted {
                        dispatch: &lane.dispatch,
                        iteration: lane.iteration,
                        attempt: lane.attempts.attempt,
                        started_at: &started_at,
                        finished_at: &finished_at,
                        spent: spent.as_ref().map(|(u, c)| (u, *c)),
                        checkpoint,
                    },
                    &verdict,
                )
            });
            match lane.attempts.next(verdict, now(ctx)) {
                AfterAttempt::Retry { pause } | AfterAttempt::WaitRateLimit { wait: pause, .. } => {
                    lane.pause = pause;
                }
                after => lane.end = Some(after),
            }
        }
        let interrupted = lanes
            .iter()
            .any(|l| matches!(l.end, Some(AfterAttempt::Interrupted)));
        if interrupted || ctx.state(|s| s.input.state.status != Status::Running) {
            return Ok(false);
        }
        let pause = lanes
            .iter()
            .filter(|l| l.end.is_none())
            .map(|l| l.pause)
            .max();
        let Some(pause) = pause else {
            return Ok(true);
        };
        sleep_unless_controlled(ctx, pause).await;
        if ctx.state(|s| s.input.state.status != Status::Running) {
            return Ok(false);
        }
    }
}

/// A batch's successes merged by a worker, then every task's result applied in task order.
async fn merge_batch(
    ctx: &mut WorkflowContext<LoopWorkflow>,
    wf: &'static dyn Workflow,
    lanes: Vec<Lane>,
    git: crate::GitSource,
    base: String,
) -> WorkflowResult<()> {
    let loop_id = ctx.state(|s| s.input.state.loop_id.clone());
    let tasks: Vec<(String, String, String)> = lanes
        .iter()
        .filter(|l| matches!(l.end, Some(AfterAttempt::Finish(Finish::Success(_)))))
        .filter_map(|l| {
            let task = l.dispatch.task_id.clone()?;
            let commit = l.checkpoint.as_ref()?.commit.clone();
            Some((task, format!("{}-merge", l.iteration), commit))
        })
        .collect();
    let report = match tasks.is_empty() {
        true => MergeReport::default(),
        false => {
            let input = MergeInput {
                loop_id,
                git: (git, base),
                tasks: tasks.clone(),
            };
            let options = ActivityOptions::with_start_to_close_timeout(ATTEMPT_LIMIT)
                .heartbeat_timeout(HEARTBEAT_TIMEOUT)
                .retry_policy(
                    temporalio_common::RetryPolicy::builder()
                        .maximum_attempts(ACTIVITY_TRIES)
                        .build(),
                )
                .build();
            match ctx
                .execute_activity(LoopActivities::merge, input, options)
                .await
            {
                Ok(report) => report,
                // Nothing merged: each task is to be developed again.
                Err(e) => MergeReport {
                    merged: Vec::new(),
                    conflicts: tasks
                        .into_iter()
                        .map(|(task, _, _)| {
                            (
                                task,
                                format!("git could not merge it: {}", why(&e)),
                                Vec::new(),
                            )
                        })
                        .collect(),
                },
            }
        }
    };
    if let Some((_, last)) = report.merged.last() {
        let head = last.commit.clone();
        ctx.state_mut(|s| {
            s.input.head = Some(head);
            // The merge was made on no loop's tree: the next attempt goes to any worker.
            s.input.holder = None;
        });
    }
    let mut held = None;
    for lane in lanes {
        let task = lane.dispatch.task_id.clone().unwrap_or_default();
        match lane.end {
            Some(AfterAttempt::Finish(finish @ Finish::Success(_))) => {
                if let Some((_, merge)) = report.merged.iter().find(|(t, _)| *t == task) {
                    let merge = merge.clone();
                    ctx.state_mut(|s| {
                        loopd_core::no_progress::touched(&mut s.input.state, Some(&merge));
                    });
                    finish_action(ctx, wf, &lane.dispatch, finish, None);
                } else {
                    let why = report
                        .conflicts
                        .iter()
                        .find(|(t, _, _)| *t == task)
                        .map_or_else(
                            || "its work tree was not recorded".to_owned(),
                            |(_, why, _)| why.clone(),
                        );
                    let at = format_ts(now(ctx));
                    ctx.state_mut(|s| {
                        let retries = s.input.retry.retries;
                        attempt::merge_failed(
                            wf,
                            &mut s.input.state,
                            &lane.dispatch,
                            lane.iteration,
                            &why,
                            retries,
                            &at,
                        );
                    });
                }
            }
            Some(AfterAttempt::Finish(failed)) => {
                finish_action(ctx, wf, &lane.dispatch, failed, None)
            }
            Some(AfterAttempt::Block(reason)) => {
                held.get_or_insert((lane.dispatch, lane.ran_by, Err(reason)));
            }
            Some(AfterAttempt::Ask(question)) => {
                held.get_or_insert((lane.dispatch, lane.ran_by, Ok(question)));
            }
            _ => {}
        }
        if ctx.state(|s| s.input.state.status != Status::Running) {
            return Ok(());
        }
    }
    let at = format_ts(now(ctx));
    match held {
        Some((dispatch, ran_by, Err(reason))) => ctx.state_mut(|s| {
            let state = &mut s.input.state;
            attempt::block(state, &dispatch, &ran_by, reason, &at);
            state.status = Status::Paused;
        }),
        Some((dispatch, _, Ok(question))) => {
            ctx.state_mut(|s| attempt::ask(wf, &mut s.input.state, &dispatch, question, &at));
        }
        None => {}
    }
    Ok(())
}

/// One attempt as an activity: first on the task queue of the worker that keeps the loop's work
/// tree, if that worker takes it within [`HOLDER_WAIT`] and runs it; else on the loop's own task
/// queue, for any worker. A `retry` goes through the queue, not straight to the worker that ran
/// this workflow task (eager execution), which may be the one whose attempt just failed. Its
/// report, or why no worker could run it, in one line.
async fn attempt(
    ctx: &WorkflowContext<LoopWorkflow>,
    input: AttemptInput,
    holder: Option<Holder>,
    retry: bool,
) -> Result<AttemptReport, String> {
    let options = |tries| {
        ActivityOptions::with_start_to_close_timeout(ATTEMPT_LIMIT)
            .heartbeat_timeout(HEARTBEAT_TIMEOUT)
            .retry_policy(
                temporalio_common::RetryPolicy::builder()
                    .maximum_attempts(tries)
                    .build(),
            )
    };
    if let Some(holder) = holder {
        // Once: a holder that is gone, busy or broken gives the attempt to the others.
        let there = options(1)
            .task_queue(holder.queue)
            .schedule_to_start_timeout(HOLDER_WAIT)
            .build();
        if let Ok(report) = ctx
            .execute_activity(LoopActivities::attempt, input.clone(), there)
            .await
        {
            return Ok(report);
        }
    }
    let anywhere = options(ACTIVITY_TRIES)
        .do_not_eagerly_execute(retry)
        .build();
    ctx.execute_activity(LoopActivities::attempt, input, anywhere)
        .await
        .map_err(|e| why(&e))
}

/// The action is done: the core applies its result and keeps the books; a loop it ends is
/// completed. `files`: without a git remote, the fingerprint of the work tree's files its worker
/// reported.
fn finish_action(
    ctx: &mut WorkflowContext<LoopWorkflow>,
    wf: &'static dyn Workflow,
    dispatch: &Dispatch,
    finish: Finish,
    files: Option<u64>,
) {
    let at = format_ts(now(ctx));
    ctx.state_mut(|s| {
        // The task list, to the actions that take it (as the file driver gives it).
        let listed_tasks = match wf.reads_task_list(&dispatch.action) {
            true => s.input.tasks.clone(),
            false => Vec::new(),
        };
        let inputs = Inputs {
            now: at.clone(),
            listed_tasks,
            // Checkpoints are recorded only where the work tree is on a git remote; in a shared
            // directory, its worker fingerprints its files.
            tree: match (&s.input.git, files) {
                (Some(_), _) => loopd_core::workflow::Tree::Checkpointed,
                (None, Some(files)) => loopd_core::workflow::Tree::Files(files),
                (None, None) => loopd_core::workflow::Tree::Unknown,
            },
        };
        let state = &mut s.input.state;
        if let Some(LoopEnd::Completed(_)) = attempt::finish(wf, state, dispatch, &finish, &inputs)
            && state.status == Status::Running
        {
            state.status = Status::Completed;
            state.completed_at = Some(at.clone());
        }
    });
}

/// Waits `wait` on a durable timer, or less if a person pauses or stops the loop meanwhile: a
/// stop takes effect at once, even during a long rate-limit wait.
async fn sleep_unless_controlled(ctx: &mut WorkflowContext<LoopWorkflow>, wait: Duration) {
    let timer = ctx.timer(wait);
    let controlled = ctx.wait_condition(|s| s.input.state.status != Status::Running);
    futures::pin_mut!(timer);
    futures::pin_mut!(controlled);
    let _ = futures::future::select(timer, controlled).await;
}
