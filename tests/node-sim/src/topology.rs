//! Topologies: which PCI functions a simulated node has, where they sit, which drivers they
//! start on. Built-ins by name, or a TOML file (format in `tests/node-sim/README.md`).

use std::collections::BTreeSet;
use std::path::Path;

use serde::Deserialize;

use crate::catalogue::{GpuModel, catalogue};
use crate::{Error, Result};

/// Names of the built-in topologies.
pub const BUILTINS: &[&str] = &[
    "2xA10",
    "4xT4",
    "8xA100",
    "8xH100-sriov",
    "rtx-workstation",
    "foreign-group",
    "mixed",
];

fn builtin_text(name: &str) -> Option<&'static str> {
    Some(match name {
        "2xA10" => include_str!("../topologies/2xA10.toml"),
        "4xT4" => include_str!("../topologies/4xT4.toml"),
        "8xA100" => include_str!("../topologies/8xA100.toml"),
        "8xH100-sriov" => include_str!("../topologies/8xH100-sriov.toml"),
        "rtx-workstation" => include_str!("../topologies/rtx-workstation.toml"),
        "foreign-group" => include_str!("../topologies/foreign-group.toml"),
        "mixed" => include_str!("../topologies/mixed.toml"),
        _ => return None,
    })
}

/// The file format.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TopologyFile {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    release: Option<String>,
    #[serde(default)]
    iommufd: bool,
    #[serde(default)]
    vfio_drivers: Vec<String>,
    #[serde(default)]
    modules_alias: Vec<String>,
    #[serde(default, rename = "bridge")]
    bridges: Vec<BridgeFile>,
    #[serde(default, rename = "device")]
    devices: Vec<DeviceFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BridgeFile {
    address: String,
    #[serde(default)]
    parent: Option<String>,
    #[serde(default)]
    numa: Option<i32>,
    #[serde(default)]
    group: Option<u32>,
    #[serde(default)]
    vendor: Option<u16>,
    #[serde(default)]
    device: Option<u16>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceFile {
    address: String,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    vendor: Option<u16>,
    #[serde(default)]
    device: Option<u16>,
    #[serde(default)]
    subsystem_vendor: Option<u16>,
    #[serde(default)]
    subsystem_device: Option<u16>,
    #[serde(default)]
    class: Option<u32>,
    #[serde(default)]
    driver: Option<String>,
    #[serde(default)]
    default_driver: Option<String>,
    #[serde(default)]
    group: Option<u32>,
    #[serde(default)]
    numa: Option<i32>,
    #[serde(default)]
    bridge: Option<String>,
}

/// A PCI bridge or switch port: a parent directory in `/sys/devices`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bridge {
    /// `DDDD:BB:DD.F`.
    pub address: String,
    /// The bridge above it, if any (else it sits under the root complex `pciDDDD:BB`).
    pub parent: Option<String>,
    /// NUMA node.
    pub numa: i32,
    /// IOMMU group.
    pub group: u32,
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
}

/// One PCI function of the topology, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// `DDDD:BB:DD.F`.
    pub address: String,
    /// Catalogue model, for NVIDIA GPUs defined by model.
    pub model: Option<String>,
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
    /// Subsystem vendor id.
    pub subsystem_vendor: u16,
    /// Subsystem device id.
    pub subsystem_device: u16,
    /// Class, 24 bits.
    pub class: u32,
    /// The driver it starts on (`None`: unbound).
    pub driver: Option<String>,
    /// The driver that takes it on a probe without `driver_override`.
    pub default_driver: Option<String>,
    /// IOMMU group.
    pub group: u32,
    /// NUMA node.
    pub numa: i32,
    /// The bridge it sits under.
    pub bridge: Option<String>,
}

/// A resolved topology.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Name (built-in name or file stem).
    pub name: String,
    /// What it imitates.
    pub description: String,
    /// Kernel release (`proc/sys/kernel/osrelease`, `lib/modules/<release>`).
    pub release: String,
    /// Whether VFIO device cdevs exist (`/dev/iommu`, `/dev/vfio/devices/vfioN`).
    pub iommufd: bool,
    /// Variant VFIO drivers registered besides `vfio-pci`.
    pub vfio_drivers: Vec<String>,
    /// Lines of `lib/modules/<release>/modules.alias`.
    pub modules_alias: Vec<String>,
    /// Bridges, parents first.
    pub bridges: Vec<Bridge>,
    /// Endpoint functions.
    pub devices: Vec<Device>,
}

