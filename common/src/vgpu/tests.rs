use super::*;
use crate::{MdevDevice, NvidiaVgpu, VgpuType};

fn a(s: &str) -> PciAddress {
    s.parse().unwrap()
}

/// A10 (or H100) PF on nvidia with `vfs` VFs at function 4 onwards (none enabled when 0).
fn pf(addr: &str, device: u16, vfs: u32) -> (PciDevice, Vec<PciDevice>) {
    let mut gpu = PciDevice {
        driver: Some("nvidia".into()),
        sriov_totalvfs: Some(32),
        sriov_numvfs: Some(vfs),
        ..PciDevice::new(a(addr), 0x10de, device, 0x030200)
    };
    let base = a(addr);
    let vfs: Vec<PciDevice> = (0..vfs)
        .map(|i| {
            let f = 4 + i;
            let va = PciAddress {
                device: base.device + (f / 8) as u8,
                function: (f % 8) as u8,
                ..base
            };
            PciDevice {
                driver: Some("nvidia".into()),
                physfn: Some(base),
                ..PciDevice::new(va, 0x10de, device, 0x030200)
            }
        })
        .collect();
    gpu.virtfns = vfs.iter().map(|v| v.address).collect();
    (gpu, vfs)
}

fn inventory(devs: impl IntoIterator<Item = PciDevice>) -> Inventory {
    Inventory {
        devices: devs.into_iter().map(|d| (d.address, d)).collect(),
        ..Default::default()
    }
}

const A10_4Q: (&str, &str, u64, u32) = ("nvidia-593", "NVIDIA A10-4Q", 4096, 6);
const A10_8Q: (&str, &str, u64, u32) = ("nvidia-595", "NVIDIA A10-8Q", 8192, 3);

fn mdev_type((id, name, fb, max): (&str, &str, u64, u32), available: u32) -> MdevType {
    MdevType {
        id: id.into(),
        name: Some(name.into()),
        available_instances: available,
        description: Some(format!(
            "num_heads=4, frl_config=60, framebuffer={fb}M, max_resolution=7680x4320, max_instance={max}"
        )),
    }
}

/// Two A10s with all 32 VFs enabled, each VF offering A10-4Q and A10-8Q as node-sim does (1
/// when the VF is free and the size fits, else 0), and `on_a` A10-4Q mdevs on GPU A's first VFs.
fn two_a10s_with_vfs(on_a: usize) -> Inventory {
    let mut devs = Vec::new();
    let mut mdevs = Vec::new();
    for (gi, addr) in ["0000:41:00.0", "0000:61:00.0"].into_iter().enumerate() {
        let (gpu, mut vfs) = pf(addr, 0x2236, 32);
        let here = if gi == 0 { on_a } else { 0 };
        for (i, vf) in vfs.iter_mut().enumerate() {
            vf.mdev_parent = true;
            let free = i >= here;
            let four = u32::from(free && here < 6);
            let eight = u32::from(free && here == 0);
            vf.mdev_types = vec![mdev_type(A10_4Q, four), mdev_type(A10_8Q, eight)];
            if !free {
                mdevs.push(MdevDevice {
                    uuid: format!("00000000-0000-4000-8000-{i:012}"),
                    type_id: A10_4Q.0.into(),
                    type_name: Some(A10_4Q.1.into()),
                    parent: vf.address.to_string(),
                    parent_pci: Some(vf.address),
                    iommu_group: None,
                    driver: Some("vfio_mdev".into()),
                    vfio_cdev: None,
                });
            }
        }
        devs.push(gpu);
        devs.extend(vfs);
    }
    let mut inv = inventory(devs);
    inv.mdevs = mdevs.into_iter().map(|m| (m.uuid.clone(), m)).collect();
    inv
}

