//! The cluster tier: a private Kubernetes cluster per run, with node-sim as its node.
//!
//! [`Cluster::start`] starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
//! containerd (CDI on) and kubelet from the binaries `tests/cluster/prepare.sh` found
//! (`K8S_ASSETS`, or built from their Go modules into `target/go`), every one of them by PID, with
//! its files in a scratch directory; imports the project's image and a pause image (no
//! registry); mounts a node-sim topology; and installs the Helm chart with its host paths
//! pointed at node-sim's tree ([`Cluster::helm_install`]). Dropping it stops and removes all of
//! it; a run killed before that is cleaned up by the next one ([`leftovers`]).
//!
//! The cluster's network is a namespace of the run's own ([`netns`]): etcd, the control plane,
//! containerd (its shims, runc and the CNI plugins) and kubelet run there, with the address
//! [`NODE_IP`] on its `lo` (the node's, the API server's and the `kubernetes` Service's, so pods
//! reach the API server without kube-proxy) and the pods' bridge [`node::BRIDGE`]; nothing of
//! it appears in the machine's namespace. The tests reach the API server at a port of the
//! host's `127.0.0.1` forwarded into it ([`ControlPlane::server`]).
//!
//! What the host must lend, and gets back: `/var/lib/kubelet` and device nodes under
//! `/dev/vfio` (containerd `stat`s a device a device plugin or a CDI spec names on the host,
//! and node-sim's are not the host's): the numbers of node-sim's groups, created as copies of
//! `/dev/null` where nothing is, removed afterwards.

pub mod api_server;
pub mod assets;
pub mod control_plane;
pub mod kubevirt;
pub mod netns;
pub mod node;
pub mod pki;
pub mod proc;

use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

pub use api_server::ApiServer;
pub use assets::Assets;
pub use control_plane::{ControlPlane, ControlPlaneOpts};
pub use netns::NetNs;
pub use node::Node;

/// The node's address (on `lo` of the cluster's network namespace), which is also the API
/// server's and the `kubernetes` Service's.
pub const NODE_IP: &str = "10.234.0.1";
/// The Service range: its first address is [`NODE_IP`].
pub const SERVICE_CIDR: &str = "10.234.0.0/24";
/// The node's name.
pub const NODE_NAME: &str = "gpu-node-1";
/// The release name and namespace the tier installs the chart as.
pub const RELEASE: &str = "gpu-vm-node";
/// The namespace of the chart's release.
pub const NAMESPACE: &str = "gpu-vm-node";
/// Device-node numbers made under `/dev/vfio` for node-sim's groups.
const VFIO_NODES: u32 = 1024;
const SCRATCH_PREFIX: &str = "gpu-vm-cluster-";

/// A running cluster of one node.
#[derive(Debug)]
pub struct Cluster {
    // Held for the cluster's life: one run at a time on a machine (there is one
    // /var/lib/kubelet). Dropped last.
    _lock: nix::fcntl::Flock<std::fs::File>,
    dir: PathBuf,
    assets: Assets,
    // Dropped in this order: the node (its pods hold the sim's mounts), the sim, the control plane.
    node: Mutex<Node>,
    binds: Mutex<Vec<PathBuf>>,
    sim: Mutex<Option<node_sim::Sim>>,
    cp: Mutex<ControlPlane>,
    netns: Arc<NetNs>,
    host: HostChanges,
}

impl Cluster {
    /// Starts the cluster, or returns `None` after printing `skipped: …` when this machine
    /// cannot run it (a panic instead with `CLUSTER_TIER=required`).
    pub fn start_or_skip() -> Result<Option<Cluster>> {
        if let Some(why) = assets::unavailable() {
            assets::skip("cluster tier", &why);
            return Ok(None);
        }
        Cluster::start().map(Some)
    }

    /// Starts the cluster from the assets `prepare.sh` prepared.
    pub fn start() -> Result<Cluster> {
        Cluster::start_with(Assets::load().map_err(anyhow::Error::msg)?)
    }

