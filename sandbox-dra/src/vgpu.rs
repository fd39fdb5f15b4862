//! vGPUs as partitionable devices: which GPUs the driver publishes as vGPUs (`--vgpu`), and
//! the sysfs side of preparing one (create exactly the allocated vGPU) and unpreparing it
//! (destroy it, never while a process holds it).
//!
//! The model of what a GPU can host is [`common::vgpu`], the one sandbox-dp's on-demand mode
//! and vgpu-device-manager plan with; the writes are [`common::Sysfs`]'s.
//!
//! Kubernetes' counters cannot say "all time-sliced vGPUs of one GPU have one size" (NVIDIA's
//! equal-size rule: a sum of framebuffers that fits may still be refused), so the scheduler may
//! allocate an `A10-8Q` on a GPU that holds an `A10-4Q`. Prepare refuses it with the GPU and
//! both types named ([`mix_refusal`]); kubelet shows that as the pod's event.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use common::vgpu::{Capacity, Mode, capacity, mix_conflict};
use common::{HostPaths, Inventory, PciAddress, Sysfs, state};
use serde::{Deserialize, Serialize};

use crate::names;

/// Which GPUs are published as vGPUs (`--vgpu`): `all`, every NVIDIA GPU whose model the vGPU
/// model table knows, or the GPUs and non-PCI mdev parents listed.
pub use common::vgpu::selector::Selector;

/// Parses `--vgpu all|BDF,…|PARENT,…` ([`common::vgpu::selector::parse_selector`]); an mdev
/// parent must also be fit to stand in a device name (lowercase letters, digits and `-`), which
/// the ResourceSlice's device names are made of.
pub fn parse_selector(s: &str) -> Result<Selector, String> {
    let sel = common::vgpu::selector::parse_selector(s)?;
    if let Selector::Listed { parents, .. } = &sel
        && let Some(p) = parents.iter().find(|p| !names::is_name_part(p))
    {
        return Err(format!(
            "mdev parent {p:?} cannot name a device in a ResourceSlice: only lowercase letters, \
             digits and - may"
        ));
    }
    Ok(sel)
}

/// The mdev parents `sel` names that this node has (`<sys>/class/mdev_bus/<name>`, not a PCI
/// function); one it does not have is logged and left out.
pub fn mdev_parents(inv: &Inventory, sel: &Selector) -> BTreeSet<String> {
    let Selector::Listed { parents, .. } = sel else {
        return BTreeSet::new();
    };
    parents
        .iter()
        .filter(|p| {
            let there = inv.mdev_parents.get(*p).is_some_and(|m| m.pci.is_none());
            if !there {
                tracing::warn!(parent = %p, "--vgpu names an mdev parent this node does not have");
            }
            there
        })
        .cloned()
        .collect()
}

/// The GPUs and non-PCI mdev parents `sel` names on this node, written as sandbox-dra's pool
/// ([`state::pool::write_dra`]), so that vgpu-device-manager leaves them alone; refused when
/// sandbox-dp's on-demand pool holds one.
pub fn claim_pool(paths: &HostPaths, sel: &Selector) -> anyhow::Result<state::pool::Members> {
    let inv = Inventory::read(paths).context("cannot read the node's PCI devices")?;
    let gpus: BTreeSet<PciAddress> = inv
        .gpus(Some(0x10de))
        .into_iter()
        .filter(|d| !d.is_vf())
        .filter(|d| common::vgpu::models::model(d.vendor, d.device).is_some())
        .filter(|d| match sel {
            Selector::All => true,
            Selector::Listed { gpus, .. } => gpus.contains(&d.address),
        })
        .map(|d| d.address)
        .collect();
    if let Selector::Listed { gpus: want, .. } = sel {
        for a in want.difference(&gpus) {
            tracing::warn!(gpu = %a, "--vgpu names a GPU this node does not have, or one whose vGPU model is unknown");
        }
    }
    let pool = state::pool::Members {
        gpus,
        parents: mdev_parents(&inv, sel),
    };
    state::pool::write_dra(paths, &pool)
        .with_context(|| "cannot record the GPUs and mdev parents of --vgpu as sandbox-dra's")?;
    if !pool.is_empty() {
        tracing::info!(gpus = ?pool.gpus.iter().map(ToString::to_string).collect::<Vec<_>>(), parents = ?pool.parents, "vGPU pool");
    }
    Ok(pool)
}

/// A vGPU made for a claim, as its record holds it (written before the sysfs write).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vgpu {
    /// The GPU (the PF).
    pub gpu: PciAddress,
    /// `NVIDIA A10-4Q`.
    pub type_name: String,
    /// The mdev's UUID, or on the vendor path the VF whose `current_vgpu_type` is set.
    pub handle: String,
    /// The vendor path (`handle` is a VF).
    pub vendor: bool,
}

