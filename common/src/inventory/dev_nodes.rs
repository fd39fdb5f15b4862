//! The iommufd-era device nodes: `/dev/iommu` and the VFIO cdevs under `/dev/vfio/devices/`.
//! A VM is handed them, next to its group's `/dev/vfio/<group>`, when the host has them.

use std::collections::BTreeSet;

use serde::Serialize;

use super::{Inventory, list_dir};
use crate::paths::HostPaths;

/// iommufd-era device nodes that exist on the host ([`Inventory::dev_nodes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DevNodes {
    /// `/dev/iommu` exists.
    pub iommufd: bool,
    /// Names under `/dev/vfio/devices/` (`vfio0`).
    pub cdevs: BTreeSet<String>,
}

impl DevNodes {
    /// Looks under the host root. A kernel without iommufd has neither: a directory that cannot
    /// be listed counts as empty.
    pub fn read(paths: &HostPaths) -> DevNodes {
        DevNodes {
            iommufd: paths.iommufd().exists(),
            cdevs: list_dir(&paths.vfio_cdev_dir())
                .unwrap_or_default()
                .into_iter()
                .collect(),
        }
    }
}

impl Inventory {
    /// Re-reads [`Inventory::dev_nodes`] (after an event on `/dev/iommu` or
    /// `/dev/vfio/devices/`).
    pub fn refresh_dev_nodes(&mut self, paths: &HostPaths) {
        self.dev_nodes = DevNodes::read(paths);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_nodes_that_exist_and_rereads_them_on_refresh() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        std::fs::create_dir_all(dir.path().join("sys/bus/pci/devices")).unwrap();
        let inv = Inventory::read(&paths).unwrap();
        assert_eq!(inv.dev_nodes, DevNodes::default());

        let cdevs = dir.path().join("dev/vfio/devices");
        std::fs::create_dir_all(&cdevs).unwrap();
        std::fs::write(cdevs.join("vfio1"), "").unwrap();
        std::fs::write(cdevs.join("vfio0"), "").unwrap();
        std::fs::write(dir.path().join("dev/iommu"), "").unwrap();
        let mut inv = Inventory::read(&paths).unwrap();
        let both = DevNodes {
            iommufd: true,
            cdevs: ["vfio0", "vfio1"].map(String::from).into(),
        };
        assert_eq!(inv.dev_nodes, both);

        std::fs::remove_file(cdevs.join("vfio1")).unwrap();
        inv.refresh_dev_nodes(&paths);
        assert_eq!(inv.dev_nodes.cdevs, ["vfio0".to_string()].into());
        assert!(inv.dev_nodes.iommufd);
    }
}
