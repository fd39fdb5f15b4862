//! Allocate and GetPreferredAllocation, as pure functions of a resource's current devices.

use std::collections::{BTreeMap, BTreeSet, HashMap};

pub use common::DevNodes;

use crate::api::{ContainerAllocateResponse, DeviceSpec};
use crate::discovery::{DeviceInfo, Resource};

/// Permissions handed to kubelet for every device node.
pub const PERMISSIONS: &str = "mrw";

/// Why an Allocate request was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum AllocError {
    /// No IDs in a container request.
    Empty {
        /// Resource.
        resource: String,
    },
    /// IDs the resource does not have.
    Unknown {
        /// Resource.
        resource: String,
        /// The IDs.
        ids: Vec<String>,
    },
    /// IDs whose `/dev/vfio/<group>` is gone.
    Unhealthy {
        /// Resource.
        resource: String,
        /// The IDs.
        ids: Vec<String>,
    },
}

impl std::error::Error for AllocError {}

impl std::fmt::Display for AllocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllocError::Empty { resource } => {
                write!(f, "{resource}: container request names no devices")
            }
            AllocError::Unknown { resource, ids } => {
                write!(f, "{resource}: unknown device IDs: {}", ids.join(", "))
            }
            AllocError::Unhealthy { resource, ids } => write!(
                f,
                "{resource}: unhealthy device IDs (no /dev/vfio group node): {}",
                ids.join(", ")
            ),
        }
    }
}

/// The response for one container: env var and device specs for exactly `ids`.
pub fn allocate(
    res: &Resource,
    ids: &[String],
    nodes: &DevNodes,
) -> Result<ContainerAllocateResponse, AllocError> {
    if ids.is_empty() {
        return Err(AllocError::Empty {
            resource: res.name.clone(),
        });
    }
    let unknown: Vec<String> = ids
        .iter()
        .filter(|id| !res.devices.contains_key(*id))
        .cloned()
        .collect();
    if !unknown.is_empty() {
        return Err(AllocError::Unknown {
            resource: res.name.clone(),
            ids: unknown,
        });
    }
    let devs: Vec<&DeviceInfo> = ids.iter().filter_map(|id| res.devices.get(id)).collect();
    let unhealthy: Vec<String> = devs
        .iter()
        .filter(|d| !d.healthy || d.iommu_group.is_none())
        .map(|d| d.id.clone())
        .collect();
    if !unhealthy.is_empty() {
        return Err(AllocError::Unhealthy {
            resource: res.name.clone(),
            ids: unhealthy,
        });
    }
    Ok(respond(&res.env_var(), ids, &devs, nodes))
}

/// The answer for one container given `devs`, with `values` (their IDs: PCI addresses, mdev
/// UUIDs) in the env var `env`: `/dev/vfio/vfio`, each group's node, and with iommufd the
/// VFIO cdevs.
pub fn respond(
    env: &str,
    values: &[String],
    devs: &[&DeviceInfo],
    nodes: &DevNodes,
) -> ContainerAllocateResponse {
    let spec = |p: String| DeviceSpec {
        container_path: p.clone(),
        host_path: p,
        permissions: PERMISSIONS.to_string(),
    };
    let mut devices = vec![spec(common::paths::HOST_VFIO_CONTAINER.to_string())];
    let mut seen = BTreeSet::new();
    for g in devs.iter().filter_map(|d| d.iommu_group) {
        if seen.insert(g) {
            devices.push(spec(common::host_vfio_group_path(g)));
        }
    }
    if nodes.iommufd {
        let cdevs: Vec<&String> = devs
            .iter()
            .filter_map(|d| d.vfio_cdev.as_ref())
            .filter(|c| nodes.cdevs.contains(*c))
            .collect();
        if !cdevs.is_empty() {
            devices.push(spec(common::paths::HOST_IOMMUFD.to_string()));
            for c in cdevs {
                devices.push(spec(common::paths::host_vfio_cdev_path(c)));
            }
        }
    }
    let mut envs = HashMap::new();
    envs.insert(env.to_string(), values.join(","));
    ContainerAllocateResponse {
        envs,
        devices,
        ..Default::default()
    }
}

