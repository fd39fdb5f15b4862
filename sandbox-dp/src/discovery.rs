//! From one [`Inventory`] snapshot to the resources sandbox-dp advertises.
//!
//! Three kinds of device, each identified the way KubeVirt expects:
//! - passthrough: a function of `--vendor` bound to `vfio-pci` or a variant VFIO driver
//!   (`nvgrace_gpu_vfio_pci`); ID = PCI address; resource named from `pci.ids`.
//! - mdev: a mediated device whose parent is a function of `--vendor`; ID = UUID; resource named
//!   from the vGPU type name.
//! - SR-IOV vGPU: a VF of `--vendor` on driver `nvidia` with `nvidia/current_vgpu_type` ≠ 0;
//!   ID = the VF's PCI address; resource named from the vGPU type name.
//!
//! A device is Healthy while its `/dev/vfio/<group>` node exists.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::rc::Rc;

use common::{Inventory, PciAddress, PciDevice, PciIds, is_vfio_driver};
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

/// What discovery needs from the configuration.
#[derive(Clone, Debug)]
pub struct DiscoverConfig {
    /// Vendor whose devices are advertised; `None` = any (also non-PCI mdev parents).
    pub vendor: Option<u16>,
    /// Device names.
    pub pci_ids: PciIds,
    /// `--resource-alias OLD=NEW`: OLD is a resource name or a `VVVV:DDDD` id.
    pub aliases: BTreeMap<String, String>,
    /// `--on-demand`: the pool whose GPUs advertise slots instead of their vGPUs.
    pub pool: Option<std::sync::Arc<crate::ondemand::Pool>>,
}

/// Everything discovered in one pass.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Snapshot {
    /// Resources by name (only those that can be registered).
    pub resources: BTreeMap<String, Resource>,
    /// Problems an operator should fix: names too long, collisions.
    pub problems: Vec<String>,
}

/// The switch a device sits under: the bridge above its downstream port (`bridges[1]`), or
/// the only bridge (a root port) when it is attached directly.
pub(crate) fn switch_of(dev: &PciDevice) -> Option<String> {
    dev.bridges
        .get(1)
        .or(dev.bridges.first())
        .map(|a| a.to_string())
}

fn vendor_ok(cfg: &DiscoverConfig, vendor: u16) -> bool {
    cfg.vendor.is_none_or(|v| v == vendor)
}

/// Resolves a name through the aliases: by `VVVV:DDDD` first, then by resource name.
fn alias(cfg: &DiscoverConfig, name: String, pci_id: Option<&str>) -> String {
    let renamed = pci_id
        .and_then(|id| cfg.aliases.get(id))
        .or_else(|| cfg.aliases.get(&name));
    match renamed {
        Some(n) if n.contains('/') => n.clone(),
        Some(n) => format!("{}{n}", common::naming::RESOURCE_PREFIX),
        None => name,
    }
}

/// Why a resource name cannot be registered, if it cannot.
pub fn name_problem(name: &str) -> Option<String> {
    let Some((prefix, part)) = name.split_once('/') else {
        return Some(format!("resource name {name:?} has no domain prefix"));
    };
    if prefix.is_empty() || part.is_empty() {
        return Some(format!("resource name {name:?} is not domain/name"));
    }
    if part.len() > MAX_NAME_LEN {
        return Some(format!(
            "resource name {name:?} is {} characters after the prefix, over kubelet's {MAX_NAME_LEN}; rename it with --resource-alias",
            part.len()
        ));
    }
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    let first_last = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !part.chars().all(ok) || !first_last(part.chars().next()) || !first_last(part.chars().last())
    {
        return Some(format!(
            "resource name {name:?} is not a valid qualified name; rename it with --resource-alias"
        ));
    }
    None
}

