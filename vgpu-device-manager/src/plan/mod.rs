//! From the GPUs as sysfs shows them ([`crate::gpu`]) to what must change: [`plan`] is a pure
//! function from those and a profile to per-GPU actions.

use std::collections::BTreeMap;
use std::fmt;

use common::PciAddress;
use serde::Serialize;

use crate::config::{Entry, TypeKey};
/// The selector of [`crate::gpu::discover`], also reachable here, where the binary imports it.
pub use crate::gpu::VendorSel;
use crate::gpu::{Backend, Gpu, Handle, TypeInfo, Vgpu};

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
    /// GPUs (and mdev parents) the profile selects that a pool owns: left alone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pooled: Vec<Pooled>,
}

/// A GPU the profile selects that a pool owns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Pooled {
    /// The GPU, as plans name it (`GPU 0 (0000:41:00.0, 10de:2236)`).
    pub gpu: String,
    /// The pool (`sandbox-dp's on-demand pool`).
    pub owner: &'static str,
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
        for p in &self.pooled {
            s.push_str(&format!("{}: in {}; left alone\n", p.gpu, p.owner));
        }
        if self.gpus.is_empty() && self.pooled.is_empty() {
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
    let mut pooled = Vec::new();
    for (gi, eis) in &chosen {
        if let Some(owner) = gpus[*gi].pooled {
            pooled.push(Pooled {
                gpu: gpus[*gi].label(),
                owner,
            });
            continue;
        }
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
            pooled,
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
    let sizes: Vec<u64> = wanted
        .iter()
        .filter_map(|(_, t, _)| t.framebuffer_mb)
        .collect();
    if g.is_nvidia()
        && let Some(why) =
            common::vgpu::mix_conflict(g.backend == Backend::MdevPf, wanted.len(), &sizes)
    {
        errors.push(PlanError::Mix {
            profile: profile.into(),
            entry: ei,
            gpu: g.label(),
            types: wanted
                .iter()
                .map(|(k, _, _)| k.0.as_str())
                .collect::<Vec<_>>()
                .join(" and "),
            why,
        });
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
mod tests;
