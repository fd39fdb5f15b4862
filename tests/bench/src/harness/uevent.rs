//! The uevent the kernel (through udevd) would send for a change made by hand on the plain tree.
//!
//! A plain tree emits no uevents: a daemon hears of a removed `/dev/vfio/<g>` through inotify,
//! but of a changed device only through the event. This sends it as udevd re-broadcasts the
//! kernel's: a libudev-format message on the NETLINK_KOBJECT_UEVENT "udev" group (2), which
//! `udev::MonitorBuilder::new()` listens to, with the properties the kernel sends (`ACTION`,
//! `DEVPATH`, `SUBSYSTEM`, the device's `uevent` file, `SEQNUM`). node-sim sends the same on its
//! writes. Sending to the group needs CAP_NET_ADMIN.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use anyhow::{Context, Result, anyhow};
use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, sendto, socket,
};

/// The udev multicast group.
const UDEV_GROUP: u32 = 2;
/// `UDEV_MONITOR_MAGIC` of libudev/sd-device.
const MAGIC: u32 = 0xfeed_cafe;
/// Size of libudev's `monitor_netlink_header`.
const HEADER_SIZE: usize = 40;

/// Sends uevents to the udev group.
#[derive(Debug)]
pub struct UeventSender {
    fd: OwnedFd,
    seq: u64,
}

impl UeventSender {
    /// A socket that may send to the udev group.
    pub fn new() -> Result<UeventSender> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkKObjectUEvent,
        )
        .context("opening a NETLINK_KOBJECT_UEVENT socket")?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).context("binding the uevent socket")?;
        // Apart from node-sim's numbers, which start at 1.
        Ok(UeventSender { fd, seq: 1 << 20 })
    }

    /// Sends `action` for the device at `dev` (a directory, or a link to one, under
    /// `root/sys`).
    pub fn send(&mut self, root: &Path, dev: &Path, action: &str) -> Result<()> {
        self.seq += 1;
        let props = properties(root, dev, action, self.seq)?;
        sendto(
            self.fd.as_raw_fd(),
            &encode(&props),
            &NetlinkAddr::new(0, UDEV_GROUP),
            MsgFlags::empty(),
        )
        .with_context(|| format!("sending a uevent for {}", dev.display()))?;
        Ok(())
    }
}

/// The kernel's properties of an event on the device at `dev`: `ACTION`, `DEVPATH` (its
/// directory under `sys`), `SUBSYSTEM` (its `subsystem` link's name), the lines of its `uevent`
/// file, `SEQNUM`.
pub fn properties(
    root: &Path,
    dev: &Path,
    action: &str,
    seq: u64,
) -> Result<Vec<(String, String)>> {
    let sys = root
        .join("sys")
        .canonicalize()
        .with_context(|| format!("resolving {}/sys", root.display()))?;
    let dir = dev
        .canonicalize()
        .with_context(|| format!("resolving {}", dev.display()))?;
    let devpath = dir
        .strip_prefix(&sys)
        .map_err(|_| anyhow!("{} is not under {}", dir.display(), sys.display()))?;
    let subsystem = std::fs::read_link(dir.join("subsystem"))
        .ok()
        .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()))
        .ok_or_else(|| anyhow!("{}: no subsystem link", dir.display()))?;
    let uevent = std::fs::read_to_string(dir.join("uevent"))
        .with_context(|| format!("reading {}/uevent", dir.display()))?;
    let mut p = vec![
        ("ACTION".to_string(), action.to_string()),
        ("DEVPATH".to_string(), format!("/{}", devpath.display())),
        ("SUBSYSTEM".to_string(), subsystem),
    ];
    p.extend(
        uevent
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    p.push(("SEQNUM".to_string(), seq.to_string()));
    Ok(p)
}

