//! Focused timings of a built sandbox-dp on plain trees (regular files and symlinks on tmpfs,
//! where reads cost what sysfs reads cost): what its events and its `--pci-ids` cost.
//!
//! ```text
//! cargo build --release -p sandbox-dp
//! cargo run -p sandbox-dp --example measure -- target/release/sandbox-dp [--pci-ids FILE] [--runs N]
//! ```
//!
//! - register: 8 A10s on vfio-pci; start → registered, and RSS once the first list is out.
//! - health: `/dev/vfio/<group>` removed → Unhealthy in ListAndWatch, and back → Healthy.
//! - vGPU VF removed: 16 L40S with 32 vGPU VFs each (512 devices); one VF's type set to 0, its
//!   group node removed and its `change` uevent sent → the VF gone from ListAndWatch. Needs root
//!   (the uevent); skipped otherwise.
//!
//! With `--root DIR` (a node-sim mount, say), only start → registered on that host root.
//!
//! With `--bare BIN` (`gpu-vm-bare-plugin`, built with the bench), only the health reaction
//! after idle spells of 0, 1, 5, 20 and 100 ms, of sandbox-dp and of that bare plugin (a
//! process that sends a prebuilt list when inotify reports the same file removed or created):
//! what waking an idle process costs, whatever it does once awake.
//!
//! Each change follows a quiet spell of 100 ms (no debounce of an earlier event running). Each
//! figure: median (min–max) over the runs. Timings only; nothing is asserted.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a measuring tool: a failed step should stop it

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testkit::kubelet::FakeKubelet;
use testkit::kubelet::api::Device;

const WAIT: Duration = Duration::from_secs(30);
/// A quiet spell before each change, so that no earlier event's debounce is still running.
const QUIET: Duration = Duration::from_millis(100);

struct Args {
    dp: PathBuf,
    pci_ids: Option<PathBuf>,
    runs: usize,
    /// Only the registration figure, on this host root (a node-sim mount).
    root: Option<PathBuf>,
    /// Only the health reaction after idle spells, beside this bare plugin.
    bare: Option<PathBuf>,
}

fn args() -> Args {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        dp: PathBuf::new(),
        pci_ids: None,
        runs: 20,
        root: None,
        bare: None,
    };
    while let Some(x) = it.next() {
        match x.as_str() {
            "--pci-ids" => a.pci_ids = it.next().map(PathBuf::from),
            "--runs" => a.runs = it.next().and_then(|n| n.parse().ok()).expect("--runs N"),
            "--root" => a.root = it.next().map(PathBuf::from),
            "--bare" => a.bare = it.next().map(PathBuf::from),
            _ => a.dp = PathBuf::from(x),
        }
    }
    assert!(
        a.dp.is_file(),
        "usage: measure SANDBOX_DP [--pci-ids FILE] [--runs N] [--root DIR | --bare BIN]"
    );
    a
}

