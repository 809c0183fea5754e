//! What each action's result does to a skill-tuning loop's part of the state: issues diagnosed,
//! fixes proposed, applied and verified, the grade, a new round; the specs checked.

use serde_json::{Map, Value};

use super::*;
use super::{Dispatch, LoopEnd, Outcome, opt_str};
use crate::protocol::ActionResult;
use crate::state::MAX_DESCRIPTION;
use state::{
    AppliedFix, DiagnosisResult, Fix, Issue, MAX_FIXES, MAX_ISSUES, Report, SeverityCounts,
    TuningState, quality,
};

/// A result's effect on the workflow's fields; how the loop ends, if it does.
pub(super) fn apply(
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
pub(super) fn propose(t: &mut TuningState, updates: Option<&Map<String, Value>>) {
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
pub(super) fn applied(t: &mut TuningState, id: &str, result: Option<&ActionResult>, now: &str) {
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
pub(super) fn verify(t: &mut TuningState, updates: Option<&Map<String, Value>>) {
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
pub(super) fn grade(t: &mut TuningState) {
    t.issues_by_severity = SeverityCounts::of(&t.issues);
    let (score, gate) = quality(t.issues_by_severity);
    t.quality_score = Some(score);
    t.quality_gate = Some(gate);
}

/// A new round (the seed's priority 12) needs critical or high issues left and a fix applied and
/// verified in this round; without a verified fix another round would find the same.
pub(super) fn new_round_due(t: &TuningState) -> bool {
    let serious = t.issues_by_severity.critical + t.issues_by_severity.high > 0;
    let verified = t
        .applied_fixes
        .iter()
        .any(|f| f.round == t.round && f.verification_result == "pass");
    serious && verified
}

/// Starts a round: the diagnosis (each of its keys back to null), the report and the proposals
/// are this round's.
pub(super) fn new_round(t: &mut TuningState) {
    t.round += 1;
    t.diagnosis = Default::default();
    t.report = None;
    keep_proposals(t, |_| false);
}

/// Keeps of the proposed fixes those still pending (a fix is applied by its record), and of the
/// others those `keep` says, the newest, within [`MAX_FIXES`].
pub(super) fn keep_proposals(t: &mut TuningState, keep: impl Fn(&Fix) -> bool) {
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
pub(super) fn add_issues(
    t: &mut TuningState,
    updates: Option<&Map<String, Value>>,
    area: &str,
) -> u64 {
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
pub(super) fn issue_specs(v: &Value) -> Result<Vec<Issue>, String> {
    specs(v, "issues", |issue: &Issue| &issue.description)
}

/// The fixes of a result: each `{description, issue_ids?, strategy?, risk?}`.
pub(super) fn fix_specs(v: &Value) -> Result<Vec<Fix>, String> {
    specs(v, "fixes", |fix: &Fix| &fix.description)
}

/// `state_updates[key]`: a list of objects whose id loopd gives, each with a description.
pub(super) fn specs<T: serde::de::DeserializeOwned>(
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
pub(super) fn checked_text(text: &str, what: &str) -> Result<(), String> {
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
pub(super) fn verify_results(v: &Value) -> Result<Vec<(String, bool)>, String> {
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
