//! Device names from `pci.ids`, looked up for the few devices a node has.
//!
//! A distribution's `pci.ids` is ~1.4 MB naming ~40,000 devices of ~2,500 vendors; a node
//! needs the names of a handful. [`PciIds`] keeps the file open and parses none of it up
//! front: the first device of a vendor asked for finds the vendor's line (a byte search for
//! `\n10de `, in 64 KiB reads, from the start up to that line only) and the end of its
//! section, and each device is then found in that section (a byte search for `\n\t2236 `).
//! Sections and names are remembered, unknown ones included, so a device is looked up once
//! per process whatever the number of re-reads of the node, and nothing else of the file is
//! kept.
//!
//! The format (<https://pci-ids.ucw.cz>): `#` comments; vendor lines `10de  NVIDIA Corporation`;
//! below each, device lines `\t2236  GA102GL [A10]` and subsystem lines
//! `\t\t10de 1482  GA102GL [A10]`; after all vendors, the device classes (`C 03  Display
//! controller`, with its own tab-indented lines), which name no device. Ids are lower-case hex,
//! as the file writes them.

use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// How much is read at a time while searching.
const CHUNK: usize = 64 * 1024;
/// The longest line looked at whole (a device line with its name).
const MAX_LINE: usize = 1024;

/// Where `pci.ids` text is read from: the embedded block, an opened file, or (tests) a source
/// that counts what is read.
pub trait IdsSource: Send + Sync {
    /// Its size in bytes.
    fn size(&self) -> u64;
    /// Reads up to `buf.len()` bytes at `offset`; 0 at the end.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// All of it, when it is in memory already: searched in place, with no copy.
    fn in_memory(&self) -> Option<&[u8]> {
        None
    }
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

    fn in_memory(&self) -> Option<&[u8]> {
        Some(self)
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

/// Vendors looked up so far: the byte range of each one's device and subsystem lines, or
/// `None` for a vendor the file does not have.
type Sections = HashMap<u16, Option<Range<u64>>>;

struct Inner {
    source: Box<dyn IdsSource>,
    /// For messages: the file, or "the embedded block".
    origin: String,
    sections: Mutex<Sections>,
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
            .finish_non_exhaustive()
    }
}

impl PciIds {
    /// The pinned NVIDIA block embedded in the binary.
    pub fn embedded() -> Self {
        let text: &'static [u8] = super::EMBEDDED.as_bytes();
        Self::from_source(Box::new(text), "the embedded NVIDIA block")
    }

    /// A full `pci.ids` file (`--pci-ids`): opened, its start checked to hold a vendor line,
    /// kept open for lookups.
    pub fn from_file(path: &Path) -> Result<Self> {
        let io_err = |e| Error::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let file = std::fs::File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        let source = FileSource { file, len };
        // The real file has its first vendor line after a few dozen lines of comments.
        let mut head = vec![0u8; CHUNK];
        let n = read_full(&source, 0, &mut head).map_err(io_err)?;
        if !head[..n]
            .split(|&b| b == b'\n')
            .any(|l| vendor_line(l).is_some())
        {
            return Err(Error::Parse {
                path: path.to_path_buf(),
                reason: format!("no vendor line in its first {CHUNK} bytes: not a pci.ids file"),
            });
        }
        Ok(Self::from_source(
            Box::new(source),
            &path.display().to_string(),
        ))
    }

