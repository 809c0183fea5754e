//! Starting a process (an attempt's executor, loopd's own git) without copying loopd's address
//! space or its descriptors.
//!
//! Theory of operation: `fork` copies the page tables of the whole process, and each of its
//! threads then faults on every page it writes until the child has exec'd: under `loopd serve`, a
//! process of tens of MiB and a score of threads, that was a third of its CPU per action.
//! `posix_spawn`, which std uses when it can, starts the child with `CLONE_VM | CLONE_VFORK`
//! instead: the child runs on a stack of its own in the parent's memory while the calling thread
//! waits, until it has exec'd. std can do that only when no `pre_exec` hook runs, and a sandboxed
//! attempt enters its sandbox between the clone and the exec. This module does what
//! `posix_spawn` does, with that step in between.
//!
//! Descriptors likewise: a clone copies the table of descriptors, and the exec then closes each
//! close-on-exec one, both as long as the table. A service holding a thousand loops holds
//! thousands of descriptors (a lock per loop, the kept sandboxes' namespaces, pipes, sockets), so
//! each spawn cost more with each loop it held. The child shares loopd's table instead
//! (`CLONE_FILES`) while it enters its sandbox, which opens and closes nothing; it then puts what
//! it is given (its standard streams, an attempt's marker) in a few descriptors loopd reserved
//! at low numbers when it started ([`reserve`]), and takes a table of its own with only those
//! (`close_range` with `CLOSE_RANGE_UNSHARE` copies only the descriptors below the first it
//! closes). Its standard streams are 0, 1 and 2, the descriptor it inherits ([`Command::inherit`])
//! is 3, and it has no other.
//!
//! The rules of the child, which shares every page with its parent: all it needs (the argument
//! and environment arrays, each path the search of `PATH` may try, its descriptors) is made
//! before the clone; it makes system calls only, allocates nothing, takes no lock, and writes no
//! memory but its own stack and the [`Failure`] it reports; until it has a table of its own it
//! changes no descriptor but the reserved ones, which loopd sets back once it runs again. Signals
//! are blocked across the clone and every handler is reset in the child before it unblocks them,
//! so no handler of loopd's runs in it. The child is started in a process group of its own, with
//! a pidfd (`CLONE_PIDFD`) that [`Child::wait`] waits on without a thread. A child that cannot
//! start reports why and exits; [`Command::spawn`] then reaps it and returns the error.

#![allow(unsafe_code)]

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString, c_char, c_int, c_void};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{LazyLock, Mutex};

use nix::errno::Errno;
use nix::libc;
use nix::sys::stat::Mode;
use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;

use crate::sandbox;
pub use crate::sandbox::Failure;

/// The descriptors a child is given, in the order it has them: its standard streams, and the one
/// it inherits.
const GIVEN: usize = 4;

/// Descriptors reserved for the children's: `GIVEN` of them at low numbers (each `/dev/null`,
/// close-on-exec, but while a child is being started), and `/dev/null` to set them back from and
/// to give as a standard input of nothing.
struct Reserved {
    slots: [RawFd; GIVEN],
    null: OwnedFd,
}