    /// Starts the cluster from `assets` (another Kubernetes release's, say:
    /// [`Assets::newest`]).
    pub fn start_with(assets: Assets) -> Result<Cluster> {
        let lock = lock()?;
        leftovers();
        let dir = std::env::temp_dir().join(format!("{SCRATCH_PREFIX}{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // A mount of its own, shared: the DaemonSets that mount a host path with
        // mountPropagation HostToContainer (the GPU Operator's mount /) need it on a shared or
        // slave mount, as / is on a systemd host (and is not in every sandbox).
        nix::mount::mount(
            Some(&dir),
            &dir,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .with_context(|| format!("bind-mounting {} on itself", dir.display()))?;
        nix::mount::mount(
            None::<&str>,
            &dir,
            None::<&str>,
            nix::mount::MsFlags::MS_SHARED | nix::mount::MsFlags::MS_REC,
            None::<&str>,
        )
        .with_context(|| format!("making {} a shared mount", dir.display()))?;
        let mut host = HostChanges::new(dir.join("host-changes"));
        host.bind_kubelet_root(&dir.join("node/kubelet"))?;
        let netns = Arc::new(NetNs::create(&dir.join("netns"))?);
        netns.run(&["addr", "add", &format!("{NODE_IP}/32"), "dev", "lo"])?;
        let t0 = Instant::now();
        let cp = ControlPlane::start(
            &dir,
            &assets,
            ControlPlaneOpts {
                bind_ip: NODE_IP.into(),
                port: 443,
                service_cidr: SERVICE_CIDR.into(),
                controllers: true,
                netns: Some(netns.clone()),
                ..ControlPlaneOpts::default()
            },
        )?;
        eprintln!(
            "cluster: API server {} ready ({:.1} s)",
            assets.k8s_version,
            t0.elapsed().as_secs_f64()
        );
        let node = Node::start(&cp, &assets, &dir.join("node"), NODE_NAME, NODE_IP)?;
        eprintln!(
            "cluster: node {NODE_NAME} Ready ({:.1} s)",
            t0.elapsed().as_secs_f64()
        );
        host.make_vfio_nodes()?;
        Ok(Cluster {
            _lock: lock,
            dir,
            assets,
            node: Mutex::new(node),
            binds: Mutex::new(Vec::new()),
            sim: Mutex::new(None),
            cp: Mutex::new(cp),
            netns,
            host,
        })
    }

    /// The scratch directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The assets the cluster runs.
    pub fn assets(&self) -> &Assets {
        &self.assets
    }

    /// The control plane.
    pub fn control_plane(&self) -> std::sync::MutexGuard<'_, ControlPlane> {
        self.cp.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cluster's network namespace (pinned at `<dir>/netns`: `nsenter --net=<dir>/netns`).
    pub fn netns(&self) -> &NetNs {
        &self.netns
    }

    /// The node.
    pub fn node(&self) -> std::sync::MutexGuard<'_, Node> {
        self.node.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cluster-admin kubeconfig.
    pub fn kubeconfig(&self) -> PathBuf {
        self.control_plane().admin_kubeconfig().to_path_buf()
    }

    /// kubelet's root directory on the node.
    pub fn kubelet_root(&self) -> PathBuf {
        self.node().kubelet_root()
    }

    /// Bind-mounts `src` at `dst` (under node-sim's root, say) until [`Cluster::unmount_binds`]
    /// or the next [`Cluster::mount_sim`].
    pub fn bind_mount(&self, src: &Path, dst: &Path) -> Result<()> {
        std::fs::create_dir_all(dst).with_context(|| format!("creating {}", dst.display()))?;
        nix::mount::mount(
            Some(src),
            dst,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .with_context(|| format!("bind-mounting {} at {}", src.display(), dst.display()))?;
        self.binds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(dst.to_path_buf());
        Ok(())
    }

    /// Undoes every [`Cluster::bind_mount`].
    pub fn unmount_binds(&self) {
        for b in self
            .binds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .rev()
        {
            let _ = nix::mount::umount2(&b, nix::mount::MntFlags::MNT_DETACH);
        }
    }

    /// Mounts `topology` as the node's hardware, replacing the previous one (whose pods must be
    /// gone: their host paths point into it).
    pub fn mount_sim(&self, topology: &str) -> Result<PathBuf> {
        self.unmount_binds();
        let mut sim = self.sim.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = sim.take() {
            old.unmount().context("unmounting the previous node-sim")?;
        }
        let topo = node_sim::topology(topology)
            .with_context(|| format!("node-sim topology {topology}"))?;
        let root = self.dir.join("sim");
        // New hardware is a new boot: nothing of the previous node's /run survives (nor its
        // other plain directories; sys, dev and proc are node-sim's mounts).
        for sub in ["run", "var", "lib"] {
            let p = root.join(sub);
            if p.exists() {
                std::fs::remove_dir_all(&p).with_context(|| format!("removing {}", p.display()))?;
            }
        }
        let s = node_sim::mount(&topo, &root)
            .with_context(|| format!("mounting node-sim {topology}"))?;
        let path = s.root().to_path_buf();
        *sim = Some(s);
        Ok(path)
    }

    /// Runs `f` on the mounted node-sim.
    pub fn with_sim<T>(&self, f: impl FnOnce(&node_sim::Sim) -> T) -> Result<T> {
        let sim = self.sim.lock().unwrap_or_else(|p| p.into_inner());
        match sim.as_ref() {
            Some(s) => Ok(f(s)),
            None => bail!("no node-sim is mounted"),
        }
    }

    /// node-sim's root (the node's `/` as the chart's host paths see it).
    pub fn sim_root(&self) -> PathBuf {
        self.dir.join("sim")
    }

    /// Runs `kubectl` as cluster admin; its stdout.
    ///
    /// A `delete` that waits gives up after 3 minutes unless it names its own `--timeout`: a
    /// pod kubelet cannot finish then fails the scenario, naming it, instead of hanging the run.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        let mut args = args.to_vec();
        if args.first() == Some(&"delete") && !args.iter().any(|a| a.starts_with("--timeout")) {
            args.push("--timeout=180s");
        }
        run_kubectl(&self.assets.kubectl, &self.kubeconfig(), &args)
    }

    /// `kubectl get … -o json`.
    pub fn get_json(&self, args: &[&str]) -> Result<Value> {
        let mut a = vec!["get"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["-o", "json"]);
        let out = self.kubectl(&a)?;
        serde_json::from_str(&out).with_context(|| format!("parsing kubectl get {args:?}"))
    }

    /// `kubectl apply -f -` of `yaml`.
    pub fn apply(&self, yaml: &str) -> Result<String> {
        kubectl_stdin(
            &self.assets.kubectl,
            &self.kubeconfig(),
            &["apply", "-f", "-"],
            yaml,
        )
    }

    /// `kubectl create -f -` of `yaml`: the error when the API server refuses it.
    pub fn create(&self, yaml: &str) -> Result<String> {
        kubectl_stdin(
            &self.assets.kubectl,
            &self.kubeconfig(),
            &["create", "-f", "-"],
            yaml,
        )
    }

    /// Runs `helm` against the cluster; its stdout.
    pub fn helm(&self, args: &[&str]) -> Result<String> {
        proc::run(
            Command::new(&self.assets.helm)
                .arg("--kubeconfig")
                .arg(self.kubeconfig())
                .args(args)
                .env("HELM_CACHE_HOME", self.dir.join("helm/cache"))
                .env("HELM_CONFIG_HOME", self.dir.join("helm/config"))
                .env("HELM_DATA_HOME", self.dir.join("helm/data")),
        )
    }

    /// The values that point the chart at this cluster: node-sim's tree as the node's host
    /// paths, kubelet's and containerd's directories, the image as imported (never pulled).
    pub fn base_values(&self) -> Vec<String> {
        let node = self.node();
        vec![
            format!("hostRoot={}", self.sim_root().display()),
            format!("kubeletDir={}", node.kubelet_root().display()),
            format!("draDriver.cdiDir={}", node.cdi_dir().display()),
            "image.pullPolicy=Never".into(),
        ]
    }

    /// `helm upgrade --install` of the chart with [`Cluster::base_values`] and `set`, and `--wait`
    /// for what it installs; its output.
    pub fn helm_install(&self, set: &[&str], extra: &[&str]) -> Result<String> {
        let chart = assets::repo().join("deploy/helm/gpu-vm-node");
        let chart = chart.to_string_lossy().into_owned();
        let mut args: Vec<String> = vec![
            "upgrade".into(),
            "--install".into(),
            RELEASE.into(),
            chart,
            "--namespace".into(),
            NAMESPACE.into(),
            "--create-namespace".into(),
        ];
        for v in self
            .base_values()
            .into_iter()
            .chain(set.iter().map(|s| s.to_string()))
        {
            args.push("--set".into());
            args.push(v);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        self.helm(&refs)
    }

    /// Sets (`Some`) or removes (`None`) a label of the node.
    pub fn label_node(&self, key: &str, value: Option<&str>) -> Result<()> {
        let arg = match value {
            Some(v) => format!("{key}={v}"),
            None => format!("{key}-"),
        };
        self.kubectl(&["label", "node", NODE_NAME, &arg, "--overwrite"])
            .map(|_| ())
    }

    /// The node as the API server has it.
    pub fn node_json(&self) -> Result<Value> {
        self.get_json(&["node", NODE_NAME])
    }

    /// The node's allocatable count of `resource` (0 when it has none).
    pub fn allocatable(&self, resource: &str) -> Result<i64> {
        let n = self.node_json()?;
        Ok(quantity(&n["status"]["allocatable"][resource]))
    }

    /// The node's capacity of `resource` (0 when it has none).
    pub fn capacity(&self, resource: &str) -> Result<i64> {
        let n = self.node_json()?;
        Ok(quantity(&n["status"]["capacity"][resource]))
    }

    /// A container's log as kubelet wrote it (`/var/log/pods`), its lines' text only.
    pub fn container_log(&self, namespace: &str, pod: &str, container: &str) -> Result<String> {
        let p = self.get_json(&["pod", "-n", namespace, pod])?;
        let uid = p["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let dir = self
            .node()
            .pod_logs()
            .join(format!("{namespace}_{pod}_{uid}"))
            .join(container);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .flatten()
            .map(|e| e.path())
            .collect();
        files.sort();
        let mut out = String::new();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            for line in text.lines() {
                // "<time> <stream> <P|F> <text>"
                let text = line.splitn(4, ' ').nth(3).unwrap_or_default();
                out.push_str(text);
                out.push('\n');
            }
        }
        Ok(out)
    }

    /// The Events of `namespace` (all: `None`) as `kubectl get events` lists them.
    pub fn events(&self, namespace: Option<&str>) -> Result<Vec<Value>> {
        let v = match namespace {
            Some(ns) => self.get_json(&["events", "-n", ns])?,
            None => self.get_json(&["events", "-A"])?,
        };
        Ok(v["items"].as_array().cloned().unwrap_or_default())
    }

    /// Polls `f` every `every` until it returns `Some`, for at most `timeout`; the error names
    /// `what` and the last `Err` or `None`.
    pub fn wait<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut f: impl FnMut() -> Result<Option<T>>,
    ) -> Result<T> {
        let t0 = Instant::now();
        let end = t0 + timeout;
        loop {
            let last = match f() {
                Ok(Some(t)) => {
                    // Where a run spends its time, for whoever shortens it.
                    let over = if proc::timings() { 0.5 } else { 10.0 };
                    if t0.elapsed().as_secs_f64() > over {
                        eprintln!("  waited {:.1} s for {what}", t0.elapsed().as_secs_f64());
                    }
                    return Ok(t);
                }
                Ok(None) => "not yet".to_string(),
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() > end {
                bail!("timed out after {timeout:?} waiting for {what} ({last})");
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Logs to look at when a scenario failed: each process's state and last lines, the
    /// workloads and pods with their owners, and our pods' logs.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        let procs = |out: &mut String, procs: Vec<&proc::Proc>, lines: usize| {
            for p in procs {
                out.push_str(&format!(
                    "--- {} ({}, {})\n{}\n",
                    p.name(),
                    p.state(),
                    p.log().display(),
                    p.log_tail(lines)
                ));
            }
        };
        procs(&mut out, self.control_plane().procs(), 8);
        procs(&mut out, self.node().procs(), 15);
        if let Ok(ds) = self.kubectl(&["get", "daemonsets", "-A", "-o", "wide"]) {
            out.push_str(&format!("--- daemonsets\n{ds}\n"));
        }
        // Who owns each pod (a DaemonSet's UID tells a pod of an older one of the same name).
        let owners = "custom-columns=NAMESPACE:.metadata.namespace,NAME:.metadata.name,\
                      PHASE:.status.phase,NODE:.spec.nodeName,CREATED:.metadata.creationTimestamp,\
                      DELETING:.metadata.deletionTimestamp,OWNER:.metadata.ownerReferences[0].name,\
                      OWNER-UID:.metadata.ownerReferences[0].uid";
        if let Ok(pods) = self.kubectl(&["get", "pods", "-A", "-o", owners]) {
            out.push_str(&format!("--- pods\n{pods}\n"));
        }
        let logs = self.node().pod_logs();
        // The pods' whole logs, kept with the components' (target/cluster-tier/last-run-logs)
        // before the next scenario's reset deletes the pods.
        let keep = self.dir.join("logs").join(format!(
            "pods-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        ));
        if let Err(e) = copy_tree(&logs, &keep) {
            out.push_str(&format!("--- cannot keep the pods' logs: {e}\n"));
        } else {
            out.push_str(&format!("--- the pods' whole logs: {}\n", keep.display()));
        }
        if let Ok(dirs) = std::fs::read_dir(&logs) {
            for d in dirs.flatten() {
                if let Ok(cs) = std::fs::read_dir(d.path()) {
                    for c in cs.flatten() {
                        if let Ok(fs) = std::fs::read_dir(c.path()) {
                            for f in fs.flatten() {
                                out.push_str(&format!(
                                    "--- {}\n{}\n",
                                    f.path().display(),
                                    proc::tail(&f.path(), 10)
                                ));
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let t0 = Instant::now();
        self.unmount_binds();
        let sandboxes = self.node().sandbox_ids();
        self.node().shutdown();
        host_logs_and_cni_cache(&self.dir, &sandboxes);
        if let Some(sim) = self.sim.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = sim.unmount();
        }
        self.control_plane().shutdown();
        // Whatever still runs in the namespace (nothing, when every process stopped as asked):
        // the namespace, its bridge and veths go with its last process and its pin.
        self.netns.kill_all();
        let dir = self.dir.clone();
        self.host.undo();
        unmount_under(&dir);
        // The components' logs outlive the run, for a look after it: the last run's only.
        let kept = assets::repo().join("target/cluster-tier/last-run-logs");
        let _ = std::fs::remove_dir_all(&kept);
        let _ = std::fs::rename(dir.join("logs"), &kept).or_else(|_| {
            std::fs::create_dir_all(&kept)?;
            for e in std::fs::read_dir(dir.join("logs"))?.flatten() {
                std::fs::copy(e.path(), kept.join(e.file_name()))?;
            }
            Ok::<(), std::io::Error>(())
        });
        let _ = std::fs::remove_dir_all(&dir);
        eprintln!(
            "cluster: stopped and removed ({:.1} s; its logs in {})",
            t0.elapsed().as_secs_f64(),
            kept.display()
        );
    }
}

/// What the run changed on the host, recorded in a file so a later run can undo it after a crash.
#[derive(Debug)]
struct HostChanges {
    file: PathBuf,
    dev_nodes: Vec<PathBuf>,
    vfio_dir: bool,
    kubelet_bind: bool,
    kubelet_dir: bool,
}

impl HostChanges {
    fn new(file: PathBuf) -> HostChanges {
        HostChanges {
            file,
            dev_nodes: Vec::new(),
            vfio_dir: false,
            kubelet_bind: false,
            kubelet_dir: false,
        }
    }

    fn save(&self) {
        let mut text = String::new();
        if self.vfio_dir {
            text.push_str("vfio-dir\n");
        }
        if self.kubelet_bind {
            text.push_str("kubelet-bind\n");
        }
        if self.kubelet_dir {
            text.push_str("kubelet-dir\n");
        }
        for n in &self.dev_nodes {
            text.push_str(&format!("dev {}\n", n.display()));
        }
        let _ = std::fs::write(&self.file, text);
    }

    /// Mounts `dir` at kubelet's root, which must be empty or absent: a node's kubelet is not
    /// this one's to share.
    fn bind_kubelet_root(&mut self, dir: &Path) -> Result<()> {
        let root = Path::new(node::KUBELET_ROOT);
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        if !root.exists() {
            std::fs::create_dir_all(root)
                .with_context(|| format!("creating {}", root.display()))?;
            self.kubelet_dir = true;
            self.save();
        } else if std::fs::read_dir(root)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
        {
            bail!(
                "{} is not empty: a kubelet runs on this machine, or ran here (the tier needs that directory for its own kubelet)",
                root.display()
            );
        }
        nix::mount::mount(
            Some(dir),
            root,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .with_context(|| format!("bind-mounting {} at {}", dir.display(), root.display()))?;
        self.kubelet_bind = true;
        self.save();
        Ok(())
    }

    fn make_vfio_nodes(&mut self) -> Result<()> {
        let dir = Path::new("/dev/vfio");
        if !dir.exists() {
            std::fs::create_dir(dir).context("creating /dev/vfio")?;
            self.vfio_dir = true;
        }
        let mut names: Vec<String> = (0..VFIO_NODES).map(|n| n.to_string()).collect();
        names.push("vfio".into());
        for n in names {
            let p = dir.join(&n);
            if p.symlink_metadata().is_ok() {
                continue;
            }
            nix::sys::stat::mknod(
                &p,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(1, 3),
            )
            .with_context(|| format!("mknod {}", p.display()))?;
            self.dev_nodes.push(p);
        }
        self.save();
        Ok(())
    }

    fn undo(&mut self) {
        undo_host_changes(&self.file);
        self.dev_nodes.clear();
        self.vfio_dir = false;
        self.kubelet_bind = false;
        self.kubelet_dir = false;
    }
}

/// Undoes what a run's `host-changes` file records.
fn undo_host_changes(file: &Path) {
    let Ok(text) = std::fs::read_to_string(file) else {
        return;
    };
    for line in text.lines() {
        if let Some(p) = line.strip_prefix("dev ") {
            // Only a device node that is still the copy of /dev/null made here.
            if let Ok(m) = std::fs::symlink_metadata(p)
                && m.file_type().is_char_device()
            {
                let _ = std::fs::remove_file(p);
            }
        }
    }
    for line in text.lines() {
        match line {
            // The node's address and the bridge, in the machine's own namespace: recorded by runs
            // of the tier from before it had a network namespace of its own.
            "address" => {
                let _ = proc::run(Command::new("ip").args([
                    "addr",
                    "del",
                    &format!("{NODE_IP}/32"),
                    "dev",
                    "lo",
                ]));
            }
            "bridge" => {
                let _ = proc::run(Command::new("ip").args(["link", "del", node::BRIDGE]));
            }
            "vfio-dir" => {
                let _ = std::fs::remove_dir("/dev/vfio");
            }
            "kubelet-bind" => {
                // kubelet's own mounts (pods' volumes) first.
                unmount_under(Path::new(node::KUBELET_ROOT));
            }
            _ => {}
        }
    }
    if text.lines().any(|l| l == "kubelet-dir") {
        let _ = std::fs::remove_dir(node::KUBELET_ROOT);
    }
    let _ = std::fs::remove_file(file);
}

/// Takes the machine's cluster-tier lock, waiting for another run to end.
fn lock() -> Result<nix::fcntl::Flock<std::fs::File>> {
    let path = Path::new("/run/gpu-vm-cluster-tier.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(l),
        Err((f, _)) => {
            eprintln!(
                "cluster: another cluster-tier run holds {}; waiting for it",
                path.display()
            );
            nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
                .map_err(|(_, e)| anyhow::anyhow!("locking {}: {e}", path.display()))
        }
    }
}

/// Stops and removes what earlier runs killed before their clean-up left: their processes
/// (every process in their network namespace, and every process naming their scratch
/// directory: a container shim names its containerd's socket), mounts (their namespace's pin
/// among them: the kernel then removes the namespace with its bridge and veths), host changes,
/// kubelet's and the CNI plugins' files outside their scratch directories
/// ([`host_logs_and_cni_cache`]), and the scratch directories.
pub fn leftovers() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(SCRATCH_PREFIX)
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // The lock is held: no other run is going.
        if pid == std::process::id() as i32 {
            continue;
        }
        let dir = e.path();
        eprintln!(
            "cluster: removing what a killed run left in {}",
            dir.display()
        );
        netns::kill_pinned(&dir.join("netns"));
        let dir_s = dir.to_string_lossy().into_owned();
        for (p, _) in proc::find(&dir_s) {
            proc::kill_tree(p);
        }
        std::thread::sleep(Duration::from_millis(200));
        undo_host_changes(&dir.join("host-changes"));
        host_logs_and_cni_cache(&dir, &node::sandbox_ids(&dir.join("node")));
        unmount_under(&dir);
        if let Ok(data) = std::fs::read_to_string(dir.join("etcd-data"))
            && data.starts_with("/dev/shm/")
        {
            let _ = std::fs::remove_dir_all(data);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Removes what kubelet and the CNI plugins keep outside their configured directories: the
/// `/var/log/containers` links into the run's pod logs, and the CNI result cache of its sandboxes.
fn host_logs_and_cni_cache(dir: &Path, sandboxes: &[String]) {
    if let Ok(links) = std::fs::read_dir("/var/log/containers") {
        for l in links.flatten() {
            if std::fs::read_link(l.path()).is_ok_and(|t| t.starts_with(dir)) {
                let _ = std::fs::remove_file(l.path());
            }
        }
    }
    if let Ok(results) = std::fs::read_dir("/var/lib/cni/results") {
        for r in results.flatten() {
            let name = r.file_name().to_string_lossy().into_owned();
            if sandboxes.iter().any(|id| name.contains(id.as_str())) {
                let _ = std::fs::remove_file(r.path());
            }
        }
    }
}

/// Copies the files under `from` to `to` (made), following no links.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)?.flatten() {
        let t = e.file_type()?;
        if t.is_dir() {
            copy_tree(&e.path(), &to.join(e.file_name()))?;
        } else if t.is_file() {
            std::fs::copy(e.path(), to.join(e.file_name()))?;
        }
    }
    Ok(())
}

/// Unmounts every mount at or under `dir`, deepest first (lazily: a mount still in use goes
/// when it is let go).
fn unmount_under(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut mps: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(m.replace("\\040", " ")))
        .filter(|m| m.starts_with(dir))
        .collect();
    mps.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    for m in mps {
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn run_kubectl(kubectl: &Path, kubeconfig: &Path, args: &[&str]) -> Result<String> {
    proc::run(
        Command::new(kubectl)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args),
    )
}

fn kubectl_stdin(kubectl: &Path, kubeconfig: &Path, args: &[&str], input: &str) -> Result<String> {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting kubectl")?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .context("writing to kubectl")?;
    }
    let out = child.wait_with_output().context("waiting for kubectl")?;
    if !out.status.success() {
        bail!(
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// An integer quantity (`"12"`, `12`); 0 when absent or not an integer.
pub fn quantity(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The labels of an object.
pub fn labels(obj: &Value) -> BTreeMap<String, String> {
    obj["metadata"]["labels"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                .collect()
        })
        .unwrap_or_default()
}
