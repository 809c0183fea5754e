//! A worker's work trees of loops whose project is a git remote ([`crate::GitSource`]): how a
//! loop's work follows it from machine to machine.
//!
//! Theory of operation: a worker keeps a cache directory of its own (locked, so no two workers
//! share one): `clones/KEY`, one bare repository per remote (KEY a digest of its URL), and
//! `trees/ID`, a work tree of that clone per loop (`git worktree`). Before an action the worker
//! fetches the loop's branch `loopd/ID` and its checkpoint refs (nothing else of the remote), and
//! puts the loop's work tree at the commit its workflow names, the loop's last checkpoint: tracked
//! files reset, untracked ones removed, ignored ones (build outputs) and loopd's state directory
//! kept. After a successful action that changes the work tree the checkpoint is recorded as the
//! file driver records it ([`loopd_exec::checkpoint`]) and pushed, branch and checkpoint ref at
//! once (`--atomic`), the branch with a lease on the value fetched before the action: an attempt
//! that another worker took over meanwhile cannot overwrite its work. The notes its agents left in
//! the loop's progress directory go with it (`refs/loopd-notes/ID/CHECKPOINT`), and come back into
//! the progress directory before the next action, on whichever worker. What a failed or interrupted
//! attempt left is never pushed, and the next attempt starts from the checkpoint again. git's own
//! credentials serve (helpers, SSH agent); it never prompts.
//!
//! A work tree no action used for a grace period is removed ([`Cache::sweep`]), and a clone left
//! without work trees with it: the loops' work is on the remote, and a worker that takes a loop
//! again fetches it.

use loopd_exec::metrics::metrics;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use loopd_core::state::Checkpoint;
use sha2::Digest as _;

use crate::GitSource;

/// The longest one git command may take (a fetch of a large history, say) before the attempt
/// fails with a timeout: a remote that stops answering must not hold an attempt forever.
const GIT_TIMEOUT: Duration = Duration::from_secs(600);

/// The largest note of a progress directory that follows its loop (an instrumented program's
/// log can be larger; it stays where it was written).
const NOTE_CAP: i64 = 1 << 20;

/// loopd's own index of a loop's notes, in its progress directory.
const NOTES_INDEX: &str = "notes.index";

/// The ref of loop `id`'s notes as they were at its checkpoint `commit`: an attempt that was
/// given up after its push leaves its notes under its own checkpoint, not the next attempt's.
fn notes_ref(id: &str, commit: &str) -> String {
    format!("refs/loopd-notes/{id}/{commit}")
}

/// Whether a progress directory's file `name` is a note that follows the loop: not loopd's own
/// index files.
fn is_note(name: &str) -> bool {
    !name.starts_with('.')
        && !name.contains('/')
        && !name.starts_with("checkpoint.index")
        && !name.starts_with(NOTES_INDEX)
}

/// The notes in a progress directory, by name: its plain files of up to [`NOTE_CAP`] bytes that
/// are not loopd's own.
fn notes_in(progress: &loopd_fs::Dir) -> Result<Vec<String>> {
    let mut names = progress.entries()?;
    names.sort();
    names.retain(|name| {
        is_note(name)
            && progress
                .stat(name)
                .ok()
                .flatten()
                .is_some_and(|s| loopd_fs::is_plain(&s) && s.st_size <= NOTE_CAP)
    });
    Ok(names)
}

/// The branch a loop's work goes to.
fn branch(id: &str) -> String {
    format!("refs/heads/loopd/{id}")
}

/// A worker's clones and work trees.
pub struct Cache {
    dir: PathBuf,
    /// Held while the worker runs: another worker given the same directory refuses to start.
    _lock: File,
    /// One git command that changes a clone at a time (fetches and work trees of its loops).
    clones: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    trees: Mutex<Trees>,
}

/// Which work trees an attempt uses now, and when each was last used.
struct Trees {
    busy: HashSet<String>,
    used: HashMap<String, Instant>,
    /// Trees this worker found at its start count as used then.
    opened: Instant,
}

