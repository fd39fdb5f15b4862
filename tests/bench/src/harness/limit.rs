//! The limit: the reads a daemon made for one figure (recorded by [`super::strace`]), replayed
//! in order by a tight loop on the same tree. It is what the node's files cost for that figure,
//! with nothing of the daemon's own: no process start, no parsing, no planning, no gRPC.
//!
//! Each call is replayed as the same system call on the same descriptor (the trace's numbers
//! mapped to the replay's), with two substitutions that cost the same on tmpfs: `statx` is
//! replayed as `fstatat`, and a directory's `getdents64` calls as one full `readdir` pass over it
//! (glibc's, with the same buffer size as the daemon's; it adds `fcntl` and `fstat` once per
//! directory listed). Descriptors a window uses but opened before it are opened before the
//! clock starts.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::dir::Dir;
use nix::fcntl::{AT_FDCWD, OFlag};
use nix::sys::stat::{Mode, fstat, fstatat};
use nix::unistd::{AccessFlags, Whence, faccessat};

use super::stats::summarize;
use super::strace::{Base, Call, Fd};

/// The limit of one figure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limit {
    /// Median time of one replay.
    pub time: Duration,
    /// Calls replayed.
    pub calls: usize,
    /// Opens whose outcome (opened or failed) differed from the trace's: the tree changed
    /// between the recording and the replay (a device node removed for the figure, back now).
    pub differed: usize,
}

/// Replays `calls` `times` times (after one untimed pass to warm the caches, as the daemon's
/// tree is warm) and returns the median.
pub fn limit(calls: &[Call], times: usize) -> Limit {
    let _ = replay(calls);
    let mut samples = Vec::with_capacity(times);
    let mut differed = 0;
    for _ in 0..times.max(1) {
        let (d, n) = replay(calls);
        samples.push(d);
        differed = differed.max(n);
    }
    Limit {
        time: summarize(&samples).map(|s| s.median).unwrap_or_default(),
        calls: calls.len(),
        differed,
    }
}

/// One replay: its duration and how many opens differed from the trace.
pub fn replay(calls: &[Call]) -> (Duration, usize) {
    let mut r = Replay::prepare(calls);
    let start = Instant::now();
    for c in calls {
        r.call(c);
    }
    let took = start.elapsed();
    (took, r.differed)
}

enum Slot {
    File(OwnedFd),
    Dir(Dir),
}

impl Slot {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Slot::File(f) => f.as_fd(),
            Slot::Dir(d) => d.as_fd(),
        }
    }
}

#[derive(Default)]
struct Replay {
    slots: HashMap<i32, Slot>,
    listed: HashSet<i32>,
    differed: usize,
    buf: Vec<u8>,
}

