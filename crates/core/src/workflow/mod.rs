//! Workflows: what to do next, and what a result does to the state. Pure functions of the state,
//! no I/O.
//!
//! A workflow says when its goal is met ([`Workflow::goal_met`]), selects ([`Workflow::select`])
//! and applies action-specific results ([`Workflow::apply`]). What every workflow shares — the
//! termination checks, interactive choices, questions, the error windows, the action history,
//! the iteration count — lives here ([`check`], [`decide`], [`record_attempt`],
//! [`record_finish`]), so the orchestrator knows no workflow's rules and a workflow knows no
//! bookkeeping.

pub mod ccw_loop;
pub mod skill_tuning;

use serde_json::Value;

use crate::protocol::ActionResult;
use crate::state::ListedTask;
use crate::state::{
    ACTION_HISTORY_WINDOW, COMPLETED_ACTIONS_WINDOW, ERRORS_WINDOW, ErrorEntry, Finished,
    HistoryEntry, LoopState, Mode, SkillState, trim_window,
};

/// Why a loop completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The workflow's goal was met.
    Passed,
    /// `max_iterations` was reached first.
    IterationLimit,
    /// Nothing is left to do, but the goal was not met.
    Incomplete,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Passed => "passed",
            Outcome::IterationLimit => "iteration_limit",
            Outcome::Incomplete => "incomplete",
        }
    }

    pub fn parse(s: &str) -> Option<Outcome> {
        match s {
            "passed" => Some(Outcome::Passed),
            "iteration_limit" => Some(Outcome::IterationLimit),
            "incomplete" => Some(Outcome::Incomplete),
            _ => None,
        }
    }
}

/// One action to run.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Dispatch {
    pub action: String,
    pub task_id: Option<String>,
    /// Set for the final action: why the loop completes.
    pub outcome: Option<Outcome>,
}

impl Dispatch {
    pub fn new(action: &str) -> Dispatch {
        Dispatch {
            action: action.to_owned(),
            task_id: None,
            outcome: None,
        }
    }

    /// The final action, `complete`, with why the loop completes.
    pub fn complete(outcome: Outcome) -> Dispatch {
        Dispatch {
            outcome: Some(outcome),
            ..Dispatch::new("complete")
        }
    }

    /// `complete` now, when nothing is left to do: `passed` if the goal is met.
    pub fn complete_if_done(goal_met: bool) -> Dispatch {
        Dispatch::complete(if goal_met {
            Outcome::Passed
        } else {
            Outcome::Incomplete
        })
    }
}

/// What the loop does next.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    Run(Dispatch),
    /// Fail the loop with this reason.
    Abort(String),
    /// An executor asked a question (`skill_state.question`): wait for the answer.
    AwaitAnswer,
    /// The loop made no progress for the rounds its rule allows: pause it with this reason
    /// ([`crate::no_progress::pause`]).
    Pause(String),
    /// Interactive mode: wait for a controller to choose one of `choices`.
    Wait {
        choices: Vec<String>,
        suggested: Option<String>,
        /// A choice was written that is not one of `choices`.
        refused: Option<String>,
    },
}

/// Defaults for limits a loop's state does not set.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    pub max_iterations: u64,
    pub max_errors: u64,
    pub max_cost_usd: Option<f64>,
    pub max_tokens: Option<u64>,
    /// What a loop that makes no progress does (absent from older histories: off).
    #[serde(default)]
    pub no_progress: crate::no_progress::Rule,
}

impl Limits {
    /// What the loop may still spend: `(tokens, dollars)`, each `None` without a budget.
    pub fn remaining(&self, state: &LoopState) -> (Option<u64>, Option<f64>) {
        let spent = state.skill_state.as_ref().map(|s| &s.usage);
        let tokens = state.max_tokens.or(self.max_tokens);
        let cost = state.max_cost_usd.or(self.max_cost_usd);
        (
            tokens.map(|t| t.saturating_sub(spent.map_or(0, |u| u.tokens()))),
            cost.map(|c| (c - spent.map_or(0.0, |u| u.cost_usd)).max(0.0)),
        )
    }

