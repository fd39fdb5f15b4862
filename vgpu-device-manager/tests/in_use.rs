//! `vgpu-device-manager` never removes a vGPU in use, as kubelet sees it: the pods of its
//! PodResources API (a fake one on the node's socket), or its checkpoint while nothing listens
//! there; and a source that cannot be read removes nothing. Against node-sim's 2xA10.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::{Path, PathBuf};

use support::*;
use testkit::kubelet::FakePodResources;
use testkit::kubelet::checkpoint::{self, entry};

fn ok(o: &std::process::Output) {
    assert_eq!(o.status.code(), Some(0), "{}", text(o));
}

fn kubelet_dir(root: &Path) -> PathBuf {
    root.join("var/lib/kubelet/device-plugins")
}

fn pod_resources_socket(root: &Path) -> PathBuf {
    root.join("var/lib/kubelet/pod-resources/kubelet.sock")
}

/// Applies A10-4Q and returns the config file and the UUID of one of 0000:61:00.0's vGPUs.
fn a10_4q(root: &Path) -> (ConfigFile, String) {
    let cfg = config_file(CONFIG);
    ok(&run(
        root,
        &["apply", "-f", cfg.path.to_str().unwrap(), "-c", "A10-4Q"],
    ));
    let (uuid, ..) = mdevs(root)
        .into_iter()
        .find(|m| m.2 == "0000:61:00.0")
        .unwrap();
    (cfg, uuid)
}

/// The second GPU kept its six A10-4Q; the first, which nobody uses, moved to A10-8Q.
fn assert_second_gpu_kept(root: &Path) {
    assert_eq!(
        mdev_counts(root).into_iter().collect::<Vec<_>>(),
        vec![
            (("0000:41:00.0".into(), "NVIDIA A10-8Q".into()), 3),
            (("0000:61:00.0".into(), "NVIDIA A10-4Q".into()), 6),
        ]
    );
}

fn assert_all_8q(root: &Path) {
    assert_eq!(
        mdev_counts(root).into_iter().collect::<Vec<_>>(),
        vec![
            (("0000:41:00.0".into(), "NVIDIA A10-8Q".into()), 3),
            (("0000:61:00.0".into(), "NVIDIA A10-8Q".into()), 3),
        ]
    );
}

#[test]
fn a_vgpu_in_kubelets_checkpoint_blocks_its_gpu_while_kubelet_is_down() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let (cfg, uuid) = a10_4q(root);
    let f = cfg.path.to_str().unwrap();
    // The pod has the vGPU but its VM has not opened it yet; no PodResources socket.
    checkpoint_gives_a_pod(&kubelet_dir(root), &uuid.to_uppercase());
    let o = run(root, &["apply", "-f", f, "-c", "A10-8Q"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains(&format!(
            "NVIDIA A10-4Q {uuid} must be removed but is in use: pod 6f1c-pod (container \
             compute, nvidia.com/NVIDIA_A10-4Q; kubelet's checkpoint) has it"
        )),
        "{out}"
    );
    assert_second_gpu_kept(root);
}

#[test]
fn a_truncated_checkpoint_removes_nothing() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let (cfg, uuid) = a10_4q(root);
    let f = cfg.path.to_str().unwrap();
    let text_full = checkpoint::json(&[entry("6f1c-pod", "compute", A10_4Q, &[&uuid])]);
    let path = kubelet_dir(root).join("kubelet_internal_checkpoint");
    std::fs::write(&path, &text_full[..text_full.len() / 2]).unwrap();

    let before = mdevs(root);
    let o = run(root, &["apply", "-f", f, "-c", "A10-8Q"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains(&format!(
            "unknown: kubelet's checkpoint {} is truncated or corrupt",
            path.display()
        )),
        "{out}"
    );
    assert!(
        out.contains("GPU 0 (0000:41:00.0, 10de:2236): left unchanged, in use"),
        "{out}"
    );
    assert_eq!(mdevs(root), before, "no vGPU was removed");
    // plan says the same, and why.
    let o = run(root, &["plan", "-f", f, "-c", "A10-8Q"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("BLOCKED"), "{}", text(&o));
    assert!(out.contains("truncated or corrupt"), "{}", text(&o));
}

#[test]
fn the_pods_kubelet_runs_decide_and_a_gone_pods_vgpu_is_free_again() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let (cfg, uuid) = a10_4q(root);
    let f = cfg.path.to_str().unwrap();
    // kubelet still has the pod's entry in its checkpoint (it keeps it until it next admits a
    // pod) ...
    checkpoint_gives_a_pod(&kubelet_dir(root), &uuid);
    let fake = kubelet_runs(&pod_resources_socket(root), &[&uuid]);
    let o = run(root, &["apply", "-f", f, "-c", "A10-8Q"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("pod vms/virt-launcher-a (container compute, nvidia.com/NVIDIA_A10-4Q)"),
        "{out}"
    );
    assert!(!out.contains("checkpoint"), "PodResources answered: {out}");
    assert_second_gpu_kept(root);
    assert_eq!(fake.list_calls(), 1, "one List per run");

    // ... but the pod is gone from what kubelet runs: its vGPU is free.
    fake.set_pods(vec![]);
    ok(&run(root, &["apply", "-f", f, "-c", "A10-8Q"]));
    assert_all_8q(root);
}

#[test]
fn a_pod_resources_api_that_fails_removes_nothing() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let (cfg, _) = a10_4q(root);
    let f = cfg.path.to_str().unwrap();
    let fake = FakePodResources::spawn(&pod_resources_socket(root)).unwrap();
    fake.fail_with(Some("podresources: rate limit exceeded"));
    let before = mdevs(root);
    let o = run(root, &["apply", "-f", f, "-c", "A10-8Q"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("rate limit exceeded"), "{out}");
    assert_eq!(mdevs(root), before);
}

#[test]
fn kubelet_dir_and_pod_resources_socket_are_honoured() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let (cfg, uuid) = a10_4q(root);
    let f = cfg.path.to_str().unwrap();
    // A kubelet whose root is not /var/lib/kubelet (k0s).
    let k0s = root.join("var/lib/k0s/kubelet/device-plugins");
    checkpoint_gives_a_pod(&k0s, &uuid);
    let flag = k0s.to_str().unwrap();
    for args in [
        vec!["plan", "-f", f, "-c", "A10-8Q", "--kubelet-dir", flag],
        vec!["apply", "-f", f, "-c", "A10-8Q", "--kubelet-dir", flag],
    ] {
        let o = run(root, &args);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains("pod 6f1c-pod (container compute"),
            "{args:?}: {}",
            text(&o)
        );
    }
    assert_second_gpu_kept(root);
    // The same through the environment, as the DaemonSet and the units pass it.
    let o = std::process::Command::new(BIN)
        .args(["plan", "-f", f, "-c", "A10-8Q", "--host-root"])
        .arg(root)
        .env("KUBELET_DIR", &k0s)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("pod 6f1c-pod"),
        "{}",
        text(&o)
    );
    // Its PodResources socket (beside the kubelet directory by default, or as set) answers
    // for the running pods: none, so the vGPU is free.
    let sock = root.join("run/k0s/pod-resources.sock");
    let _fake = FakePodResources::spawn(&sock).unwrap();
    let o = run(
        root,
        &[
            "apply",
            "-f",
            f,
            "-c",
            "A10-8Q",
            "--kubelet-dir",
            flag,
            "--pod-resources-socket",
            sock.to_str().unwrap(),
        ],
    );
    ok(&o);
    assert_all_8q(root);
}
