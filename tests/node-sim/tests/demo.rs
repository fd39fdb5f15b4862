//! `node-sim demo` end to end: the real daemons on four simulated nodes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use std::path::Path;
use std::process::Command;

#[test]
fn demo_prints_allocatable_env_permitted_devices_and_the_dynamic_paths() {
    if let Some(why) = node_sim::unavailable() {
        node_sim::skip_test("demo test", why);
        return;
    }
    let exe = Path::new(env!("CARGO_BIN_EXE_node-sim"));
    let dir = exe.parent().unwrap();
    for b in [
        "vfio-manager",
        "vgpu-device-manager",
        "sandbox-dp",
        "sandbox-dra",
    ] {
        if !dir.join(b).is_file() {
            node_sim::skip_test(
                "demo test",
                &format!("{b} is not built; cargo test --workspace builds it"),
            );
            return;
        }
    }
    let out = Command::new(exe).arg("demo").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    let section = |title: &str| {
        let start = stdout
            .find(title)
            .unwrap_or_else(|| panic!("no {title:?} in\n{stdout}"));
        stdout[start..].to_string()
    };
    let node1 = section("Name:               gpu-node-1");
    let node2 = section("Name:               gpu-node-2");
    let alloc1 = &node1[node1.find("Allocatable:").unwrap()..];
    assert!(
        alloc1.starts_with("Allocatable:\n  nvidia.com/GA102GL_A10:  2\n"),
        "{stdout}"
    );
    let alloc2 = &node2[node2.find("Allocatable:").unwrap()..];
    assert!(
        alloc2.starts_with("Allocatable:\n  nvidia.com/NVIDIA_A10-4Q:  12\n"),
        "{stdout}"
    );
    assert!(
        node1.contains("env    PCI_RESOURCE_NVIDIA_COM_GA102GL_A10=0000:"),
        "{stdout}"
    );
    assert!(node1.contains("device /dev/vfio/vfio (mrw)"), "{stdout}");
    assert!(
        node2.contains("env    MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q="),
        "{stdout}"
    );
    assert!(
        stdout.contains("pciVendorSelector: \"10DE:2236\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("mdevNameSelector: \"NVIDIA A10-4Q\""),
        "{stdout}"
    );
    // On demand: Allocate creates the vGPU it answers with, and the pod's end removes it.
    let node3 = section("Name:               gpu-node-3");
    assert!(
        node3.contains("  nvidia.com/NVIDIA_A10-4Q:  12\n"),
        "{stdout}"
    );
    assert!(
        node3.contains("env    MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q="),
        "{stdout}"
    );
    assert!(
        node3.contains("created /sys/bus/mdev/devices/") && node3.contains("(NVIDIA A10-4Q on "),
        "{stdout}"
    );
    assert!(
        node3.contains("nvidia.com/NVIDIA_A10-8Q: 6 -> 3"),
        "{stdout}"
    );
    assert!(node3.contains("removed after"), "{stdout}");
    // DRA: a whole GPU and a vGPU prepared, with the metadata virt-launcher reads; the claimed
    // GPU is in use for vfio-manager.
    let node4 = section("ResourceSlices of node gpu-node-4");
    assert!(
        node4.contains("prepared: 0000:41:00.0 and its group on vfio-pci"),
        "{stdout}"
    );
    assert!(
        node4.contains("virt-launcher reads /var/run/") && node4.contains("/vm1-gpu/gpu/"),
        "{stdout}"
    );
    assert!(
        node4.contains("\"resource.kubernetes.io/pciBusID\""),
        "{stdout}"
    );
    assert!(node4.contains("\"mdevUUID\""), "{stdout}");
    assert!(node4.contains("created (NVIDIA A10-4Q on "), "{stdout}");
    assert!(
        node4.contains("(exit 1):")
            && node4.contains("pod vms/virt-launcher-vm1 (container compute, claim vms/vm1-gpu"),
        "{stdout}"
    );
    // Nothing left mounted.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains("gpu-vm-demo-"),
        "a demo mount was left behind"
    );
}
