//! sandbox-dp `--on-demand`: on a node with no vGPUs, Allocate of a pool slot (the vGPU made in
//! the call) → answered with the vGPU ready; the same Allocate → another size's ListAndWatch
//! dropping what the GPU can no longer host; the pod gone from the fake PodResources `List` →
//! the vGPU removed from sysfs, and → that size's list whole again. Both `--on-demand-poll`
//! settings: the release waits for the next poll. The floor: each Allocate's sysfs writes (the
//! mdev `create`, the VF's `current_vgpu_type`) replayed bare on a fresh node brought to the
//! same state by the daemon's other writes.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use testkit::kubelet::pod_resources::pod;
use testkit::kubelet::{FakeKubelet, FakePodResources};

use crate::Cli;
use crate::harness::bins::Bins;
use crate::harness::floor::{replay, writes};
use crate::harness::process::Invocation;
use crate::harness::report::{Report, ratio};
use crate::harness::stats::{fmt_p50_p99, summarize};
use crate::harness::topology::{builtin, mount};
use crate::sections::dp::Daemon;

/// One node: the slot allocated each cycle and the other size whose list it changes.
struct Case {
    topology: &'static str,
    label: &'static str,
    pool: &'static str,
    resource: &'static str,
    slot: &'static str,
    env: &'static str,
    other: &'static str,
    other_full: usize,
    other_after: usize,
    /// The handle (mdev UUID or VF) is gone from sysfs.
    gone: fn(&Path, &str) -> bool,
}

fn mdev_gone(root: &Path, uuid: &str) -> bool {
    !root.join("sys/bus/mdev/devices").join(uuid).exists()
}

fn vf_cleared(root: &Path, vf: &str) -> bool {
    std::fs::read_to_string(
        root.join("sys/bus/pci/devices")
            .join(vf)
            .join("nvidia/current_vgpu_type"),
    )
    .is_ok_and(|t| t.trim() == "0")
}

const CASES: [Case; 2] = [
    Case {
        topology: "2xA10",
        label: "2xA10 (mdev on a VF)",
        pool: "all",
        resource: "nvidia.com/NVIDIA_A10-4Q",
        slot: "0000:41:00.0-A10-4Q-0",
        env: "MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q",
        other: "nvidia.com/NVIDIA_A10-8Q",
        other_full: 6,
        other_after: 3,
        gone: mdev_gone,
    },
    Case {
        topology: "8xH100-sriov",
        label: "8xH100-sriov, one GPU pooled (current_vgpu_type)",
        pool: "0000:13:00.0",
        resource: "nvidia.com/NVIDIA_H100XM-8C",
        slot: "0000:13:00.0-H100XM-8C-0",
        env: "PCI_RESOURCE_NVIDIA_COM_NVIDIA_H100XM-8C",
        other: "nvidia.com/NVIDIA_H100XM-4C",
        other_full: 20,
        other_after: 0,
        gone: vf_cleared,
    },
];

#[derive(Default)]
struct Samples {
    /// Each Allocate's writes replayed bare.
    floor: Vec<Duration>,
    ready: Vec<Duration>,
    other_list: Vec<Duration>,
    removed: Vec<Duration>,
    other_back: Vec<Duration>,
}

const PATIENCE: Duration = Duration::from_secs(30);