#[test]
fn a10_with_vfs_off_offers_what_its_model_makes() {
    let (ga, _) = pf("0000:41:00.0", 0x2236, 0);
    let (gb, _) = pf("0000:61:00.0", 0x2236, 0);
    let inv = inventory([ga, gb]);
    for gpu in ["0000:41:00.0", "0000:61:00.0"] {
        let c = capacity(&inv, &a(gpu));
        assert_eq!(c.mode, Mode::NeedsVfs { total: 32 });
        assert_eq!(c.available("NVIDIA A10-4Q"), 6);
        assert_eq!(c.available("NVIDIA A10-8Q"), 3);
        assert_eq!(c.available("NVIDIA A10-1Q"), 24);
        assert_eq!(c.available("NVIDIA A10-24Q"), 1);
        assert_eq!(c.available("NVIDIA A10-6C"), 4);
        assert_eq!(c.get("NVIDIA A10-4Q").unwrap().type_id, None);
        assert!(c.get("NVIDIA A10-5Q").is_none(), "5 does not divide 24");
        assert!(c.get("NVIDIA A10-2C").is_none(), "no C type under 4 GiB");
    }
}

#[test]
fn a10_with_vfs_counts_per_framebuffer_and_does_not_mix_sizes() {
    let inv = two_a10s_with_vfs(0);
    let c = capacity(&inv, &a("0000:41:00.0"));
    assert_eq!(c.mode, Mode::MdevVf);
    let four = c.get("NVIDIA A10-4Q").unwrap();
    assert_eq!((four.available, four.max), (6, Some(6)));
    assert_eq!(four.type_id.as_deref(), Some("nvidia-593"));
    assert_eq!(four.parents[0], "0000:41:00.4", "the first free VF");
    assert_eq!(c.available("nvidia-595"), 3);

    let inv = two_a10s_with_vfs(1);
    let c = capacity(&inv, &a("0000:41:00.0"));
    assert_eq!(c.existing.len(), 1);
    assert_eq!(c.available("NVIDIA A10-4Q"), 5);
    assert_eq!(c.available("NVIDIA A10-8Q"), 0, "one 4Q present: no 8Q");
    assert_eq!(
        c.get("NVIDIA A10-4Q").unwrap().parents[0],
        "0000:41:00.5",
        "the VF holding the 4Q is taken"
    );
    let other = capacity(&inv, &a("0000:61:00.0"));
    assert_eq!(
        (
            other.available("NVIDIA A10-4Q"),
            other.available("NVIDIA A10-8Q")
        ),
        (6, 3),
        "the other GPU is untouched"
    );

    let full = capacity(&two_a10s_with_vfs(6), &a("0000:41:00.0"));
    assert_eq!(full.available("NVIDIA A10-4Q"), 0);
    assert!(full.get("NVIDIA A10-4Q").unwrap().parents.is_empty());
}

/// An H100 SXM5 with `n` VFs on the vendor path, `current` types set on the first VFs, and
/// the creatable lists node-sim writes (the set size only, while it fits; none on a used VF).
fn h100(current: &[u32]) -> Inventory {
    let types = [
        (1500u32, "NVIDIA H100XM-4C"),
        (1501, "NVIDIA H100XM-8C"),
        (1502, "NVIDIA H100XM-80C"),
    ];
    let size = |id: u32| match id {
        1500 => 4,
        1501 => 8,
        _ => 80,
    };
    let (gpu, mut vfs) = pf("0000:18:00.0", 0x2330, 20);
    for (i, vf) in vfs.iter_mut().enumerate() {
        let cur = current.get(i).copied().unwrap_or(0);
        let creatable = if cur != 0 {
            Vec::new()
        } else {
            types
                .iter()
                .filter(|(id, _)| match current.first() {
                    None => true,
                    Some(&s) => size(*id) == size(s) && (current.len() as u32) < 80 / size(s),
                })
                .map(|(id, name)| VgpuType {
                    id: *id,
                    name: (*name).into(),
                })
                .collect()
        };
        vf.nvidia_vgpu = Some(NvidiaVgpu {
            creatable,
            current: cur,
            current_name: types.iter().find(|t| t.0 == cur).map(|t| t.1.to_string()),
        });
    }
    inventory(std::iter::once(gpu).chain(vfs))
}

