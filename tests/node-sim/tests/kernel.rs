//! Each kernel effect of node-sim, by plain file operations on the mount.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;
use support::*;

const GPU: &str = "0000:41:00.0";
const GPU_DIR: &str = "sys/bus/pci/devices/0000:41:00.0";

#[test]
fn bind_a10_to_vfio_pci_with_shell_style_writes() {
    let Some(m) = mount("2xA10") else { return };
    assert_eq!(m.r(&format!("{GPU_DIR}/vendor")), "0x10de");
    assert_eq!(m.r(&format!("{GPU_DIR}/device")), "0x2236");
    assert_eq!(m.r(&format!("{GPU_DIR}/class")), "0x030200");
    assert_eq!(
        m.r(&format!("{GPU_DIR}/modalias")),
        "pci:v000010DEd00002236sv000010DEsd00001482bc03sc02i00"
    );
    assert_eq!(m.r(&format!("{GPU_DIR}/driver_override")), "(null)");
    assert_eq!(
        m.link(&format!("{GPU_DIR}/driver")),
        "../../../../bus/pci/drivers/nvidia"
    );
    assert_eq!(
        m.link(&format!("{GPU_DIR}/iommu_group")),
        "../../../../kernel/iommu_groups/21"
    );
    assert!(m.exists("dev/nvidia0"));
    assert_eq!(m.ls("dev/vfio"), ["vfio"]);

    m.w(&format!("{GPU_DIR}/driver_override"), "vfio-pci")
        .unwrap();
    assert_eq!(m.r(&format!("{GPU_DIR}/driver_override")), "vfio-pci");
    // An override does not move a bound device.
    assert_eq!(m.driver(GPU).as_deref(), Some("nvidia"));
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    assert_eq!(m.driver(GPU), None);
    assert!(!m.exists("sys/bus/pci/drivers/nvidia/0000:41:00.0"));
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    assert_eq!(
        m.link(&format!("{GPU_DIR}/driver")),
        "../../../../bus/pci/drivers/vfio-pci"
    );
    assert!(m.exists("sys/bus/pci/drivers/vfio-pci/0000:41:00.0"));
    assert_eq!(m.ls("dev/vfio"), ["21", "vfio"]);
    assert!(!m.exists("dev/nvidia0"), "nvidia node of a GPU on vfio-pci");
    assert!(m.exists("dev/nvidia1"));
    // The device dir resolves to the real-looking place behind its root port.
    let real = std::fs::canonicalize(m.p(GPU_DIR)).unwrap();
    assert_eq!(
        real,
        m.p("sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0")
    );

    // Back: unbind from vfio-pci (node goes), clear the override, reprobe -> nvidia.
    m.w("sys/bus/pci/drivers/vfio-pci/unbind", GPU).unwrap();
    assert_eq!(m.ls("dev/vfio"), ["vfio"]);
    assert_eq!(m.r(&format!("{GPU_DIR}/driver_override")), "vfio-pci");
    m.w(&format!("{GPU_DIR}/driver_override"), "").unwrap();
    assert_eq!(m.r(&format!("{GPU_DIR}/driver_override")), "(null)");
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    assert_eq!(m.driver(GPU).as_deref(), Some("nvidia"));
}

