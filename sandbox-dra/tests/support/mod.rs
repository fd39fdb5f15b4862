//! sandbox-dra started as a process for the tests: its command line, the running driver (its
//! log, killed when the test ends), the wait for its registration socket, and the calls the
//! fake kubelet makes to it, with claims put in the fake API server.

// Each test file is a crate of its own and uses part of this module: what one leaves unused,
// another uses.
#![allow(dead_code, unused_imports)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::Reaped;
use testkit::apiserver::FakeApiServer;
use testkit::kubelet::dra::{self, Claim, DraDriver, PreparedDevice, Version};

pub const BIN: &str = env!("CARGO_BIN_EXE_sandbox-dra");
pub const DRIVER: &str = "gpu.gpu-vm-node.io";
pub const NODE: &str = "node-a";
/// The namespace of the claims.
pub const NS: &str = "vms";
/// How long a test waits for something that should happen promptly before it calls it lost.
pub const PATIENCE: Duration = Duration::from_secs(30);
/// kubelet's root on the simulated host unless a test says otherwise.
pub const KUBELET_ROOT: &str = "/var/lib/kubelet";

/// The environment variables sandbox-dra reads as its flags: none is passed on to it, so that
/// only what a test says reaches it.
const FLAG_VARS: [&str; 13] = [
    "HOST_ROOT",
    "NODE_NAME",
    "KUBECONFIG",
    "KUBELET_DIR",
    "KUBELET_ROOT",
    "POD_RESOURCES_SOCKET",
    "CDI_ROOT",
    "DRIVER_NAME",
    "UNPREPARE",
    "VGPU",
    "VGPU_TYPES",
    "METRICS_ADDR",
    "LOG_FORMAT",
];

/// `sandbox-dra --host-root root --node-name node --kubeconfig kubeconfig <args> serve`,
/// logging at `info`.
pub fn command(root: &Path, node: &str, kubeconfig: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("--host-root")
        .arg(root)
        .args(["--node-name", node, "--kubeconfig"])
        .arg(kubeconfig)
        .args(args)
        .arg("serve")
        .env("RUST_LOG", "info");
    for var in FLAG_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// A running sandbox-dra, killed (SIGKILL) when the test ends however it ends. What it logs
/// goes to a file of its own.
pub struct Driver {
    pub process: Reaped,
    logdir: tempfile::TempDir,
}

impl Driver {
    /// Starts `cmd`, its stdin and stdout closed and its stderr to the log.
    pub fn spawn(mut cmd: Command) -> Driver {
        let logdir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(logdir.path().join("log")).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Driver {
            process: Reaped(child),
            logdir,
        }
    }

    /// What it has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.logdir.path().join("log")).unwrap_or_default()
    }
}

/// The driver's registration socket under kubelet's root `kubelet_root`.
pub fn reg_socket(root: &Path, kubelet_root: &str) -> PathBuf {
    root.join(kubelet_root.trim_start_matches('/'))
        .join(format!("plugins_registry/{DRIVER}-reg.sock"))
}

