//! `vm-kubelet`: the test kubelet scenario 3 runs in the VM guest, next to sandbox-dp.
//!
//! Serves kubelet's `Registration` service in `--dir` (testkit's fake kubelet), waits for each
//! `--resource NAME=ID,ID…` to register, then checks what kubelet would see: ListAndWatch lists
//! exactly those IDs, healthy; Allocate returns the env var and the real `/dev/vfio` group nodes
//! (read from sysfs); an unknown ID is refused. With `--remove-mdev UUID` it removes that mdev
//! through sysfs and waits for ListAndWatch to drop it (or mark it unhealthy), printing how long
//! that took. Prints `PASS <check>` / `FAIL <check>: <detail>` lines on stdout (the VM tier's
//! results format); exit status 0 when every check passed.
//!
//! With `--on-demand NAME=COUNT --pod-resources SOCKET` (sandbox-dp `--on-demand`) it also
//! serves kubelet's PodResources API on SOCKET and plays a pod's life: NAME lists COUNT slots;
//! Allocate of one creates an mdev (its UUID in the env, its group node in the specs); `List`
//! then holds the device and the mdev stays; `List` drops it and the mdev is removed, and the
//! slots come back. `--other NAME=BEFORE,AFTER` is another type of the same parent, whose list
//! must go from BEFORE to AFTER slots while the mdev lives and back.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use testkit::kubelet::pod_resources::pod;
use testkit::kubelet::{FakeKubelet, FakePodResources, ListWatch, summary};
use vm_tier::Checks;

#[derive(Debug)]
struct Args {
    dir: PathBuf,
    sys: PathBuf,
    resources: Vec<(String, Vec<String>)>,
    remove_mdev: Option<String>,
    timeout: Duration,
    /// `--on-demand NAME=COUNT`.
    on_demand: Option<(String, usize)>,
    /// `--other NAME=BEFORE,AFTER`.
    other: Option<(String, usize, usize)>,
    /// `--pod-resources SOCKET`.
    pod_resources: Option<PathBuf>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        dir: PathBuf::new(),
        sys: PathBuf::from("/sys"),
        resources: Vec::new(),
        remove_mdev: None,
        timeout: Duration::from_secs(30),
        on_demand: None,
        other: None,
        pod_resources: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--dir" => args.dir = PathBuf::from(value()?),
            "--sys" => args.sys = PathBuf::from(value()?),
            "--resource" => {
                let v = value()?;
                let (name, ids) = v
                    .split_once('=')
                    .with_context(|| format!("--resource {v}: expected NAME=ID,ID"))?;
                let ids = ids.split(',').filter(|s| !s.is_empty()).map(String::from);
                args.resources.push((name.to_string(), ids.collect()));
            }
            "--remove-mdev" => args.remove_mdev = Some(value()?),
            "--on-demand" => {
                let v = value()?;
                let (name, n) = v
                    .split_once('=')
                    .with_context(|| format!("--on-demand {v}: expected NAME=COUNT"))?;
                let n = n.parse().with_context(|| format!("--on-demand {v}"))?;
                args.on_demand = Some((name.to_string(), n));
            }
            "--other" => {
                let v = value()?;
                let parsed = v.split_once('=').and_then(|(name, counts)| {
                    let (b, a) = counts.split_once(',')?;
                    Some((name.to_string(), b.parse().ok()?, a.parse().ok()?))
                });
                args.other = Some(
                    parsed.with_context(|| format!("--other {v}: expected NAME=BEFORE,AFTER"))?,
                );
            }
            "--pod-resources" => args.pod_resources = Some(PathBuf::from(value()?)),
            "--timeout" => {
                let v = value()?;
                args.timeout =
                    Duration::from_secs(v.parse().with_context(|| format!("--timeout {v}"))?);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    let on_demand = args.on_demand.is_some() && args.pod_resources.is_some();
    if args.dir.as_os_str().is_empty() || (args.resources.is_empty() && !on_demand) {
        bail!(
            "usage: vm-kubelet --dir DIR (--resource NAME=ID,ID... [--remove-mdev UUID] | --on-demand NAME=COUNT --pod-resources SOCKET [--other NAME=BEFORE,AFTER]) [--timeout SECS] [--sys DIR]"
        );
    }
    Ok(args)
}

fn is_uuid(id: &str) -> bool {
    id.len() == 36 && id.bytes().filter(|b| *b == b'-').count() == 4
}

/// The IOMMU group of a PCI address or an mdev UUID, from sysfs.
fn group_of(sys: &Path, id: &str) -> anyhow::Result<String> {
    let link = if is_uuid(id) {
        sys.join("bus/mdev/devices").join(id).join("iommu_group")
    } else {
        sys.join("bus/pci/devices").join(id).join("iommu_group")
    };
    let target = std::fs::read_link(&link).with_context(|| format!("{}", link.display()))?;
    target
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .with_context(|| format!("{}: no group in {}", link.display(), target.display()))
}

/// `PCI_RESOURCE_NVIDIA_COM_X` / `MDEV_PCI_RESOURCE_NVIDIA_COM_X`.
fn env_name(resource: &str, mdev: bool) -> String {
    let r: String = resource
        .to_uppercase()
        .chars()
        .map(|c| if c == '/' || c == '.' { '_' } else { c })
        .collect();
    if mdev {
        format!("MDEV_PCI_RESOURCE_{r}")
    } else {
        format!("PCI_RESOURCE_{r}")
    }
}

fn slug(resource: &str) -> String {
    resource.replace('/', "-")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(0) => std::process::ExitCode::SUCCESS,
        Ok(_) => std::process::ExitCode::from(1),
        Err(e) => {
            println!("FAIL vm-kubelet: {}", format!("{e:#}").replace('\n', " "));
            std::process::ExitCode::from(2)
        }
    }
}

