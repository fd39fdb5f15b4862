//! sandbox-dra as a process against node-sim and a real API server (etcd and kube-apiserver;
//! kube-controller-manager too where the garbage collector takes a deleted Node's slices): the
//! node's ResourceSlice as the API server validates and stores it, its generations, followed
//! through hot-plug, stale slices, kubelet's wipe and the Node's deletion. Needs the cluster
//! tier's assets (`tests/cluster/prepare.sh`); skipped without them, a failure with
//! `CLUSTER_TIER=required`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use cluster_tier::ApiServer;
use serde_json::{Value, json};
use support::{DRIVER, KUBELET_ROOT, NODE, command, reg_socket};
use testkit::Reaped;

/// A generous deadline for anything the driver should do "within a second".
const DEADLINE: Duration = Duration::from_secs(15);
const SLICE: &str = "node-a-gpu.gpu-vm-node.io";

/// `sandbox-dra serve` resyncing every `resync`, its debug log on the test's stderr; killed on
/// drop.
fn start(root: &Path, api: &ApiServer, resync: &str) -> Reaped {
    let mut cmd = command(
        root,
        NODE,
        api.admin_kubeconfig(),
        &["--resync-interval", resync],
    );
    cmd.env("RUST_LOG", "sandbox_dra=debug")
        .stdin(Stdio::null());
    Reaped(cmd.spawn().unwrap())
}

