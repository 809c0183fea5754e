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
//! an attempt's verdict.

pub mod agent;
pub mod procs;
pub mod result;

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::config::{PromptMode, Supervision};
use crate::safe_fs::Dir;

/// How much of stdout is kept in memory to find the result in.
pub const TAIL_CAP: usize = 1 << 20;

/// One attempt to run.
#[derive(Clone, Debug)]
pub struct Spec {
    pub argv: Vec<String>,
    pub prompt: String,
    pub prompt_mode: PromptMode,
    pub env: Vec<(String, OsString)>,
    pub cwd: PathBuf,
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
}

/// The executor's process, once spawned.
#[derive(Clone, Copy, Debug)]
pub struct Spawned {
    pub pid: u32,
    pub pgid: u32,
    pub proc_start: Option<u64>,
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
}

/// What an executor tells the daemon while an attempt runs.
#[derive(Clone, Debug)]
pub enum Report {
    /// The process exists; no output has been read yet.
    Spawned(Spawned),
    /// The agent is retrying a failed API request on its own.
    Retrying(agent::Retry),
}

#[async_trait::async_trait]
pub trait Executor: Send + Sync {
    /// Runs one attempt. `report` hears [`Report::Spawned`] once the process exists, before any
    /// output is read, then what the agent says on the way.
    async fn run(
        &self,
        spec: Spec,
        cancel: CancellationToken,
        report: &mut (dyn FnMut(Report) + Send),
    ) -> io::Result<Run>;
}

/// The executor of real subprocesses.
pub struct Subprocess;

#[async_trait::async_trait]
impl Executor for Subprocess {
    async fn run(
        &self,
        spec: Spec,
        cancel: CancellationToken,
        report: &mut (dyn FnMut(Report) + Send),
    ) -> io::Result<Run> {
        run_subprocess(spec, cancel, report).await
    }
}

