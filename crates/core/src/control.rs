//! What a person may change of a loop while it lives, whichever driver holds it: its status
//! (pause, resume, stop), the next action of an interactive loop, one more task, the answer to an
//! executor's question.
//!
//! Each rule decides from the loop's state and says in one line why it refuses; the driver writes
//! the change its own way: the file driver only the fields named here, under the loop's lock (so
//! a field this version does not know survives), the Temporal workflow into the state it holds.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::state::{LoopState, MAX_DESCRIPTION, Mode, Question, Status};
use crate::workflow::{self, Decision, Limits, Workflow};

/// A status change a person asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    Pause,
    Resume,
    Stop,
}

/// What `stop` leaves as the loop's failure reason, as the CCW dashboard writes it.
pub const STOPPED_BY_USER: &str = "Manually stopped by user";

impl Control {
    /// The command that asks for it: `pause`, `resume`, `stop`.
    pub fn verb(self) -> &'static str {
        match self {
            Control::Pause => "pause",
            Control::Resume => "resume",
            Control::Stop => "stop",
        }
    }

    /// The status it writes (`stop` = `failed`, as the CCW dashboard writes it).
    pub fn target(self) -> Status {
        match self {
            Control::Pause => Status::Paused,
            Control::Resume => Status::Running,
            Control::Stop => Status::Failed,
        }
    }

    /// The statuses it changes; a loop that became one of the others meanwhile is left alone.
    pub fn allowed(self) -> &'static [Status] {
        match self {
            Control::Pause => &[Status::Running, Status::Created],
            Control::Resume => &[
                Status::Paused,
                Status::Failed,
                Status::UserExit,
                Status::Created,
            ],
            Control::Stop => &[Status::Running, Status::Paused, Status::Created],
        }
    }

    /// Whether it makes sense for loop `id` in `state`: `Ok(false)` when the loop has that
    /// status already, `Ok(true)` when it changes it, and otherwise why not (a completed loop
    /// paused, a loop at its error limit resumed), in one line.
    pub fn check(self, state: &LoopState, id: &str, limits: Limits) -> Result<bool, String> {
        let status = &state.status;
        let resume = self == Control::Resume;
        if *status == self.target() && !resume {
            return Ok(false);
        }
        let outcome = state
            .skill_state
            .as_ref()
            .and_then(|s| s.outcome.as_deref());
        if *status == Status::Completed {
            // A loop completed without meeting its goal goes on once there is room: a raised
            // iteration limit, or tasks added to one that had nothing left to try.
            let room = match outcome {
                Some("iteration_limit") => {
                    state.current_iteration < state.max_iterations_or(limits.max_iterations)
                }
                Some("incomplete") => true,
                _ => false,
            };
            if resume && room {
                return Ok(true);
            }
            let hint = match (self, outcome) {
                (Control::Resume, Some("iteration_limit")) => format!(
                    "; to go on, raise its limit with `loopd set {id} --max-iterations N`, then \
                     resume"
                ),
                _ => String::new(),
            };
            return Err(format!(
                "cannot {} loop {id}: it is {}{hint}",
                self.verb(),
                state.standing()
            ));
        }
        if !resume && !self.allowed().contains(status) {
            return Err(format!(
                "cannot {} loop {id}: it is {}",
                self.verb(),
                state.standing()
            ));
        }
        // A loop failed at its error limit would fail again at once.
        let errors = state.skill_state.as_ref().map_or(0, |s| s.error_count);
        let max_errors = state.max_errors_or(limits.max_errors);
        if resume && *status == Status::Failed && errors >= max_errors {
            return Err(format!(
                "cannot resume loop {id}: it failed at its error limit ({errors} of {max_errors}) \
                 and would fail again at once; `loopd retry {id}` resets the count, or raise the \
                 limit with `loopd set {id} --max-errors N`"
            ));
        }
        Ok(true)
    }

    /// Writes the change into a loop's state.
    pub fn apply(self, state: &mut LoopState) {
        state.status = self.target();
        match self {
            Control::Stop => state.failure_reason = Some(STOPPED_BY_USER.into()),
            Control::Resume => {
                state.failure_reason = None;
                state.completed_at = None;
            }
            Control::Pause => {}
        }
    }

    /// Writes the same change as [`Control::apply`] into the state file's fields, only those it
    /// changes.
    pub fn apply_raw(self, raw: &mut Map<String, Value>) {
        raw.insert("status".into(), json!(self.target().as_str()));
        match self {
            Control::Stop => {
                raw.insert("failure_reason".into(), json!(STOPPED_BY_USER));
            }
            Control::Resume => {
                raw.remove("failure_reason");
                raw.remove("completed_at");
            }
            Control::Pause => {}
        }
    }
}

