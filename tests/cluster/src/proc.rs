//! The cluster's processes: each started by us, known by PID, logged to a file, stopped on drop.
//!
//! Every PID is also appended to the run's `pids` file, with its name: which process was which,
//! for whoever reads a run's logs. What a killed run left running is found by its network
//! namespace and its command lines ([`crate::leftovers`]).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::netns::NetNs;

/// A process of the cluster.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Starts `cmd` with its output appended to `<logs>/<name>.log` and its PID recorded in
    /// `pids`.
    pub fn spawn(name: &str, cmd: &mut Command, logs: &Path, pids: &Path) -> Result<Proc> {
        Proc::spawn_in(None, name, cmd, logs, pids)
    }

    /// [`Proc::spawn`] in network namespace `netns` (`None`: this process's).
    pub fn spawn_in(
        netns: Option<&NetNs>,
        name: &str,
        cmd: &mut Command,
        logs: &Path,
        pids: &Path,
    ) -> Result<Proc> {
        std::fs::create_dir_all(logs).with_context(|| format!("creating {}", logs.display()))?;
        let log = logs.join(format!("{name}.log"));
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone().context("duplicating a log descriptor")?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = match netns {
            Some(ns) => ns.spawn(cmd),
            None => cmd.spawn().map_err(anyhow::Error::from),
        }
        .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(pids)
            .with_context(|| format!("opening {}", pids.display()))?;
        writeln!(f, "{} {name}", child.id())
            .with_context(|| format!("writing {}", pids.display()))?;
        Ok(Proc {
            name: name.to_string(),
            child,
            log,
        })
    }

    /// The process's name in the cluster (`kubelet`, `etcd`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its PID.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Whether it still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// `running`, or how it ended (`exited`, a zombie not yet reaped), read from /proc without
    /// reaping it.
    pub fn state(&self) -> &'static str {
        match std::fs::read_to_string(format!("/proc/{}/stat", self.pid())) {
            // The state follows the command name, which is in parentheses.
            Ok(stat) => match stat.rsplit_once(") ").and_then(|(_, r)| r.chars().next()) {
                Some('Z') | Some('X') => "exited",
                _ => "running",
            },
            Err(_) => "exited",
        }
    }

    /// SIGTERM, then SIGKILL after `grace`; waits for it either way.
    pub fn stop(&mut self, grace: Duration) {
        if !self.alive() {
            return;
        }
        let pid = Pid::from_raw(self.pid());
        let _ = kill(pid, Signal::SIGTERM);
        let end = Instant::now() + grace;
        while Instant::now() < end {
            if !self.alive() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = kill(pid, Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// SIGKILL, as a crash would end it.
    pub fn kill9(&mut self) {
        let _ = kill(Pid::from_raw(self.pid()), Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        tail(&self.log, n)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// The last `n` lines of a file (at most its last 256 KiB).
pub fn tail(path: &Path, n: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(256 * 1024)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs a command to completion; its stdout, or an error carrying its stderr.
pub fn run(cmd: &mut Command) -> Result<String> {
    let t0 = std::time::Instant::now();
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if timings() && t0.elapsed() > std::time::Duration::from_millis(500) {
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy()).collect();
        eprintln!(
            "  {:.1} s: {} {}",
            t0.elapsed().as_secs_f64(),
            cmd.get_program().to_string_lossy(),
            args.join(" ")
        );
    }
    if !out.status.success() {
        anyhow::bail!(
            "{:?} {:?} failed ({}): {}",
            cmd.get_program(),
            cmd.get_args().collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The PIDs of every process whose command line contains `needle`, with their parent's PID.
pub fn find(needle: &str) -> Vec<(i32, i32)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) {
            out.push((pid, ppid(pid).unwrap_or(0)));
        }
    }
    out
}

fn ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(1)?.parse().ok()
}

/// Kills `pid` and every process descended from it with SIGKILL.
pub fn kill_tree(pid: i32) {
    let mut all: Vec<(i32, i32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            if let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
                all.push((p, ppid(p).unwrap_or(0)));
            }
        }
    }
    let mut doomed = vec![pid];
    let mut i = 0;
    while i < doomed.len() {
        let parent = doomed[i];
        doomed.extend(all.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    for p in doomed {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
}

/// Whether `CLUSTER_TIMINGS` asks for every wait and every command over half a second to be
/// printed with its time (without it: waits over 10 s only).
pub fn timings() -> bool {
    std::env::var_os("CLUSTER_TIMINGS").is_some()
}
