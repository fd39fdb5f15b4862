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
//! **Unprepare** marks the record, removes the CDI spec and the metadata, then by [`OnUnprepare`] leaves the
//! groups on their VFIO driver or gives each function back to the driver it had (refused,
//! naming the holder, while the group is in use), and removes the record last. A claim with no
//! record is already unprepared.
//!
//! **At start** ([`Preparer::reconcile`]) every record is brought back in line with the node:
//! a prepare that did not finish is undone (its devices never reached a container), an
//! unprepare that did not finish is finished, a finished prepare is prepared again (a GPU
//! someone unbound is bound again, a lost file rewritten).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::state::originals::{self, Originals};
use common::vfio::{self, DeviceResult, OpOptions, Outcome, Selection, Selector, Target};
use common::{HostPaths, Inventory, PciAddress, Usage, error_chain, is_vfio_driver, state};
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::cdi::{self, ClaimDevice, ClaimId, Layout};
use crate::names;
use crate::record::{self, ClaimState, Record};
use crate::vgpu;

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

/// A GPU the claim's allocation names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// The requests it was allocated for.
    pub requests: Vec<String>,
    /// Its name in the pool.
    pub device: String,
    /// Its PCI address; none for an mdev of a parent that is not a PCI function.
    pub address: Option<PciAddress>,
}

impl From<&ClaimDevice> for Wanted {
    fn from(d: &ClaimDevice) -> Self {
        Wanted {
            requests: d.requests.clone(),
            device: d.device.clone(),
            address: d.address,
        }
    }
}

