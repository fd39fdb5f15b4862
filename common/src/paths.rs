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

/// Whether `s` can be a non-PCI mdev parent's name under `class/mdev_bus/`: a kernel device
/// name of letters, digits, `-`, `_` and `.` (not `.` or `..`). A `:` is refused: a PCI
/// function is named by its full address (`0000:41:00.0`), and `0000:41:00` is a typo of one.
pub fn is_parent_name(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The host path of a VFIO device cdev (`/dev/vfio/devices/vfio0`).
pub fn host_vfio_cdev_path(name: &str) -> String {
    format!("/dev/vfio/devices/{name}")
}

/// kubelet's device-plugin directory under the host root, unless `--kubelet-dir` says otherwise.
pub const DEFAULT_KUBELET_DIR: &str = "var/lib/kubelet/device-plugins";
/// The file in the device-plugin directory where kubelet records which devices it allocated.
pub const KUBELET_CHECKPOINT: &str = "kubelet_internal_checkpoint";

/// Paths under one host root. In a pod the host's `/` is mounted somewhere (`/host`); tests and
/// node-sim point it at a directory.
///
/// kubelet's directories are the exception: a kubelet whose root is not `/var/lib/kubelet`
/// (k0s, microk8s, some OpenShift and RKE layouts) is found through
/// [`HostPaths::with_kubelet_dir`] (`--kubelet-dir`), and its PodResources socket through
/// [`HostPaths::with_pod_resources_socket`] (`--pod-resources-socket`). Both are paths as this
/// process sees them (in a pod, under `/host`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPaths {
    root: PathBuf,
    kubelet_dir: PathBuf,
    pod_resources_socket: Option<PathBuf>,
}

impl HostPaths {
    /// Paths under `root`, kubelet's at their default places under it.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        HostPaths {
            kubelet_dir: root.join(DEFAULT_KUBELET_DIR),
            root,
            pod_resources_socket: None,
        }
    }

    /// kubelet's device-plugin directory is `dir` (`--kubelet-dir`); `None` keeps the default.
    pub fn with_kubelet_dir(mut self, dir: Option<PathBuf>) -> Self {
        if let Some(dir) = dir {
            self.kubelet_dir = dir;
        }
        self
    }

    /// kubelet's PodResources socket is `socket` (`--pod-resources-socket`); `None` keeps the
    /// default beside the device-plugin directory.
    pub fn with_pod_resources_socket(mut self, socket: Option<PathBuf>) -> Self {
        if socket.is_some() {
            self.pod_resources_socket = socket;
        }
        self
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

    /// `<root>/sys/kernel/iommu_groups/<group>/devices`: a link per function of the group.
    pub fn iommu_group_devices(&self, group: u32) -> PathBuf {
        self.root
            .join("sys/kernel/iommu_groups")
            .join(group.to_string())
            .join("devices")
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

    /// kubelet's device-plugin directory (holds `kubelet.sock`, the plugins' sockets and
    /// kubelet's checkpoint): `<root>/var/lib/kubelet/device-plugins` unless set.
    pub fn kubelet_dir(&self) -> &Path {
        &self.kubelet_dir
    }

    /// kubelet's record of the devices it allocated to pods: `<kubelet-dir>/kubelet_internal_checkpoint`.
    pub fn kubelet_checkpoint(&self) -> PathBuf {
        self.kubelet_dir.join(KUBELET_CHECKPOINT)
    }

    /// kubelet's root directory: the parent of the device-plugin directory
    /// (`<root>/var/lib/kubelet` by default).
    pub fn kubelet_root(&self) -> &Path {
        self.kubelet_dir.parent().unwrap_or(&self.kubelet_dir)
    }

    /// kubelet's PodResources socket: `pod-resources/kubelet.sock` in the kubelet root, the
    /// parent of the device-plugin directory, unless set.
    pub fn pod_resources_socket(&self) -> PathBuf {
        match &self.pod_resources_socket {
            Some(s) => s.clone(),
            None => self.kubelet_root().join("pod-resources/kubelet.sock"),
        }
    }

    /// The DRA drivers' directories: `<kubelet-root>/plugins`, one `<driver>/` each (its
    /// service socket; sandbox-dra's claim records under `claims/`).
    pub fn kubelet_plugins_dir(&self) -> PathBuf {
        self.kubelet_root().join("plugins")
    }

    /// The directories container runtimes read CDI specs from, as CDI defines them and
    /// containerd and CRI-O default to: `<root>/etc/cdi` and `<root>/var/run/cdi`.
    pub fn cdi_spec_dirs(&self) -> [PathBuf; 2] {
        [self.root.join("etc/cdi"), self.root.join("var/run/cdi")]
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

    /// The text of the running kernel's `modules.alias` ([`HostPaths::modules_alias`]).
    pub fn read_modules_alias(&self) -> Result<String> {
        let path = self.modules_alias()?;
        std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))
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
            Path::new("/host/var/lib/kubelet/device-plugins")
        );
        assert_eq!(
            p.pod_resources_socket(),
            PathBuf::from("/host/var/lib/kubelet/pod-resources/kubelet.sock")
        );
        assert_eq!(host_vfio_group_path(42), "/dev/vfio/42");
    }

    #[test]
    fn the_pod_resources_socket_follows_the_kubelet_dir_unless_set() {
        let k0s = HostPaths::new("/host")
            .with_kubelet_dir(Some("/host/var/lib/k0s/kubelet/device-plugins".into()));
        assert_eq!(
            k0s.kubelet_checkpoint(),
            PathBuf::from("/host/var/lib/k0s/kubelet/device-plugins/kubelet_internal_checkpoint")
        );
        assert_eq!(
            k0s.pod_resources_socket(),
            PathBuf::from("/host/var/lib/k0s/kubelet/pod-resources/kubelet.sock")
        );
        let set = k0s
            .clone()
            .with_pod_resources_socket(Some("/run/pr.sock".into()))
            .with_kubelet_dir(None);
        assert_eq!(set.pod_resources_socket(), PathBuf::from("/run/pr.sock"));
        assert_eq!(set.kubelet_dir(), k0s.kubelet_dir());
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
