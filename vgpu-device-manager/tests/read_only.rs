//! `plan`, `assert` and `export` change nothing under the host root: every file's content and
//! every link are the same before and after (node-sim).

#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;

use support::*;
use testkit::tree::Tree;

/// Runs each command against `root`; none may change the tree.
fn assert_read_only(root: &Path, commands: &[Vec<&str>]) {
    let mut before = Tree::read(root);
    for args in commands {
        let o = run(root, args);
        assert!(
            matches!(o.status.code(), Some(0 | 1)),
            "{args:?}: {}",
            text(&o)
        );
        let after = Tree::read(root);
        before.assert_same(&after, &args.join(" "));
        before = after;
    }
}

#[test]
fn read_only_commands_write_nothing_on_the_vendor_path() {
    let Some(sim) = testkit::sim::try_mount("8xH100-sriov") else {
        return;
    };
    let root = sim.root();
    // VFs enabled by hand: their creatable lists name types no record names yet.
    write(root, "sys/bus/pci/devices/0000:13:00.0/sriov_numvfs", "32");
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    assert_read_only(
        root,
        &[
            vec!["plan", "-f", f, "-c", "H100XM-8C"],
            vec!["plan", "-f", f, "-c", "H100XM-8C", "--json"],
            vec!["assert", "-f", f, "-c", "H100XM-8C"],
            vec!["export"],
        ],
    );
    assert!(
        !root.join("run/gpu-vm-node/vgpu-type-names").exists(),
        "only apply records type names"
    );
    let o = run(root, &["apply", "-f", f, "-c", "H100XM-8C"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // apply recorded every type the lists showed, whole, with no temporary file left beside it.
    let record = root.join("run/gpu-vm-node/vgpu-type-names");
    let text = std::fs::read_to_string(&record).unwrap();
    assert!(
        text.lines().any(|l| l.ends_with("\tNVIDIA H100XM-8C")),
        "{text}"
    );
    let (header, types) = text.split_once('\n').unwrap();
    assert_eq!(header, "# gpu-vm-node vgpu-type-names v1");
    assert!(
        types.lines().all(|l| l
            .split_once('\t')
            .is_some_and(|(id, name)| id.parse::<u32>().is_ok() && name.starts_with("NVIDIA "))),
        "{text}"
    );
    let dir: Vec<_> = std::fs::read_dir(record.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(dir, ["vgpu-type-names"]);
}

#[test]
fn read_only_commands_write_nothing_with_vgpus_in_use() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    let o = run(root, &["apply", "-f", f, "-c", "A10-4Q"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // One vGPU held by a VM, one given to a pod by a running kubelet.
    let m = mdevs(root);
    let group =
        std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{}/iommu_group", m[0].0)))
            .unwrap();
    sim.control(&format!(
        "hold {} pid=4242 comm=qemu-kvm",
        group.file_name().unwrap().to_str().unwrap()
    ))
    .unwrap();
    let _kubelet = kubelet_runs(
        &root.join("var/lib/kubelet/pod-resources/kubelet.sock"),
        &[&m[1].0],
    );
    // (plan is assert's reading of the node; the tree has ~12k files here, so two commands.)
    assert_read_only(
        root,
        &[vec!["assert", "-f", f, "-c", "A10-8Q"], vec!["export"]],
    );
    // export names who uses what, from the same answer apply respects.
    let out = String::from_utf8_lossy(&run(root, &["export"]).stdout).to_string();
    assert!(out.contains("pid 4242 (qemu-kvm)"), "{out}");
    assert!(
        out.contains("pod vms/virt-launcher-a (container compute"),
        "{out}"
    );
}
