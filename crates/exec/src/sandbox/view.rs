//! The attempt's own view of the file system: a mount namespace of its own (in the user namespace
//! the child makes, so no privilege is needed), set up in the child before it enters Landlock.
//!
//! - What must not change inside where it may write is bound read-only onto itself: a git
//!   repository's control files (`config`, `hooks/`, `info/`: what git runs code from, for loopd's
//!   own git and for the user's after the loop), of the work tree's repository and, behind a
//!   `gitdir:` pointer (a worktree, a submodule), of its git directory and common directory; and
//!   the state directory (the loop's limits, status and counts, other loops, the project's
//!   config), but for the loop's progress directory, which stays writable. The directories that
//!   hold them (`.git`, a worktree's git directory) are bound onto themselves, so they cannot be
//!   renamed away and replaced by others.
//! - Where other programs keep their Unix sockets (`/run`, `$XDG_RUNTIME_DIR`, loopd's own
//!   runtime directory, the X11, ICE and tmux directories of `/tmp`, and wherever an environment
//!   variable names one) is covered by an empty read-only tmpfs, on kernels whose Landlock cannot
//!   refuse a connect by path (before ABI 9); what must stay visible there (the resolver's
//!   configuration, the sockets an executor declares) is bound back in.
//!
//! The parent plans it all ([`View::plan`]: paths resolved, missing control directories made,
//! what is bound back opened); the child only makes system calls that allocate nothing
//! ([`View::make`]). Landlock then forbids any change of mounts, so nothing inside can undo it.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use nix::mount::{MsFlags, mount};
use nix::sys::statvfs::{FsFlags, statvfs};

/// Environment variables that name another program's socket (or hold its address): removed from
/// an attempt's environment, and their sockets hidden.
pub const SOCKET_VARIABLES: [&str; 13] = [
    "SSH_AUTH_SOCK",
    "SSH_AGENT_PID",
    "GPG_AGENT_INFO",
    "DBUS_SESSION_BUS_ADDRESS",
    "DBUS_SYSTEM_BUS_ADDRESS",
    "DOCKER_HOST",
    "CONTAINER_HOST",
    "WAYLAND_DISPLAY",
    "PULSE_SERVER",
    "TMUX",
    "NOTIFY_SOCKET",
    "SWAYSOCK",
    "I3SOCK",
];

/// How deep submodules' git directories are looked for (`.git/modules/a/modules/b/...`).
const MODULE_DEPTH: usize = 4;

/// What a view is made from.
pub(super) struct Inputs<'a> {
    pub tree: &'a Path,
    /// Whether the work tree is writable (`workspace-write`): its git control files are then
    /// protected, and a worktree's git directories made writable.
    pub tree_writable: bool,
    /// The loop's state directory, and its progress directory (writable within it).
    pub state_dir: Option<&'a Path>,
    pub progress_dir: Option<&'a Path>,
    /// What the attempt needs to see (its tree, its own files, what it may write or read): never
    /// covered.
    pub needed: &'a [PathBuf],
    /// Whether other programs' sockets are covered (Landlock cannot refuse them here).
    pub mask_sockets: bool,
    /// The sockets its executor declares, reachable all the same.
    pub sockets: &'a [PathBuf],
}

/// An attempt's view, planned by the parent, made by the child.
#[derive(Debug, Default)]
pub(super) struct View {
    steps: Vec<Step>,
    /// What is bound back into a mask, open (close-on-exec) until the child has bound it, with
    /// its name in `/proc/self/fd`.
    held: Vec<(OwnedFd, CString)>,
    /// The paths bound and shown again: the view is made of what they are now.
    bound: Vec<PathBuf>,
    /// The read-only paths and the covered ones, for people (`doctor`, the tests).
    pub(super) protected: Vec<PathBuf>,
    pub(super) covered: Vec<PathBuf>,
}

