//! The planner on hand-made GPUs.

use common::{Inventory, Usage, User};

use super::*;
use crate::config::Config;
use crate::gpu::discover;

fn a10_type(id: u32, key: &str, max: u32, fb: u64) -> TypeInfo {
    TypeInfo {
        id: format!("nvidia-{id}"),
        name: Some(format!("NVIDIA {key}")),
        max: Some(max),
        framebuffer_mb: Some(fb),
    }
}

/// An A10 with `vfs` VFs (mdev on VFs) and the given vGPUs: (VF index, type id, held).
fn a10(index: usize, bus: u8, vgpus: &[(usize, u32, bool)]) -> Gpu {
    let vf = |i: usize| format!("0000:{bus:02x}:{:02x}.{}", (4 + i) / 8, (4 + i) % 8);
    Gpu {
        index,
        name: format!("0000:{bus:02x}:00.0"),
        pci: Some(format!("0000:{bus:02x}:00.0").parse().unwrap()),
        ids: (0x10de, 0x2236, 0x10de, 0x1482),
        backend: Backend::MdevVf,
        types: vec![
            a10_type(593, "A10-4Q", 6, 4096),
            a10_type(610, "A10-4C", 6, 4096),
            a10_type(595, "A10-8Q", 3, 8192),
        ],
        vgpus: vgpus
            .iter()
            .map(|(i, t, held)| Vgpu {
                handle: Handle::Mdev(format!("00000000-0000-4000-8000-{bus:02x}00000000{i:02}")),
                parent: vf(*i),
                type_id: format!("nvidia-{t}"),
                type_name: None,
                users: if *held {
                    vec![User::Process(common::usage::Process {
                        pid: 42,
                        comm: "qemu-kvm".into(),
                        path: "/dev/vfio/99".into(),
                    })]
                } else {
                    vec![]
                },
            })
            .collect(),
        slots: (0..32).map(vf).collect(),
        pooled: None,
    }
}

fn profile(yaml_entries: &str) -> Config {
    Config::parse(&format!("version: v1\nvgpu-configs:\n  p:\n{yaml_entries}")).unwrap()
}

fn run(gpus: &[Gpu], yaml_entries: &str) -> Result<Plan, Vec<PlanError>> {
    let c = profile(yaml_entries);
    plan(gpus, "p", c.profile("p").unwrap())
}

#[test]
fn keeps_matching_removes_extras_creates_missing() {
    let gpus = [a10(
        0,
        0x41,
        &[(0, 593, false), (1, 595, false), (2, 593, false)],
    )];
    let p = run(
        &gpus,
        "    - devices: all\n      vgpu-devices: {A10-4Q: 4}\n",
    )
    .unwrap();
    let g = &p.gpus[0];
    assert_eq!(g.keep.len(), 2);
    assert_eq!(
        g.actions.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        vec![
            "remove nvidia-595 00000000-0000-4000-8000-410000000001 (on 0000:41:00.5)",
            "create NVIDIA A10-4Q on 0000:41:00.5",
            "create NVIDIA A10-4Q on 0000:41:00.7",
        ]
    );
}

#[test]
fn an_applied_gpu_plans_nothing() {
    let v: Vec<(usize, u32, bool)> = (0..6).map(|i| (i, 593, false)).collect();
    let gpus = [a10(0, 0x41, &v)];
    let p = run(
        &gpus,
        "    - devices: all\n      vgpu-devices: {A10-4Q: 6}\n",
    )
    .unwrap();
    assert!(p.is_applied());
}

#[test]
fn shrinking_keeps_the_held_one_and_removing_it_blocks() {
    let gpus = [a10(0, 0x41, &[(0, 593, false), (1, 593, true)])];
    let p = run(
        &gpus,
        "    - devices: all\n      vgpu-devices: {A10-4Q: 1}\n",
    )
    .unwrap();
    let g = &p.gpus[0];
    assert!(g.blocked.is_empty());
    assert_eq!(
        g.keep,
        vec!["nvidia-593 00000000-0000-4000-8000-410000000001"]
    );
    assert_eq!(g.actions.len(), 1);
    let p = run(
        &gpus,
        "    - devices: all\n      vgpu-devices: {A10-8Q: 1}\n",
    )
    .unwrap();
    let g = &p.gpus[0];
    assert!(g.actions.is_empty());
    assert_eq!(g.blocked.len(), 1);
    assert!(
        g.blocked[0].contains("pid 42 (qemu-kvm) holds /dev/vfio/99"),
        "{g:?}"
    );
}

#[test]
fn errors_name_profile_entry_and_gpu() {
    let gpus = [a10(0, 0x41, &[]), a10(1, 0x61, &[])];
    let e = run(
        &gpus,
        "    - devices: [1]\n      vgpu-devices: {T4-4Q: 1}\n",
    )
    .unwrap_err();
    assert_eq!(
        e[0].to_string(),
        "profile \"p\" entry 0: GPU 1 (0000:61:00.0, 10de:2236) cannot make \"T4-4Q\"; it offers A10-4C, A10-4Q, A10-8Q"
    );
    let e = run(
        &gpus,
        "    - devices: all\n      vgpu-devices: {A10-8Q: 4}\n",
    )
    .unwrap_err();
    assert_eq!(e.len(), 2);
    assert!(
        e[0].to_string()
            .contains("at most 3 A10-8Q vGPUs, the entry asks for 4")
    );
    let e = run(
        &gpus,
        "    - devices: all\n      vgpu-devices: {A10-4Q: 1, A10-8Q: 1}\n",
    )
    .unwrap_err();
    assert!(
        e[0].to_string().contains("cannot mix A10-4Q and A10-8Q"),
        "{e:?}"
    );
    // Same size mixes, within the shared maximum.
    assert!(
        run(
            &gpus,
            "    - devices: all\n      vgpu-devices: {A10-4Q: 3, A10-4C: 3}\n"
        )
        .is_ok()
    );
    let e = run(
        &gpus,
        "    - devices: all\n      vgpu-devices: {A10-4Q: 4, A10-4C: 3}\n",
    )
    .unwrap_err();
    assert!(
        e[0].to_string()
            .contains("at most 6 vGPUs of this size in all"),
        "{e:?}"
    );
    let e = run(
        &gpus,
        "    - devices: all\n      vgpu-devices: {A10-4Q: 1}\n    - devices: [0]\n      vgpu-devices: {A10-8Q: 1}\n",
    )
    .unwrap_err();
    assert!(
        e[0].to_string().contains("selected by entry 0 and entry 1"),
        "{e:?}"
    );
}

