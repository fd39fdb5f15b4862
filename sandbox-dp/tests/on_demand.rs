//! `--on-demand`: sandbox-dp as a process against node-sim and the fake kubelet, creating
//! vGPUs in Allocate and removing them once kubelet's PodResources no longer lists their pod.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::*;
use testkit::kubelet::api::AllocateResponse;
use testkit::kubelet::pod_resources::pod;
use testkit::kubelet::{FakeKubelet, FakePodResources, PluginClient, checkpoint};

const A10_4Q: &str = "nvidia.com/NVIDIA_A10-4Q";
const A10_8Q: &str = "nvidia.com/NVIDIA_A10-8Q";
const GPU_A: &str = "0000:41:00.0";
const GPU_B: &str = "0000:61:00.0";

/// A kubelet directory, the fake kubelet in it, and its PodResources service (no pods yet) where
/// sandbox-dp looks by default.
async fn kubelet_with_pods() -> (tempfile::TempDir, PathBuf, FakeKubelet, FakePodResources) {
    let (k, kdir) = kubelet_dir();
    let kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let socket = kdir.parent().unwrap().join("pod-resources/kubelet.sock");
    let pods = FakePodResources::start(&socket).await.unwrap();
    (k, kdir, kubelet, pods)
}

/// sandbox-dp `serve` with `args` on `root` (2xA10), with a fake kubelet and PodResources, and
/// clients of its A10-4Q and A10-8Q plugins.
async fn a10_pool(root: &Path, args: &[&str]) -> A10Pool {
    let (k, kdir, mut kubelet, pods) = kubelet_with_pods().await;
    let d = Daemon::start(root, &kdir, args);
    let regs = kubelet.wait_for(&[A10_4Q, A10_8Q], DEADLINE).await.unwrap();
    let p4 = kubelet.plugin(&regs[A10_4Q].endpoint).await.unwrap();
    let p8 = kubelet.plugin(&regs[A10_8Q].endpoint).await.unwrap();
    A10Pool {
        p4,
        p8,
        kdir,
        pods,
        _d: d,
        _kubelet: kubelet,
        _k: k,
    }
}

struct A10Pool {
    p4: PluginClient,
    p8: PluginClient,
    kdir: PathBuf,
    pods: FakePodResources,
    // Drop order: the daemon before the kubelet and its directory.
    _d: Daemon,
    _kubelet: FakeKubelet,
    _k: tempfile::TempDir,
}

/// An A10-4Q and an A10-8Q Allocate of GPU A's first slots, at once.
async fn race_4q_8q(
    p: &mut A10Pool,
) -> (
    Result<AllocateResponse, tonic::Status>,
    Result<AllocateResponse, tonic::Status>,
) {
    let (s4, s8) = (format!("{GPU_A}-A10-4Q-0"), format!("{GPU_A}-A10-8Q-0"));
    let (c4, c8): (&[&str], &[&str]) = (&[s4.as_str()], &[s8.as_str()]);
    let (q4, q8) = ([c4], [c8]);
    tokio::join!(p.p4.allocate(&q4), p.p8.allocate(&q8))
}

/// GPU A's VFs enabled, and an A10-4Q mdev made by hand on each `(VF, UUID)`: vGPUs an
/// earlier sandbox-dp left.
fn a10_4q_mdevs(root: &Path, mdevs: &[(&str, &str)]) {
    write(
        root,
        &format!("sys/bus/pci/devices/{GPU_A}/sriov_numvfs"),
        "32",
    );
    for (vf, uuid) in mdevs {
        write(
            root,
            &format!("sys/class/mdev_bus/{vf}/mdev_supported_types/nvidia-593/create"),
            uuid,
        );
    }
}

fn records(root: &Path) -> String {
    std::fs::read_to_string(root.join("run/gpu-vm-node/on-demand-vgpus.json")).unwrap_or_default()
}