impl Cache {
    /// Opens (creating it 0700) the cache directory `dir`, which no other worker may use at
    /// the same time.
    pub fn open(dir: &Path) -> Result<Cache> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create the worker's cache {}", dir.display()))?;
        for sub in ["clones", "trees"] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir.join(sub))
                .with_context(|| format!("cannot create {}", dir.join(sub).display()))?;
        }
        let lock = loopd_fs::Dir::open(dir)
            .and_then(|d| d.open_rw("lock"))
            .with_context(|| format!("cannot open {}", dir.join("lock").display()))?;
        if let Err(std::fs::TryLockError::WouldBlock) = lock.try_lock() {
            anyhow::bail!(
                "another worker uses the cache {}: give each worker a name of its own (--name)",
                dir.display()
            );
        }
        Ok(Cache {
            dir: dir.to_owned(),
            _lock: lock,
            clones: Mutex::default(),
            trees: Mutex::new(Trees {
                busy: HashSet::new(),
                used: HashMap::new(),
                opened: Instant::now(),
            }),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The clone of `remote` in this cache.
    fn clone_dir(&self, remote: &str) -> PathBuf {
        let digest = sha2::Sha256::digest(remote.as_bytes());
        let key: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join("clones").join(key)
    }

    /// Loop `id`'s work tree, or the tree of its lane `lane` (one of the tasks it develops at
    /// once), checked out at `commit` (fetched from the remote first): kept by this worker's sweep
    /// until the returned [`Tree`] is dropped.
    pub async fn check_out(
        self: &Arc<Self>,
        source: &GitSource,
        id: &str,
        lane: Option<u32>,
        commit: &str,
    ) -> Result<Tree> {
        anyhow::ensure!(loopd_core::state::is_loop_id(id), "not a loop id: {id:?}");
        let clone = self.clone_dir(&source.remote);
        let name = match lane {
            Some(lane) => format!("{id}.lane-{lane}"),
            None => id.to_owned(),
        };
        let mut tree = Tree {
            cache: self.clone(),
            path: self.dir.join("trees").join(&name),
            repo: clone,
            id: id.to_owned(),
            name,
            seen: None,
        };
        self.trees
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .busy
            .insert(tree.name.clone());
        let one = self.one_at_a_time(&tree.repo);
        let placed = {
            let _one = one.lock().await;
            match tree.fetch(source, commit).await {
                Ok(seen) => {
                    tree.seen = seen;
                    tree.place(commit).await
                }
                // The clone is at fault, not the remote, if the remote answers.
                Err(e) if reachable(&self.dir, source, id).await => Err(e),
                Err(e) => return Err(e),
            }
        };
        match placed {
            Ok(()) => Ok(tree),
            Err(e) => {
                tree.forget().await;
                Err(e)
            }
        }
    }

    /// The lock of `clone`'s fetches and work tree changes.
    fn one_at_a_time(&self, clone: &Path) -> Arc<tokio::sync::Mutex<()>> {
        let mut clones = self.clones.lock().unwrap_or_else(PoisonError::into_inner);
        clones.entry(clone.to_owned()).or_default().clone()
    }

    /// Removes the work trees no attempt used for `grace` (those found at the worker's start
    /// count as used then); returns the loops whose trees it removed.
    pub async fn sweep(&self, grace: Duration) -> Vec<String> {
        let mut removed = Vec::new();
        {
            // Held while the trees go: no attempt takes one up meanwhile.
            let mut trees = self.trees.lock().unwrap_or_else(PoisonError::into_inner);
            let names = std::fs::read_dir(self.dir.join("trees"))
                .map(|entries| {
                    entries
                        .filter_map(|e| e.ok()?.file_name().into_string().ok())
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default();
            for id in names {
                let used = trees.used.get(&id).copied().unwrap_or(trees.opened);
                if trees.busy.contains(&id) || used.elapsed() < grace {
                    continue;
                }
                let path = self.dir.join("trees").join(&id);
                match std::fs::remove_dir_all(&path) {
                    Ok(()) => {
                        trees.used.remove(&id);
                        removed.push(id);
                    }
                    Err(e) => tracing::warn!("cannot remove the work tree {}: {e}", path.display()),
                }
            }
        }
        if !removed.is_empty() {
            // The clones' records of the removed work trees; a clone left without any goes too.
            let clones = std::fs::read_dir(self.dir.join("clones"))
                .map(|e| e.filter_map(|e| Some(e.ok()?.path())).collect::<Vec<_>>())
                .unwrap_or_default();
            for clone in clones {
                let one = self.one_at_a_time(&clone);
                let _one = one.lock().await;
                let _ = git(&clone, &["worktree", "prune"]).await;
                let trees = std::fs::read_dir(clone.join("worktrees")).map_or(0, Iterator::count);
                if trees == 0
                    && let Err(e) = std::fs::remove_dir_all(&clone)
                {
                    tracing::warn!("cannot remove the clone {}: {e}", clone.display());
                }
            }
        }
        removed
    }

    /// Forgets the work tree `name` of loop `id` and the clone it came from, which an attempt
    /// found broken (a corrupt object, a full disk): the next attempt here clones again.
    async fn forget(&self, clone: &Path, id: &str, name: &str) {
        let one = self.one_at_a_time(clone);
        let _one = one.lock().await;
        tracing::warn!(
            "loop {id}: the worker's clone {} is given up after a failure of git; the next \
             attempt here clones again",
            clone.display()
        );
        for dir in [self.dir.join("trees").join(name), clone.to_owned()] {
            if let Err(e) = std::fs::remove_dir_all(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!("cannot remove {}: {e}", dir.display());
            }
        }
    }
}

/// One loop's work tree in a worker's cache, in use by an attempt.
pub struct Tree {
    cache: Arc<Cache>,
    pub path: PathBuf,
    /// The clone the work tree belongs to.
    repo: PathBuf,
    id: String,
    /// Its directory's name in the cache's `trees`: the loop's id, or its lane's.
    name: String,
    /// The remote's branch of the loop when it was fetched: the lease of the push.
    seen: Option<String>,
}

impl Tree {
    /// Fetches the loop's branch and checkpoints into the clone (made first if missing);
    /// returns the branch's commit.
    async fn fetch(&self, source: &GitSource, commit: &str) -> Result<Option<String>> {
        if !self.repo.join("HEAD").exists() {
            let _ = std::fs::remove_dir_all(&self.repo);
            git(
                self.cache.dir.as_path(),
                &["init", "--bare", "--quiet", "--", path_arg(&self.repo)?],
            )
            .await?;
        }
        let branch = branch(&self.id);
        let refs = format!("refs/loopd/{}/*", self.id);
        let notes = format!("refs/loopd-notes/{}/*", self.id);
        let started = std::time::Instant::now();
        let fetched = git(
            &self.repo,
            &[
                "fetch",
                "--no-tags",
                "--no-write-fetch-head",
                "--quiet",
                "--end-of-options",
                &source.remote,
                &format!("+{branch}:{branch}"),
                &format!("+{refs}:{refs}"),
                &format!("+{notes}:{notes}"),
            ],
        )
        .await;
        metrics().git("fetch", started.elapsed(), fetched.is_err());
        fetched.context("cannot fetch the loop's branch")?;
        git(
            &self.repo,
            &["cat-file", "-e", &format!("{commit}^{{commit}}")],
        )
        .await
        .with_context(|| format!("the loop's last checkpoint {commit} is not on the remote"))?;
        Ok(
            git(&self.repo, &["rev-parse", "--verify", "--quiet", &branch])
                .await
                .ok(),
        )
    }

    /// Puts the work tree at `commit` (made if missing): tracked files as they are there.
    async fn place(&self, commit: &str) -> Result<()> {
        if self.path.join(".git").exists() {
            git(&self.path, &["reset", "--hard", "--quiet", commit]).await?;
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
            git(&self.repo, &["worktree", "prune"]).await?;
            git(
                &self.repo,
                &[
                    "worktree",
                    "add",
                    "--detach",
                    "--force",
                    "--quiet",
                    path_arg(&self.path)?,
                    commit,
                ],
            )
            .await?;
        }
        Ok(())
    }

    /// Removes the files an earlier attempt made and no checkpoint holds; ignored files and
    /// the state directory `state_dir` (relative to the tree) stay.
    pub async fn clean(&self, state_dir: &str) -> Result<()> {
        let keep = format!("/{}/", state_dir.trim_matches('/'));
        git(&self.path, &["clean", "-ffdq", "-e", &keep]).await?;
        Ok(())
    }

    /// Pushes `checkpoint` as the loop's branch and checkpoint ref, and `notes` as its notes, at
    /// once; refused (with the remote's reason) if the branch moved since it was fetched.
    pub async fn push(
        &self,
        source: &GitSource,
        checkpoint: &Checkpoint,
        notes: Option<&str>,
    ) -> Result<()> {
        let branch = branch(&self.id);
        let mut refspecs = vec![format!("{}:{branch}", checkpoint.commit)];
        refspecs.extend(self.checkpoint_refspecs(checkpoint, notes));
        self.push_refs(source, Some(&branch), &refspecs).await
    }

    /// Pushes `checkpoint`, of a task developed at once with others, as the loop's checkpoint
    /// ref only, and `notes` as its notes: the loop's branch moves when the batch is merged
    /// ([`Tree::push_merges`]).
    pub async fn push_checkpoint(
        &self,
        source: &GitSource,
        checkpoint: &Checkpoint,
        notes: Option<&str>,
    ) -> Result<()> {
        let refspecs = self.checkpoint_refspecs(checkpoint, notes);
        self.push_refs(source, None, &refspecs).await
    }

    /// Pushes the merges of a batch, each as a checkpoint ref with its notes, and the last as
    /// the loop's branch, at once; refused (with the remote's reason) if the branch moved since
    /// it was fetched.
    pub async fn push_merges(
        &self,
        source: &GitSource,
        merges: &[(Checkpoint, Option<String>)],
    ) -> Result<()> {
        let Some((last, _)) = merges.last() else {
            return Ok(());
        };
        let branch = branch(&self.id);
        let mut refspecs = vec![format!("{}:{branch}", last.commit)];
        for (merge, notes) in merges {
            refspecs.extend(self.checkpoint_refspecs(merge, notes.as_deref()));
        }
        self.push_refs(source, Some(&branch), &refspecs).await
    }

    /// The refspecs of `checkpoint`'s ref and, when given, of `notes` as its notes.
    fn checkpoint_refspecs(&self, checkpoint: &Checkpoint, notes: Option<&str>) -> Vec<String> {
        let (id, commit) = (&self.id, &checkpoint.commit);
        let mut refspecs = vec![format!("+{commit}:refs/loopd/{id}/{}", checkpoint.name)];
        refspecs.extend(notes.map(|notes| format!("+{notes}:{}", notes_ref(id, commit))));
        refspecs
    }

    /// Pushes `refspecs` at once, with a lease on `leased` (a branch) at its fetched value.
    async fn push_refs(
        &self,
        source: &GitSource,
        leased: Option<&str>,
        refspecs: &[String],
    ) -> Result<()> {
        let mut args = vec![
            "push".to_owned(),
            "--atomic".to_owned(),
            "--porcelain".to_owned(),
            "--quiet".to_owned(),
        ];
        if let Some(branch) = leased {
            args.push(format!(
                "--force-with-lease={branch}:{}",
                self.seen.as_deref().unwrap_or("")
            ));
        }
        args.extend(["--end-of-options".to_owned(), source.remote.clone()]);
        args.extend(refspecs.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let started = std::time::Instant::now();
        let pushed = git(&self.path, &args).await;
        metrics().git("push", started.elapsed(), pushed.is_err());
        pushed.context("cannot push the checkpoint")?;
        Ok(())
    }

    /// Puts the loop's notes as they were at its checkpoint `commit` into its progress directory
    /// `progress`: what its agents wrote there for people (`develop.md`, `changes.log`, ...),
    /// wherever they ran. Notes an attempt wrote since (one that failed, or was interrupted on
    /// this worker) are removed, as the work tree's changes are.
    pub async fn restore_notes(&self, progress: &loopd_fs::Dir, commit: &str) -> Result<()> {
        let listing = self.notes_listing(Some(&notes_ref(&self.id, commit))).await;
        for (name, object) in &listing {
            let bytes = git_bytes(&self.repo, &["cat-file", "blob", object]).await?;
            progress
                .write_atomic(name, &bytes, false)
                .with_context(|| format!("cannot write {}", progress.join(name).display()))?;
        }
        for name in notes_in(progress)? {
            if !listing.contains_key(&name) {
                progress
                    .remove(&name)
                    .with_context(|| format!("cannot remove {}", progress.join(&name).display()))?;
            }
        }
        Ok(())
    }

    /// The notes of `notes` (a notes commit or its ref), each name's blob; none where there are
    /// none.
    async fn notes_listing(&self, notes: Option<&str>) -> BTreeMap<String, String> {
        let Some(notes) = notes else {
            return BTreeMap::new();
        };
        let listing = git(&self.repo, &["ls-tree", "-z", notes])
            .await
            .unwrap_or_default();
        listing
            .split('\0')
            .filter_map(|entry| {
                // "MODE blob OBJECT\tNAME"
                let (meta, name) = entry.split_once('\t')?;
                let object = meta.strip_prefix("100644 blob ")?;
                is_note(name).then(|| (name.to_owned(), object.to_owned()))
            })
            .collect()
    }

    /// The notes commit of each of the loop's checkpoints that has notes (as fetched), by the
    /// checkpoint's commit.
    async fn notes_kept(&self) -> Result<HashMap<String, String>> {
        let prefix = format!("refs/loopd-notes/{}/", self.id);
        let listing = git(
            &self.repo,
            &["for-each-ref", "--format=%(refname) %(objectname)", &prefix],
        )
        .await?;
        Ok(listing
            .lines()
            .filter_map(|line| {
                let (name, notes) = line.split_once(' ')?;
                let commit = name.strip_prefix(&prefix)?;
                Some((commit.to_owned(), notes.to_owned()))
            })
            .collect())
    }

    /// Each merge of a batch with the loop's notes after it: those at the batch's `base`, with
    /// the notes of each task merged so far ([`Tree::merge_notes`]); `merges` gives each merge
    /// with the task's checkpoint it took.
    pub async fn notes_of_merges(
        &self,
        base: &str,
        merges: Vec<(Checkpoint, String)>,
    ) -> Result<Vec<(Checkpoint, Option<String>)>> {
        let scratch = self.cache.dir.join(format!("{}.notes", self.name));
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&scratch)
            .with_context(|| format!("cannot create {}", scratch.display()))?;
        let kept = self.notes_kept().await?;
        let at_base = kept.get(base).cloned();
        let mut notes = at_base.clone();
        let mut noted = Vec::with_capacity(merges.len());
        for (merge, theirs) in merges {
            if let Some(theirs) = kept.get(&theirs) {
                let merged = self
                    .merge_notes(&scratch, at_base.as_deref(), notes.as_deref(), theirs)
                    .await;
                notes = Some(merged?);
            }
            noted.push((merge, notes.clone()));
        }
        let _ = std::fs::remove_dir_all(&scratch);
        Ok(noted)
    }

    /// The notes `theirs` (a task's, developed at once with others) merged into `ours` (the
    /// loop's so far), both made from `base` (notes commits; none: no notes): each note as git
    /// merges text three ways, with both sides kept where they differ (`git merge-file
    /// --union`: agents append to their notes, and neither task's lines may be lost). The
    /// merged notes' commit, in `scratch` (a private directory of the worker's) meanwhile.
    async fn merge_notes(
        &self,
        scratch: &Path,
        base: Option<&str>,
        ours: Option<&str>,
        theirs: &str,
    ) -> Result<String> {
        let base = self.notes_listing(base).await;
        let ours = self.notes_listing(ours).await;
        let theirs = self.notes_listing(Some(theirs)).await;
        let mut merged = Vec::new();
        for name in ours.keys().chain(theirs.keys()).collect::<BTreeSet<_>>() {
            let [b, o, t] = [&base, &ours, &theirs].map(|l| l.get(name));
            let object = match (o, t) {
                (o, t) if o == t || t == b => o.cloned(),
                (o, t) if o == b => t.cloned(),
                // A note git cannot merge as text (an image, say): the later task's.
                _ => match self.union(scratch, [b, o, t]).await {
                    Ok(object) => Some(object),
                    Err(e) => {
                        tracing::warn!(
                            "loop {}: note {name} kept as the later task's: {e:#}",
                            self.id
                        );
                        t.or(o).cloned()
                    }
                },
            };
            merged.extend(object.map(|object| (name.clone(), object)));
        }
        let index = scratch.join(NOTES_INDEX);
        self.commit_notes(path_arg(&index)?, &merged).await
    }

    /// The blob of `[base, ours, theirs]` (blobs; none: empty) merged with both sides kept.
    async fn union(&self, scratch: &Path, sides: [Option<&String>; 3]) -> Result<String> {
        let names = ["base", "ours", "theirs"];
        for (name, side) in names.iter().zip(sides) {
            let bytes = match side {
                Some(object) => git_bytes(&self.repo, &["cat-file", "blob", object]).await?,
                None => Vec::new(),
            };
            write_private(&scratch.join(name), &bytes)?;
        }
        let [base, ours, theirs] = names.map(|n| scratch.join(n));
        let args = ["merge-file", "--union", "-p", "--"];
        let mut args: Vec<&str> = args.to_vec();
        args.extend([path_arg(&ours)?, path_arg(&base)?, path_arg(&theirs)?]);
        let merged = git_bytes(scratch, &args).await?;
        let file = scratch.join("merged");
        write_private(&file, &merged)?;
        git(&self.repo, &["hash-object", "-w", "--", path_arg(&file)?]).await
    }

    /// A commit of the notes `entries` (name and blob each), made with the index file `index`.
    async fn commit_notes(&self, index: &str, entries: &[(String, String)]) -> Result<String> {
        let _ = std::fs::remove_file(index);
        let entries: Vec<String> = entries
            .iter()
            .map(|(name, object)| format!("100644,{object},{name}"))
            .collect();
        let mut update = vec!["update-index", "--add"];
        for entry in &entries {
            update.extend(["--cacheinfo", entry.as_str()]);
        }
        git_indexed(&self.path, index, &update).await?;
        let tree = git_indexed(&self.path, index, &["write-tree"]).await?;
        let _ = std::fs::remove_file(index);
        let message = format!("loopd: loop {}, notes", self.id);
        git(&self.path, &["commit-tree", &tree, "-m", &message]).await
    }

    /// Records the notes in the progress directory `progress` (its plain files up to
    /// [`NOTE_CAP`] bytes, loopd's own left out) as a commit; `None` when there are none.
    pub async fn record_notes(&self, progress: &loopd_fs::Dir) -> Result<Option<String>> {
        let names = notes_in(progress)?;
        if names.is_empty() {
            return Ok(None);
        }
        let paths: Vec<PathBuf> = names.iter().map(|n| progress.join(n)).collect();
        let mut hash = vec!["hash-object", "-w", "--"];
        for path in &paths {
            hash.push(path_arg(path)?);
        }
        let objects = git(&self.path, &hash).await?;
        let entries: Vec<(String, String)> = names
            .into_iter()
            .zip(objects.lines().map(str::to_owned))
            .collect();
        let index = progress.join(NOTES_INDEX);
        Ok(Some(self.commit_notes(path_arg(&index)?, &entries).await?))
    }

    /// Gives up this work tree and its clone after a failure of git itself: the next attempt
    /// on this worker starts from a fresh clone.
    pub async fn forget(self) {
        self.cache.forget(&self.repo, &self.id, &self.name).await;
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let mut trees = self
            .cache
            .trees
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        trees.busy.remove(&self.name);
        trees.used.insert(self.name.clone(), Instant::now());
    }
}

/// Starts loop `id` on `remote` from commit `base` of the repository at `root`: pushes it as
/// the loop's branch and its `0-start` checkpoint.
pub async fn publish(root: &Path, remote: &str, id: &str, base: &str) -> Result<()> {
    let branch = branch(id);
    git(
        root,
        &[
            "push",
            "--porcelain",
            "--quiet",
            "--end-of-options",
            remote,
            &format!("{base}:{branch}"),
            &format!("{base}:refs/loopd/{id}/{}", loopd_exec::checkpoint::START),
        ],
    )
    .await
    .with_context(|| format!("cannot push the loop's branch to {remote}"))?;
    Ok(())
}

/// The commit `rev` names in the repository at `root`.
pub async fn resolve(root: &Path, rev: &str) -> Result<String> {
    git(
        root,
        &[
            "rev-parse",
            "--verify",
            "--end-of-options",
            &format!("{rev}^{{commit}}"),
        ],
    )
    .await
    .with_context(|| format!("{rev:?} is not a commit of {}", root.display()))
}

/// The bytes of file `path` (relative to the top of the repository at `root`) in commit `rev`.
pub async fn file_at(root: &Path, rev: &str, path: &Path) -> Result<Vec<u8>> {
    let path = path_arg(path)?;
    git_bytes(root, &["cat-file", "blob", &format!("{rev}:{path}")]).await
}

/// Whether the remote answers for loop `id`'s branch.
async fn reachable(dir: &Path, source: &GitSource, id: &str) -> bool {
    let branch = branch(id);
    let args = [
        "ls-remote",
        "--exit-code",
        "--end-of-options",
        &source.remote,
        &branch,
    ];
    git(dir, &args).await.is_ok()
}

/// A path as one argument of git's.
/// Writes `bytes` to a new file at `path`, readable by this user only (over what was there).
fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().context("a file in a directory")?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .context("a file name")?;
    loopd_fs::Dir::open(dir)?
        .write_atomic(name, bytes, false)
        .with_context(|| format!("cannot write {}", path.display()))
}

fn path_arg(path: &Path) -> Result<&str> {
    path.to_str()
        .with_context(|| format!("not a UTF-8 path: {}", path.display()))
}

/// Runs git in `dir` as loopd ([`loopd_exec::git::as_loopd`]), never prompting for a credential,
/// over the known transports only, for at most [`GIT_TIMEOUT`]; its output without the trailing
/// newline, or the line of what it printed that says why it failed.
async fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let out = run_git(dir, args, None).await?;
    Ok(String::from_utf8_lossy(&out).trim_end().to_owned())
}

/// Runs git as [`git`] does, with `index` as its index file.
async fn git_indexed(dir: &Path, index: &str, args: &[&str]) -> Result<String> {
    let out = run_git(dir, args, Some(index)).await?;
    Ok(String::from_utf8_lossy(&out).trim_end().to_owned())
}

/// Runs git as [`git`] does; its output as it printed it.
async fn git_bytes(dir: &Path, args: &[&str]) -> Result<Vec<u8>> {
    run_git(dir, args, None).await
}

async fn run_git(dir: &Path, args: &[&str], index: Option<&str>) -> Result<Vec<u8>> {
    let mut cmd = tokio::process::Command::from(loopd_exec::git::as_loopd(dir));
    cmd.args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        // A remote is a URL or path of the known transports, never a command (`ext::`).
        .env("GIT_ALLOW_PROTOCOL", "file:git:http:https:ssh")
        // Reached by the user's own ssh command, never a repository's `core.sshCommand`.
        .env("GIT_SSH_COMMAND", loopd_exec::git::ssh_command())
        .kill_on_drop(true);
    if let Some(index) = index {
        cmd.env("GIT_INDEX_FILE", index);
    }
    let output = tokio::time::timeout(GIT_TIMEOUT, loopd_exec::procs::own_output_async(&mut cmd))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "git {} took longer than {}s",
                args[0],
                GIT_TIMEOUT.as_secs()
            )
        })?
        .context("cannot run git")?;
    if output.status.success() {
        return Ok(output.stdout);
    }
    let said = format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    anyhow::bail!("git {}: {}", args[0], reason(&said));
}

