//! The demo's dynamic paths: vGPUs sandbox-dp creates when kubelet allocates them
//! (`--on-demand`), and ResourceClaims sandbox-dra prepares (a whole GPU, and a vGPU made at
//! prepare), each with what virt-launcher reads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use fake_kubelet::apiserver::FakeApiServer;
use fake_kubelet::dra::{self, Claim, PreparedDevice, Version};
use fake_kubelet::pod_resources::{ClaimDevice, pod, pod_with_claim};
use fake_kubelet::{FakeKubelet, FakePodResources, PluginClient};
use node_sim::Topology;
use serde_json::{Value, json};

use super::{Bins, Node, indent};

/// The pod and namespace the demo's VMs run as.
const NS: &str = "vms";
/// sandbox-dra's driver name (its default).
const DRIVER: &str = "gpu.gpu-vm-node.io";

fn mdevs(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root.join("sys/bus/mdev/devices"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// `NVIDIA A10-4Q on 0000:41:00.4` for an mdev.
fn describe_mdev(root: &Path, uuid: &str) -> String {
    let dir = root.join("sys/bus/mdev/devices").join(uuid);
    let name = std::fs::read_to_string(dir.join("mdev_type/name")).unwrap_or_default();
    let parent = std::fs::canonicalize(&dir)
        .ok()
        .and_then(|c| {
            c.parent()
                .and_then(|p| p.file_name())
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "?".into());
    format!("{} on {parent}", name.trim())
}

fn driver_of(root: &Path, bdf: &str) -> String {
    std::fs::read_link(root.join("sys/bus/pci/devices").join(bdf).join("driver"))
        .ok()
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "no driver".into())
}

async fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Result<Duration> {
    let start = Instant::now();
    while !f() {
        if start.elapsed() > limit {
            bail!("{what} did not happen within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(start.elapsed())
}

/// A third node, labelled `vm-vgpu-on-demand`: sandbox-dp `--on-demand all` advertises what the
/// GPUs could still host; one Allocate creates the vGPU, the other sizes' lists drop, and the
/// vGPU is removed once kubelet no longer runs the pod.
pub(super) async fn on_demand(b: &Bins, topo: &Topology) -> Result<()> {
    println!(
        "== gpu-node-3: {} with vGPUs on demand (sandbox-dp --on-demand all) ==\n",
        topo.name
    );
    let node = Node::mount(topo)?;
    let root = node.root();
    let kdir = root.join("var/lib/kubelet/device-plugins");
    let mut kubelet = FakeKubelet::start(&kdir).await?;
    let pods =
        FakePodResources::start(&root.join("var/lib/kubelet/pod-resources/kubelet.sock")).await?;
    let mut dp = tokio::process::Command::new(&b.dp)
        .arg("--host-root")
        .arg(root)
        .args(["--on-demand", "all"])
        // Only what went wrong reaches the demo's output.
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting sandbox-dp --on-demand all")?;

    let mut regs = vec![
        kubelet
            .next_registration(Duration::from_secs(20))
            .await
            .context("sandbox-dp --on-demand did not register with the kubelet")?,
    ];
    while let Ok(r) = kubelet.next_registration(Duration::from_millis(700)).await {
        regs.push(r);
    }
    // Each resource: its client, its ListAndWatch stream and the devices listed now.
    let mut lists = BTreeMap::new();
    for reg in &regs {
        let mut client = PluginClient::connect(&kdir.join(&reg.endpoint)).await?;
        let mut lw = client.list_and_watch().await?;
        let devices = lw.next(Duration::from_secs(10)).await?;
        lists.insert(reg.resource_name.clone(), (client, lw, devices));
    }
    println!("Name:               gpu-node-3");
    println!("Labels:             nvidia.com/gpu.workload.config=vm-vgpu-on-demand");
    println!("Allocatable (what could still be created; every size at once):");
    for (r, (_, _, devices)) in &lists {
        println!(
            "  {r}:  {}",
            devices.iter().filter(|d| d.health == "Healthy").count()
        );
    }

    // The size a VM asks for: a 4 GiB Q vGPU where the GPU has one, else the first listed.
    let resource = lists
        .keys()
        .find(|r| r.ends_with("-4Q"))
        .or_else(|| lists.keys().next())
        .cloned()
        .ok_or_else(|| anyhow!("sandbox-dp --on-demand advertised nothing"))?;
    let before: BTreeMap<String, usize> =
        lists.iter().map(|(r, l)| (r.clone(), l.2.len())).collect();
    let mdevs_before = mdevs(root);
    let (client, _, devices) = lists
        .get_mut(&resource)
        .ok_or_else(|| anyhow!("{resource} is gone"))?;
    let id = devices
        .iter()
        .find(|d| d.health == "Healthy")
        .map(|d| d.id.clone())
        .ok_or_else(|| anyhow!("{resource} lists no healthy device"))?;
    let resp = client.allocate(&[&[id.as_str()]]).await?;
    println!(
        "\nA VM asking for 1 {resource}: Allocate of device {id} creates its vGPU and answers"
    );
    println!("(what virt-launcher reads):");
    if let Some(c) = resp.container_responses.first() {
        for (k, v) in &c.envs {
            println!("  env    {k}={v}");
        }
        for s in &c.devices {
            println!("  device {} ({})", s.host_path, s.permissions);
        }
    }
    let created: Vec<String> = mdevs(root)
        .into_iter()
        .filter(|m| !mdevs_before.contains(m))
        .collect();
    for m in &created {
        println!(
            "  created /sys/bus/mdev/devices/{m} ({})",
            describe_mdev(root, m)
        );
    }

    // The other sizes follow within a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Shown: the sizes of the asked-for series (`…Q`), smallest first; the other series counted.
    let series = resource.chars().last();
    let size = |r: &str| -> u32 {
        r.rsplit('-')
            .next()
            .map(|s| s.trim_end_matches(|c: char| c.is_ascii_alphabetic()))
            .and_then(|n| n.parse().ok())
            .unwrap_or(u32::MAX)
    };
    let mut shown = Vec::new();
    let mut others = 0;
    for (r, (_, lw, devices)) in lists.iter_mut() {
        while let Ok(now) = lw.next(Duration::from_millis(50)).await {
            *devices = now;
        }
        if devices.len() != before[r] {
            if r.chars().last() == series {
                shown.push((size(r), format!("{r}: {} -> {}", before[r], devices.len())));
            } else {
                others += 1;
            }
        }
    }
    shown.sort();
    if !shown.is_empty() {
        println!("Listed now (that GPU hosts no other size while the vGPU exists):");
        for (_, c) in &shown {
            println!("  {c}");
        }
        if others > 0 {
            println!("  … and {others} sizes of the other series");
        }
    }

    // kubelet runs the pod, then the pod is deleted: the vGPU goes.
    pods.set_pods(vec![pod(
        NS,
        "virt-launcher-a",
        "compute",
        &resource,
        &[&id],
    )]);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    pods.set_pods(vec![]);
    if let Some(m) = created.first() {
        let gone = root.join("sys/bus/mdev/devices").join(m);
        let took = wait_until("the vGPU's removal", Duration::from_secs(15), || {
            !gone.exists()
        })
        .await?;
        println!(
            "The pod deleted (kubelet's PodResources no longer lists it): vGPU {m} removed after {:.1} s.",
            took.as_secs_f64()
        );
    }
    println!();
    let _ = dp.start_kill();
    let _ = dp.wait().await;
    kubelet.stop().await;
    Ok(())
}

/// The slice's devices (across the pool's slices): name → attributes.
fn devices(slices: &[Value]) -> BTreeMap<String, Value> {
    slices
        .iter()
        .filter_map(|s| s["spec"]["devices"].as_array())
        .flatten()
        .filter_map(|d| Some((d["name"].as_str()?.to_string(), d["attributes"].clone())))
        .collect()
}

fn attr<'a>(attrs: &'a Value, key: &str) -> Option<&'a str> {
    attrs[key]["string"].as_str()
}

/// Puts a claim allocated `device` (as the scheduler writes it) and prepares it as kubelet does.
async fn claim(
    api: &FakeApiServer,
    driver: &dra::DraDriver,
    node: &str,
    name: &str,
    uid: &str,
    class: &str,
    device: &str,
) -> Result<(Claim, Vec<PreparedDevice>)> {
    let mut result = json!({"request": "gpu", "driver": DRIVER, "pool": node, "device": device});
    if device.starts_with("vgpu-") {
        // A share of the type's shared device, as the scheduler allocates one.
        result["shareID"] = json!(format!("5a4e{}", uid.get(4..).unwrap_or_default()));
    }
    api.put_claim(json!({
        "metadata": {"namespace": NS, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": class}}
        ]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }));
    let c = Claim {
        namespace: NS.into(),
        name: name.into(),
        uid: uid.into(),
    };
    let mut out = driver
        .prepare(Version::V1, std::slice::from_ref(&c))
        .await?;
    let (_, result) = out
        .pop()
        .ok_or_else(|| anyhow!("no answer for claim {name}"))?;
    let prepared = result.map_err(|e| anyhow!("prepare of claim {name}: {e}"))?;
    Ok((c, prepared))
}

/// What the container gets for a prepared claim: its CDI spec's device nodes, and the metadata
/// file (where virt-launcher finds it, and its content).
fn show_prepared(root: &Path, uid: &str, prepared: &[PreparedDevice]) -> Result<()> {
    let spec_path = root.join(format!("var/run/cdi/{DRIVER}_{uid}.json"));
    let spec: Value = serde_json::from_str(
        &std::fs::read_to_string(&spec_path)
            .with_context(|| format!("reading {}", spec_path.display()))?,
    )
    .with_context(|| format!("parsing {}", spec_path.display()))?;
    for d in prepared {
        println!("  CDI devices: {}", d.cdi_device_ids.join(", "));
    }
    let mut metadata = None;
    for d in spec["devices"].as_array().into_iter().flatten() {
        for n in d["containerEdits"]["deviceNodes"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(p) = n["path"].as_str() {
                println!("  device {p}");
            }
        }
        for m in d["containerEdits"]["mounts"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let (Some(h), Some(c)) = (m["hostPath"].as_str(), m["containerPath"].as_str()) {
                metadata = Some((PathBuf::from(h), c.to_string()));
            }
        }
    }
    let (host, container) =
        metadata.ok_or_else(|| anyhow!("{} mounts no metadata file", spec_path.display()))?;
    let file = root.join(host.strip_prefix("/").unwrap_or(&host));
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    // A stream of DeviceMetadata objects, newest version first: the first is what KubeVirt reads.
    let first: Value = serde_json::Deserializer::from_str(&text)
        .into_iter::<Value>()
        .next()
        .ok_or_else(|| anyhow!("{} is empty", file.display()))??;
    println!("  virt-launcher reads {container}:");
    print!(
        "{}",
        indent(&indent(&serde_json::to_string_pretty(&first)?))
    );
    Ok(())
}

/// A fourth node, labelled `vm-dra`: sandbox-dra `--vgpu all` publishes the GPUs whole and as
/// vGPUs; a claim for a whole GPU and one for a vGPU are prepared the way kubelet prepares them,
/// and the GPU a prepared claim has is in use for the other daemons.
pub(super) async fn dra(b: &Bins, topo: &Topology) -> Result<()> {
    const NODE: &str = "gpu-node-4";
    println!(
        "== gpu-node-4: {} with the DRA driver (sandbox-dra --vgpu all) ==\n",
        topo.name
    );
    let node = Node::mount(topo)?;
    let root = node.root();
    let api = FakeApiServer::start(NODE, &[("nvidia.com/gpu.workload.config", "vm-dra")])?;
    let reg = root.join(format!(
        "var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock"
    ));
    let mut drv = tokio::process::Command::new(&b.dra)
        .arg("--host-root")
        .arg(root)
        .args(["--node-name", NODE, "--vgpu", "all", "--kubeconfig"])
        .arg(api.kubeconfig())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting sandbox-dra")?;
    wait_until(
        "sandbox-dra's registration socket",
        Duration::from_secs(20),
        || reg.exists(),
    )
    .await?;
    let driver = dra::register(
        root,
        Path::new(&format!(
            "/var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock"
        )),
        None,
    )
    .await?;
    let slices = tokio::task::block_in_place(|| {
        api.wait_for_slices(Duration::from_secs(20), |s| {
            s.iter().any(|s| s["spec"]["sharedCounters"].is_array())
                && s.iter()
                    .filter_map(|s| s["spec"]["pool"]["resourceSliceCount"].as_i64())
                    .all(|n| n as usize == s.len())
        })
    })
    .ok_or_else(|| anyhow!("sandbox-dra published no complete pool"))?;
    let devs = devices(&slices);
    let whole: Vec<&String> = devs
        .iter()
        .filter(|(_, a)| attr(a, "mode") == Some("passthrough"))
        .map(|(n, _)| n)
        .collect();
    let vgpus = devs.len() - whole.len();
    println!(
        "ResourceSlices of node {NODE}: {} ({} whole GPUs: {}; {vgpus} vGPU devices, one per GPU and type, shared by that type's vGPUs; each GPU's framebuffer and VFs as counters)",
        slices.len(),
        whole.len(),
        whole
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let gpu = whole
        .first()
        .map(|s| s.to_string())
        .ok_or_else(|| anyhow!("no whole GPU published"))?;
    let gpu_addr = attr(&devs[&gpu], "resource.kubernetes.io/pciBusID")
        .unwrap_or("?")
        .to_string();

    // A whole GPU.
    let (c1, p1) = claim(
        &api,
        &driver,
        NODE,
        "vm1-gpu",
        "5d1f0a3c-0000-4000-8000-000000000001",
        "vfio-gpu.gpu-vm-node.io",
        &gpu,
    )
    .await?;
    println!(
        "\nClaim {NS}/vm1-gpu, allocated {gpu} (as the scheduler writes it), prepared: {gpu_addr} and its group on {}",
        driver_of(root, &gpu_addr)
    );
    show_prepared(root, &c1.uid, &p1)?;

    // A vGPU of another GPU, made at prepare.
    let vgpu = devs
        .iter()
        .filter(|(_, a)| {
            attr(a, "mode") == Some("vgpu") && attr(a, "parentGPU") != Some(gpu_addr.as_str())
        })
        .map(|(n, _)| n)
        .find(|n| n.ends_with("-4q"))
        .or_else(|| {
            devs.iter()
                .filter(|(_, a)| {
                    attr(a, "mode") == Some("vgpu")
                        && attr(a, "parentGPU") != Some(gpu_addr.as_str())
                })
                .map(|(n, _)| n)
                .next()
        })
        .cloned();
    let mut listed = vec![pod_with_claim(
        NS,
        "virt-launcher-vm1",
        "compute",
        &c1.name,
        &claim_devices(&p1),
    )];
    if let Some(v) = vgpu {
        let before = mdevs(root);
        let (c2, p2) = claim(
            &api,
            &driver,
            NODE,
            "vm2-vgpu",
            "5d1f0a3c-0000-4000-8000-000000000002",
            "vgpu.gpu-vm-node.io",
            &v,
        )
        .await?;
        let made: Vec<String> = mdevs(root)
            .into_iter()
            .filter(|m| !before.contains(m))
            .collect();
        println!(
            "\nClaim {NS}/vm2-vgpu, allocated {v}, prepared: {}",
            made.iter()
                .map(|m| format!("vGPU {m} created ({})", describe_mdev(root, m)))
                .collect::<Vec<_>>()
                .join(", ")
        );
        show_prepared(root, &c2.uid, &p2)?;
        listed.push(pod_with_claim(
            NS,
            "virt-launcher-vm2",
            "compute",
            &c2.name,
            &claim_devices(&p2),
        ));
    }

    // While kubelet runs the pods, their GPUs are in use for every daemon.
    let pods =
        FakePodResources::start(&root.join("var/lib/kubelet/pod-resources/kubelet.sock")).await?;
    pods.set_pods(listed);
    let out = tokio::process::Command::new(&b.vfio)
        .arg("--host-root")
        .arg(root)
        .args(["unbind", "--address", &gpu_addr])
        .stdin(Stdio::null())
        .output()
        .await
        .context("running vfio-manager unbind")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let refused = format!("{gpu_addr} refused");
    let refusal = stderr
        .lines()
        .find_map(|l| l.find(&refused).map(|i| l[i..].trim().to_string()))
        .unwrap_or_else(|| stderr.trim().to_string());
    println!(
        "\nWhile kubelet runs the claim's pod, `vfio-manager unbind --address {gpu_addr}` (exit {}):",
        out.status.code().unwrap_or(-1)
    );
    println!("  {refusal}");
    println!();
    drop(pods);
    let _ = drv.start_kill();
    let _ = drv.wait().await;
    Ok(())
}

fn claim_devices(prepared: &[PreparedDevice]) -> Vec<ClaimDevice> {
    prepared
        .iter()
        .map(|d| ClaimDevice {
            driver: DRIVER.into(),
            pool: d.pool_name.clone(),
            device: d.device_name.clone(),
            cdi_devices: d.cdi_device_ids.clone(),
            share_id: d.share_id.clone(),
        })
        .collect()
}