impl Topology {
    /// Every driver the node has: the base set, the variant VFIO drivers and every driver a
    /// device names.
    pub fn drivers(&self) -> BTreeSet<String> {
        let mut d: BTreeSet<String> = [
            "nvidia",
            "nouveau",
            "vfio-pci",
            "snd_hda_intel",
            "xhci_hcd",
            "pcieport",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        d.extend(self.vfio_drivers.iter().cloned());
        for dev in &self.devices {
            d.extend(dev.driver.iter().cloned());
            d.extend(dev.default_driver.iter().cloned());
        }
        d
    }

    /// The device at `address`.
    pub fn device(&self, address: &str) -> Option<&Device> {
        self.devices.iter().find(|d| d.address == address)
    }

    /// Parses a topology file's text. `name` is used when the file has none.
    pub fn parse(text: &str, name: &str) -> Result<Topology> {
        let f: TopologyFile = toml::from_str(text).map_err(|e| Error::Topology {
            name: name.to_string(),
            reason: e.to_string(),
        })?;
        resolve(f, name)
    }
}

/// A built-in topology by name, or a TOML file by path.
pub fn topology(name_or_file: &str) -> Result<Topology> {
    if let Some(text) = builtin_text(name_or_file) {
        return Topology::parse(text, name_or_file);
    }
    let path = Path::new(name_or_file);
    if !path.exists() {
        return Err(Error::Topology {
            name: name_or_file.to_string(),
            reason: format!(
                "neither a built-in topology ({}) nor an existing file",
                BUILTINS.join(", ")
            ),
        });
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(name_or_file);
    Topology::parse(&text, stem)
}

/// Checks a `DDDD:BB:DD.F` address and returns it in lower case.
pub(crate) fn parse_bdf(s: &str) -> Option<String> {
    let b = s.as_bytes();
    if b.len() != 12 || b[4] != b':' || b[7] != b':' || b[10] != b'.' {
        return None;
    }
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(|c| c.is_ascii_hexdigit());
    if !(hex(0..4) && hex(5..7) && hex(8..10) && (b'0'..=b'7').contains(&b[11])) {
        return None;
    }
    let dev = u8::from_str_radix(&s[8..10], 16).ok()?;
    if dev > 0x1f {
        return None;
    }
    Some(s.to_ascii_lowercase())
}

fn resolve(f: TopologyFile, fallback_name: &str) -> Result<Topology> {
    let name = f.name.clone().unwrap_or_else(|| fallback_name.to_string());
    let err = |reason: String| Error::Topology {
        name: name.clone(),
        reason,
    };
    let cat = catalogue();
    let mut used_groups: BTreeSet<u32> = BTreeSet::new();
    for g in f
        .bridges
        .iter()
        .filter_map(|b| b.group)
        .chain(f.devices.iter().filter_map(|d| d.group))
    {
        used_groups.insert(g);
    }
    let mut next_group = used_groups.last().map_or(1, |g| g + 1);
    let mut alloc = |explicit: Option<u32>| {
        explicit.unwrap_or_else(|| {
            let g = next_group;
            next_group += 1;
            g
        })
    };
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut bridges = Vec::new();
    for b in &f.bridges {
        let address = parse_bdf(&b.address).ok_or_else(|| {
            err(format!(
                "bridge address {:?} is not DDDD:BB:DD.F",
                b.address
            ))
        })?;
        if !seen.insert(address.clone()) {
            return Err(err(format!("address {address} appears twice")));
        }
        let parent = match &b.parent {
            Some(p) => {
                let p = parse_bdf(p).ok_or_else(|| {
                    err(format!(
                        "bridge {address}: parent {p:?} is not a PCI address"
                    ))
                })?;
                if !bridges.iter().any(|x: &Bridge| x.address == p) {
                    return Err(err(format!(
                        "bridge {address}: parent {p} must be listed before it"
                    )));
                }
                Some(p)
            }
            None => None,
        };
        let numa = b
            .numa
            .or_else(|| {
                parent
                    .as_ref()
                    .and_then(|p| bridges.iter().find(|x: &&Bridge| &x.address == p))
                    .map(|x| x.numa)
            })
            .unwrap_or(0);
        bridges.push(Bridge {
            address,
            parent,
            numa,
            group: alloc(b.group),
            vendor: b.vendor.unwrap_or(0x8086),
            device: b.device.unwrap_or(0x2030),
        });
    }
    let mut devices = Vec::new();
    for d in &f.devices {
        let address = parse_bdf(&d.address).ok_or_else(|| {
            err(format!(
                "device address {:?} is not DDDD:BB:DD.F",
                d.address
            ))
        })?;
        if !seen.insert(address.clone()) {
            return Err(err(format!("address {address} appears twice")));
        }
        let model: Option<&GpuModel> = match &d.model {
            Some(m) => Some(cat.model(m).ok_or_else(|| {
                err(format!(
                    "device {address}: unknown model {m:?} (catalogue has {})",
                    cat.gpus
                        .iter()
                        .map(|g| g.model.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?),
            None => None,
        };
        let vendor = d
            .vendor
            .or(model.map(|_| 0x10de))
            .ok_or_else(|| err(format!("device {address}: needs a model or a vendor id")))?;
        let device = d
            .device
            .or(model.map(|m| m.device))
            .ok_or_else(|| err(format!("device {address}: needs a model or a device id")))?;
        let class = d
            .class
            .or(model.map(|m| m.class))
            .ok_or_else(|| err(format!("device {address}: needs a model or a class")))?;
        let bridge = match &d.bridge {
            Some(b) => {
                let b = parse_bdf(b).ok_or_else(|| {
                    err(format!(
                        "device {address}: bridge {b:?} is not a PCI address"
                    ))
                })?;
                if !bridges.iter().any(|x| x.address == b) {
                    return Err(err(format!("device {address}: bridge {b} is not listed")));
                }
                Some(b)
            }
            None => None,
        };
        let numa = d
            .numa
            .or_else(|| {
                bridge
                    .as_ref()
                    .and_then(|b| bridges.iter().find(|x| &x.address == b))
                    .map(|x| x.numa)
            })
            .unwrap_or(0);
        let default_driver = match &d.default_driver {
            Some(s) if s.is_empty() || s == "none" => None,
            Some(s) => Some(s.clone()),
            None => default_driver_for(vendor, class),
        };
        let driver = match &d.driver {
            Some(s) if s.is_empty() || s == "none" => None,
            Some(s) => Some(s.clone()),
            None => default_driver.clone(),
        };
        devices.push(Device {
            address,
            model: model.map(|m| m.model.clone()),
            vendor,
            device,
            subsystem_vendor: d
                .subsystem_vendor
                .or(model.map(|m| m.subsystem_vendor))
                .unwrap_or(vendor),
            subsystem_device: d
                .subsystem_device
                .or(model.map(|m| m.subsystem_device))
                .unwrap_or(0),
            class,
            driver,
            default_driver,
            group: alloc(d.group),
            numa,
            bridge,
        });
    }
    for line in &f.modules_alias {
        if !line.starts_with("alias ") {
            return Err(err(format!(
                "modules_alias line {line:?} does not start with \"alias \""
            )));
        }
    }
    Ok(Topology {
        name,
        description: f.description.unwrap_or_default(),
        release: f.release.unwrap_or_else(|| "6.1.0-sim".to_string()),
        iommufd: f.iommufd,
        vfio_drivers: f.vfio_drivers,
        modules_alias: f.modules_alias,
        bridges,
        devices,
    })
}

/// The driver a device of this vendor and class gets from the kernel's id tables.
pub(crate) fn default_driver_for(vendor: u16, class: u32) -> Option<String> {
    let d = match (vendor, class >> 8) {
        (0x10de, 0x0300 | 0x0302) => "nvidia",
        (_, 0x0403) => "snd_hda_intel",
        (_, 0x0c03) => "xhci_hcd",
        (_, 0x0604) => "pcieport",
        _ => return None,
    };
    Some(d.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_resolves() {
        for name in BUILTINS {
            let t = topology(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(&t.name, name);
            assert!(!t.devices.is_empty());
        }
    }

    #[test]
    fn bdf_parsing_is_strict() {
        assert_eq!(parse_bdf("0000:41:00.0").as_deref(), Some("0000:41:00.0"));
        assert_eq!(parse_bdf("0000:AF:00.0").as_deref(), Some("0000:af:00.0"));
        for bad in [
            "41:00.0",
            "0000:41:00.8",
            "0000:41:20.0",
            "0000:41:00.0\n",
            "garbage",
        ] {
            assert_eq!(parse_bdf(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn file_errors_name_the_problem() {
        let e = Topology::parse(
            "[[device]]\naddress = \"0000:01:00.0\"\nmodel = \"X9\"\n",
            "t",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("unknown model \"X9\""), "{e}");
        let e = Topology::parse("[[device]]\naddress = \"1:0.0\"\nmodel = \"A10\"\n", "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains("1:0.0"), "{e}");
    }
}
