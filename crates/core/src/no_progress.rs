//! No-progress detection: a loop that goes round and round changing nothing is paused (or
//! failed) before it spends more.
//!
//! A round is an action that counts an iteration (ccw-loop's develop, debug and validate;
//! skill-tuning's verify). Each round leaves a [`Fingerprint`]: the workflow's measure of
//! progress, its last validation's outcome, and the last error with its numbers, paths and
//! hashes taken out; and the work tree either changed since the round before (a checkpoint with
//! files in it) or did not. A round that changed no file and left the fingerprint the round
//! before left is one more round without progress; [`check`] says when there were too many in a
//! row. Without git checkpoints the work tree is left out, and the reason says so.

use serde::{Deserialize, Serialize};

use crate::state::{Checkpoint, Fingerprint, LoopState, NoProgress, Stalled};
use crate::workflow::{Finish, Workflow};

/// What a loop that makes no progress for `rounds` rounds does (`rounds = 0`: nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    #[serde(default)]
    pub rounds: u64,
    #[serde(default)]
    pub then: Then,
}

/// `on_no_progress`: pause the loop for a person, or fail it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Then {
    #[default]
    Pause,
    Fail,
}

/// The longest normalised error kept in a fingerprint.
const SIGNATURE_MAX: usize = 200;

/// Failing tests named in a validation's fingerprint; more are counted.
pub const FAILING_NAMED: usize = 10;

/// An attempt recorded `checkpoint`: a round whose work tree changed made progress.
pub fn touched(state: &mut LoopState, checkpoint: Option<&Checkpoint>) {
    if checkpoint.is_some_and(|c| c.files > 0) {
        books(state).tree_changed = true;
    }
}

/// An action finished: when it ends a round, the round is compared with the one before.
/// `tree_tracked`: the work tree's checkpoints are recorded.
pub fn round(
    workflow: &dyn Workflow,
    state: &mut LoopState,
    action: &str,
    finish: &Finish,
    tree_tracked: bool,
) {
    if !workflow.counts_iteration(action) {
        return;
    }
    let progress = workflow.view(state).progress;
    let validation = workflow.validation(state);
    let books = books(state);
    let now = Fingerprint {
        progress,
        validation,
        // The last error stands until another replaces it: rounds of different actions (a
        // failing debug between validations) alternate, and one that succeeds changes nothing.
        error: match finish {
            Finish::Failed(message) => Some(signature(message)),
            Finish::Success(_) => books.fingerprint.as_ref().and_then(|f| f.error.clone()),
        },
        tree_tracked,
    };
    let same = !(tree_tracked && books.tree_changed) && books.fingerprint.as_ref() == Some(&now);
    books.rounds = if same { books.rounds + 1 } else { 0 };
    books.fingerprint = Some(now);
    books.tree_changed = false;
}

/// Why the loop is to stop for making no progress, if `rule` says it is.
pub fn check(state: &LoopState, rule: Rule) -> Option<String> {
    let books = state.skill_state.as_ref()?.no_progress.as_ref()?;
    if rule.rounds == 0 || books.rounds < rule.rounds {
        return None;
    }
    let fingerprint = books.fingerprint.as_ref()?;
    let mut same = vec![match fingerprint.tree_tracked {
        true => "no file changed".to_owned(),
        false => "the work tree left out (no git checkpoints)".to_owned(),
    }];
    same.push(format!("progress {}", fingerprint.progress));
    if let Some(validation) = &fingerprint.validation {
        same.push(format!("validation {validation}"));
    }
    if let Some(error) = &fingerprint.error {
        same.push(format!("error \"{error}\""));
    }
    Some(format!(
        "no progress in {} rounds: {}",
        books.rounds,
        same.join("; ")
    ))
}

/// The loop pauses for making no progress: why is kept until an action starts again, and the
/// count starts afresh.
pub fn pause(state: &mut LoopState, reason: String, now: &str) {
    let books = books(state);
    books.rounds = 0;
    books.paused = Some(Stalled {
        since: now.to_owned(),
        reason,
    });
}

/// An action starts (after a resume): the loop is no longer paused for making no progress.
pub fn resumed(state: &mut LoopState) {
    if let Some(books) = state
        .skill_state
        .as_mut()
        .and_then(|s| s.no_progress.as_mut())
    {
        books.paused = None;
    }
}

