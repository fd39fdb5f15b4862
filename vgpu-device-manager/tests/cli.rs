//! `vgpu-device-manager` as a process against node-sim.

#![allow(clippy::unwrap_used)]

mod support;

use support::*;

fn ok(o: &std::process::Output) {
    assert_eq!(o.status.code(), Some(0), "{}", text(o));
}

#[test]
fn a10_profiles_create_switch_and_assert() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();

    // Fresh node: assert fails, apply enables the VFs and creates 6 per GPU.
    let o = run(root, &["assert", "-f", f, "-c", "A10-4Q"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    ok(&run(root, &["apply", "-f", f, "-c", "A10-4Q"]));
    let counts = mdev_counts(root);
    assert_eq!(
        counts.into_iter().collect::<Vec<_>>(),
        vec![
            (("0000:41:00.0".into(), "NVIDIA A10-4Q".into()), 6),
            (("0000:61:00.0".into(), "NVIDIA A10-4Q".into()), 6),
        ]
    );
    // One vGPU per VF.
    let mut parents: Vec<String> = mdevs(root).into_iter().map(|m| m.1).collect();
    parents.sort();
    parents.dedup();
    assert_eq!(parents.len(), 12);
    ok(&run(root, &["assert", "-f", f, "-c", "A10-4Q"]));

    // Re-apply writes nothing.
    sim.clear_ops();
    ok(&run(root, &["apply", "-f", f, "-c", "A10-4Q"]));
    assert!(sim.ops().is_empty(), "{:?}", sim.ops());

    // Switch to A10-8Q: 3 per GPU.
    ok(&run(root, &["apply", "-f", f, "-c", "A10-8Q"]));
    let m = mdevs(root);
    assert_eq!(m.len(), 6, "{m:?}");
    assert!(m.iter().all(|x| x.3 == "NVIDIA A10-8Q"), "{m:?}");
    let o = run(root, &["assert", "-f", f, "-c", "A10-4Q"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    ok(&run(root, &["assert", "-f", f, "-c", "A10-8Q"]));
}

#[test]
fn plan_prints_the_diff_and_writes_nothing() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    ok(&run(root, &["apply", "-f", f, "-c", "A10-8Q"]));
    sim.clear_ops();
    let o = run(root, &["plan", "-f", f, "-c", "A10-4Q"]);
    ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches("- remove NVIDIA A10-8Q").count(), 6, "{out}");
    assert_eq!(out.matches("+ create NVIDIA A10-4Q").count(), 12, "{out}");
    let o = run(root, &["plan", "--json", "-f", f, "-c", "A10-4Q"]);
    ok(&o);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0]["actions"].as_array().unwrap().len(), 9);
    assert_eq!(gpus[0]["actions"][0]["action"], "remove-mdev");
    assert!(sim.ops().is_empty(), "{:?}", sim.ops());
}

#[test]
fn config_from_stdin_and_env() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    ok(&run_stdin(
        root,
        &["apply", "-f", "-", "-c", "A10-12Q"],
        Some(
            "version: v1\nvgpu-configs:\n  A10-12Q:\n    - devices: [1]\n      vgpu-devices: {A10-12Q: 2}\n",
        ),
    ));
    let c = mdev_counts(root);
    assert_eq!(
        c.into_iter().collect::<Vec<_>>(),
        vec![(("0000:61:00.0".into(), "NVIDIA A10-12Q".into()), 2)]
    );
    let cfg = config_file(CONFIG);
    let o = std::process::Command::new(BIN)
        .args(["assert", "--host-root"])
        .arg(root)
        .env("VGPU_DM_CONFIG_FILE", &cfg.path)
        .env("VGPU_DM_SELECTED_CONFIG", "A10-4Q")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}

