//! Keeps the node's ResourceSlices ([`crate::slices`]) true in the API server: one slice, or
//! with a vGPU pool (`--vgpu`) the counter sets in slices of their own and the devices in
//! slices of at most 64, or with `--pool-per-gpu` a pool per pooled GPU, its counter set and
//! its devices in two slices ([`slices::Pool::slices`]). Each pool is planned and written on
//! its own: with a pool per GPU, a GPU hot-plugged writes its pool's slices, not the others'.
//!
//! What the API server holds is known without asking ([`cache`]): a kube-runtime reflector
//! follows this node's slices of this driver (field selector `spec.nodeName=<node>,
//! spec.driver=<driver>`): one list, then one watch at a time, each asking the API server to
//! keep it open for [`WATCH_TIMEOUT_SECS`] (an hour; kube-apiserver grants what a client asks)
//! with bookmarks, and opened again from where the last one ended; a list again only when the
//! API server can no longer resume it (410 Gone). At rest that renewal is the driver's one
//! request an hour. A connection that died without a word is found by TCP keepalive within two
//! minutes, not at the watch's end ([`daemon_kit::kube::watch_client`]).
//!
//! The Node is not watched: what the slices need from it, its UID (their owner reference) and
//! its container runtime ([`crate::runtime::RuntimeCheck`]), changes rarely, and is read (one
//! GET, [`crate::node`]) when it matters: at the first pass, and at the pass after the watch
//! shows what a Node deleted and registered again brings (a slice another client deleted: the
//! garbage collector takes the slices the old UID owns, and kubelet deletes the node's slices
//! when it starts; a slice owned by another UID; the slices listed anew). The slices written
//! then are owned by the UID read.
//!
//! A pass reads the node, builds the slices and compares them with the cache ([`plan`]): it
//! writes only what differs, one server-side apply (field manager `sandbox-dra`, forced: this
//! driver alone writes its node's slices) per slice that changed and a delete per slice of
//! this node and driver it no longer publishes; when nothing differs it asks the API server
//! nothing. Generations: a change to one slice of a pool that keeps its slices writes that
//! slice at its generation (as the upstream ResourceSlice controller does); any other change
//! moves every slice of the pool to one generation above the highest seen (found, or written
//! by this process), so the scheduler takes them over any older copy and never mixes two
//! generations; a generation a pass began and did not finish
//! (its time ran out, a write failed), or slices another client deleted while the rest still
//! say what the node has, are finished at that generation; a restarted driver that finds its
//! slices right adopts their generation.
//!
//! A pass runs at start, on every uevent that can change what is published (a GPU hot-plugged
//! or removed, a driver bound or unbound, a VFIO group node appearing or going), when kubelet
//! (re)registers the driver, when the watch shows another client's change to the node's
//! slices (one deleted or edited; kubelet deletes the node's slices when it starts and when a
//! driver unregisters), and every `--resync-interval` ([`daemon_kit::reconcile`]: a burst of
//! events is one pass). At rest, the passes ask the API server nothing: the watch is all the
//! driver's requests.
//!
//! A pass's requests are each bounded by `--api-timeout`, and the pass's time with the API
//! server by the longer of `--resync-interval` and that timeout (what is written by then
//! stays written; the next pass goes on from there). While a pass waits on the API server,
//! the loop beats: `/healthz` fails when the process is stuck (a read of sysfs that never
//! returns), not when the API server is slow or hangs. A pass that fails (the API server
//! unreachable, a refusal, its time out) is retried after a backoff with jitter, 1 s
//! doubling to 5 minutes. After a refusal (the API server answered: RBAC, an admission
//! policy, no such Node) a resync until then reads the node and reports health but does not
//! write again (a refused write, or a read of a missing Node, is not repeated every 30 s on
//! every node); a server that was not reached is tried again at each resync, so that the
//! slices are right soon after it is back. A change (a uevent, a claim, the watch) is tried at
//! once either way.
//!
//! Cleaning up:
//! - slices of this driver on this node other than those this process publishes (a renamed
//!   node, an older naming, the vGPU pool's slices once `--vgpu` is gone) are deleted;
//! - the slice carries an owner reference to its Node (with the Node's UID), so Kubernetes'
//!   garbage collector deletes it when the Node object is deleted; a Node registered again has
//!   a new UID, read once the watch shows the slices deleted, and the slices are written again
//!   owned by it (while the Node is missing, the pass fails and is retried on the backoff, or
//!   at once on a change: kubelet registering the driver again);
//! - kubelet deletes the node's slices of a driver that unregistered (its registration socket
//!   gone) and did not come back within its grace period, and all of the node's slices when it
//!   starts; this process therefore leaves its slice in place when it stops (a rollout's
//!   replacement finds it and keeps the generation).

