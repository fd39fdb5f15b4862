//! Partial re-reads of a kept [`Inventory`], for readers that follow the node event by event
//! ([`crate::uevent`], inotify on `/dev/vfio`) instead of reading the whole node again: one PCI
//! function with what hangs from it, one mdev, one VFIO group node. Each leaves the rest of the
//! inventory as it was, so the cost is that of the device named, not of the node.
//!
//! What one refresh reads, and so what a reader can rely on afterwards:
//! - [`Inventory::refresh_pci`]: the function, its VFs (those it lists now and those the
//!   inventory had), the mdevs in its and its VFs' directories, and the group node of every
//!   group any of them was or is in. For a VF that came or went, its PF too (its
//!   `sriov_numvfs` and `virtfnN` changed with it), without the PF's other VFs.
//! - [`Inventory::refresh_mdev`]: the mdev and its group node.
//! - [`Inventory::refresh_vfio_node`]: whether `/dev/vfio/<group>` exists.
//! - [`Inventory::refresh_dev_nodes`]: `/dev/iommu` and the VFIO cdevs.
//!
//! [`Inventory::read_groups`] builds an inventory of some IOMMU groups alone from these.
//!
//! After each, the inventory equals a full [`Inventory::read_with`] of the node, provided every
//! change was announced (the tests hold it to that); what no event announced is found by the
//! next full read.

use std::collections::BTreeSet;

use super::{Inventory, MdevParent, ReadOptions, TypeNames};
use crate::paths::HostPaths;
use crate::pci::PciAddress;

impl Inventory {
    /// Reads the functions `addresses` names and every other function of their IOMMU groups
    /// (as [`Inventory::refresh_pci`] reads each, into an empty inventory), then the device
    /// nodes (`/dev/iommu`, the VFIO cdevs): what binding those groups to VFIO or giving them
    /// back depends on, at the cost of the groups rather than of the node. A function that is
    /// not there is not in it; one in no IOMMU group is read alone.
    pub fn read_groups(
        paths: &HostPaths,
        addresses: &[PciAddress],
        opts: &ReadOptions,
    ) -> Inventory {
        let mut inv = Inventory::default();
        let mut seen = BTreeSet::new();
        let mut todo: Vec<PciAddress> = addresses.to_vec();
        while let Some(a) = todo.pop() {
            if !seen.insert(a) {
                continue;
            }
            inv.refresh_pci(paths, a, opts);
            let Some(group) = inv.device(&a).and_then(|d| d.iommu_group) else {
                continue;
            };
            let members = super::list_dir(&paths.iommu_group_devices(group)).unwrap_or_default();
            todo.extend(members.iter().filter_map(|m| m.parse::<PciAddress>().ok()));
        }
        inv.refresh_dev_nodes(paths);
        inv
    }

    /// Re-reads the PCI function `address` and what hangs from it: its VFs, the mdevs on it and
    /// on its VFs, and the VFIO group nodes of every group involved. A function that is gone
    /// is removed with its VFs and their mdevs; one that could not be read goes to
    /// [`Inventory::unreadable`] and keeps its mdevs. `opts` as for [`Inventory::read_with`].
    pub fn refresh_pci(&mut self, paths: &HostPaths, address: PciAddress, opts: &ReadOptions) {
        let mut groups = BTreeSet::new();
        let mut type_names = TypeNames::default();
        let old = self.devices.get(&address).map(|d| d.physfn);
        let old_vfs: Vec<PciAddress> = self
            .devices
            .values()
            .filter(|d| d.physfn == Some(address))
            .map(|d| d.address)
            .collect();
        let mdevs = self.reread_function(paths, address, opts, &mut type_names, &mut groups);
        let mut functions = vec![(address, mdevs)];
        // A VF that came or went changed its PF too (`sriov_numvfs`, `virtfnN`).
        let now = self.devices.get(&address).map(|d| d.physfn);
        if old.is_some() != now.is_some()
            && let Some(pf) = old.flatten().or(now.flatten())
        {
            let mdevs = self.reread_function(paths, pf, opts, &mut type_names, &mut groups);
            functions.push((pf, mdevs));
        }
        let new_vfs = self
            .devices
            .get(&address)
            .map(|d| d.virtfns.clone())
            .unwrap_or_default();
        let vfs: BTreeSet<PciAddress> = old_vfs
            .into_iter()
            .chain(new_vfs)
            .filter(|a| *a != address)
            .collect();
        for vf in vfs {
            let mdevs = self.reread_function(paths, vf, opts, &mut type_names, &mut groups);
            functions.push((vf, mdevs));
        }
        for (function, mdevs) in functions {
            self.refresh_parent(paths, function, mdevs, &mut groups);
        }
        if !opts.vf_identity {
            self.fill_vf_identity();
        }
        self.fill_vendor_vgpu_names(paths);
        for g in groups {
            self.refresh_vfio_node(paths, g);
        }
    }

