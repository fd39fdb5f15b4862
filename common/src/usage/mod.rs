//! Who uses a device: the one answer every daemon asks before it removes a vGPU, unbinds a
//! group from VFIO or takes a GPU from nvidia.
//!
//! A PCI function, VF or mdev is **in use** when
//!
//! - a **process** holds its IOMMU group's `/dev/vfio/<group>` or its VFIO cdev
//!   (`/dev/vfio/devices/vfioN`) open — a VM's QEMU — or, for a GPU on nvidia, its
//!   `/dev/nvidia<N>` (a CUDA job, nvidia-persistenced): one scan of `<root>/proc/<pid>/fd`;
//! - a **pod** kubelet runs holds it: kubelet's PodResources API (`List` on
//!   [`HostPaths::pod_resources_socket`]), matching the device's ID (PCI address or mdev UUID)
//!   whatever resource lists it. Where nothing listens on that socket (kubelet is not running)
//!   kubelet's checkpoint ([`HostPaths::kubelet_checkpoint`]) stands in; it is conservative,
//!   since kubelet keeps a deleted pod's entry there until it next admits a pod;
//! - a pod kubelet runs has a **ResourceClaim** (DRA) prepared with one of its device nodes:
//!   `List` names each claim's devices with the CDI devices the container gets, and the CDI
//!   specs on the node ([`HostPaths::cdi_spec_dirs`]) say which device nodes those are
//!   (`/dev/vfio/<group>`, `/dev/vfio/devices/vfioN`, `/dev/nvidia<N>`), matched as a process's
//!   open files are. Any DRA driver that hands devices through CDI is seen, sandbox-dra's
//!   among them;
//! - a **DRA driver has prepared a claim** with one of its device nodes: sandbox-dra's records
//!   of the claims it prepared (`<kubelet-root>/plugins/<driver>/claims/<uid>.json`, every
//!   driver directory read), from its prepare to its unprepare. They stand for the claim while
//!   kubelet is down (kubelet's checkpoint has no claims) and before the VM opens the device;
//! - or a source cannot be read (no `/proc`, a truncated checkpoint, a PodResources socket
//!   that does not answer, a claim's CDI device that no spec on the node defines): the user is
//!   **unknown**, which counts as in use. Only a daemon's `--force` overrides it. So does a
//!   claim record that cannot be read. A claim of a driver that keeps records whose CDI spec is
//!   gone is not unknown: its unprepare removes the spec first and the record last, so its
//!   record, while there is one, says what it holds (pods deleted together have their claims
//!   unprepared at once, and each would otherwise wait for the others).
//!
//! A GPU is in use when any of its functions, VFs or vGPUs is ([`Usage::of_gpu`]).
//!
//! [`Usage::read`] reads every source once (one `/proc` scan, one `List`, the claim records);
//! the queries then answer for any number of devices without reading again.

mod cdi;
mod kubelet;
mod procs;
mod records;

pub use records::CLAIM_RECORD_VERSION;

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::error::error_chain;
use crate::inventory::{Inventory, MdevDevice};
use crate::paths::{HostPaths, host_vfio_cdev_path, host_vfio_group_path};
use crate::pci::PciAddress;

/// How long kubelet's PodResources API may take to answer `List`.
pub const POD_RESOURCES_TIMEOUT: Duration = Duration::from_secs(5);

/// A process holding a device node open.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Process {
    /// Process id (in the namespace of `<root>/proc`).
    pub pid: u32,
    /// The process's `comm` (`qemu-kvm`), or `?` when unreadable.
    pub comm: String,
    /// The held path, as the process sees it (`/dev/vfio/42`).
    pub path: String,
}

impl fmt::Display for Process {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} ({}) holds {}", self.pid, self.comm, self.path)
    }
}

/// Where kubelet's word on a pod comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PodSource {
    /// The PodResources API: the pods kubelet runs now.
    PodResources,
    /// kubelet's checkpoint: may still list a pod that is gone.
    Checkpoint,
}

