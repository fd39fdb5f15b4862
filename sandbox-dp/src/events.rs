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

use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsFd as _, AsRawFd, RawFd};
use std::path::{Path, PathBuf};

use common::PciAddress;
use common::uevent::{Monitor, Subject};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use daemon_kit::reconcile::{Changes, Wake};
use tokio::sync::watch;

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

/// What one inotify event asks of the daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileEvent {
    /// Something changed in the plugin directory: the resource tasks check their sockets;
    /// `kubelet` when `kubelet.sock` was created (kubelet restarted).
    PluginDir { kubelet: bool },
    /// A device node changed.
    Dev(Change),
    /// The kernel's queue overflowed: events were lost.
    Lost,
}

/// Which watched directory a watch descriptor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Watched {
    PluginDir,
    Dev,
    DevVfio,
    DevVfioDevices,
}

/// What is watched in the plugin directory: anything but opens and reads (our own reads
/// open it, which would loop).
const PLUGIN_DIR_EVENTS: AddWatchFlags = AddWatchFlags::IN_CREATE
    .union(AddWatchFlags::IN_DELETE)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_MODIFY)
    .union(AddWatchFlags::IN_ATTRIB)
    .union(AddWatchFlags::IN_DELETE_SELF)
    .union(AddWatchFlags::IN_MOVE_SELF);

/// What is watched under `/dev`: entries coming and going.
const DEV_EVENTS: AddWatchFlags = AddWatchFlags::IN_CREATE
    .union(AddWatchFlags::IN_DELETE)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_DELETE_SELF)
    .union(AddWatchFlags::IN_MOVE_SELF);

/// The inotify instance, readable from the runtime.
#[derive(Debug)]
struct Fd(Inotify);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// File watches on one inotify instance, read on the daemon's own runtime (no thread): the
/// plugin directory, `/dev` (so that `/dev/vfio` and `/dev/iommu` appearing later are seen),
/// `/dev/vfio` and `/dev/vfio/devices` once they exist.
#[derive(Debug)]
pub struct FileWatch {
    fd: AsyncFd<Fd>,
    watched: HashMap<WatchDescriptor, Watched>,
    kubelet_dir: PathBuf,
    dev: PathBuf,
    dev_vfio: PathBuf,
}