mod cache;
mod plan;
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Context as _;
use common::uevent::{Monitor, Uevent};
use common::vfio::{self, Selector, select};
use common::{HostPaths, Inventory, PciIds, ReadOptions};
use daemon_kit::reconcile::{Settings, Trigger};
use futures::StreamExt as _;
use k8s_openapi::api::resource::v1::{CounterSet, Device, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt as _, reflector};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::node::{NodeFacts, NodeReader};
use crate::registration::Registered;
use crate::slices::{self, LeftOut, NodeDevices, Pool};
use crate::vgpu;

/// The field manager of the driver's writes.
pub const FIELD_MANAGER: &str = "sandbox-dra";

/// Uevent subsystems whose events can change the slice or a device's health (events without
/// one count too): `mdev` for a prepared vGPU removed behind the driver's back.
const SUBSYSTEMS: &[&str] = &["pci", "vfio", "iommu", "drivers", "mdev"];

/// The first and the longest delay before a failed pass is tried again (each lengthened by up
/// to as much again, at random).
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(300);

/// How often a pass waiting on the API server tells liveness that it waits, not that it is
/// stuck.
const BEAT_WHILE_WAITING: Duration = Duration::from_secs(1);

/// How long the API server is asked to keep one watch of the node's slices open
/// (`timeoutSeconds`; kube-apiserver grants what is asked): at rest, its renewal is the
/// driver's one request an hour. A quiet watch may say nothing for all that time, not even a
/// bookmark (the API server sends one only once its cache of ResourceSlices moved):
/// kube-runtime's watcher takes a watch as dead only after this and 5 s without a word, when the
/// API server has ended it already, and the watch client has no read timeout; TCP keepalive
/// finds a connection whose API server vanished ([`daemon_kit::kube::watch_client`]).
pub const WATCH_TIMEOUT_SECS: u32 = 3600;

/// What asks the publisher to compare the slices with the node again.
#[derive(Debug)]
enum Change {
    /// A uevent that can change what is published.
    Uevent(Uevent),
    /// kubelet registered the driver: it deletes the node's slices when it starts.
    Registered,
    /// Another client changed the node's slices, or they were listed (again).
    Slices,
    /// A pooled GPU's VFs could not be enabled, or could again: its vGPU devices' taint.
    Vfs,
}

/// What the publisher needs besides the clients and the host paths.
#[derive(Clone, Debug)]
pub struct PublishConfig {
    /// The driver name.
    pub driver: String,
    /// This node's name.
    pub node_name: String,
    /// The PCI vendor whose display functions are published (`--vendor`).
    pub vendor: u16,
    /// Product names.
    pub pci_ids: PciIds,
    /// How often to compare with the cache without an event.
    pub resync_interval: Duration,
    /// The most one request to the API server may take (`--api-timeout`).
    pub api_timeout: Duration,
    /// Where passes are counted, and readiness told.
    pub telemetry: std::sync::Arc<crate::telemetry::Telemetry>,
    /// Where the node's container runtime is recorded when the Node is read, for prepare to
    /// refuse what it could not hand to a pod.
    pub runtime: std::sync::Arc<crate::runtime::RuntimeCheck>,
    /// Which GPUs are published with vGPU devices (`--vgpu`), for those that appear.
    pub vgpu: vgpu::Selector,
    /// The GPUs published with vGPU devices; a GPU `vgpu` selects that appears joins it.
    pub vgpu_pool: vgpu::Pool,
    /// The mdev parents that are not PCI functions published with their types (`--vgpu mtty`).
    pub mdev_parents: BTreeSet<String>,
    /// The effect of the taint on a device that cannot serve a VM (`--taint-effect`).
    pub taint_effect: slices::TaintEffect,
    /// Each GPU of the vGPU pool in a pool of its own (`--pool-per-gpu`).
    pub pool_per_gpu: bool,
    /// `<kubelet-root>/plugins/<driver>` as this process reaches it: the claim records, whose
    /// devices stay published (tainted) while their GPU is gone.
    pub driver_dir: std::path::PathBuf,
}

impl PublishConfig {
    /// The most a pass spends waiting on the API server: the longer of the resync interval
    /// and one request's timeout (with the client's second of slack), so that kubelet hears
    /// about the devices' health (sent at every pass) well within its three resync intervals.
    pub fn pass_timeout(&self) -> Duration {
        self.resync_interval
            .max(self.api_timeout + Duration::from_secs(1))
    }
}

