//! What sandbox-dra's published pool costs the real kube-scheduler and kube-apiserver (the
//! cluster tier's binaries, `cluster_tier::ControlPlane`; no kubelet: pods are bound, never run).
//!
//! The slices are sandbox-dra's own: it runs once per pool on a simulated 8xA10 node against the
//! API server (passthrough only, `--vgpu all`, `--vgpu all --vgpu-types A10-4Q,A10-8Q`, and
//! `--vgpu all` again for claims naming the type's own DeviceClass), and its slices are copied
//! to N Node objects (renamed, `nodeName`, pool and owner changed).
//! Then pods, one after another, each with a new claim from a ResourceClaimTemplate (one
//! A10-4Q, by the vGPU class and a selector or by its type's class, or one whole A10 when no
//! vGPU is published), until the
//! count asked; when the nodes are full the pods are deleted and the next ones start on empty
//! nodes again. Timings come from the API server's audit log (microseconds): the pod's create,
//! the claim's create by the controller-manager, the scheduler's binding (`spec.nodeName` set,
//! after it wrote the claim's allocation); and from the scheduler's own histograms on its
//! `/metrics`. Memory and CPU time of kube-apiserver, kube-scheduler and etcd from `/proc`.

use std::collections::BTreeMap;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow, bail};
use cluster_tier::{Assets, ControlPlane, ControlPlaneOpts};
use serde_json::{Value, json};

use crate::Cli;
use crate::harness::bins::Bins;
use crate::harness::procstat;
use crate::harness::report::{Report, mib};
use crate::harness::stats::{fmt_duration, fmt_p50_p99};
use crate::harness::topology::{generated, mount};

const DRIVER: &str = "gpu.gpu-vm-node.io";
const NS: &str = "bench";
/// GPUs of the simulated node, each an A10.
const GPUS: usize = 8;
/// A10-4Q vGPUs one A10 holds (24 GiB / 4 GiB), what a node's vGPU claims can fill.
const A10_4Q_PER_GPU: usize = 6;
/// The vGPU types the third pool publishes (`--vgpu-types`).
const FEW_TYPES: &str = "A10-4Q,A10-8Q";
/// The chart's DeviceClass of the type A10-4Q alone (`draDriver.extendedResources`): what a pod
/// asking for `nvidia.com/NVIDIA_A10-4Q` by limits is given, and what a claim may name.
const TYPE_CLASS: &str = "nvidia-a10-4q.gpu-vm-node.io";
/// The examples' claim template of the fourth pool's pods: one device of [`TYPE_CLASS`], no
/// selector.
const TYPE_CLASS_TEMPLATE: &str = "a10-4q-by-class";
/// How long one pod may wait to be bound.
const PATIENCE: Duration = Duration::from_secs(120);

/// The DeviceClasses as they ship, then the claim templates of the examples, in the checkout
/// (read when the section runs: the image's build context holds no deploy/).
const DEVICE_CLASSES: [&str; 2] = [
    "deploy/helm/gpu-vm-node/files/dra-deviceclass.yaml",
    "deploy/helm/gpu-vm-node/files/dra-vgpu-deviceclass.yaml",
];
const TEMPLATES: [&str; 2] = [
    "deploy/examples/dra/resourceclaimtemplate.yaml",
    "deploy/examples/dra/vgpu-claims.yaml",
];

/// What the nodes publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pool {
    /// sandbox-dra without `--vgpu`: one device per GPU.
    Passthrough,
    /// `--vgpu all`: every vGPU type of every size, and the whole GPUs.
    AllTypes,
    /// `--vgpu all --vgpu-types` [`FEW_TYPES`].
    FewTypes,
    /// `--vgpu all`, the claims naming the type's own class ([`TYPE_CLASS`]) instead of the
    /// vGPU class and a selector.
    AllTypesByClass,
    /// [`Pool::AllTypes`] with `--pool-per-gpu`: each GPU a pool of its own.
    AllTypesPerGpu,
    /// [`Pool::FewTypes`] with `--pool-per-gpu`.
    FewTypesPerGpu,
}

