//! A GPU in sandbox-dp's on-demand pool (`run/gpu-vm-node/on-demand-pool`) or sandbox-dra's
//! (`run/gpu-vm-node/dra-pool`) is never touched by a profile: its vGPUs stay, none are made on
//! it, and plan says so, naming the pool (node-sim).

#![allow(clippy::unwrap_used)]

mod support;

use support::*;

#[test]
fn a_pooled_gpu_keeps_its_vgpus_and_gets_none_from_a_profile() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // sandbox-dp pooled GPU A and made an A10-4Q on it.
    write(root, "sys/bus/pci/devices/0000:41:00.0/sriov_numvfs", "32");
    let uuid = "5a3b2c1d-0000-4000-8000-0000000000aa";
    write(
        root,
        "sys/class/mdev_bus/0000:41:00.4/mdev_supported_types/nvidia-593/create",
        uuid,
    );
    // In the format before pool files had a version header: read as it is.
    std::fs::create_dir_all(root.join("run/gpu-vm-node")).unwrap();
    std::fs::write(
        root.join("run/gpu-vm-node/on-demand-pool"),
        "0000:41:00.0\n",
    )
    .unwrap();

    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    let o = run(root, &["plan", "-f", f, "-c", "A10-8Q"]);
    let out = text(&o);
    assert!(
        out.contains("GPU 0 (0000:41:00.0, 10de:2236): in sandbox-dp's on-demand pool; left alone"),
        "{out}"
    );
    let o = run(root, &["apply", "-f", f, "-c", "A10-8Q"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let counts = mdev_counts(root);
    assert_eq!(
        counts.get(&("0000:41:00.0".into(), "NVIDIA A10-4Q".into())),
        Some(&1),
        "the pool's vGPU stays: {counts:?}"
    );
    assert_eq!(
        counts.get(&("0000:61:00.0".into(), "NVIDIA A10-8Q".into())),
        Some(&3),
        "{counts:?}"
    );
    assert_eq!(counts.len(), 2, "nothing else: {counts:?}");

    // GPU B in sandbox-dra's pool (as sandbox-dra writes it now): plan names that pool.
    std::fs::write(
        root.join("run/gpu-vm-node/dra-pool"),
        "# gpu-vm-node dra-pool v1\n0000:61:00.0\n",
    )
    .unwrap();
    let o = run(root, &["plan", "-f", f, "-c", "A10-4Q"]);
    assert!(
        text(&o)
            .contains("GPU 1 (0000:61:00.0, 10de:2236): in sandbox-dra's vGPU pool; left alone"),
        "{}",
        text(&o)
    );
    std::fs::remove_file(root.join("run/gpu-vm-node/dra-pool")).unwrap();

    // A pool file that cannot be read, or of a newer format, changes nothing and names the
    // file: its owner writes it again when it starts.
    for bad in [
        "0000:41:00\n",
        "# gpu-vm-node on-demand-pool v2\n0000:41:00.0\n",
    ] {
        std::fs::write(root.join("run/gpu-vm-node/on-demand-pool"), bad).unwrap();
        let o = run(root, &["apply", "-f", f, "-c", "A10-4Q"]);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains("on-demand-pool"), "{}", text(&o));
        assert_eq!(mdev_counts(root), counts);
    }
}

#[test]
fn a_pool_left_over_by_an_owner_that_is_not_running_gives_back_its_empty_gpus() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // sandbox-dp --on-demand ran here (a node relabelled since) and left its pool file.
    std::fs::create_dir_all(root.join("run/gpu-vm-node")).unwrap();
    std::fs::write(
        root.join("run/gpu-vm-node/on-demand-pool"),
        "0000:41:00.0\n0000:61:00.0\n",
    )
    .unwrap();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();

    // While sandbox-dp runs (it holds the pool), the profile leaves both GPUs alone.
    let paths = common::HostPaths::new(root);
    let owner = common::state::pool::hold(&paths).unwrap().unwrap();
    let o = run(root, &["apply", "-f", f, "-c", "A10-8Q"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(mdev_counts(root).is_empty(), "{:?}", mdev_counts(root));

    // Once it is gone, the left-over file takes nothing: the profile applies, and says why.
    drop(owner);
    let o = run(root, &["apply", "-f", f, "-c", "A10-8Q"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("which is not running"), "{}", text(&o));
    let counts = mdev_counts(root);
    for gpu in ["0000:41:00.0", "0000:61:00.0"] {
        assert_eq!(
            counts.get(&(gpu.into(), "NVIDIA A10-8Q".into())),
            Some(&3),
            "{counts:?}"
        );
    }
}