/// The line of what git printed that says why it failed: the remote's own words (a hook's,
/// say) first, then a refused ref's reason, then git's first fatal error or error.
fn reason(said: &str) -> String {
    let lines: Vec<&str> = said
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let remote = lines
        .iter()
        .filter_map(|l| l.strip_prefix("remote:"))
        .map(str::trim)
        .find(|l| !l.is_empty());
    // `--porcelain`: "!\tSRC:DST\t[rejected] (stale info)".
    let refused = lines
        .iter()
        .find(|l| l.starts_with('!'))
        .and_then(|l| l.rsplit('\t').next());
    let first = |prefix: &str| lines.iter().find(|l| l.starts_with(prefix)).copied();
    remote
        .or(refused)
        .or_else(|| first("fatal:"))
        .or_else(|| first("error:"))
        .or_else(|| lines.last().copied())
        .map_or_else(|| "git failed".to_owned(), loopd_exec::result::one_line)
}

#[cfg(test)]
mod tests {
    use super::reason;

    #[test]
    fn the_reason_is_the_line_that_says_why() {
        let unreachable = "fatal: '/srv/remote.git' does not appear to be a git repository\n\
             fatal: Could not read from remote repository.\n\n\
             Please make sure you have the correct access rights\nand the repository exists.\n";
        assert_eq!(
            reason(unreachable),
            "fatal: '/srv/remote.git' does not appear to be a git repository"
        );
        let hook = "remote: \nremote: pushes to loopd/* are closed today\nTo /srv/r.git\n\
             !\tabc:refs/heads/loopd/x\t[remote rejected] (pre-receive hook declined)\n\
             error: failed to push some refs to '/srv/r.git'\n";
        assert_eq!(reason(hook), "pushes to loopd/* are closed today");
        let stale = "To /srv/r.git\n!\tabc:refs/heads/loopd/x\t[rejected] (stale info)\nDone\n\
             error: failed to push some refs to '/srv/r.git'\n";
        assert_eq!(reason(stale), "[rejected] (stale info)");
        assert_eq!(reason(""), "git failed");
    }
}
