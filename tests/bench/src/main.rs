//! `gpu-vm-bench`: the three daemons measured as processes on node-sim, next to the floor (the
//! same sysfs writes replayed by a bare loop on a fresh copy of the same simulated node).
//!
//! Run it from a release build so the daemons are release builds too:
//!
//! ```sh
//! cargo build --release --workspace --bins && target/release/gpu-vm-bench --out BENCHMARKS.md
//! ```
//!
//! It needs root and /dev/fuse (node-sim). Every figure is the median of `--runs` runs with
//! min–max beside it; each run gets a freshly mounted node.

mod procstat;
mod stats;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use node_sim::{Op, Topology};
use stats::{Summary, fmt_duration, fmt_summary, summarize};
use testkit::kubelet::{FakeKubelet, PluginClient};
use testkit::sim::SimDir;

/// Benchmarks of vfio-manager, vgpu-device-manager and sandbox-dp on simulated nodes.
#[derive(Parser, Debug)]
#[command(name = "gpu-vm-bench")]
struct Cli {
    /// Runs per figure (the median is reported, with min and max).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Seconds sandbox-dp is left idle to measure its CPU use.
    #[arg(long, default_value_t = 60)]
    idle_secs: u64,
    /// Allocate calls per topology.
    #[arg(long, default_value_t = 1000)]
    allocations: usize,
    /// Simulated unbind delay (ms) for the parallel-bind figure.
    #[arg(long, default_value_t = 300)]
    unbind_delay_ms: u64,
    /// Also write the report to this file (BENCHMARKS.md).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Only these sections: vfio, vgpu, dp, curve (repeatable; default all).
    #[arg(long)]
    only: Vec<String>,
}

struct Bins {
    vfio: PathBuf,
    vgpu: PathBuf,
    dp: PathBuf,
}

fn bins() -> Result<Bins> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow!("{} has no directory", exe.display()))?;
    let b = Bins {
        vfio: dir.join("vfio-manager"),
        vgpu: dir.join("vgpu-device-manager"),
        dp: dir.join("sandbox-dp"),
    };
    for p in [&b.vfio, &b.vgpu, &b.dp] {
        if !p.exists() {
            bail!(
                "{} not found: build the daemons beside this binary first (cargo build --release --workspace --bins)",
                p.display()
            );
        }
    }
    Ok(b)
}

// ---------------------------------------------------------------------------------------------
// Topologies

/// `n` GPUs of a catalogue model, each behind its own root port, split over two NUMA nodes.
fn generated(model: &str, n: usize) -> Result<Topology> {
    let mut s = format!("name = \"{n}x{model}-gen\"\ndescription = \"generated for benchmarks\"\n");
    for i in 0..n {
        let bus = 0x10 + 2 * i;
        let numa = i * 2 / n;
        let _ = write!(
            s,
            "[[bridge]]\naddress = \"0000:{bus:02x}:01.0\"\nnuma = {numa}\n\n\
             [[device]]\naddress = \"0000:{:02x}:00.0\"\nmodel = \"{model}\"\nbridge = \"0000:{bus:02x}:01.0\"\n\n",
            bus + 1
        );
    }
    Topology::parse(&s, &format!("{n}x{model}-gen")).map_err(|e| anyhow!("generated topology: {e}"))
}

fn builtin(name: &str) -> Result<Topology> {
    node_sim::topology(name).map_err(|e| anyhow!("topology {name}: {e}"))
}

fn mount(t: &Topology) -> SimDir {
    testkit::sim::mount_topology(t)
}

fn gpu_count(t: &Topology) -> usize {
    t.devices
        .iter()
        .filter(|d| d.vendor == 0x10de && d.class >> 16 == 0x03)
        .count()
}

// ---------------------------------------------------------------------------------------------
// Processes

/// What one finished process cost.
struct Finished {
    wall: Duration,
    /// User + system CPU time of the process (and any children it waited for).
    cpu: Duration,
    code: i32,
    max_rss_kib: u64,
    stderr: String,
}

/// Runs a command to completion, sampling its peak RSS (`VmHWM`) until it exits.
///
/// Not `wait4`'s `ru_maxrss`: Linux carries the pre-exec high-water mark of the forked child
/// (this process's own, under vfork) across `execve`, which would report the bench's memory.
fn run(cmd: &mut Command) -> Result<Finished> {
    use std::io::Read as _;
    let cpu_before = children_cpu();
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let pid = child.id();
    let mut err = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = err.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    let mut max_rss_kib = 0;
    let status = loop {
        if let Some(s) = procstat::sample(pid) {
            max_rss_kib = max_rss_kib.max(s.hwm_kib);
        }
        if let Some(st) = child.try_wait()? {
            break st;
        }
        // Every 2 ms: VmHWM is a high-water mark, so a late sample still sees an earlier peak,
        // and the bench's own polling must not compete for the CPU with the process measured.
        std::thread::sleep(Duration::from_millis(2));
    };
    let wall = start.elapsed();
    let cpu = children_cpu().saturating_sub(cpu_before);
    let stderr = reader.join().unwrap_or_default();
    Ok(Finished {
        wall,
        cpu,
        code: status.code().unwrap_or(-1),
        max_rss_kib,
        stderr,
    })
}