/// The ResourceClaim through which a pod has a device (DRA), and the device as its driver
/// published it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Claim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The DRA driver (`gpu.gpu-vm-node.io`).
    pub driver: String,
    /// The driver's pool (for sandbox-dra, the node's name).
    pub pool: String,
    /// The device's name in the pool (`gpu-0000-41-00-0`).
    pub device: String,
}

impl fmt::Display for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "claim {}/{}, device {}/{}/{}",
            self.namespace, self.name, self.driver, self.pool, self.device
        )
    }
}

/// A ResourceClaim a DRA driver prepared on this node, as its record says
/// (`<kubelet-root>/plugins/<driver>/claims/<uid>.json`): the claim holds the device from its
/// prepare to its unprepare, whether kubelet runs or not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PreparedClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The DRA driver whose record it is (its directory's name, `gpu.gpu-vm-node.io`).
    pub driver: String,
    /// Where its prepare is, as the record says: `preparing`, `prepared`, `unpreparing`.
    pub state: String,
    /// The record.
    pub record: PathBuf,
}

impl fmt::Display for PreparedClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = match self.state.as_str() {
            "preparing" => "being prepared by",
            "unpreparing" => "being unprepared by",
            _ => "prepared by",
        };
        write!(
            f,
            "claim {}/{} ({how} {})",
            self.namespace, self.name, self.driver
        )
    }
}

/// A pod's container that kubelet gave the device to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Pod {
    /// Its namespace (PodResources only).
    pub namespace: Option<String>,
    /// Its name (PodResources only).
    pub name: Option<String>,
    /// Its UID (checkpoint only).
    pub uid: Option<String>,
    /// The container.
    pub container: String,
    /// The resource the device was allocated as (`nvidia.com/NVIDIA_A10-4Q`); for a claim's
    /// device, its DRA driver.
    pub resource: String,
    /// The ResourceClaim it came through, for a device DRA allocated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claim: Option<Claim>,
    /// Where this comes from.
    pub source: PodSource,
}

impl fmt::Display for Pod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.namespace, &self.name, &self.uid) {
            (Some(ns), Some(n), _) => write!(f, "pod {ns}/{n}")?,
            (_, _, Some(uid)) => write!(f, "pod {uid}")?,
            _ => f.write_str("a pod")?,
        }
        match &self.claim {
            Some(c) => write!(f, " (container {}, {c}", self.container)?,
            None => write!(f, " (container {}, {}", self.container, self.resource)?,
        }
        if self.source == PodSource::Checkpoint {
            f.write_str("; kubelet's checkpoint")?;
        }
        f.write_str(")")
    }
}

/// Which source could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// The processes' open files (`/proc`), or the nvidia driver's GPU table.
    Processes,
    /// kubelet: its PodResources API or its checkpoint.
    Kubelet,
    /// The DRA drivers' records of the claims they prepared.
    ClaimRecords,
}

/// Why a source of "in use" could not be read: every device that depends on it is then used by
/// someone unknown. Each names what it could not read; the reason is kept as text so that a
/// reading of the sources ([`Usage`]) can be cloned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    /// The processes' open files under `<root>/proc`.
    #[error("cannot read the processes' open files: {reason}")]
    Processes {
        /// Why, with its causes.
        reason: String,
    },
    /// The nvidia driver's table of GPUs (`<root>/proc/driver/nvidia/gpus`).
    #[error("cannot read the nvidia driver's GPUs: {reason}")]
    NvidiaGpus {
        /// Why, with its causes.
        reason: String,
    },
    /// One GPU's entry in that table.
    #[error("{reason}")]
    NvidiaMinor {
        /// Why, naming the file.
        reason: String,
    },
    /// kubelet's PodResources API answered nothing.
    #[error("kubelet's PodResources API ({}) does not answer List: {reason}", .socket.display())]
    PodResources {
        /// Its socket.
        socket: PathBuf,
        /// Why.
        reason: String,
    },
    /// kubelet's checkpoint, where its API is not there, could not be read.
    #[error("cannot read kubelet's checkpoint {}: {reason}", .path.display())]
    CheckpointRead {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// kubelet's checkpoint is not one.
    #[error("kubelet's checkpoint {} is truncated or corrupt ({reason})", .path.display())]
    CheckpointCorrupt {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// A source that could not be read: whoever uses the device, if anyone, is unknown.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Unknown {
    /// Which source.
    pub source: Source,
    /// What could not be read, and why.
    pub reason: String,
}

/// Who uses a device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum User {
    /// A process holds one of its device nodes open.
    Process(Process),
    /// kubelet gave it to a pod.
    Pod(Pod),
    /// A DRA driver prepared a claim with it (the claim's record says so; kubelet may be
    /// down).
    Claim(PreparedClaim),
    /// A source could not be read: counts as in use.
    Unknown(Unknown),
}

