//! sandbox-dra as a process on simulated nodes (node-sim), driven by the fake kubelet the way
//! kubelet 1.36 drives it (registration through the percent-encoded socket path as
//! `:authority`, then `NodePrepareResources` / `NodeUnprepareResources`), reading claims from
//! the fake API server. What is checked is what kubelet, the container runtime and KubeVirt
//! see: driver links, the CDI spec and the `/dev/vfio` nodes it names, the device-metadata
//! file, the answers' errors; and node-sim's log of writes.
//!
//! Each test mounts its own node and prints `skipped: ...` when FUSE or root is missing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on setup failures

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{
    DRIVER, KUBELET_ROOT, NODE, NS, PATIENCE, claim, command, driver_of, prepare_one, read_json,
    read_metadata, reg_socket, register, register_at, serving, start, under, unprepare_one,
};
use testkit::apiserver::FakeApiServer;
use testkit::kubelet::dra::{Claim, DraDriver, Version};
use testkit::sim::{SimDir, try_mount};

/// [`start`] with `--kubelet-root kubelet_root`.
fn start_at(root: &Path, api: &FakeApiServer, kubelet_root: &str) -> support::Driver {
    serving(
        command(
            root,
            NODE,
            api.kubeconfig(),
            &["--kubelet-root", kubelet_root],
        ),
        &reg_socket(root, kubelet_root),
    )
}

/// [`start`], the process started with `umask` (by a shell that sets it and execs sandbox-dra).
fn start_with_umask(root: &Path, api: &FakeApiServer, umask: &str) -> support::Driver {
    let cmd = command(root, NODE, api.kubeconfig(), &[]);
    let mut sh = Command::new("sh");
    sh.args(["-c", &format!("umask {umask} && exec \"$0\" \"$@\"")])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (var, value) in cmd.get_envs() {
        match value {
            Some(v) => sh.env(var, v),
            None => sh.env_remove(var),
        };
    }
    serving(sh, &reg_socket(root, KUBELET_ROOT))
}

/// A claim allocated the named devices of this node, for request `gpu`.
fn claim_json(name: &str, uid: &str, devices: &[&str]) -> Value {
    json!({
        "metadata": {"namespace": NS, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "vfio.gpu.gpu-vm-node.io"}}
        ]}},
        "status": {"allocation": {"devices": {"results": devices.iter().map(|d| json!({
            "request": "gpu", "driver": DRIVER, "pool": NODE, "device": d,
        })).collect::<Vec<_>>()}}},
    })
}

fn cdi_spec_path(root: &Path, uid: &str) -> PathBuf {
    root.join(format!("var/run/cdi/{DRIVER}_{uid}.json"))
}

/// The device nodes the CDI spec gives the device whose CDI name ends with `device`.
fn spec_nodes(spec: &Value, device: &str) -> Vec<String> {
    let d = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"].as_str().unwrap().ends_with(device))
        .unwrap_or_else(|| panic!("no CDI device for {device}: {spec}"));
    d["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap().to_string())
        .collect()
}

/// The one request's metadata of the spec: (host path, container path) of the stream, where
/// KEP-5304 (and KubeVirt 1.8.3 and later) has it. Beside it, where KubeVirt 1.8.0 to 1.8.2
/// read it, a plain file of the stream's `v1alpha1` object (checked when it is there).
fn spec_metadata_mount(spec: &Value) -> (String, String) {
    let mounts: Vec<&Value> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["containerEdits"]["mounts"].as_array())
        .flatten()
        .collect();
    assert_eq!(mounts.len(), 2, "{spec}");
    let legacy = mounts[1]["containerPath"].as_str().unwrap();
    assert!(
        legacy.starts_with("/var/run/dra-device-attributes/"),
        "{legacy}"
    );
    let (stream, plain) = (
        mounts[0]["hostPath"].as_str().unwrap(),
        mounts[1]["hostPath"].as_str().unwrap(),
    );
    assert!(plain.ends_with("/metadata-v1alpha1.json"), "{plain}");
    assert_eq!(
        Path::new(stream).parent(),
        Path::new(plain).parent(),
        "{spec}"
    );
    (
        mounts[0]["hostPath"].as_str().unwrap().to_string(),
        mounts[0]["containerPath"].as_str().unwrap().to_string(),
    )
}

fn record_path(root: &Path, uid: &str) -> PathBuf {
    root.join(format!(
        "var/lib/kubelet/plugins/{DRIVER}/claims/{uid}.json"
    ))
}

