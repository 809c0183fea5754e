//! skill-tuning's own fields of `skill_state`, as the seed names them: the skill it tunes, what
//! the analyses found (`issues`), the fixes proposed, pending and applied, and the quality gate
//! loopd computes from the issues. Every list is bounded.

use serde::{Deserialize, Serialize};

use crate::state::{Extra, WorkflowPart, part_of};

/// How many issues `issues` keeps; a new one beyond it replaces the least severe.
pub const MAX_ISSUES: usize = 100;
/// How many fixes each of `proposed_fixes`, `pending_fixes` and `applied_fixes` keeps.
pub const MAX_FIXES: usize = 50;

/// The diagnoses, in the order they run.
pub const DIAGNOSES: &[&str] = &[
    "context",
    "memory",
    "dataflow",
    "agent",
    "docs",
    "token_consumption",
];

/// skill-tuning's part of `skill_state`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TuningState {
    #[serde(default)]
    pub target_skill: TargetSkill,
    /// Areas to look at; the diagnoses among them limit which diagnoses run.
    #[serde(default)]
    pub focus_areas: Vec<String>,
    /// What the user said is wrong with the skill (`--issue`).
    #[serde(default)]
    pub issue_description: Option<String>,
    /// When `init` finished.
    #[serde(default)]
    pub initialized_at: Option<String>,
    #[serde(default)]
    pub requirement_analysis: RequirementAnalysis,
    /// The second-opinion analysis (the seed's Gemini analysis; any executor runs it).
    #[serde(default)]
    pub gemini_analysis: SecondOpinion,
    /// Whether a controller asks for a second opinion in this round.
    #[serde(default)]
    pub gemini_analysis_requested: bool,
    #[serde(default)]
    pub diagnosis: Diagnosis,
    /// The issues found and not yet resolved (at most [`MAX_ISSUES`]).
    #[serde(default)]
    pub issues: Vec<Issue>,
    #[serde(default)]
    pub issues_by_severity: SeverityCounts,
    /// How many issues were resolved by a verified fix, over every round.
    #[serde(default)]
    pub resolved_issues: u64,
    #[serde(default)]
    pub report: Option<Report>,
    #[serde(default)]
    pub proposed_fixes: Vec<Fix>,
    /// Ids of proposed fixes still to apply, in order.
    #[serde(default)]
    pub pending_fixes: Vec<String>,
    #[serde(default)]
    pub applied_fixes: Vec<AppliedFix>,
    /// `pass`, `review` or `fail`, computed by loopd from `issues` (absent before the first report).
    #[serde(default)]
    pub quality_gate: Option<Gate>,
    #[serde(default)]
    pub quality_score: Option<u64>,
    /// The diagnosis round, from 1; a round after a verified fix when serious issues remain.
    #[serde(default)]
    pub round: u64,
    /// The round `propose-fixes` last ran in (it runs at most once a round).
    #[serde(default)]
    pub proposed_round: u64,
    /// The numbers given to issues and fixes so far: an id is never given twice.
    #[serde(default)]
    pub issue_seq: u64,
    #[serde(default)]
    pub fix_seq: u64,
    /// What `complete` said of the whole tuning.
    #[serde(default)]
    pub summary: Option<String>,
}

impl TuningState {
    /// A new loop's fields.
    pub fn new(
        name: String,
        path: String,
        focus_areas: Vec<String>,
        issue_description: Option<String>,
    ) -> TuningState {
        TuningState {
            target_skill: TargetSkill {
                name,
                path,
                extra: Default::default(),
            },
            focus_areas,
            issue_description,
            round: 1,
            ..TuningState::default()
        }
    }

    /// skill-tuning's fields among those of a `skill_state` object ([`part_of`]). Not generic:
    /// a crate above that reads them (the demo's agent) calls this rather than compile their
    /// deserializer again.
    pub fn from_fields(fields: &Extra) -> Result<TuningState, String> {
        part_of(fields)
    }
}

