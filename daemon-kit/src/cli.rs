//! The flags every binary shares, as clap argument groups to `#[command(flatten)]`, and the
//! name of the long-running command.
//!
//! Every binary's long-running mode is the subcommand [`DAEMON`], which also answers to
//! [`SERVE_ALIAS`] (the name sandbox-dp and sandbox-dra first gave it, which manifests and
//! units use). Its flags come from [`EventsArgs`] (`--node-name`, `--kubeconfig`) and
//! [`MetricsArgs`] (`--metrics-addr`); a daemon that cannot run without a node name reports its
//! absence with [`need_node_name`], a usage error (exit 2).

use std::path::PathBuf;

use common::{HostPaths, VendorSelector};

use crate::exit;
use crate::logging::{self, LogFormat};

/// The long-running command of every binary.
pub const DAEMON: &str = "daemon";
/// Another name of [`DAEMON`], for the manifests and units that say `serve`.
pub const SERVE_ALIAS: &str = "serve";

/// `--host-root` and `--kubelet-dir`: where the host's files are.
#[derive(Clone, Debug, clap::Args)]
pub struct HostArgs {
    /// The host's root directory: sys, dev, proc, run, lib/modules and the kubelet directory
    /// are found under it. In a pod the host's / is usually mounted at /host.
    #[arg(long, env = "HOST_ROOT", default_value = "/", global = true)]
    pub host_root: PathBuf,

    /// kubelet's device-plugin directory: its socket, and its checkpoint
    /// (kubelet_internal_checkpoint), which says which devices it gave to pods.
    /// Default: <host-root>/var/lib/kubelet/device-plugins.
    #[arg(long, env = "KUBELET_DIR", value_name = "DIR", global = true)]
    pub kubelet_dir: Option<PathBuf>,
}

impl HostArgs {
    /// The host's paths these flags name.
    pub fn paths(&self) -> HostPaths {
        HostPaths::new(&self.host_root).with_kubelet_dir(self.kubelet_dir.clone())
    }
}

/// `--pod-resources-socket`, for the binaries that ask kubelet who uses a device.
#[derive(Clone, Debug, clap::Args)]
pub struct PodResourcesArgs {
    /// kubelet's PodResources socket, asked which pods hold which devices.
    /// Default: pod-resources/kubelet.sock beside the kubelet directory.
    #[arg(long, env = "POD_RESOURCES_SOCKET", value_name = "PATH", global = true)]
    pub pod_resources_socket: Option<PathBuf>,
}

impl PodResourcesArgs {
    /// `paths` with this socket, when one is given.
    pub fn apply(&self, paths: HostPaths) -> HostPaths {
        paths.with_pod_resources_socket(self.pod_resources_socket.clone())
    }
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct LogArgs {
    /// Log format on stderr: text, or json (one JSON object per line). The level comes from
    /// RUST_LOG (default info).
    #[arg(
        long,
        env = "LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text,
        global = true
    )]
    pub log_format: LogFormat,
}

impl LogArgs {
    /// Sets up logging (see [`logging::init`]).
    pub fn init(&self, debug: bool) {
        logging::init(self.log_format, debug);
    }
}

/// `--node-name` and `--kubeconfig`: this node, and how to reach its API server. Every daemon
/// records the changes it makes and refuses as Events on the Node; vgpu-device-manager and
/// sandbox-dra need the node for more, and say so in their help (`mut_arg`).
#[derive(Clone, Debug, clap::Args)]
pub struct EventsArgs {
    /// This node's name: the changes made and refused are recorded as Events on its Node
    /// object (none without it).
    #[arg(long, env = "NODE_NAME", global = true)]
    pub node_name: Option<String>,
    /// A kubeconfig file for the API server; in-cluster config (or $KUBECONFIG) when absent.
    #[arg(long, value_name = "FILE", global = true)]
    pub kubeconfig: Option<std::path::PathBuf>,
}

impl EventsArgs {
    /// The node name, or a usage error (exit 2) saying that `command` needs one.
    pub fn need_node_name(&self, command: &str) -> exit::Result<String> {
        need_node_name(self.node_name.as_deref(), command)
    }
}

/// `node_name`, or a usage error (exit 2) saying that `command` needs `--node-name`.
pub fn need_node_name(node_name: Option<&str>, command: &str) -> exit::Result<String> {
    match node_name {
        Some(n) if !n.is_empty() => Ok(n.to_string()),
        _ => Err(exit::Failure::new(
            exit::USAGE,
            anyhow::anyhow!("{command} needs --node-name (or NODE_NAME)"),
        )),
    }
}

/// `--vendor` for the binaries that bind a whole GPU to VFIO: the shared syntax (a hex PCI
/// vendor id, `10de` or `0x10DE`), but not `any`, which would take every vendor's display
/// functions, the host's own console GPU among them.
pub fn pci_vendor(s: &str) -> Result<u16, BadVendor> {
    match s.parse::<VendorSelector>()? {
        VendorSelector::Pci(v) => Ok(v),
        VendorSelector::Any => Err(BadVendor::Any),
    }
}

/// A `--vendor` a daemon that binds whole GPUs does not take.
#[derive(Debug, thiserror::Error)]
pub enum BadVendor {
    /// Not a vendor id.
    #[error(transparent)]
    Syntax(#[from] common::pci::ParseVendorError),
    /// `any`.
    #[error(
        "\"any\" is refused here: every vendor's display functions would include the host's own \
         console GPU; name a vendor id (e.g. 10de)"
    )]
    Any,
}

/// `--metrics-addr`, for the daemons' long-running mode.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct MetricsArgs {
    /// Serve /metrics (Prometheus), /healthz (liveness) and /readyz (ready after the first
    /// successful pass) over HTTP on this address, for example 0.0.0.0:9481. Suggested ports:
    /// vfio-manager 9481, vgpu-device-manager 9482, sandbox-dp 9483, sandbox-dra 9484.
    #[arg(long, env = "METRICS_ADDR", value_name = "ADDR:PORT", global = true)]
    pub metrics_addr: Option<std::net::SocketAddr>,
}
