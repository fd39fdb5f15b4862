//! Kernel uevents: what changed on the node, as the kernel announces it.
//!
//! sysfs emits no inotify events; the kernel announces device changes as uevents on the
//! `NETLINK_KOBJECT_UEVENT` socket's "kernel" group, and udevd re-broadcasts them (after its rules
//! ran) on the "udev" group. [`Monitor`] listens on both through libudev (the `udev` crate): the
//! kernel's group (`MonitorBuilder::new_kernel()`, libudev's
//! `udev_monitor_new_from_netlink(udev, "kernel")`) is heard wherever the kernel runs, with or
//! without udevd (minimal hosts, the VM tier, a pod's own network namespace); udevd's group
//! (`MonitorBuilder::new()`) is where udevd, and node-sim, which no kernel announces, send. A
//! change may so be heard twice; handlers re-read what the event names, which is idempotent.
//! libudev leaves udevd's group unjoined where neither udevd runs (`/run/udev/control`) nor
//! `/dev` is a devtmpfs (a container): there the kernel's group is what there is to hear.
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
//! [`Monitor::start`] joins both groups in the calling thread (so it listens once it returns),
//! then reads them on a thread of its own and calls a handler for each event: from async code,
//! a handler that sends into a tokio channel; from sync code, a std channel.
//!
//! libudev does the socket work: it takes a kernel message only from the kernel (netlink port 0)
//! and a udevd message only from root, parses both forms, and filters by subsystem (on udevd's
//! group in the kernel, with a socket filter). What is written here is what the crate's safe API
//! does not offer: the receive buffer is enlarged (`SO_RCVBUFFORCE` on the monitor's socket, as
//! libudev's `udev_monitor_set_receive_buffer_size` would, which the crate does not wrap), so
//! that a burst (a thousand VFs enabled at once) does not overflow it; an overflow (`ENOBUFS`),
//! which the crate's iterator reports only as the end of the events, is told from `errno`, so
//! that the handler hears that events were lost; and the thread that polls both sockets and
//! stops when the monitor is dropped.

