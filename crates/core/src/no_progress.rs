//! No-progress detection: a loop that goes round and round changing nothing is paused (or
//! failed) before it spends more.
//!
//! A round is an action that counts an iteration (ccw-loop's develop, debug and validate;
//! skill-tuning's verify). Progress is what changed, not what was claimed: a round made progress
//! when a file of the work tree changed (its git checkpoint had files in it; without checkpoints,
//! the fingerprint of its files changed), or its last validation's outcome changed, or its error
//! changed (with its numbers, paths and hashes taken out: a [`Fingerprint`]). The task bookkeeping
//! alone (a fix task the agent added and marked done in a round that changed no file) is none.
//! A person's change (a task they added, a resume, an answer) counts afresh ([`afresh`]). A round
//! without progress is one more in a row, with a note of what it did
//! ([`crate::workflow::Workflow::round_note`]); [`check`] says when there were too many, in words
//! a person acts on. What a round was, the workflow says ([`crate::workflow::round`]); this module
//! knows no workflow.

use serde::{Deserialize, Serialize};

use crate::state::{Checkpoint, Fingerprint, LoopState, NoProgress, Stalled};

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

/// The notes of rounds without progress kept for the reason (the last ones).
pub const NOTES_KEPT: usize = 12;

/// An attempt recorded `checkpoint`: a round whose work tree changed made progress.
pub fn touched(state: &mut LoopState, checkpoint: Option<&Checkpoint>) {
    if checkpoint.is_some_and(|c| c.files > 0) {
        books(state).tree_changed = true;
    }
}

/// What a driver knows of the work tree after an action.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Tree {
    /// Its git checkpoints are recorded: each attempt's says whether a file changed.
    Checkpointed,
    /// No checkpoints: a fingerprint of its files (names, sizes, times).
    Files(u64),
    /// Nothing is known of it.
    #[default]
    Unknown,
}

/// A round that ended, as the workflow sees it ([`crate::workflow::round`]).
#[derive(Clone, Debug)]
pub struct Round<'a> {
    /// The workflow's measure of progress (see [`Fingerprint::progress`]).
    pub progress: String,
    /// The last validation's outcome, in a few words.
    pub validation: Option<String>,
    /// What the round did, in a few words.
    pub note: String,
    /// Its error, when it failed.
    pub failed: Option<&'a str>,
    /// What is known of the work tree now.
    pub tree: Tree,
}

/// A round ended: it is compared with the one before.
pub fn round(state: &mut LoopState, round: Round<'_>) {
    let Round {
        progress,
        validation,
        note,
        failed,
        tree,
    } = round;
    let books = books(state);
    let now = Fingerprint {
        progress,
        validation,
        // The last error stands until another replaces it: rounds of different actions (a
        // failing debug between validations) alternate, and one that succeeds changes nothing.
        error: match failed {
            Some(message) => Some(signature(message)),
            None => books.fingerprint.as_ref().and_then(|f| f.error.clone()),
        },
        tree_tracked: tree == Tree::Checkpointed,
        files: match tree {
            Tree::Files(files) => Some(files),
            _ => None,
        },
    };
    let same = match &books.fingerprint {
        Some(before) => {
            let tree_changed = match tree {
                Tree::Checkpointed => books.tree_changed,
                Tree::Files(files) => before.files != Some(files),
                Tree::Unknown => false,
            };
            !tree_changed
                && before.validation == now.validation
                && before.error == now.error
                && before.tree_tracked == now.tree_tracked
        }
        None => false,
    };
    if same {
        books.rounds += 1;
        books.notes.push(note);
        let over = books.notes.len().saturating_sub(NOTES_KEPT);
        books.notes.drain(..over);
    } else {
        books.rounds = 0;
        books.notes.clear();
    }
    books.fingerprint = Some(now);
    books.tree_changed = false;
}

/// A person changed something (added a task, resumed the loop, answered a question): the rounds
/// without progress count afresh from here.
pub fn afresh(state: &mut LoopState) {
    if let Some(books) = state
        .skill_state
        .as_mut()
        .and_then(|s| s.no_progress.as_mut())
    {
        books.rounds = 0;
        books.notes.clear();
    }
}

