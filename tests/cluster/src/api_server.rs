//! A real API server alone (etcd and kube-apiserver, no node, no controllers), for the tests of
//! the daemons that check Kubernetes API semantics: label and annotation updates under a given
//! RBAC, Events as `kubectl get events` shows them, ResourceSlices as the API stores them.
//!
//! [`ApiServer::start_or_skip`] starts one on a free loopback port in a scratch directory of its
//! own (about 4 s), or prints `skipped: …` when `tests/cluster/prepare.sh` has not prepared the
//! tier's assets (a panic instead with `CLUSTER_TIER=required`). Dropping it stops both
//! processes and removes the directory. It derefs to its [`ControlPlane`]
//! (`admin_kubeconfig`, `kubeconfig_for`, `kubectl`, `audit_log`).

use std::collections::BTreeMap;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::assets::{self, Assets};
use crate::control_plane::{ControlPlane, ControlPlaneOpts};

/// A running API server (and its etcd).
#[derive(Debug)]
pub struct ApiServer {
    // Dropped before the directory it lives in.
    cp: ControlPlane,
    kubectl: PathBuf,
    _dir: tempfile::TempDir,
}

/// Whether `slices` (ResourceSlices as JSON) are whole: each pool as many slices as each of its
/// slices says (`resourceSliceCount`), all at one generation. A pool not written at all is not
/// seen: count the pools where that matters.
pub fn whole_pools(slices: &[Value]) -> bool {
    let mut pools: BTreeMap<&str, Vec<(i64, i64)>> = BTreeMap::new();
    for s in slices {
        let pool = &s["spec"]["pool"];
        pools
            .entry(pool["name"].as_str().unwrap_or_default())
            .or_default()
            .push((
                pool["generation"].as_i64().unwrap_or(-1),
                pool["resourceSliceCount"].as_i64().unwrap_or(-1),
            ));
    }
    !pools.is_empty()
        && pools.values().all(|p| {
            p.iter()
                .all(|&(g, n)| g == p[0].0 && usize::try_from(n).ok() == Some(p.len()))
        })
}

impl std::ops::Deref for ApiServer {
    type Target = ControlPlane;
    fn deref(&self) -> &ControlPlane {
        &self.cp
    }
}

/// For [`ControlPlane::stop_apiserver`] and [`ControlPlane::start_apiserver`]: an outage.
impl std::ops::DerefMut for ApiServer {
    fn deref_mut(&mut self) -> &mut ControlPlane {
        &mut self.cp
    }
}

impl ApiServer {
    /// Starts an API server, or returns `None` after [`assets::skip`] names `what` when the
    /// tier's assets are not prepared.
    pub fn start_or_skip(what: &str) -> Result<Option<ApiServer>> {
        ApiServer::start_with_or_skip(what, false)
    }

    /// [`ApiServer::start_or_skip`], with kube-controller-manager and kube-scheduler too when
    /// `controllers` (the garbage collector, for tests of what goes with a deleted owner).
    pub fn start_with_or_skip(what: &str, controllers: bool) -> Result<Option<ApiServer>> {
        let assets = match Assets::load() {
            Ok(a) => a,
            Err(why) => {
                assets::skip(what, &format!("no real API server: {why}"));
                return Ok(None);
            }
        };
        ApiServer::start_with(&assets, controllers).map(Some)
    }

    /// Starts an API server of `assets`' release ([`Assets::newest`]'s, say), with the
    /// controllers when `controllers`.
    pub fn start_with(assets: &Assets, controllers: bool) -> Result<ApiServer> {
        let dir = tempfile::Builder::new()
            .prefix("gpu-vm-apiserver-")
            .tempdir()
            .context("creating the API server's directory")?;
        let opts = ControlPlaneOpts {
            controllers,
            ..ControlPlaneOpts::default()
        };
        let cp = ControlPlane::start(dir.path(), assets, opts)?;
        Ok(ApiServer {
            cp,
            kubectl: assets.kubectl.clone(),
            _dir: dir,
        })
    }

