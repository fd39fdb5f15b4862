//! What sandbox-dp advertises: resources of devices, the kind each holds, and what kubelet is
//! told of each device. Discovery fills them from the node; the on-demand pool adds its slots.

use std::collections::{BTreeMap, BTreeSet};

use common::PciDevice;
use serde::Serialize;

/// The kubelet's health strings.
pub const HEALTHY: &str = "Healthy";
/// The kubelet's health strings.
pub const UNHEALTHY: &str = "Unhealthy";

/// Longest name part (after `/`) kubelet accepts in an extended resource name.
pub const MAX_NAME_LEN: usize = 63;

/// What kind of device a resource holds; decides the env var prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A whole PCI function on a VFIO driver.
    Passthrough,
    /// A mediated device.
    Mdev,
    /// An NVIDIA SR-IOV vGPU VF (vendor-specific VFIO path).
    SriovVgpu,
}

impl Kind {
    /// The KubeVirt env var prefix for this kind.
    pub fn env_prefix(self) -> &'static str {
        match self {
            Kind::Passthrough | Kind::SriovVgpu => "PCI_RESOURCE",
            Kind::Mdev => "MDEV_PCI_RESOURCE",
        }
    }
}

/// One advertised device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// PCI address or mdev UUID.
    pub id: String,
    /// `/dev/vfio/<group>` exists.
    pub healthy: bool,
    /// NUMA node of the device (of the parent GPU for mdevs).
    pub numa_node: Option<i32>,
    /// IOMMU group.
    pub iommu_group: Option<u32>,
    /// VFIO cdev name (`vfio3`), when the kernel has VFIO cdevs.
    pub vfio_cdev: Option<String>,
    /// The physical GPU this device lives on (itself for passthrough).
    pub gpu: Option<String>,
    /// The PCIe switch (its upstream port) above the GPU, or the root port when there is none.
    pub switch: Option<String>,
    /// Bound driver.
    pub driver: Option<String>,
}

/// One extended resource.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Resource {
    /// `nvidia.com/GA102GL_A10`.
    pub name: String,
    /// Kind of its devices.
    pub kind: Kind,
    /// `VVVV:DDDD` ids of its PCI devices (passthrough, SR-IOV vGPU), upper-case.
    pub pci_selectors: BTreeSet<String>,
    /// vGPU type names (mdev, SR-IOV vGPU).
    pub type_names: BTreeSet<String>,
    /// Devices by ID.
    pub devices: BTreeMap<String, DeviceInfo>,
    /// Its devices are on-demand slots ([`crate::ondemand`]): Allocate creates the vGPU.
    pub on_demand: bool,
}

impl Resource {
    pub(crate) fn new(name: String, kind: Kind) -> Self {
        Resource {
            name,
            kind,
            pci_selectors: BTreeSet::new(),
            type_names: BTreeSet::new(),
            devices: BTreeMap::new(),
            on_demand: false,
        }
    }

    /// The env var KubeVirt reads for this resource.
    pub fn env_var(&self) -> String {
        common::env_var_name(self.kind.env_prefix(), &self.name)
    }
}

/// The switch a device sits under: the bridge above its downstream port (`bridges[1]`), or
/// the only bridge (a root port) when it is attached directly.
pub(crate) fn switch_of(dev: &PciDevice) -> Option<String> {
    dev.bridges
        .get(1)
        .or(dev.bridges.first())
        .map(|a| a.to_string())
}