impl Pool {
    /// How `--sched-pools` names it.
    fn letter(self) -> &'static str {
        match self {
            Pool::Passthrough => "a",
            Pool::AllTypes => "b",
            Pool::FewTypes => "c",
            Pool::AllTypesByClass => "d",
            Pool::AllTypesPerGpu => "e",
            Pool::FewTypesPerGpu => "f",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Pool::Passthrough => "(a) passthrough only",
            Pool::AllTypes => "(b) `--vgpu all`",
            Pool::FewTypes => "(c) `--vgpu-types A10-4Q,A10-8Q`",
            Pool::AllTypesByClass => "(d) `--vgpu all`, claims by the type's class",
            Pool::AllTypesPerGpu => "(e) (b) `--pool-per-gpu`",
            Pool::FewTypesPerGpu => "(f) (c) `--pool-per-gpu`",
        }
    }

    /// sandbox-dra's flags for it.
    fn args(self) -> Vec<&'static str> {
        match self {
            Pool::Passthrough => vec![],
            Pool::AllTypes | Pool::AllTypesByClass => vec!["--vgpu", "all"],
            Pool::FewTypes => vec!["--vgpu", "all", "--vgpu-types", FEW_TYPES],
            Pool::AllTypesPerGpu => vec!["--vgpu", "all", "--pool-per-gpu"],
            Pool::FewTypesPerGpu => {
                vec!["--vgpu", "all", "--vgpu-types", FEW_TYPES, "--pool-per-gpu"]
            }
        }
    }

    /// The claim template its pods use, and how many such claims one node holds.
    fn claim(self) -> (&'static str, &'static str, usize) {
        match self {
            Pool::Passthrough => ("a10-passthrough", "one whole A10", GPUS),
            Pool::AllTypesByClass => (
                TYPE_CLASS_TEMPLATE,
                "one A10-4Q by its class",
                GPUS * A10_4Q_PER_GPU,
            ),
            _ => ("a10-4q", "one A10-4Q", GPUS * A10_4Q_PER_GPU),
        }
    }
}

/// One node's slices as sandbox-dra published them, for copying.
struct Published {
    slices: Vec<Value>,
}

impl Published {
    /// The whole-GPU devices.
    fn whole_gpus(&self) -> usize {
        self.slices
            .iter()
            .filter_map(|s| s["spec"]["devices"].as_array())
            .flatten()
            .filter(|d| d["name"].as_str().is_some_and(|n| n.starts_with("gpu-")))
            .count()
    }

    fn devices(&self) -> usize {
        self.slices
            .iter()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum()
    }

    /// The slices for node `node` (UID `uid`): names, `nodeName`, pools and owner changed.
    fn for_node(&self, from: &str, node: &str, uid: &str) -> Vec<Value> {
        self.slices
            .iter()
            .map(|s| {
                let name = s["metadata"]["name"].as_str().unwrap_or_default();
                let mut spec = s["spec"].clone();
                spec["nodeName"] = json!(node);
                // The node's own pool, or one of its GPUs' (`<node>/gpu-…`).
                let pool = spec["pool"]["name"].as_str().unwrap_or_default();
                spec["pool"]["name"] = json!(pool.replacen(from, node, 1));
                json!({
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceSlice",
                    "metadata": {
                        "name": name.replacen(from, node, 1),
                        "ownerReferences": [{
                            "apiVersion": "v1", "kind": "Node", "name": node, "uid": uid,
                            "controller": true,
                        }],
                    },
                    "spec": spec,
                })
            })
            .collect()
    }
}

/// A running `sandbox-dra serve`, killed on drop.
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    std::fs::write(path, serde_json::to_vec(v)?)
        .with_context(|| format!("writing {}", path.display()))
}

fn kubectl_json(cp: &ControlPlane, args: &[&str]) -> Result<Value> {
    let out = cp.kubectl(args)?;
    serde_json::from_str(&out).with_context(|| format!("kubectl {args:?}: not JSON"))
}

fn create(cp: &ControlPlane, dir: &Path, name: &str, items: Vec<Value>) -> Result<()> {
    let file = dir.join(format!("{name}.json"));
    write_json(
        &file,
        &json!({"apiVersion": "v1", "kind": "List", "items": items}),
    )?;
    cp.kubectl(&["create", "-f", &file.to_string_lossy()])?;
    Ok(())
}

