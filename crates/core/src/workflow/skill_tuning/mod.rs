//! The skill-tuning workflow (the seed `skill-tuning-orchestrator.md`): tunes one Claude Code
//! skill by analysing its requirements, diagnosing it area by area, reporting, proposing fixes,
//! applying them one at a time and verifying them, until the quality gate passes.
//!
//! Termination, in the seed's order: the error limit fails the loop; the iteration limit (only
//! `verify` counts an iteration) or a passing gate completes it. Selection follows the seed's 13
//! priorities, with its defects fixed: a second opinion left running finishes before any trigger
//! is looked at, and runs at most once a round; a new round starts only after a fix was applied
//! and verified in this one (else the loop completes), and it resets the diagnosis by its keys;
//! the gate is computed by loopd from the issues ([`state::quality`]), never taken from an agent.
//! A failed action is skipped after its retries: it is recorded, counted, and selection moves on.

pub mod state;
mod view;

use serde_json::{Map, Value};

use super::{Dispatch, Finish, Inputs, LoopEnd, Outcome, Workflow, opt_str};
use crate::protocol::ActionResult;
use crate::state::ListedTask;
use crate::state::{LoopState, MAX_DESCRIPTION, SkillState};
use state::{
    AppliedFix, DIAGNOSES, DiagnosisResult, Fix, Gate, Issue, MAX_FIXES, MAX_ISSUES, Report,
    SeverityCounts, TuningState, quality,
};

pub const NAME: &str = "skill-tuning";

pub struct SkillTuning;

pub const ACTIONS: &[&str] = &[
    "init",
    "analyze-requirements",
    "gemini-analysis",
    "diagnose-context",
    "diagnose-memory",
    "diagnose-dataflow",
    "diagnose-agent",
    "diagnose-docs",
    "diagnose-token-consumption",
    "generate-report",
    "propose-fixes",
    "apply-fix",
    "verify",
    "complete",
];

/// Focus areas that call for a second opinion whatever the diagnoses find.
const SECOND_OPINION_AREAS: &[&str] = &["architecture", "prompt", "performance", "custom"];

/// Every focus area `create --focus` takes: the diagnoses, and those that ask for a second
/// opinion.
pub fn focus_areas() -> Vec<&'static str> {
    DIAGNOSES
        .iter()
        .chain(SECOND_OPINION_AREAS)
        .copied()
        .collect()
}

/// Its defaults where neither `create` nor the loop says: 5 iterations, 3 errors.
pub const DEFAULT_LIMITS: (u64, u64) = (5, 3);

/// The action of a diagnosis area: `token_consumption` → `diagnose-token-consumption`.
fn diagnose_action(area: &str) -> String {
    format!("diagnose-{}", area.replace('_', "-"))
}

/// The area of a diagnose action.
fn diagnosis_area(action: &str) -> Option<&'static str> {
    let area = action.strip_prefix("diagnose-")?.replace('-', "_");
    DIAGNOSES.iter().find(|d| **d == area).copied()
}

fn part(state: &LoopState) -> TuningState {
    state
        .skill_state
        .as_ref()
        .map(SkillState::part)
        .unwrap_or_default()
}

/// The diagnoses this loop runs: those its focus areas name, or all of them.
fn diagnoses(t: &TuningState) -> Vec<&'static str> {
    let named: Vec<&'static str> = DIAGNOSES
        .iter()
        .copied()
        .filter(|d| {
            t.focus_areas
                .iter()
                .any(|f| f.replace('-', "_").eq_ignore_ascii_case(d))
        })
        .collect();
    if named.is_empty() {
        DIAGNOSES.to_vec()
    } else {
        named
    }
}

/// Whether a second opinion is called for in this round (the seed's priorities 4 and 5).
fn second_opinion_due(t: &TuningState) -> bool {
    if t.gemini_analysis.round >= t.round {
        return false; // once a round
    }
    let unsatisfied = t.requirement_analysis.coverage.as_deref() == Some("unsatisfied");
    let focus = t.focus_areas.iter().any(|f| {
        SECOND_OPINION_AREAS
            .iter()
            .any(|a| f.eq_ignore_ascii_case(a))
    });
    unsatisfied
        || t.gemini_analysis_requested
        || t.issues_by_severity.critical > 0
        || focus
        || (t.round >= 2 && !t.issues.is_empty())
}

/// `complete` now, when nothing is left to do: `passed` when the gate passes.
fn complete(t: &TuningState) -> Dispatch {
    Dispatch::complete_if_done(t.quality_gate == Some(Gate::Pass))
}

