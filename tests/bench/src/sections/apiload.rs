//! What sandbox-dra's ResourceSlice publisher asks of a real kube-apiserver (the cluster tier's,
//! `cluster_tier::ControlPlane`, every request in its audit log), and what that costs the API
//! server as drivers add up.
//!
//! - One driver (node-sim 2xA10, passthrough: one slice; `--resync-interval` at its default
//!   30 s): its requests over `--api-window-secs` at rest, then over as long again with a GPU
//!   hot-plugged or unplugged every minute; per hour, by verb. At rest also per hour from the
//!   watches' own `timeoutSeconds` ([`from_timeouts`]): a window shorter than a watch's timeout
//!   sees none of its renewals, and an hour's window is not needed to know them.
//! - N drivers (`--api-drivers`, default 1, 50 and 200), each with a `--node-name` and a Node
//!   object of its own, `--kubelet-root` of its own, sharing 2xA10 node-sim trees (up to
//!   [`PER_TREE`] a tree): once every one has published and [`SETTLE`] has passed, the API
//!   server's CPU time (`/proc/<pid>/stat`, less its rate with no driver) and the drivers'
//!   requests over `--api-scale-secs` (counted, and from the watches' timeouts); then
//!   `--api-hotplugs` times a GPU hot-plugged into the first tree, and for each driver of that
//!   tree the time from the hot-plug to its apply answered (the audit log's `stageTimestamp`),
//!   and the apply's own time in the API server.
//!
//! The drivers authenticate as one user in `system:masters`, which API priority and fairness
//! exempts: queueing is not measured.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow, bail};
use cluster_tier::{Assets, ControlPlane, ControlPlaneOpts};
use serde_json::{Value, json};
use testkit::sim::SimDir;

use crate::Cli;
use crate::harness::bins::{Bins, need};
use crate::harness::procstat;
use crate::harness::report::{Report, mib};
use crate::harness::stats::fmt_duration;
use crate::harness::topology::{builtin, mount};

const DRIVER: &str = "gpu.gpu-vm-node.io";
/// The user every driver authenticates as.
const USER: &str = "sandbox-dra";
/// Drivers sharing one simulated node.
const PER_TREE: usize = 50;
/// What is hot-plugged.
const HOTPLUG: &str = "hotplug 0000:81:00.0 A10 group=50 numa=1";
const UNPLUG: &str = "unplug 0000:81:00.0";
/// After every driver published, before the figures: their first passes and watches settle.
const SETTLE: Duration = Duration::from_secs(30);
/// How long drivers may take to publish, or to follow a hot-plug.
const PATIENCE: Duration = Duration::from_secs(300);

/// Running drivers, killed on drop.
struct Drivers(Vec<Child>);

impl Drop for Drivers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

/// One request of the audit log, as far as the figures need it.
#[derive(Debug)]
struct Request {
    verb: String,
    /// `resourceslices`, `nodes`, ….
    resource: String,
    /// The slice's name for a slice request.
    name: String,
    /// The request's path and query, as sent.
    uri: String,
    code: u64,
    received: SystemTime,
    done: SystemTime,
}

