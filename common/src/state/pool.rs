//! The on-demand pool: the GPUs sandbox-dp creates vGPUs on when pods ask for them, written by
//! sandbox-dp (`--on-demand`) as `<root>/run/gpu-vm-node/on-demand-pool`, one PCI address a
//! line. vgpu-device-manager reads it and leaves those GPUs, and their vGPUs, alone: one owner
//! per GPU. The file lives in `/run`, so after a reboot no GPU is pooled until sandbox-dp
//! starts again.
//!
//! sandbox-dra keeps its own pool the same way, `<root>/run/gpu-vm-node/dra-pool`: the GPUs it
//! creates vGPUs on at claim time ([`write_dra`] refuses a GPU the on-demand pool holds, so two
//! owners never share one). [`load_owned`] is every GPU some daemon owns.

use std::collections::BTreeSet;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::paths::HostPaths;
use crate::pci::PciAddress;

/// `<root>/run/gpu-vm-node/on-demand-pool`.
pub fn path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/on-demand-pool")
}

/// `<root>/run/gpu-vm-node/dra-pool`.
pub fn dra_path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/dra-pool")
}

/// The pooled GPUs; none when the file does not exist. A line that is not a PCI address is an
/// error naming the file and the line: a reader must not take a GPU it cannot tell is pooled.
pub fn load(paths: &HostPaths) -> Result<BTreeSet<PciAddress>> {
    load_file(path(paths))
}

/// sandbox-dra's pool, read as [`load`] reads the on-demand pool.
pub fn load_dra(paths: &HostPaths) -> Result<BTreeSet<PciAddress>> {
    load_file(dra_path(paths))
}

/// Every GPU a daemon creates vGPUs on by itself (the on-demand pool and sandbox-dra's): the
/// GPUs no profile may touch.
pub fn load_owned(paths: &HostPaths) -> Result<BTreeSet<PciAddress>> {
    let mut all = load(paths)?;
    all.extend(load_dra(paths)?);
    Ok(all)
}

/// Replaces sandbox-dra's pool with `gpus`. Refused, writing nothing, when the on-demand pool
/// holds one of them: the error names the GPU and the file.
pub fn write_dra(paths: &HostPaths, gpus: &BTreeSet<PciAddress>) -> Result<()> {
    let other = load(paths)?;
    if let Some(a) = gpus.intersection(&other).next() {
        return Err(Error::Parse {
            path: path(paths),
            reason: format!("GPU {a} is in sandbox-dp's on-demand pool; a GPU has one owner"),
        });
    }
    let p = dra_path(paths);
    if gpus.is_empty() {
        super::remove_if_present(&p)?;
        return Ok(());
    }
    let text: String = gpus.iter().map(|a| format!("{a}\n")).collect();
    super::write_atomic(&p, text.as_bytes())
}

fn load_file(p: PathBuf) -> Result<BTreeSet<PciAddress>> {
    let Some(text) = super::read_if_present(&p)? else {
        return Ok(BTreeSet::new());
    };
    let mut out = BTreeSet::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let a = line.parse().map_err(|_| Error::Parse {
            path: p.clone(),
            reason: format!("line {}: {line:?} is not a PCI address", i + 1),
        })?;
        out.insert(a);
    }
    Ok(out)
}

/// Replaces the pool with `gpus` ([`super::write_atomic`]); an empty pool removes the file.
pub fn write(paths: &HostPaths, gpus: &BTreeSet<PciAddress>) -> Result<()> {
    if gpus.is_empty() {
        super::remove_if_present(&path(paths))?;
        return Ok(());
    }
    let text: String = gpus.iter().map(|a| format!("{a}\n")).collect();
    super::write_atomic(&path(paths), text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_then_read_and_a_bad_line_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        assert!(load(&paths).unwrap().is_empty());
        let gpus: BTreeSet<PciAddress> = ["0000:41:00.0".parse().unwrap()].into();
        write(&paths, &gpus).unwrap();
        assert_eq!(load(&paths).unwrap(), gpus);
        std::fs::write(path(&paths), "0000:41:00.0\nnot-a-gpu\n").unwrap();
        let e = load(&paths).unwrap_err().to_string();
        assert!(e.contains("on-demand-pool") && e.contains("line 2"), "{e}");
        write(&paths, &BTreeSet::new()).unwrap();
        assert!(!path(&paths).exists());
    }

    #[test]
    fn a_gpu_has_one_owner() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        let a: PciAddress = "0000:41:00.0".parse().unwrap();
        let b: PciAddress = "0000:61:00.0".parse().unwrap();
        write(&paths, &[a].into()).unwrap();
        let e = write_dra(&paths, &[a, b].into()).unwrap_err().to_string();
        assert!(
            e.contains("0000:41:00.0") && e.contains("on-demand-pool"),
            "{e}"
        );
        assert!(!dra_path(&paths).exists(), "nothing written");
        write_dra(&paths, &[b].into()).unwrap();
        assert_eq!(load_dra(&paths).unwrap(), [b].into());
        assert_eq!(load_owned(&paths).unwrap(), [a, b].into());
        write_dra(&paths, &BTreeSet::new()).unwrap();
        assert!(!dra_path(&paths).exists());
    }
}