#[test]
fn binding_errnos_match_the_kernel() {
    let Some(m) = mount("2xA10") else { return };
    // bind while bound elsewhere, no override: no match.
    assert_eq!(m.w("sys/bus/pci/drivers/vfio-pci/bind", GPU), Err(ENODEV));
    // unbind from a driver it is not on.
    assert_eq!(m.w("sys/bus/pci/drivers/vfio-pci/unbind", GPU), Err(ENODEV));
    assert_eq!(
        m.w("sys/bus/pci/drivers/nvidia/unbind", "0000:99:00.0"),
        Err(ENODEV)
    );
    // drivers_probe: garbage and unknown BDF.
    assert_eq!(m.w("sys/bus/pci/drivers_probe", "garbage"), Err(ENODEV));
    assert_eq!(
        m.w("sys/bus/pci/drivers_probe", "0000:99:00.0"),
        Err(ENODEV)
    );
    // A bound device: ok, nothing changes.
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    assert_eq!(m.driver(GPU).as_deref(), Some("nvidia"));
    // An unknown driver name in driver_override: ok, device stays.
    m.w(&format!("{GPU_DIR}/driver_override"), "no-such-driver")
        .unwrap();
    assert_eq!(m.r(&format!("{GPU_DIR}/driver_override")), "no-such-driver");
    assert_eq!(m.driver(GPU).as_deref(), Some("nvidia"));
    // Unbound with no override: bind to vfio-pci finds no id match.
    m.w(&format!("{GPU_DIR}/driver_override"), "").unwrap();
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    assert_eq!(m.w("sys/bus/pci/drivers/vfio-pci/bind", GPU), Err(ENODEV));
    // With the override, bind works.
    m.w(&format!("{GPU_DIR}/driver_override"), "vfio-pci")
        .unwrap();
    m.w("sys/bus/pci/drivers/vfio-pci/bind", GPU).unwrap();
    assert_eq!(m.driver(GPU).as_deref(), Some("vfio-pci"));
    // Reading a write-only attribute.
    let e = std::fs::read(m.p("sys/bus/pci/drivers/vfio-pci/bind")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EACCES));
    // Writing a read-only one.
    assert_eq!(m.w(&format!("{GPU_DIR}/vendor"), "0x1234"), Err(EACCES));
}

#[test]
fn vfio_group_open_is_exclusive_and_shows_in_proc() {
    let Some(m) = mount("2xA10") else { return };
    m.w(&format!("{GPU_DIR}/driver_override"), "vfio-pci")
        .unwrap();
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    let f = std::fs::File::open(m.p("dev/vfio/21")).unwrap();
    let e = std::fs::File::open(m.p("dev/vfio/21")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EBUSY));
    let me = std::process::id().to_string();
    let fds = m.ls(&format!("proc/{me}/fd"));
    assert_eq!(fds.len(), 1);
    assert_eq!(m.link(&format!("proc/{me}/fd/{}", fds[0])), "/dev/vfio/21");
    assert!(!m.r(&format!("proc/{me}/comm")).is_empty());
    drop(f);
    assert!(!m.exists(&format!("proc/{me}")));
    let _again = std::fs::File::open(m.p("dev/vfio/21")).unwrap();
}