/// Why the loop is to stop for making no progress, if `rule` says it is: how many rounds, what
/// each kind of round did (`debug proposed 'fix the off by one' each time, develop changed no
/// file each time, validation failed t_broken each time`).
pub fn check(state: &LoopState, rule: Rule) -> Option<String> {
    let books = state.skill_state.as_ref()?.no_progress.as_ref()?;
    if rule.rounds == 0 || books.rounds < rule.rounds {
        return None;
    }
    let fingerprint = books.fingerprint.as_ref()?;
    // The notes grouped by the action they begin with, in the order the actions came.
    let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
    for note in &books.notes {
        let action = note.split_whitespace().next().unwrap_or("");
        match groups.iter_mut().find(|(a, _)| *a == action) {
            Some((_, notes)) => notes.push(note),
            None => groups.push((action, vec![note])),
        }
    }
    let mut said: Vec<String> = groups
        .into_iter()
        .map(|(_, notes)| {
            let mut distinct: Vec<&str> = Vec::new();
            for note in &notes {
                if !distinct.contains(note) {
                    distinct.push(note);
                }
            }
            match distinct.as_slice() {
                [one] if notes.len() > 1 => format!("{one} each time"),
                [one] => (*one).to_owned(),
                many => many.join(", then "),
            }
        })
        .collect();
    if !fingerprint.tree_tracked && fingerprint.files.is_none() {
        said.push("the work tree left out (no git checkpoints)".to_owned());
    }
    Some(format!(
        "no progress in {} rounds: {}",
        books.rounds,
        said.join("; ")
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
    use crate::workflow::{Finish, Workflow as _, round};

    const RULE: Rule = Rule {
        rounds: 3,
        then: Then::Pause,
    };

    fn failed(message: &str) -> Finish {
        Finish::Failed(message.to_owned())
    }

    /// A round: a validation that failed as the one before (git checkpoints on).
    fn same_validation(state: &mut LoopState) {
        round(
            &CcwLoop,
            state,
            "validate",
            &failed("same"),
            Tree::Checkpointed,
        );
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
        round(&CcwLoop, &mut state, "validate", &fail, Tree::Checkpointed);
        for n in 1..=3 {
            assert_eq!(check(&state, RULE), None, "after {n} rounds");
            touched(&mut state, Some(&checkpoint(0)));
            round(&CcwLoop, &mut state, "debug", &fail, Tree::Checkpointed);
        }
        let reason = check(&state, RULE).expect("three rounds without progress");
        assert_eq!(
            reason,
            "no progress in 3 rounds: debug failed: validation failed: # of # tests each time"
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
        round(&CcwLoop, &mut state, "debug", &fail, Tree::Checkpointed);
        round(&CcwLoop, &mut state, "debug", &fail, Tree::Checkpointed);
        assert_eq!(state.skill().no_progress.as_ref().unwrap().rounds, 1);
        touched(&mut state, Some(&checkpoint(2)));
        round(&CcwLoop, &mut state, "debug", &fail, Tree::Checkpointed);
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
            Tree::Checkpointed,
        );
        assert_eq!(
            state.skill().no_progress.as_ref().unwrap().rounds,
            0,
            "a new error"
        );
        let ok = Finish::Success(serde_json::from_str(r#"{"status": "success"}"#).unwrap());
        round(&CcwLoop, &mut state, "validate", &ok, Tree::Checkpointed);
        assert_eq!(
            state.skill().no_progress.as_ref().unwrap().rounds,
            1,
            "the error stands"
        );
        round(
            &CcwLoop,
            &mut state,
            "plan",
            &failed("another thing"),
            Tree::Checkpointed,
        );
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
            round(
                &SkillTuning,
                &mut state,
                "diagnose-memory",
                &same,
                Tree::Checkpointed,
            );
        }
        assert_eq!(check(&state, RULE), None, "a diagnosis is not a round");
        for _ in 0..4 {
            round(
                &SkillTuning,
                &mut state,
                "verify",
                &same,
                Tree::Checkpointed,
            );
        }
        let reason = check(&state, RULE).expect("four verifications alike");
        assert!(
            reason.contains("verify failed: verify found the same # issues each time"),
            "{reason}"
        );
        // An applied fix that left the score and the open issues as they were: no progress.
        let mut state = LoopState::default();
        SkillTuning.init_part(state.skill());
        let ok = Finish::Success(serde_json::from_str(r#"{"status": "success"}"#).unwrap());
        for _ in 0..4 {
            round(&SkillTuning, &mut state, "verify", &ok, Tree::Checkpointed);
        }
        assert!(check(&state, RULE).is_some());
    }

    /// The stuck cycle agents fall into most: validation fails, debug proposes a fix task,
    /// develop marks it done and changes no file, validation fails the same way. The task
    /// bookkeeping (a task added and done each round) is no progress.
    #[test]
    fn a_fix_task_added_and_done_each_round_with_no_file_changed_is_no_progress() {
        use crate::workflow::{Decision, Inputs, Limits, Workflow as _, decide};
        for (tree, worded_alike) in [
            (Tree::Checkpointed, true),
            (Tree::Checkpointed, false),
            (Tree::Files(7), true),
            (Tree::Files(7), false),
        ] {
            let mut state = LoopState::default();
            CcwLoop.init_part(state.skill());
            let inputs = Inputs {
                now: "2026-01-01T00:00:00.000Z".into(),
                listed_tasks: Vec::new(),
                tree,
            };
            let init = crate::workflow::Dispatch::new("init");
            let planned = r#"{"status":"success","state_updates":{"tasks":[{"description":"t"}]}}"#;
            let planned = Finish::Success(serde_json::from_str(planned).unwrap());
            crate::attempt::finish(&CcwLoop, &mut state, &init, &planned, &inputs);
            let limits = Limits {
                max_iterations: 50,
                max_errors: 3,
                no_progress: RULE,
                ..Limits::default()
            };
            let mut paused = None;
            for n in 0..20 {
                let dispatch = match decide(&CcwLoop, &state, limits) {
                    Decision::Run(dispatch) => dispatch,
                    Decision::Pause(reason) => {
                        paused = Some(reason);
                        break;
                    }
                    other => panic!("{other:?}"),
                };
                CcwLoop.begin(&mut state, &dispatch, &inputs.now);
                let fix = match worded_alike {
                    true => "fix the off by one".to_owned(),
                    false => format!("fix the off by one, take {n}"),
                };
                let result = match dispatch.action.as_str() {
                    "validate" => r#"{"status":"success","state_updates":{"passed":false,"pass_rate":50,"failed_tests":["t_broken"]}}"#.to_owned(),
                    "debug" => format!(r#"{{"status":"success","state_updates":{{"fix_tasks":[{{"description":"{fix}"}}]}}}}"#),
                    _ => r#"{"status":"success"}"#.to_owned(),
                };
                let finish = Finish::Success(serde_json::from_str(&result).unwrap());
                if dispatch.action == "develop" {
                    touched(&mut state, Some(&checkpoint(0)));
                }
                crate::attempt::finish(&CcwLoop, &mut state, &dispatch, &finish, &inputs);
            }
            let reason = paused.expect("paused for no progress");
            assert!(reason.starts_with("no progress in 3 rounds: "), "{reason}");
            assert!(reason.contains("develop changed no file"), "{reason}");
            assert!(reason.contains("validation failed t_broken"), "{reason}");
            if worded_alike {
                assert!(
                    reason.contains("debug proposed 'fix the off by one'"),
                    "{reason}"
                );
            }
        }
    }

    /// A person's change counts afresh: a task they added, a resume, an answer.
    #[test]
    fn a_persons_change_counts_afresh() {
        let mut state = LoopState::default();
        for _ in 0..3 {
            same_validation(&mut state);
        }
        assert_eq!(state.skill().no_progress.as_ref().unwrap().rounds, 2);
        afresh(&mut state);
        assert_eq!(state.skill().no_progress.as_ref().unwrap().rounds, 0);
        assert!(state.skill().no_progress.as_ref().unwrap().notes.is_empty());
        same_validation(&mut state);
        assert_eq!(
            state.skill().no_progress.as_ref().unwrap().rounds,
            1,
            "counted from the person's change"
        );
    }

    #[test]
    fn without_git_the_tree_is_left_out_and_the_reason_says_so() {
        let mut state = LoopState::default();
        let fail = failed("same");
        for _ in 0..4 {
            // A checkpoint cannot say anything when the tree is not tracked.
            touched(&mut state, Some(&checkpoint(3)));
            round(&CcwLoop, &mut state, "develop", &fail, Tree::Unknown);
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
            same_validation(&mut state);
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
            same_validation(&mut state);
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
        same_validation(&mut state);
        assert_eq!(check(&state, RULE), None, "one round since the resume");
    }
}
