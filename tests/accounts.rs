//! Rate limits of an account in the service (docs/spend.md, "Rate limits of an account"), through the
//! real binary: when one loop's agent is refused until a reset time, the service's other loops of
//! that account start no attempt before it, and say why; a loop of another account goes on.

mod common;

use common::*;

/// A Claude Code stand-in that shares one rate limit among every loop that uses it (through the
/// directory `SHARED`): the first call sets the reset (`RESET_IN` seconds on), and every call
/// before it is refused with that reset, as the real CLI reports a usage limit. Each call is
/// logged in `SHARED/calls.log` with its loop, the time (ns), and whether it was refused.
const SHARED_LIMIT: &str = r#"cat > /dev/null
if mkdir SHARED/reset.d 2>/dev/null; then echo $(( $(date +%s) + RESET_IN )) > SHARED/reset.d/at.tmp && mv SHARED/reset.d/at.tmp SHARED/reset.d/at; fi
while [ ! -s SHARED/reset.d/at ]; do sleep 0.01; done
reset=$(cat SHARED/reset.d/at)
now=$(date +%s%N)
if [ "$(date +%s)" -lt "$reset" ]; then
  echo "$LOOPD_LOOP_ID $now refused" >> SHARED/calls.log
  echo '{"type":"result","subtype":"success","is_error":true,"result":"Claude AI usage limit reached|'$reset'"}'
  exit 1
fi
echo "$LOOPD_LOOP_ID $now ok" >> SHARED/calls.log
sed 's/greeting_written/passed/g' 'FIXTURE'
"#;

const ACCOUNT_CONFIG: &str = r#"
retry_backoff = 0.01
executor = "claude"

[executor_defaults]
kill_grace = 0.5
final_grace = 0.3

[executors.claude]
command = ["sh", "bin/claude"]
account = "team"
# The stand-in's shared limit lives in the first project: the other's sandbox lets it write there.
sandbox_writable = ["SHARED"]
"#;

/// `(loop, time in ns, refused)` of every call of the stand-in.
fn calls(p: &Project) -> Vec<(String, u128, bool)> {
    std::fs::read_to_string(p.root.join("calls.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let w: Vec<&str> = l.split(' ').collect();
            (w[0].to_owned(), w[1].parse().unwrap(), w[2] == "refused")
        })
        .collect()
}

#[test]
fn a_rate_limit_holds_the_loops_of_its_account_and_no_other() {
    // Two projects whose agents spend one account (loops of one project take turns in its work
    // tree), and a third whose plain executor spends another.
    let a = Project::new("");
    let c = Project::beside(&a, "");
    let fixture = format!(
        "{}/tests/fixtures/agents/claude-success.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    let agent = SHARED_LIMIT
        .replace("RESET_IN", "10")
        .replace("FIXTURE", &fixture)
        .replace("SHARED", a.root.to_str().unwrap());
    let config = ACCOUNT_CONFIG.replace("SHARED", a.root.to_str().unwrap());
    for p in [&a, &c] {
        p.config(&config);
        p.script("claude", &agent);
    }
    let b = Project::beside(&a, GOOD_AGENT);
    let first = a.create(&["--title", "first", "--task", "one"]);
    let second = c.create(&["--title", "second", "--task", "one"]);
    let other = b.create(&["--title", "other"]);
    let roots: Vec<&str> = [&a, &b, &c]
        .iter()
        .flat_map(|p| ["--root", p.root.to_str().unwrap()])
        .collect();
    let service = a.serve(&roots);

    // The first loop is refused, with a reset time.
    assert!(a.output(&["start", &first]).status.success());
    wait_for("the first rate limit", || {
        !a.events_named(&first, "rate_limited").is_empty()
    });
    let reset: i64 = std::fs::read_to_string(a.root.join("reset.d/at"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let until = a.events_named(&first, "rate_limited")[0]["until"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        chrono::DateTime::parse_from_rfc3339(&until)
            .unwrap()
            .timestamp(),
        reset,
        "{until}"
    );

    // The second loop of the account waits for that reset instead of trying; the other
    // account's loop goes on.
    assert!(c.output(&["start", &second]).status.success());
    assert!(b.output(&["start", &other]).status.success());
    wait_for("the second loop to wait for the account", || {
        !c.events_named(&second, "rate_limited").is_empty()
    });
    let held = &c.events_named(&second, "rate_limited")[0];
    assert_eq!(held["account"], "team", "{held}");
    assert_eq!(held["until"], until.as_str(), "{held}");
    let listed = stdout(&c.output(&["list"]));
    let row = listed.lines().find(|l| l.contains(&second)).unwrap();
    assert!(
        row.contains(&format!("waiting: rate limit of team until {until}")),
        "{listed}"
    );
    wait_for("the other account's loop to complete", || {
        b.state(&other)["status"] == "completed"
    });

    wait_for("both loops of the account to complete", || {
        a.state(&first)["status"] == "completed" && c.state(&second)["status"] == "completed"
    });
    // The second loop never called the agent before the reset: only the first was refused.
    let reset_ns = u128::try_from(reset).unwrap() * 1_000_000_000;
    for (id, at, refused) in calls(&a) {
        if id == second {
            assert!(
                !refused && at >= reset_ns,
                "{second} called at {at} < {reset_ns}"
            );
        }
    }
    assert_eq!(
        calls(&a).iter().filter(|(_, _, refused)| *refused).count(),
        1,
        "{:?}",
        calls(&a)
    );
    for state in [a.state(&first), c.state(&second)] {
        assert_eq!(state["skill_state"]["error_count"], 0, "{state}");
        assert!(state["skill_state"]["rate_limit"].is_null(), "{state}");
    }
    // The other loop was never held, and completed while the account was.
    assert!(b.events_named(&other, "rate_limited").is_empty());
    let completed = b.events_named(&other, "completed")[0]["ts"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        chrono::DateTime::parse_from_rfc3339(&completed)
            .unwrap()
            .timestamp()
            < reset,
        "{completed}"
    );
    // What the loops spent, per loop and for the project, today and overall.
    let state = a.state(&first);
    let usage = &state["skill_state"]["usage"];
    let tokens = usage_tokens(usage);
    let cost = usage["cost_usd"].as_f64().unwrap();
    assert!(tokens > 1000 && cost > 0.0, "{usage}");
    assert_eq!(usage["day"]["tokens"], tokens, "{usage}");
    let listed = stdout(&a.output(&["list"]));
    let row = listed.lines().find(|l| l.contains(&first)).unwrap();
    let shown = format!("{:.1}k  ${cost:.2}", tokens as f64 / 1e3);
    assert!(row.contains(&shown), "{shown} in {listed}");
    let footer = format!(
        "spent: today {:.1}k tokens, ${cost:.2} · overall {:.1}k tokens, ${cost:.2}",
        tokens as f64 / 1e3,
        tokens as f64 / 1e3
    );
    assert!(listed.lines().any(|l| l == footer), "{footer} in {listed}");
    drop(service);
}
