//! What a prepared claim hands the container runtime: a CDI spec naming the VFIO device nodes
//! of each allocated GPU, and the device-metadata file KubeVirt's virt-launcher reads the GPU's
//! PCI address from, bind-mounted through the same spec.
//!
//! **Device metadata** follows KEP-5304 ("DRA Device Attributes Downward API",
//! kubernetes/enhancements `keps/sig-node/5304-dra-attributes-downward-api`), as the Kubernetes
//! documentation states its protocol (concepts, "Dynamic Resource Allocation", "Device metadata
//! protocol") and KubeVirt reads it (VEP 10 "Support GPUs with DRA in KubeVirt",
//! kubevirt/enhancements `veps/sig-compute/10-dra-devices/vep.md`, `GPUsWithDRA`, KubeVirt 1.8+):
//!
//! - inside the container the file is
//!   `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claimName>/<requestName>/<driver>-metadata.json`
//!   for a claim the pod names, and
//!   `…/resourceclaimtemplates/<podClaimName>/<requestName>/<driver>-metadata.json` for a claim
//!   made from a template (`podClaimName`: the pod's name for the claim, which the claim carries
//!   in its `resource.kubernetes.io/pod-claim-name` annotation). `<requestName>` is the
//!   top-level request (a `/subrequest` is dropped from the path, kept in the JSON);
//! - the file is a stream of `DeviceMetadata` objects, one per API version, newest first, as
//!   Kubernetes 1.37's kubelet-plugin helper writes it: `metadata.resource.k8s.io/v1beta1`
//!   (what 1.37's readers require), then `v1alpha1` (what KubeVirt 1.8.3 to 1.9 accept, skipping
//!   other versions); each one compact JSON object on a line. Each holds `metadata` (the claim's
//!   name, namespace, UID and a `generation`: 1 when the file is first written, one more at
//!   each change), `podClaimName`, and `requests[]` with `name` and `devices[]` (`driver`,
//!   `pool`, `name`, `attributes` in the ResourceSlice's attribute form, e.g.
//!   `{"string": "0000:41:00.0"}`);
//! - the request the scheduler chose for a `firstAvailable` request is named as the allocation
//!   names it (`gpu/a10-4q`, as upstream writes it) and again under the top-level request
//!   (`gpu`): KubeVirt looks the VMI's `requestName` up, and that can only be the top-level name;
//! - virt-launcher takes `mdevUUID`, else `resource.kubernetes.io/pciBusID`, of the request's
//!   single device and writes the libvirt `<hostdev>` from it;
//! - KubeVirt 1.8.0 to 1.8.2 read KEP-5304's first layout,
//!   `/var/run/dra-device-attributes/<claimName>/<requestName>/<driver>-metadata.json` (1.8.3
//!   moved to the one above), as one plain object: a file of that form (the `v1alpha1` object
//!   alone) is mounted there.
//!
//! On the host the files live in the driver's own directory under kubelet's root
//! (`<kubelet-root>/plugins/<driver>/metadata/<namespace>_<claim>/<request>/metadata.json`, and
//! `metadata-v1alpha1.json` beside it), mounted read-only.
//!
//! **CDI**: one spec file per claim, `<cdi-root>/<driver>_<claim-uid>.json`, kind
//! `<driver>/vfio`. Each allocated GPU is one CDI device `<claim-uid>-<device>` (one share of a
//! shared vGPU device: `<claim-uid>-<device>-<share-id>`) with the group's
//! nodes (`/dev/vfio/vfio` and `/dev/vfio/<group>`, plus `/dev/iommu` and the functions'
//! `/dev/vfio/devices/vfioN` where the kernel has them); each request is one more CDI device
//! `<claim-uid>-metadata-<request>` mounting its metadata file. Paths in the spec are the host's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The CDI specification version written: device nodes and mounts need no newer one.
pub const CDI_VERSION: &str = "0.5.0";

/// The CDI class of the driver's devices (the kind is `<driver>/vfio`).
pub const CDI_CLASS: &str = "vfio";

/// The directory holding metadata files inside containers (KEP-5304).
pub const CONTAINER_METADATA_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";

/// Where KubeVirt 1.8.0 to 1.8.2 look for the metadata file (KEP-5304's first layout):
/// `<dir>/<claim name>/<request>/<driver>-metadata.json` for every claim (one made from a
/// template is found by its `podClaimName`). The file is mounted there too.
pub const LEGACY_CONTAINER_METADATA_DIR: &str = "/var/run/dra-device-attributes";

