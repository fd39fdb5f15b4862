//! Which functions to bind, grouped by IOMMU group, and to which driver.
//!
//! The default selection is every display-class function (VGA `0x0300`, 3D `0x0302`) of the
//! selected vendors (default NVIDIA `10de`) that is not an SR-IOV VF, plus every other endpoint
//! function of its IOMMU group (HDMI audio, USB-C controllers): a group is given to a VM whole
//! or not at all. Bridges are never selected. A group that also holds an endpoint of another
//! vendor is refused, naming that device, unless foreign devices are allowed.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use super::alias::{AliasTable, VFIO_PCI};
use crate::{Inventory, PciAddress, PciDevice, parse_hex16};

/// NVIDIA's PCI vendor id.
pub const NVIDIA: u16 = 0x10de;

/// A `VVVV:DDDD` vendor:device pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
}

/// A string that is not a `VVVV:DDDD` device id.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a VVVV:DDDD device id: {0:?}")]
pub struct BadDeviceId(pub String);

impl FromStr for DeviceId {
    type Err = BadDeviceId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || BadDeviceId(s.to_string());
        let (v, d) = s.split_once(':').ok_or_else(err)?;
        Ok(DeviceId {
            vendor: parse_hex16(v).ok_or_else(err)?,
            device: parse_hex16(d).ok_or_else(err)?,
        })
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:04x}", self.vendor, self.device)
    }
}

/// What the operator selected on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selector {
    /// Vendors whose display functions are selected (`--vendor`, default `10de`).
    pub vendors: Vec<u16>,
    /// Only functions with these ids (`--device`); every display function of `vendors` when
    /// empty.
    pub devices: Vec<DeviceId>,
    /// Exactly these functions (`--address`), whatever their class.
    pub addresses: Vec<PciAddress>,
    /// Never these functions (`--exclude`).
    pub exclude: Vec<PciAddress>,
    /// Bind a group even when it holds another vendor's endpoint (`--allow-foreign-in-group`).
    pub allow_foreign_in_group: bool,
}

impl Default for Selector {
    fn default() -> Self {
        Selector {
            vendors: vec![NVIDIA],
            devices: Vec::new(),
            addresses: Vec::new(),
            exclude: Vec::new(),
            allow_foreign_in_group: false,
        }
    }
}

/// One function to put on a VFIO driver.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Target {
    /// Its address.
    pub address: PciAddress,
    /// `VVVV:DDDD`.
    pub id: String,
    /// Its IOMMU group.
    pub group: u32,
    /// The driver it is on now.
    pub driver: Option<String>,
    /// Its `driver_override` now.
    pub driver_override: Option<String>,
    /// The VFIO driver it should be on.
    pub target: String,
    /// Selected in its own right (a GPU), rather than as a member of a selected GPU's group.
    pub primary: bool,
    /// Its VFIO cdev (`vfio0`), when the kernel has made one.
    pub vfio_cdev: Option<String>,
}

impl Target {
    /// On its VFIO driver now.
    pub fn is_bound(&self) -> bool {
        self.driver.as_deref() == Some(self.target.as_str())
    }
}

/// A selected function that will not be touched, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Refusal {
    /// The function.
    pub address: PciAddress,
    /// Its IOMMU group, when it has one.
    pub group: Option<u32>,
    /// A sentence naming the reason (and the offending device).
    pub reason: String,
}

/// The selection, grouped by IOMMU group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Selection {
    /// Functions to bind, by group, in address order within each group.
    pub groups: BTreeMap<u32, Vec<Target>>,
    /// Functions that were selected but are refused.
    pub refused: Vec<Refusal>,
}

impl Selection {
    /// Every target, group by group.
    pub fn targets(&self) -> impl Iterator<Item = &Target> {
        self.groups.values().flatten()
    }

    /// The number of selected functions, refused ones included.
    pub fn len(&self) -> usize {
        self.targets().count() + self.refused.len()
    }