async fn until(what: &str, mut pred: impl FnMut() -> bool) -> Result<()> {
    let end = Instant::now() + PATIENCE;
    while !pred() {
        if Instant::now() > end {
            bail!("not within {PATIENCE:?}: {what}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

async fn once(b: &Bins, case: &Case, poll: &str, cycles: usize, s: &mut Samples) -> Result<()> {
    let topology = builtin(case.topology)?;
    let sim = mount(&topology);
    let root = sim.root();
    let kdir = root.join("var/lib/kubelet/device-plugins");
    let mut kubelet = FakeKubelet::start(&kdir).await?;
    let pods =
        FakePodResources::start(&root.join("var/lib/kubelet/pod-resources/kubelet.sock")).await?;
    let inv = Invocation::new(
        &b.dp,
        &[
            &"--host-root",
            &root,
            &"serve",
            &"--on-demand",
            &case.pool,
            &"--on-demand-poll",
            &poll,
        ],
    );
    let daemon = Daemon::start(&inv).await?;
    let regs = kubelet
        .wait_for(&[case.resource, case.other], PATIENCE)
        .await
        .with_context(|| daemon.stderr_tail())?;
    let mut client = kubelet.plugin(&regs[case.resource].endpoint).await?;
    let mut other = kubelet.plugin(&regs[case.other].endpoint).await?;
    let mut lw = other.list_and_watch().await?;
    lw.wait_until(PATIENCE, |l| l.len() == case.other_full)
        .await?;
    let records = root.join("run/gpu-vm-node/on-demand-vgpus.json");
    let one: &[&str] = &[case.slot];
    let request = [one];
    // The node's writes in order, as (Allocate's or not, writes): the start's (VFs enabled),
    // then each cycle's Allocate and release, replayed on a fresh node for the floor.
    let mut ops = vec![(false, writes(&sim.ops()))];
    sim.clear_ops();
    for _ in 0..cycles {
        let t = Instant::now();
        let ((resp, ready), listed) = tokio::join!(
            async {
                let r = client.allocate(&request).await;
                (r, t.elapsed())
            },
            async {
                let r = lw
                    .wait_until(PATIENCE, |l| l.len() == case.other_after)
                    .await;
                (r, t.elapsed())
            }
        );
        let resp = resp.map_err(|e| anyhow!("Allocate: {e}: {}", daemon.stderr_tail()))?;
        ops.push((true, writes(&sim.ops())));
        sim.clear_ops();
        listed.0?;
        let handle = resp
            .container_responses
            .first()
            .and_then(|c| c.envs.get(case.env))
            .ok_or_else(|| anyhow!("no {} in the answer", case.env))?
            .clone();
        s.ready.push(ready);
        s.other_list.push(listed.1);
        // kubelet runs the pod, then it is deleted.
        pods.set_pods(vec![pod(
            "bench",
            "vm",
            "compute",
            case.resource,
            &[case.slot],
        )]);
        until("the pod is seen", || {
            std::fs::read_to_string(&records).is_ok_and(|t| t.contains("\"seen\": true"))
        })
        .await?;
        let t = Instant::now();
        pods.set_pods(vec![]);
        let (gone, back) = tokio::join!(
            async {
                until("the vGPU is removed", || (case.gone)(root, &handle)).await?;
                Ok::<_, anyhow::Error>(t.elapsed())
            },
            async {
                lw.wait_until(PATIENCE, |l| l.len() == case.other_full)
                    .await?;
                Ok::<_, anyhow::Error>(t.elapsed())
            }
        );
        s.removed.push(gone?);
        s.other_back.push(back?);
        ops.push((false, writes(&sim.ops())));
        sim.clear_ops();
    }
    daemon.stop().await;
    drop(sim);
    let fresh = mount(&topology);
    for (allocate, w) in &ops {
        let took = replay(fresh.root(), w)?;
        if *allocate {
            s.floor.push(took);
        }
    }
    Ok(())
}

pub async fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let cycles = cli.on_demand_cycles;
    r.line("### sandbox-dp --on-demand");
    r.line("");
    r.line(format!("A node with no vGPUs, sandbox-dp `serve --on-demand` with the fake kubelet and a fake PodResources service; {cycles} cycles per run of: Allocate of one slot (the vGPU is created inside the call: mdev `create` on a VF of the A10, `current_vgpu_type` on a free VF of the H100) → the answer, with the vGPU ready (`ready`); the same Allocate → the other size's ListAndWatch update (`other size listed`: A10-8Q 6 → 3, H100XM-4C 20 → 0); the pod listed by PodResources then gone → the vGPU removed from sysfs (`removed`) and → the other size listed whole again (`other size back`). The release is found by the next `--on-demand-poll`, so `removed` is about half the poll interval plus the removal. Floor: each Allocate's sysfs write replayed bare on a fresh node brought through the same states (the daemon's other writes replayed too, untimed); `ready p99 / floor` is against the floor's p50. Goal: ready p99 ≤ 3× floor. p50 and p99 over all cycles of all runs. The pre-created path's Allocate (nothing created in the call) is in the sandbox-dp table above."));
    r.line("");
    r.table(&[
        "node",
        "poll",
        "floor p50",
        "floor p99",
        "ready p50",
        "ready p99",
        "ready p99 / floor",
        "other size listed p50",
        "other size listed p99",
        "removed p50",
        "removed p99",
        "other size back p50",
        "other size back p99",
    ]);
    for case in &CASES {
        for poll in ["1s", "100ms"] {
            let mut s = Samples::default();
            for _ in 0..cli.runs {
                once(b, case, poll, cycles, &mut s)
                    .await
                    .with_context(|| format!("{} --on-demand-poll {poll}", case.label))?;
            }
            let mut row = vec![case.label.to_string(), poll.to_string()];
            for v in [&s.floor, &s.ready] {
                let (p50, p99) = fmt_p50_p99(v).ok_or_else(|| anyhow!("no samples"))?;
                row.extend([p50, p99]);
            }
            let (floor, ready) = (summarize(&s.floor), summarize(&s.ready));
            let (floor, ready) = floor.zip(ready).ok_or_else(|| anyhow!("no samples"))?;
            row.push(ratio(ready.p99, floor.median));
            for v in [&s.other_list, &s.removed, &s.other_back] {
                let (p50, p99) = fmt_p50_p99(v).ok_or_else(|| anyhow!("no samples"))?;
                row.extend([p50, p99]);
            }
            r.row(&row);
        }
    }
    r.line("");
    Ok(())
}