/// Waits (generously) until `pred` holds; panics with `what` otherwise.
fn eventually(what: &str, pred: impl Fn() -> bool) {
    let end = Instant::now() + DEADLINE;
    while Instant::now() < end {
        if pred() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("not within {DEADLINE:?}: {what}");
}

fn read(root: &Path, rel: &str) -> String {
    std::fs::read_to_string(root.join(rel))
        .unwrap_or_default()
        .trim()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a10s_create_a_4q_on_allocate_and_remove_it_when_the_pod_is_gone() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let mut pool = a10_pool(root, &["--on-demand", "all", "--on-demand-poll", "100ms"]).await;
    let A10Pool {
        p4, p8, kdir, pods, ..
    } = &mut pool;
    let mut lw4 = p4.list_and_watch().await.unwrap();
    let mut lw8 = p8.list_and_watch().await.unwrap();
    let l4 = lw4.wait_until(DEADLINE, |l| l.len() == 12).await.unwrap();
    lw8.wait_until(DEADLINE, |l| l.len() == 6).await.unwrap();
    assert!(l4.iter().all(|d| d.health == "Healthy" && numa(d) == [0]));
    assert_eq!(
        read(root, "run/gpu-vm-node/on-demand-pool"),
        format!("# gpu-vm-node on-demand-pool v1\n{GPU_A}\n{GPU_B}"),
        "the pool is written for vgpu-device-manager"
    );
    assert!(
        std::fs::read_dir(root.join("sys/bus/mdev/devices"))
            .unwrap()
            .next()
            .is_none(),
        "no vGPU before an Allocate"
    );

    // Packing: a GPU already hosting a 4Q is preferred once there is one; first, any.
    let slot = format!("{GPU_A}-A10-4Q-0");
    assert!(ids(&l4).contains(&slot), "{:?}", ids(&l4));
    let resp = p4.allocate(&[&[slot.as_str()]]).await.unwrap();
    let c = &resp.container_responses[0];
    let uuid = c
        .envs
        .get("MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q")
        .expect("the env KubeVirt reads")
        .clone();
    assert_eq!(
        read(root, &format!("sys/bus/mdev/devices/{uuid}/mdev_type/name")),
        "NVIDIA A10-4Q"
    );
    let group =
        std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{uuid}/iommu_group"))).unwrap();
    let group = group.file_name().unwrap().to_str().unwrap().to_string();
    assert_eq!(
        host_paths(c),
        ["/dev/vfio/vfio".to_string(), format!("/dev/vfio/{group}")]
    );
    // kubelet allocating the same device again (a restarted container) gets the same vGPU.
    let again = p4.allocate(&[&[slot.as_str()]]).await.unwrap();
    assert_eq!(
        again.container_responses[0].envs["MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q"],
        uuid
    );
    assert_eq!(
        std::fs::read_dir(root.join("sys/bus/mdev/devices"))
            .unwrap()
            .count(),
        1
    );
    // GPU A now holds only 4Qs: its 8Qs go, GPU B's stay; the 4Q slots stay 12 (one taken).
    let l8 = lw8.wait_until(DEADLINE, |l| l.len() == 3).await.unwrap();
    assert!(ids(&l8).iter().all(|i| i.starts_with(GPU_B)), "{l8:?}");
    let l4 = lw4.wait_until(DEADLINE, |l| l.len() == 12).await.unwrap();
    assert!(ids(&l4).contains(&slot));
    let pref = p4
        .preferred(
            &ids(&l4).iter().map(String::as_str).collect::<Vec<_>>(),
            &[],
            1,
        )
        .await
        .unwrap();
    assert!(
        pref[0].starts_with(GPU_A),
        "packs onto the GPU hosting 4Qs: {pref:?}"
    );

    // kubelet runs the pod, then the pod is deleted: gone from List, its checkpoint entry left.
    pods.set_pods(vec![pod("vms", "vm-a", "compute", A10_4Q, &[&slot])]);
    checkpoint::write(
        kdir,
        &[checkpoint::entry("uid-a", "compute", A10_4Q, &[&slot])],
    )
    .unwrap();
    eventually("the pod is seen holding the vGPU", || {
        records(root).contains("\"seen\": true")
    });
    assert!(root.join(format!("sys/bus/mdev/devices/{uuid}")).exists());
    pods.set_pods(vec![]);
    eventually("the vGPU is removed once its pod is gone", || {
        !root.join(format!("sys/bus/mdev/devices/{uuid}")).exists()
    });
    lw8.wait_until(DEADLINE, |l| l.len() == 6).await.unwrap();
    assert!(!records(root).contains(&uuid), "{}", records(root));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h100_sets_current_vgpu_type_on_a_free_vf_and_clears_it() {
    let Some(sim) = testkit::sim::try_mount("8xH100-sriov") else {
        return;
    };
    let root = sim.root();
    let pf = "0000:13:00.0";
    let r8 = "nvidia.com/NVIDIA_H100XM-8C";
    let r4 = "nvidia.com/NVIDIA_H100XM-4C";
    let (_k, kdir, mut kubelet, pods) = kubelet_with_pods().await;
    let _d = Daemon::start(
        root,
        &kdir,
        &["--on-demand", pf, "--on-demand-poll", "100ms"],
    );
    let regs = kubelet.wait_for(&[r8, r4], DEADLINE).await.unwrap();
    let mut p8 = kubelet.plugin(&regs[r8].endpoint).await.unwrap();
    let mut p4 = kubelet.plugin(&regs[r4].endpoint).await.unwrap();
    let mut lw8 = p8.list_and_watch().await.unwrap();
    let mut lw4 = p4.list_and_watch().await.unwrap();
    lw8.wait_until(DEADLINE, |l| l.len() == 10).await.unwrap();
    lw4.wait_until(DEADLINE, |l| l.len() == 20).await.unwrap();

    let slot = format!("{pf}-H100XM-8C-0");
    let resp = p8.allocate(&[&[slot.as_str()]]).await.unwrap();
    let c = &resp.container_responses[0];
    let vf = c
        .envs
        .get("PCI_RESOURCE_NVIDIA_COM_NVIDIA_H100XM-8C")
        .expect("the env KubeVirt reads")
        .clone();
    let physfn = std::fs::read_link(root.join(format!("sys/bus/pci/devices/{vf}/physfn"))).unwrap();
    assert_eq!(
        physfn.file_name().unwrap(),
        pf,
        "a VF of the GPU the slot names"
    );
    assert_eq!(
        read(
            root,
            &format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type")
        ),
        "1002"
    );
    lw4.wait_until(DEADLINE, |l| l.is_empty()).await.unwrap();
    lw8.wait_until(DEADLINE, |l| l.len() == 10).await.unwrap();

    // A second 8C on the same GPU: another VF.
    let slot2 = format!("{pf}-H100XM-8C-1");
    let resp = p8.allocate(&[&[slot2.as_str()]]).await.unwrap();
    let vf2 = resp.container_responses[0].envs["PCI_RESOURCE_NVIDIA_COM_NVIDIA_H100XM-8C"].clone();
    assert_ne!(vf, vf2);

    pods.set_pods(vec![pod("vms", "vm-a", "compute", r8, &[&slot])]);
    // slot2's pod never shows up; with the default grace it stays for now. slot's pod ends:
    eventually("the pod is seen holding the vGPU", || {
        records(root).contains("\"seen\": true")
    });
    pods.set_pods(vec![]);
    eventually("the VF is cleared once its pod is gone", || {
        read(
            root,
            &format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type"),
        ) == "0"
    });
    assert_eq!(
        read(
            root,
            &format!("sys/bus/pci/devices/{vf2}/nvidia/current_vgpu_type")
        ),
        "1002",
        "an allocation within its grace period stays"
    );
}

/// A crash left records behind: one vGPU made for an Allocate kubelet never recorded (its
/// create written, `creating`), one held by a running pod. The next start removes the first
/// after the grace period and keeps the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_a_crash_removes_the_orphan_and_keeps_the_pods_vgpu() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let (orphan, held) = (
        "5a3b2c1d-0000-4000-8000-00000000000a",
        "5a3b2c1d-0000-4000-8000-00000000000b",
    );
    a10_4q_mdevs(root, &[("0000:41:00.4", orphan), ("0000:41:00.5", held)]);
    let rec = |device: &str, uuid: &str, phase: &str, seen: bool| {
        format!(
            r#"{{"device":"{device}","resource":"{A10_4Q}","gpu":"{GPU_A}","type_name":"NVIDIA A10-4Q","handle":"{uuid}","vendor":false,"phase":"{phase}","since":0,"seen":{seen}}}"#
        )
    };
    std::fs::create_dir_all(root.join("run/gpu-vm-node")).unwrap();
    std::fs::write(
        root.join("run/gpu-vm-node/on-demand-vgpus.json"),
        format!(
            r#"{{"vgpus":[{},{}]}}"#,
            rec(&format!("{GPU_A}-A10-4Q-0"), orphan, "creating", false),
            rec(&format!("{GPU_A}-A10-4Q-1"), held, "ready", true)
        ),
    )
    .unwrap();
    let (_k, kdir, mut kubelet, _pods) = kubelet_with_pods().await;
    _pods.set_pods(vec![pod(
        "vms",
        "vm-b",
        "compute",
        A10_4Q,
        &[&format!("{GPU_A}-A10-4Q-1")],
    )]);
    let _d = Daemon::start(
        root,
        &kdir,
        &[
            "--on-demand",
            GPU_A,
            "--on-demand-poll",
            "100ms",
            "--on-demand-grace",
            "1s",
        ],
    );
    let regs = kubelet.wait_for(&[A10_4Q], DEADLINE).await.unwrap();
    let mut p4 = kubelet.plugin(&regs[A10_4Q].endpoint).await.unwrap();
    let mut lw4 = p4.list_and_watch().await.unwrap();
    eventually("the orphan is removed", || {
        !root.join(format!("sys/bus/mdev/devices/{orphan}")).exists()
    });
    let l = lw4.wait_until(DEADLINE, |l| l.len() == 6).await.unwrap();
    assert!(
        ids(&l).contains(&format!("{GPU_A}-A10-4Q-1")),
        "the held slot is listed"
    );
    // The pass that removed the orphan saw the pod holding the other.
    assert!(
        root.join(format!("sys/bus/mdev/devices/{held}")).exists(),
        "the pod's vGPU stays"
    );
}

