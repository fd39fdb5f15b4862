use super::*;
use crate::inventory::PciDevice;

fn a(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn dev(addr: &str, driver: &str, group: u32) -> PciDevice {
    PciDevice {
        subsystem_vendor: 0x10de,
        subsystem_device: 0x1482,
        driver: Some(driver.into()),
        iommu_group: Some(group),
        ..PciDevice::new(a(addr), 0x10de, 0x2236, 0x030200)
    }
}

const UUID: &str = "5a3b2c1d-0000-4000-8000-00000000abcd";

/// An A10 on nvidia (`/dev/nvidia0`) with two VFs, an mdev on the first; a second A10 on
/// vfio-pci with its audio function in group 37.
fn node() -> Inventory {
    let mut gpu = dev("0000:41:00.0", "nvidia", 21);
    gpu.virtfns = vec![a("0000:41:00.4"), a("0000:41:00.5")];
    let mut vf0 = dev("0000:41:00.4", "nvidia", 80);
    vf0.physfn = Some(gpu.address);
    let mut vf1 = dev("0000:41:00.5", "nvidia", 81);
    vf1.physfn = Some(gpu.address);
    let mut audio = dev("0000:61:00.1", "vfio-pci", 37);
    audio.class = 0x040300;
    let mut inv = Inventory {
        devices: [gpu, vf0, vf1, dev("0000:61:00.0", "vfio-pci", 37), audio]
            .into_iter()
            .map(|d| (d.address, d))
            .collect(),
        ..Default::default()
    };
    inv.mdevs.insert(
        UUID.into(),
        MdevDevice {
            uuid: UUID.into(),
            type_id: "nvidia-593".into(),
            type_name: Some("NVIDIA A10-4Q".into()),
            parent: "0000:41:00.4".into(),
            parent_pci: Some(a("0000:41:00.4")),
            iommu_group: Some(120),
            driver: Some("vfio_mdev".into()),
            vfio_cdev: Some("vfio3".into()),
        },
    );
    inv
}

fn process(pid: u32, comm: &str, path: &str) -> (String, Vec<Process>) {
    (
        path.into(),
        vec![Process {
            pid,
            comm: comm.into(),
            path: path.into(),
        }],
    )
}

fn pod(uid: &str, source: PodSource) -> Pod {
    Pod {
        namespace: (source == PodSource::PodResources).then(|| "default".into()),
        name: (source == PodSource::PodResources).then(|| "vm-a".into()),
        uid: (source == PodSource::Checkpoint).then(|| uid.into()),
        container: "compute".into(),
        resource: "nvidia.com/NVIDIA_A10-4Q".into(),
        claim: None,
        source,
    }
}

fn usage() -> Usage {
    Usage {
        nvidia_minors: Ok([(a("0000:41:00.0"), Ok(0))].into()),
        ..Usage::default()
    }
}

#[test]
fn nothing_held_is_free() {
    let inv = node();
    let u = usage();
    assert!(u.of_gpu(&inv, &a("0000:41:00.0")).is_empty());
    assert!(u.of_group(&inv, 37).is_empty());
    assert!(u.of_mdev(&inv.mdevs[UUID]).is_empty());
}

#[test]
fn a_gpu_is_in_use_when_its_mdev_is_held_or_allocated() {
    let inv = node();
    let mut u = usage();
    u.processes = Ok([process(4321, "qemu-kvm", "/dev/vfio/devices/vfio3")].into());
    u.pods = Ok([(UUID.to_string(), vec![pod("p1", PodSource::PodResources)])].into());
    let uses = u.of_gpu(&inv, &a("0000:41:00.0"));
    assert_eq!(
        uses.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
        vec![
            format!("mdev {UUID}: pid 4321 (qemu-kvm) holds /dev/vfio/devices/vfio3"),
            format!(
                "mdev {UUID}: pod default/vm-a (container compute, nvidia.com/NVIDIA_A10-4Q) has it"
            ),
        ]
    );
    // The other GPU is not concerned.
    assert!(u.of_group(&inv, 37).is_empty());
}

#[test]
fn a_gpu_on_nvidia_is_in_use_while_its_nvidia_node_is_held() {
    let inv = node();
    let mut u = usage();
    u.processes = Ok([
        process(77, "python3", "/dev/nvidia0"),
        process(78, "nvidia-smi", "/dev/nvidiactl"),
    ]
    .into());
    let uses = u.of_gpu(&inv, &a("0000:41:00.0"));
    assert_eq!(uses.len(), 1, "{uses:?}");
    assert_eq!(uses[0].device, Device::Function(a("0000:41:00.0")));
    assert_eq!(
        uses[0].to_string(),
        "0000:41:00.0: pid 77 (python3) holds /dev/nvidia0"
    );
    // The minor the driver cannot name is not known to be free.
    let no_minor = Unreadable::NvidiaMinor {
        reason: "no Device Minor line".into(),
    };
    u.nvidia_minors = Ok([(a("0000:41:00.0"), Err(no_minor))].into());
    let uses = u.of_gpu(&inv, &a("0000:41:00.0"));
    assert!(uses[0].user.is_unknown_from(Source::Processes), "{uses:?}");
}

#[test]
fn a_vm_holding_a_group_is_named_once_and_pods_per_device() {
    let inv = node();
    let mut u = usage();
    u.processes = Ok([process(4242, "qemu-kvm", "/dev/vfio/37")].into());
    u.pods = Ok([
        (
            "0000:61:00.0".to_string(),
            vec![pod("p1", PodSource::PodResources)],
        ),
        (
            "0000:61:00.1".to_string(),
            vec![pod("p1", PodSource::PodResources)],
        ),
    ]
    .into());
    let uses = u.of_group(&inv, 37);
    let shown: Vec<String> = uses.iter().map(|u| u.to_string()).collect();
    assert_eq!(shown.len(), 3, "{shown:?}");
    assert!(shown[0].starts_with("0000:61:00.0: pid 4242"), "{shown:?}");
    assert!(
        shown[1].starts_with("0000:61:00.0: pod default/vm-a"),
        "{shown:?}"
    );
    assert!(
        shown[2].starts_with("0000:61:00.1: pod default/vm-a"),
        "{shown:?}"
    );
}

#[test]
fn ids_match_whatever_their_case() {
    let inv = node();
    let mut u = usage();
    u.pods = Ok([(UUID.to_string(), vec![pod("6f1c", PodSource::Checkpoint)])].into());
    let users = u.of_mdev(&inv.mdevs[UUID]);
    assert_eq!(
        users[0].to_string(),
        "pod 6f1c (container compute, nvidia.com/NVIDIA_A10-4Q; kubelet's checkpoint) has it"
    );
    let mut upper = inv.mdevs[UUID].clone();
    upper.uuid = UUID.to_uppercase();
    assert_eq!(u.of_mdev(&upper), users);
}

#[test]
fn an_unreadable_source_is_an_unknown_user_named_once() {
    let inv = node();
    let mut u = usage();
    u.processes = Err(Unreadable::Processes {
        reason: "/proc".into(),
    });
    u.pods = Err(Unreadable::CheckpointCorrupt {
        path: "/k".into(),
        reason: "EOF".into(),
    });
    let uses = u.of_gpu(&inv, &a("0000:41:00.0"));
    assert_eq!(
        uses.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
        vec![
            "unknown: cannot read the processes' open files: /proc",
            "unknown: kubelet's checkpoint /k is truncated or corrupt (EOF)",
        ]
    );
    assert!(
        uses.iter()
            .all(|u| u.device == Device::Function(a("0000:41:00.0")))
    );
    let json = serde_json::to_value(&uses[1]).unwrap();
    assert_eq!(json["kind"], "unknown");
    assert_eq!(json["source"], "kubelet");
    assert_eq!(json["device"]["id"], "0000:41:00.0");
    assert_eq!(uses[1].user.who(), "unknown");
    // A device the node does not have is asked of kubelet only.
    let users = u.of_function(&inv, &a("0000:99:00.0"));
    assert_eq!(users.len(), 1);
    assert!(users[0].is_unknown_from(Source::Kubelet));
}

#[test]
fn users_serialize_with_their_kind() {
    let p = User::Process(Process {
        pid: 4242,
        comm: "qemu-kvm".into(),
        path: "/dev/vfio/42".into(),
    });
    let v = serde_json::to_value(&p).unwrap();
    assert_eq!(v["kind"], "process");
    assert_eq!(v["pid"], 4242);
    let v = serde_json::to_value(User::Pod(pod("p1", PodSource::PodResources))).unwrap();
    assert_eq!(v["kind"], "pod");
    assert_eq!(v["namespace"], "default");
    assert_eq!(v["source"], "pod-resources");
}

#[test]
fn moving_a_function_to_vfio_ignores_pods_given_that_function_only() {
    let inv = node();
    let mut u = usage();
    // After a reboot: kubelet runs the pod it gave the passthrough GPU to, and the pod that has
    // the vGPU on its VF.
    u.pods = Ok([
        (
            "0000:41:00.0".to_string(),
            vec![pod("p0", PodSource::PodResources)],
        ),
        (UUID.to_string(), vec![pod("p1", PodSource::PodResources)]),
    ]
    .into());
    let all = u.of_gpu(&inv, &a("0000:41:00.0"));
    assert_eq!(all.len(), 2, "{all:?}");
    let blocking = u.of_gpu_for_passthrough(&inv, &a("0000:41:00.0"));
    assert_eq!(blocking.len(), 1, "{blocking:?}");
    assert_eq!(
        blocking[0].describe(&inv),
        format!(
            "vGPU NVIDIA A10-4Q {UUID} (on 0000:41:00.4): pod default/vm-a (container compute, \
             nvidia.com/NVIDIA_A10-4Q) has it"
        )
    );
    // Unknown pods still count for what is on the GPU...
    u.pods = Err(Unreadable::CheckpointCorrupt {
        path: "/k".into(),
        reason: "EOF".into(),
    });
    let blocking = u.of_gpu_for_passthrough(&inv, &a("0000:41:00.0"));
    assert_eq!(blocking.len(), 1, "{blocking:?}");
    assert!(blocking[0].user.is_unknown_from(Source::Kubelet));
    // ... but not for a bare GPU, whose only pods would be passthrough ones.
    let mut bare = inv.clone();
    bare.mdevs.clear();
    if let Some(d) = bare.devices.get_mut(&a("0000:41:00.0")) {
        d.virtfns.clear();
    }
    assert!(
        u.of_gpu_for_passthrough(&bare, &a("0000:41:00.0"))
            .is_empty()
    );
}

/// A pod whose claim `claim` gave it a device of sandbox-dra's.
fn claim_pod(claim: &str, device: &str) -> Pod {
    Pod {
        namespace: Some("vms".into()),
        name: Some("virt-launcher-a".into()),
        uid: None,
        container: "compute".into(),
        resource: "gpu.gpu-vm-node.io".into(),
        claim: Some(Claim {
            namespace: "vms".into(),
            name: claim.into(),
            driver: "gpu.gpu-vm-node.io".into(),
            pool: "node-a".into(),
            device: device.into(),
        }),
        source: PodSource::PodResources,
    }
}

#[test]
fn a_prepared_claim_holds_the_device_nodes_its_cdi_devices_name() {
    let inv = node();
    let mut u = usage();
    u.claims = [
        // A whole GPU: its group's node (and the container node every VFIO device has).
        (
            "/dev/vfio/37".to_string(),
            vec![claim_pod("gpu", "gpu-0000-61-00-0")],
        ),
        (
            "/dev/vfio/vfio".to_string(),
            vec![claim_pod("gpu", "gpu-0000-61-00-0")],
        ),
        // A vGPU: the mdev's cdev.
        (
            "/dev/vfio/devices/vfio3".to_string(),
            vec![claim_pod("vgpu", "vgpu-0000-41-00-0-a10-4q")],
        ),
    ]
    .into();
    let uses = u.of_group(&inv, 37);
    assert_eq!(
        uses.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
        vec![
            "0000:61:00.0: pod vms/virt-launcher-a (container compute, claim vms/gpu, device \
             gpu.gpu-vm-node.io/node-a/gpu-0000-61-00-0) has it",
            "0000:61:00.1: pod vms/virt-launcher-a (container compute, claim vms/gpu, device \
             gpu.gpu-vm-node.io/node-a/gpu-0000-61-00-0) has it",
        ]
    );
    let json = serde_json::to_value(&uses[0]).unwrap();
    assert_eq!(json["kind"], "pod");
    assert_eq!(json["claim"]["name"], "gpu");
    assert_eq!(json["claim"]["device"], "gpu-0000-61-00-0");
    // The vGPU's claim makes its GPU in use, even to a move onto VFIO.
    let uses = u.of_gpu_for_passthrough(&inv, &a("0000:41:00.0"));
    assert_eq!(uses.len(), 1, "{uses:?}");
    assert_eq!(uses[0].device, Device::Mdev(UUID.into()));
    // The whole GPU's own claim needs it on VFIO: no blocker for that move, but for all else.
    assert!(
        u.of_gpu_for_passthrough(&inv, &a("0000:61:00.0"))
            .is_empty()
    );
    assert_eq!(u.of_gpu(&inv, &a("0000:61:00.0")).len(), 1);
}

#[test]
fn a_claim_holding_a_gpus_nvidia_node_blocks_its_move_to_vfio() {
    let inv = node();
    let mut u = usage();
    u.claims = [("/dev/nvidia0".to_string(), vec![claim_pod("cuda", "gpu-0")])].into();
    let uses = u.of_gpu_for_passthrough(&inv, &a("0000:41:00.0"));
    assert_eq!(uses.len(), 1, "{uses:?}");
    assert!(uses[0].to_string().contains("claim vms/cuda"), "{uses:?}");
}

#[test]
fn a_claim_whose_nodes_cannot_be_told_is_an_unknown_user_of_every_device() {
    let inv = node();
    let mut u = usage();
    u.claims_unknown = vec!["cannot tell which devices pod vms/x (…) holds: …".into()];
    for g in [21, 37] {
        let uses = u.of_group(&inv, g);
        assert_eq!(uses.len(), 1, "{uses:?}");
        assert!(uses[0].user.is_unknown_from(Source::Kubelet), "{uses:?}");
    }
    assert_eq!(u.of_mdev(&inv.mdevs[UUID]).len(), 1);
    // A GPU on VFIO moving onto VFIO has no node a claim could hold but its own.
    assert!(
        u.of_gpu_for_passthrough(&inv, &a("0000:61:00.0"))
            .is_empty()
    );
    // On nvidia, its /dev/nvidia<N> may be the claim's.
    assert!(
        !u.of_gpu_for_passthrough(&inv, &a("0000:41:00.0"))
            .is_empty()
    );
}

/// sandbox-dra's record of claim `vms/<name>`, as it writes one: `devices` are
/// `(address, nodes)`.
fn record(name: &str, state: &str, devices: &[(&str, &[&str])]) -> String {
    let devices: Vec<serde_json::Value> = devices
        .iter()
        .map(|(address, nodes)| {
            serde_json::json!({
                "requests": ["gpu"],
                "pool": "node-a",
                "device": "gpu-0000-61-00-0",
                "address": address,
                "group": 37,
                "nodes": nodes,
            })
        })
        .collect();
    serde_json::to_string_pretty(&serde_json::json!({
        "version": 1,
        "claim": {"namespace": "vms", "name": name, "uid": format!("uid-{name}"), "pod_claim_name": null},
        "state": state,
        "devices": devices,
        "originals": {"0000:61:00.0": "nvidia"},
    }))
    .unwrap()
}

/// A host root whose kubelet root holds `files` (path under `var/lib/kubelet/plugins`, text).
fn records_tree(files: &[(&str, &str)]) -> (tempfile::TempDir, HostPaths) {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let p = dir.path().join("var/lib/kubelet/plugins").join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
    }
    let paths = HostPaths::new(dir.path());
    (dir, paths)
}

