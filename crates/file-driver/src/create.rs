//! `loopd create`: a new loop of any workflow, checked before anything is written.

use anyhow::Result;
use loopd_core::control::SetLimits;
use loopd_core::state::{Bookkeeping, LoopState, Mode, SkillState, Status};

use crate::error::usage;
use crate::project::Project;
use loopd_store::now_rfc3339;
use loopd_store::store::new_id;

/// How a new loop picks its actions: by itself, or as `loopd next` says.
#[derive(Clone, Copy, Debug, Default, clap::ValueEnum)]
pub enum ModeArg {
    #[default]
    Auto,
    Interactive,
}

/// A loop's limits and budgets, as `create` and `set` take them; `None` leaves one as it is (for
/// a new loop: the config's).
#[derive(Clone, Copy, Debug, Default, clap::Args, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Complete the loop after this many develop/debug/validate actions [create: the config's]
    #[arg(long, value_name = "N")]
    pub max_iterations: Option<u64>,
    /// Fail the loop after this many failed actions [create: the config's]
    #[arg(long, value_name = "N")]
    pub max_errors: Option<u64>,
    /// Fail the loop once its agents have cost this many dollars
    #[arg(long, value_name = "USD")]
    pub max_cost_usd: Option<f64>,
    /// Fail the loop once its agents have used this many tokens
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<u64>,
    /// Develop up to N tasks at once, each in a git work tree of its own, merged back in task
    /// order (a project in git only) [create: the config's]
    #[arg(long, value_name = "N")]
    pub parallel: Option<u64>,
}

impl Limits {
    /// Refuses a limit of 0 and a budget that is not a positive number.
    pub fn check(&self) -> Result<()> {
        for (flag, value) in [
            ("--max-iterations", self.max_iterations),
            ("--max-errors", self.max_errors),
            ("--max-tokens", self.max_tokens),
            ("--parallel", self.parallel),
        ] {
            if value == Some(0) {
                return Err(usage(format!("{flag} must be at least 1")));
            }
        }
        if self
            .max_cost_usd
            .is_some_and(|c| !(c.is_finite() && c > 0.0))
        {
            return Err(usage("--max-cost-usd must be a positive number"));
        }
        Ok(())
    }
}

impl From<SetLimits> for Limits {
    fn from(l: SetLimits) -> Limits {
        let SetLimits {
            max_iterations,
            max_errors,
            max_cost_usd,
            max_tokens,
            parallel,
        } = l;
        Limits {
            max_iterations,
            max_errors,
            max_cost_usd,
            max_tokens,
            parallel,
        }
    }
}

impl From<Limits> for SetLimits {
    fn from(l: Limits) -> SetLimits {
        let Limits {
            max_iterations,
            max_errors,
            max_cost_usd,
            max_tokens,
            parallel,
        } = l;
        SetLimits {
            max_iterations,
            max_errors,
            max_cost_usd,
            max_tokens,
            parallel,
        }
    }
}

/// What `create` asks for.
#[derive(Debug, Default, clap::Args)]
pub struct CreateArgs {
    /// The loop's goal, in one line [skill-tuning: "Tune the NAME skill"]
    #[arg(long)]
    pub title: Option<String>,
    /// More about the goal; the agents see it in every prompt
    #[arg(long, default_value = "")]
    pub description: String,
    #[command(flatten)]
    pub limits: Limits,
    /// `interactive`: the loop waits for `loopd next` before each action
    #[arg(long, value_enum, default_value = "auto")]
    pub mode: ModeArg,
    /// The workflow [default: config's, `ccw-loop`]
    #[arg(long, value_name = "NAME")]
    pub workflow: Option<String>,
    /// A develop task (repeatable); written to the loop's task list
    #[arg(long = "task", value_name = "TEXT")]
    pub tasks: Vec<String>,
    /// Every task is tried by each of these executors (repeat: at least two), each in a git
    /// work tree of its own; the check (validate on each tree) keeps the best [the config's]
    #[arg(long = "race", value_name = "EXECUTOR")]
    pub race: Vec<String>,
    /// Give the loop a git worktree of its own (branch `loopd/<id>` from HEAD, in the state
    /// dir's worktrees/), so that it can run beside the project's other loops
    #[arg(long)]
    pub worktree: bool,
    /// A loop on Temporal whose workers share no file system: the git remote (a URL or the
    /// path of a bare repository) its work goes to, on branch `loopd/<id>`; the project's
    /// files are taken as they are here and now
    #[arg(long, value_name = "URL")]
    pub remote: Option<String>,
    /// With --remote: the commit the loop starts from, pushed as its branch [default: HEAD]
    #[arg(long, value_name = "REV", requires = "remote")]
    pub base: Option<String>,
    #[command(flatten)]
    pub tuning: TuningArgs,
}

