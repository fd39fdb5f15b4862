//! mdev parents that are not PCI functions: the kernel's sample drivers (`mtty`, `mbochs`,
//! `mdpy`), which the VM tier makes real mdevs with, and any other driver that registers a
//! virtual device under `class/mdev_bus/`. NVIDIA's placement rules do not apply to them: what
//! one can host is what sysfs says, each type's `available_instances`.
//!
//! Some drivers share one resource between their types, so that one mdev of a type lowers
//! every type's count: `mtty` has one pool of serial ports, and its `mtty-1` takes one port,
//! `mtty-2` two. A scheduler that counts devices per type cannot see that; [`SHARED_MODELS`]
//! names such drivers and what each of their types takes, and [`capacity`] turns it into one
//! shared counter ([`Shared`]) that sandbox-dra publishes as a counter set. A driver is
//! recognised by its type ids, which the kernel makes `<driver>-<type>` (`mtty-2`), not by the
//! parent's name: a driver missing from the table is counted per type, as sysfs shows it.

use std::collections::BTreeMap;

use super::Creatable;
use crate::Inventory;

/// A driver whose mdev types share one resource.
#[derive(Debug, PartialEq, Eq)]
pub struct SharedModel {
    /// The driver, the prefix of its type ids (`mtty` in `mtty-2`).
    pub driver: &'static str,
    /// What the types share, named as a counter (`ports`).
    pub counter: &'static str,
    /// Each type (its id after `<driver>-`) and how much of the resource one mdev of it takes.
    pub costs: &'static [(&'static str, u32)],
}

/// The drivers whose types share a resource, from the kernel's `samples/vfio-mdev`: `mtty`'s
/// types take one and two of its serial ports.
pub const SHARED_MODELS: &[SharedModel] = &[SharedModel {
    driver: "mtty",
    counter: "ports",
    costs: &[("1", 1), ("2", 2)],
}];

/// A resource a parent's types share, as much of it as the parent has in all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shared {
    /// Its name as a counter (`ports`).
    pub counter: &'static str,
    /// The whole of it: what is free now plus what the parent's mdevs take.
    pub total: u32,
    /// What one mdev of each type takes, by type id (`mtty-2` → 2).
    pub cost: BTreeMap<String, u32>,
}

/// What a non-PCI mdev parent can host now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParentCapacity {
    /// Its name under `class/mdev_bus/` (`mtty`).
    pub name: String,
    /// Each type in sysfs order: `available` its `available_instances`, `max` that plus the
    /// mdevs of the type that exist, `parents` the parent itself while it has room.
    pub types: Vec<Creatable>,
    /// The type ids of its mdevs.
    pub existing: Vec<String>,
    /// The resource its types share, when its driver is in [`SHARED_MODELS`].
    pub shared: Option<Shared>,
}

/// The capacity of the non-PCI mdev parent `name` as `inv` shows it; `None` when `inv` has no
/// such parent, or it is a PCI function (a GPU or VF: [`super::capacity`]).
pub fn capacity(inv: &Inventory, name: &str) -> Option<ParentCapacity> {
    let p = inv.mdev_parents.get(name).filter(|p| p.pci.is_none())?;
    let existing: Vec<String> = inv
        .mdevs_of(name)
        .into_iter()
        .map(|m| m.type_id.clone())
        .collect();
    let types = p
        .types
        .iter()
        .map(|t| {
            let made = existing.iter().filter(|id| **id == t.id).count();
            let made = u32::try_from(made).unwrap_or(u32::MAX);
            Creatable {
                name: t.name.clone().unwrap_or_else(|| t.id.clone()),
                type_id: Some(t.id.clone()),
                framebuffer_mb: None,
                max: Some(t.available_instances.saturating_add(made)),
                available: t.available_instances,
                parents: if t.available_instances > 0 {
                    vec![name.to_string()]
                } else {
                    Vec::new()
                },
            }
        })
        .collect();
    let ids: Vec<&str> = p.types.iter().map(|t| t.id.as_str()).collect();
    let shared = shared(&ids, &existing, |id| {
        p.types
            .iter()
            .find(|t| t.id == id)
            .map_or(0, |t| t.available_instances)
    });
    Some(ParentCapacity {
        name: name.to_string(),
        types,
        existing,
        shared,
    })
}

