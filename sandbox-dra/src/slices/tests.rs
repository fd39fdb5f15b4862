//! Slices from hand-built inventories.

use super::*;
use common::vfio::{AliasTable, Selector, select};

const NVIDIA: u16 = 0x10de;

fn dev(addr: &str, device: u16, class: u32, group: u32, driver: &str) -> PciDevice {
    PciDevice {
        driver: Some(driver.into()),
        iommu_group: Some(group),
        numa_node: Some(1),
        modalias: Some(format!(
            "pci:v000010DEd0000{device:04X}sv000010DEsd00001482bc{:02X}sc{:02X}i00",
            class >> 16,
            (class >> 8) & 0xff
        )),
        ..PciDevice::new(addr.parse().unwrap(), NVIDIA, device, class)
    }
}

fn inv(devs: Vec<PciDevice>, vfio_nodes: &[u32]) -> Inventory {
    Inventory {
        devices: devs.into_iter().map(|d| (d.address, d)).collect(),
        vfio_nodes: vfio_nodes.iter().copied().collect(),
        ..Default::default()
    }
}

fn node_devices(inv: &Inventory, aliases: &str) -> NodeDevices {
    let sel = select(inv, &Selector::default(), None, &AliasTable::parse(aliases));
    devices(inv, &sel, &PciIds::embedded())
}

fn attr<'a>(d: &'a Device, key: &str) -> Option<&'a DeviceAttribute> {
    d.attributes.as_ref().unwrap().get(key)
}

fn s<'a>(d: &'a Device, key: &str) -> Option<&'a str> {
    attr(d, key).and_then(|a| a.string.as_deref())
}

fn i(d: &Device, key: &str) -> Option<i64> {
    attr(d, key).and_then(|a| a.int)
}

#[test]
fn an_a10_is_described_for_selection() {
    let inv = inv(
        vec![dev("0000:41:00.0", 0x2236, 0x030200, 21, "nvidia")],
        &[],
    );
    let nd = node_devices(&inv, "");
    assert!(nd.left_out.is_empty(), "{:?}", nd.left_out);
    let [d] = &nd.devices[..] else {
        panic!("{:?}", nd.devices)
    };
    assert_eq!(d.name, "gpu-0000-41-00-0");
    assert_eq!(s(d, "mode"), Some("passthrough"));
    assert_eq!(s(d, "vendorID"), Some("10de"));
    assert_eq!(s(d, "deviceID"), Some("2236"));
    assert_eq!(s(d, "productName"), Some("GA102GL [A10]"));
    assert_eq!(s(d, PCI_BUS_ID), Some("0000:41:00.0"));
    assert_eq!(i(d, "numaNode"), Some(1));
    assert_eq!(i(d, "iommuGroup"), Some(21));
    assert_eq!(i(d, "functions"), Some(1));
    assert_eq!(attr(d, "companions"), None);
    assert_eq!(s(d, "vfioDriver"), Some("vfio-pci"));
    let cap = d.capacity.as_ref().unwrap();
    assert_eq!(cap["memory"].value, Quantity("24Gi".into()));
    // Every attribute name is one the API accepts: a C identifier of at most 32
    // characters, optionally behind a domain.
    for k in d.attributes.as_ref().unwrap().keys() {
        let id = k.rsplit('/').next().unwrap();
        assert!(id.len() <= 32 && !id.starts_with(|c: char| c.is_ascii_digit()));
        assert!(
            id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{k}"
        );
    }
}

/// A type and the UUIDs of its instances.
fn mdev_type(
    id: &str,
    name: &str,
    available: u32,
    devices: &[&str],
) -> (common::MdevType, Vec<String>) {
    let t = common::MdevType {
        id: id.into(),
        name: Some(name.into()),
        available_instances: available,
        description: None,
    };
    (t, devices.iter().map(|d| d.to_string()).collect())
}

fn mdev_node(parent: &str, types: Vec<(common::MdevType, Vec<String>)>) -> Inventory {
    let mut inv = Inventory::default();
    for (t, uuids) in &types {
        for uuid in uuids {
            inv.mdevs.insert(
                uuid.clone(),
                common::MdevDevice {
                    uuid: uuid.clone(),
                    type_id: t.id.clone(),
                    type_name: t.name.clone(),
                    parent: parent.into(),
                    parent_pci: None,
                    iommu_group: Some(7),
                    driver: Some("vfio_mdev".into()),
                    vfio_cdev: None,
                },
            );
        }
    }
    inv.mdev_parents.insert(
        parent.into(),
        common::MdevParent {
            name: parent.into(),
            pci: None,
            types: types.into_iter().map(|(t, _)| t).collect(),
        },
    );
    inv
}

