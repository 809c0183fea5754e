//! A loop as a Temporal workflow: the selections of the file driver's daemon, with the state in
//! the workflow and every decision from the core.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};
use loopd_core::attempt::{self, AfterAttempt, Attempts, Verdict};
use loopd_core::state::{LoopState, Status, format_ts};
use loopd_core::workflow::{self, Decision, Dispatch, Finish, Inputs, LoopEnd, Workflow};
use serde_json::{Value, json};
use temporalio_macros::{workflow, workflow_methods};
use temporalio_sdk::{
    ActivityOptions, ContinueAsNewOptions, SyncWorkflowContext, WorkflowContext,
    WorkflowContextView, WorkflowResult,
};

use crate::activity::{AttemptInput, AttemptReport, LoopActivities};
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
            let (wf, limits) = (workflow_of(&state), ctx.state(|s| s.input.limits));
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
                Decision::Run(dispatch) => run_action(ctx, wf, dispatch).await?,
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

/// The workflow a loop runs.
pub fn workflow_of(state: &LoopState) -> &'static dyn Workflow {
    let name = state
        .skill_state
        .as_ref()
        .and_then(|s| s.workflow.as_deref())
        .unwrap_or(workflow::DEFAULT);
    workflow::by_name(name).unwrap_or(&workflow::ccw_loop::CcwLoop)
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
