//! From what sysfs shows to what must change: [`discover`] turns an [`Inventory`] into one
//! [`Gpu`] per candidate device (its backend, the types it offers, the vGPUs it has and who uses
//! them, as [`common::usage`] answers); [`plan`] is a pure function from those and a profile to
//! per-GPU actions.

use std::collections::BTreeMap;
use std::fmt;

use common::{Inventory, PciAddress, Usage, User};
use serde::Serialize;

use crate::config::{Entry, TypeKey};

/// Which devices `devices:` counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VendorSel {
    /// Display-class PCI functions of this vendor.
    Pci(u16),
    /// Any vendor's vGPU-capable display functions, then non-PCI mdev parents by name.
    Any,
}

impl std::str::FromStr for VendorSel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("any") {
            return Ok(VendorSel::Any);
        }
        let h = s
            .strip_prefix("0x")
            .or_else(|| s.strip_prefix("0X"))
            .unwrap_or(s);
        u16::from_str_radix(h, 16)
            .map(VendorSel::Pci)
            .map_err(|_| format!("{s:?} is not a PCI vendor id in hex (e.g. 10de) or \"any\""))
    }
}

/// How a GPU makes vGPUs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Backend {
    /// mdev types on the device itself (Turing, the kernel's sample drivers).
    MdevPf,
    /// mdev types on each SR-IOV VF (Ampere).
    MdevVf,
    /// `<vf>/nvidia/current_vgpu_type` on each VF (Ada, Hopper).
    Vendor,
    /// SR-IOV capable, but no VFs yet: enable them to see the types.
    NeedsVfs {
        /// `sriov_totalvfs`.
        total: u32,
    },
    /// Offers no vGPU types.
    Unsupported {
        /// Why, for the message.
        why: String,
    },
}

/// A vGPU type a GPU offers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TypeInfo {
    /// sysfs id: `nvidia-593`, `mtty-2`; on the vendor path the numeric id (`1145`).
    pub id: String,
    /// `NVIDIA A10-4Q`, when known.
    pub name: Option<String>,
    /// Most instances of this type one GPU holds, when sysfs says.
    pub max: Option<u32>,
    /// Framebuffer of one instance in MiB, when sysfs (or the name) says.
    pub framebuffer_mb: Option<u64>,
}

impl TypeInfo {
    /// The key a config uses for this type: the last word of its name, else its id.
    pub fn key(&self) -> String {
        type_key_of(self.name.as_deref(), &self.id)
    }

    /// Whether a config key names this type.
    pub fn matches(&self, key: &TypeKey) -> bool {
        let k = key.as_str();
        self.name
            .as_deref()
            .and_then(|n| n.split_whitespace().last())
            .is_some_and(|w| w.eq_ignore_ascii_case(k))
            || self.id == k
            || format!("nvidia-{}", self.id) == k
    }

    /// What to show: the name, else the id.
    pub fn label(&self) -> String {
        self.name.clone().unwrap_or_else(|| self.id.clone())
    }
}

/// The config key of a type name (last word) or, without one, its id.
pub fn type_key_of(name: Option<&str>, id: &str) -> String {
    name.and_then(|n| n.split_whitespace().last())
        .map(|s| s.to_string())
        .unwrap_or_else(|| id.to_string())
}

/// How to reach an existing vGPU.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "id")]
pub enum Handle {
    /// An mdev, by UUID.
    Mdev(String),
    /// A vendor-path VF, by address.
    Vf(PciAddress),
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Handle::Mdev(u) => f.write_str(u),
            Handle::Vf(a) => write!(f, "{a}"),
        }
    }
}

/// An existing vGPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Vgpu {
    /// UUID or VF address.
    pub handle: Handle,
    /// The parent (PF or VF address, or a virtual parent's name).
    pub parent: String,
    /// Its type id (`nvidia-593`, or the vendor path's `1145`).
    pub type_id: String,
    /// Its type's name, when known.
    pub type_name: Option<String>,
    /// Who uses it: processes holding it open (a running VM), pods kubelet gave it to, or
    /// unknown (a source could not be read).
    pub users: Vec<User>,
}

impl Vgpu {
    /// In use: someone uses it, or that cannot be known. Such a vGPU is never removed.
    pub fn in_use(&self) -> bool {
        !self.users.is_empty()
    }

    /// What to show.
    pub fn label(&self) -> String {
        self.type_name
            .clone()
            .unwrap_or_else(|| self.type_id.clone())
    }
}

/// One candidate device, as sysfs shows it now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// Index among the candidates (what `devices: [i]` means).
    pub index: usize,
    /// The PCI address, or a virtual parent's name.
    pub name: String,
    /// The PCI address, for PCI devices.
    pub pci: Option<PciAddress>,
    /// vendor, device, subsystem vendor, subsystem device.
    pub ids: (u16, u16, u16, u16),
    /// How it makes vGPUs.
    pub backend: Backend,
    /// The types it offers.
    pub types: Vec<TypeInfo>,
    /// The vGPUs it has.
    pub vgpus: Vec<Vgpu>,
    /// Parents that can take a vGPU: the PF itself (mdev on the PF) or each VF in order.
    pub slots: Vec<String>,
}

impl Gpu {
    /// `GPU 0 (0000:41:00.0, 10de:2236)`.
    pub fn label(&self) -> String {
        match self.pci {
            Some(_) => format!(
                "GPU {} ({}, {:04x}:{:04x})",
                self.index, self.name, self.ids.0, self.ids.1
            ),
            None => format!("GPU {} ({})", self.index, self.name),
        }
    }

    fn is_nvidia(&self) -> bool {
        self.pci.is_some() && self.ids.0 == 0x10de
    }
}

fn description_field(desc: Option<&str>, key: &str) -> Option<String> {
    desc?.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

fn framebuffer_from_description(desc: Option<&str>) -> Option<u64> {
    let v = description_field(desc, "framebuffer")?;
    let (num, unit) = v.split_at(v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len()));
    let n: u64 = num.parse().ok()?;
    match unit.trim() {
        "M" | "MB" | "" => Some(n),
        "G" | "GB" => Some(n * 1024),
        _ => None,
    }
}

