//! sandbox-dp: the kubelet device plugin for passthrough GPUs and vGPUs, compatible with the
//! resource names and env vars of NVIDIA's kubevirt-gpu-device-plugin.
//!
//! [`run`] reads the node once ([`common::Inventory`]), builds the resources ([`discovery`]),
//! and for each resource serves the device-plugin API on `<kubelet-dir>/sandbox-dp-<name>.sock`
//! ([`plugin`]) and registers it with kubelet. It keeps the inventory and follows the node event
//! by event ([`events`]): a uevent re-reads only the device it names (with its VFs and mdevs),
//! a `/dev/vfio/<group>` change flips that group's health without reading any device; what no
//! device explains, and a slow resync, read the whole node again ([`daemon_kit::reconcile`]: a
//! bounded queue of changes, a read that fails retried with backoff). Each change (a short
//! debounce gathers bursts) rebuilds the resources from the inventory in memory and pushes
//! changed device lists to ListAndWatch through each resource's `watch` channel.

pub mod alloc;
pub mod discovery;
pub mod events;
mod manager;
pub mod metrics;
pub mod ondemand;
pub mod plugin;
pub mod report;
pub mod resource;

/// The kubelet device-plugin API `v1beta1`.
pub use kubelet_api::deviceplugin::v1beta1 as api;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use common::{HostPaths, Inventory, PciAddress, ReadOptions};
use daemon_kit::exit;
use daemon_kit::ops::{Ops, liveness_window};
use daemon_kit::reconcile::{Changes, Settings, Trigger};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::alloc::DevNodes;
use crate::discovery::{DiscoverConfig, Snapshot};
use crate::events::Pending;
use crate::manager::Manager;
use crate::metrics::Metrics;

/// The daemon's configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// The kubelet plugin directory.
    pub kubelet_dir: PathBuf,
    /// Discovery settings.
    pub discover: DiscoverConfig,
    /// Where to serve Prometheus metrics.
    pub metrics_addr: Option<SocketAddr>,
    /// Re-read the node this often even without events.
    pub resync_interval: Duration,
    /// The shortest time between two event-driven reads of devices. The first event after a
    /// quiet spell is read at once; a burst (twelve mdevs created, a driver's remove and add)
    /// costs at most one read per interval, its last event included. Group-node checks do not
    /// count.
    pub debounce: Duration,
    /// With `--on-demand`: how often kubelet's PodResources `List` is asked which on-demand
    /// vGPUs pods still hold.
    pub on_demand_poll: Duration,
    /// This node's name, for Node events about on-demand vGPUs (none without it).
    pub node_name: Option<String>,
    /// A kubeconfig for those events; in-cluster config when absent.
    pub kubeconfig: Option<PathBuf>,
}

/// What sandbox-dp reads of the node. Instances carry their type name; the parents' type lists
/// (dozens per VF) are not needed. A vGPU VF's identity is its GPU's; a VF passed through on
/// its own is read in full.
const READ_OPTIONS: ReadOptions = ReadOptions {
    mdev_types: false,
    vf_identity: false,
};

/// The first delay before a failed read of the node is tried again; it doubles up to the
/// resync interval.
const RETRY_MIN: Duration = Duration::from_secs(1);

/// The most devices read again on the daemon's own thread, rather than on the blocking pool.
const INLINE_READS: usize = 4;

/// [`READ_OPTIONS`], or with an on-demand pool the mdev types too (what is left to create).
fn read_options(cfg: &DiscoverConfig) -> ReadOptions {
    match cfg.pool {
        Some(_) => ondemand::READ_OPTIONS,
        None => READ_OPTIONS,
    }
}

/// One read of the node: inventory → resources, plus the iommufd device nodes.
pub fn read_node(paths: &HostPaths, cfg: &DiscoverConfig) -> anyhow::Result<(Snapshot, DevNodes)> {
    let view = NodeView::read(paths, &read_options(cfg))?;
    Ok((discovery::discover(&view.inv, cfg), view.inv.dev_nodes))
}

/// The node as the daemon keeps it between events.
#[derive(Debug, Default)]
struct NodeView {
    inv: Inventory,
}

impl NodeView {
    fn read(paths: &HostPaths, opts: &ReadOptions) -> anyhow::Result<NodeView> {
        let inv = Inventory::read_with(paths, opts)
            .with_context(|| format!("reading the node under {}", paths.root().display()))?;
        for u in &inv.unreadable {
            tracing::debug!(path = %u.path.display(), reason = %u.reason, "unreadable");
        }
        Ok(NodeView { inv })
    }

