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
//!
//! The parts: the workflow's choices and rules here; what each result does to the state in
//! `apply`; the state's own part in `state`; what people see in `view`; the tests in `tests`.

mod apply;
pub mod state;
mod view;

use apply::{apply, fix_specs, issue_specs, keep_proposals, verify_results};

use super::{Dispatch, Finish, Inputs, LoopEnd, Outcome, Workflow, opt_str};
use crate::protocol::ActionResult;
use crate::state::ListedTask;
use crate::state::{LoopState, SkillState};
use state::{DIAGNOSES, Fix, Gate, MAX_FIXES, TuningState};

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

#[cfg(test)]
mod tests;
