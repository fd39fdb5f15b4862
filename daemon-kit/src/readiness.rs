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

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use common::state::readiness;
use common::{HostPaths, error_chain};
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
    /// Keeps readiness file `name` under `paths`' validations directory until `shutdown`.
    pub fn start(
        paths: &HostPaths,
        name: &str,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Keeper> {
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