/// One more task, as `task add` asks for it: its text, the tasks it needs done first, the
/// executors that each try it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "NewTaskAsSaid")]
pub struct NewTask {
    pub text: String,
    /// The tasks it needs done first; `None` when a change does not say (its text alone, as
    /// loopd said it before `--after`), which keeps the task list's order.
    pub after: Option<Vec<String>>,
    pub race: Vec<String>,
}

impl NewTask {
    /// A task as `task add` says it: needing the tasks `after` names (none: nothing), tried by
    /// each executor of `race` (none: the loop's).
    pub fn new(text: impl Into<String>, after: &[String], race: &[String]) -> NewTask {
        NewTask {
            text: text.into(),
            after: Some(after.to_vec()),
            race: race.to_vec(),
        }
    }
}

/// A [`NewTask`] as a change said it: its text alone (loops on Temporal keep such changes in
/// their histories, which every later build replays), or whole.
#[derive(Deserialize)]
#[serde(untagged)]
enum NewTaskAsSaid {
    Text(String),
    Whole {
        text: String,
        after: Option<Vec<String>>,
        #[serde(default)]
        race: Vec<String>,
    },
}

impl From<NewTaskAsSaid> for NewTask {
    fn from(said: NewTaskAsSaid) -> NewTask {
        match said {
            NewTaskAsSaid::Text(text) => NewTask {
                text,
                after: None,
                race: Vec::new(),
            },
            NewTaskAsSaid::Whole { text, after, race } => NewTask { text, after, race },
        }
    }
}

/// Checks that each task `after` names is one of loop `id`'s (`known`).
pub fn check_after(id: &str, after: &[String], known: impl Fn(&str) -> bool) -> Result<(), String> {
    match after.iter().find(|t| !known(t)) {
        Some(unknown) => Err(format!("--after {unknown}: loop {id} has no such task")),
        None => Ok(()),
    }
}

/// Checks that a race has at least two executors, or none.
pub fn check_race_size(race: &[String]) -> Result<(), String> {
    match race.len() {
        1 => Err("a race needs at least two executors, or none".into()),
        _ => Ok(()),
    }
}

/// One change, as a command asks for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Change {
    Control(Control),
    /// The next action of an interactive loop.
    Next(String),
    /// One more task for the loop's task list.
    Task(NewTask),
    /// The answer to the question an executor asked.
    Answer(String),
    Set(SetLimits),
}

impl std::fmt::Display for Change {
    /// The change as the command that asked for it reads: `stop`, `answer: TEXT`, ...
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::Control(what) => f.write_str(what.verb()),
            Change::Next(action) => write!(f, "next: {action}"),
            Change::Task(task) => {
                write!(f, "task add: {}", task.text)?;
                match task.after.as_deref() {
                    Some([]) | None => Ok(()),
                    Some(after) => write!(f, " (after {})", after.join(", ")),
                }
            }
            Change::Answer(text) => write!(f, "answer: {text}"),
            Change::Set(set) => {
                let limits = [
                    ("max_iterations", set.max_iterations.map(|n| n.to_string())),
                    ("max_errors", set.max_errors.map(|n| n.to_string())),
                    ("max_cost_usd", set.max_cost_usd.map(|n| n.to_string())),
                    ("max_tokens", set.max_tokens.map(|n| n.to_string())),
                    ("parallel", set.parallel.map(|n| n.to_string())),
                ];
                let said: Vec<String> = limits
                    .into_iter()
                    .filter_map(|(key, value)| Some(format!("{key} = {}", value?)))
                    .collect();
                write!(f, "set: {}", said.join(", "))
            }
        }
    }
}

