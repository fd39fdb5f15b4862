//! The resources being served: one gRPC server per resource, fed through its `watch` channel.
//! [`Manager`] turns each new view of the node into changed device lists (a whole snapshot, or
//! only the VFs and group nodes an event named), starts servers for new resources and reports
//! health changes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use common::{Inventory, PciAddress};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Config;
use crate::alloc::DevNodes;
use crate::discovery::{self, DeviceInfo, Resource, Snapshot};
use crate::metrics::Metrics;
use crate::plugin::{ResourceState, ResourceTask};

/// A resource whose devices (or their health) changed: its size and healthy count after the
/// change.
pub(crate) struct HealthChange {
    pub(crate) resource: String,
    pub(crate) devices: usize,
    pub(crate) healthy: usize,
}

pub(crate) struct Manager {
    pub(crate) config: Config,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) resources: BTreeMap<String, watch::Sender<Arc<ResourceState>>>,
    pub(crate) reported: BTreeSet<String>,
    pub(crate) wake: Arc<watch::Sender<u64>>,
    pub(crate) kubelet_generation: Arc<AtomicU64>,
    pub(crate) shutdown: CancellationToken,
}

impl Manager {
    /// Pushes a new snapshot: changed resources get a new list, new ones get a server, vanished
    /// ones stay with zero devices.
    pub(crate) fn apply(
        &mut self,
        snap: Snapshot,
        nodes: DevNodes,
        tasks: &mut JoinSet<anyhow::Result<()>>,
    ) {
        for p in &snap.problems {
            if self.reported.insert(p.clone()) {
                tracing::warn!("{p}");
            }
        }
        let mut seen = BTreeSet::new();
        for (name, res) in snap.resources {
            seen.insert(name.clone());
            self.push(name, res, &nodes, tasks);
        }
        let gone: Vec<(String, Resource)> = self
            .resources
            .iter()
            .filter(|(n, _)| !seen.contains(*n))
            .map(|(n, tx)| {
                let mut r = tx.borrow().resource.clone();
                r.devices.clear();
                (n.clone(), r)
            })
            .collect();
        for (name, r) in gone {
            self.push(name, r, &nodes, tasks);
        }
    }

    /// Sets the health of every device in `groups` from whether its group node exists
    /// (`present`), as a new snapshot would, without rebuilding the resources. Only the devices
    /// that changed are touched: a resource's state is updated in place (copied first only
    /// while a call still holds it), with no copy and no comparison of its whole list, and
    /// only the resources that changed wake their ListAndWatch streams. `nodes` is the host's
    /// iommufd nodes now. Returns what changed, for [`Manager::report_health`] once the
    /// streams have sent.
    pub(crate) fn set_group_health(
        &mut self,
        groups: &BTreeSet<u32>,
        present: &BTreeSet<u32>,
        nodes: &DevNodes,
    ) -> Vec<HealthChange> {
        let flips = |d: &DeviceInfo| {
            d.iommu_group
                .filter(|g| groups.contains(g))
                .is_some_and(|g| d.healthy != present.contains(&g))
        };
        let mut changed = Vec::new();
        for (name, tx) in &self.resources {
            tx.send_if_modified(|cur| {
                if !cur.resource.devices.values().any(flips) && cur.nodes == *nodes {
                    return false;
                }
                let st = Arc::make_mut(cur);
                if st.nodes != *nodes {
                    st.nodes = nodes.clone();
                }
                for d in st.resource.devices.values_mut() {
                    if flips(d) {
                        d.healthy = !d.healthy;
                    }
                }
                let healthy = st.resource.devices.values().filter(|d| d.healthy).count();
                changed.push(HealthChange {
                    resource: name.clone(),
                    devices: st.resource.devices.len(),
                    healthy,
                });
                true
            });
        }
        changed
    }

