//! Operating a daemon: Prometheus metrics, liveness and readiness probes, systemd notification.
//!
//! One [`Ops`] per daemon holds its metrics registry (with this process's CPU time, resident
//! memory, open file descriptors and start time) and its health. With `--metrics-addr` it is
//! served over HTTP/1.1:
//!
//! - `/metrics`: the registry, in the OpenMetrics text format (which Prometheus scrapes);
//! - `/healthz`: 200 while the daemon's loop is alive: it has passed within the window it
//!   declared ([`Ops::expect_beats`]), or it declared none; 503 once it has not;
//! - `/readyz`: 503 until the daemon's first successful pass ([`Ops::ready`]), 200 after.
//!
//! [`Ops::ready`] also tells systemd (`Type=notify` units): `READY=1` at the first pass, and
//! [`Ops::status`] / [`Ops::ready`] send `STATUS=` lines that `systemctl status` shows. Without
//! `$NOTIFY_SOCKET` (not under systemd) these are no-ops.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The content type of `/metrics`.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The most one HTTP connection may take.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// A daemon's metrics and health.
#[derive(Debug)]
pub struct Ops {
    registry: Mutex<Registry>,
    ready: AtomicBool,
    started: Instant,
    /// Milliseconds from `started` to the last beat.
    last_beat: AtomicU64,
    /// Milliseconds without a beat after which the daemon is not alive; 0: no such window.
    beat_window: AtomicU64,
    /// The last STATUS= sent: the same one is not sent again at every pass.
    status: Mutex<String>,
}

impl Ops {
    /// An empty registry with the process metrics (`process_*`), not ready, alive.
    pub fn new() -> Arc<Ops> {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(ProcessCollector));
        Arc::new(Ops {
            registry: Mutex::new(registry),
            ready: AtomicBool::new(false),
            started: Instant::now(),
            last_beat: AtomicU64::new(0),
            beat_window: AtomicU64::new(0),
            status: Mutex::new(String::new()),
        })
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        // A panic while registering leaves a usable registry behind.
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a metric under `name` (a counter's name without its `_total`). `help` is one
    /// sentence; prometheus-client ends it with a full stop of its own.
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        let help = help.strip_suffix('.').unwrap_or(help);
        self.registry().register(name, help, metric);
    }

