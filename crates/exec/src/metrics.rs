//! loopd's own metrics, in Prometheus' text format: what its attempts did and cost, how long a
//! pause or stop took to end one, what the sandbox refused, what a fleet's git took. One registry
//! per process, recorded by whichever driver runs the attempts (the file driver under `loopd run`
//! and `loopd serve`, a Temporal worker) and served by `loopd serve` (`/metrics`) and by
//! `loopd worker --metrics ADDR`.
//!
//! Names and labels follow Prometheus' conventions: counters end in `_total`, durations are
//! seconds; no label takes a loop id, a task or a path, so a series' count stays bounded by the
//! workflows, actions, executors and accounts of the config.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus::{
    CounterVec, Encoder as _, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

/// Seconds an action may take: from a shell command's milliseconds to an agent's hour.
const ACTION_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];
/// Seconds from a control write to the executor gone: milliseconds, else a kill grace.
const STOP_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Seconds of a fleet's git fetch or push.
const GIT_BUCKETS: &[f64] = &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// The metrics of this process.
pub struct Metrics {
    registry: Registry,
    actions_started: IntCounterVec,
    actions_finished: IntCounterVec,
    action_seconds: HistogramVec,
    tokens: IntCounterVec,
    cost: CounterVec,
    loops: IntGaugeVec,
    stop_seconds: Histogram,
    sandbox_refusals: IntCounterVec,
    git_seconds: HistogramVec,
    git_failures: IntCounterVec,
    rate_limit_waits: IntCounterVec,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The metrics of this process.
pub fn metrics() -> &'static Metrics {
    &METRICS
}

