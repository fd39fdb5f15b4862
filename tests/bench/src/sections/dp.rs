//! sandbox-dp: start → registered, first ListAndWatch, Allocate, a device removed and restored
//! → update, kubelet restart → registered again, RSS, threads and idle CPU.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use node_sim::Topology;
use testkit::kubelet::api::Device;
use testkit::kubelet::{FakeKubelet, ListWatch, PluginClient};

use crate::Cli;
use crate::harness::bins::Bins;
use crate::harness::process::{Invocation, ok, run};
use crate::harness::procstat;
use crate::harness::report::{Report, mib, need};
use crate::harness::stats::{fmt_duration, fmt_summary, summarize};
use crate::harness::topology::{builtin, generated, mount};
use crate::sections::vgpu::{config_file, vgpu};

/// Prepares a node for sandbox-dp (binds GPUs, creates vGPUs).
pub type Prepare = Box<dyn Fn(&Bins, &Path, &Path) -> Result<()>>;

pub struct DpCase {
    pub topo: Topology,
    pub label: String,
    /// Prepares the node (binds GPUs, creates vGPUs).
    pub prepare: Prepare,
}

pub fn prep_passthrough(b: &Bins, root: &Path, _cfg: &Path) -> Result<()> {
    ok(
        run(Command::new(&b.vfio)
            .args(["bind", "--host-root"])
            .arg(root))?,
        "vfio-manager bind",
    )?;
    Ok(())
}

pub fn prep_a10_4q(b: &Bins, root: &Path, cfg: &Path) -> Result<()> {
    ok(vgpu(b, root, cfg, "apply", "A10-4Q")?, "apply A10-4Q")?;
    Ok(())
}

pub fn prep_l40s_1q(b: &Bins, root: &Path, cfg: &Path) -> Result<()> {
    ok(vgpu(b, root, cfg, "apply", "L40S-1Q")?, "apply L40S-1Q")?;
    Ok(())
}

#[derive(serde::Deserialize)]
pub struct DpList {
    pub resources: Vec<DpResource>,
}

#[derive(serde::Deserialize)]
pub struct DpResource {
    pub name: String,
    pub socket: String,
    pub devices: Vec<DpDevice>,
}

#[derive(serde::Deserialize)]
pub struct DpDevice {
    pub id: String,
}

pub fn dp_list(b: &Bins, root: &Path) -> Result<DpList> {
    dp_list_with(b, root, &[])
}

