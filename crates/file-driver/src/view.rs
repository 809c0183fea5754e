//! A loop as people see it: the view model `status` and `list` render (and an API will). The
//! engine's rows first (status, iteration, errors, what runs or waits), then the workflow's own
//! ([`loopd_core::workflow::Workflow::view`]), then how the loop ended and what to do next.

use loopd_core::state::{LoopState, SkillState, Status};
use loopd_core::still::Still;
use loopd_core::workflow::Row;
use serde::Serialize;

use crate::project::{Project, loop_workflow};
use crate::service::{LoopKey, ServiceInfo};

/// A loop, as `status` and `list` show it.
#[derive(Clone, Debug, Serialize)]
pub struct LoopView {
    pub loop_id: String,
    pub title: String,
    pub workflow: String,
    /// How the loop stands, in a few words (`running`, `passed`, `failed: ...`, `running (no
    /// daemon)`).
    pub standing: String,
    pub daemon_pid: Option<u32>,
    /// Where the loop waits in a service's queue (1 is next), if it does.
    pub queued: Option<usize>,
    pub iteration: u64,
    pub max_iterations: u64,
    /// The action in flight and how long it has run.
    pub action: Option<String>,
    /// The workflow's measure of progress.
    pub progress: String,
    /// What its agents spent.
    pub spent: Spent,
    /// Why it stands still, when it does ([`Still`]), and what moves it on.
    pub status_reason: Option<String>,
    pub next_step: Option<String>,
    /// Every row of `status`, in order.
    pub rows: Vec<Row>,
}

/// Tokens and dollars a loop's agents spent: overall, and today (UTC).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Spent {
    pub tokens: u64,
    pub cost_usd: f64,
    pub today_tokens: u64,
    pub today_cost_usd: f64,
}

impl Spent {
    /// What a loop spent, `today` being `YYYY-MM-DD` (UTC).
    pub fn of(s: &LoopState, today: &str) -> Spent {
        let Some(usage) = s.skill_state.as_ref().map(|k| &k.usage) else {
            return Spent::default();
        };
        let (today_tokens, today_cost_usd) = usage.on(today);
        Spent {
            tokens: usage.tokens(),
            cost_usd: usage.cost_usd,
            today_tokens,
            today_cost_usd,
        }
    }

    /// The sum of two loops' spending.
    pub fn plus(self, other: Spent) -> Spent {
        Spent {
            tokens: self.tokens.saturating_add(other.tokens),
            cost_usd: self.cost_usd + other.cost_usd,
            today_tokens: self.today_tokens.saturating_add(other.today_tokens),
            today_cost_usd: self.today_cost_usd + other.today_cost_usd,
        }
    }
}

/// Today's date as the spending is kept (`YYYY-MM-DD`, UTC).
pub fn today() -> String {
    chrono::Utc::now().format("%Y-%m-%d").to_string()
}

/// A number of tokens as people read it: `950`, `12.3k`, `4.56M`.
pub fn tokens(n: u64) -> String {
    let f = n as f64;
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}k", f / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2}M", f / 1e6),
        _ => format!("{:.2}G", f / 1e9),
    }
}

