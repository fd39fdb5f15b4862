//! mdevs of parents that are not PCI functions (`--vgpu` naming one): a claim's mdevs created
//! (each recorded before its write), removed on unprepare unless a process holds one.

use std::sync::OnceLock;

use common::{Usage, error_chain};

use super::{ClaimRef, Node, PrepareError, PreparedDevice, Wanted, refused, vfio_nodes};
use crate::cdi::ClaimId;
use crate::names;
use crate::record::{self, ClaimState, Record};
use crate::vgpu;

impl Node {
    /// Prepares a claim of mdevs of parents that are not PCI functions (`--vgpu mtty`): each
    /// allocated mdev created on its parent, recorded before the write; then the files.
    pub(super) fn prepare_mdevs(
        &self,
        claim: &ClaimRef,
        id: ClaimId,
        wanted: Vec<Wanted>,
        existing: Option<Record>,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        let rec_path = record::path(&self.driver_dir(), &claim.uid);
        let mut rec = existing.unwrap_or_else(|| self.new_record(id, &wanted));
        if rec.state != ClaimState::Prepared {
            rec.state = ClaimState::Preparing;
        }
        let save = |rec: &Record| {
            record::write_if_changed(&rec_path, &rec.to_bytes())
                .map(|_| ())
                .map_err(Self::state_err(claim, "cannot save its record".into()))
        };
        let inv = self.inventory(claim)?;
        for i in 0..rec.devices.len() {
            if rec.devices[i].mdev.as_ref().is_some_and(|m| m.exists(&inv)) {
                continue;
            }
            let device = rec.devices[i].device.clone();
            let Some((parent, type_id, _)) =
                names::parse_mdev_device(&device, &self.config.mdev_parents)
            else {
                return Err(refused(claim, format!("{device:?} is not an mdev device")));
            };
            let m = vgpu::Mdev::new(&parent, &type_id);
            rec.devices[i].mdev = Some(m.clone());
            save(&rec)?;
            m.create(&self.paths).map_err(|e| {
                refused(
                    claim,
                    format!(
                        "device {device}: cannot create an mdev of type {type_id} on {parent}: {}",
                        error_chain(&e)
                    ),
                )
            })?;
            tracing::info!(%claim, parent = %parent, mdev = %m.uuid, type_id = %type_id, "created an mdev");
        }
        for d in &mut rec.devices {
            let Some(m) = d.mdev.clone() else { continue };
            let Some((after, group)) = vgpu::wait_group(&self.paths, |inv| m.group(inv)) else {
                return Err(refused(
                    claim,
                    format!(
                        "mdev {} of type {} on {} has no /dev/vfio group node",
                        m.uuid, m.type_id, m.parent
                    ),
                ));
            };
            d.group = group;
            d.nodes = vfio_nodes(&after, group, m.cdev(&after));
        }
        self.finish(claim, rec, &rec_path)
    }

    /// Removes the claim's mdevs of parents that are not PCI functions that exist; one a
    /// process holds is kept and named (the error has kubelet call again).
    pub(super) fn destroy_mdevs(&self, claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
        if rec.devices.iter().all(|d| d.mdev.is_none()) {
            return Ok(());
        }
        let inv = self.inventory(claim)?;
        let usage: OnceLock<Usage> = OnceLock::new();
        let mut held = Vec::new();
        for m in rec.devices.iter().filter_map(|d| d.mdev.as_ref()) {
            if !m.exists(&inv) {
                continue;
            }
            let users = m.users(usage.get_or_init(|| Usage::read(&self.paths)), &inv);
            if !users.is_empty() {
                held.push(format!(
                    "mdev {} on {} is in use ({}): kept",
                    m.uuid,
                    m.parent,
                    users.join("; ")
                ));
                continue;
            }
            m.destroy(&self.paths).map_err(|e| {
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
