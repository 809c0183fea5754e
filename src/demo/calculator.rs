//! The ccw-loop demo: a tiny shell calculator whose `add` and `sub` are missing and whose `mul`
//! is wrong. The agent plans two tasks (add, sub) and does one per develop; validate runs the
//! test suite for real and finds `mul` failing; debug reads the failing test from the state file
//! and proposes a fix task; develop fixes it; validate passes; complete.

use std::path::Path;

use anyhow::Result;
use loopd_core::workflow::ccw_loop::state::{CcwState, TaskStatus};
use serde_json::{Value, json};

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

/// Writes the calculator project into `dir`.
pub fn write_project(dir: &Path) -> Result<()> {
    std::fs::write(dir.join("calc.sh"), CALC)?;
    std::fs::write(dir.join("test.sh"), TESTS)?;
    Ok(())
}

/// The real test suite for validate.
pub const CONFIG: &str = "[actions.validate]\ncommand = \"sh test.sh\"\n";

/// The loop the demo runs.
pub fn create_args() -> loopd_file_driver::create::CreateArgs {
    loopd_file_driver::create::CreateArgs {
        title: Some("Make the calculator's tests pass".into()),
        description: "calc.sh needs add and sub, and test.sh must pass.".into(),
        ..Default::default()
    }
}

/// The tasks and how they ended.
pub fn print_outcome(skill: &loopd_core::state::SkillState) -> Result<()> {
    let ccw = CcwState::from_fields(&skill.part).unwrap_or_default();
    for t in &ccw.develop.tasks {
        let mark = if t.status == TaskStatus::Completed {
            "x"
        } else {
            " "
        };
        crate::outln!("  [{mark}] {}  {}", t.id, t.description)?;
    }
    Ok(())
}

/// The scripted executor's result for one action of the calculator's loop.
pub fn act(action: &str, root: &Path, env: impl Fn(&str) -> String) -> Result<Value> {
    Ok(match action {
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
        "develop" => develop(root, &env("LOOPD_TASK"))?,
        "debug" => debug(Path::new(&env("LOOPD_STATE_FILE")))?,
        "complete" => json!({
            "status": "success",
            "summary": "all tests pass",
            "state_updates": {"summary": "calc.sh has add and sub, and mul multiplies again; the test suite passes."}
        }),
        other => json!({"status": "failed", "summary": format!("the demo agent cannot {other}")}),
    })
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
