//! The device plugin's resource names served by the DRA driver (DRA extended resources): on a
//! `vm-dra` node, with no device plugin, a pod (a VM's virt-launcher) asking for
//! `nvidia.com/NVIDIA_A10-4Q` or `nvidia.com/GA102GL_A10` in its limits, as every VM spec
//! written for sandbox-dp does, is given a claim by the real scheduler and prepared by
//! sandbox-dra: the container gets the env var and `/dev/vfio` nodes KubeVirt's own code turns
//! into the right `<hostdev>`; a full GPU turns the next pod away, sizes created at once are
//! placed apart, none is refused by kubelet's admission.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use cluster_tier::Cluster;
use serde_json::Value;

use super::dra::{attr, count_modes, wait_pool};
use super::{
    ENV_OF_PID1, TEST_NS, WORKLOAD, kubevirt_gives, mdevs, pod_yaml, test_namespace, values_file,
    vmi_gpus, wait_daemonset_ready, wait_gone, wait_log, wait_phase,
};

const A10: &str = "nvidia.com/GA102GL_A10";
const A10_4Q: &str = "nvidia.com/NVIDIA_A10-4Q";
const A10_8Q: &str = "nvidia.com/NVIDIA_A10-8Q";

/// A pod asking for `n` of extended resource `resource` in its limits, printing the env
/// virt-launcher reads and its `/dev/vfio`.
fn limits_pod(c: &Cluster, name: &str, resource: &str, n: u32) -> String {
    pod_yaml(
        c,
        name,
        &format!(
            "{ENV_OF_PID1} | busybox grep 'PCI_RESOURCE_' ; echo ---; ls /dev/vfio ; echo done ; \
             sleep 3600"
        ),
        &format!("limits:\n  {resource}: {n}"),
        "",
    )
}

/// A container's env vars, each with its comma-separated values (`NAME=a,b` → name, [a, b]).
type Vars = Vec<(String, Vec<String>)>;

/// The pod's env vars and `/dev/vfio` entries, once Running.
fn env_view(c: &Cluster, pod: &str) -> Result<(Vars, Vec<String>)> {
    wait_phase(c, pod, &["Running"], Duration::from_secs(90))?;
    let log = wait_log(c, pod, "\ndone", Duration::from_secs(30))?;
    let (env, vfio) = log.split_once("---").unwrap_or((&log, ""));
    let vars = env
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| {
            (
                k.to_string(),
                v.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect(),
            )
        })
        .collect();
    Ok((
        vars,
        vfio.split_whitespace()
            .filter(|s| *s != "done")
            .map(str::to_string)
            .collect(),
    ))
}

/// The one env var of `pod` named `var`, its values.
fn var(vars: &Vars, var: &str, pod: &str) -> Result<Vec<String>> {
    vars.iter()
        .find(|(k, _)| k == var)
        .map(|(_, v)| v.clone())
        .with_context(|| format!("pod {pod} has no {var}: {vars:?}"))
}

/// The pod's claim the scheduler made for its extended resources
/// (`status.extendedResourceClaimStatus`).
fn extended_claim(c: &Cluster, pod: &str) -> Result<String> {
    let p = c.get_json(&["pod", "-n", TEST_NS, pod])?;
    let s = &p["status"]["extendedResourceClaimStatus"];
    let claim = s["resourceClaimName"].as_str().with_context(|| {
        format!(
            "pod {pod} has no extendedResourceClaimStatus: {}",
            p["status"]
        )
    })?;
    ensure!(
        s["requestMappings"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["containerName"] == "vm")),
        "pod {pod}'s extendedResourceClaimStatus maps no request to its container: {s}"
    );
    Ok(claim.to_string())
}

/// The parent GPU of vGPU `uuid` on the node (its VF's `physfn`, or its parent).
fn parent_gpu(c: &Cluster, uuid: &str) -> Result<String> {
    c.with_sim(|s| {
        let dev =
            std::fs::canonicalize(s.root().join(format!("sys/bus/mdev/devices/{uuid}"))).ok()?;
        let parent = dev.parent()?.to_path_buf();
        let gpu = std::fs::canonicalize(parent.join("physfn")).unwrap_or(parent);
        Some(gpu.file_name()?.to_string_lossy().into_owned())
    })?
    .with_context(|| format!("vGPU {uuid} is not on the node"))
}

