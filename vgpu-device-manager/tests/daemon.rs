//! `vgpu-device-manager daemon` as a process against node-sim and an API server: the fake
//! (`testkit::apiserver`) where a test follows labels and needs a conflict on cue, a real one
//! (etcd and kube-apiserver) for the GPU Operator's RBAC.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::*;
use testkit::apiserver::FakeApiServer;

const CONFIG_LABEL: &str = "nvidia.com/vgpu.config";
const STATE: &str = "nvidia.com/vgpu.config.state";
const REASON: &str = "nvidia.com/vgpu.config.state.reason";
const WAIT: Duration = Duration::from_secs(60);

/// A daemon that is stopped with SIGTERM when dropped.
struct Daemon(Child);

impl Daemon {
    fn stop(mut self) -> Option<i32> {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        self.0.wait().unwrap().code()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn daemon(root: &Path, args: &[&str]) -> Daemon {
    daemon_with_env(root, args, &[])
}

/// The daemon with `env` set, the variables a DaemonSet could set removed otherwise.
fn daemon_with_env(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Daemon {
    // One log per daemon: the tests of this file run in parallel in one process.
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let log = std::env::temp_dir().join(format!("vgpu-dm-daemon-{}-{n}.log", std::process::id()));
    Daemon(
        Command::new(BIN)
            .arg("daemon")
            .args(args)
            .args(["--retry-min", "200ms", "--retry-max", "1s", "--host-root"])
            .arg(root)
            .env_remove("NODE_NAME")
            .env_remove("KUBECONFIG")
            .env_remove("CONFIG_FILE")
            .env_remove("VGPU_DM_CONFIG_FILE")
            .env_remove("DEFAULT_VGPU_CONFIG")
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).map_or(Stdio::null(), Stdio::from))
            .spawn()
            .unwrap(),
    )
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A ConfigMap-style directory: `config.yaml -> ..data/config.yaml`, `..data -> ..vN`.
struct ConfigMapDir {
    dir: tempfile::TempDir,
    n: u32,
}

impl ConfigMapDir {
    fn new(text: &str) -> Self {
        let mut c = ConfigMapDir {
            dir: tempfile::tempdir().unwrap(),
            n: 0,
        };
        c.update(text);
        std::os::unix::fs::symlink("..data/config.yaml", c.dir.path().join("config.yaml")).unwrap();
        c
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("config.yaml")
    }

    /// What the kubelet does on a ConfigMap update: a new directory, then an atomic swap of
    /// the `..data` link.
    fn update(&mut self, text: &str) {
        self.n += 1;
        let v = format!("..v{}", self.n);
        std::fs::create_dir(self.dir.path().join(&v)).unwrap();
        std::fs::write(self.dir.path().join(&v).join("config.yaml"), text).unwrap();
        let tmp = self.dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(&v, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("..data")).unwrap();
    }
}

fn ready_file(root: &Path) -> PathBuf {
    root.join("run/nvidia/validations/vgpu-devices-ready")
}

fn counts(root: &Path) -> Vec<((String, String), usize)> {
    mdev_counts(root).into_iter().collect()
}

fn each(name: &str, n: usize) -> Vec<((String, String), usize)> {
    vec![
        (("0000:41:00.0".into(), name.into()), n),
        (("0000:61:00.0".into(), name.into()), n),
    ]
}

/// The daemon following node `node`'s label on `api`, with its config file at `file`.
fn daemon_for(root: &Path, api: &FakeApiServer, node: &str, file: &Path) -> Daemon {
    let kc = api.kubeconfig().to_str().unwrap().to_string();
    daemon(
        root,
        &[
            "--node-name",
            node,
            "--kubeconfig",
            &kc,
            "-f",
            file.to_str().unwrap(),
        ],
    )
}

#[test]
fn daemon_follows_the_label_and_the_config_file() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start("node-a", &[(CONFIG_LABEL, "A10-4Q")]).unwrap();
    let mut cm = ConfigMapDir::new(CONFIG);
    let d = daemon_for(root, &api, "node-a", &cm.path());

    // Label set at start: pending, then success, with the vGPUs and the readiness file.
    assert!(
        api.wait_for(STATE, WAIT, |v| v == Some("success")),
        "{:?}",
        api.label(STATE)
    );
    assert_eq!(counts(root), each("NVIDIA A10-4Q", 6));
    let h = api.label_history(STATE);
    assert_eq!(h.first(), Some(&Some("pending".to_string())), "{h:?}");
    let listed: Vec<_> = std::fs::read_dir(ready_file(root).parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(listed, ["vgpu-devices-ready"], "the readiness file alone");

    // Label changed: reconfigured.
    api.clear_history();
    api.set_label(CONFIG_LABEL, Some("A10-8Q"));
    wait_until("A10-8Q applied", || {
        api.label_history(STATE).last() == Some(&Some("success".into()))
    });
    assert_eq!(counts(root), each("NVIDIA A10-8Q", 3));
    assert_eq!(
        api.label_history(STATE),
        vec![Some("pending".into()), Some("success".into())]
    );

    // A profile the file does not have: failed, with the reason; the vGPUs stay.
    api.set_label(CONFIG_LABEL, Some("no-such-profile"));
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("failed")));
    let reason = api.annotation(REASON).unwrap_or_default();
    assert!(
        reason.contains("no profile named \"no-such-profile\""),
        "{reason}"
    );
    assert!(!ready_file(root).exists());
    assert_eq!(counts(root), each("NVIDIA A10-8Q", 3));