/// [`usage`] with the claim records under `paths`, leaving out claim `exclude`.
fn with_records(paths: &HostPaths, exclude: Option<(&str, &str)>) -> Usage {
    let r = records::read(paths, exclude);
    Usage {
        prepared: r.by_node,
        prepared_functions: r.by_function,
        records_unknown: r.unknown,
        ..usage()
    }
}

#[test]
fn a_claim_a_dra_driver_prepared_holds_its_nodes_without_kubelet() {
    let inv = node();
    let (_dir, paths) = records_tree(&[
        (
            "gpu.gpu-vm-node.io/claims/uid-gpu.json",
            &record(
                "gpu",
                "prepared",
                &[("0000:61:00.0", &["/dev/vfio/vfio", "/dev/vfio/37"])],
            ),
        ),
        // A driver keeping other files, and one keeping none: nothing to read.
        ("gpu.example.com/checkpoint.json", "{}"),
        ("gpu.example.com/dra.sock", ""),
    ]);
    let u = with_records(&paths, None);
    let uses = u.of_group(&inv, 37);
    assert_eq!(
        uses.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
        vec!["0000:61:00.0: claim vms/gpu (prepared by gpu.gpu-vm-node.io) has it"]
    );
    let json = serde_json::to_value(&uses[0]).unwrap();
    assert_eq!(json["kind"], "claim");
    assert_eq!(json["name"], "gpu");
    assert_eq!(json["driver"], "gpu.gpu-vm-node.io");
    // It needs the GPU on VFIO: no blocker of that move, of every other.
    assert!(
        u.of_gpu_for_passthrough(&inv, &a("0000:61:00.0"))
            .is_empty()
    );
    assert_eq!(u.of_gpu(&inv, &a("0000:61:00.0")).len(), 1);
    assert!(u.of_group(&inv, 21).is_empty(), "the other GPU is free");
    // The driver preparing or unpreparing that claim is not its user.
    assert!(
        with_records(&paths, Some(("vms", "gpu")))
            .of_group(&inv, 37)
            .is_empty()
    );

    // Named once when kubelet's PodResources names the same claim's pod.
    let mut u = with_records(&paths, None);
    u.claims = [(
        "/dev/vfio/37".to_string(),
        vec![claim_pod("gpu", "gpu-0000-61-00-0")],
    )]
    .into();
    let uses = u.of_group(&inv, 37);
    assert_eq!(uses.len(), 2, "one per function: {uses:?}");
    assert!(uses.iter().all(|u| u.user.is_pod()), "{uses:?}");
}

