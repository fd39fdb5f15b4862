//! One consistent read of the node: PCI functions, IOMMU groups, SR-IOV VFs, mdev parents,
//! types and instances, NVIDIA SR-IOV vGPU VFs and the VFIO group nodes that exist.
//!
//! A device whose files are odd (missing, garbage, dangling links) is listed in
//! [`Inventory::unreadable`] and left out; the rest of the node is still returned.
//!
//! Over 800 lines on purpose: the inventory's types and the one read that fills them (with the
//! attribute and link readers it alone uses) are read together when a field changes; the
//! per-event re-reads (`refresh`) and the iommufd nodes (`dev_nodes`) are modules of their own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::paths::HostPaths;
use crate::pci::PciAddress;

mod dev_nodes;
mod refresh;

pub use dev_nodes::DevNodes;

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

/// The full message of an error and its sources, for reports.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

fn is_not_found(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
}

/// Names in a directory, sorted.
pub(crate) fn list_dir(dir: &Path) -> Result<Vec<String>> {
    let rd = fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut names = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        if let Some(n) = entry.file_name().to_str() {
            names.push(n.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// Whether a PCI driver is VFIO: `vfio-pci` or a variant driver (`nvgrace_gpu_vfio_pci`,
/// `mlx5_vfio_pci`).
pub fn is_vfio_driver(driver: &str) -> bool {
    driver == "vfio-pci"
        || driver == "vfio_pci"
        || driver.ends_with("_vfio_pci")
        || driver.ends_with("-vfio-pci")
}

/// A file's contents without surrounding whitespace; `None` when it does not exist.
pub(crate) fn read_opt(path: &Path) -> Result<Option<String>> {
    match read_attr(path) {
        Ok(s) => Ok(Some(s.trim().to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Reads a sysfs attribute: open and one `read` of up to a page, which is all an attribute
/// holds and all the kernel hands over in one go. `fs::read_to_string` would add an `fstat`
/// and a second `read` for the end of file: on a node of a few hundred attributes that is a
/// few hundred more round trips for nothing (many more on a FUSE tree such as node-sim).
/// A larger file (a long `creatable_vgpu_types`) is read on to its end.
fn read_attr(path: &Path) -> io::Result<String> {
    read_all(fs::File::open(path)?)
}

/// Reads an opened attribute: one `read` of a page, on to the end only if it filled the page.
/// The page is on the stack: zeroing it costs less than allocating a zeroed one per attribute,
/// and the string made from it is only as long as the value.
fn read_all(mut f: fs::File) -> io::Result<String> {
    use std::io::Read;
    let mut page = [0u8; 4096];
    let n = f.read(&mut page)?;
    let mut buf = page[..n].to_vec();
    if n == page.len() {
        f.read_to_end(&mut buf)?;
    }
    String::from_utf8(buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn parse_hex(path: &Path, s: &str) -> Result<u32> {
    let digits = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    if digits.is_empty() || digits.len() > 8 {
        return Err(Error::Parse {
            path: path.to_path_buf(),
            reason: format!("not a hex number: {s:?}"),
        });
    }
    u32::from_str_radix(digits, 16).map_err(|_| Error::Parse {
        path: path.to_path_buf(),
        reason: format!("not a hex number: {s:?}"),
    })
}

fn read_opt_u32(path: &Path) -> Result<Option<u32>> {
    read_opt(path)?
        .map(|s| {
            s.parse::<u32>().map_err(|_| Error::Parse {
                path: path.to_path_buf(),
                reason: format!("not a number: {s:?}"),
            })
        })
        .transpose()
}

/// The last component of a symlink's target; `None` when there is no link.
pub(crate) fn link_name(path: &Path) -> Result<Option<String>> {
    match fs::read_link(path) {
        Ok(t) => Ok(t
            .file_name()
            .and_then(|n| n.to_str())
            .map(|s| s.to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

fn link_number(path: &Path) -> Result<Option<u32>> {
    link_name(path)?
        .map(|n| {
            n.parse::<u32>().map_err(|_| Error::Parse {
                path: path.to_path_buf(),
                reason: format!("link does not end in a group number: {n:?}"),
            })
        })
        .transpose()
}

/// Where a sysfs link (`bus/pci/devices/<addr>` → `../../../devices/pci0000:00/…`) points, as
/// a path under the same root, checked to exist.
///
/// Resolved lexically rather than by `canonicalize`: sysfs's own links are relative and every
/// directory between `/sys` and a device is a real directory, so `..` may be folded without
/// looking; `realpath` would instead read every component of the path back as a possible link,
/// a round trip each on a FUSE tree and twenty per device on a node.
fn resolve_link(link: &Path) -> io::Result<PathBuf> {
    let target = fs::read_link(link)?;
    let joined = match link.parent() {
        Some(parent) if target.is_relative() => parent.join(&target),
        _ => target,
    };
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            std::path::Component::ParentDir => {
                // Fold `a/..`; keep a `..` that climbs above a relative host root.
                if matches!(
                    out.components().next_back(),
                    Some(std::path::Component::Normal(_))
                ) {
                    out.pop();
                } else {
                    out.push("..");
                }
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    fs::symlink_metadata(&out)?;
    Ok(out)
}

/// Reads one function; with it, the UUIDs of the mdevs whose directories sit in its own.
fn read_pci_device(
    link: &Path,
    address: PciAddress,
    opts: &ReadOptions,
    type_names: &mut TypeNames,
) -> Result<Option<(PciDevice, Vec<String>)>> {
    let dir = match resolve_link(link) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // A dangling link; a device that vanished has no link at all.
            if fs::symlink_metadata(link).is_ok() {
                return Err(Error::Parse {
                    path: link.to_path_buf(),
                    reason: "dangling link".into(),
                });
            }
            return Ok(None);
        }
        Err(e) => return Err(Error::io(link, e)),
    };
    // One open of the device directory; every attribute below is opened relative to it.
    let d = AttrDir::open(&dir)?;
    let bridges: Vec<PciAddress> = dir
        .ancestors()
        .skip(1)
        .map_while(|p| p.file_name()?.to_str()?.parse::<PciAddress>().ok())
        .collect();
    let mut virtfns: Vec<(u32, PciAddress)> = Vec::new();
    let mut mdev_parent = false;
    let mut vfio_cdev = None;
    let mut mdevs = Vec::new();
    // Optional attributes are opened only when the listing has them: a failed open costs as
    // much as a read, and most functions lack most of them (SR-IOV, physfn, nvidia/).
    let names = list_dir(&dir)?;
    let has = |n: &str| names.binary_search_by(|x| x.as_str().cmp(n)).is_ok();
    let driver = if has("driver") {
        d.link_name("driver")?
    } else {
        None
    };
    // A VF read without its identity: filled in from its PF by the caller. A VF on a VFIO
    // driver is passed through on its own, as what it is: always read.
    let identity =
        opts.vf_identity || !has("physfn") || driver.as_deref().is_some_and(is_vfio_driver);
    for name in &names {
        if let Some(n) = name
            .strip_prefix("virtfn")
            .and_then(|n| n.parse::<u32>().ok())
        {
            if let Some(a) = d.link_address(name)? {
                virtfns.push((n, a));
            }
        } else if name == "mdev_supported_types" {
            mdev_parent = true;
        } else if name == "vfio-dev" {
            vfio_cdev = list_dir(&dir.join(name))
                .ok()
                .and_then(|v| v.into_iter().next());
        } else if let Some(uuid) = crate::uevent::parse_uuid(name) {
            mdevs.push(uuid);
        }
    }
    virtfns.sort();
    let opt = |n: &str| if has(n) { d.read_opt(n) } else { Ok(None) };
    let id_opt = |n: &str| if identity { opt(n) } else { Ok(None) };
    let opt_link = |n: &str| if has(n) { d.link_name(n) } else { Ok(None) };
    let hex16 = |n: &str, s: &str| -> Result<u16> {
        let v = parse_hex(&d.file(n), s)?;
        u16::try_from(v).map_err(|_| Error::Parse {
            path: d.file(n),
            reason: format!("not a 16-bit id: {s:?}"),
        })
    };
    let opt_hex = |n: &str| id_opt(n)?.map_or(Ok(0), |s| hex16(n, &s));
    let req_hex = |n: &str| {
        if identity {
            hex16(n, &d.read_req(n)?)
        } else {
            Ok(0)
        }
    };
    let class = if identity {
        parse_hex(&d.file("class"), &d.read_req("class")?)?
    } else {
        0
    };
    let opt_u32 = |n: &str| {
        opt(n)?
            .map(|s| {
                s.parse::<u32>().map_err(|_| Error::Parse {
                    path: d.file(n),
                    reason: format!("not a number: {s:?}"),
                })
            })
            .transpose()
    };
    let numa = id_opt("numa_node")?
        .map(|s| {
            s.parse::<i32>().map_err(|_| Error::Parse {
                path: d.file("numa_node"),
                reason: format!("not a number: {s:?}"),
            })
        })
        .transpose()?;
    let iommu_group = opt_link("iommu_group")?
        .map(|n| {
            n.parse::<u32>().map_err(|_| Error::Parse {
                path: d.file("iommu_group"),
                reason: format!("link does not end in a group number: {n:?}"),
            })
        })
        .transpose()?;
    let physfn = if has("physfn") {
        d.link_address("physfn")?
    } else {
        None
    };
    let mdev_types = if mdev_parent && opts.mdev_types {
        read_mdev_types(&dir, Some((physfn.unwrap_or(address), type_names)))?
    } else {
        Vec::new()
    };
    let nvidia_vgpu = if has("nvidia") {
        read_nvidia_vgpu(&dir)?
    } else {
        None
    };
    let dev = PciDevice {
        address,
        vendor: req_hex("vendor")?,
        device: req_hex("device")?,
        subsystem_vendor: opt_hex("subsystem_vendor")?,
        subsystem_device: opt_hex("subsystem_device")?,
        class,
        driver,
        driver_override: id_opt("driver_override")?.filter(|s| !s.is_empty() && s != "(null)"),
        iommu_group,
        numa_node: numa.filter(|n| *n >= 0),
        physfn,
        virtfns: virtfns.into_iter().map(|(_, a)| a).collect(),
        sriov_totalvfs: opt_u32("sriov_totalvfs")?,
        sriov_numvfs: opt_u32("sriov_numvfs")?,
        modalias: id_opt("modalias")?,
        upstream_bridge: bridges.first().copied(),
        bridges,
        vfio_cdev,
        mdev_types,
        mdev_parent,
        nvidia_vgpu,
    };
    Ok(Some((dev, mdevs)))
}

/// A sysfs directory opened once, its attributes read relative to it: each read then resolves
/// one name instead of the whole path from the root (a round trip per component on a FUSE
/// tree, a dcache walk on real sysfs).
struct AttrDir {
    fd: std::os::fd::OwnedFd,
    path: PathBuf,
}

impl AttrDir {
    fn open(path: &Path) -> Result<AttrDir> {
        use nix::fcntl::OFlag;
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let fd = nix::fcntl::open(path, flags, nix::sys::stat::Mode::empty())
            .map_err(|e| Error::io(path, io::Error::from(e)))?;
        Ok(AttrDir {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The full path of `name`, for errors.
    fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    fn read(&self, name: &str) -> io::Result<String> {
        use nix::fcntl::OFlag;
        let fd = nix::fcntl::openat(
            &self.fd,
            name,
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(io::Error::from)?;
        read_all(fs::File::from(fd))
    }

    /// The attribute without surrounding whitespace; `None` when it does not exist.
    fn read_opt(&self, name: &str) -> Result<Option<String>> {
        match self.read(name) {
            Ok(s) => Ok(Some(s.trim().to_string())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(self.file(name), e)),
        }
    }

    fn read_req(&self, name: &str) -> Result<String> {
        self.read(name)
            .map(|s| s.trim().to_string())
            .map_err(|e| Error::io(self.file(name), e))
    }

    /// The last component of the link `name`'s target; `None` when there is no link.
    fn link_name(&self, name: &str) -> Result<Option<String>> {
        match nix::fcntl::readlinkat(&self.fd, name) {
            Ok(t) => Ok(Path::new(&t)
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string)),
            Err(nix::errno::Errno::ENOENT) => Ok(None),
            Err(e) => Err(Error::io(self.file(name), io::Error::from(e))),
        }
    }

    fn link_address(&self, name: &str) -> Result<Option<PciAddress>> {
        self.link_name(name)?
            .map(|n| {
                n.parse::<PciAddress>().map_err(|_| Error::Parse {
                    path: self.file(name),
                    reason: format!("link does not end in a PCI address: {n:?}"),
                })
            })
            .transpose()
    }
}

/// Reads one mdev parent's supported types (`<mdev_bus>/<parent>/mdev_supported_types/*`), for
/// readers that skip types in [`Inventory::read_with`] and need them for a few parents only.
pub fn read_parent_mdev_types(paths: &HostPaths, parent: &str) -> Result<Vec<MdevType>> {
    read_mdev_types(&paths.mdev_bus().join(parent), None)
}

/// The `name` and `description` of the mdev types one read has met, by GPU (a VF's PF, or the
/// function itself) and type id. A GPU's driver lists the same types on each of its VFs, each
/// VF with its own `available_instances` but the same name and description: those two are read
/// on the first VF of the GPU only, which on an A10 (32 VFs listing 23 types each) spares 1,426
/// of a read's 2,208 type files.
#[derive(Default)]
pub(crate) struct TypeNames(HashMap<(PciAddress, String), (Option<String>, Option<String>)>);

/// The types of the mdev parent at `parent_dir`: `available_instances` of each, and its name and
/// description. With `known`, the parent's GPU and the names read so far: those of that GPU are
/// taken from there, and those read are added.
fn read_mdev_types(
    parent_dir: &Path,
    mut known: Option<(PciAddress, &mut TypeNames)>,
) -> Result<Vec<MdevType>> {
    let dir = parent_dir.join("mdev_supported_types");
    let ids = list_dir(&dir)?;
    // Each type's files are opened relative to the types' directory, opened once.
    let d = AttrDir::open(&dir)?;
    let mut types = Vec::with_capacity(ids.len());
    for id in ids {
        let file = format!("{id}/available_instances");
        let available = d.read_req(&file)?;
        let available_instances = available.parse::<u32>().map_err(|_| Error::Parse {
            path: d.file(&file),
            reason: format!("not a number: {available:?}"),
        })?;
        let cached = match &known {
            Some((gpu, names)) => names.0.get(&(*gpu, id.clone())).cloned(),
            None => None,
        };
        let (name, description) = match cached {
            Some(nd) => nd,
            None => {
                let nd = (
                    d.read_opt(&format!("{id}/name"))?,
                    d.read_opt(&format!("{id}/description"))?,
                );
                if let Some((gpu, names)) = known.as_mut() {
                    names.0.insert((*gpu, id.clone()), nd.clone());
                }
                nd
            }
        };
        types.push(MdevType {
            id,
            name,
            available_instances,
            description,
        });
    }
    Ok(types)
}

/// Parses `creatable_vgpu_types`: an optional `ID : vGPU Name` header, then `1145  : NVIDIA L40S-1B`.
pub fn parse_creatable_vgpu_types(path: &Path, text: &str) -> Result<Vec<VgpuType>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let Some((id, name)) = line.split_once(':') else {
            return Err(Error::Parse {
                path: path.to_path_buf(),
                reason: format!("line without ':': {line:?}"),
            });
        };
        let (id, name) = (id.trim(), name.trim());
        if id.eq_ignore_ascii_case("id") {
            continue; // header
        }
        let id = id.parse::<u32>().map_err(|_| Error::Parse {
            path: path.to_path_buf(),
            reason: format!("type id is not a number: {line:?}"),
        })?;
        out.push(VgpuType {
            id,
            name: name.to_string(),
        });
    }
    Ok(out)
}

fn read_nvidia_vgpu(dir: &Path) -> Result<Option<NvidiaVgpu>> {
    let path = dir.join("nvidia/creatable_vgpu_types");
    let Some(text) = (match read_attr(&path) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io(&path, e)),
    }) else {
        return Ok(None);
    };
    let creatable = parse_creatable_vgpu_types(&path, &text)?;
    let current = read_opt_u32(&dir.join("nvidia/current_vgpu_type"))?.unwrap_or(0);
    let current_name = creatable
        .iter()
        .find(|t| t.id == current && current != 0)
        .map(|t| t.name.clone());
    Ok(Some(NvidiaVgpu {
        creatable,
        current,
        current_name,
    }))
}

fn read_mdev(link: &Path, name: &str) -> Result<Option<MdevDevice>> {
    let dir = match resolve_link(link) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(link, e)),
    };
    let type_id = link_name(&dir.join("mdev_type"))?.ok_or_else(|| Error::Parse {
        path: dir.join("mdev_type"),
        reason: "mdev has no mdev_type link".into(),
    })?;
    let parent = dir
        .parent()
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::Parse {
            path: dir.clone(),
            reason: "mdev has no parent directory".into(),
        })?
        .to_string();
    Ok(Some(MdevDevice {
        uuid: name.to_ascii_lowercase(),
        type_name: read_opt(&dir.join("mdev_type/name")).ok().flatten(),
        parent_pci: parent.parse().ok(),
        parent,
        iommu_group: link_number(&dir.join("iommu_group"))?,
        driver: link_name(&dir.join("driver"))?,
        vfio_cdev: list_dir(&dir.join("vfio-dev"))
            .ok()
            .and_then(|v| v.into_iter().next()),
        type_id,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed setup step should panic
    use super::*;

    #[test]
    fn an_attribute_is_read_whole_whatever_its_length() {
        let dir = tempfile::tempdir().unwrap();
        for len in [0, 1, 4095, 4096, 4097, 3 * 4096 + 5] {
            let value: String = (0..len)
                .map(|i| char::from(b'a' + (i % 26) as u8))
                .collect();
            let path = dir.path().join(format!("attr{len}"));
            fs::write(&path, &value).unwrap();
            assert_eq!(read_attr(&path).unwrap(), value, "{len} bytes");
        }
    }

    #[test]
    fn an_attribute_that_is_not_utf8_is_invalid_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("attr");
        fs::write(&path, [b'o', b'k', 0xff]).unwrap();
        let e = read_attr(&path).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}
