//! sandbox-dra: start → registration socket, then `NodePrepareResources` and
//! `NodeUnprepareResources` of a one-GPU claim through the fake kubelet's DRA client (dialled
//! as kubelet dials, one connection for every call as kubelet keeps), repeated; RSS after the
//! cycles.
//! With `--vgpu`: prepare → vGPU ready and unprepare of an A10-4Q claim, and the time from a
//! change of the node (a GPU hot-plugged, then unplugged) to the pool's slices showing it.
//! Each prepare's parts as sandbox-dra logs them ("claim prepared", its steps), beside the
//! whole call.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::json;
use testkit::apiserver::FakeApiServer;
use testkit::kubelet::dra::{self, Claim, DraDriver, Version};

use crate::Cli;
use crate::harness::bins::Bins;
use crate::harness::floor::{Files, changed, files, replace_files, replay, writes};
use crate::harness::process::Invocation;
use crate::harness::procstat;
use crate::harness::report::{Report, mib, ratio};
use crate::harness::stats::{fmt_duration, fmt_p50_p99, fmt_summary, summarize};
use crate::harness::topology::{builtin, mount};
use crate::sections::dp::Daemon;

const DRIVER: &str = "gpu.gpu-vm-node.io";
const NODE: &str = "bench";

/// Where sandbox-dra's prepare writes files, under the host root: its directory (claim records,
/// device metadata), the CDI specs, and the node-wide record of original drivers.
const FILE_DIRS: [&str; 3] = [
    "var/lib/kubelet/plugins/gpu.gpu-vm-node.io",
    "var/run/cdi",
    "run/vfio-manager",
];

/// What one prepare and its unprepare wrote, for the floor.
struct Writes {
    /// The prepare's sysfs writes.
    sysfs: Vec<node_sim::Op>,
    /// The files the prepare left new or changed.
    files: Files,
    /// The unprepare's sysfs writes.
    undo: Vec<node_sim::Op>,
}

/// The files and sysfs writes of one prepare, about to be made.
struct Watch {
    files: Files,
}

impl Watch {
    fn start(sim: &testkit::sim::SimDir) -> Watch {
        sim.clear_ops();
        Watch {
            files: files(sim.root(), &FILE_DIRS),
        }
    }

    /// What the prepare wrote since [`Watch::start`].
    fn prepared(self, sim: &testkit::sim::SimDir) -> (Vec<node_sim::Op>, Files) {
        let ops = writes(&sim.ops());
        (ops, changed(&self.files, &files(sim.root(), &FILE_DIRS)))
    }
}

/// The floor of each prepare: on a fresh node, its writes replayed bare, in the order the
/// prepare makes them (the claim's record, the original drivers, the sysfs writes, the device
/// metadata and CDI spec, the record again); each unprepare's writes replayed too, untimed,
/// and the claim's files removed, so that every prepare meets the node as the daemon's did.
fn floors(t: &node_sim::Topology, cycles: &[Writes]) -> Result<Vec<Duration>> {
    let sim = mount(t);
    let root = sim.root();
    let mut out = Vec::new();
    for w in cycles {
        let is = |p: &std::path::Path, dir: &str| p.to_string_lossy().contains(dir);
        let record: Vec<_> = w.files.iter().filter(|(p, _)| is(p, "/claims/")).collect();
        let originals: Vec<_> = w
            .files
            .iter()
            .filter(|(p, _)| is(p, "vfio-manager"))
            .collect();
        let rest: Vec<_> = w
            .files
            .iter()
            .filter(|(p, _)| !is(p, "/claims/") && !is(p, "vfio-manager"))
            .collect();
        let mut took = replace_files(root, record.iter().copied())?;
        took += replace_files(root, originals)?;
        took += replay(root, &w.sysfs)?;
        took += replace_files(root, rest.iter().copied())?;
        took += replace_files(root, record)?;
        out.push(took);
        replay(root, &w.undo)?;
        for (p, _) in rest {
            let _ = std::fs::remove_file(root.join(p));
        }
        let _ = std::fs::remove_dir_all(root.join(FILE_DIRS[0]).join("metadata"));
        let _ = std::fs::remove_dir_all(root.join(FILE_DIRS[0]).join("claims"));
    }
    Ok(out)
}