/// What a skill-tuning loop is given.
#[derive(Debug, Default, clap::Args)]
pub struct TuningArgs {
    /// skill-tuning: the skill to tune, a directory with a SKILL.md
    #[arg(long, value_name = "PATH")]
    pub target_skill: Option<std::path::PathBuf>,
    /// skill-tuning: the areas to look at (context, memory, dataflow, agent, docs,
    /// token_consumption; architecture, prompt, performance, custom ask for a second opinion)
    #[arg(long = "focus", value_name = "AREA,...", value_delimiter = ',')]
    pub focus: Vec<String>,
    /// skill-tuning: what is wrong with the skill, in your words
    #[arg(long, value_name = "TEXT")]
    pub issue: Option<String>,
}

impl TuningArgs {
    fn given(&self) -> bool {
        self.target_skill.is_some() || !self.focus.is_empty() || self.issue.is_some()
    }
}

/// The fields of a new skill-tuning loop: the target checked (a directory with a `SKILL.md`,
/// kept relative to the root when it is inside it), the focus areas known ones.
fn tuning_part(
    p: &Project,
    args: &TuningArgs,
) -> Result<loopd_core::workflow::skill_tuning::state::TuningState> {
    use loopd_core::workflow::skill_tuning::{focus_areas, state::TuningState};
    let Some(target) = &args.target_skill else {
        return Err(usage(
            "--target-skill PATH is required for a skill-tuning loop (a directory with a SKILL.md)",
        ));
    };
    let dir = p.root.join(target);
    if !dir.join("SKILL.md").is_file() {
        return Err(usage(format!(
            "--target-skill: {} is not a skill (no SKILL.md in it)",
            dir.display()
        )));
    }
    let dir = dir
        .canonicalize()
        .map_err(|e| usage(format!("--target-skill: {}: {e}", dir.display())))?;
    let path = dir.strip_prefix(&p.root).unwrap_or(&dir);
    let path = if path.as_os_str().is_empty() {
        ".".to_owned()
    } else {
        path.display().to_string()
    };
    // `token-consumption` and `Docs` are `token_consumption` and `docs`.
    let focus: Vec<String> = args
        .focus
        .iter()
        .map(|a| a.trim().replace('-', "_").to_ascii_lowercase())
        .collect();
    for (area, given) in focus.iter().zip(&args.focus) {
        let known = focus_areas();
        if !known.contains(&area.as_str()) {
            return Err(usage(format!(
                "--focus: unknown area {given:?}{} (known: {})",
                loopd_project::config::did_you_mean(area, &known),
                known.join(", ")
            )));
        }
    }
    let max = loopd_core::state::MAX_DESCRIPTION;
    if args.issue.as_ref().is_some_and(|i| i.len() > max) {
        return Err(usage(format!("--issue is over the limit of {max} bytes")));
    }
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(TuningState::new(
        name,
        path,
        focus,
        args.issue.clone().filter(|i| !i.trim().is_empty()),
    ))
}

/// The title, the description and the tasks: none empty, each within its limit.
fn check_texts(title: &str, description: &str, tasks: &[String]) -> Result<()> {
    use loopd_core::state::{MAX_DESCRIPTION, MAX_TITLE};
    use loopd_core::workflow::ccw_loop::state::MAX_TASKS;
    if tasks.iter().any(|t| t.trim().is_empty()) {
        return Err(usage("--task must not be empty"));
    }
    if tasks.len() > MAX_TASKS {
        return Err(usage(format!(
            "{} tasks are over the limit of {MAX_TASKS}",
            tasks.len()
        )));
    }
    let texts = [
        ("--title", title, MAX_TITLE),
        ("--description", description, MAX_DESCRIPTION),
    ];
    for (what, text, max) in texts.into_iter().chain(
        tasks
            .iter()
            .map(|t| ("--task", t.as_str(), MAX_DESCRIPTION)),
    ) {
        if text.len() > max {
            return Err(usage(format!(
                "{what} is {} bytes, over the limit of {max}",
                text.len()
            )));
        }
    }
    Ok(())
}

