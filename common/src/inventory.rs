//! One consistent read of the node: PCI functions, IOMMU groups, SR-IOV VFs, mdev parents,
//! types and instances, NVIDIA SR-IOV vGPU VFs and the VFIO group nodes that exist.
//!
//! A device whose files are odd (missing, garbage, dangling links) is listed in
//! [`Inventory::unreadable`] and left out; the rest of the node is still returned.
//!
//! This module holds the inventory's types and the one read that fills them; the sysfs
//! attribute and link readers it uses are `sysfs`, the per-event re-reads `refresh`, the
//! iommufd nodes `dev_nodes`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::Serialize;

use crate::error::Result;
use crate::paths::HostPaths;
use crate::pci::PciAddress;

mod dev_nodes;
mod refresh;
mod sysfs;

pub use dev_nodes::DevNodes;
pub(crate) use sysfs::{TypeNames, link_name, list_dir};

pub use crate::error::error_chain;
use sysfs::{is_not_found, link_number, read_mdev, read_mdev_types, read_pci_device};
pub use sysfs::{parse_creatable_vgpu_types, read_parent_mdev_types};

/// What [`Inventory::read_with`] reads.
#[derive(Clone, Debug)]
pub struct ReadOptions {
    /// Read every mdev parent's supported types (name, available instances, ...). Costly on
    /// nodes with many VFs (an Ampere GPU lists ~30 types on each of its VFs); readers that only
    /// need existing vGPUs turn it off. Instances always carry their type id and name.
    pub mdev_types: bool,
    /// Read a VF's own identity (vendor, device, subsystem, class, modalias, NUMA node,
    /// `driver_override`). Without it a VF gets its PF's (an NVIDIA GPU's VFs carry its ids):
    /// a GPU's VFs are dozens of functions whose identity neither a vGPU planner nor the device
    /// plugin looks at, while their driver, group, `physfn`, vGPU state and VFIO cdev are
    /// always read. A VF on a VFIO driver (passed through on its own) is always read in full.
    pub vf_identity: bool,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            mdev_types: true,
            vf_identity: true,
        }
    }
}

/// A device or file that could not be read; it is left out of the inventory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Unreadable {
    /// The sysfs path.
    pub path: PathBuf,
    /// Why.
    pub reason: String,
}

/// An NVIDIA vGPU type offered by a VF on the vendor-specific (non-mdev) path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VgpuType {
    /// Numeric type id (`1145`), the same as the mdev `nvidia-1145` number.
    pub id: u32,
    /// Type name (`NVIDIA L40S-1B`).
    pub name: String,
}

/// The vendor-specific vGPU state of one VF (`<vf>/nvidia/`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NvidiaVgpu {
    /// Types this VF can create now (`creatable_vgpu_types`).
    pub creatable: Vec<VgpuType>,
    /// The type configured on the VF (`current_vgpu_type`), 0 when free.
    pub current: u32,
    /// The name of the current type, when the creatable list (or a sibling's) names it.
    pub current_name: Option<String>,
}

/// One mdev type of a parent (`mdev_supported_types/<id>`). Its instances are the
/// inventory's [`Inventory::mdevs`] of this parent and type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MdevType {
    /// The type id, the directory name (`nvidia-558`, `mtty-2`).
    pub id: String,
    /// `name`, when the driver provides it (`NVIDIA A10-4Q`).
    pub name: Option<String>,
    /// `available_instances`.
    pub available_instances: u32,
    /// `description`, absent on some drivers.
    pub description: Option<String>,
}

/// A device that can create mdevs (`/sys/class/mdev_bus/<name>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MdevParent {
    /// The entry name: a PCI address, or a driver's name for virtual parents (`mtty`).
    pub name: String,
    /// The parent's PCI address, when it is a PCI function.
    pub pci: Option<PciAddress>,
    /// Supported types (empty when read with `mdev_types: false`).
    pub types: Vec<MdevType>,
}

/// A mediated device (`/sys/bus/mdev/devices/<uuid>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MdevDevice {
    /// Lower-case UUID.
    pub uuid: String,
    /// The type id (`nvidia-558`).
    pub type_id: String,
    /// The type's name (`NVIDIA A10-4Q`), when the driver provides one.
    pub type_name: Option<String>,
    /// The parent's name (`0000:41:00.4`, `mtty`).
    pub parent: String,
    /// The parent's PCI address, when it is a PCI function.
    pub parent_pci: Option<PciAddress>,
    /// The mdev's own IOMMU group.
    pub iommu_group: Option<u32>,
    /// The driver bound to the mdev (`vfio_mdev`), if any.
    pub driver: Option<String>,
    /// Its VFIO character device (`vfio0` under `vfio-dev/`), on kernels with iommufd.
    pub vfio_cdev: Option<String>,
}

