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
//! [`Monitor::start`] joins both groups in the calling thread (so it listens once it returns),
//! then reads them on a thread of its own and calls a handler for each event: from async code,
//! a handler that sends into a tokio channel; from sync code, a std channel.
//!
//! The sockets are read here, not through libudev: a kernel message (`ACTION@DEVPATH\0` then
//! `KEY=VALUE\0` properties) is taken only from the kernel (netlink port 0), a udevd message
//! (libudev's header, magic `0xfeedcafe`, then the properties) only from a sender whose
//! credentials say root, as libudev takes them.

use std::io::IoSliceMut;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{
    AddressFamily, ControlMessageOwned, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
    UnixCredentials, bind, recvmsg, setsockopt, socket, sockopt,
};

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

/// The kernel's netlink multicast group.
const KERNEL_GROUP: u32 = 1;
/// udevd's group, where it re-broadcasts events after its rules ran.
const UDEV_GROUP: u32 = 2;
/// libudev's message prefix and magic (`UDEV_MONITOR_MAGIC`, big-endian on the wire).
const UDEV_PREFIX: &[u8; 8] = b"libudev\0";
const UDEV_MAGIC: u32 = 0xfeed_cafe;
/// The largest message read; the kernel's are at most 2 KiB, udevd's at most 8 KiB.
const MAX_MESSAGE: usize = 16 * 1024;
/// The receive buffer asked for, as udevd and libudev ask (a burst of events, such as a
/// thousand VFs enabled at once, must not overflow it).
const RECEIVE_BUFFER: usize = 128 * 1024 * 1024;

/// One joined netlink group.
#[derive(Debug)]
struct Group {
    fd: OwnedFd,
    kernel: bool,
}

/// Joins `group` on a new non-blocking `NETLINK_KOBJECT_UEVENT` socket.
fn join(group: u32) -> nix::Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        SockProtocol::NetlinkKObjectUEvent,
    )?;
    // Forcing the size needs CAP_NET_ADMIN; without it the limit the system allows is taken.
    if setsockopt(&fd, sockopt::RcvBufForce, &RECEIVE_BUFFER).is_err() {
        let _ = setsockopt(&fd, sockopt::RcvBuf, &RECEIVE_BUFFER);
    }
    setsockopt(&fd, sockopt::PassCred, &true)?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, group))?;
    Ok(fd)
}

