//! Preparing and unpreparing claims: the allocated GPU and its whole IOMMU group on a VFIO
//! driver, a CDI spec naming its device nodes, and the device-metadata file KubeVirt reads
//! ([`crate::cdi`]).
//!
//! **Prepare**, in this order (each step converges when repeated):
//! 1. the claim: from the [`record`] when there is one, else from the API server (its UID must
//!    be the one kubelet names; its allocation's results of this driver in this node's pool,
//!    each device name mapped to its GPU by [`names::parse_gpu_device`]);
//! 2. the node: each GPU must be here, its group hold nothing but GPU functions (a NIC in it is
//!    refused), and no function that is to move may be in use (a process holding it, its VFs
//!    or vGPUs, or a source that cannot be read) — the first refusal fails the claim with
//!    nothing changed;
//! 3. the record (claim, devices, each function's current driver) — before the first bind;
//! 4. the binds ([`vfio::bind_all`], as vfio-manager's; a function already bound is not written);
//! 5. the metadata files, the CDI spec, and the record marked prepared — each written only
//!    when it differs, so a repeated prepare writes nothing.
//!
//! **Unprepare** marks the record, removes the CDI spec and the metadata, destroys the claim's
//! vGPUs and mdevs, then by [`OnUnprepare`] leaves the groups on their VFIO driver or gives
//! each function back to the driver it had (refused, naming the holder, while the group is in
//! use), and removes the record last. A claim with no
//! record is already unprepared.
//!
//! **At start** ([`Preparer::reconcile`]) every record is brought back in line with the node:
//! a prepare that did not finish is undone (its devices never reached a container), an
//! unprepare that did not finish is finished, a finished prepare is prepared again (a GPU
//! someone unbound is bound again, a lost file rewritten).
//!
//! This module holds the steps every kind shares (the record, the files, what kubelet is
//! answered); the flows are its children: `claim` (the allocation read from the API server),
//! `passthrough` (whole GPUs bound and given back), `vgpus` (vGPUs of the pooled GPUs),
//! `mdevs` (mdevs of non-PCI parents), `unprepare` and `reconcile`.

mod claim;
mod mdevs;
mod passthrough;
mod reconcile;
mod unprepare;
mod vgpus;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::vfio::OpOptions;
use common::{HostPaths, Inventory, PciAddress, error_chain, state};
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::cdi::{self, ClaimDevice, ClaimId, Layout};
use crate::names;
use crate::record::{self, ClaimState, Record};

pub use claim::{Wanted, allocated};

/// One claim kubelet names: namespace, name and UID of the ResourceClaim.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The claim's UID.
    pub uid: String,
}

impl fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// A device prepared for a claim, as kubelet is told about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The claim's requests it serves.
    pub requests: Vec<String>,
    /// Its pool (the node's).
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// The CDI device ids the runtime injects.
    pub cdi_ids: Vec<String>,
}

/// What unprepare does with a claim's GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnUnprepare {
    /// Leave the groups on their VFIO driver, ready for the next claim.
    Keep,
    /// Give every function back to the driver it had before the first prepare.
    Restore,
}

