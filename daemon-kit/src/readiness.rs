//! A readiness file kept in place while its daemon vouches, whoever removes it.
//!
//! `<host-root>/run/nvidia/validations` is shared: the GPU Operator's nvidia-validator deletes
//! the files in it (and the directory itself) when it starts and in its preStop hook, and writes
//! its own. A daemon of ours that wrote `vfio-pci-ready` or `vgpu-devices-ready` and still
//! vouches for what it says puts it back as soon as it is gone (inotify on the directory and on
//! its parent, which sees the directory removed and made again), so that an init container or a
//! probe waiting on the file never reads "not ready" while the node is. When the daemon
//! withdraws, the file stays away; when it stops (its pod deleted on a relabel or a rollout,
//! SIGTERM), the file goes with it: nobody vouches any more, and an init container waiting on it
//! must not pass on a file left behind by a daemon that no longer runs.
//!
//! Whoever waits for the node to be prepared waits for the file of the node's workload
//! ([`wait_for_workload`]: the node label `nvidia.com/gpu.workload.config`), never for any file
//! there: a node relabelled from passthrough to vGPU may still have `vfio-pci-ready` from a
//! vfio-manager killed on the way, which says nothing of its vGPUs.
//!
//! A daemon that does not stop cleanly (killed, OOM-killed, a crash) cannot remove its file: the
//! next one removes whatever it finds when it starts ([`Keeper::start`]), before anything that
//! may fail or take long, and writes it again only once it has verified the node itself. So
//! the file is there only while a running daemon vouches for what it says, or for the short
//! time between a crash and the restart.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use common::state::readiness;
use common::{HostPaths, error_chain};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::core::PartialObjectMeta;
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// One readiness file, written by [`Keeper::vouch`], removed by [`Keeper::withdraw`], and
/// written again whenever it disappears in between.
#[derive(Debug, Clone)]
pub struct Keeper {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    paths: HostPaths,
    name: String,
    /// The body while the daemon vouches; `None` once it withdrew.
    body: Mutex<Option<String>>,
}

impl Inner {
    fn body(&self) -> MutexGuard<'_, Option<String>> {
        self.body.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes the file again if the daemon vouches and it is gone; whether it did.
    fn restore(&self) -> bool {
        let body = self.body();
        let Some(text) = body.as_deref() else {
            return false;
        };
        if readiness::path(&self.paths, &self.name).exists() {
            return false;
        }
        match readiness::set(&self.paths, &self.name, text) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot write the readiness file again");
                false
            }
        }
    }
}

impl Drop for Inner {
    /// The daemon stops (the last holder of the keeper is gone): it vouches no more.
    fn drop(&mut self) {
        if self.body().take().is_some() {
            match readiness::withdraw(&self.paths, &self.name) {
                Ok(true) => tracing::info!(
                    path = %readiness::path(&self.paths, &self.name).display(),
                    "stopping: readiness file removed"
                ),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %error_chain(&e), "stopping: cannot remove the readiness file")
                }
            }
        }
    }
}

