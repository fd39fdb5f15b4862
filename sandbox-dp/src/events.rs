//! Change events, and what each asks to be read again.
//!
//! - A uevent ([`common::uevent`]) naming a PCI function or an mdev: that device (with its VFs
//!   and mdevs) is read again; one naming a VFIO group node (`vfio`): that node is checked.
//! - File events ([`FileWatch`], `notify`) on `<host-root>/dev/vfio`: `/dev/vfio/<group>` created
//!   or removed flips the health of the group's devices, without reading any device;
//!   `/dev/vfio/devices/` and `/dev/iommu` re-list the iommufd nodes.
//! - What no device explains (a uevent of another subsystem, such as the `misc` device of a VFIO
//!   or iommufd module that made `/dev/vfio` or `/dev/iommu` appear; `/dev/vfio` removed; a
//!   watch that lost events), and the periodic resync: the whole node is read again.
//!
//! All of these go to the daemon's [`daemon_kit::reconcile::Trigger`]: a bounded queue, where a
//! storm becomes one read of the whole node. File events in the plugin directory wake the
//! resource tasks (kubelet restarts, our sockets removed); they do not touch the inventory.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use common::PciAddress;
use common::uevent::{Monitor, Subject};
use daemon_kit::reconcile::{Changes, Wake};
use notify::event::{ModifyKind, RenameMode};
use notify::{EventKind, RecursiveMode, Watcher as _};
use tokio::sync::watch;

use crate::plugin::KUBELET_SOCKET;

/// Uevent subsystems that can change what sandbox-dp advertises (events without a subsystem
/// count too).
const RELEVANT_SUBSYSTEMS: &[&str] = &[
    "pci", "mdev", "vfio", "vfio-dev", "iommu", "mdev_bus", "drivers", "misc",
];

/// What one event asks to be read again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A PCI function, with its VFs and mdevs.
    Pci(PciAddress),
    /// An mdev.
    Mdev(String),
    /// Whether `/dev/vfio/<group>` exists.
    GroupNode(u32),
    /// The iommufd nodes (`/dev/iommu`, `/dev/vfio/devices/`).
    DevNodes,
    /// The whole node.
    Node,
}

impl From<Subject> for Change {
    fn from(s: Subject) -> Change {
        match s {
            Subject::Pci(a) => Change::Pci(a),
            Subject::Mdev(u) => Change::Mdev(u),
            Subject::VfioGroup(g) => Change::GroupNode(g),
            Subject::Other => Change::Node,
        }
    }
}

/// The changes gathered since the last read, each device once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    /// Read the whole node (the rest is then moot).
    pub node: bool,
    /// PCI functions to read again.
    pub pci: BTreeSet<PciAddress>,
    /// mdevs to read again.
    pub mdevs: BTreeSet<String>,
    /// Group nodes to check.
    pub groups: BTreeSet<u32>,
    /// iommufd nodes to list again.
    pub dev_nodes: bool,
}

impl Pending {
    /// Adds one change.
    pub fn add(&mut self, c: Change) {
        match c {
            Change::Pci(a) => {
                self.pci.insert(a);
            }
            Change::Mdev(u) => {
                self.mdevs.insert(u);
            }
            Change::GroupNode(g) => {
                self.groups.insert(g);
            }
            Change::DevNodes => self.dev_nodes = true,
            Change::Node => self.node = true,
        }
    }

    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        *self == Pending::default()
    }

    /// Whether group nodes are all there is to check.
    pub fn only_group_nodes(&self) -> bool {
        !self.groups.is_empty() && !self.reads_devices() && !self.dev_nodes
    }

    /// Whether any device (or the node) must be read, rather than device nodes checked.
    pub fn reads_devices(&self) -> bool {
        self.node || !self.pci.is_empty() || !self.mdevs.is_empty()
    }

    /// Adds what woke the loop. A resync (the interval passed, or changes were lost) reads the
    /// whole node, and also wakes the resource tasks, which check their sockets and kubelet's.
    pub fn absorb(&mut self, wake: Wake<Change>, resource_tasks: &watch::Sender<u64>) {
        for c in wake.changes {
            self.add(c);
        }
        if wake.resync {
            self.node = true;
            resource_tasks.send_modify(|c| *c += 1);
        }
    }
}

/// Listens to uevents (both netlink groups, [`common::uevent::Monitor`]) from its return on,
/// sending what each names to `changes` (a bounded queue: a storm becomes a read of the whole
/// node); it stops when dropped. Without uevents (no
/// `CAP_NET_ADMIN` in the host's network namespace) this logs why: inotify and the resync
/// still run.
pub fn listen_uevents(changes: Changes<Change>) -> Option<Monitor> {
    let started = Monitor::start(RELEVANT_SUBSYSTEMS, move |ev| {
        changes.send(Change::from(ev.subject))
    });
    match started {
        Ok(m) => Some(m),
        Err(e) => {
            tracing::warn!(error = %e, "no uevents: relying on inotify and the resync interval");
            None
        }
    }
}