/// `NVIDIA A10-4Q` → 4096, `GRID A100DX-1-10C` → 10240: the number before the series letter.
fn framebuffer_from_name(name: Option<&str>) -> Option<u64> {
    let last = name?.split_whitespace().last()?.rsplit('-').next()?;
    let digits: String = last.chars().take_while(|c| c.is_ascii_digit()).collect();
    let rest = &last[digits.len()..];
    if digits.is_empty() || rest.is_empty() || !rest.starts_with(|c: char| c.is_ascii_uppercase()) {
        return None;
    }
    digits.parse::<u64>().ok().map(|g| g * 1024)
}

fn mdev_type_info(t: &common::MdevType) -> TypeInfo {
    TypeInfo {
        id: t.id.clone(),
        name: t.name.clone(),
        max: description_field(t.description.as_deref(), "max_instance")
            .and_then(|v| v.parse().ok()),
        framebuffer_mb: framebuffer_from_description(t.description.as_deref())
            .or_else(|| framebuffer_from_name(t.name.as_deref())),
    }
}

/// Reads the candidate devices from an inventory. `usage` says who uses each vGPU; `names`
/// maps vendor-path type ids to names learnt earlier (a full card lists no types).
pub fn discover(
    inv: &Inventory,
    vendor: VendorSel,
    usage: &Usage,
    names: &BTreeMap<u32, String>,
) -> Vec<Gpu> {
    let pci_vendor = match vendor {
        VendorSel::Pci(v) => Some(v),
        VendorSel::Any => None,
    };
    let mut out = Vec::new();
    for dev in inv.gpus(pci_vendor) {
        let g = pci_gpu(inv, dev, usage, names);
        if vendor == VendorSel::Any && matches!(g.backend, Backend::Unsupported { .. }) {
            continue;
        }
        out.push(g);
    }
    if vendor == VendorSel::Any {
        for p in inv.mdev_parents.values().filter(|p| p.pci.is_none()) {
            out.push(Gpu {
                index: 0,
                name: p.name.clone(),
                pci: None,
                ids: (0, 0, 0, 0),
                backend: Backend::MdevPf,
                types: p.types.iter().map(mdev_type_info).collect(),
                vgpus: mdev_vgpus(inv, std::slice::from_ref(&p.name), usage),
                slots: vec![p.name.clone()],
            });
        }
    }
    for (i, g) in out.iter_mut().enumerate() {
        g.index = i;
    }
    out
}

fn mdev_vgpus(inv: &Inventory, parents: &[String], usage: &Usage) -> Vec<Vgpu> {
    inv.mdevs
        .values()
        .filter(|m| parents.contains(&m.parent))
        .map(|m| Vgpu {
            handle: Handle::Mdev(m.uuid.clone()),
            parent: m.parent.clone(),
            type_id: m.type_id.clone(),
            type_name: m.type_name.clone(),
            users: usage.of_mdev(m),
        })
        .collect()
}

