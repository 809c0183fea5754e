//! The sandbox around every attempt (docs/sandbox.md), through the real binary, with hostile
//! executors in a temporary home: what they try outside their work tree is refused, nothing
//! outside changes, and the loop goes on.

mod common;

use std::net::TcpListener;
use std::path::Path;

use common::tries::{HOSTILE_AGENT, assert_tried, hostile, tried};
use common::*;

/// Whether this machine can sandbox (Landlock), as `loopd doctor` finds it; outside CI a test
/// without it says so and passes.
fn sandboxed_here() -> bool {
    let p = Project::new(GOOD_AGENT);
    let doctor = p.output(&["doctor", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&stdout(&doctor)).expect("doctor --json");
    if report["sandbox"]["landlock"]
        .as_i64()
        .is_some_and(|abi| abi >= 4)
    {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must run the sandbox tests: this kernel has no Landlock ABI 4 ({})",
        report["sandbox"]
    );
    eprintln!("skipped: this kernel has no Landlock ABI 4");
    false
}

#[test]
fn a_hostile_executor_changes_nothing_outside_its_work_tree_and_reads_no_secret() {
    if !sandboxed_here() {
        return;
    }
    // The user: a home with a key; a directory of theirs outside the project; the project, whose
    // work tree has a link that leads out.
    let user = Project::new("");
    let ssh = user.root.join(".ssh");
    std::fs::create_dir_all(&ssh).unwrap();
    std::fs::write(ssh.join("id_ed25519"), "PRIVATE KEY\n").unwrap();
    let outside = tempfile::tempdir().unwrap();
    let outside = outside.path().canonicalize().unwrap();
    std::fs::write(outside.join("kept.txt"), "as it was\n").unwrap();
    let home = user.root.display().to_string();
    let out = outside.display().to_string();
    let tries = [
        ("write outside", format!("echo x > {out}/new.txt")),
        ("overwrite outside", format!("echo x > {out}/kept.txt")),
        ("write in the home", format!("echo x > {home}/.bashrc")),
        (
            "write through a link",
            "echo x > out/through-link.txt".to_owned(),
        ),
        (
            "read the key",
            format!("cat {home}/.ssh/id_ed25519 > key.txt"),
        ),
        ("list the keys", format!("ls {home}/.ssh > keys.txt")),
        ("write in the work tree", "echo x > mine.txt".to_owned()),
        ("write in TMPDIR", "echo x > \"$TMPDIR/scratch\"".to_owned()),
    ];
    let p = Project::beside(&user, &agent(&[("develop", HOSTILE_AGENT)]));
    hostile(&p, &tries);
    std::os::unix::fs::symlink(&outside, p.root.join("out")).unwrap();
    let id = p.create(&["--title", "hostile"]);
    let run = p.run(&id, &[]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    assert_eq!(p.state(&id)["status"], "completed");

    assert_tried(&p, &tries, &["write in the work tree", "write in TMPDIR"]);
    // Nothing outside changed; no secret reached the work tree.
    assert!(!outside.join("new.txt").exists());
    assert!(!outside.join("through-link.txt").exists());
    assert_eq!(
        std::fs::read_to_string(outside.join("kept.txt")).unwrap(),
        "as it was\n"
    );
    assert!(!user.root.join(".bashrc").exists());
    let key = std::fs::read_to_string(p.root.join("key.txt")).unwrap_or_default();
    assert!(!key.contains("PRIVATE"), "the key was read: {key}");
    // The refusals are the kernel's: permission denied.
    let errors = std::fs::read_to_string(p.root.join("errors.txt")).unwrap_or_default();
    assert!(errors.contains("Permission denied"), "{errors}");
    // And the loop's events say so, in the attempt's own words.
    let refused = p.events_named(&id, "sandbox_refused");
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0]["lines"][0]
            .as_str()
            .is_some_and(|l| l.contains("Permission denied")),
        "{refused:?}"
    );
}