/// A vGPU left half removed (its record says `removing`: a crash between the decision and the
/// write) that a process has since opened, as a shell opens it (`exec 7<>`), is neither removed
/// by the release pass nor by an Allocate of its device ID taking the record up again: the
/// Allocate fails, naming the vGPU and saying it is in use. Once let go, the next pass removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_removed_vgpu_a_process_holds_is_removed_by_no_path() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let uuid = "5a3b2c1d-0000-4000-8000-00000000000c";
    a10_4q_mdevs(root, &[("0000:41:00.4", uuid)]);
    let group =
        std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{uuid}/iommu_group"))).unwrap();
    let node = root.join("dev/vfio").join(group.file_name().unwrap());
    let shell = testkit::sim::ShellHolder::hold(&node);
    let slot = format!("{GPU_A}-A10-4Q-0");
    std::fs::create_dir_all(root.join("run/gpu-vm-node")).unwrap();
    std::fs::write(
        root.join("run/gpu-vm-node/on-demand-vgpus.json"),
        format!(
            r#"{{"vgpus":[{{"device":"{slot}","resource":"{A10_4Q}","gpu":"{GPU_A}","type_name":"NVIDIA A10-4Q","handle":"{uuid}","vendor":false,"phase":"removing","since":0,"seen":true}}]}}"#
        ),
    )
    .unwrap();
    let (_k, kdir, mut kubelet, _pods) = kubelet_with_pods().await;
    let _d = Daemon::start(
        root,
        &kdir,
        &["--on-demand", GPU_A, "--on-demand-poll", "100ms"],
    );
    let regs = kubelet.wait_for(&[A10_4Q], DEADLINE).await.unwrap();
    let mut p4 = kubelet.plugin(&regs[A10_4Q].endpoint).await.unwrap();
    // Release passes run every 100 ms meanwhile and keep it.
    std::thread::sleep(Duration::from_millis(500));
    assert!(root.join(format!("sys/bus/mdev/devices/{uuid}")).exists());
    let refused = p4.allocate(&[&[slot.as_str()]]).await;
    let err = refused.expect_err("an Allocate over a held vGPU");
    assert!(
        err.message().contains(uuid) && err.message().contains("in use"),
        "{err:?}"
    );
    assert!(
        root.join(format!("sys/bus/mdev/devices/{uuid}")).exists(),
        "the held vGPU stays"
    );
    assert!(records(root).contains(uuid), "{}", records(root));

    // Let go: the next pass removes it and its record.
    shell.release();
    eventually("the let-go vGPU is removed", || {
        !root.join(format!("sys/bus/mdev/devices/{uuid}")).exists()
    });
    eventually("its record is dropped", || !records(root).contains(uuid));
}

/// `kill -9` while an Allocate's mdev create is being written, and again while a release's
/// remove is: each next start removes what no pod holds, and the lists come back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_during_create_and_during_remove_converges_on_restart() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let (_k, kdir, mut kubelet, pods) = kubelet_with_pods().await;
    let args = [
        "--on-demand",
        GPU_A,
        "--on-demand-poll",
        "100ms",
        "--on-demand-grace",
        "1s",
    ];
    let slot = format!("{GPU_A}-A10-4Q-0");

    // 1. Killed inside the create of an Allocate.
    let mut d = Daemon::start(root, &kdir, &args);
    let regs = kubelet.wait_for(&[A10_4Q], DEADLINE).await.unwrap();
    let endpoint = regs[A10_4Q].endpoint.clone();
    let mut p4 = kubelet.plugin(&endpoint).await.unwrap();
    p4.list_and_watch()
        .await
        .unwrap()
        .wait_until(DEADLINE, |l| l.len() == 6)
        .await
        .unwrap();
    sim.control("fault create * delay=1000").unwrap();
    let pending = tokio::spawn({
        let slot = slot.clone();
        async move { p4.allocate(&[&[slot.as_str()]]).await }
    });
    let r = root.to_path_buf();
    tokio::task::spawn_blocking(move || {
        eventually("the create is recorded before it is written", || {
            records(&r).contains("\"creating\"")
        })
    })
    .await
    .unwrap();
    d.child.kill().unwrap(); // SIGKILL
    let _ = d.child.wait();
    assert!(
        pending.await.unwrap().is_err(),
        "the Allocate got no answer"
    );
    sim.control("clear-faults").unwrap();

    let _d = Daemon::start(root, &kdir, &args);
    let r = root.to_path_buf();
    tokio::task::spawn_blocking(move || {
        eventually("no vGPU and no record once the grace is over", || {
            std::fs::read_dir(r.join("sys/bus/mdev/devices"))
                .unwrap()
                .next()
                .is_none()
                && !records(&r).contains("A10-4Q-0")
        })
    })
    .await
    .unwrap();
    let mut p4 = kubelet.plugin(&endpoint).await.unwrap();
    let mut lw = p4.list_and_watch().await.unwrap();
    lw.wait_until(DEADLINE, |l| l.len() == 6).await.unwrap();

    // 2. Killed inside the remove of a release.
    let resp = p4.allocate(&[&[slot.as_str()]]).await.unwrap();
    let uuid =
        resp.container_responses[0].envs["MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q"].clone();
    pods.set_pods(vec![pod("vms", "vm-a", "compute", A10_4Q, &[&slot])]);
    let r = root.to_path_buf();
    tokio::task::spawn_blocking(move || {
        eventually("the pod is seen", || records(&r).contains("\"seen\": true"))
    })
    .await
    .unwrap();
    sim.control("fault remove * delay=1000").unwrap();
    pods.set_pods(vec![]);
    let r = root.to_path_buf();
    tokio::task::spawn_blocking(move || {
        eventually("the remove is recorded before it is written", || {
            records(&r).contains("\"removing\"")
        })
    })
    .await
    .unwrap();
    drop(_d); // SIGKILL
    sim.control("clear-faults").unwrap();
    let _d = Daemon::start(root, &kdir, &args);
    let r = root.to_path_buf();
    let u = uuid.clone();
    tokio::task::spawn_blocking(move || {
        eventually("the vGPU and its record are gone", || {
            !r.join(format!("sys/bus/mdev/devices/{u}")).exists() && !records(&r).contains(&u)
        })
    })
    .await
    .unwrap();
    let mut p4 = kubelet.plugin(&endpoint).await.unwrap();
    p4.list_and_watch()
        .await
        .unwrap()
        .wait_until(DEADLINE, |l| l.len() == 6)
        .await
        .unwrap();
}

/// Two Allocates of different sizes racing for one GPU: one vGPU is made, the other call is
/// refused naming the GPU and the type, and the GPU never holds two sizes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_allocates_of_two_sizes_on_one_gpu_make_one() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let mut p = a10_pool(root, &["--on-demand", GPU_A]).await;
    let (r4, r8) = race_4q_8q(&mut p).await;
    let (ok, err) = match (r4, r8) {
        (Ok(_), Err(e)) => ("NVIDIA A10-4Q", (e, "NVIDIA A10-8Q")),
        (Err(e), Ok(_)) => ("NVIDIA A10-8Q", (e, "NVIDIA A10-4Q")),
        other => panic!("expected one Allocate to succeed: {other:?}"),
    };
    let (e, lost) = err;
    assert!(
        e.message().contains(GPU_A) && e.message().contains(lost),
        "{}",
        e.message()
    );
    let names: Vec<String> = std::fs::read_dir(root.join("sys/bus/mdev/devices"))
        .unwrap()
        .map(|d| {
            read(
                root,
                &format!(
                    "sys/bus/mdev/devices/{}/mdev_type/name",
                    d.unwrap().file_name().to_string_lossy()
                ),
            )
        })
        .collect();
    assert_eq!(names, [ok]);
}

/// What a crash test runs against: a topology, the pooled GPU, and one vGPU type of it.
struct Case {
    topology: &'static str,
    gpu: &'static str,
    resource: &'static str,
    /// The type's key in device IDs (`A10-4Q`).
    key: &'static str,
    /// The env KubeVirt reads the vGPU from.
    env: &'static str,
    /// node-sim's op for the create and the removal of one vGPU.
    op: (&'static str, &'static str),
    /// Devices the type lists on the GPU with nothing on it.
    slots: usize,
}

const A10_CASE: Case = Case {
    topology: "2xA10",
    gpu: GPU_A,
    resource: A10_4Q,
    key: "A10-4Q",
    env: "MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q",
    op: ("create", "remove"),
    slots: 6,
};

