//! A git checkpoint per action: after every action that changes the work tree (develop and
//! debug), the whole work tree is recorded as a commit on a ref of the loop's,
//! `refs/loopd/<loop id>/<iteration>-<action>`; a loop's first look records where it started,
//! `refs/loopd/<loop id>/0-start`.
//!
//! Theory of operation: the record is kept where no action can write, in a bare repository of
//! loopd's own in the state directory, the vault (`<state dir>/checkpoints.git`, made private):
//! its refs are the checkpoints and its objects hold everything they need. An action may write
//! the work tree's `.git` (it must, to commit), so what is there is never believed: each
//! checkpoint is also copied into the work tree's repository (the same ref, fetched from the
//! vault), for `git log refs/loopd/...` and the user's own tools, and [`Repo::check`] compares
//! those copies with the vault's record, says which ones were moved or removed and puts them
//! back. Diffs, rollbacks and merges read the vault only.
//!
//! A tree is built the way `git stash create` builds one, in an index file of loopd's own
//! (`GIT_INDEX_FILE`, in the vault, so that the next checkpoint only hashes what changed; a new
//! one starts as the parent's tree): `git add -A` of the whole work tree (tracked and untracked
//! files; ignored ones and loopd's state directory left out, the latter kept as the parent has
//! it), `git write-tree`, `git commit-tree` with the loop's previous checkpoint as parent, `git
//! update-ref`, all with the vault as git's directory and the work tree as its work tree. Where a
//! loop starts (the repository's HEAD) is fetched into the vault first, only that commit
//! (`--depth=1`), so the vault never copies the repository's history. The user's branch, index,
//! HEAD and stash are never touched, and a loop's refs are its own: loops of one repository
//! never mix them.
//!
//! git is run through [`crate::git`].

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result};
use loopd_core::state::Checkpoint;

/// A request about checkpoints that cannot be met as asked (no such checkpoint, or a rollback that
/// would lose changes): the user's to change, exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// The name of the checkpoint a loop records when it starts.
pub const START: &str = "0-start";

/// The vault's directory in the state directory.
pub const VAULT: &str = "checkpoints.git";

/// A copy of a checkpoint in the work tree's repository that is not what loopd recorded
/// ([`Repo::check`]): moved to another commit, or removed (`found` is `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tampered {
    /// The checkpoint's name.
    pub name: String,
    /// Its ref in the work tree's repository.
    pub ref_name: String,
    /// What the ref pointed at.
    pub found: Option<String>,
    /// The commit loopd recorded.
    pub recorded: String,
}

impl Tampered {
    /// In one line, for people.
    pub fn message(&self) -> String {
        match &self.found {
            Some(found) => format!(
                "{} pointed at {found}, not at checkpoint {} as loopd recorded it ({}); put back",
                self.ref_name, self.name, self.recorded
            ),
            None => format!(
                "{} (checkpoint {}, {}) was removed from the repository; put back",
                self.ref_name, self.name, self.recorded
            ),
        }
    }
}

/// The git repository a loop's work tree is in, and the loop's record of it in the vault.
pub struct Repo {
    work_tree: PathBuf,
    /// The repository's top level: where the paths git prints start.
    top: PathBuf,
    /// The state directory, which holds the vault.
    state_dir: PathBuf,
    /// The vault: the bare repository that holds the record.
    vault: PathBuf,
    /// loopd's own index file for this loop, in the vault.
    index: PathBuf,
    /// The state directory, as a pathspec that leaves it out (`None` if it is outside the tree).
    exclude: Option<String>,
    loop_id: String,
    /// Set once the vault is there, with the repository's excludes ([`Repo::ready`]).
    ready: std::sync::OnceLock<()>,
}

