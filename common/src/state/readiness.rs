//! Readiness files: `<host-root>/run/nvidia/validations/<name>`, present while a daemon vouches
//! for the node (every selected GPU bound; the vGPU profile applied). Whatever waits on one (an
//! init container polling for it) sees it whole or not at all.
//!
//! A file means "true now": its daemon removes one it finds at start and writes it again only
//! once it has verified the node itself, so a file a crashed daemon left says nothing for long.
//! A waiter waits for the file of the node's workload (the node label
//! [`WORKLOAD_LABEL`], [`for_workload`]), never for another's: a node relabelled from
//! passthrough to vGPU may still have `vfio-pci-ready` from a vfio-manager killed on the way.

use std::path::PathBuf;

use crate::error::Result;
use crate::paths::HostPaths;

/// vfio-manager's: every selected function is bound to its VFIO driver.
pub const VFIO_PCI_READY: &str = "vfio-pci-ready";

/// vgpu-device-manager's: the node's vGPU profile is applied.
pub const VGPU_DEVICES_READY: &str = "vgpu-devices-ready";

/// The node label naming the node's workload (the GPU Operator's, which the deployment schedules
/// by).
pub const WORKLOAD_LABEL: &str = "nvidia.com/gpu.workload.config";

/// The readiness file that says a node of `workload` is prepared for the device plugin:
/// `vm-passthrough` → [`VFIO_PCI_READY`], `vm-vgpu` → [`VGPU_DEVICES_READY`]; `None` for any
/// other workload (no daemon of ours prepares it for the device plugin).
pub fn for_workload(workload: &str) -> Option<&'static str> {
    match workload {
        "vm-passthrough" => Some(VFIO_PCI_READY),
        "vm-vgpu" => Some(VGPU_DEVICES_READY),
        _ => None,
    }
}

/// `<host-root>/run/nvidia/validations/<name>`.
pub fn path(paths: &HostPaths, name: &str) -> PathBuf {
    paths.validations_dir().join(name)
}

/// Writes readiness file `name` with `body`, atomically ([`super::write_atomic`]).
pub fn set(paths: &HostPaths, name: &str, body: &str) -> Result<()> {
    super::write_atomic(&path(paths, name), body.as_bytes())
}

/// Removes readiness file `name`; `Ok(true)` when there was one to remove.
pub fn withdraw(paths: &HostPaths, name: &str) -> Result<bool> {
    super::remove_if_present(&path(paths, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_replaces_and_withdraw_removes() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        let file = dir.path().join("run/nvidia/validations/x-ready");
        assert_eq!(path(&p, "x-ready"), file);
        set(&p, "x-ready", "0000:1b:00.0 vfio-pci 7\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "0000:1b:00.0 vfio-pci 7\n"
        );
        set(&p, "x-ready", "").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "");
        let listed: Vec<_> = std::fs::read_dir(file.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(listed, ["x-ready"]);
        assert!(withdraw(&p, "x-ready").unwrap());
        assert!(!file.exists());
        assert!(!withdraw(&p, "x-ready").unwrap());
    }

    #[test]
    fn each_workload_has_its_own_file() {
        assert_eq!(for_workload("vm-passthrough"), Some("vfio-pci-ready"));
        assert_eq!(for_workload("vm-vgpu"), Some("vgpu-devices-ready"));
        for other in ["", "vm-dra", "vm-vgpu-on-demand", "container"] {
            assert_eq!(for_workload(other), None, "{other}");
        }
    }

    #[test]
    fn a_file_that_cannot_be_written_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        // A file where the validations directory should be.
        std::fs::create_dir_all(dir.path().join("run/nvidia")).unwrap();
        std::fs::write(dir.path().join("run/nvidia/validations"), "").unwrap();
        let err = set(&p, "x-ready", "").unwrap_err();
        assert!(
            err.to_string().contains("run/nvidia/validations/x-ready"),
            "{err}"
        );
    }
}