/// Two views are the same when they are made the same way (whatever the descriptors' numbers).
impl PartialEq for View {
    fn eq(&self, other: &View) -> bool {
        self.steps == other.steps
            && self.bound == other.bound
            && self.protected == other.protected
            && self.covered == other.covered
    }
}

/// What the child needs of a view to make it: its steps, and the names of what it shows again.
#[derive(Clone)]
pub(super) struct Made {
    steps: Vec<Step>,
    sources: Vec<CString>,
}

/// What a bind is made from.
#[derive(Clone, Debug, PartialEq)]
enum Source {
    /// `/dev/null` (a socket covered).
    DevNull,
    /// The `n`th descriptor the view holds.
    Held(usize),
}

/// One system call's worth of the view, in order.
#[derive(Clone, Debug, PartialEq)]
enum Step {
    /// `path` bound onto itself, read-only or writable (a bind in a read-only one copies its
    /// flag), keeping the flags of the mount it is in, which a remount in a user namespace may not
    /// drop.
    Bind {
        path: CString,
        read_only: bool,
        keep: MsFlags,
    },
    /// An empty tmpfs over `path`, writable until sealed.
    Mask { path: CString },
    /// A directory made in a mask.
    MakeDir { path: CString },
    /// An empty file made in a mask, to bind a file onto.
    MakeFile { path: CString },
    /// `source` bound onto `target`.
    BindAt { source: Source, target: CString },
    /// A mask made read-only, once what it shows again is bound.
    Seal { path: CString },
}

impl View {
    /// Plans the view of an attempt.
    pub(super) fn plan(inputs: &Inputs<'_>) -> io::Result<View> {
        let mut view = View::default();
        // Bound onto themselves: (path, read-only).
        let mut binds: Vec<(PathBuf, bool)> = Vec::new();
        if inputs.tree_writable {
            let git = git_control(inputs.tree)?;
            binds.extend(git.pinned.into_iter().map(|p| (p, false)));
            binds.extend(git.read_only.into_iter().map(|p| (p, true)));
        }
        if let Some(state) = inputs.state_dir.and_then(|s| loopd_fs::real_path(s).ok()) {
            let tree = loopd_fs::real_path(inputs.tree)?;
            // Within the tree (or holding it, a loop's own worktree): read-only but for the
            // loop's progress directory and the tree itself.
            if state != tree && (state.starts_with(&tree) || tree.starts_with(&state)) {
                binds.push((state.clone(), true));
                if let Some(progress) = inputs
                    .progress_dir
                    .and_then(|p| loopd_fs::real_path(p).ok())
                {
                    binds.push((progress, false));
                }
                if tree.starts_with(&state) {
                    binds.push((tree, false));
                }
            }
        }
        // Outer first: a bind inside another is made on top of it.
        binds.sort_by_key(|(path, _)| path.components().count());
        for (path, read_only) in binds {
            let keep = locked_flags(&path)?;
            if read_only {
                view.protected.push(path.clone());
            }
            view.bound.push(path.clone());
            view.steps.push(Step::Bind {
                path: c_path(&path)?,
                read_only,
                keep,
            });
        }
        view.plan_masks(inputs)?;
        Ok(view)
    }

