//! On-demand vGPUs (`--on-demand`): the pooled GPUs advertise, per vGPU type they can host, as
//! many devices as could still be created now ([`common::vgpu::capacity`]); `Allocate` creates
//! the vGPU, and [`Pool::reconcile`] destroys it once no pod kubelet runs holds its device.
//!
//! A pool member is a GPU (NVIDIA's vGPU rules, [`common::vgpu::capacity`]) or a non-PCI mdev
//! parent named by its entry in `<sys>/class/mdev_bus/` (`mtty`): its types and how many more of
//! each it can host are what sysfs says (`name`, `available_instances`,
//! [`common::vgpu::parents`]).
//!
//! Device IDs are stable across restarts: `<member>-<type>-<slot>` (`0000:41:00.0-A10-4Q-0`,
//! `mtty-mtty-2-0`: a GPU's type by the last word of its name, a parent's by its sysfs id). An
//! allocated slot is listed while its vGPU lives, under the GPU the vGPU is on (which its
//! record names: a race's loser may be placed on another GPU than the one its ID names); the
//! free slots listed are the lowest numbers no record uses, as many as the GPU can still create.
//!
//! Every vGPU made here follows [`common::vgpu::lifecycle`], the one sandbox-dra follows too,
//! and is recorded in `<root>/run/gpu-vm-node/on-demand-vgpus.json` before its sysfs write
//! (phase `creating`) and after it (`ready`), and before its removal (`removing`), each time
//! replacing the file whole ([`records`]): a crash at any point leaves a record of every vGPU
//! this daemon may have made, and the next run removes those no pod holds.
//!
//! One member serves one Allocate at a time (a lock per member): two Allocates racing for one
//! GPU never make two sizes on it. Under its lock the pool keeps the member as it last read it
//! (at start, then whenever a placement needs it), brought up to date with each vGPU it makes or
//! removes there by reading that vGPU alone. A vGPU is placed from that view, and the kernel's
//! answer to the write checks it (the mixing rule and the counts are the kernel's own): a view
//! that cannot place the vGPU, or a write the kernel refuses, has the member read again and the
//! vGPU placed from that read. So a change the pool did not make (a vGPU an operator made or
//! removed, a GPU unplugged) costs at most one refused write, and a refusal is never decided
//! on a kept view. The loser of a race is placed on another pooled GPU that can host its type
//! (its record maps kubelet's device ID to that GPU, and the answer carries the real vGPU), or
//! refused with the GPU and the type named when none can.
//!
//! The pool's parts: [`ids`] (device IDs of slots), [`records`] (the state file), `advertise`
//! (slots for kubelet), `allocate` (Allocate), `release` (removing what no pod holds).

mod advertise;
mod allocate;
pub mod ids;
pub mod records;
mod release;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context;
use common::vgpu::lifecycle::{self, Handle, NoRoom};
use common::vgpu::{Mode, capacity};
use common::{HostPaths, Inventory, PciAddress, ReadOptions, Sysfs, state};
use daemon_kit::events::NodeEvents;

use crate::metrics::Metrics;
use crate::resource::DeviceInfo;

/// What is pooled (`--on-demand`): `all`, every GPU of the vendor on its vGPU driver and every
/// non-PCI mdev parent, or the GPUs and parents listed.
pub use common::vgpu::selector::{Selector, parse_selector};

/// A member of the pool: what device IDs, records and locks name.
pub use common::vgpu::lifecycle::Member;

pub use ids::device_id;
pub use records::{Phase, Record, records_path};

/// What the node read for on-demand needs: the mdev types' `available_instances`.
pub const READ_OPTIONS: ReadOptions = ReadOptions {
    mdev_types: true,
    vf_identity: false,
};

