//! Whether the API server keeps what a vGPU pool needs. It drops, silently, the fields of a
//! feature that is off: with consumable capacity off (`DRAConsumableCapacity`: off by default
//! before Kubernetes 1.36) a shared vGPU device comes back without `allowMultipleAllocations`
//! and would serve one vGPU per type and GPU; with partitionable devices off
//! (`DRAPartitionableDevices`: before 1.36) the counters go, and the whole GPU and its vGPUs
//! could be allocated together. Neither is a pool the scheduler can be trusted with, so the
//! driver reads back what the API server stored, probes with a dry run before it publishes a
//! pool, and publishes the node's GPUs whole only (passthrough) while the API server drops
//! those fields, trying again every [`REPROBE`].

use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

/// What [`dropped`] names when the API server drops device taints.
pub const TAINTS: &str = "taints (DRADeviceTaints)";

/// How long a pool published whole only waits before the API server is asked again.
pub const REPROBE: Duration = Duration::from_secs(3600);

/// What the API server was last seen to keep.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Support {
    /// Not asked yet.
    #[default]
    Unknown,
    /// It keeps every field a pool needs.
    Kept,
    /// It dropped some (named, with their feature gates), seen at that time.
    Dropped {
        /// What it dropped: `allowMultipleAllocations (DRAConsumableCapacity)`, ….
        fields: Vec<&'static str>,
        /// When it was seen.
        at: Instant,
    },
}

impl Support {
    /// Whether the API server should be asked (a dry run) before a pool is written.
    pub fn needs_probe(&self) -> bool {
        match self {
            Support::Unknown => true,
            Support::Kept => false,
            Support::Dropped { at, .. } => at.elapsed() >= REPROBE,
        }
    }

    /// The fields dropped, when the pool must be published whole only.
    pub fn dropped(&self) -> Option<&[&'static str]> {
        match self {
            Support::Dropped { fields, .. } => Some(fields),
            _ => None,
        }
    }
}

/// Whether `devices` need what a pool needs (counters, or devices shared by several claims).
pub fn is_pool(devices: &[Device]) -> bool {
    devices
        .iter()
        .any(|d| d.consumes_counters.is_some() || d.allow_multiple_allocations == Some(true))
}

/// The fields of `sent` that `stored` (the API server's answer to writing it) lacks, each
/// named with the feature gate that keeps it; empty when it kept them all.
pub fn dropped(sent: &ResourceSlice, stored: &ResourceSlice) -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut note = |f: &'static str| {
        if !out.contains(&f) {
            out.push(f);
        }
    };
    if sent
        .spec
        .shared_counters
        .as_ref()
        .is_some_and(|c| !c.is_empty())
        && stored
            .spec
            .shared_counters
            .as_ref()
            .is_none_or(|c| c.is_empty())
    {
        note("sharedCounters (DRAPartitionableDevices)");
    }
    let stored_devices = stored.spec.devices.as_deref().unwrap_or_default();
    for d in sent.spec.devices.as_deref().unwrap_or_default() {
        let Some(s) = stored_devices.iter().find(|s| s.name == d.name) else {
            continue;
        };
        if d.allow_multiple_allocations == Some(true) && s.allow_multiple_allocations != Some(true)
        {
            note("allowMultipleAllocations (DRAConsumableCapacity)");
        }
        if d.consumes_counters.is_some() && s.consumes_counters.is_none() {
            note("consumesCounters (DRAPartitionableDevices)");
        }
        if d.taints.as_ref().is_some_and(|t| !t.is_empty())
            && s.taints.as_ref().is_none_or(|t| t.is_empty())
        {
            note(TAINTS);
        }
        let policies = |d: &Device| {
            d.capacity
                .iter()
                .flatten()
                .filter(|(_, c)| c.request_policy.is_some())
                .count()
        };
        if policies(d) > policies(s) {
            note("capacity requestPolicy (DRAConsumableCapacity)");
        }
    }
    out
}

/// `devices` without those that carry a taint: where the API server drops taints, a device that
/// cannot serve a VM is left out instead.
pub fn untainted(devices: Vec<Device>) -> Vec<Device> {
    devices
        .into_iter()
        .filter(|d| d.taints.as_ref().is_none_or(|t| t.is_empty()))
        .collect()
}