    /// Covers loopd's own state (the service's socket and token, the projects it knows) and,
    /// where Landlock cannot refuse them, where other programs keep their sockets; but for what
    /// the attempt needs.
    fn plan_masks(&mut self, inputs: &Inputs<'_>) -> io::Result<()> {
        let needed: Vec<PathBuf> = inputs
            .needed
            .iter()
            .filter_map(|p| loopd_fs::real_path(p).ok())
            .collect();
        // A directory may be covered when nothing needed is in it, nor it in something needed.
        let coverable = |dir: &Path| {
            !needed
                .iter()
                .any(|n| n.starts_with(dir) || dir.starts_with(n))
        };
        let mut dirs: Vec<PathBuf> = Vec::new();
        let mut sockets: Vec<PathBuf> = Vec::new();
        let candidates = loopd_state().into_iter().chain(if inputs.mask_sockets {
            socket_dirs()
        } else {
            Vec::new()
        });
        for dir in candidates {
            if let Ok(dir) = loopd_fs::real_path(&dir)
                && dir.is_dir()
                && coverable(&dir)
            {
                dirs.push(dir);
            }
        }
        let named = if inputs.mask_sockets {
            named_sockets()
        } else {
            Vec::new()
        };
        for socket in named {
            let Ok(socket) = loopd_fs::real_path(&socket) else {
                continue;
            };
            match socket.parent() {
                Some(parent) if parent != Path::new("/") && coverable(parent) => {
                    dirs.push(parent.to_owned());
                }
                _ if !needed.iter().any(|n| socket.starts_with(n)) => sockets.push(socket),
                _ => {}
            }
        }
        // A directory within another covered one is covered with it.
        dirs.sort();
        dirs.dedup();
        let outer: Vec<PathBuf> = dirs
            .iter()
            .filter(|d| !dirs.iter().any(|o| o != *d && d.starts_with(o)))
            .cloned()
            .collect();
        sockets.retain(|s| !outer.iter().any(|d| s.starts_with(d)));
        // Shown again in a covered directory: the resolver's configuration, declared sockets.
        let mut shown: Vec<PathBuf> = loopd_fs::real_path("/etc/resolv.conf")
            .into_iter()
            .chain(
                inputs
                    .sockets
                    .iter()
                    .filter_map(|s| loopd_fs::real_path(s).ok()),
            )
            .collect();
        shown.sort();
        shown.dedup();
        for dir in &outer {
            self.covered.push(dir.clone());
            let path = c_path(dir)?;
            self.steps.push(Step::Mask { path: path.clone() });
            for target in shown.iter().filter(|s| s.starts_with(dir) && *s != dir) {
                self.show_again(dir, target)?;
            }
            self.steps.push(Step::Seal { path });
        }
        for socket in sockets {
            self.covered.push(socket.clone());
            self.steps.push(Step::BindAt {
                source: Source::DevNull,
                target: c_path(&socket)?,
            });
        }
        Ok(())
    }

    /// Binds `target` back at its place in the mask over `dir`: the directories on the way made
    /// there, the target opened now (the mask will hide it) and bound from its descriptor.
    fn show_again(&mut self, dir: &Path, target: &Path) -> io::Result<()> {
        let Ok(rest) = target.strip_prefix(dir) else {
            return Ok(());
        };
        let mut on_the_way = dir.to_owned();
        let components: Vec<_> = rest.components().collect();
        for part in &components[..components.len().saturating_sub(1)] {
            on_the_way.push(part);
            self.steps.push(Step::MakeDir {
                path: c_path(&on_the_way)?,
            });
        }
        let fd: OwnedFd = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_PATH)
            .open(target)?
            .into();
        let source = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let target_c = c_path(target)?;
        self.steps.push(if target.is_dir() {
            Step::MakeDir {
                path: target_c.clone(),
            }
        } else {
            Step::MakeFile {
                path: target_c.clone(),
            }
        });
        self.steps.push(Step::BindAt {
            source: Source::Held(self.held.len()),
            target: target_c,
        });
        self.held.push((fd, source));
        self.bound.push(target.to_owned());
        Ok(())
    }

    /// The paths the view is made of: what it binds and shows again.
    pub(super) fn depends_on(&self) -> Vec<PathBuf> {
        self.bound.clone()
    }

    /// What the child needs to make it (while this view lives, holding what it shows again).
    pub(super) fn made(&self) -> Made {
        Made {
            steps: self.steps.clone(),
            sources: self.held.iter().map(|(_, name)| name.clone()).collect(),
        }
    }
}

