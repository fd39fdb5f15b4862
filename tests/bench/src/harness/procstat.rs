//! What a process costs, read from `/proc/<pid>`: resident memory, peak resident memory,
//! threads and CPU time.

use std::fs;

/// One reading of a process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcSample {
    /// Resident set size now, KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Peak resident set size, KiB (`VmHWM`).
    pub hwm_kib: u64,
    /// Threads.
    pub threads: u64,
    /// User + system CPU seconds so far.
    pub cpu_seconds: f64,
}

/// Reads `/proc/<pid>/status` and `/proc/<pid>/stat`; `None` when the process is gone.
pub fn sample(pid: u32) -> Option<ProcSample> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let mut s = ProcSample::default();
    for line in status.lines() {
        let mut it = line.split_whitespace();
        let (Some(key), Some(val)) = (it.next(), it.next()) else {
            continue;
        };
        let v = val.parse::<u64>().unwrap_or(0);
        match key {
            "VmRSS:" => s.rss_kib = v,
            "VmHWM:" => s.hwm_kib = v,
            "Threads:" => s.threads = v,
            _ => {}
        }
    }
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised comm: state is field 3; utime 14, stime 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime = fields.get(11)?.parse::<u64>().ok()?;
    let stime = fields.get(12)?.parse::<u64>().ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    s.cpu_seconds = (utime + stime) as f64 / hz;
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let s = sample(std::process::id()).unwrap();
        assert!(s.rss_kib > 0 && s.hwm_kib >= s.rss_kib && s.threads >= 1);
    }
}
