//! The vGPU side of the slice: a counter set and per-type devices for each GPU of the vGPU
//! pool, and for each non-PCI mdev parent `--vgpu` names.

use std::collections::BTreeMap;

use common::{Inventory, PciDevice, PciIds};
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceCapacity, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{COUNTER_MEMORY, COUNTER_VFS, MODE_VGPU, gib, identity, int, string, truncate};
use crate::names;
use crate::vgpu_types::Types;

/// One pooled GPU's counter set and its vGPU devices of `types`; `whole` (its passthrough
/// device) is made to consume the whole set. `None` for a model the table does not know.
///
/// NVIDIA's time-sliced vGPUs of one GPU all have one framebuffer size (and a GPU that hosts
/// them itself, without SR-IOV, one type), which counters cannot say: a 4 GiB and an 8 GiB vGPU
/// both fit a 24 GiB counter. So once a GPU hosts vGPUs, only the types that may join them are
/// published; the others come back when its last vGPU is gone. A claim the scheduler allocated
/// from the slice before the change (the window between one claim's allocation and its
/// prepare's uevent) is still refused by prepare.
pub(super) fn vgpu_devices(
    inv: &Inventory,
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
    whole.consumes_counters = Some(vec![DeviceCounterConsumption {
        counter_set: set_name.clone(),
        counters: counters.clone(),
    }]);
    // Type ids where sysfs shows them (the VFs enabled, or the GPU its own parent).
    let cap = common::vgpu::capacity(inv, &gpu.address);
    let hosted_sizes: std::collections::BTreeSet<u64> = cap
        .existing
        .iter()
        .filter_map(|(_, mb)| mb.map(|mb| (mb + 512) / 1024))
        .collect();
    let hosted_types: Vec<&str> = cap
        .existing
        .iter()
        .map(|(id, _)| cap.get(id).map_or(id.as_str(), |t| t.name.as_str()))
        .collect();
    let may_join = |name: &str, size_gib: u32| -> bool {
        if cap.existing.is_empty() {
            return true;
        }
        if matches!(cap.mode, common::vgpu::Mode::MdevPf) {
            return hosted_types.contains(&name);
        }
        hosted_sizes.is_empty() || hosted_sizes.contains(&u64::from(size_gib))
    };
    let mut out = Vec::new();
    for (name, size) in model.types_before_vfs() {
        if !types.publishes(&name) || !may_join(&name, size) {
            continue;
        }
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
