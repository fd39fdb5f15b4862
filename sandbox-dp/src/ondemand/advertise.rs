//! What the pool advertises: per member and vGPU type, the slots of the vGPUs it made and as
//! many free slots as the member can still host ([`lifecycle::offers`]); and which slots
//! kubelet should prefer.

use std::collections::{BTreeMap, BTreeSet};

use common::Inventory;
use common::vgpu::lifecycle::{self, Member};

use super::ids::{device_id, slot_of, type_key};
use super::{Phase, Pool};
use crate::resource::{DeviceInfo, Kind, Resource, switch_of};

impl Pool {
    /// Adds the pool members' slots to `resources`, named by `resource_name` from a type name.
    /// The vGPUs of pooled GPUs and parents are advertised through their slots only. Returns
    /// the resource names other devices produce too (not advertised).
    pub fn advertise(
        &self,
        inv: &Inventory,
        resource_name: &dyn Fn(&str) -> String,
        resources: &mut BTreeMap<String, Resource>,
    ) -> BTreeSet<String> {
        let mut clashes = BTreeSet::new();
        let records = self.records();
        for member in self.members(inv) {
            let Some(offers) = lifecycle::offers(inv, &member) else {
                continue;
            };
            let kind = if offers.vendor {
                Kind::SriovVgpu
            } else {
                Kind::Mdev
            };
            let dev = match &member {
                Member::Gpu(a) => match inv.device(a) {
                    Some(d) => Some(d),
                    None => continue,
                },
                Member::Parent(_) => None,
            };
            for t in &offers.types {
                // A GPU's type by the last word of its name, a parent's by its sysfs id.
                let key = match (&member, t.type_id.as_deref()) {
                    (Member::Parent(_), Some(id)) => id,
                    _ => type_key(&t.name),
                };
                // MIG-backed types need GPU instances made first: not offered on demand.
                let mig = matches!(member, Member::Gpu(_))
                    && common::vgpu::models::TypeName::parse(key).is_some_and(|n| n.mig);
                if mig {
                    continue;
                }
                let name = resource_name(&t.name);
                // The vGPUs of this type on this member, by the device ID kubelet gave (it may
                // name another GPU's slot: see `allocate_one`).
                let held: Vec<&str> = records
                    .iter()
                    .filter(|r| {
                        r.parent == member && r.type_name == t.name && r.phase != Phase::Removing
                    })
                    .map(|r| r.device.as_str())
                    .collect();
                // This member's slot numbers of the type that a record uses, wherever it was
                // placed.
                let taken: BTreeSet<u32> = records
                    .iter()
                    .filter(|r| r.phase != Phase::Removing)
                    .filter_map(|r| slot_of(&r.device, &member, key))
                    .collect();
                if held.is_empty() && t.available == 0 {
                    continue;
                }
                let r = resources.entry(name.clone()).or_insert_with(|| {
                    let mut r = Resource::new(name.clone(), kind);
                    r.on_demand = true;
                    r
                });
                if r.kind != kind || !r.on_demand {
                    clashes.insert(name);
                    continue;
                }
                r.type_names.insert(t.name.clone());
                if let Some(dev) = dev {
                    r.pci_selectors
                        .insert(format!("{:04X}:{:04X}", dev.vendor, dev.device));
                }
                let free = (0..)
                    .filter(|s| !taken.contains(s))
                    .take(t.available as usize)
                    .map(|slot| device_id(&member, key, slot));
                for id in held.into_iter().map(str::to_string).chain(free) {
                    r.devices.insert(
                        id.clone(),
                        DeviceInfo {
                            id,
                            healthy: true,
                            numa_node: dev.and_then(|d| d.numa_node),
                            iommu_group: None,
                            vfio_cdev: None,
                            gpu: Some(member.to_string()),
                            switch: dev.and_then(switch_of),
                            driver: None,
                        },
                    );
                }
            }
        }
        clashes
    }

    /// The preferred `size` of `available` for a container of `resource`: slots of GPUs that
    /// already host vGPUs made here first (packing leaves other GPUs free for other sizes),
    /// then in GPU and slot order.
    pub fn preferred(&self, available: &[String], must: &[String], size: usize) -> Vec<String> {
        let hosting: BTreeSet<Member> = self.records().into_iter().map(|r| r.parent).collect();
        let mut out: Vec<String> = must.to_vec();
        let mut cands: Vec<&String> = available.iter().filter(|a| !out.contains(a)).collect();
        cands.sort_by_cached_key(|id| {
            let gpu = self.parse_id(id).map(|(m, _)| m);
            let slot: u32 = id
                .rsplit_once('-')
                .and_then(|(_, s)| s.parse().ok())
                .unwrap_or(u32::MAX);
            (
                !gpu.as_ref().is_some_and(|g| hosting.contains(g)),
                gpu,
                slot,
            )
        });
        out.extend(
            cands
                .into_iter()
                .take(size.saturating_sub(out.len()))
                .cloned(),
        );
        out
    }
}
