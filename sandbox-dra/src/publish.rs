//! Keeps the node's ResourceSlices ([`crate::slices`]) true in the API server: one slice, or
//! with a vGPU pool (`--vgpu`) the counter sets in a slice of their own and the devices in
//! slices of at most 64 ([`slices::Pool::slices`]).
//!
//! A pass reads the node, builds the slices and compares them with the slices of this node
//! and driver the API server holds (one list): when they differ (or one is gone) it deletes
//! those it no longer publishes and applies the others (server-side apply, field manager
//! `sandbox-dra`, forced: this driver alone writes its node's slices) with the pool's
//! generation one above the highest seen, so the scheduler takes them over any older copy;
//! when they are equal it writes nothing. A pass runs at start, on every uevent that can
//! change what is published (a GPU hot-plugged or removed, a driver bound or unbound, a VFIO
//! group node appearing or going), when kubelet (re)registers the driver (kubelet deletes the
//! node's slices when it starts and when a driver unregisters), and every
//! `--resync-interval` ([`daemon_kit::reconcile`]: a burst of events is one pass). A pass that
//! fails (the API server unreachable, a refusal) is retried after a backoff with jitter, 1 s
//! doubling to 30 s.
//!
//! Cleaning up:
//! - slices of this driver on this node other than those this process publishes (a renamed
//!   node, an older naming, the vGPU pool's slices once `--vgpu` is gone) are deleted;
//! - the slice carries an owner reference to its Node (with the Node's UID), so Kubernetes'
//!   garbage collector deletes it when the Node object is deleted;
//! - kubelet deletes the node's slices of a driver that unregistered (its registration socket
//!   gone) and did not come back within its grace period, and all of the node's slices when it
//!   starts; this process therefore leaves its slice in place when it stops (a rollout's
//!   replacement finds it and keeps the generation).

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context as _;
use common::uevent::{Monitor, Uevent};
use common::vfio::{self, Selector, select};
use common::{HostPaths, Inventory, PciIds, ReadOptions};
use daemon_kit::reconcile::{Settings, Trigger};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{CounterSet, Device, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::registration::Registered;
use crate::slices::{self, LeftOut, NodeDevices, Pool};
use crate::vgpu;

/// The field manager of the driver's writes.
pub const FIELD_MANAGER: &str = "sandbox-dra";

/// Uevent subsystems whose events can change the slice or a device's health (events without
/// one count too): `mdev` for a prepared vGPU removed behind the driver's back.
const SUBSYSTEMS: &[&str] = &["pci", "vfio", "iommu", "drivers", "mdev"];

/// The first and the longest delay before a failed pass is tried again.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// What asks the publisher to compare the slices with the node again.
#[derive(Debug)]
enum Change {
    /// A uevent that can change what is published.
    Uevent(Uevent),
    /// A claim was prepared or unprepared: its vGPUs change what their GPU may offer.
    Claims,
    /// kubelet registered the driver: it deletes the node's slices when it starts.
    Registered,
}

/// What the publisher needs besides the client and the host paths.
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
    /// How often to compare with the API server without an event.
    pub resync_interval: Duration,
    /// Where passes are counted, and readiness told.
    pub telemetry: std::sync::Arc<crate::telemetry::Telemetry>,
    /// Where the node's container runtime is recorded, for prepare to refuse what it could not
    /// hand to a pod.
    pub runtime: std::sync::Arc<crate::runtime::RuntimeCheck>,
    /// Which GPUs are published with vGPU devices (`--vgpu`), for those that appear.
    pub vgpu: vgpu::Selector,
    /// The GPUs published with vGPU devices; a GPU `vgpu` selects that appears joins it.
    pub vgpu_pool: vgpu::Pool,
    /// The mdev parents that are not PCI functions published with their types (`--vgpu mtty`).
    pub mdev_parents: BTreeSet<String>,
}

/// Reads the node's devices (on a blocking thread: sysfs reads): the display functions of
/// `vendor`; a GPU `vgpu` selects that is not in `vgpu_pool` yet (hot-plugged) joins it
/// ([`vgpu::Pool::grow`]); the GPUs of `vgpu_pool` get their counter sets and vGPU devices,
/// the `mdev_parents` theirs ([`slices::mdev_parent_devices`]).
pub async fn read_devices(
    paths: &HostPaths,
    vendor: u16,
    ids: &PciIds,
    vgpu: &vgpu::Selector,
    vgpu_pool: &vgpu::Pool,
    mdev_parents: &BTreeSet<String>,
) -> anyhow::Result<NodeDevices> {
    let (paths, ids, sel, pool) = (paths.clone(), ids.clone(), vgpu.clone(), vgpu_pool.clone());
    let parents = mdev_parents.clone();
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
        out.devices.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    })
    .await
    .context("the node reader failed")?
}

/// The publisher's state between passes.
#[derive(Debug)]
struct Publisher {
    slices: Api<ResourceSlice>,
    nodes: Api<Node>,
    runtime: std::sync::Arc<crate::runtime::RuntimeCheck>,
    telemetry: std::sync::Arc<crate::telemetry::Telemetry>,
    pool: Pool,
    /// The pool generation last applied or adopted.
    generation: i64,
    /// The GPUs left out at the last pass, to log changes only.
    left_out: Vec<LeftOut>,
}

/// A slice's spec with the generation left out, to compare what it says.
fn content(
    s: &ResourceSlice,
) -> (
    Option<&str>,
    ResourceSliceSpec,
    Option<&Vec<OwnerReference>>,
) {
    let mut spec = s.spec.clone();
    spec.pool.generation = 0;
    (
        s.metadata.name.as_deref(),
        spec,
        s.metadata.owner_references.as_ref(),
    )
}

