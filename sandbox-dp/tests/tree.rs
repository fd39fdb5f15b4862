//! sandbox-dp as a process against plain sysfs-like trees built in a tempdir: cases node-sim
//! does not model (a `/dev/vfio/<group>` node removed and back, iommufd nodes, odd names).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::time::Duration;

use support::tree::*;
use support::*;
use testkit::kubelet::FakeKubelet;
use testkit::ops::{MetricsParser, free_addr, http_get, value, wait_for_status};

/// Held by the test that broadcasts an event naming no device (which makes every listening
/// daemon read its whole node) and by the tests that check a change was not read that way.
static NODE_WIDE_EVENTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_node_removed_is_unhealthy_and_back_is_healthy() {
    let _alone = NODE_WIDE_EVENTS.lock().await;
    let t = one_a10();
    t.add(&a10("0000:e2:00.0", 22));
    std::fs::write(t.vfio_node(22), "").unwrap();
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let _d = Daemon::start(&t.root, &kdir, &[]);
    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    assert_eq!(reg.resource_name, "nvidia.com/GA102GL_A10");
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut lw = plugin.list_and_watch().await.unwrap();
    let list = lw.next(DEADLINE).await.unwrap();
    assert_eq!(ids(&list), ["0000:01:00.0", "0000:e2:00.0"]);
    assert_eq!(list[0].health, "Healthy");
    assert_eq!(numa(&list[0]), [1]);

    // Specs are host paths, never under the host root.
    let resp = plugin.allocate(&[&["0000:01:00.0"]]).await.unwrap();
    assert_eq!(
        host_paths(&resp.container_responses[0]),
        ["/dev/vfio/vfio", "/dev/vfio/21"]
    );

    // A change no event announces: e2:00.0 leaves vfio-pci in sysfs only. A read of the node
    // would drop it from the list; the group node's change must not read the node. (Bus e2:
    // no node-sim topology uses it, so no other test's uevent names it.)
    t.set_driver("0000:e2:00.0", Some("nvidia"));

    std::fs::remove_file(t.vfio_node(21)).unwrap();
    let list = lw
        .wait_until(DEADLINE, |l| l[0].health == "Unhealthy")
        .await
        .unwrap();
    assert_eq!(
        ids(&list),
        ["0000:01:00.0", "0000:e2:00.0"],
        "the group node's removal read the node"
    );
    let e = plugin.allocate(&[&["0000:01:00.0"]]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("unhealthy"), "{}", e.message());
    assert!(e.message().contains("0000:01:00.0"), "{}", e.message());

    std::fs::write(t.vfio_node(21), "").unwrap();
    let list = lw
        .wait_until(DEADLINE, |l| l[0].health == "Healthy")
        .await
        .unwrap();
    assert_eq!(list.len(), 2);
    plugin.allocate(&[&["0000:01:00.0"]]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iommufd_nodes_are_handed_over_when_present() {
    let t = Tree::new();
    let dir = t.add(&a10("0000:01:00.0", 21));
    std::fs::create_dir_all(dir.join("vfio-dev/vfio3")).unwrap();
    std::fs::write(t.vfio_node(21), "").unwrap();
    std::fs::write(t.root.join("dev/iommu"), "").unwrap();
    std::fs::create_dir_all(t.root.join("dev/vfio/devices")).unwrap();
    std::fs::write(t.root.join("dev/vfio/devices/vfio3"), "").unwrap();
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let _d = Daemon::start(&t.root, &kdir, &[]);
    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let resp = plugin.allocate(&[&["0000:01:00.0"]]).await.unwrap();
    assert_eq!(
        host_paths(&resp.container_responses[0]),
        [
            "/dev/vfio/vfio",
            "/dev/vfio/21",
            "/dev/iommu",
            "/dev/vfio/devices/vfio3"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sriov_vgpu_vf_with_group_node_allocates_as_pci() {
    let t = Tree::new();
    t.add_h100_with_vgpu();
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let _d = Daemon::start(&t.root, &kdir, &[]);
    let name = "nvidia.com/NVIDIA_H100XM-4C";
    let reg = kubelet.wait_for(&[name], DEADLINE).await.unwrap()[name].clone();
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let list = plugin
        .list_and_watch()
        .await
        .unwrap()
        .next(DEADLINE)
        .await
        .unwrap();
    assert_eq!(ids(&list), ["0000:13:00.4"]);
    assert_eq!(list[0].health, "Healthy");
    let resp = plugin.allocate(&[&["0000:13:00.4"]]).await.unwrap();
    let c = &resp.container_responses[0];
    assert_eq!(
        c.envs
            .get("PCI_RESOURCE_NVIDIA_COM_NVIDIA_H100XM-4C")
            .map(String::as_str),
        Some("0000:13:00.4")
    );
    assert_eq!(host_paths(c), ["/dev/vfio/vfio", "/dev/vfio/130"]);
}

#[test]
fn long_and_colliding_names_are_reported_and_aliases_rename() {
    let t = Tree::new();
    t.add(&a10("0000:01:00.0", 21));
    t.add(&Func {
        device: 0x2237,
        ..a10("0000:02:00.0", 22)
    });
    // 2236 gets a 70-character name; 2237 and 2238 share one.
    let long = "X".repeat(70);
    let ids_file = t.root.join("pci.ids");
    std::fs::write(
        &ids_file,
        format!("10de  NVIDIA Corporation\n\t2236  {long}\n\t2237  Twin\n\t2238  Twin\n"),
    )
    .unwrap();
    t.add(&Func {
        device: 0x2238,
        ..a10("0000:03:00.0", 23)
    });
    let ids_arg = ids_file.to_str().unwrap();

    let out = run(&["list", "--json", "--pci-ids", ids_arg], &t.root);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = v["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["nvidia.com/TWIN"]);
    let problems = v["problems"].to_string();
    assert!(problems.contains("70 characters"), "{problems}");
    assert!(problems.contains("10de:2237, 10de:2238"), "{problems}");

    let out = run(
        &[
            "list",
            "--json",
            "--pci-ids",
            ids_arg,
            "--resource-alias",
            "10de:2236=A10",
            "--resource-alias",
            "10DE:2238=nvidia.com/TWIN_B",
        ],
        &t.root,
    );
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = v["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["nvidia.com/A10", "nvidia.com/TWIN", "nvidia.com/TWIN_B"]
    );
    assert_eq!(
        v["problems"].as_array().unwrap().len(),
        0,
        "{}",
        v["problems"]
    );

    let out = run(&["list", "--resource-alias", "nonsense"], &t.root);
    assert!(!out.status.success());
}

#[test]
fn companions_and_other_vendors_are_left_out() {
    let t = Tree::new();
    t.add(&a10("0000:01:00.0", 21));
    // HDMI audio of the same GPU, same group, on vfio-pci too.
    t.add(&Func {
        device: 0x1aef,
        class: 0x040300,
        ..a10("0000:01:00.1", 21)
    });
    // Another vendor's device on vfio-pci.
    t.add(&Func {
        vendor: 0x8086,
        device: 0x1572,
        class: 0x020000,
        ..a10("0000:05:00.0", 40)
    });
    // An NVIDIA GPU still on nvidia.
    t.add(&Func {
        driver: Some("nvidia"),
        ..a10("0000:06:00.0", 41)
    });
    let out = run(&["list", "--json"], &t.root);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let res = v["resources"].as_array().unwrap();
    assert_eq!(res.len(), 1, "{v}");
    let devs: Vec<&str> = res[0]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(devs, ["0000:01:00.0"]);
    // Unhealthy: no /dev/vfio/21 in this tree.
    assert_eq!(res[0]["devices"][0]["health"], "Unhealthy");

    let out = run(&["list", "--json", "--vendor", "8086"], &t.root);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["resources"][0]["name"], "nvidia.com/1572");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_devices_allocations_and_registrations() {
    let parser = tokio::task::spawn_blocking(|| {
        MetricsParser::install(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")))
    })
    .await
    .unwrap();
    let t = one_a10();
    let (_k, kdir) = kubelet_dir();
    let addr = free_addr();
    let _d = Daemon::start(&t.root, &kdir, &["--metrics-addr", &addr]);
    // No kubelet yet: alive, not ready.
    let a = addr.clone();
    let probes = tokio::task::spawn_blocking(move || {
        assert!(wait_for_status(&a, "/healthz", 200, DEADLINE));
        http_get(&a, "/readyz").unwrap().0
    });
    assert_eq!(probes.await.unwrap(), 503);
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    plugin.allocate(&[&["0000:01:00.0"]]).await.unwrap();
    plugin.allocate(&[&["0000:09:00.0"]]).await.unwrap_err();
    let a = addr.clone();
    let (ready, (code, body)) = tokio::task::spawn_blocking(move || {
        (
            wait_for_status(&a, "/readyz", 200, DEADLINE),
            http_get(&a, "/metrics").unwrap(),
        )
    })
    .await
    .unwrap();
    assert!(ready, "not ready after registering");
    assert_eq!(code, 200, "{body}");
    let r = "resource=\"nvidia.com/GA102GL_A10\"";
    for line in [
        format!("sandbox_dp_devices{{{r},health=\"Healthy\"}} 1\n"),
        format!("sandbox_dp_allocations_total{{{r}}} 1\n"),
        format!("sandbox_dp_allocation_errors_total{{{r}}} 1\n"),
        format!("sandbox_dp_registrations_total{{{r}}} 1\n"),
    ] {
        assert!(body.contains(&line), "{line} missing from\n{body}");
    }
    if let Some(parser) = parser {
        let samples = parser
            .parse(&body)
            .unwrap_or_else(|e| panic!("{e}\n{body}"));
        let res = ("resource", "nvidia.com/GA102GL_A10");
        assert_eq!(
            value(
                &samples,
                "sandbox_dp_devices",
                &[res, ("health", "Unhealthy")]
            ),
            Some(0.0)
        );
        assert_eq!(
            value(&samples, "sandbox_dp_registrations_total", &[res]),
            Some(1.0)
        );
        assert_eq!(
            value(&samples, "sandbox_dp_on_demand_vgpus_created_total", &[]),
            Some(0.0)
        );
        assert!(value(&samples, "process_resident_memory_bytes", &[]) > Some(0.0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_task_ends_the_process_non_zero() {
    let t = one_a10();
    let (_k, kdir) = kubelet_dir();
    let _kubelet = FakeKubelet::start(&kdir).await.unwrap();
    // The metrics address is taken: that task fails, the process must exit with an error.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let mut d = Daemon::start(&t.root, &kdir, &["--metrics-addr", &addr]);
    let status = d.wait(DEADLINE).expect("sandbox-dp kept running");
    assert!(!status.success(), "{status:?}");
}

#[test]
fn help_explains_flags() {
    let out = std::process::Command::new(BIN)
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    // What every binary takes is checked by tests/cli-shape; these are sandbox-dp's own.
    for flag in [
        "--pci-ids",
        "--resource-alias",
        "--resync-interval",
        "--on-demand",
        "permitted-devices",
        "list",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_run_registers_and_stops_cleanly() {
    let t = one_a10();
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let config = sandbox_dp::Config {
        kubelet_dir: kdir.clone(),
        discover: sandbox_dp::discovery::DiscoverConfig {
            vendor: Some(0x10de),
            pci_ids: common::PciIds::embedded(),
            aliases: Default::default(),
            pool: None,
        },
        metrics_addr: None,
        resync_interval: Duration::from_secs(3600),
        debounce: Duration::from_millis(50),
        on_demand_poll: Duration::from_secs(1),
        node_name: None,
        kubeconfig: None,
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(sandbox_dp::run(
        config,
        common::HostPaths::new(&t.root),
        stop.clone(),
    ));
    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    let sock = kdir.join(&reg.endpoint);
    assert!(sock.exists());
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut lw = plugin.list_and_watch().await.unwrap();
    lw.next(DEADLINE).await.unwrap();
    stop.cancel();
    let res = tokio::time::timeout(DEADLINE, run).await.unwrap().unwrap();
    assert!(res.is_ok(), "{res:?}");
    assert!(!sock.exists());
    // The open ListAndWatch stream ended with the server.
    assert!(lw.next(DEADLINE).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_registration_is_retried() {
    let t = one_a10();
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    kubelet.reject_with(Some("resource name taken"));
    let mut d = Daemon::start(&t.root, &kdir, &[]);
    let end = std::time::Instant::now() + DEADLINE;
    while kubelet.rejected() == 0 && std::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(kubelet.rejected() > 0, "no registration attempt");
    assert!(
        d.wait(Duration::from_millis(0)).is_none(),
        "exited on a refusal"
    );
    kubelet.reject_with(None);
    kubelet
        .wait_for(&["nvidia.com/GA102GL_A10"], DEADLINE)
        .await
        .unwrap();
}

/// Sends a uevent until `lw` shows a list satisfying `pred` (the first send may go out before
/// the daemon listens on a slow machine; a repeat names the same device again).
async fn announce_until(
    lw: &mut testkit::kubelet::ListWatch,
    event: (&str, &str, &str),
    pred: impl Fn(&[testkit::kubelet::api::Device]) -> bool,
) -> Vec<testkit::kubelet::api::Device> {
    let end = std::time::Instant::now() + DEADLINE;
    loop {
        testkit::uevent::send(event.0, event.1, event.2).unwrap();
        match lw.wait_until(Duration::from_millis(500), &pred).await {
            Ok(l) => return l,
            Err(e) if std::time::Instant::now() > end => panic!("{e:#}"),
            Err(_) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uevent_reads_again_the_device_it_names_and_only_it() {
    if !may_send_uevents("uevent test of sandbox-dp") {
        return;
    }
    let _alone = NODE_WIDE_EVENTS.lock().await;
    // e2:00.0 is advertised; e1:00.0 and e3:00.0 are on nvidia (their group nodes exist).
    let t = Tree::new();
    for (bdf, group, driver) in [
        ("0000:e1:00.0", 21, "nvidia"),
        ("0000:e2:00.0", 22, "vfio-pci"),
        ("0000:e3:00.0", 23, "nvidia"),
    ] {
        t.add(&Func {
            driver: Some(driver),
            ..a10(bdf, group)
        });
        std::fs::write(t.vfio_node(group), "").unwrap();
    }
    let (_k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let _d = Daemon::start(&t.root, &kdir, &[]);
    let reg = kubelet.next_registration(DEADLINE).await.unwrap();
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut lw = plugin.list_and_watch().await.unwrap();
    // The daemon has read the node: what follows can only be seen through events (its resync
    // is an hour, and no file watch covers sysfs).
    assert_eq!(ids(&lw.next(DEADLINE).await.unwrap()), ["0000:e2:00.0"]);

    // Two sysfs-only changes, one event: the device it names is read again, the other not.
    t.set_driver("0000:e1:00.0", Some("vfio-pci"));
    t.set_driver("0000:e3:00.0", Some("vfio-pci"));
    let dp = |bdf: &str| format!("/devices/pci0000:00/0000:00:01.0/{bdf}");
    let (dp_e1, dp_e3) = (dp("0000:e1:00.0"), dp("0000:e3:00.0"));
    let list = announce_until(&mut lw, ("bind", &dp_e1, "pci"), |l| l.len() > 1).await;
    assert_eq!(
        ids(&list),
        ["0000:e1:00.0", "0000:e2:00.0"],
        "the event for e1:00.0 read more than e1:00.0"
    );
    announce_until(&mut lw, ("bind", &dp_e3, "pci"), |l| l.len() == 3).await;

    // An event no device explains (a driver module): the whole node is read again.
    t.set_driver("0000:e2:00.0", Some("nvidia"));
    announce_until(
        &mut lw,
        ("add", "/bus/pci/drivers/nvidia", "drivers"),
        |l| ids(l) == ["0000:e1:00.0", "0000:e3:00.0"],
    )
    .await;
}

#[test]
fn json_logs_are_json_and_a_bad_root_fails_naming_the_path() {
    let (_k, kdir) = kubelet_dir();
    let out = std::process::Command::new(BIN)
        .args(["--log-format", "json", "--host-root", "/nonexistent-root"])
        .arg("--kubelet-dir")
        .arg(&kdir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let err = lines
        .iter()
        .find(|v| v["level"] == "ERROR")
        .expect("an ERROR line");
    let msg = err["fields"]["message"].as_str().unwrap();
    assert!(
        msg.contains("/nonexistent-root/sys/bus/pci/devices"),
        "{msg}"
    );
}