    /// Reads again what `pending` names: the whole node, or only the devices, group nodes and
    /// iommufd nodes events named.
    fn update(
        &mut self,
        paths: &HostPaths,
        opts: &ReadOptions,
        pending: &Pending,
    ) -> anyhow::Result<()> {
        if pending.node {
            *self = NodeView::read(paths, opts)?;
            return Ok(());
        }
        for a in &pending.pci {
            self.inv.refresh_pci(paths, *a, opts);
        }
        for u in &pending.mdevs {
            let parent_of = |inv: &Inventory| {
                let m = inv.mdevs.get(&u.to_ascii_lowercase());
                m.map(|m| m.parent.clone())
            };
            let before = parent_of(&self.inv);
            self.inv.refresh_mdev(paths, u);
            if opts.mdev_types {
                let after = parent_of(&self.inv);
                for p in before.into_iter().chain(after) {
                    self.refresh_virtual_parent_types(paths, &p);
                }
            }
        }
        for g in &pending.groups {
            self.inv.refresh_vfio_node(paths, *g);
        }
        if pending.dev_nodes {
            self.inv.refresh_dev_nodes(paths);
        }
        Ok(())
    }

    /// Re-reads the types of a non-PCI mdev parent (`mtty`): an mdev made or removed on it
    /// changed their `available_instances`. A PCI parent's are read with its function.
    fn refresh_virtual_parent_types(&mut self, paths: &HostPaths, parent: &str) {
        let Some(p) = self.inv.mdev_parents.get_mut(parent) else {
            return;
        };
        if p.pci.is_some() {
            return;
        }
        match common::inventory::read_parent_mdev_types(paths, parent) {
            Ok(types) => p.types = types,
            Err(e) => tracing::debug!(parent, error = %e, "cannot read the mdev parent's types"),
        }
    }

    /// [`NodeView::update`], then the resources. A read of the whole node, of more than
    /// [`INLINE_READS`] devices or of a function with VFs runs on the blocking pool; a group
    /// node's check (one `stat`), a few devices an event named (a few dozen small reads each)
    /// and the rebuild in memory run here, without two thread hops.
    async fn update_async(
        &mut self,
        paths: &HostPaths,
        cfg: &DiscoverConfig,
        pending: Pending,
    ) -> anyhow::Result<Rebuilt> {
        let opts = read_options(cfg);
        // A function with VFs is read with all of them: that goes to the pool, as does an
        // on-demand pool's read (every type of every VF).
        let few = !pending.node
            && cfg.pool.is_none()
            && pending.pci.len() + pending.mdevs.len() <= INLINE_READS
            && pending
                .pci
                .iter()
                .all(|a| self.inv.devices.get(a).is_none_or(|d| d.virtfns.is_empty()));
        if !pending.reads_devices() || few {
            // VFs alone, and no vGPU type the refresh could name on other VFs: the resources
            // may be patched rather than rebuilt ([`Manager::patch_vfs`]).
            let vfs_only = !pending.pci.is_empty()
                && pending.mdevs.is_empty()
                && !pending.node
                && !pending.dev_nodes
                && !self.inv.devices.values().any(|d| {
                    d.nvidia_vgpu
                        .as_ref()
                        .is_some_and(|v| v.current != 0 && v.current_name.is_none())
                });
            self.update(paths, &opts, &pending)?;
            if vfs_only {
                return Ok(Rebuilt::Vfs {
                    vfs: pending.pci,
                    groups: pending.groups,
                });
            }
            return Ok(Rebuilt::Whole(discovery::discover(&self.inv, cfg)));
        }
        let mut view = std::mem::take(self);
        let (p, c) = (paths.clone(), cfg.clone());
        let done = tokio::task::spawn_blocking(move || {
            let res = view.update(&p, &opts, &pending);
            let snap = discovery::discover(&view.inv, &c);
            (view, res.map(|()| snap))
        })
        .await;
        match done {
            Ok((view, res)) => {
                *self = view;
                res.map(Rebuilt::Whole)
            }
            // The view went with the task: the next update must read the whole node.
            Err(e) => Err(anyhow::Error::new(e).context("inventory task")),
        }
    }
}

/// What a read of the node gives the manager.
enum Rebuilt {
    /// The resources, discovered anew.
    Whole(Snapshot),
    /// Only these VFs were read again, and these group nodes checked: the VFs' devices may be
    /// patched in place, and the groups' health flipped.
    Vfs {
        vfs: BTreeSet<PciAddress>,
        groups: BTreeSet<u32>,
    },
}

