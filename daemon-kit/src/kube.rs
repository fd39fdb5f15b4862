//! A Kubernetes client from `--kubeconfig`, or in-cluster (or `$KUBECONFIG`) without one.

use std::path::Path;

use std::time::Duration;

use anyhow::Context as _;
use kube::runtime::utils::ResetTimerBackoff;
use kube::runtime::watcher::ExponentialBackoff;

/// A client for the API server `kubeconfig` names; without one, the pod's service account (or
/// the file `$KUBECONFIG` names).
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    kube::Client::try_from(config(kubeconfig).await?).context("cannot make a Kubernetes client")
}

/// The configuration [`client`] builds its client from, for a daemon that sets more (its
/// timeouts) before making one.
pub async fn config(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Config> {
    Ok(match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p)
                .with_context(|| format!("cannot read kubeconfig {}", p.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("kubeconfig {}", p.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no in-cluster config and no kubeconfig")?,
    })
}

/// The first delay before a watch that failed is tried again ([`watch_backoff`]).
pub const WATCH_RETRY_MIN: Duration = Duration::from_millis(800);
/// The longest delay before a watch that failed is tried again, jitter left out.
pub const WATCH_RETRY_MAX: Duration = Duration::from_secs(8);

/// The backoff of a daemon's watch of its own node's objects (`.backoff(watch_backoff())` on a
/// kube-runtime watcher): from [`WATCH_RETRY_MIN`] doubling to [`WATCH_RETRY_MAX`], each delay
/// plus a random part of up to itself, started over after 2 minutes without a failure.
///
/// kube-runtime's default (client-go's reflector: up to 30 s, so up to 60 s with its jitter) is
/// made for controllers that list a whole cluster. A daemon watches one object or a handful
/// through a field selector: a try is one small request, and while the API server is away it
/// is a refused connection. With the shorter cap a node follows a label changed during or
/// right after an outage within about 16 s of the API server's return, not a minute.
pub fn watch_backoff() -> ResetTimerBackoff<ExponentialBackoff> {
    let exp = backon::ExponentialBuilder::default()
        .with_min_delay(WATCH_RETRY_MIN)
        .with_max_delay(WATCH_RETRY_MAX)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times();
    ResetTimerBackoff::new(exp.into(), Duration::from_secs(120))
}