/// The annotation on a claim made from a template that names it in the pod.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// The attribute carrying a device's PCI address, which virt-launcher reads.
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";

/// The attribute carrying a mediated device's UUID, which virt-launcher reads (KubeVirt's
/// VEP 10; not yet standardized under `resource.kubernetes.io`).
pub const MDEV_UUID: &str = "mdevUUID";

/// The metadata API versions written, newest first (the file is a stream of one object each).
pub const METADATA_API_VERSIONS: [&str; 2] = [
    "metadata.resource.k8s.io/v1beta1",
    "metadata.resource.k8s.io/v1alpha1",
];

/// The metadata API version of the plain object KubeVirt 1.8.0 to 1.8.2 read.
pub const LEGACY_METADATA_API_VERSION: &str = "metadata.resource.k8s.io/v1alpha1";

/// One allocated GPU as the claim's record holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimDevice {
    /// The claim's requests it was allocated for (`gpu`, or `gpu/subrequest`).
    pub requests: Vec<String>,
    /// Its pool, as the claim's allocation names it: the node's (`node-a`), or its GPU's
    /// (`node-a/gpu-0000-41-00-0`).
    pub pool: String,
    /// Its name in the pool (`gpu-0000-41-00-0`).
    pub device: String,
    /// The share of a device that allows several allocations (a vGPU type's shared device):
    /// the allocation's `shareID`, one vGPU each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// The GPU's PCI address; none for an mdev of a parent that is not a PCI function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<common::PciAddress>,
    /// Its IOMMU group.
    pub group: u32,
    /// The VFIO device nodes the container gets, as the host names them.
    pub nodes: Vec<String>,
    /// The vGPU made for it, for a vGPU device (its `address` is then the GPU, or the VF on
    /// the vendor path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<crate::vgpu::Vgpu>,
    /// The mdev made for it, for a device of an mdev parent that is not a PCI function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mdev: Option<crate::vgpu::Mdev>,
    /// The extended resource its request stands for, in a claim the scheduler made for a
    /// pod's `resources.limits`: the container gets the env var KubeVirt reads for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extended_resource: Option<String>,
    /// Its attributes as the ResourceSlice published them when it was prepared, in the
    /// slice's form (`{"string": "10de"}`), for the metadata file.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, Value>,
}

impl ClaimDevice {
    /// How KubeVirt's device-plugin code names it in an env var: `MDEV_PCI_RESOURCE` and the
    /// mdev's UUID for a mediated device, else `PCI_RESOURCE` and the PCI address of the
    /// function (a GPU, or an SR-IOV VF vGPU), as sandbox-dp hands them out.
    fn kubevirt_id(&self) -> Option<(&'static str, String)> {
        match (&self.vgpu, &self.mdev, self.address) {
            (Some(v), _, _) if !v.handle.is_vendor() => {
                Some(("MDEV_PCI_RESOURCE", v.handle.to_string()))
            }
            (_, Some(m), _) => Some(("MDEV_PCI_RESOURCE", m.uuid.clone())),
            (_, _, Some(a)) => Some(("PCI_RESOURCE", a.to_string())),
            (_, None, None) => None,
        }
    }

    /// What the metadata file says of it: every attribute the slice published, and what
    /// KubeVirt reads: the mdev's UUID (`mdevUUID`) for a mediated device, else the PCI
    /// address of the function (a GPU, or an SR-IOV VF vGPU).
    fn attributes(&self) -> Value {
        let mut attrs: serde_json::Map<String, Value> = self
            .attributes
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        match (&self.vgpu, &self.mdev, self.address) {
            (Some(v), _, _) if !v.handle.is_vendor() => {
                attrs.insert(MDEV_UUID.into(), json!({"string": v.handle.to_string()}));
            }
            (_, Some(m), _) => {
                attrs.insert(MDEV_UUID.into(), json!({"string": m.uuid}));
            }
            (_, _, Some(a)) => {
                attrs.insert(PCI_BUS_ID.into(), json!({"string": a.to_string()}));
            }
            (_, None, None) => {}
        }
        Value::Object(attrs)
    }
}

/// The claim's identity as the files name it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimId {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// The pod's name for the claim, for a claim made from a template.
    pub pod_claim_name: Option<String>,
}

