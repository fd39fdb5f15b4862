//! The node's devices as ResourceSlices: one pool per node, one device per GPU that can be
//! passed through.
//!
//! Which GPUs: exactly those vfio-manager would bind ([`common::vfio::select`] with its default
//! selector: NVIDIA display functions that are not VFs, each with the other endpoint functions
//! of its IOMMU group), so that a device published here is one prepare can put on VFIO whole.
//! A device is one IOMMU group: the group travels to the VM whole, so two GPUs sharing a group
//! (behind a switch without ACS) are one device, named after the first, the other listed
//! among its companions.
//!
//! A GPU that cannot be given to a VM is left out of the slice rather than published with a
//! taint (device taints are alpha in Kubernetes 1.34, off by default), with the reason logged:
//! a group vfio-manager refuses (a foreign or unreadable member, no IOMMU group), and a GPU
//! on its VFIO driver whose `/dev/vfio/<group>` node is missing (the kernel did not make the
//! group viable).
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
//! | `numaNode` (left out when the kernel does not say) | `0` |
//! | `iommuGroup` | `21` |
//! | `functions` (how many PCI functions go to the VM) | `2` |
//! | `companions` (the other functions, comma-separated; left out when none) | `0000:41:00.1` |
//! | `vfioDriver` (`vfio-pci`, or the variant driver `modules.alias` names) | `vfio-pci` |
//!
//! and its capacity `memory` (the GPU's framebuffer, `24Gi`) where the model is known.

use std::collections::{BTreeMap, BTreeSet};

use common::vfio::{Selection, Target};
use common::{Inventory, PciAddress, PciDevice, PciIds, is_vfio_driver};
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::names;

/// The standard attribute naming a device's PCI address (KEP-5304), which KubeVirt reads.
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";

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

/// The most counters, in all its sets, one slice holds (the API's limit).
pub const MAX_COUNTERS: usize = 32;

/// The longest string attribute value the API accepts.
const MAX_STRING_ATTRIBUTE: usize = 64;

/// A GPU left out of the slice, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftOut {
    /// The GPU.
    pub address: PciAddress,
    /// A sentence naming the reason.
    pub reason: String,
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
}

/// The devices `inv` has for the slice, from vfio-manager's selection `sel` of it; product
/// names from `ids`.
pub fn devices(inv: &Inventory, sel: &Selection, ids: &PciIds) -> NodeDevices {
    devices_with_vgpus(inv, sel, ids, &BTreeSet::new())
}

