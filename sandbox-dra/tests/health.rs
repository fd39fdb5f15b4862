//! Device health as kubelet 1.36 asks for it: a `NodeWatchResources` stream
//! (`v1alpha1.DRAResourceHealth`) on the driver's plugin socket, opened the way kubelet opens
//! it, against sandbox-dra as a process on a simulated node (node-sim). What is checked is what
//! kubelet would put in the pod's `allocatedResourcesStatus`: which device of the pool is
//! Healthy or Unhealthy, as the node changes under prepared claims.
//!
//! Prints `skipped: ...` when FUSE or root is missing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use kubelet_api::dra_health::v1alpha1::dra_resource_health_client::DraResourceHealthClient;
use kubelet_api::dra_health::v1alpha1::{
    HealthStatus, NodeWatchResourcesRequest, NodeWatchResourcesResponse,
};
use support::{DRIVER, Driver, NODE, PATIENCE, prepare, put_claim, register, start};
use testkit::apiserver::FakeApiServer;
use testkit::sim::try_mount;
use tonic::codec::Streaming;

/// Opens the health stream on the driver's plugin socket, as kubelet does.
async fn watch(root: &Path) -> Streaming<NodeWatchResourcesResponse> {
    let sock = root.join(format!("var/lib/kubelet/plugins/{DRIVER}/dra.sock"));
    let ch = kubelet_api::unix_channel(&sock).await.unwrap();
    DraResourceHealthClient::new(ch)
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await
        .unwrap_or_else(|e| panic!("no health stream: {e}"))
        .into_inner()
}

/// One message: device name → (health, message).
type Report = BTreeMap<String, (HealthStatus, String)>;

fn report(msg: NodeWatchResourcesResponse) -> Report {
    let mut out = Report::new();
    for d in msg.devices {
        let id = d.device.clone().expect("a device identifier");
        // The node's pool, or (`--pool-per-gpu`) for a device of a GPU of the vGPU pool, that
        // GPU's own.
        let own = support::gpu_pool(&id.device_name);
        assert!(id.pool_name == NODE || id.pool_name == own, "{d:?}");
        assert!(d.last_updated_time > 1_700_000_000, "{d:?}");
        // kubelet reads Unknown after this long without news: at least its own default.
        assert!(d.health_check_timeout_seconds >= 30, "{d:?}");
        let before = out.insert(id.device_name, (d.health(), d.message));
        assert!(before.is_none(), "a device listed twice");
    }
    out
}

/// Reads messages until one satisfies `want`.
async fn until(
    s: &mut Streaming<NodeWatchResourcesResponse>,
    d: &Driver,
    what: &str,
    want: impl Fn(&Report) -> bool,
) -> Report {
    let deadline = Instant::now() + PATIENCE;
    let mut last = Report::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.message()).await {
            Ok(Ok(Some(m))) => {
                last = report(m);
                if want(&last) {
                    return last;
                }
            }
            Ok(other) => panic!(
                "the stream ended ({other:?}) waiting for {what}:\n{}",
                d.log()
            ),
            Err(_) => panic!("no report with {what}; last: {last:#?}\n{}", d.log()),
        }
    }
}

fn unhealthy(r: &Report) -> Vec<&str> {
    r.iter()
        .filter(|(_, (h, _))| *h == HealthStatus::Unhealthy)
        .map(|(n, _)| n.as_str())
        .collect()
}

fn is(r: &Report, name: &str, h: HealthStatus) -> bool {
    r.get(name).is_some_and(|(x, _)| *x == h)
}