/// The top-level request of a request reference (`gpu/big` → `gpu`).
pub fn base_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(base, _)| base)
}

/// Where one claim's files go, each as the host names it.
#[derive(Clone, Debug)]
pub struct Layout {
    /// The driver's name.
    pub driver: String,
    /// The CDI spec directory (`--cdi-root`).
    pub cdi_root: PathBuf,
    /// `<kubelet-root>/plugins/<driver>`.
    pub driver_dir: PathBuf,
}

impl Layout {
    /// The claim's CDI spec file.
    pub fn cdi_spec(&self, uid: &str) -> PathBuf {
        self.cdi_root.join(format!("{}_{uid}.json", self.driver))
    }

    /// The directory of the claim's metadata files.
    pub fn metadata_dir(&self, claim: &ClaimId) -> PathBuf {
        self.driver_dir
            .join("metadata")
            .join(format!("{}_{}", claim.namespace, claim.name))
    }

    /// The metadata file of one (top-level) request of the claim: the stream.
    pub fn metadata_file(&self, claim: &ClaimId, request: &str) -> PathBuf {
        self.metadata_dir(claim).join(request).join("metadata.json")
    }

    /// The metadata of one request as KubeVirt 1.8.0 to 1.8.2 read it: one plain object.
    pub fn legacy_metadata_file(&self, claim: &ClaimId, request: &str) -> PathBuf {
        self.metadata_dir(claim)
            .join(request)
            .join("metadata-v1alpha1.json")
    }

    /// Where the request's metadata file appears inside the container.
    pub fn container_metadata_file(&self, claim: &ClaimId, request: &str) -> PathBuf {
        let (kind, name) = match &claim.pod_claim_name {
            Some(pod_name) => ("resourceclaimtemplates", pod_name.as_str()),
            None => ("resourceclaims", claim.name.as_str()),
        };
        Path::new(CONTAINER_METADATA_DIR)
            .join(kind)
            .join(name)
            .join(request)
            .join(format!("{}-metadata.json", self.driver))
    }

    /// Where KubeVirt 1.8.0 to 1.8.2 look for the request's metadata file
    /// ([`LEGACY_CONTAINER_METADATA_DIR`]).
    pub fn legacy_container_metadata_file(&self, claim: &ClaimId, request: &str) -> PathBuf {
        Path::new(LEGACY_CONTAINER_METADATA_DIR)
            .join(&claim.name)
            .join(request)
            .join(format!("{}-metadata.json", self.driver))
    }

    /// The CDI device name of an allocated GPU, or of one share of a shared device.
    fn gpu_cdi_name(claim: &ClaimId, device: &ClaimDevice) -> String {
        match &device.share_id {
            Some(share) => format!("{}-{}-{share}", claim.uid, device.device),
            None => format!("{}-{}", claim.uid, device.device),
        }
    }

    /// The CDI device name mounting a request's metadata.
    fn metadata_cdi_name(claim: &ClaimId, request: &str) -> String {
        format!("{}-metadata-{request}", claim.uid)
    }

    /// The CDI device name setting the env var of a request that stands for an extended
    /// resource.
    fn env_cdi_name(claim: &ClaimId, request: &str) -> String {
        format!("{}-env-{request}", claim.uid)
    }

    /// A fully qualified CDI device id (`<driver>/vfio=<name>`).
    fn cdi_id(&self, name: &str) -> String {
        format!("{}/{CDI_CLASS}={name}", self.driver)
    }

    /// The CDI ids of one device: its own, then its requests' metadata, then (for a request
    /// that stands for an extended resource) its request's env var.
    pub fn cdi_ids(&self, claim: &ClaimId, device: &ClaimDevice) -> Vec<String> {
        let mut ids = vec![self.cdi_id(&Self::gpu_cdi_name(claim, device))];
        for r in requests_of(std::slice::from_ref(device)) {
            ids.push(self.cdi_id(&Self::metadata_cdi_name(claim, &r)));
        }
        if device.extended_resource.is_some() {
            for r in requests_of(std::slice::from_ref(device)) {
                ids.push(self.cdi_id(&Self::env_cdi_name(claim, &r)));
            }
        }
        ids
    }

