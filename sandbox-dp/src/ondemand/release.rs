//! Giving vGPUs back: [`Pool::reconcile`] removes those no pod holds, never one a process
//! holds ([`common::usage`]), each marked `removing` in the records before its removal.

use std::collections::BTreeSet;
use std::time::Duration;

use common::vgpu::lifecycle::{Handle, Member};
use common::{Inventory, error_chain};

use super::records::{now, past_grace};
use super::{Error, Phase, Pool, READ_OPTIONS, Record, lock};

impl Pool {
    /// Removes the vGPUs no pod holds: those a pod held once and no longer does, and those no
    /// pod was seen holding within the grace period. A vGPU a process holds is kept and
    /// reported until it is let go. Does nothing when kubelet does not answer. Blocking.
    /// Returns the GPUs and parents whose records it dropped.
    pub fn reconcile(&self) -> BTreeSet<Member> {
        let mut dropped = BTreeSet::new();
        let active = match common::usage::active_pods(&self.paths, Duration::from_secs(5)) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("keeping every on-demand vGPU: {e}");
                return dropped;
            }
        };
        let t = now();
        let mut release = Vec::new();
        let changed = {
            let mut rs = lock(&self.records);
            let mut changed = false;
            for r in rs.iter_mut() {
                if let Some(pods) = active.get(&r.device.to_ascii_lowercase()) {
                    let pod = pods.iter().find_map(|p| {
                        Some(format!("{}/{}", p.namespace.as_ref()?, p.name.as_ref()?))
                    });
                    changed |= !r.seen || (pod.is_some() && r.pod != pod);
                    r.seen = true;
                    // Listed again: a later keep is told again.
                    lock(&self.pod_told).remove(&r.device);
                    if pod.is_some() {
                        r.pod = pod;
                    }
                } else if r.seen || r.phase == Phase::Removing || past_grace(r.since, t, self.grace)
                {
                    release.push(r.clone());
                }
            }
            changed
        };
        if changed && let Err(e) = self.update(|_| {}) {
            tracing::warn!(error = %error_chain(&e), "cannot record the vGPUs' pods");
        }
        for r in release {
            if let Some(why) = self.pod_runs(&r) {
                if lock(&self.pod_told).insert(r.device.clone()) {
                    tracing::info!(device = %r.device, vgpu = %r.handle, "keeping an on-demand vGPU: {why}");
                }
                continue;
            }
            match self.release(&r) {
                Ok(()) => {
                    lock(&self.pod_told).remove(&r.device);
                    dropped.insert(r.parent.clone());
                }
                Err(e) => {
                    self.metrics.on_demand_failure();
                    let e = error_chain(&e);
                    if lock(&self.kept_told).insert(r.device.clone()) {
                        self.event_warning(
                            "VgpuNotRemoved",
                            "Remove",
                            format!("{e} (device {})", r.device),
                        );
                    }
                    tracing::warn!(device = %r.device, vgpu = %r.handle, "cannot remove an on-demand vGPU: {e}");
                }
            }
        }
        // A pod no record names any more is not asked about again anyway.
        let named: BTreeSet<String> = self.records().into_iter().filter_map(|r| r.pod).collect();
        lock(&self.gone_pods).retain(|p| named.contains(p));
        dropped
    }

    /// Why the vGPU of `r`, whose pod kubelet no longer lists, is kept: the API server has that
    /// pod on this node still (kubelet lists no pod for a while after it starts, until it has
    /// its pods from the API server), or cannot say. `None`: it may go (the pod is gone, or no
    /// pod was ever named, or the API server is not asked).
    fn pod_runs(&self, r: &Record) -> Option<String> {
        use daemon_kit::kube::{PodLookupError, PodOnNode};
        use std::sync::atomic::Ordering;
        let pod = r.pod.as_deref()?;
        let api = self.pods_api.get()?;
        if r.phase == Phase::Removing
            || api.forbidden.load(Ordering::Relaxed)
            || lock(&self.gone_pods).contains(pod)
        {
            return None;
        }
        let (ns, name) = pod.split_once('/')?;
        let answer = api
            .rt
            .block_on(api.pods.pod(ns, name, Duration::from_secs(5)));
        match answer {
            Ok(PodOnNode::Gone(why)) => {
                tracing::debug!(device = %r.device, "{why}");
                lock(&self.gone_pods).insert(pod.to_string());
                None
            }
            Ok(PodOnNode::Runs(why)) => Some(format!(
                "kubelet does not list pod {pod} with it, but the API server says {why} \
                 (kubelet starting?)"
            )),
            Err(PodLookupError::Forbidden(e)) => {
                api.forbidden.store(true, Ordering::Relaxed);
                tracing::warn!(
                    "cannot ask the API server whether a pod kubelet no longer lists still runs \
                     here ({e}): kubelet's PodResources alone decides when a vGPU goes; give \
                     the account `get` on pods"
                );
                None
            }
            Err(PodLookupError::Failed(e)) => Some(format!(
                "kubelet does not list pod {pod} with it, and the API server cannot say whether \
                 it still runs here ({e}); retried"
            )),
        }
    }

    fn release(&self, r: &Record) -> Result<(), Error> {
        let gl = self.member_lock(&r.parent);
        let mut view = lock(&gl);
        // An Allocate may have taken the record up again meanwhile (kubelet's retry): the next
        // poll decides anew.
        if !self.records().contains(r) {
            return Ok(());
        }
        // Its GPU holds the vGPU (an mdev on it or a VF, or the VF itself): whether it is
        // there and who uses it are found from that device alone, read again (its group node,
        // its VFIO cdev, its pod).
        let inv = self.view(&mut view, &r.parent)?;
        r.handle.refresh(inv, &self.paths, &READ_OPTIONS);
        if r.handle.exists(inv) {
            if let Some(who) = self.held(inv, r) {
                return Err(Error::InUse {
                    type_name: r.type_name.clone(),
                    vgpu: r.handle.clone(),
                    member: r.parent.clone(),
                    who: format!("{who}, though no pod holds it; kept, retried"),
                });
            }
            self.update(|rs| {
                if let Some(x) = rs.iter_mut().find(|x| x.device == r.device) {
                    x.phase = Phase::Removing;
                }
            })?;
            self.destroy(inv, r)?;
            self.metrics.on_demand_destroyed();
            lock(&self.kept_told).remove(&r.device);
            self.event_normal(
                "VgpuRemoved",
                "Remove",
                format!(
                    "{} {} removed from {} {} (device {}): no pod holds it",
                    r.type_name,
                    r.handle,
                    r.parent.what(),
                    r.parent,
                    r.device
                ),
            );
            tracing::info!(device = %r.device, vgpu = %r.handle, type_name = %r.type_name, gpu = %r.parent, "removed an on-demand vGPU: no pod holds it");
        }
        self.update(|rs| rs.retain(|x| x.device != r.device))
    }

    /// Who other than a pod holds the vGPU of `r` (a process: its group node or VFIO cdev
    /// open), as a description; `None` when nobody does. Unknown counts as held. Pods are left
    /// to the callers, which judge them from kubelet's PodResources. `inv` holds its GPU.
    pub(super) fn held(&self, inv: &Inventory, r: &Record) -> Option<String> {
        let usage = common::Usage::read(&self.paths);
        let users: Vec<_> = r
            .handle
            .users(&usage, inv)
            .into_iter()
            .filter(|u| !u.is_pod())
            .collect();
        (!users.is_empty()).then(|| common::usage::describe(&users))
    }

    /// Undoes a vGPU this call made (an Allocate of several devices failed on a later one),
    /// under its GPU's lock, unless something already holds it.
    pub(super) fn destroy_handle(&self, handle: &Handle) -> Result<(), Error> {
        let r = lock(&self.records)
            .iter()
            .find(|r| r.handle == *handle)
            .cloned();
        let Some(r) = r else { return Ok(()) };
        let gl = self.member_lock(&r.parent);
        let mut view = lock(&gl);
        let inv = self.view(&mut view, &r.parent)?;
        r.handle.refresh(inv, &self.paths, &READ_OPTIONS);
        if r.handle.exists(inv) {
            if let Some(who) = self.held(inv, &r) {
                return Err(Error::InUse {
                    type_name: r.type_name.clone(),
                    vgpu: r.handle.clone(),
                    member: r.parent.clone(),
                    who: format!("{who}; kept"),
                });
            }
            self.destroy(inv, &r)?;
        }
        self.update(|rs| rs.retain(|x| x.handle != *handle))
    }

    /// The write that removes the vGPU of `r`; then its member's view `inv` reads that vGPU
    /// again (gone, or as the failed write left it). Callers ask [`Pool::held`] first.
    pub(super) fn destroy(&self, inv: &mut Inventory, r: &Record) -> Result<(), Error> {
        let done = r.handle.destroy(&self.sysfs).map_err(|e| Error::Destroy {
            type_name: r.type_name.clone(),
            vgpu: r.handle.clone(),
            member: r.parent.clone(),
            source: Box::new(e),
        });
        r.handle.refresh(inv, &self.paths, &READ_OPTIONS);
        done
    }
}
