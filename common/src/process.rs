//! This process's own resource use, for its metrics: CPU time, resident memory, open file
//! descriptors, start time. Read from `/proc/self` (the daemon's own view of procfs, wherever
//! the host's is mounted) and `/proc/stat`.

use std::io;

/// One reading.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProcessStats {
    /// User and system CPU time, in seconds.
    pub cpu_seconds: f64,
    /// Resident set size, in bytes.
    pub resident_bytes: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// When the process started, in seconds since the Unix epoch.
    pub start_time_seconds: f64,
}

/// Reads this process's stats.
pub fn read() -> io::Result<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let btime = std::fs::read_to_string("/proc/stat")?;
    let open_fds = std::fs::read_dir("/proc/self/fd")?.count() as u64;
    let ticks = sysconf(nix::unistd::SysconfVar::CLK_TCK)?;
    let page = sysconf(nix::unistd::SysconfVar::PAGE_SIZE)?;
    parse(&stat, &btime, open_fds, ticks, page)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unexpected /proc/self/stat"))
}

fn sysconf(var: nix::unistd::SysconfVar) -> io::Result<u64> {
    match nix::unistd::sysconf(var) {
        Ok(Some(v)) if v > 0 => Ok(v as u64),
        Ok(_) => Err(io::Error::other(format!("sysconf {var:?}: no value"))),
        Err(e) => Err(io::Error::from(e)),
    }
}

/// `stat`: `/proc/self/stat`; `proc_stat`: `/proc/stat` (for `btime`).
fn parse(
    stat: &str,
    proc_stat: &str,
    open_fds: u64,
    ticks: u64,
    page: u64,
) -> Option<ProcessStats> {
    // The command name (field 2) is in parentheses and may hold spaces or parentheses itself:
    // the fields after it start after the last ')'. Field 3 (state) is index 0 there.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    let (utime, stime, start, rss) = (num(11)?, num(12)?, num(19)?, num(21)?);
    let btime: u64 = proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let ticks = ticks as f64;
    Some(ProcessStats {
        cpu_seconds: (utime + stime) as f64 / ticks,
        resident_bytes: rss * page,
        open_fds,
        start_time_seconds: btime as f64 + start as f64 / ticks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_stat_line_whose_name_has_spaces_and_parentheses() {
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 \
                    1000 123456789 2048 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let s = parse(stat, "cpu 1 2 3\nbtime 1700000000\n", 7, 100, 4096).unwrap();
        assert_eq!(s.cpu_seconds, 3.0);
        assert_eq!(s.resident_bytes, 2048 * 4096);
        assert_eq!(s.open_fds, 7);
        assert_eq!(s.start_time_seconds, 1_700_000_010.0);
    }

    #[test]
    fn a_truncated_line_is_refused() {
        assert_eq!(parse("1 (x) S 1 2", "btime 1\n", 0, 100, 4096), None);
        assert_eq!(parse("no parenthesis", "btime 1\n", 0, 100, 4096), None);
    }

    #[test]
    fn reads_this_process() {
        let s = read().unwrap();
        assert!(s.resident_bytes > 0);
        assert!(s.open_fds >= 3);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(s.start_time_seconds > 1.0e9 && s.start_time_seconds <= now + 1.0);
    }
}