async fn run() -> anyhow::Result<usize> {
    let args = parse_args()?;
    let mut report = Checks::default();
    let mut kubelet = FakeKubelet::start(&args.dir).await?;
    if let (Some(od), Some(socket)) = (&args.on_demand, &args.pod_resources) {
        let pods = FakePodResources::start(socket).await?;
        let res = on_demand(&args, od, &mut kubelet, &pods, &mut report).await;
        report.check("on-demand", res);
        kubelet.stop().await;
        return Ok(report.failed);
    }
    let names: Vec<&str> = args.resources.iter().map(|(n, _)| n.as_str()).collect();
    let regs = kubelet.wait_for(&names, args.timeout).await;
    let regs = match regs {
        Ok(r) => r,
        Err(e) => {
            report.check("kubelet-registrations", Err(e));
            return Ok(report.failed);
        }
    };
    for (name, ids) in &args.resources {
        let s = slug(name);
        let Some(reg) = regs.get(name) else { continue };
        report.check(&format!("registered-{s}"), {
            if reg.version == "v1beta1" {
                Ok(())
            } else {
                Err(anyhow::anyhow!("API version {:?}", reg.version))
            }
        });
        let mut plugin = match kubelet.plugin(&reg.endpoint).await {
            Ok(p) => p,
            Err(e) => {
                report.check(&format!("connect-{s}"), Err(e));
                continue;
            }
        };
        // ListAndWatch: exactly the expected IDs, all healthy.
        let want: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
        let listed = async {
            let mut lw = plugin.list_and_watch().await?;
            lw.wait_until(args.timeout, |l| {
                l.iter().map(|d| d.id.as_str()).collect::<BTreeSet<_>>() == want
                    && l.iter().all(|d| d.health == "Healthy")
            })
            .await
            .map(|_| ())
        };
        report.check(&format!("listandwatch-{s}"), listed.await);

        // Allocate all of them in one container.
        let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        match plugin.allocate(&[&id_refs]).await {
            Err(status) => report.check(&format!("allocate-{s}"), Err(anyhow::anyhow!("{status}"))),
            Ok(resp) => {
                let c = resp
                    .container_responses
                    .into_iter()
                    .next()
                    .unwrap_or_default();
                let mdev = ids.iter().all(|i| is_uuid(i));
                let key = env_name(name, mdev);
                let want_env = ids.join(",");
                report.check(
                    &format!("allocate-{s}-env"),
                    match c.envs.get(&key) {
                        Some(v) if *v == want_env => Ok(()),
                        other => Err(anyhow::anyhow!(
                            "{key}={other:?}, want {want_env:?}; envs {:?}",
                            c.envs
                        )),
                    },
                );
                let specs = (|| -> anyhow::Result<()> {
                    let mut want_paths: BTreeSet<String> =
                        BTreeSet::from(["/dev/vfio/vfio".to_string()]);
                    for id in ids {
                        want_paths.insert(format!("/dev/vfio/{}", group_of(&args.sys, id)?));
                    }
                    let got: BTreeSet<String> =
                        c.devices.iter().map(|d| d.host_path.clone()).collect();
                    if got != want_paths {
                        bail!("device specs {got:?}, want {want_paths:?}");
                    }
                    for d in &c.devices {
                        if d.permissions != "mrw" {
                            bail!("{} has permissions {:?}", d.host_path, d.permissions);
                        }
                        if !Path::new(&d.host_path).exists() {
                            bail!("{} does not exist", d.host_path);
                        }
                    }
                    Ok(())
                })();
                report.check(&format!("allocate-{s}-vfio-nodes"), specs);
            }
        }
        report.check(
            &format!("allocate-{s}-unknown-id-refused"),
            match plugin.allocate(&[&["no-such-device"]]).await {
                Ok(r) => Err(anyhow::anyhow!("accepted: {r:?}")),
                Err(_) => Ok(()),
            },
        );
    }

    if let Some(uuid) = &args.remove_mdev {
        let owner = args.resources.iter().find(|(_, ids)| ids.contains(uuid));
        let result = async {
            let (name, _) = owner.with_context(|| format!("{uuid} is in no --resource"))?;
            let reg = regs
                .get(name)
                .with_context(|| format!("{name} did not register"))?;
            let mut plugin = kubelet.plugin(&reg.endpoint).await?;
            let mut lw = plugin.list_and_watch().await?;
            lw.next(args.timeout).await?;
            let remove = args.sys.join("bus/mdev/devices").join(uuid).join("remove");
            let started = Instant::now();
            std::fs::write(&remove, "1").with_context(|| format!("{}", remove.display()))?;
            let l = lw
                .wait_until(args.timeout, |l| {
                    l.iter().all(|d| d.id != *uuid || d.health != "Healthy")
                })
                .await?;
            eprintln!(
                "vm-kubelet: ListAndWatch dropped {uuid} {} ms after its removal: {:?}",
                started.elapsed().as_millis(),
                summary(&l)
            );
            Ok(())
        };
        report.check("listandwatch-drops-removed-mdev", result.await);
    }
    kubelet.stop().await;
    Ok(report.failed)
}

