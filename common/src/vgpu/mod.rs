//! What vGPUs a GPU can host: the one model of capacity and mixing that every daemon uses.
//!
//! [`capacity`] answers, for one GPU as an [`Inventory`] shows it, which vGPU types can be
//! created on it now, how many more of each, and on which parents. It reads sysfs's own answers
//! where the kernel gives them (`available_instances` of an mdev type, a VF's
//! `creatable_vgpu_types`) and falls back on the model table ([`models`]) where it does not
//! (a GPU whose VFs are not enabled shows no types; the vendor path lists types without counts).
//!
//! The rules, from NVIDIA's placement tables (see `VGPU-CATALOGUE.md`):
//! - a GPU that hosts mdevs itself (Turing, no SR-IOV) holds one type at a time, as many as its
//!   `available_instances` says;
//! - on an SR-IOV GPU each vGPU takes one VF, and all time-sliced vGPUs of one GPU have the same
//!   framebuffer size (equal-size mode); a size holds at most the GPU's memory over the size.
//!
//! [`mix_conflict`] states the mixing rule for a set of wanted types, so that a planner refuses
//! what [`capacity`] would never offer.
//!
//! Non-PCI mdev parents (the kernel's sample drivers) are modelled by [`parents`]; the life of
//! one vGPU made at run time (placed, recorded, created, waited for, destroyed) by
//! [`lifecycle`], which sandbox-dp's on-demand pool and sandbox-dra share.

pub mod lifecycle;
pub mod models;
pub mod parents;
pub mod selector;

use crate::{Inventory, MdevType, PciAddress, PciDevice};

use models::TypeName;

/// How a GPU makes vGPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// mdev types on the device itself (Turing, the kernel's sample drivers).
    MdevPf,
    /// mdev types on each SR-IOV VF (Ampere).
    MdevVf,
    /// `<vf>/nvidia/current_vgpu_type` on each VF (Ada, Hopper).
    Vendor,
    /// SR-IOV capable on its vGPU driver, VFs not enabled: enabling `total` shows the types.
    NeedsVfs {
        /// `sriov_totalvfs`.
        total: u32,
    },
    /// It hosts no vGPU (another driver, or no types).
    None,
}

/// A vGPU type the GPU can host, and how many more of it now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Creatable {
    /// Its name (`NVIDIA A10-4Q`), else its sysfs id (`mtty-2`).
    pub name: String,
    /// sysfs id (`nvidia-593`, `mtty-2`; the vendor path's `1145`). `None` before the VFs are
    /// enabled: the id is read by name once they are.
    pub type_id: Option<String>,
    /// Framebuffer of one instance, MiB, when sysfs or the name says.
    pub framebuffer_mb: Option<u64>,
    /// The most of this type the GPU holds when it has no other vGPU, when known.
    pub max: Option<u32>,
    /// How many more can be created now, given the vGPUs that exist.
    pub available: u32,
    /// Where the next ones go, in order: the GPU itself, or its free VFs that offer the type.
    /// Empty before the VFs are enabled.
    pub parents: Vec<String>,
}

/// One GPU's vGPU capacity now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// The GPU (the PF).
    pub gpu: PciAddress,
    /// How it makes vGPUs.
    pub mode: Mode,
    /// The vGPUs it has: `(type id, framebuffer MiB)`.
    pub existing: Vec<(String, Option<u64>)>,
    /// Every type it can host, in sysfs order (model order before the VFs exist), each with
    /// what is left of it.
    pub types: Vec<Creatable>,
}

impl Capacity {
    /// The entry for a type, by name or sysfs id.
    pub fn get(&self, name_or_id: &str) -> Option<&Creatable> {
        self.types
            .iter()
            .find(|t| t.name == name_or_id || t.type_id.as_deref() == Some(name_or_id))
    }

    /// How many more of a type (by name or id) can be created now; 0 for a type it does not offer.
    pub fn available(&self, name_or_id: &str) -> u32 {
        self.get(name_or_id).map_or(0, |t| t.available)
    }
}