impl Made {
    /// Makes the view: called in a child in its own user and mount namespaces, between fork and
    /// exec, where only system calls that allocate nothing may be made.
    pub(super) fn make(&self) -> io::Result<()> {
        const NONE: Option<&CStr> = None;
        // Whatever the mounts it was copied from, nothing made here propagates anywhere.
        mount(
            NONE,
            c"/",
            NONE,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            NONE,
        )?;
        for step in &self.steps {
            match step {
                Step::Bind {
                    path,
                    read_only,
                    keep,
                } => {
                    let path = path.as_c_str();
                    mount(
                        Some(path),
                        path,
                        NONE,
                        MsFlags::MS_BIND | MsFlags::MS_REC,
                        NONE,
                    )?;
                    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | *keep;
                    if *read_only {
                        flags |= MsFlags::MS_RDONLY;
                    }
                    mount(NONE, path, NONE, flags, NONE)?;
                }
                Step::Mask { path } => mount(
                    Some(c"tmpfs"),
                    path.as_c_str(),
                    Some(c"tmpfs"),
                    MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                    Some(c"mode=0755,size=64k"),
                )?,
                Step::MakeDir { path } => {
                    match nix::unistd::mkdir(path.as_c_str(), nix::sys::stat::Mode::S_IRWXU) {
                        Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                Step::MakeFile { path } => {
                    use nix::fcntl::{OFlag, open};
                    drop(open(
                        path.as_c_str(),
                        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_CLOEXEC,
                        nix::sys::stat::Mode::S_IRUSR,
                    )?);
                }
                Step::BindAt { source, target } => {
                    let source = match source {
                        Source::DevNull => c"/dev/null",
                        Source::Held(n) => match self.sources.get(*n) {
                            Some(name) => name.as_c_str(),
                            None => return Err(nix::errno::Errno::EINVAL.into()),
                        },
                    };
                    mount(
                        Some(source),
                        target.as_c_str(),
                        NONE,
                        MsFlags::MS_BIND,
                        NONE,
                    )?
                }
                Step::Seal { path } => mount(
                    NONE,
                    path.as_c_str(),
                    NONE,
                    MsFlags::MS_REMOUNT
                        | MsFlags::MS_RDONLY
                        | MsFlags::MS_NOSUID
                        | MsFlags::MS_NODEV
                        | MsFlags::MS_NOEXEC,
                    NONE,
                )?,
            }
        }
        Ok(())
    }
}

/// The git directories of a work tree: what is bound onto itself to stay where it is, and what
/// is read-only.
#[derive(Debug, Default, PartialEq)]
struct GitControl {
    pinned: Vec<PathBuf>,
    read_only: Vec<PathBuf>,
}

/// The git control files of `tree`'s repository (none when it has no `.git`). Control
/// directories git would have made (`hooks/`, `info/`) are made when missing, so that none can be
/// planted there; a control file that is a symbolic link is refused (it could not be held).
fn git_control(tree: &Path) -> io::Result<GitControl> {
    let mut control = GitControl::default();
    let dot_git = tree.join(".git");
    let meta = match std::fs::symlink_metadata(&dot_git) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(control),
        Err(e) => return Err(e),
    };
    if meta.file_type().is_symlink() {
        return Err(refused(&dot_git));
    }
    if meta.is_dir() {
        let dot_git = loopd_fs::real_path(&dot_git)?;
        control.pinned.push(dot_git.clone());
        control_files(&dot_git, &mut control.read_only)?;
        modules(
            &dot_git.join("modules"),
            MODULE_DEPTH,
            &mut control.read_only,
        )?;
        return Ok(control);
    }
    // A pointer (`gitdir: DIR`): the pointer itself, the files of its git directory that say
    // where the rest is, and the control files of its common directory. (Its git directories are
    // outside the tree, and stay as unwritable as the rest: a fleet worker's clone serves other
    // loops too.)
    control.read_only.push(loopd_fs::real_path(&dot_git)?);
    let Some(git_dir) = pointed(tree, &dot_git) else {
        return Ok(control);
    };
    for name in ["commondir", "gitdir", "config.worktree"] {
        let path = git_dir.join(name);
        if std::fs::symlink_metadata(&path).is_ok() {
            control.read_only.push(held(&path)?);
        }
    }
    let common = std::fs::read_to_string(git_dir.join("commondir"))
        .ok()
        .and_then(|c| loopd_fs::real_path(git_dir.join(c.trim())).ok())
        .unwrap_or_else(|| git_dir.clone());
    control_files(&common, &mut control.read_only)?;
    if common != git_dir {
        modules(
            &common.join("modules"),
            MODULE_DEPTH,
            &mut control.read_only,
        )?;
    }
    Ok(control)
}

/// The directory a `.git` file points at (`gitdir: DIR`, relative to the tree), if it is there.
fn pointed(tree: &Path, dot_git: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(dot_git).ok()?;
    let dir = text.lines().find_map(|l| l.strip_prefix("gitdir:"))?.trim();
    loopd_fs::real_path(tree.join(dir)).ok()
}

/// `config`, `hooks/` and `info/` of a git directory (and `config.worktree` where the repository
/// reads one), made where missing.
fn control_files(git_dir: &Path, read_only: &mut Vec<PathBuf>) -> io::Result<()> {
    let config = git_dir.join("config");
    made(&config)?;
    read_only.push(held(&config)?);
    let text = std::fs::read_to_string(&config).unwrap_or_default();
    if text.to_ascii_lowercase().contains("worktreeconfig") {
        let worktree = git_dir.join("config.worktree");
        made(&worktree)?;
        read_only.push(held(&worktree)?);
    }
    for name in ["hooks", "info"] {
        let dir = git_dir.join(name);
        if std::fs::symlink_metadata(&dir).is_err() {
            std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        }
        read_only.push(held(&dir)?);
    }
    Ok(())
}

/// `path` made as an empty private file if nothing is there.
fn made(path: &Path) -> io::Result<()> {
    if std::fs::symlink_metadata(path).is_err() {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)?;
    }
    Ok(())
}