/// The seed's selection, priorities 1 to 13 (3, waiting for a clarification, and 6, waiting for a
/// running analysis, are the engine's: it waits for an answer before it selects, and runs one
/// action at a time).
pub fn select(t: &TuningState) -> Dispatch {
    // 1. Not initialised.
    if t.initialized_at.is_none() {
        return Dispatch::new("init");
    }
    // 2–3. The requirements are not analysed yet, or the analysis asked and was answered.
    if matches!(
        t.requirement_analysis.status.as_str(),
        "pending" | "needs_clarification"
    ) {
        return Dispatch::new("analyze-requirements");
    }
    // 6 before 4–5: an analysis left running (its daemon ended mid-way) finishes first; it is
    // never started a second time.
    if t.gemini_analysis.status == "running" || second_opinion_due(t) {
        return Dispatch::new("gemini-analysis");
    }
    // 7. The next diagnosis of this round.
    if let Some(area) = diagnoses(t)
        .into_iter()
        .find(|d| t.diagnosis.get(d).is_none())
    {
        return Dispatch::new(&diagnose_action(area));
    }
    // 8. Every diagnosis done, no report.
    if t.report.is_none() {
        return Dispatch::new("generate-report");
    }
    // 9. Issues, and no proposal this round.
    if !t.issues.is_empty() && t.proposed_round < t.round {
        return Dispatch::new("propose-fixes");
    }
    // 10. A fix waits.
    if let Some(fix) = t.pending_fixes.first() {
        return Dispatch {
            task_id: Some(fix.clone()),
            ..Dispatch::new("apply-fix")
        };
    }
    // 11. An applied fix waits for its verification.
    if t.applied_fixes
        .iter()
        .any(|f| f.verification_result == "pending")
    {
        return Dispatch::new("verify");
    }
    // 12 starts a new round in verify's result (see `new_round`), so that selection never comes
    // back here without a verified fix; 13. Nothing else to do.
    complete(t)
}