/// What an inotify event under `/dev` asks to be read again, if anything.
fn dev_change(dev: &Path, dev_vfio: &Path, path: &Path) -> Option<Change> {
    if path == dev_vfio {
        // /dev/vfio itself came or went: every group node with it.
        return Some(Change::Node);
    }
    if path == dev.join("iommu") || path.starts_with(dev_vfio.join("devices")) {
        return Some(Change::DevNodes);
    }
    if path.parent() == Some(dev_vfio) {
        return path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse().ok())
            .map(Change::GroupNode);
    }
    None // another device node of the host
}

/// What one file event asks of the daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileEvent {
    /// Something changed in the plugin directory: the resource tasks check their sockets;
    /// `kubelet` when `kubelet.sock` was created (kubelet restarted).
    PluginDir { kubelet: bool },
    /// A device node changed.
    Dev(Change),
    /// The watch lost events (its queue overflowed, or it failed): read everything again.
    Lost,
}

/// Which path an event is about, and what that asks.
#[derive(Debug)]
struct Classify {
    kubelet_dir: PathBuf,
    dev: PathBuf,
    dev_vfio: PathBuf,
    /// The paths watched now: one removed is watched again by [`FileWatch::refresh`].
    live: Arc<Mutex<BTreeSet<PathBuf>>>,
}

impl Classify {
    fn events(&self, ev: notify::Result<notify::Event>, out: &mut Vec<FileEvent>) {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                tracing::warn!(error = %e, "file watch failed; reading the node again");
                out.push(FileEvent::Lost);
                return;
            }
        };
        if ev.need_rescan() {
            tracing::debug!("file watch lost events; reading the node again");
            out.push(FileEvent::Lost);
            return;
        }
        // Opens and closes: our own reads of the plugin directory among them, which would loop.
        if ev.kind.is_access() {
            return;
        }
        let gone = matches!(
            ev.kind,
            EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(RenameMode::From))
        );
        for path in &ev.paths {
            if gone && let Ok(mut live) = self.live.lock() {
                live.remove(path);
            }
            if *path == self.kubelet_dir || path.parent() == Some(&self.kubelet_dir) {
                let kubelet = matches!(ev.kind, EventKind::Create(_))
                    && path.file_name().is_some_and(|n| n == KUBELET_SOCKET);
                tracing::debug!(kind = ?ev.kind, path = %path.display(), "plugin directory event");
                out.push(FileEvent::PluginDir { kubelet });
            } else if let Some(c) = dev_change(&self.dev, &self.dev_vfio, path) {
                tracing::debug!(kind = ?ev.kind, path = %path.display(), change = ?c, "device node event");
                out.push(FileEvent::Dev(c));
            }
        }
    }
}

/// File watches through `notify` (inotify underneath, on a thread of its own): the plugin
/// directory, and `/dev/vfio`, `/dev/vfio/devices` and `/dev/iommu` while they exist.
///
/// `/dev` itself is not watched: `notify` watches a directory for opens and writes of its
/// entries too, and every open of `/dev/null` on the host would wake the daemon. `/dev/vfio` and
/// `/dev/iommu` come with their modules, whose devices announce themselves by a `misc` uevent,
/// which reads the node; [`FileWatch::refresh`] then watches them.
#[derive(Debug)]
pub struct FileWatch {
    watcher: notify::RecommendedWatcher,
    /// What is watched when it exists.
    targets: Vec<PathBuf>,
    live: Arc<Mutex<BTreeSet<PathBuf>>>,
}

impl FileWatch {
    /// Watches `kubelet_dir` (an error when it cannot be watched), and `dev_vfio`, its
    /// `devices` directory and `dev/iommu` when they exist; `handler` hears what each event
    /// asks, on the watcher's thread.
    pub fn start<F>(
        kubelet_dir: &Path,
        dev: &Path,
        dev_vfio: &Path,
        mut handler: F,
    ) -> anyhow::Result<FileWatch>
    where
        F: FnMut(FileEvent) + Send + 'static,
    {
        let live = Arc::new(Mutex::new(BTreeSet::new()));
        let classify = Classify {
            kubelet_dir: kubelet_dir.to_path_buf(),
            dev: dev.to_path_buf(),
            dev_vfio: dev_vfio.to_path_buf(),
            live: live.clone(),
        };
        let watcher = notify::recommended_watcher(move |ev| {
            let mut out = Vec::new();
            classify.events(ev, &mut out);
            for e in out {
                handler(e);
            }
        })
        .context("cannot start watching files")?;
        let mut fw = FileWatch {
            watcher,
            targets: vec![
                kubelet_dir.to_path_buf(),
                dev_vfio.to_path_buf(),
                dev_vfio.join("devices"),
                dev.join("iommu"),
            ],
            live,
        };
        fw.watcher
            .watch(kubelet_dir, RecursiveMode::NonRecursive)
            .with_context(|| format!("cannot watch {}", kubelet_dir.display()))?;
        fw.mark_live(kubelet_dir);
        fw.refresh();
        Ok(fw)
    }

