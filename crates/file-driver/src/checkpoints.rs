//! A loop's git checkpoints as people see and use them, from the command line (`loopd
//! checkpoints`, `diff`, `rollback`) and the API alike: the list with what each changed, the diff
//! of one checkpoint (as git's text, or parsed into files and hunks, bounded), and the rollback
//! of the work tree, refused while a daemon drives the loop. Runs git ([`loopd_exec::checkpoint`]).
//!
//! Theory of operation of the parsed diff: [`Repo::diff`] gives a summary of the files
//! (`--stat`) and then git's unified diff (`--no-renames`, no colour). [`parse_diff`] skips to the
//! first `diff --git` line, then reads each file's extended header (new, deleted, renamed, binary)
//! and its hunks, each hunk as long as its `@@ -a,b +c,d @@` header says, so that a removed line
//! that reads `--- x` is never taken for a file's header. What it keeps is bounded ([`BOUNDS`]):
//! what is left out is counted and said, per file and in one line for the whole.

use anyhow::Result;
use serde::Serialize;

use crate::error::usage;
use crate::project::Project;
use loopd_core::state::{Checkpoint, Status};
use loopd_exec::checkpoint::{Repo, Tampered};

/// The repository of loop `id`'s work tree, with the loop's own index file; refused in one line
/// when the work tree is in none. The copies of its checkpoints there that are not as loopd
/// recorded them are put back, each said in the loop's events (`tampered`) and on stderr.
pub fn repo_of(p: &Project, id: &str) -> Result<Repo> {
    let loaded = p.store.load(id)?;
    let tree = crate::worktree::of(p, &loaded.state)?;
    let repo = Repo::open(&tree.path, p.store.dir(), id, "checkpoint").ok_or_else(|| {
        usage(format!(
            "loop {id} has no checkpoints: its work tree {} is not in a git repository",
            tree.path.display()
        ))
    })?;
    let tampered = repo.check()?;
    if !tampered.is_empty() {
        let dir = loopd_store::events::ProgressDir::new(&p.store, id);
        let mut events = loopd_store::events::EventLog::open(id, &dir).ok();
        for t in &tampered {
            tracing::warn!("loop {id}: {}", t.message());
            if let Some(events) = events.as_mut() {
                events.emit(tampered_event(t));
            }
        }
    }
    Ok(repo)
}

/// The `tampered` event of a checkpoint's copy that was not as loopd recorded it.
pub fn tampered_event(t: &Tampered) -> loopd_store::events::Event {
    loopd_store::events::Event::new(loopd_store::events::name::TAMPERED)
        .with("checkpoint", t.name.clone())
        .with("ref", t.ref_name.clone())
        .with("found", t.found.clone())
        .with("recorded", t.recorded.clone())
        .with("message", t.message())
}

/// Loop `id`'s checkpoints, oldest first, each with what it changed since the one before (the
/// first with nothing counted).
pub fn list(p: &Project, id: &str) -> Result<Vec<Checkpoint>> {
    let repo = repo_of(p, id)?;
    let mut shown = Vec::new();
    let mut before: Option<String> = None;
    for (name, commit) in repo.list()? {
        let mut checkpoint = Checkpoint {
            name,
            commit,
            ..Checkpoint::default()
        };
        if let Some(before) = &before {
            repo.count_changes(before, &mut checkpoint)?;
        }
        before = Some(checkpoint.commit.clone());
        shown.push(checkpoint);
    }
    Ok(shown)
}

