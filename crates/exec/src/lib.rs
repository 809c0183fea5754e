//! Executors: run one action attempt as a subprocess and report how it ended.
//!
//! Theory of operation: the command starts in the project root, in a process group of its own, with
//! the `LOOPD_*` environment. The prompt goes to stdin, which is then closed (or as an argument or
//! a file). One task multiplexes the child's stdout and stderr, its exit, the wall-clock and idle
//! timers and the cancellation token. Output goes to the attempt's log file up to a size cap; only a
//! bounded tail of stdout is kept in memory, for finding the result. However the attempt ends (exit,
//! timeout, cancellation) the whole process group is then ended — SIGTERM, grace, SIGKILL — and
//! the child is always reaped, so no process of an attempt outlives it.
//!
//! An executor never touches the state file: it reports a [`Run`], and [`result`] turns that into
//! an attempt's verdict. [`procs`] keeps the process groups of the attempts in flight (and ends
//! them, and finds what they left behind); [`agent`] reads the event streams of the agent CLIs
//! (Claude Code, Codex, Gemini CLI, Qwen Code) as they arrive; [`checkpoint`] records the work
//! tree after an action as a git commit of the loop's own, through [`git`] (never a shell).
//!
//! Which layer may use which: this crate uses [`loopd_core`] (the result protocol) and
//! [`loopd_fs`] (the attempt's log and result files), nothing else of loopd's: no state file, no
//! store, no command line. Every driver uses it, whether its loops live in files or elsewhere.

pub mod agent;
pub mod checkpoint;
mod clone;
pub mod git;
pub mod guard;
pub mod metrics;
pub mod procs;
pub mod result;
pub mod sandbox;
mod settings;
pub mod spawn;

pub use settings::{Format, PromptMode, Supervision};

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio_util::sync::CancellationToken;

use loopd_fs::Dir;

/// How much of stdout is kept in memory to find the result in.
pub const TAIL_CAP: usize = 1 << 20;
/// How much of a pipe one read takes. An attempt waits for its pipes to be readable, then reads
/// into a buffer on the stack (see [`read_ready`]): a service running a thousand attempts holds
/// no read buffer for any of them.
const READ_BUF: usize = 8 * 1024;

/// One attempt to run.
#[derive(Clone, Debug)]
pub struct Spec {
    pub argv: Vec<String>,
    pub prompt: String,
    pub prompt_mode: PromptMode,
    pub env: Vec<(String, OsString)>,
    pub cwd: PathBuf,
    /// The loop's state directory: read-only to a sandboxed attempt, but for its loop's progress
    /// directory (the parent of `dir`).
    pub state_dir: PathBuf,
    pub supervision: Supervision,
    /// Where the attempt's files go: `{stem}.log` (its output) and `{stem}.prompt.md` (the
    /// prompt, when the executor takes it as a file).
    pub dir: Dir,
    pub stem: String,
    /// The name of the marker the executor and everything it starts inherit (see
    /// [`procs::marker_name`]).
    pub marker: String,
    /// For an agent's output format: its stream, fed stdout as it comes.
    pub agent: Option<agent::AgentStream>,
    /// What this attempt may still spend, if the loop has a budget.
    pub budget: Budget,
    /// What it may do ([`sandbox`]): it may always write in `dir` and the directory `dir` is in
    /// (the loop's progress directory).
    pub sandbox: sandbox::Policy,
}

/// Tokens and dollars an attempt may still spend.
#[derive(Clone, Copy, Debug, Default)]
pub struct Budget {
    pub tokens: Option<u64>,
    pub cost_usd: Option<f64>,
}

impl Budget {
    /// Whether an agent's spending so far crossed this budget.
    pub fn crossed(&self, stream: &agent::AgentStream) -> bool {
        self.tokens.is_some_and(|t| stream.usage.total() > t)
            || self
                .cost_usd
                .is_some_and(|c| stream.cost_usd.is_some_and(|spent| spent > c))
    }

    /// One of `n` equal shares, for attempts that run at once and spend from one budget: together
    /// they never spend more than it.
    pub fn share(self, n: usize) -> Budget {
        let n = n.max(1);
        Budget {
            tokens: self.tokens.map(|t| t / n as u64),
            cost_usd: self.cost_usd.map(|c| c / n as f64),
        }
    }
}