    /// Patches the devices of the VFs `changed` (read again) into the resources in place, as
    /// [`Manager::set_group_health`] flips health: only the resources they are in change, with
    /// no rebuild, copy or comparison of the others' lists. `None` when
    /// [`discovery::vf_devices`] cannot tell the change from those VFs alone: the caller then
    /// discovers the whole node. Returns what changed, for [`Manager::report_health`].
    pub(crate) fn patch_vfs(
        &mut self,
        inv: &Inventory,
        changed: &BTreeSet<PciAddress>,
    ) -> Option<Vec<HealthChange>> {
        let states: BTreeMap<String, Arc<ResourceState>> = self
            .resources
            .iter()
            .map(|(n, tx)| (n.clone(), tx.borrow().clone()))
            .collect();
        let current: BTreeMap<String, &Resource> = states
            .iter()
            .map(|(n, st)| (n.clone(), &st.resource))
            .collect();
        let patches = discovery::vf_devices(inv, &self.config.discover, &current, changed);
        drop(current);
        drop(states);
        let patches = patches?;
        let mut changes = Vec::new();
        for (name, tx) in &self.resources {
            let mine: Vec<&discovery::DevicePatch> =
                patches.iter().filter(|p| p.resource == *name).collect();
            tx.send_if_modified(|cur| {
                let differs = |st: &ResourceState| {
                    st.nodes != inv.dev_nodes
                        || mine
                            .iter()
                            .any(|p| st.resource.devices.get(&p.id) != p.info.as_ref())
                };
                if mine.is_empty() || !differs(cur) {
                    return false;
                }
                let st = Arc::make_mut(cur);
                if st.nodes != inv.dev_nodes {
                    st.nodes = inv.dev_nodes.clone();
                }
                for p in &mine {
                    match &p.info {
                        Some(d) => {
                            st.resource.devices.insert(p.id.clone(), d.clone());
                        }
                        None => {
                            st.resource.devices.remove(&p.id);
                        }
                    }
                }
                let healthy = st.resource.devices.values().filter(|d| d.healthy).count();
                changes.push(HealthChange {
                    resource: name.clone(),
                    devices: st.resource.devices.len(),
                    healthy,
                });
                true
            });
        }
        Some(changes)
    }

    /// Logs and counts what [`Manager::set_group_health`] or [`Manager::patch_vfs`] changed.
    pub(crate) fn report_health(&self, changed: Vec<HealthChange>) {
        for c in changed {
            tracing::info!(
                resource = %c.resource,
                devices = c.devices,
                healthy = c.healthy,
                "device list changed"
            );
            self.metrics
                .set_devices(&c.resource, c.healthy, c.devices - c.healthy);
        }
    }

