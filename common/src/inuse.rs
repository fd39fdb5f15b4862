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

/// The minor number of a GPU on the nvidia driver (its `/dev/nvidia<N>`), from the driver's
/// `<root>/proc/driver/nvidia/gpus/<address>/information` (`Device Minor:  0`). `None` when the
/// driver does not list the GPU (not on nvidia, or the driver is not loaded).
pub fn nvidia_minor(paths: &HostPaths, address: &crate::PciAddress) -> Result<Option<u32>> {
    let path = paths
        .proc()
        .join("driver/nvidia/gpus")
        .join(address.to_string())
        .join("information");
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, e)),
    };
    for line in text.lines() {
        if let Some((key, value)) = line.split_once(':')
            && key.trim() == "Device Minor"
        {
            return value
                .trim()
                .parse::<u32>()
                .map(Some)
                .map_err(|_| Error::Parse {
                    path: path.clone(),
                    reason: format!("Device Minor is not a number: {:?}", value.trim()),
                });
        }
    }
    Err(Error::Parse {
        path,
        reason: "no Device Minor line".into(),
    })
}

/// Processes holding the `/dev/nvidia<N>` of the GPU at `address` (a CUDA job,
/// nvidia-persistenced): while any runs, unbinding the GPU from nvidia hangs. Empty when the
/// GPU is not listed by the nvidia driver.
pub fn nvidia_holders(paths: &HostPaths, address: &crate::PciAddress) -> Result<Vec<Holder>> {
    let Some(minor) = nvidia_minor(paths, address)? else {
        return Ok(Vec::new());
    };
    Ok(holders(paths)?
        .remove(&format!("/dev/nvidia{minor}"))
        .unwrap_or_default())
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

    #[test]
    fn nvidia_holders_follow_the_device_minor() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        let a: crate::PciAddress = "0000:41:00.0".parse().unwrap();
        let b: crate::PciAddress = "0000:61:00.0".parse().unwrap();
        let c: crate::PciAddress = "0000:81:00.0".parse().unwrap();
        for (addr, minor) in [(a, "1"), (b, "0"), (c, "x")] {
            let info = dir.path().join(format!("proc/driver/nvidia/gpus/{addr}"));
            fs::create_dir_all(&info).unwrap();
            fs::write(
                info.join("information"),
                format!("Model: \t\t NVIDIA A10\nIRQ:   \t\t 88\nDevice Minor: \t {minor}\n"),
            )
            .unwrap();
        }
        let fd = dir.path().join("proc/77/fd");
        fs::create_dir_all(&fd).unwrap();
        fs::write(dir.path().join("proc/77/comm"), "python3\n").unwrap();
        symlink("/dev/nvidia1", fd.join("5")).unwrap();
        symlink("/dev/nvidiactl", fd.join("4")).unwrap();

        assert_eq!(nvidia_minor(&p, &a).unwrap(), Some(1));
        let h = nvidia_holders(&p, &a).unwrap();
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].to_string(), "pid 77 (python3) holds /dev/nvidia1");
        assert!(nvidia_holders(&p, &b).unwrap().is_empty());
        let e = nvidia_holders(&p, &c).unwrap_err();
        assert!(e.to_string().contains("0000:81:00.0/information"), "{e}");
        let absent: crate::PciAddress = "0000:99:00.0".parse().unwrap();
        assert_eq!(nvidia_minor(&p, &absent).unwrap(), None);
    }
}
