//! `sandbox-dra`: a Kubernetes DRA (Dynamic Resource Allocation) driver that gives a node's
//! GPUs to KubeVirt VMs through ResourceClaims.
//!
//! - [`registration`]: kubelet finds the driver through
//!   `<kubelet-root>/plugins_registry/<driver>-reg.sock`;
//! - [`plugin`]: kubelet calls `NodePrepareResources` / `NodeUnprepareResources` on
//!   `<kubelet-root>/plugins/<driver>/dra.sock`, answered by [`prepare`], which writes the
//!   [`cdi`] spec and device metadata and keeps a [`record`] of each claim;
//! - [`slices`]: the node's devices as a ResourceSlice, kept true in the API server by
//!   [`publish`];
//! - [`health`]: the devices' health, streamed to kubelet on the same socket
//!   (`NodeWatchResources`), judged after each of the publisher's reads of the node.
//!
//! Every path the driver gives kubelet or the container runtime is the host's view (its
//! `--kubelet-root`, `/dev/vfio/<g>`); the driver reaches them under `--host-root`.

pub mod cdi;
pub mod extended;
pub mod health;
pub mod names;
pub mod node;
pub mod plugin;
pub mod prepare;
pub mod publish;
pub mod record;
pub mod registration;
pub mod runtime;
pub mod slices;
pub mod telemetry;
pub mod vgpu;
pub mod vgpu_types;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use common::{HostPaths, PciIds};
use daemon_kit::exit;
use kubelet_api::dra::{v1, v1beta1};
use kubelet_api::pluginregistration::registration_server::RegistrationServer;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

use crate::plugin::Plugin;
use crate::prepare::{OnUnprepare, PrepareConfig, Preparer};
use crate::registration::Registrar;

/// The driver name when `--driver-name` does not say otherwise.
pub const DEFAULT_DRIVER_NAME: &str = "gpu.gpu-vm-node.io";

/// kubelet's root directory as the host sees it, when `--kubelet-root` does not say otherwise.
pub const DEFAULT_KUBELET_ROOT: &str = "/var/lib/kubelet";

/// The host's CDI spec directory, when `--cdi-root` does not say otherwise.
pub const DEFAULT_CDI_ROOT: &str = "/var/run/cdi";

/// The `DRAPlugin` socket's file name in `<kubelet-root>/plugins/<driver>/`.
pub const PLUGIN_SOCKET: &str = "dra.sock";

/// kubelet's directories for one driver, each as the host names it (what kubelet is told) and
/// as this process reaches it (under the host root).
#[derive(Clone, Debug)]
pub struct KubeletDirs {
    host_root: PathBuf,
    kubelet_root: PathBuf,
    driver: String,
}

impl KubeletDirs {
    /// The directories of `driver` under `kubelet_root` (a host path, absolute).
    pub fn new(paths: &HostPaths, kubelet_root: &Path, driver: &str) -> Self {
        KubeletDirs {
            host_root: paths.root().to_path_buf(),
            kubelet_root: kubelet_root.to_path_buf(),
            driver: driver.to_string(),
        }
    }

    /// `host` (a host path) as this process reaches it.
    fn local(&self, host: &Path) -> PathBuf {
        self.host_root.join(host.strip_prefix("/").unwrap_or(host))
    }

    /// The driver's own directory as the host names it: `<kubelet-root>/plugins/<driver>`
    /// (its socket, its claim records, the claims' device metadata).
    pub fn driver_dir_host(&self) -> PathBuf {
        self.kubelet_root.join("plugins").join(&self.driver)
    }

    /// The `DRAPlugin` socket as the host names it: what kubelet is told to dial.
    pub fn plugin_socket_host(&self) -> PathBuf {
        self.driver_dir_host().join(PLUGIN_SOCKET)
    }

    /// The driver's own directory as this process reaches it.
    pub fn driver_dir(&self) -> PathBuf {
        self.local(&self.driver_dir_host())
    }

    /// The `DRAPlugin` socket as this process reaches it.
    pub fn plugin_socket(&self) -> PathBuf {
        self.local(&self.plugin_socket_host())
    }

    /// The registration socket as this process reaches it.
    pub fn registration_socket(&self) -> PathBuf {
        self.local(
            &self
                .kubelet_root
                .join("plugins_registry")
                .join(format!("{}-reg.sock", self.driver)),
        )
    }
}

