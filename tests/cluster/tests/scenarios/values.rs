//! The chart's documented values (docs/install-kubernetes.md), each set as a user would and its
//! effect checked on what the cluster runs; the workload labels are the other scenarios'.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use cluster_tier::{Cluster, NAMESPACE};
use serde_json::Value;

use super::vgpu::{CONFIG, STATE, wait_state};
use super::{
    WORKLOAD, chart_pods, ensure_resources, http_get, mdevs, resources_value, sysfs_writes,
    values_file, wait_allocatable, wait_daemonset_ready,
};

const CUSTOM_CONFIG: &str = r#"version: v1
vgpu-configs:
  A10-8Q:
    - devices: all
      vgpu-devices: {"A10-8Q": 3}
  two-small:
    - devices: all
      vgpu-devices: {"A10-2Q": 4}
"#;

/// A ConfigMap of profiles the user keeps (`vgpuDeviceManager.config.create=false`), with a
/// profile the chart's content does not have.
const USER_CONFIG_MAP: &str = "user-vgpu-profiles";
const USER_CONFIG: &str = r#"version: v1
vgpu-configs:
  user-4q:
    - devices: all
      vgpu-devices: {"A10-4Q": 6}
"#;

/// The minimal CRDs the chart's optional objects need: the Prometheus Operator's
/// ServiceMonitor and OpenShift's SecurityContextConstraints.
fn crd(group: &str, kind: &str, plural: &str, scope: &str) -> String {
    format!(
        r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: {plural}.{group}
spec:
  group: {group}
  scope: {scope}
  names: {{kind: {kind}, plural: {plural}, singular: {singular}}}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {{type: object, x-kubernetes-preserve-unknown-fields: true}}
"#,
        singular = kind.to_lowercase()
    )
}

fn daemonset(c: &Cluster, name: &str) -> Result<Value> {
    c.get_json(&["daemonset", "-n", NAMESPACE, name])
}

fn pod_of(c: &Cluster, name: &str) -> Result<Value> {
    chart_pods(c, name)?
        .into_iter()
        .next()
        .with_context(|| format!("no pod of {name}"))
}

