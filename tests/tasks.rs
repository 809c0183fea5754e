//! One task list for every writer: tasks added by loopd (`create --task`, `task add`) and by the
//! CCW dashboard (its `{id}/tasks.jsonl`, written exactly as CCW writes it) in every order, while
//! the loop runs or not, racing or torn, are all run, once; CCW's file stays CCW's shape.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use serde_json::Value;

/// The tasks that were developed, each checked to have been developed once.
fn developed_once(p: &Project, id: &str) -> Vec<String> {
    let developed = p.developed(id);
    let unique: HashSet<&String> = developed.iter().collect();
    assert_eq!(
        unique.len(),
        developed.len(),
        "a task ran twice: {developed:?}"
    );
    developed
}

/// CCW's list as CCW reads it: every record a whole `LoopTask`, and its ids.
fn ccw_ids(p: &Project, id: &str) -> Vec<String> {
    let tasks = ccw::tasks(p, id);
    for task in &tasks {
        assert!(
            ccw::is_loop_task(task),
            "not a LoopTask CCW can use: {task}"
        );
    }
    tasks
        .iter()
        .map(|t| t["task_id"].as_str().unwrap().to_owned())
        .collect()
}

fn task_add(p: &Project, id: &str, text: &str) -> String {
    let out = p.output(&["--json", "task", "add", id, text]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let added: Value = serde_json::from_slice(&out.stdout).expect("json");
    added["task_id"].as_str().unwrap().to_owned()
}

fn no_stale_warning(p: &Project, id: &str) {
    let stale: Vec<Value> = p
        .events(id)
        .into_iter()
        .filter(|e| e["message"].as_str().is_some_and(|m| m.contains("stale")))
        .collect();
    assert!(stale.is_empty(), "nothing was reverted: {stale:?}");
}

#[test]
fn tasks_added_by_either_program_in_either_order_are_all_run_once() {
    // A loop loopd made: loopd, CCW, loopd, CCW.
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t", "--task", "loopd's first"]);
    let c1 = ccw::add_task(&p, &id, "CCW's first");
    let l2 = task_add(&p, &id, "loopd's second");
    let c2 = ccw::add_task(&p, &id, "CCW's second");
    assert_eq!(l2, "task-002");
    // CCW lists every task, loopd's among them, in its own shape.
    assert_eq!(ccw_ids(&p, &id), ["task-001", c1.as_str(), "task-002", &c2]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(
        developed_once(&p, &id),
        ["task-001", c1.as_str(), "task-002", &c2]
    );
    no_stale_warning(&p, &id);

    // A loop CCW made: CCW, loopd, CCW; CCW starts it, loopd drives it.
    let q = Project::new(GOOD_AGENT);
    let id = ccw::create_loop(&q, "made by CCW");
    let c1 = ccw::add_task(&q, &id, "CCW's first");
    let l1 = task_add(&q, &id, "loopd's first");
    // CCW's backup habit, kept: the list as it was before loopd's write.
    let backup = q.root.join(".loop").join(&id).join("tasks.jsonl.backup");
    let backup = std::fs::read_to_string(backup).unwrap();
    assert!(backup.contains(&c1) && !backup.contains(&l1), "{backup}");
    let c2 = ccw::add_task(&q, &id, "CCW's second");
    assert_eq!(ccw_ids(&q, &id), [c1.as_str(), &l1, &c2]);
    ccw::set_status(&q, &id, "running");
    let out = q.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(developed_once(&q, &id), [c1.as_str(), &l1, &c2]);
    let tasks = q.state(&id)["skill_state"]["develop"]["tasks"].clone();
    assert_eq!(tasks[0]["description"], "CCW's first");
    assert_eq!(tasks[0]["tool"], "gemini", "CCW's fields come along");
    // A loop CCW wrote last, started: nothing was reverted, nothing said so.
    no_stale_warning(&q, &id);
}

#[test]
fn a_ccw_rewrite_from_an_older_copy_loses_no_task_and_its_edit_is_kept() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t", "--task", "first"]);
    // CCW reads the list, then loopd adds a task, then CCW writes back what it read with an
    // edit (`updateTask`): loopd's task is gone from CCW's file.
    let mut stale = ccw::tasks(&p, &id);
    let added = task_add(&p, &id, "second");
    stale[0]["description"] = "first, edited in CCW".into();
    ccw::rewrite_tasks(&p, &id, &stale);
    assert_eq!(ccw_ids(&p, &id), ["task-001"]);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(developed_once(&p, &id), ["task-001", added.as_str()]);
    let tasks = p.state(&id)["skill_state"]["develop"]["tasks"].clone();
    assert_eq!(tasks[0]["description"], "first, edited in CCW");
    // Written back where CCW lists it, and said so.
    assert_eq!(ccw_ids(&p, &id), ["task-001", added.as_str()]);
    assert!(
        p.events(&id).iter().any(|e| e["event"] == "recovered"
            && e["message"]
                .as_str()
                .is_some_and(|m| m.contains("written there again"))),
        "{:?}",
        p.events(&id)
    );
}

#[test]
fn a_task_ccw_adds_while_the_loop_runs_joins_it() {
    let p = Project::new(&agent(&[(
        "develop",
        &format!("touch developing; {}", wait_for_file("go")),
    )]));
    let id = p.create(&["--title", "t", "--task", "first"]);
    let run = p.spawn_run(&id, &[]);
    wait_for("the first develop", || p.root.join("developing").exists());
    let added = ccw::add_task(&p, &id, "added in CCW meanwhile");
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = wait_output(run, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(developed_once(&p, &id), ["task-001", added.as_str()]);
    assert!(p.event_names(&id).iter().any(|e| e == "tasks_added"));
}

#[test]
fn a_task_added_to_a_skill_tuning_loop_is_applied_and_verified_as_a_fix() {
    // Nothing found, so the gate passes at the report; the fixes of the task list are applied and
    // verified before the loop completes. `diagnose-memory` waits for `go` once `hold` exists.
    let p = Project::new(
        r#"
cat > /dev/null
if [ "$LOOPD_ACTION" = diagnose-memory ] && [ -f hold ]; then
  touch diagnosing
  i=0; while [ ! -f go ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done
fi
case "$LOOPD_ACTION" in
  analyze-requirements) r='{"status":"success","state_updates":{"coverage":"satisfied"}}' ;;
  diagnose-*) r='{"status":"success","state_updates":{"issues":[]}}' ;;
  apply-fix) echo "$LOOPD_TASK_ID" >> applied.txt; r='{"status":"success","summary":"applied"}' ;;
  verify) r="{\"status\":\"success\",\"state_updates\":{\"results\":[$(sed 's/.*/{"fix_id":"&","result":"pass"}/' applied.txt | paste -sd, -)]}}" ;;
  *) r='{"status":"success","summary":"done"}' ;;
