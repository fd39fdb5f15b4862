//! A node: containerd (CRI, CDI on) and kubelet, every directory of theirs under the run's
//! scratch directory, in the control plane's network namespace ([`crate::netns`]): the pods'
//! network (the bridge, each pod's veth) is made there by the CNI plugins containerd runs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::assets::Assets;
use crate::control_plane::ControlPlane;
use crate::netns::NetNs;
use crate::proc::{Proc, find, kill_tree, run};

/// The pod network's bridge and range (host-local IPAM, no kube-proxy: pods reach the API
/// server at the node's own address, which is the `kubernetes` Service's too), in the node's
/// network namespace.
pub const BRIDGE: &str = "gvmbr0";
const POD_CIDR: &str = "10.235.0.0/24";
const CNI_NETWORK: &str = "gpu-vm-test";
/// kubelet's root directory.
pub const KUBELET_ROOT: &str = "/var/lib/kubelet";

/// A node of the cluster.
#[derive(Debug)]
pub struct Node {
    name: String,
    ip: String,
    dir: PathBuf,
    k8s_bin: PathBuf,
    kubelet: Option<Proc>,
    containerd: Option<Proc>,
    kubeconfig: PathBuf,
    netns: Option<Arc<NetNs>>,
}

impl Node {
    /// Starts containerd (with the images imported) and kubelet for node `name` at `ip`, in the
    /// control plane's network namespace when it has one (`ip` is an address there); returns
    /// when the Node is Ready.
    pub fn start(
        cp: &ControlPlane,
        assets: &Assets,
        dir: &Path,
        name: &str,
        ip: &str,
    ) -> Result<Node> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let cert = cp.sign(
            &format!("kubelet-{name}"),
            &format!("system:node:{name}"),
            &["system:nodes"],
            &[],
        )?;
        let kubeconfig = cp.pki().kubeconfig(
            &dir.join("kubelet.kubeconfig"),
            &cp.internal_server(),
            &cert,
        )?;
        let mut node = Node {
            name: name.to_string(),
            ip: ip.to_string(),
            dir: dir.to_path_buf(),
            k8s_bin: assets.k8s_bin.clone(),
            kubelet: None,
            containerd: None,
            kubeconfig,
            netns: cp.netns().cloned(),
        };
        node.write_containerd_config()?;
        node.start_containerd()?;
        node.import(&assets.pause)?;
        node.import(&assets.image)?;
        let serving = cp.sign(
            &format!("kubelet-serving-{name}"),
            name,
            &[],
            &[format!("IP:{ip}"), format!("DNS:{name}")],
        )?;
        node.write_kubelet_config(cp, &serving.crt, &serving.key)?;
        node.start_kubelet()?;
        node.wait_ready(cp, Duration::from_secs(90))?;
        Ok(node)
    }

    /// The Node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// kubelet's root directory (`--root-dir`): `/var/lib/kubelet`, as on a real node, because
    /// kubelet's device-plugin directory is always `/var/lib/kubelet/device-plugins` whatever its
    /// root. The run's own directory is bind-mounted there ([`crate::Cluster::start`]).
    pub fn kubelet_root(&self) -> PathBuf {
        PathBuf::from(KUBELET_ROOT)
    }

    /// The directory containerd reads CDI specs from.
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.join("cdi")
    }

    /// Where kubelet writes containers' logs (`/var/log/pods` on a real node).
    pub fn pod_logs(&self) -> PathBuf {
        self.dir.join("pod-logs")
    }

    fn containerd_sock(&self) -> PathBuf {
        self.dir.join("containerd/containerd.sock")
    }

    fn write_containerd_config(&self) -> Result<()> {
        let d = self.dir.join("containerd");
        for sub in ["root", "state", "runc"] {
            std::fs::create_dir_all(d.join(sub))
                .with_context(|| format!("creating {}", d.join(sub).display()))?;
        }
        let cni = self.dir.join("cni");
        std::fs::create_dir_all(&cni).with_context(|| format!("creating {}", cni.display()))?;
        std::fs::create_dir_all(self.cdi_dir())
            .with_context(|| format!("creating {}", self.cdi_dir().display()))?;
        let conflist = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": CNI_NETWORK,
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": true, "ipMasq": false,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": self.dir.join("cni-ipam")}},
                {"type": "loopback"}
            ]
        });
        std::fs::write(cni.join("10-gpu-vm-test.conflist"), conflist.to_string())
            .context("writing the CNI config")?;
        let config = format!(
            r#"version = 3
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = true
  cdi_spec_dirs = ["{cdi}"]
  # No CAP_SYS_RESOURCE in this sandbox: without it runc cannot start the pause container.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      # Privileged containers get no copy of the host's device nodes: the /dev/vfio nodes the
      # tier makes on the host would be made again inside, onto node-sim's /dev/vfio (FUSE, which
      # cannot hold device nodes) where a DaemonSet mounts it there. Our daemons read the host's
      # /dev through their host mounts.
      privileged_without_host_devices = true
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "runc"
        Root = "{d}/runc"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{cni}"
[plugins."io.containerd.cri.v1.images"]
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "registry.k8s.io/pause:3.10"
"#,
            d = d.display(),
            sock = self.containerd_sock().display(),
            cdi = self.cdi_dir().display(),
            cni = cni.display(),
        );
        std::fs::write(d.join("config.toml"), config).context("writing containerd's config")?;
        Ok(())
    }

    fn start_containerd(&mut self) -> Result<()> {
        let mut cmd = Command::new(self.k8s_bin.join("containerd"));
        cmd.arg("--config")
            .arg(self.dir.join("containerd/config.toml"));
        // The shim is found on PATH.
        cmd.env("PATH", path_with(&self.k8s_bin));
        self.containerd = Some(Proc::spawn_in(
            self.netns.as_deref(),
            "containerd",
            &mut cmd,
            &self.dir.join("../logs"),
            &self.dir.join("../pids"),
        )?);
        let end = Instant::now() + Duration::from_secs(30);
        while !self.containerd_sock().exists() {
            if Instant::now() > end {
                bail!(
                    "containerd did not create {}",
                    self.containerd_sock().display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Runs `ctr` against this node's containerd in the CRI namespace.
    pub fn ctr(&self, args: &[&str]) -> Result<String> {
        run(Command::new(self.k8s_bin.join("ctr"))
            .arg("--address")
            .arg(self.containerd_sock())
            .args(["--namespace", "k8s.io"])
            .args(args))
    }

    /// Imports an OCI archive into the CRI namespace (as `ctr images import` does).
    pub fn import(&self, archive: &Path) -> Result<()> {
        let a = archive.to_string_lossy();
        self.ctr(&["images", "import", "--local", &a]).map(|_| ())
    }

    fn write_kubelet_config(&self, cp: &ControlPlane, crt: &Path, key: &Path) -> Result<()> {
        let root = self.kubelet_root();
        std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
        let config = serde_json::json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            // The sandbox's host: cgroup v1 with no systemd, swap allowed.
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": false,
            "failSwapOn": false,
            "cgroupsPerQOS": false,
            "enforceNodeAllocatable": [],
            "authentication": {"anonymous": {"enabled": false}, "webhook": {"enabled": true},
                               "x509": {"clientCAFile": cp.pki().ca()}},
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": crt,
            "tlsPrivateKeyFile": key,
            "address": self.ip,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 0,
            "containerRuntimeEndpoint": format!("unix://{}", self.containerd_sock().display()),
            "podLogsDir": self.pod_logs(),
            "resolvConf": "",
            // Nothing is evicted or collected because the test machine's disk is busy.
            "evictionHard": {"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%", "nodefs.inodesFree": "0%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "localStorageCapacityIsolation": false,
            "serializeImagePulls": false,
            "shutdownGracePeriod": "0s",
            // kubelet checks its Node's status (Allocatable from the device plugins) every 2 s
            // rather than 10 s: a capacity change reaches the Node sooner, and a scenario waits
            // less. What the daemons do does not depend on it.
            "nodeStatusUpdateFrequency": "2s",
        });
        std::fs::write(self.dir.join("kubelet.json"), config.to_string())
            .context("writing kubelet's config")?;
        Ok(())
    }

    /// Starts kubelet (again, after [`Node::stop_kubelet`]).
    pub fn start_kubelet(&mut self) -> Result<()> {
        let mut cmd = Command::new(self.k8s_bin.join("kubelet"));
        cmd.arg("--config")
            .arg(self.dir.join("kubelet.json"))
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--root-dir")
            .arg(self.kubelet_root())
            .arg("--cert-dir")
            .arg(self.dir.join("kubelet-pki"))
            .args(["--hostname-override", &self.name, "--node-ip", &self.ip]);
        cmd.env("PATH", path_with(&self.k8s_bin));
        self.kubelet = Some(Proc::spawn_in(
            self.netns.as_deref(),
            "kubelet",
            &mut cmd,
            &self.dir.join("../logs"),
            &self.dir.join("../pids"),
        )?);
        Ok(())
    }

    /// Stops kubelet (SIGTERM): its pods keep running, as on a real node.
    pub fn stop_kubelet(&mut self) {
        if let Some(mut k) = self.kubelet.take() {
            k.stop(Duration::from_secs(10));
        }
    }

    fn wait_ready(&mut self, cp: &ControlPlane, timeout: Duration) -> Result<()> {
        let end = Instant::now() + timeout;
        loop {
            let status = cp
                .kubectl(&[
                    "get",
                    "node",
                    &self.name,
                    "-o",
                    "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
                ])
                .unwrap_or_default();
            if status.trim() == "True" {
                return Ok(());
            }
            if let Some(k) = self.kubelet.as_mut()
                && !k.alive()
            {
                bail!("kubelet exited:\n{}", k.log_tail(30));
            }
            if Instant::now() > end {
                let tail = self
                    .kubelet
                    .as_ref()
                    .map(|k| k.log_tail(30))
                    .unwrap_or_default();
                bail!("node {} not Ready after {timeout:?}:\n{tail}", self.name);
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The node's processes, for logs on failure.
    pub fn procs(&self) -> Vec<&Proc> {
        [self.kubelet.as_ref(), self.containerd.as_ref()]
            .into_iter()
            .flatten()
            .collect()
    }

    /// The IDs of the pod sandboxes containerd ever made here (their CNI results name them).
    pub fn sandbox_ids(&self) -> Vec<String> {
        sandbox_ids(&self.dir)
    }

    /// Stops everything the node runs: kubelet, every container (their shims and processes)
    /// and containerd.
    pub fn shutdown(&mut self) {
        self.stop_kubelet();
        let _ = self.ctr(&["tasks", "ls", "-q"]).map(|ids| {
            for id in ids.lines().filter(|l| !l.is_empty()) {
                let _ = self.ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
            }
        });
        if let Some(mut c) = self.containerd.take() {
            c.stop(Duration::from_secs(5));
        }
        // Shims outlive containerd: each names containerd's socket on its command line.
        let sock = self.containerd_sock().to_string_lossy().into_owned();
        for (pid, _) in find(&sock) {
            kill_tree(pid);
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The IDs of the pod sandboxes the containerd of the node in `dir` ever made (a killed run's
/// too).
pub fn sandbox_ids(dir: &Path) -> Vec<String> {
    let dir = dir.join("containerd/root/io.containerd.grpc.v1.cri/sandboxes");
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// PATH with `dir` first.
fn path_with(dir: &Path) -> String {
    format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into())
    )
}
