//! Running a daemon command as a process: wall time, CPU time, peak RSS, exit code.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::procstat;

/// What one finished process cost.
pub struct Finished {
    pub wall: Duration,
    /// User + system CPU time of the process (and any children it waited for).
    pub cpu: Duration,
    pub code: i32,
    pub max_rss_kib: u64,
    pub stderr: String,
}

/// Runs a command to completion, sampling its peak RSS (`VmHWM`) until it exits.
///
/// Not `wait4`'s `ru_maxrss`: Linux carries the pre-exec high-water mark of the forked child
/// (this process's own, under vfork) across `execve`, which would report the bench's memory.
pub fn run(cmd: &mut Command) -> Result<Finished> {
    use std::io::Read as _;
    let cpu_before = children_cpu();
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let pid = child.id();
    let mut err = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = err.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    let mut max_rss_kib = 0;
    let status = loop {
        if let Some(s) = procstat::sample(pid) {
            max_rss_kib = max_rss_kib.max(s.hwm_kib);
        }
        if let Some(st) = child.try_wait()? {
            break st;
        }
        // Every 2 ms: VmHWM is a high-water mark, so a late sample still sees an earlier peak,
        // and the bench's own polling must not compete for the CPU with the process measured.
        std::thread::sleep(Duration::from_millis(2));
    };
    let wall = start.elapsed();
    let cpu = children_cpu().saturating_sub(cpu_before);
    let stderr = reader.join().unwrap_or_default();
    Ok(Finished {
        wall,
        cpu,
        code: status.code().unwrap_or(-1),
        max_rss_kib,
        stderr,
    })
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

/// The process, if it exited 0; its stderr in the error otherwise.
pub fn ok(f: Finished, what: &str) -> Result<Finished> {
    if f.code != 0 {
        bail!("{what} exited {}: {}", f.code, f.stderr.trim());
    }
    Ok(f)
}
