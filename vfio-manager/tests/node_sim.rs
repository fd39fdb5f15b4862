//! vfio-manager as a process against simulated nodes (node-sim): driver links, `/dev/vfio`
//! nodes, the readiness file and node-sim's operation log are what is checked.
//!
//! Each test mounts its own node and prints `skipped: ...` when FUSE or root is missing.
//!
//! Over 800 lines on purpose: one file per daemon for its node-sim tier, so that its helpers
//! (running the binary, reading driver links and the op log) are written once; each test is a
//! user-visible scenario read top to bottom.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on setup failures

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use testkit::kubelet::FakePodResources;
use testkit::kubelet::checkpoint::{self, entry};
use testkit::kubelet::pod_resources::pod;
use testkit::sim::try_mount;

const BIN: &str = env!("CARGO_BIN_EXE_vfio-manager");
/// How long a test waits for something that should happen promptly before it calls it lost.
const PATIENCE: Duration = Duration::from_secs(30);

fn cmd(root: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("--host-root")
        .arg(root)
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("HOST_ROOT")
        .env_remove("KUBELET_DIR")
        .env_remove("POD_RESOURCES_SOCKET");
    c
}

fn run(root: &Path, args: &[&str]) -> Output {
    cmd(root, args).output().expect("run vfio-manager")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        text(&o.stdout),
        text(&o.stderr)
    )
}

fn dev_dir(root: &Path, bdf: &str) -> PathBuf {
    root.join("sys/bus/pci/devices").join(bdf)
}

fn driver(root: &Path, bdf: &str) -> Option<String> {
    std::fs::read_link(dev_dir(root, bdf).join("driver"))
        .ok()
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
}

fn group(root: &Path, bdf: &str) -> u32 {
    std::fs::read_link(dev_dir(root, bdf).join("iommu_group"))
        .unwrap()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

fn vfio_node(root: &Path, g: u32) -> bool {
    root.join("dev/vfio").join(g.to_string()).exists()
}

fn control(root: &Path, command: &str) {
    std::fs::write(root.join("sys/kernel/node-sim/control"), command)
        .unwrap_or_else(|e| panic!("node-sim control {command:?}: {e}"));
}

/// node-sim's op log: `(path, value, result)` of every write, control writes left out.
fn ops(root: &Path) -> Vec<(String, String, String)> {
    let log = std::fs::read_to_string(root.join("sys/kernel/node-sim/ops")).unwrap();
    log.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let _seq = w.next()?;
            let path = w.next()?.to_string();
            let rest: Vec<&str> = w.collect();
            let (result, value) = rest.split_last()?;
            Some((path, value.join(" "), result.to_string()))
        })
        .filter(|(p, _, _)| !p.contains("node-sim/"))
        .collect()
}

/// Writes that concern `bdf` (its own files, or its address written to a driver file).
fn ops_for(root: &Path, bdf: &str) -> Vec<(String, String, String)> {
    ops(root)
        .into_iter()
        .filter(|(p, v, _)| p.contains(bdf) || v.contains(bdf))
        .collect()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < PATIENCE, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn two_a10_bind_then_a_second_bind_writes_nothing() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let out = text(&o.stdout);
    for bdf in ["0000:41:00.0", "0000:61:00.0"] {
        assert_eq!(driver(root, bdf).as_deref(), Some("vfio-pci"), "{bdf}");
        let g = group(root, bdf);
        assert!(vfio_node(root, g), "dev/vfio/{g}");
        assert!(
            out.contains(&format!("{bdf} nvidia → vfio-pci (group {g})")),
            "{}",
            show(&o)
        );
    }
    assert!(out.contains("bind: 2 selected, 2 changed"), "{}", show(&o));

    control(root, "clear-ops");
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(text(&o.stdout).contains("2 already bound"), "{}", show(&o));
    assert_eq!(ops(root), Vec::new(), "a second bind must not write");
}

