//! A fleet of workers that share no directory: loops on Temporal whose project is a git remote (a
//! bare repository of the test), each worker with a home, working directory and cache of its own,
//! against a real Temporal dev server ([`common::temporal`]). A loop's work must follow it from
//! worker to worker through its checkpoints on the remote, whatever happens to a worker or to the
//! remote. Built with `--features temporal`.
#![cfg(feature = "temporal")]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::temporal::{Temporal, temporal_bin};
use common::{Project, alive, code, git, race_rates, read_pid, stderr, stdout};
use serde_json::Value;

/// How long a test waits for its fleet to finish its loops: a bound that catches a hang.
const FLEET_DEADLINE: Duration = Duration::from_secs(180);

/// The agent of the fleet's loops: init plans two tasks; each develop appends its task's id to
/// `work.txt` in the work tree and to its notes, `develop.md` in the progress directory;
/// validate passes. `$MARKS` (set by the project's config) is a
/// directory of the test where a step of a test's own (`$STEP`, run before each action) leaves
/// its marks.
const AGENT: &str = r#"
cat > /dev/null
[ -f "$MARKS/step.sh" ] && . "$MARKS/step.sh"
case "$LOOPD_ACTION" in
  init) r='{"status":"success","summary":"planned","state_updates":{"tasks":[{"description":"first"},{"description":"second"}]}}' ;;
  develop) echo "$LOOPD_TASK_ID" >> work.txt; echo "$LOOPD_TASK_ID" >> "$LOOPD_PROGRESS_DIR/develop.md"
    r="{\"status\":\"success\",\"summary\":\"did $LOOPD_TASK_ID\"}" ;;
  validate) r='{"status":"success","summary":"ok","state_updates":{"passed":true,"pass_rate":100}}' ;;
  *) r='{"status":"success","summary":"done"}' ;;
esac
echo "$r" > "$LOOPD_RESULT_FILE"
"#;

/// A step's wait of a develop for another task's to run at the same time (at most 20 s), once per
/// task: it then says in `$MARKS/met-TASK` how many it met (2 when they ran at once).
/// `$WHO` names the one that waits, when it is not the task (a racing executor).
const MEET: &str = r#"who=${WHO:-$LOOPD_TASK_ID}; if [ ! -e "$MARKS/met-$who" ]; then
  mkdir -p "$MARKS/meet"; : > "$MARKS/meet/$who"
  i=0; while [ "$(ls "$MARKS/meet" | wc -l)" -lt 2 ] && [ $i -lt 1000 ]; do sleep 0.02; i=$((i+1)); done
  ls "$MARKS/meet" | wc -l | tr -d ' ' > "$MARKS/met-$who"
fi"#;

/// A project in a git repository whose remote is a bare repository of the test, workers in
/// directories of their own, and a Temporal server.
struct Fleet {
    p: Project,
    temporal: Temporal,
    /// The bare repository the loops' work goes to.
    remote: PathBuf,
    /// Where a test's step leaves its marks (`$MARKS`).
    marks: PathBuf,
    /// The workers' homes, caches and working directories.
    places: tempfile::TempDir,
}

impl Fleet {
    /// `None` where the Temporal server is not installed (outside CI).
    fn new() -> Option<Fleet> {
        Fleet::with_executor("")
    }

    /// [`Fleet::new`], with more settings of the loops' executor: `sandbox = "off"` where a
    /// test's agent injects a fault into its worker (the sandbox would stop it there), or more
    /// executors (`@MARKS@` in them is `$MARKS`).
    fn with_executor(settings: &str) -> Option<Fleet> {
        let bin = temporal_bin()?;
        let p = Project::new(AGENT);
        let marks = p.root.join("marks");
        let places = tempfile::tempdir().expect("tempdir");
        let remote = places.path().join("remote.git");
        std::fs::create_dir_all(&marks).expect("mkdir marks");
        let settings = settings.replace("@MARKS@", &marks.display().to_string());
        p.config(&format!(
            "retry_backoff = 0.01\naction_retries = 12\nexecutor = \"fake\"\nmax_errors = 20\n\
             [executor_defaults]\nkill_grace = 0.5\n\n\
             [executors.fake]\ncommand = [\"sh\", \"bin/agent.sh\"]\nprompt = \"stdin\"\n\
             format = \"json\"\nenv = {{ MARKS = \"{0}\" }}\n\
             # The test's marks are outside the workers' work trees.\n\
             sandbox_writable = [\"{0}\"]\n{settings}\n",
            marks.display()
        ));
        std::fs::write(
            p.root.join(".gitignore"),
            "/marks/\n/temporal.*\n/worker-*.log\n",
        )
        .expect("write .gitignore");
        git(&p.root, &["init", "--quiet", "--initial-branch=main"]);
        git(&p.root, &["add", "--all"]);
        git(&p.root, &["commit", "--quiet", "-m", "the project"]);
        git(places.path(), &["init", "--quiet", "--bare", "remote.git"]);
        let temporal = Temporal::start(&p, &bin);
        Some(Fleet {
            p,
            temporal,
            remote,
            marks,
            places,
        })
    }

    /// Starts worker `name` in a directory of its own (its home, working directory and cache).
    fn worker(&mut self, name: &str) {
        self.worker_configured(name, "");
    }

