//! The sandbox around every attempt: the executor and everything it starts may write only where
//! the attempt's policy says (its work tree, its own files, a private temporary directory, the
//! paths its executor declares), may not change a git repository's control files nor its loop's
//! state, may not read the user's secrets, may not reach another program's Unix socket nor signal
//! or trace a process outside it, and reaches the network only as told.
//!
//! Theory of operation: a Landlock ruleset (no privileges needed) is built in loopd, before the
//! spawn, from paths it opens itself ([`Policy::prepare`]), with the attempt's view of the file
//! system (`view`), made once in a user and mount namespace of a cloned child's (`namespaces`)
//! and kept (`cache`);
//! the attempt's child joins them and enters the ruleset, between its clone and its exec, with
//! system calls that allocate nothing (`Prepared::enter`, [`crate::spawn`]). Landlock domains
//! are inherited and cannot be left: a grandchild in a new session, or a program that drops every
//! variable, is held as its parent is; and a process in one may not change mounts, so the view
//! holds too. Landlock grants, it does not deny: what is hidden
//! is every path but the hidden ones, so the directories on the way to a hidden path are granted
//! entry by entry (`readable`), and a hidden path declared readable is granted again. Its scopes
//! (ABI 6) keep signals and abstract Unix sockets within the attempt; pathname sockets are refused
//! by Landlock from ABI 9, and covered by the view before. TCP connects are limited to ports by
//! Landlock (ABI 4); no network at all is a network namespace of the child's own.

mod cache;
mod namespaces;
pub mod network;
mod view;

pub use network::{HostPattern, HostRule, Refusal};
pub use view::SOCKET_VARIABLES;

use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};

use landlock::{
    ABI, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, NetPort, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreated, RulesetCreatedAttr, Scope,
};
use nix::errno::Errno;
use nix::libc;

/// What an attempt may change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Its work tree, its own files and the declared paths (the default).
    #[default]
    WorkspaceWrite,
    /// Its own files only (the result file, a temporary directory).
    ReadOnly,
    /// No sandbox.
    Off,
}

impl Mode {
    /// The names Codex users know: `workspace-write`, `read-only`, `off`.
    pub fn parse(name: &str) -> Option<Mode> {
        match name {
            "workspace-write" => Some(Mode::WorkspaceWrite),
            "read-only" => Some(Mode::ReadOnly),
            "off" => Some(Mode::Off),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::WorkspaceWrite => "workspace-write",
            Mode::ReadOnly => "read-only",
            Mode::Off => "off",
        }
    }
}

/// Where an attempt may connect.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Network {
    #[default]
    Any,
    /// No network at all (not even loopback): a network namespace of its own.
    None,
    /// TCP connects to these ports only (Landlock ABI 4).
    Ports(Vec<u16>),
    /// These hosts and ports only, through loopd's proxy, from a network namespace of its own
    /// ([`network`]).
    Hosts(Vec<HostRule>),
}

impl std::fmt::Display for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Network::Any => f.write_str("any"),
            Network::None => f.write_str("none"),
            Network::Ports(ports) => {
                let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
                write!(f, "TCP ports {}", ports.join(", "))
            }
            Network::Hosts(hosts) if hosts.is_empty() => f.write_str("no host"),
            Network::Hosts(hosts) => {
                let hosts: Vec<String> = hosts.iter().map(HostRule::to_string).collect();
                f.write_str(&hosts.join(", "))
            }
        }
    }
}

/// The credential files and directories no action reads, under `$HOME`.
pub const HIDDEN_IN_HOME: [&str; 8] = [
    ".ssh",
    ".aws",
    ".gnupg",
    ".netrc",
    ".docker/config.json",
    ".kube",
    ".config/gcloud",
    // The Temporal CLI's profiles, API keys among them.
    ".config/temporalio",
];

/// The files of this process's own credentials (a worker's Temporal API key and client key):
/// hidden from every attempt it runs, beside each policy's own.
static SECRETS: std::sync::RwLock<Vec<PathBuf>> = std::sync::RwLock::new(Vec::new());