#[test]
fn nvidia_vgpu_dm_flags_are_understood() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    // `assert -a`: the file is valid and has the profile; the node is not even read.
    for args in [
        &["assert", "-a", "-f", f, "-c", "A10-4Q"][..],
        &["assert", "--valid-config", "-f", f, "-c", "A10-4Q"][..],
    ] {
        let o = run(root, args);
        ok(&o);
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("valid"),
            "{}",
            text(&o)
        );
    }
    let o = std::process::Command::new(BIN)
        .args([
            "assert",
            "-f",
            f,
            "-c",
            "A10-4Q",
            "--host-root",
            "/nonexistent",
        ])
        .env("VGPU_DM_VALID_CONFIG", "true")
        .output()
        .unwrap();
    ok(&o);
    let o = run(root, &["assert", "-a", "-f", f, "-c", "no-such"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no profile named \"no-such\""));
    let bad = config_file("version: v1\nvgpu-configs:\n  p:\n    - devices: none\n");
    let o = run(
        root,
        &["assert", "-a", "-f", bad.path.to_str().unwrap(), "-c", "p"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));

    // Without -c: a file's only profile is used; with several, the error lists them.
    let o = run(root, &["plan", "-f", f]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("-c/--selected-config") && err.contains("A10-4Q, A10-8Q"),
        "{err}"
    );
    let one = config_file(
        "version: v1\nvgpu-configs:\n  only:\n    - devices: [0]\n      vgpu-devices: {A10-24Q: 1}\n",
    );
    assert!(sim.ops().is_empty(), "{:?}", sim.ops());

    // -d (or VGPU_DM_DEBUG) logs every sysfs write.
    let o = run(root, &["-d", "apply", "-f", one.path.to_str().unwrap()]);
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("DEBUG") && err.contains("sysfs write"),
        "{err}"
    );
    assert_eq!(
        mdev_counts(root).into_iter().collect::<Vec<_>>(),
        vec![(("0000:41:00.0".into(), "NVIDIA A10-24Q".into()), 1)]
    );
    let o = std::process::Command::new(BIN)
        .args(["assert", "-f", one.path.to_str().unwrap(), "--host-root"])
        .arg(root)
        .env("VGPU_DM_DEBUG", "1")
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    ok(&o);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("DEBUG"),
        "{}",
        text(&o)
    );
    let o = run(root, &["assert", "-f", one.path.to_str().unwrap()]);
    ok(&o);
    assert!(
        !String::from_utf8_lossy(&o.stderr).contains("DEBUG"),
        "{}",
        text(&o)
    );
}

#[test]
fn a100_mdevs_on_vfs() {
    let Some(sim) = testkit::sim::try_mount("8xA100") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    ok(&run(root, &["apply", "-f", f, "-c", "A100DX-8C"]));
    let c = mdev_counts(root);
    assert_eq!(c.len(), 8, "{c:?}");
    assert!(
        c.iter()
            .all(|((_, name), n)| name == "GRID A100DX-8C" && *n == 10),
        "{c:?}"
    );
    for pf in ["0000:13:00.0", "0000:b4:00.0"] {
        let n: u32 =
            std::fs::read_to_string(root.join(format!("sys/bus/pci/devices/{pf}/sriov_numvfs")))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
        assert_eq!(n, 20);
    }
    sim.clear_ops();
    ok(&run(root, &["assert", "-f", f, "-c", "A100DX-8C"]));
    ok(&run(root, &["apply", "-f", f, "-c", "A100DX-8C"]));
    assert!(sim.ops().is_empty(), "{:?}", sim.ops());
}

#[test]
fn h100_vendor_path() {
    let Some(sim) = testkit::sim::try_mount("8xH100-sriov") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    ok(&run(root, &["apply", "-f", f, "-c", "H100XM-8C"]));
    let v = vendor_vgpus(root);
    assert_eq!(v.len(), 80, "{v:?}");
    assert!(v.iter().all(|x| x.2 == 1002), "{v:?}");
    let mut pfs: Vec<&str> = v.iter().map(|x| x.1.as_str()).collect();
    pfs.dedup();
    assert_eq!(pfs.len(), 8);
    // Full cards list no creatable types; re-applying still recognises the vGPUs.
    sim.clear_ops();
    ok(&run(root, &["assert", "-f", f, "-c", "H100XM-8C"]));
    ok(&run(root, &["apply", "-f", f, "-c", "H100XM-8C"]));
    assert!(sim.ops().is_empty(), "{:?}", sim.ops());
    // Half the GPUs to 4C.
    ok(&run(root, &["apply", "-f", f, "-c", "H100XM-4C"]));
    let v = vendor_vgpus(root);
    let c4 = v.iter().filter(|x| x.2 == 1000).count();
    let c8 = v.iter().filter(|x| x.2 == 1002).count();
    assert_eq!((c4, c8), (80, 40), "{v:?}");
    ok(&run(root, &["assert", "-f", f, "-c", "H100XM-4C"]));
    let o = run(root, &["export"]);
    ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("H100XM-4C: 20"), "{out}");
    assert!(out.contains("H100XM-8C: 10"), "{out}");
}