impl Workflow for SkillTuning {
    fn name(&self) -> &'static str {
        NAME
    }

    fn actions(&self) -> &'static [&'static str] {
        ACTIONS
    }

    fn counts_iteration(&self, action: &str) -> bool {
        action == "verify"
    }

    fn changes_work_tree(&self, action: &str) -> bool {
        action == "apply-fix"
    }

    fn default_limits(&self) -> Option<(u64, u64)> {
        Some(DEFAULT_LIMITS)
    }

    /// The quality score and the issues still open, once a verification graded them.
    fn validation(&self, state: &LoopState) -> Option<String> {
        let t = part(state);
        let score = t.quality_score?;
        Some(format!("score {score}, {} issues open", t.issues.len()))
    }

    /// verify: the score and the open issues it left (an applied fix that changed neither is
    /// no progress).
    fn round_note(&self, state: &LoopState, action: &str, _finish: &Finish) -> Option<String> {
        let validation = self.validation(state).filter(|_| action == "verify")?;
        Some(format!("verify left {validation}"))
    }

    /// The gate passes, and no task of the task list waits to be applied or verified.
    fn goal_met(&self, state: &LoopState) -> bool {
        let t = part(state);
        let task_waits = t.pending_fixes.iter().any(|id| {
            t.proposed_fixes
                .iter()
                .any(|f| f.id == *id && f.from_task_list)
        }) || t
            .applied_fixes
            .iter()
            .any(|f| f.from_task_list && f.verification_result == "pending");
        t.quality_gate == Some(Gate::Pass) && !task_waits
    }

    fn select(&self, state: &LoopState) -> Dispatch {
        select(&part(state))
    }

    fn choose(&self, state: &LoopState, action: &str) -> Result<Dispatch, String> {
        let t = part(state);
        match action {
            "init" if t.initialized_at.is_some() => Err("the loop is initialised already".into()),
            "init" => Ok(Dispatch::new("init")),
            _ if t.initialized_at.is_none() => Err("init first".into()),
            "apply-fix" => match t.pending_fixes.first() {
                Some(fix) => Ok(Dispatch {
                    task_id: Some(fix.clone()),
                    ..Dispatch::new("apply-fix")
                }),
                None => Err("no fix is pending".into()),
            },
            "verify"
                if !t
                    .applied_fixes
                    .iter()
                    .any(|f| f.verification_result == "pending") =>
            {
                Err("no applied fix waits for verification".into())
            }
            "complete" => Ok(complete(&t)),
            other => Ok(Dispatch::new(other)),
        }
    }

    fn begin(&self, state: &mut LoopState, dispatch: &Dispatch, _now: &str) {
        if dispatch.action == "gemini-analysis" {
            let skill = state.skill();
            let mut t: TuningState = skill.part();
            t.gemini_analysis.status = "running".into();
            skill.set_part(&t);
        }
    }

    fn asked(&self, state: &mut LoopState, dispatch: &Dispatch) {
        if dispatch.action == "analyze-requirements" {
            let skill = state.skill();
            let mut t: TuningState = skill.part();
            t.requirement_analysis.status = "needs_clarification".into();
            skill.set_part(&t);
        }
    }

    fn validate(&self, action: &str, result: &ActionResult) -> Result<(), String> {
        let updates = &result.state_updates;
        match action {
            "analyze-requirements" => match opt_str(updates, "coverage")? {
                Some("satisfied" | "partial" | "unsatisfied") => Ok(()),
                Some(other) => Err(format!(
                    "state_updates.coverage must be satisfied, partial or unsatisfied, not {other:?}"
                )),
                None => Err("state_updates.coverage is required for analyze-requirements".into()),
            },
            a if a == "gemini-analysis" || diagnosis_area(a).is_some() => {
                let required = a != "gemini-analysis";
                match updates.get("issues") {
                    None if required => Err(format!(
                        "state_updates.issues is required for {a} (may be [])"
                    )),
                    None => Ok(()),
                    Some(v) => issue_specs(v).map(|_| ()),
                }
            }
            "propose-fixes" => match updates.get("fixes") {
                None => Err("state_updates.fixes is required for propose-fixes (may be [])".into()),
                Some(v) => fix_specs(v).map(|_| ()),
            },
            "verify" => {
                if let Some(v) = updates.get("results") {
                    verify_results(v)?;
                }
                if let Some(v) = updates.get("resolved_issues") {
                    serde_json::from_value::<Vec<String>>(v.clone())
                        .map_err(|e| format!("state_updates.resolved_issues: {e}"))?;
                }
                Ok(())
            }
            "generate-report" | "complete" => opt_str(updates, "summary").map(|_| ()),
            _ => Ok(()),
        }
    }

    fn apply(
        &self,
        state: &mut LoopState,
        dispatch: &Dispatch,
        finish: &Finish,
        inputs: &Inputs,
    ) -> Option<LoopEnd> {
        let result = finish.result();
        let skill = state.skill();
        let mut t: TuningState = skill.part();
        let end = apply(&mut t, dispatch, result, &inputs.now);
        if let Some(LoopEnd::Completed(outcome)) = &end {
            skill.outcome = Some(outcome.as_str().to_owned());
        }
        skill.set_part(&t);
        end
    }

    /// A task joins as a fix of its own, pending: applied by `apply-fix` and verified like a
    /// proposed one.
    fn absorb_tasks(&self, state: &mut LoopState, listed: &[ListedTask], _now: &str) -> usize {
        let Some(skill) = state.skill_state.as_mut() else {
            return 0;
        };
        let mut t: TuningState = skill.part();
        let mut joined = 0;
        for task in listed {
            let known = t.proposed_fixes.iter().any(|f| f.id == task.id)
                || t.pending_fixes.contains(&task.id)
                || t.applied_fixes.iter().any(|f| f.id == task.id);
            if known {
                continue;
            }
            if t.pending_fixes.len() >= MAX_FIXES {
                break; // the fixes waiting are as many as it keeps
            }
            t.proposed_fixes.push(Fix {
                id: task.id.clone(),
                description: task.description.clone(),
                from_task_list: true,
                ..Fix::default()
            });
            t.pending_fixes.push(task.id.clone());
            joined += 1;
        }
        if joined > 0 {
            keep_proposals(&mut t, |_| true);
            skill.set_part(&t);
        }
        joined
    }

    fn init_part(&self, skill: &mut SkillState) {
        let mut t: TuningState = skill.part();
        t.round = t.round.max(1);
        skill.set_part(&t);
    }

    fn rebuild(
        &self,
        _: &mut SkillState,
        _: Vec<ListedTask>,
        _: &dyn Fn(&str) -> Option<String>,
        _: &str,
    ) -> Result<(), String> {
        // Its target and findings live nowhere else: a backup is its only way back.
        Err("a skill-tuning loop's fields cannot be rebuilt from its progress files".into())
    }

    fn problems(&self, skill: &SkillState) -> Vec<String> {
        match skill.try_part::<TuningState>() {
            Ok(_) => Vec::new(),
            Err(e) => vec![format!("skill_state: {e}")],
        }
    }

    fn task(&self, state: &LoopState, dispatch: &Dispatch) -> Option<(String, String)> {
        let id = dispatch.task_id.as_deref()?;
        let t = part(state);
        let fix = t.proposed_fixes.iter().find(|f| f.id == id)?;
        Some((fix.id.clone(), fix.description.clone()))
    }

    fn prompt_vars(&self, state: &LoopState, dispatch: &Dispatch) -> Vec<(&'static str, String)> {
        view::prompt_vars(&part(state), dispatch)
    }

    fn view(&self, state: &LoopState) -> super::View {
        view::view(&part(state))
    }

    fn notes(
        &self,
        state: &LoopState,
        dispatch: &Dispatch,
        finish: &Finish,
        now: &str,
    ) -> Vec<super::Note> {
        view::notes(&part(state), state.current_iteration, dispatch, finish, now)
    }

    fn report(&self, state: &LoopState) -> (Option<String>, String) {
        view::report(&part(state))
    }

    fn reset_failed(&self, skill: &mut SkillState) -> usize {
        let mut t: TuningState = skill.part();
        let mut reset = 0;
        if t.requirement_analysis.status == "failed" {
            t.requirement_analysis.status = "pending".into();
            reset += 1;
        }
        for area in DIAGNOSES {
            if t.diagnosis.get(area).is_some_and(|d| d.status == "failed") {
                t.diagnosis.set(area, None);
                reset += 1;
            }
        }
        if t.report.as_ref().is_some_and(|r| r.status == "failed") {
            t.report = None;
            reset += 1;
        }
        skill.set_part(&t);
        reset
    }

    /// Its fixes' ids: a task joins as a fix.
    fn task_ids(&self, skill: &SkillState) -> Vec<String> {
        let t: TuningState = skill.part();
        let ids = t.proposed_fixes.iter().map(|f| f.id.clone());
        let applied = t.applied_fixes.iter().map(|f| f.id.clone());
        ids.chain(applied).chain(t.pending_fixes).collect()
    }
}