/// Builds the resources of one inventory snapshot.
pub fn discover(inv: &Inventory, cfg: &DiscoverConfig) -> Snapshot {
    let mut resources: BTreeMap<String, Resource> = BTreeMap::new();
    // resource name -> the sources (pci id or type name) that produced it, for collisions
    let mut sources: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    // Names that two kinds of device map to: one resource has one env var prefix
    // (PCI_RESOURCE_ or MDEV_PCI_RESOURCE_), so the later kind is left out and reported.
    let mut cross_kind: BTreeSet<String> = BTreeSet::new();
    let mut kind_clash = |resources: &BTreeMap<String, Resource>,
                          name: &str,
                          kind: Kind,
                          what: &str| {
        match resources.get(name) {
            Some(r) if r.kind != kind => {
                cross_kind.insert(format!(
                    "resource name {name:?} is produced by {:?} devices and by {what} ({kind:?}); the {kind:?} devices are not advertised (rename one with --resource-alias)",
                    r.kind
                ));
                true
            }
            _ => false,
        }
    };
    let healthy = |g: Option<u32>| g.is_some_and(|g| inv.vfio_nodes.contains(&g));
    let gpu_of = |d: &PciDevice| d.physfn.unwrap_or(d.address);
    let pooled: BTreeSet<PciAddress> = cfg.pool.as_ref().map(|p| p.gpus(inv)).unwrap_or_default();
    let pooled_parents: BTreeSet<String> = cfg
        .pool
        .as_ref()
        .map(|p| p.parents(inv))
        .unwrap_or_default();

    // Display functions on VFIO drivers, to leave out their group companions (HDMI audio).
    let passthrough: Vec<&PciDevice> = inv
        .devices
        .values()
        .filter(|d| {
            vendor_ok(cfg, d.vendor)
                && !d.is_bridge()
                && d.nvidia_vgpu.as_ref().is_none_or(|v| v.current == 0)
                && d.driver.as_deref().is_some_and(is_vfio_driver)
        })
        .collect();
    let display_groups: BTreeSet<u32> = passthrough
        .iter()
        .filter(|d| d.is_display())
        .filter_map(|d| d.iommu_group)
        .collect();
    for d in passthrough {
        if !d.is_display() && d.iommu_group.is_some_and(|g| display_groups.contains(&g)) {
            continue; // travels with its GPU's group
        }
        let pci_id = d.id_string();
        let base = common::passthrough_resource_name(&cfg.pci_ids, d.vendor, d.device);
        let name = alias(cfg, base, Some(&pci_id));
        if kind_clash(&resources, &name, Kind::Passthrough, &pci_id) {
            continue;
        }
        sources.entry(name.clone()).or_default().insert(pci_id);
        let r = resources
            .entry(name.clone())
            .or_insert_with(|| Resource::new(name, Kind::Passthrough));
        r.pci_selectors.insert(selector(d));
        r.devices.insert(
            d.address.to_string(),
            DeviceInfo {
                id: d.address.to_string(),
                healthy: healthy(d.iommu_group),
                numa_node: d.numa_node,
                iommu_group: d.iommu_group,
                vfio_cdev: d.vfio_cdev.clone(),
                gpu: Some(gpu_of(d).to_string()),
                switch: switch_of(d),
                driver: d.driver.clone(),
            },
        );
    }

    // SR-IOV vGPU VFs. Hundreds of them share a few types and GPUs: what a type (its
    // resource) and a GPU (its name, NUMA node, switch) give is worked out once for all.
    let mut vf_types: HashMap<String, Option<String>> = HashMap::new();
    let mut facts = VfFacts::new(inv, cfg);
    for d in inv.devices.values() {
        if pooled.contains(&gpu_of(d)) {
            continue;
        }
        let Some(vf) = facts.entry(d) else { continue };
        let name = match vf_types.get(vf.type_name.as_ref()) {
            Some(known) => known.clone(),
            None => {
                let name = vf.resource.to_string();
                let name =
                    (!kind_clash(&resources, &name, Kind::SriovVgpu, &vf.type_name)).then(|| {
                        sources
                            .entry(name.clone())
                            .or_default()
                            .insert(vf.type_name.to_string());
                        resources
                            .entry(name.clone())
                            .or_insert_with(|| Resource::new(name.clone(), Kind::SriovVgpu))
                            .type_names
                            .insert(vf.type_name.to_string());
                        name
                    });
                vf_types.insert(vf.type_name.to_string(), name.clone());
                name
            }
        };
        let Some(r) = name.and_then(|n| resources.get_mut(&n)) else {
            continue;
        };
        if !r.pci_selectors.contains(&*vf.selector) {
            r.pci_selectors.insert(vf.selector.to_string());
        }
        r.devices.insert(vf.info.id.clone(), vf.info);
    }

    // mdevs.
    for m in inv.mdevs.values() {
        let parent = m.parent_pci.and_then(|p| inv.device(&p));
        match parent {
            Some(p) if !vendor_ok(cfg, p.vendor) => continue,
            None if cfg.vendor.is_some() || pooled_parents.contains(&m.parent) => continue,
            Some(p) if pooled.contains(&gpu_of(p)) => continue,
            _ => {}
        }
        let type_name = m.type_name.clone().unwrap_or_else(|| m.type_id.clone());
        let name = alias(cfg, common::vgpu_resource_name(&type_name), None);
        if kind_clash(&resources, &name, Kind::Mdev, &type_name) {
            continue;
        }
        sources
            .entry(name.clone())
            .or_default()
            .insert(type_name.clone());
        let gpu = parent.map(|p| p.physfn.and_then(|pf| inv.device(&pf)).unwrap_or(p));
        let r = resources
            .entry(name.clone())
            .or_insert_with(|| Resource::new(name, Kind::Mdev));
        r.type_names.insert(type_name);
        r.devices.insert(
            m.uuid.clone(),
            DeviceInfo {
                id: m.uuid.clone(),
                healthy: healthy(m.iommu_group),
                numa_node: parent
                    .and_then(|p| p.numa_node)
                    .or(gpu.and_then(|g| g.numa_node)),
                iommu_group: m.iommu_group,
                vfio_cdev: m.vfio_cdev.clone(),
                gpu: Some(
                    gpu.map(|g| g.address.to_string())
                        .unwrap_or_else(|| m.parent.clone()),
                ),
                switch: gpu.and_then(switch_of),
                driver: m.driver.clone(),
            },
        );
    }

    if let Some(pool) = &cfg.pool {
        let name = |t: &str| alias(cfg, common::vgpu_resource_name(t), None);
        for n in pool.advertise(inv, &name, &mut resources) {
            cross_kind.insert(format!(
                "resource name {n:?} is produced by devices outside the on-demand pool too; the pool's slots of it are not advertised (rename one with --resource-alias)"
            ));
        }
    }
    let mut problems: Vec<String> = cross_kind.into_iter().collect();
    for (name, srcs) in &sources {
        if srcs.len() > 1 {
            let list: Vec<&str> = srcs.iter().map(String::as_str).collect();
            problems.push(format!(
                "resource name {name:?} is shared by {}; their devices are advertised together (rename one with --resource-alias)",
                list.join(", ")
            ));
        }
    }
    resources.retain(|name, _| match name_problem(name) {
        Some(p) => {
            problems.push(format!("{p}; not advertised"));
            false
        }
        None => true,
    });
    Snapshot {
        resources,
        problems,
    }
}

