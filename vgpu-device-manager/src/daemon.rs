//! The daemon: keep the node on a profile.
//!
//! The profile comes from the node label `nvidia.com/vgpu.config` (a metadata watch of the one
//! Node; `--default-config` when the label is absent) or, without Kubernetes, from
//! `--selected-config`. It applies at start (vGPUs do not survive a reboot), whenever the label
//! or the config file changes (the file's directory is watched: a ConfigMap update swaps a
//! symlink), and retries a failed or blocked apply with backoff (`--retry-min` doubling up to
//! `--retry-max`, with jitter: [`daemon_kit::reconcile`]). In Kubernetes it reports
//! through `nvidia.com/vgpu.config.state` (`pending`, `success`, `failed`) and the annotation
//! `nvidia.com/vgpu.config.state.reason`, written by a task of their own, retried with backoff
//! until the write lands or a newer state replaces it. After a successful apply it writes
//! `<host-root>/run/nvidia/validations/vgpu-devices-ready`, and writes it again whenever someone
//! else removes it (the GPU Operator's validator) until an apply fails. One found at start (a
//! daemon killed before it could remove its own) is removed until an apply succeeds.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use common::{HostPaths, error_chain};
use daemon_kit::events::NodeEvents;
use daemon_kit::exit;
use daemon_kit::ops::Ops;
use daemon_kit::readiness::Keeper;
use daemon_kit::reconcile::{Changes, Settings, Trigger};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use tokio_util::sync::CancellationToken;

use crate::apply::{ApplyError, Options, Outcome, Report, apply};
use crate::config::Config;
use crate::node_meta::{MetaChange, NodeMeta};
use crate::plan::{PlanError, VendorSel};

/// The label that names the profile.
pub const CONFIG_LABEL: &str = "nvidia.com/vgpu.config";
/// The label the daemon reports its state in.
pub const STATE_LABEL: &str = "nvidia.com/vgpu.config.state";
/// The annotation with the reason of a failure.
pub const REASON_ANNOTATION: &str = "nvidia.com/vgpu.config.state.reason";
/// The readiness file's name under the validations directory.
pub const READY_FILE: &str = common::state::readiness::VGPU_DEVICES_READY;

/// Where the profile name comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// The node label, through the Kubernetes API.
    Kube {
        /// The node.
        node_name: String,
        /// A kubeconfig; in-cluster (or `$KUBECONFIG`) when absent.
        kubeconfig: Option<PathBuf>,
        /// The profile when the label is absent.
        default_config: String,
    },
    /// A fixed profile, no Kubernetes.
    Fixed(String),
}

/// Everything the daemon needs besides the host's paths.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Which devices `devices:` counts (`--vendor`).
    pub vendor: VendorSel,
    /// Longest a single sysfs write may take (`--write-timeout`).
    pub write_timeout: Duration,
    /// The config file.
    pub config_file: PathBuf,
    /// Where the profile name comes from.
    pub source: Source,
    /// First retry delay after a failed or blocked apply; doubles up to `retry_max`.
    pub retry_min: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
    /// Serve metrics and probes here (`--metrics-addr`).
    pub metrics_addr: Option<SocketAddr>,
}

