//! The on-demand pool: the GPUs and non-PCI mdev parents (`mtty`) sandbox-dp creates vGPUs on
//! when pods ask for them, written by sandbox-dp (`--on-demand`) as
//! `<root>/run/gpu-vm-node/on-demand-pool`, one member a line: a GPU by its PCI address, a
//! parent by its name under `class/mdev_bus/`. vgpu-device-manager reads it and leaves those
//! members, and their vGPUs, alone: one owner per GPU or parent. The file lives in `/run`, so
//! after a reboot nothing is pooled until sandbox-dp starts again.
//!
//! sandbox-dra keeps its own pool the same way, `<root>/run/gpu-vm-node/dra-pool`: the members
//! it creates vGPUs on at claim time ([`write_dra`] refuses one the on-demand pool holds, so two
//! owners never share one). [`load_owned`] is every member some daemon owns.

use std::collections::BTreeSet;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::paths::{HostPaths, is_parent_name};
use crate::pci::PciAddress;

/// What a pool holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Members {
    /// GPUs, by PCI address.
    pub gpus: BTreeSet<PciAddress>,
    /// mdev parents that are not PCI functions, by name (`mtty`).
    pub parents: BTreeSet<String>,
}

impl Members {
    /// Nothing pooled.
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty() && self.parents.is_empty()
    }

    /// A member both pools hold, for messages.
    fn shared_with(&self, other: &Members) -> Option<String> {
        let gpu = self.gpus.intersection(&other.gpus).next();
        let parent = self.parents.intersection(&other.parents).next();
        gpu.map(|a| format!("GPU {a}"))
            .or_else(|| parent.map(|p| format!("mdev parent {p}")))
    }

    /// The file's text: addresses, then parents, one a line.
    fn text(&self) -> String {
        let gpus = self.gpus.iter().map(ToString::to_string);
        gpus.chain(self.parents.iter().cloned())
            .map(|l| l + "\n")
            .collect()
    }
}

impl From<BTreeSet<PciAddress>> for Members {
    fn from(gpus: BTreeSet<PciAddress>) -> Members {
        Members {
            gpus,
            parents: BTreeSet::new(),
        }
    }
}

/// Who owns what the on-demand pool holds, for messages.
pub const ON_DEMAND_OWNER: &str = "sandbox-dp's on-demand pool";

/// Who owns what sandbox-dra's pool holds, for messages.
pub const DRA_OWNER: &str = "sandbox-dra's vGPU pool";

/// `<root>/run/gpu-vm-node/on-demand-pool`.
pub fn path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/on-demand-pool")
}

/// `<root>/run/gpu-vm-node/dra-pool`.
pub fn dra_path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/dra-pool")
}

/// What the on-demand pool holds; nothing when the file does not exist. A line that is neither
/// a PCI address nor an mdev parent's name is an error naming the file and the line: a reader
/// must not take a GPU it cannot tell is pooled.
pub fn load(paths: &HostPaths) -> Result<Members> {
    load_file(path(paths))
}

/// sandbox-dra's pool, read as [`load`] reads the on-demand pool.
pub fn load_dra(paths: &HostPaths) -> Result<Members> {
    load_file(dra_path(paths))
}

/// Everything a daemon creates vGPUs on by itself, with its owner ([`ON_DEMAND_OWNER`],
/// [`DRA_OWNER`]): what no profile may touch.
pub fn load_owned(paths: &HostPaths) -> Result<Vec<(&'static str, Members)>> {
    Ok(vec![
        (ON_DEMAND_OWNER, load(paths)?),
        (DRA_OWNER, load_dra(paths)?),
    ])
}

/// Replaces sandbox-dra's pool with `members`. Refused, writing nothing, when the on-demand
/// pool holds one of them: the error names it and the file.
pub fn write_dra(paths: &HostPaths, members: &Members) -> Result<()> {
    if let Some(m) = members.shared_with(&load(paths)?) {
        return Err(Error::Parse {
            path: path(paths),
            reason: format!("{m} is in sandbox-dp's on-demand pool; it has one owner"),
        });
    }
    write_file(dra_path(paths), members)
}

/// Replaces the on-demand pool with `members` ([`super::write_atomic`]); an empty pool removes
/// the file.
pub fn write(paths: &HostPaths, members: &Members) -> Result<()> {
    write_file(path(paths), members)
}

fn write_file(p: PathBuf, members: &Members) -> Result<()> {
    if members.is_empty() {
        super::remove_if_present(&p)?;
        return Ok(());
    }
    super::write_atomic(&p, members.text().as_bytes())
}

fn load_file(p: PathBuf) -> Result<Members> {
    let Some(text) = super::read_if_present(&p)? else {
        return Ok(Members::default());
    };
    let mut out = Members::default();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Ok(a) = line.parse() {
            out.gpus.insert(a);
        } else if is_parent_name(line) {
            out.parents.insert(line.to_string());
        } else {
            return Err(Error::Parse {
                path: p.clone(),
                reason: format!(
                    "line {}: {line:?} is neither a PCI address nor an mdev parent's name",
                    i + 1
                ),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(s: &str) -> PciAddress {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e:?}"))
    }

    fn members(gpus: &[&str], parents: &[&str]) -> Members {
        Members {
            gpus: gpus.iter().map(|s| gpu(s)).collect(),
            parents: parents.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn written_then_read_and_a_bad_line_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        assert!(load(&paths).unwrap().is_empty());
        let m = members(&["0000:41:00.0"], &["mtty"]);
        write(&paths, &m).unwrap();
        assert_eq!(
            std::fs::read_to_string(path(&paths)).unwrap(),
            "0000:41:00.0\nmtty\n"
        );
        assert_eq!(load(&paths).unwrap(), m);
        std::fs::write(path(&paths), "0000:41:00.0\n0000:61:00\n").unwrap();
        let e = load(&paths).unwrap_err().to_string();
        assert!(
            e.contains("on-demand-pool") && e.contains("line 2") && e.contains("0000:61:00"),
            "{e}"
        );
        write(&paths, &Members::default()).unwrap();
        assert!(!path(&paths).exists());
    }

    #[test]
    fn a_gpu_or_a_parent_has_one_owner() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        write(&paths, &members(&["0000:41:00.0"], &["mtty"])).unwrap();
        for (clash, named) in [
            (
                members(&["0000:41:00.0", "0000:61:00.0"], &[]),
                "0000:41:00.0",
            ),
            (members(&["0000:61:00.0"], &["mtty"]), "mdev parent mtty"),
        ] {
            let e = write_dra(&paths, &clash).unwrap_err().to_string();
            assert!(e.contains(named) && e.contains("on-demand-pool"), "{e}");
            assert!(!dra_path(&paths).exists(), "nothing written");
        }
        let dra = members(&["0000:61:00.0"], &["mtty-2"]);
        write_dra(&paths, &dra).unwrap();
        assert_eq!(load_dra(&paths).unwrap(), dra);
        let dra = load_dra(&paths).unwrap();
        assert_eq!(
            load_owned(&paths).unwrap(),
            [
                (ON_DEMAND_OWNER, members(&["0000:41:00.0"], &["mtty"])),
                (DRA_OWNER, dra)
            ]
        );
        write_dra(&paths, &Members::default()).unwrap();
        assert!(!dra_path(&paths).exists());
    }
}