#[test]
fn mtty_publishes_its_ports_as_one_counter_whatever_is_in_use() {
    // 24 ports, one dual-port mdev made: 22 free (mtty-1 shows 22, mtty-2 11).
    let inv = mdev_node(
        "mtty",
        vec![
            mdev_type("mtty-1", "Single port serial", 22, &[]),
            mdev_type("mtty-2", "Dual port serial", 11, &["u-1"]),
        ],
    );
    let (set, devices) = mdev_parent_devices(&inv, "mtty").unwrap();
    let set = set.unwrap();
    assert_eq!(set.name, "mdev-mtty");
    assert_eq!(set.counters["ports"].value, Quantity("24".into()));
    let of = |t: &str| devices.iter().filter(|d| s(d, "typeID") == Some(t)).count();
    assert_eq!((of("mtty-1"), of("mtty-2"), devices.len()), (24, 12, 36));
    let d = devices
        .iter()
        .find(|d| d.name == "mdev-mtty-mtty-2-11")
        .unwrap();
    assert_eq!(s(d, "mode"), Some(MODE_VGPU));
    assert_eq!(s(d, "vgpuType"), Some("Dual port serial"));
    assert_eq!(s(d, "mdevParent"), Some("mtty"));
    assert_eq!(i(d, "maxInstances"), Some(12));
    let c = &d.consumes_counters.as_ref().unwrap()[0];
    assert_eq!(c.counter_set, "mdev-mtty");
    assert_eq!(c.counters["ports"].value, Quantity("2".into()));
    assert_eq!(mdev_parent_devices(&inv, "mbochs"), None);
}

#[test]
fn another_mdev_parent_has_no_counters_and_its_types_own_counts() {
    let inv = mdev_node(
        "mbochs",
        vec![
            mdev_type("mbochs-1", "mbochs-64", 1, &["u-1"]),
            mdev_type("mbochs-2", "mbochs-128", 0, &[]),
            mdev_type("Odd Type", "odd", 3, &[]),
        ],
    );
    let (set, devices) = mdev_parent_devices(&inv, "mbochs").unwrap();
    assert_eq!(set, None);
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["mdev-mbochs-mbochs-1-0", "mdev-mbochs-mbochs-1-1"]);
    assert!(devices.iter().all(|d| d.consumes_counters.is_none()));
    assert_eq!(i(&devices[0], "maxInstances"), Some(2));
}

#[test]
fn the_audio_function_travels_with_its_gpu_and_unknown_models_have_no_capacity() {
    // A workstation GPU with its HDMI audio function in the same group, on the host's
    // drivers; the numa node unknown.
    let mut gpu = dev("0000:01:00.0", 0x2684, 0x030000, 1, "nvidia");
    gpu.numa_node = None;
    let audio = dev("0000:01:00.1", 0x22ba, 0x040300, 1, "snd_hda_intel");
    let nd = node_devices(&inv(vec![gpu, audio], &[]), "");
    let [d] = &nd.devices[..] else {
        panic!("{:?}", nd.devices)
    };
    assert_eq!(d.name, "gpu-0000-01-00-0");
    assert_eq!(s(d, "companions"), Some("0000:01:00.1"));
    assert_eq!(i(d, "functions"), Some(2));
    assert_eq!(i(d, "numaNode"), None);
    assert_eq!(
        d.capacity, None,
        "the RTX 4090's memory is not in the model table"
    );
}

#[test]
fn the_variant_driver_from_modules_alias_is_named() {
    let inv = inv(
        vec![dev("0000:09:00.0", 0x2342, 0x030200, 9, "nvidia")],
        &[],
    );
    let nd = node_devices(
        &inv,
        "alias vfio_pci:v000010DEd00002342sv*sd*bc03sc*i* nvgrace_gpu_vfio_pci\n",
    );
    assert_eq!(
        s(&nd.devices[0], "vfioDriver"),
        Some("nvgrace_gpu_vfio_pci")
    );
}

