//! Device health for kubelet: the `DRAResourceHealth` service (kubelet's dra-health
//! `v1alpha1`) on the driver's `DRAPlugin` socket. kubelet (ResourceHealthStatus, beta and on by
//! default in 1.36) opens one `NodeWatchResources` stream per driver and shows what it receives
//! in the status of every pod whose claim holds the device:
//! `status.containerStatuses[].allocatedResourcesStatus[]` (`name: claim:<claim>/<request>`,
//! `resources[]: {resourceID: <the device's first CDI id>, health: Healthy|Unhealthy|Unknown}`).
//!
//! The stream sends the health of every device the driver answers for at once, then again after
//! every pass of the ResourceSlice publisher ([`crate::publish`]: at start, on each uevent that
//! can change the node — a driver bound or unbound, a device or mdev added or removed, a VFIO
//! group node appearing or going — and every `--resync-interval`). Each message is the complete
//! list, as kubelet expects. A device is:
//!
//! - **Unhealthy** when a prepared claim holds it and it cannot serve the claim's VM: a whole GPU
//!   no longer on a VFIO driver (`vfio-pci` or a variant), or gone from the node, or another
//!   function of its IOMMU group (its audio function) taken by a host driver; a vGPU whose mdev
//!   or vendor-path VF vGPU is gone; any device whose `/dev/vfio/<group>` node is gone;
//! - **Unhealthy** when the slice publishes it with a taint (it cannot serve a VM: a group that
//!   cannot go to VFIO, a missing group node; the reason in the message);
//! - **Unhealthy** when it was published and is not any more (hot-removed, the reason in the
//!   message), until it comes back; at most [`MAX_GONE`] are kept;
//! - **Healthy** otherwise: every device the slice publishes.
//!
//! kubelet stamps what it receives with its own clock and reads a device as Unknown once
//! `health_check_timeout_seconds` pass without news; the timeout sent is three resync intervals
//! (at least 30 s), so a driver whose loop stopped turns its devices Unknown rather than leaving
//! them Healthy. A stream that ends (the driver stopped) makes kubelet forget the driver's health
//! at once (Unknown).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{HostPaths, Inventory, ReadOptions, is_vfio_driver};
use futures::Stream;
use kubelet_api::dra_health::v1alpha1::dra_resource_health_server::DraResourceHealth;
use kubelet_api::dra_health::v1alpha1::{
    DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
    NodeWatchResourcesResponse,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::cdi::ClaimDevice;
use crate::names;
use crate::record::{self, ClaimState};
use crate::slices::LeftOut;

pub use kubelet_api::dra_health::v1alpha1::dra_resource_health_server::DraResourceHealthServer;

/// The service name kubelet's registration lists it by (`<package>.<service>`).
pub const SERVICE: &str = "v1alpha1.DRAResourceHealth";

/// The most devices remembered as removed.
pub const MAX_GONE: usize = 1024;

/// The least timeout sent to kubelet (its own default).
const MIN_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest message kubelet keeps.
const MAX_MESSAGE: usize = 1024;

/// The timeout sent with each device for a publisher that wakes every `resync`.
pub fn timeout_for(resync: Duration) -> Duration {
    resync.saturating_mul(3).max(MIN_TIMEOUT)
}

/// One device's health as judged here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It can serve a VM.
    Healthy,
    /// It cannot, and why.
    Unhealthy(String),
}

/// What judging the node needs to know about it.
#[derive(Debug)]
pub struct Seen<'a> {
    /// The node.
    pub inv: &'a Inventory,
    /// The names of the devices the slice publishes now.
    pub published: &'a BTreeSet<String>,
    /// The GPUs left out of the slice, and why.
    pub left_out: &'a [LeftOut],
    /// The devices of the claims prepared on this node (this pool's only).
    pub prepared: &'a [ClaimDevice],
}

