//! Uevents for kernel-like changes. In node-sim's own network namespace they are sent as
//! libudev-format messages on the NETLINK_KOBJECT_UEVENT "udev" multicast group (2), the group
//! `udev::MonitorBuilder::new()` listens on, where udevd re-broadcasts the kernel's events after
//! processing them: the kernel's own group there would also reach the host's udevd, which would
//! act on devices that do not exist. In every other network namespace they reach the kernel's
//! group (1), as the kernel's own events do ([`Namespaces`]).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, sendto, socket,
};

use crate::state::{Dev, Mdev};

/// A kernel-like change, broadcast as a uevent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Uevent {
    pub action: &'static str,
    /// Relative to the sim's sys (`/devices/pci0000:40/...`).
    pub devpath: String,
    pub subsystem: &'static str,
    pub driver: Option<String>,
    pub extra: Vec<(String, String)>,
}

impl Uevent {
    /// A PCI function's event.
    pub fn pci(action: &'static str, d: &Dev) -> Uevent {
        Uevent {
            action,
            devpath: devpath(&d.dir()),
            subsystem: "pci",
            driver: d.driver.clone(),
            extra: vec![
                ("PCI_CLASS".into(), format!("{:X}", d.class)),
                (
                    "PCI_ID".into(),
                    format!("{:04X}:{:04X}", d.vendor, d.device),
                ),
                (
                    "PCI_SUBSYS_ID".into(),
                    format!("{:04X}:{:04X}", d.subsystem_vendor, d.subsystem_device),
                ),
                ("PCI_SLOT_NAME".into(), d.addr.clone()),
                ("MODALIAS".into(), d.modalias()),
            ],
        }
    }

    /// An mdev's event; `parent` is the device it sits under.
    pub fn mdev(action: &'static str, parent: &Dev, m: &Mdev) -> Uevent {
        Uevent {
            action,
            devpath: devpath(&format!("{}/{}", parent.dir(), m.uuid)),
            subsystem: "mdev",
            driver: (action != "remove").then(|| "vfio_mdev".to_string()),
            extra: vec![("MDEV_TYPE".into(), format!("nvidia-{}", m.type_id))],
        }
    }
}

/// A tree path's DEVPATH: relative to the sim's `sys`.
fn devpath(dir: &str) -> String {
    dir.strip_prefix("sys").unwrap_or(dir).to_string()
}

/// udevd's multicast group, where node-sim sends.
pub const UDEV_GROUP: u32 = 2;
/// `UDEV_MONITOR_MAGIC` of libudev/sd-device.
const MAGIC: u32 = 0xfeed_cafe;
/// Size of libudev's `monitor_netlink_header`.
const HEADER_SIZE: usize = 40;

/// Broadcasts uevents: in node-sim's own network namespace and, as the kernel does, in every
/// other one on the machine ([`Namespaces`]), so a daemon in a pod without `hostNetwork` (the
/// cluster tier's) hears the simulated node as it would hear a real one.
#[derive(Debug)]
pub(crate) struct UeventSender {
    fd: OwnedFd,
    seq: AtomicU64,
    others: Mutex<Namespaces>,
}

/// A sending socket in each network namespace other than node-sim's, found under `/proc`.
///
/// The kernel broadcasts a uevent to the netlink sockets of every network namespace owned by
/// the initial user namespace (lib/kobject_uevent.c), on its own group; udevd re-broadcasts it
/// in its namespace only. A message node-sim sends reaches its own namespace only. It
/// therefore also sends from a socket opened inside each other namespace (`setns` on a thread of
/// its own; needs CAP_SYS_ADMIN, else only its own namespace hears it), and there hands the
/// event to the kernel, which broadcasts it on its group from port 0 as one of its own (uevent
/// injection, `uevent_net_rcv`, Linux 4.18): what a daemon in a pod hears of a real node, and
/// all libudev lets it hear there (it leaves udevd's group unjoined where neither udevd's
/// control socket nor a devtmpfs `/dev` is). The list is read again before a batch of events
/// once [`RESCAN`] has passed, and a namespace gone from `/proc` is let go (its socket would
/// keep it alive).
#[derive(Debug, Default)]
struct Namespaces {
    sockets: HashMap<u64, OwnedFd>,
    scanned: Option<Instant>,
}

/// How long a list of network namespaces is trusted before a batch of events.
const RESCAN: Duration = Duration::from_millis(250);