#[test]
fn two_gpus_in_one_group_are_one_device() {
    let inv = inv(
        vec![
            dev("0000:41:00.0", 0x2236, 0x030200, 5, "nvidia"),
            dev("0000:42:00.0", 0x2236, 0x030200, 5, "nvidia"),
        ],
        &[],
    );
    let nd = node_devices(&inv, "");
    let [d] = &nd.devices[..] else {
        panic!("{:?}", nd.devices)
    };
    assert_eq!(d.name, "gpu-0000-41-00-0");
    assert_eq!(s(d, "companions"), Some("0000:42:00.0"));
}

#[test]
fn refused_groups_and_unviable_groups_are_published_tainted_with_the_reason() {
    let mut nic = dev("0000:61:00.1", 0x1572, 0x020000, 37, "i40e");
    nic.vendor = 0x8086;
    let inv = inv(
        vec![
            dev("0000:41:00.0", 0x2236, 0x030200, 21, "vfio-pci"),
            dev("0000:61:00.0", 0x2236, 0x030200, 37, "nvidia"),
            nic,
            dev("0000:81:00.0", 0x2236, 0x030200, 50, "vfio-pci"),
        ],
        &[50],
    );
    let mut nd = node_devices(&inv, "");
    let names: Vec<&str> = nd.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        ["gpu-0000-41-00-0", "gpu-0000-61-00-0", "gpu-0000-81-00-0"]
    );
    taint(
        &mut nd.devices,
        "gpu.example.io",
        TaintEffect::NoSchedule,
        &nd.left_out,
        &BTreeSet::new(),
    );
    let taints: Vec<Option<(String, String, String)>> = nd
        .devices
        .iter()
        .map(|d| {
            d.taints.as_ref().map(|t| {
                (
                    t[0].key.clone(),
                    t[0].value.clone().unwrap_or_default(),
                    t[0].effect.clone(),
                )
            })
        })
        .collect();
    let t = |v: &str| {
        Some((
            "gpu.example.io/unusable".to_string(),
            v.to_string(),
            "NoSchedule".to_string(),
        ))
    };
    assert_eq!(
        taints,
        [t("no-vfio-group-node"), t("group-not-assignable"), None]
    );
    // The refused group's GPU says what it is, for an operator reading the slice.
    assert_eq!(s(&nd.devices[1], PCI_BUS_ID), Some("0000:61:00.0"));
    assert_eq!(s(&nd.devices[1], "mode"), Some("passthrough"));
    let [missing, foreign] = &nd.left_out[..] else {
        panic!("{:?}", nd.left_out)
    };
    assert_eq!(missing.address.to_string(), "0000:41:00.0");
    assert!(
        missing.reason.contains("/dev/vfio/21 is missing"),
        "{}",
        missing.reason
    );
    assert_eq!(foreign.address.to_string(), "0000:61:00.0");
    assert!(
        foreign.reason.contains("0000:61:00.1"),
        "{}",
        foreign.reason
    );
}

#[test]
fn a_pooled_gpu_whose_vfs_could_not_be_enabled_has_its_vgpu_devices_tainted() {
    let mut a10 = dev("0000:41:00.0", 0x2236, 0x030200, 21, "nvidia");
    a10.sriov_totalvfs = Some(32);
    let inv = inv(vec![a10], &[]);
    let sel = select(&inv, &Selector::default(), None, &AliasTable::parse(""));
    let gpu: PciAddress = "0000:41:00.0".parse().unwrap();
    let mut nd = devices_with_vgpus(
        &inv,
        &sel,
        &PciIds::embedded(),
        &BTreeSet::from([gpu]).into(),
    );
    taint(
        &mut nd.devices,
        "gpu.example.io",
        TaintEffect::NoExecute,
        &[],
        &BTreeSet::from([gpu]),
    );
    for d in &nd.devices {
        let v = d
            .taints
            .as_ref()
            .map(|t| (t[0].value.clone().unwrap_or_default(), t[0].effect.clone()));
        if d.name == "gpu-0000-41-00-0" {
            assert_eq!(v, None, "the whole GPU does not need VFs");
        } else {
            assert_eq!(
                v,
                Some(("vfs-not-enabled".to_string(), "NoExecute".to_string())),
                "{}",
                d.name
            );
        }
    }
}

