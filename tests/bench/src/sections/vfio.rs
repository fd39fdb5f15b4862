//! vfio-manager: `bind` of every GPU against the floor, the no-op bind, and binds in parallel
//! under a slow unbind.

use std::process::Command;

use anyhow::{Result, anyhow};

use crate::Cli;
use crate::harness::bins::Bins;
use crate::harness::floor::{replay, writes};
use crate::harness::process::{ok, run};
use crate::harness::report::{Report, mib, need, ratio};
use crate::harness::stats::{fmt_duration, fmt_summary, summarize};
use crate::harness::topology::{builtin, generated, gpu_count, mount};

pub fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
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