/// The commits a diff goes from and to: checkpoint `name`'s (from the checkpoint before it, or
/// its commit's parent for the first), or the loop's as a whole (`None`: from its first to its
/// last checkpoint).
fn range(repo: &Repo, id: &str, name: Option<&str>) -> Result<(String, String)> {
    let list = repo.list()?;
    match name {
        Some(name) => {
            let to = repo.find(name)?;
            // From the tree it started on: its first parent (a task developed at once with
            // others starts on the batch's base, a merge on the loop's tree), else the checkpoint
            // before it.
            let at = list.iter().position(|(n, _)| n == name).unwrap_or(0);
            let from = match repo.parent(&to) {
                Some(parent) => parent,
                None => match at.checked_sub(1).and_then(|before| list.get(before)) {
                    Some((_, commit)) => commit.clone(),
                    None => format!("{to}^"),
                },
            };
            Ok((from, to))
        }
        None => match (list.first(), list.last()) {
            (Some((_, first)), Some((_, last))) => Ok((first.clone(), last.clone())),
            _ => Err(usage(format!("loop {id} has no checkpoint"))),
        },
    }
}

/// What one action changed (checkpoint `name`), or the loop as a whole (`None`), as git prints
/// it: a summary of the files, then the patch (`loopd diff`).
pub fn diff_text(p: &Project, id: &str, name: Option<&str>) -> Result<String> {
    let repo = repo_of(p, id)?;
    let (from, to) = range(&repo, id, name)?;
    repo.diff(&from, &to)
}

/// The diff of one checkpoint, parsed and bounded ([`parse_diff`]): what the API answers.
#[derive(Debug, Serialize)]
pub struct Diff {
    pub loop_id: String,
    pub checkpoint: String,
    /// The commit the diff starts from (`COMMIT^` for a loop's first checkpoint).
    pub from: String,
    /// The checkpoint's commit.
    pub to: String,
    pub files: Vec<FileDiff>,
    /// What was left out, in one line; `None` when nothing was.
    pub cut: Option<String>,
}

/// Checkpoint `name` of loop `id`: what it changed since the checkpoint before it, file by file.
pub fn diff(p: &Project, id: &str, name: &str) -> Result<Diff> {
    let repo = repo_of(p, id)?;
    let (from, to) = range(&repo, id, Some(name))?;
    let text = repo.diff(&from, &to)?;
    let (files, cut) = parse_diff(&text, &BOUNDS);
    Ok(Diff {
        loop_id: id.to_owned(),
        checkpoint: name.to_owned(),
        from,
        to,
        files,
        cut,
    })
}

/// Puts loop `id`'s work tree back as it was at checkpoint `name` ([`Repo::rollback`]), and says
/// so in the loop's events (`rolled_back`). Refused while a daemon drives the running loop (it
/// would write over the files as they are put back); returns the checkpoint's commit.
pub fn rollback(p: &Project, id: &str, name: &str, force: bool) -> Result<String> {
    let repo = repo_of(p, id)?;
    let state = p.store.load(id)?.state;
    if state.status == Status::Running
        && let Some(pid) = crate::locks::driving_daemon(&p.store, id)
    {
        return Err(usage(format!(
            "loop {id} is running (daemon {pid}); pause it first: loopd pause {id}"
        )));
    }
    let commit = repo.rollback(name, force)?;
    let dir = loopd_store::events::ProgressDir::new(&p.store, id);
    if let Ok(mut events) = loopd_store::events::EventLog::open(id, &dir) {
        events.emit(
            loopd_store::events::Event::new(loopd_store::events::name::ROLLED_BACK)
                .with("checkpoint", name)
                .with("commit", commit.clone())
                .with("forced", force),
        );
    }
    Ok(commit)
}

/// How much of a diff is kept.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Files listed; those after are counted only.
    pub files: usize,
    /// Lines kept of one file (hunk headers count as lines).
    pub lines_per_file: usize,
    /// Bytes of line text kept in all (hunk headers included).
    pub bytes: usize,
}

/// What the API keeps of a diff: enough to read, never a page a browser chokes on.
pub const BOUNDS: Bounds = Bounds {
    files: 100,
    lines_per_file: 1000,
    bytes: 256 * 1024,
};