#[test]
fn a_prepare_under_way_holds_its_function_and_a_vgpus_claim_its_gpu() {
    let inv = node();
    let (_dir, paths) = records_tree(&[
        // Preparing: the devices' nodes are not known yet.
        (
            "gpu.gpu-vm-node.io/claims/uid-gpu.json",
            &record("gpu", "preparing", &[("0000:61:00.0", &[])]),
        ),
        // A vGPU on the first GPU's VF, prepared under another driver name.
        (
            "vgpu.example.org/claims/uid-vgpu.json",
            &record(
                "vgpu",
                "prepared",
                &[("0000:41:00.0", &["/dev/vfio/vfio", "/dev/vfio/120"])],
            ),
        ),
    ]);
    let u = with_records(&paths, None);
    let uses = u.of_gpu_for_passthrough(&inv, &a("0000:61:00.0"));
    assert_eq!(
        uses.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
        vec!["0000:61:00.0: claim vms/gpu (being prepared by gpu.gpu-vm-node.io) has it"]
    );
    let uses = u.of_gpu_for_passthrough(&inv, &a("0000:41:00.0"));
    assert_eq!(
        uses.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
        vec![format!(
            "mdev {UUID}: claim vms/vgpu (prepared by vgpu.example.org) has it"
        )]
    );
}