/// New limits and budgets for a loop; those left `None` stay as they are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SetLimits {
    pub max_iterations: Option<u64>,
    pub max_errors: Option<u64>,
    pub max_cost_usd: Option<f64>,
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub parallel: Option<u64>,
}

/// Whether `action` may be chosen as the next action of loop `id`: an interactive loop only, an
/// action of its workflow that the workflow would run now.
pub fn check_next(
    wf: &dyn Workflow,
    state: &LoopState,
    id: &str,
    action: &str,
    limits: Limits,
) -> Result<(), String> {
    if state.mode() != Mode::Interactive {
        return Err(format!(
            "loop {id} is in auto mode; it chooses its own actions"
        ));
    }
    if !wf.actions().contains(&action) {
        return Err(format!(
            "invalid action {action:?}; valid choices: {}",
            wf.actions().join(", ")
        ));
    }
    let mut chosen = state.clone();
    chosen.next_action = Some(action.to_owned());
    match workflow::decide(wf, &chosen, limits) {
        Decision::Wait {
            refused: Some(why), ..
        } => Err(format!("cannot choose {why}")),
        _ => Ok(()),
    }
}

/// Whether a task may be added to loop `id`; returns the task's text, trimmed. A loop that met
/// its goal is done; one that stopped short can be resumed with more work.
pub fn check_task<'t>(state: &LoopState, id: &str, text: &'t str) -> Result<&'t str, String> {
    let passed = state.status == Status::Completed
        && !matches!(
            state
                .skill_state
                .as_ref()
                .and_then(|s| s.outcome.as_deref()),
            Some("iteration_limit" | "incomplete")
        );
    if passed {
        return Err(format!(
            "loop {id} has met its goal; a new task would never run (create a new loop)"
        ));
    }
    let text = text.trim();
    check_text("task", text)?;
    Ok(text)
}

/// The question loop `id` waits to have answered, if `text` may answer it.
pub fn check_answer(state: &LoopState, id: &str, text: &str) -> Result<Question, String> {
    let Some(question) = waiting_question(state) else {
        return Err(format!("loop {id} is waiting for no answer"));
    };
    check_text("answer", text.trim())?;
    Ok(question)
}

/// The question an executor of the loop asked that has no answer yet.
pub fn waiting_question(state: &LoopState) -> Option<Question> {
    state
        .skill_state
        .as_ref()
        .and_then(|k| k.question.clone())
        .filter(Question::waiting)
}

/// Writes `text` as the answer to the waiting question, at `at`.
pub fn apply_answer(state: &mut LoopState, text: &str, at: &str) {
    if let Some(q) = state.skill_state.as_mut().and_then(|s| s.question.as_mut()) {
        q.answer = Some(text.to_owned());
        q.answered_at = Some(at.to_owned());
    }
}

/// Writes the same answer as [`apply_answer`] into the state file's fields.
pub fn apply_answer_raw(raw: &mut Map<String, Value>, text: &str, at: &str) {
    if let Some(Value::Object(q)) = raw
        .get_mut("skill_state")
        .and_then(|s| s.get_mut("question"))
    {
        q.insert("answer".into(), json!(text));
        q.insert("answered_at".into(), json!(at));
    }
}