#[test]
fn the_slice_is_the_nodes_pool_owned_by_its_node() {
    let pool = Pool {
        driver: "gpu.gpu-vm-node.io".into(),
        node_name: "node-a".into(),
        node_uid: Some("uid-1".into()),
        per_gpu: false,
        pinned: BTreeMap::new(),
    };
    let inv = inv(
        vec![dev("0000:41:00.0", 0x2236, 0x030200, 21, "nvidia")],
        &[],
    );
    let devs = node_devices(&inv, "").devices;
    let slice = pool.slice(devs.clone(), 3);
    assert_eq!(
        slice.metadata.name.as_deref(),
        Some("node-a-gpu.gpu-vm-node.io")
    );
    let owner = &slice.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
        ("Node", "node-a", "uid-1")
    );
    assert_eq!(slice.spec.driver, "gpu.gpu-vm-node.io");
    assert_eq!(slice.spec.node_name.as_deref(), Some("node-a"));
    assert_eq!(slice.spec.pool.name, "node-a");
    assert_eq!(slice.spec.pool.generation, 3);
    assert_eq!(slice.spec.pool.resource_slice_count, 1);
    assert_eq!(slice.spec.devices, Some(devs));

    let unknown = Pool {
        node_uid: None,
        ..pool
    };
    assert_eq!(unknown.slice(vec![], 1).metadata.owner_references, None);
}

#[test]
fn a_pooled_a10_publishes_only_the_listed_types() {
    let mut a10 = dev("0000:41:00.0", 0x2236, 0x030200, 21, "nvidia");
    a10.sriov_totalvfs = Some(32);
    let inv = inv(vec![a10], &[]);
    let sel = select(&inv, &Selector::default(), None, &AliasTable::parse(""));
    let pool = crate::vgpu::Pooled {
        gpus: ["0000:41:00.0".parse().unwrap()].into(),
        types: crate::vgpu_types::parse("A10-4Q,*-8Q,L40S-2Q").unwrap(),
    };
    let nd = devices_with_vgpus(&inv, &sel, &PciIds::embedded(), &pool);
    let mut types: Vec<&str> = nd.devices.iter().filter_map(|d| s(d, "vgpuType")).collect();
    types.dedup();
    assert_eq!(types, ["NVIDIA A10-4Q", "NVIDIA A10-8Q"]);
    // One shared device per type, and the whole GPU.
    assert_eq!(nd.devices.len(), 1 + 2);
    // The counter set and the whole GPU's consumption of it are those of every type.
    assert_eq!(nd.counters.len(), 1);
    assert_eq!(
        nd.counters[0].counters["memory"].value,
        Quantity("24Gi".into())
    );
}