    /// Why the loop's budget is spent, if it is.
    pub fn budget_spent(&self, state: &LoopState) -> Option<String> {
        let spent = state
            .skill_state
            .as_ref()
            .map(|s| s.usage.clone())
            .unwrap_or_default();
        if let Some(max) = state.max_cost_usd.or(self.max_cost_usd)
            && spent.cost_usd >= max
        {
            return Some(format!(
                "budget exceeded: ${:.4} spent, max_cost_usd is ${max}",
                spent.cost_usd
            ));
        }
        if let Some(max) = state.max_tokens.or(self.max_tokens)
            && spent.tokens() >= max
        {
            return Some(format!(
                "budget exceeded: {} tokens spent, max_tokens is {max}",
                spent.tokens()
            ));
        }
        None
    }
}

/// How an action ended, after its retries.
#[derive(Clone, Debug)]
pub enum Finish {
    Success(ActionResult),
    Failed(String),
}

impl Finish {
    /// The result of a success.
    pub fn result(&self) -> Option<&ActionResult> {
        match self {
            Finish::Success(result) => Some(result),
            Finish::Failed(_) => None,
        }
    }
}

/// What applying a result did to the loop as a whole.
#[derive(Clone, Debug, PartialEq)]
pub enum LoopEnd {
    Completed(Outcome),
}

/// The facts a workflow needs from outside when applying a result.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    pub now: String,
    /// Tasks from the task list file, in order.
    pub listed_tasks: Vec<ListedTask>,
    /// What is known of the work tree after the action: whether a round changed a file.
    pub tree: Tree,
}

pub use crate::no_progress::Tree;

/// A line of `status`: a label, a value, and lines under it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Row {
    pub label: &'static str,
    pub value: String,
    pub lines: Vec<String>,
}

/// What a workflow shows of its own fields, for `status`, `list` and the API.
#[derive(Clone, Debug, PartialEq)]
pub struct View {
    /// One short measure of progress (`list`'s PROGRESS column): `2/3` tasks, a gate.
    pub progress: String,
    pub rows: Vec<Row>,
}

/// Text a finished action adds to a progress file of `{id}.progress/`.
#[derive(Clone, Debug, PartialEq)]
pub struct Note {
    pub file: &'static str,
    pub text: String,
    /// The file is replaced with `text`, not appended to.
    pub replace: bool,
}

impl Note {
    pub fn append(file: &'static str, text: String) -> Note {
        Note {
            file,
            text,
            replace: false,
        }
    }

    pub fn replace(file: &'static str, text: String) -> Note {
        Note {
            file,
            text,
            replace: true,
        }
    }
}

