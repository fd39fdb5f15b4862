//! Device names from `pci.ids`, looked up for the few devices a node has.
//!
//! A distribution's `pci.ids` is ~1.4 MB naming ~40,000 devices of ~2,500 vendors; a node
//! needs the names of a handful. [`PciIds`] reads the file once, at start, to note where each
//! vendor's section lies (a few dozen kB of offsets), and keeps nothing else of it. Naming a
//! device reads its vendor's section (kept open, with `pread`) and remembers the answer, so a
//! device is looked up once per process, whatever the number of re-reads of the node.
//!
//! The format (<https://pci-ids.ucw.cz>): `#` comments; vendor lines `10de  NVIDIA Corporation`;
//! below each, device lines `\t2236  GA102GL [A10]` and subsystem lines
//! `\t\t10de 1482  GA102GL [A10]`; after all vendors, the device classes (`C 03  Display
//! controller`, with its own tab-indented lines), which name no device.

use std::collections::HashMap;
use std::io::{self, BufRead as _};
use std::ops::Range;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// How much is read at a time while indexing.
const CHUNK: usize = 64 * 1024;

/// Where `pci.ids` text is read from: the embedded block, an opened file, or (tests) a source
/// that counts what is read.
pub trait IdsSource: Send + Sync {
    /// Its size in bytes.
    fn size(&self) -> u64;
    /// Reads up to `buf.len()` bytes at `offset`; 0 at the end.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
}

impl IdsSource for &'static [u8] {
    fn size(&self) -> u64 {
        <[u8]>::len(self) as u64
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(<[u8]>::len(self));
        let n = buf.len().min(<[u8]>::len(self) - start);
        buf[..n].copy_from_slice(&self[start..start + n]);
        Ok(n)
    }
}

/// An opened file and its length when it was opened.
struct FileSource {
    file: std::fs::File,
    len: u64,
}

impl IdsSource for FileSource {
    fn size(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.file.read_at(buf, offset)
    }
}

/// Device names looked up so far, unknown devices included.
type Names = HashMap<(u16, u16), Option<Arc<str>>>;

struct Inner {
    source: Box<dyn IdsSource>,
    /// For messages: the file, or "the embedded block".
    origin: String,
    /// Each vendor's device and subsystem lines: a byte range of the source.
    vendors: HashMap<u16, Range<u64>>,
    names: Mutex<Names>,
}

/// Device names from a `pci.ids` (see the module documentation). Cloning shares it.
#[derive(Clone)]
pub struct PciIds {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PciIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciIds")
            .field("origin", &self.inner.origin)
            .field("vendors", &self.inner.vendors.len())
            .finish_non_exhaustive()
    }
}

impl PciIds {
    /// The pinned NVIDIA block embedded in the binary.
    pub fn embedded() -> Self {
        let text: &'static [u8] = super::EMBEDDED.as_bytes();
        match Self::from_source(Box::new(text), "the embedded NVIDIA block") {
            Ok(ids) => ids,
            // Indexing in-memory text cannot fail on I/O; an empty index names nothing.
            Err(_) => Self::new(Box::new(text), "the embedded NVIDIA block", HashMap::new()),
        }
    }

    /// A full `pci.ids` file (`--pci-ids`): opened, indexed, kept open for lookups.
    pub fn from_file(path: &Path) -> Result<Self> {
        let io_err = |e| Error::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let file = std::fs::File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        let ids = Self::from_source(
            Box::new(FileSource { file, len }),
            &path.display().to_string(),
        )
        .map_err(io_err)?;
        if ids.inner.vendors.is_empty() {
            return Err(Error::Parse {
                path: path.to_path_buf(),
                reason: "no vendor lines: not a pci.ids file".into(),
            });
        }
        Ok(ids)
    }

    /// Indexes `source` (one pass over it); `origin` names it in messages.
    pub fn from_source(source: Box<dyn IdsSource>, origin: &str) -> io::Result<Self> {
        let vendors = index(source.as_ref())?;
        Ok(Self::new(source, origin, vendors))
    }

