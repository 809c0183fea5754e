//! The loop state of `{id}.json`: the seed's `LoopState`, typed.
//!
//! Every struct below the top level carries an `extra` map flattened into it, so fields this
//! version of loopd does not know survive a read and a write unchanged, at every level. The top
//! level needs none: the store writes back the file's own JSON object with only the daemon's
//! fields replaced, so unknown top-level fields are never touched. The typed view is what the
//! workflow reasons about; which of its fields the daemon may write back is decided by the store,
//! not here.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

/// Fields a struct does not know, kept verbatim.
pub type Extra = Map<String, Value>;

/// How many entries `skill_state.action_history` keeps.
pub const ACTION_HISTORY_WINDOW: usize = 10;
/// How many entries `skill_state.errors` keeps.
pub const ERRORS_WINDOW: usize = 5;
/// How many entries `skill_state.completed_actions` keeps.
pub const COMPLETED_ACTIONS_WINDOW: usize = 20;
/// The longest task description (and loop description), in bytes: the state file stays within
/// its size limit, and `LOOPD_TASK` within the kernel's limit for one variable.
pub const MAX_DESCRIPTION: usize = 32 << 10;
/// The longest loop title, in bytes.
pub const MAX_TITLE: usize = 1 << 10;

/// The loop's status, as the CCW API writes it. Unknown values are kept as they were written.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Status {
    #[default]
    Created,
    Running,
    Paused,
    Completed,
    Failed,
    UserExit,
    Other(String),
}

impl Status {
    pub fn as_str(&self) -> &str {
        match self {
            Status::Created => "created",
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::UserExit => "user_exit",
            Status::Other(s) => s,
        }
    }

    pub fn parse(s: &str) -> Status {
        match s {
            "created" => Status::Created,
            "running" => Status::Running,
            "paused" => Status::Paused,
            "completed" => Status::Completed,
            "failed" => Status::Failed,
            "user_exit" => Status::UserExit,
            other => Status::Other(other.to_owned()),
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Status {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Status {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Status::parse(&String::deserialize(d)?))
    }
}

/// `skill_state.mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Auto,
    Interactive,
}

/// `{id}.json`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    #[serde(default)]
    pub loop_id: String,
    #[serde(default)]
    pub title: String,
    #[serde(default)]
    pub description: String,
    /// Absent means the configured default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_iterations: Option<u64>,
    /// loopd's addition; absent means the configured default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_errors: Option<u64>,
    pub status: Status,
    #[serde(default)]
    pub current_iteration: u64,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub updated_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Interactive mode: the action a controller chose (`loopd next`, or a dashboard writing it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_action: Option<String>,
    /// loopd's: the loop's budgets; absent means the configured default (none unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_usd: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// loopd's: how many of its tasks are developed at once, each in a git work tree of its own;
    /// absent means the configured default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel: Option<u64>,
    /// loopd's: the executors that each try every task of the loop in a tree of their own, the
    /// best result kept (`loopd create --race`); absent means the configured default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub race: Option<Vec<String>>,
    /// loopd's: who set the status last, when a loopd command or the service's API did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_by: Option<StatusBy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skill_state: Option<SkillState>,
}

/// Who set a loop's status, as loopd's controllers record it beside the status (`status_by`,
/// top level): the status they set, which controller (`loopd pause`, the service's API), its
/// process and when. A status another program wrote since (the CCW dashboard, an editor) is not
/// the one recorded here, which tells it apart.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusBy {
    pub status: Status,
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
}

impl StatusBy {
    /// Who set `status`, in words: the controller recorded for it, or another program.
    pub fn who(recorded: Option<&StatusBy>, status: &Status) -> String {
        match recorded.filter(|r| &r.status == status) {
            Some(r) => match r.pid {
                Some(pid) => format!("{} (pid {pid})", r.by),
                None => r.by.clone(),
            },
            None => "a program other than loopd (no loopd controller recorded it)".to_owned(),
        }
    }
}

