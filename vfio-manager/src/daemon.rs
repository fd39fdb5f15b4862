//! `vfio-manager daemon`: bind, vouch for it with a readiness file, and keep binding.
//!
//! The daemon binds the selection, writes `<host-root>/run/nvidia/validations/vfio-pci-ready`
//! once every selected function is on its VFIO driver, then reconciles again whenever udev
//! reports a PCI device added, removed, bound or unbound (a hot-plugged GPU), and on a slow
//! resync timer as a safety net. While any selected function is not bound the readiness file
//! is absent; while all are, it is written again whenever someone else removes it (the GPU
//! Operator's validator). SIGTERM/SIGINT end it with the devices left bound (a rollout must not break
//! running VMs); with `--unbind-on-exit` it gives them back first.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use common::state::readiness;
use common::uevent::{Monitor, Subject, Uevent};
use common::{HostPaths, PciAddress, error_chain};
use daemon_kit::exit;
use daemon_kit::readiness::Keeper;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::report::{Outcome, Report};
use crate::{Config, run_bind, run_unbind};

/// The readiness file's name under the validations directory.
pub const READY_FILE: &str = "vfio-pci-ready";

/// `daemon` settings.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Selection, driver and timeouts, as for `bind`.
    pub config: Config,
    /// How often to reconcile without an event (`--resync-interval`).
    pub resync_interval: Duration,
    /// Give the devices back on SIGTERM (`--unbind-on-exit`).
    pub unbind_on_exit: bool,
    /// Listen for udev events (off only where no netlink socket can be had).
    pub udev: bool,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            config: Config::default(),
            resync_interval: Duration::from_secs(60),
            unbind_on_exit: false,
            udev: true,
        }
    }
}

/// The readiness file's path.
pub fn ready_path(paths: &HostPaths) -> PathBuf {
    readiness::path(paths, READY_FILE)
}

/// Writes the readiness file (when `report` is clean) or removes it.
fn set_ready(ready: &Keeper, paths: &HostPaths, report: Option<&Report>) {
    let path = ready_path(paths);
    if let Some(report) = report.filter(|r| r.exit_code() == 0) {
        let mut body = String::new();
        for r in &report.results {
            let driver = match &r.outcome {
                Outcome::Changed { to, .. } => to.clone(),
                Outcome::Unchanged { driver } => driver.clone(),
                _ => None,
            };
            body.push_str(&format!(
                "{} {} {}\n",
                r.address,
                driver.as_deref().unwrap_or("-"),
                r.group.map(|g| g.to_string()).unwrap_or_else(|| "-".into())
            ));
        }
        match ready.vouch(&body) {
            Ok(()) => tracing::info!(path = %path.display(), "all selected devices bound; ready"),
            Err(e) => {
                tracing::error!(error = %error_chain(&e), "cannot write the readiness file")
            }
        }
    } else {
        match ready.withdraw() {
            Ok(true) => {
                tracing::warn!(path = %path.display(), "not every selected device is bound; readiness withdrawn")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::error!(error = %error_chain(&e), "cannot remove the readiness file")
            }
        }
    }
}

/// Prints a report the way `bind` does (changes on stdout, failures on stderr).
pub fn print_report(report: &Report, quiet_when_unchanged: bool) {
    let changes = report.change_lines();
    let failures = report.failure_lines();
    for l in &changes {
        println!("{l}");
    }
    for l in &failures {
        eprintln!("{l}");
    }
    if !(quiet_when_unchanged && changes.is_empty() && failures.is_empty()) {
        println!("{}", report.summary());
    }
}

/// One bind pass on a blocking thread; `None` when the node could not be read.
async fn reconcile(cfg: &Config, paths: &HostPaths) -> Option<Report> {
    let (cfg, p) = (cfg.clone(), paths.clone());
    match tokio::task::spawn_blocking(move || run_bind(&cfg, &p)).await {
        Ok(Ok(r)) => Some(r),
        Ok(Err(e)) => {
            tracing::error!(error = %error_chain(&e), "reconcile failed");
            None
        }
        Err(e) => {
            tracing::error!(error = %e, "reconcile worker failed");
            None
        }
    }
}

