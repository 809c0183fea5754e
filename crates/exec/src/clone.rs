//! Cloning a child that shares loopd's memory and table of descriptors until it execs or exits,
//! as `posix_spawn` does (`CLONE_VM | CLONE_VFORK`) and with the table too (`CLONE_FILES`): its
//! cost is the same however large loopd and however many its descriptors. The child runs a
//! function of the caller's on a stack of its own, with every signal blocked, under the rules
//! [`crate::spawn`] gives: system calls only, no allocation, no lock, no write to memory but its
//! stack and the cells of what it was passed.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

use nix::libc;

/// The child's stack: what it runs (a few system calls, the sandbox's entry) needs a few KiB.
const STACK: usize = 256 * 1024;

/// The page below the child's stack, where it would overflow into: a fault, not a write into
/// loopd's memory.
const GUARD: usize = 4096;

/// Clones the child, which runs `main` on `arg` (its `Ctx`) with every signal blocked, in the
/// namespaces `namespaces` asks for; returns once it has exec'd or exited, with its pid and pidfd.
pub(crate) fn clone_vfork<C>(
    main: extern "C" fn(*mut c_void) -> c_int,
    arg: &C,
    namespaces: c_int,
) -> io::Result<(libc::pid_t, OwnedFd)> {
    let stack = Stack::map()?;
    let flags = libc::CLONE_VM
        | libc::CLONE_VFORK
        | libc::CLONE_FILES
        | libc::CLONE_PIDFD
        | libc::SIGCHLD
        | namespaces;
    let mut pidfd: c_int = -1;
    let all = nix::sys::signal::SigSet::all();
    let mut old = nix::sys::signal::SigSet::empty();
    nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&all),
        Some(&mut old),
    )?;
    // SAFETY: the child runs `main` on a stack of its own that outlives it (the parent waits,
    // `CLONE_VFORK`, until it has exec'd or exited), and reads `arg`, which outlives it likewise,
    // writing only its cells; `CLONE_PIDFD` writes the pidfd to `pidfd`.
    let pid = unsafe {
        libc::clone(
            main,
            stack.top(),
            flags,
            arg as *const C as *mut c_void,
            &mut pidfd as *mut c_int,
        )
    };
    let cloned = if pid < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(pid)
    };
    nix::sys::signal::pthread_sigmask(nix::sys::signal::SigmaskHow::SIG_SETMASK, Some(&old), None)?;
    drop(stack);
    let pid = cloned?;
    // SAFETY: the kernel gave this process the pidfd, owned by nothing else.
    Ok((pid, unsafe { OwnedFd::from_raw_fd(pidfd) }))
}

/// The child's stack: pages of its own, mapped as it touches them, above a guard page.
struct Stack(*mut c_void);

impl Stack {
    fn map() -> io::Result<Stack> {
        // SAFETY: a new private mapping, which nothing else refers to.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                GUARD + STACK,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let stack = Stack(base);
            if libc::mprotect(base, GUARD, libc::PROT_NONE) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(stack)
        }
    }

    /// Where the stack starts: its end (it grows down), which a page boundary aligns as the ABI
    /// asks.
    fn top(&self) -> *mut c_void {
        self.0.wrapping_byte_add(GUARD + STACK)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping `map` made, which no child runs on any more.
        unsafe { libc::munmap(self.0, GUARD + STACK) };
    }
}
