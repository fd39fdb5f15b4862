//! Node Events against a real API server (etcd and kube-apiserver), read as `kubectl get events`
//! and `kubectl describe node` show them: one Event per thing said, with a count; a different
//! note is an Event of its own; one create per Event in the audit log; and, with the API server
//! stopped, Events noted by the thousand are held bounded and the latest written once it is back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use cluster_tier::{Assets, ControlPlane, ControlPlaneOpts};
use daemon_kit::events::{NodeEvents, Tuning};
use serde_json::Value;

const NODE: &str = "node-e";
const WAIT: Duration = Duration::from_secs(60);

/// The Events of `default` about our Node, as `kubectl get events` lists them (core/v1).
fn events(cp: &ControlPlane) -> Vec<Value> {
    let out = cp
        .kubectl(&[
            "get",
            "events",
            "-n",
            "default",
            "--field-selector",
            &format!("involvedObject.name={NODE}"),
            "-o",
            "json",
        ])
        .unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    v["items"].as_array().cloned().unwrap_or_default()
}

/// How many times an Event was seen, as kubectl counts it: its series, else its count, else 1.
fn count(e: &Value) -> i64 {
    let series = cluster_tier::quantity(&e["series"]["count"]);
    let count = cluster_tier::quantity(&e["count"]);
    series.max(count).max(1)
}

/// `(reason, message, count)` of every Event, sorted.
fn shown(cp: &ControlPlane) -> Vec<(String, String, i64)> {
    let mut v: Vec<_> = events(cp)
        .iter()
        .map(|e| {
            (
                e["reason"].as_str().unwrap_or_default().to_string(),
                e["message"].as_str().unwrap_or_default().to_string(),
                count(e),
            )
        })
        .collect();
    v.sort();
    v
}

fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < WAIT, "waited {WAIT:?} for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn creates_of_events(cp: &ControlPlane) -> usize {
    let text = std::fs::read_to_string(cp.audit_log()).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| {
            e["stage"] == "ResponseComplete"
                && e["objectRef"]["resource"] == "events"
                && e["verb"] == "create"
                && e["user"]["username"] == "admin"
        })
        .count()
}

#[test]
fn events_aggregate_what_says_the_same_and_wait_bounded_for_the_api_server() {
    let assets = match Assets::load() {
        Ok(a) => a,
        Err(why) => {
            cluster_tier::assets::skip("Node Events against a real API server", &why);
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cp = ControlPlane::start(dir.path(), &assets, ControlPlaneOpts::default()).unwrap();
    let node = format!(r#"{{"apiVersion":"v1","kind":"Node","metadata":{{"name":"{NODE}"}}}}"#);
    let f = dir.path().join("node.json");
    std::fs::write(&f, node).unwrap();
    cp.kubectl(&["create", "-f", f.to_str().unwrap()]).unwrap();

    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = rt
        .block_on(daemon_kit::kube::client(Some(cp.admin_kubeconfig())))
        .unwrap();
    let capacity = 32;
    let tuning = Tuning {
        capacity,
        write_gap: Duration::from_millis(300),
        retry_min: Duration::from_millis(100),
        retry_max: Duration::from_millis(500),
        ..Tuning::default()
    };
    let ev = {
        let _in = rt.enter();
        NodeEvents::start_tuned(client, NODE, "test-daemon", tuning)
    };

    // A node relabelled from A10-4Q to A10-8Q: one reason, two notes, two Events.
    let applied_4q = "vGPU profile A10-4Q applied: 12 vGPUs created, 0 removed, 0 kept";
    let applied_8q = "vGPU profile A10-8Q applied: 6 vGPUs created, 12 removed, 0 kept";
    ev.normal("ProfileApplied", "Apply", applied_4q);
    wait_for("the first ProfileApplied", || {
        (shown(&cp).len() == 1).then_some(())
    });
    ev.normal("ProfileApplied", "Apply", applied_8q);
    // The same refusal at every pass: one Event, counted.
    let blocked = "vGPU profile A10-8Q not applied: 0000:41:00.0: vGPU held by pid 778";
    for _ in 0..7 {
        ev.warning("ProfileBlocked", "Apply", blocked);
        std::thread::sleep(Duration::from_millis(40));
    }
    let want = vec![
        ("ProfileApplied".to_string(), applied_4q.to_string(), 1),
        ("ProfileApplied".to_string(), applied_8q.to_string(), 1),
        ("ProfileBlocked".to_string(), blocked.to_string(), 7),
    ];
    wait_for("three Events with their counts", || {
        (shown(&cp) == want).then_some(())
    });
    // Types as said.
    for e in events(&cp) {
        let t = if e["reason"] == "ProfileBlocked" {
            "Warning"
        } else {
            "Normal"
        };
        assert_eq!(e["type"], t, "{e}");
        assert_eq!(e["involvedObject"]["kind"], "Node", "{e}");
        assert_eq!(e["reportingComponent"], "gpu-vm-node/test-daemon", "{e}");
    }
    // One create per Event; the repeats were patches of its count.
    assert_eq!(creates_of_events(&cp), 3);
    // What an operator reads.
    let described = cp.kubectl(&["describe", "node", NODE]).unwrap();
    let line = |needle: &str| {
        described
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?}:\n{described}"))
            .to_string()
    };
    assert!(
        line("A10-8Q not applied").contains("(x7 over"),
        "{described}"
    );
    assert!(!line("A10-4Q applied").contains("(x"), "{described}");
    assert!(!line("A10-8Q applied").contains("(x"), "{described}");

    // The API server goes away; the daemon goes on noting Events, by the thousand.
    cp.stop_apiserver();
    let n = 5000;
    for i in 0..n {
        ev.warning("BindRefused", "Bind", format!("refusal {i}"));
    }
    // And one thing said five times, which waits as one Event.
    let away = "said five times while the API server was away";
    for _ in 0..5 {
        ev.warning("ProfileFailed", "Apply", away);
    }
    let held = ev.backlog();
    // Full of unsent Events; the three already written were forgotten first.
    assert_eq!(held.held, capacity, "{held:?}");
    assert_eq!(held.dropped, (n - capacity + 1) as u64, "{held:?}");
    cp.start_apiserver().unwrap();
    // Back: the latest are written (the oldest were dropped), nothing waits any more.
    wait_for("the latest refusal written", || {
        shown(&cp)
            .iter()
            .any(|(r, m, _)| r == "BindRefused" && m == &format!("refusal {}", n - 1))
            .then_some(())
    });
    wait_for("nothing unsent", || {
        (ev.backlog().unsent == 0).then_some(())
    });
    let refusals = shown(&cp)
        .into_iter()
        .filter(|(r, _, _)| r == "BindRefused")
        .count();
    assert_eq!(refusals, capacity - 1, "BindRefused Events");
    assert!(
        shown(&cp).contains(&("ProfileFailed".to_string(), away.to_string(), 5)),
        "{:?}",
        shown(&cp)
    );
    drop(ev);
}
