//! The node's devices as ResourceSlices: one device per GPU that can be passed through, in the
//! node's pool; with `--pool-per-gpu` each GPU of the vGPU pool, with its vGPU devices, in a
//! pool of its own ([`Pool::slices`]).
//!
//! Which GPUs: exactly those vfio-manager would bind ([`common::vfio::select`] with its default
//! selector: NVIDIA display functions that are not VFs, each with the other endpoint functions
//! of its IOMMU group), so that a device published here is one prepare can put on VFIO whole.
//! A device is one IOMMU group: the group travels to the VM whole, so two GPUs sharing a group
//! (behind a switch without ACS) are one device, named after the first, the other listed
//! among its companions.
//!
//! A GPU that cannot be given to a VM stays published with a device taint (Kubernetes 1.36:
//! `DRADeviceTaints`, beta and on by default; [`taint`]), so that the scheduler places no claim
//! on it and an operator sees why in the slice: key `<driver>/unusable`, the reason as its
//! value, effect `NoSchedule` (or `NoExecute` with `--taint-effect`, which evicts the pods of
//! claims that do not tolerate it): a group vfio-manager refuses (`group-not-assignable`: a
//! foreign or unreadable member, no IOMMU group), a GPU on its VFIO driver whose
//! `/dev/vfio/<group>` node is missing (`no-vfio-group-node`: the kernel did not make the group
//! viable), a pooled GPU whose VFs could not be enabled (`vfs-not-enabled`, its vGPU devices),
//! and a device a prepared claim holds whose GPU is gone (`gone`). The taint goes when the GPU
//! recovers; either way one slice is written, the pool keeps its devices.
//!
//! What a device says, for claims to select on (attributes in the driver's domain unless
//! named otherwise):
//!
//! | attribute | example |
//! |---|---|
//! | `mode` | `passthrough` |
//! | `vendorID`, `deviceID` | `10de`, `2236` |
//! | `productName` (pci.ids; left out when unknown) | `GA102GL [A10]` |
//! | `resource.kubernetes.io/pciBusID` (the standard attribute KubeVirt reads) | `0000:41:00.0` |
//! | `numaNode`, and the standard `resource.kubernetes.io/numaNode` (left out when the kernel does not say) | `0` |
//! | `resource.kubernetes.io/pcieRoot` (the standard attribute: the PCIe root complex) | `pci0000:40` |
//! | `iommuGroup` | `21` |
//! | `functions` (how many PCI functions go to the VM) | `2` |
//! | `companions` (the other functions, comma-separated; left out when none) | `0000:41:00.1` |
//! | `vfioDriver` (`vfio-pci`, or the variant driver `modules.alias` names) | `vfio-pci` |
//!
//! and its capacity `memory` (the GPU's framebuffer, `24Gi`) where the model is known.

use std::collections::{BTreeMap, BTreeSet};

use common::vfio::{AliasTable, Selection, Selector, Target, select};
use common::{Inventory, PciAddress, PciDevice, PciIds, is_vfio_driver};
use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
    ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::names;
use crate::vgpu::Pooled;
use crate::vgpu_types::Types;

mod vgpus;

use vgpus::vgpu_devices;
pub use vgpus::{CAPACITY_VGPUS, mdev_parent_devices};

/// The standard attribute naming a device's PCI address (KEP-5304), which KubeVirt reads.
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";

/// The standard attribute naming a device's PCIe root complex (`pci0000:40`), so a claim can
/// keep a GPU and a NIC under one root (`matchAttribute`).
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";

/// The standard attribute naming a device's NUMA node, beside the driver's own `numaNode`.
pub const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";

/// The `mode` attribute of a whole GPU given to a VM.
pub const MODE_PASSTHROUGH: &str = "passthrough";

/// The `mode` attribute of a vGPU.
pub const MODE_VGPU: &str = "vgpu";

/// The counter of a GPU's framebuffer in its counter set.
pub const COUNTER_MEMORY: &str = "memory";

/// The counter of an SR-IOV GPU's VFs (one per vGPU) in its counter set.
pub const COUNTER_VFS: &str = "vfs";

/// The most devices one slice holds when they consume counters (the API's limit).
pub const MAX_DEVICES_WITH_COUNTERS: usize = 64;

