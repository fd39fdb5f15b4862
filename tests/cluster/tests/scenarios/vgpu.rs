//! A vGPU node by label, as a user runs one: `vm-vgpu` and `nvidia.com/vgpu.config=A10-4Q`.
//! vgpu-device-manager makes 12 A10-4Q, sandbox-dp advertises them, a pod gets one; a relabel to
//! A10-8Q while that pod runs (after the API server was away for 30 s) is blocked on its GPU,
//! said on the Node's state label and in an Event; once the pod is gone the switch completes;
//! vgpu-device-manager killed (-9) keeps every vGPU.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use cluster_tier::Cluster;

use super::{
    ENV_OF_PID1, TEST_NS, WORKLOAD, chart_pods, ensure_resources, kill_daemon, kubevirt_gives,
    pod_yaml, resources_value, test_namespace, values_file, vmi_gpus, wait_allocatable, wait_log,
    wait_phase,
};

const A10_4Q: &str = "nvidia.com/NVIDIA_A10-4Q";
const A10_8Q: &str = "nvidia.com/NVIDIA_A10-8Q";
pub const CONFIG: &str = "nvidia.com/vgpu.config";
pub const STATE: &str = "nvidia.com/vgpu.config.state";

/// Waits for the node's vGPU state label to be `want`.
pub fn wait_state(c: &Cluster, want: &str, timeout: Duration) -> Result<()> {
    c.wait(&format!("{STATE}={want}"), timeout, || {
        let n = c.node_json()?;
        let got = n["metadata"]["labels"][STATE]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Ok((got == want).then_some(()))
    })
}

pub fn run(c: &Cluster) -> Result<()> {
    c.mount_sim("2xA10")?;
    c.label_node(CONFIG, Some("A10-4Q"))?;
    c.label_node(WORKLOAD, Some("vm-vgpu"))?;
    c.helm_install(&[], &["--wait", "--timeout", "3m"])?;
    wait_state(c, "success", Duration::from_secs(60))?;
    wait_allocatable(c, A10_4Q, 12, Duration::from_secs(60))?;

    test_namespace(c)?;
    let script = format!(
        "{ENV_OF_PID1} | busybox grep '^MDEV_PCI_RESOURCE' ; ls /dev/vfio ; echo done ; sleep 3600"
    );
    c.apply(&pod_yaml(
        c,
        "vm-a",
        &script,
        &format!("limits:\n  {A10_4Q}: 1"),
        "",
    ))?;
    wait_phase(c, "vm-a", &["Running"], Duration::from_secs(60))?;
    let log = wait_log(c, "vm-a", "done", Duration::from_secs(30))?;
    let uuid = log
        .lines()
        .find_map(|l| l.strip_prefix("MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q="))
        .with_context(|| {
            format!("no MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q in the container's env:\n{log}")
        })?
        .to_string();
    // The vGPU exists on the node, and its group's node is in the container.
    let group = c
        .with_sim(|s| {
            std::fs::read_link(
                s.root()
                    .join(format!("sys/bus/mdev/devices/{uuid}/iommu_group")),
            )
        })?
        .with_context(|| format!("vGPU {uuid} of the env var does not exist on the node"))?;
    let group = group
        .file_name()
        .and_then(|g| g.to_str())
        .unwrap_or_default()
        .to_string();
    ensure!(
        log.lines().any(|l| l == group),
        "/dev/vfio/{group} of vGPU {uuid} is not in the container:\n{log}"
    );
    kubevirt_gives(
        c,
        "vm-a",
        &vmi_gpus(&["nvidia.com/NVIDIA_A10-4Q"]),
        std::slice::from_ref(&uuid),
    )?;

    // The API server goes away for 30 s: the daemons keep what they have, and follow the label
    // again once it is back.
    c.control_plane().stop_apiserver();
    std::thread::sleep(Duration::from_secs(30));
    c.control_plane().start_apiserver()?;

    // Relabel while the vGPU is in use: the other GPU switches, this one is left, and the
    // operator is told where they look.
    c.label_node(CONFIG, Some("A10-8Q"))?;
    // After an outage the label watch comes back on its backoff (daemon_kit::kube::watch_backoff:
    // up to 16 s between tries, each failure while the API server warms up costing one).
    wait_state(c, "failed", Duration::from_secs(90))?;
    let event = c.wait(
        "the Event saying why the switch is blocked",
        Duration::from_secs(30),
        || {
            let events = c.events(None)?;
            Ok(events.into_iter().find(|e| {
                e["reason"] == "ProfileBlocked"
                    && e["message"].as_str().is_some_and(|m| m.contains("A10-8Q"))
            }))
        },
    )?;
    let msg = event["message"].as_str().unwrap_or_default();
    ensure!(
        msg.contains("vm-a") || msg.contains(&uuid),
        "the Event does not name the vGPU or its pod: {msg}"
    );
    wait_allocatable(c, A10_8Q, 3, Duration::from_secs(60))?;

    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-a", "--wait=true"])?;
    wait_state(c, "success", Duration::from_secs(120))?;
    wait_allocatable(c, A10_8Q, 6, Duration::from_secs(60))?;
    wait_allocatable(c, A10_4Q, 0, Duration::from_secs(60))?;
    ensure!(
        !mdevs(c)?.contains(&uuid),
        "vGPU {uuid} is still there after the switch to A10-8Q"
    );
    // vgpu-device-manager killed (-9): its restart keeps every vGPU and says success again.
    let before = mdevs(c)?;
    kill_daemon(c, "vgpu-device-manager")?;
    wait_state(c, "success", Duration::from_secs(60))?;
    ensure!(
        mdevs(c)? == before,
        "vGPUs changed across vgpu-device-manager's restart: {before:?} -> {:?}",
        mdevs(c)?
    );
    Ok(())
}