/// The reserved descriptors, taken at the first spawn unless [`reserve`] took them before; held
/// by one spawn at a time.
static RESERVED: LazyLock<Mutex<Result<Reserved, Errno>>> = LazyLock::new(|| {
    let reserved = (|| {
        use nix::fcntl::{FcntlArg, OFlag, fcntl, open};
        let null = open(
            c"/dev/null",
            OFlag::O_RDWR | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        let above = |fd: &OwnedFd| -> Result<OwnedFd, Errno> {
            let fd = fcntl(fd, FcntlArg::F_DUPFD_CLOEXEC(3))?;
            // SAFETY: `fcntl` returned a new descriptor, owned by nothing else.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        };
        let null = above(&null)?;
        let mut slots = [0; GIVEN];
        for slot in &mut slots {
            // Open for the life of the process: its number is what is reserved.
            *slot = above(&null)?.into_raw_fd();
        }
        slots.sort_unstable();
        Ok(Reserved { slots, null })
    })();
    Mutex::new(reserved)
});

/// Reserves the descriptors the children's are passed through, at the lowest numbers free: called
/// first thing, before the process opens the many a service holds (later, they may be numbered
/// after those, and each spawn then copies as many). Reserving is otherwise done by the first
/// spawn.
pub fn reserve() {
    LazyLock::force(&RESERVED);
}

/// What the child's stdin is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stdin {
    /// A pipe, [`Child::stdin`].
    Piped,
    /// `/dev/null`.
    Null,
}

/// A process to start: its stdout and stderr are pipes, it leads a process group of its own.
pub struct Command {
    program: OsString,
    args: Vec<OsString>,
    env: BTreeMap<OsString, OsString>,
    cwd: PathBuf,
    stdin: Stdin,
    inherit: Option<OwnedFd>,
    sandbox: Option<sandbox::Prepared>,
}

impl Command {
    /// `program` (searched in the child's `PATH` unless it has a `/`), with loopd's environment,
    /// in loopd's working directory.
    pub fn new(program: impl AsRef<OsStr>) -> Command {
        Command {
            program: program.as_ref().to_owned(),
            args: Vec::new(),
            env: std::env::vars_os().collect(),
            cwd: PathBuf::from("."),
            stdin: Stdin::Null,
            inherit: None,
            sandbox: None,
        }
    }

    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut Command {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&mut self, args: I) -> &mut Command {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    pub fn env(&mut self, name: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Command {
        self.env
            .insert(name.as_ref().to_owned(), value.as_ref().to_owned());
        self
    }

    pub fn envs<I, K, V>(&mut self, vars: I) -> &mut Command
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        for (name, value) in vars {
            self.env(name, value);
        }
        self
    }

    pub fn env_remove(&mut self, name: impl AsRef<OsStr>) -> &mut Command {
        self.env.remove(name.as_ref());
        self
    }

    pub fn current_dir(&mut self, dir: impl AsRef<Path>) -> &mut Command {
        self.cwd = dir.as_ref().to_owned();
        self
    }

    pub fn stdin(&mut self, stdin: Stdin) -> &mut Command {
        self.stdin = stdin;
        self
    }

    /// The one descriptor the child inherits besides its standard streams: its 3, closed here
    /// once the child is started.
    pub fn inherit(&mut self, fd: OwnedFd) -> &mut Command {
        self.inherit = Some(fd);
        self
    }

    /// The sandbox the child enters before it execs (see `sandbox::Prepared::enter`).
    pub fn sandbox(&mut self, sandbox: sandbox::Prepared) -> &mut Command {
        self.sandbox = Some(sandbox);
        self
    }

    /// A command as `cmd` says it (its program, arguments, changes to the environment and
    /// working directory; not its standard streams, which are this module's).
    pub fn from_std(cmd: &std::process::Command) -> Command {
        let mut command = Command::new(cmd.get_program());
        command.args(cmd.get_args());
        for (name, value) in cmd.get_envs() {
            match value {
                Some(value) => command.env(name, value),
                None => command.env_remove(name),
            };
        }
        if let Some(dir) = cmd.get_current_dir() {
            command.current_dir(dir);
        }
        command
    }

    /// Starts the process, with its standard streams and what it inherits, and no other
    /// descriptor of loopd's; waited for in loopd's runtime.
    pub fn spawn(&mut self) -> io::Result<Child> {
        let started = self.start()?;
        let pid = started.pid;
        let child = (|| {
            // SAFETY: the pidfd is owned, open, and given to the `AsyncFd` for its whole life.
            let pidfd = unsafe {
                AsyncFd::register_with_interest(started.pidfd, tokio::io::Interest::READABLE)
            }
            .map_err(io::Error::from)?;
            io::Result::Ok(Child {
                pid,
                pidfd: Some(pidfd),
                stdin: started.stdin.map(pipe::Sender::from_owned_fd).transpose()?,
                stdout: Some(pipe::Receiver::from_owned_fd(started.stdout)?),
                stderr: Some(pipe::Receiver::from_owned_fd(started.stderr)?),
                status: None,
            })
        })();
        // A child whose pipes or pidfd could not be set up is not left running.
        child.inspect_err(|_| end(pid as libc::pid_t))
    }

    /// Starts the process as [`Command::spawn`] does, with no runtime: its pid, pidfd and the
    /// parent's ends of its pipes.
    pub fn start(&mut self) -> io::Result<Started> {
        let program = c_string(self.program.as_bytes())?;
        let paths = self.search_paths(&program)?;
        let argv = std::iter::once(Ok(program))
            .chain(self.args.iter().map(|a| c_string(a.as_bytes())))
            .collect::<io::Result<Vec<_>>>()?;
        let envp = self
            .env
            .iter()
            .map(|(k, v)| c_string(&[k.as_bytes(), b"=", v.as_bytes()].concat()))
            .collect::<io::Result<Vec<_>>>()?;
        let cwd = c_string(self.cwd.as_os_str().as_bytes())?;

        let reserved = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
        let reserved = reserved.as_ref().map_err(|errno| {
            io::Error::new(
                io::Error::from(*errno).kind(),
                format!("reserving descriptors for children: {errno}"),
            )
        })?;
        let (stdin_child, stdin_parent) = match self.stdin {
            Stdin::Piped => {
                let (read, write) = pipe_above_stdio()?;
                (Some(read), Some(write))
            }
            Stdin::Null => (None, None),
        };
        let (stdout_parent, stdout_child) = pipe_above_stdio()?;
        let (stderr_parent, stderr_child) = pipe_above_stdio()?;
        let stdin_raw = stdin_child
            .as_ref()
            .map_or(reserved.null.as_raw_fd(), |fd| fd.as_raw_fd());
        let mut given = [-1; GIVEN];
        given[..3].copy_from_slice(&[
            stdin_raw,
            stdout_child.as_raw_fd(),
            stderr_child.as_raw_fd(),
        ]);
        let count = match &self.inherit {
            Some(fd) => {
                given[3] = fd.as_raw_fd();
                4
            }
            None => 3,
        };

        let ctx = Ctx {
            paths: null_terminated(&paths),
            argv: null_terminated(&argv),
            envp: null_terminated(&envp),
            cwd: &cwd,
            given: &given[..count],
            slots: &reserved.slots[..count],
            first_unshared: reserved.slots[GIVEN - 1] + 1,
            sandbox: self.sandbox.as_ref(),
            failure: Cell::new(None),
        };
        let cloned = crate::clone::clone_vfork(child_main, &ctx, 0);
        // The child has exec'd or exited: the slots it filled in the table it shared are set
        // back, which lets go of loopd's references to its pipes.
        for slot in reserved.slots {
            // SAFETY: puts `/dev/null` in a reserved descriptor, which nothing else uses.
            unsafe { libc::dup3(reserved.null.as_raw_fd(), slot, libc::O_CLOEXEC) };
        }
        let (pid, pidfd) = cloned?;
        drop((stdin_child, stdout_child, stderr_child, self.inherit.take()));
        if let Some(failure) = ctx.failure.get() {
            // It has exited (the parent runs again once the child has exec'd or exited).
            end(pid);
            return Err(failure.into());
        }
        Ok(Started {
            pid: pid as u32,
            pidfd,
            stdin: stdin_parent,
            stdout: stdout_parent,
            stderr: stderr_parent,
        })
    }

    /// The paths the child tries to exec, in order: `program` itself if it names a path, else
    /// it in each directory of the child's `PATH` (as `execvp` searches).
    fn search_paths(&self, program: &CString) -> io::Result<Vec<CString>> {
        let bytes = program.as_bytes();
        if bytes.contains(&b'/') {
            return Ok(vec![program.clone()]);
        }
        let path = self
            .env
            .get(OsStr::new("PATH"))
            .map_or(&b"/usr/local/bin:/usr/bin:/bin"[..], |p| p.as_bytes());
        path.split(|b| *b == b':')
            .map(|dir| {
                let dir = if dir.is_empty() { &b"."[..] } else { dir };
                c_string(&[dir, b"/", bytes].concat())
            })
            .collect()
    }
}

fn c_string(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "an argument or variable with a NUL byte",
        )
    })
}

