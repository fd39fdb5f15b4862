//! The DRA driver (`draDriver.enabled`, nodes labelled `vm-dra`) through the real scheduler and
//! kubelet: GPUs published as a ResourceSlice, claimed by pods (a stand-in for virt-launcher)
//! that see their `/dev/vfio` nodes and the metadata file KubeVirt reads, a `firstAvailable`
//! claim, device health in the pod's status; with `draDriver.vgpu=all`, vGPUs fitted on a GPU's
//! counters and created by prepare (two of one GPU in one claim, at the first prepare), a GPU
//! hot-plugged into the pool; pools of 10 and 16 GPUs (more counter sets than one slice may
//! hold); and faults: sandbox-dra killed (-9), and away while a pod is deleted.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use cluster_tier::{Cluster, NAMESPACE};
use serde_json::Value;

use super::{
    TEST_NS, WORKLOAD, kill_daemon, mdevs, pod_yaml, test_namespace, wait_daemonset_ready,
    wait_log, wait_phase,
};

const DRIVER: &str = "gpu.gpu-vm-node.io";
const VGPU_CLASS: &str = "vgpu.gpu-vm-node.io";
const GPU_CLASS: &str = "vfio-gpu.gpu-vm-node.io";
const METADATA_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";

/// What the pods run: the container's `/dev/vfio` and every metadata file, then they stay.
fn show_devices() -> String {
    format!(
        "ls /dev/vfio; echo ---; for f in $(busybox find {METADATA_DIR} -name '*.json'); do \
         echo \"$f\"; busybox cat \"$f\"; echo; done; echo done; sleep 3600"
    )
}

