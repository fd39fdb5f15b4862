//! The GPU model: [`discover`] turns an [`Inventory`] into one [`Gpu`] per candidate device
//! (its backend, the types it offers, the vGPUs it has and who uses them, as [`common::usage`]
//! answers). The planner ([`crate::plan`]) works on these alone.

use std::collections::BTreeMap;
use std::fmt;

use common::vgpu::{description_field, framebuffer_from_name, mdev_framebuffer_mb};
use common::{Inventory, PciAddress, Usage, User};
use serde::Serialize;

use crate::config::TypeKey;

/// Which devices `devices:` counts: display-class PCI functions of one vendor, or any vendor's
/// vGPU-capable display functions and then non-PCI mdev parents by name.
pub use common::VendorSelector as VendorSel;

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
    /// The pool that owns it and its vGPUs, if one does (sandbox-dp's on-demand pool or
    /// sandbox-dra's, [`common::state::pool`]): no profile touches it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooled: Option<&'static str>,
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

    pub(crate) fn is_nvidia(&self) -> bool {
        self.pci.is_some() && self.ids.0 == 0x10de
    }
}

fn mdev_type_info(t: &common::MdevType) -> TypeInfo {
    TypeInfo {
        id: t.id.clone(),
        name: t.name.clone(),
        max: description_field(t.description.as_deref(), "max_instance")
            .and_then(|v| v.parse().ok()),
        framebuffer_mb: mdev_framebuffer_mb(t),
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
    let pci_vendor = vendor.pci();
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
                pooled: None,
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
        pooled: None,
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
                    framebuffer_mb: name.as_deref().and_then(framebuffer_from_name),
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
    match common::vgpu::needs_vfs(dev) {
        Some(total) => g.backend = Backend::NeedsVfs { total },
        None => {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_and_names_from_sysfs_text() {
        let t = TypeInfo {
            id: "nvidia-593".into(),
            name: Some("NVIDIA A10-4Q".into()),
            max: Some(6),
            framebuffer_mb: Some(4096),
        };
        assert!(t.matches(&TypeKey("A10-4Q".into())));
        assert!(t.matches(&TypeKey("nvidia-593".into())));
        assert!(!t.matches(&TypeKey("A10-4C".into())));
    }
}
