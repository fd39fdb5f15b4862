//! Readiness files: `<host-root>/run/nvidia/validations/<name>`, present while a daemon vouches
//! for the node (every selected GPU bound; the vGPU profile applied). Whatever waits on one (an
//! init container polling for it) sees it whole or not at all.

use std::path::PathBuf;

use crate::error::Result;
use crate::paths::HostPaths;

/// `<host-root>/run/nvidia/validations/<name>`.
pub fn path(paths: &HostPaths, name: &str) -> PathBuf {
    paths.validations_dir().join(name)
}

/// Writes readiness file `name` with `body`, atomically ([`super::write_atomic`]).
pub fn set(paths: &HostPaths, name: &str, body: &str) -> Result<()> {
    super::write_atomic(&path(paths, name), body.as_bytes())
}

/// Removes readiness file `name`; `Ok(true)` when there was one to remove.
pub fn withdraw(paths: &HostPaths, name: &str) -> Result<bool> {
    super::remove_if_present(&path(paths, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_replaces_and_withdraw_removes() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        let file = dir.path().join("run/nvidia/validations/x-ready");
        assert_eq!(path(&p, "x-ready"), file);
        set(&p, "x-ready", "0000:1b:00.0 vfio-pci 7\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "0000:1b:00.0 vfio-pci 7\n"
        );
        set(&p, "x-ready", "").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "");
        let listed: Vec<_> = std::fs::read_dir(file.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(listed, ["x-ready"]);
        assert!(withdraw(&p, "x-ready").unwrap());
        assert!(!file.exists());
        assert!(!withdraw(&p, "x-ready").unwrap());
    }

    #[test]
    fn a_file_that_cannot_be_written_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        // A file where the validations directory should be.
        std::fs::create_dir_all(dir.path().join("run/nvidia")).unwrap();
        std::fs::write(dir.path().join("run/nvidia/validations"), "").unwrap();
        let err = set(&p, "x-ready", "").unwrap_err();
        assert!(
            err.to_string().contains("run/nvidia/validations/x-ready"),
            "{err}"
        );
    }
}
