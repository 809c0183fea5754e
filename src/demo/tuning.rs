//! The skill-tuning demo: `changelog-writer`, a small skill with four planted problems: its
//! rules repeated in `SKILL.md` (context), a history file appended on every run and read whole
//! (memory), a phase that reads `commits.json` where the one before writes `commits.md`
//! (dataflow), and a phase its docs name that does not exist (docs). The scripted agent finds
//! them by reading the files, proposes a fix for each, edits the files, and verifies by reading
//! them again: the gate then passes.

use std::path::Path;

use anyhow::Result;
use loopd_core::workflow::skill_tuning::state::TuningState;
use serde_json::{Value, json};

use super::read;

const SKILL: &str = "---
name: changelog-writer
description: Writes a CHANGELOG entry from the commits since the last release.
---
# changelog-writer

Run the phases in order: phases/01-collect.md, phases/02-write.md, phases/03-publish.md.

## Rules
Write entries in the imperative mood, grouped as Added, Changed and Fixed.
Leave out merge commits.

## Rules (again, to be sure)
Write entries in the imperative mood, grouped as Added, Changed and Fixed.
Leave out merge commits.
";

const COLLECT: &str = "# Phase 1: collect
Run `git log --oneline` and append every line to history.log, then read all of history.log.
Write the commits since the last tag to commits.md.
";

const WRITE: &str = "# Phase 2: write
Read commits.json and write one CHANGELOG entry per commit, grouped as the rules say.
";

const SKILL_DIR: &str = "skills/changelog-writer";

/// Writes the skill into `dir`; returns the loop the demo creates.
pub fn write_project(dir: &Path) -> Result<loopd_file_driver::create::CreateArgs> {
    let skill = dir.join(SKILL_DIR);
    std::fs::create_dir_all(skill.join("phases"))?;
    std::fs::write(skill.join("SKILL.md"), SKILL)?;
    std::fs::write(skill.join("phases/01-collect.md"), COLLECT)?;
    std::fs::write(skill.join("phases/02-write.md"), WRITE)?;
    Ok(loopd_file_driver::create::CreateArgs {
        workflow: Some(loopd_core::workflow::skill_tuning::NAME.into()),
        tuning: loopd_file_driver::create::TuningArgs {
            target_skill: Some(SKILL_DIR.into()),
            issue: Some("its history keeps growing and some runs find no commits".into()),
            ..Default::default()
        },
        ..Default::default()
    })
}

/// A planted problem still in the files: `(severity, description, location, evidence)`.
type Finding = (&'static str, &'static str, &'static str, &'static str);

/// What the agent finds in one area, reading the skill's files as they are now.
fn detect(root: &Path, area: &str) -> Result<Option<Finding>> {
    let file = |f: &str| read(root, &format!("{SKILL_DIR}/{f}"));
    Ok(match area {
        "context" if file("SKILL.md")?.contains("## Rules (again") => Some((
            "high",
            "the rules are written twice in SKILL.md: every run pays for them twice",
            "SKILL.md: Rules (again, to be sure)",
            "two identical Rules sections",
        )),
        "memory" if file("phases/01-collect.md")?.contains("history.log") => Some((
            "critical",
            "every run appends all commits to history.log and reads it whole: it grows without bound",
            "phases/01-collect.md:2",
            "append every line to history.log, then read all of history.log",
        )),
        "dataflow" if file("phases/02-write.md")?.contains("commits.json") => Some((
            "medium",
            "phase 2 reads commits.json, but phase 1 writes commits.md",
            "phases/02-write.md:2",
            "Read commits.json",
        )),
        "docs"
            if file("SKILL.md")?.contains("03-publish.md")
                && !root.join(SKILL_DIR).join("phases/03-publish.md").exists() =>
        {
            Some((
                "high",
                "SKILL.md names phases/03-publish.md, which does not exist",
                "SKILL.md:7",
                "phases/03-publish.md",
            ))
        }
        _ => None,
    })
}

/// Fixes the problem of an area in the files; returns the file it changed.
fn fix(root: &Path, area: &str) -> Result<Option<&'static str>> {
    let edit = |f: &'static str, from: &str, to: &str| -> Result<Option<&'static str>> {
        let path = root.join(SKILL_DIR).join(f);
        let text = std::fs::read_to_string(&path)?;
        std::fs::write(&path, text.replace(from, to))?;
        Ok(Some(f))
    };
    match area {
        "context" => edit(
            "SKILL.md",
            "\n## Rules (again, to be sure)\nWrite entries in the imperative mood, grouped as Added, Changed and Fixed.\nLeave out merge commits.\n",
            "",
        ),
        "memory" => edit(
            "phases/01-collect.md",
            "Run `git log --oneline` and append every line to history.log, then read all of history.log.\nWrite the commits since the last tag to commits.md.",
            "Run `git log --oneline LAST_TAG..HEAD` and write its lines to commits.md, replacing it.",
        ),
        "dataflow" => edit("phases/02-write.md", "commits.json", "commits.md"),
        "docs" => edit(
            "SKILL.md",
            "phases/02-write.md, phases/03-publish.md.",
            "phases/02-write.md.",
        ),
        _ => Ok(None),
    }
}

