//! Uevents sent as udevd re-broadcasts them (libudev's format, node-sim's encoding, on udevd's
//! netlink group), for tests of daemons against plain trees, where no kernel announces the
//! changes a test makes. Sending needs `CAP_NET_ADMIN` (root).

use std::os::fd::AsRawFd as _;

use anyhow::Context as _;
use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, sendto, socket,
};

/// Broadcasts one event: `ACTION`, `DEVPATH` (below `/sys`: `/devices/pci0000:00/…`),
/// `SUBSYSTEM`.
pub fn send(action: &str, devpath: &str, subsystem: &str) -> anyhow::Result<()> {
    let msg = node_sim::udev_message(&[
        ("ACTION", action),
        ("DEVPATH", devpath),
        ("SUBSYSTEM", subsystem),
        ("SEQNUM", "1"),
    ]);
    broadcast(&msg).with_context(|| format!("sending {action} {devpath}"))
}

/// Broadcasts one message, as it is, on udevd's group.
pub fn broadcast(msg: &[u8]) -> anyhow::Result<()> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkKObjectUEvent,
    )
    .context("opening a NETLINK_KOBJECT_UEVENT socket")?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).context("binding the netlink socket")?;
    sendto(
        fd.as_raw_fd(),
        msg,
        &NetlinkAddr::new(0, node_sim::UDEV_GROUP),
        MsgFlags::empty(),
    )
    .context("sending to udevd's group")?;
    Ok(())
}