    // Back to a good profile: the reason goes away.
    api.set_label(CONFIG_LABEL, Some("A10-4Q"));
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("success")));
    assert_eq!(api.annotation(REASON), None);
    assert_eq!(counts(root), each("NVIDIA A10-4Q", 6));

    // The config file changes (ConfigMap symlink swap): re-applied.
    api.clear_history();
    cm.update(&CONFIG.replace("{\"A10-4Q\": 6}", "{\"A10-4Q\": 2}"));
    wait_until("the edited profile", || {
        counts(root) == each("NVIDIA A10-4Q", 2)
    });
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("success")));
    assert!(api.label_history(STATE).contains(&Some("pending".into())));

    assert_eq!(d.stop(), Some(0));
}

/// An API server that accepts and never answers does not stall the daemon: a config change is
/// applied (the node's vGPUs and readiness file follow it) while every state write goes
/// unanswered, and SIGTERM still ends it. A fake, since a real API server cannot be made to hang.
#[test]
fn a_hung_api_server_does_not_stall_the_apply_loop() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start("node-hang", &[(CONFIG_LABEL, "A10-4Q")]).unwrap();
    let mut cm = ConfigMapDir::new(CONFIG);
    let d = daemon_for(root, &api, "node-hang", &cm.path());
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("success")));
    assert_eq!(counts(root), each("NVIDIA A10-4Q", 6));

    api.hang();
    cm.update(&CONFIG.replace("{\"A10-4Q\": 6}", "{\"A10-4Q\": 2}"));
    wait_until(
        "the edited profile applied while the API server hangs",
        || counts(root) == each("NVIDIA A10-4Q", 2) && ready_file(root).exists(),
    );
    wait_until("a state write left unanswered", || api.hung_requests() > 0);
    assert_eq!(d.stop(), Some(0));
}

#[test]
fn node_without_label_gets_the_default_profile() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api = FakeApiServer::start("node-b", &[]).unwrap();
    let cfg = config_file(CONFIG);
    let kc = api.kubeconfig().to_str().unwrap().to_string();
    let d = daemon(
        root,
        &[
            "--node-name",
            "node-b",
            "--kubeconfig",
            &kc,
            "-f",
            cfg.path.to_str().unwrap(),
        ],
    );
    assert!(
        api.wait_for(STATE, WAIT, |v| v == Some("success")),
        "{:?}",
        api.label(STATE)
    );
    assert_eq!(counts(root), each("NVIDIA A10-12Q", 2));
    assert_eq!(d.stop(), Some(0));
}