/// The shared resource of a parent whose types are `ids` (all of one model's), with mdevs of
/// `existing` types and `available(id)` more of each type free.
fn shared(ids: &[&str], existing: &[String], available: impl Fn(&str) -> u32) -> Option<Shared> {
    let model = SHARED_MODELS
        .iter()
        .find(|m| !ids.is_empty() && ids.iter().all(|id| cost_in(m, id).is_some()))?;
    let cost: BTreeMap<String, u32> = ids
        .iter()
        .filter_map(|id| Some((id.to_string(), cost_in(model, id)?)))
        .collect();
    // What is free, in units of the resource: what the cheapest type can still make of it.
    let free = cost
        .iter()
        .map(|(id, c)| available(id).saturating_mul(*c))
        .max()
        .unwrap_or(0);
    let used: u32 = existing.iter().filter_map(|id| cost.get(id)).sum();
    Some(Shared {
        counter: model.counter,
        total: free.saturating_add(used),
        cost,
    })
}

/// What one mdev of type `id` takes of `m`'s resource, when `id` is one of its types.
fn cost_in(m: &SharedModel, id: &str) -> Option<u32> {
    let name = id.strip_prefix(m.driver)?.strip_prefix('-')?;
    m.costs.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MdevDevice, MdevParent, MdevType};

    fn parent(name: &str, types: &[(&str, &str, u32)], mdevs: &[(&str, &str)]) -> Inventory {
        let mut inv = Inventory::default();
        inv.mdev_parents.insert(
            name.to_string(),
            MdevParent {
                name: name.to_string(),
                pci: None,
                types: types
                    .iter()
                    .map(|(id, n, avail)| MdevType {
                        id: id.to_string(),
                        name: Some(n.to_string()),
                        available_instances: *avail,
                        description: None,
                    })
                    .collect(),
            },
        );
        for (uuid, type_id) in mdevs {
            inv.mdevs.insert(
                uuid.to_string(),
                MdevDevice {
                    uuid: uuid.to_string(),
                    type_id: type_id.to_string(),
                    type_name: None,
                    parent: name.to_string(),
                    parent_pci: None,
                    iommu_group: None,
                    driver: None,
                    vfio_cdev: None,
                },
            );
        }
        inv
    }

    #[test]
    fn mtty_ports_are_one_counter_whatever_the_parent_is_called() {
        // 24 ports, one dual-port mdev made: 22 free (mtty-1 shows 22, mtty-2 11).
        let types = [
            ("mtty-1", "Single port serial", 22),
            ("mtty-2", "Dual port serial", 11),
        ];
        for name in ["mtty", "serial0"] {
            let inv = parent(name, &types, &[("u-1", "mtty-2")]);
            let c = capacity(&inv, name).unwrap();
            let s = c.shared.unwrap();
            assert_eq!((s.counter, s.total), ("ports", 24));
            assert_eq!(s.cost["mtty-1"], 1);
            assert_eq!(s.cost["mtty-2"], 2);
            assert_eq!(c.existing, ["mtty-2"]);
            assert_eq!(c.types[1].max, Some(12));
            assert_eq!(c.types[1].parents, [name]);
        }
    }

    #[test]
    fn another_driver_is_counted_per_type() {
        let inv = parent(
            "mbochs",
            &[
                ("mbochs-small", "mbochs-small", 0),
                ("mbochs-large", "x", 1),
            ],
            &[("u-1", "mbochs-small")],
        );
        let c = capacity(&inv, "mbochs").unwrap();
        assert_eq!(c.shared, None);
        assert_eq!((c.types[0].available, c.types[0].max), (0, Some(1)));
        assert!(c.types[0].parents.is_empty());
        assert_eq!((c.types[1].available, c.types[1].max), (1, Some(1)));
        // A type of a sharing driver beside a type it does not know: per type too.
        let inv = parent("m", &[("mtty-1", "a", 2), ("mtty-9", "b", 1)], &[]);
        assert_eq!(capacity(&inv, "m").unwrap().shared, None);
        assert_eq!(capacity(&inv, "nope"), None);
    }
}