/// Runs the daemon until `shutdown`. A clean shutdown is `Ok`; with `--unbind-on-exit`, a
/// device not given back ends it with exit status 1.
pub async fn run(cfg: DaemonConfig, paths: HostPaths, shutdown: CancellationToken) -> exit::Result {
    let ready = Keeper::start(&paths, READY_FILE, shutdown.clone())?;
    let (tx, mut rx) = mpsc::unbounded_channel::<Uevent>();
    // pci uevents (kernel and udev groups: common::uevent), until the monitor is dropped.
    let monitor = if cfg.udev {
        Monitor::start(&["pci"], move |ev| tx.send(ev).is_ok())
            .inspect_err(|e| {
                tracing::warn!(error = %e, "udev events unavailable; relying on the resync interval")
            })
            .ok()
    } else {
        drop(tx);
        None
    };
    let address = |ev: &Uevent| match ev.subject {
        Subject::Pci(a) => Some(a),
        _ => None,
    };
    let mut ticker = tokio::time::interval(cfg.resync_interval.max(Duration::from_millis(100)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut events_open = cfg.udev;
    let mut first = true;
    // After a pass with failures, event-triggered retries wait this long, so a device that
    // keeps failing (and whose failed writes raise events) is not retried in a tight loop.
    const RETRY_GAP: Duration = Duration::from_secs(1);
    let mut retry_not_before = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = ticker.tick() => {
                if !first {
                    tracing::debug!("resync");
                }
            }
            ev = rx.recv(), if events_open => match ev {
                Some(ev) => {
                    tracing::debug!(action = %ev.action, device = ?address(&ev), "change seen");
                    // Let a burst of events (a driver's remove + add) settle.
                    let settle = tokio::time::Instant::now() + Duration::from_millis(100);
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep_until(settle.max(retry_not_before)) => {}
                    }
                    while rx.try_recv().is_ok() {}
                }
                None => events_open = false,
            },
        }
        let mut again = true;
        while again && !shutdown.is_cancelled() {
            again = false;
            let Some(report) = reconcile(&cfg.config, &paths).await else {
                set_ready(&ready, &paths, None);
                retry_not_before = tokio::time::Instant::now() + RETRY_GAP;
                break;
            };
            print_report(&report, !first);
            first = false;
            set_ready(&ready, &paths, Some(&report));
            let failed = report.exit_code() != 0;
            if failed {
                retry_not_before = tokio::time::Instant::now() + RETRY_GAP;
            }
            // Our own writes raise events. After a clean pass any event is worth another
            // (cheap, write-free when nothing changed) pass; after a failed one only events
            // about devices this pass did not touch are, the rest waits for the retry gap.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let touched: BTreeSet<PciAddress> = report
                .results
                .iter()
                .filter(|r| !matches!(r.outcome, Outcome::Unchanged { .. }))
                .map(|r| r.address)
                .collect();
            while let Ok(ev) = rx.try_recv() {
                if !failed || address(&ev).is_none_or(|a| !touched.contains(&a)) {
                    again = true;
                }
            }
        }
    }
    drop(monitor);
    if cfg.unbind_on_exit {
        tracing::info!("shutting down: giving the devices back (--unbind-on-exit)");
        set_ready(&ready, &paths, None);
        let (c, p) = (cfg.config.clone(), paths.clone());
        match tokio::task::spawn_blocking(move || run_unbind(&c, &p)).await {
            Ok(Ok(r)) => {
                print_report(&r, false);
                return exit::status(r.exit_code());
            }
            Ok(Err(e)) => {
                return Err(anyhow::Error::new(e)
                    .context("unbind on exit failed")
                    .into());
            }
            Err(e) => {
                return Err(anyhow::Error::new(e)
                    .context("unbind on exit failed")
                    .into());
            }
        }
    }
    tracing::info!("shutting down; devices stay bound");
    Ok(())
}
