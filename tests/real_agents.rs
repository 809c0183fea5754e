//! The real agent CLIs (Claude Code, Codex, Gemini CLI, Qwen Code), installed from npm by `.ci/run`
//! (pinned in `tests/agents/package-lock.json`), each driven by loopd with its default invocation
//! against a scripted model server on 127.0.0.1 (`tests/agents/model_server.py`).
//!
//! Where the CLIs are not installed the tests say so and pass, except in CI (`CI=true`), where
//! they must run. `LOOPD_AGENTS_DIR` is where `.ci/run` installs them
//! (default `~/.cache/loopd/agents`).

mod common;

use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::*;
use serde_json::Value;

/// The four CLIs, by loopd's executor name.
const CLIS: [&str; 4] = ["claude", "codex", "gemini", "qwen"];

/// The directory holding the installed CLIs' programs, or `None` (with a message) where they are
/// not installed outside CI.
fn agents_bin() -> Option<PathBuf> {
    let dir = std::env::var_os("LOOPD_AGENTS_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/loopd/agents")))?;
    let bin = dir.join("node_modules/.bin");
    let missing: Vec<_> = CLIS.iter().filter(|c| !bin.join(c).exists()).collect();
    if missing.is_empty() {
        return Some(bin);
    }
    common::not_installed(
        &format!("the agent CLIs {missing:?}"),
        &bin,
        "docs/development.md, \"The real agent CLIs\"",
    );
    None
}