/// Hides `files` from every attempt this process runs from now on.
pub fn keep_secret(files: impl IntoIterator<Item = PathBuf>) {
    SECRETS
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .extend(files);
}

/// The files [`keep_secret`] was given.
pub fn secrets() -> Vec<PathBuf> {
    SECRETS.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// What one attempt may do.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Policy {
    pub mode: Mode,
    /// Where it may write besides its own files (the work tree, for `workspace-write`, and
    /// what its executor declares).
    pub writable: Vec<PathBuf>,
    /// What it may not read (nor execute).
    pub hidden: Vec<PathBuf>,
    /// Hidden paths it may read anyway (an agent's own key file).
    pub readable: Vec<PathBuf>,
    /// Unix sockets of programs outside it that it may connect to (`sandbox_sockets`).
    pub sockets: Vec<PathBuf>,
    pub network: Network,
}

/// Where an attempt runs: its work tree, its own files (writable), and its loop's state directory
/// with the progress directory in it.
pub struct Place<'a> {
    pub tree: &'a Path,
    pub own: &'a [&'a Path],
    pub state_dir: Option<&'a Path>,
    pub progress_dir: Option<&'a Path>,
}

/// The Landlock ABI that scopes signals and abstract Unix sockets (Linux 6.12).
const SCOPES_ABI: i32 = 6;
/// The Landlock ABI that refuses a connect to a Unix socket by its path (Linux 7.1).
const RESOLVE_UNIX_ABI: i32 = 9;

/// What this machine offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Support {
    /// The kernel's Landlock ABI version; `None` when Landlock is not there or not enabled.
    pub landlock: Option<i32>,
    /// Whether this process may make a user namespace (for the attempt's own view of the file
    /// system, and `sandbox_network = "none"`).
    pub user_namespaces: bool,
}

impl Support {
    /// Asks the kernel; whether user namespaces may be made is tried once a process, in a child.
    pub fn probe() -> Support {
        static USER_NAMESPACES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        Support {
            landlock: landlock_abi(),
            user_namespaces: *USER_NAMESPACES.get_or_init(user_namespaces),
        }
    }

    /// In a few words, for `doctor` and `demo`.
    pub fn describe(&self) -> String {
        let yes = |b: bool| if b { "yes" } else { "no" };
        match self.landlock {
            Some(abi) => format!(
                "Landlock ABI {abi}, user namespaces {}, signals and abstract sockets kept in \
                 {}, sockets by path {}",
                yes(self.user_namespaces),
                yes(abi >= SCOPES_ABI),
                if abi >= RESOLVE_UNIX_ABI {
                    "refused by Landlock"
                } else {
                    "covered where they live"
                }
            ),
            None => "none: this kernel has no Landlock".to_owned(),
        }
    }

    /// Why `policy` cannot be held here, in one line; `None` when it can. Never less than the
    /// policy asks: what this machine cannot give refuses the loop.
    pub fn refuses(&self, policy: &Policy) -> Option<String> {
        if policy.mode == Mode::Off {
            return None;
        }
        let Some(abi) = self.landlock else {
            return Some(
                "this kernel has no Landlock (Linux 5.13 or later, with landlock among the LSMs \
                 in /sys/kernel/security/lsm), so actions cannot be sandboxed; set \
                 sandbox = \"off\" to run them without"
                    .into(),
            );
        };
        if abi < SCOPES_ABI {
            return Some(format!(
                "the sandbox needs Landlock ABI {SCOPES_ABI} (Linux 6.12) to keep an action from \
                 signalling loopd and from other programs' abstract sockets; this kernel has \
                 {abi}; set sandbox = \"off\" to run actions without it"
            ));
        }
        if !self.user_namespaces {
            return Some(
                "the sandbox needs user namespaces (for an action's own read-only view of git's \
                 and loopd's files), which this machine does not allow an unprivileged process; \
                 allow them (sysctl kernel.unprivileged_userns_clone=1, or AppArmor's \
                 kernel.apparmor_restrict_unprivileged_userns=0) or set sandbox = \"off\""
                    .into(),
            );
        }
        None
    }
}

