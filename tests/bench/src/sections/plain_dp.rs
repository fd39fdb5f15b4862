//! sandbox-dp as a daemon on the plain tree: start → registered (with and without the host's
//! pci.ids), the first ListAndWatch, the health reaction to a removed `/dev/vfio/<group>` file,
//! and on vendor-path nodes a vGPU removed and restored, each with its limit from one run under
//! strace, where the bench notes when each figure starts and ends.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use common::HostPaths;
use testkit::kubelet::FakeKubelet;
use testkit::kubelet::api::Device;

use crate::Cli;
use crate::harness::baseline;
use crate::harness::bins::Bins;
use crate::harness::process::Invocation;
use crate::harness::procstat;
use crate::harness::stats::{Summary, summarize};
use crate::harness::strace;
use crate::harness::uevent::UeventSender;
use crate::sections::dp::{Daemon, DpList, biggest, dp_list_with, first_list, registered};
use crate::sections::plain::{Base, Inputs, PlainNode, Row, Tracer, at_most, limit_of};

/// Runs of the bare plugin, per node.
pub(crate) const LIST_RUNS: usize = 20;

/// sandbox-dp's runs per `--runs`, each a daemon started, registered, listed and the group node
/// removed and created again, per node and with and without pci.ids: each figure is one sample
/// of a run, and a median of three is at the mercy of one slow spell.
pub(crate) const DAEMON_RUNS_PER: usize = 3;

/// sandbox-dp's runs per node: `--plain-runs`, or [`DAEMON_RUNS_PER`] × `--runs`.
pub(crate) fn daemon_runs(cli: &Cli) -> usize {
    cli.plain_runs.unwrap_or(cli.runs * DAEMON_RUNS_PER)
}

/// How long the bench waits after a vGPU's removal showed before restoring it: longer than
/// sandbox-dp's debounce (20 ms, the least time between two event-driven reads of devices), so
/// that "restored → update" is the reaction to the restore, not the rest of that interval.
const SETTLE: Duration = Duration::from_millis(50);

/// A vGPU VF's removal as node-sim makes it: the files under the VF that change when
/// `current_vgpu_type` is set to 0, and the device files that go.
#[derive(Debug)]
pub struct Removal {
    /// The VF (sandbox-dp's device id).
    pub device: String,
    /// Files under the VF's directory that change.
    changed: Vec<Changed>,
    /// Device files (relative to the root) that go, with their modes.
    gone: Vec<(PathBuf, u32)>,
}

/// A file under the VF's directory: its path relative to it, its content before and after
/// (`None`: absent).
type Changed = (PathBuf, Option<Vec<u8>>, Option<Vec<u8>>);

/// Files and their contents, by path.
type Files = BTreeMap<PathBuf, Vec<u8>>;

/// Device files and their modes, by path.
type Nodes = BTreeMap<PathBuf, u32>;

/// Regular files in `dir` and its subdirectories (one level), relative to it; links are not
/// followed, unreadable files left out.
fn snapshot(dir: &Path) -> Result<Files> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![(dir.to_path_buf(), 0)];
    while let Some((d, depth)) = dirs.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("listing {}", d.display()))? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() && depth == 0 {
                dirs.push((e.path(), 1));
            } else if ft.is_file()
                && let Ok(c) = std::fs::read(e.path())
                && let Ok(rel) = e.path().strip_prefix(dir)
            {
                out.insert(rel.to_path_buf(), c);
            }
        }
    }
    Ok(out)
}

/// The files under `dev/vfio` (group nodes, VFIO cdevs), relative to the root, with modes.
fn dev_nodes(root: &Path) -> Nodes {
    let mut out = BTreeMap::new();
    let mut dirs = vec![HostPaths::new(root).dev_vfio()];
    while let Some(d) = dirs.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if meta.is_dir() {
                dirs.push(e.path());
            } else if let Ok(rel) = e.path().strip_prefix(root) {
                out.insert(rel.to_path_buf(), meta.permissions().mode());
            }
        }
    }
    out
}

