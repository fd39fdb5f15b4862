//! `gpu-vm-bench`: the daemons measured as processes on node-sim, next to the floor (the
//! same sysfs writes replayed by a bare loop on a fresh copy of the same simulated node); their
//! read-only figures again on the plain tree (the simulated node copied onto tmpfs), next to the
//! limit (the same reads replayed by a bare loop); and node-sim's own cost.
//!
//! Run it from a release build so the daemons are release builds too, linked as they ship:
//!
//! ```sh
//! tools/build-release.sh --workspace --bins && target/shipped/gpu-vm-bench --out BENCHMARKS.md
//! ```
//!
//! It needs root and /dev/fuse (node-sim), and strace for the limits. Every figure is the median of `--runs` runs with
//! min–max beside it; each run gets a freshly mounted node.

mod harness;
mod sections;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};
use clap::Parser;
use harness::report::{Report, write_out};

/// The report's sections, in order.
const SECTIONS: [&str; 8] = [
    "vfio",
    "vgpu",
    "dp",
    "on-demand",
    "dra",
    "curve",
    "plain",
    "sim",
];

/// Benchmarks of vfio-manager, vgpu-device-manager, sandbox-dp and sandbox-dra on simulated
/// nodes.
#[derive(Parser, Debug)]
#[command(name = "gpu-vm-bench")]
pub struct Cli {
    /// Runs per figure (the median is reported, with min and max).
    #[arg(long, default_value_t = 5, value_parser = at_least_one())]
    pub runs: usize,
    /// Seconds sandbox-dp is left idle to measure its CPU use.
    #[arg(long, default_value_t = 60)]
    pub idle_secs: u64,
    /// Allocate calls per topology.
    #[arg(long, default_value_t = 1000)]
    pub allocations: usize,
    /// sandbox-dp --on-demand Allocate/release cycles per run and node.
    #[arg(long, default_value_t = 20)]
    pub on_demand_cycles: usize,
    /// sandbox-dra prepare/unprepare cycles per run.
    #[arg(long, default_value_t = 50)]
    pub claims: usize,
    /// Simulated unbind delay (ms) for the parallel-bind figure.
    #[arg(long, default_value_t = 300)]
    pub unbind_delay_ms: u64,
    /// Also write the report to this file (BENCHMARKS.md).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The host's pci.ids, for sandbox-dp's registration with it on the plain tree (Debian
    /// package `pci.ids`); the figure is skipped when the file is missing.
    #[arg(long, default_value = "/usr/share/misc/pci.ids")]
    pub pci_ids: PathBuf,
    /// Keep the strace logs the plain tree's limits are replayed from in this directory.
    #[arg(long, value_name = "DIR")]
    pub traces: Option<PathBuf>,
    /// Samples of each plain-tree figure: timed runs of each one-shot command, and sandbox-dp
    /// daemons started per node (with and without pci.ids each) [default: 5 × --runs for the
    /// commands, 3 × --runs for the daemon].
    #[arg(long, value_name = "N", value_parser = at_least_one())]
    pub plain_runs: Option<usize>,
    /// Only these sections: vfio, vgpu, dp, on-demand, dra, curve, plain, sim (repeatable;
    /// default all).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(SECTIONS))]
    pub only: Vec<String>,
}

/// A count of runs: 1 or more (a median of none is no figure).
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cores} × {cpu}, Linux {}", kernel.trim())
}

fn commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(why) = testkit::sim::unavailable() {
        bail!("gpu-vm-bench needs node-sim, which cannot run here: {why}");
    }
    let b = harness::bins::bins()?;
    // The binaries as a node runs them: read from disk, not in the pages the build wrote.
    for p in b.all() {
        harness::bins::evict(p)?;
    }
    let mut r = Report::default();
    let want = |s: &str| cli.only.is_empty() || cli.only.iter().any(|o| o == s);
    r.line(format!(
        "Machine: {}. Commit: {}. Runs per figure: {} (median, min–max).",
        machine(),
        commit(),
        cli.runs
    ));
    r.line("");
    if want("vfio") {
        sections::vfio::bench(&cli, &b, &mut r)?;
    }
    if want("vgpu") {
        sections::vgpu::bench(&cli, &b, &mut r)?;
    }
    if want("dp") || want("on-demand") || want("dra") || want("curve") || want("plain") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        if want("dp") {
            rt.block_on(sections::dp::bench(&cli, &b, &mut r))?;
        }
        if want("on-demand") {
            rt.block_on(sections::ondemand::bench(&cli, &b, &mut r))?;
        }
        if want("dra") {
            rt.block_on(sections::dra::bench(&cli, &b, &mut r))?;
        }
        if want("curve") {
            rt.block_on(sections::curve::bench(&cli, &b, &mut r))?;
        }
        if want("plain") {
            rt.block_on(sections::plain::bench(&cli, &b, &mut r))?;
        }
    }
    if want("sim") {
        sections::sim::bench(&cli, &b, &mut r)?;
    }
    if let Some(out) = &cli.out {
        write_out(out, r.text())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_of_runs_are_one_or_more() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        for args in [["--runs", "0"], ["--plain-runs", "0"]] {
            let e = Cli::try_parse_from(std::iter::once("gpu-vm-bench").chain(args))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("0 is not in 1.."), "{args:?}: {e}");
        }
        let cli = Cli::try_parse_from(["gpu-vm-bench", "--plain-runs", "2"]).unwrap();
        assert_eq!((cli.runs, cli.plain_runs), (5, Some(2)));
    }
}