/// Reads the node's devices (on a blocking thread: sysfs reads): the display functions of
/// `vendor`; a GPU `vgpu` selects that is not in `vgpu_pool` yet (hot-plugged) joins it
/// ([`vgpu::Pool::grow`]); the GPUs of `vgpu_pool` get their counter sets and vGPU devices,
/// the `mdev_parents` theirs ([`slices::mdev_parent_devices`]).
pub async fn read_devices(cfg: &PublishConfig, paths: &HostPaths) -> anyhow::Result<NodeDevices> {
    let (paths, ids, sel, pool) = (
        paths.clone(),
        cfg.pci_ids.clone(),
        cfg.vgpu.clone(),
        cfg.vgpu_pool.clone(),
    );
    let (parents, vendor, driver, effect) = (
        cfg.mdev_parents.clone(),
        cfg.vendor,
        cfg.driver.clone(),
        cfg.taint_effect,
    );
    let driver_dir = cfg.driver_dir.clone();
    // Which pool each device is published in.
    let layout = Pool {
        driver: cfg.driver.clone(),
        node_name: cfg.node_name.clone(),
        node_uid: None,
        per_gpu: cfg.pool_per_gpu,
        pinned: BTreeMap::new(),
    };
    tokio::task::spawn_blocking(move || {
        let opts = ReadOptions {
            // Type ids, for the vGPU devices' attributes.
            mdev_types: sel != vgpu::Selector::none() || !parents.is_empty(),
            vf_identity: false,
        };
        let inv = Inventory::read_with(&paths, &opts).with_context(|| {
            format!(
                "cannot read the node's PCI devices under {}",
                paths.root().display()
            )
        })?;
        for u in &inv.unreadable {
            tracing::debug!(path = %u.path.display(), reason = %u.reason, "unreadable device skipped");
        }
        if let Err(e) = pool.grow(&paths, &inv, &sel) {
            // Published for passthrough only until a later pass succeeds.
            tracing::warn!(error = %format!("{e:#}"), "cannot add new GPUs to the vGPU pool");
        }
        // A GPU whose VFs a prepare could not enable is tainted until they are enabled (by the
        // retry of that claim, or by hand).
        for gpu in pool.without_vfs() {
            if inv.device(&gpu).and_then(|d| d.sriov_numvfs).is_some_and(|n| n > 0) {
                pool.note_vfs(gpu, true);
            }
        }
        let no_vfs = pool.without_vfs();
        let pool = pool.gpus();
        let aliases = vfio::load_aliases(&paths);
        let selector = Selector {
            vendors: vec![vendor],
            ..Selector::default()
        };
        let sel = select(&inv, &selector, None, &aliases);
        let mut out = slices::devices_with_vgpus(&inv, &sel, &ids, &pool);
        for p in &parents {
            if let Some((set, devices)) = slices::mdev_parent_devices(&inv, p) {
                out.counters.extend(set);
                out.devices.extend(devices);
            }
        }
        // A device a prepared claim holds stays published while its GPU is gone or the
        // configuration no longer offers it, tainted: the scheduler keeps counting it, and
        // places nothing new on it.
        let prepared = Prepared::read(&driver_dir, &layout, &out.devices);
        slices::taint(&mut out.devices, &driver, effect, &out.left_out, &no_vfs);
        prepared.taint_split(&mut out.devices, &driver);
        out.pinned = prepared.pinned;
        out.held = prepared
            .held
            .into_iter()
            .map(|(pool, mut d, gpu)| {
                let present = gpu.is_some_and(|g| inv.device(&g).is_some());
                let reason = if present { "not-offered" } else { "gone" };
                d.taints = Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
                    key: slices::taint_key(&driver),
                    value: Some(reason.into()),
                    effect: effect.as_str().to_string(),
                    time_added: None,
                }]);
                (pool, d)
            })
            .collect();
        out.devices.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    })
    .await
    .context("the node reader failed")?
}

/// What the claims prepared on this node hold, against the devices the node publishes now.
#[derive(Debug, Default)]
struct Prepared {
    /// The devices prepared claims hold that the node does not publish (their GPU is gone, or
    /// the configuration no longer offers them), as they were published: the pool their claims
    /// name, their names and attributes (from the claims' records), and the GPU each is or is
    /// part of.
    held: Vec<(String, Device, Option<common::PciAddress>)>,
    /// GPUs whose prepared claims were all allocated from one of the node's pools other than
    /// the one the layout gives them (`--pool-per-gpu` turned on or off under them): kept in
    /// that pool ([`Pool::pinned`]) while those claims are prepared.
    pinned: BTreeMap<common::PciAddress, String>,
    /// GPUs whose devices are published in another pool than the one a prepared claim's
    /// allocation names, even so: claims from two pools on one GPU (allocated while it moved),
    /// or from a pool it cannot be kept in.
    split: BTreeSet<common::PciAddress>,
}

/// The GPU device `name` is or is part of: from its name, or from its `parentGPU` attribute.
fn gpu_of(
    name: &str,
    attributes: &std::collections::BTreeMap<String, serde_json::Value>,
) -> Option<common::PciAddress> {
    crate::names::parse_gpu_device(name)
        .or_else(|| crate::names::parse_vgpu_device(name).map(|(gpu, _)| gpu))
        .or_else(|| {
            attributes
                .get("parentGPU")
                .and_then(|v| v.get("string"))
                .and_then(|v| v.as_str())
                .and_then(|g| g.parse().ok())
        })
}