/// Why the loop is paused for making no progress, if it is.
pub fn paused(state: &LoopState) -> Option<&Stalled> {
    state
        .skill_state
        .as_ref()?
        .no_progress
        .as_ref()?
        .paused
        .as_ref()
}

/// An error message with what differs between two occurrences of the same error taken out:
/// paths (words with a `/`) become `<path>`, long hexadecimal words (hashes, ids) `<hex>`, and
/// runs of digits (counts, times, line numbers, pids) `#`. Bounded.
pub fn signature(message: &str) -> String {
    let words = message.split_whitespace().map(|word| {
        if word.contains('/') {
            return "<path>".to_owned();
        }
        let hex = word.trim_matches(|c: char| !c.is_ascii_alphanumeric());
        if hex.len() >= 7
            && hex.chars().all(|c| c.is_ascii_hexdigit())
            && hex.chars().any(|c| c.is_ascii_digit())
            && hex.chars().any(|c| c.is_ascii_alphabetic())
        {
            return word.replace(hex, "<hex>");
        }
        let mut out = String::with_capacity(word.len());
        for c in word.chars() {
            match c.is_ascii_digit() {
                true if out.ends_with('#') => {}
                true => out.push('#'),
                false => out.push(c),
            }
        }
        out
    });
    let mut signature = words.collect::<Vec<_>>().join(" ");
    if signature.len() > SIGNATURE_MAX {
        let mut end = SIGNATURE_MAX;
        while !signature.is_char_boundary(end) {
            end -= 1;
        }
        signature.truncate(end);
    }
    signature
}