impl Namespaces {
    fn rescan(&mut self) {
        if self.scanned.is_some_and(|t| t.elapsed() < RESCAN) {
            return;
        }
        self.scanned = Some(Instant::now());
        let own = std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).ok();
        let mut found: HashMap<u64, PathBuf> = HashMap::new();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let ns = e.path().join("ns/net");
            if let Ok(m) = std::fs::metadata(&ns)
                && Some(m.ino()) != own
            {
                found.entry(m.ino()).or_insert(ns);
            }
        }
        self.sockets.retain(|ino, _| found.contains_key(ino));
        for (ino, ns) in found {
            if let std::collections::hash_map::Entry::Vacant(v) = self.sockets.entry(ino) {
                match socket_in(&ns) {
                    Ok(fd) => {
                        v.insert(fd);
                    }
                    Err(e) => tracing::debug!(ns = %ns.display(), "no uevents there: {e}"),
                }
            }
        }
    }
}

/// A netlink uevent socket opened inside the network namespace `ns` (`/proc/<pid>/ns/net`).
fn socket_in(ns: &Path) -> std::io::Result<OwnedFd> {
    let file = std::fs::File::open(ns)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            setns(&file, CloneFlags::CLONE_NEWNET)?;
            let fd = netlink_socket()?;
            Ok(fd)
        })
        .join()
        .unwrap_or_else(|_| {
            Err(std::io::Error::other(
                "the thread opening the socket panicked",
            ))
        })
    })
}

/// A `NETLINK_KOBJECT_UEVENT` socket that can send, bound to no group.
fn netlink_socket() -> nix::Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkKObjectUEvent,
    )?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))?;
    Ok(fd)
}

impl UeventSender {
    /// A socket that can send to the udev group, or `None` (with a log line) when this process
    /// may not (it needs CAP_NET_ADMIN).
    pub fn new() -> Option<UeventSender> {
        let fd = match netlink_socket() {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!("no uevents: cannot open a NETLINK_KOBJECT_UEVENT socket: {e}");
                return None;
            }
        };
        Some(UeventSender {
            fd,
            seq: AtomicU64::new(1),
            others: Mutex::new(Namespaces::default()),
        })
    }

    /// Sends `events` in order, in every network namespace; failures are logged, never fatal
    /// (nobody may be listening).
    pub fn send(&self, events: &[Uevent]) {
        if events.is_empty() {
            return;
        }
        let mut others = self.others.lock().unwrap_or_else(|p| p.into_inner());
        others.rescan();
        for e in events {
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            let udevd = (&self.fd, encode(e, seq), NetlinkAddr::new(0, UDEV_GROUP));
            let injection = injection(e, seq);
            let kernel = others
                .sockets
                .values()
                .map(|fd| (fd, injection.clone(), NetlinkAddr::new(0, 0)));
            for (fd, msg, to) in std::iter::once(udevd).chain(kernel) {
                if let Err(err) = sendto(fd.as_raw_fd(), &msg, &to, MsgFlags::empty()) {
                    // ECONNREFUSED/ESRCH: no listener in the group.
                    tracing::trace!(devpath = %e.devpath, "uevent not sent: {err}");
                }
            }
        }
    }
}

/// The properties of an event, `KEY=VALUE` pairs in order.
pub(crate) fn properties(e: &Uevent, seq: u64) -> Vec<(String, String)> {
    let mut p = vec![
        ("ACTION".to_string(), e.action.to_string()),
        ("DEVPATH".to_string(), e.devpath.clone()),
        ("SUBSYSTEM".to_string(), e.subsystem.to_string()),
    ];
    if let Some(d) = &e.driver {
        p.push(("DRIVER".to_string(), d.clone()));
    }
    p.extend(e.extra.iter().cloned());
    p.push(("SEQNUM".to_string(), seq.to_string()));
    p
}

/// A message that has the kernel broadcast `e` on its own group, in the sending socket's network
/// namespace: a netlink header (a request of a type the kernel accepts; no acknowledgement
/// asked), then the event as the kernel writes one, `ACTION@DEVPATH` and the properties but
/// `SEQNUM`, which the kernel adds from its own count.
fn injection(e: &Uevent, seq: u64) -> Vec<u8> {
    /// `NLMSG_MIN_TYPE`: the lowest type that is not a netlink control message.
    const TYPE: u16 = 0x10;
    /// `NLM_F_REQUEST`.
    const REQUEST: u16 = 1;
    let mut body = format!("{}@{}\0", e.action, e.devpath).into_bytes();
    for (k, v) in properties(e, seq).iter().filter(|(k, _)| k != "SEQNUM") {
        body.extend_from_slice(format!("{k}={v}\0").as_bytes());
    }
    let len = u32::try_from(16 + body.len()).unwrap_or(u32::MAX);
    let mut m = Vec::with_capacity(16 + body.len());
    m.extend_from_slice(&len.to_ne_bytes());
    m.extend_from_slice(&TYPE.to_ne_bytes());
    m.extend_from_slice(&REQUEST.to_ne_bytes());
    m.extend_from_slice(&(seq as u32).to_ne_bytes()); // the header's sequence number
    m.extend_from_slice(&0u32.to_ne_bytes()); // port: the kernel fills it in
    m.extend_from_slice(&body);
    m
}

