//! On-demand vGPUs (`--on-demand`): the pooled GPUs advertise, per vGPU type they can host, as
//! many devices as could still be created now ([`common::vgpu::capacity`]); `Allocate` creates
//! the vGPU, and [`Pool::reconcile`] destroys it once no pod kubelet runs holds its device.
//!
//! A pool member is a GPU (NVIDIA's vGPU rules, [`common::vgpu::capacity`]) or a non-PCI mdev
//! parent named by its entry in `<sys>/class/mdev_bus/` (`mtty`): its types and how many more of
//! each it can host are what sysfs says (`name`, `available_instances`), with no model rules.
//!
//! Device IDs are stable across restarts: `<member>-<type>-<slot>` (`0000:41:00.0-A10-4Q-0`,
//! `mtty-mtty-2-0`: a GPU's type by the last word of its name, a parent's by its sysfs id). An
//! allocated slot is listed while its vGPU lives, under the GPU
//! the vGPU is on (which its record names: a race's loser may be placed on another GPU than the
//! one its ID names); the free slots listed are the lowest numbers no record uses, as many as
//! the GPU can still create.
//!
//! Every vGPU made here is recorded in `<root>/run/gpu-vm-node/on-demand-vgpus.json` before
//! its sysfs write (phase `creating`) and after it (`ready`), and before its removal
//! (`removing`), each time replacing the file whole: a crash at any point leaves a record of
//! every vGPU this daemon may have made, and the next run removes those no pod holds.
//!
//! One member serves one Allocate at a time (a lock per member), and each reads it afresh: two
//! Allocates racing for one GPU never make two sizes on it. The loser is placed on another
//! pooled GPU that can host its type (its record maps kubelet's device ID to that GPU, and the
//! answer carries the real vGPU), or refused with the GPU and the type named when none can.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::vgpu::{Capacity, Creatable, Mode, capacity};
use common::{HostPaths, Inventory, PciAddress, ReadOptions, Sysfs, state};
use serde::{Deserialize, Serialize};

use crate::discovery::{DeviceInfo, Kind, Resource};
use crate::metrics::Metrics;
use daemon_kit::events::NodeEvents;

/// What is pooled (`--on-demand`): `all`, every GPU of the vendor on its vGPU driver and every
/// non-PCI mdev parent, or the GPUs and parents listed.
pub use common::vgpu::selector::{Selector, parse_selector};

/// A member of the pool: what device IDs, records and locks name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum Member {
    /// A GPU: NVIDIA's vGPU rules ([`common::vgpu::capacity`]).
    Gpu(PciAddress),
    /// A non-PCI mdev parent (`mtty`): its types and counts as sysfs has them.
    Parent(String),
}

impl Member {
    /// `GPU` or `mdev parent`, for messages.
    fn what(&self) -> &'static str {
        match self {
            Member::Gpu(_) => "GPU",
            Member::Parent(_) => "mdev parent",
        }
    }
}

impl std::fmt::Display for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Member::Gpu(a) => a.fmt(f),
            Member::Parent(n) => f.write_str(n),
        }
    }
}

impl From<Member> for String {
    fn from(m: Member) -> String {
        m.to_string()
    }
}

impl From<String> for Member {
    fn from(s: String) -> Member {
        match s.parse() {
            Ok(a) => Member::Gpu(a),
            Err(_) => Member::Parent(s),
        }
    }
}

/// Where a record's vGPU is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// About to be written to sysfs (it may or may not exist).
    Creating,
    /// Created; given to kubelet.
    Ready,
    /// About to be removed (it may or may not exist still).
    Removing,
}

/// One vGPU made for an allocation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The advertised device ID kubelet allocated.
    pub device: String,
    /// Its resource.
    pub resource: String,
    /// The GPU or mdev parent the vGPU is on (`gpu` in files an earlier version wrote).
    #[serde(alias = "gpu")]
    pub parent: Member,
    /// `NVIDIA A10-4Q`, `Dual port serial`.
    pub type_name: String,
    /// The mdev's UUID, or the VF's address on the vendor path.
    pub handle: String,
    /// The vendor path: `handle` is a VF whose `current_vgpu_type` was set.
    pub vendor: bool,
    /// Where it is in its life.
    pub phase: Phase,
    /// When the allocation came, seconds since the epoch.
    pub since: u64,
    /// A pod kubelet runs was seen holding it.
    pub seen: bool,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Records {
    vgpus: Vec<Record>,
}

/// `<root>/run/gpu-vm-node/on-demand-vgpus.json`.
pub fn records_path(paths: &HostPaths) -> std::path::PathBuf {
    paths.root().join("run/gpu-vm-node/on-demand-vgpus.json")
}