/// The most counter sets (`sharedCounters`) one slice holds (the API's limit since
/// Kubernetes 1.35).
pub const MAX_COUNTER_SETS: usize = 8;

/// The most counters, in all its sets, one slice holds (the API's limit).
pub const MAX_COUNTERS: usize = 32;

/// The longest string attribute value the API accepts.
const MAX_STRING_ATTRIBUTE: usize = 64;

/// A GPU that cannot be given to a VM (published with a taint), and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftOut {
    /// The GPU.
    pub address: PciAddress,
    /// A sentence naming the reason.
    pub reason: String,
    /// The reason as the taint's value (a label value): `group-not-assignable`, ….
    pub code: &'static str,
}

/// The taint key of an unusable device, under the driver's domain.
pub fn taint_key(driver: &str) -> String {
    format!("{driver}/unusable")
}

/// A device taint's effect (`--taint-effect`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TaintEffect {
    /// No new claim is placed on the device; claims that have it keep it.
    #[default]
    #[value(name = "NoSchedule")]
    NoSchedule,
    /// As `NoSchedule`, and the pods of claims that have it are evicted (unless they
    /// tolerate it).
    #[value(name = "NoExecute")]
    NoExecute,
}

impl TaintEffect {
    /// As the API writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// Puts a taint (key [`taint_key`], value the reason's code, `effect`) on each device of a GPU
/// of `unusable` (its whole device and its vGPU devices) and on the vGPU devices of each GPU of
/// `no_vgpus` (its VFs could not be enabled, `vfs-not-enabled`).
pub fn taint(
    devices: &mut [Device],
    driver: &str,
    effect: TaintEffect,
    unusable: &[LeftOut],
    no_vgpus: &BTreeSet<PciAddress>,
) {
    let key = taint_key(driver);
    for d in devices.iter_mut() {
        let Some(gpu) = gpu_of(d) else { continue };
        let mode = d
            .attributes
            .as_ref()
            .and_then(|a| a.get("mode"))
            .and_then(|v| v.string.as_deref());
        let code = match unusable.iter().find(|l| l.address == gpu) {
            Some(l) => l.code,
            None if mode == Some(MODE_VGPU) && no_vgpus.contains(&gpu) => "vfs-not-enabled",
            None => continue,
        };
        d.taints = Some(vec![DeviceTaint {
            key: key.clone(),
            value: Some(code.to_string()),
            effect: effect.as_str().to_string(),
            time_added: None,
        }]);
    }
}

/// The GPU device `d` is (its name) or is part of (its `parentGPU` attribute).
pub fn gpu_of(d: &Device) -> Option<PciAddress> {
    names::parse_gpu_device(&d.name).or_else(|| {
        d.attributes
            .as_ref()
            .and_then(|a| a.get("parentGPU"))
            .and_then(|v| v.string.as_deref())
            .and_then(|g| g.parse().ok())
    })
}

/// The devices of the node, in name order, and the GPUs left out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeDevices {
    /// One per IOMMU group holding a selected GPU.
    pub devices: Vec<Device>,
    /// Selected GPUs that are not published.
    pub left_out: Vec<LeftOut>,
    /// One counter set per GPU of the vGPU pool, named after its passthrough device.
    pub counters: Vec<CounterSet>,
    /// Devices prepared claims hold that the node no longer offers, each with the pool its
    /// claims' allocations name ([`Pool::slices`]).
    pub held: Vec<(String, Device)>,
    /// GPUs kept in the pool their prepared claims were allocated from ([`Pool::pinned`]).
    pub pinned: BTreeMap<PciAddress, String>,
}

/// The devices `inv` has for the slice, from vfio-manager's selection `sel` of it; product
/// names from `ids`.
pub fn devices(inv: &Inventory, sel: &Selection, ids: &PciIds) -> NodeDevices {
    devices_with_vgpus(inv, sel, ids, &Pooled::default())
}