#[test]
fn a_pooled_a10_has_a_counter_set_its_vgpus_and_its_whole_self_consume() {
    let mut a10 = dev("0000:41:00.0", 0x2236, 0x030200, 21, "nvidia");
    a10.sriov_totalvfs = Some(32);
    let inv = inv(vec![a10], &[]);
    let sel = select(&inv, &Selector::default(), None, &AliasTable::parse(""));
    let pool: BTreeSet<PciAddress> = ["0000:41:00.0".parse().unwrap()].into();
    let nd = devices_with_vgpus(&inv, &sel, &PciIds::embedded(), &pool.into());
    let [set] = &nd.counters[..] else {
        panic!("{:?}", nd.counters)
    };
    assert_eq!(set.name, "gpu-0000-41-00-0");
    assert_eq!(set.counters["memory"].value, Quantity("24Gi".into()));
    assert_eq!(set.counters["vfs"].value, Quantity("32".into()));
    // One shared device per type: Q and A in each size that divides 24 GiB, C from 4 GiB; B
    // (no size the table derives) not offered. Each holds as many of its type as fit, one per
    // allocation, and takes the whole counter set, as the whole GPU does.
    let of_type = |key: &str| {
        let found: Vec<&Device> = nd
            .devices
            .iter()
            .filter(|d| s(d, "vgpuType") == Some(key))
            .collect();
        assert_eq!(found.len(), 1, "{key}: {found:?}");
        found[0]
    };
    let vgpus = |d: &Device| {
        let cap = &d.capacity.as_ref().unwrap()[CAPACITY_VGPUS];
        let policy = cap.request_policy.as_ref().unwrap();
        assert_eq!(policy.default, Some(Quantity("1".into())));
        assert_eq!(policy.valid_values, Some(vec![Quantity("1".into())]));
        cap.value.0.parse::<u32>().unwrap()
    };
    assert_eq!(vgpus(of_type("NVIDIA A10-1Q")), 24);
    assert_eq!(vgpus(of_type("NVIDIA A10-3Q")), 8);
    assert_eq!(vgpus(of_type("NVIDIA A10-24A")), 1);
    assert_eq!(vgpus(of_type("NVIDIA A10-4C")), 6);
    assert_eq!(nd.devices.len(), 1 + 8 + 8 + 5);
    let whole = nd
        .devices
        .iter()
        .find(|d| d.name == "gpu-0000-41-00-0")
        .unwrap();
    assert_eq!(
        whole.consumes_counters.as_ref().unwrap()[0].counters,
        set.counters
    );
    assert_eq!(whole.allow_multiple_allocations, None);
    let q4 = of_type("NVIDIA A10-4Q");
    assert_eq!(q4.name, "vgpu-0000-41-00-0-a10-4q");
    assert_eq!(q4.allow_multiple_allocations, Some(true));
    assert_eq!(q4.consumes_counters, whole.consumes_counters);
    assert_eq!(vgpus(q4), 6);
    assert_eq!(i(q4, "maxInstances"), Some(6));
    assert_eq!(i(q4, "framebufferMiB"), Some(4096));
    assert_eq!(s(q4, "series"), Some("Q"));
    assert_eq!(s(q4, "parentGPU"), Some("0000:41:00.0"));
    for d in nd.devices.iter().filter(|d| d.name != whole.name) {
        assert_eq!(
            d.capacity.as_ref().map(BTreeMap::len),
            Some(1),
            "{}",
            d.name
        );
    }
    // Not pooled: passthrough only, consuming nothing.
    let plain = devices(&inv, &sel, &PciIds::embedded());
    assert!(plain.counters.is_empty());
    assert_eq!(plain.devices.len(), 1);
    assert_eq!(plain.devices[0].consumes_counters, None);

    // The slices: devices 64 at most each, counter sets 8 at most each and apart, one
    // generation and count.
    let pool = Pool {
        driver: "gpu.gpu-vm-node.io".into(),
        node_name: "n".into(),
        node_uid: None,
        per_gpu: false,
        pinned: BTreeMap::new(),
    };
    let sets: Vec<CounterSet> = (0..20)
        .map(|k| CounterSet {
            name: format!("s{k}"),
            ..set.clone()
        })
        .collect();
    // 66 devices of counter sets that are no GPU's (an mdev parent's): the node's pool, two
    // device slices.
    let three: Vec<Device> = (0..3)
        .flat_map(|k| {
            nd.devices.iter().map(move |d| {
                let mut d = Device {
                    name: format!("{}-{k}", d.name),
                    ..d.clone()
                };
                for c in d.consumes_counters.iter_mut().flatten() {
                    c.counter_set = "s0".into();
                }
                d
            })
        })
        .collect();
    let slices = pool.slices(three, sets, Vec::new(), 4);
    let names: Vec<&str> = slices
        .iter()
        .map(|s| s.metadata.name.as_deref().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "n-gpu.gpu-vm-node.io",
            "n-gpu.gpu-vm-node.io-1",
            "n-gpu.gpu-vm-node.io-counters",
            "n-gpu.gpu-vm-node.io-counters-1",
            "n-gpu.gpu-vm-node.io-counters-2"
        ]
    );
    for sl in &slices {
        assert_eq!(sl.spec.pool.resource_slice_count, 5);
        // Kubernetes 1.35 and later: at most 8 counter sets a slice, 2 consumptions a device.
        assert!(sl.spec.shared_counters.as_ref().map_or(0, Vec::len) <= MAX_COUNTER_SETS);
        assert!(
            sl.spec.devices.iter().flatten().all(|d| d
                .consumes_counters
                .as_ref()
                .map_or(0, Vec::len)
                <= 2)
        );
        assert_eq!(sl.spec.pool.generation, 4);
        assert!(sl.spec.devices.as_ref().map_or(0, Vec::len) <= MAX_DEVICES_WITH_COUNTERS);
        let counters: usize = sl
            .spec
            .shared_counters
            .iter()
            .flatten()
            .map(|c| c.counters.len())
            .sum();
        assert!(counters <= MAX_COUNTERS);
        assert!(sl.spec.devices.is_none() || sl.spec.shared_counters.is_none());
    }
}

