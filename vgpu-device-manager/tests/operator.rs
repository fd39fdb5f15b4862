//! The GPU Operator's own operand DaemonSets with our image (`tests/fixtures/gpu-operator`,
//! transcribed from NVIDIA's gpu-operator): each main container's command, arguments and
//! environment, run as the container would run them, against a simulated node (node-sim).
//!
//! "As the container would": the image's `/usr/local/bin` is a directory laid out as the
//! image lays it out (tools/build-image.sh: our three binaries, `vfio-manage` naming vfio-manager, the
//! default command `image/operand`), a container without `command` runs the Containerfile's
//! `CMD`, and the environment is only the image's (`HOST_ROOT=/host`) and the DaemonSet's. A
//! volume mount cannot be made without a mount namespace, so a container path a DaemonSet
//! mounts is rewritten to where the simulated host keeps it (`/host` is the node-sim root); the
//! pod's service account is a client certificate for that service account on a real API
//! server (etcd and kube-apiserver) holding the GPU Operator's RBAC, and the device-plugin mount
//! is named through `KUBELET_DIR`. The init containers run NVIDIA's validator and
//! driver-manager images, not ours, and are not run.
//!
//! The three tests need the workspace's three binaries (`cargo test --workspace` builds them);
//! a run of this crate alone skips with a message when one is missing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use support::*;
use testkit::kubelet::FakeKubelet;
use yaml_serde::Value;

const WAIT: Duration = Duration::from_secs(60);
const STATE: &str = "nvidia.com/vgpu.config.state";
const GPUS: [&str; 2] = ["0000:41:00.0", "0000:61:00.0"];
const NODE: &str = "gpu-node-op";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// The image's `/usr/local/bin`, and its default command.
struct Image {
    bin: tempfile::TempDir,
    cmd: Vec<String>,
}

