//! Whole GPUs: selecting a claim's GPUs with the rest of their IOMMU groups, binding them to
//! their VFIO driver ([`common::vfio`]), and giving them back to the driver they had.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use common::state::originals::{self, Originals};
use common::vfio::{self, DeviceResult, Outcome, Selection, Selector, Target};
use common::{Inventory, PciAddress, Usage, error_chain, is_vfio_driver};

use super::{
    ClaimRef, Node, PrepareError, PreparedDevice, Step, Steps, Wanted, device_nodes, refused,
};
use crate::cdi::{ClaimDevice, ClaimId};
use crate::names;
use crate::record::{self, ClaimState, Record};

/// A GPU a whole-GPU claim left on VFIO that could not go back to its vGPU driver.
#[derive(Debug, thiserror::Error)]
#[error("GPU {gpu} is on VFIO and cannot go back to its vGPU driver: {failures}")]
pub(super) struct GiveBack {
    /// The GPU.
    gpu: PciAddress,
    /// Each function's failure, naming it.
    failures: String,
}

impl Node {
    /// The functions `gpus` names and the rest of their IOMMU groups, read alone
    /// ([`Inventory::read_groups`]): what binding them or giving them back depends on, at the
    /// cost of those groups, not of the node. Without the mdev types (a vGPU's size does not
    /// matter to a whole GPU).
    pub(super) fn groups(&self, gpus: &[PciAddress]) -> Inventory {
        let opts = common::ReadOptions {
            mdev_types: false,
            vf_identity: true,
        };
        Inventory::read_groups(&self.paths, gpus, &opts)
    }

    /// Selects the GPUs and the rest of their groups, refusing a missing GPU or a group with a
    /// foreign member.
    fn select(
        &self,
        claim: &ClaimRef,
        inv: &Inventory,
        wanted: &[Wanted],
    ) -> Result<Selection, PrepareError> {
        for w in wanted {
            let Some(a) = w.address else {
                // An mdev of a parent --vgpu named when it was prepared, and names no more.
                return Err(refused(
                    claim,
                    format!(
                        "device {} is not a GPU, and its mdev parent is not in --vgpu; nothing \
                         was changed",
                        w.device
                    ),
                ));
            };
            if inv.device(&a).is_none() {
                return Err(refused(
                    claim,
                    format!(
                        "device {} ({a}) is not on this node any more (removed or unplugged); \
                         nothing was changed",
                        w.device
                    ),
                ));
            }
        }
        let selector = Selector {
            addresses: wanted.iter().filter_map(|w| w.address).collect(),
            ..Selector::default()
        };
        let aliases = vfio::load_aliases(&self.paths);
        let sel = vfio::select(inv, &selector, None, &aliases);
        if !sel.refused.is_empty() {
            let reasons: Vec<&str> = sel.refused.iter().map(|r| r.reason.as_str()).collect();
            return Err(refused(
                claim,
                format!("{}; nothing was changed", reasons.join("; ")),
            ));
        }
        Ok(sel)
    }