impl Publisher {
    /// Makes the API server's slices of this node and driver be the node's `devices` and
    /// `counters`: when they differ, slices of this node and driver not among them are deleted
    /// and the rest written, all at a new pool generation; returns whether it wrote.
    async fn publish(
        &mut self,
        devices: Vec<Device>,
        counters: Vec<CounterSet>,
    ) -> anyhow::Result<bool> {
        // Read every pass: a Node deleted and registered again has a new UID, and a slice
        // owned by the old one would be deleted by the garbage collector each time it is put
        // back.
        let node = self
            .nodes
            .get(&self.pool.node_name)
            .await
            .with_context(|| format!("cannot read Node {}", self.pool.node_name))?;
        self.pool.node_uid = node.metadata.uid;
        let runtime = node
            .status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .map(|i| i.container_runtime_version.as_str())
            .unwrap_or_default();
        if !runtime.is_empty()
            && let Some(cdi) = self.runtime.observe(runtime)
        {
            self.telemetry.runtime(&cdi);
        }
        let fields = format!(
            "spec.nodeName={},spec.driver={}",
            self.pool.node_name, self.pool.driver
        );
        let mut current = self
            .slices
            .list(&ListParams::default().fields(&fields))
            .await
            .with_context(|| format!("cannot list ResourceSlices ({fields})"))?
            .items;
        current.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let mut wanted = self.pool.slices(devices, counters, 0);
        wanted.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let gens: BTreeSet<i64> = current.iter().map(|c| c.spec.pool.generation).collect();
        let seen = gens.iter().copied().max().unwrap_or(0);
        let same = gens.len() == 1
            && current.len() == wanted.len()
            && current
                .iter()
                .zip(&wanted)
                .all(|(c, w)| content(c) == content(w));
        if same {
            self.generation = seen;
            return Ok(false);
        }
        let generation = seen.max(self.generation) + 1;
        let names: Vec<String> = wanted
            .iter()
            .filter_map(|w| w.metadata.name.clone())
            .collect();
        for s in &current {
            let Some(other) = s.metadata.name.as_deref() else {
                continue;
            };
            if names.iter().any(|n| n == other) {
                continue;
            }
            match self.slices.delete(other, &DeleteParams::default()).await {
                Ok(_) => {
                    tracing::info!(slice = other, "deleted a stale ResourceSlice of this node")
                }
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("cannot delete ResourceSlice {other}"));
                }
            }
        }
        for mut slice in wanted {
            slice.spec.pool.generation = generation;
            let name = slice.metadata.name.clone().unwrap_or_default();
            self.slices
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&slice),
                )
                .await
                .with_context(|| format!("cannot apply ResourceSlice {name}"))?;
        }
        tracing::info!(
            slices = ?names,
            generation,
            "published the node's devices"
        );
        self.generation = generation;
        Ok(true)
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

/// Publishes the node's slice until `shutdown`; `registered` follows kubelet's registration.
/// After each read of the node, `health` judges its devices for kubelet ([`crate::health`]),
/// whether or not the API server then takes the slice. Failures are logged and retried, never
/// fatal: the driver keeps serving prepared claims.
pub async fn run(
    client: kube::Client,
    cfg: PublishConfig,
    paths: HostPaths,
    mut registered: watch::Receiver<Registered>,
    mut health: crate::health::Reporter,
    shutdown: CancellationToken,
) {
    let mut p = Publisher {
        slices: Api::all(client.clone()),
        nodes: Api::all(client),
        runtime: cfg.runtime.clone(),
        telemetry: cfg.telemetry.clone(),
        pool: Pool {
            driver: cfg.driver.clone(),
            node_name: cfg.node_name.clone(),
            node_uid: None,
        },
        generation: 0,
        left_out: Vec::new(),
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
    // A prepare or unprepare changes which sizes a GPU may offer: the scheduler should see it
    // before the next claim, without waiting for the vGPU's uevent.
    let claims_changed = cfg.telemetry.claims_changed();
    loop {
        cfg.telemetry.beat();
        let wake = tokio::select! {
            w = trigger.wait(&shutdown) => match w {
                Some(w) => w,
                None => break,
            },
            () = claims_changed.notified() => {
                changes.send(Change::Claims);
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
        };
        for c in &wake.changes {
            match c {
                Change::Uevent(ev) => {
                    tracing::debug!(action = %ev.action, subject = ?ev.subject, "change seen")
                }
                Change::Registered => {
                    tracing::debug!("kubelet registered the driver; checking the slice")
                }
                Change::Claims => {
                    tracing::debug!("a claim was prepared or unprepared; checking the slice")
                }
            }
        }
        let outcome = match read_devices(
            &paths,
            cfg.vendor,
            &cfg.pci_ids,
            &cfg.vgpu,
            &cfg.vgpu_pool,
            &cfg.mdev_parents,
        )
        .await
        {
            Ok(nd) => {
                let names = nd.devices.iter().map(|d| d.name.clone()).collect();
                health.report(&paths, names, &nd.left_out).await;
                p.note_left_out(nd.left_out);
                let published = nd.devices.len();
                p.publish(nd.devices, nd.counters).await.map(|_| published)
            }
            Err(e) => Err(e),
        };
        match outcome {
            Ok(published) => {
                cfg.telemetry.published(published);
                trigger.done();
            }
            Err(e) => {
                cfg.telemetry.publish_failed();
                let retry_in = trigger.retry();
                tracing::error!(error = %format!("{e:#}"), ?retry_in, "cannot publish the node's ResourceSlice");
            }
        }
    }
}
