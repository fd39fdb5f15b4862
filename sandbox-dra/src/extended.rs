//! The device plugin's resource names served through DRA (Kubernetes' DRA extended resources,
//! KEP-5004): one DeviceClass per name sandbox-dp advertises, with `extendedResourceName` that
//! name, selecting exactly its devices. A pod (a VM's virt-launcher) asking for
//! `nvidia.com/NVIDIA_A10-4Q: 1` in `resources.limits` on a node that does not advertise the
//! name is then given a claim by the scheduler, which this driver prepares as any other, adding
//! the env var KubeVirt reads for that name ([`crate::cdi::extended_env`]).
//!
//! The names follow sandbox-dp's rules (`common::naming`): a whole GPU `nvidia.com/` + its
//! `pci.ids` name (`GA102GL [A10]` → `nvidia.com/GA102GL_A10`), a vGPU type `nvidia.com/` + its
//! name (`NVIDIA A10-4Q` → `nvidia.com/NVIDIA_A10-4Q`). A name whose part after `/` is longer
//! than 63 characters cannot be a resource name: it is left out and said. Two device ids that
//! `pci.ids` names alike are one resource, as in sandbox-dp.
//!
//! [`catalogue`] is every GPU model the vGPU model table knows, with its types (the Helm chart
//! installs its classes, generated into `deploy/helm/gpu-vm-node/files/extended-resources.yaml`);
//! [`of_node`] is what one node publishes, for a model the table does not know
//! (`sandbox-dra device-classes`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use common::{PciIds, naming};

use crate::vgpu_types::Types;

/// Longest name part (after `/`) of an extended resource name.
pub const MAX_NAME_LEN: usize = 63;

/// What one extended resource stands for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// Whole GPUs of these device ids (vendor 10de).
    Passthrough(BTreeSet<u16>),
    /// vGPUs of this type (`NVIDIA A10-4Q`).
    Vgpu(String),
}

/// One extended resource and its DeviceClass.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Resource {
    /// `nvidia.com/GA102GL_A10`.
    pub name: String,
    /// What its devices are.
    pub kind: Kind,
}

impl Resource {
    /// Its DeviceClass's name: the name part lower-cased, `_` → `-` (a run of them one), in the
    /// project's domain
    /// (`ga102gl-a10.gpu-vm-node.io`, `nvidia-a10-4q.gpu-vm-node.io`).
    pub fn class(&self) -> String {
        let part = self.name.rsplit('/').next().unwrap_or_default();
        let mut label = String::new();
        for c in part.chars() {
            let c = match c {
                '_' | '.' => '-',
                c => c.to_ascii_lowercase(),
            };
            if !(c == '-' && label.ends_with('-')) {
                label.push(c);
            }
        }
        format!("{}.gpu-vm-node.io", label.trim_matches('-'))
    }

    /// The CEL selector of its devices among `driver`'s.
    pub fn selector(&self, driver: &str) -> String {
        let a = |k: &str| format!("device.attributes[\"{driver}\"].{k}");
        match &self.kind {
            Kind::Passthrough(ids) => {
                let ids: Vec<String> = ids.iter().map(|d| format!("\"{d:04x}\"")).collect();
                format!(
                    "device.driver == \"{driver}\" && {} == \"passthrough\" && {} in [{}]",
                    a("mode"),
                    a("deviceID"),
                    ids.join(", ")
                )
            }
            Kind::Vgpu(t) => format!(
                "device.driver == \"{driver}\" && {} == \"vgpu\" && {} == \"{t}\"",
                a("mode"),
                a("vgpuType")
            ),
        }
    }
}

/// Resources and the names left out (too long), from `(name, kind)` pairs: two device ids of
/// one name are one resource.
fn collect(pairs: impl IntoIterator<Item = (String, Kind)>) -> (Vec<Resource>, Vec<String>) {
    let mut by_name: BTreeMap<String, Kind> = BTreeMap::new();
    let mut problems = Vec::new();
    for (name, kind) in pairs {
        let part = name.rsplit('/').next().unwrap_or_default();
        if part.len() > MAX_NAME_LEN {
            problems.push(format!(
                "resource name {name:?} is longer than {MAX_NAME_LEN} characters after the '/': \
                 no DeviceClass"
            ));
            continue;
        }
        match (by_name.get_mut(&name), kind) {
            (Some(Kind::Passthrough(have)), Kind::Passthrough(more)) => have.extend(more),
            (Some(_), _) => {}
            (None, kind) => {
                by_name.insert(name, kind);
            }
        }
    }
    let resources = by_name
        .into_iter()
        .map(|(name, kind)| Resource { name, kind })
        .collect();
    (resources, problems)
}

