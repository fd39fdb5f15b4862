//! A fake kubelet for device-plugin tests: the `Registration` service on `<dir>/kubelet.sock`,
//! recording each registration, and a client for a plugin's own socket; and
//! [`FakePodResources`], kubelet's PodResources service answering from a list the test sets;
//! and [`checkpoint`], kubelet's device-manager checkpoint in the shape kubelet writes; and
//! [`dra`], kubelet's side of a DRA driver (registration and `DRAPlugin` calls), dialled
//! through [`h2raw`] with the `:authority` kubelet sends; and [`apiserver`], a fake Kubernetes
//! API server with one Node, ResourceSlices, ResourceClaims and Events (here rather than in
//! testkit so that node-sim's demo can run the DRA driver too).
//!
//! ```no_run
//! # async fn f() -> anyhow::Result<()> {
//! let dir = tempfile::tempdir()?;
//! let mut kubelet = fake_kubelet::FakeKubelet::start(dir.path()).await?;
//! // start the plugin with --kubelet-dir dir ...
//! let reg = kubelet.next_registration(std::time::Duration::from_secs(10)).await?;
//! let mut plugin = kubelet.plugin(&reg.endpoint).await?;
//! let mut list = plugin.list_and_watch().await?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::service::Routes;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status, Streaming};

pub mod apiserver;
pub mod checkpoint;
pub mod dra;
pub mod h2raw;
pub mod pod_resources;
pub use pod_resources::FakePodResources;

/// The device-plugin API `v1beta1`.
pub use kubelet_api::deviceplugin::v1beta1 as api;

use api::device_plugin_client::DevicePluginClient;
use api::registration_server::{Registration as RegistrationSvc, RegistrationServer};
use api::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest,
    ContainerPreferredAllocationRequest, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreferredAllocationRequest, RegisterRequest,
};

/// kubelet's socket name.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// One `Register` call as the fake kubelet received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// API version (`v1beta1`).
    pub version: String,
    /// Socket file name in the plugin directory.
    pub endpoint: String,
    /// Resource name.
    pub resource_name: String,
    /// Options.
    pub options: Option<DevicePluginOptions>,
}

#[derive(Debug)]
struct Svc {
    tx: mpsc::UnboundedSender<Registration>,
    reject: Arc<Mutex<Option<String>>>,
    rejected: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl RegistrationSvc for Svc {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let r = req.into_inner();
        let reject = self.reject.lock().map(|g| g.clone()).unwrap_or(None);
        if let Some(msg) = reject {
            self.rejected.fetch_add(1, Ordering::SeqCst);
            return Err(Status::invalid_argument(msg));
        }
        let _ = self.tx.send(Registration {
            version: r.version,
            endpoint: r.endpoint,
            resource_name: r.resource_name,
            options: r.options,
        });
        Ok(Response::new(Empty {}))
    }
}

/// A fake kubelet serving `Registration` on `<dir>/kubelet.sock`.
#[derive(Debug)]
pub struct FakeKubelet {
    dir: PathBuf,
    tx: mpsc::UnboundedSender<Registration>,
    rx: mpsc::UnboundedReceiver<Registration>,
    reject: Arc<Mutex<Option<String>>>,
    rejected: Arc<AtomicUsize>,
    server: Option<Running>,
}

