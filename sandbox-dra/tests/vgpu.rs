//! vGPUs on simulated nodes (node-sim) with the fake kubelet and the fake API server: the
//! counter sets and shared vGPU devices published for `--vgpu`, and prepare/unprepare creating
//! and destroying exactly one vGPU per allocated share, the same GPU serving whole and in
//! fractions across claims. Where the scheduler places claims on these devices is the cluster
//! tier's to show (the real kube-scheduler: `tests/cluster`, scenario `dra-vgpu`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{
    DRIVER, Driver, NODE, NS, PATIENCE, claim, driver_of, gpu_pool, prepare, put_claim, read_json,
    register, share_id, under, unprepare,
};
use testkit::apiserver::FakeApiServer;
use testkit::kubelet::dra::{Claim, Version};
use testkit::sim::try_mount;

/// The class of the claims.
const VGPU: &str = "vgpu.gpu-vm-node.io";

/// sandbox-dra serving with `--vgpu vgpu`.
fn start(root: &Path, api: &FakeApiServer, vgpu: &str) -> Driver {
    support::start(root, api, &["--vgpu", vgpu])
}

/// The mdevs on the node: (uuid, type name, parent, iommu group).
fn mdevs(root: &Path) -> Vec<(String, String, String, String)> {
    let dir = root.join("sys/bus/mdev/devices");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let p = e.path();
        let name = std::fs::read_to_string(p.join("mdev_type/name")).unwrap_or_default();
        let parent = std::fs::canonicalize(&p)
            .ok()
            .and_then(|c| {
                c.parent()
                    .map(|x| x.file_name().unwrap().to_string_lossy().into_owned())
            })
            .unwrap_or_default();
        let group = std::fs::read_link(p.join("iommu_group"))
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_default();
        out.push((
            e.file_name().to_string_lossy().into_owned(),
            name.trim().to_string(),
            parent,
            group,
        ));
    }
    out.sort();
    out
}

/// The CDI spec's device nodes and the metadata file's device of a one-device claim.
fn handed_out(root: &Path, uid: &str) -> (Vec<String>, Value) {
    let spec = read_json(&root.join(format!("var/run/cdi/{DRIVER}_{uid}.json")));
    let mut nodes = Vec::new();
    let mut meta = Value::Null;
    for d in spec["devices"].as_array().unwrap() {
        for n in d["containerEdits"]["deviceNodes"]
            .as_array()
            .into_iter()
            .flatten()
        {
            nodes.push(n["path"].as_str().unwrap().to_string());
        }
        // The first mount is the metadata stream (the second, the plain file of KubeVirt 1.8.2).
        if let Some(m) = d["containerEdits"]["mounts"].get(0) {
            let file = support::read_metadata(&under(root, m["hostPath"].as_str().unwrap()));
            meta = file["requests"][0]["devices"][0].clone();
        }
    }
    (nodes, meta)
}

/// The slices once `gpus` pooled GPUs' pools are whole.
fn wait_for_pool(api: &FakeApiServer, gpus: usize) -> Vec<Value> {
    api.wait_for_slices(PATIENCE, |s| {
        counter_sets(s).len() == gpus && support::whole_pools(s)
    })
    .unwrap_or_else(|| panic!("no counters published: {:#?}", api.slices()))
}

