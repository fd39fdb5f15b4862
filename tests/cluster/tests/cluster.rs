//! The cluster tier's scenarios, in one cluster started once: each asserts what a user sees
//! (`kubectl`-level objects, a container's view), and leaves the cluster as it found it. When
//! `prepare.sh` built the newest Kubernetes release too (`K8S_NEWEST`), the DRA scenarios then
//! run again on a cluster of it.
//!
//!   cargo test -p cluster-tier --test cluster                 every scenario
//!   cargo test -p cluster-tier --test cluster -- passthrough  those whose name contains a word

use std::process::ExitCode;
use std::time::Instant;

use cluster_tier::Cluster;

mod scenarios;

fn main() -> ExitCode {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let chosen: Vec<&scenarios::Scenario> = scenarios::ALL
        .iter()
        .filter(|s| filters.is_empty() || filters.iter().any(|f| s.name.contains(f.as_str())))
        .collect();
    if chosen.is_empty() {
        eprintln!("no scenario matches {filters:?}");
        return ExitCode::SUCCESS;
    }
    let cluster = match Cluster::start_or_skip() {
        Ok(Some(c)) => c,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cluster tier: cannot start the cluster: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let newest = cluster.assets().newest();
    let mut failed = run(&cluster, &chosen);
    drop(cluster);
    let mut ran = chosen.len();
    // The DRA scenarios again on the newest release: what its API and kubelet change
    // (device metadata, taints) is where a driver breaks first.
    let dra: Vec<&scenarios::Scenario> = chosen
        .iter()
        .copied()
        .filter(|s| s.name.starts_with("dra"))
        .collect();
    if let Some(assets) = newest.filter(|_| !dra.is_empty()) {
        let version = assets.k8s_version.clone();
        eprintln!("cluster tier: the DRA scenarios on Kubernetes {version}");
        match Cluster::start_with(assets) {
            Ok(c) => {
                let f = run(&c, &dra);
                failed.extend(f.into_iter().map(|n| format!("{n} ({version})")));
                ran += dra.len();
            }
            Err(e) => {
                eprintln!("cluster tier: cannot start the cluster on {version}: {e:#}");
                failed.push(format!("the cluster on {version}"));
            }
        }
    }
    if failed.is_empty() {
        eprintln!("cluster tier: {ran} scenarios passed");
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "cluster tier: {} of {ran} scenarios failed: {failed:?}",
            failed.len(),
        );
        ExitCode::FAILURE
    }
}

/// Runs `chosen` in order on `cluster`; the names of those that failed.
fn run(cluster: &Cluster, chosen: &[&scenarios::Scenario]) -> Vec<String> {
    let version = &cluster.assets().k8s_version;
    let mut failed = Vec::new();
    for s in chosen {
        let t0 = Instant::now();
        eprintln!("scenario {} ({version}) ...", s.name);
        let result = (s.run)(cluster);
        if let Err(e) = &result {
            eprintln!(
                "scenario {} ... FAILED ({:.1} s): {e:#}",
                s.name,
                t0.elapsed().as_secs_f64()
            );
            eprintln!("{}", cluster.diagnostics());
            failed.push(s.name.to_string());
            if std::env::var_os("CLUSTER_KEEP").is_some() {
                eprintln!(
                    "CLUSTER_KEEP: the cluster stays up (kubeconfig {}); Ctrl-C ends the run",
                    cluster.kubeconfig().display()
                );
                std::thread::park();
            }
        }
        // The next scenario starts from a clean cluster, whatever this one left.
        if let Err(e) = scenarios::reset(cluster) {
            eprintln!("cannot reset the cluster after {}: {e:#}", s.name);
            eprintln!("{}", cluster.diagnostics());
            if result.is_ok() {
                failed.push(s.name.to_string());
            }
            break;
        }
        if result.is_ok() {
            eprintln!(
                "scenario {} ... ok ({:.1} s)",
                s.name,
                t0.elapsed().as_secs_f64()
            );
        }
    }
    failed
}