/// The drivers' requests, one entry each (a watch's first: when it started).
fn requests(cp: &ControlPlane) -> Vec<Request> {
    let time = |v: &Value| {
        v.as_str()
            .and_then(|t| humantime::parse_rfc3339(t).ok())
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    cp.requests_of(USER)
        .iter()
        .map(|e| Request {
            verb: e["verb"].as_str().unwrap_or_default().to_string(),
            resource: e["objectRef"]["resource"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            uri: e["requestURI"].as_str().unwrap_or_default().to_string(),
            name: e["objectRef"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            code: e["responseStatus"]["code"].as_u64().unwrap_or(0),
            received: time(&e["requestReceivedTimestamp"]),
            done: time(&e["stageTimestamp"]),
        })
        .collect()
}

/// `requests` per hour over `took`, by verb: `"3.0 (watch 3.0)"`; `"none in 120 s"` when the
/// window saw none (a watch is renewed at its timeout: a shorter window may see no renewal).
fn per_hour(requests: &[&Request], took: Duration, scale: f64) -> String {
    if requests.is_empty() {
        return format!("none in {} s", took.as_secs());
    }
    let h = |n: usize| n as f64 * 3600.0 / took.as_secs_f64().max(0.001) * scale;
    let mut verbs = BTreeMap::<&str, usize>::new();
    for r in requests {
        *verbs.entry(r.verb.as_str()).or_default() += 1;
    }
    let by: Vec<String> = verbs
        .iter()
        .map(|(v, n)| format!("{v} {:.1}", h(*n)))
        .collect();
    format!("{:.1} ({})", h(requests.len()), by.join(", "))
}

/// Query parameter `key` of `uri`, as sent (percent-encoded).
fn query<'a>(uri: &'a str, key: &str) -> Option<&'a str> {
    uri.split_once('?')?
        .1
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// Requests per hour at rest with the watches counted from their `timeoutSeconds`: the API
/// server ends a quiet watch at its timeout and the driver opens the next, so each watch stream
/// (a resource and field selector among `since`'s watches, the drivers' requests since they
/// started) is one request per timeout of its last watch; the other requests as counted in
/// `window` over `took`. Scaled by `scale`, by verb, with the timeouts seen: `"1.0 (watch 1.0;
/// timeoutSeconds 3600)"`.
fn from_timeouts(since: &[&Request], window: &[&Request], took: Duration, scale: f64) -> String {
    let mut streams = BTreeMap::<(&str, &str), u64>::new();
    for r in since.iter().filter(|r| r.verb == "watch") {
        let Some(t) = query(&r.uri, "timeoutSeconds").and_then(|t| t.parse().ok()) else {
            continue;
        };
        let fields = query(&r.uri, "fieldSelector").unwrap_or_default();
        streams.insert((r.resource.as_str(), fields), t);
    }
    let mut verbs = BTreeMap::<&str, f64>::new();
    for t in streams.values() {
        *verbs.entry("watch").or_default() += 3600.0 / (*t).max(1) as f64 * scale;
    }
    for r in window.iter().filter(|r| r.verb != "watch") {
        *verbs.entry(r.verb.as_str()).or_default() +=
            3600.0 / took.as_secs_f64().max(0.001) * scale;
    }
    let timeouts: BTreeSet<u64> = streams.values().copied().collect();
    let by: Vec<String> = verbs.iter().map(|(v, n)| format!("{v} {n:.1}")).collect();
    format!(
        "{:.1} ({}; timeoutSeconds {})",
        verbs.values().sum::<f64>(),
        by.join(", "),
        timeouts
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER}")
}

/// Creates Node objects `nodes`.
fn create_nodes(cp: &ControlPlane, dir: &Path, nodes: &[String]) -> Result<()> {
    let items: Vec<Value> = nodes
        .iter()
        .map(|n| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}}))
        .collect();
    let file = dir.join("nodes.json");
    std::fs::write(
        &file,
        serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "List", "items": items}))?,
    )?;
    cp.kubectl(&["create", "-f", &file.to_string_lossy()])?;
    Ok(())
}

/// Starts a driver for each of `nodes`, the `i`th on `trees[i / PER_TREE]`.
fn start(
    b: &Bins,
    kubeconfig: &Path,
    logs: &Path,
    trees: &[SimDir],
    nodes: &[String],
) -> Result<Drivers> {
    let mut d = Drivers(Vec::new());
    for (i, node) in nodes.iter().enumerate() {
        let tree = &trees[i / PER_TREE];
        let child = Command::new(&b.dra)
            .arg("serve")
            .arg("--host-root")
            .arg(tree.root())
            .args(["--node-name", node])
            // Under the tree's root, as --host-root takes it: each driver's sockets apart.
            .args(["--kubelet-root", &format!("/var/lib/kubelet-{node}")])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .env_remove("HOST_ROOT")
            .env_remove("KUBECONFIG")
            .env_remove("KUBELET_ROOT")
            .env_remove("KUBELET_DIR")
            .env_remove("VGPU")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(logs.join(format!("{node}.log")))?)
            .spawn()
            .with_context(|| format!("starting {}", b.dra.display()))?;
        d.0.push(child);
    }
    Ok(d)
}