/// What the node read for on-demand needs: the mdev types' `available_instances`.
pub const READ_OPTIONS: ReadOptions = ReadOptions {
    mdev_types: true,
    vf_identity: false,
};

/// The on-demand pool.
#[derive(Debug)]
pub struct Pool {
    paths: HostPaths,
    selector: Selector,
    vendor: Option<u16>,
    /// How long an allocation no pod was ever seen holding lives.
    grace: Duration,
    records: Mutex<Vec<Record>>,
    locks: Mutex<BTreeMap<Member, Arc<Mutex<()>>>>,
    metrics: Arc<Metrics>,
    /// Node events for creations, removals and refusals (set once the runtime runs).
    events: std::sync::OnceLock<NodeEvents>,
    /// Devices whose vGPU is kept because a process holds it, told once each.
    kept_told: Mutex<BTreeSet<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Records are written to disk before they are relied on: a panic leaves them usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether a vGPU allocated at `since` and still seen in no pod at `at` (both whole seconds, as
/// [`now`] gives them) is past its grace period. Whole seconds cut both instants short by up to a second,
/// so the elapsed time is only known to within a second: the grace is over when it is surely
/// over, more whole seconds than the grace rounded up. A vGPU is never released early (one
/// allocated at 07.99 is not gone at 08.01 with a grace of 1 s); it may go up to a second late.
fn past_grace(since: u64, at: u64, grace: Duration) -> bool {
    let grace = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
    at.saturating_sub(since) > grace
}

/// `NVIDIA A10-4Q` → `A10-4Q`.
fn type_key(name: &str) -> &str {
    name.split_whitespace().last().unwrap_or(name)
}

/// `0000:41:00.0-A10-4Q-3`, `mtty-mtty-2-0`: `key` is a GPU's type by the last word of its
/// name, a parent's by its sysfs id.
pub fn device_id(member: &Member, key: &str, slot: u32) -> String {
    format!("{member}-{key}-{slot}")
}

/// The slot number of `id` when it is one of `member`'s slots of type `key`.
fn slot_of(id: &str, member: &Member, key: &str) -> Option<u32> {
    id.strip_prefix(&format!("{member}-{key}-"))?.parse().ok()
}

/// The GPU and type key of a device ID.
fn parse_device_id(id: &str) -> Option<(PciAddress, &str)> {
    let gpu = id.get(..12)?.parse().ok()?;
    let rest = id.get(13..)?;
    let (key, slot) = rest.rsplit_once('-')?;
    slot.parse::<u32>().ok()?;
    Some((gpu, key))
}

/// A vGPU created for an allocation: what the response carries.
#[derive(Clone, Debug)]
pub struct Created {
    /// The env value: the mdev UUID, or the VF address.
    pub handle: String,
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
        let path = records_path(&paths);
        let records = match state::read_if_present(&path)? {
            Some(text) => {
                serde_json::from_str::<Records>(&text)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
                    .vgpus
            }
            None => Vec::new(),
        };
        Ok(Pool {
            paths,
            selector,
            vendor,
            grace,
            records: Mutex::new(records),
            locks: Mutex::new(BTreeMap::new()),
            metrics,
            events: std::sync::OnceLock::new(),
            kept_told: Mutex::new(BTreeSet::new()),
        })
    }

    /// Records its creations, removals and refusals as Events on the Node from now on.
    pub fn set_events(&self, events: NodeEvents) {
        let _ = self.events.set(events);
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
            .filter(|n| inv.mdev_parents.get(*n).is_some_and(|p| p.pci.is_none()))
            .cloned()
            .collect()
    }

    /// What placing or removing a vGPU on `m` depends on, read under its lock: for a GPU, the
    /// GPU with its VFs, their mdev types and mdevs, and the group nodes of their groups (a
    /// refresh of that GPU into an empty inventory, which then shows it as a full read does:
    /// the cost of the GPU, not of the node, which on a node of SR-IOV GPUs is every VF's
    /// types); for a non-PCI parent, the node.
    fn read_member(&self, m: &Member) -> common::Result<Inventory> {
        match m {
            Member::Gpu(a) => {
                let mut inv = Inventory::default();
                inv.refresh_pci(&self.paths, *a, &READ_OPTIONS);
                Ok(inv)
            }
            Member::Parent(_) => Inventory::read_with(&self.paths, &READ_OPTIONS),
        }
    }

    /// Every pooled GPU and mdev parent the inventory has, GPUs first.
    fn members(&self, inv: &Inventory) -> Vec<Member> {
        let gpus = self.gpus(inv).into_iter().map(Member::Gpu);
        gpus.chain(self.parents(inv).into_iter().map(Member::Parent))
            .collect()
    }

    /// The member and type key a device ID names: a GPU's (`0000:41:00.0-A10-4Q-0`) or a
    /// listed parent's (`mtty-mtty-2-0`; the longest listed name that fits).
    fn parse_id<'a>(&self, id: &'a str) -> Option<(Member, &'a str)> {
        if let Some((gpu, key)) = parse_device_id(id) {
            return Some((Member::Gpu(gpu), key));
        }
        let Selector::Listed { parents, .. } = &self.selector else {
            return None;
        };
        parents
            .iter()
            .filter_map(|p| {
                let rest = id.strip_prefix(p.as_str())?.strip_prefix('-')?;
                let (key, slot) = rest.rsplit_once('-')?;
                slot.parse::<u32>().ok()?;
                (!key.is_empty()).then_some((p, key))
            })
            .max_by_key(|(p, _)| p.len())
            .map(|(p, key)| (Member::Parent(p.clone()), key))
    }