    pub(crate) fn push(
        &mut self,
        name: String,
        resource: Resource,
        nodes: &DevNodes,
        tasks: &mut JoinSet<anyhow::Result<()>>,
    ) {
        let healthy = resource.devices.values().filter(|d| d.healthy).count();
        self.metrics
            .set_devices(&name, healthy, resource.devices.len() - healthy);
        let state = ResourceState {
            resource,
            nodes: nodes.clone(),
        };
        if let Some(tx) = self.resources.get(&name) {
            tx.send_if_modified(|cur| {
                if **cur == state {
                    return false;
                }
                tracing::info!(
                    resource = %name,
                    devices = state.resource.devices.len(),
                    healthy,
                    "device list changed"
                );
                *cur = Arc::new(state);
                true
            });
            return;
        }
        tracing::info!(
            resource = %name,
            kind = ?state.resource.kind,
            devices = state.resource.devices.len(),
            healthy,
            "new resource"
        );
        let (tx, rx) = watch::channel(Arc::new(state));
        self.resources.insert(name.clone(), tx);
        let task = ResourceTask {
            name: name.clone(),
            kubelet_dir: self.config.kubelet_dir.clone(),
            state: rx,
            metrics: self.metrics.clone(),
            wake: self.wake.subscribe(),
            kubelet_generation: self.kubelet_generation.clone(),
            shutdown: self.shutdown.clone(),
            pool: self.config.discover.pool.clone(),
        };
        let span = tracing::info_span!("resource", resource = %task.name);
        tasks.spawn(tracing::Instrument::instrument(task.run(), span));
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::*;
    use crate::discovery::DiscoverConfig;
    use crate::discovery::Kind;

    pub(crate) fn dev(id: &str, group: u32) -> DeviceInfo {
        DeviceInfo {
            id: id.into(),
            healthy: true,
            numa_node: Some(0),
            iommu_group: Some(group),
            vfio_cdev: None,
            gpu: Some(id.into()),
            switch: None,
            driver: Some("vfio-pci".into()),
        }
    }

    pub(crate) fn manager() -> Manager {
        Manager {
            config: Config {
                kubelet_dir: PathBuf::new(),
                discover: DiscoverConfig {
                    vendor: Some(0x10de),
                    pci_ids: common::PciIds::embedded(),
                    aliases: BTreeMap::new(),
                    pool: None,
                },
                metrics_addr: None,
                resync_interval: Duration::from_secs(30),
                debounce: Duration::from_millis(20),
                on_demand_poll: Duration::from_secs(1),
                node_name: None,
                kubeconfig: None,
            },
            metrics: Arc::new(Metrics::default()),
            resources: BTreeMap::new(),
            reported: BTreeSet::new(),
            wake: Arc::new(watch::channel(0).0),
            kubelet_generation: Arc::new(AtomicU64::new(0)),
            shutdown: CancellationToken::new(),
        }
    }

    pub(crate) fn health(rx: &mut watch::Receiver<Arc<ResourceState>>) -> Vec<(String, bool)> {
        let st = rx.borrow_and_update().clone();
        st.resource
            .devices
            .values()
            .map(|d| (d.id.clone(), d.healthy))
            .collect()
    }

    #[test]
    pub(crate) fn a_group_node_flips_only_its_devices_and_wakes_only_their_resource() {
        let mut m = manager();
        let mut rx = BTreeMap::new();
        for (name, devs) in [
            (
                "nvidia.com/A",
                vec![dev("0000:01:00.0", 21), dev("0000:02:00.0", 22)],
            ),
            ("nvidia.com/B", vec![dev("0000:03:00.0", 23)]),
        ] {
            let mut r = Resource::new(name.into(), Kind::Passthrough);
            for d in devs {
                r.devices.insert(d.id.clone(), d);
            }
            let state = ResourceState {
                resource: r,
                nodes: DevNodes::default(),
            };
            let (tx, r) = watch::channel(Arc::new(state));
            m.resources.insert(name.to_string(), tx);
            rx.insert(name, r);
        }
        let mut ra = rx.remove("nvidia.com/A").unwrap();
        let rb = rx.remove("nvidia.com/B").unwrap();
        let nodes = DevNodes::default();
        let groups = BTreeSet::from([21]);

        let changed = m.set_group_health(&groups, &BTreeSet::from([22, 23]), &nodes);
        let told: Vec<_> = changed
            .iter()
            .map(|c| (c.resource.as_str(), c.devices, c.healthy))
            .collect();
        assert_eq!(told, [("nvidia.com/A", 2, 1)], "only A changed");
        m.report_health(changed);
        assert!(ra.has_changed().unwrap());
        assert_eq!(
            health(&mut ra),
            [
                ("0000:01:00.0".into(), false),
                ("0000:02:00.0".into(), true)
            ]
        );
        assert!(!rb.has_changed().unwrap(), "B's devices did not change");

        // Nothing new: no list is sent, nothing to tell.
        assert!(
            m.set_group_health(&groups, &BTreeSet::from([22, 23]), &nodes)
                .is_empty()
        );
        assert!(!ra.has_changed().unwrap());

        m.set_group_health(&groups, &BTreeSet::from([21, 22, 23]), &nodes);
        assert!(ra.has_changed().unwrap());
        assert_eq!(
            health(&mut ra),
            [("0000:01:00.0".into(), true), ("0000:02:00.0".into(), true)]
        );
        assert!(!rb.has_changed().unwrap());
    }

    #[test]
    pub(crate) fn a_vf_read_again_is_patched_into_its_resource_and_its_batch_groups_flip() {
        use crate::discovery::tests::h100;
        let mut m = manager();
        let c = m.config.discover.clone();
        let inv = h100(&[1000, 1000, 1001]);
        // The resources as a full discovery made them (no servers: only their states).
        let snap = discovery::discover(&inv, &c);
        let mut rx: BTreeMap<String, watch::Receiver<Arc<ResourceState>>> = BTreeMap::new();
        for (name, r) in snap.resources {
            let (tx, r_rx) = watch::channel(Arc::new(ResourceState {
                resource: r,
                nodes: DevNodes::default(),
            }));
            m.resources.insert(name.clone(), tx);
            rx.insert(name, r_rx);
        }
        let four_c = "nvidia.com/NVIDIA_H100XM-4C";
        let eight_c = "nvidia.com/NVIDIA_H100XM-8C";

        // VF .4's vGPU removed, read again, while group 12's node (VF .6, 8C) went.
        let mut after = h100(&[0, 1000, 1001]);
        after.vfio_nodes.remove(&12);
        let vfs = BTreeSet::from(["0000:13:00.4".parse().unwrap()]);
        let mut changes = m.patch_vfs(&after, &vfs).expect("a VF change");
        changes.extend(m.set_group_health(
            &BTreeSet::from([12]),
            &after.vfio_nodes,
            &after.dev_nodes,
        ));
        let told: Vec<_> = changes
            .iter()
            .map(|c| (c.resource.as_str(), c.devices, c.healthy))
            .collect();
        assert_eq!(told, [(four_c, 1, 1), (eight_c, 1, 0)]);
        let mut r4 = rx.remove(four_c).unwrap();
        let mut r8 = rx.remove(eight_c).unwrap();
        assert_eq!(health(&mut r4), [("0000:13:00.5".into(), true)]);
        assert_eq!(health(&mut r8), [("0000:13:00.6".into(), false)]);
        // What a full discovery of the node now gives, device for device.
        let full = discovery::discover(&after, &c);
        assert_eq!(r4.borrow().resource.devices, full.resources[four_c].devices);
        assert_eq!(
            r8.borrow().resource.devices,
            full.resources[eight_c].devices
        );

        // Nothing changed since: no list is sent.
        assert!(m.patch_vfs(&after, &vfs).expect("a VF change").is_empty());
        assert!(!r4.has_changed().unwrap() && !r8.has_changed().unwrap());
    }
}