#[test]
fn an_executor_reaches_the_ports_it_may_and_no_other() {
    if !sandboxed_here() {
        return;
    }
    let allowed = TcpListener::bind("127.0.0.1:0").unwrap();
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = |l: &TcpListener| l.local_addr().unwrap().port();
    let connect = |port: u16| {
        format!(
            "python3 -c \"import socket; socket.create_connection((\\\"127.0.0.1\\\", {port}), 5)\""
        )
    };
    let (to_allowed, to_other) = (connect(port(&allowed)), connect(port(&other)));
    let tries = [
        ("connect to the allowed port", to_allowed),
        ("connect to another port", to_other),
    ];
    let p = Project::new(&agent(&[("develop", HOSTILE_AGENT)]));
    hostile(&p, &tries);
    p.config(&format!(
        "{TEST_CONFIG}sandbox_network = [{}]\n",
        port(&allowed)
    ));
    let id = p.create(&["--title", "ports"]);
    let run = p.run(&id, &[]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    let said = tried(&p);
    for line in [
        "connect to the allowed port: done",
        "connect to the allowed port (grandchild): done",
        "connect to another port: refused",
        "connect to another port (grandchild): refused",
    ] {
        assert!(said.contains(&line.to_owned()), "{line:?} not in {said:#?}");
    }

    // No network at all: not even the allowed port.
    let q = Project::new(&agent(&[("develop", HOSTILE_AGENT)]));
    hostile(&q, &tries);
    q.config(&format!("{TEST_CONFIG}sandbox_network = \"none\"\n"));
    let id = q.create(&["--title", "no network"]);
    let run = q.run(&id, &[]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    let said = tried(&q);
    assert!(said.iter().all(|l| l.ends_with("refused")), "{said:#?}");
    assert_eq!(said.len(), 4, "{said:#?}");
}

#[test]
fn an_executor_declares_where_else_it_writes_and_what_secret_it_reads() {
    if !sandboxed_here() {
        return;
    }
    let user = Project::new("");
    let cache = user.root.join(".cache/tool");
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::create_dir_all(user.root.join(".aws")).unwrap();
    std::fs::write(user.root.join(".aws/credentials"), "mine\n").unwrap();
    let home = user.root.display().to_string();
    let write = format!("echo x > {home}/.cache/tool/made.txt");
    let read = format!("cat {home}/.aws/credentials > creds.txt");
    let tries = [("write the cache", write), ("read the key", read)];
    let p = Project::beside(&user, &agent(&[("develop", HOSTILE_AGENT)]));
    hostile(&p, &tries);
    p.config(&TEST_CONFIG.replace(
        "format = \"json\"",
        "format = \"json\"\nsandbox_writable = [\"~/.cache/tool\"]\nsandbox_readable = [\"~/.aws/credentials\"]",
    ));
    let id = p.create(&["--title", "declared"]);
    let run = p.run(&id, &[]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    let said = tried(&p);
    for line in ["write the cache: done", "read the key: done"] {
        assert!(said.contains(&line.to_owned()), "{line:?} not in {said:#?}");
    }
    assert!(cache.join("made.txt").exists());
}

#[test]
fn a_bad_sandbox_setting_is_one_line() {
    let p = Project::new(GOOD_AGENT);
    for (setting, key) in [
        ("sandbox = \"danger\"", "executor_defaults.sandbox"),
        (
            "sandbox_network = \"some\"",
            "executor_defaults.sandbox_network",
        ),
        (
            "sandbox_hidden = [\"relative/path\"]",
            "executor_defaults.sandbox_hidden",
        ),
    ] {
        p.config(&TEST_CONFIG.replace("kill_grace = 0.5", &format!("kill_grace = 0.5\n{setting}")));
        let out = p.output(&["create", "--title", "x"]);
        assert_eq!(code(&out), 2, "{setting}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains(key) && err.trim().lines().count() == 1,
            "{err}"
        );
    }
}

/// Each attempt's private TMPDIR starts empty, whatever the one before left in it, and an empty
/// one is kept for the next attempt (`spare.tmp`) rather than made anew; a link an agent plants
/// in the spare's place leads nowhere: the next attempt gets a directory of its own.
#[test]
fn each_attempt_gets_an_empty_tmpdir_of_its_own() {
    if !sandboxed_here() {
        return;
    }
    let outside = tempfile::tempdir().unwrap();
    let out = outside.path().canonicalize().unwrap();
    let p = Project::new(&agent(&[(
        "develop",
        &format!(
            r#"ls -A "$TMPDIR" > "tmp-$LOOPD_TASK_ID.txt"; [ -d "$TMPDIR" ] && [ ! -L "$TMPDIR" ] || echo link >> "tmp-$LOOPD_TASK_ID.txt"
case "$LOOPD_TASK_ID" in
  task-001) echo secret > "$TMPDIR/left" ;;
  task-002) ln -s {out} "$(dirname "$TMPDIR")/spare.tmp" ;;
  task-003) echo x > "$TMPDIR/mine" ;;
esac"#,
            out = out.display()
        ),
    )]));
    let id = p.create(&[
        "--title", "tmp", "--task", "a", "--task", "b", "--task", "c",
    ]);
    let run = p.run(&id, &[]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    for task in ["task-001", "task-002", "task-003"] {
        let listing = std::fs::read_to_string(p.root.join(format!("tmp-{task}.txt"))).unwrap();
        assert_eq!(listing, "", "{task}'s TMPDIR");
    }
    assert_eq!(
        std::fs::read_dir(&out).unwrap().count(),
        0,
        "nothing outside"
    );
    let actions = p.root.join(format!(".loop/{id}.progress/actions"));
    let spare = actions.join("spare.tmp");
    let meta = std::fs::symlink_metadata(&spare).unwrap();
    assert!(meta.is_dir(), "the spare is a directory: {meta:?}");
    assert_eq!(std::fs::read_dir(&spare).unwrap().count(), 0);
    let others: Vec<String> = std::fs::read_dir(&actions)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".tmp") && !n.starts_with('.') && n != "spare.tmp")
        .collect();
    assert_eq!(others, Vec::<String>::new(), "no attempt's TMPDIR left");
}