impl WorkflowPart for TuningState {
    const KEYS: &'static [&'static str] = &[
        "target_skill",
        "focus_areas",
        "issue_description",
        "initialized_at",
        "requirement_analysis",
        "gemini_analysis",
        "gemini_analysis_requested",
        "diagnosis",
        "issues",
        "issues_by_severity",
        "resolved_issues",
        "report",
        "proposed_fixes",
        "pending_fixes",
        "applied_fixes",
        "quality_gate",
        "quality_score",
        "round",
        "proposed_round",
        "issue_seq",
        "fix_seq",
        "summary",
    ];
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TargetSkill {
    #[serde(default)]
    pub name: String,
    /// The skill's directory (with `SKILL.md`), relative to the project root where it is in it.
    #[serde(default)]
    pub path: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Whether the skill's requirements are understood and covered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequirementAnalysis {
    /// `pending`, `completed`, `needs_clarification` (the analysis asked a question) or `failed`.
    #[serde(default = "pending")]
    pub status: String,
    /// `satisfied`, `partial` or `unsatisfied`: how well the skill covers its requirements.
    #[serde(default)]
    pub coverage: Option<String>,
    #[serde(default)]
    pub summary: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

fn pending() -> String {
    "pending".to_owned()
}

impl Default for RequirementAnalysis {
    fn default() -> Self {
        RequirementAnalysis {
            status: pending(),
            coverage: None,
            summary: None,
            extra: Extra::default(),
        }
    }
}

impl Default for SecondOpinion {
    fn default() -> Self {
        SecondOpinion {
            status: pending(),
            round: 0,
            summary: None,
            extra: Extra::default(),
        }
    }
}

/// The second-opinion analysis.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SecondOpinion {
    /// `pending`, `running`, `completed` or `failed`.
    #[serde(default = "pending")]
    pub status: String,
    /// The round it last ran in (it runs at most once a round).
    #[serde(default)]
    pub round: u64,
    #[serde(default)]
    pub summary: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One result per diagnosis; `null` until it has run this round.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Diagnosis {
    #[serde(default)]
    pub context: Option<DiagnosisResult>,
    #[serde(default)]
    pub memory: Option<DiagnosisResult>,
    #[serde(default)]
    pub dataflow: Option<DiagnosisResult>,
    #[serde(default)]
    pub agent: Option<DiagnosisResult>,
    #[serde(default)]
    pub docs: Option<DiagnosisResult>,
    #[serde(default)]
    pub token_consumption: Option<DiagnosisResult>,
}

impl Diagnosis {
    pub fn get(&self, area: &str) -> Option<&DiagnosisResult> {
        match area {
            "context" => self.context.as_ref(),
            "memory" => self.memory.as_ref(),
            "dataflow" => self.dataflow.as_ref(),
            "agent" => self.agent.as_ref(),
            "docs" => self.docs.as_ref(),
            "token_consumption" => self.token_consumption.as_ref(),
            _ => None,
        }
    }

    /// Sets (`Some`) or clears (`None`) the result of an area.
    pub fn set(&mut self, area: &str, result: Option<DiagnosisResult>) {
        let slot = match area {
            "context" => &mut self.context,
            "memory" => &mut self.memory,
            "dataflow" => &mut self.dataflow,
            "agent" => &mut self.agent,
            "docs" => &mut self.docs,
            "token_consumption" => &mut self.token_consumption,
            _ => return,
        };
        *slot = result;
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DiagnosisResult {
    /// `completed`, or `failed` (skipped after its retries).
    pub status: String,
    #[serde(default)]
    pub issues_found: u64,
    #[serde(default)]
    pub summary: Option<String>,
    #[serde(default)]
    pub at: Option<String>,
}

/// How bad an issue is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Critical,
    High,
    Medium,
    #[default]
    Low,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Issue {
    pub id: String,
    /// The diagnosis (or analysis) that found it.
    #[serde(default)]
    pub category: String,
    pub severity: Severity,
    pub description: String,
    #[serde(default)]
    pub location: Option<String>,
    #[serde(default)]
    pub evidence: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Critical => "critical",
            Severity::High => "high",
            Severity::Medium => "medium",
            Severity::Low => "low",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeverityCounts {
    pub critical: u64,
    pub high: u64,
    pub medium: u64,
    pub low: u64,
}

impl SeverityCounts {
    pub fn of(issues: &[Issue]) -> SeverityCounts {
        let count = |s| issues.iter().filter(|i| i.severity == s).count() as u64;
        SeverityCounts {
            critical: count(Severity::Critical),
            high: count(Severity::High),
            medium: count(Severity::Medium),
            low: count(Severity::Low),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// `completed` or `failed`.
    pub status: String,
    #[serde(default)]
    pub summary: Option<String>,
    #[serde(default)]
    pub at: Option<String>,
}

/// A fix proposed for one or more issues.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Fix {
    pub id: String,
    #[serde(default)]
    pub issue_ids: Vec<String>,
    pub description: String,
    #[serde(default)]
    pub strategy: Option<String>,
    #[serde(default)]
    pub risk: Option<String>,
    /// A task of the loop's task list, not a proposal: the loop does not complete before it
    /// is applied and verified.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub from_task_list: bool,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AppliedFix {
    pub id: String,
    #[serde(default)]
    pub issue_ids: Vec<String>,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub applied_at: Option<String>,
    /// `pass`, `fail`, or `pending` until a verify has judged it.
    pub verification_result: String,
    /// The round it was applied in.
    #[serde(default)]
    pub round: u64,
    #[serde(default)]
    pub files_changed: Vec<String>,
    /// Applied from the loop's task list (see [`Fix::from_task_list`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub from_task_list: bool,
}

/// The quality gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gate {
    Pass,
    Review,
    Fail,
}

impl Gate {
    pub fn as_str(self) -> &'static str {
        match self {
            Gate::Pass => "pass",
            Gate::Review => "review",
            Gate::Fail => "fail",
        }
    }
}

/// The quality score and gate of a set of issues, never an agent's word: the score is
/// 100 − 25·critical − 15·high − 5·medium − 1·low (at least 0); `pass` with no critical issue, at
/// most 2 high and a score of 60 or more; `review` with a score of 40 or more; else `fail`.
pub fn quality(counts: SeverityCounts) -> (u64, Gate) {
    let penalty = 25 * counts.critical + 15 * counts.high + 5 * counts.medium + counts.low;
    let score = 100u64.saturating_sub(penalty);
    let gate = if counts.critical == 0 && counts.high <= 2 && score >= 60 {
        Gate::Pass
    } else if score >= 40 {
        Gate::Review
    } else {
        Gate::Fail
    };
    (score, gate)
}
