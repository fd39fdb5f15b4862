//! Running a daemon command as a process: wall time, peak RSS, exit code.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use super::procstat;

/// What one finished process cost.
pub struct Finished {
    pub wall: Duration,
    pub code: i32,
    pub max_rss_kib: u64,
    /// The largest anonymous resident memory (`RssAnon`) sampled.
    pub max_anon_kib: u64,
    pub stderr: String,
}

/// Runs a command to completion, sampling its peak RSS (`VmHWM`) until it exits.
///
/// The wall time ends when `waitpid` returns (a thread blocks in it), not at the next RSS
/// sample. Not `wait4`'s `ru_maxrss`: Linux carries the pre-exec high-water mark of the forked
/// child (this process's own, under vfork) across `execve`, which would report the bench's
/// memory. A sample counts only when the process has the program's name
/// ([`procstat::sample_as`]): two full runs each reported one figure with the bench's own
/// peak (39.9 MiB and 3043 MiB) before that.
pub fn run(cmd: &mut Command) -> Result<Finished> {
    use std::io::Read as _;
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
    let (mut max_rss_kib, mut max_anon_kib) = (0, 0);
    loop {
        if let Some(s) = procstat::sample_as(pid, &program) {
            max_rss_kib = max_rss_kib.max(s.hwm_kib);
            max_anon_kib = max_anon_kib.max(s.anon_kib);
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
    let stderr = reader.join().unwrap_or_default();
    Ok(Finished {
        wall,
        code: status.code().unwrap_or(-1),
        max_rss_kib,
        max_anon_kib,
        stderr,
    })
}

/// The process, if it exited 0; its stderr in the error otherwise.
pub fn ok(f: Finished, what: &str) -> Result<Finished> {
    if f.code != 0 {
        bail!("{what} exited {}: {}", f.code, f.stderr.trim());
    }
    Ok(f)
}

/// A command line, for a daemon started in the background ([`crate::sections::dp::Daemon`]).
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
}
