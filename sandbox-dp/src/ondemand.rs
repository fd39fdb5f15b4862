//! On-demand vGPUs (`--on-demand`): the pooled GPUs advertise, per vGPU type they can host, as
//! many devices as could still be created now ([`common::vgpu::capacity`]); `Allocate` creates
//! the vGPU, and [`Pool::reconcile`] destroys it once no pod kubelet runs holds its device.
//!
//! Device IDs are stable across restarts: `<GPU address>-<type>-<slot>`
//! (`0000:41:00.0-A10-4Q-0`). An allocated slot is listed while its vGPU lives, under the GPU
//! the vGPU is on (which its record names: a race's loser may be placed on another GPU than the
//! one its ID names); the free slots listed are the lowest numbers no record uses, as many as
//! the GPU can still create.
//!
//! Every vGPU made here is recorded in `<root>/run/gpu-vm-node/on-demand-vgpus.json` before
//! its sysfs write (phase `creating`) and after it (`ready`), and before its removal
//! (`removing`), each time replacing the file whole: a crash at any point leaves a record of
//! every vGPU this daemon may have made, and the next run removes those no pod holds.
//!
//! One GPU serves one Allocate at a time (a lock per GPU), and each reads the GPU afresh: two
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

/// Which GPUs are pooled: `all` (every GPU of the vendor on its vGPU driver), or a list of PCI
/// addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    /// Every GPU of `--vendor` on the nvidia driver.
    All,
    /// These GPUs.
    Gpus(BTreeSet<PciAddress>),
}

/// Parses `--on-demand all|BDF,BDF,…`.
pub fn parse_selector(s: &str) -> Result<Selector, String> {
    if s.trim() == "all" {
        return Ok(Selector::All);
    }
    let mut out = BTreeSet::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        out.insert(
            part.parse()
                .map_err(|_| format!("{part:?} is not a PCI address (0000:41:00.0) or \"all\""))?,
        );
    }
    if out.is_empty() {
        return Err("expected \"all\" or a comma list of GPU PCI addresses".into());
    }
    Ok(Selector::Gpus(out))
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
    /// The GPU.
    pub gpu: PciAddress,
    /// `NVIDIA A10-4Q`.
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
    locks: Mutex<BTreeMap<PciAddress, Arc<Mutex<()>>>>,
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

/// `NVIDIA A10-4Q` → `A10-4Q`.
fn type_key(name: &str) -> &str {
    name.split_whitespace().last().unwrap_or(name)
}