impl Prepared {
    /// Reads the claims prepared on node `node` (in any of its pools) from the records under
    /// `driver_dir`, against `devices`, the devices the node publishes, in `layout`'s pools.
    fn read(driver_dir: &std::path::Path, layout: &Pool, devices: &[Device]) -> Prepared {
        let node = layout.node_name.as_str();
        let mut out = Prepared::default();
        // Each live device a prepared claim holds: the pool its allocation names, its GPU.
        let mut live = Vec::new();
        for d in crate::health::prepared_devices(driver_dir, node) {
            if let Some(device) = devices.iter().find(|x| x.name == d.device) {
                live.push((device, d.pool, gpu_of(&d.device, &d.attributes)));
                continue;
            }
            if out
                .held
                .iter()
                .any(|(pool, x, _)| *pool == d.pool && x.name == d.device)
            {
                continue;
            }
            let gpu = gpu_of(&d.device, &d.attributes);
            let attributes = d
                .attributes
                .into_iter()
                .filter_map(|(k, v)| Some((k, serde_json::from_value(v).ok()?)))
                .collect();
            out.held.push((
                d.pool,
                Device {
                    name: d.device,
                    attributes: Some(attributes),
                    ..Default::default()
                },
                gpu,
            ));
        }
        // A GPU whose claims all name one pool it can be in (the node's, or its own) stays there.
        let mut pools: BTreeMap<common::PciAddress, BTreeSet<&str>> = BTreeMap::new();
        for (device, pool, gpu) in &live {
            if let Some(gpu) = gpu
                && device.consumes_counters.is_some()
            {
                pools.entry(*gpu).or_default().insert(pool.as_str());
            }
        }
        for (gpu, named) in pools {
            if let [pool] = named.into_iter().collect::<Vec<_>>()[..]
                && pool != layout.layout_pool(Some(&gpu))
                && (pool == node || pool == crate::names::gpu_pool(node, &gpu))
            {
                out.pinned.insert(gpu, pool.to_string());
            }
        }
        let mut kept = layout.clone();
        kept.pinned.clone_from(&out.pinned);
        for (device, pool, gpu) in live {
            if kept.pool_of(device) != pool
                && let Some(gpu) = gpu
            {
                out.split.insert(gpu);
            }
        }
        out
    }

    /// Taints (`NoSchedule`, value `old-pool-claims`) every untainted device of each GPU of
    /// [`Prepared::split`]: the scheduler does not count some of its claims against the pool it
    /// is published in, so nothing new is placed on the GPU until they are gone. Never
    /// `NoExecute`: the claims are the GPU's own, and their VMs keep running.
    fn taint_split(&self, devices: &mut [Device], driver: &str) {
        if self.split.is_empty() {
            return;
        }
        for d in devices.iter_mut().filter(|d| d.taints.is_none()) {
            if slices::gpu_of(d).is_some_and(|g| self.split.contains(&g)) {
                d.taints = Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
                    key: slices::taint_key(driver),
                    value: Some("old-pool-claims".into()),
                    effect: slices::TaintEffect::NoSchedule.as_str().to_string(),
                    time_added: None,
                }]);
            }
        }
    }
}

/// What one write of the slices did.
#[derive(Debug, PartialEq, Eq)]
enum Written {
    /// They already said what the node has.
    Nothing,
    /// Slices were written as sent.
    Done,
    /// Slices were written, and the API server dropped these fields from them.
    Dropped(Vec<&'static str>),
}

/// What a pass made of the API server's slices.
#[derive(Debug, PartialEq, Eq)]
enum Published {
    /// The node's slices are not listed yet: the list's end starts a pass.
    Waiting,
    /// They already said what the node has.
    Unchanged,
    /// Slices were written (applied or deleted).
    Wrote,
}

/// The publisher's state between passes.
#[derive(Debug)]
struct Publisher {
    /// Writes go through the client whose every request is bounded.
    slices: Api<ResourceSlice>,
    cache: cache::Cache,
    /// Reads the Node (through the bounded client); records its container runtime.
    node: NodeReader,
    /// The Node as last read.
    node_facts: Option<NodeFacts>,
    /// The watch showed what a new Node brings: the next pass reads it before it writes.
    node_stale: bool,
    telemetry: std::sync::Arc<crate::telemetry::Telemetry>,
    pool: Pool,
    /// Each pool's generation last applied or adopted.
    generations: BTreeMap<String, i64>,
    /// The GPUs left out at the last pass, to log changes only.
    left_out: Vec<LeftOut>,
    /// Whether the API server keeps what a vGPU pool needs.
    support: support::Support,
    /// How many devices the slices say the node has, as last published or found.
    published: usize,
    /// The API server drops device taints: tainted devices are left out.
    taints_dropped: bool,
}

impl Publisher {
    /// Makes the API server's slices of this node and driver be the node's `devices` and
    /// `counters`, writing only what the cache says differs ([`plan`]). A vGPU pool is
    /// published only while the API server keeps what it needs ([`support`]): asked with a dry
    /// run before it is first written, and read back from every write; otherwise the node's
    /// GPUs are published whole only.
    async fn publish(
        &mut self,
        devices: Vec<Device>,
        counters: Vec<CounterSet>,
        held: Vec<(String, Device)>,
    ) -> anyhow::Result<Published> {
        if !self.cache.listed() {
            return Ok(Published::Waiting);
        }
        // A Node deleted and registered again has a new UID: a slice owned by the old one would
        // be deleted by the garbage collector each time it is put back.
        if self.node_stale || self.node_facts.is_none() {
            let read = self.node.read().await?;
            if let Some(was) = &self.node_facts
                && was.uid != read.uid
            {
                tracing::info!(
                    node = %self.node.name(),
                    uid = ?read.uid,
                    "the Node was registered again: its slices are written owned by its new UID"
                );
            }
            self.pool.node_uid = read.uid.clone();
            self.node_facts = Some(read);
            self.node_stale = false;
        }
        let pool = support::is_pool(&devices);
        if pool && self.support.needs_probe() {
            self.probe(&devices, &counters).await?;
        }
        let mut wrote = false;
        loop {
            let (mut devices, counters) = match self.support.dropped() {
                Some(_) if pool => (support::passthrough_only(devices.clone()), Vec::new()),
                _ => (devices.clone(), counters.clone()),
            };
            let mut held = held.clone();
            if self.taints_dropped {
                devices = support::untainted(devices);
                held.clear();
            }
            self.published = devices.len() + held.len();
            match self.write(devices, counters, held).await? {
                Written::Nothing => break,
                Written::Done => {
                    wrote = true;
                    break;
                }
                // What was stored is not what was sent: written again without what it drops.
                Written::Dropped(mut fields) => {
                    wrote = true;
                    if fields.contains(&support::TAINTS) && !self.taints_dropped {
                        self.taints_dropped = true;
                        tracing::error!(
                            "the API server drops device taints (DRADeviceTaints is off): a \
                             device that cannot serve a VM is left out of the slice instead"
                        );
                    }
                    fields.retain(|f| *f != support::TAINTS);
                    if !fields.is_empty() {
                        self.note_support(support::Support::Dropped {
                            fields,
                            at: std::time::Instant::now(),
                        });
                    } else if !self.taints_dropped {
                        break;
                    }
                }
            }
        }
        Ok(if wrote {
            Published::Wrote
        } else {
            Published::Unchanged
        })
    }

