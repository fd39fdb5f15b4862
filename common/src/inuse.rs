//! Which processes hold a device open: a scan of `<root>/proc/<pid>/fd/*` links.
//!
//! A VM (QEMU in virt-launcher) holds its devices' `/dev/vfio/<group>` (or the VFIO cdev) open
//! for as long as it runs; a CUDA job or nvidia-persistenced holds `/dev/nvidia<N>`. Links are
//! compared as host paths (`/dev/vfio/42`): that is what the kernel shows for a process in the
//! host's mount namespace, and what container runtimes give VMs.

use std::collections::BTreeMap;
use std::fs;
use std::io;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::paths::{HostPaths, host_vfio_group_path};

/// A process holding a device node open.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Holder {
    /// Process id (in the namespace of `<root>/proc`).
    pub pid: u32,
    /// The process's `comm` (`qemu-kvm`), or `?` when unreadable.
    pub comm: String,
    /// The held path, as the process sees it (`/dev/vfio/42`).
    pub path: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({}) holds {}", self.pid, self.comm, self.path)
    }
}

/// Every open file under `/dev` of every process: held path → holders. Processes that vanish
/// or whose fds cannot be read (permissions) are skipped.
pub fn holders(paths: &HostPaths) -> Result<BTreeMap<String, Vec<Holder>>> {
    let proc_dir = paths.proc();
    let rd = fs::read_dir(&proc_dir).map_err(|e| Error::io(&proc_dir, e))?;
    let mut out: BTreeMap<String, Vec<Holder>> = BTreeMap::new();
    for entry in rd.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let fd_dir = entry.path().join("fd");
        let fds = match fs::read_dir(&fd_dir) {
            Ok(f) => f,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::PermissionDenied
                ) =>
            {
                continue;
            }
            Err(_) => continue,
        };
        let mut comm: Option<String> = None;
        for fd in fds.flatten() {
            let Ok(target) = fs::read_link(fd.path()) else {
                continue;
            };
            let Some(target) = target.to_str() else {
                continue;
            };
            if !target.starts_with("/dev/") {
                continue;
            }
            let comm = comm
                .get_or_insert_with(|| {
                    fs::read_to_string(entry.path().join("comm"))
                        .map(|s| s.trim().to_string())
                        .unwrap_or_else(|_| "?".into())
                })
                .clone();
            let list = out.entry(target.to_string()).or_default();
            if !list.iter().any(|h| h.pid == pid) {
                list.push(Holder {
                    pid,
                    comm,
                    path: target.to_string(),
                });
            }
        }
    }
    Ok(out)
}

/// Holders of IOMMU group `group`'s `/dev/vfio/<group>`, and of the given VFIO cdevs
/// (`vfio0`, from [`crate::PciDevice::vfio_cdev`]), from a scan made by [`holders`].
pub fn group_holders_in(
    scan: &BTreeMap<String, Vec<Holder>>,
    group: u32,
    cdevs: &[&str],
) -> Vec<Holder> {
    let mut out: Vec<Holder> = scan
        .get(&host_vfio_group_path(group))
        .cloned()
        .unwrap_or_default();
    for c in cdevs {
        if let Some(h) = scan.get(&crate::paths::host_vfio_cdev_path(c)) {
            out.extend(h.iter().cloned());
        }
    }
    out
}

/// Holders of `/dev/vfio/<group>`, scanning `<root>/proc` now.
pub fn group_holders(paths: &HostPaths, group: u32) -> Result<Vec<Holder>> {
    Ok(group_holders_in(&holders(paths)?, group, &[]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn finds_holders_by_host_path() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        let fd = dir.path().join("proc/4242/fd");
        fs::create_dir_all(&fd).unwrap();
        fs::write(dir.path().join("proc/4242/comm"), "qemu-kvm\n").unwrap();
        symlink("/dev/vfio/42", fd.join("17")).unwrap();
        symlink("/dev/vfio/vfio", fd.join("16")).unwrap();
        symlink("socket:[1234]", fd.join("3")).unwrap();
        fs::create_dir_all(dir.path().join("proc/self")).unwrap();
        fs::create_dir_all(dir.path().join("proc/17/fd")).unwrap();

        let h = group_holders(&p, 42).unwrap();
        assert_eq!(
            h,
            vec![Holder {
                pid: 4242,
                comm: "qemu-kvm".into(),
                path: "/dev/vfio/42".into()
            }]
        );
        assert!(group_holders(&p, 43).unwrap().is_empty());
        assert_eq!(h[0].to_string(), "pid 4242 (qemu-kvm) holds /dev/vfio/42");
    }
}
