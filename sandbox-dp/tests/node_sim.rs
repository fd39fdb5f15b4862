//! sandbox-dp as a process against node-sim and the fake kubelet.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::path::Path;
use std::time::Duration;

use support::*;
use testkit::kubelet::FakeKubelet;

const A10: &str = "nvidia.com/GA102GL_A10";
const A10_4Q: &str = "nvidia.com/NVIDIA_A10-4Q";
const GPU_A: &str = "0000:41:00.0";
const GPU_B: &str = "0000:61:00.0";

// Every daemon here runs with an hour's resync (`Daemon::start`): what a test waits for after
// changing node-sim can only come from the uevent node-sim sends for that change.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_a10s_register_list_and_allocate() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    bind_vfio(root, GPU_A);
    bind_vfio(root, GPU_B);
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let mut d = Daemon::start(root, &kdir, &[]);

    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    assert_eq!(reg.resource_name, A10);
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(reg.endpoint, "sandbox-dp-nvidia.com_GA102GL_A10.sock");
    assert!(
        reg.options
            .as_ref()
            .unwrap()
            .get_preferred_allocation_available
    );
    assert!(kdir.join(&reg.endpoint).exists());

    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut lw = plugin.list_and_watch().await.unwrap();
    let list = lw.next(DEADLINE).await.unwrap();
    assert_eq!(ids(&list), [GPU_A, GPU_B]);
    for dev in &list {
        assert_eq!(dev.health, "Healthy");
        assert_eq!(numa(dev), [0]);
    }

    let resp = plugin.allocate(&[&[GPU_A, GPU_B]]).await.unwrap();
    let c = &resp.container_responses[0];
    assert_eq!(
        c.envs
            .get("PCI_RESOURCE_NVIDIA_COM_GA102GL_A10")
            .map(String::as_str),
        Some("0000:41:00.0,0000:61:00.0")
    );
    assert_eq!(
        host_paths(c),
        ["/dev/vfio/vfio", "/dev/vfio/21", "/dev/vfio/37"]
    );
    for spec in &c.devices {
        assert_eq!(spec.permissions, "mrw");
        assert_eq!(spec.container_path, spec.host_path);
    }

    // Two containers: each gets only its own device.
    let resp = plugin.allocate(&[&[GPU_A], &[GPU_B]]).await.unwrap();
    let [c1, c2] = &resp.container_responses[..] else {
        panic!("expected two container responses: {resp:?}");
    };
    assert_eq!(host_paths(c1), ["/dev/vfio/vfio", "/dev/vfio/21"]);
    assert_eq!(host_paths(c2), ["/dev/vfio/vfio", "/dev/vfio/37"]);
    assert_eq!(
        c1.envs.get("PCI_RESOURCE_NVIDIA_COM_GA102GL_A10").unwrap(),
        GPU_A
    );
    assert_eq!(
        c2.envs.get("PCI_RESOURCE_NVIDIA_COM_GA102GL_A10").unwrap(),
        GPU_B
    );

    // Unknown ID and empty request are errors naming the problem.
    let e = plugin
        .allocate(&[&[GPU_A, "0000:99:00.0"]])
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("0000:99:00.0"), "{}", e.message());
    let e = plugin.allocate(&[&[]]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);

    // A driver change while running: the GPU leaves the list.
    unbind_vfio(root, GPU_B);
    let list = lw
        .wait_until(DEADLINE, |l| ids(l) == [GPU_A])
        .await
        .unwrap();
    assert_eq!(list.len(), 1);
    // Gone from the resource, not merely unhealthy.
    let e = plugin.allocate(&[&[GPU_B]]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message()
            .ends_with(&format!("unknown device IDs: {GPU_B}")),
        "{}",
        e.message()
    );
    bind_vfio(root, GPU_B);
    lw.wait_until(DEADLINE, |l| ids(l) == [GPU_A, GPU_B])
        .await
        .unwrap();

    let status = d.terminate();
    assert!(status.success(), "{status:?}");
    assert!(
        !kdir.join(&reg.endpoint).exists(),
        "socket left behind after SIGTERM"
    );
}

