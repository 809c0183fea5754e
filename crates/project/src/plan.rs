//! How a project's actions run: each action's plan (its executor resolved from the config and its
//! action file), and an attempt's prompt and environment. The same for every driver, so a loop
//! prompts its agents alike wherever it runs.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::Result;
use loopd_core::state::LoopState;
use loopd_core::workflow::{Dispatch, Outcome, Workflow};
use loopd_exec::{Format, PromptMode, Supervision};

use crate::actions::ActionDef;
use crate::config::{Config, ExecutorConfig};
use crate::project_file::ProjectFile;

/// How one action runs: its executor, resolved.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The executor's name, or `command: ...` for an action's own shell command.
    pub executor: String,
    pub argv: Vec<String>,
    pub prompt_mode: PromptMode,
    pub format: Format,
    pub env: Vec<(String, OsString)>,
    pub supervision: Supervision,
    /// The account whose rate limits it spends: the executor's `account`, else its name.
    pub account: String,
    /// What its attempts may do ([`loopd_exec::sandbox`]).
    pub sandbox: loopd_exec::sandbox::Policy,
}

impl Plan {
    /// Resolves the executor of an action: `--executor`, else `[actions.NAME]` (its `executor`,
    /// or its own shell `command`), else the action file's front matter, else the config's
    /// `executor`.
    pub fn resolve(config: &Config, def: &ActionDef, override_: Option<&str>) -> Result<Plan> {
        let action_config = config.actions.get(&def.name);
        let shell = ExecutorConfig::default();
        let (name, executor, argv, format) =
            match (action_config.and_then(|a| a.command.clone()), override_) {
                (Some(command), None) => {
                    // A validate command is a test command; any other reports like a `json` executor.
                    let format = if def.name == "validate" {
                        Format::Test
                    } else {
                        Format::Json
                    };
                    let argv = vec!["sh".into(), "-c".into(), command.clone()];
                    (format!("command: {command}"), &shell, argv, format)
                }
                _ => {
                    let name = override_
                        .map(str::to_owned)
                        .or_else(|| action_config.and_then(|a| a.executor.clone()))
                        .or_else(|| def.front.executor.clone())
                        .unwrap_or_else(|| config.executor.clone());
                    let executor = config.executor_named(&name).map_err(|reason| {
                        anyhow::anyhow!("action {} ({}): {reason}", def.name, def.source)
                    })?;
                    (name, executor, executor.command.clone(), executor.format)
                }
            };
        let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/"), PathBuf::from);
        Ok(Plan {
            sandbox: config.sandbox(executor, action_config, &home),
            account: executor.account.clone().unwrap_or_else(|| name.clone()),
            executor: name,
            argv,
            prompt_mode: executor.prompt,
            format,
            env: executor
                .env
                .iter()
                .map(|(k, v)| (k.clone(), OsString::from(v)))
                .collect(),
            supervision: config.supervision(
                executor,
                action_config,
                (def.front.timeout, def.front.idle_timeout),
            ),
        })
    }

    /// The program it runs, for a check that it exists: the executor's program, or the first
    /// word of an action's shell command when that is a plain program name (not a builtin, a
    /// keyword, an assignment or anything the shell must interpret first).
    pub fn program(&self) -> Option<String> {
        let plan = self;
        let Some(command) = plan.executor.strip_prefix("command: ") else {
            return plan.argv.first().cloned();
        };
        let word = command.split_whitespace().next()?;
        const SHELL_OWN: &[&str] = &[
            "cd", "exec", "if", "for", "while", "until", "case", "{", "(", "!", "[", "[[", "test",
            "true", "false", "echo", "printf", "set", "export", "unset", ".", "source", ":",
            "eval", "exit", "read", "command", "time", "env",
        ];
        let plain = word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-+/".contains(c));
        (plain && !SHELL_OWN.contains(&word)).then(|| word.to_owned())
    }
}

/// A workflow's actions in a project, each with its definition and its plan.
pub struct Plans {
    actions: BTreeMap<String, ActionDef>,
    plans: BTreeMap<String, Plan>,
}