/// No pod of the test namespace was refused by kubelet's admission (`UnexpectedAdmissionError`
/// and the like: `status.reason` on a Failed pod).
fn none_refused(c: &Cluster) -> Result<()> {
    let pods = c.get_json(&["pods", "-n", TEST_NS])?;
    for p in pods["items"].as_array().into_iter().flatten() {
        if p["status"]["phase"] == "Failed" {
            bail!(
                "pod {} failed: {} {}",
                p["metadata"]["name"],
                p["status"]["reason"],
                p["status"]["message"]
            );
        }
    }
    Ok(())
}

fn pending_reason(c: &Cluster, pod: &str) -> Result<String> {
    c.wait(
        &format!("the scheduler's reason for {pod}"),
        Duration::from_secs(60),
        || {
            let p = c.get_json(&["pod", "-n", TEST_NS, pod])?;
            Ok(p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|x| x["type"] == "PodScheduled" && x["status"] == "False")
                .and_then(|x| x["message"].as_str().map(str::to_string)))
        },
    )
}

pub fn run(c: &Cluster) -> Result<()> {
    c.mount_sim("2xA10")?;
    c.label_node(WORKLOAD, Some("vm-dra"))?;
    // draDriver.vgpuTypes: a name and a pattern, the types these pods ask for; a pool per GPU
    // on kube-scheduler 1.37 and later.
    let per_gpu = super::dra::newer_than_1_36(&c.assets().k8s_version);
    let vf = values_file(
        c,
        "vgpu-types",
        &serde_json::json!({"draDriver": {"vgpuTypes": "A10-4Q,*-8Q", "poolPerGpu": per_gpu}}),
    )?;
    c.helm_install(
        &["draDriver.enabled=true", "draDriver.vgpu=all"],
        &["-f", &vf, "--wait", "--timeout", "3m"],
    )?;
    wait_daemonset_ready(c, "sandbox-dra", Duration::from_secs(120))?;
    test_namespace(c)?;
    // The node's slices publish those types' devices alone, on each GPU.
    let devs = wait_pool(
        c,
        "the A10s and their vGPU types published",
        Duration::from_secs(60),
        |d| {
            let (whole, vgpus) = count_modes(d);
            whole == 2 && vgpus.len() == 2
        },
    )?;
    let mut types: Vec<String> = devs
        .iter()
        .filter(|(_, a)| attr(a, "mode")["string"] == "vgpu")
        .map(|(_, a)| {
            format!(
                "{} on {}",
                attr(a, "vgpuType")["string"].as_str().unwrap_or_default(),
                attr(a, "parentGPU")["string"].as_str().unwrap_or_default()
            )
        })
        .collect();
    types.sort();
    ensure!(
        types
            == [
                "NVIDIA A10-4Q on 0000:41:00.0",
                "NVIDIA A10-4Q on 0000:61:00.0",
                "NVIDIA A10-8Q on 0000:41:00.0",
                "NVIDIA A10-8Q on 0000:61:00.0",
            ],
        "draDriver.vgpuTypes=A10-4Q,*-8Q: the slices publish {types:?}"
    );
    // The chart's classes, and no device plugin on the node: the names are not allocatable.
    let classes = c.get_json(&["deviceclasses"])?;
    let serves = |name: &str| {
        classes["items"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|d: &Value| d["spec"]["extendedResourceName"] == name)
    };
    ensure!(
        serves(A10) && serves(A10_4Q) && serves(A10_8Q),
        "the chart installs no DeviceClass for {A10}, {A10_4Q} or {A10_8Q}"
    );
    // Of the A10's types, only those vgpuTypes lists have a class.
    let a10_types: Vec<&str> = classes["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d: &Value| d["spec"]["extendedResourceName"].as_str())
        .filter(|n| n.starts_with("nvidia.com/NVIDIA_A10-"))
        .collect();
    ensure!(
        a10_types.len() == 2,
        "draDriver.vgpuTypes=A10-4Q,*-8Q: DeviceClasses for {a10_types:?}"
    );
    // A node that ran sandbox-dp before keeps its names in allocatable at 0 (kubelet zeroes a
    // device plugin's resources and never drops them): the scheduler serves a name at 0
    // through DRA, as one the node never had.
    let node = c.node_json()?;
    let advertised = &node["status"]["allocatable"][A10_4Q];
    ensure!(
        advertised.is_null() || advertised == "0",
        "the node advertises {A10_4Q} itself: {}",
        node["status"]["allocatable"]
    );

    // One A10-4Q by limits: the vGPU made at prepare, named in the env var KubeVirt reads.
    c.apply(&limits_pod(c, "vm-4q", A10_4Q, 1))?;
    let (vars, vfio) = env_view(c, "vm-4q")?;
    let uuids = var(&vars, "MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q", "vm-4q")?;
    ensure!(uuids.len() == 1, "vm-4q's env names {uuids:?}");
    ensure!(
        mdevs(c)? == uuids,
        "the node's vGPUs are {:?}, the env names {uuids:?}",
        mdevs(c)?
    );
    ensure!(
        vfio.iter().any(|n| n == "vfio") && vfio.len() == 2,
        "{vfio:?}"
    );
    let claim = extended_claim(c, "vm-4q")?;
    kubevirt_gives(c, "vm-4q", &vmi_gpus(&[A10_4Q]), &uuids)?;
    let four_gpu = parent_gpu(c, &uuids[0])?;
    c.kubectl(&["delete", "pod", "-n", TEST_NS, "vm-4q", "--wait=true"])?;
    c.wait(
        "vm-4q's vGPU removed with it",
        Duration::from_secs(60),
        || Ok(mdevs(c)?.is_empty().then_some(())),
    )?;
    wait_gone(
        c,
        "vm-4q's claim gone with it",
        "resourceclaim",
        &claim,
        Duration::from_secs(60),
    )?;

    // A whole A10 by limits: its address in PCI_RESOURCE_, its group on vfio-pci and in the
    // container.
    c.apply(&limits_pod(c, "vm-a10", A10, 1))?;
    let (vars, vfio) = env_view(c, "vm-a10")?;
    let addrs = var(&vars, "PCI_RESOURCE_NVIDIA_COM_GA102GL_A10", "vm-a10")?;
    let [addr] = &addrs[..] else {
        bail!("vm-a10's env names {addrs:?}");
    };
    let group = if addr == "0000:41:00.0" { "21" } else { "37" };
    ensure!(
        vfio.iter().any(|n| n == group),
        "/dev/vfio/{group} of {addr} is not in the container: {vfio:?}"
    );
    let driver = c.with_sim(|s| {
        std::fs::read_link(s.root().join(format!("sys/bus/pci/devices/{addr}/driver")))
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
    })?;
    ensure!(
        driver.as_deref() == Some("vfio-pci"),
        "{addr} is on {driver:?}"
    );
    extended_claim(c, "vm-a10")?;
    kubevirt_gives(c, "vm-a10", &vmi_gpus(&[A10]), &addrs)?;

    // The other A10 is left: seven A10-4Q pods at once, six run there, the seventh waits with
    // the scheduler's reason; none is refused by kubelet.
    let seven: String = (1..=7)
        .map(|i| format!("{}---\n", limits_pod(c, &format!("vm-s{i}"), A10_4Q, 1)))
        .collect();
    c.apply(&seven)?;
    let mut running = Vec::new();
    let mut waiting = Vec::new();
    c.wait(
        "six of seven A10-4Q pods running",
        Duration::from_secs(120),
        || {
            running.clear();
            waiting.clear();
            for i in 1..=7 {
                let pod = format!("vm-s{i}");
                let p = c.get_json(&["pod", "-n", TEST_NS, &pod])?;
                match p["status"]["phase"].as_str() {
                    Some("Running") => running.push(pod),
                    Some("Pending") if p["spec"]["nodeName"].is_null() => waiting.push(pod),
                    _ => {}
                }
            }
            Ok((running.len() == 6 && waiting.len() == 1).then_some(()))
        },
    )?;
    none_refused(c)?;
    let why = pending_reason(c, &waiting[0])?;
    ensure!(
        why.contains("cannot allocate all claims") || why.contains("Insufficient"),
        "{} waits for another reason: {why}",
        waiting[0]
    );
    eprintln!("  dra-extended-resources: the seventh A10-4Q pod waits: {why}");
    ensure!(mdevs(c)?.len() == 6, "{:?}", mdevs(c)?);

    // Everything deleted, then sizes at once: two A10-4Q pods and three A10-8Q, one size per
    // GPU, all running.
    c.kubectl(&["delete", "pods", "-n", TEST_NS, "--all", "--wait=true"])?;
    c.wait("the vGPUs removed", Duration::from_secs(60), || {
        Ok(mdevs(c)?.is_empty().then_some(()))
    })?;
    let mut mixed = String::new();
    for (pod, resource) in [
        ("vm-m4-1", A10_4Q),
        ("vm-m4-2", A10_4Q),
        ("vm-m8-1", A10_8Q),
        ("vm-m8-2", A10_8Q),
        ("vm-m8-3", A10_8Q),
    ] {
        mixed.push_str(&format!("{}---\n", limits_pod(c, pod, resource, 1)));
    }
    c.apply(&mixed)?;
    for pod in ["vm-m4-1", "vm-m4-2", "vm-m8-1", "vm-m8-2", "vm-m8-3"] {
        wait_phase(c, pod, &["Running"], super::BURST_PATIENCE)?;
    }
    let mut sizes: std::collections::BTreeMap<String, &str> = Default::default();
    for pod in ["vm-m4-1", "vm-m4-2", "vm-m8-1", "vm-m8-2", "vm-m8-3"] {
        let (vars, _) = env_view(c, pod)?;
        let size = if pod.starts_with("vm-m4") { "4Q" } else { "8Q" };
        let var_name = format!("MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-{size}");
        let uuids = var(&vars, &var_name, pod)?;
        ensure!(uuids.len() == 1, "{pod}'s env names {uuids:?}");
        let gpu = parent_gpu(c, &uuids[0])?;
        if let Some(other) = sizes.insert(gpu.clone(), size).filter(|s| *s != size) {
            bail!("GPU {gpu} holds {other} and {size} vGPUs");
        }
    }
    none_refused(c)?;
    ensure!(sizes.len() == 2, "one GPU holds both sizes: {sizes:?}");
    eprintln!(
        "  dra-extended-resources: sizes created at once placed {sizes:?} (the first A10-4Q \
         earlier on {four_gpu})"
    );

    // Two of one name in one pod: one env var, the comma list KubeVirt parses. (One request of
    // two devices: the scheduler takes each device once per request, so here two GPUs' A10-4Q
    // devices.)
    c.kubectl(&["delete", "pods", "-n", TEST_NS, "--all", "--wait=true"])?;
    c.wait("the vGPUs removed", Duration::from_secs(60), || {
        Ok(mdevs(c)?.is_empty().then_some(()))
    })?;
    c.apply(&limits_pod(c, "vm-two", A10_4Q, 2))?;
    let (vars, vfio) = env_view(c, "vm-two")?;
    let uuids = var(
        &vars,
        "MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q",
        "vm-two",
    )?;
    ensure!(uuids.len() == 2, "vm-two's env names {uuids:?}");
    ensure!(vfio.len() == 3, "vm-two's /dev/vfio: {vfio:?}");
    kubevirt_gives(c, "vm-two", &vmi_gpus(&[A10_4Q, A10_4Q]), &uuids)?;
    c.kubectl(&["delete", "pods", "-n", TEST_NS, "--all", "--wait=true"])?;
    c.wait("the vGPUs removed", Duration::from_secs(60), || {
        Ok(mdevs(c)?.is_empty().then_some(()))
    })?;

    // draDriver.extendedResources=false: the classes go, and a pod asking by limits waits for
    // a node that advertises the name, as on a cluster without DRA.
    c.helm_install(
        &[
            "draDriver.enabled=true",
            "draDriver.vgpu=all",
            "draDriver.extendedResources=false",
        ],
        &["-f", &vf, "--wait", "--timeout", "3m"],
    )?;
    let classes = c.get_json(&["deviceclasses"])?;
    let named: Vec<&str> = classes["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d: &Value| d["spec"]["extendedResourceName"].as_str())
        .collect();
    ensure!(
        named.is_empty(),
        "draDriver.extendedResources=false: DeviceClasses still serve {named:?}"
    );
    c.apply(&limits_pod(c, "vm-off", A10_4Q, 1))?;
    let why = pending_reason(c, "vm-off")?;
    ensure!(
        why.contains(&format!("Insufficient {A10_4Q}")),
        "with draDriver.extendedResources=false vm-off waits for another reason: {why}"
    );
    Ok(())
}
