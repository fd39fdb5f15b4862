//! sandbox-dra as a process against node-sim and the fake API server: the node's ResourceSlice
//! as published, followed through hot-plug, stale slices and the Node's deletion.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use testkit::apiserver::{FakeApiServer, NODE_UID};

/// A generous deadline for anything the driver should do "within a second".
const DEADLINE: Duration = Duration::from_secs(15);
const BIN: &str = env!("CARGO_BIN_EXE_sandbox-dra");
const NODE: &str = "node-a";
const DRIVER: &str = "gpu.gpu-vm-node.io";
const SLICE: &str = "node-a-gpu.gpu-vm-node.io";

/// A running `sandbox-dra serve`; killed on drop.
struct Driver(Child);

impl Driver {
    fn start(root: &Path, api: &FakeApiServer, resync: &str) -> Driver {
        let child = Command::new(BIN)
            .arg("serve")
            .arg("--host-root")
            .arg(root)
            .args(["--node-name", NODE, "--resync-interval", resync])
            .arg("--kubeconfig")
            .arg(api.kubeconfig())
            .env("RUST_LOG", "sandbox_dra=debug")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Driver(child)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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

/// Waits until the node's slice holds exactly `want` devices; returns it.
fn wait_for_devices(api: &FakeApiServer, want: &[&str]) -> Value {
    let found = api.wait_for_slices(DEADLINE, |s| {
        s.iter()
            .any(|s| s["metadata"]["name"] == SLICE && names(s) == want)
    });
    let Some(slices) = found else {
        panic!("the slice never held {want:?}: {:#?}", api.slices());
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
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = Driver::start(sim.root(), &api, "1h");

    let slice = wait_for_devices(&api, &["gpu-0000-41-00-0", "gpu-0000-61-00-0"]);
    assert_eq!(slice["spec"]["driver"], DRIVER);
    assert_eq!(slice["spec"]["nodeName"], NODE);
    assert_eq!(
        slice["spec"]["pool"],
        json!({"name": NODE, "generation": 1, "resourceSliceCount": 1})
    );
    assert_eq!(
        slice["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE_UID, "controller": true}])
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

    // A GPU hot-plugged: published with the next generation, from the uevent alone (the
    // resync is an hour).
    sim.control("hotplug 0000:81:00.0 A10 group=50 numa=1")
        .unwrap();
    let slice = wait_for_devices(
        &api,
        &["gpu-0000-41-00-0", "gpu-0000-61-00-0", "gpu-0000-81-00-0"],
    );
    assert_eq!(generation(&slice), 2);
    let new = &slice["spec"]["devices"][2]["attributes"];
    assert_eq!(new["numaNode"], json!({"int": 1}));
    assert_eq!(new["iommuGroup"], json!({"int": 50}));

    sim.control("unplug 0000:81:00.0").unwrap();
    let slice = wait_for_devices(&api, &["gpu-0000-41-00-0", "gpu-0000-61-00-0"]);
    assert_eq!(generation(&slice), 3);

    // The Node deleted: the garbage collector follows the owner reference.
    assert_eq!(api.delete_node(), [SLICE]);
    assert!(api.slices().is_empty());
}

#[test]
fn stale_slices_go_at_start_and_a_wiped_slice_comes_back_with_a_higher_generation() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let api = FakeApiServer::start(NODE, &[]).unwrap();
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
    api.put_slice(slice(SLICE, NODE, DRIVER, 7));
    api.put_slice(slice("node-a-gpu.gpu-vm-node.io-x1z2", NODE, DRIVER, 2));
    api.put_slice(slice("node-b-gpu.gpu-vm-node.io", "node-b", DRIVER, 1));
    api.put_slice(slice(
        "node-a-other.example.com",
        NODE,
        "other.example.com",
        1,
    ));
    let _d = Driver::start(sim.root(), &api, "1s");

    let slice = wait_for_devices(&api, &["gpu-0000-41-00-0", "gpu-0000-61-00-0"]);
    assert_eq!(generation(&slice), 8, "one above the generation it found");
    let left: Vec<String> = api
        .slices()
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        left,
        [
            "node-a-gpu.gpu-vm-node.io",
            "node-a-other.example.com",
            "node-b-gpu.gpu-vm-node.io"
        ]
    );

    // kubelet wipes the node's slices when it starts: the resync puts it back, with a
    // generation above any seen.
    assert!(api.delete_slice(SLICE));
    let slice = wait_for_devices(&api, &["gpu-0000-41-00-0", "gpu-0000-61-00-0"]);
    assert_eq!(generation(&slice), 9);

    // Nothing changed: resyncs read the node's slices (a list) and write nothing.
    let count = |method: &str| {
        let target = match method {
            "GET" => "GET /apis/resource.k8s.io/v1/resourceslices?".to_string(),
            _ => format!("{method} /apis/resource.k8s.io/v1/resourceslices/{SLICE}?"),
        };
        api.requests()
            .iter()
            .filter(|r| r.starts_with(&target))
            .count()
    };
    let (reads, writes) = (count("GET"), count("PATCH"));
    let deadline = std::time::Instant::now() + DEADLINE;
    while count("GET") < reads + 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no resync read the slice"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(count("PATCH"), writes, "a resync wrote an unchanged slice");
    assert_eq!(generation(&api.slice(SLICE).unwrap()), 9);

    // The Node deleted (its slice collected with it) and registered again: the slice comes
    // back owned by the new Node, not by the UID the driver saw first.
    assert_eq!(api.delete_node(), [SLICE]);
    api.recreate_node("uid-of-the-new-node");
    let found = api.wait_for_slices(DEADLINE, |s| {
        s.iter().any(|s| {
            s["metadata"]["name"] == SLICE
                && s["metadata"]["ownerReferences"][0]["uid"] == "uid-of-the-new-node"
        })
    });
    assert!(found.is_some(), "{:#?}", api.slices());
}

/// kubelet wipes a node's slices when it starts, then registers the driver again: the driver
/// puts its slice back on that registration, not only at the next resync (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_wiped_by_kubelet_is_back_when_kubelet_registers_the_driver() {
    use kubelet_api::pluginregistration::registration_client::RegistrationClient;
    use kubelet_api::pluginregistration::{InfoRequest, RegistrationStatus};

    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = Driver::start(sim.root(), &api, "1h");
    let api = std::sync::Arc::new(api);
    let wait = |want: &'static [&'static str]| {
        let api = api.clone();
        tokio::task::spawn_blocking(move || wait_for_devices(&api, want))
    };
    let both: &[&str] = &["gpu-0000-41-00-0", "gpu-0000-61-00-0"];
    let slice = wait(both).await.unwrap();
    assert_eq!(generation(&slice), 1);

    assert!(api.delete_slice(SLICE));
    let socket = sim
        .root()
        .join("var/lib/kubelet/plugins_registry/gpu.gpu-vm-node.io-reg.sock");
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
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = Driver::start(sim.root(), &api, "1h");

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
    // a VM whole), which now carries it; the generation moves on.
    sim.control("hotplug 0000:01:00.2 A10 group=12").unwrap();
    let found = api.wait_for_slices(DEADLINE, |s| {
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
    assert_eq!(generation(slice), 2);
}