#[test]
fn a_gpu_whose_nvidia_node_is_held_is_not_unbound() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // A shell plays the CUDA job.
    let held = testkit::sim::hold_nvidia_node(root, "0000:41:00.0");
    control(root, "clear-ops");
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let all = format!("{}{}", text(&o.stdout), text(&o.stderr));
    assert!(all.contains("0000:41:00.0"), "{}", show(&o));
    assert!(
        all.contains(&format!("pid {}", held.pid())),
        "the holder is named: {}",
        show(&o)
    );
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert_eq!(
        ops_for(root, "0000:41:00.0"),
        Vec::new(),
        "nothing written for it"
    );
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn a_gpu_whose_vgpu_a_vm_uses_is_not_unbound() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // An A10-4Q vGPU on the first GPU's first VF, its group held by a VM.
    std::fs::write(dev_dir(root, "0000:41:00.0").join("sriov_numvfs"), "4").unwrap();
    let uuid = "6f1d2c3b-4a59-4e8d-9c7b-0a1b2c3d4e5f";
    std::fs::write(
        root.join("sys/class/mdev_bus/0000:41:00.4/mdev_supported_types/nvidia-593/create"),
        uuid,
    )
    .unwrap();
    let g =
        std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{uuid}/iommu_group"))).unwrap();
    let g = g.file_name().unwrap().to_str().unwrap().to_string();
    control(root, &format!("hold {g} pid=4321 comm=virt-launcher"));
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(err.contains("0000:41:00.0 refused"), "{}", show(&o));
    assert!(err.contains("pid 4321 (virt-launcher)"), "{}", show(&o));
    assert!(
        err.contains(&format!("vGPU NVIDIA A10-4Q {uuid} (on 0000:41:00.4)")),
        "{}",
        show(&o)
    );
    assert!(err.contains("destroy its vGPUs"), "{}", show(&o));
    let touched: Vec<_> = ops_for(root, "0000:41:00.0")
        .into_iter()
        .filter(|(p, _, _)| !p.ends_with("sriov_numvfs") && !p.ends_with("/create"))
        .collect();
    assert_eq!(touched, vec![], "the GPU was not written to");
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert!(root.join(format!("sys/bus/mdev/devices/{uuid}")).exists());
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn rtx_workstation_gpu_and_audio_are_bound_together() {
    let Some(sim) = try_mount("rtx-workstation") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:01:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(driver(root, "0000:01:00.1").as_deref(), Some("vfio-pci"));
    assert!(vfio_node(root, group(root, "0000:01:00.0")));
    // The GPU first, then its audio function.
    let probes: Vec<String> = ops(root)
        .into_iter()
        .filter(|(p, _, _)| p.ends_with("drivers_probe"))
        .map(|(_, v, _)| v)
        .collect();
    assert_eq!(probes, ["0000:01:00.0", "0000:01:00.1"]);

    let st = run(root, &["status", "--json"]);
    assert_eq!(st.status.code(), Some(0), "{}", show(&st));
    let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    let devs = v["devices"].as_array().unwrap();
    assert_eq!(devs.len(), 2);
    assert_eq!(devs[0]["driver"], "vfio-pci");
    assert_eq!(devs[0]["viable"], true);
    assert_eq!(devs[0]["members"].as_array().unwrap().len(), 2);
    assert_eq!(devs[0]["in_use"].as_array().unwrap().len(), 0);
}

