//! The usage model against a fake kubelet: its PodResources API on a Unix socket, and its
//! checkpoint written in kubelet's shape.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed setup step should panic

use common::usage::{PodSource, Source};
use common::{HostPaths, Inventory, Usage, User};
use fake_kubelet::FakePodResources;
use fake_kubelet::checkpoint::{self, entry};
use fake_kubelet::pod_resources::{ClaimDevice, pod, pod_with_claim};

const UUID: &str = "5a3b2c1d-0000-4000-8000-00000000abcd";
const RESOURCE: &str = "nvidia.com/NVIDIA_A10-4Q";

fn mdev() -> common::MdevDevice {
    common::MdevDevice {
        uuid: UUID.into(),
        type_id: "nvidia-593".into(),
        type_name: Some("NVIDIA A10-4Q".into()),
        parent: "0000:61:00.4".into(),
        parent_pci: Some("0000:61:00.4".parse().unwrap()),
        iommu_group: Some(120),
        driver: None,
        vfio_cdev: None,
    }
}

/// A host root with no processes and a kubelet directory holding a checkpoint that gives the
/// mdev to pod `gone`.
fn root() -> (tempfile::TempDir, HostPaths) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("proc")).unwrap();
    let paths = HostPaths::new(dir.path());
    checkpoint::write(
        paths.kubelet_dir(),
        &[entry("gone", "compute", RESOURCE, &[&UUID.to_uppercase()])],
    )
    .unwrap();
    (dir, paths)
}

fn users(paths: &HostPaths) -> Vec<User> {
    Usage::read(paths).of_mdev(&mdev())
}

#[test]
fn the_pod_resources_api_is_authoritative_over_the_checkpoint() {
    let (_dir, paths) = root();
    let fake = FakePodResources::spawn(&paths.pod_resources_socket()).unwrap();
    // kubelet runs no pod with it: the checkpoint's entry is a pod that is gone.
    assert_eq!(users(&paths), vec![]);
    fake.set_pods(vec![pod(
        "vms",
        "virt-launcher-a",
        "compute",
        RESOURCE,
        &[UUID],
    )]);
    let u = Usage::read(&paths);
    assert!(u.pods_source.contains("PodResources"), "{}", u.pods_source);
    let found = u.of_mdev(&mdev());
    assert_eq!(found.len(), 1, "{found:?}");
    let User::Pod(p) = &found[0] else {
        panic!("{found:?}")
    };
    assert_eq!(p.source, PodSource::PodResources);
    assert_eq!(
        found[0].to_string(),
        "pod vms/virt-launcher-a (container compute, nvidia.com/NVIDIA_A10-4Q) has it"
    );
    // A PCI address listed under any resource name counts too.
    fake.set_pods(vec![pod(
        "x",
        "y",
        "c",
        "example.com/anything",
        &["0000:41:00.0"],
    )]);
    let inv = Inventory::default();
    let u = Usage::read(&paths).of_function(&inv, &"0000:41:00.0".parse().unwrap());
    assert_eq!(u.len(), 1, "{u:?}");
    // One List per reading, however many devices are asked about.
    assert_eq!(fake.list_calls(), 3);
}

#[test]
fn a_list_that_fails_is_unknown_not_the_checkpoint() {
    let (_dir, paths) = root();
    let fake = FakePodResources::spawn(&paths.pod_resources_socket()).unwrap();
    fake.fail_with(Some("podresources: rate limit exceeded"));
    let found = users(&paths);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].is_unknown_from(Source::Kubelet), "{found:?}");
    let s = found[0].to_string();
    assert!(s.contains("does not answer List"), "{s}");
    assert!(s.contains("rate limit exceeded"), "{s}");
}

#[test]
fn a_kubelet_that_is_down_leaves_the_checkpoint_to_answer() {
    let (_dir, paths) = root();
    let mut fake = FakePodResources::spawn(&paths.pod_resources_socket()).unwrap();
    fake.stop();
    assert!(
        paths.pod_resources_socket().exists(),
        "a stale socket is left"
    );
    let found = users(&paths);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        found[0].to_string(),
        "pod gone (container compute, nvidia.com/NVIDIA_A10-4Q; kubelet's checkpoint) has it"
    );
    // No socket at all: the same.
    std::fs::remove_file(paths.pod_resources_socket()).unwrap();
    assert_eq!(users(&paths), found);
}

#[tokio::test(flavor = "current_thread")]
async fn usage_can_be_read_on_a_blocking_thread_of_a_runtime() {
    let (_dir, paths) = root();
    let fake = FakePodResources::start(&paths.pod_resources_socket())
        .await
        .unwrap();
    fake.set_pods(vec![pod("vms", "a", "compute", RESOURCE, &[UUID])]);
    // The fake is served by this very thread's runtime: the call must not block it, which a
    // blocking List here would. So read on a blocking thread, as daemons do.
    let p = paths.clone();
    let found = tokio::task::spawn_blocking(move || users(&p))
        .await
        .unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
}

