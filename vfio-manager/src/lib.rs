//! vfio-manager: puts a node's selected GPUs, and the other functions of their IOMMU groups, on
//! `vfio-pci` (or the variant VFIO driver the kernel names for them) for PCI passthrough, and
//! gives them back.
//!
//! Flow: read an [`Inventory`] → [`select::select`] decides which functions (and to which
//! driver) → [`ops`] writes through `common::Sysfs`, one worker per IOMMU group → a
//! [`report::Report`] says what changed. [`daemon`] repeats that on udev events and a slow
//! resync, and keeps the readiness file honest.

pub mod alias;
pub mod daemon;
pub mod memory;
pub mod ops;
pub mod report;
pub mod select;
pub mod status;

use std::time::{Duration, Instant};

use common::{Holder, HostPaths, Inventory, PciAddress, error_chain, inuse};

pub use daemon::{DaemonConfig, READY_FILE, run_daemon};
pub use ops::OpOptions;
pub use report::{Action, DeviceResult, Outcome, Report};
pub use select::{DeviceId, Selection, Selector, Target};
pub use status::Status;

use alias::AliasTable;

/// Everything `bind`, `unbind` and `status` need besides the host paths.
#[derive(Clone, Debug)]
pub struct Config {
    /// Which functions.
    pub selector: Selector,
    /// `--driver`: this driver instead of `vfio-pci` / the `modules.alias` variant.
    pub driver: Option<String>,
    /// Per-function time limit (`--timeout`).
    pub timeout: Duration,
    /// Unbind groups that are in use (`--force`).
    pub force: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            selector: Selector::default(),
            driver: None,
            timeout: Duration::from_secs(30),
            force: false,
        }
    }
}

impl Config {
    fn op_options(&self) -> OpOptions {
        OpOptions {
            timeout: self.timeout,
            force: self.force,
        }
    }
}

/// The node cannot be read at all (no `sys/bus/pci/devices` under the host root).
#[derive(Debug, thiserror::Error)]
#[error("cannot read the node's PCI devices under {root}")]
pub struct NodeError {
    /// The host root.
    pub root: String,
    /// Why.
    #[source]
    pub source: common::Error,
}

/// The `modules.alias` of the running kernel; empty (everything on `vfio-pci`) when there is
/// none to read.
pub fn load_aliases(paths: &HostPaths) -> AliasTable {
    let path = match paths.modules_alias() {
        Ok(p) => p,
        Err(e) => {
            tracing::debug!(error = %error_chain(&e), "no kernel release; using vfio-pci for every device");
            return AliasTable::default();
        }
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => AliasTable::parse(&text),
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "no modules.alias; using vfio-pci for every device");
            AliasTable::default()
        }
    }
}

/// Reads the node and selects.
pub fn read_and_select(
    cfg: &Config,
    paths: &HostPaths,
) -> Result<(Inventory, Selection), NodeError> {
    let inv = Inventory::read(paths).map_err(|source| NodeError {
        root: paths.root().display().to_string(),
        source,
    })?;
    for u in &inv.unreadable {
        tracing::warn!(path = %u.path.display(), reason = %u.reason, "unreadable device skipped");
    }
    let aliases = load_aliases(paths);
    let sel = select::select(&inv, &cfg.selector, cfg.driver.as_deref(), &aliases);
    Ok((inv, sel))
}