/// Why a prepared device cannot serve its VM, or `None` when it can.
pub fn prepared_fault(inv: &Inventory, d: &ClaimDevice) -> Option<String> {
    if let Some(m) = &d.mdev {
        if !inv.mdevs.contains_key(&m.uuid.to_ascii_lowercase()) {
            return Some(format!("mdev {} on {} is gone", m.uuid, m.parent));
        }
    } else if let Some(v) = &d.vgpu {
        match &v.handle {
            common::vgpu::lifecycle::Handle::Mdev(uuid) => {
                if !inv.mdevs.contains_key(&uuid.to_ascii_lowercase()) {
                    return Some(format!(
                        "the {} vGPU (mdev {uuid}) of {} is gone",
                        v.type_name, v.gpu
                    ));
                }
            }
            common::vgpu::lifecycle::Handle::Vf(vf) => {
                let current = inv
                    .device(vf)
                    .and_then(|f| f.nvidia_vgpu.as_ref())
                    .map_or(0, |n| n.current);
                if current == 0 {
                    return Some(format!(
                        "the {} vGPU on VF {vf} of {} is gone",
                        v.type_name, v.gpu
                    ));
                }
            }
        }
    } else if let Some(a) = d.address {
        let Some(gpu) = inv.device(&a) else {
            return Some(format!("{a} is gone from the node"));
        };
        match gpu.driver.as_deref() {
            Some(drv) if is_vfio_driver(drv) => {}
            Some(drv) => return Some(format!("{a} is on {drv}, not on its VFIO driver")),
            None => return Some(format!("{a} is on no driver, not on its VFIO driver")),
        }
        // The group goes to the VM whole: the kernel refuses it while a member other than a
        // bridge is on a host driver.
        for m in inv.group_members(d.group) {
            let Some(f) = inv.device(&m).filter(|f| f.address != a && !f.is_bridge()) else {
                continue;
            };
            if let Some(drv) = f.driver.as_deref().filter(|x| !group_safe_driver(x)) {
                return Some(format!(
                    "{m}, in the IOMMU group of {a}, is on {drv}: the group cannot go to a VM"
                ));
            }
        }
    }
    if !inv.vfio_nodes.contains(&d.group) {
        let of = match (&d.mdev, &d.vgpu, d.address) {
            (Some(m), _, _) => format!("mdev {}", m.uuid),
            (_, Some(v), _) => format!("the {} vGPU {} of {}", v.type_name, v.handle, v.gpu),
            (_, _, Some(a)) => a.to_string(),
            (None, None, None) => d.device.clone(),
        };
        return Some(format!(
            "{} (the IOMMU group of {of}) is gone",
            common::paths::host_vfio_group_path(d.group)
        ));
    }
    None
}

/// Whether a function on `driver` leaves its IOMMU group usable by VFIO (the kernel's own
/// list: VFIO drivers and `pci-stub`).
fn group_safe_driver(driver: &str) -> bool {
    is_vfio_driver(driver) || driver == "pci-stub"
}

/// The health of every device the node answers for: the published ones, those prepared claims
/// hold, and those `gone` (published once, not now: name → why, updated here).
pub fn judge(seen: &Seen<'_>, gone: &mut Gone) -> BTreeMap<String, Verdict> {
    let mut out: BTreeMap<String, Verdict> = seen
        .published
        .iter()
        .map(|n| (n.clone(), Verdict::Healthy))
        .collect();
    // Published with a taint: unusable, and why.
    for l in seen.left_out {
        let name = names::gpu_device(&l.address);
        if seen.published.contains(&name) {
            out.insert(name, Verdict::Unhealthy(l.reason.clone()));
        }
    }
    for d in seen.prepared {
        if let Some(why) = prepared_fault(seen.inv, d) {
            out.insert(d.device.clone(), Verdict::Unhealthy(why));
        }
    }
    gone.update(seen.published, seen.left_out);
    for (name, why) in gone.iter() {
        out.entry(name.clone())
            .or_insert_with(|| Verdict::Unhealthy(why.clone()));
    }
    out
}

/// Devices published once and not now, oldest first, at most [`MAX_GONE`].
#[derive(Debug, Default)]
pub struct Gone {
    /// Published at the last pass.
    last: BTreeSet<String>,
    gone: VecDeque<(String, String)>,
}

impl Gone {
    fn update(&mut self, published: &BTreeSet<String>, left_out: &[LeftOut]) {
        self.gone.retain(|(n, _)| !published.contains(n));
        let reasons: BTreeMap<String, &str> = left_out
            .iter()
            .map(|l| (names::gpu_device(&l.address), l.reason.as_str()))
            .collect();
        for n in self.last.difference(published) {
            let why = reasons.get(n).map_or_else(
                || format!("{n} is no longer on the node"),
                |r| r.to_string(),
            );
            self.gone.retain(|(g, _)| g != n);
            self.gone.push_back((n.clone(), why));
        }
        while self.gone.len() > MAX_GONE {
            self.gone.pop_front();
        }
        self.last = published.clone();
    }