impl Removal {
    /// Removes the vGPU of the VF `device` on node-sim, notes what changed, and creates it again
    /// (checking that node-sim is back where it was).
    pub fn record(sim_root: &Path, device: &str) -> Result<Removal> {
        let dir = pci_dir(sim_root, device);
        let ty_path = dir.join("nvidia/current_vgpu_type");
        let ty = std::fs::read_to_string(&ty_path)
            .with_context(|| format!("reading {}", ty_path.display()))?
            .trim()
            .to_string();
        if ty == "0" {
            bail!("{device} has no vGPU to remove");
        }
        let (files0, nodes0) = (snapshot(&dir)?, dev_nodes(sim_root));
        std::fs::write(&ty_path, "0")
            .with_context(|| format!("writing 0 to {}", ty_path.display()))?;
        let (files1, nodes1) = (snapshot(&dir)?, dev_nodes(sim_root));
        std::fs::write(&ty_path, &ty)
            .with_context(|| format!("writing {ty} to {}", ty_path.display()))?;
        if snapshot(&dir)? != files0 || dev_nodes(sim_root) != nodes0 {
            bail!(
                "{device}: node-sim did not come back to the same state after the vGPU was recreated"
            );
        }
        Ok(Removal::between(
            device,
            (&files0, &nodes0),
            (&files1, &nodes1),
        ))
    }

    /// The removal that takes a device from `before` to `after` (its files, the device files).
    fn between(device: &str, before: (&Files, &Nodes), after: (&Files, &Nodes)) -> Removal {
        let (files0, nodes0) = before;
        let (files1, nodes1) = after;
        let names: BTreeSet<&PathBuf> = files0.keys().chain(files1.keys()).collect();
        let changed = names
            .into_iter()
            .filter(|p| files0.get(*p) != files1.get(*p))
            .map(|p| (p.clone(), files0.get(p).cloned(), files1.get(p).cloned()))
            .collect();
        let gone = nodes0
            .iter()
            .filter(|(p, _)| !nodes1.contains_key(*p))
            .map(|(p, m)| (p.clone(), *m))
            .collect();
        Removal {
            device: device.to_string(),
            changed,
            gone,
        }
    }

    /// Makes the copy at `root` look removed (or restored), then sends the uevent.
    fn set(&self, root: &Path, removed: bool, sender: &mut UeventSender) -> Result<()> {
        let dir = pci_dir(root, &self.device);
        for (rel, before, after) in &self.changed {
            let p = dir.join(rel);
            match if removed { after } else { before } {
                Some(c) => std::fs::write(&p, c),
                None => std::fs::remove_file(&p),
            }
            .with_context(|| format!("changing {}", p.display()))?;
        }
        for (rel, mode) in &self.gone {
            let p = root.join(rel);
            if removed {
                std::fs::remove_file(&p)
            } else {
                std::fs::write(&p, "").and_then(|()| {
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode))
                })
            }
            .with_context(|| format!("changing {}", p.display()))?;
        }
        sender.send(root, &dir, "change")
    }
}

fn pci_dir(root: &Path, bdf: &str) -> PathBuf {
    HostPaths::new(root).pci_devices().join(bdf)
}

/// The IOMMU group of a device id: a PCI address or an mdev UUID.
fn group_of(root: &Path, id: &str) -> Result<u32> {
    let paths = HostPaths::new(root);
    let dev = if id.contains(':') {
        paths.pci_devices().join(id)
    } else {
        paths.mdev_devices().join(id)
    };
    let link = std::fs::read_link(dev.join("iommu_group"))
        .with_context(|| format!("reading {}/iommu_group", dev.display()))?;
    link.file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| anyhow!("{}: no group in {}", id, link.display()))
}

/// Empties the kubelet directory (sockets of an earlier run).
fn clear_dir(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        }
        .with_context(|| format!("removing {}", p.display()))?;
    }
    Ok(())
}

/// Start and end (strace's clock) of each figure of a run.
#[derive(Clone, Copy, Debug, Default)]
struct Windows {
    register: (u64, u64),
    first_list: (u64, u64),
    unhealthy: (u64, u64),
    healthy: (u64, u64),
    removed: Option<(u64, u64)>,
    restored: Option<(u64, u64)>,
}

/// One run's figures.
struct ServeRun {
    register: Duration,
    first_list: Duration,
    unhealthy: Duration,
    healthy: Duration,
    removed: Option<Duration>,
    restored: Option<Duration>,
    rss_kib: u64,
    w: Windows,
}

fn health_of<'a>(l: &'a [Device], id: &str) -> Option<&'a str> {
    l.iter().find(|d| d.id == id).map(|d| d.health.as_str())
}

fn healthy(l: &[Device]) -> usize {
    l.iter().filter(|d| d.health == "Healthy").count()
}