/// `sandbox = "off"`: an action runs as before, with none of the sandbox (no private TMPDIR).
#[test]
fn with_the_sandbox_off_an_action_runs_as_before() {
    let p = Project::new(&agent(&[(
        "develop",
        "echo \"${TMPDIR:-none}\" > tmpdir.txt",
    )]));
    p.config(&TEST_CONFIG.replace("kill_grace = 0.5", "kill_grace = 0.5\nsandbox = \"off\""));
    let id = p.create(&["--title", "off"]);
    let run = p.run(&id, &[]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    let tmpdir = std::fs::read_to_string(p.root.join("tmpdir.txt")).unwrap();
    assert_eq!(tmpdir.trim(), "none");
}

/// `(name, command)` tries of an action in a git work tree against git's control files: each
/// would make loopd's git, or the user's after the loop, run `touch MARK/NAME`.
fn git_tries(mark: &Path) -> Vec<(&'static str, String)> {
    let m = mark.display();
    vec![
        (
            "plant an fsmonitor",
            format!("git config core.fsmonitor \"touch {m}/fsmonitor\""),
        ),
        (
            "plant a hook",
            format!(
                "printf \"#!/bin/sh\\ntouch {m}/hook\\n\" > .git/hooks/pre-commit && chmod +x .git/hooks/pre-commit"
            ),
        ),
        (
            "set core.hooksPath",
            format!(
                "mkdir -p myhooks && printf \"#!/bin/sh\\ntouch {m}/hookspath\\n\" > myhooks/pre-commit && chmod +x myhooks/pre-commit && git config core.hooksPath myhooks"
            ),
        ),
        (
            "plant a filter",
            format!(
                "echo \"* filter=evil\" > .gitattributes && git config filter.evil.clean \"touch {m}/filter; cat\""
            ),
        ),
        (
            "set core.sshCommand",
            format!("git config core.sshCommand \"touch {m}/ssh\""),
        ),
        ("replace .git", "mv .git .git-away".to_owned()),
        (
            "plant an info attribute",
            "echo \"* diff=evil\" > .git/info/attributes".to_owned(),
        ),
        (
            "commit its work",
            "echo work >> work.txt && git add work.txt && git -c user.name=a -c user.email=a@a commit -q -m work"
                .to_owned(),
        ),
    ]
}

#[test]
fn an_action_cannot_make_git_run_anything_and_its_own_commits_work() {
    if !sandboxed_here() {
        return;
    }
    let mark = tempfile::tempdir().unwrap();
    let mark = mark.path().canonicalize().unwrap();
    let tries = git_tries(&mark);
    let p = Project::new(&agent(&[("develop", HOSTILE_AGENT)]));
    hostile(&p, &tries);
    git(&p.root, &["init", "-q"]);
    std::fs::write(p.root.join(".gitignore"), "/.loop/\n").unwrap();
    git(&p.root, &["add", "-A"]);
    git(&p.root, &["commit", "-q", "-m", "start"]);
    let hooks_before = std::fs::read_dir(p.root.join(".git/hooks"))
        .unwrap()
        .count();
    let id = p.create(&["--title", "git"]);
    let run = p.run(&id, &[]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    assert_tried(&p, &tries, &["commit its work"]);
    // The agent's commits are there; loopd's checkpoints and diff ran over its work.
    let log = git(&p.root, &["log", "--format=%s"]);
    assert_eq!(log.lines().filter(|l| *l == "work").count(), 2, "{log}");
    let diff = p.output(&["diff", &id]);
    assert_eq!(code(&diff), 0, "{}", stderr(&diff));
    // And the user's own git after the loop, the way a person goes on.
    git(&p.root, &["status"]);
    std::fs::write(p.root.join("mine.txt"), "mine\n").unwrap();
    git(&p.root, &["add", "mine.txt"]);
    git(&p.root, &["commit", "-q", "-m", "mine"]);
    let ran: Vec<_> = std::fs::read_dir(&mark)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(ran.is_empty(), "git ran what an action planted: {ran:?}");
    assert_eq!(
        std::fs::read_dir(p.root.join(".git/hooks"))
            .unwrap()
            .count(),
        hooks_before
    );
    assert!(p.root.join(".git/config").is_file());

    // A repository whose config already names programs (someone else prepared it): loopd's own
    // git (its checkpoints, its diff) runs none of them.
    let q = Project::new(GOOD_AGENT);
    git(&q.root, &["init", "-q"]);
    std::fs::write(q.root.join(".gitignore"), "/.loop/\n").unwrap();
    git(&q.root, &["add", "-A"]);
    git(&q.root, &["commit", "-q", "-m", "start"]);
    let m = mark.display();
    for (key, value) in [
        ("core.fsmonitor", format!("touch {m}/preset-fsmonitor")),
        ("core.hooksPath", "myhooks".to_owned()),
        ("diff.external", format!("touch {m}/preset-diff")),
    ] {
        git(&q.root, &["config", key, &value]);
    }
    std::fs::create_dir_all(q.root.join("myhooks")).unwrap();
    for hook in [
        "pre-commit",
        "post-commit",
        "post-checkout",
        "reference-transaction",
    ] {
        q.script("hook", &format!("touch {m}/preset-{hook}\n"));
        std::fs::copy(q.root.join("bin/hook"), q.root.join("myhooks").join(hook)).unwrap();
    }
    let id = q.create(&["--title", "prepared"]);
    let run = q.run(&id, &[]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    assert_eq!(code(&q.output(&["diff", &id])), 0);
    let ran: Vec<_> = std::fs::read_dir(&mark)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        ran.is_empty(),
        "loopd's git ran a program the repository names: {ran:?}"
    );
}

#[test]
fn an_action_cannot_change_its_loops_limits_another_loop_or_the_config() {
    if !sandboxed_here() {
        return;
    }
    let edit = |file: &str| {
        format!(
            "python3 -c \"import sys,json; p=sys.argv[1]; s=json.load(open(p)); s[\\\"max_iterations\\\"]=50; json.dump(s, open(p, \\\"w\\\"))\" {file}"
        )
    };
    let tries = vec![
        ("raise its own limit", edit("\"$LOOPD_STATE_FILE\"")),
        ("raise its limit by a rename", "cp \"$LOOPD_STATE_FILE\" mine.json && sed -i s/6/50/ mine.json && mv mine.json \"$LOOPD_STATE_FILE\"".to_owned()),
        ("raise the limit of another loop", edit(".loop/other.json")),
        ("rewrite the config", "echo \"max_iterations = 50\" >> .loop/config.toml".to_owned()),
        ("make a loop", "cp .loop/other.json .loop/made.json".to_owned()),
        ("move the state directory", "mv .loop .loop-away".to_owned()),
        ("keep a note", "echo seen >> \"$LOOPD_PROGRESS_DIR/notes.md\"".to_owned()),
    ];
    let p = Project::new(&agent(&[("develop", HOSTILE_AGENT)]));
    hostile(&p, &tries);
    let other = p.create(&["--title", "other", "--max-iterations", "6"]);
    std::fs::rename(p.state_path(&other), p.root.join(".loop/other.json")).unwrap();
    let config = std::fs::read_to_string(p.root.join(".loop/config.toml")).unwrap();
    let id = p.create(&["--title", "limits", "--max-iterations", "6"]);
    let mounts = || std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let before = mounts();
    let run = p.run(&id, &[]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    // The attempts' views were made in namespaces of their own: loopd's has no mount more.
    assert!(
        !mounts().contains(&format!("{} ", p.root.join(".loop").display())),
        "a mount of the view leaked into loopd's namespace"
    );
    assert_eq!(mounts().lines().count(), before.lines().count());
    assert_tried(&p, &tries, &["keep a note"]);
    assert_eq!(p.state(&id)["max_iterations"], 6);
    let other: serde_json::Value =
        serde_json::from_slice(&std::fs::read(p.root.join(".loop/other.json")).unwrap()).unwrap();
    assert_eq!(other["max_iterations"], 6);
    assert_eq!(
        std::fs::read_to_string(p.root.join(".loop/config.toml")).unwrap(),
        config
    );
    assert!(!p.root.join(".loop/made.json").exists());
    let notes = p.progress(&id).join("notes.md");
    assert_eq!(std::fs::read_to_string(notes).unwrap(), "seen\nseen\n");
}

/// A Unix socket server of the test's (a program outside the sandbox): how many connections it
/// took.
fn socket_server(
    listener: std::os::unix::net::UnixListener,
) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    let taken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = taken.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            if stream.is_ok() {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    taken
}

#[test]
fn an_action_reaches_no_socket_outside_and_signals_no_process_outside() {
    use std::os::linux::net::SocketAddrExt as _;
    use std::os::unix::net::{SocketAddr, UnixListener};
    use std::sync::atomic::Ordering;
    if !sandboxed_here() {
        return;
    }
    // An SSH agent of the user's, a socket the executor declares, and an abstract socket.
    let outside = tempfile::tempdir().unwrap();
    let outside = outside.path().canonicalize().unwrap();
    let agent_sock = outside.join("agent.sock");
    let agent_taken = socket_server(UnixListener::bind(&agent_sock).unwrap());
    let declared_dir = tempfile::tempdir().unwrap();
    let declared = declared_dir
        .path()
        .canonicalize()
        .unwrap()
        .join("podman.sock");
    let declared_taken = socket_server(UnixListener::bind(&declared).unwrap());
    let name = format!("loopd-test-{}", std::process::id());
    let abstract_taken = socket_server(
        UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap(),
    );
    let p = Project::new(&agent(&[("develop", HOSTILE_AGENT)]));
    p.script(
        "connect.py",
        "import socket, sys\ns = socket.socket(socket.AF_UNIX)\na = sys.argv[1]\ns.connect(\"\\0\" + a[1:] if a.startswith(\"@\") else a)\n",
    );
    p.script(
        "own.py",
        "import os, socket\np = os.path.join(os.environ[\"TMPDIR\"], \"own.sock\")\nif os.path.exists(p): os.remove(p)\ns = socket.socket(socket.AF_UNIX); s.bind(p); s.listen()\nc = socket.socket(socket.AF_UNIX); c.connect(p)\n",
    );
    p.script(
        "daemon.py",
        "import json, os\nprint(json.load(open(os.environ[\"LOOPD_STATE_FILE\"]))[\"skill_state\"][\"in_flight\"][\"daemon_pid\"])\n",
    );
    let tries = vec![
        (
            "reach the ssh agent",
            format!("python3 bin/connect.py {}", agent_sock.display()),
        ),
        (
            "find the ssh agent",
            "test -n \"$SSH_AUTH_SOCK\"".to_owned(),
        ),
        (
            "reach an abstract socket",
            format!("python3 bin/connect.py @{name}"),
        ),
        (
            "reach the declared socket",
            format!("python3 bin/connect.py {}", declared.display()),
        ),
        ("serve a socket of its own", "python3 bin/own.py".to_owned()),
        (
            "signal the daemon",
            "kill -CONT $(python3 bin/daemon.py)".to_owned(),
        ),
        (
            "read the environment of the daemon",
            "cat /proc/$(python3 bin/daemon.py)/environ > env.txt".to_owned(),
        ),
    ];
    hostile(&p, &tries);
    p.config(&TEST_CONFIG.replace(
        "format = \"json\"",
        &format!(
            "format = \"json\"\nsandbox_sockets = [\"{}\"]",
            declared.display()
        ),
    ));
    let id = p.create(&["--title", "sockets"]);
    let child = p
        .loopd()
        .args(["run", &id])
        .env("SSH_AUTH_SOCK", &agent_sock)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let run = wait_output(child, DEADLINE);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    assert_tried(
        &p,
        &tries,
        &["reach the declared socket", "serve a socket of its own"],
    );
    assert_eq!(agent_taken.load(Ordering::SeqCst), 0);
    assert_eq!(abstract_taken.load(Ordering::SeqCst), 0);
    wait_for("the declared socket's connections", || {
        declared_taken.load(Ordering::SeqCst) == 2
    });
}

/// An attempt's sandbox is kept for the next attempts of its loop while what it was made from
/// holds: a credential file made since is hidden all the same, a directory made since in the home
/// is readable, and a `.git/config` git rewrote since is the one an agent's git reads.
#[test]
fn a_kept_sandbox_follows_what_changed_since_it_was_made() {
    if !sandboxed_here() {
        return;
    }
    let user = Project::new("");
    let home = user.root.display().to_string();
    let look = format!(
        "{{ cat {home}/.aws/credentials || echo hidden; cat {home}/later/notes.txt || echo unseen; git config --get loopd.test; }} >> \"looked-$LOOPD_TASK_ID.txt\" 2>/dev/null"
    );
    let p = Project::beside(
        &user,
        &agent(&[(
            "develop",
            &format!(
                "{look}; if [ \"$LOOPD_TASK_ID\" = task-001 ]; then touch first-done; {}; fi",
                wait_for_file("go")
            ),
        )]),
    );
    git(&p.root, &["init", "-q"]);
    git(&p.root, &["config", "loopd.test", "before"]);
    let id = p.create(&["--title", "kept"]);
    let run = p.spawn_run(&id, &[]);
    wait_for("the first develop", || p.root.join("first-done").exists());
    std::fs::create_dir_all(user.root.join(".aws")).unwrap();
    std::fs::write(user.root.join(".aws/credentials"), "SECRET\n").unwrap();
    std::fs::create_dir_all(user.root.join("later")).unwrap();
    std::fs::write(user.root.join("later/notes.txt"), "seen\n").unwrap();
    git(&p.root, &["config", "loopd.test", "after"]);
    std::fs::write(p.root.join("go"), "").unwrap();
    let out = wait_output(run, DEADLINE);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let looked =
        |task: &str| std::fs::read_to_string(p.root.join(format!("looked-{task}.txt"))).unwrap();
    assert_eq!(looked("task-001"), "hidden\nunseen\nbefore\n");
    assert_eq!(looked("task-002"), "hidden\nseen\nafter\n");
}

#[test]
fn no_attempt_reads_loopds_temporal_credentials_nor_sees_their_variables() {
    if !sandboxed_here() {
        return;
    }
    // The user's: an API key file that `[temporal]` names, and the temporal CLI's profiles.
    let user = Project::new("");
    let home = user.root.display().to_string();
    let secrets = user.root.join("secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    let key = secrets.join("temporal-key");
    std::fs::write(&key, "sk-from-the-file\n").unwrap();
    let profiles = user.root.join(".config/temporalio");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(
        profiles.join("temporal.toml"),
        "[profile.default]\napi_key = \"sk-from-the-profile\"\n",
    )
    .unwrap();
    let tries = [
        (
            "read the API key file",
            format!("cat {} > k1.txt", key.display()),
        ),
        (
            "read the temporal CLI profiles",
            format!("cat {home}/.config/temporalio/temporal.toml > k2.txt"),
        ),
        (
            "see TEMPORAL_API_KEY",
            "test -n \"$TEMPORAL_API_KEY\"".to_owned(),
        ),
        (
            "see its executor own TEMPORAL_ variable",
            "test -n \"$TEMPORAL_MINE\"".to_owned(),
        ),
    ];
    let p = Project::beside(&user, &agent(&[("develop", HOSTILE_AGENT)]));
    hostile(&p, &tries);
    p.config(&format!(
        "{TEST_CONFIG}env = {{ TEMPORAL_MINE = \"set by its executor\" }}\n\n\
         [temporal]\napi_key_file = {:?}\n",
        key.display().to_string()
    ));
    let id = p.create(&["--title", "after loopd's credentials"]);
    let out = p
        .loopd()
        .env("TEMPORAL_API_KEY", "sk-from-the-environment")
        .args(["run", &id])
        .output()
        .expect("run loopd");
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_tried(&p, &tries, &["see its executor own TEMPORAL_ variable"]);
    for copy in ["k1.txt", "k2.txt"] {
        let read = std::fs::read_to_string(p.root.join(copy)).unwrap_or_default();
        assert!(!read.contains("sk-from"), "{copy}: {read}");
    }
}

/// The service a loop runs under, its MCP endpoint, and an MCP server of the agent's own making:
/// an action reaches none of them, and its loop goes on to its end.
#[test]
fn an_action_reaches_neither_the_service_nor_an_mcp_server_of_loopd() {
    if !sandboxed_here() {
        return;
    }
    // The user's home is not the project's root, as for most users.
    let home = Project::new(GOOD_AGENT);
    let p = Project::beside(&home, &agent(&[("develop", HOSTILE_AGENT)]));
    let service = p.serve(&[
        "--listen",
        "127.0.0.1:0",
        "--root",
        p.root.to_str().unwrap(),
    ]);
    let info = service.info().expect("the service's status");
    let (addr, socket) = (&info["listen"], &info["socket"]);
    let (addr, socket) = (addr.as_str().unwrap(), socket.as_str().unwrap());
    p.script(
        "reach.py",
        "import socket, sys\nhost, port = sys.argv[1].rsplit(\":\", 1)\nsocket.create_connection((host, int(port)), timeout=5)\n",
    );
    p.script(
        "connect.py",
        "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n",
    );
    // JSON-RPC by hand to `loopd mcp`: initialize, then stop this very loop.
    p.script(
        "mcp.sh",
        &format!(
            "{{ printf '%s\\n' '{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"initialize\",\"params\":{{\"protocolVersion\":\"2025-11-25\",\"capabilities\":{{}},\"clientInfo\":{{\"name\":\"a\",\"version\":\"1\"}}}}}}' \
             '{{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}}' \
             \"{{\\\"jsonrpc\\\":\\\"2.0\\\",\\\"id\\\":2,\\\"method\\\":\\\"tools/call\\\",\\\"params\\\":{{\\\"name\\\":\\\"stop_loop\\\",\\\"arguments\\\":{{\\\"id\\\":\\\"$LOOPD_LOOP_ID\\\"}}}}}}\"; sleep 1; }} \
             | {} --root . mcp | grep -q '\"isError\":false'\n",
            env!("CARGO_BIN_EXE_loopd")
        ),
    );
    let tries = vec![
        (
            "reach the MCP endpoint",
            format!("python3 bin/reach.py {addr}"),
        ),
        (
            "reach the service socket",
            format!("python3 bin/connect.py {socket}"),
        ),
        (
            "stop its loop through loopd mcp",
            "sh bin/mcp.sh".to_owned(),
        ),
    ];
    hostile(&p, &tries);
    let id = p.create(&["--title", "reaches for loopd"]);
    let started = p.output(&["start", &id]);
    assert_eq!(code(&started), 0, "{}", stderr(&started));
    wait_for("the loop's end", || p.state(&id)["status"] != "running");
    assert_eq!(p.state(&id)["status"], "completed", "{}", p.state(&id));
    assert_tried(&p, &tries, &[]);
}
