//! `node-sim demo`: two simulated GPU nodes, the real daemons run against them, and what an
//! operator would see on a real cluster.
//!
//! 1. A passthrough node (`nvidia.com/gpu.workload.config=vm-passthrough`): `vfio-manager bind`,
//!    then `sandbox-dp` registering with a test kubelet.
//! 2. A vGPU node (`vm-vgpu`, `nvidia.com/vgpu.config=<profile>`): `vgpu-device-manager apply`,
//!    then `sandbox-dp`.
//! 3. A node with vGPUs on demand (`vm-vgpu-on-demand`): `sandbox-dp --on-demand all`; an
//!    Allocate creates a vGPU, the pod's end removes it ([`dynamic::on_demand`]).
//! 4. A DRA node (`vm-dra`): `sandbox-dra --vgpu all` with a test API server; a claim for a
//!    whole GPU and one for a vGPU prepared as kubelet prepares them ([`dynamic::dra`]).
//!
//! For each: the node's Capacity/Allocatable as `kubectl describe node` shows them (or the
//! ResourceSlices), what a VM's virt-launcher receives (the Allocate answer's env; a claim's
//! CDI devices and device-metadata file), and the `permittedHostDevices` block for KubeVirt.
//! Everything lives in temporary directories that are unmounted and removed at the end, also
//! on Ctrl-C.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use fake_kubelet::{FakeKubelet, PluginClient};

use node_sim::{Sim, Topology};

mod dynamic;

/// What the demo needs from the command line.
#[derive(Debug, Clone)]
pub struct DemoArgs {
    /// The topology of both nodes.
    pub topology: String,
    /// The vGPU profile of the second node; `None`: `A10-4Q` on A10 nodes, else `default`.
    pub profile: Option<String>,
    /// Where the daemons' binaries are; `None`: beside this binary.
    pub bin_dir: Option<PathBuf>,
}

struct Bins {
    vfio: PathBuf,
    vgpu: PathBuf,
    dp: PathBuf,
    dra: PathBuf,
}

fn bins(dir: Option<&Path>) -> Result<Bins> {
    let dir = match dir {
        Some(d) => d.to_path_buf(),
        None => std::env::current_exe()
            .context("locating node-sim")?
            .parent()
            .ok_or_else(|| anyhow!("node-sim has no directory"))?
            .to_path_buf(),
    };
    let b = Bins {
        vfio: dir.join("vfio-manager"),
        vgpu: dir.join("vgpu-device-manager"),
        dp: dir.join("sandbox-dp"),
        dra: dir.join("sandbox-dra"),
    };
    for p in [&b.vfio, &b.vgpu, &b.dp, &b.dra] {
        if !p.is_file() {
            bail!(
                "{} is missing: build the daemons first (cargo build --release --bins)",
                p.display()
            );
        }
    }
    Ok(b)
}

/// A mounted node in its own temporary directory; dropping it unmounts and removes it.
struct Node {
    sim: Option<Sim>,
    _dir: tempfile::TempDir,
}

impl Node {
    fn mount(topo: &Topology) -> Result<Node> {
        let dir = tempfile::Builder::new()
            .prefix("gpu-vm-demo-")
            .tempdir()
            .context("creating a temporary directory")?;
        let sim = node_sim::mount(topo, dir.path())
            .with_context(|| format!("mounting a simulated {} node", topo.name))?;
        Ok(Node {
            sim: Some(sim),
            _dir: dir,
        })
    }

    fn root(&self) -> &Path {
        self.sim.as_ref().map_or(Path::new("/"), |s| s.root())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(sim) = self.sim.take() {
            let _ = sim.unmount();
        }
    }
}

