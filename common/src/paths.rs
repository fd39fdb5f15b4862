//! Every path the daemons use, derived from one host root (`--host-root`, default `/`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The host container path handed to kubelet for the VFIO container device.
pub const HOST_VFIO_CONTAINER: &str = "/dev/vfio/vfio";
/// The host path of the iommufd character device.
pub const HOST_IOMMUFD: &str = "/dev/iommu";

/// The host path of an IOMMU group's VFIO node, as kubelet and the container runtime see it.
/// Never prefixed with the host root: the runtime opens it on the host.
pub fn host_vfio_group_path(group: u32) -> String {
    format!("/dev/vfio/{group}")
}

/// The host path of a VFIO device cdev (`/dev/vfio/devices/vfio0`).
pub fn host_vfio_cdev_path(name: &str) -> String {
    format!("/dev/vfio/devices/{name}")
}

/// Paths under one host root. In a pod the host's `/` is mounted somewhere (`/host`); tests and
/// node-sim point it at a directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPaths {
    root: PathBuf,
}

impl HostPaths {
    /// Paths under `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        HostPaths { root: root.into() }
    }

    /// The host root itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/sys`.
    pub fn sys(&self) -> PathBuf {
        self.root.join("sys")
    }

    /// `<root>/sys/bus/pci/devices`.
    pub fn pci_devices(&self) -> PathBuf {
        self.root.join("sys/bus/pci/devices")
    }

    /// `<root>/sys/bus/pci/devices/<addr>`.
    pub fn pci_device(&self, addr: &crate::PciAddress) -> PathBuf {
        self.pci_devices().join(addr.to_string())
    }

    /// `<root>/sys/bus/pci/drivers`.
    pub fn pci_drivers(&self) -> PathBuf {
        self.root.join("sys/bus/pci/drivers")
    }

    /// `<root>/sys/bus/pci/drivers_probe`.
    pub fn drivers_probe(&self) -> PathBuf {
        self.root.join("sys/bus/pci/drivers_probe")
    }

    /// `<root>/sys/class/mdev_bus`.
    pub fn mdev_bus(&self) -> PathBuf {
        self.root.join("sys/class/mdev_bus")
    }

    /// `<root>/sys/bus/mdev/devices`.
    pub fn mdev_devices(&self) -> PathBuf {
        self.root.join("sys/bus/mdev/devices")
    }

    /// `<root>/dev`.
    pub fn dev(&self) -> PathBuf {
        self.root.join("dev")
    }

    /// `<root>/dev/vfio`.
    pub fn dev_vfio(&self) -> PathBuf {
        self.root.join("dev/vfio")
    }

    /// `<root>/dev/vfio/<group>`.
    pub fn vfio_group_node(&self, group: u32) -> PathBuf {
        self.dev_vfio().join(group.to_string())
    }

    /// `<root>/dev/vfio/devices` (iommufd-era VFIO cdevs).
    pub fn vfio_cdev_dir(&self) -> PathBuf {
        self.dev_vfio().join("devices")
    }

    /// `<root>/dev/iommu`.
    pub fn iommufd(&self) -> PathBuf {
        self.root.join("dev/iommu")
    }

    /// `<root>/proc`.
    pub fn proc(&self) -> PathBuf {
        self.root.join("proc")
    }

    /// `<root>/run/nvidia/validations`, where readiness files live.
    pub fn validations_dir(&self) -> PathBuf {
        self.root.join("run/nvidia/validations")
    }

    /// `<root>/var/lib/kubelet/device-plugins`.
    pub fn kubelet_dir(&self) -> PathBuf {
        self.root.join("var/lib/kubelet/device-plugins")
    }

    /// The running kernel's release, from `<root>/proc/sys/kernel/osrelease`.
    pub fn kernel_release(&self) -> Result<String> {
        let path = self.root.join("proc/sys/kernel/osrelease");
        let s = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let s = s.trim();
        if s.is_empty() || s.contains('/') {
            return Err(Error::Parse {
                path,
                reason: format!("not a kernel release: {s:?}"),
            });
        }
        Ok(s.to_string())
    }

    /// `<root>/lib/modules/<release>/modules.alias` for the running kernel.
    pub fn modules_alias(&self) -> Result<PathBuf> {
        let release = self.kernel_release()?;
        Ok(self
            .root
            .join("lib/modules")
            .join(release)
            .join("modules.alias"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_under_the_root() {
        let p = HostPaths::new("/host");
        assert_eq!(p.vfio_group_node(42), PathBuf::from("/host/dev/vfio/42"));
        assert_eq!(
            p.kubelet_dir(),
            PathBuf::from("/host/var/lib/kubelet/device-plugins")
        );
        assert_eq!(host_vfio_group_path(42), "/dev/vfio/42");
    }

    #[test]
    fn modules_alias_follows_the_release() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("proc/sys/kernel")).unwrap();
        std::fs::write(
            dir.path().join("proc/sys/kernel/osrelease"),
            "6.1.0-9-amd64\n",
        )
        .unwrap();
        let p = HostPaths::new(dir.path());
        assert_eq!(
            p.modules_alias().unwrap(),
            dir.path().join("lib/modules/6.1.0-9-amd64/modules.alias")
        );
    }
}
