//! vGPUs of the pooled GPUs: a claim's vGPUs created (each recorded before its write),
//! destroyed on unprepare unless a process holds one.

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::time::Duration;

use common::{Inventory, PciAddress, Usage, is_vfio_driver};

use super::{ClaimRef, Node, PrepareError, PreparedDevice, Wanted, refused, vfio_nodes};
use crate::cdi::ClaimId;
use crate::names;
use crate::record::{self, ClaimState, Record};
use crate::vgpu;

impl Node {
    /// Prepares a claim of vGPU devices: each allocated vGPU created (its GPU given back to
    /// its vGPU driver first when a whole-GPU claim left it on VFIO, its VFs enabled when
    /// needed), each recorded before its write; then the files.
    pub(super) fn prepare_vgpus(
        &self,
        claim: &ClaimRef,
        id: ClaimId,
        wanted: Vec<Wanted>,
        existing: Option<Record>,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        for w in &wanted {
            if let Some((gpu, _, _)) = names::parse_vgpu_device(&w.device)
                && !self.config.vgpu_pool.contains(&gpu)
            {
                return Err(refused(
                    claim,
                    format!(
                        "device {}: GPU {gpu} is not in this driver's vGPU pool (--vgpu); nothing \
                         was changed",
                        w.device
                    ),
                ));
            }
        }
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
        let sysfs = common::Sysfs::new(self.paths.clone());
        let mut inv = self.inventory(claim)?;
        for i in 0..rec.devices.len() {
            if rec.devices[i].vgpu.as_ref().is_some_and(|v| v.exists(&inv)) {
                continue;
            }
            let device = rec.devices[i].device.clone();
            let Some((gpu, key, _)) = names::parse_vgpu_device(&device) else {
                return Err(refused(claim, format!("{device:?} is not a vGPU device")));
            };
            let fail = |reason: String| refused(claim, format!("device {device}: {reason}"));
            if inv
                .device(&gpu)
                .and_then(|d| d.driver.as_deref())
                .is_some_and(is_vfio_driver)
            {
                save(&rec)?;
                self.give_back(&inv, gpu).map_err(fail)?;
                inv = self.inventory(claim)?;
            }
            let mut enabled = false;
            loop {
                match vgpu::next_step(&inv, &gpu, &key) {
                    Ok(vgpu::Step::EnableVfs(n)) if !enabled => {
                        save(&rec)?;
                        sysfs.set_sriov_numvfs(&gpu, n).map_err(|e| {
                            fail(format!("cannot enable the VFs of GPU {gpu}: {e}"))
                        })?;
                        enabled = true;
                        inv = self.wait_vfs(claim, &gpu)?;
                    }
                    Ok(vgpu::Step::EnableVfs(_)) => {
                        return Err(fail(format!(
                            "GPU {gpu} shows no vGPU types after its VFs were enabled"
                        )));
                    }
                    Ok(vgpu::Step::Create(v, target)) => {
                        let d = &mut rec.devices[i];
                        if let Some(vf) = v.vf() {
                            d.address = Some(vf);
                        }
                        d.vgpu = Some(v.clone());
                        save(&rec)?;
                        vgpu::create(&self.paths, &v, &target).map_err(|e| {
                            fail(format!("cannot create {} on GPU {gpu}: {e}", v.type_name))
                        })?;
                        tracing::info!(%claim, gpu = %gpu, vgpu = %v.handle, type_name = %v.type_name, "created a vGPU");
                        break;
                    }
                    Err(reason) => return Err(fail(reason)),
                }
            }
        }
        for d in &mut rec.devices {
            let Some(v) = d.vgpu.clone() else { continue };
            let Some((after, group)) = vgpu::wait_ready(&self.paths, &v) else {
                return Err(refused(
                    claim,
                    format!(
                        "{} {} on GPU {} has no /dev/vfio group node",
                        v.type_name, v.handle, v.gpu
                    ),
                ));
            };
            d.group = group;
            d.nodes = vfio_nodes(&after, group, v.cdev(&after));
        }
        self.finish(claim, rec, &rec_path)
    }

    /// Reads the node until `gpu`'s VFs show vGPU types (up to two seconds).
    fn wait_vfs(&self, claim: &ClaimRef, gpu: &PciAddress) -> Result<Inventory, PrepareError> {
        let end = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let inv = self.inventory(claim)?;
            let cap = common::vgpu::capacity(&inv, gpu);
            let ready = !matches!(cap.mode, common::vgpu::Mode::NeedsVfs { .. })
                && cap.types.iter().any(|t| t.type_id.is_some());
            if ready || std::time::Instant::now() >= end {
                return Ok(inv);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Destroys the claim's vGPUs that exist; one a process holds is kept and named (the
    /// error has kubelet call again).
    ///
    /// A GPU a prepare killed while giving it back from VFIO left without a driver gets its
    /// vGPU driver, so that it is ready for either mode.
    pub(super) fn destroy_vgpus(&self, claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
        let gpus: BTreeSet<PciAddress> = rec
            .devices
            .iter()
            .filter_map(|d| names::parse_vgpu_device(&d.device).map(|(gpu, _, _)| gpu))
            .collect();
        if gpus.is_empty() {
            return Ok(());
        }
        let inv = self.inventory(claim)?;
        for gpu in &gpus {
            if inv.device(gpu).is_some_and(|d| d.driver.is_none()) {
                self.give_back(&inv, *gpu).map_err(|e| refused(claim, e))?;
            }
        }
        let usage: OnceLock<Usage> = OnceLock::new();
        let mut held = Vec::new();
        for v in rec.devices.iter().filter_map(|d| d.vgpu.as_ref()) {
            if !v.exists(&inv) {
                continue;
            }
            let users = v.users(usage.get_or_init(|| Usage::read(&self.paths)), &inv);
            if !users.is_empty() {
                held.push(format!(
                    "{} {} on GPU {} is in use ({}): kept",
                    v.type_name,
                    v.handle,
                    v.gpu,
                    users.join("; ")
                ));
                continue;
            }
            vgpu::destroy(&self.paths, v).map_err(|e| {
                refused(
                    claim,
                    format!(
                        "cannot remove {} {} on GPU {}: {e}",
                        v.type_name, v.handle, v.gpu
                    ),
                )
            })?;
            tracing::info!(%claim, gpu = %v.gpu, vgpu = %v.handle, type_name = %v.type_name, "removed a vGPU");
        }
        if held.is_empty() {
            Ok(())
        } else {
            Err(refused(claim, held.join("; ")))
        }
    }
}
