//! A claim sandbox-dra prepared is in use for every daemon: with the claim's pod in kubelet's
//! PodResources `List` (the fake kubelet, answering as kubelet 1.36 does, with the CDI devices
//! sandbox-dra's prepare answered), `vfio-manager` refuses to take the claim's GPU or the GPU
//! of its vGPU, naming the pod and the claim, and takes it once kubelet no longer runs the pod.
//!
//! With kubelet down (no PodResources socket, and kubelet's checkpoint has no claims), the
//! driver's own record of the claim says the same: `vfio-manager` refuses the claim's GPU,
//! naming the claim and the driver, until the claim is unprepared; a record that cannot be read
//! is an unknown user, which only `--force` overrides.
//!
//! sandbox-dra and vfio-manager run as processes on a simulated node (node-sim); vfio-manager
//! is the binary built beside sandbox-dra (`cargo test --workspace` builds it; a test without
//! it says `skipped`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on setup failures

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use cluster_tier::ApiServer;
use serde_json::json;
use support::{
    BIN, DRIVER, KUBELET_ROOT, NODE, NS, claim, command, driver_of, mdev_count, prepare, put_claim,
    reg_socket, register, serving, start, unprepare,
};
use testkit::apiserver::FakeApiServer;
use testkit::kubelet::FakePodResources;
use testkit::kubelet::dra::{Claim, PreparedDevice};
use testkit::kubelet::pod_resources::{ClaimDevice, pod_with_claim};
use testkit::sim::try_mount;

const POD: &str = "virt-launcher-a";

/// vfio-manager beside sandbox-dra, or `None` (said as `skipped`) when it is not built.
fn vfio_manager() -> Option<PathBuf> {
    let p = Path::new(BIN).parent()?.join("vfio-manager");
    if p.is_file() {
        return Some(p);
    }
    println!(
        "skipped: {} is not built; cargo test --workspace builds it",
        p.display()
    );
    None
}

/// The devices of a claim as kubelet's PodResources lists them: those its prepare answered.
fn claim_devices(prepared: &[PreparedDevice]) -> Vec<ClaimDevice> {
    prepared
        .iter()
        .map(|d| ClaimDevice {
            driver: DRIVER.into(),
            pool: d.pool_name.clone(),
            device: d.device_name.clone(),
            cdi_devices: d.cdi_device_ids.clone(),
            share_id: d.share_id.clone(),
        })
        .collect()
}

/// kubelet's PodResources API on the node, running pod `vms/virt-launcher-a` whose container
/// `compute` has claim `c` with the devices its prepare answered.
async fn kubelet_runs(root: &Path, c: &Claim, prepared: &[PreparedDevice]) -> FakePodResources {
    let fake = FakePodResources::start(&root.join("var/lib/kubelet/pod-resources/kubelet.sock"))
        .await
        .unwrap();
    let devices = claim_devices(prepared);
    fake.set_pods(vec![pod_with_claim(NS, POD, "compute", &c.name, &devices)]);
    fake
}

