//! The record of every vGPU the pool made: `<root>/run/gpu-vm-node/on-demand-vgpus.json`,
//! replaced whole before each vGPU's creation (phase `creating`), after it (`ready`) and before
//! its removal (`removing`), so that a crash at any point leaves a record of every vGPU this
//! daemon may have made. It is not flushed to disk ([`state::write_atomic_until_reboot`]): a
//! crash of the machine destroys the vGPUs it names.
//!
//! The file carries its format's version (`"version": 1`); one without (the format before) is
//! read as it is and written with it next time. One that cannot be read, or of a newer
//! format, is set aside (kept beside it for an operator) and reported: the pool starts with
//! no records, and the vGPUs that file named are left as they are.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::vgpu::lifecycle::{Handle, Member};
use common::{HostPaths, state};
use serde::{Deserialize, Serialize};

use super::{Error, Pool, lock};

/// Where a record's vGPU is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// About to be written to sysfs (it may or may not exist).
    Creating,
    /// Created; given to kubelet.
    Ready,
    /// About to be removed (it may or may not exist still).
    Removing,
}

/// One vGPU made for an allocation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The advertised device ID kubelet allocated.
    pub device: String,
    /// Its resource.
    pub resource: String,
    /// The GPU or mdev parent the vGPU is on (`gpu` in files an earlier version wrote).
    #[serde(alias = "gpu")]
    pub parent: Member,
    /// `NVIDIA A10-4Q`, `Dual port serial`.
    pub type_name: String,
    /// The mdev's UUID, or the VF whose `current_vgpu_type` was set (`handle` and `vendor` in
    /// the file).
    #[serde(flatten)]
    pub handle: Handle,
    /// Where it is in its life.
    pub phase: Phase,
    /// When the allocation came, seconds since the epoch.
    pub since: u64,
    /// A pod kubelet runs was seen holding it.
    pub seen: bool,
    /// The pod kubelet last listed holding it (`namespace/name`): when kubelet lists it no
    /// more, the API server is asked whether it still runs here before the vGPU goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

/// The format version the file is written in.
pub const VERSION: u32 = 1;

#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Records {
    /// The format version (0: the format before records carried one).
    #[serde(default)]
    pub(super) version: u32,
    pub(super) vgpus: Vec<Record>,
}

/// `<root>/run/gpu-vm-node/on-demand-vgpus.json`.
pub fn records_path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/on-demand-vgpus.json")
}

/// Seconds since the epoch.
pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether a vGPU allocated at `since` and still seen in no pod at `at` (both whole seconds, as
/// [`now`] gives them) is past its grace period. Whole seconds cut both instants short by up to
/// a second, so the elapsed time is only known to within a second: the grace is over when it
/// is surely over, more whole seconds than the grace rounded up. A vGPU is never released
/// early (one allocated at 07.99 is not gone at 08.01 with a grace of 1 s); it may go up to a
/// second late.
pub(super) fn past_grace(since: u64, at: u64, grace: Duration) -> bool {
    let grace = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
    at.saturating_sub(since) > grace
}

/// The records a previous run left; none when there is no file.
pub(super) fn load(paths: &HostPaths) -> Result<Vec<Record>, Error> {
    let path = records_path(paths);
    let Some(text) = state::read_if_present(&path).map_err(|e| Error::Records(Box::new(e)))? else {
        return Ok(Vec::new());
    };
    let corrupt = |source: Box<dyn std::error::Error + Send + Sync>| Error::Corrupt {
        path: path.clone(),
        source,
    };
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| corrupt(Box::new(e)))?;
    state::json_version(&path, &value, VERSION).map_err(|e| corrupt(Box::new(e)))?;
    serde_json::from_value::<Records>(value)
        .map(|r| r.vgpus)
        .map_err(|e| corrupt(Box::new(e)))
}

/// The records a previous run left, as [`load`] reads them; a file that cannot be read is set
/// aside instead, and the sentence to report says so.
pub(super) fn load_or_set_aside(paths: &HostPaths) -> Result<(Vec<Record>, Option<String>), Error> {
    match load(paths) {
        Ok(r) => Ok((r, None)),
        Err(e @ Error::Corrupt { .. }) => {
            let path = records_path(paths);
            let what = match state::set_aside(&path) {
                Ok(aside) => format!("set aside as {}", aside.display()),
                Err(e2) => format!("and cannot be set aside: {}", common::error_chain(&e2)),
            };
            let note = format!(
                "{}; {what}: the pool starts with no records, and the vGPUs they named are left \
                 as they are",
                common::error_chain(&e)
            );
            tracing::warn!("{note}");
            Ok((Vec::new(), Some(note)))
        }
        Err(e) => Err(e),
    }
}

