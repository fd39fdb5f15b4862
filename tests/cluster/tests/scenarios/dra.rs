//! The DRA driver (`draDriver.enabled`, nodes labelled `vm-dra`) through the real scheduler and
//! kubelet: GPUs published as a ResourceSlice, claimed by pods (a stand-in for virt-launcher)
//! that see their `/dev/vfio` nodes and the metadata file KubeVirt reads, a `firstAvailable`
//! claim, device health in the pod's status; with `draDriver.vgpu=all`, vGPUs placed by the
//! scheduler on one shared device per GPU and type and created by prepare (a burst of two sizes,
//! a full GPU, a whole GPU waiting for the last share), a GPU hot-plugged into the pool; pools
//! of 10 and 16 GPUs (more counter sets than one slice may hold); and faults: sandbox-dra
//! killed (-9), away while a pod is deleted, and kubelet restarted.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use cluster_tier::{Cluster, NAMESPACE};
use serde_json::Value;

use super::{
    TEST_NS, WORKLOAD, ensure_resources, kill_daemon, kubevirt_gives, mdevs, pod_yaml,
    resources_value, test_namespace, values_file, vmi_dra, vmi_dra_claim, wait_daemonset_ready,
    wait_gone, wait_log, wait_phase,
};

const DRIVER: &str = "gpu.gpu-vm-node.io";
const VGPU_CLASS: &str = "vgpu.gpu-vm-node.io";
const GPU_CLASS: &str = "vfio-gpu.gpu-vm-node.io";
const METADATA_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";
/// Where KubeVirt 1.8.0 to 1.8.2 read the metadata: `<dir>/<claim>/<request>/`.
const LEGACY_METADATA_DIR: &str = "/var/run/dra-device-attributes";

/// What the pods run: the container's `/dev/vfio` and every metadata file (both layouts), then
/// they stay.
fn show_devices() -> String {
    format!(
        "ls /dev/vfio; echo ---; for f in $(busybox find {METADATA_DIR} {LEGACY_METADATA_DIR} \
         -name '*.json'); do echo \"$f\"; busybox cat \"$f\"; echo; done; echo done; sleep 3600"
    )
}

/// A pod claiming one claim made from `template`, its container using the claim's request
/// `gpu`.
fn claim_pod(c: &Cluster, name: &str, template: &str) -> String {
    claim_pod_with(c, name, template, "")
}

/// [`claim_pod`] with `extra` lines in the container (`securityContext: ...`).
fn claim_pod_with(c: &Cluster, name: &str, template: &str, extra: &str) -> String {
    let mut y = pod_yaml(c, name, &show_devices(), "claims:\n- name: gpu", extra);
    y.push_str(&format!(
        "  resourceClaims:\n  - name: gpu\n    resourceClaimTemplateName: {template}\n"
    ));
    y
}

/// A ResourceClaimTemplate in the test namespace with `requests` (YAML under `requests:`,
/// indented for it) and optional `constraints`.
fn template(name: &str, requests: &str, constraints: &str) -> String {
    let indent = |s: &str| {
        s.lines()
            .map(|l| format!("        {l}\n"))
            .collect::<String>()
    };
    let mut y = format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  name: {name}\n  \
         namespace: {TEST_NS}\nspec:\n  spec:\n    devices:\n      requests:\n{}",
        indent(requests)
    );
    if !constraints.is_empty() {
        y.push_str(&format!("      constraints:\n{}", indent(constraints)));
    }
    y
}

/// The driver's ResourceSlices on the node.
fn slices(c: &Cluster) -> Result<Vec<Value>> {
    let all = c.get_json(&[
        "resourceslices",
        "--field-selector",
        &format!("spec.driver={DRIVER}"),
    ])?;
    Ok(all["items"].as_array().cloned().unwrap_or_default())
}

/// The pool each published device is in: name → pool.
fn device_pools(c: &Cluster) -> Result<std::collections::BTreeMap<String, String>> {
    let mut out = std::collections::BTreeMap::new();
    for s in slices(c)? {
        let pool = s["spec"]["pool"]["name"].as_str().unwrap_or_default();
        for d in s["spec"]["devices"].as_array().into_iter().flatten() {
            let name = d["name"].as_str().unwrap_or_default();
            out.insert(name.to_string(), pool.to_string());
        }
    }
    Ok(out)
}

/// The published devices: name → attributes. `None` while a pool is incomplete (fewer slices
/// than its `resourceSliceCount`, or slices of two generations).
pub(super) fn devices(c: &Cluster) -> Result<Option<Vec<(String, Value)>>> {
    let slices = slices(c)?;
    if !cluster_tier::api_server::whole_pools(&slices) {
        return Ok(None);
    }
    let mut out = Vec::new();
    for s in &slices {
        for d in s["spec"]["devices"].as_array().into_iter().flatten() {
            out.push((
                d["name"].as_str().unwrap_or_default().to_string(),
                d["attributes"].clone(),
            ));
        }
    }
    Ok(Some(out))
}

pub(super) fn attr<'a>(attrs: &'a Value, name: &str) -> &'a Value {
    let key = if name.contains('/') {
        name.to_string()
    } else {
        format!("{DRIVER}/{name}")
    };
    // The API server returns attributes under their names as written; ours are unqualified.
    match &attrs[name] {
        Value::Null => &attrs[key.as_str()],
        v => v,
    }
}

/// Waits for a complete pool in which `pred` holds; its devices.
pub(super) fn wait_pool(
    c: &Cluster,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&[(String, Value)]) -> bool,
) -> Result<Vec<(String, Value)>> {
    c.wait(what, timeout, || Ok(devices(c)?.filter(|d| pred(d))))
}

