//! The vGPU side of the slice: a counter set and one shared device per vGPU type for each GPU
//! of the vGPU pool, and for each non-PCI mdev parent `--vgpu` names its per-instance devices.
//!
//! **One shared device per GPU and type.** NVIDIA's time-sliced vGPUs of one GPU all have one
//! framebuffer size (equal-size mode), which counters cannot say: they are sums, and a 4 GiB
//! and an 8 GiB vGPU both fit a 24 GiB counter. So each type is one device that allows
//! multiple allocations (`allowMultipleAllocations`, Kubernetes' consumable capacity), with a
//! capacity `vgpus` of as many vGPUs of that type as the GPU holds, each allocation (share)
//! taking one (request policy: default 1, the only valid value), and consuming the GPU's whole
//! counter set, as the whole-GPU device does. The scheduler's allocator consumes a shared
//! device's counters once, with its first share (kube-scheduler 1.36, `k8s.io/
//! dynamic-resource-allocation` `structured/internal/incubating`: `allocateDevice` skips the
//! counter check of a device that already has a share, and `IsDeviceAllocated` counts a device
//! with shares as allocated). So the scheduler alone keeps one type per GPU, fills it up to the
//! type's count and keeps the whole GPU off it, before any prepare runs; the devices never
//! change with what is allocated.

use std::collections::BTreeMap;

use common::{Inventory, PciDevice, PciIds};
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, Counter, CounterSet, Device, DeviceCapacity, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{COUNTER_MEMORY, COUNTER_VFS, MODE_VGPU, gib, identity, int, string, truncate};
use crate::names;
use crate::vgpu_types::Types;

/// The capacity of a shared vGPU device: how many vGPUs of its type its GPU holds, one per
/// allocation.
pub const CAPACITY_VGPUS: &str = "vgpus";

/// One pooled GPU's counter set and its shared vGPU devices, one per type of `types`; `whole`
/// (its passthrough device) is made to consume the whole set, as each vGPU device does. `None`
/// for a model the table does not know.
pub(super) fn vgpu_devices(
    gpu: &PciDevice,
    whole: &mut Device,
    ids: &PciIds,
    types: &Types,
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
    let all_of_it = vec![DeviceCounterConsumption {
        counter_set: set_name.clone(),
        counters: counters.clone(),
    }];
    whole.consumes_counters = Some(all_of_it.clone());
    let one = Quantity("1".into());
    let mut out = Vec::new();
    for (name, size) in model.types_before_vfs() {
        if !types.publishes(&name) {
            continue;
        }
        let max = vfs.map_or(model.equal_size_max(size), |n| {
            model.equal_size_max(size).min(n)
        });
        let series = name.chars().last().unwrap_or_default().to_string();
        let mut attrs = BTreeMap::new();
        attrs.insert("mode".to_string(), string(MODE_VGPU));
        attrs.insert("vgpuType".to_string(), string(name.clone()));
        attrs.insert("series".to_string(), string(series));
        attrs.insert("framebufferMiB".to_string(), int(i64::from(size) * 1024));
        attrs.insert("maxInstances".to_string(), int(max));
        attrs.insert("parentGPU".to_string(), string(gpu.address.to_string()));
        identity(gpu, ids, &mut attrs);
        out.push(Device {
            name: names::vgpu_device(&gpu.address, &name),
            attributes: Some(attrs),
            allow_multiple_allocations: Some(true),
            capacity: Some(BTreeMap::from([(
                CAPACITY_VGPUS.to_string(),
                DeviceCapacity {
                    value: Quantity(max.to_string()),
                    request_policy: Some(CapacityRequestPolicy {
                        default: Some(one.clone()),
                        valid_values: Some(vec![one.clone()]),
                        valid_range: None,
                    }),
                },
            )])),
            consumes_counters: Some(all_of_it.clone()),
            ..Default::default()
        });
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