#[test]
fn a10_vfs_and_an_a10_4q_mdev_look_like_a_real_host() {
    let Some(m) = mount("2xA10") else { return };
    assert_eq!(m.r(&format!("{GPU_DIR}/sriov_totalvfs")), "32");
    assert_eq!(m.r(&format!("{GPU_DIR}/sriov_numvfs")), "0");
    assert!(
        m.ls("sys/class/mdev_bus").is_empty(),
        "A10 PF is not an mdev parent"
    );
    m.w(&format!("{GPU_DIR}/sriov_numvfs"), "32").unwrap();
    assert_eq!(m.r(&format!("{GPU_DIR}/sriov_numvfs")), "32");
    assert_eq!(m.link(&format!("{GPU_DIR}/virtfn0")), "../0000:41:00.4");
    assert_eq!(m.link(&format!("{GPU_DIR}/virtfn31")), "../0000:41:04.3");
    let vf = "sys/bus/pci/devices/0000:41:00.4";
    assert_eq!(m.link(&format!("{vf}/physfn")), "../0000:41:00.0");
    assert_eq!(m.r(&format!("{vf}/device")), "0x2236");
    assert_eq!(m.driver("0000:41:00.4").as_deref(), Some("nvidia"));
    let g0 = m.link(&format!("{vf}/iommu_group"));
    let g1 = m.link("sys/bus/pci/devices/0000:41:00.5/iommu_group");
    assert_ne!(g0, g1, "each VF its own group");
    assert_eq!(m.ls("sys/class/mdev_bus").len(), 32);

    let t = "sys/class/mdev_bus/0000:41:00.4/mdev_supported_types/nvidia-593";
    assert_eq!(m.r(&format!("{t}/name")), "NVIDIA A10-4Q");
    assert_eq!(m.r(&format!("{t}/available_instances")), "1");
    assert_eq!(m.r(&format!("{t}/device_api")), "vfio-pci");
    assert!(
        m.r(&format!("{t}/description"))
            .contains("framebuffer=4096M")
    );
    let uuid = "5a3b2c1d-0000-4000-8000-00000000abcd";
    m.w(&format!("{t}/create"), uuid).unwrap();
    let md = format!("sys/bus/mdev/devices/{uuid}");
    assert_eq!(
        std::fs::canonicalize(m.p(&md)).unwrap(),
        m.p(&format!(
            "sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/{uuid}"
        ))
    );
    assert_eq!(
        m.link(&format!("{md}/mdev_type")),
        "../mdev_supported_types/nvidia-593"
    );
    assert!(
        m.link(&format!("{md}/driver"))
            .ends_with("bus/mdev/drivers/vfio_mdev")
    );
    let group = m.link(&format!("{md}/iommu_group"));
    let group = group.rsplit('/').next().unwrap();
    assert!(m.exists(&format!("dev/vfio/{group}")));
    assert_eq!(m.ls(&format!("{t}/devices")), [uuid]);
    assert_eq!(m.r(&format!("{t}/available_instances")), "0");
    assert!(m.ls(&format!("sys/kernel/iommu_groups/{group}/devices")) == [uuid]);

    // Remove: 0 is a no-op, garbage EINVAL, 1 removes.
    m.w(&format!("{md}/remove"), "0").unwrap();
    assert!(m.exists(&md));
    assert_eq!(m.w(&format!("{md}/remove"), "yes"), Err(EINVAL));
    let e = std::fs::read(m.p(&format!("{md}/remove"))).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EACCES));
    m.w(&format!("{md}/remove"), "1").unwrap();
    assert!(!m.exists(&md));
    assert!(!m.exists(&format!("dev/vfio/{group}")));
    assert_eq!(m.r(&format!("{t}/available_instances")), "1");
}

#[test]
fn mdev_create_errnos() {
    let Some(m) = mount("4xT4") else { return };
    let base = "sys/class/mdev_bus/0000:3b:00.0/mdev_supported_types";
    let q1 = format!("{base}/nvidia-230");
    assert_eq!(m.w(&format!("{q1}/create"), "not-a-uuid"), Err(EINVAL));
    let e = std::fs::read(m.p(&format!("{q1}/create"))).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EACCES));
    // Upper case accepted, stored lower case.
    m.w(
        &format!("{q1}/create"),
        "AAAAAAAA-0000-4000-8000-000000000001",
    )
    .unwrap();
    assert!(m.exists("sys/bus/mdev/devices/aaaaaaaa-0000-4000-8000-000000000001"));
    // Duplicate, same type and another parent's type.
    assert_eq!(
        m.w(
            &format!("{q1}/create"),
            "aaaaaaaa-0000-4000-8000-000000000001"
        ),
        Err(EEXIST)
    );
    assert_eq!(
        m.w(
            "sys/class/mdev_bus/0000:5e:00.0/mdev_supported_types/nvidia-234/create",
            "aaaaaaaa-0000-4000-8000-000000000001"
        ),
        Err(EEXIST)
    );
    // T4-16Q: one per GPU, then ENOSPC.
    let q16 = "sys/class/mdev_bus/0000:5e:00.0/mdev_supported_types/nvidia-234";
    m.w(
        &format!("{q16}/create"),
        "bbbbbbbb-0000-4000-8000-000000000001",
    )
    .unwrap();
    assert_eq!(m.r(&format!("{q16}/available_instances")), "0");
    assert_eq!(
        m.w(
            &format!("{q16}/create"),
            "bbbbbbbb-0000-4000-8000-000000000002"
        ),
        Err(ENOSPC)
    );
}

