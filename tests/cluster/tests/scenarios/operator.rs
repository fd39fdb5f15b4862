//! The GPU Operator's own three VM operand DaemonSets (vgpu-device-manager/tests/fixtures/
//! gpu-operator, transcribed from NVIDIA's gpu-operator) and their RBAC (tests/cluster/fixtures),
//! running our image, with only what the tier must change: their host paths pointed at
//! node-sim's tree (`/` is node-sim's root, whose `var/lib/kubelet` is kubelet's own), and the
//! sandbox device plugin given node-sim's `/sys` where the runtime gives it the host's.
//!
//! Their init containers run as the operator renders them (command, arguments, environment,
//! privileges, mounts and mount propagation as shipped; the validator's `runAsUser: 0`), from
//! stand-ins for NVIDIA's validator and driver-manager images under the names the operator
//! fills in (those cannot be pulled here): busybox, which runs the validators' own shell
//! commands, and a `driver-manager` that only says how it was run. The files NVIDIA's validator
//! writes under `/run/nvidia/validations` (`workload-type`, `vfio-pci-ready`,
//! `host-vgpu-manager-ready`) are written by the test; `vgpu-devices-ready`, which the
//! sandbox device plugin's init container waits for on a vGPU node, is our
//! vgpu-device-manager's.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use cluster_tier::Cluster;
use serde_json::{Value, json};

use super::vgpu::{CONFIG, STATE, wait_state};
use super::wait_allocatable;

const NS: &str = "gpu-operator";

/// The images the operator fills the init containers with: its own (the validator, the chart's
/// appVersion) and k8s-driver-manager (`vfioManager.driverManager`), the operator chart's
/// defaults at the fixtures' commit.
const VALIDATOR_IMAGE: &str = "nvcr.io/nvidia/gpu-operator:main-latest";
const DRIVER_MANAGER_IMAGE: &str = "nvcr.io/nvidia/cloud-native/k8s-driver-manager:v0.12.0";

/// The stand-in for NVIDIA's k8s-driver-manager, whose program is not available here.
const DRIVER_MANAGER: &str = r#"#!/bin/sh
# A stand-in for NVIDIA's k8s-driver-manager: says how it was run and what the operator's
# mounts show it, then succeeds.
echo "driver-manager $* node=${NODE_NAME:-} namespace=${OPERATOR_NAMESPACE:-}"
[ -d /host/sys/bus/pci/devices ] && [ -d /sys/bus/pci/devices ] && [ -d /run/nvidia ] || exit 1
echo "mounts: /host, /sys, /run/nvidia"
"#;