/// The vGPU capacity of `gpu` as `inv` shows it. Pure: reads nothing but `inv`.
pub fn capacity(inv: &Inventory, gpu: &PciAddress) -> Capacity {
    let mut c = Capacity {
        gpu: *gpu,
        mode: Mode::None,
        existing: Vec::new(),
        types: Vec::new(),
    };
    let Some(dev) = inv.device(gpu) else {
        return c;
    };
    let nvidia = dev.vendor == 0x10de;
    let model = models::model(dev.vendor, dev.device);
    let vfs: Vec<&PciDevice> = dev.virtfns.iter().filter_map(|a| inv.device(a)).collect();
    if dev.mdev_parent {
        c.mode = Mode::MdevPf;
        let parent = dev.address.to_string();
        c.existing = existing_mdevs(inv, &[parent.as_str()]);
        for t in &dev.mdev_types {
            let mine = c.existing.iter().filter(|(id, _)| *id == t.id).count() as u32;
            let max = max_instance(t).or_else(|| {
                (c.existing.len() as u32 == mine).then_some(t.available_instances + mine)
            });
            c.types.push(Creatable {
                name: t.name.clone().unwrap_or_else(|| t.id.clone()),
                type_id: Some(t.id.clone()),
                framebuffer_mb: mdev_framebuffer_mb(t),
                max,
                available: t.available_instances,
                parents: if t.available_instances > 0 {
                    vec![parent.clone()]
                } else {
                    Vec::new()
                },
            });
        }
        return c;
    }
    let mdev_vfs: Vec<&PciDevice> = vfs.iter().copied().filter(|v| v.mdev_parent).collect();
    if !mdev_vfs.is_empty() {
        c.mode = Mode::MdevVf;
        let names: Vec<String> = mdev_vfs.iter().map(|v| v.address.to_string()).collect();
        let parents: Vec<&str> = names.iter().map(String::as_str).collect();
        c.existing = existing_mdevs(inv, &parents);
        let free: Vec<&PciDevice> = mdev_vfs
            .iter()
            .copied()
            .filter(|v| inv.mdevs_of(&v.address.to_string()).is_empty())
            .collect();
        let mut seen: Vec<&MdevType> = Vec::new();
        for t in mdev_vfs.iter().flat_map(|v| &v.mdev_types) {
            if seen.iter().any(|s| s.id == t.id) {
                continue;
            }
            seen.push(t);
            let fb = mdev_framebuffer_mb(t);
            let name = t.name.clone().unwrap_or_else(|| t.id.clone());
            let max = max_instance(t)
                .or_else(|| equal_size_max(model, &name, fb))
                .map(|m| m.min(mdev_vfs.len() as u32));
            let offering: Vec<String> = free
                .iter()
                .filter(|v| {
                    v.mdev_types
                        .iter()
                        .any(|x| x.id == t.id && x.available_instances > 0)
                })
                .map(|v| v.address.to_string())
                .collect();
            c.types.push(sized(
                nvidia,
                &c.existing,
                name,
                Some(t.id.clone()),
                fb,
                max,
                offering,
            ));
        }
        return c;
    }
    let vendor_vfs: Vec<&PciDevice> = vfs
        .iter()
        .copied()
        .filter(|v| v.nvidia_vgpu.is_some())
        .collect();
    if !vendor_vfs.is_empty() {
        c.mode = Mode::Vendor;
        let mut order: Vec<(u32, String)> = Vec::new();
        for v in &vendor_vfs {
            let Some(nv) = &v.nvidia_vgpu else { continue };
            if nv.current != 0 {
                let name = nv.current_name.as_deref();
                c.existing
                    .push((nv.current.to_string(), name.and_then(framebuffer_from_name)));
            }
            for t in &nv.creatable {
                if !order.iter().any(|(id, _)| *id == t.id) {
                    order.push((t.id, t.name.clone()));
                }
            }
        }
        for (id, name) in order {
            let fb = framebuffer_from_name(&name);
            let max = equal_size_max(model, &name, fb).map(|m| m.min(vendor_vfs.len() as u32));
            let offering: Vec<String> = vendor_vfs
                .iter()
                .filter(|v| {
                    v.nvidia_vgpu.as_ref().is_some_and(|nv| {
                        nv.current == 0 && nv.creatable.iter().any(|t| t.id == id)
                    })
                })
                .map(|v| v.address.to_string())
                .collect();
            c.types.push(sized(
                nvidia,
                &c.existing,
                name,
                Some(id.to_string()),
                fb,
                max,
                offering,
            ));
        }
        return c;
    }
    if let Some(total) = needs_vfs(dev) {
        c.mode = Mode::NeedsVfs { total };
        if let Some(m) = model {
            for (name, size) in m.types_before_vfs() {
                let max = m.equal_size_max(size).min(total);
                c.types.push(Creatable {
                    name,
                    type_id: None,
                    framebuffer_mb: Some(u64::from(size) * 1024),
                    max: Some(max),
                    available: max,
                    parents: Vec::new(),
                });
            }
        }
    }
    c
}

