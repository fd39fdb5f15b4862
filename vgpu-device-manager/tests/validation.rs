//! Every validation error: exit status 2, a message naming the profile, the entry and the GPU,
//! and not one write in node-sim's operation log.

#![allow(clippy::unwrap_used)]

mod support;

use support::*;

const BAD: &str = r#"
version: v1
vgpu-configs:
  A10-4Q:
    - devices: all
      vgpu-devices: {"A10-4Q": 6}
  wrong-type:
    - devices: all
      vgpu-devices: {"T4-4Q": 4}
  too-many:
    - devices: [0]
      vgpu-devices: {"A10-4Q": 7}
    - devices: [1]
      vgpu-devices: {"A10-4Q": 6}
  mixed-sizes:
    - devices: [1]
      vgpu-devices: {"A10-4Q": 3, "A10-8Q": 1}
  same-size-over:
    - devices: [1]
      vgpu-devices: {"A10-4Q": 4, "A10-4C": 3}
  twice:
    - devices: all
      vgpu-devices: {"A10-4Q": 6}
    - devices: [1]
      device-filter: "0x223610DE"
      vgpu-devices: {"A10-8Q": 3}
"#;

/// Both A10s of 2xA10 have no VFs enabled, as node-sim starts them.
fn assert_no_vfs(root: &std::path::Path) {
    for pf in ["0000:41:00.0", "0000:61:00.0"] {
        let n =
            std::fs::read_to_string(root.join(format!("sys/bus/pci/devices/{pf}/sriov_numvfs")))
                .unwrap();
        assert_eq!(n.trim(), "0", "{pf}: VFs as found");
    }
}

