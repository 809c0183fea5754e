//! Loops on a Temporal that demands what teams run it with: TLS, a client certificate (mutual
//! TLS) and an API key on every call. A real dev server behind a real TLS endpoint
//! (`tests/fixtures/temporal_tls_proxy.py`: PyPI's `grpcio` and `trustme`, which `.ci/run`
//! installs into `~/.cache/loopd/tls-proxy`), the real binary, and each way of connecting a user
//! has: flags, `[temporal]` settings, the Temporal CLI's environment and its profiles. Built with
//! `--features temporal`.
#![cfg(feature = "temporal")]

mod common;

use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::temporal::{Process, Temporal, free_port, side_dir, temporal_bin};
use common::{GOOD_AGENT, Project, code, stderr, stdout, wait_for};

/// The API key the endpoint wants.
const KEY: &str = "sk-loopd-test-4f1c9a";

/// The Python with `grpcio` and `trustme`, or `None` (with a message) where it is not installed
/// outside CI.
fn proxy_python() -> Option<PathBuf> {
    common::installed(
        "LOOPD_TLS_PROXY_PYTHON",
        ".cache/loopd/tls-proxy/bin/python",
        "Python's grpcio and trustme",
        "docs/development.md, \"Loops on Temporal\"",
    )
}

/// A TLS endpoint in front of a dev server: mutual TLS, and the API key [`KEY`] on every call.
struct Endpoint {
    temporal: Temporal,
    /// Its `127.0.0.1:PORT`.
    address: String,
    /// ca.pem, client.pem, client.key, other-ca.pem, and the files of the keys: key (right),
    /// wrong-key.
    certs: PathBuf,
    log: PathBuf,
    _proxy: Process,
}