#[test]
fn repeated_entries_are_one_wish_and_types_pick_between_boards() {
    let gpus = [a10(0, 0x41, &[]), a10(1, 0x61, &[])];
    // The same filter twice with the same vGPUs, as NVIDIA's default config has it.
    let twice = "    - device-filter: \"0x223610DE\"\n      devices: all\n      vgpu-devices: {A10-8Q: 2}\n";
    let p = run(&gpus, &twice.repeat(2)).unwrap();
    assert_eq!(p.gpus.len(), 2);
    assert!(p.gpus.iter().all(|g| g.entry == "p[0]"), "{p:?}");
    // One PCI id, two boards: the entry whose types the GPU offers is the one applied.
    let boards = "    - device-filter: \"0x223610DE\"\n      devices: all\n      vgpu-devices: {T4-8Q: 2}\n    - device-filter: \"0x223610DE\"\n      devices: all\n      vgpu-devices: {A10-4Q: 2}\n";
    let p = run(&gpus, boards).unwrap();
    assert!(p.gpus.iter().all(|g| g.entry == "p[1]"), "{p:?}");
    // Neither fits: both reasons are given.
    let e = run(&gpus, &boards.replace("A10-4Q", "A16-4Q")).unwrap_err();
    assert_eq!(e.len(), 4, "{e:?}");
    assert!(e[1].to_string().contains("cannot make \"A16-4Q\""), "{e:?}");
}

#[test]
fn filters_and_missing_indices() {
    let gpus = [a10(0, 0x41, &[]), a10(1, 0x61, &[])];
    let p = run(
        &gpus,
        "    - devices: all\n      device-filter: \"0x1EB810DE\"\n      vgpu-devices: {T4-4Q: 1}\n",
    )
    .unwrap();
    assert!(p.gpus.is_empty());
    let p = run(
        &gpus,
        "    - devices: [1, 5]\n      vgpu-devices: {A10-8Q: 1}\n",
    )
    .unwrap();
    assert_eq!(p.gpus.len(), 1);
    assert_eq!(p.gpus[0].index, 1);
    assert!(p.warnings[0].contains("GPU index 5"), "{:?}", p.warnings);
}

#[test]
fn vendor_any_admits_virtual_mdev_parents() {
    let mut inv = Inventory::default();
    let ty = |id: &str, avail: u32| common::MdevType {
        id: id.into(),
        name: None,
        available_instances: avail,
        description: None,
    };
    inv.mdev_parents.insert(
        "mtty".into(),
        common::MdevParent {
            name: "mtty".into(),
            pci: None,
            types: vec![ty("mtty-1", 4), ty("mtty-2", 2)],
        },
    );
    inv.mdevs.insert(
        "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001".into(),
        common::MdevDevice {
            uuid: "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001".into(),
            type_id: "mtty-1".into(),
            type_name: None,
            parent: "mtty".into(),
            parent_pci: None,
            iommu_group: Some(3),
            driver: None,
            vfio_cdev: None,
        },
    );
    let (none, names) = (Usage::default(), BTreeMap::new());
    assert!(discover(&inv, VendorSel::Pci(0x10de), &none, &names).is_empty());
    let gpus = discover(&inv, VendorSel::Any, &none, &names);
    assert_eq!(gpus.len(), 1);
    assert_eq!(gpus[0].label(), "GPU 0 (mtty)");
    let p = run(
        &gpus,
        "    - devices: [0]\n      vgpu-devices: {mtty-2: 1}\n",
    )
    .unwrap();
    assert_eq!(
        p.gpus[0]
            .actions
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>(),
        vec![
            "remove mtty-1 83b8f4f2-509f-382f-3c1e-e6bfe0fa1001 (on mtty)",
            "create mtty-2 on mtty"
        ]
    );
}

#[test]
fn pooled_gpus_are_left_alone_and_said_so() {
    let mut a = a10(0, 0x41, &[(0, 593, false), (1, 593, false)]);
    a.pooled = Some(common::state::pool::ON_DEMAND_OWNER);
    let b = a10(1, 0x61, &[]);
    let p = run(
        &[a, b],
        "    - devices: all\n      vgpu-devices: {\"A10-8Q\": 3}\n",
    )
    .unwrap();
    assert_eq!(p.gpus.len(), 1, "only GPU 1 is planned: {p:?}");
    assert_eq!(p.gpus[0].index, 1);
    assert_eq!(p.pooled.len(), 1);
    assert_eq!(p.pooled[0].gpu, "GPU 0 (0000:41:00.0, 10de:2236)");
    let text = p.render();
    assert!(
        text.contains(
            "GPU 0 (0000:41:00.0, 10de:2236): in sandbox-dp's on-demand pool; left alone"
        ),
        "{text}"
    );
    assert!(!text.contains("remove"), "its vGPUs stay: {text}");
}
