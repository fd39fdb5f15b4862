//! Kernel uevents: what changed on the node, as the kernel announces it.
//!
//! sysfs emits no inotify events; the kernel announces device changes as uevents on the
//! `NETLINK_KOBJECT_UEVENT` socket, and udevd re-broadcasts them (after its rules ran) on the
//! same socket's "udev" group. [`Monitor`] listens on both: the kernel's group is heard where no
//! udevd runs (minimal hosts, the VM tier), udevd's group where only it reaches (and where
//! node-sim sends). A change may so be heard twice; handlers re-read what the event names, which
//! is idempotent.
//!
//! Each event becomes a [`Uevent`]: its action, subsystem, devpath, driver, and the
//! [`Subject`] it names — a PCI function, an mdev, a VFIO group node — so that a reader can
//! re-read that one device instead of the node:
//!
//! | subsystem | devpath | subject |
//! |---|---|---|
//! | `pci` | `/devices/pci0000:40/0000:40:01.1/0000:41:00.0` | `Pci(0000:41:00.0)` |
//! | `mdev` | `/devices/…/0000:41:00.4/<uuid>` | `Mdev(uuid)` |
//! | `vfio` | `/devices/virtual/vfio/42` | `VfioGroup(42)` |
//! | `vfio-dev` | `/devices/…/0000:41:00.0/vfio-dev/vfio0` | `Pci(0000:41:00.0)` (or `Mdev`) |
//! | anything else | | `Other` |
//!
//! [`Monitor::start`] runs the sockets on a thread of their own (libudev's sockets are not
//! `Send`) and calls a handler for each event: from async code, a handler that sends into a
//! tokio channel; from sync code, a std channel.

use std::os::fd::{AsFd as _, OwnedFd};
use std::path::Path;
use std::sync::mpsc;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::pci::PciAddress;

/// What a uevent is about.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Subject {
    /// A PCI function (`pci` events, and `vfio-dev` events of its VFIO cdev).
    Pci(PciAddress),
    /// A mediated device, by lower-case UUID (`mdev` events, and `vfio-dev` of its cdev).
    Mdev(String),
    /// The VFIO group node `/dev/vfio/<group>` (`vfio` events).
    VfioGroup(u32),
    /// Something no single device explains (a driver module, an IOMMU unit, a bridge).
    Other,
}

/// One uevent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uevent {
    /// `add`, `remove`, `bind`, `unbind`, `change`, `move`, …
    pub action: String,
    /// `SUBSYSTEM` (`pci`, `mdev`, `vfio`, `vfio-dev`, …).
    pub subsystem: Option<String>,
    /// `DEVPATH`, relative to `/sys` (`/devices/pci0000:40/…`).
    pub devpath: String,
    /// `DRIVER`, when the event carries one.
    pub driver: Option<String>,
    /// The device it names.
    pub subject: Subject,
}

impl Uevent {
    /// An event from its fields; the subject is derived from the subsystem and devpath.
    pub fn new(
        action: &str,
        subsystem: Option<&str>,
        devpath: &str,
        driver: Option<&str>,
    ) -> Uevent {
        Uevent {
            action: action.to_string(),
            subsystem: subsystem.map(str::to_string),
            devpath: devpath.to_string(),
            driver: driver.map(str::to_string),
            subject: subject(subsystem, devpath),
        }
    }

    fn from_udev(ev: &udev::Event) -> Uevent {
        let s = |o: Option<&std::ffi::OsStr>| o.and_then(|s| s.to_str()).map(str::to_string);
        let devpath = ev.devpath().to_str().unwrap_or_default().to_string();
        let subsystem = s(ev.subsystem());
        let action = ev.property_value("ACTION").and_then(|a| a.to_str());
        Uevent {
            action: action.unwrap_or("unknown").to_string(),
            subject: subject(subsystem.as_deref(), &devpath),
            subsystem,
            devpath,
            driver: s(ev.driver()),
        }
    }
}

/// A lower-case UUID, if `s` is one (`8-4-4-4-12` hex digits): how mdevs are named.
pub(crate) fn parse_uuid(s: &str) -> Option<String> {
    let groups: Vec<&str> = s.split('-').collect();
    let ok = groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()));
    ok.then(|| s.to_ascii_lowercase())
}