const H100_CASE: Case = Case {
    topology: "8xH100-sriov",
    gpu: "0000:13:00.0",
    resource: "nvidia.com/NVIDIA_H100XM-8C",
    key: "H100XM-8C",
    env: "PCI_RESOURCE_NVIDIA_COM_NVIDIA_H100XM-8C",
    op: ("current_vgpu_type", "current_vgpu_type"),
    slots: 10,
};

impl Case {
    fn slot(&self, n: u32) -> String {
        format!("{}-{}-{n}", self.gpu, self.key)
    }

    /// The vGPUs on the node: mdev UUIDs, or the GPU's VFs holding a vGPU type.
    fn vgpus(&self, root: &Path) -> Vec<String> {
        let mut out: Vec<String> = if self.op.0 == "create" {
            std::fs::read_dir(root.join("sys/bus/mdev/devices"))
                .unwrap()
                .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        } else {
            std::fs::read_dir(root.join(format!("sys/bus/pci/devices/{}", self.gpu)))
                .unwrap()
                .filter_map(|d| {
                    let d = d.unwrap();
                    d.file_name()
                        .to_string_lossy()
                        .starts_with("virtfn")
                        .then(|| {
                            std::fs::read_link(d.path())
                                .unwrap()
                                .file_name()
                                .unwrap()
                                .to_string_lossy()
                                .into_owned()
                        })
                })
                .filter(|vf| {
                    !matches!(
                        read(
                            root,
                            &format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type")
                        )
                        .as_str(),
                        "0" | ""
                    )
                })
                .collect()
        };
        out.sort();
        out
    }
}