/// One file of a diff.
#[derive(Debug, Default, PartialEq, Serialize)]
pub struct FileDiff {
    /// Its path (the old one for a deleted file).
    pub path: String,
    /// Where a renamed file was; `None` unless renamed.
    pub old_path: Option<String>,
    pub status: FileStatus,
    /// Lines added and removed, all of them (those left out too).
    pub insertions: u64,
    pub deletions: u64,
    pub hunks: Vec<Hunk>,
    /// Some of its hunks or lines were left out.
    pub cut: bool,
}

/// What happened to a file. A binary file is `Binary` whatever happened to it: it has no lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FileStatus {
    Added,
    Deleted,
    #[default]
    Modified,
    Renamed,
    Binary,
}

/// A hunk: its header (`@@ -1,3 +1,4 @@ ...`) and its lines, each with its mark (` `, `-`, `+`,
/// or `\` for git's "\ No newline at end of file").
#[derive(Debug, Default, PartialEq, Serialize)]
pub struct Hunk {
    pub header: String,
    pub lines: Vec<String>,
}

/// What is left out of a diff, counted as it is read.
#[derive(Default)]
struct Left {
    /// Files after the last one listed.
    files: usize,
    /// Lines of listed files left out, and how many files they are in.
    lines: u64,
    files_cut: usize,
}

/// The hunk being read: how many of its old and new lines are still to come (`None` when its
/// header did not say: then it runs until the next header).
struct Open {
    old: Option<u64>,
    new: Option<u64>,
}

impl Open {
    fn of(header: &str) -> Open {
        let counts = hunk_counts(header);
        Open {
            old: counts.map(|c| c.0),
            new: counts.map(|c| c.1),
        }
    }

    /// Whether every line the header announced has come.
    fn done(&self) -> bool {
        self.old == Some(0) && self.new == Some(0)
    }

    /// Counts a line off by its mark.
    fn take(&mut self, mark: u8) {
        let less = |n: &mut Option<u64>| {
            if let Some(n) = n {
                *n = n.saturating_sub(1);
            }
        };
        match mark {
            b'-' => less(&mut self.old),
            b'+' => less(&mut self.new),
            b'\\' => {}
            _ => {
                less(&mut self.old);
                less(&mut self.new);
            }
        }
    }
}

/// The old and new line counts of a hunk header `@@ -a[,b] +c[,d] @@`.
fn hunk_counts(header: &str) -> Option<(u64, u64)> {
    let mut parts = header.strip_prefix("@@ ")?.split(' ');
    let count = |range: &str| -> Option<u64> {
        match range.split_once(',') {
            Some((_, n)) => n.parse().ok(),
            None => range.parse::<u64>().ok().map(|_| 1),
        }
    };
    let old = count(parts.next()?.strip_prefix('-')?)?;
    let new = count(parts.next()?.strip_prefix('+')?)?;
    Some((old, new))
}

/// Reads git's unified diff (what [`Repo::diff`] prints: anything before the first `diff --git`
/// line is skipped) into its files, keeping what `bounds` allow; returns them and, when anything
/// was left out, one line that says what.
pub fn parse_diff(text: &str, bounds: &Bounds) -> (Vec<FileDiff>, Option<String>) {
    let mut parser = Parser {
        bounds: *bounds,
        files: Vec::new(),
        left: Left::default(),
        bytes: 0,
        file: None,
        hunk: None,
    };
    for line in text.lines() {
        parser.line(line);
    }
    parser.finish()
}

/// [`parse_diff`]'s state as it reads.
struct Parser {
    bounds: Bounds,
    files: Vec<FileDiff>,
    left: Left,
    /// Bytes of line text kept so far.
    bytes: usize,
    /// The file being read, and how many of its lines are kept; `None` before the first.
    file: Option<(FileDiff, usize)>,
    /// The hunk being read.
    hunk: Option<Open>,
}

