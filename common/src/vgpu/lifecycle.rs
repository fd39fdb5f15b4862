//! The life of one vGPU made at run time, the same for sandbox-dp's on-demand pool and
//! sandbox-dra's claims: choose where it goes, record it, create it, wait for its group node,
//! destroy it.
//!
//! 1. [`offers`] reads what a [`Member`] can host now: a GPU by NVIDIA's rules
//!    ([`super::capacity`]), a non-PCI mdev parent by its sysfs counts ([`super::parents`]).
//!    A GPU whose types show only on its VFs ([`Offers::needs_vfs`]) has them enabled first,
//!    and waited for, by [`enable_vfs`].
//! 2. [`Offers::place`] says where the next vGPU of a type goes ([`Planned`]: a fresh UUID on
//!    the first parent with room, or the first free VF on NVIDIA's vendor path), or why none
//!    can (the GPU full, or holding vGPUs of another size).
//! 3. The caller records [`Planned::handle`] in its own state file **before** the write, so
//!    that after a crash at any later point it knows every vGPU it may have made.
//! 4. [`Planned::create`] writes the mdev type's `create` or the VF's `current_vgpu_type`.
//!    The kernel checks the placement as it answers (its own counts and mixing rule): a
//!    caller that placed from a view it kept ([`Member::read`] earlier, brought up to date
//!    with its own vGPUs by [`Handle::refresh`]) reads the member again when that view cannot
//!    place the vGPU or the kernel [`refused`] it, and never refuses on a kept view.
//! 5. [`Handle::wait_ready`] re-reads that one device (not the node) until its
//!    `/dev/vfio/<group>` exists.
//! 6. Before [`Handle::destroy`] (`remove`, or `current_vgpu_type` 0) the caller asks the one
//!    "in use" model, [`crate::usage`], who holds it ([`Handle::users`]), and records that the
//!    vGPU is going.

use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{Capacity, Creatable, Mode, capacity, mix_conflict, parents};
use crate::usage::{Usage, User};
use crate::{HostPaths, Inventory, PciAddress, ReadOptions, Sysfs};