/// One run's figures.
struct DraRun {
    registered: Duration,
    /// Prepare that binds (the GPU on nvidia).
    prepare: Vec<Duration>,
    /// Prepare repeated on a prepared claim (kubelet's retry).
    again: Vec<Duration>,
    /// Unprepare that gives the GPU back (`--unprepare restore`).
    unprepare: Vec<Duration>,
    /// Each prepare's writes replayed bare.
    floor: Vec<Duration>,
    /// Each prepare's parts, and each repeated prepare's.
    parts: Vec<Parts>,
    again_parts: Vec<Parts>,
    rss_kib: u64,
    hwm_kib: u64,
    anon_kib: u64,
}

fn prepared_ok(out: Vec<(String, Result<Vec<dra::PreparedDevice>, String>)>) -> Result<()> {
    match out.first() {
        Some((_, Ok(d))) if !d.is_empty() => Ok(()),
        other => bail!("prepare: {other:?}"),
    }
}

/// How long each step of one prepare took, as sandbox-dra logged it, by step name; `call` is
/// the rest of the call as the fake kubelet timed it (gRPC, the daemon's runtime).
type Parts = BTreeMap<String, Duration>;

/// The steps sandbox-dra logged for each prepare, in order: the `steps` of each "claim
/// prepared" line of its JSON log (`record 0.21ms, node 0.40ms, …`).
fn logged_parts(daemon: &Daemon) -> Result<Vec<Parts>> {
    let mut out = Vec::new();
    for line in daemon.stderr().lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["fields"]["message"] != "claim prepared" {
            continue;
        }
        let steps = v["fields"]["steps"]
            .as_str()
            .ok_or_else(|| anyhow!("a \"claim prepared\" line without steps: {line}"))?;
        let mut parts = Parts::new();
        for step in steps.split(", ") {
            let ms = step
                .split_once(' ')
                .and_then(|(name, t)| Some((name, t.strip_suffix("ms")?.parse::<f64>().ok()?)));
            let Some((name, ms)) = ms else {
                bail!("cannot read step {step:?} of {line}");
            };
            parts.insert(name.to_string(), Duration::from_secs_f64(ms / 1e3));
        }
        out.push(parts);
    }
    Ok(out)
}

/// Each call's parts, with what the daemon's steps do not cover as `call`.
fn with_call(logged: Vec<Parts>, calls: &[Duration]) -> Vec<Parts> {
    logged
        .into_iter()
        .zip(calls)
        .map(|(mut parts, call)| {
            let inside: Duration = parts.values().sum();
            parts.insert("call".into(), call.saturating_sub(inside));
            parts
        })
        .collect()
}

/// The steps a prepare's log line can name, in the order the table shows them.
const STEPS: [&str; 9] = [
    "api", "queue", "record", "node", "in-use", "write", "ready", "files", "call",
];

/// Two rows per kind of prepare: p50 / p99 of each step over all its calls (`-` for a step it
/// never took), then the steps of its slowest call (where its tail comes from).
fn parts_table(r: &mut Report, rows: &[(&str, Vec<Parts>)]) {
    let mut header = vec!["prepare"];
    header.extend(STEPS);
    r.table(&header);
    for (name, calls) in rows {
        let mut row = vec![format!("{name} ({})", calls.len())];
        for step in STEPS {
            let v: Vec<Duration> = calls.iter().filter_map(|p| p.get(step).copied()).collect();
            row.push(match fmt_p50_p99(&v) {
                Some((p50, p99)) if v.len() == calls.len() => format!("{p50} / {p99}"),
                Some((p50, p99)) => format!("{p50} / {p99} ({} calls)", v.len()),
                None => "-".into(),
            });
        }
        r.row(&row);
        let Some(slowest) = calls.iter().max_by_key(|p| p.values().sum::<Duration>()) else {
            continue;
        };
        let total: Duration = slowest.values().sum();
        let mut row = vec![format!("{name}: slowest, {}", fmt_duration(total))];
        row.extend(
            STEPS
                .iter()
                .map(|s| slowest.get(*s).map_or("-".into(), |d| fmt_duration(*d))),
        );
        r.row(&row);
    }
}