impl Parser {
    fn line(&mut self, line: &str) {
        if let Some(open) = &mut self.hunk {
            let mark = line.bytes().next().unwrap_or(b' ');
            // A line the header announced, or "\ No newline at end of file" after the last.
            let in_hunk = match mark {
                b' ' | b'-' | b'+' => !open.done(),
                b'\\' => true,
                _ => false,
            };
            if in_hunk {
                open.take(mark);
                self.hunk_line(line);
                return;
            }
            self.hunk = None;
        }
        if let Some(header) = line.strip_prefix("diff --git ") {
            self.start_file(header);
            return;
        }
        let Some((file, kept)) = &mut self.file else {
            return; // the summary before the patch
        };
        if line.starts_with("@@ ") {
            self.hunk = Some(Open::of(line));
            if !file.cut
                && *kept < self.bounds.lines_per_file
                && self.bytes + line.len() <= self.bounds.bytes
            {
                file.hunks.push(Hunk {
                    header: line.to_owned(),
                    lines: Vec::new(),
                });
                *kept += 1;
                self.bytes += line.len();
            } else {
                file.cut = true;
            }
        } else if line.starts_with("new file mode ") {
            file.status = FileStatus::Added;
        } else if line.starts_with("deleted file mode ") {
            file.status = FileStatus::Deleted;
        } else if let Some(old) = line.strip_prefix("rename from ") {
            file.status = FileStatus::Renamed;
            file.old_path = Some(unquote(old));
        } else if let Some(new) = line.strip_prefix("rename to ") {
            file.path = unquote(new);
        } else if line.starts_with("Binary files ") || line == "GIT binary patch" {
            file.status = FileStatus::Binary;
        } else if let Some(old) = line.strip_prefix("--- ")
            && file.status == FileStatus::Deleted
            && let Some(path) = diff_path(old, "a/")
        {
            file.path = path;
        } else if let Some(new) = line.strip_prefix("+++ ")
            && file.status != FileStatus::Deleted
            && let Some(path) = diff_path(new, "b/")
        {
            file.path = path;
        }
    }

    /// A line of the hunk being read: counted, and kept if it fits.
    fn hunk_line(&mut self, line: &str) {
        let Some((file, kept)) = &mut self.file else {
            return;
        };
        match line.as_bytes().first() {
            Some(b'+') => file.insertions += 1,
            Some(b'-') => file.deletions += 1,
            _ => {}
        }
        let fits = !file.cut
            && *kept < self.bounds.lines_per_file
            && self.bytes + line.len() <= self.bounds.bytes;
        match file.hunks.last_mut() {
            Some(hunk) if fits => {
                // An empty line is an empty context line whose space was lost.
                hunk.lines.push(if line.is_empty() {
                    " ".to_owned()
                } else {
                    line.to_owned()
                });
                *kept += 1;
                self.bytes += line.len();
            }
            _ => {
                file.cut = true;
                self.left.lines += 1;
            }
        }
    }

    /// A new file, from its `diff --git a/X b/Y` header; the one before is done.
    fn start_file(&mut self, header: &str) {
        self.end_file();
        if self.files.len() >= self.bounds.files {
            self.left.files += 1;
            return;
        }
        let path = header_path(header);
        self.file = Some((
            FileDiff {
                path,
                ..FileDiff::default()
            },
            0,
        ));
    }

    fn end_file(&mut self) {
        if let Some((mut file, _)) = self.file.take() {
            // A hunk whose header was kept and no line of it.
            if file.cut && file.hunks.last().is_some_and(|h| h.lines.is_empty()) {
                file.hunks.pop();
            }
            if file.cut {
                self.left.files_cut += 1;
            }
            self.files.push(file);
        }
    }