    /// `kubectl apply -f -` of `yaml`, as cluster admin.
    pub fn apply(&self, yaml: &str) -> Result<String> {
        crate::kubectl_stdin(
            &self.kubectl,
            self.cp.admin_kubeconfig(),
            &["apply", "-f", "-"],
            yaml,
        )
    }

    /// `kubectl get ARGS -o json`, as cluster admin.
    pub fn get_json(&self, args: &[&str]) -> Result<Value> {
        let mut a = vec!["get"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["-o", "json"]);
        let out = self.cp.kubectl(&a)?;
        serde_json::from_str(&out).with_context(|| format!("parsing kubectl get {args:?}"))
    }

    /// Creates Node `name` with `labels` (a Node object only: no kubelet runs).
    pub fn create_node(&self, name: &str, labels: &[(&str, &str)]) -> Result<()> {
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        let node = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": labels},
        });
        crate::kubectl_stdin(
            &self.kubectl,
            self.cp.admin_kubeconfig(),
            &["create", "-f", "-"],
            &node.to_string(),
        )?;
        Ok(())
    }

    /// Creates ResourceClaim `namespace/name` (and its namespace when missing) with `requests`
    /// (its `spec.devices.requests`), then allocates it as the scheduler does: `results`
    /// (`status.allocation.devices.results`) written through the status subresource. Returns
    /// the claim's UID.
    pub fn put_allocated_claim(
        &self,
        namespace: &str,
        name: &str,
        requests: Value,
        results: Value,
    ) -> Result<String> {
        self.apply(
            &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
                .to_string(),
        )?;
        let claim = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name},
            "spec": {"devices": {"requests": requests}},
        });
        crate::kubectl_stdin(
            &self.kubectl,
            self.cp.admin_kubeconfig(),
            &["apply", "--server-side", "-f", "-"],
            &claim.to_string(),
        )?;
        let status = json!({"status": {"allocation": {"devices": {"results": results}}}});
        self.cp.kubectl(&[
            "patch",
            "resourceclaim",
            "-n",
            namespace,
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            &status.to_string(),
        ])?;
        let uid = self.cp.kubectl(&[
            "get",
            "resourceclaim",
            "-n",
            namespace,
            name,
            "-o",
            "jsonpath={.metadata.uid}",
        ])?;
        Ok(uid.trim().to_string())
    }

    /// Node `name` as the API server stores it.
    pub fn node(&self, name: &str) -> Result<Value> {
        self.get_json(&["node", name])
    }

    /// Label `key` of Node `node` (`None`: absent, or the Node could not be read).
    pub fn label(&self, node: &str, key: &str) -> Option<String> {
        let n = self.node(node).ok()?;
        n["metadata"]["labels"][key].as_str().map(str::to_string)
    }

    /// Annotation `key` of Node `node`.
    pub fn annotation(&self, node: &str, key: &str) -> Option<String> {
        let n = self.node(node).ok()?;
        n["metadata"]["annotations"][key]
            .as_str()
            .map(str::to_string)
    }

    /// Sets (`Some`) or removes (`None`) label `key` of Node `node`, as an administrator would
    /// with `kubectl label`.
    pub fn set_label(&self, node: &str, key: &str, value: Option<&str>) -> Result<()> {
        let arg = match value {
            Some(v) => format!("{key}={v}"),
            None => format!("{key}-"),
        };
        self.cp
            .kubectl(&["label", "node", node, &arg, "--overwrite"])?;
        Ok(())
    }

    /// Polls label `key` of Node `node` until `pred` holds, for at most `timeout`.
    pub fn wait_for_label(
        &self,
        node: &str,
        key: &str,
        timeout: Duration,
        pred: impl Fn(Option<&str>) -> bool,
    ) -> bool {
        let end = Instant::now() + timeout;
        loop {
            if pred(self.label(node, key).as_deref()) {
                return true;
            }
            if Instant::now() > end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The Events of `namespace` as `kubectl get events` lists them (core/v1: `reason`,
    /// `message`, `count`, `involvedObject`, `type`), oldest first.
    pub fn events(&self, namespace: &str) -> Result<Vec<Value>> {
        let v = self.get_json(&[
            "events",
            "-n",
            namespace,
            "--sort-by=.metadata.creationTimestamp",
        ])?;
        Ok(v["items"].as_array().cloned().unwrap_or_default())
    }

    /// Polls the Events of `namespace` until one has `reason`, for at most `timeout`.
    pub fn wait_for_event(
        &self,
        namespace: &str,
        reason: &str,
        timeout: Duration,
    ) -> Option<Value> {
        let end = Instant::now() + timeout;
        loop {
            if let Ok(evs) = self.events(namespace)
                && let Some(e) = evs.into_iter().find(|e| e["reason"] == reason)
            {
                return Some(e);
            }
            if Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Creates namespace `gpu-operator` and the GPU Operator's service accounts, roles and
    /// bindings for its three VM operands (`tests/cluster/fixtures/gpu-operator-rbac.yaml`).
    pub fn apply_gpu_operator_rbac(&self) -> Result<()> {
        self.apply("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: gpu-operator\n")?;
        let file = assets::repo().join("tests/cluster/fixtures/gpu-operator-rbac.yaml");
        let yaml = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        self.apply(&yaml)?;
        Ok(())
    }

    /// A kubeconfig authenticating as service account `namespace/name` (a client certificate
    /// with the user name and groups a service account token gives): RBAC treats it as that
    /// service account.
    pub fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> Result<PathBuf> {
        let group = format!("system:serviceaccounts:{namespace}");
        self.cp.kubeconfig_for(
            &format!("sa-{namespace}-{name}"),
            &format!("system:serviceaccount:{namespace}:{name}"),
            &["system:serviceaccounts", &group, "system:authenticated"],
        )
    }

    /// The audit log's entries (stage `ResponseComplete`) for `resource` requests, in order.
    pub fn audited(&self, resource: &str) -> Vec<Value> {
        let text = std::fs::read_to_string(self.cp.audit_log()).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["stage"] == "ResponseComplete" && e["objectRef"]["resource"] == resource)
            .collect()
    }

    /// Watches label `key` of Node `node` (`kubectl get --watch`): every value it takes from
    /// now on, in order, none missed.
    pub fn watch_label(&self, node: &str, key: &str) -> Result<LabelWatch> {
        LabelWatch::start(&self.kubectl, self.cp.admin_kubeconfig(), node, key)
    }
}

/// The values a Node's label took, as a watch of the Node delivered them.
#[derive(Debug)]
pub struct LabelWatch {
    child: Child,
    seen: Arc<Mutex<Vec<Option<String>>>>,
}

impl LabelWatch {
    fn start(kubectl: &Path, kubeconfig: &Path, node: &str, key: &str) -> Result<LabelWatch> {
        let mut child = Command::new(kubectl)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["get", "node", node, "--watch", "-o", "json"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting kubectl get --watch")?;
        let stdout = child.stdout.take().context("kubectl's stdout")?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let s = seen.clone();
        let key = key.to_string();
        std::thread::spawn(move || {
            // One JSON object after another (the Node as it is, then at every change), read
            // as a stream until kubectl is killed.
            let objects = serde_json::Deserializer::from_reader(BufReader::new(stdout));
            for obj in objects.into_iter::<Value>() {
                let Ok(obj) = obj else { break };
                let v = obj["metadata"]["labels"][&key].as_str().map(str::to_string);
                let mut seen = s.lock().unwrap_or_else(|p| p.into_inner());
                if seen.last() != Some(&v) || seen.is_empty() {
                    seen.push(v);
                }
                let _ = first_tx.send(());
            }
        });
        // The Node as it was when the watch began: every change after it is seen.
        first_rx
            .recv_timeout(Duration::from_secs(30))
            .context("kubectl get --watch printed nothing")?;
        Ok(LabelWatch { child, seen })
    }

    /// The values so far, the one when the watch began first; a repeat of the same value is
    /// one entry.
    pub fn history(&self) -> Vec<Option<String>> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for LabelWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