/// Where `program` is, as a process started in `cwd` with `path` as its PATH finds it.
pub fn find_program_in(
    program: &str,
    cwd: &Path,
    path: Option<&std::ffi::OsStr>,
) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = cwd.join(program);
        return executable(&p).then_some(p);
    }
    std::env::split_paths(path?)
        .map(|dir| cwd.join(dir).join(program))
        .find(|p| executable(p))
}

/// The executor's process, once spawned.
#[derive(Clone, Copy, Debug)]
pub struct Spawned {
    pub pid: u32,
    pub pgid: u32,
    pub proc_start: Option<u64>,
}

impl Spawned {
    /// SIGTERMs its process group if that is still this attempt's; true when it did.
    pub fn terminate(self) -> bool {
        procs::terminate_in_flight(self.pgid, self.proc_start)
    }
}

/// Why supervision ended the attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// The wall-clock limit.
    Timeout(Duration),
    /// No output for this long.
    Idle(Duration),
    /// Cancelled from outside (pause, stop, shutdown).
    Cancelled,
    /// The agent's final event came and it did not exit within the grace: its tree was ended.
    /// Not a failure.
    Lingered,
    /// The agent's spending crossed the loop's budget.
    Budget,
}

/// How an attempt's process ended.
#[derive(Debug)]
pub struct Run {
    pub spawned: Spawned,
    /// The main process's exit status (after a cut, the one the kill produced).
    pub status: Option<ExitStatus>,
    pub cut: Option<Cut>,
    pub duration: Duration,
    /// The last [`TAIL_CAP`] bytes of stdout.
    pub stdout_tail: Vec<u8>,
    /// The last [`TAIL_CAP`] bytes of stdout and stderr, interleaved as they came.
    pub output_tail: Vec<u8>,
    /// All output bytes, kept or not.
    pub output_bytes: u64,
    /// Whether the process group had to be SIGKILLed.
    pub killed: bool,
    /// The agent's stream, read to the end.
    pub agent: Option<agent::AgentStream>,
    /// What loopd's proxy refused it (a network of hosts).
    pub network_refused: Vec<sandbox::Refusal>,
}

/// Starts attempts. Two phases, so that the daemon records the attempt in flight (and learns that
/// it could not) before it supervises it: [`Executor::spawn`] starts the process and returns at
/// once; [`Attempt::supervise`] then runs it to its end.
#[async_trait::async_trait]
pub trait Executor: Send + Sync {
    /// Starts one attempt: its files and its process, in a process group of its own. No output is
    /// read yet.
    fn spawn(&self, spec: Spec) -> io::Result<Box<dyn Attempt>> {
        self.spawn_when(spec, &mut || {})
    }

    /// [`Executor::spawn`], which calls `ready` once all is ready and the process is about to
    /// start: what must hold before an attempt starts is waited for there (the daemon's last
    /// action durable), while the attempt's preparation (its command, its sandbox) overlaps the
    /// wait. Not called when the attempt cannot start.
    fn spawn_when(&self, spec: Spec, ready: &mut dyn FnMut()) -> io::Result<Box<dyn Attempt>>;

    /// Ends whatever a daemon that died left running of the loop whose state file is
    /// `state_file`, giving each process `grace` to go; returns how many processes there were.
    async fn end_leftovers(&self, state_file: &std::path::Path, grace: Duration) -> usize;
}

/// An attempt whose process runs.
#[async_trait::async_trait]
pub trait Attempt: Send {
    /// The process, as it was started.
    fn spawned(&self) -> Spawned;
    /// Supervises the attempt to its end: output to the log, timeouts, the agent's stream, the
    /// cancellation token. However it ends, every process of its group is ended and the main one
    /// reaped. `told` hears what the agent's stream tells as it goes: each request it retries
    /// on its own, what it has spent so far.
    async fn supervise(
        self: Box<Self>,
        cancel: CancellationToken,
        told: &mut (dyn FnMut(agent::Told) + Send),
    ) -> io::Result<Run>;
}

/// The executor of real subprocesses.
pub struct Subprocess;

#[async_trait::async_trait]
impl Executor for Subprocess {
    fn spawn_when(&self, spec: Spec, ready: &mut dyn FnMut()) -> io::Result<Box<dyn Attempt>> {
        Ok(Box::new(SubprocessAttempt::start(spec, ready)?))
    }