fn names(slice: &Value) -> Vec<String> {
    slice["spec"]["devices"]
        .as_array()
        .map(|d| {
            d.iter()
                .map(|d| d["name"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn generation(slice: &Value) -> i64 {
    slice["spec"]["pool"]["generation"].as_i64().unwrap()
}

/// An API server with Node `NODE`, or `None` when the tier's assets are missing (skipped).
fn api_server(controllers: bool) -> Option<ApiServer> {
    let api =
        ApiServer::start_with_or_skip("sandbox-dra's ResourceSlices", controllers).unwrap()?;
    api.create_node(NODE, &[]).unwrap();
    Some(api)
}

/// Every ResourceSlice, by name, as the API server stores it.
fn slices(api: &ApiServer) -> Vec<Value> {
    let v = api
        .get_json(&["resourceslices", "--sort-by=.metadata.name"])
        .unwrap();
    v["items"].as_array().cloned().unwrap_or_default()
}

fn slice_names(api: &ApiServer) -> Vec<String> {
    slices(api)
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

/// Polls the slices until `pred` holds, for at most `timeout`.
fn wait_for_slices(
    api: &ApiServer,
    timeout: Duration,
    pred: impl Fn(&[Value]) -> bool,
) -> Option<Vec<Value>> {
    let end = std::time::Instant::now() + timeout;
    loop {
        let s = slices(api);
        if pred(&s) {
            return Some(s);
        }
        if std::time::Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Creates a ResourceSlice as another client would (the API server validates it).
fn put_slice(api: &ApiServer, slice: Value) {
    api.apply(&slice.to_string()).unwrap();
}

fn delete_slice(api: &ApiServer, name: &str) {
    api.kubectl(&["delete", "resourceslice", name]).unwrap();
}

/// Deletes the Node and waits for the garbage collector to take the slices its UID owns;
/// returns the names of the slices that went.
fn delete_node(api: &ApiServer) -> Vec<String> {
    let before = slice_names(api);
    api.kubectl(&["delete", "node", NODE]).unwrap();
    // The garbage collector's first sync can take a while after it starts.
    let owned = |s: &Value| s["metadata"]["ownerReferences"][0]["name"] == NODE;
    let after = wait_for_slices(api, Duration::from_secs(90), |s| !s.iter().any(owned))
        .unwrap_or_else(|| panic!("the Node's slices stayed: {:#?}", slices(api)));
    let after: Vec<String> = after
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    before.into_iter().filter(|n| !after.contains(n)).collect()
}

/// Waits until the node's slice holds exactly `want` devices; returns it.
fn wait_for_devices(api: &ApiServer, want: &[&str]) -> Value {
    let found = wait_for_slices(api, DEADLINE, |s| {
        s.iter()
            .any(|s| s["metadata"]["name"] == SLICE && names(s) == want)
    });
    let Some(slices) = found else {
        panic!("the slice never held {want:?}: {:#?}", slices(api));
    };
    slices
        .into_iter()
        .find(|s| s["metadata"]["name"] == SLICE)
        .unwrap()
}

#[test]
fn a_2xa10_node_is_published_followed_through_hotplug_and_collected_with_its_node() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(api) = api_server(true) else { return };
    let node_uid = api.node(NODE).unwrap()["metadata"]["uid"].clone();
    let _d = start(sim.root(), &api, "1h");

    let slice = wait_for_devices(&api, &["gpu-0000-41-00-0", "gpu-0000-61-00-0"]);
    assert_eq!(slice["spec"]["driver"], DRIVER);
    assert_eq!(slice["spec"]["nodeName"], NODE);
    assert_eq!(
        slice["spec"]["pool"],
        json!({"name": NODE, "generation": 1, "resourceSliceCount": 1})
    );
    assert_eq!(
        slice["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": true}])
    );
    let dev = &slice["spec"]["devices"][0];
    assert_eq!(
        dev["attributes"],
        json!({
            "mode": {"string": "passthrough"},
            "vendorID": {"string": "10de"},
            "deviceID": {"string": "2236"},
            "productName": {"string": "GA102GL [A10]"},
            "resource.kubernetes.io/pciBusID": {"string": "0000:41:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:40"},
            "resource.kubernetes.io/numaNode": {"int": 0},
            "numaNode": {"int": 0},
            "iommuGroup": {"int": 21},
            "functions": {"int": 1},
            "vfioDriver": {"string": "vfio-pci"},
        })
    );
    assert_eq!(dev["capacity"], json!({"memory": {"value": "24Gi"}}));
    assert_eq!(
        slice["spec"]["devices"][1]["attributes"]["resource.kubernetes.io/pciBusID"],
        json!({"string": "0000:61:00.0"})
    );

    // A GPU hot-plugged: published from the uevent alone (the resync is an hour), in place:
    // the pool's one slice keeps its generation (one write cannot show a mix of two).
    sim.control("hotplug 0000:81:00.0 A10 group=50 numa=1")
        .unwrap();
    let slice = wait_for_devices(
        &api,
        &["gpu-0000-41-00-0", "gpu-0000-61-00-0", "gpu-0000-81-00-0"],
    );
    assert_eq!(generation(&slice), 1);
    let new = &slice["spec"]["devices"][2]["attributes"];
    assert_eq!(new["numaNode"], json!({"int": 1}));
    assert_eq!(new["iommuGroup"], json!({"int": 50}));

    sim.control("unplug 0000:81:00.0").unwrap();
    let slice = wait_for_devices(&api, &["gpu-0000-41-00-0", "gpu-0000-61-00-0"]);
    assert_eq!(generation(&slice), 1);

    // The Node deleted: the garbage collector follows the owner reference.
    assert_eq!(delete_node(&api), [SLICE]);
    assert!(slices(&api).is_empty());
}

#[test]
fn stale_slices_go_at_start_and_a_wiped_slice_comes_back_with_a_higher_generation() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(api) = api_server(true) else { return };
    let slice = |name: &str, node: &str, driver: &str, generation: i64| {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": []},
        })
    };
    // Ours from an earlier run (its devices since gone), one under an older name, another
    // node's and another driver's on this node.
    put_slice(&api, slice(SLICE, NODE, DRIVER, 7));
    put_slice(
        &api,
        slice("node-a-gpu.gpu-vm-node.io-x1z2", NODE, DRIVER, 2),
    );
    put_slice(
        &api,
        slice("node-b-gpu.gpu-vm-node.io", "node-b", DRIVER, 1),
    );
    put_slice(
        &api,
        slice("node-a-other.example.com", NODE, "other.example.com", 1),
    );
    // No resync within the test: what follows is the watches' doing.
    let _d = start(sim.root(), &api, "1h");

    let slice = wait_for_devices(&api, &["gpu-0000-41-00-0", "gpu-0000-61-00-0"]);
    assert_eq!(generation(&slice), 8, "one above the generation it found");
    let left = slice_names(&api);
    assert_eq!(
        left,
        [
            "node-a-gpu.gpu-vm-node.io",
            "node-a-other.example.com",
            "node-b-gpu.gpu-vm-node.io"
        ]
    );

    // kubelet wipes the node's slices when it starts: the watch shows it, and the slice is
    // back with a generation above any seen.
    delete_slice(&api, SLICE);
    let slice = wait_for_devices(&api, &["gpu-0000-41-00-0", "gpu-0000-61-00-0"]);
    assert_eq!(generation(&slice), 9);

    // What the resyncs ask of the API server (nothing) is tests/requests.rs's.
    let stored = api.get_json(&["resourceslice", SLICE]).unwrap();
    assert_eq!(generation(&stored), 9);

    // The Node deleted (its slice collected with it) and registered again: the watch shows the
    // slice gone, the Node is read again, and the slice comes back owned by its new UID, not by
    // the UID the driver saw first.
    assert_eq!(delete_node(&api), [SLICE]);
    api.create_node(NODE, &[]).unwrap();
    let new_uid = api.node(NODE).unwrap()["metadata"]["uid"].clone();
    let found = wait_for_slices(&api, DEADLINE, |s| {
        s.iter().any(|s| {
            s["metadata"]["name"] == SLICE && s["metadata"]["ownerReferences"][0]["uid"] == new_uid
        })
    });
    assert!(found.is_some(), "{:#?}", slices(&api));
}

/// kubelet wipes a node's slices when it starts, then registers the driver again: the driver
/// puts its slice back (the watch shows the wipe, and the registration asks for a pass), not
/// only at the next resync (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_wiped_by_kubelet_is_back_when_kubelet_registers_the_driver() {
    use kubelet_api::pluginregistration::registration_client::RegistrationClient;
    use kubelet_api::pluginregistration::{InfoRequest, RegistrationStatus};

    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(api) = tokio::task::block_in_place(|| api_server(false)) else {
        return;
    };
    let _d = start(sim.root(), &api, "1h");
    let api = std::sync::Arc::new(api);
    let wait = |want: &'static [&'static str]| {
        let api = api.clone();
        tokio::task::spawn_blocking(move || wait_for_devices(&api, want))
    };
    let both: &[&str] = &["gpu-0000-41-00-0", "gpu-0000-61-00-0"];
    let slice = wait(both).await.unwrap();
    assert_eq!(generation(&slice), 1);

    tokio::task::block_in_place(|| delete_slice(&api, SLICE));
    let socket = reg_socket(sim.root(), KUBELET_ROOT);
    let channel = testkit::kubelet::unix_channel(&socket).await.unwrap();
    let mut reg = RegistrationClient::new(channel);
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.name, DRIVER);
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    let slice = wait(both).await.unwrap();
    assert_eq!(generation(&slice), 2);
}