/// One daemon run on the node: every figure, in order.
async fn serve_once(
    b: &Bins,
    n: &PlainNode,
    pci_ids: Option<&Path>,
    log: Option<&Path>,
    sender: Option<&mut UeventSender>,
) -> Result<ServeRun> {
    let root = n.tree.root();
    let paths = HostPaths::new(root);
    let kdir = paths.kubelet_dir();
    clear_dir(kdir)?;
    let mut extra: Vec<OsString> = Vec::new();
    if let Some(p) = pci_ids {
        extra.push("--pci-ids".into());
        extra.push(p.into());
    }
    let list = dp_list_with(b, root, &extra)?;
    let expected: BTreeSet<String> = list.resources.iter().map(|r| r.name.clone()).collect();
    if expected.is_empty() {
        bail!("{}: nothing to advertise", n.label);
    }
    let mut kubelet = FakeKubelet::start(kdir).await?;
    let mut inv = Invocation::new(&b.dp, &[&"--host-root", &root]);
    inv.args.extend(extra);

    let t0 = strace::now();
    let start = Instant::now();
    let daemon = Daemon::start(&inv, log).await?;
    let run = measure(
        n,
        &list,
        &expected,
        &mut kubelet,
        &daemon,
        start,
        t0,
        sender,
    )
    .await;
    let run = run.map_err(|e| e.context(format!("sandbox-dp's stderr: {}", daemon.stderr_tail())));
    daemon.stop().await;
    kubelet.stop().await;
    run
}

/// The figures of one run, from the daemon's start on.
#[allow(clippy::too_many_arguments)]
async fn measure(
    n: &PlainNode,
    list: &DpList,
    expected: &BTreeSet<String>,
    kubelet: &mut FakeKubelet,
    daemon: &Daemon,
    start: Instant,
    t0: u64,
    sender: Option<&mut UeventSender>,
) -> Result<ServeRun> {
    let root = n.tree.root();
    let paths = HostPaths::new(root);
    let kdir = paths.kubelet_dir();
    let mut w = Windows::default();
    registered(kubelet, expected).await?;
    let register = start.elapsed();
    w.register = (t0, strace::now());

    let res = biggest(list)?;
    let t0 = strace::now();
    let (_client, mut lw, first, first_list) = first_list(kdir, res, &n.label).await?;
    w.first_list = (t0, strace::now());
    let rss_kib = procstat::sample(daemon.pid)
        .map(|s| s.rss_kib)
        .ok_or_else(|| anyhow!("sandbox-dp died"))?;

    // Health: the group's device file removed, then created again.
    let id = res.devices[0].id.clone();
    let node = paths.vfio_group_node(group_of(root, &id)?);
    let mode = std::fs::metadata(&node)
        .with_context(|| format!("{} is missing", node.display()))?
        .permissions()
        .mode();
    let wait = Duration::from_secs(10);
    let t0 = strace::now();
    let start = Instant::now();
    std::fs::remove_file(&node)?;
    lw.wait_until(wait, |l| health_of(l, &id) == Some("Unhealthy"))
        .await?;
    let unhealthy = start.elapsed();
    w.unhealthy = (t0, strace::now());
    let t0 = strace::now();
    let start = Instant::now();
    std::fs::write(&node, "")?;
    std::fs::set_permissions(&node, std::fs::Permissions::from_mode(mode))?;
    lw.wait_until(wait, |l| health_of(l, &id) == Some("Healthy"))
        .await?;
    let healthy_again = start.elapsed();
    w.healthy = (t0, strace::now());

    // A vGPU removed and restored.
    let (mut removed, mut restored) = (None, None);
    if let (Some(rm), Some(sender)) = (&n.removal, sender) {
        let total = first.len();
        let t0 = strace::now();
        let start = Instant::now();
        rm.set(root, true, sender)?;
        lw.wait_until(wait, |l| healthy(l) == total - 1 || l.len() == total - 1)
            .await?;
        removed = Some(start.elapsed());
        w.removed = Some((t0, strace::now()));
        tokio::time::sleep(SETTLE).await;
        let t0 = strace::now();
        let start = Instant::now();
        rm.set(root, false, sender)?;
        lw.wait_until(wait, |l| healthy(l) == total && l.len() == total)
            .await?;
        restored = Some(start.elapsed());
        w.restored = Some((t0, strace::now()));
    }
    Ok(ServeRun {
        register,
        first_list,
        unhealthy,
        healthy: healthy_again,
        removed,
        restored,
        rss_kib,
        w,
    })
}

