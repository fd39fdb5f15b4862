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

/// Counters and gauges, shared by every task.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<BTreeMap<String, PerResource>>,
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
        let t = m.render();
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