fn create_mdev(root: &Path, parent: &str, type_id: &str, uuid: &str) {
    write(
        root,
        &format!("sys/class/mdev_bus/{parent}/mdev_supported_types/{type_id}/create"),
        uuid,
    );
}

fn remove_mdev(root: &Path, uuid: &str) {
    write(root, &format!("sys/bus/mdev/devices/{uuid}/remove"), "1");
}

fn mdev_group(root: &Path, uuid: &str) -> String {
    let link =
        std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{uuid}/iommu_group"))).unwrap();
    link.file_name().unwrap().to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mdevs_created_and_removed_while_running() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let _d = Daemon::start(root, &kdir, &[]);

    // Nothing to advertise yet; vgpu-device-manager then creates two A10-4Q on GPU B.
    write(
        root,
        &format!("sys/bus/pci/devices/{GPU_B}/sriov_numvfs"),
        "4",
    );
    let name = std::fs::read_to_string(
        root.join("sys/class/mdev_bus/0000:61:00.4/mdev_supported_types/nvidia-593/name"),
    )
    .unwrap();
    assert_eq!(name.trim(), "NVIDIA A10-4Q");
    let u1 = "5a3b2c1d-0000-4000-8000-000000000001";
    let u2 = "5a3b2c1d-0000-4000-8000-000000000002";
    create_mdev(root, "0000:61:00.4", "nvidia-593", u1);
    create_mdev(root, "0000:61:00.5", "nvidia-593", u2);

    let reg = kubelet.wait_for(&[A10_4Q], DEADLINE).await.unwrap()[A10_4Q].clone();
    assert_eq!(reg.endpoint, "sandbox-dp-nvidia.com_NVIDIA_A10-4Q.sock");
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut lw = plugin.list_and_watch().await.unwrap();
    let list = lw.wait_until(DEADLINE, |l| l.len() == 2).await.unwrap();
    assert_eq!(ids(&list), [u1, u2]);
    assert!(list.iter().all(|d| d.health == "Healthy" && numa(d) == [0]));

    let resp = plugin.allocate(&[&[u1, u2]]).await.unwrap();
    let c = &resp.container_responses[0];
    assert_eq!(
        c.envs
            .get("MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q")
            .map(String::as_str),
        Some(format!("{u1},{u2}").as_str())
    );
    let (g1, g2) = (mdev_group(root, u1), mdev_group(root, u2));
    assert_eq!(
        host_paths(c),
        [
            "/dev/vfio/vfio".to_string(),
            format!("/dev/vfio/{g1}"),
            format!("/dev/vfio/{g2}")
        ]
    );
    assert!(!host_paths(c).contains(&"/dev/vfio/37".to_string()));

    // Removed one by one: the resource stays, with zero devices at the end.
    remove_mdev(root, u1);
    lw.wait_until(DEADLINE, |l| ids(l) == [u2]).await.unwrap();
    remove_mdev(root, u2);
    lw.wait_until(DEADLINE, |l| l.is_empty()).await.unwrap();
    assert!(kdir.join(&reg.endpoint).exists());

    // And back.
    create_mdev(root, "0000:61:00.6", "nvidia-593", u1);
    lw.wait_until(DEADLINE, |l| ids(l) == [u1]).await.unwrap();
}