/// How often the loop wakes to show it is alive, and how long it may go without: an apply
/// runs inside the loop, and one of thousands of vGPUs on a slow node takes minutes.
const BEAT: Duration = Duration::from_secs(30);
const LIVENESS_WINDOW: Duration = Duration::from_secs(600);
/// The most one write of the node's state (and its read) may take: an API server that accepts
/// and never answers must not stall the apply loop, which is what keeps the node's vGPUs right.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// What the daemon counts, and tells: metrics, Node events, systemd status.
#[derive(Debug)]
struct Telemetry {
    ops: Arc<Ops>,
    events: NodeEvents,
    applies: Family<ResultLabel, Counter>,
    created: Counter,
    removed: Counter,
    vgpus: Gauge,
    duration: Histogram,
    /// The last failure told: a retry failing the same way is not told again.
    told: Option<String>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

impl Telemetry {
    fn new(ops: Arc<Ops>) -> Telemetry {
        let t = Telemetry {
            ops,
            events: NodeEvents::disabled(),
            applies: Family::default(),
            created: Counter::default(),
            removed: Counter::default(),
            vgpus: Gauge::default(),
            duration: Histogram::new([0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]),
            told: None,
        };
        let o = &t.ops;
        o.register(
            "vgpu_device_manager_applies",
            "Applies of the profile, by result (success, failed).",
            t.applies.clone(),
        );
        o.register(
            "vgpu_device_manager_vgpus_created",
            "vGPUs created (mdevs, SR-IOV vGPU types set).",
            t.created.clone(),
        );
        o.register(
            "vgpu_device_manager_vgpus_removed",
            "vGPUs removed.",
            t.removed.clone(),
        );
        o.register(
            "vgpu_device_manager_vgpus",
            "vGPUs of the profile on the node after the last successful apply.",
            t.vgpus.clone(),
        );
        o.register(
            "vgpu_device_manager_apply_duration_seconds",
            "How long an apply took (reading the node, planning, writing).",
            t.duration.clone(),
        );
        t
    }

    fn result(&self, ok: bool) {
        let result = if ok { "success" } else { "failed" };
        self.applies
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
    }

    /// Counts what an apply changed (also a failed one's changes).
    fn changes(&self, report: &Report) -> (usize, usize, usize) {
        let (mut created, mut removed, mut kept) = (0, 0, 0);
        for (_, o) in &report.gpus {
            if let Outcome::Applied {
                created: c,
                removed: r,
                kept: k,
            } = o
            {
                created += c;
                removed += r;
                kept += k;
            }
        }
        self.created.inc_by(created as u64);
        self.removed.inc_by(removed as u64);
        (created, removed, kept)
    }

    fn applied(&mut self, profile: &str, report: &Report, took: Duration) {
        self.duration.observe(took.as_secs_f64());
        self.result(true);
        let (created, removed, kept) = self.changes(report);
        self.vgpus
            .set(i64::try_from(created + kept).unwrap_or(i64::MAX));
        if created + removed > 0 || self.told.is_some() || !self.ops.is_ready() {
            self.events.normal(
                "ProfileApplied",
                "Apply",
                format!(
                    "vGPU profile {profile} applied: {created} vGPUs created, {removed} removed, {kept} kept"
                ),
            );
        }
        self.told = None;
        self.ops.ready(&format!(
            "profile {profile} applied: {} vGPUs",
            created + kept
        ));
    }