/// How long [`Handle::wait_ready`] waits for the kernel to make a new vGPU's group node, and
/// [`enable_vfs`] for a GPU's new VFs to show their vGPU types.
pub const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// Enables `n` SR-IOV VFs on GPU `gpu` (its `sriov_numvfs`), for a GPU whose vGPU types show
/// only on its VFs ([`super::Mode::NeedsVfs`]), then re-reads the GPU with its VFs into `inv`
/// until they show their vGPU types, at most [`READY_TIMEOUT`] (the driver probes each new VF
/// after the write returns), read with `opts` (which must read mdev types). Whether they did;
/// an error, naming the GPU and the file, when the kernel refuses the write.
pub fn enable_vfs(
    sysfs: &Sysfs,
    paths: &HostPaths,
    inv: &mut Inventory,
    gpu: &PciAddress,
    n: u32,
    opts: &ReadOptions,
) -> crate::Result<bool> {
    sysfs.set_sriov_numvfs(gpu, n)?;
    let end = Instant::now() + READY_TIMEOUT;
    loop {
        inv.refresh_pci(paths, *gpu, opts);
        let cap = capacity(inv, gpu);
        let shown = !matches!(cap.mode, Mode::NeedsVfs { .. })
            && cap.types.iter().any(|t| t.type_id.is_some());
        if shown {
            return Ok(true);
        }
        if Instant::now() >= end {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Where vGPUs are made: what a pool holds, and what a record names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum Member {
    /// A GPU: NVIDIA's vGPU rules ([`super::capacity`]).
    Gpu(PciAddress),
    /// An mdev parent that is not a PCI function (`mtty`): its types and counts as sysfs has
    /// them ([`super::parents`]).
    Parent(String),
}

impl Member {
    /// `GPU` or `mdev parent`, for messages.
    pub fn what(&self) -> &'static str {
        match self {
            Member::Gpu(_) => "GPU",
            Member::Parent(_) => "mdev parent",
        }
    }
}

impl Member {
    /// Reads what placing or removing a vGPU on it depends on. A GPU: the GPU with its VFs,
    /// their mdev types and vGPUs, and the group nodes of their groups, refreshed into an empty
    /// inventory (which then shows it as a full read does: the cost of the GPU, not of the
    /// node, which on a node of SR-IOV GPUs is every VF's types). A non-PCI parent: the node.
    pub fn read(&self, paths: &HostPaths, opts: &ReadOptions) -> crate::Result<Inventory> {
        match self {
            Member::Gpu(a) => {
                let mut inv = Inventory::default();
                inv.refresh_pci(paths, *a, opts);
                Ok(inv)
            }
            Member::Parent(_) => Inventory::read_with(paths, opts),
        }
    }
}

/// Whether a failed [`Planned::create`] was the kernel's refusal (an errno, or the type or
/// device gone): nothing was made, and a fresh read of the member may place the vGPU
/// elsewhere. A write that timed out may still land: it is not a refusal.
pub fn refused(e: &crate::Error) -> bool {
    matches!(
        e,
        crate::Error::Write { .. } | crate::Error::NotFound { .. }
    )
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
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

/// What one member can create now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offers {
    /// The member.
    pub member: Member,
    /// NVIDIA's vendor path: each vGPU is a VF's `current_vgpu_type`, not an mdev.
    pub vendor: bool,
    /// A GPU whose VFs must be enabled (`sriov_numvfs`) before it shows its types: how many.
    pub needs_vfs: Option<u32>,
    /// Every type it offers, with how many more of each it can host now.
    pub types: Vec<Creatable>,
    /// A GPU's capacity (its vGPUs, how it makes them), for the mixing rule and messages.
    pub capacity: Option<Capacity>,
}

/// What `member` can host now, as `inv` shows it. A GPU that hosts no vGPU offers no types; a
/// parent `inv` does not have is `None`.
pub fn offers(inv: &Inventory, member: &Member) -> Option<Offers> {
    match member {
        Member::Gpu(gpu) => {
            let cap = capacity(inv, gpu);
            let needs_vfs = match cap.mode {
                Mode::NeedsVfs { total } => Some(total),
                _ => None,
            };
            let offered = matches!(cap.mode, Mode::MdevPf | Mode::MdevVf | Mode::Vendor);
            Some(Offers {
                member: member.clone(),
                vendor: cap.mode == Mode::Vendor,
                needs_vfs,
                types: if offered {
                    cap.types.clone()
                } else {
                    Vec::new()
                },
                capacity: Some(cap),
            })
        }
        Member::Parent(name) => {
            let p = parents::capacity(inv, name)?;
            Some(Offers {
                member: member.clone(),
                vendor: false,
                needs_vfs: None,
                types: p.types,
                capacity: None,
            })
        }
    }
}

/// Why a vGPU cannot go on a member now.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoRoom {
    /// The member does not offer the type at all.
    #[error("{what} {member} offers no vGPU type {wanted} (it offers {offered})")]
    NotOffered {
        /// `GPU` or `mdev parent`.
        what: &'static str,
        /// The member.
        member: Member,
        /// The type asked for.
        wanted: String,
        /// What it offers, comma-separated.
        offered: String,
    },
    /// A GPU holds vGPUs the type cannot share it with (NVIDIA's mixing rule).
    #[error("GPU {gpu} holds {holds}; {wanted} cannot join it: {why}")]
    Mixed {
        /// The GPU.
        gpu: PciAddress,
        /// The types it holds, comma-separated.
        holds: String,
        /// The type asked for.
        wanted: String,
        /// The rule.
        why: String,
    },
    /// The member is full for the type.
    #[error("{0}")]
    Full(String),
}

impl Offers {
    /// The offered type `matches` picks (by its name or id, as the caller keys types).
    pub fn find(&self, matches: impl Fn(&Creatable) -> bool) -> Option<&Creatable> {
        self.types.iter().find(|t| matches(t))
    }

    /// [`NoRoom::NotOffered`] for `wanted`.
    pub fn not_offered(&self, wanted: &str) -> NoRoom {
        NoRoom::NotOffered {
            what: self.member.what(),
            member: self.member.clone(),
            wanted: wanted.to_string(),
            offered: self
                .types
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// Where the next vGPU of `t` (one of [`Offers::types`]) goes: a fresh UUID on the first
    /// parent with room, or on the vendor path the first free VF. Refused when a GPU holds
    /// vGPUs `t` may not share it with, or has no room left.
    pub fn place(&self, t: &Creatable) -> Result<Planned, NoRoom> {
        if let Some(cap) = &self.capacity
            && let Some(why) = mix_refusal(cap, t)
        {
            return Err(why);
        }
        let (Some(type_id), Some(parent)) = (t.type_id.clone(), t.parents.first().cloned()) else {
            return Err(NoRoom::Full(self.full(t)));
        };
        let handle = match (self.vendor, parent.parse::<PciAddress>()) {
            (true, Ok(vf)) => Handle::Vf(vf),
            (true, Err(_)) => return Err(NoRoom::Full(self.full(t))),
            (false, _) => Handle::Mdev(uuid::Uuid::new_v4().to_string()),
        };
        Ok(Planned {
            handle,
            parent,
            type_id,
            type_name: t.name.clone(),
        })
    }

    fn full(&self, t: &Creatable) -> String {
        let Some(cap) = &self.capacity else {
            return format!(
                "{} {} cannot host another {} now: its available_instances is 0",
                self.member.what(),
                self.member,
                t.name
            );
        };
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
}

/// Why a vGPU of `t` cannot join the vGPUs `cap`'s GPU has (NVIDIA's mixing rule), naming the
/// GPU and the types; `None` when it can.
pub fn mix_refusal(cap: &Capacity, t: &Creatable) -> Option<NoRoom> {
    if cap.existing.is_empty() {
        return None;
    }
    let mut ids: std::collections::BTreeSet<&str> =
        cap.existing.iter().map(|(id, _)| id.as_str()).collect();
    let mut sizes: Vec<u64> = cap.existing.iter().filter_map(|(_, s)| *s).collect();
    if let Some(id) = t.type_id.as_deref() {
        ids.insert(id);
    }
    sizes.extend(t.framebuffer_mb);
    let why = mix_conflict(cap.mode == Mode::MdevPf, ids.len(), &sizes)?;
    let holds: std::collections::BTreeSet<String> = cap
        .existing
        .iter()
        .map(|(id, _)| cap.get(id).map_or_else(|| id.clone(), |t| t.name.clone()))
        .collect();
    Some(NoRoom::Mixed {
        gpu: cap.gpu,
        holds: holds.into_iter().collect::<Vec<_>>().join(", "),
        wanted: t.name.clone(),
        why,
    })
}

/// A vGPU about to be made: record [`Planned::handle`], then [`Planned::create`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    /// What it will be known by.
    pub handle: Handle,
    /// Where it is written: the mdev parent (a GPU, a VF, a non-PCI parent) or the VF.
    pub parent: String,
    /// The sysfs type id (`nvidia-558`, `mtty-2`; the vendor path's `1145`).
    pub type_id: String,
    /// The type's name (`NVIDIA A10-4Q`), else its id.
    pub type_name: String,
}

impl Planned {
    /// Makes it: the mdev type's `create`, or the VF's `current_vgpu_type`.
    pub fn create(&self, sysfs: &Sysfs) -> crate::Result<()> {
        match &self.handle {
            Handle::Mdev(uuid) => sysfs.mdev_create(&self.parent, &self.type_id, uuid),
            Handle::Vf(vf) => match self.type_id.parse::<u32>() {
                Ok(n) => sysfs.set_current_vgpu_type(vf, n),
                Err(_) => Err(crate::Error::Parse {
                    path: sysfs
                        .paths()
                        .pci_device(vf)
                        .join("nvidia/creatable_vgpu_types"),
                    reason: format!("vendor vGPU type id {:?} is not a number", self.type_id),
                }),
            },
        }
    }
}

/// A vGPU that exists, or may: what records keep to find it again. In a record it is two
/// fields, `handle` (the UUID or the VF's address) and `vendor` (whether it is a VF), as the
/// daemons' records have always kept it: flatten it into the record.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "RecordedHandle", into = "RecordedHandle")]
pub enum Handle {
    /// An mdev, by its UUID.
    Mdev(String),
    /// A VF whose `current_vgpu_type` is set (NVIDIA's vendor path).
    Vf(PciAddress),
}

/// [`Handle`] as records keep it.
#[derive(Serialize, Deserialize)]
struct RecordedHandle {
    handle: String,
    #[serde(default)]
    vendor: bool,
}

impl TryFrom<RecordedHandle> for Handle {
    type Error = BadHandle;

    fn try_from(r: RecordedHandle) -> Result<Handle, BadHandle> {
        Handle::from_record(&r.handle, r.vendor)
    }
}

impl From<Handle> for RecordedHandle {
    fn from(h: Handle) -> RecordedHandle {
        RecordedHandle {
            vendor: h.is_vendor(),
            handle: h.to_string(),
        }
    }
}

/// A record's handle that names no vGPU.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{handle:?} is recorded as a vendor-path vGPU but is not a VF's PCI address")]
pub struct BadHandle {
    /// The handle as recorded.
    pub handle: String,
}

/// The group node and VFIO cdev of a vGPU the kernel has made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ready {
    /// Its IOMMU group (`/dev/vfio/<group>` exists).
    pub group: u32,
    /// Its VFIO cdev (`vfio3`), where the kernel has one.
    pub cdev: Option<String>,
}

impl Handle {
    /// The handle of a record that keeps it as a string and a vendor flag: a VF's address on
    /// the vendor path, else an mdev's UUID.
    pub fn from_record(handle: &str, vendor: bool) -> Result<Handle, BadHandle> {
        if !vendor {
            return Ok(Handle::Mdev(handle.to_string()));
        }
        handle.parse().map(Handle::Vf).map_err(|_| BadHandle {
            handle: handle.to_string(),
        })
    }

    /// The vendor path (a VF), as records flag it.
    pub fn is_vendor(&self) -> bool {
        matches!(self, Handle::Vf(_))
    }

    /// The VF of a vendor-path vGPU.
    pub fn vf(&self) -> Option<PciAddress> {
        match self {
            Handle::Vf(vf) => Some(*vf),
            Handle::Mdev(_) => None,
        }
    }

    /// Whether it exists on the node `inv` shows.
    pub fn exists(&self, inv: &Inventory) -> bool {
        match self {
            Handle::Vf(vf) => inv
                .device(vf)
                .and_then(|d| d.nvidia_vgpu.as_ref())
                .is_some_and(|nv| nv.current != 0),
            Handle::Mdev(uuid) => inv.mdevs.contains_key(uuid),
        }
    }

    /// Its IOMMU group, once the kernel made it.
    pub fn group(&self, inv: &Inventory) -> Option<u32> {
        match self {
            Handle::Vf(vf) => inv.device(vf)?.iommu_group,
            Handle::Mdev(uuid) => inv.mdevs.get(uuid)?.iommu_group,
        }
    }

    /// Its VFIO cdev (`vfio3`), where the kernel has one.
    pub fn cdev(&self, inv: &Inventory) -> Option<String> {
        match self {
            Handle::Vf(vf) => inv.device(vf)?.vfio_cdev.clone(),
            Handle::Mdev(uuid) => inv.mdevs.get(uuid)?.vfio_cdev.clone(),
        }
    }

    /// Who holds it ([`crate::usage`]): processes holding its group node or cdev, pods kubelet
    /// gave it to, or unknown where a source cannot be read.
    pub fn users(&self, usage: &Usage, inv: &Inventory) -> Vec<User> {
        match self {
            Handle::Vf(vf) => usage.of_function(inv, vf),
            Handle::Mdev(uuid) => inv
                .mdevs
                .get(uuid)
                .map(|m| usage.of_mdev(m))
                .unwrap_or_default(),
        }
    }

    /// Re-reads this device alone into `inv` (the VF, or the mdev) with its group node.
    pub fn refresh(&self, inv: &mut Inventory, paths: &HostPaths, opts: &ReadOptions) {
        match self {
            Handle::Vf(vf) => inv.refresh_pci(paths, *vf, opts),
            Handle::Mdev(uuid) => inv.refresh_mdev(paths, uuid),
        }
    }

    /// Its group and cdev when it exists and its `/dev/vfio/<group>` does, as `inv` shows it.
    pub fn ready(&self, inv: &Inventory) -> Option<Ready> {
        if !self.exists(inv) {
            return None;
        }
        let group = self.group(inv)?;
        inv.vfio_nodes.contains(&group).then(|| Ready {
            group,
            cdev: self.cdev(inv),
        })
    }

    /// Re-reads this device alone into `inv` until it is [`Handle::ready`], at most
    /// [`READY_TIMEOUT`]: the kernel makes the group node just after the write returns.
    pub fn wait_ready(
        &self,
        inv: &mut Inventory,
        paths: &HostPaths,
        opts: &ReadOptions,
    ) -> Option<Ready> {
        let end = Instant::now() + READY_TIMEOUT;
        loop {
            self.refresh(inv, paths, opts);
            if let Some(r) = self.ready(inv) {
                return Some(r);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Destroys it: the mdev's `remove`, or the VF's `current_vgpu_type` 0. Callers ask
    /// [`Handle::users`] first and record that it is going.
    pub fn destroy(&self, sysfs: &Sysfs) -> crate::Result<()> {
        match self {
            Handle::Vf(vf) => sysfs.set_current_vgpu_type(vf, 0),
            Handle::Mdev(uuid) => sysfs.mdev_remove(uuid),
        }
    }
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Handle::Mdev(uuid) => f.write_str(uuid),
            Handle::Vf(vf) => vf.fmt(f),
        }
    }
}