/// The environment the GPU Operator's vgpu-device-manager DaemonSet gives its container, and
/// no flag: NODE_NAME, CONFIG_FILE, and DEFAULT_VGPU_CONFIG for a node without the label.
#[test]
fn the_operators_environment_alone_selects_node_file_and_default_profile() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // An empty label is no label (NVIDIA's daemon reads it the same way).
    let api = FakeApiServer::start("node-op", &[(CONFIG_LABEL, "")]).unwrap();
    let cm = ConfigMapDir::new(CONFIG);
    let file = cm.path();
    let d = daemon_with_env(
        root,
        &[],
        &[
            ("NODE_NAME", "node-op"),
            ("NAMESPACE", "gpu-operator"),
            ("KUBECONFIG", api.kubeconfig().to_str().unwrap()),
            ("CONFIG_FILE", file.to_str().unwrap()),
            ("DEFAULT_VGPU_CONFIG", "A10-8Q"),
        ],
    );
    assert!(
        api.wait_for(STATE, WAIT, |v| v == Some("success")),
        "{:?}",
        api.label(STATE)
    );
    assert_eq!(
        counts(root),
        each("NVIDIA A10-8Q", 3),
        "the default profile"
    );

    api.set_label(CONFIG_LABEL, Some("A10-4Q"));
    wait_until("the labelled profile", || {
        counts(root) == each("NVIDIA A10-4Q", 6)
    });
    api.set_label(CONFIG_LABEL, Some(""));
    wait_until("the default profile again", || {
        counts(root) == each("NVIDIA A10-8Q", 3)
    });
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("success")));
    assert_eq!(d.stop(), Some(0));
}

