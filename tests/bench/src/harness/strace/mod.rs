//! Recording what a daemon reads: the process run under `strace`, its log parsed into the
//! file-reading system calls that concern the node (the plain tree) and its named input files.
//!
//! `strace -f -qq -y -s 0 -ttt` prints one line per call, prefixed with the thread id and the
//! time (seconds since the epoch, µs), with every descriptor decorated with its path
//! (`3</root/sys/bus/pci/devices>`, `AT_FDCWD</cwd>`):
//!
//! ```text
//! 8875  1795471819.938447 openat(AT_FDCWD</tmp>, "/tmp/t/sys", O_RDONLY|O_CLOEXEC|O_DIRECTORY) = 3</tmp/t/sys>
//! 8875  1795471819.938823 getdents64(3</tmp/t/sys>, 0x5633d4958790 /* 4 entries */, 32768) = 96
//! ```
//!
//! A call interrupted by another thread's is split over two lines (`<unfinished ...>`, then
//! `<... openat resumed>`) and joined back here. Opens for writing are left out, and so is every
//! call on a descriptor they returned: the limit is the reads.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use syntax::{access_mode, decoration, open_flags, parse_fd, parse_ret, split_call, unquote};

mod syntax;

/// The system calls recorded (`?`: not an error where the architecture lacks it).
pub const TRACED: &str = "openat,?open,read,pread64,getdents64,readlinkat,?readlink,\
                          newfstatat,statx,?stat,?lstat,fstat,?access,faccessat,faccessat2,\
                          lseek,close";

/// `strace` recording `program`'s file reads (and its threads') into `log`; add the program's
/// arguments to it.
pub fn command(log: &Path, program: &Path) -> Command {
    let mut c = Command::new("strace");
    c.args(["-f", "-qq", "-y", "-s", "0", "-ttt", "-e"])
        .arg(format!("trace={TRACED}"))
        .arg("-o")
        .arg(log)
        .arg("--")
        .arg(program);
    c
}

/// Whether `strace` can run here.
pub fn available() -> bool {
    Command::new("strace")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Now, on strace's `-ttt` clock: microseconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// `1795471819.000021` (strace's `-ttt`) → microseconds since the epoch.
fn micros(s: &str) -> Option<u64> {
    let (secs, frac) = s.split_once('.')?;
    if frac.len() != 6 {
        return None;
    }
    Some(secs.parse::<u64>().ok()? * 1_000_000 + frac.parse::<u64>().ok()?)
}

/// A descriptor as the trace shows it: its number and the path strace decorated it with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fd {
    /// The number in the traced process.
    pub num: i32,
    /// What it referred to (canonical), when strace could tell.
    pub path: Option<PathBuf>,
}

/// What a path argument is relative to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Base {
    /// The working directory (`AT_FDCWD`; made absolute here).
    Cwd,
    /// An open directory.
    Fd(Fd),
}

/// One recorded call, as the replay needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    /// `openat`/`open`; `ret` is the descriptor the trace got (`None`: it failed).
    Open {
        base: Base,
        path: PathBuf,
        flags: i32,
        ret: Option<i32>,
    },
    /// `read`/`pread64` of `count` bytes.
    Read {
        fd: Fd,
        count: usize,
        offset: Option<i64>,
    },
    /// `getdents64`.
    Getdents { fd: Fd },
    /// `newfstatat`/`statx`/`stat`/`lstat`; `fstat` is an empty path on an `Fd` base.
    Stat {
        base: Base,
        path: PathBuf,
        nofollow: bool,
    },
    /// `readlinkat`/`readlink`.
    Readlink {
        base: Base,
        path: PathBuf,
        count: usize,
    },
    /// `access`/`faccessat`/`faccessat2`.
    Access {
        base: Base,
        path: PathBuf,
        mode: i32,
    },
    /// `lseek`.
    Lseek { fd: Fd, offset: i64, whence: i32 },
    /// `close`.
    Close { fd: Fd },
}

/// One call and when it started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Traced {
    /// Microseconds since the epoch.
    pub time: u64,
    /// The call.
    pub call: Call,
}

/// The calls of a log that concern the files `keep` accepts, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// The calls.
    pub calls: Vec<Traced>,
}