    /// Prepares a claim of whole GPUs: the checks, the record, the binds, then the files.
    pub(super) fn prepare_gpus(
        &self,
        claim: &ClaimRef,
        id: ClaimId,
        wanted: Vec<Wanted>,
        existing: Option<Record>,
        steps: &mut Steps,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        let addresses: Vec<PciAddress> = wanted.iter().filter_map(|w| w.address).collect();
        let mut inv = self.groups(&addresses);
        // A GPU of the vGPU pool goes to a VM whole only without vGPUs; its VFs (enabled for
        // vGPUs) are disabled first. No record is needed for that write: a GPU without VFs is
        // where either mode starts from.
        let mut vfs_off = Vec::new();
        for w in &wanted {
            let Some(a) = w.address.filter(|a| self.config.vgpu_pool.contains(a)) else {
                continue;
            };
            let cap = common::vgpu::capacity(&inv, &a);
            if !cap.existing.is_empty() {
                return Err(refused(
                    claim,
                    format!(
                        "GPU {} hosts {} vGPU(s): it goes to a VM whole only without them; \
                         nothing was changed",
                        a,
                        cap.existing.len()
                    ),
                ));
            }
            if inv
                .device(&a)
                .is_some_and(|d| d.sriov_numvfs.unwrap_or(0) > 0)
            {
                vfs_off.push(a);
            }
        }
        if !vfs_off.is_empty() {
            // Disabling VFs takes them from whoever holds them: asked first, for every GPU,
            // before the first write.
            steps.mark(Step::Node);
            let usage =
                Usage::read_excluding_claim(&self.paths, Some((&claim.namespace, &claim.name)));
            steps.mark(Step::InUse);
            for a in &vfs_off {
                let users = usage.of_gpu_for_passthrough(&inv, a);
                if !users.is_empty() {
                    let who: Vec<String> = users.iter().map(|u| u.describe(&inv)).collect();
                    return Err(refused(
                        claim,
                        format!(
                            "GPU {a} is in use: {}; its VFs stay enabled, nothing was changed",
                            who.join("; ")
                        ),
                    ));
                }
            }
            self.forget(vfs_off.iter().copied());
            steps.mark(Step::Node);
            for a in &vfs_off {
                self.sysfs.set_sriov_numvfs(a, 0).map_err(|e| {
                    refused(
                        claim,
                        format!("cannot disable the VFs of GPU {a}: {}", error_chain(&e)),
                    )
                })?;
            }
            steps.mark(Step::Write);
            inv = self.groups(&addresses);
        }
        let sel = self.select(claim, &inv, &wanted)?;

        // Who would lose something: asked of every function that is to move, before the
        // first write, so that a claim refused for one GPU changes none.
        let usage: OnceLock<Usage> = OnceLock::new();
        let in_use = |t: &Target| -> Vec<String> {
            let usage = usage.get_or_init(|| {
                Usage::read_excluding_claim(&self.paths, Some((&claim.namespace, &claim.name)))
            });
            vfio::bind_blockers(usage, &inv, t)
                .iter()
                .map(|u| u.describe(&inv))
                .collect()
        };
        steps.mark(Step::Node);
        let mut busy = Vec::new();
        for t in sel.targets().filter(|t| !t.is_bound()) {
            let users = in_use(t);
            if !users.is_empty() {
                busy.push(format!(
                    "{} is in use ({}) on {}",
                    t.address,
                    users.join("; "),
                    t.driver.as_deref().unwrap_or("no driver")
                ));
            }
        }
        steps.mark(Step::InUse);
        if !busy.is_empty() {
            return Err(refused(
                claim,
                format!("{}; nothing was changed", busy.join("; ")),
            ));
        }

        steps.mark(Step::Node);
        let group_of = |a: &PciAddress| sel.targets().find(|t| t.address == *a).map(|t| t.group);
        let mut rec = existing.unwrap_or_else(|| Record {
            version: record::VERSION,
            claim: id.clone(),
            state: ClaimState::Preparing,
            devices: Vec::new(),
            originals: BTreeMap::new(),
        });
        // A function on VFIO already (a claim before this one left it there) goes back, on
        // restore, to the driver it had before anything moved it: vfio-manager's record of
        // original drivers, shared with it, says which.
        let remembered = originals::load(&self.paths).drivers;
        for t in sel.targets() {
            let on_vfio = t.driver.as_deref().is_some_and(is_vfio_driver) || t.is_bound();
            let original = match remembered.get(&t.address) {
                Some(r) if on_vfio => r.clone(),
                _ => t.driver.clone(),
            };
            rec.originals.entry(t.address).or_insert(original);
        }
        let moving: Vec<(PciAddress, Option<String>)> = sel
            .targets()
            .filter(|t| !t.is_bound() && !t.driver.as_deref().is_some_and(is_vfio_driver))
            .map(|t| (t.address, t.driver.clone()))
            .collect();
        if rec.devices.is_empty() {
            rec.devices = wanted
                .iter()
                .map(|w| ClaimDevice {
                    requests: w.requests.clone(),
                    pool: w.pool.clone(),
                    device: w.device.clone(),
                    share_id: None,
                    address: w.address,
                    group: w.address.as_ref().and_then(group_of).unwrap_or_default(),
                    nodes: Vec::new(),
                    vgpu: None,
                    mdev: None,
                    extended_resource: w.extended_resource.clone(),
                    attributes: Default::default(),
                })
                .collect();
        }
        let rec_path = record::path(&self.driver_dir(), &claim.uid);
        if rec.state != ClaimState::Prepared {
            rec.state = ClaimState::Preparing;
            self.save(claim, &rec_path, &rec)?;
        }
        // The node-wide record of original drivers too, shared with vfio-manager: before the
        // bind, as the claim's own record.
        if let Err(e) = originals::update(&self.paths, &moving, &[]) {
            tracing::warn!(%claim, error = %error_chain(&e), "cannot record the original drivers node-wide; the claim's record keeps them");
        }

        steps.mark(Step::Record);
        self.forget(sel.targets().map(|t| t.address));
        let results = vfio::bind_all(&self.sysfs, &sel, &self.op_options(), &in_use);
        steps.mark(Step::Write);
        let failures: Vec<String> = results.iter().filter_map(DeviceResult::failure).collect();
        if !failures.is_empty() {
            return Err(refused(claim, failures.join("; ")));
        }

        // The VFIO cdevs appear with the bind: read them again when something moved.
        let moved = results
            .iter()
            .any(|r| matches!(r.outcome, Outcome::Changed { .. }));
        let after = if moved { self.groups(&addresses) } else { inv };
        for d in &mut rec.devices {
            d.group = d.address.as_ref().and_then(group_of).unwrap_or(d.group);
            d.nodes = device_nodes(&after, d);
        }
        self.fill_attributes(&after, &mut rec);
        steps.mark(Step::Node);
        self.finish(claim, rec, &rec_path, steps)
    }

