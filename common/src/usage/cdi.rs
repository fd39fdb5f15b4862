//! Which device nodes a ResourceClaim's CDI devices are: the CDI specs on the node, as the
//! container runtime reads them (`<root>/etc/cdi` and `<root>/var/run/cdi`, JSON or YAML).
//!
//! A CDI device is named `<vendor>/<class>=<name>`; the spec of kind `<vendor>/<class>` lists it
//! under `devices[]` with its `containerEdits.deviceNodes[]` (`path`, and `hostPath` where the
//! host's differs), and edits at the spec's top level apply to each of its devices. Only what
//! is needed is read: nothing at all when no claim names a CDI device.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::Pod;
use super::kubelet::ListedClaim;
use crate::paths::HostPaths;

/// The claims' device nodes, and the claims whose nodes cannot be told.
#[derive(Debug, Default)]
pub(super) struct Resolved {
    /// Host path of a device node → the pods whose claims gave it to them.
    pub by_node: BTreeMap<String, Vec<Pod>>,
    /// Why some claim's nodes cannot be told, each naming the pod, the claim and the CDI device.
    pub unknown: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct Spec {
    kind: String,
    #[serde(default)]
    devices: Vec<SpecDevice>,
    #[serde(default, rename = "containerEdits")]
    edits: Option<Edits>,
}

#[derive(Debug, Deserialize)]
struct SpecDevice {
    name: String,
    #[serde(default, rename = "containerEdits")]
    edits: Option<Edits>,
}

#[derive(Debug, Default, Deserialize)]
struct Edits {
    #[serde(default, rename = "deviceNodes")]
    device_nodes: Vec<DeviceNode>,
}

#[derive(Debug, Deserialize)]
struct DeviceNode {
    path: String,
    #[serde(default, rename = "hostPath")]
    host_path: Option<String>,
}

impl Edits {
    fn host_nodes(&self) -> impl Iterator<Item = String> + '_ {
        self.device_nodes
            .iter()
            .map(|n| n.host_path.clone().unwrap_or_else(|| n.path.clone()))
    }
}

/// The device nodes of the claims' CDI devices, from the specs under `paths`. A CDI device no
/// spec defines leaves its pod's devices unknown, unless its claim's driver is one of
/// `keepers`, whose claim records say what the claim holds (its unprepare removes the spec
/// first and the record last).
pub(super) fn resolve(
    paths: &HostPaths,
    claims: Vec<ListedClaim>,
    keepers: &BTreeSet<String>,
) -> Resolved {
    let wanted: BTreeSet<&str> = claims
        .iter()
        .flat_map(|c| c.cdi_devices.iter().map(String::as_str))
        .collect();
    let mut out = Resolved::default();
    if wanted.is_empty() {
        for c in &claims {
            tracing::debug!(pod = %c.pod, "a claim's device with no CDI device: no device node to hold");
        }
        return out;
    }
    let dirs = paths.cdi_spec_dirs();
    let (nodes, unreadable) = read_specs(&dirs, &wanted);
    // Per pod, container and claim: the CDI devices no spec defines.
    let mut missing: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for c in &claims {
        let lost: Vec<&str> = c
            .cdi_devices
            .iter()
            .filter(|d| !nodes.contains_key(d.as_str()))
            .map(String::as_str)
            .collect();
        let recorded = c
            .pod
            .claim
            .as_ref()
            .is_some_and(|claim| keepers.contains(&claim.driver));
        if !lost.is_empty() && recorded {
            // Being unprepared, or unprepared: its record, while there is one, holds its devices.
            tracing::debug!(
                "{}: CDI device {} gone; its driver's record says what it holds",
                who(&c.pod),
                lost.join(", ")
            );
        } else if !lost.is_empty() {
            missing.entry(who(&c.pod)).or_default().extend(lost);
            continue;
        }
        let held: BTreeSet<&String> = c
            .cdi_devices
            .iter()
            .flat_map(|d| nodes.get(d.as_str()).into_iter().flatten())
            .collect();
        for node in held {
            let pods = out.by_node.entry(node.clone()).or_default();
            if !pods.contains(&c.pod) {
                pods.push(c.pod.clone());
            }
        }
    }
    let dirs = dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(" or ");
    for (who, lost) in missing {
        let mut why = format!(
            "cannot tell which devices {who} holds: CDI device {} is in no spec in {dirs}",
            lost.join(", ")
        );
        if !unreadable.is_empty() {
            why.push_str(&format!(" (unreadable: {})", unreadable.join("; ")));
        }
        out.unknown.push(why);
    }
    out
}