impl Keeper {
    /// Keeps readiness file `name` under `paths`' validations directory until `shutdown`. A
    /// file already there (left by a daemon that did not stop cleanly) is removed first: it is
    /// written again by [`Keeper::vouch`] once this daemon has verified what it says.
    pub fn start(
        paths: &HostPaths,
        name: &str,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Keeper> {
        let path = readiness::path(paths, name);
        match readiness::withdraw(paths, name) {
            Ok(true) => tracing::info!(
                path = %path.display(),
                "readiness file left from before removed: written again once verified"
            ),
            Ok(false) => {}
            Err(e) => {
                return Err(anyhow::Error::new(e)
                    .context("cannot remove the readiness file left from before"));
            }
        }
        let inner = Arc::new(Inner {
            paths: paths.clone(),
            name: name.to_string(),
            body: Mutex::new(None),
        });
        let dir = paths.validations_dir();
        let parent = dir
            .parent()
            .map(PathBuf::from)
            .context("the validations directory has no parent")?;
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let (tx, mut rx) = mpsc::channel::<()>(8);
        let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
            if ev.is_ok_and(|e| e.kind.is_remove() || e.kind.is_create()) {
                let _ = tx.try_send(());
            }
        })
        .context("cannot start watching files")?;
        for d in [&parent, &dir] {
            watcher
                .watch(d, RecursiveMode::NonRecursive)
                .with_context(|| format!("cannot watch {}", d.display()))?;
        }
        let keeper = inner.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    ev = rx.recv() => if ev.is_none() { break },
                }
                // Let a burst (a directory removed with its files, then made again) settle.
                tokio::time::sleep(Duration::from_millis(50)).await;
                while rx.try_recv().is_ok() {}
                // A directory made again is a new inode: watch it (a second watch of the same
                // one is harmless).
                let _ = watcher.watch(&dir, RecursiveMode::NonRecursive);
                let k = keeper.clone();
                if let Ok(true) = tokio::task::spawn_blocking(move || k.restore()).await {
                    tracing::info!(
                        path = %readiness::path(&keeper.paths, &keeper.name).display(),
                        "the readiness file was removed behind our back; written again"
                    );
                }
            }
        });
        Ok(Keeper { inner })
    }

    /// Writes the file with `body` and keeps it.
    pub fn vouch(&self, body: &str) -> common::Result<()> {
        let mut b = self.inner.body();
        readiness::set(&self.inner.paths, &self.inner.name, body)?;
        *b = Some(body.to_string());
        Ok(())
    }

    /// Removes the file and lets it stay away; `Ok(true)` when there was one to remove.
    pub fn withdraw(&self) -> common::Result<bool> {
        let mut b = self.inner.body();
        *b = None;
        readiness::withdraw(&self.inner.paths, &self.inner.name)
    }
}

/// How often [`wait_for_workload`] looks for the file, and how often it reads the node's label
/// again (a relabel while it waits changes the file it waits for).
const LOOK_EVERY: Duration = Duration::from_secs(1);
const LABEL_EVERY: u32 = 5;
/// The most one read of the Node may take.
const NODE_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits until node `node` is prepared for the device plugin: the readiness file of its
/// workload (the label [`readiness::WORKLOAD_LABEL`]: `vm-passthrough` → `vfio-pci-ready`,
/// `vm-vgpu` → `vgpu-devices-ready`) exists under `paths`. The label is read from `client` at
/// once and again every few seconds; while it cannot be read, or names another workload, the
/// wait goes on (said in the log, once per change). Returns the file found, or `None` when
/// `shutdown` came first.
pub async fn wait_for_workload(
    paths: &HostPaths,
    node: &str,
    client: kube::Client,
    shutdown: &CancellationToken,
) -> Option<PathBuf> {
    let nodes: Api<PartialObjectMeta<Node>> = Api::all(client);
    let mut workload: Option<String> = None;
    let mut said = String::new();
    let mut say = |line: String| {
        if line != said {
            tracing::info!("{line}");
            said = line;
        }
    };
    let mut tick = tokio::time::interval(LOOK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n: u32 = 0;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tick.tick() => {}
        }
        let read_label = n.is_multiple_of(LABEL_EVERY);
        n = n.wrapping_add(1);
        if read_label {
            match tokio::time::timeout(NODE_READ_TIMEOUT, nodes.get_metadata(node)).await {
                Ok(Ok(m)) => {
                    workload = Some(
                        m.metadata
                            .labels
                            .and_then(|mut l| l.remove(readiness::WORKLOAD_LABEL))
                            .unwrap_or_default(),
                    );
                }
                Ok(Err(e)) => say(format!(
                    "cannot read node {node}'s labels: {e}; trying again"
                )),
                Err(_) => say(format!(
                    "cannot read node {node}'s labels: no answer within {NODE_READ_TIMEOUT:?}; trying again"
                )),
            }
        }
        let Some(w) = workload.as_deref() else {
            continue;
        };
        match readiness::for_workload(w) {
            Some(name) => {
                let path = readiness::path(paths, name);
                if path.exists() {
                    tracing::info!(path = %path.display(), "node {node} ({w}) is prepared");
                    return Some(path);
                }
                say(format!(
                    "waiting for {} (node {node} is {} {w})",
                    path.display(),
                    readiness::WORKLOAD_LABEL
                ));
            }
            None => say(format!(
                "node {node} is {} {w:?}: no readiness file of this device plugin's; waiting \
                 for a workload of vm-passthrough or vm-vgpu",
                readiness::WORKLOAD_LABEL
            )),
        }
    }
}
