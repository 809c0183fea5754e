//! What skill-tuning shows of its fields: the prompt placeholders, the rows of `status`, its
//! progress file (`tuning.md`) and its sections of `summary.md`.

use super::state::{DIAGNOSES, TuningState};
use super::{diagnoses, diagnosis_area};
use crate::workflow::{Dispatch, Finish, Note, Row, View};

/// The issues, one line each, most severe first.
fn issue_lines(t: &TuningState) -> Vec<String> {
    let mut issues: Vec<_> = t.issues.iter().collect();
    issues.sort_by_key(|i| i.severity);
    issues
        .into_iter()
        .map(|i| {
            let at = i
                .location
                .as_deref()
                .map(|l| format!(" ({l})"))
                .unwrap_or_default();
            format!(
                "{} [{}, {}] {}{at}",
                i.id,
                i.severity.as_str(),
                i.category,
                i.description
            )
        })
        .collect()
}

/// The fixes, one line each, with where they stand.
fn fix_lines(t: &TuningState) -> Vec<String> {
    let applied = t.applied_fixes.iter().map(|f| {
        format!(
            "{} [applied, verification {}] {}",
            f.id, f.verification_result, f.description
        )
    });
    let pending = t
        .proposed_fixes
        .iter()
        .filter(|f| t.pending_fixes.contains(&f.id))
        .map(|f| {
            format!(
                "{} [pending, for {}] {}",
                f.id,
                f.issue_ids.join(", "),
                f.description
            )
        });
    applied.chain(pending).collect()
}

fn gate_text(t: &TuningState) -> String {
    match (t.quality_gate, t.quality_score) {
        (Some(gate), Some(score)) => format!("{} (score {score})", gate.as_str()),
        _ => "not graded yet".to_owned(),
    }
}

fn or_none(lines: Vec<String>) -> String {
    if lines.is_empty() {
        "none".to_owned()
    } else {
        lines.join("\n")
    }
}

/// `{{target_skill}}`, `{{skill_path}}`, `{{focus_areas}}`, `{{issue_description}}`,
/// `{{requirements}}`, `{{diagnosis_area}}`, `{{issues}}`, `{{fixes}}`, `{{quality}}`,
/// `{{round}}`.
pub fn prompt_vars(t: &TuningState, dispatch: &Dispatch) -> Vec<(&'static str, String)> {
    let r = &t.requirement_analysis;
    let requirements = format!(
        "{}; coverage: {}{}",
        r.status,
        r.coverage.as_deref().unwrap_or("unknown"),
        r.summary
            .as_deref()
            .map(|s| format!("; {s}"))
            .unwrap_or_default()
    );
    let focus = if t.focus_areas.is_empty() {
        "all areas".to_owned()
    } else {
        t.focus_areas.join(", ")
    };
    vec![
        ("target_skill", t.target_skill.name.clone()),
        ("skill_path", t.target_skill.path.clone()),
        ("focus_areas", focus),
        (
            "issue_description",
            t.issue_description
                .clone()
                .unwrap_or_else(|| "none given".into()),
        ),
        ("requirements", requirements),
        (
            "diagnosis_area",
            diagnosis_area(&dispatch.action)
                .unwrap_or_default()
                .to_owned(),
        ),
        ("issues", or_none(issue_lines(t))),
        ("fixes", or_none(fix_lines(t))),
        ("quality", gate_text(t)),
        ("round", t.round.to_string()),
    ]
}

/// The gate for `list`, and the skill, the diagnoses, the issues, the fixes and the gate for
/// `status`.
pub fn view(t: &TuningState) -> View {
    let wanted = diagnoses(t);
    let done = wanted
        .iter()
        .filter(|d| t.diagnosis.get(d).is_some())
        .count();
    let areas: Vec<String> = DIAGNOSES
        .iter()
        .filter(|d| wanted.contains(d))
        .map(|d| match t.diagnosis.get(d) {
            Some(r) => format!("{d}: {} ({} issues)", r.status, r.issues_found),
            None => format!("{d}: pending"),
        })
        .collect();
    let c = t.issues_by_severity;
    View {
        progress: match t.quality_gate {
            Some(gate) => gate.as_str().to_owned(),
            None => format!("{done}/{} diagnosed", wanted.len()),
        },
        rows: vec![
            Row {
                label: "skill",
                value: format!("{} ({})", t.target_skill.name, t.target_skill.path),
                lines: Vec::new(),
            },
            Row {
                label: "diagnosis",
                value: format!("round {}: {done}/{} done", t.round, wanted.len()),
                lines: areas,
            },
            Row {
                label: "issues",
                value: format!(
                    "{} open ({} critical, {} high, {} medium, {} low), {} resolved",
                    t.issues.len(),
                    c.critical,
                    c.high,
                    c.medium,
                    c.low,
                    t.resolved_issues
                ),
                lines: issue_lines(t),
            },
            Row {
                label: "fixes",
                value: format!(
                    "{} pending, {} applied",
                    t.pending_fixes.len(),
                    t.applied_fixes.len()
                ),
                lines: fix_lines(t),
            },
            Row {
                label: "gate",
                value: gate_text(t),
                lines: Vec::new(),
            },
        ],
    }
}

/// A section of `tuning.md` for every finished action.
pub fn notes(
    t: &TuningState,
    iteration: u64,
    dispatch: &Dispatch,
    finish: &Finish,
    now: &str,
) -> Vec<Note> {
    let (result, summary) = match finish {
        Finish::Success(r) => ("completed", r.summary.as_str()),
        Finish::Failed(e) => ("failed (skipped)", e.as_str()),
    };
    let mut text = format!(
        "\n## {} (round {}, iteration {iteration})\n\n- result: {result}\n- at: {now}\n",
        dispatch.action, t.round
    );
    if !summary.is_empty() {
        text.push_str(&format!("- summary: {summary}\n"));
    }
    if let Some(fix) = &dispatch.task_id {
        text.push_str(&format!("- fix: {fix}\n"));
    }
    text.push_str(&format!(
        "- issues open: {}; gate: {}\n",
        t.issues.len(),
        gate_text(t)
    ));
    vec![Note::append("tuning.md", text)]
}

/// What `complete` said, and the issues, fixes and gate for `summary.md`.
pub fn report(t: &TuningState) -> (Option<String>, String) {
    let body = format!(
        "\n## Skill\n\n{} ({})\n\n## Quality gate\n\n{}\n\n## Issues left\n\n{}\n\n## Fixes\n\n{}\n",
        t.target_skill.name,
        t.target_skill.path,
        gate_text(t),
        or_none(issue_lines(t)),
        or_none(fix_lines(t)),
    );
    (t.summary.clone(), body)
}
