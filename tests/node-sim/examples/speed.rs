//! node-sim's own speed: what a read and a write cost, and whether a write's cost grows with
//! the node. A measurement, not a test (timings are never asserted): run it before and after a
//! change to the simulator and compare.
//!
//! ```sh
//! cargo run -p node-sim --example speed            # the test profile the suite uses
//! cargo run -p node-sim --example speed -- 20      # 20 rounds instead of 10
//! ```
//!
//! Needs root and /dev/fuse. Prints, for each figure, the median over the rounds:
//! - `read`: every readable attribute of every PCI function of 8xA100 with 20 VFs per GPU
//!   (168 functions), through `sys/bus/pci/devices/<BDF>/…`: `std::fs::read` (open, fstat, read
//!   to the end, close; wall and CPU of this process, reader and server) and open, one read of
//!   a page, close (what `common` does), µs per file; `stat` and `readlink driver` the same way;
//! - `write`: on generated nodes of 1, 4 and 16 A10s (32 VFs each, enabled first): creating and
//!   removing one A10-4Q mdev on the first GPU, and `sriov_numvfs` 0 → 32 → 0 on the first
//!   GPU: µs per write, and the ratio 16 GPUs / 1 GPU (1.0: a write's cost does not grow with
//!   the node).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// This process's CPU time (user + system, all threads: the reader and node-sim's server
/// alike). `/proc/<pid>/stat` counts in USER_HZ, which is 100 on Linux.
fn cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = after_comm
        .split(' ')
        .skip(11)
        .take(2)
        .map(|v| v.parse().unwrap())
        .collect();
    Duration::from_millis((f[0] + f[1]) * 10)
}

fn us(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e6 / n as f64
}

fn mount(topo: &node_sim::Topology) -> (node_sim::Sim, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix("node-sim-speed-")
        .tempdir()
        .unwrap();
    let sim = node_sim::mount(topo, dir.path()).unwrap();
    (sim, dir)
}

fn generated(n: usize) -> node_sim::Topology {
    let mut s = format!("name = \"{n}xA10\"\ndescription = \"generated\"\n");
    for i in 0..n {
        let bus = 0x10 + 2 * i;
        let _ = write!(
            s,
            "[[bridge]]\naddress = \"0000:{bus:02x}:01.0\"\n\n\
             [[device]]\naddress = \"0000:{:02x}:00.0\"\nmodel = \"A10\"\nbridge = \"0000:{bus:02x}:01.0\"\n\n",
            bus + 1
        );
    }
    node_sim::Topology::parse(&s, &format!("{n}xA10")).unwrap()
}

fn write(path: &Path, value: &str) {
    std::fs::write(path, value).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

fn gpus(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root.join("sys/bus/pci/devices"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|a| {
            std::fs::read_to_string(root.join(format!("sys/bus/pci/devices/{a}/class")))
                .is_ok_and(|c| c.starts_with("0x0302"))
                && !root
                    .join(format!("sys/bus/pci/devices/{a}/physfn"))
                    .exists()
        })
        .collect();
    v.sort();
    v
}

fn readable_files(dir: &Path, out: &mut Vec<PathBuf>, depth: usize) {
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        let md = std::fs::symlink_metadata(&p).unwrap();
        use std::os::unix::fs::PermissionsExt;
        if md.is_file() && md.permissions().mode() & 0o444 != 0 {
            out.push(p);
        } else if md.is_dir() && depth > 0 {
            readable_files(&p, out, depth - 1);
        }
    }
}