/// The kernel's Landlock ABI version, if it has Landlock.
#[allow(unsafe_code)]
fn landlock_abi() -> Option<i32> {
    const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
    // SAFETY: the documented way to ask for the version (no attribute, no size, the flag): it
    // touches no memory of ours.
    let v = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    (v > 0).then(|| i32::try_from(v).unwrap_or(i32::MAX))
}

/// Whether this process may make a user namespace with a mount and a network namespace: tried in
/// a child that exits at once.
fn user_namespaces() -> bool {
    std::process::Command::new("unshare")
        .args(["--user", "--mount", "--net", "true"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// An attempt's sandbox, built, to be entered by its child (`Prepared::enter`).
pub struct Prepared {
    /// The namespaces (with the view made in them) and the ruleset, kept for the place's next
    /// attempts.
    built: std::sync::Arc<cache::Built>,
    /// Whether it has a network namespace of its own (no network).
    own_network: bool,
    /// The attempt's working directory (its tree).
    cwd: CString,
}

impl Prepared {
    /// The variables that send the attempt's clients to loopd's proxy (`HTTPS_PROXY`, ...), when
    /// its network is a list of hosts.
    pub fn proxy_env(&self) -> Vec<(&'static str, String)> {
        let Some(port) = self.built.proxy_port else {
            return Vec::new();
        };
        let url = format!("http://127.0.0.1:{port}");
        [
            "HTTPS_PROXY",
            "HTTP_PROXY",
            "ALL_PROXY",
            "https_proxy",
            "http_proxy",
            "all_proxy",
        ]
        .into_iter()
        .map(|name| (name, url.clone()))
        .collect()
    }

    /// What loopd's proxy refused the place's attempts since this was last asked (at the end of
    /// each attempt: the attempt's own).
    pub fn refusals(&self) -> Option<network::Refusals> {
        self.built.refusals.clone()
    }
}

impl Policy {
    /// Builds the sandbox of an attempt at `place`: it may write in its own files and, for
    /// `workspace-write`, in its tree and the declared paths. `None` when the policy is off. The
    /// sandbox of the place's last attempt is taken again while what it was made from holds
    /// (`cache`).
    pub fn prepare(&self, place: &Place<'_>) -> io::Result<Option<Prepared>> {
        if self.mode == Mode::Off {
            return Ok(None);
        }
        // User namespaces were checked before the loop started (preflight); should they be gone
        // since, making them fails and the attempt with it: never unsandboxed.
        let support = Support {
            landlock: landlock_abi(),
            user_namespaces: true,
        };
        if let Some(why) = support.refuses(self) {
            return Err(io::Error::new(io::ErrorKind::Unsupported, why));
        }
        let abi = support.landlock.unwrap_or(0);
        let mut needed: Vec<PathBuf> = vec![place.tree.to_owned()];
        needed.extend(place.own.iter().map(|p| p.to_path_buf()));
        needed.extend(self.writable.iter().cloned());
        needed.extend(self.readable.iter().cloned());
        let view = view::View::plan(&view::Inputs {
            tree: place.tree,
            tree_writable: self.mode == Mode::WorkspaceWrite,
            state_dir: place.state_dir,
            progress_dir: place.progress_dir,
            needed: &needed,
            mask_sockets: abi < RESOLVE_UNIX_ABI,
            sockets: &self.sockets,
        })?;
        let key = cache::Key {
            policy: self.clone(),
            tree: place.tree.to_owned(),
            own: place.own.iter().map(|p| p.to_path_buf()).collect(),
            state_dir: place.state_dir.map(Path::to_owned),
            progress_dir: place.progress_dir.map(Path::to_owned),
        };
        let built = cache::built(key, view, || {
            let mut listed = Vec::new();
            let ruleset = self
                .ruleset(ABI::from(abi), place, &mut listed)
                .map_err(io::Error::other)?;
            // What the ruleset was made of: the hidden and declared paths as they were, and the
            // directories listed to leave the hidden ones out.
            let declared = self
                .hidden
                .iter()
                .chain(&self.writable)
                .chain(&self.readable)
                .chain(&self.sockets);
            let paths = declared
                .map(|path| cache::DependsOn {
                    path: path.clone(),
                    listed: false,
                })
                .chain(
                    listed
                        .into_iter()
                        .map(|path| cache::DependsOn { path, listed: true }),
                )
                .collect();
            Ok((ruleset, paths))
        })?;
        let cwd = CString::new(place.tree.as_os_str().as_encoded_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(Some(Prepared {
            built,
            own_network: self.network == Network::None,
            cwd,
        }))
    }

    /// The Landlock ruleset of an attempt at `place`; the directories it listed to leave the
    /// hidden paths out go into `listed`.
    fn ruleset(
        &self,
        abi: ABI,
        place: &Place<'_>,
        listed: &mut Vec<PathBuf>,
    ) -> Result<RulesetCreated, landlock::RulesetError> {
        let read = AccessFs::from_read(abi);
        let write = AccessFs::from_write(abi);
        let mut ruleset = Ruleset::default()
            .set_compatibility(CompatLevel::HardRequirement)
            .handle_access(read | write)?
            .scope(Scope::AbstractUnixSocket | Scope::Signal)?;
        if let Network::Ports(_) = self.network {
            ruleset = ruleset.handle_access(AccessNet::ConnectTcp)?;
        }
        let mut created = ruleset.create()?;
        let mut writable: Vec<PathBuf> = place.own.iter().map(|p| p.to_path_buf()).collect();
        // Terminals, /dev/null, shared memory.
        writable.push(PathBuf::from("/dev"));
        if self.mode == Mode::WorkspaceWrite {
            writable.push(place.tree.to_owned());
            writable.extend(self.writable.iter().cloned());
            // A declared directory (`~/.codex/`) is made if missing, private: a CLI's first run
            // makes its own, and could not here.
            for dir in self.writable.iter().filter(|p| is_dir_name(p)) {
                let _ = std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir);
            }
        }
        let hidden = existing(&self.hidden);
        for path in split(Path::new("/"), &hidden, listed)
            .into_iter()
            .chain(self.readable.iter().cloned())
        {
            created = add(created, &path, read, abi)?;
        }
        // A hidden path in a writable one (a work tree that holds the home directory) stays
        // hidden.
        for writable in &writable {
            for path in split(writable, &hidden, listed) {
                created = add(created, &path, read | write, abi)?;
            }
        }
        // The sockets it declares, where Landlock refuses the others (before, the view shows
        // them).
        if abi >= ABI::from(RESOLVE_UNIX_ABI) {
            for socket in &self.sockets {
                created = add(created, socket, AccessFs::ResolveUnix.into(), abi)?;
            }
        }
        if let Network::Ports(ports) = &self.network {
            for port in ports {
                created = created.add_rule(NetPort::new(*port, AccessNet::ConnectTcp))?;
            }
        }
        Ok(created)
    }
}

/// Whether a declared path names a directory: it ends with `/`.
fn is_dir_name(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    path.as_os_str().as_bytes().ends_with(b"/")
}

/// Grants `access` beneath `path`, if it is there (a declared path that does not exist grants
/// nothing). A file is granted the rights a file can have.
fn add(
    ruleset: RulesetCreated,
    path: &Path,
    access: BitFlags<AccessFs>,
    abi: ABI,
) -> Result<RulesetCreated, landlock::RulesetError> {
    let Ok(fd) = PathFd::new(path) else {
        return Ok(ruleset);
    };
    let is_dir = std::fs::metadata(path).is_ok_and(|m| m.is_dir());
    let access = if is_dir {
        access
    } else {
        access & AccessFs::from_file(abi)
    };
    ruleset.add_rule(PathBeneath::new(fd, access))
}

/// The lines of an attempt's output that say it was refused something (at most three, each
/// cut at 200 characters): under a sandbox the kernel says no as `Permission denied` or
/// `Operation not permitted`, and says it to the program, which says it or not.
pub fn refusals(output: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(output)
        .lines()
        .filter(|l| l.contains("Permission denied") || l.contains("Operation not permitted"))
        .take(3)
        .map(|l| l.trim().chars().take(200).collect())
        .collect()
}

/// The hidden paths that are there, as the kernel names them.
fn existing(hidden: &[PathBuf]) -> Vec<PathBuf> {
    hidden
        .iter()
        .filter_map(|h| loopd_fs::real_path(h).ok())
        .collect()
}

/// `dir` as grants that leave out `hidden`: `dir` itself when nothing hidden is in it, else its
/// entries, each split the same way. A symbolic link on the way is not followed (its target is
/// granted where it is), and one that leads into a hidden path is left out. The directories whose
/// entries were listed go into `listed` (a new entry in one is not granted until it is split
/// again).
fn split(dir: &Path, hidden: &[PathBuf], listed: &mut Vec<PathBuf>) -> Vec<PathBuf> {
    let mut granted = Vec::new();
    split_into(dir, hidden, &mut granted, listed);
    granted
}

fn split_into(
    dir: &Path,
    hidden: &[PathBuf],
    granted: &mut Vec<PathBuf>,
    listed: &mut Vec<PathBuf>,
) {
    let real = loopd_fs::real_path(dir).unwrap_or_else(|_| dir.to_owned());
    if hidden.iter().any(|h| real.starts_with(h)) {
        return;
    }
    if !hidden.iter().any(|h| h.starts_with(&real)) {
        granted.push(dir.to_owned());
        return;
    }
    if dir != real {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    listed.push(dir.to_owned());
    for entry in entries.flatten() {
        split_into(&entry.path(), hidden, granted, listed);
    }
}

impl Prepared {
    /// Enters the sandbox: called in the child between its clone and its exec, where only system
    /// calls may be made (see [`crate::spawn`]: nothing allocated, no memory of loopd's
    /// written). It joins the user and mount namespaces made for its place (the view made in
    /// them; never the namespace loopd is in: checked once, when they were made, as the
    /// namespace behind a descriptor never changes), makes a network namespace of its own if it
    /// has no network, and enters the ruleset (which forbids any change of mounts from then on).
    #[allow(unsafe_code)]
    pub(crate) fn enter(&self) -> Result<(), Failure> {
        use nix::sched::{CloneFlags, setns, unshare};
        let os = |step| {
            move |errno| Failure {
                step,
                errno: Some(errno),
            }
        };
        setns(&self.built.user, CloneFlags::CLONE_NEWUSER)
            .map_err(os("joining the sandbox's user namespace"))?;
        setns(&self.built.mount, CloneFlags::CLONE_NEWNS)
            .map_err(os("joining the sandbox's mount namespace"))?;
        if let Some(net) = &self.built.net {
            setns(net, CloneFlags::CLONE_NEWNET)
                .map_err(os("joining the sandbox's network namespace"))?;
        }
        if self.own_network {
            unshare(CloneFlags::CLONE_NEWNET).map_err(os("making a network namespace"))?;
        }
        // Joining a mount namespace takes the working directory to its root.
        nix::unistd::chdir(self.cwd.as_c_str()).map_err(os("chdir in the sandbox"))?;
        // What the landlock crate's `restrict_self` does, on the kept descriptor: no new
        // privileges, then the ruleset, which closes nothing (the child shares loopd's table of
        // descriptors until it has entered the sandbox; see `crate::spawn`).
        // SAFETY: two system calls on integers and a descriptor `Built` keeps open.
        unsafe {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(Failure::os("setting no new privileges"));
            }
            let ruleset = self.built.ruleset.as_raw_fd();
            if libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0) != 0 {
                return Err(Failure::os("entering the Landlock ruleset"));
            }
        }
        Ok(())
    }

    /// What the attempt's view holds read-only (git's control files, the state directory) and
    /// what it covers (where other programs' sockets are).
    pub fn view(&self) -> (&[PathBuf], &[PathBuf]) {
        (&self.built.protected, &self.built.covered)
    }
}

/// Why a child could not start ([`crate::spawn`]): the step, and the error of its system call.
/// Here, below the spawn, as entering the sandbox is one of its steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    pub step: &'static str,
    pub errno: Option<Errno>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.errno {
            Some(errno) => write!(f, "{}: {}", self.step, io::Error::from(errno)),
            None => f.write_str(self.step),
        }
    }
}

