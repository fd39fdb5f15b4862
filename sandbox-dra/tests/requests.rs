//! What sandbox-dra asks of a real API server (etcd and kube-apiserver, every request in its
//! audit log), as a process on a simulated node (node-sim) with a vGPU pool of several slices:
//!
//! - at start, one list of the node's slices, one read (GET) of its Node, and its writes; at
//!   rest, nothing but the watch of the node's slices, which asks the API server to keep it
//!   open for an hour (`timeoutSeconds=3600`): passes run every second (`--resync-interval 1s`,
//!   counted by `sandbox_dra_publish_passes_total`), and none of them sends a request; the Node
//!   is not read again, nor watched;
//! - a GPU hot-plugged (`--pool-per-gpu`) costs one apply per slice of its own pool (devices,
//!   counters), each once, and nothing else: no list, no get, no delete, no write to the other
//!   GPUs' pools;
//! - a write the API server refuses is tried again on the backoff, not at every resync; one
//!   to an API server that is down is tried at every resync, and lands once it is back.
//!
//! Requests are counted, never timed. The driver runs as a user of its own, so the audit log's
//! entries for that user are its requests. Watch requests (verb `watch`) are counted apart: the
//! driver opens one again when the API server ends the last (after its hour), from where it was
//! (a list again only after a 410 Gone, which a watch resumed from its last bookmark does not
//! get); nothing else is.
//! `AT_REST_SECS` keeps the driver at rest longer and prints its requests per hour, watches
//! included (for BENCHMARKS.md). Needs the cluster tier's assets (`tests/cluster/prepare.sh`);
//! skipped without them, a failure with `CLUSTER_TIER=required`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::time::{Duration, Instant};

use cluster_tier::ApiServer;
use serde_json::Value;
use support::{DRIVER, Driver, NODE, command};

/// The user the driver authenticates as.
const USER: &str = "sandbox-dra";
/// The `timeoutSeconds` the driver's watch asks for.
const WATCH_TIMEOUT: &str = "3600";
/// A generous deadline for what should happen within seconds on a busy machine.
const PATIENCE: Duration = Duration::from_secs(90);

/// The driver's requests in the audit log, in order, watches left out. Each: verb (`patch (dry
/// run)` for a dry run), resource, name.
fn requests(api: &ApiServer) -> Vec<(String, String, String)> {
    api.requests_of(USER)
        .iter()
        .filter(|e| e["verb"] != "watch")
        .map(|e| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
            let dry = s(&e["requestURI"]).contains("dryRun=All");
            (
                format!("{}{}", s(&e["verb"]), if dry { " (dry run)" } else { "" }),
                s(&e["objectRef"]["resource"]),
                s(&e["objectRef"]["name"]),
            )
        })
        .collect()
}

/// Query parameter `key` of `uri`, as sent.
fn query<'a>(uri: &'a str, key: &str) -> Option<&'a str> {
    uri.split_once('?')?
        .1
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// `sandbox_dra_publish_passes_total{result}` now.
fn passes(addr: &str, result: &str) -> u64 {
    let sample = format!("sandbox_dra_publish_passes_total{{result=\"{result}\"}}");
    testkit::ops::metric(addr, &sample).unwrap_or(0.0) as u64
}