/// Two A10s in groups 21 and 37, each with its own function only.
fn two_gpus() -> Inventory {
    let mut inv = Inventory::default();
    for (a, g) in [("0000:41:00.0", 21), ("0000:61:00.0", 37)] {
        let mut d = common::PciDevice::new(a.parse().unwrap(), 0x10de, 0x2236, 0x030200);
        d.driver = Some("vfio-pci".into());
        d.iommu_group = Some(g);
        inv.devices.insert(d.address, d);
    }
    inv
}

const DRIVER: &str = "gpu.gpu-vm-node.io";

fn claim_device(device: &str) -> ClaimDevice {
    ClaimDevice {
        driver: DRIVER.into(),
        pool: "node-a".into(),
        device: device.into(),
        cdi_devices: vec![
            format!("{DRIVER}/vfio=u1-{device}"),
            format!("{DRIVER}/vfio=u1-metadata-gpu"),
        ],
        share_id: None,
    }
}

#[test]
fn a_claim_kubelet_lists_holds_the_groups_its_cdi_devices_name() {
    let (dir, paths) = root();
    // The CDI spec sandbox-dra wrote for the claim.
    let cdi = dir.path().join("var/run/cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    std::fs::write(
        cdi.join(format!("{DRIVER}_u1.json")),
        serde_json::json!({"cdiVersion": "0.5.0", "kind": format!("{DRIVER}/vfio"), "devices": [
            {"name": "u1-gpu-0000-41-00-0", "containerEdits": {"deviceNodes": [
                {"path": "/dev/vfio/vfio"}, {"path": "/dev/vfio/21"}]}},
            {"name": "u1-gpu-0000-61-00-0", "containerEdits": {"deviceNodes": [
                {"path": "/dev/vfio/vfio"}, {"path": "/dev/vfio/37"}]}},
            {"name": "u1-metadata-gpu", "containerEdits": {"mounts": [
                {"hostPath": "/m", "containerPath": "/c"}]}},
        ]})
        .to_string(),
    )
    .unwrap();
    let fake = FakePodResources::spawn(&paths.pod_resources_socket()).unwrap();
    fake.set_pods(vec![pod_with_claim(
        "vms",
        "virt-launcher-a",
        "compute",
        "vm1-gpu",
        &[
            claim_device("gpu-0000-41-00-0"),
            claim_device("gpu-0000-61-00-0"),
        ],
    )]);
    let inv = two_gpus();
    let u = Usage::read(&paths);
    // Each group is the claim's device that names it, though kubelet hands the second device
    // the first's CDI devices too.
    for (g, device) in [(21, "gpu-0000-41-00-0"), (37, "gpu-0000-61-00-0")] {
        let uses = u.of_group(&inv, g);
        assert_eq!(
            uses.iter().map(|u| u.user.to_string()).collect::<Vec<_>>(),
            vec![format!(
                "pod vms/virt-launcher-a (container compute, claim vms/vm1-gpu, device \
                 {DRIVER}/node-a/{device}) has it"
            )]
        );
    }
    // The claim's spec gone (unprepared) while kubelet still lists it: who holds what cannot
    // be told, which is in use.
    std::fs::remove_file(cdi.join(format!("{DRIVER}_u1.json"))).unwrap();
    let uses = Usage::read(&paths).of_group(&inv, 21);
    assert_eq!(uses.len(), 1, "{uses:?}");
    assert!(uses[0].user.is_unknown_from(Source::Kubelet), "{uses:?}");
    assert!(
        uses[0].to_string().contains(&format!(
            "pod vms/virt-launcher-a (container compute) through claim vms/vm1-gpu holds: CDI \
             device {DRIVER}/vfio=u1-gpu-0000-41-00-0, {DRIVER}/vfio=u1-metadata-gpu, \
             {DRIVER}/vfio=u1-gpu-0000-61-00-0 is in no spec"
        )),
        "{uses:?}"
    );
    // The claim's own driver unpreparing it does not count the claim's pod, which kubelet
    // still lists until the unprepare succeeds.
    assert_eq!(
        Usage::read_excluding_claim(&paths, Some(("vms", "vm1-gpu"))).of_group(&inv, 21),
        vec![]
    );
    assert_eq!(
        Usage::read_excluding_claim(&paths, Some(("vms", "other")))
            .of_group(&inv, 21)
            .len(),
        1
    );
    // kubelet no longer lists the pod: free.
    fake.set_pods(vec![]);
    assert_eq!(Usage::read(&paths).of_group(&inv, 21), vec![]);
}
