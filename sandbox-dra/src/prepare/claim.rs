//! The claim as the API server has it: the GPUs, vGPUs and mdevs its allocation gives this
//! driver on this node.

use common::PciAddress;
use k8s_openapi::api::resource::v1::ResourceClaim;

use super::{ClaimRef, PrepareConfig, PrepareError, refused};
use crate::cdi::{self, ClaimDevice, ClaimId};
use crate::{names, record};

/// A GPU the claim's allocation names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// The requests it was allocated for.
    pub requests: Vec<String>,
    /// Its pool: the node's, or its GPU's ([`names::gpu_pool`]).
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// The allocation's share of it, for a device that allows several (a vGPU type's).
    pub share_id: Option<String>,
    /// Its PCI address; none for an mdev of a parent that is not a PCI function.
    pub address: Option<PciAddress>,
    /// The extended resource its request stands for, in a claim the scheduler made for a
    /// pod's `resources.limits` (`nvidia.com/NVIDIA_A10-4Q`).
    pub extended_resource: Option<String>,
}

impl From<&ClaimDevice> for Wanted {
    fn from(d: &ClaimDevice) -> Self {
        Wanted {
            requests: d.requests.clone(),
            pool: d.pool.clone(),
            device: d.device.clone(),
            share_id: d.share_id.clone(),
            address: d.address,
            extended_resource: d.extended_resource.clone(),
        }
    }
}

/// The claim's identity and the GPUs its allocation gives this driver on this node. Refused
/// when the UID is not kubelet's, the claim is not allocated, or a device name is not one of
/// this driver's.
pub fn allocated(
    config: &PrepareConfig,
    claim: &ClaimRef,
    rc: &ResourceClaim,
) -> Result<(ClaimId, Vec<Wanted>), PrepareError> {
    let uid = rc.metadata.uid.as_deref().unwrap_or_default();
    if uid != claim.uid {
        return Err(refused(
            claim,
            format!(
                "the API server's claim of that name has UID {uid:?}: it was deleted and made \
                 again; not preparing it"
            ),
        ));
    }
    let results = rc
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let Some(results) = results else {
        return Err(refused(claim, "it is not allocated".into()));
    };
    let mut wanted: Vec<Wanted> = Vec::new();
    for r in results
        .iter()
        .filter(|r| r.driver == config.driver && names::is_node_pool(&config.node_name, &r.pool))
    {
        // Both end up in host paths (the metadata directory, the CDI spec) and device names.
        if !names::is_request_ref(&r.request) {
            return Err(refused(
                claim,
                format!(
                    "its allocation names request {}, which is not a request name (a DNS label, \
                     or <request>/<subrequest>); nothing was changed",
                    names::quoted(&r.request)
                ),
            ));
        }
        if !names::is_dns_label(&r.device) {
            return Err(refused(
                claim,
                format!(
                    "its allocation names device {}, which is not a device name (a DNS label); \
                     nothing was changed",
                    names::quoted(&r.device)
                ),
            ));
        }
        // A share's ID names its CDI device and its vGPU in the record.
        if let Some(share) = r.share_id.as_deref()
            && !record::valid_uid(share)
        {
            return Err(refused(
                claim,
                format!(
                    "its allocation names share {} of device {}, which is not a share ID (a \
                     UID); nothing was changed",
                    names::quoted(share),
                    r.device
                ),
            ));
        }
        let address = names::parse_gpu_device(&r.device)
            .or_else(|| names::parse_vgpu_device(&r.device).map(|(gpu, _)| gpu));
        let mdev = names::parse_mdev_device(&r.device, &config.mdev_parents).is_some();
        if address.is_none() && !mdev {
            return Err(refused(
                claim,
                format!(
                    "device {:?} of pool {} is not a GPU of driver {} (names look like \
                     gpu-0000-41-00-0, vgpu-0000-41-00-0-a10-4q, mdev-mtty-mtty-1-0)",
                    r.device, r.pool, config.driver
                ),
            ));
        }
        // One entry per device, or per share of a shared device (one vGPU each).
        match wanted
            .iter_mut()
            .find(|w| w.pool == r.pool && w.device == r.device && w.share_id == r.share_id)
        {
            Some(w) if !w.requests.contains(&r.request) => w.requests.push(r.request.clone()),
            Some(_) => {}
            None => wanted.push(Wanted {
                requests: vec![r.request.clone()],
                pool: r.pool.clone(),
                device: r.device.clone(),
                share_id: r.share_id.clone(),
                address,
                extended_resource: None,
            }),
        }
    }
    if wanted.is_empty() {
        return Err(refused(
            claim,
            format!(
                "its allocation has no device of driver {} in the pools of node {}",
                config.driver, config.node_name
            ),
        ));
    }
    let annotations = rc.metadata.annotations.as_ref();
    let pod_claim_name = annotations
        .and_then(|a| a.get(cdi::POD_CLAIM_NAME_ANNOTATION))
        .cloned();
    // Anyone who may edit the claim may edit its annotations: it names a directory inside
    // the container, so it must be what a pod's name for a claim is.
    if let Some(p) = pod_claim_name.as_deref()
        && !names::is_dns_label(p)
    {
        return Err(refused(
            claim,
            format!(
                "its annotation {} is {}, which is not a pod's name for a claim (a DNS label); \
                 nothing was changed",
                cdi::POD_CLAIM_NAME_ANNOTATION,
                names::quoted(p)
            ),
        ));
    }
    let id = ClaimId {
        namespace: claim.namespace.clone(),
        name: claim.name.clone(),
        uid: claim.uid.clone(),
        pod_claim_name,
    };
    Ok((id, wanted))
}