impl Trace {
    /// The calls started between `from` and `to` (microseconds since the epoch).
    pub fn window(&self, from: u64, to: u64) -> Vec<Call> {
        self.calls
            .iter()
            .filter(|t| t.time >= from && t.time <= to)
            .map(|t| t.call.clone())
            .collect()
    }

    /// Every call.
    pub fn all(&self) -> Vec<Call> {
        self.calls.iter().map(|t| t.call.clone()).collect()
    }
}

/// Parses a log written by [`command`]. `keep` decides, for each path a call names (made
/// absolute), whether the call concerns the node; calls on descriptors opened from kept paths
/// are kept too.
pub fn parse(log: &str, keep: &dyn Fn(&Path) -> bool) -> Trace {
    let mut p = Parser {
        keep,
        cwd: PathBuf::from("/"),
        open: HashMap::new(),
        pending: HashMap::new(),
        out: Trace::default(),
    };
    for line in log.lines() {
        p.line(line);
    }
    p.out
}

struct Parser<'a> {
    keep: &'a dyn Fn(&Path) -> bool,
    cwd: PathBuf,
    /// Descriptors opened from kept paths and not closed yet.
    open: HashMap<i32, PathBuf>,
    /// Unfinished calls by thread: their time and text so far.
    pending: HashMap<String, (u64, String)>,
    out: Trace,
}

const UNFINISHED: &str = " <unfinished ...>";

