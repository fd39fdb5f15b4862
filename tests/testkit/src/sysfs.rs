//! A plain sysfs-like host root in a temporary directory, built by hand for the cases node-sim
//! does not model (odd files, links moved behind the daemons' backs). Links are relative, as
//! the kernel's are, so the tree reads the same from any `--host-root`.
//!
//! ```no_run
//! let t = testkit::sysfs::SysfsTree::new();
//! t.device("pci0000:00/0000:00:01.0", "0000:41:00.0", testkit::sysfs::A10, Some("nvidia"), 30);
//! t.vfio_node(30);
//! // pass t.root() as --host-root
//! ```
#![allow(clippy::unwrap_used)] // test code: a failed setup step should panic

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// An NVIDIA A10's `vendor`, `device` and `class`, as sysfs shows them.
pub const A10: (&str, &str, &str) = ("0x10de", "0x2236", "0x030200");

/// A host root with the directories the kernel always has: the PCI bus and its `nvidia` and
/// `vfio-pci` drivers, IOMMU groups, the mdev bus and class, `/dev/vfio`.
#[derive(Debug)]
pub struct SysfsTree {
    dir: tempfile::TempDir,
}

impl Default for SysfsTree {
    fn default() -> Self {
        Self::new()
    }
}

impl SysfsTree {
    /// An empty node.
    pub fn new() -> SysfsTree {
        let dir = tempfile::Builder::new()
            .prefix("sysfs-tree-")
            .tempdir()
            .unwrap();
        for d in [
            "sys/bus/pci/devices",
            "sys/bus/pci/drivers/nvidia",
            "sys/bus/pci/drivers/vfio-pci",
            "sys/kernel/iommu_groups",
            "sys/bus/mdev/devices",
            "sys/class/mdev_bus",
            "dev/vfio",
        ] {
            fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        SysfsTree { dir }
    }

    /// The host root.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// A PCI function `bdf` below `parent` (a path under `sys/devices`: the root complex and the
    /// bridges, `pci0000:00/0000:00:01.0`) with `vendor`, `device` and `class` as given
    /// (verbatim, so a test can write nonsense), subsystem `0x10de:0x1482`, no
    /// `driver_override`, NUMA node 1, on `driver` and in IOMMU group `group`. Returns its
    /// directory.
    pub fn device(
        &self,
        parent: &str,
        bdf: &str,
        ids: (&str, &str, &str),
        driver: Option<&str>,
        group: u32,
    ) -> PathBuf {
        let rel = format!("{parent}/{bdf}");
        let d = self.root().join("sys/devices").join(&rel);
        fs::create_dir_all(&d).unwrap();
        let put = |name: &str, v: &str| fs::write(d.join(name), format!("{v}\n")).unwrap();
        put("vendor", ids.0);
        put("device", ids.1);
        put("subsystem_vendor", "0x10de");
        put("subsystem_device", "0x1482");
        put("class", ids.2);
        put("driver_override", "(null)");
        put("numa_node", "1");
        let up = up_to_sys(&rel);
        if let Some(drv) = driver {
            self.driver_dir(drv);
            symlink(format!("{up}bus/pci/drivers/{drv}"), d.join("driver")).unwrap();
        }
        fs::create_dir_all(
            self.root()
                .join(format!("sys/kernel/iommu_groups/{group}/devices")),
        )
        .unwrap();
        symlink(
            format!("{up}kernel/iommu_groups/{group}"),
            d.join("iommu_group"),
        )
        .unwrap();
        // The group lists its functions, as the kernel's does (a function added again
        // replaces its link).
        let member = self
            .root()
            .join(format!("sys/kernel/iommu_groups/{group}/devices/{bdf}"));
        let _ = fs::remove_file(&member);
        symlink(format!("../../../../devices/{rel}"), member).unwrap();
        symlink(
            format!("../../../devices/{rel}"),
            self.root().join("sys/bus/pci/devices").join(bdf),
        )
        .unwrap();
        d
    }

    /// The directory of PCI function `bdf` (through its `sys/bus/pci/devices` link).
    pub fn device_dir(&self, bdf: &str) -> PathBuf {
        fs::canonicalize(self.root().join("sys/bus/pci/devices").join(bdf)).unwrap()
    }

    /// Moves `bdf`'s `driver` link (sysfs only: no event announces it); `None` unbinds it.
    pub fn set_driver(&self, bdf: &str, driver: Option<&str>) {
        let d = self.device_dir(bdf);
        let _ = fs::remove_file(d.join("driver"));
        if let Some(drv) = driver {
            self.driver_dir(drv);
            let root = fs::canonicalize(self.root()).unwrap();
            let rel = d.strip_prefix(root.join("sys/devices")).unwrap();
            let up = up_to_sys(&rel.to_string_lossy());
            symlink(format!("{up}bus/pci/drivers/{drv}"), d.join("driver")).unwrap();
        }
    }

    /// Writes `value` (and a newline) to the attribute `name` of `bdf` (`numa_node`,
    /// `sriov_numvfs`).
    pub fn set_attr(&self, bdf: &str, name: &str, value: &str) {
        fs::write(self.device_dir(bdf).join(name), format!("{value}\n")).unwrap();
    }

    /// Creates `/dev/vfio/<group>`; returns its path.
    pub fn vfio_node(&self, group: u32) -> PathBuf {
        let p = self.root().join(format!("dev/vfio/{group}"));
        fs::write(&p, "").unwrap();
        p
    }

    /// An mdev type `id` named `name` under `parent` (a device directory), with
    /// `available_instances`; returns the type's directory.
    pub fn mdev_type(&self, parent: &Path, id: &str, name: &str, available: u32) -> PathBuf {
        let t = parent.join("mdev_supported_types").join(id);
        fs::create_dir_all(t.join("devices")).unwrap();
        fs::write(t.join("name"), format!("{name}\n")).unwrap();
        fs::write(t.join("available_instances"), format!("{available}\n")).unwrap();
        t
    }

    /// Lists `parent` (a path under `sys/devices`) as an mdev parent named `name` in
    /// `sys/class/mdev_bus`.
    pub fn mdev_parent(&self, parent: &str, name: &str) {
        symlink(
            format!("../../devices/{parent}"),
            self.root().join("sys/class/mdev_bus").join(name),
        )
        .unwrap();
    }

    /// An mdev `uuid` of type `type_id` under `parent` (a path under `sys/devices`), in IOMMU
    /// group `group` when given; returns its directory. Its `/dev/vfio` node is not made.
    pub fn mdev(&self, parent: &str, uuid: &str, type_id: &str, group: Option<u32>) -> PathBuf {
        let rel = format!("{parent}/{uuid}");
        let m = self.root().join("sys/devices").join(&rel);
        fs::create_dir_all(&m).unwrap();
        symlink(
            format!("../mdev_supported_types/{type_id}"),
            m.join("mdev_type"),
        )
        .unwrap();
        if let Some(g) = group {
            fs::create_dir_all(self.root().join(format!("sys/kernel/iommu_groups/{g}"))).unwrap();
            symlink(
                format!("{}kernel/iommu_groups/{g}", up_to_sys(&rel)),
                m.join("iommu_group"),
            )
            .unwrap();
        }
        symlink(
            format!("../../../devices/{rel}"),
            self.root().join("sys/bus/mdev/devices").join(uuid),
        )
        .unwrap();
        m
    }

    fn driver_dir(&self, driver: &str) {
        fs::create_dir_all(self.root().join("sys/bus/pci/drivers").join(driver)).unwrap();
    }
}

/// `../` enough times to climb from `sys/devices/<rel>` to `sys/`.
fn up_to_sys(rel: &str) -> String {
    "../".repeat(rel.matches('/').count() + 2)
}
