//! Trust (CONTRACT §8): a project's own config and action files set what runs only after
//! `loopd trust`; a changed file must be trusted again; the user's own files need no trust.

mod common;

use std::os::unix::fs::PermissionsExt as _;

use common::*;

/// The one line a refused command prints, checked for the file and the hint.
fn assert_untrusted(out: &std::process::Output, file: &str, why: &str) {
    let err = stderr(out);
    assert_eq!(code(out), 2, "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains(file), "names {file}: {err}");
    assert!(err.contains(why), "says {why}: {err}");
    assert!(err.contains("`loopd trust`"), "gives the command: {err}");
}

#[test]
fn untrusted_project_files_stop_run_start_and_resume_until_trusted() {
    let p = Project::new(GOOD_AGENT);
    assert_eq!(code(&p.output(&["trust", "--revoke"])), 0);
    let marker = p.root.join("ran");
    // The project's config, as a cloned repository would bring it: written, never trusted.
    let config = TEST_CONFIG.replace(
        "command = [\"sh\", \"bin/agent.sh\"]",
        &format!(
            "command = [\"sh\", \"-c\", \"touch {} && sh bin/agent.sh\"]",
            marker.display()
        ),
    );
    std::fs::write(p.root.join(".loop/config.toml"), &config).unwrap();
    let id = p.create(&["--title", "t"]);

    assert_untrusted(&p.run(&id, &[]), ".loop/config.toml", "is not trusted");
    assert_untrusted(
        &p.output(&["start", &id]),
        ".loop/config.toml",
        "is not trusted",
    );
    assert_eq!(code(&p.output(&["pause", &id])), 0);
    assert_untrusted(
        &p.output(&["resume", &id]),
        ".loop/config.toml",
        "is not trusted",
    );
    assert_eq!(
        p.state(&id)["status"],
        "paused",
        "a refused resume changes nothing"
    );
    assert!(!marker.exists(), "nothing of the project's ran");

    let doctor = p.output(&["doctor"]);
    assert_eq!(code(&doctor), 1);
    assert!(
        stdout(&doctor).contains("is not trusted"),
        "{}",
        stdout(&doctor)
    );

    let out = p.output(&["trust"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!(
            "trusted {}",
            p.root.join(".loop/config.toml").display()
        )),
        "{}",
        stdout(&out)
    );
    assert!(stdout(&p.output(&["doctor"])).contains("trusted (1 project file)"));
    assert_eq!(code(&p.output(&["resume", &id])), 0);
    wait_for("the trusted loop to complete", || {
        p.state(&id)["status"] == "completed"
    });
    assert!(marker.exists(), "the trusted command ran");

    // A changed file is untrusted again, and so is a new action file.
    let q = p.create(&["--title", "again"]);
    std::fs::write(
        p.root.join(".loop/config.toml"),
        format!("{config}\n# edited\n"),
    )
    .unwrap();
    assert_untrusted(
        &p.run(&q, &[]),
        ".loop/config.toml",
        "changed since it was trusted",
    );
    assert!(p.trust());
    let develop = p.root.join(".loop/actions/ccw-loop/develop.md");
    std::fs::create_dir_all(develop.parent().unwrap()).unwrap();
    std::fs::write(&develop, "develop {{task_description}}\n").unwrap();
    assert_untrusted(
        &p.run(&q, &[]),
        "actions/ccw-loop/develop.md",
        "is not trusted",
    );
    assert!(p.trust());
    assert_eq!(code(&p.run(&q, &[])), 0);

    // Revoked: untrusted again.
    let out = p.output(&["trust", "--revoke"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let r = p.create(&["--title", "revoked"]);
    assert_untrusted(&p.run(&r, &[]), ".loop/config.toml", "is not trusted");
}

#[test]
fn the_users_own_config_needs_no_trust_and_the_record_is_private() {
    let p = Project::new(GOOD_AGENT);
    assert_eq!(code(&p.output(&["trust", "--revoke"])), 0);
    std::fs::remove_file(p.root.join(".loop/config.toml")).unwrap();
    // The user's config dir, from $XDG_CONFIG_HOME.
    let xdg = tempfile::tempdir().unwrap();
    let user = xdg.path().join("loopd");
    std::fs::create_dir_all(&user).unwrap();
    std::fs::write(user.join("config.toml"), TEST_CONFIG).unwrap();
    let loopd = |args: &[&str]| {
        p.loopd()
            .env("XDG_CONFIG_HOME", xdg.path())
            .args(args)
            .output()
            .unwrap()
    };
    let id = stdout(&loopd(&["create", "--title", "t"]))
        .trim()
        .to_owned();
    let out = loopd(&["run", &id]);
    assert_eq!(code(&out), 0, "user config: {}", stderr(&out));
    let out = loopd(&["trust"]);
    assert!(
        stdout(&out).contains("nothing to trust"),
        "{}",
        stdout(&out)
    );

    // `--config FILE` is the user's own choice, even when it names the project's file.
    std::fs::write(p.root.join(".loop/config.toml"), TEST_CONFIG).unwrap();
    let id = p.create(&["--title", "explicit"]);
    let out = p
        .loopd()
        .args(["--config", ".loop/config.toml", "run", &id])
        .output()
        .unwrap();
    assert_eq!(code(&out), 0, "--config: {}", stderr(&out));

    // The record lands in the user's config dir, private.
    assert_eq!(code(&loopd(&["trust"])), 0);
    let records = user.join("trusted");
    let mode =
        |path: &std::path::Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&records), 0o700);
    let files: Vec<_> = std::fs::read_dir(&records)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(mode(&files[0]), 0o600);
    let text = std::fs::read_to_string(&files[0]).unwrap();
    assert!(
        text.contains(&p.root.join(".loop/config.toml").display().to_string()),
        "{text}"
    );
    // A record of this project in another user dir does not count here.
    let id = p.create(&["--title", "elsewhere"]);
    assert_untrusted(&p.run(&id, &[]), ".loop/config.toml", "is not trusted");
}