/// `devices` as the node's GPUs whole only: the passthrough devices, consuming no counters.
pub fn passthrough_only(devices: Vec<Device>) -> Vec<Device> {
    devices
        .into_iter()
        .filter(|d| d.allow_multiple_allocations != Some(true))
        .filter(|d| {
            d.attributes
                .as_ref()
                .and_then(|a| a.get("mode"))
                .and_then(|m| m.string.as_deref())
                == Some(crate::slices::MODE_PASSTHROUGH)
        })
        .map(|d| Device {
            consumes_counters: None,
            ..d
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use common::PciIds;
    use k8s_openapi::api::resource::v1::ResourceSliceSpec;

    use super::*;

    /// The devices the slice publishes for a pooled A10 (every type).
    fn pooled_a10() -> (Vec<Device>, Vec<k8s_openapi::api::resource::v1::CounterSet>) {
        let a: common::PciAddress = "0000:41:00.0".parse().unwrap();
        let gpu = common::PciDevice {
            driver: Some("nvidia".into()),
            iommu_group: Some(21),
            sriov_totalvfs: Some(32),
            ..common::PciDevice::new(a, 0x10de, 0x2236, 0x030200)
        };
        let inv = common::Inventory {
            devices: [(a, gpu)].into(),
            ..Default::default()
        };
        let sel = common::vfio::select(
            &inv,
            &common::vfio::Selector::default(),
            None,
            &Default::default(),
        );
        let pool = crate::vgpu::Pooled::from(std::collections::BTreeSet::from([a]));
        let nd = crate::slices::devices_with_vgpus(&inv, &sel, &PciIds::embedded(), &pool);
        (nd.devices, nd.counters)
    }

    fn slice(devices: Vec<Device>) -> ResourceSlice {
        ResourceSlice {
            spec: ResourceSliceSpec {
                devices: Some(devices),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn fields_the_api_server_dropped_are_named_with_their_feature() {
        let (devices, _) = pooled_a10();
        assert!(is_pool(&devices));
        let sent = slice(devices.clone());
        assert_eq!(dropped(&sent, &sent), Vec::<&str>::new());
        // What an API server with consumable capacity off keeps.
        let off = slice(
            devices
                .iter()
                .cloned()
                .map(|d| Device {
                    allow_multiple_allocations: None,
                    capacity: d.capacity.map(|c| {
                        c.into_iter()
                            .map(|(k, v)| {
                                (
                                    k,
                                    k8s_openapi::api::resource::v1::DeviceCapacity {
                                        request_policy: None,
                                        ..v
                                    },
                                )
                            })
                            .collect::<BTreeMap<_, _>>()
                    }),
                    ..d
                })
                .collect(),
        );
        assert_eq!(
            dropped(&sent, &off),
            vec![
                "allowMultipleAllocations (DRAConsumableCapacity)",
                "capacity requestPolicy (DRAConsumableCapacity)"
            ]
        );
        let no_counters = slice(
            devices
                .into_iter()
                .map(|d| Device {
                    consumes_counters: None,
                    ..d
                })
                .collect(),
        );
        assert_eq!(
            dropped(&sent, &no_counters),
            vec!["consumesCounters (DRAPartitionableDevices)"]
        );
    }

    #[test]
    fn whole_only_is_the_passthrough_devices_without_counters() {
        let (devices, _) = pooled_a10();
        assert!(devices.len() > 20, "{}", devices.len());
        let whole = passthrough_only(devices);
        assert_eq!(
            whole.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
            vec!["gpu-0000-41-00-0"]
        );
        assert!(!is_pool(&whole));
    }

    #[test]
    fn a_pool_dropped_is_asked_again_after_a_while_only() {
        assert!(Support::Unknown.needs_probe());
        assert!(!Support::Kept.needs_probe());
        let now = Support::Dropped {
            fields: vec!["x"],
            at: Instant::now(),
        };
        assert!(!now.needs_probe());
        assert_eq!(now.dropped(), Some(&["x"][..]));
        if let Some(then) = Instant::now().checked_sub(REPROBE) {
            let old = Support::Dropped {
                fields: vec!["x"],
                at: then,
            };
            assert!(old.needs_probe());
        }
    }
}
