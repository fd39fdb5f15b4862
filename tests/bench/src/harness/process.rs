//! Running a daemon command as a process: wall time, CPU time, peak RSS, exit code.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use super::{procstat, strace};

/// What one finished process cost.
pub struct Finished {
    pub wall: Duration,
    /// User + system CPU time of the process (and any children it waited for).
    pub cpu: Duration,
    pub code: i32,
    pub max_rss_kib: u64,
    /// Page faults served without I/O (`ru_minflt`) of the process (and any children it
    /// waited for): mostly, at start, copies of the relocated data and fresh heap pages.
    pub minor_faults: u64,
    pub stderr: String,
}

/// Runs a command to completion, sampling its peak RSS (`VmHWM`) until it exits.
///
/// The wall time ends when `waitpid` returns (a thread blocks in it), not at the next RSS
/// sample. Not `wait4`'s `ru_maxrss`: Linux carries the pre-exec high-water mark of the forked
/// child (this process's own, under vfork) across `execve`, which would report the bench's
/// memory. A sample counts only when the process has the program's name
/// ([`procstat::sample_as`]): two full runs each reported one figure with the bench's own
/// peak (39.9 MiB and 3043 MiB) before that. A process that lives a few milliseconds may peak
/// between samples: [`peak_rss_kib`] reads the peak at its exit.
pub fn run(cmd: &mut Command) -> Result<Finished> {
    use std::io::Read as _;
    let cpu_before = children_cpu();
    let faults_before = children_minor_faults();
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let pid = child.id();
    let program = cmd.get_program().to_owned();
    let mut err = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = err.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let status = child.wait();
        let end = Instant::now();
        let _ = tx.send(());
        (status, end)
    });
    let mut max_rss_kib = 0;
    loop {
        if let Some(s) = procstat::sample_as(pid, &program) {
            max_rss_kib = max_rss_kib.max(s.hwm_kib);
        }
        // Every 2 ms: VmHWM is a high-water mark, so a late sample still sees an earlier peak,
        // and the bench's own polling must not compete for the CPU with the process measured.
        match rx.recv_timeout(Duration::from_millis(2)) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            _ => break,
        }
    }
    let (status, end) = waiter
        .join()
        .map_err(|_| anyhow!("the thread waiting for {cmd:?} panicked"))?;
    let status = status.with_context(|| format!("waiting for {cmd:?}"))?;
    let wall = end - start;
    let cpu = children_cpu().saturating_sub(cpu_before);
    let minor_faults = children_minor_faults().saturating_sub(faults_before);
    let stderr = reader.join().unwrap_or_default();
    Ok(Finished {
        wall,
        cpu,
        code: status.code().unwrap_or(-1),
        max_rss_kib,
        minor_faults,
        stderr,
    })
}

/// Runs a command to completion and reads its peak RSS (`VmHWM`) as it exits: the process is
/// attached with `PTRACE_SEIZE` and stopped once, at `PTRACE_EVENT_EXIT`, when its memory is
/// still there. Not for timing (the stop costs a round trip); fails if it exits non-zero.
pub fn peak_rss_kib(cmd: &mut Command) -> Result<u64> {
    use nix::sys::ptrace;
    use nix::sys::wait::{WaitStatus, waitpid};
    use nix::unistd::Pid;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let pid = Pid::from_raw(child.id() as i32);
    // If it is already gone, waitpid below still reaps it; the peak is then unknown.
    let seized = ptrace::seize(pid, ptrace::Options::PTRACE_O_TRACEEXIT).is_ok();
    let mut hwm = None;
    let code = loop {
        match waitpid(pid, None).with_context(|| format!("waiting for {cmd:?}"))? {
            WaitStatus::PtraceEvent(_, _, ev) if ev == libc::PTRACE_EVENT_EXIT => {
                hwm = procstat::sample(pid.as_raw() as u32).map(|s| s.hwm_kib);
                let _ = ptrace::cont(pid, None);
            }
            WaitStatus::Stopped(_, sig) => {
                let _ = ptrace::cont(pid, Some(sig));
            }
            WaitStatus::PtraceEvent(..) => {
                let _ = ptrace::cont(pid, None);
            }
            WaitStatus::Exited(_, code) => break code,
            WaitStatus::Signaled(_, sig, _) => bail!("{cmd:?} killed by {sig}"),
            _ => {}
        }
    };
    if code != 0 {
        bail!("{cmd:?} exited {code}");
    }
    match (seized, hwm) {
        (_, Some(kib)) => Ok(kib),
        (false, None) => bail!("{cmd:?} exited before it could be attached"),
        (true, None) => bail!("{cmd:?}: no memory figure at its exit"),
    }
}

/// CPU time of this process's reaped children so far: across one [`run`], the process run (the
/// only child reaped meanwhile). Unlike `ru_maxrss`, CPU times start at zero in a new child.
pub fn children_cpu() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let Ok(u) = getrusage(UsageWho::RUSAGE_CHILDREN) else {
        return Duration::ZERO;
    };
    let t = |tv: nix::sys::time::TimeVal| {
        Duration::from_secs(tv.tv_sec().max(0) as u64)
            + Duration::from_micros(tv.tv_usec().max(0) as u64)
    };
    t(u.user_time()) + t(u.system_time())
}

/// Minor page faults of this process's reaped children so far (as [`children_cpu`]).
pub fn children_minor_faults() -> u64 {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_CHILDREN)
        .map(|u| u64::try_from(u.minor_page_faults()).unwrap_or(0))
        .unwrap_or(0)
}

/// The process, if it exited 0; its stderr in the error otherwise.
pub fn ok(f: Finished, what: &str) -> Result<Finished> {
    if f.code != 0 {
        bail!("{what} exited {}: {}", f.code, f.stderr.trim());
    }
    Ok(f)
}

/// A command line: run as is for the figure, or under strace for its limit.
#[derive(Debug)]
pub struct Invocation {
    /// The program.
    pub bin: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
}

impl Invocation {
    /// `bin` with `args`.
    pub fn new(bin: &Path, args: &[&dyn AsRef<OsStr>]) -> Invocation {
        Invocation {
            bin: bin.to_path_buf(),
            args: args.iter().map(|a| a.as_ref().to_os_string()).collect(),
        }
    }

    /// The command as is.
    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.args(&self.args);
        c
    }

    /// The command under strace, recording its file reads into `log`.
    pub fn traced(&self, log: &Path) -> Command {
        let mut c = strace::command(log, &self.bin);
        c.args(&self.args);
        c
    }
}
