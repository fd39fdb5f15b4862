//! Crash safety: `kill -9` after the k-th sysfs write of a large apply, for every k; the next
//! run converges and leaves nothing behind.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// Starts `apply`, kills it with SIGKILL once the op log holds at least `k` writes (each write
/// is slowed down so the kill lands near the k-th), and returns how many writes it made.
fn apply_killed_after(sim: &testkit::sim::SimDir, f: &str, profile: &str, k: usize) -> usize {
    for op in ["create", "remove", "sriov_numvfs"] {
        sim.control(&format!("fault {op} * delay=15")).unwrap();
    }
    sim.clear_ops();
    let mut child = Command::new(BIN)
        .args(["apply", "-f", f, "-c", profile, "--host-root"])
        .arg(sim.root())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    loop {
        if sim.ops().len() >= k {
            child.kill().unwrap(); // SIGKILL
            break;
        }
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = child.wait();
    sim.control("clear-faults").unwrap();
    sim.ops().len()
}

fn converge(sim: &testkit::sim::SimDir, f: &str, profile: &str, type_name: &str, per_gpu: usize) {
    let root = sim.root();
    let o = run(root, &["apply", "-f", f, "-c", profile]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = run(root, &["assert", "-f", f, "-c", profile]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let c = mdev_counts(root);
    assert_eq!(
        c.into_iter().collect::<Vec<_>>(),
        vec![
            (("0000:41:00.0".into(), type_name.into()), per_gpu),
            (("0000:61:00.0".into(), type_name.into()), per_gpu),
        ],
        "after a kill, {profile}"
    );
}

#[test]
fn killed_switch_converges_for_every_k() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    converge(&sim, f, "A10-2Q", "NVIDIA A10-2Q", 12);
    // A10-2Q → A10-4Q is 24 removals and 12 creations, and back the reverse: 36 writes each.
    let mut killed_mid_way = 0;
    for k in 1..=36 {
        let (profile, name, n) = if k % 2 == 1 {
            ("A10-4Q", "NVIDIA A10-4Q", 6)
        } else {
            ("A10-2Q", "NVIDIA A10-2Q", 12)
        };
        let done = apply_killed_after(&sim, f, profile, k);
        if done < 36 {
            killed_mid_way += 1;
        }
        converge(&sim, f, profile, name, n);
    }
    // The kills did land part-way (not after the run had finished).
    assert!(
        killed_mid_way >= 30,
        "only {killed_mid_way} runs were cut short"
    );
}

#[test]
fn killed_first_apply_converges_for_every_k() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    // From a node without VFs: 2 sriov_numvfs writes, then 12 creations.
    for k in 1..=14 {
        for pf in ["0000:41:00.0", "0000:61:00.0"] {
            write(root, &format!("sys/bus/pci/devices/{pf}/sriov_numvfs"), "0");
        }
        assert!(mdevs(root).is_empty());
        apply_killed_after(&sim, f, "A10-4Q", k);
        converge(&sim, f, "A10-4Q", "NVIDIA A10-4Q", 6);
    }
}
