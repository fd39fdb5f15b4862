//! A node-sim mount in a temporary directory, for tests.
//!
//! ```no_run
//! let Some(sim) = testkit::sim::try_mount("2xA10") else { return };
//! let root = sim.root(); // pass as --host-root
//! ```

use std::ops::Deref;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

pub use node_sim::{Op, Sim, Topology};

/// A mounted simulated node and the temporary directory it lives in. Dropping it unmounts,
/// then removes the directory.
#[derive(Debug)]
pub struct SimDir {
    // Field order matters: the mount goes before the directory.
    sim: Sim,
    _dir: tempfile::TempDir,
}

impl SimDir {
    /// The mounted node.
    pub fn sim(&self) -> &Sim {
        &self.sim
    }

    /// The host root (`DIR`).
    pub fn root(&self) -> &Path {
        self.sim.root()
    }
}

impl Deref for SimDir {
    type Target = Sim;

    fn deref(&self) -> &Sim {
        &self.sim
    }
}

pub use node_sim::skip_test;

/// Why node-sim cannot run here, if it cannot: it needs root and `/dev/fuse`.
pub fn unavailable() -> Option<String> {
    node_sim::unavailable().map(str::to_string)
}

/// Mounts the topology (a built-in name or a TOML file) in a new temporary directory. Returns
/// `None` after printing `skipped: ...` when this machine cannot run node-sim (a panic instead
/// with `NODE_SIM=required`); panics when it can but the mount fails (that is a test failure,
/// not a skip).
pub fn try_mount(topology: &str) -> Option<SimDir> {
    if let Some(why) = node_sim::unavailable() {
        node_sim::skip_test(&format!("node-sim {topology}"), why);
        return None;
    }
    let topo = match node_sim::topology(topology) {
        Ok(t) => t,
        Err(e) => panic!("node-sim topology {topology}: {}", chain(&e)),
    };
    Some(mount_topology(&topo))
}

/// Mounts an already resolved topology (root and /dev/fuse must be there: see [`unavailable`]).
pub fn mount_topology(topo: &Topology) -> SimDir {
    let dir = match tempfile::Builder::new().prefix("node-sim-").tempdir() {
        Ok(d) => d,
        Err(e) => panic!("creating a temporary directory: {e}"),
    };
    match node_sim::mount(topo, dir.path()) {
        Ok(sim) => SimDir { sim, _dir: dir },
        Err(e) => panic!("mounting node-sim ({}): {}", topo.name, chain(&e)),
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Opens the GPU `bdf`'s `/dev/nvidia<N>` under `root` (the minor from the driver's own
/// `proc/driver/nvidia/gpus/<bdf>/information`) from a shell of its own, as a CUDA job would:
/// the GPU is in use until the holder is dropped. Not from the test process, which starts
/// daemons while it holds.
pub fn hold_nvidia_node(root: &Path, bdf: &str) -> ShellHolder {
    let info_path = root.join(format!("proc/driver/nvidia/gpus/{bdf}/information"));
    let info = std::fs::read_to_string(&info_path)
        .unwrap_or_else(|e| panic!("{}: {e}", info_path.display()));
    let minor = info
        .lines()
        .find_map(|l| l.strip_prefix("Device Minor:"))
        .unwrap_or_else(|| panic!("no Device Minor in {}", info_path.display()))
        .trim()
        .to_string();
    ShellHolder::hold(&root.join(format!("dev/nvidia{minor}")))
}

/// A shell holding a device node open as a shell script would (`exec 7<>NODE`, then `exec
/// sleep`: the descriptor passes to the sleeping process). Held from [`ShellHolder::hold`]
/// returning (the shell said so) until [`ShellHolder::release`] or drop.
#[derive(Debug)]
pub struct ShellHolder(std::process::Child);

impl ShellHolder {
    /// Opens `node` read-write from a shell and waits until it is open.
    pub fn hold(node: &Path) -> ShellHolder {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "exec 7<>\"$1\"; echo held; exec sleep 600", "sh"])
            .arg(node)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("sh: {e}"));
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line);
        }
        assert_eq!(line.trim(), "held", "sh could not open {}", node.display());
        ShellHolder(child)
    }

    /// The holding process's pid (a user report names it).
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Lets go: the process is killed and reaped, the node closed.
    pub fn release(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ShellHolder {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The writes to simulated kernel files node-sim logged since the last `clear_ops` (the
/// control file's own left out), in order.
pub fn writes(sim: &Sim) -> Vec<Op> {
    sim.ops()
        .into_iter()
        .filter(|o| !o.path.contains("node-sim/"))
        .collect()
}

/// Kills `child` with SIGKILL as soon as `now()` holds (polled every millisecond) or it exits
/// by itself, and reaps it. Returns whether it was still running when `now()` held. Crash tests
/// pair it with slowed writes (`fault <op> * delay=MS`, and `after=MS` to hold the answer of a
/// write already done) and `now` counting [`writes`], so that the kill lands near the k-th
/// write.
pub fn kill_when(child: &mut Child, patience: Duration, mut now: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + patience;
    let killed = loop {
        if matches!(child.try_wait(), Ok(Some(_))) {
            break false;
        }
        if now() {
            let _ = child.kill();
            break true;
        }
        if Instant::now() >= end {
            panic!("within {patience:?}: neither the kill point came nor the process ended");
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let _ = child.wait();
    killed
}