impl Replay {
    /// Opens, by the paths the trace decorated them with, the descriptors `calls` use before
    /// opening them; sizes the read buffer.
    fn prepare(calls: &[Call]) -> Replay {
        let mut r = Replay::default();
        let mut opened = HashSet::new();
        let need = |fd: &Fd, opened: &HashSet<i32>, r: &mut Replay| {
            if opened.contains(&fd.num) || r.slots.contains_key(&fd.num) {
                return;
            }
            if let Some(p) = &fd.path
                && let Ok(f) =
                    nix::fcntl::open(p, OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
            {
                r.slots.insert(fd.num, Slot::File(f));
            }
        };
        let mut max_read = 4096;
        for c in calls {
            match c {
                Call::Open { base, ret, .. } => {
                    if let Base::Fd(fd) = base {
                        need(fd, &opened, &mut r);
                    }
                    if let Some(n) = ret {
                        opened.insert(*n);
                    }
                }
                Call::Read { fd, count, .. } => {
                    max_read = max_read.max(*count);
                    need(fd, &opened, &mut r);
                }
                Call::Getdents { fd } | Call::Lseek { fd, .. } | Call::Close { fd } => {
                    need(fd, &opened, &mut r)
                }
                Call::Stat { base, .. }
                | Call::Readlink { base, .. }
                | Call::Access { base, .. } => {
                    if let Base::Fd(fd) = base {
                        need(fd, &opened, &mut r);
                    }
                }
            }
        }
        r.buf = vec![0; max_read];
        r
    }

    fn call(&mut self, c: &Call) {
        match c {
            Call::Open {
                base,
                path,
                flags,
                ret,
            } => {
                let opened = match self.dir(base) {
                    Some(dir) => nix::fcntl::openat(
                        dir,
                        path.as_path(),
                        OFlag::from_bits_retain(*flags),
                        Mode::empty(),
                    )
                    .ok(),
                    None => None,
                };
                if opened.is_some() != ret.is_some() {
                    self.differed += 1;
                }
                if let (Some(f), Some(n)) = (opened, ret) {
                    self.listed.remove(n);
                    self.slots.insert(*n, Slot::File(f));
                }
            }
            Call::Read { fd, count, offset } => {
                let Some(s) = self.slots.get(&fd.num) else {
                    return;
                };
                let n = (*count).min(self.buf.len());
                let buf = &mut self.buf[..n];
                let _ = match offset {
                    Some(o) => nix::sys::uio::pread(s.fd(), buf, *o),
                    None => nix::unistd::read(s.fd(), buf),
                };
            }
            Call::Getdents { fd } => {
                if self.listed.contains(&fd.num) {
                    return;
                }
                let Some(slot) = self.slots.remove(&fd.num) else {
                    return;
                };
                let dir = match slot {
                    Slot::Dir(d) => Some(d),
                    Slot::File(f) => Dir::from_fd(f).ok(),
                };
                if let Some(mut d) = dir {
                    for e in d.iter() {
                        let _ = e;
                    }
                    self.slots.insert(fd.num, Slot::Dir(d));
                }
                self.listed.insert(fd.num);
            }
            Call::Stat {
                base,
                path,
                nofollow,
            } => {
                if path.as_os_str().is_empty()
                    && let Base::Fd(fd) = base
                {
                    if let Some(s) = self.slots.get(&fd.num) {
                        let _ = fstat(s.fd());
                    }
                    return;
                }
                let flags = if *nofollow {
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW
                } else {
                    nix::fcntl::AtFlags::empty()
                };
                if let Some(dir) = self.dir(base) {
                    let _ = fstatat(dir, path.as_path(), flags);
                }
            }
            Call::Readlink { base, path, .. } => {
                if let Some(dir) = self.dir(base) {
                    let _ = nix::fcntl::readlinkat(dir, path.as_path());
                }
            }
            Call::Access { base, path, mode } => {
                if let Some(dir) = self.dir(base) {
                    let _ = faccessat(
                        dir,
                        path.as_path(),
                        AccessFlags::from_bits_truncate(*mode),
                        nix::fcntl::AtFlags::empty(),
                    );
                }
            }
            Call::Lseek { fd, offset, whence } => {
                let whence = match *whence {
                    libc::SEEK_CUR => Whence::SeekCur,
                    libc::SEEK_END => Whence::SeekEnd,
                    _ => Whence::SeekSet,
                };
                if let Some(s) = self.slots.get(&fd.num) {
                    let _ = nix::unistd::lseek(s.fd(), *offset, whence);
                }
            }
            Call::Close { fd } => {
                self.slots.remove(&fd.num);
                self.listed.remove(&fd.num);
            }
        }
    }

    /// The directory a path argument is relative to.
    fn dir(&self, base: &Base) -> Option<BorrowedFd<'_>> {
        match base {
            Base::Cwd => Some(AT_FDCWD),
            Base::Fd(fd) => self.slots.get(&fd.num).map(Slot::fd),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::strace::{Trace, parse};
    use super::*;
    use std::path::{Path, PathBuf};

    /// A trace of a device read (directory listing, relative opens, a failed optional
    /// attribute, a link, a stat), written against `root`.
    fn log(root: &Path) -> String {
        let r = root.display();
        format!(
            "1 1.000000 openat(AT_FDCWD</>, \"{r}/devices\", O_RDONLY|O_CLOEXEC|O_DIRECTORY) = 3<{r}/devices>\n\
             1 1.000001 getdents64(3<{r}/devices>, 0x1 /* 3 entries */, 32768) = 72\n\
             1 1.000002 getdents64(3<{r}/devices>, 0x1 /* 0 entries */, 32768) = 0\n\
             1 1.000003 openat(3<{r}/devices>, \"gpu\", O_RDONLY|O_CLOEXEC|O_DIRECTORY) = 4<{r}/devices/gpu>\n\
             1 1.000004 openat(4<{r}/devices/gpu>, \"vendor\", O_RDONLY|O_CLOEXEC) = 5<{r}/devices/gpu/vendor>\n\
             1 1.000005 read(5<{r}/devices/gpu/vendor>, \"\"..., 4096) = 7\n\
             1 1.000006 close(5<{r}/devices/gpu/vendor>) = 0\n\
             1 1.000007 openat(4<{r}/devices/gpu>, \"sriov_numvfs\", O_RDONLY|O_CLOEXEC) = -1 ENOENT (No such file or directory)\n\
             1 1.000008 readlinkat(4<{r}/devices/gpu>, \"driver\", \"\"..., 4096) = 7\n\
             1 1.000009 statx(AT_FDCWD</>, \"{r}/vfio/12\", AT_STATX_SYNC_AS_STAT, STATX_ALL, {{stx_mask=STATX_ALL}}) = 0\n\
             1 1.000010 close(4<{r}/devices/gpu>) = 0\n\
             1 1.000011 read(4<{r}/devices/gpu/vendor>, \"\"..., 4096) = 7\n\
             1 1.000012 close(3<{r}/devices>) = 0\n"
        )
    }

    /// The tree the log was recorded on, and the log's trace.
    fn recorded() -> (tempfile::TempDir, PathBuf, Trace) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join("devices/gpu")).unwrap();
        std::fs::write(root.join("devices/gpu/vendor"), "0x10de\n").unwrap();
        std::os::unix::fs::symlink("../vfio", root.join("devices/gpu/driver")).unwrap();
        std::fs::create_dir_all(root.join("vfio")).unwrap();
        std::fs::write(root.join("vfio/12"), "").unwrap();
        let t = parse(&log(&root), &|p| p.starts_with(&root));
        (tmp, root, t)
    }

