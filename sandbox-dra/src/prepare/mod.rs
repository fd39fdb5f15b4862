//! Preparing and unpreparing claims: the allocated GPU and its whole IOMMU group on a VFIO
//! driver, a CDI spec naming its device nodes, and the device-metadata file KubeVirt reads
//! ([`crate::cdi`]).
//!
//! **Prepare**, in this order (each step converges when repeated):
//! 1. the claim: from the [`record`] when there is one, else from the API server (its UID must
//!    be the one kubelet names; its allocation's results of this driver in this node's pools,
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
//! This module holds the steps every kind shares (the record, what kubelet is answered), and
//! `files` the metadata and CDI spec others read; the flows are its children: `claim` (the
//! allocation read from the API server), `passthrough` (whole GPUs bound and given back),
//! `vgpus` (vGPUs of the pooled GPUs), `mdevs` (mdevs of non-PCI parents), `unprepare` and
//! `reconcile`.

mod claim;
mod files;
mod mdevs;
mod passthrough;
mod reconcile;
mod steps;
mod unprepare;
mod vgpus;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use common::vfio::OpOptions;
use common::vgpu::lifecycle::Handle;
use common::{
    HostPaths, Inventory, PciAddress, PciIds, ReadOptions, Sysfs, error_chain, is_vfio_driver,
    state,
};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};

use crate::cdi::{self, ClaimDevice, ClaimId, Layout};
use crate::names;
use crate::record::{self, ClaimState, Record};
use crate::telemetry::Telemetry;

pub use claim::{Wanted, allocated, is_resource_name};
use steps::{Step, Steps};

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

impl ClaimRef {
    /// Its identity as the claim's files name it (no pod claim name: that is the API server's).
    pub fn id(&self) -> ClaimId {
        ClaimId {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            uid: self.uid.clone(),
            pod_claim_name: None,
        }
    }
}

