//! Tasks developed at once (`parallel`, docs/tasks.md), through the real binary
//! on real git repositories: each attempt in a work tree of its own, all supervised together,
//! merged back in task order; the needs of a task, a conflict sent back to its agent, a stop
//! that ends every attempt of a batch, and a daemon killed mid-batch.

mod common;

use std::path::Path;

use common::*;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

/// develop: a task whose description is `meet N ...` says it is here (in the progress dir, which
/// every attempt may write) and waits for N tasks to be there at once, then writes its own file
/// `out-TASK.txt` with how many it met; `shared` also writes `shared.txt` (over it, or after
/// what the others wrote when its prompt says its result could not be merged); `needs FILE`
/// writes whether FILE is in its tree; `hold` writes its pid and waits while the progress
/// dir's `hold` is there.
const AGENT: &str = r#"
prompt=$(cat)
progress="$LOOPD_PROGRESS_DIR"
result() { echo "{\"status\":\"success\",\"summary\":\"$1\"}" > "$LOOPD_RESULT_FILE"; }
case "$LOOPD_ACTION" in
  develop)
    set -- $LOOPD_TASK
    case "$1" in
      meet)
        mkdir -p "$progress/meet"; : > "$progress/meet/$LOOPD_TASK_ID"
        i=0
        while [ "$(ls "$progress/meet" | wc -l)" -lt "$2" ] && [ $i -lt 1500 ]; do
          sleep 0.02; i=$((i+1))
        done
        ls "$progress/meet" | wc -l | tr -d ' ' > "out-$LOOPD_TASK_ID.txt" ;;
      needs)
        if [ -f "$2" ]; then echo saw > "out-$LOOPD_TASK_ID.txt"; else echo missing > "out-$LOOPD_TASK_ID.txt"; fi ;;
      hold)
        mkdir -p "$progress/pids"; echo $$ > "$progress/pids/$LOOPD_TASK_ID"
        i=0; while [ -f "$progress/hold" ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done
        echo done > "out-$LOOPD_TASK_ID.txt" ;;
    esac
    case "$LOOPD_TASK" in
      *shared*)
        if printf '%s' "$prompt" | grep -q "could not be merged"; then
          echo "$LOOPD_TASK_ID" >> shared.txt
        else
          echo "$LOOPD_TASK_ID" > shared.txt
        fi ;;
    esac
    result "did $LOOPD_TASK_ID" ;;
  validate) echo '{"status":"success","state_updates":{"passed":true,"pass_rate":100}}' > "$LOOPD_RESULT_FILE" ;;
  *) result ok ;;
esac
"#;

/// A project in a git repository of one commit (`shared.txt` in it), the loop's state ignored.
fn repo_project() -> Project {
    let p = Project::new(AGENT);
    let root = &p.root;
    git(root, &["init", "--quiet", "--initial-branch=main"]);
    std::fs::write(root.join(".gitignore"), ".loop/\n").unwrap();
    std::fs::write(root.join("shared.txt"), "base\n").unwrap();
    git(root, &["add", "."]);
    git(root, &["commit", "--quiet", "-m", "base"]);
    p
}