#[test]
fn a_claim_record_that_cannot_be_read_is_an_unknown_user_of_every_device() {
    let inv = node();
    let ok = record("gpu", "prepared", &[("0000:61:00.0", &["/dev/vfio/37"])]);
    let newer = ok.replace("\"version\": 1", "\"version\": 2");
    for (text, says) in [
        ("{\"claim\": {\"namespace\": \"vms\"", "is not one"),
        (newer.as_str(), "format v2"),
    ] {
        let (_dir, paths) = records_tree(&[
            ("gpu.gpu-vm-node.io/claims/uid-x.json", text),
            // Set aside by the driver, and a write's temporary file: not records.
            (
                "gpu.gpu-vm-node.io/claims/uid-y.json.unreadable-1700000000",
                "garbage",
            ),
            ("gpu.gpu-vm-node.io/claims/.uid-z.json.1f2e.tmp", "garb"),
        ]);
        let u = with_records(&paths, None);
        for g in [21, 37] {
            let uses = u.of_group(&inv, g);
            assert_eq!(uses.len(), 1, "{uses:?}");
            assert!(
                uses[0].user.is_unknown_from(Source::ClaimRecords),
                "{uses:?}"
            );
            let s = uses[0].to_string();
            assert!(s.contains("uid-x.json") && s.contains(says), "{s}");
        }
        assert_eq!(u.of_mdev(&inv.mdevs[UUID]).len(), 1);
    }
    // No plugins directory at all: no DRA driver ran, nothing is held.
    let dir = tempfile::tempdir().unwrap();
    let u = with_records(&HostPaths::new(dir.path()), None);
    assert!(u.of_group(&inv, 37).is_empty());
}