fn pci_or_mdev(name: &str) -> Option<Subject> {
    name.parse::<PciAddress>()
        .ok()
        .map(Subject::Pci)
        .or_else(|| parse_uuid(name).map(Subject::Mdev))
}

fn subject(subsystem: Option<&str>, devpath: &str) -> Subject {
    let path = Path::new(devpath);
    let name = |p: &Path| p.file_name().and_then(|n| n.to_str()).map(str::to_string);
    let last = name(path).unwrap_or_default();
    let found = match subsystem {
        Some("pci") => last.parse().ok().map(Subject::Pci),
        Some("mdev") => parse_uuid(&last).map(Subject::Mdev),
        Some("vfio") => last.parse().ok().map(Subject::VfioGroup),
        Some("vfio-dev") => path
            .parent()
            .filter(|p| p.file_name().is_some_and(|n| n == "vfio-dev"))
            .and_then(Path::parent)
            .and_then(name)
            .and_then(|n| pci_or_mdev(&n)),
        _ => None,
    };
    found.unwrap_or(Subject::Other)
}

/// Why no uevents can be heard.
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    /// Neither netlink group could be joined.
    #[error("cannot listen to uevents: {0}")]
    NoSocket(String),
    /// The listening thread could not be started.
    #[error("cannot start the uevent thread")]
    Thread(#[source] std::io::Error),
}

/// Listens to uevents on a thread until dropped (or until its handler returns `false`).
#[derive(Debug)]
pub struct Monitor {
    /// Closing it wakes the thread, which then ends.
    _stop: OwnedFd,
}

impl Monitor {
    /// Joins the kernel's and udevd's groups and calls `handler` for each event whose subsystem
    /// is one of `subsystems` (events without a subsystem are passed too; an empty list passes
    /// everything). Returns once listening, or an error when neither group can be joined
    /// (which is what a process without `CAP_NET_ADMIN` in the host's network namespace
    /// gets); one group failing is logged at `debug`.
    pub fn start<F>(
        subsystems: &'static [&'static str],
        handler: F,
    ) -> Result<Monitor, MonitorError>
    where
        F: FnMut(Uevent) -> bool + Send + 'static,
    {
        Self::spawn(subsystems, handler)?.wait()
    }

    /// [`Monitor::start`] in two steps: the thread starts joining the groups, and
    /// [`Starting::wait`] returns once it listens. Setting up other watches in between takes
    /// their time off the start.
    pub fn spawn<F>(
        subsystems: &'static [&'static str],
        handler: F,
    ) -> Result<Starting, MonitorError>
    where
        F: FnMut(Uevent) -> bool + Send + 'static,
    {
        let (stop_read, stop_write) =
            nix::unistd::pipe().map_err(|e| MonitorError::Thread(e.into()))?;
        let (opened_tx, opened) = mpsc::channel::<Result<(), String>>();
        std::thread::Builder::new()
            .name("uevents".into())
            .spawn(move || listen(subsystems, handler, stop_read, opened_tx))
            .map_err(MonitorError::Thread)?;
        Ok(Starting {
            stop: stop_write,
            opened,
        })
    }
}

/// A [`Monitor`] whose thread is joining the netlink groups.
#[derive(Debug)]
pub struct Starting {
    stop: OwnedFd,
    opened: mpsc::Receiver<Result<(), String>>,
}

impl Starting {
    /// Waits until the monitor listens (events from then on are heard).
    pub fn wait(self) -> Result<Monitor, MonitorError> {
        match self.opened.recv() {
            Ok(Ok(())) => Ok(Monitor { _stop: self.stop }),
            Ok(Err(e)) => Err(MonitorError::NoSocket(e)),
            Err(_) => Err(MonitorError::NoSocket("the uevent thread ended".into())),
        }
    }
}