/// A slot's number: the last part of its ID (`mtty-mtty-2-3` → 3).
fn slot(id: &str) -> u32 {
    id.rsplit_once('-')
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(u32::MAX)
}

/// Waits until `lw` lists `n` devices, all healthy.
async fn lists(lw: &mut ListWatch, n: usize, timeout: Duration) -> anyhow::Result<Vec<String>> {
    let l = lw
        .wait_until(timeout, |l| {
            l.len() == n && l.iter().all(|d| d.health == "Healthy")
        })
        .await?;
    let mut ids: Vec<String> = l.into_iter().map(|d| d.id).collect();
    ids.sort_by_key(|id| slot(id));
    Ok(ids)
}

/// Waits until `pred` holds, polling every 20 ms.
async fn until(timeout: Duration, what: &str, pred: impl Fn() -> bool) -> anyhow::Result<()> {
    let end = Instant::now() + timeout;
    while !pred() {
        if Instant::now() >= end {
            bail!("not within {timeout:?}: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The on-demand pod life (see the module's doc). Each step is a check; an `Err` is a step
/// the others depend on that failed.
async fn on_demand(
    args: &Args,
    (name, count): &(String, usize),
    kubelet: &mut FakeKubelet,
    pods: &FakePodResources,
    report: &mut Checks,
) -> anyhow::Result<()> {
    let t = args.timeout;
    let mut names = vec![name.as_str()];
    names.extend(args.other.as_ref().map(|(n, _, _)| n.as_str()));
    let regs = kubelet.wait_for(&names, t).await?;
    let s = slug(name);
    let mut plugin = kubelet.plugin(&regs[name].endpoint).await?;
    let mut lw = plugin.list_and_watch().await?;
    let mut other = match &args.other {
        Some((o, before, after)) => {
            let mut p = kubelet.plugin(&regs[o].endpoint).await?;
            let lw = p.list_and_watch().await?;
            Some((slug(o), *before, *after, lw))
        }
        None => None,
    };

    // The slots: as many as sysfs says can be created.
    let ids = lists(&mut lw, *count, t).await;
    report.check(
        &format!("on-demand-{s}-lists-{count}-slots"),
        ids.as_ref()
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("{e:#}")),
    );
    if let Some((o, before, _, lw)) = &mut other {
        let r = lists(lw, *before, t).await.map(|_| ());
        report.check(&format!("on-demand-{o}-lists-{before}-slots"), r);
    }
    let id = ids?
        .into_iter()
        .next()
        .with_context(|| format!("{name} lists no slot"))?;

    // Allocate: an mdev now exists, and the answer names it.
    let resp = plugin
        .allocate(&[&[id.as_str()]])
        .await
        .map_err(|e| anyhow::anyhow!("Allocate {id}: {e}"))?;
    let c = resp
        .container_responses
        .into_iter()
        .next()
        .unwrap_or_default();
    let key = env_name(name, true);
    let uuid = c.envs.get(&key).cloned().unwrap_or_default();
    let mdev_dir = args.sys.join("bus/mdev/devices").join(&uuid);
    eprintln!("vm-kubelet: Allocate {id} answered {key}={uuid}");
    report.check(
        "allocate-creates-the-mdev-named-in-the-env",
        if is_uuid(&uuid) && mdev_dir.exists() {
            Ok(())
        } else {
            Err(anyhow::anyhow!(
                "{key}={uuid:?} ({} exists: {}); envs {:?}",
                mdev_dir.display(),
                mdev_dir.exists(),
                c.envs
            ))
        },
    );
    let specs = (|| -> anyhow::Result<()> {
        let want: BTreeSet<String> = [
            "/dev/vfio/vfio".to_string(),
            format!("/dev/vfio/{}", group_of(&args.sys, &uuid)?),
        ]
        .into();
        let got: BTreeSet<String> = c.devices.iter().map(|d| d.host_path.clone()).collect();
        if got != want {
            bail!("device specs {got:?}, want {want:?}");
        }
        if let Some(d) = c.devices.iter().find(|d| !Path::new(&d.host_path).exists()) {
            bail!("{} does not exist", d.host_path);
        }
        Ok(())
    })();
    report.check("allocate-answers-the-mdev-group-node", specs);
    if let Some((o, _, after, lw)) = &mut other {
        let r = lists(lw, *after, t).await.map(|_| ());
        report.check(
            &format!("on-demand-{o}-lists-{after}-slots-while-it-lives"),
            r,
        );
    }

    // A pod holds it: kept across polls.
    let calls = pods.list_calls();
    pods.set_pods(vec![pod("default", "vm", "compute", name, &[id.as_str()])]);
    let polled = until(t, "two PodResources List calls", || {
        pods.list_calls() >= calls + 2
    })
    .await;
    report.check(
        "held-mdev-kept",
        polled.and_then(|()| {
            if mdev_dir.exists() {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "{} was removed under its pod",
                    mdev_dir.display()
                ))
            }
        }),
    );

    // The pod is gone: the mdev is removed, and the slots come back.
    pods.set_pods(Vec::new());
    let started = Instant::now();
    let gone = until(t, "the mdev removed", || !mdev_dir.exists()).await;
    if gone.is_ok() {
        eprintln!(
            "vm-kubelet: {uuid} removed {} ms after its pod left List",
            started.elapsed().as_millis()
        );
    }
    report.check("released-mdev-removed", gone);
    let back = lists(&mut lw, *count, t).await.map(|_| ());
    report.check(&format!("on-demand-{s}-lists-{count}-slots-again"), back);
    if let Some((o, before, _, lw)) = &mut other {
        let r = lists(lw, *before, t).await.map(|_| ());
        report.check(&format!("on-demand-{o}-lists-{before}-slots-again"), r);
    }
    Ok(())
}
