//! KubeVirt's own virt-launcher code as the judge of what a VM pod's container holds
//! (`tests/kubevirt-check`: one program per KubeVirt version, built on its released modules).
//!
//! [`Cluster::kubevirt_hostdevs`] runs every checker on a running container of the cluster: its
//! environment as the runtime started it (`/proc/<pid>/environ`, which the device-plugin
//! builders read) and its own root (`/proc/<pid>/root`, under which the DRA builders find the
//! metadata files where the container sees them), with a VMI naming what the pod was given.
//! Each checker prints the libvirt `<hostdev>`s KubeVirt would put into the domain, or
//! KubeVirt's error: the VM would not start.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use crate::Cluster;

/// What one KubeVirt version made of a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judged {
    /// `v1.9.0`: the `kubevirt.io/kubevirt` version the checker links.
    pub version: String,
    /// The `<hostdev>` elements, one per line, in the order KubeVirt builds them.
    pub hostdevs: Vec<String>,
}

impl Judged {
    /// What each `<hostdev>` hands the VM: an mdev's UUID, or a PCI function's address
    /// (`0000:41:00.0`).
    pub fn devices(&self) -> Vec<String> {
        self.hostdevs
            .iter()
            .filter_map(|h| hostdev_device(h))
            .collect()
    }
}

/// The UUID (`type="mdev"`) or PCI address (`type="pci"`) a libvirt `<hostdev>` names.
pub fn hostdev_device(xml: &str) -> Option<String> {
    let attr = |name: &str| -> Option<&str> {
        let start = xml.find(&format!(" {name}=\""))? + name.len() + 3;
        let len = xml[start..].find('"')?;
        Some(&xml[start..start + len])
    };
    if xml.contains("type=\"mdev\"") {
        return attr("uuid").map(str::to_string);
    }
    let hex = |name: &str| -> Option<u32> {
        u32::from_str_radix(attr(name)?.trim_start_matches("0x"), 16).ok()
    };
    Some(format!(
        "{:04x}:{:02x}:{:02x}.{:x}",
        hex("domain")?,
        hex("bus")?,
        hex("slot")?,
        hex("function")?
    ))
}

impl Cluster {
    /// The host PID of container `container` of pod `namespace/pod` (its process as the
    /// runtime started it).
    pub fn container_pid(&self, namespace: &str, pod: &str, container: &str) -> Result<u32> {
        let p = self.get_json(&["pod", "-n", namespace, pod])?;
        let id = p["status"]["containerStatuses"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["name"] == container)
            .and_then(|s| s["containerID"].as_str())
            .and_then(|s| s.strip_prefix("containerd://"))
            .with_context(|| format!("pod {namespace}/{pod} has no running container {container}"))?
            .to_string();
        let tasks = self.node().ctr(&["tasks", "ls"])?;
        tasks
            .lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(id.as_str())).then(|| f.next()?.parse().ok())?
            })
            .with_context(|| format!("containerd has no task {id} (pod {namespace}/{pod})"))
    }

    /// Runs KubeVirt's own virt-launcher code, every version prepared, on container `vm` of
    /// pod `namespace/pod` with the VMI `vmi` (YAML naming the pod's resources, claims and
    /// requests): what each version hands the VM. Fails with KubeVirt's error when a version
    /// would not start the VM.
    pub fn kubevirt_hostdevs(&self, namespace: &str, pod: &str, vmi: &str) -> Result<Vec<Judged>> {
        let checkers = self.assets().kubevirt_checkers.clone();
        ensure!(
            !checkers.is_empty(),
            "no KubeVirt checker prepared (tests/cluster/prepare.sh builds them)"
        );
        let pid = self.container_pid(namespace, pod, "vm")?;
        let file = self.dir().join(format!("vmi-{namespace}-{pod}.yaml"));
        std::fs::write(&file, vmi).with_context(|| format!("writing {}", file.display()))?;
        let mut out = Vec::new();
        for checker in &checkers {
            out.push(judge(checker, &file, pid).with_context(|| {
                format!(
                    "{} on pod {namespace}/{pod} with the VMI\n{vmi}",
                    checker.display()
                )
            })?);
        }
        Ok(out)
    }
}

fn judge(checker: &Path, vmi: &Path, pid: u32) -> Result<Judged> {
    let out = Command::new(checker)
        .arg("--vmi")
        .arg(vmi)
        .arg("--env")
        .arg(format!("/proc/{pid}/environ"))
        .arg("--root")
        .arg(format!("/proc/{pid}/root"))
        .output()
        .with_context(|| format!("running {}", checker.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let version = lines
        .next()
        .and_then(|l| l.strip_prefix("kubevirt "))
        .unwrap_or("?")
        .to_string();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let error: Vec<&str> = stderr.lines().filter(|l| !l.starts_with('{')).collect();
        bail!(
            "KubeVirt {version} would not start the VM ({}): {}",
            out.status,
            error.join("\n")
        );
    }
    Ok(Judged {
        version,
        hostdevs: lines.map(str::to_string).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hostdev_names_its_mdev_or_its_pci_function() {
        let mdev = r#"<hostdev mode="subsystem" type="mdev" model="vfio-pci" display="on" ramfb="on"><source><address uuid="2d8306f9-a884-4df9-9778-7988d9be8d39"></address></source><alias name="ua-gpu-vgpu1"></alias></hostdev>"#;
        assert_eq!(
            hostdev_device(mdev).as_deref(),
            Some("2d8306f9-a884-4df9-9778-7988d9be8d39")
        );
        let pci = r#"<hostdev type="pci" managed="no"><source><address type="pci" domain="0x0000" bus="0x41" slot="0x00" function="0x0"></address></source><alias name="ua-gpu-gpu1"></alias></hostdev>"#;
        assert_eq!(hostdev_device(pci).as_deref(), Some("0000:41:00.0"));
        assert_eq!(hostdev_device("<hostdev/>"), None);
    }
}