/// One PCI function.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PciDevice {
    /// Address.
    pub address: PciAddress,
    /// `vendor`.
    pub vendor: u16,
    /// `device`.
    pub device: u16,
    /// `subsystem_vendor` (0 when absent).
    pub subsystem_vendor: u16,
    /// `subsystem_device` (0 when absent).
    pub subsystem_device: u16,
    /// `class`, 24 bits (`0x030200`).
    pub class: u32,
    /// The bound driver's name (`driver` link).
    pub driver: Option<String>,
    /// `driver_override`, `None` when it reads `(null)`.
    pub driver_override: Option<String>,
    /// The IOMMU group (`iommu_group` link).
    pub iommu_group: Option<u32>,
    /// `numa_node`, `None` when -1 or absent.
    pub numa_node: Option<i32>,
    /// The PF of a VF (`physfn`).
    pub physfn: Option<PciAddress>,
    /// The VFs of a PF (`virtfnN`), in N order.
    pub virtfns: Vec<PciAddress>,
    /// `sriov_totalvfs`.
    pub sriov_totalvfs: Option<u32>,
    /// `sriov_numvfs`.
    pub sriov_numvfs: Option<u32>,
    /// `modalias`.
    pub modalias: Option<String>,
    /// The bridge or port the function sits under (its parent in `/sys/devices`); GPUs under one
    /// PCIe switch share an upstream bridge's upstream bridge.
    pub upstream_bridge: Option<PciAddress>,
    /// The whole chain of bridges above the function, nearest first.
    pub bridges: Vec<PciAddress>,
    /// The PCIe root complex the function sits under, as sysfs names its directory
    /// (`pci0000:40` for `/sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0`): the value of
    /// Kubernetes' standard device attribute `resource.kubernetes.io/pcieRoot`.
    pub pcie_root: Option<String>,
    /// The VFIO cdev name (`vfio0`) under `<dev>/vfio-dev/`, when the kernel has them.
    pub vfio_cdev: Option<String>,
    /// mdev types, when this function is an mdev parent (and types were read).
    pub mdev_types: Vec<MdevType>,
    /// Whether this function is an mdev parent (`mdev_supported_types` exists).
    pub mdev_parent: bool,
    /// Vendor-path vGPU state, when `<dev>/nvidia/creatable_vgpu_types` exists.
    pub nvidia_vgpu: Option<NvidiaVgpu>,
}

impl PciDevice {
    /// A function with these ids and nothing else known: no driver, group, subsystem, NUMA
    /// node, SR-IOV, bridges or vGPU state. For building inventories by hand (tests, tools).
    pub fn new(address: PciAddress, vendor: u16, device: u16, class: u32) -> PciDevice {
        PciDevice {
            address,
            vendor,
            device,
            subsystem_vendor: 0,
            subsystem_device: 0,
            class,
            driver: None,
            driver_override: None,
            iommu_group: None,
            numa_node: None,
            physfn: None,
            virtfns: Vec::new(),
            sriov_totalvfs: None,
            sriov_numvfs: None,
            modalias: None,
            upstream_bridge: None,
            bridges: Vec::new(),
            pcie_root: None,
            vfio_cdev: None,
            mdev_types: Vec::new(),
            mdev_parent: false,
            nvidia_vgpu: None,
        }
    }

    /// Display controller: VGA (0x0300) or 3D (0x0302).
    pub fn is_display(&self) -> bool {
        matches!(self.class >> 8, 0x0300 | 0x0302)
    }

    /// A bridge (class 0x06xx): never bound to VFIO.
    pub fn is_bridge(&self) -> bool {
        self.class >> 16 == 0x06
    }

    /// An SR-IOV virtual function.
    pub fn is_vf(&self) -> bool {
        self.physfn.is_some()
    }

    /// `VVVV:DDDD` in lower-case hex.
    pub fn id_string(&self) -> String {
        format!("{:04x}:{:04x}", self.vendor, self.device)
    }
}

