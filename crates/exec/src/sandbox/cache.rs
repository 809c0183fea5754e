//! Sandboxes kept between the attempts of one place: what a sandbox costs to make (its Landlock
//! ruleset, opening the entries of `/` and of the home directory one by one to leave the hidden
//! paths out; its user and mount namespaces with the view made in them) is paid once, and each
//! attempt only joins it (`setns` twice, then the ruleset: a few system calls).
//!
//! Theory of operation: a built sandbox is kept by what it was made for (the policy and the
//! place) with a [`Stamp`] of what it was made from: the view's plan, and the identity of every
//! path it depends on (the hidden, declared and bound paths, each one's device, inode and time;
//! the directories whose entries were listed, with their times). Each attempt plans the view and
//! takes the stamp again, a few dozen `stat`s; while both are the same, the kept sandbox is its
//! own. A credential file made since, a `.git/config` git replaced, a new entry in the home
//! directory: the stamp differs, and the sandbox is made anew. The namespaces are made by a child
//! cloned into them, which makes the view and opens them for loopd (`namespaces`); descriptors
//! keep a namespace alive.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

use landlock::RulesetCreated;

use super::view::View;

/// How many sandboxes a process keeps (one a loop under `loopd serve`, a few descriptors each):
/// past it, the one used least recently is let go.
const KEPT: usize = 4096;

/// What a sandbox is kept by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Key {
    pub policy: super::Policy,
    pub tree: PathBuf,
    pub own: Vec<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub progress_dir: Option<PathBuf>,
}

/// A sandbox made once, joined by each attempt.
pub(super) struct Built {
    stamp: Stamp,
    /// The Landlock ruleset's descriptor: made under `CompatLevel::HardRequirement`, it is
    /// enforced in full or not made at all.
    pub(super) ruleset: OwnedFd,
    /// The user and mount namespaces, with the view made in them.
    pub(super) user: OwnedFd,
    pub(super) mount: OwnedFd,
    /// For a network of hosts: its network namespace, the port of loopd's proxy on its
    /// loopback, and what the proxy refused.
    pub(super) net: Option<OwnedFd>,
    pub(super) proxy_port: Option<u16>,
    pub(super) refusals: Option<super::network::Refusals>,
    pub(super) protected: Vec<PathBuf>,
    pub(super) covered: Vec<PathBuf>,
}

/// What a sandbox was made from.
#[derive(Debug, PartialEq)]
struct Stamp {
    view: View,
    /// Each path it depends on, whether its entries were listed, and what it was (see
    /// [`identity`]); nothing if it was not there.
    paths: Vec<(PathBuf, bool, Option<Identity>)>,
}

/// A path a sandbox depends on, and whether its entries were listed.
pub(super) struct DependsOn {
    pub path: PathBuf,
    pub listed: bool,
}

impl Stamp {
    fn take(view: View, paths: Vec<DependsOn>) -> Stamp {
        let paths = paths
            .into_iter()
            .map(|d| {
                let id = identity(&d.path, d.listed);
                (d.path, d.listed, id)
            })
            .collect();
        Stamp { view, paths }
    }

    /// Whether `view` and the paths are as they were.
    fn holds(&self, view: &View) -> bool {
        self.view == *view
            && self
                .paths
                .iter()
                .all(|(path, listed, was)| identity(path, *listed) == *was)
    }
}

/// A path's device and inode, and for a directory whose entries were listed its modification
/// time (a new entry changes it; zero for the others, whose contents the sandbox does not depend
/// on).
type Identity = (u64, u64, i64, i64);

fn identity(path: &Path, listed: bool) -> Option<Identity> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::symlink_metadata(path).ok()?;
    let (s, ns) = if listed {
        (m.mtime(), m.mtime_nsec())
    } else {
        (0, 0)
    };
    Some((m.dev(), m.ino(), s, ns))
}

/// The kept sandboxes, each with when it was last used (a count of uses).
#[derive(Default)]
struct Kept {
    sandboxes: HashMap<Key, (Arc<Built>, u64)>,
    uses: u64,
}

impl Kept {
    fn get(&mut self, key: &Key) -> Option<Arc<Built>> {
        self.uses += 1;
        let (built, used) = self.sandboxes.get_mut(key)?;
        *used = self.uses;
        Some(built.clone())
    }