/// CPU time of this process's reaped children so far: across one [`run`], the process run (the
/// only child reaped meanwhile). Unlike `ru_maxrss`, CPU times start at zero in a new child.
fn children_cpu() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let Ok(u) = getrusage(UsageWho::RUSAGE_CHILDREN) else {
        return Duration::ZERO;
    };
    let t = |tv: nix::sys::time::TimeVal| {
        Duration::from_secs(tv.tv_sec().max(0) as u64)
            + Duration::from_micros(tv.tv_usec().max(0) as u64)
    };
    t(u.user_time()) + t(u.system_time())
}

fn ok(f: Finished, what: &str) -> Result<Finished> {
    if f.code != 0 {
        bail!("{what} exited {}: {}", f.code, f.stderr.trim());
    }
    Ok(f)
}

/// Replays the successful writes of an op log on another node, sequentially: the floor.
fn replay(root: &Path, ops: &[Op]) -> Result<Duration> {
    let start = Instant::now();
    for op in ops.iter().filter(|o| o.is_ok()) {
        let value = if op.value.is_empty() {
            "\n"
        } else {
            op.value.as_str()
        };
        let p = root.join(&op.path);
        let mut f = OpenOptions::new()
            .write(true)
            .open(&p)
            .with_context(|| format!("replay: opening {}", p.display()))?;
        f.write_all(value.as_bytes())
            .with_context(|| format!("replay: writing {value:?} to {}", p.display()))?;
    }
    Ok(start.elapsed())
}

fn writes(ops: &[Op]) -> Vec<Op> {
    ops.iter().filter(|o| o.is_ok()).cloned().collect()
}

// ---------------------------------------------------------------------------------------------
// Report

#[derive(Default)]
struct Report {
    text: String,
}

impl Report {
    fn line(&mut self, s: impl AsRef<str>) {
        println!("{}", s.as_ref());
        self.text.push_str(s.as_ref());
        self.text.push('\n');
    }

    fn table(&mut self, header: &[&str]) {
        self.line(format!("| {} |", header.join(" | ")));
        self.line(format!(
            "|{}|",
            header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
        ));
    }

    fn row(&mut self, cells: &[String]) {
        self.line(format!("| {} |", cells.join(" | ")));
    }
}