/// Builds a stand-in image `name` (busybox, with `driver-manager` when `driver_manager`) and
/// imports it into the node's containerd.
fn stand_in(c: &Cluster, name: &str, driver_manager: bool) -> Result<()> {
    let root = c
        .dir()
        .join(format!("stand-in-{}", name.replace(['/', ':'], "_")));
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    std::fs::copy("/bin/busybox", bin.join("busybox")).context("copying /bin/busybox")?;
    for applet in ["sh", "cat", "echo", "sleep", "test", "[", "ls"] {
        let link = bin.join(applet);
        if link.symlink_metadata().is_err() {
            std::os::unix::fs::symlink("busybox", &link)
                .with_context(|| format!("linking {}", link.display()))?;
        }
    }
    if driver_manager {
        use std::os::unix::fs::PermissionsExt;
        let dm = root.join("usr/bin/driver-manager");
        std::fs::create_dir_all(root.join("usr/bin")).context("creating usr/bin")?;
        std::fs::write(&dm, DRIVER_MANAGER).with_context(|| format!("writing {}", dm.display()))?;
        std::fs::set_permissions(&dm, std::fs::Permissions::from_mode(0o755))?;
    }
    let archive = root.with_extension("oci.tar");
    let script = cluster_tier::assets::repo().join("tools/oci-archive.sh");
    cluster_tier::proc::run(
        std::process::Command::new(&script)
            .arg(&root)
            .arg(&archive)
            .arg(name)
            .arg(r#"{"Env":["PATH=/usr/bin:/bin"]}"#),
    )
    .with_context(|| format!("building the stand-in image {name}"))?;
    c.node().import(&archive)
}

fn fixture(c: &Cluster, path: &Path) -> Result<Value> {
    let p = path.to_string_lossy();
    let out = c.kubectl(&["create", "--dry-run=client", "-o", "json", "-f", &p])?;
    serde_json::from_str(&out).with_context(|| format!("parsing {p}"))
}

/// The operator's DaemonSet `file`, as the tier runs it.
fn daemonset(c: &Cluster, file: &str) -> Result<Value> {
    let repo = cluster_tier::assets::repo();
    let mut ds = fixture(
        c,
        &repo
            .join("vgpu-device-manager/tests/fixtures/gpu-operator")
            .join(file),
    )?;
    let sim = c.sim_root();
    let spec = &mut ds["spec"]["template"]["spec"];
    // The init containers' images as the operator fills them (`transformValidationInitContainer`,
    // `transformDriverManagerInitContainer`), here stand-ins that are never pulled.
    for ctr in spec["initContainers"].as_array_mut().into_iter().flatten() {
        let name = ctr["name"].as_str().unwrap_or_default().to_string();
        if name.contains("validation") {
            ctr["image"] = json!(VALIDATOR_IMAGE);
            ctr["securityContext"]["runAsUser"] = json!(0);
        } else if name == "k8s-driver-manager" {
            ctr["image"] = json!(DRIVER_MANAGER_IMAGE);
        }
        ctr["imagePullPolicy"] = json!("Never");
    }
    for v in spec["volumes"].as_array_mut().into_iter().flatten() {
        let Some(path) = v["hostPath"]["path"].as_str().map(str::to_string) else {
            continue;
        };
        let host = match path.as_str() {
            "/" => sim.clone(),
            p if ["/sys", "/dev/vfio", "/lib/modules"].contains(&p) || p.starts_with("/run/") => {
                sim.join(p.trim_start_matches('/'))
            }
            // The CDI directory containerd reads (the plugin's own, unused by ours).
            "/var/run/cdi" => c.node().cdi_dir(),
            _ => continue,
        };
        v["hostPath"]["path"] = json!(host);
    }
    for ctr in spec["containers"].as_array_mut().into_iter().flatten() {
        ctr["image"] = json!(c.assets().image_ref);
        ctr["imagePullPolicy"] = json!("Never");
        if ctr["name"] == "nvidia-sandbox-device-plugin-ctr"
            && let Some(m) = ctr["volumeMounts"].as_array_mut()
        {
            m.push(json!({"name": "sim-sys", "mountPath": "/sys"}));
        }
    }
    if file == "sandbox-device-plugin.yaml"
        && let Some(v) = spec["volumes"].as_array_mut()
    {
        v.push(
            json!({"name": "sim-sys", "hostPath": {"path": sim.join("sys"), "type": "Directory"}}),
        );
    }
    Ok(ds)
}

/// The one pod of the operator's DaemonSet selected by `selector` (`app=...`, `name=...`).
fn operand_pod(c: &Cluster, selector: &str) -> Result<Value> {
    let pods = c.get_json(&["pods", "-n", NS, "-l", selector])?;
    let live: Vec<Value> = pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .cloned()
        .collect();
    match live.as_slice() {
        [p] => Ok(p.clone()),
        _ => bail!("not one pod of {selector}: {}", live.len()),
    }
}

/// Waits until the operand's init container `init` runs and has said `said` (it waits for a
/// validation file); the pod's name.
fn wait_init_waiting(c: &Cluster, selector: &str, init: &str, said: &str) -> Result<String> {
    c.wait(
        &format!("{selector}'s init container {init} waiting ({said:?})"),
        Duration::from_secs(90),
        || {
            let Ok(p) = operand_pod(c, selector) else {
                return Ok(None);
            };
            let name = p["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let running = p["status"]["initContainerStatuses"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|s| s["name"] == init && s["state"]["running"].is_object());
            let log = c.container_log(NS, &name, init).unwrap_or_default();
            Ok((running && log.contains(said)).then_some(name))
        },
    )
}

/// The operand's init container `init` ended with status 0, having said `said`.
fn ensure_init_done(c: &Cluster, selector: &str, init: &str, said: &str) -> Result<()> {
    let p = operand_pod(c, selector)?;
    let name = p["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let status = p["status"]["initContainerStatuses"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["name"] == init)
        .cloned()
        .with_context(|| format!("{name} has no init container {init}"))?;
    ensure!(
        status["state"]["terminated"]["exitCode"] == 0,
        "{name}'s init container {init} did not end with 0: {}",
        status["state"]
    );
    let log = c.container_log(NS, &name, init)?;
    ensure!(
        log.contains(said),
        "{name}'s init container {init} did not say {said:?}:\n{log}"
    );
    Ok(())
}

fn pod_log(c: &Cluster, app: &str) -> Result<String> {
    let pods = c.get_json(&["pods", "-n", NS, "-l", &format!("app={app}")])?;
    let name = pods["items"][0]["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let ctr = pods["items"][0]["spec"]["containers"][0]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    c.container_log(NS, &name, &ctr)
}

pub fn run(c: &Cluster) -> Result<()> {
    let sim = c.mount_sim("2xA10")?;
    // The operator's DaemonSets mount the host's / (here node-sim's root) and find kubelet there.
    let kubelet_in_sim = sim.join("var/lib/kubelet");
    c.bind_mount(Path::new(cluster_tier::node::KUBELET_ROOT), &kubelet_in_sim)?;
    stand_in(c, VALIDATOR_IMAGE, false)?;
    stand_in(c, DRIVER_MANAGER_IMAGE, true)?;
    // What nvidia-validator writes first on a vm-passthrough node: the workload type.
    let validations = sim.join("run/nvidia/validations");
    std::fs::create_dir_all(&validations)?;
    std::fs::write(validations.join("workload-type"), "vm-passthrough")?;
    let repo = cluster_tier::assets::repo();
    c.kubectl(&["create", "namespace", NS])?;
    c.kubectl(&[
        "apply",
        "-f",
        &repo
            .join("tests/cluster/fixtures/gpu-operator-rbac.yaml")
            .to_string_lossy(),
    ])?;
    let mut cm = fixture(
        c,
        &repo.join("deploy/helm/gpu-vm-node/files/vgpu-config.yaml"),
    )?;
    cm["metadata"]["namespace"] = json!(NS);
    c.apply(&cm.to_string())?;
    for f in [
        "vfio-manager.yaml",
        "vgpu-device-manager.yaml",
        "sandbox-device-plugin.yaml",
    ] {
        c.apply(&daemonset(c, f)?.to_string())?;
    }

    // Passthrough, as the operator labels a vm-passthrough node: the driver manager runs, then
    // `vfio-manage bind --all`.
    c.label_node("nvidia.com/gpu.deploy.vfio-manager", Some("true"))?;
    c.label_node("nvidia.com/gpu.deploy.sandbox-device-plugin", Some("true"))?;
    let on = |gpu: &str, driver: &str| {
        std::fs::read_link(sim.join(format!("sys/bus/pci/devices/{gpu}/driver")))
            .is_ok_and(|d| d.ends_with(driver))
    };
    c.wait(
        "both GPUs on vfio-pci (vfio-manage bind --all)",
        Duration::from_secs(90),
        || {
            Ok(["0000:41:00.0", "0000:61:00.0"]
                .iter()
                .all(|g| on(g, "vfio-pci"))
                .then_some(()))
        },
    )?;
    ensure_init_done(
        c,
        "name=nvidia-vfio-manager",
        "k8s-driver-manager",
        &format!(
            "driver-manager uninstall_driver node={} namespace={NS}",
            cluster_tier::NODE_NAME
        ),
    )?;
    // The device plugin waits in its vfio-pci validation until the validator has seen vfio-pci
    // bound: nothing is advertised before.
    let dp = "app=nvidia-sandbox-device-plugin-daemonset";
    wait_init_waiting(c, dp, "vfio-pci-validation", "waiting for vfio-pci driver")?;
    ensure!(
        c.allocatable("nvidia.com/GA102GL_A10")? == 0,
        "the GPUs are advertised before vfio-pci-ready"
    );
    std::fs::write(validations.join("vfio-pci-ready"), "")?;
    wait_allocatable(c, "nvidia.com/GA102GL_A10", 2, Duration::from_secs(90))?;
    ensure_init_done(c, dp, "vfio-pci-validation", "waiting for vfio-pci driver")?;
    ensure_init_done(c, dp, "vgpu-devices-validation", "vgpu-devices not needed")?;

    // vGPU: the validator's workload type changes, the operator removes vfio-manager (its
    // preStop gives the GPUs back) and starts vgpu-device-manager, whose DEFAULT_VGPU_CONFIG
    // (A10-8Q) applies without a label.
    std::fs::write(validations.join("workload-type"), "vm-vgpu")?;
    c.label_node("nvidia.com/gpu.deploy.vfio-manager", Some("false"))?;
    c.wait(
        "the GPUs back on nvidia (vfio-manage unbind --all in the preStop hook)",
        Duration::from_secs(90),
        || {
            let back = ["0000:41:00.0", "0000:61:00.0"].iter().all(|g| {
                std::fs::read_link(sim.join(format!("sys/bus/pci/devices/{g}/driver")))
                    .is_ok_and(|d| d.ends_with("nvidia"))
            });
            Ok(back.then_some(()))
        },
    )?;
    // The device plugin started again (a node reboot, a rollout) now waits in its vGPU
    // validation for vgpu-devices-ready, which is ours to write.
    c.kubectl(&["delete", "pods", "-n", NS, "-l", dp, "--wait=true"])?;
    wait_init_waiting(c, dp, "vgpu-devices-validation", "waiting for vGPU devices")?;
    c.label_node("nvidia.com/gpu.deploy.vgpu-device-manager", Some("true"))?;
    // vgpu-device-manager waits in its init container until the validator has seen the vGPU
    // Manager (here pre-installed on the host: node-sim's nvidia driver).
    let vdm = "app=nvidia-vgpu-device-manager";
    wait_init_waiting(
        c,
        vdm,
        "vgpu-manager-validation",
        "waiting for NVIDIA vGPU Manager",
    )?;
    ensure!(
        c.node_json()?["metadata"]["labels"][STATE].is_null(),
        "a vGPU state before the vGPU Manager was validated"
    );
    std::fs::write(validations.join("host-vgpu-manager-ready"), "")?;
    // The state label through the operator's RBAC, which grants update and not patch.
    wait_state(c, "success", Duration::from_secs(120))?;
    wait_allocatable(c, "nvidia.com/NVIDIA_A10-8Q", 6, Duration::from_secs(60))?;
    ensure_init_done(c, dp, "vgpu-devices-validation", "waiting for vGPU devices")?;
    ensure_init_done(
        c,
        vdm,
        "vgpu-manager-validation",
        "waiting for NVIDIA vGPU Manager",
    )?;
    // No Events under the operator's RBAC: said once in the log.
    let log = c.wait(
        "vgpu-device-manager saying Events are forbidden",
        Duration::from_secs(30),
        || {
            let log = pod_log(c, "nvidia-vgpu-device-manager")?;
            Ok(log.contains("Events are forbidden").then_some(log))
        },
    )?;
    ensure!(
        log.matches("Events are forbidden").count() == 1,
        "the refusal is logged more than once:\n{log}"
    );

    // With deploy/operator/events-rbac.yaml, a restarted daemon records its Events.
    c.kubectl(&[
        "apply",
        "-f",
        &repo
            .join("deploy/operator/events-rbac.yaml")
            .to_string_lossy(),
    ])?;
    c.kubectl(&[
        "delete",
        "pods",
        "-n",
        NS,
        "-l",
        "app=nvidia-vgpu-device-manager",
        "--wait=true",
    ])?;
    c.label_node(CONFIG, Some("A10-4Q"))?;
    c.wait("the switch to A10-4Q", Duration::from_secs(120), || {
        let n = c.node_json()?;
        let ok = n["metadata"]["labels"][STATE] == "success"
            && cluster_tier::quantity(&n["status"]["allocatable"]["nvidia.com/NVIDIA_A10-4Q"])
                == 12;
        Ok(ok.then_some(()))
    })?;
    c.wait(
        "an Event of vgpu-device-manager on the Node",
        Duration::from_secs(60),
        || {
            let events = c.events(None)?;
            Ok(events.into_iter().find(|e| {
                e["reportingComponent"]
                    .as_str()
                    .is_some_and(|r| r.contains("vgpu-device-manager"))
                    && e["message"].as_str().is_some_and(|m| m.contains("A10-4Q"))
            }))
        },
    )?;
    Ok(())
}

/// What the operator scenario adds besides the chart's objects.
pub fn reset(c: &Cluster) -> Result<()> {
    let _ = c.kubectl(&[
        "delete",
        "namespace",
        NS,
        "--ignore-not-found",
        "--wait=true",
        "--timeout=120s",
    ]);
    let _ = c.kubectl(&[
        "delete",
        "-f",
        &cluster_tier::assets::repo()
            .join("tests/cluster/fixtures/gpu-operator-rbac.yaml")
            .to_string_lossy(),
        "--ignore-not-found",
    ]);
    let _ = c.kubectl(&[
        "delete",
        "-f",
        &cluster_tier::assets::repo()
            .join("deploy/operator/events-rbac.yaml")
            .to_string_lossy(),
        "--ignore-not-found",
    ]);
    for l in [
        "vfio-manager",
        "vgpu-device-manager",
        "sandbox-device-plugin",
    ] {
        c.label_node(&format!("nvidia.com/gpu.deploy.{l}"), None)?;
    }
    c.unmount_binds();
    Ok(())
}