impl Pool {
    fn save(&self, records: &[Record]) -> Result<(), Error> {
        let path = records_path(&self.paths);
        let text = serde_json::to_string_pretty(&Records {
            version: VERSION,
            vgpus: records.to_vec(),
        })
        .map_err(|source| Error::Serialize {
            path: path.clone(),
            source,
        })?;
        // vGPUs do not outlive a boot: the file is not flushed to disk (the VM waits on it).
        state::write_atomic_until_reboot(&path, text.as_bytes())
            .map_err(|e| Error::Records(Box::new(e)))
    }

    /// Changes the records with `f` and replaces the file with them.
    pub(super) fn update(&self, f: impl FnOnce(&mut Vec<Record>)) -> Result<(), Error> {
        let mut r = lock(&self.records);
        f(&mut r);
        self.save(&r)
    }

    /// The records now.
    pub fn records(&self) -> Vec<Record> {
        lock(&self.records).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grace_period_is_never_cut_short_by_whole_seconds() {
        let s = Duration::from_secs;
        // Allocated at 100.99, seen at 101.01: 20 ms, not a second.
        assert!(!past_grace(100, 101, s(1)));
        // At 102.00 at the earliest: over 1 s.
        assert!(past_grace(100, 102, s(1)));
        assert!(!past_grace(100, 160, s(60)));
        assert!(past_grace(100, 161, s(60)));
        // A grace under a second lasts until the next second but one.
        assert!(!past_grace(100, 101, Duration::from_millis(500)));
        assert!(past_grace(100, 102, Duration::from_millis(500)));
        assert!(!past_grace(100, 100, Duration::ZERO));
        assert!(past_grace(100, 101, Duration::ZERO));
        // A clock set back keeps the vGPU.
        assert!(!past_grace(100, 50, s(1)));
    }

    #[test]
    fn an_old_file_is_read_and_a_corrupt_or_newer_one_is_set_aside_with_a_note() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        let file = records_path(&paths);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        let old = r#"{"vgpus": [{"device":"d","resource":"r","parent":"mtty","type_name":"t","handle":"h","vendor":false,"phase":"ready","since":0,"seen":false}]}"#;
        std::fs::write(&file, old).unwrap();
        let (records, note) = load_or_set_aside(&paths).unwrap();
        assert_eq!((records.len(), note), (1, None));
        for bad in ["{\"vgpus\": [", r#"{"version": 2, "vgpus": []}"#] {
            std::fs::write(&file, bad).unwrap();
            let (records, note) = load_or_set_aside(&paths).unwrap();
            assert!(records.is_empty());
            let note = note.expect("a note to report");
            assert!(
                note.contains("on-demand-vgpus.json") && note.contains("set aside as"),
                "{note}"
            );
            assert!(!file.exists(), "set aside");
        }
        assert_eq!(load_or_set_aside(&paths).unwrap(), (Vec::new(), None));
    }

    #[test]
    fn records_name_the_member_by_its_string_and_read_files_that_say_gpu() {
        let r: Record = serde_json::from_str(
            r#"{"device":"d","resource":"r","gpu":"0000:41:00.0","type_name":"t","handle":"h","vendor":false,"phase":"ready","since":0,"seen":false}"#,
        )
        .unwrap();
        assert_eq!(r.parent, Member::Gpu("0000:41:00.0".parse().unwrap()));
        assert_eq!(r.handle, Handle::Mdev("h".into()));
        let mtty = Member::Parent("mtty".into());
        let text = serde_json::to_string(&Record { parent: mtty, ..r }).unwrap();
        assert!(text.contains(r#""parent":"mtty""#), "{text}");
        assert!(
            text.contains(r#""handle":"h","vendor":false"#),
            "the handle keeps its two fields: {text}"
        );
        assert_eq!(
            serde_json::from_str::<Record>(&text).unwrap().parent,
            Member::Parent("mtty".into())
        );
        // A vendor-path record whose handle is no VF is not a record.
        let bad = text.replace(r#""vendor":false"#, r#""vendor":true"#);
        let e = serde_json::from_str::<Record>(&bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"h\""), "{e}");
    }
}