#[test]
fn t4_one_size_rule() {
    let Some(m) = mount("4xT4") else { return };
    let base = "sys/class/mdev_bus/0000:3b:00.0/mdev_supported_types";
    assert_eq!(m.r(&format!("{base}/nvidia-230/available_instances")), "16");
    assert_eq!(m.r(&format!("{base}/nvidia-232/available_instances")), "4");
    m.w(
        &format!("{base}/nvidia-230/create"),
        "11111111-0000-4000-8000-000000000001",
    )
    .unwrap();
    assert_eq!(m.r(&format!("{base}/nvidia-230/available_instances")), "15");
    for other in [
        "nvidia-222",
        "nvidia-231",
        "nvidia-232",
        "nvidia-234",
        "nvidia-319",
    ] {
        assert_eq!(
            m.r(&format!("{base}/{other}/available_instances")),
            "0",
            "{other}"
        );
    }
    assert_eq!(
        m.w(
            &format!("{base}/nvidia-232/create"),
            "11111111-0000-4000-8000-000000000002"
        ),
        Err(ENOSPC)
    );
    // Another T4 is untouched.
    assert_eq!(
        m.r("sys/class/mdev_bus/0000:5e:00.0/mdev_supported_types/nvidia-232/available_instances"),
        "4"
    );
}

#[test]
fn a10_one_size_across_vfs_and_per_type_cap() {
    let Some(m) = mount("2xA10") else { return };
    m.w(&format!("{GPU_DIR}/sriov_numvfs"), "32").unwrap();
    let ty = |vf: &str, t: &str| format!("sys/class/mdev_bus/{vf}/mdev_supported_types/{t}");
    let vfs: Vec<String> = m
        .ls("sys/class/mdev_bus")
        .into_iter()
        .filter(|v| v.starts_with("0000:41:"))
        .collect();
    assert_eq!(vfs.len(), 32);
    m.w(
        &format!("{}/create", ty(&vfs[0], "nvidia-593")),
        "22222222-0000-4000-8000-000000000000",
    )
    .unwrap();
    // The used VF offers nothing more; other VFs offer 4 GB types only.
    assert_eq!(
        m.r(&format!(
            "{}/available_instances",
            ty(&vfs[0], "nvidia-593")
        )),
        "0"
    );
    assert_eq!(
        m.r(&format!(
            "{}/available_instances",
            ty(&vfs[1], "nvidia-593")
        )),
        "1"
    );
    assert_eq!(
        m.r(&format!(
            "{}/available_instances",
            ty(&vfs[1], "nvidia-601")
        )),
        "1"
    ); // 4A
    assert_eq!(
        m.r(&format!(
            "{}/available_instances",
            ty(&vfs[1], "nvidia-592")
        )),
        "0"
    ); // 3Q
    assert_eq!(
        m.r(&format!(
            "{}/available_instances",
            ty(&vfs[1], "nvidia-597")
        )),
        "0"
    ); // 24Q
    assert_eq!(
        m.w(
            &format!("{}/create", ty(&vfs[1], "nvidia-591")),
            "22222222-0000-4000-8000-000000000099"
        ),
        Err(ENOSPC)
    );
    // A10-4Q: at most 6 per GPU although 32 VFs.
    for (i, vf) in vfs.iter().enumerate().take(6).skip(1) {
        m.w(
            &format!("{}/create", ty(vf, "nvidia-593")),
            &format!("22222222-0000-4000-8000-00000000000{i}"),
        )
        .unwrap();
    }
    assert_eq!(
        m.r(&format!(
            "{}/available_instances",
            ty(&vfs[6], "nvidia-593")
        )),
        "0"
    );
    assert_eq!(
        m.w(
            &format!("{}/create", ty(&vfs[6], "nvidia-593")),
            "22222222-0000-4000-8000-000000000007"
        ),
        Err(ENOSPC)
    );
    assert_eq!(m.ls("sys/bus/mdev/devices").len(), 6);
    // The other A10 is not affected (its VFs are not even enabled).
    assert_eq!(m.r("sys/bus/pci/devices/0000:61:00.0/sriov_numvfs"), "0");
}