use std::os::fd::{AsFd as _, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{setsockopt, sockopt};

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

/// The receive buffer asked for, as udevd asks (a burst of events, such as a thousand VFs
/// enabled at once, must not overflow it).
const RECEIVE_BUFFER: usize = 128 * 1024 * 1024;

/// One joined group.
struct Group {
    socket: udev::MonitorSocket,
    name: &'static str,
}

/// Joins the kernel's group, or udevd's, keeping the events of `subsystems` (all when empty).
fn join(kernel: bool, subsystems: &[&str]) -> std::io::Result<udev::MonitorSocket> {
    let mut builder = if kernel {
        udev::MonitorBuilder::new_kernel()?
    } else {
        udev::MonitorBuilder::new()?
    };
    for s in subsystems {
        builder = builder.match_subsystem(s)?;
    }
    let socket = builder.listen()?;
    // Forcing the size needs CAP_NET_ADMIN; without it the limit the system allows is taken.
    if setsockopt(&socket.as_fd(), sockopt::RcvBufForce, &RECEIVE_BUFFER).is_err() {
        let _ = setsockopt(&socket.as_fd(), sockopt::RcvBuf, &RECEIVE_BUFFER);
    }
    Ok(socket)
}

/// Joins the kernel's and udevd's groups: those that could be joined, or why neither could.
fn join_groups(subsystems: &[&str]) -> Result<Vec<Group>, MonitorError> {
    let mut groups = Vec::new();
    let mut errors = Vec::new();
    for (kernel, name) in [(true, "kernel"), (false, "udev")] {
        match join(kernel, subsystems) {
            Ok(socket) => groups.push(Group { socket, name }),
            Err(e) => errors.push(format!("{name} group: {e}")),
        }
    }
    if groups.is_empty() {
        return Err(MonitorError::NoSocket(errors.join("; ")));
    }
    for e in &errors {
        tracing::debug!("uevents: {e}");
    }
    Ok(groups)
}

/// The event libudev received, as a [`Uevent`]; `None` without an action or a devpath. Only
/// the event's own properties are read: libudev never looks at this host's `/sys` for them.
fn from_udev(ev: &udev::Event) -> Option<Uevent> {
    let prop = |k: &str| ev.property_value(k).and_then(|v| v.to_str());
    Some(Uevent::new(
        prop("ACTION")?,
        prop("SUBSYSTEM"),
        prop("DEVPATH")?,
        prop("DRIVER"),
    ))
}

/// What reading a socket gave.
enum Read {
    /// An event.
    Event(Uevent),
    /// Nothing more for now (or a message libudev did not take: from a sender it does not
    /// trust, or that its filter drops).
    Drained,
    /// Events were lost: the socket's buffer overflowed.
    Lost,
    /// A message that could not be read (malformed); the next one may be.
    Skipped(Errno),
}

fn read(socket: &udev::MonitorSocket) -> Read {
    // The crate's iterator ends on an error as on an empty socket: libudev's errno tells them
    // apart.
    Errno::clear();
    match socket.iter().next() {
        Some(ev) => from_udev(&ev).map_or(Read::Skipped(Errno::EINVAL), Read::Event),
        None => match Errno::last() {
            Errno::UnknownErrno | Errno::EAGAIN | Errno::EINTR => Read::Drained,
            Errno::ENOBUFS => Read::Lost,
            e => Read::Skipped(e),
        },
    }
}

/// Listens to uevents on a thread until dropped (or until its handler returns `false`).
#[derive(Debug)]
pub struct Monitor {
    /// Closing it wakes the thread, which then ends.
    _stop: OwnedFd,
}

impl Monitor {
    /// Joins the kernel's and udevd's groups and calls `handler`, on a thread of its own, for
    /// each event whose subsystem is one of `subsystems` (an empty list passes everything).
    /// When events were lost (a socket's buffer overflowed), the handler hears an event that
    /// names no device (action `lost`, no subsystem), so that what it reads again is everything.
    /// Listens once it returns: the groups are joined here, the thread only reads them. An
    /// error when neither group can be joined; one group failing is logged at `debug`.
    pub fn start<F>(
        subsystems: &'static [&'static str],
        handler: F,
    ) -> Result<Monitor, MonitorError>
    where
        F: FnMut(Uevent) -> bool + Send + 'static,
    {
        let groups = join_groups(subsystems)?;
        let (stop_read, stop_write) =
            nix::unistd::pipe().map_err(|e| MonitorError::Thread(e.into()))?;
        std::thread::Builder::new()
            .name("uevents".into())
            .spawn(move || listen(handler, groups, stop_read))
            .map_err(MonitorError::Thread)?;
        tracing::debug!("listening to uevents");
        Ok(Monitor { _stop: stop_write })
    }
}

