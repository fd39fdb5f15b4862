//! `vfio-manager daemon`: bind, vouch for it with a readiness file, and keep binding.
//!
//! The daemon binds the selection, writes `<host-root>/run/nvidia/validations/vfio-pci-ready`
//! once every selected function is on its VFIO driver, then reconciles again whenever udev
//! reports a PCI device added, removed, bound or unbound (a hot-plugged GPU), and on a slow
//! resync timer as a safety net; a pass that did not bind everything is retried with backoff
//! ([`daemon_kit::reconcile`]). While any selected function is not bound the readiness file
//! is absent; while all are, it is written again whenever someone else removes it (the GPU
//! Operator's validator). One found at start (a daemon killed before it could remove its own)
//! is removed before the first pass, which writes it again once everything is bound. SIGTERM/SIGINT end it with the devices left bound (a rollout must not break
//! running VMs); with `--unbind-on-exit` it gives them back first.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::state::readiness;
use common::uevent::{Monitor, Subject, Uevent};
use common::{HostPaths, error_chain};
use daemon_kit::events::NodeEvents;
use daemon_kit::exit;
use daemon_kit::ops::{Ops, liveness_window};
use daemon_kit::readiness::Keeper;
use daemon_kit::reconcile::{Settings, Trigger};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;

use crate::report::{Outcome, Report};
use crate::{Config, run_bind, run_unbind};

/// The readiness file's name under the validations directory.
pub const READY_FILE: &str = common::state::readiness::VFIO_PCI_READY;

/// The first delay before a failed pass is tried again; it doubles up to the resync interval.
const RETRY_MIN: Duration = Duration::from_secs(1);

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
    /// Serve metrics and probes here (`--metrics-addr`).
    pub metrics_addr: Option<SocketAddr>,
    /// Record Events on this Node (`--node-name`).
    pub node_name: Option<String>,
    /// The kubeconfig for them; in-cluster config when absent.
    pub kubeconfig: Option<PathBuf>,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            config: Config::default(),
            resync_interval: Duration::from_secs(60),
            unbind_on_exit: false,
            udev: true,
            metrics_addr: None,
            node_name: None,
            kubeconfig: None,
        }
    }
}

/// What the daemon counts, and tells: metrics, Node events, systemd status.
#[derive(Debug)]
struct Telemetry {
    ops: Arc<Ops>,
    events: NodeEvents,
    passes: Counter,
    binds: Counter,
    unbinds: Counter,
    refusals: Counter,
    failures: Counter,
    selected: Gauge,
    bound: Gauge,
    /// The last pass's failure lines: the same refusal is told once, not at every retry.
    told: Vec<String>,
    /// The last pass's warnings, told once the same way.
    told_warnings: Vec<String>,
}

impl Telemetry {
    fn new(ops: Arc<Ops>, events: NodeEvents) -> Telemetry {
        let t = Telemetry {
            ops,
            events,
            passes: Counter::default(),
            binds: Counter::default(),
            unbinds: Counter::default(),
            refusals: Counter::default(),
            failures: Counter::default(),
            selected: Gauge::default(),
            bound: Gauge::default(),
            told: Vec::new(),
            told_warnings: Vec::new(),
        };
        let o = &t.ops;
        o.register(
            "vfio_manager_passes",
            "Passes that read the node and bound what was selected (at start, on udev events, at each resync, and retries).",
            t.passes.clone(),
        );
        o.register(
            "vfio_manager_binds",
            "Functions moved onto a VFIO driver.",
            t.binds.clone(),
        );
        o.register(
            "vfio_manager_unbinds",
            "Functions given back to their default driver.",
            t.unbinds.clone(),
        );
        o.register(
            "vfio_manager_refusals",
            "Functions not bound because their GPU was in use or their group held another vendor's device (each pass counts them again).",
            t.refusals.clone(),
        );
        o.register(
            "vfio_manager_failures",
            "Functions whose bind or unbind failed (each pass counts them again).",
            t.failures.clone(),
        );
        o.register(
            "vfio_manager_devices_selected",
            "Functions the selection names, at the last pass.",
            t.selected.clone(),
        );
        o.register(
            "vfio_manager_devices_bound",
            "Selected functions on their VFIO driver, at the last pass.",
            t.bound.clone(),
        );
        t
    }

