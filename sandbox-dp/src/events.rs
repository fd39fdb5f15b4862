//! Change events, and what each asks to be read again.
//!
//! - A uevent ([`common::uevent`]) naming a PCI function or an mdev: that device (with its VFs
//!   and mdevs) is read again; one naming a VFIO group node (`vfio`): that node is checked.
//! - inotify on `<host-root>/dev/vfio`: `/dev/vfio/<group>` created or removed flips the health
//!   of the group's devices, without reading any device; `/dev/vfio/devices/` and `/dev/iommu`
//!   re-list the iommufd nodes.
//! - What no device explains (a uevent of another subsystem, `/dev/vfio` itself appearing, a
//!   lost inotify queue), and the periodic resync: the whole node is read again.
//!
//! inotify on the plugin directory wakes the resource tasks (kubelet restarts, our sockets
//! removed); it does not touch the inventory.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::PciAddress;
use common::uevent::{Monitor, MonitorError, Starting, Subject};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use tokio::sync::{mpsc, watch};

use crate::plugin::KUBELET_SOCKET;

/// Uevent subsystems that can change what sandbox-dp advertises (events without a subsystem
/// count too).
const RELEVANT_SUBSYSTEMS: &[&str] = &[
    "pci", "mdev", "vfio", "vfio-dev", "iommu", "mdev_bus", "drivers",
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
}

/// Starts listening to uevents (both netlink groups, [`common::uevent::Monitor`]), sending
/// what each names to `changes`; [`listening`] waits until it listens.
pub fn start_uevents(changes: mpsc::UnboundedSender<Change>) -> Result<Starting, MonitorError> {
    Monitor::spawn(RELEVANT_SUBSYSTEMS, move |ev| {
        changes.send(Change::from(ev.subject)).is_ok()
    })
}

/// The monitor [`start_uevents`] started, once it listens; it stops when dropped. Without
/// uevents (no `CAP_NET_ADMIN` in the host's network namespace) this logs why: inotify and the
/// resync still run.
pub fn listening(started: Result<Starting, MonitorError>) -> Option<Monitor> {
    match started.and_then(Starting::wait) {
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

/// File watches: `/dev/vfio` (added once it exists) and the plugin directory.
#[derive(Debug)]
pub struct FileWatch {
    watcher: RecommendedWatcher,
    dev_vfio: PathBuf,
    dev_vfio_watched: bool,
}

impl FileWatch {
    /// Watches `kubelet_dir` (bumping `wake`, and `kubelet_generation` when `kubelet.sock` is
    /// created) and `dev_vfio` (sending what changed to `changes`); `dev` is watched so that
    /// `dev_vfio` and `/dev/iommu` appearing later are seen.
    pub fn start(
        kubelet_dir: &Path,
        dev: &Path,
        dev_vfio: &Path,
        changes: mpsc::UnboundedSender<Change>,
        wake: Arc<watch::Sender<u64>>,
        kubelet_generation: Arc<AtomicU64>,
    ) -> anyhow::Result<FileWatch> {
        let kdir = kubelet_dir.to_path_buf();
        let (dev_dir, vfio_dir) = (dev.to_path_buf(), dev_vfio.to_path_buf());
        let mut watcher = notify::recommended_watcher(
            move |res: notify::Result<notify::Event>| {
                let ev = match res {
                    Ok(ev) => ev,
                    Err(e) => {
                        tracing::warn!(error = %e, "file watch error; reading the node again");
                        let _ = changes.send(Change::Node);
                        wake.send_modify(|c| *c += 1);
                        return;
                    }
                };
                // Our own reads open these directories: access events would loop.
                if matches!(ev.kind, EventKind::Access(_)) {
                    return;
                }
                if ev.need_rescan() {
                    tracing::debug!("file watch lost events; reading the node again");
                    let _ = changes.send(Change::Node);
                    wake.send_modify(|c| *c += 1);
                    return;
                }
                let in_kdir = ev.paths.iter().any(|p| p.parent() == Some(kdir.as_path()));
                if in_kdir {
                    let kubelet = ev
                        .paths
                        .iter()
                        .any(|p| p.file_name().is_some_and(|n| n == KUBELET_SOCKET));
                    if kubelet && matches!(ev.kind, EventKind::Create(_)) {
                        kubelet_generation.fetch_add(1, Ordering::SeqCst);
                    }
                    tracing::debug!(kind = ?ev.kind, paths = ?ev.paths, "plugin directory event");
                    wake.send_modify(|c| *c += 1);
                    return;
                }
                for p in &ev.paths {
                    if let Some(c) = dev_change(&dev_dir, &vfio_dir, p) {
                        tracing::debug!(kind = ?ev.kind, path = %p.display(), change = ?c, "device node event");
                        let _ = changes.send(c);
                    }
                }
            },
        )?;
        watcher
            .watch(kubelet_dir, RecursiveMode::NonRecursive)
            .map_err(|e| anyhow::anyhow!("watching {}: {e}", kubelet_dir.display()))?;
        if let Err(e) = watcher.watch(dev, RecursiveMode::NonRecursive) {
            tracing::debug!(path = %dev.display(), error = %e, "not watching");
        }
        let mut fw = FileWatch {
            watcher,
            dev_vfio: dev_vfio.to_path_buf(),
            dev_vfio_watched: false,
        };
        fw.refresh();
        Ok(fw)
    }

    /// Adds the `/dev/vfio` watch once the directory exists (again after it was removed).
    pub fn refresh(&mut self) {
        let exists = self.dev_vfio.is_dir();
        if exists && !self.dev_vfio_watched {
            match self.watcher.watch(&self.dev_vfio, RecursiveMode::Recursive) {
                Ok(()) => self.dev_vfio_watched = true,
                Err(e) => {
                    tracing::debug!(path = %self.dev_vfio.display(), error = %e, "not watching")
                }
            }
        } else if !exists {
            self.dev_vfio_watched = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