async fn dra_once(b: &Bins, topology: &str, cycles: usize) -> Result<DraRun> {
    let topo = builtin(topology)?;
    let sim = mount(&topo);
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[])?;
    let gpu = "gpu-0000-41-00-0";
    api.put_claim(json!({
        "metadata": {"namespace": "bench", "name": "c", "uid": "uid-bench"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": gpu}
        ]}}},
    }));
    let inv = Invocation::new(
        &b.dra,
        &[
            &"--host-root",
            &root,
            &"--node-name",
            &NODE,
            &"--kubeconfig",
            &api.kubeconfig(),
            &"--unprepare",
            &"restore",
            &"--log-format",
            &"json",
            &"serve",
        ],
    );
    let start = Instant::now();
    let daemon = Daemon::start(&inv).await?;
    let kubelet_root = Path::new("/var/lib/kubelet");
    let socket = loop {
        if let Some(s) = dra::registration_sockets(root, kubelet_root).pop() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("sandbox-dra did not serve: {}", daemon.stderr_tail());
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    };
    let mut drv: DraDriver = dra::register(root, &socket, None).await?;
    drv.keep_connection().await?;
    let registered = start.elapsed();
    let claim = [Claim {
        namespace: "bench".into(),
        name: "c".into(),
        uid: "uid-bench".into(),
    }];
    let mut run = DraRun {
        registered,
        prepare: Vec::with_capacity(cycles),
        again: Vec::with_capacity(cycles),
        unprepare: Vec::with_capacity(cycles),
        floor: Vec::with_capacity(cycles),
        parts: Vec::new(),
        again_parts: Vec::new(),
        rss_kib: 0,
        hwm_kib: 0,
        anon_kib: 0,
    };
    let mut written = Vec::with_capacity(cycles);
    for _ in 0..cycles {
        let watch = Watch::start(&sim);
        let t = Instant::now();
        prepared_ok(drv.prepare(Version::V1, &claim).await?)
            .with_context(|| daemon.stderr_tail())?;
        run.prepare.push(t.elapsed());
        let (sysfs, files) = watch.prepared(&sim);
        let t = Instant::now();
        prepared_ok(drv.prepare(Version::V1, &claim).await?)?;
        run.again.push(t.elapsed());
        sim.clear_ops();
        let t = Instant::now();
        let out = drv.unprepare(Version::V1, &claim).await?;
        run.unprepare.push(t.elapsed());
        if !matches!(out.first(), Some((_, Ok(())))) {
            bail!("unprepare: {out:?}: {}", daemon.stderr_tail());
        }
        let undo = writes(&sim.ops());
        written.push(Writes { sysfs, files, undo });
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = procstat::sample(daemon.pid).ok_or_else(|| anyhow!("sandbox-dra died"))?;
    run.rss_kib = s.rss_kib;
    run.hwm_kib = s.hwm_kib;
    run.anon_kib = s.anon_kib;
    (run.parts, run.again_parts) = split_parts(logged_parts(&daemon)?, &run.prepare, &run.again)?;
    daemon.stop().await;
    drop(sim);
    run.floor = floors(&topo, &written)?;
    Ok(run)
}

/// The logged parts of alternating prepares and repeated prepares, each with its call.
fn split_parts(
    logged: Vec<Parts>,
    prepare: &[Duration],
    again: &[Duration],
) -> Result<(Vec<Parts>, Vec<Parts>)> {
    if logged.len() != prepare.len() + again.len() {
        bail!(
            "sandbox-dra logged {} prepares of {}",
            logged.len(),
            prepare.len() + again.len()
        );
    }
    let (first, second): (Vec<_>, Vec<_>) = logged
        .into_iter()
        .enumerate()
        .partition(|(i, _)| i % 2 == 0);
    let strip = |v: Vec<(usize, Parts)>| v.into_iter().map(|(_, p)| p).collect::<Vec<_>>();
    Ok((
        with_call(strip(first), prepare),
        with_call(strip(second), again),
    ))
}

/// One run of the vGPU figures.
struct VgpuRun {
    /// The first prepare: the GPU's VFs enabled, then the mdev created.
    first: Duration,
    /// Later prepares: the mdev created, its group node there.
    prepare: Vec<Duration>,
    /// The same prepare again (kubelet's retry: nothing to do).
    again: Vec<Duration>,
    /// Each later prepare's writes replayed bare.
    floor: Vec<Duration>,
    /// Each later prepare's parts, and each repeated prepare's.
    parts: Vec<Parts>,
    again_parts: Vec<Parts>,
    unprepare: Vec<Duration>,
    /// A GPU hot-plugged / unplugged → the API server's slices show it.
    plugged: Duration,
    unplugged: Duration,
    slices: usize,
    devices: usize,
    /// ResourceSlice writes (any request but a read) while the cycles ran.
    slice_writes: usize,
}

/// The ResourceSlice writes `api` received so far: every request on them but a read.
fn slice_writes(api: &FakeApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.contains("/resourceslices") && !r.starts_with("GET"))
        .count()
}