#[test]
fn sriov_numvfs_errnos() {
    let Some(m) = mount("2xA10") else { return };
    let f = format!("{GPU_DIR}/sriov_numvfs");
    assert_eq!(m.w(&f, "33"), Err(libc::ERANGE));
    assert_eq!(m.w(&f, "many"), Err(EINVAL));
    m.w(&f, "4").unwrap();
    m.w(&f, "4").unwrap();
    assert_eq!(m.w(&f, "8"), Err(EBUSY));
    m.w(
        "sys/class/mdev_bus/0000:41:00.5/mdev_supported_types/nvidia-593/create",
        "33333333-0000-4000-8000-000000000000",
    )
    .unwrap();
    m.w(&f, "0").unwrap();
    assert!(!m.exists("sys/bus/pci/devices/0000:41:00.4"));
    assert!(!m.exists(&format!("{GPU_DIR}/virtfn0")));
    assert!(m.ls("sys/bus/mdev/devices").is_empty());
    m.w(&f, "8").unwrap();
    assert_eq!(m.ls("sys/class/mdev_bus").len(), 8);
}

#[test]
fn vgpu_types_exist_only_while_on_nvidia() {
    let Some(m) = mount("4xT4") else { return };
    let gpu = "0000:3b:00.0";
    let types = format!("sys/bus/pci/devices/{gpu}/mdev_supported_types");
    m.w(
        &format!("{types}/nvidia-232/create"),
        "44444444-0000-4000-8000-000000000000",
    )
    .unwrap();
    m.w("sys/bus/pci/drivers/nvidia/unbind", gpu).unwrap();
    assert!(!m.exists(&types));
    assert!(!m.exists(&format!("sys/class/mdev_bus/{gpu}")));
    assert!(
        m.ls("sys/bus/mdev/devices").is_empty(),
        "mdevs go with the driver"
    );
    m.w("sys/bus/pci/drivers_probe", gpu).unwrap();
    assert_eq!(m.r(&format!("{types}/nvidia-232/available_instances")), "4");
}