/// What a controller can change, read on its own: cheap to parse from a whole state file, as the
/// watcher does after every change.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Control {
    #[serde(default)]
    pub status: Status,
    #[serde(default)]
    pub next_action: Option<String>,
    #[serde(default)]
    pub title: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub max_iterations: Option<u64>,
    #[serde(default)]
    pub max_errors: Option<u64>,
    #[serde(default)]
    pub status_by: Option<StatusBy>,
    #[serde(default)]
    skill_state: Option<SkillControl>,
}

/// What a controller can change in `skill_state`: the mode, and the answer to a question.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
struct SkillControl {
    #[serde(default)]
    mode: Mode,
    #[serde(default)]
    question: Option<AnswerOnly>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
struct AnswerOnly {
    #[serde(default)]
    answer: Option<String>,
}

impl Control {
    /// The fields of `state`: what parsing the file `state` was read from (or written as) gives.
    pub fn of(state: &LoopState) -> Control {
        Control {
            status: state.status.clone(),
            next_action: state.next_action.clone(),
            title: state.title.clone(),
            description: state.description.clone(),
            max_iterations: state.max_iterations,
            max_errors: state.max_errors,
            status_by: state.status_by.clone(),
            skill_state: state.skill_state.as_ref().map(|skill| SkillControl {
                mode: skill.mode,
                question: skill.question.as_ref().map(|q| AnswerOnly {
                    answer: q.answer.clone(),
                }),
            }),
        }
    }

    pub fn mode(&self) -> Mode {
        self.skill_state
            .as_ref()
            .map(|s| s.mode)
            .unwrap_or_default()
    }

    /// Why an attempt was ended for these fields: the status, and who set it.
    pub fn interruption(&self) -> String {
        let who = StatusBy::who(self.status_by.as_ref(), &self.status);
        match self.status {
            // Set back before the watcher read the pause or stop (see loopd_store::watch).
            Status::Running => format!("the loop was paused or stopped, then set running by {who}"),
            _ => format!("the loop's status became {}, set by {who}", self.status),
        }
    }

    /// The answer to the question an executor asked, once given.
    pub fn answer(&self) -> Option<&str> {
        self.skill_state
            .as_ref()?
            .question
            .as_ref()?
            .answer
            .as_deref()
    }
}

/// `skill_state`: everything in it belongs to the daemon. It holds the engine's bookkeeping,
/// the same for every workflow ([`Bookkeeping`], reached through `Deref`), and the workflow's own
/// fields ([`SkillState::part`]), which only the workflow reads and writes, through a typed view
/// of its own ([`WorkflowPart`]). Fields loopd does not know are kept with the workflow's.
///
/// Below this level every known field is always written (`null` when empty), so that a key the
/// daemon does not write is a key it does not know, which the store keeps (see
/// the store's `keep_unknown`). Keys are written in one order ([`SKILL_KEY_ORDER`]), so a
/// ccw-loop file reads as it always did.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct SkillState {
    #[serde(flatten)]
    pub book: Bookkeeping,
    /// The workflow's own fields, and fields loopd does not know, verbatim.
    #[serde(flatten)]
    pub part: Extra,
}

impl std::ops::Deref for SkillState {
    type Target = Bookkeeping;
    fn deref(&self) -> &Bookkeeping {
        &self.book
    }
}

impl std::ops::DerefMut for SkillState {
    fn deref_mut(&mut self) -> &mut Bookkeeping {
        &mut self.book
    }
}

/// The order of `skill_state`'s keys in the file: the seed's and ccw-loop's fields where they
/// always stood, loopd's additions after them; any other key follows, in the order it came.
pub const SKILL_KEY_ORDER: &[&str] = &[
    "current_action",
    "last_action",
    "completed_actions",
    "mode",
    "workflow",
    "develop",
    "debug",
    "validate",
    "errors",
    "summary",
    "error_count",
    "action_history",
    "in_flight",
    "lanes",
    "initialized_at",
    "seq",
    "finished",
    "develop_failed_seq",
    "executor",
    "outcome",
    "awaiting_choice",
    "usage",
    "blocked",
    "worktree",
    "question",
    "rate_limit",
    "best_validation",
    "no_progress",
    "network",
];

impl Serialize for SkillState {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        self.to_map().map_err(S::Error::custom)?.serialize(s)
    }
}

