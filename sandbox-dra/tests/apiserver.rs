//! sandbox-dra as a process against the real kube-apiserver (the cluster tier's etcd and API
//! server, no kubelet): the ResourceSlices it publishes for a large vGPU pool (in the node's
//! pool, or with `--pool-per-gpu` a pool per GPU) are accepted as a whole, and with consumable
//! capacity off it publishes the GPUs whole only.
//! The API's limits on a pool's slices (Kubernetes 1.35 and later: at most 8 counter
//! sets a slice, 2 counter consumptions a device, 64 devices a slice when any consumes
//! counters, counters and devices never in one slice) are checked by the API server itself,
//! which the fake one does not. Needs the tier's assets (`tests/cluster/prepare.sh`); skipped
//! without them, a failure with `CLUSTER_TIER=required`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use cluster_tier::assets::{self, Assets};
use cluster_tier::control_plane::{ControlPlane, ControlPlaneOpts};
use serde_json::Value;
use support::{DRIVER, Driver, command};
use testkit::sim::Topology;

/// How long a whole pool may take to be written (hundreds of devices, one apply a slice).
const PATIENCE: Duration = Duration::from_secs(90);

/// `n` A10s, each behind its own root port, over two NUMA nodes.
fn a10s(n: usize) -> Topology {
    let mut s = format!("name = \"{n}xA10\"\n");
    for i in 0..n {
        let bus = 0x10 + 2 * i;
        let _ = write!(
            s,
            "[[bridge]]\naddress = \"0000:{bus:02x}:01.0\"\nnuma = {}\n\n\
             [[device]]\naddress = \"0000:{:02x}:00.0\"\nmodel = \"A10\"\nbridge = \"0000:{bus:02x}:01.0\"\n\n",
            i * 2 / n,
            bus + 1
        );
    }
    Topology::parse(&s, &format!("{n}xA10")).unwrap()
}

/// The node's slices of the driver, as the API server holds them.
fn slices(cp: &ControlPlane, node: &str) -> Vec<Value> {
    let out = cp
        .kubectl(&[
            "get",
            "resourceslices",
            "-o",
            "json",
            "--field-selector",
            &format!("spec.nodeName={node},spec.driver={DRIVER}"),
        ])
        .unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    v["items"].as_array().cloned().unwrap_or_default()
}

/// Whether `s` is whole: `want_pools` pools (each pooled GPU's, or the node's), each as many
/// slices as each of its slices says, all of one generation.
fn complete(s: &[Value], want_pools: usize) -> bool {
    let mut pools: Vec<&str> = s
        .iter()
        .filter_map(|s| s["spec"]["pool"]["name"].as_str())
        .collect();
    pools.sort_unstable();
    pools.dedup();
    pools.len() == want_pools && support::whole_pools(s)
}

fn len(v: &Value) -> usize {
    v.as_array().map_or(0, Vec::len)
}

