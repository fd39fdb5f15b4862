//! Helpers for running sandbox-dp as a process against a host root and a fake kubelet.
#![allow(dead_code)]

pub mod tree;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use testkit::kubelet::api::{ContainerAllocateResponse, Device};

/// A generous deadline for anything the daemon should do "within a second".
pub const DEADLINE: Duration = Duration::from_secs(10);

pub const BIN: &str = env!("CARGO_BIN_EXE_sandbox-dp");

/// A running `sandbox-dp serve`; killed on drop.
pub struct Daemon {
    pub child: Child,
}

impl Daemon {
    /// With a resync of an hour: events, not the resync, must drive every update a test waits
    /// for.
    pub fn start(root: &Path, kubelet_dir: &Path, extra: &[&str]) -> Daemon {
        Self::start_with_resync(root, kubelet_dir, "1h", extra)
    }

    pub fn start_with_resync(
        root: &Path,
        kubelet_dir: &Path,
        resync: &str,
        extra: &[&str],
    ) -> Daemon {
        let child = Command::new(BIN)
            .arg("serve")
            .arg("--host-root")
            .arg(root)
            .arg("--kubelet-dir")
            .arg(kubelet_dir)
            .args(["--resync-interval", resync])
            .args(extra)
            .env("RUST_LOG", "sandbox_dp=debug")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Daemon { child }
    }

    /// SIGTERM, then the exit status (killed after the deadline).
    pub fn terminate(&mut self) -> ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        self.wait(DEADLINE)
            .expect("sandbox-dp did not exit after SIGTERM")
    }

    /// The exit status once it exits, if within `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a one-shot subcommand.
pub fn run(args: &[&str], root: &Path) -> Output {
    Command::new(BIN)
        .args(args)
        .arg("--host-root")
        .arg(root)
        .output()
        .unwrap()
}

pub fn write(root: &Path, rel: &str, value: &str) {
    let p = root.join(rel);
    std::fs::write(&p, value)
        .unwrap_or_else(|e| panic!("writing {value:?} to {}: {e}", p.display()));
}

/// Binds a function from nvidia to vfio-pci the way vfio-manager does.
pub fn bind_vfio(root: &Path, bdf: &str) {
    write(
        root,
        &format!("sys/bus/pci/devices/{bdf}/driver_override"),
        "vfio-pci",
    );
    write(root, "sys/bus/pci/drivers/nvidia/unbind", bdf);
    write(root, "sys/bus/pci/drivers_probe", bdf);
}

/// Gives a function back to nvidia.
pub fn unbind_vfio(root: &Path, bdf: &str) {
    write(
        root,
        &format!("sys/bus/pci/devices/{bdf}/driver_override"),
        "\n",
    );
    write(root, "sys/bus/pci/drivers/vfio-pci/unbind", bdf);
    write(root, "sys/bus/pci/drivers_probe", bdf);
}

pub fn ids(list: &[Device]) -> Vec<String> {
    list.iter().map(|d| d.id.clone()).collect()
}

pub fn numa(d: &Device) -> Vec<i64> {
    d.topology
        .as_ref()
        .map(|t| t.nodes.iter().map(|n| n.id).collect())
        .unwrap_or_default()
}

pub fn host_paths(c: &ContainerAllocateResponse) -> Vec<String> {
    c.devices.iter().map(|d| d.host_path.clone()).collect()
}

/// Whether this process may send uevents (root, for `CAP_NET_ADMIN`). When it may not, prints
/// `skipped: ...`, or panics when `NODE_SIM=required` (where node-sim runs, root is there:
/// CI requires every root-only test).
pub fn may_send_uevents(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    let line = format!("skipped: {what}: not root (sending a uevent needs CAP_NET_ADMIN)");
    if std::env::var("NODE_SIM").is_ok_and(|v| v == "required") {
        panic!("NODE_SIM=required but {line}");
    }
    eprintln!("{line}");
    false
}

/// A kubelet directory outside the host root (node-sim's is a plain directory too).
pub fn kubelet_dir() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::Builder::new()
        .prefix("kubelet-")
        .tempdir()
        .unwrap();
    let p = d.path().join("device-plugins");
    (d, p)
}