    /// The claim's CDI spec.
    pub fn cdi_spec_json(&self, claim: &ClaimId, devices: &[ClaimDevice]) -> Value {
        let mut cdi_devices: Vec<Value> = devices
            .iter()
            .map(|d| {
                json!({
                    "name": Self::gpu_cdi_name(claim, d),
                    "containerEdits": {
                        "deviceNodes": d.nodes.iter().map(|p| json!({"path": p})).collect::<Vec<_>>(),
                    },
                })
            })
            .collect();
        for r in requests_of(devices) {
            let env = extended_env(devices, &r);
            if !env.is_empty() {
                cdi_devices.push(json!({
                    "name": Self::env_cdi_name(claim, &r),
                    "containerEdits": {"env": env},
                }));
            }
            cdi_devices.push(json!({
                "name": Self::metadata_cdi_name(claim, &r),
                "containerEdits": {
                    "mounts": [
                        {
                            "hostPath": self.metadata_file(claim, &r),
                            "containerPath": self.container_metadata_file(claim, &r),
                            "options": ["ro", "bind"],
                        },
                        {
                            "hostPath": self.legacy_metadata_file(claim, &r),
                            "containerPath": self.legacy_container_metadata_file(claim, &r),
                            "options": ["ro", "bind"],
                        },
                    ],
                },
            }));
        }
        json!({
            "cdiVersion": CDI_VERSION,
            "kind": format!("{}/{CDI_CLASS}", self.driver),
            "devices": cdi_devices,
        })
    }

    /// The `DeviceMetadata` of one top-level request at `api_version` and `generation`: the
    /// devices allocated to it (or to its subrequests), each request as the allocation names it
    /// and, for a subrequest, again under the top-level name (what KubeVirt looks up).
    pub fn metadata_json(
        &self,
        claim: &ClaimId,
        request: &str,
        devices: &[ClaimDevice],
        api_version: &str,
        generation: i64,
    ) -> Value {
        let mut refs: Vec<&str> = Vec::new();
        for d in devices {
            for r in &d.requests {
                if base_request(r) == request && !refs.contains(&r.as_str()) {
                    refs.push(r);
                }
            }
        }
        let entry = |name: &str, of: &dyn Fn(&str) -> bool| -> Value {
            let devs: Vec<Value> = devices
                .iter()
                .filter(|d| d.requests.iter().any(|x| of(x)))
                .map(|d| {
                    json!({
                        "driver": self.driver,
                        "pool": d.pool,
                        "name": d.device,
                        "attributes": d.attributes(),
                    })
                })
                .collect();
            json!({"name": name, "devices": devs})
        };
        let mut requests: Vec<Value> = refs.iter().map(|r| entry(r, &|x| x == *r)).collect();
        if !refs.contains(&request) {
            requests.push(entry(request, &|x| base_request(x) == request));
        }
        let mut obj = json!({
            "kind": "DeviceMetadata",
            "apiVersion": api_version,
            "metadata": {
                "name": claim.name,
                "namespace": claim.namespace,
                "uid": claim.uid,
                "generation": generation,
            },
            "requests": requests,
        });
        if let Some(p) = &claim.pod_claim_name {
            obj["podClaimName"] = json!(p);
        }
        obj
    }

    /// The metadata stream of one top-level request: an object per version of
    /// [`METADATA_API_VERSIONS`], newest first, each compact on a line of its own.
    pub fn metadata_stream(
        &self,
        claim: &ClaimId,
        request: &str,
        devices: &[ClaimDevice],
        generation: i64,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        for v in METADATA_API_VERSIONS {
            let obj = self.metadata_json(claim, request, devices, v, generation);
            out.extend_from_slice(obj.to_string().as_bytes());
            out.push(b'\n');
        }
        out
    }
}

/// The `generation` of the first object of a metadata stream; `None` when it has none.
pub fn stream_generation(stream: &str) -> Option<i64> {
    serde_json::Deserializer::from_str(stream)
        .into_iter::<Value>()
        .next()?
        .ok()?["metadata"]["generation"]
        .as_i64()
}