    /// Writes what differs between the cache and the slices of `devices` and `counters`.
    async fn write(
        &mut self,
        devices: Vec<Device>,
        counters: Vec<CounterSet>,
        held: Vec<(String, Device)>,
    ) -> anyhow::Result<Written> {
        let current = self.cache.slices();
        let wanted = self.pool.slices(devices, counters, held, 0);
        let plan = plan::plan(&current, wanted, &self.generations);
        if plan.is_empty() {
            self.generations = plan.generations;
            return Ok(Written::Nothing);
        }
        for (name, was) in &plan.delete {
            match self.slices.delete(name, &DeleteParams::default()).await {
                Ok(_) => {
                    self.telemetry.slice_written("delete");
                    tracing::info!(slice = %name, "deleted a stale ResourceSlice of this node");
                }
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("cannot delete ResourceSlice {name}"));
                }
            }
            self.cache.deleted(name, was.as_deref());
        }
        let mut names = Vec::new();
        let mut lost = Vec::new();
        for slice in plan.apply {
            let name = slice.metadata.name.clone().unwrap_or_default();
            let stored = self
                .slices
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&slice),
                )
                .await
                .with_context(|| format!("cannot apply ResourceSlice {name}"))?;
            self.telemetry.slice_written("apply");
            let pool = &slice.spec.pool;
            let at = self.generations.entry(pool.name.clone()).or_default();
            *at = (*at).max(pool.generation);
            for f in support::dropped(&slice, &stored) {
                if !lost.contains(&f) {
                    lost.push(f);
                }
            }
            self.cache.applied(stored);
            names.push(name);
        }
        if !names.is_empty() {
            tracing::info!(slices = ?names, "published the node's devices");
        }
        self.generations = plan.generations;
        Ok(if lost.is_empty() {
            Written::Done
        } else {
            Written::Dropped(lost)
        })
    }

    /// Asks the API server, with a dry run of the pool's first slice that needs them, whether
    /// it keeps what a pool needs; notes the answer.
    async fn probe(&mut self, devices: &[Device], counters: &[CounterSet]) -> anyhow::Result<()> {
        let wanted = self
            .pool
            .slices(devices.to_vec(), counters.to_vec(), Vec::new(), 1);
        let mut fields = Vec::new();
        for slice in wanted.iter().filter(|s| {
            support::is_pool(s.spec.devices.as_deref().unwrap_or_default())
                || s.spec.shared_counters.is_some()
        }) {
            let name = slice.metadata.name.clone().unwrap_or_default();
            let stored = self
                .slices
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force().dry_run(),
                    &Patch::Apply(slice),
                )
                .await
                .with_context(|| format!("cannot apply ResourceSlice {name} (dry run)"))?;
            fields = support::dropped(slice, &stored);
            // One slice of devices and one of counters tell it all.
            if !fields.is_empty() || slice.spec.devices.is_some() {
                break;
            }
        }
        self.note_support(if fields.is_empty() {
            support::Support::Kept
        } else {
            support::Support::Dropped {
                fields,
                at: std::time::Instant::now(),
            }
        });
        Ok(())
    }

    /// Records what the API server keeps; says so (log, Event, readiness) when that changes.
    fn note_support(&mut self, now: support::Support) {
        let was = std::mem::replace(&mut self.support, now);
        match (was.dropped(), self.support.dropped()) {
            (None, Some(fields)) => {
                let note = format!(
                    "the API server drops {} from the node's ResourceSlices (the feature is off): \
                     the vGPU pool (--vgpu) is not published, the node's GPUs are published whole \
                     only; turn the feature on (on by default from Kubernetes 1.36); asked again \
                     every {} minutes",
                    fields.join(", "),
                    support::REPROBE.as_secs() / 60
                );
                tracing::error!("{note}");
                self.telemetry.vgpu_pool_unsupported(Some(&note));
            }
            (Some(_), None) => {
                tracing::info!("the API server keeps what the vGPU pool needs: publishing it");
                self.telemetry.vgpu_pool_unsupported(None);
            }
            _ => {}
        }
    }

    /// Keeps the GPUs of `pinned` in the pools their prepared claims were allocated from
    /// ([`Pool::pinned`]); logs each GPU kept or let go.
    fn pin(&mut self, pinned: BTreeMap<common::PciAddress, String>) {
        if pinned == self.pool.pinned {
            return;
        }
        for (gpu, pool) in &pinned {
            if self.pool.pinned.get(gpu) != Some(pool) {
                tracing::info!(
                    %gpu,
                    pool = %pool,
                    layout = %self.pool.layout_pool(Some(gpu)),
                    "a GPU stays in the pool its prepared claims were allocated from, until they are unprepared"
                );
            }
        }
        for gpu in self.pool.pinned.keys().filter(|g| !pinned.contains_key(g)) {
            tracing::info!(
                %gpu,
                pool = %self.pool.layout_pool(Some(gpu)),
                "no prepared claim keeps a GPU in its earlier pool: it moves to the one the layout gives it"
            );
        }
        self.pool.pinned = pinned;
    }

    /// Logs the GPUs left out when that set changes.
    fn note_left_out(&mut self, left_out: Vec<LeftOut>) {
        if left_out != self.left_out {
            for l in &left_out {
                tracing::warn!(gpu = %l.address, reason = %l.reason, "GPU not published");
            }
            self.left_out = left_out;
        }
    }
}