/// Why a claim was not prepared or unprepared. Every message names the claim.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The API server did not give the claim.
    #[error("claim {claim}: cannot read it from the API server")]
    Api {
        /// The claim.
        claim: ClaimRef,
        /// Why.
        #[source]
        source: Box<kube::Error>,
    },
    /// The claim or the node refuses it; nothing was changed unless the reason says so.
    #[error("claim {claim}: {reason}")]
    Refused {
        /// The claim.
        claim: ClaimRef,
        /// Why, naming the device (and who holds it).
        reason: String,
    },
    /// A file of the driver's could not be written or read.
    #[error("claim {claim}: {what}")]
    State {
        /// The claim.
        claim: ClaimRef,
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Everything preparing needs besides the API server.
#[derive(Clone, Debug)]
pub struct PrepareConfig {
    /// The driver's name.
    pub driver: String,
    /// This node's name: the pool the claims' devices come from.
    pub node_name: String,
    /// Where files go, as the host names them.
    pub layout: Layout,
    /// What unprepare does with the GPUs.
    pub on_unprepare: OnUnprepare,
    /// The most one function's bind or unbind may take.
    pub timeout: Duration,
    /// The GPUs whose vGPUs are published (`--vgpu`).
    pub vgpu_pool: BTreeSet<PciAddress>,
    /// The mdev parents that are not PCI functions whose types are published (`--vgpu mtty`).
    pub mdev_parents: BTreeSet<String>,
}

/// Prepares and unprepares the claims of this node, one at a time.
pub struct Preparer {
    node: Arc<Node>,
    client: kube::Client,
    lock: tokio::sync::Mutex<()>,
}

impl fmt::Debug for Preparer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Preparer")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl Preparer {
    /// A preparer reading claims through `client`.
    pub fn new(config: PrepareConfig, paths: HostPaths, client: kube::Client) -> Self {
        Preparer {
            node: Arc::new(Node { config, paths }),
            client,
            lock: tokio::sync::Mutex::new(()),
        }
    }

    /// Prepares `claim`: idempotent, kubelet calls again after a failure or a restart.
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        let _one_at_a_time = self.lock.lock().await;
        if !record::valid_uid(&claim.uid) {
            return Err(refused(
                claim,
                format!("{:?} is not a claim UID", claim.uid),
            ));
        }
        let existing = self.node.load(claim)?;
        let (id, wanted) = match &existing {
            Some(r) => (
                r.claim.clone(),
                r.devices.iter().map(Wanted::from).collect(),
            ),
            None => self.read_claim(claim).await?,
        };
        let node = self.node.clone();
        let c = claim.clone();
        blocking(claim, move || node.prepare(&c, id, wanted, existing)).await
    }

    /// Unprepares `claim`: idempotent, a claim never prepared is already unprepared.
    pub async fn unprepare(&self, claim: &ClaimRef) -> Result<(), PrepareError> {
        let _one_at_a_time = self.lock.lock().await;
        if !record::valid_uid(&claim.uid) {
            return Err(refused(
                claim,
                format!("{:?} is not a claim UID", claim.uid),
            ));
        }
        let node = self.node.clone();
        let c = claim.clone();
        blocking(claim, move || {
            let rec = node.load(&c)?;
            node.unprepare(&c, rec, node.config.on_unprepare)
        })
        .await
    }

    /// Brings every record in line with the node (at start, before kubelet is served): an
    /// unfinished prepare is undone, a finished one prepared again. Failures are logged; the
    /// record stays for kubelet's next call.
    pub async fn reconcile(&self) {
        let _one_at_a_time = self.lock.lock().await;
        let node = self.node.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || node.reconcile()).await {
            tracing::error!(error = %e, "reconciling the claims' records failed");
        }
    }

    /// Reads the claim from the API server: its identity and the GPUs allocated to it here.
    async fn read_claim(&self, claim: &ClaimRef) -> Result<(ClaimId, Vec<Wanted>), PrepareError> {
        let api: kube::Api<ResourceClaim> =
            kube::Api::namespaced(self.client.clone(), &claim.namespace);
        let rc = match api.get(&claim.name).await {
            Ok(rc) => rc,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                return Err(refused(
                    claim,
                    "the API server has no such ResourceClaim (deleted?)".into(),
                ));
            }
            Err(source) => {
                return Err(PrepareError::Api {
                    claim: claim.clone(),
                    source: Box::new(source),
                });
            }
        };
        allocated(&self.node.config, claim, &rc)
    }
}

/// Runs `f` on a blocking thread (sysfs writes wait on the kernel).
async fn blocking<T: Send + 'static>(
    claim: &ClaimRef,
    f: impl FnOnce() -> Result<T, PrepareError> + Send + 'static,
) -> Result<T, PrepareError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(PrepareError::State {
            claim: claim.clone(),
            what: "the worker preparing it failed".into(),
            source: Box::new(e),
        }),
    }
}

fn refused(claim: &ClaimRef, reason: String) -> PrepareError {
    PrepareError::Refused {
        claim: claim.clone(),
        reason,
    }
}

/// The node side of preparing: sysfs and the driver's files.
#[derive(Debug)]
struct Node {
    config: PrepareConfig,
    paths: HostPaths,
}

impl Node {
    /// A host path as this process reaches it.
    fn local(&self, host: &Path) -> PathBuf {
        self.paths
            .root()
            .join(host.strip_prefix("/").unwrap_or(host))
    }

    fn driver_dir(&self) -> PathBuf {
        self.local(&self.config.layout.driver_dir)
    }

