//! `Inventory::read` against plain trees in a tempdir, including odd ones.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed setup step should panic

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use common::{HostPaths, Inventory, PciAddress, ReadOptions, is_vfio_driver};
use testkit::sysfs::SysfsTree;

/// The shared builder ([`SysfsTree`]) and the node's paths.
struct Tree(SysfsTree);

impl std::ops::Deref for Tree {
    type Target = SysfsTree;

    fn deref(&self) -> &SysfsTree {
        &self.0
    }
}

impl Tree {
    fn new() -> Self {
        Tree(SysfsTree::new())
    }

    fn paths(&self) -> HostPaths {
        HostPaths::new(self.root())
    }
}

fn a(s: &str) -> PciAddress {
    s.parse().unwrap()
}

/// Two GPUs whose VFs list a type of the same id under different names: each VF has its own
/// GPU's name and description (read once per GPU) and its own `available_instances`, in a full
/// read and in a read of one GPU alone.
#[test]
fn each_vf_has_its_own_gpus_type_names_and_its_own_instances() {
    let t = Tree::new();
    let mut want = Vec::new();
    for (g, pf_addr, model) in [(0, "0000:41:00.0", "A10"), (1, "0000:61:00.0", "A40")] {
        let pf = t.device(
            "pci0000:00",
            pf_addr,
            ("0x10de", "0x2236", "0x030200"),
            Some("nvidia"),
            30 + g,
        );
        fs::write(pf.join("sriov_numvfs"), "2\n").unwrap();
        for n in 0..2u32 {
            let vf_addr = format!("{}.{}", &pf_addr[..10], 4 + n);
            let vf = t.device(
                "pci0000:00",
                &vf_addr,
                ("0x10de", "0x2236", "0x030200"),
                Some("nvidia"),
                40 + 2 * g + n,
            );
            symlink(format!("../{pf_addr}"), vf.join("physfn")).unwrap();
            symlink(format!("../{vf_addr}"), pf.join(format!("virtfn{n}"))).unwrap();
            let available = 10 * g + n;
            let td =
                t.0.mdev_type(&vf, "nvidia-1", &format!("NVIDIA {model}-4Q"), available);
            fs::write(td.join("description"), format!("model={model}\n")).unwrap();
            t.0.mdev_parent(&format!("pci0000:00/{vf_addr}"), &vf_addr);
            want.push((vf_addr, format!("NVIDIA {model}-4Q"), available));
        }
    }
    let check = |inv: &Inventory, gpu: Option<&str>| {
        for (vf, name, available) in &want {
            if gpu.is_some_and(|g| vf[..10] != g[..10]) {
                assert!(!inv.mdev_parents.contains_key(vf), "{vf} was read");
                continue;
            }
            let ty = &inv.mdev_parents[vf].types[0];
            assert_eq!(ty.name.as_deref(), Some(name.as_str()), "{vf}");
            let model = &name["NVIDIA ".len()..name.len() - 3];
            assert_eq!(ty.description, Some(format!("model={model}")), "{vf}");
            assert_eq!(ty.available_instances, *available, "{vf}");
        }
    };
    check(&Inventory::read(&t.paths()).unwrap(), None);
    let mut one = Inventory::default();
    one.refresh_pci(&t.paths(), a("0000:61:00.0"), &ReadOptions::default());
    check(&one, Some("0000:61:00.0"));
}

