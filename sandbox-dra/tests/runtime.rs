//! A node whose container runtime ignores CDI (containerd 1.6, Debian 12's) would start a VM's pod
//! without its `/dev/vfio` nodes and metadata: sandbox-dra reads the runtime from its Node and
//! refuses the claim instead, naming the runtime, with a Warning Event on the Node; once the
//! Node reports a runtime that reads CDI, the same claim is prepared.
//!
//! Against a real kube-apiserver (the cluster tier's assets): the Node, its status and the
//! claim's allocation are written as kubelet and the scheduler write them, and the driver's
//! Events (`ClaimNotPrepared`, `ContainerRuntimeCDI`, `ClaimPrepared`) are read as
//! `kubectl get events` shows them. The driver runs on a
//! node-sim 2xA10 and is called the way kubelet calls it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on setup failures

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use cluster_tier::{Assets, ControlPlane, ControlPlaneOpts};
use serde_json::{Value, json};
use support::{DRIVER, KUBELET_ROOT, NODE, command, reg_socket, register, serving};
use testkit::kubelet::dra::{Claim, Version};
use testkit::sim::try_mount;

const NS: &str = "default";

fn kubectl_apply(cp: &ControlPlane, dir: &Path, name: &str, obj: &Value) {
    let f = dir.join(format!("{name}.json"));
    std::fs::write(&f, obj.to_string()).unwrap();
    cp.kubectl(&["apply", "-f", f.to_str().unwrap()]).unwrap();
}

fn set_runtime(cp: &ControlPlane, version: &str) {
    let status = json!({"status": {"nodeInfo": {
        "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "6.1.0",
        "osImage": "Debian GNU/Linux 12", "containerRuntimeVersion": version,
        "kubeletVersion": "v1.36.2", "kubeProxyVersion": "", "operatingSystem": "linux",
        "architecture": "amd64"
    }}});
    cp.kubectl(&[
        "patch",
        "node",
        NODE,
        "--subresource=status",
        "--type=merge",
        "-p",
        &status.to_string(),
    ])
    .unwrap();
}

fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "waited 60 s for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runtime_without_cdi_refuses_claims_and_says_so() {
    if let Some(why) = cluster_tier::assets::unavailable() {
        cluster_tier::assets::skip("sandbox-dra against a real API server", &why);
        return;
    }
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let dir = tempfile::tempdir().unwrap();
    let cp = ControlPlane::start(
        dir.path(),
        &Assets::load().unwrap(),
        ControlPlaneOpts::default(),
    )
    .unwrap();
    kubectl_apply(
        &cp,
        dir.path(),
        "node",
        &json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}),
    );
    set_runtime(&cp, "containerd://1.6.20");
    kubectl_apply(
        &cp,
        dir.path(),
        "claim",
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": NS, "name": "vm1-gpu"},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "vfio-gpu.gpu-vm-node.io"}}
            ]}},
        }),
    );
    let allocation = json!({"status": {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0000-41-00-0"}
    ]}}}});
    cp.kubectl(&[
        "patch",
        "resourceclaim",
        "-n",
        NS,
        "vm1-gpu",
        "--subresource=status",
        "--type=merge",
        "-p",
        &allocation.to_string(),
    ])
    .unwrap();
    let uid = cp
        .kubectl(&[
            "get",
            "resourceclaim",
            "-n",
            NS,
            "vm1-gpu",
            "-o",
            "jsonpath={.metadata.uid}",
        ])
        .unwrap();

    let d = serving(
        command(
            root,
            NODE,
            cp.admin_kubeconfig(),
            &["--resync-interval", "1s"],
        ),
        &reg_socket(root, KUBELET_ROOT),
    );
    let drv = register(root).await;
    // The Node's runtime is read with the first pass, which also publishes the slice.
    wait_for("the slice published", || {
        let out = cp
            .kubectl(&["get", "resourceslices", "-o", "name"])
            .unwrap();
        (!out.trim().is_empty()).then_some(())
    });

    let claim = Claim {
        namespace: NS.into(),
        name: "vm1-gpu".into(),
        uid: uid.clone(),
    };
    let out = drv
        .prepare(Version::V1, std::slice::from_ref(&claim))
        .await
        .unwrap();
    let err = out[0]
        .1
        .as_ref()
        .expect_err("a claim prepared for a runtime without CDI");
    assert!(
        err.contains("containerd://1.6.20 ignores CDI") && err.contains("containerd 2.0"),
        "{err}"
    );
    let driver_link = root.join("sys/bus/pci/devices/0000:41:00.0/driver");
    assert!(
        std::fs::read_link(&driver_link)
            .unwrap()
            .ends_with("nvidia"),
        "the GPU was moved for a claim that was refused"
    );
    // Events as `kubectl get events` shows them, by reason.
    let events = |reason: &str| {
        wait_for(&format!("an Event {reason}"), || {
            let out = cp
                .kubectl(&[
                    "get",
                    "events",
                    "-A",
                    "--field-selector",
                    &format!("reason={reason}"),
                    "-o",
                    "json",
                ])
                .unwrap();
            let v: Value = serde_json::from_str(&out).unwrap();
            let items = v["items"].as_array().cloned().unwrap_or_default();
            (!items.is_empty()).then_some(items)
        })
    };
    let refused = events("ClaimNotPrepared");
    assert_eq!(refused[0]["type"], "Warning", "{refused:?}");
    assert!(
        refused[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("default/vm1-gpu") && m.contains("ignores CDI")),
        "{refused:?}"
    );
    // The claim named once, as kubelet reports the error on the pod.
    let note = refused[0]["message"].as_str().unwrap_or_default();
    assert!(
        note.starts_with(&format!("claim default/vm1-gpu ({uid}): "))
            && note.matches("vm1-gpu").count() == 1,
        "{note}"
    );
    let events = events("ContainerRuntimeCDI");
    assert_eq!(events[0]["type"], "Warning", "{events:?}");
    assert!(
        events[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("containerd://1.6.20")),
        "{events:?}"
    );

    // The node's runtime upgraded: the same claim is prepared.
    set_runtime(&cp, "containerd://2.0.5");
    let devices = wait_for("the claim prepared once the runtime reads CDI", || {
        std::thread::sleep(Duration::from_millis(500));
        let rt = tokio::runtime::Handle::current();
        let out = tokio::task::block_in_place(|| {
            rt.block_on(drv.prepare(Version::V1, std::slice::from_ref(&claim)))
        })
        .unwrap();
        out[0].1.clone().ok()
    });
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert!(
        std::fs::read_link(&driver_link)
            .unwrap()
            .ends_with("vfio-pci")
    );
    let prepared = wait_for("an Event ClaimPrepared", || {
        let out = cp
            .kubectl(&[
                "get",
                "events",
                "-A",
                "--field-selector",
                "reason=ClaimPrepared",
                "-o",
                "json",
            ])
            .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        let items = v["items"].as_array().cloned().unwrap_or_default();
        (!items.is_empty()).then_some(items)
    });
    assert_eq!(prepared[0]["type"], "Normal", "{prepared:?}");
    assert!(
        prepared[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("default/vm1-gpu") && m.contains("gpu-0000-41-00-0")),
        "{prepared:?}"
    );
    let log = d.log();
    assert!(log.contains("ignores CDI"), "{log}");
}