    /// `kind`: `Blocked` (a vGPU in use), `Invalid` (config or profile), `Failed`.
    fn failed(
        &mut self,
        profile: &str,
        kind: &str,
        reason: &str,
        took: Duration,
        report: Option<&Report>,
    ) {
        self.duration.observe(took.as_secs_f64());
        self.result(false);
        if let Some(r) = report {
            self.changes(r);
        }
        if self.told.as_deref() != Some(reason) {
            self.events.warning(
                &format!("Profile{kind}"),
                "Apply",
                format!("vGPU profile {profile} not applied: {reason}"),
            );
            self.told = Some(reason.to_string());
        }
        self.ops
            .status(&format!("profile {profile} not applied: {reason}"));
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Pending,
    Success,
    Failed(String),
}

/// Tells the node's state: the label [`STATE_LABEL`] and the annotation [`REASON_ANNOTATION`],
/// written by a task of their own ([`report`]) so that the apply loop never waits on the API
/// server. Without Kubernetes it tells nothing.
struct Reporter {
    states: Option<Changes<State>>,
}

impl Reporter {
    /// The node is in `state` now.
    fn set(&self, state: &State) {
        if let Some(tx) = &self.states {
            tx.send(state.clone());
        }
    }
}

/// Writes each state the apply loop tells, in order, unless the node shows it already. A write
/// that fails (the API server away, a refusal) is retried with [`daemon_kit::reconcile`]'s
/// backoff until it lands or a newer state replaces it: the label never stays behind the node
/// until the next change. A state a newer one follows is not retried.
async fn report(node: NodeMeta, mut trigger: Trigger<State>, shutdown: CancellationToken) {
    // What the node shows, as far as this daemon wrote it, and the newest state told.
    let mut shown: Option<State> = None;
    let mut want: Option<State> = None;
    while let Some(wake) = trigger.wait(&shutdown).await {
        let states: Vec<State> = if wake.changes.is_empty() {
            want.clone().into_iter().collect()
        } else {
            wake.changes
        };
        let last = states.len().saturating_sub(1);
        let mut failed = None;
        for (i, state) in states.into_iter().enumerate() {
            want = Some(state.clone());
            if shown.as_ref() == Some(&state) {
                failed = None;
                continue;
            }
            match write_state(&node, &state).await {
                Ok(()) => {
                    shown = Some(state);
                    failed = None;
                }
                Err(e) if i == last => failed = Some(e),
                Err(e) => tracing::warn!(node = node.node(), "{e}; a newer state follows"),
            }
        }
        match failed {
            None => trigger.done(),
            Some(e) => {
                let retry_in = trigger.retry();
                tracing::warn!(node = node.node(), ?retry_in, "{e}");
            }
        }
    }
}

/// One write of `state` to the node, bounded by [`API_TIMEOUT`].
async fn write_state(node: &NodeMeta, state: &State) -> Result<(), String> {
    let (value, reason) = match state {
        State::Pending => ("pending", None),
        State::Success => ("success", None),
        State::Failed(r) => ("failed", Some(r.clone())),
    };
    let mut change = MetaChange::default();
    change
        .labels
        .insert(STATE_LABEL.into(), Some(value.to_string()));
    if !matches!(state, State::Pending) {
        change.annotations.insert(REASON_ANNOTATION.into(), reason);
    }
    match tokio::time::timeout(API_TIMEOUT, node.apply(&change)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("cannot set {STATE_LABEL}={value}: {e}")),
        Err(_) => Err(format!(
            "cannot set {STATE_LABEL}={value}: the API server did not answer within {API_TIMEOUT:?}"
        )),
    }
}

/// Runs until `shutdown`; an error means the daemon cannot go on (its watch ended): exit 1.
pub async fn run(cfg: DaemonConfig, paths: HostPaths, shutdown: CancellationToken) -> exit::Result {
    // First: a readiness file left by a daemon that did not stop cleanly goes before anything
    // here may fail or wait (the API server, the metrics port, the first apply).
    let ready = Keeper::start(&paths, READY_FILE, shutdown.clone())?;
    let ops = Ops::new();
    ops.expect_beats(LIVENESS_WINDOW);
    if let Some(addr) = cfg.metrics_addr {
        ops.clone().listen(addr, shutdown.clone()).await?;
    }
    let opts = Options {
        vendor: cfg.vendor,
        write_timeout: cfg.write_timeout,
        ..Options::new(paths)
    };
    Ok(keep_applied(cfg, opts, ready, Telemetry::new(ops), shutdown).await?)
}

async fn keep_applied(
    cfg: DaemonConfig,
    opts: Options,
    ready: Keeper,
    mut telemetry: Telemetry,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let settings = Settings::new("vgpu-device-manager").with_retry(cfg.retry_min, cfg.retry_max);
    let (mut trigger, changes) = Trigger::<Change>::new(settings);
    let mut profile: Option<String> = None;
    let mut tasks = tokio::task::JoinSet::new();
    let reporter = match &cfg.source {
        Source::Fixed(name) => {
            profile = Some(name.clone());
            Reporter { states: None }
        }
        Source::Kube {
            node_name,
            kubeconfig,
            default_config,
        } => {
            let client = daemon_kit::kube::client(kubeconfig.as_deref()).await?;
            // Writes go through a client whose every request is bounded; the watch keeps the
            // plain one (a quiet watch is not a hung server).
            let mut bounded = daemon_kit::kube::config(kubeconfig.as_deref()).await?;
            bounded.connect_timeout = Some(API_TIMEOUT);
            bounded.read_timeout = Some(API_TIMEOUT);
            bounded.write_timeout = Some(API_TIMEOUT);
            let writer =
                kube::Client::try_from(bounded).context("cannot make a Kubernetes client")?;
            telemetry.events = NodeEvents::start(writer.clone(), node_name, "vgpu-device-manager");
            let meta: Api<PartialObjectMeta<Node>> = Api::all(client.clone());
            let (node, default) = (node_name.clone(), default_config.clone());
            let stop = shutdown.clone();
            let changes = changes.clone();
            tasks.spawn(async move {
                let mut selected: Option<String> = None;
                let wc = watcher::Config::default().fields(&format!("metadata.name={node}"));
                let mut stream = watcher(meta, wc)
                    .backoff(daemon_kit::kube::watch_backoff())
                    .boxed();
                loop {
                    let ev = tokio::select! {
                        _ = stop.cancelled() => return Ok(()),
                        ev = stream.next() => ev,
                    };
                    let Some(ev) = ev else {
                        anyhow::bail!("the watch of node {node} ended");
                    };
                    let obj = match ev {
                        Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o,
                        Ok(_) => continue,
                        Err(e) => {
                            tracing::warn!(node, "watching the node: {e}");
                            continue;
                        }
                    };
                    let want = obj
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(CONFIG_LABEL))
                        .filter(|v| !v.is_empty())
                        .cloned()
                        .unwrap_or_else(|| default.clone());
                    if selected.as_deref() != Some(want.as_str()) {
                        tracing::info!(node, profile = want, "selected profile");
                        selected = Some(want.clone());
                        changes.send(Change::Profile(want));
                    }
                }
            });
            // The state label's own loop: its retries follow the backoff of daemon-kit's
            // reconcile loops (1 s doubling to 30 s, with jitter), not the applies'.
            let (states, tx) = Trigger::<State>::new(
                Settings::new("vgpu-device-manager state label")
                    .with_settle(Duration::ZERO)
                    .without_first_pass(),
            );
            let node = NodeMeta::new(Api::all(writer), node_name.clone());
            let stop = shutdown.clone();
            tasks.spawn(async move {
                report(node, states, stop).await;
                Ok(())
            });
            Reporter { states: Some(tx) }
        }
    };