/// [`devices`], and for each GPU of `vgpu_pool` whose model the vGPU model table knows
/// ([`common::vgpu::models`]): a counter set (its framebuffer; its VFs on an SR-IOV GPU), as
/// many devices per vGPU type as the GPU could hold of it, each consuming its framebuffer and
/// one VF, and its passthrough device consuming the whole set.
pub fn devices_with_vgpus(
    inv: &Inventory,
    sel: &Selection,
    ids: &PciIds,
    vgpu_pool: &BTreeSet<PciAddress>,
) -> NodeDevices {
    let mut out = NodeDevices::default();
    for r in &sel.refused {
        out.left_out.push(LeftOut {
            address: r.address,
            reason: r.reason.clone(),
        });
    }
    for (&group, targets) in &sel.groups {
        let Some(first) = targets.iter().find(|t| t.primary) else {
            continue; // a group holds targets only for its GPUs' sake
        };
        let Some(gpu) = inv.device(&first.address) else {
            continue; // selected from this inventory: always there
        };
        if gpu.driver.as_deref().is_some_and(is_vfio_driver) && !inv.vfio_nodes.contains(&group) {
            out.left_out.push(LeftOut {
                address: gpu.address,
                reason: format!(
                    "{} is on {} but /dev/vfio/{group} is missing: the kernel did not make \
                     IOMMU group {group} viable",
                    gpu.address,
                    gpu.driver.as_deref().unwrap_or_default()
                ),
            });
            continue;
        }
        let mut whole = device(gpu, first, group, targets, ids);
        if vgpu_pool.contains(&gpu.address)
            && let Some((set, vgpus)) = vgpu_devices(inv, gpu, &mut whole, ids)
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
/// knows it), `numaNode` (when the kernel says).
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

/// One pooled GPU's counter set and vGPU devices; `whole` (its passthrough device) is made to
/// consume the whole set. `None` for a model the table does not know.
fn vgpu_devices(
    inv: &Inventory,
    gpu: &PciDevice,
    whole: &mut Device,
    ids: &PciIds,
) -> Option<(CounterSet, Vec<Device>)> {
    let model = common::vgpu::models::model(gpu.vendor, gpu.device)?;
    let set_name = names::gpu_device(&gpu.address);
    let vfs = gpu.sriov_totalvfs.filter(|n| *n > 0);
    let mut counters = BTreeMap::from([(
        COUNTER_MEMORY.to_string(),
        Counter {
            value: gib(model.memory_gib),
        },
    )]);
    if let Some(n) = vfs {
        counters.insert(
            COUNTER_VFS.to_string(),
            Counter {
                value: Quantity(n.to_string()),
            },
        );
    }
    whole.consumes_counters = Some(vec![DeviceCounterConsumption {
        counter_set: set_name.clone(),
        counters: counters.clone(),
    }]);
    // Type ids where sysfs shows them (the VFs enabled, or the GPU its own parent).
    let cap = common::vgpu::capacity(inv, &gpu.address);
    let mut out = Vec::new();
    for (name, size) in model.types_before_vfs() {
        let max = vfs.map_or(model.equal_size_max(size), |n| {
            model.equal_size_max(size).min(n)
        });
        let series = name.chars().last().unwrap_or_default().to_string();
        let mut attrs = BTreeMap::new();
        attrs.insert("mode".to_string(), string(MODE_VGPU));
        attrs.insert("vgpuType".to_string(), string(name.clone()));
        if let Some(id) = cap.get(&name).and_then(|t| t.type_id.clone()) {
            attrs.insert("typeID".to_string(), string(id));
        }
        attrs.insert("series".to_string(), string(series));
        attrs.insert("framebufferMiB".to_string(), int(i64::from(size) * 1024));
        attrs.insert("maxInstances".to_string(), int(max));
        attrs.insert("parentGPU".to_string(), string(gpu.address.to_string()));
        identity(gpu, ids, &mut attrs);
        let mut consumes =
            BTreeMap::from([(COUNTER_MEMORY.to_string(), Counter { value: gib(size) })]);
        if vfs.is_some() {
            consumes.insert(
                COUNTER_VFS.to_string(),
                Counter {
                    value: Quantity("1".into()),
                },
            );
        }
        for slot in 0..max {
            out.push(Device {
                name: names::vgpu_device(&gpu.address, &name, slot),
                attributes: Some(attrs.clone()),
                capacity: Some(BTreeMap::from([(
                    "memory".to_string(),
                    DeviceCapacity {
                        value: gib(size),
                        ..Default::default()
                    },
                )])),
                consumes_counters: Some(vec![DeviceCounterConsumption {
                    counter_set: set_name.clone(),
                    counters: consumes.clone(),
                }]),
                ..Default::default()
            });
        }
    }
    let set = CounterSet {
        name: set_name,
        counters,
    };
    Some((set, out))
}

/// The counter set and devices of an mdev parent that is not a PCI function (`--vgpu mtty`),
/// from the one model of such parents ([`common::vgpu::parents`]): per type as many devices as
/// could exist (attributes `vgpuType`, the type's `name` or its id, `typeID`, `mdevParent`,
/// `maxInstances`). A parent whose types share one resource (`mtty`'s serial ports) gets one
/// counter of it, named as the model names it, each device consuming what its type takes; any
/// other parent no counters, and per type its `available_instances` plus its mdevs. `None` for
/// a parent `inv` does not have.
pub fn mdev_parent_devices(
    inv: &Inventory,
    parent: &str,
) -> Option<(Option<CounterSet>, Vec<Device>)> {
    let cap = common::vgpu::parents::capacity(inv, parent)?;
    let set = cap.shared.as_ref().map(|shared| CounterSet {
        name: format!("mdev-{parent}"),
        counters: BTreeMap::from([(
            shared.counter.to_string(),
            Counter {
                value: Quantity(shared.total.to_string()),
            },
        )]),
    });
    let mut out = Vec::new();
    for t in &cap.types {
        let Some(type_id) = t.type_id.as_deref() else {
            continue;
        };
        if !names::is_name_part(type_id) {
            tracing::warn!(
                parent,
                type_id,
                "mdev type id cannot stand in a device name; not published"
            );
            continue;
        }
        let cost = cap
            .shared
            .as_ref()
            .and_then(|s| Some((s, *s.cost.get(type_id)?)))
            .filter(|(_, n)| *n > 0);
        let (max, consumes) = match (&set, cost) {
            (Some(set), Some((shared, n))) => {
                let consumes = DeviceCounterConsumption {
                    counter_set: set.name.clone(),
                    counters: BTreeMap::from([(
                        shared.counter.to_string(),
                        Counter {
                            value: Quantity(n.to_string()),
                        },
                    )]),
                };
                (shared.total / n, Some(vec![consumes]))
            }
            _ => (t.max.unwrap_or(t.available), None),
        };
        let mut attrs = BTreeMap::new();
        attrs.insert("mode".to_string(), string(MODE_VGPU));
        attrs.insert("vgpuType".to_string(), string(truncate(&t.name)));
        attrs.insert("typeID".to_string(), string(truncate(type_id)));
        attrs.insert("mdevParent".to_string(), string(truncate(parent)));
        attrs.insert("maxInstances".to_string(), int(max));
        for slot in 0..max {
            out.push(Device {
                name: names::mdev_device(parent, type_id, slot),
                attributes: Some(attrs.clone()),
                consumes_counters: consumes.clone(),
                ..Default::default()
            });
        }
    }
    Some((set, out))
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

/// What identifies the node's pool and slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// The driver name.
    pub driver: String,
    /// The node's name: the pool's name and the slice's `nodeName`.
    pub node_name: String,
    /// The Node's UID, for the owner reference that has Kubernetes' garbage collector delete
    /// the slice with the Node; `None` until it is known.
    pub node_uid: Option<String>,
}

impl Pool {
    /// The slice's name: `<node>-<driver>`, one per node and driver. A name over 253
    /// characters (the API's limit) keeps its end, the driver's part.
    pub fn slice_name(&self) -> String {
        let name = format!("{}-{}", self.node_name, self.driver);
        match name.len().checked_sub(253) {
            Some(extra) if extra > 0 => name[extra..].trim_start_matches(['-', '.']).to_string(),
            _ => name,
        }
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

    /// The node's slice holding `devices`, at pool `generation`.
    pub fn slice(&self, devices: Vec<Device>, generation: i64) -> ResourceSlice {
        self.slice_named(self.slice_name(), Some(devices), None, generation, 1)
    }

    /// The node's slices: without counters the one [`Pool::slice`]; with counters (a vGPU
    /// pool) the counter sets in slices of their own, `<slice>-counters`, `<slice>-counters-1`,
    /// … of at most [`MAX_COUNTERS`] counters (Kubernetes 1.35 and later take counters and
    /// devices only in separate slices of one pool), and the devices in slices of at most
    /// [`MAX_DEVICES_WITH_COUNTERS`], `<slice>`, `<slice>-1`, ….
    pub fn slices(
        &self,
        devices: Vec<Device>,
        counters: Vec<CounterSet>,
        generation: i64,
    ) -> Vec<ResourceSlice> {
        if counters.is_empty() {
            return vec![self.slice(devices, generation)];
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
            if in_last + set.counters.len() > MAX_COUNTERS {
                counter_chunks.push(Vec::new());
            }
            if let Some(last) = counter_chunks.last_mut() {
                last.push(set);
            }
        }
        let count = i64::try_from(chunks.len() + counter_chunks.len()).unwrap_or(i64::MAX);
        let base = self.slice_name();
        let mut out: Vec<ResourceSlice> = chunks
            .into_iter()
            .enumerate()
            .map(|(i, d)| {
                let name = if i == 0 {
                    base.clone()
                } else {
                    format!("{base}-{i}")
                };
                self.slice_named(name, Some(d), None, generation, count)
            })
            .collect();
        for (i, sets) in counter_chunks.into_iter().enumerate() {
            let name = if i == 0 {
                format!("{base}-counters")
            } else {
                format!("{base}-counters-{i}")
            };
            out.push(self.slice_named(name, None, Some(sets), generation, count));
        }
        out
    }

    fn slice_named(
        &self,
        name: String,
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
                    name: self.node_name.clone(),
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
mod tests {
    use super::*;
    use common::vfio::{AliasTable, Selector, select};

    const NVIDIA: u16 = 0x10de;

    fn dev(addr: &str, device: u16, class: u32, group: u32, driver: &str) -> PciDevice {
        PciDevice {
            driver: Some(driver.into()),
            iommu_group: Some(group),
            numa_node: Some(1),
            modalias: Some(format!(
                "pci:v000010DEd0000{device:04X}sv000010DEsd00001482bc{:02X}sc{:02X}i00",
                class >> 16,
                (class >> 8) & 0xff
            )),
            ..PciDevice::new(addr.parse().unwrap(), NVIDIA, device, class)
        }
    }

    fn inv(devs: Vec<PciDevice>, vfio_nodes: &[u32]) -> Inventory {
        Inventory {
            devices: devs.into_iter().map(|d| (d.address, d)).collect(),
            vfio_nodes: vfio_nodes.iter().copied().collect(),
            ..Default::default()
        }
    }

    fn node_devices(inv: &Inventory, aliases: &str) -> NodeDevices {
        let sel = select(inv, &Selector::default(), None, &AliasTable::parse(aliases));
        devices(inv, &sel, &PciIds::embedded())
    }

    fn attr<'a>(d: &'a Device, key: &str) -> Option<&'a DeviceAttribute> {
        d.attributes.as_ref().unwrap().get(key)
    }

    fn s<'a>(d: &'a Device, key: &str) -> Option<&'a str> {
        attr(d, key).and_then(|a| a.string.as_deref())
    }

    fn i(d: &Device, key: &str) -> Option<i64> {
        attr(d, key).and_then(|a| a.int)
    }

    #[test]
    fn an_a10_is_described_for_selection() {
        let inv = inv(
            vec![dev("0000:41:00.0", 0x2236, 0x030200, 21, "nvidia")],
            &[],
        );
        let nd = node_devices(&inv, "");
        assert!(nd.left_out.is_empty(), "{:?}", nd.left_out);
        let [d] = &nd.devices[..] else {
            panic!("{:?}", nd.devices)
        };
        assert_eq!(d.name, "gpu-0000-41-00-0");
        assert_eq!(s(d, "mode"), Some("passthrough"));
        assert_eq!(s(d, "vendorID"), Some("10de"));
        assert_eq!(s(d, "deviceID"), Some("2236"));
        assert_eq!(s(d, "productName"), Some("GA102GL [A10]"));
        assert_eq!(s(d, PCI_BUS_ID), Some("0000:41:00.0"));
        assert_eq!(i(d, "numaNode"), Some(1));
        assert_eq!(i(d, "iommuGroup"), Some(21));
        assert_eq!(i(d, "functions"), Some(1));
        assert_eq!(attr(d, "companions"), None);
        assert_eq!(s(d, "vfioDriver"), Some("vfio-pci"));
        let cap = d.capacity.as_ref().unwrap();
        assert_eq!(cap["memory"].value, Quantity("24Gi".into()));
        // Every attribute name is one the API accepts: a C identifier of at most 32
        // characters, optionally behind a domain.
        for k in d.attributes.as_ref().unwrap().keys() {
            let id = k.rsplit('/').next().unwrap();
            assert!(id.len() <= 32 && !id.starts_with(|c: char| c.is_ascii_digit()));
            assert!(
                id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{k}"
            );
        }
    }

    /// A type and the UUIDs of its instances.
    fn mdev_type(
        id: &str,
        name: &str,
        available: u32,
        devices: &[&str],
    ) -> (common::MdevType, Vec<String>) {
        let t = common::MdevType {
            id: id.into(),
            name: Some(name.into()),
            available_instances: available,
            description: None,
        };
        (t, devices.iter().map(|d| d.to_string()).collect())
    }

    fn mdev_node(parent: &str, types: Vec<(common::MdevType, Vec<String>)>) -> Inventory {
        let mut inv = Inventory::default();
        for (t, uuids) in &types {
            for uuid in uuids {
                inv.mdevs.insert(
                    uuid.clone(),
                    common::MdevDevice {
                        uuid: uuid.clone(),
                        type_id: t.id.clone(),
                        type_name: t.name.clone(),
                        parent: parent.into(),
                        parent_pci: None,
                        iommu_group: Some(7),
                        driver: Some("vfio_mdev".into()),
                        vfio_cdev: None,
                    },
                );
            }
        }
        inv.mdev_parents.insert(
            parent.into(),
            common::MdevParent {
                name: parent.into(),
                pci: None,
                types: types.into_iter().map(|(t, _)| t).collect(),
            },
        );
        inv
    }

    #[test]
    fn mtty_publishes_its_ports_as_one_counter_whatever_is_in_use() {
        // 24 ports, one dual-port mdev made: 22 free (mtty-1 shows 22, mtty-2 11).
        let inv = mdev_node(
            "mtty",
            vec![
                mdev_type("mtty-1", "Single port serial", 22, &[]),
                mdev_type("mtty-2", "Dual port serial", 11, &["u-1"]),
            ],
        );
        let (set, devices) = mdev_parent_devices(&inv, "mtty").unwrap();
        let set = set.unwrap();
        assert_eq!(set.name, "mdev-mtty");
        assert_eq!(set.counters["ports"].value, Quantity("24".into()));
        let of = |t: &str| devices.iter().filter(|d| s(d, "typeID") == Some(t)).count();
        assert_eq!((of("mtty-1"), of("mtty-2"), devices.len()), (24, 12, 36));
        let d = devices
            .iter()
            .find(|d| d.name == "mdev-mtty-mtty-2-11")
            .unwrap();
        assert_eq!(s(d, "mode"), Some(MODE_VGPU));
        assert_eq!(s(d, "vgpuType"), Some("Dual port serial"));
        assert_eq!(s(d, "mdevParent"), Some("mtty"));
        assert_eq!(i(d, "maxInstances"), Some(12));
        let c = &d.consumes_counters.as_ref().unwrap()[0];
        assert_eq!(c.counter_set, "mdev-mtty");
        assert_eq!(c.counters["ports"].value, Quantity("2".into()));
        assert_eq!(mdev_parent_devices(&inv, "mbochs"), None);
    }

    #[test]
    fn another_mdev_parent_has_no_counters_and_its_types_own_counts() {
        let inv = mdev_node(
            "mbochs",
            vec![
                mdev_type("mbochs-1", "mbochs-64", 1, &["u-1"]),
                mdev_type("mbochs-2", "mbochs-128", 0, &[]),
                mdev_type("Odd Type", "odd", 3, &[]),
            ],
        );
        let (set, devices) = mdev_parent_devices(&inv, "mbochs").unwrap();
        assert_eq!(set, None);
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["mdev-mbochs-mbochs-1-0", "mdev-mbochs-mbochs-1-1"]);
        assert!(devices.iter().all(|d| d.consumes_counters.is_none()));
        assert_eq!(i(&devices[0], "maxInstances"), Some(2));
    }

    #[test]
    fn the_audio_function_travels_with_its_gpu_and_unknown_models_have_no_capacity() {
        // A workstation GPU with its HDMI audio function in the same group, on the host's
        // drivers; the numa node unknown.
        let mut gpu = dev("0000:01:00.0", 0x2684, 0x030000, 1, "nvidia");
        gpu.numa_node = None;
        let audio = dev("0000:01:00.1", 0x22ba, 0x040300, 1, "snd_hda_intel");
        let nd = node_devices(&inv(vec![gpu, audio], &[]), "");
        let [d] = &nd.devices[..] else {
            panic!("{:?}", nd.devices)
        };
        assert_eq!(d.name, "gpu-0000-01-00-0");
        assert_eq!(s(d, "companions"), Some("0000:01:00.1"));
        assert_eq!(i(d, "functions"), Some(2));
        assert_eq!(i(d, "numaNode"), None);
        assert_eq!(
            d.capacity, None,
            "the RTX 4090's memory is not in the model table"
        );
    }

    #[test]
    fn the_variant_driver_from_modules_alias_is_named() {
        let inv = inv(
            vec![dev("0000:09:00.0", 0x2342, 0x030200, 9, "nvidia")],
            &[],
        );
        let nd = node_devices(
            &inv,
            "alias vfio_pci:v000010DEd00002342sv*sd*bc03sc*i* nvgrace_gpu_vfio_pci\n",
        );
        assert_eq!(
            s(&nd.devices[0], "vfioDriver"),
            Some("nvgrace_gpu_vfio_pci")
        );
    }

    #[test]
    fn two_gpus_in_one_group_are_one_device() {
        let inv = inv(
            vec![
                dev("0000:41:00.0", 0x2236, 0x030200, 5, "nvidia"),
                dev("0000:42:00.0", 0x2236, 0x030200, 5, "nvidia"),
            ],
            &[],
        );
        let nd = node_devices(&inv, "");
        let [d] = &nd.devices[..] else {
            panic!("{:?}", nd.devices)
        };
        assert_eq!(d.name, "gpu-0000-41-00-0");
        assert_eq!(s(d, "companions"), Some("0000:42:00.0"));
    }

    #[test]
    fn refused_groups_and_unviable_groups_are_left_out_with_the_reason() {
        let mut nic = dev("0000:61:00.1", 0x1572, 0x020000, 37, "i40e");
        nic.vendor = 0x8086;
        let inv = inv(
            vec![
                dev("0000:41:00.0", 0x2236, 0x030200, 21, "vfio-pci"),
                dev("0000:61:00.0", 0x2236, 0x030200, 37, "nvidia"),
                nic,
                dev("0000:81:00.0", 0x2236, 0x030200, 50, "vfio-pci"),
            ],
            &[50],
        );
        let nd = node_devices(&inv, "");
        let names: Vec<&str> = nd.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-0000-81-00-0"]);
        let [missing, foreign] = &nd.left_out[..] else {
            panic!("{:?}", nd.left_out)
        };
        assert_eq!(missing.address.to_string(), "0000:41:00.0");
        assert!(
            missing.reason.contains("/dev/vfio/21 is missing"),
            "{}",
            missing.reason
        );
        assert_eq!(foreign.address.to_string(), "0000:61:00.0");
        assert!(
            foreign.reason.contains("0000:61:00.1"),
            "{}",
            foreign.reason
        );
    }

    #[test]
    fn the_slice_is_the_nodes_pool_owned_by_its_node() {
        let pool = Pool {
            driver: "gpu.gpu-vm-node.io".into(),
            node_name: "node-a".into(),
            node_uid: Some("uid-1".into()),
        };
        let inv = inv(
            vec![dev("0000:41:00.0", 0x2236, 0x030200, 21, "nvidia")],
            &[],
        );
        let devs = node_devices(&inv, "").devices;
        let slice = pool.slice(devs.clone(), 3);
        assert_eq!(
            slice.metadata.name.as_deref(),
            Some("node-a-gpu.gpu-vm-node.io")
        );
        let owner = &slice.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("Node", "node-a", "uid-1")
        );
        assert_eq!(slice.spec.driver, "gpu.gpu-vm-node.io");
        assert_eq!(slice.spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(slice.spec.pool.name, "node-a");
        assert_eq!(slice.spec.pool.generation, 3);
        assert_eq!(slice.spec.pool.resource_slice_count, 1);
        assert_eq!(slice.spec.devices, Some(devs));

        let unknown = Pool {
            node_uid: None,
            ..pool
        };
        assert_eq!(unknown.slice(vec![], 1).metadata.owner_references, None);
    }

    #[test]
    fn a_pooled_a10_has_a_counter_set_its_vgpus_and_its_whole_self_consume() {
        let mut a10 = dev("0000:41:00.0", 0x2236, 0x030200, 21, "nvidia");
        a10.sriov_totalvfs = Some(32);
        let inv = inv(vec![a10], &[]);
        let sel = select(&inv, &Selector::default(), None, &AliasTable::parse(""));
        let pool: BTreeSet<PciAddress> = ["0000:41:00.0".parse().unwrap()].into();
        let nd = devices_with_vgpus(&inv, &sel, &PciIds::embedded(), &pool);
        let [set] = &nd.counters[..] else {
            panic!("{:?}", nd.counters)
        };
        assert_eq!(set.name, "gpu-0000-41-00-0");
        assert_eq!(set.counters["memory"].value, Quantity("24Gi".into()));
        assert_eq!(set.counters["vfs"].value, Quantity("32".into()));
        let count = |key: &str| {
            nd.devices
                .iter()
                .filter(|d| s(d, "vgpuType") == Some(key))
                .count()
        };
        // Q and A: 24/size each; C from 4 GiB; B (no size the table derives) not offered.
        assert_eq!(count("NVIDIA A10-1Q"), 24);
        assert_eq!(count("NVIDIA A10-3Q"), 8);
        assert_eq!(count("NVIDIA A10-24A"), 1);
        assert_eq!(count("NVIDIA A10-4C"), 6);
        assert_eq!(nd.devices.len(), 1 + 60 + 60 + 16);
        let whole = nd
            .devices
            .iter()
            .find(|d| d.name == "gpu-0000-41-00-0")
            .unwrap();
        assert_eq!(
            whole.consumes_counters.as_ref().unwrap()[0].counters,
            set.counters
        );
        let q4 = nd
            .devices
            .iter()
            .find(|d| d.name == "vgpu-0000-41-00-0-a10-4q-5")
            .unwrap();
        let c = &q4.consumes_counters.as_ref().unwrap()[0];
        assert_eq!(c.counter_set, "gpu-0000-41-00-0");
        assert_eq!(c.counters["memory"].value, Quantity("4Gi".into()));
        assert_eq!(c.counters["vfs"].value, Quantity("1".into()));
        assert_eq!(i(q4, "maxInstances"), Some(6));
        assert_eq!(s(q4, "series"), Some("Q"));
        // Not pooled: passthrough only, consuming nothing.
        let plain = devices(&inv, &sel, &PciIds::embedded());
        assert!(plain.counters.is_empty());
        assert_eq!(plain.devices.len(), 1);
        assert_eq!(plain.devices[0].consumes_counters, None);

        // The slices: devices 64 at most each, counters apart, one generation and count.
        let pool = Pool {
            driver: "gpu.gpu-vm-node.io".into(),
            node_name: "n".into(),
            node_uid: None,
        };
        let sets: Vec<CounterSet> = (0..20)
            .map(|k| CounterSet {
                name: format!("s{k}"),
                ..set.clone()
            })
            .collect();
        let slices = pool.slices(nd.devices.clone(), sets, 4);
        let names: Vec<&str> = slices
            .iter()
            .map(|s| s.metadata.name.as_deref().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "n-gpu.gpu-vm-node.io",
                "n-gpu.gpu-vm-node.io-1",
                "n-gpu.gpu-vm-node.io-2",
                "n-gpu.gpu-vm-node.io-counters",
                "n-gpu.gpu-vm-node.io-counters-1"
            ]
        );
        for sl in &slices {
            assert_eq!(sl.spec.pool.resource_slice_count, 5);
            assert_eq!(sl.spec.pool.generation, 4);
            assert!(sl.spec.devices.as_ref().map_or(0, Vec::len) <= MAX_DEVICES_WITH_COUNTERS);
            let counters: usize = sl
                .spec
                .shared_counters
                .iter()
                .flatten()
                .map(|c| c.counters.len())
                .sum();
            assert!(counters <= MAX_COUNTERS);
            assert!(sl.spec.devices.is_none() || sl.spec.shared_counters.is_none());
        }
    }

    #[test]
    fn long_slice_names_keep_the_driver() {
        let pool = Pool {
            driver: "gpu.gpu-vm-node.io".into(),
            node_name: "n".repeat(250),
            node_uid: None,
        };
        let name = pool.slice_name();
        assert!(name.len() <= 253);
        assert!(name.ends_with("-gpu.gpu-vm-node.io"), "{name}");
        assert!(name.starts_with('n'));
    }
}
