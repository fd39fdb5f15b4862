//! The `node-sim` binary as a process: mount, shell writes, SIGTERM, mount gone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

fn mounted_under(dir: &Path) -> usize {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|mp| Path::new(mp).starts_with(dir))
        .count()
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The node-sim process; killed if the test fails before it ends it.
struct NodeSim(Child);

impl NodeSim {
    fn start(topology: &str, root: &Path) -> NodeSim {
        NodeSim(
            Command::new(env!("CARGO_BIN_EXE_node-sim"))
                .args(["mount", "--topology", topology])
                .arg(root)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        )
    }

    fn signal(&mut self, sig: Signal) -> std::process::ExitStatus {
        kill(Pid::from_raw(self.0.id() as i32), sig).unwrap();
        self.0.wait().unwrap()
    }
}

impl Drop for NodeSim {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn sh(cmd: &str) -> std::process::Output {
    Command::new("sh").arg("-c").arg(cmd).output().unwrap()
}

fn can_run() -> bool {
    if let Some(why) = node_sim::unavailable() {
        node_sim::skip_test("node-sim binary tests", why);
        return false;
    }
    true
}

#[test]
fn binary_mounts_serves_shell_writes_and_unmounts_on_sigterm() {
    if !can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let mut sim = NodeSim::start("2xA10", &root);
    // The three mounts are made one after the other (sys, dev, proc): wait for the last too.
    wait_for("the mounts", || {
        root.join("sys/kernel/node-sim/ops").exists()
            && root.join("dev/vfio/vfio").exists()
            && root.join("proc/sys/kernel/osrelease").exists()
    });
    let r = root.display();
    let out = sh(&format!(
        "set -e; cd {r}
         echo vfio-pci > sys/bus/pci/devices/0000:41:00.0/driver_override
         echo 0000:41:00.0 > sys/bus/pci/drivers/nvidia/unbind
         echo 0000:41:00.0 > sys/bus/pci/drivers_probe
         readlink sys/bus/pci/devices/0000:41:00.0/driver; ls dev/vfio"
    ));
    assert!(
        out.status.success(),
        "{}\nops:\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(root.join("sys/kernel/node-sim/ops")).unwrap_or_default()
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "../../../../bus/pci/drivers/vfio-pci\n21\nvfio\n"
    );
    // A refused write fails in the shell (dash's echo says "I/O error" for any errno; the op
    // log has the kernel's answer).
    let out = sh(&format!(
        "echo 0000:41:00.0 > {r}/sys/bus/pci/drivers/vfio-pci/bind"
    ));
    assert!(!out.status.success());
    let ops = std::fs::read_to_string(root.join("sys/kernel/node-sim/ops")).unwrap();
    assert_eq!(
        ops.lines().last(),
        Some("4 sys/bus/pci/drivers/vfio-pci/bind 0000:41:00.0 EBUSY")
    );
    assert_eq!(mounted_under(&root), 3);

    let status = sim.signal(Signal::SIGTERM);
    assert!(status.success(), "{status}");
    assert_eq!(mounted_under(&root), 0);
    assert!(!root.join("sys/bus").exists());
}

#[test]
fn binary_replaces_stale_mounts_of_a_killed_run() {
    if !can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let mut first = NodeSim::start("2xA10", &root);
    wait_for("the first mount", || {
        root.join("proc/sys/kernel/osrelease").exists()
    });
    first.signal(Signal::SIGKILL);
    // SIGKILL leaves the mounts behind (dead connections).
    assert_eq!(mounted_under(&root), 3);
    let mut second = NodeSim::start("4xT4", &root);
    wait_for("the second mount", || {
        root.join("sys/bus/pci/devices/0000:3b:00.0").exists()
            && root.join("proc/sys/kernel/osrelease").exists()
    });
    assert_eq!(mounted_under(&root), 3);
    assert!(second.signal(Signal::SIGINT).success());
    assert_eq!(mounted_under(&root), 0);
}
