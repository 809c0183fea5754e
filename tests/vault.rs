//! The way back out of the agent's reach (docs/checkpoints.md): an action that forges or erases
//! the loop's checkpoint refs in the repository's `.git`, itself or from a grandchild in a session
//! of its own, under the default sandbox, never makes `checkpoints`, `diff` or `rollback` give
//! back a tree loopd did not record; loopd says what was done (`tampered`) and puts its copies
//! back. Through `loopd run`, the service and a parallel batch.

mod common;

use std::path::Path;

use common::*;
use serde_json::Value;

/// Points every `refs/loopd/` ref at a commit of the agent's own, whose tree holds only
/// `agent.txt`.
const FORGE: &str = r#"
blob=$(echo forged | git hash-object -w --stdin)
tree=$(printf '100644 blob %s\tagent.txt\n' "$blob" | git mktree)
forged=$(git -c user.name=agent -c user.email=agent@localhost commit-tree "$tree" -m forged)
echo "$forged" > "$LOOPD_PROGRESS_DIR/forged"
git for-each-ref --format='%(refname)' refs/loopd/ | while read -r ref; do git update-ref "$ref" "$forged"; done
for ref in $(git --git-dir=.loop/checkpoints.git for-each-ref --format='%(refname)' refs/loopd/); do
  git --git-dir=.loop/checkpoints.git update-ref "$ref" "$forged" 2>/dev/null
done
true
"#;

/// Removes every `refs/loopd/` ref, expires the reflogs and lets git drop what they held.
const ERASE: &str = r#"
git for-each-ref --format='delete %(refname)' refs/loopd/ | git update-ref --stdin
git reflog expire --expire=now --all
git gc --prune=now --quiet
git repack -a -d -q
"#;

/// develop writes the task's files; task-002's develop also runs `bin/hostile.sh` (in a new
/// session when `bin/detach` is there, waiting for it to end).
const AGENT: &str = r#"
cat > /dev/null
result() { echo "{\"status\":\"success\"$1}" > "$LOOPD_RESULT_FILE"; }
case "$LOOPD_ACTION" in
  init) result ',"state_updates":{"tasks":[{"description":"one"},{"description":"two"}]}' ;;
  develop)
    echo "$LOOPD_TASK_ID" > "code-$LOOPD_TASK_ID.txt"
    if [ "$LOOPD_TASK_ID" = task-002 ]; then
      if [ -f bin/detach ]; then
        setsid sh -c 'sh bin/hostile.sh; : > "$LOOPD_PROGRESS_DIR/hostile-done"' < /dev/null > /dev/null 2>&1 &
        i=0; while [ ! -f "$LOOPD_PROGRESS_DIR/hostile-done" ] && [ $i -lt 1500 ]; do sleep 0.02; i=$((i+1)); done
      else
        sh bin/hostile.sh
      fi
    fi
    result ',"summary":"did it"' ;;
  validate) result ',"state_updates":{"passed":true,"pass_rate":100}' ;;
  *) result '' ;;
esac
"#;

/// How the loop is driven.
#[derive(Clone, Copy, Debug)]
enum Drive {
    Run,
    Service,
    Batch,
}

/// A project in a repository of one commit (`code.txt`, the agent and `hostile`), the loop's state
/// ignored.
fn project(hostile: &str, detach: bool) -> Project {
    let p = Project::new(AGENT);
    let root = &p.root;
    std::fs::write(root.join("bin/hostile.sh"), hostile).unwrap();
    if detach {
        std::fs::write(root.join("bin/detach"), "").unwrap();
    }
    git(root, &["init", "--quiet", "--initial-branch=main"]);
    std::fs::write(root.join(".gitignore"), ".loop/\n").unwrap();
    std::fs::write(root.join("code.txt"), "v1\n").unwrap();
    git(root, &["add", "."]);
    git(root, &["commit", "--quiet", "-m", "base"]);
    p
}