    /// The registry in the OpenMetrics text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry()) {
            tracing::warn!(error = %e, "cannot encode the metrics");
        }
        out
    }

    /// The daemon's first successful pass is done (later calls: another one is): `/readyz`
    /// answers 200 from now on, systemd is told `READY=1` (once) and `STATUS=status`.
    pub fn ready(&self, status: &str) {
        self.beat();
        let first = !self.ready.swap(true, Ordering::SeqCst);
        if first {
            tracing::debug!(status, "ready");
            self.new_status(status);
            notify(&[
                sd_notify::NotifyState::Ready,
                sd_notify::NotifyState::Status(status),
            ]);
        } else {
            self.status(status);
        }
    }

    /// Whether `status` differs from the last one sent (and is now the last).
    fn new_status(&self, status: &str) -> bool {
        let mut last = self.status.lock().unwrap_or_else(|e| e.into_inner());
        if *last == status {
            return false;
        }
        status.clone_into(&mut last);
        true
    }

    /// Tells systemd `READY=1` and `STATUS=status` without marking `/readyz`: for a daemon whose
    /// readiness waits on a service ordered after it (sandbox-dp's registration needs kubelet,
    /// which its unit starts before), up is as far as systemd can wait.
    pub fn systemd_ready(&self, status: &str) {
        self.new_status(status);
        notify(&[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status(status),
        ]);
    }

    /// Whether [`Ops::ready`] was called.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// Tells systemd what the daemon is doing (`systemctl status` shows it), when it changed.
    pub fn status(&self, status: &str) {
        if self.new_status(status) {
            notify(&[sd_notify::NotifyState::Status(status)]);
        }
    }

    /// The daemon's loop is alive (it finished a pass, or woke on its timer).
    pub fn beat(&self) {
        let ms = self
            .started
            .elapsed()
            .as_millis()
            .try_into()
            .unwrap_or(u64::MAX);
        self.last_beat.store(ms, Ordering::SeqCst);
    }

    /// The daemon's loop beats at least every `window` while it is alive: `/healthz` answers
    /// 503 once it has not beaten for that long.
    pub fn expect_beats(&self, window: Duration) {
        self.beat();
        let ms = window.as_millis().try_into().unwrap_or(u64::MAX).max(1);
        self.beat_window.store(ms, Ordering::SeqCst);
    }

    /// `None` while alive; else how long since the last beat.
    fn stalled(&self) -> Option<Duration> {
        let window = self.beat_window.load(Ordering::SeqCst);
        if window == 0 {
            return None;
        }
        let now: u64 = self
            .started
            .elapsed()
            .as_millis()
            .try_into()
            .unwrap_or(u64::MAX);
        let since = now.saturating_sub(self.last_beat.load(Ordering::SeqCst));
        (since > window).then(|| Duration::from_millis(since))
    }

    /// Serves `/metrics`, `/healthz` and `/readyz` on `addr` until `shutdown`. Failing to bind
    /// the address is an error; a failed connection is logged and the others served.
    pub async fn serve(
        self: Arc<Self>,
        addr: SocketAddr,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let listener = bind(addr).await?;
        self.serve_on(listener, shutdown).await;
        Ok(())
    }

    /// Binds `addr` (an error when it cannot be), then serves it on a task of its own until
    /// `shutdown`, as [`Ops::serve`].
    pub async fn listen(
        self: Arc<Self>,
        addr: SocketAddr,
        shutdown: CancellationToken,
    ) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        let listener = bind(addr).await?;
        Ok(tokio::spawn(self.serve_on(listener, shutdown)))
    }

    async fn serve_on(self: Arc<Self>, listener: TcpListener, shutdown: CancellationToken) {
        let addr = listener
            .local_addr()
            .map_or_else(|_| "?".to_string(), |a| a.to_string());
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
        loop {
            let stream = tokio::select! {
                _ = shutdown.cancelled() => return,
                acc = listener.accept() => match acc {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // EMFILE, a peer that reset: that connection's problem, not the daemon's.
                        tracing::warn!(%addr, error = %e, "cannot accept a metrics connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let ops = self.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let ops = ops.clone();
                    async move { Ok::<_, Infallible>(ops.answer(&req)) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(stream), service);
                match tokio::time::timeout(ANSWER_TIMEOUT, conn).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!(error = %e, "metrics request failed"),
                    Err(_) => tracing::debug!("metrics request timed out"),
                }
            });
        }
    }

    fn answer(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        let text = "text/plain; charset=utf-8";
        let (code, kind, body) = if !matches!(*req.method(), Method::GET | Method::HEAD) {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                text,
                "GET only\n".to_string(),
            )
        } else {
            match req.uri().path() {
                "/metrics" => (StatusCode::OK, METRICS_CONTENT_TYPE, self.render()),
                "/healthz" => match self.stalled() {
                    None => (StatusCode::OK, text, "ok\n".into()),
                    Some(d) => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        text,
                        format!("the daemon's loop has not run for {}s\n", d.as_secs()),
                    ),
                },
                "/readyz" if self.is_ready() => {
                    let status = self.status.lock().map(|s| s.clone()).unwrap_or_default();
                    let body = if status.is_empty() {
                        "ready\n".to_string()
                    } else {
                        format!("ready: {status}\n")
                    };
                    (StatusCode::OK, text, body)
                }
                "/readyz" => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    text,
                    "not ready: no successful pass yet\n".into(),
                ),
                _ => (
                    StatusCode::NOT_FOUND,
                    text,
                    "not found: /metrics, /healthz, /readyz\n".into(),
                ),
            }
        };
        let mut resp = Response::new(Full::new(Bytes::from(body)));
        *resp.status_mut() = code;
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(kind),
        );
        resp
    }
}

async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot bind the metrics address {addr}"))
}

/// How long a daemon whose loop wakes at least every `interval` may go without a beat before
/// it counts as wedged: three intervals, and never under two minutes (a long pass, a slow
/// node).
pub fn liveness_window(interval: Duration) -> Duration {
    (interval * 3).max(Duration::from_secs(120))
}

/// Sends `state` to systemd when it asked for notifications; a failure is logged.
fn notify(state: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(state) {
        tracing::warn!(error = %e, "cannot notify systemd ($NOTIFY_SOCKET)");
    }
}

/// `process_*`: read at every scrape.
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = match common::process::read() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read this process's stats");
                return Ok(());
            }
        };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges: [(&str, &str, f64); 3] = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                s.resident_bytes as f64,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors.",
                s.open_fds as f64,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                s.start_time_seconds,
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[test]
    fn renders_process_metrics_and_registered_ones() {
        let ops = Ops::new();
        let c = Counter::<u64>::default();
        ops.register("test_things", "Things.", c.clone());
        c.inc_by(3);
        let t = ops.render();
        assert!(t.contains("# HELP test_things Things.\n"), "{t}");
        assert!(t.contains("# TYPE test_things counter\n"), "{t}");
        assert!(t.contains("test_things_total 3\n"), "{t}");
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_open_fds ",
            "process_start_time_seconds ",
        ] {
            assert!(t.contains(name), "{name} missing: {t}");
        }
        assert!(t.ends_with("# EOF\n"), "{t}");
    }

    #[test]
    fn liveness_follows_the_beats() {
        let ops = Ops::new();
        assert_eq!(ops.stalled(), None, "no window declared: alive");
        ops.expect_beats(Duration::from_millis(1));
        std::thread::sleep(Duration::from_millis(20));
        assert!(ops.stalled().is_some());
        ops.beat();
        ops.expect_beats(Duration::from_secs(3600));
        assert_eq!(ops.stalled(), None);
    }
}