    /// Gives every function of the record back to the driver it had, when that was not a
    /// VFIO driver; refused while the group is in use.
    pub(super) fn restore(&self, claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
        let whole: Vec<PciAddress> = rec
            .devices
            .iter()
            .filter(|d| names::parse_vgpu_device(&d.device).is_none())
            .filter_map(|d| d.address)
            .collect();
        let inv = self.groups(&whole);
        let present: Vec<PciAddress> = rec
            .devices
            .iter()
            .filter(|d| names::parse_vgpu_device(&d.device).is_none())
            .filter_map(|d| d.address)
            .filter(|a| inv.device(a).is_some())
            .collect();
        if present.is_empty() {
            return Ok(());
        }
        let selector = Selector {
            addresses: present,
            allow_foreign_in_group: true,
            ..Selector::default()
        };
        let aliases = vfio::load_aliases(&self.paths);
        let mut sel = vfio::select(&inv, &selector, None, &aliases);
        // Only what this driver moved goes back: a function that was on VFIO already stays.
        let ours = |t: &Target| {
            rec.originals
                .get(&t.address)
                .is_some_and(|d| !d.as_deref().is_some_and(is_vfio_driver))
        };
        for targets in sel.groups.values_mut() {
            targets.retain(ours);
        }
        sel.groups.retain(|_, t| !t.is_empty());
        sel.refused.clear();
        let failures = self.unbind_groups(&inv, &sel, &rec.originals, Some(claim));
        if failures.is_empty() {
            Ok(())
        } else {
            Err(refused(
                claim,
                format!(
                    "cannot give its GPUs back: {}",
                    failures.into_iter().collect::<Vec<_>>().join("; ")
                ),
            ))
        }
    }

    /// Gives a GPU a whole-GPU claim left on VFIO back to the driver it had before (its vGPU
    /// driver, `nvidia` when no record says), with the rest of its group; refused while
    /// anything but `claim` (the vGPU claim it is given back for) holds the group.
    pub(super) fn give_back(
        &self,
        inv: &Inventory,
        gpu: PciAddress,
        claim: &ClaimRef,
    ) -> Result<(), GiveBack> {
        let selector = Selector {
            addresses: vec![gpu],
            allow_foreign_in_group: true,
            ..Selector::default()
        };
        let aliases = vfio::load_aliases(&self.paths);
        let mut sel = vfio::select(inv, &selector, None, &aliases);
        sel.refused.clear();
        let mut originals = originals::load(&self.paths).drivers;
        originals
            .entry(gpu)
            .or_insert_with(|| Some("nvidia".to_string()));
        let failures = self.unbind_groups(inv, &sel, &originals, Some(claim));
        if failures.is_empty() {
            Ok(())
        } else {
            Err(GiveBack {
                gpu,
                failures: failures.into_iter().collect::<Vec<_>>().join("; "),
            })
        }
    }

    /// Gives the functions of `sel` back to their `originals` (refused while their group is in
    /// use, the pod of `claim` itself not counting) and forgets those released in vfio-manager's
    /// record; the failures, each naming the function.
    fn unbind_groups(
        &self,
        inv: &Inventory,
        sel: &Selection,
        originals: &Originals,
        claim: Option<&ClaimRef>,
    ) -> BTreeSet<String> {
        let usage = Usage::read_excluding_claim(
            &self.paths,
            claim.map(|c| (c.namespace.as_str(), c.name.as_str())),
        );
        let in_use = |group: u32| -> Vec<String> {
            usage
                .of_group(inv, group)
                .iter()
                .map(|u| u.describe(inv))
                .collect()
        };
        self.forget(sel.targets().map(|t| t.address));
        let results = vfio::unbind_all(&self.sysfs, sel, &self.op_options(), &in_use, originals);
        let released: Vec<PciAddress> = results
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Changed { .. }))
            .map(|r| r.address)
            .collect();
        if let Err(e) = originals::update(&self.paths, &[], &released) {
            tracing::warn!(error = %error_chain(&e), "cannot forget the original drivers of the functions given back");
        }
        results.iter().filter_map(DeviceResult::failure).collect()
    }
}
