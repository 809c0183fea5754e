//! Git checkpoints (docs/checkpoints.md), on real repositories in temporary directories, through
//! the real binary: a commit of the whole work tree after every develop and debug, on the loop's
//! own refs, with the user's branch, index, HEAD and stash untouched; `checkpoints`, `diff` and
//! `rollback`.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;

/// Develop changes the tree in every way a checkpoint must see: a tracked file edited, a new file,
/// a binary file, a tracked file deleted (by the first task), and ignored files, nested.
const TREE_AGENT: &str = r#"
cat > /dev/null
case "$LOOPD_ACTION" in
  init) echo '{"status":"success","state_updates":{"tasks":[{"description":"one"},{"description":"two"}]}}' > "$LOOPD_RESULT_FILE" ;;
  develop)
    echo "$LOOPD_TASK_ID" >> code.txt
    echo "made by $LOOPD_TASK_ID" > "new-$LOOPD_TASK_ID.txt"
    printf '\000\001\002\377' > "blob-$LOOPD_TASK_ID.bin"
    [ "$LOOPD_TASK_ID" = task-001 ] && rm -f old.txt
    mkdir -p build/deep && echo "ignored $LOOPD_TASK_ID" > build/deep/out.o
    echo '{"status":"success","summary":"did it"}' > "$LOOPD_RESULT_FILE" ;;
  validate) echo '{"status":"success","state_updates":{"passed":true,"pass_rate":100}}' > "$LOOPD_RESULT_FILE" ;;
  *) echo '{"status":"success"}' > "$LOOPD_RESULT_FILE" ;;
esac
"#;

/// A repository in the project root with one commit, and the user's own work in progress: a
/// staged change, an unstaged one, and a stash.
fn user_repo(p: &Project) {
    let root = &p.root;
    git(root, &["init", "--quiet", "--initial-branch=main"]);
    std::fs::write(root.join(".gitignore"), "build/\n.loop/\n").unwrap();
    std::fs::write(root.join("code.txt"), "v1\n").unwrap();
    std::fs::write(root.join("old.txt"), "to be deleted\n").unwrap();
    std::fs::write(root.join("staged.txt"), "one\n").unwrap();
    git(root, &["add", "."]);
    git(root, &["commit", "--quiet", "-m", "base"]);
    std::fs::write(root.join("staged.txt"), "stashed\n").unwrap();
    git(root, &["stash", "--quiet"]);
    std::fs::write(root.join("staged.txt"), "two\n").unwrap();
    git(root, &["add", "staged.txt"]);
}

/// What the user's git looks like: HEAD, branch, index, stash.
fn users_git(root: &Path) -> (String, String, Vec<u8>, String) {
    (
        git(root, &["rev-parse", "HEAD"]),
        git(root, &["symbolic-ref", "--quiet", "HEAD"]),
        std::fs::read(root.join(".git/index")).unwrap(),
        git(root, &["stash", "list", "--format=%H"]),
    )
}

/// The files of a commit's tree.
fn files_of(root: &Path, commit: &str) -> Vec<String> {
    git(root, &["ls-tree", "-r", "--name-only", commit])
        .lines()
        .map(str::to_owned)
        .collect()
}

fn refs(root: &Path, id: &str) -> Vec<String> {
    git(
        root,
        &[
            "for-each-ref",
            "--format=%(refname:lstrip=3)",
            &format!("refs/loopd/{id}/"),
        ],
    )
    .lines()
    .map(str::to_owned)
    .collect()
}

