//! vfio-manager: puts a node's selected GPUs, and the other functions of their IOMMU groups, on
//! `vfio-pci` (or the variant VFIO driver the kernel names for them) for PCI passthrough, and
//! gives them back.
//!
//! Flow: read an [`Inventory`] → [`common::vfio::select`] decides which functions (and to
//! which driver) → [`common::vfio::bind`] writes through `common::Sysfs`, one worker per IOMMU
//! group → a [`report::Report`] says what changed. [`daemon`] repeats that on udev events and a slow
//! resync, and keeps the readiness file honest.

pub mod daemon;
pub mod report;
pub mod status;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::state::originals;
use common::vfio::{self, OpOptions};
use common::{HostPaths, Inventory, PciAddress, Usage, error_chain};

pub use common::vfio::{DeviceId, DeviceResult, Outcome, Selection, Selector, Target};
pub use daemon::{DaemonConfig, READY_FILE};
pub use report::{Action, Report};
pub use status::Status;

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
    let aliases = vfio::load_aliases(paths);
    let sel = vfio::select(&inv, &cfg.selector, cfg.driver.as_deref(), &aliases);
    Ok((inv, sel))
}

/// `vfio-manager bind`: every selected function onto its VFIO driver.
pub fn run_bind(cfg: &Config, paths: &HostPaths) -> Result<Report, NodeError> {
    let start = Instant::now();
    let (inv, sel) = read_and_select(cfg, paths)?;
    if sel.is_empty() {
        tracing::warn!("no devices match the selection; nothing to bind");
    }
    // Read who uses what only when a device is to leave its driver: a pass with nothing to
    // do (the daemon's resync) scans no process and asks kubelet nothing.
    let usage: OnceLock<Usage> = OnceLock::new();
    let in_use = |t: &Target| -> Vec<String> {
        let usage = usage.get_or_init(|| Usage::read(paths));
        vfio::bind_blockers(usage, &inv, t)
            .iter()
            .map(|u| u.describe(&inv))
            .collect()
    };
    let (recorded, mut warnings) = record_intent(paths, &sel);
    let results = vfio::bind_all(
        &common::Sysfs::new(paths.clone()),
        &sel,
        &cfg.op_options(),
        &in_use,
    );
    warnings.extend(forget_unmoved(paths, &recorded, &results));
    Ok(Report {
        action: Action::Bind,
        results,
        elapsed: start.elapsed(),
        warnings,
    })
}

/// Records the driver of every function the bind is to move, before the bind: a crash between
/// the record and the bind must not lose `nouveau` or "no driver". Returns the functions
/// recorded now (not by an earlier run), and what went wrong with the record, one sentence each.
fn record_intent(
    paths: &HostPaths,
    sel: &vfio::Selection,
) -> (Vec<(PciAddress, Option<String>)>, Vec<String>) {
    let moving: Vec<(PciAddress, Option<String>)> = sel
        .targets()
        .filter(|t| !t.is_bound() && !t.driver.as_deref().is_some_and(common::is_vfio_driver))
        .map(|t| (t.address, t.driver.clone()))
        .collect();
    if moving.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let known = originals::load(paths).drivers;
    let new: Vec<_> = moving
        .iter()
        .filter(|(a, _)| !known.contains_key(a))
        .cloned()
        .collect();
    match originals::update(paths, &moving, &[]) {
        Ok(problems) => (new, problems),
        Err(e) => {
            let why = format!(
                "cannot record the original drivers ({}); unbind will give these functions to \
                 their default driver",
                error_chain(&e)
            );
            tracing::warn!("{why}");
            (Vec::new(), vec![why])
        }
    }
}

/// Forgets what [`record_intent`] recorded of functions the bind did not move and that are on
/// that driver still (refused, or given back after a failure).
fn forget_unmoved(
    paths: &HostPaths,
    recorded: &[(PciAddress, Option<String>)],
    results: &[vfio::DeviceResult],
) -> Vec<String> {
    let sysfs = common::Sysfs::new(paths.clone());
    let unmoved: Vec<PciAddress> = recorded
        .iter()
        .filter(|(a, driver)| {
            results.iter().any(|r| {
                r.address == *a
                    && !matches!(r.outcome, Outcome::Changed { .. })
                    && sysfs.current_driver(a).ok().as_ref() == Some(driver)
            })
        })
        .map(|(a, _)| *a)
        .collect();
    match originals::update(paths, &[], &unmoved) {
        Ok(problems) => problems,
        Err(e) => vec![format!(
            "cannot update the record of original drivers: {}",
            error_chain(&e)
        )],
    }
}

/// `vfio-manager unbind`: every selected function on a VFIO driver back to its default driver;
/// groups in use (a VM holds them, kubelet gave them to a pod, or that cannot be known) are
/// refused unless `cfg.force`.
pub fn run_unbind(cfg: &Config, paths: &HostPaths) -> Result<Report, NodeError> {
    let start = Instant::now();
    // Selection for unbind does not refuse foreign members: giving devices back is safe.
    let mut cfg = cfg.clone();
    cfg.selector.allow_foreign_in_group = true;
    let (inv, sel) = read_and_select(&cfg, paths)?;
    let on_vfio = sel
        .targets()
        .any(|t| t.driver.as_deref().is_some_and(common::is_vfio_driver));
    let usage = if on_vfio {
        Usage::read(paths)
    } else {
        Usage::default()
    };
    let originals::Loaded {
        drivers: remembered,
        problems: mut warnings,
    } = originals::load(paths);
    let in_use = |group: u32| -> Vec<String> {
        usage
            .of_group(&inv, group)
            .iter()
            .map(|u| u.describe(&inv))
            .collect()
    };
    let results = vfio::unbind_all(
        &common::Sysfs::new(paths.clone()),
        &sel,
        &cfg.op_options(),
        &in_use,
        &remembered,
    );
    let released: Vec<_> = results
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Changed { .. }))
        .map(|r| r.address)
        .collect();
    match originals::update(paths, &[], &released) {
        Ok(problems) => warnings.extend(problems),
        Err(e) => warnings.push(format!(
            "cannot update the record of original drivers: {}",
            error_chain(&e)
        )),
    }
    Ok(Report {
        action: Action::Unbind,
        results,
        elapsed: start.elapsed(),
        warnings,
    })
}

/// `vfio-manager status`.
pub fn run_status(cfg: &Config, paths: &HostPaths) -> Result<Status, NodeError> {
    let (inv, sel) = read_and_select(cfg, paths)?;
    Ok(Status::new(&inv, &sel, &Usage::read(paths)))
}