    /// Names from `source`, read when asked; `origin` names it in messages.
    pub fn from_source(source: Box<dyn IdsSource>, origin: &str) -> Self {
        PciIds {
            inner: Arc::new(Inner {
                source,
                origin: origin.to_string(),
                sections: Mutex::new(HashMap::new()),
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
        let Some(section) = self.section(vendor)? else {
            return Ok(None);
        };
        let src = self.inner.source.as_ref();
        // The section starts at a line's start: the search sees the newline before it.
        let needle = format!("\n\t{device:04x} ");
        let Some(at) = search(src, section.start - 1, section.end, needle.as_bytes())? else {
            return Ok(None);
        };
        let line = line_at(src, at + 2)?;
        let text = String::from_utf8_lossy(&line);
        Ok(split_id(&text).map(|(_, name)| Arc::from(name)))
    }

    /// The vendor's device and subsystem lines, found the first time it is asked for.
    fn section(&self, vendor: u16) -> io::Result<Option<Range<u64>>> {
        let mut sections = self
            .inner
            .sections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(known) = sections.get(&vendor) {
            return Ok(known.clone());
        }
        let found = locate(self.inner.source.as_ref(), vendor)?;
        sections.insert(vendor, found.clone());
        Ok(found)
    }
}

/// Reads at `offset` until `buf` is full or the source ends; how much was read.
fn read_full(src: &dyn IdsSource, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        let n = src.read_at(offset + got as u64, &mut buf[got..])?;
        if n == 0 {
            break;
        }
        got += n;
    }
    Ok(got)
}

/// Where `needle` first occurs in the source between `from` and `to`, in [`CHUNK`] reads.
/// `from` may be one before the start (`u64::MAX` wraps to it): the text is then searched as
/// if a newline preceded it, so that a needle starting with one matches the first line.
fn search(src: &dyn IdsSource, from: u64, to: u64, needle: &[u8]) -> io::Result<Option<u64>> {
    let finder = memchr::memmem::Finder::new(needle);
    if let Some(all) = src.in_memory() {
        let end = usize::try_from(to).unwrap_or(usize::MAX).min(all.len());
        let (start, at_newline) = match from {
            u64::MAX => (0, true),
            f => (usize::try_from(f).unwrap_or(usize::MAX).min(end), false),
        };
        // Before the start, a newline: a needle beginning with one matches the first line.
        if at_newline && needle.first() == Some(&b'\n') && all[..end].starts_with(&needle[1..]) {
            return Ok(Some(u64::MAX));
        }
        return Ok(finder.find(&all[start..end]).map(|i| (start + i) as u64));
    }
    let keep = needle.len().saturating_sub(1);
    let mut buf = Vec::with_capacity(CHUNK + keep);
    // Where buf[0] lies in the source.
    let mut base = from;
    let mut next = from;
    if from == u64::MAX {
        buf.push(b'\n');
        next = 0;
    }
    let mut chunk = vec![0u8; CHUNK];
    while next < to {
        let want = usize::try_from((to - next).min(CHUNK as u64)).unwrap_or(CHUNK);
        let n = read_full(src, next, &mut chunk[..want])?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        next += n as u64;
        if let Some(i) = finder.find(&buf) {
            return Ok(Some(base.wrapping_add(i as u64)));
        }
        // Keep the tail a match could start in.
        let drop = buf.len().saturating_sub(keep);
        buf.drain(..drop);
        base = base.wrapping_add(drop as u64);
    }
    Ok(None)
}

/// The line that starts at `offset`, without its newline (at most [`MAX_LINE`] bytes).
fn line_at(src: &dyn IdsSource, offset: u64) -> io::Result<Vec<u8>> {
    if let Some(all) = src.in_memory() {
        let from = usize::try_from(offset).unwrap_or(usize::MAX).min(all.len());
        let rest = &all[from..all.len().min(from.saturating_add(MAX_LINE))];
        let end = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
        return Ok(rest[..end].to_vec());
    }
    let mut line = vec![0u8; MAX_LINE];
    let n = read_full(src, offset, &mut line)?;
    line.truncate(n);
    if let Some(end) = memchr::memchr(b'\n', &line) {
        line.truncate(end);
    }
    Ok(line)
}

/// The vendor's section: from the line after its vendor line to the next vendor line (or the
/// classes, or the end). `None` when the file has no such vendor.
fn locate(src: &dyn IdsSource, vendor: u16) -> io::Result<Option<Range<u64>>> {
    let size = src.size();
    let needle = format!("\n{vendor:04x} ");
    let Some(at) = search(src, u64::MAX, size, needle.as_bytes())? else {
        return Ok(None);
    };
    // The vendor line itself starts after the newline; the section after its own newline.
    let head = at.wrapping_add(1);
    let Some(eol) = search(src, head, size, b"\n")? else {
        return Ok(Some(size..size));
    };
    let start = eol + 1;
    // The next line that is not the vendor's: a vendor line or the classes.
    if let Some(all) = src.in_memory() {
        let from = usize::try_from(start).unwrap_or(usize::MAX).min(all.len());
        return Ok(Some(match section_end(&all[from..]) {
            Ok(pos) => start..start + pos as u64,
            Err(_) => start..size,
        }));
    }
    let mut buf = vec![0u8; CHUNK];
    let mut line_start = start;
    loop {
        let n = read_full(src, line_start, &mut buf)?;
        if n == 0 {
            return Ok(Some(start..size));
        }
        match section_end(&buf[..n]) {
            Ok(pos) => return Ok(Some(start..line_start + pos as u64)),
            // A line cut by the read: read again from its start.
            Err(pos) if n == buf.len() && pos > 0 => line_start += pos as u64,
            Err(_) => return Ok(Some(start..size)),
        }
    }
}

/// Where the first line of `text` (which starts at a line start) that is not a vendor's
/// device or subsystem line starts: `Ok` at a vendor line or the classes; `Err` with the start
/// of the last line, unended, when there is none (the text's length if its last line ends).
fn section_end(text: &[u8]) -> Result<usize, usize> {
    let mut pos = 0;
    while pos < text.len() {
        let line = &text[pos..];
        if vendor_line(line).is_some() || line.starts_with(b"C ") {
            return Ok(pos);
        }
        match memchr::memchr(b'\n', line) {
            Some(e) => pos += e + 1,
            None => return Err(pos),
        }
    }
    Err(pos)
}

/// `2236  GA102GL [A10]` → (0x2236, "GA102GL [A10]"): four hex digits, then the name.
pub(super) fn split_id(s: &str) -> Option<(u16, &str)> {
    let (id, name) = s.split_once(' ')?;
    if id.len() != 4 {
        return None;
    }
    Some((u16::from_str_radix(id, 16).ok()?, name.trim()))
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

    /// Text read in chunks, as a file is.
    struct Chunked(&'static [u8]);

    impl IdsSource for Chunked {
        fn size(&self) -> u64 {
            self.0.len() as u64
        }

        fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
            self.0.read_at(offset, buf)
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
        let ids = PciIds::from_source(Box::new(src), "test");
        (ids, reads, bytes)
    }

    /// In-memory text, as the embedded block is, that counts the reads made through `read_at`
    /// (none should be: in-memory text is searched in place).
    struct InPlace {
        text: &'static [u8],
        reads: Arc<AtomicUsize>,
    }

    impl IdsSource for InPlace {
        fn size(&self) -> u64 {
            self.text.len() as u64
        }

        fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            self.text.read_at(offset, buf)
        }

        fn in_memory(&self) -> Option<&[u8]> {
            Some(self.text)
        }
    }

    #[test]
    fn names_from_a_real_format_file() {
        let (ids, _, _) = counting();
        real_format_names(&ids);
    }

    #[test]
    fn in_memory_text_is_searched_in_place_with_the_same_names() {
        let reads = Arc::new(AtomicUsize::new(0));
        let src = InPlace {
            text: REAL_FORMAT.as_bytes(),
            reads: reads.clone(),
        };
        let ids = PciIds::from_source(Box::new(src), "test");
        real_format_names(&ids);
        assert_eq!(reads.load(Ordering::SeqCst), 0, "nothing copied out");
    }

    /// What REAL_FORMAT names, and does not.
    fn real_format_names(ids: &PciIds) {
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
    fn a_lookup_reads_no_further_than_its_vendor_and_only_once() {
        let (ids, reads, bytes) = counting();
        // Nothing is read before a name is asked for.
        assert_eq!(bytes.load(Ordering::SeqCst), 0);
        ids.device_name(0x10de, 0x2236);
        assert!(reads.load(Ordering::SeqCst) > 0);
        // Asked again (a re-read of the node), or for a device known to be absent: no read.
        for _ in 0..3 {
            ids.device_name(0x10de, 0x2236);
            ids.clone().device_name(0x10de, 0x2236);
        }
        ids.device_name(0x8086, 0x1572);
        let after_unknown = (reads.load(Ordering::SeqCst), bytes.load(Ordering::SeqCst));
        ids.device_name(0x8086, 0x1572);
        ids.device_name(0x8086, 0x1573);
        assert_eq!(
            (reads.load(Ordering::SeqCst), bytes.load(Ordering::SeqCst)),
            after_unknown,
            "an unknown vendor is searched once"
        );
        // Another device of a known vendor: its section, and its line.
        let before = bytes.load(Ordering::SeqCst);
        ids.device_name(0x10de, 0x26b9);
        let section = REAL_FORMAT.find("\t1eb8").unwrap()..REAL_FORMAT.find("1af4  ").unwrap();
        assert!(bytes.load(Ordering::SeqCst) - before <= section.len() + 1 + MAX_LINE);
    }

    #[test]
    fn a_vendor_near_the_start_of_a_big_file_reads_little_of_it() {
        // NVIDIA early, then 32 chunks of other vendors, as 10de sits a quarter into the
        // real file.
        let mut text = String::from(
            "# header\n0001  First\n10de  NVIDIA Corporation\n\t2236  GA102GL [A10]\n",
        );
        let mut v = 0x2000u32;
        while text.len() < 32 * CHUNK {
            text.push_str(&format!(
                "{v:04x}  Vendor\n\t0001  Device\n\t\t{v:04x} 0001  Sub\n"
            ));
            v += 1;
        }
        let text: &'static str = Box::leak(text.into_boxed_str());
        let bytes = Arc::new(AtomicUsize::new(0));
        let src = Counting {
            text: text.as_bytes(),
            reads: Arc::new(AtomicUsize::new(0)),
            bytes: bytes.clone(),
        };
        let ids = PciIds::from_source(Box::new(src), "test");
        assert_eq!(
            ids.device_name(0x10de, 0x2236).as_deref(),
            Some("GA102GL [A10]")
        );
        assert_eq!(ids.device_name(0x10de, 0x2237), None);
        let read = bytes.load(Ordering::SeqCst);
        assert!(
            read <= 4 * CHUNK + MAX_LINE,
            "read {read} of {} bytes",
            text.len()
        );
    }

    #[test]
    fn a_big_file_is_searched_in_chunks_and_found_across_their_boundaries() {
        // Vendor lines and device lines placed across every offset of a chunk boundary.
        for shift in 0..12 {
            let mut text = String::from("# padding\n");
            while text.len() < CHUNK - shift {
                text.push_str("#\n");
            }
            text.push_str("0100  Someone\n\t2236  Not NVIDIA's\n");
            while text.len() < 2 * CHUNK - shift {
                text.push_str("\t\t0100 0001  sub\n");
            }
            text.push_str("10de  NVIDIA Corporation\n\t2236  GA102GL [A10]\n\t\t10de 1482  sub\nC 03  Display\n\t2237  class line\n");
            let text: &'static str = Box::leak(text.into_boxed_str());
            // Read in chunks (a file), and searched in place (the embedded block).
            let sources: [Box<dyn IdsSource>; 2] = [
                Box::new(Chunked(text.as_bytes())),
                Box::new(text.as_bytes()),
            ];
            for src in sources {
                let ids = PciIds::from_source(src, "test");
                assert_eq!(
                    ids.device_name(0x10de, 0x2236).as_deref(),
                    Some("GA102GL [A10]"),
                    "shift {shift}"
                );
                assert_eq!(
                    ids.device_name(0x0100, 0x2236).as_deref(),
                    Some("Not NVIDIA's")
                );
                assert_eq!(
                    ids.device_name(0x10de, 0x2237),
                    None,
                    "a class line is no device"
                );
                assert_eq!(
                    ids.device_name(0x0100, 0x0001),
                    None,
                    "a subsystem is no device"
                );
            }
        }
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
        let ids = PciIds::from_source(Box::new(Chunked(text.as_bytes())), "test");
        assert_eq!(
            ids.device_name(0x10de, 0x2236).as_deref(),
            Some("GA102GL [A10]")
        );
        // No final newline; the first line a vendor's.
        let text = &b"10de  NVIDIA\n\t2236  A10"[..];
        for src in [
            Box::new(Chunked(text)) as Box<dyn IdsSource>,
            Box::new(text),
        ] {
            let ids = PciIds::from_source(src, "t");
            assert_eq!(ids.device_name(0x10de, 0x2236).as_deref(), Some("A10"));
        }
    }
}