/// The GPU Operator's ClusterRole grants `update` on nodes, not `patch`: the state label is
/// still written, by a read and a replace, on a real API server under the operator's own RBAC.
#[test]
fn state_is_written_by_update_under_the_operators_rbac() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let Some(api) =
        cluster_tier::ApiServer::start_or_skip("vgpu-device-manager under the operator's RBAC")
            .unwrap()
    else {
        return;
    };
    let node = "node-rbac";
    api.create_node(node, &[(CONFIG_LABEL, "A10-4Q"), ("keep", "me")])
        .unwrap();
    api.apply_gpu_operator_rbac().unwrap();
    let sa = "system:serviceaccount:gpu-operator:nvidia-vgpu-device-manager";
    let kc = api
        .service_account_kubeconfig("gpu-operator", "nvidia-vgpu-device-manager")
        .unwrap();
    let history = api.watch_label(node, STATE).unwrap();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    let d = daemon(
        root,
        &[
            "--node-name",
            node,
            "--kubeconfig",
            kc.to_str().unwrap(),
            "-f",
            f,
        ],
    );
    assert!(
        api.wait_for_label(node, STATE, WAIT, |v| v == Some("success")),
        "{:?}",
        api.label(node, STATE)
    );
    assert_eq!(
        history.history(),
        vec![None, Some("pending".into()), Some("success".into())]
    );
    assert_eq!(
        api.label(node, "keep").as_deref(),
        Some("me"),
        "other labels kept"
    );
    assert_eq!(counts(root), each("NVIDIA A10-4Q", 6));

    // A failure's reason is an annotation: written and then removed the same way.
    api.set_label(node, CONFIG_LABEL, Some("no-such-profile"))
        .unwrap();
    assert!(api.wait_for_label(node, STATE, WAIT, |v| v == Some("failed")));
    let reason = api.annotation(node, REASON).unwrap_or_default();
    assert!(reason.contains("no-such-profile"), "{reason}");
    api.set_label(node, CONFIG_LABEL, Some("A10-4Q")).unwrap();
    assert!(api.wait_for_label(node, STATE, WAIT, |v| v == Some("success")));
    assert_eq!(api.annotation(node, REASON), None);

    // What the API server answered the daemon: one patch, refused; then replaces, accepted.
    let writes: Vec<_> = api
        .audited("nodes")
        .into_iter()
        .filter(|e| e["user"]["username"] == sa && e["verb"] != "get" && e["verb"] != "list")
        .filter(|e| e["verb"] != "watch")
        .map(|e| {
            (
                e["verb"].as_str().unwrap().to_string(),
                e["responseStatus"]["code"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        writes.first(),
        Some(&("patch".to_string(), 403)),
        "{writes:?}"
    );
    // (A replace that lost to `kubectl label` is a conflict, read again and retried.)
    assert!(
        writes[1..]
            .iter()
            .all(|(verb, code)| verb == "update" && (*code == 200 || *code == 409)),
        "{writes:?}"
    );
    assert!(
        writes.iter().filter(|w| w.1 == 200).count() >= 4,
        "pending, success, failed, success: {writes:?}"
    );
    assert_eq!(d.stop(), Some(0));
}

/// Another client's writes at exact moments between the daemon's read and its replace (which
/// a real API server cannot be made to interleave on cue): each conflict is read again and
/// retried, and the other client's labels survive.
#[test]
fn state_is_written_by_update_where_patch_is_forbidden() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let api =
        FakeApiServer::start("node-rbac", &[(CONFIG_LABEL, "A10-4Q"), ("keep", "me")]).unwrap();
    api.forbid_patch();
    // Another client writes the Node between the daemon's read and each of its first four
    // replaces: more conflicts in a row than the daemon's retries of a failed write (3), so
    // `pending` is written only if each replace is read again and retried on its conflict.
    api.race_puts(4);
    let cfg = config_file(CONFIG);
    let kc = api.kubeconfig().to_str().unwrap().to_string();
    let f = cfg.path.to_str().unwrap();
    let d = daemon(
        root,
        &["--node-name", "node-rbac", "--kubeconfig", &kc, "-f", f],
    );
    assert!(
        api.wait_for(STATE, WAIT, |v| v == Some("success")),
        "{:?}",
        api.label(STATE)
    );
    assert_eq!(
        api.label_history(STATE),
        vec![Some("pending".into()), Some("success".into())]
    );
    assert_eq!(
        api.label("keep").as_deref(),
        Some("me"),
        "other labels kept"
    );
    for k in ["raced-by-0", "raced-by-1", "raced-by-2", "raced-by-3"] {
        assert_eq!(
            api.label(k).as_deref(),
            Some("another-client"),
            "the other client's {k} survives the replace that came after it"
        );
    }
    assert_eq!(counts(root), each("NVIDIA A10-4Q", 6));

    // A failure's reason is an annotation: written and then removed the same way.
    api.set_label(CONFIG_LABEL, Some("no-such-profile"));
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("failed")));
    let reason = api.annotation(REASON).unwrap_or_default();
    assert!(reason.contains("no-such-profile"), "{reason}");
    api.set_label(CONFIG_LABEL, Some("A10-4Q"));
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("success")));
    assert_eq!(api.annotation(REASON), None);
    let patches = api
        .requests()
        .iter()
        .filter(|r| r.starts_with("PATCH /api/v1/nodes/"))
        .count();
    assert_eq!(
        patches,
        1,
        "one refused patch, then updates: {:?}",
        api.requests()
    );
    assert_eq!(d.stop(), Some(0));
}

