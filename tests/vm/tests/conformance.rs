//! Scenario 4: the same plain sysfs writes and reads on the real kernel (in the guest) and on
//! node-sim (topology `tests/vm/guest-like.toml`), compared observation by observation.
//!
//! Known, documented differences are listed in [`KNOWN_DIFFERENCES`]; every other difference fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vm_tier::{Job, build_binaries, repo_root, require_or_skip, run, skip};

/// Observations where node-sim is known to differ from the kernel, with the reason. Each is
/// still printed.
const KNOWN_DIFFERENCES: &[(&str, &str)] = &[];

fn observations(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A node-sim process serving a mount directory; dropping it ends node-sim (SIGTERM: it
/// unmounts) and leaves no mount behind, whatever happened to node-sim.
struct Sim {
    child: Child,
    dir: PathBuf,
}

impl Drop for Sim {
    fn drop(&mut self) {
        // SIGTERM makes node-sim unmount; kill(1) keeps this crate free of unsafe code.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // A node-sim that did not unmount (killed, crashed) leaves dead mounts ("Transport
        // endpoint is not connected"): detach them, deepest first.
        let mut left: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(PathBuf::from)
            .filter(|mp| mp.starts_with(&self.dir) && *mp != self.dir)
            .collect();
        left.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for mp in left {
            vm_tier::visible(&format!(
                "VM tier: conformance: node-sim left {} mounted; detaching it",
                mp.display()
            ));
            let _ = Command::new("umount").arg("-l").arg(&mp).status();
        }
    }
}

fn mount_sim(bin: &Path, topology: &Path, dir: &Path) -> Result<Sim, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let child = Command::new(bin.join("node-sim"))
        .arg("mount")
        .arg("--topology")
        .arg(topology)
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start node-sim: {e}"))?;
    let mut sim = Sim {
        child,
        // As /proc/self/mountinfo names it.
        dir: dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf()),
    };
    let ready = dir.join("sys/bus/pci/devices");
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if ready.exists() {
            return Ok(sim);
        }
        if let Ok(Some(status)) = sim.child.try_wait() {
            return Err(format!("node-sim exited with {status} before mounting"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!(
        "node-sim did not mount {} within 20 s",
        dir.display()
    ))
}

#[test]
fn node_sim_answers_like_the_kernel() {
    let Some(p) = require_or_skip() else { return };
    if let Some(why) = testkit::sim::unavailable() {
        // A skip unless either tier is required: NODE_SIM=required panics here, VM_TIER=required
        // in `skip`.
        testkit::sim::skip_test("VM tier conformance", &why);
        skip(&format!("node-sim cannot run: {why}"));
        return;
    }
    let bin = build_binaries("node-sim").unwrap_or_else(|e| panic!("VM tier: {e}"));
    let repo = repo_root();

    // The kernel.
    let outcome = run(&p, &Job::scenario("conformance", "4-conformance.sh")).unwrap();
    outcome.assert_all_passed();
    let kernel = outcome.file("observations").unwrap();

    // node-sim.
    // Outside the run directory, which the next run deletes: node-sim itself clears a stale
    // mount left here by a killed run.
    let dir = vm_tier::target_dir().join("vm-runs/conformance-node-sim");
    let sim = mount_sim(&bin, &repo.join("tests/vm/guest-like.toml"), &dir)
        .unwrap_or_else(|e| panic!("VM tier: {e}"));
    let script = format!(
        ". {0}/tests/vm/guest/lib.sh; . {0}/tests/vm/scenarios/conformance.sh",
        repo.display()
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .env("ROOT", &dir)
        .env("PCI_DEV", "0000:00:02.0")
        .env("DEFAULT_DRIVER", "bochs-drm")
        .env("NODRV_DEV", "0000:00:04.0")
        .env("MDEV_PARENT", "0000:00:05.0")
        .env("MDEV_TYPE", "nvidia-232")
        .env("MDEV_OTHER_TYPE", "nvidia-231")
        .env("VMTIER_RESULTS", &outcome.run_dir)
        .output()
        .unwrap();
    drop(sim);
    let simulated = String::from_utf8_lossy(&out.stdout).to_string();
    std::fs::write(outcome.run_dir.join("observations.node-sim"), &simulated).unwrap();
    assert!(
        out.status.success(),
        "conformance script on node-sim failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let k = observations(&kernel);
    let s = observations(&simulated);
    let mut failures = Vec::new();
    println!("conformance: {} observations", k.len());
    for (i, (op, want)) in k.iter().enumerate() {
        let got = s
            .get(i)
            .filter(|(sop, _)| sop == op)
            .map(|(_, v)| v.as_str());
        match got {
            Some(v) if v == want => println!("  same      {op}: {want}"),
            other => {
                let got = other.unwrap_or("<missing>");
                let known = KNOWN_DIFFERENCES.iter().find(|(o, _)| o == op);
                match known {
                    Some((_, why)) => {
                        println!("  known     {op}: kernel {want:?}, node-sim {got:?} ({why})")
                    }
                    None => {
                        println!("  DIFFERENT {op}: kernel {want:?}, node-sim {got:?}");
                        failures.push(format!("{op}: kernel {want:?}, node-sim {got:?}"));
                    }
                }
            }
        }
    }
    if s.len() != k.len() {
        failures.push(format!(
            "kernel gave {} observations, node-sim {}",
            k.len(),
            s.len()
        ));
    }
    vm_tier::visible(&format!(
        "VM tier: conformance: {} of {} observations differ between the kernel and node-sim",
        failures.len(),
        k.len()
    ));
    assert!(
        failures.is_empty(),
        "node-sim differs from the kernel:\n  {}",
        failures.join("\n  ")
    );
}