    /// Nothing selected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Selects functions from `inv`. `forced_driver` is `--driver`; otherwise `aliases` names a
/// variant driver, or `vfio-pci`.
pub fn select(
    inv: &Inventory,
    sel: &Selector,
    forced_driver: Option<&str>,
    aliases: &AliasTable,
) -> Selection {
    let excluded: BTreeSet<PciAddress> = sel.exclude.iter().copied().collect();
    let mut out = Selection::default();
    let mut primaries: Vec<&PciDevice> = Vec::new();

    if sel.addresses.is_empty() {
        primaries.extend(inv.devices.values().filter(|d| {
            !d.is_vf()
                && !d.is_bridge()
                && if sel.devices.is_empty() {
                    d.is_display() && sel.vendors.contains(&d.vendor)
                } else {
                    sel.devices.contains(&DeviceId {
                        vendor: d.vendor,
                        device: d.device,
                    })
                }
        }));
    } else {
        let wanted: BTreeSet<PciAddress> = sel.addresses.iter().copied().collect();
        for a in wanted {
            match inv.device(&a) {
                Some(d) if d.is_bridge() => out.refused.push(Refusal {
                    address: a,
                    group: d.iommu_group,
                    reason: format!(
                        "{a} is a bridge (class {:06x}); bridges are never bound",
                        d.class
                    ),
                }),
                Some(d) => primaries.push(d),
                None => out.refused.push(Refusal {
                    address: a,
                    group: None,
                    reason: format!("{a}: no such PCI device on this node"),
                }),
            }
        }
    }
    primaries.retain(|d| !excluded.contains(&d.address));

    // Group the primaries; each group is decided once.
    let mut by_group: BTreeMap<u32, Vec<&PciDevice>> = BTreeMap::new();
    for d in primaries {
        match d.iommu_group {
            Some(g) => by_group.entry(g).or_default().push(d),
            None => out.refused.push(Refusal {
                address: d.address,
                group: None,
                reason: format!(
                    "{} has no IOMMU group (is the IOMMU enabled: intel_iommu=on / amd_iommu=on?)",
                    d.address
                ),
            }),
        }
    }

    for (group, prims) in by_group {
        let home: BTreeSet<u16> = sel
            .vendors
            .iter()
            .copied()
            .chain(prims.iter().map(|d| d.vendor))
            .collect();
        let primary_set: BTreeSet<PciAddress> = prims.iter().map(|d| d.address).collect();
        let members: Vec<&PciDevice> = inv
            .group_members(group)
            .iter()
            .filter_map(|a| inv.device(a))
            .filter(|d| !d.is_bridge())
            .collect();
        let foreign: Vec<&PciDevice> = members
            .iter()
            .copied()
            .filter(|d| !home.contains(&d.vendor) && !primary_set.contains(&d.address))
            .collect();
        let excluded_members: Vec<&PciDevice> = members
            .iter()
            .copied()
            .filter(|d| excluded.contains(&d.address))
            .collect();
        let unknown = inv.unreadable_in_group.get(&group).and_then(|v| v.first());
        let refusal = if let Some(u) = unknown {
            Some(format!(
                "IOMMU group {group} also holds {u}, whose sysfs entry cannot be read; a group is \
                 given to a VM whole, so it is left alone"
            ))
        } else if let (false, Some(f)) = (sel.allow_foreign_in_group, foreign.first()) {
            Some(format!(
                "IOMMU group {group} also holds {} ({}, class {:06x}), which is not a GPU \
                 function; refusing the group (--allow-foreign-in-group binds it too)",
                f.address,
                f.id_string(),
                f.class
            ))
        } else {
            excluded_members.first().map(|x| {
                format!(
                    "IOMMU group {group} also holds {}, which is excluded; a group is given \
                     to a VM whole, so it is left alone",
                    x.address
                )
            })
        };
        if let Some(reason) = refusal {
            for d in prims {
                out.refused.push(Refusal {
                    address: d.address,
                    group: Some(group),
                    reason: format!("{}: {reason}", d.address),
                });
            }
            continue;
        }
        let targets = members
            .iter()
            .map(|d| Target {
                address: d.address,
                id: d.id_string(),
                group,
                driver: d.driver.clone(),
                driver_override: d.driver_override.clone(),
                target: forced_driver
                    .map(str::to_string)
                    .or_else(|| d.modalias.as_deref().and_then(|m| aliases.driver_for(m)))
                    .unwrap_or_else(|| VFIO_PCI.to_string()),
                primary: primary_set.contains(&d.address),
                vfio_cdev: d.vfio_cdev.clone(),
            })
            .collect();
        out.groups.insert(group, targets);
    }
    out.refused.sort_by_key(|r| r.address);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(addr: &str, vendor: u16, device: u16, class: u32, group: u32) -> PciDevice {
        PciDevice {
            driver: Some("nvidia".into()),
            iommu_group: Some(group),
            modalias: Some(format!(
                "pci:v0000{vendor:04X}d0000{device:04X}sv00000000sd00000000bc{:02X}sc{:02X}i00",
                class >> 16,
                (class >> 8) & 0xff
            )),
            ..PciDevice::new(addr.parse().unwrap(), vendor, device, class)
        }
    }

    fn inv(devs: Vec<PciDevice>) -> Inventory {
        Inventory {
            devices: devs.into_iter().map(|d| (d.address, d)).collect(),
            ..Default::default()
        }
    }

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    fn addrs(s: &Selection) -> Vec<String> {
        s.targets().map(|t| t.address.to_string()).collect()
    }

    fn workstation() -> Inventory {
        let mut audio = dev("0000:01:00.1", NVIDIA, 0x22ba, 0x040300, 1);
        audio.driver = Some("snd_hda_intel".into());
        let mut bridge = dev("0000:00:01.0", 0x8086, 0x1901, 0x060400, 1);
        bridge.driver = Some("pcieport".into());
        inv(vec![
            dev("0000:01:00.0", NVIDIA, 0x2684, 0x030000, 1),
            audio,
            bridge,
            dev("0000:02:00.0", 0x8086, 0x1572, 0x020000, 2),
        ])
    }

    #[test]
    fn default_selects_gpus_and_their_group_companions_but_not_bridges() {
        let s = select(
            &workstation(),
            &Selector::default(),
            None,
            &AliasTable::default(),
        );
        assert_eq!(addrs(&s), ["0000:01:00.0", "0000:01:00.1"]);
        assert!(s.refused.is_empty());
        let t: Vec<_> = s.targets().collect();
        assert!(t[0].primary && !t[1].primary);
        assert!(t.iter().all(|t| t.target == "vfio-pci" && t.group == 1));
    }

    #[test]
    fn a_foreign_endpoint_refuses_the_group_and_is_named() {
        let i = inv(vec![
            dev("0000:41:00.0", NVIDIA, 0x2236, 0x030200, 7),
            dev("0000:41:00.1", 0x8086, 0x1572, 0x020000, 7),
            dev("0000:81:00.0", NVIDIA, 0x2236, 0x030200, 8),
        ]);
        let s = select(&i, &Selector::default(), None, &AliasTable::default());
        assert_eq!(addrs(&s), ["0000:81:00.0"]);
        assert_eq!(s.refused.len(), 1);
        assert_eq!(s.refused[0].address, a("0000:41:00.0"));
        assert!(
            s.refused[0].reason.contains("0000:41:00.1"),
            "{:?}",
            s.refused
        );
        assert!(s.refused[0].reason.contains("8086:1572"), "{:?}", s.refused);

        let allow = Selector {
            allow_foreign_in_group: true,
            ..Selector::default()
        };
        let s = select(&i, &allow, None, &AliasTable::default());
        assert_eq!(addrs(&s), ["0000:41:00.0", "0000:41:00.1", "0000:81:00.0"]);
    }

    #[test]
    fn a_group_with_an_unreadable_member_is_refused_even_when_foreign_is_allowed() {
        let mut i = inv(vec![
            dev("0000:41:00.0", NVIDIA, 0x2236, 0x030200, 7),
            dev("0000:81:00.0", NVIDIA, 0x2236, 0x030200, 8),
        ]);
        i.unreadable_in_group.insert(7, vec![a("0000:41:00.1")]);
        let allow = Selector {
            allow_foreign_in_group: true,
            ..Selector::default()
        };
        let s = select(&i, &allow, None, &AliasTable::default());
        assert_eq!(addrs(&s), ["0000:81:00.0"]);
        assert_eq!(s.refused[0].address, a("0000:41:00.0"));
        assert!(
            s.refused[0]
                .reason
                .contains("0000:41:00.1, whose sysfs entry cannot be read"),
            "{:?}",
            s.refused
        );
    }

    #[test]
    fn address_device_and_exclude_selectors() {
        let i = inv(vec![
            dev("0000:41:00.0", NVIDIA, 0x2236, 0x030200, 7),
            dev("0000:81:00.0", NVIDIA, 0x20b5, 0x030200, 8),
            dev("0000:c1:00.0", NVIDIA, 0x2236, 0x030200, 9),
        ]);
        let by_id = Selector {
            devices: vec!["10de:2236".parse().unwrap()],
            ..Selector::default()
        };
        let s = select(&i, &by_id, None, &AliasTable::default());
        assert_eq!(addrs(&s), ["0000:41:00.0", "0000:c1:00.0"]);

        let excl = Selector {
            exclude: vec![a("0000:41:00.0")],
            ..by_id
        };
        let s = select(&i, &excl, None, &AliasTable::default());
        assert_eq!(addrs(&s), ["0000:c1:00.0"]);

        let by_addr = Selector {
            addresses: vec![a("0000:81:00.0"), a("0000:99:00.0")],
            ..Selector::default()
        };
        let s = select(&i, &by_addr, None, &AliasTable::default());
        assert_eq!(addrs(&s), ["0000:81:00.0"]);
        assert_eq!(s.refused[0].address, a("0000:99:00.0"));
        assert!(s.refused[0].reason.contains("no such PCI device"));
    }

    #[test]
    fn other_vendors_and_vfs_are_not_selected_by_default() {
        let mut vf = dev("0000:41:00.4", NVIDIA, 0x2236, 0x030200, 20);
        vf.physfn = Some(a("0000:41:00.0"));
        let i = inv(vec![
            dev("0000:41:00.0", NVIDIA, 0x2236, 0x030200, 7),
            vf,
            dev("0000:03:00.0", 0x1002, 0x73bf, 0x030000, 3),
        ]);
        let s = select(&i, &Selector::default(), None, &AliasTable::default());
        assert_eq!(addrs(&s), ["0000:41:00.0"]);
        let amd = Selector {
            vendors: vec![0x1002],
            ..Selector::default()
        };
        let s = select(&i, &amd, None, &AliasTable::default());
        assert_eq!(addrs(&s), ["0000:03:00.0"]);
    }

    #[test]
    fn excluding_a_companion_leaves_the_group_alone() {
        let s = select(
            &workstation(),
            &Selector {
                exclude: vec![a("0000:01:00.1")],
                ..Selector::default()
            },
            None,
            &AliasTable::default(),
        );
        assert!(s.groups.is_empty());
        assert!(
            s.refused[0]
                .reason
                .contains("0000:01:00.1, which is excluded"),
            "{:?}",
            s.refused
        );
    }

    #[test]
    fn a_device_without_a_group_is_refused() {
        let mut d = dev("0000:41:00.0", NVIDIA, 0x2236, 0x030200, 0);
        d.iommu_group = None;
        let s = select(
            &inv(vec![d]),
            &Selector::default(),
            None,
            &AliasTable::default(),
        );
        assert!(s.groups.is_empty());
        assert!(s.refused[0].reason.contains("no IOMMU group"));
    }

    #[test]
    fn the_driver_comes_from_flag_then_alias_then_default() {
        let i = inv(vec![
            dev("0000:41:00.0", NVIDIA, 0x2941, 0x030200, 7),
            dev("0000:81:00.0", NVIDIA, 0x2236, 0x030200, 8),
        ]);
        let aliases = AliasTable::parse(
            "alias vfio_pci:v000010DEd00002941sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci\n",
        );
        let s = select(&i, &Selector::default(), None, &aliases);
        let drivers: Vec<_> = s.targets().map(|t| t.target.as_str()).collect();
        assert_eq!(drivers, ["nvgrace_gpu_vfio_pci", "vfio-pci"]);
        let s = select(&i, &Selector::default(), Some("my-vfio"), &aliases);
        assert!(s.targets().all(|t| t.target == "my-vfio"));
    }

    #[test]
    fn device_ids_parse_strictly() {
        assert_eq!(
            "10de:2236".parse::<DeviceId>().unwrap(),
            DeviceId {
                vendor: 0x10de,
                device: 0x2236
            }
        );
        assert_eq!(
            "0x10DE:0x2236".parse::<DeviceId>().unwrap().to_string(),
            "10de:2236"
        );
        for bad in [
            "10de",
            "10de:",
            "10de:22366",
            "g0de:2236",
            ":2236",
            "10de:2236:1",
        ] {
            assert!(bad.parse::<DeviceId>().is_err(), "{bad}");
        }
    }
}