/// The one mdev on the node.
fn only_mdev(root: &Path) -> String {
    let names: Vec<String> = std::fs::read_dir(root.join("sys/bus/mdev/devices"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    names[0].clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn kubelet_hears_exactly_the_device_that_can_no_longer_serve_its_vm() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, &["--vgpu", "0000:61:00.0"]);
    let drv = register(root).await;
    assert!(
        drv.info
            .supported_versions
            .iter()
            .any(|v| v == "v1alpha1.DRAResourceHealth"),
        "{:?}",
        drv.info.supported_versions
    );
    let mut s = watch(root).await;

    // At start: every published device, all healthy.
    let (whole, vgpu) = ("gpu-0000-41-00-0", "vgpu-0000-61-00-0-a10-4q");
    let r = until(&mut s, &d, "the published devices", |r| {
        r.contains_key(whole) && r.contains_key(vgpu)
    })
    .await;
    assert!(r.contains_key("gpu-0000-61-00-0"), "{r:#?}");
    assert_eq!(unhealthy(&r), Vec::<&str>::new(), "{r:#?}");
    assert!(r.values().all(|(h, _)| *h == HealthStatus::Healthy));

    // A whole GPU and a vGPU prepared for VMs: still healthy.
    let c1 = put_claim(&api, "vm1", "uid-1", "vfio.gpu.gpu-vm-node.io", whole);
    prepare(&drv, &c1).await.unwrap();
    let c2 = put_claim(&api, "vm2", "uid-2", "vgpu.gpu-vm-node.io", vgpu);
    prepare(&drv, &c2).await.unwrap();

    // The whole GPU taken off vfio-pci behind the driver's back: that device, and only it.
    std::fs::write(
        root.join("sys/bus/pci/drivers/vfio-pci/unbind"),
        "0000:41:00.0",
    )
    .unwrap();
    let r = until(&mut s, &d, "the unbound GPU unhealthy", |r| {
        is(r, whole, HealthStatus::Unhealthy)
    })
    .await;
    assert_eq!(unhealthy(&r), vec![whole], "{r:#?}");
    // The driver link and the group node go one after the other: either names the GPU.
    let why = &r[whole].1;
    assert!(why.contains("0000:41:00.0"), "{why}");
    assert!(is(&r, vgpu, HealthStatus::Healthy), "{r:#?}");

    // The prepared vGPU's mdev removed: its type's shared device too (kubelet hears health by
    // device, not by share), the GPU's other types stay healthy.
    let uuid = only_mdev(root);
    std::fs::write(
        root.join(format!("sys/bus/mdev/devices/{uuid}/remove")),
        "1",
    )
    .unwrap();
    let r = until(&mut s, &d, "the removed vGPU unhealthy", |r| {
        is(r, vgpu, HealthStatus::Unhealthy)
    })
    .await;
    assert_eq!(unhealthy(&r), vec![whole, vgpu], "{r:#?}");
    assert!(r[vgpu].1.contains(&uuid), "{:?}", r[vgpu]);
    assert!(
        is(&r, "vgpu-0000-61-00-0-a10-8q", HealthStatus::Healthy),
        "{r:#?}"
    );

    // A GPU hot-plugged is healthy; hot-removed, it is unhealthy.
    let plugged = "gpu-0000-81-00-0";
    sim.control("hotplug 0000:81:00.0 A10 group=50 numa=1")
        .unwrap();
    until(&mut s, &d, "the hot-plugged GPU healthy", |r| {
        is(r, plugged, HealthStatus::Healthy)
    })
    .await;
    sim.control("unplug 0000:81:00.0").unwrap();
    let r = until(&mut s, &d, "the hot-removed GPU unhealthy", |r| {
        is(r, plugged, HealthStatus::Unhealthy)
    })
    .await;
    assert_eq!(unhealthy(&r), vec![whole, plugged, vgpu], "{r:#?}");

    // Put back on vfio-pci, the whole GPU is healthy again.
    std::fs::write(
        root.join("sys/bus/pci/drivers/vfio-pci/bind"),
        "0000:41:00.0",
    )
    .unwrap();
    let r = until(&mut s, &d, "the rebound GPU healthy", |r| {
        is(r, whole, HealthStatus::Healthy)
    })
    .await;
    assert_eq!(unhealthy(&r), vec![plugged, vgpu], "{r:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prepared_gpu_whose_audio_function_a_host_driver_takes_is_unhealthy() {
    let Some(sim) = try_mount("rtx-workstation") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, &[]);
    let drv = register(root).await;
    let mut s = watch(root).await;
    let gpu = "gpu-0000-01-00-0";
    until(&mut s, &d, "the GPU healthy", |r| {
        is(r, gpu, HealthStatus::Healthy)
    })
    .await;
    let c = put_claim(&api, "ws", "uid-ws", "vfio.gpu.gpu-vm-node.io", gpu);
    prepare(&drv, &c).await.unwrap();

    // The audio function, bound with the GPU, given back to the host's sound driver.
    let audio = root.join("sys/bus/pci/devices/0000:01:00.1");
    std::fs::write(audio.join("driver_override"), "\n").unwrap();
    std::fs::write(audio.join("driver/unbind"), "0000:01:00.1").unwrap();
    std::fs::write(
        root.join("sys/bus/pci/drivers/snd_hda_intel/bind"),
        "0000:01:00.1",
    )
    .unwrap();
    let r = until(&mut s, &d, "the GPU unhealthy", |r| {
        is(r, gpu, HealthStatus::Unhealthy)
    })
    .await;
    assert_eq!(unhealthy(&r), vec![gpu], "{r:#?}");
    let why = &r[gpu].1;
    assert!(
        why.contains("0000:01:00.1") && why.contains("snd_hda_intel"),
        "{why}"
    );
}

/// A vGPU claims hold from two pools (one allocated from the node's own pool before
/// `--pool-per-gpu` gave its GPU a pool of its own, one from the GPU's pool) is reported in
/// both: where kubelet looks for each claim's device.
#[tokio::test(flavor = "multi_thread")]
async fn a_device_claims_hold_from_two_pools_is_reported_in_both() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, &["--vgpu", "0000:61:00.0", "--pool-per-gpu"]);
    let drv = register(root).await;
    let vgpu = "vgpu-0000-61-00-0-a10-4q";
    let old = support::put_claim_in(&api, "vm", "uid-old", "vgpu.gpu-vm-node.io", NODE, vgpu);
    let new = support::put_claim_in(
        &api,
        "vm-2",
        "uid-new",
        "vgpu.gpu-vm-node.io",
        &support::gpu_pool(vgpu),
        vgpu,
    );
    for c in [&old, &new] {
        prepare(&drv, c)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    }
    let mut s = watch(root).await;
    let want = [
        (NODE.to_string(), vgpu.to_string()),
        (support::gpu_pool(vgpu), vgpu.to_string()),
    ];
    let deadline = Instant::now() + PATIENCE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let m = match tokio::time::timeout(left, s.message()).await {
            Ok(Ok(Some(m))) => m,
            other => panic!("no report of {want:?}: {other:?}\n{}", d.log()),
        };
        let listed: Vec<(String, String, HealthStatus)> = m
            .devices
            .iter()
            .filter_map(|x| {
                let id = x.device.clone()?;
                Some((id.pool_name, id.device_name, x.health()))
            })
            .collect();
        if want.iter().all(|(p, n)| {
            listed
                .iter()
                .any(|(lp, ln, h)| lp == p && ln == n && *h == HealthStatus::Healthy)
        }) {
            break;
        }
    }
}
