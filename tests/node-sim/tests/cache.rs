//! The kernel caches `sys` and `dev` names, attributes and symlinks: every write, control
//! command and refused write must show at the very next read, through paths looked up before.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;
use support::*;

const GPU: &str = "0000:41:00.0";
const DEV: &str = "sys/bus/pci/devices/0000:41:00.0";

/// Looks `rel` up (so the kernel caches it) and says whether it is there.
fn seen(m: &Mounted, rel: &str) -> bool {
    m.exists(rel)
}

#[test]
fn cached_names_and_links_follow_driver_changes() {
    let Some(m) = mount("2xA10") else { return };
    assert_eq!(m.driver(GPU).as_deref(), Some("nvidia"));
    assert!(seen(&m, "dev/nvidia0"));
    assert!(!seen(&m, "dev/vfio/21"));

    m.w(&format!("{DEV}/driver_override"), "vfio-pci").unwrap();
    assert_eq!(m.r(&format!("{DEV}/driver_override")), "vfio-pci");
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    assert!(!seen(&m, &format!("{DEV}/driver")), "driver link gone");
    assert!(!seen(&m, "dev/nvidia0"));
    assert!(!seen(&m, &format!("sys/bus/pci/drivers/nvidia/{GPU}")));
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    // The same link path, another target.
    assert_eq!(m.driver(GPU).as_deref(), Some("vfio-pci"));
    assert!(seen(&m, "dev/vfio/21"));
    assert!(m.ls("dev/vfio").contains(&"21".to_string()));
    m.w("sys/bus/pci/drivers/vfio-pci/unbind", GPU).unwrap();
    assert!(!seen(&m, "dev/vfio/21"));
    assert!(!m.ls("dev/vfio").contains(&"21".to_string()));
    m.w(&format!("{DEV}/driver_override"), "").unwrap();
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    assert_eq!(m.driver(GPU).as_deref(), Some("nvidia"));
    assert!(seen(&m, "dev/nvidia0"));
}

#[test]
fn cached_vfs_mdevs_and_values_follow_writes() {
    let Some(m) = mount("2xA10") else { return };
    let vf = "sys/bus/pci/devices/0000:41:00.4";
    assert!(!seen(&m, vf));
    assert_eq!(m.r(&format!("{DEV}/sriov_numvfs")), "0");
    m.w(&format!("{DEV}/sriov_numvfs"), "4").unwrap();
    assert_eq!(m.r(&format!("{DEV}/sriov_numvfs")), "4");
    assert!(seen(&m, vf));
    let t = format!("{vf}/mdev_supported_types/nvidia-593");
    assert_eq!(m.r(&format!("{t}/available_instances")), "1");
    let uuid = "5a3b2c1d-0000-4000-8000-00000000abcd";
    let mdev = format!("sys/bus/mdev/devices/{uuid}");
    assert!(!seen(&m, &mdev));
    m.w(&format!("{t}/create"), uuid).unwrap();
    assert!(seen(&m, &mdev));
    assert!(seen(&m, &format!("{t}/devices/{uuid}")));
    assert_eq!(m.r(&format!("{t}/available_instances")), "0");
    m.w(&format!("{mdev}/remove"), "1").unwrap();
    assert!(!seen(&m, &mdev));
    assert!(!seen(&m, &format!("{t}/devices/{uuid}")));
    assert_eq!(m.r(&format!("{t}/available_instances")), "1");
    // The VF and everything under it go with sriov_numvfs 0.
    m.w(&format!("{DEV}/sriov_numvfs"), "0").unwrap();
    assert!(!seen(&m, vf));
    assert!(!seen(&m, &t));
    assert!(!seen(&m, "sys/class/mdev_bus/0000:41:00.4"));
}

#[test]
fn cached_names_follow_control_commands_and_refused_writes() {
    let Some(m) = mount("2xA10") else { return };
    let new = "sys/bus/pci/devices/0000:81:00.0";
    assert!(!seen(&m, new));
    m.ctl("hotplug 0000:81:00.0 A10");
    assert!(seen(&m, new));
    assert_eq!(m.driver("0000:81:00.0").as_deref(), Some("nvidia"));
    m.ctl("unplug 0000:81:00.0");
    assert!(!seen(&m, new));
    assert!(!seen(&m, &format!("{new}/vendor")));
    // A refused write changes nothing: the cached link is still right.
    m.ctl(&format!("fault unbind {GPU} EBUSY count=1"));
    assert_eq!(m.w("sys/bus/pci/drivers/nvidia/unbind", GPU), Err(EBUSY));
    assert_eq!(m.driver(GPU).as_deref(), Some("nvidia"));
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    assert_eq!(m.driver(GPU), None);
}