impl Repo {
    /// The repository `work_tree` is in, or `None` when it is in none (or git cannot run).
    /// `state_dir` is left out of every checkpoint and holds the vault; `index` names the loop's
    /// own index file there (`checkpoint` for the loop's tree, `lane-N` for a task's).
    pub fn open(work_tree: &Path, state_dir: &Path, loop_id: &str, index: &str) -> Option<Repo> {
        let top = run(git_in(work_tree).args(["rev-parse", "--show-toplevel"])).ok()?;
        // Made if missing (a fleet worker's clone), so that it is left out of every checkpoint.
        let _ = std::os::unix::fs::DirBuilderExt::mode(
            std::fs::DirBuilder::new().recursive(true),
            0o700,
        )
        .create(state_dir);
        let top = PathBuf::from(top);
        let top = top.canonicalize().unwrap_or(top);
        // Left out by a pathspec, unless git ignores it already (then naming it is an error).
        let exclude = state_dir
            .canonicalize()
            .ok()
            .and_then(|dir| {
                dir.strip_prefix(&top)
                    .ok()
                    .and_then(|r| r.to_str().map(str::to_owned))
            })
            .filter(|rel| {
                run(git_in(work_tree)
                    .args(["check-ignore", "--quiet", "--no-index", "--"])
                    .arg(top.join(rel)))
                .is_err()
            })
            .map(|rel| format!(":(top,exclude){rel}"));
        let state_dir = state_dir
            .canonicalize()
            .unwrap_or_else(|_| state_dir.to_owned());
        let vault = state_dir.join(VAULT);
        Some(Repo {
            work_tree: work_tree.to_owned(),
            top,
            index: vault.join("indexes").join(format!("{loop_id}.{index}")),
            vault,
            state_dir,
            exclude,
            loop_id: loop_id.to_owned(),
            ready: std::sync::OnceLock::new(),
        })
    }

    /// Makes the vault if there is none (private, made whole under another name and then
    /// renamed into place, so that whoever finds it finds it whole; never through a link), and
    /// gives it the repository's excludes (`info/exclude`), which git reads from its own directory.
    /// Once a [`Repo`].
    fn ready(&self) -> Result<()> {
        if self.ready.get().is_some() {
            return Ok(());
        }
        let made = || -> std::io::Result<loopd_fs::Dir> {
            let state = loopd_fs::Dir::open(&self.state_dir)?;
            if !state.exists(VAULT) {
                let building = format!(".{VAULT}.{}", std::process::id());
                let dir = state.subdir(&building, true)?;
                crate::git::output(crate::git::command(dir.path()).args([
                    "init",
                    "--bare",
                    "--quiet",
                    "--shared=0600",
                ]))
                .map_err(std::io::Error::other)?;
                dir.subdir("indexes", true)?;
                if state.rename_new(&building, VAULT).is_err() {
                    // Another process made it first.
                    std::fs::remove_dir_all(dir.path())?;
                }
            }
            state.subdir(VAULT, false)
        };
        let vault = made().context("cannot make the checkpoints' vault")?;
        let excludes = run(git_in(&self.top).args([
            "rev-parse",
            "--path-format=absolute",
            "--git-common-dir",
        ]))
        .ok()
        .and_then(|common| std::fs::read(Path::new(&common).join("info/exclude")).ok())
        .unwrap_or_default();
        let info = vault.subdir("info", true)?;
        if info.read("exclude", 1 << 20).ok().as_ref() != Some(&excludes) {
            info.write_atomic("exclude", &excludes, false)?;
        }
        let _ = self.ready.set(());
        Ok(())
    }

    /// Whether the vault holds `object` (a commit, or anything `git cat-file -e` takes).
    fn holds(&self, object: &str) -> bool {
        self.run(&["cat-file", "-e", object]).is_ok()
    }

    /// Brings commit `commit` from the work tree's repository into the vault, alone (its history
    /// left out), unless the vault holds it: where a loop starts, or on a fleet worker what the
    /// remote (the record there) gave the clone.
    fn import(&self, commit: &str) -> Result<()> {
        if self.holds(&format!("{commit}^{{commit}}")) {
            return Ok(());
        }
        let top = self
            .top
            .to_str()
            .context("the work tree's path is not UTF-8")?;
        run(self.in_vault().args([
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-write-fetch-head",
            "--no-auto-gc",
            "--depth=1",
            top,
            commit,
        ]))
        .with_context(|| format!("cannot bring commit {commit} into the checkpoints' vault"))?;
        Ok(())
    }

    /// git in the vault alone (no work tree).
    fn in_vault(&self) -> Command {
        let mut cmd = git_in(&self.vault);
        cmd.arg("--git-dir=.");
        cmd
    }