impl SkillState {
    /// Its fields as one JSON object, its keys in the file's order ([`SKILL_KEY_ORDER`], then any
    /// other key in the order it came): the bookkeeping's serialized once and moved in, the
    /// workflow's own copied.
    pub fn to_map(&self) -> serde_json::Result<Map<String, Value>> {
        use serde::ser::Error as _;
        let Value::Object(mut book) = serde_json::to_value(&self.book)? else {
            return Err(serde_json::Error::custom(
                "the bookkeeping is not an object",
            ));
        };
        let mut map = Map::with_capacity(book.len() + self.part.len());
        for key in SKILL_KEY_ORDER {
            if let Some(v) = book.remove(*key).or_else(|| self.part.get(*key).cloned()) {
                map.insert((*key).to_owned(), v);
            }
        }
        map.extend(book);
        for (key, v) in &self.part {
            if !SKILL_KEY_ORDER.contains(&key.as_str()) {
                map.insert(key.clone(), v.clone());
            }
        }
        Ok(map)
    }
}

/// A workflow's typed view of its own fields among `fields` (those of a `skill_state` object);
/// why they do not fit it, if they do not.
pub fn part_of<P: WorkflowPart>(fields: &Extra) -> Result<P, String> {
    // Read where they are: a workflow's fields (its tasks, its notes) are read several times an
    // action, and a copy of them cost as much as the reading.
    let mine = P::KEYS.iter().filter_map(|k| Some((*k, fields.get(*k)?)));
    P::deserialize(serde::de::value::MapDeserializer::<_, serde_json::Error>::new(mine))
        .map_err(|e| e.to_string())
}

/// A workflow's typed view of its own fields of `skill_state`.
pub trait WorkflowPart: Serialize + serde::de::DeserializeOwned + Default {
    /// The keys it owns.
    const KEYS: &'static [&'static str];
}

impl SkillState {
    /// The workflow's own fields as its typed view; why they do not fit it, if they do not.
    pub fn try_part<P: WorkflowPart>(&self) -> Result<P, String> {
        part_of(&self.part)
    }

    /// The workflow's own fields as its typed view (its defaults, where they do not fit: a state
    /// whose fields do not fit is refused when it is loaded, see [`LoopState::problems`]).
    pub fn part<P: WorkflowPart>(&self) -> P {
        self.try_part().unwrap_or_default()
    }

    /// Writes the workflow's typed view back, every key of it.
    pub fn set_part<P: WorkflowPart>(&mut self, part: &P) {
        if let Ok(Value::Object(fields)) = serde_json::to_value(part) {
            for (key, value) in fields {
                self.part.insert(key, value);
            }
        }
    }
}

