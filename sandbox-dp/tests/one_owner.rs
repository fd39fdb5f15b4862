//! One owner per GPU between sandbox-dp `--on-demand all` and sandbox-dra `--vgpu all`, started
//! at the same moment, many times, on a simulated 2xA10 node: each time one of them holds the
//! GPUs and the other refuses to start, naming a GPU and the owner; never both.
//!
//! sandbox-dra is the binary built beside sandbox-dp (`cargo test --workspace` builds it; a
//! test without it says `skipped`), given a real API server (the cluster tier's assets; skipped
//! without them) it does not need before its pool is claimed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_sandbox-dp");
const ROUNDS: usize = 40;
const STEP: Duration = Duration::from_millis(2);
const PATIENCE: Duration = Duration::from_secs(60);

/// A process killed when the test ends however it ends, its stderr in a file.
struct Proc {
    child: Child,
    log: tempfile::NamedTempFile,
}

impl Proc {
    fn spawn(mut cmd: Command) -> Proc {
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .spawn()
            .unwrap();
        Proc { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Waits until it exited (`Some(code)`) or `claimed` exists (`None`).
    fn settled(&mut self, claimed: &Path) -> Option<i32> {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s.code().unwrap_or(-1));
            }
            if claimed.exists() {
                return None;
            }
            assert!(
                t.elapsed() < PATIENCE,
                "neither ran nor exited:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sandbox_dra() -> Option<PathBuf> {
    let p = Path::new(BIN).parent()?.join("sandbox-dra");
    if p.is_file() {
        return Some(p);
    }
    println!(
        "skipped: {} is not built; cargo test --workspace builds it",
        p.display()
    );
    None
}

#[test]
fn sandbox_dp_on_demand_and_sandbox_dra_started_together_never_both_take_a_gpu() {
    let Some(dra_bin) = sandbox_dra() else {
        return;
    };
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(api) = cluster_tier::ApiServer::start_or_skip("two pool owners at once").unwrap()
    else {
        return;
    };
    let root = sim.root();
    let kdir = tempfile::tempdir().unwrap();
    let state = root.join("run/gpu-vm-node");
    let (on_demand_pool, dra_pool) = (state.join("on-demand-pool"), state.join("dra-pool"));
    let mut winners = [0, 0];
    for round in 0..ROUNDS {
        let _ = std::fs::remove_file(&on_demand_pool);
        let _ = std::fs::remove_file(&dra_pool);
        let mut dp = Command::new(BIN);
        dp.arg("--host-root")
            .arg(root)
            .arg("--kubelet-dir")
            .arg(kdir.path())
            .args(["--on-demand", "all", "serve"]);
        let mut dra = Command::new(&dra_bin);
        dra.arg("--host-root")
            .arg(root)
            .args(["--node-name", "node-a", "--kubeconfig"])
            .arg(api.admin_kubeconfig())
            .args(["--vgpu", "all", "serve"]);
        for c in [&mut dp, &mut dra] {
            for var in [
                "HOST_ROOT",
                "KUBELET_DIR",
                "KUBELET_ROOT",
                "NODE_NAME",
                "VGPU",
            ] {
                c.env_remove(var);
            }
        }
        // Started one after the other, each first in turn, a little further apart every other
        // round: the rounds sweep the moment both claim at once.
        let gap = STEP * (round / 2) as u32;
        let (mut dp, mut dra) = if round % 2 == 0 {
            let dp = Proc::spawn(dp);
            std::thread::sleep(gap);
            (dp, Proc::spawn(dra))
        } else {
            let dra = Proc::spawn(dra);
            std::thread::sleep(gap);
            (Proc::spawn(dp), dra)
        };
        let (dp_exit, dra_exit) = (dp.settled(&on_demand_pool), dra.settled(&dra_pool));
        let what = format!(
            "round {round}: on-demand pool {:?}, sandbox-dp exit {dp_exit:?}; dra pool {:?}, \
             sandbox-dra exit {dra_exit:?}\n--- sandbox-dp\n{}\n--- sandbox-dra\n{}",
            std::fs::read_to_string(&on_demand_pool).ok(),
            std::fs::read_to_string(&dra_pool).ok(),
            dp.log(),
            dra.log()
        );
        let (loser, owner) = match (dp_exit, dra_exit) {
            (None, Some(_)) => {
                winners[0] += 1;
                (&dra, "sandbox-dp's on-demand pool")
            }
            (Some(_), None) => {
                winners[1] += 1;
                (&dp, "sandbox-dra's vGPU pool")
            }
            _ => panic!("one owner must hold the GPUs, the other refuse: {what}"),
        };
        let log = loser.log();
        assert!(
            log.contains("GPU 0000:") && log.contains(owner) && log.contains("a GPU has one owner"),
            "{what}"
        );
        assert!(
            !(on_demand_pool.exists() && dra_pool.exists()),
            "both pools written: {what}"
        );
    }
    println!(
        "{ROUNDS} rounds: sandbox-dp took the GPUs {} times, sandbox-dra {}",
        winners[0], winners[1]
    );
}
