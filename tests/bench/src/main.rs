//! `gpu-vm-bench`: the daemons measured as processes on node-sim, as a node runs them: what a
//! user waits for (a bind, an apply, a registration, an Allocate, a vGPU made or removed, a
//! claim prepared) and what each daemon holds in memory.
//!
//! Run it from a release build, so that the daemons beside it are the release builds:
//!
//! ```sh
//! cargo build --release --bins && target/release/gpu-vm-bench --out BENCHMARKS.md
//! ```
//!
//! `--only scheduler` measures instead what sandbox-dra's published pool costs a real
//! kube-scheduler and kube-apiserver (the cluster tier's assets, `tests/cluster/prepare.sh`);
//! it is not part of the default run and has its own place in BENCHMARKS.md. `--only dra-api`
//! likewise measures sandbox-dra's requests to a real kube-apiserver, and what they cost it.
//!
//! It needs root and /dev/fuse (node-sim). Every figure is the median of `--runs` runs with
//! min–max beside it, or p50 and p99 over every call of every run; each run gets a freshly
//! mounted node.

mod harness;
mod sections;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};
use clap::Parser;
use harness::bins::Bins;
use harness::report::{Report, write_out};

/// The report's sections, in order (`--only` takes these names).
const SECTIONS: [&str; 5] = ["vfio", "vgpu", "dp", "on-demand", "dra"];

/// Sections run only when `--only` names them, each reported between markers of its own.
const OPT_IN: [&str; 2] = ["scheduler", "dra-api"];

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
    /// scheduler: how many Nodes carry the copied slices (repeatable; default 1 and 100).
    #[arg(long, value_name = "N", value_parser = at_least_one())]
    pub sched_nodes: Vec<usize>,
    /// scheduler: run on the newest Kubernetes release the cluster tier prepared
    /// (K8S_NEWEST_VERSION in target/cluster-tier/assets.env) instead of the tier's own.
    #[arg(long)]
    pub sched_newest: bool,
    /// scheduler: the published pools measured, by letter (default all): a passthrough only,
    /// b `--vgpu all`, c `--vgpu-types A10-4Q,A10-8Q`, d `--vgpu all` with claims naming the
    /// type's own DeviceClass, e and f b and c with `--pool-per-gpu` (a pool per GPU).
    #[arg(long, value_name = "POOL", value_delimiter = ',',
          value_parser = clap::builder::PossibleValuesParser::new(["a", "b", "c", "d", "e", "f"]))]
    pub sched_pools: Vec<String>,
    /// scheduler: pods placed one after another per node count and published pool.
    #[arg(long, default_value_t = 50, value_parser = at_least_one())]
    pub sched_pods: usize,
    /// dra-api: seconds one driver is measured at rest, and again under a hot-plug a minute.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub api_window_secs: u64,
    /// dra-api: how many drivers run together against the API server (repeatable; default 1,
    /// 50 and 200).
    #[arg(long, value_name = "N", value_parser = at_least_one())]
    pub api_drivers: Vec<usize>,
    /// dra-api: seconds N drivers are measured at rest.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub api_scale_secs: u64,
    /// dra-api: hot-plugs into the first tree per driver count.
    #[arg(long, default_value_t = 5, value_parser = at_least_one())]
    pub api_hotplugs: usize,
    /// Also write the report to this file (BENCHMARKS.md: between its begin and end markers).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Only these sections: vfio, vgpu, dp, on-demand, dra (repeatable; default all), or
    /// scheduler (the cluster tier's kube-scheduler and kube-apiserver) or dra-api (sandbox-dra's
    /// requests and their cost to a kube-apiserver), never by default.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(SECTIONS.iter().chain(&OPT_IN)))]
    pub only: Vec<String>,
}

/// A count of runs: 1 or more (a median of none is no figure).
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

/// Runs one section. A new section is a module under `sections/`, its name in [`SECTIONS`]
/// and its line here; it writes its own heading, text and tables into the report.
async fn section(name: &str, cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    match name {
        "vfio" => sections::vfio::bench(cli, b, r),
        "vgpu" => sections::vgpu::bench(cli, b, r),
        "dp" => sections::dp::bench(cli, b, r).await,
        "on-demand" => sections::ondemand::bench(cli, b, r).await,
        "dra" => sections::dra::bench(cli, b, r).await,
        "scheduler" => sections::scheduler::bench(cli, b, r),
        "dra-api" => sections::apiload::bench(cli, b, r),
        other => bail!("no section {other}"),
    }
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

/// The 1-minute load average: how busy the machine was around the figures.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
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
    let b = harness::bins::bins();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let chosen = |name: &str| cli.only.iter().any(|o| o == name);
    let mut runs: Vec<(&str, Vec<&str>)> = Vec::new();
    if cli.only.is_empty() || SECTIONS.iter().any(|s| chosen(s)) {
        b.check()?;
        let names = SECTIONS
            .into_iter()
            .filter(|s| cli.only.is_empty() || chosen(s))
            .collect();
        runs.push((harness::report::MAIN, names));
    }
    for name in OPT_IN.into_iter().filter(|s| chosen(s)) {
        runs.push((name, vec![name]));
    }
    for (markers, names) in runs {
        let mut r = Report::default();
        let start_load = load();
        let runs = match markers {
            harness::report::MAIN => format!(" Runs per figure: {} (median, min–max).", cli.runs),
            _ => String::new(),
        };
        r.line(format!(
            "Machine: {}. Commit: {}.{runs}",
            machine(),
            commit()
        ));
        r.line("");
        for name in names {
            rt.block_on(section(name, &cli, &b, &mut r))?;
        }
        r.memory_table();
        r.line(format!(
            "Load average (1 min) at the start: {start_load}; at the end: {}.",
            load()
        ));
        r.line("");
        if let Some(out) = &cli.out {
            write_out(out, markers, r.text())?;
        }
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
        let e = Cli::try_parse_from(["gpu-vm-bench", "--runs", "0"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("0 is not in 1.."), "{e}");
        let cli = Cli::try_parse_from(["gpu-vm-bench", "--only", "dp", "--only", "dra"]).unwrap();
        assert_eq!((cli.runs, cli.only.len()), (5, 2));
        assert!(Cli::try_parse_from(["gpu-vm-bench", "--only", "plain"]).is_err());
        let cli = Cli::try_parse_from(["gpu-vm-bench", "--only", "scheduler"]).unwrap();
        assert_eq!((cli.sched_nodes.len(), cli.sched_pods), (0, 50));
        assert!(cli.sched_pools.is_empty());
        let cli = Cli::try_parse_from(["gpu-vm-bench", "--sched-pools", "a,d"]).unwrap();
        assert_eq!(cli.sched_pools, ["a", "d"]);
        assert!(Cli::try_parse_from(["gpu-vm-bench", "--sched-pools", "g"]).is_err());
        let cli = Cli::try_parse_from(["gpu-vm-bench", "--only", "dra-api"]).unwrap();
        assert_eq!((cli.api_window_secs, cli.api_scale_secs), (600, 120));
    }
}