/// The engine's part of `skill_state`: the same for every workflow.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Bookkeeping {
    #[serde(default)]
    pub current_action: Option<String>,
    #[serde(default)]
    pub last_action: Option<String>,
    /// The last [`COMPLETED_ACTIONS_WINDOW`] actions that finished.
    #[serde(default)]
    pub completed_actions: Vec<String>,
    #[serde(default)]
    pub mode: Mode,
    /// The workflow driving this loop (loopd's addition; absent means `ccw-loop`).
    #[serde(default)]
    pub workflow: Option<String>,
    /// The last [`ERRORS_WINDOW`] errors.
    #[serde(default)]
    pub errors: Vec<ErrorEntry>,

    // loopd's additions, documented in docs/files.md.
    /// Actions that failed after their last retry, ever (the `errors` window keeps only the last 5).
    #[serde(default)]
    pub error_count: u64,
    /// The last [`ACTION_HISTORY_WINDOW`] attempts.
    #[serde(default)]
    pub action_history: Vec<HistoryEntry>,
    /// The attempt running now, so that a restarted daemon can clean up after a crash.
    #[serde(default)]
    pub in_flight: Option<InFlight>,
    /// loopd's: the attempts of a batch of tasks developed at once (`parallel`), each in a work
    /// tree of its own; empty when none runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lanes: Vec<InFlight>,
    /// How many actions have finished; the clock of `finished`.
    #[serde(default)]
    pub seq: u64,
    /// For each action, when (`seq`) it last finished and whether it succeeded.
    #[serde(default)]
    pub finished: BTreeMap<String, Finished>,
    /// The `--executor` the loop's daemon was last started with.
    #[serde(default)]
    pub executor: Option<String>,
    /// How the loop ended: `passed`, `iteration_limit` or `incomplete` (completed), or `failed`
    /// (the daemon failed it). Cleared when an action starts.
    #[serde(default)]
    pub outcome: Option<String>,
    /// Interactive mode: the choice the daemon waits for.
    #[serde(default)]
    pub awaiting_choice: Option<AwaitingChoice>,
    /// Tokens and cost the agents reported, over every attempt.
    #[serde(default)]
    pub usage: UsageTotals,
    /// Set while the loop is paused because its executor cannot run here (not logged in, no
    /// key, a missing program): why, and what to do. Cleared when an action starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked: Option<Blocked>,
    /// The loop's own git worktree (`loopd create --worktree`), where its actions run; absent
    /// when they run in the project root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worktree: Option<Worktree>,
    /// What an executor asked a person (`needs_input`), and the answer once given (`loopd answer`
    /// or anyone writing `answer`). The loop waits while it is unanswered; the next prompt gets
    /// both; it is cleared when that action finishes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<Question>,
    /// Set while the loop waits for a rate limit to reset, its own or its account's: which
    /// account, and until when. Cleared when the wait ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitWait>,
    /// `rollback_on_regression`: the best validation so far, which a worse one rolls back to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_validation: Option<BestValidation>,
    /// No-progress detection: the rounds in a row that changed nothing, and while the loop is
    /// paused for it, why (see `no_progress`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_progress: Option<NoProgress>,
    /// What the sandbox's proxy refused the loop's attempts (a network of hosts), once it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkRefused>,
}

/// The connections the sandbox's proxy refused a loop's attempts: how many, and the last.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NetworkRefused {
    pub refused: u64,
    /// `host:port` of the last, the action that asked, and when.
    pub last: String,
    pub action: String,
    pub at: String,
}

/// A loop waiting for a rate limit to reset.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RateLimitWait {
    pub account: String,
    pub until: String,
}

/// What no-progress detection keeps between rounds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NoProgress {
    /// Rounds in a row that left the fingerprint as the round before left it.
    #[serde(default)]
    pub rounds: u64,
    /// What the last round left.
    #[serde(default)]
    pub fingerprint: Option<Fingerprint>,
    /// A checkpoint changed files since the last round ended.
    #[serde(default)]
    pub tree_changed: bool,
    /// What each round without progress did, in a few words (`debug proposed 'fix it'`), for
    /// the pause's reason: the last [`crate::no_progress::NOTES_KEPT`]. (Always written, empty
    /// too: a key the daemon leaves out would be kept as another writer's.)
    #[serde(default)]
    pub notes: Vec<String>,
    /// Set while the loop is paused for making no progress; cleared (`null`, always written so
    /// that the store's merge sees it cleared) when an action starts.
    #[serde(default)]
    pub paused: Option<Stalled>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// What a round leaves that progress would change (besides the work tree, whose checkpoints say
/// whether it changed).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// The workflow's measure of progress (`2/3` tasks, a gate), for people: the task bookkeeping
    /// alone (a task the agent added and marked done) is no progress.
    pub progress: String,
    /// The last validation's outcome, in a few words, once there was one.
    #[serde(default)]
    pub validation: Option<String>,
    /// The round's error, normalised (numbers, paths and hashes taken out), if it failed.
    #[serde(default)]
    pub error: Option<String>,
    /// Whether the work tree's checkpoints are recorded (git), so that a round that changed no
    /// file is known.
    #[serde(default)]
    pub tree_tracked: bool,
    /// Without checkpoints, a fingerprint of the work tree's files (their names, sizes and
    /// times), when the driver can take one.
    #[serde(default)]
    pub files: Option<u64>,
}

/// A loop paused because it made no progress.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stalled {
    pub since: String,
    /// What stayed the same, for people.
    pub reason: String,
}