#[test]
fn a_checkpoint_per_develop_records_the_whole_tree_and_leaves_the_users_git_alone() {
    let p = Project::new(TREE_AGENT);
    user_repo(&p);
    let before = users_git(&p.root);
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    assert_eq!(
        users_git(&p.root),
        before,
        "the user's HEAD, branch, index or stash changed"
    );
    let mut names = refs(&p.root, &id);
    names.sort();
    assert_eq!(names, ["0-start", "1-develop", "2-develop"]);
    let commit = |name: &str| git(&p.root, &["rev-parse", &format!("refs/loopd/{id}/{name}")]);
    // Where the loop started holds the user's work in progress, and descends from HEAD.
    let start = files_of(&p.root, &commit("0-start"));
    assert!(start.contains(&"old.txt".to_owned()) && start.contains(&"staged.txt".to_owned()));
    assert_eq!(
        git(&p.root, &["rev-parse", &format!("{}^", commit("0-start"))]),
        before.0
    );
    let first = files_of(&p.root, &commit("1-develop"));
    for present in [
        "code.txt",
        "new-task-001.txt",
        "blob-task-001.bin",
        ".gitignore",
    ] {
        assert!(
            first.contains(&present.to_owned()),
            "{present} missing: {first:?}"
        );
    }
    assert!(
        !first.contains(&"old.txt".to_owned()),
        "a deleted file is still there"
    );
    assert!(
        !first
            .iter()
            .any(|f| f.starts_with("build/") || f.starts_with(".loop/")),
        "ignored files or the state dir recorded: {first:?}"
    );
    let blob = git(
        &p.root,
        &[
            "cat-file",
            "-s",
            &format!("{}:blob-task-001.bin", commit("1-develop")),
        ],
    );
    assert_eq!(blob, "4", "the binary file is recorded byte for byte");
    // Each checkpoint is the child of the one before.
    assert_eq!(
        git(
            &p.root,
            &["rev-parse", &format!("{}^", commit("2-develop"))]
        ),
        commit("1-develop")
    );

    // The history entry and the event carry the commit and what it changed.
    let finished: Vec<Value> = p
        .events(&id)
        .into_iter()
        .filter(|e| e["event"] == "action_finished" && e["action"] == "develop")
        .collect();
    assert_eq!(finished.len(), 2);
    let c = &finished[1]["checkpoint"];
    assert_eq!(c["name"], "2-develop");
    assert_eq!(c["commit"], commit("2-develop").as_str());
    assert_eq!(
        c["files"], 3,
        "code.txt, new-task-002.txt, blob-task-002.bin: {c}"
    );
    assert_eq!(
        (c["insertions"].clone(), c["deletions"].clone()),
        (2.into(), 0.into())
    );
    let history = p.state(&id)["skill_state"]["action_history"].clone();
    let develop = history
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|h| h["action"] == "develop")
        .expect("a develop in the history");
    assert_eq!(
        develop["checkpoint"]["commit"],
        commit("2-develop").as_str()
    );
}

#[test]
fn checkpoints_diff_and_rollback_through_the_binary() {
    let p = Project::new(TREE_AGENT);
    user_repo(&p);
    let id = p.create(&["--title", "t"]);
    assert_eq!(code(&p.run(&id, &[])), 0);

    let listed = p.output(&["--json", "checkpoints", &id]);
    assert_eq!(code(&listed), 0, "{}", stderr(&listed));
    let listed: Value = serde_json::from_str(&stdout(&listed)).unwrap();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["0-start", "1-develop", "2-develop"]);
    let text = stdout(&p.output(&["checkpoints", &id]));
    assert!(
        text.contains("2-develop") && text.contains("3 files"),
        "{text}"
    );

    let one = stdout(&p.output(&["diff", &id, "2-develop"]));
    assert!(
        one.contains("+task-002") && one.contains("new-task-002.txt"),
        "{one}"
    );
    assert!(
        !one.contains("task-001.txt"),
        "the diff of one action shows another's: {one}"
    );
    let whole = stdout(&p.output(&["diff", &id]));
    assert!(whole.contains("new-task-001.txt") && whole.contains("new-task-002.txt"));
    assert!(
        whole.contains("old.txt"),
        "the loop deleted old.txt: {whole}"
    );
    let missing = p.output(&["diff", &id, "9-develop"]);
    assert_eq!(code(&missing), 2);
    assert!(
        stderr(&missing).contains("2-develop"),
        "{}",
        stderr(&missing)
    );

    // A change no checkpoint holds is refused, in one line, and left as it is.
    std::fs::write(p.root.join("code.txt"), "mine\n").unwrap();
    let refused = p.output(&["rollback", &id, "1-develop"]);
    assert_eq!(code(&refused), 2, "{}", stderr(&refused));
    assert_eq!(
        stderr(&refused).trim().lines().count(),
        1,
        "{}",
        stderr(&refused)
    );
    assert_eq!(
        std::fs::read_to_string(p.root.join("code.txt")).unwrap(),
        "mine\n"
    );

    let before = users_git(&p.root);
    let forced = p.output(&["rollback", &id, "1-develop", "--force"]);
    assert_eq!(code(&forced), 0, "{}", stderr(&forced));
    let read = |f: &str| std::fs::read_to_string(p.root.join(f)).ok();
    assert_eq!(read("code.txt").unwrap(), "v1\ntask-001\n");
    assert!(read("new-task-001.txt").is_some());
    assert!(
        read("new-task-002.txt").is_none(),
        "a file made after the checkpoint is left"
    );
    assert!(read("blob-task-002.bin").is_none());
    assert!(
        read("old.txt").is_none(),
        "old.txt was deleted at 1-develop"
    );
    assert_eq!(
        read("build/deep/out.o").as_deref(),
        Some("ignored task-002\n"),
        "ignored files are left alone"
    );
    assert_eq!(
        users_git(&p.root),
        before,
        "rollback touched the user's git"
    );
    assert!(p.event_names(&id).iter().any(|n| n == "rolled_back"));

    // Now the tree is a checkpoint's: back to the start without --force.
    let back = p.output(&["rollback", &id, "0-start"]);
    assert_eq!(code(&back), 0, "{}", stderr(&back));
    assert_eq!(read("code.txt").unwrap(), "v1\n");
    assert_eq!(read("old.txt").unwrap(), "to be deleted\n");
    assert_eq!(
        read("staged.txt").unwrap(),
        "two\n",
        "the user's work in progress is back"
    );
    assert!(read("new-task-001.txt").is_none());
}