#[tokio::test(flavor = "multi_thread")]
async fn an_a10_publishes_its_fractions_and_serves_whole_then_vgpus_then_whole() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, "all");
    let drv = register(root).await;
    let slices = wait_for_pool(&api, 2);

    // What is published: per GPU a counter set of its framebuffer and VFs; per A10 type the
    // model table names one shared device holding as many of it as fit, one per allocation;
    // and the whole GPU. Each of them consumes the whole set.
    let sets: Vec<&Value> = slices
        .iter()
        .filter_map(|s| s["spec"]["sharedCounters"].as_array())
        .flatten()
        .collect();
    assert_eq!(sets.len(), 2, "{sets:?}");
    let set = sets
        .iter()
        .find(|s| s["name"] == "gpu-0000-41-00-0")
        .unwrap();
    assert_eq!(set["counters"]["memory"]["value"], "24Gi");
    assert_eq!(set["counters"]["vfs"]["value"], "32");
    for slice in &slices {
        let n = slice["spec"]["devices"].as_array().map_or(0, Vec::len);
        assert!(n <= 64, "{n} devices in one slice");
        assert!(
            slice["spec"]["devices"].is_null() || slice["spec"]["sharedCounters"].is_null(),
            "counters and devices share a slice"
        );
    }
    let devices: Vec<&Value> = slices
        .iter()
        .filter_map(|s| s["spec"]["devices"].as_array())
        .flatten()
        .collect();
    let device = |name: &str| {
        *devices
            .iter()
            .find(|d| d["name"] == name)
            .unwrap_or_else(|| panic!("no {name}: {devices:?}"))
    };
    let of_gpu = |gpu: &str| {
        devices
            .iter()
            .filter(|d| d["name"].as_str().unwrap().contains(gpu))
            .count()
    };
    assert_eq!(of_gpu("0000-41-00-0"), 1 + 21, "the whole GPU and 21 types");
    let holds = |key: &str| {
        let d = device(&format!("vgpu-0000-41-00-0-{key}"));
        assert_eq!(d["allowMultipleAllocations"], true, "{d}");
        let cap = &d["capacity"]["vgpus"];
        assert_eq!(cap["requestPolicy"]["default"], "1", "{d}");
        assert_eq!(cap["requestPolicy"]["validValues"], json!(["1"]), "{d}");
        cap["value"].as_str().unwrap().to_string()
    };
    assert_eq!(
        [
            holds("a10-1q"),
            holds("a10-4q"),
            holds("a10-8q"),
            holds("a10-24q"),
            holds("a10-4c")
        ],
        ["24", "6", "3", "1", "6"]
    );
    let dev = device("vgpu-0000-41-00-0-a10-4q");
    let a = &dev["attributes"];
    assert_eq!(a["vgpuType"]["string"], "NVIDIA A10-4Q");
    assert_eq!(a["series"]["string"], "Q");
    assert_eq!(a["framebufferMiB"]["int"], 4096);
    assert_eq!(a["maxInstances"]["int"], 6);
    assert_eq!(a["parentGPU"]["string"], "0000:41:00.0");
    let whole_device = device("gpu-0000-41-00-0");
    assert_eq!(dev["consumesCounters"], whole_device["consumesCounters"]);
    assert_eq!(
        dev["consumesCounters"][0]["counters"], set["counters"],
        "the whole set"
    );

    // A whole-GPU claim first: the GPU goes to vfio-pci and stays there (--unprepare keep).
    let whole = put_claim(&api, "whole-1", "uid-w1", VGPU, "gpu-0000-41-00-0");
    prepare(&drv, &whole).await.unwrap();
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    unprepare(&drv, &whole).await.unwrap();

    // An A10-4Q claim: the GPU back on nvidia, its VFs enabled, one A10-4Q mdev on a VF.
    let c = put_claim(&api, "small", "uid-s1", VGPU, "vgpu-0000-41-00-0-a10-4q");
    let prepared = prepare(&drv, &c)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(prepared[0].device_name, "vgpu-0000-41-00-0-a10-4q");
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    let made = mdevs(root);
    let [(uuid, name, parent, group)] = &made[..] else {
        panic!("{made:?}")
    };
    assert_eq!(name, "NVIDIA A10-4Q");
    assert!(parent.starts_with("0000:41:"), "{parent}");
    let (nodes, meta) = handed_out(root, "uid-s1");
    assert_eq!(
        nodes,
        vec!["/dev/vfio/vfio".to_string(), format!("/dev/vfio/{group}")]
    );
    assert!(under(root, &nodes[1]).exists());
    assert_eq!(meta["attributes"]["mdevUUID"]["string"], uuid.as_str());
    assert_eq!(meta["name"], "vgpu-0000-41-00-0-a10-4q");
    assert_eq!(
        prepared[0].share_id.as_deref(),
        Some(share_id("uid-s1", 0).as_str())
    );

    // The scheduler places no A10-8Q beside it (the shared devices' counters keep them apart);
    // an allocation that says otherwise is refused at prepare, naming the GPU and both types,
    // nothing created.
    let big = put_claim(&api, "big", "uid-b1", VGPU, "vgpu-0000-41-00-0-a10-8q");
    let err = prepare(&drv, &big).await.unwrap_err();
    for want in [
        "0000:41:00.0",
        "NVIDIA A10-4Q",
        "NVIDIA A10-8Q",
        "same framebuffer size",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    assert_eq!(mdevs(root).len(), 1);
    unprepare(&drv, &big).await.unwrap();

    // Unprepare removes it; the GPU serves a whole-GPU claim again.
    unprepare(&drv, &c).await.unwrap();
    assert_eq!(mdevs(root), vec![]);
    assert!(
        !root
            .join(format!("var/run/cdi/{DRIVER}_uid-s1.json"))
            .exists()
    );
    let whole2 = put_claim(&api, "whole-2", "uid-w2", VGPU, "gpu-0000-41-00-0");
    prepare(&drv, &whole2)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    unprepare(&drv, &whole2).await.unwrap();
    // The pool file tells vgpu-device-manager these GPUs are sandbox-dra's.
    let pool = std::fs::read_to_string(root.join("run/gpu-vm-node/dra-pool")).unwrap();
    assert_eq!(
        pool,
        "# gpu-vm-node dra-pool v1\n0000:41:00.0\n0000:61:00.0\n"
    );
}

