//! Discovery from hand-built inventories.

use super::*;
use common::{MdevDevice, NvidiaVgpu};

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn func(bdf: &str, vendor: u16, device: u16, class: u32, driver: &str, group: u32) -> PciDevice {
    PciDevice {
        driver: Some(driver.to_string()),
        iommu_group: Some(group),
        numa_node: Some(1),
        bridges: vec![
            addr("0000:12:00.0"),
            addr("0000:11:00.0"),
            addr("0000:10:01.0"),
        ],
        ..PciDevice::new(addr(bdf), vendor, device, class)
    }
}

fn inventory(devs: Vec<PciDevice>, mdevs: Vec<MdevDevice>, nodes: &[u32]) -> Inventory {
    Inventory {
        devices: devs.into_iter().map(|d| (d.address, d)).collect(),
        mdevs: mdevs.into_iter().map(|m| (m.uuid.clone(), m)).collect(),
        vfio_nodes: nodes.iter().copied().collect(),
        ..Default::default()
    }
}

fn cfg(vendor: Option<u16>) -> DiscoverConfig {
    DiscoverConfig {
        vendor,
        pci_ids: PciIds::embedded(),
        aliases: BTreeMap::new(),
        pool: None,
    }
}

fn mdev(uuid: &str, parent: &str, name: Option<&str>, group: u32) -> MdevDevice {
    MdevDevice {
        uuid: uuid.into(),
        type_id: "nvidia-593".into(),
        type_name: name.map(str::to_string),
        parent: parent.into(),
        parent_pci: parent.parse().ok(),
        iommu_group: Some(group),
        driver: Some("vfio_mdev".into()),
        vfio_cdev: None,
    }
}

#[test]
fn a_name_two_kinds_map_to_keeps_the_first_kind_and_reports_the_other() {
    let gpu = func("0000:13:00.0", 0x10de, 0x2236, 0x030200, "vfio-pci", 1);
    let mut vf = func("0000:14:00.4", 0x10de, 0x2236, 0x030200, "nvidia", 2);
    vf.physfn = Some(addr("0000:14:00.0"));
    let inv = inventory(
        vec![gpu, vf],
        vec![mdev("u1", "0000:14:00.4", Some("NVIDIA A10-4Q"), 50)],
        &[1, 50],
    );
    let mut c = cfg(Some(0x10de));
    c.aliases
        .insert("nvidia.com/NVIDIA_A10-4Q".into(), "GA102GL_A10".into());
    let snap = discover(&inv, &c);
    let r = &snap.resources["nvidia.com/GA102GL_A10"];
    assert_eq!(r.kind, Kind::Passthrough);
    assert_eq!(r.devices.keys().collect::<Vec<_>>(), ["0000:13:00.0"]);
    assert_eq!(snap.problems.len(), 1, "{:?}", snap.problems);
    assert!(
        snap.problems[0].contains("the Mdev devices are not advertised"),
        "{:?}",
        snap.problems
    );
}

#[test]
fn mdevs_on_vfs_belong_to_the_pf_and_follow_the_vendor() {
    let pf = func("0000:13:00.0", 0x10de, 0x2236, 0x030200, "nvidia", 1);
    let mut vf = func("0000:13:00.4", 0x10de, 0x2236, 0x030200, "nvidia", 2);
    vf.physfn = Some(pf.address);
    vf.numa_node = None;
    let inv = inventory(
        vec![pf, vf],
        vec![
            mdev("u1", "0000:13:00.4", Some("NVIDIA A10-4Q"), 50),
            mdev("u2", "mtty", None, 51),
        ],
        &[50],
    );
    let snap = discover(&inv, &cfg(Some(0x10de)));
    let names: Vec<&String> = snap.resources.keys().collect();
    assert_eq!(names, ["nvidia.com/NVIDIA_A10-4Q"]);
    let r = &snap.resources["nvidia.com/NVIDIA_A10-4Q"];
    assert_eq!(r.kind, Kind::Mdev);
    let d = &r.devices["u1"];
    assert!(d.healthy);
    assert_eq!(d.gpu.as_deref(), Some("0000:13:00.0"));
    assert_eq!(
        d.numa_node,
        Some(1),
        "NUMA node of the PF when the VF has none"
    );
    assert_eq!(d.switch.as_deref(), Some("0000:11:00.0"));

    // `any`: the mtty mdev too, named from its type id, Unhealthy without its node.
    let snap = discover(&inv, &cfg(None));
    let r = &snap.resources["nvidia.com/nvidia-593"];
    assert!(!r.devices["u2"].healthy);
}