/// Passthrough devices (mode `passthrough`) and vGPU devices per parent GPU.
pub(super) fn count_modes(
    devs: &[(String, Value)],
) -> (usize, std::collections::BTreeMap<String, usize>) {
    let mut whole = 0;
    let mut vgpus = std::collections::BTreeMap::new();
    for (_, a) in devs {
        match attr(a, "mode")["string"].as_str() {
            Some("passthrough") => whole += 1,
            Some(_) => {
                let parent = attr(a, "parentGPU")["string"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                *vgpus.entry(parent).or_insert(0) += 1;
            }
            None => {}
        }
    }
    (whole, vgpus)
}

fn driver_of(c: &Cluster, addr: &str) -> Result<String> {
    c.with_sim(|s| {
        std::fs::read_link(s.root().join(format!("sys/bus/pci/devices/{addr}/driver")))
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_default()
    })
}

/// The metadata files a pod printed ([`show_devices`]): each path, and what it holds.
fn metadata_files(meta: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in meta.lines() {
        if line == "done" {
            break;
        }
        if line.starts_with(METADATA_DIR) || line.starts_with(LEGACY_METADATA_DIR) {
            out.push((line.to_string(), String::new()));
        } else if let Some((_, text)) = out.last_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    out
}

/// The name of the ResourceClaim `pod` calls `gpu` (made from its template, or named).
fn claim_name_of(c: &Cluster, pod: &str) -> Result<String> {
    let p = c.get_json(&["pod", "-n", TEST_NS, pod])?;
    p["status"]["resourceClaimStatuses"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["name"] == "gpu")
        .and_then(|s| s["resourceClaimName"].as_str())
        .or_else(|| {
            p["spec"]["resourceClaims"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|s| s["name"] == "gpu")
                .and_then(|s| s["resourceClaimName"].as_str())
        })
        .map(str::to_string)
        .with_context(|| format!("pod {pod} has no claim gpu"))
}

/// The metadata of `pod`'s request `request` as KubeVirt 1.8.0 to 1.8.2 read it, as the
/// container printed it ([`pod_view`]): at `/var/run/dra-device-attributes/<claim>/<request>/`,
/// one plain JSON object (not a stream), the `v1alpha1` object of the stream at the newer path;
/// the object.
fn legacy_metadata(c: &Cluster, pod: &str, meta: &str, request: &str) -> Result<Value> {
    let claim = claim_name_of(c, pod)?;
    let files = metadata_files(meta);
    let want = format!("{LEGACY_METADATA_DIR}/{claim}/{request}/{DRIVER}-metadata.json");
    let (_, text) = files
        .iter()
        .find(|(p, _)| *p == want)
        .with_context(|| format!("{pod}'s container has no {want}:\n{meta}"))?;
    let obj: Value = serde_json::from_str(text.trim())
        .with_context(|| format!("{want} in {pod} is not one JSON object:\n{text}"))?;
    ensure!(
        obj.is_object() && obj["apiVersion"] == "metadata.resource.k8s.io/v1alpha1",
        "{want} in {pod} is not a v1alpha1 DeviceMetadata object: {obj}"
    );
    let suffix = format!("/{request}/{DRIVER}-metadata.json");
    let (stream_path, stream) = files
        .iter()
        .find(|(p, _)| p.starts_with(METADATA_DIR) && p.ends_with(&suffix))
        .with_context(|| format!("{pod}'s container has no stream file for {request}:\n{meta}"))?;
    let in_stream = stream
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .any(|o| o == obj);
    ensure!(
        in_stream,
        "{want} in {pod} is not the v1alpha1 object of {stream_path}:\n{text}\n{stream}"
    );
    Ok(obj)
}

/// The attribute `name` (`{"string": ...}`) of the one device of request `request` in a
/// metadata object.
fn metadata_attr(obj: &Value, request: &str, name: &str) -> Option<String> {
    obj["requests"]
        .as_array()?
        .iter()
        .find(|r| r["name"] == request)?["devices"][0]["attributes"][name]["string"]
        .as_str()
        .map(str::to_string)
}

/// The pod's log once it printed everything: its `/dev/vfio` entries and its metadata files.
fn pod_view(c: &Cluster, pod: &str) -> Result<(Vec<String>, String)> {
    wait_phase(c, pod, &["Running"], Duration::from_secs(90))?;
    let log = wait_log(c, pod, "\ndone", Duration::from_secs(30))?;
    let (vfio, metadata) = log.split_once("---").unwrap_or((&log, ""));
    Ok((
        vfio.split_whitespace().map(str::to_string).collect(),
        metadata.to_string(),
    ))
}

/// No `FailedPrepareDynamicResources` Event for `pod` that reached the driver or found it
/// unregistered: its claim was prepared at the first call kubelet made to it. kubelet's own
/// read of the claim refused by the node authorizer ("no relationship found between node …",
/// the authorizer's graph not yet showing the pod's claim) is kubelet's to retry, and left out.
fn prepared_first_time(c: &Cluster, pod: &str) -> Result<()> {
    let failed: Vec<Value> = c
        .events(Some(TEST_NS))?
        .into_iter()
        .filter(|e| {
            let note = e["note"].as_str().or(e["message"].as_str()).unwrap_or("");
            (e["regarding"]["name"] == pod || e["involvedObject"]["name"] == pod)
                && e["reason"].as_str().is_some_and(|r| r.contains("Prepare"))
                && (note.contains("NodePrepareResources") || note.contains(DRIVER))
        })
        .collect();
    ensure!(
        failed.is_empty(),
        "pod {pod}'s claim failed a prepare before it started: {failed:?}"
    );
    Ok(())
}

/// sandbox-dra's `resources` value (draDriver.resources), and the container's as stored.
fn dra_resources() -> (Value, Value) {
    resources_value(72)
}

fn install(c: &Cluster, topology: &str, vgpu: bool) -> Result<()> {
    c.mount_sim(topology)?;
    c.label_node(WORKLOAD, Some("vm-dra"))?;
    helm_dra(c, vgpu, &[])?;
    test_namespace(c)
}

/// Whether Kubernetes `version` (`v1.37.2`) is later than 1.36.
pub(super) fn newer_than_1_36(version: &str) -> bool {
    let mut parts = version.trim_start_matches('v').split('.');
    let major: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (major, minor) > (1, 36)
}

/// Installs or upgrades the chart with the DRA driver as [`install`] does, plus `extra` values,
/// and waits for the driver to be ready.
fn helm_dra(c: &Cluster, vgpu: bool, extra: &[&str]) -> Result<()> {
    let mut set = vec!["draDriver.enabled=true", "draDriver.metricsPort=19484"];
    if vgpu {
        set.push("draDriver.vgpu=all");
        // The layout for kube-scheduler 1.37 and later.
        if newer_than_1_36(&c.assets().k8s_version) {
            set.push("draDriver.poolPerGpu=true");
        }
    }
    set.extend_from_slice(extra);
    let vf = values_file(
        c,
        "dra",
        &serde_json::json!({"draDriver": {"resources": dra_resources().0}}),
    )?;
    c.helm_install(&set, &["-f", &vf, "--wait", "--timeout", "3m"])?;
    wait_daemonset_ready(c, "sandbox-dra", Duration::from_secs(120))
}

/// Whole GPUs: a claim by product name and one with `firstAvailable`, each pod seeing its
/// group's node and the metadata KubeVirt reads; sandbox-dra killed and away while a pod is
/// deleted.
pub fn passthrough(c: &Cluster) -> Result<()> {
    install(c, "2xA10", false)?;
    let svc = c.get_json(&["service", "-n", NAMESPACE, "sandbox-dra-metrics"])?;
    ensure!(
        svc["spec"]["ports"][0]["port"] == 19484,
        "draDriver.metricsPort: the Service's port is {}",
        svc["spec"]["ports"][0]["port"]
    );
    ensure_resources(c, "sandbox-dra", "sandbox-dra", &dra_resources().1)?;
    let devs = wait_pool(c, "the two A10s published", Duration::from_secs(60), |d| {
        count_modes(d).0 == 2
    })?;
    ensure!(
        devs.iter()
            .all(|(_, a)| attr(a, "resource.kubernetes.io/pciBusID")["string"].is_string()),
        "a GPU without resource.kubernetes.io/pciBusID: {devs:?}"
    );

    let example =
        cluster_tier::assets::repo().join("deploy/examples/dra/resourceclaimtemplate.yaml");
    let example = example.to_string_lossy().into_owned();
    c.kubectl(&["apply", "-n", TEST_NS, "-f", &example])?;
    c.apply(&template(
        "first-available",
        &format!(
            "- name: gpu\n  firstAvailable:\n  - name: h100\n    deviceClassName: {GPU_CLASS}\n    \
             selectors:\n    - cel:\n        expression: device.attributes[\"{DRIVER}\"].productName == \"GH100 [H100 SXM5 80GB]\"\n  \
             - name: any\n    deviceClassName: {GPU_CLASS}"
        ),
        "",
    ))?;

    // vm-a runs as virt-launcher's user (107, qemu), not root.
    c.apply(&claim_pod_with(
        c,
        "vm-a",
        "a10-passthrough",
        "securityContext:\n  runAsUser: 107\n  runAsGroup: 107",
    ))?;
    let (vfio_a, meta_a) = pod_view(c, "vm-a")?;
    let addr_a = which_gpu(&vfio_a, &meta_a)?;
    ensure!(
        meta_a.contains(&format!(
            "{METADATA_DIR}/resourceclaimtemplates/gpu/gpu/{DRIVER}-metadata.json"
        )),
        "vm-a's metadata file is not where KubeVirt reads it:\n{meta_a}"
    );
    // Where KubeVirt 1.8.0 to 1.8.2 read it, as that user reads it: one object, the GPU's.
    let legacy = legacy_metadata(c, "vm-a", &meta_a, "gpu")?;
    ensure!(
        metadata_attr(&legacy, "gpu", "resource.kubernetes.io/pciBusID").as_deref() == Some(addr_a),
        "vm-a's metadata for KubeVirt 1.8.0-1.8.2 does not name {addr_a}: {legacy}"
    );
    ensure!(
        driver_of(c, addr_a)? == "vfio-pci",
        "{addr_a} is on {} while vm-a holds it",
        driver_of(c, addr_a)?
    );
    prepared_first_time(c, "vm-a")?;
    kubevirt_gives(
        c,
        "vm-a",
        &vmi_dra("a10-passthrough", &["gpu"]),
        &[addr_a.to_string()],
    )?;

    // firstAvailable: the H100 subrequest matches nothing here, `any` takes the other A10, and
    // the container still gets its devices (kubelet matches the request `gpu`, not `gpu/any`).
    c.apply(&claim_pod(c, "vm-b", "first-available"))?;
    let (vfio_b, meta_b) = pod_view(c, "vm-b")?;
    let addr_b = which_gpu(&vfio_b, &meta_b)?;
    ensure!(addr_b != addr_a, "vm-a and vm-b both hold {addr_a}");
    ensure!(
        meta_b.contains("gpu/any"),
        "vm-b's metadata does not name the subrequest gpu/any:\n{meta_b}"
    );
    // A VM names the request `gpu`: KubeVirt finds its device.
    kubevirt_gives(
        c,
        "vm-b",
        &vmi_dra("first-available", &["gpu"]),
        &[addr_b.to_string()],
    )?;

    // kubelet restarted while both VMs run: their containers and GPUs untouched (no sysfs
    // write at all), the slice back once kubelet (which deletes a node's slices when it starts)
    // and the driver are; a claim after that is prepared (vm-c, below).
    c.with_sim(|s| s.clear_ops())?;
    super::restart_kubelet(c)?;
    wait_pool(
        c,
        "the slice back after kubelet restarted",
        Duration::from_secs(90),
        |d| count_modes(d).0 == 2,
    )?;
    for (pod, addr) in [("vm-a", addr_a), ("vm-b", addr_b)] {
        let p = wait_phase(c, pod, &["Running"], Duration::from_secs(30))?;
        ensure!(
            p["status"]["containerStatuses"][0]["restartCount"] == 0,
            "{pod} restarted with kubelet"
        );
        ensure!(
            driver_of(c, addr)? == "vfio-pci",
            "{addr} left vfio-pci when kubelet restarted"
        );
    }
    let written = super::sysfs_writes(c)?;
    ensure!(
        written.is_empty(),
        "sysfs written while kubelet restarted with both claims prepared: {written:?}"
    );

    // sandbox-dra killed (-9) while both VMs run: nothing is taken from them.
    kill_daemon(c, "sandbox-dra")?;
    for (pod, addr) in [("vm-a", addr_a), ("vm-b", addr_b)] {
        ensure!(
            driver_of(c, addr)? == "vfio-pci",
            "{addr} left vfio-pci after sandbox-dra was killed"
        );
        let p = wait_phase(c, pod, &["Running"], Duration::from_secs(5))?;
        ensure!(
            p["status"]["containerStatuses"][0]["restartCount"] == 0,
            "{pod} restarted"
        );
    }

    // sandbox-dra away while vm-a is deleted: the GPU stays on VFIO until it is back, then
    // returns to nvidia.
    c.label_node(WORKLOAD, Some("none"))?;
    c.wait("sandbox-dra gone", Duration::from_secs(60), || {
        let pods = c.get_json(&["pods", "-n", NAMESPACE])?;
        Ok(pods["items"]
            .as_array()
            .is_none_or(Vec::is_empty)
            .then_some(()))
    })?;
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-a", "--wait=false"])?;
    c.wait("vm-a's container stopped", Duration::from_secs(60), || {
        let p = c.get_json(&["pod", "-n", TEST_NS, "vm-a", "--ignore-not-found"]);
        let stopped = match p {
            Ok(p) => {
                p.is_null()
                    || p["status"]["containerStatuses"][0]["state"]["terminated"].is_object()
            }
            Err(_) => true,
        };
        Ok(stopped.then_some(()))
    })?;
    ensure!(
        driver_of(c, addr_a)? == "vfio-pci",
        "{addr_a} left vfio-pci while no driver could unprepare it"
    );
    c.label_node(WORKLOAD, Some("vm-dra"))?;
    // Back, it unprepares the claim: the pod and its claim go. The GPU stays on VFIO, ready for
    // the next VM (sandbox-dra's default `--unprepare keep`).
    c.wait(
        "vm-a and its claim gone once sandbox-dra is back",
        Duration::from_secs(120),
        || {
            let pod = c.kubectl(&[
                "get",
                "pod",
                "-n",
                TEST_NS,
                "vm-a",
                "--ignore-not-found",
                "-o",
                "name",
            ])?;
            let claims = c.get_json(&["resourceclaims", "-n", TEST_NS])?;
            let left = claims["items"].as_array().into_iter().flatten().any(|cl| {
                cl["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("vm-a-"))
            });
            Ok((pod.trim().is_empty() && !left).then_some(()))
        },
    )?;
    ensure!(
        driver_of(c, addr_a)? == "vfio-pci",
        "{addr_a} left vfio-pci after its claim was unprepared (policy keep)"
    );
    // The freed GPU serves the next claim.
    c.apply(&claim_pod(c, "vm-c", "a10-passthrough"))?;
    let (vfio_c, meta_c) = pod_view(c, "vm-c")?;
    ensure!(
        which_gpu(&vfio_c, &meta_c)? == addr_a,
        "vm-c did not get the freed GPU {addr_a}"
    );

    // Device health, as kubelet shows it in the pod's status: Healthy, then Unhealthy once the
    // GPU is taken off vfio-pci under the VM.
    wait_health(c, "vm-c", "Healthy")?;
    c.with_sim(|s| std::fs::write(s.root().join("sys/bus/pci/drivers/vfio-pci/unbind"), addr_a))?
        .with_context(|| format!("unbinding {addr_a} from vfio-pci"))?;
    wait_health(c, "vm-c", "Unhealthy")?;
    Ok(())
}

/// Waits until kubelet shows every device of `pod`'s claim with `health`
/// (`status.containerStatuses[].allocatedResourcesStatus`).
fn wait_health(c: &Cluster, pod: &str, health: &str) -> Result<()> {
    c.wait(
        &format!("{pod}'s device {health} in its status"),
        Duration::from_secs(60),
        || {
            let p = c.get_json(&["pod", "-n", TEST_NS, pod])?;
            let healths: Vec<String> = p["status"]["containerStatuses"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|s| {
                    s["allocatedResourcesStatus"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .flat_map(|r| r["resources"].as_array().cloned().unwrap_or_default())
                .map(|r| r["health"].as_str().unwrap_or_default().to_string())
                .collect();
            Ok((!healths.is_empty() && healths.iter().all(|h| h == health)).then_some(()))
        },
    )
}

/// Which A10 a pod holds, from its `/dev/vfio` and its metadata's `pciBusID`, which must agree.
fn which_gpu(vfio: &[String], metadata: &str) -> Result<&'static str> {
    let (addr, group) = if metadata.contains("\"0000:41:00.0\"") {
        ("0000:41:00.0", "21")
    } else if metadata.contains("\"0000:61:00.0\"") {
        ("0000:61:00.0", "37")
    } else {
        bail!("the metadata names neither A10's pciBusID:\n{metadata}");
    };
    ensure!(
        vfio.iter().any(|n| n == group) && vfio.iter().any(|n| n == "vfio"),
        "/dev/vfio in the container holds {vfio:?}, not {group} and vfio ({addr})"
    );
    Ok(addr)
}

/// The ResourceClaimTemplate `name`: one vGPU of `vgpu_type` (`NVIDIA A10-4Q`).
fn vgpu_template(name: &str, vgpu_type: &str) -> String {
    template(
        name,
        &format!(
            "- name: gpu\n  exactly:\n    deviceClassName: {VGPU_CLASS}\n    selectors:\n    - cel:\n        \
             expression: device.attributes[\"{DRIVER}\"].vgpuType == \"{vgpu_type}\""
        ),
        "",
    )
}

/// The vGPUs (`mdevUUID`) a pod's metadata names, each once.
fn uuids_in(meta: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for part in meta.split("\"mdevUUID\":").skip(1) {
        let uuid = part.split('"').nth(3).unwrap_or_default().to_string();
        if !uuid.is_empty() && !out.contains(&uuid) {
            out.push(uuid);
        }
    }
    out
}

/// The GPU the metadata of a vGPU pod names as its vGPU's parent (`parentGPU`).
fn parent_of(meta: &str) -> Result<&'static str> {
    match (
        meta.contains("\"0000:41:00.0\""),
        meta.contains("\"0000:61:00.0\""),
    ) {
        (true, false) => Ok("0000:41:00.0"),
        (false, true) => Ok("0000:61:00.0"),
        _ => bail!("the metadata names not exactly one A10 as parentGPU:\n{meta}"),
    }
}

/// Why the scheduler leaves `pod` unscheduled (its `PodScheduled` condition), once it says.
fn unschedulable(c: &Cluster, pod: &str) -> Result<String> {
    c.wait(
        &format!("the scheduler's reason for {pod}"),
        Duration::from_secs(60),
        || {
            let p = c.get_json(&["pod", "-n", TEST_NS, pod])?;
            let cond = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|x| x["type"] == "PodScheduled" && x["status"] == "False")
                .and_then(|x| x["message"].as_str().map(str::to_string));
            Ok(cond)
        },
    )
}

/// sandbox-dra's writes of ResourceSlices so far, as the API server's audit log has them.
fn slice_writes(c: &Cluster) -> usize {
    c.control_plane()
        .requests_of(&format!("system:serviceaccount:{NAMESPACE}:sandbox-dra"))
        .iter()
        .filter(|e| {
            e["objectRef"]["resource"] == "resourceslices"
                && ["create", "update", "patch", "delete"]
                    .contains(&e["verb"].as_str().unwrap_or(""))
                && !e["requestURI"]
                    .as_str()
                    .is_some_and(|u| u.contains("dryRun=All"))
        })
        .count()
}

/// vGPUs through the real scheduler, one shared device per GPU and type: a burst of A10-4Q and
/// A10-8Q claims created at once lands one size per GPU and every one starts at its first
/// prepare; a GPU full of one type turns the next claim of it away (the scheduler's reason),
/// which runs once a place frees; a whole GPU waits until a GPU's last share is gone; the pool
/// is not written for any prepare. Then sandbox-dra killed and kubelet restarted with shares
/// prepared (nothing lost, nothing made twice), a GPU hot-plugged joins the pool, and the pool
/// layout (`draDriver.poolPerGpu`) turned over with every GPU in use keeps each GPU where its
/// claims were allocated, counted, until they are gone.
pub fn vgpu(c: &Cluster) -> Result<()> {
    install(c, "2xA10", true)?;
    let devs = wait_pool(
        c,
        "the A10s' vGPUs published",
        Duration::from_secs(60),
        |d| {
            let (whole, vgpus) = count_modes(d);
            whole == 2 && vgpus.len() == 2
        },
    )?;
    let (_, per_gpu) = count_modes(&devs);
    ensure!(
        per_gpu.values().all(|n| *n == 21),
        "not one shared device per A10 type (21 per GPU): {per_gpu:?}"
    );
    for example in ["vgpu-claims.yaml", "resourceclaimtemplate.yaml"] {
        let example = cluster_tier::assets::repo()
            .join("deploy/examples/dra")
            .join(example);
        let example = example.to_string_lossy().into_owned();
        c.kubectl(&["apply", "-n", TEST_NS, "-f", &example])?;
    }
    c.apply(&vgpu_template("a10-8q", "NVIDIA A10-8Q"))?;
    let writes_before = slice_writes(c);

    // A burst, created at once: three A10-4Q and three A10-8Q.
    let burst: Vec<(String, &str)> = (1..=3)
        .flat_map(|i| {
            [
                (format!("vm-4q-{i}"), "a10-4q"),
                (format!("vm-8q-{i}"), "a10-8q"),
            ]
        })
        .collect();
    let all: String = burst
        .iter()
        .map(|(pod, t)| format!("{}---\n", claim_pod(c, pod, t)))
        .collect();
    c.apply(&all)?;
    for (pod, _) in &burst {
        wait_phase(c, pod, &["Running"], super::BURST_PATIENCE)?;
    }
    let mut gpu_of = std::collections::BTreeMap::new();
    for (pod, t) in &burst {
        let (_, meta) = pod_view(c, pod)?;
        prepared_first_time(c, pod)?;
        gpu_of.insert(pod.clone(), (*t, parent_of(&meta)?));
        if pod == "vm-4q-1" {
            kubevirt_gives(c, pod, &vmi_dra(t, &["gpu"]), &uuids_in(&meta))?;
        }
    }
    let sizes_on = |gpu: &str| -> std::collections::BTreeSet<&str> {
        gpu_of
            .values()
            .filter(|(_, g)| *g == gpu)
            .map(|(t, _)| *t)
            .collect()
    };
    for gpu in ["0000:41:00.0", "0000:61:00.0"] {
        ensure!(
            sizes_on(gpu).len() == 1,
            "GPU {gpu} holds {:?}: two sizes on one GPU ({gpu_of:?})",
            sizes_on(gpu)
        );
    }
    let four_gpu = gpu_of["vm-4q-1"].1;
    ensure!(mdevs(c)?.len() == 6, "{:?}", mdevs(c)?);

    // The A10-4Q GPU filled up (six), then a seventh: turned away with the scheduler's reason.
    // The fifth names the type's own class (the examples' a10-4q-by-class, no selector) and
    // takes a share of the same device.
    let more: String = (4..=6)
        .map(|i| {
            let template = if i == 5 { "a10-4q-by-class" } else { "a10-4q" };
            format!("{}---\n", claim_pod(c, &format!("vm-4q-{i}"), template))
        })
        .collect();
    c.apply(&more)?;
    for i in 4..=6 {
        let (_, meta) = pod_view(c, &format!("vm-4q-{i}"))?;
        ensure!(
            parent_of(&meta)? == four_gpu,
            "vm-4q-{i} is not beside the other A10-4Qs on {four_gpu}"
        );
        if i == 5 {
            kubevirt_gives(
                c,
                "vm-4q-5",
                &vmi_dra("a10-4q-by-class", &["gpu"]),
                &uuids_in(&meta),
            )?;
        }
    }
    c.apply(&claim_pod(c, "vm-4q-7", "a10-4q"))?;
    let why = unschedulable(c, "vm-4q-7")?;
    ensure!(
        why.contains("cannot allocate all claims"),
        "vm-4q-7 waits for another reason: {why}"
    );
    eprintln!("  dra-vgpu: the seventh A10-4Q waits: {why}");
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-4q-1", "--wait=true"])?;
    let (_, meta) = pod_view(c, "vm-4q-7")?;
    ensure!(
        parent_of(&meta)? == four_gpu,
        "vm-4q-7 ran elsewhere than in vm-4q-1's place"
    );

    // A whole GPU while both GPUs hold shares: waits; once the A10-8Qs are gone, it takes their
    // GPU.
    c.apply(&claim_pod(c, "vm-whole", "a10-passthrough"))?;
    let why = unschedulable(c, "vm-whole")?;
    ensure!(
        why.contains("cannot allocate all claims"),
        "vm-whole waits for another reason: {why}"
    );
    for i in 1..=3 {
        c.kubectl(&[
            "delete",
            "pod",
            "-n",
            TEST_NS,
            &format!("vm-8q-{i}"),
            "--wait=false",
        ])?;
    }
    let (vfio, meta_whole) = pod_view(c, "vm-whole")?;
    let whole = which_gpu(&vfio, &meta_whole)?;
    ensure!(
        whole != four_gpu,
        "the whole GPU {whole} is the one holding A10-4Qs"
    );
    ensure!(
        driver_of(c, whole)? == "vfio-pci",
        "{whole} is not on vfio-pci"
    );
    ensure!(mdevs(c)?.len() == 6, "{:?}", mdevs(c)?);
    let writes = slice_writes(c) - writes_before;
    ensure!(
        writes == 0,
        "the pool was written {writes} times while vGPUs were prepared and unprepared"
    );
    eprintln!("  dra-vgpu: slice writes for 10 vGPU prepares and 4 unprepares: {writes}");

    // sandbox-dra killed (-9), then kubelet restarted, with six shares prepared: the same vGPUs,
    // the VMs' containers untouched, and a claim after that is prepared.
    let created = mdevs(c)?;
    kill_daemon(c, "sandbox-dra")?;
    ensure!(
        mdevs(c)? == created,
        "vGPUs changed after sandbox-dra was killed: {:?}",
        mdevs(c)?
    );
    super::restart_kubelet(c)?;
    wait_daemonset_ready(c, "sandbox-dra", Duration::from_secs(120))?;
    ensure!(
        mdevs(c)? == created,
        "vGPUs changed after kubelet restarted: {:?}",
        mdevs(c)?
    );
    for i in 2..=7 {
        let p = wait_phase(
            c,
            &format!("vm-4q-{i}"),
            &["Running"],
            Duration::from_secs(30),
        )?;
        ensure!(
            p["status"]["containerStatuses"][0]["restartCount"] == 0,
            "vm-4q-{i} restarted"
        );
    }
    // In the place freed, a firstAvailable claim whose first choice matches nothing here: its
    // A10-4Q prepared, and found by KubeVirt under the request the VM names.
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-4q-2", "--wait=true"])?;
    c.apply(&template(
        "fa-4q",
        &format!(
            "- name: gpu\n  firstAvailable:\n  - name: h100\n    deviceClassName: {VGPU_CLASS}\n    \
             selectors:\n    - cel:\n        expression: device.attributes[\"{DRIVER}\"].vgpuType == \"NVIDIA H100-10C\"\n  \
             - name: a10-4q\n    deviceClassName: {VGPU_CLASS}\n    selectors:\n    - cel:\n        \
             expression: device.attributes[\"{DRIVER}\"].vgpuType == \"NVIDIA A10-4Q\""
        ),
        "",
    ))?;
    c.apply(&claim_pod(c, "vm-4q-8", "fa-4q"))?;
    let (_, meta) = pod_view(c, "vm-4q-8")?;
    ensure!(
        meta.contains("gpu/a10-4q"),
        "vm-4q-8's metadata does not name the subrequest:\n{meta}"
    );
    kubevirt_gives(c, "vm-4q-8", &vmi_dra("fa-4q", &["gpu"]), &uuids_in(&meta))?;
    let created = mdevs(c)?;
    ensure!(created.len() == 6, "{created:?}");

    // A GPU hot-plugged under `--vgpu all` while shares exist joins the pool with its vGPU
    // types, and serves a claim.
    c.with_sim(|s| s.control("hotplug 0000:81:00.0 A10 group=45"))??;
    wait_pool(
        c,
        "the hot-plugged A10 published with its vGPUs",
        Duration::from_secs(60),
        |d| {
            let (whole, vgpus) = count_modes(d);
            whole == 3 && vgpus.get("0000:81:00.0") == Some(&21)
        },
    )?;
    let pool = std::fs::read_to_string(c.sim_root().join("run/gpu-vm-node/dra-pool"))
        .context("reading sandbox-dra's pool file")?;
    ensure!(
        pool.contains("0000:81:00.0"),
        "the hot-plugged GPU is not in sandbox-dra's pool:\n{pool}"
    );
    // And serves a VM two vGPUs of it: a claim of two requests (one device each, as a VM takes
    // them) on one GPU, two shares of its A10-8Q device.
    let one_8q = |name: &str| {
        format!(
            "- name: {name}\n  exactly:\n    deviceClassName: {VGPU_CLASS}\n    selectors:\n    - cel:\n        \
             expression: device.attributes[\"{DRIVER}\"].vgpuType == \"NVIDIA A10-8Q\""
        )
    };
    c.apply(&template(
        "two-8q",
        &format!("{}\n{}", one_8q("gpu-a"), one_8q("gpu-b")),
        &format!("- requests: [gpu-a, gpu-b]\n  matchAttribute: {DRIVER}/parentGPU"),
    ))?;
    c.apply(&claim_pod(c, "vm-two", "two-8q"))?;
    let (vfio, meta_two) = pod_view(c, "vm-two")?;
    prepared_first_time(c, "vm-two")?;
    let groups = vfio.iter().filter(|n| n.as_str() != "vfio").count();
    ensure!(
        groups == 2,
        "vm-two's /dev/vfio holds {vfio:?}: not two vGPU groups"
    );
    let made: Vec<String> = mdevs(c)?
        .into_iter()
        .filter(|m| !created.contains(m))
        .collect();
    ensure!(made.len() == 2, "vm-two's vGPUs: {made:?}");
    for uuid in &made {
        ensure!(
            meta_two.contains(uuid.as_str()),
            "vm-two's metadata does not name its vGPU {uuid}:\n{meta_two}"
        );
    }
    ensure!(
        meta_two.matches("\"0000:81:00.0\"").count() >= 2,
        "vm-two's vGPUs are not both on the new GPU:\n{meta_two}"
    );
    kubevirt_gives(c, "vm-two", &vmi_dra("two-8q", &["gpu-a", "gpu-b"]), &made)?;

    // A claim made by hand (not from a template), named by its pod: the GPU's third A10-8Q.
    c.apply(&format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: named-8q\n  \
         namespace: {TEST_NS}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        \
         deviceClassName: {VGPU_CLASS}\n        selectors:\n        - cel:\n            \
         expression: device.attributes[\"{DRIVER}\"].vgpuType == \"NVIDIA A10-8Q\"\n"
    ))?;
    let mut y = pod_yaml(c, "vm-named", &show_devices(), "claims:\n- name: gpu", "");
    y.push_str("  resourceClaims:\n  - name: gpu\n    resourceClaimName: named-8q\n");
    c.apply(&y)?;
    let (_, meta_named) = pod_view(c, "vm-named")?;
    ensure!(
        meta_named.contains("\"0000:81:00.0\""),
        "vm-named's vGPU is not on the new GPU:\n{meta_named}"
    );
    // A claim the pod names, where KubeVirt 1.8.0 to 1.8.2 read it: its vGPU's UUID.
    let legacy = legacy_metadata(c, "vm-named", &meta_named, "gpu")?;
    let named_uuids = uuids_in(&meta_named);
    ensure!(
        named_uuids.len() == 1
            && metadata_attr(&legacy, "gpu", "mdevUUID") == named_uuids.first().cloned(),
        "vm-named's metadata for KubeVirt 1.8.0-1.8.2 does not name its vGPU {named_uuids:?}: {legacy}"
    );
    kubevirt_gives(
        c,
        "vm-named",
        &vmi_dra_claim("named-8q", &["gpu"]),
        &uuids_in(&meta_named),
    )?;

    // The layout turned over under running VMs (`draDriver.poolPerGpu` flipped by a helm
    // upgrade; the driver is Ready after a pass with it): every GPU holds claims, so each stays
    // in the pool they were allocated from, where the scheduler counts them. The share vm-4q-3
    // frees on the full A10-4Q GPU is taken again, and no seventh.
    let device_4q = format!("vgpu-{}-a10-4q", four_gpu.replace([':', '.'], "-"));
    let before = device_pools(c)?;
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-4q-3", "--wait=true"])?;
    let per_gpu = !newer_than_1_36(&c.assets().k8s_version);
    helm_dra(c, true, &[&format!("draDriver.poolPerGpu={per_gpu}")])?;
    let kept = device_pools(c)?;
    ensure!(
        kept == before,
        "the pools changed with claims prepared on every GPU:\nbefore {before:#?}\nafter {kept:#?}"
    );
    c.apply(&claim_pod(c, "vm-4q-9", "a10-4q"))?;
    let (_, meta) = pod_view(c, "vm-4q-9")?;
    ensure!(
        parent_of(&meta)? == four_gpu,
        "vm-4q-9 is not in vm-4q-3's place on {four_gpu}"
    );
    c.apply(&claim_pod(c, "vm-4q-10", "a10-4q"))?;
    let why = unschedulable(c, "vm-4q-10")?;
    ensure!(
        why.contains("cannot allocate all claims"),
        "vm-4q-10 waits for another reason: {why}"
    );
    eprintln!(
        "  dra-vgpu: poolPerGpu={per_gpu} with every GPU in use: pools kept, {device_4q} in {}",
        kept.get(&device_4q).map_or("none", String::as_str)
    );

    c.kubectl(&["delete", "namespace", TEST_NS, "--wait=true"])?;
    c.wait("the vGPUs removed", Duration::from_secs(60), || {
        Ok(mdevs(c)?.is_empty().then_some(()))
    })?;
    // Their claims gone, the GPUs move to the pools the new layout gives them.
    let node = cluster_tier::NODE_NAME;
    let want = if per_gpu {
        format!("{node}/gpu-{}", four_gpu.replace([':', '.'], "-"))
    } else {
        node.to_string()
    };
    c.wait(
        &format!("{device_4q} moved to pool {want}"),
        Duration::from_secs(60),
        || Ok((device_pools(c)?.get(&device_4q) == Some(&want)).then_some(())),
    )?;
    Ok(())
}

/// A topology of `n` A10s, each behind its own root port and in its own group.
fn many_a10s(c: &Cluster, n: usize) -> Result<String> {
    let mut t = format!("name = \"{n}xA10\"\n");
    for i in 0..n {
        let bus = 0x10 + i * 0x08;
        t.push_str(&format!(
            "\n[[bridge]]\naddress = \"0000:{:02x}:01.1\"\nnuma = {}\n\n[[device]]\naddress = \"0000:{:02x}:00.0\"\n\
             model = \"A10\"\nbridge = \"0000:{:02x}:01.1\"\ngroup = {}\n",
            bus - 1,
            i % 2,
            bus,
            bus - 1,
            100 + i
        ));
    }
    let path = c.dir().join(format!("{n}xA10.toml"));
    std::fs::write(&path, t).with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_string_lossy().into_owned())
}

/// Pools of 10 and 16 A10s, each GPU a counter set: more than one slice holds. The pool is
/// published whole, and a whole GPU and a vGPU are placed on it.
pub fn large_pools(c: &Cluster) -> Result<()> {
    for n in [10, 16] {
        let topology = many_a10s(c, n)?;
        if n > 10 {
            super::reset(c)?;
        }
        install(c, &topology, true)?;
        wait_pool(
            c,
            &format!("{n} A10s and their vGPUs published"),
            Duration::from_secs(90),
            |d| {
                let (whole, vgpus) = count_modes(d);
                whole == n && vgpus.len() == n
            },
        )?;
        // A vGPU of the last GPU: its counter set is in the pool's second counters slice.
        let last = format!("0000:{:02x}:00.0", 0x10 + (n - 1) * 0x08);
        c.apply(&template(
            "a10-4q",
            &format!(
                "- name: gpu\n  exactly:\n    deviceClassName: {VGPU_CLASS}\n    selectors:\n    - cel:\n        \
                 expression: device.attributes[\"{DRIVER}\"].vgpuType == \"NVIDIA A10-4Q\" && \
                 device.attributes[\"{DRIVER}\"].parentGPU == \"{last}\""
            ),
            "",
        ))?;
        c.apply(&template(
            "whole",
            &format!("- name: gpu\n  exactly:\n    deviceClassName: {GPU_CLASS}"),
            "",
        ))?;
        c.apply(&claim_pod(c, "vm-vgpu", "a10-4q"))?;
        c.apply(&claim_pod(c, "vm-whole", "whole"))?;
        for pod in ["vm-vgpu", "vm-whole"] {
            let (vfio, _) = pod_view(c, pod)?;
            ensure!(
                vfio.iter().any(|n| n == "vfio"),
                "{pod} on the {n}-GPU node has no /dev/vfio/vfio: {vfio:?}"
            );
        }
        c.kubectl(&["delete", "namespace", TEST_NS, "--wait=true"])?;
    }
    Ok(())
}

/// The taint on device `name` in the driver's slices: (key, value, effect), or `None`.
fn taint_of(c: &Cluster, name: &str) -> Result<Option<(String, String, String)>> {
    for s in slices(c)? {
        for d in s["spec"]["devices"].as_array().into_iter().flatten() {
            if d["name"] == name {
                return Ok(d["taints"].get(0).map(|t| {
                    let f = |k: &str| t[k].as_str().unwrap_or_default().to_string();
                    (f("key"), f("value"), f("effect"))
                }));
            }
        }
    }
    bail!("no device {name} in the slices")
}

/// The claim of `pod` (its one claim made from a template), as the API server has it.
fn claim_of(c: &Cluster, pod: &str) -> Result<Value> {
    let p = c.get_json(&["pod", "-n", TEST_NS, pod])?;
    let name = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        .as_str()
        .with_context(|| format!("pod {pod} has no claim yet"))?
        .to_string();
    c.get_json(&["resourceclaim", "-n", TEST_NS, &name])
}

/// Devices that cannot serve a VM stay published with a taint, which the real scheduler and
/// kubelet act on: a GPU whose IOMMU group holds a NIC (`foreign-group`) is published tainted,
/// a claim is not placed on it and one that tolerates the taint is; a pooled GPU whose VFs
/// cannot be enabled gets its vGPU devices tainted, and untainted once they can, each one
/// slice write; a prepared vGPU whose mdev is removed, and one whose GPU is unplugged, show
/// Unhealthy in the pod's status (the unplugged GPU's device staying published, tainted, while
/// the claim holds it).
pub fn taints(c: &Cluster) -> Result<()> {
    install(c, "foreign-group", true)?;
    let key = format!("{DRIVER}/unusable");
    c.wait(
        "the refused A10 published with a taint",
        Duration::from_secs(60),
        || {
            Ok(taint_of(c, "gpu-0000-41-00-0").ok().flatten().filter(|t| {
                *t == (
                    key.clone(),
                    "group-not-assignable".into(),
                    "NoSchedule".into(),
                )
            }))
        },
    )?;
    ensure!(
        taint_of(c, "gpu-0000-61-00-0")?.is_none(),
        "the clean A10 is tainted"
    );
    let example =
        cluster_tier::assets::repo().join("deploy/examples/dra/resourceclaimtemplate.yaml");
    c.kubectl(&["apply", "-n", TEST_NS, "-f", &example.to_string_lossy()])?;

    // Two whole-A10 claims: the first gets the clean GPU, the second waits.
    c.apply(&claim_pod(c, "vm-t1", "a10-passthrough"))?;
    let (vfio, meta) = pod_view(c, "vm-t1")?;
    ensure!(
        which_gpu(&vfio, &meta)? == "0000:61:00.0",
        "vm-t1 is not on the clean A10"
    );
    c.apply(&claim_pod(c, "vm-t2", "a10-passthrough"))?;
    let p = c.wait("vm-t2 left unscheduled", Duration::from_secs(60), || {
        let p = c.get_json(&["pod", "-n", TEST_NS, "vm-t2"])?;
        let why = p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|x| x["type"] == "PodScheduled" && x["status"] == "False")
            .and_then(|x| x["message"].as_str().map(str::to_string));
        Ok(why)
    })?;
    ensure!(
        p.contains("cannot allocate all claims"),
        "vm-t2 waits for another reason: {p}"
    );
    // A claim tolerating the taint is placed on the tainted GPU (its prepare then refuses the
    // group, naming the NIC in it).
    c.apply(&template(
        "tolerant",
        &format!(
            "- name: gpu\n  exactly:\n    deviceClassName: {GPU_CLASS}\n    tolerations:\n    \
             - key: {key}\n      operator: Exists\n      effect: NoSchedule"
        ),
        "",
    ))?;
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-t2", "--wait=true"])?;
    c.apply(&claim_pod(c, "vm-t3", "tolerant"))?;
    let got = c.wait(
        "the tolerating claim allocated",
        Duration::from_secs(60),
        || {
            let claim = claim_of(c, "vm-t3").ok();
            Ok(claim.and_then(|cl| {
                cl["status"]["allocation"]["devices"]["results"][0]["device"]
                    .as_str()
                    .map(str::to_string)
            }))
        },
    )?;
    ensure!(
        got == "gpu-0000-41-00-0",
        "the tolerating claim got {got}, not the tainted GPU"
    );
    c.wait(
        "vm-t3's prepare refused, naming the NIC in the group",
        Duration::from_secs(60),
        || {
            let refused = c.events(Some(TEST_NS))?.into_iter().any(|e| {
                let note = e["note"].as_str().or(e["message"].as_str()).unwrap_or("");
                (e["regarding"]["name"] == "vm-t3" || e["involvedObject"]["name"] == "vm-t3")
                    && note.contains("0000:42:00.0")
            });
            Ok(refused.then_some(()))
        },
    )?;
    for pod in ["vm-t1", "vm-t3"] {
        c.kubectl(&["delete", "pod", "-n", TEST_NS, pod, "--wait=true"])?;
    }

    // The clean A10's VFs cannot be enabled: its vGPU devices tainted (one slice written), a
    // vGPU claim waits; once they can, the taint goes (one more) and the claim is prepared.
    let vgpu_device = "vgpu-0000-61-00-0-a10-4q";
    let writes = |c: &Cluster| -> usize {
        c.control_plane()
            .requests_of(&format!("system:serviceaccount:{NAMESPACE}:sandbox-dra"))
            .iter()
            .filter(|e| {
                e["objectRef"]["resource"] == "resourceslices"
                    && e["verb"] == "patch"
                    && !e["requestURI"]
                        .as_str()
                        .is_some_and(|u| u.contains("dryRun"))
            })
            .count()
    };
    let before = writes(c);
    c.with_sim(|s| s.control("fault sriov_numvfs 0000:61:00.0 EIO"))??;
    c.apply(&template(
        "a10-4q",
        &format!(
            "- name: gpu\n  exactly:\n    deviceClassName: {VGPU_CLASS}\n    selectors:\n    - cel:\n        \
             expression: device.attributes[\"{DRIVER}\"].vgpuType == \"NVIDIA A10-4Q\""
        ),
        "",
    ))?;
    c.apply(&claim_pod(c, "vm-v", "a10-4q"))?;
    c.wait(
        "the vGPU devices of the GPU whose VFs cannot be enabled tainted",
        Duration::from_secs(60),
        || {
            Ok(taint_of(c, vgpu_device)?
                .filter(|t| t.1 == "vfs-not-enabled")
                .map(|_| ()))
        },
    )?;
    ensure!(
        taint_of(c, "gpu-0000-61-00-0")?.is_none(),
        "the whole GPU is tainted too"
    );
    let tainted = writes(c) - before;
    ensure!(
        tainted == 1,
        "the taint took {tainted} slice writes, not one"
    );
    // The cause fixed and the VFs enabled by hand: the taint goes, and a vGPU claim is placed
    // there and prepared.
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-v", "--wait=true"])?;
    c.with_sim(|s| s.control("clear-faults"))??;
    c.with_sim(|s| {
        std::fs::write(
            s.root()
                .join("sys/bus/pci/devices/0000:61:00.0/sriov_numvfs"),
            "32",
        )
    })?
    .context("enabling the VFs of 0000:61:00.0")?;
    c.wait("the taint lifted", Duration::from_secs(60), || {
        Ok(taint_of(c, vgpu_device)?.is_none().then_some(()))
    })?;
    let lifted = writes(c) - before - tainted;
    ensure!(
        lifted == 1,
        "lifting the taint took {lifted} slice writes, not one"
    );
    c.apply(&claim_pod(c, "vm-v2", "a10-4q"))?;
    let (_, meta) = pod_view(c, "vm-v2")?;
    prepared_first_time(c, "vm-v2")?;
    let uuid = uuids_in(&meta)
        .first()
        .with_context(|| format!("vm-v2's metadata names no vGPU:\n{meta}"))?
        .clone();
    wait_health(c, "vm-v2", "Healthy")?;

    // The vGPU removed under the VM: kubelet shows it Unhealthy.
    c.with_sim(|s| {
        std::fs::write(
            s.root().join(format!("sys/bus/mdev/devices/{uuid}/remove")),
            "1",
        )
    })?
    .context("removing vm-v2's vGPU")?;
    wait_health(c, "vm-v2", "Unhealthy")?;
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-v2", "--wait=true"])?;

    // A GPU unplugged under a VM's vGPU: Unhealthy in the pod's status, and its device stays
    // published, tainted `gone`, while the claim holds it.
    c.apply(&claim_pod(c, "vm-w", "a10-4q"))?;
    pod_view(c, "vm-w")?;
    wait_health(c, "vm-w", "Healthy")?;
    c.with_sim(|s| s.control("unplug 0000:61:00.0"))??;
    wait_health(c, "vm-w", "Unhealthy")?;
    c.wait(
        "the unplugged GPU's vGPU device published, tainted gone",
        Duration::from_secs(60),
        || {
            Ok(taint_of(c, vgpu_device)
                .ok()
                .flatten()
                .filter(|t| t.1 == "gone")
                .map(|_| ()))
        },
    )?;
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-w", "--wait=true"])?;
    c.wait(
        "the gone device left the slices with its last claim",
        Duration::from_secs(60),
        || Ok(taint_of(c, vgpu_device).is_err().then_some(())),
    )?;
    // kubelet polls the driver's health every 5 s: none of that logged an error (a health
    // stream that ended with a driver restart aside).
    let log = std::fs::read_to_string(c.dir().join("logs/kubelet.log")).unwrap_or_default();
    let health_errors: Vec<&str> = log
        .lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.starts_with('e')
                && l.contains("health")
                && (l.contains("dra") || l.contains("device"))
        })
        .filter(|l| !l.contains("Error receiving from WatchResources stream"))
        .collect();
    ensure!(
        health_errors.is_empty(),
        "kubelet logged errors about device health:\n{}",
        health_errors.join("\n")
    );

    // draDriver.taintEffect=NoExecute: the refused GPU's taint evicts the pod of a claim that
    // holds it and tolerates NoSchedule only (kube-controller-manager's device taint eviction).
    c.apply(&claim_pod(c, "vm-x", "tolerant"))?;
    c.wait(
        "vm-x's claim allocated the refused GPU",
        Duration::from_secs(60),
        || {
            let claim = claim_of(c, "vm-x").ok();
            Ok(claim
                .filter(|cl| {
                    cl["status"]["allocation"]["devices"]["results"][0]["device"]
                        == "gpu-0000-41-00-0"
                })
                .map(|_| ()))
        },
    )?;
    helm_dra(c, true, &["draDriver.taintEffect=NoExecute"])?;
    c.wait(
        "the refused A10's taint NoExecute",
        Duration::from_secs(60),
        || {
            Ok(taint_of(c, "gpu-0000-41-00-0")
                .ok()
                .flatten()
                .filter(|t| {
                    *t == (
                        key.clone(),
                        "group-not-assignable".into(),
                        "NoExecute".into(),
                    )
                })
                .map(|_| ()))
        },
    )?;
    wait_gone(
        c,
        "vm-x evicted by the NoExecute taint",
        "pod",
        "vm-x",
        Duration::from_secs(90),
    )?;
    Ok(())
}