#[test]
fn reads_functions_groups_and_bridges() {
    let t = Tree::new();
    t.device(
        "pci0000:00/0000:00:01.0",
        "0000:41:00.0",
        ("0x10de", "0x2236", "0x030200"),
        Some("nvidia"),
        30,
    );
    t.device(
        "pci0000:00/0000:00:01.0",
        "0000:41:00.1",
        ("0x10de", "0x1aef", "0x040300"),
        None,
        30,
    );
    t.device(
        "pci0000:00/0000:00:02.0/0000:01:00.0/0000:02:08.0",
        "0000:03:00.0",
        ("0x10de", "0x2236", "0x030200"),
        Some("vfio-pci"),
        31,
    );
    fs::write(t.root().join("dev/vfio/31"), "").unwrap();
    fs::write(t.root().join("dev/vfio/vfio"), "").unwrap();

    let inv = Inventory::read(&t.paths()).unwrap();
    assert!(inv.unreadable.is_empty(), "{:?}", inv.unreadable);
    let gpu = inv.device(&a("0000:41:00.0")).unwrap();
    assert_eq!(
        (gpu.vendor, gpu.device, gpu.class),
        (0x10de, 0x2236, 0x030200)
    );
    assert_eq!(gpu.subsystem_device, 0x1482);
    assert_eq!(gpu.driver.as_deref(), Some("nvidia"));
    assert_eq!(gpu.driver_override, None);
    assert_eq!(gpu.iommu_group, Some(30));
    assert_eq!(gpu.numa_node, Some(1));
    assert_eq!(gpu.upstream_bridge, Some(a("0000:00:01.0")));
    assert!(gpu.is_display() && !gpu.is_vf() && !gpu.is_bridge());
    assert_eq!(
        inv.group_members(30),
        vec![a("0000:41:00.0"), a("0000:41:00.1")]
    );
    let deep = inv.device(&a("0000:03:00.0")).unwrap();
    assert_eq!(
        deep.bridges,
        vec![a("0000:02:08.0"), a("0000:01:00.0"), a("0000:00:02.0")]
    );
    // The root complex above the bridges: Kubernetes' resource.kubernetes.io/pcieRoot.
    assert_eq!(deep.pcie_root.as_deref(), Some("pci0000:00"));
    assert_eq!(gpu.pcie_root.as_deref(), Some("pci0000:00"));
    assert_eq!(inv.gpus(Some(0x10de)).len(), 2);
    assert_eq!(inv.vfio_nodes.iter().copied().collect::<Vec<_>>(), vec![31]);
}

/// What preparing a whole GPU reads: its IOMMU group's functions, read as a full read reads
/// them, with the group nodes and the device nodes, and no other group.
#[test]
fn a_gpus_groups_read_alone_are_what_a_full_read_shows_of_them() {
    let t = Tree::new();
    let gpu = ("0x10de", "0x2236", "0x030200");
    t.device(
        "pci0000:00/0000:00:01.0",
        "0000:41:00.0",
        gpu,
        Some("vfio-pci"),
        30,
    );
    t.device(
        "pci0000:00/0000:00:01.0",
        "0000:41:00.1",
        ("0x10de", "0x1aef", "0x040300"),
        Some("vfio-pci"),
        30,
    );
    t.device(
        "pci0000:00/0000:00:02.0",
        "0000:61:00.0",
        gpu,
        Some("nvidia"),
        31,
    );
    fs::write(t.root().join("dev/vfio/30"), "").unwrap();
    fs::create_dir_all(t.root().join("dev/vfio/devices")).unwrap();
    fs::write(t.root().join("dev/vfio/devices/vfio0"), "").unwrap();
    fs::write(t.root().join("dev/iommu"), "").unwrap();

    let full = Inventory::read(&t.paths()).unwrap();
    let groups = Inventory::read_groups(&t.paths(), &[a("0000:41:00.0")], &ReadOptions::default());
    for f in ["0000:41:00.0", "0000:41:00.1"] {
        assert_eq!(groups.device(&a(f)), full.device(&a(f)), "{f}");
    }
    assert_eq!(
        groups.device(&a("0000:61:00.0")),
        None,
        "another group is not read"
    );
    assert_eq!(groups.group_members(30), full.group_members(30));
    assert!(groups.vfio_nodes.contains(&30));
    assert_eq!(groups.dev_nodes, full.dev_nodes);
    // A function that is not there is not in it.
    let none = Inventory::read_groups(&t.paths(), &[a("0000:81:00.0")], &ReadOptions::default());
    assert!(none.devices.is_empty());
}

