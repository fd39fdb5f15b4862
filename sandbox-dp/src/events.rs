//! Change events: udev netlink (kernel and udev groups), `notify` on `/dev/vfio` and the plugin
//! directory. Each source only signals "something may have changed"; the caller debounces and
//! re-reads the inventory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, watch};

use crate::plugin::KUBELET_SOCKET;

/// Uevent subsystems that can change what sandbox-dp advertises (events without a subsystem
/// count too).
const RELEVANT_SUBSYSTEMS: &[&str] = &[
    "pci", "mdev", "vfio", "vfio-dev", "iommu", "mdev_bus", "drivers",
];

/// Starts a thread listening to uevents on both netlink groups (the kernel's and udevd's).
/// Failing to open either is logged, not fatal: `notify` and the resync still run.
pub fn spawn_udev(changes: Arc<Notify>) {
    let spawned = std::thread::Builder::new()
        .name("udev".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::warn!(error = %e, "no udev listener: cannot build its runtime");
                    return;
                }
            };
            rt.block_on(listen(changes));
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no udev listener: cannot start its thread");
    }
}

fn open(kernel: bool) -> std::io::Result<udev::MonitorSocket> {
    let b = if kernel {
        udev::MonitorBuilder::new_kernel()?
    } else {
        udev::MonitorBuilder::new()?
    };
    b.listen()
}

async fn listen(changes: Arc<Notify>) {
    let mut fds = Vec::new();
    for (kernel, group) in [(true, "kernel"), (false, "udev")] {
        // `AsyncFd::new` is deprecated for types whose fd could be closed behind its back; the
        // AsyncFd owns the socket here, so the fd lives exactly as long as the registration.
        #[allow(deprecated)]
        let fd = open(kernel).and_then(AsyncFd::new);
        match fd {
            Ok(fd) => fds.push(fd),
            Err(e) => tracing::warn!(group, error = %e, "cannot listen to uevents"),
        }
    }
    if fds.is_empty() {
        return;
    }
    tracing::debug!(sockets = fds.len(), "listening to uevents");
    loop {
        let ready = futures::future::select_all(fds.iter().map(|fd| Box::pin(fd.readable()))).await;
        let (res, idx, _) = ready;
        let mut guard = match res {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(error = %e, "uevent socket failed; stopped listening");
                return;
            }
        };
        let mut any = false;
        for ev in guard.get_inner().iter() {
            let relevant = ev
                .subsystem()
                .and_then(|s| s.to_str())
                .is_none_or(|s| RELEVANT_SUBSYSTEMS.contains(&s));
            if !relevant {
                continue;
            }
            tracing::debug!(
                socket = idx,
                action = ?ev.event_type(),
                subsystem = ?ev.subsystem(),
                path = %ev.syspath().display(),
                "uevent"
            );
            any = true;
        }
        guard.clear_ready();
        if any {
            changes.notify_one();
        }
    }
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
    /// created) and `dev_vfio` (signalling `changes`); `dev` is watched so that `dev_vfio`
    /// appearing later is seen.
    pub fn start(
        kubelet_dir: &Path,
        dev: &Path,
        dev_vfio: &Path,
        changes: Arc<Notify>,
        wake: Arc<watch::Sender<u64>>,
        kubelet_generation: Arc<AtomicU64>,
    ) -> anyhow::Result<FileWatch> {
        let kdir = kubelet_dir.to_path_buf();
        let mut watcher =
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
                let ev = match res {
                    Ok(ev) => ev,
                    Err(e) => {
                        tracing::warn!(error = %e, "file watch error");
                        changes.notify_one();
                        wake.send_modify(|c| *c += 1);
                        return;
                    }
                };
                // Our own reads open these directories: access events would loop.
                if matches!(ev.kind, EventKind::Access(_)) {
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
                } else {
                    tracing::debug!(kind = ?ev.kind, paths = ?ev.paths, "device node event");
                    changes.notify_one();
                }
            })?;
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
