//! `sandbox-dp list` and `sandbox-dp permitted-devices`.

use std::fmt::Write as _;

use serde::Serialize;

use crate::discovery::{HEALTHY, Kind, Snapshot, UNHEALTHY};

#[derive(Serialize)]
struct ListDevice<'a> {
    id: &'a str,
    health: &'static str,
    numa_node: Option<i32>,
    iommu_group: Option<u32>,
    gpu: Option<&'a str>,
    driver: Option<&'a str>,
}

#[derive(Serialize)]
struct ListResource<'a> {
    name: &'a str,
    kind: Kind,
    env: String,
    socket: String,
    devices: Vec<ListDevice<'a>>,
}

#[derive(Serialize)]
struct List<'a> {
    resources: Vec<ListResource<'a>>,
    problems: &'a [String],
}

fn list(snap: &Snapshot) -> List<'_> {
    List {
        resources: snap
            .resources
            .values()
            .map(|r| ListResource {
                name: &r.name,
                kind: r.kind,
                env: r.env_var(),
                socket: crate::plugin::socket_name(&r.name),
                devices: r
                    .devices
                    .values()
                    .map(|d| ListDevice {
                        id: &d.id,
                        health: if d.healthy { HEALTHY } else { UNHEALTHY },
                        numa_node: d.numa_node,
                        iommu_group: d.iommu_group,
                        gpu: d.gpu.as_deref(),
                        driver: d.driver.as_deref(),
                    })
                    .collect(),
            })
            .collect(),
        problems: &snap.problems,
    }
}

/// `list --json`.
pub fn list_json(snap: &Snapshot) -> String {
    serde_json::to_string_pretty(&list(snap)).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

/// `list` as text.
pub fn list_text(snap: &Snapshot) -> String {
    let mut out = String::new();
    if snap.resources.is_empty() {
        out.push_str("no devices to advertise\n");
    }
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    for r in snap.resources.values() {
        let _ = writeln!(
            out,
            "{} ({:?}, {} devices, env {})",
            r.name,
            r.kind,
            r.devices.len(),
            r.env_var()
        );
        for d in r.devices.values() {
            let _ = writeln!(
                out,
                "  {:<38} {:<9} numa {:<3} group {:<5} gpu {}",
                d.id,
                if d.healthy { HEALTHY } else { UNHEALTHY },
                dash(d.numa_node.map(|n| n.to_string())),
                dash(d.iommu_group.map(|g| g.to_string())),
                dash(d.gpu.clone()),
            );
        }
    }
    for p in &snap.problems {
        let _ = writeln!(out, "problem: {p}");
    }
    out
}

fn q(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}

/// The KubeVirt `permittedHostDevices` block for what was found.
pub fn permitted_devices(snap: &Snapshot) -> String {
    let mut pci = String::new();
    let mut mdev = String::new();
    for r in snap.resources.values() {
        match r.kind {
            Kind::Passthrough | Kind::SriovVgpu => {
                for sel in &r.pci_selectors {
                    let _ = writeln!(pci, "    - pciVendorSelector: {}", q(sel));
                    let _ = writeln!(pci, "      resourceName: {}", q(&r.name));
                    let _ = writeln!(pci, "      externalResourceProvider: true");
                }
            }
            Kind::Mdev => {
                for t in &r.type_names {
                    let _ = writeln!(mdev, "    - mdevNameSelector: {}", q(t));
                    let _ = writeln!(mdev, "      resourceName: {}", q(&r.name));
                    let _ = writeln!(mdev, "      externalResourceProvider: true");
                }
            }
        }
    }
    let mut out = String::from("permittedHostDevices:\n");
    if pci.is_empty() {
        out.push_str("  pciHostDevices: []\n");
    } else {
        out.push_str("  pciHostDevices:\n");
        out.push_str(&pci);
    }
    if mdev.is_empty() {
        out.push_str("  mediatedDevices: []\n");
    } else {
        out.push_str("  mediatedDevices:\n");
        out.push_str(&mdev);
    }
    out
}