fn slice_devices(api: &FakeApiServer) -> Vec<String> {
    api.slices()
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .filter_map(|d| d["name"].as_str().map(str::to_string))
        .collect()
}

async fn wait_slices(api: &FakeApiServer, f: impl Fn(&[String]) -> bool) -> Result<Duration> {
    let t = Instant::now();
    loop {
        if f(&slice_devices(api)) {
            return Ok(t.elapsed());
        }
        if t.elapsed() > Duration::from_secs(20) {
            bail!("the slices never showed the change");
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
}

async fn vgpu_once(b: &Bins, cycles: usize) -> Result<VgpuRun> {
    let topo = builtin("2xA10")?;
    let sim = mount(&topo);
    let root = sim.root();
    let api = FakeApiServer::start(NODE, &[])?;
    api.put_claim(json!({
        "metadata": {"namespace": "bench", "name": "v", "uid": "uid-vgpu"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "vgpu-0000-41-00-0-a10-4q",
             "shareID": "5a4e0000-0000-4000-8000-000000000001"}
        ]}}},
    }));
    let inv = Invocation::new(
        &b.dra,
        &[
            &"--host-root",
            &root,
            &"--node-name",
            &NODE,
            &"--kubeconfig",
            &api.kubeconfig(),
            &"--vgpu",
            &"0000:41:00.0",
            &"--log-format",
            &"json",
            &"serve",
        ],
    );
    let daemon = Daemon::start(&inv).await?;
    let kubelet_root = Path::new("/var/lib/kubelet");
    let start = Instant::now();
    let socket = loop {
        if let Some(s) = dra::registration_sockets(root, kubelet_root).pop() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("sandbox-dra did not serve: {}", daemon.stderr_tail());
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    };
    let mut drv: DraDriver = dra::register(root, &socket, None).await?;
    drv.keep_connection().await?;
    // The pooled GPU's pool, whole: as many slices as each says it has.
    wait_slices(&api, |d| {
        d.iter().any(|n| n.starts_with("vgpu-"))
            && cluster_tier::api_server::whole_pools(&api.slices())
    })
    .await
    .with_context(|| daemon.stderr_tail())?;
    let claim = [Claim {
        namespace: "bench".into(),
        name: "v".into(),
        uid: "uid-vgpu".into(),
    }];
    let mut run = VgpuRun {
        first: Duration::ZERO,
        prepare: Vec::with_capacity(cycles),
        again: Vec::with_capacity(cycles),
        floor: Vec::with_capacity(cycles),
        parts: Vec::new(),
        again_parts: Vec::new(),
        unprepare: Vec::with_capacity(cycles),
        plugged: Duration::ZERO,
        unplugged: Duration::ZERO,
        slices: api.slices().len(),
        devices: slice_devices(&api).len(),
        slice_writes: 0,
    };
    let writes_before = slice_writes(&api);
    let mut written = Vec::with_capacity(cycles);
    for i in 0..cycles {
        let watch = Watch::start(&sim);
        let t = Instant::now();
        prepared_ok(drv.prepare(Version::V1, &claim).await?)
            .with_context(|| daemon.stderr_tail())?;
        if i == 0 {
            run.first = t.elapsed();
        } else {
            run.prepare.push(t.elapsed());
        }
        let (sysfs, files) = watch.prepared(&sim);
        let t = Instant::now();
        prepared_ok(drv.prepare(Version::V1, &claim).await?)?;
        run.again.push(t.elapsed());
        sim.clear_ops();
        let t = Instant::now();
        let out = drv.unprepare(Version::V1, &claim).await?;
        run.unprepare.push(t.elapsed());
        if !matches!(out.first(), Some((_, Ok(())))) {
            bail!("unprepare: {out:?}: {}", daemon.stderr_tail());
        }
        let undo = writes(&sim.ops());
        written.push(Writes { sysfs, files, undo });
    }
    run.slice_writes = slice_writes(&api) - writes_before;
    let t = Instant::now();
    sim.control("hotplug 0000:81:00.0 A10 group=50 numa=1")?;
    wait_slices(&api, |d| d.iter().any(|n| n == "gpu-0000-81-00-0")).await?;
    run.plugged = t.elapsed();
    let t = Instant::now();
    sim.control("unplug 0000:81:00.0")?;
    wait_slices(&api, |d| !d.iter().any(|n| n == "gpu-0000-81-00-0")).await?;
    run.unplugged = t.elapsed();
    let mut prepares = vec![run.first];
    prepares.extend(&run.prepare);
    (run.parts, run.again_parts) = split_parts(logged_parts(&daemon)?, &prepares, &run.again)?;
    // The first prepare (VFs enabled) is left out, as from the prepare's figures.
    if !run.parts.is_empty() {
        run.parts.remove(0);
    }
    daemon.stop().await;
    drop(sim);
    // The first prepare (VFs enabled) is replayed for the node's sake, and not counted.
    run.floor = floors(&topo, &written)?.split_off(1);
    Ok(run)
}