#[test]
fn validation_errors_change_nothing() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // VFs enabled and the first GPU configured, so the types can be read and some vGPUs exist.
    let good = config_file(BAD);
    let f = good.path.to_str().unwrap();
    let o = run(root, &["apply", "-f", f, "-c", "A10-4Q"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let before = mdevs(root);

    let cases: &[(&str, &[&str])] = &[
        (
            "wrong-type",
            &[
                "profile \"wrong-type\" entry 0",
                "GPU 0 (0000:41:00.0, 10de:2236) cannot make \"T4-4Q\"",
                "A10-4Q",
            ],
        ),
        (
            "too-many",
            &[
                "profile \"too-many\" entry 0",
                "GPU 0 (0000:41:00.0",
                "at most 6 A10-4Q vGPUs, the entry asks for 7",
            ],
        ),
        (
            "mixed-sizes",
            &[
                "profile \"mixed-sizes\" entry 0",
                "GPU 1 (0000:61:00.0",
                "cannot mix A10-4Q and A10-8Q",
                "same framebuffer size",
            ],
        ),
        (
            "same-size-over",
            &[
                "profile \"same-size-over\" entry 0",
                "GPU 1",
                "at most 6",
                "asks for 7",
            ],
        ),
        (
            "twice",
            &[
                "profile \"twice\"",
                "GPU 1 (0000:61:00.0",
                "entry 0 and entry 1",
            ],
        ),
        (
            "no-such-profile",
            &[
                "no profile named \"no-such-profile\"",
                "A10-4Q, mixed-sizes",
            ],
        ),
    ];
    for (profile, want) in cases {
        sim.clear_ops();
        for cmd in ["apply", "plan", "assert"] {
            let o = run(root, &[cmd, "-f", f, "-c", profile]);
            assert_eq!(o.status.code(), Some(2), "{cmd} {profile}: {}", text(&o));
            let err = String::from_utf8_lossy(&o.stderr);
            for w in *want {
                assert!(err.contains(w), "{cmd} {profile}: missing {w:?} in\n{err}");
            }
        }
        assert!(sim.ops().is_empty(), "{profile}: {:?}", sim.ops());
        assert_eq!(mdevs(root), before, "{profile}");
    }

    // File-level errors: the YAML path and line.
    let files: &[(&str, &[&str])] = &[
        (
            "version: v1\nvgpu-configs:\n  p:\n    - devices: all\n      vgpu-device: {A10-4Q: 6}\n",
            &["vgpu-configs.p[0]", "unknown field `vgpu-device`", "line 5"],
        ),
        (
            "version: v1\nvgpu-configs:\n  p:\n    - devices: all\n      vgpu-devices: {\"A10 4Q\": 6}\n",
            &[
                "vgpu-configs.p[0].vgpu-devices",
                "\"A10 4Q\" is not a vGPU type",
                "line 5",
            ],
        ),
        (
            "version: v1\nvgpu-configs:\n  p:\n    - devices: all\n      vgpu-devices:\n        A10-4Q: 0\n",
            &["vgpu-configs.p[0].vgpu-devices", "at least 1", "line 6"],
        ),
        (
            "version: v1\nvgpu-configs:\n  p:\n    - devices: all\n      device-filter: 10DE\n      vgpu-devices: {A10-4Q: 6}\n",
            &["vgpu-configs.p[0].device-filter", "\"10DE\""],
        ),
    ];
    for (body, want) in files {
        sim.clear_ops();
        let c = config_file(body);
        let o = run(root, &["apply", "-f", c.path.to_str().unwrap(), "-c", "p"]);
        assert_eq!(o.status.code(), Some(2), "{body}: {}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(c.path.to_str().unwrap()), "{err}");
        for w in *want {
            assert!(err.contains(w), "missing {w:?} in\n{err}");
        }
        assert!(sim.ops().is_empty(), "{body}: {:?}", sim.ops());
    }
    assert_eq!(mdevs(root), before);
}

#[test]
fn t4_holds_one_type_at_a_time() {
    let Some(sim) = testkit::sim::try_mount("4xT4") else {
        return;
    };
    let root = sim.root();
    let c = config_file(
        "version: v1\nvgpu-configs:\n  p:\n    - devices: [2]\n      vgpu-devices: {T4-4Q: 2, T4-4A: 2}\n",
    );
    let o = run(root, &["apply", "-f", c.path.to_str().unwrap(), "-c", "p"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("profile \"p\" entry 0"), "{err}");
    assert!(err.contains("GPU 2 (0000:86:00.0"), "{err}");
    assert!(err.contains("one vGPU type at a time"), "{err}");
    assert!(sim.ops().is_empty(), "{:?}", sim.ops());
}

#[test]
fn a_fresh_gpu_is_checked_against_its_model_before_any_vf_is_enabled() {
    // A GPU without VFs shows no types; what its model makes is known, so a profile that cannot
    // fit is refused with not one write.
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let c = config_file(
        r#"
version: v1
vgpu-configs:
  wrong-type:
    - devices: all
      vgpu-devices: {"T4-4Q": 4}
  no-such-size:
    - devices: [1]
      vgpu-devices: {"A10-5Q": 4}
  too-many:
    - devices: [0]
      vgpu-devices: {"A10-4Q": 7}
  mixed-sizes:
    - devices: [1]
      vgpu-devices: {"A10-4Q": 3, "A10-8Q": 1}
  same-size-over:
    - devices: [1]
      vgpu-devices: {"A10-4Q": 4, "A10-4C": 3}
  more-than-vfs:
    - devices: [0]
      vgpu-devices: {"nvidia-590": 33}
"#,
    );
    let f = c.path.to_str().unwrap();
    let cases: &[(&str, &[&str])] = &[
        (
            "wrong-type",
            &[
                "profile \"wrong-type\" entry 0: GPU 0 (0000:41:00.0, 10de:2236) cannot make \"T4-4Q\"",
                "such as A10-4Q",
            ],
        ),
        (
            "no-such-size",
            &[
                "GPU 1 (0000:61:00.0",
                "cannot make \"A10-5Q\"",
                "divides its 24 GiB",
            ],
        ),
        (
            "too-many",
            &[
                "GPU 0 (0000:41:00.0",
                "at most 6 A10-4Q vGPUs, the entry asks for 7",
            ],
        ),
        (
            "mixed-sizes",
            &[
                "GPU 1 (0000:61:00.0",
                "cannot mix A10-4Q and A10-8Q",
                "same framebuffer size",
            ],
        ),
        ("same-size-over", &["GPU 1", "at most 6", "asks for 7"]),
        (
            "more-than-vfs",
            &["GPU 0", "one per VF, 32 VFs", "asks for 33"],
        ),
    ];
    for (profile, want) in cases {
        for cmd in ["apply", "plan", "assert"] {
            let o = run(root, &[cmd, "-f", f, "-c", profile]);
            assert_eq!(o.status.code(), Some(2), "{cmd} {profile}: {}", text(&o));
            let err = String::from_utf8_lossy(&o.stderr);
            for w in *want {
                assert!(err.contains(w), "{cmd} {profile}: missing {w:?} in\n{err}");
            }
        }
        assert!(sim.ops().is_empty(), "{profile}: {:?}", sim.ops());
    }
    assert_no_vfs(root);
}

#[test]
fn a_type_only_sysfs_can_judge_is_checked_after_the_vfs_and_they_are_disabled_again() {
    // A type id is not in the model table: the VFs are enabled to read the types, and disabled
    // again when the type is not among them; no vGPU is created.
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let c = config_file(
        "version: v1\nvgpu-configs:\n  by-id:\n    - devices: all\n      vgpu-devices: {\"nvidia-999\": 2}\n",
    );
    let o = run(
        root,
        &["apply", "-f", c.path.to_str().unwrap(), "-c", "by-id"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot make \"nvidia-999\"; it offers A10-12A"),
        "{err}"
    );
    let ops = sim.ops();
    assert_eq!(ops.len(), 4, "{ops:?}");
    assert!(
        ops.iter().all(|o| o.path.ends_with("/sriov_numvfs")),
        "{ops:?}"
    );
    assert_eq!(
        ops.iter().filter(|o| o.value == "0").count(),
        2,
        "both GPUs' VFs disabled again: {ops:?}"
    );
    assert_no_vfs(root);
    assert!(mdevs(root).is_empty());
    // `plan` shows the VF step and writes nothing at all.
    let fresh = testkit::sim::try_mount("2xA10").unwrap();
    let o = run(
        fresh.root(),
        &["plan", "-f", c.path.to_str().unwrap(), "-c", "by-id"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("enable 32 VFs on 0000:41:00.0"));
    assert!(fresh.ops().is_empty());
}

#[test]
fn vendor_path_counts_are_checked_against_the_gpus_memory() {
    // The vendor path lists types without counts: H100XM-16C fits 5 times in 80 GiB. Asking for
    // 6 is refused before any write, whether the VFs exist yet or not.
    let Some(sim) = testkit::sim::try_mount("8xH100-sriov") else {
        return;
    };
    let root = sim.root();
    let c = config_file(
        r#"
version: v1
vgpu-configs:
  small:
    - devices: all
      vgpu-devices: {"H100XM-4C": 2}
  over:
    - devices: [3]
      vgpu-devices: {"H100XM-16C": 6}
"#,
    );
    let f = c.path.to_str().unwrap();
    let o = run(root, &["apply", "-f", f, "-c", "over"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("profile \"over\" entry 0: GPU 3")
            && err.contains("at most 5 H100XM-16C vGPUs, the entry asks for 6"),
        "{err}"
    );
    assert!(sim.ops().is_empty(), "{:?}", sim.ops());
    // With the VFs enabled and vGPUs on every GPU, the same is refused from what sysfs lists.
    let o = run(root, &["apply", "-f", f, "-c", "small"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    sim.clear_ops();
    let o = run(root, &["apply", "-f", f, "-c", "over"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("at most 5 H100XM-16C vGPUs, the entry asks for 6"),
        "{err}"
    );
    assert!(sim.ops().is_empty(), "{:?}", sim.ops());
}

#[test]
fn a_gpu_on_another_driver_is_named() {
    let Some(sim) = testkit::sim::try_mount("mixed") else {
        return;
    };
    let root = sim.root();
    let c = config_file(
        "version: v1\nvgpu-configs:\n  p:\n    - devices: all\n      device-filter: \"0x223610DE\"\n      vgpu-devices: {A10-4Q: 6}\n",
    );
    let o = run(root, &["apply", "-f", c.path.to_str().unwrap(), "-c", "p"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("profile \"p\" entry 0: GPU 1 (0000:1b:00.0, 10de:2236) cannot make vGPUs: it is bound to nouveau"),
        "{err}"
    );
    assert!(sim.ops().is_empty(), "{:?}", sim.ops());
}

#[test]
fn a_vendor_model_the_table_lacks_is_limited_by_its_largest_type() {
    // H200 is not in the model table: a free GPU lists every type, and the largest
    // (H200X-141C) gives its memory, so H200X-35C fits 4 times. Asking for 5 is refused before
    // any vGPU is made; 4 apply.
    if let Some(why) = testkit::sim::unavailable() {
        testkit::sim::skip_test("node-sim 1xH200", &why);
        return;
    }
    let topo = testkit::sim::Topology::parse(
        r#"
name = "1xH200"
description = "one H200, a model the planner's table does not list"
[[bridge]]
address = "0000:10:01.0"
numa = 0
[[device]]
address = "0000:11:00.0"
model = "H200"
bridge = "0000:10:01.0"
"#,
        "1xH200",
    )
    .unwrap();
    let sim = testkit::sim::mount_topology(&topo);
    let root = sim.root();
    let c = config_file(
        "version: v1\nvgpu-configs:\n  over:\n    - devices: all\n      vgpu-devices: {H200X-35C: 5}\n  fits:\n    - devices: all\n      vgpu-devices: {H200X-35C: 4}\n",
    );
    let f = c.path.to_str().unwrap();
    let o = run(root, &["apply", "-f", f, "-c", "over"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("at most 4 H200X-35C vGPUs, the entry asks for 5"),
        "{err}"
    );
    // Unknown model: its VFs were enabled to read the types, then disabled again; no vGPU.
    assert!(
        sim.ops().iter().all(|o| o.path.ends_with("/sriov_numvfs")),
        "{:?}",
        sim.ops()
    );
    assert!(vendor_vgpus(root).is_empty());
    let o = run(root, &["apply", "-f", f, "-c", "fits"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(vendor_vgpus(root).len(), 4);
}
