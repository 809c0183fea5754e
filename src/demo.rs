//! `loopd demo`: a complete loop in a temporary project, with a scripted executor built into the
//! binary (`loopd demo-agent`) and a real test suite in plain shell.
//!
//! The project is a tiny shell calculator whose `add` and `sub` are missing and whose `mul` is
//! wrong. The agent plans two tasks (add, sub) and does one per develop; validate runs the test
//! suite for real and finds `mul` failing; debug reads the failing test from the state file and
//! proposes a fix task; develop fixes it; validate passes; complete.

use std::io::Read;
use std::path::Path;

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use crate::cli::Project;
use crate::config::Config;
use crate::orchestrator::Exit;
use crate::state::store::Store;
use crate::workflow::ccw_loop::state::TaskStatus;

const CALC: &str = "# A tiny calculator: loopd's demo project.\nmul() { echo $(( $1 + $2 )); }\n";

const TESTS: &str = r#"# The calculator's test suite (TAP output, then a summary line).
. ./calc.sh
n=0; pass=0; fail=0
check() {
  n=$((n + 1)); name=$1; expected=$2; shift 2
  got=$("$@" 2>/dev/null)
  if [ "$got" = "$expected" ]; then
    pass=$((pass + 1)); echo "ok $n - $name"
  else
    fail=$((fail + 1)); echo "not ok $n - $name # expected $expected, got ${got:-nothing}"
  fi
}
check add 5 add 2 3
check sub 2 sub 5 3
check mul 12 mul 3 4
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
"#;

/// Runs the demo; returns the loop's exit code.
pub fn run() -> Result<i32> {
    let dir = tempfile::Builder::new()
        .prefix("loopd-demo-")
        .tempdir()
        .context("cannot create the demo's temporary directory")?
        .keep()
        .canonicalize()?;
    std::fs::write(dir.join("calc.sh"), CALC)?;
    std::fs::write(dir.join("test.sh"), TESTS)?;
    let exe = std::env::current_exe().context("cannot find the loopd binary")?;
    let config_text = format!(
        "# The demo's configuration: the scripted agent for every action, the real test suite for validate.\n\
         executor = \"demo\"\nretry_backoff = 0.1\n\n\
         [executors.demo]\ncommand = [{}, \"demo-agent\"]\nprompt = \"stdin\"\nformat = \"json\"\n\n\
         [actions.validate]\ncommand = \"sh test.sh\"\n",
        toml::Value::String(exe.display().to_string())
    );
    std::fs::create_dir_all(dir.join(".loop"))?;
    std::fs::write(dir.join(".loop/config.toml"), &config_text)?;
    // loopd wrote this file itself: `loopd status` and `loopd run` may use it afterwards.
    crate::trust::allow(&dir, &crate::trust::project_files(&dir)?)
        .context("cannot record the demo project as trusted")?;
    // The built-in defaults and the demo's layer only: the user's own config does not apply here.
    let config = Config::builtin_with(&config_text)?;
    let project = Project {
        store: Store::new(&dir, &config.state_dir),
        root: dir.clone(),
        config,
        config_flag: None,
    };
    let id = crate::create::create_loop(
        &project,
        &crate::create::CreateArgs {
            title: Some("Make the calculator's tests pass".into()),
            description: "calc.sh needs add and sub, and test.sh must pass.".into(),
            ..Default::default()
        },
    )?;
    eprintln!("loopd demo: a loop that fixes a tiny shell calculator");
    eprintln!("  project  {}", dir.display());
    eprintln!("  loop     {id}\n");
    let exit = crate::daemon::drive(&project, &id, None, false)?;
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
    let ccw: crate::workflow::ccw_loop::state::CcwState = skill.part();
    for t in &ccw.develop.tasks {
        let mark = if t.status == TaskStatus::Completed {
            "x"
        } else {
            " "
        };
        crate::outln!("  [{mark}] {}  {}", t.id, t.description)?;
    }
    let progress = project.store.progress_dir(&id);
    crate::outln!("\nfiles:")?;
    crate::outln!("  state     {}", project.store.state_path(&id).display())?;
    crate::outln!(
        "  events    {}",
        progress.join(crate::events::EVENTS).display()
    )?;
    crate::outln!("  summary   {}", progress.join("summary.md").display())?;
    crate::outln!("  progress  {}", progress.display())?;
    crate::outln!("\nlook around:")?;
    crate::outln!("  loopd --root {} status {id}", dir.display())?;
    crate::outln!("  loopd --root {} logs {id}", dir.display())?;
    Ok(exit.code())
}

