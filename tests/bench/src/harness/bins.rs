//! The daemons' binaries, found beside this one (a release build of the workspace).

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};

/// Paths of the daemons.
pub struct Bins {
    pub vfio: PathBuf,
    pub vgpu: PathBuf,
    pub dp: PathBuf,
    pub dra: PathBuf,
    /// `gpu-vm-noop`, a Rust executable of the same build that only exits (absent in builds
    /// of the daemons alone).
    pub noop: Option<PathBuf>,
    /// `gpu-vm-bare-plugin`, the least a device plugin does, built as the daemons are: the
    /// base of sandbox-dp's plain-tree figures.
    pub bare: PathBuf,
}

/// Finds the daemons beside this binary.
pub fn bins() -> Result<Bins> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow!("{} has no directory", exe.display()))?;
    let b = Bins {
        vfio: dir.join("vfio-manager"),
        vgpu: dir.join("vgpu-device-manager"),
        dp: dir.join("sandbox-dp"),
        dra: dir.join("sandbox-dra"),
        noop: Some(dir.join("gpu-vm-noop")).filter(|p| p.exists()),
        bare: dir.join("gpu-vm-bare-plugin"),
    };
    for p in [&b.vfio, &b.vgpu, &b.dp, &b.dra, &b.bare] {
        if !p.exists() {
            bail!(
                "{} not found: build the daemons and the bench's programs beside this binary first (tools/build-release.sh --workspace --bins)",
                p.display()
            );
        }
    }
    Ok(b)
}

impl Bins {
    /// Every binary the bench runs.
    pub fn all(&self) -> Vec<&PathBuf> {
        let mut v = vec![&self.vfio, &self.vgpu, &self.dp, &self.dra, &self.bare];
        v.extend(self.noop.iter());
        v
    }
}

/// Drops `path`'s pages from the page cache (written back first), so that the next `exec`
/// reads the file from disk as after a boot or an image pull, not in the pages the linker
/// wrote: how much of a binary one page fault maps (and so the faults a start takes, and the
/// resident memory of its code) depends on which. Pages that are mapped stay.
pub fn evict(path: &std::path::Path) -> Result<()> {
    use nix::fcntl::{PosixFadviseAdvice, posix_fadvise};
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    f.sync_all()
        .with_context(|| format!("writing {} back", path.display()))?;
    posix_fadvise(&f, 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
        .with_context(|| format!("dropping {} from the page cache", path.display()))?;
    Ok(())
}

/// How an ELF executable is linked: "dynamically linked" when it names a program interpreter
/// (the dynamic loader), "static" otherwise; "unknown" when it cannot be read as 64-bit ELF.
pub fn linkage(path: &std::path::Path) -> &'static str {
    const PT_INTERP: u32 = 3;
    let Ok(b) = std::fs::read(path) else {
        return "unknown";
    };
    let u16_at = |o: usize| b.get(o..o + 2).map(|s| u16::from_le_bytes([s[0], s[1]]));
    let u32_at = |o: usize| {
        b.get(o..o + 4)
            .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    };
    let u64_at = |o: usize| {
        b.get(o..o + 8).map(|s| {
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            u64::from_le_bytes(a)
        })
    };
    // 64-bit little-endian ELF only (x86-64, aarch64).
    if b.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return "unknown";
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return "unknown";
    };
    let Ok(phoff) = usize::try_from(phoff) else {
        return "unknown";
    };
    let interp = (0..usize::from(phnum))
        .filter_map(|i| u32_at(phoff + i * usize::from(phentsize)))
        .any(|t| t == PT_INTERP);
    if interp {
        "dynamically linked"
    } else {
        "static"
    }
}

#[cfg(test)]
mod tests {
    use super::{evict, linkage};

    #[test]
    fn an_evicted_file_reads_back_the_same() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let f = dir.path().join("bin");
        std::fs::write(&f, vec![7u8; 1 << 16]).unwrap_or_else(|e| panic!("write: {e}"));
        assert!(evict(&f).is_ok());
        assert_eq!(std::fs::read(&f).ok(), Some(vec![7u8; 1 << 16]));
        assert!(evict(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn this_test_binary_is_dynamically_linked_and_garbage_is_unknown() {
        let exe = std::env::current_exe().unwrap_or_default();
        assert_eq!(linkage(&exe), "dynamically linked");
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let f = dir.path().join("not-elf");
        std::fs::write(&f, b"#!/bin/sh\n").unwrap_or_else(|e| panic!("write: {e}"));
        assert_eq!(linkage(&f), "unknown");
        #[cfg(target_arch = "x86_64")]
        {
            let g = dir.path().join("static");
            std::fs::write(&g, crate::harness::baseline::no_op_elf())
                .unwrap_or_else(|e| panic!("write: {e}"));
            assert_eq!(linkage(&g), "static");
        }
    }
}