#[test]
fn odd_devices_are_reported_and_the_rest_returned() {
    let t = Tree::new();
    t.device(
        "pci0000:00",
        "0000:41:00.0",
        ("0x10de", "0x2236", "0x030200"),
        Some("nvidia"),
        30,
    );
    let garbage = t.device(
        "pci0000:00",
        "0000:42:00.0",
        ("nonsense", "0x2236", "0x030200"),
        None,
        31,
    );
    let missing = t.device(
        "pci0000:00",
        "0000:43:00.0",
        ("0x10de", "0x2236", "0x030200"),
        None,
        32,
    );
    fs::remove_file(missing.join("class")).unwrap();
    symlink(
        "../../../devices/pci0000:00/0000:44:00.0",
        t.root().join("sys/bus/pci/devices/0000:44:00.0"),
    )
    .unwrap();
    fs::create_dir_all(t.root().join("sys/bus/pci/devices/not-an-address")).unwrap();
    let badgroup = t.device(
        "pci0000:00",
        "0000:45:00.0",
        ("0x10de", "0x2236", "0x030200"),
        None,
        33,
    );
    fs::remove_file(badgroup.join("iommu_group")).unwrap();
    symlink("../../kernel/iommu_groups/x", badgroup.join("iommu_group")).unwrap();
    let _ = garbage;

    let inv = Inventory::read(&t.paths()).unwrap();
    assert_eq!(
        inv.devices.keys().copied().collect::<Vec<_>>(),
        vec![a("0000:41:00.0")]
    );
    let reasons: Vec<String> = inv
        .unreadable
        .iter()
        .map(|u| format!("{}: {}", u.path.display(), u.reason))
        .collect();
    assert_eq!(reasons.len(), 5, "{reasons:#?}");
    let has = |needle: &str| reasons.iter().any(|r| r.contains(needle));
    assert!(has("0000:42:00.0/vendor: not a hex number"), "{reasons:#?}");
    assert!(has("0000:43:00.0/class"), "{reasons:#?}");
    assert!(has("0000:44:00.0: dangling link"), "{reasons:#?}");
    assert!(has("not-an-address"), "{reasons:#?}");
    assert!(has("0000:45:00.0/iommu_group"), "{reasons:#?}");
    // The groups of the unreadable functions whose group link could be read.
    assert_eq!(
        inv.unreadable_in_group,
        [(31, vec![a("0000:42:00.0")]), (32, vec![a("0000:43:00.0")])].into()
    );
}