/// Waits until `n` more passes found nothing to write.
fn wait_for_passes(addr: &str, n: u64, d: &Driver) {
    let from = passes(addr, "unchanged");
    let t = Instant::now();
    while passes(addr, "unchanged") < from + n {
        assert!(
            t.elapsed() < PATIENCE,
            "not {n} passes in {PATIENCE:?}:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The node's slices of the driver, as the API server holds them.
fn slices(api: &ApiServer) -> Vec<Value> {
    let v = api
        .get_json(&[
            "resourceslices",
            "--field-selector",
            &format!("spec.nodeName={NODE},spec.driver={DRIVER}"),
        ])
        .unwrap();
    v["items"].as_array().cloned().unwrap_or_default()
}

/// The node's slices once each pool is whole (as many as each says, one generation) and `f`
/// holds.
fn wait_for_pool(
    api: &ApiServer,
    d: &Driver,
    what: &str,
    f: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let t = Instant::now();
    loop {
        let s = slices(api);
        if support::whole_pools(&s) && f(&s) {
            return s;
        }
        assert!(t.elapsed() < PATIENCE, "{what}: {s:#?}\n{}", d.log());
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn counter_sets(s: &[Value]) -> Vec<String> {
    s.iter()
        .filter_map(|s| s["spec"]["sharedCounters"].as_array())
        .flatten()
        .map(|c| c["name"].as_str().unwrap_or_default().to_string())
        .collect()
}

fn names(s: &[Value]) -> Vec<String> {
    let mut n: Vec<String> = s
        .iter()
        .map(|s| {
            s["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    n.sort();
    n
}

/// The driver on `sim`'s node as `USER` through `groups`, a pass every second, logging at
/// debug, with `args`; its metrics address.
fn start(
    sim: &testkit::sim::SimDir,
    api: &ApiServer,
    groups: &[&str],
    args: &[&str],
) -> (Driver, String) {
    let kubeconfig = api.kubeconfig_for(USER, USER, groups).unwrap();
    let metrics = testkit::ops::free_addr();
    let mut all = vec!["--resync-interval", "1s", "--metrics-addr", &metrics];
    all.extend(args);
    let mut cmd = command(sim.root(), NODE, &kubeconfig, &all);
    cmd.env("RUST_LOG", "sandbox_dra=debug");
    (Driver::spawn(cmd), metrics)
}

#[test]
fn at_rest_the_driver_asks_nothing_and_a_hotplug_costs_one_apply_per_slice_of_its_pool() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(api) = ApiServer::start_or_skip("sandbox-dra's requests").unwrap() else {
        return;
    };
    api.create_node(NODE, &[]).unwrap();
    let (d, metrics) = start(
        &sim,
        &api,
        &["system:masters"],
        &["--vgpu", "all", "--pool-per-gpu"],
    );

    let before = wait_for_pool(&api, &d, "the pool never published", |s| {
        counter_sets(s).len() == 2
    });
    // A pool of two slices (devices, counters) per GPU; the node's own has nothing.
    assert_eq!(before.len(), 2 * 2, "{before:#?}");
    // Its own writes seen back on the watch.
    wait_for_passes(&metrics, 1, &d);

    // The audit log shows the driver's requests: the list of its slices, the read of its Node, a
    // dry run asking whether the API server keeps what a vGPU pool needs, and one apply per
    // slice.
    let start = requests(&api);
    assert_eq!(
        start
            .iter()
            .filter(|(v, _, _)| v == "patch (dry run)")
            .count(),
        1,
        "{start:?}"
    );
    for (verb, resource) in [("list", "resourceslices"), ("get", "nodes")] {
        assert_eq!(
            start
                .iter()
                .filter(|(v, r, _)| (v.as_str(), r.as_str()) == (verb, resource))
                .count(),
            1,
            "{verb} {resource}: {start:?}"
        );
    }
    let applied = start.iter().filter(|(v, _, _)| v == "patch").count();
    assert_eq!(applied, before.len(), "{start:?}");
    assert_eq!(
        start.iter().filter(|(_, r, _)| r == "nodes").count(),
        1,
        "the Node read once: {start:?}"
    );

    // At rest: passes, and no request.
    let asked = start.len();
    let all_asked = api.requests_of(USER).len();
    let rest = Instant::now();
    wait_for_passes(&metrics, 5, &d);
    std::thread::sleep(testkit::ops::at_rest().saturating_sub(rest.elapsed()));
    testkit::ops::report_at_rest(
        "sandbox-dra",
        &api.requests_of(USER).split_off(all_asked),
        rest.elapsed(),
    );
    let at_rest = requests(&api)[asked..].to_vec();
    assert_eq!(
        at_rest,
        [],
        "requests at rest besides the watch\n{}",
        d.log()
    );
    assert_eq!(passes(&metrics, "failed"), 0, "{}", d.log());
    // The watches: of the node's slices only, each asking for the hour; the Node not watched.
    let watches: Vec<(String, String)> = api
        .requests_of(USER)
        .iter()
        .filter(|e| e["verb"] == "watch")
        .map(|e| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
            (s(&e["objectRef"]["resource"]), s(&e["requestURI"]))
        })
        .collect();
    assert!(!watches.is_empty(), "no watch in the audit log");
    for (resource, uri) in &watches {
        assert_eq!(resource, "resourceslices", "{watches:#?}");
        assert!(
            uri.contains("allowWatchBookmarks=true"),
            "a watch without bookmarks: {uri}"
        );
        assert_eq!(
            query(uri, "timeoutSeconds"),
            Some(WATCH_TIMEOUT),
            "a watch the API server ends before the hour: {uri}"
        );
    }

    // A GPU hot-plugged: it joins the vGPU pool, in a pool of its own; the others stay.
    let asked = requests(&api).len();
    sim.control("hotplug 0000:81:00.0 A10 group=50 numa=1")
        .unwrap();
    let after = wait_for_pool(&api, &d, "the hot-plugged GPU never joined the pool", |s| {
        counter_sets(s).contains(&"gpu-0000-81-00-0".to_string())
    });
    let pool_of = |s: &Value| s["spec"]["pool"]["name"].as_str().unwrap().to_string();
    let new_pool = format!("{NODE}/gpu-0000-81-00-0");
    let (new, old): (Vec<&Value>, Vec<&Value>) = after.iter().partition(|s| pool_of(s) == new_pool);
    assert_eq!(new.len(), 2, "{after:#?}");
    for s in old {
        let was = before
            .iter()
            .find(|b| b["metadata"]["name"] == s["metadata"]["name"]);
        assert_eq!(
            was.map(|b| &b["spec"]["pool"]["generation"]),
            Some(&s["spec"]["pool"]["generation"]),
            "{s:#}"
        );
    }
    // Settled: passes that found nothing more to write.
    wait_for_passes(&metrics, 3, &d);
    let mut written = requests(&api)[asked..].to_vec();
    written.sort();
    let want: Vec<(String, String, String)> = names(&after)
        .into_iter()
        .filter(|n| n.contains("gpu-0000-81-00-0"))
        .map(|n| ("patch".to_string(), "resourceslices".to_string(), n))
        .collect();
    assert_eq!(
        written,
        want,
        "a hot-plug: one apply per slice of its pool, and nothing else\n{}",
        d.log()
    );
}

/// A write the API server refuses (RBAC lets the driver watch its slices and read its Node,
/// not write them) is tried again on the backoff (1 s doubling, each delay up to twice as long),
/// not at every resync: with `--resync-interval 1s`, 15 s after the first refusal at most 4
/// more tries where every tick would have made 15, while the ticks still read the node. Once
/// the write is allowed, a change to the node (a GPU hot-plugged) is published.
#[test]
fn a_refused_write_is_tried_again_on_the_backoff_not_at_every_resync() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(api) = ApiServer::start_or_skip("sandbox-dra's refused writes").unwrap() else {
        return;
    };
    api.create_node(NODE, &[]).unwrap();
    let read_only = "sandbox-dra-read-only";
    api.kubectl(&[
        "create",
        "clusterrole",
        read_only,
        "--verb=get,list,watch",
        "--resource=resourceslices.resource.k8s.io,nodes",
    ])
    .unwrap();
    api.kubectl(&[
        "create",
        "clusterrolebinding",
        read_only,
        &format!("--clusterrole={read_only}"),
        &format!("--user={USER}"),
    ])
    .unwrap();
    let (d, metrics) = start(&sim, &api, &[], &[]);
    let patches = || {
        requests(&api)
            .iter()
            .filter(|(v, r, _)| v == "patch" && r == "resourceslices")
            .count()
    };
    let t = Instant::now();
    while passes(&metrics, "failed") == 0 {
        assert!(t.elapsed() < PATIENCE, "no refused pass:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let refused = patches();
    assert!(refused >= 1, "the refused write is in the audit log");
    let held = |log: &str| log.matches("waits for its retry: nothing written").count();
    let held_before = held(&d.log());
    std::thread::sleep(Duration::from_secs(15));
    let again = patches() - refused;
    let log = d.log();
    assert!(
        again <= 4,
        "{again} more refused writes in 15 s: the resync repeats them\n{log}"
    );
    assert!(
        held(&log) >= held_before + 5,
        "the resync ticks went on reading the node:\n{log}"
    );
    assert!(slices(&api).is_empty());

    // Allowed now: a change to the node is published.
    api.kubectl(&[
        "create",
        "clusterrolebinding",
        "sandbox-dra-writes",
        "--clusterrole=cluster-admin",
        &format!("--user={USER}"),
    ])
    .unwrap();
    sim.control("hotplug 0000:81:00.0 A10 group=50 numa=1")
        .unwrap();
    wait_for_pool(&api, &d, "the pool never published once allowed", |s| {
        s.iter()
            .filter_map(|x| x["spec"]["devices"].as_array())
            .flatten()
            .any(|dev| dev["name"] == "gpu-0000-81-00-0")
    });
}

/// An API server that is down is not a refusal: the write is tried again at every resync
/// (each a failed pass while it is down), whatever the backoff has grown to, and a GPU
/// hot-plugged during the outage is published once the server is back.
#[test]
fn a_write_to_an_api_server_that_is_down_is_tried_at_every_resync() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(mut api) = ApiServer::start_or_skip("sandbox-dra through an outage").unwrap() else {
        return;
    };
    api.create_node(NODE, &[]).unwrap();
    let (d, metrics) = start(&sim, &api, &["system:masters"], &["--api-timeout", "1s"]);
    wait_for_pool(&api, &d, "the node never published", |s| !s.is_empty());

    api.stop_apiserver();
    sim.control("hotplug 0000:81:00.0 A10 group=50 numa=1")
        .unwrap();
    let failed = passes(&metrics, "failed");
    std::thread::sleep(Duration::from_secs(15));
    let during = passes(&metrics, "failed") - failed;
    // On the backoff alone (1, 2, 4, 8 s, each up to twice as long) at most 5.
    assert!(
        during >= 8,
        "{during} failed passes in 15 s of one-second resyncs\n{}",
        d.log()
    );
    api.start_apiserver().unwrap();
    wait_for_pool(&api, &d, "the hot-plugged GPU never published", |s| {
        s.iter()
            .filter_map(|x| x["spec"]["devices"].as_array())
            .flatten()
            .any(|dev| dev["name"] == "gpu-0000-81-00-0")
    });
}