/// Joins the kernel's and udevd's groups: those that could be joined, or why neither could.
fn join_groups() -> Result<Vec<Group>, MonitorError> {
    let mut groups = Vec::new();
    let mut errors = Vec::new();
    for (kernel, group, name) in [(true, KERNEL_GROUP, "kernel"), (false, UDEV_GROUP, "udev")] {
        match join(group) {
            Ok(fd) => groups.push(Group { fd, kernel }),
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

/// Reads one message from a group: `Ok(None)` for a message that is not taken (a kernel
/// message from a process, a udevd message from a sender that is not root, a truncated or
/// malformed one); `Err(EAGAIN)` when none is waiting.
fn receive(g: &Group, buf: &mut [u8]) -> nix::Result<Option<Uevent>> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!(UnixCredentials);
    let msg = recvmsg::<NetlinkAddr>(
        g.fd.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_DONTWAIT,
    )?;
    let len = msg.bytes;
    let truncated = msg.flags.contains(MsgFlags::MSG_TRUNC);
    let sender = msg.address.map(|a| a.pid());
    let uid = msg.cmsgs().ok().and_then(|mut c| {
        c.find_map(|c| match c {
            ControlMessageOwned::ScmCredentials(u) => Some(u.uid()),
            _ => None,
        })
    });
    if truncated {
        return Ok(None);
    }
    let trusted = if g.kernel {
        sender == Some(0)
    } else {
        uid == Some(0)
    };
    if !trusted {
        return Ok(None);
    }
    Ok(buf.get(..len).and_then(|m| parse(m, g.kernel)))
}

/// The event in one message: the kernel's form, or udevd's (libudev's header).
pub(crate) fn parse(msg: &[u8], kernel: bool) -> Option<Uevent> {
    let props = if kernel {
        // `ACTION@DEVPATH`, then the properties.
        let head = msg.iter().position(|&b| b == 0)?;
        if !msg[..head].contains(&b'@') {
            return None;
        }
        msg.get(head + 1..)?
    } else {
        if msg.get(..8)? != UDEV_PREFIX {
            return None;
        }
        let word = |at: usize| -> Option<[u8; 4]> { msg.get(at..at + 4)?.try_into().ok() };
        if u32::from_be_bytes(word(8)?) != UDEV_MAGIC {
            return None;
        }
        let off = u32::from_ne_bytes(word(16)?) as usize;
        let len = u32::from_ne_bytes(word(20)?) as usize;
        msg.get(off..off.checked_add(len)?)?
    };
    let (mut action, mut devpath, mut subsystem, mut driver) = (None, None, None, None);
    for kv in props.split(|&b| b == 0) {
        let Some(eq) = kv.iter().position(|&b| b == b'=') else {
            continue;
        };
        let Ok(v) = std::str::from_utf8(&kv[eq + 1..]) else {
            continue;
        };
        match &kv[..eq] {
            b"ACTION" => action = Some(v),
            b"DEVPATH" => devpath = Some(v),
            b"SUBSYSTEM" => subsystem = Some(v),
            b"DRIVER" => driver = Some(v),
            _ => {}
        }
    }
    Some(Uevent::new(action?, subsystem, devpath?, driver))
}

/// Listens to uevents on a thread until dropped (or until its handler returns `false`).
#[derive(Debug)]
pub struct Monitor {
    /// Closing it wakes the thread, which then ends.
    _stop: OwnedFd,
}

impl Monitor {
    /// Joins the kernel's and udevd's groups and calls `handler`, on a thread of its own, for
    /// each event whose subsystem is one of `subsystems` (events without a subsystem are
    /// passed too; an empty list passes everything). Listens once it returns: the groups are
    /// joined here, the thread only reads them. An error when neither group can be joined
    /// (which is what a process without `CAP_NET_ADMIN` in the host's network namespace
    /// gets); one group failing is logged at `debug`.
    pub fn start<F>(
        subsystems: &'static [&'static str],
        handler: F,
    ) -> Result<Monitor, MonitorError>
    where
        F: FnMut(Uevent) -> bool + Send + 'static,
    {
        let groups = join_groups()?;
        let (stop_read, stop_write) =
            nix::unistd::pipe().map_err(|e| MonitorError::Thread(e.into()))?;
        std::thread::Builder::new()
            .name("uevents".into())
            .spawn(move || listen(subsystems, handler, groups, stop_read))
            .map_err(MonitorError::Thread)?;
        tracing::debug!("listening to uevents");
        Ok(Monitor { _stop: stop_write })
    }
}

fn listen<F>(subsystems: &[&str], mut handler: F, groups: Vec<Group>, stop: OwnedFd)
where
    F: FnMut(Uevent) -> bool,
{
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut fds: Vec<PollFd> = groups
            .iter()
            .map(|g| PollFd::new(g.fd.as_fd(), PollFlags::POLLIN))
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
        drop(fds);
        for g in &groups {
            loop {
                let ev = match receive(g, &mut buf) {
                    Ok(Some(ev)) => ev,
                    Ok(None) => continue,
                    Err(Errno::EAGAIN) => break,
                    Err(Errno::EINTR) => continue,
                    // ENOBUFS: the socket overflowed and events were lost. The handler hears
                    // an event that names no device (action `lost`, no subsystem), so that
                    // what it reads again is everything.
                    Err(Errno::ENOBUFS) => {
                        tracing::warn!("uevents were lost: the socket's buffer overflowed");
                        Uevent::new("lost", None, "", None)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "uevent socket failed; no more uevents");
                        return;
                    }
                };
                let relevant = subsystems.is_empty()
                    || ev
                        .subsystem
                        .as_deref()
                        .is_none_or(|s| subsystems.contains(&s));
                if !relevant {
                    continue;
                }
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

    /// A udevd message as libudev writes it: prefix, magic, header size, properties' offset
    /// and length, then the properties.
    fn udevd(props: &[(&str, &str)]) -> Vec<u8> {
        let body: Vec<u8> = props
            .iter()
            .flat_map(|(k, v)| format!("{k}={v}\0").into_bytes())
            .collect();
        let mut m = b"libudev\0".to_vec();
        m.extend_from_slice(&UDEV_MAGIC.to_be_bytes());
        for v in [40u32, 40, body.len() as u32] {
            m.extend_from_slice(&v.to_ne_bytes());
        }
        m.extend_from_slice(&[0; 16]);
        m.extend_from_slice(&body);
        m
    }

    #[test]
    fn kernel_and_udevd_messages_parse_to_the_same_event() {
        let devpath = "/devices/pci0000:40/0000:40:01.1/0000:41:00.0";
        let kernel = format!(
            "bind@{devpath}\0ACTION=bind\0DEVPATH={devpath}\0SUBSYSTEM=pci\0DRIVER=vfio-pci\0SEQNUM=7\0"
        );
        let want = Uevent::new("bind", Some("pci"), devpath, Some("vfio-pci"));
        assert_eq!(parse(kernel.as_bytes(), true), Some(want.clone()));
        let m = udevd(&[
            ("ACTION", "bind"),
            ("DEVPATH", devpath),
            ("SUBSYSTEM", "pci"),
            ("DRIVER", "vfio-pci"),
            ("SEQNUM", "7"),
        ]);
        assert_eq!(parse(&m, false), Some(want));
        // Without a subsystem or driver.
        let m = udevd(&[
            ("ACTION", "remove"),
            ("DEVPATH", "/devices/virtual/vfio/42"),
        ]);
        assert_eq!(
            parse(&m, false).map(|e| (e.action, e.subsystem, e.subject)),
            Some(("remove".into(), None, Subject::Other))
        );
    }

    #[test]
    fn the_monitor_hears_udevds_group_from_its_return_on_and_filters_subsystems() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mon = match Monitor::start(&["pci"], move |ev| tx.send(ev).is_ok()) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("skipped: {e}");
                return;
            }
        };
        let pci = "/devices/pci0000:40/0000:40:01.1/0000:41:00.0";
        // Sent at once after the start: heard, as the groups are joined before it returns.
        if let Err(e) = testkit::uevent::send("change", "/devices/virtual/mdev/x", "mdev")
            .and_then(|()| testkit::uevent::send("change", pci, "pci"))
        {
            eprintln!("skipped: cannot send uevents here: {e:#}");
            return;
        }
        let wait = std::time::Duration::from_secs(5);
        // Other tests may send too: find ours; the mdev event never comes through the filter.
        let ev = std::iter::from_fn(|| rx.recv_timeout(wait).ok())
            .inspect(|e| assert_ne!(e.subsystem.as_deref(), Some("mdev")))
            .find(|e| e.devpath == pci)
            .expect("the pci event");
        assert_eq!(ev.action, "change");
        assert_eq!(ev.subject, Subject::Pci("0000:41:00.0".parse().unwrap()));
        drop(mon);
    }

    #[test]
    fn malformed_messages_are_not_events() {
        let devpath = "/devices/virtual/vfio/42";
        // The kernel's form on udevd's group, udevd's on the kernel's.
        let kernel = format!("add@{devpath}\0ACTION=add\0DEVPATH={devpath}\0");
        assert_eq!(parse(kernel.as_bytes(), false), None);
        assert_eq!(
            parse(&udevd(&[("ACTION", "add"), ("DEVPATH", devpath)]), true),
            None
        );
        // No ACTION, no DEVPATH, no `@` header, a bad magic, properties past the end.
        assert_eq!(
            parse(
                format!("add@{devpath}\0DEVPATH={devpath}\0").as_bytes(),
                true
            ),
            None
        );
        assert_eq!(parse(b"add@/x\0ACTION=add\0", true), None);
        assert_eq!(parse(b"ACTION=add\0DEVPATH=/x\0", true), None);
        let mut m = udevd(&[("ACTION", "add"), ("DEVPATH", devpath)]);
        m[8] ^= 0xff;
        assert_eq!(parse(&m, false), None);
        let mut m = udevd(&[("ACTION", "add"), ("DEVPATH", devpath)]);
        m[20..24].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert_eq!(parse(&m, false), None);
        assert_eq!(parse(b"libudev\0", false), None);
        assert_eq!(parse(b"", true), None);
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