#[test]
fn h100_vendor_path_counts_from_memory_and_free_vfs() {
    let c = capacity(&h100(&[]), &a("0000:18:00.0"));
    assert_eq!(c.mode, Mode::Vendor);
    assert_eq!(
        c.available("NVIDIA H100XM-4C"),
        20,
        "80 GiB / 4, capped at 20 VFs"
    );
    assert_eq!(c.available("NVIDIA H100XM-8C"), 10);
    assert_eq!(c.available("NVIDIA H100XM-80C"), 1);
    assert_eq!(
        c.get("NVIDIA H100XM-8C").unwrap().type_id.as_deref(),
        Some("1501")
    );

    let c = capacity(&h100(&[1501]), &a("0000:18:00.0"));
    assert_eq!(c.available("NVIDIA H100XM-8C"), 9);
    assert_eq!(c.available("NVIDIA H100XM-4C"), 0, "sizes do not mix");
    assert_eq!(c.available("NVIDIA H100XM-80C"), 0);
    assert!(
        !c.get("NVIDIA H100XM-8C")
            .unwrap()
            .parents
            .contains(&"0000:18:00.4".to_string()),
        "the VF in use is not offered"
    );
}

#[test]
fn h100_with_vfs_off_offers_its_c_types() {
    let (gpu, _) = pf("0000:18:00.0", 0x2330, 0);
    let c = capacity(&inventory([gpu]), &a("0000:18:00.0"));
    assert_eq!(c.mode, Mode::NeedsVfs { total: 32 });
    let names: Vec<&str> = c.types.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "NVIDIA H100XM-4C",
            "NVIDIA H100XM-5C",
            "NVIDIA H100XM-8C",
            "NVIDIA H100XM-10C",
            "NVIDIA H100XM-16C",
            "NVIDIA H100XM-20C",
            "NVIDIA H100XM-40C",
            "NVIDIA H100XM-80C"
        ]
    );
    assert_eq!(c.available("NVIDIA H100XM-4C"), 20);
    assert_eq!(c.available("NVIDIA H100XM-16C"), 5);
}

#[test]
fn pf_mdevs_follow_available_instances() {
    let mut t4 = PciDevice {
        driver: Some("nvidia".into()),
        mdev_parent: true,
        ..PciDevice::new(a("0000:3b:00.0"), 0x10de, 0x1eb8, 0x030200)
    };
    t4.mdev_types = vec![
        mdev_type(("nvidia-230", "GRID T4-1Q", 1024, 16), 15),
        mdev_type(("nvidia-232", "GRID T4-4Q", 4096, 4), 0),
    ];
    let mut inv = inventory([t4]);
    inv.mdevs.insert(
        "u".into(),
        MdevDevice {
            uuid: "u".into(),
            type_id: "nvidia-230".into(),
            type_name: Some("GRID T4-1Q".into()),
            parent: "0000:3b:00.0".into(),
            parent_pci: Some(a("0000:3b:00.0")),
            iommu_group: None,
            driver: None,
            vfio_cdev: None,
        },
    );
    let c = capacity(&inv, &a("0000:3b:00.0"));
    assert_eq!(c.mode, Mode::MdevPf);
    assert_eq!(c.available("GRID T4-1Q"), 15);
    assert_eq!(c.get("GRID T4-1Q").unwrap().parents, ["0000:3b:00.0"]);
    assert_eq!(c.available("GRID T4-4Q"), 0);
    assert_eq!(capacity(&inv, &a("0000:99:00.0")).mode, Mode::None);
}

#[test]
fn mixing_rules() {
    assert_eq!(mix_conflict(true, 1, &[4096]), None);
    assert!(
        mix_conflict(true, 2, &[4096, 4096])
            .unwrap()
            .contains("one vGPU type")
    );
    assert_eq!(
        mix_conflict(false, 2, &[4096, 4096]),
        None,
        "same size mixes"
    );
    assert!(
        mix_conflict(false, 2, &[4096, 8192])
            .unwrap()
            .contains("4096, 8192 MiB")
    );
}