impl FileWatch {
    /// Watches `kubelet_dir` (an error when it cannot be watched), `dev`, and `dev_vfio` with
    /// its `devices` directory when they exist. Call it inside the runtime.
    pub fn start(kubelet_dir: &Path, dev: &Path, dev_vfio: &Path) -> anyhow::Result<FileWatch> {
        let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| anyhow::anyhow!("inotify: {e}"))?;
        // SAFETY: `Fd` owns the inotify descriptor and the `AsyncFd` owns `Fd`: the descriptor
        // stays open, and is not closed or reused by anything else, while it is registered.
        #[allow(unsafe_code)]
        let fd = unsafe { AsyncFd::register(Fd(ino)) }
            .map_err(|e| anyhow::anyhow!("inotify: {}", std::io::Error::from(e)))?;
        let mut fw = FileWatch {
            fd,
            watched: HashMap::new(),
            kubelet_dir: kubelet_dir.to_path_buf(),
            dev: dev.to_path_buf(),
            dev_vfio: dev_vfio.to_path_buf(),
        };
        fw.add(Watched::PluginDir)
            .map_err(|e| anyhow::anyhow!("watching {}: {e}", kubelet_dir.display()))?;
        fw.refresh();
        Ok(fw)
    }

    fn path(&self, w: Watched) -> PathBuf {
        match w {
            Watched::PluginDir => self.kubelet_dir.clone(),
            Watched::Dev => self.dev.clone(),
            Watched::DevVfio => self.dev_vfio.clone(),
            Watched::DevVfioDevices => self.dev_vfio.join("devices"),
        }
    }

    fn add(&mut self, w: Watched) -> nix::Result<()> {
        let mask = if w == Watched::PluginDir {
            PLUGIN_DIR_EVENTS
        } else {
            DEV_EVENTS
        };
        let wd = self.fd.get_ref().0.add_watch(&self.path(w), mask)?;
        // Watching a directory again returns its descriptor: one entry per directory.
        self.watched.retain(|_, v| *v != w);
        self.watched.insert(wd, w);
        Ok(())
    }

    /// Adds the watches of `/dev`, `/dev/vfio` and `/dev/vfio/devices` that are missing and
    /// whose directory exists (again after one was removed).
    pub fn refresh(&mut self) {
        for w in [Watched::Dev, Watched::DevVfio, Watched::DevVfioDevices] {
            if self.watched.values().any(|v| *v == w) || !self.path(w).is_dir() {
                continue;
            }
            if let Err(e) = self.add(w) {
                tracing::debug!(path = %self.path(w).display(), error = %e, "not watching");
            }
        }
    }

    /// Waits for the next events and says what they ask. An error means the instance
    /// cannot be read any more.
    pub async fn next(&mut self) -> std::io::Result<Vec<FileEvent>> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.get_inner().0.read_events() {
                Ok(evs) => return Ok(self.interpret(evs)),
                Err(nix::errno::Errno::EAGAIN) => guard.clear_ready(),
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn interpret(&mut self, evs: Vec<InotifyEvent>) -> Vec<FileEvent> {
        let mut out = Vec::new();
        for ev in evs {
            if ev.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                tracing::debug!("file watch lost events; reading the node again");
                out.push(FileEvent::Lost);
                continue;
            }
            let Some(&w) = self.watched.get(&ev.wd) else {
                continue;
            };
            if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
                // The directory went (or was unmounted): watched again once it is back.
                self.watched.remove(&ev.wd);
            }
            let path = match &ev.name {
                Some(n) => self.path(w).join(n),
                None => self.path(w),
            };
            if w == Watched::PluginDir {
                let kubelet = ev.mask.contains(AddWatchFlags::IN_CREATE)
                    && ev.name.as_deref().is_some_and(|n| n == KUBELET_SOCKET);
                tracing::debug!(mask = ?ev.mask, path = %path.display(), "plugin directory event");
                out.push(FileEvent::PluginDir { kubelet });
                continue;
            }
            if let Some(c) = dev_change(&self.dev, &self.dev_vfio, &path) {
                tracing::debug!(mask = ?ev.mask, path = %path.display(), change = ?c, "device node event");
                out.push(FileEvent::Dev(c));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The next events of `fw` until one matches `want`, or a panic after 5 s.
    async fn until(fw: &mut FileWatch, want: &FileEvent) {
        let wait = std::time::Duration::from_secs(5);
        loop {
            let evs = tokio::time::timeout(wait, fw.next())
                .await
                .unwrap_or_else(|_| panic!("no {want:?} within {wait:?}"))
                .unwrap();
            if evs.contains(want) {
                return;
            }
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn file_watches_follow_dev_vfio_as_it_comes_and_goes() {
        let dir = tempfile::tempdir().unwrap();
        let (kdir, dev) = (dir.path().join("kubelet"), dir.path().join("dev"));
        let vfio = dev.join("vfio");
        std::fs::create_dir_all(&kdir).unwrap();
        std::fs::create_dir_all(&dev).unwrap();
        let mut fw = FileWatch::start(&kdir, &dev, &vfio).unwrap();

        // kubelet (re)starts: its socket is created in the plugin directory.
        std::fs::write(kdir.join(KUBELET_SOCKET), "").unwrap();
        until(&mut fw, &FileEvent::PluginDir { kubelet: true }).await;
        std::fs::remove_file(kdir.join(KUBELET_SOCKET)).unwrap();
        until(&mut fw, &FileEvent::PluginDir { kubelet: false }).await;

        // /dev/vfio appears after the start: the whole node, then its group nodes are watched.
        std::fs::create_dir(&vfio).unwrap();
        until(&mut fw, &FileEvent::Dev(Change::Node)).await;
        fw.refresh();
        std::fs::write(vfio.join("42"), "").unwrap();
        until(&mut fw, &FileEvent::Dev(Change::GroupNode(42))).await;
        std::fs::remove_file(vfio.join("42")).unwrap();
        until(&mut fw, &FileEvent::Dev(Change::GroupNode(42))).await;

        // The iommufd directory and its nodes.
        std::fs::create_dir(vfio.join("devices")).unwrap();
        until(&mut fw, &FileEvent::Dev(Change::DevNodes)).await;
        fw.refresh();
        std::fs::write(vfio.join("devices/vfio0"), "").unwrap();
        until(&mut fw, &FileEvent::Dev(Change::DevNodes)).await;

        // /dev/vfio removed, and created again: watched again after a refresh.
        std::fs::remove_dir_all(&vfio).unwrap();
        until(&mut fw, &FileEvent::Dev(Change::Node)).await;
        std::fs::create_dir(&vfio).unwrap();
        until(&mut fw, &FileEvent::Dev(Change::Node)).await;
        fw.refresh();
        std::fs::write(vfio.join("7"), "").unwrap();
        until(&mut fw, &FileEvent::Dev(Change::GroupNode(7))).await;
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