fn vfio(bin: &Path, root: &Path, args: &[&str]) -> Output {
    Command::new(bin)
        .arg("--host-root")
        .arg(root)
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("HOST_ROOT")
        .env_remove("KUBELET_DIR")
        .env_remove("POD_RESOURCES_SOCKET")
        .output()
        .unwrap()
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn vfio_manager_unbind_refuses_the_gpu_of_a_prepared_claim_while_kubelet_runs_its_pod() {
    let Some(vfio_manager) = vfio_manager() else {
        return;
    };
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start(root, &api, &[]);
    let drv = register(root).await;
    let c = put_claim(
        &api,
        "vm1-gpu",
        "uid-1",
        "vfio-gpu.gpu-vm-node.io",
        "gpu-0000-41-00-0",
    );
    let prepared = prepare(&drv, &c).await.unwrap();
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    let kubelet = kubelet_runs(root, &c, &prepared).await;

    sim.clear_ops();
    let o = vfio(
        &vfio_manager,
        root,
        &["unbind", "--address", "0000:41:00.0"],
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!(
            "0000:41:00.0: pod {NS}/{POD} (container compute, claim {NS}/vm1-gpu, device \
             {DRIVER}/{NODE}/gpu-0000-41-00-0) has it"
        )),
        "{}",
        show(&o)
    );
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert!(
        sim.ops().iter().all(|op| op.path.contains("node-sim/")),
        "nothing written: {:?}",
        sim.ops()
    );
    // status says who has it.
    let st = vfio(&vfio_manager, root, &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    let gpu = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["address"] == "0000:41:00.0")
        .unwrap_or_else(|| panic!("{}", show(&st)));
    assert_eq!(
        gpu["in_use"][0]["claim"]["name"],
        "vm1-gpu",
        "{}",
        show(&st)
    );

    // The pod ends: kubelet no longer lists it and unprepares the claim; the GPU is free.
    kubelet.set_pods(vec![]);
    unprepare(&drv, &c).await.unwrap();
    let o = vfio(
        &vfio_manager,
        root,
        &["unbind", "--address", "0000:41:00.0"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("nvidia"));
}

#[tokio::test(flavor = "multi_thread")]
async fn vfio_manager_bind_refuses_the_gpu_of_a_prepared_vgpu_claim() {
    let Some(vfio_manager) = vfio_manager() else {
        return;
    };
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start(root, &api, &["--vgpu", "all"]);
    let drv = register(root).await;
    let c = put_claim(
        &api,
        "vm2-vgpu",
        "uid-2",
        "vgpu.gpu-vm-node.io",
        "vgpu-0000-61-00-0-a10-4q",
    );
    let prepared = prepare(&drv, &c).await.unwrap();
    let _kubelet = kubelet_runs(root, &c, &prepared).await;

    // Binding the GPU to VFIO would destroy the claim's vGPU.
    let o = vfio(&vfio_manager, root, &["bind", "--address", "0000:61:00.0"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!(
            "pod {NS}/{POD} (container compute, claim {NS}/vm2-vgpu, device \
             {DRIVER}/{NODE}/vgpu-0000-61-00-0-a10-4q) has it"
        )),
        "{}",
        show(&o)
    );
    assert_eq!(driver_of(root, "0000:61:00.0").as_deref(), Some("nvidia"));
}

#[tokio::test(flavor = "multi_thread")]
async fn with_kubelet_down_a_prepared_claims_record_keeps_its_gpu_in_use() {
    let Some(vfio_manager) = vfio_manager() else {
        return;
    };
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let Some(api) = ApiServer::start_or_skip("a prepared claim with kubelet down").unwrap() else {
        return;
    };
    let root = sim.root();
    api.create_node(NODE, &[]).unwrap();
    let uid = api
        .put_allocated_claim(
            NS,
            "vm1-gpu",
            json!([{"name": "gpu", "exactly": {"deviceClassName": "vfio-gpu.gpu-vm-node.io"}}]),
            json!([{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0000-41-00-0"}]),
        )
        .unwrap();
    let _d = serving(
        command(root, NODE, api.admin_kubeconfig(), &[]),
        &reg_socket(root, KUBELET_ROOT),
    );
    let drv = register(root).await;
    let c = claim("vm1-gpu", &uid);
    prepare(&drv, &c).await.unwrap();
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    // kubelet is down: nothing answers PodResources, and it left no checkpoint.
    let kubelet = root.join("var/lib/kubelet");
    assert!(!kubelet.join("pod-resources/kubelet.sock").exists());
    assert!(
        !kubelet
            .join("device-plugins/kubelet_internal_checkpoint")
            .exists()
    );

    sim.clear_ops();
    let o = vfio(
        &vfio_manager,
        root,
        &["unbind", "--address", "0000:41:00.0"],
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!(
            "0000:41:00.0: claim {NS}/vm1-gpu (prepared by {DRIVER}) has it"
        )),
        "{}",
        show(&o)
    );
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert!(
        sim.ops().iter().all(|op| op.path.contains("node-sim/")),
        "nothing written: {:?}",
        sim.ops()
    );
    let st = vfio(&vfio_manager, root, &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    let gpu = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["address"] == "0000:41:00.0")
        .unwrap_or_else(|| panic!("{}", show(&st)));
    assert_eq!(gpu["in_use"][0]["kind"], "claim", "{}", show(&st));
    assert_eq!(gpu["in_use"][0]["name"], "vm1-gpu", "{}", show(&st));

    // Unprepared, its record is gone: the GPU is free.
    unprepare(&drv, &c).await.unwrap();
    let o = vfio(
        &vfio_manager,
        root,
        &["unbind", "--address", "0000:41:00.0"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("nvidia"));

    // A record that cannot be read may hold any GPU: unknown, refused but with --force.
    let o = vfio(&vfio_manager, root, &["bind", "--address", "0000:61:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let damaged = kubelet.join(format!("plugins/{DRIVER}/claims/uid-damaged.json"));
    std::fs::write(&damaged, "{\"version\": 1, \"claim\": {").unwrap();
    let o = vfio(
        &vfio_manager,
        root,
        &["unbind", "--address", "0000:61:00.0"],
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("uid-damaged.json"),
        "{}",
        show(&o)
    );
    assert_eq!(driver_of(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
    let o = vfio(
        &vfio_manager,
        root,
        &["unbind", "--force", "--address", "0000:61:00.0"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver_of(root, "0000:61:00.0").as_deref(), Some("nvidia"));
}

/// Pods deleted together: kubelet unprepares their claims at once, and each unprepare removes
/// its claim's CDI spec before it checks who else holds its vGPU. A claim whose spec another
/// unprepare has removed is held to what its record says, not to "any device": otherwise each
/// unprepare waits for the other's and none ends (the pods stay Terminating). kubelet's
/// PodResources is the fake here: the real kubelet's two concurrent unprepares cannot be made
/// to interleave at this exact point.
#[tokio::test(flavor = "multi_thread")]
async fn an_unprepare_is_not_blocked_by_a_claim_whose_spec_another_unprepare_removed() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start(root, &api, &["--vgpu", "all"]);
    let drv = register(root).await;
    let a = put_claim(
        &api,
        "vm-a-vgpu",
        "uid-a",
        "vgpu.gpu-vm-node.io",
        "vgpu-0000-61-00-0-a10-4q",
    );
    let b = put_claim(
        &api,
        "vm-b-vgpu",
        "uid-b",
        "vgpu.gpu-vm-node.io",
        "vgpu-0000-41-00-0-a10-4q",
    );
    let listed = |c: &Claim, prepared: &[PreparedDevice], pod: &str| {
        pod_with_claim(NS, pod, "compute", &c.name, &claim_devices(prepared))
    };
    let pa = prepare(&drv, &a).await.unwrap();
    let pb = prepare(&drv, &b).await.unwrap();
    let kubelet = FakePodResources::start(&root.join("var/lib/kubelet/pod-resources/kubelet.sock"))
        .await
        .unwrap();
    kubelet.set_pods(vec![listed(&a, &pa, "vm-a"), listed(&b, &pb, "vm-b")]);
    assert_eq!(mdev_count(root), 2);

    // vm-b's unprepare got as far as removing its spec.
    let spec = root.join(format!("var/run/cdi/{DRIVER}_uid-b.json"));
    std::fs::remove_file(&spec).unwrap_or_else(|e| panic!("{}: {e}", spec.display()));

    unprepare(&drv, &a).await.unwrap();
    assert_eq!(mdev_count(root), 1, "vm-a's vGPU is removed, vm-b's kept");
    unprepare(&drv, &b).await.unwrap();
    assert_eq!(mdev_count(root), 0);
}