/// The best validation of a loop: its pass rate, the checkpoint the work tree was at, and the
/// tasks done by then.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BestValidation {
    pub pass_rate: f64,
    pub checkpoint: String,
    #[serde(default)]
    pub done_tasks: Vec<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Tokens of one attempt, as the agents report them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.input_tokens
            .saturating_add(self.output_tokens)
            .saturating_add(self.cache_read_tokens)
            .saturating_add(self.cache_write_tokens)
    }

    pub fn add(&mut self, other: &Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cache_read_tokens = self
            .cache_read_tokens
            .saturating_add(other.cache_read_tokens);
        self.cache_write_tokens = self
            .cache_write_tokens
            .saturating_add(other.cache_write_tokens);
    }
}

/// Tokens and cost spent by a loop's agents.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageTotals {
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    #[serde(default)]
    pub cache_read_tokens: u64,
    #[serde(default)]
    pub cache_write_tokens: u64,
    #[serde(default)]
    pub cost_usd: f64,
    /// What was spent on the last day anything was (UTC), for `list`'s "today" (loopd's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub day: Option<DaySpend>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Tokens and dollars spent on one day.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DaySpend {
    /// `YYYY-MM-DD`, UTC.
    pub date: String,
    #[serde(default)]
    pub tokens: u64,
    #[serde(default)]
    pub cost_usd: f64,
}

/// The most dollars a loop's usage records: more is surely garbage, and must stay a finite number
/// (JSON has no infinity).
pub const MAX_COST_USD: f64 = 1e12;

impl UsageTotals {
    pub fn tokens(&self) -> u64 {
        self.input_tokens
            .saturating_add(self.output_tokens)
            .saturating_add(self.cache_read_tokens)
            .saturating_add(self.cache_write_tokens)
    }

    /// What was spent on `date` (`YYYY-MM-DD`, UTC): `(tokens, dollars)`.
    pub fn on(&self, date: &str) -> (u64, f64) {
        match &self.day {
            Some(day) if day.date == date => (day.tokens, day.cost_usd),
            _ => (0, 0.0),
        }
    }