#[test]
fn ten_and_sixteen_pooled_a10s_are_slices_the_api_server_accepts_in_either_layout() {
    if let Some(why) = assets::unavailable() {
        assets::skip("sandbox-dra against kube-apiserver", &why);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cp = ControlPlane::start(
        dir.path(),
        &Assets::load().unwrap(),
        ControlPlaneOpts::default(),
    )
    .unwrap();
    for (n, per_gpu) in [(10, false), (16, false), (10, true)] {
        let node = format!("node-{n}{}", if per_gpu { "-per-gpu" } else { "" });
        let manifest = dir.path().join(format!("{node}.json"));
        std::fs::write(
            &manifest,
            format!(r#"{{"apiVersion": "v1", "kind": "Node", "metadata": {{"name": "{node}"}}}}"#),
        )
        .unwrap();
        cp.kubectl(&["create", "-f", manifest.to_str().unwrap()])
            .unwrap();
        let sim = testkit::sim::mount_topology(&a10s(n));
        let d = Driver::spawn(command(
            sim.root(),
            &node,
            cp.admin_kubeconfig(),
            if per_gpu {
                &["--vgpu", "all", "--pool-per-gpu"]
            } else {
                &["--vgpu", "all"]
            },
        ));
        let t = Instant::now();
        let got = loop {
            let s = slices(&cp, &node);
            if complete(&s, if per_gpu { n } else { 1 }) {
                break s;
            }
            if t.elapsed() > PATIENCE {
                panic!(
                    "{n} A10s: no whole pool after {PATIENCE:?}: {} slices {:?}\n{}",
                    s.len(),
                    s.iter()
                        .map(|s| s["metadata"]["name"].as_str().unwrap_or_default())
                        .collect::<Vec<_>>(),
                    d.log()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        };
        // Every GPU's counter set, read back: the API server kept what it accepted.
        let sets: usize = got.iter().map(|s| len(&s["spec"]["sharedCounters"])).sum();
        assert_eq!(sets, n, "{n} A10s: counter sets");
        let mut pools: Vec<&str> = got
            .iter()
            .map(|s| s["spec"]["pool"]["name"].as_str().unwrap())
            .collect();
        pools.sort_unstable();
        pools.dedup();
        if per_gpu {
            // A pool per GPU (two slices: devices, counters); the node's own has nothing left.
            assert_eq!(pools.len(), n, "{n} A10s: pools {pools:?}");
            assert!(
                pools
                    .iter()
                    .all(|p| p.starts_with(&format!("{node}/gpu-0000-"))),
                "{pools:?}"
            );
            assert_eq!(got.len(), 2 * n, "{n} A10s: slices");
        } else {
            assert_eq!(pools, [node.as_str()], "{n} A10s: one pool");
        }
        let devices: Vec<&Value> = got
            .iter()
            .filter_map(|s| s["spec"]["devices"].as_array())
            .flatten()
            .collect();
        let whole = devices
            .iter()
            .filter(|d| d["name"].as_str().unwrap().starts_with("gpu-"))
            .count();
        assert_eq!(whole, n, "{n} A10s: whole GPUs");
        let per_gpu = devices
            .iter()
            .filter(|d| {
                d["name"]
                    .as_str()
                    .unwrap()
                    .starts_with("vgpu-0000-11-00-0-")
            })
            .count();
        assert!(per_gpu > 0, "{n} A10s: no vGPU of the first GPU");
        assert_eq!(devices.len(), n * (per_gpu + 1), "{n} A10s: devices");
        // The shared vGPU devices, read back: the API server kept what makes them shared.
        assert!(
            devices
                .iter()
                .filter(|d| d["name"].as_str().unwrap().starts_with("vgpu-"))
                .all(|d| d["allowMultipleAllocations"] == true
                    && d["capacity"]["vgpus"]["requestPolicy"]["default"] == "1"),
            "{n} A10s: a vGPU device stored without what makes it shared"
        );
        for s in &got {
            assert!(len(&s["spec"]["sharedCounters"]) <= 8);
            assert!(len(&s["spec"]["devices"]) <= 64);
            assert!(s["spec"]["devices"].is_null() || s["spec"]["sharedCounters"].is_null());
        }
        assert!(
            !d.log().contains("cannot publish"),
            "{n} A10s: a pass failed:\n{}",
            d.log()
        );
    }
}

/// An API server with consumable capacity off (`DRAConsumableCapacity=false`, as 1.34 and 1.35
/// have it by default) would drop `allowMultipleAllocations` from the shared vGPU devices, and
/// each would serve one vGPU: the driver asks first (a dry run), publishes the GPUs whole only,
/// and says why in its log, in an Event on the Node and in `/readyz`.
#[tokio::test(flavor = "multi_thread")]
async fn with_consumable_capacity_off_the_gpus_are_published_whole_only_and_it_says_why() {
    if let Some(why) = assets::unavailable() {
        assets::skip("sandbox-dra against kube-apiserver", &why);
        return;
    }
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let cp = ControlPlane::start(
        dir.path(),
        &Assets::load().unwrap(),
        ControlPlaneOpts {
            apiserver_args: vec!["--feature-gates=DRAConsumableCapacity=false".into()],
            ..ControlPlaneOpts::default()
        },
    )
    .unwrap();
    let node = support::NODE;
    let manifest = dir.path().join("node.json");
    std::fs::write(
        &manifest,
        format!(r#"{{"apiVersion": "v1", "kind": "Node", "metadata": {{"name": "{node}"}}}}"#),
    )
    .unwrap();
    cp.kubectl(&["create", "-f", manifest.to_str().unwrap()])
        .unwrap();
    let metrics = testkit::ops::free_addr();
    let d = support::serving(
        command(
            sim.root(),
            node,
            cp.admin_kubeconfig(),
            &["--vgpu", "all", "--metrics-addr", &metrics],
        ),
        &support::reg_socket(sim.root(), support::KUBELET_ROOT),
    );
    let _drv = support::register(sim.root()).await;
    let t = Instant::now();
    let got = loop {
        let s = slices(&cp, node);
        if complete(&s, 1) {
            break s;
        }
        assert!(t.elapsed() < PATIENCE, "no pool: {s:#?}\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let names: Vec<&str> = got
        .iter()
        .filter_map(|s| s["spec"]["devices"].as_array())
        .flatten()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gpu-0000-41-00-0", "gpu-0000-61-00-0"], "{got:#?}");
    for s in &got {
        assert!(s["spec"]["sharedCounters"].is_null(), "{s:#}");
        for dev in s["spec"]["devices"].as_array().into_iter().flatten() {
            assert!(dev["consumesCounters"].is_null(), "{dev:#}");
        }
    }
    let why = "allowMultipleAllocations (DRAConsumableCapacity)";
    assert!(d.log().contains(why), "{}", d.log());
    // No vGPU device was ever stored: the dry run asked before anything was written.
    let audit = std::fs::read_to_string(cp.audit_log()).unwrap();
    let stored_vgpus = audit
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| {
            e["objectRef"]["resource"] == "resourceslices"
                && e["verb"] == "patch"
                && !e["requestURI"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("dryRun")
        })
        .count();
    assert_eq!(stored_vgpus, 1, "one slice written, of whole GPUs only");
    let t = Instant::now();
    let event = loop {
        let out = cp
            .kubectl(&["get", "events.events.k8s.io", "-A", "-o", "json"])
            .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        if let Some(e) = v["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["reason"] == "VgpuPoolNotPublished")
        {
            break e.clone();
        }
        assert!(t.elapsed() < PATIENCE, "no Event:\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["regarding"]["name"], node);
    assert!(event["note"].as_str().unwrap().contains(why), "{event:#}");
    let t = Instant::now();
    loop {
        let (code, body) = testkit::ops::http_get(&metrics, "/readyz").unwrap_or_default();
        if code == 200 {
            assert!(body.contains(why) && body.contains("whole only"), "{body}");
            break;
        }
        assert!(t.elapsed() < PATIENCE, "not ready: {body}\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