    fn finish(mut self) -> (Vec<FileDiff>, Option<String>) {
        self.end_file();
        let Left {
            files,
            lines,
            files_cut,
        } = self.left;
        let mut said = Vec::new();
        if lines > 0 {
            said.push(format!("{lines} line(s) of {files_cut} file(s)"));
        }
        if files > 0 {
            said.push(format!("{files} more file(s)"));
        }
        let cut = (!said.is_empty()).then(|| {
            let Bounds {
                files,
                lines_per_file,
                bytes,
            } = self.bounds;
            format!(
                "left out: {} (shown: at most {files} files, {lines_per_file} lines a file, {} KiB \
                 of lines in all)",
                said.join(" and "),
                bytes / 1024
            )
        });
        (self.files, cut)
    }
}

/// The path of a `---`/`+++` line (`a/X`, `"a/X"` quoted, or `/dev/null`: `None`), without its
/// prefix and the tab git adds after a name with a space.
fn diff_path(given: &str, prefix: &str) -> Option<String> {
    let given = given.strip_suffix('\t').unwrap_or(given);
    if given == "/dev/null" {
        return None;
    }
    let path = unquote(given);
    Some(
        path.strip_prefix(prefix)
            .map_or(path.clone(), str::to_owned),
    )
}

/// The new path of a `diff --git a/X b/Y` header: `Y` without its `b/`. Unquoted names may hold
/// spaces, so the cut is made where both halves name the same file when one does.
fn header_path(header: &str) -> String {
    if header.starts_with('"') || header.ends_with('"') {
        let (_, rest) = split_quoted(header);
        let new = unquote(rest.trim_start());
        return new.strip_prefix("b/").map_or(new.clone(), str::to_owned);
    }
    let cuts: Vec<usize> = header.match_indices(' ').map(|(i, _)| i).collect();
    let same = cuts.iter().find(|&&i| {
        let (a, b) = (&header[..i], &header[i + 1..]);
        a.strip_prefix("a/").unwrap_or(a) == b.strip_prefix("b/").unwrap_or(b)
    });
    let at = same
        .or_else(|| cuts.iter().find(|&&i| header[i + 1..].starts_with("b/")))
        .or(cuts.first());
    let new = at.map_or(header, |&i| &header[i + 1..]);
    new.strip_prefix("b/").unwrap_or(new).to_owned()
}

/// `"quoted" rest` → the quoted part (with its quotes) and the rest; an unquoted start is cut at
/// its first space.
fn split_quoted(s: &str) -> (&str, &str) {
    if !s.starts_with('"') {
        return s.split_once(' ').unwrap_or((s, ""));
    }
    let mut escaped = false;
    for (i, c) in s.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return (&s[..=i], &s[i + 1..]),
            _ => {}
        }
    }
    (s, "")
}