/// A workflow: its rules, its result validation, and what it shows of its own fields. No I/O:
/// the engine reads and writes the files, runs the actions, and keeps the books.
pub trait Workflow: Send + Sync {
    fn name(&self) -> &'static str;
    /// Every action this workflow can run (the choices of interactive mode).
    fn actions(&self) -> &'static [&'static str];
    /// Whether finishing `action` consumes an iteration.
    fn counts_iteration(&self, action: &str) -> bool;
    /// Whether `action` changes the work tree: a git checkpoint is recorded after it.
    fn changes_work_tree(&self, action: &str) -> bool;
    /// The pass rate (percent) of the validation `action` just recorded, when it is one: a drop
    /// is a regression (`rollback_on_regression`).
    fn pass_rate(&self, _state: &LoopState, _action: &str) -> Option<f64> {
        None
    }
    /// The last validation's outcome in a few words, once there was one: a round that leaves it
    /// as it was made no progress there ([`crate::no_progress`]).
    fn validation(&self, _state: &LoopState) -> Option<String> {
        None
    }
    /// What a round of `action` did in a few words, for a person reading why a loop made no
    /// progress (`debug proposed 'fix the off by one'`, `validation failed t_broken`), when the
    /// workflow says more than "changed no file". `state` is after the action's result was
    /// applied.
    fn round_note(&self, _state: &LoopState, _action: &str, _finish: &Finish) -> Option<String> {
        None
    }
    /// The ids of the tasks done so far.
    fn done_tasks(&self, _state: &LoopState) -> Vec<String> {
        Vec::new()
    }
    /// After the work tree was rolled back: the tasks done since (not in `kept`) are to be done
    /// again, and `note` says why in the next prompts. Returns their ids.
    fn redo_after_rollback(
        &self,
        _state: &mut LoopState,
        _kept: &[String],
        _note: &str,
    ) -> Vec<String> {
        Vec::new()
    }
    /// `(max_iterations, max_errors)` of a new loop where `create` gives none, if the workflow
    /// has its own.
    fn default_limits(&self) -> Option<(u64, u64)> {
        None
    }
    /// Whether the loop's goal is met: the last of the termination checks ([`check`]).
    fn goal_met(&self, state: &LoopState) -> bool;
    /// The next action in auto mode.
    fn select(&self, state: &LoopState) -> Dispatch;
    /// Tasks that may be developed at once after `first` (the dispatch [`Workflow::select`]
    /// chose): those whose needs are met, in order, `first` among them, at most `max`. Empty
    /// when `first` is no such task or the workflow has none.
    fn batch(&self, _state: &LoopState, _first: &Dispatch, _max: usize) -> Vec<Dispatch> {
        Vec::new()
    }
    /// The executors that each try `dispatch`'s task: the task's own, else `loop_race` (the
    /// loop's or the config's) where the workflow races its tasks; empty: none do.
    fn racers(
        &self,
        _state: &LoopState,
        _dispatch: &Dispatch,
        _loop_race: &[String],
    ) -> Vec<String> {
        Vec::new()
    }
    /// The action that checks a tree (a race's entries are compared by its pass rate), if the
    /// workflow has one.
    fn check_action(&self) -> Option<&'static str> {
        None
    }
    /// A task's result could not be merged into the loop's tree: it is to be done again, `why`
    /// in its next prompt. Failed instead when `fail` (its merges have no retry left).
    fn merge_failed(&self, _state: &mut LoopState, _task_id: &str, _why: &str, _fail: bool) {}
    /// The dispatch for an action a controller chose in interactive mode, or why it cannot run
    /// now.
    fn choose(&self, state: &LoopState, action: &str) -> Result<Dispatch, String>;
    /// Marks the state as the action starts (a develop task becomes `in_progress`).
    fn begin(&self, state: &mut LoopState, dispatch: &Dispatch, now: &str);
    /// Marks the state as an action asks a person (`needs_input`); the action runs again once
    /// answered.
    fn asked(&self, _state: &mut LoopState, _dispatch: &Dispatch) {}
    /// Checks an action's `state_updates` before anything is applied.
    fn validate(&self, action: &str, result: &ActionResult) -> Result<(), String>;
    /// Applies the action's final outcome to the state.
    fn apply(
        &self,
        state: &mut LoopState,
        dispatch: &Dispatch,
        finish: &Finish,
        inputs: &Inputs,
    ) -> Option<LoopEnd>;
    /// Whether applying `action` takes the tasks of the task list file ([`Inputs::listed_tasks`]).
    fn reads_task_list(&self, _action: &str) -> bool {
        false
    }
    /// Adds tasks listed after the loop started as `pending`; returns how many joined.
    fn absorb_tasks(&self, state: &mut LoopState, listed: &[ListedTask], now: &str) -> usize;
    /// Writes the workflow's own fields of a new loop, or fills in those a state lacks.
    fn init_part(&self, skill: &mut SkillState);
    /// Rebuilds the workflow's fields of a state whose `skill_state` was lost (the seed's "State
    /// Recovery"), from the task list and the progress files (`read` gives one's text), `now`
    /// being the time of the rebuild; why it cannot, if it cannot.
    fn rebuild(
        &self,
        skill: &mut SkillState,
        listed: Vec<ListedTask>,
        read: &dyn Fn(&str) -> Option<String>,
        now: &str,
    ) -> Result<(), String>;
    /// What makes the workflow's own fields unusable, one line each.
    fn problems(&self, skill: &SkillState) -> Vec<String>;
    /// The task a dispatch works on, `(id, description)`: the executor gets it as
    /// `LOOPD_TASK_ID` and `LOOPD_TASK`, the prompt as `{{task_id}}` and `{{task_description}}`.
    fn task(&self, state: &LoopState, dispatch: &Dispatch) -> Option<(String, String)>;
    /// The values of the workflow's own prompt placeholders.
    fn prompt_vars(&self, state: &LoopState, dispatch: &Dispatch) -> Vec<(&'static str, String)>;
    /// What `status` and `list` show of the workflow's own fields.
    fn view(&self, state: &LoopState) -> View;
    /// What a finished action adds to the progress files.
    fn notes(
        &self,
        state: &LoopState,
        dispatch: &Dispatch,
        finish: &Finish,
        now: &str,
    ) -> Vec<Note>;
    /// At completion: the summary for the `completed` event, and the workflow's sections of
    /// `summary.md`.
    fn report(&self, state: &LoopState) -> (Option<String>, String);
    /// `loopd retry`: failed work is pending again; returns how much.
    fn reset_failed(&self, skill: &mut SkillState) -> usize;
    /// The ids of the tasks the loop knows, that a new task must not have.
    fn task_ids(&self, skill: &SkillState) -> Vec<String>;
}