    // The config file: watch its directory (a ConfigMap swaps the `..data` symlink).
    let _watcher = watch_file(&cfg.config_file, changes)?;

    let mut last_text: Option<String> = None;
    let mut heartbeat = tokio::time::interval(BEAT);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        telemetry.ops.beat();
        // Shutdown first: on SIGTERM the watch task ends, which must not read as the profile
        // source failing.
        let wake = tokio::select! {
            biased;
            w = trigger.wait(&shutdown) => match w {
                Some(w) => w,
                None => break,
            },
            r = tasks.join_next(), if !tasks.is_empty() => {
                if shutdown.is_cancelled() { break; }
                match r {
                    Some(Ok(Err(e))) => return Err(e),
                    Some(Err(e)) => anyhow::bail!("a daemon task failed: {e}"),
                    _ => {}
                }
                continue;
            }
            _ = heartbeat.tick() => continue,
        };
        // A new profile or config file is applied at once, with the backoff started over.
        let mut asked = wake.first || wake.resync;
        let mut file_event = false;
        for c in wake.changes {
            match c {
                Change::Profile(p) => {
                    profile = Some(p);
                    asked = true;
                }
                Change::File => file_event = true,
            }
        }
        if file_event && !asked {
            let now = std::fs::read_to_string(&cfg.config_file).ok();
            if now != last_text {
                tracing::info!(file = %cfg.config_file.display(), "config file changed");
                asked = true;
            }
        }
        if !asked && !wake.retry {
            continue;
        }
        if asked {
            trigger.done();
        }
        let Some(profile) = profile.clone() else {
            continue;
        };
        // A retry after a failure keeps reporting `failed` until it passes: the label does not
        // flap through `pending` on every attempt.
        if asked {
            reporter.set(&State::Pending);
        }
        let started = Instant::now();
        telemetry.ops.status(&format!("applying profile {profile}"));
        let text = std::fs::read_to_string(&cfg.config_file);
        last_text = text.as_ref().ok().cloned();
        let mut failed_report: Option<Report> = None;
        let outcome = match text {
            Err(e) => Err((
                format!("cannot read config file {}: {e}", cfg.config_file.display()),
                false,
            )),
            Ok(text) => match Config::parse(&text) {
                Err(e) => Err((
                    format!("config file {}: {e}", cfg.config_file.display()),
                    false,
                )),
                Ok(config) => {
                    let opts = opts.clone();
                    let p = profile.clone();
                    match tokio::task::spawn_blocking(move || apply(&opts, &config, &p)).await {
                        Err(e) => Err((format!("the apply task failed: {e}"), true)),
                        Ok(Err(e @ ApplyError::Read(_))) => Err((format!("{e:#}"), true)),
                        // A GPU whose driver or VFs are not up yet (boot) may fit later.
                        Ok(Err(ApplyError::Invalid(errs))) => {
                            let later = errs.iter().any(PlanError::may_pass_later);
                            Err((ApplyError::Invalid(errs).to_string(), later))
                        }
                        Ok(Err(e)) => Err((e.to_string(), false)),
                        Ok(Ok(report)) if report.success() => Ok(report),
                        Ok(Ok(report)) => {
                            let reason = report.failure_reason();
                            failed_report = Some(report);
                            Err((reason, true))
                        }
                    }
                }
            },
        };
        match outcome {
            Ok(report) => {
                tracing::info!(profile, writes = report.writes, "profile applied");
                telemetry.applied(&profile, &report, started.elapsed());
                if let Err(e) = ready.vouch("") {
                    tracing::warn!("cannot write the readiness file: {}", error_chain(&e));
                }
                reporter.set(&State::Success);
                trigger.done();
            }
            Err((reason, retryable)) => {
                if let Err(e) = ready.withdraw() {
                    tracing::warn!("cannot remove the readiness file: {}", error_chain(&e));
                }
                tracing::error!(profile, "profile not applied: {reason}");
                let kind = match &failed_report {
                    Some(r)
                        if r.gpus
                            .iter()
                            .any(|(_, o)| matches!(o, Outcome::Blocked { .. })) =>
                    {
                        "Blocked"
                    }
                    Some(_) => "Failed",
                    None if retryable => "Failed",
                    None => "Invalid",
                };
                telemetry.failed(
                    &profile,
                    kind,
                    &reason,
                    started.elapsed(),
                    failed_report.as_ref(),
                );
                reporter.set(&State::Failed(reason));
                if retryable {
                    let delay = trigger.retry();
                    tracing::info!("retrying in {delay:?}");
                } else {
                    trigger.done();
                }
            }
        }
    }
    tasks.shutdown().await;
    Ok(())
}

/// What asks the daemon to apply again.
#[derive(Debug)]
enum Change {
    /// The node label names this profile (or, without it, the default does).
    Profile(String),
    /// Something changed in the config file's directory.
    File,
}

fn watch_file(file: &Path, changes: Changes<Change>) -> anyhow::Result<notify::RecommendedWatcher> {
    use notify::{RecursiveMode, Watcher};
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut w = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        match ev {
            Ok(e) if !e.kind.is_access() => {
                changes.send(Change::File);
            }
            Ok(_) => {}
            // The watch lost events (its queue overflowed): read everything again.
            Err(_) => {
                changes.lost();
            }
        }
    })
    .context("cannot start watching files")?;
    w.watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("cannot watch {}", dir.display()))?;
    Ok(w)
}