/// `pod vms/a (container compute) through claim vms/c`.
fn who(p: &Pod) -> String {
    let pod = match (&p.namespace, &p.name) {
        (Some(ns), Some(n)) => format!("pod {ns}/{n}"),
        _ => "a pod".into(),
    };
    match &p.claim {
        Some(c) => format!(
            "{pod} (container {}) through claim {}/{}",
            p.container, c.namespace, c.name
        ),
        None => format!("{pod} (container {})", p.container),
    }
}

/// Every spec file in `dirs` (in name order; a missing directory has none) that defines one of
/// `wanted`: CDI device name → its device nodes' host paths. Also the files that could not be
/// read or parsed, each with why.
fn read_specs(
    dirs: &[PathBuf],
    wanted: &BTreeSet<&str>,
) -> (BTreeMap<String, Vec<String>>, Vec<String>) {
    let mut nodes: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut unreadable = Vec::new();
    for dir in dirs {
        let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
            Ok(entries) => entries.filter_map(|e| e.ok()).map(|e| e.path()).collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                unreadable.push(format!("{}: {e}", dir.display()));
                continue;
            }
        };
        files.sort();
        for f in files.iter().filter(|f| is_spec_file(f)) {
            let spec = match parse(f) {
                Ok(s) => s,
                Err(e) => {
                    unreadable.push(format!("{}: {e}", f.display()));
                    continue;
                }
            };
            let common: Vec<String> = spec
                .edits
                .as_ref()
                .map(|e| e.host_nodes().collect())
                .unwrap_or_default();
            for d in &spec.devices {
                let id = format!("{}={}", spec.kind, d.name);
                if !wanted.contains(id.as_str()) {
                    continue;
                }
                let entry = nodes.entry(id).or_default();
                let own = d.edits.iter().flat_map(Edits::host_nodes);
                for n in own.chain(common.iter().cloned()) {
                    if !entry.contains(&n) {
                        entry.push(n);
                    }
                }
            }
        }
    }
    (nodes, unreadable)
}

/// A CDI spec file, by its name as CDI defines it: `*.json` or `*.yaml`; names starting with
/// `.` (a writer's temporary file) are not specs.
fn is_spec_file(p: &Path) -> bool {
    let hidden = p
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with('.'));
    let ext = p.extension().and_then(|e| e.to_str());
    !hidden && matches!(ext, Some("json" | "yaml"))
}