#[test]
fn vendor_vgpu_vfs_need_a_type_and_the_nvidia_driver() {
    let pf = func("0000:13:00.0", 0x10de, 0x2330, 0x030200, "nvidia", 1);
    let mut set = func("0000:13:00.4", 0x10de, 0x2330, 0x030200, "nvidia", 2);
    set.physfn = Some(pf.address);
    set.nvidia_vgpu = Some(NvidiaVgpu {
        creatable: Vec::new(),
        current: 1000,
        current_name: Some("NVIDIA H100XM-4C".into()),
    });
    let mut free = func("0000:13:00.5", 0x10de, 0x2330, 0x030200, "nvidia", 3);
    free.physfn = Some(pf.address);
    free.nvidia_vgpu = Some(NvidiaVgpu {
        creatable: Vec::new(),
        current: 0,
        current_name: None,
    });
    let inv = inventory(vec![pf, set, free], Vec::new(), &[2]);
    let snap = discover(&inv, &cfg(Some(0x10de)));
    let r = &snap.resources["nvidia.com/NVIDIA_H100XM-4C"];
    assert_eq!(r.kind, Kind::SriovVgpu);
    assert_eq!(r.devices.keys().collect::<Vec<_>>(), ["0000:13:00.4"]);
    assert_eq!(r.env_var(), "PCI_RESOURCE_NVIDIA_COM_NVIDIA_H100XM-4C");
    assert_eq!(r.pci_selectors.iter().collect::<Vec<_>>(), ["10DE:2330"]);
    assert_eq!(snap.resources.len(), 1);
}

/// A vendor-path GPU with `n` VFs, VF `i` (`0000:13:00.<i+4>`, group `10+i`) holding type
/// `types[i]` (0: none; 1000 is H100XM-4C, 1001 H100XM-8C, 1002 an unnamed type); every
/// group node present.
pub(crate) fn h100(types: &[u32]) -> Inventory {
    let pf = func("0000:13:00.0", 0x10de, 0x2330, 0x030200, "nvidia", 1);
    let mut devs = vec![pf];
    for (i, t) in types.iter().enumerate() {
        let mut vf = func(
            &format!("0000:13:00.{}", i + 4),
            0x10de,
            0x2330,
            0x030200,
            "nvidia",
            10 + i as u32,
        );
        vf.physfn = Some(addr("0000:13:00.0"));
        vf.nvidia_vgpu = Some(NvidiaVgpu {
            creatable: Vec::new(),
            current: *t,
            current_name: match t {
                1000 => Some("NVIDIA H100XM-4C".into()),
                1001 => Some("NVIDIA H100XM-8C".into()),
                _ => None,
            },
        });
        devs.push(vf);
    }
    let groups: Vec<u32> = (0..types.len() as u32).map(|i| 10 + i).collect();
    inventory(devs, Vec::new(), &groups)
}

/// The resources after `patches`, as the manager keeps them (a resource emptied stays).
fn patched(
    mut resources: BTreeMap<String, Resource>,
    patches: &[DevicePatch],
) -> BTreeMap<String, Resource> {
    for p in patches {
        let r = resources.get_mut(&p.resource).expect("a known resource");
        match &p.info {
            Some(d) => r.devices.insert(p.id.clone(), d.clone()),
            None => r.devices.remove(&p.id),
        };
    }
    resources.retain(|_, r| !r.devices.is_empty());
    resources
}

#[test]
fn a_vf_read_again_patches_what_a_full_discovery_would_give() {
    let c = cfg(Some(0x10de));
    let vf = |i: u8| -> BTreeSet<PciAddress> { [addr(&format!("0000:13:00.{i}"))].into() };
    // (before, after, the VFs read again): removal, a removal that empties a resource,
    // restore, a type change between two existing resources, a VF without a vGPU, and two
    // VFs at once.
    let cases: [(&[u32], &[u32], BTreeSet<PciAddress>); 6] = [
        (&[1000, 1000, 1001], &[0, 1000, 1001], vf(4)),
        (&[1000, 1001], &[0, 1001], vf(4)),
        (&[0, 1000, 1001], &[1000, 1000, 1001], vf(4)),
        (&[1000, 1000, 1001, 1001], &[1001, 1000, 1001, 1001], vf(4)),
        (&[0, 1000], &[0, 1000], vf(4)),
        (
            &[1000, 1000, 1000],
            &[0, 0, 1000],
            vf(4).union(&vf(5)).copied().collect(),
        ),
    ];
    for (before, after, changed) in cases {
        let old = discover(&h100(before), &c).resources;
        let inv = h100(after);
        let current: BTreeMap<String, &Resource> =
            old.iter().map(|(n, r)| (n.clone(), r)).collect();
        let patches = vf_devices(&inv, &c, &current, &changed)
            .unwrap_or_else(|| panic!("{before:?} -> {after:?} is a VF change"));
        assert_eq!(
            patched(old.clone(), &patches),
            discover(&inv, &c).resources,
            "{before:?} -> {after:?}"
        );
    }
}