/// [`devices`], and for each GPU of `vgpu_pool` whose model the vGPU model table knows
/// ([`common::vgpu::models`]): a counter set (its framebuffer; its VFs on an SR-IOV GPU), one
/// shared device per vGPU type the pool publishes (`--vgpu-types`) whose capacity `vgpus` is
/// as many of that type as the GPU holds, and its passthrough device; each of them consumes the
/// whole set ([`vgpus`]).
pub fn devices_with_vgpus(
    inv: &Inventory,
    sel: &Selection,
    ids: &PciIds,
    vgpu_pool: &Pooled,
) -> NodeDevices {
    let mut out = NodeDevices::default();
    for r in &sel.refused {
        out.left_out.push(LeftOut {
            address: r.address,
            reason: r.reason.clone(),
            code: "group-not-assignable",
        });
        // Published all the same, tainted: the scheduler and an operator see it and why.
        if let Some(gpu) = inv
            .device(&r.address)
            .filter(|d| d.is_display() && !d.is_vf())
        {
            let mut attrs = BTreeMap::new();
            attrs.insert("mode".to_string(), string(MODE_PASSTHROUGH));
            identity(gpu, ids, &mut attrs);
            attrs.insert(PCI_BUS_ID.to_string(), string(gpu.address.to_string()));
            if let Some(g) = gpu.iommu_group {
                attrs.insert("iommuGroup".to_string(), int(g));
            }
            out.devices.push(Device {
                name: names::gpu_device(&gpu.address),
                attributes: Some(attrs),
                ..Default::default()
            });
        }
    }
    for (&group, targets) in &sel.groups {
        let Some(first) = targets.iter().find(|t| t.primary) else {
            continue; // a group holds targets only for its GPUs' sake
        };
        let Some(gpu) = inv.device(&first.address) else {
            continue; // selected from this inventory: always there
        };
        if gpu.driver.as_deref().is_some_and(is_vfio_driver) && !inv.vfio_nodes.contains(&group) {
            // Published, tainted ([`taint`]).
            out.left_out.push(LeftOut {
                address: gpu.address,
                reason: format!(
                    "{} is on {} but /dev/vfio/{group} is missing: the kernel did not make \
                     IOMMU group {group} viable",
                    gpu.address,
                    gpu.driver.as_deref().unwrap_or_default()
                ),
                code: "no-vfio-group-node",
            });
        }
        let mut whole = device(gpu, first, group, targets, ids);
        if vgpu_pool.gpus.contains(&gpu.address)
            && let Some((set, vgpus)) = vgpu_devices(gpu, &mut whole, ids, &vgpu_pool.types)
        {
            out.counters.push(set);
            out.devices.extend(vgpus);
        }
        out.devices.push(whole);
    }
    out.devices.sort_by(|a, b| a.name.cmp(&b.name));
    out.left_out.sort_by_key(|l| l.address);
    out
}

/// The attributes the slice publishes for device `name` of this node now (every one: the
/// device-metadata file repeats them, as upstream's kubelet-plugin helper does); `None` for a
/// name that is none of the node's devices. `aliases` names each GPU's VFIO driver, `ids` its
/// product, `mdev_parents` the non-PCI parents of `--vgpu`.
pub fn attributes_of(
    inv: &Inventory,
    aliases: &AliasTable,
    ids: &PciIds,
    mdev_parents: &BTreeSet<String>,
    name: &str,
) -> Option<BTreeMap<String, DeviceAttribute>> {
    if let Some(addr) = names::parse_gpu_device(name) {
        let sel = select(inv, &Selector::default(), None, aliases);
        let (&group, targets) = sel
            .groups
            .iter()
            .find(|(_, ts)| ts.iter().any(|t| t.primary && t.address == addr))?;
        let first = targets.iter().find(|t| t.primary)?;
        let gpu = inv.device(&first.address)?;
        return device(gpu, first, group, targets, ids).attributes;
    }
    if let Some((addr, key)) = names::parse_vgpu_device(name) {
        let gpu = inv.device(&addr)?;
        let (_, devices) = vgpu_devices(gpu, &mut Device::default(), ids, &Types::All)?;
        let shared = names::vgpu_device(&addr, &key);
        return devices.into_iter().find(|d| d.name == shared)?.attributes;
    }
    let (parent, _, _) = names::parse_mdev_device(name, mdev_parents)?;
    let (_, devices) = mdev_parent_devices(inv, &parent)?;
    devices.into_iter().find(|d| d.name == name)?.attributes
}

fn string(s: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.into()),
        ..Default::default()
    }
}

fn int(i: impl Into<i64>) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i.into()),
        ..Default::default()
    }
}