/// A result's effect on the workflow's fields; how the loop ends, if it does.
fn apply(
    t: &mut TuningState,
    dispatch: &Dispatch,
    result: Option<&ActionResult>,
    now: &str,
) -> Option<LoopEnd> {
    let ok = result.is_some();
    let status = if ok { "completed" } else { "failed" };
    let updates = result.map(|r| &r.state_updates);
    let summary = result.map(|r| r.summary.clone()).filter(|s| !s.is_empty());
    let action = dispatch.action.as_str();
    match action {
        "init" => {
            // Skipped after its retries, too: the loop moves on.
            t.initialized_at = Some(now.to_owned());
            t.round = t.round.max(1);
        }
        "analyze-requirements" => {
            let r = &mut t.requirement_analysis;
            r.status = status.into();
            r.summary = summary;
            if let Some(Ok(Some(coverage))) = updates.map(|u| opt_str(u, "coverage")) {
                r.coverage = Some(coverage.to_owned());
            }
        }
        "gemini-analysis" => {
            t.gemini_analysis.status = status.into();
            t.gemini_analysis.round = t.round;
            t.gemini_analysis.summary = summary;
            t.gemini_analysis_requested = false;
            add_issues(t, updates, "second-opinion");
        }
        "generate-report" => {
            t.report = Some(Report {
                status: status.into(),
                summary,
                at: Some(now.to_owned()),
            });
            grade(t);
        }
        "propose-fixes" => propose(t, updates),
        "apply-fix" => applied(t, dispatch.task_id.as_deref()?, result, now),
        "verify" => {
            verify(t, updates);
            grade(t);
            if new_round_due(t) {
                new_round(t);
            }
        }
        "complete" => {
            let outcome = dispatch
                .outcome
                .or_else(|| complete(t).outcome)
                .unwrap_or(Outcome::Incomplete);
            t.summary = updates
                .and_then(|u| opt_str(u, "summary").ok().flatten())
                .map(str::to_owned)
                .or(summary);
            return Some(LoopEnd::Completed(outcome));
        }
        a => {
            if let Some(area) = diagnosis_area(a) {
                let found = add_issues(t, updates, area);
                let result = DiagnosisResult {
                    status: status.into(),
                    issues_found: found,
                    summary,
                    at: Some(now.to_owned()),
                };
                t.diagnosis.set(area, Some(result));
            }
        }
    }
    None
}

/// propose-fixes: this round's proposals, each given an id and made pending.
fn propose(t: &mut TuningState, updates: Option<&Map<String, Value>>) {
    t.proposed_round = t.round;
    let specs = updates
        .and_then(|u| u.get("fixes"))
        .and_then(|v| fix_specs(v).ok())
        .unwrap_or_default();
    keep_proposals(t, |_| false);
    for spec in specs.into_iter().take(MAX_FIXES) {
        t.fix_seq += 1;
        let fix = Fix {
            id: format!("FIX-{:03}", t.fix_seq),
            ..spec
        };
        t.pending_fixes.push(fix.id.clone());
        t.proposed_fixes.push(fix);
    }
    t.pending_fixes.truncate(MAX_FIXES);
}

/// apply-fix: the fix leaves the pending ones; applied, it waits for a verify (one that could
/// not be applied has nothing to verify: it failed).
fn applied(t: &mut TuningState, id: &str, result: Option<&ActionResult>, now: &str) {
    let ok = result.is_some();
    t.pending_fixes.retain(|f| f != id);
    let fix = t.proposed_fixes.iter().find(|f| f.id == id).cloned();
    t.applied_fixes.push(AppliedFix {
        id: id.to_owned(),
        issue_ids: fix
            .as_ref()
            .map(|f| f.issue_ids.clone())
            .unwrap_or_default(),
        from_task_list: fix.as_ref().is_some_and(|f| f.from_task_list),
        description: fix.map(|f| f.description).unwrap_or_default(),
        applied_at: ok.then(|| now.to_owned()),
        verification_result: if ok { "pending" } else { "fail" }.into(),
        round: t.round,
        files_changed: result.map(|r| r.files_changed.clone()).unwrap_or_default(),
    });
    if t.applied_fixes.len() > MAX_FIXES {
        t.applied_fixes.remove(0);
    }
}

/// Judges the applied fixes waiting for it (a fix the result does not name failed), and drops
/// the issues the result says are resolved.
fn verify(t: &mut TuningState, updates: Option<&Map<String, Value>>) {
    let results = updates
        .and_then(|u| u.get("results"))
        .and_then(|v| verify_results(v).ok())
        .unwrap_or_default();
    for fix in &mut t.applied_fixes {
        if fix.verification_result == "pending" {
            let passed = results.iter().any(|(id, pass)| *id == fix.id && *pass);
            fix.verification_result = if passed { "pass" } else { "fail" }.into();
        }
    }
    let resolved: Vec<String> = updates
        .and_then(|u| u.get("resolved_issues"))
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default();
    let before = t.issues.len();
    t.issues.retain(|i| !resolved.contains(&i.id));
    t.resolved_issues += (before - t.issues.len()) as u64;
}

/// The issue counts, the score and the gate, from the issues as they are.
fn grade(t: &mut TuningState) {
    t.issues_by_severity = SeverityCounts::of(&t.issues);
    let (score, gate) = quality(t.issues_by_severity);
    t.quality_score = Some(score);
    t.quality_gate = Some(gate);
}

/// A new round (the seed's priority 12) needs critical or high issues left and a fix applied and
/// verified in this round; without a verified fix another round would find the same.
fn new_round_due(t: &TuningState) -> bool {
    let serious = t.issues_by_severity.critical + t.issues_by_severity.high > 0;
    let verified = t
        .applied_fixes
        .iter()
        .any(|f| f.round == t.round && f.verification_result == "pass");
    serious && verified
}

/// Starts a round: the diagnosis (each of its keys back to null), the report and the proposals
/// are this round's.
fn new_round(t: &mut TuningState) {
    t.round += 1;
    t.diagnosis = Default::default();
    t.report = None;
    keep_proposals(t, |_| false);
}

