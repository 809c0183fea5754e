//! A real Prometheus server (Debian's `prometheus`, which `.ci/run` installs) that scrapes loopd's
//! metrics endpoints every second, on a free port of 127.0.0.1, its database in the test's
//! directory; and its query API.
//!
//! Where it is not installed the tests say so and pass, except in CI (`CI=true`), where they
//! must run. `LOOPD_PROMETHEUS` names the `prometheus` program (`promtool` beside it).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use super::http::{To, fetch};
use super::{Running, free_port, wait_for};

/// The `prometheus` program, or `None` (with a message) where it is not installed outside CI.
pub fn prometheus_bin() -> Option<PathBuf> {
    let bin = std::env::var_os("LOOPD_PROMETHEUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/prometheus"));
    if bin.exists() {
        return Some(bin);
    }
    super::not_installed("Prometheus", &bin, "apt-get install prometheus");
    None
}

/// What it scrapes: a job's name, its `HOST:PORT`, and the file of the bearer token it sends.
pub struct Target<'a> {
    pub job: &'a str,
    pub address: &'a str,
    pub token: Option<&'a Path>,
}

pub struct Prometheus {
    pub address: String,
    _server: Running,
}

impl Prometheus {
    /// Starts a server in `dir` that scrapes `targets` every second, and waits until it serves.
    pub fn start(bin: &Path, dir: &Path, targets: &[Target<'_>]) -> Prometheus {
        std::fs::create_dir_all(dir).expect("mkdir prometheus");
        let mut config = String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n");
        config.push_str("scrape_configs:\n");
        for t in targets {
            config.push_str(&format!(
                "  - job_name: {}\n    static_configs:\n      - targets: ['{}']\n",
                t.job, t.address
            ));
            if let Some(token) = t.token {
                config.push_str(&format!(
                    "    authorization:\n      credentials_file: {}\n",
                    token.display()
                ));
            }
        }
        let file = dir.join("prometheus.yml");
        std::fs::write(&file, config).expect("write prometheus.yml");
        let address = format!("127.0.0.1:{}", free_port());
        let server = Command::new(bin)
            .arg(format!("--config.file={}", file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .arg("--log.level=error")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).expect("its log"))
            .spawn()
            .expect("start prometheus");
        let prometheus = Prometheus {
            address,
            _server: server.into(),
        };
        wait_for("Prometheus to serve", || {
            prometheus
                .get("/-/ready")
                .is_some_and(|(status, _)| status == 200)
        });
        prometheus
    }

    /// `GET path`; `None` while nothing listens.
    fn get(&self, path: &str) -> Option<(u16, String)> {
        std::net::TcpStream::connect(&self.address).ok()?;
        Some(fetch(&To::Tcp(&self.address, None), "GET", path, None, &[]))
    }

    /// The value of an instant query whose answer is one number (`sum(...)`), when it has one.
    pub fn value(&self, query: &str) -> Option<f64> {
        let (status, body) = self.get(&format!("/api/v1/query?query={}", encode(query)))?;
        assert_eq!(status, 200, "{query}: {body}");
        let answer: Value = serde_json::from_str(&body).expect("JSON");
        answer["data"]["result"][0]["value"][1]
            .as_str()?
            .parse()
            .ok()
    }

    /// Whether every target's last scrape succeeded.
    pub fn all_up(&self) -> bool {
        self.get("/api/v1/targets").is_some_and(|(_, body)| {
            let targets: Value = serde_json::from_str(&body).unwrap_or_default();
            let active = targets["data"]["activeTargets"].as_array().cloned();
            active.is_some_and(|a| !a.is_empty() && a.iter().all(|t| t["health"] == "up"))
        })
    }
}

/// `promtool check metrics` over `text`: its complaints, empty when it has none.
pub fn lint(bin: &Path, text: &str) -> String {
    use std::io::Write as _;
    let mut promtool = Command::new(bin.with_file_name("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start promtool");
    promtool
        .stdin
        .take()
        .expect("its stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = promtool.wait_with_output().expect("promtool's output");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    match out.status.success() {
        true => said.trim().to_owned(),
        false if said.trim().is_empty() => format!("promtool failed: {}", out.status),
        false => said.trim().to_owned(),
    }
}

/// `query` as a URL's query value.
fn encode(query: &str) -> String {
    query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}
