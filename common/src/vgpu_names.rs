//! Names of vendor-path vGPU types, remembered across the moment sysfs stops showing them.
//!
//! On the vendor-specific path a VF shows the types it can still create in
//! `nvidia/creatable_vgpu_types`; once a type is set on it, and on every VF once the GPU is
//! full, the list is empty (a header line only) and `current_vgpu_type` gives a bare number.
//! So when [`crate::Sysfs::set_current_vgpu_type`] sets a type, it first reads the name from
//! the VF's list, and records `id → name` in `<root>/run/gpu-vm-node/vgpu-type-names` (one
//! `ID<TAB>NAME` line per type). [`crate::Inventory`] names set VFs from there when no
//! creatable list on the node names their type. The file lives in `/run`: after a reboot the
//! VFs are free again and the lists name every type.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::paths::HostPaths;

/// `<root>/run/gpu-vm-node/vgpu-type-names`.
pub fn registry_path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/vgpu-type-names")
}

/// The remembered names; empty when nothing was recorded. Malformed lines are skipped.
pub fn load(paths: &HostPaths) -> BTreeMap<u32, String> {
    let Ok(text) = std::fs::read_to_string(registry_path(paths)) else {
        return BTreeMap::new();
    };
    text.lines()
        .filter_map(|l| {
            let (id, name) = l.split_once('\t')?;
            Some((id.trim().parse().ok()?, name.trim().to_string()))
        })
        .filter(|(_, n): &(u32, String)| !n.is_empty())
        .collect()
}

/// Records `id → name`, keeping the others.
pub fn remember(paths: &HostPaths, id: u32, name: &str) -> Result<()> {
    remember_all(paths, [(id, name.to_string())])
}

/// Records every name in `seen` (for example every type the node's creatable lists show now),
/// keeping the others; writes nothing when nothing is new. Written to a temporary file and
/// renamed, so a reader never sees half a file.
pub fn remember_all(
    paths: &HostPaths,
    seen: impl IntoIterator<Item = (u32, String)>,
) -> Result<()> {
    let old = load(paths);
    let mut all = old.clone();
    all.extend(seen.into_iter().filter(|(_, n)| !n.is_empty()));
    if all == old {
        return Ok(());
    }
    let path = registry_path(paths);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    for (id, name) in &all {
        writeln!(f, "{id}\t{name}").map_err(|e| Error::io(&tmp, e))?;
    }
    drop(f);
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_and_merges() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        assert!(load(&p).is_empty());
        remember(&p, 1006, "NVIDIA H100XM-40C").unwrap();
        remember(&p, 1147, "NVIDIA L40S-1Q").unwrap();
        remember(&p, 1006, "NVIDIA H100XM-40C").unwrap();
        let m = load(&p);
        assert_eq!(m.len(), 2);
        assert_eq!(m[&1006], "NVIDIA H100XM-40C");
        std::fs::write(registry_path(&p), "garbage\n12\tA\n\t\nx\ty\n").unwrap();
        assert_eq!(
            load(&p).into_iter().collect::<Vec<_>>(),
            vec![(12, "A".to_string())]
        );
    }
}
