//! `vfio-manager daemon`'s operational side against node-sim and a real API server (etcd and
//! kube-apiserver): Events on the Node for a refusal and for the binds, as `kubectl get events`
//! shows them, no request at all while it refuses at every pass nor at rest once every GPU is
//! bound (counted in the API server's audit log; `AT_REST_SECS` keeps it at rest longer, for
//! BENCHMARKS.md), `/readyz` before and after every selected GPU is bound, systemd's
//! `READY=1`, and `/metrics` read by a real Prometheus parser.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::ops::{MetricsParser, NotifySocket, free_addr, http_get, value, wait_for_status};

const BIN: &str = env!("CARGO_BIN_EXE_vfio-manager");
const WAIT: Duration = Duration::from_secs(30);

fn driver(root: &Path, bdf: &str) -> Option<String> {
    let link = std::fs::read_link(root.join(format!("sys/bus/pci/devices/{bdf}/driver"))).ok()?;
    Some(link.file_name()?.to_string_lossy().into_owned())
}

/// Polls `f` until it holds, for at most [`WAIT`] (and as long as `AT_REST_SECS` besides).
fn wait_until(what: &str, f: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(
            start.elapsed() < WAIT + testkit::ops::at_rest(),
            "not within {WAIT:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_refusal_then_the_binds_are_told_counted_and_make_it_ready() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let parser = MetricsParser::install(Path::new(env!("CARGO_TARGET_TMPDIR")));
    let root = sim.root();
    // A CUDA job holds the first GPU's /dev/nvidia<N>: it is refused until the job ends.
    let held = testkit::sim::hold_nvidia_node(root, "0000:41:00.0");

    let Some(api) = cluster_tier::ApiServer::start_or_skip("vfio-manager's Events").unwrap() else {
        return;
    };
    api.create_node("node-v", &[]).unwrap();
    // Its own user, for its requests in the audit log.
    let user = "vfio-manager";
    let kubeconfig = api.kubeconfig_for(user, user, &["system:masters"]).unwrap();
    let notify = NotifySocket::new().unwrap();
    let addr = free_addr();
    let mut child = testkit::Reaped(
        Command::new(BIN)
            .arg("--host-root")
            .arg(root)
            .args(["daemon", "--resync-interval", "1", "--metrics-addr", &addr])
            .args(["--node-name", "node-v", "--kubeconfig"])
            .arg(&kubeconfig)
            .env("NOTIFY_SOCKET", notify.path())
            .env("RUST_LOG", "info")
            .env_remove("KUBELET_DIR")
            .env_remove("POD_RESOURCES_SOCKET")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    // Node events go to "default", as kubelet's do.
    let refused = api
        .wait_for_event("default", "BindRefused", WAIT)
        .expect("no BindRefused event");
    assert_eq!(refused["type"], "Warning");
    assert_eq!(refused["involvedObject"]["kind"], "Node");
    assert_eq!(refused["involvedObject"]["name"], "node-v");
    let note = refused["message"].as_str().unwrap();
    let me = format!("pid {}", held.pid());
    assert!(
        note.contains("0000:41:00.0") && note.contains(&me),
        "{note}"
    );
    let bound = api
        .wait_for_event("default", "GpusBound", WAIT)
        .expect("no GpusBound event");
    assert!(
        bound["message"].as_str().unwrap().contains("0000:61:00.0"),
        "{bound}"
    );
    // Not every selected GPU is bound: alive, not ready.
    assert!(wait_for_status(&addr, "/healthz", 200, WAIT));
    assert_eq!(http_get(&addr, "/readyz").unwrap().0, 503);
    // The refusal is told once, not at every retry.
    std::thread::sleep(Duration::from_millis(2500));
    let events = api.events("default").unwrap();
    let refusals: Vec<_> = events
        .iter()
        .filter(|e| e["reason"] == "BindRefused")
        .collect();
    assert_eq!(refusals.len(), 1, "{events:?}");
    // Not repeated either: a repeat would be a series on the one Event (count 2 and more).
    assert!(
        refusals[0]["series"].is_null() && cluster_tier::quantity(&refusals[0]["count"]) <= 1,
        "{events:?}"
    );
    // Refusing at every pass, it asks the API server nothing: its passes run (the refusals
    // counter counts each), its requests in the audit log do not grow.
    let asked = api.requests_of(user).len();
    let refused = || testkit::ops::metric(&addr, "vfio_manager_refusals_total").unwrap_or(0.0);
    let before = refused();
    wait_until("three refusing passes", || refused() >= before + 3.0);
    let later: Vec<_> = api.requests_of(user).split_off(asked);
    assert!(
        later.is_empty(),
        "refusing at every pass it asked: {later:?}"
    );

    drop(held);
    let lines = notify
        .wait_for_line("READY=1", WAIT)
        .unwrap_or_else(|l| panic!("no READY=1; got {l:?}"));
    assert!(
        lines.contains(&"STATUS=2 of 2 selected functions bound".to_string()),
        "{lines:?}"
    );
    assert!(wait_for_status(&addr, "/readyz", 200, WAIT));
    assert_eq!(driver(root, "0000:41:00.0").as_deref(), Some("vfio-pci"));

    // Its bind told (the Event is written beside the pass that bound it)...
    wait_until("a GpusBound Event naming 0000:41:00.0", || {
        api.events("default").unwrap().iter().any(|e| {
            e["reason"] == "GpusBound"
                && e["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("0000:41:00.0"))
        })
    });
    // ...then at rest, every GPU bound, a pass every second: no request at all.
    let asked = api.requests_of(user).len();
    let passes = || testkit::ops::metric(&addr, "vfio_manager_passes_total").unwrap_or(0.0);
    let before = passes();
    let start = std::time::Instant::now();
    wait_until("three passes at rest", || {
        passes() >= before + 3.0 && start.elapsed() >= testkit::ops::at_rest()
    });
    let later: Vec<_> = api.requests_of(user).split_off(asked);
    testkit::ops::report_at_rest("vfio-manager", &later, start.elapsed());
    assert!(later.is_empty(), "at rest it asked: {later:?}");

    let (code, body) = http_get(&addr, "/metrics").unwrap();
    assert_eq!(code, 200);
    if let Some(parser) = parser {
        let samples = parser
            .parse(&body)
            .unwrap_or_else(|e| panic!("{e}\n{body}"));
        let v = |name: &str| value(&samples, name, &[]);
        assert_eq!(v("vfio_manager_binds_total"), Some(2.0), "{body}");
        assert_eq!(v("vfio_manager_devices_selected"), Some(2.0), "{body}");
        assert_eq!(v("vfio_manager_devices_bound"), Some(2.0), "{body}");
        assert!(v("vfio_manager_refusals_total") >= Some(1.0), "{body}");
        assert_eq!(v("vfio_manager_unbinds_total"), Some(0.0), "{body}");
        assert!(v("process_open_fds") > Some(0.0), "{body}");
        assert!(v("process_cpu_seconds_total") >= Some(0.0), "{body}");
    }
    assert_eq!(testkit::sigterm_and_wait(&mut child.0), Some(0));
}