/// What makes a loop's state unusable: the file's own problems, and its workflow's.
pub fn problems(state: &LoopState, file_id: Option<&str>) -> Vec<String> {
    let mut problems = state.problems(file_id);
    if let Some(skill) = &state.skill_state
        && let Some(workflow) = by_name(skill.workflow.as_deref().unwrap_or(DEFAULT))
    {
        problems.extend(workflow.problems(skill));
    }
    problems
}

/// Every workflow loopd knows.
pub fn all() -> impl Iterator<Item = &'static dyn Workflow> {
    WORKFLOWS.iter().filter_map(|name| by_name(name))
}

/// The workflow called `name`.
pub fn by_name(name: &str) -> Option<&'static dyn Workflow> {
    match name {
        ccw_loop::NAME => Some(&ccw_loop::CcwLoop),
        skill_tuning::NAME => Some(&skill_tuning::SkillTuning),
        _ => None,
    }
}

/// The workflow loop `state` runs: the one its state names, else (it names none, or one loopd
/// does not know) ccw-loop.
pub fn of(state: &LoopState) -> &'static dyn Workflow {
    let name = state
        .skill_state
        .as_ref()
        .and_then(|s| s.workflow.as_deref())
        .unwrap_or(DEFAULT);
    by_name(name).unwrap_or(&ccw_loop::CcwLoop)
}

/// The workflow of a loop whose state names none: CCW's loops are all ccw-loop.
pub const DEFAULT: &str = ccw_loop::NAME;

/// The names [`by_name`] knows.
pub const WORKFLOWS: &[&str] = &[ccw_loop::NAME, skill_tuning::NAME];

/// The termination checks after the status check, the same for every workflow (the seeds'
/// order): the error limit fails the loop; the iteration limit completes it (`passed` if the
/// goal was met on that last iteration); a goal met completes it; then loopd's: rounds without
/// progress pause (or fail) it. `None`: go on to selection.
pub fn check(workflow: &dyn Workflow, state: &LoopState, limits: Limits) -> Option<Decision> {
    let skill = state.skill_state.as_ref();
    let max_errors = state.max_errors_or(limits.max_errors);
    if skill.map_or(0, |s| s.error_count) >= max_errors {
        let last = skill
            .and_then(|s| s.errors.last())
            .map(|e| format!("; last error: {}: {}", e.action, e.message))
            .unwrap_or_default();
        return Some(Decision::Abort(format!(
            "max_errors ({max_errors}) reached{last}"
        )));
    }
    let goal_met = workflow.goal_met(state);
    if state.current_iteration >= state.max_iterations_or(limits.max_iterations) {
        let outcome = if goal_met {
            Outcome::Passed
        } else {
            Outcome::IterationLimit
        };
        return Some(Decision::Run(Dispatch::complete(outcome)));
    }
    if goal_met {
        return Some(Decision::Run(Dispatch::complete(Outcome::Passed)));
    }
    let reason = crate::no_progress::check(state, limits.no_progress)?;
    Some(match limits.no_progress.then {
        crate::no_progress::Then::Pause => Decision::Pause(reason),
        crate::no_progress::Then::Fail => Decision::Abort(reason),
    })
}

/// Termination checks, then selection: auto mode selects, interactive mode waits for a choice.
pub fn decide(workflow: &dyn Workflow, state: &LoopState, limits: Limits) -> Decision {
    if let Some(reason) = limits.budget_spent(state) {
        return Decision::Abort(reason);
    }
    if let Some(decision) = check(workflow, state, limits) {
        return decision;
    }
    let skill = state.skill_state.as_ref();
    if skill
        .and_then(|s| s.question.as_ref())
        .is_some_and(|q| q.waiting())
    {
        return Decision::AwaitAnswer;
    }
    if state.mode() == Mode::Auto {
        return Decision::Run(workflow.select(state));
    }
    let choices: Vec<String> = workflow.actions().iter().map(|a| (*a).to_owned()).collect();
    let refused = match &state.next_action {
        Some(choice) if choices.contains(choice) => match workflow.choose(state, choice) {
            Ok(dispatch) => return Decision::Run(dispatch),
            Err(why) => Some(format!("{choice} ({why})")),
        },
        other => other.clone(),
    };
    Decision::Wait {
        suggested: Some(workflow.select(state).action),
        refused,
        choices,
    }
}