impl LoopView {
    /// The view of a loop; `service` is the running service, if one runs, which may queue it.
    pub fn of(p: &Project, s: &LoopState, service: Option<&ServiceInfo>) -> LoopView {
        let daemon_pid = crate::locks::daemon_pid(&p.store, &s.loop_id);
        let key = LoopKey {
            root: p.root.clone(),
            loop_id: s.loop_id.clone(),
        };
        let queued = service.and_then(|service| service.queue_position(&key));
        let skill = s.skill_state.clone().unwrap_or_default();
        let workflow = loop_workflow(p, s).ok();
        let wf_view = workflow.map(|w| w.view(s));
        let max_iterations = s.max_iterations_or(p.config.max_iterations);
        let action = skill.in_flight.as_ref().or(skill.lanes.first()).map(|f| {
            let age = loopd_core::state::parse_ts(&f.started_at)
                .map(|t| format!(" {}", age(chrono::Utc::now() - t)))
                .unwrap_or_default();
            match skill.lanes.len() {
                0 | 1 => format!("{}{age}", f.action),
                n => format!("{} x{n}{age}", f.action),
            }
        });
        let behind = service.and_then(|service| service.waits_behind(&key));
        let standing = match (queued, behind) {
            (Some(n), _) if daemon_pid.is_none() => format!("queued ({n})"),
            (_, Some(other)) if daemon_pid.is_none() && s.status == Status::Running => {
                format!("queued behind {other}")
            }
            _ => standing(s, daemon_pid),
        };
        let refused = service.and_then(|v| v.refused.iter().find(|r| r.key == key));
        // Its own reason first where a daemon drives it; else what the service knows comes first.
        let own = s.still();
        let still = match (queued, behind, refused) {
            _ if daemon_pid.is_some() => own,
            (Some(n), _, _) => Some(Still::new(
                format!(
                    "queued: {n} in line; the service runs at most {} loops at once",
                    service.map_or(0, |v| v.running.len())
                ),
                "nothing: the service starts it when a place is free",
            )),
            (_, Some(other), _) if s.status == Status::Running => Some(Still::new(
                format!("waiting for loop {other}, which runs in its work tree"),
                format!("nothing: it starts when {other} ends or pauses"),
            )),
            (_, _, Some(refused)) if s.status == Status::Running => Some(Still::new(
                format!("the service cannot take it: {}", refused.reason),
                "fix that; the service tries again at the next change of its state file",
            )),
            _ if s.status == Status::Running && service.is_none() && own.is_none() => {
                Some(Still::new(
                    "running, but nothing drives it",
                    format!(
                        "nothing drives it: `loopd start {}` picks it up where it was",
                        s.loop_id
                    ),
                ))
            }
            _ => own,
        };
        let mut rows = engine_rows(p, s, &skill, &standing, daemon_pid);
        // A loop set to run that the service could not take says why.
        if let Some(refused) = refused {
            rows.insert(
                1,
                row("service", format!("cannot take it: {}", refused.reason)),
            );
        }
        if let Some(still) = &still {
            rows.insert(1, row("why", still.reason.clone()));
        }
        rows.extend(wf_view.as_ref().map(|v| v.rows.clone()).unwrap_or_default());
        rows.extend(ending_rows(p, s, &skill, still.as_ref()));
        LoopView {
            loop_id: s.loop_id.clone(),
            title: s.title.clone(),
            workflow: workflow.map_or_else(
                || skill.workflow.clone().unwrap_or_default(),
                |w| w.name().to_owned(),
            ),
            standing,
            daemon_pid,
            queued,
            iteration: s.current_iteration,
            max_iterations,
            action,
            progress: wf_view.map(|v| v.progress).unwrap_or_default(),
            spent: Spent::of(s, &today()),
            status_reason: still.as_ref().map(|w| w.reason.clone()),
            next_step: still.map(|w| w.next),
            rows,
        }
    }
}

fn row(label: &'static str, value: String) -> Row {
    Row {
        label,
        value,
        lines: Vec::new(),
    }
}

