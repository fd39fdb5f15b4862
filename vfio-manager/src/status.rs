//! `vfio-manager status`: each selected function, its driver, group, the group's members,
//! whether the group can be given to a VM (viable), and who uses it.

use std::fmt::Write as _;

use common::{Inventory, PciAddress, Usage, Use, User};
use serde::Serialize;

use common::is_vfio_driver;
use common::vfio::Selection;

use crate::report::driver_label;

/// One row of `status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StatusRow {
    /// The function.
    pub address: PciAddress,
    /// `VVVV:DDDD`.
    pub id: String,
    /// Its driver now.
    pub driver: Option<String>,
    /// The VFIO driver it is meant to be on.
    pub target: String,
    /// On its target driver.
    pub bound: bool,
    /// Its IOMMU group.
    pub group: u32,
    /// Every function in the group, bridges included.
    pub members: Vec<PciAddress>,
    /// Every endpoint of the group is on a VFIO driver (or none) and `/dev/vfio/<group>`
    /// exists: a VM can open the group.
    pub viable: bool,
    /// Who uses it, as [`common::usage`] answers: for a bound function, the users of its group
    /// (what `unbind` respects); for one not bound yet, the users `bind` would respect (its
    /// `/dev/nvidia<N>`, its VFs and vGPUs). Unknown where a source could not be read.
    pub in_use: Vec<Use>,
}

/// A selected function that is refused, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RefusedRow {
    /// The function.
    pub address: PciAddress,
    /// Why it is not handled.
    pub reason: String,
}

/// The whole `status` answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Status {
    /// Selected functions.
    pub devices: Vec<StatusRow>,
    /// Selected functions that are refused.
    pub refused: Vec<RefusedRow>,
}

impl Status {
    /// Builds the status of `sel` from `inv` and who uses what.
    pub fn new(inv: &Inventory, sel: &Selection, usage: &Usage) -> Self {
        let mut devices = Vec::new();
        for (&group, targets) in &sel.groups {
            let members = inv.group_members(group);
            let endpoints_ok = members
                .iter()
                .filter_map(|a| inv.device(a))
                .all(|d| d.is_bridge() || d.driver.as_deref().is_none_or(is_vfio_driver));
            let viable = endpoints_ok && inv.vfio_nodes.contains(&group);
            let group_users = usage.of_group(inv, group);
            for t in targets {
                let in_use = if t.is_bound() {
                    group_users.clone()
                } else {
                    common::vfio::bind_blockers(usage, inv, t)
                };
                devices.push(StatusRow {
                    address: t.address,
                    id: t.id.clone(),
                    driver: t.driver.clone(),
                    target: t.target.clone(),
                    bound: t.is_bound(),
                    group,
                    members: members.clone(),
                    viable,
                    in_use,
                });
            }
        }
        devices.sort_by_key(|r| r.address);
        Status {
            devices,
            refused: sel
                .refused
                .iter()
                .map(|r| RefusedRow {
                    address: r.address,
                    reason: r.reason.clone(),
                })
                .collect(),
        }
    }