fn reads(rounds: usize) {
    let (sim, _dir) = mount(&node_sim::topology("8xA100").unwrap());
    let root = sim.root().to_path_buf();
    for g in gpus(&root) {
        write(
            &root.join(format!("sys/bus/pci/devices/{g}/sriov_numvfs")),
            "20",
        );
    }
    let mut devs: Vec<PathBuf> = std::fs::read_dir(root.join("sys/bus/pci/devices"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    devs.sort();
    let mut files = Vec::new();
    for d in &devs {
        // The device's attributes and its mdev types' (mdev_supported_types/<t>/<attr>).
        readable_files(d, &mut files, 2);
    }
    let mut per_read = Vec::new();
    let mut per_one = Vec::new();
    let mut per_stat = Vec::new();
    let mut per_link = Vec::new();
    let mut read_cpu = Duration::ZERO;
    for _ in 0..rounds {
        let c = cpu();
        let t = Instant::now();
        for f in &files {
            std::hint::black_box(std::fs::read(f).unwrap());
        }
        per_read.push(t.elapsed());
        read_cpu += cpu() - c;
        // open, one read of a page, close: what `common` does for each attribute.
        let t = Instant::now();
        let mut buf = [0u8; 4096];
        for f in &files {
            use std::io::Read;
            let n = std::fs::File::open(f).unwrap().read(&mut buf).unwrap();
            std::hint::black_box(n);
        }
        per_one.push(t.elapsed());
        let t = Instant::now();
        for f in &files {
            std::hint::black_box(std::fs::metadata(f).unwrap());
        }
        per_stat.push(t.elapsed());
        let t = Instant::now();
        for d in &devs {
            std::hint::black_box(std::fs::read_link(d.join("driver")).ok());
        }
        per_link.push(t.elapsed());
    }
    println!(
        "read   8xA100 + 160 VFs: {} files: fs::read {:.1} µs/file ({:.1} µs CPU), open+read+close {:.1} µs/file, stat {:.1} µs/file, readlink driver {:.1} µs/device",
        files.len(),
        us(median(per_read), files.len()),
        us(read_cpu, files.len() * rounds),
        us(median(per_one), files.len()),
        us(median(per_stat), files.len()),
        us(median(per_link), devs.len()),
    );
}

fn writes(rounds: usize) {
    let mut firsts = Vec::new();
    for n in [1, 4, 16] {
        let (sim, _dir) = mount(&generated(n));
        let root = sim.root().to_path_buf();
        let gpus = gpus(&root);
        let dev = |a: &str, f: &str| root.join(format!("sys/bus/pci/devices/{a}/{f}"));
        let mut enable = Vec::new();
        for g in &gpus {
            let t = Instant::now();
            write(&dev(g, "sriov_numvfs"), "32");
            enable.push(t.elapsed());
        }
        let vfs: Vec<String> = (0..6)
            .map(|i| {
                let l = std::fs::read_link(dev(&gpus[0], &format!("virtfn{i}"))).unwrap();
                l.file_name().unwrap().to_string_lossy().into_owned()
            })
            .collect();
        let mut create = Vec::new();
        let mut remove = Vec::new();
        for r in 0..rounds {
            let uuids: Vec<String> = (0..vfs.len())
                .map(|i| format!("5a3b2c1d-0000-4000-8000-{:06x}{:06x}", r, i))
                .collect();
            let t = Instant::now();
            for (vf, u) in vfs.iter().zip(&uuids) {
                write(
                    &dev(vf, "mdev_supported_types/nvidia-593/create"),
                    &format!("{u}\n"),
                );
            }
            create.push(t.elapsed());
            let t = Instant::now();
            for u in &uuids {
                write(
                    &root.join(format!("sys/bus/mdev/devices/{u}/remove")),
                    "1\n",
                );
            }
            remove.push(t.elapsed());
        }
        let mut toggle = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            write(&dev(&gpus[0], "sriov_numvfs"), "0");
            write(&dev(&gpus[0], "sriov_numvfs"), "32");
            toggle.push(t.elapsed());
        }
        let f = (
            us(median(create), vfs.len()),
            us(median(remove), vfs.len()),
            us(median(toggle), 2),
            us(median(enable), 1),
        );
        println!(
            "write  {n:>2}xA10 ({} functions): mdev create {:.0} µs, remove {:.0} µs, sriov_numvfs on one GPU {:.0} µs (first enables: {:.0} µs)",
            n * 33,
            f.0,
            f.1,
            f.2,
            f.3
        );
        firsts.push(f);
    }
    let (a, b) = (firsts[0], firsts[firsts.len() - 1]);
    println!(
        "growth 16 GPUs / 1 GPU: create ×{:.1}, remove ×{:.1}, sriov_numvfs ×{:.1}",
        b.0 / a.0,
        b.1 / a.1,
        b.2 / a.2
    );
}

fn main() {
    if let Some(why) = node_sim::unavailable() {
        eprintln!("node-sim cannot run here: {why} (needs root and /dev/fuse)");
        std::process::exit(2);
    }
    let rounds = std::env::args()
        .nth(1)
        .map(|r| r.parse().expect("rounds: a number"))
        .unwrap_or(10);
    reads(rounds);
    writes(rounds);
}