/// One SR-IOV vGPU VF as [`discover`] lists it.
struct VfEntry<'a> {
    /// Its vGPU type's name (the type number when sysfs names none).
    type_name: std::borrow::Cow<'a, str>,
    /// The resource the type names (aliases applied), before any clash with another kind.
    resource: Rc<str>,
    /// `VVVV:DDDD` of the VF.
    selector: Rc<str>,
    info: DeviceInfo,
}

/// What VFs share, worked out once per type, GPU and device id: [`discover`] asks it for
/// hundreds of VFs, [`vf_devices`] for the few an event named.
struct VfFacts<'a> {
    inv: &'a Inventory,
    cfg: &'a DiscoverConfig,
    resources: HashMap<String, Rc<str>>,
    gpus: HashMap<PciAddress, GpuFacts>,
    selectors: HashMap<(u16, u16), Rc<str>>,
}

impl<'a> VfFacts<'a> {
    fn new(inv: &'a Inventory, cfg: &'a DiscoverConfig) -> Self {
        VfFacts {
            inv,
            cfg,
            resources: HashMap::new(),
            gpus: HashMap::new(),
            selectors: HashMap::new(),
        }
    }

    /// `d` as an SR-IOV vGPU device, if it is one: a VF of `--vendor` on the nvidia driver with
    /// a vGPU type set. Pools are the caller's to leave out.
    fn entry(&mut self, d: &'a PciDevice) -> Option<VfEntry<'a>> {
        let v = d.nvidia_vgpu.as_ref()?;
        if v.current == 0
            || !d.is_vf()
            || !vendor_ok(self.cfg, d.vendor)
            || d.driver.as_deref() != Some("nvidia")
        {
            return None;
        }
        let type_name = match &v.current_name {
            Some(n) => std::borrow::Cow::Borrowed(n.as_str()),
            None => std::borrow::Cow::Owned(v.current.to_string()),
        };
        let resource = match self.resources.get(type_name.as_ref()) {
            Some(r) => r.clone(),
            None => {
                let r: Rc<str> =
                    alias(self.cfg, common::vgpu_resource_name(&type_name), None).into();
                self.resources.insert(type_name.to_string(), r.clone());
                r
            }
        };
        let selector = self
            .selectors
            .entry((d.vendor, d.device))
            .or_insert_with(|| selector(d).into())
            .clone();
        let inv = self.inv;
        let gpu_addr = d.physfn.unwrap_or(d.address);
        let gpu = self.gpus.entry(gpu_addr).or_insert_with(|| {
            let parent = d.physfn.and_then(|p| inv.device(&p));
            GpuFacts {
                name: gpu_addr.to_string(),
                numa_node: parent.and_then(|p| p.numa_node),
                switch: parent.and_then(switch_of),
            }
        });
        let id = d.address.to_string();
        let info = DeviceInfo {
            id,
            healthy: d.iommu_group.is_some_and(|g| inv.vfio_nodes.contains(&g)),
            numa_node: d.numa_node.or(gpu.numa_node),
            iommu_group: d.iommu_group,
            vfio_cdev: d.vfio_cdev.clone(),
            gpu: Some(gpu.name.clone()),
            switch: gpu.switch.clone().or_else(|| switch_of(d)),
            driver: d.driver.clone(),
        };
        Some(VfEntry {
            type_name,
            resource,
            selector,
            info,
        })
    }
}

/// One device of a resource, as a change to it: `info` `None` when the device left it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevicePatch {
    /// The resource.
    pub resource: String,
    /// The device ID.
    pub id: String,
    /// The device now, or `None` when it is no longer in the resource.
    pub info: Option<DeviceInfo>,
}

