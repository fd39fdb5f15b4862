//! The cost curve: how each figure grows with the node (1 to 16 A10s; four L40S with 4 to 128
//! vGPUs).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Result, anyhow};

use crate::Cli;
use crate::harness::bins::Bins;
use crate::harness::process::{ok, run};
use crate::harness::report::{Report, need};
use crate::harness::stats::{fmt_duration, fmt_exponent, growth_exponent, summarize};
use crate::harness::topology::{generated, mount};
use crate::sections::dp::{DpCase, dp_once, prep_passthrough};
use crate::sections::vgpu::{config_file, vgpu};

/// One point of a curve: the medians of each figure at one size.
struct Point {
    n: usize,
    medians: Vec<Duration>,
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
                .map(|(x, y)| fmt_exponent(growth_exponent(*x, *y, a.n, b.n))),
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
pub async fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let (_dir, cfg) = config_file()?;
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
