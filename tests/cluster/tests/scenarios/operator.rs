//! The GPU Operator's own three VM operand DaemonSets (vgpu-device-manager/tests/fixtures/
//! gpu-operator, transcribed from NVIDIA's gpu-operator) and their RBAC (tests/cluster/fixtures),
//! running our image, with only what the tier must change: their host paths pointed at
//! node-sim's tree (`/` is node-sim's root, whose `var/lib/kubelet` is kubelet's own), the init
//! containers (NVIDIA's validator and driver-manager images) left out, and the sandbox device
//! plugin given node-sim's `/sys` where the runtime gives it the host's.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use cluster_tier::Cluster;
use serde_json::{Value, json};

use super::vgpu::{CONFIG, STATE, wait_state};
use super::wait_allocatable;

const NS: &str = "gpu-operator";

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
    if let Some(o) = spec.as_object_mut() {
        o.remove("initContainers");
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

    // Passthrough, as the operator labels a vm-passthrough node.
    c.label_node("nvidia.com/gpu.deploy.vfio-manager", Some("true"))?;
    c.label_node("nvidia.com/gpu.deploy.sandbox-device-plugin", Some("true"))?;
    wait_allocatable(c, "nvidia.com/GA102GL_A10", 2, Duration::from_secs(90))?;
    for gpu in ["0000:41:00.0", "0000:61:00.0"] {
        let drv = std::fs::read_link(sim.join(format!("sys/bus/pci/devices/{gpu}/driver")))?;
        ensure!(
            drv.ends_with("vfio-pci"),
            "{gpu} is on {drv:?}, not vfio-pci"
        );
    }

    // vGPU: the operator removes vfio-manager (its preStop gives the GPUs back) and starts
    // vgpu-device-manager, whose DEFAULT_VGPU_CONFIG (A10-8Q) applies without a label.
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
    c.label_node("nvidia.com/gpu.deploy.vgpu-device-manager", Some("true"))?;
    // The state label through the operator's RBAC, which grants update and not patch.
    wait_state(c, "success", Duration::from_secs(120))?;
    wait_allocatable(c, "nvidia.com/NVIDIA_A10-8Q", 6, Duration::from_secs(60))?;
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
