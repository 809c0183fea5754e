//! The projects this user's loops live in: `create` and `start` record a project's root, so that
//! one service (and `loopd projects`) can find every loop on the machine.
//!
//! One small file per project in `$XDG_STATE_HOME/loopd/projects/` (else
//! `~/.local/state/loopd/projects/`), named by a hash of the root and written atomically: two
//! commands recording projects at once never lose each other's. Projects whose root is gone are
//! forgotten when the next one is recorded. A record that cannot be written costs a warning,
//! never the command.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use loopd_fs::Dir;

/// A project as recorded.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub root: PathBuf,
    pub added_at: String,
}

/// `$XDG_STATE_HOME/loopd`, else `~/.local/state/loopd`.
fn state_home() -> Option<PathBuf> {
    let absolute = |var| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    absolute("XDG_STATE_HOME")
        .map(|s| s.join("loopd"))
        .or_else(|| absolute("HOME").map(|h| h.join(".local/state/loopd")))
}

/// Where the service keeps what lives only while it runs (its lock, its status, the API's socket
/// and token): `$XDG_RUNTIME_DIR/loopd`, else `run` in loopd's state directory. Private (0700).
pub fn runtime_dir(create: bool) -> io::Result<Dir> {
    let runtime = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    match runtime {
        Some(dir) => loopd_project::trust::records_in(&dir, "loopd", create),
        None => {
            let home = state_home().ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    "none of $XDG_RUNTIME_DIR, $XDG_STATE_HOME and $HOME is set",
                )
            })?;
            loopd_project::trust::records_in(&home, "run", create)
        }
    }
}

/// The directory of the projects' records (made when `create` is set).
pub fn projects_dir(create: bool) -> io::Result<Dir> {
    let home = state_home().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "neither $XDG_STATE_HOME nor $HOME is set",
        )
    })?;
    loopd_project::trust::records_in(&home, "projects", create)
}

/// Records a project (once), and forgets those whose root is gone.
pub fn add(root: &Path) -> io::Result<()> {
    let dir = projects_dir(true)?;
    for (name, record) in records(&dir) {
        if !record.root.exists() {
            let _ = dir.remove(&name);
        }
    }
    let name = loopd_project::trust::record_name(root);
    if read(&dir, &name).is_some_and(|r| r.root == root) {
        return Ok(());
    }
    let record = Record {
        root: root.to_owned(),
        added_at: loopd_store::now_rfc3339(),
    };
    let text = toml::to_string(&record).map_err(io::Error::other)?;
    dir.write_atomic(&name, text.as_bytes(), false)
}

/// Records a project, or says in one line why it could not.
pub fn note(root: &Path) {
    if let Err(e) = add(root) {
        eprintln!(
            "loopd: warning: cannot record {} among your projects: {e}",
            root.display()
        );
    }
}

/// Every recorded project whose root is still there, by root.
pub fn list() -> io::Result<Vec<Record>> {
    let dir = match projects_dir(false) {
        Ok(dir) => dir,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut all: Vec<Record> = records(&dir)
        .into_iter()
        .map(|(_, r)| r)
        .filter(|r| r.root.exists())
        .collect();
    all.sort_by(|a, b| a.root.cmp(&b.root));
    Ok(all)
}

/// Forgets a project; returns whether it was recorded.
pub fn remove(root: &Path) -> io::Result<bool> {
    let dir = match projects_dir(false) {
        Ok(dir) => dir,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let name = loopd_project::trust::record_name(root);
    if read(&dir, &name).is_none_or(|r| r.root != root) {
        return Ok(false);
    }
    dir.remove(&name)?;
    Ok(true)
}

fn records(dir: &Dir) -> Vec<(String, Record)> {
    dir.entries()
        .unwrap_or_default()
        .into_iter()
        .filter(|name| name.ends_with(".toml"))
        .filter_map(|name| Some((name.clone(), read(dir, &name)?)))
        .collect()
}

fn read(dir: &Dir, name: &str) -> Option<Record> {
    let bytes = dir.read(name, loopd_fs::USER_FILE_CAP).ok()?;
    toml::from_str(std::str::from_utf8(&bytes).ok()?).ok()
}