fn books(state: &mut LoopState) -> &mut NoProgress {
    state
        .skill()
        .no_progress
        .get_or_insert_with(NoProgress::default)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workflow::ccw_loop::CcwLoop;

    const RULE: Rule = Rule {
        rounds: 3,
        then: Then::Pause,
    };

    fn failed(message: &str) -> Finish {
        Finish::Failed(message.to_owned())
    }

    fn checkpoint(files: u64) -> Checkpoint {
        Checkpoint {
            files,
            ..Checkpoint::default()
        }
    }

    #[test]
    fn an_error_signature_leaves_out_what_differs_between_occurrences() {
        let a = signature(
            "test failed at /tmp/x1/src/lib.rs:42 after 1.5s (pid 4242) in 3f2a9c1e 123456789",
        );
        let b =
            signature("test failed at /tmp/y2/src/lib.rs:7 after 12.25s (pid 17) in 0b7d33aa 5");
        assert_eq!(a, b);
        assert_eq!(a, "test failed at <path> after #.#s (pid #) in <hex> #");
        assert_ne!(a, signature("test failed at <path> after 1s: assertion"));
        assert!(signature(&"x".repeat(1000)).len() <= SIGNATURE_MAX);
        assert!(signature(&"é".repeat(1000)).len() <= SIGNATURE_MAX);
    }

    #[test]
    fn rounds_that_change_nothing_are_counted_and_reach_the_rule() {
        let mut state = LoopState::default();
        let fail = failed("validation failed: 2 of 5 tests");
        round(&CcwLoop, &mut state, "validate", &fail, true);
        for n in 1..=3 {
            assert_eq!(check(&state, RULE), None, "after {n} rounds");
            touched(&mut state, Some(&checkpoint(0)));
            round(&CcwLoop, &mut state, "debug", &fail, true);
        }
        let reason = check(&state, RULE).expect("three rounds without progress");
        assert!(
            reason.starts_with("no progress in 3 rounds: no file changed"),
            "{reason}"
        );
        assert!(
            reason.contains("error \"validation failed: # of # tests\""),
            "{reason}"
        );
        assert_eq!(
            check(&state, Rule { rounds: 0, ..RULE }),
            None,
            "0 turns it off"
        );
        assert_eq!(check(&state, Rule { rounds: 4, ..RULE }), None);
    }

    #[test]
    fn a_changed_file_or_a_new_error_is_progress_and_a_success_alone_is_not() {
        let mut state = LoopState::default();
        let fail = failed("boom 1");
        round(&CcwLoop, &mut state, "debug", &fail, true);
        round(&CcwLoop, &mut state, "debug", &fail, true);
        assert_eq!(state.skill().no_progress.as_ref().unwrap().rounds, 1);
        touched(&mut state, Some(&checkpoint(2)));
        round(&CcwLoop, &mut state, "debug", &fail, true);
        assert_eq!(
            state.skill().no_progress.as_ref().unwrap().rounds,
            0,
            "a file changed"
        );
        round(
            &CcwLoop,
            &mut state,
            "debug",
            &failed("another thing"),
            true,
        );
        assert_eq!(
            state.skill().no_progress.as_ref().unwrap().rounds,
            0,
            "a new error"
        );
        let ok = Finish::Success(serde_json::from_str(r#"{"status": "success"}"#).unwrap());
        round(&CcwLoop, &mut state, "validate", &ok, true);
        assert_eq!(
            state.skill().no_progress.as_ref().unwrap().rounds,
            1,
            "the error stands"
        );
        round(&CcwLoop, &mut state, "plan", &failed("another thing"), true);
        assert_eq!(
            state.skill().no_progress.as_ref().unwrap().rounds,
            1,
            "not a round"
        );
    }

    #[test]
    fn skill_tuning_rounds_are_its_verifications() {
        use crate::workflow::skill_tuning::SkillTuning;
        let mut state = LoopState::default();
        SkillTuning.init_part(state.skill());
        let same = failed("verify found the same 2 issues");
        for _ in 0..4 {
            round(&SkillTuning, &mut state, "diagnose-memory", &same, true);
        }
        assert_eq!(check(&state, RULE), None, "a diagnosis is not a round");
        for _ in 0..4 {
            round(&SkillTuning, &mut state, "verify", &same, true);
        }
        let reason = check(&state, RULE).expect("four verifications alike");
        assert!(reason.contains("diagnosed"), "{reason}");
    }

    #[test]
    fn without_git_the_tree_is_left_out_and_the_reason_says_so() {
        let mut state = LoopState::default();
        let fail = failed("same");
        for _ in 0..4 {
            // A checkpoint cannot say anything when the tree is not tracked.
            touched(&mut state, Some(&checkpoint(3)));
            round(&CcwLoop, &mut state, "develop", &fail, false);
        }
        let reason = check(&state, RULE).unwrap();
        assert!(
            reason.contains("the work tree left out (no git checkpoints)"),
            "{reason}"
        );
    }

    #[test]
    fn decide_pauses_or_fails_a_loop_without_progress_as_the_rule_says() {
        use crate::workflow::{Decision, Limits, decide};
        let mut state = LoopState::default();
        CcwLoop.init_part(state.skill());
        for _ in 0..4 {
            round(&CcwLoop, &mut state, "validate", &failed("same"), true);
        }
        let limits = |then| Limits {
            max_iterations: 10,
            max_errors: 3,
            no_progress: Rule { rounds: 3, then },
            ..Limits::default()
        };
        assert!(matches!(
            decide(&CcwLoop, &state, limits(Then::Pause)),
            Decision::Pause(r) if r.starts_with("no progress in 3 rounds")
        ));
        assert!(matches!(
            decide(&CcwLoop, &state, limits(Then::Fail)),
            Decision::Abort(r) if r.starts_with("no progress in 3 rounds")
        ));
        state.current_iteration = 10;
        let first = decide(&CcwLoop, &state, limits(Then::Pause));
        assert!(
            matches!(&first, Decision::Run(d) if d.action == "complete"),
            "the iteration limit comes first: {first:?}"
        );
    }

    #[test]
    fn a_pause_starts_the_count_afresh_and_an_action_clears_it() {
        let mut state = LoopState::default();
        for _ in 0..4 {
            round(&CcwLoop, &mut state, "validate", &failed("same"), true);
        }
        let reason = check(&state, RULE).unwrap();
        pause(&mut state, reason.clone(), "2026-11-25T12:00:00.000Z");
        assert_eq!(
            paused(&state).map(|s| s.reason.as_str()),
            Some(reason.as_str())
        );
        assert_eq!(check(&state, RULE), None);
        resumed(&mut state);
        assert_eq!(paused(&state), None);
        round(&CcwLoop, &mut state, "validate", &failed("same"), true);
        assert_eq!(check(&state, RULE), None, "one round since the resume");
    }
}