impl Endpoint {
    fn start(p: &Project, bin: &PathBuf, python: &Path) -> Endpoint {
        let temporal = Temporal::start(p, bin);
        let dir = side_dir(p);
        let certs = dir.join("certs");
        std::fs::create_dir_all(&certs).expect("mkdir certs");
        std::fs::write(certs.join("key"), format!("{KEY}\n")).expect("write the key");
        std::fs::write(certs.join("wrong-key"), "sk-not-this-one").expect("write a wrong key");
        let port = free_port();
        let log = dir.join("proxy-calls.log");
        let mut proxy = Command::new(python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/temporal_tls_proxy.py"))
            .arg("--certs")
            .arg(&certs)
            .args(["--port", &port.to_string(), "--upstream", &temporal.address])
            .arg("--api-key-file")
            .arg(certs.join("key"))
            .arg("--log")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("proxy.log")).expect("its log"))
            .spawn()
            .expect("start the TLS endpoint");
        let mut ready = String::new();
        std::io::BufReader::new(proxy.stdout.take().expect("its stdout"))
            .read_line(&mut ready)
            .expect("read its first line");
        assert_eq!(
            ready.trim(),
            "ready",
            "the TLS endpoint did not start: {}",
            std::fs::read_to_string(dir.join("proxy.log")).unwrap_or_default()
        );
        Endpoint {
            temporal,
            address: format!("127.0.0.1:{port}"),
            certs,
            log,
            _proxy: Process(proxy),
        }
    }

    fn cert(&self, name: &str) -> String {
        self.certs.join(name).display().to_string()
    }

    /// The flags of a client that has every credential, the API key in file `key`.
    fn flags(&self, key: &str) -> Vec<String> {
        [
            "--temporal",
            &self.address,
            "--tls-ca-path",
            &self.cert("ca.pem"),
            "--tls-cert-path",
            &self.cert("client.pem"),
            "--tls-key-path",
            &self.cert("client.key"),
            "--api-key-file",
            &self.cert(key),
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// The calls it took and refused, as `ok METHOD` / `refused METHOD` lines.
    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

/// `loopd ARGS...` in the project, with `env` set.
fn loopd(p: &Project, env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    p.loopd()
        .envs(env.iter().copied())
        .args(args)
        .output()
        .expect("run loopd")
}

#[test]
fn a_fleet_runs_through_mutual_tls_and_an_api_key_set_each_way_a_user_sets_them() {
    let (Some(bin), Some(python)) = (temporal_bin(), proxy_python()) else {
        return;
    };
    // The first task's develop waits for `go`: time to stop the loop and resume it.
    let p = Project::new(&GOOD_AGENT.replace(
        "  develop)",
        &format!(
            "  develop) [ \"$LOOPD_TASK_ID\" = task-001 ] && {{ {}; }}\n    ",
            common::wait_for_file("go")
        ),
    ));
    let mut endpoint = Endpoint::start(&p, &bin, &python);
    // One worker told everything by flags, the other by the Temporal CLI's variables alone.
    let mut w0 = p.loopd();
    w0.args(endpoint.flags("key"))
        .args(["worker", "--name", "w0"]);
    endpoint.temporal.add_worker(&p, "w0", w0);
    let mut w1 = p.loopd();
    w1.args(["worker", "--name", "w1"]).envs([
        ("TEMPORAL_ADDRESS", endpoint.address.clone()),
        ("TEMPORAL_TLS_SERVER_CA_CERT_PATH", endpoint.cert("ca.pem")),
        ("TEMPORAL_TLS_CLIENT_CERT_PATH", endpoint.cert("client.pem")),
        ("TEMPORAL_TLS_CLIENT_KEY_PATH", endpoint.cert("client.key")),
        ("TEMPORAL_API_KEY", KEY.to_owned()),
    ]);
    endpoint.temporal.add_worker(&p, "w1", w1);
    // The commands a person types: a profile of the Temporal CLI, named by its variables, and
    // `[temporal] enabled` in the project.
    let profiles = side_dir(&p).join("temporal.toml");
    std::fs::write(
        &profiles,
        format!(
            "[profile.default]\naddress = \"127.0.0.1:1\"\n\n\
             [profile.fleet]\naddress = \"{}\"\nnamespace = \"default\"\napi_key = \"{KEY}\"\n\
             [profile.fleet.tls]\nserver_ca_cert_path = \"{}\"\nclient_cert_path = \"{}\"\n\
             client_key_path = \"{}\"\n",
            endpoint.address,
            endpoint.cert("ca.pem"),
            endpoint.cert("client.pem"),
            endpoint.cert("client.key"),
        ),
    )
    .expect("write the profiles");
    p.config(&format!(
        "{}\n[temporal]\nenabled = true\n",
        common::TEST_CONFIG
    ));
    let profiles = profiles.display().to_string();
    let env = [
        ("TEMPORAL_CONFIG_FILE", profiles.as_str()),
        ("TEMPORAL_PROFILE", "fleet"),
    ];
    let out = loopd(&p, &env, &["create", "--title", "through TLS"]);
    assert_eq!(code(&out), 0, "create: {}", stderr(&out));
    let id = stdout(&out).trim().to_owned();
    let status = |id: &str| {
        let out = loopd(&p, &env, &["--json", "status", id]);
        assert_eq!(code(&out), 0, "status: {}", stderr(&out));
        serde_json::from_str::<serde_json::Value>(&stdout(&out)).expect("JSON")
    };
    wait_for("the first develop to run", || {
        status(&id)["heartbeat"]["action"] == "develop"
    });
    let out = loopd(&p, &env, &["stop", &id]);
    assert_eq!(code(&out), 0, "stop: {}", stderr(&out));
    wait_for("the loop to be stopped", || {
        status(&id)["status"] == "failed"
    });
    std::fs::write(p.root.join("go"), "").expect("touch go");
    let out = loopd(&p, &env, &["resume", &id]);
    assert_eq!(code(&out), 0, "resume: {}", stderr(&out));
    let mut state = serde_json::Value::Null;
    wait_for("the loop to complete", || {
        state = status(&id);
        state["status"] == "completed"
    });
    assert_eq!(state["skill_state"]["outcome"], "passed", "{state}");
    wait_for("the list to show it completed", || {
        let out = loopd(&p, &env, &["list"]);
        code(&out) == 0 && stdout(&out).contains(&id) && stdout(&out).contains("completed")
    });
    // Every call reached the dev server through the endpoint, each with the key.
    let calls = endpoint.calls();
    assert!(
        calls.iter().all(|c| c.starts_with("ok ")),
        "refused calls: {calls:?}"
    );
    for method in [
        "PollActivityTaskQueue",
        "RespondActivityTaskCompleted",
        "StartWorkflowExecution",
        "UpdateWorkflowExecution",
        "ListWorkflowExecutions",
    ] {
        assert!(
            calls.iter().any(|c| c.ends_with(&format!("/{method}"))),
            "no {method} among the calls: {calls:?}"
        );
    }
    // The key is nowhere a person or an agent reads: the history, the workers' logs, the
    // project's files.
    let out = loopd(&p, &env, &["--json", "logs", &id]);
    assert_eq!(code(&out), 0, "logs: {}", stderr(&out));
    let mut seen = vec![stdout(&out), state.to_string()];
    for w in ["w0", "w1"] {
        seen.push(std::fs::read_to_string(side_dir(&p).join(format!("worker-{w}.log"))).unwrap());
    }
    for (i, text) in seen.iter().enumerate() {
        assert!(!text.contains(KEY), "the key is in text {i}: {text}");
    }
}

#[test]
fn each_bad_connection_is_one_line_that_names_what_failed() {
    let (Some(bin), Some(python)) = (temporal_bin(), proxy_python()) else {
        return;
    };
    let p = Project::new(GOOD_AGENT);
    let endpoint = Endpoint::start(&p, &bin, &python);
    let with = |changes: &[(&str, Option<&str>)]| {
        let mut flags = endpoint.flags("key");
        for (flag, value) in changes {
            let at = flags.iter().position(|f| f == flag);
            match (at, value) {
                (Some(i), Some(v)) => flags[i + 1] = (*v).to_owned(),
                (Some(i), None) => {
                    flags.drain(i..i + 2);
                }
                (None, Some(v)) => flags.extend([(*flag).to_owned(), (*v).to_owned()]),
                (None, None) => flags.push((*flag).to_owned()),
            }
        }
        flags.push("list".into());
        flags
    };
    let (other_ca, wrong_key) = (endpoint.cert("other-ca.pem"), endpoint.cert("wrong-key"));
    let unused = format!("127.0.0.1:{}", free_port());
    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        (
            "plaintext to a TLS endpoint",
            vec!["--temporal".into(), endpoint.address.clone(), "list".into()],
            "if it speaks TLS, set tls = true",
        ),
        (
            "a CA that did not sign its certificate",
            with(&[("--tls-ca-path", Some(&other_ca))]),
            "the server's certificate is not trusted",
        ),
        (
            "no client certificate",
            with(&[("--tls-cert-path", None), ("--tls-key-path", None)]),
            "it asks for a client certificate",
        ),
        (
            "the wrong API key",
            with(&[("--api-key-file", Some(&wrong_key))]),
            "the server refused the API key",
        ),
        (
            "no API key",
            with(&[("--api-key-file", None)]),
            "the server wants credentials",
        ),
        (
            "a namespace the server does not have",
            with(&[("--namespace", Some("nowhere"))]),
            "namespace \"nowhere\" is not there",
        ),
        (
            "TLS to a plaintext server",
            vec![
                "--temporal".into(),
                endpoint.temporal.address.clone(),
                "--tls".into(),
                "list".into(),
            ],
            "the server does not speak TLS",
        ),
        (
            "an address where nothing listens",
            vec!["--temporal".into(), unused, "list".into()],
            "nothing listens there",
        ),
    ];
    for (case, args, expected) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = loopd(&p, &[], &args);
        let err = stderr(&out);
        assert_eq!(code(&out), 2, "{case}: {err}");
        // One line; where nothing listens yet, after the one that says it was waited for.
        let (error, waited) = match err.trim_end().lines().collect::<Vec<_>>()[..] {
            [error] => (error, None),
            [waited, error] => (error, Some(waited)),
            _ => panic!("{case}: not one line: {err}"),
        };
        assert_eq!(
            waited.is_some(),
            expected == "nothing listens there",
            "{case}: {err}"
        );
        if let Some(waited) = waited {
            assert!(
                waited.starts_with("waiting up to 10s for Temporal"),
                "{case}: {err}"
            );
        }
        assert!(error.starts_with("loopd: cannot "), "{case}: {err}");
        assert!(
            err.contains(expected),
            "{case}: expected {expected:?} in {err}"
        );
        assert!(!err.contains(KEY), "{case}: the key is shown: {err}");
    }
}
