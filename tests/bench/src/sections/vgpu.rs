//! vgpu-device-manager: `apply` against the floor, no-op apply, `assert`, a profile switch, and
//! the daemon's label change → success.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::Cli;
use crate::harness::bins::Bins;
use crate::harness::floor::{replay, writes};
use crate::harness::process::{Finished, ok, run};
use crate::harness::procstat;
use crate::harness::report::{Report, mib, need, ratio};
use crate::harness::stats::{fmt_summary, summarize};
use crate::harness::topology::{builtin, generated, mount};

const VGPU_CONFIG: &str = r#"version: v1
vgpu-configs:
  A10-4Q:
    - devices: all
      vgpu-devices: {"A10-4Q": 6}
  A10-8Q:
    - devices: all
      vgpu-devices: {"A10-8Q": 3}
  A100DX-4C:
    - devices: all
      vgpu-devices: {"A100DX-4C": 20}
  A100DX-8C:
    - devices: all
      vgpu-devices: {"A100DX-8C": 10}
  L40S-1Q:
    - devices: all
      vgpu-devices: {"L40S-1Q": 32}
  L40S-2Q:
    - devices: all
      vgpu-devices: {"L40S-2Q": 24}
  L40S-3Q:
    - devices: all
      vgpu-devices: {"L40S-3Q": 16}
  L40S-6Q:
    - devices: all
      vgpu-devices: {"L40S-6Q": 8}
  L40S-12Q:
    - devices: all
      vgpu-devices: {"L40S-12Q": 4}
  L40S-48Q:
    - devices: all
      vgpu-devices: {"L40S-48Q": 1}
"#;

/// The vGPU config every section uses, written to a temporary directory (removed when the
/// guard is dropped).
pub fn config_file() -> Result<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("vgpu-config.yaml");
    std::fs::write(&cfg, VGPU_CONFIG)?;
    Ok((dir, cfg))
}

/// Runs `vgpu-device-manager SUB -f CFG -c PROFILE --host-root ROOT`.
pub fn vgpu(b: &Bins, root: &Path, cfg: &Path, sub: &str, profile: &str) -> Result<Finished> {
    run(Command::new(&b.vgpu)
        .arg(sub)
        .arg("-f")
        .arg(cfg)
        .args(["-c", profile, "--host-root"])
        .arg(root))
}

pub fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let (_dir, cfg) = config_file()?;
    r.line("## vgpu-device-manager");
    r.line("");
    r.line("`apply` from an empty node (VFs enabled by the run where needed), `apply` again (no-op), `assert` on the configured node, and a switch to another profile. Floor: the apply's successful writes replayed by a bare loop on a fresh node. Goals: assert ≤ 10 ms, peak RSS ≤ 8 MB, apply ≤ 1.2× floor.");
    r.line("");
    r.table(&[
        "topology → profile",
        "vGPUs",
        "writes",
        "apply",
        "floor",
        "apply / floor",
        "no-op apply",
        "assert",
        "switch → profile",
        "peak RSS",
    ]);
    let cases = [
        (builtin("2xA10")?, "A10-4Q", "A10-8Q"),
        (builtin("8xA100")?, "A100DX-4C", "A100DX-8C"),
        (generated("L40S", 16)?, "L40S-1Q", "L40S-2Q"),
    ];
    for (t, p1, p2) in &cases {
        let (mut applies, mut floors, mut noops, mut asserts, mut switches) =
            (vec![], vec![], vec![], vec![], vec![]);
        let (mut rss, mut anon, mut nwrites, mut vgpus) = (0, 0, 0, 0);
        for _ in 0..cli.runs {
            let sim = mount(t);
            let f = ok(vgpu(b, sim.root(), &cfg, "apply", p1)?, "apply")?;
            applies.push(f.wall);
            rss = rss.max(f.max_rss_kib);
            anon = anon.max(f.max_anon_kib);
            let ops = writes(&sim.ops());
            nwrites = ops.len();
            let inv = common::Inventory::read_with(
                &common::HostPaths::new(sim.root()),
                &common::ReadOptions {
                    mdev_types: false,
                    vf_identity: true,
                },
            )?;
            vgpus = inv.mdevs.len()
                + inv
                    .devices
                    .values()
                    .filter(|d| d.nvidia_vgpu.as_ref().is_some_and(|v| v.current != 0))
                    .count();
            let fresh = mount(t);
            floors.push(replay(fresh.root(), &ops)?);
            sim.clear_ops();
            let f = ok(vgpu(b, sim.root(), &cfg, "apply", p1)?, "no-op apply")?;
            noops.push(f.wall);
            rss = rss.max(f.max_rss_kib);
            anon = anon.max(f.max_anon_kib);
            if !writes(&sim.ops()).is_empty() {
                bail!("{}: the no-op apply wrote to sysfs", t.name);
            }
            let f = ok(vgpu(b, sim.root(), &cfg, "assert", p1)?, "assert")?;
            asserts.push(f.wall);
            rss = rss.max(f.max_rss_kib);
            anon = anon.max(f.max_anon_kib);
            let f = ok(vgpu(b, sim.root(), &cfg, "apply", p2)?, "switch")?;
            switches.push(f.wall);
            rss = rss.max(f.max_rss_kib);
            anon = anon.max(f.max_anon_kib);
        }
        let a = need(summarize(&applies))?;
        let fl = need(summarize(&floors))?;
        r.row(&[
            format!("{} → {p1}", t.name),
            vgpus.to_string(),
            nwrites.to_string(),
            fmt_summary(&a),
            fmt_summary(&fl),
            ratio(a.median, fl.median),
            fmt_summary(&need(summarize(&noops))?),
            fmt_summary(&need(summarize(&asserts))?),
            format!("{} → {p2}", fmt_summary(&need(summarize(&switches))?)),
            mib(rss),
        ]);
        r.memory(
            "vgpu-device-manager",
            "peak of apply, apply again, assert, switch",
            &format!("{} → {p1}", t.name),
            rss,
            anon,
        );
    }
    r.line("");
    bench_daemon(cli, b, &cfg, r)?;
    Ok(())
}