/// How waiting on the API server ended.
#[derive(Debug)]
enum Waited<T> {
    Done(T),
    /// `bound` passed first.
    TimedOut(Duration),
    /// The process is stopping.
    Stopped,
}

/// Awaits `work` (requests to the API server) for at most `bound`, beating `telemetry`'s
/// liveness meanwhile: a loop that waits on the network with a bound is not stuck.
async fn wait_on_api<T>(
    work: impl std::future::Future<Output = T>,
    bound: Duration,
    telemetry: &crate::telemetry::Telemetry,
    shutdown: &CancellationToken,
) -> Waited<T> {
    tokio::pin!(work);
    let deadline = tokio::time::sleep(bound);
    tokio::pin!(deadline);
    let mut beats = tokio::time::interval(BEAT_WHILE_WAITING);
    beats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            r = &mut work => return Waited::Done(r),
            () = &mut deadline => return Waited::TimedOut(bound),
            () = shutdown.cancelled() => return Waited::Stopped,
            _ = beats.tick() => telemetry.beat(),
        }
    }
}

/// Whether slice event `ev`, another client's change, may come of the Node deleted and
/// registered again (its slices deleted by the garbage collector or by kubelet as it starts, one
/// owned by another UID than `uid`, a list anew that may have missed either), so that the Node
/// is read again before the next write.
fn node_news(ev: &Event<ResourceSlice>, uid: Option<&str>) -> bool {
    match ev {
        Event::InitDone | Event::Delete(_) => true,
        Event::Apply(s) => s
            .metadata
            .owner_references
            .iter()
            .flatten()
            .filter(|o| o.kind == "Node")
            .any(|o| Some(o.uid.as_str()) != uid),
        Event::Init | Event::InitApply(_) => false,
    }
}