    #[test]
    fn a_replay_on_the_recorded_tree_opens_what_the_trace_opened() {
        let (_tmp, _, t) = recorded();
        let calls = t.all();
        // The read after the close of fd 4 is on no open descriptor: not kept.
        assert_eq!(calls.len(), 12);
        let l = limit(&calls, 3);
        assert_eq!((l.calls, l.differed), (12, 0));
    }

    #[test]
    fn a_replay_on_a_changed_tree_counts_the_opens_that_differ() {
        let (_tmp, root, t) = recorded();
        let calls = t.all();
        std::fs::remove_file(root.join("devices/gpu/vendor")).unwrap();
        std::fs::write(root.join("devices/gpu/sriov_numvfs"), "0\n").unwrap();
        assert_eq!(replay(&calls).1, 2);
    }

    #[test]
    fn a_window_opens_the_descriptors_it_inherits_first() {
        let (_tmp, root, t) = recorded();
        // From the relative open of `vendor` on: fd 4 was opened before the window.
        let w = t.window(1_000_004, 1_000_009);
        assert_eq!(w.len(), 6);
        assert_eq!(replay(&w).1, 0);
        std::fs::remove_dir_all(root.join("devices")).unwrap();
        // Without its directory, the inherited descriptor cannot be opened: the opens on it
        // fail where the trace's succeeded (the failed one failed in both).
        assert_eq!(replay(&w).1, 1);
    }
}
