//! A passthrough node, as a user makes one: label it `vm-passthrough`, install the chart.
//! vfio-manager binds both A10s, sandbox-dp advertises them; a pod asking for one gets the
//! env var virt-launcher reads and its `/dev/vfio` nodes; deleting it gives the GPU back to the
//! scheduler. Then faults while a VM holds both GPUs: each daemon killed (-9), kubelet
//! restarted; nothing is taken from the VM and the node serves again.

use std::time::Duration;

use anyhow::{Result, ensure};
use cluster_tier::Cluster;

use super::{
    ENV_OF_PID1, TEST_NS, WORKLOAD, kill_daemon, kubevirt_gives, pod_yaml, restart_kubelet,
    test_namespace, vmi_gpus, wait_allocatable, wait_log, wait_phase,
};

const RESOURCE: &str = "nvidia.com/GA102GL_A10";

pub fn run(c: &Cluster) -> Result<()> {
    c.mount_sim("2xA10")?;
    c.label_node(WORKLOAD, Some("vm-passthrough"))?;
    c.helm_install(&[], &["--wait", "--timeout", "3m"])?;
    wait_allocatable(c, RESOURCE, 2, Duration::from_secs(60))?;
    ensure!(c.capacity(RESOURCE)? == 2, "capacity {RESOURCE} is not 2");

    test_namespace(c)?;
    let script = format!(
        "{ENV_OF_PID1} | busybox grep '^PCI_RESOURCE' ; ls /dev/vfio ; echo done ; sleep 3600"
    );
    c.apply(&pod_yaml(
        c,
        "vm-a",
        &script,
        &format!("limits:\n  {RESOURCE}: 1"),
        "",
    ))?;
    wait_phase(c, "vm-a", &["Running"], Duration::from_secs(60))?;
    let log = wait_log(c, "vm-a", "done", Duration::from_secs(30))?;
    // The env var names the allocated GPU; its group's node is in the container.
    let line = log
        .lines()
        .find(|l| l.starts_with("PCI_RESOURCE_NVIDIA_COM_GA102GL_A10="))
        .ok_or_else(|| {
            anyhow::anyhow!("no PCI_RESOURCE_NVIDIA_COM_GA102GL_A10 in the container's env:\n{log}")
        })?;
    let (addr, group) = match line.split_once('=').map(|(_, v)| v) {
        Some("0000:41:00.0") => ("0000:41:00.0", "21"),
        Some("0000:61:00.0") => ("0000:61:00.0", "37"),
        other => anyhow::bail!("PCI_RESOURCE names {other:?}, not one of the A10s"),
    };
    let nodes: Vec<&str> = log
        .lines()
        .skip_while(|l| !l.starts_with("PCI_RESOURCE"))
        .skip(1)
        .collect();
    ensure!(
        nodes.contains(&group) && nodes.contains(&"vfio"),
        "/dev/vfio in the container holds {nodes:?}, not {group} and vfio ({addr})"
    );
    // KubeVirt's own code, on what the container holds, gives a VM naming the resource that GPU.
    kubevirt_gives(c, "vm-a", &vmi_gpus(&[RESOURCE]), &[addr.to_string()])?;

    // Both GPUs are taken: a pod asking for two waits; once vm-a is gone it starts.
    c.apply(&pod_yaml(
        c,
        "vm-b",
        "echo started; sleep 3600",
        &format!("limits:\n  {RESOURCE}: 2"),
        "",
    ))?;
    c.wait(
        "vm-b unschedulable while vm-a holds a GPU",
        Duration::from_secs(30),
        || {
            let p = c.get_json(&["pod", "-n", TEST_NS, "vm-b"])?;
            let unschedulable = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|cond| cond["type"] == "PodScheduled" && cond["reason"] == "Unschedulable");
            Ok(unschedulable.then_some(()))
        },
    )?;
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-a", "--wait=true"])?;
    wait_phase(c, "vm-b", &["Running"], Duration::from_secs(90))?;
    wait_log(c, "vm-b", "started", Duration::from_secs(30))?;

    // Faults while vm-b holds both GPUs: each daemon killed (-9), then kubelet restarted.
    // Nothing a running VM has is taken, and the node serves again afterwards.
    let bound = |c: &Cluster| -> Result<bool> {
        c.with_sim(|s| {
            ["0000:41:00.0", "0000:61:00.0"].iter().all(|g| {
                std::fs::read_link(s.root().join(format!("sys/bus/pci/devices/{g}/driver")))
                    .is_ok_and(|d| d.ends_with("vfio-pci"))
            })
        })
    };
    kill_daemon(c, "vfio-manager")?;
    ensure!(
        bound(c)?,
        "a GPU left vfio-pci after vfio-manager was killed and restarted"
    );
    kill_daemon(c, "sandbox-dp")?;
    wait_allocatable(c, RESOURCE, 2, Duration::from_secs(60))?;
    restart_kubelet(c)?;
    wait_allocatable(c, RESOURCE, 2, Duration::from_secs(60))?;
    let p = wait_phase(c, "vm-b", &["Running"], Duration::from_secs(10))?;
    ensure!(
        p["status"]["containerStatuses"][0]["restartCount"] == 0,
        "vm-b's container was restarted by the faults: {}",
        p["status"]["containerStatuses"][0]
    );
    ensure!(bound(c)?, "a GPU left vfio-pci during the faults");
    // And a new VM gets a GPU once vm-b is gone.
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-b", "--wait=true"])?;
    c.apply(&pod_yaml(
        c,
        "vm-c",
        "echo started; sleep 3600",
        &format!("limits:\n  {RESOURCE}: 1"),
        "",
    ))?;
    wait_phase(c, "vm-c", &["Running"], Duration::from_secs(60))?;
    Ok(())
}