pub fn preferred(
    res: &Resource,
    available: &[String],
    must: &[String],
    size: usize,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for id in must {
        if !out.contains(id) {
            out.push(id.clone());
        }
    }
    if out.len() >= size {
        return out;
    }
    let need = size - out.len();
    let chosen: BTreeSet<&String> = out.iter().collect();
    let mut cands: Vec<&String> = available.iter().filter(|id| !chosen.contains(id)).collect();
    cands.sort();
    cands.dedup();
    // Keys: NUMA, switch, GPU. The preferred key at each level is the one of the must-include
    // devices.
    type KeyFn = fn(Option<&DeviceInfo>) -> String;
    let levels: [KeyFn; 3] = [
        |d| {
            d.and_then(|d| d.numa_node)
                .map_or_else(|| "-".to_string(), |n| format!("{n:08}"))
        },
        |d| d.and_then(|d| d.switch.clone()).unwrap_or_default(),
        |d| d.and_then(|d| d.gpu.clone()).unwrap_or_default(),
    ];
    let preferred_keys: Vec<BTreeSet<String>> = levels
        .iter()
        .map(|k| out.iter().map(|id| k(res.devices.get(id))).collect())
        .collect();
    let mut picked = Vec::new();
    pick(res, &cands, need, 0, &levels, &preferred_keys, &mut picked);
    out.extend(picked.into_iter().cloned());
    out
}