/// The slices sandbox-dra publishes for a node of [`GPUS`] A10s, started with `args`.
fn publish(
    b: &Bins,
    cp: &ControlPlane,
    dir: &Path,
    node: &str,
    args: &[&str],
) -> Result<Published> {
    create(
        cp,
        dir,
        node,
        vec![json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})],
    )?;
    let sim = mount(&generated("A10", GPUS)?);
    let log = dir.join(format!("sandbox-dra-{node}.log"));
    let mut cmd = Command::new(&b.dra);
    cmd.arg("serve")
        .arg("--host-root")
        .arg(sim.root())
        .args(["--node-name", node, "--kubeconfig"])
        .arg(cp.admin_kubeconfig())
        .env_remove("HOST_ROOT")
        .env_remove("KUBECONFIG")
        .env_remove("VGPU")
        .env_remove("VGPU_TYPES")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    let _driver = Driver(
        cmd.spawn()
            .with_context(|| format!("starting {}", b.dra.display()))?,
    );
    let t = Instant::now();
    loop {
        let v = kubectl_json(
            cp,
            &[
                "get",
                "resourceslices",
                "-o",
                "json",
                "--field-selector",
                &format!("spec.nodeName={node},spec.driver={DRIVER}"),
            ],
        )?;
        let slices = v["items"].as_array().cloned().unwrap_or_default();
        let whole = cluster_tier::api_server::whole_pools(&slices);
        let p = Published { slices };
        // Every GPU (each in the node's pool, or in a pool of its own) and whole pools.
        if whole && p.whole_gpus() == GPUS {
            return Ok(p);
        }
        if t.elapsed() > Duration::from_secs(90) {
            bail!(
                "sandbox-dra published no whole pool in 90 s: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One request of the audit log.
#[derive(Clone, Debug)]
struct Audit {
    verb: String,
    resource: String,
    subresource: String,
    name: String,
    /// When the API server answered (`stageTimestamp` of `ResponseComplete`).
    done: SystemTime,
}

/// The audit log read as it grows: the requests on pods and claims of the bench's namespace.
struct AuditTail {
    path: PathBuf,
    offset: u64,
    rest: String,
    events: Vec<Audit>,
}

impl AuditTail {
    fn new(path: PathBuf) -> AuditTail {
        AuditTail {
            path,
            offset: 0,
            rest: String::new(),
            events: Vec::new(),
        }
    }

    fn read(&mut self) -> Result<()> {
        let mut f = std::fs::File::open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        f.seek(SeekFrom::Start(self.offset))?;
        let mut buf = String::new();
        self.offset += f.read_to_string(&mut buf)? as u64;
        self.rest.push_str(&buf);
        let Some(end) = self.rest.rfind('\n') else {
            return Ok(());
        };
        let whole: String = self.rest.drain(..=end).collect();
        for line in whole.lines() {
            if !line.contains("\"namespace\":\"bench\"") {
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let o = &v["objectRef"];
            let code = v["responseStatus"]["code"].as_u64().unwrap_or(0);
            if o["namespace"] != NS || !(200..300).contains(&code) {
                continue;
            }
            let Some(done) = v["stageTimestamp"]
                .as_str()
                .and_then(|t| humantime::parse_rfc3339(t).ok())
            else {
                continue;
            };
            let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
            self.events.push(Audit {
                verb: s(&v["verb"]),
                resource: s(&o["resource"]),
                subresource: s(&o["subresource"]),
                name: s(&o["name"]),
                done,
            });
        }
        Ok(())
    }

    fn find(&self, f: impl Fn(&Audit) -> bool) -> Option<&Audit> {
        self.events.iter().find(|e| f(e))
    }
}

/// One histogram of the scheduler's metrics, its series with `labels` summed.
#[derive(Clone, Debug, Default, PartialEq)]
struct Histogram {
    /// Upper bound (seconds) → cumulative count.
    buckets: BTreeMap<String, f64>,
    sum: f64,
    count: f64,
}

impl Histogram {
    fn parse(text: &str, name: &str, labels: &[(&str, &str)]) -> Histogram {
        let mut h = Histogram::default();
        for line in text.lines().filter(|l| l.starts_with(name)) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (metric, lbls) = series.split_once('{').unwrap_or((series, "}"));
            // `,name="value"` for every label, the first one's too (`profile` ends in `le`).
            let lbls = format!(",{lbls}");
            if !labels
                .iter()
                .all(|(k, v)| lbls.contains(&format!(",{k}=\"{v}\"")))
            {
                continue;
            }
            match metric.strip_prefix(name) {
                Some("_bucket") => {
                    let le = lbls
                        .split(",le=\"")
                        .nth(1)
                        .and_then(|r| r.split('"').next())
                        .unwrap_or_default();
                    *h.buckets.entry(le.to_string()).or_default() += value;
                }
                Some("_sum") => h.sum += value,
                Some("_count") => h.count += value,
                _ => {}
            }
        }
        h
    }

    /// What was observed between `before` and `self`.
    fn since(&self, before: &Histogram) -> Histogram {
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|(k, v)| (k.clone(), v - before.buckets.get(k).copied().unwrap_or(0.0)))
                .collect(),
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    fn mean(&self) -> Option<Duration> {
        (self.count > 0.0).then(|| Duration::from_secs_f64(self.sum / self.count))
    }

    /// The `q` quantile, interpolated in its bucket as Prometheus' `histogram_quantile` does;
    /// `None` without observations, the largest finite bound when it falls in `+Inf`.
    fn quantile(&self, q: f64) -> Option<Duration> {
        if self.count <= 0.0 {
            return None;
        }
        let mut b: Vec<(f64, f64)> = self
            .buckets
            .iter()
            .map(|(le, n)| (le.parse::<f64>().unwrap_or(f64::INFINITY), *n))
            .collect();
        b.sort_by(|x, y| x.0.total_cmp(&y.0));
        let rank = q * self.count;
        let (mut lo, mut below) = (0.0, 0.0);
        for (le, n) in b {
            if n >= rank {
                if le.is_infinite() {
                    return Some(Duration::from_secs_f64(lo));
                }
                let share = if n > below {
                    (rank - below) / (n - below)
                } else {
                    0.0
                };
                return Some(Duration::from_secs_f64(lo + (le - lo) * share));
            }
            (lo, below) = (le, n);
        }
        Some(Duration::from_secs_f64(lo))
    }
}

/// The scheduler's histograms this section reports.
#[derive(Clone, Debug, Default)]
struct Metrics {
    attempt: Histogram,
    filter: Histogram,
    prefilter: Histogram,
}

fn scrape(port: u16) -> Result<Metrics> {
    let text = cluster_tier::proc::run(
        Command::new("curl")
            .args(["-sSfk", "--max-time", "10"])
            .arg(format!("https://127.0.0.1:{port}/metrics")),
    )
    .context("kube-scheduler's /metrics")?;
    let ext = "scheduler_framework_extension_point_duration_seconds";
    Ok(Metrics {
        attempt: Histogram::parse(
            &text,
            "scheduler_scheduling_attempt_duration_seconds",
            &[("result", "scheduled")],
        ),
        filter: Histogram::parse(&text, ext, &[("extension_point", "Filter")]),
        prefilter: Histogram::parse(&text, ext, &[("extension_point", "PreFilter")]),
    })
}

/// A reading of the control plane's processes, by name.
fn usage(cp: &ControlPlane) -> BTreeMap<String, procstat::ProcSample> {
    cp.procs()
        .into_iter()
        .filter_map(|p| {
            let s = procstat::sample(u32::try_from(p.pid()).ok()?)?;
            Some((p.name().to_string(), s))
        })
        .collect()
}

/// One scenario's figures.
struct Run {
    nodes: usize,
    pool: Pool,
    slices: usize,
    devices: usize,
    json_bytes: usize,
    /// Pod created → bound, per pod.
    pod_bound: Vec<Duration>,
    /// Claim created (by the controller-manager) → pod bound, per pod.
    claim_bound: Vec<Duration>,
    metrics: Metrics,
    /// The processes once the slices are loaded, and after the pods.
    loaded: BTreeMap<String, procstat::ProcSample>,
    after: BTreeMap<String, procstat::ProcSample>,
}

fn ready_node(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name,
            "nvidia.com/gpu.workload.config": "vm-dra",
        }},
        "status": {
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "bench", "lastHeartbeatTime": null,
                            "lastTransitionTime": null}],
        },
    })
}

