//! `sandbox-dp wait-ready`, the deployment's init container: it passes once the readiness file
//! of the node's workload exists, read from the node label `nvidia.com/gpu.workload.config` on a
//! real API server (the cluster tier's assets; skipped without them), and never on the other
//! daemon's file (a `vfio-pci-ready` left by a vfio-manager killed on a relabel to `vm-vgpu`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cluster_tier::ApiServer;

const BIN: &str = env!("CARGO_BIN_EXE_sandbox-dp");
const WORKLOAD: &str = "nvidia.com/gpu.workload.config";
/// How long something that should happen promptly may take before it is called lost.
const PATIENCE: Duration = Duration::from_secs(60);

/// `sandbox-dp wait-ready` for `node`, its log in `log`.
struct Waiter {
    child: Child,
    log: tempfile::NamedTempFile,
}

impl Waiter {
    fn start(root: &Path, api: &ApiServer, node: &str) -> Waiter {
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(BIN)
            .arg("--host-root")
            .arg(root)
            .args(["--node-name", node, "--kubeconfig"])
            .arg(api.admin_kubeconfig())
            .arg("wait-ready")
            .env_remove("NODE_NAME")
            .env_remove("HOST_ROOT")
            .env_remove("KUBELET_DIR")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap();
        Waiter { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Waits until the log says `line`; the waiter must still be waiting then.
    fn says(&mut self, line: &str) {
        let t = Instant::now();
        while !self.log().contains(line) {
            assert!(
                t.elapsed() < PATIENCE,
                "never said {line:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "it stopped waiting:\n{}",
            self.log()
        );
    }

    /// Its exit status, once it exits.
    fn exits(&mut self) -> Option<i32> {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(t.elapsed() < PATIENCE, "still waiting:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_wait_is_for_the_file_of_the_nodes_workload() {
    let Some(api) = ApiServer::start_or_skip("sandbox-dp wait-ready").unwrap() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let validations = root.join("run/nvidia/validations");
    std::fs::create_dir_all(&validations).unwrap();

    // A vGPU node with vfio-pci-ready left over: not prepared until vgpu-devices-ready.
    api.create_node("node-v", &[(WORKLOAD, "vm-vgpu")]).unwrap();
    std::fs::write(validations.join("vfio-pci-ready"), "").unwrap();
    let mut w = Waiter::start(root, &api, "node-v");
    let vgpu_ready = validations.join("vgpu-devices-ready");
    w.says(&format!(
        "waiting for {} (node node-v is {WORKLOAD} vm-vgpu)",
        vgpu_ready.display()
    ));
    std::fs::write(&vgpu_ready, "").unwrap();
    assert_eq!(w.exits(), Some(0), "{}", w.log());
    assert!(
        w.log().contains("node node-v (vm-vgpu) is prepared"),
        "{}",
        w.log()
    );

    // Relabelled while it waits: it waits for the new workload's file.
    std::fs::remove_file(validations.join("vfio-pci-ready")).unwrap();
    api.create_node("node-p", &[(WORKLOAD, "vm-passthrough")])
        .unwrap();
    let mut w = Waiter::start(root, &api, "node-p");
    w.says(&format!(
        "waiting for {} (node node-p is {WORKLOAD} vm-passthrough)",
        validations.join("vfio-pci-ready").display()
    ));
    api.set_label("node-p", WORKLOAD, Some("vm-vgpu")).unwrap();
    assert_eq!(w.exits(), Some(0), "{}", w.log());

    // A workload of no file of its: it waits, and says so; SIGTERM ends the wait, not passed.
    api.create_node("node-d", &[(WORKLOAD, "vm-dra")]).unwrap();
    let mut w = Waiter::start(root, &api, "node-d");
    w.says("node node-d is nvidia.com/gpu.workload.config \"vm-dra\": no readiness file");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(w.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(w.exits(), Some(1), "{}", w.log());
}

#[test]
fn without_a_node_name_it_is_a_usage_error() {
    let o = Command::new(BIN)
        .args(["--host-root", "/nonexistent", "wait-ready"])
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("wait-ready needs --node-name"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