/// The daemon: node label changed through the fake API server → `nvidia.com/vgpu.config.state`
/// back at `success`.
fn bench_daemon(cli: &Cli, b: &Bins, cfg: &Path, r: &mut Report) -> Result<()> {
    const STATE: &str = "nvidia.com/vgpu.config.state";
    let t = builtin("2xA10")?;
    let sim = mount(&t);
    let api = testkit::apiserver::FakeApiServer::start(
        "bench-node",
        &[("nvidia.com/vgpu.config", "A10-4Q")],
    )?;
    let mut d = Command::new(&b.vgpu)
        .args(["daemon", "--node-name", "bench-node", "--kubeconfig"])
        .arg(api.kubeconfig())
        .arg("-f")
        .arg(cfg)
        .arg("--host-root")
        .arg(sim.root())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting vgpu-device-manager daemon")?;
    let result = (|| -> Result<(Vec<Duration>, procstat::ProcSample)> {
        if !api.wait_for(STATE, Duration::from_secs(60), |v| v == Some("success")) {
            bail!("the daemon never reported success for A10-4Q");
        }
        let mut times = Vec::new();
        for i in 0..cli.runs.max(2) * 2 {
            let profile = if i % 2 == 0 { "A10-8Q" } else { "A10-4Q" };
            api.clear_history();
            let start = Instant::now();
            api.set_label("nvidia.com/vgpu.config", Some(profile));
            while api.label_history(STATE).last() != Some(&Some("success".into())) {
                if start.elapsed() > Duration::from_secs(60) {
                    bail!("no success after relabelling to {profile}");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            times.push(start.elapsed());
        }
        let mem = procstat::sample(d.id()).unwrap_or_default();
        Ok((times, mem))
    })();
    testkit::sigterm_and_wait(&mut d);
    let (times, mem) = result?;
    let s = need(summarize(&times))?;
    r.line("Daemon: node label `nvidia.com/vgpu.config` switched A10-4Q ⇄ A10-8Q on 2xA10 through the fake API server, until `nvidia.com/vgpu.config.state` is `success` again (includes the apply itself). Goal: ≤ 50 ms.");
    r.line("");
    r.table(&["label change → success", "daemon peak RSS"]);
    r.row(&[fmt_summary(&s), mib(mem.hwm_kib)]);
    r.memory(
        "vgpu-device-manager",
        "daemon: peak after the label switches",
        "2xA10",
        mem.hwm_kib,
        mem.anon_kib,
    );
    r.line("");
    Ok(())
}
