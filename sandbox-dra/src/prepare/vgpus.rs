//! vGPUs of the pooled GPUs: a claim's vGPUs created (each recorded before its write),
//! destroyed on unprepare unless a process holds one.

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::vgpu::lifecycle::{self, Member, READY_TIMEOUT};
use common::{Inventory, PciAddress, ReadOptions, Sysfs, Usage, is_vfio_driver};

use super::{ClaimRef, Node, PrepareError, PreparedDevice, Wanted, refused, vfio_nodes};
use crate::cdi::ClaimId;
use crate::names;
use crate::record::{self, ClaimState, Record};
use crate::vgpu::Vgpu;

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
        let save = |rec: &Record| self.save(claim, &rec_path, rec);
        let sysfs = Sysfs::new(self.paths.clone());
        let mut inv = self.inventory(claim)?;
        // The type a device name carries is checked against the GPU's own list (its model's
        // types that --vgpu-types selects, what the slice publishes) before anything is
        // written for it. A vGPU already made for the claim stays its, even if an earlier run
        // published types this one does not.
        for d in &rec.devices {
            let made = d.vgpu.as_ref().is_some_and(|v| v.handle.exists(&inv));
            let Some((gpu, key, slot)) = names::parse_vgpu_device(&d.device) else {
                return Err(refused(
                    claim,
                    format!("{} is not a vGPU device", names::quoted(&d.device)),
                ));
            };
            let Some(g) = inv.device(&gpu) else {
                continue; // refused below, naming the GPU that is gone
            };
            let model = common::vgpu::models::model(g.vendor, g.device);
            let known = model.and_then(|m| {
                m.types_before_vfs()
                    .into_iter()
                    .find(|(name, _)| names::type_key(name) == key)
                    .filter(|(name, _)| made || self.config.vgpu_pool.publishes(name))
                    .map(|(_, size)| slot < m.equal_size_max(size))
            });
            if known != Some(true) {
                return Err(refused(
                    claim,
                    format!(
                        "device {}: GPU {gpu} publishes no such vGPU (type {}, slot {slot}); \
                         nothing was changed",
                        d.device,
                        names::quoted(&key)
                    ),
                ));
            }
        }
        for i in 0..rec.devices.len() {
            if rec.devices[i]
                .vgpu
                .as_ref()
                .is_some_and(|v| v.handle.exists(&inv))
            {
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
                self.give_back(&inv, gpu).map_err(|e| fail(e.to_string()))?;
                inv = self.inventory(claim)?;
            }
            let mut enabled = false;
            loop {
                let offers = lifecycle::offers(&inv, &Member::Gpu(gpu))
                    .ok_or_else(|| fail(format!("GPU {gpu} is not on this node")))?;
                if let Some(n) = offers.needs_vfs {
                    if enabled {
                        return Err(fail(format!(
                            "GPU {gpu} shows no vGPU types after its VFs were enabled"
                        )));
                    }
                    save(&rec)?;
                    sysfs
                        .set_sriov_numvfs(&gpu, n)
                        .map_err(|e| fail(format!("cannot enable the VFs of GPU {gpu}: {e}")))?;
                    enabled = true;
                    self.wait_vfs(&mut inv, &gpu);
                    continue;
                }
                let t = offers
                    .find(|t| names::type_key(&t.name) == key)
                    .ok_or_else(|| fail(offers.not_offered(&key).to_string()))?;
                let planned = offers.place(t).map_err(|e| fail(e.to_string()))?;
                let v = Vgpu {
                    gpu,
                    type_name: planned.type_name.clone(),
                    handle: planned.handle.clone(),
                };
                let d = &mut rec.devices[i];
                if let Some(vf) = v.handle.vf() {
                    d.address = Some(vf);
                }
                d.vgpu = Some(v.clone());
                save(&rec)?;
                planned.create(&sysfs).map_err(|e| {
                    fail(format!("cannot create {} on GPU {gpu}: {e}", v.type_name))
                })?;
                tracing::info!(%claim, gpu = %gpu, vgpu = %v.handle, type_name = %v.type_name, "created a vGPU");
                // The next vGPU of the claim is placed by what the GPU shows now: the VF this
                // one took offers nothing more.
                inv.refresh_pci(&self.paths, gpu, &ReadOptions::default());
                break;
            }
        }
        for d in &mut rec.devices {
            let Some(v) = d.vgpu.clone() else { continue };
            let Some(ready) = v
                .handle
                .wait_ready(&mut inv, &self.paths, &ReadOptions::default())
            else {
                return Err(refused(
                    claim,
                    format!(
                        "{} {} on GPU {} has no /dev/vfio group node",
                        v.type_name, v.handle, v.gpu
                    ),
                ));
            };
            d.group = ready.group;
            d.nodes = vfio_nodes(&inv, ready.group, ready.cdev);
        }
        self.finish(claim, &inv, rec, &rec_path)
    }

    /// Re-reads `gpu` (with its VFs) into `inv` until its VFs show vGPU types, at most
    /// [`READY_TIMEOUT`].
    fn wait_vfs(&self, inv: &mut Inventory, gpu: &PciAddress) {
        let end = Instant::now() + READY_TIMEOUT;
        loop {
            inv.refresh_pci(&self.paths, *gpu, &ReadOptions::default());
            let cap = common::vgpu::capacity(inv, gpu);
            let ready = !matches!(cap.mode, common::vgpu::Mode::NeedsVfs { .. })
                && cap.types.iter().any(|t| t.type_id.is_some());
            if ready || Instant::now() >= end {
                return;
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
                self.give_back(&inv, *gpu)
                    .map_err(|e| refused(claim, e.to_string()))?;
            }
        }
        let sysfs = Sysfs::new(self.paths.clone());
        let usage: OnceLock<Usage> = OnceLock::new();
        let mut held = Vec::new();
        for v in rec.devices.iter().filter_map(|d| d.vgpu.as_ref()) {
            if !v.handle.exists(&inv) {
                continue;
            }
            let usage = usage.get_or_init(|| {
                Usage::read_excluding_claim(&self.paths, Some((&claim.namespace, &claim.name)))
            });
            let users: Vec<String> = v
                .handle
                .users(usage, &inv)
                .iter()
                .map(ToString::to_string)
                .collect();
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
            v.handle.destroy(&sysfs).map_err(|e| {
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
