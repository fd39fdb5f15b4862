//! `--vgpu-types`: only the listed vGPU types are published, on simulated nodes (node-sim) with
//! the fake kubelet and a real API server (the cluster tier's assets; skipped without them),
//! which validates and stores the slices and holds the claims as the scheduler allocates them;
//! a device of another type is refused at prepare, and an entry that is no vGPU type stops the
//! driver at start (exit 2) before it changes anything.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use cluster_tier::ApiServer;
use serde_json::{Value, json};
use support::{
    DRIVER, Driver, KUBELET_ROOT, NODE, NS, PATIENCE, claim, command, mdev_count, prepare,
    reg_socket, register, serving, share_id, unprepare,
};
use testkit::kubelet::dra::Claim;
use testkit::sim::try_mount;

/// The class of the claims.
const VGPU: &str = "vgpu.gpu-vm-node.io";

/// A real API server with this node's Node, or `None` (said as `skipped`).
fn api_server(what: &str) -> Option<ApiServer> {
    let api = ApiServer::start_or_skip(what).unwrap()?;
    api.create_node(NODE, &[]).unwrap();
    Some(api)
}

/// sandbox-dra serving `root` with `args` for node `NODE` against `api`, once its registration
/// socket is there.
fn start(root: &Path, api: &ApiServer, args: &[&str]) -> Driver {
    serving(
        command(root, NODE, api.admin_kubeconfig(), args),
        &reg_socket(root, KUBELET_ROOT),
    )
}

/// Claim `name` of `NS` for request `gpu` of class `class`, allocated `device` of this node
/// with a share of its own (a vGPU type's shared device), as the scheduler writes it.
fn put_claim(api: &ApiServer, name: &str, class: &str, device: &str) -> Claim {
    let uid = api
        .put_allocated_claim(
            NS,
            name,
            json!([{"name": "gpu", "exactly": {"deviceClassName": class}}]),
            json!([{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device,
                    "shareID": share_id(name, 0)}]),
        )
        .unwrap();
    claim(name, &uid)
}

/// The node's slices of the driver, as the API server stores them.
fn slices(api: &ApiServer) -> Vec<Value> {
    let v = api
        .get_json(&[
            "resourceslices",
            "--field-selector",
            &format!("spec.nodeName={NODE},spec.driver={DRIVER}"),
        ])
        .unwrap();
    v["items"].as_array().cloned().unwrap_or_default()
}

