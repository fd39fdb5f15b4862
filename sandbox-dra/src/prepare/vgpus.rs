//! vGPUs of the pooled GPUs: a claim's vGPUs created, one per allocated share of a type's
//! shared device (each recorded before its write), destroyed on unprepare unless a process
//! holds one.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use common::vgpu::lifecycle::{self, Member, Planned};
use common::{Inventory, PciAddress, ReadOptions, Usage, error_chain, is_vfio_driver};

use super::{
    ClaimRef, Node, PrepareError, PreparedDevice, Step, Steps, Views, Wanted, refused, vfio_nodes,
};
use crate::cdi::ClaimId;
use crate::names;
use crate::record::{self, ClaimState, Record};
use crate::vgpu::Vgpu;

/// What a GPU's view says of the next vGPU of a claim.
enum Next {
    /// It goes there.
    Place(Planned),
    /// The GPU's VFs must be enabled first: this many.
    NeedsVfs(u32),
    /// It cannot, and why.
    Refused(String),
}

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
        steps: &mut Steps,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        for w in &wanted {
            if let Some((gpu, _)) = names::parse_vgpu_device(&w.device)
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
        let opts = ReadOptions::default();
        let mut views = self.views();
        // The type a device name carries is checked against the GPU's own list (its model's
        // types that --vgpu-types selects, what the slice publishes) before anything is
        // written for it. A vGPU already made for the claim stays its, even if an earlier run
        // published types this one does not.
        for d in &rec.devices {
            let made = d.vgpu.as_ref().is_some_and(|v| {
                let inv = self.view(&mut views, v.gpu);
                v.handle.refresh(inv, &self.paths, &opts);
                v.handle.exists(inv)
            });
            let Some((gpu, key)) = names::parse_vgpu_device(&d.device) else {
                return Err(refused(
                    claim,
                    format!("{} is not a vGPU device", names::quoted(&d.device)),
                ));
            };
            let Some(g) = self.view(&mut views, gpu).device(&gpu) else {
                continue; // refused below, naming the GPU that is gone
            };
            let known = common::vgpu::models::model(g.vendor, g.device).is_some_and(|m| {
                m.types_before_vfs().into_iter().any(|(name, _)| {
                    names::type_key(&name) == key
                        && (made || self.config.vgpu_pool.publishes(&name))
                })
            });
            if !known {
                return Err(refused(
                    claim,
                    format!(
                        "device {}: GPU {gpu} publishes no vGPU of type {}; nothing was changed",
                        d.device,
                        names::quoted(&key)
                    ),
                ));
            }
        }
        steps.mark(Step::Node);
        // Each vGPU's group node, once the kernel made it.
        let mut readies: Vec<Option<lifecycle::Ready>> = vec![None; rec.devices.len()];
        for (i, ready) in readies.iter_mut().enumerate() {
            let device = rec.devices[i].device.clone();
            let Some((gpu, key)) = names::parse_vgpu_device(&device) else {
                return Err(refused(claim, format!("{device:?} is not a vGPU device")));
            };
            if let Some(v) = rec.devices[i].vgpu.clone() {
                let inv = self.view(&mut views, v.gpu);
                v.handle.refresh(inv, &self.paths, &opts);
                if v.handle.exists(inv) {
                    *ready = v.handle.ready(inv);
                    continue;
                }
            }
            let fail = |reason: String| refused(claim, format!("device {device}: {reason}"));
            // A whole-GPU claim left it on VFIO (its driver read afresh: no view follows a
            // bind): given back first, with its group read whole.
            let driver = self.sysfs.current_driver(&gpu).ok().flatten();
            if driver.as_deref().is_some_and(is_vfio_driver) {
                steps.mark(Step::Node);
                save(&rec)?;
                steps.mark(Step::Record);
                let inv = self.groups(&[gpu]);
                // Giving back forgets the GPU's view.
                drop(views);
                self.give_back(&inv, gpu, claim)
                    .map_err(|e| fail(e.to_string()))?;
                views = self.views();
                steps.mark(Step::Write);
            }
            // Placed from the GPU's view; when the view cannot place it, or the kernel refuses
            // the write, placed again from a fresh read (lifecycle).
            let mut fresh = false;
            let mut enabled = false;
            loop {
                fresh |= !views.contains_key(&gpu);
                let inv = self.view(&mut views, gpu);
                let next = match lifecycle::offers(inv, &Member::Gpu(gpu)) {
                    None => Next::Refused(format!("GPU {gpu} is not on this node")),
                    Some(o) => match (o.needs_vfs, o.find(|t| names::type_key(&t.name) == key)) {
                        (Some(n), _) => Next::NeedsVfs(n),
                        (None, None) => Next::Refused(o.not_offered(&key).to_string()),
                        (None, Some(t)) => match o.place(t) {
                            Ok(p) => Next::Place(p),
                            Err(e) => Next::Refused(e.to_string()),
                        },
                    },
                };
                let planned = match next {
                    Next::Place(p) => p,
                    Next::Refused(_) | Next::NeedsVfs(_) if !fresh => {
                        views.remove(&gpu);
                        continue;
                    }
                    Next::Refused(why) => return Err(fail(why)),
                    Next::NeedsVfs(_) if enabled => {
                        self.config.vgpu_pool.note_vfs(gpu, false);
                        return Err(fail(format!(
                            "GPU {gpu} shows no vGPU types after its VFs were enabled"
                        )));
                    }
                    Next::NeedsVfs(n) => {
                        steps.mark(Step::Node);
                        save(&rec)?;
                        steps.mark(Step::Record);
                        let inv = self.view(&mut views, gpu);
                        lifecycle::enable_vfs(&self.sysfs, &self.paths, inv, &gpu, n, &opts)
                            .map_err(|e| {
                                // Its vGPU devices are tainted until a prepare enables them.
                                self.config.vgpu_pool.note_vfs(gpu, false);
                                fail(format!("cannot enable the VFs of GPU {gpu}: {e}"))
                            })?;
                        enabled = true;
                        // The write and the wait for the VFs' types, together.
                        steps.mark(Step::Write);
                        continue;
                    }
                };
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
                steps.mark(Step::Node);
                save(&rec)?;
                steps.mark(Step::Record);
                let created = planned.create(&self.sysfs);
                steps.mark(Step::Write);
                match created {
                    Ok(()) => {}
                    Err(e) if !fresh && lifecycle::refused(&e) => {
                        tracing::debug!(%claim, gpu = %gpu, error = %error_chain(&e), "refused by the kernel; reading the GPU again");
                        views.remove(&gpu);
                        continue;
                    }
                    Err(e) => {
                        return Err(fail(format!(
                            "cannot create {} on GPU {gpu}: {e}",
                            v.type_name
                        )));
                    }
                }
                tracing::info!(%claim, gpu = %gpu, vgpu = %v.handle, type_name = %v.type_name, "created a vGPU");
                self.config.vgpu_pool.note_vfs(gpu, true);
                // Read until its group node is there; the view then shows it, so the next
                // vGPU of the claim is placed beside it.
                *ready = v
                    .handle
                    .wait_ready(self.view(&mut views, gpu), &self.paths, &opts);
                steps.mark(Step::Ready);
                break;
            }
        }
        for (d, ready) in rec.devices.iter_mut().zip(readies) {
            let Some(v) = d.vgpu.clone() else { continue };
            let inv = self.view(&mut views, v.gpu);
            steps.mark(Step::Node);
            let ready = ready.or_else(|| v.handle.wait_ready(inv, &self.paths, &opts));
            steps.mark(Step::Ready);
            let Some(ready) = ready else {
                return Err(refused(
                    claim,
                    format!(
                        "{} {} on GPU {} has no /dev/vfio group node",
                        v.type_name, v.handle, v.gpu
                    ),
                ));
            };
            // Whether the kernel has iommufd, read now: the view may be older.
            inv.refresh_dev_nodes(&self.paths);
            d.group = ready.group;
            d.nodes = vfio_nodes(inv, ready.group, ready.cdev);
        }
        for inv in views.values() {
            self.fill_attributes(inv, &mut rec);
        }
        drop(views);
        steps.mark(Step::Node);
        self.finish(claim, rec, &rec_path, steps)
    }

    /// `gpu` as this driver last read it ([`Node::views`]), read now when it has no view.
    fn view<'a>(&self, views: &'a mut Views, gpu: PciAddress) -> &'a mut Inventory {
        views.entry(gpu).or_insert_with(|| {
            // A GPU's read puts what it cannot read in the inventory; it does not fail.
            Member::Gpu(gpu)
                .read(&self.paths, &ReadOptions::default())
                .unwrap_or_default()
        })
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
            .filter_map(|d| names::parse_vgpu_device(&d.device).map(|(gpu, _)| gpu))
            .collect();
        if gpus.is_empty() {
            return Ok(());
        }
        for gpu in &gpus {
            // No driver: a prepare killed while giving the GPU back from VFIO.
            if matches!(self.sysfs.current_driver(gpu), Ok(None)) {
                let inv = self.groups(&[*gpu]);
                self.give_back(&inv, *gpu, claim)
                    .map_err(|e| refused(claim, e.to_string()))?;
            }
        }
        let opts = ReadOptions::default();
        let mut views = self.views();
        let usage: OnceLock<Usage> = OnceLock::new();
        let mut held = Vec::new();
        for v in rec.devices.iter().filter_map(|d| d.vgpu.as_ref()) {
            // That vGPU read again: whether it is there, and who holds it.
            let inv = self.view(&mut views, v.gpu);
            v.handle.refresh(inv, &self.paths, &opts);
            if !v.handle.exists(inv) {
                continue;
            }
            let usage = usage.get_or_init(|| {
                Usage::read_excluding_claim(&self.paths, Some((&claim.namespace, &claim.name)))
            });
            let users: Vec<String> = v
                .handle
                .users(usage, inv)
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
            let done = v.handle.destroy(&self.sysfs);
            v.handle.refresh(inv, &self.paths, &opts);
            done.map_err(|e| {
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