esac
echo "$r" > "$LOOPD_RESULT_FILE"
"#,
    );
    std::fs::create_dir_all(p.root.join("skills/s")).unwrap();
    std::fs::write(p.root.join("skills/s/SKILL.md"), "# s\n").unwrap();
    std::fs::write(p.root.join("hold"), "").unwrap();
    let id = p.create(&[
        "--workflow",
        "skill-tuning",
        "--target-skill",
        "skills/s",
        "--focus",
        "memory",
        "--task",
        "shorten the intro",
    ]);
    let run = p.spawn_run(&id, &[]);
    wait_for("diagnose-memory", || p.root.join("diagnosing").exists());
    let added = ccw::add_task(&p, &id, "say when to stop");
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = wait_output(run, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let applied = std::fs::read_to_string(p.root.join("applied.txt")).unwrap();
    assert_eq!(
        applied.lines().collect::<Vec<_>>(),
        ["task-001", added.as_str()]
    );
    let skill = p.state(&id)["skill_state"].clone();
    assert_eq!(skill["outcome"], "passed");
    let verdicts: Vec<(&str, &str)> = skill["applied_fixes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["id"].as_str().unwrap(),
                f["verification_result"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(verdicts, [("task-001", "pass"), (added.as_str(), "pass")]);
}

#[test]
fn a_torn_ccw_write_is_survived_and_mended() {
    let p = Project::new(GOOD_AGENT);
    let id = ccw::create_loop(&p, "torn");
    for text in ["one", "two", "three"] {
        ccw::add_task(&p, &id, text);
    }
    let whole = ccw::tasks(&p, &id);
    // CCW's `writeTasks` died after its backup and half of its write: the second record is cut
    // short, the third is missing.
    let path = ccw::tasks_path(&p, &id);
    std::fs::write(
        path.with_extension("jsonl.backup"),
        std::fs::read(&path).unwrap(),
    )
    .unwrap();
    let second = whole[1].to_string();
    std::fs::write(
        &path,
        format!("{}\n{}", whole[0], &second[..second.len() / 2]),
    )
    .unwrap();
    let ids: Vec<&str> = whole
        .iter()
        .map(|t| t["task_id"].as_str().unwrap())
        .collect();
    // loopd adds a task: CCW's file is whole again, its lost records back from the backup.
    let added = task_add(&p, &id, "four");
    let mut all = ids.clone();
    all.push(&added);
    let listed = ccw_ids(&p, &id);
    assert_eq!(
        listed.iter().collect::<HashSet<_>>(),
        all.iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .iter()
            .collect()
    );
    ccw::set_status(&p, &id, "running");
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(developed_once(&p, &id), all);
}

#[test]
fn a_torn_ccw_file_is_read_with_its_backup_and_reported() {
    let p = Project::new(GOOD_AGENT);
    let id = ccw::create_loop(&p, "torn");
    let first = ccw::add_task(&p, &id, "one");
    let second = ccw::add_task(&p, &id, "two");
    let path = ccw::tasks_path(&p, &id);
    // An append cut short after the backup was taken: the file ends in half a record.
    let whole = std::fs::read_to_string(&path).unwrap();
    std::fs::write(path.with_extension("jsonl.backup"), &whole).unwrap();
    let third = ccw::new_task(&p, &id, "three").to_string();
    std::fs::write(&path, format!("{whole}{}", &third[..20])).unwrap();
    ccw::set_status(&p, &id, "running");
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(developed_once(&p, &id), [first, second]);
    let warned = p.events(&id).into_iter().any(|e| {
        e["event"] == "warning"
            && e["message"]
                .as_str()
                .is_some_and(|m| m.contains("tasks.jsonl:3:"))
    });
    assert!(warned, "{:?}", p.events(&id));
}

#[test]
fn loopd_and_ccw_adding_tasks_at_once_lose_none() {
    let p = Project::new(GOOD_AGENT);
    let id = p.create(&["--title", "t", "--max-iterations", "200"]);
    const EACH: usize = 15;
    // CCW appends its tasks as fast as its routes would, while loopd adds its own.
    let stop = Arc::new(AtomicBool::new(false));
    let ccw_writer = {
        let (root, home, id, stop) = (p.root.clone(), p.home.clone(), id.clone(), stop.clone());
        std::thread::spawn(move || {
            let q = Project::at(root, home);
            let mut ids = Vec::new();
            for i in 0..EACH {
                ids.push(ccw::add_task(&q, &id, &format!("ccw {i}")));
                std::thread::sleep(std::time::Duration::from_millis(7 * (i as u64 % 5)));
                if stop.load(Ordering::SeqCst) {
                    break;
                }
            }
            ids
        })
    };
    let mut mine = Vec::new();
    for i in 0..EACH {
        mine.push(task_add(&p, &id, &format!("loopd {i}")));
    }
    let theirs = ccw_writer.join().unwrap();
    stop.store(true, Ordering::SeqCst);
    // Every task is in CCW's list, whoever wrote last.
    let listed: HashSet<String> = ccw_ids(&p, &id).into_iter().collect();
    for task in mine.iter().chain(&theirs) {
        assert!(listed.contains(task), "{task} was lost from CCW's list");
    }
    assert_eq!(listed.len(), 2 * EACH);
    let out = p.run(&id, &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let developed: HashSet<String> = developed_once(&p, &id).into_iter().collect();
    assert_eq!(developed, listed);
}