/// Why an on-demand vGPU was not made, reused or removed. Each names the device and the file
/// or the member concerned.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// kubelet asked for an ID that is no slot of the pool.
    #[error("{resource}: {id:?} is not an on-demand device ID")]
    NotASlot {
        /// The resource.
        resource: String,
        /// The device ID.
        id: String,
    },
    /// The member an ID names is not pooled now.
    #[error("{resource}: {} {member} of {id} is not in the on-demand pool", .member.what())]
    NotPooled {
        /// The resource.
        resource: String,
        /// The device ID.
        id: String,
        /// The member.
        member: Member,
    },
    /// The member cannot host the type now.
    #[error("{resource}: {why}")]
    NoRoom {
        /// The resource.
        resource: String,
        /// Why.
        why: NoRoom,
    },
    /// Neither the member the ID names nor any other can host it.
    #[error("{first}, nor can any other {} of the pool", .member.what())]
    NoneCan {
        /// The member the ID names.
        member: Member,
        /// Why it could not.
        first: Box<Error>,
    },
    /// The node could not be read.
    #[error("cannot read the node")]
    Read(#[source] Box<common::Error>),
    /// The records file could not be read or written.
    #[error("cannot keep the on-demand records")]
    Records(#[source] Box<common::Error>),
    /// The records file is not what this version writes.
    #[error("{path} is not a record of on-demand vGPUs this version reads")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Why: not JSON, not records, or a newer format.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The records could not be turned into the file's text.
    #[error("cannot write the on-demand records {path}")]
    Serialize {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The sysfs write that makes the vGPU failed.
    #[error("{resource}: cannot create {type_name} on {} {member} ({parent})", .member.what())]
    Create {
        /// The resource.
        resource: String,
        /// The type.
        type_name: String,
        /// The member.
        member: Member,
        /// Where it was written: the mdev parent or the VF.
        parent: String,
        /// The kernel's answer.
        #[source]
        source: Box<common::Error>,
    },
    /// The vGPU was made but its group node did not appear.
    #[error("{type_name} {vgpu} on {} {member} has no /dev/vfio group node", .member.what())]
    NotReady {
        /// The type.
        type_name: String,
        /// The vGPU.
        vgpu: Handle,
        /// The member.
        member: Member,
    },
    /// A process (or a source that cannot be read) holds the vGPU: it is kept.
    #[error("{type_name} {vgpu} on {} {member} is in use: {who}", .member.what())]
    InUse {
        /// The type.
        type_name: String,
        /// The vGPU.
        vgpu: Handle,
        /// The member.
        member: Member,
        /// Who holds it, and what is done about it.
        who: String,
    },
    /// The sysfs write that removes the vGPU failed.
    #[error("cannot remove {type_name} {vgpu} on {} {member}", .member.what())]
    Destroy {
        /// The type.
        type_name: String,
        /// The vGPU.
        vgpu: Handle,
        /// The member.
        member: Member,
        /// The kernel's answer.
        #[source]
        source: Box<common::Error>,
    },
}

/// The on-demand pool.
#[derive(Debug)]
pub struct Pool {
    paths: HostPaths,
    /// Its sysfs writes, on threads kept for the next one.
    sysfs: Sysfs,
    selector: Selector,
    vendor: Option<u16>,
    /// How long an allocation no pod was ever seen holding lives.
    grace: Duration,
    records: Mutex<Vec<Record>>,
    /// Each member's lock, and under it the member as the pool last read it, brought up to
    /// date with every vGPU the pool made or removed there since ([`Pool::view`]).
    locks: Mutex<BTreeMap<Member, Arc<Mutex<View>>>>,
    metrics: Arc<Metrics>,
    /// Node events for creations, removals and refusals (set once the runtime runs).
    events: std::sync::OnceLock<NodeEvents>,
    /// Devices whose vGPU is kept because a process holds it, told once each.
    kept_told: Mutex<BTreeSet<String>>,
    /// The API server's pods of this node (set once the runtime runs): asked before a vGPU
    /// whose pod kubelet no longer lists goes ([`release`]).
    pods_api: std::sync::OnceLock<PodsApi>,
    /// Pods the API server said are gone (`namespace/name`): not asked again.
    gone_pods: Mutex<BTreeSet<String>>,
    /// Devices whose vGPU is kept because the API server has its pod here, told once each.
    pod_told: Mutex<BTreeSet<String>>,
    /// What became of a records file that could not be read at start, until it is told.
    unreadable: Mutex<Option<String>>,
}

/// The API server's pods of the node, and the runtime its requests run on (the release runs on
/// a blocking thread).
#[derive(Debug)]
struct PodsApi {
    pods: daemon_kit::kube::NodePods,
    rt: tokio::runtime::Handle,
    /// The account may not read pods: kubelet's PodResources alone decides.
    forbidden: std::sync::atomic::AtomicBool,
}

/// A member as the pool last read it (none before the first read, or after a write whose
/// effect is not known).
type View = Option<Inventory>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Records are written to disk before they are relied on: a panic leaves them usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A vGPU created for an allocation: what the response carries.
#[derive(Clone, Debug)]
pub struct Created {
    /// The env value: the mdev UUID, or the VF address.
    pub handle: String,
    /// The vGPU.
    pub vgpu: Handle,
    /// The vGPU as a device: its IOMMU group and VFIO cdev.
    pub info: DeviceInfo,
}

impl Pool {
    /// A pool over `selector`'s GPUs, with the records a previous run left.
    pub fn new(
        paths: HostPaths,
        selector: Selector,
        vendor: Option<u16>,
        grace: Duration,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Pool> {
        let (records, unreadable) = records::load_or_set_aside(&paths)?;
        if unreadable.is_some() {
            metrics.on_demand_records_unreadable();
        }
        Ok(Pool {
            sysfs: Sysfs::new(paths.clone()),
            paths,
            selector,
            vendor,
            grace,
            records: Mutex::new(records),
            locks: Mutex::new(BTreeMap::new()),
            metrics,
            events: std::sync::OnceLock::new(),
            kept_told: Mutex::new(BTreeSet::new()),
            pods_api: std::sync::OnceLock::new(),
            gone_pods: Mutex::new(BTreeSet::new()),
            pod_told: Mutex::new(BTreeSet::new()),
            unreadable: Mutex::new(unreadable),
        })
    }

    /// Asks `pods` whether a pod kubelet no longer lists still runs on the node before its
    /// vGPU goes: kubelet lists no pod for a while after it starts, until it has its pods from
    /// the API server. To be called on the runtime its requests are to run on.
    pub fn set_pods_api(&self, pods: daemon_kit::kube::NodePods) {
        let _ = self.pods_api.set(PodsApi {
            pods,
            rt: tokio::runtime::Handle::current(),
            forbidden: std::sync::atomic::AtomicBool::new(false),
        });
    }

    /// Records its creations, removals and refusals as Events on the Node from now on (and
    /// that its records were set aside at start, when they were).
    pub fn set_events(&self, events: NodeEvents) {
        let _ = self.events.set(events);
        if let Some(note) = lock(&self.unreadable).take() {
            self.event_warning("OnDemandRecordsUnreadable", "Start", note);
        }
    }

    fn event_normal(&self, reason: &str, action: &str, note: String) {
        if let Some(ev) = self.events.get() {
            ev.normal(reason, action, note);
        }
    }

    fn event_warning(&self, reason: &str, action: &str, note: String) {
        if let Some(ev) = self.events.get() {
            ev.warning(reason, action, note);
        }
    }

    /// The metrics it counts in.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// The pooled GPUs the inventory has.
    pub fn gpus(&self, inv: &Inventory) -> BTreeSet<PciAddress> {
        inv.gpus(self.vendor)
            .into_iter()
            .filter(|d| !d.is_vf())
            .filter(|d| match &self.selector {
                Selector::All => d.driver.as_deref() == Some("nvidia") || d.mdev_parent,
                Selector::Listed { gpus, .. } => gpus.contains(&d.address),
            })
            .map(|d| d.address)
            .collect()
    }

    /// The pooled non-PCI mdev parents the inventory has.
    pub fn parents(&self, inv: &Inventory) -> BTreeSet<String> {
        let Selector::Listed { parents, .. } = &self.selector else {
            return BTreeSet::new();
        };
        parents
            .iter()
            .filter(|n| common::vgpu::parents::capacity(inv, n).is_some())
            .cloned()
            .collect()
    }

    /// What placing or removing a vGPU on `m` depends on ([`Member::read`]), read under its
    /// lock.
    fn read_member(&self, m: &Member) -> Result<Inventory, Error> {
        m.read(&self.paths, &READ_OPTIONS)
            .map_err(|e| Error::Read(Box::new(e)))
    }

    /// The member's view (its lock held): as kept, else read now.
    fn view<'a>(&self, view: &'a mut View, m: &Member) -> Result<&'a mut Inventory, Error> {
        if view.is_none() {
            *view = Some(self.read_member(m)?);
        }
        // Just filled when it was empty.
        Ok(view.get_or_insert_default())
    }

    /// Every pooled GPU and mdev parent the inventory has, GPUs first.
    fn members(&self, inv: &Inventory) -> Vec<Member> {
        let gpus = self.gpus(inv).into_iter().map(Member::Gpu);
        gpus.chain(self.parents(inv).into_iter().map(Member::Parent))
            .collect()
    }

    /// At start: takes the pool's hold (kept while the returned value lives: the pool is this
    /// process's only while it runs), writes the pool file (vgpu-device-manager and sandbox-dra
    /// leave these GPUs alone) and enables the VFs of pooled GPUs that need them to show their
    /// types.
    pub fn start(&self) -> anyhow::Result<state::pool::Hold> {
        let hold = state::pool::hold(&self.paths)?.with_context(|| {
            format!(
                "another sandbox-dp --on-demand holds {}.lock: one owner per node",
                state::pool::path(&self.paths).display()
            )
        })?;
        let mut inv = Inventory::read_with(&self.paths, &READ_OPTIONS)?;
        let gpus = self.gpus(&inv);
        if let Selector::Listed {
            gpus: want,
            parents,
        } = &self.selector
        {
            for a in want.difference(&gpus) {
                tracing::warn!(gpu = %a, "--on-demand names a GPU this node does not have");
            }
            for p in parents.difference(&self.parents(&inv)) {
                tracing::warn!(parent = %p, "--on-demand names an mdev parent this node does not have: no {}", self.paths.mdev_bus().join(p).display());
            }
        }
        let parents = self.parents(&inv);
        state::pool::write(
            &self.paths,
            &state::pool::Members {
                gpus: gpus.clone(),
                parents: parents.clone(),
            },
        )?;
        let sysfs = &self.sysfs;
        let need: Vec<(PciAddress, u32)> = gpus
            .iter()
            .filter_map(|a| match capacity(&inv, a).mode {
                Mode::NeedsVfs { total } => Some((*a, total)),
                _ => None,
            })
            .collect();
        // Enabling VFs changes what the GPU is: a GPU something uses (a process holding
        // /dev/nvidia<N>, a pod given it) is left as it is, and offers nothing until a restart.
        let usage = (!need.is_empty()).then(|| common::Usage::read(&self.paths));
        for (a, total) in need {
            let uses = usage
                .as_ref()
                .map(|u| u.of_gpu(&inv, &a))
                .unwrap_or_default();
            if !uses.is_empty() {
                let who: Vec<String> = uses.iter().map(|u| u.describe(&inv)).collect();
                tracing::warn!(gpu = %a, "not enabling the VFs of GPU {a} for on-demand vGPUs: it is in use: {}", who.join("; "));
                continue;
            }
            tracing::info!(gpu = %a, vfs = total, "enabling VFs for on-demand vGPUs");
            if !lifecycle::enable_vfs(sysfs, &self.paths, &mut inv, &a, total, &READ_OPTIONS)? {
                tracing::warn!(gpu = %a, "the VFs of GPU {a} show no vGPU types yet");
            }
        }
        // Each member read once now, so that the first Allocate on it does not wait for that.
        for m in gpus
            .iter()
            .map(|a| Member::Gpu(*a))
            .chain(parents.iter().map(|p| Member::Parent(p.clone())))
        {
            match self.read_member(&m) {
                Ok(inv) => *lock(&self.member_lock(&m)) = Some(inv),
                Err(e) => {
                    tracing::debug!(gpu = %m, error = %common::error_chain(&e), "not read at start")
                }
            }
        }
        tracing::info!(gpus = ?gpus.iter().map(ToString::to_string).collect::<Vec<_>>(), parents = ?parents, "on-demand pool");
        Ok(hold)
    }

    fn member_lock(&self, m: &Member) -> Arc<Mutex<View>> {
        lock(&self.locks).entry(m.clone()).or_default().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_file_names_the_mdev_parents_too() {
        let t = testkit::sysfs::SysfsTree::new();
        let dev = t.root().join("sys/devices/virtual/mtty/mtty");
        t.mdev_type(&dev, "mtty-2", "Dual port serial", 3);
        t.mdev_parent("virtual/mtty/mtty", "mtty");
        let paths = HostPaths::new(t.root());
        let pool = Pool::new(
            paths.clone(),
            parse_selector("mtty").unwrap(),
            None,
            Duration::from_secs(1),
            Default::default(),
        )
        .unwrap();
        let _hold = pool.start().unwrap();
        assert_eq!(
            state::pool::load(&paths).unwrap(),
            state::pool::Members {
                gpus: BTreeSet::new(),
                parents: ["mtty".to_string()].into(),
            },
            "vgpu-device-manager leaves mtty alone"
        );
    }
}