    /// Starts worker `name` as [`Fleet::worker`] does, `config` its user's config file.
    fn worker_configured(&mut self, name: &str, config: &str) {
        let place = self.place(name);
        std::fs::create_dir_all(place.join(".config/loopd")).expect("mkdir the worker's config");
        std::fs::write(place.join(".config/loopd/config.toml"), config)
            .expect("write the worker's config");
        let cache = place.join("cache");
        self.temporal.worker_with(&self.p, name, |cmd| {
            cmd.env("HOME", &place)
                .current_dir(&place)
                .arg("--cache")
                .arg(&cache);
        });
    }

    /// Worker `name`'s directory (made if missing).
    fn place(&self, name: &str) -> PathBuf {
        let place = self.places.path().join(name);
        std::fs::create_dir_all(&place).expect("mkdir the worker's place");
        place
    }

    /// `loopd create --temporal ADDR --remote REMOTE ARGS...`: the new loop's id.
    fn create(&self, args: &[&str]) -> String {
        let remote = self.remote.display().to_string();
        self.temporal
            .create(&self.p, &[&["--remote", remote.as_str()], args].concat())
    }

    /// Starts workers `names` of one action at a time each: the tasks of a batch go to
    /// different workers.
    fn single_action_workers(&mut self, names: &[&str]) {
        for name in names {
            self.worker_configured(name, "[temporal]\nmax_actions = 1\n");
        }
    }

    /// A loop on the remote whose two tasks (`first`, `second`) are developed at once.
    fn create_two_at_once(&self, title: &str) -> String {
        self.create(&[
            "--title",
            title,
            "--parallel",
            "2",
            "--task",
            "first",
            "--task",
            "second",
        ])
    }