    /// git in the work tree's own repository (what actions can write).
    fn in_repository(&self) -> Command {
        let mut cmd = git_in(&self.top);
        cmd.args(["-c", "gc.auto=0", "-c", "maintenance.auto=false"]);
        cmd
    }

    /// Copies checkpoints `(name, commit)` from the vault into the work tree's repository, each on
    /// its ref there.
    fn publish(&self, checkpoints: &[(String, String)]) -> Result<()> {
        if checkpoints.is_empty() {
            return Ok(());
        }
        let vault = self
            .vault
            .to_str()
            .context("the vault's path is not UTF-8")?;
        let mut fetch = self.in_repository();
        fetch.args([
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-write-fetch-head",
            "--no-auto-gc",
            "--no-write-commit-graph",
            vault,
        ]);
        for (name, commit) in checkpoints {
            fetch.arg(format!("+{commit}:{}", self.ref_name(name)));
        }
        run(&mut fetch).context("cannot copy checkpoints into the repository")?;
        Ok(())
    }

    /// [`Repo::publish`], a failure only logged: the record is the vault's, the copy a courtesy.
    fn publish_or_warn(&self, checkpoints: &[(String, String)]) {
        if let Err(e) = self.publish(checkpoints) {
            tracing::warn!("loop {}: {e:#}", self.loop_id);
        }
    }

    /// The copies of this loop's checkpoints in the work tree's repository that are not as the
    /// vault records them (moved or removed), each put back. Refs of the loop's there that the
    /// vault does not know (made by hand, or before the vault) are not loopd's and left alone.
    pub fn check(&self) -> Result<Vec<Tampered>> {
        let recorded = self.list()?;
        if recorded.is_empty() {
            return Ok(Vec::new());
        }
        let prefix = self.ref_name("");
        let found = run(self.in_repository().args([
            "for-each-ref",
            "--format=%(objectname) %(refname)",
            prefix.as_str(),
        ]))?;
        let found: std::collections::HashMap<&str, &str> = found
            .lines()
            .filter_map(|l| {
                let (commit, name) = l.split_once(' ')?;
                Some((name.strip_prefix(&prefix)?, commit))
            })
            .collect();
        let tampered: Vec<Tampered> = recorded
            .iter()
            .filter(|(name, commit)| found.get(name.as_str()) != Some(&commit.as_str()))
            .map(|(name, commit)| Tampered {
                name: name.clone(),
                ref_name: self.ref_name(name),
                found: found.get(name.as_str()).map(|c| (*c).to_owned()),
                recorded: commit.clone(),
            })
            .collect();
        let back: Vec<(String, String)> = tampered
            .iter()
            .map(|t| (t.name.clone(), t.recorded.clone()))
            .collect();
        self.publish_or_warn(&back);
        Ok(tampered)
    }

    /// The ref of this loop's checkpoint `name`.
    fn ref_name(&self, name: &str) -> String {
        format!("refs/loopd/{}/{name}", self.loop_id)
    }

    /// git with the vault as its directory, the work tree as its work tree and the loop's own
    /// index.
    fn git(&self) -> Command {
        let mut cmd = git_in(&self.work_tree);
        cmd.arg("--git-dir")
            .arg(&self.vault)
            .arg("--work-tree")
            .arg(&self.top)
            .env("GIT_INDEX_FILE", &self.index);
        cmd
    }

    /// Runs git; its standard output, trimmed, or its last line of errors.
    fn run<S: AsRef<OsStr>>(&self, args: &[S]) -> Result<String> {
        run(self.git().args(args))
    }

    /// Records the work tree as checkpoint `name`, the child of the loop's checkpoint `parent`
    /// (else of HEAD, if the repository has one); returns it with what changed since `parent`.
    pub fn record(&self, name: &str, parent: Option<&str>) -> Result<Checkpoint> {
        self.ready()?;
        let parent = match parent {
            Some(parent) => Some(parent.to_owned()),
            None => run(self.in_repository().args([
                "rev-parse",
                "--verify",
                "--quiet",
                "HEAD^{commit}",
            ]))
            .ok(),
        };
        if let Some(parent) = &parent {
            self.import(parent)?;
        }
        // A new index starts as the parent's tree: what the checkpoint leaves out (the state
        // directory) stays as the parent has it, rather than looking deleted.
        if let Some(parent) = &parent
            && !self.index.exists()
        {
            self.run(&["read-tree", parent])?;
        }
        let tree = self.tree_now()?;
        let message = format!("loopd: loop {}, {name}", self.loop_id);
        let mut commit = vec!["commit-tree", tree.as_str(), "-m", message.as_str()];
        if let Some(parent) = &parent {
            commit.extend(["-p", parent.as_str()]);
        }
        let commit = self.run(&commit)?;
        self.keep(name, &commit)?;
        let mut checkpoint = Checkpoint {
            name: name.to_owned(),
            commit,
            ..Checkpoint::default()
        };
        if let Some(parent) = parent {
            self.count_changes(&parent, &mut checkpoint)?;
        }
        Ok(checkpoint)
    }