#[test]
fn foreign_group_is_refused_and_nothing_in_it_is_written() {
    let Some(sim) = try_mount("foreign-group") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(err.contains("0000:41:00.0 refused"), "{}", show(&o));
    assert!(
        err.contains("0000:42:00.0"),
        "the NIC is named: {}",
        show(&o)
    );
    assert_eq!(ops_for(root, "0000:41:00.0"), Vec::new());
    assert_eq!(ops_for(root, "0000:42:00.0"), Vec::new());
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert_eq!(driver(root, "0000:42:00.0").as_deref(), Some("i40e"));
    // The other GPU, alone in its group, is bound.
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));

    let o = run(root, &["bind", "--allow-foreign-in-group"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(driver(root, "0000:42:00.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn mixed_starting_drivers_all_end_on_vfio_pci() {
    let Some(sim) = try_mount("mixed") else {
        return;
    };
    let root = sim.root();
    let before: Vec<_> = [
        "0000:1a:00.0",
        "0000:1b:00.0",
        "0000:1c:00.0",
        "0000:1d:00.0",
    ]
    .iter()
    .map(|b| driver(root, b))
    .collect();
    assert_eq!(
        before,
        [
            Some("nvidia".into()),
            Some("nouveau".into()),
            Some("vfio-pci".into()),
            None
        ]
    );
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let out = text(&o.stdout);
    assert!(
        out.contains("0000:1b:00.0 nouveau → vfio-pci"),
        "{}",
        show(&o)
    );
    assert!(
        out.contains("0000:1d:00.0 (no driver) → vfio-pci"),
        "{}",
        show(&o)
    );
    for b in [
        "0000:1a:00.0",
        "0000:1b:00.0",
        "0000:1c:00.0",
        "0000:1d:00.0",
    ] {
        assert_eq!(driver(root, b).as_deref(), Some("vfio-pci"), "{b}");
        assert!(vfio_node(root, group(root, b)), "{b}");
    }
    // The one already on vfio-pci was not written to.
    assert_eq!(ops_for(root, "0000:1c:00.0"), Vec::new());

    // Unbind gives each back to the driver it came from (none for the one that had none).
    let o = run(root, &["unbind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:1a:00.0").as_deref(), Some("nvidia"));
    assert_eq!(driver(root, "0000:1b:00.0").as_deref(), Some("nouveau"));
    assert_eq!(driver(root, "0000:1d:00.0"), None);
    for b in ["0000:1a:00.0", "0000:1b:00.0", "0000:1d:00.0"] {
        let o = std::fs::read_to_string(dev_dir(root, b).join("driver_override")).unwrap();
        assert_eq!(o.trim(), "(null)", "{b}");
    }
}

#[test]
fn ebusy_on_one_unbind_fails_that_gpu_only() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    control(root, "fault unbind 0000:41:00.0 EBUSY");
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(err.contains("0000:41:00.0 failed"), "{}", show(&o));
    assert!(err.contains("unbind"), "the file is named: {}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
    // Left as it was: driver_override put back.
    let ov = std::fs::read_to_string(dev_dir(root, "0000:41:00.0").join("driver_override"));
    assert_eq!(ov.unwrap().trim(), "(null)");
    assert!(text(&o.stdout).contains("1 failed"), "{}", show(&o));
    // The record of original drivers, written before the binds, keeps only the GPU that moved.
    assert_eq!(
        original_drivers(root),
        "# gpu-vm-node original-drivers v1\n0000:61:00.0 nvidia\n"
    );
}

fn original_drivers(root: &Path) -> String {
    std::fs::read_to_string(root.join("run/vfio-manager/original-drivers")).unwrap_or_default()
}

#[test]
fn a_bind_killed_after_its_unbind_has_recorded_the_driver_the_gpu_goes_back_to() {
    let Some(sim) = try_mount("mixed") else {
        return;
    };
    let root = sim.root().to_path_buf();
    assert_eq!(driver(&root, "0000:1b:00.0").as_deref(), Some("nouveau"));
    // The unbind happens at once, but its answer is held: the bind is killed in between.
    control(&root, "fault unbind 0000:1b:00.0 after=5000");
    let mut child = cmd(&root, &["bind", "--address", "0000:1b:00.0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until("the unbind", || driver(&root, "0000:1b:00.0").is_none());
    child.kill().unwrap();
    let _ = child.wait();
    control(&root, "clear-faults");
    assert_eq!(
        original_drivers(&root),
        "# gpu-vm-node original-drivers v1\n0000:1b:00.0 nouveau\n",
        "written before the first write of the bind"
    );
    // Giving it back finishes the cut-off bind onto the driver it had, not the default one.
    let o = run(&root, &["unbind", "--address", "0000:1b:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(&root, "0000:1b:00.0").as_deref(), Some("nouveau"));
    assert_eq!(
        original_drivers(&root),
        "# gpu-vm-node original-drivers v1\n"
    );
}

#[test]
fn an_unreadable_record_of_original_drivers_is_set_aside_and_said_so() {
    let Some(sim) = try_mount("mixed") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind", "--address", "0000:1b:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    // A record a newer version wrote: not guessed at.
    let file = root.join("run/vfio-manager/original-drivers");
    std::fs::write(&file, "# gpu-vm-node original-drivers v9\n{}\n").unwrap();
    let o = run(root, &["unbind", "--address", "0000:1b:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(
        err.contains("v9") && err.contains("set aside as") && err.contains("default driver"),
        "{}",
        show(&o)
    );
    let aside: Vec<String> = std::fs::read_dir(file.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("original-drivers.unreadable-"))
        .collect();
    assert_eq!(aside.len(), 1, "kept for an operator");
    // The format before versions is read as it is.
    let o = run(root, &["bind", "--address", "0000:1b:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:1b:00.0").as_deref(), Some("vfio-pci"));
    std::fs::write(&file, "0000:1b:00.0 nouveau\n").unwrap();
    let o = run(root, &["unbind", "--address", "0000:1b:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:1b:00.0").as_deref(), Some("nouveau"));
}

#[test]
fn a_driver_that_is_not_loaded_is_refused_before_any_write() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind", "--driver", "vfio-pci-typo"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(
        err.contains("driver vfio-pci-typo is not loaded"),
        "{}",
        show(&o)
    );
    assert!(
        err.contains("sys/bus/pci/drivers/vfio-pci-typo"),
        "{}",
        show(&o)
    );
    assert_eq!(ops(root), vec![], "nothing written");
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("nvidia"));
}

#[test]
fn a_refused_probe_gives_the_gpu_back_to_its_driver() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    control(root, "fault probe 0000:41:00.0 EIO count=1");
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(err.contains("0000:41:00.0 failed"), "{}", show(&o));
    assert!(err.contains("the device is back on nvidia"), "{}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    let ov = std::fs::read_to_string(dev_dir(root, "0000:41:00.0").join("driver_override"));
    assert_eq!(ov.unwrap().trim(), "(null)");
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
    // The next run binds it.
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn a_write_that_hangs_is_cut_off_by_the_timeout() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // A per-device file: node-sim's FUSE mount serialises writes to one file (the kernel's
    // inode lock), so a hang in the shared drivers/nvidia/unbind would stall the other GPU too,
    // which real sysfs does not do.
    control(root, "fault driver_override 0000:41:00.0 delay=10000");
    // Long enough for the other GPU's bind on a loaded machine, far shorter than the hang.
    let o = run(root, &["bind", "--timeout", "3"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(err.contains("0000:41:00.0 failed"), "{}", show(&o));
    assert!(err.contains("did not finish within"), "{}", show(&o));
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn a_device_that_disappears_mid_run_is_a_clear_error() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root().to_path_buf();
    control(&root, "fault unbind 0000:41:00.0 delay=1500");
    let child = cmd(&root, &["bind", "--address", "0000:41:00.0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once its driver_override is written the bind is under way: pull the device.
    wait_until("the bind to start", || {
        ops_for(&root, "0000:41:00.0")
            .iter()
            .any(|(p, _, _)| p.ends_with("driver_override"))
    });
    control(&root, "unplug 0000:41:00.0");
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(err.contains("0000:41:00.0 failed"), "{}", show(&o));
    assert!(!err.contains("panicked"), "{}", show(&o));
}

#[test]
fn unbind_restores_the_driver_and_refuses_a_group_in_use() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let g = group(root, "0000:41:00.0");
    control(root, &format!("hold {g} pid=4242 comm=qemu-kvm"));
    control(root, "clear-ops");

    let o = run(root, &["unbind"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(err.contains("0000:41:00.0 refused"), "{}", show(&o));
    assert!(
        err.contains("4242") && err.contains("qemu-kvm"),
        "{}",
        show(&o)
    );
    assert_eq!(ops_for(root, "0000:41:00.0"), Vec::new(), "nothing written");
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert!(vfio_node(root, g));
    // The group nobody uses went back to nvidia.
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("nvidia"));
    assert!(
        text(&o.stdout).contains("0000:61:00.0 vfio-pci → nvidia"),
        "{}",
        show(&o)
    );

    // status shows who holds it.
    let st = run(root, &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    assert_eq!(v["devices"][0]["in_use"][0]["pid"], 4242, "{}", show(&st));
    assert_eq!(st.status.code(), Some(1), "not everything is bound");

    let o = run(root, &["unbind", "--force"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
}

#[test]
fn unbind_finishes_a_bind_cut_off_between_its_unbind_and_its_probe() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // What a bind killed after its unbind leaves: no driver, the override on vfio-pci.
    let dev = dev_dir(root, "0000:41:00.0");
    std::fs::write(dev.join("driver_override"), "vfio-pci").unwrap();
    std::fs::write(
        root.join("sys/bus/pci/drivers/nvidia/unbind"),
        "0000:41:00.0",
    )
    .unwrap();
    assert_eq!(driver(root, "0000:41:00.0"), None);
    let o = run(root, &["unbind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert_eq!(
        std::fs::read_to_string(dev.join("driver_override")).unwrap(),
        "(null)\n"
    );
}

const VGPU: &str = "6f1d2c3b-4a59-4e8d-9c7b-0a1b2c3d4e5f";
const VGPU_RESOURCE: &str = "nvidia.com/NVIDIA_A10-4Q";

/// An A10-4Q vGPU on 0000:61:00.0's first VF (as `vgpu-device-manager apply` makes it), then
/// the op log cleared.
fn vgpu_on_second_a10(root: &Path) {
    std::fs::write(dev_dir(root, "0000:61:00.0").join("sriov_numvfs"), "4").unwrap();
    std::fs::write(
        root.join("sys/class/mdev_bus/0000:61:00.4/mdev_supported_types/nvidia-593/create"),
        VGPU,
    )
    .unwrap();
    control(root, "clear-ops");
}

fn kubelet_dir(root: &Path) -> PathBuf {
    root.join("var/lib/kubelet/device-plugins")
}

/// kubelet's checkpoint in `dir` gives the vGPU to pod `6f1c-pod`.
fn checkpoint_gives_the_vgpu_a_pod(dir: &Path) {
    checkpoint::write(dir, &[entry("6f1c-pod", "compute", VGPU_RESOURCE, &[VGPU])]).unwrap();
}

/// kubelet's PodResources API on the node's socket, running the pod `vms/virt-launcher-a`
/// with `ids` of `resource`.
fn kubelet_runs(root: &Path, resource: &str, ids: &[&str]) -> FakePodResources {
    let pods = vec![pod("vms", "virt-launcher-a", "compute", resource, ids)];
    FakePodResources::spawn_with(
        &root.join("var/lib/kubelet/pod-resources/kubelet.sock"),
        pods,
    )
    .unwrap()
}

/// The second A10 is on nvidia with its vGPU, and nothing was written for it.
fn assert_second_a10_untouched(root: &Path) {
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("nvidia"));
    assert!(root.join(format!("sys/bus/mdev/devices/{VGPU}")).exists());
    assert_eq!(ops_for(root, "0000:61:00.0"), Vec::new(), "nothing written");
}

#[test]
fn bind_refuses_a_gpu_whose_vgpu_kubelet_gave_a_pod() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    vgpu_on_second_a10(root);
    // kubelet is down (no PodResources socket); its checkpoint gives the vGPU to a pod.
    checkpoint_gives_the_vgpu_a_pod(&kubelet_dir(root));
    let o = run(root, &["bind", "--address", "0000:61:00.0"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(
        err.contains(&format!(
            "0000:61:00.0 refused: 0000:61:00.0 is in use (vGPU NVIDIA A10-4Q {VGPU} (on \
             0000:61:00.4): pod 6f1c-pod (container compute, nvidia.com/NVIDIA_A10-4Q; \
             kubelet's checkpoint) has it)"
        )),
        "{}",
        show(&o)
    );
    assert_second_a10_untouched(root);
}

#[test]
fn bind_follows_the_pods_kubelet_runs() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    vgpu_on_second_a10(root);
    // The checkpoint still names a pod; kubelet's PodResources API says who runs now.
    checkpoint_gives_the_vgpu_a_pod(&kubelet_dir(root));
    let fake = kubelet_runs(root, VGPU_RESOURCE, &[VGPU]);
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(err.contains("pod vms/virt-launcher-a"), "{}", show(&o));
    assert!(!err.contains("checkpoint"), "{}", show(&o));
    assert_second_a10_untouched(root);
    // The first A10, which nobody uses, was bound; both GPUs were asked about in one List.
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(fake.list_calls(), 1);

    // The pod is gone from what kubelet runs, though its checkpoint entry stays: the GPU is
    // free, and binding it takes its vGPU away.
    fake.set_pods(vec![]);
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
    assert!(!root.join(format!("sys/bus/mdev/devices/{VGPU}")).exists());
    assert_eq!(fake.list_calls(), 2);
    // Nothing left to do: no process scan, no List.
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(fake.list_calls(), 2);
}

#[test]
fn a_passthrough_gpu_kubelet_still_gives_a_pod_is_bound_again() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // After a reboot the GPU is back on nvidia while kubelet runs the VM's pod it gave the
    // GPU to: that pod needs it on vfio-pci.
    let _kubelet = kubelet_runs(root, "nvidia.com/GA102GL_A10", &["0000:41:00.0"]);
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn unbind_refuses_a_group_kubelet_gave_a_pod_unless_forced() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let _kubelet = kubelet_runs(root, "nvidia.com/GA102GL_A10", &["0000:41:00.0"]);
    control(root, "clear-ops");
    let o = run(root, &["unbind"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    assert!(
        err.contains(&format!(
            "0000:41:00.0 refused: IOMMU group {} is in use (0000:41:00.0: pod \
             vms/virt-launcher-a (container compute, nvidia.com/GA102GL_A10) has it); not \
             unbinding (--force overrides)",
            group(root, "0000:41:00.0")
        )),
        "{}",
        show(&o)
    );
    assert_eq!(ops_for(root, "0000:41:00.0"), Vec::new(), "nothing written");
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("nvidia"));

    let st = run(root, &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    let used = &v["devices"][0]["in_use"][0];
    assert_eq!(used["kind"], "pod", "{}", show(&st));
    assert_eq!(used["name"], "virt-launcher-a", "{}", show(&st));
    let st = run(root, &["status"]);
    assert!(
        text(&st.stdout).contains("pod vms/virt-launcher-a"),
        "{}",
        show(&st)
    );

    let o = run(root, &["unbind", "--force"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
}

#[test]
fn unbind_refuses_while_a_corrupt_checkpoint_hides_who_uses_a_group() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let full = checkpoint::json(&[entry("p", "c", "nvidia.com/GA102GL_A10", &["0000:41:00.0"])]);
    let path = kubelet_dir(root).join("kubelet_internal_checkpoint");
    std::fs::write(&path, &full[..full.len() - 20]).unwrap();
    let o = run(root, &["unbind"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = text(&o.stderr);
    for bdf in ["0000:41:00.0", "0000:61:00.0"] {
        assert!(err.contains(&format!("{bdf} refused")), "{}", show(&o));
        assert_eq!(driver(root, bdf).as_deref(), Some("vfio-pci"));
    }
    assert!(
        err.contains(&format!(
            "unknown: kubelet's checkpoint {} is truncated or corrupt",
            path.display()
        )),
        "{}",
        show(&o)
    );
    let st = run(root, &["status"]);
    assert!(
        text(&st.stdout).contains("truncated or corrupt"),
        "status says why: {}",
        show(&st)
    );
    let o = run(root, &["unbind", "--force"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
}

#[test]
fn kubelet_dir_is_honoured() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    vgpu_on_second_a10(root);
    let k0s = root.join("var/lib/k0s/kubelet/device-plugins");
    checkpoint_gives_the_vgpu_a_pod(&k0s);
    let o = run(
        root,
        &[
            "bind",
            "--address",
            "0000:61:00.0",
            "--kubelet-dir",
            k0s.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(text(&o.stderr).contains("pod 6f1c-pod"), "{}", show(&o));
    let o = cmd(root, &["bind", "--address", "0000:61:00.0"])
        .env("KUBELET_DIR", &k0s)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(text(&o.stderr).contains("pod 6f1c-pod"), "{}", show(&o));
    assert_second_a10_untouched(root);
    // Its PodResources socket beside it answers for the running pods: none.
    let _fake =
        FakePodResources::spawn(&root.join("var/lib/k0s/kubelet/pod-resources/kubelet.sock"))
            .unwrap();
    let o = cmd(root, &["bind", "--address", "0000:61:00.0"])
        .env("KUBELET_DIR", &k0s)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn status_writes_nothing() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind", "--address", "0000:41:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    vgpu_on_second_a10(root);
    control(
        root,
        &format!(
            "hold {} pid=4242 comm=qemu-kvm",
            group(root, "0000:41:00.0")
        ),
    );
    let _kubelet = kubelet_runs(root, VGPU_RESOURCE, &[VGPU]);
    let mut before = testkit::tree::Tree::read(root);
    for args in [vec!["status"], vec!["status", "--json"]] {
        let o = run(root, &args);
        assert_eq!(o.status.code(), Some(1), "{}", show(&o));
        let after = testkit::tree::Tree::read(root);
        before.assert_same(&after, &args.join(" "));
        before = after;
    }
    // It shows who uses what: the VM on the bound GPU, the pod on the other's vGPU.
    let st = text(&run(root, &["status"]).stdout);
    let row = |bdf: &str| st.lines().find(|l| l.starts_with(bdf)).unwrap().to_string();
    assert!(row("0000:41:00.0").ends_with("pid 4242 (qemu-kvm)"), "{st}");
    assert!(
        row("0000:61:00.0").ends_with("pod vms/virt-launcher-a"),
        "{st}"
    );
}

/// A daemon process, killed when the test ends however it ends.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn daemon(root: &Path, args: &[&str]) -> Daemon {
    let mut all = vec!["daemon"];
    all.extend_from_slice(args);
    Daemon(
        cmd(root, &all)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    )
}

/// Lines of a child's stdout, as they come.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

fn next_summary(rx: &mpsc::Receiver<String>) -> String {
    let start = Instant::now();
    loop {
        let left = PATIENCE.saturating_sub(start.elapsed());
        let l = rx
            .recv_timeout(left)
            .expect("the daemon printed no bind summary");
        if l.starts_with("bind: ") {
            return l;
        }
    }
}

fn sigterm(child: &Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
}

#[test]
fn daemon_vouches_only_when_all_are_bound_binds_hotplug_and_leaves_devices_on_sigterm() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root().to_path_buf();
    let ready = root.join("run/nvidia/validations/vfio-pci-ready");
    control(&root, "fault unbind 0000:41:00.0 EBUSY count=1");
    let mut d = daemon(&root, &["--resync-interval", "1"]);
    let rx = lines_of(&mut d.0);
    let first = next_summary(&rx);
    assert!(first.contains("1 failed"), "{first}");
    assert!(!ready.exists(), "ready while 0000:41:00.0 is not bound");

    // The fault was for one write: a later pass binds it, and the daemon vouches.
    wait_until("the readiness file", || ready.exists());
    assert_eq!(driver(&root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(driver(&root, "0000:61:00.0").as_deref(), Some("vfio-pci"));

    // A GPU that appears later is bound.
    control(&root, "hotplug 0000:81:00.0 A10");
    wait_until("the hot-plugged GPU on vfio-pci", || {
        driver(&root, "0000:81:00.0").as_deref() == Some("vfio-pci")
    });
    wait_until("the readiness file to list the new GPU", || {
        std::fs::read_to_string(&ready).is_ok_and(|s| s.contains("0000:81:00.0"))
    });
    // One whole `BDF DRIVER GROUP` line per function, and nothing else in the directory.
    let body = std::fs::read_to_string(&ready).unwrap();
    assert!(
        body.lines().all(|l| {
            let w: Vec<&str> = l.split(' ').collect();
            w.len() == 3 && w[1] == "vfio-pci" && w[2].parse::<u32>().is_ok()
        }),
        "{body}"
    );
    let listed: Vec<_> = std::fs::read_dir(ready.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(listed, ["vfio-pci-ready"]);

    sigterm(&d.0);
    let status = d.0.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    for b in ["0000:41:00.0", "0000:61:00.0", "0000:81:00.0"] {
        assert_eq!(
            driver(&root, b).as_deref(),
            Some("vfio-pci"),
            "{b} left bound"
        );
    }
    assert!(
        !ready.exists(),
        "a stopped daemon vouches no more: the file goes with it (devices stay bound)"
    );
}

#[test]
fn daemon_withdraws_readiness_when_a_device_is_unbound_behind_its_back() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root().to_path_buf();
    let ready = root.join("run/nvidia/validations/vfio-pci-ready");
    let mut d = daemon(&root, &["--resync-interval", "1"]);
    let rx = lines_of(&mut d.0);
    let first = next_summary(&rx);
    assert!(first.contains("0 failed"), "{first}");
    wait_until("the readiness file", || ready.exists());

    // Someone takes a GPU off vfio-pci and it cannot go back: the daemon must not vouch.
    control(&root, "fault driver_override 0000:41:00.0 EBUSY");
    std::fs::write(
        root.join("sys/bus/pci/drivers/vfio-pci/unbind"),
        "0000:41:00.0",
    )
    .unwrap();
    wait_until("the readiness file to be withdrawn", || !ready.exists());

    // Once it can go back, the daemon binds it and vouches again.
    control(&root, "clear-faults");
    wait_until("the readiness file again", || ready.exists());
    assert_eq!(driver(&root, "0000:41:00.0").as_deref(), Some("vfio-pci"));

    sigterm(&d.0);
    assert_eq!(d.0.wait().unwrap().code(), Some(0));
}

/// Whether node-sim's changes reach a udev monitor: hot-plugs `bdf` and watches for its `add`.
fn uevent_seen_for_hotplug(root: &Path, bdf: &str) -> bool {
    let Ok(socket) = udev::MonitorBuilder::new().and_then(|b| b.listen()) else {
        return false;
    };
    control(root, &format!("hotplug {bdf} A10"));
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        for ev in socket.iter() {
            if ev.sysname().to_str() == Some(bdf) {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn daemon_binds_a_hotplugged_gpu_on_its_udev_event_alone() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root().to_path_buf();
    // No resync for an hour: only the udev event can get the new GPU bound.
    let mut d = daemon(&root, &["--resync-interval", "3600"]);
    let rx = lines_of(&mut d.0);
    next_summary(&rx);
    if !uevent_seen_for_hotplug(&root, "0000:81:00.0") {
        testkit::sim::skip_test(
            "udev path of the daemon",
            "node-sim broadcast no uevent for a hot-plug",
        );
        return;
    }
    wait_until("the hot-plugged GPU on vfio-pci", || {
        driver(&root, "0000:81:00.0").as_deref() == Some("vfio-pci")
    });
    sigterm(&d.0);
    assert_eq!(d.0.wait().unwrap().code(), Some(0));
}

#[test]
fn daemon_unbind_on_exit_gives_devices_back() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root().to_path_buf();
    let ready = root.join("run/nvidia/validations/vfio-pci-ready");
    let mut d = daemon(&root, &["--unbind-on-exit"]);
    let rx = lines_of(&mut d.0);
    next_summary(&rx);
    wait_until("the readiness file", || ready.exists());
    sigterm(&d.0);
    assert_eq!(d.0.wait().unwrap().code(), Some(0));
    assert!(!ready.exists());
    assert_eq!(driver(&root, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert_eq!(driver(&root, "0000:61:00.0").as_deref(), Some("nvidia"));
}

#[test]
fn a_variant_vfio_driver_named_in_modules_alias_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let topo = dir.path().join("grace.toml");
    std::fs::write(
        &topo,
        r#"name = "grace"
vfio_drivers = ["nvgrace_gpu_vfio_pci"]
modules_alias = [
    "alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci",
    "alias vfio_pci:v000010DEd00002941sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci",
]

[[bridge]]
address = "0000:00:01.0"

[[device]]
address = "0009:01:00.0"
vendor = 0x10de
device = 0x2941
subsystem_vendor = 0x10de
subsystem_device = 0x2046
class = 0x030200
bridge = "0000:00:01.0"
group = 9

[[device]]
address = "0000:41:00.0"
model = "A10"
bridge = "0000:00:01.0"
group = 21
"#,
    )
    .unwrap();
    let Some(sim) = try_mount(topo.to_str().unwrap()) else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(
        driver(root, "0009:01:00.0").as_deref(),
        Some("nvgrace_gpu_vfio_pci")
    );
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert!(
        text(&o.stdout).contains("0009:01:00.0 nvidia → nvgrace_gpu_vfio_pci (group 9)"),
        "{}",
        show(&o)
    );

    // --driver overrides the table.
    let o = run(root, &["unbind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let o = run(root, &["bind", "--driver", "vfio-pci"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0009:01:00.0").as_deref(), Some("vfio-pci"));
}

/// NVIDIA's vfio-manage spelling, `-d`/`--device-id BDF`: that GPU (and its group) alone.
#[test]
fn device_id_selects_one_gpu() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let o = run(root, &["bind", "--device-id", "0000:41:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(driver(root, "0000:61:00.0").as_deref(), Some("nvidia"));
    let o = run(root, &["unbind", "-d", "0000:41:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("nvidia"));
}

/// The switch from passthrough to vGPU as docs/install-kubernetes.md gives it: relabel first
/// (the DaemonSet's pod is deleted: SIGTERM, the devices stay bound), then unbind. Unbinding
/// while the daemon still runs is undone by the daemon at the unbind's own uevent.
#[test]
fn the_documented_switch_to_vgpu_relabels_first_then_unbinds() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root().to_path_buf();
    let ready = root.join("run/nvidia/validations/vfio-pci-ready");
    let gpus = ["0000:41:00.0", "0000:61:00.0"];
    let mut d = daemon(&root, &["--resync-interval", "1h"]);
    let rx = lines_of(&mut d.0);
    assert!(next_summary(&rx).contains("0 failed"));
    wait_until("the readiness file", || ready.exists());

    // The wrong order: an unbind while the daemon runs does not hold.
    let o = run(&root, &["unbind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    wait_until("the daemon binding them again", || {
        gpus.iter()
            .all(|g| driver(&root, g).as_deref() == Some("vfio-pci"))
    });

    // Relabel: the pod goes away; running VMs would keep their GPUs.
    sigterm(&d.0);
    assert_eq!(d.0.wait().unwrap().code(), Some(0));
    for g in gpus {
        assert_eq!(driver(&root, g).as_deref(), Some("vfio-pci"), "{g}");
    }
    // Then the unbind, from the node: it holds.
    let o = run(&root, &["unbind"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    for g in gpus {
        assert_eq!(driver(&root, g).as_deref(), Some("nvidia"), "{g}");
    }
}

/// nvidia-validator deletes the files under run/nvidia/validations (and the directory with
/// them) when it starts and in its preStop: while every GPU is bound, the daemon's file comes
/// back; the validator's own files are not touched.
#[test]
fn daemon_writes_its_readiness_file_again_when_someone_else_removes_it() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root().to_path_buf();
    let dir = root.join("run/nvidia/validations");
    let ready = dir.join("vfio-pci-ready");
    let mut d = daemon(&root, &["--resync-interval", "1h"]);
    wait_until("the readiness file", || ready.exists());
    let body = std::fs::read_to_string(&ready).unwrap();

    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("workload-type"), "vm-passthrough").unwrap();
    wait_until("the readiness file written again", || ready.exists());
    assert_eq!(std::fs::read_to_string(&ready).unwrap(), body);
    std::fs::remove_file(&ready).unwrap();
    wait_until("the readiness file written again", || ready.exists());
    assert_eq!(
        std::fs::read_to_string(dir.join("workload-type")).unwrap(),
        "vm-passthrough"
    );

    sigterm(&d.0);
    assert_eq!(d.0.wait().unwrap().code(), Some(0));
}

#[test]
fn a_readiness_file_left_by_a_killed_daemon_goes_when_the_next_one_starts() {
    let Some(sim) = try_mount("2xA10") else {
        return;
    };
    let root = sim.root().to_path_buf();
    let ready = root.join("run/nvidia/validations/vfio-pci-ready");
    let mut d = daemon(&root, &["--resync-interval", "1h"]);
    wait_until("the readiness file", || ready.exists());
    // Killed (an OOM kill): it removes nothing; then a GPU goes back to nvidia.
    d.0.kill().unwrap();
    d.0.wait().unwrap();
    assert!(ready.exists(), "a killed daemon removes nothing");
    let o = run(&root, &["unbind", "--address", "0000:41:00.0"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(driver(&root, "0000:41:00.0").as_deref(), Some("nvidia"));

    // The next one cannot even start (its metrics port is taken): the old file says nothing.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let o = run(&root, &["daemon", "--metrics-addr", &addr]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(!ready.exists(), "left from before: {}", show(&o));

    // One that starts binds the GPU again, and vouches once it did.
    let mut d = daemon(&root, &["--resync-interval", "1h"]);
    wait_until("the readiness file again", || ready.exists());
    assert_eq!(driver(&root, "0000:41:00.0").as_deref(), Some("vfio-pci"));
    sigterm(&d.0);
    assert_eq!(d.0.wait().unwrap().code(), Some(0));
}