impl Plans {
    /// Loads `workflow`'s action files in the project at `root` and resolves each one's executor
    /// (every action's `executor_override` when given).
    pub fn load(
        root: &Path,
        config: &Config,
        workflow: &dyn Workflow,
        executor_override: Option<&str>,
    ) -> Result<Plans> {
        let actions = crate::actions::load(workflow.name(), workflow.actions(), root)?;
        let mut plans = BTreeMap::new();
        for (name, def) in &actions {
            plans.insert(name.clone(), Plan::resolve(config, def, executor_override)?);
        }
        Ok(Plans { actions, plans })
    }

    /// How each action would run, by action.
    pub fn plans(&self) -> &BTreeMap<String, Plan> {
        &self.plans
    }

    /// An action's definition and plan.
    pub fn get(&self, action: &str) -> Option<(&ActionDef, &Plan)> {
        Some((self.actions.get(action)?, self.plans.get(action)?))
    }

    /// What would stop the loop's actions from running at all, one line each: an executor
    /// program that is not installed, an action command whose program is not found. An action
    /// left to the config's default executor says so.
    pub fn preflight(
        &self,
        work_tree: &Path,
        config: &Config,
        executor_override: Option<&str>,
    ) -> Vec<String> {
        let mut problems = Vec::new();
        // Never a silent downgrade: a sandbox this machine cannot hold refuses the loop.
        let support = loopd_exec::sandbox::Support::probe();
        let mut refused = std::collections::BTreeSet::new();
        for (action, plan) in &self.plans {
            if let Some(why) = support.refuses(&plan.sandbox)
                && refused.insert(why.clone())
            {
                problems.push(format!("{action}: {why}"));
            }
        }
        for action in self.plans.keys() {
            let Some(plan) = self.plans.get(action) else {
                continue;
            };
            let Some(program) = plan.program() else {
                continue;
            };
            let path = plan
                .env
                .iter()
                .find(|(k, _)| k == "PATH")
                .map(|(_, v)| v.clone())
                .or_else(|| std::env::var_os("PATH"));
            if loopd_exec::find_program_in(&program, work_tree, path.as_deref()).is_some() {
                continue;
            }
            let what = match plan.executor.strip_prefix("command: ") {
                Some(command) => format!(
                    "{action}: `{program}` (of `{command}`) is not found; check [actions.{action}] command"
                ),
                None => {
                    let default = executor_override.is_none()
                        && config
                            .actions
                            .get(action)
                            .is_none_or(|a| a.executor.is_none())
                        && self.actions[action].front.executor.is_none();
                    format!(
                        "{action}: executor {} needs `{program}`, which is not installed (not on PATH){}",
                        plan.executor,
                        if default {
                            "; it is the default executor: set `executor` in .loop/config.toml, \
                             or pass --executor"
                        } else {
                            ""
                        }
                    )
                }
            };
            problems.push(what);
        }
        problems
    }

    /// The project's own files loaded for these actions, with the config's, which need
    /// `loopd trust` (see [`crate::trust`]).
    pub fn project_files<'a>(&'a self, config: &'a Config) -> Vec<&'a ProjectFile> {
        config
            .project_file
            .iter()
            .chain(
                self.actions
                    .values()
                    .filter_map(|a| a.project_file.as_ref()),
            )
            .collect()
    }

    /// Where each action's definition comes from, by action.
    pub fn action_sources(&self) -> impl Iterator<Item = (&str, &str)> {
        self.actions
            .iter()
            .map(|(name, def)| (name.as_str(), def.source.as_str()))
    }
}

/// The action being run: what, how, and the iteration it counts for.
pub struct Step<'a> {
    pub dispatch: &'a Dispatch,
    pub plan: &'a Plan,
    pub def: &'a ActionDef,
    pub iteration: u64,
}

/// The paths a prompt names.
pub struct Paths<'a> {
    pub root: &'a Path,
    pub state_file: &'a Path,
    pub progress_dir: &'a Path,
    pub result_file: &'a Path,
}