/// Processes that unbinding a GPU from `nvidia` would hurt: holders of its `/dev/nvidia<N>`
/// (a CUDA job, nvidia-persistenced: the unbind hangs until they exit), and VMs using its
/// vGPUs (the unbind destroys the mdevs on the GPU and its VFs, and the VFs' SR-IOV vGPUs).
fn nvidia_holders_fn<'a>(
    paths: &HostPaths,
    inv: &'a Inventory,
) -> impl Fn(&Target) -> Vec<Holder> + Sync + use<'a> {
    let paths = paths.clone();
    move |t: &Target| {
        let mut out = match inuse::nvidia_holders(&paths, &t.address) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(device = %t.address, error = %error_chain(&e), "cannot tell whether the GPU is in use");
                Vec::new()
            }
        };
        // The GPU's vGPUs: (IOMMU group, VFIO cdev) of each mdev on it or its VFs, and of
        // each VF that holds an SR-IOV vGPU.
        let vfs: Vec<&common::PciDevice> = inv
            .device(&t.address)
            .map(|g| g.virtfns.iter().filter_map(|v| inv.device(v)).collect())
            .unwrap_or_default();
        let on_gpu = |p: Option<PciAddress>| {
            p.is_some_and(|p| p == t.address || vfs.iter().any(|v| v.address == p))
        };
        let mut vgpus: Vec<(u32, Option<&str>)> = inv
            .mdevs
            .values()
            .filter(|m| on_gpu(m.parent_pci))
            .filter_map(|m| Some((m.iommu_group?, m.vfio_cdev.as_deref())))
            .collect();
        vgpus.extend(
            vfs.iter()
                .filter(|v| v.nvidia_vgpu.as_ref().is_some_and(|g| g.current != 0))
                .filter_map(|v| Some((v.iommu_group?, v.vfio_cdev.as_deref()))),
        );
        if vgpus.is_empty() {
            return out;
        }
        match inuse::holders(&paths) {
            Ok(scan) => {
                for (group, cdev) in vgpus {
                    let cdevs: Vec<&str> = cdev.into_iter().collect();
                    out.extend(inuse::group_holders_in(&scan, group, &cdevs));
                }
            }
            Err(e) => out.push(Holder {
                pid: 0,
                comm: format!(
                    "unknown: cannot read the processes ({}), and the GPU has vGPUs",
                    error_chain(&e)
                ),
                path: paths.proc().display().to_string(),
            }),
        }
        out
    }
}

/// `vfio-manager bind`: every selected function onto its VFIO driver.
pub fn run_bind(cfg: &Config, paths: &HostPaths) -> Result<Report, NodeError> {
    let start = Instant::now();
    let (inv, sel) = read_and_select(cfg, paths)?;
    if sel.is_empty() {
        tracing::warn!("no devices match the selection; nothing to bind");
    }
    let holders = nvidia_holders_fn(paths, &inv);
    let results = ops::bind_all(paths, &sel, &cfg.op_options(), &holders);
    let moved: Vec<_> = results
        .iter()
        .filter_map(|r| match &r.outcome {
            Outcome::Changed { from, .. }
                if !from.as_deref().is_some_and(common::is_vfio_driver) =>
            {
                Some((r.address, from.clone()))
            }
            _ => None,
        })
        .collect();
    memory::update(paths, &moved, &[]);
    Ok(Report {
        action: Action::Bind,
        results,
        elapsed: start.elapsed(),
    })
}

/// `vfio-manager unbind`: every selected function on a VFIO driver back to its default driver;
/// groups in use by a VM are refused unless `cfg.force`.
pub fn run_unbind(cfg: &Config, paths: &HostPaths) -> Result<Report, NodeError> {
    let start = Instant::now();
    // Selection for unbind does not refuse foreign members: giving devices back is safe.
    let mut cfg = cfg.clone();
    cfg.selector.allow_foreign_in_group = true;
    let (_inv, sel) = read_and_select(&cfg, paths)?;
    let scan = inuse::holders(paths).map_err(|e| {
        let e = error_chain(&e);
        tracing::warn!(error = %e, "cannot scan processes for open VFIO groups");
        e
    });
    let originals = memory::load(paths);
    let results = ops::unbind_all(paths, &sel, &cfg.op_options(), &scan, &originals);
    let released: Vec<_> = results
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Changed { .. }))
        .map(|r| r.address)
        .collect();
    memory::update(paths, &[], &released);
    Ok(Report {
        action: Action::Unbind,
        results,
        elapsed: start.elapsed(),
    })
}

/// `vfio-manager status`.
pub fn run_status(cfg: &Config, paths: &HostPaths) -> Result<Status, NodeError> {
    let (inv, sel) = read_and_select(cfg, paths)?;
    let scan = inuse::holders(paths).unwrap_or_else(|e| {
        tracing::warn!(error = %error_chain(&e), "cannot scan processes for open VFIO groups");
        Default::default()
    });
    Ok(Status::new(&inv, &sel, &scan))
}