/// A claim of request `gpu` allocated every device of `devices`, each with a share of its own.
fn put_claim_of(api: &FakeApiServer, name: &str, uid: &str, devices: &[&str]) -> Claim {
    api.put_claim(json!({
        "metadata": {"namespace": NS, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": VGPU, "count": devices.len()}}
        ]}},
        "status": {"allocation": {"devices": {"results": devices.iter().zip(0..).map(|(d, n)| json!({
            "request": "gpu", "driver": DRIVER, "pool": NODE, "device": d,
            "shareID": share_id(uid, n),
        })).collect::<Vec<_>>()}}},
    }));
    claim(name, uid)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_of_two_vgpus_of_one_gpu_is_prepared_at_its_first_call() {
    // mdevs on VFs (A10) and vGPU types on VFs (H100): each vGPU on a VF of its own.
    for (topology, gpu, devices) in [
        (
            "2xA10",
            "0000:41:00.0",
            ["vgpu-0000-41-00-0-a10-4q", "vgpu-0000-41-00-0-a10-4q"],
        ),
        (
            "8xH100-sriov",
            "0000:13:00.0",
            [
                "vgpu-0000-13-00-0-h100xm-10c",
                "vgpu-0000-13-00-0-h100xm-10c",
            ],
        ),
    ] {
        let Some(sim) = try_mount(topology) else {
            return;
        };
        let root = sim.root();
        let api = FakeApiServer::start(NODE, &[]).unwrap();
        let d = start(root, &api, gpu);
        let drv = register(root).await;
        wait_for_pool(&api, 1);
        let c = put_claim_of(&api, "two", "uid-two", &devices);
        let prepared = prepare(&drv, &c)
            .await
            .unwrap_or_else(|e| panic!("{topology}: the first prepare failed: {e}\n{}", d.log()));
        assert_eq!(prepared.len(), 2, "{prepared:?}");
        let spec = read_json(&root.join(format!("var/run/cdi/{DRIVER}_uid-two.json")));
        let meta_host = spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|d| d["containerEdits"]["mounts"][0]["hostPath"].as_str())
            .unwrap()
            .to_string();
        let meta = support::read_metadata(&under(root, &meta_host));
        let handles: Vec<String> = meta["requests"][0]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                let a = &d["attributes"];
                a["mdevUUID"]["string"]
                    .as_str()
                    .or(a["resource.kubernetes.io/pciBusID"]["string"].as_str())
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(handles.len(), 2, "{meta}");
        assert_ne!(
            handles[0], handles[1],
            "{topology}: two vGPUs, not one twice"
        );
        if topology == "2xA10" {
            let made = mdevs(root);
            assert_eq!(made.len(), 2, "{made:?}");
            assert_ne!(
                made[0].2, made[1].2,
                "each mdev on a VF of its own: {made:?}"
            );
        }
        unprepare(&drv, &c).await.unwrap();
        assert_eq!(mdevs(root), vec![]);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_h100_vgpu_is_a_vf_with_current_vgpu_type() {
    let Some(sim) = try_mount("8xH100-sriov") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, "0000:13:00.0");
    let drv = register(root).await;
    let slices = wait_for_pool(&api, 1);
    assert_eq!(counter_sets(&slices), ["gpu-0000-13-00-0"]);
    let dev = slices
        .iter()
        .filter_map(|s| s["spec"]["devices"].as_array())
        .flatten()
        .find(|d| d["name"] == "vgpu-0000-13-00-0-h100xm-10c")
        .unwrap_or_else(|| panic!("{:?}", device_names(&slices)));
    assert_eq!(dev["attributes"]["vgpuType"]["string"], "NVIDIA H100XM-10C");
    assert_eq!(dev["attributes"]["maxInstances"]["int"], 8);
    assert_eq!(dev["capacity"]["vgpus"]["value"], "8");
    // Only the pooled GPU has vGPU devices.
    assert!(
        !device_names(&slices)
            .iter()
            .any(|n| n.starts_with("vgpu-0000-14-"))
    );

    let c = put_claim(&api, "h", "uid-h1", VGPU, "vgpu-0000-13-00-0-h100xm-10c");
    prepare(&drv, &c)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let (_, meta) = handed_out(root, "uid-h1");
    let vf = meta["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(vf, "0000:13:00.0", "the VF, not the GPU");
    let cur = |vf: &str| {
        std::fs::read_to_string(
            root.join(format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type")),
        )
        .unwrap()
        .trim()
        .to_string()
    };
    assert_ne!(cur(&vf), "0");
    unprepare(&drv, &c).await.unwrap();
    assert_eq!(cur(&vf), "0");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_vgpu_a_vm_holds_is_kept_at_unprepare_and_removed_at_the_retry() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let _d = start(root, &api, "0000:61:00.0");
    let drv = register(root).await;
    let c = put_claim(&api, "held", "uid-held", VGPU, "vgpu-0000-61-00-0-a10-4q");
    prepare(&drv, &c).await.unwrap();
    let made = mdevs(root);
    let [(uuid, _, _, group)] = &made[..] else {
        panic!("{made:?}")
    };
    sim.control(&format!("hold {group} pid=4242 comm=qemu-kvm"))
        .unwrap();
    let err = unprepare(&drv, &c).await.unwrap_err();
    for want in [
        "NVIDIA A10-4Q",
        uuid.as_str(),
        "0000:61:00.0",
        "4242",
        "kept",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    assert_eq!(mdevs(root).len(), 1, "the held vGPU stays");
    // A GPU outside --vgpu has no vGPU devices to prepare.
    let other = put_claim(&api, "other", "uid-o", VGPU, "vgpu-0000-41-00-0-a10-4q");
    let err = prepare(&drv, &other).await.unwrap_err();
    assert!(err.contains("not in this driver's vGPU pool"), "{err}");
    // The VM ends; kubelet's retry removes it.
    sim.control(&format!("release {group}")).unwrap();
    unprepare(&drv, &c).await.unwrap();
    assert_eq!(mdevs(root), vec![]);
    assert!(
        !root
            .join(format!(
                "var/lib/kubelet/plugins/{DRIVER}/claims/uid-held.json"
            ))
            .exists()
    );
}

/// sysfs writes node-sim logged since the last clear.
fn writes(sim: &testkit::sim::SimDir) -> usize {
    sim.ops()
        .into_iter()
        .filter(|o| !o.path.contains("node-sim/"))
        .count()
}

/// Starts prepare (or unprepare) of `c` with every sysfs write slowed, kills the driver once
/// node-sim logged `k` writes; returns how many it made.
async fn killed_after(
    sim: &testkit::sim::SimDir,
    api: &FakeApiServer,
    c: &Claim,
    prepare_it: bool,
    k: usize,
) -> usize {
    let root = sim.root();
    let mut d = start(root, api, "0000:41:00.0");
    let drv = register(root).await;
    for op in [
        "bind",
        "unbind",
        "probe",
        "driver_override",
        "sriov_numvfs",
        "create",
        "remove",
    ] {
        sim.control(&format!("fault {op} * delay=15")).unwrap();
    }
    sim.clear_ops();
    let c2 = c.clone();
    let task = tokio::spawn(async move {
        if prepare_it {
            drv.prepare(Version::V1, &[c2]).await.map(|_| ())
        } else {
            drv.unprepare(Version::V1, &[c2]).await.map(|_| ())
        }
    });
    let t = Instant::now();
    loop {
        if writes(sim) >= k || task.is_finished() {
            d.process.0.kill().unwrap();
            break;
        }
        assert!(t.elapsed() < PATIENCE, "the call neither wrote nor ended");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _ = d.process.0.wait();
    let _ = task.await;
    sim.control("clear-faults").unwrap();
    writes(sim)
}

/// A vGPU claim on a GPU a whole-GPU claim left on vfio-pci writes: the GPU given back to
/// nvidia (override, unbind, probe), its VFs enabled, the mdev created. Killed after each of
/// them, the next start converges (no vGPU without a record, a finished claim prepared), and
/// kubelet's retry makes exactly one vGPU; an unprepare killed at its write is finished.
#[tokio::test(flavor = "multi_thread")]
async fn a_vgpu_prepare_or_unprepare_killed_at_any_write_converges_at_start() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let whole = put_claim(&api, "whole", "uid-whole", VGPU, "gpu-0000-41-00-0");
    let c = put_claim(&api, "crash", "uid-crash", VGPU, "vgpu-0000-41-00-0-a10-4q");
    let record = root.join(format!(
        "var/lib/kubelet/plugins/{DRIVER}/claims/uid-crash.json"
    ));
    let mut killed_mid_way = 0;
    for k in 1..=6 {
        {
            // The GPU on vfio-pci, no VFs, no vGPU.
            let _d = start(root, &api, "0000:41:00.0");
            let drv = register(root).await;
            prepare(&drv, &whole).await.unwrap();
            unprepare(&drv, &whole).await.unwrap();
            assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
        }
        let done = killed_after(&sim, &api, &c, true, k).await;
        if done < 5 {
            killed_mid_way += 1;
        }
        let d = start(root, &api, "0000:41:00.0");
        let drv = register(root).await;
        if record.exists() {
            let r: Value = read_json(&record);
            assert_eq!(r["state"], "prepared", "k={k}:\n{}", d.log());
            assert_eq!(mdevs(root).len(), 1, "k={k}");
        } else {
            assert_eq!(
                mdevs(root),
                vec![],
                "k={k}: a vGPU without a record:\n{}",
                d.log()
            );
        }
        prepare(&drv, &c)
            .await
            .unwrap_or_else(|e| panic!("k={k}: {e}\n{}", d.log()));
        let made = mdevs(root);
        assert_eq!(made.len(), 1, "k={k}: {made:?}");
        assert_eq!(made[0].1, "NVIDIA A10-4Q");
        unprepare(&drv, &c).await.unwrap();
        assert_eq!(mdevs(root), vec![], "k={k}");
    }
    assert!(
        killed_mid_way >= 2,
        "the kills landed mid-way {killed_mid_way} times"
    );

    // Unprepare: one write (the mdev's remove); killed at it, the next start finishes.
    {
        let _d = start(root, &api, "0000:41:00.0");
        let drv = register(root).await;
        prepare(&drv, &c).await.unwrap();
    }
    killed_after(&sim, &api, &c, false, 1).await;
    let d = start(root, &api, "0000:41:00.0");
    let drv = register(root).await;
    if record.exists() {
        // Killed before the record said unpreparing: still prepared; kubelet's retry ends it.
        unprepare(&drv, &c).await.unwrap();
    }
    assert_eq!(mdevs(root), vec![], "{}", d.log());
    assert!(!record.exists());
}

/// A whole-GPU claim on a pooled GPU whose VFs are enabled disables them only when nothing
/// uses the GPU: held by a shell (`exec 7<>/dev/nvidia<N>`), the claim is refused naming the
/// holder and `sriov_numvfs` is left as it was; let go, the claim is prepared.
#[tokio::test(flavor = "multi_thread")]
async fn a_whole_gpu_claim_leaves_the_vfs_of_a_gpu_in_use_enabled() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, "0000:61:00.0");
    let drv = register(root).await;
    // A vGPU claim enables the GPU's VFs; unprepare removes the vGPU and leaves them on.
    let v = put_claim(&api, "frac", "uid-frac", VGPU, "vgpu-0000-61-00-0-a10-4q");
    prepare(&drv, &v)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    unprepare(&drv, &v).await.unwrap();
    let numvfs = || {
        std::fs::read_to_string(root.join("sys/bus/pci/devices/0000:61:00.0/sriov_numvfs"))
            .unwrap()
            .trim()
            .to_string()
    };
    let before = numvfs();
    assert_ne!(before, "0");

    let info =
        std::fs::read_to_string(root.join("proc/driver/nvidia/gpus/0000:61:00.0/information"))
            .unwrap();
    let minor = info
        .lines()
        .find_map(|l| l.strip_prefix("Device Minor:"))
        .unwrap()
        .trim()
        .to_string();
    let node = root.join(format!("dev/nvidia{minor}"));
    let shell = testkit::sim::ShellHolder::hold(&node);

    let whole = put_claim(&api, "whole", "uid-whole", VGPU, "gpu-0000-61-00-0");
    let err = prepare(&drv, &whole).await.unwrap_err();
    assert!(
        err.contains("0000:61:00.0")
            && err.contains("in use")
            && err.contains(&shell.pid().to_string()),
        "{err}"
    );
    assert_eq!(numvfs(), before, "the VFs of a GPU in use stay enabled");
    assert_eq!(driver_of(root, "0000:61:00.0").as_deref(), Some("nvidia"));

    shell.release();
    prepare(&drv, &whole)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(numvfs(), "0");
    assert_eq!(driver_of(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
}

/// The counter sets of `slices`, by name.
fn counter_sets(slices: &[Value]) -> Vec<String> {
    let mut out: Vec<String> = slices
        .iter()
        .filter_map(|s| s["spec"]["sharedCounters"].as_array())
        .flatten()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect();
    out.sort();
    out
}

/// Every device name of `slices`.
fn device_names(slices: &[Value]) -> Vec<String> {
    slices
        .iter()
        .filter_map(|s| s["spec"]["devices"].as_array())
        .flatten()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_hot_plugged_under_vgpu_all_joins_the_pool_unless_another_daemon_owns_it() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // sandbox-dp's on-demand pool already holds a GPU that is not there yet.
    let run = root.join("run/gpu-vm-node");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("on-demand-pool"), "0000:a1:00.0\n").unwrap();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, "all");
    let drv = register(root).await;
    wait_for_pool(&api, 2);

    sim.control("hotplug 0000:81:00.0 A10 group=50 numa=1")
        .unwrap();
    let slices = api
        .wait_for_slices(PATIENCE, |s| {
            counter_sets(s).contains(&"gpu-0000-81-00-0".to_string())
        })
        .unwrap_or_else(|| {
            panic!(
                "the hot-plugged GPU has no counter set: {:#?}\n{}",
                api.slices(),
                d.log()
            )
        });
    // Its counter set and its vGPUs, as the GPUs there at start have them.
    assert_eq!(
        counter_sets(&slices),
        ["gpu-0000-41-00-0", "gpu-0000-61-00-0", "gpu-0000-81-00-0"]
    );
    let names = device_names(&slices);
    let of = |gpu: &str| names.iter().filter(|n| n.contains(gpu)).count();
    assert_eq!(of("0000-81-00-0"), of("0000-41-00-0"), "{names:?}");
    assert!(names.contains(&"vgpu-0000-81-00-0-a10-4q".to_string()));
    // Recorded as sandbox-dra's, so vgpu-device-manager leaves it alone.
    let pool = std::fs::read_to_string(run.join("dra-pool")).unwrap();
    assert_eq!(
        pool,
        "# gpu-vm-node dra-pool v1\n0000:41:00.0\n0000:61:00.0\n0000:81:00.0\n"
    );
    // And prepared as any vGPU of the pool.
    let c = put_claim(&api, "hot", "uid-hot", VGPU, "vgpu-0000-81-00-0-a10-4q");
    prepare(&drv, &c)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let made = mdevs(root);
    assert_eq!(made.len(), 1, "{made:?}");
    assert_eq!(made[0].1, "NVIDIA A10-4Q");
    unprepare(&drv, &c).await.unwrap();

    // A GPU the on-demand pool owns: a whole GPU only, and not sandbox-dra's.
    sim.control("hotplug 0000:a1:00.0 A10 group=60 numa=1")
        .unwrap();
    let slices = api
        .wait_for_slices(PATIENCE, |s| {
            device_names(s).contains(&"gpu-0000-a1-00-0".to_string())
        })
        .unwrap_or_else(|| panic!("the second GPU never published\n{}", d.log()));
    assert!(!counter_sets(&slices).contains(&"gpu-0000-a1-00-0".to_string()));
    assert!(
        !device_names(&slices)
            .iter()
            .any(|n| n.starts_with("vgpu-0000-a1-00-0"))
    );
    let pool = std::fs::read_to_string(run.join("dra-pool")).unwrap();
    assert_eq!(
        pool,
        "# gpu-vm-node dra-pool v1\n0000:41:00.0\n0000:61:00.0\n0000:81:00.0\n"
    );
    assert!(
        d.log().contains("owned by another daemon"),
        "nothing says why: {}",
        d.log()
    );
    let c = put_claim(&api, "owned", "uid-owned", VGPU, "vgpu-0000-a1-00-0-a10-4q");
    let err = prepare(&drv, &c).await.unwrap_err();
    assert!(err.contains("not in this driver's vGPU pool"), "{err}");
}

/// sandbox-dp's on-demand pool cannot be read (here: written by a newer version): which GPUs
/// are its is unknown, so `--vgpu` claims none, and says so in an Event on the Node; the driver
/// starts all the same and serves whole GPUs.
#[tokio::test(flavor = "multi_thread")]
async fn an_unreadable_on_demand_pool_leaves_the_vgpus_unoffered_and_the_whole_gpus_served() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let on_demand = root.join("run/gpu-vm-node/on-demand-pool");
    std::fs::create_dir_all(on_demand.parent().unwrap()).unwrap();
    std::fs::write(
        &on_demand,
        "# gpu-vm-node on-demand-pool v9\n0000:41:00.0\n",
    )
    .unwrap();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, "all");
    let drv = register(root).await;
    let ev = tokio::task::spawn_blocking(move || {
        api.wait_for_event("VgpuPoolNotClaimed", PATIENCE)
            .map(|e| (e, api))
    })
    .await
    .unwrap();
    let (ev, api) = ev.unwrap_or_else(|| panic!("no VgpuPoolNotClaimed event:\n{}", d.log()));
    assert_eq!(ev["type"], "Warning");
    let note = ev["note"].as_str().unwrap();
    assert!(
        note.contains("on-demand-pool") && note.contains("v9") && note.contains("no vGPU"),
        "{ev}"
    );
    assert!(
        !root.join("run/gpu-vm-node/dra-pool").exists(),
        "no GPU claimed for vGPUs"
    );
    assert_eq!(
        std::fs::read_to_string(&on_demand).unwrap(),
        "# gpu-vm-node on-demand-pool v9\n0000:41:00.0\n",
        "sandbox-dp's file is left to it"
    );
    // Whole GPUs are published and prepared; no vGPU is.
    let slices = api
        .wait_for_slices(PATIENCE, |s| {
            s.iter().any(|s| {
                s["spec"]["devices"]
                    .as_array()
                    .is_some_and(|d| !d.is_empty())
            })
        })
        .unwrap_or_else(|| panic!("nothing published: {:#?}", api.slices()));
    let names: Vec<&str> = slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
        .filter_map(|d| d["name"].as_str())
        .collect();
    assert!(names.contains(&"gpu-0000-41-00-0"), "{names:?}");
    assert!(!names.iter().any(|n| n.starts_with("vgpu-")), "{names:?}");
    assert!(
        slices.iter().all(|s| s["spec"]["sharedCounters"].is_null()),
        "{slices:#?}"
    );
    let vgpu = put_claim(&api, "v", "uid-v", VGPU, "vgpu-0000-61-00-0-a10-4q");
    let err = prepare(&drv, &vgpu).await.unwrap_err();
    assert!(err.contains("not in this driver's vGPU pool"), "{err}");
    let whole = put_claim(&api, "w", "uid-w", VGPU, "gpu-0000-41-00-0");
    prepare(&drv, &whole).await.unwrap();
    assert_eq!(driver_of(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    unprepare(&drv, &whole).await.unwrap();
}

/// The pool does not change with what is allocated: preparing and unpreparing vGPUs (each
/// making or removing an mdev, whose uevents start publisher passes) writes no slice. The
/// driver's own pass counter shows that passes ran after each.
#[tokio::test(flavor = "multi_thread")]
async fn preparing_and_unpreparing_vgpus_writes_no_slice() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let metrics = testkit::ops::free_addr();
    let d = support::start(
        root,
        &api,
        &[
            "--vgpu",
            "all",
            "--metrics-addr",
            &metrics,
            "--resync-interval",
            "1s",
        ],
    );
    let drv = register(root).await;
    wait_for_pool(&api, 2);
    let passes = || passes(&metrics);
    let writes = |api: &FakeApiServer| {
        api.requests()
            .iter()
            .filter(|r| r.contains("resourceslices") && !r.starts_with("GET"))
            .count()
    };
    let after = |since: f64| passes_after(&metrics, since, &d);
    after(passes());
    let written = writes(&api);
    let c = put_claim_of(
        &api,
        "two",
        "uid-two",
        &["vgpu-0000-41-00-0-a10-4q", "vgpu-0000-41-00-0-a10-4q"],
    );
    prepare(&drv, &c)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(mdevs(root).len(), 2);
    after(passes());
    unprepare(&drv, &c).await.unwrap();
    assert_eq!(mdevs(root), vec![]);
    after(passes());
    assert_eq!(
        writes(&api),
        written,
        "slices written for a prepare: {:?}",
        api.requests()
    );
}