/// One snapshot of the node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Inventory {
    /// Every readable PCI function, by address.
    pub devices: BTreeMap<PciAddress, PciDevice>,
    /// What could not be read.
    pub unreadable: Vec<Unreadable>,
    /// mdev parents by name.
    pub mdev_parents: BTreeMap<String, MdevParent>,
    /// mdev instances by lower-case UUID.
    pub mdevs: BTreeMap<String, MdevDevice>,
    /// Groups whose `<root>/dev/vfio/<group>` node exists.
    pub vfio_nodes: BTreeSet<u32>,
    /// Functions that could not be read but whose IOMMU group could, by group: a group is
    /// given to a VM whole, so a member nobody can vouch for matters.
    pub unreadable_in_group: BTreeMap<u32, Vec<PciAddress>>,
    /// `/dev/iommu` and the VFIO cdevs under `/dev/vfio/devices/`.
    pub dev_nodes: DevNodes,
}

impl Inventory {
    /// Reads everything, mdev types included.
    pub fn read(paths: &HostPaths) -> Result<Inventory> {
        Self::read_with(paths, &ReadOptions::default())
    }

    /// Reads the node. Fails only when the PCI device list itself cannot be listed; odd devices
    /// go to [`Inventory::unreadable`].
    pub fn read_with(paths: &HostPaths, opts: &ReadOptions) -> Result<Inventory> {
        let mut inv = Inventory::default();
        let mut type_names = TypeNames::default();
        let pci_dir = paths.pci_devices();
        for name in list_dir(&pci_dir)? {
            let path = pci_dir.join(&name);
            let Ok(address) = name.parse::<PciAddress>() else {
                inv.unreadable.push(Unreadable {
                    path,
                    reason: "entry name is not a PCI address".into(),
                });
                continue;
            };
            inv.read_function(path, address, opts, &mut type_names);
        }
        if !opts.vf_identity {
            inv.fill_vf_identity();
        }
        inv.read_mdev_parents(paths, opts);
        inv.read_mdevs(paths);
        inv.fill_vendor_vgpu_names(paths);
        inv.dev_nodes = DevNodes::read(paths);
        match list_dir(&paths.dev_vfio()) {
            Ok(names) => inv.vfio_nodes = names.iter().filter_map(|n| n.parse().ok()).collect(),
            Err(e) if is_not_found(&e) => {}
            Err(e) => inv.unreadable.push(Unreadable {
                path: paths.dev_vfio(),
                reason: error_chain(&e),
            }),
        }
        Ok(inv)
    }

    /// Reads one function into the inventory (or into [`Inventory::unreadable`]). Returns the
    /// UUIDs of the mdevs under it, `None` when it is gone or could not be read.
    fn read_function(
        &mut self,
        path: PathBuf,
        address: PciAddress,
        opts: &ReadOptions,
        type_names: &mut TypeNames,
    ) -> Option<Vec<String>> {
        match read_pci_device(&path, address, opts, type_names) {
            Ok(Some((dev, mdevs))) => {
                self.devices.insert(address, dev);
                Some(mdevs)
            }
            Ok(None) => None, // vanished while we read it
            Err(e) => {
                if let Ok(Some(g)) = link_number(&path.join("iommu_group")) {
                    self.unreadable_in_group.entry(g).or_default().push(address);
                }
                self.unreadable.push(Unreadable {
                    path,
                    reason: error_chain(&e),
                });
                None
            }
        }
    }

    /// VFs read without their identity take their PF's (ids, class, modalias, NUMA node).
    fn fill_vf_identity(&mut self) {
        let vfs: Vec<(PciAddress, PciAddress)> = self
            .devices
            .values()
            .filter(|d| d.vendor == 0 && d.class == 0)
            .filter_map(|d| Some((d.address, d.physfn?)))
            .collect();
        for (vf, pf) in vfs {
            let Some(p) = self.devices.get(&pf).cloned() else {
                continue;
            };
            if let Some(d) = self.devices.get_mut(&vf) {
                d.vendor = p.vendor;
                d.device = p.device;
                d.subsystem_vendor = p.subsystem_vendor;
                d.subsystem_device = p.subsystem_device;
                d.class = p.class;
                d.modalias = p.modalias;
                d.numa_node = p.numa_node;
            }
        }
    }

    /// The device at `a`.
    pub fn device(&self, a: &PciAddress) -> Option<&PciDevice> {
        self.devices.get(a)
    }

    /// The PCI functions in IOMMU group `group`, in address order.
    pub fn group_members(&self, group: u32) -> Vec<PciAddress> {
        self.devices
            .values()
            .filter(|d| d.iommu_group == Some(group))
            .map(|d| d.address)
            .collect()
    }