fn control(root: &Path, command: &str) {
    write(root, "sys/kernel/node-sim/control", command);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_plugged_and_unplugged_gpus_follow_their_uevents() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    bind_vfio(root, GPU_A);
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let _d = Daemon::start(root, &kdir, &[]);
    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut lw = plugin.list_and_watch().await.unwrap();
    assert_eq!(ids(&lw.next(DEADLINE).await.unwrap()), [GPU_A]);

    // A GPU hot-plugged (on nvidia: not advertised), then bound to vfio-pci.
    let new = "0000:81:00.0";
    control(root, &format!("hotplug {new} A10 numa=1"));
    bind_vfio(root, new);
    let list = lw
        .wait_until(DEADLINE, |l| ids(l) == [GPU_A, new])
        .await
        .unwrap();
    assert_eq!(list[1].health, "Healthy");
    assert_eq!(numa(&list[1]), [1]);
    let resp = plugin.allocate(&[&[new]]).await.unwrap();
    assert_eq!(
        resp.container_responses[0]
            .envs
            .get("PCI_RESOURCE_NVIDIA_COM_GA102GL_A10")
            .map(String::as_str),
        Some(new)
    );

    // Unplugged while bound: it leaves the list and is refused.
    control(root, &format!("unplug {new}"));
    lw.wait_until(DEADLINE, |l| ids(l) == [GPU_A])
        .await
        .unwrap();
    let e = plugin.allocate(&[&[new]]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().ends_with(&format!("unknown device IDs: {new}")),
        "{}",
        e.message()
    );
    // The last one too: the resource stays, empty.
    control(root, &format!("unplug {GPU_A}"));
    lw.wait_until(DEADLINE, |l| l.is_empty()).await.unwrap();
    assert!(kdir.join(&reg.endpoint).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restarts_and_deleted_socket_are_followed() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    bind_vfio(root, GPU_A);
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let mut d = Daemon::start(root, &kdir, &[]);
    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    assert_eq!(reg.resource_name, A10);

    for i in 0..20 {
        kubelet.restart().await.unwrap();
        let got = kubelet.wait_for(&[A10], DEADLINE).await;
        assert!(got.is_ok(), "restart {i}: {:#}", got.unwrap_err());
    }
    // Each restart registered once more, not more.
    assert!(kubelet.drain().is_empty());

    // Our socket deleted: served again and registered again.
    let sock = kdir.join(&reg.endpoint);
    std::fs::remove_file(&sock).unwrap();
    kubelet.wait_for(&[A10], DEADLINE).await.unwrap();
    assert!(sock.exists());
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let list = plugin
        .list_and_watch()
        .await
        .unwrap()
        .next(DEADLINE)
        .await
        .unwrap();
    assert_eq!(ids(&list), [GPU_A]);

    // kubelet's own restart also removes the plugin sockets: served and registered again.
    for i in 0..3 {
        kubelet.restart_clearing_dir().await.unwrap();
        let got = kubelet.wait_for(&[A10], DEADLINE).await;
        assert!(got.is_ok(), "restart {i}: {:#}", got.unwrap_err());
        let end = std::time::Instant::now() + DEADLINE;
        while !sock.exists() && std::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(sock.exists());
    }

    // kubelet gone for a while, then back: registered again.
    kubelet.stop().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    kubelet.restart().await.unwrap();
    kubelet.wait_for(&[A10], DEADLINE).await.unwrap();

    assert!(d.terminate().success());
    assert!(!sock.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sriov_vgpu_vfs_are_pci_resources() {
    let Some(sim) = testkit::sim::try_mount("8xH100-sriov") else {
        return;
    };
    let root = sim.root();
    let pf = "0000:13:00.0";
    write(root, &format!("sys/bus/pci/devices/{pf}/sriov_numvfs"), "4");
    let vf = "0000:13:00.4";
    let types = std::fs::read_to_string(root.join(format!(
        "sys/bus/pci/devices/{vf}/nvidia/creatable_vgpu_types"
    )))
    .unwrap();
    // "ID    : vGPU Name" then "NNNN  : NVIDIA H100XM-..." lines.
    let (id, type_name) = types
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(i, n)| (i.trim().to_string(), n.trim().to_string()))
        .find(|(_, n)| !n.contains("-1-") && !n.contains("-2-"))
        .expect("a creatable type");
    write(
        root,
        &format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type"),
        &id,
    );
    let resource = format!("nvidia.com/{}", type_name.replace(' ', "_"));
    let env = format!(
        "PCI_RESOURCE_{}",
        resource.to_uppercase().replace(['/', '.'], "_")
    );

    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let _d = Daemon::start(root, &kdir, &[]);
    let reg = kubelet.wait_for(&[&resource], DEADLINE).await.unwrap()[&resource].clone();
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let list = plugin
        .list_and_watch()
        .await
        .unwrap()
        .next(DEADLINE)
        .await
        .unwrap();
    assert_eq!(ids(&list), [vf]);
    assert_eq!(numa(&list[0]), [0]);
    // The nvidia driver registers a VF holding a vGPU with VFIO itself: its group node exists
    // while it stays on nvidia, so the VF is Healthy and allocated as a PCI device.
    let group =
        std::fs::read_link(root.join(format!("sys/bus/pci/devices/{vf}/iommu_group"))).unwrap();
    let group = group.file_name().unwrap().to_str().unwrap().to_string();
    assert!(root.join(format!("dev/vfio/{group}")).exists());
    assert_eq!(list[0].health, "Healthy", "{list:?}");
    let resp = plugin.allocate(&[&[vf]]).await.unwrap();
    let c = &resp.container_responses[0];
    assert_eq!(c.envs.get(&env).map(String::as_str), Some(vf));
    assert_eq!(
        host_paths(c),
        ["/dev/vfio/vfio".to_string(), format!("/dev/vfio/{group}")]
    );

    // The vGPU removed (type 0): the VF leaves the list, on the VF's uevent alone.
    let mut lw = plugin.list_and_watch().await.unwrap();
    lw.next(DEADLINE).await.unwrap();
    write(
        root,
        &format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type"),
        "0",
    );
    lw.wait_until(DEADLINE, |l| l.is_empty()).await.unwrap();
    assert!(!root.join(format!("dev/vfio/{group}")).exists());
    write(
        root,
        &format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type"),
        &id,
    );
    let list = lw.wait_until(DEADLINE, |l| l.len() == 1).await.unwrap();
    assert_eq!(list[0].health, "Healthy", "{list:?}");

    let out = run(&["permitted-devices"], root);
    assert!(out.status.success());
    let yaml = String::from_utf8_lossy(&out.stdout);
    assert!(yaml.contains("pciVendorSelector: \"10DE:"), "{yaml}");
    assert!(
        yaml.contains(&format!("resourceName: \"{resource}\"")),
        "{yaml}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_follows_numa_and_switches_on_8xa100() {
    let Some(sim) = testkit::sim::try_mount("8xA100") else {
        return;
    };
    let root = sim.root();
    let gpus = [
        "0000:13:00.0",
        "0000:14:00.0",
        "0000:33:00.0",
        "0000:34:00.0",
        "0000:93:00.0",
        "0000:94:00.0",
        "0000:b3:00.0",
        "0000:b4:00.0",
    ];
    for g in gpus {
        bind_vfio(root, g);
    }
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let _d = Daemon::start(root, &kdir, &[]);
    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    assert_eq!(reg.resource_name, "nvidia.com/GA100_A100_SXM4_80GB");
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let list = plugin
        .list_and_watch()
        .await
        .unwrap()
        .next(DEADLINE)
        .await
        .unwrap();
    let numas: Vec<Vec<i64>> = list.iter().map(numa).collect();
    assert_eq!(numas, [[0], [0], [0], [0], [1], [1], [1], [1]]);

    // Two from everything: a pair under one switch.
    let got = plugin.preferred(&gpus, &[], 2).await.unwrap();
    assert_eq!(got, ["0000:13:00.0", "0000:14:00.0"]);
    // 14 is taken: the next whole switch, not 13 + a stranger.
    let avail: Vec<&str> = gpus
        .iter()
        .copied()
        .filter(|g| *g != "0000:14:00.0")
        .collect();
    let got = plugin.preferred(&avail, &[], 2).await.unwrap();
    assert_eq!(got, ["0000:33:00.0", "0000:34:00.0"]);
    // Four: one whole NUMA node (node 0 has only three left).
    let got = plugin.preferred(&avail, &[], 4).await.unwrap();
    assert_eq!(got, &gpus[4..]);
    // Must-include first, then its switch partner.
    let got = plugin.preferred(&gpus, &["0000:b4:00.0"], 2).await.unwrap();
    assert_eq!(got, ["0000:b4:00.0", "0000:b3:00.0"]);
    // Must-include on NUMA 1, three: the rest come from NUMA 1.
    let got = plugin.preferred(&gpus, &["0000:94:00.0"], 3).await.unwrap();
    assert_eq!(got[..2], ["0000:94:00.0", "0000:93:00.0"]);
    assert!(
        got[2] == "0000:b3:00.0" || got[2] == "0000:b4:00.0",
        "{got:?}"
    );
}

#[test]
fn list_and_permitted_devices_on_2xa10() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    bind_vfio(root, GPU_A);
    write(
        root,
        &format!("sys/bus/pci/devices/{GPU_B}/sriov_numvfs"),
        "2",
    );
    let u = "5a3b2c1d-0000-4000-8000-0000000000aa";
    create_mdev(root, "0000:61:00.4", "nvidia-593", u);

    let out = run(&["list", "--json"], root);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let res = v["resources"].as_array().unwrap();
    let names: Vec<&str> = res.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, [A10, A10_4Q]);
    assert_eq!(res[0]["devices"][0]["id"], GPU_A);
    assert_eq!(res[0]["devices"][0]["health"], "Healthy");
    assert_eq!(res[0]["devices"][0]["numa_node"], 0);
    assert_eq!(res[0]["devices"][0]["iommu_group"], 21);
    assert_eq!(res[0]["env"], "PCI_RESOURCE_NVIDIA_COM_GA102GL_A10");
    assert_eq!(res[1]["devices"][0]["id"], u);
    // An mdev on a VF belongs to the VF's physical GPU.
    assert_eq!(res[1]["devices"][0]["gpu"], GPU_B);
    assert_eq!(res[1]["env"], "MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q");

    let out = run(&["list"], root);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(A10) && text.contains(GPU_A) && text.contains(u),
        "{text}"
    );

    let out = run(&["permitted-devices"], root);
    assert!(out.status.success());
    let yaml = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        yaml,
        "permittedHostDevices:\n  pciHostDevices:\n    - pciVendorSelector: \"10DE:2236\"\n      resourceName: \"nvidia.com/GA102GL_A10\"\n      externalResourceProvider: true\n  mediatedDevices:\n    - mdevNameSelector: \"NVIDIA A10-4Q\"\n      resourceName: \"nvidia.com/NVIDIA_A10-4Q\"\n      externalResourceProvider: true\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_packs_vgpus_onto_fewest_gpus_on_8xa100() {
    let Some(sim) = testkit::sim::try_mount("8xA100") else {
        return;
    };
    let root = sim.root();
    // Three A100DX-4C on GPU 13, two on GPU 14 (same switch, NUMA 0), one on GPU 93 (NUMA 1).
    let mut made: Vec<(String, &str)> = Vec::new();
    for (pf, vf_prefix, n) in [
        ("0000:13:00.0", "0000:13:00", 3),
        ("0000:14:00.0", "0000:14:00", 2),
        ("0000:93:00.0", "0000:93:00", 1),
    ] {
        write(root, &format!("sys/bus/pci/devices/{pf}/sriov_numvfs"), "4");
        for i in 0..n {
            let vf = format!("{vf_prefix}.{}", 4 + i);
            let uuid = format!("00000000-0000-4000-8000-{}{i:02}", &pf[5..7].repeat(5));
            create_mdev(root, &vf, "nvidia-615", &uuid);
            made.push((uuid, pf));
        }
    }
    let name = "nvidia.com/GRID_A100DX-4C";
    let on = |pf: &str| -> Vec<String> {
        made.iter()
            .filter(|(_, p)| *p == pf)
            .map(|(u, _)| u.clone())
            .collect()
    };
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let _d = Daemon::start(root, &kdir, &[]);
    let reg = kubelet.wait_for(&[name], DEADLINE).await.unwrap()[name].clone();
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let list = plugin
        .list_and_watch()
        .await
        .unwrap()
        .next(DEADLINE)
        .await
        .unwrap();
    assert_eq!(list.len(), 6);
    let all: Vec<&str> = made.iter().map(|(u, _)| u.as_str()).collect();

    // Two: the GPU with exactly two free, not one from each.
    let got = plugin.preferred(&all, &[], 2).await.unwrap();
    assert_eq!(got, on("0000:14:00.0"));
    // Three: all on GPU 13.
    let got = plugin.preferred(&all, &[], 3).await.unwrap();
    assert_eq!(got, on("0000:13:00.0"));
    // Must-include one of GPU 13's: the rest from GPU 13 too.
    let first13 = on("0000:13:00.0")[0].clone();
    let got = plugin.preferred(&all, &[&first13], 3).await.unwrap();
    assert_eq!(got, on("0000:13:00.0"));
}