    fn iter(&self) -> impl Iterator<Item = &(String, String)> {
        self.gone.iter()
    }
}

/// Judges the node after each publisher pass and hands the result to the streams.
#[derive(Debug)]
pub struct Reporter {
    tx: watch::Sender<Option<Arc<NodeWatchResourcesResponse>>>,
    /// The node's name: its own pool, and the prefix of its GPUs' pools.
    node: String,
    /// The pool each device reported was last published in.
    pools: BTreeMap<String, String>,
    /// `<kubelet-root>/plugins/<driver>` as this process reaches it (the claim records).
    driver_dir: PathBuf,
    timeout: Duration,
    gone: Gone,
    last: BTreeMap<String, Verdict>,
}

/// The reporter and the service it feeds; the service's streams end at `shutdown`.
pub fn channel(
    node: String,
    driver_dir: PathBuf,
    timeout: Duration,
    shutdown: CancellationToken,
) -> (Reporter, Service) {
    let (tx, rx) = watch::channel(None);
    (
        Reporter {
            tx,
            node,
            pools: BTreeMap::new(),
            driver_dir,
            timeout,
            gone: Gone::default(),
            last: BTreeMap::new(),
        },
        Service { rx, shutdown },
    )
}

/// The devices of the claims prepared on node `node`, in any of its pools
/// ([`names::is_node_pool`]); a record that cannot be read is skipped.
pub fn prepared_devices(driver_dir: &std::path::Path, node: &str) -> Vec<ClaimDevice> {
    let mut out = Vec::new();
    for p in record::list(driver_dir) {
        match record::load_path(&p) {
            Ok(Some(r)) if r.state == ClaimState::Prepared => {
                out.extend(
                    r.devices
                        .into_iter()
                        .filter(|d| names::is_node_pool(node, &d.pool)),
                );
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "claim record skipped for health"),
        }
    }
    out
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

fn cut(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE - 3;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

impl Reporter {
    /// Judges the node now that the publisher read it: `published` the slices' devices (pool,
    /// name), `left_out` the GPUs they left out. Sends the complete list to every stream (also
    /// when nothing changed: kubelet's timeout counts from the last message). A device is
    /// reported in the pool it is published in, and in each pool a prepared claim's allocation
    /// names it in.
    pub async fn report(
        &mut self,
        paths: &HostPaths,
        published: Vec<(String, String)>,
        left_out: &[LeftOut],
    ) {
        let (paths, driver_dir, pool) = (paths.clone(), self.driver_dir.clone(), self.node.clone());
        let read = tokio::task::spawn_blocking(move || {
            let opts = ReadOptions {
                mdev_types: false,
                vf_identity: false,
            };
            let inv = Inventory::read_with(&paths, &opts)?;
            Ok::<_, common::Error>((inv, prepared_devices(&driver_dir, &pool)))
        })
        .await;
        let (inv, prepared) = match read {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "cannot read the node for device health; kept the last");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the device-health reader failed; kept the last");
                return;
            }
        };
        let mut names = BTreeSet::new();
        for (pool, name) in published {
            self.pools.insert(name.clone(), pool);
            names.insert(name);
        }
        let published = names;
        let verdicts = judge(
            &Seen {
                inv: &inv,
                published: &published,
                left_out,
                prepared: &prepared,
            },
            &mut self.gone,
        );
        for (name, v) in &verdicts {
            if self.last.get(name) == Some(v) {
                continue;
            }
            match v {
                Verdict::Unhealthy(why) => {
                    tracing::warn!(device = %name, reason = %why, "device unhealthy")
                }
                Verdict::Healthy if self.last.contains_key(name) => {
                    tracing::info!(device = %name, "device healthy again")
                }
                Verdict::Healthy => {}
            }
        }
        let now = unix_now();
        let timeout = i64::try_from(self.timeout.as_secs()).unwrap_or(i64::MAX);
        self.pools.retain(|name, _| verdicts.contains_key(name));
        let mut devices = Vec::new();
        for (name, v) in &verdicts {
            let (health, message) = match v {
                Verdict::Healthy => (HealthStatus::Healthy, String::new()),
                Verdict::Unhealthy(why) => (HealthStatus::Unhealthy, cut(why.clone())),
            };
            let mut pools: BTreeSet<&str> = prepared
                .iter()
                .filter(|d| d.device == *name)
                .map(|d| d.pool.as_str())
                .collect();
            match self.pools.get(name) {
                Some(p) => {
                    pools.insert(p);
                }
                None if pools.is_empty() => {
                    pools.insert(&self.node);
                }
                None => {}
            }
            for pool in pools {
                devices.push(DeviceHealth {
                    device: Some(DeviceIdentifier {
                        pool_name: pool.to_string(),
                        device_name: name.clone(),
                    }),
                    health: health.into(),
                    last_updated_time: now,
                    health_check_timeout_seconds: timeout,
                    message: message.clone(),
                });
            }
        }
        self.last = verdicts;
        self.tx
            .send_replace(Some(Arc::new(NodeWatchResourcesResponse { devices })));
    }
}