/// Waits until every one of `nodes` has had its slice applied at or after `since`; then
/// each one's apply, by node.
fn wait_applied<'a>(
    cp: &ControlPlane,
    nodes: &'a [String],
    since: SystemTime,
    logs: &Path,
) -> Result<BTreeMap<&'a str, Request>> {
    let t = Instant::now();
    loop {
        let mut got: BTreeMap<&str, Request> = BTreeMap::new();
        let wanted: BTreeMap<String, &str> =
            nodes.iter().map(|n| (slice_name(n), n.as_str())).collect();
        for r in requests(cp) {
            if r.verb == "patch"
                && (200..300).contains(&r.code)
                && r.done >= since
                && let Some(n) = wanted.get(&r.name)
            {
                got.entry(n).or_insert(r);
            }
        }
        if got.len() == nodes.len() {
            return Ok(got);
        }
        if t.elapsed() > PATIENCE {
            let missing: Vec<&String> = nodes
                .iter()
                .filter(|n| !got.contains_key(n.as_str()))
                .collect();
            let first = missing.first().map(|n| logs.join(format!("{n}.log")));
            bail!(
                "{} of {} drivers not applied in {PATIENCE:?} (first: {:?}):\n{}",
                missing.len(),
                nodes.len(),
                first,
                first
                    .as_ref()
                    .and_then(|p| std::fs::read_to_string(p).ok())
                    .unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn cpu(pid: u32) -> Result<f64> {
    procstat::sample(pid)
        .map(|s| s.cpu_seconds)
        .ok_or_else(|| anyhow!("the API server (pid {pid}) is gone"))
}

/// The median of `v`, and its largest.
fn median_max(mut v: Vec<Duration>) -> String {
    if v.is_empty() {
        return "–".into();
    }
    v.sort();
    format!(
        "{} / {}",
        fmt_duration(v[v.len() / 2]),
        fmt_duration(v[v.len() - 1])
    )
}

pub fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    need(&b.dra)?;
    let assets = Assets::load().map_err(|e| anyhow!("the cluster tier's assets: {e}"))?;
    let dir = tempfile::Builder::new()
        .prefix("gpu-vm-bench-api-")
        .tempdir()?;
    let logs = dir.path().join("drivers");
    std::fs::create_dir_all(&logs)?;
    let cp = ControlPlane::start(dir.path(), &assets, ControlPlaneOpts::default())?;
    let kubeconfig = cp.kubeconfig_for(USER, USER, &["system:masters"])?;
    let apiserver = cp
        .procs()
        .iter()
        .find(|p| p.name().contains("apiserver"))
        .and_then(|p| u32::try_from(p.pid()).ok())
        .context("no kube-apiserver process")?;
    let window = Duration::from_secs(cli.api_window_secs);
    let scale_window = Duration::from_secs(cli.api_scale_secs);

    r.line("### sandbox-dra and the API server");
    r.line("");
    r.line(format!(
        "`gpu-vm-bench --only dra-api`: sandbox-dra (node-sim 2xA10, passthrough: one slice) against a real kube-apiserver, its requests read from the audit log; over {} s at rest (`--resync-interval` 30 s), then {} s with a GPU hot-plugged or unplugged every minute. At rest the requests are counted, and also taken per hour from the watches' own `timeoutSeconds` (the API server ends a quiet watch at its timeout and the driver opens the next: one request per timeout per watch, which a window shorter than the timeout does not see). Then N drivers (own `--node-name`, Node, `--kubelet-root`; up to {PER_TREE} sharing a node-sim tree) at rest over {} s: the API server's CPU (less its own at rest, no driver) and the drivers' requests (counted, and by the watches' timeouts), per 100 drivers; and {} hot-plugs into the first tree: hot-plug → each of its drivers' apply answered, and that apply's time in the API server (audit), median / max.",
        window.as_secs(),
        window.as_secs(),
        scale_window.as_secs(),
        cli.api_hotplugs
    ));
    r.line("");

    // The API server alone.
    std::thread::sleep(SETTLE);
    let c0 = cpu(apiserver)?;
    let t0 = Instant::now();
    std::thread::sleep(scale_window);
    let idle_cores = (cpu(apiserver)? - c0) / t0.elapsed().as_secs_f64();

    // One driver: at rest, and a hot-plug every minute.
    let node = vec!["rest-0".to_string()];
    create_nodes(&cp, dir.path(), &node)?;
    let tree = vec![mount(&builtin("2xA10")?)];
    let since = SystemTime::now();
    let one = start(b, &kubeconfig, &logs, &tree, &node)?;
    wait_applied(&cp, &node, since, &logs)?;
    std::thread::sleep(SETTLE);
    let asked = requests(&cp).len();
    let t = Instant::now();
    std::thread::sleep(window);
    let all = requests(&cp);
    let rest: Vec<&Request> = all[asked..].iter().collect();
    let took = t.elapsed();
    let rest_line = per_hour(&rest, took, 1.0);
    let rest_timeouts = from_timeouts(&all.iter().collect::<Vec<_>>(), &rest, took, 1.0);
    let asked = asked + rest.len();
    let t = Instant::now();
    let mut plugged = false;
    while t.elapsed() < window {
        tree[0].control(if plugged { UNPLUG } else { HOTPLUG })?;
        plugged = !plugged;
        std::thread::sleep(Duration::from_secs(60).min(window.saturating_sub(t.elapsed())));
    }
    let busy = requests(&cp);
    let busy: Vec<&Request> = busy[asked..].iter().collect();
    let busy_line = per_hour(&busy, t.elapsed(), 1.0);
    if plugged {
        tree[0].control(UNPLUG)?;
    }
    drop(one);
    drop(tree);
    r.table(&["one driver", "requests per hour (by verb)"]);
    r.row(&["at rest".into(), rest_line]);
    r.row(&[
        "at rest, each watch once per its timeoutSeconds".into(),
        rest_timeouts,
    ]);
    r.row(&["a hot-plug or unplug every minute".into(), busy_line]);
    r.line("");

    r.table(&[
        "drivers",
        "API server CPU at rest (millicores)",
        "per 100 drivers",
        "requests per hour per 100 drivers",
        "the same, watches by their timeoutSeconds",
        "hot-plug → slice, median / max",
        "the apply in the API server",
        "driver RSS (median)",
    ]);
    r.row(&[
        "0".into(),
        format!("{:.1}", idle_cores * 1000.0),
        "–".into(),
        "–".into(),
        "–".into(),
        "–".into(),
        "–".into(),
        "–".into(),
    ]);
    let counts = if cli.api_drivers.is_empty() {
        vec![1, 50, 200]
    } else {
        cli.api_drivers.clone()
    };
    for n in counts {
        let nodes: Vec<String> = (0..n).map(|i| format!("n{n}-{i}")).collect();
        create_nodes(&cp, dir.path(), &nodes)?;
        let trees = (0..n.div_ceil(PER_TREE))
            .map(|_| builtin("2xA10").map(|t| mount(&t)))
            .collect::<Result<Vec<_>>>()?;
        let since = SystemTime::now();
        let started = requests(&cp).len();
        let drivers = start(b, &kubeconfig, &logs, &trees, &nodes)?;
        wait_applied(&cp, &nodes, since, &logs)?;
        std::thread::sleep(SETTLE);
        let asked = requests(&cp).len();
        let c = cpu(apiserver)?;
        let t = Instant::now();
        std::thread::sleep(scale_window);
        let cores = (cpu(apiserver)? - c) / t.elapsed().as_secs_f64();
        let took = t.elapsed();
        let all = requests(&cp);
        let at_rest: Vec<&Request> = all[asked..].iter().collect();
        let since_start: Vec<&Request> = all[started..].iter().collect();
        let mut rss: Vec<u64> = drivers
            .0
            .iter()
            .filter_map(|c| procstat::sample(c.id()).map(|s| s.rss_kib))
            .collect();
        rss.sort_unstable();
        // Hot-plugs into the first tree: each of its drivers applies its slice.
        let first: Vec<String> = nodes.iter().take(PER_TREE).cloned().collect();
        let (mut follow, mut apply) = (Vec::new(), Vec::new());
        for _ in 0..cli.api_hotplugs {
            let t0 = SystemTime::now();
            trees[0].control(HOTPLUG)?;
            for (_, a) in wait_applied(&cp, &first, t0, &logs)? {
                follow.push(a.done.duration_since(t0).unwrap_or_default());
                apply.push(a.done.duration_since(a.received).unwrap_or_default());
            }
            let t1 = SystemTime::now();
            trees[0].control(UNPLUG)?;
            wait_applied(&cp, &first, t1, &logs)?;
        }
        drop(drivers);
        let extra = (cores - idle_cores).max(0.0);
        r.row(&[
            n.to_string(),
            format!("{:.1}", cores * 1000.0),
            format!("{:.1}", extra * 1000.0 * 100.0 / n as f64),
            per_hour(&at_rest, took, 100.0 / n as f64),
            from_timeouts(&since_start, &at_rest, took, 100.0 / n as f64),
            median_max(follow),
            median_max(apply),
            rss.get(rss.len() / 2)
                .map_or_else(|| "–".into(), |k| mib(*k)),
        ]);
    }
    r.line("");
    let distinct: BTreeSet<String> = requests(&cp)
        .iter()
        .filter(|q| q.verb != "watch")
        .map(|q| q.verb.clone())
        .collect();
    r.line(format!(
        "The drivers' verbs besides watch over the whole run: {}.",
        distinct.into_iter().collect::<Vec<_>>().join(", ")
    ));
    r.line("");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(verb: &str, resource: &str, uri: &str) -> Request {
        Request {
            verb: verb.into(),
            resource: resource.into(),
            name: String::new(),
            uri: uri.into(),
            code: 200,
            received: SystemTime::UNIX_EPOCH,
            done: SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn watches_count_once_per_timeout_of_their_last_renewal() {
        let slices = |n: &str, t: u32| {
            req(
                "watch",
                "resourceslices",
                &format!(
                    "/apis/resource.k8s.io/v1/resourceslices?allowWatchBookmarks=true&fieldSelector=spec.nodeName%3D{n}&resourceVersion=7&timeoutSeconds={t}&watch=true"
                ),
            )
        };
        let node = req(
            "watch",
            "nodes",
            "/api/v1/nodes?fieldSelector=metadata.name%3Da&timeoutSeconds=290&watch=true",
        );
        let list = req(
            "list",
            "resourceslices",
            "/apis/resource.k8s.io/v1/resourceslices",
        );
        let all = [
            slices("a", 290),
            slices("a", 3600),
            slices("b", 1800),
            node,
            list,
        ];
        let since: Vec<&Request> = all.iter().collect();
        // a's slices once an hour, b's twice, a's Node every 290 s; the list once in 120 s.
        let line = from_timeouts(&since, &since[4..], Duration::from_secs(120), 1.0);
        assert_eq!(
            line,
            "45.4 (list 30.0, watch 15.4; timeoutSeconds 290, 1800, 3600)"
        );
        assert_eq!(query(&all[0].uri, "timeoutSeconds"), Some("290"));
        assert_eq!(query(&all[0].uri, "watch"), Some("true"));
        assert_eq!(query(&all[0].uri, "timeout"), None);
        assert_eq!(query("/api/v1/nodes", "watch"), None);
    }
}
