//! The driver's record of the claims it prepared: one JSON file per claim,
//! `<kubelet-root>/plugins/<driver>/claims/<claim-uid>.json`, written before the first change
//! to the node and removed after the last one of unprepare, so that a restart knows what a
//! crash left half done.
//!
//! It holds the claim, its devices, whether preparing finished, and the driver every function
//! of the devices' IOMMU groups had before the first prepare moved it (the first record wins:
//! a retry never records `vfio-pci` as a function's original driver; a function an earlier
//! claim left on VFIO takes its original from vfio-manager's node-wide record of original
//! drivers, `run/vfio-manager/original-drivers`, which preparing keeps up to date too). It lives under kubelet's
//! root rather than `/run` because a claim stays prepared across a reboot of the driver's pod,
//! as kubelet's own DRA checkpoint does.
//!
//! A record carries its format's version (`"version": 1`); one without (the format before) is
//! read as it is and written back with it ([`load_path`] says which). A record that cannot be
//! read, or of a newer format, is an error ([`RecordError`]): the driver sets it aside and goes
//! on as if the claim had none, rather than refusing the claim's unprepare for ever.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{PciAddress, state};
use serde::{Deserialize, Serialize};

use crate::cdi::{ClaimDevice, ClaimId};

/// Where a claim is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimState {
    /// Preparing began (nothing reached a container yet).
    Preparing,
    /// Preparing finished: the devices are bound and the CDI spec and metadata written.
    Prepared,
    /// Unpreparing began.
    Unpreparing,
}

/// The format version records are written in.
pub const VERSION: u32 = common::usage::CLAIM_RECORD_VERSION;

/// One claim's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The format version it was written in (0: before records carried one).
    #[serde(default)]
    pub version: u32,
    /// The claim.
    pub claim: ClaimId,
    /// Where it is.
    pub state: ClaimState,
    /// The allocated GPUs.
    pub devices: Vec<ClaimDevice>,
    /// Every function of the devices' groups → the driver it had before the first prepare
    /// (`None`: no driver).
    pub originals: BTreeMap<PciAddress, Option<String>>,
}

impl Record {
    /// The record as written, at [`VERSION`]: pretty JSON, so an operator can read it.
    pub fn to_bytes(&self) -> Result<Vec<u8>, serde_json::Error> {
        let mut v = serde_json::to_vec_pretty(&Record {
            version: VERSION,
            ..self.clone()
        })?;
        v.push(b'\n');
        Ok(v)
    }
}

/// The directory of the records (as this process reaches it).
pub fn dir(driver_dir: &Path) -> PathBuf {
    driver_dir.join("claims")
}

/// A claim UID is used as a file name: only what a UID is made of is accepted.
pub fn valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 128
        && uid
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// The record file of claim `uid`.
pub fn path(driver_dir: &Path, uid: &str) -> PathBuf {
    dir(driver_dir).join(format!("{uid}.json"))
}

/// Why a record cannot be used or saved.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// It cannot be read (the file system refuses).
    #[error(transparent)]
    Read(common::Error),
    /// It is not a record, or one of a newer format: set it aside and go on without it.
    #[error("{path} is not a claim record this version reads")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// It cannot be written.
    #[error("cannot save the claim record {path}")]
    Save {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Reads the record at `p`; `None` when there is none. A record of the format before versions
/// comes back with `version` 0: the caller saves it again to migrate it.
pub fn load_path(p: &Path) -> Result<Option<Record>, RecordError> {
    let Some(text) = state::read_if_present(p).map_err(RecordError::Read)? else {
        return Ok(None);
    };
    let unreadable = |source: Box<dyn std::error::Error + Send + Sync>| RecordError::Unreadable {
        path: p.to_path_buf(),
        source,
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| unreadable(Box::new(e)))?;
    state::json_version(p, &value, VERSION).map_err(|e| unreadable(Box::new(e)))?;
    serde_json::from_value(value)
        .map(Some)
        .map_err(|e| unreadable(Box::new(e)))
}

/// Saves `rec` at `p` (at [`VERSION`]) unless the file holds exactly that already: a repeated
/// prepare writes nothing. Returns whether it wrote.
pub fn save(p: &Path, rec: &Record) -> Result<bool, RecordError> {
    let save_err = |source: Box<dyn std::error::Error + Send + Sync>| RecordError::Save {
        path: p.to_path_buf(),
        source,
    };
    let bytes = rec.to_bytes().map_err(|e| save_err(Box::new(e)))?;
    write_if_changed(p, &bytes).map_err(|e| save_err(Box::new(e)))
}

/// Every record file in the directory, in name order.
pub fn list(driver_dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir(driver_dir)) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && p.file_name()
                    .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
        })
        .collect();
    out.sort();
    out
}

/// Writes `contents` to `p` unless it already holds exactly that: a repeated prepare writes
/// nothing. Returns whether it wrote.
pub fn write_if_changed(p: &Path, contents: &[u8]) -> common::Result<bool> {
    if let Ok(Some(now)) = state::read_if_present(p)
        && now.as_bytes() == contents
    {
        return Ok(false);
    }
    // What it records (vGPUs, bindings) a reboot undoes, and kubelet prepares the claim again
    // after one: not flushed to disk, on the path a VM start waits on.
    state::write_atomic_until_reboot(p, contents)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_survives_a_round_trip_and_is_not_rewritten_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let rec = Record {
            version: VERSION,
            claim: ClaimId {
                namespace: "ns".into(),
                name: "c".into(),
                uid: "u1".into(),
                pod_claim_name: None,
            },
            state: ClaimState::Preparing,
            devices: vec![],
            originals: [
                ("0000:41:00.0".parse().unwrap(), Some("nvidia".into())),
                ("0000:41:00.1".parse().unwrap(), None),
            ]
            .into(),
        };
        let p = path(dir.path(), "u1");
        assert!(save(&p, &rec).unwrap());
        assert!(!save(&p, &rec).unwrap());
        assert_eq!(load_path(&p).unwrap(), Some(rec.clone()));
        assert!(
            std::fs::read_to_string(&p)
                .unwrap()
                .contains("\"version\": 1")
        );
        assert_eq!(list(dir.path()), vec![p.clone()]);
        assert_eq!(load_path(&path(dir.path(), "u2")).unwrap(), None);

        // The format before versions reads as version 0; saving it migrates it.
        let old = std::fs::read_to_string(&p)
            .unwrap()
            .replace("  \"version\": 1,\n", "");
        assert!(!old.contains("version"), "{old}");
        std::fs::write(&p, &old).unwrap();
        let read = load_path(&p).unwrap().unwrap();
        assert_eq!((read.version, &read.claim), (0, &rec.claim));
        assert!(save(&p, &read).unwrap());
        assert_eq!(load_path(&p).unwrap(), Some(rec));

        // Garbage, and a newer format, are unreadable (to be set aside), naming the file.
        for bad in ["{\"claim\": 7", "{\"version\": 2, \"claim\": {}}"] {
            std::fs::write(&p, bad).unwrap();
            let e = load_path(&p).unwrap_err();
            assert!(matches!(e, RecordError::Unreadable { .. }), "{e:?}");
            assert!(common::error_chain(&e).contains("u1.json"), "{e}");
        }
    }

    #[test]
    fn uids_that_are_not_file_names_are_refused() {
        assert!(valid_uid("3f1e6c2a-4b5d-4e8f-9a0b-1c2d3e4f5a6b"));
        for bad in ["", "../x", "a/b", "a b", "x.json"] {
            assert!(!valid_uid(bad), "{bad}");
        }
    }
}
