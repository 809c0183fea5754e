//! Action definitions: `actions/<workflow>/<action>.md`, built in, overridable per project in
//! `<state_dir>/actions/<workflow>/<action>.md`.
//!
//! A file is an optional TOML front matter between `+++` lines, then a prompt template with
//! `{{name}}` placeholders from [`PLACEHOLDERS`]. Everything is checked when the file is loaded,
//! so a typo fails the start of a loop, not its fifth iteration.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Built-in action files, by workflow and action.
const BUILTIN: &[(&str, &str, &str)] = &[
    (
        "ccw-loop",
        "init",
        include_str!("../../../actions/ccw-loop/init.md"),
    ),
    (
        "ccw-loop",
        "develop",
        include_str!("../../../actions/ccw-loop/develop.md"),
    ),
    (
        "ccw-loop",
        "debug",
        include_str!("../../../actions/ccw-loop/debug.md"),
    ),
    (
        "ccw-loop",
        "validate",
        include_str!("../../../actions/ccw-loop/validate.md"),
    ),
    (
        "ccw-loop",
        "complete",
        include_str!("../../../actions/ccw-loop/complete.md"),
    ),
    (
        "skill-tuning",
        "init",
        include_str!("../../../actions/skill-tuning/init.md"),
    ),
    (
        "skill-tuning",
        "analyze-requirements",
        include_str!("../../../actions/skill-tuning/analyze-requirements.md"),
    ),
    (
        "skill-tuning",
        "gemini-analysis",
        include_str!("../../../actions/skill-tuning/gemini-analysis.md"),
    ),
    (
        "skill-tuning",
        "diagnose-context",
        include_str!("../../../actions/skill-tuning/diagnose-context.md"),
    ),
    (
        "skill-tuning",
        "diagnose-memory",
        include_str!("../../../actions/skill-tuning/diagnose-memory.md"),
    ),
    (
        "skill-tuning",
        "diagnose-dataflow",
        include_str!("../../../actions/skill-tuning/diagnose-dataflow.md"),
    ),
    (
        "skill-tuning",
        "diagnose-agent",
        include_str!("../../../actions/skill-tuning/diagnose-agent.md"),
    ),
    (
        "skill-tuning",
        "diagnose-docs",
        include_str!("../../../actions/skill-tuning/diagnose-docs.md"),
    ),
    (
        "skill-tuning",
        "diagnose-token-consumption",
        include_str!("../../../actions/skill-tuning/diagnose-token-consumption.md"),
    ),
    (
        "skill-tuning",
        "generate-report",
        include_str!("../../../actions/skill-tuning/generate-report.md"),
    ),
    (
        "skill-tuning",
        "propose-fixes",
        include_str!("../../../actions/skill-tuning/propose-fixes.md"),
    ),
    (
        "skill-tuning",
        "apply-fix",
        include_str!("../../../actions/skill-tuning/apply-fix.md"),
    ),
    (
        "skill-tuning",
        "verify",
        include_str!("../../../actions/skill-tuning/verify.md"),
    ),
    (
        "skill-tuning",
        "complete",
        include_str!("../../../actions/skill-tuning/complete.md"),
    ),
];

