//! Prometheus text metrics (`--metrics-addr`): devices per resource and health, allocations,
//! registrations. Served by a minimal HTTP/1.1 responder: `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug, Default)]
struct PerResource {
    healthy: u64,
    unhealthy: u64,
    allocations: u64,
    allocation_errors: u64,
    registrations: u64,
}

/// On-demand vGPUs (`--on-demand`): counters, and the Allocate→ready time in all.
#[derive(Clone, Debug, Default)]
struct OnDemand {
    created: u64,
    destroyed: u64,
    failures: u64,
    ready_seconds: f64,
}

/// Counters and gauges, shared by every task.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<BTreeMap<String, PerResource>>,
    on_demand: Mutex<OnDemand>,
}

impl Metrics {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, PerResource>> {
        // A panic while holding this lock leaves plain counters behind: still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets a resource's device counts.
    pub fn set_devices(&self, resource: &str, healthy: usize, unhealthy: usize) {
        let mut m = self.lock();
        let r = m.entry(resource.to_string()).or_default();
        r.healthy = healthy as u64;
        r.unhealthy = unhealthy as u64;
    }

    /// Counts one container allocation (`ok`) or a refused one.
    pub fn allocation(&self, resource: &str, ok: bool) {
        let mut m = self.lock();
        let r = m.entry(resource.to_string()).or_default();
        if ok {
            r.allocations += 1;
        } else {
            r.allocation_errors += 1;
        }
    }

    /// Counts one successful registration with kubelet.
    pub fn registration(&self, resource: &str) {
        self.lock()
            .entry(resource.to_string())
            .or_default()
            .registrations += 1;
    }

    fn on_demand(&self) -> MutexGuard<'_, OnDemand> {
        self.on_demand.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts an on-demand vGPU created for an Allocate, `took` from the call to ready.
    pub fn on_demand_created(&self, took: std::time::Duration) {
        let mut m = self.on_demand();
        m.created += 1;
        m.ready_seconds += took.as_secs_f64();
    }

    /// Counts an on-demand vGPU removed once no pod held it.
    pub fn on_demand_destroyed(&self) {
        self.on_demand().destroyed += 1;
    }

    /// Counts an on-demand vGPU that could not be created or removed.
    pub fn on_demand_failure(&self) {
        self.on_demand().failures += 1;
    }

    /// Registrations of `resource` so far.
    pub fn registrations(&self, resource: &str) -> u64 {
        self.lock().get(resource).map_or(0, |r| r.registrations)
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let m = self.lock().clone();
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, rows: Vec<(String, u64)>| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, v) in rows {
                let _ = writeln!(out, "{name}{{{labels}}} {v}");
            }
        };
        let label = |r: &str| {
            format!(
                "resource=\"{}\"",
                r.replace('\\', "\\\\").replace('"', "\\\"")
            )
        };
        family(
            "sandbox_dp_devices",
            "gauge",
            "Devices advertised to kubelet, by resource and health.",
            m.iter()
                .flat_map(|(r, v)| {
                    [
                        (format!("{},health=\"Healthy\"", label(r)), v.healthy),
                        (format!("{},health=\"Unhealthy\"", label(r)), v.unhealthy),
                    ]
                })
                .collect(),
        );
        family(
            "sandbox_dp_allocations_total",
            "counter",
            "Container allocations answered.",
            m.iter().map(|(r, v)| (label(r), v.allocations)).collect(),
        );
        family(
            "sandbox_dp_allocation_errors_total",
            "counter",
            "Container allocations refused (unknown or unhealthy IDs, empty requests).",
            m.iter()
                .map(|(r, v)| (label(r), v.allocation_errors))
                .collect(),
        );
        family(
            "sandbox_dp_registrations_total",
            "counter",
            "Successful registrations with kubelet.",
            m.iter().map(|(r, v)| (label(r), v.registrations)).collect(),
        );
        let od = self.on_demand().clone();
        let _ = writeln!(
            out,
            "# HELP sandbox_dp_on_demand_vgpus_created_total On-demand vGPUs created for an Allocate.\n\
             # TYPE sandbox_dp_on_demand_vgpus_created_total counter\n\
             sandbox_dp_on_demand_vgpus_created_total {}\n\
             # HELP sandbox_dp_on_demand_vgpus_destroyed_total On-demand vGPUs removed once no pod held them.\n\
             # TYPE sandbox_dp_on_demand_vgpus_destroyed_total counter\n\
             sandbox_dp_on_demand_vgpus_destroyed_total {}\n\
             # HELP sandbox_dp_on_demand_failures_total On-demand vGPUs that could not be created or removed.\n\
             # TYPE sandbox_dp_on_demand_failures_total counter\n\
             sandbox_dp_on_demand_failures_total {}\n\
             # HELP sandbox_dp_on_demand_ready_seconds_total Time from Allocate to a ready vGPU, summed over the created ones.\n\
             # TYPE sandbox_dp_on_demand_ready_seconds_total counter\n\
             sandbox_dp_on_demand_ready_seconds_total {}",
            od.created, od.destroyed, od.failures, od.ready_seconds
        );
        out
    }
}