#[test]
fn blocked_apply_fails_then_retries_to_success() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let f = cfg.path.to_str().unwrap();
    let group = apply_and_hold_a_vgpu(&sim, f, "A10-4Q", 777);

    let api = FakeApiServer::start("node-c", &[(CONFIG_LABEL, "A10-8Q")]).unwrap();
    let kc = api.kubeconfig().to_str().unwrap().to_string();
    let d = daemon(
        root,
        &["--node-name", "node-c", "--kubeconfig", &kc, "-f", f],
    );
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("failed")));
    let reason = api.annotation(REASON).unwrap_or_default();
    assert!(reason.contains("pid 777 (virt-launcher)"), "{reason}");
    // The VM goes away; a retry applies the rest.
    sim.control(&format!("release {group}")).unwrap();
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("success")));
    assert_eq!(counts(root), each("NVIDIA A10-8Q", 3));
    assert_eq!(api.annotation(REASON), None);
    assert_eq!(d.stop(), Some(0));
}

#[test]
fn selected_config_runs_without_kubernetes() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let cfg = config_file(CONFIG);
    let d = daemon(root, &["-c", "A10-8Q", "-f", cfg.path.to_str().unwrap()]);
    wait_until("the readiness file", || ready_file(root).exists());
    assert_eq!(counts(root), each("NVIDIA A10-8Q", 3));
    // vGPUs lost (a reboot, someone removing them): a restart re-applies. A stopped daemon
    // vouches no more: its readiness file goes with it.
    assert_eq!(d.stop(), Some(0));
    assert!(
        !ready_file(root).exists(),
        "the readiness file outlived the daemon"
    );
    for pf in ["0000:41:00.0", "0000:61:00.0"] {
        write(root, &format!("sys/bus/pci/devices/{pf}/sriov_numvfs"), "0");
    }
    let d = daemon(root, &["-c", "A10-8Q", "-f", cfg.path.to_str().unwrap()]);
    wait_until("the readiness file again", || ready_file(root).exists());
    assert_eq!(counts(root), each("NVIDIA A10-8Q", 3));
    assert_eq!(d.stop(), Some(0));
}

#[test]
fn a_gpu_whose_driver_comes_up_late_is_retried_without_flapping() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    // At boot the vGPU manager has not taken the second A10 yet.
    write(root, "sys/bus/pci/drivers/nvidia/unbind", "0000:61:00.0");
    let cfg = config_file(CONFIG);
    let api = FakeApiServer::start("node-d", &[(CONFIG_LABEL, "A10-8Q")]).unwrap();
    let kc = api.kubeconfig().to_str().unwrap().to_string();
    let f = cfg.path.to_str().unwrap();
    let d = daemon(
        root,
        &["--node-name", "node-d", "--kubeconfig", &kc, "-f", f],
    );
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("failed")));
    let reason = api.annotation(REASON).unwrap_or_default();
    assert!(reason.contains("0000:61:00.0"), "{reason}");
    assert!(reason.contains("no driver bound"), "{reason}");
    // Retries keep the state at failed: no pending in between.
    std::thread::sleep(Duration::from_millis(900));
    let h = api.label_history(STATE);
    assert_eq!(
        h,
        vec![Some("pending".into()), Some("failed".into())],
        "{h:?}"
    );
    // The driver takes the GPU: the next retry applies the profile.
    write(root, "sys/bus/pci/drivers_probe", "0000:61:00.0");
    assert!(api.wait_for(STATE, WAIT, |v| v == Some("success")));
    assert_eq!(counts(root), each("NVIDIA A10-8Q", 3));
    assert_eq!(api.annotation(REASON), None);
    assert_eq!(d.stop(), Some(0));
}

