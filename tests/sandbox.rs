//! The sandbox around every attempt (README "Sandbox"), through the real binary, with hostile
//! executors in a temporary home: what they try outside their work tree is refused, nothing
//! outside changes, and the loop goes on.

mod common;

use std::net::TcpListener;

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

/// Develop runs `bin/hostile.sh` (see [`hostile`]) itself and from a grandchild in a new session,
/// once, then succeeds, so the loop goes on.
const HOSTILE_AGENT: &str = "[ -e tried.txt ] || { sh bin/hostile.sh; setsid -w sh bin/hostile.sh ' (grandchild)' < /dev/null; cat errors.txt >&2; }";

/// Writes `bin/hostile.sh`: it tries each `(NAME, COMMAND)` and writes `NAME: done` or `NAME:
/// refused` (NAME followed by its first argument) to `tried.txt` in the work tree, and what the
/// commands said to `errors.txt`.
fn hostile(p: &Project, tries: &[(&str, String)]) {
    let mut script = String::from(
        "try() { if ( eval \"$2\" ) 2>>errors.txt; then echo \"$1$who: done\" >> tried.txt; \
         else echo \"$1$who: refused\" >> tried.txt; fi; }\nwho=$1\n",
    );
    for (name, command) in tries {
        script.push_str(&format!("try '{name}' '{command}'\n"));
    }
    p.script("hostile.sh", &script);
}

/// What develop tried, line by line.
fn tried(p: &Project) -> Vec<String> {
    std::fs::read_to_string(p.root.join("tried.txt"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
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

    let said = tried(&p);
    for (name, allowed) in [
        ("write outside", false),
        ("overwrite outside", false),
        ("write in the home", false),
        ("write through a link", false),
        ("read the key", false),
        ("list the keys", false),
        ("write in the work tree", true),
        ("write in TMPDIR", true),
    ] {
        let word = if allowed { "done" } else { "refused" };
        for who in ["", " (grandchild)"] {
            let line = format!("{name}{who}: {word}");
            assert!(said.contains(&line), "{line:?} not in {said:#?}");
        }
    }
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