/// Keeps of the proposed fixes those still pending (a fix is applied by its record), and of the
/// others those `keep` says, the newest, within [`MAX_FIXES`].
fn keep_proposals(t: &mut TuningState, keep: impl Fn(&Fix) -> bool) {
    let pending = &t.pending_fixes;
    t.proposed_fixes
        .retain(|f| pending.contains(&f.id) || keep(f));
    while t.proposed_fixes.len() > MAX_FIXES {
        match t
            .proposed_fixes
            .iter()
            .position(|f| !t.pending_fixes.contains(&f.id))
        {
            Some(done) => t.proposed_fixes.remove(done),
            None => break,
        };
    }
}

/// Adds the issues of a result (their ids given here, their category the area's unless they
/// name one); returns how many.
fn add_issues(t: &mut TuningState, updates: Option<&Map<String, Value>>, area: &str) -> u64 {
    let specs = updates
        .and_then(|u| u.get("issues"))
        .and_then(|v| issue_specs(v).ok())
        .unwrap_or_default();
    let count = specs.len() as u64;
    for spec in specs {
        t.issue_seq += 1;
        let issue = Issue {
            id: format!("ISS-{:03}", t.issue_seq),
            category: if spec.category.is_empty() {
                area.to_owned()
            } else {
                spec.category
            },
            ..spec
        };
        if t.issues.len() >= MAX_ISSUES {
            // The least severe, oldest issue makes room for a more severe one.
            let Some((least, _)) = t
                .issues
                .iter()
                .enumerate()
                .max_by_key(|(i, issue)| (issue.severity, std::cmp::Reverse(*i)))
            else {
                continue;
            };
            if t.issues[least].severity <= issue.severity {
                continue;
            }
            t.issues.remove(least);
        }
        t.issues.push(issue);
    }
    t.issues_by_severity = SeverityCounts::of(&t.issues);
    count
}

/// The issues of a result: each `{severity, description, category?, location?, evidence?}`.
fn issue_specs(v: &Value) -> Result<Vec<Issue>, String> {
    specs(v, "issues", |issue: &Issue| &issue.description)
}

/// The fixes of a result: each `{description, issue_ids?, strategy?, risk?}`.
fn fix_specs(v: &Value) -> Result<Vec<Fix>, String> {
    specs(v, "fixes", |fix: &Fix| &fix.description)
}

/// `state_updates[key]`: a list of objects whose id loopd gives, each with a description.
fn specs<T: serde::de::DeserializeOwned>(
    v: &Value,
    key: &str,
    description: impl Fn(&T) -> &str,
) -> Result<Vec<T>, String> {
    let Value::Array(items) = v else {
        return Err(format!("state_updates.{key} must be an array"));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let at = format!("state_updates.{key}[{i}]");
            let mut item = item.clone();
            if let Value::Object(map) = &mut item {
                map.entry("id")
                    .or_insert_with(|| Value::String(String::new()));
            }
            let spec: T = serde_json::from_value(item).map_err(|e| format!("{at}: {e}"))?;
            checked_text(description(&spec), &at)?;
            Ok(spec)
        })
        .collect()
}

/// A description: not empty, within [`MAX_DESCRIPTION`].
fn checked_text(text: &str, what: &str) -> Result<(), String> {
    if text.trim().is_empty() {
        return Err(format!("{what} needs a non-empty description"));
    }
    if text.len() > MAX_DESCRIPTION {
        return Err(format!(
            "{what}: a description of {} bytes is over the limit of {MAX_DESCRIPTION}",
            text.len()
        ));
    }
    Ok(())
}