impl Failure {
    /// The failure of a system call that set `errno`.
    pub fn os(step: &'static str) -> Failure {
        Failure::errno(step, Errno::last())
    }

    /// The failure of a system call that returned `errno`.
    pub fn errno(step: &'static str, errno: Errno) -> Failure {
        Failure {
            step,
            errno: Some(errno),
        }
    }

    /// The failure of a step whose error is the system's (or, if it is not, no errno): made
    /// without allocating.
    pub fn io(step: &'static str, error: &io::Error) -> Failure {
        Failure {
            step,
            errno: error.raw_os_error().map(Errno::from_raw),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_have_codex_names() {
        for mode in [Mode::WorkspaceWrite, Mode::ReadOnly, Mode::Off] {
            assert_eq!(Mode::parse(mode.name()), Some(mode));
        }
        assert_eq!(Mode::parse("danger-full-access"), None);
    }

    #[test]
    fn a_machine_without_what_a_policy_needs_refuses_it_in_one_line() {
        let policy = |network| Policy {
            network,
            ..Policy::default()
        };
        let none = Support {
            landlock: None,
            user_namespaces: false,
        };
        let why = none.refuses(&policy(Network::Any)).unwrap();
        assert!(
            why.contains("no Landlock") && why.contains("sandbox = \"off\""),
            "{why}"
        );
        let off = Policy {
            mode: Mode::Off,
            ..Policy::default()
        };
        assert_eq!(none.refuses(&off), None);
        // Without scopes, an action could signal loopd: refused, not run with less.
        let old = Support {
            landlock: Some(5),
            user_namespaces: true,
        };
        let why = old.refuses(&policy(Network::Any)).unwrap();
        assert!(why.contains("ABI 6") && why.contains("signalling"), "{why}");
        // Without user namespaces, no read-only view of git's and loopd's files.
        let no_namespaces = Support {
            landlock: Some(6),
            user_namespaces: false,
        };
        let why = no_namespaces.refuses(&policy(Network::Any)).unwrap();
        assert!(why.contains("user namespaces"), "{why}");
        let enough = Support {
            landlock: Some(6),
            user_namespaces: true,
        };
        for network in [Network::Any, Network::None, Network::Ports(vec![443])] {
            assert_eq!(enough.refuses(&policy(network)), None);
        }
    }

    #[test]
    fn what_is_readable_leaves_out_the_hidden_paths_and_only_them() {
        let home = tempfile::tempdir().unwrap();
        let home = home.path().canonicalize().unwrap();
        for dir in [".ssh", ".config/gcloud", ".config/other", "work"] {
            std::fs::create_dir_all(home.join(dir)).unwrap();
        }
        std::os::unix::fs::symlink(home.join(".ssh"), home.join("keys")).unwrap();
        let hidden = [
            home.join(".ssh"),
            home.join(".config/gcloud"),
            home.join(".missing"),
        ];
        let granted = split(Path::new("/"), &existing(&hidden), &mut Vec::new());
        for h in &hidden {
            assert!(
                !granted.iter().any(|g| h.starts_with(g)),
                "{} is readable through {granted:?}",
                h.display()
            );
        }
        for open in [home.join("work"), home.join(".config/other")] {
            assert!(
                granted.contains(&open),
                "{} is not readable",
                open.display()
            );
        }
        assert!(!granted.contains(&home.join("keys")), "a link into .ssh");
        assert!(granted.contains(&PathBuf::from("/usr")));
        // A writable home keeps its hidden paths hidden.
        let mut listed = Vec::new();
        let writable = split(&home, &existing(&hidden), &mut listed);
        assert_eq!(
            listed,
            vec![home.clone(), home.join(".config")],
            "the directories listed"
        );
        assert!(writable.contains(&home.join("work")));
        assert!(!writable.iter().any(|g| home.join(".ssh").starts_with(g)));
    }
}