/// The vGPU figures; the parts of its prepares for the table of parts.
async fn bench_vgpu(
    cli: &Cli,
    b: &Bins,
    r: &mut Report,
) -> Result<Vec<(&'static str, Vec<Parts>)>> {
    let cycles = cli.claims.max(2);
    r.line(format!("vGPUs (`--vgpu 0000:41:00.0` on 2xA10: one counter set, one shared device per vGPU type of that GPU, its passthrough device and the other GPU's): {cycles} cycles per run of an A10-4Q claim. The first prepare enables the GPU's 32 VFs, then creates the mdev; the others create it on the enabled VFs; each returns once the vGPU's /dev/vfio group node exists (vGPU ready). The same prepare again is kubelet's retry (nothing to do). Unprepare removes the mdev. Floor: each prepare's writes replayed bare on a fresh node, as for whole GPUs above. Goals: prepare p50 ≤ 2× and p99 ≤ 3× the floor's p50, prepare again ≤ 2 ms. Slice writes: the API server's ResourceSlice writes while the cycles ran, per prepare (the pool changes only when the node does). Publication: from node-sim's hot-plug (or unplug) of a third A10 to the API server's slices showing (or no longer showing) its device, through the uevent, a read of the node and the pool's slices written again."));
    r.line("");
    r.table(&[
        "node",
        "slices / devices",
        "first prepare (VFs enabled)",
        "floor p50",
        "floor p99",
        "prepare → vGPU ready p50",
        "p99",
        "p50 / floor",
        "p99 / floor",
        "prepare again p50",
        "prepare again p99",
        "unprepare p50",
        "unprepare p99",
        "slice writes per prepare",
        "hot-plug → slices p50",
        "unplug → slices p50",
    ]);
    let mut runs = Vec::new();
    for _ in 0..cli.runs {
        runs.push(vgpu_once(b, cycles).await?);
    }
    let pct = |v: Vec<Duration>| -> Result<(String, String)> {
        let s = summarize(&v).ok_or_else(|| anyhow!("no samples"))?;
        Ok((fmt_duration(s.median), fmt_duration(s.p99)))
    };
    let all = |f: fn(&VgpuRun) -> &Vec<Duration>| -> Vec<Duration> {
        runs.iter().flat_map(|x| f(x).iter().copied()).collect()
    };
    let (p50, p99) = pct(all(|x| &x.prepare))?;
    let (f50, f99) = pct(all(|x| &x.floor))?;
    let (a50, a99) = pct(all(|x| &x.again))?;
    let (u50, u99) = pct(all(|x| &x.unprepare))?;
    let (prep, floor) = summarize(&all(|x| &x.prepare))
        .zip(summarize(&all(|x| &x.floor)))
        .ok_or_else(|| anyhow!("no samples"))?;
    let first = summarize(&runs.iter().map(|x| x.first).collect::<Vec<_>>())
        .ok_or_else(|| anyhow!("no runs"))?;
    let (pl, _) = pct(runs.iter().map(|x| x.plugged).collect())?;
    let (un, _) = pct(runs.iter().map(|x| x.unplugged).collect())?;
    r.row(&[
        "2xA10".to_string(),
        format!(
            "{} / {}",
            runs.first().map_or(0, |x| x.slices),
            runs.first().map_or(0, |x| x.devices)
        ),
        fmt_summary(&first),
        f50,
        f99,
        p50,
        p99,
        ratio(prep.median, floor.median),
        ratio(prep.p99, floor.median),
        a50,
        a99,
        u50,
        u99,
        {
            let writes: usize = runs.iter().map(|x| x.slice_writes).sum();
            let prepares = runs.len() * cycles;
            format!("{:.2}", writes as f64 / prepares.max(1) as f64)
        },
        pl,
        un,
    ]);
    r.line("");
    Ok(vec![
        ("vGPU", runs.iter().flat_map(|x| x.parts.clone()).collect()),
        (
            "vGPU again",
            runs.iter().flat_map(|x| x.again_parts.clone()).collect(),
        ),
    ])
}