/// The claim's identity and the GPUs its allocation gives this driver on this node. Refused
/// when the UID is not kubelet's, the claim is not allocated, or a device name is not one of
/// this driver's.
pub fn allocated(
    config: &PrepareConfig,
    claim: &ClaimRef,
    rc: &ResourceClaim,
) -> Result<(ClaimId, Vec<Wanted>), PrepareError> {
    let uid = rc.metadata.uid.as_deref().unwrap_or_default();
    if uid != claim.uid {
        return Err(refused(
            claim,
            format!(
                "the API server's claim of that name has UID {uid:?}: it was deleted and made \
                 again; not preparing it"
            ),
        ));
    }
    let results = rc
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let Some(results) = results else {
        return Err(refused(claim, "it is not allocated".into()));
    };
    let mut wanted: Vec<Wanted> = Vec::new();
    for r in results
        .iter()
        .filter(|r| r.driver == config.driver && r.pool == config.node_name)
    {
        let address = names::parse_gpu_device(&r.device)
            .or_else(|| names::parse_vgpu_device(&r.device).map(|(gpu, _, _)| gpu));
        let mdev = names::parse_mdev_device(&r.device, &config.mdev_parents).is_some();
        if address.is_none() && !mdev {
            return Err(refused(
                claim,
                format!(
                    "device {:?} of pool {} is not a GPU of driver {} (names look like \
                     gpu-0000-41-00-0, vgpu-0000-41-00-0-a10-4q-0, mdev-mtty-mtty-1-0)",
                    r.device, r.pool, config.driver
                ),
            ));
        }
        match wanted.iter_mut().find(|w| w.device == r.device) {
            Some(w) if !w.requests.contains(&r.request) => w.requests.push(r.request.clone()),
            Some(_) => {}
            None => wanted.push(Wanted {
                requests: vec![r.request.clone()],
                device: r.device.clone(),
                address,
            }),
        }
    }
    if wanted.is_empty() {
        return Err(refused(
            claim,
            format!(
                "its allocation has no device of driver {} in pool {}",
                config.driver, config.node_name
            ),
        ));
    }
    let annotations = rc.metadata.annotations.as_ref();
    let id = ClaimId {
        namespace: claim.namespace.clone(),
        name: claim.name.clone(),
        uid: claim.uid.clone(),
        pod_claim_name: annotations
            .and_then(|a| a.get(cdi::POD_CLAIM_NAME_ANNOTATION))
            .cloned(),
    };
    Ok((id, wanted))
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

    /// Selects the GPUs and the rest of their groups, refusing a missing GPU or a group with a
    /// foreign member.
    fn select(
        &self,
        claim: &ClaimRef,
        inv: &Inventory,
        wanted: &[Wanted],
    ) -> Result<Selection, PrepareError> {
        for w in wanted {
            let Some(a) = w.address else {
                // An mdev of a parent --vgpu named when it was prepared, and names no more.
                return Err(refused(
                    claim,
                    format!(
                        "device {} is not a GPU, and its mdev parent is not in --vgpu; nothing \
                         was changed",
                        w.device
                    ),
                ));
            };
            if inv.device(&a).is_none() {
                return Err(refused(
                    claim,
                    format!(
                        "device {} ({a}) is not on this node any more (removed or unplugged); \
                         nothing was changed",
                        w.device
                    ),
                ));
            }
        }
        let selector = Selector {
            addresses: wanted.iter().filter_map(|w| w.address).collect(),
            ..Selector::default()
        };
        let aliases = vfio::load_aliases(&self.paths);
        let sel = vfio::select(inv, &selector, None, &aliases);
        if !sel.refused.is_empty() {
            let reasons: Vec<&str> = sel.refused.iter().map(|r| r.reason.as_str()).collect();
            return Err(refused(
                claim,
                format!("{}; nothing was changed", reasons.join("; ")),
            ));
        }
        Ok(sel)
    }

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
        let mut inv = self.inventory(claim)?;
        // A GPU of the vGPU pool goes to a VM whole only without vGPUs; its VFs (enabled for
        // vGPUs) are disabled first. No record is needed for that write: a GPU without VFs is
        // where either mode starts from.
        let mut vfs_off = Vec::new();
        for w in &wanted {
            let Some(a) = w.address.filter(|a| self.config.vgpu_pool.contains(a)) else {
                continue;
            };
            let cap = common::vgpu::capacity(&inv, &a);
            if !cap.existing.is_empty() {
                return Err(refused(
                    claim,
                    format!(
                        "GPU {} hosts {} vGPU(s): it goes to a VM whole only without them; \
                         nothing was changed",
                        a,
                        cap.existing.len()
                    ),
                ));
            }
            if inv
                .device(&a)
                .is_some_and(|d| d.sriov_numvfs.unwrap_or(0) > 0)
            {
                vfs_off.push(a);
            }
        }
        if !vfs_off.is_empty() {
            // Disabling VFs takes them from whoever holds them: asked first, for every GPU,
            // before the first write.
            let usage = Usage::read(&self.paths);
            for a in &vfs_off {
                let users = usage.of_gpu_for_passthrough(&inv, a);
                if !users.is_empty() {
                    let who: Vec<String> = users.iter().map(|u| u.describe(&inv)).collect();
                    return Err(refused(
                        claim,
                        format!(
                            "GPU {a} is in use: {}; its VFs stay enabled, nothing was changed",
                            who.join("; ")
                        ),
                    ));
                }
            }
            let sysfs = common::Sysfs::new(self.paths.clone());
            for a in &vfs_off {
                sysfs.set_sriov_numvfs(a, 0).map_err(|e| {
                    refused(
                        claim,
                        format!("cannot disable the VFs of GPU {a}: {}", error_chain(&e)),
                    )
                })?;
            }
            inv = self.inventory(claim)?;
        }
        let sel = self.select(claim, &inv, &wanted)?;

        // Who would lose something: asked of every function that is to move, before the
        // first write, so that a claim refused for one GPU changes none.
        let usage: OnceLock<Usage> = OnceLock::new();
        let in_use = |t: &Target| -> Vec<String> {
            let usage = usage.get_or_init(|| Usage::read(&self.paths));
            vfio::bind_blockers(usage, &inv, t)
                .iter()
                .map(|u| u.describe(&inv))
                .collect()
        };
        let mut busy = Vec::new();
        for t in sel.targets().filter(|t| !t.is_bound()) {
            let users = in_use(t);
            if !users.is_empty() {
                busy.push(format!(
                    "{} is in use ({}) on {}",
                    t.address,
                    users.join("; "),
                    t.driver.as_deref().unwrap_or("no driver")
                ));
            }
        }
        if !busy.is_empty() {
            return Err(refused(
                claim,
                format!("{}; nothing was changed", busy.join("; ")),
            ));
        }

        let group_of = |a: &PciAddress| sel.targets().find(|t| t.address == *a).map(|t| t.group);
        let mut rec = existing.unwrap_or_else(|| Record {
            claim: id.clone(),
            state: ClaimState::Preparing,
            devices: Vec::new(),
            originals: BTreeMap::new(),
        });
        // A function on VFIO already (a claim before this one left it there) goes back, on
        // restore, to the driver it had before anything moved it: vfio-manager's record of
        // original drivers, shared with it, says which.
        let remembered = originals::load(&self.paths);
        for t in sel.targets() {
            let on_vfio = t.driver.as_deref().is_some_and(is_vfio_driver) || t.is_bound();
            let original = match remembered.get(&t.address) {
                Some(r) if on_vfio => r.clone(),
                _ => t.driver.clone(),
            };
            rec.originals.entry(t.address).or_insert(original);
        }
        let moving: Vec<(PciAddress, Option<String>)> = sel
            .targets()
            .filter(|t| !t.is_bound() && !t.driver.as_deref().is_some_and(is_vfio_driver))
            .map(|t| (t.address, t.driver.clone()))
            .collect();
        if rec.devices.is_empty() {
            rec.devices = wanted
                .iter()
                .map(|w| ClaimDevice {
                    requests: w.requests.clone(),
                    pool: self.config.node_name.clone(),
                    device: w.device.clone(),
                    address: w.address,
                    group: w.address.as_ref().and_then(group_of).unwrap_or_default(),
                    nodes: Vec::new(),
                    vgpu: None,
                    mdev: None,
                })
                .collect();
        }
        let rec_path = record::path(&self.driver_dir(), &claim.uid);
        if rec.state != ClaimState::Prepared {
            rec.state = ClaimState::Preparing;
            record::write_if_changed(&rec_path, &rec.to_bytes())
                .map_err(Self::state_err(claim, "cannot save its record".into()))?;
        }
        originals::update(&self.paths, &moving, &[]);

        let results = vfio::bind_all(&self.paths, &sel, &self.op_options(), &in_use);
        let failures: Vec<String> = results.iter().filter_map(DeviceResult::failure).collect();
        if !failures.is_empty() {
            return Err(refused(claim, failures.join("; ")));
        }

        // The VFIO cdevs appear with the bind: read them again when something moved.
        let moved = results
            .iter()
            .any(|r| matches!(r.outcome, Outcome::Changed { .. }));
        let after = if moved { self.inventory(claim)? } else { inv };
        for d in &mut rec.devices {
            d.group = d.address.as_ref().and_then(group_of).unwrap_or(d.group);
            d.nodes = device_nodes(&after, d);
        }
        self.finish(claim, rec, &rec_path)
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

    /// Prepares a claim of vGPU devices: each allocated vGPU created (its GPU given back to
    /// its vGPU driver first when a whole-GPU claim left it on VFIO, its VFs enabled when
    /// needed), each recorded before its write; then the files.
    fn prepare_vgpus(
        &self,
        claim: &ClaimRef,
        id: ClaimId,
        wanted: Vec<Wanted>,
        existing: Option<Record>,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        for w in &wanted {
            if let Some((gpu, _, _)) = names::parse_vgpu_device(&w.device)
                && !self.config.vgpu_pool.contains(&gpu)
            {
                return Err(refused(
                    claim,
                    format!(
                        "device {}: GPU {gpu} is not in this driver's vGPU pool (--vgpu); nothing \
                         was changed",
                        w.device
                    ),
                ));
            }
        }
        let rec_path = record::path(&self.driver_dir(), &claim.uid);
        let mut rec = existing.unwrap_or_else(|| self.new_record(id, &wanted));
        if rec.state != ClaimState::Prepared {
            rec.state = ClaimState::Preparing;
        }
        let save = |rec: &Record| {
            record::write_if_changed(&rec_path, &rec.to_bytes())
                .map(|_| ())
                .map_err(Self::state_err(claim, "cannot save its record".into()))
        };
        let sysfs = common::Sysfs::new(self.paths.clone());
        let mut inv = self.inventory(claim)?;
        for i in 0..rec.devices.len() {
            if rec.devices[i].vgpu.as_ref().is_some_and(|v| v.exists(&inv)) {
                continue;
            }
            let device = rec.devices[i].device.clone();
            let Some((gpu, key, _)) = names::parse_vgpu_device(&device) else {
                return Err(refused(claim, format!("{device:?} is not a vGPU device")));
            };
            let fail = |reason: String| refused(claim, format!("device {device}: {reason}"));
            if inv
                .device(&gpu)
                .and_then(|d| d.driver.as_deref())
                .is_some_and(is_vfio_driver)
            {
                save(&rec)?;
                self.give_back(&inv, gpu).map_err(fail)?;
                inv = self.inventory(claim)?;
            }
            let mut enabled = false;
            loop {
                match vgpu::next_step(&inv, &gpu, &key) {
                    Ok(vgpu::Step::EnableVfs(n)) if !enabled => {
                        save(&rec)?;
                        sysfs.set_sriov_numvfs(&gpu, n).map_err(|e| {
                            fail(format!("cannot enable the VFs of GPU {gpu}: {e}"))
                        })?;
                        enabled = true;
                        inv = self.wait_vfs(claim, &gpu)?;
                    }
                    Ok(vgpu::Step::EnableVfs(_)) => {
                        return Err(fail(format!(
                            "GPU {gpu} shows no vGPU types after its VFs were enabled"
                        )));
                    }
                    Ok(vgpu::Step::Create(v, target)) => {
                        let d = &mut rec.devices[i];
                        if let Some(vf) = v.vf() {
                            d.address = Some(vf);
                        }
                        d.vgpu = Some(v.clone());
                        save(&rec)?;
                        vgpu::create(&self.paths, &v, &target).map_err(|e| {
                            fail(format!("cannot create {} on GPU {gpu}: {e}", v.type_name))
                        })?;
                        tracing::info!(%claim, gpu = %gpu, vgpu = %v.handle, type_name = %v.type_name, "created a vGPU");
                        break;
                    }
                    Err(reason) => return Err(fail(reason)),
                }
            }
        }
        for d in &mut rec.devices {
            let Some(v) = d.vgpu.clone() else { continue };
            let Some((after, group)) = vgpu::wait_ready(&self.paths, &v) else {
                return Err(refused(
                    claim,
                    format!(
                        "{} {} on GPU {} has no /dev/vfio group node",
                        v.type_name, v.handle, v.gpu
                    ),
                ));
            };
            d.group = group;
            d.nodes = vfio_nodes(&after, group, v.cdev(&after));
        }
        self.finish(claim, rec, &rec_path)
    }

    /// Prepares a claim of mdevs of parents that are not PCI functions (`--vgpu mtty`): each
    /// allocated mdev created on its parent, recorded before the write; then the files.
    fn prepare_mdevs(
        &self,
        claim: &ClaimRef,
        id: ClaimId,
        wanted: Vec<Wanted>,
        existing: Option<Record>,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        let rec_path = record::path(&self.driver_dir(), &claim.uid);
        let mut rec = existing.unwrap_or_else(|| self.new_record(id, &wanted));
        if rec.state != ClaimState::Prepared {
            rec.state = ClaimState::Preparing;
        }
        let save = |rec: &Record| {
            record::write_if_changed(&rec_path, &rec.to_bytes())
                .map(|_| ())
                .map_err(Self::state_err(claim, "cannot save its record".into()))
        };
        let inv = self.inventory(claim)?;
        for i in 0..rec.devices.len() {
            if rec.devices[i].mdev.as_ref().is_some_and(|m| m.exists(&inv)) {
                continue;
            }
            let device = rec.devices[i].device.clone();
            let Some((parent, type_id, _)) =
                names::parse_mdev_device(&device, &self.config.mdev_parents)
            else {
                return Err(refused(claim, format!("{device:?} is not an mdev device")));
            };
            let m = vgpu::Mdev::new(&parent, &type_id);
            rec.devices[i].mdev = Some(m.clone());
            save(&rec)?;
            m.create(&self.paths).map_err(|e| {
                refused(
                    claim,
                    format!(
                        "device {device}: cannot create an mdev of type {type_id} on {parent}: {}",
                        error_chain(&e)
                    ),
                )
            })?;
            tracing::info!(%claim, parent = %parent, mdev = %m.uuid, type_id = %type_id, "created an mdev");
        }
        for d in &mut rec.devices {
            let Some(m) = d.mdev.clone() else { continue };
            let Some((after, group)) = vgpu::wait_group(&self.paths, |inv| m.group(inv)) else {
                return Err(refused(
                    claim,
                    format!(
                        "mdev {} of type {} on {} has no /dev/vfio group node",
                        m.uuid, m.type_id, m.parent
                    ),
                ));
            };
            d.group = group;
            d.nodes = vfio_nodes(&after, group, m.cdev(&after));
        }
        self.finish(claim, rec, &rec_path)
    }

    /// Removes the claim's mdevs of parents that are not PCI functions that exist; one a
    /// process holds is kept and named (the error has kubelet call again).
    fn destroy_mdevs(&self, claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
        if rec.devices.iter().all(|d| d.mdev.is_none()) {
            return Ok(());
        }
        let inv = self.inventory(claim)?;
        let usage: OnceLock<Usage> = OnceLock::new();
        let mut held = Vec::new();
        for m in rec.devices.iter().filter_map(|d| d.mdev.as_ref()) {
            if !m.exists(&inv) {
                continue;
            }
            let users = m.users(usage.get_or_init(|| Usage::read(&self.paths)), &inv);
            if !users.is_empty() {
                held.push(format!(
                    "mdev {} on {} is in use ({}): kept",
                    m.uuid,
                    m.parent,
                    users.join("; ")
                ));
                continue;
            }
            m.destroy(&self.paths).map_err(|e| {
                refused(
                    claim,
                    format!(
                        "cannot remove mdev {} on {}: {}",
                        m.uuid,
                        m.parent,
                        error_chain(&e)
                    ),
                )
            })?;
            tracing::info!(%claim, parent = %m.parent, mdev = %m.uuid, "removed an mdev");
        }
        if held.is_empty() {
            Ok(())
        } else {
            Err(refused(claim, held.join("; ")))
        }
    }

    /// Reads the node until `gpu`'s VFs show vGPU types (up to two seconds).
    fn wait_vfs(&self, claim: &ClaimRef, gpu: &PciAddress) -> Result<Inventory, PrepareError> {
        let end = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let inv = self.inventory(claim)?;
            let cap = common::vgpu::capacity(&inv, gpu);
            let ready = !matches!(cap.mode, common::vgpu::Mode::NeedsVfs { .. })
                && cap.types.iter().any(|t| t.type_id.is_some());
            if ready || std::time::Instant::now() >= end {
                return Ok(inv);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Gives a GPU a whole-GPU claim left on VFIO back to the driver it had before (its vGPU
    /// driver, `nvidia` when no record says), with the rest of its group; refused while
    /// anything holds the group.
    fn give_back(&self, inv: &Inventory, gpu: PciAddress) -> Result<(), String> {
        let selector = Selector {
            addresses: vec![gpu],
            allow_foreign_in_group: true,
            ..Selector::default()
        };
        let aliases = vfio::load_aliases(&self.paths);
        let mut sel = vfio::select(inv, &selector, None, &aliases);
        sel.refused.clear();
        let mut originals = originals::load(&self.paths);
        originals
            .entry(gpu)
            .or_insert_with(|| Some("nvidia".to_string()));
        let failures = self.unbind_groups(inv, &sel, &originals);
        if failures.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "GPU {gpu} is on VFIO and cannot go back to its vGPU driver: {}",
                failures.into_iter().collect::<Vec<_>>().join("; ")
            ))
        }
    }

    /// Gives the functions of `sel` back to their `originals` (refused while their group is in
    /// use) and forgets those released in vfio-manager's record; the failures, each naming
    /// the function.
    fn unbind_groups(
        &self,
        inv: &Inventory,
        sel: &Selection,
        originals: &Originals,
    ) -> BTreeSet<String> {
        let usage = Usage::read(&self.paths);
        let in_use = |group: u32| -> Vec<String> {
            usage
                .of_group(inv, group)
                .iter()
                .map(|u| u.describe(inv))
                .collect()
        };
        let results = vfio::unbind_all(&self.paths, sel, &self.op_options(), &in_use, originals);
        let released: Vec<PciAddress> = results
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Changed { .. }))
            .map(|r| r.address)
            .collect();
        originals::update(&self.paths, &[], &released);
        results.iter().filter_map(DeviceResult::failure).collect()
    }

    /// Destroys the claim's vGPUs that exist; one a process holds is kept and named (the
    /// error has kubelet call again).
    ///
    /// A GPU a prepare killed while giving it back from VFIO left without a driver gets its
    /// vGPU driver, so that it is ready for either mode.
    fn destroy_vgpus(&self, claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
        let gpus: BTreeSet<PciAddress> = rec
            .devices
            .iter()
            .filter_map(|d| names::parse_vgpu_device(&d.device).map(|(gpu, _, _)| gpu))
            .collect();
        if gpus.is_empty() {
            return Ok(());
        }
        let inv = self.inventory(claim)?;
        for gpu in &gpus {
            if inv.device(gpu).is_some_and(|d| d.driver.is_none()) {
                self.give_back(&inv, *gpu).map_err(|e| refused(claim, e))?;
            }
        }
        let usage: OnceLock<Usage> = OnceLock::new();
        let mut held = Vec::new();
        for v in rec.devices.iter().filter_map(|d| d.vgpu.as_ref()) {
            if !v.exists(&inv) {
                continue;
            }
            let users = v.users(usage.get_or_init(|| Usage::read(&self.paths)), &inv);
            if !users.is_empty() {
                held.push(format!(
                    "{} {} on GPU {} is in use ({}): kept",
                    v.type_name,
                    v.handle,
                    v.gpu,
                    users.join("; ")
                ));
                continue;
            }
            vgpu::destroy(&self.paths, v).map_err(|e| {
                refused(
                    claim,
                    format!(
                        "cannot remove {} {} on GPU {}: {e}",
                        v.type_name, v.handle, v.gpu
                    ),
                )
            })?;
            tracing::info!(%claim, gpu = %v.gpu, vgpu = %v.handle, type_name = %v.type_name, "removed a vGPU");
        }
        if held.is_empty() {
            Ok(())
        } else {
            Err(refused(claim, held.join("; ")))
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

    fn unprepare(
        &self,
        claim: &ClaimRef,
        rec: Option<Record>,
        policy: OnUnprepare,
    ) -> Result<(), PrepareError> {
        let Some(mut rec) = rec else {
            // Nothing was prepared: at most a spec a crash left (none does: the record is the
            // first thing written and the last removed).
            self.remove_files(claim, None)?;
            tracing::debug!(%claim, "not prepared here; nothing to do");
            return Ok(());
        };
        // Marked first, so that a restart finishes the unprepare rather than preparing again.
        let p = record::path(&self.driver_dir(), &claim.uid);
        if rec.state == ClaimState::Prepared {
            rec.state = ClaimState::Unpreparing;
            record::write_if_changed(&p, &rec.to_bytes())
                .map_err(Self::state_err(claim, "cannot save its record".into()))?;
        }
        self.remove_files(claim, Some(&rec))?;
        self.destroy_vgpus(claim, &rec)?;
        self.destroy_mdevs(claim, &rec)?;
        if policy == OnUnprepare::Restore {
            self.restore(claim, &rec)?;
        }
        state::remove_if_present(&p).map_err(Self::state_err(
            claim,
            format!("cannot remove its record {}", p.display()),
        ))?;
        tracing::info!(%claim, ?policy, "unprepared");
        Ok(())
    }

    /// Gives every function of the record back to the driver it had, when that was not a
    /// VFIO driver; refused while the group is in use.
    fn restore(&self, claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
        let inv = self.inventory(claim)?;
        let present: Vec<PciAddress> = rec
            .devices
            .iter()
            .filter(|d| names::parse_vgpu_device(&d.device).is_none())
            .filter_map(|d| d.address)
            .filter(|a| inv.device(a).is_some())
            .collect();
        if present.is_empty() {
            return Ok(());
        }
        let selector = Selector {
            addresses: present,
            allow_foreign_in_group: true,
            ..Selector::default()
        };
        let aliases = vfio::load_aliases(&self.paths);
        let mut sel = vfio::select(&inv, &selector, None, &aliases);
        // Only what this driver moved goes back: a function that was on VFIO already stays.
        let ours = |t: &Target| {
            rec.originals
                .get(&t.address)
                .is_some_and(|d| !d.as_deref().is_some_and(is_vfio_driver))
        };
        for targets in sel.groups.values_mut() {
            targets.retain(ours);
        }
        sel.groups.retain(|_, t| !t.is_empty());
        sel.refused.clear();
        let failures = self.unbind_groups(&inv, &sel, &rec.originals);
        if failures.is_empty() {
            Ok(())
        } else {
            Err(refused(
                claim,
                format!(
                    "cannot give its GPUs back: {}",
                    failures.into_iter().collect::<Vec<_>>().join("; ")
                ),
            ))
        }
    }

    fn reconcile(&self) {
        for p in record::list(&self.driver_dir()) {
            let rec = match record::load_path(&p) {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(error = %error_chain(&e), "skipping a record that cannot be read");
                    continue;
                }
            };
            let claim = ClaimRef {
                namespace: rec.claim.namespace.clone(),
                name: rec.claim.name.clone(),
                uid: rec.claim.uid.clone(),
            };
            if p != record::path(&self.driver_dir(), &claim.uid) {
                tracing::warn!(path = %p.display(), "skipping a record whose name is not its claim's UID");
                continue;
            }
            let outcome = match rec.state {
                ClaimState::Prepared => {
                    let wanted = rec.devices.iter().map(Wanted::from).collect();
                    self.prepare(&claim, rec.claim.clone(), wanted, Some(rec))
                        .map(|_| "prepared again")
                }
                // Its devices never reached a container: undone whatever the policy.
                ClaimState::Preparing => self
                    .unprepare(&claim, Some(rec), OnUnprepare::Restore)
                    .map(|()| "unfinished prepare undone"),
                ClaimState::Unpreparing => self
                    .unprepare(&claim, Some(rec), self.config.on_unprepare)
                    .map(|()| "unfinished unprepare finished"),
            };
            match outcome {
                Ok(what) => tracing::info!(%claim, "{what}"),
                Err(e) => {
                    tracing::warn!(%claim, error = %error_chain(&e), "claim left for kubelet's next call")
                }
            }
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

fn write_json(p: &Path, v: &serde_json::Value) -> common::Result<bool> {
    let mut bytes = serde_json::to_vec_pretty(v).unwrap_or_default();
    bytes.push(b'\n');
    record::write_if_changed(p, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
        ResourceClaimStatus,
    };

    fn config() -> PrepareConfig {
        PrepareConfig {
            driver: "gpu.example.io".into(),
            node_name: "node-a".into(),
            layout: Layout {
                driver: "gpu.example.io".into(),
                cdi_root: "/var/run/cdi".into(),
                driver_dir: "/var/lib/kubelet/plugins/gpu.example.io".into(),
            },
            on_unprepare: OnUnprepare::Keep,
            timeout: Duration::from_secs(1),
            vgpu_pool: BTreeSet::new(),
            mdev_parents: BTreeSet::new(),
        }
    }

    fn claim_ref() -> ClaimRef {
        ClaimRef {
            namespace: "vms".into(),
            name: "c1".into(),
            uid: "u-1".into(),
        }
    }

    fn rc(uid: &str, results: &[(&str, &str, &str, &str)]) -> ResourceClaim {
        let mut rc = ResourceClaim::default();
        rc.metadata.uid = Some(uid.into());
        rc.status = Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(
                        results
                            .iter()
                            .map(|(req, driver, pool, dev)| DeviceRequestAllocationResult {
                                request: (*req).into(),
                                driver: (*driver).into(),
                                pool: (*pool).into(),
                                device: (*dev).into(),
                                ..Default::default()
                            })
                            .collect(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        rc
    }

    fn reason(r: Result<(ClaimId, Vec<Wanted>), PrepareError>) -> String {
        match r {
            Err(PrepareError::Refused { reason, .. }) => reason,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn only_this_drivers_devices_in_this_nodes_pool_are_taken() {
        let c = rc(
            "u-1",
            &[
                ("gpu", "gpu.example.io", "node-a", "gpu-0000-41-00-0"),
                ("gpu", "gpu.example.io", "node-b", "gpu-0000-61-00-0"),
                ("nic", "nic.example.io", "node-a", "nic-0"),
            ],
        );
        let (id, wanted) = allocated(&config(), &claim_ref(), &c).unwrap();
        assert_eq!(id.uid, "u-1");
        assert_eq!(id.pod_claim_name, None);
        assert_eq!(
            wanted,
            vec![Wanted {
                requests: vec!["gpu".into()],
                device: "gpu-0000-41-00-0".into(),
                address: Some("0000:41:00.0".parse().unwrap()),
            }]
        );
    }

    #[test]
    fn an_mdev_of_a_pooled_parent_is_taken_and_of_another_refused() {
        let c = rc(
            "u-1",
            &[("tty", "gpu.example.io", "node-a", "mdev-mtty-mtty-2-0")],
        );
        let r = reason(allocated(&config(), &claim_ref(), &c));
        assert!(r.contains("\"mdev-mtty-mtty-2-0\""), "{r}");
        let cfg = PrepareConfig {
            mdev_parents: ["mtty".to_string()].into(),
            ..config()
        };
        let (_, wanted) = allocated(&cfg, &claim_ref(), &c).unwrap();
        assert_eq!(
            wanted,
            vec![Wanted {
                requests: vec!["tty".into()],
                device: "mdev-mtty-mtty-2-0".into(),
                address: None,
            }]
        );
    }

    #[test]
    fn a_claim_of_a_vgpu_and_an_mdev_of_another_parent_is_refused_before_any_read() {
        let cfg = PrepareConfig {
            mdev_parents: ["mtty".to_string()].into(),
            ..config()
        };
        let c = rc(
            "u-1",
            &[
                (
                    "a",
                    "gpu.example.io",
                    "node-a",
                    "vgpu-0000-41-00-0-a10-4q-0",
                ),
                ("b", "gpu.example.io", "node-a", "mdev-mtty-mtty-1-0"),
            ],
        );
        let (id, wanted) = allocated(&cfg, &claim_ref(), &c).unwrap();
        // A root with nothing in it: the refusal comes before any read or write.
        let node = Node {
            config: cfg,
            paths: HostPaths::new("/nonexistent-root"),
        };
        match node.prepare(&claim_ref(), id, wanted, None) {
            Err(PrepareError::Refused { reason, .. }) => {
                assert!(reason.contains("more than one kind"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_claim_made_again_unallocated_or_naming_a_foreign_device_is_refused() {
        let cfg = config();
        let r = reason(allocated(&cfg, &claim_ref(), &rc("u-2", &[])));
        assert!(r.contains("UID \"u-2\""), "{r}");
        let mut unallocated = rc("u-1", &[]);
        unallocated.status = None;
        let r = reason(allocated(&cfg, &claim_ref(), &unallocated));
        assert_eq!(r, "it is not allocated");
        let r = reason(allocated(
            &cfg,
            &claim_ref(),
            &rc("u-1", &[("gpu", "gpu.example.io", "node-a", "vgpu-7")]),
        ));
        assert!(r.contains("\"vgpu-7\""), "{r}");
        let r = reason(allocated(
            &cfg,
            &claim_ref(),
            &rc("u-1", &[("gpu", "other.io", "node-a", "gpu-0000-41-00-0")]),
        ));
        assert!(
            r.contains("no device of driver gpu.example.io in pool node-a"),
            "{r}"
        );
    }
}
