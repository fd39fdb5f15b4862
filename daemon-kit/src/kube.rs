//! A Kubernetes client from `--kubeconfig`, or in-cluster (or `$KUBECONFIG`) without one; and
//! one for long watches ([`watch_client`]).

use std::path::Path;

use std::time::Duration;

use anyhow::Context as _;
use hyper_util::client::legacy::connect::HttpConnector;
use kube::client::ConfigExt as _;
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

/// How long a watch's connection carries nothing before TCP asks whether the API server is
/// still there ([`watch_client`]).
pub const WATCH_KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// The time between two such probes.
pub const WATCH_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
/// How many probes go unanswered before the connection is taken as dead.
pub const WATCH_KEEPALIVE_PROBES: u32 = 4;

/// A client for long watches, made from `config` (its server, TLS, credentials, headers and
/// connect timeout). It has no read timeout: a quiet watch says nothing, not even a bookmark,
/// for as long as the API server keeps it open (kube-apiserver sends a bookmark only once its
/// cache of the resource moved), so a read timeout shorter than the watch would cut it. Its
/// connections have TCP keepalive instead ([`WATCH_KEEPALIVE_IDLE`], then
/// [`WATCH_KEEPALIVE_PROBES`] probes [`WATCH_KEEPALIVE_INTERVAL`] apart): one whose API server
/// vanished without closing it (its host gone, a network partition) fails within two minutes,
/// and the watcher opens another, instead of going unnoticed until the watch's timeout.
///
/// With a proxy (`proxy_url`), kube's own client without a read timeout (and without
/// keepalive).
pub fn watch_client(config: &kube::Config) -> anyhow::Result<kube::Client> {
    if config.proxy_url.is_some() {
        let mut config = config.clone();
        config.read_timeout = None;
        return kube::Client::try_from(config).context("cannot make a Kubernetes client");
    }
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_connect_timeout(config.connect_timeout);
    tcp.set_keepalive(Some(WATCH_KEEPALIVE_IDLE));
    tcp.set_keepalive_interval(Some(WATCH_KEEPALIVE_INTERVAL));
    tcp.set_keepalive_retries(Some(WATCH_KEEPALIVE_PROBES));
    let https = config
        .rustls_https_connector_with_connector(tcp)
        .context("cannot set up TLS to the API server")?;
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, kube::client::Body>(https);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .auth_layer()
                .context("cannot set up the credentials for the API server")?,
        )
        .layer(
            config
                .extra_headers_layer()
                .context("cannot set up the headers for the API server")?,
        )
        .map_err(tower::BoxError::from)
        .service(http);
    Ok(kube::Client::new(service, config.default_namespace.clone()))
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

/// What the API server says of a pod that a node's kubelet does not list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodOnNode {
    /// It is bound to the node and not finished (phase `Pending` or `Running`, or a deletion
    /// still under way): its containers may run there.
    Runs(String),
    /// It no longer runs there: why (deleted, finished, or bound to another node).
    Gone(String),
}

/// Why [`NodePods::pod`] has no answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PodLookupError {
    /// The daemon's account may not read pods: asking again will not help.
    #[error("may not read pods: {0}")]
    Forbidden(String),
    /// No answer now (the API server away, a timeout, an error).
    #[error("{0}")]
    Failed(String),
}

/// The pods of one node, as the API server knows them.
#[derive(Clone)]
pub struct NodePods {
    client: kube::Client,
    node: String,
}

impl std::fmt::Debug for NodePods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodePods")
            .field("node", &self.node)
            .finish()
    }
}

impl NodePods {
    /// The pods of node `node` through `client`.
    pub fn new(client: kube::Client, node: &str) -> NodePods {
        NodePods {
            client,
            node: node.to_string(),
        }
    }

    /// Whether pod `namespace/name` still runs on the node, asked within `timeout`.
    pub async fn pod(
        &self,
        namespace: &str,
        name: &str,
        timeout: Duration,
    ) -> Result<PodOnNode, PodLookupError> {
        use k8s_openapi::api::core::v1::Pod;
        let api: kube::Api<Pod> = kube::Api::namespaced(self.client.clone(), namespace);
        let pod = match tokio::time::timeout(timeout, api.get_opt(name)).await {
            Err(_) => {
                return Err(PodLookupError::Failed(format!(
                    "the API server did not answer within {timeout:?}"
                )));
            }
            Ok(Err(kube::Error::Api(e))) if e.code == 403 => {
                return Err(PodLookupError::Forbidden(e.message));
            }
            Ok(Err(e)) => return Err(PodLookupError::Failed(e.to_string())),
            Ok(Ok(p)) => p,
        };
        let node = &self.node;
        let Some(pod) = pod else {
            return Ok(PodOnNode::Gone(format!(
                "pod {namespace}/{name} no longer exists"
            )));
        };
        let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        if bound != Some(node.as_str()) {
            return Ok(PodOnNode::Gone(format!(
                "pod {namespace}/{name} is bound to {}",
                bound.unwrap_or("no node")
            )));
        }
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_else(|| "Pending".into());
        Ok(match phase.as_str() {
            "Succeeded" | "Failed" => {
                PodOnNode::Gone(format!("pod {namespace}/{name} has finished ({phase})"))
            }
            _ if pod.metadata.deletion_timestamp.is_some() => PodOnNode::Runs(format!(
                "pod {namespace}/{name} is {phase} on {node}, being deleted"
            )),
            _ => PodOnNode::Runs(format!("pod {namespace}/{name} is {phase} on {node}")),
        })
    }
}