fn pick<'a>(
    res: &Resource,
    cands: &[&'a String],
    need: usize,
    level: usize,
    levels: &[fn(Option<&DeviceInfo>) -> String],
    preferred: &[BTreeSet<String>],
    out: &mut Vec<&'a String>,
) {
    if need == 0 {
        return;
    }
    let Some(key) = levels.get(level) else {
        out.extend(cands.iter().take(need).copied());
        return;
    };
    let mut groups: BTreeMap<String, Vec<&'a String>> = BTreeMap::new();
    for id in cands {
        groups
            .entry(key(res.devices.get(*id)))
            .or_default()
            .push(id);
    }
    let mut order: Vec<(String, Vec<&'a String>)> = groups.into_iter().collect();
    let pref = &preferred[level];
    // Groups of the must-include devices first; then, if one group can hold the rest, the
    // smallest such group (keeps big groups whole for big requests); then the biggest groups.
    let fits = |g: &Vec<&String>| g.len() >= need;
    order.sort_by(|(ka, a), (kb, b)| {
        let pa = pref.contains(ka);
        let pb = pref.contains(kb);
        pb.cmp(&pa)
            .then_with(|| fits(b).cmp(&fits(a)))
            .then_with(|| {
                if fits(a) && fits(b) {
                    a.len().cmp(&b.len())
                } else {
                    b.len().cmp(&a.len())
                }
            })
            .then_with(|| ka.cmp(kb))
    });
    let mut left = need;
    for (_, g) in order {
        if left == 0 {
            break;
        }
        let take = left.min(g.len());
        pick(res, &g, take, level + 1, levels, preferred, out);
        left -= take;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::Kind;

    fn dev(id: &str, numa: i32, switch: &str, gpu: &str, group: u32) -> DeviceInfo {
        DeviceInfo {
            id: id.into(),
            healthy: true,
            numa_node: Some(numa),
            iommu_group: Some(group),
            vfio_cdev: Some(format!("vfio{group}")),
            gpu: Some(gpu.into()),
            switch: Some(switch.into()),
            driver: Some("vfio-pci".into()),
        }
    }

    fn res(kind: Kind, devs: Vec<DeviceInfo>) -> Resource {
        Resource {
            name: "nvidia.com/GA100_A100_SXM4_80GB".into(),
            kind,
            pci_selectors: BTreeSet::new(),
            type_names: BTreeSet::new(),
            devices: devs.into_iter().map(|d| (d.id.clone(), d)).collect(),
            on_demand: false,
        }
    }

    /// 8 GPUs: NUMA 0 = switches s0 (a,b) and s1 (c,d); NUMA 1 = s2 (e,f), s3 (g,h).
    fn eight() -> Resource {
        let mut v = Vec::new();
        for (i, id) in ["a", "b", "c", "d", "e", "f", "g", "h"].iter().enumerate() {
            let numa = (i / 4) as i32;
            v.push(dev(id, numa, &format!("s{}", i / 2), id, i as u32));
        }
        res(Kind::Passthrough, v)
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn allocate_sets_env_and_group_specs() {
        let r = eight();
        let resp = allocate(&r, &ids(&["a", "c"]), &DevNodes::default()).unwrap();
        assert_eq!(
            resp.envs
                .get("PCI_RESOURCE_NVIDIA_COM_GA100_A100_SXM4_80GB"),
            Some(&"a,c".to_string())
        );
        let paths: Vec<&str> = resp.devices.iter().map(|d| d.host_path.as_str()).collect();
        assert_eq!(paths, ["/dev/vfio/vfio", "/dev/vfio/0", "/dev/vfio/2"]);
        assert!(resp.devices.iter().all(|d| d.permissions == "mrw"));
    }

    #[test]
    fn allocate_adds_iommufd_nodes_when_present() {
        let r = eight();
        let nodes = DevNodes {
            iommufd: true,
            cdevs: ["vfio1".to_string()].into(),
        };
        let resp = allocate(&r, &ids(&["b"]), &nodes).unwrap();
        let paths: Vec<&str> = resp.devices.iter().map(|d| d.host_path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/dev/vfio/vfio",
                "/dev/vfio/1",
                "/dev/iommu",
                "/dev/vfio/devices/vfio1"
            ]
        );
    }

    #[test]
    fn allocate_refuses_unknown_unhealthy_and_empty() {
        let mut r = eight();
        if let Some(d) = r.devices.get_mut("b") {
            d.healthy = false;
        }
        let e = allocate(&r, &ids(&["a", "zz"]), &DevNodes::default()).unwrap_err();
        assert!(e.to_string().contains("unknown device IDs: zz"), "{e}");
        let e = allocate(&r, &ids(&["b"]), &DevNodes::default()).unwrap_err();
        assert!(e.to_string().contains("unhealthy device IDs"), "{e}");
        assert!(e.to_string().contains(": b"), "{e}");
        assert!(matches!(
            allocate(&r, &[], &DevNodes::default()),
            Err(AllocError::Empty { .. })
        ));
    }

    #[test]
    fn preferred_keeps_to_one_switch_then_one_numa_node() {
        let r = eight();
        let all = ids(&["a", "b", "c", "d", "e", "f", "g", "h"]);
        assert_eq!(preferred(&r, &all, &[], 2), ids(&["a", "b"]));
        // b taken elsewhere: a pair stays on one switch (c,d), not a + c.
        let avail = ids(&["a", "c", "d", "e", "f", "g", "h"]);
        assert_eq!(preferred(&r, &avail, &[], 2), ids(&["c", "d"]));
        // Four: one whole NUMA node; NUMA 0 is short of one, so NUMA 1.
        assert_eq!(preferred(&r, &avail, &[], 4), ids(&["e", "f", "g", "h"]));
    }

    #[test]
    fn preferred_honours_must_include_first() {
        let r = eight();
        let all = ids(&["a", "b", "c", "d", "e", "f", "g", "h"]);
        // g is required: its switch partner h next, then NUMA 1's other switch.
        let got = preferred(&r, &all, &ids(&["g"]), 3);
        assert_eq!(got[0], "g");
        assert_eq!(got[1], "h");
        assert!(got[2] == "e" || got[2] == "f", "{got:?}");
        assert_eq!(preferred(&r, &all, &ids(&["a", "h"]), 2), ids(&["a", "h"]));
    }

    #[test]
    fn preferred_packs_vgpus_onto_fewest_gpus() {
        // GPU x has 3 free vGPUs, GPU y has 2, both on one switch and NUMA node.
        let v = vec![
            dev("x1", 0, "s", "x", 1),
            dev("x2", 0, "s", "x", 2),
            dev("x3", 0, "s", "x", 3),
            dev("y1", 0, "s", "y", 4),
            dev("y2", 0, "s", "y", 5),
        ];
        let r = res(Kind::Mdev, v);
        let all = ids(&["x1", "x2", "x3", "y1", "y2"]);
        assert_eq!(preferred(&r, &all, &[], 2), ids(&["y1", "y2"]));
        assert_eq!(preferred(&r, &all, &[], 3), ids(&["x1", "x2", "x3"]));
        let got = preferred(&r, &all, &[], 4);
        assert_eq!(&got[..3], &ids(&["x1", "x2", "x3"])[..]);
        assert_eq!(preferred(&r, &all, &ids(&["y2"]), 2), ids(&["y2", "y1"]));
    }
}