/// What [`discover`] would change in `current` (the resources as advertised) because the VFs
/// `changed` were read again, without going over the node: the devices that left or joined a
/// resource, or changed in it. `None` when that cannot be told from those VFs alone, and the
/// node must be discovered whole: a function that is not a vGPU-capable VF (a VFIO-bound one is
/// a passthrough device, an mdev parent has mdevs), a resource that would be made (or one left
/// with no devices filled again), a resource of several types or device ids (which could
/// shrink), a pool, a VF whose type has no name yet. A resource a VF's removal empties stays,
/// with no devices, as [`discover`]'s caller keeps a resource that vanished.
pub fn vf_devices(
    inv: &Inventory,
    cfg: &DiscoverConfig,
    current: &BTreeMap<String, &Resource>,
    changed: &BTreeSet<PciAddress>,
) -> Option<Vec<DevicePatch>> {
    if cfg.pool.is_some() {
        return None;
    }
    let mut facts = VfFacts::new(inv, cfg);
    let mut patches = Vec::new();
    for a in changed {
        let d = inv.device(a)?;
        let vgpu = d.nvidia_vgpu.as_ref()?;
        if !d.is_vf()
            || d.mdev_parent
            || d.driver.as_deref().is_some_and(is_vfio_driver)
            || (vgpu.current != 0 && vgpu.current_name.is_none())
        {
            return None;
        }
        let id = a.to_string();
        let before = current.iter().find(|(_, r)| r.devices.contains_key(&id));
        if let Some((_, r)) = before
            && (r.kind != Kind::SriovVgpu || r.type_names.len() != 1 || r.pci_selectors.len() != 1)
        {
            return None;
        }
        let now = facts.entry(d);
        match (&now, before) {
            (Some(vf), _) => {
                let r = current.get(&*vf.resource)?;
                if r.kind != Kind::SriovVgpu
                    || r.devices.is_empty()
                    || !r.type_names.contains(vf.type_name.as_ref())
                    || !r.pci_selectors.contains(&*vf.selector)
                {
                    return None;
                }
                if let Some((old, _)) = before.filter(|(n, _)| n.as_str() != &*vf.resource) {
                    patches.push(DevicePatch {
                        resource: old.clone(),
                        id: id.clone(),
                        info: None,
                    });
                }
            }
            (None, Some((old, _))) => {
                patches.push(DevicePatch {
                    resource: old.clone(),
                    id: id.clone(),
                    info: None,
                });
            }
            (None, None) => {}
        }
        if let Some(vf) = now {
            patches.push(DevicePatch {
                resource: vf.resource.to_string(),
                id,
                info: Some(vf.info),
            });
        }
    }
    Some(patches)
}

