//! `sandbox-dp`: the kubelet device plugin for passthrough GPUs and vGPUs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use common::{PciIds, VendorSelector};
use daemon_kit::cli::{EventsArgs, HostArgs, LogArgs, MetricsArgs, PodResourcesArgs, SERVE_ALIAS};
use daemon_kit::daemon::Threads;
use daemon_kit::duration;
use daemon_kit::exit::{self, Report};
use sandbox_dp::discovery::{DiscoverConfig, parse_alias};
use sandbox_dp::{Config, ondemand, report};

/// Kubelet device plugin for NVIDIA GPUs given to KubeVirt VMs: whole GPUs on vfio-pci, mdev
/// vGPUs and SR-IOV vGPU VFs. Resource names and env vars match NVIDIA's
/// kubevirt-gpu-device-plugin, so existing VM specs keep working.
#[derive(Debug, Parser)]
#[command(
    name = "sandbox-dp",
    version,
    after_help = EXIT_STATUS,
    mut_arg("metrics_addr", |a| a.help(METRICS_ADDR_HELP))
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    host: HostArgs,

    /// PCI vendor id (hex) whose devices are advertised, or "any" (also admits mdevs on
    /// non-PCI parents such as the kernel's mtty sample).
    #[arg(long, default_value = "10de", global = true)]
    vendor: VendorSelector,

    /// A pci.ids file to name passthrough resources from, instead of the embedded NVIDIA list.
    #[arg(long, value_name = "FILE", global = true)]
    pci_ids: Option<PathBuf>,

    /// Rename a resource: OLD is a resource name (nvidia.com/GA102GL_A10) or a device id
    /// (10de:2236); NEW is a name, with nvidia.com/ added when it has no prefix. Repeatable.
    #[arg(long, value_name = "OLD=NEW", value_parser = parse_alias, global = true)]
    resource_alias: Vec<(String, String)>,

    #[command(flatten)]
    metrics: MetricsArgs,

    /// Re-read the node this often even without events, a safety net; events drive updates
    /// (30s, 5m; a bare number is seconds).
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "30s",
        value_parser = duration::parse,
        global = true
    )]
    resync_interval: Duration,

    /// Create vGPUs when pods ask for them, on these GPUs: "all" (every GPU of --vendor on the
    /// nvidia driver) or a comma list of PCI addresses and non-PCI mdev parents (their names
    /// under /sys/class/mdev_bus, e.g. mtty: their types and counts as sysfs lists them). Each
    /// vGPU type they can host is advertised with as many devices as could still be created;
    /// Allocate creates one, and it is removed once no pod holds it. vgpu-device-manager leaves
    /// these GPUs alone. With --node-name, before a vGPU whose pod kubelet no longer lists goes,
    /// the API server is asked whether that pod still runs on the node (get on pods).
    #[arg(long, value_name = "all|BDF|PARENT,...", value_parser = ondemand::parse_selector, global = true)]
    on_demand: Option<ondemand::Selector>,

    /// How often kubelet's PodResources API is asked which on-demand vGPUs pods still hold.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = duration::parse, global = true)]
    on_demand_poll: Duration,

    /// How long an on-demand vGPU lives when no pod is ever seen holding it (kubelet failed
    /// the pod after Allocate, or crashed).
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = duration::parse, global = true)]
    on_demand_grace: Duration,

    #[command(flatten)]
    pod_resources: PodResourcesArgs,

    #[command(flatten)]
    events: EventsArgs,

    #[command(flatten)]
    log: LogArgs,
}

/// `--metrics-addr`: when sandbox-dp is ready.
const METRICS_ADDR_HELP: &str = "Serve /metrics (Prometheus), /healthz and /readyz on this \
    address (for example 0.0.0.0:9483). Ready once every resource found at start has registered \
    with kubelet";