    fn new(source: Box<dyn IdsSource>, origin: &str, vendors: HashMap<u16, Range<u64>>) -> Self {
        PciIds {
            inner: Arc::new(Inner {
                source,
                origin: origin.to_string(),
                vendors,
                names: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The device's name (`GA102GL [A10]`), read from its vendor's section the first time it
    /// is asked for. A read that fails is logged and answered `None` (not remembered).
    pub fn device_name(&self, vendor: u16, device: u16) -> Option<Arc<str>> {
        let mut names = self
            .inner
            .names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(known) = names.get(&(vendor, device)) {
            return known.clone();
        }
        match self.find(vendor, device) {
            Ok(name) => {
                names.insert((vendor, device), name.clone());
                name
            }
            Err(e) => {
                tracing::warn!(
                    source = %self.inner.origin,
                    vendor = format!("{vendor:04x}"),
                    error = %e,
                    "cannot read pci.ids"
                );
                None
            }
        }
    }

    fn find(&self, vendor: u16, device: u16) -> io::Result<Option<Arc<str>>> {
        let Some(range) = self.inner.vendors.get(&vendor) else {
            return Ok(None);
        };
        let len = usize::try_from(range.end - range.start).unwrap_or(0);
        let mut section = vec![0u8; len];
        let mut got = 0;
        while got < len {
            let n = self
                .inner
                .source
                .read_at(range.start + got as u64, &mut section[got..])?;
            if n == 0 {
                break;
            }
            got += n;
        }
        section.truncate(got);
        let text = String::from_utf8_lossy(&section);
        Ok(text
            .lines()
            .filter_map(|l| l.strip_prefix('\t'))
            .filter(|l| !l.starts_with('\t'))
            .filter_map(split_id)
            .find(|(id, _)| *id == device)
            .map(|(_, name)| Arc::from(name)))
    }
}

/// `2236  GA102GL [A10]` → (0x2236, "GA102GL [A10]"): four hex digits, then the name.
pub(super) fn split_id(s: &str) -> Option<(u16, &str)> {
    let (id, name) = s.split_once(' ')?;
    if id.len() != 4 {
        return None;
    }
    Some((u16::from_str_radix(id, 16).ok()?, name.trim()))
}

/// Reads a source front to back.
struct SourceReader<'a> {
    source: &'a dyn IdsSource,
    offset: u64,
}

impl io::Read for SourceReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.source.read_at(self.offset, buf)?;
        self.offset += n as u64;
        Ok(n)
    }
}

/// One pass over the source: the byte range of each vendor's section, up to the classes.
fn index(source: &dyn IdsSource) -> io::Result<HashMap<u16, Range<u64>>> {
    let mut vendors = HashMap::new();
    let mut current: Option<(u16, u64)> = None;
    let mut close = |current: &mut Option<(u16, u64)>, end: u64| {
        if let Some((v, start)) = current.take() {
            vendors.entry(v).or_insert(start..end);
        }
    };
    let mut reader = io::BufReader::with_capacity(CHUNK, SourceReader { source, offset: 0 });
    let mut line = Vec::with_capacity(256);
    let mut at = 0u64;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line)? as u64;
        if n == 0 {
            close(&mut current, at);
            break;
        }
        if line.starts_with(b"C ") {
            // The device classes: no vendor after them.
            close(&mut current, at);
            break;
        }
        if let Some(v) = vendor_line(&line) {
            close(&mut current, at);
            current = Some((v, at + n));
        }
        at += n;
    }
    Ok(vendors)
}

