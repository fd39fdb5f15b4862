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
use std::sync::{Arc, PoisonError, RwLock};

use anyhow::Context as _;
use common::vgpu::lifecycle::Handle;
use common::vgpu::selector::BadSelector;
use common::{HostPaths, Inventory, PciAddress, state};
use serde::{Deserialize, Serialize};

use crate::names;
use crate::vgpu_types::Types;

/// Which GPUs are published as vGPUs (`--vgpu`): `all`, every NVIDIA GPU whose model the vGPU
/// model table knows, or the GPUs and non-PCI mdev parents listed.
pub use common::vgpu::selector::Selector;

/// Parses `--vgpu all|BDF,…|PARENT,…` ([`common::vgpu::selector::parse_selector`]); an mdev
/// parent must also be fit to stand in a device name (lowercase letters, digits and `-`), which
/// the ResourceSlice's device names are made of.
pub fn parse_selector(s: &str) -> Result<Selector, BadSelector> {
    let sel = common::vgpu::selector::parse_selector(s)?;
    if let Selector::Listed { parents, .. } = &sel
        && let Some(p) = parents.iter().find(|p| !names::is_name_part(p))
    {
        return Err(BadSelector::Parent {
            name: p.clone(),
            why: "cannot name a device in a ResourceSlice: only lowercase letters, digits and - \
                  may",
        });
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

/// The GPUs of `inv` that `sel` names and whose vGPU model the table knows.
pub fn selected_gpus(inv: &Inventory, sel: &Selector) -> BTreeSet<PciAddress> {
    inv.gpus(Some(0x10de))
        .into_iter()
        .filter(|d| !d.is_vf())
        .filter(|d| common::vgpu::models::model(d.vendor, d.device).is_some())
        .filter(|d| match sel {
            Selector::All => true,
            Selector::Listed { gpus, .. } => gpus.contains(&d.address),
        })
        .map(|d| d.address)
        .collect()
}

/// What [`claim_pool`] claimed.
#[derive(Debug, Default)]
pub struct Claimed {
    /// The GPUs and mdev parents published and prepared as vGPUs.
    pub pool: state::pool::Members,
    /// Why `--vgpu` claims nothing when it named something, for the log and an Event.
    pub not_claimed: Option<String>,
}

/// The GPUs and non-PCI mdev parents `sel` names on this node, written as sandbox-dra's pool
/// ([`state::pool::write_dra`]), so that vgpu-device-manager leaves them alone; refused when
/// sandbox-dp's on-demand pool holds one.
///
/// When sandbox-dp's on-demand pool cannot be read (damaged, or of a newer format), which GPUs
/// are its is unknown: the driver then claims none (its pool file is left as it is, for
/// vgpu-device-manager) and serves passthrough alone, rather than not starting; `not_claimed`
/// says so. GPUs join later through [`Pool::grow`] once the file can be read.
pub fn claim_pool(paths: &HostPaths, sel: &Selector) -> anyhow::Result<Claimed> {
    let inv = Inventory::read(paths).context("cannot read the node's PCI devices")?;
    let gpus = selected_gpus(&inv, sel);
    if let Selector::Listed { gpus: want, .. } = sel {
        for a in want.difference(&gpus) {
            tracing::warn!(gpu = %a, "--vgpu names a GPU this node does not have, or one whose vGPU model is unknown");
        }
    }
    let pool = state::pool::Members {
        gpus,
        parents: mdev_parents(&inv, sel),
    };
    if !pool.is_empty()
        && let Err(e) = state::pool::load(paths)
    {
        let note = format!(
            "{}: sandbox-dp's on-demand GPUs are unknown, so no vGPU is offered (--vgpu) while \
             that file cannot be read (GPUs join once sandbox-dp writes it again or it is \
             removed; mdev parents at the next start); whole GPUs are served",
            common::error_chain(&e)
        );
        tracing::warn!("{note}");
        return Ok(Claimed {
            pool: state::pool::Members::default(),
            not_claimed: Some(note),
        });
    }
    state::pool::write_dra(paths, &pool)
        .with_context(|| "cannot record the GPUs and mdev parents of --vgpu as sandbox-dra's")?;
    if !pool.is_empty() {
        tracing::info!(gpus = ?pool.gpus.iter().map(ToString::to_string).collect::<Vec<_>>(), parents = ?pool.parents, "vGPU pool");
    }
    Ok(Claimed {
        pool,
        not_claimed: None,
    })
}

/// The GPUs of the vGPU pool, shared by the publisher, which adds the GPUs `--vgpu` selects
/// that appear while the driver runs ([`Pool::grow`]), and the preparer, which creates vGPUs
/// only on them; and the vGPU types they publish (`--vgpu-types`).
#[derive(Clone, Debug, Default)]
pub struct Pool {
    inner: Arc<RwLock<PoolState>>,
    /// Told when a GPU's VFs are noted as enabled or not ([`Pool::note_vfs`]): the publisher
    /// taints or untaints its vGPU devices.
    changed: Arc<tokio::sync::Notify>,
}

/// The vGPU pool as one pass of the publisher reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pooled {
    /// Its GPUs.
    pub gpus: BTreeSet<PciAddress>,
    /// The vGPU types they publish.
    pub types: Types,
}

impl From<BTreeSet<PciAddress>> for Pooled {
    /// These GPUs, publishing every type.
    fn from(gpus: BTreeSet<PciAddress>) -> Pooled {
        Pooled {
            gpus,
            types: Types::All,
        }
    }
}

#[derive(Debug, Default)]
struct PoolState {
    gpus: BTreeSet<PciAddress>,
    types: Types,
    parents: BTreeSet<String>,
    /// GPUs that appeared and could not join (another owner holds them), said once each.
    refused: BTreeSet<PciAddress>,
    /// GPUs whose VFs a prepare could not enable (their vGPU devices are tainted), until one
    /// enables them.
    no_vfs: BTreeSet<PciAddress>,
}

impl Pool {
    /// The pool [`claim_pool`] wrote, its GPUs publishing every vGPU type.
    pub fn new(members: state::pool::Members) -> Pool {
        Pool::with_types(members, Types::All)
    }

    /// The pool [`claim_pool`] wrote, its GPUs publishing `types` (`--vgpu-types`).
    pub fn with_types(members: state::pool::Members, types: Types) -> Pool {
        Pool {
            inner: Arc::new(RwLock::new(PoolState {
                gpus: members.gpus,
                types,
                parents: members.parents,
                refused: BTreeSet::new(),
                no_vfs: BTreeSet::new(),
            })),
            changed: Arc::default(),
        }
    }

    /// Notes whether GPU `a`'s VFs could be enabled (a prepare's last try); whether that
    /// changed what is noted.
    pub fn note_vfs(&self, a: PciAddress, enabled: bool) -> bool {
        let mut st = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let changed = if enabled {
            st.no_vfs.remove(&a)
        } else {
            st.no_vfs.insert(a)
        };
        if changed {
            self.changed.notify_one();
        }
        changed
    }

    /// Notified when what [`Pool::note_vfs`] noted changes.
    pub fn changed(&self) -> Arc<tokio::sync::Notify> {
        self.changed.clone()
    }

    /// The GPUs whose VFs a prepare could not enable.
    pub fn without_vfs(&self) -> BTreeSet<PciAddress> {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .no_vfs
            .clone()
    }

    /// Whether GPU `a` is in the pool.
    pub fn contains(&self, a: &PciAddress) -> bool {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .gpus
            .contains(a)
    }

    /// The GPUs in the pool, with the vGPU types they publish.
    pub fn gpus(&self) -> Pooled {
        let st = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        Pooled {
            gpus: st.gpus.clone(),
            types: st.types.clone(),
        }
    }

    /// Whether the pool's GPUs publish vGPU type `type_name` (`NVIDIA A10-4Q`).
    pub fn publishes(&self, type_name: &str) -> bool {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .types
            .publishes(type_name)
    }

    /// Adds to the pool the GPUs of `inv` that `sel` selects and the pool does not hold yet (a
    /// GPU hot-plugged under `--vgpu all`), and records them in sandbox-dra's pool file. A GPU
    /// sandbox-dp's on-demand pool holds stays out (one owner per GPU), published for
    /// passthrough only, which is logged once. GPUs that went stay in the pool: the slices
    /// hold only GPUs the node has.
    pub fn grow(&self, paths: &HostPaths, inv: &Inventory, sel: &Selector) -> anyhow::Result<()> {
        let mut st = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let new: BTreeSet<PciAddress> = selected_gpus(inv, sel)
            .difference(&st.gpus)
            .copied()
            .filter(|a| !st.refused.contains(a))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        let on_demand = state::pool::load(paths)?.gpus;
        for a in new.intersection(&on_demand) {
            tracing::warn!(
                gpu = %a,
                owner = state::pool::ON_DEMAND_OWNER,
                "a new GPU is owned by another daemon: published for passthrough only"
            );
            st.refused.insert(*a);
        }
        let joining: BTreeSet<PciAddress> = new.difference(&on_demand).copied().collect();
        if joining.is_empty() {
            return Ok(());
        }
        let members = state::pool::Members {
            gpus: st.gpus.union(&joining).copied().collect(),
            parents: st.parents.clone(),
        };
        state::pool::write_dra(paths, &members).with_context(
            || "cannot record the GPUs and mdev parents of --vgpu as sandbox-dra's",
        )?;
        tracing::info!(
            gpus = ?joining.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "new GPUs joined the vGPU pool"
        );
        st.gpus = members.gpus;
        Ok(())
    }
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
        let e = parse_selector("mdev_1.0").unwrap_err().to_string();
        assert!(
            e.contains("\"mdev_1.0\"") && e.contains("ResourceSlice"),
            "{e}"
        );
        assert!(
            parse_selector("GPU 0")
                .unwrap_err()
                .to_string()
                .contains("GPU 0")
        );
    }
}
