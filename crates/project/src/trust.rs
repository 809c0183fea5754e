//! Trust before running a project's own commands, as `direnv allow` and `mise trust` do.
//!
//! A project's `.loop/config.toml` and `.loop/actions/**.md` can set any command loopd runs, and
//! they arrive with a cloned repository. They take effect only once the user has run `loopd trust`
//! in the project, which records a SHA-256 digest of each file in the user's config dir
//! (`~/.config/loopd/trusted/`, one record per project). A daemon compares the digests of the very
//! bytes it loaded with the record, so a file changed after `loopd trust` is untrusted again.
//! Built-in, user-level and `--config` files are the user's own and always trusted.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use loopd_fs::Dir;

use crate::project_file::{ProjectFile, sha256_hex};

/// A project file that is not trusted: bad input, so exit 2.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} {}: a project's files can set the commands loopd runs; review it, then run `{}`",
    file.display(),
    if *changed { "changed since it was trusted" } else { "is not trusted" },
    trust_command(root)
)]
pub struct Untrusted {
    pub file: PathBuf,
    pub changed: bool,
    pub root: PathBuf,
}

/// Whether a project's files may run.
#[derive(Debug)]
pub enum Verdict {
    /// The project has no file that sets what runs.
    NothingToTrust,
    /// Every such file is trusted as it is.
    Trusted(usize),
    Untrusted(Untrusted),
}

/// The record `loopd trust` writes for a project.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Record {
    root: PathBuf,
    trusted_at: String,
    /// Digest by absolute path.
    files: BTreeMap<PathBuf, String>,
}

/// Checks the files a daemon loaded against the project's record.
pub fn verdict(root: &Path, files: &[&ProjectFile]) -> Verdict {
    if files.is_empty() {
        return Verdict::NothingToTrust;
    }
    let record = read_record(root);
    for file in files {
        let recorded = record.as_ref().and_then(|r| r.files.get(&file.path));
        if recorded != Some(&file.digest) {
            return Verdict::Untrusted(Untrusted {
                file: file.path.clone(),
                changed: recorded.is_some(),
                root: root.to_owned(),
            });
        }
    }
    Verdict::Trusted(files.len())
}

/// Refuses files that are not trusted.
pub fn check(root: &Path, files: &[&ProjectFile]) -> Result<(), Untrusted> {
    match verdict(root, files) {
        Verdict::Untrusted(u) => Err(u),
        Verdict::NothingToTrust | Verdict::Trusted(_) => Ok(()),
    }
}

/// Every file of a project that can change what runs, as it is now: the project config and the
/// action files of every workflow that exist.
pub fn project_files(root: &Path) -> io::Result<Vec<ProjectFile>> {
    let mut paths = vec![crate::config::Config::project_file(root)];
    for workflow in loopd_core::workflow::all() {
        for action in workflow.actions() {
            paths.push(crate::actions::project_file(root, workflow.name(), action));
        }
    }
    let mut files = Vec::new();
    for path in paths {
        match loopd_fs::read_text(&path) {
            Ok(text) => files.push(ProjectFile::new(&path, &text)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(files)
}

/// Records `files` as trusted for `root`, replacing any earlier record; returns the record's path.
pub fn allow(root: &Path, files: &[ProjectFile]) -> io::Result<PathBuf> {
    let record = Record {
        root: root.to_owned(),
        trusted_at: loopd_core::state::format_ts(chrono::Utc::now()),
        files: files
            .iter()
            .map(|f| (f.path.clone(), f.digest.clone()))
            .collect(),
    };
    let mut text = String::from(
        "# Written by `loopd trust`: these files of the project may set what loopd runs,\n\
         # as long as their SHA-256 digest is the one recorded here.\n",
    );
    text.push_str(&toml::to_string(&record).map_err(io::Error::other)?);
    let dir = records_dir(true)?;
    let name = record_name(root);
    dir.write_atomic(&name, text.as_bytes(), true)?;
    forget_gone(&dir);
    Ok(dir.join(&name))
}

/// Forgets projects that no longer exist (the demo's temporary directories, say).
fn forget_gone(dir: &Dir) {
    for name in dir.entries().unwrap_or_default() {
        let gone =
            name.ends_with(".toml") && parse_record(dir, &name).is_some_and(|r| !r.root.exists());
        if gone {
            let _ = dir.remove(&name);
        }
    }
}

/// Removes the project's record; returns whether there was one.
pub fn revoke(root: &Path) -> io::Result<bool> {
    let dir = match records_dir(false) {
        Ok(dir) => dir,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    match dir.remove(&record_name(root)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The command that trusts `root`, as the user would type it.
pub fn trust_command(root: &Path) -> String {
    let here = std::env::current_dir()
        .ok()
        .and_then(|d| d.canonicalize().ok());
    if here.as_deref() == Some(root) {
        "loopd trust".to_owned()
    } else {
        format!("loopd --root {} trust", root.display())
    }
}

fn read_record(root: &Path) -> Option<Record> {
    let record = parse_record(&records_dir(false).ok()?, &record_name(root))?;
    // A record names its root: a clash of names would take a SHA-256 collision, but check anyway.
    (record.root == root).then_some(record)
}

fn parse_record(dir: &Dir, name: &str) -> Option<Record> {
    let bytes = dir.read(name, loopd_fs::USER_FILE_CAP).ok()?;
    toml::from_str(std::str::from_utf8(&bytes).ok()?).ok()
}

/// `~/.config/loopd/trusted`, private, created when `create` is set.
fn records_dir(create: bool) -> io::Result<Dir> {
    let user = crate::config::user_dir().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "neither $XDG_CONFIG_HOME nor $HOME is set",
        )
    })?;
    records_in(&user, "trusted", create)
}

/// `sub` of a directory of the user's (made private, with its parents, when `create` is set).
pub fn records_in(user: &Path, sub: &str, create: bool) -> io::Result<Dir> {
    if create {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(loopd_fs::DIR_MODE)
            .create(user)?;
    }
    Dir::open(user)?.subdir(sub, create)
}

/// The name of a project's record among the user's: a hash of its root.
pub fn record_name(root: &Path) -> String {
    use std::os::unix::ffi::OsStrExt as _;
    format!("{}.toml", &sha256_hex(root.as_os_str().as_bytes())[..32])
}
