//! Which processes hold a device node open: a scan of `<root>/proc/<pid>/fd/*` links, and the
//! nvidia driver's GPU → `/dev/nvidia<N>` table.
//!
//! A VM (QEMU in virt-launcher) holds its devices' `/dev/vfio/<group>` (or the VFIO cdev) open
//! for as long as it runs; a CUDA job or nvidia-persistenced holds `/dev/nvidia<N>`. Links are
//! compared as host paths (`/dev/vfio/42`): that is what the kernel shows for a process in the
//! host's mount namespace, and what container runtimes give VMs.

use std::collections::BTreeMap;
use std::fs;
use std::io;

use crate::error::{Error, Result};
use crate::paths::HostPaths;
use crate::pci::PciAddress;
use crate::usage::Process;

/// Every open file under `/dev` of every process: held path → holders. Processes that vanish
/// or whose fds cannot be read (permissions) are skipped.
pub(crate) fn scan(paths: &HostPaths) -> Result<BTreeMap<String, Vec<Process>>> {
    let proc_dir = paths.proc();
    let rd = fs::read_dir(&proc_dir).map_err(|e| Error::io(&proc_dir, e))?;
    let mut out: BTreeMap<String, Vec<Process>> = BTreeMap::new();
    for entry in rd.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        // A process that exited, or one whose fds this process may not read.
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else {
            continue;
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
                list.push(Process {
                    pid,
                    comm,
                    path: target.to_string(),
                });
            }
        }
    }
    Ok(out)
}

/// The minor number (`/dev/nvidia<N>`) of every GPU the nvidia driver lists under
/// `<root>/proc/driver/nvidia/gpus/<address>/information` (`Device Minor:  0`). Empty when the
/// driver is not loaded; a GPU whose file cannot be understood maps to the reason.
pub(crate) fn nvidia_minors(
    paths: &HostPaths,
) -> Result<BTreeMap<PciAddress, Result<u32, super::Unreadable>>> {
    let dir = paths.proc().join("driver/nvidia/gpus");
    let rd = match fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(Error::io(&dir, e)),
    };
    let mut out = BTreeMap::new();
    for entry in rd.flatten() {
        let Some(address) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<PciAddress>().ok())
        else {
            continue;
        };
        let minor = read_minor(&entry.path().join("information")).map_err(|e| {
            super::Unreadable::NvidiaMinor {
                reason: crate::error_chain(&e),
            }
        });
        out.insert(address, minor);
    }
    Ok(out)
}

fn read_minor(path: &std::path::Path) -> Result<u32> {
    let text = fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    for line in text.lines() {
        if let Some((key, value)) = line.split_once(':')
            && key.trim() == "Device Minor"
        {
            return value.trim().parse::<u32>().map_err(|_| Error::Parse {
                path: path.to_path_buf(),
                reason: format!("Device Minor is not a number: {:?}", value.trim()),
            });
        }
    }
    Err(Error::Parse {
        path: path.to_path_buf(),
        reason: "no Device Minor line".into(),
    })
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

        let scan = scan(&p).unwrap();
        assert_eq!(
            scan["/dev/vfio/42"],
            vec![Process {
                pid: 4242,
                comm: "qemu-kvm".into(),
                path: "/dev/vfio/42".into()
            }]
        );
        assert!(!scan.contains_key("/dev/vfio/43"));
        assert!(!scan.contains_key("socket:[1234]"));
        assert_eq!(
            scan["/dev/vfio/42"][0].to_string(),
            "pid 4242 (qemu-kvm) holds /dev/vfio/42"
        );
    }

    #[test]
    fn nvidia_minors_come_from_the_drivers_table() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        assert!(nvidia_minors(&p).unwrap().is_empty(), "no driver loaded");
        for (addr, minor) in [
            ("0000:41:00.0", "1"),
            ("0000:61:00.0", "0"),
            ("0000:81:00.0", "x"),
        ] {
            let info = dir.path().join(format!("proc/driver/nvidia/gpus/{addr}"));
            fs::create_dir_all(&info).unwrap();
            fs::write(
                info.join("information"),
                format!("Model: \t\t NVIDIA A10\nIRQ:   \t\t 88\nDevice Minor: \t {minor}\n"),
            )
            .unwrap();
        }
        let m = nvidia_minors(&p).unwrap();
        let a = |s: &str| s.parse::<PciAddress>().unwrap();
        assert_eq!(m[&a("0000:41:00.0")], Ok(1));
        assert_eq!(m[&a("0000:61:00.0")], Ok(0));
        let e = m[&a("0000:81:00.0")].as_ref().unwrap_err();
        assert!(e.to_string().contains("0000:81:00.0/information"), "{e}");
    }
}
