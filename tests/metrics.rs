//! loopd's metrics as an operator reads them: a real Prometheus server scrapes `loopd serve`
//! (behind its token) and `loopd worker --metrics` while loops run, `promtool check metrics` finds
//! nothing to say of the exposition, and the query API counts what the loops did.

mod common;

use common::prometheus::{Prometheus, Target, lint, prometheus_bin};
use common::{Project, code, stderr, wait_for};

/// An agent that speaks Claude Code's stream (`claude-stream-json`): each attempt reports 100
/// input and 10 output tokens and $0.25; it plans one task, develops it, passes validation.
const METERED_AGENT: &str = r#"cat > /dev/null
case "$LOOPD_ACTION" in
  init) r='{\"status\":\"success\",\"state_updates\":{\"tasks\":[{\"description\":\"one\"}]}}' ;;
  develop) echo x >> f.txt; r='{\"status\":\"success\",\"files_changed\":[\"f.txt\"]}' ;;
  validate) r='{\"status\":\"success\",\"state_updates\":{\"passed\":true,\"pass_rate\":100}}' ;;
  *) r='{\"status\":\"success\"}' ;;
esac
printf '{"type":"result","subtype":"success","is_error":false,"result":"```json\\n%s\\n```","total_cost_usd":0.25,"usage":{"input_tokens":100,"output_tokens":10}}\n' "$r"
"#;

/// Its config: the agent as executor `meter` of account `team`.
const METERED_CONFIG: &str = r#"
retry_backoff = 0.01
executor = "meter"

[executor_defaults]
kill_grace = 0.5

[executors.meter]
command = ["sh", "bin/agent.sh"]
prompt = "stdin"
format = "claude-stream-json"
account = "team"
"#;

/// The actions of one loop of [`METERED_AGENT`]: init, develop, validate, complete.
const ACTIONS_PER_LOOP: f64 = 4.0;

#[test]
fn prometheus_scrapes_the_service_and_counts_its_actions_and_tokens() {
    let Some(bin) = prometheus_bin() else { return };
    let p = Project::new(METERED_AGENT);
    p.config(METERED_CONFIG);
    let service = p.serve(&[
        "--root",
        &p.root.display().to_string(),
        "--listen",
        "127.0.0.1:0",
    ]);
    let info = service.info().expect("the service's info");
    let addr = info["listen"].as_str().expect("listen").to_owned();
    let token = p.home.join(".local/state/loopd/run/token");
    let prometheus = Prometheus::start(
        &bin,
        &p.root.join(".loop/test-prometheus"),
        &[Target {
            job: "loopd-serve",
            address: &addr,
            token: Some(&token),
        }],
    );
    let ids: Vec<String> = (0..2)
        .map(|i| {
            let id = p.create(&["--title", &format!("metered {i}")]);
            let out = p.output(&["start", &id]);
            assert_eq!(code(&out), 0, "start: {}", stderr(&out));
            id
        })
        .collect();
    for id in &ids {
        wait_for("the loop to complete", || {
            p.state(id)["status"] == "completed"
        });
    }
    let loops = ids.len() as f64;
    let sum = |q: &str| prometheus.value(&format!("sum({q})"));
    wait_for("Prometheus to count every action and token", || {
        sum("loopd_actions_finished_total{outcome=\"success\",executor=\"meter\"}")
            == Some(loops * ACTIONS_PER_LOOP)
            && sum("loopd_tokens_total{account=\"team\"}") == Some(loops * ACTIONS_PER_LOOP * 110.0)
            && sum("loopd_loops{status=\"completed\"}") == Some(loops)
    });
    assert_eq!(
        sum("loopd_actions_started_total{workflow=\"ccw-loop\"}"),
        Some(loops * ACTIONS_PER_LOOP)
    );
    assert_eq!(
        sum("loopd_tokens_total{kind=\"output\"}"),
        Some(loops * ACTIONS_PER_LOOP * 10.0)
    );
    assert_eq!(
        sum("loopd_cost_dollars_total{executor=\"meter\",account=\"team\"}"),
        Some(loops * ACTIONS_PER_LOOP * 0.25)
    );
    assert_eq!(
        sum("loopd_action_duration_seconds_count{action=\"develop\"}"),
        Some(loops)
    );
    assert!(prometheus.all_up());
    // The exposition as the service serves it: nothing for promtool to say; and the token is
    // asked for.
    let to = common::http::To::Tcp(&addr, None);
    let (status, _) = common::http::fetch(&to, "GET", "/metrics", None, &[]);
    assert_eq!(status, 401, "metrics without the token");
    let token = std::fs::read_to_string(&token).expect("the token");
    let to = common::http::To::Tcp(&addr, Some(token.trim()));
    let (status, text) = common::http::fetch(&to, "GET", "/metrics", None, &[]);
    assert_eq!(status, 200, "{text}");
    assert_eq!(lint(&bin, &text), "", "promtool on:\n{text}");
}

#[cfg(feature = "temporal")]
#[test]
fn prometheus_scrapes_a_worker_its_sdks_metrics_and_loopds() {
    use common::temporal::{Temporal, free_port, temporal_bin};
    let (Some(bin), Some(temporal_bin)) = (prometheus_bin(), temporal_bin()) else {
        return;
    };
    let p = Project::new(METERED_AGENT);
    p.config(METERED_CONFIG);
    let mut temporal = Temporal::start(&p, &temporal_bin);
    let metrics = format!("127.0.0.1:{}", free_port());
    temporal.worker_with(&p, "w0", |cmd| {
        cmd.args(["--metrics", &metrics]);
    });
    let prometheus = Prometheus::start(
        &bin,
        &p.root.join(".loop/test-prometheus"),
        &[Target {
            job: "loopd-worker",
            address: &metrics,
            token: None,
        }],
    );
    let id = temporal.create(&p, &["--title", "metered on temporal"]);
    temporal.wait_for_status(&p, &id, "completed");
    let sum = |q: &str| prometheus.value(&format!("sum({q})"));
    wait_for(
        "Prometheus to count the worker's actions and tokens",
        || {
            sum("loopd_actions_finished_total{outcome=\"success\"}") == Some(ACTIONS_PER_LOOP)
            && sum("loopd_tokens_total{executor=\"meter\"}") == Some(ACTIONS_PER_LOOP * 110.0)
            // The SDK's own, as Temporal's dashboards know them.
            && sum("temporal_activity_execution_latency_seconds_count{activity_type=\"LoopActivities::attempt\"}")
                == Some(ACTIONS_PER_LOOP)
        },
    );
    assert!(prometheus.all_up());
    let (status, text) = common::http::fetch(
        &common::http::To::Tcp(&metrics, None),
        "GET",
        "/metrics",
        None,
        &[],
    );
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("temporal_worker_task_slots_available"),
        "{text}"
    );
    assert_eq!(lint(&bin, &text), "", "promtool on:\n{text}");
}