impl Metrics {
    fn new() -> Metrics {
        let registry = Registry::new();
        fn add<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            r.register(Box::new(c.clone()))
                .expect("each of loopd's metrics is registered once");
            c
        }
        let counter = |name: &str, help: &str, labels: &[&str]| {
            add(
                &registry,
                IntCounterVec::new(Opts::new(name, help), labels).expect("a counter"),
            )
        };
        let histogram = |name: &str, help: &str, buckets: &[f64], labels: &[&str]| {
            let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
            add(
                &registry,
                HistogramVec::new(opts, labels).expect("a histogram"),
            )
        };
        let by_action = ["workflow", "action", "executor"];
        let finished = ["workflow", "action", "executor", "outcome"];
        let spender = ["executor", "account"];
        Metrics {
            actions_started: counter(
                "loopd_actions_started_total",
                "Attempts of actions started.",
                &by_action,
            ),
            actions_finished: counter(
                "loopd_actions_finished_total",
                "Attempts of actions ended, by outcome (success, failure, rate_limited, \
                 interrupted, ...).",
                &finished,
            ),
            action_seconds: histogram(
                "loopd_action_duration_seconds",
                "How long an attempt of an action ran.",
                ACTION_BUCKETS,
                &["workflow", "action", "outcome"],
            ),
            tokens: counter(
                "loopd_tokens_total",
                "Tokens agents reported, by kind (input, output, cached).",
                &["executor", "account", "kind"],
            ),
            cost: add(
                &registry,
                CounterVec::new(
                    Opts::new(
                        "loopd_cost_dollars_total",
                        "Dollars agents reported spending.",
                    ),
                    &spender,
                )
                .expect("a counter"),
            ),
            loops: add(
                &registry,
                IntGaugeVec::new(
                    Opts::new("loopd_loops", "Loops this process serves, by status."),
                    &["status"],
                )
                .expect("a gauge"),
            ),
            stop_seconds: add(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "loopd_control_to_executor_gone_seconds",
                        "From a pause or stop written to the interrupted executor gone.",
                    )
                    .buckets(STOP_BUCKETS.to_vec()),
                )
                .expect("a histogram"),
            ),
            sandbox_refusals: counter(
                "loopd_sandbox_refusals_total",
                "Connections the sandbox's proxy refused an attempt.",
                &["action", "executor"],
            ),
            git_seconds: histogram(
                "loopd_fleet_git_seconds",
                "How long a worker's git fetch or push of a loop's work tree took.",
                GIT_BUCKETS,
                &["operation"],
            ),
            git_failures: counter(
                "loopd_fleet_git_failures_total",
                "A worker's git fetches and pushes that failed.",
                &["operation"],
            ),
            rate_limit_waits: counter(
                "loopd_rate_limit_waits_total",
                "Waits for an account's rate limit before an attempt.",
                &spender,
            ),
            registry,
        }
    }

    /// An attempt of `action` started.
    pub fn attempt_started(&self, workflow: &str, action: &str, executor: &str) {
        self.actions_started
            .with_label_values(&[workflow, action, executor])
            .inc();
    }

    /// An attempt ended with `outcome`, after `run`'s time and spending.
    pub fn attempt_finished(&self, attempt: &Attempt<'_>, outcome: &str, run: &crate::Run) {
        let Attempt {
            workflow,
            action,
            executor,
            account,
        } = *attempt;
        self.actions_finished
            .with_label_values(&[workflow, action, executor, outcome])
            .inc();
        self.action_seconds
            .with_label_values(&[workflow, action, outcome])
            .observe(run.duration.as_secs_f64());
        if !run.network_refused.is_empty() {
            self.sandbox_refusals
                .with_label_values(&[action, executor])
                .inc_by(run.network_refused.len() as u64);
        }
        if let Some(agent) = &run.agent {
            let usage = &agent.usage;
            for (kind, n) in [
                ("input", usage.input_tokens),
                ("output", usage.output_tokens),
                ("cached", usage.cache_read_tokens + usage.cache_write_tokens),
            ] {
                self.tokens
                    .with_label_values(&[executor, account, kind])
                    .inc_by(n);
            }
            if let Some(cost) = agent.cost_usd.filter(|c| c.is_finite() && *c > 0.0) {
                self.cost
                    .with_label_values(&[executor, account])
                    .inc_by(cost);
            }
        }
    }

    /// An attempt was ended by a pause or stop written `after` ago.
    pub fn stopped(&self, after: Duration) {
        self.stop_seconds.observe(after.as_secs_f64());
    }

    /// An attempt waited for its account's rate limit.
    pub fn rate_limit_wait(&self, executor: &str, account: &str) {
        self.rate_limit_waits
            .with_label_values(&[executor, account])
            .inc();
    }

    /// A fleet's git `operation` (`fetch`, `push`) took `took`, and failed or not.
    pub fn git(&self, operation: &str, took: Duration, failed: bool) {
        self.git_seconds
            .with_label_values(&[operation])
            .observe(took.as_secs_f64());
        if failed {
            self.git_failures.with_label_values(&[operation]).inc();
        }
    }

    /// The loops this process serves: how many of each status, as now.
    pub fn set_loops<'a>(&self, statuses: impl IntoIterator<Item = &'a str>) {
        self.loops.reset();
        for status in statuses {
            self.loops.with_label_values(&[status]).inc();
        }
    }

    /// Every metric, in Prometheus' text format (version 0.0.4).
    pub fn encode(&self) -> String {
        let mut text = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut text)
            .expect("the text format takes any metric");
        String::from_utf8(text).expect("the text format is UTF-8")
    }
}

/// The content type of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Which attempt a metric counts: the labels every driver knows.
#[derive(Clone, Copy, Debug)]
pub struct Attempt<'a> {
    pub workflow: &'a str,
    pub action: &'a str,
    pub executor: &'a str,
    /// The account it spends (empty: the executor's own).
    pub account: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_names_each_metric_once_with_its_type() {
        let m = Metrics::new();
        m.attempt_started("ccw-loop", "develop", "claude");
        m.stopped(Duration::from_millis(30));
        m.git("push", Duration::from_millis(200), true);
        m.set_loops(["running", "running", "paused"]);
        let text = m.encode();
        for line in [
            "# TYPE loopd_actions_started_total counter",
            "loopd_actions_started_total{action=\"develop\",executor=\"claude\",workflow=\"ccw-loop\"} 1",
            "# TYPE loopd_control_to_executor_gone_seconds histogram",
            "loopd_control_to_executor_gone_seconds_count 1",
            "loopd_fleet_git_failures_total{operation=\"push\"} 1",
            "loopd_loops{status=\"running\"} 2",
            "loopd_loops{status=\"paused\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        m.set_loops(["completed"]);
        let text = m.encode();
        assert!(!text.contains("status=\"running\""), "{text}");
    }
}