/// The scripted executor: plays a coding agent for the demo project.
pub fn agent() -> Result<i32> {
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let mut prompt = String::new();
    std::io::stdin().read_to_string(&mut prompt)?;
    let action = env("LOOPD_ACTION");
    let root = std::path::PathBuf::from(env("LOOPD_ROOT"));
    let result = match action.as_str() {
        "init" => {
            crate::outln!("reading calc.sh and test.sh: add and sub are missing")?;
            json!({
                "status": "success",
                "summary": "planned 2 tasks",
                "state_updates": {"tasks": [
                    {"description": "Implement add in calc.sh", "tool": "bash", "mode": "write"},
                    {"description": "Implement sub in calc.sh", "tool": "bash", "mode": "write"}
                ]}
            })
        }
        "develop" => develop(&root, &env("LOOPD_TASK"))?,
        "debug" => debug(Path::new(&env("LOOPD_STATE_FILE")))?,
        "complete" => json!({
            "status": "success",
            "summary": "all tests pass",
            "state_updates": {"summary": "calc.sh has add and sub, and mul multiplies again; the test suite passes."}
        }),
        other => json!({"status": "failed", "summary": format!("the demo agent cannot {other}")}),
    };
    std::fs::write(
        env("LOOPD_RESULT_FILE"),
        serde_json::to_vec_pretty(&result)?,
    )?;
    Ok(0)
}

fn develop(root: &Path, task: &str) -> Result<Value> {
    let calc = root.join("calc.sh");
    let mut text = std::fs::read_to_string(&calc)?;
    let summary = if task.contains("mul") {
        text = text.replace(
            "mul() { echo $(( $1 + $2 )); }",
            "mul() { echo $(( $1 * $2 )); }",
        );
        "mul() multiplies instead of adding"
    } else if task.contains("add") {
        text.push_str("add() { echo $(( $1 + $2 )); }\n");
        "added add()"
    } else if task.contains("sub") {
        text.push_str("sub() { echo $(( $1 - $2 )); }\n");
        "added sub()"
    } else {
        return Ok(json!({"status": "failed", "summary": format!("no idea how to {task:?}")}));
    };
    std::fs::write(&calc, text)?;
    crate::outln!("editing calc.sh: {summary}")?;
    Ok(json!({"status": "success", "summary": summary, "files_changed": ["calc.sh"]}))
}

fn debug(state_file: &Path) -> Result<Value> {
    let state: Value = serde_json::from_slice(&std::fs::read(state_file)?)?;
    let failing: Vec<String> = state["skill_state"]["validate"]["failed_tests"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    crate::outln!("failing tests: {failing:?}")?;
    if !failing.iter().any(|t| t.starts_with("mul")) {
        return Ok(json!({"status": "success", "summary": "nothing to fix"}));
    }
    Ok(json!({
        "status": "success",
        "summary": "mul adds instead of multiplying",
        "state_updates": {
            "active_bug": "mul 3 4 prints 7, not 12",
            "hypotheses": [{
                "id": "H1",
                "description": "mul() uses + where it should use *",
                "testable_condition": "mul 3 4 prints 7",
                "logging_point": "calc.sh mul()",
                "evidence_criteria": {"confirm": "prints 7", "reject": "prints 12"},
                "likelihood": 1,
                "status": "confirmed",
                "evidence": {"mul 3 4": "7"},
                "verdict_reason": "7 = 3 + 4"
            }],
            "confirmed_hypothesis": "H1",
            "fix_tasks": [{"description": "Fix mul in calc.sh: it adds instead of multiplying"}]
        }
    }))
}