impl FakeKubelet {
    /// Serves on `<dir>/kubelet.sock` (the directory is created if needed).
    pub async fn start(dir: &Path) -> anyhow::Result<FakeKubelet> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let mut k = FakeKubelet {
            dir: dir.to_path_buf(),
            tx,
            rx,
            reject: Arc::new(Mutex::new(None)),
            rejected: Arc::new(AtomicUsize::new(0)),
            server: None,
        };
        k.serve()?;
        Ok(k)
    }

    fn serve(&mut self) -> anyhow::Result<()> {
        let svc = RegistrationServer::new(Svc {
            tx: self.tx.clone(),
            reject: self.reject.clone(),
            rejected: self.rejected.clone(),
        });
        self.server = Some(serve_unix(&self.socket(), Routes::new(svc))?);
        Ok(())
    }

    /// The plugin directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<dir>/kubelet.sock`.
    pub fn socket(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET)
    }

    /// Stops serving and removes `kubelet.sock` (kubelet going down).
    pub async fn stop(&mut self) {
        if let Some((stop, handle)) = self.server.take() {
            let _ = stop.send(());
            let _ = handle.await;
        }
        let _ = std::fs::remove_file(self.socket());
    }

    /// A kubelet restart: stop, remove `kubelet.sock`, serve again on a new socket file.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop().await;
        self.serve()
    }

    /// A restart as kubelet's device manager does it: it also removes every other file in the
    /// plugin directory (the plugins' sockets), then serves on a new `kubelet.sock`.
    pub async fn restart_clearing_dir(&mut self) -> anyhow::Result<()> {
        self.stop().await;
        let entries = std::fs::read_dir(&self.dir)
            .with_context(|| format!("listing {}", self.dir.display()))?;
        for e in entries.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        self.serve()
    }

    /// Makes every following `Register` fail with `message` (`None`: accept again).
    pub fn reject_with(&self, message: Option<&str>) {
        if let Ok(mut g) = self.reject.lock() {
            *g = message.map(str::to_string);
        }
    }

    /// How many registrations were refused (see [`FakeKubelet::reject_with`]).
    pub fn rejected(&self) -> usize {
        self.rejected.load(Ordering::SeqCst)
    }

    /// The next registration, waiting at most `timeout`.
    pub async fn next_registration(&mut self, timeout: Duration) -> anyhow::Result<Registration> {
        match tokio::time::timeout(timeout, self.rx.recv()).await {
            Ok(Some(r)) => Ok(r),
            Ok(None) => bail!("registration channel closed"),
            Err(_) => bail!("no registration within {timeout:?}"),
        }
    }

    /// Registrations drained so far without waiting.
    pub fn drain(&mut self) -> Vec<Registration> {
        let mut v = Vec::new();
        while let Ok(r) = self.rx.try_recv() {
            v.push(r);
        }
        v
    }

    /// Waits until every resource in `names` has registered (again), within `timeout`; returns
    /// the latest registration of each.
    pub async fn wait_for(
        &mut self,
        names: &[&str],
        timeout: Duration,
    ) -> anyhow::Result<BTreeMap<String, Registration>> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut got: BTreeMap<String, Registration> = BTreeMap::new();
        while !names.iter().all(|n| got.contains_key(*n)) {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_registration(left).await {
                Ok(r) => {
                    got.insert(r.resource_name.clone(), r);
                }
                Err(e) => {
                    let have: Vec<&String> = got.keys().collect();
                    return Err(e.context(format!("waiting for {names:?}; registered: {have:?}")));
                }
            }
        }
        Ok(got)
    }

    /// A client for a registered plugin's endpoint (a socket name in the directory).
    pub async fn plugin(&self, endpoint: &str) -> anyhow::Result<PluginClient> {
        PluginClient::connect(&self.dir.join(endpoint)).await
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        if let Some((stop, _)) = self.server.take() {
            let _ = stop.send(());
        }
    }
}

/// A running server: the sender that stops it, and its task.
type Running = (oneshot::Sender<()>, JoinHandle<()>);

/// Serves `routes` on a Unix socket at `path` from the current tokio runtime, as kubelet serves
/// its sockets: the directory is created, a stale socket file replaced.
fn serve_unix(path: &Path, routes: Routes) -> anyhow::Result<Running> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(path);
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        let _ = Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stop_rx.await;
            })
            .await;
    });
    Ok((stop_tx, handle))
}

/// A gRPC channel over a Unix socket, dialled as kubelet dials (`:authority` `localhost`).
pub async fn unix_channel(path: &Path) -> anyhow::Result<Channel> {
    kubelet_api::unix_channel(path)
        .await
        .with_context(|| format!("connecting to {}", path.display()))
}