/// sysfs writes node-sim logged since the last clear.
fn writes(sim: &SimDir) -> Vec<String> {
    sim.ops()
        .into_iter()
        .filter(|o| !o.path.contains("node-sim/"))
        .map(|o| format!("{} {} {}", o.path, o.value, o.result))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn two_a10_claim_binds_both_and_hands_kubevirt_the_vfio_nodes_and_pci_address() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start(root, &api, &[]);
    let drv = register(root).await;
    assert_eq!(drv.info.r#type, "DRAPlugin");
    assert_eq!(drv.info.name, DRIVER);
    assert_eq!(
        drv.info.endpoint,
        format!("/var/lib/kubelet/plugins/{DRIVER}/dra.sock")
    );
    assert!(drv.supports(Version::V1) && drv.supports(Version::V1beta1));

    api.put_claim(claim_json(
        "vm1-gpu",
        "uid-1",
        &["gpu-0000-41-00-0", "gpu-0000-61-00-0"],
    ));
    let c = claim("vm1-gpu", "uid-1");
    let devices = prepare_one(&drv, Version::V1, &c).await.unwrap();
    assert_eq!(devices.len(), 2, "{devices:?}");
    for (bdf, name, group) in [
        ("0000:41:00.0", "gpu-0000-41-00-0", 21),
        ("0000:61:00.0", "gpu-0000-61-00-0", 37),
    ] {
        assert_eq!(driver_of(root, bdf).as_deref(), Some("vfio-pci"), "{bdf}");
        let dev = devices.iter().find(|d| d.device_name == name).unwrap();
        assert_eq!(dev.pool_name, NODE);
        assert_eq!(dev.request_names, vec!["gpu".to_string()]);
        assert_eq!(
            dev.cdi_device_ids,
            vec![
                format!("{DRIVER}/vfio=uid-1-{name}"),
                format!("{DRIVER}/vfio=uid-1-metadata-gpu"),
            ]
        );
        let spec = read_json(&cdi_spec_path(root, "uid-1"));
        assert_eq!(spec["kind"], format!("{DRIVER}/vfio"));
        let nodes = spec_nodes(&spec, name);
        assert_eq!(
            nodes,
            vec!["/dev/vfio/vfio".to_string(), format!("/dev/vfio/{group}")]
        );
        assert!(under(root, &nodes[1]).exists(), "{} exists", nodes[1]);
    }
    // The metadata file, where the spec mounts it from and to.
    let spec = read_json(&cdi_spec_path(root, "uid-1"));
    let (host, container) = spec_metadata_mount(&spec);
    assert_eq!(
        container,
        format!(
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm1-gpu/gpu/{DRIVER}-metadata.json"
        )
    );
    let meta = read_metadata(&under(root, &host));
    assert_eq!(meta["apiVersion"], "metadata.resource.k8s.io/v1alpha1");
    assert_eq!(meta["metadata"]["generation"], 1);
    // The same, one plain object, where KubeVirt 1.8.0 to 1.8.2 read it.
    let plain = read_json(&under(root, &host).with_file_name("metadata-v1alpha1.json"));
    assert_eq!(plain, meta);
    assert_eq!(meta["metadata"]["uid"], "uid-1");
    let ids: Vec<&str> = meta["requests"][0]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(ids, vec!["0000:41:00.0", "0000:61:00.0"]);

    // kubelet calls again (here in v1beta1): the same answer, nothing written.
    let files = [
        cdi_spec_path(root, "uid-1"),
        under(root, &host),
        record_path(root, "uid-1"),
    ];
    let before: Vec<_> = files
        .iter()
        .map(|f| common::state::file_identity(f).unwrap())
        .collect();
    sim.clear_ops();
    let again = prepare_one(&drv, Version::V1beta1, &c).await.unwrap();
    assert_eq!(again, devices);
    assert_eq!(writes(&sim), Vec::<String>::new());
    let after: Vec<_> = files
        .iter()
        .map(|f| common::state::file_identity(f).unwrap())
        .collect();
    assert_eq!(before, after, "no file rewritten");
}

/// A claim whose request `gpu` has `firstAvailable` subrequests, allocated `gpu/a10` as the
/// scheduler writes it.
fn first_available_claim_json(name: &str, uid: &str, device: &str) -> Value {
    json!({
        "metadata": {"namespace": NS, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": [
            {"name": "a10", "deviceClassName": "vfio-gpu.gpu-vm-node.io"},
            {"name": "any", "deviceClassName": "vfio-gpu.gpu-vm-node.io"},
        ]}]}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu/a10", "driver": DRIVER, "pool": NODE, "device": device,
        }]}}},
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_first_available_claim_is_answered_by_its_request_and_names_both_in_metadata() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    // A umask that would leave the files to root alone.
    let _d = start_with_umask(root, &api, "077");
    let drv = register(root).await;
    api.put_claim(first_available_claim_json(
        "vm1-gpu",
        "uid-fa",
        "gpu-0000-41-00-0",
    ));
    let c = claim("vm1-gpu", "uid-fa");
    for v in [Version::V1, Version::V1beta1] {
        let devices = prepare_one(&drv, v, &c).await.unwrap();
        assert_eq!(devices.len(), 1, "{devices:?}");
        // kubelet gives a container the CDI devices of the requests it names: `gpu`.
        assert_eq!(devices[0].request_names, vec!["gpu".to_string()], "{v:?}");
        assert_eq!(
            devices[0].cdi_device_ids,
            vec![
                format!("{DRIVER}/vfio=uid-fa-gpu-0000-41-00-0"),
                format!("{DRIVER}/vfio=uid-fa-metadata-gpu"),
            ]
        );
    }
    let spec = read_json(&cdi_spec_path(root, "uid-fa"));
    let (host, container) = spec_metadata_mount(&spec);
    assert!(
        container.ends_with(&format!(
            "/resourceclaims/vm1-gpu/gpu/{DRIVER}-metadata.json"
        )),
        "{container}"
    );
    // The metadata names what was allocated: the subrequest; and the same device under the
    // top-level request, which a VMI's `requestName` names (KubeVirt looks that up).
    let meta = read_metadata(&under(root, &host));
    assert_eq!(meta["requests"][0]["name"], "gpu/a10", "{meta}");
    assert_eq!(meta["requests"][1]["name"], "gpu", "{meta}");
    assert_eq!(
        meta["requests"][1]["devices"], meta["requests"][0]["devices"],
        "{meta}"
    );
    // Every attribute the slice publishes, the standard ones among them.
    let attrs = &meta["requests"][0]["devices"][0]["attributes"];
    for (k, v) in [
        (
            "resource.kubernetes.io/pciBusID",
            json!({"string": "0000:41:00.0"}),
        ),
        (
            "resource.kubernetes.io/pcieRoot",
            json!({"string": "pci0000:40"}),
        ),
        ("resource.kubernetes.io/numaNode", json!({"int": 0})),
        ("numaNode", json!({"int": 0})),
        ("productName", json!({"string": "GA102GL [A10]"})),
        ("iommuGroup", json!({"int": 21})),
        ("vfioDriver", json!({"string": "vfio-pci"})),
        ("mode", json!({"string": "passthrough"})),
    ] {
        assert_eq!(attrs[k], v, "{k}: {meta}");
    }
    // Readable by virt-launcher's own user whatever the driver's umask; so is the CDI spec.
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let file = under(root, &host);
    assert_eq!(mode(&file), 0o644, "{}", file.display());
    assert_eq!(mode(file.parent().unwrap()), 0o755);
    assert_eq!(mode(file.parent().unwrap().parent().unwrap()), 0o755);
    assert_eq!(mode(&cdi_spec_path(root, "uid-fa")), 0o644);
}