/// Status, iteration, errors, and what the loop does or waits for.
fn engine_rows(
    p: &Project,
    s: &LoopState,
    skill: &SkillState,
    standing: &str,
    daemon_pid: Option<u32>,
) -> Vec<Row> {
    let id = &s.loop_id;
    let daemon = match daemon_pid {
        Some(pid) => format!(" (daemon pid {pid})"),
        None if standing.ends_with("(no daemon)") || standing.starts_with("queued") => {
            String::new()
        }
        None => " (no daemon)".to_owned(),
    };
    let max_iter = s.max_iterations_or(p.config.max_iterations);
    let mut rows = vec![
        row("status", format!("{standing}{daemon}")),
        row(
            "iteration",
            format!(
                "{}/{max_iter}  {}",
                s.current_iteration,
                bar(s.current_iteration, max_iter)
            ),
        ),
        row(
            "errors",
            format!(
                "{}/{}",
                skill.error_count,
                s.max_errors_or(p.config.max_errors)
            ),
        ),
    ];
    if let Some(reason) = &s.failure_reason {
        rows.push(row("reason", reason.clone()));
    }
    if let Some(w) = &skill.worktree {
        let value = format!("{} (branch {})", w.path.display(), w.branch);
        rows.push(row("worktree", value));
    }
    if let Some(q) = &skill.question {
        let answer = match &q.answer {
            Some(a) => format!(" — answered: {a}"),
            None => String::new(),
        };
        rows.push(row("question", format!("{}: {}{answer}", q.action, q.text)));
    }
    if let Some(b) = &skill.blocked {
        let value = format!(
            "{}: {} — fix it, then `loopd resume {id}`",
            b.executor, b.reason
        );
        rows.push(row("blocked", value));
    }
    if let Some(stalled) = skill.no_progress.as_ref().and_then(|n| n.paused.as_ref()) {
        let value = format!(
            "{} (since {}) — look at it, then `loopd resume {id}`",
            stalled.reason, stalled.since
        );
        rows.push(row("stalled", value));
    }
    if let Some(n) = skill.network.as_ref().filter(|n| n.refused > 0) {
        let value = format!(
            "{} refused by the sandbox (last: {} for {}, at {}); see `loopd logs {id}`",
            n.refused, n.last, n.action, n.at
        );
        rows.push(row("network", value));
    }
    // The attempt in flight, or each of a batch's.
    for f in skill.in_flight.iter().chain(&skill.lanes) {
        let task = f
            .task_id
            .as_deref()
            .map(|t| format!(" {t}"))
            .unwrap_or_default();
        let value = format!(
            "{}{task} attempt {} (pid {}, since {})",
            f.action, f.attempt, f.pid, f.started_at
        );
        rows.push(row("action", value));
    }
    if skill.in_flight.is_none()
        && skill.lanes.is_empty()
        && let Some(last) = &skill.last_action
    {
        rows.push(row("last", last.clone()));
    }
    if let Some(wait) = &skill.awaiting_choice {
        let value = format!(
            "for `loopd next {id} ACTION`: {} (suggested: {})",
            wait.choices.join(", "),
            wait.suggested.as_deref().unwrap_or("-")
        );
        rows.push(row("waiting", value));
    }
    rows
}

/// How the loop ended, its last errors, its files, and what to do next.
fn ending_rows(p: &Project, s: &LoopState, skill: &SkillState, still: Option<&Still>) -> Vec<Row> {
    let mut rows = Vec::new();
    if let Some(outcome) = &skill.outcome {
        rows.push(row("outcome", outcome.clone()));
    }
    for e in skill.errors.iter().rev().take(3) {
        let value = format!("{} {}: {}", e.timestamp, e.action, e.message);
        rows.push(row("error", value));
    }
    let files = p.store.progress_dir(&s.loop_id).display().to_string();
    rows.push(row("files", files));
    match still {
        Some(still) => rows.push(row("next", still.next.clone())),
        None if s.status == Status::Running => {
            let id = &s.loop_id;
            rows.push(row(
                "next",
                format!("watch it with `loopd logs {id} --follow`"),
            ));
        }
        None => {}
    }
    rows
}

fn bar(n: u64, max: u64) -> String {
    let width = 20;
    let filled = (n.min(max) * width).checked_div(max).unwrap_or(0) as usize;
    format!(
        "[{}{}]",
        "#".repeat(filled),
        ".".repeat(width as usize - filled)
    )
}

/// How a loop stands, in a few words: its status, what ended it, whether anything drives it.
pub fn standing(s: &LoopState, daemon: Option<u32>) -> String {
    match &s.status {
        Status::Running if daemon.is_none() => "running (no daemon)".to_owned(),
        _ => s.standing(),
    }
}

/// A duration as people read it: `42s`, `3m05s`, `2h10m`.
pub fn age(d: chrono::TimeDelta) -> String {
    let secs = d.num_seconds().max(0);
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, secs % 3600 / 60),
    }
}