#[test]
fn a_running_loop_is_not_rolled_back_and_loops_keep_their_own_refs() {
    let p = Project::new(&agent(&[(
        "develop",
        "echo x >> f.txt; echo $$ > agent.pid; sleep 100",
    )]));
    git(&p.root, &["init", "--quiet"]);
    let first = p.create(&["--title", "a"]);
    let run = p.spawn_run(&first, &[]);
    wait_for("the develop in flight", || {
        p.root.join("agent.pid").exists()
    });
    let refused = p.output(&["rollback", &first, "0-start"]);
    assert_eq!(code(&refused), 2);
    assert!(
        stderr(&refused).contains("pause it first"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(code(&p.output(&["stop", &first])), 0);
    let out = wait_output(run, DEADLINE);
    assert_eq!(code(&out), 5, "{}", stderr(&out));

    // An empty repository (no commit yet): the start has no parent, and nothing else moves.
    assert_eq!(refs(&p.root, &first), ["0-start"]);
    let start = git(
        &p.root,
        &["rev-parse", &format!("refs/loopd/{first}/0-start")],
    );
    let files = files_of(&p.root, &start);
    assert!(files.contains(&"bin/agent.sh".to_owned()), "{files:?}");
    assert!(
        !files.iter().any(|f| f.starts_with(".loop/")),
        "the state dir (not ignored here) is recorded: {files:?}"
    );
    assert!(
        Command::new("git")
            .arg("-C")
            .arg(&p.root)
            .args(["rev-parse", "--verify", "--quiet", "HEAD"])
            .output()
            .unwrap()
            .stdout
            .is_empty()
    );

    p.agent(GOOD_AGENT);
    let second = p.create(&["--title", "b"]);
    assert_eq!(code(&p.run(&second, &[])), 0);
    assert_eq!(
        refs(&p.root, &first),
        ["0-start"],
        "another loop's refs changed"
    );
    assert!(refs(&p.root, &second).contains(&"0-start".to_owned()));
}

#[test]
fn a_detached_head_a_submodule_and_checkpoints_off() {
    let sub = Project::new(GOOD_AGENT);
    git(&sub.root, &["init", "--quiet"]);
    std::fs::write(sub.root.join("lib.txt"), "lib\n").unwrap();
    git(&sub.root, &["add", "lib.txt"]);
    git(&sub.root, &["commit", "--quiet", "-m", "lib"]);

    let p = Project::new(TREE_AGENT);
    user_repo(&p);
    git(
        &p.root,
        &[
            "-c",
            "protocol.file.allow=always",
            "submodule",
            "add",
            "--quiet",
            sub.root.to_str().unwrap(),
            "vendor/lib",
        ],
    );
    git(&p.root, &["commit", "--quiet", "-m", "submodule"]);
    let head = git(&p.root, &["rev-parse", "HEAD"]);
    git(&p.root, &["checkout", "--quiet", "--detach", &head]);
    let id = p.create(&["--title", "t"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let last = git(
        &p.root,
        &["rev-parse", &format!("refs/loopd/{id}/2-develop")],
    );
    let entry = git(&p.root, &["ls-tree", &last, "vendor/lib"]);
    assert!(
        entry.starts_with("160000 commit"),
        "the submodule is recorded as such: {entry}"
    );
    assert_eq!(
        git(&p.root, &["rev-parse", "HEAD"]),
        head,
        "the detached HEAD moved"
    );
    assert!(!p.event_names(&id).iter().any(|n| n == "warning"));

    let off = Project::new(TREE_AGENT);
    user_repo(&off);
    off.config(&format!("checkpoint = \"off\"\n{TEST_CONFIG}"));
    let id = off.create(&["--title", "t"]);
    assert_eq!(code(&off.run(&id, &[])), 0);
    assert!(refs(&off.root, &id).is_empty());
    let none = off.output(&["checkpoints", &id]);
    assert_eq!(
        stdout(&none).trim(),
        format!("loop {id} has no checkpoint yet")
    );

    // Outside a git repository: no checkpoints, and the commands say why in one line.
    let plain = Project::new(GOOD_AGENT);
    let id = plain.create(&["--title", "t"]);
    assert_eq!(code(&plain.run(&id, &[])), 0);
    for args in [
        vec!["checkpoints", &id],
        vec!["diff", &id],
        vec!["rollback", &id, "0-start"],
    ] {
        let out = plain.output(&args);
        assert_eq!(code(&out), 2, "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("not in a git repository"),
            "{}",
            stderr(&out)
        );
        assert_eq!(stderr(&out).trim().lines().count(), 1, "{}", stderr(&out));
    }
}

#[test]
fn a_develop_that_breaks_what_passed_is_rolled_back_and_the_loop_completes() {
    let p = Project::new(REGRESSION_AGENT);
    p.config(&format!("rollback_on_regression = true\n{TEST_CONFIG}"));
    user_repo(&p);
    std::fs::write(p.root.join(".gitignore"), "build/\n.loop/\nmarkers/\n").unwrap();
    git(&p.root, &["add", ".gitignore"]);
    let before = users_git(&p.root);
    let id = p.create(&["--title", "t", "--max-iterations", "20"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    let events = p.events(&id);
    let rolled: Vec<&Value> = events
        .iter()
        .filter(|e| e["event"] == "rolled_back")
        .collect();
    assert_eq!(rolled.len(), 1, "{rolled:?}");
    let r = rolled[0];
    assert_eq!(r["reason"], "regression");
    assert_eq!(r["checkpoint"], "1-develop");
    assert_eq!(
        (r["best_pass_rate"].as_f64(), r["pass_rate"].as_f64()),
        (Some(66.0), Some(33.0))
    );
    assert_eq!(r["tasks"], serde_json::json!(["task-002"]));
    // The second develop ran again, told why, and this time broke nothing.
    assert!(
        p.root.join("markers/told").exists(),
        "the regression was not in the prompt"
    );
    for (file, there) in [
        ("fixed_a", true),
        ("fixed_b", true),
        ("broken_a", false),
        ("broken_c", false),
    ] {
        assert_eq!(p.root.join(file).exists(), there, "{file}");
    }
    let state = p.state(&id);
    assert_eq!(state["status"], "completed");
    assert_eq!(state["skill_state"]["validate"]["passed"], true);
    assert_eq!(
        state["skill_state"]["best_validation"]["pass_rate"].as_f64(),
        Some(100.0)
    );
    // The user's own work in progress was never touched.
    assert_eq!(users_git(&p.root), before);
    assert_eq!(
        std::fs::read_to_string(p.root.join("staged.txt")).unwrap(),
        "two\n"
    );
}

#[test]
fn only_the_last_checkpoints_are_kept_and_a_stale_index_lock_is_no_obstacle() {
    let p = Project::new(TREE_AGENT);
    p.config(&format!("checkpoint_keep = 1\n{TEST_CONFIG}"));
    user_repo(&p);
    // A loop before makes the checkpoints' vault.
    let before = p.create(&["--title", "before"]);
    assert_eq!(code(&p.run(&before, &[])), 0);
    let id = p.create(&["--title", "t"]);
    // What a git killed in the middle of a checkpoint leaves.
    let lock = p.root.join(format!(
        ".loop/checkpoints.git/indexes/{id}.checkpoint.lock"
    ));
    std::fs::write(&lock, "").unwrap();
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(!p.event_names(&id).iter().any(|n| n == "warning"));
    let mut names = refs(&p.root, &id);
    names.sort();
    assert_eq!(
        names,
        ["0-start", "2-develop"],
        "the start stays, the oldest go"
    );
}
