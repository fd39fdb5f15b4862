//! A Kubernetes client from `--kubeconfig`, or in-cluster (or `$KUBECONFIG`) without one.

use std::path::Path;

use anyhow::Context as _;

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
