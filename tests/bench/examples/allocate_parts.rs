//! The parts of an on-demand Allocate (and of a vGPU prepare), timed one by one on a fresh
//! node-sim node with the calls sandbox-dp makes, 60 vGPUs made and removed in turn: the read
//! of the GPU a placement no longer makes, placing from the kept view, the record replaced
//! twice (before the write and after it, as the lifecycle requires), the write itself, and the
//! vGPU read back until its group node is there. For BENCHMARKS.md's account of what an
//! Allocate costs beside its write; the bench itself times the whole call.
//!
//! ```sh
//! cargo build --release -p bench --example allocate_parts
//! target/release/examples/allocate_parts 2xA10 A10-4Q 0000:41:00.0
//! target/release/examples/allocate_parts 8xH100-sriov H100XM-8C 0000:13:00.0
//! ```

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use common::vgpu::lifecycle::{self, Member};
use common::{HostPaths, ReadOptions, Sysfs};

const CYCLES: usize = 60;

/// p50 and p99 of `v`.
fn pct(mut v: Vec<Duration>) -> String {
    v.sort();
    let at = |q: f64| {
        let i = ((v.len().saturating_sub(1)) as f64 * q).round() as usize;
        v.get(i).copied().unwrap_or_default()
    };
    format!("p50 {:>10.3?}  p99 {:>10.3?}", at(0.5), at(0.99))
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let topology = args.next().unwrap_or_else(|| "2xA10".into());
    let key = args.next().unwrap_or_else(|| "A10-4Q".into());
    let gpu: common::PciAddress = args
        .next()
        .unwrap_or_else(|| "0000:41:00.0".into())
        .parse()
        .map_err(|e| anyhow!("GPU address: {e}"))?;
    let t = node_sim::topology(&topology).map_err(|e| anyhow!("topology {topology}: {e}"))?;
    let sim = testkit::sim::mount_topology(&t);
    let root = sim.root().to_path_buf();
    let paths = HostPaths::new(&root);
    let sysfs = Sysfs::new(paths.clone());
    // sandbox-dp's reads of a member.
    let opts = ReadOptions {
        mdev_types: true,
        vf_identity: false,
    };
    let member = Member::Gpu(gpu);
    let offers = |inv: &common::Inventory| {
        lifecycle::offers(inv, &member).ok_or_else(|| anyhow!("{gpu} is not on {topology}"))
    };
    if let Some(n) = offers(&member.read(&paths, &opts)?)?.needs_vfs {
        sysfs.set_sriov_numvfs(&gpu, n)?;
        std::thread::sleep(Duration::from_millis(500));
    }
    let record = root.join("run/gpu-vm-node/allocate-parts.json");
    std::fs::create_dir_all(root.join("run/gpu-vm-node"))?;
    // About the size of the records file holding one vGPU.
    let body = vec![b' '; 700];
    let mut view = member.read(&paths, &opts)?;
    let mut parts: [Vec<Duration>; 6] = Default::default();
    for _ in 0..CYCLES {
        let s = Instant::now();
        member.read(&paths, &opts)?;
        parts[0].push(s.elapsed());

        let s = Instant::now();
        let o = offers(&view)?;
        let ty = o
            .find(|c| c.name.ends_with(&key))
            .ok_or_else(|| anyhow!("{gpu} offers no {key}"))?;
        let planned = o.place(ty).map_err(|e| anyhow!("{e}"))?;
        parts[1].push(s.elapsed());

        let s = Instant::now();
        common::state::write_atomic_until_reboot(&record, &body)?;
        common::state::write_atomic_until_reboot(&record, &body)?;
        parts[2].push(s.elapsed());

        let s = Instant::now();
        planned.create(&sysfs)?;
        parts[3].push(s.elapsed());

        let s = Instant::now();
        planned
            .handle
            .wait_ready(&mut view, &paths, &opts)
            .context("the vGPU never got its group node")?;
        parts[4].push(s.elapsed());

        let s = Instant::now();
        planned.handle.destroy(&sysfs)?;
        planned.handle.refresh(&mut view, &paths, &opts);
        parts[5].push(s.elapsed());
    }
    let names = [
        "read of the GPU (no longer on the path)",
        "placed from the kept view (CPU)",
        "record replaced twice",
        "the write (through Sysfs)",
        "vGPU read back until ready",
        "removed, and read back",
    ];
    println!("{topology}, {key} on {gpu}, {CYCLES} vGPUs:");
    for (name, v) in names.iter().zip(parts) {
        println!("  {name:<40} {}", pct(v));
    }
    Ok(())
}