/// Publishes the node's slices until `shutdown`; `registered` follows kubelet's registration.
/// Writes go through `client` (every request bounded by `--api-timeout`), the watch through
/// `watch_client` (a quiet watch is not a hung request: kube-runtime's watcher ends one that
/// says nothing, not even a bookmark, for longer than its timeout); the Node is read through
/// `client` when it matters. After each read of the node, `health` judges its devices for
/// kubelet ([`crate::health`]), whether or not the API server then takes the slice. Failures
/// are logged and retried, never fatal: the driver keeps serving prepared claims.
pub async fn run(
    client: kube::Client,
    watch_client: kube::Client,
    cfg: PublishConfig,
    paths: HostPaths,
    mut registered: watch::Receiver<Registered>,
    mut health: crate::health::Reporter,
    shutdown: CancellationToken,
) {
    let slice_fields = format!("spec.nodeName={},spec.driver={}", cfg.node_name, cfg.driver);
    let (slice_store, slice_writer) = reflector::store::<ResourceSlice>();
    let mut watched = reflector::reflector(
        slice_writer,
        watcher::watcher(
            Api::<ResourceSlice>::all(watch_client),
            watcher::Config::default()
                .fields(&slice_fields)
                .timeout(WATCH_TIMEOUT_SECS),
        )
        .default_backoff(),
    )
    .boxed();
    let node = NodeReader::new(
        client.clone(),
        &cfg.node_name,
        cfg.api_timeout,
        cfg.runtime.clone(),
        cfg.telemetry.clone(),
    );
    let mut p = Publisher {
        slices: Api::all(client),
        cache: cache::Cache::new(slice_store),
        node,
        node_facts: None,
        node_stale: true,
        telemetry: cfg.telemetry.clone(),
        pool: Pool {
            driver: cfg.driver.clone(),
            node_name: cfg.node_name.clone(),
            node_uid: None,
            per_gpu: cfg.pool_per_gpu,
            pinned: BTreeMap::new(),
        },
        generations: BTreeMap::new(),
        left_out: Vec::new(),
        support: support::Support::default(),
        published: 0,
        taints_dropped: false,
    };
    let settings = Settings::new("sandbox-dra")
        .with_resync(cfg.resync_interval)
        .with_retry(RETRY_MIN, RETRY_MAX);
    let (mut trigger, changes) = Trigger::<Change>::new(settings);
    // Listens until dropped, at the end of this function.
    let uevents = changes.clone();
    let _monitor = Monitor::start(SUBSYSTEMS, move |ev| uevents.send(Change::Uevent(ev)))
        .inspect_err(|e| {
            tracing::warn!(error = %e, "no uevents: the slice follows the node at the resync interval only")
        })
        .ok();
    let mut registration_open = true;
    let mut watching = true;
    let pass_timeout = cfg.pass_timeout();
    let vfs_changed = cfg.vgpu_pool.changed();
    // The last pass failed on a refusal by the API server: resyncs wait for its retry.
    let mut refused = false;
    loop {
        cfg.telemetry.beat();
        let wake = tokio::select! {
            w = trigger.wait(&shutdown) => match w {
                Some(w) => w,
                None => break,
            },
            () = vfs_changed.notified() => {
                changes.send(Change::Vfs);
                continue;
            }
            changed = registered.changed(), if registration_open => {
                if changed.is_err() {
                    registration_open = false;
                } else if *registered.borrow_and_update() == Registered::Yes {
                    changes.send(Change::Registered);
                }
                continue;
            }
            ev = watched.next(), if watching => {
                match ev {
                    Some(Ok(ev)) => {
                        if p.cache.slice_event(&ev) {
                            let uid = p.pool.node_uid.as_deref();
                            p.node_stale |= node_news(&ev, uid);
                            changes.send(Change::Slices);
                        }
                    }
                    Some(Err(e)) => tracing::warn!(
                        error = %e,
                        fields = %slice_fields,
                        "cannot list or watch the node's ResourceSlices"
                    ),
                    // kube-runtime's watcher does not end.
                    None => watching = false,
                }
                continue;
            }
        };
        for c in &wake.changes {
            match c {
                Change::Uevent(ev) => {
                    tracing::debug!(action = %ev.action, subject = ?ev.subject, "change seen")
                }
                Change::Registered => {
                    tracing::debug!("kubelet registered the driver; checking the slice")
                }
                Change::Slices => {
                    tracing::debug!("the node's slices changed in the API server; checking them")
                }
                Change::Vfs => {
                    tracing::debug!(
                        "a pooled GPU's VFs could or could not be enabled; checking the slices"
                    )
                }
            }
        }
        // A resync tick while a refused write waits for its retry: the node and its health only.
        let held =
            refused && trigger.retrying() && wake.changes.is_empty() && !wake.retry && !wake.first;
        let outcome = match read_devices(&cfg, &paths).await {
            Ok(nd) => {
                p.pin(nd.pinned);
                let published = nd
                    .devices
                    .iter()
                    .map(|d| (p.pool.pool_of(d), d.name.clone()))
                    .chain(nd.held.iter().map(|(p, d)| (p.clone(), d.name.clone())))
                    .collect();
                health.report(&paths, published, &nd.left_out).await;
                p.note_left_out(nd.left_out);
                if held {
                    tracing::debug!(
                        "a resync while a refused write waits for its retry: nothing written"
                    );
                    continue;
                }
                let publishing = p.publish(nd.devices, nd.counters, nd.held);
                match wait_on_api(publishing, pass_timeout, &cfg.telemetry, &shutdown).await {
                    Waited::Done(r) => r.map(|r| (p.published, r)),
                    Waited::TimedOut(t) => Err(anyhow::anyhow!(
                        "the API server did not take the node's slices within {t:?} (what it took stays; the next pass goes on)"
                    )),
                    Waited::Stopped => break,
                }
            }
            Err(e) => Err(e),
        };
        match outcome {
            Ok((_, Published::Waiting)) => {
                cfg.telemetry.pass("waiting");
                tracing::debug!("the node's slices are not listed yet; publishing once they are");
                trigger.done();
            }
            Ok((published, done)) => {
                cfg.telemetry.pass(if done == Published::Wrote {
                    "written"
                } else {
                    "unchanged"
                });
                let usable = *registered.borrow() == Registered::Yes;
                cfg.telemetry.published(published, usable);
                trigger.done();
            }
            Err(e) => {
                cfg.telemetry.pass("failed");
                cfg.telemetry.publish_failed();
                refused = answered(&e);
                let retry_in = trigger.retry();
                tracing::error!(error = %format!("{e:#}"), ?retry_in, "cannot publish the node's ResourceSlice");
            }
        }
    }
}

