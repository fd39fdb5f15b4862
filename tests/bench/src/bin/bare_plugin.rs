//! `gpu-vm-bare-plugin`: the least a device plugin does, as a process of its own built as the
//! daemons are: it serves ListAndWatch on `--socket` (a current-thread runtime, as sandbox-dp's)
//! with a list of `--devices` devices shaped as sandbox-dp's, built once; it watches the
//! directory of `--watch` with inotify, read on the runtime, and when that file is removed sends
//! the list with the first device Unhealthy, when it is created again the list all Healthy.
//! With `--kubelet`, it first registers `--resources` resources there, each on a connection of
//! its own, all at once, after printing `dial <CLOCK_MONOTONIC ns>` on stdout. Nothing is read,
//! stat'ed or logged.
//!
//! The plain tree's sandbox-dp figures that end with a registration or a ListAndWatch message
//! are judged against it (`baseline::bare_plugin`): the same steps, taken first in a fresh
//! process or after the same idle, on the same stack, with nothing a daemon could leave out.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use nix::time::{ClockId, clock_gettime};
use testkit::kubelet::api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use testkit::kubelet::api::registration_client::RegistrationClient;
use testkit::kubelet::api::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    NumaNode, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, RegisterRequest, TopologyInfo,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;
use tokio_stream::Stream;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tonic::{Request, Response, Status};

/// A bare device plugin: ListAndWatch from a file's presence, nothing else.
#[derive(Parser, Debug)]
#[command(name = "gpu-vm-bare-plugin")]
struct Cli {
    /// Serve the device plugin on this socket.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// The first device is Healthy while this file exists.
    #[arg(long, value_name = "FILE")]
    watch: PathBuf,
    /// Devices in the list.
    #[arg(long, value_name = "N")]
    devices: usize,
    /// Register with the kubelet's registration socket first.
    #[arg(long, value_name = "SOCKET")]
    kubelet: Option<PathBuf>,
    /// Resources to register (`bench.example/r<i>`), each on a connection of its own.
    #[arg(long, value_name = "N", default_value_t = 1)]
    resources: usize,
}

/// A list of `n` devices shaped as sandbox-dp's: PCI-address ids, a health, a NUMA node.
fn list_of(n: usize, first_healthy: bool) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: (0..n)
            .map(|i| Device {
                id: format!("0000:{:02x}:{:02x}.{}", 0x40 + i / 256, (i / 8) % 32, i % 8),
                health: if i > 0 || first_healthy {
                    "Healthy"
                } else {
                    "Unhealthy"
                }
                .to_string(),
                topology: Some(TopologyInfo {
                    nodes: vec![NumaNode { id: 0 }],
                }),
            })
            .collect(),
    }
}

struct Bare {
    lists: watch::Receiver<Arc<ListAndWatchResponse>>,
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Bare {
    type ListAndWatchStream = ListStream;

    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        // One copy per send, for the encoder: the least a server holding its list can do.
        let s = WatchStream::new(self.lists.clone());
        let s = tokio_stream::StreamExt::map(s, |l| Ok(ListAndWatchResponse::clone(&l)));
        Ok(Response::new(Box::pin(s)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("bare plugin"))
    }

    async fn allocate(
        &self,
        _: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        Err(Status::unimplemented("bare plugin"))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Err(Status::unimplemented("bare plugin"))
    }
}

/// The inotify descriptor, readable from the runtime.
struct Fd(Inotify);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Registers `resources` resources with the kubelet at `kubelet`, all at once.
async fn register(kubelet: &Path, endpoint: &str, resources: usize) -> Result<(), String> {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC).map_err(|e| format!("clock: {e}"))?;
    let ns = i128::from(now.tv_sec()) * 1_000_000_000 + i128::from(now.tv_nsec());
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "dial {ns}")
            .and_then(|()| out.flush())
            .map_err(|e| format!("stdout: {e}"))?;
    }
    let calls = (0..resources).map(|r| async move {
        let ch = testkit::kubelet::unix_channel(kubelet)
            .await
            .map_err(|e| format!("dialling {}: {e}", kubelet.display()))?;
        RegistrationClient::new(ch)
            .register(RegisterRequest {
                version: "v1beta1".into(),
                endpoint: endpoint.to_string(),
                resource_name: format!("bench.example/r{r}"),
                options: None,
            })
            .await
            .map_err(|s| format!("Register: {s}"))?;
        Ok::<(), String>(())
    });
    futures::future::try_join_all(calls).await.map(|_| ())
}

async fn run(cli: Cli) -> Result<(), String> {
    let Cli {
        socket: sock,
        watch: file,
        devices: n,
        kubelet,
        resources,
    } = cli;
    let dir = file.parent().unwrap_or(Path::new("/"));
    let name = file
        .file_name()
        .ok_or("--watch has no file name")?
        .to_os_string();
    let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
        .map_err(|e| format!("inotify: {e}"))?;
    ino.add_watch(dir, AddWatchFlags::IN_CREATE | AddWatchFlags::IN_DELETE)
        .map_err(|e| format!("watching {}: {e}", dir.display()))?;
    // SAFETY: `Fd` owns the inotify descriptor and the `AsyncFd` owns `Fd`: the descriptor
    // stays open, and is not closed or reused by anything else, while it is registered.
    #[allow(unsafe_code)]
    let ino = unsafe { AsyncFd::register(Fd(ino)) }
        .map_err(|e| format!("inotify: {}", std::io::Error::from(e)))?;
    let (healthy, unhealthy) = (Arc::new(list_of(n, true)), Arc::new(list_of(n, false)));
    let (tx, rx) = watch::channel(Arc::clone(&healthy));
    let _ = std::fs::remove_file(&sock);
    let listener = tokio::net::UnixListener::bind(&sock)
        .map_err(|e| format!("binding {}: {e}", sock.display()))?;
    let server = tonic::transport::Server::builder()
        .add_service(DevicePluginServer::new(Bare { lists: rx }))
        .serve_with_incoming(UnixListenerStream::new(listener));
    let endpoint = sock
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let registered = async {
        match &kubelet {
            Some(k) => register(k, &endpoint, resources).await,
            None => Ok(()),
        }
    };
    let events = async move {
        loop {
            let mut ready = ino.readable().await.map_err(|e| e.to_string())?;
            let evs = match ready.get_inner().0.read_events() {
                Ok(evs) => evs,
                Err(nix::errno::Errno::EAGAIN) => {
                    ready.clear_ready();
                    continue;
                }
                Err(e) => return Err::<(), String>(format!("inotify: {e}")),
            };
            for ev in evs {
                if ev.name.as_deref() != Some(name.as_os_str()) {
                    continue;
                }
                if ev.mask.contains(AddWatchFlags::IN_DELETE) {
                    tx.send_replace(Arc::clone(&unhealthy));
                } else if ev.mask.contains(AddWatchFlags::IN_CREATE) {
                    tx.send_replace(Arc::clone(&healthy));
                }
            }
        }
    };
    let server = async { server.await.map_err(|e| format!("serving: {e}")) };
    tokio::try_join!(server, events, registered).map(|_| ())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpu-vm-bare-plugin: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-vm-bare-plugin: {e}");
            ExitCode::FAILURE
        }
    }
}
