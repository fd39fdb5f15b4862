//! On-demand vGPUs (`onDemand.enabled`, nodes labelled `vm-vgpu-on-demand`): sandbox-dp
//! advertises what each GPU could host, creates a vGPU in Allocate, the other sizes' counts
//! drop, and the vGPU is removed once its pod is gone; kubelet restarting, sandbox-dp killed
//! (-9), and sandbox-dp away while the pod is deleted lose nothing.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use cluster_tier::Cluster;

use super::{
    ENV_OF_PID1, TEST_NS, WORKLOAD, kill_daemon, kubevirt_gives, mdevs, pod_yaml, test_namespace,
    vmi_gpus, wait_allocatable, wait_log, wait_phase,
};

const A10_4Q: &str = "nvidia.com/NVIDIA_A10-4Q";
const A10_8Q: &str = "nvidia.com/NVIDIA_A10-8Q";

pub fn run(c: &Cluster) -> Result<()> {
    c.mount_sim("2xA10")?;
    c.label_node(WORKLOAD, Some("vm-vgpu-on-demand"))?;
    c.helm_install(&["onDemand.enabled=true"], &["--wait", "--timeout", "3m"])?;
    wait_allocatable(c, A10_4Q, 12, Duration::from_secs(60))?;
    wait_allocatable(c, A10_8Q, 6, Duration::from_secs(30))?;
    ensure!(
        mdevs(c)?.is_empty(),
        "vGPUs exist before any pod asked for one"
    );

    test_namespace(c)?;
    let script =
        format!("{ENV_OF_PID1} | busybox grep '^MDEV_PCI_RESOURCE' ; echo done ; sleep 3600");
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
    ensure!(
        mdevs(c)? == [uuid.clone()],
        "the node's vGPUs are {:?}, not the pod's {uuid}",
        mdevs(c)?
    );
    kubevirt_gives(
        c,
        "vm-a",
        &vmi_gpus(&["nvidia.com/NVIDIA_A10-4Q"]),
        std::slice::from_ref(&uuid),
    )?;
    // The GPU now hosts 4Q: its 8Q slots are withdrawn.
    wait_allocatable(c, A10_8Q, 3, Duration::from_secs(30))?;

    // kubelet restarts while the pod runs: sandbox-dp registers again, the vGPU stays.
    {
        let mut node = c.node();
        node.stop_kubelet();
        node.start_kubelet()?;
    }
    c.wait(
        "kubelet back with the resources",
        Duration::from_secs(90),
        || {
            let n = c.node_json()?;
            let ready = n["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|cond| cond["type"] == "Ready" && cond["status"] == "True");
            Ok(
                (ready && cluster_tier::quantity(&n["status"]["allocatable"][A10_8Q]) == 3)
                    .then_some(()),
            )
        },
    )?;
    ensure!(
        mdevs(c)? == [uuid.clone()],
        "the vGPU did not survive kubelet's restart: {:?}",
        mdevs(c)?
    );
    wait_phase(c, "vm-a", &["Running"], Duration::from_secs(10))?;

    // sandbox-dp killed (-9): its records keep the pod's vGPU.
    kill_daemon(c, "sandbox-dp-on-demand")?;
    wait_allocatable(c, A10_8Q, 3, Duration::from_secs(60))?;
    ensure!(
        mdevs(c)? == [uuid.clone()],
        "the vGPU did not survive sandbox-dp's restart: {:?}",
        mdevs(c)?
    );

    // sandbox-dp away while the pod is deleted: the vGPU waits for it, and goes when it is back.
    c.label_node(WORKLOAD, Some("none"))?;
    c.wait("sandbox-dp gone", Duration::from_secs(60), || {
        let pods = c.get_json(&["pods", "-n", cluster_tier::NAMESPACE])?;
        Ok(pods["items"]
            .as_array()
            .is_none_or(Vec::is_empty)
            .then_some(()))
    })?;
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-a", "--wait=true"])?;
    ensure!(
        mdevs(c)? == [uuid.clone()],
        "the vGPU went while no sandbox-dp ran: {:?}",
        mdevs(c)?
    );
    let t0 = Instant::now();
    c.label_node(WORKLOAD, Some("vm-vgpu-on-demand"))?;
    c.wait(
        "the vGPU removed once sandbox-dp is back",
        Duration::from_secs(90),
        || Ok(mdevs(c)?.is_empty().then_some(())),
    )?;
    eprintln!(
        "  on-demand: the vGPU of a pod deleted while sandbox-dp was away removed {:.1} s after the label brought it back",
        t0.elapsed().as_secs_f64()
    );
    wait_allocatable(c, A10_8Q, 6, Duration::from_secs(60))?;

    // Another pod: its vGPU goes once the pod is gone, and the sizes come back.
    c.apply(&pod_yaml(
        c,
        "vm-b",
        "echo started; sleep 3600",
        &format!("limits:\n  {A10_8Q}: 1"),
        "",
    ))?;
    wait_phase(c, "vm-b", &["Running"], Duration::from_secs(60))?;
    ensure!(mdevs(c)?.len() == 1, "vm-b's vGPU: {:?}", mdevs(c)?);
    let t0 = Instant::now();
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-b", "--wait=true"])?;
    c.wait(
        "the vGPU removed after its pod",
        Duration::from_secs(30),
        || Ok(mdevs(c)?.is_empty().then_some(())),
    )?;
    eprintln!(
        "  on-demand: vGPU removed {:.1} s after `kubectl delete pod` (1 s grace period)",
        t0.elapsed().as_secs_f64()
    );
    wait_allocatable(c, A10_8Q, 6, Duration::from_secs(30))?;
    Ok(())
}