pub fn run(c: &Cluster) -> Result<()> {
    c.mount_sim("2xA10")?;
    // What the values name must exist: an image under another name, a priority class, the
    // CRDs of the optional objects.
    c.node().ctr(&[
        "images",
        "tag",
        "--force",
        &format!("docker.io/library/{}", c.assets().image_ref),
        "example.test/gpu/gpu-vm-node:cluster-test",
    ])?;
    c.apply("apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata:\n  name: gpu-test-critical\nvalue: 1000000\n")?;
    c.apply(&crd(
        "monitoring.coreos.com",
        "ServiceMonitor",
        "servicemonitors",
        "Namespaced",
    ))?;
    c.apply(&crd(
        "security.openshift.io",
        "SecurityContextConstraints",
        "securitycontextconstraints",
        "Cluster",
    ))?;
    c.wait("the CRDs served", Duration::from_secs(30), || {
        let out = c
            .kubectl(&[
                "api-resources",
                "--api-group",
                "security.openshift.io",
                "-o",
                "name",
            ])
            .unwrap_or_default();
        let out2 = c
            .kubectl(&[
                "api-resources",
                "--api-group",
                "monitoring.coreos.com",
                "-o",
                "name",
            ])
            .unwrap_or_default();
        Ok((!out.trim().is_empty() && !out2.trim().is_empty()).then_some(()))
    })?;
    // A taint only the custom toleration tolerates; scheduling labels the values select on.
    c.kubectl(&[
        "taint",
        "node",
        cluster_tier::NODE_NAME,
        "example.test/dedicated=gpu:NoSchedule",
        "--overwrite",
    ])?;
    c.label_node(WORKLOAD, Some("vm-vgpu"))?;

    // The pull secret the values name.
    c.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NAMESPACE}\n"
    ))?;
    let _ = c.kubectl(&[
        "delete",
        "secret",
        "-n",
        NAMESPACE,
        "registry-cred",
        "--ignore-not-found",
    ]);
    c.kubectl(&[
        "create",
        "secret",
        "-n",
        NAMESPACE,
        "docker-registry",
        "registry-cred",
        "--docker-server=example.test",
        "--docker-username=u",
        "--docker-password=p",
    ])?;
    let (vdm_resources, vdm_stored) = resources_value(40);
    let (dp_resources, dp_stored) = resources_value(24);
    let values_file = c.dir().join("values-test.yaml");
    let values = serde_json::json!({
        "image": {"repository": "example.test/gpu/gpu-vm-node", "tag": "cluster-test"},
        "imagePullSecrets": [{"name": "registry-cred"}],
        "logLevel": "debug",
        "priorityClassName": "gpu-test-critical",
        "tolerations": [{"key": "example.test/dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"example.test/pool": "gpus"},
        "nodeAffinityExpressions": [{"key": "example.test/zone", "operator": "In", "values": ["a"]}],
        "vgpuDeviceManager": {
            "metricsPort": 19482,
            "defaultConfig": "A10-8Q",
            "config": {"name": "my-vgpu-profiles", "content": CUSTOM_CONFIG},
            "ownNodePolicy": {"enabled": true},
            "resources": vdm_resources
        },
        "sandboxDevicePlugin": {"metricsPort": 19483, "resources": dp_resources},
        "metrics": {"serviceMonitor": {"enabled": true, "interval": "15s", "labels": {"release": "prometheus"}}},
        "openshift": {"scc": {"enabled": true}}
    });
    std::fs::write(&values_file, values.to_string()).context("writing the values")?;
    let vf = values_file.to_string_lossy().into_owned();
    c.helm_install(&[], &["-f", &vf])?;

    // nodeSelector and nodeAffinityExpressions: nothing runs until the node has both labels.
    let ds = daemonset(c, "vgpu-device-manager")?;
    ensure!(
        ds["status"]["desiredNumberScheduled"] == 0,
        "vgpu-device-manager is scheduled on a node without the selected labels: {}",
        ds["status"]
    );
    c.label_node("example.test/pool", Some("gpus"))?;
    c.label_node("example.test/zone", Some("a"))?;
    wait_daemonset_ready(c, "vgpu-device-manager", Duration::from_secs(120))?;
    wait_daemonset_ready(c, "sandbox-dp", Duration::from_secs(120))?;

    // defaultConfig (no vgpu.config label) from the custom ConfigMap's profiles.
    wait_state(c, "success", Duration::from_secs(60))?;
    wait_allocatable(c, "nvidia.com/NVIDIA_A10-8Q", 6, Duration::from_secs(60))?;
    let cm = c.get_json(&["configmap", "-n", NAMESPACE, "my-vgpu-profiles"])?;
    ensure!(
        cm["data"]["config.yaml"]
            .as_str()
            .is_some_and(|d| d.contains("two-small")),
        "config.content is not the ConfigMap's"
    );
    c.label_node(CONFIG, Some("two-small"))?;
    wait_allocatable(c, "nvidia.com/NVIDIA_A10-2Q", 8, Duration::from_secs(90))?;

    // image, pull secrets, priority, tolerations, resources, log level, ports.
    let pod = pod_of(c, "vgpu-device-manager")?;
    let spec = &pod["spec"];
    ensure!(
        spec["containers"][0]["image"] == "example.test/gpu/gpu-vm-node:cluster-test",
        "image: {}",
        spec["containers"][0]["image"]
    );
    ensure!(
        spec["imagePullSecrets"][0]["name"] == "registry-cred",
        "imagePullSecrets: {}",
        spec["imagePullSecrets"]
    );
    ensure!(
        spec["priorityClassName"] == "gpu-test-critical" && spec["priority"] == 1_000_000,
        "priority: {} {}",
        spec["priorityClassName"],
        spec["priority"]
    );
    // resources: as given, in the API server's canonical quantities.
    ensure_resources(c, "vgpu-device-manager", "vgpu-device-manager", &vdm_stored)?;
    ensure_resources(c, "sandbox-dp", "sandbox-dp", &dp_stored)?;
    let name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let log = c.container_log(NAMESPACE, &name, "vgpu-device-manager")?;
    ensure!(
        log.contains(" DEBUG "),
        "logLevel=debug: no debug line in vgpu-device-manager's log"
    );
    // metricsPort: the Service's port, and /metrics served there on the pod's IP.
    for (app, port) in [("vgpu-device-manager", 19482), ("sandbox-dp", 19483)] {
        let svc = format!("{app}-metrics");
        let s = c.get_json(&["service", "-n", NAMESPACE, &svc])?;
        ensure!(
            s["spec"]["ports"][0]["port"] == port,
            "{svc} port: {}",
            s["spec"]["ports"][0]
        );
        metrics_served(c, app, port)?;
    }
    // The ServiceMonitor and the SCC.
    let sm = c.get_json(&["servicemonitors", "-n", NAMESPACE])?;
    let sms = sm["items"].as_array().map(Vec::len).unwrap_or(0);
    ensure!(
        sms > 0 && sm["items"][0]["metadata"]["labels"]["release"] == "prometheus",
        "ServiceMonitors: {sm}"
    );
    let scc = c.get_json(&["securitycontextconstraints"])?;
    ensure!(
        scc["items"].as_array().is_some_and(|i| !i.is_empty()),
        "no SecurityContextConstraints"
    );

    // The own-node policy: vgpu-device-manager's own token may not label another Node.
    c.apply("apiVersion: v1\nkind: Node\nmetadata:\n  name: other-node\n")?;
    let token = daemon_token(c, "vgpu-device-manager")?;
    // (One lock of the control plane at a time: its guard lives to the end of a statement.)
    let server = c.control_plane().server();
    let ca = c.control_plane().pki().ca();
    let out = std::process::Command::new(&c.assets().kubectl)
        .args(["--server", &server, "--certificate-authority"])
        .arg(&ca)
        .args([
            "--token",
            &token,
            "label",
            "node",
            "other-node",
            "nvidia.com/vgpu.config.state=success",
        ])
        .output()
        .context("running kubectl as vgpu-device-manager")?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("may change only the node its pod runs on"),
        "the own-node policy let vgpu-device-manager label another node: {err}"
    );
    c.kubectl(&["delete", "node", "other-node"])?;

    // namespace.create=true is refused and changes nothing.
    match c.helm_install(&["namespace.create=true"], &["-f", &vf]) {
        Ok(_) => bail!("namespace.create=true was accepted"),
        Err(e) => ensure!(
            format!("{e:#}").contains("Create the namespace first"),
            "namespace.create=true refused without saying what to do: {e:#}"
        ),
    }
    ensure!(
        daemonset(c, "vgpu-device-manager").is_ok(),
        "the refused upgrade changed the release"
    );

    // config.create=false: the chart's ConfigMap goes, the daemon reads the user's own.
    c.apply(
        &serde_json::json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": USER_CONFIG_MAP, "namespace": NAMESPACE},
            "data": {"config.yaml": USER_CONFIG}
        })
        .to_string(),
    )?;
    let user_config = [
        "vgpuDeviceManager.config.create=false",
        &format!("vgpuDeviceManager.config.name={USER_CONFIG_MAP}"),
    ];
    c.helm_install(&user_config, &["-f", &vf])?;
    c.wait(
        "vgpu-device-manager started again with the user's ConfigMap",
        Duration::from_secs(120),
        || {
            let items = chart_pods(c, "vgpu-device-manager")?;
            let ok = items.len() == 1
                && items.iter().all(|p| {
                    let mounts_user = p["spec"]["volumes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|v| v["configMap"]["name"] == USER_CONFIG_MAP);
                    let running =
                        p["status"]["containerStatuses"][0]["state"]["running"].is_object();
                    mounts_user && running && p["metadata"]["deletionTimestamp"].is_null()
                });
            Ok(ok.then_some(()))
        },
    )?;
    let cms = c.get_json(&["configmaps", "-n", NAMESPACE])?;
    let mut names: Vec<&str> = cms["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["metadata"]["name"].as_str())
        .collect();
    names.sort_unstable();
    ensure!(
        names == ["kube-root-ca.crt", USER_CONFIG_MAP],
        "config.create=false: the namespace's ConfigMaps are {names:?}"
    );
    let user_cm = c.get_json(&["configmap", "-n", NAMESPACE, USER_CONFIG_MAP])?;
    ensure!(
        user_cm["data"]["config.yaml"] == USER_CONFIG
            && user_cm["metadata"]["annotations"]["meta.helm.sh/release-name"].is_null(),
        "the user's ConfigMap was changed or taken over by the release: {}",
        user_cm["metadata"]
    );
    c.label_node(CONFIG, Some("user-4q"))?;
    wait_allocatable(c, "nvidia.com/NVIDIA_A10-4Q", 12, Duration::from_secs(90))?;
    wait_state(c, "success", Duration::from_secs(30))?;

    // vgpuDeviceManager.enabled=false: its DaemonSet, Service and own-node policy go; the vGPUs
    // it made and the node's state stay, and sandbox-dp goes on serving them.
    let made = mdevs(c)?;
    let no_vdm = [
        user_config[0],
        user_config[1],
        "vgpuDeviceManager.enabled=false",
    ];
    c.helm_install(&no_vdm, &["-f", &vf])?;
    c.wait(
        "vgpu-device-manager's DaemonSet, pod, Service and policy gone",
        Duration::from_secs(90),
        || {
            let left = c.kubectl(&[
                "get",
                "daemonset/vgpu-device-manager",
                "service/vgpu-device-manager-metrics",
                "validatingadmissionpolicy/gpu-vm-node-vgpu-device-manager-own-node",
                "-n",
                NAMESPACE,
                "--ignore-not-found",
                "-o",
                "name",
            ])?;
            let none = chart_pods(c, "vgpu-device-manager")?.is_empty();
            Ok((left.trim().is_empty() && none).then_some(()))
        },
    )?;
    ensure!(
        mdevs(c)? == made,
        "the vGPUs changed when vgpu-device-manager was disabled: {:?}, were {made:?}",
        mdevs(c)?
    );
    let node = c.node_json()?;
    ensure!(
        node["metadata"]["labels"][STATE] == "success",
        "the state label changed when vgpu-device-manager was disabled: {}",
        node["metadata"]["labels"]
    );
    wait_allocatable(c, "nvidia.com/NVIDIA_A10-4Q", 12, Duration::from_secs(30))?;

    // sandboxDevicePlugin.enabled=false removes the device plugin.
    let no_dp = [
        user_config[0],
        user_config[1],
        "vgpuDeviceManager.enabled=false",
        "sandboxDevicePlugin.enabled=false",
    ];
    c.helm_install(&no_dp, &["-f", &vf])?;
    c.wait("sandbox-dp removed", Duration::from_secs(60), || {
        let out = c.kubectl(&[
            "get",
            "daemonset",
            "-n",
            NAMESPACE,
            "sandbox-dp",
            "--ignore-not-found",
            "-o",
            "name",
        ])?;
        Ok(out.trim().is_empty().then_some(()))
    })?;
    c.kubectl(&[
        "delete",
        "configmap",
        "-n",
        NAMESPACE,
        USER_CONFIG_MAP,
        "--ignore-not-found",
    ])?;
    c.kubectl(&[
        "taint",
        "node",
        cluster_tier::NODE_NAME,
        "example.test/dedicated-",
    ])?;
    for l in ["example.test/pool", "example.test/zone"] {
        c.label_node(l, None)?;
    }
    Ok(())
}

/// The chart's daemon `app` serves `/metrics` at `port` of its pod's IP.
fn metrics_served(c: &Cluster, app: &str, port: u16) -> Result<()> {
    let pod = pod_of(c, app)?;
    let ip = pod["status"]["podIP"]
        .as_str()
        .with_context(|| format!("{app}'s pod has no IP"))?
        .to_string();
    let (status, body) = http_get(c, &ip, port, "/metrics")?;
    ensure!(
        status.contains(" 200 ") && body.contains("# TYPE"),
        "{app}: GET http://{ip}:{port}/metrics answered {status:?}:\n{body}"
    );
    Ok(())
}

/// The service-account token a daemon's pod runs with, read from its container's files.
fn daemon_token(c: &Cluster, name: &str) -> Result<String> {
    let pod = pod_of(c, name)?;
    let id = pod["status"]["containerStatuses"][0]["containerID"]
        .as_str()
        .and_then(|s| s.strip_prefix("containerd://"))
        .context("no container")?
        .to_string();
    let info = c.node().ctr(&["tasks", "ls"])?;
    let pid = info
        .lines()
        .find(|l| l.starts_with(&id))
        .and_then(|l| l.split_whitespace().nth(1))
        .context("the container's task")?
        .to_string();
    let p = Path::new("/proc")
        .join(pid)
        .join("root/var/run/secrets/kubernetes.io/serviceaccount/token");
    Ok(std::fs::read_to_string(&p)
        .with_context(|| format!("reading {}", p.display()))?
        .trim()
        .to_string())
}

/// vfioManager.enabled=false on a vm-passthrough node: nothing binds the GPUs, and sandbox-dp
/// waits for a vfio-pci-ready nobody writes. Then kubeletDir: a kubelet whose root is not
/// /var/lib/kubelet (k0s, MicroK8s) — here the same directory seen at another path — with
/// onDemand.gpus naming one GPU, onDemand.metricsPort and onDemand.resources.
pub fn vfio_off_kubelet_dir_on_demand(c: &Cluster) -> Result<()> {
    let sim = c.mount_sim("2xA10")?;
    c.label_node(WORKLOAD, Some("vm-passthrough"))?;
    c.with_sim(|s| s.clear_ops())?;
    c.helm_install(&["vfioManager.enabled=false"], &[])?;
    // sandbox-dp scheduled and waiting in its init container: the node was looked at.
    c.wait(
        "sandbox-dp waiting for vfio-pci-ready",
        Duration::from_secs(90),
        || {
            let pods = chart_pods(c, "sandbox-dp")?;
            let waiting = pods.first().is_some_and(|p| {
                p["status"]["initContainerStatuses"][0]["state"]["running"].is_object()
            });
            Ok(waiting.then_some(()))
        },
    )?;
    let left = c.kubectl(&[
        "get",
        "daemonset/vfio-manager",
        "service/vfio-manager-metrics",
        "-n",
        NAMESPACE,
        "--ignore-not-found",
        "-o",
        "name",
    ])?;
    ensure!(
        left.trim().is_empty(),
        "vfioManager.enabled=false installed {left}"
    );
    for gpu in ["0000:41:00.0", "0000:61:00.0"] {
        let drv = std::fs::read_link(sim.join(format!("sys/bus/pci/devices/{gpu}/driver")))?;
        ensure!(
            drv.ends_with("nvidia"),
            "vfioManager.enabled=false: {gpu} is on {drv:?}"
        );
    }
    let written = sysfs_writes(c)?;
    ensure!(
        written.is_empty(),
        "vfioManager.enabled=false: sysfs written: {written:?}"
    );
    ensure!(
        !sim.join("run/nvidia/validations/vfio-pci-ready").exists(),
        "vfio-pci-ready written with vfioManager.enabled=false"
    );
    ensure!(
        c.allocatable("nvidia.com/GA102GL_A10")? == 0,
        "GPUs advertised with vfioManager.enabled=false"
    );

    // (Short: a device plugin socket path, /host<kubeletDir>/device-plugins/<name>.sock, must fit
    // in 108 bytes.)
    let alt = c.dir().join("k0s/kubelet");
    c.bind_mount(Path::new(cluster_tier::node::KUBELET_ROOT), &alt)?;
    c.label_node(WORKLOAD, Some("vm-vgpu-on-demand"))?;
    let alt_s = alt.to_string_lossy().into_owned();
    let (resources, stored) = resources_value(56);
    let vf = values_file(
        c,
        "on-demand",
        &serde_json::json!({
            "kubeletDir": alt_s,
            "onDemand": {
                "enabled": true,
                "gpus": "0000:41:00.0",
                "metricsPort": 19485,
                "resources": resources
            }
        }),
    )?;
    c.helm_install(&[], &["-f", &vf, "--wait", "--timeout", "3m"])?;
    // One GPU pooled: six A10-4Q, not twelve; the other GPU's VFs are not enabled.
    wait_allocatable(c, "nvidia.com/NVIDIA_A10-4Q", 6, Duration::from_secs(60))?;
    let vfs = std::fs::read_to_string(sim.join("sys/bus/pci/devices/0000:61:00.0/sriov_numvfs"))?;
    ensure!(
        vfs.trim() == "0",
        "the GPU outside onDemand.gpus has {vfs} VFs enabled"
    );
    // onDemand.metricsPort: the Service, and /metrics on the pod's IP; onDemand.resources.
    let svc = c.get_json(&["service", "-n", NAMESPACE, "sandbox-dp-on-demand-metrics"])?;
    ensure!(
        svc["spec"]["ports"][0]["port"] == 19485,
        "onDemand.metricsPort: the Service's port is {}",
        svc["spec"]["ports"][0]
    );
    let pod = pod_of(c, "sandbox-dp-on-demand")?;
    let ip = pod["status"]["podIP"]
        .as_str()
        .context("sandbox-dp-on-demand's pod has no IP")?
        .to_string();
    let (status, body) = http_get(c, &ip, 19485, "/metrics")?;
    ensure!(
        status.contains(" 200 ") && body.contains("sandbox_dp_on_demand_vgpus_created"),
        "GET http://{ip}:19485/metrics answered {status:?}:\n{body}"
    );
    ensure_resources(c, "sandbox-dp-on-demand", "sandbox-dp", &stored)?;
    Ok(())
}