    /// Makes `commit` checkpoint `name` in the vault, and copies it into the work tree's
    /// repository.
    fn keep(&self, name: &str, commit: &str) -> Result<()> {
        self.run(&["update-ref", &self.ref_name(name), commit])?;
        self.publish_or_warn(&[(name.to_owned(), commit.to_owned())]);
        Ok(())
    }

    /// Files, inserted and deleted lines from `from` to the checkpoint (a binary file counts as a
    /// file with no lines).
    pub fn count_changes(&self, from: &str, checkpoint: &mut Checkpoint) -> Result<()> {
        let numstat = self.run(&[
            "diff",
            "--numstat",
            "--no-renames",
            "--no-ext-diff",
            "--no-textconv",
            from,
            &checkpoint.commit,
        ])?;
        for line in numstat.lines() {
            let mut fields = line.split('\t');
            let mut count = || {
                fields
                    .next()
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            checkpoint.insertions += count();
            checkpoint.deletions += count();
            checkpoint.files += 1;
        }
        Ok(())
    }

    /// This loop's checkpoints, oldest first: `(name, commit)`.
    pub fn list(&self) -> Result<Vec<(String, String)>> {
        if !self.vault.join("HEAD").exists() {
            return Ok(Vec::new());
        }
        let prefix = self.ref_name("");
        let refs = self.run(&[
            "for-each-ref",
            "--format=%(objectname) %(refname)",
            prefix.as_str(),
        ])?;
        let mut found: Vec<(String, String)> = refs
            .lines()
            .filter_map(|l| {
                let (commit, name) = l.split_once(' ')?;
                Some((name.strip_prefix(&prefix)?.to_owned(), commit.to_owned()))
            })
            .collect();
        found.sort_by_key(|(name, _)| order(name));
        Ok(found)
    }

    /// The commit of checkpoint `name`.
    pub fn find(&self, name: &str) -> Result<String> {
        let list = self.list()?;
        let why = match list.iter().find(|(n, _)| n == name) {
            Some((_, commit)) => return Ok(commit.clone()),
            None if list.is_empty() => format!("loop {} has no checkpoint", self.loop_id),
            None => format!(
                "loop {} has no checkpoint {name:?}; it has: {}",
                self.loop_id,
                list.iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        Err(Refused(why).into())
    }

    /// The first parent of `commit`, when it has one.
    pub fn parent(&self, commit: &str) -> Option<String> {
        self.run(&["rev-parse", "--verify", "--quiet", &format!("{commit}^1")])
            .ok()
    }

    /// The patch from `from` to `to` (commits), with a summary of the files first.
    pub fn diff(&self, from: &str, to: &str) -> Result<String> {
        let mut out = self.run(&[
            "diff",
            "--stat",
            "--no-renames",
            "--no-ext-diff",
            "--no-textconv",
            from,
            to,
        ])?;
        let patch = self.run(&[
            "diff",
            "--no-renames",
            "--no-color",
            "--no-ext-diff",
            "--no-textconv",
            from,
            to,
        ])?;
        if !patch.is_empty() {
            out.push_str("\n\n");
            out.push_str(&patch);
        }
        Ok(out)
    }

    /// The tree of the work tree as it is now (as a checkpoint would record it, recording none).
    fn tree_now(&self) -> Result<String> {
        let mut add = vec!["add", "--all", "--", ":/"];
        if let Some(exclude) = &self.exclude {
            add.push(exclude);
        }
        self.run(&add)?;
        self.run(&["write-tree"])
    }

    /// Puts the work tree back as it was at checkpoint `name`: its files written, the files made
    /// since removed (ignored files and the state directory are left alone). Refused when the
    /// work tree holds changes no checkpoint of the loop holds, unless `force`. Returns the
    /// checkpoint's commit.
    pub fn rollback(&self, name: &str, force: bool) -> Result<String> {
        let target = self.find(name)?;
        let now = self.tree_now()?;
        let trees = self.run(&["for-each-ref", "--format=%(tree)", &self.ref_name("")])?;
        if !force && !trees.lines().any(|t| t == now) {
            return Err(Refused(format!(
                "the work tree has changes that no checkpoint of loop {} holds; commit or stash them \
                 first, or roll back with --force to lose them",
                self.loop_id
            ))
            .into());
        }
        let made_since = self.run(&[
            "diff-tree",
            "-r",
            "--name-only",
            "--no-renames",
            "--diff-filter=A",
            "-z",
            &format!("{target}^{{tree}}"),
            &now,
        ])?;
        self.run(&["read-tree", &target])?;
        self.run(&["checkout-index", "--all", "--force"])?;
        for path in made_since.split('\0').filter(|p| !p.is_empty()) {
            let path = self.top.join(path);
            // Files and links only: a directory (a submodule added since) is left as it is.
            if path.symlink_metadata().is_ok_and(|m| !m.is_dir()) {
                std::fs::remove_file(&path)
                    .with_context(|| format!("cannot remove {}", path.display()))?;
            }
        }
        Ok(target)
    }

    /// Merges checkpoint commit `theirs` (made from `base`) into `ours` with git's three-way merge
    /// (`git merge-tree`, nothing checked out), recording a clean result as checkpoint `name`,
    /// the child of both. A conflict records nothing and names the files.
    pub fn merge(&self, name: &str, base: &str, ours: &str, theirs: &str) -> Result<Merge> {
        self.ready()?;
        for commit in [base, ours, theirs] {
            self.import(commit)?;
        }
        let output = crate::git::own_output(self.git().args([
            "merge-tree",
            "--write-tree",
            "--name-only",
            "--no-messages",
            "-z",
            &format!("--merge-base={base}"),
            ours,
            theirs,
        ]))
        .context("cannot run git")?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let mut fields = stdout.split('\0').filter(|f| !f.is_empty());
        let tree = fields.next().unwrap_or_default().trim().to_owned();
        match output.status.code() {
            Some(0) => {}
            // Conflicts: the tree, then the conflicted files.
            Some(1) => {
                let mut files: Vec<String> = fields.map(str::to_owned).collect();
                files.dedup();
                return Ok(Merge::Conflict(files));
            }
            _ => {
                let stderr = String::from_utf8_lossy(&output.stderr);
                anyhow::bail!(
                    "git merge-tree: {}",
                    stderr.lines().last().unwrap_or("failed").trim()
                );
            }
        }
        let message = format!("loopd: loop {}, {name}", self.loop_id);
        let commit = self.run(&[
            "commit-tree",
            &tree,
            "-m",
            &message,
            "-p",
            ours,
            "-p",
            theirs,
        ])?;
        self.keep(name, &commit)?;
        let mut checkpoint = Checkpoint {
            name: name.to_owned(),
            commit,
            ..Checkpoint::default()
        };
        self.count_changes(ours, &mut checkpoint)?;
        Ok(Merge::Clean(checkpoint))
    }

    /// Moves the work tree from checkpoint commit `from`, where it is, to `to`: the files that
    /// differ are written or removed (`git read-tree -m -u` in the loop's index), refused when
    /// that would lose a change made since `from`.
    pub fn advance(&self, from: &str, to: &str) -> Result<()> {
        let now = self.tree_now()?;
        let recorded = self.run(&["rev-parse", &format!("{from}^{{tree}}")])?;
        if now != recorded {
            return Err(Refused(format!(
                "the work tree of loop {} changed since its checkpoint {from}; the merged tasks \
                 are kept as checkpoints but not written over it",
                self.loop_id
            ))
            .into());
        }
        self.run(&["read-tree", "-m", "-u", from, to])?;
        Ok(())
    }

    /// Writes the files of checkpoint commit `commit` from the vault into a work tree made
    /// without them (a task's, `git worktree add --no-checkout`), then gives that work tree's own
    /// index the same files (`git reset`), so that git there sees them unchanged.
    pub fn fill(&self, commit: &str) -> Result<()> {
        self.ready()?;
        self.forget_index();
        self.run(&["read-tree", commit])?;
        self.run(&["checkout-index", "--all", "--force"])?;
        run(self.in_repository().args(["reset", "--quiet"]))?;
        Ok(())
    }

    /// Removes the loop's index file, so that the next checkpoint starts from its parent's tree
    /// (on a fleet worker, whose last checkpoint another worker may have recorded).
    pub fn forget_index(&self) {
        let _ = std::fs::remove_file(&self.index);
    }

    /// Removes all but the last `keep` checkpoints of the loop (its start is always kept).
    pub fn prune(&self, keep: usize) -> Result<usize> {
        let list = self.list()?;
        let actions: Vec<&(String, String)> = list.iter().filter(|(n, _)| n != START).collect();
        let drop = actions.len().saturating_sub(keep);
        if drop == 0 {
            return Ok(0);
        }
        for (name, _) in &actions[..drop] {
            let ref_name = self.ref_name(name);
            self.run(&["update-ref", "-d", &ref_name])?;
            if let Err(why) = run(self.in_repository().args(["update-ref", "-d", &ref_name])) {
                tracing::warn!(
                    "loop {}: cannot remove the copy of {ref_name}: {why:#}",
                    self.loop_id
                );
            }
        }
        // What the dropped checkpoints alone held goes once git finds enough of it loose.
        let _ = run(self
            .in_vault()
            .args(["-c", "gc.autoDetach=false", "gc", "--auto", "--quiet"]));
        Ok(drop)
    }
}

/// Removes the index files of loop `id`'s tasks' work trees from the vault in `state_dir`.
pub fn forget_lane_indexes(state_dir: &Path, id: &str) {
    let prefix = format!("{id}.lane-");
    let Ok(entries) = std::fs::read_dir(state_dir.join(VAULT).join("indexes")) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// How a merge of two checkpoints went ([`Repo::merge`]).
#[derive(Debug)]
pub enum Merge {
    Clean(Checkpoint),
    /// The files both sides changed in ways git cannot put together.
    Conflict(Vec<String>),
}

/// Why a task's checkpoint could not be merged, as its next prompt says: `files` in conflict.
pub fn conflict_reason(files: &[String]) -> String {
    format!(
        "{} changed by the tasks merged before it too, in ways git cannot put together",
        files.join(", ")
    )
}

/// The most entries [`files_fingerprint`] looks at: a larger tree is not fingerprinted.
const FINGERPRINT_MAX_ENTRIES: usize = 100_000;

/// Without git, a fingerprint of a work tree's files: their names, kinds, sizes and modification
/// times, `.git` and `leave_out` (the state directory) left out, links not followed. Two
/// fingerprints differ when a file was made, removed, renamed or written (the time of a write
/// within the clock's tick of the one before aside). `None` past 100,000 entries or when the tree
/// cannot be read.
pub fn files_fingerprint(tree: &Path, leave_out: &[&Path]) -> Option<u64> {
    use std::hash::{Hash as _, Hasher as _};
    use std::os::unix::fs::MetadataExt as _;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let mut dirs = vec![tree.to_owned()];
    let mut seen = 0usize;
    while let Some(dir) = dirs.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&dir).ok()?.flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            seen += 1;
            if seen > FINGERPRINT_MAX_ENTRIES {
                return None;
            }
            let path = entry.path();
            if entry.file_name() == ".git" || leave_out.iter().any(|l| path == *l) {
                continue;
            }
            let Ok(meta) = entry.metadata() else {
                continue;
            };
            path.strip_prefix(tree).unwrap_or(&path).hash(&mut hasher);
            (meta.mode(), meta.size(), meta.mtime(), meta.mtime_nsec()).hash(&mut hasher);
            if meta.is_dir() {
                dirs.push(path);
            }
        }
    }
    Some(hasher.finish())
}

/// A checkpoint's place in the loop: by iteration, then as named.
fn order(name: &str) -> (u64, String) {
    let (n, _) = name.split_once('-').unwrap_or((name, ""));
    (n.parse().unwrap_or(u64::MAX), name.to_owned())
}

/// `git -C dir`, committing as loopd ([`crate::git::as_loopd`]).
fn git_in(dir: &Path) -> Command {
    crate::git::as_loopd(dir)
}

fn run(cmd: &mut Command) -> Result<String> {
    crate::git::output(cmd).map_err(|why| anyhow::anyhow!("git: {why}"))
}

/// A loop's checkpoints as its daemon records them: each the child of the one before.
pub struct Recorder {
    repo: Repo,
    /// The last checkpoint recorded or rolled back to: `(name, commit)`.
    last: (String, String),
    /// How many checkpoints of actions the loop has (at least).
    count: usize,
    keep: usize,
}

impl Recorder {
    /// The recorder of a loop whose work tree is `work_tree`, or `None` outside a git repository.
    /// Records where the loop started ([`START`]) if it has no checkpoint yet.
    pub fn start(repo: Option<Repo>, keep: usize) -> Result<Option<Recorder>> {
        let Some(repo) = repo else {
            return Ok(None);
        };
        // A git killed while it wrote the loop's index leaves its lock behind, which would refuse
        // every checkpoint after; nothing else writes that index while the loop starts.
        let mut lock = repo.index.clone().into_os_string();
        lock.push(".lock");
        let _ = std::fs::remove_file(lock);
        let mut list = repo.list()?;
        let count = list.iter().filter(|(name, _)| name != START).count();
        let last = match list.pop() {
            Some(last) => last,
            None => (START.to_owned(), repo.record(START, None)?.commit),
        };
        Ok(Some(Recorder {
            repo,
            last,
            count,
            keep,
        }))
    }