/// Starts `cmd`, a `serve`, and waits for its registration socket `reg`.
pub fn serving(cmd: Command, reg: &Path) -> Driver {
    // A socket left by a killed run must not count as the new one's.
    let _ = std::fs::remove_file(reg);
    let mut d = Driver::spawn(cmd);
    let t = Instant::now();
    while !reg.exists() {
        if let Some(status) = d.process.0.try_wait().unwrap() {
            panic!("sandbox-dra exited ({status}) before serving:\n{}", d.log());
        }
        assert!(
            t.elapsed() < PATIENCE,
            "no registration socket:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    d
}

/// sandbox-dra serving `root` with `args` for node `NODE` against the fake API server, once its
/// registration socket is there.
pub fn start(root: &Path, api: &FakeApiServer, args: &[&str]) -> Driver {
    serving(
        command(root, NODE, api.kubeconfig(), args),
        &reg_socket(root, KUBELET_ROOT),
    )
}

/// Registers the driver as kubelet does: the one socket in plugins_registry/.
pub async fn register(root: &Path) -> DraDriver {
    register_at(root, KUBELET_ROOT).await
}

/// [`register`] with kubelet's root at `kubelet_root`.
pub async fn register_at(root: &Path, kubelet_root: &str) -> DraDriver {
    let kubelet_root = Path::new(kubelet_root);
    let socks = dra::registration_sockets(root, kubelet_root);
    assert_eq!(
        socks,
        vec![kubelet_root.join(format!("plugins_registry/{DRIVER}-reg.sock"))]
    );
    dra::register(root, &socks[0], None).await.unwrap()
}

/// Claim `name` of namespace `NS`, as kubelet names it to the driver.
pub fn claim(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: NS.into(),
        name: name.into(),
        uid: uid.into(),
    }
}

pub use cluster_tier::api_server::whole_pools;

/// The pool a device of a GPU of the vGPU pool (`--vgpu --pool-per-gpu`) is published in: its GPU's own,
/// `<node>/gpu-0000-41-00-0` for `vgpu-0000-41-00-0-a10-4q` or `gpu-0000-41-00-0`.
pub fn gpu_pool(device: &str) -> String {
    let rest = device
        .strip_prefix("vgpu-")
        .or_else(|| device.strip_prefix("gpu-"))
        .unwrap_or(device);
    let gpu: Vec<&str> = rest.splitn(5, '-').take(4).collect();
    format!("{NODE}/gpu-{}", gpu.join("-"))
}

/// Claim `name` allocated `device` of this node's pool for request `gpu` of class `class`, in
/// the fake API server; a vGPU type's shared device with a share of its own, as the scheduler
/// allocates one.
pub fn put_claim(api: &FakeApiServer, name: &str, uid: &str, class: &str, device: &str) -> Claim {
    put_claim_in(api, name, uid, class, NODE, device)
}

/// [`put_claim`] of `device` in pool `pool`.
pub fn put_claim_in(
    api: &FakeApiServer,
    name: &str,
    uid: &str,
    class: &str,
    pool: &str,
    device: &str,
) -> Claim {
    let mut result = json!({"request": "gpu", "driver": DRIVER, "pool": pool, "device": device});
    if device.starts_with("vgpu-") {
        result["shareID"] = json!(share_id(uid, 0));
    }
    api.put_claim(json!({
        "metadata": {"namespace": NS, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": class}}
        ]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }));
    claim(name, uid)
}

/// The `n`-th share ID of claim `uid` (a UUID, as the scheduler makes them).
pub fn share_id(uid: &str, n: u32) -> String {
    let h = uid.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        h >> 32,
        (h >> 16) & 0xffff,
        h & 0xfff,
        n & 0xfff,
        h & 0xffff_ffff_ffff
    )
}

/// kubelet's `NodePrepareResources` at version `v` for claim `c` alone: the answer for it.
pub async fn prepare_one(
    d: &DraDriver,
    v: Version,
    c: &Claim,
) -> Result<Vec<PreparedDevice>, String> {
    let mut out = d.prepare(v, std::slice::from_ref(c)).await.unwrap();
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].0, c.uid);
    out.remove(0).1
}

/// kubelet's `NodeUnprepareResources` at version `v` for claim `c` alone: the answer for it.
pub async fn unprepare_one(d: &DraDriver, v: Version, c: &Claim) -> Result<(), String> {
    let mut out = d.unprepare(v, std::slice::from_ref(c)).await.unwrap();
    assert_eq!(out.len(), 1, "{out:?}");
    out.remove(0).1
}

/// [`prepare_one`] at v1.
pub async fn prepare(d: &DraDriver, c: &Claim) -> Result<Vec<PreparedDevice>, String> {
    prepare_one(d, Version::V1, c).await
}

/// [`unprepare_one`] at v1.
pub async fn unprepare(d: &DraDriver, c: &Claim) -> Result<(), String> {
    unprepare_one(d, Version::V1, c).await
}

/// How many mdevs (vGPUs) the simulated node has.
pub fn mdev_count(root: &Path) -> usize {
    std::fs::read_dir(root.join("sys/bus/mdev/devices"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The driver PCI function `bdf` is bound to, if any.
pub fn driver_of(root: &Path, bdf: &str) -> Option<String> {
    std::fs::read_link(root.join("sys/bus/pci/devices").join(bdf).join("driver"))
        .ok()
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
}

pub fn read_json(p: &Path) -> Value {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// A device-metadata file as KEP-5304 has it: a stream of one object per API version, newest
/// first (`v1beta1`, then `v1alpha1`), saying the same; the `v1alpha1` one, which KubeVirt reads.
pub fn read_metadata(p: &Path) -> Value {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let objs: Vec<Value> = serde_json::Deserializer::from_str(&text)
        .into_iter::<Value>()
        .map(|o| o.unwrap_or_else(|e| panic!("{}: {e}\n{text}", p.display())))
        .collect();
    let versions: Vec<&str> = objs
        .iter()
        .map(|o| o["apiVersion"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        versions,
        [
            "metadata.resource.k8s.io/v1beta1",
            "metadata.resource.k8s.io/v1alpha1"
        ],
        "{}",
        p.display()
    );
    for k in ["metadata", "requests", "podClaimName"] {
        assert_eq!(
            objs[0][k], objs[1][k],
            "{k} differs between versions: {text}"
        );
    }
    objs[1].clone()
}

/// Host path `host` on the simulated host.
pub fn under(root: &Path, host: &str) -> PathBuf {
    root.join(host.trim_start_matches('/'))
}