fn pci_gpu(
    inv: &Inventory,
    dev: &common::PciDevice,
    usage: &Usage,
    names: &BTreeMap<u32, String>,
) -> Gpu {
    let mut g = Gpu {
        index: 0,
        name: dev.address.to_string(),
        pci: Some(dev.address),
        ids: (
            dev.vendor,
            dev.device,
            dev.subsystem_vendor,
            dev.subsystem_device,
        ),
        backend: Backend::Unsupported { why: String::new() },
        types: Vec::new(),
        vgpus: Vec::new(),
        slots: Vec::new(),
    };
    let vfs: Vec<&common::PciDevice> = dev.virtfns.iter().filter_map(|a| inv.device(a)).collect();
    if dev.mdev_parent {
        g.backend = Backend::MdevPf;
        g.types = dev.mdev_types.iter().map(mdev_type_info).collect();
        g.slots = vec![g.name.clone()];
        g.vgpus = mdev_vgpus(inv, &g.slots, usage);
        // Capacity fallback from available_instances when there is no description.
        let used: BTreeMap<&str, u32> = g.vgpus.iter().fold(BTreeMap::new(), |mut m, v| {
            *m.entry(v.type_id.as_str()).or_default() += 1;
            m
        });
        for (t, src) in g.types.iter_mut().zip(&dev.mdev_types) {
            if t.max.is_none() {
                let mine = used.get(t.id.as_str()).copied().unwrap_or(0);
                if used.is_empty() || mine as usize == g.vgpus.len() && mine > 0 {
                    t.max = Some(src.available_instances + mine);
                }
            }
        }
        return g;
    }
    if vfs.iter().any(|v| v.mdev_parent) {
        g.backend = Backend::MdevVf;
        g.slots = vfs
            .iter()
            .filter(|v| v.mdev_parent)
            .map(|v| v.address.to_string())
            .collect();
        let mut types: Vec<TypeInfo> = Vec::new();
        for v in &vfs {
            for t in &v.mdev_types {
                if !types.iter().any(|x| x.id == t.id) {
                    types.push(mdev_type_info(t));
                }
            }
        }
        g.types = types;
        g.vgpus = mdev_vgpus(inv, &g.slots, usage);
        return g;
    }
    if vfs.iter().any(|v| v.nvidia_vgpu.is_some()) {
        g.backend = Backend::Vendor;
        let mut known: BTreeMap<u32, String> = names.clone();
        for d in inv.devices.values() {
            if let Some(nv) = &d.nvidia_vgpu {
                for t in &nv.creatable {
                    known.insert(t.id, t.name.clone());
                }
                if let (cur, Some(n)) = (nv.current, &nv.current_name)
                    && cur != 0
                {
                    known.insert(cur, n.clone());
                }
            }
        }
        let mut types: Vec<TypeInfo> = Vec::new();
        fn add(types: &mut Vec<TypeInfo>, id: u32, name: Option<String>) {
            if !types.iter().any(|x| x.id == id.to_string()) {
                types.push(TypeInfo {
                    id: id.to_string(),
                    framebuffer_mb: framebuffer_from_name(name.as_deref()),
                    name,
                    max: None,
                });
            }
        }
        for v in &vfs {
            if let Some(nv) = &v.nvidia_vgpu {
                for t in &nv.creatable {
                    add(&mut types, t.id, Some(t.name.clone()));
                }
            }
        }
        // Types this node's GPUs of the same model showed before (learnt names).
        let same_model: Vec<u32> = inv
            .devices
            .values()
            .filter(|d| d.vendor == dev.vendor && d.device == dev.device)
            .filter_map(|d| d.nvidia_vgpu.as_ref())
            .flat_map(|nv| {
                nv.creatable
                    .iter()
                    .map(|t| t.id)
                    .chain((nv.current != 0).then_some(nv.current))
            })
            .collect();
        for id in same_model {
            add(&mut types, id, known.get(&id).cloned());
        }
        for (id, name) in names {
            // A learnt name of a type whose GPU prefix matches one this GPU offers.
            if types
                .iter()
                .any(|t| same_prefix(t.name.as_deref(), Some(name)))
            {
                add(&mut types, *id, Some(name.clone()));
            }
        }
        // The vendor path lists types without counts. A time-sliced type's equal-size limit is
        // the GPU's memory over the type's size: the model's memory, else (a GPU with no vGPU
        // lists every type) the largest type it lists.
        let busy = vfs
            .iter()
            .any(|v| v.nvidia_vgpu.as_ref().is_some_and(|nv| nv.current != 0));
        let memory_mb = crate::models::model(dev.vendor, dev.device)
            .map(|m| u64::from(m.memory_gib) * 1024)
            .or_else(|| {
                (!busy)
                    .then(|| types.iter().filter_map(|t| t.framebuffer_mb).max())
                    .flatten()
            });
        let vf_count = vfs.iter().filter(|v| v.nvidia_vgpu.is_some()).count() as u32;
        for t in &mut types {
            let time_sliced = t
                .name
                .as_deref()
                .and_then(|n| n.split_whitespace().last())
                .and_then(crate::models::TypeName::parse)
                .is_some_and(|n| !n.mig);
            if let (true, Some(mem), Some(fb)) = (time_sliced, memory_mb, t.framebuffer_mb)
                && fb > 0
            {
                t.max = Some(((mem / fb) as u32).min(vf_count));
            }
        }
        g.types = types;
        g.slots = vfs
            .iter()
            .filter(|v| v.nvidia_vgpu.is_some())
            .map(|v| v.address.to_string())
            .collect();
        for v in &vfs {
            let Some(nv) = &v.nvidia_vgpu else { continue };
            if nv.current == 0 {
                continue;
            }
            g.vgpus.push(Vgpu {
                handle: Handle::Vf(v.address),
                parent: v.address.to_string(),
                type_id: nv.current.to_string(),
                type_name: nv
                    .current_name
                    .clone()
                    .or_else(|| known.get(&nv.current).cloned()),
                users: usage.of_function(inv, &v.address),
            });
        }
        return g;
    }
    match (dev.sriov_totalvfs, dev.sriov_numvfs) {
        // NVIDIA's VFs offer vGPU types only under the nvidia driver (not nouveau or vfio-pci).
        (Some(total), Some(0) | None)
            if total > 0
                && dev.virtfns.is_empty()
                && match dev.driver.as_deref() {
                    Some(d) => dev.vendor != 0x10de || d == "nvidia",
                    None => false,
                } =>
        {
            g.backend = Backend::NeedsVfs { total };
        }
        _ => {
            g.backend = Backend::Unsupported {
                why: match &dev.driver {
                    Some(d) if dev.vendor == 0x10de && d != "nvidia" => {
                        format!("it is bound to {d}; vGPUs need the nvidia driver (vGPU manager)")
                    }
                    Some(d) => format!("it offers no vGPU types (driver {d})"),
                    None => "it offers no vGPU types (no driver bound)".into(),
                },
            };
        }
    }
    g
}

/// `NVIDIA H100XM-4C` and `NVIDIA H100XM-8C` share the GPU prefix `H100XM`.
fn same_prefix(a: Option<&str>, b: Option<&str>) -> bool {
    let p = |n: Option<&str>| {
        n.and_then(|n| n.split_whitespace().last())
            .and_then(|w| w.split_once('-'))
            .map(|(p, _)| p.to_string())
    };
    matches!((p(a), p(b)), (Some(x), Some(y)) if x == y)
}

/// A change to one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "action")]
pub enum Action {
    /// Enable SR-IOV VFs (`sriov_numvfs`); the types are read once they exist.
    EnableVfs {
        /// The PF.
        pf: PciAddress,
        /// How many.
        count: u32,
    },
    /// Remove an mdev.
    RemoveMdev {
        /// Its UUID.
        uuid: String,
        /// Its parent.
        parent: String,
        /// Its type, for messages.
        type_label: String,
    },
    /// Write `0` to a VF's `current_vgpu_type`.
    ClearVf {
        /// The VF.
        vf: PciAddress,
        /// Its type, for messages.
        type_label: String,
    },
    /// Create an mdev (the UUID is made when it is created).
    CreateMdev {
        /// Parent name.
        parent: String,
        /// Type id (`nvidia-593`).
        type_id: String,
        /// Its type, for messages.
        type_label: String,
    },
    /// Write a type id to a VF's `current_vgpu_type`.
    SetVf {
        /// The VF.
        vf: PciAddress,
        /// The numeric type id.
        type_id: u32,
        /// Its type, for messages.
        type_label: String,
    },
}

impl Action {
    /// Whether the action deletes a vGPU.
    pub fn is_removal(&self) -> bool {
        matches!(self, Action::RemoveMdev { .. } | Action::ClearVf { .. })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Action::EnableVfs { pf, count } => write!(f, "enable {count} VFs on {pf}"),
            Action::RemoveMdev {
                uuid,
                parent,
                type_label,
            } => write!(f, "remove {type_label} {uuid} (on {parent})"),
            Action::ClearVf { vf, type_label } => write!(f, "remove {type_label} on VF {vf}"),
            Action::CreateMdev {
                parent, type_label, ..
            } => write!(f, "create {type_label} on {parent}"),
            Action::SetVf { vf, type_label, .. } => write!(f, "create {type_label} on VF {vf}"),
        }
    }
}