fn pod(name: &str, template: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "containers": [{"name": "vm", "image": "registry.k8s.io/pause:3.10",
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            // No kubelet renews the Nodes: the taints the node controller adds are tolerated.
            "tolerations": [{"operator": "Exists"}],
            "automountServiceAccountToken": false,
        },
    })
}

fn wait(what: &str, limit: Duration, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let t = Instant::now();
    while !f()? {
        if t.elapsed() > limit {
            bail!("{what}: not after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Creates the chart's [`TYPE_CLASS`] as `helm template` renders it with vGPUs on (the
/// examples' template [`TYPE_CLASS_TEMPLATE`] names it).
fn type_class(assets: &Assets, cp: &ControlPlane, dir: &Path) -> Result<()> {
    let chart = cluster_tier::assets::repo().join("deploy/helm/gpu-vm-node");
    let text = cluster_tier::proc::run(
        Command::new(&assets.helm)
            .args(["template", "bench"])
            .arg(&chart)
            .args([
                "--set",
                "draDriver.enabled=true",
                "--set",
                "draDriver.vgpu=all",
                "--show-only",
                "templates/dra.yaml",
            ]),
    )
    .context("helm template")?;
    let class = text
        .split("\n---")
        .find(|d| d.contains("kind: DeviceClass") && d.contains(&format!("name: {TYPE_CLASS}")))
        .with_context(|| format!("the chart renders no DeviceClass {TYPE_CLASS}"))?;
    let path = dir.join("type-class.yaml");
    std::fs::write(&path, class)?;
    cp.kubectl(&["apply", "-f", &path.to_string_lossy()])?;
    Ok(())
}

fn scenario(
    assets: &Assets,
    dir: &Path,
    published: &Published,
    from: &str,
    nodes: usize,
    pool: Pool,
    pods: usize,
) -> Result<Run> {
    let port = cluster_tier::control_plane::free_port()?;
    let cp = ControlPlane::start(
        dir,
        assets,
        ControlPlaneOpts {
            controllers: true,
            scheduler_port: port,
            ..ControlPlaneOpts::default()
        },
    )?;
    // Where to point `go tool pprof` (its profile, as the bench's own figures, is of this run).
    eprintln!("  kube-scheduler: https://127.0.0.1:{port}/metrics and /debug/pprof/");
    for (i, file) in DEVICE_CLASSES.iter().chain(&TEMPLATES).enumerate() {
        let f = cluster_tier::assets::repo().join(file);
        if i == DEVICE_CLASSES.len() {
            cp.kubectl(&["create", "namespace", NS])?;
        }
        cp.kubectl(&["apply", "-n", NS, "-f", &f.to_string_lossy()])?;
    }
    if pool == Pool::AllTypesByClass {
        type_class(assets, &cp, dir)?;
    }
    let names: Vec<String> = (0..nodes).map(|i| format!("node-{i:03}")).collect();
    create(
        &cp,
        dir,
        "nodes",
        names.iter().map(|n| ready_node(n)).collect(),
    )?;
    let got = kubectl_json(&cp, &["get", "nodes", "-o", "json"])?;
    let uids: BTreeMap<String, String> = got["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| {
            (
                n["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                n["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect();
    if got["items"][0]["status"]["allocatable"]["pods"] != "110" {
        bail!(
            "the Nodes were created without their status: {}",
            got["items"][0]["status"]
        );
    }
    let mut json_bytes = 0;
    for (i, chunk) in names.chunks(10).enumerate() {
        let mut items = Vec::new();
        for n in chunk {
            let uid = uids.get(n).ok_or_else(|| anyhow!("no Node {n}"))?;
            items.extend(published.for_node(from, n, uid));
        }
        if i == 0 {
            json_bytes = serde_json::to_vec(&published.for_node(from, &names[0], "x"))?.len();
        }
        create(&cp, dir, &format!("slices-{i}"), items)?;
    }
    wait(
        "the default ServiceAccount",
        Duration::from_secs(60),
        || {
            Ok(cp
                .kubectl(&["get", "serviceaccount", "-n", NS, "-o", "name"])?
                .contains("default"))
        },
    )?;
    // The scheduler's informers have the slices by the time its metrics answer after them.
    wait("kube-scheduler's /metrics", Duration::from_secs(60), || {
        Ok(scrape(port).is_ok())
    })?;
    std::thread::sleep(Duration::from_secs(3));
    let loaded = usage(&cp);
    let before = scrape(port)?;
    let (template, _, per_node) = pool.claim();
    let capacity = per_node * nodes;
    let mut audit = AuditTail::new(cp.audit_log());
    let mut run = Run {
        nodes,
        pool,
        slices: published.slices.len(),
        devices: published.devices(),
        json_bytes,
        pod_bound: Vec::new(),
        claim_bound: Vec::new(),
        metrics: Metrics::default(),
        loaded,
        after: BTreeMap::new(),
    };
    let mut placed = 0;
    for i in 0..pods {
        if placed == capacity {
            // Full: the pods go (their claims with them) and the next ones start afresh.
            cp.kubectl(&[
                "delete",
                "pods",
                "--all",
                "-n",
                NS,
                "--grace-period=0",
                "--force",
            ])?;
            wait("the claims deleted", Duration::from_secs(120), || {
                Ok(cp
                    .kubectl(&["get", "resourceclaims", "-n", NS, "-o", "name"])?
                    .trim()
                    .is_empty())
            })?;
            std::thread::sleep(Duration::from_secs(1));
            placed = 0;
        }
        let name = format!("vm-{i:03}");
        let f = dir.join("pod.json");
        write_json(&f, &pod(&name, template))?;
        cp.kubectl(&["create", "-f", &f.to_string_lossy()])?;
        let t = Instant::now();
        let bound = loop {
            audit.read()?;
            let bound =
                audit.find(|e| e.subresource == "binding" && e.name == name && e.verb == "create");
            if let Some(b) = bound {
                break b.clone();
            }
            if t.elapsed() > PATIENCE {
                let p = cp.kubectl(&["get", "pod", "-n", NS, &name, "-o", "yaml"])?;
                bail!("{name} not bound after {PATIENCE:?}:\n{p}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let created = audit
            .find(|e| {
                e.verb == "create"
                    && e.resource == "pods"
                    && e.subresource.is_empty()
                    && e.name == name
            })
            .ok_or_else(|| anyhow!("no create of {name} in the audit log"))?
            .done;
        let claim = audit
            .find(|e| {
                e.verb == "create"
                    && e.resource == "resourceclaims"
                    && e.done >= created
                    && e.done <= bound.done
            })
            .map(|e| e.done);
        run.pod_bound
            .push(bound.done.duration_since(created).unwrap_or_default());
        if let Some(c) = claim {
            run.claim_bound
                .push(bound.done.duration_since(c).unwrap_or_default());
        }
        placed += 1;
    }
    let after = scrape(port)?;
    run.metrics = Metrics {
        attempt: after.attempt.since(&before.attempt),
        filter: after.filter.since(&before.filter),
        prefilter: after.prefilter.since(&before.prefilter),
    };
    run.after = usage(&cp);
    // Every bound pod's claim is allocated.
    let claims = kubectl_json(&cp, &["get", "resourceclaims", "-n", NS, "-o", "json"])?;
    let allocated = claims["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| !c["status"]["allocation"].is_null())
        .count();
    if allocated != placed {
        bail!("{placed} pods bound but {allocated} claims allocated");
    }
    Ok(run)
}

fn opt(d: Option<Duration>) -> String {
    d.map_or_else(|| "–".to_string(), fmt_duration)
}

pub fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let assets = Assets::load()
        .map_err(|why| anyhow!("the scheduler section needs the cluster tier's assets: {why}"))?;
    let assets = if cli.sched_newest {
        assets
            .newest()
            .context("--sched-newest: the cluster tier prepared no newest release (K8S_NEWEST)")?
    } else {
        assets
    };
    if !b.dra.exists() {
        bail!(
            "{} not found: build sandbox-dra beside this binary first",
            b.dra.display()
        );
    }
    let top = tempfile::Builder::new()
        .prefix("bench-scheduler")
        .tempdir()?;
    // Each control plane's etcd keeps its data in /dev/shm under its directory's name: unique.
    let unique = top
        .path()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let pools: Vec<Pool> = [
        Pool::Passthrough,
        Pool::AllTypes,
        Pool::FewTypes,
        Pool::AllTypesByClass,
        Pool::AllTypesPerGpu,
        Pool::FewTypesPerGpu,
    ]
    .into_iter()
    .filter(|p| cli.sched_pools.is_empty() || cli.sched_pools.iter().any(|l| l == p.letter()))
    .collect();
    let published = {
        let dir = top.path().join(format!("{unique}-source"));
        std::fs::create_dir_all(&dir)?;
        let cp = ControlPlane::start(&dir, &assets, ControlPlaneOpts::default())?;
        pools
            .iter()
            .enumerate()
            .map(|(i, p)| publish(b, &cp, &dir, &format!("source-{i}"), &p.args()))
            .collect::<Result<Vec<_>>>()?
    };
    let counts = match &cli.sched_nodes[..] {
        [] => vec![1, 100],
        n => n.to_vec(),
    };
    let mut runs = Vec::new();
    // A pool whose pods the scheduler could not place is reported as such; the others go on.
    let mut failed = Vec::new();
    for nodes in counts {
        for (i, (&pool, published)) in pools.iter().zip(&published).enumerate() {
            let from = format!("source-{i}");
            let dir = top.path().join(format!("{unique}-{nodes}-{pool:?}"));
            std::fs::create_dir_all(&dir)?;
            eprintln!("scheduler: {nodes} nodes, {}", pool.label());
            match scenario(&assets, &dir, published, &from, nodes, pool, cli.sched_pods) {
                Ok(run) => runs.push(run),
                Err(e) => {
                    let why = why_not_placed(&format!("{e:#}"));
                    eprintln!("scheduler: {nodes} nodes, {}: {why}", pool.label());
                    failed.push((nodes, pool, why));
                }
            }
        }
    }
    report(cli, &assets.k8s_version, &runs, r);
    for (nodes, pool, why) in &failed {
        r.line(format!(
            "Not measured: {nodes} nodes, {}: {why}",
            pool.label()
        ));
        r.line("");
    }
    Ok(())
}

/// What the scheduler said of a pod it did not place (its `PodScheduled` condition's message,
/// as the error quotes the pod), else the error's first line.
fn why_not_placed(err: &str) -> String {
    // YAML quotes the message in ' (inside which " is plain) or in ".
    let quoted = err
        .split_once("message: '")
        .map(|(_, rest)| rest.split('\'').next())
        .or_else(|| {
            err.split_once("message: \"")
                .map(|(_, rest)| rest.split('"').next())
        })
        .flatten()
        .map(|m| m.split_whitespace().collect::<Vec<_>>().join(" "));
    quoted.unwrap_or_else(|| err.lines().next().unwrap_or_default().to_string())
}

#[cfg(test)]
mod why {
    #[test]
    fn the_schedulers_message_is_taken_whole() {
        let err = "pod vm-000 not bound:\n  conditions:\n  - message: 'running \"DynamicResources\" filter\n      plugin: node node-465: timed out'\n    reason: SchedulerError";
        assert_eq!(
            super::why_not_placed(err),
            "running \"DynamicResources\" filter plugin: node node-465: timed out"
        );
        assert_eq!(super::why_not_placed("no pods\nmore"), "no pods");
    }
}

fn report(cli: &Cli, k8s: &str, runs: &[Run], r: &mut Report) {
    r.line(format!("sandbox-dra's slices for an {GPUS}xA10 node (node-sim), copied to N Ready Node objects of a real kube-apiserver and kube-scheduler {k8s} (no kubelet); then {} pods one after another, each with a new claim from a ResourceClaimTemplate (one whole A10 when only passthrough is published, else one A10-4Q), the nodes emptied when full. From the API server's audit log: pod created → bound (the controller-manager creating the claim included), claim created → bound (the scheduler's part: the allocation written, then the binding); p50 and p99 over the pods. From the scheduler's `/metrics`, over the same pods: a scheduling attempt (result `scheduled`), mean and p50/p99 interpolated in the histogram's buckets, and the mean of its Filter extension point (every node's filters, one observation per attempt) and PreFilter.", cli.sched_pods));
    r.line("");
    r.table(&[
        "nodes",
        "published per node",
        "claim",
        "pod created → bound p50",
        "p99",
        "claim created → bound p50",
        "p99",
        "attempt mean",
        "attempt p50 / p99",
        "Filter mean",
        "PreFilter mean",
    ]);
    for x in runs {
        let (p50, p99) = fmt_p50_p99(&x.pod_bound).unwrap_or_default();
        let (c50, c99) = fmt_p50_p99(&x.claim_bound).unwrap_or_default();
        let m = &x.metrics;
        r.row(&[
            x.nodes.to_string(),
            format!(
                "{}: {} slices, {} devices, {} kB",
                x.pool.label(),
                x.slices,
                x.devices,
                x.json_bytes / 1000
            ),
            x.pool.claim().1.to_string(),
            p50,
            p99,
            c50,
            c99,
            opt(m.attempt.mean()),
            format!(
                "{} / {}",
                opt(m.attempt.quantile(0.5)),
                opt(m.attempt.quantile(0.99))
            ),
            opt(m.filter.mean()),
            opt(m.prefilter.mean()),
        ]);
    }
    r.line("");
    r.line("Memory (RSS once the slices are loaded → after the pods, and the peak), and CPU time per pod while the pods were placed (user and system, all threads: what the machine's load does not stretch as it stretches the times above):");
    r.line("");
    r.table(&[
        "nodes",
        "published",
        "kube-apiserver RSS",
        "kube-scheduler RSS",
        "etcd RSS",
        "CPU per pod: kube-scheduler",
        "kube-apiserver",
    ]);
    for x in runs {
        let get = |m: &BTreeMap<String, procstat::ProcSample>, name: &str| {
            m.get(name).copied().unwrap_or_default()
        };
        let rss = |name: &str| {
            let (l, a) = (get(&x.loaded, name), get(&x.after, name));
            format!(
                "{} → {} (peak {})",
                mib(l.rss_kib),
                mib(a.rss_kib),
                mib(a.hwm_kib)
            )
        };
        let cpu = |name: &str| {
            let s = get(&x.after, name).cpu_seconds - get(&x.loaded, name).cpu_seconds;
            fmt_duration(Duration::from_secs_f64(
                s.max(0.0) / x.pod_bound.len().max(1) as f64,
            ))
        };
        r.row(&[
            x.nodes.to_string(),
            x.pool.label().to_string(),
            rss("kube-apiserver"),
            rss("kube-scheduler"),
            rss("etcd"),
            cpu("kube-scheduler"),
            cpu("kube-apiserver"),
        ]);
    }
    r.line("");
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# TYPE scheduler_scheduling_attempt_duration_seconds histogram
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.001"} 1
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.002"} 3
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.004"} 4
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="+Inf"} 4
scheduler_scheduling_attempt_duration_seconds_sum{profile="default-scheduler",result="scheduled"} 0.006
scheduler_scheduling_attempt_duration_seconds_count{profile="default-scheduler",result="scheduled"} 4
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="unschedulable",le="0.001"} 7
scheduler_scheduling_attempt_duration_seconds_count{profile="default-scheduler",result="unschedulable"} 7
"#;

    #[test]
    fn histograms_are_read_for_their_labels_and_interpolated() {
        let h = Histogram::parse(
            TEXT,
            "scheduler_scheduling_attempt_duration_seconds",
            &[("result", "scheduled")],
        );
        assert_eq!((h.count, h.sum), (4.0, 0.006), "{h:?}");
        assert_eq!(h.mean(), Some(Duration::from_micros(1500)));
        // The 2nd of 4 observations: half-way into the (1 ms, 2 ms] bucket.
        assert_eq!(h.quantile(0.5), Some(Duration::from_micros(1500)));
        let p99 = h.quantile(0.99).unwrap().as_secs_f64();
        assert!((p99 - 0.00392).abs() < 1e-9, "{p99}");
        let none = h.since(&h);
        assert_eq!((none.mean(), none.quantile(0.5)), (None, None));
    }
}