/// A prepared vGPU claim asked again (kubelet's retry) is answered from its record once its
/// vGPU and files are checked: nothing is written. A vGPU removed by hand is made again by the
/// next retry. The driver places vGPUs from its own view of the GPU: a vGPU of another size
/// made by hand there since has the kernel refuse the write, and the claim is refused from a
/// fresh read naming both sizes; once it is gone, the GPU takes the claim again.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_writes_nothing_and_a_vgpu_made_by_hand_is_found_by_the_kernels_refusal() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = start(root, &api, "0000:41:00.0");
    let drv = register(root).await;
    wait_for_pool(&api, 1);
    let c = put_claim(&api, "v", "uid-v", VGPU, "vgpu-0000-41-00-0-a10-4q");
    let first = prepare(&drv, &c)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let made = mdevs(root);
    assert_eq!(made.len(), 1, "{made:?}");

    let spec = root.join(format!("var/run/cdi/{DRIVER}_uid-v.json"));
    let before = common::state::file_identity(&spec).unwrap();
    sim.clear_ops();
    assert_eq!(prepare(&drv, &c).await.unwrap(), first);
    assert_eq!(writes(&sim), 0, "a retry writes nothing");
    assert_eq!(common::state::file_identity(&spec).unwrap(), before);
    assert_eq!(mdevs(root), made);
    // Each prepare's log line says where its time went: the first made the vGPU and waited
    // for it, the retry only checked.
    let log = d.log();
    let steps: Vec<Vec<&str>> = log
        .lines()
        .filter(|l| l.contains("claim prepared") && l.contains("uid-v"))
        .filter_map(|l| l.split_once("steps=").map(|(_, s)| s))
        .map(|s| s.split(", ").filter_map(|p| p.split(' ').next()).collect())
        .collect();
    assert_eq!(
        steps,
        [
            vec!["record", "api", "queue", "node", "write", "ready", "files"],
            vec!["record", "queue", "node", "files"],
        ],
        "{log}"
    );

    // Removed by hand: the retry makes it again.
    std::fs::write(
        root.join(format!("sys/bus/mdev/devices/{}/remove", made[0].0)),
        "1",
    )
    .unwrap();
    prepare(&drv, &c).await.unwrap();
    let again = mdevs(root);
    assert_eq!(again.len(), 1, "{again:?}");
    assert_ne!(again[0].0, made[0].0, "a new vGPU");
    let (nodes, _) = handed_out(root, "uid-v");
    assert!(
        nodes.contains(&format!("/dev/vfio/{}", again[0].3)),
        "{nodes:?} name the new vGPU's group {}",
        again[0].3
    );
    // Its metadata names the new vGPU, one generation on (the retry before changed nothing).
    let meta_file = root.join(format!(
        "var/lib/kubelet/plugins/{DRIVER}/metadata/{NS}_v/gpu/metadata.json"
    ));
    let meta = support::read_metadata(&meta_file);
    assert_eq!(meta["metadata"]["generation"], 2, "{meta}");
    assert_eq!(
        meta["requests"][0]["devices"][0]["attributes"]["mdevUUID"]["string"],
        again[0].0.as_str()
    );
    unprepare(&drv, &c).await.unwrap();
    assert_eq!(mdevs(root), vec![]);

    // An A10-8Q by hand on the VF the driver would take next.
    let vf = "0000:41:00.4";
    let types = root.join(format!("sys/class/mdev_bus/{vf}/mdev_supported_types"));
    let t8 = std::fs::read_dir(&types)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|t| {
            std::fs::read_to_string(t.join("name"))
                .unwrap()
                .trim()
                .ends_with("A10-8Q")
        })
        .unwrap();
    let by_hand = "6a0e1b8c-0d6f-4c8e-9a53-1f2e3d4c5b6a";
    std::fs::write(t8.join("create"), by_hand).unwrap();
    let e = prepare(&drv, &c).await.unwrap_err();
    assert!(
        e.contains("0000:41:00.0") && e.contains("A10-8Q") && e.contains("A10-4Q"),
        "{e}"
    );
    let left = mdevs(root);
    assert_eq!(left.len(), 1, "only the hand-made vGPU: {left:?}");
    assert_eq!(left[0].0, by_hand);

    std::fs::write(
        root.join(format!("sys/bus/mdev/devices/{by_hand}/remove")),
        "1",
    )
    .unwrap();
    prepare(&drv, &c)
        .await
        .unwrap_or_else(|e| panic!("the GPU is free again: {e}\n{}", d.log()));
    let now = mdevs(root);
    assert_eq!(now.len(), 1, "{now:?}");
    assert!(now[0].1.ends_with("A10-4Q"), "{now:?}");
    unprepare(&drv, &c).await.unwrap();
}