    /// The loops on Temporal as `loopd list --temporal --json` lists them.
    fn list(&self) -> Vec<Value> {
        let out = self.temporal.command(&self.p, &["--json", "list"]);
        assert_eq!(code(&out), 0, "list: {}", stderr(&out));
        serde_json::from_str::<Value>(&stdout(&out))
            .expect("JSON")
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Waits until every loop of `ids` is completed (listed so), for at most [`FLEET_DEADLINE`].
    fn wait_completed(&self, ids: &[String]) {
        let mut listed = Vec::new();
        wait_until("every loop to complete", FLEET_DEADLINE, || {
            listed = self.list();
            ids.iter().all(|id| {
                listed
                    .iter()
                    .any(|l| l["loop_id"] == id.as_str() && l["status"] == "completed")
            })
        });
    }

    /// Loop `id`'s state as its workflow holds it.
    fn state(&self, id: &str) -> Value {
        self.temporal.state(&self.p, id)
    }

    /// Checks what loop `id` left on the remote: its branch holds one commit per develop
    /// action, in order, each its checkpoint, on top of the base; `work.txt` and the notes'
    /// `develop.md` hold each task once, in order, and nothing an attempt that did not succeed
    /// wrote.
    fn check_branch(&self, id: &str) {
        let branch = format!("loopd/{id}");
        let base = git(
            &self.remote,
            &["rev-parse", &format!("refs/loopd/{id}/0-start")],
        );
        let commits = git(
            &self.remote,
            &[
                "log",
                "--reverse",
                "--format=%H %s",
                &format!("{base}..{branch}"),
            ],
        );
        let commits: Vec<(&str, &str)> = commits
            .lines()
            .map(|l| l.split_once(' ').expect("hash and subject"))
            .collect();
        let names: Vec<&str> = commits
            .iter()
            .map(|(_, subject)| subject.rsplit(", ").next().expect("a checkpoint name"))
            .collect();
        assert_eq!(
            names,
            ["1-develop", "2-develop"],
            "loop {id}'s branch: {commits:?}; its history: {}",
            self.state(id)["skill_state"]["action_history"]
        );
        for ((commit, _), name) in commits.iter().zip(&names) {
            let checkpoint = git(
                &self.remote,
                &["rev-parse", &format!("refs/loopd/{id}/{name}")],
            );
            assert_eq!(checkpoint, *commit, "checkpoint {name} of loop {id}");
        }
        let work = git(&self.remote, &["show", &format!("{branch}:work.txt")]);
        assert_eq!(work, "task-001\ntask-002", "loop {id}'s work.txt");
        // The notes, as they were at the last checkpoint, followed the loop from worker to worker.
        let (head, _) = commits.last().expect("a checkpoint");
        let notes = git(
            &self.remote,
            &["show", &format!("refs/loopd-notes/{id}/{head}:develop.md")],
        );
        assert_eq!(notes, "task-001\ntask-002", "loop {id}'s develop.md");
        let state = self.state(id);
        assert_eq!(
            state["skill_state"]["outcome"], "passed",
            "loop {id}: {state}"
        );
    }

    /// Loop `id`'s note `name` as it is at the last checkpoint on its branch.
    fn notes_at_head(&self, id: &str, name: &str) -> String {
        let head = git(&self.remote, &["rev-parse", &format!("loopd/{id}")]);
        git(
            &self.remote,
            &["show", &format!("refs/loopd-notes/{id}/{head}:{name}")],
        )
    }

    /// The pid of the worker process whose descendant `pid` is.
    fn worker_of(&self, pid: u32) -> usize {
        let mut at = pid;
        while at > 1 {
            if let Some(i) = self.temporal.workers.iter().position(|w| w.0.id() == at) {
                return i;
            }
            at = parent(at);
        }
        panic!("process {pid} is no worker's");
    }

    /// Writes the step every action of the fleet's agent runs first (`$MARKS/step.sh`).
    fn step(&self, script: &str) {
        std::fs::write(self.marks.join("step.sh"), script).expect("write step.sh");
    }

    fn mark(&self, name: &str) -> PathBuf {
        self.marks.join(name)
    }

    /// Waits until the first `action` is held by a step's [`hold`].
    fn wait_held(&self, action: &str) {
        wait_until(&format!("the first {action}"), FLEET_DEADLINE, || {
            self.mark(&format!("{action}-held")).exists()
        });
    }

    /// Lets the `action` a step's [`hold`] holds go on.
    fn release(&self, action: &str) {
        std::fs::write(self.mark(&format!("{action}-go")), "").expect("write the release");
    }

    /// Checks that the develops of `tasks` ran at the same time (their [`MEET`] met 2).
    fn assert_met(&self, tasks: &[&str]) {
        for task in tasks {
            let met = std::fs::read_to_string(self.mark(&format!("met-{task}"))).unwrap();
            assert_eq!(met.trim(), "2", "{task} ran alone");
        }
    }
}

/// A step's hold of the first `action` (at most 30 s): it says so in `$MARKS/ACTION-held` and
/// waits for [`Fleet::release`].
fn hold(action: &str) -> String {
    format!(
        r#"if [ "$LOOPD_ACTION" = {action} ] && [ ! -e "$MARKS/{action}-held" ]; then
  : > "$MARKS/{action}-held"
  i=0; while [ ! -e "$MARKS/{action}-go" ] && [ $i -lt 1500 ]; do sleep 0.02; i=$((i+1)); done
fi"#
    )
}

/// The parent of process `pid` (0 when it is gone).
fn parent(pid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits for `cond`, looking every 100 ms, for at most `limit`.
fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The messages of the failed attempts loop `id` remembers.
fn failures(state: &Value) -> Vec<String> {
    state["skill_state"]["action_history"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|h| h["error"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn thirty_loops_over_three_workers_each_leave_one_commit_per_develop_on_the_remote() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    for name in ["w0", "w1", "w2"] {
        fleet.worker(name);
    }
    let ids: Vec<String> = (0..30)
        .map(|i| fleet.create(&["--title", &format!("loop {i}")]))
        .collect();
    fleet.wait_completed(&ids);
    for id in &ids {
        fleet.check_branch(id);
    }
    // Each loop names the worker that keeps its work tree.
    let listed = fleet.list();
    for l in &listed {
        assert!(
            ["w0", "w1", "w2"].contains(&l["worker"].as_str().unwrap_or_default()),
            "{l}"
        );
    }
    let out = fleet.temporal.command(&fleet.p, &["status", &ids[0]]);
    assert!(
        stdout(&out).contains("its work tree on worker w"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn a_worker_killed_mid_action_loses_only_that_action_and_leaves_no_process() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    // The second develop, the first time: its change half made, it hangs (a child too).
    fleet.step(
        "if [ \"$LOOPD_TASK_ID\" = task-002 ] && [ ! -f \"$MARKS/once\" ]; then \
           touch \"$MARKS/once\"; echo partial >> work.txt; \
           sleep 300 & echo $! > \"$MARKS/child.pid\"; echo $$ > \"$MARKS/develop.pid\"; wait; \
         fi\n",
    );
    for name in ["w0", "w1"] {
        fleet.worker(name);
    }
    let id = fleet.create(&["--title", "its worker dies"]);
    wait_until("the second develop to run", FLEET_DEADLINE, || {
        fleet.mark("develop.pid").exists()
    });
    let (executor, child) = (
        read_pid(&fleet.mark("develop.pid")),
        read_pid(&fleet.mark("child.pid")),
    );
    let dead = fleet.worker_of(executor);
    fleet.temporal.kill_worker(dead);
    wait_until(
        "the executor and its child to be gone",
        FLEET_DEADLINE,
        || !alive(executor) && !alive(child),
    );
    fleet.wait_completed(std::slice::from_ref(&id));
    fleet.check_branch(&id);
    let state = fleet.state(&id);
    let live = ["w0", "w1"][1 - dead];
    assert_eq!(state["worker"], live, "{state}");
}

#[test]
fn a_corrupted_clone_fails_its_attempt_clearly_and_the_loop_goes_on() {
    // The agent breaks its worker's clone, outside its work tree: no sandbox for it.
    let Some(mut fleet) = Fleet::with_executor("sandbox = \"off\"") else {
        return;
    };
    // The first develop, the first time: the worker's clone loses its objects under it.
    fleet.step(
        "if [ \"$LOOPD_ACTION\" = develop ] && [ ! -f \"$MARKS/once\" ]; then \
           touch \"$MARKS/once\"; rm -rf \"$(git rev-parse --git-common-dir)/objects\"/*; \
         fi\n",
    );
    for name in ["w0", "w1"] {
        fleet.worker(name);
    }
    let id = fleet.create(&["--title", "its clone breaks"]);
    fleet.wait_completed(std::slice::from_ref(&id));
    fleet.check_branch(&id);
    let state = fleet.state(&id);
    let failed = failures(&state);
    assert!(
        failed
            .iter()
            .any(|f| f.contains("git") && f.contains("fatal:")),
        "a failure in git's words: {failed:?}"
    );
}

#[test]
fn on_a_worker_the_sandbox_keeps_an_agent_out_of_the_workers_clone() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    // What the clone test above does on purpose, tried by a sandboxed agent: refused.
    fleet.step(
        "if [ \"$LOOPD_ACTION\" = develop ] && [ ! -f \"$MARKS/tried\" ]; then \
           touch \"$MARKS/tried\"; \
           rm -rf \"$(git rev-parse --git-common-dir)/objects\"/* 2>> \"$MARKS/refused\"; \
         fi\n",
    );
    fleet.worker("w0");
    let id = fleet.create(&["--title", "its agent reaches for the clone"]);
    fleet.wait_completed(std::slice::from_ref(&id));
    fleet.check_branch(&id);
    assert!(failures(&fleet.state(&id)).is_empty());
    let refused = std::fs::read_to_string(fleet.mark("refused")).unwrap_or_default();
    assert!(refused.contains("Permission denied"), "{refused}");
}

#[test]
fn a_worker_whose_disk_fills_fails_its_attempt_clearly_and_the_loop_goes_on_elsewhere() {
    // The agent fills its worker's cache, outside its work tree: no sandbox for it.
    let Some(mut fleet) = Fleet::with_executor("sandbox = \"off\"") else {
        return;
    };
    if !common::can_mount() {
        eprintln!("no mount namespace here: the full disk is left out");
        return;
    }
    // Run on the worker whose cache is a tmpfs, the first develop does its work, then fills it.
    fleet.step(
        "if [ \"$LOOPD_ACTION\" = develop ] && [ \"$(stat -f -c %T .)\" = tmpfs ] \
            && [ ! -f \"$MARKS/filled\" ]; then \
           echo \"$LOOPD_TASK_ID\" >> work.txt; echo '{\"status\":\"success\"}' > \"$LOOPD_RESULT_FILE\"; \
           dd if=/dev/zero of=\"$(git rev-parse --git-common-dir)/../../fill\" bs=64k \
              2>/dev/null; touch \"$MARKS/filled\"; exit 0; \
         fi\n",
    );
    let place = fleet.place("full");
    let cache = place.join("cache");
    std::fs::create_dir_all(&cache).expect("mkdir cache");
    fleet.temporal.worker_with(&fleet.p, "full", |cmd| {
        cmd.env("HOME", &place)
            .current_dir(&place)
            .arg("--cache")
            .arg(&cache);
        common::in_tmpfs(cmd, &cache, "2m");
    });
    let id = fleet.create(&["--title", "its worker's disk fills"]);
    wait_until("the disk to fill", FLEET_DEADLINE, || {
        fleet.mark("filled").exists()
    });
    fleet.worker("w1");
    fleet.wait_completed(std::slice::from_ref(&id));
    fleet.check_branch(&id);
    let failed = failures(&fleet.state(&id));
    assert!(
        failed
            .iter()
            .any(|f| f.contains("Out of diskspace") || f.contains("No space left on device")),
        "a failure that says the disk is full: {failed:?}"
    );
}

#[test]
fn a_remote_gone_for_a_while_fails_attempts_with_its_reason_and_the_loop_completes_when_it_is_back()
{
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    // The second develop, the first time, waits for `go` (the remote taken away meanwhile).
    fleet.step(
        "if [ \"$LOOPD_TASK_ID\" = task-002 ] && [ ! -f \"$MARKS/once\" ]; then \
           touch \"$MARKS/once\"; \
           i=0; while [ ! -f \"$MARKS/go\" ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done; \
         fi\n",
    );
    fleet.worker("w0");
    let id = fleet.create(&["--title", "its remote goes away"]);
    wait_until("the second develop to run", FLEET_DEADLINE, || {
        fleet.mark("once").exists()
    });
    let away = fleet.remote.with_extension("away");
    std::fs::rename(&fleet.remote, &away).expect("take the remote away");
    std::fs::write(fleet.mark("go"), "").expect("touch go");
    let mut failed = Vec::new();
    wait_until(
        "two attempts to fail for the remote",
        FLEET_DEADLINE,
        || {
            failed = failures(&fleet.state(&id));
            failed.len() >= 2
        },
    );
    assert!(
        failed
            .iter()
            .all(|f| f.contains("does not appear to be a git repository")),
        "the remote's reason: {failed:?}"
    );
    std::fs::rename(&away, &fleet.remote).expect("bring the remote back");
    fleet.wait_completed(std::slice::from_ref(&id));
    fleet.check_branch(&id);
}

#[test]
fn workers_restarted_one_by_one_while_thirty_loops_run_lose_nothing() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    // Each develop takes a moment, so that the restarts fall amid the loops' actions.
    fleet.step("[ \"$LOOPD_ACTION\" = develop ] && sleep 0.2\n");
    for name in ["w0", "w1", "w2"] {
        fleet.worker(name);
    }
    let ids: Vec<String> = (0..30)
        .map(|i| fleet.create(&["--title", &format!("loop {i}")]))
        .collect();
    for (i, name) in ["w0", "w1", "w2"].into_iter().enumerate() {
        // Some loop went on since the last restart.
        let done = |fleet: &Fleet| {
            fleet
                .list()
                .iter()
                .filter(|l| l["status"] == "completed")
                .count()
        };
        let before = done(&fleet);
        wait_until("a loop to complete", FLEET_DEADLINE, || {
            done(&fleet) > before || before == ids.len()
        });
        fleet.temporal.stop_worker(i);
        fleet.worker(name);
        let restarted = fleet.temporal.workers.len() - 1;
        fleet.temporal.workers.swap(i, restarted);
    }
    fleet.wait_completed(&ids);
    for id in &ids {
        fleet.check_branch(id);
    }
}

#[test]
fn a_work_tree_no_action_used_for_its_grace_period_is_removed() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    fleet.worker_configured("w0", "[temporal]\ntree_grace = 1.0\n");
    let id = fleet.create(&["--title", "its tree goes"]);
    let tree = fleet.place("w0").join("cache/trees").join(&id);
    wait_until("the loop's work tree", FLEET_DEADLINE, || tree.exists());
    fleet.wait_completed(std::slice::from_ref(&id));
    let clones = fleet.place("w0").join("cache/clones");
    wait_until(
        "the idle work tree and its clone to be removed",
        FLEET_DEADLINE,
        || !tree.exists() && std::fs::read_dir(&clones).is_ok_and(|mut c| c.next().is_none()),
    );
    fleet.check_branch(&id);
    let log = std::fs::read_to_string(common::temporal::side_dir(&fleet.p).join("worker-w0.log"))
        .unwrap_or_default();
    assert!(log.contains("removed"), "{log}");
}

#[test]
fn a_worker_runs_at_most_its_max_actions_at_once_and_the_rest_wait() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    // Each develop holds `$MARKS/running` for a moment; one that finds it held was not alone.
    fleet.step(
        "if [ \"$LOOPD_ACTION\" = develop ]; then \
           mkdir \"$MARKS/running\" 2>/dev/null || touch \"$MARKS/overlap\"; \
           sleep 0.2; rmdir \"$MARKS/running\" 2>/dev/null; \
         fi\n",
    );
    fleet.single_action_workers(&["w0"]);
    let ids: Vec<String> = (0..4)
        .map(|i| fleet.create(&["--title", &format!("loop {i}")]))
        .collect();
    fleet.wait_completed(&ids);
    for id in &ids {
        fleet.check_branch(id);
    }
    assert!(
        !fleet.mark("overlap").exists(),
        "two develops ran at once on a worker of max_actions = 1"
    );
}

#[test]
fn a_bad_remote_or_uncommitted_project_files_are_refused_in_one_line_with_exit_2() {
    let Some(fleet) = Fleet::new() else { return };
    let nowhere = fleet.places.path().join("nowhere.git");
    let nowhere = nowhere.display().to_string();
    let out = fleet.p.output(&[
        "create",
        "--temporal",
        &fleet.temporal.address,
        "--remote",
        &nowhere,
        "--title",
        "t",
    ]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert_eq!(stderr(&out).trim().lines().count(), 1, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("does not appear to be a git repository"),
        "{}",
        stderr(&out)
    );
    let out = fleet
        .p
        .output(&["create", "--remote", &nowhere, "--title", "t"]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--remote is for loops on Temporal"),
        "{}",
        stderr(&out)
    );
    // A password in the URL would be kept in the loop's history.
    let out = fleet.p.output(&[
        "create",
        "--temporal",
        &fleet.temporal.address,
        "--remote",
        "https://me:s3cret@example.com/r.git",
        "--title",
        "t",
    ]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(!stderr(&out).contains("s3cret"), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("credential helper"),
        "{}",
        stderr(&out)
    );
    // A remote that is a command is not run.
    let command = format!("ext::sh -c touch% {}", fleet.mark("ran").display());
    let out = fleet.p.output(&[
        "create",
        "--temporal",
        &fleet.temporal.address,
        "--remote",
        &command,
        "--title",
        "t",
    ]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("transport 'ext' not allowed"),
        "{}",
        stderr(&out)
    );
    assert!(!fleet.mark("ran").exists());
    // The project's files as trusted here, but not as committed.
    std::fs::write(
        fleet.p.root.join(".loop/config.toml"),
        format!(
            "{}\n# changed\n",
            std::fs::read_to_string(fleet.p.root.join(".loop/config.toml")).unwrap()
        ),
    )
    .expect("change the config");
    assert!(fleet.p.trust());
    let remote = fleet.remote.display().to_string();
    let out = fleet.p.output(&[
        "create",
        "--temporal",
        &fleet.temporal.address,
        "--remote",
        &remote,
        "--title",
        "t",
    ]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(
        stderr(&out).contains(".loop/config.toml is not in the base commit"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn tasks_developed_at_once_run_on_several_workers_and_are_merged_on_the_remote() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    fleet.single_action_workers(&["w0", "w1", "w2"]);
    // Each develop waits for the other task's to be there at once, and says how many it met.
    fleet.step(&format!(
        r#"if [ "$LOOPD_ACTION" = develop ]; then {MEET}; fi"#
    ));
    let id = fleet.create_two_at_once("at once");
    fleet.wait_completed(std::slice::from_ref(&id));
    fleet.assert_met(&["task-001", "task-002"]);
    // Both appended to work.txt at the same place: the first was merged, the second went back to
    // its agent and was developed again on the merged tree. Neither side was dropped.
    let branch = format!("loopd/{id}");
    let work = git(&fleet.remote, &["show", &format!("{branch}:work.txt")]);
    assert_eq!(work, "task-001\ntask-002");
    let refs = git(
        &fleet.remote,
        &[
            "for-each-ref",
            "--format=%(refname:lstrip=3)",
            &format!("refs/loopd/{id}/"),
        ],
    );
    assert!(refs.lines().any(|r| r.ends_with("-merge")), "{refs}");
    let state = fleet.state(&id);
    let history = state["skill_state"]["action_history"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        history
            .iter()
            .any(|h| h["outcome"] == "merge_conflict" && h["task_id"] == "task-002"),
        "{history:?}"
    );
    assert_eq!(state["skill_state"]["outcome"], "passed", "{state}");
    // The notes followed: the first task's from its lane through the merge, the second's from
    // its attempt on the merged tree; its attempt that conflicted left none.
    assert_eq!(fleet.notes_at_head(&id, "develop.md"), "task-001\ntask-002");
}

#[test]
fn the_notes_of_tasks_developed_at_once_are_merged_with_every_tasks_lines_kept() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    fleet.single_action_workers(&["w0", "w1"]);
    // Each develop writes a file of its own (no conflict) and appends to the notes at once; each
    // also leaves a note git cannot merge as text.
    fleet.step(&format!(
        r#"if [ "$LOOPD_ACTION" = develop ]; then {MEET}
  echo "$LOOPD_TASK_ID" > "out-$LOOPD_TASK_ID.txt"; echo "$LOOPD_TASK_ID" >> "$LOOPD_PROGRESS_DIR/develop.md"
  printf 'shot\0%s' "$LOOPD_TASK_ID" > "$LOOPD_PROGRESS_DIR/shot.bin"
  echo '{{"status":"success","summary":"did it"}}' > "$LOOPD_RESULT_FILE"; exit 0
fi"#
    ));
    let id = fleet.create_two_at_once("notes at once");
    fleet.wait_completed(std::slice::from_ref(&id));
    fleet.assert_met(&["task-001", "task-002"]);
    let notes = fleet.notes_at_head(&id, "develop.md");
    let mut lines: Vec<&str> = notes.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, ["task-001", "task-002"], "{notes}");
    // The note that is no text is the later task's, and both tasks were merged.
    assert_eq!(fleet.notes_at_head(&id, "shot.bin"), "shot\0task-002");
    let history = fleet.state(&id)["skill_state"]["action_history"].clone();
    assert!(!history.to_string().contains("merge_conflict"), "{history}");
    for task in ["task-001", "task-002"] {
        let out = git(
            &fleet.remote,
            &["show", &format!("loopd/{id}:out-{task}.txt")],
        );
        assert_eq!(out, task);
    }
}

#[test]
fn tasks_added_on_temporal_say_what_they_need_and_only_what_they_need_waits() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    fleet.single_action_workers(&["w0", "w1"]);
    // The first develop waits while the test adds tasks.
    fleet.step(&hold("develop"));
    let id = fleet.create(&["--title", "needs", "--parallel", "2", "--task", "first"]);
    fleet.wait_held("develop");
    let add = |args: &[&str]| {
        let out = fleet
            .temporal
            .command(&fleet.p, &[&["task", "add", &id], args].concat());
        assert_eq!(code(&out), 0, "task add {args:?}: {}", stderr(&out));
        stdout(&out).trim().to_owned()
    };
    let first = "task-001";
    let second = add(&["second"]);
    let third = add(&["third", "--after", first]);
    let fourth = add(&["fourth", "--after", &second]);
    // What a loop on Temporal cannot do is refused in one line, and nothing is added.
    for (args, said) in [
        (
            vec!["fifth", "--after", "task-099"],
            "--after task-099: loop",
        ),
        (
            vec!["fifth", "--race", "fake"],
            "a race needs at least two executors",
        ),
    ] {
        let out = fleet
            .temporal
            .command(&fleet.p, &[&["task", "add", &id], &args[..]].concat());
        assert_eq!(code(&out), 2, "{}", stderr(&out));
        assert!(stderr(&out).contains(said), "{}", stderr(&out));
    }
    // The second (which needs nothing) and the third (which needs the first) wait for each
    // other (at most 20 s) and say how many they met; the fourth says whether the second's
    // change was in its tree when it started.
    fleet.step(&format!(
        r#"if [ "$LOOPD_ACTION" = develop ]; then case "$LOOPD_TASK_ID" in
  {second}|{third}) {MEET} ;;
  {fourth}) [ -e "$MARKS/saw" ] || {{ grep -qx {second} work.txt && echo yes || echo no; }} > "$MARKS/saw" ;;
esac; fi"#
    ));
    fleet.release("develop");
    fleet.wait_completed(std::slice::from_ref(&id));
    fleet.assert_met(&[&second, &third]);
    let saw = std::fs::read_to_string(fleet.mark("saw")).unwrap();
    assert_eq!(
        saw.trim(),
        "yes",
        "the fourth started before the second was merged"
    );
    let state = fleet.state(&id);
    let tasks = state["skill_state"]["develop"]["tasks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let needs = |task: &str| {
        tasks
            .iter()
            .find(|t| t["id"] == task)
            .map(|t| t["after"].clone())
            .unwrap_or_default()
    };
    assert_eq!(needs(&second), serde_json::json!([]), "{tasks:?}");
    assert_eq!(needs(&fourth), serde_json::json!([second]), "{tasks:?}");
    assert!(
        tasks.iter().all(|t| t["status"] == "completed"),
        "{tasks:?}"
    );
    assert_eq!(tasks.len(), 4, "{tasks:?}");
}

#[test]
fn a_race_on_temporal_runs_each_executor_on_its_own_worker_and_merges_the_best() {
    // Executors `a` and `b` (the fleet's agent, told which it is): `a` makes a small change its
    // check rates 40%, `b` a larger one rated 100%.
    let racers = ["a", "b"]
        .map(|n| {
            format!(
                "[executors.{n}]\ncommand = [\"sh\", \"bin/agent.sh\", \"{n}\"]\n\
                 prompt = \"stdin\"\nformat = \"json\"\n\
                 env = {{ MARKS = \"@MARKS@\" }}\nsandbox_writable = [\"@MARKS@\"]\n"
            )
        })
        .concat();
    let Some(mut fleet) = Fleet::with_executor(&racers) else {
        return;
    };
    fleet.single_action_workers(&["w0", "w1"]);
    // What a loop on Temporal cannot race is refused in one line.
    for (args, said) in [
        (
            vec!["--task", "x", "--race", "a", "--race", "b"],
            "--race on Temporal needs --remote",
        ),
        (vec!["--task", "x", "--race", "a"], "at least two executors"),
        (vec!["--task", "x", "--race", "a", "--race", "nope"], "nope"),
    ] {
        let out = fleet
            .temporal
            .command(&fleet.p, &[&["create"], &args[..]].concat());
        assert_eq!(code(&out), 2, "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(said), "{args:?}: {}", stderr(&out));
    }
    fleet.step(&race_step());
    let id = fleet.create(&[
        "--title", "race", "--task", "race me", "--race", "a", "--race", "b",
    ]);
    fleet.wait_completed(std::slice::from_ref(&id));
    fleet.assert_met(&["a", "b"]);

    // The winner is merged; the other's work stays on the remote as a checkpoint of its own.
    let branch = format!("loopd/{id}");
    let show = |what: &str| git(&fleet.remote, &["show", what]);
    assert_eq!(show(&format!("{branch}:impl.txt")), "b\nmore");
    assert_eq!(show(&format!("refs/loopd/{id}/1-develop-a:impl.txt")), "a");
    assert_eq!(
        show(&format!("refs/loopd/{id}/1-develop-b:impl.txt")),
        "b\nmore"
    );
    let state = fleet.state(&id);
    let history = state["skill_state"]["action_history"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let ran = |action: &str| {
        history
            .iter()
            .filter(|h| h["action"] == action && h["iteration"] == 1)
            .count()
    };
    // Two tries of the task, and the check of each tree.
    assert_eq!((ran("develop"), ran("validate")), (2, 2), "{history:?}");
    let tasks = state["skill_state"]["develop"]["tasks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    assert_eq!(tasks[0]["status"], "completed", "{tasks:?}");
    assert_eq!(state["race"], serde_json::json!(["a", "b"]), "{state}");
    assert_eq!(state["skill_state"]["outcome"], "passed", "{state}");
    // The log shows the race and each try in its lane, by its executor, as on this machine.
    let out = fleet.temporal.command(&fleet.p, &["--json", "logs", &id]);
    assert_eq!(code(&out), 0, "logs: {}", stderr(&out));
    let events: Vec<Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("an event per line"))
        .collect();
    let named =
        |name: &str| -> Vec<&Value> { events.iter().filter(|e| e["event"] == name).collect() };
    let started = named("race_started");
    assert_eq!(started.len(), 1, "{events:?}");
    assert_eq!(started[0]["executors"], serde_json::json!(["a", "b"]));
    let decided = named("race_decided");
    assert_eq!(decided.len(), 1, "{events:?}");
    assert_eq!(decided[0]["winner"], "b", "{decided:?}");
    assert_eq!(
        race_rates(decided[0]),
        [("a".to_owned(), 40.0), ("b".to_owned(), 100.0)]
    );
    let mut tries: Vec<(String, u64, String)> = events
        .iter()
        .filter(|e| e["event"] == "action_finished" && e["action"] == "develop")
        .map(|e| {
            let label = e["label"].as_str().unwrap_or_default().to_owned();
            (
                label,
                e["lane"].as_u64().unwrap_or(0),
                e["executor"].to_string(),
            )
        })
        .collect();
    tries.sort();
    assert_eq!(
        tries,
        [
            ("a".into(), 1, "\"a\"".into()),
            ("b".into(), 2, "\"b\"".into())
        ]
    );

    // A task of its own that races (`task add --race`), in a loop that does not: added while the
    // loop's init waits, raced when its turn comes.
    fleet.step(&format!("{}\n{}", hold("init"), race_step()));
    let id = fleet.create(&["--title", "a task races"]);
    fleet.wait_held("init");
    let args = ["task", "add", &id, "race me", "--race", "a", "--race", "b"];
    let out = fleet.temporal.command(&fleet.p, &args);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let task = stdout(&out).trim().to_owned();
    fleet.release("init");
    fleet.wait_completed(std::slice::from_ref(&id));
    let state = fleet.state(&id);
    let tasks = state["skill_state"]["develop"]["tasks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let raced = tasks
        .iter()
        .find(|t| t["id"] == task.as_str())
        .expect("the task");
    assert_eq!(raced["race"], serde_json::json!(["a", "b"]), "{tasks:?}");
    assert_eq!(raced["status"], "completed", "{tasks:?}");
    let out = fleet.temporal.command(&fleet.p, &["--json", "logs", &id]);
    let decided: Vec<Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("an event per line"))
        .filter(|e| e["event"] == "race_decided")
        .collect();
    assert_eq!(
        decided.len(),
        1,
        "one race, of the task that asked: {decided:?}"
    );
    assert_eq!(decided[0]["task_id"], task.as_str());
    assert_eq!(decided[0]["winner"], "b");
    let iteration = decided[0]["iteration"].as_u64().expect("its iteration");
    let loser = format!("refs/loopd/{id}/{iteration}-develop-a:impl.txt");
    assert_eq!(git(&fleet.remote, &["show", &loser]), "a");
    let branch = format!("loopd/{id}:impl.txt");
    assert_eq!(git(&fleet.remote, &["show", &branch]), "b\nmore");
}

/// The step of a race's agents: executors `a` and `b` (the fleet's agent, told which it is; they
/// wait for each other, [`MEET`]) make a change each, `a` a small one its check rates 40%, `b` a
/// larger one rated 100%.
fn race_step() -> String {
    format!(
        r#"case "$LOOPD_ACTION:$1" in
  develop:a|develop:b) WHO=$1; {MEET}
    if [ "$1" = a ]; then echo a > impl.txt; else printf 'b\nmore\n' > impl.txt; fi
    echo "{{\"status\":\"success\",\"summary\":\"$1 did it\"}}" > "$LOOPD_RESULT_FILE"; exit 0 ;;
  validate:*) if grep -q b impl.txt 2>/dev/null; then r=100; p=true; else r=40; p=false; fi
    echo "{{\"status\":\"success\",\"state_updates\":{{\"passed\":$p,\"pass_rate\":$r}}}}" > "$LOOPD_RESULT_FILE"; exit 0 ;;
esac"#
    )
}

#[test]
fn a_stop_ends_every_attempt_of_a_batch_on_temporal() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    fleet.single_action_workers(&["w0", "w1"]);
    // Each develop writes its pid and hangs.
    fleet.step(
        "if [ \"$LOOPD_ACTION\" = develop ]; then \
           echo $$ > \"$MARKS/$LOOPD_TASK_ID.pid\"; sleep 300; \
         fi\n",
    );
    let id = fleet.create_two_at_once("stopped");
    wait_until("both develops to run", FLEET_DEADLINE, || {
        ["task-001", "task-002"]
            .iter()
            .all(|t| fleet.mark(&format!("{t}.pid")).exists())
    });
    let pids = ["task-001", "task-002"].map(|t| read_pid(&fleet.mark(&format!("{t}.pid"))));
    // On two workers at once; `status` shows both, each with its task and lane.
    assert_ne!(fleet.worker_of(pids[0]), fleet.worker_of(pids[1]));
    let mut running = Vec::new();
    wait_until("status to show both attempts", FLEET_DEADLINE, || {
        let heartbeats = fleet.state(&id)["heartbeats"].clone();
        running = heartbeats
            .as_array()
            .into_iter()
            .flatten()
            .map(|h| (h["task_id"].to_string(), h["lane"].as_u64().unwrap_or(0)))
            .collect();
        running.sort();
        running.len() == 2
    });
    assert_eq!(
        running,
        [
            ("\"task-001\"".to_owned(), 1),
            ("\"task-002\"".to_owned(), 2)
        ]
    );
    let out = fleet.temporal.command(&fleet.p, &["stop", &id]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    wait_until("every attempt of the batch to end", FLEET_DEADLINE, || {
        pids.iter().all(|&pid| !alive(pid))
    });
    let state = fleet.state(&id);
    assert_eq!(state["status"], "failed", "{state}");
    let interrupted = state["skill_state"]["action_history"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|h| h["outcome"] == "interrupted")
        .count();
    assert_eq!(interrupted, 2, "{state}");
}

#[test]
fn a_worker_killed_mid_batch_loses_only_its_attempt_and_the_batch_is_merged_on_the_others() {
    let Some(mut fleet) = Fleet::new() else {
        return;
    };
    fleet.single_action_workers(&["w0", "w1", "w2"]);
    // The second task's first develop hangs (a child too) once the first task's is under way:
    // its worker dies with both in flight.
    fleet.step(
        r#"if [ "$LOOPD_ACTION" = develop ] && [ "$LOOPD_TASK_ID" = task-001 ]; then : > "$MARKS/first-ran"; fi
if [ "$LOOPD_TASK_ID" = task-002 ] && [ ! -f "$MARKS/once" ]; then
  touch "$MARKS/once"; echo partial >> work.txt
  sleep 300 & echo $! > "$MARKS/child.pid"; echo $$ > "$MARKS/develop.pid"; wait
fi"#,
    );
    let id = fleet.create_two_at_once("a worker dies mid-batch");
    wait_until("the second task's develop to hang", FLEET_DEADLINE, || {
        fleet.mark("develop.pid").exists()
    });
    let (executor, child) = (
        read_pid(&fleet.mark("develop.pid")),
        read_pid(&fleet.mark("child.pid")),
    );
    fleet.temporal.kill_worker(fleet.worker_of(executor));
    wait_until(
        "the dead worker's executor and its child to be gone",
        FLEET_DEADLINE,
        || !alive(executor) && !alive(child),
    );
    fleet.wait_completed(std::slice::from_ref(&id));
    assert!(fleet.mark("first-ran").exists());
    // Each task's change once on the remote, the half-made one of the dead attempt nowhere.
    let work = git(&fleet.remote, &["show", &format!("loopd/{id}:work.txt")]);
    let mut lines: Vec<&str> = work.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, ["task-001", "task-002"], "{work}");
    let state = fleet.state(&id);
    assert_eq!(state["skill_state"]["outcome"], "passed", "{state}");
}
