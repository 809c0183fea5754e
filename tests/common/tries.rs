//! A hostile executor for the sandbox's tests (`tests/sandbox.rs`, `tests/network.rs`): develop
//! runs `bin/hostile.sh` itself and from a grandchild in a new session, and each try is written
//! down as done or refused.

use super::Project;

/// Develop runs `bin/hostile.sh` (see [`hostile`]) itself and from a grandchild in a new session,
/// once, then succeeds, so the loop goes on.
pub const HOSTILE_AGENT: &str = "[ -e tried.txt ] || { sh bin/hostile.sh; setsid -w sh bin/hostile.sh ' (grandchild)' < /dev/null; cat errors.txt >&2; }";

/// Writes `bin/hostile.sh`: it tries each `(NAME, COMMAND)` and writes `NAME: done` or `NAME:
/// refused` (NAME followed by its first argument) to `tried.txt` in the work tree, and what the
/// commands said to `errors.txt`.
pub fn hostile(p: &Project, tries: &[(&str, String)]) {
    let mut script = String::from(
        "try() { if ( eval \"$2\" ) 2>>errors.txt; then echo \"$1$who: done\" >> tried.txt; \
         else echo \"$1$who: refused\" >> tried.txt; fi; }\nwho=$1\n",
    );
    for (name, command) in tries {
        script.push_str(&format!("try '{name}' '{command}'\n"));
    }
    p.script("hostile.sh", &script);
}

/// Each of `tries`, itself and from a grandchild, was done if it is in `done`, else refused.
pub fn assert_tried(p: &Project, tries: &[(&str, String)], done: &[&str]) {
    let said = tried(p);
    for (name, _) in tries {
        let word = if done.contains(name) {
            "done"
        } else {
            "refused"
        };
        for who in ["", " (grandchild)"] {
            let line = format!("{name}{who}: {word}");
            assert!(said.contains(&line), "{line:?} not in {said:#?}");
        }
    }
}

/// What develop tried, line by line.
pub fn tried(p: &Project) -> Vec<String> {
    std::fs::read_to_string(p.root.join("tried.txt"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}