/// Why a spec file could not be used; the caller names the file.
#[derive(Debug, thiserror::Error)]
enum SpecError {
    /// It cannot be read.
    #[error(transparent)]
    Read(#[from] std::io::Error),
    /// It is not JSON, or not a spec.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// It is not YAML, or not a spec.
    #[error(transparent)]
    Yaml(#[from] yaml_serde::Error),
}

fn parse(p: &Path) -> Result<Spec, SpecError> {
    let text = std::fs::read_to_string(p)?;
    if p.extension().is_some_and(|e| e == "json") {
        Ok(serde_json::from_str(&text)?)
    } else {
        Ok(yaml_serde::from_str(&text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::{Claim, PodSource};

    fn listed(claim: &str, cdi: &[&str]) -> ListedClaim {
        ListedClaim {
            pod: Pod {
                namespace: Some("vms".into()),
                name: Some("virt-launcher-a".into()),
                uid: None,
                container: "compute".into(),
                resource: "gpu.gpu-vm-node.io".into(),
                claim: Some(Claim {
                    namespace: "vms".into(),
                    name: claim.into(),
                    driver: "gpu.gpu-vm-node.io".into(),
                    pool: "node-a".into(),
                    device: "gpu-0000-41-00-0".into(),
                }),
                source: PodSource::PodResources,
            },
            cdi_devices: cdi.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn json_and_yaml_specs_name_the_nodes_and_a_missing_device_is_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        let run = dir.path().join("var/run/cdi");
        let etc = dir.path().join("etc/cdi");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::create_dir_all(&etc).unwrap();
        // As sandbox-dra writes it: host paths, the metadata device with a mount only.
        std::fs::write(
            run.join("gpu.gpu-vm-node.io_u1.json"),
            r#"{"cdiVersion":"0.5.0","kind":"gpu.gpu-vm-node.io/vfio","devices":[
                {"name":"u1-gpu-0000-41-00-0","containerEdits":{"deviceNodes":[
                    {"path":"/dev/vfio/vfio"},{"path":"/dev/vfio/21"}]}},
                {"name":"u1-metadata-gpu","containerEdits":{"mounts":[
                    {"hostPath":"/x","containerPath":"/y"}]}}]}"#,
        )
        .unwrap();
        // Another vendor's, in YAML, with nodes common to its devices and a host path that
        // differs from the container's.
        std::fs::write(
            etc.join("example.yaml"),
            "cdiVersion: 0.6.0\nkind: example.com/gpu\ncontainerEdits:\n  deviceNodes:\n    \
             - path: /dev/nvidiactl\ndevices:\n  - name: g0\n    containerEdits:\n      \
             deviceNodes:\n        - path: /dev/gpu0\n          hostPath: /dev/nvidia0\n",
        )
        .unwrap();
        // A broken file and a writer's temporary file are not the end of it.
        std::fs::write(run.join("broken.json"), "{").unwrap();
        std::fs::write(run.join(".tmp.json"), "{").unwrap();

        let r = resolve(
            &paths,
            vec![
                listed(
                    "a",
                    &[
                        "gpu.gpu-vm-node.io/vfio=u1-gpu-0000-41-00-0",
                        "gpu.gpu-vm-node.io/vfio=u1-metadata-gpu",
                    ],
                ),
                listed("b", &["example.com/gpu=g0"]),
                listed("c", &["gpu.gpu-vm-node.io/vfio=gone"]),
                listed("d", &[]),
            ],
            &BTreeSet::new(),
        );
        let names = |node: &str| -> Vec<String> {
            r.by_node[node]
                .iter()
                .map(|p| p.claim.as_ref().unwrap().name.clone())
                .collect()
        };
        assert_eq!(
            r.by_node.keys().collect::<Vec<_>>(),
            vec![
                "/dev/nvidia0",
                "/dev/nvidiactl",
                "/dev/vfio/21",
                "/dev/vfio/vfio"
            ]
        );
        assert_eq!(names("/dev/vfio/21"), ["a"]);
        assert_eq!(names("/dev/nvidia0"), ["b"]);
        assert_eq!(r.unknown.len(), 1, "{:?}", r.unknown);
        let e = &r.unknown[0];
        assert!(
            e.starts_with(
                "cannot tell which devices pod vms/virt-launcher-a (container compute) through \
                 claim vms/c holds: CDI device gpu.gpu-vm-node.io/vfio=gone is in no spec in "
            ),
            "{e}"
        );
        assert!(e.contains("broken.json") && !e.contains(".tmp.json"), "{e}");
    }

    #[test]
    fn a_gone_spec_of_a_driver_that_keeps_records_is_left_to_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        let gone = || vec![listed("c", &["gpu.gpu-vm-node.io/vfio=gone"])];
        // The driver keeps claim records: the record, or none, says what the claim holds.
        let keepers = BTreeSet::from(["gpu.gpu-vm-node.io".to_string()]);
        let r = resolve(&paths, gone(), &keepers);
        assert!(r.by_node.is_empty() && r.unknown.is_empty(), "{r:?}");
        // Another driver's: nothing says what it holds.
        let keepers = BTreeSet::from(["example.com".to_string()]);
        let r = resolve(&paths, gone(), &keepers);
        assert_eq!(r.unknown.len(), 1, "{r:?}");
    }

    #[test]
    fn no_cdi_device_reads_no_spec() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        // A directory that cannot be read would be an error: it is not even looked at.
        std::fs::write(dir.path().join("etc"), "not a directory").unwrap();
        let r = resolve(&paths, vec![listed("a", &[])], &BTreeSet::new());
        assert!(r.by_node.is_empty() && r.unknown.is_empty(), "{r:?}");
    }
}