/// The loop's own fields, read from its state file as an agent would.
fn tuning(state_file: &str) -> Result<TuningState> {
    let state: Value = serde_json::from_slice(&std::fs::read(state_file)?)?;
    let Some(Value::Object(fields)) = state.get("skill_state") else {
        anyhow::bail!("{state_file} has no skill_state object");
    };
    TuningState::from_fields(fields).map_err(anyhow::Error::msg)
}

/// The scripted executor's result for one action of the skill-tuning loop.
pub fn act(action: &str, root: &Path, env: impl Fn(&str) -> String) -> Result<Value> {
    let say = |line: String| crate::outln!("{line}");
    if let Some(area) = action
        .strip_prefix("diagnose-")
        .map(|a| a.replace('-', "_"))
    {
        let issues: Vec<Value> = detect(root, &area)?
            .map(|(severity, description, location, evidence)| {
                json!({"severity": severity, "description": description,
                       "location": location, "evidence": evidence})
            })
            .into_iter()
            .collect();
        say(format!("{area}: {} issue(s)", issues.len()))?;
        return Ok(json!({
            "status": "success",
            "summary": format!("{area}: {} issue(s) found", issues.len()),
            "state_updates": {"issues": issues}
        }));
    }
    Ok(match action {
        "init" => {
            let lines = read(root, &format!("{SKILL_DIR}/SKILL.md"))?
                .lines()
                .count();
            say(format!(
                "reading {SKILL_DIR}: SKILL.md ({lines} lines) and 2 phases"
            ))?;
            json!({"status": "success",
                   "summary": format!("changelog-writer: SKILL.md of {lines} lines, 2 phase files")})
        }
        "analyze-requirements" => json!({
            "status": "success",
            "summary": "collect commits since the last tag, write a grouped CHANGELOG entry",
            "state_updates": {"coverage": "satisfied"}
        }),
        "gemini-analysis" => json!({
            "status": "success",
            "summary": "a second look found nothing the diagnoses missed",
            "state_updates": {"issues": []}
        }),
        "generate-report" => {
            let t = tuning(&env("LOOPD_STATE_FILE"))?;
            let mut report = String::from("# changelog-writer: diagnosis\n\n");
            for i in &t.issues {
                report.push_str(&format!(
                    "- {} [{}] {}\n",
                    i.id,
                    i.severity.as_str(),
                    i.description
                ));
            }
            std::fs::write(
                Path::new(&env("LOOPD_PROGRESS_DIR")).join("report.md"),
                report,
            )?;
            json!({"status": "success",
                   "summary": format!("{} issues, the memory one critical", t.issues.len())})
        }
        "propose-fixes" => {
            let t = tuning(&env("LOOPD_STATE_FILE"))?;
            let fixes: Vec<Value> = t
                .issues
                .iter()
                .map(|i| {
                    json!({"issue_ids": [i.id], "risk": "low",
                           "description": format!("{}: fix {}", i.category, i.description)})
                })
                .collect();
            json!({"status": "success", "summary": format!("{} fixes", fixes.len()),
                   "state_updates": {"fixes": fixes}})
        }
        "apply-fix" => {
            let task = env("LOOPD_TASK");
            let area = task.split(':').next().unwrap_or("");
            let Some(file) = fix(root, area)? else {
                return Ok(
                    json!({"status": "failed", "summary": format!("no idea how to {task:?}")}),
                );
            };
            say(format!("editing {file}: {area}"))?;
            json!({"status": "success", "summary": format!("{area}: fixed in {file}"),
                   "files_changed": [format!("{SKILL_DIR}/{file}")]})
        }
        "verify" => {
            let t = tuning(&env("LOOPD_STATE_FILE"))?;
            let mut results = Vec::new();
            for f in t
                .applied_fixes
                .iter()
                .filter(|f| f.verification_result == "pending")
            {
                let area = f.description.split(':').next().unwrap_or("");
                let pass = detect(root, area)?.is_none();
                say(format!("{}: {}", f.id, if pass { "pass" } else { "fail" }))?;
                results.push(json!({"fix_id": f.id, "result": if pass { "pass" } else { "fail" }}));
            }
            let mut resolved = Vec::new();
            for i in &t.issues {
                if detect(root, &i.category)?.is_none() {
                    resolved.push(i.id.clone());
                }
            }
            json!({"status": "success",
                   "summary": format!("{} fixes checked, {} issues resolved", results.len(), resolved.len()),
                   "state_updates": {"results": results, "resolved_issues": resolved}})
        }
        "complete" => json!({
            "status": "success",
            "summary": "changelog-writer is tuned",
            "state_updates": {"summary": "The rules are stated once, the history no longer grows, phase 2 reads what phase 1 writes, and the docs name only phases that exist."}
        }),
        other => json!({"status": "failed", "summary": format!("the demo agent cannot {other}")}),
    })
}

/// The gate, and what became of each issue.
pub fn print_outcome(skill: &loopd_core::state::SkillState) -> Result<()> {
    let t = TuningState::from_fields(&skill.part).unwrap_or_default();
    crate::outln!(
        "  quality gate {} (score {}), {} issue(s) resolved, {} left",
        t.quality_gate.map_or("-", |g| g.as_str()),
        t.quality_score.unwrap_or(0),
        t.resolved_issues,
        t.issues.len()
    )?;
    for f in &t.applied_fixes {
        crate::outln!("  [{}] {}  {}", f.verification_result, f.id, f.description)?;
    }
    Ok(())
}
