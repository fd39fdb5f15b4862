//! The scenarios, in the order they run.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use cluster_tier::{Cluster, NAMESPACE, RELEASE};
use serde_json::Value;

mod dra;
mod extended;
mod on_demand;
mod operator;
mod passthrough;
mod values;
mod vgpu;

/// A scenario: a name and what it does.
pub struct Scenario {
    pub name: &'static str,
    pub run: fn(&Cluster) -> Result<()>,
}

/// Every scenario, in order.
pub const ALL: &[Scenario] = &[
    Scenario {
        name: "passthrough",
        run: passthrough::run,
    },
    Scenario {
        name: "vgpu-by-label",
        run: vgpu::run,
    },
    Scenario {
        name: "relabel-passthrough-to-vgpu",
        run: vgpu::relabel_passthrough_to_vgpu,
    },
    Scenario {
        name: "on-demand",
        run: on_demand::run,
    },
    Scenario {
        name: "dra-passthrough",
        run: dra::passthrough,
    },
    Scenario {
        name: "dra-vgpu",
        run: dra::vgpu,
    },
    Scenario {
        name: "dra-extended-resources",
        run: extended::run,
    },
    Scenario {
        name: "dra-taints",
        run: dra::taints,
    },
    Scenario {
        name: "dra-large-pools",
        run: dra::large_pools,
    },
    Scenario {
        name: "gpu-operator-daemonsets",
        run: operator::run,
    },
    Scenario {
        name: "chart-values",
        run: values::run,
    },
    Scenario {
        name: "chart-vfio-off-kubelet-dir-on-demand",
        run: values::vfio_off_kubelet_dir_on_demand,
    },
];

/// The namespace the scenarios' own pods and claims live in.
pub const TEST_NS: &str = "vms";

/// The workload label the chart's DaemonSets are scheduled by.
pub const WORKLOAD: &str = "nvidia.com/gpu.workload.config";

/// Returns the cluster to its state before a scenario: test pods and the chart gone, the node's
/// labels cleared.
pub fn reset(c: &Cluster) -> Result<()> {
    operator::reset(c)?;
    let _ = c.kubectl(&[
        "delete",
        "namespace",
        TEST_NS,
        "--ignore-not-found",
        "--wait=false",
    ]);
    // The test pods go first, while the chart's drivers still run to unprepare their claims
    // (kubelet keeps a pod whose claims no driver can unprepare).
    c.wait("the test pods gone", Duration::from_secs(120), || {
        let pods = c.get_json(&["pods", "-n", TEST_NS])?;
        Ok(pods["items"]
            .as_array()
            .is_none_or(Vec::is_empty)
            .then_some(()))
    })?;
    if let Err(e) = c.helm(&[
        "uninstall",
        RELEASE,
        "--namespace",
        NAMESPACE,
        "--ignore-not-found",
        "--wait",
    ]) {
        eprintln!("  reset: helm uninstall failed: {e:#}");
    }
    // A workload the uninstall left would start pods in the next scenario, beside its own.
    let left = c.kubectl(&[
        "get",
        "daemonsets,deployments",
        "-n",
        NAMESPACE,
        "-o",
        "name",
    ])?;
    if !left.trim().is_empty() {
        eprintln!(
            "  reset: the chart's uninstall left {}; deleting them",
            left.trim()
        );
        c.kubectl(&[
            "delete",
            "daemonsets,deployments",
            "--all",
            "-n",
            NAMESPACE,
            "--wait=true",
            "--timeout=60s",
        ])?;
    }
    for l in [
        WORKLOAD,
        "nvidia.com/vgpu.config",
        "nvidia.com/vgpu.config.state",
        "example.test/pool",
        "example.test/zone",
    ] {
        c.label_node(l, None)?;
    }
    let _ = c.kubectl(&[
        "taint",
        "node",
        cluster_tier::NODE_NAME,
        "example.test/dedicated-",
    ]);
    let _ = c.kubectl(&["delete", "node", "other-node", "--ignore-not-found"]);
    c.wait("every pod gone", Duration::from_secs(120), || {
        let pods = c.get_json(&["pods", "-A"])?;
        let n = pods["items"].as_array().map(Vec::len).unwrap_or(0);
        Ok((n == 0).then_some(()))
    })?;
    c.wait("the test namespace gone", Duration::from_secs(60), || {
        let out = c.kubectl(&[
            "get",
            "namespace",
            TEST_NS,
            "--ignore-not-found",
            "-o",
            "name",
        ])?;
        Ok(out.trim().is_empty().then_some(()))
    })
}

/// Creates the test namespace.
pub fn test_namespace(c: &Cluster) -> Result<()> {
    c.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {TEST_NS}\n"
    ))
    .map(|_| ())
}