/// The taints of every device of `slices`: (pool, device) → (value, effect).
fn taints(slices: &[Value]) -> BTreeMap<(String, String), (String, String)> {
    let mut out = BTreeMap::new();
    for s in slices {
        let pool = s["spec"]["pool"]["name"].as_str().unwrap().to_string();
        for d in s["spec"]["devices"].as_array().into_iter().flatten() {
            for t in d["taints"].as_array().into_iter().flatten() {
                out.insert(
                    (pool.clone(), d["name"].as_str().unwrap().to_string()),
                    (
                        t["value"].as_str().unwrap_or_default().to_string(),
                        t["effect"].as_str().unwrap_or_default().to_string(),
                    ),
                );
            }
        }
    }
    out
}

/// The publisher's passes so far, whatever their result, from its `/metrics` at `metrics`.
fn passes(metrics: &str) -> f64 {
    let (_, body) = testkit::ops::http_get(metrics, "/metrics").unwrap_or_default();
    body.lines()
        .filter(|l| l.starts_with("sandbox_dra_publish_passes_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits for a publisher pass that began after `since` passes: two more than then (one may
/// have been running).
fn passes_after(metrics: &str, since: f64, d: &support::Driver) {
    let t = Instant::now();
    while passes(metrics) < since + 2.0 {
        assert!(
            t.elapsed() < PATIENCE,
            "no publisher pass ran:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pool of each device and counter set (`set <name>`) of `slices`.
fn pools(slices: &[Value]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for s in slices {
        let pool = s["spec"]["pool"]["name"].as_str().unwrap().to_string();
        for d in s["spec"]["devices"].as_array().into_iter().flatten() {
            out.insert(d["name"].as_str().unwrap().to_string(), pool.clone());
        }
        for c in s["spec"]["sharedCounters"].as_array().into_iter().flatten() {
            out.insert(format!("set {}", c["name"].as_str().unwrap()), pool.clone());
        }
    }
    out
}

/// Whether every device of GPU `gpu` (`0000-61-00-0`) and its counter set are in pool `pool`.
fn gpu_in(slices: &[Value], gpu: &str, pool: &str) -> bool {
    let of_gpu: Vec<(String, String)> = pools(slices)
        .into_iter()
        .filter(|(name, _)| name.contains(gpu))
        .collect();
    // The counter set, the whole GPU and its 21 types.
    of_gpu.len() == 23 && of_gpu.iter().all(|(_, p)| p == pool)
}

/// A claim allocated from the node's own pool, before `--pool-per-gpu` gave each GPU of the vGPU
/// pool a pool of its own (turned on with VMs running), is still prepared, and its VM keeps its
/// vGPU; its GPU stays in the node's pool, untainted, so the scheduler goes on counting that
/// claim against the GPU and fills the GPU's other shares from there; when its last claim is
/// gone, the GPU moves to its own pool.
#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_stays_in_the_pool_its_prepared_claims_came_from_until_they_go() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let metrics = testkit::ops::free_addr();
    let d = support::start(
        root,
        &api,
        &[
            "--vgpu",
            "all",
            "--pool-per-gpu",
            "--metrics-addr",
            &metrics,
            "--resync-interval",
            "1s",
        ],
    );
    let drv = register(root).await;
    wait_for_pool(&api, 2);
    let device = "vgpu-0000-61-00-0-a10-4q";
    let old = support::put_claim_in(&api, "old", "uid-old", VGPU, NODE, device);
    prepare(&drv, &old)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(mdevs(root).len(), 1);
    let kept = api
        .wait_for_slices(PATIENCE, |s| {
            support::whole_pools(s) && gpu_in(s, "0000-61-00-0", NODE)
        })
        .unwrap_or_else(|| {
            panic!(
                "GPU 61 not kept in {NODE}: {:#?}\n{}",
                api.slices(),
                d.log()
            )
        });
    assert!(
        gpu_in(&kept, "0000-41-00-0", &gpu_pool("gpu-0000-41-00-0")),
        "the other GPU follows the layout: {:#?}",
        pools(&kept)
    );
    assert_eq!(taints(&kept), BTreeMap::new(), "nothing tainted");
    assert!(
        d.log()
            .contains("stays in the pool its prepared claims were allocated from"),
        "{}",
        d.log()
    );
    // kubelet's repeated prepare: the same vGPU. A second share, allocated from where the GPU
    // is now published: a second vGPU, and the GPU stays.
    prepare(&drv, &old).await.unwrap();
    assert_eq!(mdevs(root).len(), 1);
    let next = support::put_claim_in(&api, "next", "uid-next", VGPU, NODE, device);
    prepare(&drv, &next)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(mdevs(root).len(), 2);
    unprepare(&drv, &old).await.unwrap();
    assert_eq!(mdevs(root).len(), 1);
    // Passes ran with `next` still prepared: the GPU is still in the node's pool.
    passes_after(&metrics, passes(&metrics), &d);
    assert!(
        gpu_in(&api.slices(), "0000-61-00-0", NODE),
        "GPU 61 left {NODE} while a claim from it is prepared: {:#?}",
        pools(&api.slices())
    );
    unprepare(&drv, &next).await.unwrap();
    assert_eq!(mdevs(root), vec![]);
    let moved = api
        .wait_for_slices(PATIENCE, |s| {
            support::whole_pools(s) && gpu_in(s, "0000-61-00-0", &gpu_pool(device))
        })
        .unwrap_or_else(|| panic!("GPU 61 stayed in {NODE}: {:#?}\n{}", api.slices(), d.log()));
    assert_eq!(taints(&moved), BTreeMap::new());
    assert!(
        d.log().contains("moves to the one the layout gives it"),
        "{}",
        d.log()
    );
}

/// Claims from two pools on one GPU (one allocated before the layout changed, one after, while
/// the GPU moved): the GPU is published where the layout puts it, and every device of it is
/// tainted `old-pool-claims` (`NoSchedule`, even with `--taint-effect NoExecute`: no VM is
/// evicted), since the scheduler does not count the other pool's claim; the taint goes with it.
#[tokio::test(flavor = "multi_thread")]
async fn claims_from_two_pools_on_one_gpu_keep_it_off_the_scheduler_until_the_old_one_goes() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[]).unwrap();
    let d = support::start(
        root,
        &api,
        &[
            "--vgpu",
            "all",
            "--pool-per-gpu",
            "--taint-effect",
            "NoExecute",
        ],
    );
    let drv = register(root).await;
    wait_for_pool(&api, 2);
    let device = "vgpu-0000-61-00-0-a10-4q";
    let gpu61 = gpu_pool(device);
    let old = support::put_claim_in(&api, "old", "uid-old", VGPU, NODE, device);
    let new = support::put_claim_in(&api, "new", "uid-new", VGPU, &gpu61, device);
    for c in [&old, &new] {
        prepare(&drv, c)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    }
    assert_eq!(mdevs(root).len(), 2);
    let held = api
        .wait_for_slices(PATIENCE, |s| {
            support::whole_pools(s) && taints(s).keys().any(|(p, _)| *p == gpu61)
        })
        .unwrap_or_else(|| panic!("no taint: {:#?}\n{}", api.slices(), d.log()));
    assert!(gpu_in(&held, "0000-61-00-0", &gpu61), "{:#?}", pools(&held));
    let t = taints(&held);
    let of_61: Vec<&(String, String)> = t
        .iter()
        .filter(|((p, _), _)| *p == gpu61)
        .map(|(_, v)| v)
        .collect();
    // The whole GPU and its 21 types, each `NoSchedule`; the other GPU untouched.
    assert_eq!(of_61.len(), 22, "{t:#?}");
    assert!(
        of_61
            .iter()
            .all(|(v, e)| v == "old-pool-claims" && e == "NoSchedule"),
        "{t:#?}"
    );
    assert!(t.keys().all(|(p, _)| *p == gpu61), "{t:#?}");
    unprepare(&drv, &old).await.unwrap();
    assert_eq!(mdevs(root).len(), 1);
    let freed = api
        .wait_for_slices(PATIENCE, |s| {
            support::whole_pools(s) && taints(s).is_empty()
        })
        .unwrap_or_else(|| panic!("the taint stayed: {:#?}\n{}", api.slices(), d.log()));
    assert!(
        gpu_in(&freed, "0000-61-00-0", &gpu61),
        "{:#?}",
        pools(&freed)
    );
    unprepare(&drv, &new).await.unwrap();
    assert_eq!(mdevs(root), vec![]);
}