fn ratio(a: Duration, b: Duration) -> String {
    if b.is_zero() {
        return "–".into();
    }
    format!("{:.2}×", a.as_secs_f64() / b.as_secs_f64())
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn need(s: Option<Summary>) -> Result<Summary> {
    s.ok_or_else(|| anyhow!("no samples"))
}

// ---------------------------------------------------------------------------------------------
// vfio-manager

fn bench_vfio(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    r.line("## vfio-manager");
    r.line("");
    r.line("`bind` of every GPU (and its group companions) from nvidia to vfio-pci, on a fresh node each run. Floor: the same writes replayed sequentially by a bare loop on a fresh node.");
    r.line("");
    r.table(&[
        "topology",
        "GPUs",
        "writes",
        "bind",
        "no-op bind",
        "floor",
        "bind / floor",
        "peak RSS",
    ]);
    let topos = [builtin("2xA10")?, builtin("8xA100")?, generated("A10", 16)?];
    for t in &topos {
        let (mut walls, mut noops, mut floors, mut rss, mut nwrites) =
            (vec![], vec![], vec![], 0, 0);
        for _ in 0..cli.runs {
            let sim = mount(t);
            let f = ok(
                run(Command::new(&b.vfio)
                    .args(["bind", "--host-root"])
                    .arg(sim.root()))?,
                "vfio-manager bind",
            )?;
            walls.push(f.wall);
            rss = rss.max(f.max_rss_kib);
            let ops = writes(&sim.ops());
            nwrites = ops.len();
            let f = ok(
                run(Command::new(&b.vfio)
                    .args(["bind", "--host-root"])
                    .arg(sim.root()))?,
                "vfio-manager bind (no-op)",
            )?;
            noops.push(f.wall);
            let fresh = mount(t);
            floors.push(replay(fresh.root(), &ops)?);
        }
        let (w, n, fl) = (
            need(summarize(&walls))?,
            need(summarize(&noops))?,
            need(summarize(&floors))?,
        );
        r.row(&[
            t.name.clone(),
            gpu_count(t).to_string(),
            nwrites.to_string(),
            fmt_summary(&w),
            fmt_summary(&n),
            fmt_summary(&fl),
            ratio(w.median, fl.median),
            mib(rss),
        ]);
    }
    r.line("");

    // Parallelism: every unbind takes `delay` ms.
    let delay = cli.unbind_delay_ms;
    r.line(format!("Parallel bind: every nvidia unbind delayed {delay} ms (`fault unbind * delay={delay}`). Goal: all GPUs ≤ 1.2× one GPU."));
    r.line("");
    r.table(&[
        "topology",
        "GPUs",
        "one GPU",
        "all GPUs",
        "sequential sum (N × one)",
        "all / one",
    ]);
    for t in [builtin("8xA100")?, generated("A10", 16)?] {
        let first = t
            .devices
            .iter()
            .find(|d| d.vendor == 0x10de && d.class >> 16 == 0x03)
            .ok_or_else(|| anyhow!("{}: no GPU", t.name))?
            .address
            .clone();
        let (mut ones, mut alls) = (vec![], vec![]);
        for _ in 0..cli.runs.min(3) {
            let sim = mount(&t);
            sim.control(&format!("fault unbind * delay={delay}"))?;
            let f = ok(
                run(Command::new(&b.vfio)
                    .args(["bind", "--address", &first, "--host-root"])
                    .arg(sim.root()))?,
                "bind one",
            )?;
            ones.push(f.wall);
            let sim = mount(&t);
            sim.control(&format!("fault unbind * delay={delay}"))?;
            let f = ok(
                run(Command::new(&b.vfio)
                    .args(["bind", "--host-root"])
                    .arg(sim.root()))?,
                "bind all",
            )?;
            alls.push(f.wall);
        }
        let (o, a) = (need(summarize(&ones))?, need(summarize(&alls))?);
        let n = gpu_count(&t);
        r.row(&[
            t.name.clone(),
            n.to_string(),
            fmt_summary(&o),
            fmt_summary(&a),
            fmt_duration(o.median * n as u32),
            ratio(a.median, o.median),
        ]);
    }
    r.line("");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// vgpu-device-manager

const VGPU_CONFIG: &str = r#"version: v1
vgpu-configs:
  A10-4Q:
    - devices: all
      vgpu-devices: {"A10-4Q": 6}
  A10-8Q:
    - devices: all
      vgpu-devices: {"A10-8Q": 3}
  A100DX-4C:
    - devices: all
      vgpu-devices: {"A100DX-4C": 20}
  A100DX-8C:
    - devices: all
      vgpu-devices: {"A100DX-8C": 10}
  L40S-1Q:
    - devices: all
      vgpu-devices: {"L40S-1Q": 32}
  L40S-2Q:
    - devices: all
      vgpu-devices: {"L40S-2Q": 24}
  L40S-3Q:
    - devices: all
      vgpu-devices: {"L40S-3Q": 16}
  L40S-6Q:
    - devices: all
      vgpu-devices: {"L40S-6Q": 8}
  L40S-12Q:
    - devices: all
      vgpu-devices: {"L40S-12Q": 4}
  L40S-48Q:
    - devices: all
      vgpu-devices: {"L40S-48Q": 1}
"#;

fn vgpu(b: &Bins, root: &Path, cfg: &Path, sub: &str, profile: &str) -> Result<Finished> {
    run(Command::new(&b.vgpu)
        .arg(sub)
        .arg("-f")
        .arg(cfg)
        .args(["-c", profile, "--host-root"])
        .arg(root))
}

fn bench_vgpu(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("vgpu-config.yaml");
    std::fs::write(&cfg, VGPU_CONFIG)?;
    r.line("## vgpu-device-manager");
    r.line("");
    r.line("`apply` from an empty node (VFs enabled by the run where needed), `apply` again (no-op), `assert` on the configured node, and a switch to another profile. Floor: the apply's successful writes replayed by a bare loop on a fresh node. Goals: assert ≤ 10 ms, peak RSS ≤ 8 MB, apply ≤ 1.2× floor.");
    r.line("");
    r.table(&[
        "topology → profile",
        "vGPUs",
        "writes",
        "apply",
        "floor",
        "apply / floor",
        "no-op apply",
        "assert",
        "switch → profile",
        "peak RSS",
    ]);
    let cases = [
        (builtin("2xA10")?, "A10-4Q", "A10-8Q"),
        (builtin("8xA100")?, "A100DX-4C", "A100DX-8C"),
        (generated("L40S", 16)?, "L40S-1Q", "L40S-2Q"),
    ];
    for (t, p1, p2) in &cases {
        let (mut applies, mut floors, mut noops, mut asserts, mut switches) =
            (vec![], vec![], vec![], vec![], vec![]);
        let (mut rss, mut nwrites, mut vgpus) = (0, 0, 0);
        for _ in 0..cli.runs {
            let sim = mount(t);
            let f = ok(vgpu(b, sim.root(), &cfg, "apply", p1)?, "apply")?;
            applies.push(f.wall);
            rss = rss.max(f.max_rss_kib);
            let ops = writes(&sim.ops());
            nwrites = ops.len();
            let inv = common::Inventory::read_with(
                &common::HostPaths::new(sim.root()),
                &common::ReadOptions {
                    mdev_types: false,
                    vf_identity: true,
                },
            )?;
            vgpus = inv.mdevs.len()
                + inv
                    .devices
                    .values()
                    .filter(|d| d.nvidia_vgpu.as_ref().is_some_and(|v| v.current != 0))
                    .count();
            let fresh = mount(t);
            floors.push(replay(fresh.root(), &ops)?);
            sim.clear_ops();
            let f = ok(vgpu(b, sim.root(), &cfg, "apply", p1)?, "no-op apply")?;
            noops.push(f.wall);
            rss = rss.max(f.max_rss_kib);
            if !writes(&sim.ops()).is_empty() {
                bail!("{}: the no-op apply wrote to sysfs", t.name);
            }
            let f = ok(vgpu(b, sim.root(), &cfg, "assert", p1)?, "assert")?;
            asserts.push(f.wall);
            rss = rss.max(f.max_rss_kib);
            let f = ok(vgpu(b, sim.root(), &cfg, "apply", p2)?, "switch")?;
            switches.push(f.wall);
            rss = rss.max(f.max_rss_kib);
        }
        let a = need(summarize(&applies))?;
        let fl = need(summarize(&floors))?;
        r.row(&[
            format!("{} → {p1}", t.name),
            vgpus.to_string(),
            nwrites.to_string(),
            fmt_summary(&a),
            fmt_summary(&fl),
            ratio(a.median, fl.median),
            fmt_summary(&need(summarize(&noops))?),
            fmt_summary(&need(summarize(&asserts))?),
            format!("{} → {p2}", fmt_summary(&need(summarize(&switches))?)),
            mib(rss),
        ]);
    }
    r.line("");
    bench_vgpu_daemon(cli, b, &cfg, r)?;
    Ok(())
}

/// The daemon: node label changed through the fake API server → `nvidia.com/vgpu.config.state`
/// back at `success`.
fn bench_vgpu_daemon(cli: &Cli, b: &Bins, cfg: &Path, r: &mut Report) -> Result<()> {
    const STATE: &str = "nvidia.com/vgpu.config.state";
    let t = builtin("2xA10")?;
    let sim = mount(&t);
    let api = testkit::apiserver::FakeApiServer::start(
        "bench-node",
        &[("nvidia.com/vgpu.config", "A10-4Q")],
    )?;
    let mut d = Command::new(&b.vgpu)
        .args(["daemon", "--node-name", "bench-node", "--kubeconfig"])
        .arg(api.kubeconfig())
        .arg("-f")
        .arg(cfg)
        .arg("--host-root")
        .arg(sim.root())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting vgpu-device-manager daemon")?;
    let result = (|| -> Result<(Vec<Duration>, u64)> {
        if !api.wait_for(STATE, Duration::from_secs(60), |v| v == Some("success")) {
            bail!("the daemon never reported success for A10-4Q");
        }
        let mut times = Vec::new();
        for i in 0..cli.runs.max(2) * 2 {
            let profile = if i % 2 == 0 { "A10-8Q" } else { "A10-4Q" };
            api.clear_history();
            let start = Instant::now();
            api.set_label("nvidia.com/vgpu.config", Some(profile));
            while api.label_history(STATE).last() != Some(&Some("success".into())) {
                if start.elapsed() > Duration::from_secs(60) {
                    bail!("no success after relabelling to {profile}");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            times.push(start.elapsed());
        }
        let hwm = procstat::sample(d.id()).map(|s| s.hwm_kib).unwrap_or(0);
        Ok((times, hwm))
    })();
    let _ = d.kill();
    let _ = d.wait();
    let (times, hwm) = result?;
    let s = need(summarize(&times))?;
    r.line("Daemon: node label `nvidia.com/vgpu.config` switched A10-4Q ⇄ A10-8Q on 2xA10 through the fake API server, until `nvidia.com/vgpu.config.state` is `success` again (includes the apply itself). Goal: ≤ 50 ms.");
    r.line("");
    r.table(&["label change → success", "daemon peak RSS"]);
    r.row(&[fmt_summary(&s), mib(hwm)]);
    r.line("");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// sandbox-dp

/// Prepares a node for sandbox-dp (binds GPUs, creates vGPUs).
type Prepare = Box<dyn Fn(&Bins, &Path, &Path) -> Result<()>>;

struct DpCase {
    topo: Topology,
    label: String,
    /// Prepares the node (binds GPUs, creates vGPUs).
    prepare: Prepare,
}

fn prep_passthrough(b: &Bins, root: &Path, _cfg: &Path) -> Result<()> {
    ok(
        run(Command::new(&b.vfio)
            .args(["bind", "--host-root"])
            .arg(root))?,
        "vfio-manager bind",
    )?;
    Ok(())
}

fn prep_a10_4q(b: &Bins, root: &Path, cfg: &Path) -> Result<()> {
    ok(vgpu(b, root, cfg, "apply", "A10-4Q")?, "apply A10-4Q")?;
    Ok(())
}

fn prep_l40s_1q(b: &Bins, root: &Path, cfg: &Path) -> Result<()> {
    ok(vgpu(b, root, cfg, "apply", "L40S-1Q")?, "apply L40S-1Q")?;
    Ok(())
}

#[derive(serde::Deserialize)]
struct DpList {
    resources: Vec<DpResource>,
}

#[derive(serde::Deserialize)]
struct DpResource {
    name: String,
    socket: String,
    devices: Vec<DpDevice>,
}

#[derive(serde::Deserialize)]
struct DpDevice {
    id: String,
}

fn dp_list(b: &Bins, root: &Path) -> Result<DpList> {
    let out = Command::new(&b.dp)
        .args(["list", "--json", "--host-root"])
        .arg(root)
        .output()
        .context("sandbox-dp list")?;
    if !out.status.success() {
        bail!("sandbox-dp list: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).context("parsing sandbox-dp list --json")
}

struct DpRun {
    register: Duration,
    /// CPU time sandbox-dp used until every resource was registered.
    register_cpu: Duration,
    first_list: Duration,
    alloc: Vec<Duration>,
    change_remove: Option<Duration>,
    change_restore: Option<Duration>,
    /// kubelet restarted (its plugin directory cleared) → every resource registered again.
    reregister: Duration,
    rss_kib: u64,
    threads: u64,
    idle_cpu: Option<f64>,
}

async fn dp_once(
    b: &Bins,
    case: &DpCase,
    cfg: &Path,
    allocations: usize,
    idle: Option<u64>,
) -> Result<DpRun> {
    let sim = mount(&case.topo);
    (case.prepare)(b, sim.root(), cfg)?;
    let list = dp_list(b, sim.root())?;
    let expected: BTreeSet<String> = list.resources.iter().map(|r| r.name.clone()).collect();
    if expected.is_empty() {
        bail!("{}: nothing to advertise", case.label);
    }
    let kdir = sim.root().join("var/lib/kubelet/device-plugins");
    let mut kubelet = FakeKubelet::start(&kdir).await?;
    let start = Instant::now();
    let mut child = tokio::process::Command::new(&b.dp)
        .args(["--host-root"])
        .arg(sim.root())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting sandbox-dp")?;
    let pid = child
        .id()
        .ok_or_else(|| anyhow!("sandbox-dp exited at once"))?;
    let mut seen = BTreeSet::new();
    while seen != expected {
        let reg = kubelet.next_registration(Duration::from_secs(30)).await?;
        seen.insert(reg.resource_name);
    }
    let register = start.elapsed();
    let register_cpu = procstat::sample(pid)
        .map(|s| Duration::from_secs_f64(s.cpu_seconds))
        .unwrap_or_default();

    // The biggest resource: first list, allocations, change.
    let res = list
        .resources
        .iter()
        .max_by_key(|r| r.devices.len())
        .ok_or_else(|| anyhow!("no resource"))?;
    let sock = kdir.join(&res.socket);
    let t = Instant::now();
    let mut client = PluginClient::connect(&sock).await?;
    let mut lw = client.list_and_watch().await?;
    let first = lw.next(Duration::from_secs(10)).await?;
    let first_list = t.elapsed();
    if first.len() != res.devices.len() {
        bail!(
            "{}: first list has {} devices, expected {}",
            case.label,
            first.len(),
            res.devices.len()
        );
    }
    let mut alloc = Vec::with_capacity(allocations);
    for i in 0..allocations {
        let id = res.devices[i % res.devices.len()].id.as_str();
        let t = Instant::now();
        client.allocate(&[&[id]]).await?;
        alloc.push(t.elapsed());
    }

    // Idle footprint, after a moment to settle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s0 = procstat::sample(pid).ok_or_else(|| anyhow!("sandbox-dp died"))?;
    let idle_cpu = match idle {
        Some(secs) => {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            let s1 = procstat::sample(pid).ok_or_else(|| anyhow!("sandbox-dp died"))?;
            Some(s1.cpu_seconds - s0.cpu_seconds)
        }
        None => None,
    };

    // Change → update: remove one device and restore it.
    let n = first.len();
    let (change_remove, change_restore) = if let Ok(uuid) = res.devices[0].id.parse::<String>()
        && !uuid.contains(':')
    {
        // An mdev: remove it (no restore: a new one would be another device).
        let t = Instant::now();
        std::fs::write(
            sim.root()
                .join(format!("sys/bus/mdev/devices/{uuid}/remove")),
            "1",
        )?;
        lw.wait_until(Duration::from_secs(10), |l| l.len() == n - 1)
            .await?;
        (Some(t.elapsed()), None)
    } else {
        // A PCI function on vfio-pci: unbind it (its /dev/vfio node goes), then bind it back.
        let id = &res.devices[0].id;
        let dev = sim.root().join(format!("sys/bus/pci/devices/{id}"));
        let healthy = |l: &[testkit::kubelet::api::Device]| {
            l.iter().filter(|d| d.health == "Healthy").count()
        };
        let vgpu_type = dev.join("nvidia/current_vgpu_type");
        if let Ok(t) = std::fs::read_to_string(&vgpu_type) {
            // An SR-IOV vGPU VF: unbinding it would destroy its vGPU; remove the vGPU (type 0)
            // and set it again instead.
            let t = t.trim().to_string();
            let start = Instant::now();
            std::fs::write(&vgpu_type, "0")?;
            lw.wait_until(Duration::from_secs(10), |l| {
                healthy(l) == n - 1 || l.len() == n - 1
            })
            .await?;
            let removed = start.elapsed();
            let start = Instant::now();
            std::fs::write(&vgpu_type, &t)?;
            lw.wait_until(Duration::from_secs(10), |l| healthy(l) == n)
                .await?;
            let restored = start.elapsed();
            let reregister = reregistration(&mut kubelet, &expected).await?;
            let _ = child.start_kill();
            let _ = child.wait().await;
            kubelet.stop().await;
            return Ok(DpRun {
                register,
                register_cpu,
                first_list,
                alloc,
                change_remove: Some(removed),
                change_restore: Some(restored),
                reregister,
                rss_kib: s0.rss_kib,
                threads: s0.threads,
                idle_cpu,
            });
        }
        let driver = std::fs::read_link(dev.join("driver"))?;
        let driver = driver
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("vfio-pci")
            .to_string();
        let t = Instant::now();
        std::fs::write(
            sim.root()
                .join(format!("sys/bus/pci/drivers/{driver}/unbind")),
            id,
        )?;
        let healthy = |l: &[testkit::kubelet::api::Device]| {
            l.iter().filter(|d| d.health == "Healthy").count()
        };
        lw.wait_until(Duration::from_secs(10), |l| healthy(l) == n - 1)
            .await?;
        let removed = t.elapsed();
        let t = Instant::now();
        std::fs::write(sim.root().join("sys/bus/pci/drivers_probe"), id)?;
        lw.wait_until(Duration::from_secs(10), |l| healthy(l) == n)
            .await?;
        (Some(removed), Some(t.elapsed()))
    };
    let reregister = reregistration(&mut kubelet, &expected).await?;
    let _ = child.start_kill();
    let _ = child.wait().await;
    kubelet.stop().await;
    Ok(DpRun {
        register,
        register_cpu,
        first_list,
        alloc,
        change_remove,
        change_restore,
        reregister,
        rss_kib: s0.rss_kib,
        threads: s0.threads,
        idle_cpu,
    })
}

/// Restarts the fake kubelet as kubelet does (the plugin directory cleared, a new
/// `kubelet.sock`) and times until every resource is registered again.
async fn reregistration(
    kubelet: &mut FakeKubelet,
    expected: &BTreeSet<String>,
) -> Result<Duration> {
    kubelet.drain();
    kubelet.restart_clearing_dir().await?;
    let start = Instant::now();
    let names: Vec<&str> = expected.iter().map(String::as_str).collect();
    kubelet.wait_for(&names, Duration::from_secs(30)).await?;
    Ok(start.elapsed())
}

async fn bench_dp(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("vgpu-config.yaml");
    std::fs::write(&cfg, VGPU_CONFIG)?;
    let cases = [
        DpCase {
            topo: builtin("2xA10")?,
            label: "2xA10 passthrough".into(),
            prepare: Box::new(prep_passthrough),
        },
        DpCase {
            topo: builtin("8xA100")?,
            label: "8xA100 passthrough".into(),
            prepare: Box::new(prep_passthrough),
        },
        DpCase {
            topo: generated("A10", 16)?,
            label: "16xA10 passthrough".into(),
            prepare: Box::new(prep_passthrough),
        },
        DpCase {
            topo: builtin("2xA10")?,
            label: "2xA10 A10-4Q (12 mdevs)".into(),
            prepare: Box::new(prep_a10_4q),
        },
        DpCase {
            topo: generated("L40S", 16)?,
            label: "16xL40S L40S-1Q (512 VF vGPUs)".into(),
            prepare: Box::new(prep_l40s_1q),
        },
    ];
    r.line("## sandbox-dp");
    r.line("");
    r.line(format!("From process start to the fake kubelet holding every resource's registration; the first ListAndWatch answer; Allocate of one device ({} calls per run: p50 and p99 over all runs); a device removed (driver unbound or mdev removed) → ListAndWatch update, and restored → update; kubelet restarted (plugin directory cleared, new `kubelet.sock`) → every resource registered again; RSS and threads at idle. Goals: register ≤ 5 ms for 8 GPUs, Allocate p99 ≤ 0.2 ms, change → update ≤ 10 ms, RSS ≤ 5 MB, idle CPU ≈ 0.", cli.allocations));
    r.line("");
    r.table(&[
        "node",
        "register",
        "first list",
        "Allocate p50",
        "Allocate p99",
        "removed → update",
        "restored → update",
        "kubelet restart → registered",
        "RSS",
        "threads",
    ]);
    let mut idle_line = None;
    for (i, case) in cases.iter().enumerate() {
        let mut runs = Vec::new();
        let mut failed = None;
        for k in 0..cli.runs {
            // The idle minute is measured once, on the first node's last run.
            let idle = (i == 0 && k + 1 == cli.runs).then_some(cli.idle_secs);
            match dp_once(b, case, &cfg, cli.allocations, idle).await {
                Ok(x) => runs.push(x),
                Err(e) => {
                    let mut why = format!("{e:#}").replace('|', "/").replace('\n', " ");
                    why.truncate(300);
                    failed = Some(why);
                    break;
                }
            }
        }
        if let Some(why) = failed {
            eprintln!("{}: {why}", case.label);
            r.row(&[case.label.clone(), format!("failed: {why}")]);
            continue;
        }
        let reg = need(summarize(
            &runs.iter().map(|x| x.register).collect::<Vec<_>>(),
        ))?;
        let fl = need(summarize(
            &runs.iter().map(|x| x.first_list).collect::<Vec<_>>(),
        ))?;
        let all_alloc: Vec<Duration> = runs.iter().flat_map(|x| x.alloc.iter().copied()).collect();
        let al = need(summarize(&all_alloc))?;
        let rem: Vec<Duration> = runs.iter().filter_map(|x| x.change_remove).collect();
        let res: Vec<Duration> = runs.iter().filter_map(|x| x.change_restore).collect();
        let rss = runs.iter().map(|x| x.rss_kib).max().unwrap_or(0);
        let threads = runs.iter().map(|x| x.threads).max().unwrap_or(0);
        if let Some(cpu) = runs.iter().find_map(|x| x.idle_cpu) {
            idle_line = Some(format!(
                "Idle CPU ({}): {cpu:.3} CPU-seconds over {} s.",
                case.label, cli.idle_secs
            ));
        }
        r.row(&[
            case.label.clone(),
            fmt_summary(&reg),
            fmt_summary(&fl),
            fmt_duration(al.median),
            fmt_duration(al.p99),
            summarize(&rem)
                .map(|s| fmt_summary(&s))
                .unwrap_or_else(|| "–".into()),
            summarize(&res)
                .map(|s| fmt_summary(&s))
                .unwrap_or_else(|| "–".into()),
            fmt_summary(&need(summarize(
                &runs.iter().map(|x| x.reregister).collect::<Vec<_>>(),
            ))?),
            mib(rss),
            threads.to_string(),
        ]);
    }
    r.line("");
    if let Some(l) = idle_line {
        r.line(l);
        r.line("");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Cost curve

/// One point of a curve: the medians of each figure at one size.
struct Point {
    n: usize,
    medians: Vec<Duration>,
}

/// `ln(b/a) / ln(n_b/n_a)`: 1 is linear, above 1 grows faster than the node.
fn exponent(a: Duration, b: Duration, na: usize, nb: usize) -> String {
    if a.is_zero() || b.is_zero() || na == nb {
        return "–".into();
    }
    format!(
        "{:.2}",
        (b.as_secs_f64() / a.as_secs_f64()).ln() / (nb as f64 / na as f64).ln()
    )
}

/// The table of a curve: each size's medians, then the marginal cost per unit of each step
/// and the growth exponent of the last doubling.
fn curve_table(r: &mut Report, unit: &str, names: &[&str], points: &[Point]) {
    let mut header = vec![unit];
    header.extend_from_slice(names);
    r.table(&header);
    for p in points {
        let mut row = vec![p.n.to_string()];
        row.extend(p.medians.iter().map(|d| fmt_duration(*d)));
        r.row(&row);
    }
    r.line("");
    r.line(format!(
        "Marginal cost per {} at each step ((t(n) − t(m)) / (n − m)), and the growth exponent of the last doubling (ln(t₂/t₁) / ln 2: 1 is linear, above 1 grows faster than the node):",
        unit.trim_end_matches('s')
    ));
    r.line("");
    r.table(&header);
    for w in points.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let mut row = vec![format!("{} → {}", a.n, b.n)];
        row.extend(a.medians.iter().zip(&b.medians).map(|(x, y)| {
            let per = (y.as_secs_f64() - x.as_secs_f64()) / (b.n - a.n) as f64;
            if per < 0.0 {
                format!("−{}", fmt_duration(Duration::from_secs_f64(-per)))
            } else {
                fmt_duration(Duration::from_secs_f64(per))
            }
        }));
        r.row(&row);
    }
    if let [.., a, b] = points {
        let mut row = vec![format!("exponent {} → {}", a.n, b.n)];
        row.extend(
            a.medians
                .iter()
                .zip(&b.medians)
                .map(|(x, y)| exponent(*x, *y, a.n, b.n)),
        );
        r.row(&row);
    }
    r.line("");
}

fn medians(samples: &[Vec<Duration>]) -> Result<Vec<Duration>> {
    samples
        .iter()
        .map(|v| need(summarize(v)).map(|s| s.median))
        .collect()
}

/// How each figure grows with the node: A10 nodes of 1 to 16 GPUs, and four L40S with 1 to 32
/// vGPUs each.
async fn bench_curve(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("vgpu-config.yaml");
    std::fs::write(&cfg, VGPU_CONFIG)?;
    let allocations = cli.allocations.min(100);
    r.line("## Cost curve");
    r.line("");
    r.line("Medians of each figure as the node grows. GPUs: generated nodes of n A10s: vfio-manager `bind` of all, sandbox-dp start → registered and removed → update (passthrough), vgpu-device-manager `apply` A10-4Q from empty (6 vGPUs per GPU) and `assert`. vGPUs: four L40S (vendor path, 128 VFs) with 1, 4, 8, 16 or 32 vGPUs each (L40S-48Q … L40S-1Q): `apply` from empty, `assert`, sandbox-dp start → registered and removed → update. \"its CPU\": the daemon's own user + system CPU time, which excludes the time node-sim's server takes to answer; wall time on node-sim also grows with node-sim's own costs.");
    r.line("");
    let mut points = Vec::new();
    for n in [1, 2, 4, 8, 16] {
        let t = generated("A10", n)?;
        let mut s: Vec<Vec<Duration>> = vec![Vec::new(); 9];
        for _ in 0..cli.runs {
            let sim = mount(&t);
            let f = ok(
                run(Command::new(&b.vfio)
                    .args(["bind", "--host-root"])
                    .arg(sim.root()))?,
                "vfio-manager bind",
            )?;
            s[0].push(f.wall);
            s[1].push(f.cpu);
            let case = DpCase {
                topo: t.clone(),
                label: format!("{n}xA10 passthrough"),
                prepare: Box::new(prep_passthrough),
            };
            let d = dp_once(b, &case, &cfg, allocations, None).await?;
            s[2].push(d.register);
            s[3].push(d.register_cpu);
            s[4].push(d.change_remove.ok_or_else(|| anyhow!("no change figure"))?);
            let sim = mount(&t);
            let f = ok(vgpu(b, sim.root(), &cfg, "apply", "A10-4Q")?, "apply")?;
            s[5].push(f.wall);
            s[6].push(f.cpu);
            let f = ok(vgpu(b, sim.root(), &cfg, "assert", "A10-4Q")?, "assert")?;
            s[7].push(f.wall);
            s[8].push(f.cpu);
        }
        points.push(Point {
            n,
            medians: medians(&s)?,
        });
    }
    curve_table(
        r,
        "GPUs",
        &[
            "vfio bind",
            "its CPU",
            "dp register",
            "its CPU",
            "dp removed → update",
            "vgpu apply A10-4Q",
            "its CPU",
            "vgpu assert",
            "its CPU",
        ],
        &points,
    );
    let t = generated("L40S", 4)?;
    let mut points = Vec::new();
    for (per_gpu, profile) in [
        (1, "L40S-48Q"),
        (4, "L40S-12Q"),
        (8, "L40S-6Q"),
        (16, "L40S-3Q"),
        (32, "L40S-1Q"),
    ] {
        let mut s: Vec<Vec<Duration>> = vec![Vec::new(); 7];
        for _ in 0..cli.runs {
            let sim = mount(&t);
            let f = ok(vgpu(b, sim.root(), &cfg, "apply", profile)?, "apply")?;
            s[0].push(f.wall);
            s[1].push(f.cpu);
            let f = ok(vgpu(b, sim.root(), &cfg, "assert", profile)?, "assert")?;
            s[2].push(f.wall);
            s[3].push(f.cpu);
            let p = profile.to_string();
            let case = DpCase {
                topo: t.clone(),
                label: format!("4xL40S {profile}"),
                prepare: Box::new(move |b: &Bins, root: &Path, cfg: &Path| {
                    ok(vgpu(b, root, cfg, "apply", &p)?, "apply").map(|_| ())
                }),
            };
            let d = dp_once(b, &case, &cfg, allocations, None).await?;
            s[4].push(d.register);
            s[5].push(d.register_cpu);
            s[6].push(d.change_remove.ok_or_else(|| anyhow!("no change figure"))?);
        }
        points.push(Point {
            n: 4 * per_gpu,
            medians: medians(&s)?,
        });
    }
    curve_table(
        r,
        "vGPUs",
        &[
            "vgpu apply",
            "its CPU",
            "vgpu assert",
            "its CPU",
            "dp register",
            "its CPU",
            "dp removed → update",
        ],
        &points,
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cores} × {cpu}, Linux {}", kernel.trim())
}

fn commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(why) = testkit::sim::unavailable() {
        bail!("gpu-vm-bench needs node-sim, which cannot run here: {why}");
    }
    let b = bins()?;
    let mut r = Report::default();
    let want = |s: &str| cli.only.is_empty() || cli.only.iter().any(|o| o == s);
    r.line(format!(
        "Machine: {}. Commit: {}. Runs per figure: {} (median, min–max).",
        machine(),
        commit(),
        cli.runs
    ));
    r.line("");
    if want("vfio") {
        bench_vfio(&cli, &b, &mut r)?;
    }
    if want("vgpu") {
        bench_vgpu(&cli, &b, &mut r)?;
    }
    if want("dp") || want("curve") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        if want("dp") {
            rt.block_on(bench_dp(&cli, &b, &mut r))?;
        }
        if want("curve") {
            rt.block_on(bench_curve(&cli, &b, &mut r))?;
        }
    }
    if let Some(out) = &cli.out {
        write_out(out, &r.text)?;
    }
    Ok(())
}

/// Replaces the generated part of BENCHMARKS.md (between the markers) or writes it whole.
fn write_out(path: &Path, body: &str) -> Result<()> {
    const BEGIN: &str = "<!-- gpu-vm-bench: begin -->";
    const END: &str = "<!-- gpu-vm-bench: end -->";
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let new = match (old.find(BEGIN), old.find(END)) {
        (Some(a), Some(z)) if a < z => format!("{}{BEGIN}\n{body}{}", &old[..a], &old[z..]),
        _ => format!("{old}{BEGIN}\n{body}{END}\n"),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}