    /// Adds an attempt's spending, which ended at `at` (RFC 3339, UTC), to the totals and its
    /// day's; sums saturate, and a cost that is not a finite number of dollars counts as nothing.
    pub fn add(&mut self, usage: &Usage, cost_usd: Option<f64>, at: &str) {
        self.input_tokens = self.input_tokens.saturating_add(usage.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(usage.output_tokens);
        self.cache_read_tokens = self
            .cache_read_tokens
            .saturating_add(usage.cache_read_tokens);
        self.cache_write_tokens = self
            .cache_write_tokens
            .saturating_add(usage.cache_write_tokens);
        let cost = cost_usd
            .filter(|c| c.is_finite() && *c > 0.0)
            .unwrap_or(0.0);
        self.cost_usd = (self.cost_usd + cost).clamp(0.0, MAX_COST_USD);
        let date = at.get(..10).unwrap_or(at);
        let day = self.day.get_or_insert_with(DaySpend::default);
        if day.date != date {
            *day = DaySpend {
                date: date.to_owned(),
                ..DaySpend::default()
            };
        }
        day.tokens = day.tokens.saturating_add(usage.total());
        day.cost_usd = (day.cost_usd + cost).clamp(0.0, MAX_COST_USD);
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finished {
    pub seq: u64,
    pub ok: bool,
}

/// A question an executor asked.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Question {
    pub since: String,
    pub action: String,
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_at: Option<String>,
}

impl Question {
    /// Asked and not answered yet.
    pub fn waiting(&self) -> bool {
        self.answer.is_none()
    }
}

/// A loop's own git worktree.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Worktree {
    pub path: PathBuf,
    pub branch: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Blocked {
    pub since: String,
    pub action: String,
    pub executor: String,
    /// The executor's own words, one line.
    pub reason: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AwaitingChoice {
    pub since: String,
    pub choices: Vec<String>,
    #[serde(default)]
    pub suggested: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ErrorEntry {
    pub action: String,
    pub message: String,
    pub timestamp: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A git checkpoint recorded after an action: its name (the last part of its ref), commit and
/// what it changed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub name: String,
    pub commit: String,
    /// Against the loop's checkpoint before it.
    #[serde(default)]
    pub files: u64,
    #[serde(default)]
    pub insertions: u64,
    #[serde(default)]
    pub deletions: u64,
}

/// Whether `id` can name a loop: 1 to 128 ASCII letters, digits, `.`, `_` and `-`, the first a
/// letter or digit; so it is one safe file name (`{id}.json`, a work tree's directory).
pub fn is_loop_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The id of a loop's `n`th task (from 1), as loopd numbers the tasks it adds: `task-001`.
pub fn task_id(n: u64) -> String {
    format!("task-{n:03}")
}

/// The number of a task id loopd gave ([`task_id`]), if it is one.
pub fn task_number(id: &str) -> Option<u64> {
    id.strip_prefix("task-")?.parse().ok()
}

/// The number of the next task: past every one of `ids` that loopd gave.
pub fn next_task_number<'a>(ids: impl IntoIterator<Item = &'a str>) -> u64 {
    ids.into_iter().filter_map(task_number).max().unwrap_or(0) + 1
}

/// A task of the loop's task list, as a workflow takes it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ListedTask {
    pub id: String,
    pub description: String,
    pub tool: Option<String>,
    pub mode: Option<String>,
    pub created_at: Option<String>,
    /// Its place in the list, as its writer numbered it.
    pub order: Option<Value>,
    /// The tasks it needs done first (`loopd task add --after`); `None` when its writer cannot
    /// say (CCW's tasks), and then it keeps its place in the order.
    #[serde(default)]
    pub after: Option<Vec<String>>,
    /// The executors that each try it (`loopd task add --race`); empty: the loop's. (Absent from
    /// the inputs of loops on Temporal made before it.)
    #[serde(default)]
    pub race: Vec<String>,
}

/// One attempt in `skill_state.action_history`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub action: String,
    pub iteration: u64,
    pub attempt: u32,
    #[serde(default)]
    pub task_id: Option<String>,
    pub started_at: String,
    #[serde(default)]
    pub finished_at: Option<String>,
    /// The attempt's outcome: `success`, `interrupted`, or a failure of the taxonomy in
    /// the executors' `AttemptOutcome`.
    pub outcome: String,
    #[serde(default)]
    pub summary: Option<String>,
    #[serde(default)]
    pub error: Option<String>,
    /// The git checkpoint recorded after it (actions that change the work tree).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Checkpoint>,
    /// The tokens its agent spent, every kind counted ([`Usage::total`]), when it said (loopd's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Its cost in dollars, when its agent said (loopd's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    /// The pass rate a validation that succeeded measured, in percent (loopd's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_rate: Option<f64>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The attempt in flight, recorded while its executor runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct InFlight {
    pub action: String,
    pub iteration: u64,
    pub attempt: u32,
    #[serde(default)]
    pub task_id: Option<String>,
    pub started_at: String,
    /// The executor's pid, which is also its process group id.
    pub pid: u32,
    pub pgid: u32,
    /// The process's start time in clock ticks since boot (`/proc/PID/stat` field 22), so that a
    /// recycled pid is never mistaken for the executor.
    #[serde(default)]
    pub proc_start: Option<u64>,
    /// The pid of the daemon that started it.
    pub daemon_pid: u32,
    /// The name of its log in the progress directory's `actions/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl LoopState {
    /// The skill state, created empty when missing.
    pub fn skill(&mut self) -> &mut SkillState {
        self.skill_state.get_or_insert_with(SkillState::default)
    }

    /// How the loop stands, in a few words: its status and what ended it (`passed`, `iteration
    /// limit`, `failed: REASON`, `stopped`, `blocked`, `waiting for an answer`).
    pub fn standing(&self) -> String {
        let skill = self.skill_state.as_ref();
        let outcome = skill.and_then(|k| k.outcome.as_deref());
        if self.status == Status::Running
            && let Some(wait) = skill.and_then(|k| k.rate_limit.as_ref())
        {
            return format!(
                "waiting: rate limit of {} until {}",
                wait.account, wait.until
            );
        }
        match &self.status {
            Status::Running
                if skill
                    .and_then(|k| k.question.as_ref())
                    .is_some_and(Question::waiting) =>
            {
                "waiting for an answer".to_owned()
            }
            Status::Paused if skill.is_some_and(|k| k.blocked.is_some()) => "blocked".to_owned(),
            Status::Paused
                if skill
                    .and_then(|k| k.no_progress.as_ref())
                    .is_some_and(|n| n.paused.is_some()) =>
            {
                "no progress".to_owned()
            }
            Status::Completed => match outcome {
                Some("iteration_limit") => "iteration limit".to_owned(),
                Some("incomplete") => "incomplete".to_owned(),
                _ => "passed".to_owned(),
            },
            Status::Failed if outcome == Some("failed") => format!(
                "failed: {}",
                self.failure_reason.as_deref().unwrap_or("no reason given")
            ),
            Status::Failed | Status::UserExit => "stopped".to_owned(),
            other => other.as_str().to_owned(),
        }
    }

    pub fn max_iterations_or(&self, default: u64) -> u64 {
        self.max_iterations.unwrap_or(default)
    }

    /// How many tasks the loop develops at once: its own setting, else `default`; at least 1.
    pub fn parallel_or(&self, default: u64) -> u64 {
        self.parallel.unwrap_or(default).max(1)
    }

    pub fn max_errors_or(&self, default: u64) -> u64 {
        self.max_errors.unwrap_or(default)
    }

    /// What makes this state unusable, for people (the seed's state validation). `file_id` is the
    /// id the file name gives.
    pub fn problems(&self, file_id: Option<&str>) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(id) = file_id
            && !self.loop_id.is_empty()
            && self.loop_id != id
        {
            problems.push(format!(
                "loop_id {:?} does not match the file name ({id})",
                self.loop_id
            ));
        }
        for (key, value) in [
            ("max_iterations", self.max_iterations),
            ("max_errors", self.max_errors),
        ] {
            if value == Some(0) {
                problems.push(format!("{key} must be at least 1"));
            }
        }
        problems
    }