#[test]
fn mdev_parents_types_and_instances() {
    let t = Tree::new();
    let pf = t.device(
        "pci0000:00",
        "0000:41:00.0",
        ("0x10de", "0x2236", "0x030200"),
        Some("nvidia"),
        30,
    );
    fs::write(pf.join("sriov_totalvfs"), "32\n").unwrap();
    fs::write(pf.join("sriov_numvfs"), "1\n").unwrap();
    let vf = t.device(
        "pci0000:00",
        "0000:41:00.4",
        ("0x10de", "0x2236", "0x030200"),
        Some("nvidia"),
        40,
    );
    symlink("../0000:41:00.0", vf.join("physfn")).unwrap();
    symlink("../0000:41:00.4", pf.join("virtfn0")).unwrap();
    for (id, name) in [
        ("nvidia-593", "NVIDIA A10-4Q"),
        ("nvidia-594", "NVIDIA A10-6Q"),
    ] {
        t.0.mdev_type(&vf, id, name, 0);
    }
    t.0.mdev_parent("pci0000:00/0000:41:00.4", "0000:41:00.4");
    let uuid = "3b1a9d2e-0a51-4c5e-9f0e-6c7a8d9e0f11";
    let m =
        t.0.mdev("pci0000:00/0000:41:00.4", uuid, "nvidia-593", Some(120));
    // iommufd kernels: the mdev's own VFIO cdev.
    fs::create_dir_all(m.join("vfio-dev/vfio7")).unwrap();

    let inv = Inventory::read(&t.paths()).unwrap();
    assert!(inv.unreadable.is_empty(), "{:?}", inv.unreadable);
    let pfd = inv.device(&a("0000:41:00.0")).unwrap();
    assert_eq!(pfd.virtfns, vec![a("0000:41:00.4")]);
    assert_eq!((pfd.sriov_totalvfs, pfd.sriov_numvfs), (Some(32), Some(1)));
    let vfd = inv.device(&a("0000:41:00.4")).unwrap();
    assert_eq!(vfd.physfn, Some(a("0000:41:00.0")));
    assert!(vfd.is_vf());
    assert_eq!(inv.gpus(None).len(), 1, "VFs are not GPUs");
    let parent = &inv.mdev_parents["0000:41:00.4"];
    assert_eq!(parent.pci, Some(a("0000:41:00.4")));
    assert_eq!(parent.types.len(), 2);
    assert_eq!(parent.types[0].name.as_deref(), Some("NVIDIA A10-4Q"));
    assert_eq!(parent.types[0].description, None);
    let mdev = &inv.mdevs[uuid];
    assert_eq!(mdev.type_id, "nvidia-593");
    assert_eq!(mdev.type_name.as_deref(), Some("NVIDIA A10-4Q"));
    assert_eq!(mdev.parent, "0000:41:00.4");
    assert_eq!(mdev.iommu_group, Some(120));
    assert_eq!(mdev.vfio_cdev.as_deref(), Some("vfio7"));

    let light = Inventory::read_with(
        &t.paths(),
        &ReadOptions {
            mdev_types: false,
            vf_identity: false,
        },
    )
    .unwrap();
    assert!(light.mdev_parents["0000:41:00.4"].types.is_empty());
    // The VF's identity is its PF's; what it holds is its own.
    let (full, lite) = (
        inv.device(&a("0000:41:00.4")).unwrap(),
        light.device(&a("0000:41:00.4")).unwrap(),
    );
    assert_eq!(
        (lite.vendor, lite.device, lite.class),
        (full.vendor, full.device, full.class)
    );
    assert_eq!(
        (
            &lite.physfn,
            &lite.driver,
            lite.iommu_group,
            lite.mdev_parent
        ),
        (
            &full.physfn,
            &full.driver,
            full.iommu_group,
            full.mdev_parent
        )
    );
    assert_eq!(
        light.mdevs[uuid].type_name.as_deref(),
        Some("NVIDIA A10-4Q")
    );
}

#[test]
fn vfio_drivers_and_their_variants() {
    for d in [
        "vfio-pci",
        "vfio_pci",
        "nvgrace_gpu_vfio_pci",
        "mlx5_vfio_pci",
        "foo-vfio-pci",
    ] {
        assert!(is_vfio_driver(d), "{d}");
    }
    for d in ["nvidia", "vfio_mdev", "nouveau", ""] {
        assert!(!is_vfio_driver(d), "{d}");
    }
}