/// The env vars KubeVirt's virt-launcher reads for the devices of top-level request `request`
/// that stand for an extended resource, as sandbox-dp's Allocate sets them for that resource
/// name: `MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q=<uuid>[,<uuid>…]`,
/// `PCI_RESOURCE_NVIDIA_COM_GA102GL_A10=<address>[,…]`. Empty for any other request.
pub fn extended_env(devices: &[ClaimDevice], request: &str) -> Vec<String> {
    let mut vars: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for d in devices
        .iter()
        .filter(|d| d.requests.iter().any(|r| base_request(r) == request))
    {
        let (Some(resource), Some((prefix, id))) = (&d.extended_resource, d.kubevirt_id()) else {
            continue;
        };
        vars.entry(common::naming::env_var_name(prefix, resource))
            .or_default()
            .push(id);
    }
    vars.into_iter()
        .map(|(k, ids)| format!("{k}={}", ids.join(",")))
        .collect()
}

/// The top-level requests of `devices`, each once, in order.
pub fn requests_of(devices: &[ClaimDevice]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for d in devices {
        for r in &d.requests {
            let b = base_request(r);
            if !out.iter().any(|x| x == b) {
                out.push(b.to_string());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            driver: "gpu.example.io".into(),
            cdi_root: "/var/run/cdi".into(),
            driver_dir: "/var/lib/kubelet/plugins/gpu.example.io".into(),
        }
    }

    fn claim(pod_claim_name: Option<&str>) -> ClaimId {
        ClaimId {
            namespace: "vms".into(),
            name: "vm1-gpu-x7k".into(),
            uid: "u-1".into(),
            pod_claim_name: pod_claim_name.map(str::to_string),
        }
    }

    fn gpu(request: &str) -> ClaimDevice {
        ClaimDevice {
            requests: vec![request.into()],
            pool: "node-a".into(),
            device: "gpu-0000-41-00-0".into(),
            share_id: None,
            address: Some("0000:41:00.0".parse().unwrap()),
            group: 21,
            nodes: vec!["/dev/vfio/vfio".into(), "/dev/vfio/21".into()],
            vgpu: None,
            mdev: None,
            extended_resource: None,
            attributes: BTreeMap::from([
                ("vendorID".to_string(), json!({"string": "10de"})),
                (
                    "resource.kubernetes.io/pcieRoot".to_string(),
                    json!({"string": "pci0000:40"}),
                ),
            ]),
        }
    }

    #[test]
    fn metadata_lands_where_virt_launcher_looks_for_both_kinds_of_claim() {
        let l = layout();
        assert_eq!(
            l.container_metadata_file(&claim(None), "gpu"),
            Path::new(
                "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm1-gpu-x7k/gpu/gpu.example.io-metadata.json"
            )
        );
        assert_eq!(
            l.container_metadata_file(&claim(Some("gpu")), "req"),
            Path::new(
                "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/req/gpu.example.io-metadata.json"
            )
        );
    }

    #[test]
    fn metadata_carries_the_pci_bus_id_under_the_full_and_the_top_level_request_name() {
        let l = layout();
        let c = claim(Some("gpu"));
        let v1alpha1 = LEGACY_METADATA_API_VERSION;
        let m = l.metadata_json(&c, "gpu", &[gpu("gpu/a10")], v1alpha1, 3);
        assert_eq!(m["apiVersion"], v1alpha1);
        assert_eq!(m["kind"], "DeviceMetadata");
        assert_eq!(m["podClaimName"], "gpu");
        assert_eq!(m["metadata"]["uid"], "u-1");
        assert_eq!(m["metadata"]["generation"], 3);
        // As the allocation names it, then under the top-level name KubeVirt looks up.
        assert_eq!(m["requests"][0]["name"], "gpu/a10");
        assert_eq!(m["requests"][1]["name"], "gpu");
        assert_eq!(m["requests"][1]["devices"], m["requests"][0]["devices"]);
        assert_eq!(m["requests"].as_array().unwrap().len(), 2);
        let plain = l.metadata_json(&c, "gpu", &[gpu("gpu")], v1alpha1, 1);
        assert_eq!(plain["requests"].as_array().unwrap().len(), 1);
        let d = &m["requests"][0]["devices"][0];
        assert_eq!(d["driver"], "gpu.example.io");
        assert_eq!(d["pool"], "node-a");
        assert_eq!(d["name"], "gpu-0000-41-00-0");
        assert_eq!(d["attributes"][PCI_BUS_ID]["string"], "0000:41:00.0");
        // Every attribute the slice published, as upstream's helper puts them.
        assert_eq!(d["attributes"]["vendorID"]["string"], "10de");
        assert_eq!(
            d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"],
            "pci0000:40"
        );
        assert!(
            l.metadata_json(&claim(None), "gpu", &[gpu("gpu")], v1alpha1, 1)["podClaimName"]
                .is_null()
        );
    }

    #[test]
    fn the_metadata_stream_is_one_object_per_version_newest_first() {
        let l = layout();
        let c = claim(None);
        let stream = l.metadata_stream(&c, "gpu", &[gpu("gpu")], 2);
        let text = String::from_utf8(stream).unwrap();
        let objs: Vec<Value> = serde_json::Deserializer::from_str(&text)
            .into_iter::<Value>()
            .map(Result::unwrap)
            .collect();
        let versions: Vec<&str> = objs
            .iter()
            .map(|o| o["apiVersion"].as_str().unwrap())
            .collect();
        assert_eq!(versions, METADATA_API_VERSIONS);
        assert_eq!(text.lines().count(), 2, "one object a line:\n{text}");
        assert_eq!(stream_generation(&text), Some(2));
        assert_eq!(objs[0]["requests"], objs[1]["requests"]);
        assert_eq!(stream_generation(""), None);
    }

    #[test]
    fn the_cdi_spec_names_the_group_nodes_and_mounts_the_metadata_read_only() {
        let l = layout();
        let c = claim(None);
        let d = gpu("gpu");
        let spec = l.cdi_spec_json(&c, std::slice::from_ref(&d));
        assert_eq!(spec["kind"], "gpu.example.io/vfio");
        assert_eq!(spec["devices"][0]["name"], "u-1-gpu-0000-41-00-0");
        assert_eq!(
            spec["devices"][0]["containerEdits"]["deviceNodes"],
            json!([{"path": "/dev/vfio/vfio"}, {"path": "/dev/vfio/21"}])
        );
        let m = &spec["devices"][1]["containerEdits"]["mounts"][0];
        assert_eq!(
            m["hostPath"],
            "/var/lib/kubelet/plugins/gpu.example.io/metadata/vms_vm1-gpu-x7k/gpu/metadata.json"
        );
        assert_eq!(m["options"], json!(["ro", "bind"]));
        // One plain object where KubeVirt 1.8.0 to 1.8.2 read it.
        let legacy = &spec["devices"][1]["containerEdits"]["mounts"][1];
        assert_eq!(
            legacy["hostPath"],
            "/var/lib/kubelet/plugins/gpu.example.io/metadata/vms_vm1-gpu-x7k/gpu/metadata-v1alpha1.json"
        );
        assert_eq!(
            legacy["containerPath"],
            "/var/run/dra-device-attributes/vm1-gpu-x7k/gpu/gpu.example.io-metadata.json"
        );
        assert_eq!(
            l.cdi_ids(&c, &d),
            vec![
                "gpu.example.io/vfio=u-1-gpu-0000-41-00-0".to_string(),
                "gpu.example.io/vfio=u-1-metadata-gpu".to_string()
            ]
        );
    }

    #[test]
    fn a_request_for_an_extended_resource_sets_the_env_var_virt_launcher_reads() {
        let l = layout();
        let c = claim(None);
        let mut a = gpu("container-0-request-0");
        a.extended_resource = Some("nvidia.com/GA102GL_A10".into());
        let mut b = a.clone();
        b.device = "gpu-0000-61-00-0".into();
        b.address = Some("0000:61:00.0".parse().unwrap());
        let devices = [a.clone(), b];
        assert_eq!(
            extended_env(&devices, "container-0-request-0"),
            vec!["PCI_RESOURCE_NVIDIA_COM_GA102GL_A10=0000:41:00.0,0000:61:00.0".to_string()]
        );
        let spec = l.cdi_spec_json(&c, &devices);
        let env = spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == "u-1-env-container-0-request-0")
            .unwrap();
        assert_eq!(
            env["containerEdits"]["env"],
            json!(["PCI_RESOURCE_NVIDIA_COM_GA102GL_A10=0000:41:00.0,0000:61:00.0"])
        );
        assert_eq!(
            l.cdi_ids(&c, &a).last().map(String::as_str),
            Some("gpu.example.io/vfio=u-1-env-container-0-request-0")
        );
        // A claim of the pod's own: no env var.
        assert!(extended_env(&[gpu("gpu")], "gpu").is_empty());
        assert_eq!(l.cdi_ids(&c, &gpu("gpu")).len(), 2);
    }
}