/// The node's slices once `f` holds of them, or `None` after `PATIENCE`.
fn wait_for_slices(api: &ApiServer, f: impl Fn(&[Value]) -> bool) -> Option<Vec<Value>> {
    let t = Instant::now();
    loop {
        let s = slices(api);
        if f(&s) {
            return Some(s);
        }
        if t.elapsed() > PATIENCE {
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// sandbox-dra with `args` run to its end (it must stop by itself): its exit code and log.
fn run_to_end(root: &Path, api: &ApiServer, args: &[&str]) -> (Option<i32>, String) {
    let mut d = Driver::spawn(command(root, NODE, api.admin_kubeconfig(), args));
    let t = Instant::now();
    let status = loop {
        if let Some(st) = d.process.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < PATIENCE,
            "sandbox-dra {args:?} did not stop:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    (status.code(), d.log())
}

/// Each tainted device with its taint's value (the reason).
fn tainted(slices: &[Value]) -> BTreeMap<String, String> {
    slices
        .iter()
        .filter_map(|s| s["spec"]["devices"].as_array())
        .flatten()
        .filter_map(|d| {
            let reason = d["taints"][0]["value"].as_str()?;
            Some((d["name"].as_str()?.to_string(), reason.to_string()))
        })
        .collect()
}

/// Per GPU (`0000-41-00-0`), its vGPU types in the slices (`a10-4q`), each with how many
/// vGPUs its shared device holds; tainted devices are not offered.
fn vgpus(slices: &[Value]) -> BTreeMap<String, BTreeMap<String, usize>> {
    let mut out: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for d in slices
        .iter()
        .filter_map(|s| s["spec"]["devices"].as_array())
        .flatten()
        .filter(|d| d["taints"].is_null())
    {
        let name = d["name"].as_str().unwrap();
        let Some(rest) = name.strip_prefix("vgpu-") else {
            continue;
        };
        let (gpu, tail) = rest.split_at(12);
        let holds: usize = d["capacity"]["vgpus"]["value"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        out.entry(gpu.to_string())
            .or_default()
            .insert(tail[1..].to_string(), holds);
    }
    out
}

fn device_names(slices: &[Value]) -> BTreeSet<String> {
    slices
        .iter()
        .filter_map(|s| s["spec"]["devices"].as_array())
        .flatten()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect()
}

fn types(pairs: &[(&str, usize)]) -> BTreeMap<String, usize> {
    pairs.iter().map(|(k, n)| (k.to_string(), *n)).collect()
}

/// `--vgpu-types A10-4Q,a10-8q` on 2xA10: each GPU publishes an A10-4Q device holding six and
/// an A10-8Q device holding three beside its whole self and its counter set, nothing else. A
/// device of a type not listed is refused at prepare, nothing made; a vGPU made for a claim
/// before the list changed stays the claim's.
#[tokio::test(flavor = "multi_thread")]
async fn only_the_listed_vgpu_types_are_published_and_prepared() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let Some(api) = api_server("--vgpu-types on a real API server") else {
        return;
    };
    let d = start(
        root,
        &api,
        &["--vgpu", "all", "--vgpu-types", "A10-4Q, a10-8q"],
    );
    let drv = register(root).await;
    let both = types(&[("a10-4q", 6), ("a10-8q", 3)]);
    let four = types(&[("a10-4q", 6)]);
    let offers = |a: &BTreeMap<String, usize>, b: &BTreeMap<String, usize>| {
        // A GPU offering no vGPU has no entry.
        let want: BTreeMap<String, BTreeMap<String, usize>> = [
            ("0000-41-00-0".to_string(), a.clone()),
            ("0000-61-00-0".to_string(), b.clone()),
        ]
        .into_iter()
        .filter(|(_, t)| !t.is_empty())
        .collect();
        move |s: &[Value]| vgpus(s) == want && support::whole_pools(s)
    };
    let published = wait_for_slices(&api, offers(&both, &both))
        .unwrap_or_else(|| panic!("{:?}\n{}", vgpus(&slices(&api)), d.log()));
    let names = device_names(&published);
    assert!(
        names.contains("gpu-0000-41-00-0") && names.contains("gpu-0000-61-00-0"),
        "{names:?}"
    );
    assert_eq!(names.len(), 2 + 2 * 2, "{names:?}");
    let sets: usize = published
        .iter()
        .filter_map(|s| s["spec"]["sharedCounters"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(sets, 2);
    assert!(d.log().contains("vGPU types published"), "{}", d.log());

    // A type the list leaves out is no device of this driver.
    let other = put_claim(&api, "small", VGPU, "vgpu-0000-41-00-0-a10-2q");
    let e = prepare(&drv, &other).await.unwrap_err();
    assert!(
        e.contains("publishes no vGPU of type") && e.contains("a10-2q"),
        "{e}"
    );
    assert_eq!(mdev_count(root), 0);

    let claim = put_claim(&api, "four", VGPU, "vgpu-0000-41-00-0-a10-4q");
    prepare(&drv, &claim).await.unwrap();
    assert_eq!(mdev_count(root), 1);
    unprepare(&drv, &claim).await.unwrap();
    assert_eq!(mdev_count(root), 0);

    // An A10-8Q prepared, then the driver started again with A10-4Q only: the claim's device
    // stays published, tainted "not-offered", so the scheduler keeps counting it and places
    // nothing new on it; kubelet's repeated prepare keeps the vGPU made, and unprepare removes
    // it, and then the device.
    let eight = put_claim(&api, "eight", VGPU, "vgpu-0000-61-00-0-a10-8q");
    prepare(&drv, &eight).await.unwrap();
    drop(d);
    let d = start(root, &api, &["--vgpu", "all", "--vgpu-types", "A10-4Q"]);
    let drv = register(root).await;
    let held: BTreeMap<String, String> = [(
        "vgpu-0000-61-00-0-a10-8q".to_string(),
        "not-offered".to_string(),
    )]
    .into();
    let four_and_held = offers(&four, &four);
    wait_for_slices(&api, |s| four_and_held(s) && tainted(s) == held)
        .unwrap_or_else(|| panic!("{:?}\n{}", slices(&api), d.log()));
    prepare(&drv, &eight)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(mdev_count(root), 1);
    unprepare(&drv, &eight).await.unwrap();
    assert_eq!(mdev_count(root), 0);
    let four_only = offers(&four, &four);
    wait_for_slices(&api, |s| four_only(s) && tainted(s).is_empty())
        .unwrap_or_else(|| panic!("{:?}\n{}", slices(&api), d.log()));
}

/// A type of no GPU model (a typo) stops the driver at start with exit 2, naming the entry and
/// the node's GPUs with their own types; nothing is written (no pool file, no slice). A type
/// of another model is accepted: it matches nothing here, and the GPUs are published whole.
#[tokio::test(flavor = "multi_thread")]
async fn an_entry_that_is_no_vgpu_type_is_refused_at_start() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let Some(api) = api_server("--vgpu-types refused at start") else {
        return;
    };
    let (code, log) = run_to_end(
        root,
        &api,
        &["--vgpu", "all", "--vgpu-types", "A10-4Q,A10-5Q"],
    );
    assert_eq!(code, Some(2), "{log}");
    for want in [
        "--vgpu-types",
        "\"A10-5Q\" is no vGPU type",
        "GPUs 0000:41:00.0, 0000:61:00.0 (A10) publish A10-1Q, A10-2Q, A10-3Q, A10-4Q",
        "A10-24C",
    ] {
        assert!(log.contains(want), "{want:?} not in:\n{log}");
    }
    assert!(!root.join("run/gpu-vm-node/dra-pool").exists());
    assert!(slices(&api).is_empty(), "{:?}", slices(&api));

    // --vgpu-types alone selects types of nothing: a usage error.
    let (code, log) = run_to_end(root, &api, &["--vgpu-types", "A10-4Q"]);
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("--vgpu"), "{log}");

    // Another model's type: started, and each A10 published whole only.
    let d = start(root, &api, &["--vgpu", "all", "--vgpu-types", "L40S-8Q"]);
    let published = wait_for_slices(&api, |s| {
        device_names(s).contains("gpu-0000-61-00-0")
            && s.iter().any(|s| s["spec"]["sharedCounters"].is_array())
    })
    .unwrap_or_else(|| panic!("{:#?}\n{}", slices(&api), d.log()));
    assert!(vgpus(&published).is_empty(), "{:?}", vgpus(&published));
    assert!(
        d.log()
            .contains("none of --vgpu-types is a type of this GPU"),
        "{}",
        d.log()
    );
}