/// What the plan does with one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuPlan {
    /// The GPU's index.
    pub index: usize,
    /// `GPU 0 (0000:41:00.0, 10de:2236)`.
    pub gpu: String,
    /// The entry that selects it: `profile[i]`.
    pub entry: String,
    /// The wanted vGPUs, key → count.
    pub want: BTreeMap<String, u32>,
    /// vGPUs that already match and stay.
    pub keep: Vec<String>,
    /// Changes, in order: removals, then creations.
    pub actions: Vec<Action>,
    /// Set when a vGPU that must go is in use: the GPU is left as it is.
    pub blocked: Vec<String>,
    /// More changes follow once the VFs exist (types cannot be read before).
    pub after_vfs: bool,
}

impl GpuPlan {
    /// Nothing to do and nothing in the way.
    pub fn is_applied(&self) -> bool {
        self.actions.is_empty() && self.blocked.is_empty() && !self.after_vfs
    }
}

/// The plan for the node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// The profile.
    pub profile: String,
    /// One per selected GPU, in index order.
    pub gpus: Vec<GpuPlan>,
    /// Things worth saying that are not errors (an index that selects no GPU).
    pub warnings: Vec<String>,
}

impl Plan {
    /// Every selected GPU is as the profile says.
    pub fn is_applied(&self) -> bool {
        self.gpus.iter().all(GpuPlan::is_applied)
    }

    /// The human-readable diff.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for w in &self.warnings {
            s.push_str(&format!("warning: {w}\n"));
        }
        if self.gpus.is_empty() {
            s.push_str(&format!(
                "profile {:?} selects no GPU on this node\n",
                self.profile
            ));
        }
        for g in &self.gpus {
            let want: Vec<String> = g.want.iter().map(|(k, n)| format!("{n}× {k}")).collect();
            let want = if want.is_empty() {
                "no vGPUs".to_string()
            } else {
                want.join(", ")
            };
            let state = if !g.blocked.is_empty() {
                "BLOCKED"
            } else if g.is_applied() {
                "applied"
            } else {
                "changes"
            };
            s.push_str(&format!(
                "{} [{}]: want {want}; keep {}: {state}\n",
                g.gpu,
                g.entry,
                g.keep.len()
            ));
            for b in &g.blocked {
                s.push_str(&format!("  ! {b}\n"));
            }
            for a in &g.actions {
                let sign = if a.is_removal() { '-' } else { '+' };
                s.push_str(&format!("  {sign} {a}\n"));
            }
            if g.after_vfs {
                s.push_str("  + then create the vGPUs (types are read once the VFs exist)\n");
            }
        }
        s
    }
}

/// Why a profile cannot be applied to this node. Nothing is changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A GPU is selected by two entries that ask for different vGPUs, and it can make both.
    #[error(
        "profile {profile:?}: {gpu} is selected by entry {first} and entry {second}, which ask for different vGPUs it can both make"
    )]
    Overlap {
        /// Profile.
        profile: String,
        /// GPU.
        gpu: String,
        /// First entry index.
        first: usize,
        /// Second entry index.
        second: usize,
    },
    /// The GPU offers no vGPU at all.
    #[error("profile {profile:?} entry {entry}: {gpu} cannot make vGPUs: {why}")]
    Unsupported {
        /// Profile.
        profile: String,
        /// Entry index.
        entry: usize,
        /// GPU.
        gpu: String,
        /// Why.
        why: String,
    },
    /// The GPU does not offer the type.
    #[error("profile {profile:?} entry {entry}: {gpu} cannot make {key:?}; it offers {offered}")]
    UnknownType {
        /// Profile.
        profile: String,
        /// Entry index.
        entry: usize,
        /// GPU.
        gpu: String,
        /// The key.
        key: String,
        /// The keys it offers.
        offered: String,
    },
    /// More than the GPU holds.
    #[error(
        "profile {profile:?} entry {entry}: {gpu} holds at most {max} {what}, the entry asks for {asked}"
    )]
    Capacity {
        /// Profile.
        profile: String,
        /// Entry index.
        entry: usize,
        /// GPU.
        gpu: String,
        /// What is counted.
        what: String,
        /// The limit.
        max: u32,
        /// What was asked.
        asked: u32,
    },
    /// Types the GPU cannot hold together.
    #[error("profile {profile:?} entry {entry}: {gpu} cannot mix {types}: {why}")]
    Mix {
        /// Profile.
        profile: String,
        /// Entry index.
        entry: usize,
        /// GPU.
        gpu: String,
        /// The types.
        types: String,
        /// The rule.
        why: String,
    },
}

impl PlanError {
    /// Whether the node may yet change so that the profile fits without any edit: a GPU that
    /// is not on its vGPU driver yet, or shows no types yet (at boot, the driver and the VFs
    /// come up after the daemon starts). A daemon retries these; the others wait for a new
    /// label or config file.
    pub fn may_pass_later(&self) -> bool {
        match self {
            PlanError::Unsupported { .. } => true,
            PlanError::UnknownType { offered, .. } => offered == NO_TYPE_NOW,
            _ => false,
        }
    }
}

/// What [`PlanError::UnknownType`] says a GPU offers when it shows no type at all.
const NO_TYPE_NOW: &str = "no type now";