/// Where a crash test kills sandbox-dp: at each of the writes of one Allocate or release.
#[derive(Clone, Copy, Debug)]
enum KillAt {
    /// The record file says `phase` for the device (written before the sysfs write; that write
    /// is slowed, so the kill lands before it takes effect).
    Recorded(&'static str),
    /// node-sim logged the sysfs write: it took effect, and its answer is held back, so the
    /// record after it is not written yet.
    SysfsWrite,
    /// The call is over (every write made).
    Done,
}

const ALLOCATE_KILLS: [KillAt; 3] = [
    KillAt::Recorded("creating"),
    KillAt::SysfsWrite,
    KillAt::Done,
];
const RELEASE_KILLS: [KillAt; 3] = [
    KillAt::Recorded("removing"),
    KillAt::SysfsWrite,
    KillAt::Done,
];

/// A record of `device` in phase `phase` is on disk.
fn recorded(root: &Path, device: &str, phase: &str) -> bool {
    let text = records(root);
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    v["vgpus"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|r| r["device"] == device && r["phase"] == phase)
}

/// Makes every `op` write wait 300 ms before it takes effect and 300 ms after, before the
/// writer is answered: a kill when its record is written lands before the write, a kill when
/// the write is seen lands after it but before the daemon could record it.
fn slow_writes(sim: &testkit::sim::SimDir, op: &str) {
    sim.control(&format!("fault {op} * delay=300")).unwrap();
    sim.control(&format!("fault {op} * after=300")).unwrap();
}

/// Kills `d` at `at` (the sysfs writes counted since the last `clear_ops`; `done` says the call
/// ended); the faults are cleared after.
fn kill_at(
    sim: &testkit::sim::SimDir,
    d: &mut Daemon,
    at: KillAt,
    device: &str,
    done: impl Fn() -> bool,
) {
    let root = sim.root();
    testkit::sim::kill_when(&mut d.child, DEADLINE, || match at {
        KillAt::Recorded(phase) => recorded(root, device, phase),
        KillAt::SysfsWrite => !testkit::sim::writes(sim).is_empty(),
        KillAt::Done => done(),
    });
    sim.control("clear-faults").unwrap();
}

/// Starts sandbox-dp and waits for `resource` to register; the daemon and its endpoint.
async fn start(
    root: &Path,
    kubelet: &mut FakeKubelet,
    resource: &str,
    args: &[&str],
) -> (Daemon, String) {
    let d = Daemon::start(root, kubelet.dir(), args);
    let regs = kubelet.wait_for(&[resource], DEADLINE).await.unwrap();
    (d, regs[resource].endpoint.clone())
}

/// Lists `endpoint`'s devices from a fresh ListAndWatch until `pred` holds.
async fn listed(
    kubelet: &FakeKubelet,
    endpoint: &str,
    what: &str,
    pred: impl Fn(&[testkit::kubelet::api::Device]) -> bool,
) -> Vec<String> {
    let mut p = kubelet.plugin(endpoint).await.unwrap();
    let mut lw = p.list_and_watch().await.unwrap();
    match lw.wait_until(DEADLINE, |l| pred(l)).await {
        Ok(l) => ids(&l),
        Err(e) => panic!("{what}: {e:#}"),
    }
}

/// Allocates `slot` of the case's type; the vGPU handed over.
async fn allocate(
    kubelet: &FakeKubelet,
    endpoint: &str,
    case: &Case,
    slot: &str,
) -> Result<String, tonic::Status> {
    let mut p = kubelet.plugin(endpoint).await.unwrap();
    let resp = p.allocate(&[&[slot]]).await?;
    Ok(resp.container_responses[0].envs[case.env].clone())
}

fn block<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// `kill -9` at each write of an Allocate (its record, the sysfs write, the record after) and
/// of a release (the same three), with a pod holding another vGPU of the GPU throughout; each
/// next start converges: a vGPU no pod holds is removed (after the grace period when kubelet
/// never recorded its pod), kubelet's retry of the killed Allocate gets one vGPU, the pod's
/// vGPU is never touched, and the device IDs are the same.
async fn killed_at_every_write_converges(case: Case) {
    let Some(sim) = testkit::sim::try_mount(case.topology) else {
        return;
    };
    let root = sim.root();
    let (_k, _kdir, mut kubelet, pods) = kubelet_with_pods().await;
    let args = [
        "--on-demand",
        case.gpu,
        "--on-demand-poll",
        "100ms",
        "--on-demand-grace",
        "1s",
    ];
    let (s0, s1) = (case.slot(0), case.slot(1));
    let all_slots = |l: &[testkit::kubelet::api::Device]| {
        l.len() == case.slots && [&s0, &s1].iter().all(|s| l.iter().any(|d| &&d.id == s))
    };
    let only_held = |held: &str| {
        case.vgpus(root) == [held.to_string()] && !records(root).contains(&format!("\"{s0}\""))
    };
    let pod0 = pod("vms", "vm-0", "compute", case.resource, &[&s0]);

    // A pod holds slot 1's vGPU all along.
    let (mut d, ep) = start(root, &mut kubelet, case.resource, &args).await;
    let held = allocate(&kubelet, &ep, &case, &s1).await.unwrap();
    let held_pod = pod("vms", "vm-held", "compute", case.resource, &[&s1]);
    pods.set_pods(vec![held_pod.clone()]);
    block(|| {
        eventually("the held pod is seen", || {
            records(root).contains("\"seen\": true")
        })
    });

    let mut killed_mid_way = 0;
    for at in ALLOCATE_KILLS {
        // kubelet retries the Allocate, or never does (admission failed).
        for retry in [true, false] {
            slow_writes(&sim, case.op.0);
            sim.clear_ops();
            let call = tokio::spawn({
                let mut p = kubelet.plugin(&ep).await.unwrap();
                let s0 = s0.clone();
                async move { p.allocate(&[&[s0.as_str()]]).await.map(|_| ()) }
            });
            block(|| kill_at(&sim, &mut d, at, &s0, || call.is_finished()));
            if !matches!(call.await, Ok(Ok(()))) {
                killed_mid_way += 1;
            }
            assert!(
                case.vgpus(root).contains(&held),
                "{at:?}: the pod's vGPU stays"
            );
            (d, _) = start(root, &mut kubelet, case.resource, &args).await;
            if retry {
                let v = allocate(&kubelet, &ep, &case, &s0).await.unwrap();
                let mut want = vec![held.clone(), v];
                want.sort();
                assert_eq!(
                    case.vgpus(root),
                    want,
                    "{at:?}, retried: one vGPU for the device"
                );
                pods.set_pods(vec![held_pod.clone(), pod0.clone()]);
                block(|| {
                    eventually("the retried pod is seen", || {
                        records(root).matches("\"seen\": true").count() == 2
                    })
                });
                pods.set_pods(vec![held_pod.clone()]);
            }
            block(|| {
                eventually(
                    &format!("{at:?} (retry {retry}): only the pod's vGPU is left"),
                    || only_held(&held),
                )
            });
            listed(&kubelet, &ep, &format!("{at:?} (retry {retry})"), all_slots).await;
        }
    }
    // Killed at the record and at the write, with and without kubelet's retry.
    assert_eq!(killed_mid_way, 4, "Allocates cut short");

    let mut killed_mid_way = 0;
    for at in RELEASE_KILLS {
        allocate(&kubelet, &ep, &case, &s0).await.unwrap();
        pods.set_pods(vec![held_pod.clone(), pod0.clone()]);
        block(|| {
            eventually("the pod is seen", || {
                records(root).matches("\"seen\": true").count() == 2
            })
        });
        slow_writes(&sim, case.op.1);
        sim.clear_ops();
        pods.set_pods(vec![held_pod.clone()]);
        block(|| {
            kill_at(&sim, &mut d, at, &s0, || {
                !records(root).contains(&format!("\"{s0}\""))
            })
        });
        // The write itself is finished by the kernel (node-sim) even for a killed writer; the
        // record left is what the next start must finish.
        if records(root).contains(&format!("\"{s0}\"")) {
            killed_mid_way += 1;
        }
        assert!(
            case.vgpus(root).contains(&held),
            "{at:?}: the pod's vGPU stays"
        );
        (d, _) = start(root, &mut kubelet, case.resource, &args).await;
        block(|| {
            eventually(
                &format!("{at:?}: the released vGPU is gone, the pod's stays"),
                || only_held(&held),
            )
        });
        listed(&kubelet, &ep, &format!("{at:?}"), all_slots).await;
    }
    // Killed at the record and at the write.
    assert_eq!(killed_mid_way, 2, "releases cut short");
    drop(d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a10_killed_at_every_write_of_an_allocate_and_a_release_converges() {
    killed_at_every_write_converges(A10_CASE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h100_killed_at_every_write_of_an_allocate_and_a_release_converges() {
    killed_at_every_write_converges(H100_CASE).await;
}

/// `kill -9` while the start enables a pooled H100's VFs: the next start enables them and
/// offers the GPU's types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h100_killed_while_enabling_vfs_at_start_converges() {
    let Some(sim) = testkit::sim::try_mount(H100_CASE.topology) else {
        return;
    };
    let root = sim.root();
    let (_k, kdir, mut kubelet, _pods) = kubelet_with_pods().await;
    let args = ["--on-demand", H100_CASE.gpu];
    sim.control("fault sriov_numvfs * delay=300").unwrap();
    sim.clear_ops();
    let mut d = Daemon::start(root, &kdir, &args);
    let killed = block(|| {
        testkit::sim::kill_when(&mut d.child, DEADLINE, || {
            !testkit::sim::writes(&sim).is_empty()
        })
    });
    assert!(killed, "sandbox-dp exited by itself");
    sim.control("clear-faults").unwrap();
    let numvfs = read(
        root,
        &format!("sys/bus/pci/devices/{}/sriov_numvfs", H100_CASE.gpu),
    );
    let (_d, ep) = start(root, &mut kubelet, H100_CASE.resource, &args).await;
    listed(&kubelet, &ep, "after the restart", |l| {
        l.len() == H100_CASE.slots
    })
    .await;
    assert_ne!(
        read(
            root,
            &format!("sys/bus/pci/devices/{}/sriov_numvfs", H100_CASE.gpu)
        ),
        "0",
        "the VFs are enabled (after the kill: {numvfs})"
    );
}

/// The GPU an mdev is on (its parent, or the parent's PF).
fn gpu_of_mdev(root: &Path, uuid: &str) -> String {
    let link = std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{uuid}"))).unwrap();
    let parent = link
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    match std::fs::read_link(root.join(format!("sys/bus/pci/devices/{parent}/physfn"))) {
        Ok(pf) => pf.file_name().unwrap().to_string_lossy().into_owned(),
        Err(_) => parent,
    }
}

/// Two Allocates of different sizes racing for one GPU with another pooled GPU free: both
/// succeed, each GPU holds one size, the loser's device ID (a slot of the first GPU) is listed
/// while its vGPU lives, and its vGPU goes when its pod does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loser_of_a_race_for_one_gpu_is_placed_on_another() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let mut p = a10_pool(root, &["--on-demand", "all", "--on-demand-poll", "100ms"]).await;
    let (r4, r8) = race_4q_8q(&mut p).await;
    let (s4, s8) = (format!("{GPU_A}-A10-4Q-0"), format!("{GPU_A}-A10-8Q-0"));
    let u4 = r4.unwrap().container_responses[0].envs["MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q"]
        .clone();
    let u8 = r8.unwrap().container_responses[0].envs["MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-8Q"]
        .clone();
    let (g4, g8) = (gpu_of_mdev(root, &u4), gpu_of_mdev(root, &u8));
    let mut gpus = [g4.clone(), g8.clone()];
    gpus.sort();
    assert_eq!(gpus, [GPU_A, GPU_B], "one size per GPU");
    let (loser, loser_slot, loser_uuid) = if g4 == GPU_B {
        (A10_4Q, &s4, &u4)
    } else {
        (A10_8Q, &s8, &u8)
    };
    // The loser's slot is listed (its vGPU lives), and the GPUs' other slots follow what each
    // hosts: 4Q 6 on one GPU, 8Q 3 on the other. (A list of the loser's size may first show
    // its new GPU's own slots, until the loser's record moves its slot there.)
    let mut lw4 = p.p4.list_and_watch().await.unwrap();
    let mut lw8 = p.p8.list_and_watch().await.unwrap();
    let l4 = lw4
        .wait_until(DEADLINE, |l| l.len() == 6 && ids(l).contains(&s4))
        .await;
    let l8 = lw8
        .wait_until(DEADLINE, |l| l.len() == 3 && ids(l).contains(&s8))
        .await;
    assert!(l4.is_ok() && l8.is_ok(), "{l4:?} {l8:?}");

    p.pods
        .set_pods(vec![pod("vms", "vm-l", "compute", loser, &[loser_slot])]);
    eventually("the pod is seen holding the vGPU", || {
        records(root).contains("\"seen\": true")
    });
    p.pods.set_pods(vec![]);
    eventually("the loser's vGPU is removed once its pod is gone", || {
        !root
            .join(format!("sys/bus/mdev/devices/{loser_uuid}"))
            .exists()
    });
}

/// A pooled GPU something uses keeps its VFs off at start (the log names the holder); the other
/// GPU's are enabled and offered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfs_are_not_enabled_at_start_on_a_gpu_in_use() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    assert_eq!(
        read(root, &format!("sys/bus/pci/devices/{GPU_A}/sriov_numvfs")),
        "0"
    );
    // A process (a shell) holds GPU A's /dev/nvidia<N> (its minor from the driver's
    // information file).
    let holder = testkit::sim::hold_nvidia_node(root, GPU_A);
    let (_k, kdir, mut kubelet, _pods) = kubelet_with_pods().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let child = std::process::Command::new(BIN)
        .arg("serve")
        .arg("--host-root")
        .arg(root)
        .arg("--kubelet-dir")
        .arg(&kdir)
        .args(["--on-demand", "all"])
        .env("RUST_LOG", "sandbox_dp=info")
        .env("NO_COLOR", "1")
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    let _d = Daemon { child };
    let regs = kubelet.wait_for(&[A10_4Q], DEADLINE).await.unwrap();
    let l = listed(&kubelet, &regs[A10_4Q].endpoint, "GPU B's", |l| {
        l.len() == 6
    })
    .await;
    assert!(l.iter().all(|i| i.starts_with(GPU_B)), "{l:?}");
    assert_eq!(
        read(root, &format!("sys/bus/pci/devices/{GPU_A}/sriov_numvfs")),
        "0"
    );
    assert_ne!(
        read(root, &format!("sys/bus/pci/devices/{GPU_B}/sriov_numvfs")),
        "0"
    );
    let text = std::fs::read_to_string(log.path()).unwrap();
    let me = holder.pid();
    assert!(
        text.contains(&format!("not enabling the VFs of GPU {GPU_A}"))
            && text.contains(&format!("pid {me}")),
        "{text}"
    );
}

/// A records file that cannot be read does not stop the daemon or hold a pod: it is set aside
/// (kept beside it for an operator), an Event on the Node says so (as `kubectl get events`
/// shows it from a real API server), and the pool serves with no records. One of the format before versions is read as it is and written with its version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_records_are_set_aside_and_told_and_old_ones_are_read() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let file = root.join("run/gpu-vm-node/on-demand-vgpus.json");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(&file, "{\"vgpus\": [{\"device\": ").unwrap();
    let Some(api) =
        block(|| cluster_tier::ApiServer::start_or_skip("sandbox-dp's records Event")).unwrap()
    else {
        return;
    };
    api.create_node("node-od", &[]).unwrap();
    let kubeconfig = api.admin_kubeconfig().to_str().unwrap().to_string();
    let mut pool = a10_pool(
        root,
        &[
            "--on-demand",
            GPU_A,
            "--node-name",
            "node-od",
            "--kubeconfig",
            &kubeconfig,
        ],
    )
    .await;
    // As `kubectl get events` shows it: Node events go to "default", as kubelet's do.
    let ev = block(|| api.wait_for_event("default", "OnDemandRecordsUnreadable", DEADLINE))
        .expect("an OnDemandRecordsUnreadable event on the Node");
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["involvedObject"]["kind"], "Node");
    assert_eq!(ev["involvedObject"]["name"], "node-od");
    let note = ev["message"].as_str().unwrap_or_default();
    assert!(
        note.contains("on-demand-vgpus.json") && note.contains("set aside as"),
        "{ev}"
    );
    let aside: Vec<String> = std::fs::read_dir(file.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("on-demand-vgpus.json.unreadable-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    // The pool works: an Allocate makes a vGPU, recorded with the format's version.
    let slot = format!("{GPU_A}-A10-4Q-0");
    pool.p4.allocate(&[&[slot.as_str()]]).await.unwrap();
    assert!(
        records(root).contains("\"version\": 1"),
        "{}",
        records(root)
    );
    drop(pool);

    // The format before versions (this record, without its version) is read as it is: the
    // restarted daemon gives the same device the same vGPU.
    let old = records(root).replace("  \"version\": 1,\n", "");
    assert!(!old.contains("version"), "{old}");
    std::fs::write(&file, &old).unwrap();
    let uuid = |r: &AllocateResponse| {
        r.container_responses[0].envs["MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q"].clone()
    };
    let made: serde_json::Value = serde_json::from_str(&old).unwrap();
    let handle = made["vgpus"][0]["handle"].as_str().unwrap().to_string();
    // GPU A holds a 4Q: only 4Q slots are offered now.
    let (_k, kdir, mut kubelet, _pods) = kubelet_with_pods().await;
    let _d = Daemon::start(root, &kdir, &["--on-demand", GPU_A]);
    let regs = kubelet.wait_for(&[A10_4Q], DEADLINE).await.unwrap();
    let mut p4 = kubelet.plugin(&regs[A10_4Q].endpoint).await.unwrap();
    let again = p4.allocate(&[&[slot.as_str()]]).await.unwrap();
    assert_eq!(uuid(&again), handle);
    assert!(
        records(root).contains("\"version\": 1"),
        "{}",
        records(root)
    );
}

/// What the pool changes and refuses is told on the Node, as `kubectl get events` shows it from
/// a real API server: the vGPU created (type, UUID, GPU, device), the Allocate refused (naming
/// the GPU and the type), the vGPU kept while a process holds it, then removed. While it is
/// kept, retried at every poll, the daemon asks the API server nothing (its audit log;
/// `AT_REST_SECS` keeps it so longer, for BENCHMARKS.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creations_refusals_and_removals_are_node_events() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let Some(api) =
        block(|| cluster_tier::ApiServer::start_or_skip("sandbox-dp's Events")).unwrap()
    else {
        return;
    };
    api.create_node("node-od", &[]).unwrap();
    // Its own user, for its requests in the audit log.
    let user = "sandbox-dp";
    let kubeconfig = api.kubeconfig_for(user, user, &["system:masters"]).unwrap();
    let addr = testkit::ops::free_addr();
    // Node events go to "default", as kubelet's do.
    let event = |reason: &str| block(|| api.wait_for_event("default", reason, DEADLINE));
    let mut pool = pool_asking_api(root, &kubeconfig, &["--metrics-addr", &addr]).await;
    let slot = format!("{GPU_A}-A10-4Q-0");
    let resp = pool.p4.allocate(&[&[slot.as_str()]]).await.unwrap();
    let uuid =
        resp.container_responses[0].envs["MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q"].clone();
    let created = event("VgpuCreated").expect("a VgpuCreated event on the Node");
    let note = created["message"].as_str().unwrap_or_default();
    assert!(
        note.contains("NVIDIA A10-4Q")
            && note.contains(&uuid)
            && note.contains(GPU_A)
            && note.contains(&slot),
        "{created}"
    );
    assert_eq!(created["involvedObject"]["kind"], "Node");
    assert_eq!(created["involvedObject"]["name"], "node-od");
    assert_eq!(created["type"], "Normal");

    // GPU A hosts a 4Q: an 8Q cannot go there, and no other GPU is pooled.
    let s8 = format!("{GPU_A}-A10-8Q-0");
    let refused = pool.p8.allocate(&[&[s8.as_str()]]).await;
    assert!(refused.is_err(), "{refused:?}");
    let ev = event("VgpuNotCreated").expect("a VgpuNotCreated event on the Node");
    let note = ev["message"].as_str().unwrap_or_default();
    assert!(note.contains(GPU_A) && note.contains("A10-8Q"), "{ev}");
    assert_eq!(ev["type"], "Warning");

    // The pod runs, then is gone while a process (a VM's QEMU outliving its pod) still holds
    // the vGPU's group node: the vGPU is kept, and that is told.
    pool.pods
        .set_pods(vec![pod("vms", "vm-a", "compute", A10_4Q, &[&slot])]);
    block(|| {
        eventually("the pod is seen holding the vGPU", || {
            records(root).contains("\"seen\": true")
        })
    });
    let group =
        std::fs::read_link(root.join(format!("sys/bus/mdev/devices/{uuid}/iommu_group"))).unwrap();
    let group = group.file_name().unwrap().to_str().unwrap().to_string();
    // Held by a process of its own, as QEMU holds it: this test process forks and execs
    // daemons, and each exec closes its copies of the test's descriptors.
    let qemu = testkit::sim::ShellHolder::hold(&root.join(format!("dev/vfio/{group}")));
    pool.pods.set_pods(vec![]);
    let kept = event("VgpuNotRemoved").expect("a VgpuNotRemoved event on the Node");
    let note = kept["message"].as_str().unwrap_or_default();
    assert!(note.contains(&uuid) && note.contains("in use"), "{kept}");
    assert_eq!(kept["type"], "Warning");
    assert!(root.join(format!("sys/bus/mdev/devices/{uuid}")).exists());

    // Kept at every poll, it asks the API server nothing: its polls run (each counts a
    // failure), its requests in the audit log do not grow.
    let asked = api.requests_of(user).len();
    let failures =
        || testkit::ops::metric(&addr, "sandbox_dp_on_demand_failures_total").unwrap_or(0.0);
    let before = failures();
    let start = std::time::Instant::now();
    block(|| {
        while failures() < before + 3.0 || start.elapsed() < testkit::ops::at_rest() {
            assert!(
                start.elapsed() < DEADLINE + testkit::ops::at_rest(),
                "no polls: {} failures",
                failures()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let later = api.requests_of(user).split_off(asked);
    testkit::ops::report_at_rest("sandbox-dp --on-demand, vGPU kept", &later, start.elapsed());
    assert!(later.is_empty(), "at rest it asked: {later:?}");

    // Let go: the next poll removes it, and that is told too.
    drop(qemu);
    let removed = event("VgpuRemoved").expect("a VgpuRemoved event on the Node");
    let note = removed["message"].as_str().unwrap_or_default();
    assert!(note.contains(&uuid) && note.contains(GPU_A), "{removed}");
    assert!(!root.join(format!("sys/bus/mdev/devices/{uuid}")).exists());
}

/// sandbox-dp on GPU A of `root`, polling every 100 ms, telling Events on and asking about the
/// pods of node `node-od` through the API server of `kubeconfig`; and `more` arguments.
async fn pool_asking_api(root: &Path, kubeconfig: &Path, more: &[&str]) -> A10Pool {
    let kubeconfig = kubeconfig.to_str().unwrap();
    let mut args = vec![
        "--on-demand",
        GPU_A,
        "--on-demand-poll",
        "100ms",
        "--node-name",
        "node-od",
        "--kubeconfig",
        kubeconfig,
    ];
    args.extend_from_slice(more);
    a10_pool(root, &args).await
}

/// Allocates A10-4Q `slot` and has PodResources list it for pod `vms/<pod>` until the records
/// name that pod; the vGPU's sysfs directory.
async fn vgpu_of_pod(pool: &mut A10Pool, root: &Path, slot: &str, name: &str) -> PathBuf {
    let resp = pool.p4.allocate(&[&[slot]]).await.unwrap();
    let uuid = &resp.container_responses[0].envs["MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q"];
    pool.pods
        .set_pods(vec![pod("vms", name, "compute", A10_4Q, &[slot])]);
    let recorded = format!("\"pod\": \"vms/{name}\"");
    block(|| {
        eventually("the pod is recorded with the vGPU", || {
            records(root).contains(&recorded)
        })
    });
    root.join(format!("sys/bus/mdev/devices/{uuid}"))
}

/// kubelet restarted lists no pod until it has read its pods from the API server: a vGPU whose
/// pod kubelet does not list then, and which the API server has on the node, is kept; it goes
/// once the API server has the pod no more. The fake PodResources plays kubelet in that window,
/// which the real one holds open too briefly to be hit on purpose (the cluster tier's on-demand
/// scenario restarts a real kubelet with a pod's vGPU, and checks the vGPU stays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vgpu_is_kept_while_the_api_server_has_its_pod_on_the_node() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let Some(api) = block(|| cluster_tier::ApiServer::start_or_skip("pods on the node")).unwrap()
    else {
        return;
    };
    api.create_node("node-od", &[]).unwrap();
    api.apply(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: vms}\n---\n\
         apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: default, namespace: vms}\n---\n\
         apiVersion: v1\nkind: Pod\nmetadata: {name: vm-a, namespace: vms}\n\
         spec: {nodeName: node-od, containers: [{name: compute, image: vm}]}\n",
    )
    .unwrap();
    let user = "sandbox-dp";
    let kubeconfig = api.kubeconfig_for(user, user, &["system:masters"]).unwrap();
    let mut pool = pool_asking_api(root, &kubeconfig, &[]).await;
    let mdev = vgpu_of_pod(&mut pool, root, &format!("{GPU_A}-A10-4Q-0"), "vm-a").await;

    // kubelet lists nothing: the API server is asked at each poll, and the vGPU stays.
    let gets = || {
        api.requests_of(user)
            .into_iter()
            .filter(|e| e["verb"] == "get" && e["objectRef"]["name"] == "vm-a")
            .count()
    };
    pool.pods.set_pods(vec![]);
    block(|| eventually("three polls asking for pod vms/vm-a", || gets() >= 3));
    assert!(mdev.exists(), "the vGPU of a pod the API server has went");

    // The pod is gone from the API server: the vGPU goes.
    api.kubectl(&[
        "delete",
        "pod",
        "-n",
        "vms",
        "vm-a",
        "--grace-period=0",
        "--force",
    ])
    .unwrap();
    block(|| eventually("the vGPU removed", || !mdev.exists()));
    let asked = gets();
    // A pod the API server never had: its vGPU goes at the first poll that asks, and vm-a,
    // gone, is not asked about again.
    let mdev_b = vgpu_of_pod(&mut pool, root, &format!("{GPU_A}-A10-4Q-1"), "vm-b").await;
    pool.pods.set_pods(vec![]);
    block(|| eventually("the vGPU of vm-b removed", || !mdev_b.exists()));
    assert_eq!(gets(), asked, "vm-a was asked about after it was gone");
}

/// An account that may not read pods: kubelet's PodResources alone decides, as without an API
/// server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_get_on_pods_kubelets_word_decides() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let Some(api) = block(|| cluster_tier::ApiServer::start_or_skip("pods on the node")).unwrap()
    else {
        return;
    };
    api.create_node("node-od", &[]).unwrap();
    // No role bound: every request is refused.
    let user = "no-rights";
    let kubeconfig = api.kubeconfig_for(user, user, &[]).unwrap();
    let mut pool = pool_asking_api(root, &kubeconfig, &[]).await;
    let mdev = vgpu_of_pod(&mut pool, root, &format!("{GPU_A}-A10-4Q-0"), "vm-a").await;
    pool.pods.set_pods(vec![]);
    block(|| eventually("the vGPU removed", || !mdev.exists()));
    let refused = api
        .requests_of(user)
        .into_iter()
        .filter(|e| e["objectRef"]["resource"] == "pods")
        .count();
    assert_eq!(refused, 1, "asked once, refused, not again");
}