/// Runs the device plugin until `shutdown`; returns an error (exit 1) when any of its tasks
/// fails.
pub async fn run(config: Config, paths: HostPaths, shutdown: CancellationToken) -> exit::Result {
    tracing::info!(
        host_root = %paths.root().display(),
        kubelet_dir = %config.kubelet_dir.display(),
        "starting"
    );
    // An on-demand pool counts its creations in the daemon's metrics.
    let metrics: Arc<Metrics> = config
        .discover
        .pool
        .as_ref()
        .map(|p| p.metrics())
        .unwrap_or_default();
    // Only the on-demand pool changes the node; its creations, removals and refusals are told
    // on the Node, and the API server is asked whether a pod kubelet no longer lists still
    // runs here before its vGPU goes.
    if let Some(pool) = &config.discover.pool {
        match config.node_name.as_deref() {
            Some(node) => match daemon_kit::kube::client(config.kubeconfig.as_deref()).await {
                Ok(client) => {
                    pool.set_events(daemon_kit::events::NodeEvents::start(
                        client.clone(),
                        node,
                        "sandbox-dp",
                    ));
                    pool.set_pods_api(daemon_kit::kube::NodePods::new(client, node));
                }
                Err(e) => tracing::warn!(
                    node,
                    error = format!("{e:#}"),
                    "no Kubernetes client: no events on the node, and a vGPU goes once \
                     kubelet's PodResources no longer lists its pod"
                ),
            },
            None => pool.set_events(daemon_kit::events::NodeEvents::disabled()),
        }
    }
    common::state::ensure_dir(&config.kubelet_dir).map_err(anyhow::Error::new)?;
    // The node is read before the loop: no first pass. A read that fails is tried again with
    // backoff, at least as often as the resync.
    let settings = Settings::new("sandbox-dp")
        .with_resync(config.resync_interval)
        .with_settle(Duration::ZERO)
        .with_retry(RETRY_MIN, config.resync_interval)
        .without_first_pass();
    let (mut trigger, changes) = Trigger::<events::Change>::new(settings);
    // The uevent monitor and the file watches listen before the node is read, so no change
    // after the read goes unseen.
    let _uevents = events::listen_uevents(changes.clone());
    let (wake_tx, _) = watch::channel(0u64);
    let wake = Arc::new(wake_tx);
    let kubelet_generation = Arc::new(AtomicU64::new(0));
    let on_file = {
        let (changes, wake, kubelet_generation) =
            (changes.clone(), wake.clone(), kubelet_generation.clone());
        move |ev| match ev {
            events::FileEvent::PluginDir { kubelet } => {
                if kubelet {
                    kubelet_generation.fetch_add(1, Ordering::SeqCst);
                }
                wake.send_modify(|c| *c += 1);
            }
            events::FileEvent::Dev(c) => {
                changes.send(c);
            }
            events::FileEvent::Lost => {
                changes.lost();
            }
        }
    };
    let mut files = events::FileWatch::start(
        &config.kubelet_dir,
        &paths.dev(),
        &paths.dev_vfio(),
        on_file,
    )?;

    // The on-demand pool is this process's while it runs: the hold goes when it ends.
    let _pool_hold = match config.discover.pool.clone() {
        Some(pool) => Some(
            tokio::task::spawn_blocking(move || pool.start())
                .await
                .context("on-demand pool task")?
                .context("starting the on-demand pool")?,
        ),
        None => None,
    };
    // The first read runs here: nothing is served yet that it could hold up, and a thread of
    // the blocking pool would only add its start to the registration.
    let mut view = NodeView::read(&paths, &read_options(&config.discover))?;
    let snap = discovery::discover(&view.inv, &config.discover);
    let mut tasks: JoinSet<anyhow::Result<()>> = JoinSet::new();
    let task_stop = shutdown.child_token();
    let ops = Ops::new();
    metrics.register(&ops);
    // The loop wakes at least every resync; a read that hangs for far longer is a wedge.
    ops.expect_beats(liveness_window(config.resync_interval));
    if let Some(addr) = config.metrics_addr {
        tasks.spawn(ops.clone().serve(addr, task_stop.clone()));
    }
    // Ready once every resource of the first read has registered with kubelet.
    let first_resources: Vec<String> = snap.resources.keys().cloned().collect();
    let (m, o, stop) = (metrics.clone(), ops.clone(), task_stop.clone());
    tasks.spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = m.all_registered(&first_resources) => o.ready(&format!(
                "advertising {} resources to kubelet",
                first_resources.len()
            )),
        }
        // Parks until shutdown: a task that ends early reads as a failure.
        stop.cancelled().await;
        Ok(())
    });
    if let Some(pool) = config.discover.pool.clone() {
        tasks.spawn(release_loop(
            pool,
            config.on_demand_poll,
            changes.clone(),
            task_stop.clone(),
        ));
    }
    let mut mgr = Manager {
        config: config.clone(),
        metrics,
        resources: BTreeMap::new(),
        reported: BTreeSet::new(),
        wake: wake.clone(),
        kubelet_generation: kubelet_generation.clone(),
        shutdown: task_stop.clone(),
    };
    if snap.resources.is_empty() {
        tracing::info!("no devices to advertise yet; watching for them");
    }
    mgr.apply(snap, view.inv.dev_nodes.clone(), &mut tasks);
    // Serving: systemd may start kubelet (its unit is ordered before kubelet's).
    ops.systemd_ready(&format!(
        "serving {} resources; waiting for kubelet's registration",
        mgr.resources.len()
    ));

    let mut last_read = tokio::time::Instant::now();
    let mut pending = Pending::default();
    let result = loop {
        ops.beat();
        let woken = tokio::select! {
            w = trigger.wait(&shutdown) => match w {
                Some(w) => w,
                None => break Ok(()),
            },
            Some(done) = tasks.join_next() => {
                let err = match done {
                    Ok(Ok(())) if shutdown.is_cancelled() => break Ok(()),
                    Ok(Ok(())) => anyhow::anyhow!("a task stopped unexpectedly"),
                    Ok(Err(e)) => e,
                    Err(e) => anyhow::Error::new(e).context("a task panicked"),
                };
                break Err(err);
            }
        };
        pending.absorb(woken, &wake);
        // A directory that came or went is watched again.
        files.refresh();
        if pending.is_empty() {
            continue;
        }
        // Checking group nodes is never delayed; reading devices is debounced.
        if pending.reads_devices() {
            tokio::time::sleep_until(last_read + config.debounce).await;
            pending.absorb(trigger.take_queued(), &wake);
        }
        let work = std::mem::take(&mut pending);
        // Only reads of devices count for the debounce: a group node's check costs a `stat`,
        // and the uevent that often follows it (a vGPU removed: its node goes, then its VF's
        // event comes) is read at once.
        if work.reads_devices() {
            last_read = tokio::time::Instant::now();
        }
        tracing::debug!(?work, "reading again");
        if work.only_group_nodes() {
            // A group node came or went: its devices' health follows it, nothing else changes.
            if let Err(e) = view.update(&paths, &read_options(&config.discover), &work) {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "cannot check the group nodes; reading the node"
                );
                pending.node = true;
                trigger.retry();
                continue;
            }
            trigger.done();
            let changed =
                mgr.set_group_health(&work.groups, &view.inv.vfio_nodes, &view.inv.dev_nodes);
            if !changed.is_empty() {
                // The woken ListAndWatch streams send first; the log line and the metrics
                // follow.
                tokio::task::yield_now().await;
                mgr.report_health(changed);
            }
            continue;
        }
        match view.update_async(&paths, &config.discover, work).await {
            Ok(Rebuilt::Whole(snap)) => mgr.apply(snap, view.inv.dev_nodes.clone(), &mut tasks),
            Ok(Rebuilt::Vfs { vfs, groups }) => match mgr.patch_vfs(&view.inv, &vfs) {
                Some(mut changes) => {
                    if !groups.is_empty() {
                        changes.extend(mgr.set_group_health(
                            &groups,
                            &view.inv.vfio_nodes,
                            &view.inv.dev_nodes,
                        ));
                    }
                    if !changes.is_empty() {
                        tokio::task::yield_now().await;
                        mgr.report_health(changes);
                    }
                }
                None => mgr.apply(
                    discovery::discover(&view.inv, &config.discover),
                    view.inv.dev_nodes.clone(),
                    &mut tasks,
                ),
            },
            Err(e) => {
                let retry_in = trigger.retry();
                tracing::warn!(
                    error = format!("{e:#}"),
                    ?retry_in,
                    "cannot re-read the node; keeping the last state and reading it all next time"
                );
                pending.node = true;
                continue;
            }
        }
        trigger.done();
    };
    task_stop.cancel();
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = format!("{e:#}"), "task ended with an error"),
            Err(e) => tracing::warn!(error = %e, "task failed"),
        }
    }
    Ok(result?)
}

/// Every `poll`, removes the on-demand vGPUs no pod holds ([`ondemand::Pool::reconcile`]); the
/// GPUs and parents whose records changed are read again, so their slots come back to the lists even when
/// no uevent came (a record whose vGPU a crash left uncreated).
async fn release_loop(
    pool: Arc<ondemand::Pool>,
    poll: Duration,
    changes: Changes<events::Change>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        let p = pool.clone();
        let changed = tokio::task::spawn_blocking(move || p.reconcile())
            .await
            .context("on-demand release task")?;
        for member in changed {
            // A non-PCI parent has no function to read again: the node is.
            changes.send(match member {
                ondemand::Member::Gpu(gpu) => events::Change::Pci(gpu),
                ondemand::Member::Parent(_) => events::Change::Node,
            });
        }
    }
}