impl Image {
    /// `None` (the test skips) when a binary of the workspace is not built.
    fn new() -> Option<Image> {
        let built = Path::new(BIN).parent().unwrap();
        let bin = tempfile::tempdir().unwrap();
        for b in ["vfio-manager", "vgpu-device-manager", "sandbox-dp"] {
            let exe = built.join(b);
            if !exe.is_file() {
                eprintln!("skipped: {b} is not built; cargo test --workspace builds it");
                return None;
            }
            std::os::unix::fs::symlink(&exe, bin.path().join(b)).unwrap();
        }
        // As the Containerfile makes them.
        std::os::unix::fs::symlink("vfio-manager", bin.path().join("vfio-manage")).unwrap();
        std::os::unix::fs::symlink(repo().join("image/operand"), bin.path().join("operand"))
            .unwrap();
        // The image's files are what tools/build-image.sh lays out (the Containerfile runs it).
        let layout = std::fs::read_to_string(repo().join("tools/build-image.sh")).unwrap();
        assert!(
            layout.contains(r#"ln -s vfio-manager "$root/usr/local/bin/vfio-manage""#)
                && layout.contains("put image/operand /usr/local/bin/operand"),
            "tools/build-image.sh no longer installs vfio-manage and operand as this test assumes"
        );
        let containerfile = std::fs::read_to_string(repo().join("Containerfile")).unwrap();
        let cmd = containerfile
            .lines()
            .find_map(|l| l.strip_prefix("CMD "))
            .expect("the Containerfile has a CMD");
        let cmd: Vec<String> = serde_json::from_str(cmd).unwrap();
        Some(Image { bin, cmd })
    }
}

impl Image {
    /// The default command as [`container`] resolves it: the image's `/usr/local/bin/operand`.
    fn default_command(&self) -> Vec<String> {
        let [cmd] = &self.cmd[..] else {
            panic!("a default command with arguments: {:?}", self.cmd)
        };
        let name = cmd
            .strip_prefix("/usr/local/bin/")
            .expect("in /usr/local/bin");
        vec![self.bin.path().join(name).display().to_string()]
    }
}

/// What runs a container: its argv and environment, container paths already rewritten.
#[derive(Debug)]
struct Container {
    argv: Vec<String>,
    env: Vec<(String, String)>,
    pre_stop: Option<Vec<String>>,
}

/// The DaemonSet's main container, run on node `NODE` in namespace `gpu-operator`, each
/// container path in `mounts` (container path, host directory) rewritten.
fn container(file: &str, image: &Image, mounts: &[(&str, &Path)]) -> Container {
    let text = std::fs::read_to_string(
        repo()
            .join("vgpu-device-manager/tests/fixtures/gpu-operator")
            .join(file),
    )
    .unwrap();
    let ds: Value = yaml_serde::from_str(&text).unwrap();
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["image"].as_str(), Some("gpu-vm-node:0.1.0"), "{file}");
    let map = |s: &str| -> String {
        for (cpath, host) in mounts {
            if let Some(rest) = s.strip_prefix(cpath)
                && (rest.is_empty() || rest.starts_with('/'))
            {
                return format!("{}{rest}", host.display());
            }
        }
        s.to_string()
    };
    let strings = |v: &Value| -> Vec<String> {
        v.as_sequence()
            .map(|s| s.iter().map(|x| x.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    let bin_path = |argv: Vec<String>| -> Vec<String> {
        argv.into_iter()
            .enumerate()
            .map(|(i, a)| match a.strip_prefix("/usr/local/bin/") {
                Some(b) if i == 0 => image.bin.path().join(b).display().to_string(),
                _ => a,
            })
            .collect()
    };
    let mut argv = strings(&c["command"]);
    if argv.is_empty() {
        argv = image.cmd.clone();
    }
    argv.extend(strings(&c["args"]));
    // The image's environment, then the container's.
    let mut env = vec![
        (
            "PATH".to_string(),
            format!("{}:/usr/bin:/bin", image.bin.path().display()),
        ),
        ("HOST_ROOT".to_string(), map("/host")),
        ("RUST_LOG".to_string(), "info".to_string()),
    ];
    for e in c["env"].as_sequence().into_iter().flatten() {
        let name = e["name"].as_str().unwrap().to_string();
        let value = match e["value"].as_str() {
            Some(v) => map(v),
            None => match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("spec.nodeName") => NODE.to_string(),
                Some("metadata.namespace") => "gpu-operator".to_string(),
                other => panic!("{file}: env {name} from {other:?}"),
            },
        };
        env.retain(|(n, _)| *n != name);
        env.push((name, value));
    }
    let pre_stop = match &c["lifecycle"]["preStop"]["exec"]["command"] {
        Value::Null => None,
        v => Some(bin_path(strings(v))),
    };
    Container {
        argv: bin_path(argv),
        env,
        pre_stop,
    }
}

impl Container {
    fn command(&self, argv: &[String], extra: &[(&str, &str)]) -> Command {
        let mut c = Command::new(&argv[0]);
        c.args(&argv[1..])
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(extra.iter().copied());
        c
    }

    /// Starts the container's process (in a process group of its own, as a container's).
    fn start(&self, extra: &[(&str, &str)]) -> Running {
        let child = self
            .command(&self.argv, extra)
            .process_group(0)
            .spawn()
            .unwrap();
        Running(child)
    }

    /// Runs the preStop hook to its end.
    fn pre_stop(&self) -> Output {
        let argv = self.pre_stop.as_ref().expect("a preStop hook");
        self.command(argv, &[]).output().unwrap()
    }
}

/// A container's processes; SIGTERM to the group on drop, as the kubelet stops a container.
struct Running(Child);

impl Running {
    fn still_running(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }

    fn stop(&mut self) -> Option<i32> {
        let pg = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::killpg(pg, nix::sys::signal::Signal::SIGTERM);
        self.0.wait().unwrap().code()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.still_running() {
            self.stop();
        }
    }
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn driver(root: &Path, bdf: &str) -> Option<String> {
    std::fs::read_link(root.join("sys/bus/pci/devices").join(bdf).join("driver"))
        .ok()
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
}

fn output(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn the_operators_vfio_manager_binds_every_gpu_and_its_prestop_gives_them_back() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(image) = Image::new() else { return };
    let root = sim.root();
    let c = container("vfio-manager.yaml", &image, &[("/host", root)]);
    assert_eq!(c.argv[..2], ["/bin/sh", "-c"], "{c:?}");

    let mut run = c.start(&[]);
    wait_until("both A10s on vfio-pci", || {
        GPUS.iter()
            .all(|g| driver(root, g).as_deref() == Some("vfio-pci"))
    });
    for g in GPUS {
        let group =
            std::fs::read_link(root.join("sys/bus/pci/devices").join(g).join("iommu_group"))
                .unwrap();
        let group = group.file_name().unwrap().to_owned();
        assert!(
            root.join("dev/vfio").join(&group).exists(),
            "{g}: /dev/vfio/{group:?}"
        );
    }
    // `bind --all` succeeded: the shell went on to its sleep loop, and the container stays up.
    std::thread::sleep(Duration::from_millis(300));
    assert!(run.still_running(), "the container's command ended");

    // Deleting the pod (a relabel, an uninstall) runs the preStop hook: the GPUs go back.
    let o = c.pre_stop();
    assert_eq!(o.status.code(), Some(0), "{}", output(&o));
    for g in GPUS {
        assert_eq!(driver(root, g).as_deref(), Some("nvidia"), "{g}");
    }
    run.stop();
}

#[test]
fn the_operators_vgpu_device_manager_applies_its_default_profile_and_coexists_with_the_validator() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(image) = Image::new() else { return };
    let root = sim.root();
    let Some(api) =
        cluster_tier::ApiServer::start_or_skip("the operator's vgpu-device-manager").unwrap()
    else {
        return;
    };
    api.create_node(NODE, &[]).unwrap();
    // The pod's service account, with the operator's own roles: `update` on nodes, no `patch`.
    api.apply_gpu_operator_rbac().unwrap();
    let kubeconfig = api
        .service_account_kubeconfig("gpu-operator", "nvidia-vgpu-device-manager")
        .unwrap();
    // The ConfigMap default-vgpu-devices-config, mounted at /vgpu-config.
    let cm = config_file(CONFIG);
    let c = container(
        "vgpu-device-manager.yaml",
        &image,
        &[("/host", root), ("/vgpu-config", cm.dir.path())],
    );
    assert_eq!(
        c.argv,
        image.default_command(),
        "runs the image's default command"
    );

    let kubeconfig = kubeconfig.to_str().unwrap().to_string();
    let mut run = c.start(&[("KUBECONFIG", &kubeconfig)]);
    assert!(
        api.wait_for_label(NODE, STATE, WAIT, |v| v == Some("success")),
        "{:?}",
        api.label(NODE, STATE)
    );
    // Written as the operator's service account, by a replace: the API server refused its patch.
    let sa = "system:serviceaccount:gpu-operator:nvidia-vgpu-device-manager";
    let by_sa: Vec<_> = api
        .audited("nodes")
        .into_iter()
        .filter(|e| e["user"]["username"] == sa)
        .map(|e| (e["verb"].clone(), e["responseStatus"]["code"].clone()))
        .collect();
    assert!(by_sa.contains(&("update".into(), 200.into())), "{by_sa:?}");
    assert!(!by_sa.contains(&("patch".into(), 200.into())), "{by_sa:?}");
    let want: Vec<_> = GPUS
        .iter()
        .map(|g| ((g.to_string(), "NVIDIA A10-8Q".to_string()), 3))
        .collect();
    assert_eq!(
        mdev_counts(root).into_iter().collect::<Vec<_>>(),
        want,
        "DEFAULT_VGPU_CONFIG=A10-8Q on a node without the label"
    );
    let validations = root.join("run/nvidia/validations");
    let ready = validations.join("vgpu-devices-ready");
    assert!(ready.exists());

    // nvidia-validator starting (or its preStop): the whole directory removed and made again,
    // with its own files. Ours comes back; the validator's are left alone.
    std::fs::remove_dir_all(&validations).unwrap();
    std::fs::create_dir(&validations).unwrap();
    std::fs::write(validations.join("workload-type"), "vm-vgpu").unwrap();
    wait_until("vgpu-devices-ready written again", || ready.exists());
    // The validator removing just our file, and writing its own copy: both fine.
    std::fs::remove_file(&ready).unwrap();
    wait_until("vgpu-devices-ready written again", || ready.exists());
    assert_eq!(
        std::fs::read_to_string(validations.join("workload-type")).unwrap(),
        "vm-vgpu"
    );

    assert_eq!(run.stop(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_sandbox_device_plugin_registers_the_passthrough_gpus() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let Some(image) = Image::new() else { return };
    let root = sim.root();
    // What the vfio-manager operand did before.
    let vfio = container("vfio-manager.yaml", &image, &[("/host", root)]);
    let o = vfio
        .command(&["vfio-manage".into(), "bind".into(), "--all".into()], &[])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output(&o));

    let kdir = tempfile::tempdir().unwrap();
    let mut kubelet = FakeKubelet::start(kdir.path()).await.unwrap();
    let c = container(
        "sandbox-device-plugin.yaml",
        &image,
        &[
            ("/host", root),
            ("/var/lib/kubelet/device-plugins", kdir.path()),
        ],
    );
    assert_eq!(
        c.argv,
        image.default_command(),
        "runs the image's default command"
    );
    let kubelet_dir = kdir.path().to_str().unwrap().to_string();
    let _run = c.start(&[("KUBELET_DIR", &kubelet_dir)]);

    let reg = kubelet.next_registration(WAIT).await.unwrap();
    assert_eq!(reg.resource_name, "nvidia.com/GA102GL_A10");
    let mut plugin = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut lw = plugin.list_and_watch().await.unwrap();
    let mut ids: Vec<String> = lw
        .next(WAIT)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.id)
        .collect();
    ids.sort();
    assert_eq!(ids, GPUS);
}

/// `image/operand`, the default command: which daemon, and the HOST_ROOT fallback.
#[test]
fn the_default_command_picks_the_daemon_from_the_environment() {
    let bin = tempfile::tempdir().unwrap();
    for b in ["vgpu-device-manager", "sandbox-dp"] {
        let p = bin.path().join(b);
        std::fs::write(&p, format!("#!/bin/sh\necho {b} \"$HOST_ROOT\" \"$@\"\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let host = tempfile::tempdir().unwrap();
    std::fs::create_dir(host.path().join("sys")).unwrap();
    let host_root = host.path().to_str().unwrap();
    let run = |env: &[(&str, &str)], args: &[&str]| -> String {
        let o = Command::new(repo().join("image/operand"))
            .args(args)
            .env_clear()
            .env("PATH", format!("{}:/usr/bin:/bin", bin.path().display()))
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", output(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    assert_eq!(
        run(&[("HOST_ROOT", host_root)], &[]),
        format!("sandbox-dp {host_root}")
    );
    assert_eq!(
        run(
            &[("HOST_ROOT", host_root), ("DEFAULT_VGPU_CONFIG", "A10-8Q")],
            &[]
        ),
        format!("vgpu-device-manager {host_root} daemon")
    );
    assert_eq!(
        run(
            &[("HOST_ROOT", host_root), ("CONFIG_FILE", "/c.yaml")],
            &["-d"]
        ),
        format!("vgpu-device-manager {host_root} daemon -d")
    );
    // The operator's sandbox-device-plugin mounts no /host: the host's paths are at their own.
    assert_eq!(
        run(&[("HOST_ROOT", "/nonexistent-host-root")], &["list"]),
        "sandbox-dp / list"
    );
}
