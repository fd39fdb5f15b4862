//! The claims a DRA driver has prepared on this node, from the driver's own records:
//! `<kubelet-root>/plugins/<driver>/claims/<claim-uid>.json`, one JSON file per claim, written
//! by sandbox-dra before its first change to the node and removed after the last change of
//! its unprepare ([`CLAIM_RECORD_VERSION`] is their format).
//!
//! They say what kubelet's PodResources API says of a prepared claim, and go on saying it while
//! kubelet is down (no PodResources socket, and kubelet's checkpoint has no claims): a GPU a
//! claim holds is in use from its prepare to its unprepare, whether or not its VM has opened
//! it yet. Every driver directory under `<kubelet-root>/plugins/` is read, so that the driver
//! name sandbox-dra runs under (`--driver-name`) need not be told to every daemon; the
//! directory's name is the driver's.
//!
//! Of a record only this is read: `version` (at most [`CLAIM_RECORD_VERSION`]), the claim's
//! `namespace` and `name`, `state`, and each device's `nodes` (host paths of its device nodes,
//! `/dev/vfio/21`) and `address` (its PCI function). A device whose nodes are not known yet (a
//! prepare under way, or interrupted) holds its function. A record that cannot be read, or of
//! a newer format, may hold any device: its user is unknown, which counts as in use until the
//! driver sets it aside or removes it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::PreparedClaim;
use crate::paths::HostPaths;
use crate::pci::PciAddress;

/// The newest format of sandbox-dra's claim records this version reads (their `version`
/// field). sandbox-dra writes this one.
pub const CLAIM_RECORD_VERSION: u32 = 1;

/// What the records say.
#[derive(Debug, Default)]
pub(super) struct Records {
    /// Host path of a device node → the claims holding it.
    pub by_node: BTreeMap<String, Vec<PreparedClaim>>,
    /// A PCI function → the claims holding it whose device nodes are not known yet.
    pub by_function: BTreeMap<PciAddress, Vec<PreparedClaim>>,
    /// Records that cannot be read: why, each naming the file.
    pub unknown: Vec<String>,
    /// The drivers whose records were read (their `claims` directory): what such a driver's
    /// claim holds is in its record, or nothing when it has none (not prepared yet, or
    /// unprepared: a record is written before the first change and removed after the last).
    pub keepers: BTreeSet<String>,
    /// How many records were read, for logs.
    pub read: usize,
}

#[derive(Debug, Deserialize)]
struct RecordFile {
    claim: RecordClaim,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    devices: Vec<RecordDevice>,
}

#[derive(Debug, Deserialize)]
struct RecordClaim {
    namespace: String,
    name: String,
}

#[derive(Debug, Deserialize)]
struct RecordDevice {
    #[serde(default)]
    address: Option<PciAddress>,
    #[serde(default)]
    nodes: Vec<String>,
}

/// Reads every driver's claim records under `paths`' kubelet root, leaving out the claim
/// `exclude` (`namespace`, `name`): a driver preparing or unpreparing it is not its user.
pub(super) fn read(paths: &HostPaths, exclude: Option<(&str, &str)>) -> Records {
    let mut out = Records::default();
    let plugins = paths.kubelet_plugins_dir();
    let drivers = match std::fs::read_dir(&plugins) {
        Ok(d) => d,
        // No DRA driver ever ran here.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return out,
        Err(e) => {
            out.unknown.push(format!(
                "cannot read the DRA drivers' claim records in {}: {e}",
                plugins.display()
            ));
            return out;
        }
    };
    let mut dirs: Vec<PathBuf> = drivers.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    dirs.sort();
    for driver_dir in dirs {
        let Some(driver) = driver_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
        else {
            continue;
        };
        let claims = driver_dir.join("claims");
        let files = match std::fs::read_dir(&claims) {
            Ok(f) => f,
            // Not a directory, or none: a driver (or a file) that keeps no claim records.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                continue;
            }
            Err(e) => {
                out.unknown.push(format!(
                    "cannot read the claim records of DRA driver {driver} in {}: {e}",
                    claims.display()
                ));
                continue;
            }
        };
        out.keepers.insert(driver.clone());
        let mut records: Vec<PathBuf> = files
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| is_record(p))
            .collect();
        records.sort();
        for p in records {
            match load(&p) {
                // Removed meanwhile: unprepared.
                Ok(None) => {}
                Ok(Some(rec)) => {
                    out.read += 1;
                    let c = &rec.claim;
                    if exclude.is_some_and(|(ns, name)| c.namespace == ns && c.name == name) {
                        continue;
                    }
                    let claim = PreparedClaim {
                        namespace: c.namespace.clone(),
                        name: c.name.clone(),
                        driver: driver.clone(),
                        state: rec.state.clone().unwrap_or_else(|| "prepared".into()),
                        record: p.clone(),
                    };
                    for d in &rec.devices {
                        if d.nodes.is_empty() {
                            if let Some(a) = d.address {
                                push(out.by_function.entry(a).or_default(), &claim);
                            }
                            continue;
                        }
                        for n in &d.nodes {
                            push(out.by_node.entry(n.clone()).or_default(), &claim);
                        }
                    }
                }
                Err(why) => out.unknown.push(why),
            }
        }
    }
    out
}

fn push(claims: &mut Vec<PreparedClaim>, c: &PreparedClaim) {
    if !claims.contains(c) {
        claims.push(c.clone());
    }
}

/// A record's file: `<uid>.json`, not a hidden one (a write's temporary file) nor one set
/// aside (`<uid>.json.unreadable-<time>`).
fn is_record(p: &Path) -> bool {
    p.extension().is_some_and(|x| x == "json")
        && p.file_name()
            .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
        && p.is_file()
}

/// The record at `p`; `None` when it is gone; an error naming the file when it cannot be read,
/// is not a record, or is of a newer format.
fn load(p: &Path) -> Result<Option<RecordFile>, String> {
    let text = match crate::state::read_if_present(p) {
        Ok(Some(t)) => t,
        Ok(None) => return Ok(None),
        Err(e) => return Err(format!("claim record: {}", crate::error_chain(&e))),
    };
    let not_one = |why: String| format!("claim record {} is not one: {why}", p.display());
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| not_one(e.to_string()))?;
    crate::state::json_version(p, &value, CLAIM_RECORD_VERSION)
        .map_err(|e| format!("claim record {e}"))?;
    serde_json::from_value(value)
        .map(Some)
        .map_err(|e| not_one(e.to_string()))
}
