//! Who holds a simulated device node open, as the kernel keeps it.
//!
//! The kernel holds a VFIO group from the open of `/dev/vfio/<g>` until the last close of that
//! open file description: `dup`, `dup2`, `fork` and `exec` share the description, and only when
//! every descriptor of it is closed is the group free again. Its `/proc/<pid>/fd/<n>` lists the
//! processes that have a descriptor of it now (the shell after `exec 7<>/dev/vfio/<g>`, a forked
//! child after its parent exited, the program an `exec` started).
//!
//! FUSE sees the open (OPEN), every close of any descriptor of the description (FLUSH, sent
//! synchronously by `close(2)` after the descriptor left the process's table) and the end of
//! the description (RELEASE, sent asynchronously, after `close(2)` has returned). node-sim
//! therefore keeps each open description of a device node from OPEN until either RELEASE or a
//! FLUSH after which no process has a descriptor of the node any more, found in the host's
//! `/proc/<pid>/fd`; `proc` lists what the host's `/proc` shows now. Synthetic holders
//! (`hold <group>`) stand beside them.
//!
//! Every read of the host's `/proc` runs on a thread of its own and is given up after
//! [`PROC_DEADLINE`]. Such a read can wait on the process it reads: on its memory map's lock,
//! or on its exec, which holds its locks while it closes its close-on-exec descriptors — and
//! each close of a device node here is a FLUSH this simulator must answer first. Waiting for
//! the read with the simulator's lock held (or in the FLUSH itself) would hang both for good;
//! giving up turns that into a short delay and an answer that errs towards "held": a FLUSH
//! whose scan gave up keeps the description until its RELEASE, as if a descriptor were left.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use crate::tree::OpenKind;

/// An errno.
type Errno = i32;

/// A device node a process may hold: its host path (`/dev/vfio/42`).
pub(crate) fn host_path(kind: OpenKind) -> String {
    match kind {
        OpenKind::VfioGroup(g) => format!("/dev/vfio/{g}"),
        OpenKind::VfioCdev(n) => format!("/dev/vfio/devices/vfio{n}"),
        OpenKind::Nvidia(n) => format!("/dev/nvidia{n}"),
    }
}

/// A process's descriptors open on the sim's device nodes: fd → (host path, whether the node
/// was removed meanwhile).
type Fds = BTreeMap<u32, (String, bool)>;

/// A synthetic VM holding a group (`hold`).
#[derive(Clone, Debug)]
struct Synthetic {
    pid: u32,
    comm: String,
    group: u32,
    fd: u32,
}

/// A process holding simulated device nodes, as `proc/<pid>` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Process {
    pid: u32,
    /// A synthetic holder's comm and cmdline; a host process's are read when asked for.
    synthetic: Option<(String, String)>,
    /// Descriptor number → host path of the node (`/dev/vfio/42`).
    pub fds: BTreeMap<u32, String>,
}

impl Process {
    /// `comm`, as the host's `/proc/<pid>/comm` shows it now.
    pub fn comm(&self) -> String {
        match &self.synthetic {
            Some((comm, _)) => comm.clone(),
            None => self.host_file("comm"),
        }
    }

    /// `cmdline`, as the host's `/proc/<pid>/cmdline` shows it now. Read only when asked for:
    /// reading another process's cmdline takes its memory map's lock, which listing `proc`
    /// or reading a descriptor link must never wait on.
    pub fn cmdline(&self) -> String {
        match &self.synthetic {
            Some((_, cmdline)) => cmdline.clone(),
            None => self.host_file("cmdline"),
        }
    }

    fn host_file(&self, name: &str) -> String {
        let path = format!("/proc/{}/{name}", self.pid);
        bounded(move || std::fs::read_to_string(path).unwrap_or_default()).unwrap_or_default()
    }
}

/// How long a read of the host's `/proc` may take before it is given up (see the module's
/// documentation). Reads that do not wait on anyone take microseconds.
pub(crate) const PROC_DEADLINE: Duration = Duration::from_millis(500);

/// `read()` on a thread of its own, its result if it is done within [`PROC_DEADLINE`]. A read
/// given up finishes on its own later, once what it waited for is done, and is dropped.
fn bounded<T: Send + 'static>(read: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("node-sim-proc".into())
        .spawn(move || {
            let _ = tx.send(read());
        });
    if spawned.is_err() {
        return None;
    }
    rx.recv_timeout(PROC_DEADLINE).ok()
}

/// The holders of the node's device nodes.
#[derive(Debug)]
pub(crate) struct Holders {
    /// The sim's root as the host's `/proc/<pid>/fd/<n>` links show it (canonical).
    root: String,
    synthetic: Vec<Synthetic>,
    /// Open descriptions of device nodes by FUSE file handle: the node opened.
    open: HashMap<u64, OpenKind>,
    next_fd: u32,
}

impl Holders {
    pub fn new(root: &Path) -> Holders {
        Holders {
            root: root.to_string_lossy().into_owned(),
            synthetic: Vec::new(),
            open: HashMap::new(),
            next_fd: 3,
        }
    }

    /// Whether anything holds the group: an open description or a synthetic holder.
    pub fn group_held(&self, g: u32) -> bool {
        self.synthetic.iter().any(|s| s.group == g)
            || self.open.values().any(|k| *k == OpenKind::VfioGroup(g))
    }