/// `0000:41:00.0-A10-4Q-3`.
pub fn device_id(gpu: &PciAddress, type_name: &str, slot: u32) -> String {
    format!("{gpu}-{}-{slot}", type_key(type_name))
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
                Selector::Gpus(set) => set.contains(&d.address),
            })
            .map(|d| d.address)
            .collect()
    }

    /// At start: writes the pool file (vgpu-device-manager leaves these GPUs alone) and enables
    /// the VFs of pooled GPUs that need them to show their types.
    pub fn start(&self) -> anyhow::Result<()> {
        let inv = Inventory::read_with(&self.paths, &READ_OPTIONS)?;
        let gpus = self.gpus(&inv);
        if let Selector::Gpus(want) = &self.selector {
            for a in want.difference(&gpus) {
                tracing::warn!(gpu = %a, "--on-demand names a GPU this node does not have");
            }
        }
        state::pool::write(&self.paths, &gpus)?;
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
        tracing::info!(gpus = ?gpus.iter().map(ToString::to_string).collect::<Vec<_>>(), "on-demand pool");
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

    fn gpu_lock(&self, gpu: PciAddress) -> Arc<Mutex<()>> {
        lock(&self.locks).entry(gpu).or_default().clone()
    }

    /// The records now.
    pub fn records(&self) -> Vec<Record> {
        lock(&self.records).clone()
    }

    /// Adds the pooled GPUs' slots to `resources`, named by `resource_name` from a type name.
    /// The vGPUs of pooled GPUs are advertised through their slots only.
    pub fn advertise(
        &self,
        inv: &Inventory,
        resource_name: &dyn Fn(&str) -> String,
        resources: &mut BTreeMap<String, Resource>,
    ) -> BTreeSet<String> {
        let mut clashes = BTreeSet::new();
        let records = self.records();
        for gpu in self.gpus(inv) {
            let Some(dev) = inv.device(&gpu) else {
                continue;
            };
            let cap = capacity(inv, &gpu);
            let kind = match cap.mode {
                Mode::MdevPf | Mode::MdevVf => Kind::Mdev,
                Mode::Vendor => Kind::SriovVgpu,
                _ => continue,
            };
            for t in &cap.types {
                // MIG-backed types need GPU instances made first: not offered on demand.
                let mig =
                    common::vgpu::models::TypeName::parse(type_key(&t.name)).is_some_and(|n| n.mig);
                if mig {
                    continue;
                }
                let name = resource_name(&t.name);
                // The vGPUs of this type on this GPU, by the device ID kubelet gave (it may
                // name another GPU's slot: see `allocate_one`).
                let held: Vec<&str> = records
                    .iter()
                    .filter(|r| r.gpu == gpu && r.type_name == t.name && r.phase != Phase::Removing)
                    .map(|r| r.device.as_str())
                    .collect();
                // This GPU's slot numbers of the type that a record uses, wherever it was placed.
                let taken: BTreeSet<u32> = records
                    .iter()
                    .filter(|r| r.phase != Phase::Removing)
                    .filter(|r| {
                        parse_device_id(&r.device)
                            .is_some_and(|(g, k)| g == gpu && k == type_key(&t.name))
                    })
                    .filter_map(|r| r.device.rsplit_once('-')?.1.parse().ok())
                    .collect();
                if held.is_empty() && t.available == 0 {
                    continue;
                }
                let r = resources.entry(name.clone()).or_insert_with(|| {
                    let mut r = Resource::new(name.clone(), kind);
                    r.on_demand = true;
                    r
                });
                if r.kind != kind || !r.on_demand {
                    clashes.insert(name);
                    continue;
                }
                r.type_names.insert(t.name.clone());
                r.pci_selectors
                    .insert(format!("{:04X}:{:04X}", dev.vendor, dev.device));
                let free = (0..)
                    .filter(|s| !taken.contains(s))
                    .take(t.available as usize)
                    .map(|slot| device_id(&gpu, &t.name, slot));
                for id in held.into_iter().map(str::to_string).chain(free) {
                    r.devices.insert(
                        id.clone(),
                        DeviceInfo {
                            id,
                            healthy: true,
                            numa_node: dev.numa_node,
                            iommu_group: None,
                            vfio_cdev: None,
                            gpu: Some(gpu.to_string()),
                            switch: crate::discovery::switch_of(dev),
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
        let hosting: BTreeSet<PciAddress> = self.records().iter().map(|r| r.gpu).collect();
        let mut out: Vec<String> = must.to_vec();
        let mut cands: Vec<&String> = available.iter().filter(|a| !out.contains(a)).collect();
        cands.sort_by_key(|id| {
            let gpu = parse_device_id(id).map(|(g, _)| g);
            let slot: u32 = id
                .rsplit_once('-')
                .and_then(|(_, s)| s.parse().ok())
                .unwrap_or(u32::MAX);
            (!gpu.is_some_and(|g| hosting.contains(&g)), gpu, slot)
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
        let (gpu, key) = parse_device_id(id)
            .ok_or_else(|| format!("{resource}: {id:?} is not an on-demand device ID"))?;
        if let Some(c) = self.reuse(resource, id)? {
            return Ok(c);
        }
        let refused = match self.create_on(resource, id, gpu, key, started) {
            Placed::Made(c) => return Ok(c),
            Placed::NoRoom(e) => e,
            Placed::Failed(e) => return Err(e),
        };
        let inv = Inventory::read_with(&self.paths, &READ_OPTIONS)
            .map_err(|e| format!("reading the node: {e}"))?;
        for other in self.gpus(&inv).into_iter().filter(|g| *g != gpu) {
            match self.create_on(resource, id, other, key, started) {
                Placed::Made(c) => {
                    tracing::info!(device = id, gpu = %other, "{refused}; placed on GPU {other}");
                    return Ok(c);
                }
                Placed::NoRoom(_) => continue,
                Placed::Failed(e) => return Err(e),
            }
        }
        Err(format!("{refused}, nor can any other GPU of the pool"))
    }

    /// A record for this device: kubelet allocates it again (a restarted container, or a retry
    /// after this daemon died inside the first Allocate). Its vGPU, when it is there whole, is
    /// the answer; a partial one is removed with its record.
    fn reuse(&self, resource: &str, id: &str) -> Result<Option<Created>, String> {
        let Some(r) = self.records().into_iter().find(|r| r.device == id) else {
            return Ok(None);
        };
        let gl = self.gpu_lock(r.gpu);
        let _held = lock(&gl);
        let mut inv = Inventory::read_with(&self.paths, &READ_OPTIONS)
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
            self.destroy_handle_of(&r)
                .map_err(|e| format!("{resource}: removing {} {}: {e}", r.type_name, r.handle))?;
        }
        self.update(|rs| rs.retain(|x| x.device != id))
            .map_err(|e| format!("recording the vGPU for {id}: {e:#}"))?;
        Ok(None)
    }

    /// Creates a vGPU of type `key` for device `id` on `gpu`, under the GPU's lock and from a
    /// fresh read of it.
    fn create_on(
        &self,
        resource: &str,
        id: &str,
        gpu: PciAddress,
        key: &str,
        started: Instant,
    ) -> Placed {
        let gl = self.gpu_lock(gpu);
        let _held = lock(&gl);
        let mut inv = match Inventory::read_with(&self.paths, &READ_OPTIONS) {
            Ok(inv) => inv,
            Err(e) => return Placed::Failed(format!("reading the node: {e}")),
        };
        if !self.gpus(&inv).contains(&gpu) {
            return Placed::NoRoom(format!(
                "{resource}: GPU {gpu} of {id} is not in the on-demand pool"
            ));
        }
        let cap = capacity(&inv, &gpu);
        let Some(t) = cap.types.iter().find(|t| type_key(&t.name) == key) else {
            return Placed::NoRoom(format!("{resource}: GPU {gpu} does not offer {key}"));
        };
        let (Some(type_id), Some(parent)) = (t.type_id.clone(), t.parents.first().cloned()) else {
            return Placed::NoRoom(no_room(&cap, t));
        };
        let vendor = cap.mode == Mode::Vendor;
        let handle = if vendor {
            parent.clone()
        } else {
            uuid::Uuid::new_v4().to_string()
        };
        let rec = Record {
            device: id.to_string(),
            resource: resource.to_string(),
            gpu,
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
                    path: self.paths.pci_device(&gpu),
                    reason: format!("VF {parent} or type id {type_id} is malformed"),
                }),
            }
        } else {
            sysfs.mdev_create(&parent, &type_id, &handle)
        };
        if let Err(e) = write {
            let _ = self.update(|rs| rs.retain(|r| r.device != id));
            return Placed::Failed(format!(
                "{resource}: cannot create {} on GPU {gpu} ({parent}): {e}",
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
                "{resource}: {} {handle} on GPU {gpu} has no /dev/vfio group node",
                t.name
            ));
        };
        self.metrics.on_demand_created(started.elapsed());
        self.event_normal(
            "VgpuCreated",
            "Create",
            format!("{} {handle} created on GPU {gpu} for device {id}", t.name),
        );
        tracing::info!(device = id, gpu = %gpu, vgpu = %handle, type_name = %t.name, took_ms = started.elapsed().as_millis() as u64, "created an on-demand vGPU");
        Placed::Made(c)
    }

    /// Removes the vGPUs no pod holds: those a pod held once and no longer does, and those no
    /// pod was seen holding within the grace period. A vGPU a process holds is kept and
    /// reported until it is let go. Does nothing when kubelet does not answer. Blocking.
    /// Returns the GPUs whose records it dropped.
    pub fn reconcile(&self) -> BTreeSet<PciAddress> {
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
                } else if r.seen
                    || r.phase == Phase::Removing
                    || t.saturating_sub(r.since) >= self.grace.as_secs()
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
                    dropped.insert(r.gpu);
                }
                Err(e) => {
                    self.metrics.on_demand_failure();
                    if lock(&self.kept_told).insert(r.device.clone()) {
                        self.event_warning(
                            "VgpuNotRemoved",
                            "Remove",
                            format!(
                                "{} {} on GPU {} (device {}): {e}",
                                r.type_name, r.handle, r.gpu, r.device
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
        let gl = self.gpu_lock(r.gpu);
        let _held = lock(&gl);
        // An Allocate may have taken the record up again meanwhile (kubelet's retry): the next
        // poll decides anew.
        if !self.records().contains(r) {
            return Ok(());
        }
        let inv = Inventory::read_with(&self.paths, &READ_OPTIONS)
            .map_err(|e| format!("reading the node: {e}"))?;
        if exists(&inv, r) {
            let usage = common::Usage::read(&self.paths);
            let users: Vec<common::User> = if r.vendor {
                let vf: PciAddress = r.handle.parse().map_err(|_| "bad VF".to_string())?;
                usage.of_function(&inv, &vf)
            } else {
                inv.mdevs
                    .get(&r.handle)
                    .map(|m| usage.of_mdev(m))
                    .unwrap_or_default()
            };
            let users: Vec<_> = users.into_iter().filter(|u| !u.is_pod()).collect();
            if !users.is_empty() {
                return Err(format!(
                    "no pod holds it, but it is in use: {}; kept, retried",
                    common::usage::describe(&users)
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
                    "{} {} removed from GPU {} (device {}): no pod holds it",
                    r.type_name, r.handle, r.gpu, r.device
                ),
            );
            tracing::info!(device = %r.device, vgpu = %r.handle, type_name = %r.type_name, gpu = %r.gpu, "removed an on-demand vGPU: no pod holds it");
        }
        self.update(|rs| rs.retain(|x| x.device != r.device))
            .map_err(|e| format!("{e:#}"))
    }

    fn destroy_handle(&self, handle: &str) -> Result<(), String> {
        let r = lock(&self.records)
            .iter()
            .find(|r| r.handle == handle)
            .cloned();
        match r {
            Some(r) => {
                self.destroy_handle_of(&r)?;
                self.update(|rs| rs.retain(|x| x.handle != handle))
                    .map_err(|e| format!("{e:#}"))
            }
            None => Ok(()),
        }
    }

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

fn no_room(cap: &Capacity, t: &Creatable) -> String {
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
            gpu: Some(r.gpu.to_string()),
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
    fn selectors_and_device_ids() {
        assert_eq!(parse_selector("all"), Ok(Selector::All));
        let a: PciAddress = "0000:41:00.0".parse().unwrap();
        assert_eq!(
            parse_selector("0000:41:00.0, 0000:61:00.0").unwrap(),
            Selector::Gpus(
                [
                    "0000:41:00.0".parse().unwrap(),
                    "0000:61:00.0".parse().unwrap()
                ]
                .into()
            )
        );
        assert!(parse_selector("gpu0").unwrap_err().contains("gpu0"));
        assert!(parse_selector(",").is_err());
        let id = device_id(&a, "NVIDIA A10-4Q", 3);
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
}