    fn state_err(
        claim: &ClaimRef,
        what: String,
    ) -> impl FnOnce(common::Error) -> PrepareError + '_ {
        move |e| PrepareError::State {
            claim: claim.clone(),
            what,
            source: Box::new(e),
        }
    }

    fn load(&self, claim: &ClaimRef) -> Result<Option<Record>, PrepareError> {
        let p = record::path(&self.driver_dir(), &claim.uid);
        record::load_path(&p).map_err(|e| PrepareError::State {
            claim: claim.clone(),
            what: format!("cannot read its record {}", p.display()),
            source: Box::new(e),
        })
    }

    fn inventory(&self, claim: &ClaimRef) -> Result<Inventory, PrepareError> {
        Inventory::read(&self.paths).map_err(|e| {
            refused(
                claim,
                format!("cannot read the node's PCI devices: {}", error_chain(&e)),
            )
        })
    }

    fn op_options(&self) -> OpOptions {
        OpOptions {
            timeout: self.config.timeout,
            force: false,
        }
    }

    /// Prepares a claim: whole GPUs, vGPUs or mdevs, one kind per claim.
    fn prepare(
        &self,
        claim: &ClaimRef,
        id: ClaimId,
        wanted: Vec<Wanted>,
        existing: Option<Record>,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        let vgpus = wanted
            .iter()
            .filter(|w| names::parse_vgpu_device(&w.device).is_some())
            .count();
        let mdevs = wanted
            .iter()
            .filter(|w| names::parse_mdev_device(&w.device, &self.config.mdev_parents).is_some())
            .count();
        if vgpus == wanted.len() {
            return self.prepare_vgpus(claim, id, wanted, existing);
        }
        if mdevs == wanted.len() {
            return self.prepare_mdevs(claim, id, wanted, existing);
        }
        if vgpus + mdevs > 0 {
            return Err(refused(
                claim,
                "it asks for devices of more than one kind together (whole GPUs, vGPUs, mdevs \
                 of other parents); this driver prepares one kind per claim (use a claim per \
                 kind); nothing was changed"
                    .into(),
            ));
        }
        self.prepare_gpus(claim, id, wanted, existing)
    }

    /// The last steps of every prepare: the files written, the record marked prepared and
    /// saved; what kubelet is answered.
    fn finish(
        &self,
        claim: &ClaimRef,
        mut rec: Record,
        rec_path: &Path,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        self.write_files(claim, &rec)?;
        rec.state = ClaimState::Prepared;
        record::write_if_changed(rec_path, &rec.to_bytes())
            .map_err(Self::state_err(claim, "cannot save its record".into()))?;
        let layout = &self.config.layout;
        Ok(rec
            .devices
            .iter()
            .map(|d| PreparedDevice {
                requests: d.requests.clone(),
                pool: d.pool.clone(),
                device: d.device.clone(),
                cdi_ids: layout.cdi_ids(&rec.claim, d),
            })
            .collect())
    }

    /// The record of a claim of vGPUs or mdevs before anything is made for it.
    fn new_record(&self, id: ClaimId, wanted: &[Wanted]) -> Record {
        Record {
            claim: id,
            state: ClaimState::Preparing,
            devices: wanted
                .iter()
                .map(|w| ClaimDevice {
                    requests: w.requests.clone(),
                    pool: self.config.node_name.clone(),
                    device: w.device.clone(),
                    address: w.address,
                    group: 0,
                    nodes: Vec::new(),
                    vgpu: None,
                    mdev: None,
                })
                .collect(),
            originals: BTreeMap::new(),
        }
    }

    /// The metadata files, then the CDI spec that mounts them.
    fn write_files(&self, claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
        let layout = &self.config.layout;
        for r in cdi::requests_of(&rec.devices) {
            let host = layout.metadata_file(&rec.claim, &r);
            let json = layout.metadata_json(&rec.claim, &r, &rec.devices);
            write_json(&self.local(&host), &json).map_err(Self::state_err(
                claim,
                format!("cannot write its device metadata {}", host.display()),
            ))?;
        }
        let host = layout.cdi_spec(&claim.uid);
        let json = layout.cdi_spec_json(&rec.claim, &rec.devices);
        write_json(&self.local(&host), &json).map_err(Self::state_err(
            claim,
            format!("cannot write its CDI spec {}", host.display()),
        ))?;
        Ok(())
    }

    fn remove_files(&self, claim: &ClaimRef, rec: Option<&Record>) -> Result<(), PrepareError> {
        let layout = &self.config.layout;
        let spec = layout.cdi_spec(&claim.uid);
        state::remove_if_present(&self.local(&spec)).map_err(Self::state_err(
            claim,
            format!("cannot remove its CDI spec {}", spec.display()),
        ))?;
        if let Some(rec) = rec {
            let dir = layout.metadata_dir(&rec.claim);
            match std::fs::remove_dir_all(self.local(&dir)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(PrepareError::State {
                        claim: claim.clone(),
                        what: format!("cannot remove its device metadata {}", dir.display()),
                        source: Box::new(e),
                    });
                }
            }
        }
        Ok(())
    }
}

/// The host paths of the VFIO nodes a container needs for `d`: the container and its group,
/// plus `/dev/iommu` and the GPU's cdev where the kernel has them (as sandbox-dp hands out).
fn device_nodes(inv: &Inventory, d: &ClaimDevice) -> Vec<String> {
    let cdev = d
        .address
        .and_then(|a| inv.device(&a))
        .and_then(|p| p.vfio_cdev.clone())
        .filter(|c| inv.dev_nodes.cdevs.contains(c));
    vfio_nodes(inv, d.group, cdev)
}

/// The host paths of the VFIO nodes of IOMMU group `group`: the container and the group, plus
/// `/dev/iommu` and `cdev` where the kernel has them.
fn vfio_nodes(inv: &Inventory, group: u32, cdev: Option<String>) -> Vec<String> {
    let mut nodes = vec![
        common::paths::HOST_VFIO_CONTAINER.to_string(),
        common::host_vfio_group_path(group),
    ];
    if let (true, Some(c)) = (inv.dev_nodes.iommufd, cdev) {
        nodes.push(common::paths::HOST_IOMMUFD.to_string());
        nodes.push(common::paths::host_vfio_cdev_path(&c));
    }
    nodes
}

fn write_json(p: &Path, v: &serde_json::Value) -> common::Result<bool> {
    let mut bytes = serde_json::to_vec_pretty(v).unwrap_or_default();
    bytes.push(b'\n');
    record::write_if_changed(p, &bytes)
}