    /// Only processes that prove they are the loop's executors are ended: by the marker every
    /// executor inherits, or by the loop's state file in their environment. A pid or group the
    /// state file records is the file's word, which anyone who can write the file can make up.
    async fn end_leftovers(&self, state_file: &std::path::Path, grace: Duration) -> usize {
        let marker = procs::marker_name(state_file);
        let leftovers = procs::leftovers(&marker, state_file);
        if !leftovers.is_empty() {
            procs::end_processes(&[], &leftovers, &marker, grace).await;
        }
        leftovers.len()
    }
}

/// A subprocess attempt: its child, its log, and what is read from it.
struct SubprocessAttempt {
    child: spawn::Child,
    spawned: Spawned,
    started: Instant,
    supervision: Supervision,
    output: Output,
    /// The marker its processes inherit: how those reparented to this process are told apart
    /// from other attempts'.
    marker: String,
    /// Its private temporary directory (sandboxed), put away at its end (see [`PrivateTmp`]).
    tmp: Option<PrivateTmp>,
    /// What loopd's proxy refused it (a network of hosts).
    refusals: Option<sandbox::network::Refusals>,
}

/// A sandboxed attempt's private temporary directory, `{stem}.tmp` in its files' directory. One
/// left empty is kept, as [`PrivateTmp::SPARE`], for the next attempt to take rather than make a
/// directory anew: on a filesystem that has freed many inodes lately (ext4 looks past each
/// before it reuses one) a `mkdir` per attempt cost more than the rest of the spawn.
struct PrivateTmp {
    dir: loopd_fs::Dir,
    name: String,
    path: PathBuf,
}

impl PrivateTmp {
    const SPARE: &str = "spare.tmp";

    /// Makes `name` in `dir`, of the spare if there is one.
    fn take(dir: &loopd_fs::Dir, name: &str) -> io::Result<()> {
        let spare = dir.rename_new(Self::SPARE, name).is_ok();
        match dir.subdir(name, true) {
            // Something else in the spare's place (the attempt that left it may have made it
            // a link): removed, and a directory made.
            Err(_) if spare => {
                let _ = std::fs::remove_dir_all(dir.join(name));
                dir.subdir(name, true).map(drop)
            }
            opened => opened.map(drop),
        }
    }