/// What a GPU is, for a device of it: `vendorID`, `deviceID`, `productName` (when pci.ids
/// knows it), `numaNode` and the standard `resource.kubernetes.io/numaNode` (when the kernel
/// says), the standard `resource.kubernetes.io/pcieRoot`.
fn identity(gpu: &PciDevice, ids: &PciIds, attrs: &mut BTreeMap<String, DeviceAttribute>) {
    attrs.insert(
        "vendorID".to_string(),
        string(format!("{:04x}", gpu.vendor)),
    );
    attrs.insert(
        "deviceID".to_string(),
        string(format!("{:04x}", gpu.device)),
    );
    if let Some(name) = ids.device_name(gpu.vendor, gpu.device) {
        attrs.insert("productName".to_string(), string(truncate(&name)));
    }
    if let Some(n) = gpu.numa_node {
        attrs.insert("numaNode".to_string(), int(n));
        attrs.insert(NUMA_NODE.to_string(), int(n));
    }
    if let Some(root) = &gpu.pcie_root {
        attrs.insert(PCIE_ROOT.to_string(), string(truncate(root)));
    }
}

/// The device of IOMMU group `group`, named after `gpu` (its first GPU, `first` its target).
fn device(gpu: &PciDevice, first: &Target, group: u32, targets: &[Target], ids: &PciIds) -> Device {
    let mut attrs = BTreeMap::new();
    attrs.insert("mode".to_string(), string(MODE_PASSTHROUGH));
    identity(gpu, ids, &mut attrs);
    attrs.insert(PCI_BUS_ID.to_string(), string(gpu.address.to_string()));
    attrs.insert("iommuGroup".to_string(), int(group));
    attrs.insert(
        "functions".to_string(),
        int(i64::try_from(targets.len()).unwrap_or(i64::MAX)),
    );
    let companions: Vec<String> = targets
        .iter()
        .filter(|t| t.address != gpu.address)
        .map(|t| t.address.to_string())
        .collect();
    if !companions.is_empty() {
        let joined = companions.join(",");
        if joined.len() <= MAX_STRING_ATTRIBUTE {
            attrs.insert("companions".to_string(), string(joined));
        } else {
            // Only a group of six or more functions gets here; `functions` still counts them.
            tracing::debug!(group, companions = %joined, "companion list too long for an attribute");
        }
    }
    attrs.insert("vfioDriver".to_string(), string(first.target.clone()));
    Device {
        name: names::gpu_device(&gpu.address),
        attributes: Some(attrs),
        capacity: framebuffer(gpu).map(|q| {
            BTreeMap::from([(
                "memory".to_string(),
                DeviceCapacity {
                    value: q,
                    ..Default::default()
                },
            )])
        }),
        ..Default::default()
    }
}

fn gib(n: u32) -> Quantity {
    Quantity(format!("{n}Gi"))
}

/// The GPU's framebuffer, from the vGPU model table every daemon plans with. `None` for a
/// model it does not know (workstation and older datacenter GPUs): sysfs does not show a
/// GPU's memory while it is not on nvidia, so there is nothing else to read it from.
fn framebuffer(gpu: &PciDevice) -> Option<Quantity> {
    common::vgpu::models::model(gpu.vendor, gpu.device)
        .map(|m| Quantity(format!("{}Gi", m.memory_gib)))
}

/// `s` cut to the longest prefix the API takes as a string attribute.
fn truncate(s: &str) -> String {
    let mut end = s.len().min(MAX_STRING_ATTRIBUTE);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// What identifies the node's pools and slices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// The driver name.
    pub driver: String,
    /// The node's name: its own pool's name, the prefix of its GPUs' pools
    /// ([`names::gpu_pool`]), and the slices' `nodeName`.
    pub node_name: String,
    /// The Node's UID, for the owner reference that has Kubernetes' garbage collector delete
    /// the slice with the Node; `None` until it is known.
    pub node_uid: Option<String>,
    /// Each GPU of the vGPU pool in a pool of its own (`--pool-per-gpu`); otherwise every
    /// device in the node's pool.
    pub per_gpu: bool,
    /// GPUs kept in another of the node's pools than [`Pool::per_gpu`] gives them: the pool
    /// their prepared claims were allocated from (the flag turned on or off under them), so
    /// the scheduler goes on counting those claims against the GPU.
    pub pinned: BTreeMap<PciAddress, String>,
}