fn listen<F>(
    subsystems: &[&str],
    mut handler: F,
    stop: OwnedFd,
    opened: mpsc::Sender<Result<(), String>>,
) where
    F: FnMut(Uevent) -> bool,
{
    let mut sockets = Vec::new();
    let mut errors = Vec::new();
    for (kernel, group) in [(true, "kernel"), (false, "udev")] {
        let b = if kernel {
            udev::MonitorBuilder::new_kernel()
        } else {
            udev::MonitorBuilder::new()
        };
        match b.and_then(|b| b.listen()) {
            Ok(s) => sockets.push(s),
            Err(e) => errors.push(format!("{group} group: {e}")),
        }
    }
    if sockets.is_empty() {
        let _ = opened.send(Err(errors.join("; ")));
        return;
    }
    for e in &errors {
        tracing::debug!("uevents: {e}");
    }
    let _ = opened.send(Ok(()));
    tracing::debug!(sockets = sockets.len(), "listening to uevents");
    loop {
        let mut fds: Vec<PollFd> = sockets
            .iter()
            .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN))
            .collect();
        fds.push(PollFd::new(stop.as_fd(), PollFlags::POLLIN));
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "uevent sockets failed; no more uevents");
                return;
            }
        }
        // The stop pipe's write end was closed: the monitor was dropped.
        if fds
            .last()
            .and_then(|f| f.revents())
            .is_some_and(|r| !r.is_empty())
        {
            return;
        }
        drop(fds);
        for socket in &sockets {
            for ev in socket.iter() {
                let relevant = subsystems.is_empty()
                    || ev
                        .subsystem()
                        .and_then(|s| s.to_str())
                        .is_none_or(|s| subsystems.contains(&s));
                if !relevant {
                    continue;
                }
                let ev = Uevent::from_udev(&ev);
                tracing::debug!(
                    action = %ev.action,
                    subsystem = ?ev.subsystem,
                    devpath = %ev.devpath,
                    subject = ?ev.subject,
                    "uevent"
                );
                if !handler(ev) {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subj(subsystem: &str, devpath: &str) -> Subject {
        Uevent::new("add", Some(subsystem), devpath, None).subject
    }

    #[test]
    fn subjects_from_devpaths() {
        let a: PciAddress = "0000:41:00.0".parse().unwrap();
        assert_eq!(
            subj("pci", "/devices/pci0000:40/0000:40:01.1/0000:41:00.0"),
            Subject::Pci(a)
        );
        assert_eq!(
            subj(
                "mdev",
                "/devices/pci0000:60/0000:60:01.1/0000:61:00.4/5A3B2C1D-0000-4000-8000-000000000001"
            ),
            Subject::Mdev("5a3b2c1d-0000-4000-8000-000000000001".into())
        );
        assert_eq!(
            subj("vfio", "/devices/virtual/vfio/42"),
            Subject::VfioGroup(42)
        );
        assert_eq!(
            subj(
                "vfio-dev",
                "/devices/pci0000:40/0000:40:01.1/0000:41:00.0/vfio-dev/vfio3"
            ),
            Subject::Pci(a)
        );
        assert_eq!(
            subj(
                "vfio-dev",
                "/devices/virtual/mtty/mtty/83b8f4f2-509f-382f-3c1e-e6bfe0fa1001/vfio-dev/vfio0"
            ),
            Subject::Mdev("83b8f4f2-509f-382f-3c1e-e6bfe0fa1001".into())
        );
        // The container node, a driver, an IOMMU unit, a bridge's odd name: nothing to name.
        assert_eq!(subj("misc", "/devices/virtual/misc/vfio"), Subject::Other);
        assert_eq!(subj("vfio", "/devices/virtual/vfio/vfio"), Subject::Other);
        assert_eq!(subj("drivers", "/bus/pci/drivers/vfio-pci"), Subject::Other);
        assert_eq!(
            subj("iommu", "/devices/virtual/iommu/dmar0"),
            Subject::Other
        );
        assert_eq!(subj("pci", "/devices/pci0000:40"), Subject::Other);
        assert_eq!(subj("mdev", "/devices/x/not-a-uuid"), Subject::Other);
        assert_eq!(
            Uevent::new(
                "bind",
                None,
                "/devices/pci0000:40/0000:40:01.1/0000:41:00.0",
                None
            )
            .subject,
            Subject::Other
        );
    }
}