/// Every GPU model the vGPU model table knows: its whole-GPU resource, and with `vgpu` its
/// vGPU types that `types` lists.
pub fn catalogue(ids: &PciIds, vgpu: bool, types: &Types) -> (Vec<Resource>, Vec<String>) {
    let mut pairs = Vec::new();
    for m in common::vgpu::models::MODELS {
        pairs.push((
            naming::passthrough_resource_name(ids, 0x10de, m.device),
            Kind::Passthrough([m.device].into()),
        ));
        if vgpu {
            for (t, _) in m.types_before_vfs() {
                if types.publishes(&t) {
                    pairs.push((naming::vgpu_resource_name(&t), Kind::Vgpu(t)));
                }
            }
        }
    }
    collect(pairs)
}

/// What the devices `devices` (a node's, as its slices publish them) stand for.
pub fn of_node(
    devices: &[k8s_openapi::api::resource::v1::Device],
    ids: &PciIds,
) -> (Vec<Resource>, Vec<String>) {
    let attr = |d: &k8s_openapi::api::resource::v1::Device, k: &str| -> Option<String> {
        d.attributes.as_ref()?.get(k)?.string.clone()
    };
    let mut pairs = Vec::new();
    for d in devices {
        match attr(d, "mode").as_deref() {
            Some(crate::slices::MODE_PASSTHROUGH) => {
                let (Some(v), Some(dev)) = (attr(d, "vendorID"), attr(d, "deviceID")) else {
                    continue;
                };
                let (Ok(v), Ok(dev)) = (u16::from_str_radix(&v, 16), u16::from_str_radix(&dev, 16))
                else {
                    continue;
                };
                pairs.push((
                    naming::passthrough_resource_name(ids, v, dev),
                    Kind::Passthrough([dev].into()),
                ));
            }
            Some(crate::slices::MODE_VGPU) => {
                if let Some(t) = attr(d, "vgpuType") {
                    pairs.push((naming::vgpu_resource_name(&t), Kind::Vgpu(t)));
                }
            }
            _ => {}
        }
    }
    collect(pairs)
}

/// The DeviceClasses of `resources` for `driver`, as YAML documents.
pub fn device_classes_yaml(resources: &[Resource], driver: &str) -> String {
    let mut out = String::new();
    for r in resources {
        let _ = write!(
            out,
            "---\napiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: {}\n  \
             labels:\n    app.kubernetes.io/name: sandbox-dra\n    app.kubernetes.io/part-of: gpu-vm-node\n\
             spec:\n  extendedResourceName: {}\n  selectors:\n    - cel:\n        expression: >-\n          {}\n",
            r.class(),
            r.name,
            r.selector(driver)
        );
    }
    out
}

/// KubeVirt's `permittedHostDevices` block for `resources`, each served by an external
/// provider (this driver through the scheduler, or sandbox-dp): whole GPUs by PCI id, vGPUs by
/// type name.
pub fn permitted_devices(resources: &[Resource]) -> String {
    let q = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""));
    let (mut pci, mut mdev) = (String::new(), String::new());
    for r in resources {
        match &r.kind {
            Kind::Passthrough(ids) => {
                for id in ids {
                    let _ = writeln!(
                        pci,
                        "    - pciVendorSelector: {}",
                        q(&format!("10DE:{id:04X}"))
                    );
                    let _ = writeln!(pci, "      resourceName: {}", q(&r.name));
                    let _ = writeln!(pci, "      externalResourceProvider: true");
                }
            }
            Kind::Vgpu(t) => {
                let _ = writeln!(mdev, "    - mdevNameSelector: {}", q(t));
                let _ = writeln!(mdev, "      resourceName: {}", q(&r.name));
                let _ = writeln!(mdev, "      externalResourceProvider: true");
            }
        }
    }
    let mut out = String::from("permittedHostDevices:\n");
    for (key, body) in [("pciHostDevices", pci), ("mediatedDevices", mdev)] {
        if body.is_empty() {
            let _ = writeln!(out, "  {key}: []");
        } else {
            let _ = writeln!(out, "  {key}:");
            out.push_str(&body);
        }
    }
    out
}