/// What `daemon` needs besides the host paths.
#[derive(Clone, Debug)]
pub struct Config {
    /// The DRA driver name (a DNS subdomain): ResourceSlices, DeviceClasses and claims name it.
    pub driver: String,
    /// kubelet's root directory as the host sees it.
    pub kubelet_root: PathBuf,
    /// This node's name: the pool's name and the slices' `nodeName`.
    pub node_name: String,
    /// `--kubeconfig`; in-cluster without one.
    pub kubeconfig: Option<PathBuf>,
    /// The host's CDI spec directory (`--cdi-root`), reached under the host root.
    pub cdi_root: PathBuf,
    /// What unprepare does with a claim's GPUs (`--unprepare`).
    pub on_unprepare: OnUnprepare,
    /// The most one function's bind or unbind may take (`--timeout`).
    pub timeout: std::time::Duration,
    /// The PCI vendor whose display functions are published (`--vendor`, NVIDIA's `10de`).
    pub vendor: u16,
    /// Product names for the slice's devices (`--pci-ids`, or the embedded NVIDIA block).
    pub pci_ids: PciIds,
    /// How often the slice is compared with the API server without an event.
    pub resync_interval: Duration,
    /// Serve metrics and probes here (`--metrics-addr`).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The GPUs published and prepared as vGPUs too (`--vgpu`).
    pub vgpu: Option<vgpu::Selector>,
    /// The vGPU types the GPUs of `vgpu` publish (`--vgpu-types`).
    pub vgpu_types: vgpu_types::Types,
    /// The most one request to the API server may take, connecting, sending and waiting for
    /// the answer (`--api-timeout`).
    pub api_timeout: Duration,
    /// How long the publisher's loop may go without coming round before `/healthz` fails;
    /// `None`: [`daemon_kit::ops::liveness_window`] of the resync interval.
    pub liveness_window: Option<Duration>,
    /// The effect of the taint on a device that cannot serve a VM (`--taint-effect`).
    pub taint_effect: slices::TaintEffect,
    /// Each GPU of the vGPU pool in a ResourceSlice pool of its own (`--pool-per-gpu`).
    pub pool_per_gpu: bool,
}

/// Binds a Unix socket at `path`, replacing a stale one a killed run left.
fn bind_socket(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        common::state::ensure_dir(dir)?;
    }
    common::state::remove_if_present(path)
        .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
    UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))
}

/// Refuses `--vgpu-types` entries that are no vGPU type (exit 2, before anything is changed),
/// naming them and the types of the GPUs `sel` takes; warns of a GPU none of whose types is
/// listed (it is published whole only).
fn check_vgpu_types(
    paths: &HostPaths,
    sel: &vgpu::Selector,
    types: &vgpu_types::Types,
) -> exit::Result {
    if *types == vgpu_types::Types::All {
        return Ok(());
    }
    let inv = common::Inventory::read(paths).context("cannot read the node's PCI devices")?;
    let gpus: Vec<common::PciAddress> = vgpu::selected_gpus(&inv, sel).into_iter().collect();
    types
        .check(&inv, &gpus)
        .map_err(|e| exit::Failure::new(exit::USAGE, anyhow::anyhow!(e)))?;
    for a in &gpus {
        if let Some(m) = inv
            .device(a)
            .and_then(|d| common::vgpu::models::model(d.vendor, d.device))
            && !types.publishes_any(m)
        {
            tracing::warn!(gpu = %a, vgpu_types = %types.describe(), "none of --vgpu-types is a type of this GPU: published whole only");
        }
    }
    tracing::info!(vgpu_types = %types.describe(), "vGPU types published");
    Ok(())
}