/// A pod claiming one claim made from `template`, its container using the claim's request
/// `gpu`.
fn claim_pod(c: &Cluster, name: &str, template: &str) -> String {
    let mut y = pod_yaml(c, name, &show_devices(), "claims:\n- name: gpu", "");
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

/// The published devices: name → attributes. Fails while the pool is incomplete (fewer slices
/// than its `resourceSliceCount`, or slices of two generations).
fn devices(c: &Cluster) -> Result<Option<Vec<(String, Value)>>> {
    let slices = slices(c)?;
    let Some(first) = slices.first() else {
        return Ok(None);
    };
    let generation = &first["spec"]["pool"]["generation"];
    let count = first["spec"]["pool"]["resourceSliceCount"]
        .as_u64()
        .unwrap_or(0);
    if slices.len() as u64 != count
        || slices
            .iter()
            .any(|s| &s["spec"]["pool"]["generation"] != generation)
    {
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

fn attr<'a>(attrs: &'a Value, name: &str) -> &'a Value {
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
fn wait_pool(
    c: &Cluster,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&[(String, Value)]) -> bool,
) -> Result<Vec<(String, Value)>> {
    c.wait(what, timeout, || Ok(devices(c)?.filter(|d| pred(d))))
}

/// Passthrough devices (mode `passthrough`) and vGPU devices per parent GPU.
fn count_modes(devs: &[(String, Value)]) -> (usize, std::collections::BTreeMap<String, usize>) {
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

fn install(c: &Cluster, topology: &str, vgpu: bool) -> Result<()> {
    c.mount_sim(topology)?;
    c.label_node(WORKLOAD, Some("vm-dra"))?;
    let mut set = vec!["draDriver.enabled=true", "draDriver.metricsPort=19484"];
    if vgpu {
        set.push("draDriver.vgpu=all");
    }
    c.helm_install(&set, &["--wait", "--timeout", "3m"])?;
    wait_daemonset_ready(c, "sandbox-dra", Duration::from_secs(120))?;
    test_namespace(c)
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

    c.apply(&claim_pod(c, "vm-a", "a10-passthrough"))?;
    let (vfio_a, meta_a) = pod_view(c, "vm-a")?;
    let addr_a = which_gpu(&vfio_a, &meta_a)?;
    ensure!(
        meta_a.contains(&format!(
            "{METADATA_DIR}/resourceclaimtemplates/gpu/gpu/{DRIVER}-metadata.json"
        )),
        "vm-a's metadata file is not where KubeVirt reads it:\n{meta_a}"
    );
    ensure!(
        driver_of(c, addr_a)? == "vfio-pci",
        "{addr_a} is on {} while vm-a holds it",
        driver_of(c, addr_a)?
    );
    prepared_first_time(c, "vm-a")?;

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

/// vGPUs: two in one claim on one GPU (prepared at the first call), a whole GPU beside them,
/// sandbox-dra killed while they run, and a GPU hot-plugged into the pool.
pub fn vgpu(c: &Cluster) -> Result<()> {
    install(c, "2xA10", true)?;
    wait_pool(
        c,
        "the A10s' vGPUs published",
        Duration::from_secs(60),
        |d| {
            let (whole, vgpus) = count_modes(d);
            whole == 2 && vgpus.len() == 2
        },
    )?;
    for example in ["vgpu-claims.yaml", "resourceclaimtemplate.yaml"] {
        let example = cluster_tier::assets::repo()
            .join("deploy/examples/dra")
            .join(example);
        let example = example.to_string_lossy().into_owned();
        c.kubectl(&["apply", "-n", TEST_NS, "-f", &example])?;
    }
    c.apply(&template(
        "two-4q",
        &format!(
            "- name: gpu\n  exactly:\n    deviceClassName: {VGPU_CLASS}\n    allocationMode: ExactCount\n    \
             count: 2\n    selectors:\n    - cel:\n        expression: device.attributes[\"{DRIVER}\"].vgpuType == \"NVIDIA A10-4Q\""
        ),
        &format!("- requests: [gpu]\n  matchAttribute: {DRIVER}/parentGPU"),
    ))?;

    c.apply(&claim_pod(c, "vm-two", "two-4q"))?;
    let (vfio, meta) = pod_view(c, "vm-two")?;
    prepared_first_time(c, "vm-two")?;
    let groups: Vec<&String> = vfio.iter().filter(|n| n.as_str() != "vfio").collect();
    ensure!(
        groups.len() == 2,
        "vm-two's /dev/vfio holds {vfio:?}: not two vGPU groups"
    );
    let created = mdevs(c)?;
    ensure!(
        created.len() == 2,
        "the node's vGPUs are {created:?}, not two"
    );
    for uuid in &created {
        ensure!(
            meta.contains(uuid.as_str()),
            "vm-two's metadata does not name its vGPU {uuid}:\n{meta}"
        );
    }

    // Their GPU now offers only 4 GiB sizes (an A10's vGPUs all have one size): an 8 GiB vGPU
    // is placed on the other GPU by the real scheduler and starts at its first prepare.
    let two_gpu = if meta.contains("\"0000:41:00.0\"") {
        "0000:41:00.0"
    } else {
        "0000:61:00.0"
    };
    let t0 = std::time::Instant::now();
    wait_pool(
        c,
        "the other sizes of vm-two's GPU withdrawn",
        Duration::from_secs(60),
        |d| {
            d.iter().all(|(_, a)| {
                attr(a, "parentGPU")["string"] != two_gpu
                    || attr(a, "framebufferMiB")["int"] == 4096
            })
        },
    )?;
    eprintln!(
        "  dra-vgpu: other sizes withdrawn from the slice {:.1} s after vm-two ran",
        t0.elapsed().as_secs_f64()
    );
    c.apply(&claim_pod(c, "vm-8g", "vgpu-8gi"))?;
    let (_, meta_8g) = pod_view(c, "vm-8g")?;
    prepared_first_time(c, "vm-8g")?;
    ensure!(
        !meta_8g.contains(&format!("\"{two_gpu}\"")),
        "the 8 GiB vGPU went to {two_gpu}, beside 4 GiB ones:\n{meta_8g}"
    );
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-8g", "--wait=true"])?;
    c.wait("vm-8g's vGPU removed", Duration::from_secs(60), || {
        Ok((mdevs(c)?.len() == 2).then_some(()))
    })?;

    // A whole GPU beside them: the other A10.
    c.apply(&claim_pod(c, "vm-whole", "a10-passthrough"))?;
    let (vfio, meta_whole) = pod_view(c, "vm-whole")?;
    let whole = which_gpu(&vfio, &meta_whole)?;
    ensure!(
        driver_of(c, whole)? == "vfio-pci",
        "{whole} is not on vfio-pci"
    );

    kill_daemon(c, "sandbox-dra")?;
    ensure!(
        mdevs(c)? == created,
        "vGPUs changed after sandbox-dra was killed: {:?}",
        mdevs(c)?
    );

    // A GPU hot-plugged under `--vgpu all` joins the pool with its vGPUs.
    c.with_sim(|s| s.control("hotplug 0000:81:00.0 A10 group=45"))??;
    wait_pool(
        c,
        "the hot-plugged A10 published with its vGPUs",
        Duration::from_secs(60),
        |d| {
            let (whole, vgpus) = count_modes(d);
            whole == 3 && vgpus.contains_key("0000:81:00.0")
        },
    )?;
    let pool = std::fs::read_to_string(c.sim_root().join("run/gpu-vm-node/dra-pool"))
        .context("reading sandbox-dra's pool file")?;
    ensure!(
        pool.contains("0000:81:00.0"),
        "the hot-plugged GPU is not in sandbox-dra's pool:\n{pool}"
    );
    // And it serves a claim.
    c.apply(&template(
        "on-new-gpu",
        &format!(
            "- name: gpu\n  exactly:\n    deviceClassName: {VGPU_CLASS}\n    selectors:\n    - cel:\n        \
             expression: device.attributes[\"{DRIVER}\"].parentGPU == \"0000:81:00.0\""
        ),
        "",
    ))?;
    c.apply(&claim_pod(c, "vm-new", "on-new-gpu"))?;
    let (_, meta_new) = pod_view(c, "vm-new")?;
    ensure!(
        meta_new.contains("mdevUUID"),
        "vm-new's metadata carries no vGPU:\n{meta_new}"
    );

    for pod in ["vm-two", "vm-whole", "vm-new"] {
        c.kubectl(&["delete", "pod", "-n", TEST_NS, pod, "--wait=true"])?;
    }
    c.wait("the vGPUs removed", Duration::from_secs(60), || {
        Ok(mdevs(c)?.is_empty().then_some(()))
    })?;
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