/// The data the Helm chart renders its classes from: every resource of the [`catalogue`]
/// (every type), one line each, for the chart to filter by `draDriver.vgpu` and
/// `draDriver.vgpuTypes`.
pub fn chart_data(ids: &PciIds) -> String {
    let (resources, problems) = catalogue(ids, true, &Types::All);
    let mut out = String::from(
        "# Generated by deploy/generate.sh (cargo test -p sandbox-dra --test extended_resources);\n\
         # do not edit. The extended resources sandbox-dp advertises, for the GPU models the vGPU\n\
         # model table knows: the chart makes one DeviceClass of each (templates/dra.yaml).\n",
    );
    for p in &problems {
        let _ = writeln!(out, "# left out: {p}");
    }
    out.push_str("resources:\n");
    for r in &resources {
        let _ = write!(out, "  - {{name: {}, class: {}, ", r.name, r.class());
        match &r.kind {
            Kind::Passthrough(ids) => {
                let ids: Vec<String> = ids.iter().map(|d| format!("\"{d:04x}\"")).collect();
                let _ = writeln!(out, "deviceIDs: [{}]}}", ids.join(", "));
            }
            Kind::Vgpu(t) => {
                let key = t.split_whitespace().last().unwrap_or_default();
                let _ = writeln!(out, "vgpuType: \"{t}\", key: \"{key}\"}}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_names_resources_as_sandbox_dp_does() {
        let ids = PciIds::embedded();
        let (all, problems) = catalogue(&ids, true, &Types::All);
        assert!(problems.is_empty(), "{problems:?}");
        let a10 = all
            .iter()
            .find(|r| r.name == "nvidia.com/GA102GL_A10")
            .unwrap();
        assert_eq!(a10.kind, Kind::Passthrough([0x2236].into()));
        assert_eq!(a10.class(), "ga102gl-a10.gpu-vm-node.io");
        assert_eq!(
            a10.selector("gpu.gpu-vm-node.io"),
            "device.driver == \"gpu.gpu-vm-node.io\" && \
             device.attributes[\"gpu.gpu-vm-node.io\"].mode == \"passthrough\" && \
             device.attributes[\"gpu.gpu-vm-node.io\"].deviceID in [\"2236\"]"
        );
        let q4 = all
            .iter()
            .find(|r| r.name == "nvidia.com/NVIDIA_A10-4Q")
            .unwrap();
        assert_eq!(q4.kind, Kind::Vgpu("NVIDIA A10-4Q".into()));
        assert_eq!(q4.class(), "nvidia-a10-4q.gpu-vm-node.io");
        // Every class name is a DNS subdomain, every name one the API accepts.
        for r in &all {
            assert!(crate::names::is_dns_subdomain(&r.class()), "{}", r.class());
            assert!(crate::prepare::is_resource_name(&r.name), "{}", r.name);
        }
        let (few, _) = catalogue(&ids, true, &crate::vgpu_types::parse("A10-4Q").unwrap());
        let vgpus: Vec<&str> = few
            .iter()
            .filter(|r| matches!(r.kind, Kind::Vgpu(_)))
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(vgpus, ["nvidia.com/NVIDIA_A10-4Q"]);
        let (whole, _) = catalogue(&ids, false, &Types::All);
        assert!(whole.iter().all(|r| matches!(r.kind, Kind::Passthrough(_))));
    }

    #[test]
    fn a_name_too_long_is_left_out_and_said_and_one_name_of_two_ids_is_one_resource() {
        let long = format!("nvidia.com/{}", "A".repeat(64));
        let (r, problems) = collect([
            (long.clone(), Kind::Vgpu("x".into())),
            ("nvidia.com/X".into(), Kind::Passthrough([1].into())),
            ("nvidia.com/X".into(), Kind::Passthrough([2].into())),
        ]);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].kind, Kind::Passthrough([1, 2].into()));
        assert!(problems[0].contains(&long), "{problems:?}");
    }

    #[test]
    fn permitted_devices_lists_every_name_as_served_by_an_external_provider() {
        let (r, _) = catalogue(
            &PciIds::embedded(),
            true,
            &crate::vgpu_types::parse("A10-4Q").unwrap(),
        );
        let block = permitted_devices(&r);
        assert!(block.contains(
            "    - pciVendorSelector: \"10DE:2236\"\n      resourceName: \"nvidia.com/GA102GL_A10\"\n      externalResourceProvider: true\n"
        ), "{block}");
        assert!(block.contains(
            "    - mdevNameSelector: \"NVIDIA A10-4Q\"\n      resourceName: \"nvidia.com/NVIDIA_A10-4Q\"\n"
        ), "{block}");
    }
}
