//! `loopd demo`: a complete loop in a temporary project, with a scripted executor built into the
//! binary (`loopd demo-agent`), for each workflow: ccw-loop fixes a tiny shell calculator
//! (`calculator`), skill-tuning tunes a small skill with planted problems (`tuning`).

mod calculator;
mod tuning;

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use loopd_core::workflow::{ccw_loop, skill_tuning};

use loopd_file_driver::error::usage;
use loopd_file_driver::orchestrator::Exit;
use loopd_file_driver::project::Project;
use loopd_project::config::Config;
use loopd_store::store::Store;

/// Runs the demo of a workflow (ccw-loop by default); returns the loop's exit code.
pub fn run(workflow: Option<&str>) -> Result<i32> {
    let workflow = workflow.unwrap_or(ccw_loop::NAME);
    let (headline, own_config): (&str, &str) = match workflow {
        ccw_loop::NAME => (
            "a loop that fixes a tiny shell calculator",
            calculator::CONFIG,
        ),
        skill_tuning::NAME => ("a loop that tunes a small skill", ""),
        other => {
            return Err(usage(format!(
                "unknown workflow {other:?} (known: {})",
                loopd_core::workflow::WORKFLOWS.join(", ")
            )));
        }
    };
    let dir = tempfile::Builder::new()
        .prefix("loopd-demo-")
        .tempdir()
        .context("cannot create the demo's temporary directory")?
        .keep()
        .canonicalize()?;
    let args = match workflow {
        skill_tuning::NAME => tuning::write_project(&dir)?,
        _ => {
            calculator::write_project(&dir)?;
            calculator::create_args()
        }
    };
    let exe = std::env::current_exe().context("cannot find the loopd binary")?;
    // The demo runs on any Linux machine: sandboxed where the kernel can, and says which.
    let support = loopd_exec::sandbox::Support::probe();
    let policy = loopd_exec::sandbox::Policy::default();
    let (sandbox, said) = match support.refuses(&policy) {
        None => (
            "workspace-write",
            format!(
                "each action in a sandbox ({}): it could write in the project and its own files \
                 only",
                support.describe()
            ),
        ),
        Some(why) => (
            "off",
            format!(
                "without a sandbox: {why} (a loop of yours would be refused unless its config \
                 says so)"
            ),
        ),
    };
    let config_text = format!(
        "# The demo's configuration: the scripted agent for every action.\n\
         executor = \"demo\"\nretry_backoff = 0.1\n\n\
         [executors.demo]\ncommand = [{}, \"demo-agent\", \"--workflow\", \"{workflow}\"]\n\
         prompt = \"stdin\"\nformat = \"json\"\nsandbox = \"{sandbox}\"\n\n{own_config}",
        toml::Value::String(exe.display().to_string())
    );
    std::fs::create_dir_all(dir.join(".loop"))?;
    std::fs::write(dir.join(".loop/config.toml"), &config_text)?;
    // loopd wrote this file itself: `loopd status` and `loopd run` may use it afterwards.
    loopd_project::trust::allow(&dir, &loopd_project::trust::project_files(&dir)?)
        .context("cannot record the demo project as trusted")?;
    // The built-in defaults and the demo's layer only: the user's own config does not apply here.
    let config = Config::builtin_with(&config_text)?;
    let project = Project {
        store: Store::new(&dir, &config.state_dir),
        root: dir.clone(),
        config,
        config_flag: None,
    };
    let id = loopd_file_driver::create::create_loop(&project, &args)?;
    eprintln!("loopd demo: {headline}");
    eprintln!("  project  {}", dir.display());
    eprintln!("  loop     {id}");
    eprintln!("  sandbox  {said}\n");
    let exit = loopd_file_driver::daemon::drive(&project, &id, None, false)?;
    let state = project.load(&id)?;
    let skill = state.skill_state.clone().unwrap_or_default();
    crate::outln!()?;
    crate::outln!(
        "{} after {} iterations ({})",
        match &exit {
            Exit::Completed(_) => "completed",
            _ => "ended",
        },
        state.current_iteration,
        skill.outcome.as_deref().unwrap_or("-")
    )?;
    match workflow {
        skill_tuning::NAME => tuning::print_outcome(&skill)?,
        _ => calculator::print_outcome(&skill)?,
    }
    let progress = project.store.progress_dir(&id);
    crate::outln!("\nfiles:")?;
    crate::outln!("  state     {}", project.store.state_path(&id).display())?;
    crate::outln!(
        "  events    {}",
        progress.join(loopd_store::events::EVENTS).display()
    )?;
    crate::outln!("  summary   {}", progress.join("summary.md").display())?;
    crate::outln!("  progress  {}", progress.display())?;
    crate::outln!("\nlook around:")?;
    crate::outln!("  loopd --root {} status {id}", dir.display())?;
    crate::outln!("  loopd --root {} logs {id}", dir.display())?;
    if crate::doctor::find_program("loopd").is_none() {
        // Run from a clone (`cargo run --release -- demo`): this very build, installed as it is.
        crate::outln!(
            "\nloopd is not on your PATH yet; from the clone, this build installs without \
             compiling again:\n  cargo install --locked --path . --target-dir target"
        )?;
    }
    Ok(exit.code())
}

/// The scripted executor: plays a coding agent for the demo's project, and writes its result.
pub fn agent(workflow: Option<&str>) -> Result<i32> {
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let mut prompt = String::new();
    std::io::stdin().read_to_string(&mut prompt)?;
    let action = env("LOOPD_ACTION");
    let root = PathBuf::from(env("LOOPD_ROOT"));
    let result = match workflow {
        Some(skill_tuning::NAME) => tuning::act(&action, &root, env)?,
        _ => calculator::act(&action, &root, env)?,
    };
    std::fs::write(
        env("LOOPD_RESULT_FILE"),
        serde_json::to_vec_pretty(&result)?,
    )?;
    Ok(0)
}

/// A file of the demo's project, read for the scripted agent.
fn read(root: &Path, file: &str) -> Result<String> {
    std::fs::read_to_string(root.join(file)).with_context(|| format!("cannot read {file}"))
}