/// The placeholders a template may use.
pub const PLACEHOLDERS: &[(&str, &str)] = &[
    ("loop_id", "the loop's id"),
    ("title", "the loop's title"),
    ("description", "the loop's description"),
    ("action", "this action's name"),
    ("iteration", "the current iteration (before this action)"),
    ("max_iterations", "the loop's iteration limit"),
    ("attempt", "this attempt's number, from 1"),
    ("root", "the project root"),
    ("state_file", "the loop's state file"),
    ("progress_dir", "the loop's progress directory"),
    ("result_file", "where to write the result JSON"),
    ("task_id", "develop: the task's id; apply-fix: the fix's"),
    (
        "task_description",
        "develop: the task's description; apply-fix: the fix's",
    ),
    ("tasks", "the task list, one line each with its status"),
    (
        "validation",
        "the last validation: passed, pass rate, failed tests",
    ),
    (
        "debug",
        "the debug state: active bug, confirmed hypothesis, hypotheses",
    ),
    ("errors", "the last errors, one line each"),
    (
        "previous",
        "the last attempts, one line each with their summaries",
    ),
    ("outcome", "complete: why the loop completes"),
    ("target_skill", "skill-tuning: the skill's name"),
    ("skill_path", "skill-tuning: the skill's directory"),
    ("focus_areas", "skill-tuning: the areas to look at"),
    (
        "issue_description",
        "skill-tuning: what the user said is wrong",
    ),
    (
        "requirements",
        "skill-tuning: the requirement analysis and its coverage",
    ),
    (
        "diagnosis_area",
        "skill-tuning: the area a diagnosis examines",
    ),
    ("issues", "skill-tuning: the open issues, one line each"),
    ("fixes", "skill-tuning: the fixes and where they stand"),
    ("quality", "skill-tuning: the quality gate and score"),
    ("round", "skill-tuning: the diagnosis round"),
];

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrontMatter {
    /// The executor this action uses unless the config or `--executor` says otherwise.
    pub executor: Option<String>,
    pub timeout: Option<f64>,
    pub idle_timeout: Option<f64>,
    /// One line for people, shown by `loopd doctor` and in the docs.
    pub description: Option<String>,
}

#[derive(Clone, Debug)]
pub struct ActionDef {
    pub name: String,
    /// Where it came from: "built-in" or a path.
    pub source: String,
    pub front: FrontMatter,
    /// The project's file as it was read, for a project override: it needs `loopd trust`.
    pub project_file: Option<crate::project_file::ProjectFile>,
    /// A built-in action's is its text in the binary: a service of hundreds of loops keeps no
    /// copy of it per loop.
    template: Cow<'static, str>,
}

#[derive(Debug, thiserror::Error)]
#[error("bad action file {file}: {reason}")]
pub struct ActionError {
    pub file: String,
    pub reason: String,
}