/// Drives a new loop of `p` to its end, as `drive` says.
fn drive(p: &Project, drive: Drive) -> String {
    match drive {
        Drive::Run | Drive::Batch => {
            let parallel: &[&str] = match drive {
                Drive::Batch => &["--parallel", "2"],
                _ => &[],
            };
            let id = p.create(&[&["--title", "t"], parallel].concat());
            let out = p.run(&id, &[]);
            assert_eq!(code(&out), 0, "{drive:?}: {}", stderr(&out));
            id
        }
        Drive::Service => {
            let id = p.create(&["--title", "t"]);
            let service = p.serve(&["--root", p.root.to_str().unwrap()]);
            let out = p.output(&["start", &id]);
            assert!(out.status.success(), "{}", stderr(&out));
            wait_for("the loop to complete", || {
                p.state(&id)["status"] == "completed"
            });
            let out = service.stop();
            assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
            id
        }
    }
}

/// The loop's checkpoints as loopd lists them: `(name, commit)`.
fn checkpoints(p: &Project, id: &str) -> Vec<(String, String)> {
    let out = p.output(&["--json", "checkpoints", id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let listed: Value = serde_json::from_str(&stdout(&out)).unwrap();
    listed
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_owned(),
                c["commit"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn read(root: &Path, file: &str) -> Option<String> {
    std::fs::read_to_string(root.join(file)).ok()
}

/// What every case checks once the loop is done: the repository's refs are loopd's again, the
/// diff and the rollback are of loopd's trees, and `loopd checkpoints` still has them all.
fn the_way_back_holds(p: &Project, id: &str, what: &str) {
    let list = checkpoints(p, id);
    assert!(list.len() >= 3, "{what}: {list:?}");
    assert_eq!(list[0].0, "0-start", "{what}: {list:?}");
    for (name, commit) in &list {
        assert_eq!(
            &git(&p.root, &["rev-parse", &format!("refs/loopd/{id}/{name}")]),
            commit,
            "{what}: the repository's copy of {name} is not loopd's"
        );
    }
    // The first develop's checkpoint holds the first task's file and not the second's.
    let first = list
        .iter()
        .find(|(n, _)| n.contains("develop") && !n.contains("merge"))
        .map(|(n, _)| n.clone())
        .unwrap();
    let diff = stdout(&p.output(&["diff", id, &first]));
    assert!(
        diff.contains("code-task-00") && !diff.contains("agent.txt"),
        "{what}: {diff}"
    );
    let out = p.output(&["rollback", id, "0-start", "--force"]);
    assert_eq!(code(&out), 0, "{what}: {}", stderr(&out));
    assert_eq!(read(&p.root, "code.txt").as_deref(), Some("v1\n"), "{what}");
    assert_eq!(read(&p.root, "agent.txt"), None, "{what}");
    assert_eq!(read(&p.root, "code-task-001.txt"), None, "{what}");
    let (last, _) = list.last().unwrap();
    let out = p.output(&["rollback", id, last]);
    assert_eq!(code(&out), 0, "{what}: {}", stderr(&out));
    for file in ["code.txt", "code-task-001.txt", "code-task-002.txt"] {
        assert!(read(&p.root, file).is_some(), "{what}: {file} is not back");
    }
    assert_eq!(read(&p.root, "agent.txt"), None, "{what}");
}

/// Each hostile action, from the action and from a grandchild in a new session.
fn cases() -> Vec<(&'static str, &'static str, bool)> {
    vec![
        ("forge", FORGE, false),
        ("erase", ERASE, false),
        ("forge, detached", FORGE, true),
        ("erase, detached", ERASE, true),
    ]
}

fn hostile_actions_leave_the_way_back(how: Drive) {
    for (name, script, detach) in cases() {
        let what = format!("{name} ({how:?})");
        let p = project(script, detach);
        let id = drive(&p, how);
        assert!(
            p.progress(&id).join("hostile-done").exists() || !detach,
            "{what}: the grandchild never ran"
        );
        let tampered = p.events_named(&id, "tampered");
        assert!(!tampered.is_empty(), "{what}: no tampered event");
        if name.starts_with("forge") {
            let forged = read(&p.progress(&id), "forged").unwrap();
            assert!(
                tampered.iter().all(|t| t["found"] == forged.trim()),
                "{what}: {tampered:?}"
            );
        } else {
            assert!(
                tampered.iter().all(|t| t["found"].is_null()),
                "{what}: {tampered:?}"
            );
        }
        let list = checkpoints(&p, &id);
        for t in &tampered {
            assert!(
                list.iter()
                    .any(|(n, c)| t["checkpoint"] == n.as_str() && t["recorded"] == c.as_str()),
                "{what}: {t} is not of a checkpoint loopd lists: {list:?}"
            );
        }
        the_way_back_holds(&p, &id, &what);
    }
}

#[test]
fn hostile_actions_leave_the_way_back_under_loopd_run() {
    hostile_actions_leave_the_way_back(Drive::Run);
}

#[test]
fn hostile_actions_leave_the_way_back_under_the_service() {
    hostile_actions_leave_the_way_back(Drive::Service);
}

#[test]
fn hostile_actions_leave_the_way_back_in_a_parallel_batch() {
    hostile_actions_leave_the_way_back(Drive::Batch);
}

#[test]
fn refs_forged_after_the_loop_are_reported_and_put_back_by_the_cli() {
    let p = project("", false);
    let id = drive(&p, Drive::Run);
    let before = checkpoints(&p, &id);
    // As a later action of another loop, or anyone, would: forged, then erased with the objects.
    let forge = std::process::Command::new("sh")
        .args(["-c", FORGE])
        .current_dir(&p.root)
        .env("LOOPD_PROGRESS_DIR", p.progress(&id))
        .status()
        .unwrap();
    assert!(forge.success());
    let out = p.output(&["rollback", &id, "1-develop", "--force"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("tampered") || stderr(&out).contains("pointed at"),
        "{}",
        stderr(&out)
    );
    assert_eq!(read(&p.root, "agent.txt"), None);
    assert_eq!(
        read(&p.root, "code-task-001.txt").as_deref(),
        Some("task-001\n")
    );
    assert_eq!(read(&p.root, "code-task-002.txt"), None);
    assert!(!p.events_named(&id, "tampered").is_empty());
    let erase = std::process::Command::new("sh")
        .args(["-c", ERASE])
        .current_dir(&p.root)
        .status()
        .unwrap();
    assert!(erase.success());
    assert_eq!(checkpoints(&p, &id), before, "erased refs lost checkpoints");
    the_way_back_holds(&p, &id, "after the loop");
}

/// The rollback on regression gives back loopd's tree too: the develop that breaks what passed
/// also forges (or erases) every checkpoint ref, and the work tree is put back as loopd recorded
/// it at the best validation's checkpoint.
#[test]
fn the_rollback_on_regression_gives_back_loopds_tree_whatever_the_develop_did_to_git() {
    for (name, script) in [("forge", FORGE), ("erase", ERASE)] {
        let p = Project::new(REGRESSION_AGENT);
        p.config(&format!("rollback_on_regression = true\n{TEST_CONFIG}"));
        let root = &p.root;
        std::fs::write(root.join("bin/hostile.sh"), script).unwrap();
        git(root, &["init", "--quiet", "--initial-branch=main"]);
        std::fs::write(root.join(".gitignore"), ".loop/\nmarkers/\n").unwrap();
        git(root, &["add", "."]);
        git(root, &["commit", "--quiet", "-m", "base"]);
        let id = p.create(&["--title", "t", "--max-iterations", "20"]);
        let out = p.run(&id, &[]);
        assert_eq!(code(&out), 0, "{name}: {}", stderr(&out));
        let rolled = p.events_named(&id, "rolled_back");
        assert_eq!(rolled.len(), 1, "{name}: {rolled:?}");
        assert_eq!(rolled[0]["checkpoint"], "1-develop", "{name}");
        assert!(
            !p.events_named(&id, "tampered").is_empty(),
            "{name}: no tampered event"
        );
        for (file, there) in [
            ("fixed_a", true),
            ("fixed_b", true),
            ("broken_a", false),
            ("broken_c", false),
            ("agent.txt", false),
        ] {
            assert_eq!(root.join(file).exists(), there, "{name}: {file}");
        }
        assert_eq!(p.state(&id)["status"], "completed", "{name}");
    }
}