impl fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// A device prepared for a claim, as kubelet is told about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The claim's requests it serves, as allocated (`gpu/a10` for a `firstAvailable`
    /// subrequest).
    pub requests: Vec<String>,
    /// Its pool: the node's, or its GPU's.
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// The allocation's share of it, for a shared device.
    pub share_id: Option<String>,
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
    /// The API server did not answer in time.
    #[error(
        "claim {claim}: the API server did not answer within {after:?}; nothing was changed \
         (kubelet calls again)"
    )]
    ApiTimeout {
        /// The claim.
        claim: ClaimRef,
        /// How long it waited.
        after: Duration,
    },
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
    pub vgpu_pool: crate::vgpu::Pool,
    /// The mdev parents that are not PCI functions whose types are published (`--vgpu mtty`).
    pub mdev_parents: BTreeSet<String>,
    /// Product names, for the devices' attributes in the metadata file.
    pub pci_ids: PciIds,
    /// The most reading a claim from the API server may take.
    pub api_timeout: Duration,
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
    /// A preparer reading claims through `client`, reporting through `telemetry`.
    pub fn new(
        config: PrepareConfig,
        paths: HostPaths,
        client: kube::Client,
        telemetry: Arc<Telemetry>,
    ) -> Self {
        Preparer {
            node: Arc::new(Node::new(config, paths, Some(telemetry))),
            client,
            lock: tokio::sync::Mutex::new(()),
        }
    }

    /// Prepares `claim`: idempotent, kubelet calls again after a failure or a restart.
    ///
    /// The claim is read from the API server before the lock is taken: a request that takes
    /// its time holds up no other claim's prepare or unprepare.
    ///
    /// Logs the claim prepared with how long each step took ([`Steps`]).
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        check_ref(claim)?;
        let mut steps = Steps::start();
        let recorded = self.node.load(claim)?;
        steps.mark(Step::Record);
        let read = match recorded {
            Some(_) => None,
            None => {
                let read = self.read_claim(claim).await?;
                steps.mark(Step::Api);
                Some(read)
            }
        };
        let _one_at_a_time = self.lock.lock().await;
        steps.mark(Step::Queue);
        let existing = self.node.load(claim)?;
        steps.mark(Step::Record);
        let (id, wanted) = match (&existing, read) {
            (Some(r), _) => (
                r.claim.clone(),
                r.devices.iter().map(Wanted::from).collect(),
            ),
            (None, Some(read)) => read,
            (None, None) => {
                return Err(refused(
                    claim,
                    "it was unprepared while this prepare waited; nothing was changed (kubelet \
                     calls again)"
                        .into(),
                ));
            }
        };
        let node = self.node.clone();
        let c = claim.clone();
        let (devices, steps) = blocking(claim, move || {
            steps.mark(Step::Queue);
            let devices = node.prepare(&c, id, wanted, existing, &mut steps)?;
            Ok((devices, steps))
        })
        .await?;
        let names: Vec<&str> = devices.iter().map(|d| d.device.as_str()).collect();
        tracing::info!(%claim, devices = ?names, took = ?steps.total(), %steps, "claim prepared");
        Ok(devices)
    }

    /// Unprepares `claim`: idempotent, a claim never prepared is already unprepared. It asks
    /// the API server nothing.
    pub async fn unprepare(&self, claim: &ClaimRef) -> Result<(), PrepareError> {
        check_ref(claim)?;
        let _one_at_a_time = self.lock.lock().await;
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
        let timeout = self.node.config.api_timeout;
        let got = tokio::time::timeout(timeout, api.get(&claim.name))
            .await
            .map_err(|_| PrepareError::ApiTimeout {
                claim: claim.clone(),
                after: timeout,
            })?;
        let rc = match got {
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
        let (id, mut wanted) = allocated(&self.node.config, claim, &rc)?;
        // A claim the scheduler made for a pod's extended resources: the resource each request
        // stands for, from its DeviceClass.
        for (request, class) in claim::extended_classes(&rc) {
            let resource = self.extended_resource(claim, &class).await?;
            for w in wanted
                .iter_mut()
                .filter(|w| w.requests.iter().any(|r| cdi::base_request(r) == request))
            {
                w.extended_resource = Some(resource.clone());
            }
        }
        Ok((id, wanted))
    }

    /// The extended resource DeviceClass `class` serves: its `extendedResourceName`, or the
    /// implicit `deviceclass.resource.kubernetes.io/<class>`; checked, since it becomes the
    /// name of an environment variable.
    async fn extended_resource(
        &self,
        claim: &ClaimRef,
        class: &str,
    ) -> Result<String, PrepareError> {
        let api: kube::Api<DeviceClass> = kube::Api::all(self.client.clone());
        let timeout = self.node.config.api_timeout;
        let got = tokio::time::timeout(timeout, api.get(class))
            .await
            .map_err(|_| PrepareError::ApiTimeout {
                claim: claim.clone(),
                after: timeout,
            })?
            .map_err(|source| PrepareError::Api {
                claim: claim.clone(),
                source: Box::new(source),
            })?;
        let name = got
            .spec
            .extended_resource_name
            .unwrap_or_else(|| format!("deviceclass.resource.kubernetes.io/{class}"));
        if !claim::is_resource_name(&name) {
            return Err(refused(
                claim,
                format!(
                    "DeviceClass {} names extended resource {}, which is not a resource name; \
                     nothing was changed",
                    names::quoted(class),
                    names::quoted(&name)
                ),
            ));
        }
        Ok(name)
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

/// Refuses a claim kubelet names whose UID, namespace or name is not what the API allows:
/// each becomes part of a host path (the record, the metadata directory) or an API request.
fn check_ref(claim: &ClaimRef) -> Result<(), PrepareError> {
    if !record::valid_uid(&claim.uid) {
        return Err(refused(
            claim,
            format!("{} is not a claim UID", names::quoted(&claim.uid)),
        ));
    }
    if !names::is_dns_label(&claim.namespace) {
        return Err(refused(
            claim,
            format!(
                "namespace {} is not a namespace name (a DNS label)",
                names::quoted(&claim.namespace)
            ),
        ));
    }
    if !names::is_dns_subdomain(&claim.name) {
        return Err(refused(
            claim,
            format!(
                "{} is not a claim name (a DNS subdomain)",
                names::quoted(&claim.name)
            ),
        ));
    }
    Ok(())
}

/// Refuses a record whose names could not have come from the API (one written by hand, or by
/// a version that did not check them) before any of its paths is built.
fn check_id(claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
    let id = &rec.claim;
    check_ref(&ClaimRef {
        namespace: id.namespace.clone(),
        name: id.name.clone(),
        uid: id.uid.clone(),
    })
    .map_err(|e| match e {
        PrepareError::Refused { reason, .. } => refused(claim, format!("its record: {reason}")),
        other => other,
    })?;
    if let Some(p) = id.pod_claim_name.as_deref()
        && !names::is_dns_label(p)
    {
        return Err(refused(
            claim,
            format!(
                "its record names the pod's claim {}, which is not a DNS label",
                names::quoted(p)
            ),
        ));
    }
    for d in &rec.devices {
        if let Some(r) = d.requests.iter().find(|r| !names::is_request_ref(r)) {
            return Err(refused(
                claim,
                format!(
                    "its record names request {}, which is not a request name",
                    names::quoted(r)
                ),
            ));
        }
    }
    Ok(())
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
    /// Where unreadable records are reported (none in unit tests).
    telemetry: Option<Arc<Telemetry>>,
    /// Its sysfs writes, on threads kept for the next one.
    sysfs: Sysfs,
    /// The pooled GPUs as this driver last read them, each brought up to date with the vGPUs
    /// it made or removed there since: vGPUs are placed from them
    /// ([`common::vgpu::lifecycle`]; `vgpus`).
    views: Mutex<Views>,
}

/// Kept reads of pooled GPUs ([`common::vgpu::lifecycle::Member::read`]), by GPU.
type Views = BTreeMap<PciAddress, Inventory>;

impl Node {
    fn new(config: PrepareConfig, paths: HostPaths, telemetry: Option<Arc<Telemetry>>) -> Node {
        Node {
            config,
            sysfs: Sysfs::new(paths.clone()),
            paths,
            telemetry,
            views: Mutex::new(Views::new()),
        }
    }

    /// The kept views of the pooled GPUs (preparing and unpreparing run one at a time).
    fn views(&self) -> MutexGuard<'_, Views> {
        // A view is only ever a read of the node: one a panic left half updated is forgotten.
        self.views.lock().unwrap_or_else(|e| {
            let mut v = e.into_inner();
            v.clear();
            v
        })
    }

    /// Forgets the views of `gpus`: something changed them that no view follows (a bind, the
    /// VFs disabled, a GPU given back).
    fn forget(&self, gpus: impl IntoIterator<Item = PciAddress>) {
        let mut views = self.views();
        for g in gpus {
            views.remove(&g);
        }
    }

    /// A host path as this process reaches it.
    fn local(&self, host: &Path) -> PathBuf {
        self.paths
            .root()
            .join(host.strip_prefix("/").unwrap_or(host))
    }

    fn driver_dir(&self) -> PathBuf {
        self.local(&self.config.layout.driver_dir)
    }

    fn state_err<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
        claim: &ClaimRef,
        what: String,
    ) -> impl FnOnce(E) -> PrepareError + '_ {
        move |e| PrepareError::State {
            claim: claim.clone(),
            what,
            source: e.into(),
        }
    }

    /// The claim's record: `None` when there is none, or it could not be read (set aside
    /// and reported: the claim is then handled as one without a record, never refused for
    /// ever). A record of the format before versions is written back in the current one.
    fn load(&self, claim: &ClaimRef) -> Result<Option<Record>, PrepareError> {
        let p = record::path(&self.driver_dir(), &claim.uid);
        match record::load_path(&p) {
            Ok(Some(rec)) => {
                self.migrate(claim, &p, &rec)?;
                Ok(Some(rec))
            }
            Ok(None) => Ok(None),
            Err(e @ record::RecordError::Unreadable { .. }) => {
                self.set_aside(&p, &e);
                Ok(None)
            }
            Err(e) => Err(PrepareError::State {
                claim: claim.clone(),
                what: format!("cannot read its record {}", p.display()),
                source: Box::new(e),
            }),
        }
    }

    /// Writes a record of the format before versions back in the current one.
    fn migrate(&self, claim: &ClaimRef, p: &Path, rec: &Record) -> Result<(), PrepareError> {
        if rec.version < record::VERSION {
            self.save(claim, p, rec)?;
            tracing::info!(%claim, record = %p.display(), from = rec.version, "claim record migrated");
        }
        Ok(())
    }

    /// Saves the claim's record at `p`, unless it holds that already.
    fn save(&self, claim: &ClaimRef, p: &Path, rec: &Record) -> Result<(), PrepareError> {
        record::save(p, rec)
            .map(|_| ())
            .map_err(|e| PrepareError::State {
                claim: claim.clone(),
                what: "cannot save its record".into(),
                source: Box::new(e),
            })
    }

    /// Moves a record that cannot be read out of the way (kept beside it for an operator),
    /// and says so in the log, the metrics and an Event.
    fn set_aside(&self, p: &Path, e: &record::RecordError) {
        let what = match state::set_aside(p) {
            Ok(aside) => format!("set aside as {}", aside.display()),
            Err(e2) => format!("and cannot be set aside: {}", error_chain(&e2)),
        };
        let note = format!(
            "{}; {what}: its claim is handled as one this driver has no record of, its GPUs \
             and vGPUs left as they are",
            error_chain(e)
        );
        tracing::warn!("{note}");
        if let Some(t) = &self.telemetry {
            t.record_unreadable(&note);
        }
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
        steps: &mut Steps,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        // kubelet's retry of a prepare that finished: the answer, once the node and the files
        // are checked to be as the record says.
        let in_place = existing.as_ref().filter(|r| self.in_place(r)).cloned();
        steps.mark(Step::Node);
        if let Some(rec) = in_place {
            let rec_path = record::path(&self.driver_dir(), &claim.uid);
            return self.finish(claim, rec, &rec_path, steps);
        }
        let vgpus = wanted
            .iter()
            .filter(|w| names::parse_vgpu_device(&w.device).is_some())
            .count();
        let mdevs = wanted
            .iter()
            .filter(|w| names::parse_mdev_device(&w.device, &self.config.mdev_parents).is_some())
            .count();
        if vgpus == wanted.len() {
            return self.prepare_vgpus(claim, id, wanted, existing, steps);
        }
        if mdevs == wanted.len() {
            return self.prepare_mdevs(claim, id, wanted, existing, steps);
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
        self.prepare_gpus(claim, id, wanted, existing, steps)
    }

    /// What the slice says of each device `inv` shows, for the metadata file: taken once, at
    /// the first prepare (a GPU that has gone since keeps what it had).
    fn fill_attributes(&self, inv: &Inventory, rec: &mut Record) {
        // The VFIO drivers modules.alias names matter to whole GPUs only: read for them.
        let mut aliases: Option<common::vfio::AliasTable> = None;
        let none = common::vfio::AliasTable::default();
        for d in rec.devices.iter_mut().filter(|d| d.attributes.is_empty()) {
            let table = if names::parse_gpu_device(&d.device).is_some() {
                aliases.get_or_insert_with(|| common::vfio::load_aliases(&self.paths))
            } else {
                &none
            };
            let attrs = crate::slices::attributes_of(
                inv,
                table,
                &self.config.pci_ids,
                &self.config.mdev_parents,
                &d.device,
            );
            d.attributes = attrs
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| Some((k, serde_json::to_value(v).ok()?)))
                .collect();
        }
    }

    /// The last steps of every prepare: the files written, the record marked prepared and
    /// saved; what kubelet is answered.
    fn finish(
        &self,
        claim: &ClaimRef,
        mut rec: Record,
        rec_path: &Path,
        steps: &mut Steps,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        self.write_files(claim, &rec)?;
        steps.mark(Step::Files);
        rec.state = ClaimState::Prepared;
        self.save(claim, rec_path, &rec)?;
        steps.mark(Step::Record);
        let layout = &self.config.layout;
        Ok(rec
            .devices
            .iter()
            .map(|d| PreparedDevice {
                // As allocated (`gpu/a10`): the plugin answers kubelet with the top-level
                // request.
                requests: d.requests.clone(),
                pool: d.pool.clone(),
                device: d.device.clone(),
                share_id: d.share_id.clone(),
                cdi_ids: layout.cdi_ids(&rec.claim, d),
            })
            .collect())
    }

    /// Whether a prepared claim is still in place, as its record says: each device's nodes
    /// there, each vGPU and mdev with its group node, every function of the whole GPUs'
    /// groups on a VFIO driver. Reads those devices alone, not the node.
    fn in_place(&self, rec: &Record) -> bool {
        if rec.state != ClaimState::Prepared {
            return false;
        }
        let opts = ReadOptions::default();
        let ready = |h: &Handle, group: u32| {
            let mut inv = Inventory::default();
            h.refresh(&mut inv, &self.paths, &opts);
            h.ready(&inv).is_some_and(|r| r.group == group)
        };
        let devices = rec.devices.iter().all(|d| {
            let nodes = !d.nodes.is_empty()
                && d.nodes
                    .iter()
                    .all(|n| std::fs::symlink_metadata(self.local(Path::new(n))).is_ok());
            nodes
                && match (&d.vgpu, &d.mdev) {
                    (Some(v), _) => ready(&v.handle, d.group),
                    (None, Some(m)) => ready(&m.handle(), d.group),
                    (None, None) => true,
                }
        });
        let whole = rec
            .devices
            .iter()
            .any(|d| d.vgpu.is_none() && d.mdev.is_none());
        devices
            && (!whole
                || rec.originals.keys().all(|a| {
                    self.sysfs
                        .current_driver(a)
                        .ok()
                        .flatten()
                        .is_some_and(|d| is_vfio_driver(&d))
                }))
    }

    /// The record of a claim of vGPUs or mdevs before anything is made for it.
    fn new_record(&self, id: ClaimId, wanted: &[Wanted]) -> Record {
        Record {
            version: record::VERSION,
            claim: id,
            state: ClaimState::Preparing,
            devices: wanted
                .iter()
                .map(|w| ClaimDevice {
                    requests: w.requests.clone(),
                    pool: w.pool.clone(),
                    device: w.device.clone(),
                    share_id: w.share_id.clone(),
                    address: w.address,
                    group: 0,
                    nodes: Vec::new(),
                    vgpu: None,
                    mdev: None,
                    extended_resource: w.extended_resource.clone(),
                    attributes: Default::default(),
                })
                .collect(),
            originals: BTreeMap::new(),
        }
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