/// A person's text (a task, an answer): not empty, not over [`MAX_DESCRIPTION`].
fn check_text(what: &str, text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err(format!("the {what} is empty"));
    }
    if text.len() > MAX_DESCRIPTION {
        return Err(format!(
            "the {what} is {} bytes, over the limit of {MAX_DESCRIPTION}",
            text.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::SkillState;

    #[test]
    fn a_task_change_said_by_its_text_alone_keeps_the_lists_order_and_a_whole_one_says_its_needs() {
        // As the histories of loops on Temporal keep it from before `--after`.
        let old: Change = serde_json::from_str(r#"{"Task":"a third"}"#).unwrap();
        let Change::Task(old) = old else {
            panic!("a task change")
        };
        assert_eq!((old.text.as_str(), old.after), ("a third", None));
        let new = Change::Task(NewTask::new(
            "a fourth",
            &["task-001".into(), "task-003".into()],
            &[],
        ));
        let said = serde_json::to_string(&new).unwrap();
        assert_eq!(serde_json::from_str::<Change>(&said).unwrap(), new);
        assert_eq!(
            new.to_string(),
            "task add: a fourth (after task-001, task-003)"
        );
        assert_eq!(
            Change::Task(NewTask::new("x", &[], &[])).to_string(),
            "task add: x"
        );
        let known = |t: &str| t == "task-001";
        assert_eq!(check_after("L", &["task-001".into()], known), Ok(()));
        assert_eq!(
            check_after("L", &["task-001".into(), "task-009".into()], known),
            Err("--after task-009: loop L has no such task".into())
        );
    }

    fn limits() -> Limits {
        Limits {
            max_iterations: 10,
            max_errors: 3,
            ..Limits::default()
        }
    }

    fn with(status: Status) -> LoopState {
        LoopState {
            status,
            skill_state: Some(SkillState::default()),
            ..LoopState::default()
        }
    }

    #[test]
    fn stop_writes_what_the_ccw_dashboard_writes() {
        let mut state = with(Status::Running);
        assert_eq!(Control::Stop.check(&state, "L", limits()), Ok(true));
        Control::Stop.apply(&mut state);
        assert_eq!(state.status, Status::Failed);
        assert_eq!(state.failure_reason.as_deref(), Some(STOPPED_BY_USER));
        let mut raw = Map::new();
        Control::Stop.apply_raw(&mut raw);
        assert_eq!(raw["status"], "failed");
        assert_eq!(raw["failure_reason"], STOPPED_BY_USER);
    }

    #[test]
    fn a_change_already_made_changes_nothing() {
        let state = with(Status::Paused);
        assert_eq!(Control::Pause.check(&state, "L", limits()), Ok(false));
    }

    #[test]
    fn a_passed_loop_is_neither_paused_nor_resumed() {
        let state = with(Status::Completed);
        for what in [Control::Pause, Control::Resume, Control::Stop] {
            let refused = what.check(&state, "L", limits()).unwrap_err();
            assert!(refused.contains("it is passed"), "{refused}");
        }
    }

    #[test]
    fn a_loop_at_its_iteration_limit_resumes_once_the_limit_is_raised() {
        let mut state = with(Status::Completed);
        state.skill().outcome = Some("iteration_limit".into());
        state.current_iteration = 10;
        let refused = Control::Resume.check(&state, "L", limits()).unwrap_err();
        assert!(
            refused.contains("loopd set L --max-iterations N"),
            "{refused}"
        );
        state.max_iterations = Some(12);
        assert_eq!(Control::Resume.check(&state, "L", limits()), Ok(true));
        Control::Resume.apply(&mut state);
        assert_eq!(state.status, Status::Running);
        assert_eq!(state.completed_at, None);
    }

    #[test]
    fn a_loop_failed_at_its_error_limit_is_not_resumed() {
        let mut state = with(Status::Failed);
        state.skill().error_count = 3;
        let refused = Control::Resume.check(&state, "L", limits()).unwrap_err();
        assert!(refused.contains("error limit (3 of 3)"), "{refused}");
        state.skill().error_count = 2;
        assert_eq!(Control::Resume.check(&state, "L", limits()), Ok(true));
    }

    #[test]
    fn an_answer_needs_a_question_and_words() {
        let mut state = with(Status::Running);
        assert!(check_answer(&state, "L", "yes").is_err());
        state.skill().question = Some(Question {
            action: "develop".into(),
            text: "which?".into(),
            ..Question::default()
        });
        assert_eq!(
            check_answer(&state, "L", "  ").unwrap_err(),
            "the answer is empty"
        );
        assert_eq!(check_answer(&state, "L", "yes").unwrap().text, "which?");
        apply_answer(&mut state, "yes", "T");
        assert!(waiting_question(&state).is_none());
    }

    #[test]
    fn a_task_is_refused_to_a_loop_that_met_its_goal() {
        let state = with(Status::Completed);
        assert!(check_task(&state, "L", "more").is_err());
        let state = with(Status::Paused);
        assert_eq!(check_task(&state, "L", " more ").unwrap(), "more");
    }
}