/// A host root on tmpfs.
struct Tree {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Tree {
    fn new() -> Tree {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = tempfile::Builder::new()
            .prefix("dp-measure-")
            .tempdir_in(base)
            .unwrap();
        let root = dir.path().to_path_buf();
        for d in [
            "sys/bus/pci/devices",
            "sys/bus/pci/drivers/vfio-pci",
            "sys/bus/pci/drivers/nvidia",
            "sys/kernel/iommu_groups",
            "dev/vfio",
            "kubelet",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::write(root.join("dev/vfio/vfio"), "").unwrap();
        Tree { _dir: dir, root }
    }

    /// A function under root port `port`; returns its directory.
    fn func(&self, port: &str, bdf: &str, device: u16, driver: &str, group: u32) -> PathBuf {
        let dir = self
            .root
            .join("sys/devices/pci0000:00")
            .join(port)
            .join(bdf);
        std::fs::create_dir_all(&dir).unwrap();
        for (f, v) in [
            ("vendor", "0x10de".to_string()),
            ("device", format!("0x{device:04x}")),
            ("class", "0x030200".to_string()),
            ("numa_node", "0".to_string()),
            ("driver_override", "(null)".to_string()),
        ] {
            std::fs::write(dir.join(f), v + "\n").unwrap();
        }
        symlink(
            self.root.join("sys/bus/pci/drivers").join(driver),
            dir.join("driver"),
        )
        .unwrap();
        let g = self.root.join(format!("sys/kernel/iommu_groups/{group}"));
        std::fs::create_dir_all(&g).unwrap();
        symlink(&g, dir.join("iommu_group")).unwrap();
        symlink(&dir, self.root.join("sys/bus/pci/devices").join(bdf)).unwrap();
        std::fs::write(self.root.join(format!("dev/vfio/{group}")), "").unwrap();
        dir
    }

    fn kubelet_dir(&self) -> PathBuf {
        self.root.join("kubelet")
    }
}

fn a10s(n: u32) -> Tree {
    let t = Tree::new();
    for i in 0..n {
        let bus = 0x10 + i;
        t.func(
            &format!("0000:00:{:02x}.0", i + 1),
            &format!("0000:{bus:02x}:00.0"),
            0x2236,
            "vfio-pci",
            100 + i,
        );
    }
    t
}

/// 16 L40S on nvidia, each with 32 VFs holding an NVIDIA L40S-1Q vGPU (type 1147).
fn l40s_vgpus() -> (Tree, Vec<(String, u32)>) {
    let t = Tree::new();
    let mut vfs = Vec::new();
    for i in 0..16u32 {
        let bus = 0x10 + i;
        let port = format!("0000:00:{:02x}.0", i + 1);
        let pf = t.func(
            &port,
            &format!("0000:{bus:02x}:00.0"),
            0x26b9,
            "nvidia",
            100 + i,
        );
        std::fs::remove_file(t.root.join(format!("dev/vfio/{}", 100 + i))).unwrap();
        std::fs::write(pf.join("sriov_totalvfs"), "32\n").unwrap();
        std::fs::write(pf.join("sriov_numvfs"), "32\n").unwrap();
        for n in 0..32u32 {
            // VF n: 00.4–00.7, then 01.0 onwards.
            let bdf = if n < 4 {
                format!("0000:{bus:02x}:00.{}", n + 4)
            } else {
                let k = n - 4;
                format!("0000:{bus:02x}:{:02x}.{}", 1 + k / 8, k % 8)
            };
            let group = 1000 + i * 32 + n;
            let vf = t.func(&port, &bdf, 0x26b9, "nvidia", group);
            symlink(&pf, vf.join("physfn")).unwrap();
            symlink(&vf, pf.join(format!("virtfn{n}"))).unwrap();
            std::fs::create_dir_all(vf.join("nvidia")).unwrap();
            std::fs::write(vf.join("nvidia/current_vgpu_type"), "1147\n").unwrap();
            std::fs::write(
                vf.join("nvidia/creatable_vgpu_types"),
                if n == 0 {
                    "ID    : vGPU Name\n1147  : NVIDIA L40S-1Q\n"
                } else {
                    "ID    : vGPU Name\n"
                },
            )
            .unwrap();
            vfs.push((bdf, group));
        }
    }
    (t, vfs)
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(a: &Args, t: &Tree) -> Daemon {
    start_on(a, &t.root, &t.kubelet_dir())
}

fn start_on(a: &Args, root: &Path, kubelet_dir: &Path) -> Daemon {
    let mut c = Command::new(&a.dp);
    c.arg("--host-root")
        .arg(root)
        .arg("--kubelet-dir")
        .arg(kubelet_dir)
        .args(["--resync-interval", "1h"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    if let Some(p) = &a.pci_ids {
        c.arg("--pci-ids").arg(p);
    }
    Daemon(c.spawn().unwrap())
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn summary(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{name}: {:.3} ms ({:.3}–{:.3}), {} runs",
        ms(v[v.len() / 2]),
        ms(v[0]),
        ms(v[v.len() - 1]),
        v.len()
    );
}

fn healthy(l: &[Device], id: &str) -> Option<bool> {
    l.iter().find(|d| d.id == id).map(|d| d.health == "Healthy")
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = args();
    println!(
        "sandbox-dp {} {}",
        a.dp.display(),
        a.pci_ids
            .as_ref()
            .map(|p| format!("--pci-ids {}", p.display()))
            .unwrap_or_else(|| "(embedded names)".into())
    );

    if let Some(root) = &a.root {
        let kdir = root.join("var/lib/kubelet/device-plugins");
        let mut reg = Vec::new();
        for _ in 0..a.runs {
            let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
            let start_at = Instant::now();
            let d = start_on(&a, root, &kdir);
            kubelet.next_registration(WAIT).await.unwrap();
            reg.push(start_at.elapsed());
            drop(d);
            kubelet.stop().await;
        }
        summary(&format!("{} start → registered", root.display()), reg);
        return;
    }

    if let Some(bare) = &a.bare {
        idle(&a, bare).await;
        return;
    }

    // register + RSS
    let t = a10s(8);
    let mut reg = Vec::new();
    let mut rss = Vec::new();
    for _ in 0..a.runs {
        let mut kubelet = FakeKubelet::start(&t.kubelet_dir()).await.unwrap();
        let start_at = Instant::now();
        let d = start(&a, &t);
        let r = kubelet.next_registration(WAIT).await.unwrap();
        reg.push(start_at.elapsed());
        let mut p = kubelet.plugin(&r.endpoint).await.unwrap();
        p.list_and_watch().await.unwrap().next(WAIT).await.unwrap();
        rss.push(rss_kib(d.0.id()));
        drop(d);
        kubelet.stop().await;
    }
    summary("8xA10 start → registered", reg);
    rss.sort();
    println!(
        "8xA10 RSS after the first list: {} KiB (median)",
        rss[rss.len() / 2]
    );

    // health reaction
    let mut kubelet = FakeKubelet::start(&t.kubelet_dir()).await.unwrap();
    let _d = start(&a, &t);
    let r = kubelet.next_registration(WAIT).await.unwrap();
    let mut p = kubelet.plugin(&r.endpoint).await.unwrap();
    let mut lw = p.list_and_watch().await.unwrap();
    lw.next(WAIT).await.unwrap();
    let node = t.root.join("dev/vfio/103");
    let (down, up) = reactions(&mut lw, &node, "0000:13:00.0", QUIET, a.runs).await;
    summary("8xA10 /dev/vfio/<g> removed → Unhealthy", down);
    summary("8xA10 /dev/vfio/<g> back → Healthy", up);
    drop(_d);
    kubelet.stop().await;

    // 512 vGPU VFs: one removed
    if !nix::unistd::geteuid().is_root() {
        println!("512 vGPU VFs: skipped (sending a uevent needs root)");
        return;
    }
    let (t, vfs) = l40s_vgpus();
    let mut kubelet = FakeKubelet::start(&t.kubelet_dir()).await.unwrap();
    let start_at = Instant::now();
    let _d = start(&a, &t);
    let r = kubelet.next_registration(WAIT).await.unwrap();
    println!(
        "16xL40S 512 vGPU VFs start → registered: {:.1} ms (one run)",
        start_at.elapsed().as_secs_f64() * 1e3
    );
    let mut p = kubelet.plugin(&r.endpoint).await.unwrap();
    let mut lw = p.list_and_watch().await.unwrap();
    let n = lw.next(WAIT).await.unwrap().len();
    assert_eq!(n, 512, "{}", r.resource_name);
    let (mut gone, mut back) = (Vec::new(), Vec::new());
    for i in 0..a.runs {
        let (bdf, group) = &vfs[(i * 37) % vfs.len()];
        let dir = t.root.join("sys/bus/pci/devices").join(bdf);
        let devpath = format!("/devices/pci0000:00/x/{bdf}");
        tokio::time::sleep(QUIET).await;
        let s = Instant::now();
        std::fs::write(dir.join("nvidia/current_vgpu_type"), "0\n").unwrap();
        std::fs::remove_file(t.root.join(format!("dev/vfio/{group}"))).unwrap();
        testkit::uevent::send("change", &devpath, "pci").unwrap();
        lw.wait_until(WAIT, |l| l.len() == n - 1).await.unwrap();
        gone.push(s.elapsed());
        tokio::time::sleep(QUIET).await;
        let s = Instant::now();
        std::fs::write(dir.join("nvidia/current_vgpu_type"), "1147\n").unwrap();
        std::fs::write(t.root.join(format!("dev/vfio/{group}")), "").unwrap();
        testkit::uevent::send("change", &devpath, "pci").unwrap();
        lw.wait_until(WAIT, |l| {
            l.len() == n && l.iter().all(|d| d.health == "Healthy")
        })
        .await
        .unwrap();
        back.push(s.elapsed());
    }
    summary(
        "16xL40S 512 vGPU VFs: one VF's vGPU removed → gone from the list",
        gone,
    );
    summary("16xL40S 512 vGPU VFs: set again → back, Healthy", back);
}

/// `/dev/vfio/<group>` removed → Unhealthy and back → Healthy on `lw` after each idle spell.
async fn reactions(
    lw: &mut testkit::kubelet::ListWatch,
    node: &Path,
    id: &str,
    idle: Duration,
    runs: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut down, mut up) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        tokio::time::sleep(idle).await;
        let s = Instant::now();
        std::fs::remove_file(node).unwrap();
        lw.wait_until(WAIT, |l| healthy(l, id) == Some(false))
            .await
            .unwrap();
        down.push(s.elapsed());
        tokio::time::sleep(idle).await;
        let s = Instant::now();
        std::fs::write(node, "").unwrap();
        lw.wait_until(WAIT, |l| healthy(l, id) == Some(true))
            .await
            .unwrap();
        up.push(s.elapsed());
    }
    (down, up)
}

/// The health reaction of sandbox-dp and of the bare plugin `bare` after idle spells, on 8
/// A10s (a list of 8 devices for both).
async fn idle(a: &Args, bare: &Path) {
    let t = a10s(8);
    let node = t.root.join("dev/vfio/103");
    let mut kubelet = FakeKubelet::start(&t.kubelet_dir()).await.unwrap();
    let _d = start(a, &t);
    let r = kubelet.next_registration(WAIT).await.unwrap();
    let mut p = kubelet.plugin(&r.endpoint).await.unwrap();
    let mut dp = p.list_and_watch().await.unwrap();
    dp.next(WAIT).await.unwrap();
    // The bare plugin's own file, in a directory sandbox-dp does not watch: neither process
    // wakes for the other's changes.
    let bare_node = t.root.join("bare/103");
    std::fs::create_dir_all(t.root.join("bare")).unwrap();
    std::fs::write(&bare_node, "").unwrap();
    let sock = t.root.join("bare/plugin.sock");
    let _b = Daemon(
        Command::new(bare)
            .arg("--socket")
            .arg(&sock)
            .arg("--watch")
            .arg(&bare_node)
            .args(["--devices", "8"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let until = Instant::now() + WAIT;
    while !sock.exists() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut bp = testkit::kubelet::PluginClient::connect(&sock)
        .await
        .unwrap();
    let mut bl = bp.list_and_watch().await.unwrap();
    let bare_id = bl.next(WAIT).await.unwrap()[0].id.clone();
    println!(
        "| idle before the change | sandbox-dp removed → Unhealthy | bare plugin | sandbox-dp back → Healthy | bare plugin |"
    );
    println!("|---|---|---|---|---|");
    let ms = |v: &mut Vec<Duration>| {
        v.sort();
        format!("{:.3} ms", v[v.len() / 2].as_secs_f64() * 1e3)
    };
    for gap in [0u64, 1, 5, 20, 100] {
        let gap_d = Duration::from_millis(gap);
        let (mut dd, mut du) = (Vec::new(), Vec::new());
        let (mut bd, mut bu) = (Vec::new(), Vec::new());
        for _ in 0..a.runs {
            let (d, u) = reactions(&mut dp, &node, "0000:13:00.0", gap_d, 1).await;
            dd.extend(d);
            du.extend(u);
            let (d, u) = reactions(&mut bl, &bare_node, &bare_id, gap_d, 1).await;
            bd.extend(d);
            bu.extend(u);
        }
        println!(
            "| {gap} ms | {} | {} | {} | {} |",
            ms(&mut dd),
            ms(&mut bd),
            ms(&mut du),
            ms(&mut bu)
        );
    }
}
