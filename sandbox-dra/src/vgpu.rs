//! vGPUs as partitionable devices: which GPUs and non-PCI mdev parents the driver publishes as
//! vGPUs (`--vgpu`), and how a claim's record names the vGPUs and mdevs made for it.
//!
//! The model of what a GPU or parent can host, and the life of one vGPU (placed, recorded,
//! created, waited for, destroyed), are [`common::vgpu`]'s, shared with sandbox-dp's on-demand
//! mode.
//!
//! Kubernetes' counters cannot say "all time-sliced vGPUs of one GPU have one size" (NVIDIA's
//! equal-size rule: a sum of framebuffers that fits may still be refused), so the scheduler may
//! allocate an `A10-8Q` on a GPU that holds an `A10-4Q`. Prepare refuses it with the GPU and
//! both types named ([`common::vgpu::lifecycle::mix_refusal`]); kubelet shows that as the pod's
//! event.

use std::collections::BTreeSet;

use anyhow::Context as _;
use common::vgpu::lifecycle::Handle;
use common::{HostPaths, Inventory, PciAddress, state};
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
            let there = common::vgpu::parents::capacity(inv, p).is_some();
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
    #[serde(flatten)]
    pub handle: Handle,
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
    /// Its handle in [`common::vgpu::lifecycle`].
    pub fn handle(&self) -> Handle {
        Handle::Mdev(self.uuid.clone())
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