/// The exit-status table, shown after `--help`.
const EXIT_STATUS: &str = "\
Exit status:
  0  done (daemon: stopped by SIGTERM/SIGINT)
  1  failed: the node or --pci-ids cannot be read, a socket cannot be served, a task of the
     plugin failed (the error is logged); wait-ready: stopped by SIGTERM/SIGINT before the node
     was prepared
  2  usage error (a bad flag or value)";

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the device plugin and register it with kubelet (the default).
    #[command(visible_alias = SERVE_ALIAS)]
    Daemon,
    /// Print the resources and devices that would be advertised: health, NUMA node, IOMMU group.
    /// Writes nothing.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print KubeVirt's permittedHostDevices block for what this node has. Writes nothing.
    PermittedDevices,
    /// Wait until the node is prepared for the device plugin, then exit 0: the readiness file
    /// of the node's workload (its label nvidia.com/gpu.workload.config: vm-passthrough ->
    /// run/nvidia/validations/vfio-pci-ready, vm-vgpu -> vgpu-devices-ready) exists. Reads
    /// the node's labels (--node-name, --kubeconfig). The deployment's init container.
    WaitReady,
}

fn main() -> ExitCode {
    if let Some(code) = daemon_kit::manual::generate_if_asked::<Cli>() {
        return code;
    }
    let cli = Cli::parse();
    cli.log.init(false);
    let report = match cli.command {
        None | Some(Command::Daemon) => Report::Log,
        Some(_) => Report::Stderr,
    };
    exit::finish(run(cli), report)
}

fn run(cli: Cli) -> exit::Result {
    let paths = cli.pod_resources.apply(cli.host.paths());
    let pool = match &cli.on_demand {
        Some(sel) => Some(std::sync::Arc::new(ondemand::Pool::new(
            paths.clone(),
            sel.clone(),
            cli.vendor.pci(),
            cli.on_demand_grace,
            Default::default(),
        )?)),
        None => None,
    };
    let pci_ids = match &cli.pci_ids {
        Some(p) => {
            PciIds::from_file(p).with_context(|| format!("reading --pci-ids {}", p.display()))?
        }
        None => PciIds::embedded(),
    };
    let discover = DiscoverConfig {
        vendor: cli.vendor.pci(),
        pci_ids,
        aliases: cli
            .resource_alias
            .iter()
            .cloned()
            .collect::<BTreeMap<_, _>>(),
        pool,
    };
    match cli.command.unwrap_or(Command::Daemon) {
        Command::List { json } => {
            let (snap, _) = sandbox_dp::read_node(&paths, &discover)?;
            if json {
                println!("{}", report::list_json(&snap));
            } else {
                print!("{}", report::list_text(&snap));
            }
            Ok(())
        }
        Command::PermittedDevices => {
            let (snap, _) = sandbox_dp::read_node(&paths, &discover)?;
            print!("{}", report::permitted_devices(&snap));
            for p in &snap.problems {
                eprintln!("sandbox-dp: {p}");
            }
            Ok(())
        }
        Command::WaitReady => {
            let node = cli.events.need_node_name("wait-ready")?;
            let kubeconfig = cli.events.kubeconfig.clone();
            daemon_kit::daemon::run(Threads::Current, |shutdown| async move {
                let client = daemon_kit::kube::client(kubeconfig.as_deref()).await?;
                match daemon_kit::readiness::wait_for_workload(&paths, &node, client, &shutdown)
                    .await
                {
                    Some(_) => Ok(()),
                    None => Err(anyhow::anyhow!("stopped before node {node} was prepared").into()),
                }
            })
        }
        Command::Daemon => {
            let config = Config {
                kubelet_dir: paths.kubelet_dir().to_path_buf(),
                discover,
                metrics_addr: cli.metrics.metrics_addr,
                resync_interval: cli.resync_interval,
                debounce: Duration::from_millis(20),
                on_demand_poll: cli.on_demand_poll,
                node_name: cli.events.node_name.clone(),
                kubeconfig: cli.events.kubeconfig.clone(),
            };
            // One thread serves every resource: a device plugin answers a few calls a minute,
            // and each worker thread costs memory. Node reads run on the blocking pool.
            daemon_kit::daemon::run(Threads::Current, |shutdown| {
                sandbox_dp::run(config, paths, shutdown)
            })
        }
    }
}