#[test]
fn what_a_vf_alone_cannot_tell_asks_for_the_whole_node() {
    let c = cfg(Some(0x10de));
    let vf4: BTreeSet<PciAddress> = [addr("0000:13:00.4")].into();
    let none = |before: &[u32], after: Inventory, changed: &BTreeSet<PciAddress>| {
        let old = discover(&h100(before), &c).resources;
        let current: BTreeMap<String, &Resource> =
            old.iter().map(|(n, r)| (n.clone(), r)).collect();
        vf_devices(&after, &c, &current, changed).is_none()
    };
    // A type no resource has yet: a resource would be made.
    assert!(none(&[0, 1000], h100(&[1001, 1000]), &vf4));
    // A type without a name.
    assert!(none(&[0, 1000], h100(&[1002, 1000]), &vf4));
    // A VF bound to vfio-pci (a passthrough device), and one that is an mdev parent.
    let mut inv = h100(&[0, 1000]);
    if let Some(d) = inv.devices.get_mut(&addr("0000:13:00.4")) {
        d.driver = Some("vfio-pci".into());
    }
    assert!(none(&[0, 1000], inv, &vf4));
    let mut inv = h100(&[0, 1000]);
    if let Some(d) = inv.devices.get_mut(&addr("0000:13:00.4")) {
        d.mdev_parent = true;
    }
    assert!(none(&[0, 1000], inv, &vf4));
    // The PF, and a function that is gone.
    assert!(none(&[1000], h100(&[1000]), &[addr("0000:13:00.0")].into()));
    assert!(none(&[1000], h100(&[1000]), &[addr("0000:13:00.7")].into()));
    // A pool.
    let old = discover(&h100(&[1000]), &c).resources;
    let current: BTreeMap<String, &Resource> = old.iter().map(|(n, r)| (n.clone(), r)).collect();
    let pooled = DiscoverConfig {
        pool: Some(std::sync::Arc::new(
            crate::ondemand::Pool::new(
                common::HostPaths::new("/nonexistent-root"),
                crate::ondemand::Selector::All,
                Some(0x10de),
                std::time::Duration::from_secs(1),
                Default::default(),
            )
            .unwrap_or_else(|e| panic!("{e:#}")),
        )),
        ..cfg(Some(0x10de))
    };
    assert!(vf_devices(&h100(&[1000]), &pooled, &current, &vf4).is_none());
}

#[test]
fn a_re_read_looks_no_name_up_again() {
    use common::IdsSource;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// pci.ids text that counts its reads.
    struct Counting(&'static [u8], Arc<AtomicUsize>);
    impl IdsSource for Counting {
        fn size(&self) -> u64 {
            self.0.len() as u64
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.read_at(offset, buf)
        }
    }
    let text = "10de  NVIDIA Corporation\n\t2236  GA102GL [A10]\n\t\t10de 1482  A10\n\
                8086  Intel Corporation\n\t1572  Ethernet Controller X710\n";
    let gpus = [
        func("0000:13:00.0", 0x10de, 0x2236, 0x030200, "vfio-pci", 1),
        func("0000:14:00.0", 0x10de, 0x2236, 0x030200, "vfio-pci", 2),
    ];
    // The reads of a fresh pci.ids naming the first `n` GPUs, and its configuration.
    let named = |n: usize| {
        let reads = Arc::new(AtomicUsize::new(0));
        let ids = PciIds::from_source(Box::new(Counting(text.as_bytes(), reads.clone())), "t");
        assert_eq!(reads.load(Ordering::SeqCst), 0, "nothing is read up front");
        let inv = inventory(gpus[..n].to_vec(), Vec::new(), &[1, 2][..n]);
        let c = DiscoverConfig {
            pci_ids: ids,
            ..cfg(Some(0x10de))
        };
        let snap = discover(&inv, &c);
        (reads, c, inv, snap)
    };
    let (one, ..) = named(1);
    let (reads, c, inv, first) = named(2);
    assert_eq!(
        first.resources.keys().collect::<Vec<_>>(),
        ["nvidia.com/GA102GL_A10"]
    );
    // Two GPUs of one model: one lookup, the reads of one GPU's.
    let looked_up = reads.load(Ordering::SeqCst);
    assert!(looked_up > 0);
    assert_eq!(looked_up, one.load(Ordering::SeqCst));
    // Each re-read (the daemon clones its configuration for it) reads no pci.ids again.
    for _ in 0..5 {
        assert_eq!(discover(&inv, &c.clone()), first);
    }
    assert_eq!(reads.load(Ordering::SeqCst), looked_up);
}

#[test]
fn names_over_63_chars_are_refused() {
    let long = format!("nvidia.com/{}", "A".repeat(64));
    assert!(name_problem(&long).is_some_and(|p| p.contains("64 characters")));
    assert_eq!(
        name_problem(&format!("nvidia.com/{}", "A".repeat(63))),
        None
    );
    assert_eq!(name_problem("nvidia.com/NVIDIA_A10-4Q"), None);
    assert!(name_problem("nvidia.com/A B").is_some());
}

#[test]
fn aliases_parse() {
    assert_eq!(
        parse_alias("10DE:2236=nvidia.com/A10"),
        Ok(("10de:2236".into(), "nvidia.com/A10".into()))
    );
    assert_eq!(
        parse_alias("nvidia.com/X=Y"),
        Ok(("nvidia.com/X".into(), "Y".into()))
    );
    assert!(parse_alias("nope").is_err());
    assert!(parse_alias("=x").is_err());
}