/// `sriov_totalvfs` of a GPU on its vGPU driver whose VFs are not enabled. NVIDIA's VFs offer
/// vGPU types only under the nvidia driver (not nouveau or vfio-pci).
pub fn needs_vfs(dev: &PciDevice) -> Option<u32> {
    match (dev.sriov_totalvfs, dev.sriov_numvfs) {
        (Some(total), Some(0) | None)
            if total > 0
                && dev.virtfns.is_empty()
                && dev
                    .driver
                    .as_deref()
                    .is_some_and(|d| dev.vendor != 0x10de || d == "nvidia") =>
        {
            Some(total)
        }
        _ => None,
    }
}

/// Why NVIDIA vGPUs of these framebuffer sizes cannot share one GPU, or `None` when they can.
/// `on_pf`: the GPU hosts mdevs itself (no SR-IOV), where only one type lives at a time.
pub fn mix_conflict(on_pf: bool, types: usize, sizes_mb: &[u64]) -> Option<String> {
    if types < 2 {
        return None;
    }
    if on_pf {
        return Some(
            "a GPU that hosts vGPUs itself (no SR-IOV) holds one vGPU type at a time".into(),
        );
    }
    let mut sizes = sizes_mb.to_vec();
    sizes.sort();
    sizes.dedup();
    (sizes.len() > 1).then(|| {
        format!(
            "all vGPUs on one GPU must have the same framebuffer size in equal-size mode (sizes {} MiB)",
            sizes
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}

/// An SR-IOV type's entry: what is left of its size, capped by the free VFs that offer it.
fn sized(
    nvidia: bool,
    existing: &[(String, Option<u64>)],
    name: String,
    type_id: Option<String>,
    fb: Option<u64>,
    max: Option<u32>,
    mut offering: Vec<String>,
) -> Creatable {
    let other_size = nvidia
        && existing
            .iter()
            .any(|(_, s)| s.is_none() || fb.is_none() || *s != fb);
    let left = match (other_size, max) {
        (true, _) => 0,
        (false, Some(max)) => max.saturating_sub(existing.len() as u32),
        (false, None) => u32::MAX,
    };
    offering.truncate(left as usize);
    Creatable {
        name,
        type_id,
        framebuffer_mb: fb,
        max,
        available: offering.len() as u32,
        parents: offering,
    }
}

fn existing_mdevs(inv: &Inventory, parents: &[&str]) -> Vec<(String, Option<u64>)> {
    inv.mdevs
        .values()
        .filter(|m| parents.contains(&m.parent.as_str()))
        .map(|m| {
            let types = match m.parent_pci.and_then(|a| inv.device(&a)) {
                Some(d) => Some(&d.mdev_types),
                None => inv.mdev_parents.get(&m.parent).map(|p| &p.types),
            };
            let fb = types
                .and_then(|ts| ts.iter().find(|t| t.id == m.type_id))
                .and_then(mdev_framebuffer_mb)
                .or_else(|| m.type_name.as_deref().and_then(framebuffer_from_name));
            (m.type_id.clone(), fb)
        })
        .collect()
}

/// The equal-size limit of a time-sliced type of a known model.
fn equal_size_max(model: Option<&models::Model>, name: &str, fb: Option<u64>) -> Option<u32> {
    let t = TypeName::parse(name.split_whitespace().last()?)?;
    let m = model?;
    if t.mig || !m.may_make(&t) {
        return None;
    }
    let fb = fb.unwrap_or(u64::from(t.size_gib) * 1024);
    (fb > 0).then(|| (u64::from(m.memory_gib) * 1024 / fb) as u32)
}

fn max_instance(t: &MdevType) -> Option<u32> {
    description_field(t.description.as_deref(), "max_instance").and_then(|v| v.parse().ok())
}

/// Framebuffer of an mdev type: its description's `framebuffer=`, else its name.
pub fn mdev_framebuffer_mb(t: &MdevType) -> Option<u64> {
    framebuffer_from_description(t.description.as_deref())
        .or_else(|| t.name.as_deref().and_then(framebuffer_from_name))
}

/// A field of an mdev type's `description` (`num_heads=4, framebuffer=4096M, max_instance=6`).
pub fn description_field(desc: Option<&str>, key: &str) -> Option<String> {
    desc?.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// `framebuffer=4096M` of a description, in MiB.
pub fn framebuffer_from_description(desc: Option<&str>) -> Option<u64> {
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
pub fn framebuffer_from_name(name: &str) -> Option<u64> {
    let last = name.split_whitespace().last()?.rsplit('-').next()?;
    let digits: String = last.chars().take_while(|c| c.is_ascii_digit()).collect();
    let rest = &last[digits.len()..];
    if digits.is_empty() || rest.is_empty() || !rest.starts_with(|c: char| c.is_ascii_uppercase()) {
        return None;
    }
    digits.parse::<u64>().ok().map(|g| g * 1024)
}

#[cfg(test)]
mod tests;
