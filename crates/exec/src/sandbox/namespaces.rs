//! The namespaces of a sandbox, made once for each kept sandbox: a child is cloned into a new
//! user and mount namespace (and network namespace), makes the sandbox's view in them, opens them
//! for loopd, and exits. It is cloned as a spawn's child is ([`crate::clone`]): a fork would copy
//! loopd's memory and its table of descriptors, both growing with every loop a service holds, and
//! the exec of a helper would then close each of those descriptors again.

#![allow(unsafe_code)]

use std::cell::Cell;
use std::ffi::{CStr, CString, c_int, c_void};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::libc;

use super::Failure;
use super::view::View;

/// A sandbox's user and mount namespaces, and its network namespace if it has one of its own.
pub(super) type Namespaces = (OwnedFd, OwnedFd, Option<OwnedFd>);

/// A user and a mount namespace with `view` made in them, and with `network` a network namespace
/// whose loopback is up.
pub(super) fn made(view: &View, network: bool) -> io::Result<Namespaces> {
    let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
    let map = |id: u32| CString::new(format!("{id} {id} 1")).unwrap_or_default();
    let maps = (map(uid.as_raw()), map(gid.as_raw()));
    let parent = mount_namespace()?;
    let made = view.made();
    let (user, mount, net) = cloned_into(network, &|| {
        map_ids(&maps, parent)?;
        if network {
            super::network::loopback_up().map_err(|e| Failure::io("bringing up loopback", &e))?;
        }
        made.make()
            .map_err(|e| Failure::io("making the sandbox's view", &e))
    })?;
    // What each attempt joins is never loopd's own mount namespace (the child checked the one
    // it made; this is the one held).
    let held = nix::sys::stat::fstat(&mount)?;
    if (held.st_dev, held.st_ino) == parent {
        return Err(io::Error::other("no mount namespace of its own"));
    }
    Ok((user, mount, net))
}

/// A user and a mount namespace (and with `network` a network namespace), made by a child cloned
/// into them that runs `setup` in them (under a spawn's child's rules: system calls only), opens
/// them in the table of descriptors it shares with loopd, and exits: they are loopd's.
fn cloned_into(network: bool, setup: &dyn Fn() -> Result<(), Failure>) -> io::Result<Namespaces> {
    let ctx = NamespacesCtx {
        setup,
        network,
        opened: [Cell::new(-1), Cell::new(-1), Cell::new(-1)],
        failure: Cell::new(None),
    };
    let mut flags = libc::CLONE_NEWUSER | libc::CLONE_NEWNS;
    if network {
        flags |= libc::CLONE_NEWNET;
    }
    let (pid, _pidfd) = {
        // No sweep may reap it before this does.
        let _no_sweep = crate::procs::spawning();
        let cloned = crate::clone::clone_vfork(namespaces_main, &ctx, flags)?;
        let mut status = 0;
        // SAFETY: reaps this process's own child, which has exited (the parent runs again once
        // the child has exec'd or exited, and this one never execs).
        unsafe { libc::waitpid(cloned.0, &mut status, 0) };
        cloned
    };
    // SAFETY: each descriptor the child opened is open, in this process's table, and owned by
    // nothing else.
    let [user, mount, net] = ctx
        .opened
        .map(|fd| (fd.get() >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd.get()) }));
    if let Some(failure) = ctx.failure.get() {
        return Err(io::Error::from(failure));
    }
    match (user, mount) {
        (Some(user), Some(mount)) if net.is_some() == network => Ok((user, mount, net)),
        _ => Err(io::Error::other(format!(
            "the child that made the namespaces (pid {pid}) opened not all of them"
        ))),
    }
}

/// What the child that makes the namespaces runs, and where it puts what it opened.
struct NamespacesCtx<'a> {
    setup: &'a dyn Fn() -> Result<(), Failure>,
    network: bool,
    /// The user, mount and network namespaces' descriptors, -1 until opened.
    opened: [Cell<RawFd>; 3],
    failure: Cell<Option<Failure>>,
}

/// The child of [`cloned_into`]: system calls only (see the module's rules); it opens descriptors
/// in loopd's table, as any of its threads may, and never execs.
extern "C" fn namespaces_main(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `NamespacesCtx` the parent passed, alive while it waits.
    let ctx = unsafe { &*(arg as *const NamespacesCtx<'_>) };
    let made = (ctx.setup)().and_then(|()| {
        let names: &[&CStr] = if ctx.network {
            &[
                c"/proc/self/ns/user",
                c"/proc/self/ns/mnt",
                c"/proc/self/ns/net",
            ]
        } else {
            &[c"/proc/self/ns/user", c"/proc/self/ns/mnt"]
        };
        for (name, cell) in names.iter().zip(&ctx.opened) {
            // SAFETY: opens a path the child was given, as a system call.
            let fd = unsafe { libc::open(name.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(Failure::os("opening a namespace"));
            }
            cell.set(fd);
        }
        Ok(())
    });
    let code = match made {
        Ok(()) => 0,
        Err(failure) => {
            ctx.failure.set(Some(failure));
            127
        }
    };
    // SAFETY: ends the child without running anything of the parent's (no atexit, no flush).
    unsafe { libc::_exit(code) }
}

/// The mount namespace this process is in: `st_dev` and `st_ino` of `/proc/self/ns/mnt` (a
/// `stat`, which allocates nothing).
fn mount_namespace() -> nix::Result<(u64, u64)> {
    let ns = nix::sys::stat::stat(c"/proc/self/ns/mnt")?;
    Ok((ns.st_dev, ns.st_ino))
}

/// In a child cloned into a user and a mount namespace of its own: checks that its mount
/// namespace is not `parent`, loopd's, and maps its user and group to themselves (`maps`). Only
/// system calls that allocate nothing.
fn map_ids(maps: &(CString, CString), parent: (u64, u64)) -> Result<(), Failure> {
    match mount_namespace() {
        Ok(ns) if ns == parent => {
            return Err(Failure {
                step: "no mount namespace of its own",
                errno: None,
            });
        }
        Ok(_) => {}
        Err(errno) => return Err(Failure::errno("reading its mount namespace", errno)),
    }
    write_proc(c"/proc/self/setgroups", c"deny")
        .map_err(|e| Failure::errno("denying setgroups", e))?;
    write_proc(c"/proc/self/uid_map", &maps.0)
        .map_err(|e| Failure::errno("mapping its user", e))?;
    write_proc(c"/proc/self/gid_map", &maps.1).map_err(|e| Failure::errno("mapping its group", e))
}

/// Writes `text` to the file `path` of `/proc`, with system calls alone (a `CStr` path is
/// passed as it is); a short write is `EIO`.
fn write_proc(path: &CStr, text: &CStr) -> nix::Result<()> {
    use nix::fcntl::{OFlag, open};
    let fd = open(
        path,
        OFlag::O_WRONLY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    let bytes = text.to_bytes();
    if nix::unistd::write(&fd, bytes)? != bytes.len() {
        return Err(Errno::EIO);
    }
    Ok(())
}