/// The devices this node's slices would publish, read without writing anything (no pool is
/// claimed): its GPUs of `vendor`, with `vgpu` the vGPU types `types` lists for the GPUs it
/// names. For `sandbox-dra device-classes` and `permitted-devices`.
pub fn node_devices(
    paths: &HostPaths,
    vendor: u16,
    ids: &common::PciIds,
    vgpu: Option<&vgpu::Selector>,
    types: &vgpu_types::Types,
) -> anyhow::Result<Vec<k8s_openapi::api::resource::v1::Device>> {
    use anyhow::Context as _;
    let inv = common::Inventory::read_with(
        paths,
        &common::ReadOptions {
            mdev_types: vgpu.is_some(),
            vf_identity: false,
        },
    )
    .with_context(|| {
        format!(
            "cannot read the node's PCI devices under {}",
            paths.root().display()
        )
    })?;
    let aliases = common::vfio::load_aliases(paths);
    let selector = common::vfio::Selector {
        vendors: vec![vendor],
        ..common::vfio::Selector::default()
    };
    let sel = common::vfio::select(&inv, &selector, None, &aliases);
    let pooled = vgpu::Pooled {
        gpus: vgpu
            .map(|v| vgpu::selected_gpus(&inv, v))
            .unwrap_or_default(),
        types: types.clone(),
    };
    let mut out = slices::devices_with_vgpus(&inv, &sel, ids, &pooled).devices;
    for p in vgpu
        .map(|v| vgpu::mdev_parents(&inv, v))
        .unwrap_or_default()
    {
        if let Some((_, devices)) = slices::mdev_parent_devices(&inv, &p) {
            out.extend(devices);
        }
    }
    Ok(out)
}

