//! The usage model against a fake kubelet: its PodResources API on a Unix socket, and its
//! checkpoint written in kubelet's shape.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed setup step should panic

use common::usage::{PodSource, Source};
use common::{HostPaths, Inventory, Usage, User};
use fake_kubelet::FakePodResources;
use fake_kubelet::checkpoint::{self, entry};
use fake_kubelet::pod_resources::pod;

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
