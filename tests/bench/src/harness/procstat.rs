//! What a process costs, read from `/proc/<pid>`: resident memory (and how much of it is
//! anonymous), peak resident memory, threads and CPU time.

use std::fs;

/// One reading of a process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcSample {
    /// Resident set size now, KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Peak resident set size, KiB (`VmHWM`).
    pub hwm_kib: u64,
    /// Anonymous resident memory, KiB (`RssAnon`): heap and stacks, what only this process
    /// holds (the rest of the RSS is pages of files: its binary and the C library).
    pub anon_kib: u64,
    /// Threads.
    pub threads: u64,
    /// User + system CPU seconds so far.
    pub cpu_seconds: f64,
}

/// Reads `/proc/<pid>/status` and `/proc/<pid>/stat`; `None` when the process is gone.
pub fn sample(pid: u32) -> Option<ProcSample> {
    sample_named(pid, None)
}

/// [`sample`], but `None` unless the process's name (`Name:` in its status, the first 15
/// bytes of the file name it was executed as) is `name`'s: a reading of a process just spawned
/// is then of that program, not of the bench before `execve` has replaced it (Linux changes the
/// name last), nor of a later task that was given the same number.
pub fn sample_as(pid: u32, name: &std::ffi::OsStr) -> Option<ProcSample> {
    sample_named(pid, Some(comm(name)))
}

/// What Linux keeps of an executable's file name as its process name (`TASK_COMM_LEN` - 1
/// bytes).
fn comm(name: &std::ffi::OsStr) -> &[u8] {
    use std::os::unix::ffi::OsStrExt as _;
    let b = std::path::Path::new(name)
        .file_name()
        .unwrap_or(name)
        .as_bytes();
    &b[..b.len().min(15)]
}

fn sample_named(pid: u32, want: Option<&[u8]>) -> Option<ProcSample> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let mut s = ProcSample::default();
    for line in status.lines() {
        if let (Some(want), Some(name)) = (want, line.strip_prefix("Name:"))
            && name.trim().as_bytes() != want
        {
            return None;
        }
        let mut it = line.split_whitespace();
        let (Some(key), Some(val)) = (it.next(), it.next()) else {
            continue;
        };
        let v = val.parse::<u64>().unwrap_or(0);
        match key {
            "VmRSS:" => s.rss_kib = v,
            "VmHWM:" => s.hwm_kib = v,
            "RssAnon:" => s.anon_kib = v,
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
        assert!(s.anon_kib > 0 && s.anon_kib <= s.rss_kib);
    }

    #[test]
    fn reads_a_process_only_by_its_name() {
        let me = std::env::current_exe().unwrap();
        let status = fs::read_to_string("/proc/self/status").unwrap();
        let name = status
            .lines()
            .find_map(|l| l.strip_prefix("Name:"))
            .unwrap()
            .trim();
        // The test binary's file name is longer than 15 bytes: compared as Linux keeps it.
        assert_eq!(comm(me.as_os_str()), name.as_bytes());
        let s = sample_as(std::process::id(), me.as_os_str()).unwrap();
        assert!(s.rss_kib > 0);
        assert_eq!(
            sample_as(std::process::id(), "/usr/bin/vgpu-device-manager".as_ref()),
            None
        );
    }
}