/// Plans `profile` (named `name`) for `gpus`. Pure: reads nothing, writes nothing.
pub fn plan(gpus: &[Gpu], name: &str, entries: &[Entry]) -> Result<Plan, Vec<PlanError>> {
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    // Every entry that selects each GPU, in file order.
    let mut chosen: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (ei, e) in entries.iter().enumerate() {
        if let crate::config::Devices::Indices(ix) = &e.devices {
            for i in ix {
                if *i >= gpus.len() {
                    warnings.push(format!(
                        "profile {name:?} entry {ei} lists GPU index {i}, but the node has {} GPU(s)",
                        gpus.len()
                    ));
                }
            }
        }
        for g in gpus {
            let filtered = e
                .device_filter
                .as_ref()
                .is_none_or(|f| g.pci.is_some() && f.matches(g.ids.0, g.ids.1, g.ids.2, g.ids.3));
            if e.devices.matches(g.index) && filtered {
                chosen.entry(g.index).or_default().push(ei);
            }
        }
    }
    let mut out = Vec::new();
    for (gi, eis) in &chosen {
        match plan_selected(&gpus[*gi], name, entries, eis) {
            Ok(p) => out.push(p),
            Err(mut e) => errors.append(&mut e),
        }
    }
    if errors.is_empty() {
        Ok(Plan {
            profile: name.into(),
            gpus: out,
            warnings,
        })
    } else {
        Err(errors)
    }
}

/// Plans one GPU that entries `eis` (at least one) select.
///
/// Entries that ask for the same vGPUs are one wish: NVIDIA's default config repeats some
/// `device-filter` entries. Entries that differ are told apart by what the GPU can make (one
/// PCI id can be two boards, such as A2 and A16, each with its own types); when more than one
/// fits, the profile is ambiguous for this GPU.
fn plan_selected(
    g: &Gpu,
    profile: &str,
    entries: &[Entry],
    eis: &[usize],
) -> Result<GpuPlan, Vec<PlanError>> {
    let mut distinct: Vec<usize> = Vec::new();
    for &ei in eis {
        if !distinct
            .iter()
            .any(|&d| entries[d].vgpu_devices == entries[ei].vgpu_devices)
        {
            distinct.push(ei);
        }
    }
    if let [ei] = distinct[..] {
        return plan_gpu(g, profile, ei, &entries[ei]);
    }
    let mut fits = Vec::new();
    let mut errors = Vec::new();
    for &ei in &distinct {
        match plan_gpu(g, profile, ei, &entries[ei]) {
            Ok(p) => fits.push((ei, p)),
            Err(mut e) => errors.append(&mut e),
        }
    }
    // A GPU whose VFs are not enabled yet shows no types: any entry that fits its VF count
    // enables them, and the plan made after that picks the entry by the types.
    let types_unknown = matches!(g.backend, Backend::NeedsVfs { .. });
    match fits.len() {
        0 => Err(errors),
        1 => Ok(fits.remove(0).1),
        _ if types_unknown => Ok(fits.remove(0).1),
        _ => Err(vec![PlanError::Overlap {
            profile: profile.into(),
            gpu: g.label(),
            first: fits[0].0,
            second: fits[1].0,
        }]),
    }
}

/// Checks an entry for a GPU whose VFs are not enabled yet, so shows no types, against what its
/// model is known to make ([`crate::models`]): a type it cannot make, more than fit, or sizes
/// it cannot mix are refused before any VF is enabled. Keys the table cannot judge (type ids,
/// MIG-backed counts, a model it does not know) pass here; the plan made once the VFs exist
/// checks them against sysfs.
fn check_before_vfs(g: &Gpu, profile: &str, ei: usize, e: &Entry, vfs: u32) -> Vec<PlanError> {
    let asked: u32 = e.vgpu_devices.values().map(|c| c.0).sum();
    let Some(model) = crate::models::model(g.ids.0, g.ids.1) else {
        return check_fit(g, profile, ei, &[], asked, Some(vfs));
    };
    let mut errors = Vec::new();
    let mut known: Vec<(&TypeKey, TypeInfo, u32)> = Vec::new();
    for (k, c) in &e.vgpu_devices {
        let k_str = k.as_str();
        let is_id = k_str.bytes().all(|b| b.is_ascii_digit())
            || k_str
                .strip_prefix("nvidia-")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if is_id {
            continue;
        }
        match crate::models::TypeName::parse(k_str) {
            Some(t) if model.may_make(&t) => {
                if !t.mig {
                    known.push((
                        k,
                        TypeInfo {
                            id: k_str.into(),
                            name: Some(k_str.into()),
                            max: Some(model.equal_size_max(t.size_gib).min(vfs)),
                            framebuffer_mb: Some(u64::from(t.size_gib) * 1024),
                        },
                        c.0,
                    ));
                }
            }
            _ => errors.push(PlanError::UnknownType {
                profile: profile.into(),
                entry: ei,
                gpu: g.label(),
                key: k.0.clone(),
                offered: model.describe(),
            }),
        }
    }
    if !errors.is_empty() {
        return errors;
    }
    let wanted: Vec<(&TypeKey, &TypeInfo, u32)> =
        known.iter().map(|(k, t, n)| (*k, t, *n)).collect();
    check_fit(g, profile, ei, &wanted, asked, Some(vfs))
}