    /// Display-class physical functions (VFs excluded) of `vendor` (any vendor when `None`), in
    /// address order: the GPUs of the node.
    pub fn gpus(&self, vendor: Option<u16>) -> Vec<&PciDevice> {
        self.devices
            .values()
            .filter(|d| d.is_display() && !d.is_vf() && vendor.is_none_or(|v| d.vendor == v))
            .collect()
    }

    /// The mdevs whose parent is `parent` (a PCI address string or a virtual parent's name).
    pub fn mdevs_of(&self, parent: &str) -> Vec<&MdevDevice> {
        self.mdevs.values().filter(|m| m.parent == parent).collect()
    }

    fn read_mdev_parents(&mut self, paths: &HostPaths, opts: &ReadOptions) {
        let dir = paths.mdev_bus();
        let names = match list_dir(&dir) {
            Ok(n) => n,
            Err(e) if is_not_found(&e) => return,
            Err(e) => {
                self.unreadable.push(Unreadable {
                    path: dir,
                    reason: error_chain(&e),
                });
                return;
            }
        };
        for name in names {
            let path = dir.join(&name);
            let pci = name.parse::<PciAddress>().ok();
            let types = match pci.and_then(|a| self.devices.get(&a)) {
                Some(dev) => dev.mdev_types.clone(),
                None if opts.mdev_types => match read_mdev_types(&path, None) {
                    Ok(t) => t,
                    Err(e) => {
                        self.unreadable.push(Unreadable {
                            path,
                            reason: error_chain(&e),
                        });
                        continue;
                    }
                },
                None => Vec::new(),
            };
            self.mdev_parents
                .insert(name.clone(), MdevParent { name, pci, types });
        }
    }

    fn read_mdevs(&mut self, paths: &HostPaths) {
        let dir = paths.mdev_devices();
        let names = match list_dir(&dir) {
            Ok(n) => n,
            Err(e) if is_not_found(&e) => return,
            Err(e) => {
                self.unreadable.push(Unreadable {
                    path: dir,
                    reason: error_chain(&e),
                });
                return;
            }
        };
        for name in names {
            self.read_mdev_entry(dir.join(&name), &name);
        }
    }

    /// Reads one mdev (`<mdev bus>/devices/<name>`) into the inventory (or into
    /// [`Inventory::unreadable`]); returns its IOMMU group.
    fn read_mdev_entry(&mut self, path: PathBuf, name: &str) -> Option<u32> {
        match read_mdev(&path, name) {
            Ok(Some(mut m)) => {
                if m.type_name.is_none() {
                    m.type_name = self
                        .mdev_parents
                        .get(&m.parent)
                        .and_then(|p| p.types.iter().find(|t| t.id == m.type_id))
                        .and_then(|t| t.name.clone());
                }
                let group = m.iommu_group;
                self.mdevs.insert(m.uuid.clone(), m);
                group
            }
            Ok(None) => None,
            Err(e) => {
                self.unreadable.push(Unreadable {
                    path,
                    reason: error_chain(&e),
                });
                None
            }
        }
    }

    /// A VF's creatable list stops naming its own type once it is set; name it from a sibling,
    /// else from the names `apply` recorded while the lists showed them
    /// ([`crate::state::vgpu_names`]).
    fn fill_vendor_vgpu_names(&mut self, paths: &HostPaths) {
        let mut names: BTreeMap<u32, String> = BTreeMap::new();
        let mut remembered: Option<BTreeMap<u32, String>> = None;
        for d in self.devices.values() {
            if let Some(v) = &d.nvidia_vgpu {
                for t in &v.creatable {
                    names.entry(t.id).or_insert_with(|| t.name.clone());
                }
            }
        }
        for d in self.devices.values_mut() {
            if let Some(v) = &mut d.nvidia_vgpu
                && v.current != 0
                && v.current_name.is_none()
            {
                v.current_name = names.get(&v.current).cloned().or_else(|| {
                    remembered
                        .get_or_insert_with(|| crate::state::vgpu_names::load(paths))
                        .get(&v.current)
                        .cloned()
                });
            }
        }
    }
}

/// Whether a PCI driver is VFIO: `vfio-pci` or a variant driver (`nvgrace_gpu_vfio_pci`,
/// `mlx5_vfio_pci`).
pub fn is_vfio_driver(driver: &str) -> bool {
    driver == "vfio-pci"
        || driver == "vfio_pci"
        || driver.ends_with("_vfio_pci")
        || driver.ends_with("-vfio-pci")
}