/// The `DRAResourceHealth` service: each `NodeWatchResources` stream sends the last report at
/// once (when there is one) and every report after it, until the driver stops.
#[derive(Clone, Debug)]
pub struct Service {
    rx: watch::Receiver<Option<Arc<NodeWatchResourcesResponse>>>,
    shutdown: CancellationToken,
}

/// A stream of health reports.
pub type Reports = Pin<Box<dyn Stream<Item = Result<NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DraResourceHealth for Service {
    type NodeWatchResourcesStream = Reports;

    async fn node_watch_resources(
        &self,
        _: Request<NodeWatchResourcesRequest>,
    ) -> Result<Response<Reports>, Status> {
        tracing::debug!("kubelet opened the device-health stream");
        let mut rx = self.rx.clone();
        // The current report goes first.
        rx.mark_changed();
        let stream = futures::stream::unfold(
            (rx, self.shutdown.clone()),
            |(mut rx, shutdown)| async move {
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        r = rx.changed() => if r.is_err() { return None },
                    }
                    let report = rx.borrow_and_update().clone();
                    if let Some(r) = report {
                        return Some((Ok(NodeWatchResourcesResponse::clone(&r)), (rx, shutdown)));
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    fn gone_names(g: &Gone) -> Vec<&str> {
        g.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn the_timeout_outlasts_three_resyncs_and_kubelets_default() {
        assert_eq!(
            timeout_for(Duration::from_secs(30)),
            Duration::from_secs(90)
        );
        assert_eq!(timeout_for(Duration::from_secs(5)), Duration::from_secs(30));
        assert_eq!(timeout_for(Duration::MAX), Duration::MAX);
    }

    #[test]
    fn a_device_no_longer_published_stays_unhealthy_until_it_is_back() {
        let mut g = Gone::default();
        let a: common::PciAddress = "0000:41:00.0".parse().unwrap();
        g.update(&set(&["gpu-0000-41-00-0", "gpu-0000-61-00-0"]), &[]);
        assert!(gone_names(&g).is_empty());
        // 61 removed, 41 left out with a reason.
        let left = [LeftOut {
            address: a,
            code: "group-not-assignable",
            reason: "/dev/vfio/21 is missing".to_string(),
        }];
        g.update(&set(&[]), &left);
        let why: BTreeMap<&str, &str> = g.iter().map(|(n, w)| (n.as_str(), w.as_str())).collect();
        assert_eq!(why["gpu-0000-41-00-0"], "/dev/vfio/21 is missing");
        assert!(why["gpu-0000-61-00-0"].contains("no longer on the node"));
        // Still gone at the next pass; 41 back.
        g.update(&set(&["gpu-0000-41-00-0"]), &[]);
        assert_eq!(gone_names(&g), vec!["gpu-0000-61-00-0"]);
    }

    #[test]
    fn at_most_max_gone_are_remembered_the_oldest_dropped() {
        let mut g = Gone::default();
        let all: Vec<String> = (0..MAX_GONE + 5).map(|i| format!("d{i}")).collect();
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        g.update(&set(&refs), &[]);
        g.update(&set(&[]), &[]);
        assert_eq!(g.iter().count(), MAX_GONE);
        assert!(!gone_names(&g).contains(&"d0"));
    }

    #[test]
    fn long_messages_are_cut_as_kubelet_would() {
        let m = cut("é".repeat(600));
        assert!(m.len() <= MAX_MESSAGE && m.ends_with("..."), "{}", m.len());
        assert_eq!(cut("short".into()), "short");
    }
}