/// A libudev monitor message: the 40-byte header, then `KEY=VALUE\0` properties.
pub fn encode(props: &[(String, String)]) -> Vec<u8> {
    let mut body = Vec::new();
    for (k, v) in props {
        body.extend_from_slice(k.as_bytes());
        body.push(b'=');
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    let subsystem = props
        .iter()
        .find(|(k, _)| k == "SUBSYSTEM")
        .map(|(_, v)| v.as_str())
        .unwrap_or("");
    let mut m = Vec::with_capacity(HEADER_SIZE + body.len());
    m.extend_from_slice(b"libudev\0");
    m.extend_from_slice(&MAGIC.to_be_bytes());
    m.extend_from_slice(&(HEADER_SIZE as u32).to_ne_bytes()); // header_size
    m.extend_from_slice(&(HEADER_SIZE as u32).to_ne_bytes()); // properties_off
    m.extend_from_slice(&(body.len() as u32).to_ne_bytes()); // properties_len
    // The hash libudev's socket filter compares when a monitor matches subsystems.
    m.extend_from_slice(&murmur2(subsystem.as_bytes()).to_be_bytes());
    m.extend_from_slice(&0u32.to_be_bytes()); // devtype hash: no devtype
    m.extend_from_slice(&0u32.to_be_bytes()); // tag bloom, high
    m.extend_from_slice(&0u32.to_be_bytes()); // tag bloom, low
    m.extend_from_slice(&body);
    m
}

/// MurmurHash2 with seed 0, as libudev hashes the subsystem.
fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    let mut h = data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]).wrapping_mul(M);
        k ^= k >> 24;
        h = h.wrapping_mul(M) ^ k.wrapping_mul(M);
    }
    let rest = chunks.remainder();
    for (i, b) in rest.iter().enumerate().rev() {
        h ^= u32::from(*b) << (8 * i);
    }
    if !rest.is_empty() {
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^ (h >> 15)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_are_the_kernels() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let dir = root.join("sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
        std::os::unix::fs::symlink("../../../bus/pci", dir.join("subsystem")).unwrap();
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:40/0000:40:01.1/0000:41:00.4",
            root.join("sys/bus/pci/devices/0000:41:00.4"),
        )
        .unwrap();
        std::fs::write(
            dir.join("uevent"),
            "DRIVER=nvidia\nPCI_SLOT_NAME=0000:41:00.4\n",
        )
        .unwrap();
        let p = properties(
            root,
            &root.join("sys/bus/pci/devices/0000:41:00.4"),
            "change",
            9,
        )
        .unwrap();
        let p: Vec<String> = p.iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert_eq!(
            p,
            [
                "ACTION=change",
                "DEVPATH=/devices/pci0000:40/0000:40:01.1/0000:41:00.4",
                "SUBSYSTEM=pci",
                "DRIVER=nvidia",
                "PCI_SLOT_NAME=0000:41:00.4",
                "SEQNUM=9"
            ]
        );
    }

    #[test]
    fn message_has_the_libudev_header() {
        let props = vec![
            ("ACTION".to_string(), "change".to_string()),
            ("SUBSYSTEM".to_string(), "pci".to_string()),
        ];
        let m = encode(&props);
        assert_eq!(&m[..8], b"libudev\0");
        assert_eq!(&m[8..12], &[0xfe, 0xed, 0xca, 0xfe]);
        assert_eq!(&m[HEADER_SIZE..], b"ACTION=change\0SUBSYSTEM=pci\0");
        assert_eq!(u32::from_ne_bytes([m[20], m[21], m[22], m[23]]), 28);
        assert_eq!(&m[24..28], &0x5916_3b92u32.to_be_bytes());
    }

    #[test]
    fn murmur2_matches_the_reference() {
        // MurmurHash2 (Austin Appleby), seed 0.
        assert_eq!(murmur2(b""), 0);
        assert_eq!(murmur2(b"pci"), 0x5916_3b92);
        assert_eq!(murmur2(b"mdev"), 0xbb52_11c7);
        assert_eq!(murmur2(b"vfio-dev"), 0x573b_34c1);
    }
}