    /// At start: writes the pool file (vgpu-device-manager leaves these GPUs alone) and enables
    /// the VFs of pooled GPUs that need them to show their types.
    pub fn start(&self) -> anyhow::Result<()> {
        let inv = Inventory::read_with(&self.paths, &READ_OPTIONS)?;
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
        let sysfs = Sysfs::new(self.paths.clone());
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
            sysfs.set_sriov_numvfs(&a, total)?;
        }
        tracing::info!(gpus = ?gpus.iter().map(ToString::to_string).collect::<Vec<_>>(), parents = ?parents, "on-demand pool");
        Ok(())
    }

    fn save(&self, records: &[Record]) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(&Records {
            vgpus: records.to_vec(),
        })?;
        state::write_atomic(&records_path(&self.paths), text.as_bytes())?;
        Ok(())
    }

    fn update(&self, f: impl FnOnce(&mut Vec<Record>)) -> anyhow::Result<()> {
        let mut r = lock(&self.records);
        f(&mut r);
        self.save(&r)
    }

    fn member_lock(&self, m: &Member) -> Arc<Mutex<()>> {
        lock(&self.locks).entry(m.clone()).or_default().clone()
    }

    /// The records now.
    pub fn records(&self) -> Vec<Record> {
        lock(&self.records).clone()
    }

    /// Adds the pool members' slots to `resources`, named by `resource_name` from a type name.
    /// The vGPUs of pooled GPUs and parents are advertised through their slots only.
    pub fn advertise(
        &self,
        inv: &Inventory,
        resource_name: &dyn Fn(&str) -> String,
        resources: &mut BTreeMap<String, Resource>,
    ) -> BTreeSet<String> {
        let mut clashes = BTreeSet::new();
        let records = self.records();
        for member in self.members(inv) {
            let Some(offers) = offers(inv, &member) else {
                continue;
            };
            let dev = match &member {
                Member::Gpu(a) => match inv.device(a) {
                    Some(d) => Some(d),
                    None => continue,
                },
                Member::Parent(_) => None,
            };
            for (key, t) in &offers.types {
                // MIG-backed types need GPU instances made first: not offered on demand.
                let mig = matches!(member, Member::Gpu(_))
                    && common::vgpu::models::TypeName::parse(key).is_some_and(|n| n.mig);
                if mig {
                    continue;
                }
                let name = resource_name(&t.name);
                // The vGPUs of this type on this member, by the device ID kubelet gave (it may
                // name another GPU's slot: see `allocate_one`).
                let held: Vec<&str> = records
                    .iter()
                    .filter(|r| {
                        r.parent == member && r.type_name == t.name && r.phase != Phase::Removing
                    })
                    .map(|r| r.device.as_str())
                    .collect();
                // This member's slot numbers of the type that a record uses, wherever it was
                // placed.
                let taken: BTreeSet<u32> = records
                    .iter()
                    .filter(|r| r.phase != Phase::Removing)
                    .filter_map(|r| slot_of(&r.device, &member, key))
                    .collect();
                if held.is_empty() && t.available == 0 {
                    continue;
                }
                let r = resources.entry(name.clone()).or_insert_with(|| {
                    let mut r = Resource::new(name.clone(), offers.kind);
                    r.on_demand = true;
                    r
                });
                if r.kind != offers.kind || !r.on_demand {
                    clashes.insert(name);
                    continue;
                }
                r.type_names.insert(t.name.clone());
                if let Some(dev) = dev {
                    r.pci_selectors
                        .insert(format!("{:04X}:{:04X}", dev.vendor, dev.device));
                }
                let free = (0..)
                    .filter(|s| !taken.contains(s))
                    .take(t.available as usize)
                    .map(|slot| device_id(&member, key, slot));
                for id in held.into_iter().map(str::to_string).chain(free) {
                    r.devices.insert(
                        id.clone(),
                        DeviceInfo {
                            id,
                            healthy: true,
                            numa_node: dev.and_then(|d| d.numa_node),
                            iommu_group: None,
                            vfio_cdev: None,
                            gpu: Some(member.to_string()),
                            switch: dev.and_then(crate::discovery::switch_of),
                            driver: None,
                        },
                    );
                }
            }
        }
        clashes
    }

    /// The preferred `size` of `available` for a container of `resource`: slots of GPUs that
    /// already host vGPUs made here first (packing leaves other GPUs free for other sizes),
    /// then in GPU and slot order.
    pub fn preferred(&self, available: &[String], must: &[String], size: usize) -> Vec<String> {
        let hosting: BTreeSet<Member> = self.records().into_iter().map(|r| r.parent).collect();
        let mut out: Vec<String> = must.to_vec();
        let mut cands: Vec<&String> = available.iter().filter(|a| !out.contains(a)).collect();
        cands.sort_by_cached_key(|id| {
            let gpu = self.parse_id(id).map(|(m, _)| m);
            let slot: u32 = id
                .rsplit_once('-')
                .and_then(|(_, s)| s.parse().ok())
                .unwrap_or(u32::MAX);
            (
                !gpu.as_ref().is_some_and(|g| hosting.contains(g)),
                gpu,
                slot,
            )
        });
        out.extend(
            cands
                .into_iter()
                .take(size.saturating_sub(out.len()))
                .cloned(),
        );
        out
    }

    /// Creates the vGPU for each device ID of one container (blocking: sysfs writes), or
    /// reuses the one made for it before. On an error, the vGPUs made for this call are removed.
    pub fn allocate(&self, resource: &str, ids: &[String]) -> Result<Vec<Created>, String> {
        let mut out = Vec::new();
        for id in ids {
            match self.allocate_one(resource, id) {
                Ok(c) => out.push(c),
                Err(e) => {
                    for c in &out {
                        if let Err(e) = self.destroy_handle(&c.handle) {
                            tracing::warn!(vgpu = %c.handle, error = %e, "cannot undo a vGPU of a failed allocation");
                        }
                    }
                    self.metrics.on_demand_failure();
                    self.event_warning("VgpuNotCreated", "Create", e.clone());
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
    fn allocate_one(&self, resource: &str, id: &str) -> Result<Created, String> {
        let started = Instant::now();
        let (member, key) = self
            .parse_id(id)
            .ok_or_else(|| format!("{resource}: {id:?} is not an on-demand device ID"))?;
        if let Some(c) = self.reuse(resource, id)? {
            return Ok(c);
        }
        let refused = match self.create_on(resource, id, &member, key, started) {
            Placed::Made(c) => return Ok(c),
            Placed::NoRoom(e) => e,
            Placed::Failed(e) => return Err(e),
        };
        let inv = Inventory::read_with(&self.paths, &READ_OPTIONS)
            .map_err(|e| format!("reading the node: {e}"))?;
        for other in self.members(&inv).into_iter().filter(|m| *m != member) {
            match self.create_on(resource, id, &other, key, started) {
                Placed::Made(c) => {
                    tracing::info!(device = id, gpu = %other, "{refused}; placed on {} {other}", other.what());
                    return Ok(c);
                }
                Placed::NoRoom(_) => continue,
                Placed::Failed(e) => return Err(e),
            }
        }
        Err(format!(
            "{refused}, nor can any other {} of the pool",
            member.what()
        ))
    }

    /// A record for this device: kubelet allocates it again (a restarted container, or a retry
    /// after this daemon died inside the first Allocate). Its vGPU, when it is there whole, is
    /// the answer; a partial one is removed with its record.
    fn reuse(&self, resource: &str, id: &str) -> Result<Option<Created>, String> {
        let Some(r) = self.records().into_iter().find(|r| r.device == id) else {
            return Ok(None);
        };
        let gl = self.member_lock(&r.parent);
        let _held = lock(&gl);
        let mut inv = self
            .read_member(&r.parent)
            .map_err(|e| format!("reading the node: {e}"))?;
        if r.phase != Phase::Removing
            && let Some(c) = created(&mut inv, &self.paths, &r)
        {
            // Ready, and its grace period starts again: kubelet is admitting a pod with it.
            self.update(|rs| {
                if let Some(x) = rs.iter_mut().find(|x| x.device == id) {
                    x.phase = Phase::Ready;
                    x.since = now();
                }
            })
            .map_err(|e| format!("recording the vGPU for {id}: {e:#}"))?;
            tracing::info!(device = id, vgpu = %r.handle, "reusing the vGPU made for this device");
            return Ok(Some(c));
        }
        if exists(&inv, &r) {
            // Made for this device but not whole (no group node yet, or half removed): made
            // again, unless something holds it.
            if let Some(who) = self.held(&inv, &r)? {
                return Err(format!(
                    "{resource}: {} {} made earlier for {id} is in use: {who}; not removed",
                    r.type_name, r.handle
                ));
            }
            self.destroy_handle_of(&r)
                .map_err(|e| format!("{resource}: removing {} {}: {e}", r.type_name, r.handle))?;
        }
        self.update(|rs| rs.retain(|x| x.device != id))
            .map_err(|e| format!("recording the vGPU for {id}: {e:#}"))?;
        Ok(None)
    }

    /// Creates a vGPU of type `key` for device `id` on `gpu` (a GPU or an mdev parent), under
    /// its lock and from a fresh read of it.
    fn create_on(
        &self,
        resource: &str,
        id: &str,
        gpu: &Member,
        key: &str,
        started: Instant,
    ) -> Placed {
        let what = gpu.what();
        let gl = self.member_lock(gpu);
        let _held = lock(&gl);
        let mut inv = match self.read_member(gpu) {
            Ok(inv) => inv,
            Err(e) => return Placed::Failed(format!("reading the node: {e}")),
        };
        if !self.members(&inv).contains(gpu) {
            return Placed::NoRoom(format!(
                "{resource}: {what} {gpu} of {id} is not in the on-demand pool"
            ));
        }
        let offers = offers(&inv, gpu);
        let Some(t) = offers
            .as_ref()
            .and_then(|o| o.types.iter().find(|(k, _)| k == key))
            .map(|(_, t)| t)
        else {
            return Placed::NoRoom(format!("{resource}: {what} {gpu} does not offer {key}"));
        };
        let (Some(type_id), Some(parent)) = (t.type_id.clone(), t.parents.first().cloned()) else {
            return Placed::NoRoom(no_room(gpu, offers.as_ref(), t));
        };
        let vendor = offers.as_ref().is_some_and(|o| o.vendor);
        let handle = if vendor {
            parent.clone()
        } else {
            uuid::Uuid::new_v4().to_string()
        };
        let rec = Record {
            device: id.to_string(),
            resource: resource.to_string(),
            parent: gpu.clone(),
            type_name: t.name.clone(),
            handle: handle.clone(),
            vendor,
            phase: Phase::Creating,
            since: now(),
            seen: false,
        };
        if let Err(e) = self.update(|rs| {
            rs.retain(|r| r.device != id);
            rs.push(rec.clone());
        }) {
            return Placed::Failed(format!("recording the vGPU for {id}: {e:#}"));
        }
        let sysfs = Sysfs::new(self.paths.clone());
        let write = if vendor {
            match (parent.parse::<PciAddress>(), type_id.parse::<u32>()) {
                (Ok(vf), Ok(n)) => sysfs.set_current_vgpu_type(&vf, n),
                _ => Err(common::Error::Parse {
                    path: match gpu {
                        Member::Gpu(a) => self.paths.pci_device(a),
                        Member::Parent(n) => self.paths.mdev_bus().join(n),
                    },
                    reason: format!("VF {parent} or type id {type_id} is malformed"),
                }),
            }
        } else {
            sysfs.mdev_create(&parent, &type_id, &handle)
        };
        if let Err(e) = write {
            let _ = self.update(|rs| rs.retain(|r| r.device != id));
            return Placed::Failed(format!(
                "{resource}: cannot create {} on {what} {gpu} ({parent}): {e}",
                t.name
            ));
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
            return Placed::Failed(format!("recording the vGPU for {id}: {e:#}"));
        }
        let Some(c) = wait_created(&mut inv, &self.paths, &ready) else {
            return Placed::Failed(format!(
                "{resource}: {} {handle} on {what} {gpu} has no /dev/vfio group node",
                t.name
            ));
        };
        self.metrics.on_demand_created(started.elapsed());
        self.event_normal(
            "VgpuCreated",
            "Create",
            format!(
                "{} {handle} created on {what} {gpu} for device {id}",
                t.name
            ),
        );
        tracing::info!(device = id, gpu = %gpu, vgpu = %handle, type_name = %t.name, took_ms = started.elapsed().as_millis() as u64, "created an on-demand vGPU");
        Placed::Made(c)
    }

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
                if active.contains_key(&r.device.to_ascii_lowercase()) {
                    changed |= !r.seen;
                    r.seen = true;
                } else if r.seen || r.phase == Phase::Removing || past_grace(r.since, t, self.grace)
                {
                    release.push(r.clone());
                }
            }
            changed
        };
        if changed && let Err(e) = self.update(|_| {}) {
            tracing::warn!(error = format!("{e:#}"), "cannot record the vGPUs' pods");
        }
        for r in release {
            match self.release(&r) {
                Ok(()) => {
                    dropped.insert(r.parent.clone());
                }
                Err(e) => {
                    self.metrics.on_demand_failure();
                    if lock(&self.kept_told).insert(r.device.clone()) {
                        self.event_warning(
                            "VgpuNotRemoved",
                            "Remove",
                            format!(
                                "{} {} on {} {} (device {}): {e}",
                                r.type_name,
                                r.handle,
                                r.parent.what(),
                                r.parent,
                                r.device
                            ),
                        );
                    }
                    tracing::warn!(device = %r.device, vgpu = %r.handle, "cannot remove an on-demand vGPU: {e}");
                }
            }
        }
        dropped
    }

    fn release(&self, r: &Record) -> Result<(), String> {
        let gl = self.member_lock(&r.parent);
        let _held = lock(&gl);
        // An Allocate may have taken the record up again meanwhile (kubelet's retry): the next
        // poll decides anew.
        if !self.records().contains(r) {
            return Ok(());
        }
        // Its GPU holds the vGPU (an mdev on it or a VF, or the VF itself): who uses it is
        // found from that device alone (its group node, its VFIO cdev, its pod).
        let inv = self
            .read_member(&r.parent)
            .map_err(|e| format!("reading the node: {e}"))?;
        if exists(&inv, r) {
            if let Some(who) = self.held(&inv, r)? {
                return Err(format!(
                    "no pod holds it, but it is in use: {who}; kept, retried"
                ));
            }
            self.update(|rs| {
                if let Some(x) = rs.iter_mut().find(|x| x.device == r.device) {
                    x.phase = Phase::Removing;
                }
            })
            .map_err(|e| format!("{e:#}"))?;
            self.destroy_handle_of(r)?;
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
            .map_err(|e| format!("{e:#}"))
    }

    /// Who other than a pod holds the vGPU of `r` (a process: its group node or VFIO cdev
    /// open), as a description; `None` when nobody does. Unknown counts as held. Pods are left
    /// to the callers, which judge them from kubelet's PodResources. `inv` holds its GPU.
    fn held(&self, inv: &Inventory, r: &Record) -> Result<Option<String>, String> {
        let usage = common::Usage::read(&self.paths);
        let users: Vec<common::User> = if r.vendor {
            let vf: PciAddress = r.handle.parse().map_err(|_| "bad VF".to_string())?;
            usage.of_function(inv, &vf)
        } else {
            inv.mdevs
                .get(&r.handle)
                .map(|m| usage.of_mdev(m))
                .unwrap_or_default()
        };
        let users: Vec<_> = users.into_iter().filter(|u| !u.is_pod()).collect();
        Ok((!users.is_empty()).then(|| common::usage::describe(&users)))
    }

    /// Undoes a vGPU this call made (an Allocate of several devices failed on a later one),
    /// under its GPU's lock, unless something already holds it.
    fn destroy_handle(&self, handle: &str) -> Result<(), String> {
        let r = lock(&self.records)
            .iter()
            .find(|r| r.handle == handle)
            .cloned();
        let Some(r) = r else { return Ok(()) };
        let gl = self.member_lock(&r.parent);
        let _held = lock(&gl);
        let inv = self
            .read_member(&r.parent)
            .map_err(|e| format!("reading the node: {e}"))?;
        if exists(&inv, &r) {
            if let Some(who) = self.held(&inv, &r)? {
                return Err(format!("it is in use: {who}; kept"));
            }
            self.destroy_handle_of(&r)?;
        }
        self.update(|rs| rs.retain(|x| x.handle != handle))
            .map_err(|e| format!("{e:#}"))
    }

    /// The write that removes the vGPU of `r`. Callers ask [`Pool::held`] first.
    fn destroy_handle_of(&self, r: &Record) -> Result<(), String> {
        let sysfs = Sysfs::new(self.paths.clone());
        let res = if r.vendor {
            let vf: PciAddress = r.handle.parse().map_err(|_| "bad VF".to_string())?;
            sysfs.set_current_vgpu_type(&vf, 0)
        } else {
            sysfs.mdev_remove(&r.handle)
        };
        res.map_err(|e| e.to_string())
    }
}

/// What one GPU made of an Allocate.
enum Placed {
    /// The vGPU.
    Made(Created),
    /// The GPU cannot host the type now (or is not pooled, or lacks the type): try another.
    NoRoom(String),
    /// Anything else: the Allocate fails.
    Failed(String),
}

/// What one member can create now, by type.
struct Offers {
    kind: Kind,
    /// The vendor SR-IOV path: `current_vgpu_type` on a free VF.
    vendor: bool,
    /// Each type by its key in device IDs.
    types: Vec<(String, Creatable)>,
    /// A GPU's capacity (for messages).
    cap: Option<Capacity>,
}

/// A GPU's types by NVIDIA's rules ([`capacity`]); a non-PCI parent's as sysfs lists them, each
/// with its `available_instances`. `None`: it offers nothing now (VFs not enabled, not a vGPU
/// GPU, no such parent).
fn offers(inv: &Inventory, m: &Member) -> Option<Offers> {
    match m {
        Member::Gpu(gpu) => {
            let cap = capacity(inv, gpu);
            let kind = match cap.mode {
                Mode::MdevPf | Mode::MdevVf => Kind::Mdev,
                Mode::Vendor => Kind::SriovVgpu,
                _ => return None,
            };
            let types = cap
                .types
                .iter()
                .map(|t| (type_key(&t.name).to_string(), t.clone()))
                .collect();
            Some(Offers {
                kind,
                vendor: cap.mode == Mode::Vendor,
                types,
                cap: Some(cap),
            })
        }
        Member::Parent(name) => {
            let p = inv.mdev_parents.get(name).filter(|p| p.pci.is_none())?;
            let types = p
                .types
                .iter()
                .map(|t| {
                    let c = Creatable {
                        name: t.name.clone().unwrap_or_else(|| t.id.clone()),
                        type_id: Some(t.id.clone()),
                        framebuffer_mb: None,
                        max: None,
                        available: t.available_instances,
                        parents: if t.available_instances > 0 {
                            vec![name.clone()]
                        } else {
                            Vec::new()
                        },
                    };
                    (t.id.clone(), c)
                })
                .collect();
            Some(Offers {
                kind: Kind::Mdev,
                vendor: false,
                types,
                cap: None,
            })
        }
    }
}

fn no_room(m: &Member, offers: Option<&Offers>, t: &Creatable) -> String {
    match offers.and_then(|o| o.cap.as_ref()) {
        Some(cap) => gpu_no_room(cap, t),
        None => format!(
            "{} {m} cannot host another {} now: its available_instances is 0",
            m.what(),
            t.name
        ),
    }
}

fn gpu_no_room(cap: &Capacity, t: &Creatable) -> String {
    let have: Vec<String> = cap
        .existing
        .iter()
        .map(|(id, fb)| match fb {
            Some(fb) => format!("{id} ({fb} MiB)"),
            None => id.clone(),
        })
        .collect();
    format!(
        "GPU {} cannot host another {} now: it has {} vGPU(s){}",
        cap.gpu,
        t.name,
        have.len(),
        if have.is_empty() {
            String::new()
        } else {
            format!(": {}", have.join(", "))
        }
    )
}

fn exists(inv: &Inventory, r: &Record) -> bool {
    if r.vendor {
        r.handle
            .parse::<PciAddress>()
            .ok()
            .and_then(|a| inv.device(&a))
            .and_then(|d| d.nvidia_vgpu.as_ref())
            .is_some_and(|nv| nv.current != 0)
    } else {
        inv.mdevs.contains_key(&r.handle)
    }
}

/// The vGPU of a record as a device, once its group node exists.
fn created(inv: &mut Inventory, paths: &HostPaths, r: &Record) -> Option<Created> {
    let (group, cdev) = if r.vendor {
        let a: PciAddress = r.handle.parse().ok()?;
        inv.refresh_pci(paths, a, &READ_OPTIONS);
        let d = inv.device(&a)?;
        (d.nvidia_vgpu.as_ref()?.current != 0).then_some(())?;
        (d.iommu_group?, d.vfio_cdev.clone())
    } else {
        inv.refresh_mdev(paths, &r.handle);
        let m = inv.mdevs.get(&r.handle)?;
        (m.iommu_group?, m.vfio_cdev.clone())
    };
    inv.refresh_vfio_node(paths, group);
    inv.vfio_nodes.contains(&group).then(|| Created {
        handle: r.handle.clone(),
        info: DeviceInfo {
            id: r.handle.clone(),
            healthy: true,
            numa_node: None,
            iommu_group: Some(group),
            vfio_cdev: cdev,
            gpu: Some(r.parent.to_string()),
            switch: None,
            driver: None,
        },
    })
}

/// [`created`], waiting up to two seconds for the kernel to make the group node.
fn wait_created(inv: &mut Inventory, paths: &HostPaths, r: &Record) -> Option<Created> {
    let end = Instant::now() + Duration::from_secs(2);
    loop {
        if let Some(c) = created(inv, paths, r) {
            return Some(c);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grace_period_is_never_cut_short_by_whole_seconds() {
        let s = Duration::from_secs;
        // Allocated at 100.99, seen at 101.01: 20 ms, not a second.
        assert!(!past_grace(100, 101, s(1)));
        // At 102.00 at the earliest: over 1 s.
        assert!(past_grace(100, 102, s(1)));
        assert!(!past_grace(100, 160, s(60)));
        assert!(past_grace(100, 161, s(60)));
        // A grace under a second lasts until the next second but one.
        assert!(!past_grace(100, 101, Duration::from_millis(500)));
        assert!(past_grace(100, 102, Duration::from_millis(500)));
        assert!(!past_grace(100, 100, Duration::ZERO));
        assert!(past_grace(100, 101, Duration::ZERO));
        // A clock set back keeps the vGPU.
        assert!(!past_grace(100, 50, s(1)));
    }

    #[test]
    fn device_ids() {
        let a: PciAddress = "0000:41:00.0".parse().unwrap();
        let id = device_id(&Member::Gpu(a), type_key("NVIDIA A10-4Q"), 3);
        assert_eq!(id, "0000:41:00.0-A10-4Q-3");
        assert_eq!(parse_device_id(&id), Some((a, "A10-4Q")));
        assert_eq!(
            parse_device_id("0000:18:00.0-H100XM-1-10C-0"),
            Some(("0000:18:00.0".parse().unwrap(), "H100XM-1-10C"))
        );
        assert_eq!(
            parse_device_id("5a3b2c1d-0000-4000-8000-00000000abcd"),
            None
        );
    }

    #[test]
    fn mdev_parents_are_named_and_their_ids_parse_by_the_listed_names() {
        let sel = parse_selector("mtty, 0000:41:00.0,mtty-x").unwrap();
        assert_eq!(
            sel,
            Selector::Listed {
                gpus: ["0000:41:00.0".parse().unwrap()].into(),
                parents: ["mtty".to_string(), "mtty-x".to_string()].into(),
            }
        );
        let pool = Pool::new(
            HostPaths::new("/nonexistent-root"),
            sel,
            None,
            Duration::from_secs(1),
            Default::default(),
        )
        .unwrap();
        let mtty = Member::Parent("mtty".into());
        let id = device_id(&mtty, "mtty-2", 0);
        assert_eq!(id, "mtty-mtty-2-0");
        assert_eq!(pool.parse_id(&id), Some((mtty.clone(), "mtty-2")));
        // The longest listed name that fits.
        assert_eq!(
            pool.parse_id("mtty-x-mtty-1-4"),
            Some((Member::Parent("mtty-x".into()), "mtty-1"))
        );
        assert_eq!(pool.parse_id("mbochs-mbochs-small-0"), None);
        assert_eq!(pool.parse_id("mtty-mtty-2-x"), None);
        assert_eq!(slot_of("mtty-mtty-2-7", &mtty, "mtty-2"), Some(7));
        assert_eq!(slot_of("mtty-mtty-2-7", &mtty, "mtty-1"), None);
        // Records name the member by its string, and read files that still say `gpu`.
        let r: Record = serde_json::from_str(
            r#"{"device":"d","resource":"r","gpu":"0000:41:00.0","type_name":"t","handle":"h","vendor":false,"phase":"ready","since":0,"seen":false}"#,
        )
        .unwrap();
        assert_eq!(r.parent, Member::Gpu("0000:41:00.0".parse().unwrap()));
        let text = serde_json::to_string(&Record { parent: mtty, ..r }).unwrap();
        assert!(text.contains(r#""parent":"mtty""#), "{text}");
        assert_eq!(
            serde_json::from_str::<Record>(&text).unwrap().parent,
            Member::Parent("mtty".into())
        );
    }

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
        pool.start().unwrap();
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