/// The vendor id of a vendor line (`10de  NVIDIA Corporation`).
fn vendor_line(line: &[u8]) -> Option<u16> {
    if line.len() < 5 || line[4] != b' ' {
        return None;
    }
    let id = std::str::from_utf8(&line[..4]).ok()?;
    if !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u16::from_str_radix(id, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// In-memory text that counts its reads and the bytes they returned.
    struct Counting {
        text: &'static [u8],
        reads: Arc<AtomicUsize>,
        bytes: Arc<AtomicUsize>,
    }

    impl IdsSource for Counting {
        fn size(&self) -> u64 {
            self.text.len() as u64
        }

        fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.text.read_at(offset, buf)?;
            self.reads.fetch_add(1, Ordering::SeqCst);
            self.bytes.fetch_add(n, Ordering::SeqCst);
            Ok(n)
        }
    }

    /// The shape of the real file: header comments, vendors with devices and subsystems,
    /// comments between them, a vendor without devices, then the classes.
    const REAL_FORMAT: &str = "\
#\tList of PCI ID's
#
# Version: 2023.04.10
# Syntax:
# vendor  vendor_name
#\tdevice  device_name\t\t\t\t<-- single tab
#\t\tsubvendor subdevice  subsystem_name\t<-- two tabs

0001  SafeNet (wrong ID)
0010  Allied Telesis, Inc (Wrong ID)
# This is a relabelled RTL-8139
\t8139  AT-2500TX V3 Ethernet
10de  NVIDIA Corporation
\t1eb8  TU104GL [Tesla T4]
\t\t10de 12a2  Tesla T4
\t2236  GA102GL [A10]
\t\t10de 1482  GA102GL [A10]
# Two tabs and an id that is also a device id of this vendor above: not a device.
\t\t10de 2237  Fake subsystem
\t26b9  AD102GL [L40S]
1af4  Red Hat, Inc.
\t1050  Virtio 1.0 GPU
ffff  Illegal Vendor ID


# List of known device classes, subclasses and programming interfaces

# Syntax:
# C class\tclass_name
#\tsubclass\tsubclass_name  \t\t<-- single tab
C 00  Unclassified device
\t00  Non-VGA unclassified device
C 03  Display controller
\t0000  Not a device of ffff
\t02  3D controller
";

    fn counting() -> (PciIds, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let reads = Arc::new(AtomicUsize::new(0));
        let bytes = Arc::new(AtomicUsize::new(0));
        let src = Counting {
            text: REAL_FORMAT.as_bytes(),
            reads: reads.clone(),
            bytes: bytes.clone(),
        };
        let ids = PciIds::from_source(Box::new(src), "test").unwrap();
        (ids, reads, bytes)
    }

    #[test]
    fn names_from_a_real_format_file() {
        let (ids, _, _) = counting();
        let name = |v, d| ids.device_name(v, d).map(|n| n.to_string());
        assert_eq!(name(0x10de, 0x2236).as_deref(), Some("GA102GL [A10]"));
        assert_eq!(name(0x10de, 0x1eb8).as_deref(), Some("TU104GL [Tesla T4]"));
        assert_eq!(name(0x10de, 0x26b9).as_deref(), Some("AD102GL [L40S]"));
        assert_eq!(
            name(0x0010, 0x8139).as_deref(),
            Some("AT-2500TX V3 Ethernet")
        );
        assert_eq!(name(0x1af4, 0x1050).as_deref(), Some("Virtio 1.0 GPU"));
        // A subsystem line is not a device; the classes name no device of the last vendor.
        assert_eq!(name(0x10de, 0x2237), None);
        assert_eq!(name(0x10de, 0x10de), None);
        assert_eq!(name(0xffff, 0x0000), None);
        // Vendor-scoped, and unknown vendors.
        assert_eq!(name(0x1af4, 0x2236), None);
        assert_eq!(name(0x8086, 0x1572), None);
        assert_eq!(name(0x0001, 0x8139), None);
    }

    #[test]
    fn the_file_is_read_once_and_a_lookup_reads_only_its_vendor() {
        let (ids, reads, bytes) = counting();
        // Indexing: the text once, up to the classes at most.
        assert!(bytes.load(Ordering::SeqCst) <= REAL_FORMAT.len());
        let (r0, b0) = (reads.load(Ordering::SeqCst), bytes.load(Ordering::SeqCst));
        // A lookup reads NVIDIA's section and nothing else.
        ids.device_name(0x10de, 0x2236);
        let section = REAL_FORMAT.find("\t1eb8").unwrap()..REAL_FORMAT.find("1af4  ").unwrap();
        assert_eq!(bytes.load(Ordering::SeqCst) - b0, section.len());
        // Asked again (a re-read of the node), or for a device known to be absent: no read.
        let (r1, b1) = (reads.load(Ordering::SeqCst), bytes.load(Ordering::SeqCst));
        assert!(r1 > r0);
        for _ in 0..3 {
            ids.device_name(0x10de, 0x2236);
            ids.clone().device_name(0x10de, 0x2236);
        }
        ids.device_name(0x8086, 0x1572);
        ids.device_name(0x8086, 0x1572);
        assert_eq!(
            (reads.load(Ordering::SeqCst), bytes.load(Ordering::SeqCst)),
            (r1, b1)
        );
    }

    #[test]
    fn lines_across_read_chunks_are_indexed() {
        // A vendor line split by the chunk boundary still starts a section.
        let mut text = String::from("# padding\n");
        while text.len() < CHUNK - 3 {
            text.push_str("#\n");
        }
        text.push_str("10de  NVIDIA Corporation\n\t2236  GA102GL [A10]\n");
        let text: &'static str = Box::leak(text.into_boxed_str());
        let ids = PciIds::from_source(Box::new(text.as_bytes()), "test").unwrap();
        assert_eq!(
            ids.device_name(0x10de, 0x2236).as_deref(),
            Some("GA102GL [A10]")
        );
        // No final newline.
        let ids = PciIds::from_source(Box::new(&b"10de  NVIDIA\n\t2236  A10"[..]), "t").unwrap();
        assert_eq!(ids.device_name(0x10de, 0x2236).as_deref(), Some("A10"));
    }
}
