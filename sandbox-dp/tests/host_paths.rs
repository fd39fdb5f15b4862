//! What sandbox-dp reads where: `list` and `permitted-devices` change nothing under the host
//! root, and `KUBELET_DIR` names the plugin directory as `--kubelet-dir` does (node-sim).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::process::{Command, Stdio};

use support::*;
use testkit::kubelet::FakeKubelet;
use testkit::tree::Tree;

#[test]
fn list_and_permitted_devices_write_nothing() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    bind_vfio(root, "0000:41:00.0");
    write(root, "sys/bus/pci/devices/0000:61:00.0/sriov_numvfs", "2");
    write(
        root,
        "sys/class/mdev_bus/0000:61:00.4/mdev_supported_types/nvidia-593/create",
        "5a3b2c1d-0000-4000-8000-0000000000aa",
    );
    let mut before = Tree::read(root);
    for args in [
        vec!["list"],
        vec!["list", "--json"],
        vec!["permitted-devices"],
    ] {
        let o = run(&args, root);
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let after = Tree::read(root);
        before.assert_same(&after, &args.join(" "));
        before = after;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_dir_comes_from_the_environment_too() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    bind_vfio(root, "0000:41:00.0");
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let child = Command::new(BIN)
        .args(["serve", "--resync-interval", "1h", "--host-root"])
        .arg(root)
        .env("KUBELET_DIR", &kdir)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut d = Daemon { child };
    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    assert_eq!(reg.resource_name, "nvidia.com/GA102GL_A10");
    assert!(kdir.join(&reg.endpoint).exists());
    assert!(d.terminate().success());
}