/// An attempt's environment: the `LOOPD_*` variables, then the plan's own.
pub fn environment(
    id: &str,
    step: &Step<'_>,
    attempt: u32,
    paths: &Paths<'_>,
    task: Option<(String, String)>,
) -> Vec<(String, OsString)> {
    let mut env: Vec<(String, OsString)> = vec![
        ("LOOPD_LOOP_ID".into(), id.into()),
        ("LOOPD_ACTION".into(), step.dispatch.action.clone().into()),
        ("LOOPD_ITERATION".into(), step.iteration.to_string().into()),
        ("LOOPD_ATTEMPT".into(), attempt.to_string().into()),
        ("LOOPD_ROOT".into(), paths.root.into()),
        ("LOOPD_STATE_FILE".into(), paths.state_file.into()),
        ("LOOPD_PROGRESS_DIR".into(), paths.progress_dir.into()),
        ("LOOPD_RESULT_FILE".into(), paths.result_file.into()),
    ];
    if let Some((task_id, description)) = task {
        env.push(("LOOPD_TASK_ID".into(), task_id.into()));
        env.push(("LOOPD_TASK".into(), description.into()));
    }
    env.extend(step.plan.env.iter().cloned());
    env
}

/// An attempt's prompt: its action file rendered with the loop's values, the task's and the
/// workflow's, and, after a question, the question and its answer.
pub fn prompt(
    workflow: &dyn Workflow,
    max_iterations: u64,
    state: &LoopState,
    step: &Step<'_>,
    attempt: u32,
    paths: &Paths<'_>,
    task: Option<(String, String)>,
) -> String {
    let mut vars = template_vars(state, step, attempt, paths, max_iterations);
    let (task_id, task_description) = task.unwrap_or_default();
    vars.insert("task_id", task_id);
    vars.insert("task_description", task_description);
    vars.extend(workflow.prompt_vars(state, step.dispatch));
    let mut prompt = step.def.render(&vars);
    if let Some(q) = state.skill_state.as_ref().and_then(|s| s.question.as_ref())
        && let Some(answer) = &q.answer
    {
        prompt.push_str(&format!(
            "\n\n## Your question, answered\n\nAn earlier {} asked:\n\n{}\n\nThe answer:\n\n{answer}\n",
            q.action, q.text
        ));
    }
    prompt
}

/// The loop's values of the template placeholders (see [`crate::actions::PLACEHOLDERS`]).
pub fn template_vars(
    state: &LoopState,
    step: &Step<'_>,
    attempt: u32,
    paths: &Paths<'_>,
    max_iterations: u64,
) -> BTreeMap<&'static str, String> {
    let (dispatch, iteration) = (step.dispatch, step.iteration);
    let (errors, history) = state.skill_state.as_ref().map_or((&[][..], &[][..]), |s| {
        (&s.errors[..], &s.action_history[..])
    });
    let errors = if errors.is_empty() {
        "none".to_owned()
    } else {
        errors
            .iter()
            .map(|e| format!("- {} {}: {}", e.timestamp, e.action, e.message))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let previous = if history.is_empty() {
        "none".to_owned()
    } else {
        history
            .iter()
            .map(|h| {
                let detail = h.summary.as_deref().or(h.error.as_deref()).unwrap_or("");
                format!(
                    "- #{} {} attempt {}: {} {detail}",
                    h.iteration, h.action, h.attempt, h.outcome
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let path = |p: &Path| p.display().to_string();
    BTreeMap::from([
        ("loop_id", state.loop_id.clone()),
        ("title", state.title.clone()),
        ("description", state.description.clone()),
        ("action", dispatch.action.clone()),
        ("iteration", iteration.to_string()),
        ("max_iterations", max_iterations.to_string()),
        ("attempt", attempt.to_string()),
        ("root", path(paths.root)),
        ("state_file", path(paths.state_file)),
        ("progress_dir", path(paths.progress_dir)),
        ("result_file", path(paths.result_file)),
        ("errors", errors),
        ("previous", previous),
        (
            "outcome",
            dispatch
                .outcome
                .map(Outcome::as_str)
                .unwrap_or("")
                .to_owned(),
        ),
    ])
}