    /// An open of a device node (FUSE handle `fh`); `Err(EBUSY)` when it is a VFIO group that
    /// is held already (one open description per group).
    pub fn open(&mut self, kind: OpenKind, fh: u64) -> Result<(), Errno> {
        if let OpenKind::VfioGroup(g) = kind
            && self.group_held(g)
        {
            return Err(libc::EBUSY);
        }
        self.open.insert(fh, kind);
        Ok(())
    }

    /// A close of one descriptor of handle `fh` (FUSE's FLUSH). The description ends here when
    /// no process has a descriptor of its node any more; otherwise at RELEASE.
    pub fn flush(&mut self, fh: u64) {
        let Some(kind) = self.open.get(&fh).copied() else {
            return;
        };
        let target = host_path(kind);
        // A scan given up counts as held: RELEASE ends the description then.
        let held = self.scan_all().is_none_or(|all| {
            all.values()
                .any(|fds| fds.values().any(|(t, _)| *t == target))
        });
        if !held {
            self.open.remove(&fh);
        }
    }

    /// The end of the description of handle `fh` (FUSE's RELEASE).
    pub fn release(&mut self, fh: u64) {
        self.open.remove(&fh);
    }

    /// `hold <group>`: a synthetic VM holding the group.
    pub fn hold(&mut self, group: u32, pid: Option<u32>, comm: &str) -> Result<(), String> {
        if self.group_held(group) {
            return Err("group is already held".into());
        }
        let fd = self.next_fd;
        self.next_fd += 1;
        self.synthetic.push(Synthetic {
            pid: pid.unwrap_or(900_000 + group),
            comm: comm.to_string(),
            group,
            fd,
        });
        Ok(())
    }

    /// `release <group>`: ends a synthetic hold.
    pub fn release_synthetic(&mut self, group: u32) -> Result<(), String> {
        let before = self.synthetic.len();
        self.synthetic.retain(|s| s.group != group);
        if self.synthetic.len() == before {
            return Err("no synthetic holder of that group".into());
        }
        Ok(())
    }

    /// The pids `proc` lists now.
    pub fn pids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.synthetic.iter().map(|s| s.pid).collect();
        if !self.open.is_empty() {
            v.extend(self.scan_all().unwrap_or_default().into_keys());
        }
        v.sort_unstable();
        v.dedup();
        v
    }

    /// What `proc/<pid>` shows, if the process holds a simulated device node now. `exists`
    /// says whether a node (`dev/vfio/42`) is still there: a link to one that is gone reads
    /// `… (deleted)`, as the kernel's does.
    pub fn process(&self, pid: u32, exists: impl Fn(&str) -> bool) -> Option<Process> {
        let mut fds: BTreeMap<u32, String> = self
            .synthetic
            .iter()
            .filter(|s| s.pid == pid)
            .map(|s| (s.fd, host_path(OpenKind::VfioGroup(s.group))))
            .collect();
        if let Some(s) = self.synthetic.iter().find(|s| s.pid == pid) {
            return Some(Process {
                pid,
                synthetic: Some((
                    format!("{}\n", s.comm),
                    format!("/usr/libexec/qemu-kvm\0-name\0guest=sim-vm-{}\0", s.group),
                )),
                fds,
            });
        }
        if self.open.is_empty() {
            return None;
        }
        for (fd, (target, deleted)) in self.scan(pid).unwrap_or_default() {
            let shown = if deleted || !exists(target.trim_start_matches('/')) {
                format!("{target} (deleted)")
            } else {
                target
            };
            fds.insert(fd, shown);
        }
        if fds.is_empty() {
            return None;
        }
        Some(Process {
            pid,
            synthetic: None,
            fds,
        })
    }

    /// What a scan of the host's `/proc` looks for: the sim's root and the host paths of the
    /// nodes open now.
    fn targets(&self) -> Targets {
        Targets {
            root: self.root.clone(),
            paths: self.open.values().map(|k| host_path(*k)).collect(),
        }
    }

    /// The descriptors of host process `pid` open on this sim's device nodes; `None` when the
    /// host's `/proc` did not answer in time.
    fn scan(&self, pid: u32) -> Option<Fds> {
        let targets = self.targets();
        bounded(move || targets.scan(pid))
    }

    /// [`Self::scan`] of every host process that has such descriptors.
    fn scan_all(&self) -> Option<BTreeMap<u32, Fds>> {
        let targets = self.targets();
        bounded(move || {
            pids()
                .map(|pid| (pid, targets.scan(pid)))
                .filter(|(_, fds)| !fds.is_empty())
                .collect()
        })
    }
}

/// What a scan of the host's `/proc` looks for (owned, for the thread that reads).
#[derive(Debug)]
struct Targets {
    /// The sim's root as the host's `/proc/<pid>/fd/<n>` links show it.
    root: String,
    /// Host paths of the device nodes open now (`/dev/vfio/42`).
    paths: HashSet<String>,
}

impl Targets {
    /// The descriptors of host process `pid` that are open on this sim's device nodes with an
    /// open description.
    fn scan(&self, pid: u32) -> Fds {
        let mut out = BTreeMap::new();
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return out;
        };
        for e in dir.flatten() {
            let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(link) = std::fs::read_link(e.path()) else {
                continue;
            };
            let link = link.to_string_lossy();
            let (path, deleted) = match link.strip_suffix(" (deleted)") {
                Some(p) => (p, true),
                None => (link.as_ref(), false),
            };
            let Some(target) = path.strip_prefix(self.root.as_str()) else {
                continue;
            };
            if self.paths.contains(target) {
                out.insert(fd, (target.to_string(), deleted));
            }
        }
        out
    }
}

/// The host's process ids.
fn pids() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
}