/// The control files of the submodules' git directories under `modules` (a submodule named with
/// a slash is a directory deeper), `depth` levels at most.
fn modules(dir: &Path, depth: usize, read_only: &mut Vec<PathBuf>) -> io::Result<()> {
    if depth == 0 {
        return Ok(());
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = entry.path();
        if path.join("HEAD").exists() {
            control_files(&path, read_only)?;
            modules(&path.join("modules"), depth - 1, read_only)?;
        } else {
            modules(&path, depth - 1, read_only)?;
        }
    }
    Ok(())
}

/// `path`, which is not a symbolic link, as the kernel names it.
fn held(path: &Path) -> io::Result<PathBuf> {
    if std::fs::symlink_metadata(path)?.file_type().is_symlink() {
        return Err(refused(path));
    }
    loopd_fs::real_path(path)
}

fn refused(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{} is a symbolic link: the sandbox cannot keep an action from changing what it \
             points at; make it a plain file or directory (or set sandbox = \"off\")",
            path.display()
        ),
    )
}

/// The flags of the mount `path` is on that a remount in a user namespace must keep.
fn locked_flags(path: &Path) -> io::Result<MsFlags> {
    let flags = statvfs(path)?.flags();
    let mut keep = MsFlags::empty();
    for (have, keep_as) in [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if flags.contains(have) {
            keep |= keep_as;
        }
    }
    Ok(keep)
}

/// Where other programs keep their sockets.
fn socket_dirs() -> Vec<PathBuf> {
    let env = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let uid = nix::unistd::getuid();
    let mut dirs = vec![
        PathBuf::from("/run"),
        PathBuf::from("/var/run"),
        PathBuf::from("/tmp/.X11-unix"),
        PathBuf::from("/tmp/.ICE-unix"),
        PathBuf::from(format!("/tmp/tmux-{uid}")),
    ];
    dirs.extend(env("XDG_RUNTIME_DIR"));
    dirs
}

