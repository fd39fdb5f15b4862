//! Helpers shared by the process-level tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_vgpu-device-manager");

pub const CONFIG: &str = r#"
version: v1
vgpu-configs:
  default:
    - devices: all
      vgpu-devices: {"A10-12Q": 2}
  A10-4Q:
    - devices: all
      vgpu-devices: {"A10-4Q": 6}
  A10-8Q:
    - devices: all
      vgpu-devices: {"A10-8Q": 3}
  A10-2Q:
    - devices: all
      vgpu-devices: {"A10-2Q": 12}
  A100DX-8C:
    - devices: all
      device-filter: "0x20B210DE"
      vgpu-devices: {"A100DX-8C": 10}
  A100DX-4C:
    - devices: all
      device-filter: ["0x20B210DE"]
      vgpu-devices: {"A100DX-4C": 20}
  H100XM-8C:
    - devices: all
      vgpu-devices: {"H100XM-8C": 10}
  H100XM-4C:
    - devices: [0, 1, 2, 3]
      vgpu-devices: {"H100XM-4C": 20}
    - devices: [4, 5, 6, 7]
      vgpu-devices: {"H100XM-8C": 10}
  T4-4Q:
    - devices: all
      vgpu-devices: {"T4-4Q": 4}
"#;

/// A config file in a temporary directory.
pub struct ConfigFile {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
}

pub fn config_file(text: &str) -> ConfigFile {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, text).unwrap();
    ConfigFile { dir, path }
}

/// Runs the binary with `--host-root root` and `args`.
pub fn run(root: &Path, args: &[&str]) -> Output {
    run_stdin(root, args, None)
}

pub fn run_stdin(root: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    let mut c = Command::new(BIN);
    c.args(args)
        .arg("--host-root")
        .arg(root)
        .env_remove("VGPU_DM_CONFIG_FILE")
        .env_remove("VGPU_DM_SELECTED_CONFIG")
        .env_remove("VGPU_DM_DEBUG")
        .env_remove("VGPU_DM_VALID_CONFIG")
        .env_remove("NODE_NAME")
        .env_remove("KUBELET_DIR")
        .env_remove("POD_RESOURCES_SOCKET")
        .env("RUST_LOG", "info")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The node's mdevs: (uuid, parent VF, its PF, type name). An mdev removed while this reads
/// (a daemon at work) is left out.
pub fn mdevs(root: &Path) -> Vec<(String, String, String, String)> {
    let dir = root.join("sys/bus/mdev/devices");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let e = e.unwrap();
        let uuid = e.file_name().to_string_lossy().to_string();
        let Ok(real) = std::fs::canonicalize(e.path()) else {
            continue;
        };
        let parent_dir = real.parent().unwrap().to_path_buf();
        let parent = parent_dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string();
        let pf = match std::fs::canonicalize(parent_dir.join("physfn")) {
            Ok(p) => p.file_name().unwrap().to_string_lossy().to_string(),
            Err(_) => parent.clone(),
        };
        let Ok(name) = std::fs::read_to_string(e.path().join("mdev_type/name")) else {
            continue;
        };
        let name = name.trim().to_string();
        out.push((uuid, parent, pf, name));
    }
    out.sort();
    out
}

/// Count of mdevs per (PF, type name).
pub fn mdev_counts(root: &Path) -> std::collections::BTreeMap<(String, String), usize> {
    let mut m = std::collections::BTreeMap::new();
    for (_, _, pf, name) in mdevs(root) {
        *m.entry((pf, name)).or_insert(0) += 1;
    }
    m
}

/// Vendor-path vGPUs: (VF, PF, current_vgpu_type) for every VF with a type set.
pub fn vendor_vgpus(root: &Path) -> Vec<(String, String, u32)> {
    let dir = root.join("sys/bus/pci/devices");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let e = e.unwrap();
        let cur = e.path().join("nvidia/current_vgpu_type");
        let Ok(v) = std::fs::read_to_string(&cur) else {
            continue;
        };
        let v: u32 = v.trim().parse().unwrap();
        if v == 0 {
            continue;
        }
        let pf = std::fs::canonicalize(e.path().join("physfn")).unwrap();
        out.push((
            e.file_name().to_string_lossy().to_string(),
            pf.file_name().unwrap().to_string_lossy().to_string(),
            v,
        ));
    }
    out.sort();
    out
}

/// Writes to a sysfs file of the simulated node (test set-up, outside the op log's interest).
pub fn write(root: &Path, rel: &str, value: &str) {
    std::fs::write(root.join(rel), value).unwrap();
}

/// The resource of A10-4Q vGPUs.
pub const A10_4Q: &str = "nvidia.com/NVIDIA_A10-4Q";

/// kubelet's checkpoint in `kubelet_dir` gives the A10-4Q vGPU `id` to pod `6f1c-pod`.
pub fn checkpoint_gives_a_pod(kubelet_dir: &Path, id: &str) {
    use testkit::kubelet::checkpoint;
    checkpoint::write(
        kubelet_dir,
        &[checkpoint::entry("6f1c-pod", "compute", A10_4Q, &[id])],
    )
    .unwrap();
}

/// kubelet's PodResources API on `socket`, running pod `vms/virt-launcher-a` with the A10-4Q
/// vGPUs `ids`.
pub fn kubelet_runs(socket: &Path, ids: &[&str]) -> testkit::kubelet::FakePodResources {
    let pod =
        testkit::kubelet::pod_resources::pod("vms", "virt-launcher-a", "compute", A10_4Q, ids);
    testkit::kubelet::FakePodResources::spawn_with(socket, vec![pod]).unwrap()
}

/// Applies `profile` of config file `f`, then has a VM (pid `pid`, `virt-launcher`) hold the
/// IOMMU group of the first vGPU; returns that group (for `release GROUP`).
pub fn apply_and_hold_a_vgpu(
    sim: &testkit::sim::SimDir,
    f: &str,
    profile: &str,
    pid: u32,
) -> String {
    let root = sim.root();
    let o = run(root, &["apply", "-f", f, "-c", profile]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let (uuid, ..) = mdevs(root).into_iter().next().unwrap();
    let group =
        std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{uuid}/iommu_group"))).unwrap();
    let group = group.file_name().unwrap().to_str().unwrap().to_string();
    sim.control(&format!("hold {group} pid={pid} comm=virt-launcher"))
        .unwrap();
    group
}