/// What virt-launcher reads: the container's environment as it was started (`/proc/1/environ`;
/// a shell drops the variables whose names hold `-`, like `MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q`).
pub const ENV_OF_PID1: &str = "busybox tr '\\0' '\\n' < /proc/1/environ";

/// A pod in the test namespace running `script` in the project's image (it has busybox), with
/// `resources` (a YAML block under `resources:`, or empty) and `extra` lines appended to the
/// container (indented six spaces) — a stand-in for a VM's virt-launcher.
pub fn pod_yaml(c: &Cluster, name: &str, script: &str, resources: &str, extra: &str) -> String {
    let image = &c.assets().image_ref;
    let script = script.replace('\n', "\n        ");
    let mut y = format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {TEST_NS}
spec:
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: 1
  restartPolicy: Never
  containers:
  - name: vm
    image: {image}
    imagePullPolicy: Never
    command:
      - /bin/sh
      - -c
      - |
        {script}
"#
    );
    if !resources.is_empty() {
        y.push_str("    resources:\n");
        for l in resources.lines() {
            y.push_str(&format!("      {l}\n"));
        }
    }
    for l in extra.lines() {
        y.push_str(&format!("    {l}\n"));
    }
    y
}

/// A VMI whose GPUs are the device-plugin resources `resources`, one `gpus[]` entry each
/// (`nvidia.com/GA102GL_A10`): what virt-launcher reads from the environment.
pub fn vmi_gpus(resources: &[&str]) -> String {
    let gpus: String = resources
        .iter()
        .enumerate()
        .map(|(i, r)| format!("      - name: gpu{i}\n        deviceName: {r}\n"))
        .collect();
    format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata:\n  name: vm\n  \
         namespace: {TEST_NS}\nspec:\n  domain:\n    resources:\n      requests:\n        memory: 1Gi\n    \
         devices:\n      gpus:\n{gpus}"
    )
}

/// A VMI whose GPUs are the requests `requests` of the pod's claim `gpu`, made from the
/// ResourceClaimTemplate `template` (as the DRA scenarios' pods have it), one `gpus[]` entry
/// each: what virt-launcher reads from the device-metadata files.
pub fn vmi_dra(template: &str, requests: &[&str]) -> String {
    vmi_of_claim(&format!("resourceClaimTemplateName: {template}"), requests)
}

/// [`vmi_dra`] for a pod whose claim `gpu` is the ResourceClaim `claim` itself.
pub fn vmi_dra_claim(claim: &str, requests: &[&str]) -> String {
    vmi_of_claim(&format!("resourceClaimName: {claim}"), requests)
}

fn vmi_of_claim(source: &str, requests: &[&str]) -> String {
    let gpus: String = requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            format!("      - name: gpu{i}\n        claimName: gpu\n        requestName: {r}\n")
        })
        .collect();
    format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata:\n  name: vm\n  \
         namespace: {TEST_NS}\nspec:\n  resourceClaims:\n  - name: gpu\n    {source}\n  \
         domain:\n    resources:\n      requests:\n        memory: 1Gi\n    devices:\n      \
         gpus:\n{gpus}"
    )
}

/// KubeVirt's own code, every version the tier checks, run on `pod`'s container with `vmi`:
/// each must hand the VM exactly `want` (mdev UUIDs or PCI addresses), in any order.
pub fn kubevirt_gives(c: &Cluster, pod: &str, vmi: &str, want: &[String]) -> Result<()> {
    let mut want: Vec<String> = want.to_vec();
    want.sort();
    for j in c.kubevirt_hostdevs(TEST_NS, pod, vmi)? {
        let mut got = j.devices();
        got.sort();
        if got != want {
            bail!(
                "KubeVirt {} hands pod {pod}'s VM {got:?}, not {want:?}:\n{}",
                j.version,
                j.hostdevs.join("\n")
            );
        }
        eprintln!(
            "  KubeVirt {}: pod {pod}'s VM gets {}",
            j.version,
            got.join(", ")
        );
    }
    Ok(())
}