    pub fn mode(&self) -> Mode {
        self.skill_state
            .as_ref()
            .map(|s| s.mode)
            .unwrap_or_default()
    }
}

/// Keeps the last `window` elements of `list`.
pub fn trim_window<T>(list: &mut Vec<T>, window: usize) {
    if list.len() > window {
        list.drain(..list.len() - window);
    }
}

/// Where `theirs` differs from `ours`, for people: one `path: theirs → ours` each, the path in
/// dots and `[i]`, values cut short; arrays of another length as their lengths. At most `limit`,
/// then how many more.
pub fn differences(ours: &Value, theirs: &Value, limit: usize) -> Vec<String> {
    fn short(v: &Value) -> String {
        let text = v.to_string();
        match text.char_indices().nth(40) {
            Some((cut, _)) => format!("{}…", &text[..cut]),
            None => text,
        }
    }
    fn walk(path: &str, ours: &Value, theirs: &Value, out: &mut Vec<String>) {
        let join = |key: &str| match path {
            "" => key.to_owned(),
            _ => format!("{path}.{key}"),
        };
        match (ours, theirs) {
            (Value::Object(o), Value::Object(t)) => {
                for (key, ov) in o {
                    walk(&join(key), ov, t.get(key).unwrap_or(&Value::Null), out);
                }
                for (key, tv) in t.iter().filter(|(k, _)| !o.contains_key(*k)) {
                    walk(&join(key), &Value::Null, tv, out);
                }
            }
            (Value::Array(o), Value::Array(t)) if o.len() == t.len() => {
                for (i, (ov, tv)) in o.iter().zip(t).enumerate() {
                    walk(&format!("{path}[{i}]"), ov, tv, out);
                }
            }
            (Value::Array(o), Value::Array(t)) => {
                out.push(format!("{path}: {} entries → {}", t.len(), o.len()));
            }
            (o, t) if o != t => out.push(format!("{path}: {} → {}", short(t), short(o))),
            _ => {}
        }
    }
    let mut all = Vec::new();
    walk("", ours, theirs, &mut all);
    if all.len() > limit {
        let more = all.len() - limit;
        all.truncate(limit);
        all.push(format!("and {more} more"));
    }
    all
}