/// The pointers of `strings`, then a null pointer, as `execve` takes them.
fn null_terminated(strings: &[CString]) -> Vec<*const c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// A close-on-exec pipe `(read, write)`, both ends numbered 3 or more.
fn pipe_above_stdio() -> io::Result<(OwnedFd, OwnedFd)> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((above_stdio(read)?, above_stdio(write)?))
}

/// `fd`, renumbered to 3 or more if it took the place of a standard stream loopd runs without:
/// the child's `dup2` onto 0, 1 and 2 then never overwrites another of its sources.
fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    let moved = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3))?;
    // SAFETY: `fcntl` returned a new descriptor, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(moved) })
}

impl From<Failure> for io::Error {
    fn from(failure: Failure) -> io::Error {
        match failure.errno {
            // The exec's own error, as std reports it.
            Some(errno) if failure.step == EXEC => io::Error::from(errno),
            Some(errno) => io::Error::new(io::Error::from(errno).kind(), failure.to_string()),
            None => io::Error::other(failure.to_string()),
        }
    }
}

const EXEC: &str = "exec";

/// What the child reads, and the one place it writes.
struct Ctx<'a> {
    paths: Vec<*const c_char>,
    argv: Vec<*const c_char>,
    envp: Vec<*const c_char>,
    cwd: &'a CString,
    /// The descriptors it is given, which it has as 0, 1, 2 (and 3)...
    given: &'a [RawFd],
    /// ...passed through these reserved ones, ascending, each 3 or more.
    slots: &'a [RawFd],
    /// The number after the last reserved descriptor: the child's own table keeps those below.
    first_unshared: RawFd,
    sandbox: Option<&'a sandbox::Prepared>,
    failure: Cell<Option<Failure>>,
}