/// Whether a pass failed on the API server's answer (a refusal, no such Node), not on its
/// absence.
fn answered(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref::<kube::Error>(), Some(kube::Error::Api(_)))
        || e.downcast_ref::<crate::node::Error>()
            .is_some_and(crate::node::Error::answered)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn telemetry() -> crate::telemetry::Telemetry {
        crate::telemetry::Telemetry::new(
            daemon_kit::ops::Ops::new(),
            daemon_kit::events::NodeEvents::disabled(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_pass_waits_on_the_api_server_at_most_its_bound() {
        let t = telemetry();
        let stop = CancellationToken::new();
        let bound = Duration::from_secs(30);
        let start = tokio::time::Instant::now();
        let hung = wait_on_api(std::future::pending::<()>(), bound, &t, &stop).await;
        assert!(
            matches!(hung, Waited::TimedOut(b) if b == bound),
            "{hung:?}"
        );
        assert_eq!(start.elapsed(), bound);
        let slow = async {
            tokio::time::sleep(Duration::from_secs(29)).await;
            7
        };
        assert!(matches!(
            wait_on_api(slow, bound, &t, &stop).await,
            Waited::Done(7)
        ));
        stop.cancel();
        let stopped = wait_on_api(std::future::pending::<()>(), bound, &t, &stop).await;
        assert!(matches!(stopped, Waited::Stopped), "{stopped:?}");
    }

    fn owned_by(uid: &str) -> ResourceSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n-d", "resourceVersion": "5", "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": "n", "uid": uid}
            ]},
            "spec": {"driver": "d", "nodeName": "n", "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1}}
        }))
        .unwrap()
    }

    #[test]
    fn the_node_is_read_again_when_its_slices_go_or_name_another_uid() {
        let uid = Some("u1");
        // Another client's edit that keeps the owner: the UID known still holds.
        assert!(!node_news(&Event::Apply(owned_by("u1")), uid));
        // Owned by another UID, deleted (the garbage collector, kubelet's wipe), listed anew.
        assert!(node_news(&Event::Apply(owned_by("u2")), uid));
        assert!(node_news(&Event::Delete(owned_by("u1")), uid));
        assert!(node_news(&Event::InitDone, uid));
        // A list's objects: its end says it.
        assert!(!node_news(&Event::InitApply(owned_by("u2")), uid));
        assert!(!node_news(&Event::Init, uid));
    }

    #[test]
    fn no_such_node_is_an_answer_like_a_refusal() {
        let missing = anyhow::Error::from(crate::node::Error::Missing { node: "n".into() });
        assert!(answered(&missing));
        let late = anyhow::Error::from(crate::node::Error::Timeout {
            node: "n".into(),
            after: Duration::from_secs(1),
        });
        assert!(!answered(&late));
        let forbidden = kube::Error::Api(
            kube::core::Status::failure("forbidden", "Forbidden")
                .with_code(403)
                .boxed(),
        );
        assert!(answered(
            &anyhow::Error::from(forbidden).context("cannot apply ResourceSlice n-d")
        ));
        assert!(!answered(&anyhow::anyhow!("the node reader failed")));
    }

    #[test]
    fn a_pass_waits_at_most_the_longer_of_the_resync_and_one_request() {
        let cfg = |resync, api| PublishConfig {
            driver: "d".into(),
            node_name: "n".into(),
            vendor: 0x10de,
            pci_ids: PciIds::embedded(),
            resync_interval: Duration::from_secs(resync),
            api_timeout: Duration::from_secs(api),
            telemetry: std::sync::Arc::new(telemetry()),
            runtime: std::sync::Arc::default(),
            vgpu: vgpu::Selector::none(),
            vgpu_pool: vgpu::Pool::new(Default::default()),
            mdev_parents: BTreeSet::new(),
            taint_effect: Default::default(),
            pool_per_gpu: false,
            driver_dir: Default::default(),
        };
        assert_eq!(cfg(30, 10).pass_timeout(), Duration::from_secs(30));
        assert_eq!(cfg(1, 10).pass_timeout(), Duration::from_secs(11));
    }
}
