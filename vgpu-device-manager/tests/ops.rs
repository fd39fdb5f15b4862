//! The daemon's operational side against node-sim and a real API server (etcd and
//! kube-apiserver): `/metrics` read by a real Prometheus parser, `/readyz` before and after the
//! first successful apply, systemd's `READY=1`, Events on the Node for a refusal and for the
//! apply (as `kubectl get events` shows them; a relabel's apply an Event of its own), no
//! request at rest but its watch of the node (refused at every retry, and applied; counted in
//! the API server's audit log; `AT_REST_SECS` keeps it at rest longer, for BENCHMARKS.md), and
//! progress lines during a long apply.

#![allow(clippy::unwrap_used)]

mod support;

use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::*;
use testkit::ops::{MetricsParser, NotifySocket, free_addr, http_get, value, wait_for_status};

const WAIT: Duration = Duration::from_secs(60);

#[test]
fn metrics_readiness_notify_and_events_follow_the_applies() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let parser = MetricsParser::install(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")));
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    // A VM holds a vGPU of A10-4Q: switching to A10-8Q is refused until it goes.
    let group = apply_and_hold_a_vgpu(&sim, f, "A10-4Q", 778);

    let Some(api) = cluster_tier::ApiServer::start_or_skip("vgpu-device-manager's Events").unwrap()
    else {
        return;
    };
    api.create_node("node-m", &[("nvidia.com/vgpu.config", "A10-8Q")])
        .unwrap();
    // Its own user, for its requests in the audit log.
    let user = "vgpu-device-manager";
    let kubeconfig = api.kubeconfig_for(user, user, &["system:masters"]).unwrap();
    let notify = NotifySocket::new().unwrap();
    let addr = free_addr();
    let mut child = testkit::Reaped(
        Command::new(BIN)
            .args(["daemon", "--node-name", "node-m", "--kubeconfig"])
            .arg(&kubeconfig)
            .args(["-f", f, "--retry-min", "200ms", "--retry-max", "1s"])
            .args(["--metrics-addr", &addr, "--host-root"])
            .arg(root)
            .env("NOTIFY_SOCKET", notify.path())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    // Node events go to "default", as kubelet's do.
    let refused = api.wait_for_event("default", "ProfileBlocked", WAIT);
    let refused = refused.expect("no ProfileBlocked event");
    assert_eq!(refused["type"], "Warning");
    assert_eq!(refused["involvedObject"]["kind"], "Node");
    assert_eq!(refused["involvedObject"]["name"], "node-m");
    let note = refused["message"].as_str().unwrap();
    assert!(
        note.contains("A10-8Q") && note.contains("pid 778"),
        "{note}"
    );
    // Failing: alive, not ready.
    assert_eq!(http_get(&addr, "/readyz").unwrap().0, 503);
    assert_eq!(http_get(&addr, "/healthz").unwrap().0, 200);
    assert!(
        api.wait_for_label("node-m", "nvidia.com/vgpu.config.state", WAIT, |v| {
            v == Some("failed")
        })
    );

    // Refused at every retry, it asks the API server nothing but its watch of the node: its
    // passes run (each counted a failed apply), the state label and the Event are not written
    // again.
    let asked = api.requests_of(user).len();
    let failed = || {
        testkit::ops::metric(
            &addr,
            r#"vgpu_device_manager_applies_total{result="failed"}"#,
        )
        .unwrap_or(0.0)
    };
    let before = failed();
    let start = std::time::Instant::now();
    while failed() < before + 3.0 || start.elapsed() < testkit::ops::at_rest() {
        assert!(
            start.elapsed() < WAIT + testkit::ops::at_rest(),
            "no passes: {} failed applies",
            failed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let later = api.requests_of(user).split_off(asked);
    testkit::ops::report_at_rest("vgpu-device-manager, refused", &later, start.elapsed());
    assert!(
        later.iter().all(|r| r["verb"] == "watch"),
        "at rest it asked: {later:?}"
    );

    sim.control(&format!("release {group}")).unwrap();
    let lines = notify.wait_for_line("READY=1", WAIT);
    let lines = lines.unwrap_or_else(|l| panic!("no READY=1; got {l:?}"));
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("STATUS=profile A10-8Q applied")),
        "{lines:?}"
    );
    assert!(wait_for_status(&addr, "/readyz", 200, WAIT));
    let applied = api
        .wait_for_event("default", "ProfileApplied", WAIT)
        .unwrap();
    assert_eq!(applied["type"], "Normal");
    let note = applied["message"].as_str().unwrap();
    // The free GPU was switched by the refused pass already; this one switched the other.
    assert_eq!(
        note,
        "vGPU profile A10-8Q applied: 3 vGPUs created, 6 removed, 3 kept"
    );
    assert!(
        api.wait_for_label("node-m", "nvidia.com/vgpu.config.state", WAIT, |v| {
            v == Some("success")
        })
    );

    // Applied, at rest while others change the Node (kubelet's status, an administrator's
    // labels) and the config file is written again unchanged: nothing but the watch.
    let asked = api.requests_of(user).len();
    let start = std::time::Instant::now();
    for i in 0..3 {
        api.set_label("node-m", "example.com/other", Some(&i.to_string()))
            .unwrap();
        std::fs::write(&cfg.path, CONFIG).unwrap();
        std::thread::sleep(Duration::from_millis(500));
    }
    std::thread::sleep(testkit::ops::at_rest().saturating_sub(start.elapsed()));
    let later = api.requests_of(user).split_off(asked);
    testkit::ops::report_at_rest("vgpu-device-manager, applied", &later, start.elapsed());
    assert!(
        later.iter().all(|r| r["verb"] == "watch"),
        "at rest it asked: {later:?}"
    );

    let (code, body) = http_get(&addr, "/metrics").unwrap();
    assert_eq!(code, 200);
    if let Some(parser) = parser {
        let samples = parser
            .parse(&body)
            .unwrap_or_else(|e| panic!("{e}\n{body}"));
        let v = |name: &str, labels: &[(&str, &str)]| value(&samples, name, labels);
        assert_eq!(v("vgpu_device_manager_vgpus", &[]), Some(6.0), "{body}");
        // Both passes' changes count, the refused one's too.
        assert_eq!(
            v("vgpu_device_manager_vgpus_created_total", &[]),
            Some(6.0),
            "{body}"
        );
        // The 12 A10-4Q vGPUs of the first apply went.
        assert_eq!(
            v("vgpu_device_manager_vgpus_removed_total", &[]),
            Some(12.0),
            "{body}"
        );
        assert_eq!(
            v(
                "vgpu_device_manager_applies_total",
                &[("result", "success")]
            ),
            Some(1.0),
            "{body}"
        );
        assert!(v("vgpu_device_manager_applies_total", &[("result", "failed")]) >= Some(1.0));
        assert!(v("vgpu_device_manager_apply_duration_seconds_count", &[]) >= Some(2.0));
        assert!(
            v("process_resident_memory_bytes", &[]) > Some(0.0),
            "{body}"
        );
        assert!(v("process_start_time_seconds", &[]) > Some(1.0e9), "{body}");
    }

    // Relabelled back to A10-4Q: a ProfileApplied Event of its own, saying A10-4Q; the A10-8Q
    // one stays as it was, not counted for this apply.
    api.set_label("node-m", "nvidia.com/vgpu.config", Some("A10-4Q"))
        .unwrap();
    let applied = |events: &[serde_json::Value]| -> Vec<(String, i64)> {
        let mut v: Vec<_> = events
            .iter()
            .filter(|e| e["reason"] == "ProfileApplied")
            .map(|e| {
                let count = cluster_tier::quantity(&e["series"]["count"])
                    .max(cluster_tier::quantity(&e["count"]))
                    .max(1);
                (e["message"].as_str().unwrap_or_default().to_string(), count)
            })
            .collect();
        v.sort();
        v
    };
    let want = vec![
        (
            "vGPU profile A10-4Q applied: 12 vGPUs created, 6 removed, 0 kept".to_string(),
            1,
        ),
        (
            "vGPU profile A10-8Q applied: 3 vGPUs created, 6 removed, 3 kept".to_string(),
            1,
        ),
    ];
    let start = std::time::Instant::now();
    let mut seen = Vec::new();
    while start.elapsed() < WAIT {
        seen = applied(&api.events("default").unwrap());
        if seen == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(seen, want);
    assert_eq!(testkit::sigterm_and_wait(&mut child.0), Some(0));
}

/// 16 L40S, each behind its own root port.
fn sixteen_l40s() -> testkit::sim::Topology {
    let mut s = String::from("name = \"16xL40S\"\ndescription = \"generated\"\n");
    for i in 0..16 {
        let bus = 0x10 + 2 * i;
        let _ = write!(
            s,
            "[[bridge]]\naddress = \"0000:{bus:02x}:01.0\"\n\n\
             [[device]]\naddress = \"0000:{:02x}:00.0\"\nmodel = \"L40S\"\nbridge = \"0000:{bus:02x}:01.0\"\n\n",
            bus + 1
        );
    }
    testkit::sim::Topology::parse(&s, "16xL40S").unwrap()
}

#[test]
fn a_long_apply_tells_its_progress() {
    if let Some(why) = testkit::sim::unavailable() {
        testkit::sim::skip_test("node-sim 16xL40S", &why);
        return;
    }
    let sim = testkit::sim::mount_topology(&sixteen_l40s());
    let cfg = config_file(
        "version: v1\nvgpu-configs:\n  L40S-1Q:\n    - devices: all\n      vgpu-devices: {\"L40S-1Q\": 32}\n",
    );
    let o = run(
        sim.root(),
        &["apply", "-f", cfg.path.to_str().unwrap(), "-c", "L40S-1Q"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let progress: Vec<&str> = err
        .lines()
        .filter_map(|l| l.split_once("created ").map(|(_, p)| p))
        .filter(|p| p.ends_with("/512 vGPUs"))
        .collect();
    // Every 64 created (and every 2 s besides), never the last one (the summary says it).
    for step in (64..512).step_by(64) {
        assert!(
            progress.contains(&format!("{step}/512 vGPUs").as_str()),
            "no line for {step}: {progress:?}\n{err}"
        );
    }
    assert!(!progress.contains(&"512/512 vGPUs"), "{progress:?}");
    assert_eq!(vendor_vgpus(sim.root()).len(), 512);
}