async fn run_subprocess(
    spec: Spec,
    cancel: CancellationToken,
    report: &mut (dyn FnMut(Report) + Send),
) -> io::Result<Run> {
    let started = Instant::now();
    let Some((program, args)) = spec.argv.split_first() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty command"));
    };
    let mut command = Command::new(program);
    command
        .args(args)
        .current_dir(&spec.cwd)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    match spec.prompt_mode {
        PromptMode::Stdin => {
            command.stdin(Stdio::piped());
        }
        PromptMode::Arg => {
            command.arg(&spec.prompt).stdin(Stdio::null());
        }
        PromptMode::File => {
            let name = format!("{}.prompt.md", spec.stem);
            spec.dir
                .create(&name)
                .and_then(|mut f| f.write_all(spec.prompt.as_bytes()))?;
            command.arg(spec.dir.join(&name)).stdin(Stdio::null());
        }
    }
    let log_name = format!("{}.log", spec.stem);
    let mut log = CappedLog {
        file: Some(spec.dir.create(&log_name)?),
        path: spec.dir.join(&log_name),
        cap: spec.supervision.output_cap,
        written: 0,
        seen: 0,
    };
    let mut child = spawn_marked(&mut command, &spec.marker)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot start {program:?}: {e}")))?;
    let pid = child.id().unwrap_or(0);
    let spawned = Spawned {
        pid,
        pgid: pid,
        proc_start: procs::ProcStat::read(pid).map(|s| s.start),
    };
    procs::set_current_group(spawned.pgid);
    report(Report::Spawned(spawned));

    // Feed the prompt on its own task, so a child that never reads stdin cannot block us; dropping
    // the pipe closes it.
    if let Some(mut stdin) = child.stdin.take() {
        let prompt = spec.prompt.clone();
        tokio::spawn(async move {
            let _ = stdin.write_all(prompt.as_bytes()).await;
        });
    }
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let mut stdout_tail = Tail::default();
    let mut output_tail = Tail::default();
    let mut out_buf = vec![0u8; 16 * 1024];
    let mut err_buf = vec![0u8; 16 * 1024];

    let sup = spec.supervision;
    let wall = tokio::time::sleep(sup.timeout);
    let idle = tokio::time::sleep(sup.idle_timeout);
    tokio::pin!(wall, idle);
    let mut status: Option<ExitStatus> = None;
    let mut cut = None;
    let mut agent = spec.agent;
    let budget = spec.budget;
    // Set once the agent's final event is read: it may linger until then.
    let mut linger_until: Option<tokio::time::Instant> = None;
    // Once the main process has exited, what it left behind gets a moment to flush, then ends.
    let mut drain_until: Option<tokio::time::Instant> = None;

    loop {
        if stdout.is_none() && stderr.is_none() && status.is_some() {
            break;
        }
        let drain = sleep_until(drain_until);
        let linger = sleep_until(linger_until);
        tokio::select! {
            n = read_some(&mut stdout, &mut out_buf) => match n {
                Some(n) => {
                    log.write(&out_buf[..n]);
                    stdout_tail.push(&out_buf[..n]);
                    output_tail.push(&out_buf[..n]);
                    let signal = agent.as_mut().map(|stream| stream.feed(&out_buf[..n]));
                    // An agent that only says it is reconnecting is not making progress.
                    if signal != Some(agent::Signal::Noise) {
                        idle.as_mut().reset(tokio::time::Instant::now() + sup.idle_timeout);
                    }
                    if let Some(stream) = &mut agent {
                        if signal == Some(agent::Signal::Final) && linger_until.is_none() {
                            linger_until = Some(tokio::time::Instant::now() + sup.final_grace);
                        }
                        for retry in stream.take_retries() {
                            report(Report::Retrying(retry));
                        }
                        if budget.crossed(stream) {
                            cut = Some(Cut::Budget);
                            break;
                        }
                    }
                }
                None => stdout = None,
            },
            n = read_some(&mut stderr, &mut err_buf) => match n {
                Some(n) => {
                    log.write(&err_buf[..n]);
                    output_tail.push(&err_buf[..n]);
                    idle.as_mut().reset(tokio::time::Instant::now() + sup.idle_timeout);
                }
                None => stderr = None,
            },
            s = child.wait(), if status.is_none() => {
                status = Some(s?);
                drain_until = Some(tokio::time::Instant::now() + Duration::from_millis(200));
            }
            () = drain => break,
            () = linger, if status.is_none() => { cut = Some(Cut::Lingered); break }
            () = &mut wall, if status.is_none() => { cut = Some(Cut::Timeout(sup.timeout)); break }
            () = &mut idle, if status.is_none() => { cut = Some(Cut::Idle(sup.idle_timeout)); break }
            () = cancel.cancelled(), if status.is_none() => { cut = Some(Cut::Cancelled); break }
        }
    }

    // End whatever is left of the group, then reap the main process if it still runs.
    let killed = procs::end_attempt(spawned.pgid, spawned.pid, sup.kill_grace).await;
    procs::set_current_group(0);
    if status.is_none() {
        status = Some(child.wait().await?);
    }
    // Whatever the group wrote before it ended is still in the pipes.
    drain(&mut stdout, &mut out_buf, |bytes| {
        log.write(bytes);
        output_tail.push(bytes);
        stdout_tail.push(bytes);
    })
    .await;
    drain(&mut stderr, &mut err_buf, |bytes| {
        log.write(bytes);
        output_tail.push(bytes);
    })
    .await;
    log.finish();
    if let Some(stream) = &mut agent {
        stream.finish(&stdout_tail.buf, &output_tail.buf);
    }
    Ok(Run {
        spawned,
        status,
        cut,
        duration: started.elapsed(),
        stdout_tail: stdout_tail.into_vec(),
        output_tail: output_tail.into_vec(),
        output_bytes: log.seen,
        killed,
        agent,
    })
}

/// Spawns `command` with the marker `name` inherited: a memfd opened without close-on-exec just
/// before the spawn and closed just after, so the child (and whatever it starts) holds it open
/// and this process does not. Spawns are serialized so no other child inherits it.
fn spawn_marked(command: &mut Command, name: &str) -> io::Result<tokio::process::Child> {
    static SPAWN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
    let marker = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::empty())
        .map_err(io::Error::from)?;
    let child = command.spawn();
    drop(marker);
    child
}

/// Sleeps until `t`, or forever without one (so `select!` ignores it).
async fn sleep_until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Reads from an optional pipe: `None` at end of file, error, or when there is no pipe (then it
/// never resolves, so `select!` ignores it).
async fn read_some<R: AsyncRead + Unpin>(pipe: &mut Option<R>, buf: &mut [u8]) -> Option<usize> {
    match pipe {
        Some(p) => match p.read(buf).await {
            Ok(0) | Err(_) => None,
            Ok(n) => Some(n),
        },
        None => std::future::pending().await,
    }
}

/// Reads what is left in a pipe whose writers are gone, giving up on one that stays open
/// (a process that escaped the group may hold it).
async fn drain<R: AsyncRead + Unpin>(
    pipe: &mut Option<R>,
    buf: &mut [u8],
    mut sink: impl FnMut(&[u8]),
) {
    while pipe.is_some() {
        let Ok(Some(n)) =
            tokio::time::timeout(Duration::from_millis(50), read_some(pipe, buf)).await
        else {
            return;
        };
        sink(&buf[..n]);
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
