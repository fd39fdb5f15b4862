//! kubelet's PodResources service (`PodResourcesLister`, API `v1`) on a Unix socket, as kubelet
//! serves it on `<kubelet-root>/pod-resources/kubelet.sock`: `List` answers the pods the test
//! set, `GetAllocatableResources` every device of those pods, `Get` one of them.
//!
//! ```no_run
//! # fn f(root: &std::path::Path) -> anyhow::Result<()> {
//! use fake_kubelet::pod_resources::{FakePodResources, pod};
//! let fake = FakePodResources::spawn(&root.join("var/lib/kubelet/pod-resources/kubelet.sock"))?;
//! fake.set_pods(vec![pod("default", "vm-a", "compute", "nvidia.com/NVIDIA_A10-4Q", &["5a3b..."])]);
//! // run a daemon against root ...
//! assert_eq!(fake.list_calls(), 1);
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use kubelet_api::podresources::v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use kubelet_api::podresources::v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, CdiDevice, ClaimResource,
    ContainerDevices, ContainerResources, DynamicResource, GetPodResourcesRequest,
    GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use tonic::service::Routes;
use tonic::{Request, Response, Status};

/// What the fake answers from, shared with its server task.
#[derive(Debug, Default)]
struct State {
    pods: Vec<PodResources>,
    fail: Option<String>,
    lists: usize,
}

#[derive(Debug)]
struct Svc(Arc<Mutex<State>>);

impl Svc {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> Result<T, Status> {
        self.0
            .lock()
            .map(|mut s| f(&mut s))
            .map_err(|_| Status::internal("fake PodResources state poisoned"))
    }
}

#[tonic::async_trait]
impl PodResourcesLister for Svc {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let (pods, fail) = self.with(|s| {
            s.lists += 1;
            (s.pods.clone(), s.fail.clone())
        })?;
        match fail {
            Some(msg) => Err(Status::internal(msg)),
            None => Ok(Response::new(ListPodResourcesResponse {
                pod_resources: pods,
            })),
        }
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let devices = self.with(|s| {
            s.pods
                .iter()
                .flat_map(|p| &p.containers)
                .flat_map(|c| c.devices.iter().cloned())
                .collect()
        })?;
        Ok(Response::new(AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        req: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let r = req.into_inner();
        let pod = self.with(|s| {
            s.pods
                .iter()
                .find(|p| p.name == r.pod_name && p.namespace == r.pod_namespace)
                .cloned()
        })?;
        match pod {
            Some(p) => Ok(Response::new(GetPodResourcesResponse {
                pod_resources: Some(p),
            })),
            None => Err(Status::not_found(format!(
                "pod {}/{} not found",
                r.pod_namespace, r.pod_name
            ))),
        }
    }
}

/// A fake PodResources service on a Unix socket.
#[derive(Debug)]
pub struct FakePodResources {
    socket: PathBuf,
    state: Arc<Mutex<State>>,
    server: Option<crate::Running>,
    /// The runtime [`FakePodResources::spawn`] made; dropped last.
    runtime: Option<tokio::runtime::Runtime>,
}

impl FakePodResources {
    /// Serves on `socket` (its directory is created; a stale socket file is replaced) from the
    /// current tokio runtime. No pods until [`FakePodResources::set_pods`].
    pub async fn start(socket: &Path) -> anyhow::Result<FakePodResources> {
        let state = Arc::new(Mutex::new(State::default()));
        let svc = PodResourcesListerServer::new(Svc(state.clone()));
        let server = crate::serve_unix(socket, Routes::new(svc))?;
        Ok(FakePodResources {
            socket: socket.to_path_buf(),
            state,
            server: Some(server),
            runtime: None,
        })
    }

    /// [`FakePodResources::start`] on a runtime of its own, for tests that are not async (they
    /// run daemons as processes and wait for them).
    pub fn spawn(socket: &Path) -> anyhow::Result<FakePodResources> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("starting a runtime for the fake PodResources service")?;
        let mut fake = rt.block_on(FakePodResources::start(socket))?;
        fake.runtime = Some(rt);
        Ok(fake)
    }

