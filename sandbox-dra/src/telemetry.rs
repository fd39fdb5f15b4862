//! What the driver counts and tells: its metrics (in the daemon's [`Ops`] registry, served with
//! `--metrics-addr`), its readiness (the first ResourceSlice published), and Events on the
//! Node for every claim prepared or refused; and the publisher's wake-up after each claim
//! prepared or unprepared (a GPU's vGPUs decide which sizes it offers).

use std::fmt::Display;
use std::sync::Arc;

use daemon_kit::events::NodeEvents;
use daemon_kit::ops::Ops;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerbLabel {
    verb: String,
}

/// Shared by the plugin service and the publisher.
#[derive(Debug)]
pub struct Telemetry {
    ops: Arc<Ops>,
    events: NodeEvents,
    prepares: Family<ResultLabel, Counter>,
    unprepares: Family<ResultLabel, Counter>,
    published: Gauge,
    publish_failures: Counter,
    passes: Family<ResultLabel, Counter>,
    slice_writes: Family<VerbLabel, Counter>,
    unreadable_records: Counter,
    /// Why the vGPU pool is not published, while it is not.
    vgpu_pool_off: std::sync::Mutex<Option<String>>,
}

fn result(ok: bool) -> ResultLabel {
    ResultLabel {
        result: if ok { "success" } else { "failed" }.into(),
    }
}

impl Telemetry {
    /// Registers the driver's metrics in `ops`.
    pub fn new(ops: Arc<Ops>, events: NodeEvents) -> Telemetry {
        let t = Telemetry {
            ops,
            events,
            prepares: Family::default(),
            unprepares: Family::default(),
            published: Gauge::default(),
            publish_failures: Counter::default(),
            passes: Family::default(),
            slice_writes: Family::default(),
            unreadable_records: Counter::default(),
            vgpu_pool_off: std::sync::Mutex::new(None),
        };
        t.ops.register(
            "sandbox_dra_prepares",
            "Claims kubelet asked to prepare, by result (success, failed).",
            t.prepares.clone(),
        );
        t.ops.register(
            "sandbox_dra_unprepares",
            "Claims kubelet asked to unprepare, by result (success, failed).",
            t.unprepares.clone(),
        );
        t.ops.register(
            "sandbox_dra_published_devices",
            "Devices in the node's ResourceSlice, as last published.",
            t.published.clone(),
        );
        t.ops.register(
            "sandbox_dra_unreadable_records",
            "Claim records that could not be read (garbage, or a newer format) and were set aside.",
            t.unreadable_records.clone(),
        );
        t.ops.register(
            "sandbox_dra_publish_failures",
            "Passes that could not read the node or publish its ResourceSlice.",
            t.publish_failures.clone(),
        );
        t.ops.register(
            "sandbox_dra_publish_passes",
            "Passes of the ResourceSlice publisher, by result: unchanged (the API server's slices, as the watch shows them, already said what the node has: no request), written, failed, waiting (the node's slices not listed yet).",
            t.passes.clone(),
        );
        t.ops.register(
            "sandbox_dra_slice_writes",
            "Requests that wrote the node's ResourceSlices, by verb (apply, delete).",
            t.slice_writes.clone(),
        );
        t
    }

    /// A claim prepared with the devices named, or refused with `Err(message)`: the error's
    /// chain, which names the claim already (every [`crate::prepare::PrepareError`] does).
    pub fn prepared(&self, claim: &dyn Display, r: Result<&[&str], &str>) {
        self.prepares.get_or_create(&result(r.is_ok())).inc();
        match r {
            Ok(names) => {
                self.events.normal(
                    "ClaimPrepared",
                    "Prepare",
                    format!("claim {claim}: {}", names.join(", ")),
                );
            }
            Err(e) => self.events.warning("ClaimNotPrepared", "Prepare", e),
        }
    }

    /// A claim unprepared, or not with `Err(message)`, which names the claim (as in
    /// [`Telemetry::prepared`]).
    pub fn unprepared(&self, r: Result<(), &str>) {
        self.unprepares.get_or_create(&result(r.is_ok())).inc();
        if let Err(e) = r {
            self.events.warning("ClaimNotUnprepared", "Unprepare", e);
        }
    }

    /// What the node's container runtime (newly read) means for CDI, told once per change.
    pub fn runtime(&self, cdi: &crate::runtime::Cdi) {
        use crate::runtime::Cdi;
        match cdi {
            Cdi::Read => tracing::info!("the node's container runtime reads CDI"),
            Cdi::Maybe(why) => {
                tracing::warn!("{why}");
                self.events
                    .warning("ContainerRuntimeCDI", "Check", why.clone());
            }
            Cdi::Ignored(why) => {
                tracing::error!("{why}; every claim is refused until it changes");
                self.events
                    .warning("ContainerRuntimeCDI", "Check", why.clone());
            }
        }
    }

    /// A claim record could not be read and was set aside: `note` says which and what became
    /// of it.
    pub fn record_unreadable(&self, note: &str) {
        self.unreadable_records.inc();
        self.events
            .warning("ClaimRecordUnreadable", "Prepare", note.to_string());
    }

    /// `--vgpu` claimed nothing at start: `note` says why.
    pub fn vgpu_pool_not_claimed(&self, note: &str) {
        self.events
            .warning("VgpuPoolNotClaimed", "Start", note.to_string());
    }

    /// The API server drops what the vGPU pool needs (`Some(why)`: a Warning Event
    /// `VgpuPoolNotPublished`, and readiness says why), or keeps it again (`None`: a Normal
    /// Event `VgpuPoolPublished`).
    pub fn vgpu_pool_unsupported(&self, why: Option<&str>) {
        *self.vgpu_pool_off.lock().unwrap_or_else(|e| e.into_inner()) = why.map(str::to_string);
        match why {
            Some(why) => self
                .events
                .warning("VgpuPoolNotPublished", "Publish", why.to_string()),
            None => self.events.normal(
                "VgpuPoolPublished",
                "Publish",
                "the API server keeps what the vGPU pool needs: the pool is published",
            ),
        }
    }

    /// The publisher's loop is alive.
    pub fn beat(&self) {
        self.ops.beat();
    }

    /// A pass published (or found in place) a slice of `devices` devices. With `registered`
    /// (kubelet registered the driver, so it can prepare what the scheduler places there) the
    /// driver is ready: a pod Ready before kubelet can call it would let a rollout go on while
    /// claims on this node fail.
    pub fn published(&self, devices: usize, registered: bool) {
        self.published
            .set(i64::try_from(devices).unwrap_or(i64::MAX));
        if registered {
            let mut status = format!(
                "{devices} devices published in the ResourceSlice; kubelet registered the driver"
            );
            if let Some(why) = self
                .vgpu_pool_off
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_deref()
            {
                status.push_str("; ");
                status.push_str(why);
            }
            self.ops.ready(&status);
        }
    }

    /// A pass failed.
    pub fn publish_failed(&self) {
        self.publish_failures.inc();
    }

    /// A pass of the publisher ended with `result`.
    pub fn pass(&self, result: &str) {
        self.passes
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
    }

    /// A request wrote one of the node's slices (`apply`, `delete`).
    pub fn slice_written(&self, verb: &str) {
        self.slice_writes
            .get_or_create(&VerbLabel { verb: verb.into() })
            .inc();
    }
}