#[test]
fn a_vf_passed_through_on_its_own_keeps_its_identity() {
    // Without `vf_identity` a VF takes its PF's ids, unless it is on a VFIO driver: then it is
    // advertised as what it is.
    let t = Tree::new();
    let pf = t.device(
        "pci0000:00",
        "0000:41:00.0",
        ("0x10de", "0x2236", "0x030200"),
        Some("nvidia"),
        30,
    );
    fs::write(pf.join("sriov_totalvfs"), "4\n").unwrap();
    fs::write(pf.join("sriov_numvfs"), "2\n").unwrap();
    for (n, bdf, device, driver, group) in [
        (0, "0000:41:00.4", "0x2237", "nvidia", 40),
        (1, "0000:41:00.5", "0x2237", "vfio-pci", 41),
    ] {
        let vf = t.device(
            "pci0000:00",
            bdf,
            ("0x10de", device, "0x030200"),
            Some(driver),
            group,
        );
        symlink("../0000:41:00.0", vf.join("physfn")).unwrap();
        symlink(format!("../{bdf}"), pf.join(format!("virtfn{n}"))).unwrap();
    }
    let light = Inventory::read_with(
        &t.paths(),
        &ReadOptions {
            mdev_types: false,
            vf_identity: false,
        },
    )
    .unwrap();
    assert!(light.unreadable.is_empty(), "{:?}", light.unreadable);
    let on_nvidia = light.device(&a("0000:41:00.4")).unwrap();
    assert_eq!(on_nvidia.device, 0x2236, "its PF's");
    let on_vfio = light.device(&a("0000:41:00.5")).unwrap();
    assert_eq!(on_vfio.device, 0x2237, "its own");
    assert_eq!(on_vfio.driver.as_deref(), Some("vfio-pci"));
    assert_eq!(on_vfio.numa_node, Some(1));
}

#[test]
fn vendor_path_vgpu_vfs() {
    let t = Tree::new();
    let vf = t.device(
        "pci0000:00",
        "0000:59:00.4",
        ("0x10de", "0x26b9", "0x030200"),
        Some("nvidia"),
        50,
    );
    let vf2 = t.device(
        "pci0000:00",
        "0000:59:00.5",
        ("0x10de", "0x26b9", "0x030200"),
        Some("nvidia"),
        51,
    );
    fs::create_dir_all(vf.join("nvidia")).unwrap();
    fs::create_dir_all(vf2.join("nvidia")).unwrap();
    fs::write(
        vf.join("nvidia/creatable_vgpu_types"),
        "ID    : vGPU Name\n",
    )
    .unwrap();
    fs::write(vf.join("nvidia/current_vgpu_type"), "1147\n").unwrap();
    fs::write(
        vf2.join("nvidia/creatable_vgpu_types"),
        "ID    : vGPU Name\n1147  : NVIDIA L40S-1Q\n",
    )
    .unwrap();
    fs::write(vf2.join("nvidia/current_vgpu_type"), "0\n").unwrap();
    let inv = Inventory::read(&t.paths()).unwrap();
    let v = inv
        .device(&a("0000:59:00.4"))
        .unwrap()
        .nvidia_vgpu
        .as_ref()
        .unwrap();
    assert_eq!(v.current, 1147);
    assert!(v.creatable.is_empty());
    assert_eq!(
        v.current_name.as_deref(),
        Some("NVIDIA L40S-1Q"),
        "named from a sibling"
    );
    let v2 = inv
        .device(&a("0000:59:00.5"))
        .unwrap()
        .nvidia_vgpu
        .as_ref()
        .unwrap();
    assert_eq!(v2.creatable[0].id, 1147);
}

#[test]
fn no_pci_tree_is_an_error_naming_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let e = Inventory::read(&HostPaths::new(dir.path())).unwrap_err();
    assert!(e.to_string().contains("sys/bus/pci/devices"), "{e}");
}

#[test]
fn a_relative_host_root_above_the_current_directory_reads_the_same() {
    let t = Tree::new();
    t.device(
        "pci0000:00/0000:00:01.0",
        "0000:41:00.0",
        ("0x10de", "0x2236", "0x030200"),
        Some("nvidia"),
        30,
    );
    let sub = t.root().join("cwd");
    fs::create_dir_all(&sub).unwrap();
    // ../ from a directory inside the root: what `--host-root ..` gives.
    let rel = Path::new("..")
        .join(sub.strip_prefix(t.root()).unwrap())
        .join("..");
    let cwd = std::env::current_dir().unwrap();
    std::env::set_current_dir(&sub).unwrap();
    let inv = Inventory::read(&HostPaths::new(&rel));
    std::env::set_current_dir(cwd).unwrap();
    let inv = inv.unwrap();
    assert!(inv.unreadable.is_empty(), "{:?}", inv.unreadable);
    assert_eq!(
        inv.device(&a("0000:41:00.0")).unwrap().upstream_bridge,
        Some(a("0000:00:01.0"))
    );
}