/// A scripted model server for one test, ended when dropped.
struct ModelServer {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl ModelServer {
    fn start(root: &Path, dir: &Path, fault: &Fault) -> ModelServer {
        let log = dir.join("requests.jsonl");
        let mut cmd = Command::new("python3");
        cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/agents/model_server.py"))
            .arg("--root")
            .arg(root)
            .arg("--log")
            .arg(&log)
            .args(["--fault", fault.kind]);
        if let Some(secs) = fault.for_secs {
            cmd.args(["--fault-for", &secs.to_string()]);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 runs the model server");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("the server prints its port");
        let port = line.trim().parse().expect("a port number");
        ModelServer { child, port, log }
    }

    /// The requests it answered, one JSON object each.
    fn requests(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How the scripted server misbehaves: `kind` is `none`, `401`, `429`, `529`, `500` or `hang`;
/// with `for_secs`, only for that long after the first request.
#[derive(Clone, Copy)]
struct Fault {
    kind: &'static str,
    for_secs: Option<f64>,
}

const NO_FAULT: Fault = Fault {
    kind: "none",
    for_secs: None,
};

fn fault(kind: &'static str) -> Fault {
    Fault {
        kind,
        for_secs: None,
    }
}

/// A project whose loops use the real `cli` against a scripted server, with the CLI's own files
/// (login state, settings, sessions) in a home of its own.
struct AgentProject {
    project: Project,
    server: ModelServer,
    bin: PathBuf,
    _home: tempfile::TempDir,
}

impl AgentProject {
    fn new(cli: &str, bin: &Path, fault: Fault, extra_config: &str) -> AgentProject {
        AgentProject::with_key(cli, bin, fault, extra_config, true)
    }

    /// As [`AgentProject::new`]; without `key`, the CLI is given no API key at all.
    fn with_key(
        cli: &str,
        bin: &Path,
        fault: Fault,
        extra_config: &str,
        key: bool,
    ) -> AgentProject {
        let project = Project::new("");
        let home = tempfile::tempdir().unwrap();
        let server = ModelServer::start(&project.root, home.path(), &fault);
        let env = cli_env(cli, server.port, home.path(), key);
        let env: String = env
            .iter()
            .map(|(k, v)| format!("{k} = {}\n", toml_string(v)))
            .collect();
        project.config(&format!(
            "executor = \"{cli}\"\n{extra_config}\n\
             [executor_defaults]\nkill_grace = 1.0\n\n[executors.{cli}.env]\n{env}"
        ));
        AgentProject {
            project,
            server,
            bin: bin.to_owned(),
            _home: home,
        }
    }

    /// `loopd` with the installed CLIs first on PATH: the built-in command lines run as they are.
    fn loopd(&self) -> Command {
        let mut cmd = self.project.loopd();
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs = vec![self.bin.clone()];
        dirs.extend(std::env::split_paths(&path));
        cmd.env("PATH", std::env::join_paths(dirs).unwrap());
        cmd
    }

    /// `loopd run ID` in the background, its output dropped; ended when dropped.
    fn spawn_run(&self, id: &str) -> Running {
        self.loopd()
            .args(["run", id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
            .into()
    }

    fn run(&self, id: &str) -> std::process::Output {
        let child = self
            .loopd()
            .args(["run", id])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_output(child, std::time::Duration::from_secs(180))
    }
}

/// The environment that points `cli` at the scripted server on `port`, with its own files in
/// `home` (where its config file, if it needs one, is written); without `key`, no API key.
fn cli_env(cli: &str, port: u16, home: &Path, key: bool) -> Vec<(&'static str, String)> {
    let url = format!("http://127.0.0.1:{port}");
    // Each CLI's documented way to another endpoint, as environment or its own config file.
    let env: Vec<(&str, String)> = match cli {
        "claude" => vec![
            ("ANTHROPIC_BASE_URL", url),
            ("ANTHROPIC_API_KEY", "sk-scripted".into()),
            // Claude Code refuses --dangerously-skip-permissions as root without it.
            ("IS_SANDBOX", "1".into()),
            ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".into()),
            ("CLAUDE_CODE_MAX_RETRIES", "1".into()),
        ],
        "codex" => {
            let codex = home.join(".codex");
            std::fs::create_dir_all(&codex).unwrap();
            std::fs::write(
                codex.join("config.toml"),
                format!(
                    "model = \"scripted\"\nmodel_provider = \"scripted\"\n\n\
                     [model_providers.scripted]\nname = \"scripted\"\nbase_url = \"{url}/v1\"\n\
                     wire_api = \"responses\"\nenv_key = \"SCRIPTED_API_KEY\"\n\
                     request_max_retries = 0\nstream_max_retries = 0\n"
                ),
            )
            .unwrap();
            vec![("SCRIPTED_API_KEY", "sk-scripted".into())]
        }
        "gemini" => {
            // GOOGLE_GEMINI_BASE_URL alone selects the "gateway" auth type, which gemini-cli
            // 0.61 then rejects as invalid: choose the API key type in its settings.
            let gemini = home.join(".gemini");
            std::fs::create_dir_all(&gemini).unwrap();
            std::fs::write(
                gemini.join("settings.json"),
                r#"{"security":{"auth":{"selectedType":"gemini-api-key"}}}"#,
            )
            .unwrap();
            vec![
                ("GOOGLE_GEMINI_BASE_URL", url),
                ("GEMINI_API_KEY", "sk-scripted".into()),
            ]
        }
        "qwen" => vec![
            ("OPENAI_BASE_URL", format!("{url}/v1")),
            ("OPENAI_API_KEY", "sk-scripted".into()),
            ("OPENAI_MODEL", "scripted".into()),
        ],
        other => panic!("unknown CLI {other}"),
    };
    std::iter::once(("HOME", home.display().to_string()))
        .chain(env)
        .filter(|(k, _)| key || !k.ends_with("_API_KEY"))
        .collect()
}

fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

/// Runs `scenario` for every CLI, one after the other (each CLI is a few node processes).
fn for_each_cli(scenario: impl Fn(&str, &Path)) {
    let Some(bin) = agents_bin() else { return };
    for cli in CLIS {
        eprintln!("--- {cli}");
        scenario(cli, &bin);
    }
}

#[test]
fn each_real_cli_runs_a_whole_loop_against_its_scripted_server() {
    for_each_cli(|cli, bin| {
        let a = AgentProject::new(cli, bin, NO_FAULT, "");
        let p = &a.project;
        let id = p.create(&["--title", "write two files"]);
        let out = a.run(&id);
        assert_eq!(code(&out), 0, "{cli}: {}", stderr(&out));
        // The agents' own tool calls wrote the files.
        for task in ["task-001", "task-002"] {
            let text = std::fs::read_to_string(p.root.join(format!("{task}.txt")))
                .unwrap_or_else(|e| panic!("{cli}: {task}.txt: {e}"));
            assert_eq!(text, format!("written by the agent for {task}\n"), "{cli}");
        }
        let state = p.state(&id);
        assert_eq!(state["status"], "completed", "{cli}");
        assert_eq!(state["skill_state"]["outcome"], "passed", "{cli}");
        // Under the default network (its model endpoint only): the scripted server was reached,
        // and whatever else the CLI asked for was refused and said.
        let refused = p.events_named(&id, "network_refused");
        for e in &refused {
            eprintln!(
                "{cli}: refused {}:{} ({})",
                e["host"], e["port"], e["count"]
            );
        }
        assert!(
            refused.iter().all(|e| e["port"] != a.server.port),
            "{cli}: its model server was refused: {refused:?}"
        );
        let actions: Vec<String> = p
            .events(&id)
            .iter()
            .filter(|e| e["event"] == "action_finished")
            .map(|e| e["action"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            actions,
            ["init", "develop", "develop", "validate", "complete"],
            "{cli}"
        );
        // Every attempt's tokens, as the server reported them, add up in the state.
        let usage = &state["skill_state"]["usage"];
        assert!(
            usage["input_tokens"].as_u64().unwrap() >= 5 * 1000,
            "{cli}: {usage}"
        );
        assert!(
            usage["output_tokens"].as_u64().unwrap() >= 5 * 50,
            "{cli}: {usage}"
        );
        assert!(
            a.server
                .requests()
                .iter()
                .filter(|r| r["main"] == true)
                .count()
                >= 7,
            "{cli}: every action asked the model"
        );
        // Only Claude Code reports a cost (from its own price list).
        let cost = usage["cost_usd"].as_f64().unwrap_or(0.0);
        assert_eq!(cost > 0.0, cli == "claude", "{cli}: cost {cost}");
    });
}

/// Waits until the loop is paused by an environment fault; returns the state.
fn wait_blocked(a: &AgentProject, id: &str) -> Value {
    let mut state = Value::Null;
    wait_for("the loop to be blocked", || {
        state = a.project.state(id);
        state["status"] == "paused" && !state["skill_state"]["blocked"].is_null()
    });
    state
}

#[test]
fn no_key_or_a_rejected_key_blocks_the_loop_without_using_it_up() {
    for_each_cli(|cli, bin| {
        for (what, fault, key) in [
            ("no key", NO_FAULT, false),
            ("a rejected key", fault("401"), true),
        ] {
            let a = AgentProject::with_key(cli, bin, fault, "", key);
            let p = &a.project;
            let id = p.create(&["--title", "t"]);
            let mut daemon = a.spawn_run(&id);
            let state = wait_blocked(&a, &id);
            // No retry, no error, no iteration, no task touched.
            let events = p.events(&id);
            let started = events
                .iter()
                .filter(|e| e["event"] == "action_started")
                .count();
            assert_eq!(
                started, 1,
                "{cli}, {what}: one attempt, no retries: {events:#?}"
            );
            assert_eq!(state["skill_state"]["error_count"], 0, "{cli}, {what}");
            assert_eq!(state["current_iteration"], 0, "{cli}, {what}");
            let blocked = &state["skill_state"]["blocked"];
            assert_eq!(blocked["executor"], cli, "{cli}, {what}: {blocked}");
            // One line, from status and from logs, says what and what to do.
            let status = stdout(&p.output(&["status", &id]));
            let line = status
                .lines()
                .find(|l| l.trim_start().starts_with("blocked"))
                .unwrap_or_else(|| panic!("{cli}, {what}: {status}"));
            assert!(line.contains(&format!("{cli}: ")), "{line}");
            assert!(line.contains(&format!("loopd resume {id}")), "{line}");
            let logs = stdout(&p.output(&["logs", &id]));
            assert!(
                logs.lines()
                    .any(|l| l.contains("blocked") && l.contains("loopd resume")),
                "{cli}, {what}: {logs}"
            );
            eprintln!("{cli}, {what}: {}", blocked["reason"]);
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
    });
}

/// What `pids` are, for an assertion's message: each one's `/proc/PID/stat` and command line.
fn described(pids: &[u32]) -> String {
    pids.iter()
        .map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .unwrap_or_default();
            format!("\n  {} | {}", stat.trim(), cmdline.trim())
        })
        .collect()
}

/// The live processes whose environment has `LOOPD_STATE_FILE=state`: an executor of that loop
/// and whatever it started.
fn processes_of(state: &Path) -> Vec<u32> {
    let needle = format!("LOOPD_STATE_FILE={}", state.display());
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == needle.as_bytes()))
        })
        .filter(|pid| alive(*pid))
        .collect()
}

#[test]
fn a_stop_mid_request_ends_every_process_of_the_cli() {
    for_each_cli(|cli, bin| {
        let a = AgentProject::new(cli, bin, fault("hang"), "");
        let p = &a.project;
        let id = p.create(&["--title", "t"]);
        let mut daemon = a.spawn_run(&id);
        wait_for("the CLI to wait for the model", || {
            a.server.requests().iter().any(|r| r["main"] == true)
        });
        let pids = processes_of(&p.state_path(&id));
        assert!(!pids.is_empty(), "{cli}: the CLI's processes are found");
        let started = std::time::Instant::now();
        let out = p.output(&["stop", &id]);
        assert_eq!(code(&out), 0, "{cli}: {}", stderr(&out));
        wait_for("every process of the CLI to end", || {
            pids.iter().all(|pid| !alive(*pid))
        });
        eprintln!(
            "{cli}: {} processes gone {} ms after `loopd stop` started",
            pids.len(),
            started.elapsed().as_millis()
        );
        let left = processes_of(&p.state_path(&id));
        assert!(left.is_empty(), "{cli}: left behind:{}", described(&left));
        let status = daemon.wait().unwrap();
        assert_eq!(status.code(), Some(5), "{cli}: stopped by a user");
    });
}

#[test]
fn rate_limits_and_overloads_end_in_their_outcome_and_the_loop_goes_on() {
    for_each_cli(|cli, bin| {
        for (kind, outcome) in [("429", "rate_limited"), ("529", "transient_api_error")] {
            let refusing = Fault {
                kind,
                for_secs: Some(3.0),
            };
            let a = AgentProject::new(
                cli,
                bin,
                refusing,
                "rate_limit_wait = 1.0\naction_retries = 5",
            );
            let p = &a.project;
            let id = p.create(&["--title", "t"]);
            let started = std::time::Instant::now();
            let out = a.run(&id);
            assert_eq!(code(&out), 0, "{cli}, {kind}: {}", stderr(&out));
            let events = p.events(&id);
            let failed: Vec<_> = events
                .iter()
                .filter(|e| e["event"] == "action_failed")
                .map(|e| e["outcome"].as_str().unwrap().to_owned())
                .collect();
            let retried = events
                .iter()
                .filter(|e| e["event"] == "agent_retrying")
                .count();
            eprintln!(
                "{cli}, {kind}: completed in {:.1}s; attempts failed as {failed:?}; the agent's own retries shown: {retried}",
                started.elapsed().as_secs_f64()
            );
            assert!(
                failed.iter().all(|o| o == outcome),
                "{cli}, {kind}: every failed attempt is {outcome}: {failed:?}"
            );
            assert_eq!(
                p.state(&id)["skill_state"]["error_count"],
                0,
                "{cli}, {kind}"
            );
        }
    });
}

#[test]
fn a_model_that_stops_answering_ends_in_the_idle_timeout_with_the_whole_tree() {
    for_each_cli(|cli, bin| {
        let a = AgentProject::new(
            cli,
            bin,
            fault("hang"),
            &format!("action_retries = 0\n[executors.{cli}]\nidle_timeout = 3.0\n"),
        );
        let p = &a.project;
        let id = p.create(&["--title", "t", "--max-errors", "1"]);
        let out = a.run(&id);
        assert_eq!(code(&out), 4, "{cli}: {}", stderr(&out));
        let failed: Vec<_> = p
            .events(&id)
            .into_iter()
            .filter(|e| e["event"] == "action_failed")
            .collect();
        assert_eq!(failed.len(), 1, "{cli}: {failed:?}");
        assert_eq!(failed[0]["outcome"], "timeout", "{cli}: {}", failed[0]);
        assert_eq!(failed[0]["error"], "no output for 3s", "{cli}");
        let left = processes_of(&p.state_path(&id));
        assert!(left.is_empty(), "{cli}: left behind:{}", described(&left));
    });
}

/// The default command line of `cli`, from the built-in config.
fn default_argv(cli: &str) -> Vec<String> {
    let config: toml::Table = toml::from_str(include_str!("../config.toml")).unwrap();
    config["executors"][cli]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect()
}

/// Captures what each real CLI prints, run as loopd runs it, for `tests/fixtures/agents/real/`:
/// `LOOPD_CAPTURE=1 cargo test --test real_agents capture -- --ignored`. Each case is the
/// transcript (stdout and stderr as they came, one file each) and its exit code.
#[test]
#[ignore = "writes fixtures; run by hand after a CLI upgrade"]
fn capture_fixtures_from_the_real_clis() {
    let Some(bin) = agents_bin() else { return };
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agents/real");
    std::fs::create_dir_all(&out_dir).unwrap();
    let versions: serde_json::Map<String, Value> =
        serde_json::from_str::<Value>(include_str!("agents/package.json")).unwrap()["dependencies"]
            .as_object()
            .unwrap()
            .clone();
    for cli in CLIS {
        let package = match cli {
            "claude" => "@anthropic-ai/claude-code",
            "codex" => "@openai/codex",
            "gemini" => "@google/gemini-cli",
            _ => "@qwen-code/qwen-code",
        };
        let version = versions[package].as_str().unwrap();
        for (case, kind, key) in [
            ("success", "none", true),
            ("no-key", "none", false),
            ("rejected-key", "401", true),
            ("rate-limit", "429", true),
        ] {
            // Gemini CLI and Qwen Code retry a rate limit on their own for minutes, saying
            // nothing: there is no transcript of it to capture.
            if case == "rate-limit" && matches!(cli, "gemini" | "qwen") {
                continue;
            }
            let root = tempfile::tempdir().unwrap();
            let home = tempfile::tempdir().unwrap();
            let server = ModelServer::start(root.path(), home.path(), &fault(kind));
            let mut argv = default_argv(cli);
            argv[0] = bin.join(cli).display().to_string();
            let mut child: Running = Command::new(&argv[0])
                .args(&argv[1..])
                .current_dir(root.path())
                .env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .envs(cli_env(cli, server.port, home.path(), key))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
                .into();
            use std::io::Write as _;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(b"You are the develop step of an autonomous development loop run by loopd.\n# Your task now: task-001\n")
                .unwrap();
            let out = wait_output(child, std::time::Duration::from_secs(120));
            let file = |ext: &str| out_dir.join(format!("{cli}-{version}-{case}.{ext}"));
            std::fs::write(file("stdout"), &out.stdout).unwrap();
            std::fs::write(file("stderr"), &out.stderr).unwrap();
            let exit = out.status.code().unwrap_or(-1);
            std::fs::write(file("exit"), format!("{exit}\n")).unwrap();
            eprintln!("{cli} {case}: exit {:?}", out.status.code());
            drop(server);
        }
    }
}

#[test]
fn doctor_shows_each_real_cli_its_version_flags_and_login() {
    for_each_cli(|cli, bin| {
        for key in [true, false] {
            let a = AgentProject::with_key(cli, bin, NO_FAULT, "", key);
            let out = a.loopd().arg("doctor").output().unwrap();
            let text = stdout(&out);
            assert_eq!(code(&out), 0, "{cli}: {text}{}", stderr(&out));
            let lines: Vec<&str> = text.lines().collect();
            let at = lines
                .iter()
                .position(|l| l.trim_start().starts_with(&format!("{cli} ")))
                .unwrap_or_else(|| panic!("{cli}: {text}"));
            let version = match cli {
                "claude" => "2.1.197",
                "codex" => "0.169.0",
                "gemini" => "0.61.0",
                _ => "0.15.10",
            };
            assert!(lines[at].contains(version), "{cli}: {}", lines[at]);
            assert!(
                lines[at + 1].contains(&default_argv(cli)[1..].join(" ")),
                "{text}"
            );
            let login = lines[at + 2];
            if key {
                assert!(login.contains("_API_KEY is set"), "{cli}: {login}");
            } else {
                assert!(login.contains("login: none found"), "{cli}: {login}");
            }
            assert!(
                !text.contains("sk-scripted"),
                "{cli}: a secret printed: {text}"
            );
        }
    });
}