impl ActionDef {
    pub fn parse(
        name: &str,
        source: &str,
        text: impl Into<Cow<'static, str>>,
    ) -> Result<ActionDef, ActionError> {
        let err = |reason: String| ActionError {
            file: source.to_owned(),
            reason,
        };
        let text = text.into();
        let (front, start) = match text.strip_prefix("+++\n") {
            Some(rest) => {
                let end = rest
                    .find("\n+++\n")
                    .ok_or_else(|| err("front matter opened with +++ is never closed".into()))?;
                let front: FrontMatter = toml::from_str(&rest[..end])
                    .map_err(|e| err(format!("front matter: {}", e.message().trim())))?;
                (front, "+++\n".len() + end + "\n+++\n".len())
            }
            None => (FrontMatter::default(), 0),
        };
        let template = match text {
            Cow::Borrowed(text) => Cow::Borrowed(&text[start..]),
            Cow::Owned(mut text) => {
                text.drain(..start);
                Cow::Owned(text)
            }
        };
        for (key, v) in [
            ("timeout", front.timeout),
            ("idle_timeout", front.idle_timeout),
        ] {
            if v.is_some_and(|v| !crate::config::seconds_ok(v)) {
                return Err(err(format!(
                    "front matter {key} must be a positive number of seconds, at most {}",
                    crate::config::MAX_SECONDS
                )));
            }
        }
        for placeholder in placeholders(&template) {
            let placeholder = placeholder.map_err(err)?;
            if !PLACEHOLDERS.iter().any(|(p, _)| *p == placeholder) {
                return Err(err(format!(
                    "unknown placeholder {{{{{placeholder}}}}} (known: {})",
                    PLACEHOLDERS
                        .iter()
                        .map(|(p, _)| *p)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        Ok(ActionDef {
            name: name.to_owned(),
            source: source.to_owned(),
            front,
            project_file: None,
            template,
        })
    }

    /// Fills the template; every placeholder in it was checked at load.
    pub fn render(&self, vars: &BTreeMap<&str, String>) -> String {
        let mut out = String::with_capacity(self.template.len() + 256);
        let mut rest = &*self.template;
        while let Some(start) = rest.find("{{") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find("}}") else { break };
            let name = after[..end].trim();
            out.push_str(vars.get(name).map(String::as_str).unwrap_or(""));
            rest = &after[end + 2..];
        }
        out.push_str(rest);
        out
    }
}

/// The placeholder names in a template, in order.
fn placeholders(template: &str) -> impl Iterator<Item = Result<&str, String>> {
    let mut rest = template;
    std::iter::from_fn(move || {
        let start = rest.find("{{")?;
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            rest = "";
            return Some(Err("a placeholder opened with {{ is never closed".into()));
        };
        let name = after[..end].trim();
        rest = &after[end + 2..];
        Some(Ok(name))
    })
}

/// Where a project overrides an action: `<root>/.loop/actions/WORKFLOW/ACTION.md`, next to the
/// project config wherever `state_dir` points.
pub fn project_file(root: &Path, workflow: &str, action: &str) -> PathBuf {
    root.join(".loop/actions")
        .join(workflow)
        .join(format!("{action}.md"))
}

/// Loads every action of a workflow: the project's override where there is one, else the built-in.
pub fn load(
    workflow: &str,
    actions: &[&str],
    root: &Path,
) -> Result<BTreeMap<String, ActionDef>, ActionError> {
    let mut defs = BTreeMap::new();
    for action in actions {
        let path = project_file(root, workflow, action);
        let def = match loopd_fs::read_text(&path) {
            Ok(text) => ActionDef {
                project_file: Some(crate::project_file::ProjectFile::new(&path, &text)),
                ..ActionDef::parse(action, &path.display().to_string(), text)?
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let text = BUILTIN
                    .iter()
                    .find(|(w, a, _)| *w == workflow && a == action)
                    .map(|(_, _, text)| *text)
                    .ok_or_else(|| ActionError {
                        file: path.display().to_string(),
                        reason: format!("no action file for {workflow}/{action}"),
                    })?;
                ActionDef::parse(action, &format!("built-in {workflow}/{action}.md"), text)?
            }
            Err(e) => {
                return Err(ActionError {
                    file: path.display().to_string(),
                    reason: e.to_string(),
                });
            }
        };
        defs.insert((*action).to_owned(), def);
    }
    Ok(defs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_actions_load() {
        let dir = tempfile::tempdir().unwrap();
        let defs = load(
            "ccw-loop",
            loopd_core::workflow::ccw_loop::ACTIONS,
            dir.path(),
        )
        .unwrap();
        assert_eq!(defs.len(), 5);
        let vars = BTreeMap::from([("title", "T".to_owned()), ("result_file", "/r".to_owned())]);
        let text = defs["develop"].render(&vars);
        assert!(text.contains("/r") && !text.contains("{{"), "{text}");
    }

    #[test]
    fn unknown_placeholder_is_refused_at_load() {
        let e = ActionDef::parse("init", "x.md", "do {{titel}}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.md") && e.contains("{{titel}}"), "{e}");
        let e = ActionDef::parse("init", "x.md", "do {{title")
            .unwrap_err()
            .to_string();
        assert!(e.contains("never closed"), "{e}");
        let e = ActionDef::parse("init", "x.md", "+++\nexecuter = \"a\"\n+++\nhi")
            .unwrap_err()
            .to_string();
        assert!(e.contains("executer"), "{e}");
    }

    #[test]
    fn project_override_wins() {
        let dir = tempfile::tempdir().unwrap();
        let over = dir.path().join(".loop/actions/ccw-loop");
        std::fs::create_dir_all(&over).unwrap();
        std::fs::write(
            over.join("init.md"),
            "+++\nexecutor = \"bash\"\n+++\nplan {{title}}\n",
        )
        .unwrap();
        let defs = load(
            "ccw-loop",
            loopd_core::workflow::ccw_loop::ACTIONS,
            dir.path(),
        )
        .unwrap();
        assert_eq!(defs["init"].front.executor.as_deref(), Some("bash"));
        let vars = BTreeMap::from([("title", "X".to_owned())]);
        assert_eq!(defs["init"].render(&vars), "plan X\n");
        assert!(defs["develop"].source.starts_with("built-in"));
        // The override is the project's own file, to be trusted; the built-in is not.
        assert!(defs["init"].project_file.is_some());
        assert!(defs["develop"].project_file.is_none());
    }
}