/// `sandbox-dp list --json` with more arguments (`--pci-ids FILE`).
pub fn dp_list_with(b: &Bins, root: &Path, args: &[std::ffi::OsString]) -> Result<DpList> {
    let out = Command::new(&b.dp)
        .args(["list", "--json", "--host-root"])
        .arg(root)
        .args(args)
        .output()
        .context("sandbox-dp list")?;
    if !out.status.success() {
        bail!("sandbox-dp list: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).context("parsing sandbox-dp list --json")
}

pub struct DpRun {
    pub register: Duration,
    pub first_list: Duration,
    pub alloc: Vec<Duration>,
    pub change_remove: Option<Duration>,
    pub change_restore: Option<Duration>,
    /// kubelet restarted (its plugin directory cleared) → every resource registered again.
    pub reregister: Duration,
    pub rss_kib: u64,
    pub anon_kib: u64,
    pub threads: u64,
    pub idle_cpu: Option<f64>,
}

pub async fn dp_once(
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
    let inv = Invocation::new(&b.dp, &[&"--host-root", &sim.root()]);
    let daemon = Daemon::start(&inv).await?;
    let pid = daemon.pid;
    registered(&mut kubelet, &expected).await?;
    let register = start.elapsed();

    // The biggest resource: first list, allocations, change.
    let res = biggest(&list)?;
    let (mut client, mut lw, first, first_list) = first_list(&kdir, res, &case.label).await?;
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
            daemon.stop().await;
            kubelet.stop().await;
            return Ok(DpRun {
                register,
                first_list,
                alloc,
                change_remove: Some(removed),
                change_restore: Some(restored),
                reregister,
                rss_kib: s0.rss_kib,
                anon_kib: s0.anon_kib,
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
    daemon.stop().await;
    kubelet.stop().await;
    Ok(DpRun {
        register,
        first_list,
        alloc,
        change_remove,
        change_restore,
        reregister,
        rss_kib: s0.rss_kib,
        anon_kib: s0.anon_kib,
        threads: s0.threads,
        idle_cpu,
    })
}

/// Waits until the fake kubelet holds a registration of every resource in `expected`.
pub async fn registered(kubelet: &mut FakeKubelet, expected: &BTreeSet<String>) -> Result<()> {
    let mut seen = BTreeSet::new();
    while &seen != expected {
        let reg = kubelet.next_registration(Duration::from_secs(30)).await?;
        seen.insert(reg.resource_name);
    }
    Ok(())
}

/// The resource with the most devices.
pub fn biggest(list: &DpList) -> Result<&DpResource> {
    list.resources
        .iter()
        .max_by_key(|r| r.devices.len())
        .ok_or_else(|| anyhow!("no resource"))
}

/// Connects to the resource's socket and opens ListAndWatch: the client, the stream, the first
/// list (checked to hold every device) and how long it took.
pub async fn first_list(
    kdir: &Path,
    res: &DpResource,
    label: &str,
) -> Result<(PluginClient, ListWatch, Vec<Device>, Duration)> {
    let t = Instant::now();
    let mut client = PluginClient::connect(&kdir.join(&res.socket)).await?;
    let mut lw = client.list_and_watch().await?;
    let first = lw.next(Duration::from_secs(10)).await?;
    let took = t.elapsed();
    if first.len() != res.devices.len() {
        bail!(
            "{label}: first list has {} devices, expected {}",
            first.len(),
            res.devices.len()
        );
    }
    Ok((client, lw, first, took))
}

/// A daemon (sandbox-dp, sandbox-dra) started for one run; dropping it kills it.
#[derive(Debug)]
pub struct Daemon {
    child: Option<tokio::process::Child>,
    /// Its pid.
    pub pid: u32,
    /// Its stderr, for the error when a run fails.
    stderr: tempfile::NamedTempFile,
}

impl Daemon {
    /// Starts `inv`.
    pub async fn start(inv: &Invocation) -> Result<Daemon> {
        let mut cmd = inv.command();
        let stderr = tempfile::NamedTempFile::new()?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr.reopen()?);
        let child = tokio::process::Command::from(cmd)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", inv.bin.display()))?;
        let pid = child
            .id()
            .ok_or_else(|| anyhow!("{} exited at once", inv.bin.display()))?;
        Ok(Daemon {
            child: Some(child),
            pid,
            stderr,
        })
    }

    /// Stops it as kubelet stops a pod, SIGTERM, and waits until it is gone; SIGKILL if it has
    /// not exited within 5 s.
    pub async fn stop(mut self) {
        if let Some(mut child) = self.child.take() {
            self.signal(nix::sys::signal::Signal::SIGTERM);
            if tokio::time::timeout(Duration::from_secs(5), child.wait())
                .await
                .is_err()
            {
                self.kill();
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
    }

    fn kill(&self) {
        self.signal(nix::sys::signal::Signal::SIGKILL);
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid as i32), signal);
    }

    /// All it wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.stderr.path()).unwrap_or_default()
    }

    /// The last lines it wrote to stderr.
    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(self.stderr.path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" / ")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Not after `stop`: the pid may belong to another process by then.
        if self.child.is_some() {
            self.kill();
        }
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
    }
}

/// Restarts the fake kubelet as kubelet does (the plugin directory cleared, a new
/// `kubelet.sock`) and times until every resource is registered again.
pub async fn reregistration(
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

pub async fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let (_dir, cfg) = config_file()?;
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
    r.line(format!("From process start to the fake kubelet holding every resource's registration; the first ListAndWatch answer; Allocate of one device ({} calls per run: p50 and p99 over all runs); a device removed (driver unbound or mdev removed) → ListAndWatch update, and restored → update; kubelet restarted (plugin directory cleared, new `kubelet.sock`) → every resource registered again; RSS and threads at idle. Goals: Allocate p99 ≤ 0.2 ms, change → update ≤ 10 ms, RSS ≤ 5 MB, idle CPU ≈ 0.", cli.allocations));
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
        let anon = runs.iter().map(|x| x.anon_kib).max().unwrap_or(0);
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
        r.memory("sandbox-dp", "registered, idle", &case.label, rss, anon);
    }
    r.line("");
    if let Some(l) = idle_line {
        r.line(l);
        r.line("");
    }
    Ok(())
}