// ---------------------------------------------------------------------------------- refreshes

/// What sandbox-dp reads: no mdev types, a VF's identity from its PF.
fn light() -> ReadOptions {
    ReadOptions {
        mdev_types: false,
        vf_identity: false,
    }
}

/// A kept inventory, refreshed event by event, compared with a full read after each change.
struct Follower {
    paths: HostPaths,
    opts: ReadOptions,
    inv: Inventory,
}

impl Follower {
    fn new(t: &Tree, opts: ReadOptions) -> Self {
        let inv = Inventory::read_with(&t.paths(), &opts).unwrap();
        Follower {
            paths: t.paths(),
            opts,
            inv,
        }
    }

    fn pci(&mut self, bdf: &str) -> &mut Self {
        self.inv.refresh_pci(&self.paths, a(bdf), &self.opts);
        self
    }

    fn mdev(&mut self, uuid: &str) -> &mut Self {
        self.inv.refresh_mdev(&self.paths, uuid);
        self
    }

    fn group_node(&mut self, g: u32) -> &mut Self {
        self.inv.refresh_vfio_node(&self.paths, g);
        self
    }

    /// The refreshed inventory is what a full read sees now.
    fn matches(&self, step: &str) {
        let full = Inventory::read_with(&self.paths, &self.opts).unwrap();
        assert_eq!(self.inv, full, "{step}");
    }
}

const UUID: &str = "3b1a9d2e-0a51-4c5e-9f0e-6c7a8d9e0f11";

impl Tree {
    /// A VF of 0000:41:00.0 (`virtfn<n>`), an mdev parent.
    fn add_vf(&self, n: u32, bdf: &str, group: u32) -> PathBuf {
        let pf = self.root().join("sys/devices/pci0000:00/0000:41:00.0");
        let vf = self.device(
            "pci0000:00",
            bdf,
            ("0x10de", "0x2236", "0x030200"),
            Some("nvidia"),
            group,
        );
        symlink("../0000:41:00.0", vf.join("physfn")).unwrap();
        symlink(format!("../{bdf}"), pf.join(format!("virtfn{n}"))).unwrap();
        self.0.mdev_type(&vf, "nvidia-593", "NVIDIA A10-4Q", 1);
        self.0.mdev_parent(&format!("pci0000:00/{bdf}"), bdf);
        fs::write(pf.join("sriov_numvfs"), format!("{}\n", n + 1)).unwrap();
        vf
    }

    fn remove_vf(&self, n: u32, bdf: &str) {
        let pf = self.root().join("sys/devices/pci0000:00/0000:41:00.0");
        fs::remove_file(pf.join(format!("virtfn{n}"))).unwrap();
        fs::remove_file(self.root().join("sys/class/mdev_bus").join(bdf)).unwrap();
        fs::remove_file(self.root().join("sys/bus/pci/devices").join(bdf)).unwrap();
        fs::remove_dir_all(self.root().join("sys/devices/pci0000:00").join(bdf)).unwrap();
        fs::write(pf.join("sriov_numvfs"), format!("{n}\n")).unwrap();
    }

    /// An A10-4Q mdev on a VF, in its own group, with its node.
    fn add_mdev(&self, vf: &str, uuid: &str, group: u32) {
        self.0
            .mdev(&format!("pci0000:00/{vf}"), uuid, "nvidia-593", Some(group));
        self.0.vfio_node(group);
    }

    fn remove_mdev(&self, vf: &str, uuid: &str, group: u32) {
        fs::remove_file(self.root().join("sys/bus/mdev/devices").join(uuid)).unwrap();
        fs::remove_dir_all(
            self.root()
                .join("sys/devices/pci0000:00")
                .join(vf)
                .join(uuid),
        )
        .unwrap();
        fs::remove_file(self.root().join(format!("dev/vfio/{group}"))).unwrap();
    }
}

