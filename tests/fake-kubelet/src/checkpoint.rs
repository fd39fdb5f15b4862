//! kubelet's device-manager checkpoint, `<kubelet-dir>/kubelet_internal_checkpoint`, written
//! in the JSON shape kubelet writes (`checkpoint.Data` of kubelet's devicemanager):
//!
//! ```json
//! {"Data":{"PodDeviceEntries":[{"PodUID":"…","ContainerName":"compute",
//!   "ResourceName":"nvidia.com/NVIDIA_A10-4Q","DeviceIDs":{"-1":["<uuid>"]},
//!   "AllocResp":"<base64 of the ContainerAllocateResponse>"}],
//!   "RegisteredDevices":{"nvidia.com/NVIDIA_A10-4Q":["<uuid>"]}},"Checksum":…}
//! ```
//!
//! `DeviceIDs` is keyed by NUMA node (`"-1"` when the plugin reported no topology).
//! `Checksum` is a hash of Go's printing of `Data` that only kubelet computes; readers other
//! than kubelet cannot check it, so any number stands in.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use kubelet_api::deviceplugin::v1beta1::ContainerAllocateResponse;
use prost::Message as _;

/// One `PodDeviceEntries` item: a container's devices of one resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// `PodUID`.
    pub pod_uid: String,
    /// `ContainerName`.
    pub container: String,
    /// `ResourceName`.
    pub resource: String,
    /// The NUMA node the IDs are keyed by; `None` is kubelet's `-1` (no topology).
    pub numa: Option<i64>,
    /// `DeviceIDs`.
    pub ids: Vec<String>,
}

/// An entry without topology.
pub fn entry(pod_uid: &str, container: &str, resource: &str, ids: &[&str]) -> Entry {
    Entry {
        pod_uid: pod_uid.into(),
        container: container.into(),
        resource: resource.into(),
        numa: None,
        ids: ids.iter().map(|s| s.to_string()).collect(),
    }
}

/// The checkpoint's JSON text for `entries`.
pub fn json(entries: &[Entry]) -> String {
    let mut registered: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let items: Vec<serde_json::Value> = entries
        .iter()
        .map(|e| {
            registered
                .entry(&e.resource)
                .or_default()
                .extend(e.ids.iter().map(String::as_str));
            let numa = e.numa.unwrap_or(-1).to_string();
            serde_json::json!({
                "PodUID": e.pod_uid,
                "ContainerName": e.container,
                "ResourceName": e.resource,
                "DeviceIDs": { numa: e.ids },
                "AllocResp": base64(&alloc_resp(e).encode_to_vec()),
            })
        })
        .collect();
    serde_json::json!({
        "Data": {
            "PodDeviceEntries": items,
            "RegisteredDevices": registered,
        },
        "Checksum": 2_939_453_716_u64,
    })
    .to_string()
}

/// Writes the checkpoint into `kubelet_dir` as kubelet does (a temporary file renamed over it).
pub fn write(kubelet_dir: &Path, entries: &[Entry]) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(kubelet_dir)
        .with_context(|| format!("creating {}", kubelet_dir.display()))?;
    let path = kubelet_dir.join("kubelet_internal_checkpoint");
    let tmp = kubelet_dir.join(".kubelet_internal_checkpoint.tmp");
    std::fs::write(&tmp, json(entries)).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(path)
}

/// What the plugin answered Allocate with, as sandbox-dp answers: the IDs in an env var.
fn alloc_resp(e: &Entry) -> ContainerAllocateResponse {
    let r = e.resource.to_ascii_uppercase().replace(['/', '.'], "_");
    let mdev = e.ids.iter().any(|id| id.contains('-'));
    let var = if mdev {
        format!("MDEV_PCI_RESOURCE_{r}")
    } else {
        format!("PCI_RESOURCE_{r}")
    };
    ContainerAllocateResponse {
        envs: [(var, e.ids.join(","))].into(),
        ..Default::default()
    }
}

/// Standard base64 with padding, as Go's encoding/json writes a `[]byte`.
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ABC[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn the_json_has_kubelets_shape() {
        let v: serde_json::Value = serde_json::from_str(&json(&[entry(
            "6f1c",
            "compute",
            "nvidia.com/NVIDIA_A10-4Q",
            &["5a3b2c1d-0000-4000-8000-00000000abcd"],
        )]))
        .unwrap();
        let e = &v["Data"]["PodDeviceEntries"][0];
        assert_eq!(e["PodUID"], "6f1c");
        assert_eq!(
            e["DeviceIDs"]["-1"][0],
            "5a3b2c1d-0000-4000-8000-00000000abcd"
        );
        assert!(e["AllocResp"].as_str().unwrap().len() > 20);
        assert_eq!(
            v["Data"]["RegisteredDevices"]["nvidia.com/NVIDIA_A10-4Q"][0],
            "5a3b2c1d-0000-4000-8000-00000000abcd"
        );
        assert!(v["Checksum"].is_u64());
    }
}