fn tasks(state: &Value) -> Vec<Value> {
    state["skill_state"]["develop"]["tasks"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn read(root: &Path, file: &str) -> String {
    std::fs::read_to_string(root.join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .trim()
        .to_owned()
}

/// Where the loop's lanes live; gone when no batch runs.
fn lanes(p: &Project, id: &str) -> std::path::PathBuf {
    p.root.join(".loop/worktrees").join(format!("{id}.lanes"))
}

fn task_ids(event: &Value) -> Vec<String> {
    event["tasks"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| t.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn four_tasks_are_developed_at_once_and_merged_back() {
    let p = repo_project();
    let head = git(&p.root, &["rev-parse", "HEAD"]);
    let mut args = vec!["--title", "four at once", "--parallel", "4"];
    for _ in 0..4 {
        args.extend(["--task", "meet 4"]);
    }
    let id = p.create(&args);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    // Each met the other three: they ran at the same time, each in a tree of its own.
    for n in 1..=4 {
        assert_eq!(read(&p.root, &format!("out-task-00{n}.txt")), "4");
    }
    let batches = p.events_named(&id, "batch_started");
    assert_eq!(batches.len(), 1, "{batches:?}");
    assert_eq!(
        task_ids(&batches[0]),
        ["task-001", "task-002", "task-003", "task-004"]
    );
    let merged: Vec<Value> = p.events_named(&id, "merged");
    let merged_tasks: Vec<&str> = merged
        .iter()
        .filter_map(|e| e["task_id"].as_str())
        .collect();
    assert_eq!(
        merged_tasks,
        ["task-001", "task-002", "task-003", "task-004"]
    );
    // Each merge is a checkpoint with both sides as parents: the loop's tree and the task's.
    let refs = git(
        &p.root,
        &[
            "for-each-ref",
            "--format=%(refname:lstrip=3)",
            &format!("refs/loopd/{id}/"),
        ],
    );
    let merges: Vec<&str> = refs.lines().filter(|r| r.ends_with("-merge")).collect();
    assert_eq!(merges.len(), 4, "{refs}");
    for merge in &merges {
        let parents = git(
            &p.root,
            &[
                "rev-list",
                "--parents",
                "-n1",
                &format!("refs/loopd/{id}/{merge}"),
            ],
        );
        assert_eq!(parents.split_whitespace().count(), 3, "{merge}: {parents}");
    }
    // The last merge holds every task's file exactly once, as the work tree does.
    let last = merges
        .iter()
        .max_by_key(|m| m.split('-').next().unwrap().parse::<u64>().unwrap())
        .unwrap();
    let files = git(
        &p.root,
        &[
            "ls-tree",
            "-r",
            "--name-only",
            &format!("refs/loopd/{id}/{last}"),
        ],
    );
    for n in 1..=4 {
        let name = format!("out-task-00{n}.txt");
        assert_eq!(files.lines().filter(|f| *f == name).count(), 1, "{files}");
    }

    let state = p.state(&id);
    assert!(
        tasks(&state).iter().all(|t| t["status"] == "completed"),
        "{state}"
    );
    assert!(state["skill_state"].get("lanes").is_none(), "{state}");
    assert!(
        !lanes(&p, &id).exists(),
        "the lanes' work trees are removed"
    );
    assert!(!git(&p.root, &["worktree", "list"]).contains(".lanes"));
    // Validation ran once, over the merged tree; the user's branch never moved.
    assert_eq!(p.events_named(&id, "validated").len(), 1);
    assert_eq!(git(&p.root, &["rev-parse", "HEAD"]), head);
}

#[test]
fn a_task_waits_for_the_tasks_it_needs() {
    let p = repo_project();
    let id = p.create(&[
        "--title",
        "needs",
        "--parallel",
        "2",
        "--task",
        "meet 2",
        "--task",
        "meet 2",
    ]);
    let out = p.output(&[
        "task",
        "add",
        &id,
        "needs out-task-001.txt",
        "--after",
        "task-001",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let set = p.output(&["set", &id, "--parallel", "3"]);
    assert_eq!(code(&set), 0, "{}", stderr(&set));
    assert_eq!(p.state(&id)["parallel"], 3);
    let bad = p.output(&["task", "add", &id, "x", "--after", "task-009"]);
    assert_eq!(code(&bad), 2);
    assert!(stderr(&bad).contains("no such task"), "{}", stderr(&bad));

    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    // The first two ran together; the third only after, on a tree with the first's work.
    let batches = p.events_named(&id, "batch_started");
    assert_eq!(task_ids(&batches[0]), ["task-001", "task-002"]);
    assert_eq!(read(&p.root, "out-task-001.txt"), "2");
    assert_eq!(read(&p.root, "out-task-003.txt"), "saw");
    let state = p.state(&id);
    let third = tasks(&state)
        .into_iter()
        .find(|t| t["id"] == "task-003")
        .unwrap();
    assert_eq!(third["after"], serde_json::json!(["task-001"]));
    assert_eq!(third["status"], "completed");
}

#[test]
fn a_conflict_goes_back_to_the_agent_with_the_merged_tree() {
    let p = repo_project();
    let id = p.create(&[
        "--title",
        "conflict",
        "--parallel",
        "2",
        "--task",
        "meet 2 shared",
        "--task",
        "meet 2 shared",
    ]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    let conflicts = p.events_named(&id, "merge_conflict");
    assert_eq!(conflicts.len(), 1, "{conflicts:?}");
    assert_eq!(conflicts[0]["task_id"], "task-002");
    assert_eq!(conflicts[0]["files"], serde_json::json!(["shared.txt"]));
    assert_eq!(conflicts[0]["failed"], false);
    // Neither side was dropped: the second task did its work again after the first's.
    assert_eq!(read(&p.root, "shared.txt"), "task-001\ntask-002");
    let state = p.state(&id);
    let history = state["skill_state"]["action_history"].as_array().unwrap();
    assert!(
        history
            .iter()
            .any(|h| h["outcome"] == "merge_conflict" && h["task_id"] == "task-002"),
        "{history:?}"
    );
    let second = tasks(&state)
        .into_iter()
        .find(|t| t["id"] == "task-002")
        .unwrap();
    assert_eq!(second["status"], "completed");
    assert_eq!(second["merge_conflict"], Value::Null, "{second}");
}

/// Waits until every task of `ids` has written its pid; returns them.
fn held_pids(p: &Project, id: &str, ids: &[&str]) -> Vec<u32> {
    let dir = p.progress(id).join("pids");
    wait_for("every attempt of the batch to start", || {
        ids.iter().all(|t| dir.join(t).exists())
    });
    ids.iter().map(|t| read_pid(&dir.join(t))).collect()
}

fn hold_loop(p: &Project) -> String {
    let id = p.create(&[
        "--title",
        "hold",
        "--parallel",
        "3",
        "--task",
        "hold",
        "--task",
        "hold",
        "--task",
        "hold",
    ]);
    let progress = p.progress(&id);
    std::fs::create_dir_all(&progress).unwrap();
    std::fs::write(progress.join("hold"), "").unwrap();
    id
}

#[test]
fn a_stop_ends_every_attempt_of_a_batch() {
    let p = repo_project();
    let id = hold_loop(&p);
    let run = p.spawn_run(&id, &[]);
    let pids = held_pids(&p, &id, &["task-001", "task-002", "task-003"]);
    assert_eq!(
        p.state(&id)["skill_state"]["lanes"]
            .as_array()
            .map(Vec::len),
        Some(3)
    );
    // `status` lists every attempt in flight, `list` says how many.
    let status = stdout(&p.output(&["status", &id]));
    for t in ["task-001", "task-002", "task-003"] {
        assert!(
            status.contains(&format!("develop {t} attempt 1")),
            "{status}"
        );
    }
    let list = stdout(&p.output(&["list"]));
    assert!(list.contains("develop x3"), "{list}");

    let out = p.output(&["stop", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = wait_output(run, DEADLINE);
    assert_eq!(code(&out), 5, "{}", stderr(&out));
    for pid in pids {
        assert!(!alive(pid), "attempt {pid} outlived the stop");
    }
    let state = p.state(&id);
    assert!(state["skill_state"].get("lanes").is_none(), "{state}");
    let interrupted = p.events_named(&id, "action_interrupted");
    assert_eq!(interrupted.len(), 3, "{interrupted:?}");
    assert!(!lanes(&p, &id).exists());
    assert!(!tasks(&state).iter().any(|t| t["status"] == "completed"));
}

#[test]
fn a_daemon_killed_mid_batch_is_recovered_by_the_next() {
    let p = repo_project();
    let id = hold_loop(&p);
    let mut run = p.spawn_run(&id, &[]);
    let pids = held_pids(&p, &id, &["task-001", "task-002", "task-003"]);
    kill(Pid::from_raw(run.id() as i32), Signal::SIGKILL).unwrap();
    run.wait().unwrap();
    // The attempts are orphans now, their trees still there, the state knows of them all.
    assert!(pids.iter().all(|&pid| alive(pid)));
    assert!(lanes(&p, &id).join("1").exists());
    assert_eq!(
        p.state(&id)["skill_state"]["lanes"]
            .as_array()
            .map(Vec::len),
        Some(3)
    );

    // The next daemon ends them and removes their trees before anything else; this time the
    // attempts do not wait.
    std::fs::remove_dir_all(p.progress(&id).join("pids")).unwrap();
    std::fs::remove_file(p.progress(&id).join("hold")).unwrap();
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    for pid in pids {
        assert!(
            !alive(pid),
            "attempt {pid} of the killed daemon outlived the recovery"
        );
    }
    let recovered: Vec<Value> = p
        .events_named(&id, "recovered")
        .into_iter()
        .filter(|e| e["action"] == "develop")
        .collect();
    assert_eq!(recovered.len(), 3, "{recovered:?}");
    assert_eq!(recovered[0]["work_trees_removed"], 3);
    for n in 1..=3 {
        assert_eq!(read(&p.root, &format!("out-task-00{n}.txt")), "done");
    }
    let state = p.state(&id);
    assert!(
        tasks(&state).iter().all(|t| t["status"] == "completed"),
        "{state}"
    );
    assert!(!lanes(&p, &id).exists());
}

#[test]
fn parallel_needs_git_and_says_so_in_one_line() {
    let p = Project::new(AGENT);
    let out = p.output(&["create", "--title", "t", "--parallel", "2"]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("needs a git repository"), "{err}");
    let id = p.create(&["--title", "t"]);
    let out = p.output(&["set", &id, "--parallel", "3"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("needs a git repository"));
    let out = p.output(&["set", &id, "--parallel", "0"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("--parallel must be at least 1"));
}

/// Executors `a` and `b`, the agent told which it is: `a` makes a small change its check rates
/// 40%, `b` a larger one rated 100%.
const RACE_AGENT: &str = r#"
cat > /dev/null
case "$LOOPD_ACTION" in
  develop)
    case "$1" in
      a) echo a > impl.txt ;;
      b) printf 'b\nmore\n' > impl.txt ;;
    esac
    echo "{\"status\":\"success\",\"summary\":\"$1 did it\"}" > "$LOOPD_RESULT_FILE" ;;
  validate)
    if grep -q b impl.txt 2>/dev/null; then rate=100; passed=true; else rate=40; passed=false; fi
    echo "{\"status\":\"success\",\"state_updates\":{\"passed\":$passed,\"pass_rate\":$rate}}" > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

#[test]
fn a_race_of_two_executors_keeps_the_best_and_the_other_as_a_checkpoint() {
    let p = Project::new(RACE_AGENT);
    let racers = ["a", "b"]
        .map(|n| {
            format!(
                "[executors.{n}]\ncommand = [\"sh\", \"bin/agent.sh\", \"{n}\"]\n\
                 prompt = \"stdin\"\nformat = \"json\"\n"
            )
        })
        .concat();
    p.config(&format!("{TEST_CONFIG}\n{racers}"));
    git(&p.root, &["init", "--quiet", "--initial-branch=main"]);
    std::fs::write(p.root.join(".gitignore"), ".loop/\n").unwrap();
    git(&p.root, &["add", "."]);
    git(&p.root, &["commit", "--quiet", "-m", "base"]);
    let id = p.create(&["--title", "race"]);
    let one = p.output(&["task", "add", &id, "x", "--race", "a"]);
    assert_eq!(code(&one), 2);
    assert!(stderr(&one).contains("at least two"), "{}", stderr(&one));
    let out = p.output(&["task", "add", &id, "race me", "--race", "a", "--race", "b"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let started = p.events_named(&id, "race_started");
    assert_eq!(started[0]["executors"], serde_json::json!(["a", "b"]));
    let decided = p.events_named(&id, "race_decided");
    assert_eq!(decided.len(), 1, "{decided:?}");
    assert_eq!(decided[0]["winner"], "b", "{decided:?}");
    assert_eq!(
        race_rates(&decided[0]),
        [("a".to_owned(), 40.0), ("b".to_owned(), 100.0)]
    );

    // The winner is merged; the other's work is kept as a checkpoint of its own, and `diff`
    // shows it from the tree it started on.
    assert_eq!(read(&p.root, "impl.txt"), "b\nmore");
    let loser = format!("refs/loopd/{id}/1-develop-a");
    assert_eq!(git(&p.root, &["show", &format!("{loser}:impl.txt")]), "a");
    let diff = p.output(&["diff", &id, "1-develop-a"]);
    assert_eq!(code(&diff), 0, "{}", stderr(&diff));
    assert!(stdout(&diff).contains("+a"), "{}", stdout(&diff));
    assert!(!stdout(&diff).contains("more"), "{}", stdout(&diff));
    let state = p.state(&id);
    let task = &tasks(&state)[0];
    assert_eq!(task["status"], "completed");
    assert_eq!(task["race"], serde_json::json!(["a", "b"]));
    assert!(!lanes(&p, &id).exists());
}

#[test]
fn a_pause_ends_every_attempt_of_a_batch_and_a_resume_develops_them_again() {
    let p = repo_project();
    let id = hold_loop(&p);
    let run = p.spawn_run(&id, &[]);
    let pids = held_pids(&p, &id, &["task-001", "task-002", "task-003"]);
    let out = p.output(&["pause", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    wait_for("every attempt of the batch to end", || {
        pids.iter().all(|&pid| !alive(pid))
    });
    wait_for("the lanes' work trees to be removed", || {
        !lanes(&p, &id).exists()
    });
    assert_eq!(p.events_named(&id, "action_interrupted").len(), 3);

    // Resumed, the batch starts again from the loop's tree; this time the attempts go through.
    std::fs::remove_dir_all(p.progress(&id).join("pids")).unwrap();
    std::fs::remove_file(p.progress(&id).join("hold")).unwrap();
    let out = p.output(&["resume", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = wait_output(run, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(p.events_named(&id, "batch_started").len(), 2);
    for n in 1..=3 {
        assert_eq!(read(&p.root, &format!("out-task-00{n}.txt")), "done");
    }
}