    /// Re-reads the mdev `uuid` (removed when it is gone) and the group node of the group it
    /// was or is in.
    pub fn refresh_mdev(&mut self, paths: &HostPaths, uuid: &str) {
        let mut groups = BTreeSet::new();
        self.reread_mdev(paths, &uuid.to_ascii_lowercase(), &mut groups);
        for g in groups {
            self.refresh_vfio_node(paths, g);
        }
    }

    /// Records whether `<root>/dev/vfio/<group>` exists now: the health of every device of the
    /// group follows, without reading any device.
    pub fn refresh_vfio_node(&mut self, paths: &HostPaths, group: u32) {
        if std::fs::symlink_metadata(paths.vfio_group_node(group)).is_ok() {
            self.vfio_nodes.insert(group);
        } else {
            self.vfio_nodes.remove(&group);
        }
    }

    /// Forgets what the inventory knew of `address` and reads it again; collects its old and
    /// new group. Returns the mdevs under it (`None`: gone, or unreadable).
    fn reread_function(
        &mut self,
        paths: &HostPaths,
        address: PciAddress,
        opts: &ReadOptions,
        type_names: &mut TypeNames,
        groups: &mut BTreeSet<u32>,
    ) -> Option<Vec<String>> {
        let path = paths.pci_device(&address);
        if let Some(old) = self.devices.remove(&address) {
            groups.extend(old.iommu_group);
        }
        self.unreadable.retain(|u| u.path != path);
        for members in self.unreadable_in_group.values_mut() {
            members.retain(|a| *a != address);
        }
        self.unreadable_in_group.retain(|_, m| !m.is_empty());
        let mdevs = self.read_function(path, address, opts, type_names);
        if let Some(d) = self.devices.get(&address) {
            groups.extend(d.iommu_group);
        }
        mdevs
    }

    /// The mdev-parent side of a re-read function: its entry in `mdev_parents`, and its mdevs
    /// (those now in its directory, read again; those the inventory had there, gone).
    fn refresh_parent(
        &mut self,
        paths: &HostPaths,
        function: PciAddress,
        mdevs: Option<Vec<String>>,
        groups: &mut BTreeSet<u32>,
    ) {
        let name = function.to_string();
        match self.devices.get(&function) {
            Some(d) if d.mdev_parent => {
                let parent = MdevParent {
                    name: name.clone(),
                    pci: Some(function),
                    types: d.mdev_types.clone(),
                };
                self.mdev_parents.insert(name.clone(), parent);
            }
            Some(_) => {
                self.mdev_parents.remove(&name);
            }
            // Unreadable: what it had stays; gone: so does it.
            None if mdevs.is_none() && self.unreadable_path(paths, function) => return,
            None => {
                self.mdev_parents.remove(&name);
            }
        }
        let now: BTreeSet<String> = mdevs.unwrap_or_default().into_iter().collect();
        let had: Vec<String> = self
            .mdevs
            .values()
            .filter(|m| m.parent == name && !now.contains(&m.uuid))
            .map(|m| m.uuid.clone())
            .collect();
        for uuid in had.iter().chain(&now) {
            self.reread_mdev(paths, uuid, groups);
        }
    }

    fn unreadable_path(&self, paths: &HostPaths, function: PciAddress) -> bool {
        let path = paths.pci_device(&function);
        self.unreadable.iter().any(|u| u.path == path)
    }

    fn reread_mdev(&mut self, paths: &HostPaths, uuid: &str, groups: &mut BTreeSet<u32>) {
        let path = paths.mdev_devices().join(uuid);
        if let Some(old) = self.mdevs.remove(uuid) {
            groups.extend(old.iommu_group);
        }
        self.unreadable.retain(|u| u.path != path);
        groups.extend(self.read_mdev_entry(path, uuid));
    }
}
