//! Uevents sent as udevd re-broadcasts them (libudev's format, netlink group 2), for tests of
//! daemons against plain trees, where no kernel announces the changes a test makes. Sending
//! needs `CAP_NET_ADMIN` (root).

use std::os::fd::AsRawFd as _;

use anyhow::Context as _;
use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, sendto, socket,
};

/// Broadcasts one event: `ACTION`, `DEVPATH` (below `/sys`: `/devices/pci0000:00/…`),
/// `SUBSYSTEM`.
pub fn send(action: &str, devpath: &str, subsystem: &str) -> anyhow::Result<()> {
    let props = format!("ACTION={action}\0DEVPATH={devpath}\0SUBSYSTEM={subsystem}\0SEQNUM=1\0");
    let mut msg = b"libudev\0".to_vec();
    msg.extend_from_slice(&0xfeed_cafe_u32.to_be_bytes()); // magic
    // Header size, properties offset and length, then filter hashes (none).
    for v in [40u32, 40, props.len() as u32, 0, 0, 0, 0] {
        msg.extend_from_slice(&v.to_ne_bytes());
    }
    msg.extend_from_slice(props.as_bytes());
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
        &msg,
        &NetlinkAddr::new(0, 2),
        MsgFlags::empty(),
    )
    .with_context(|| format!("sending {action} {devpath}"))?;
    Ok(())
}
