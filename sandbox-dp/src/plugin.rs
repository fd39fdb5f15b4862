//! One gRPC device-plugin server per resource, its socket and its registration with kubelet.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use common::state::{self, file_identity};
use daemon_kit::reconcile::Backoff;
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};
use tower::service_fn;

use crate::alloc::{self, DevNodes};
use crate::api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use crate::api::registration_client::RegistrationClient;
use crate::api::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, Empty, ListAndWatchResponse, NumaNode, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
    RegisterRequest, TopologyInfo,
};
use crate::discovery::{DeviceInfo, HEALTHY, Resource, UNHEALTHY};
use crate::metrics::Metrics;
use crate::ondemand::Pool;

/// The device-plugin API version we implement.
pub const API_VERSION: &str = "v1beta1";
/// kubelet's registration socket in the plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// First and longest wait before registering again after a failure (any plugin-directory
/// event, such as kubelet.sock being created, retries at once).
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// How long a server may take to finish its calls when stopping.
const SERVER_STOP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a connect or a call to kubelet (or our own socket) may take.
const RPC_TIMEOUT: Duration = Duration::from_secs(5);

/// What a resource's server answers from: its devices and the host's iommufd nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceState {
    /// The resource.
    pub resource: Resource,
    /// iommufd nodes present on the host.
    pub nodes: DevNodes,
}

/// The socket file name for a resource: `sandbox-dp-nvidia.com_GA102GL_A10.sock`.
pub fn socket_name(resource: &str) -> String {
    format!("sandbox-dp-{}.sock", resource.replace('/', "_"))
}

/// The ListAndWatch message for a state.
pub fn list_response(state: &ResourceState) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: state
            .resource
            .devices
            .values()
            .map(|d| Device {
                id: d.id.clone(),
                health: if d.healthy { HEALTHY } else { UNHEALTHY }.to_string(),
                topology: d.numa_node.map(|n| TopologyInfo {
                    nodes: vec![NumaNode { id: i64::from(n) }],
                }),
            })
            .collect(),
    }
}

/// The gRPC service of one resource.
#[derive(Clone, Debug)]
pub struct Plugin {
    name: String,
    state: watch::Receiver<Arc<ResourceState>>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
    pool: Option<Arc<Pool>>,
}

impl Plugin {
    /// A service answering from `state`; its ListAndWatch streams end when `stop` fires, so
    /// that the server can shut down.
    pub fn new(
        name: String,
        state: watch::Receiver<Arc<ResourceState>>,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
        pool: Option<Arc<Pool>>,
    ) -> Self {
        Plugin {
            name,
            state,
            metrics,
            stop,
            pool,
        }
    }

    /// Allocate for an on-demand resource: creates each container's vGPUs (on the blocking
    /// pool) and answers as for pre-created ones.
    async fn allocate_on_demand(
        &self,
        pool: Arc<Pool>,
        state: &ResourceState,
        req: AllocateRequest,
    ) -> Result<Response<AllocateResponse>, Status> {
        let mut out = Vec::new();
        for c in req.container_requests {
            let (p, name, ids) = (pool.clone(), self.name.clone(), c.devices_ids.clone());
            let made = tokio::task::spawn_blocking(move || p.allocate(&name, &ids))
                .await
                .map_err(|e| Status::internal(format!("allocation task: {e}")))?;
            match made {
                Ok(made) => {
                    self.metrics.allocation(&self.name, true);
                    let handles: Vec<String> = made.iter().map(|m| m.handle.clone()).collect();
                    let devs: Vec<&DeviceInfo> = made.iter().map(|m| &m.info).collect();
                    tracing::info!(resource = %self.name, devices = %c.devices_ids.join(","), vgpus = %handles.join(","), "allocated on demand");
                    out.push(alloc::respond(
                        &state.resource.env_var(),
                        &handles,
                        &devs,
                        &state.nodes,
                    ));
                }
                Err(e) => {
                    self.metrics.allocation(&self.name, false);
                    let e = common::error_chain(&e);
                    tracing::warn!(resource = %self.name, error = %e, "on-demand allocation failed");
                    return Err(Status::failed_precondition(e));
                }
            }
        }
        Ok(Response::new(AllocateResponse {
            container_responses: out,
        }))
    }