impl User {
    /// A pod that has the device (not a process, not unknown).
    pub fn is_pod(&self) -> bool {
        matches!(self, User::Pod(_))
    }

    /// Whether this user is unknown because `source` could not be read.
    pub fn is_unknown_from(&self, source: Source) -> bool {
        matches!(self, User::Unknown(u) if u.source == source)
    }
}

impl User {
    /// Who, in a few words: `pid 4242 (qemu-kvm)`, `pod default/vm-a`, `unknown`.
    pub fn who(&self) -> String {
        match self {
            User::Process(p) => format!("pid {} ({})", p.pid, p.comm),
            User::Pod(p) => match (&p.namespace, &p.name, &p.uid) {
                (Some(ns), Some(n), _) => format!("pod {ns}/{n}"),
                (_, _, Some(uid)) => format!("pod {uid}"),
                _ => "a pod".into(),
            },
            User::Claim(c) => format!("claim {}/{}", c.namespace, c.name),
            User::Unknown(_) => "unknown".into(),
        }
    }
}

impl fmt::Display for User {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            User::Process(p) => p.fmt(f),
            User::Pod(p) => write!(f, "{p} has it"),
            User::Claim(c) => write!(f, "{c} has it"),
            User::Unknown(u) => write!(f, "unknown: {}", u.reason),
        }
    }
}

/// A device, as the usage model names it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(tag = "kind", content = "id", rename_all = "kebab-case")]
pub enum Device {
    /// A PCI function (a GPU, one of its VFs or its other functions).
    Function(PciAddress),
    /// An mdev, by UUID.
    Mdev(String),
}

impl Device {
    /// How an operator knows it: `vGPU NVIDIA A10-4Q 5a3b… (on 0000:41:00.4)` for an mdev or
    /// a VF holding an SR-IOV vGPU, else the address.
    pub fn label(&self, inv: &Inventory) -> String {
        match self {
            Device::Mdev(uuid) => match inv.mdevs.get(&uuid.to_ascii_lowercase()) {
                Some(m) => format!(
                    "vGPU {} {uuid} (on {})",
                    m.type_name.as_deref().unwrap_or(&m.type_id),
                    m.parent
                ),
                None => format!("mdev {uuid}"),
            },
            Device::Function(a) => match inv.device(a).and_then(|d| d.nvidia_vgpu.as_ref()) {
                Some(v) if v.current != 0 => format!(
                    "vGPU {} on VF {a}",
                    v.current_name
                        .clone()
                        .unwrap_or_else(|| format!("type {}", v.current))
                ),
                _ => a.to_string(),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Function(a) => write!(f, "{a}"),
            Device::Mdev(u) => write!(f, "mdev {u}"),
        }
    }
}

/// One device of a group or GPU and one of its users. As JSON, the user's fields beside
/// `device`: `{"device": {...}, "kind": "process", "pid": 4242, ...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Use {
    /// The device used.
    pub device: Device,
    /// Who uses it.
    #[serde(flatten)]
    pub user: User,
}