impl Vgpu {
    /// Whether it exists on the node `inv` shows.
    pub fn exists(&self, inv: &Inventory) -> bool {
        if self.vendor {
            self.vf()
                .and_then(|a| inv.device(&a))
                .and_then(|d| d.nvidia_vgpu.as_ref())
                .is_some_and(|nv| nv.current != 0)
        } else {
            inv.mdevs.contains_key(&self.handle)
        }
    }

    /// The VF of a vendor-path vGPU.
    pub fn vf(&self) -> Option<PciAddress> {
        self.vendor.then(|| self.handle.parse().ok()).flatten()
    }

    /// Who holds it: processes holding its group node or cdev, pods kubelet gave it to.
    pub fn users(&self, usage: &common::Usage, inv: &Inventory) -> Vec<String> {
        let users = match self.vf() {
            Some(vf) => usage.of_function(inv, &vf),
            None => inv
                .mdevs
                .get(&self.handle)
                .map(|m| usage.of_mdev(m))
                .unwrap_or_default(),
        };
        users.iter().map(ToString::to_string).collect()
    }

    /// Its IOMMU group, once the kernel made it.
    pub fn group(&self, inv: &Inventory) -> Option<u32> {
        match self.vf() {
            Some(vf) => inv.device(&vf)?.iommu_group,
            None => inv.mdevs.get(&self.handle)?.iommu_group,
        }
    }

    /// Its VFIO cdev (`vfio3`), where the kernel has one.
    pub fn cdev(&self, inv: &Inventory) -> Option<String> {
        match self.vf() {
            Some(vf) => inv.device(&vf)?.vfio_cdev.clone(),
            None => inv.mdevs.get(&self.handle)?.vfio_cdev.clone(),
        }
    }
}

/// An mdev made for a claim on a parent that is not a PCI function (`mtty`), as its record
/// holds it (written before the sysfs write).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mdev {
    /// The parent's name under `class/mdev_bus/`.
    pub parent: String,
    /// The type id (`mtty-2`).
    pub type_id: String,
    /// The mdev's UUID.
    pub uuid: String,
}

impl Mdev {
    /// A new mdev of `type_id` on `parent`, with a fresh UUID.
    pub fn new(parent: &str, type_id: &str) -> Mdev {
        Mdev {
            parent: parent.to_string(),
            type_id: type_id.to_string(),
            uuid: uuid::Uuid::new_v4().to_string(),
        }
    }

    /// Whether it exists on the node `inv` shows.
    pub fn exists(&self, inv: &Inventory) -> bool {
        inv.mdevs.contains_key(&self.uuid)
    }

    /// Who holds it: processes holding its group node or cdev.
    pub fn users(&self, usage: &common::Usage, inv: &Inventory) -> Vec<String> {
        inv.mdevs
            .get(&self.uuid)
            .map(|m| usage.of_mdev(m))
            .unwrap_or_default()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// Its IOMMU group, once the kernel made it.
    pub fn group(&self, inv: &Inventory) -> Option<u32> {
        inv.mdevs.get(&self.uuid)?.iommu_group
    }

    /// Its VFIO cdev, where the kernel has one.
    pub fn cdev(&self, inv: &Inventory) -> Option<String> {
        inv.mdevs.get(&self.uuid)?.vfio_cdev.clone()
    }

    /// Creates it (`mdev_supported_types/<type>/create`).
    pub fn create(&self, paths: &HostPaths) -> common::Result<()> {
        Sysfs::new(paths.clone()).mdev_create(&self.parent, &self.type_id, &self.uuid)
    }

    /// Removes it (its `remove`).
    pub fn destroy(&self, paths: &HostPaths) -> common::Result<()> {
        Sysfs::new(paths.clone()).mdev_remove(&self.uuid)
    }
}

/// What the node must do for a vGPU of type `key` (`a10-4q`) on `gpu`, read from `inv`.
#[derive(Debug)]
pub enum Step {
    /// Enable the GPU's VFs first (`sriov_numvfs`), then look again.
    EnableVfs(u32),
    /// Create it: the vGPU to record, then write.
    Create(Vgpu, String),
}

/// The type entry of `cap` for a device name's type key.
fn type_of<'a>(cap: &'a Capacity, key: &str) -> Option<&'a common::vgpu::Creatable> {
    cap.types.iter().find(|t| names::type_key(&t.name) == key)
}