    /// At the attempt's end, when none of its processes is left: kept as the spare if it is an
    /// empty directory (and no other is), else removed with what is in it.
    fn put_away(&self) {
        let empty = self
            .dir
            .subdir(&self.name, false)
            .and_then(|tmp| tmp.entries())
            .is_ok_and(|entries| entries.is_empty());
        if !(empty && self.dir.rename_new(&self.name, Self::SPARE).is_ok()) {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// What an attempt's output goes to: the log, the tails, the agent's stream.
struct Output {
    log: CappedLog,
    stdout_tail: Tail,
    output_tail: Tail,
    agent: Option<agent::AgentStream>,
    budget: Budget,
}

/// What a chunk of stdout said.
enum Heard {
    /// Progress: the idle timer starts again.
    Progress,
    /// Only an agent's note that it reconnects: no progress.
    Noise,
    /// The agent's final event: it may linger for `final_grace`, no longer.
    Final,
    /// The agent's spending crossed the budget.
    OverBudget,
}

impl Output {
    fn stdout(&mut self, bytes: &[u8], told: &mut (dyn FnMut(agent::Told) + Send)) -> Heard {
        self.log.write(bytes);
        self.stdout_tail.push(bytes);
        self.output_tail.push(bytes);
        let Some(stream) = &mut self.agent else {
            return Heard::Progress;
        };
        let spent = (stream.usage.total(), stream.cost_usd);
        let signal = stream.feed(bytes);
        for retry in stream.take_retries() {
            told(agent::Told::Retry(retry));
        }
        if (stream.usage.total(), stream.cost_usd) != spent {
            told(agent::Told::Spent {
                tokens: stream.usage.total(),
                cost_usd: stream.cost_usd,
            });
        }
        if self.budget.crossed(stream) {
            return Heard::OverBudget;
        }
        match signal {
            agent::Signal::Final => Heard::Final,
            agent::Signal::Noise => Heard::Noise,
            _ => Heard::Progress,
        }
    }

    fn stderr(&mut self, bytes: &[u8]) {
        self.log.write(bytes);
        self.output_tail.push(bytes);
    }
}

impl SubprocessAttempt {
    fn start(spec: Spec, ready: &mut dyn FnMut()) -> io::Result<SubprocessAttempt> {
        let Some((program, args)) = spec.argv.split_first() else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty command"));
        };
        let mut command = spawn::Command::new(program);
        command
            .args(args)
            .current_dir(&spec.cwd)
            .envs(spec.env.iter().map(|(k, v)| (k, v)));
        match spec.prompt_mode {
            PromptMode::Stdin => command.stdin(spawn::Stdin::Piped),
            PromptMode::Arg => command.arg(&spec.prompt),
            PromptMode::File => {
                let name = format!("{}.prompt.md", spec.stem);
                spec.dir
                    .create(&name)
                    .and_then(|mut f| f.write_all(spec.prompt.as_bytes()))?;
                command.arg(spec.dir.join(&name))
            }
        };
        let log_name = format!("{}.log", spec.stem);
        let log = CappedLog {
            file: Some(spec.dir.create(&log_name)?),
            path: spec.dir.join(&log_name),
            cap: spec.supervision.output_cap,
            written: 0,
            seen: 0,
        };
        // Sandboxed, its temporary files go to a directory of its own, removed at its end.
        let tmp = (spec.sandbox.mode != sandbox::Mode::Off).then(|| {
            let name = format!("{}.tmp", spec.stem);
            (name.clone(), spec.dir.join(&name))
        });
        // Its own files, and the loop's progress directory they are in (the notes its prompt
        // may ask it to keep there, `$LOOPD_PROGRESS_DIR`).
        let progress_dir = spec.dir.path().parent();
        let own: Vec<&Path> = std::iter::once(spec.dir.path())
            .chain(progress_dir)
            .collect();
        let place = sandbox::Place {
            tree: &spec.cwd,
            own: &own,
            state_dir: Some(&spec.state_dir),
            progress_dir,
        };
        // loopd's own connection to Temporal (an API key, a client key) is none of its business,
        // unless its executor sets such a variable itself.
        for (name, _) in std::env::vars_os() {
            let ours = name.to_str().is_some_and(|n| n.starts_with("TEMPORAL_"));
            if ours
                && !spec
                    .env
                    .iter()
                    .any(|(k, _)| std::ffi::OsStr::new(k) == name)
            {
                command.env_remove(name);
            }
        }
        let mut refusals = None;
        if let Some(sandboxed) = spec.sandbox.prepare(&place)? {
            // Another program's socket is not named to it (nor reachable: see the sandbox),
            // unless its executor sets the variable itself.
            for name in sandbox::SOCKET_VARIABLES {
                if !spec.env.iter().any(|(k, _)| k == name) {
                    command.env_remove(name);
                }
            }
            // A network of hosts: its clients are sent to loopd's proxy, and told of no way
            // around it.
            let proxy = sandboxed.proxy_env();
            if !proxy.is_empty() {
                command.env_remove("NO_PROXY").env_remove("no_proxy");
                command.envs(proxy);
            }
            refusals = sandboxed.refusals();
            command.sandbox(sandboxed);
        }
        if let Some((name, path)) = &tmp {
            PrivateTmp::take(&spec.dir, name)?;
            command.env("TMPDIR", path);
        }
        ready();
        let started = Instant::now();
        let mut child = spawn_marked(&mut command, &spec.marker).map_err(|e| {
            if let Some((_, path)) = &tmp {
                let _ = std::fs::remove_dir_all(path);
            }
            io::Error::new(e.kind(), format!("cannot start {program:?}: {e}"))
        })?;
        let pid = child.id();
        let spawned = Spawned {
            pid,
            pgid: pid,
            proc_start: procs::ProcStat::read(pid).map(|s| s.start),
        };
        // The prompt is fed on its own task, so a child that never reads stdin cannot block the
        // daemon; dropping the pipe closes it.
        if let Some(mut stdin) = child.stdin.take() {
            let prompt = spec.prompt;
            tokio::spawn(async move {
                let _ = stdin.write_all(prompt.as_bytes()).await;
            });
        }
        Ok(SubprocessAttempt {
            child,
            spawned,
            started,
            supervision: spec.supervision,
            output: Output {
                log,
                stdout_tail: Tail::default(),
                output_tail: Tail::default(),
                agent: spec.agent,
                budget: spec.budget,
            },
            marker: spec.marker,
            tmp: tmp.map(|(name, path)| PrivateTmp {
                dir: spec.dir.clone(),
                name,
                path,
            }),
            refusals,
        })
    }
}

#[async_trait::async_trait]
impl Attempt for SubprocessAttempt {
    fn spawned(&self) -> Spawned {
        self.spawned
    }

    async fn supervise(
        mut self: Box<Self>,
        cancel: CancellationToken,
        told: &mut (dyn FnMut(agent::Told) + Send),
    ) -> io::Result<Run> {
        let mut stdout = self.child.stdout.take();
        let mut stderr = self.child.stderr.take();
        let sup = self.supervision;
        let wall = tokio::time::sleep(sup.timeout);
        let idle = tokio::time::sleep(sup.idle_timeout);
        tokio::pin!(wall, idle);
        let mut status: Option<ExitStatus> = None;
        let mut cut = None;
        // Set once the agent's final event is read: it may linger until then.
        let mut linger_until: Option<tokio::time::Instant> = None;
        // Once the main process has exited, what it left behind gets a moment to flush, then ends.
        let mut drain_until: Option<tokio::time::Instant> = None;
        let now = tokio::time::Instant::now;
        while stdout.is_some() || stderr.is_some() || status.is_none() {
            tokio::select! {
                () = readable(&stdout) => match read_ready(&mut stdout, |b| self.output.stdout(b, told)) {
                    Some(Heard::OverBudget) => { cut = Some(Cut::Budget); break }
                    Some(Heard::Noise) | None => {}
                    Some(Heard::Final) => {
                        idle.as_mut().reset(now() + sup.idle_timeout);
                        linger_until.get_or_insert(now() + sup.final_grace);
                    }
                    Some(Heard::Progress) => idle.as_mut().reset(now() + sup.idle_timeout),
                },
                () = readable(&stderr) => {
                    if read_ready(&mut stderr, |b| self.output.stderr(b)).is_some() {
                        idle.as_mut().reset(now() + sup.idle_timeout);
                    }
                }
                s = self.child.wait(), if status.is_none() => {
                    status = Some(s?);
                    drain_until = Some(now() + Duration::from_millis(200));
                }
                () = sleep_until(drain_until) => break,
                () = sleep_until(linger_until), if status.is_none() => { cut = Some(Cut::Lingered); break }
                () = &mut wall, if status.is_none() => { cut = Some(Cut::Timeout(sup.timeout)); break }
                () = &mut idle, if status.is_none() => { cut = Some(Cut::Idle(sup.idle_timeout)); break }
                () = cancel.cancelled(), if status.is_none() => { cut = Some(Cut::Cancelled); break }
            }
        }
        self.end(status, cut, stdout, stderr).await
    }
}

impl SubprocessAttempt {
    /// Ends whatever is left of the group, reaps the main process if it still runs, and reads
    /// what the group wrote before it ended.
    async fn end(
        mut self: Box<Self>,
        mut status: Option<ExitStatus>,
        cut: Option<Cut>,
        mut stdout: Option<pipe::Receiver>,
        mut stderr: Option<pipe::Receiver>,
    ) -> io::Result<Run> {
        let spawned = self.spawned;
        let killed =
            procs::end_attempt(spawned.pgid, &self.marker, self.supervision.kill_grace).await;
        // The executor stays among the attempts in flight until it is reaped here: another
        // attempt's end reaps stray zombies, and must not take this one's exit status.
        let waited = match status {
            Some(status) => Ok(status),
            None => self.child.wait().await,
        };
        procs::attempt_ended(spawned.pgid);
        status = Some(waited?);
        let mut out = self.output;
        drain(&mut stdout, |bytes| {
            out.log.write(bytes);
            out.output_tail.push(bytes);
            out.stdout_tail.push(bytes);
        })
        .await;
        drain(&mut stderr, |bytes| out.stderr(bytes)).await;
        out.log.finish();
        if let Some(tmp) = &self.tmp {
            tmp.put_away();
        }
        if let Some(stream) = &mut out.agent {
            stream.finish(&out.stdout_tail.buf, &out.output_tail.buf);
        }
        Ok(Run {
            spawned,
            status,
            cut,
            duration: self.started.elapsed(),
            stdout_tail: out.stdout_tail.into_vec(),
            output_tail: out.output_tail.into_vec(),
            output_bytes: out.log.seen,
            killed,
            agent: out.agent,
            network_refused: self.refusals.map(|r| r.take()).unwrap_or_default(),
        })
    }
}

/// Spawns `command` with the marker `name` inherited: a memfd the child (and whatever it starts)
/// holds open and this process does not. Spawns are serialized, and the new executor is counted
/// among the attempts in flight before anyone may reap a zombie (see [`procs::spawning`]).
fn spawn_marked(command: &mut spawn::Command, name: &str) -> io::Result<spawn::Child> {
    let _one_at_a_time = procs::spawning();
    let marker = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .map_err(io::Error::from)?;
    let child = command.inherit(marker).spawn();
    if let Ok(child) = &child {
        procs::attempt_started(child.id());
    }
    child
}

/// Sleeps until `t`, or forever without one (so `select!` ignores it).
async fn sleep_until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Resolves when an optional pipe may be read (data, its end, or an error); never when there is
/// no pipe, so `select!` ignores it.
async fn readable(pipe: &Option<pipe::Receiver>) {
    match pipe {
        Some(p) => {
            // An error is the read's to meet.
            let _ = p.readable().await;
        }
        None => std::future::pending().await,
    }
}

/// Reads what a readable pipe holds into a buffer on this thread's stack, and gives it to `heard`
/// (`None` when there was nothing after all). At its end, or on an error, the pipe is dropped.
fn read_ready<T>(pipe: &mut Option<pipe::Receiver>, heard: impl FnOnce(&[u8]) -> T) -> Option<T> {
    let mut buf = [0u8; READ_BUF];
    match pipe.as_ref()?.try_read(&mut buf) {
        Ok(n) if n > 0 => Some(heard(&buf[..n])),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
        // Its end, or an error: nothing more comes from it.
        _ => {
            *pipe = None;
            None
        }
    }
}

/// Reads what is left in a pipe whose writers are gone, giving up on one that stays open
/// (a process that escaped the group may hold it).
async fn drain(pipe: &mut Option<pipe::Receiver>, mut sink: impl FnMut(&[u8])) {
    while pipe.is_some() {
        if tokio::time::timeout(Duration::from_millis(50), readable(pipe))
            .await
            .is_err()
        {
            return;
        }
        read_ready(pipe, &mut sink);
    }
}

/// The last [`TAIL_CAP`] bytes written to it.
#[derive(Default)]
struct Tail {
    buf: Vec<u8>,
}

impl Tail {
    fn push(&mut self, bytes: &[u8]) {
        if bytes.len() >= TAIL_CAP {
            self.buf.clear();
            self.buf.extend_from_slice(&bytes[bytes.len() - TAIL_CAP..]);
            return;
        }
        let over = (self.buf.len() + bytes.len()).saturating_sub(TAIL_CAP);
        if over > 0 {
            self.buf.drain(..over);
        }
        self.buf.extend_from_slice(bytes);
    }

    fn into_vec(self) -> Vec<u8> {
        self.buf
    }
}

/// An attempt's log file, kept below `cap` bytes; what is over is counted.
struct CappedLog {
    file: Option<File>,
    path: PathBuf,
    cap: u64,
    written: u64,
    seen: u64,
}

impl CappedLog {
    fn write(&mut self, bytes: &[u8]) {
        self.seen += bytes.len() as u64;
        let room = self.cap.saturating_sub(self.written) as usize;
        let keep = &bytes[..bytes.len().min(room)];
        if keep.is_empty() {
            return;
        }
        if let Some(file) = &mut self.file
            && file.write_all(keep).is_err()
        {
            // A full disk must not stop the attempt; the log just ends here.
            tracing::warn!(path = %self.path.display(), "cannot write the attempt log");
            self.file = None;
        }
        self.written += keep.len() as u64;
    }

    fn finish(&mut self) {
        if self.seen > self.written
            && let Some(file) = &mut self.file
        {
            let _ = writeln!(
                file,
                "\n[loopd: output capped at {} bytes; {} bytes in all]",
                self.written, self.seen
            );
        }
        self.file = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_bytes() {
        let mut t = Tail::default();
        t.push(&vec![b'a'; TAIL_CAP - 2]);
        t.push(b"bcd");
        let v = t.into_vec();
        assert_eq!(v.len(), TAIL_CAP);
        assert!(v.ends_with(b"abcd"));
    }
}