/// A time as loopd writes timestamps: RFC 3339 UTC with milliseconds and `Z`.
pub fn format_ts(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Parses any RFC 3339 timestamp, whatever its offset.
pub fn parse_ts(s: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.with_timezone(&chrono::Utc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_id_is_one_safe_file_name() {
        let longest = "a".repeat(128);
        for id in [
            "loop-v2-20261125T120000-0a1b2c3d",
            "L.1_x-y",
            "7",
            longest.as_str(),
        ] {
            assert!(is_loop_id(id), "{id:?}");
        }
        let too_long = "a".repeat(129);
        for id in [
            "",
            ".hidden",
            "-flag",
            "..",
            "a/b",
            "a\0b",
            "é",
            "a b",
            too_long.as_str(),
        ] {
            assert!(!is_loop_id(id), "{id:?}");
        }
    }

    #[test]
    fn unknown_fields_survive_at_every_level() {
        let text = r#"{
            "loop_id": "l", "status": "running",
            "skill_state": {
                "mode": "auto", "custom": true,
                "develop": {"tasks": [{"id": "t1", "status": "pending", "weird": "x"}], "more": 1},
                "debug": {"hypotheses": [{"id": "H1", "evidence_criteria": {"confirm": "c", "x": 2}, "y": 3}]},
                "validate": {"test_results": [{"test_name": "a", "extra_field": [1]}], "k": "v"},
                "errors": [{"action": "a", "message": "m", "timestamp": "t", "code": 7}]
            }
        }"#;
        let state: LoopState = serde_json::from_str(text).unwrap();
        let back = serde_json::to_value(&state).unwrap();
        let orig: Value = serde_json::from_str(text).unwrap();
        for pointer in [
            "/skill_state/custom",
            "/skill_state/develop/tasks/0/weird",
            "/skill_state/develop/more",
            "/skill_state/debug/hypotheses/0/y",
            "/skill_state/debug/hypotheses/0/evidence_criteria/x",
            "/skill_state/validate/test_results/0/extra_field",
            "/skill_state/validate/k",
            "/skill_state/errors/0/code",
        ] {
            assert_eq!(back.pointer(pointer), orig.pointer(pointer), "{pointer}");
        }
    }

    #[test]
    fn unknown_status_is_kept() {
        let state: LoopState = serde_json::from_str(r#"{"status": "sleeping"}"#).unwrap();
        assert_eq!(state.status, Status::Other("sleeping".into()));
        assert_eq!(serde_json::to_value(&state).unwrap()["status"], "sleeping");
    }

    #[test]
    fn timestamps_have_millis_and_z_and_any_offset_parses() {
        let a = parse_ts("2026-01-22T10:00:00+08:00").unwrap();
        assert_eq!(format_ts(a), "2026-01-22T02:00:00.000Z");
    }

    #[test]
    fn differences_name_each_changed_path_from_theirs_to_ours() {
        let ours = serde_json::json!({
            "current_iteration": 3,
            "skill_state": {"develop": {"completed": 2, "tasks": [{"status": "completed"}]},
                            "errors": [1, 2]}
        });
        let theirs = serde_json::json!({
            "current_iteration": 1,
            "skill_state": {"develop": {"completed": 0, "tasks": [{"status": "pending"}]},
                            "errors": [1], "theirs": true}
        });
        assert_eq!(
            differences(&ours, &theirs, 10),
            [
                "current_iteration: 1 → 3",
                "skill_state.develop.completed: 0 → 2",
                "skill_state.develop.tasks[0].status: \"pending\" → \"completed\"",
                "skill_state.errors: 1 entries → 2",
                "skill_state.theirs: true → null",
            ]
        );
        assert_eq!(differences(&ours, &theirs, 2).last().unwrap(), "and 3 more");
        assert!(differences(&ours, &ours, 10).is_empty());
    }

    #[test]
    fn trim_window_keeps_the_tail() {
        let mut v: Vec<u32> = (0..15).collect();
        trim_window(&mut v, 10);
        assert_eq!(v, (5..15).collect::<Vec<_>>());
    }
}
