//! `Allocate`: the vGPU of each device ID made (or the one made for it before reused), each
//! following [`common::vgpu::lifecycle`]: placed under the member's lock from the member as
//! the pool last saw it (read again when that view cannot place it or the kernel refuses the
//! write), recorded, created, waited for.

use std::time::Instant;

use common::Inventory;
use common::vgpu::lifecycle::{self, Member, NoRoom};

use super::records::now;
use super::{Created, Error, Phase, Pool, READ_OPTIONS, Record, lock};
use crate::resource::DeviceInfo;

/// What one member made of an Allocate.
enum Placed {
    /// The vGPU.
    Made(Created),
    /// The member cannot host the type now (or is not pooled, or lacks the type): try another.
    NoRoom(Error),
    /// Anything else: the Allocate fails.
    Failed(Error),
}

impl Pool {
    /// Creates the vGPU for each device ID of one container (blocking: sysfs writes), or
    /// reuses the one made for it before. On an error, the vGPUs made for this call are removed.
    pub fn allocate(&self, resource: &str, ids: &[String]) -> Result<Vec<Created>, Error> {
        let mut out = Vec::new();
        for id in ids {
            match self.allocate_one(resource, id) {
                Ok(c) => out.push(c),
                Err(e) => {
                    for c in &out {
                        if let Err(e) = self.destroy_handle(&c.vgpu) {
                            tracing::warn!(vgpu = %c.handle, error = %common::error_chain(&e), "cannot undo a vGPU of a failed allocation");
                        }
                    }
                    self.metrics.on_demand_failure();
                    self.event_warning("VgpuNotCreated", "Create", common::error_chain(&e));
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// One device: the vGPU made for it before, else a new one on the GPU its ID names, else
    /// (that GPU cannot host the type now: another size won a race for it, or it is full) on
    /// the first other pooled GPU that can. The record maps the device ID to the GPU the vGPU
    /// is on, and the answer carries the real vGPU (its UUID or VF), so kubelet's ID may name a
    /// slot of another GPU than the one serving it.
    fn allocate_one(&self, resource: &str, id: &str) -> Result<Created, Error> {
        let started = Instant::now();
        let (member, key) = self.parse_id(id).ok_or_else(|| Error::NotASlot {
            resource: resource.to_string(),
            id: id.to_string(),
        })?;
        if let Some(c) = self.reuse(resource, id)? {
            return Ok(c);
        }
        let refused = match self.create_on(resource, id, &member, key, started) {
            Placed::Made(c) => return Ok(c),
            Placed::NoRoom(e) => e,
            Placed::Failed(e) => return Err(e),
        };
        let inv = Inventory::read_with(&self.paths, &READ_OPTIONS)
            .map_err(|e| Error::Read(Box::new(e)))?;
        for other in self.members(&inv).into_iter().filter(|m| *m != member) {
            match self.create_on(resource, id, &other, key, started) {
                Placed::Made(c) => {
                    tracing::info!(device = id, gpu = %other, "{}; placed on {} {other}", common::error_chain(&refused), other.what());
                    return Ok(c);
                }
                Placed::NoRoom(_) => continue,
                Placed::Failed(e) => return Err(e),
            }
        }
        Err(Error::NoneCan {
            member,
            first: Box::new(refused),
        })
    }

    /// A record for this device: kubelet allocates it again (a restarted container, or a retry
    /// after this daemon died inside the first Allocate). Its vGPU, when it is there whole, is
    /// the answer; a partial one is removed with its record.
    fn reuse(&self, resource: &str, id: &str) -> Result<Option<Created>, Error> {
        let Some(r) = self.records().into_iter().find(|r| r.device == id) else {
            return Ok(None);
        };
        let gl = self.member_lock(&r.parent);
        let mut view = lock(&gl);
        let inv = self.view(&mut view, &r.parent)?;
        r.handle.refresh(inv, &self.paths, &READ_OPTIONS);
        if r.phase != Phase::Removing
            && let Some(ready) = r.handle.ready(inv)
        {
            // Ready, and its grace period starts again: kubelet is admitting a pod with it.
            self.update(|rs| {
                if let Some(x) = rs.iter_mut().find(|x| x.device == id) {
                    x.phase = Phase::Ready;
                    x.since = now();
                }
            })?;
            tracing::info!(device = id, vgpu = %r.handle, "reusing the vGPU made for this device");
            return Ok(Some(created(&r, ready)));
        }
        if r.handle.exists(inv) {
            // Made for this device but not whole (no group node yet, or half removed): made
            // again, unless something holds it.
            if let Some(who) = self.held(inv, &r) {
                return Err(Error::InUse {
                    type_name: r.type_name.clone(),
                    vgpu: r.handle.clone(),
                    member: r.parent.clone(),
                    who: format!("{who}; made earlier for {id} of {resource}, not removed"),
                });
            }
            self.destroy(inv, &r)?;
        }
        self.update(|rs| rs.retain(|x| x.device != id))?;
        Ok(None)
    }

    /// Creates a vGPU of type `key` for device `id` on `member`, under its lock: placed from
    /// the member as the pool last saw it (its last read, with the pool's own vGPUs since), the
    /// kernel's answer to the write checking that view; what that view cannot place, or the
    /// kernel refuses, is placed again from a fresh read of the member, which the pool keeps.
    fn create_on(
        &self,
        resource: &str,
        id: &str,
        member: &Member,
        key: &str,
        started: Instant,
    ) -> Placed {
        let gl = self.member_lock(member);
        let mut view = lock(&gl);
        if let Some(inv) = view.as_mut() {
            match self.create_from(inv, resource, id, member, key, started) {
                Placed::NoRoom(e) => {
                    tracing::debug!(device = id, gpu = %member, why = %common::error_chain(&e), "reading the member again");
                }
                Placed::Failed(e @ Error::Create { .. }) if refused(&e) => {
                    tracing::debug!(device = id, gpu = %member, why = %common::error_chain(&e), "the kernel refused; reading the member again");
                }
                done => return done,
            }
        }
        *view = None;
        let mut inv = match self.read_member(member) {
            Ok(inv) => inv,
            Err(e) => return Placed::Failed(e),
        };
        let placed = self.create_from(&mut inv, resource, id, member, key, started);
        *view = Some(inv);
        placed
    }

    /// Creates a vGPU of type `key` for device `id` on `member` as `inv` shows it (the
    /// member's lock held), and brings `inv` up to date with it.
    fn create_from(
        &self,
        inv: &mut Inventory,
        resource: &str,
        id: &str,
        member: &Member,
        key: &str,
        started: Instant,
    ) -> Placed {
        let what = member.what();
        if !self.members(inv).contains(member) {
            return Placed::NoRoom(Error::NotPooled {
                resource: resource.to_string(),
                id: id.to_string(),
                member: member.clone(),
            });
        }
        let no_room = |why: NoRoom| Error::NoRoom {
            resource: resource.to_string(),
            why,
        };
        let Some(offers) = lifecycle::offers(inv, member) else {
            return Placed::NoRoom(no_room(NoRoom::Full(format!(
                "{what} {member} is not on this node"
            ))));
        };
        let key_of = |t: &common::vgpu::Creatable| match member {
            Member::Parent(_) => t.type_id.clone().unwrap_or_default(),
            Member::Gpu(_) => super::ids::type_key(&t.name).to_string(),
        };
        let Some(t) = offers.find(|t| key_of(t) == key) else {
            return Placed::NoRoom(no_room(offers.not_offered(key)));
        };
        let planned = match offers.place(t) {
            Ok(p) => p,
            Err(e) => return Placed::NoRoom(no_room(e)),
        };
        let handle = planned.handle.clone();
        let rec = Record {
            device: id.to_string(),
            resource: resource.to_string(),
            parent: member.clone(),
            type_name: t.name.clone(),
            handle: handle.clone(),
            phase: Phase::Creating,
            since: now(),
            seen: false,
            pod: None,
        };
        if let Err(e) = self.update(|rs| {
            rs.retain(|r| r.device != id);
            rs.push(rec.clone());
        }) {
            return Placed::Failed(e);
        }
        if let Err(source) = planned.create(&self.sysfs) {
            if let Err(e) = self.update(|rs| rs.retain(|r| r.device != id)) {
                tracing::warn!(device = id, error = %common::error_chain(&e), "cannot drop the record of a vGPU that was not created");
            }
            return Placed::Failed(Error::Create {
                resource: resource.to_string(),
                type_name: t.name.clone(),
                member: member.clone(),
                parent: planned.parent,
                source: Box::new(source),
            });
        }
        let ready = Record {
            phase: Phase::Ready,
            ..rec
        };
        if let Err(e) = self.update(|rs| {
            if let Some(r) = rs.iter_mut().find(|r| r.device == id) {
                *r = ready.clone();
            }
        }) {
            return Placed::Failed(e);
        }
        let Some(made) = handle.wait_ready(inv, &self.paths, &READ_OPTIONS) else {
            return Placed::Failed(Error::NotReady {
                type_name: t.name.clone(),
                vgpu: handle,
                member: member.clone(),
            });
        };
        self.metrics.on_demand_created(started.elapsed());
        self.event_normal(
            "VgpuCreated",
            "Create",
            format!(
                "{} {handle} created on {what} {member} for device {id}",
                t.name
            ),
        );
        tracing::info!(device = id, gpu = %member, vgpu = %handle, type_name = %t.name, took_ms = started.elapsed().as_millis() as u64, "created an on-demand vGPU");
        Placed::Made(created(&ready, made))
    }
}

/// Whether a failed create was the kernel's refusal ([`lifecycle::refused`]).
fn refused(e: &Error) -> bool {
    matches!(e, Error::Create { source, .. } if lifecycle::refused(source))
}

/// The vGPU of a record as a device, its group node there.
fn created(r: &Record, ready: lifecycle::Ready) -> Created {
    let handle = r.handle.to_string();
    Created {
        handle: handle.clone(),
        vgpu: r.handle.clone(),
        info: DeviceInfo {
            id: handle,
            healthy: true,
            numa_node: None,
            iommu_group: Some(ready.group),
            vfio_cdev: ready.cdev,
            gpu: Some(r.parent.to_string()),
            switch: None,
            driver: None,
        },
    }
}