/// Writes a new loop (and its task list); returns its id.
pub fn create_loop(p: &Project, args: &CreateArgs) -> Result<String> {
    if args.remote.is_some() {
        return Err(usage(
            "--remote is for loops on Temporal (`loopd create --temporal ADDR --remote URL`)",
        ));
    }
    crate::worktree::check_parallel(p, args.limits.parallel)?;
    crate::worktree::check_race(p, &args.race)?;
    let id = new_id();
    let worktree = match args.worktree {
        true => Some(crate::worktree::create(&p.root, &p.store, &id)?),
        false => None,
    };
    let state = match new_state(p, args, &id, worktree.clone()) {
        Ok(state) => state,
        Err(e) => {
            if let Some(w) = &worktree {
                crate::worktree::remove(&p.root, w);
            }
            return Err(e);
        }
    };
    if let Err(e) = p.store.create(&state) {
        if let Some(w) = &worktree {
            crate::worktree::remove(&p.root, w);
        }
        return Err(e.into());
    }
    if !args.tasks.is_empty() {
        let texts: Vec<&str> = args.tasks.iter().map(String::as_str).collect();
        p.store.add_tasks(&id, &texts, &Default::default(), &[])?;
    }
    Ok(id)
}

/// A new loop's state as `create` makes it, every request checked (its task list aside, which
/// the driver keeps): loop `id`, in `worktree` when it has one of its own.
pub fn new_state(
    p: &Project,
    args: &CreateArgs,
    id: &str,
    worktree: Option<loopd_core::state::Worktree>,
) -> Result<LoopState> {
    let CreateArgs {
        title,
        description,
        limits,
        mode,
        workflow,
        tasks,
        race,
        worktree: _,
        remote: _,
        base: _,
        tuning,
    } = args;
    let crate::create::Limits {
        max_iterations,
        max_errors,
        max_cost_usd,
        max_tokens,
        parallel,
    } = *limits;
    limits.check()?;
    let name = workflow.as_deref().unwrap_or(&p.config.workflow);
    let Some(workflow) = loopd_core::workflow::by_name(name) else {
        return Err(usage(format!(
            "unknown workflow {name:?} (known: {})",
            loopd_core::workflow::WORKFLOWS.join(", ")
        )));
    };
    let tuning = match workflow.name() {
        loopd_core::workflow::skill_tuning::NAME => Some(tuning_part(p, tuning)?),
        _ if tuning.given() => {
            return Err(usage(format!(
                "--target-skill, --focus and --issue are for --workflow skill-tuning, not {}",
                workflow.name()
            )));
        }
        _ => None,
    };
    let title = match (title, &tuning) {
        (Some(t), _) if !t.trim().is_empty() => t.clone(),
        (None, Some(t)) => format!("Tune the {} skill", t.target_skill.name),
        (Some(_), _) => return Err(usage("--title must not be empty")),
        (None, None) => return Err(usage("--title TEXT is required")),
    };
    check_texts(&title, description, tasks)?;
    // The workflow's own defaults, where it has them, else the config's.
    let defaults = workflow
        .default_limits()
        .unwrap_or((p.config.max_iterations, p.config.max_errors));
    let now = now_rfc3339();
    let mut state = LoopState {
        loop_id: id.to_owned(),
        title,
        description: description.to_owned(),
        max_iterations: Some(max_iterations.unwrap_or(defaults.0)),
        max_errors: Some(max_errors.unwrap_or(defaults.1)),
        max_cost_usd: max_cost_usd.or(p.config.max_cost_usd),
        max_tokens: max_tokens.or(p.config.max_tokens),
        parallel,
        race: (!race.is_empty()).then(|| race.clone()),
        status: Status::Created,
        created_at: Some(now.clone()),
        updated_at: Some(now),
        skill_state: Some(SkillState {
            book: Bookkeeping {
                mode: match mode {
                    ModeArg::Auto => Mode::Auto,
                    ModeArg::Interactive => Mode::Interactive,
                },
                workflow: Some(workflow.name().to_owned()),
                worktree: worktree.clone(),
                ..Bookkeeping::default()
            },
            part: Default::default(),
        }),
        ..LoopState::default()
    };
    if let Some(tuning) = &tuning {
        state.skill().set_part(tuning);
    }
    workflow.init_part(state.skill());
    Ok(state)
}
