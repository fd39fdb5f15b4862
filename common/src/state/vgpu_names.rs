//! Names of vendor-path vGPU types, remembered across the moment sysfs stops showing them.
//!
//! On the vendor-specific path a VF shows the types it can still create in
//! `nvidia/creatable_vgpu_types`; once a type is set on it, and on every VF once the GPU is
//! full, the list is empty (a header line only) and `current_vgpu_type` gives a bare number.
//! So vgpu-device-manager `apply`, the only writer, records every type the node's lists show
//! before it sets any ([`record`]), as `id → name` in `<root>/run/gpu-vm-node/vgpu-type-names`
//! (one `ID<TAB>NAME` line per type after the header `# gpu-vm-node vgpu-type-names v1`; a
//! file without it, the format before, reads the same). [`crate::Inventory`] names set VFs from there
//! ([`load`]) when no creatable list on the node names their type. The file lives in `/run`:
//! after a reboot the VFs are free again and the lists name every type.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::error::{Result, error_chain};
use crate::paths::HostPaths;

/// The format version the file is written in.
pub const VERSION: u32 = 1;

/// The record kind, as its header names it.
const KIND: &str = "vgpu-type-names";

/// `<root>/run/gpu-vm-node/vgpu-type-names`.
pub fn registry_path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/vgpu-type-names")
}

/// The remembered names; empty when nothing was recorded, or the file is of a newer format
/// (logged: the names are then read from sysfs alone). Malformed lines are skipped.
pub fn load(paths: &HostPaths) -> BTreeMap<u32, String> {
    let path = registry_path(paths);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return BTreeMap::new();
    };
    if let Err(e) = super::text_version(&path, KIND, VERSION, &text) {
        tracing::warn!(error = %error_chain(&e), "vGPU type names not remembered");
        return BTreeMap::new();
    }
    text.lines()
        .filter_map(|l| {
            let (id, name) = l.split_once('\t')?;
            Some((id.trim().parse().ok()?, name.trim().to_string()))
        })
        .filter(|(_, n): &(u32, String)| !n.is_empty())
        .collect()
}

/// Records every name in `seen` (every type the node's creatable lists show now), keeping the
/// others; writes nothing when nothing is new. The file is replaced whole
/// ([`super::write_atomic`]).
pub fn record(paths: &HostPaths, seen: impl IntoIterator<Item = (u32, String)>) -> Result<()> {
    let old = load(paths);
    let mut all = old.clone();
    all.extend(seen.into_iter().filter(|(_, n)| !n.is_empty()));
    if all == old {
        return Ok(());
    }
    let lines: String = all
        .iter()
        .map(|(id, name)| format!("{id}\t{name}\n"))
        .collect();
    let text = super::header(KIND, VERSION) + &lines;
    super::write_atomic(&registry_path(paths), text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_and_merges() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        assert!(load(&p).is_empty());
        record(&p, [(1006, "NVIDIA H100XM-40C".to_string())]).unwrap();
        record(
            &p,
            [(1147, "NVIDIA L40S-1Q".to_string()), (7, String::new())],
        )
        .unwrap();
        record(&p, [(1006, "NVIDIA H100XM-40C".to_string())]).unwrap();
        let m = load(&p);
        assert_eq!(m.len(), 2);
        assert_eq!(m[&1006], "NVIDIA H100XM-40C");
        assert_eq!(
            std::fs::read_to_string(registry_path(&p)).unwrap(),
            "# gpu-vm-node vgpu-type-names v1\n1006\tNVIDIA H100XM-40C\n1147\tNVIDIA L40S-1Q\n"
        );
        // The format before the header, with garbage: the good lines are read.
        std::fs::write(registry_path(&p), "garbage\n12\tA\n\t\nx\ty\n").unwrap();
        assert_eq!(
            load(&p).into_iter().collect::<Vec<_>>(),
            vec![(12, "A".to_string())]
        );
        // A newer format is not guessed at.
        std::fs::write(
            registry_path(&p),
            "# gpu-vm-node vgpu-type-names v9\n12\tA\n",
        )
        .unwrap();
        assert!(load(&p).is_empty());
    }
}
