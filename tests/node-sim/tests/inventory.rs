//! `common::Inventory` read of every built-in topology matches the topology's definition: the
//! simulated node looks to the daemons' library exactly as it was described.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use common::{HostPaths, Inventory, PciAddress};

fn can_mount() -> bool {
    if let Some(why) = node_sim::unavailable() {
        node_sim::skip_test("inventory tests", why);
        return false;
    }
    true
}

fn check(name: &str) {
    let topo = node_sim::topology(name).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sim = node_sim::mount(&topo, dir.path()).unwrap();
    let inv = Inventory::read(&HostPaths::new(sim.root())).unwrap();
    assert!(inv.unreadable.is_empty(), "{name}: {:#?}", inv.unreadable);

    // Every endpoint and bridge, nothing more.
    let mut expected: Vec<PciAddress> = topo
        .devices
        .iter()
        .map(|d| d.address.parse().unwrap())
        .chain(topo.bridges.iter().map(|b| b.address.parse().unwrap()))
        .collect();
    expected.sort();
    let found: Vec<PciAddress> = inv.devices.keys().copied().collect();
    assert_eq!(found, expected, "{name}: functions");

    for d in &topo.devices {
        let a: PciAddress = d.address.parse().unwrap();
        let got = inv.device(&a).unwrap();
        assert_eq!(
            (got.vendor, got.device, got.class),
            (d.vendor, d.device, d.class),
            "{name} {a}: ids"
        );
        assert_eq!(
            (got.subsystem_vendor, got.subsystem_device),
            (d.subsystem_vendor, d.subsystem_device),
            "{name} {a}: subsystem"
        );
        assert_eq!(got.driver, d.driver, "{name} {a}: driver");
        assert_eq!(got.driver_override, None, "{name} {a}: driver_override");
        assert_eq!(got.iommu_group, Some(d.group), "{name} {a}: group");
        assert_eq!(
            got.numa_node,
            (d.numa >= 0).then_some(d.numa),
            "{name} {a}: numa"
        );
        assert_eq!(
            got.upstream_bridge.map(|b| b.to_string()),
            d.bridge,
            "{name} {a}: bridge"
        );
        assert!(!got.is_vf(), "{name} {a}: no VFs before sriov_numvfs");
        let members: Vec<String> = inv
            .group_members(d.group)
            .iter()
            .map(|m| m.to_string())
            .collect();
        let mut want: Vec<String> = topo
            .devices
            .iter()
            .filter(|o| o.group == d.group)
            .map(|o| o.address.clone())
            .chain(
                topo.bridges
                    .iter()
                    .filter(|b| b.group == d.group)
                    .map(|b| b.address.clone()),
            )
            .collect();
        want.sort();
        assert_eq!(members, want, "{name} {a}: group members");
        let on_vfio = d
            .driver
            .as_deref()
            .is_some_and(|drv| drv == "vfio-pci" || topo.vfio_drivers.iter().any(|v| v == drv));
        assert_eq!(
            inv.vfio_nodes.contains(&d.group),
            on_vfio,
            "{name} {a}: /dev/vfio/{}",
            d.group
        );
        if let Some(model) = &d.model {
            let m = node_sim::catalogue()
                .gpus
                .iter()
                .find(|m| &m.model == model)
                .unwrap();
            // Turing's mdev types sit on the GPU itself while it is on nvidia.
            if matches!(m.attach, node_sim::catalogue::Attach::PfMdev)
                && got.driver.as_deref() == Some("nvidia")
            {
                assert!(
                    got.mdev_parent,
                    "{name} {a}: T4-class GPUs are mdev parents"
                );
                assert_eq!(
                    got.mdev_types.len(),
                    m.offered_types().count(),
                    "{name} {a}: types"
                );
            }
            if m.sriov_totalvfs > 0 {
                assert_eq!(
                    got.sriov_totalvfs,
                    Some(m.sriov_totalvfs),
                    "{name} {a}: totalvfs"
                );
                assert_eq!(got.sriov_numvfs, Some(0), "{name} {a}: numvfs");
            }
        }
    }
    for b in &topo.bridges {
        let got = inv.device(&b.address.parse().unwrap()).unwrap();
        assert!(got.is_bridge(), "{name} {}: a bridge", b.address);
        assert_eq!(
            got.upstream_bridge.map(|x| x.to_string()),
            b.parent,
            "{name} {}: parent",
            b.address
        );
    }
    assert!(inv.mdevs.is_empty(), "{name}: no vGPUs at start");
    sim.unmount().unwrap();
}

#[test]
fn every_builtin_topology_reads_as_defined() {
    if !can_mount() {
        return;
    }
    for name in node_sim::topology::BUILTINS {
        check(name);
    }
}