#[test]
fn t4_mdevs_on_the_gpu() {
    let Some(sim) = testkit::sim::try_mount("4xT4") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    ok(&run(root, &["apply", "-f", f, "-c", "T4-4Q"]));
    let c = mdev_counts(root);
    assert_eq!(c.len(), 4, "{c:?}");
    assert!(c.values().all(|n| *n == 4), "{c:?}");
    assert!(c.keys().all(|(_, n)| n == "GRID T4-4Q"), "{c:?}");
    // The parent is the GPU itself.
    assert!(mdevs(root).iter().all(|m| m.1 == m.2));
}

#[test]
fn in_use_vgpu_blocks_only_its_gpu() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    ok(&run(root, &["apply", "-f", f, "-c", "A10-4Q"]));
    // A VM holds one vGPU of the first GPU.
    let (uuid, _, pf, _) = mdevs(root)
        .into_iter()
        .find(|m| m.2 == "0000:41:00.0")
        .unwrap();
    let group =
        std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{uuid}/iommu_group"))).unwrap();
    let group = group.file_name().unwrap().to_str().unwrap().to_string();
    sim.control(&format!("hold {group} pid=4242 comm=qemu-kvm"))
        .unwrap();

    let o = run(root, &["apply", "-f", f, "-c", "A10-8Q"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("pid 4242 (qemu-kvm)"), "{out}");
    assert!(out.contains(&uuid), "{out}");
    assert!(out.contains(&pf), "{out}");
    let c = mdev_counts(root);
    assert_eq!(
        c.into_iter().collect::<Vec<_>>(),
        vec![
            (("0000:41:00.0".into(), "NVIDIA A10-4Q".into()), 6),
            (("0000:61:00.0".into(), "NVIDIA A10-8Q".into()), 3),
        ]
    );
    // Once the VM is gone, the same apply finishes the job.
    sim.control(&format!("release {group}")).unwrap();
    ok(&run(root, &["apply", "-f", f, "-c", "A10-8Q"]));
    ok(&run(root, &["assert", "-f", f, "-c", "A10-8Q"]));
}

#[test]
fn shrinking_keeps_the_vgpu_in_use() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    ok(&run(root, &["apply", "-f", f, "-c", "A10-4Q"]));
    // Hold the last vGPU (in UUID order) of the first GPU.
    let held = mdevs(root)
        .into_iter()
        .rfind(|m| m.2 == "0000:41:00.0")
        .unwrap();
    let group =
        std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{}/iommu_group", held.0)))
            .unwrap();
    let group = group.file_name().unwrap().to_str().unwrap().to_string();
    sim.control(&format!("hold {group}")).unwrap();
    let half = config_file(
        "version: v1\nvgpu-configs:\n  half:\n    - devices: all\n      vgpu-devices: {A10-4Q: 3}\n",
    );
    ok(&run(
        root,
        &["apply", "-f", half.path.to_str().unwrap(), "-c", "half"],
    ));
    let m = mdevs(root);
    assert_eq!(m.len(), 6, "{m:?}");
    assert!(
        m.iter().any(|x| x.0 == held.0),
        "the held vGPU was removed: {m:?}"
    );
}

/// The deployed default ConfigMap (GPU Operator shape: per-model `device-filter` entries).
fn deployed_config() -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/helm/gpu-vm-node/files/vgpu-config.yaml");
    let cm: yaml_serde::Value =
        yaml_serde::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    cm["data"]["config.yaml"].as_str().unwrap().to_string()
}

#[test]
fn the_deployed_configmap_parses_and_applies() {
    let text = deployed_config();
    let cfg = config_file(&text);
    let f = cfg.path.to_str().unwrap();
    for (topology, profile, expect) in [
        ("2xA10", "default", "NVIDIA A10-12Q"),
        ("2xA10", "A10-4Q", "NVIDIA A10-4Q"),
        ("4xT4", "default", "GRID T4-8Q"),
        ("8xA100", "default", "GRID A100DX-40C"),
    ] {
        let Some(sim) = testkit::sim::try_mount(topology) else {
            return;
        };
        let root = sim.root();
        ok(&run(root, &["apply", "-f", f, "-c", profile]));
        ok(&run(root, &["assert", "-f", f, "-c", profile]));
        let c = mdev_counts(root);
        assert!(!c.is_empty(), "{topology} {profile}");
        assert!(
            c.keys().all(|(_, n)| n == expect),
            "{topology} {profile}: {c:?}"
        );
    }
    let Some(sim) = testkit::sim::try_mount("8xH100-sriov") else {
        return;
    };
    ok(&run(sim.root(), &["apply", "-f", f, "-c", "default"]));
    ok(&run(sim.root(), &["assert", "-f", f, "-c", "default"]));
    assert_eq!(vendor_vgpus(sim.root()).len(), 16);
}