impl Parser<'_> {
    fn line(&mut self, line: &str) {
        let Some((first, rest)) = line.trim_end().split_once(char::is_whitespace) else {
            return;
        };
        let rest = rest.trim_start();
        // `-f` prefixes the thread id; a lone process's lines start with the time.
        let (tid, time, rest) = if first.contains('.') {
            ("", first, rest)
        } else {
            let Some((time, rest)) = rest.split_once(char::is_whitespace) else {
                return;
            };
            (first, time, rest.trim_start())
        };
        let Some(time) = micros(time) else {
            return;
        };
        if let Some(head) = rest.strip_suffix(UNFINISHED) {
            self.pending
                .insert(tid.to_string(), (time, head.to_string()));
            return;
        }
        if let Some(resumed) = rest.strip_prefix("<... ") {
            let Some((_, tail)) = resumed.split_once("resumed>") else {
                return;
            };
            let Some((t0, head)) = self.pending.remove(tid) else {
                return;
            };
            let whole = format!("{head}{tail}");
            self.call(t0, &whole);
            return;
        }
        self.call(time, rest);
    }

    fn call(&mut self, time: u64, text: &str) {
        let Some((name, args, ret)) = split_call(text) else {
            return;
        };
        let (ret_num, ret_path) = parse_ret(ret);
        let a = |i: usize| args.get(i).map(String::as_str).unwrap_or("");
        let call = match name {
            "openat" | "open" => {
                let (base, path, flags) = if name == "openat" {
                    (self.base(a(0)), unquote(a(1)), a(2))
                } else {
                    (Base::Cwd, unquote(a(0)), a(1))
                };
                let flags = open_flags(flags);
                let writes = libc::O_WRONLY | libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC;
                let ret = ret_num.filter(|n| *n >= 0).map(|n| n as i32);
                let resolved = self.resolve(&base, &path);
                let kept = flags & writes == 0
                    && (resolved.as_deref().is_some_and(self.keep)
                        || ret_path.as_deref().is_some_and(self.keep));
                if !kept {
                    return;
                }
                if let Some(fd) = ret {
                    let p = ret_path.or(resolved).unwrap_or_default();
                    self.open.insert(fd, p);
                }
                let path = match base {
                    Base::Cwd => self.absolute(path),
                    Base::Fd(_) => path,
                };
                Call::Open {
                    base,
                    path,
                    flags,
                    ret,
                }
            }
            "read" | "pread64" => {
                let Some(fd) = self.kept_fd(a(0)) else { return };
                Call::Read {
                    fd,
                    count: a(2).parse().unwrap_or(4096),
                    offset: (name == "pread64").then(|| a(3).parse().unwrap_or(0)),
                }
            }
            "getdents64" => {
                let Some(fd) = self.kept_fd(a(0)) else { return };
                Call::Getdents { fd }
            }
            "fstat" => {
                let Some(fd) = self.kept_fd(a(0)) else { return };
                Call::Stat {
                    base: Base::Fd(fd),
                    path: PathBuf::new(),
                    nofollow: false,
                }
            }
            "lseek" => {
                let Some(fd) = self.kept_fd(a(0)) else { return };
                let whence = match a(2) {
                    "SEEK_CUR" => libc::SEEK_CUR,
                    "SEEK_END" => libc::SEEK_END,
                    _ => libc::SEEK_SET,
                };
                Call::Lseek {
                    fd,
                    offset: a(1).parse().unwrap_or(0),
                    whence,
                }
            }
            "close" => {
                let Some(fd) = parse_fd(a(0)) else { return };
                if self.open.remove(&fd.num).is_none() {
                    return;
                }
                Call::Close { fd }
            }
            "newfstatat" | "statx" | "stat" | "lstat" => {
                let (base, path, flags) = match name {
                    "newfstatat" => (self.base(a(0)), unquote(a(1)), a(3)),
                    "statx" => (self.base(a(0)), unquote(a(1)), a(2)),
                    "lstat" => (Base::Cwd, unquote(a(0)), "AT_SYMLINK_NOFOLLOW"),
                    _ => (Base::Cwd, unquote(a(0)), ""),
                };
                let Some((base, path)) = self.kept_path(base, path) else {
                    return;
                };
                Call::Stat {
                    base,
                    path,
                    nofollow: flags.contains("AT_SYMLINK_NOFOLLOW"),
                }
            }
            "readlinkat" | "readlink" => {
                let (base, path, count) = if name == "readlinkat" {
                    (self.base(a(0)), unquote(a(1)), a(3))
                } else {
                    (Base::Cwd, unquote(a(0)), a(2))
                };
                let Some((base, path)) = self.kept_path(base, path) else {
                    return;
                };
                Call::Readlink {
                    base,
                    path,
                    count: count.parse().unwrap_or(4096),
                }
            }
            "access" | "faccessat" | "faccessat2" => {
                let (base, path, mode) = if name == "access" {
                    (Base::Cwd, unquote(a(0)), a(1))
                } else {
                    (self.base(a(0)), unquote(a(1)), a(2))
                };
                let Some((base, path)) = self.kept_path(base, path) else {
                    return;
                };
                Call::Access {
                    base,
                    path,
                    mode: access_mode(mode),
                }
            }
            _ => return,
        };
        self.out.calls.push(Traced { time, call });
    }

    /// `AT_FDCWD</cwd>` (remembering the directory) or `3</path>`.
    fn base(&mut self, arg: &str) -> Base {
        if let Some(rest) = arg.strip_prefix("AT_FDCWD") {
            if let Some(p) = decoration(rest) {
                self.cwd = PathBuf::from(p);
            }
            return Base::Cwd;
        }
        match parse_fd(arg) {
            Some(fd) => Base::Fd(fd),
            None => Base::Cwd,
        }
    }

    fn absolute(&self, path: PathBuf) -> PathBuf {
        if path.is_absolute() || path.as_os_str().is_empty() {
            path
        } else {
            self.cwd.join(path)
        }
    }

    /// The path a call names, made absolute (`None` when its directory is unknown).
    fn resolve(&self, base: &Base, path: &Path) -> Option<PathBuf> {
        if path.is_absolute() {
            return Some(path.to_path_buf());
        }
        match base {
            Base::Cwd => Some(self.cwd.join(path)),
            Base::Fd(fd) => {
                let dir = self.open.get(&fd.num).cloned().or(fd.path.clone())?;
                Some(if path.as_os_str().is_empty() {
                    dir
                } else {
                    dir.join(path)
                })
            }
        }
    }

    fn kept_path(&self, base: Base, path: PathBuf) -> Option<(Base, PathBuf)> {
        let on_kept_fd = matches!(&base, Base::Fd(fd) if self.open.contains_key(&fd.num));
        let resolved = self.resolve(&base, &path);
        if !on_kept_fd && !resolved.as_deref().is_some_and(self.keep) {
            return None;
        }
        let path = match base {
            Base::Cwd => self.absolute(path),
            Base::Fd(_) => path,
        };
        Some((base, path))
    }

    fn kept_fd(&self, arg: &str) -> Option<Fd> {
        parse_fd(arg).filter(|fd| self.open.contains_key(&fd.num))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: &str = "/tmp/plain/root";

    fn under_root(p: &Path) -> bool {
        p.starts_with(ROOT) || p == Path::new("/usr/share/misc/pci.ids")
    }

    fn fd(num: i32, path: &str) -> Fd {
        Fd {
            num,
            path: Some(PathBuf::from(path)),
        }
    }

    /// A `sandbox-dp` start as strace prints it: the loader and the runtime's own reads, a
    /// directory listing, a relative open in a device directory, a read split by another
    /// thread, a failed optional attribute, a write, and the host pci.ids.
    const LOG: &str = r#"4242  1795471819.000001 openat(AT_FDCWD</work>, "/etc/ld.so.cache", O_RDONLY|O_CLOEXEC) = 3</etc/ld.so.cache>
4242  1795471819.000002 read(3</etc/ld.so.cache>, ""..., 832) = 832
4242  1795471819.000003 close(3</etc/ld.so.cache>) = 0
4242  1795471819.000010 openat(AT_FDCWD</work>, "/tmp/plain/root/sys/bus/pci/devices", O_RDONLY|O_NONBLOCK|O_CLOEXEC|O_DIRECTORY) = 3</tmp/plain/root/sys/bus/pci/devices>
4242  1795471819.000011 getdents64(3</tmp/plain/root/sys/bus/pci/devices>, 0x5633d4958790 /* 4 entries */, 32768) = 96
4242  1795471819.000012 getdents64(3</tmp/plain/root/sys/bus/pci/devices>, 0x5633d4958790 /* 0 entries */, 32768) = 0
4242  1795471819.000013 close(3</tmp/plain/root/sys/bus/pci/devices>) = 0
4243  1795471819.000020 openat(AT_FDCWD</work>, "/tmp/plain/root/sys/bus/pci/devices/0000:41:00.0", O_RDONLY|O_CLOEXEC|O_DIRECTORY) = 5</tmp/plain/root/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0>
4243  1795471819.000021 openat(5</tmp/plain/root/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0>, "vendor", O_RDONLY|O_CLOEXEC <unfinished ...>
4242  1795471819.000022 openat(AT_FDCWD</work>, "/proc/self/maps", O_RDONLY|O_CLOEXEC) = 7</proc/4242/maps>
4243  1795471819.000023 <... openat resumed>) = 6</tmp/plain/root/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/vendor>
4243  1795471819.000024 read(6</tmp/plain/root/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/vendor>, ""..., 4096) = 7
4243  1795471819.000025 close(6</tmp/plain/root/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/vendor>) = 0
4243  1795471819.000026 openat(5</tmp/plain/root/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0>, "sriov_numvfs", O_RDONLY|O_CLOEXEC) = -1 ENOENT (No such file or directory)
4243  1795471819.000027 readlinkat(5</tmp/plain/root/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0>, "driver", ""..., 4096) = 33
4243  1795471819.000028 statx(AT_FDCWD</work>, "/tmp/plain/root/dev/vfio/12", AT_STATX_SYNC_AS_STAT, STATX_ALL, {stx_mask=STATX_BASIC_STATS|STATX_MNT_ID, stx_attributes=0, stx_mode=S_IFREG|0600, stx_size=0, ...}) = 0
4243  1795471819.000029 close(5</tmp/plain/root/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0>) = 0
4242  1795471819.000030 openat(AT_FDCWD</work>, "/tmp/plain/root/run/nvidia/validations/x", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0666) = 8</tmp/plain/root/run/nvidia/validations/x>
4242  1795471819.000031 read(8</tmp/plain/root/run/nvidia/validations/x>, ""..., 4096) = 0
4242  1795471819.000032 --- SIGCHLD {si_signo=SIGCHLD, si_code=CLD_EXITED, si_pid=8875} ---
4242  1795471819.000040 openat(AT_FDCWD</work>, "/usr/share/misc/pci.ids", O_RDONLY|O_CLOEXEC) = 3</usr/share/misc/pci.ids>
4242  1795471819.000041 newfstatat(3</usr/share/misc/pci.ids>, "", {st_mode=S_IFREG|0644, st_size=1500000, ...}, AT_EMPTY_PATH) = 0
4242  1795471819.000042 read(3</usr/share/misc/pci.ids>, ""..., 1500001) = 1500000
4242  1795471819.000043 readlink("/tmp/plain/root/sys/bus/pci/devices/0000:41:00.0/iommu_group", ""..., 64) = 28
4242  1795471819.000044 access("dev/vfio/vfio", R_OK|W_OK) = -1 ENOENT (No such file or directory)
"#;

    #[test]
    fn keeps_the_reads_of_the_node_and_the_named_inputs_only() {
        let t = parse(LOG, &under_root);
        let dev = "/tmp/plain/root/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0";
        let devices = "/tmp/plain/root/sys/bus/pci/devices";
        let ids = "/usr/share/misc/pci.ids";
        let calls = t.all();
        assert_eq!(
            calls,
            vec![
                Call::Open {
                    base: Base::Cwd,
                    path: devices.into(),
                    flags: libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_DIRECTORY,
                    ret: Some(3),
                },
                Call::Getdents { fd: fd(3, devices) },
                Call::Getdents { fd: fd(3, devices) },
                Call::Close { fd: fd(3, devices) },
                Call::Open {
                    base: Base::Cwd,
                    path: format!("{devices}/0000:41:00.0").into(),
                    flags: libc::O_CLOEXEC | libc::O_DIRECTORY,
                    ret: Some(5),
                },
                // Joined from its unfinished and resumed halves, at the time it started.
                Call::Open {
                    base: Base::Fd(fd(5, dev)),
                    path: "vendor".into(),
                    flags: libc::O_CLOEXEC,
                    ret: Some(6),
                },
                Call::Read {
                    fd: fd(6, &format!("{dev}/vendor")),
                    count: 4096,
                    offset: None,
                },
                Call::Close {
                    fd: fd(6, &format!("{dev}/vendor"))
                },
                Call::Open {
                    base: Base::Fd(fd(5, dev)),
                    path: "sriov_numvfs".into(),
                    flags: libc::O_CLOEXEC,
                    ret: None,
                },
                Call::Readlink {
                    base: Base::Fd(fd(5, dev)),
                    path: "driver".into(),
                    count: 4096,
                },
                Call::Stat {
                    base: Base::Cwd,
                    path: "/tmp/plain/root/dev/vfio/12".into(),
                    nofollow: false,
                },
                Call::Close { fd: fd(5, dev) },
                Call::Open {
                    base: Base::Cwd,
                    path: ids.into(),
                    flags: libc::O_CLOEXEC,
                    ret: Some(3),
                },
                Call::Stat {
                    base: Base::Fd(fd(3, ids)),
                    path: "".into(),
                    nofollow: false,
                },
                Call::Read {
                    fd: fd(3, ids),
                    count: 1_500_001,
                    offset: None,
                },
                Call::Readlink {
                    base: Base::Cwd,
                    path: format!("{devices}/0000:41:00.0/iommu_group").into(),
                    count: 64,
                },
            ]
        );
        // The relative access resolves against the working directory (/work): not the node.
        assert!(!calls.iter().any(|c| matches!(c, Call::Access { .. })));
        // The unfinished open carries its start time.
        assert_eq!(t.calls[5].time, 1_795_471_819_000_021);
    }

    #[test]
    fn windows_select_by_start_time() {
        let t = parse(LOG, &under_root);
        let w = t.window(1_795_471_819_000_020, 1_795_471_819_000_029);
        assert_eq!(w.len(), 8);
        assert!(matches!(&w[0], Call::Open { ret: Some(5), .. }));
        assert!(matches!(&w[7], Call::Close { .. }));
        assert!(
            t.window(1_795_471_819_000_050, 1_795_471_819_000_060)
                .is_empty()
        );
        assert_eq!(micros("12.000300"), Some(12_000_300));
        assert_eq!(micros("12.3"), None);
    }

    #[test]
    fn relative_paths_resolve_against_the_last_known_working_directory() {
        let log = "1 1.000000 newfstatat(AT_FDCWD</tmp/plain>, \"root/sys\", {st_mode=S_IFDIR|0755, ...}, 0) = 0\n\
                   1 1.000001 access(\"root/dev/vfio/vfio\", R_OK|W_OK) = -1 ENOENT (No such file or directory)\n";
        let t = parse(log, &under_root);
        assert_eq!(
            t.all(),
            vec![
                Call::Stat {
                    base: Base::Cwd,
                    path: "/tmp/plain/root/sys".into(),
                    nofollow: false,
                },
                Call::Access {
                    base: Base::Cwd,
                    path: "/tmp/plain/root/dev/vfio/vfio".into(),
                    mode: libc::R_OK | libc::W_OK,
                },
            ]
        );
    }
}
