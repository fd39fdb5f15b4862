//! mdevs of parents that are not PCI functions (`--vgpu` naming one): a claim's mdevs created
//! (each recorded before its write), removed on unprepare unless a process holds one.

use std::sync::OnceLock;

use common::vgpu::lifecycle::{self, Member};
use common::{ReadOptions, Usage, error_chain};

use super::{
    ClaimRef, Node, PrepareError, PreparedDevice, Step, Steps, Wanted, refused, vfio_nodes,
};
use crate::cdi::ClaimId;
use crate::names;
use crate::record::{self, ClaimState, Record};
use crate::vgpu::Mdev;

impl Node {
    /// Prepares a claim of mdevs of parents that are not PCI functions (`--vgpu mtty`): each
    /// allocated mdev created on its parent, recorded before the write; then the files.
    pub(super) fn prepare_mdevs(
        &self,
        claim: &ClaimRef,
        id: ClaimId,
        wanted: Vec<Wanted>,
        existing: Option<Record>,
        steps: &mut Steps,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        let rec_path = record::path(&self.driver_dir(), &claim.uid);
        let mut rec = existing.unwrap_or_else(|| self.new_record(id, &wanted));
        if rec.state != ClaimState::Prepared {
            rec.state = ClaimState::Preparing;
        }
        let save = |rec: &Record| self.save(claim, &rec_path, rec);
        let sysfs = &self.sysfs;
        let mut inv = self.inventory(claim)?;
        for i in 0..rec.devices.len() {
            if rec.devices[i]
                .mdev
                .as_ref()
                .is_some_and(|m| m.handle().exists(&inv))
            {
                continue;
            }
            let device = rec.devices[i].device.clone();
            let Some((parent, type_id, _)) =
                names::parse_mdev_device(&device, &self.config.mdev_parents)
            else {
                return Err(refused(claim, format!("{device:?} is not an mdev device")));
            };
            let fail = |reason: String| refused(claim, format!("device {device}: {reason}"));
            let offers = lifecycle::offers(&inv, &Member::Parent(parent.clone()))
                .ok_or_else(|| fail(format!("mdev parent {parent} is not on this node")))?;
            let t = offers
                .find(|t| t.type_id.as_deref() == Some(type_id.as_str()))
                .ok_or_else(|| fail(offers.not_offered(&type_id).to_string()))?;
            let planned = offers.place(t).map_err(|e| fail(e.to_string()))?;
            let m = Mdev {
                parent: planned.parent.clone(),
                type_id: planned.type_id.clone(),
                uuid: planned.handle.to_string(),
            };
            rec.devices[i].mdev = Some(m.clone());
            steps.mark(Step::Node);
            save(&rec)?;
            steps.mark(Step::Record);
            let created = planned.create(sysfs);
            steps.mark(Step::Write);
            created.map_err(|e| {
                fail(format!(
                    "cannot create an mdev of type {type_id} on {parent}: {}",
                    error_chain(&e)
                ))
            })?;
            tracing::info!(%claim, parent = %parent, mdev = %m.uuid, type_id = %type_id, "created an mdev");
        }
        steps.mark(Step::Node);
        for d in &mut rec.devices {
            let Some(m) = d.mdev.clone() else { continue };
            let ready = m
                .handle()
                .wait_ready(&mut inv, &self.paths, &ReadOptions::default());
            steps.mark(Step::Ready);
            let Some(ready) = ready else {
                return Err(refused(
                    claim,
                    format!(
                        "mdev {} of type {} on {} has no /dev/vfio group node",
                        m.uuid, m.type_id, m.parent
                    ),
                ));
            };
            d.group = ready.group;
            d.nodes = vfio_nodes(&inv, ready.group, ready.cdev);
        }
        self.fill_attributes(&inv, &mut rec);
        steps.mark(Step::Node);
        self.finish(claim, rec, &rec_path, steps)
    }

    /// Removes the claim's mdevs of parents that are not PCI functions that exist; one a
    /// process holds is kept and named (the error has kubelet call again).
    pub(super) fn destroy_mdevs(&self, claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
        if rec.devices.iter().all(|d| d.mdev.is_none()) {
            return Ok(());
        }
        let inv = self.inventory(claim)?;
        let sysfs = &self.sysfs;
        let usage: OnceLock<Usage> = OnceLock::new();
        let mut held = Vec::new();
        for m in rec.devices.iter().filter_map(|d| d.mdev.as_ref()) {
            if !m.handle().exists(&inv) {
                continue;
            }
            let usage = usage.get_or_init(|| {
                Usage::read_excluding_claim(&self.paths, Some((&claim.namespace, &claim.name)))
            });
            let users: Vec<String> = m
                .handle()
                .users(usage, &inv)
                .iter()
                .map(ToString::to_string)
                .collect();
            if !users.is_empty() {
                held.push(format!(
                    "mdev {} on {} is in use ({}): kept",
                    m.uuid,
                    m.parent,
                    users.join("; ")
                ));
                continue;
            }
            m.handle().destroy(sysfs).map_err(|e| {
                refused(
                    claim,
                    format!(
                        "cannot remove mdev {} on {}: {}",
                        m.uuid,
                        m.parent,
                        error_chain(&e)
                    ),
                )
            })?;
            tracing::info!(%claim, parent = %m.parent, mdev = %m.uuid, "removed an mdev");
        }
        if held.is_empty() {
            Ok(())
        } else {
            Err(refused(claim, held.join("; ")))
        }
    }
}