    fn insert(&mut self, key: Key, built: Arc<Built>) {
        if self.sandboxes.len() >= KEPT && !self.sandboxes.contains_key(&key) {
            let oldest = self.sandboxes.iter().min_by_key(|(_, (_, used))| *used);
            if let Some(oldest) = oldest.map(|(key, _)| key.clone()) {
                self.sandboxes.remove(&oldest);
            }
        }
        self.uses += 1;
        self.sandboxes.insert(key, (built, self.uses));
    }
}

static KEPT_SANDBOXES: LazyLock<Mutex<Kept>> = LazyLock::new(Default::default);

fn kept() -> std::sync::MutexGuard<'static, Kept> {
    KEPT_SANDBOXES.lock().unwrap_or_else(|e| e.into_inner())
}

/// The sandbox for `key` whose view is `view`: the one kept while its stamp holds, else one made
/// with the ruleset `make` returns (with the paths it depends on), and kept.
pub(super) fn built(
    key: Key,
    view: View,
    make: impl FnOnce() -> io::Result<(RulesetCreated, Vec<DependsOn>)>,
) -> io::Result<Arc<Built>> {
    let kept_one = kept().get(&key);
    if let Some(built) = kept_one
        && built.stamp.holds(&view)
    {
        return Ok(built);
    }
    tracing::debug!("making the sandbox of {}", key.tree.display());
    let (ruleset, mut paths) = make()?;
    let ruleset = Option::<OwnedFd>::from(ruleset)
        .ok_or_else(|| io::Error::other("the sandbox could not be enforced: no Landlock"))?;
    let hosts = match &key.policy.network {
        super::Network::Hosts(hosts) => Some(hosts.clone()),
        _ => None,
    };
    let (user, mount, net) = super::namespaces::made(&view, hosts.is_some())?;
    let (net, proxy_port, refusals) = match (net, hosts) {
        (Some(net), Some(hosts)) => {
            let (port, refusals) = serve_network(&net, hosts)?;
            (Some(net), Some(port), Some(refusals))
        }
        _ => (None, None, None),
    };
    paths.extend(view.depends_on().into_iter().map(|path| DependsOn {
        path,
        listed: false,
    }));
    let built = Arc::new(Built {
        protected: view.protected.clone(),
        covered: view.covered.clone(),
        stamp: Stamp::take(view, paths),
        ruleset,
        user,
        mount,
        net,
        proxy_port,
        refusals,
    });
    kept().insert(key, built.clone());
    Ok(built)
}

/// Makes the listeners of a network of `hosts` in the namespace `net` (from a thread that joins it
/// for that) and serves them from here: the proxy's (its port returned) and a forwarder for each
/// loopback host. The refusals are told as they come.
fn serve_network(
    net: &OwnedFd,
    hosts: Vec<super::HostRule>,
) -> io::Result<(u16, super::network::Refusals)> {
    use std::os::fd::AsFd as _;
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| io::Error::other("a network of hosts needs loopd's runtime"))?;
    let net = net.as_fd().try_clone_to_owned()?;
    let loopbacks: Vec<std::net::SocketAddr> = hosts.iter().filter_map(|h| h.loopback()).collect();
    let (proxy, forwards) = std::thread::spawn(move || -> io::Result<_> {
        nix::sched::setns(&net, nix::sched::CloneFlags::CLONE_NEWNET)?;
        let proxy = std::net::TcpListener::bind("127.0.0.1:0")?;
        let forwards = loopbacks
            .into_iter()
            .map(|to| Ok((std::net::TcpListener::bind(to)?, to)))
            .collect::<io::Result<Vec<_>>>()?;
        Ok((proxy, forwards))
    })
    .join()
    .map_err(|_| io::Error::other("the thread that made the network's listeners panicked"))??;
    let port = proxy.local_addr()?.port();
    let refusals = super::network::Refusals::default();
    let _entered = runtime.enter();
    super::network::serve(
        proxy,
        forwards,
        std::sync::Arc::new(hosts),
        refusals.clone(),
    )?;
    Ok((port, refusals))
}