    /// 0 when every selected function is bound and none is refused, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        if self.refused.is_empty() && self.devices.iter().all(|d| d.bound) {
            0
        } else {
            1
        }
    }

    /// A table for people.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        if self.devices.is_empty() && self.refused.is_empty() {
            s.push_str("no devices selected\n");
            return s;
        }
        let rows: Vec<[String; 7]> = self
            .devices
            .iter()
            .map(|d| {
                [
                    d.address.to_string(),
                    d.id.clone(),
                    driver_label(d.driver.as_deref()).to_string(),
                    d.group.to_string(),
                    d.members
                        .iter()
                        .map(|m| m.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                    if d.viable { "yes" } else { "no" }.to_string(),
                    if d.in_use.is_empty() {
                        "no".to_string()
                    } else {
                        let mut who: Vec<String> = Vec::new();
                        for w in d.in_use.iter().map(|u| u.user.who()) {
                            if !who.contains(&w) {
                                who.push(w);
                            }
                        }
                        who.join(",")
                    },
                ]
            })
            .collect();
        let header = [
            "ADDRESS", "ID", "DRIVER", "GROUP", "MEMBERS", "VIABLE", "IN-USE",
        ];
        let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut line = |cells: &[&str]| {
            let mut l = String::new();
            for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
                if i + 1 == cells.len() {
                    l.push_str(c);
                } else {
                    let _ = write!(l, "{c:<w$}  ");
                }
            }
            s.push_str(l.trim_end());
            s.push('\n');
        };
        line(&header);
        for r in &rows {
            let cells: Vec<&str> = r.iter().map(String::as_str).collect();
            line(&cells);
        }
        for r in &self.refused {
            let _ = writeln!(s, "{} refused: {}", r.address, r.reason);
        }
        let mut unknown: Vec<&User> = Vec::new();
        for u in self.devices.iter().flat_map(|d| &d.in_use) {
            if matches!(u.user, User::Unknown(_)) && !unknown.contains(&&u.user) {
                unknown.push(&u.user);
            }
        }
        for u in unknown {
            let _ = writeln!(s, "{u}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::PciDevice;
    use common::vfio::select::NVIDIA;
    use common::vfio::{AliasTable, Selector, select};

    fn dev(addr: &str, vendor: u16, device: u16, class: u32, group: u32) -> PciDevice {
        PciDevice {
            driver: Some("nvidia".into()),
            iommu_group: Some(group),
            ..PciDevice::new(addr.parse().unwrap(), vendor, device, class)
        }
    }

    fn inv(devs: Vec<PciDevice>) -> Inventory {
        Inventory {
            devices: devs.into_iter().map(|d| (d.address, d)).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn status_shows_driver_group_members_viability_and_use() {
        let mut gpu = dev("0000:01:00.0", NVIDIA, 0x2684, 0x030000, 1);
        gpu.driver = Some("vfio-pci".into());
        let mut audio = dev("0000:01:00.1", NVIDIA, 0x22ba, 0x040300, 1);
        audio.driver = Some("snd_hda_intel".into());
        let mut other = dev("0000:41:00.0", NVIDIA, 0x2236, 0x030200, 7);
        other.driver = Some("vfio-pci".into());
        let mut i = inv(vec![gpu, audio, other]);
        i.vfio_nodes.insert(1);
        i.vfio_nodes.insert(7);
        let sel = select(&i, &Selector::default(), None, &AliasTable::default());
        let usage = Usage {
            processes: Ok([(
                "/dev/vfio/7".to_string(),
                vec![common::usage::Process {
                    pid: 4242,
                    comm: "qemu-kvm".into(),
                    path: "/dev/vfio/7".into(),
                }],
            )]
            .into()),
            ..Usage::default()
        };
        let st = Status::new(&i, &sel, &usage);
        assert_eq!(st.devices.len(), 3);
        let gpu = &st.devices[0];
        assert!(gpu.bound && !gpu.viable, "audio still on snd_hda_intel");
        assert_eq!(gpu.members.len(), 2);
        let a10 = &st.devices[2];
        assert!(a10.bound && a10.viable);
        assert_eq!(a10.in_use[0].user.who(), "pid 4242 (qemu-kvm)");
        assert_eq!(st.exit_code(), 1);

        let text = st.to_text();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("ADDRESS"), "{text}");
        assert!(
            lines[1].starts_with("0000:01:00.0") && lines[1].contains("vfio-pci"),
            "{text}"
        );
        assert!(lines[1].contains("0000:01:00.0,0000:01:00.1"), "{text}");
        assert!(lines[2].contains("snd_hda_intel"), "{text}");
        assert!(lines[3].ends_with("pid 4242 (qemu-kvm)"), "{text}");

        let json = serde_json::to_value(&st).unwrap();
        assert_eq!(json["devices"][2]["in_use"][0]["comm"], "qemu-kvm");
        assert_eq!(json["devices"][0]["viable"], false);
    }
}