/// verify's `results`: `[{"fix_id", "result": "pass" | "fail"}]`, as `(id, passed)`.
fn verify_results(v: &Value) -> Result<Vec<(String, bool)>, String> {
    let Value::Array(items) = v else {
        return Err("state_updates.results must be an array".into());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let at = |e: &str| format!("state_updates.results[{i}]: {e}");
            let Value::Object(map) = item else {
                return Err(at("must be an object"));
            };
            let id = opt_str(map, "fix_id")
                .map_err(|e| at(&e))?
                .ok_or_else(|| at("fix_id is required"))?;
            let passed = match opt_str(map, "result").map_err(|e| at(&e))? {
                Some("pass") => true,
                Some("fail") => false,
                _ => return Err(at("result must be pass or fail")),
            };
            Ok((id.to_owned(), passed))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{ErrorEntry, Status};
    use crate::workflow::{Decision, Limits, check, decide, record_attempt, record_finish};
    use serde_json::json;
    use state::{Severity, Severity::*, SeverityCounts};

    const LIMITS: Limits = Limits {
        max_iterations: 5,
        max_errors: 3,
        max_cost_usd: None,
        max_tokens: None,
        no_progress: crate::no_progress::Rule {
            rounds: 0,
            then: crate::no_progress::Then::Pause,
        },
    };

    fn issue(id: &str, severity: Severity) -> Issue {
        Issue {
            id: id.into(),
            category: "context".into(),
            severity,
            description: format!("issue {id}"),
            ..Issue::default()
        }
    }

    fn done(status: &str) -> Option<DiagnosisResult> {
        Some(DiagnosisResult {
            status: status.into(),
            ..DiagnosisResult::default()
        })
    }

    /// Initialised, requirements analysed (satisfied), no diagnosis yet.
    fn analysed() -> TuningState {
        let mut t = TuningState::new("s".into(), "skills/s".into(), Vec::new(), None);
        t.initialized_at = Some("2026-01-01T00:00:00.000Z".into());
        t.requirement_analysis.status = "completed".into();
        t.requirement_analysis.coverage = Some("satisfied".into());
        t
    }

    /// Every diagnosis of the round done, the report written.
    fn reported(issues: Vec<Issue>) -> TuningState {
        let mut t = analysed();
        for area in DIAGNOSES {
            t.diagnosis.set(area, done("completed"));
        }
        t.issues = issues;
        grade(&mut t);
        t.report = Some(Report {
            status: "completed".into(),
            ..Report::default()
        });
        t
    }

    fn state(t: &TuningState) -> LoopState {
        let mut s = LoopState {
            loop_id: "l".into(),
            status: Status::Running,
            ..LoopState::default()
        };
        s.skill().workflow = Some(NAME.into());
        s.skill().set_part(t);
        s
    }

    fn action(t: &TuningState) -> String {
        select(t).action
    }

    #[test]
    fn termination_follows_the_seeds_order() {
        let serious = reported(vec![issue("ISS-001", Critical)]);
        let passing = reported(vec![issue("ISS-001", Medium)]);
        // (state, errors, iteration, expected)
        let cases: Vec<(&TuningState, u64, u64, &str)> = vec![
            (&serious, 3, 0, "abort"),
            (&passing, 3, 5, "abort"), // the error limit before everything else
            (&serious, 0, 5, "complete:iteration_limit"),
            (&passing, 0, 5, "complete:passed"), // the limit, with the gate passing
            (&passing, 0, 1, "complete:passed"), // the gate passes
            (&serious, 0, 1, "select"),
        ];
        for (t, errors, iteration, expected) in cases {
            let mut s = state(t);
            s.current_iteration = iteration;
            s.skill().error_count = errors;
            s.skill().errors.push(ErrorEntry {
                action: "verify".into(),
                message: "boom".into(),
                timestamp: "t".into(),
                extra: Default::default(),
            });
            let got = match check(&SkillTuning, &s, LIMITS) {
                None => "select".to_owned(),
                Some(Decision::Abort(_)) => "abort".to_owned(),
                Some(Decision::Run(d)) => format!("{}:{}", d.action, d.outcome.unwrap().as_str()),
                Some(other) => format!("{other:?}"),
            };
            assert_eq!(got, expected, "errors {errors}, iteration {iteration}");
        }
    }

    #[test]
    fn selection_follows_the_seeds_thirteen_priorities() {
        let fresh = TuningState::new("s".into(), "p".into(), Vec::new(), None);
        let mut unclear = analysed();
        unclear.requirement_analysis.status = "needs_clarification".into();
        let mut unsatisfied = analysed();
        unsatisfied.requirement_analysis.coverage = Some("unsatisfied".into());
        let mut requested = analysed();
        requested.gemini_analysis_requested = true;
        let mut architecture = analysed();
        architecture.focus_areas = vec!["architecture".into()];
        let mut critical = analysed();
        critical.issues = vec![issue("ISS-001", Critical)];
        grade(&mut critical);
        let mut running = analysed();
        running.gemini_analysis.status = "running".into();
        running.gemini_analysis.round = 1;
        let mut second_opinion_done = critical.clone();
        second_opinion_done.gemini_analysis.round = 1;
        let mut memory_next = analysed();
        memory_next.diagnosis.context = done("completed");
        let mut focused = analysed();
        focused.focus_areas = vec!["docs".into()];
        let mut failed_counts_as_done = analysed();
        for area in DIAGNOSES {
            failed_counts_as_done.diagnosis.set(area, done("failed"));
        }
        let with_issues = reported(vec![issue("ISS-001", High), issue("ISS-002", High)]);
        let mut high = reported(vec![issue("ISS-001", High), issue("ISS-002", High)]);
        high.gemini_analysis.round = 1;
        let mut proposed = high.clone();
        proposed.proposed_round = 1;
        proposed.pending_fixes = vec!["FIX-001".into()];
        let mut applied = proposed.clone();
        applied.pending_fixes.clear();
        applied.applied_fixes.push(AppliedFix {
            id: "FIX-001".into(),
            verification_result: "pending".into(),
            round: 1,
            ..AppliedFix::default()
        });
        let mut nothing_left = applied.clone();
        nothing_left.applied_fixes[0].verification_result = "fail".into();
        let no_issues = reported(Vec::new());
        let mut requirements = analysed();
        requirements.requirement_analysis.status = "pending".into();
        let diagnosis = analysed();

        let cases: Vec<(&str, &TuningState, &str)> = vec![
            ("1 init", &fresh, "init"),
            ("2 requirements", &requirements, "analyze-requirements"),
            ("3 clarified", &unclear, "analyze-requirements"),
            ("4 coverage unsatisfied", &unsatisfied, "gemini-analysis"),
            ("5 requested", &requested, "gemini-analysis"),
            ("5 focus area", &architecture, "gemini-analysis"),
            ("5 critical issue", &critical, "gemini-analysis"),
            ("6 running", &running, "gemini-analysis"),
            ("5 once a round", &second_opinion_done, "diagnose-context"),
            ("7 first diagnosis", &diagnosis, "diagnose-context"),
            ("7 in order", &memory_next, "diagnose-memory"),
            ("7 focus", &focused, "diagnose-docs"),
            ("8 report", &failed_counts_as_done, "generate-report"),
            ("9 propose", &high, "propose-fixes"),
            ("9 second opinion first", &with_issues, "propose-fixes"),
            ("10 apply", &proposed, "apply-fix"),
            ("11 verify", &applied, "verify"),
            ("13 nothing left", &nothing_left, "complete"),
            ("13 no issues", &no_issues, "complete"),
        ];
        for (name, t, expected) in cases {
            assert_eq!(action(t), expected, "{name}");
        }
        assert_eq!(select(&proposed).task_id.as_deref(), Some("FIX-001"));
    }

    #[test]
    fn the_gate_is_computed_from_the_issues_at_each_threshold() {
        let counts = |critical, high, medium, low| SeverityCounts {
            critical,
            high,
            medium,
            low,
        };
        let cases = [
            (counts(0, 0, 0, 0), 100, Gate::Pass),
            (counts(0, 2, 0, 0), 70, Gate::Pass),
            (counts(0, 2, 2, 0), 60, Gate::Pass), // a score of 60 passes
            (counts(0, 2, 2, 1), 59, Gate::Review), // 59 does not
            (counts(0, 3, 0, 0), 55, Gate::Review), // 3 high never pass
            (counts(1, 0, 0, 0), 75, Gate::Review), // a critical issue never passes
            (counts(0, 4, 0, 0), 40, Gate::Review), // 40 is review
            (counts(0, 4, 0, 1), 39, Gate::Fail), // 39 fails
            (counts(3, 3, 3, 3), 0, Gate::Fail),  // floored at 0
        ];
        for (c, score, gate) in cases {
            assert_eq!(quality(c), (score, gate), "{c:?}");
        }
    }

    fn finish(updates: Value) -> Finish {
        Finish::Success(ActionResult {
            state_updates: serde_json::from_value(updates).unwrap(),
            ..ActionResult::bare_success()
        })
    }

    fn apply_result(t: &mut TuningState, action: &str, task: Option<&str>, f: &Finish) {
        let d = Dispatch {
            task_id: task.map(str::to_owned),
            ..Dispatch::new(action)
        };
        let result = match f {
            Finish::Success(r) => Some(r),
            Finish::Failed(_) => None,
        };
        apply(t, &d, result, "2026-01-01T00:00:00.000Z");
    }

    #[test]
    fn a_new_round_needs_a_verified_fix_else_the_loop_completes() {
        // The seed looped on diagnose-context when no fix had been applied.
        let mut t = reported(vec![issue("ISS-001", Critical)]);
        t.gemini_analysis.round = 1;
        apply_result(&mut t, "propose-fixes", None, &finish(json!({"fixes": []})));
        assert_eq!(action(&t), "complete");

        // A fix that fails verification starts no round either.
        let mut t = reported(vec![issue("ISS-001", Critical), issue("ISS-002", High)]);
        t.gemini_analysis.round = 1;
        let fixes = json!({"fixes": [{"issue_ids": ["ISS-001"], "description": "trim it"}]});
        apply_result(&mut t, "propose-fixes", None, &finish(fixes));
        apply_result(&mut t, "apply-fix", Some("FIX-001"), &finish(json!({})));
        let failed = json!({"results": [{"fix_id": "FIX-001", "result": "fail"}]});
        apply_result(&mut t, "verify", None, &finish(failed));
        assert_eq!((t.round, action(&t).as_str()), (1, "complete"));
    }

    #[test]
    fn a_new_round_resets_the_diagnosis_by_its_keys() {
        // The seed wrote `'diagnosis.context': null`, which became a literal key.
        let mut t = reported(vec![issue("ISS-001", Critical), issue("ISS-002", High)]);
        t.gemini_analysis.round = 1;
        let fixes = json!({"fixes": [{"issue_ids": ["ISS-001"], "description": "trim it"}]});
        apply_result(&mut t, "propose-fixes", None, &finish(fixes));
        apply_result(&mut t, "apply-fix", Some("FIX-001"), &finish(json!({})));
        let verified = json!({"results": [{"fix_id": "FIX-001", "result": "pass"}],
                              "resolved_issues": ["ISS-001"]});
        apply_result(&mut t, "verify", None, &finish(verified));
        assert_eq!(t.round, 2, "a high issue is left and a fix was verified");
        assert_eq!(t.issues.len(), 1);
        assert_eq!(t.resolved_issues, 1);
        let s = state(&t);
        let written = serde_json::to_value(s.skill_state.as_ref().unwrap()).unwrap();
        let keys = written.as_object().unwrap().keys();
        assert!(keys.clone().all(|k| !k.contains('.')), "{keys:?}");
        assert_eq!(
            written["diagnosis"],
            json!({"context": null, "memory": null, "dataflow": null, "agent": null,
                   "docs": null, "token_consumption": null})
        );
        // The second opinion is due again (round 2 with issues left), then diagnose-context.
        assert_eq!(action(&t), "gemini-analysis");
        t.gemini_analysis.round = 2;
        assert_eq!(action(&t), "diagnose-context");
    }

    #[test]
    fn a_running_second_opinion_is_finished_never_started_twice() {
        // The seed checked its triggers (5) before "running" (6) and started a second one.
        let mut t = analysed();
        t.gemini_analysis_requested = true;
        let mut s = state(&t);
        let d = Dispatch::new("gemini-analysis");
        assert_eq!(SkillTuning.select(&s), d);
        SkillTuning.begin(&mut s, &d, "now");
        let running: TuningState = s.skill_state.as_ref().unwrap().part();
        assert_eq!(running.gemini_analysis.status, "running");
        assert_eq!(select(&running), d, "left running: finished, once");
        let found = json!({"issues": [{"severity": "critical", "description": "x"}]});
        SkillTuning.apply(&mut s, &d, &finish(found), &Inputs::default());
        let after: TuningState = s.skill_state.as_ref().unwrap().part();
        assert_eq!(after.gemini_analysis.status, "completed");
        assert!(!after.gemini_analysis_requested);
        // Its own critical issue does not trigger it again in this round.
        assert_eq!(select(&after).action, "diagnose-context");
    }

    #[test]
    fn each_finished_action_gets_its_own_history_entry_and_only_verify_counts() {
        // The seed overwrote the previous entry.
        let mut s = state(&analysed());
        for (n, a) in ["diagnose-context", "diagnose-memory", "verify"]
            .iter()
            .enumerate()
        {
            let d = Dispatch::new(a);
            record_attempt(
                &mut s,
                crate::state::HistoryEntry {
                    action: (*a).into(),
                    attempt: 1,
                    outcome: "success".into(),
                    ..Default::default()
                },
            );
            let f = finish(json!({"issues": []}));
            SkillTuning.apply(&mut s, &d, &f, &Inputs::default());
            record_finish(&SkillTuning, &mut s, &d, &f, "now");
            assert_eq!(s.skill_state.as_ref().unwrap().action_history.len(), n + 1);
        }
        let history = &s.skill_state.as_ref().unwrap().action_history;
        let names: Vec<&str> = history.iter().map(|h| h.action.as_str()).collect();
        assert_eq!(names, ["diagnose-context", "diagnose-memory", "verify"]);
        assert_eq!(s.current_iteration, 1);
    }

    #[test]
    fn a_spent_budget_ends_a_skill_tuning_loop_as_any_other() {
        let mut s = state(&analysed());
        s.max_cost_usd = Some(1.0);
        s.skill().usage.cost_usd = 1.5;
        match decide(&SkillTuning, &s, LIMITS) {
            Decision::Abort(reason) => assert!(reason.contains("budget exceeded"), "{reason}"),
            other => panic!("expected the budget to end it, got {other:?}"),
        }
    }

    #[test]
    fn the_error_limit_aborts_and_a_failed_action_is_skipped() {
        let mut s = state(&analysed());
        s.skill().error_count = 3;
        assert!(matches!(
            decide(&SkillTuning, &s, LIMITS),
            Decision::Abort(_)
        ));
        // Under the limit, a diagnosis that failed after its retries is passed over.
        let mut t = analysed();
        apply_result(
            &mut t,
            "diagnose-context",
            None,
            &Finish::Failed("boom".into()),
        );
        assert_eq!(t.diagnosis.context.as_ref().unwrap().status, "failed");
        assert_eq!(action(&t), "diagnose-memory");
        // And retry runs it again.
        let mut s = state(&t);
        assert_eq!(SkillTuning.reset_failed(s.skill_state.as_mut().unwrap()), 1);
        assert_eq!(SkillTuning.select(&s).action, "diagnose-context");
    }

    #[test]
    fn results_that_do_not_fit_are_refused_before_anything_is_applied() {
        let with = |u: Value| ActionResult {
            state_updates: serde_json::from_value(u).unwrap(),
            ..ActionResult::bare_success()
        };
        let ok = [
            ("analyze-requirements", json!({"coverage": "partial"})),
            ("diagnose-docs", json!({"issues": []})),
            ("gemini-analysis", json!({})),
            ("propose-fixes", json!({"fixes": [{"description": "d"}]})),
            (
                "verify",
                json!({"results": [{"fix_id": "FIX-001", "result": "pass"}]}),
            ),
        ];
        for (a, u) in ok {
            assert_eq!(SkillTuning.validate(a, &with(u.clone())), Ok(()), "{a} {u}");
        }
        let bad = [
            ("analyze-requirements", json!({})),
            ("analyze-requirements", json!({"coverage": "mostly"})),
            ("diagnose-docs", json!({})),
            (
                "diagnose-docs",
                json!({"issues": [{"severity": "urgent", "description": "d"}]}),
            ),
            (
                "diagnose-docs",
                json!({"issues": [{"severity": "low", "description": " "}]}),
            ),
            ("propose-fixes", json!({"fixes": "all"})),
            (
                "verify",
                json!({"results": [{"fix_id": "FIX-001", "result": "maybe"}]}),
            ),
        ];
        for (a, u) in bad {
            assert!(
                SkillTuning.validate(a, &with(u.clone())).is_err(),
                "{a} {u}"
            );
        }
    }

    #[test]
    fn issues_are_bounded_and_a_more_severe_one_takes_the_place_of_the_least() {
        let mut t = analysed();
        t.issues = (0..MAX_ISSUES)
            .map(|i| issue(&format!("ISS-{i:03}"), if i == 5 { Low } else { Medium }))
            .collect();
        let one = |s: &str| json!({"issues": [{"severity": s, "description": "new"}]});
        apply_result(&mut t, "diagnose-docs", None, &finish(one("low")));
        assert_eq!(t.issues.len(), MAX_ISSUES);
        assert!(
            t.issues.iter().all(|i| i.description != "new"),
            "a low one waits"
        );
        apply_result(&mut t, "diagnose-agent", None, &finish(one("critical")));
        assert_eq!(t.issues.len(), MAX_ISSUES);
        assert!(t.issues.iter().any(|i| i.severity == Critical));
        assert!(
            t.issues.iter().all(|i| i.id != "ISS-005"),
            "the low one made room"
        );
    }
}