pub async fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let cycles = cli.claims;
    r.line("## sandbox-dra");
    r.line("");
    r.line(format!("From process start to registered (the fake kubelet's GetInfo and NotifyRegistrationStatus through the percent-encoded socket path); then {cycles} cycles per run of a one-GPU claim (0000:41:00.0): NodePrepareResources that binds the GPU's group (nvidia → vfio-pci, record, metadata, CDI spec), the same call again (kubelet's retry: nothing written), and NodeUnprepareResources with `--unprepare restore` (spec and metadata removed, the GPU back on nvidia); p50 and p99 over all calls of all runs. Floor: each prepare's writes replayed bare on a fresh node in the order the prepare makes them (the claim's record, the original drivers, the binds' sysfs writes, the metadata and CDI spec, the record again; files replaced as the daemon replaces them), each unprepare's replayed untimed between them. Goals: prepare p50 ≤ 2× and p99 ≤ 3× the floor's p50, prepare again ≤ 2 ms. RSS and peak RSS after the cycles."));
    r.line("");
    r.table(&[
        "node",
        "registered",
        "floor p50",
        "floor p99",
        "prepare p50",
        "prepare p99",
        "p50 / floor",
        "p99 / floor",
        "prepare again p50",
        "prepare again p99",
        "unprepare p50",
        "unprepare p99",
        "RSS",
        "peak RSS",
    ]);
    let mut parts = Vec::new();
    for topology in ["2xA10"] {
        let mut runs = Vec::new();
        for _ in 0..cli.runs {
            runs.push(dra_once(b, topology, cycles).await?);
        }
        let all = |f: fn(&DraRun) -> &Vec<Duration>| -> Vec<Duration> {
            runs.iter().flat_map(|x| f(x).iter().copied()).collect()
        };
        let pct = |v: Vec<Duration>| fmt_p50_p99(&v).ok_or_else(|| anyhow!("no samples"));
        let (p50, p99) = pct(all(|x| &x.prepare))?;
        let (f50, f99) = pct(all(|x| &x.floor))?;
        let (prep, floor) = summarize(&all(|x| &x.prepare))
            .zip(summarize(&all(|x| &x.floor)))
            .ok_or_else(|| anyhow!("no samples"))?;
        let (a50, a99) = pct(all(|x| &x.again))?;
        let (u50, u99) = pct(all(|x| &x.unprepare))?;
        let reg = summarize(&runs.iter().map(|x| x.registered).collect::<Vec<_>>())
            .ok_or_else(|| anyhow!("no runs"))?;
        let rss = runs.iter().map(|x| x.rss_kib).max().unwrap_or(0);
        let hwm = runs.iter().map(|x| x.hwm_kib).max().unwrap_or(0);
        let anon = runs.iter().map(|x| x.anon_kib).max().unwrap_or(0);
        r.row(&[
            topology.to_string(),
            fmt_summary(&reg),
            f50,
            f99,
            p50,
            p99,
            ratio(prep.median, floor.median),
            ratio(prep.p99, floor.median),
            a50,
            a99,
            u50,
            u99,
            mib(rss),
            mib(hwm),
        ]);
        r.memory("sandbox-dra", "after the claims", topology, rss, anon);
        parts.push((
            "GPU",
            runs.iter().flat_map(|x| x.parts.iter().cloned()).collect(),
        ));
        parts.push((
            "GPU again",
            runs.iter()
                .flat_map(|x| x.again_parts.iter().cloned())
                .collect(),
        ));
    }
    r.line("");
    parts.extend(bench_vgpu(cli, b, r).await?);
    r.line("Each prepare's parts as sandbox-dra logs them (\"claim prepared\", its steps): the claim read from the API server (`api`), waiting for the one-at-a-time lock and a worker thread (`queue`), the claim's record read and saved (`record`), the node read and checked (`node`), who holds what is to move (`in-use`: processes, pods, claims), the sysfs writes (`write`), waiting for the vGPU's group node (`ready`), the metadata and CDI spec (`files`); `call` is the rest of the call as the fake kubelet timed it (gRPC, the daemon's runtime). p50 / p99 of each over the calls above (the first vGPU prepare left out), then the steps of the slowest call; a repeated prepare reads the record and checks the node, and writes nothing.");
    r.line("");
    parts_table(r, &parts);
    r.line("");
    Ok(())
}