/// What kubelet calls on a device plugin.
#[derive(Debug, Clone)]
pub struct PluginClient {
    inner: DevicePluginClient<Channel>,
}

impl PluginClient {
    /// Connects to a plugin socket.
    pub async fn connect(path: &Path) -> anyhow::Result<PluginClient> {
        Ok(PluginClient {
            inner: DevicePluginClient::new(unix_channel(path).await?),
        })
    }

    /// GetDevicePluginOptions.
    pub async fn options(&mut self) -> Result<DevicePluginOptions, Status> {
        Ok(self
            .inner
            .get_device_plugin_options(Empty {})
            .await?
            .into_inner())
    }

    /// Opens ListAndWatch.
    pub async fn list_and_watch(&mut self) -> Result<ListWatch, Status> {
        Ok(ListWatch {
            stream: self.inner.list_and_watch(Empty {}).await?.into_inner(),
            last: None,
        })
    }

    /// Allocate, one inner list of IDs per container.
    pub async fn allocate(&mut self, containers: &[&[&str]]) -> Result<AllocateResponse, Status> {
        let req = AllocateRequest {
            container_requests: containers
                .iter()
                .map(|ids| ContainerAllocateRequest {
                    devices_ids: ids.iter().map(|s| s.to_string()).collect(),
                })
                .collect(),
        };
        Ok(self.inner.allocate(req).await?.into_inner())
    }

    /// GetPreferredAllocation for one container.
    pub async fn preferred(
        &mut self,
        available: &[&str],
        must_include: &[&str],
        size: i32,
    ) -> Result<Vec<String>, Status> {
        let req = PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: available.iter().map(|s| s.to_string()).collect(),
                must_include_device_i_ds: must_include.iter().map(|s| s.to_string()).collect(),
                allocation_size: size,
            }],
        };
        let resp = self.inner.get_preferred_allocation(req).await?.into_inner();
        Ok(resp
            .container_responses
            .into_iter()
            .next()
            .map(|c| c.device_i_ds)
            .unwrap_or_default())
    }
}

/// An open ListAndWatch stream.
#[derive(Debug)]
pub struct ListWatch {
    stream: Streaming<ListAndWatchResponse>,
    last: Option<Vec<Device>>,
}

impl ListWatch {
    /// The next list, waiting at most `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> anyhow::Result<Vec<Device>> {
        match tokio::time::timeout(timeout, self.stream.message()).await {
            Ok(Ok(Some(m))) => {
                self.last = Some(m.devices.clone());
                Ok(m.devices)
            }
            Ok(Ok(None)) => bail!("ListAndWatch stream ended"),
            Ok(Err(s)) => Err(anyhow!("ListAndWatch failed: {s}")),
            Err(_) => bail!("no ListAndWatch update within {timeout:?}"),
        }
    }

    /// Reads lists until one satisfies `pred` (the latest one counts too), within `timeout`.
    pub async fn wait_until(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&[Device]) -> bool,
    ) -> anyhow::Result<Vec<Device>> {
        if let Some(l) = &self.last
            && pred(l)
        {
            return Ok(l.clone());
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next(left).await {
                Ok(l) if pred(&l) => return Ok(l),
                Ok(_) => {}
                Err(e) => {
                    return Err(e.context(format!(
                        "waiting for a matching list; last: {:?}",
                        self.last.as_ref().map(|l| summary(l))
                    )));
                }
            }
        }
    }
}

/// `id=health@numa` for each device, for messages.
pub fn summary(devices: &[Device]) -> Vec<String> {
    devices
        .iter()
        .map(|d| {
            let numa: Vec<i64> = d
                .topology
                .as_ref()
                .map(|t| t.nodes.iter().map(|n| n.id).collect())
                .unwrap_or_default();
            format!("{}={}@{numa:?}", d.id, d.health)
        })
        .collect()
}