fn listen<F>(mut handler: F, groups: Vec<Group>, stop: OwnedFd)
where
    F: FnMut(Uevent) -> bool,
{
    loop {
        let mut fds: Vec<PollFd> = groups
            .iter()
            .map(|g| PollFd::new(g.socket.as_fd(), PollFlags::POLLIN))
            .collect();
        fds.push(PollFd::new(stop.as_fd(), PollFlags::POLLIN));
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(Errno::EINTR) => continue,
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
        if fds
            .iter()
            .any(|f| f.revents().is_some_and(|r| r.contains(PollFlags::POLLNVAL)))
        {
            tracing::warn!("a uevent socket was closed; no more uevents");
            return;
        }
        drop(fds);
        for g in &groups {
            loop {
                let ev = match read(&g.socket) {
                    Read::Event(ev) => ev,
                    Read::Drained => break,
                    Read::Lost => {
                        tracing::warn!(
                            group = g.name,
                            "uevents were lost: the socket's buffer overflowed"
                        );
                        Uevent::new("lost", None, "", None)
                    }
                    // Read again from the poll: a message is consumed even when it fails.
                    Read::Skipped(e) => {
                        tracing::debug!(group = g.name, error = %e, "a uevent could not be read");
                        break;
                    }
                };
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

    /// Starts a monitor sending into a channel, or `None` (printing why) where none can be had.
    fn monitor(
        subsystems: &'static [&'static str],
    ) -> Option<(Monitor, std::sync::mpsc::Receiver<Uevent>)> {
        let (tx, rx) = std::sync::mpsc::channel();
        match Monitor::start(subsystems, move |ev| tx.send(ev).is_ok()) {
            Ok(m) => Some((m, rx)),
            Err(e) => {
                eprintln!("skipped: {e}");
                None
            }
        }
    }

    /// The first event received within 5 s that `want` accepts; other tests may send too.
    fn find(rx: &std::sync::mpsc::Receiver<Uevent>, want: impl FnMut(&Uevent) -> bool) -> Uevent {
        let wait = std::time::Duration::from_secs(5);
        std::iter::from_fn(|| rx.recv_timeout(wait).ok())
            .find(want)
            .expect("the event within 5 s")
    }

    #[test]
    fn the_monitor_hears_udevds_group_from_its_return_on_and_filters_subsystems() {
        let Some((mon, rx)) = monitor(&["pci"]) else {
            return;
        };
        let pci = "/devices/pci0000:40/0000:40:01.1/0000:41:00.0";
        // Sent at once after the start: heard, as the groups are joined before it returns.
        if let Err(e) = testkit::uevent::send("change", "/devices/virtual/mdev/x", "mdev")
            .and_then(|()| testkit::uevent::send("change", pci, "pci"))
        {
            eprintln!("skipped: cannot send uevents here: {e:#}");
            return;
        }
        // The mdev event never comes through the filter.
        let ev = find(&rx, |e| {
            assert_ne!(e.subsystem.as_deref(), Some("mdev"));
            e.devpath == pci
        });
        assert_eq!(ev.action, "change");
        assert_eq!(ev.subsystem.as_deref(), Some("pci"));
        assert_eq!(ev.subject, Subject::Pci("0000:41:00.0".parse().unwrap()));
        drop(mon);
    }

    #[test]
    fn messages_libudev_cannot_read_are_passed_over() {
        let Some((mon, rx)) = monitor(&["pci"]) else {
            return;
        };
        let devpath = "/devices/pci0000:40/0000:40:01.1/0000:41:00.1";
        let props = |action| {
            [
                ("ACTION", action),
                ("DEVPATH", devpath),
                ("SUBSYSTEM", "pci"),
                ("SEQNUM", "9"),
            ]
        };
        // No SEQNUM, a bad magic, a header alone: none is an event, and the next one still is.
        let no_seqnum = node_sim::udev_message(&props("add")[..3]);
        let mut bad_magic = node_sim::udev_message(&props("add"));
        bad_magic[8] ^= 0xff;
        let header = node_sim::udev_message(&[("SUBSYSTEM", "pci")]);
        let good = node_sim::udev_message(&props("bind"));
        for m in [&no_seqnum, &bad_magic, &header[..40], &good] {
            if let Err(e) = testkit::uevent::broadcast(m) {
                eprintln!("skipped: cannot send uevents here: {e:#}");
                return;
            }
        }
        let ev = find(&rx, |e| e.devpath == devpath);
        assert_eq!(ev.action, "bind");
        drop(mon);
    }

    #[test]
    fn the_monitor_hears_the_kernel_itself() {
        let Some((mon, rx)) = monitor(&["mem"]) else {
            return;
        };
        // A synthetic uevent, as `udevadm trigger` makes one: the kernel sends it on its own
        // group, whether udevd runs or not.
        let trigger = "/sys/devices/virtual/mem/null/uevent";
        if let Err(e) = std::fs::write(trigger, "change") {
            eprintln!("skipped: cannot write {trigger} (root and a writable sysfs needed): {e}");
            return;
        }
        let ev = find(&rx, |e| e.devpath == "/devices/virtual/mem/null");
        assert_eq!(ev.action, "change");
        assert_eq!(ev.subsystem.as_deref(), Some("mem"));
        assert_eq!(ev.subject, Subject::Other);
        drop(mon);
    }

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