/// The rules a set of wanted types must meet on one GPU: NVIDIA's mixing rules for time-sliced
/// vGPUs, each type's limit, the limit of one size in all, and (`vfs`) one vGPU per VF.
/// `asked` counts every vGPU of the entry.
fn check_fit(
    g: &Gpu,
    profile: &str,
    ei: usize,
    wanted: &[(&TypeKey, &TypeInfo, u32)],
    asked: u32,
    vfs: Option<u32>,
) -> Vec<PlanError> {
    let mut errors = Vec::new();
    if g.is_nvidia() && wanted.len() > 1 {
        let types = wanted
            .iter()
            .map(|(k, _, _)| k.0.as_str())
            .collect::<Vec<_>>()
            .join(" and ");
        if g.backend == Backend::MdevPf {
            errors.push(PlanError::Mix {
                profile: profile.into(),
                entry: ei,
                gpu: g.label(),
                types,
                why: "a GPU that hosts vGPUs itself (no SR-IOV) holds one vGPU type at a time"
                    .into(),
            });
        } else {
            let mut sizes: Vec<u64> = wanted
                .iter()
                .filter_map(|(_, t, _)| t.framebuffer_mb)
                .collect();
            sizes.sort();
            sizes.dedup();
            if sizes.len() > 1 {
                errors.push(PlanError::Mix {
                    profile: profile.into(),
                    entry: ei,
                    gpu: g.label(),
                    types,
                    why: format!(
                        "all vGPUs on one GPU must have the same framebuffer size in equal-size \
                         mode (sizes {} MiB)",
                        sizes
                            .iter()
                            .map(|s| s.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
        }
    }
    for (k, t, n) in wanted {
        if let Some(max) = t.max
            && *n > max
        {
            errors.push(PlanError::Capacity {
                profile: profile.into(),
                entry: ei,
                gpu: g.label(),
                what: format!("{k} vGPUs"),
                max,
                asked: *n,
            });
        }
    }
    let total: u32 = wanted.iter().map(|(_, _, n)| n).sum();
    if g.is_nvidia()
        && wanted.len() > 1
        && errors.is_empty()
        && let Some(max) = wanted.iter().filter_map(|(_, t, _)| t.max).min()
        && total > max
    {
        errors.push(PlanError::Capacity {
            profile: profile.into(),
            entry: ei,
            gpu: g.label(),
            what: "vGPUs of this size in all".into(),
            max,
            asked: total,
        });
    }
    if let Some(vfs) = vfs
        && asked > vfs
    {
        errors.push(PlanError::Capacity {
            profile: profile.into(),
            entry: ei,
            gpu: g.label(),
            what: format!("vGPUs (one per VF, {vfs} VFs)"),
            max: vfs,
            asked,
        });
    }
    errors
}

fn plan_gpu(g: &Gpu, profile: &str, ei: usize, e: &Entry) -> Result<GpuPlan, Vec<PlanError>> {
    let want: BTreeMap<String, u32> = e
        .vgpu_devices
        .iter()
        .map(|(k, c)| (k.0.clone(), c.0))
        .collect();
    let mut p = GpuPlan {
        index: g.index,
        gpu: g.label(),
        entry: format!("{profile}[{ei}]"),
        want,
        keep: Vec::new(),
        actions: Vec::new(),
        blocked: Vec::new(),
        after_vfs: false,
    };
    let err_ctx = |f: &dyn Fn(String, usize, String) -> PlanError| f(profile.into(), ei, g.label());
    match &g.backend {
        Backend::Unsupported { why } => {
            if e.vgpu_devices.is_empty() {
                return Ok(p);
            }
            return Err(vec![err_ctx(&|profile, entry, gpu| {
                PlanError::Unsupported {
                    profile,
                    entry,
                    gpu,
                    why: why.clone(),
                }
            })]);
        }
        Backend::NeedsVfs { total } => {
            if e.vgpu_devices.is_empty() {
                return Ok(p);
            }
            let errors = check_before_vfs(g, profile, ei, e, *total);
            if !errors.is_empty() {
                return Err(errors);
            }
            if let Some(pf) = g.pci {
                p.actions.push(Action::EnableVfs { pf, count: *total });
            }
            p.after_vfs = true;
            return Ok(p);
        }
        _ => {}
    }
    // Resolve each key to a type.
    let mut errors = Vec::new();
    let mut wanted: Vec<(&TypeKey, &TypeInfo, u32)> = Vec::new();
    for (k, c) in &e.vgpu_devices {
        match g.types.iter().find(|t| t.matches(k)) {
            Some(t) => wanted.push((k, t, c.0)),
            None => {
                let mut offered: Vec<String> = g.types.iter().map(TypeInfo::key).collect();
                offered.sort();
                offered.dedup();
                errors.push(PlanError::UnknownType {
                    profile: profile.into(),
                    entry: ei,
                    gpu: g.label(),
                    key: k.0.clone(),
                    offered: if offered.is_empty() {
                        NO_TYPE_NOW.into()
                    } else {
                        offered.join(", ")
                    },
                });
            }
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let vfs =
        matches!(g.backend, Backend::MdevVf | Backend::Vendor).then_some(g.slots.len() as u32);
    let asked: u32 = wanted.iter().map(|(_, _, n)| n).sum();
    let errors = check_fit(g, profile, ei, &wanted, asked, vfs);
    if !errors.is_empty() {
        return Err(errors);
    }
    // Keep what matches (in-use ones first), remove the rest, create what is missing.
    let mut existing: Vec<&Vgpu> = g.vgpus.iter().collect();
    existing.sort_by_key(|v| !v.in_use());
    let mut kept_per_type: BTreeMap<&str, u32> = BTreeMap::new();
    let mut removals: Vec<&Vgpu> = Vec::new();
    for v in existing {
        let target = wanted.iter().find(|(_, t, _)| t.id == v.type_id);
        match target {
            Some((_, t, n)) if kept_per_type.get(t.id.as_str()).copied().unwrap_or(0) < *n => {
                *kept_per_type.entry(t.id.as_str()).or_default() += 1;
                p.keep.push(format!("{} {}", v.label(), v.handle));
            }
            _ => removals.push(v),
        }
    }
    p.keep.sort();
    let busy: Vec<&Vgpu> = removals.iter().copied().filter(|v| v.in_use()).collect();
    if !busy.is_empty() {
        for v in busy {
            p.blocked.push(format!(
                "{} {} must be removed but is in use: {}",
                v.label(),
                v.handle,
                common::usage::describe(&v.users)
            ));
        }
        return Ok(p);
    }
    let mut freed: Vec<String> = Vec::new();
    for v in &removals {
        freed.push(v.parent.clone());
        p.actions.push(match &v.handle {
            Handle::Mdev(u) => Action::RemoveMdev {
                uuid: u.clone(),
                parent: v.parent.clone(),
                type_label: v.label(),
            },
            Handle::Vf(a) => Action::ClearVf {
                vf: *a,
                type_label: v.label(),
            },
        });
    }
    // Parents free after the removals, in slot order.
    let occupied: Vec<&str> = g
        .vgpus
        .iter()
        .filter(|v| !removals.iter().any(|r| r.handle == v.handle))
        .map(|v| v.parent.as_str())
        .collect();
    let mut free = g
        .slots
        .iter()
        .filter(|s| !occupied.contains(&s.as_str()))
        .cloned();
    for (_, t, n) in &wanted {
        let have = kept_per_type.get(t.id.as_str()).copied().unwrap_or(0);
        for _ in have..*n {
            match g.backend {
                Backend::MdevPf => p.actions.push(Action::CreateMdev {
                    parent: g.name.clone(),
                    type_id: t.id.clone(),
                    type_label: t.label(),
                }),
                Backend::MdevVf => {
                    let Some(vf) = free.next() else { break };
                    p.actions.push(Action::CreateMdev {
                        parent: vf,
                        type_id: t.id.clone(),
                        type_label: t.label(),
                    });
                }
                Backend::Vendor => {
                    let Some(vf) = free.next() else { break };
                    let (Ok(vf), Ok(id)) = (vf.parse::<PciAddress>(), t.id.parse::<u32>()) else {
                        continue;
                    };
                    p.actions.push(Action::SetVf {
                        vf,
                        type_id: id,
                        type_label: t.label(),
                    });
                }
                _ => {}
            }
        }
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn a10_type(id: u32, key: &str, max: u32, fb: u64) -> TypeInfo {
        TypeInfo {
            id: format!("nvidia-{id}"),
            name: Some(format!("NVIDIA {key}")),
            max: Some(max),
            framebuffer_mb: Some(fb),
        }
    }

    /// An A10 with `vfs` VFs (mdev on VFs) and the given vGPUs: (VF index, type id, held).
    fn a10(index: usize, bus: u8, vgpus: &[(usize, u32, bool)]) -> Gpu {
        let vf = |i: usize| format!("0000:{bus:02x}:{:02x}.{}", (4 + i) / 8, (4 + i) % 8);
        Gpu {
            index,
            name: format!("0000:{bus:02x}:00.0"),
            pci: Some(format!("0000:{bus:02x}:00.0").parse().unwrap()),
            ids: (0x10de, 0x2236, 0x10de, 0x1482),
            backend: Backend::MdevVf,
            types: vec![
                a10_type(593, "A10-4Q", 6, 4096),
                a10_type(610, "A10-4C", 6, 4096),
                a10_type(595, "A10-8Q", 3, 8192),
            ],
            vgpus: vgpus
                .iter()
                .map(|(i, t, held)| Vgpu {
                    handle: Handle::Mdev(format!(
                        "00000000-0000-4000-8000-{bus:02x}00000000{i:02}"
                    )),
                    parent: vf(*i),
                    type_id: format!("nvidia-{t}"),
                    type_name: None,
                    users: if *held {
                        vec![User::Process(common::usage::Process {
                            pid: 42,
                            comm: "qemu-kvm".into(),
                            path: "/dev/vfio/99".into(),
                        })]
                    } else {
                        vec![]
                    },
                })
                .collect(),
            slots: (0..32).map(vf).collect(),
        }
    }

    fn profile(yaml_entries: &str) -> Config {
        Config::parse(&format!("version: v1\nvgpu-configs:\n  p:\n{yaml_entries}")).unwrap()
    }

    fn run(gpus: &[Gpu], yaml_entries: &str) -> Result<Plan, Vec<PlanError>> {
        let c = profile(yaml_entries);
        plan(gpus, "p", c.profile("p").unwrap())
    }

    #[test]
    fn keeps_matching_removes_extras_creates_missing() {
        let gpus = [a10(
            0,
            0x41,
            &[(0, 593, false), (1, 595, false), (2, 593, false)],
        )];
        let p = run(
            &gpus,
            "    - devices: all\n      vgpu-devices: {A10-4Q: 4}\n",
        )
        .unwrap();
        let g = &p.gpus[0];
        assert_eq!(g.keep.len(), 2);
        assert_eq!(
            g.actions.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            vec![
                "remove nvidia-595 00000000-0000-4000-8000-410000000001 (on 0000:41:00.5)",
                "create NVIDIA A10-4Q on 0000:41:00.5",
                "create NVIDIA A10-4Q on 0000:41:00.7",
            ]
        );
    }

    #[test]
    fn an_applied_gpu_plans_nothing() {
        let v: Vec<(usize, u32, bool)> = (0..6).map(|i| (i, 593, false)).collect();
        let gpus = [a10(0, 0x41, &v)];
        let p = run(
            &gpus,
            "    - devices: all\n      vgpu-devices: {A10-4Q: 6}\n",
        )
        .unwrap();
        assert!(p.is_applied());
    }

    #[test]
    fn shrinking_keeps_the_held_one_and_removing_it_blocks() {
        let gpus = [a10(0, 0x41, &[(0, 593, false), (1, 593, true)])];
        let p = run(
            &gpus,
            "    - devices: all\n      vgpu-devices: {A10-4Q: 1}\n",
        )
        .unwrap();
        let g = &p.gpus[0];
        assert!(g.blocked.is_empty());
        assert_eq!(
            g.keep,
            vec!["nvidia-593 00000000-0000-4000-8000-410000000001"]
        );
        assert_eq!(g.actions.len(), 1);
        let p = run(
            &gpus,
            "    - devices: all\n      vgpu-devices: {A10-8Q: 1}\n",
        )
        .unwrap();
        let g = &p.gpus[0];
        assert!(g.actions.is_empty());
        assert_eq!(g.blocked.len(), 1);
        assert!(
            g.blocked[0].contains("pid 42 (qemu-kvm) holds /dev/vfio/99"),
            "{g:?}"
        );
    }

    #[test]
    fn errors_name_profile_entry_and_gpu() {
        let gpus = [a10(0, 0x41, &[]), a10(1, 0x61, &[])];
        let e = run(
            &gpus,
            "    - devices: [1]\n      vgpu-devices: {T4-4Q: 1}\n",
        )
        .unwrap_err();
        assert_eq!(
            e[0].to_string(),
            "profile \"p\" entry 0: GPU 1 (0000:61:00.0, 10de:2236) cannot make \"T4-4Q\"; it offers A10-4C, A10-4Q, A10-8Q"
        );
        let e = run(
            &gpus,
            "    - devices: all\n      vgpu-devices: {A10-8Q: 4}\n",
        )
        .unwrap_err();
        assert_eq!(e.len(), 2);
        assert!(
            e[0].to_string()
                .contains("at most 3 A10-8Q vGPUs, the entry asks for 4")
        );
        let e = run(
            &gpus,
            "    - devices: all\n      vgpu-devices: {A10-4Q: 1, A10-8Q: 1}\n",
        )
        .unwrap_err();
        assert!(
            e[0].to_string().contains("cannot mix A10-4Q and A10-8Q"),
            "{e:?}"
        );
        // Same size mixes, within the shared maximum.
        assert!(
            run(
                &gpus,
                "    - devices: all\n      vgpu-devices: {A10-4Q: 3, A10-4C: 3}\n"
            )
            .is_ok()
        );
        let e = run(
            &gpus,
            "    - devices: all\n      vgpu-devices: {A10-4Q: 4, A10-4C: 3}\n",
        )
        .unwrap_err();
        assert!(
            e[0].to_string()
                .contains("at most 6 vGPUs of this size in all"),
            "{e:?}"
        );
        let e = run(
            &gpus,
            "    - devices: all\n      vgpu-devices: {A10-4Q: 1}\n    - devices: [0]\n      vgpu-devices: {A10-8Q: 1}\n",
        )
        .unwrap_err();
        assert!(
            e[0].to_string().contains("selected by entry 0 and entry 1"),
            "{e:?}"
        );
    }

    #[test]
    fn repeated_entries_are_one_wish_and_types_pick_between_boards() {
        let gpus = [a10(0, 0x41, &[]), a10(1, 0x61, &[])];
        // The same filter twice with the same vGPUs, as NVIDIA's default config has it.
        let twice = "    - device-filter: \"0x223610DE\"\n      devices: all\n      vgpu-devices: {A10-8Q: 2}\n";
        let p = run(&gpus, &twice.repeat(2)).unwrap();
        assert_eq!(p.gpus.len(), 2);
        assert!(p.gpus.iter().all(|g| g.entry == "p[0]"), "{p:?}");
        // One PCI id, two boards: the entry whose types the GPU offers is the one applied.
        let boards = "    - device-filter: \"0x223610DE\"\n      devices: all\n      vgpu-devices: {T4-8Q: 2}\n    - device-filter: \"0x223610DE\"\n      devices: all\n      vgpu-devices: {A10-4Q: 2}\n";
        let p = run(&gpus, boards).unwrap();
        assert!(p.gpus.iter().all(|g| g.entry == "p[1]"), "{p:?}");
        // Neither fits: both reasons are given.
        let e = run(&gpus, &boards.replace("A10-4Q", "A16-4Q")).unwrap_err();
        assert_eq!(e.len(), 4, "{e:?}");
        assert!(e[1].to_string().contains("cannot make \"A16-4Q\""), "{e:?}");
    }

    #[test]
    fn filters_and_missing_indices() {
        let gpus = [a10(0, 0x41, &[]), a10(1, 0x61, &[])];
        let p = run(
            &gpus,
            "    - devices: all\n      device-filter: \"0x1EB810DE\"\n      vgpu-devices: {T4-4Q: 1}\n",
        )
        .unwrap();
        assert!(p.gpus.is_empty());
        let p = run(
            &gpus,
            "    - devices: [1, 5]\n      vgpu-devices: {A10-8Q: 1}\n",
        )
        .unwrap();
        assert_eq!(p.gpus.len(), 1);
        assert_eq!(p.gpus[0].index, 1);
        assert!(p.warnings[0].contains("GPU index 5"), "{:?}", p.warnings);
    }

    #[test]
    fn type_ids_and_names_from_sysfs_text() {
        assert_eq!(
            framebuffer_from_description(Some(
                "num_heads=4, frl_config=60, framebuffer=4096M, max_resolution=7680x4320, max_instance=6"
            )),
            Some(4096)
        );
        assert_eq!(
            framebuffer_from_name(Some("GRID A100DX-1-10C")),
            Some(10240)
        );
        assert_eq!(framebuffer_from_name(Some("NVIDIA L40S-48Q")), Some(49152));
        assert_eq!(framebuffer_from_name(Some("mtty-2")), None);
        let t = a10_type(593, "A10-4Q", 6, 4096);
        assert!(t.matches(&TypeKey("A10-4Q".into())));
        assert!(t.matches(&TypeKey("nvidia-593".into())));
        assert!(!t.matches(&TypeKey("A10-4C".into())));
        assert_eq!("any".parse::<VendorSel>(), Ok(VendorSel::Any));
        assert_eq!("0x10DE".parse::<VendorSel>(), Ok(VendorSel::Pci(0x10de)));
        assert!("nvidia".parse::<VendorSel>().is_err());
    }

    #[test]
    fn vendor_any_admits_virtual_mdev_parents() {
        let mut inv = Inventory::default();
        let ty = |id: &str, avail: u32| common::MdevType {
            id: id.into(),
            name: None,
            available_instances: avail,
            device_api: Some("vfio-pci".into()),
            description: None,
            devices: vec![],
        };
        inv.mdev_parents.insert(
            "mtty".into(),
            common::MdevParent {
                name: "mtty".into(),
                pci: None,
                types: vec![ty("mtty-1", 4), ty("mtty-2", 2)],
            },
        );
        inv.mdevs.insert(
            "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001".into(),
            common::MdevDevice {
                uuid: "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001".into(),
                type_id: "mtty-1".into(),
                type_name: None,
                parent: "mtty".into(),
                parent_pci: None,
                iommu_group: Some(3),
                driver: None,
                vfio_cdev: None,
            },
        );
        let (none, names) = (Usage::default(), BTreeMap::new());
        assert!(discover(&inv, VendorSel::Pci(0x10de), &none, &names).is_empty());
        let gpus = discover(&inv, VendorSel::Any, &none, &names);
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus[0].label(), "GPU 0 (mtty)");
        let p = run(
            &gpus,
            "    - devices: [0]\n      vgpu-devices: {mtty-2: 1}\n",
        )
        .unwrap();
        assert_eq!(
            p.gpus[0]
                .actions
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>(),
            vec![
                "remove mtty-1 83b8f4f2-509f-382f-3c1e-e6bfe0fa1001 (on mtty)",
                "create mtty-2 on mtty"
            ]
        );
    }
}