/// The node's vGPUs (mdev UUIDs), sorted.
pub fn mdevs(c: &Cluster) -> Result<Vec<String>> {
    c.with_sim(|s| {
        let mut v: Vec<String> = std::fs::read_dir(s.root().join("sys/bus/mdev/devices"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    })
}

/// vm-passthrough, then vm-vgpu with a profile that cannot apply (the GPUs are still on
/// vfio-pci): vfio-manager's pod goes and its readiness file with it, so a sandbox-dp that
/// starts again waits for vgpu-device-manager instead of serving a node that is not ready. It
/// waits for vgpu-devices-ready alone: a vfio-pci-ready left on the host (by a vfio-manager
/// OOM-killed on the relabel, which removes nothing) does not let it pass.
pub fn relabel_passthrough_to_vgpu(c: &Cluster) -> Result<()> {
    c.mount_sim("2xA10")?;
    c.label_node(WORKLOAD, Some("vm-passthrough"))?;
    let (resources, stored) = resources_value(48);
    let vf = values_file(
        c,
        "vfio-manager",
        &serde_json::json!({"vfioManager": {"resources": resources}}),
    )?;
    c.helm_install(&[], &["-f", &vf, "--wait", "--timeout", "3m"])?;
    wait_allocatable(c, "nvidia.com/GA102GL_A10", 2, Duration::from_secs(60))?;
    ensure_resources(c, "vfio-manager", "vfio-manager", &stored)?;
    let ready = c.sim_root().join("run/nvidia/validations/vfio-pci-ready");
    ensure!(
        ready.exists(),
        "vfio-manager did not write {}",
        ready.display()
    );

    c.label_node(CONFIG, Some("A10-4Q"))?;
    c.label_node(WORKLOAD, Some("vm-vgpu"))?;
    c.wait(
        "vfio-manager's pod gone, and its readiness file",
        Duration::from_secs(60),
        || {
            let none = chart_pods(c, "vfio-manager")?.is_empty();
            Ok((none && !ready.exists()).then_some(()))
        },
    )?;
    // A pass of vgpu-device-manager ran and failed: the GPUs are not on nvidia.
    wait_state(c, "failed", Duration::from_secs(90))?;
    // What a vfio-manager killed on the relabel (an OOM kill) leaves: its file, which nothing
    // removes on a vm-vgpu node.
    std::fs::write(&ready, "0000:41:00.0 vfio-pci 21\n")?;
    // sandbox-dp starts again (a rollout, a crash): its init container must wait.
    c.kubectl(&[
        "delete",
        "pods",
        "-n",
        cluster_tier::NAMESPACE,
        "-l",
        "app.kubernetes.io/name=sandbox-dp",
        "--wait=true",
    ])?;
    let pod = c.wait("a new sandbox-dp pod", Duration::from_secs(60), || {
        Ok(chart_pods(c, "sandbox-dp")?.into_iter().next())
    })?;
    let name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let log = c.wait(
        "sandbox-dp's init container waiting",
        Duration::from_secs(60),
        || {
            let log = c
                .container_log(cluster_tier::NAMESPACE, &name, "wait-for-node-ready")
                .unwrap_or_default();
            Ok(log.contains("vgpu-devices-ready (node").then_some(log))
        },
    )?;
    let p = c.get_json(&["pod", "-n", cluster_tier::NAMESPACE, &name])?;
    let init_done = p["status"]["initContainerStatuses"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|s| s["state"]["terminated"].is_object());
    ensure!(
        !init_done,
        "sandbox-dp's init container passed while vgpu-device-manager is not ready:\n{log}"
    );
    ensure!(
        c.allocatable("nvidia.com/GA102GL_A10")? == 0 || c.allocatable(A10_4Q)? == 0,
        "sandbox-dp serves a node that is not ready"
    );
    Ok(())
}