#[test]
fn vendor_path_on_h100() {
    let Some(m) = mount("8xH100-sriov") else {
        return;
    };
    let pf = "sys/bus/pci/devices/0000:13:00.0";
    assert!(
        !m.exists(&format!("{pf}/nvidia")),
        "the PF has no nvidia/ directory"
    );
    assert!(!m.exists(&format!("{pf}/mdev_supported_types")));
    m.w(&format!("{pf}/sriov_numvfs"), "4").unwrap();
    let vf = |n: u32| format!("sys/bus/pci/devices/0000:13:00.{}", 4 + n);
    let creatable = m.r(&format!("{}/nvidia/creatable_vgpu_types", vf(0)));
    let lines: Vec<&str> = creatable.lines().collect();
    assert_eq!(lines[0], "ID    : vGPU Name");
    assert!(lines.contains(&"1003  : NVIDIA H100XM-10C"), "{creatable}");
    assert!(lines.contains(&"1007  : NVIDIA H100XM-80C"), "{creatable}");
    assert!(!creatable.contains("1-10C"), "MIG types are not offered");
    assert_eq!(m.r(&format!("{}/nvidia/current_vgpu_type", vf(0))), "0");
    let cur = |n| format!("{}/nvidia/current_vgpu_type", vf(n));
    assert_eq!(m.w(&cur(0), "4242"), Err(EINVAL));
    assert_eq!(m.w(&cur(0), "x"), Err(EINVAL));
    let group = |n: u32| {
        std::fs::read_link(m.root().join(vf(n)).join("iommu_group"))
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned()
    };
    assert!(
        !m.exists(&format!("dev/vfio/{}", group(0))),
        "a free VF has no VFIO node"
    );
    m.w(&cur(0), "1006").unwrap(); // 40C: max 2
    assert_eq!(m.r(&cur(0)), "1006");
    assert!(
        m.exists(&format!("dev/vfio/{}", group(0))),
        "a VF with a vGPU is registered with VFIO by the nvidia driver"
    );
    assert_eq!(m.w(&cur(0), "1006"), Err(EBUSY));
    assert_eq!(
        m.r(&format!("{}/nvidia/creatable_vgpu_types", vf(0))),
        "ID    : vGPU Name"
    );
    // Siblings collapse to the same size.
    assert_eq!(
        m.r(&format!("{}/nvidia/creatable_vgpu_types", vf(1))),
        "ID    : vGPU Name\n1006  : NVIDIA H100XM-40C"
    );
    assert_eq!(m.w(&cur(1), "1007"), Err(EINVAL));
    m.w(&cur(1), "1006").unwrap();
    // Full: header only.
    assert_eq!(
        m.r(&format!("{}/nvidia/creatable_vgpu_types", vf(2))),
        "ID    : vGPU Name"
    );
    m.w(&cur(0), "0").unwrap();
    assert_eq!(m.r(&cur(0)), "0");
    assert!(!m.exists(&format!("dev/vfio/{}", group(0))));
    assert!(
        m.r(&format!("{}/nvidia/creatable_vgpu_types", vf(2)))
            .contains("1006")
    );
}

#[test]
fn topology_file_with_a_variant_vfio_driver() {
    if support::mount("2xA10").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("grace.toml");
    std::fs::write(
        &file,
        r#"
release = "6.8.0-sim"
vfio_drivers = ["nvgrace_gpu_vfio_pci"]
modules_alias = ["alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci"]
iommufd = true
[[device]]
address = "0009:01:00.0"
vendor = 0x10de
device = 0x2342
class = 0x030200
group = 5
"#,
    )
    .unwrap();
    let topo = node_sim::topology(file.to_str().unwrap()).unwrap();
    assert_eq!(topo.name, "grace");
    let root = dir.path().join("root");
    let sim = node_sim::mount(&topo, &root).unwrap();
    let m = |p: &str| root.join(p);
    assert_eq!(
        std::fs::read_to_string(m("lib/modules/6.8.0-sim/modules.alias")).unwrap(),
        "alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci\n"
    );
    assert_eq!(
        std::fs::read_to_string(m("proc/sys/kernel/osrelease")).unwrap(),
        "6.8.0-sim\n"
    );
    assert!(m("run").is_dir() && m("var/lib/kubelet/device-plugins").is_dir());
    let d = "sys/bus/pci/devices/0009:01:00.0";
    std::fs::write(m(&format!("{d}/driver_override")), "nvgrace_gpu_vfio_pci\n").unwrap();
    std::fs::write(m("sys/bus/pci/drivers/nvidia/unbind"), "0009:01:00.0\n").unwrap();
    std::fs::write(m("sys/bus/pci/drivers_probe"), "0009:01:00.0\n").unwrap();
    assert!(
        std::fs::read_link(m(&format!("{d}/driver")))
            .unwrap()
            .ends_with("nvgrace_gpu_vfio_pci")
    );
    assert!(m("dev/vfio/5").exists());
    assert!(m("dev/iommu").exists());
    assert!(m("dev/vfio/devices/vfio0").exists());
    assert!(m(&format!("{d}/vfio-dev/vfio0")).is_dir());
    sim.unmount().unwrap();
    assert!(!m("sys/bus").exists(), "unmounted");
}