    fn mark_live(&self, path: &Path) {
        if let Ok(mut live) = self.live.lock() {
            live.insert(path.to_path_buf());
        }
    }

    /// Watches what exists and is not watched (again, after it was removed).
    pub fn refresh(&mut self) {
        for path in &self.targets {
            let watched = self.live.lock().is_ok_and(|l| l.contains(path));
            if watched || !path.exists() {
                continue;
            }
            match self.watcher.watch(path, RecursiveMode::NonRecursive) {
                Ok(()) => self.mark_live(path),
                Err(e) => tracing::debug!(path = %path.display(), error = %e, "not watching"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events until one matches `want`, or a panic after 5 s without it.
    fn until(rx: &std::sync::mpsc::Receiver<FileEvent>, want: &FileEvent) {
        let wait = std::time::Duration::from_secs(5);
        loop {
            let ev = rx
                .recv_timeout(wait)
                .unwrap_or_else(|_| panic!("no {want:?} within {wait:?}"));
            if ev == *want {
                return;
            }
        }
    }

    #[test]
    fn file_watches_follow_dev_vfio_and_dev_iommu_as_they_come_and_go() {
        let dir = tempfile::tempdir().unwrap();
        let (kdir, dev) = (dir.path().join("kubelet"), dir.path().join("dev"));
        let vfio = dev.join("vfio");
        std::fs::create_dir_all(&kdir).unwrap();
        std::fs::create_dir_all(&dev).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut fw = FileWatch::start(&kdir, &dev, &vfio, move |e| {
            let _ = tx.send(e);
        })
        .unwrap();

        // kubelet (re)starts: its socket is created in the plugin directory.
        std::fs::write(kdir.join(KUBELET_SOCKET), "").unwrap();
        until(&rx, &FileEvent::PluginDir { kubelet: true });
        std::fs::remove_file(kdir.join(KUBELET_SOCKET)).unwrap();
        until(&rx, &FileEvent::PluginDir { kubelet: false });

        // /dev/vfio appears after the start (its module's uevent reads the node): once
        // refreshed, its group nodes are watched.
        std::fs::create_dir(&vfio).unwrap();
        fw.refresh();
        std::fs::write(vfio.join("42"), "").unwrap();
        until(&rx, &FileEvent::Dev(Change::GroupNode(42)));
        std::fs::remove_file(vfio.join("42")).unwrap();
        until(&rx, &FileEvent::Dev(Change::GroupNode(42)));

        // The iommufd directory and its nodes, and /dev/iommu.
        std::fs::create_dir(vfio.join("devices")).unwrap();
        until(&rx, &FileEvent::Dev(Change::DevNodes));
        std::fs::write(dev.join("iommu"), "").unwrap();
        fw.refresh();
        std::fs::write(vfio.join("devices/vfio0"), "").unwrap();
        until(&rx, &FileEvent::Dev(Change::DevNodes));
        std::fs::remove_file(dev.join("iommu")).unwrap();
        until(&rx, &FileEvent::Dev(Change::DevNodes));

        // /dev/vfio removed: the whole node; created again: watched again after a refresh.
        std::fs::remove_dir_all(&vfio).unwrap();
        until(&rx, &FileEvent::Dev(Change::Node));
        std::fs::create_dir(&vfio).unwrap();
        fw.refresh();
        std::fs::write(vfio.join("7"), "").unwrap();
        until(&rx, &FileEvent::Dev(Change::GroupNode(7)));
    }

    #[test]
    fn device_node_events_name_what_to_read() {
        let dev = Path::new("/host/dev");
        let vfio = dev.join("vfio");
        let c = |p: &str| dev_change(dev, &vfio, Path::new(p));
        assert_eq!(c("/host/dev/vfio/42"), Some(Change::GroupNode(42)));
        assert_eq!(c("/host/dev/vfio/devices/vfio3"), Some(Change::DevNodes));
        assert_eq!(c("/host/dev/vfio/devices"), Some(Change::DevNodes));
        assert_eq!(c("/host/dev/iommu"), Some(Change::DevNodes));
        assert_eq!(c("/host/dev/vfio"), Some(Change::Node));
        assert_eq!(c("/host/dev/vfio/vfio"), None);
        assert_eq!(c("/host/dev/ttyS0"), None);
    }

    #[test]
    fn pending_changes_coalesce() {
        let a: PciAddress = "0000:41:00.0".parse().unwrap();
        let mut p = Pending::default();
        assert!(p.is_empty());
        p.add(Change::GroupNode(3));
        assert!(!p.reads_devices() && p.only_group_nodes());
        let mut q = p.clone();
        q.add(Change::DevNodes);
        assert!(
            !q.only_group_nodes(),
            "iommufd nodes are listed again, not only group nodes"
        );
        p.add(Change::Pci(a));
        assert!(!p.only_group_nodes());
        p.add(Change::Pci(a));
        p.add(Change::from(Subject::Mdev("u".into())));
        assert_eq!(p.pci.len(), 1);
        assert!(p.reads_devices() && !p.node);
        p.add(Change::from(Subject::Other));
        assert!(p.node);
    }
}