/// loopd's own state: its runtime directory (the service's API socket and its token) and its
/// state directory (the same when there is no `$XDG_RUNTIME_DIR`, and the projects it knows).
fn loopd_state() -> Vec<PathBuf> {
    let env = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let state = env("XDG_STATE_HOME")
        .or_else(|| env("HOME").map(|h| h.join(".local/state")))
        .map(|state| state.join("loopd"));
    let runtime = env("XDG_RUNTIME_DIR").map(|r| r.join("loopd"));
    state.into_iter().chain(runtime).collect()
}

/// The sockets the environment names (see [`SOCKET_VARIABLES`]), as paths.
fn named_sockets() -> Vec<PathBuf> {
    let mut sockets = Vec::new();
    for name in SOCKET_VARIABLES {
        let Some(value) = std::env::var_os(name) else {
            continue;
        };
        let value = value.to_string_lossy();
        match (socket_path(&value), name) {
            (Some(path), _) => sockets.push(PathBuf::from(path)),
            (None, "WAYLAND_DISPLAY") => {
                if let Some(runtime) = std::env::var_os("XDG_RUNTIME_DIR") {
                    sockets.push(Path::new(&runtime).join(&*value));
                }
            }
            _ => {}
        }
    }
    sockets
}

/// The socket path in a variable's value: `unix:path=/run/user/1000/bus,guid=...`,
/// `unix:///var/run/docker.sock`, a path, or tmux's `path,pid,session`.
fn socket_path(value: &str) -> Option<&str> {
    value
        .split([';', ','])
        .map(|part| {
            part.trim_start_matches("unix:path=")
                .trim_start_matches("unix://")
                .trim_start_matches("unix:")
        })
        .find(|p| p.starts_with('/'))
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn git(dir: &Path, args: &[&str]) {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn a_repositorys_control_files_are_read_only_and_its_git_directory_stays_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().canonicalize().unwrap();
        git(&tree, &["init", "-q"]);
        std::fs::remove_dir_all(tree.join(".git/hooks")).unwrap();
        let control = git_control(&tree).unwrap();
        let g = tree.join(".git");
        assert_eq!(control.pinned, vec![g.clone()]);
        assert_eq!(
            control.read_only,
            vec![g.join("config"), g.join("hooks"), g.join("info")]
        );
        assert!(
            g.join("hooks").is_dir(),
            "a missing hooks directory is made"
        );
        // A control file that is a link cannot be held.
        std::fs::remove_dir(g.join("hooks")).unwrap();
        std::os::unix::fs::symlink(&tree, g.join("hooks")).unwrap();
        let e = git_control(&tree).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }

    #[test]
    fn a_worktrees_pointer_its_git_directory_and_its_common_directory_are_held() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        git(&root, &["init", "-q"]);
        git(
            &root,
            &[
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "commit",
                "-q",
                "--allow-empty",
                "-m",
                "0",
            ],
        );
        let tree = root.join("wt");
        git(&root, &["worktree", "add", "-q", tree.to_str().unwrap()]);
        let control = git_control(&tree).unwrap();
        let common = root.join(".git");
        let own = common.join("worktrees/wt");
        assert!(control.pinned.is_empty(), "{control:?}");
        for held in [
            tree.join(".git"),
            own.join("commondir"),
            own.join("gitdir"),
            common.join("config"),
            common.join("hooks"),
            common.join("info"),
        ] {
            assert!(control.read_only.contains(&held), "{held:?}: {control:?}");
        }
    }

    #[test]
    fn sockets_named_by_the_environment_are_found_in_each_form() {
        for (value, path) in [
            (
                "unix:path=/run/user/1000/bus,guid=abc",
                Some("/run/user/1000/bus"),
            ),
            ("unix:///var/run/docker.sock", Some("/var/run/docker.sock")),
            (
                "/tmp/tmux-1000/default,123,0",
                Some("/tmp/tmux-1000/default"),
            ),
            ("/tmp/ssh-XXXX/agent.12", Some("/tmp/ssh-XXXX/agent.12")),
            ("tcp://127.0.0.1:2375", None),
            ("wayland-0", None),
        ] {
            assert_eq!(socket_path(value), path, "{value}");
        }
    }
}