/// The annotation the scheduler puts on the claim it makes for a pod's extended resources
/// (`resources.limits` served through DRA).
pub const EXTENDED_RESOURCE_CLAIM_ANNOTATION: &str =
    "resource.kubernetes.io/extended-resource-claim";

/// For a claim the scheduler made for a pod's extended resources: each request and the
/// DeviceClass it names (whose `extendedResourceName` is the resource the pod asked for). Empty
/// for any other claim.
pub fn extended_classes(rc: &ResourceClaim) -> Vec<(String, String)> {
    let made_for_limits = rc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(EXTENDED_RESOURCE_CLAIM_ANNOTATION))
        .is_some_and(|v| v == "true");
    if !made_for_limits {
        return Vec::new();
    }
    rc.spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|r| {
            Some((
                r.name.clone(),
                r.exactly.as_ref()?.device_class_name.clone(),
            ))
        })
        .collect()
}

/// Whether `name` is an extended resource name the API accepts (`<domain>/<name>`, each part
/// of letters, digits, `-`, `_` and `.`, starting and ending with a letter or digit; the name
/// part at most 63 characters): it becomes the name of an environment variable.
pub fn is_resource_name(name: &str) -> bool {
    let part = |s: &str, max: usize| {
        let b = s.as_bytes();
        !b.is_empty()
            && b.len() <= max
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
    };
    match name.split_once('/') {
        Some((domain, n)) => {
            part(domain, names::DNS_SUBDOMAIN_MAX) && part(n, names::DNS_LABEL_MAX)
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use common::HostPaths;

    use super::super::{Node, OnUnprepare, Steps};
    use super::*;
    use crate::cdi::Layout;
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
        ResourceClaimStatus,
    };

    fn config() -> PrepareConfig {
        PrepareConfig {
            driver: "gpu.example.io".into(),
            node_name: "node-a".into(),
            layout: Layout {
                driver: "gpu.example.io".into(),
                cdi_root: "/var/run/cdi".into(),
                driver_dir: "/var/lib/kubelet/plugins/gpu.example.io".into(),
            },
            on_unprepare: OnUnprepare::Keep,
            timeout: Duration::from_secs(1),
            vgpu_pool: Default::default(),
            mdev_parents: BTreeSet::new(),
            pci_ids: common::PciIds::embedded(),
            api_timeout: Duration::from_secs(1),
        }
    }

    fn claim_ref() -> ClaimRef {
        ClaimRef {
            namespace: "vms".into(),
            name: "c1".into(),
            uid: "u-1".into(),
        }
    }

    fn rc(uid: &str, results: &[(&str, &str, &str, &str)]) -> ResourceClaim {
        let mut rc = ResourceClaim::default();
        rc.metadata.uid = Some(uid.into());
        rc.status = Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(
                        results
                            .iter()
                            .map(|(req, driver, pool, dev)| DeviceRequestAllocationResult {
                                request: (*req).into(),
                                driver: (*driver).into(),
                                pool: (*pool).into(),
                                device: (*dev).into(),
                                ..Default::default()
                            })
                            .collect(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        rc
    }

    fn reason(r: Result<(ClaimId, Vec<Wanted>), PrepareError>) -> String {
        match r {
            Err(PrepareError::Refused { reason, .. }) => reason,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn only_this_drivers_devices_in_this_nodes_pool_are_taken() {
        let c = rc(
            "u-1",
            &[
                ("gpu", "gpu.example.io", "node-a", "gpu-0000-41-00-0"),
                ("gpu", "gpu.example.io", "node-b", "gpu-0000-61-00-0"),
                ("nic", "nic.example.io", "node-a", "nic-0"),
            ],
        );
        let (id, wanted) = allocated(&config(), &claim_ref(), &c).unwrap();
        assert_eq!(id.uid, "u-1");
        assert_eq!(id.pod_claim_name, None);
        assert_eq!(
            wanted,
            vec![Wanted {
                requests: vec!["gpu".into()],
                pool: "node-a".into(),
                device: "gpu-0000-41-00-0".into(),
                share_id: None,
                address: Some("0000:41:00.0".parse().unwrap()),
                extended_resource: None,
            }]
        );
    }

    #[test]
    fn a_claim_made_for_limits_names_its_requests_classes_and_resource_names_are_checked() {
        let mut c = rc(
            "u-1",
            &[(
                "container-0-request-0",
                "gpu.example.io",
                "node-a",
                "gpu-0000-41-00-0",
            )],
        );
        c.spec.devices = Some(k8s_openapi::api::resource::v1::DeviceClaim {
            requests: Some(vec![k8s_openapi::api::resource::v1::DeviceRequest {
                name: "container-0-request-0".into(),
                exactly: Some(k8s_openapi::api::resource::v1::ExactDeviceRequest {
                    device_class_name: "ga102gl-a10.gpu-vm-node.io".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        });
        assert_eq!(extended_classes(&c), vec![]);
        c.metadata.annotations = Some(
            [(
                EXTENDED_RESOURCE_CLAIM_ANNOTATION.to_string(),
                "true".to_string(),
            )]
            .into(),
        );
        assert_eq!(
            extended_classes(&c),
            vec![(
                "container-0-request-0".to_string(),
                "ga102gl-a10.gpu-vm-node.io".to_string()
            )]
        );
        for ok in [
            "nvidia.com/GA102GL_A10",
            "nvidia.com/NVIDIA_A10-4Q",
            "example.com/gpu",
        ] {
            assert!(is_resource_name(ok), "{ok}");
        }
        for bad in [
            "gpu",
            "nvidia.com/",
            "/gpu",
            "nvidia.com/a=b",
            "nvidia.com/a b",
            "nvidia.com/-a",
        ]
        .into_iter()
        .map(String::from)
        .chain(
            names::tests::hostile(63)
                .into_iter()
                .map(|h| format!("nvidia.com/{h}")),
        ) {
            assert!(!is_resource_name(&bad), "{bad:?}");
        }
    }

    #[test]
    fn each_share_of_a_shared_vgpu_device_is_one_device_and_a_share_id_is_checked() {
        let mut c = rc(
            "u-1",
            &[
                ("a", "gpu.example.io", "node-a", "vgpu-0000-41-00-0-a10-4q"),
                ("b", "gpu.example.io", "node-a", "vgpu-0000-41-00-0-a10-4q"),
            ],
        );
        let shares = [
            "0f4e1a2b-1111-4c3d-8e9f-000000000001",
            "0f4e1a2b-1111-4c3d-8e9f-000000000002",
        ];
        let results = |c: &mut ResourceClaim| {
            c.status
                .as_mut()
                .and_then(|s| s.allocation.as_mut())
                .and_then(|a| a.devices.as_mut())
                .and_then(|d| d.results.as_mut())
                .map(std::mem::take)
                .unwrap()
        };
        let mut rs = results(&mut c);
        for (r, share) in rs.iter_mut().zip(shares) {
            r.share_id = Some(share.into());
        }
        let put = |c: &mut ResourceClaim, rs: Vec<DeviceRequestAllocationResult>| {
            if let Some(d) = c
                .status
                .as_mut()
                .and_then(|s| s.allocation.as_mut())
                .and_then(|a| a.devices.as_mut())
            {
                d.results = Some(rs);
            }
        };
        put(&mut c, rs.clone());
        let (_, wanted) = allocated(&config(), &claim_ref(), &c).unwrap();
        let got: Vec<(&str, Option<&str>)> = wanted
            .iter()
            .map(|w| (w.requests[0].as_str(), w.share_id.as_deref()))
            .collect();
        assert_eq!(got, vec![("a", Some(shares[0])), ("b", Some(shares[1]))]);
        assert!(wanted.iter().all(|w| w.device == "vgpu-0000-41-00-0-a10-4q"
            && w.address == Some("0000:41:00.0".parse().unwrap())));
        // A share ID names a CDI device and a record entry: one that is no UID is refused.
        for bad in names::tests::hostile(128) {
            rs[1].share_id = Some(bad.clone());
            put(&mut c, rs.clone());
            let r = reason(allocated(&config(), &claim_ref(), &c));
            assert!(r.contains("not a share ID"), "{bad:?}: {r}");
        }
    }

    #[test]
    fn an_mdev_of_a_pooled_parent_is_taken_and_of_another_refused() {
        let c = rc(
            "u-1",
            &[("tty", "gpu.example.io", "node-a", "mdev-mtty-mtty-2-0")],
        );
        let r = reason(allocated(&config(), &claim_ref(), &c));
        assert!(r.contains("\"mdev-mtty-mtty-2-0\""), "{r}");
        let cfg = PrepareConfig {
            mdev_parents: ["mtty".to_string()].into(),
            ..config()
        };
        let (_, wanted) = allocated(&cfg, &claim_ref(), &c).unwrap();
        assert_eq!(
            wanted,
            vec![Wanted {
                requests: vec!["tty".into()],
                pool: "node-a".into(),
                device: "mdev-mtty-mtty-2-0".into(),
                share_id: None,
                address: None,
                extended_resource: None,
            }]
        );
    }

    #[test]
    fn a_claim_of_a_vgpu_and_an_mdev_of_another_parent_is_refused_before_any_read() {
        let cfg = PrepareConfig {
            mdev_parents: ["mtty".to_string()].into(),
            ..config()
        };
        let c = rc(
            "u-1",
            &[
                (
                    "a",
                    "gpu.example.io",
                    "node-a",
                    "vgpu-0000-41-00-0-a10-4q-0",
                ),
                ("b", "gpu.example.io", "node-a", "mdev-mtty-mtty-1-0"),
            ],
        );
        let (id, wanted) = allocated(&cfg, &claim_ref(), &c).unwrap();
        // A root with nothing in it: the refusal comes before any read or write.
        let node = Node::new(cfg, HostPaths::new("/nonexistent-root"), None);
        match node.prepare(&claim_ref(), id, wanted, None, &mut Steps::start()) {
            Err(PrepareError::Refused { reason, .. }) => {
                assert!(reason.contains("more than one kind"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_name_from_the_api_is_checked_before_a_path_is_built() {
        use crate::names::{DNS_LABEL_MAX, DNS_SUBDOMAIN_MAX, tests::hostile};
        let cfg = config();
        let dev = "gpu-0000-41-00-0";
        // Requests and devices of the allocation.
        for bad in hostile(DNS_LABEL_MAX) {
            // A request may have one `/`, before its subrequest: two are not a request.
            let bad_request = if bad == "a/b" {
                "a/b/c".into()
            } else {
                bad.clone()
            };
            let r = reason(allocated(
                &cfg,
                &claim_ref(),
                &rc("u-1", &[(&bad_request, "gpu.example.io", "node-a", dev)]),
            ));
            assert!(
                r.contains("request") && r.contains("nothing was changed"),
                "{r}"
            );
            let r = reason(allocated(
                &cfg,
                &claim_ref(),
                &rc("u-1", &[("gpu", "gpu.example.io", "node-a", &bad)]),
            ));
            assert!(
                r.contains("device") && r.contains("not a device name"),
                "{r}"
            );
            // The pod's name for the claim, from an annotation anyone who may edit the claim
            // may edit.
            let mut c = rc("u-1", &[("gpu", "gpu.example.io", "node-a", dev)]);
            c.metadata.annotations =
                Some([(cdi::POD_CLAIM_NAME_ANNOTATION.to_string(), bad.clone())].into());
            let r = reason(allocated(&cfg, &claim_ref(), &c));
            assert!(r.contains(cdi::POD_CLAIM_NAME_ANNOTATION), "{r}");
            // The namespace kubelet names.
            let ns = ClaimRef {
                namespace: bad.clone(),
                ..claim_ref()
            };
            match super::super::check_ref(&ns) {
                Err(PrepareError::Refused { reason, .. }) => {
                    assert!(reason.contains("namespace"), "{reason}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        // The claim's name, a subdomain.
        for bad in hostile(DNS_SUBDOMAIN_MAX) {
            let name = ClaimRef {
                name: bad.clone(),
                ..claim_ref()
            };
            match super::super::check_ref(&name) {
                Err(PrepareError::Refused { reason, .. }) => {
                    assert!(reason.contains("claim name"), "{reason}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        assert!(super::super::check_ref(&claim_ref()).is_ok());
        // What an allocation may hold: a subrequest, a subdomain name.
        let ok = rc("u-1", &[("gpu/a10", "gpu.example.io", "node-a", dev)]);
        let (_, wanted) = allocated(&cfg, &claim_ref(), &ok).unwrap();
        assert_eq!(wanted[0].requests, vec!["gpu/a10".to_string()]);
    }

    #[test]
    fn a_claim_made_again_unallocated_or_naming_a_foreign_device_is_refused() {
        let cfg = config();
        let r = reason(allocated(&cfg, &claim_ref(), &rc("u-2", &[])));
        assert!(r.contains("UID \"u-2\""), "{r}");
        let mut unallocated = rc("u-1", &[]);
        unallocated.status = None;
        let r = reason(allocated(&cfg, &claim_ref(), &unallocated));
        assert_eq!(r, "it is not allocated");
        let r = reason(allocated(
            &cfg,
            &claim_ref(),
            &rc("u-1", &[("gpu", "gpu.example.io", "node-a", "vgpu-7")]),
        ));
        assert!(r.contains("\"vgpu-7\""), "{r}");
        let r = reason(allocated(
            &cfg,
            &claim_ref(),
            &rc("u-1", &[("gpu", "other.io", "node-a", "gpu-0000-41-00-0")]),
        ));
        assert!(
            r.contains("no device of driver gpu.example.io in the pools of node node-a"),
            "{r}"
        );
    }
}