impl fmt::Display for Use {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.user {
            User::Unknown(_) => self.user.fmt(f),
            _ => write!(f, "{}: {}", self.device, self.user),
        }
    }
}

impl Use {
    /// `<device label>: <user>`, the device named as [`Device::label`] does; an unknown user
    /// alone (it concerns every device).
    pub fn describe(&self, inv: &Inventory) -> String {
        match &self.user {
            User::Unknown(_) => self.user.to_string(),
            u => format!("{}: {u}", self.device.label(inv)),
        }
    }
}

/// `a; b; c` of what users say.
pub fn describe<T: fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(|u| u.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// Device ID in lower case → the pods' containers that hold it now, from kubelet's
/// PodResources `List` alone (never the checkpoint): what decides whether a vGPU made for a pod
/// may go. Blocks for at most `timeout`; an error when kubelet does not answer.
pub fn active_pods(
    paths: &HostPaths,
    timeout: Duration,
) -> std::result::Result<BTreeMap<String, Vec<Pod>>, Unreadable> {
    kubelet::active(paths, timeout)
}

/// One reading of every source. Build it with [`Usage::read`] once per run or node read and
/// ask it about as many devices as needed; the fields are public so that tests can build one.
#[derive(Clone, Debug)]
pub struct Usage {
    /// Open device nodes: host path (`/dev/vfio/42`) → the processes holding it; or why the
    /// processes could not be read.
    pub processes: Result<BTreeMap<String, Vec<Process>>, Unreadable>,
    /// GPUs on the nvidia driver → their `/dev/nvidia<N>` minor (or why it is not known); or
    /// why the driver's table could not be read.
    pub nvidia_minors: Result<BTreeMap<PciAddress, Result<u32, Unreadable>>, Unreadable>,
    /// Device ID in lower case (PCI address, mdev UUID) → the pods kubelet gave it to; or why
    /// that cannot be known.
    pub pods: Result<BTreeMap<String, Vec<Pod>>, Unreadable>,
    /// Device nodes, as host paths (`/dev/vfio/42`) → the pods a prepared ResourceClaim gave
    /// them to (each [`Pod`] names its claim).
    pub claims: BTreeMap<String, Vec<Pod>>,
    /// Claims' devices whose device nodes cannot be told (a CDI device that no spec on the node
    /// defines, a spec that cannot be read): why, each naming the pod and claim.
    pub claims_unknown: Vec<String>,
    /// Device nodes, as host paths → the claims a DRA driver's records say it prepared with
    /// them.
    pub prepared: BTreeMap<String, Vec<PreparedClaim>>,
    /// PCI functions → the prepared claims holding them whose device nodes are not known yet
    /// (a prepare under way, or interrupted).
    pub prepared_functions: BTreeMap<PciAddress, Vec<PreparedClaim>>,
    /// Claim records that cannot be read: why, each naming the file.
    pub records_unknown: Vec<String>,
    /// Where `pods` comes from, for logs.
    pub pods_source: String,
}

impl Default for Usage {
    /// Nothing is in use and every source was read.
    fn default() -> Self {
        Usage {
            processes: Ok(BTreeMap::new()),
            nvidia_minors: Ok(BTreeMap::new()),
            pods: Ok(BTreeMap::new()),
            claims: BTreeMap::new(),
            claims_unknown: Vec::new(),
            prepared: BTreeMap::new(),
            prepared_functions: BTreeMap::new(),
            records_unknown: Vec::new(),
            pods_source: "none".into(),
        }
    }
}

impl Usage {
    /// Reads every source once: `<root>/proc`, the nvidia driver's GPU table, kubelet's
    /// PodResources API (or its checkpoint), and the DRA drivers' claim records. Never fails: a source that cannot be read makes
    /// every device that depends on it [`User::Unknown`].
    pub fn read(paths: &HostPaths) -> Usage {
        Usage::read_excluding_claim(paths, None)
    }

    /// [`Usage::read`] for a DRA driver preparing or unpreparing the claim `namespace/name`:
    /// that claim's own pod is not a user of its devices (kubelet unprepares a claim once the
    /// pod's containers have stopped, while PodResources may still list it, with CDI devices
    /// the driver has already removed), nor is its own record.
    pub fn read_excluding_claim(paths: &HostPaths, claim: Option<(&str, &str)>) -> Usage {
        let processes = procs::scan(paths).map_err(|e| {
            let e = Unreadable::Processes {
                reason: error_chain(&e),
            };
            tracing::warn!("{e}");
            e
        });
        let nvidia_minors = procs::nvidia_minors(paths).map_err(|e| {
            let e = Unreadable::NvidiaGpus {
                reason: error_chain(&e),
            };
            tracing::warn!("{e}");
            e
        });
        let kubelet::PodsRead {
            allocations,
            claims,
            source,
        } = kubelet::read(paths, POD_RESOURCES_TIMEOUT);
        let claims: Vec<_> = claims
            .into_iter()
            .filter(|c| {
                !claim.is_some_and(|(ns, name)| {
                    c.pod
                        .claim
                        .as_ref()
                        .is_some_and(|own| own.namespace == ns && own.name == name)
                })
            })
            .collect();
        match &allocations {
            Ok(a) => {
                tracing::debug!(source = %source, devices = a.len(), claims = claims.len(), "pods' devices read")
            }
            Err(e) => tracing::warn!("cannot tell which devices pods hold: {e}"),
        }
        let records = records::read(paths, claim);
        let cdi::Resolved {
            by_node: claims,
            unknown: claims_unknown,
        } = cdi::resolve(paths, claims, &records.keepers);
        for e in &claims_unknown {
            tracing::warn!("{e}");
        }
        tracing::debug!(
            records = records.read,
            dir = %paths.kubelet_plugins_dir().display(),
            "DRA claim records read"
        );
        for e in &records.unknown {
            tracing::warn!("{e}");
        }
        Usage {
            processes,
            nvidia_minors,
            pods: allocations,
            claims,
            claims_unknown,
            prepared: records.by_node,
            prepared_functions: records.by_function,
            records_unknown: records.unknown,
            pods_source: source,
        }
    }

    /// Processes holding `path` (a host path).
    fn holders(&self, path: &str, out: &mut Vec<User>) {
        if let Ok(scan) = &self.processes
            && let Some(h) = scan.get(path)
        {
            out.extend(h.iter().cloned().map(User::Process));
        }
    }

    /// Pods whose prepared claims gave them `path` (a host path), then the claims a DRA
    /// driver's records say hold it that no such pod named already.
    fn claim_holders(&self, path: &str, out: &mut Vec<User>) {
        if let Some(p) = self.claims.get(path) {
            out.extend(p.iter().cloned().map(User::Pod));
        }
        if let Some(c) = self.prepared.get(path) {
            Self::prepared_holders(c, out);
        }
    }

    /// `claims`, each unless a pod with the same claim is named in `out` already.
    fn prepared_holders(claims: &[PreparedClaim], out: &mut Vec<User>) {
        for c in claims {
            let named = out.iter().any(|u| {
                matches!(u, User::Pod(p) if p.claim.as_ref().is_some_and(|pc| {
                    pc.namespace == c.namespace && pc.name == c.name
                }))
            });
            if !named {
                out.push(User::Claim(c.clone()));
            }
        }
    }

    /// The processes source, where it could not be read.
    fn processes_unknown(&self, out: &mut Vec<User>) {
        if let Err(e) = &self.processes {
            out.push(User::Unknown(Unknown {
                source: Source::Processes,
                reason: e.to_string(),
            }));
        }
    }

    /// Claims whose device nodes cannot be told (a CDI device no spec defines, a claim record
    /// that cannot be read): any device may be theirs.
    fn claims_unknown(&self, out: &mut Vec<User>) {
        out.extend(self.claims_unknown.iter().map(|reason| {
            User::Unknown(Unknown {
                source: Source::Kubelet,
                reason: reason.clone(),
            })
        }));
        out.extend(self.records_unknown.iter().map(|reason| {
            User::Unknown(Unknown {
                source: Source::ClaimRecords,
                reason: reason.clone(),
            })
        }));
    }

    /// Pods holding the device with ID `id`, or the kubelet source where it could not be read.
    fn pods_of(&self, id: &str, out: &mut Vec<User>) {
        match &self.pods {
            Ok(m) => {
                if let Some(p) = m.get(&id.to_ascii_lowercase()) {
                    out.extend(p.iter().cloned().map(User::Pod));
                }
            }
            Err(e) => out.push(User::Unknown(Unknown {
                source: Source::Kubelet,
                reason: e.to_string(),
            })),
        }
    }

    /// Users of one PCI function: processes holding its group's `/dev/vfio/<group>` or its VFIO
    /// cdev, or (on nvidia) its `/dev/nvidia<N>`; pods kubelet gave its address to, or whose
    /// claims gave them one of those nodes; claims a DRA driver prepared with one of those
    /// nodes, or with the function itself while its nodes are not known yet. A function the inventory does not have is asked of
    /// kubelet's device plugins' allocations only.
    pub fn of_function(&self, inv: &Inventory, address: &PciAddress) -> Vec<User> {
        let mut out = self.holders_of_function(inv, address, true);
        self.pods_of(&address.to_string(), &mut out);
        dedup(out)
    }

    /// The device-node part of [`Usage::of_function`]: processes, and (with `vfio_claims`)
    /// claims holding its VFIO nodes; claims holding its `/dev/nvidia<N>` always.
    fn holders_of_function(
        &self,
        inv: &Inventory,
        address: &PciAddress,
        vfio_claims: bool,
    ) -> Vec<User> {
        let mut out = Vec::new();
        let Some(d) = inv.device(address) else {
            return out;
        };
        self.processes_unknown(&mut out);
        // A claim whose nodes cannot be told may hold any of them; without the VFIO nodes,
        // only the `/dev/nvidia<N>` of a GPU on nvidia is left to hold.
        if vfio_claims || d.driver.as_deref() == Some("nvidia") {
            self.claims_unknown(&mut out);
        }
        let mut vfio_nodes = Vec::new();
        if let Some(g) = d.iommu_group {
            vfio_nodes.push(host_vfio_group_path(g));
        }
        if let Some(c) = &d.vfio_cdev {
            vfio_nodes.push(host_vfio_cdev_path(c));
        }
        for n in &vfio_nodes {
            self.holders(n, &mut out);
            if vfio_claims {
                self.claim_holders(n, &mut out);
            }
        }
        // A prepare under way (or interrupted) before it knew the device's nodes: the function
        // is the claim's, for passthrough too.
        if let Some(c) = self.prepared_functions.get(address) {
            Self::prepared_holders(c, &mut out);
        }
        if d.driver.as_deref() == Some("nvidia") {
            match &self.nvidia_minors {
                Ok(m) => match m.get(address) {
                    Some(Ok(minor)) => {
                        let node = format!("/dev/nvidia{minor}");
                        self.holders(&node, &mut out);
                        self.claim_holders(&node, &mut out);
                    }
                    Some(Err(e)) => out.push(User::Unknown(Unknown {
                        source: Source::Processes,
                        reason: format!("which /dev/nvidia<N> is {address}: {e}"),
                    })),
                    // The driver does not list it (a VF): no /dev/nvidia<N> of its own.
                    None => {}
                },
                Err(e) => out.push(User::Unknown(Unknown {
                    source: Source::Processes,
                    reason: e.to_string(),
                })),
            }
        }
        out
    }

    /// Users of an mdev: processes holding its group's `/dev/vfio/<group>` or its VFIO cdev;
    /// pods kubelet gave its UUID to, or whose claims gave them one of those nodes; claims a DRA
    /// driver prepared with one of those nodes.
    pub fn of_mdev(&self, m: &MdevDevice) -> Vec<User> {
        let mut out = Vec::new();
        self.processes_unknown(&mut out);
        self.claims_unknown(&mut out);
        let nodes = m
            .iommu_group
            .map(host_vfio_group_path)
            .into_iter()
            .chain(m.vfio_cdev.as_deref().map(host_vfio_cdev_path));
        for n in nodes {
            self.holders(&n, &mut out);
            self.claim_holders(&n, &mut out);
        }
        self.pods_of(&m.uuid, &mut out);
        dedup(out)
    }

    /// Users of every PCI function of IOMMU group `group` (a VM holding the group's node is
    /// named once).
    pub fn of_group(&self, inv: &Inventory, group: u32) -> Vec<Use> {
        let uses = inv
            .group_members(group)
            .iter()
            .flat_map(|a| self.uses(Device::Function(*a), self.of_function(inv, a)))
            .collect();
        dedup_uses(uses)
    }

    /// Users of a GPU and everything on it: the function itself, its VFs, and the mdevs on it
    /// or on its VFs (a VF's SR-IOV vGPU is the VF itself). Whoever uses any of them uses the
    /// GPU; unbinding it from its driver takes every one of them away.
    pub fn of_gpu(&self, inv: &Inventory, address: &PciAddress) -> Vec<Use> {
        self.gpu_uses(inv, address, true)
    }

    /// Whom moving a function onto a VFIO driver would hurt: [`Usage::of_gpu`] without the
    /// pods kubelet gave the function itself to, by device plugin or by a claim's VFIO nodes.
    /// Such a pod was given it for passthrough, on VFIO, and needs it there (after a reboot the
    /// GPU comes up on nvidia while kubelet still runs the pod); the processes holding it, a
    /// claim holding its `/dev/nvidia<N>`, its VFs and its vGPUs still count.
    pub fn of_gpu_for_passthrough(&self, inv: &Inventory, address: &PciAddress) -> Vec<Use> {
        self.gpu_uses(inv, address, false)
    }

    fn gpu_uses(&self, inv: &Inventory, address: &PciAddress, own_pods: bool) -> Vec<Use> {
        let own = if own_pods {
            self.of_function(inv, address)
        } else {
            dedup(self.holders_of_function(inv, address, false))
        };
        let mut uses = self.uses(Device::Function(*address), own);
        let vfs: Vec<PciAddress> = inv
            .device(address)
            .map(|d| d.virtfns.clone())
            .unwrap_or_default();
        for vf in &vfs {
            uses.extend(self.uses(Device::Function(*vf), self.of_function(inv, vf)));
        }
        for m in inv.mdevs.values() {
            if m.parent_pci
                .is_some_and(|p| p == *address || vfs.contains(&p))
            {
                uses.extend(self.uses(Device::Mdev(m.uuid.clone()), self.of_mdev(m)));
            }
        }
        dedup_uses(uses)
    }

    fn uses(&self, device: Device, users: Vec<User>) -> Vec<Use> {
        users
            .into_iter()
            .map(|user| Use {
                device: device.clone(),
                user,
            })
            .collect()
    }
}

/// The same user named twice (a process holding a group node and a cdev of it) is named once.
fn dedup(users: Vec<User>) -> Vec<User> {
    let mut out: Vec<User> = Vec::with_capacity(users.len());
    for u in users {
        if !out.contains(&u) {
            out.push(u);
        }
    }
    out
}

/// Across devices: a process or an unknown source is named once, at its first device; a pod is
/// named for each device it has.
fn dedup_uses(uses: Vec<Use>) -> Vec<Use> {
    let mut out: Vec<Use> = Vec::with_capacity(uses.len());
    for u in uses {
        let seen = out.iter().any(|o| match (&o.user, &u.user) {
            (User::Pod(_), User::Pod(_)) => o == &u,
            (a, b) => a == b,
        });
        if !seen {
            out.push(u);
        }
    }
    out
}

#[cfg(test)]
mod tests;