/// The most one metrics request may take.
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `GET /metrics` on `addr` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics address {addr}"))?;
    tracing::info!(%addr, "serving metrics");
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            acc = listener.accept() => {
                // A failed accept (EMFILE, a peer that reset) is that connection's problem, not
                // the device plugin's: log it, pause briefly, keep serving.
                let stream = match acc {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!(%addr, error = %e, "cannot accept a metrics connection");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let m = metrics.clone();
                tokio::spawn(async move {
                    // A client that never finishes its request does not hold a task forever.
                    let r = tokio::time::timeout(ANSWER_TIMEOUT, answer(stream, &m)).await;
                    match r {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => tracing::debug!(error = %e, "metrics request failed"),
                        Err(_) => tracing::debug!("metrics request timed out"),
                    }
                });
            }
        }
    }
}

async fn answer(mut stream: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let path = head.split_whitespace().nth(1).unwrap_or("");
    let (status, body) = if path == "/metrics" || path == "/" {
        ("200 OK", metrics.render())
    } else {
        ("404 Not Found", "not found: try /metrics\n".to_string())
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(resp.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.set_devices("nvidia.com/GA102GL_A10", 2, 1);
        m.allocation("nvidia.com/GA102GL_A10", true);
        m.allocation("nvidia.com/GA102GL_A10", false);
        m.registration("nvidia.com/GA102GL_A10");
        m.on_demand_created(std::time::Duration::from_millis(250));
        m.on_demand_failure();
        let t = m.render();
        assert!(
            t.contains("sandbox_dp_on_demand_vgpus_created_total 1\n"),
            "{t}"
        );
        assert!(
            t.contains("sandbox_dp_on_demand_vgpus_destroyed_total 0\n"),
            "{t}"
        );
        assert!(t.contains("sandbox_dp_on_demand_failures_total 1\n"), "{t}");
        assert!(
            t.contains("sandbox_dp_on_demand_ready_seconds_total 0.25\n"),
            "{t}"
        );
        assert!(t.contains(
            "sandbox_dp_devices{resource=\"nvidia.com/GA102GL_A10\",health=\"Healthy\"} 2"
        ));
        assert!(t.contains(
            "sandbox_dp_devices{resource=\"nvidia.com/GA102GL_A10\",health=\"Unhealthy\"} 1"
        ));
        assert!(t.contains("sandbox_dp_allocations_total{resource=\"nvidia.com/GA102GL_A10\"} 1"));
        assert!(
            t.contains("sandbox_dp_allocation_errors_total{resource=\"nvidia.com/GA102GL_A10\"} 1")
        );
        assert!(
            t.contains("sandbox_dp_registrations_total{resource=\"nvidia.com/GA102GL_A10\"} 1")
        );
    }
}
