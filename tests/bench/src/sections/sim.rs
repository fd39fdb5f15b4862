//! node-sim's own cost, so that its speed-ups show from one run to the next: what one
//! attribute read costs (on node-sim, on its plain copy, and on this machine's sysfs), and how
//! `vgpu-device-manager apply` and node-sim's cost per write grow from 1 to 16 GPUs.

use std::fs::File;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};

use crate::Cli;
use crate::harness::bins::Bins;
use crate::harness::floor::{replay, writes};
use crate::harness::process::ok;
use crate::harness::report::{Report, need};
use crate::harness::stats::{
    fitted_exponent, fmt_duration, fmt_exponent, fmt_micros, growth_exponent, summarize,
};
use crate::harness::topology::{builtin, generated, mount};
use crate::harness::tree::PlainTree;
use crate::sections::vgpu::{config_file, vgpu};

/// Reads per figure of the per-read cost.
const READS: usize = 1000;

pub fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    r.line("## node-sim's own cost");
    r.line("");
    per_read(r)?;
    apply_growth(cli, b, r)
}

/// The median of `READS` reads of one attribute: opened by its full path, read, closed.
fn read_cost(path: &Path) -> Result<Duration> {
    let mut buf = [0u8; 4096];
    let mut samples = Vec::with_capacity(READS);
    for _ in 0..READS {
        let t = Instant::now();
        let mut f = File::open(path)?;
        let _ = f.read(&mut buf)?;
        drop(f);
        samples.push(t.elapsed());
    }
    Ok(need(summarize(&samples))?.median)
}

/// An attribute of this machine's own sysfs: the first PCI device's `vendor`.
fn host_attribute() -> Option<PathBuf> {
    let devices = common::HostPaths::new("/").pci_devices();
    let mut names: Vec<_> = std::fs::read_dir(devices)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|d| d.join("vendor"))
        .find(|v| v.is_file())
}

fn per_read(r: &mut Report) -> Result<()> {
    let t = builtin("2xA10")?;
    let sim = mount(&t);
    let gpu = t
        .devices
        .iter()
        .find(|d| d.vendor == 0x10de)
        .ok_or_else(|| anyhow!("2xA10 has no NVIDIA device"))?
        .address
        .clone();
    let rel = PathBuf::from(format!("sys/bus/pci/devices/{gpu}/vendor"));
    let on_sim = read_cost(&sim.root().join(&rel))?;
    let plain = PlainTree::copy_of(sim.root())?;
    let on_plain = read_cost(&plain.root().join(&rel))?;
    let host = host_attribute().map(|p| read_cost(&p).map(|d| (p, d)));
    r.line(format!("One attribute read: `open`, `read`, `close` of `{rel}` by its full path, median of {READS}.", rel = rel.display()));
    r.line("");
    r.table(&[
        "node-sim",
        "plain tree (tmpfs)",
        "this machine's sysfs",
        "node-sim / plain tree",
    ]);
    let host = match host {
        Some(Ok((p, d))) => format!("{} (`{}`)", fmt_micros(d), p.display()),
        Some(Err(e)) => format!("failed: {e}"),
        None => "– (no PCI device)".into(),
    };
    r.row(&[
        fmt_micros(on_sim),
        fmt_micros(on_plain),
        host,
        format!(
            "{:.0}×",
            on_sim.as_secs_f64() / on_plain.as_secs_f64().max(1e-9)
        ),
    ]);
    r.line("");
    Ok(())
}

/// `apply` A10-4Q on 1 to 16 A10s, its writes replayed on a fresh node (the floor), and the
/// floor per write: node-sim's cost of one write on a node of that size.
fn apply_growth(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let (_dir, cfg) = config_file()?;
    r.line("`vgpu-device-manager apply` A10-4Q from empty on n A10s (6 vGPUs each), its CPU, its writes replayed by a bare loop on a fresh node (the floor), and the floor per write: what node-sim charges for one write on a node of that size. Growth exponents: of the last doubling (ln(t₁₆/t₈) / ln 2) and fitted over 1 → 16 (least squares of ln t on ln n); 1 is linear.");
    r.line("");
    let names = ["apply", "its CPU", "floor", "node-sim per write"];
    let mut header = vec!["GPUs", "writes"];
    header.extend_from_slice(&names);
    r.table(&header);
    let mut points: Vec<(usize, [Duration; 4])> = Vec::new();
    for n in [1, 2, 4, 8, 16] {
        let t = generated("A10", n)?;
        let mut s: [Vec<Duration>; 4] = Default::default();
        let mut nwrites = 0;
        for _ in 0..cli.runs {
            let sim = mount(&t);
            let f = ok(vgpu(b, sim.root(), &cfg, "apply", "A10-4Q")?, "apply")?;
            let ops = writes(&sim.ops());
            nwrites = ops.len();
            let fresh = mount(&t);
            let floor = replay(fresh.root(), &ops)?;
            s[0].push(f.wall);
            s[1].push(f.cpu);
            s[2].push(floor);
            s[3].push(floor / nwrites.max(1) as u32);
        }
        let m = [
            need(summarize(&s[0]))?.median,
            need(summarize(&s[1]))?.median,
            need(summarize(&s[2]))?.median,
            need(summarize(&s[3]))?.median,
        ];
        let mut row = vec![n.to_string(), nwrites.to_string()];
        row.extend(m.iter().map(|d| fmt_duration(*d)));
        r.row(&row);
        points.push((n, m));
    }
    if let [.., (na, a), (nb, b)] = points.as_slice() {
        let mut row = vec![format!("exponent {na} → {nb}"), String::new()];
        row.extend((0..names.len()).map(|i| fmt_exponent(growth_exponent(a[i], b[i], *na, *nb))));
        r.row(&row);
    }
    let mut row = vec!["exponent fitted 1 → 16".to_string(), String::new()];
    row.extend((0..names.len()).map(|i| {
        let pts: Vec<(usize, Duration)> = points.iter().map(|(n, m)| (*n, m[i])).collect();
        fmt_exponent(fitted_exponent(&pts))
    }));
    r.row(&row);
    r.line("");
    Ok(())
}