/// Serves the driver until `shutdown`: the `DRAPlugin` socket first, then the registration
/// socket (kubelet dials the plugin as soon as it sees the registration); both are removed on
/// the way out, which tells kubelet the driver is gone.
pub async fn run(config: Config, paths: HostPaths, shutdown: CancellationToken) -> exit::Result {
    let dirs = KubeletDirs::new(&paths, &config.kubelet_root, &config.driver);
    tracing::info!(
        driver = %config.driver,
        host_root = %paths.root().display(),
        kubelet_root = %config.kubelet_root.display(),
        "starting"
    );
    if let Some(sel) = &config.vgpu {
        check_vgpu_types(&paths, sel, &config.vgpu_types)?;
    }
    // Every request is bounded: an API server that accepts and never answers makes a claim
    // fail (kubelet calls again) and a publishing pass fail (retried), never stalls them.
    // The client's own limits are a second longer than --api-timeout: a claim's read is cut
    // off by the driver's timeout, whose error says what happened, not by the client's, which
    // would otherwise win a tie half the time.
    let mut kube_config = daemon_kit::kube::config(config.kubeconfig.as_deref()).await?;
    let backstop = config.api_timeout + Duration::from_secs(1);
    kube_config.connect_timeout = Some(backstop);
    kube_config.write_timeout = Some(backstop);
    kube_config.read_timeout = Some(backstop);
    kube_config.reset_reader_on_write = true;
    // The publisher's watch has no read timeout: a quiet watch is not a hung server (it says
    // nothing for as long as the API server keeps it open, an hour); TCP keepalive finds a
    // connection whose server vanished.
    let watch_client = daemon_kit::kube::watch_client(&kube_config)?;
    let client = kube::Client::try_from(kube_config).context("cannot make a Kubernetes client")?;
    let ops = daemon_kit::ops::Ops::new();
    // The publisher's loop wakes at least every resync, and beats while a pass waits on the
    // API server: only a loop stuck on the node stops it.
    ops.expect_beats(
        config
            .liveness_window
            .unwrap_or_else(|| daemon_kit::ops::liveness_window(config.resync_interval)),
    );
    if let Some(addr) = config.metrics_addr {
        ops.clone().listen(addr, shutdown.clone()).await?;
    }
    let events =
        daemon_kit::events::NodeEvents::start(client.clone(), &config.node_name, "sandbox-dra");
    let telemetry = Arc::new(telemetry::Telemetry::new(ops.clone(), events));
    let sel = config.vgpu.clone().unwrap_or_else(vgpu::Selector::none);
    // The vGPU pool is this process's while it runs: the hold goes when it ends, and a pool
    // file without it is one the other daemons know to be left over.
    let _pool_hold = match &config.vgpu {
        Some(_) => Some(
            common::state::pool::hold_dra(&paths)
                .map_err(anyhow::Error::from)?
                .with_context(|| {
                    format!(
                        "another sandbox-dra --vgpu holds {}.lock: one owner per node",
                        common::state::pool::dra_path(&paths).display()
                    )
                })?,
        ),
        None => None,
    };
    let claimed = vgpu::claim_pool(&paths, &sel)?;
    if let Some(note) = &claimed.not_claimed {
        telemetry.vgpu_pool_not_claimed(note);
    }
    let members = claimed.pool;
    let mdev_parents = members.parents.clone();
    let vgpu_pool = vgpu::Pool::with_types(members, config.vgpu_types.clone());
    let prepare_config = PrepareConfig {
        driver: config.driver.clone(),
        node_name: config.node_name.clone(),
        layout: cdi::Layout {
            driver: config.driver.clone(),
            cdi_root: config.cdi_root.clone(),
            driver_dir: dirs.driver_dir_host(),
        },
        on_unprepare: config.on_unprepare,
        timeout: config.timeout,
        vgpu_pool: vgpu_pool.clone(),
        mdev_parents: mdev_parents.clone(),
        pci_ids: config.pci_ids.clone(),
        api_timeout: config.api_timeout,
    };
    let preparer = Arc::new(Preparer::new(
        prepare_config,
        paths.clone(),
        client.clone(),
        telemetry.clone(),
    ));
    // Before kubelet can call: what a crash left half done is brought in line first.
    preparer.reconcile().await;
    // The node's container runtime, as the publisher and prepare read it from the Node:
    // prepare refuses claims a runtime without CDI could not hand to the pod.
    let runtime = Arc::new(runtime::RuntimeCheck::default());
    let node = node::NodeReader::new(
        client.clone(),
        &config.node_name,
        config.api_timeout,
        runtime.clone(),
        telemetry.clone(),
    );
    let plugin = Plugin::new(preparer, telemetry.clone(), node);
    let plugin_path = dirs.plugin_socket();
    let plugin_listener = bind_socket(&plugin_path)?;
    let (health_reporter, health_service) = health::channel(
        config.node_name.clone(),
        dirs.driver_dir(),
        health::timeout_for(config.resync_interval),
        shutdown.clone(),
    );
    let plugin_server = tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(plugin.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(plugin))
        .add_service(health::DraResourceHealthServer::new(health_service));
    let registrar = Registrar::new(config.driver.clone(), dirs.plugin_socket_host());
    let reg_path = dirs.registration_socket();
    let reg_listener = bind_socket(&reg_path)?;
    // The publisher runs beside the sockets and stops with them: a socket that fails ends the
    // process, the publisher only logs and retries.
    let stop_publishing = shutdown.child_token();
    let publishing = tokio::spawn(publish::run(
        client,
        watch_client,
        publish::PublishConfig {
            driver: config.driver.clone(),
            node_name: config.node_name.clone(),
            vendor: config.vendor,
            pci_ids: config.pci_ids.clone(),
            resync_interval: config.resync_interval,
            api_timeout: config.api_timeout,
            telemetry,
            runtime,
            vgpu: sel,
            vgpu_pool,
            mdev_parents,
            taint_effect: config.taint_effect,
            pool_per_gpu: config.pool_per_gpu,
            driver_dir: dirs.driver_dir(),
        },
        paths.clone(),
        registrar.subscribe(),
        health_reporter,
        stop_publishing.clone(),
    ));
    let reg_server =
        tonic::transport::Server::builder().add_service(RegistrationServer::new(registrar));
    tracing::info!(
        plugin = %plugin_path.display(),
        registration = %reg_path.display(),
        "serving"
    );
    // Both sockets are bound: systemd may start kubelet (the unit is ordered before it);
    // /readyz waits for the first ResourceSlice pass after kubelet registered the driver.
    ops.systemd_ready("serving kubelet's sockets");
    let served = tokio::try_join!(
        daemon_kit::grpc::serve_unix(
            plugin_server,
            plugin_listener,
            shutdown.clone().cancelled_owned()
        ),
        daemon_kit::grpc::serve_unix(reg_server, reg_listener, shutdown.clone().cancelled_owned()),
    );
    stop_publishing.cancel();
    if let Err(e) = publishing.await {
        tracing::error!(error = %e, "the ResourceSlice publisher failed");
    }
    for p in [&reg_path, &plugin_path] {
        if let Err(e) = common::state::remove_if_present(p) {
            tracing::warn!(socket = %p.display(), error = %e, "cannot remove the socket");
        }
    }
    served.context("serving the driver's sockets")?;
    tracing::info!("stopped");
    Ok(())
}