/// A libudev monitor message: the 40-byte header, then `KEY=VALUE\0` properties.
pub(crate) fn encode(e: &Uevent, seq: u64) -> Vec<u8> {
    let props = properties(e, seq);
    let props: Vec<(&str, &str)> = props
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    udev_message(&props)
}

/// A message as udevd broadcasts one on its group (libudev's format): the 40-byte header, with
/// the hash of the `SUBSYSTEM` property that a monitor filtering by subsystem checks in the
/// kernel, then the properties as `KEY=VALUE\0`, in order.
pub fn udev_message(props: &[(&str, &str)]) -> Vec<u8> {
    let mut body = Vec::new();
    for (k, v) in props {
        body.extend_from_slice(k.as_bytes());
        body.push(b'=');
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    let subsystem = props
        .iter()
        .find_map(|(k, v)| (*k == "SUBSYSTEM").then_some(*v))
        .map_or(0, |s| murmur2(s.as_bytes()));
    let mut m = Vec::with_capacity(HEADER_SIZE + body.len());
    m.extend_from_slice(b"libudev\0");
    m.extend_from_slice(&MAGIC.to_be_bytes());
    m.extend_from_slice(&(HEADER_SIZE as u32).to_ne_bytes());
    m.extend_from_slice(&(HEADER_SIZE as u32).to_ne_bytes()); // properties_off
    m.extend_from_slice(&(body.len() as u32).to_ne_bytes()); // properties_len
    m.extend_from_slice(&subsystem.to_be_bytes()); // subsystem hash
    m.extend_from_slice(&0u32.to_be_bytes()); // devtype hash: no devtype
    m.extend_from_slice(&0u32.to_be_bytes()); // tag bloom hi
    m.extend_from_slice(&0u32.to_be_bytes()); // tag bloom lo
    m.extend_from_slice(&body);
    m
}

/// MurmurHash2 with seed 0, as libudev hashes the subsystem for its socket filter.
fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_has_the_libudev_header_and_properties() {
        let e = Uevent {
            action: "bind",
            devpath: "/devices/pci0000:40/0000:40:01.1/0000:41:00.0".into(),
            subsystem: "pci",
            driver: Some("vfio-pci".into()),
            extra: vec![("PCI_SLOT_NAME".into(), "0000:41:00.0".into())],
        };
        let m = encode(&e, 7);
        assert_eq!(&m[..8], b"libudev\0");
        assert_eq!(&m[8..12], &[0xfe, 0xed, 0xca, 0xfe]);
        let props = std::str::from_utf8(&m[HEADER_SIZE..]).unwrap();
        assert_eq!(
            props,
            "ACTION=bind\0DEVPATH=/devices/pci0000:40/0000:40:01.1/0000:41:00.0\0SUBSYSTEM=pci\0\
             DRIVER=vfio-pci\0PCI_SLOT_NAME=0000:41:00.0\0SEQNUM=7\0"
        );
    }

    #[test]
    fn an_injection_is_a_netlink_request_carrying_the_kernels_form_without_seqnum() {
        let e = Uevent {
            action: "remove",
            devpath: "/devices/pci0000:60/0000:60:01.1/0000:61:00.4/u1".into(),
            subsystem: "mdev",
            driver: None,
            extra: vec![("MDEV_TYPE".into(), "nvidia-593".into())],
        };
        let m = injection(&e, 9);
        let word = |at: usize| u32::from_ne_bytes(m[at..at + 4].try_into().unwrap());
        let half = |at: usize| u16::from_ne_bytes(m[at..at + 2].try_into().unwrap());
        assert_eq!(word(0) as usize, m.len());
        assert_eq!((half(4), half(6)), (0x10, 1));
        assert_eq!(
            std::str::from_utf8(&m[16..]).unwrap(),
            "remove@/devices/pci0000:60/0000:60:01.1/0000:61:00.4/u1\0ACTION=remove\0\
             DEVPATH=/devices/pci0000:60/0000:60:01.1/0000:61:00.4/u1\0SUBSYSTEM=mdev\0\
             MDEV_TYPE=nvidia-593\0"
        );
    }
}