#[test]
fn each_pooled_gpu_is_a_pool_of_its_own_and_the_rest_the_nodes() {
    let mut a = dev("0000:41:00.0", 0x2236, 0x030200, 21, "nvidia");
    a.sriov_totalvfs = Some(32);
    let mut b = dev("0000:61:00.0", 0x2236, 0x030200, 22, "nvidia");
    b.sriov_totalvfs = Some(32);
    let plain = dev("0000:81:00.0", 0x2236, 0x030200, 23, "nvidia");
    let inv = inv(vec![a, b, plain], &[]);
    let sel = select(&inv, &Selector::default(), None, &AliasTable::parse(""));
    let pooled = crate::vgpu::Pooled {
        gpus: [
            "0000:41:00.0".parse().unwrap(),
            "0000:61:00.0".parse().unwrap(),
        ]
        .into(),
        types: crate::vgpu_types::parse("A10-4Q,A10-8Q").unwrap(),
    };
    let nd = devices_with_vgpus(&inv, &sel, &PciIds::embedded(), &pooled);
    let pool = Pool {
        driver: "gpu.gpu-vm-node.io".into(),
        node_name: "node-a".into(),
        node_uid: None,
        per_gpu: true,
        pinned: BTreeMap::new(),
    };
    // A device a prepared claim holds, in the pool its allocation names.
    let held = vec![(
        "node-a/gpu-0000-a1-00-0".to_string(),
        Device {
            name: "gpu-0000-a1-00-0".into(),
            ..Default::default()
        },
    )];
    let slices = pool.slices(nd.devices, nd.counters, held, 2);
    /// A slice as (pool, name, resourceSliceCount, devices, counter sets).
    type Layout<'a> = (&'a str, &'a str, i64, Vec<&'a str>, Vec<&'a str>);
    let layout: Vec<Layout> = slices
        .iter()
        .map(|s| {
            (
                s.spec.pool.name.as_str(),
                s.metadata.name.as_deref().unwrap(),
                s.spec.pool.resource_slice_count,
                s.spec
                    .devices
                    .iter()
                    .flatten()
                    .map(|d| d.name.as_str())
                    .collect(),
                s.spec
                    .shared_counters
                    .iter()
                    .flatten()
                    .map(|c| c.name.as_str())
                    .collect(),
            )
        })
        .collect();
    let gpu = |n: &str| {
        vec![
            format!("gpu-0000-{n}-00-0"),
            format!("vgpu-0000-{n}-00-0-a10-4q"),
            format!("vgpu-0000-{n}-00-0-a10-8q"),
        ]
    };
    let (g41, g61) = (gpu("41"), gpu("61"));
    fn as_str(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    assert_eq!(
        layout,
        [
            (
                "node-a",
                "node-a-gpu.gpu-vm-node.io",
                1,
                vec!["gpu-0000-81-00-0"],
                vec![]
            ),
            (
                "node-a/gpu-0000-41-00-0",
                "node-a-gpu.gpu-vm-node.io-gpu-0000-41-00-0",
                2,
                as_str(&g41),
                vec![]
            ),
            (
                "node-a/gpu-0000-41-00-0",
                "node-a-gpu.gpu-vm-node.io-gpu-0000-41-00-0-counters",
                2,
                vec![],
                vec!["gpu-0000-41-00-0"]
            ),
            (
                "node-a/gpu-0000-61-00-0",
                "node-a-gpu.gpu-vm-node.io-gpu-0000-61-00-0",
                2,
                as_str(&g61),
                vec![]
            ),
            (
                "node-a/gpu-0000-61-00-0",
                "node-a-gpu.gpu-vm-node.io-gpu-0000-61-00-0-counters",
                2,
                vec![],
                vec!["gpu-0000-61-00-0"]
            ),
            (
                "node-a/gpu-0000-a1-00-0",
                "node-a-gpu.gpu-vm-node.io-gpu-0000-a1-00-0",
                1,
                vec!["gpu-0000-a1-00-0"],
                vec![]
            ),
        ]
    );
    assert!(
        slices
            .iter()
            .all(|s| s.spec.pool.generation == 2 && s.spec.node_name.as_deref() == Some("node-a"))
    );

    // Without --pool-per-gpu: every device and counter set in the node's pool.
    let nd = devices_with_vgpus(&inv, &sel, &PciIds::embedded(), &pooled);
    let node_only = Pool {
        per_gpu: false,
        ..pool.clone()
    };
    let slices = node_only.slices(nd.devices, nd.counters, Vec::new(), 1);
    assert!(slices.iter().all(|s| s.spec.pool.name == "node-a"));
    assert_eq!(slices.len(), 2, "devices and counters");

    // A pinned GPU stays in the pool its claims came from, its counter set with its devices, in
    // either layout; the other GPU follows the layout.
    let g61: PciAddress = "0000:61:00.0".parse().unwrap();
    let pools_of = |p: &Pool| -> BTreeMap<String, String> {
        let nd = devices_with_vgpus(&inv, &sel, &PciIds::embedded(), &pooled);
        let mut out = BTreeMap::new();
        for s in p.slices(nd.devices, nd.counters, Vec::new(), 1) {
            for d in s.spec.devices.iter().flatten() {
                out.insert(d.name.clone(), s.spec.pool.name.clone());
            }
            for c in s.spec.shared_counters.iter().flatten() {
                out.insert(format!("set {}", c.name), s.spec.pool.name.clone());
            }
        }
        out
    };
    let kept_in_node = Pool {
        pinned: [(g61, "node-a".to_string())].into(),
        ..pool.clone()
    };
    let got = pools_of(&kept_in_node);
    for name in [
        "set gpu-0000-61-00-0",
        "gpu-0000-61-00-0",
        "vgpu-0000-61-00-0-a10-4q",
    ] {
        assert_eq!(got[name], "node-a", "{got:#?}");
    }
    assert_eq!(got["vgpu-0000-41-00-0-a10-4q"], "node-a/gpu-0000-41-00-0");
    assert_eq!(got["set gpu-0000-41-00-0"], "node-a/gpu-0000-41-00-0");
    let kept_in_own = Pool {
        pinned: [(g61, "node-a/gpu-0000-61-00-0".to_string())].into(),
        ..node_only.clone()
    };
    let got = pools_of(&kept_in_own);
    for name in [
        "set gpu-0000-61-00-0",
        "gpu-0000-61-00-0",
        "vgpu-0000-61-00-0-a10-8q",
    ] {
        assert_eq!(got[name], "node-a/gpu-0000-61-00-0", "{got:#?}");
    }
    assert_eq!(got["vgpu-0000-41-00-0-a10-4q"], "node-a");
    assert_eq!(kept_in_own.layout_pool(Some(&g61)), "node-a");
    assert_eq!(
        kept_in_node.layout_pool(Some(&g61)),
        "node-a/gpu-0000-61-00-0"
    );

    // Every GPU pooled: the node's own pool has nothing, and is not published.
    let nd = devices_with_vgpus(&inv, &sel, &PciIds::embedded(), &pooled);
    let pooled_only: Vec<Device> = nd
        .devices
        .into_iter()
        .filter(|d| d.name != "gpu-0000-81-00-0")
        .collect();
    let slices = pool.slices(pooled_only, nd.counters, Vec::new(), 1);
    assert_eq!(slices.len(), 4);
    assert!(slices.iter().all(|s| s.spec.pool.name != "node-a"));
    // Nothing at all: the node's own pool, empty.
    let slices = pool.slices(Vec::new(), Vec::new(), Vec::new(), 1);
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0].spec.pool.name, "node-a");
}

#[test]
fn long_slice_names_keep_the_driver() {
    let pool = Pool {
        driver: "gpu.gpu-vm-node.io".into(),
        node_name: "n".repeat(250),
        node_uid: None,
        per_gpu: false,
        pinned: BTreeMap::new(),
    };
    let name = pool.slice_name();
    assert!(name.len() <= 253);
    assert!(name.ends_with("-gpu.gpu-vm-node.io"), "{name}");
    assert!(name.starts_with('n'));
}