/// Each resource `list --json` prints, with its device IDs in order.
fn list_json(out: &std::process::Output) -> Vec<(String, Vec<String>)> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let ids = r["devices"].as_array().unwrap().iter();
            let mut ids: Vec<String> = ids.map(|d| d["id"].as_str().unwrap().into()).collect();
            ids.sort_by_key(|id| {
                let (head, slot) = id.rsplit_once('-').unwrap();
                (head.to_string(), slot.parse::<u32>().unwrap_or(u32::MAX))
            });
            (r["name"].as_str().unwrap().to_string(), ids)
        })
        .collect()
}

/// A non-PCI mdev parent named in `--on-demand` offers each of its types with as many slots as
/// sysfs's `available_instances` says, named as sandbox-dp names such mdevs (by the type's
/// `name`); its existing mdevs are not advertised on their own. No node-sim: a hand-built tree.
#[test]
fn an_mtty_parent_offers_what_sysfs_says_it_can_still_create() {
    let t = testkit::sysfs::SysfsTree::new();
    let dev = t.root().join("sys/devices/virtual/mtty/mtty");
    t.mdev_type(&dev, "mtty-1", "Single port serial", 22);
    t.mdev_type(&dev, "mtty-2", "Dual port serial", 3);
    t.mdev_parent("virtual/mtty/mtty", "mtty");
    let uuid = "6f1c8a52-0000-4000-8000-000000000001";
    t.mdev("virtual/mtty/mtty", uuid, "mtty-2", Some(7));
    t.vfio_node(7);
    let slots =
        |key: &str, n: u32| -> Vec<String> { (0..n).map(|i| format!("mtty-{key}-{i}")).collect() };
    let want = vec![
        (
            "nvidia.com/Dual_port_serial".to_string(),
            slots("mtty-2", 3),
        ),
        (
            "nvidia.com/Single_port_serial".to_string(),
            slots("mtty-1", 22),
        ),
    ];
    // Without the pool, `--vendor any` advertises the mdev by its UUID.
    assert_eq!(
        list_json(&run(&["list", "--json", "--vendor", "any"], t.root())),
        [(
            "nvidia.com/Dual_port_serial".to_string(),
            vec![uuid.to_string()]
        )]
    );
    // Pooled: the slots only, whatever --vendor says (the parent is named).
    for vendor in [&["--vendor", "any"][..], &[]] {
        let args = [&["list", "--json", "--on-demand", "mtty"][..], vendor].concat();
        assert_eq!(list_json(&run(&args, t.root())), want, "{args:?}");
    }
    // The counts are sysfs's: one fewer available, one slot fewer.
    write(
        t.root(),
        "sys/devices/virtual/mtty/mtty/mdev_supported_types/mtty-2/available_instances",
        "2\n",
    );
    let out = run(&["list", "--json", "--on-demand", "mtty"], t.root());
    assert_eq!(list_json(&out)[0].1, slots("mtty-2", 2));
    // A GPU and a parent together; a malformed entry is refused naming it.
    let out = run(
        &["list", "--json", "--on-demand", "0000:41:00.0,mtty"],
        t.root(),
    );
    assert_eq!(list_json(&out)[0].1, slots("mtty-2", 2));
    let out = run(&["list", "--on-demand", "mtty,0000:41:00"], t.root());
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("0000:41:00"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One owner per GPU, checked by whoever claims second: while sandbox-dra runs with GPU A in
/// its vGPU pool (it holds `dra-pool.lock`; here this test holds it as sandbox-dra would),
/// sandbox-dp --on-demand refuses to start, naming the GPU and the owner, and writes no pool.
/// Once the holder is gone, its left-over pool file takes nothing: sandbox-dp pools both GPUs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_in_a_running_sandbox_dra_pool_is_refused_and_a_left_over_pool_is_not() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let paths = common::HostPaths::new(root);
    let dra = common::state::pool::hold_dra(&paths).unwrap().unwrap();
    let a: common::PciAddress = GPU_A.parse().unwrap();
    common::state::pool::write_dra(&paths, &std::collections::BTreeSet::from([a]).into()).unwrap();
    let (_k, kdir, mut kubelet, _pods) = kubelet_with_pods().await;
    let run = || {
        let mut c = std::process::Command::new(BIN);
        c.arg("serve")
            .arg("--host-root")
            .arg(root)
            .arg("--kubelet-dir")
            .arg(&kdir)
            .args(["--on-demand", "all"])
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1");
        c
    };
    let out = block(|| run().output().unwrap());
    let err =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "sandbox-dp started ({}): {err}",
        out.status
    );
    assert!(
        err.contains(&format!("GPU {GPU_A}")) && err.contains("sandbox-dra's vGPU pool"),
        "{err}"
    );
    assert!(!root.join("run/gpu-vm-node/on-demand-pool").exists());

    drop(dra);
    let log = tempfile::NamedTempFile::new().unwrap();
    let child = run().stderr(log.reopen().unwrap()).spawn().unwrap();
    let _d = Daemon { child };
    kubelet.wait_for(&[A10_4Q], DEADLINE).await.unwrap();
    let pool = read(root, "run/gpu-vm-node/on-demand-pool");
    assert!(pool.contains(GPU_A) && pool.contains(GPU_B), "{pool}");
}