/// A PF with SR-IOV (no VFs yet) and a second GPU, on nvidia.
fn sriov_node() -> Tree {
    let t = Tree::new();
    let pf = t.device(
        "pci0000:00",
        "0000:41:00.0",
        ("0x10de", "0x2236", "0x030200"),
        Some("nvidia"),
        30,
    );
    fs::write(pf.join("sriov_totalvfs"), "32\n").unwrap();
    fs::write(pf.join("sriov_numvfs"), "0\n").unwrap();
    t.device(
        "pci0000:00",
        "0000:61:00.0",
        ("0x10de", "0x2236", "0x030200"),
        Some("nvidia"),
        31,
    );
    t
}

#[test]
fn refreshing_what_an_event_names_matches_a_full_read() {
    for opts in [ReadOptions::default(), light()] {
        let t = sriov_node();
        let mut f = Follower::new(&t, opts);

        // A GPU moves to vfio-pci and its group node appears (one `bind` event).
        t.set_driver("0000:61:00.0", Some("vfio-pci"));
        fs::write(t.root().join("dev/vfio/31"), "").unwrap();
        f.pci("0000:61:00.0").matches("bind");

        // VFs enabled: the PF's event (sriov_numvfs) brings both.
        t.add_vf(0, "0000:41:00.4", 40);
        t.add_vf(1, "0000:41:00.5", 41);
        f.pci("0000:41:00.0").matches("VFs enabled, PF event");

        // One more VF, announced by its own `add` only: the PF learns of it too.
        t.add_vf(2, "0000:41:00.6", 42);
        f.pci("0000:41:00.6").matches("VF added, VF event");

        // mdevs: created and removed, each announced by an mdev event.
        t.add_mdev("0000:41:00.4", UUID, 120);
        f.mdev(UUID).matches("mdev created");
        t.remove_mdev("0000:41:00.4", UUID, 120);
        f.mdev(UUID).matches("mdev removed");

        // An mdev created, but only its parent named (a `change` of the VF).
        t.add_mdev("0000:41:00.5", UUID, 121);
        f.pci("0000:41:00.5").matches("mdev created, parent event");

        // A VF goes away with its mdev, announced by the VF's `remove`.
        t.remove_mdev("0000:41:00.5", UUID, 121);
        t.remove_vf(1, "0000:41:00.5");
        f.pci("0000:41:00.5").matches("VF removed");

        // A group node goes (the only change: inotify on /dev/vfio).
        fs::remove_file(t.root().join("dev/vfio/31")).unwrap();
        f.group_node(31).matches("group node removed");
        fs::write(t.root().join("dev/vfio/31"), "").unwrap();
        f.group_node(31).matches("group node back");

        // The GPU is unplugged: gone with its VFs and their mdevs.
        t.add_mdev("0000:41:00.4", UUID, 120);
        f.mdev(UUID);
        for (n, vf) in [(0, "0000:41:00.4"), (2, "0000:41:00.6")] {
            t.remove_vf(n, vf);
        }
        fs::remove_dir_all(t.root().join("sys/devices/pci0000:00/0000:41:00.0")).unwrap();
        fs::remove_file(t.root().join("sys/bus/pci/devices/0000:41:00.0")).unwrap();
        fs::remove_file(t.root().join("sys/bus/mdev/devices").join(UUID)).unwrap();
        fs::remove_file(t.root().join("dev/vfio/120")).unwrap();
        f.pci("0000:41:00.0").matches("GPU unplugged");
        assert!(f.inv.mdevs.is_empty() && f.inv.devices.len() == 1);

        // And hot-plugged back, on its own.
        t.device(
            "pci0000:00",
            "0000:41:00.0",
            ("0x10de", "0x2236", "0x030200"),
            Some("nvidia"),
            30,
        );
        f.pci("0000:41:00.0").matches("GPU hot-plugged");

        // A function whose files turn to garbage is reported, the rest kept.
        fs::write(
            t.root().join("sys/devices/pci0000:00/0000:61:00.0/vendor"),
            "garbage\n",
        )
        .unwrap();
        f.pci("0000:61:00.0").matches("unreadable");
        assert_eq!(f.inv.unreadable.len(), 1, "{:?}", f.inv.unreadable);
        assert_eq!(f.inv.unreadable_in_group[&31], [a("0000:61:00.0")]);
        fs::write(
            t.root().join("sys/devices/pci0000:00/0000:61:00.0/vendor"),
            "0x10de\n",
        )
        .unwrap();
        f.pci("0000:61:00.0").matches("readable again");
    }
}