/// The node's mdevs (node-sim's `sys/bus/mdev/devices`), by UUID.
pub fn mdevs(c: &Cluster) -> Result<Vec<String>> {
    c.with_sim(|s| {
        std::fs::read_dir(s.root().join("sys/bus/mdev/devices"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Writes `values` (JSON, which is YAML) into the scratch directory for `helm --values`; its
/// path.
pub fn values_file(c: &Cluster, name: &str, values: &Value) -> Result<String> {
    let path = c.dir().join(format!("values-{name}.yaml"));
    std::fs::write(&path, values.to_string())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_string_lossy().into_owned())
}

/// A daemon's `resources` value as a user may write it (CPUs as a decimal fraction, memory in
/// Ki and in a fraction of Gi), with `memory_mi` MiB requested; and what the API server stores
/// for it (canonical quantities), which the daemon's container must carry.
pub fn resources_value(memory_mi: u32) -> (Value, Value) {
    let given = serde_json::json!({
        "requests": {"cpu": "0.015", "memory": format!("{}Ki", memory_mi * 1024)},
        "limits": {"memory": "0.25Gi"}
    });
    let stored = serde_json::json!({
        "requests": {"cpu": "15m", "memory": format!("{memory_mi}Mi")},
        "limits": {"memory": "256Mi"}
    });
    (given, stored)
}

/// Waits until the test namespace's `kind` object `name` is gone (`what` for the wait's message).
pub fn wait_gone(c: &Cluster, what: &str, kind: &str, name: &str, timeout: Duration) -> Result<()> {
    c.wait(what, timeout, || {
        let out = c.kubectl(&[
            "get",
            kind,
            "-n",
            TEST_NS,
            name,
            "--ignore-not-found",
            "-o",
            "name",
        ])?;
        Ok(out.trim().is_empty().then_some(()))
    })
}

/// The chart's pods labelled `app.kubernetes.io/name=<app>`.
pub fn chart_pods(c: &Cluster, app: &str) -> Result<Vec<Value>> {
    let pods = c.get_json(&[
        "pods",
        "-n",
        NAMESPACE,
        "-l",
        &format!("app.kubernetes.io/name={app}"),
    ])?;
    Ok(pods["items"].as_array().cloned().unwrap_or_default())
}

/// What was written under node-sim's sysfs since its ops were last cleared (`path value`),
/// node-sim's own control files left out.
pub fn sysfs_writes(c: &Cluster) -> Result<Vec<String>> {
    c.with_sim(|s| {
        s.ops()
            .into_iter()
            .filter(|o| !o.path.contains("node-sim/"))
            .map(|o| format!("{} {}", o.path, o.value))
            .collect()
    })
}

/// The chart's pod `app` (`app.kubernetes.io/name`): its container `container` carries exactly
/// the resources `want`, as the API server stores the pod.
pub fn ensure_resources(c: &Cluster, app: &str, container: &str, want: &Value) -> Result<()> {
    let items = chart_pods(c, app)?;
    ensure!(!items.is_empty(), "no pod of {app}");
    for p in items {
        let got = p["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|x| x["name"] == container)
            .map(|x| x["resources"].clone())
            .with_context(|| format!("{app}'s pod has no container {container}"))?;
        ensure!(
            &got == want,
            "{app}'s container {container} carries the resources {got}, not {want}"
        );
    }
    Ok(())
}

/// GET `path` from `ip:port` inside the cluster's network (a pod's IP, or the node's); the
/// status line and the body.
pub fn http_get(c: &Cluster, ip: &str, port: u16, path: &str) -> Result<(String, String)> {
    use std::io::{Read, Write};
    let addr = format!("{ip}:{port}");
    let text = c.netns().within(|| {
        let sock: std::net::SocketAddr = addr.parse().with_context(|| format!("address {addr}"))?;
        let mut s = std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(5))
            .with_context(|| format!("connecting to {addr}"))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)
            .with_context(|| format!("reading {path} from {addr}"))?;
        Ok(out)
    })?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Ok((
        head.lines().next().unwrap_or_default().to_string(),
        body.to_string(),
    ))
}

/// How long a pod of a burst may take to run. kube-scheduler 1.36.3 and 1.37.2 count the
/// capacity a claim's share consumes twice while its pod is being bound (once from the claim as
/// written, once as still in flight: `GatherAllocatedState` in
/// `pkg/scheduler/framework/plugins/dynamicresources/dra_manager.go`), so a pod tried in that
/// window can find a device one share short (the last `A10-8Q` of three) and is tried again
/// only when the scheduler flushes its unschedulable pods, up to five minutes later.
pub const BURST_PATIENCE: Duration = Duration::from_secs(330);

/// Waits for a pod's phase to be one of `phases`; the pod.
pub fn wait_phase(c: &Cluster, pod: &str, phases: &[&str], timeout: Duration) -> Result<Value> {
    let t0 = std::time::Instant::now();
    let got = c.wait(&format!("pod {pod} in {phases:?}"), timeout, || {
        let p = c.get_json(&["pod", "-n", TEST_NS, pod])?;
        let phase = p["status"]["phase"].as_str().unwrap_or_default();
        if phases.contains(&phase) {
            return Ok(Some(p));
        }
        if phase == "Failed" {
            bail!("pod {pod} failed: {}", p["status"]);
        }
        Ok(None)
    });
    // A long wait, passed or not, says what the pod went through.
    if t0.elapsed() > Duration::from_secs(30) {
        for e in c.events(Some(TEST_NS)).unwrap_or_default() {
            if e["regarding"]["name"] == pod || e["involvedObject"]["name"] == pod {
                let at = e["eventTime"]
                    .as_str()
                    .or(e["lastTimestamp"].as_str())
                    .or(e["deprecatedLastTimestamp"].as_str())
                    .unwrap_or("");
                let note = e["note"].as_str().or(e["message"].as_str()).unwrap_or("");
                eprintln!(
                    "    {at} {pod}: {} {note}",
                    e["reason"].as_str().unwrap_or("")
                );
            }
        }
    }
    got
}

/// Waits until a pod's log holds `needle`; the log.
pub fn wait_log(c: &Cluster, pod: &str, needle: &str, timeout: Duration) -> Result<String> {
    c.wait(&format!("{needle:?} in pod {pod}'s log"), timeout, || {
        let log = c.container_log(TEST_NS, pod, "vm").unwrap_or_default();
        Ok(log.contains(needle).then_some(log))
    })
}

/// Waits until the node's allocatable `resource` is `n`.
pub fn wait_allocatable(c: &Cluster, resource: &str, n: i64, timeout: Duration) -> Result<()> {
    c.wait(&format!("allocatable {resource} = {n}"), timeout, || {
        let got = c.allocatable(resource)?;
        Ok((got == n).then_some(()))
    })
    .with_context(|| format!("allocatable {resource}: {:?}", c.allocatable(resource)))
}

/// The `Ready` condition of every pod of a DaemonSet of the chart.
pub fn wait_daemonset_ready(c: &Cluster, name: &str, timeout: Duration) -> Result<()> {
    c.wait(&format!("DaemonSet {name} ready"), timeout, || {
        let ds = c.get_json(&["daemonset", "-n", NAMESPACE, name])?;
        let want = ds["status"]["desiredNumberScheduled"]
            .as_i64()
            .unwrap_or(-1);
        let ready = ds["status"]["numberReady"].as_i64().unwrap_or(0);
        // After an upgrade, the pods of the new template: the rollout seen and done.
        let seen = ds["status"]["observedGeneration"] == ds["metadata"]["generation"];
        let updated = ds["status"]["updatedNumberScheduled"].as_i64().unwrap_or(0);
        Ok((seen && want > 0 && ready == want && updated == want).then_some(()))
    })
}

/// kill -9 of the main container of the chart's pod labelled `app.kubernetes.io/name=<name>` (its
/// process, as a crash would end it); returns once kubelet restarted it and it is Ready again.
pub fn kill_daemon(c: &Cluster, name: &str) -> Result<()> {
    let pod = chart_pods(c, name)?
        .into_iter()
        .next()
        .with_context(|| format!("no pod of {name}"))?;
    let pod_name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let status = &pod["status"]["containerStatuses"][0];
    let restarts = status["restartCount"].as_i64().unwrap_or(0);
    let id = status["containerID"]
        .as_str()
        .and_then(|s| s.strip_prefix("containerd://"))
        .with_context(|| format!("pod {pod_name} has no running container"))?
        .to_string();
    c.node()
        .ctr(&["tasks", "kill", "--signal", "SIGKILL", &id])?;
    c.wait(
        &format!("{name} restarted by kubelet and Ready"),
        Duration::from_secs(120),
        || {
            let p = c.get_json(&["pod", "-n", NAMESPACE, &pod_name])?;
            let s = &p["status"]["containerStatuses"][0];
            let again = s["restartCount"].as_i64().unwrap_or(0) > restarts && s["ready"] == true;
            Ok(again.then_some(()))
        },
    )
}

/// Restarts kubelet and waits for the Node to be Ready again.
pub fn restart_kubelet(c: &Cluster) -> Result<()> {
    {
        let mut node = c.node();
        node.stop_kubelet();
        node.start_kubelet()?;
    }
    // The Node's Ready condition is stale right after the restart: wait for a heartbeat newer
    // than the restart.
    let since = c.node_json()?["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|x| x["type"] == "Ready"))
        .and_then(|x| x["lastHeartbeatTime"].as_str().map(str::to_string))
        .unwrap_or_default();
    c.wait(
        "kubelet back, the Node Ready",
        Duration::from_secs(90),
        || {
            let n = c.node_json()?;
            let ready = n["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|x| {
                    x["type"] == "Ready"
                        && x["status"] == "True"
                        && x["lastHeartbeatTime"]
                            .as_str()
                            .is_some_and(|t| t > since.as_str())
                });
            Ok(ready.then_some(()))
        },
    )
}