async fn run_tool(bin: &Path, args: &[&str], root: &Path) -> Result<String> {
    let out = tokio::process::Command::new(bin)
        .args(args)
        .arg("--host-root")
        .arg(root)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let name = bin.file_name().and_then(|n| n.to_str()).unwrap_or("?");
    if !out.status.success() {
        bail!(
            "{name} {} failed ({}):\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What Allocate returned for one device of a resource.
struct Allocation {
    resource: String,
    envs: Vec<(String, String)>,
    specs: Vec<String>,
}

/// What kubelet learned from sandbox-dp on one node.
struct Advertised {
    /// resource → (capacity, allocatable)
    resources: BTreeMap<String, (usize, usize)>,
    /// The first resource's Allocate answer for one device.
    allocation: Option<Allocation>,
    permitted: String,
}

async fn advertise(b: &Bins, root: &Path) -> Result<Advertised> {
    let kdir = root.join("var/lib/kubelet/device-plugins");
    let mut kubelet = FakeKubelet::start(&kdir).await?;
    let mut dp = tokio::process::Command::new(&b.dp)
        .arg("--host-root")
        .arg(root)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting sandbox-dp")?;

    // Registrations arrive one per resource; take them until none comes for a moment.
    let mut regs = Vec::new();
    let first = kubelet
        .next_registration(Duration::from_secs(20))
        .await
        .context("sandbox-dp did not register with the kubelet")?;
    regs.push(first);
    while let Ok(r) = kubelet.next_registration(Duration::from_millis(700)).await {
        regs.push(r);
    }

    let mut resources = BTreeMap::new();
    let mut allocation = None;
    for reg in &regs {
        let mut client = PluginClient::connect(&kdir.join(&reg.endpoint)).await?;
        let mut lw = client.list_and_watch().await?;
        let devices = lw.next(Duration::from_secs(10)).await?;
        let healthy = devices.iter().filter(|d| d.health == "Healthy").count();
        resources.insert(reg.resource_name.clone(), (devices.len(), healthy));
        if allocation.is_none()
            && let Some(d) = devices.iter().find(|d| d.health == "Healthy")
        {
            let resp = client.allocate(&[&[d.id.as_str()]]).await?;
            if let Some(c) = resp.container_responses.into_iter().next() {
                let envs = c.envs.into_iter().collect();
                let specs = c
                    .devices
                    .into_iter()
                    .map(|s| format!("{} ({})", s.host_path, s.permissions))
                    .collect();
                allocation = Some(Allocation {
                    resource: reg.resource_name.clone(),
                    envs,
                    specs,
                });
            }
        }
    }
    let permitted = run_tool(&b.dp, &["permitted-devices"], root).await?;
    let _ = dp.start_kill();
    let _ = dp.wait().await;
    kubelet.stop().await;
    Ok(Advertised {
        resources,
        allocation,
        permitted,
    })
}

fn print_node(name: &str, labels: &[&str], a: &Advertised) {
    println!("Name:               {name}");
    println!(
        "Labels:             {}",
        labels.join("\n                    ")
    );
    println!("Capacity:");
    for (r, (cap, _)) in &a.resources {
        println!("  {r}:  {cap}");
    }
    println!("Allocatable:");
    for (r, (_, alloc)) in &a.resources {
        println!("  {r}:  {alloc}");
    }
    if let Some(al) = &a.allocation {
        println!();
        println!(
            "A VM asking for 1 {} gets, from Allocate (what virt-launcher reads):",
            al.resource
        );
        for (k, v) in &al.envs {
            println!("  env    {k}={v}");
        }
        for s in &al.specs {
            println!("  device {s}");
        }
    }
    println!();
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("  {l}\n"))
        .collect::<Vec<_>>()
        .concat()
}

async fn demo(args: DemoArgs) -> Result<()> {
    let started = Instant::now();
    let b = bins(args.bin_dir.as_deref())?;
    let topo = node_sim::topology(&args.topology)?;
    let profile = args.profile.clone().unwrap_or_else(|| {
        if topo
            .devices
            .iter()
            .any(|d| d.model.as_deref() == Some("A10"))
        {
            "A10-4Q".into()
        } else {
            "default".into()
        }
    });

    // Node 1: passthrough.
    println!("== gpu-node-1: {} for passthrough ==\n", topo.name);
    let node1 = Node::mount(&topo)?;
    let out = run_tool(&b.vfio, &["bind"], node1.root()).await?;
    println!("$ vfio-manager bind\n{}", indent(&out));
    let a1 = advertise(&b, node1.root()).await?;
    print_node(
        "gpu-node-1",
        &["nvidia.com/gpu.workload.config=vm-passthrough"],
        &a1,
    );

    // Node 2: vGPUs.
    println!(
        "== gpu-node-2: {} with vGPU profile {profile} ==\n",
        topo.name
    );
    let node2 = Node::mount(&topo)?;
    let cfg_dir = tempfile::tempdir().context("creating a temporary directory")?;
    let cfg = cfg_dir.path().join("config.yaml");
    std::fs::write(
        &cfg,
        node_sim::configmap::default_vgpu_config(node_sim::catalogue()),
    )
    .with_context(|| format!("writing {}", cfg.display()))?;
    let cfg_s = cfg.to_string_lossy().into_owned();
    let out = run_tool(
        &b.vgpu,
        &["apply", "-f", &cfg_s, "-c", &profile],
        node2.root(),
    )
    .await?;
    println!(
        "$ vgpu-device-manager apply -f <default vgpu-config> -c {profile}\n{}",
        indent(&out)
    );
    let a2 = advertise(&b, node2.root()).await?;
    let label = format!("nvidia.com/vgpu.config={profile}");
    print_node(
        "gpu-node-2",
        &["nvidia.com/gpu.workload.config=vm-vgpu", &label],
        &a2,
    );

    println!(
        "== KubeVirt: spec.configuration.permittedHostDevices (from `sandbox-dp permitted-devices`) ==\n"
    );
    println!("# gpu-node-1\n{}", a1.permitted);
    println!("# gpu-node-2\n{}", a2.permitted);
    drop(node1);
    drop(node2);

    dynamic::on_demand(&b, &topo).await?;
    dynamic::dra(&b, &topo).await?;
    println!(
        "Done in {:.1} s; the simulated nodes are unmounted and removed.",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs the demo; Ctrl-C or SIGTERM stops it, cleaning up.
pub fn run(args: DemoArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        tokio::select! {
            r = demo(args) => r,
            _ = tokio::signal::ctrl_c() => Err(Interrupted.into()),
            _ = term.recv() => Err(Interrupted.into()),
        }
    })
}

/// The demo was stopped by a signal; by then its nodes are unmounted and its daemons gone.
#[derive(Debug, thiserror::Error)]
#[error("interrupted; the simulated nodes were unmounted and removed")]
pub struct Interrupted;