/// The child: from the clone to the exec, system calls only (see the module's rules).
extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Ctx` the parent passed, alive while it waits.
    let ctx = unsafe { &*(arg as *const Ctx<'_>) };
    let failure = prepare_and_exec(ctx);
    ctx.failure.set(Some(failure));
    // SAFETY: ends the child without running anything of the parent's (no atexit, no flush).
    unsafe { libc::_exit(127) }
}

/// Returns only if the child could not start, with why.
fn prepare_and_exec(ctx: &Ctx<'_>) -> Failure {
    // SAFETY (the whole function): system calls on descriptors, strings and arrays the parent
    // made for the child.
    unsafe {
        // No handler of loopd's may run in the child: each one installed is reset, and SIGPIPE,
        // which Rust programs ignore, is given back its default as std does for its children.
        for signal in 1..libc::SIGRTMAX() + 1 {
            let mut action: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut action) != 0 {
                continue;
            }
            let handled = !matches!(action.sa_sigaction, libc::SIG_DFL | libc::SIG_IGN);
            if handled || signal == libc::SIGPIPE {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(signal, &default, std::ptr::null_mut());
            }
        }
        if libc::setpgid(0, 0) != 0 {
            return Failure::os("setpgid");
        }
        if libc::chdir(ctx.cwd.as_ptr()) != 0 {
            return Failure::os("chdir");
        }
        if let Some(sandbox) = ctx.sandbox
            && let Err(failure) = sandbox.enter()
        {
            return failure;
        }
        // Until here the child shares loopd's table of descriptors: what it is given goes into
        // the reserved slots of that table, then it takes a table of its own with only the
        // descriptors below the first it closes (Linux 5.9; before it, a copy of the whole
        // table, whose descriptors of loopd's are close-on-exec).
        for (fd, slot) in ctx.given.iter().zip(ctx.slots) {
            if libc::dup3(*fd, *slot, libc::O_CLOEXEC) < 0 {
                return Failure::os("passing a descriptor");
            }
        }
        let unshared = libc::syscall(
            libc::SYS_close_range,
            ctx.first_unshared as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_UNSHARE,
        );
        if unshared != 0 && libc::unshare(libc::CLONE_FILES) != 0 {
            return Failure::os("taking a table of descriptors of its own");
        }
        // Each slot is 3 or more and above the ones before it, so none is overwritten before
        // it is read.
        for (target, slot) in ctx.slots.iter().enumerate() {
            if libc::dup2(*slot, target as c_int) < 0 {
                return Failure::os("dup2");
            }
        }
        libc::syscall(
            libc::SYS_close_range,
            ctx.slots.len() as libc::c_uint,
            libc::c_uint::MAX,
            0,
        );
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        // As `execvp`: a path that is not there, or not a file one may run, lets the search go
        // on; the first such denial is what is reported if no path runs.
        let mut failure = Failure {
            step: EXEC,
            errno: Some(Errno::ENOENT),
        };
        let mut denied = false;
        for path in ctx.paths.iter().take_while(|p| !p.is_null()) {
            libc::execve(*path, ctx.argv.as_ptr(), ctx.envp.as_ptr());
            let errno = Errno::last();
            match errno {
                Errno::EACCES if !denied => {
                    denied = true;
                    failure.errno = Some(errno);
                }
                Errno::EACCES | Errno::ENOENT | Errno::ENOTDIR => {}
                _ => {
                    failure.errno = Some(errno);
                    return failure;
                }
            }
        }
        failure
    }
}

/// Kills `pid`, a child of this process nothing else reaps, and reaps it.
fn end(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: signals and waits for this process's own child, not reaped yet.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, &mut status, 0);
    }
}

/// A started process: its pipes, and its pidfd to wait on. Dropped before it was reaped, it is
/// killed (SIGKILL, its group left to its owner) and reaped when it has gone.
pub struct Child {
    pid: u32,
    pidfd: Option<AsyncFd<OwnedFd>>,
    pub stdin: Option<pipe::Sender>,
    pub stdout: Option<pipe::Receiver>,
    pub stderr: Option<pipe::Receiver>,
    status: Option<ExitStatus>,
}

impl Child {
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// Waits for the process to exit and reaps it. Cancel-safe: the status, once taken, is kept.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        loop {
            if let Some(status) = self.status {
                return Ok(status);
            }
            let Some(pidfd) = &self.pidfd else {
                return Err(io::Error::other("the child's pidfd is gone"));
            };
            let mut ready = pidfd.readable().await?;
            match reap(self.pid)? {
                Some(status) => self.status = Some(status),
                None => ready.clear_ready(),
            }
        }
    }
}

/// A child [`Command::start`]ed: its pid, its pidfd, and the parent's ends of its pipes.
pub struct Started {
    pub pid: u32,
    pidfd: OwnedFd,
    pub stdin: Option<OwnedFd>,
    stdout: OwnedFd,
    stderr: OwnedFd,
}

impl Started {
    /// Closes its standard input, reads its standard output and error to their ends, and
    /// waits for it to exit (blocking the thread), as [`std::process::Child::wait_with_output`].
    pub fn wait_with_output(self) -> io::Result<std::process::Output> {
        drop(self.stdin);
        let (stdout, stderr) = read_both(self.stdout, self.stderr)?;
        let status = loop {
            // SAFETY: waits for this process's own child.
            let mut status = 0;
            match unsafe { libc::waitpid(self.pid as libc::pid_t, &mut status, 0) } {
                n if n > 0 => break ExitStatus::from_raw(status),
                _ if Errno::last() == Errno::EINTR => {}
                _ => return Err(io::Error::last_os_error()),
            }
        };
        drop(self.pidfd);
        Ok(std::process::Output {
            status,
            stdout,
            stderr,
        })
    }
}

/// Reads two pipes to their ends, each as it has something: a read of the other would wait
/// while the writer waits for this one to be read.
fn read_both(first: OwnedFd, second: OwnedFd) -> io::Result<(Vec<u8>, Vec<u8>)> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::os::fd::AsFd as _;
    let mut pipes = [(Some(first), Vec::new()), (Some(second), Vec::new())];
    let mut buf = [0u8; 8192];
    while pipes.iter().any(|(fd, _)| fd.is_some()) {
        let ready: Vec<usize> = {
            let (which, mut fds): (Vec<usize>, Vec<PollFd<'_>>) = pipes
                .iter()
                .enumerate()
                .filter_map(|(i, (fd, _))| {
                    Some((i, PollFd::new(fd.as_ref()?.as_fd(), PollFlags::POLLIN)))
                })
                .unzip();
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
            which
                .into_iter()
                .zip(&fds)
                .filter(|(_, fd)| fd.revents().is_some_and(|r| !r.is_empty()))
                .map(|(i, _)| i)
                .collect()
        };
        for i in ready {
            let (pipe, sink) = &mut pipes[i];
            let Some(fd) = pipe else { continue };
            match nix::unistd::read(&*fd, &mut buf) {
                Ok(0) => *pipe = None,
                Ok(n) => sink.extend_from_slice(&buf[..n]),
                Err(Errno::EAGAIN | Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    let [(_, first), (_, second)] = pipes;
    Ok((first, second))
}

/// Reaps `pid`, a child of this process, if it has exited.
fn reap(pid: u32) -> io::Result<Option<ExitStatus>> {
    let mut status = 0;
    // SAFETY: waits, without blocking, for this process's own child.
    match unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) } {
        0 => Ok(None),
        n if n < 0 => Err(io::Error::last_os_error()),
        _ => Ok(Some(ExitStatus::from_raw(status))),
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.status.is_some() || matches!(reap(self.pid), Ok(Some(_)) | Err(_)) {
            return;
        }
        // Not reaped, so the pid is still this child's.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let (pid, pidfd) = (self.pid, self.pidfd.take());
        if let (Ok(runtime), Some(pidfd)) = (tokio::runtime::Handle::try_current(), pidfd) {
            runtime.spawn(async move {
                let _ = pidfd.readable().await;
                let _ = reap(pid);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn read_all(pipe: Option<pipe::Receiver>) -> String {
        let mut text = String::new();
        pipe.unwrap().read_to_string(&mut text).await.unwrap();
        text
    }

    fn script(dir: &Path, name: &str, body: &str, mode: u32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[tokio::test]
    async fn a_child_gets_its_arguments_environment_directory_and_pipes() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new("sh")
            .args([
                "-c",
                "read line; echo \"$line $1 $GREETING $(pwd)\"; echo err >&2; exit 3",
                "sh",
                "arg",
            ])
            .env("GREETING", "hello")
            .current_dir(dir.path())
            .stdin(Stdin::Piped)
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"prompt\n").await.unwrap();
        drop(stdin);
        let (out, err) = (child.stdout.take(), child.stderr.take());
        let (out, err) = tokio::join!(read_all(out), read_all(err));
        let status = child.wait().await.unwrap();
        let cwd = dir.path().canonicalize().unwrap();
        assert_eq!(out, format!("prompt arg hello {}\n", cwd.display()));
        assert_eq!(err, "err\n");
        assert_eq!(status.code(), Some(3));
    }

    #[tokio::test]
    async fn a_child_has_its_streams_and_what_it_inherits_and_no_other_descriptor() {
        // Descriptors of loopd's, close-on-exec or not, at numbers above and below the reserved
        // ones: none reaches the child.
        let leaky: Vec<OwnedFd> = (0..200)
            .map(|_| {
                let fd = nix::fcntl::open(c"/dev/null", nix::fcntl::OFlag::O_RDONLY, Mode::empty());
                fd.unwrap()
            })
            .collect();
        let marker =
            nix::sys::memfd::memfd_create("the-marker", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                .unwrap();
        let list = "ls /proc/self/fd; readlink /proc/self/fd/3";
        let mut child = Command::new("sh")
            .args(["-c", list])
            .inherit(marker)
            .spawn()
            .unwrap();
        let out = read_all(child.stdout.take()).await;
        assert!(child.wait().await.unwrap().success());
        let mut lines: Vec<&str> = out.lines().collect();
        let link = lines.pop().unwrap();
        // `ls` has the directory it lists open as one more.
        let fds: Vec<u32> = lines.iter().map(|l| l.parse().unwrap()).collect();
        assert_eq!(&fds[..4], &[0, 1, 2, 3], "{out}");
        assert_eq!(fds.len(), 5, "{out}");
        assert!(link.starts_with("/memfd:the-marker"), "{link}");

        // Without one to inherit: the streams only (and `ls`'s own, now 3; no 3 to read as a
        // link), and the reserved descriptors are `/dev/null` again in this process.
        let mut child = Command::new("sh").args(["-c", list]).spawn().unwrap();
        let out = read_all(child.stdout.take()).await;
        child.wait().await.unwrap();
        assert_eq!(out, "0\n1\n2\n3\n");
        let reserved = RESERVED.lock().unwrap();
        for slot in reserved.as_ref().unwrap().slots {
            let target = std::fs::read_link(format!("/proc/self/fd/{slot}")).unwrap();
            assert_eq!(target, Path::new("/dev/null"));
        }
        drop(leaky);
    }

    #[tokio::test]
    async fn a_child_leads_its_group_with_no_signal_blocked_nor_sigpipe_ignored() {
        // A handler of the parent's own, which must not be the child's.
        let _handler =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1()).unwrap();
        let mut child = Command::new("sh")
            .args([
                "-c",
                "echo $$; cut -d' ' -f5 /proc/$$/stat; grep -E '^Sig(Blk|Ign):' /proc/self/status",
            ])
            .spawn()
            .unwrap();
        let out = read_all(child.stdout.take()).await;
        assert!(child.wait().await.unwrap().success());
        let lines: Vec<&str> = out.lines().map(str::trim).collect();
        assert_eq!(lines[0], child.id().to_string(), "{out}");
        assert_eq!(lines[1], lines[0], "its own process group: {out}");
        let mask = |name: &str| {
            let line = lines.iter().find(|l| l.starts_with(name)).unwrap();
            u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
        };
        assert_eq!(mask("SigBlk:"), 0, "{out}");
        assert_eq!(mask("SigIgn:") & (1 << (libc::SIGPIPE - 1)), 0, "{out}");
    }

    #[tokio::test]
    async fn the_path_search_skips_what_cannot_run_and_a_missing_program_is_an_error() {
        let (first, second) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        script(first.path(), "agent", "echo not runnable", 0o644);
        script(second.path(), "agent", "echo ran", 0o755);
        let path = format!("{}:{}", first.path().display(), second.path().display());
        let mut child = Command::new("agent").env("PATH", &path).spawn().unwrap();
        assert_eq!(read_all(child.stdout.take()).await, "ran\n");
        assert!(child.wait().await.unwrap().success());

        let only_denied = first.path().display().to_string();
        let denied = Command::new("agent")
            .env("PATH", only_denied)
            .spawn()
            .err()
            .unwrap();
        assert_eq!(denied.kind(), io::ErrorKind::PermissionDenied, "{denied}");
        let missing = Command::new("no-such-agent")
            .env("PATH", &path)
            .spawn()
            .err()
            .unwrap();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound, "{missing}");
        let bad_dir = Command::new("true")
            .current_dir("/no/such/dir")
            .spawn()
            .err()
            .unwrap();
        assert!(bad_dir.to_string().starts_with("chdir: "), "{bad_dir}");
    }

    #[tokio::test]
    async fn a_child_dropped_before_its_end_is_killed_and_reaped() {
        let child = Command::new("sleep").arg("600").spawn().unwrap();
        let pid = child.id();
        drop(child);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(std::time::Instant::now() < deadline, "{pid} still there");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}
