//! `loopd init --shell`: a first loop without any agent. Every action is a shell command of the
//! project's own: develop runs the user's command once per task (the task in `$LOOPD_TASK_ID` and
//! `$LOOPD_TASK`, never on its command line), validate runs the test command, and init, debug and
//! complete only report. The config is written as the user asked, so it is trusted at once.

use anyhow::{Context as _, Result};

use loopd_file_driver::error::usage;
use loopd_file_driver::project::Project;
use loopd_project::config::Config;

/// What `init --shell` is given.
#[derive(Debug, clap::Args)]
pub struct InitArgs {
    /// Every action a shell command: no agent needed
    #[arg(long)]
    pub shell: bool,
    /// The command each develop runs, once per task
    #[arg(long, value_name = "COMMAND")]
    pub develop: String,
    /// The test command validate runs (exit 0: passed)
    #[arg(long, value_name = "COMMAND")]
    pub validate: String,
    /// Replace an existing .loop/config.toml
    #[arg(long)]
    pub force: bool,
}

/// Writes `.loop/config.toml` for an all-shell loop and trusts it; prints its path.
pub fn run(p: &Project, args: &InitArgs, as_json: bool) -> Result<i32> {
    if !args.shell {
        return Err(usage(
            "only `loopd init --shell` exists so far; for an agent, see `loopd doctor`",
        ));
    }
    for (flag, command) in [("--develop", &args.develop), ("--validate", &args.validate)] {
        if command.trim().is_empty() {
            return Err(usage(format!("{flag}: the command is empty")));
        }
    }
    let path = Config::project_file(&p.root);
    if path.exists() && !args.force {
        return Err(usage(format!(
            "{} already exists; --force replaces it",
            path.display()
        )));
    }
    let text = shell_config(&args.develop, &args.validate);
    // Checked like any config before it is written: a broken one is never left behind.
    Config::builtin_with(&text)?;
    let dir = loopd_fs::Dir::open(&p.root)
        .and_then(|root| root.subdir(".loop", true))
        .with_context(|| format!("cannot open {}", p.root.join(".loop").display()))?;
    dir.write_atomic("config.toml", text.as_bytes(), true)
        .with_context(|| format!("cannot write {}", path.display()))?;
    loopd_project::trust::allow(&p.root, &loopd_project::trust::project_files(&p.root)?)
        .context("cannot record the new config as trusted")?;
    eprintln!(
        "wrote {} (trusted); next: `loopd create --title ... --task ...`, then `loopd run ID`",
        path.display()
    );
    let value = serde_json::json!({ "config": path, "trusted": true });
    crate::output::print_result(as_json, &value, &path.display().to_string())?;
    Ok(0)
}

/// The config of an all-shell loop.
fn shell_config(develop: &str, validate: &str) -> String {
    let quote = |s: &str| toml::Value::String(s.to_owned()).to_string();
    let report = |summary: &str| {
        quote(&format!(
            r#"echo '{{"status":"success","summary":"{summary}"}}'"#
        ))
    };
    format!(
        "# An all-shell loop, written by `loopd init --shell`: no agent. Tasks come from\n\
         # `loopd create --task TEXT` (or `loopd task add`); each develop runs your command once\n\
         # per task, with the task in $LOOPD_TASK_ID and $LOOPD_TASK; validate runs your test\n\
         # command (exit 0: passed). A develop command may print loopd's JSON result; otherwise\n\
         # exit 0 is a success.\n\n\
         [executor_defaults]\n\
         # Where your commands may connect: the hosts listed, with their ports, through loopd's\n\
         # proxy, and nothing else. A command that fetches packages needs their registries, as\n\
         # [\"index.crates.io:443\", \"static.crates.io:443\"] or [\"registry.npmjs.org:443\"];\n\
         # \"any\" lets it reach everything. A refusal's event in `loopd logs` names the host.\n\
         sandbox_network = []\n\n\
         [actions.init]\ncommand = {}\n\n\
         [actions.develop]\ncommand = {}\n\n\
         [actions.debug]\ncommand = {}\n\n\
         [actions.validate]\ncommand = {}\n\n\
         [actions.complete]\ncommand = {}\n",
        report("the tasks are the ones given to loopd create"),
        quote(develop),
        report("an all-shell loop has nothing to debug"),
        quote(validate),
        report("done"),
    )
}