/// The sysfs id of the mdev type of `vf` whose name ends in `key` (`A10-8Q`).
fn type_id(root: &Path, vf: &str, key: &str) -> String {
    let dir = root.join(format!("sys/class/mdev_bus/{vf}/mdev_supported_types"));
    std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|t| read(root, &format!("{}/{t}/name", dir.display())).ends_with(key))
        .unwrap_or_else(|| panic!("{vf} has no type {key}"))
}

/// The mdevs on `gpu`'s VFs.
fn mdevs_on(root: &Path, gpu: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(root.join("sys/bus/mdev/devices"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|u| gpu_of_mdev(root, u) == gpu)
        .collect();
    out.sort();
    out
}

/// The pool places vGPUs from its own view of a GPU, which does not see a vGPU made by hand:
/// the kernel refuses that write (an A10-4Q cannot join an A10-8Q), and the GPU is read again,
/// so the vGPU goes to the other GPU. Once the hand-made vGPU is gone, the next Allocate finds
/// the GPU free again (its view, holding that vGPU, cannot place the 4Q: it reads again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vgpu_the_pool_did_not_make_is_found_by_the_kernels_refusal() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let mut p = a10_pool(root, &["--on-demand", "all"]).await;
    let vf = "0000:41:00.4";
    let by_hand = "6a0e1b8c-0d6f-4c8e-9a53-1f2e3d4c5b6a";
    let t8 = type_id(root, vf, "A10-8Q");
    write(
        root,
        &format!("sys/class/mdev_bus/{vf}/mdev_supported_types/{t8}/create"),
        by_hand,
    );
    let env = "MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q";
    let slot = format!("{GPU_A}-A10-4Q-0");
    let one: &[&str] = &[slot.as_str()];
    let r = p.p4.allocate(&[one]).await.unwrap();
    let uuid = r.container_responses[0].envs[env].clone();
    assert_eq!(gpu_of_mdev(root, &uuid), GPU_B, "placed on the other GPU");
    assert_eq!(
        mdevs_on(root, GPU_A),
        [by_hand],
        "GPU A keeps its A10-8Q alone"
    );
    assert!(
        records(root).contains(&uuid) && !records(root).contains(by_hand),
        "{}",
        records(root)
    );

    write(root, &format!("sys/bus/mdev/devices/{by_hand}/remove"), "1");
    let slot = format!("{GPU_A}-A10-4Q-1");
    let one: &[&str] = &[slot.as_str()];
    let r = p.p4.allocate(&[one]).await.unwrap();
    let again = r.container_responses[0].envs[env].clone();
    // The view of GPU A, read when the 4Q was refused, holds the 8Q: it cannot place the 4Q,
    // and A is read again rather than passed over.
    assert_eq!(
        gpu_of_mdev(root, &again),
        GPU_A,
        "placed on the GPU its ID names"
    );
}