/// Records one attempt in the action history (bounded).
pub fn record_attempt(state: &mut LoopState, entry: HistoryEntry) {
    let skill = state.skill();
    skill.action_history.push(entry);
    trim_window(&mut skill.action_history, ACTION_HISTORY_WINDOW);
}

/// The bookkeeping every finished action gets: last/completed actions, the finish clock, the
/// iteration count, and on failure the error count and window.
pub fn record_finish(
    workflow: &dyn Workflow,
    state: &mut LoopState,
    dispatch: &Dispatch,
    finish: &Finish,
    now: &str,
) {
    if workflow.counts_iteration(&dispatch.action) {
        state.current_iteration = state.current_iteration.saturating_add(1);
    }
    // A validation's pass rate goes with its attempt, for the loop's history over time.
    if let (Finish::Success(_), Some(rate)) = (finish, workflow.pass_rate(state, &dispatch.action))
        && let Some(last) = state.skill().action_history.last_mut()
        && last.action == dispatch.action
    {
        last.pass_rate = Some(rate);
    }
    let skill = &mut state.skill().book;
    skill.seq = skill.seq.saturating_add(1);
    let ok = matches!(finish, Finish::Success(_));
    skill
        .finished
        .insert(dispatch.action.clone(), Finished { seq: skill.seq, ok });
    skill.current_action = None;
    skill.last_action = Some(dispatch.action.clone());
    skill.completed_actions.push(dispatch.action.clone());
    // An answered question was given to this action's prompt.
    if skill.question.as_ref().is_some_and(|q| !q.waiting()) {
        skill.question = None;
    }
    trim_window(&mut skill.completed_actions, COMPLETED_ACTIONS_WINDOW);
    if let Finish::Failed(message) = finish {
        skill.error_count = skill.error_count.saturating_add(1);
        skill.errors.push(ErrorEntry {
            action: dispatch.action.clone(),
            message: message.clone(),
            timestamp: now.to_owned(),
            extra: Default::default(),
        });
        trim_window(&mut skill.errors, ERRORS_WINDOW);
    }
}

/// `state_updates[key]` as an optional string; an error if present with another type.
pub(crate) fn opt_str<'a>(
    updates: &'a serde_json::Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, String> {
    match updates.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(format!("state_updates.{key} must be a string, not {other}")),
    }
}

/// The no-progress books' record of an action that finished ([`crate::no_progress::round`]),
/// when it ends a round (it counts an iteration). `tree`: what is known of the work tree now.
pub fn round(
    workflow: &dyn Workflow,
    state: &mut LoopState,
    action: &str,
    finish: &Finish,
    tree: Tree,
) {
    if !workflow.counts_iteration(action) {
        return;
    }
    let round = crate::no_progress::Round {
        progress: workflow.view(state).progress,
        validation: workflow.validation(state),
        note: round_note(workflow, state, action, finish, tree),
        failed: match finish {
            Finish::Failed(message) => Some(message),
            Finish::Success(_) => None,
        },
        tree,
    };
    crate::no_progress::round(state, round);
}

/// What a round did, in a few words: the workflow's note, else what it changed.
fn round_note(
    workflow: &dyn Workflow,
    state: &LoopState,
    action: &str,
    finish: &Finish,
    tree: Tree,
) -> String {
    if let Finish::Failed(message) = finish {
        return format!(
            "{action} failed: {}",
            crate::no_progress::signature(message)
        );
    }
    if let Some(note) = workflow.round_note(state, action, finish) {
        return note;
    }
    match (workflow.changes_work_tree(action), tree) {
        (true, Tree::Unknown) => format!("{action} changed nothing loopd could see"),
        (true, _) => format!("{action} changed no file"),
        (false, _) => format!("{action} changed nothing"),
    }
}
