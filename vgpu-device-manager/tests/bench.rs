//! Measurements for BENCHMARKS.md (ignored by default; run with
//! `cargo test --release -p vgpu-device-manager --test bench -- --ignored --nocapture`).
//!
//! Wall time (median of runs) and peak RSS of the process (`wait4`), against node-sim. The
//! floor for an apply is the bare sequence of the same sysfs writes, replayed on a fresh node
//! by this process.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Runs the binary under `/usr/bin/time` (so the peak RSS is the binary's own, not that of a
/// fork of this test process); returns wall time, peak RSS in KiB and the exit code.
fn measure(root: &std::path::Path, args: &[&str]) -> (Duration, i64, i32) {
    let out = tempfile::NamedTempFile::new().unwrap();
    let start = Instant::now();
    let status = Command::new("/usr/bin/time")
        .args(["-f", "%M", "-o"])
        .arg(out.path())
        .arg(BIN)
        .args(args)
        .arg("--host-root")
        .arg(root)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    let elapsed = start.elapsed();
    let rss = std::fs::read_to_string(out.path())
        .unwrap()
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or(-1);
    (elapsed, rss, status.code().unwrap_or(-1))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

const RUNS: usize = 5;

fn apply_from_empty(topology: &str, profile: &str, f: &str) -> String {
    let mut times = Vec::new();
    let mut floors = Vec::new();
    let mut rss = 0;
    let mut writes = 0;
    for _ in 0..RUNS {
        let sim = testkit::sim::try_mount(topology).unwrap();
        let (t, r, code) = measure(sim.root(), &["apply", "-f", f, "-c", profile]);
        assert_eq!(code, 0);
        times.push(t);
        rss = rss.max(r);
        let ops = sim.ops();
        writes = ops.len();
        // The floor: the same writes, in the same order, on a fresh node.
        let fresh = testkit::sim::try_mount(topology).unwrap();
        let start = Instant::now();
        for op in &ops {
            std::fs::write(fresh.root().join(&op.path), &op.value).unwrap();
        }
        floors.push(start.elapsed());
    }
    let (t, fl) = (median(times), median(floors));
    format!(
        "| apply {profile} from empty on {topology} ({writes} writes) | {} | {} | {:.2}× | {:.1} MiB |",
        ms(t),
        ms(fl),
        t.as_secs_f64() / fl.as_secs_f64(),
        rss as f64 / 1024.0
    )
}

#[test]
#[ignore = "benchmark"]
fn benchmarks() {
    if testkit::sim::unavailable().is_some() {
        eprintln!("skipped: node-sim needs root and /dev/fuse");
        return;
    }
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    let mut rows = vec![
        "| what | vgpu-device-manager | bare writes | ratio | peak RSS |".to_string(),
        "|---|---|---|---|---|".to_string(),
    ];
    rows.push(apply_from_empty("2xA10", "A10-4Q", f));
    rows.push(apply_from_empty("8xA100", "A100DX-4C", f));

    let sim = testkit::sim::try_mount("8xA100").unwrap();
    assert_eq!(
        measure(sim.root(), &["apply", "-f", f, "-c", "A100DX-4C"]).2,
        0
    );
    for cmd in ["assert", "apply"] {
        let mut times = Vec::new();
        let mut rss = 0;
        for _ in 0..RUNS {
            let (t, r, code) = measure(sim.root(), &[cmd, "-f", f, "-c", "A100DX-4C"]);
            assert_eq!(code, 0);
            times.push(t);
            rss = rss.max(r);
        }
        rows.push(format!(
            "| {cmd} on 8xA100 fully configured (160 vGPUs, no change) | {} | 0 writes | — | {:.1} MiB |",
            ms(median(times)),
            rss as f64 / 1024.0
        ));
    }
    assert!(
        sim.ops().len() == 8 + 160,
        "no-op runs wrote: {}",
        sim.ops().len()
    );

    // Daemon: label change to state=success through the fake API server.
    let sim = testkit::sim::try_mount("2xA10").unwrap();
    let api =
        testkit::apiserver::FakeApiServer::start("n", &[("nvidia.com/vgpu.config", "A10-4Q")])
            .unwrap();
    let mut d = Command::new(BIN)
        .args(["daemon", "--node-name", "n", "--kubeconfig"])
        .arg(api.kubeconfig())
        .args(["-f", f, "--host-root"])
        .arg(sim.root())
        .env("RUST_LOG", "warn")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let state = "nvidia.com/vgpu.config.state";
    assert!(api.wait_for(state, Duration::from_secs(60), |v| v == Some("success")));
    let mut times = Vec::new();
    for i in 0..RUNS {
        let profile = if i % 2 == 0 { "A10-8Q" } else { "A10-4Q" };
        api.clear_history();
        let start = Instant::now();
        api.set_label("nvidia.com/vgpu.config", Some(profile));
        while api.label_history(state).last() != Some(&Some("success".into())) {
            assert!(start.elapsed() < Duration::from_secs(60));
            std::thread::sleep(Duration::from_millis(2));
        }
        times.push(start.elapsed());
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.id())).unwrap_or_default();
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .unwrap_or("VmHWM: ?")
        .trim_start_matches("VmHWM:")
        .trim()
        .to_string();
    let _ = d.kill();
    let _ = d.wait();
    rows.push(format!(
        "| daemon: label change A10-4Q ⇄ A10-8Q on 2xA10 → state success (fake API) | {} | — | — | {hwm} |",
        ms(median(times))
    ));
    println!("{}", rows.join("\n"));
}