/// What the VFs of one GPU share.
struct GpuFacts {
    /// The GPU's PCI address.
    name: String,
    numa_node: Option<i32>,
    switch: Option<String>,
}

fn selector(d: &PciDevice) -> String {
    format!("{:04X}:{:04X}", d.vendor, d.device)
}

/// Parses one `--resource-alias OLD=NEW`.
pub fn parse_alias(s: &str) -> Result<(String, String), String> {
    let (old, new) = s
        .split_once('=')
        .ok_or_else(|| format!("expected OLD=NEW, got {s:?}"))?;
    let (old, new) = (old.trim(), new.trim());
    if old.is_empty() || new.is_empty() {
        return Err(format!("expected OLD=NEW, got {s:?}"));
    }
    // A `VVVV:DDDD` key is matched in lower case, like PciDevice::id_string.
    let old = if old.len() == 9 && old.as_bytes()[4] == b':' {
        old.to_ascii_lowercase()
    } else {
        old.to_string()
    };
    Ok((old, new.to_string()))
}

/// Parses a PCI address, for callers holding device IDs.
pub fn parse_address(id: &str) -> Option<PciAddress> {
    id.parse().ok()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use common::{MdevDevice, NvidiaVgpu};

    fn addr(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    fn func(
        bdf: &str,
        vendor: u16,
        device: u16,
        class: u32,
        driver: &str,
        group: u32,
    ) -> PciDevice {
        PciDevice {
            driver: Some(driver.to_string()),
            iommu_group: Some(group),
            numa_node: Some(1),
            bridges: vec![
                addr("0000:12:00.0"),
                addr("0000:11:00.0"),
                addr("0000:10:01.0"),
            ],
            ..PciDevice::new(addr(bdf), vendor, device, class)
        }
    }

    fn inventory(devs: Vec<PciDevice>, mdevs: Vec<MdevDevice>, nodes: &[u32]) -> Inventory {
        Inventory {
            devices: devs.into_iter().map(|d| (d.address, d)).collect(),
            mdevs: mdevs.into_iter().map(|m| (m.uuid.clone(), m)).collect(),
            vfio_nodes: nodes.iter().copied().collect(),
            ..Default::default()
        }
    }

    fn cfg(vendor: Option<u16>) -> DiscoverConfig {
        DiscoverConfig {
            vendor,
            pci_ids: PciIds::embedded(),
            aliases: BTreeMap::new(),
            pool: None,
        }
    }

    fn mdev(uuid: &str, parent: &str, name: Option<&str>, group: u32) -> MdevDevice {
        MdevDevice {
            uuid: uuid.into(),
            type_id: "nvidia-593".into(),
            type_name: name.map(str::to_string),
            parent: parent.into(),
            parent_pci: parent.parse().ok(),
            iommu_group: Some(group),
            driver: Some("vfio_mdev".into()),
            vfio_cdev: None,
        }
    }

    #[test]
    fn a_name_two_kinds_map_to_keeps_the_first_kind_and_reports_the_other() {
        let gpu = func("0000:13:00.0", 0x10de, 0x2236, 0x030200, "vfio-pci", 1);
        let mut vf = func("0000:14:00.4", 0x10de, 0x2236, 0x030200, "nvidia", 2);
        vf.physfn = Some(addr("0000:14:00.0"));
        let inv = inventory(
            vec![gpu, vf],
            vec![mdev("u1", "0000:14:00.4", Some("NVIDIA A10-4Q"), 50)],
            &[1, 50],
        );
        let mut c = cfg(Some(0x10de));
        c.aliases
            .insert("nvidia.com/NVIDIA_A10-4Q".into(), "GA102GL_A10".into());
        let snap = discover(&inv, &c);
        let r = &snap.resources["nvidia.com/GA102GL_A10"];
        assert_eq!(r.kind, Kind::Passthrough);
        assert_eq!(r.devices.keys().collect::<Vec<_>>(), ["0000:13:00.0"]);
        assert_eq!(snap.problems.len(), 1, "{:?}", snap.problems);
        assert!(
            snap.problems[0].contains("the Mdev devices are not advertised"),
            "{:?}",
            snap.problems
        );
    }

    #[test]
    fn mdevs_on_vfs_belong_to_the_pf_and_follow_the_vendor() {
        let pf = func("0000:13:00.0", 0x10de, 0x2236, 0x030200, "nvidia", 1);
        let mut vf = func("0000:13:00.4", 0x10de, 0x2236, 0x030200, "nvidia", 2);
        vf.physfn = Some(pf.address);
        vf.numa_node = None;
        let inv = inventory(
            vec![pf, vf],
            vec![
                mdev("u1", "0000:13:00.4", Some("NVIDIA A10-4Q"), 50),
                mdev("u2", "mtty", None, 51),
            ],
            &[50],
        );
        let snap = discover(&inv, &cfg(Some(0x10de)));
        let names: Vec<&String> = snap.resources.keys().collect();
        assert_eq!(names, ["nvidia.com/NVIDIA_A10-4Q"]);
        let r = &snap.resources["nvidia.com/NVIDIA_A10-4Q"];
        assert_eq!(r.kind, Kind::Mdev);
        let d = &r.devices["u1"];
        assert!(d.healthy);
        assert_eq!(d.gpu.as_deref(), Some("0000:13:00.0"));
        assert_eq!(
            d.numa_node,
            Some(1),
            "NUMA node of the PF when the VF has none"
        );
        assert_eq!(d.switch.as_deref(), Some("0000:11:00.0"));

        // `any`: the mtty mdev too, named from its type id, Unhealthy without its node.
        let snap = discover(&inv, &cfg(None));
        let r = &snap.resources["nvidia.com/nvidia-593"];
        assert!(!r.devices["u2"].healthy);
    }

    #[test]
    fn vendor_vgpu_vfs_need_a_type_and_the_nvidia_driver() {
        let pf = func("0000:13:00.0", 0x10de, 0x2330, 0x030200, "nvidia", 1);
        let mut set = func("0000:13:00.4", 0x10de, 0x2330, 0x030200, "nvidia", 2);
        set.physfn = Some(pf.address);
        set.nvidia_vgpu = Some(NvidiaVgpu {
            creatable: Vec::new(),
            current: 1000,
            current_name: Some("NVIDIA H100XM-4C".into()),
        });
        let mut free = func("0000:13:00.5", 0x10de, 0x2330, 0x030200, "nvidia", 3);
        free.physfn = Some(pf.address);
        free.nvidia_vgpu = Some(NvidiaVgpu {
            creatable: Vec::new(),
            current: 0,
            current_name: None,
        });
        let inv = inventory(vec![pf, set, free], Vec::new(), &[2]);
        let snap = discover(&inv, &cfg(Some(0x10de)));
        let r = &snap.resources["nvidia.com/NVIDIA_H100XM-4C"];
        assert_eq!(r.kind, Kind::SriovVgpu);
        assert_eq!(r.devices.keys().collect::<Vec<_>>(), ["0000:13:00.4"]);
        assert_eq!(r.env_var(), "PCI_RESOURCE_NVIDIA_COM_NVIDIA_H100XM-4C");
        assert_eq!(r.pci_selectors.iter().collect::<Vec<_>>(), ["10DE:2330"]);
        assert_eq!(snap.resources.len(), 1);
    }

    /// A vendor-path GPU with `n` VFs, VF `i` (`0000:13:00.<i+4>`, group `10+i`) holding type
    /// `types[i]` (0: none; 1000 is H100XM-4C, 1001 H100XM-8C, 1002 an unnamed type); every
    /// group node present.
    pub(crate) fn h100(types: &[u32]) -> Inventory {
        let pf = func("0000:13:00.0", 0x10de, 0x2330, 0x030200, "nvidia", 1);
        let mut devs = vec![pf];
        for (i, t) in types.iter().enumerate() {
            let mut vf = func(
                &format!("0000:13:00.{}", i + 4),
                0x10de,
                0x2330,
                0x030200,
                "nvidia",
                10 + i as u32,
            );
            vf.physfn = Some(addr("0000:13:00.0"));
            vf.nvidia_vgpu = Some(NvidiaVgpu {
                creatable: Vec::new(),
                current: *t,
                current_name: match t {
                    1000 => Some("NVIDIA H100XM-4C".into()),
                    1001 => Some("NVIDIA H100XM-8C".into()),
                    _ => None,
                },
            });
            devs.push(vf);
        }
        let groups: Vec<u32> = (0..types.len() as u32).map(|i| 10 + i).collect();
        inventory(devs, Vec::new(), &groups)
    }

    /// The resources after `patches`, as the manager keeps them (a resource emptied stays).
    fn patched(
        mut resources: BTreeMap<String, Resource>,
        patches: &[DevicePatch],
    ) -> BTreeMap<String, Resource> {
        for p in patches {
            let r = resources.get_mut(&p.resource).expect("a known resource");
            match &p.info {
                Some(d) => r.devices.insert(p.id.clone(), d.clone()),
                None => r.devices.remove(&p.id),
            };
        }
        resources.retain(|_, r| !r.devices.is_empty());
        resources
    }

    #[test]
    fn a_vf_read_again_patches_what_a_full_discovery_would_give() {
        let c = cfg(Some(0x10de));
        let vf = |i: u8| -> BTreeSet<PciAddress> { [addr(&format!("0000:13:00.{i}"))].into() };
        // (before, after, the VFs read again): removal, a removal that empties a resource,
        // restore, a type change between two existing resources, a VF without a vGPU, and two
        // VFs at once.
        let cases: [(&[u32], &[u32], BTreeSet<PciAddress>); 6] = [
            (&[1000, 1000, 1001], &[0, 1000, 1001], vf(4)),
            (&[1000, 1001], &[0, 1001], vf(4)),
            (&[0, 1000, 1001], &[1000, 1000, 1001], vf(4)),
            (&[1000, 1000, 1001, 1001], &[1001, 1000, 1001, 1001], vf(4)),
            (&[0, 1000], &[0, 1000], vf(4)),
            (
                &[1000, 1000, 1000],
                &[0, 0, 1000],
                vf(4).union(&vf(5)).copied().collect(),
            ),
        ];
        for (before, after, changed) in cases {
            let old = discover(&h100(before), &c).resources;
            let inv = h100(after);
            let current: BTreeMap<String, &Resource> =
                old.iter().map(|(n, r)| (n.clone(), r)).collect();
            let patches = vf_devices(&inv, &c, &current, &changed)
                .unwrap_or_else(|| panic!("{before:?} -> {after:?} is a VF change"));
            assert_eq!(
                patched(old.clone(), &patches),
                discover(&inv, &c).resources,
                "{before:?} -> {after:?}"
            );
        }
    }

    #[test]
    fn what_a_vf_alone_cannot_tell_asks_for_the_whole_node() {
        let c = cfg(Some(0x10de));
        let vf4: BTreeSet<PciAddress> = [addr("0000:13:00.4")].into();
        let none = |before: &[u32], after: Inventory, changed: &BTreeSet<PciAddress>| {
            let old = discover(&h100(before), &c).resources;
            let current: BTreeMap<String, &Resource> =
                old.iter().map(|(n, r)| (n.clone(), r)).collect();
            vf_devices(&after, &c, &current, changed).is_none()
        };
        // A type no resource has yet: a resource would be made.
        assert!(none(&[0, 1000], h100(&[1001, 1000]), &vf4));
        // A type without a name.
        assert!(none(&[0, 1000], h100(&[1002, 1000]), &vf4));
        // A VF bound to vfio-pci (a passthrough device), and one that is an mdev parent.
        let mut inv = h100(&[0, 1000]);
        if let Some(d) = inv.devices.get_mut(&addr("0000:13:00.4")) {
            d.driver = Some("vfio-pci".into());
        }
        assert!(none(&[0, 1000], inv, &vf4));
        let mut inv = h100(&[0, 1000]);
        if let Some(d) = inv.devices.get_mut(&addr("0000:13:00.4")) {
            d.mdev_parent = true;
        }
        assert!(none(&[0, 1000], inv, &vf4));
        // The PF, and a function that is gone.
        assert!(none(&[1000], h100(&[1000]), &[addr("0000:13:00.0")].into()));
        assert!(none(&[1000], h100(&[1000]), &[addr("0000:13:00.7")].into()));
        // A pool.
        let old = discover(&h100(&[1000]), &c).resources;
        let current: BTreeMap<String, &Resource> =
            old.iter().map(|(n, r)| (n.clone(), r)).collect();
        let pooled = DiscoverConfig {
            pool: Some(std::sync::Arc::new(
                crate::ondemand::Pool::new(
                    common::HostPaths::new("/nonexistent-root"),
                    crate::ondemand::Selector::All,
                    Some(0x10de),
                    std::time::Duration::from_secs(1),
                    Default::default(),
                )
                .unwrap_or_else(|e| panic!("{e:#}")),
            )),
            ..cfg(Some(0x10de))
        };
        assert!(vf_devices(&h100(&[1000]), &pooled, &current, &vf4).is_none());
    }

    #[test]
    fn a_re_read_looks_no_name_up_again() {
        use common::IdsSource;
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};

        /// pci.ids text that counts its reads.
        struct Counting(&'static [u8], Arc<AtomicUsize>);
        impl IdsSource for Counting {
            fn size(&self) -> u64 {
                self.0.len() as u64
            }
            fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
                self.1.fetch_add(1, Ordering::SeqCst);
                self.0.read_at(offset, buf)
            }
        }
        let text = "10de  NVIDIA Corporation\n\t2236  GA102GL [A10]\n\t\t10de 1482  A10\n\
                    8086  Intel Corporation\n\t1572  Ethernet Controller X710\n";
        let gpus = [
            func("0000:13:00.0", 0x10de, 0x2236, 0x030200, "vfio-pci", 1),
            func("0000:14:00.0", 0x10de, 0x2236, 0x030200, "vfio-pci", 2),
        ];
        // The reads of a fresh pci.ids naming the first `n` GPUs, and its configuration.
        let named = |n: usize| {
            let reads = Arc::new(AtomicUsize::new(0));
            let ids = PciIds::from_source(Box::new(Counting(text.as_bytes(), reads.clone())), "t");
            assert_eq!(reads.load(Ordering::SeqCst), 0, "nothing is read up front");
            let inv = inventory(gpus[..n].to_vec(), Vec::new(), &[1, 2][..n]);
            let c = DiscoverConfig {
                pci_ids: ids,
                ..cfg(Some(0x10de))
            };
            let snap = discover(&inv, &c);
            (reads, c, inv, snap)
        };
        let (one, ..) = named(1);
        let (reads, c, inv, first) = named(2);
        assert_eq!(
            first.resources.keys().collect::<Vec<_>>(),
            ["nvidia.com/GA102GL_A10"]
        );
        // Two GPUs of one model: one lookup, the reads of one GPU's.
        let looked_up = reads.load(Ordering::SeqCst);
        assert!(looked_up > 0);
        assert_eq!(looked_up, one.load(Ordering::SeqCst));
        // Each re-read (the daemon clones its configuration for it) reads no pci.ids again.
        for _ in 0..5 {
            assert_eq!(discover(&inv, &c.clone()), first);
        }
        assert_eq!(reads.load(Ordering::SeqCst), looked_up);
    }

    #[test]
    fn names_over_63_chars_are_refused() {
        let long = format!("nvidia.com/{}", "A".repeat(64));
        assert!(name_problem(&long).is_some_and(|p| p.contains("64 characters")));
        assert_eq!(
            name_problem(&format!("nvidia.com/{}", "A".repeat(63))),
            None
        );
        assert_eq!(name_problem("nvidia.com/NVIDIA_A10-4Q"), None);
        assert!(name_problem("nvidia.com/A B").is_some());
    }

    #[test]
    fn aliases_parse() {
        assert_eq!(
            parse_alias("10DE:2236=nvidia.com/A10"),
            Ok(("10de:2236".into(), "nvidia.com/A10".into()))
        );
        assert_eq!(
            parse_alias("nvidia.com/X=Y"),
            Ok(("nvidia.com/X".into(), "Y".into()))
        );
        assert!(parse_alias("nope").is_err());
        assert!(parse_alias("=x").is_err());
    }
}