/// `name` cut to the API's 253 characters by keeping its end (the driver's and the GPU's part).
fn slice_name_within_limit(name: String) -> String {
    match name.len().checked_sub(253) {
        Some(extra) if extra > 0 => name[extra..].trim_start_matches(['-', '.']).to_string(),
        _ => name,
    }
}

impl Pool {
    /// The pool device `d` is published in ([`Pool::slices`]): with [`Pool::per_gpu`] its GPU's
    /// own when it consumes a GPU's counter set, the node's otherwise.
    pub fn pool_of(&self, d: &Device) -> String {
        d.consumes_counters
            .as_ref()
            .and_then(|c| c.first())
            .map_or_else(
                || self.node_name.clone(),
                |c| self.pool_of_set(&c.counter_set),
            )
    }

    /// The pool counter set `set` (and each device consuming it) goes to: the one its GPU is
    /// [pinned](Pool::pinned) to; else with [`Pool::per_gpu`] its GPU's own, for a GPU's set;
    /// the node's for any other.
    fn pool_of_set(&self, set: &str) -> String {
        let gpu = names::parse_gpu_device(set);
        if let Some(pool) = gpu.as_ref().and_then(|g| self.pinned.get(g)) {
            return pool.clone();
        }
        self.layout_pool(gpu.as_ref())
    }

    /// The pool the layout alone ([`Pool::per_gpu`], nothing [pinned](Pool::pinned)) gives
    /// the devices of `gpu` (a pooled GPU's counter set and the devices consuming it), or
    /// devices of no GPU's counter set (`None`).
    pub fn layout_pool(&self, gpu: Option<&PciAddress>) -> String {
        match gpu {
            Some(gpu) if self.per_gpu => names::gpu_pool(&self.node_name, gpu),
            _ => self.node_name.clone(),
        }
    }

    /// The node pool's slice name: `<node>-<driver>`, one per node and driver. A name over 253
    /// characters (the API's limit) keeps its end, the driver's part.
    pub fn slice_name(&self) -> String {
        slice_name_within_limit(format!("{}-{}", self.node_name, self.driver))
    }

    /// The owner reference to the Node, when its UID is known.
    pub fn owner(&self) -> Option<OwnerReference> {
        Some(OwnerReference {
            api_version: "v1".to_string(),
            kind: "Node".to_string(),
            name: self.node_name.clone(),
            uid: self.node_uid.clone()?,
            controller: Some(true),
            block_owner_deletion: None,
        })
    }

    /// The node pool's one slice holding `devices`, at pool `generation`.
    pub fn slice(&self, devices: Vec<Device>, generation: i64) -> ResourceSlice {
        self.slice_named(
            self.slice_name(),
            &self.node_name,
            Some(devices),
            None,
            generation,
            1,
        )
    }