#[test]
fn a_refresh_reads_only_what_it_names() {
    let t = sriov_node();
    let mut f = Follower::new(&t, light());
    // Two changes, one event: the other GPU's driver change is not seen until its own event.
    t.set_driver("0000:41:00.0", Some("vfio-pci"));
    t.set_driver("0000:61:00.0", None);
    f.pci("0000:41:00.0");
    let driver = |f: &Follower, bdf: &str| f.inv.device(&a(bdf)).unwrap().driver.clone();
    assert_eq!(driver(&f, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(driver(&f, "0000:61:00.0").as_deref(), Some("nvidia"));
    // A group node is checked, no device read.
    fs::write(t.root().join("dev/vfio/30"), "").unwrap();
    f.group_node(30);
    assert!(f.inv.vfio_nodes.contains(&30));
    assert_eq!(driver(&f, "0000:61:00.0").as_deref(), Some("nvidia"));
    f.pci("0000:61:00.0").matches("both events seen");
}

/// What sandbox-dp's on-demand pool reads before it places a vGPU: one GPU refreshed into an
/// empty inventory. It must see that GPU's vGPU capacity as a full read does, and nothing else.
#[test]
fn one_gpu_read_alone_has_the_capacity_a_full_read_gives_it() {
    let opts = ReadOptions {
        mdev_types: true,
        vf_identity: false,
    };
    let t = sriov_node();
    t.add_vf(0, "0000:41:00.4", 40);
    t.add_vf(1, "0000:41:00.5", 41);
    t.add_vf(2, "0000:41:00.6", 42);
    t.add_mdev("0000:41:00.5", UUID, 121);
    let alone = |bdf: &str| {
        let mut inv = Inventory::default();
        inv.refresh_pci(&t.paths(), a(bdf), &opts);
        inv
    };
    let full = Inventory::read_with(&t.paths(), &opts).unwrap();
    for gpu in ["0000:41:00.0", "0000:61:00.0"] {
        let inv = alone(gpu);
        let cap = common::vgpu::capacity(&inv, &a(gpu));
        assert_eq!(cap, common::vgpu::capacity(&full, &a(gpu)), "{gpu}");
        // The group nodes of its groups too: a placement answers with one.
        for d in inv.devices.values() {
            let g = d.iommu_group.unwrap();
            assert_eq!(
                inv.vfio_nodes.contains(&g),
                full.vfio_nodes.contains(&g),
                "{gpu}: group {g}"
            );
        }
    }
    let inv = alone("0000:41:00.0");
    let cap = common::vgpu::capacity(&inv, &a("0000:41:00.0"));
    assert_eq!(cap.mode, common::vgpu::Mode::MdevVf);
    assert_eq!(cap.existing.len(), 1, "{cap:?}");
    assert_eq!(
        cap.types[0].parents,
        ["0000:41:00.4", "0000:41:00.6"],
        "the VFs without an mdev offer it"
    );
    assert_eq!(inv.mdevs.keys().collect::<Vec<_>>(), [UUID]);
    assert!(
        inv.device(&a("0000:61:00.0")).is_none(),
        "the other GPU is not read"
    );
    assert_eq!(inv.devices.len(), 4);
}