#[test]
fn framebuffer_from_sysfs_text() {
    assert_eq!(
        framebuffer_from_description(Some(
            "num_heads=4, frl_config=60, framebuffer=4096M, max_resolution=7680x4320, max_instance=6"
        )),
        Some(4096)
    );
    assert_eq!(framebuffer_from_name("GRID A100DX-1-10C"), Some(10240));
    assert_eq!(framebuffer_from_name("NVIDIA L40S-48Q"), Some(49152));
    assert_eq!(framebuffer_from_name("mtty-2"), None);
}

mod lifecycle_tests {
    use super::*;
    use crate::vgpu::lifecycle::{Handle, Member, NoRoom, offers};

    #[test]
    fn a_vgpu_is_placed_on_a_free_vf_and_another_size_is_refused_naming_both() {
        let inv = two_a10s_with_vfs(2);
        let gpu = Member::Gpu(a("0000:41:00.0"));
        let o = offers(&inv, &gpu).unwrap();
        assert!(!o.vendor && o.needs_vfs.is_none());
        let four = o.find(|t| t.name == "NVIDIA A10-4Q").unwrap();
        let p = o.place(four).unwrap();
        assert_eq!(p.type_id, "nvidia-593");
        assert_eq!(p.parent, "0000:41:00.6", "the first VF without an mdev");
        assert!(
            matches!(p.handle, Handle::Mdev(ref u) if u.len() == 36),
            "{p:?}"
        );
        let eight = o.find(|t| t.name == "NVIDIA A10-8Q").unwrap();
        let e = o.place(eight).unwrap_err();
        assert!(matches!(e, NoRoom::Mixed { .. }), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("0000:41:00.0") && e.contains("NVIDIA A10-4Q") && e.contains("A10-8Q"),
            "{e}"
        );
        assert_eq!(
            o.not_offered("A10-2B").to_string(),
            "GPU 0000:41:00.0 offers no vGPU type A10-2B (it offers NVIDIA A10-4Q, NVIDIA A10-8Q)"
        );
    }

    #[test]
    fn the_vendor_path_places_on_the_vf_and_a_full_gpu_says_what_it_has() {
        let inv = h100(&[]);
        let gpu = Member::Gpu(a("0000:18:00.0"));
        let o = offers(&inv, &gpu).unwrap();
        assert!(o.vendor);
        let t = o.types[0].clone();
        let p = o.place(&t).unwrap();
        assert_eq!(p.handle, Handle::Vf(p.parent.parse().unwrap()));
        let full = crate::vgpu::Creatable {
            parents: Vec::new(),
            available: 0,
            ..t
        };
        let e = o.place(&full).unwrap_err();
        assert!(
            matches!(e, NoRoom::Full(ref m) if m.contains("cannot host another")),
            "{e:?}"
        );
        // A GPU whose VFs are off asks for them first and offers nothing yet.
        let (g, _) = pf("0000:41:00.0", 0x2236, 0);
        let o = offers(&inventory([g]), &Member::Gpu(a("0000:41:00.0"))).unwrap();
        assert_eq!((o.needs_vfs, o.types.len()), (Some(32), 0));
    }

    #[test]
    fn a_handle_is_recorded_as_handle_and_vendor_and_a_bad_vf_is_refused() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct R {
            #[serde(flatten)]
            h: Handle,
        }
        let vf = R {
            h: Handle::Vf(a("0000:41:00.4")),
        };
        let text = serde_json::to_string(&vf).unwrap();
        assert_eq!(text, r#"{"handle":"0000:41:00.4","vendor":true}"#);
        assert_eq!(serde_json::from_str::<R>(&text).unwrap(), vf);
        let m: R = serde_json::from_str(r#"{"handle":"u-1","vendor":false}"#).unwrap();
        assert_eq!(m.h, Handle::Mdev("u-1".into()));
        let e = serde_json::from_str::<R>(r#"{"handle":"u-1","vendor":true}"#).unwrap_err();
        assert!(e.to_string().contains("not a VF"), "{e}");
    }
}