    /// [`FakePodResources::spawn`], answering `pods`.
    pub fn spawn_with(socket: &Path, pods: Vec<PodResources>) -> anyhow::Result<FakePodResources> {
        let fake = FakePodResources::spawn(socket)?;
        fake.set_pods(pods);
        Ok(fake)
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Makes `List` answer these pods from now on.
    pub fn set_pods(&self, pods: Vec<PodResources>) {
        if let Ok(mut s) = self.state.lock() {
            s.pods = pods;
        }
    }

    /// Makes `List` fail with `message` (status INTERNAL) from now on; `None` answers again.
    pub fn fail_with(&self, message: Option<&str>) {
        if let Ok(mut s) = self.state.lock() {
            s.fail = message.map(str::to_string);
        }
    }

    /// How many `List` calls were received.
    pub fn list_calls(&self) -> usize {
        self.state.lock().map(|s| s.lists).unwrap_or(0)
    }

    /// Stops serving and leaves the socket file behind, as a kubelet that was killed does: a
    /// client's connect is then refused.
    pub fn stop(&mut self) {
        if let Some((stop, handle)) = self.server.take() {
            let _ = stop.send(());
            match &self.runtime {
                Some(rt) => {
                    let _ = rt.block_on(handle);
                }
                None => handle.abort(),
            }
        }
    }
}

impl Drop for FakePodResources {
    fn drop(&mut self) {
        if let Some((stop, _)) = self.server.take() {
            let _ = stop.send(());
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// A pod whose one container holds `ids` of `resource`, as `List` reports it.
pub fn pod(
    namespace: &str,
    name: &str,
    container: &str,
    resource: &str,
    ids: &[&str],
) -> PodResources {
    PodResources {
        name: name.to_string(),
        namespace: namespace.to_string(),
        containers: vec![ContainerResources {
            name: container.to_string(),
            devices: vec![ContainerDevices {
                resource_name: resource.to_string(),
                device_ids: ids.iter().map(|s| s.to_string()).collect(),
                topology: None,
            }],
            ..Default::default()
        }],
    }
}

/// One device a DRA driver prepared for a claim, as its `NodePrepareResources` answer named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimDevice {
    /// The driver.
    pub driver: String,
    /// Its pool.
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// The CDI devices the driver answered for it.
    pub cdi_devices: Vec<String>,
    /// The share of a shared device the driver answered.
    pub share_id: Option<String>,
}

/// A pod whose one container has the ResourceClaim `claim_namespace/claim` with `devices`, as
/// kubelet 1.36's `List` reports it: each device of one driver carries the CDI devices of the
/// devices before it as well as its own (kubelet builds one list across them,
/// `containerManagerImpl.GetDynamicResources`).
pub fn pod_with_claim(
    namespace: &str,
    name: &str,
    container: &str,
    claim: &str,
    devices: &[ClaimDevice],
) -> PodResources {
    let mut so_far: std::collections::BTreeMap<&str, Vec<CdiDevice>> = Default::default();
    let claim_resources = devices
        .iter()
        .map(|d| {
            let cdi = so_far.entry(&d.driver).or_default();
            cdi.extend(d.cdi_devices.iter().map(|n| CdiDevice { name: n.clone() }));
            ClaimResource {
                cdi_devices: cdi.clone(),
                driver_name: d.driver.clone(),
                pool_name: d.pool.clone(),
                device_name: d.device.clone(),
                share_id: d.share_id.clone(),
            }
        })
        .collect();
    PodResources {
        name: name.to_string(),
        namespace: namespace.to_string(),
        containers: vec![ContainerResources {
            name: container.to_string(),
            dynamic_resources: vec![DynamicResource {
                claim_name: claim.to_string(),
                claim_namespace: namespace.to_string(),
                claim_resources,
            }],
            ..Default::default()
        }],
    }
}