#[tokio::test(flavor = "multi_thread")]
async fn names_from_the_api_that_would_leave_their_directory_are_refused_before_any_write() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, &["--vgpu", "all"]);
    let drv = register(root).await;
    let escape = "../../../../../../tmp/x";
    let mut cases: Vec<(&str, Value)> = Vec::new();
    let mut c = claim_json("vm1-gpu", "uid-h1", &["gpu-0000-41-00-0"]);
    c["metadata"]["annotations"] = json!({"resource.kubernetes.io/pod-claim-name": escape});
    cases.push(("resource.kubernetes.io/pod-claim-name", c));
    let mut c = claim_json("vm1-gpu", "uid-h2", &["gpu-0000-41-00-0"]);
    c["status"]["allocation"]["devices"]["results"][0]["request"] = json!(escape);
    cases.push(("request", c));
    let mut c = claim_json("vm1-gpu", "uid-h3", &["gpu-0000-41-00-0"]);
    c["status"]["allocation"]["devices"]["results"][0]["device"] = json!("gpu-0000-41-00-0/../x");
    cases.push(("device", c));
    // A type the GPU does not have, in a well-formed name: nothing is written for it either
    // (not even the VFs it would need).
    let c = claim_json("vm1-gpu", "uid-h4", &["vgpu-0000-41-00-0-a10-99q-0"]);
    cases.push(("a10-99q", c));
    sim.clear_ops();
    for (what, c) in cases {
        let uid = c["metadata"]["uid"].as_str().unwrap().to_string();
        api.put_claim(c);
        let err = prepare_one(&drv, Version::V1, &claim("vm1-gpu", &uid))
            .await
            .unwrap_err();
        assert!(err.contains(what), "{what}: {err}\n{}", d.log());
        assert!(!cdi_spec_path(root, &uid).exists(), "{what}: a CDI spec");
        assert!(!record_path(root, &uid).exists(), "{what}: a record");
    }
    // kubelet names the claim too: a namespace or name that is not one.
    for (ns, name) in [("../etc", "c"), ("vms", "a/b"), ("vms", "..")] {
        let bad = Claim {
            namespace: ns.into(),
            name: name.into(),
            uid: "uid-h5".into(),
        };
        let err = prepare_one(&drv, Version::V1, &bad).await.unwrap_err();
        assert!(err.contains("not a"), "{ns}/{name}: {err}");
        unprepare_one(&drv, Version::V1, &bad).await.unwrap_err();
    }
    assert_eq!(writes(&sim), Vec::<String>::new());
    assert!(!root.join("tmp/x").exists());
    assert!(
        !root
            .join(format!("var/lib/kubelet/plugins/{DRIVER}/metadata"))
            .exists()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_and_its_audio_function_are_bound_together() {
    let Some(sim) = try_mount("rtx-workstation") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start(root, &api, &["--unprepare", "restore"]);
    let drv = register(root).await;
    api.put_claim(claim_json("ws", "uid-ws", &["gpu-0000-01-00-0"]));
    let c = claim("ws", "uid-ws");
    prepare_one(&drv, Version::V1, &c).await.unwrap();
    assert_eq!(driver_of(root, "0000:01:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(driver_of(root, "0000:01:00.1").as_deref(), Some("vfio-pci"));
    let spec = read_json(&cdi_spec_path(root, "uid-ws"));
    assert_eq!(
        spec_nodes(&spec, "gpu-0000-01-00-0"),
        vec!["/dev/vfio/vfio", "/dev/vfio/12"]
    );
    // restore: each function back to its own driver.
    unprepare_one(&drv, Version::V1, &c).await.unwrap();
    assert_eq!(driver_of(root, "0000:01:00.0").as_deref(), Some("nvidia"));
    assert_eq!(
        driver_of(root, "0000:01:00.1").as_deref(),
        Some("snd_hda_intel")
    );
    assert!(!cdi_spec_path(root, "uid-ws").exists());
    assert!(!record_path(root, "uid-ws").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_group_holding_a_nic_is_refused_and_nothing_written() {
    let Some(sim) = try_mount("foreign-group") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start(root, &api, &[]);
    let drv = register(root).await;
    api.put_claim(claim_json("nic", "uid-nic", &["gpu-0000-41-00-0"]));
    sim.clear_ops();
    let err = prepare_one(&drv, Version::V1, &claim("nic", "uid-nic"))
        .await
        .unwrap_err();
    assert!(err.contains("claim vms/nic (uid-nic)"), "{err}");
    assert!(err.contains("0000:42:00.0"), "the NIC is named: {err}");
    assert_eq!(writes(&sim), Vec::<String>::new());
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert!(!cdi_spec_path(root, "uid-nic").exists());
    assert!(!record_path(root, "uid-nic").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_a_process_holds_is_refused_naming_the_pid_and_nothing_changes() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // A shell plays the CUDA job on the second GPU.
    let held = testkit::sim::hold_nvidia_node(root, "0000:61:00.0");
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let addr = testkit::ops::free_addr();
    let d = start(root, &api, &["--metrics-addr", &addr]);
    let drv = register(root).await;
    api.put_claim(claim_json(
        "busy",
        "uid-busy",
        &["gpu-0000-41-00-0", "gpu-0000-61-00-0"],
    ));
    let c = claim("busy", "uid-busy");
    sim.clear_ops();
    let err = prepare_one(&drv, Version::V1, &c).await.unwrap_err();
    assert!(err.contains("0000:61:00.0 is in use"), "{err}");
    assert!(
        err.contains(&format!("pid {}", held.pid())),
        "the holder is named: {err}"
    );
    assert!(err.contains("nothing was changed"), "{err}");
    assert_eq!(writes(&sim), Vec::<String>::new());
    for bdf in ["0000:41:00.0", "0000:61:00.0"] {
        assert_eq!(driver_of(root, bdf).as_deref(), Some("nvidia"), "{bdf}");
    }
    assert!(!cdi_spec_path(root, "uid-busy").exists());
    // The refusal is an Event on the Node.
    let ev = tokio::task::spawn_blocking(move || {
        api.wait_for_event("ClaimNotPrepared", PATIENCE)
            .map(|e| (e, api))
    })
    .await
    .unwrap();
    let (ev, api) = ev.expect("no ClaimNotPrepared event");
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["regarding"]["name"], NODE);
    assert!(ev["note"].as_str().unwrap().contains("vms/busy"), "{ev}");
    // The job ends; kubelet's retry succeeds.
    drop(held);
    prepare_one(&drv, Version::V1, &c).await.unwrap();
    assert_eq!(driver_of(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
    // Ready once the first ResourceSlice pass is done; the metrics count it from then on.
    let (ev, ready, body) = tokio::task::spawn_blocking(move || {
        (
            api.wait_for_event("ClaimPrepared", PATIENCE),
            testkit::ops::wait_for_status(&addr, "/readyz", 200, PATIENCE),
            testkit::ops::http_get(&addr, "/metrics"),
        )
    })
    .await
    .unwrap();
    let ev = ev.expect("no ClaimPrepared event");
    let note = ev["note"].as_str().unwrap();
    assert!(note.contains("gpu-0000-61-00-0"), "{note}");
    assert!(ready, "not ready after publishing");
    let (code, body) = body.unwrap();
    assert_eq!(code, 200);
    for line in [
        "sandbox_dra_prepares_total{result=\"failed\"} 1\n",
        "sandbox_dra_prepares_total{result=\"success\"} 1\n",
        "sandbox_dra_published_devices 2\n",
    ] {
        assert!(
            body.contains(line),
            "{line} missing from\n{body}\n{}",
            d.log()
        );
    }
    if let Some(parser) =
        testkit::ops::MetricsParser::install(Path::new(env!("CARGO_TARGET_TMPDIR")))
    {
        parser
            .parse(&body)
            .unwrap_or_else(|e| panic!("{e}\n{body}"));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_whose_device_vanished_or_is_not_ours_is_a_clear_error() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start(root, &api, &[]);
    let drv = register(root).await;
    sim.control("unplug 0000:61:00.0").unwrap();
    api.put_claim(claim_json("gone", "uid-gone", &["gpu-0000-61-00-0"]));
    sim.clear_ops();
    let err = prepare_one(&drv, Version::V1, &claim("gone", "uid-gone"))
        .await
        .unwrap_err();
    assert!(
        err.contains("device gpu-0000-61-00-0 (0000:61:00.0) is not on this node"),
        "{err}"
    );
    assert_eq!(writes(&sim), Vec::<String>::new());

    // A claim the API server does not have, and one whose UID is another's.
    let err = prepare_one(&drv, Version::V1, &claim("nope", "uid-nope"))
        .await
        .unwrap_err();
    assert!(
        err.contains("vms/nope") && err.contains("no such ResourceClaim"),
        "{err}"
    );
    api.put_claim(claim_json("again", "uid-new", &["gpu-0000-41-00-0"]));
    let err = prepare_one(&drv, Version::V1, &claim("again", "uid-old"))
        .await
        .unwrap_err();
    assert!(err.contains("\"uid-new\""), "{err}");
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("nvidia"));
}

#[tokio::test(flavor = "multi_thread")]
async fn unprepare_keep_leaves_the_gpu_on_vfio_and_restore_refuses_a_held_group() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, &[]);
    let drv = register(root).await;
    api.put_claim(claim_json("k", "uid-k", &["gpu-0000-41-00-0"]));
    let c = claim("k", "uid-k");
    let devices = prepare_one(&drv, Version::V1, &c).await.unwrap();
    let spec = read_json(&cdi_spec_path(root, "uid-k"));
    let (host, _) = spec_metadata_mount(&spec);
    unprepare_one(&drv, Version::V1, &c).await.unwrap();
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert!(!cdi_spec_path(root, "uid-k").exists());
    assert!(!under(root, &host).exists(), "metadata removed");
    assert!(!record_path(root, "uid-k").exists());
    // Again, and a claim never prepared: already unprepared.
    unprepare_one(&drv, Version::V1beta1, &c).await.unwrap();
    unprepare_one(&drv, Version::V1, &claim("never", "uid-never"))
        .await
        .unwrap();
    // Prepared again: the GPU is already on vfio-pci, the answer is the same.
    assert_eq!(prepare_one(&drv, Version::V1, &c).await.unwrap(), devices);
    drop(d);

    // restore, while a VM still holds the group: refused, naming it; then released.
    let _d = start(root, &api, &["--unprepare", "restore"]);
    let drv = register(root).await;
    sim.control("hold 21 pid=4242 comm=qemu-kvm").unwrap();
    let err = unprepare_one(&drv, Version::V1, &c).await.unwrap_err();
    assert!(err.contains("IOMMU group 21 is in use"), "{err}");
    assert!(err.contains("4242"), "{err}");
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    sim.control("release 21").unwrap();
    unprepare_one(&drv, Version::V1, &c).await.unwrap();
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert!(!record_path(root, "uid-k").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restart_prepares_a_finished_claim_again() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, &[]);
    let drv = register(root).await;
    api.put_claim(claim_json("r", "uid-r", &["gpu-0000-41-00-0"]));
    let c = claim("r", "uid-r");
    let devices = prepare_one(&drv, Version::V1, &c).await.unwrap();
    drop(d);
    // Behind the driver's back: the GPU is given back and the spec lost; the claim is gone
    // from the API server too, so only the record can tell.
    std::fs::write(
        root.join("sys/bus/pci/drivers/vfio-pci/unbind"),
        "0000:41:00.0",
    )
    .unwrap();
    std::fs::remove_file(cdi_spec_path(root, "uid-r")).unwrap();
    api.delete_claim(NS, "r");
    let _d = start(root, &api, &[]);
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert!(cdi_spec_path(root, "uid-r").exists());
    let drv = register(root).await;
    assert_eq!(prepare_one(&drv, Version::V1, &c).await.unwrap(), devices);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_record_of_the_format_before_versions_is_read_and_written_back_in_the_current_one()
{
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, &[]);
    let drv = register(root).await;
    api.put_claim(claim_json("o", "uid-o", &["gpu-0000-41-00-0"]));
    let c = claim("o", "uid-o");
    let devices = prepare_one(&drv, Version::V1, &c).await.unwrap();
    drop(d);
    let rec = record_path(root, "uid-o");
    let mut old = read_json(&rec);
    assert_eq!(old["version"], 1, "{old}");
    old.as_object_mut().unwrap().remove("version");
    std::fs::write(&rec, serde_json::to_vec_pretty(&old).unwrap()).unwrap();
    // At start the claim is prepared again from its record, which is written back with its
    // version; kubelet's calls find it as before.
    let d = start(root, &api, &[]);
    let drv = register(root).await;
    assert_eq!(read_json(&rec)["version"], 1);
    assert_eq!(prepare_one(&drv, Version::V1, &c).await.unwrap(), devices);
    unprepare_one(&drv, Version::V1, &c).await.unwrap();
    assert!(!rec.exists());
    assert!(d.log().contains("claim record migrated"), "{}", d.log());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_record_that_cannot_be_read_is_set_aside_and_reported_and_unprepare_succeeds() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, &[]);
    let drv = register(root).await;
    api.put_claim(claim_json("x", "uid-x", &["gpu-0000-41-00-0"]));
    let c = claim("x", "uid-x");
    let spec = {
        prepare_one(&drv, Version::V1, &c).await.unwrap();
        read_json(&cdi_spec_path(root, "uid-x"))
    };
    let (metadata, _) = spec_metadata_mount(&spec);
    drop(d);
    let rec = record_path(root, "uid-x");
    std::fs::write(&rec, "{\"claim\": ").unwrap();
    let d = start(root, &api, &[]);
    let drv = register(root).await;
    // Set aside at start (kept beside it), and said so in an Event on the Node.
    assert!(!rec.exists());
    let aside: Vec<String> = std::fs::read_dir(rec.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("uid-x.json.unreadable-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    let ev = tokio::task::spawn_blocking(move || {
        api.wait_for_event("ClaimRecordUnreadable", PATIENCE)
            .map(|e| (e, api))
    })
    .await
    .unwrap();
    let (ev, _api) = ev.expect("no ClaimRecordUnreadable event");
    assert_eq!(ev["type"], "Warning");
    let note = ev["note"].as_str().unwrap();
    assert!(
        note.contains("uid-x.json") && note.contains("set aside as"),
        "{ev}"
    );
    // kubelet's unprepare is not refused for ever: it succeeds, and what the runtime would
    // have found of the claim is gone; the GPU stays as it is.
    unprepare_one(&drv, Version::V1, &c).await.unwrap();
    assert!(!cdi_spec_path(root, "uid-x").exists());
    assert!(!under(root, &metadata).exists(), "metadata removed");
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    // Kubelet's call for a record gone bad while the driver runs: the same.
    spoil_and_unprepare(&drv, root, &c).await;
    drop(d);
}

/// Prepares `c` again, spoils its record while the driver runs, and unprepares it: set aside,
/// and the unprepare succeeds.
async fn spoil_and_unprepare(drv: &DraDriver, root: &Path, c: &Claim) {
    prepare_one(drv, Version::V1, c).await.unwrap();
    let rec = record_path(root, &c.uid);
    std::fs::write(&rec, "{\"version\": 99}").unwrap();
    unprepare_one(drv, Version::V1, c).await.unwrap();
    assert!(!rec.exists());
    assert!(!cdi_spec_path(root, &c.uid).exists());
}

/// What a crash test interrupts.
#[derive(Clone, Copy, PartialEq)]
enum Call {
    Prepare,
    /// Unprepare with `--unprepare restore`.
    Unprepare,
}

/// Starts `call` on `c` with every sysfs write slowed, kills the driver (SIGKILL) once node-sim
/// has logged `k` writes, and returns how many it made.
async fn killed_after(sim: &SimDir, api: &FakeApiServer, c: &Claim, call: Call, k: usize) -> usize {
    let root = sim.root();
    let mut d = start(root, api, &["--unprepare", "restore"]);
    let drv = register(root).await;
    for op in ["bind", "unbind", "probe", "driver_override"] {
        sim.control(&format!("fault {op} * delay=15")).unwrap();
    }
    sim.clear_ops();
    let c2 = c.clone();
    let task = tokio::spawn(async move {
        match call {
            Call::Prepare => drv.prepare(Version::V1, &[c2]).await.map(|_| ()),
            Call::Unprepare => drv.unprepare(Version::V1, &[c2]).await.map(|_| ()),
        }
    });
    let start = Instant::now();
    loop {
        if writes(sim).len() >= k || task.is_finished() {
            d.process.0.kill().unwrap();
            break;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "the call neither wrote nor ended"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _ = d.process.0.wait();
    let _ = task.await;
    sim.control("clear-faults").unwrap();
    writes(sim).len()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prepare_killed_at_any_write_is_undone_at_start_and_then_succeeds() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    api.put_claim(claim_json(
        "crash",
        "uid-crash",
        &["gpu-0000-41-00-0", "gpu-0000-61-00-0"],
    ));
    let c = claim("crash", "uid-crash");
    // Both GPUs: override, unbind, probe each (6 writes; the two groups in parallel, so a
    // kill lands a write or two after the k-th).
    let mut killed_mid_way = 0;
    let mut left_without_driver = 0;
    for k in 1..=6 {
        let done = killed_after(&sim, &api, &c, Call::Prepare, k).await;
        if done < 6 {
            killed_mid_way += 1;
        }
        if ["0000:41:00.0", "0000:61:00.0"]
            .iter()
            .any(|bdf| driver_of(root, bdf).is_none())
        {
            left_without_driver += 1;
        }
        // The next start undoes the unfinished prepare: both GPUs back on nvidia, no spec.
        let d = start(root, &api, &[]);
        let rec = record_path(root, "uid-crash");
        if rec.exists() {
            let r = read_json(&rec);
            assert_eq!(
                r["state"], "prepared",
                "k={k}: an unfinished record survived the start"
            );
        } else {
            for bdf in ["0000:41:00.0", "0000:61:00.0"] {
                assert_eq!(
                    driver_of(root, bdf).as_deref(),
                    Some("nvidia"),
                    "k={k} {bdf}:\n{}",
                    d.log()
                );
            }
            assert!(!cdi_spec_path(root, "uid-crash").exists(), "k={k}");
        }
        // kubelet's retry prepares it; unprepare with restore puts the node back for the next k.
        let drv = register(root).await;
        prepare_one(&drv, Version::V1, &c).await.unwrap();
        for bdf in ["0000:41:00.0", "0000:61:00.0"] {
            assert_eq!(driver_of(root, bdf).as_deref(), Some("vfio-pci"), "k={k}");
        }
        drop(d);
        let _d = start(root, &api, &["--unprepare", "restore"]);
        let drv = register(root).await;
        unprepare_one(&drv, Version::V1, &c).await.unwrap();
        for bdf in ["0000:41:00.0", "0000:61:00.0"] {
            assert_eq!(driver_of(root, bdf).as_deref(), Some("nvidia"), "k={k}");
        }
    }
    assert!(
        killed_mid_way >= 2,
        "the kills landed mid-way {killed_mid_way} times"
    );
    assert!(
        left_without_driver >= 1,
        "no kill landed between an unbind and its probe"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unprepare_killed_at_any_write_is_finished_at_start() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    api.put_claim(claim_json(
        "undo",
        "uid-undo",
        &["gpu-0000-41-00-0", "gpu-0000-61-00-0"],
    ));
    let c = claim("undo", "uid-undo");
    // Both GPUs: override, unbind, probe, override cleared each (8 writes).
    let mut killed_mid_way = 0;
    for k in 1..=8 {
        {
            let _d = start(root, &api, &[]);
            let drv = register(root).await;
            prepare_one(&drv, Version::V1, &c).await.unwrap();
        }
        if killed_after(&sim, &api, &c, Call::Unprepare, k).await < 8 {
            killed_mid_way += 1;
        }
        // The next start finishes it, with the policy it runs with.
        let d = start(root, &api, &["--unprepare", "restore"]);
        let _drv = register(root).await;
        for bdf in ["0000:41:00.0", "0000:61:00.0"] {
            assert_eq!(
                driver_of(root, bdf).as_deref(),
                Some("nvidia"),
                "k={k} {bdf}:\n{}",
                d.log()
            );
        }
        assert!(!record_path(root, "uid-undo").exists(), "k={k}");
        assert!(!cdi_spec_path(root, "uid-undo").exists(), "k={k}");
    }
    assert!(
        killed_mid_way >= 2,
        "the kills landed mid-way {killed_mid_way} times"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crash_between_the_file_writes_is_undone_at_start() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    api.put_claim(claim_json("files", "uid-files", &["gpu-0000-41-00-0"]));
    let c = claim("files", "uid-files");
    let d = start(root, &api, &[]);
    let drv = register(root).await;
    prepare_one(&drv, Version::V1, &c).await.unwrap();
    let spec = read_json(&cdi_spec_path(root, "uid-files"));
    let (host, _) = spec_metadata_mount(&spec);
    drop(d);
    // Killed after the spec was written, before the record said prepared.
    let rec = record_path(root, "uid-files");
    let mut r = read_json(&rec);
    assert_eq!(r["state"], "prepared");
    r["state"] = json!("preparing");
    std::fs::write(&rec, r.to_string()).unwrap();
    let _d = start(root, &api, &[]);
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert!(!cdi_spec_path(root, "uid-files").exists());
    assert!(!under(root, &host).exists(), "metadata removed");
    assert!(!rec.exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_whose_vgpu_kubelet_gave_a_pod_is_refused_under_another_kubelet_root() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // A vGPU on the second A10's first VF, which kubelet's checkpoint gives a pod; kubelet's
    // root is k0s's.
    let vgpu = "6f1d2c3b-4a59-4e8d-9c7b-0a1b2c3d4e5f";
    std::fs::write(
        root.join("sys/bus/pci/devices/0000:61:00.0/sriov_numvfs"),
        "4",
    )
    .unwrap();
    std::fs::write(
        root.join("sys/class/mdev_bus/0000:61:00.4/mdev_supported_types/nvidia-593/create"),
        vgpu,
    )
    .unwrap();
    let kubelet_root = "/var/lib/k0s/kubelet";
    testkit::kubelet::checkpoint::write(
        &root.join("var/lib/k0s/kubelet/device-plugins"),
        &[testkit::kubelet::checkpoint::entry(
            "6f1c-pod",
            "compute",
            "nvidia.com/NVIDIA_A10-4Q",
            &[vgpu],
        )],
    )
    .unwrap();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start_at(root, &api, kubelet_root);
    let drv = register_at(root, kubelet_root).await;
    assert_eq!(
        drv.info.endpoint,
        format!("{kubelet_root}/plugins/{DRIVER}/dra.sock")
    );
    api.put_claim(claim_json("vg", "uid-vg", &["gpu-0000-61-00-0"]));
    sim.clear_ops();
    let err = prepare_one(&drv, Version::V1, &claim("vg", "uid-vg"))
        .await
        .unwrap_err();
    assert!(err.contains("pod 6f1c-pod"), "the pod is named: {err}");
    assert_eq!(writes(&sim), Vec::<String>::new());
    assert_eq!(driver_of(root, "0000:61:00.0").as_deref(), Some("nvidia"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_the_api_server_cannot_be_asked_about_is_an_error_naming_it() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start(root, &api, &[]);
    let drv = register(root).await;
    drop(api);
    sim.clear_ops();
    let err = prepare_one(&drv, Version::V1, &claim("down", "uid-down"))
        .await
        .unwrap_err();
    assert!(
        err.starts_with("claim vms/down (uid-down): cannot read it from the API server"),
        "{err}"
    );
    assert_eq!(writes(&sim), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_api_server_that_never_answers_fails_a_claim_in_time_and_holds_up_no_other() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    // No resync while the server hangs: the only request left unanswered is the claim's.
    // The timeout is well inside the fake kubelet's own wait for an answer (10 s).
    let d = start(
        root,
        &api,
        &["--api-timeout", "4s", "--resync-interval", "1h"],
    );
    let drv = register(root).await;
    api.put_claim(claim_json("vm1-gpu", "uid-a", &["gpu-0000-41-00-0"]));
    let a = claim("vm1-gpu", "uid-a");
    prepare_one(&drv, Version::V1, &a)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    api.put_claim(claim_json("vm2-gpu", "uid-b", &["gpu-0000-61-00-0"]));
    let b = claim("vm2-gpu", "uid-b");

    api.hang();
    let before = api.hung_requests();
    let pending = prepare_one(&drv, Version::V1, &b);
    tokio::pin!(pending);
    // Until the driver's read of claim b is in the API server's hands, unanswered.
    while api.hung_requests() == before {
        tokio::select! {
            r = &mut pending => panic!("answered while the API server hangs: {r:?}"),
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    // Claim a is unprepared meanwhile: the prepare lock is not held across the request.
    tokio::select! {
        r = &mut pending => panic!("claim b ended before claim a's unprepare: {r:?}\n{}", d.log()),
        r = unprepare_one(&drv, Version::V1, &a) => r.unwrap_or_else(|e| panic!("{e}\n{}", d.log())),
    }
    assert!(!cdi_spec_path(root, "uid-a").exists());
    // Claim b fails, naming the wait; nothing was written for it.
    let err = pending.await.unwrap_err();
    assert!(
        err.contains("did not answer within") && err.contains("vm2-gpu"),
        "{err}"
    );
    assert!(!record_path(root, "uid-b").exists());
    assert_eq!(driver_of(root, "0000:61:00.0").as_deref(), Some("nvidia"));

    // The API server back: kubelet's next call prepares it.
    api.answer();
    prepare_one(&drv, Version::V1, &b)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert!(cdi_spec_path(root, "uid-b").exists());
}

/// `/healthz` means "the process is stuck", not "the API server hangs": with an API server that
/// accepts and never answers, the publisher's passes wait on it (a GPU hot-plugged meanwhile
/// gives them a slice to write), each bounded, and the loop stays alive for many times its
/// liveness window (shortened from its two minutes for the test); claims are still answered.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_api_server_leaves_the_driver_alive_and_answering() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let addr = testkit::ops::free_addr();
    // One request may take longer than the window: a loop that only came round between
    // requests would fail it at the first hung write.
    let window = Duration::from_secs(5);
    let d = start(
        root,
        &api,
        &[
            "--api-timeout",
            "8s",
            "--resync-interval",
            "1s",
            "--liveness-window",
            "5s",
            "--metrics-addr",
            &addr,
        ],
    );
    let drv = register(root).await;
    api.put_claim(claim_json("vm1-gpu", "uid-a", &["gpu-0000-41-00-0"]));
    let a = claim("vm1-gpu", "uid-a");
    prepare_one(&drv, Version::V1, &a)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    api.put_claim(claim_json("vm2-gpu", "uid-b", &["gpu-0000-61-00-0"]));
    let b = claim("vm2-gpu", "uid-b");
    let a2 = addr.clone();
    let ready = tokio::task::spawn_blocking(move || {
        testkit::ops::wait_for_status(&a2, "/readyz", 200, PATIENCE)
    });
    assert!(ready.await.unwrap(), "never published\n{}", d.log());

    api.hang();
    let hung = api.hung_requests();
    sim.control("hotplug 0000:81:00.0 A10 group=50 numa=1")
        .unwrap();
    // Four windows of /healthz, polled, while passes wait on the API server.
    let a2 = addr.clone();
    let health = tokio::task::spawn_blocking(move || {
        let t = Instant::now();
        let mut seen = Vec::new();
        while t.elapsed() < window * 4 {
            let code = testkit::ops::http_get(&a2, "/healthz").map(|(c, _)| c);
            if code != Some(200) {
                seen.push((t.elapsed(), code));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        seen
    });
    // Meanwhile a new claim fails in time (its read hangs), and claim a is unprepared.
    let err = prepare_one(&drv, Version::V1, &b).await.unwrap_err();
    assert!(err.contains("did not answer within"), "{err}");
    unprepare_one(&drv, Version::V1, &a)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let not_ok = health.await.unwrap();
    assert_eq!(
        not_ok,
        [],
        "/healthz failed while the API server hung\n{}",
        d.log()
    );
    // The passes did wait on the API server: the hot-plugged GPU's slice write hung, and
    // they failed and were retried.
    assert!(
        api.hung_requests() >= hung + 2,
        "{} requests hung",
        api.hung_requests() - hung
    );
    let (_, metrics) = testkit::ops::http_get(&addr, "/metrics").unwrap();
    assert!(
        !metrics.contains("sandbox_dra_publish_failures_total 0\n"),
        "no pass failed:\n{metrics}"
    );

    // The API server back: the hot-plugged GPU is published.
    api.answer();
    let found = tokio::task::spawn_blocking(move || {
        api.wait_for_slices(PATIENCE, |s| {
            s.iter().any(|s| {
                s["spec"]["devices"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|d| d["name"] == "gpu-0000-81-00-0"))
            })
        })
    });
    assert!(found.await.unwrap().is_some(), "{}", d.log());
}

/// The driver is Ready (`/readyz`) only once kubelet has registered it, not at its first
/// published slice: a pod Ready before kubelet can call it would let a rollout go on while
/// the claims kubelet prepares on this node fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_only_once_kubelet_registered_the_driver() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let addr = testkit::ops::free_addr();
    let d = start(root, &api, &["--metrics-addr", &addr]);
    let t = Instant::now();
    while api.slices().is_empty() {
        assert!(t.elapsed() < PATIENCE, "never published\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let a = addr.clone();
    let status = tokio::task::spawn_blocking(move || testkit::ops::http_get(&a, "/readyz"))
        .await
        .unwrap()
        .unwrap()
        .0;
    assert_eq!(status, 503, "published, not registered\n{}", d.log());
    let _drv = register(root).await;
    let ready = tokio::task::spawn_blocking(move || {
        testkit::ops::wait_for_status(&addr, "/readyz", 200, PATIENCE)
    });
    assert!(ready.await.unwrap(), "registered, never ready\n{}", d.log());
}
