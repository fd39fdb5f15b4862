//! sandbox-dp's metrics: devices per resource and health, allocations, registrations,
//! on-demand vGPUs. Registered in the daemon's [`Ops`] registry and served with it
//! (`--metrics-addr`: `/metrics`, `/healthz`, `/readyz`).

use std::sync::atomic::AtomicU64;

use daemon_kit::ops::Ops;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Notify;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    resource: String,
    health: String,
}

/// Counters and gauges, shared by every task.
#[derive(Debug, Default)]
pub struct Metrics {
    devices: Family<DeviceLabels, Gauge>,
    allocations: Family<ResourceLabels, Counter>,
    allocation_errors: Family<ResourceLabels, Counter>,
    registrations: Family<ResourceLabels, Counter>,
    on_demand_created: Counter,
    on_demand_destroyed: Counter,
    on_demand_failures: Counter,
    on_demand_ready_seconds: Counter<f64, AtomicU64>,
    on_demand_records_unreadable: Counter,
    /// Woken at every registration.
    registered: Notify,
}

fn resource(r: &str) -> ResourceLabels {
    ResourceLabels {
        resource: r.to_string(),
    }
}

impl Metrics {
    /// Registers every metric in `ops`'s registry.
    pub fn register(&self, ops: &Ops) {
        ops.register(
            "sandbox_dp_devices",
            "Devices advertised to kubelet, by resource and health.",
            self.devices.clone(),
        );
        ops.register(
            "sandbox_dp_allocations",
            "Container allocations answered.",
            self.allocations.clone(),
        );
        ops.register(
            "sandbox_dp_allocation_errors",
            "Container allocations refused (unknown or unhealthy IDs, empty requests).",
            self.allocation_errors.clone(),
        );
        ops.register(
            "sandbox_dp_registrations",
            "Successful registrations with kubelet.",
            self.registrations.clone(),
        );
        ops.register(
            "sandbox_dp_on_demand_vgpus_created",
            "On-demand vGPUs created for an Allocate.",
            self.on_demand_created.clone(),
        );
        ops.register(
            "sandbox_dp_on_demand_vgpus_destroyed",
            "On-demand vGPUs removed once no pod held them.",
            self.on_demand_destroyed.clone(),
        );
        ops.register(
            "sandbox_dp_on_demand_failures",
            "On-demand vGPUs that could not be created or removed.",
            self.on_demand_failures.clone(),
        );
        ops.register(
            "sandbox_dp_on_demand_ready_seconds",
            "Time from Allocate to a ready vGPU, summed over the created ones.",
            self.on_demand_ready_seconds.clone(),
        );
        ops.register(
            "sandbox_dp_on_demand_records_unreadable",
            "Files of on-demand vGPU records that could not be read (garbage, or a newer format) and were set aside.",
            self.on_demand_records_unreadable.clone(),
        );
    }

    /// Sets a resource's device counts (its counters show from now on, at 0 until counted).
    pub fn set_devices(&self, resource_name: &str, healthy: usize, unhealthy: usize) {
        for (health, n) in [("Healthy", healthy), ("Unhealthy", unhealthy)] {
            let labels = DeviceLabels {
                resource: resource_name.to_string(),
                health: health.to_string(),
            };
            self.devices
                .get_or_create(&labels)
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        let r = resource(resource_name);
        for family in [
            &self.allocations,
            &self.allocation_errors,
            &self.registrations,
        ] {
            let _ = family.get_or_create(&r);
        }
    }

    /// Counts one container allocation (`ok`) or a refused one.
    pub fn allocation(&self, resource_name: &str, ok: bool) {
        let family = if ok {
            &self.allocations
        } else {
            &self.allocation_errors
        };
        family.get_or_create(&resource(resource_name)).inc();
    }

    /// Counts one successful registration with kubelet.
    pub fn registration(&self, resource_name: &str) {
        self.registrations
            .get_or_create(&resource(resource_name))
            .inc();
        self.registered.notify_waiters();
    }

    /// Counts an on-demand vGPU created for an Allocate, `took` from the call to ready.
    pub fn on_demand_created(&self, took: std::time::Duration) {
        self.on_demand_created.inc();
        self.on_demand_ready_seconds.inc_by(took.as_secs_f64());
    }

    /// Counts a file of on-demand records set aside because it could not be read.
    pub fn on_demand_records_unreadable(&self) {
        self.on_demand_records_unreadable.inc();
    }

    /// Counts an on-demand vGPU removed once no pod held it.
    pub fn on_demand_destroyed(&self) {
        self.on_demand_destroyed.inc();
    }

    /// Counts an on-demand vGPU that could not be created or removed.
    pub fn on_demand_failure(&self) {
        self.on_demand_failures.inc();
    }

    /// Registrations of `resource` so far.
    pub fn registrations(&self, resource_name: &str) -> u64 {
        self.registrations
            .get(&resource(resource_name))
            .map_or(0, |c| c.get())
    }

    /// Waits until every resource of `names` has registered with kubelet at least once.
    pub async fn all_registered(&self, names: &[String]) {
        loop {
            let next = self.registered.notified();
            tokio::pin!(next);
            next.as_mut().enable();
            if names.iter().all(|n| self.registrations(n) > 0) {
                return;
            }
            next.await;
        }
    }

    /// These metrics alone, in the text format `/metrics` serves.
    pub fn render(&self) -> String {
        let ops = Ops::new();
        self.register(&ops);
        ops.render()
    }
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
        m.set_devices("nvidia.com/TU104GL_T4", 1, 0);
        let t = m.render();
        for line in [
            "sandbox_dp_on_demand_vgpus_created_total 1\n",
            "sandbox_dp_on_demand_vgpus_destroyed_total 0\n",
            "sandbox_dp_on_demand_failures_total 1\n",
            "sandbox_dp_on_demand_ready_seconds_total 0.25\n",
            "sandbox_dp_devices{resource=\"nvidia.com/GA102GL_A10\",health=\"Healthy\"} 2\n",
            "sandbox_dp_devices{resource=\"nvidia.com/GA102GL_A10\",health=\"Unhealthy\"} 1\n",
            "sandbox_dp_allocations_total{resource=\"nvidia.com/GA102GL_A10\"} 1\n",
            "sandbox_dp_allocation_errors_total{resource=\"nvidia.com/GA102GL_A10\"} 1\n",
            "sandbox_dp_registrations_total{resource=\"nvidia.com/GA102GL_A10\"} 1\n",
            // A resource seen but not yet allocated or registered shows its counters at 0.
            "sandbox_dp_allocations_total{resource=\"nvidia.com/TU104GL_T4\"} 0\n",
            "sandbox_dp_registrations_total{resource=\"nvidia.com/TU104GL_T4\"} 0\n",
        ] {
            assert!(t.contains(line), "{line} missing from:\n{t}");
        }
        assert_eq!(m.registrations("nvidia.com/GA102GL_A10"), 1);
        assert_eq!(m.registrations("nvidia.com/TU104GL_T4"), 0);
    }
}