#[test]
fn a_gpu_travels_with_its_audio_function_and_a_new_group_member_changes_the_device() {
    let Some(sim) = testkit::sim::try_mount("rtx-workstation") else {
        return;
    };
    let Some(api) = api_server(false) else { return };
    let _d = start(sim.root(), &api, "1h");

    let slice = wait_for_devices(&api, &["gpu-0000-01-00-0"]);
    let dev = &slice["spec"]["devices"][0];
    assert_eq!(
        dev["attributes"]["companions"],
        json!({"string": "0000:01:00.1"})
    );
    assert_eq!(dev["attributes"]["functions"], json!({"int": 2}));
    assert_eq!(dev["attributes"]["iommuGroup"], json!({"int": 12}));
    assert_eq!(
        dev["attributes"]["resource.kubernetes.io/pciBusID"],
        json!({"string": "0000:01:00.0"})
    );
    assert_eq!(
        dev["capacity"],
        Value::Null,
        "the RTX 4090 is not in the model table"
    );
    assert_eq!(generation(&slice), 1);

    // A second GPU hot-plugged into the same IOMMU group: still one device (the group goes to
    // a VM whole), which now carries it, in place.
    sim.control("hotplug 0000:01:00.2 A10 group=12").unwrap();
    let found = wait_for_slices(&api, DEADLINE, |s| {
        s.first().is_some_and(|s| {
            s["spec"]["devices"][0]["attributes"]["companions"]
                == json!({"string": "0000:01:00.1,0000:01:00.2"})
        })
    });
    let slice = &found.expect("the device never listed the new group member")[0];
    assert_eq!(names(slice), ["gpu-0000-01-00-0"]);
    assert_eq!(
        slice["spec"]["devices"][0]["attributes"]["functions"],
        json!({"int": 3})
    );
    assert_eq!(generation(slice), 1);
}