    fn options() -> DevicePluginOptions {
        DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    type ListAndWatchStream = ListStream;

    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(Self::options()))
    }

    /// The current list, then a new one each time the resource's state changes, until the
    /// server stops.
    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        tracing::debug!(resource = %self.name, "ListAndWatch opened");
        let lists = WatchStream::new(self.state.clone()).map(|st| Ok(list_response(&st)));
        let s = futures::StreamExt::take_until(lists, self.stop.clone().cancelled_owned());
        Ok(Response::new(Box::pin(s)))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let state = self.state.borrow().clone();
        let mut out = Vec::new();
        for c in req.into_inner().container_requests {
            let size = usize::try_from(c.allocation_size).unwrap_or(0);
            if state.resource.on_demand
                && let Some(pool) = &self.pool
            {
                let ids =
                    pool.preferred(&c.available_device_i_ds, &c.must_include_device_i_ds, size);
                out.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
                continue;
            }
            let ids = alloc::preferred(
                &state.resource,
                &c.available_device_i_ds,
                &c.must_include_device_i_ds,
                size,
            );
            out.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(PreferredAllocationResponse {
            container_responses: out,
        }))
    }

    async fn allocate(
        &self,
        req: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let state = self.state.borrow().clone();
        if state.resource.on_demand
            && let Some(pool) = self.pool.clone()
        {
            return self
                .allocate_on_demand(pool, &state, req.into_inner())
                .await;
        }
        let mut out = Vec::new();
        for c in req.into_inner().container_requests {
            match alloc::allocate(&state.resource, &c.devices_ids, &state.nodes) {
                Ok(r) => {
                    self.metrics.allocation(&self.name, true);
                    tracing::info!(resource = %self.name, devices = %c.devices_ids.join(","), "allocated");
                    out.push(r);
                }
                Err(e) => {
                    self.metrics.allocation(&self.name, false);
                    tracing::warn!(error = %e, "allocation refused");
                    return Err(Status::invalid_argument(e.to_string()));
                }
            }
        }
        Ok(Response::new(AllocateResponse {
            container_responses: out,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// A gRPC channel over a Unix socket.
pub async fn unix_channel(path: &Path) -> anyhow::Result<Channel> {
    let p = path.to_path_buf();
    let ch = Endpoint::try_from("http://[::1]:50051")?
        .connect_timeout(RPC_TIMEOUT)
        .timeout(RPC_TIMEOUT)
        .connect_with_connector(service_fn(move |_: Uri| {
            let p = p.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?)) }
        }))
        .await
        .with_context(|| format!("connecting to {}", path.display()))?;
    Ok(ch)
}

/// Everything one resource task needs.
#[derive(Debug)]
pub struct ResourceTask {
    /// Resource name.
    pub name: String,
    /// The plugin directory.
    pub kubelet_dir: PathBuf,
    /// The resource's devices.
    pub state: watch::Receiver<Arc<ResourceState>>,
    /// Shared metrics.
    pub metrics: Arc<Metrics>,
    /// Bumped on any event in the plugin directory (and on resync).
    pub wake: watch::Receiver<u64>,
    /// Bumped each time `kubelet.sock` is created.
    pub kubelet_generation: Arc<AtomicU64>,
    /// Stops the task; it removes its socket.
    pub shutdown: CancellationToken,
    /// The on-demand pool, whose resources' Allocate creates vGPUs.
    pub pool: Option<Arc<Pool>>,
}

enum Registered {
    No,
    /// Registered with the kubelet socket of this identity and generation.
    Yes(Option<state::FileIdentity>, u64),
}

impl ResourceTask {
    /// Serves and registers until shutdown; serves again when the socket is removed and
    /// registers again when kubelet restarts; retries failed registrations with a backoff.
    /// Returns an error when the socket cannot be bound or the server fails.
    pub async fn run(mut self) -> anyhow::Result<()> {
        let endpoint = socket_name(&self.name);
        let path = self.kubelet_dir.join(&endpoint);
        loop {
            match state::remove_if_present(&path) {
                Ok(true) => tracing::debug!(socket = %path.display(), "removed a stale socket"),
                Ok(false) => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("removing {}", path.display()));
                }
            }
            let listener = UnixListener::bind(&path)
                .with_context(|| format!("binding {} for {}", path.display(), self.name))?;
            let own = file_identity(&path);
            let stop = self.shutdown.child_token();
            let svc = DevicePluginServer::new(Plugin::new(
                self.name.clone(),
                self.state.clone(),
                self.metrics.clone(),
                stop.clone(),
                self.pool.clone(),
            ));
            let stop2 = stop.clone();
            // Served through daemon-kit so that every client is answered, whatever
            // `:authority` it sends (kubelet sends `localhost`, grpcio the socket path).
            let router = Server::builder().add_service(svc);
            let mut server = tokio::spawn(daemon_kit::grpc::serve_unix(
                router,
                listener,
                stop2.cancelled_owned(),
            ));
            // The socket listens from its bind on: kubelet's first dial waits in the backlog
            // until the server accepts it, so no call to ourselves is needed before kubelet is
            // told. A server that ended as it started is caught here, before kubelet is told.
            tokio::task::yield_now().await;
            if server.is_finished() {
                let res = (&mut server)
                    .await
                    .with_context(|| format!("server task of {}", self.name))?;
                res.with_context(|| format!("gRPC server of {} on {}", self.name, path.display()))?;
                bail!(
                    "gRPC server of {} on {} stopped as it started",
                    self.name,
                    path.display()
                );
            }
            tracing::info!(resource = %self.name, socket = %path.display(), "serving");
            let mut registered = Registered::No;
            // Every resource of the node retries on its own jittered delays: when kubelet
            // refuses or does not answer, they do not all call it again at the same moment.
            let mut backoff = Backoff::new(RETRY_MIN, RETRY_MAX);
            let rebind = loop {
                self.register_if_needed(&endpoint, &mut registered).await?;
                let retry = matches!(registered, Registered::No)
                    && file_identity(&self.kubelet_dir.join(KUBELET_SOCKET)).is_some();
                let delay = if retry {
                    backoff.next_delay()
                } else {
                    backoff.reset();
                    RETRY_MAX
                };
                tokio::select! {
                    _ = self.shutdown.cancelled() => break false,
                    res = &mut server => {
                        let res = res.with_context(|| format!("server task of {}", self.name))?;
                        res.with_context(|| format!("gRPC server of {} on {}", self.name, path.display()))?;
                        if self.shutdown.is_cancelled() {
                            if file_identity(&path) == own {
                                let _ = state::remove_if_present(&path);
                            }
                            return Ok(());
                        }
                        bail!("gRPC server of {} on {} stopped", self.name, path.display());
                    }
                    ch = self.wake.changed() => {
                        if ch.is_err() { break false; }
                    }
                    _ = tokio::time::sleep(delay), if retry => {}
                }
                if file_identity(&path) != own {
                    tracing::info!(resource = %self.name, socket = %path.display(), "our socket was removed; serving again");
                    break true;
                }
            };
            stop.cancel();
            match tokio::time::timeout(SERVER_STOP_TIMEOUT, &mut server).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => {
                    tracing::warn!(resource = %self.name, error = %e, "server ended with an error")
                }
                Ok(Err(e)) => {
                    tracing::warn!(resource = %self.name, error = %e, "server task failed")
                }
                Err(_) => {
                    tracing::warn!(resource = %self.name, "server did not stop in time; dropping its connections");
                    server.abort();
                }
            }
            if !rebind {
                if file_identity(&path) == own {
                    let _ = state::remove_if_present(&path);
                }
                tracing::info!(resource = %self.name, "stopped");
                return Ok(());
            }
        }
    }

    async fn register_if_needed(
        &self,
        endpoint: &str,
        registered: &mut Registered,
    ) -> anyhow::Result<()> {
        let ksock = self.kubelet_dir.join(KUBELET_SOCKET);
        let ident = file_identity(&ksock);
        if ident.is_none() {
            if matches!(registered, Registered::Yes(..)) {
                tracing::info!(resource = %self.name, "kubelet socket gone; waiting for kubelet");
            }
            *registered = Registered::No;
            return Ok(());
        }
        let generation = self.kubelet_generation.load(Ordering::SeqCst);
        if let Registered::Yes(id, g) = registered
            && *id == ident
            && *g == generation
        {
            return Ok(());
        }
        let ch = match unix_channel(&ksock).await {
            Ok(ch) => ch,
            Err(e) => {
                tracing::warn!(resource = %self.name, error = format!("{e:#}"), "kubelet does not answer; will retry");
                *registered = Registered::No;
                return Ok(());
            }
        };
        let req = RegisterRequest {
            version: API_VERSION.to_string(),
            endpoint: endpoint.to_string(),
            resource_name: self.name.clone(),
            options: Some(Plugin::options()),
        };
        match RegistrationClient::new(ch).register(req).await {
            Ok(_) => {
                self.metrics.registration(&self.name);
                tracing::info!(resource = %self.name, endpoint, "registered with kubelet");
                *registered = Registered::Yes(ident, generation);
            }
            Err(s) => {
                // kubelet answers refusals with code Unknown, like transport failures: retry
                // both (every second) rather than crash-loop.
                tracing::error!(
                    resource = %self.name,
                    kubelet = %ksock.display(),
                    error = %s.message(),
                    "registration failed; will retry"
                );
                *registered = Registered::No;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::discovery::Kind;

    fn device(id: &str, healthy: bool, numa_node: Option<i32>) -> DeviceInfo {
        DeviceInfo {
            id: id.to_string(),
            healthy,
            numa_node,
            iommu_group: Some(7),
            vfio_cdev: None,
            gpu: None,
            switch: None,
            driver: Some("vfio-pci".to_string()),
        }
    }

    fn state(devices: Vec<DeviceInfo>) -> Arc<ResourceState> {
        let mut resource = Resource::new("nvidia.com/NVIDIA_L40S-1Q".to_string(), Kind::SriovVgpu);
        resource.devices = devices
            .into_iter()
            .map(|d| (d.id.clone(), d))
            .collect::<BTreeMap<_, _>>();
        Arc::new(ResourceState {
            resource,
            nodes: DevNodes::default(),
        })
    }

    /// Each device of a list: id, health, NUMA nodes (None without a topology).
    fn summary(list: &ListAndWatchResponse) -> Vec<(&str, &str, Option<Vec<i64>>)> {
        list.devices
            .iter()
            .map(|d| {
                let numa = d
                    .topology
                    .as_ref()
                    .map(|t| t.nodes.iter().map(|n| n.id).collect());
                (d.id.as_str(), d.health.as_str(), numa)
            })
            .collect()
    }

    #[test]
    fn the_list_has_every_device_in_id_order_with_its_health_and_numa_node() {
        let st = state(vec![
            device("3f2a5c1e-0b7d-4e8a-9c61-2d4b8e0f7a13", true, Some(3)),
            device("0000:c1:00.0", true, Some(-1)),
            device("0000:41:00.5", true, None),
            device("0000:41:00.4", false, Some(1)),
            device("0000:c1:00.1", false, Some(0)),
        ]);
        assert_eq!(
            summary(&list_response(&st)),
            [
                ("0000:41:00.4", "Unhealthy", Some(vec![1])),
                ("0000:41:00.5", "Healthy", None),
                ("0000:c1:00.0", "Healthy", Some(vec![-1])),
                ("0000:c1:00.1", "Unhealthy", Some(vec![0])),
                (
                    "3f2a5c1e-0b7d-4e8a-9c61-2d4b8e0f7a13",
                    "Healthy",
                    Some(vec![3])
                ),
            ]
        );
        assert!(list_response(&state(vec![])).devices.is_empty());
    }

    #[test]
    fn a_big_list_keeps_every_device_and_its_health() {
        let devices: Vec<DeviceInfo> = (0..512)
            .map(|i| {
                device(
                    &format!("0000:{:02x}:{:02x}.{}", 0x40 + i / 256, (i / 8) % 32, i % 8),
                    i != 77,
                    Some(i / 128),
                )
            })
            .collect();
        let list = list_response(&state(devices));
        assert_eq!(list.devices.len(), 512);
        let sick: Vec<&str> = list
            .devices
            .iter()
            .filter(|d| d.health == UNHEALTHY)
            .map(|d| d.id.as_str())
            .collect();
        assert_eq!(sick, ["0000:40:09.5"]);
    }

    #[tokio::test]
    async fn list_and_watch_sends_the_state_then_each_change_and_ends_on_stop() {
        let (tx, rx) = watch::channel(state(vec![device("0000:41:00.0", true, Some(0))]));
        let stop = CancellationToken::new();
        let plugin = Plugin::new(
            "nvidia.com/NVIDIA_L40S-1Q".into(),
            rx,
            Arc::new(Metrics::default()),
            stop.clone(),
            None,
        );
        let mut lists = plugin
            .list_and_watch(Request::new(Empty {}))
            .await
            .unwrap()
            .into_inner();
        // A list that does not come fails the test instead of hanging it.
        let mut next = async || {
            tokio::time::timeout(Duration::from_secs(10), lists.next())
                .await
                .expect("no list within 10 s")
        };
        let first = next().await.unwrap().unwrap();
        assert_eq!(
            summary(&first),
            [("0000:41:00.0", "Healthy", Some(vec![0]))]
        );
        tx.send_replace(state(vec![
            device("0000:41:00.0", false, Some(0)),
            device("0000:42:00.0", true, None),
        ]));
        let second = next().await.unwrap().unwrap();
        assert_eq!(
            summary(&second),
            [
                ("0000:41:00.0", "Unhealthy", Some(vec![0])),
                ("0000:42:00.0", "Healthy", None),
            ]
        );
        stop.cancel();
        assert!(
            next().await.is_none(),
            "the stream ends when the server stops"
        );
    }
}
