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

use crate::resource::switch_of;
pub use crate::resource::{DeviceInfo, HEALTHY, Kind, MAX_NAME_LEN, Resource, UNHEALTHY};

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

/// A `--resource-alias` that is not `OLD=NEW`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("expected OLD=NEW, got {0:?}")]
pub struct BadAlias(pub String);

/// Parses one `--resource-alias OLD=NEW`.
pub fn parse_alias(s: &str) -> Result<(String, String), BadAlias> {
    let bad = || BadAlias(s.to_string());
    let (old, new) = s.split_once('=').ok_or_else(bad)?;
    let (old, new) = (old.trim(), new.trim());
    if old.is_empty() || new.is_empty() {
        return Err(bad());
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
pub(crate) mod tests;
