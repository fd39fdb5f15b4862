//! The cluster tier's scenarios, in one cluster started once: each asserts what a user sees
//! (`kubectl`-level objects, a container's view), and leaves the cluster as it found it.
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
    let mut failed = Vec::new();
    for s in &chosen {
        let t0 = Instant::now();
        eprintln!("scenario {} ...", s.name);
        let result = (s.run)(&cluster);
        if let Err(e) = &result {
            eprintln!(
                "scenario {} ... FAILED ({:.1} s): {e:#}",
                s.name,
                t0.elapsed().as_secs_f64()
            );
            eprintln!("{}", cluster.diagnostics());
            failed.push(s.name);
            if std::env::var_os("CLUSTER_KEEP").is_some() {
                eprintln!(
                    "CLUSTER_KEEP: the cluster stays up (kubeconfig {}); Ctrl-C ends the run",
                    cluster.kubeconfig().display()
                );
                std::thread::park();
            }
        }
        // The next scenario starts from a clean cluster, whatever this one left.
        if let Err(e) = scenarios::reset(&cluster) {
            eprintln!("cannot reset the cluster after {}: {e:#}", s.name);
            if result.is_ok() {
                failed.push(s.name);
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
    drop(cluster);
    if failed.is_empty() {
        eprintln!("cluster tier: {} scenarios passed", chosen.len());
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "cluster tier: {} of {} scenarios failed: {failed:?}",
            failed.len(),
            chosen.len()
        );
        ExitCode::FAILURE
    }
}