/// A daemon killed before it could remove its readiness file (an OOM kill) leaves it; the next
/// one removes it at start, before it can read its profile (here the API server is away), and
/// writes it again only once it has applied the profile itself.
#[test]
fn a_readiness_file_left_by_a_killed_daemon_goes_until_the_next_one_applied() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let Some(mut api) =
        cluster_tier::ApiServer::start_or_skip("a readiness file left by a killed daemon").unwrap()
    else {
        return;
    };
    let node = "node-killed";
    api.create_node(node, &[(CONFIG_LABEL, "A10-4Q")]).unwrap();
    let cfg = config_file(CONFIG);
    let kc = api.admin_kubeconfig().to_str().unwrap().to_string();
    let args = [
        "--node-name",
        node,
        "--kubeconfig",
        &kc,
        "-f",
        cfg.path.to_str().unwrap(),
    ];
    let mut d = daemon(root, &args);
    assert!(api.wait_for_label(node, STATE, WAIT, |v| v == Some("success")));
    wait_until("the readiness file", || ready_file(root).exists());
    d.0.kill().unwrap();
    d.0.wait().unwrap();
    assert!(ready_file(root).exists(), "a killed daemon removes nothing");

    // The next one cannot read its Node: it applies nothing, and the old file says nothing.
    api.stop_apiserver();
    let mut d = daemon(root, &args);
    wait_until("the file left from before removed", || {
        !ready_file(root).exists()
    });
    assert!(d.0.try_wait().unwrap().is_none(), "the daemon runs on");

    // The API server back: the profile is applied (already in place) and vouched for again.
    api.start_apiserver().unwrap();
    wait_until("the readiness file again", || ready_file(root).exists());
    assert_eq!(counts(root), each("NVIDIA A10-4Q", 6));
    assert_eq!(d.stop(), Some(0));
}

/// A state write the API server refuses is tried again with backoff until it lands, without
/// any new change of the node: here RBAC forbids writing the Node until a role is fixed.
#[test]
fn a_refused_state_write_lands_once_it_is_allowed() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let root = sim.root();
    let Some(api) =
        cluster_tier::ApiServer::start_or_skip("a refused state write retried").unwrap()
    else {
        return;
    };
    let node = "node-refused";
    api.create_node(node, &[(CONFIG_LABEL, "A10-4Q")]).unwrap();
    let role = |verbs: &str| {
        format!(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: vgpu-dm\n\
             rules:\n- apiGroups: [\"\"]\n  resources: [nodes]\n  verbs: [{verbs}]\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: vgpu-dm\n\
             roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: vgpu-dm}}\n\
             subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: vgpu-dm}}]\n"
        )
    };
    // It may follow its Node, not write it.
    api.apply(&role("get, list, watch")).unwrap();
    let kc = api.kubeconfig_for("vgpu-dm", "vgpu-dm", &[]).unwrap();
    let cfg = config_file(CONFIG);
    let log = tempfile::NamedTempFile::new().unwrap();
    let d = Daemon(
        Command::new(BIN)
            .args(["daemon", "--node-name", node, "--kubeconfig"])
            .arg(&kc)
            .arg("-f")
            .arg(&cfg.path)
            .arg("--host-root")
            .arg(root)
            .env_remove("NODE_NAME")
            .env_remove("KUBECONFIG")
            .env_remove("CONFIG_FILE")
            .env_remove("VGPU_DM_CONFIG_FILE")
            .env_remove("DEFAULT_VGPU_CONFIG")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    // The profile is applied; its state cannot be written, and is tried again.
    wait_until("the profile applied", || ready_file(root).exists());
    let refused = |n: usize| {
        std::fs::read_to_string(log.path())
            .unwrap_or_default()
            .matches("cannot set nvidia.com/vgpu.config.state=success")
            .count()
            >= n
    };
    wait_until("three refused writes of the state", || refused(3));
    assert_eq!(api.label(node, STATE), None);

    // The role fixed, nothing else: the state lands.
    api.apply(&role("get, list, watch, patch")).unwrap();
    assert!(
        api.wait_for_label(node, STATE, WAIT * 2, |v| v == Some("success")),
        "the state never landed:\n{}",
        std::fs::read_to_string(log.path()).unwrap_or_default()
    );
    assert_eq!(d.stop(), Some(0));
}