    /// The node's slices, each pool's at `generation`:
    ///
    /// - with [`Pool::per_gpu`], each GPU of the vGPU pool is a pool of its own
    ///   ([`names::gpu_pool`]): its counter set,
    ///   and the devices that consume it (its whole-GPU device, its vGPU devices), in two
    ///   slices `<node>-<driver>-<gpu>` and `<node>-<driver>-<gpu>-counters` (Kubernetes 1.35
    ///   and later take counters and devices only in separate slices of one pool). The
    ///   scheduler checks a device's counters against the other devices of its pool, and asks
    ///   for each of them whether any claim in the cluster holds a share of it: a pool per GPU
    ///   keeps that walk to one GPU's devices;
    /// - every other device is in the node's pool (named after the node; left out when it has
    ///   none and there are GPUs' pools): without counters one
    ///   slice `<node>-<driver>` ([`Pool::slice`]); with counters (an mdev parent's) the counter
    ///   sets in slices of their own, `<slice>-counters`, `<slice>-counters-1`, … of at most
    ///   [`MAX_COUNTER_SETS`] sets and [`MAX_COUNTERS`] counters, and the devices in slices of
    ///   at most [`MAX_DEVICES_WITH_COUNTERS`], `<slice>`, `<slice>-1`, …;
    /// - each of `held` (a device a prepared claim holds that the node no longer offers) in the
    ///   pool its claim's allocation names.
    pub fn slices(
        &self,
        devices: Vec<Device>,
        counters: Vec<CounterSet>,
        held: Vec<(String, Device)>,
        generation: i64,
    ) -> Vec<ResourceSlice> {
        let node = self.node_name.as_str();
        let mut pools: BTreeMap<String, (Vec<Device>, Vec<CounterSet>)> = BTreeMap::new();
        pools.entry(node.to_string()).or_default();
        for set in counters {
            pools
                .entry(self.pool_of_set(&set.name))
                .or_default()
                .1
                .push(set);
        }
        for d in devices {
            pools.entry(self.pool_of(&d)).or_default().0.push(d);
        }
        for (pool, d) in held {
            pools.entry(pool).or_default().0.push(d);
        }
        // The node's own pool only when it has something, or is the only one.
        if pools.len() > 1
            && pools
                .get(node)
                .is_some_and(|(d, c)| d.is_empty() && c.is_empty())
        {
            pools.remove(node);
        }
        let mut out = Vec::new();
        for (pool, (mut devices, counters)) in pools {
            devices.sort_by(|a, b| a.name.cmp(&b.name));
            let base = match pool.strip_prefix(node).and_then(|r| r.strip_prefix('/')) {
                Some(gpu) => slice_name_within_limit(format!("{node}-{}-{gpu}", self.driver)),
                None => self.slice_name(),
            };
            out.extend(self.pool_slices(&pool, &base, devices, counters, generation));
        }
        out
    }

    /// The slices of pool `pool`, named from `base`.
    fn pool_slices(
        &self,
        pool: &str,
        base: &str,
        devices: Vec<Device>,
        counters: Vec<CounterSet>,
        generation: i64,
    ) -> Vec<ResourceSlice> {
        if counters.is_empty() {
            let slice =
                self.slice_named(base.to_string(), pool, Some(devices), None, generation, 1);
            return vec![slice];
        }
        let chunks: Vec<Vec<Device>> = if devices.is_empty() {
            vec![Vec::new()]
        } else {
            devices
                .chunks(MAX_DEVICES_WITH_COUNTERS)
                .map(<[Device]>::to_vec)
                .collect()
        };
        let mut counter_chunks: Vec<Vec<CounterSet>> = vec![Vec::new()];
        for set in counters {
            let in_last: usize = counter_chunks
                .last()
                .map_or(0, |c| c.iter().map(|s| s.counters.len()).sum());
            let sets_in_last = counter_chunks.last().map_or(0, Vec::len);
            if sets_in_last >= MAX_COUNTER_SETS || in_last + set.counters.len() > MAX_COUNTERS {
                counter_chunks.push(Vec::new());
            }
            if let Some(last) = counter_chunks.last_mut() {
                last.push(set);
            }
        }
        let count = i64::try_from(chunks.len() + counter_chunks.len()).unwrap_or(i64::MAX);
        let mut out: Vec<ResourceSlice> = chunks
            .into_iter()
            .enumerate()
            .map(|(i, d)| {
                let name = if i == 0 {
                    base.to_string()
                } else {
                    slice_name_within_limit(format!("{base}-{i}"))
                };
                self.slice_named(name, pool, Some(d), None, generation, count)
            })
            .collect();
        for (i, sets) in counter_chunks.into_iter().enumerate() {
            let name = if i == 0 {
                format!("{base}-counters")
            } else {
                format!("{base}-counters-{i}")
            };
            let name = slice_name_within_limit(name);
            out.push(self.slice_named(name, pool, None, Some(sets), generation, count));
        }
        out
    }

    fn slice_named(
        &self,
        name: String,
        pool: &str,
        devices: Option<Vec<Device>>,
        counters: Option<Vec<CounterSet>>,
        generation: i64,
        count: i64,
    ) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name),
                owner_references: self.owner().map(|o| vec![o]),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: self.driver.clone(),
                node_name: Some(self.node_name.clone()),
                pool: ResourcePool {
                    name: pool.to_string(),
                    generation,
                    resource_slice_count: count,
                },
                devices,
                shared_counters: counters,
                ..Default::default()
            },
        }
    }
}

#[cfg(test)]
mod tests;