    /// Records checkpoint `name` of the work tree as it is now.
    pub fn record(&mut self, name: &str) -> Result<Checkpoint> {
        let checkpoint = self.repo.record(name, Some(&self.last.1))?;
        self.last = (name.to_owned(), checkpoint.commit.clone());
        self.count += 1;
        if self.count > self.keep {
            self.repo.prune(self.keep)?;
            self.count = self.keep;
        }
        Ok(checkpoint)
    }

    /// The name of the checkpoint the work tree is at, as far as the loop knows.
    pub fn last(&self) -> &str {
        &self.last.0
    }

    /// The commit of that checkpoint.
    pub fn last_commit(&self) -> &str {
        &self.last.1
    }

    /// The repository.
    pub fn repo(&self) -> &Repo {
        &self.repo
    }

    /// Where a batch of tasks starts: the last checkpoint, or when the work tree changed since
    /// (a file an action that records none wrote), a new one, `name`.
    pub fn base(&mut self, name: &str) -> Result<String> {
        let recorded = self
            .repo
            .run(&["rev-parse", &format!("{}^{{tree}}", self.last.1)])?;
        if self.repo.tree_now()? != recorded {
            self.record(name)?;
        }
        Ok(self.last.1.clone())
    }

    /// Merges checkpoint `theirs` (made from `base`) into the last checkpoint as `name` (see
    /// [`Repo::merge`]); a clean merge becomes the last checkpoint, the work tree not yet moved.
    pub fn merge(&mut self, name: &str, base: &str, theirs: &str) -> Result<Merge> {
        let merge = self.repo.merge(name, base, &self.last.1, theirs)?;
        if let Merge::Clean(checkpoint) = &merge {
            self.last = (name.to_owned(), checkpoint.commit.clone());
            self.count += 1;
        }
        Ok(merge)
    }

    /// Moves the work tree from commit `from` to the last checkpoint ([`Repo::advance`]), then
    /// prunes the oldest checkpoints past those kept.
    pub fn catch_up(&mut self, from: &str) -> Result<()> {
        if from != self.last.1 {
            self.repo.advance(from, &self.last.1)?;
        }
        if self.count > self.keep {
            self.repo.prune(self.keep)?;
            self.count = self.keep;
        }
        Ok(())
    }

    /// Puts the work tree back as it was at checkpoint `name`, whatever changed since; returns
    /// its commit.
    pub fn rollback(&mut self, name: &str) -> Result<String> {
        let commit = self.repo.rollback(name, true)?;
        self.last = (name.to_owned(), commit.clone());
        Ok(commit)
    }
}