    fn pass(&mut self, report: &Report) {
        self.passes.inc();
        let mut bound = 0i64;
        for r in &report.results {
            match &r.outcome {
                Outcome::Changed { .. } => {
                    bound += 1;
                    self.binds.inc();
                }
                Outcome::Unchanged { .. } => bound += 1,
                Outcome::Refused { .. } => {
                    self.refusals.inc();
                }
                Outcome::Failed { .. } => {
                    self.failures.inc();
                }
            }
        }
        let selected = i64::try_from(report.results.len()).unwrap_or(i64::MAX);
        self.selected.set(selected);
        self.bound.set(bound);
        let changes = report.change_lines();
        if !changes.is_empty() {
            self.events.normal("GpusBound", "Bind", changes.join("; "));
        }
        if report.warnings != self.told_warnings {
            if !report.warnings.is_empty() {
                self.events.warning(
                    "OriginalDriversNotRecorded",
                    "Bind",
                    report.warnings.join("; "),
                );
            }
            self.told_warnings = report.warnings.clone();
        }
        let failures = report.failure_lines();
        if failures != self.told {
            let refused = report
                .results
                .iter()
                .any(|r| matches!(r.outcome, Outcome::Refused { .. }));
            if !failures.is_empty() {
                let reason = if refused { "BindRefused" } else { "BindFailed" };
                self.events.warning(reason, "Bind", failures.join("; "));
            }
            self.told = failures;
        }
        let status = format!("{bound} of {selected} selected functions bound");
        if report.exit_code() == 0 {
            self.ops.ready(&status);
        } else {
            self.ops.status(&status);
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
    for l in failures.iter().chain(&report.warnings) {
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
    let ops = Ops::new();
    ops.expect_beats(liveness_window(cfg.resync_interval));
    if let Some(addr) = cfg.metrics_addr {
        ops.clone().listen(addr, shutdown.clone()).await?;
    }
    let events = daemon_kit::events::for_node(
        cfg.node_name.as_deref(),
        cfg.kubeconfig.as_deref(),
        "vfio-manager",
    )
    .await;
    let mut telemetry = Telemetry::new(ops.clone(), events);
    // A failed pass is retried with backoff, at least as often as the resync would.
    let settings = Settings::new("vfio-manager")
        .with_resync(cfg.resync_interval)
        .with_retry(RETRY_MIN, cfg.resync_interval);
    let (mut trigger, changes) = Trigger::<Uevent>::new(settings);
    // pci uevents (kernel and udev groups: common::uevent), until the monitor is dropped.
    let monitor = if cfg.udev {
        Monitor::start(&["pci"], move |ev| changes.send(ev))
            .inspect_err(|e| {
                tracing::warn!(error = %e, "udev events unavailable; relying on the resync interval")
            })
            .ok()
    } else {
        None
    };
    let mut first = true;
    loop {
        ops.beat();
        let Some(wake) = trigger.wait(&shutdown).await else {
            break;
        };
        for ev in &wake.changes {
            let device = match ev.subject {
                Subject::Pci(a) => Some(a),
                _ => None,
            };
            tracing::debug!(action = %ev.action, ?device, "change seen");
        }
        if wake.resync && !wake.first {
            tracing::debug!("resync");
        }
        let Some(report) = reconcile(&cfg.config, &paths).await else {
            set_ready(&ready, &paths, None);
            trigger.retry();
            continue;
        };
        print_report(&report, !first);
        telemetry.pass(&report);
        first = false;
        set_ready(&ready, &paths, Some(&report));
        // Our own writes raise events: after a clean pass they make another one, which writes
        // nothing; after a failed pass they wait for the backoff, as the retry does.
        if report.exit_code() == 0 {
            trigger.done();
        } else {
            trigger.retry();
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
                let changes = r.change_lines();
                telemetry.unbinds.inc_by(changes.len() as u64);
                if !changes.is_empty() {
                    telemetry
                        .events
                        .normal("GpusUnbound", "Unbind", changes.join("; "));
                }
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
