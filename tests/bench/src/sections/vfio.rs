//! vfio-manager: `bind` of every GPU, the same bind on a bound node (nothing to do), `unbind`
//! giving them back, and binds in parallel under a slow unbind.

use std::process::Command;

use anyhow::{Result, anyhow};

use crate::Cli;
use crate::harness::bins::Bins;
use crate::harness::process::{ok, run};
use crate::harness::report::{Report, mib, need, ratio};
use crate::harness::stats::{fmt_duration, fmt_summary, summarize};
use crate::harness::topology::{builtin, generated, gpu_count, mount};

/// `vfio-manager SUB --host-root ROOT [ARGS]`.
fn vfio(b: &Bins, sub: &str, root: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new(&b.vfio);
    c.arg(sub).arg("--host-root").arg(root).args(args);
    c
}

pub fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    r.line("## vfio-manager");
    r.line("");
    r.line("`bind` of every GPU (and its group companions) from nvidia to vfio-pci on a fresh node, as the unit does at boot; `bind` again on the bound node (nothing to do: a restart); `unbind`, every GPU back on nvidia. Wall time of the command, process start included.");
    r.line("");
    r.table(&[
        "topology",
        "GPUs",
        "bind",
        "bind again",
        "unbind",
        "peak RSS",
    ]);
    let topos = [builtin("2xA10")?, builtin("8xA100")?, generated("A10", 16)?];
    for t in &topos {
        let (mut binds, mut again, mut unbinds, mut rss, mut anon) = (vec![], vec![], vec![], 0, 0);
        for _ in 0..cli.runs {
            let sim = mount(t);
            for (what, sub, samples) in [
                ("bind", "bind", &mut binds),
                ("bind again", "bind", &mut again),
                ("unbind", "unbind", &mut unbinds),
            ] {
                let f = ok(run(&mut vfio(b, sub, sim.root(), &[]))?, what)?;
                samples.push(f.wall);
                rss = rss.max(f.max_rss_kib);
                anon = anon.max(f.max_anon_kib);
            }
        }
        r.row(&[
            t.name.clone(),
            gpu_count(t).to_string(),
            fmt_summary(&need(summarize(&binds))?),
            fmt_summary(&need(summarize(&again))?),
            fmt_summary(&need(summarize(&unbinds))?),
            mib(rss),
        ]);
        r.memory(
            "vfio-manager",
            "peak of bind, bind again, unbind",
            &t.name,
            rss,
            anon,
        );
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
                run(&mut vfio(b, "bind", sim.root(), &["--address", &first]))?,
                "bind one",
            )?;
            ones.push(f.wall);
            let sim = mount(&t);
            sim.control(&format!("fault unbind * delay={delay}"))?;
            let f = ok(run(&mut vfio(b, "bind", sim.root(), &[]))?, "bind all")?;
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