/// Why a vGPU of `key` cannot join the vGPUs `gpu` has, naming the GPU and the types; `None`
/// when it can.
pub fn mix_refusal(cap: &Capacity, key: &str) -> Option<String> {
    let t = type_of(cap, key)?;
    let mut ids: BTreeSet<&str> = cap.existing.iter().map(|(id, _)| id.as_str()).collect();
    if cap.existing.is_empty() {
        return None;
    }
    let mut sizes: Vec<u64> = cap.existing.iter().filter_map(|(_, s)| *s).collect();
    if let Some(id) = t.type_id.as_deref() {
        ids.insert(id);
    }
    sizes.extend(t.framebuffer_mb);
    let why = mix_conflict(cap.mode == Mode::MdevPf, ids.len(), &sizes)?;
    let have: BTreeSet<String> = cap
        .existing
        .iter()
        .map(|(id, _)| cap.get(id).map_or_else(|| id.clone(), |t| t.name.clone()))
        .collect();
    Some(format!(
        "GPU {} holds {}; {} cannot join it: {why}",
        cap.gpu,
        have.into_iter().collect::<Vec<_>>().join(", "),
        t.name
    ))
}

/// The next step towards a vGPU of type `key` on `gpu`, or why there is none.
pub fn next_step(inv: &Inventory, gpu: &PciAddress, key: &str) -> Result<Step, String> {
    let cap = capacity(inv, gpu);
    if let Mode::NeedsVfs { total } = cap.mode {
        return Ok(Step::EnableVfs(total));
    }
    let Some(t) = type_of(&cap, key) else {
        return Err(format!(
            "GPU {gpu} offers no vGPU type {key} (it offers {})",
            cap.types
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    };
    if let Some(why) = mix_refusal(&cap, key) {
        return Err(why);
    }
    let (Some(type_id), Some(parent)) = (t.type_id.clone(), t.parents.first().cloned()) else {
        return Err(format!(
            "GPU {gpu} has no room for another {} ({} exist)",
            t.name,
            cap.existing.len()
        ));
    };
    let vendor = cap.mode == Mode::Vendor;
    let handle = if vendor {
        parent.clone()
    } else {
        uuid::Uuid::new_v4().to_string()
    };
    Ok(Step::Create(
        Vgpu {
            gpu: *gpu,
            type_name: t.name.clone(),
            handle,
            vendor,
        },
        format!("{parent}\n{type_id}"),
    ))
}

/// Writes what [`Step::Create`] names: the mdev's `create`, or the VF's `current_vgpu_type`.
pub fn create(paths: &HostPaths, v: &Vgpu, target: &str) -> common::Result<()> {
    let (parent, type_id) = target.split_once('\n').unwrap_or((target, ""));
    let sysfs = Sysfs::new(paths.clone());
    match v.vf() {
        Some(vf) => match type_id.parse::<u32>() {
            Ok(n) => sysfs.set_current_vgpu_type(&vf, n),
            Err(_) => Err(common::Error::Parse {
                path: paths.pci_device(&vf),
                reason: format!("vendor vGPU type id {type_id:?} is not a number"),
            }),
        },
        None => sysfs.mdev_create(parent, type_id, &v.handle),
    }
}

/// Destroys `v` when it exists: the mdev's `remove`, or `current_vgpu_type` 0.
pub fn destroy(paths: &HostPaths, v: &Vgpu) -> common::Result<()> {
    let sysfs = Sysfs::new(paths.clone());
    match v.vf() {
        Some(vf) => sysfs.set_current_vgpu_type(&vf, 0),
        None => sysfs.mdev_remove(&v.handle),
    }
}

/// Reads the node until `v`'s VFIO group node exists (up to two seconds): the inventory then.
pub fn wait_ready(paths: &HostPaths, v: &Vgpu) -> Option<(Inventory, u32)> {
    wait_group(paths, |inv| v.group(inv))
}

/// Reads the node until the VFIO group node of the group `group_of` finds exists (up to two
/// seconds): the inventory then.
pub fn wait_group(
    paths: &HostPaths,
    group_of: impl Fn(&Inventory) -> Option<u32>,
) -> Option<(Inventory, u32)> {
    let end = Instant::now() + Duration::from_secs(2);
    loop {
        if let Ok(inv) = Inventory::read(paths)
            && let Some(g) = group_of(&inv)
            && inv.vfio_nodes.contains(&g)
        {
            return Some((inv, g));
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_take_only_parents_that_can_name_a_device() {
        assert_eq!(parse_selector("all"), Ok(Selector::All));
        let a: PciAddress = "0000:41:00.0".parse().unwrap();
        assert_eq!(
            parse_selector("mtty,0000:41:00.0"),
            Ok(Selector::Listed {
                gpus: [a].into(),
                parents: ["mtty".to_string()].into()
            })
        );
        // A kernel device name, but not a DNS label.
        let e = parse_selector("mdev_1.0").unwrap_err();
        assert!(
            e.contains("\"mdev_1.0\"") && e.contains("ResourceSlice"),
            "{e}"
        );
        assert!(parse_selector("GPU 0").unwrap_err().contains("GPU 0"));
    }
}
