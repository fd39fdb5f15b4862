//! `node-sim demo` end to end: the real daemons on two simulated nodes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use std::path::Path;
use std::process::Command;

#[test]
fn demo_prints_allocatable_env_and_permitted_devices() {
    if let Some(why) = node_sim::unavailable() {
        node_sim::skip_test("demo test", why);
        return;
    }
    let exe = Path::new(env!("CARGO_BIN_EXE_node-sim"));
    let dir = exe.parent().unwrap();
    for b in ["vfio-manager", "vgpu-device-manager", "sandbox-dp"] {
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
    // Nothing left mounted.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains("gpu-vm-demo-"),
        "a demo mount was left behind"
    );
}