fn summary(runs: &[ServeRun], f: impl Fn(&ServeRun) -> Option<Duration>) -> Option<Summary> {
    summarize(&runs.iter().filter_map(f).collect::<Vec<_>>())
}

/// Every sandbox-dp daemon figure of one node.
pub async fn figures(
    cli: &Cli,
    b: &Bins,
    n: &PlainNode,
    pci_ids: Option<&Path>,
    tracer: &Tracer,
    inputs: &Inputs,
    start: Option<Base>,
) -> Result<Vec<Row>> {
    let mut sender = match n.removal {
        Some(_) => Some(UeventSender::new()?),
        None => None,
    };
    let (mut plain, mut ids) = (Vec::new(), Vec::new());
    for _ in 0..daemon_runs(cli) {
        plain.push(serve_once(b, n, None, None, sender.as_mut()).await?);
        if let Some(p) = pci_ids {
            ids.push(serve_once(b, n, Some(p), None, None).await?);
        }
    }
    // The limits: one run each under strace, its figures' windows replayed.
    let traced = match tracer.log(&n.label, "sandbox-dp") {
        Some(log) => Some((
            serve_once(b, n, None, Some(&log), sender.as_mut()).await?.w,
            log,
        )),
        None => None,
    };
    let traced_ids = match (pci_ids, tracer.log(&n.label, "sandbox-dp pci.ids")) {
        (Some(p), Some(log)) => Some((serve_once(b, n, Some(p), Some(&log), None).await?.w, log)),
        _ => None,
    };
    let lim = |t: &Option<(Windows, PathBuf)>, pick: &dyn Fn(&Windows) -> Option<(u64, u64)>| {
        t.as_ref()
            .and_then(|(w, log)| pick(w).map(|win| limit_of(log, inputs, Some(win))))
            .transpose()
    };

    // The bases of the figures that end with a registration or a ListAndWatch message: the
    // same steps taken by a bare device plugin, a process of its own woken by the same events
    // (gpu-vm-bare-plugin), with a list of the biggest resource's size.
    let listed = dp_list_with(b, n.tree.root(), &[])?;
    let size = biggest(&listed)?.devices.len();
    let dir = tempfile::tempdir_in(n.tree.root())?;
    let bare =
        baseline::bare_plugin(&b.bare, dir.path(), size, listed.resources.len(), LIST_RUNS).await?;
    let registers = Some(Base {
        what: if start.is_some() {
            "start + bare plugin's dial + Register"
        } else {
            "bare plugin's dial + Register"
        },
        time: start.map(|b| b.time).unwrap_or_default() + bare.register,
        start: start.map(|b| b.start).unwrap_or_default(),
    });
    let connect = Some(Base {
        what: "bare plugin's connect + list",
        time: bare.first,
        start: Duration::ZERO,
    });
    let removed_base = Some(Base {
        what: "bare plugin: file removed → list",
        time: bare.unhealthy,
        start: Duration::ZERO,
    });
    let created_base = Some(Base {
        what: "bare plugin: file created → list",
        time: bare.healthy,
        start: Duration::ZERO,
    });

    let label = n.label.as_str();
    let mut rows = Vec::new();
    let need = |s: Option<Summary>| s.ok_or_else(|| anyhow!("{label}: no runs"));
    let reg = need(summary(&plain, |r| Some(r.register)))?;
    rows.push(
        Row::time(
            label,
            "start → registered",
            reg,
            lim(&traced, &|w| Some(w.register))?,
        )
        .plus(registers),
    );
    if pci_ids.is_some() {
        let s = need(summary(&ids, |r| Some(r.register)))?;
        let x = s.median.as_secs_f64() / reg.median.as_secs_f64().max(1e-9);
        rows.push(
            Row::time(
                label,
                "start → registered, with pci.ids",
                s,
                lim(&traced_ids, &|w| Some(w.register))?,
            )
            .plus(registers)
            .goal(format!(
                "≤ 1.5× without ({x:.2}×): {}",
                if x <= 1.5 { "met" } else { "missed" }
            )),
        );
    }
    rows.push(
        Row::time(
            label,
            "first ListAndWatch",
            need(summary(&plain, |r| Some(r.first_list)))?,
            lim(&traced, &|w| Some(w.first_list))?,
        )
        .plus(connect),
    );
    // The health reaction, without and with pci.ids (no runs with it when it is missing).
    for (runs, t, suffix) in [(&plain, &traced, ""), (&ids, &traced_ids, ", with pci.ids")] {
        let Some(s) = summary(runs, |r| Some(r.unhealthy)) else {
            continue;
        };
        let figure = format!("`/dev/vfio/<g>` removed → Unhealthy{suffix}");
        rows.push(
            Row::time(label, figure, s, lim(t, &|w| Some(w.unhealthy))?)
                .plus(removed_base)
                .goal(at_most(s.median, Duration::from_micros(500), "0.5 ms")),
        );
    }
    rows.push(
        Row::time(
            label,
            "`/dev/vfio/<g>` back → Healthy",
            need(summary(&plain, |r| Some(r.healthy)))?,
            lim(&traced, &|w| Some(w.healthy))?,
        )
        .plus(created_base),
    );
    if let Some(s) = summary(&plain, |r| r.removed) {
        rows.push(
            Row::time(
                label,
                "vGPU removed → update",
                s,
                lim(&traced, &|w| w.removed)?,
            )
            .plus(removed_base)
            .goal(at_most(s.median, Duration::from_millis(10), "10 ms")),
        );
    }
    if let Some(s) = summary(&plain, |r| r.restored) {
        rows.push(
            Row::time(
                label,
                "vGPU restored → update",
                s,
                lim(&traced, &|w| w.restored)?,
            )
            .plus(created_base),
        );
    }
    let rss = |runs: &[ServeRun]| runs.iter().map(|r| r.rss_kib).max().unwrap_or(0);
    rows.push(Row::memory(label, "RSS, registered", rss(&plain)));
    if pci_ids.is_some() {
        rows.push(Row::memory(
            label,
            "RSS, registered, with pci.ids",
            rss(&ids),
        ));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(entries: &[(&str, &str)]) -> Files {
        entries
            .iter()
            .map(|(p, c)| (PathBuf::from(p), c.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn a_removal_is_what_changed_and_the_device_files_that_went() {
        let before = files(&[
            ("vendor", "0x10de\n"),
            ("nvidia/current_vgpu_type", "1155\n"),
            ("nvidia/creatable_vgpu_types", ""),
        ]);
        let after = files(&[
            ("vendor", "0x10de\n"),
            ("nvidia/current_vgpu_type", "0\n"),
            ("nvidia/creatable_vgpu_types", "1155 : NVIDIA L40S-1Q\n"),
            ("nvidia/new", "x"),
        ]);
        let nodes0: Nodes = [
            ("dev/vfio/40".into(), 0o600),
            ("dev/vfio/vfio".into(), 0o666),
        ]
        .into();
        let nodes1: Nodes = [("dev/vfio/vfio".into(), 0o666)].into();
        let r = Removal::between("0000:11:00.4", (&before, &nodes0), (&after, &nodes1));
        type Change<'a> = (&'a str, Option<&'a [u8]>, Option<&'a [u8]>);
        let changed: Vec<Change> = r
            .changed
            .iter()
            .map(|(p, a, b)| (p.to_str().unwrap(), a.as_deref(), b.as_deref()))
            .collect();
        assert_eq!(
            changed,
            [
                (
                    "nvidia/creatable_vgpu_types",
                    Some(&b""[..]),
                    Some(&b"1155 : NVIDIA L40S-1Q\n"[..])
                ),
                (
                    "nvidia/current_vgpu_type",
                    Some(&b"1155\n"[..]),
                    Some(&b"0\n"[..])
                ),
                ("nvidia/new", None, Some(&b"x"[..])),
            ]
        );
        assert_eq!(r.gone, [(PathBuf::from("dev/vfio/40"), 0o600)]);
    }

    #[test]
    fn groups_of_functions_and_mdevs() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let paths = HostPaths::new(root);
        let gpu = paths.pci_devices().join("0000:41:00.0");
        let mdev = paths
            .mdev_devices()
            .join("c0ffee00-0000-4000-8000-000000000001");
        for (d, g) in [(&gpu, 7), (&mdev, 130)] {
            std::fs::create_dir_all(d).unwrap();
            std::os::unix::fs::symlink(
                format!("../../../kernel/iommu_groups/{g}"),
                d.join("iommu_group"),
            )
            .unwrap();
        }
        assert_eq!(group_of(root, "0000:41:00.0").unwrap(), 7);
        assert_eq!(
            group_of(root, "c0ffee00-0000-4000-8000-000000000001").unwrap(),
            130
        );
        assert!(group_of(root, "0000:42:00.0").is_err());
    }
}