/// A name as git prints it: as is, or in C quotes with `\t`, `\n`, `\"`, `\\` and octal escapes
/// of bytes (a name that is not UTF-8 has its bad bytes replaced).
fn unquote(s: &str) -> String {
    let Some(inner) = s.strip_prefix('"').and_then(|s| s.strip_suffix('"')) else {
        return s.to_owned();
    };
    let mut bytes = Vec::with_capacity(inner.len());
    let mut rest = inner.bytes().peekable();
    while let Some(b) = rest.next() {
        if b != b'\\' {
            bytes.push(b);
            continue;
        }
        match rest.next() {
            Some(b'n') => bytes.push(b'\n'),
            Some(b't') => bytes.push(b'\t'),
            Some(b'r') => bytes.push(b'\r'),
            Some(b'a') => bytes.push(7),
            Some(b'b') => bytes.push(8),
            Some(b'f') => bytes.push(12),
            Some(b'v') => bytes.push(11),
            Some(d @ b'0'..=b'7') => {
                let mut value = u32::from(d - b'0');
                for _ in 0..2 {
                    match rest.peek() {
                        Some(&d @ b'0'..=b'7') => {
                            value = value * 8 + u32::from(d - b'0');
                            rest.next();
                        }
                        _ => break,
                    }
                }
                bytes.push(u8::try_from(value).unwrap_or(b'?'));
            }
            Some(other) => bytes.push(other),
            None => bytes.push(b'\\'),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `Repo::diff` prints: the summary, a blank line, then the patch.
    const SAMPLE: &str = "\
 code.txt     | 1 +
 gone.txt     | 1 -
 new file.txt | 2 ++
 pic.bin      | Bin 0 -> 4 bytes
 4 files changed, 3 insertions(+), 1 deletion(-)

diff --git a/code.txt b/code.txt
index 626799f..1a7b5a4 100644
--- a/code.txt
+++ b/code.txt
@@ -1,2 +1,3 @@ fn main
 v1
--- not a header
+task-001
diff --git a/gone.txt b/gone.txt
deleted file mode 100644
index 1c8e5d4..0000000
--- a/gone.txt
+++ /dev/null
@@ -1 +0,0 @@
-to be deleted
diff --git a/new file.txt b/new file.txt
new file mode 100644
index 0000000..8e1f2a3
--- /dev/null
+++ b/new file.txt\t
@@ -0,0 +1,2 @@
+made
+by me
\\ No newline at end of file
diff --git a/pic.bin b/pic.bin
new file mode 100644
index 0000000..e7e6b9a
Binary files /dev/null and b/pic.bin differ
";

    #[test]
    fn a_diff_is_read_into_files_and_hunks() {
        let (files, cut) = parse_diff(SAMPLE, &BOUNDS);
        assert_eq!(cut, None);
        assert_eq!(files.len(), 4, "{files:#?}");
        assert_eq!(
            files[0],
            FileDiff {
                path: "code.txt".into(),
                old_path: None,
                status: FileStatus::Modified,
                insertions: 1,
                deletions: 1,
                hunks: vec![Hunk {
                    header: "@@ -1,2 +1,3 @@ fn main".into(),
                    lines: vec![" v1".into(), "--- not a header".into(), "+task-001".into()],
                }],
                cut: false,
            }
        );
        assert_eq!(
            (files[1].path.as_str(), files[1].status, files[1].deletions),
            ("gone.txt", FileStatus::Deleted, 1)
        );
        assert_eq!(files[1].hunks[0].lines, ["-to be deleted"]);
        assert_eq!(
            (files[2].path.as_str(), files[2].status, files[2].insertions),
            ("new file.txt", FileStatus::Added, 2)
        );
        assert_eq!(
            files[2].hunks[0].lines,
            ["+made", "+by me", "\\ No newline at end of file"]
        );
        assert_eq!(
            (files[3].path.as_str(), files[3].status),
            ("pic.bin", FileStatus::Binary)
        );
        assert!(files[3].hunks.is_empty());
    }

    #[test]
    fn a_rename_and_quoted_names() {
        let text = "\
diff --git a/old name.txt b/new name.txt
similarity index 90%
rename from old name.txt
rename to new name.txt
index 1111111..2222222 100644
--- a/old name.txt\t
+++ b/new name.txt\t
@@ -1 +1 @@
-a
+b
diff --git \"a/caf\\303\\251\\t.txt\" \"b/caf\\303\\251\\t.txt\"
new file mode 100644
index 0000000..e69de29
";
        let (files, _) = parse_diff(text, &BOUNDS);
        assert_eq!(files.len(), 2, "{files:#?}");
        assert_eq!(files[0].status, FileStatus::Renamed);
        assert_eq!(files[0].path, "new name.txt");
        assert_eq!(files[0].old_path.as_deref(), Some("old name.txt"));
        assert_eq!(files[0].hunks[0].lines, ["-a", "+b"]);
        // An empty new file: no ---/+++ lines, its name from the header.
        assert_eq!(files[1].path, "café\t.txt");
        assert_eq!(files[1].status, FileStatus::Added);
        assert!(files[1].hunks.is_empty());
    }

    #[test]
    fn a_removed_file_whose_last_line_had_no_newline() {
        let text = "\
diff --git a/x b/x
deleted file mode 100644
index 1111111..0000000
--- a/x
+++ /dev/null
@@ -1,2 +0,0 @@
-one
-two
\\ No newline at end of file
diff --git a/y b/y
index 1111111..2222222 100644
--- a/y
+++ b/y
@@ -1 +1 @@
-same
\\ No newline at end of file
+same
";
        let (files, cut) = parse_diff(text, &BOUNDS);
        assert_eq!(cut, None);
        assert_eq!(files[0].path, "x");
        assert_eq!(
            files[0].hunks[0].lines,
            ["-one", "-two", "\\ No newline at end of file"]
        );
        assert_eq!(files[0].deletions, 2);
        assert_eq!(
            files[1].hunks[0].lines,
            ["-same", "\\ No newline at end of file", "+same"]
        );
        assert_eq!((files[1].insertions, files[1].deletions), (1, 1));
    }

    /// A diff of `files` files of `lines` added lines each, in one hunk.
    fn big(files: usize, lines: usize, width: usize) -> String {
        let mut text = String::new();
        for f in 0..files {
            text.push_str(&format!(
                "diff --git a/f{f} b/f{f}\nnew file mode 100644\n--- /dev/null\n+++ b/f{f}\n@@ -0,0 +1,{lines} @@\n"
            ));
            for _ in 0..lines {
                text.push('+');
                text.push_str(&"x".repeat(width));
                text.push('\n');
            }
        }
        text
    }

    #[test]
    fn a_diff_over_the_bounds_is_cut_and_says_what_it_left_out() {
        let bounds = Bounds {
            files: 3,
            lines_per_file: 10,
            bytes: 1000,
        };
        // Over the files and the lines of a file.
        let (files, cut) = parse_diff(&big(5, 20, 1), &bounds);
        assert_eq!(files.len(), 3);
        for file in &files {
            assert!(file.cut);
            assert_eq!(file.insertions, 20, "every line is counted");
            // The header and 9 lines.
            assert_eq!(file.hunks[0].lines.len(), 9);
        }
        let cut = cut.expect("said");
        assert!(cut.contains("33 line(s) of 3 file(s)"), "{cut}");
        assert!(cut.contains("2 more file(s)"), "{cut}");
        assert_eq!(cut.lines().count(), 1);

        // Over the bytes in all: the second file gets what is left, the third nothing.
        let (files, cut) = parse_diff(&big(3, 5, 99), &bounds);
        let kept: usize = files
            .iter()
            .flat_map(|f| &f.hunks)
            .map(|h| h.header.len() + h.lines.iter().map(String::len).sum::<usize>())
            .sum();
        assert!(kept <= 1000, "{kept}");
        assert!(!files[0].cut);
        assert!(files[1].cut && files[2].cut);
        assert!(files[2].hunks.is_empty(), "{:?}", files[2].hunks);
        assert!(cut.is_some_and(|c| c.contains("of 2 file(s)")));

        // Within the bounds: nothing said.
        assert_eq!(parse_diff(&big(3, 9, 1), &bounds).1, None);
    }

    #[test]
    fn the_summary_before_the_patch_and_an_empty_diff_are_no_files() {
        assert!(parse_diff("", &BOUNDS).0.is_empty());
        let (files, _) = parse_diff(" a | 1 +\n 1 file changed\n", &BOUNDS);
        assert!(files.is_empty());
    }

    #[test]
    fn hunk_headers_say_their_counts() {
        assert_eq!(hunk_counts("@@ -1,3 +1,4 @@ fn x"), Some((3, 4)));
        assert_eq!(hunk_counts("@@ -1 +1 @@"), Some((1, 1)));
        assert_eq!(hunk_counts("@@ -0,0 +1 @@"), Some((0, 1)));
        assert_eq!(hunk_counts("@@@ -1 -1 +1 @@@"), None);
    }
}
