//! A plain sysfs-like tree in a tempdir ([`testkit::sysfs`]): a host root for cases node-sim
//! does not model.

use std::os::unix::fs::symlink;
use std::path::PathBuf;

use testkit::sysfs::SysfsTree;

/// A host root with sys, dev and nothing else.
pub struct Tree {
    sysfs: SysfsTree,
    pub root: PathBuf,
}

pub struct Func<'a> {
    pub bdf: &'a str,
    /// Bridges from the root port down.
    pub bridges: &'a [&'a str],
    pub vendor: u16,
    pub device: u16,
    pub class: u32,
    pub driver: Option<&'a str>,
    pub group: u32,
    pub numa: i32,
}

impl Tree {
    pub fn new() -> Tree {
        let sysfs = SysfsTree::new();
        let root = sysfs.root().to_path_buf();
        std::fs::write(root.join("dev/vfio/vfio"), "").unwrap();
        Tree { sysfs, root }
    }

    pub fn add(&self, f: &Func) -> PathBuf {
        let parent = ["pci0000:00"]
            .iter()
            .chain(f.bridges)
            .copied()
            .collect::<Vec<_>>()
            .join("/");
        let dir = self.sysfs.device(
            &parent,
            f.bdf,
            (
                &format!("0x{:04x}", f.vendor),
                &format!("0x{:04x}", f.device),
                &format!("0x{:06x}", f.class),
            ),
            f.driver,
            f.group,
        );
        self.sysfs.set_attr(f.bdf, "numa_node", &f.numa.to_string());
        dir
    }

    /// An H100 on nvidia (`0000:13:00.0`, group 100) with two SR-IOV VFs: `0000:13:00.4`
    /// (group 130, its node present) holding an NVIDIA H100XM-4C vGPU, `0000:13:00.5`
    /// (group 131) free.
    pub fn add_h100_with_vgpu(&self) {
        let pf = self.add(&Func {
            driver: Some("nvidia"),
            device: 0x2330,
            ..a10("0000:13:00.0", 100)
        });
        for (vf, group, current, creatable) in [
            ("0000:13:00.4", 130, "1000", "ID    : vGPU Name\n"),
            (
                "0000:13:00.5",
                131,
                "0",
                "ID    : vGPU Name\n1000  : NVIDIA H100XM-4C\n",
            ),
        ] {
            let dir = self.add(&Func {
                driver: Some("nvidia"),
                device: 0x2330,
                bridges: &["0000:00:01.0", "0000:13:00.0"],
                ..a10(vf, group)
            });
            // A VF sits beside its PF in the real tree; the nesting here only fakes the bridges.
            symlink(&pf, dir.join("physfn")).unwrap();
            std::fs::create_dir_all(dir.join("nvidia")).unwrap();
            std::fs::write(dir.join("nvidia/current_vgpu_type"), format!("{current}\n")).unwrap();
            std::fs::write(dir.join("nvidia/creatable_vgpu_types"), creatable).unwrap();
        }
        std::fs::write(self.vfio_node(130), "").unwrap();
    }

    /// Moves a function's `driver` link (sysfs only: no event announces it).
    pub fn set_driver(&self, bdf: &str, driver: Option<&str>) {
        self.sysfs.set_driver(bdf, driver);
    }

    pub fn vfio_node(&self, group: u32) -> PathBuf {
        self.root.join(format!("dev/vfio/{group}"))
    }
}

pub fn a10<'a>(bdf: &'a str, group: u32) -> Func<'a> {
    Func {
        bdf,
        bridges: &["0000:00:01.0"],
        vendor: 0x10de,
        device: 0x2236,
        class: 0x030200,
        driver: Some("vfio-pci"),
        group,
        numa: 1,
    }
}

/// Passthrough A10 on vfio-pci, with its node.
pub fn one_a10() -> Tree {
    let t = Tree::new();
    t.add(&a10("0000:01:00.0", 21));
    std::fs::write(t.vfio_node(21), "").unwrap();
    t
}
