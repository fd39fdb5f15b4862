//! Crash safety: `kill -9` after the k-th sysfs write of a large apply, for every k; the next
//! run converges and leaves nothing behind.

#![allow(clippy::unwrap_used)]

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use support::*;

/// Starts `apply`, kills it with SIGKILL once the op log holds at least `k` writes (each write
/// is slowed down so the kill lands near the k-th), and returns how many writes it made.
fn apply_killed_after(sim: &testkit::sim::SimDir, f: &str, profile: &str, k: usize) -> usize {
    for op in ["create", "remove", "sriov_numvfs", "current_vgpu_type"] {
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
    testkit::sim::kill_when(&mut child, Duration::from_secs(120), || {
        sim.ops().len() >= k
    });
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
    let mut half_applied = 0;
    for k in 1..=14 {
        for pf in ["0000:41:00.0", "0000:61:00.0"] {
            write(root, &format!("sys/bus/pci/devices/{pf}/sriov_numvfs"), "0");
        }
        assert!(mdevs(root).is_empty());
        apply_killed_after(&sim, f, "A10-4Q", k);
        // What the kill left: fewer than the profile's 12 vGPUs is a run cut short.
        if mdevs(root).len() < 12 {
            half_applied += 1;
        }
        converge(&sim, f, "A10-4Q", "NVIDIA A10-4Q", 6);
    }
    // The kills did land part-way, and the repair runs started from half-applied nodes.
    assert!(
        half_applied >= 11,
        "only {half_applied} of 14 runs were left half-applied"
    );
}

const VENDOR: &str = r#"
version: v1
vgpu-configs:
  H100XM-16C:
    - devices: [0, 1]
      vgpu-devices: {"H100XM-16C": 5}
  H100XM-20C:
    - devices: [0, 1]
      vgpu-devices: {"H100XM-20C": 4}
"#;

/// The vendor path's vGPUs: per GPU, `per_gpu` of type `type_id`, on two GPUs, nothing else.
fn converge_vendor(
    sim: &testkit::sim::SimDir,
    f: &str,
    profile: &str,
    type_id: u32,
    per_gpu: usize,
) {
    let root = sim.root();
    let o = run(root, &["apply", "-f", f, "-c", profile]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = run(root, &["assert", "-f", f, "-c", profile]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let mut per_pf: std::collections::BTreeMap<(String, u32), usize> = Default::default();
    for (_, pf, t) in vendor_vgpus(root) {
        *per_pf.entry((pf, t)).or_default() += 1;
    }
    assert_eq!(per_pf.len(), 2, "after a kill, {profile}: {per_pf:?}");
    assert!(
        per_pf
            .iter()
            .all(|((_, t), n)| *t == type_id && *n == per_gpu),
        "after a kill, {profile}: {per_pf:?}"
    );
}

#[test]
fn killed_vendor_path_applies_converge_for_every_k() {
    let Some(sim) = testkit::sim::try_mount("8xH100-sriov") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(VENDOR);
    let f = cfg.path.to_str().unwrap();
    let pfs: Vec<String> = {
        let o = run(root, &["plan", "--json", "-f", f, "-c", "H100XM-16C"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                let label = g["gpu"].as_str().unwrap();
                label[label.find('(').unwrap() + 1..label.find(',').unwrap()].to_string()
            })
            .collect()
    };
    assert_eq!(pfs.len(), 2, "{pfs:?}");
    // From a node without VFs: 2 sriov_numvfs writes, then 10 current_vgpu_type writes.
    let mut half_applied = 0;
    for k in 1..=12 {
        for pf in &pfs {
            write(root, &format!("sys/bus/pci/devices/{pf}/sriov_numvfs"), "0");
        }
        assert!(vendor_vgpus(root).is_empty());
        apply_killed_after(&sim, f, "H100XM-16C", k);
        // Fewer than the profile's 10 vGPUs: the kill cut the run short.
        if vendor_vgpus(root).len() < 10 {
            half_applied += 1;
        }
        converge_vendor(&sim, f, "H100XM-16C", 1004, 5);
    }
    assert!(
        half_applied >= 7,
        "only {half_applied} of 12 first runs were left half-applied"
    );
    // 16C → 20C is 10 clears (`0`) and 8 sets, and back 8 clears and 10 sets: 18 writes each.
    let mut killed_mid_way = 0;
    for k in 1..=18 {
        let (profile, id, n) = if k % 2 == 1 {
            ("H100XM-20C", 1005, 4)
        } else {
            ("H100XM-16C", 1004, 5)
        };
        if apply_killed_after(&sim, f, profile, k) < 18 {
            killed_mid_way += 1;
        }
        converge_vendor(&sim, f, profile, id, n);
    }
    assert!(
        killed_mid_way >= 10,
        "only {killed_mid_way} runs were cut short"
    );
}
