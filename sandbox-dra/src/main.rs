//! `sandbox-dra`: the DRA driver for GPUs given to KubeVirt VMs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;

use clap::{Parser, Subcommand};
use common::PciIds;
use daemon_kit::cli::{self, EventsArgs, HostArgs, LogArgs, MetricsArgs, SERVE_ALIAS};
use daemon_kit::daemon::Threads;
use daemon_kit::duration;
use daemon_kit::exit::{self, Report};
use sandbox_dra::prepare::OnUnprepare;
use sandbox_dra::{Config, DEFAULT_CDI_ROOT, DEFAULT_DRIVER_NAME, DEFAULT_KUBELET_ROOT};

/// Kubernetes DRA driver for NVIDIA GPUs given to KubeVirt VMs: publishes the node's GPUs as
/// ResourceSlices and, when kubelet prepares a claim, puts the allocated GPU and its whole IOMMU
/// group on a VFIO driver and hands the VM's pod its /dev/vfio nodes through CDI.
#[derive(Debug, Parser)]
#[command(
    name = "sandbox-dra",
    version,
    after_help = EXIT_STATUS,
    mut_arg("node_name", |a| a.help(NODE_NAME_HELP))
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    host: HostArgs,

    /// The DRA driver name: ResourceSlices, DeviceClasses and claims' allocations name it.
    #[arg(long, env = "DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME, global = true)]
    driver_name: String,

    /// kubelet's root directory as the host sees it: the registration socket goes to
    /// plugins_registry/ in it, the driver's socket, claim records and device metadata to
    /// plugins/<driver>/, and kubelet's device-plugin checkpoint (which devices pods hold) is
    /// read from device-plugins/ in it unless --kubelet-dir says otherwise. It is reached under
    /// --host-root.
    #[arg(
        long,
        env = "KUBELET_ROOT",
        value_name = "DIR",
        default_value = DEFAULT_KUBELET_ROOT,
        global = true
    )]
    kubelet_root: PathBuf,

    /// PCI vendor id (hex) whose display functions are published for passthrough. `any` is
    /// refused: every vendor's display functions would include the host's own console GPU.
    #[arg(long, value_name = "HEX", default_value = "10de", value_parser = cli::pci_vendor, global = true)]
    vendor: u16,

    /// The container runtime's CDI spec directory as the host sees it (reached under
    /// --host-root): each prepared claim gets one spec file there naming its /dev/vfio nodes
    /// and mounting its device metadata.
    #[arg(
        long,
        env = "CDI_ROOT",
        value_name = "DIR",
        default_value = DEFAULT_CDI_ROOT,
        global = true
    )]
    cdi_root: PathBuf,

    /// What unprepare does with a claim's GPUs once the CDI spec and metadata are gone.
    /// keep: the whole IOMMU group stays on its VFIO driver, ready for the next claim; nothing
    /// on the host can start using the GPU between two VMs, and no driver is unloaded and
    /// probed again for each VM (the default: a node that gives GPUs to VMs keeps them for
    /// VMs). restore: every function goes back to the driver it had before the first prepare
    /// (nvidia, snd_hda_intel, or none), refused while a process still holds the group.
    #[arg(
        long = "unprepare",
        env = "UNPREPARE",
        value_enum,
        value_name = "POLICY",
        default_value = "keep",
        global = true
    )]
    on_unprepare: OnUnprepare,

    /// The most one PCI function's bind or unbind may take, every write and wait together
    /// (500ms, 30s, 2m; a bare number is seconds).
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "30s",
        value_parser = duration::parse,
        global = true
    )]
    timeout: Duration,

    /// A pci.ids file to take the devices' productName attribute from, instead of the embedded
    /// NVIDIA list.
    #[arg(long, value_name = "FILE", global = true)]
    pci_ids: Option<PathBuf>,

    /// Compare the node with its ResourceSlices this often even without events, a safety net;
    /// uevents, claims, kubelet's registration and the watch of the slices drive updates (30s,
    /// 5m; a bare number is seconds). The comparison is with the watched copy: it asks the API
    /// server nothing unless a slice must be written. Device health goes to kubelet at each
    /// pass too; kubelet shows a device Unknown after three intervals (at least 30s) without
    /// news.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "30s",
        value_parser = duration::parse,
        global = true
    )]
    resync_interval: Duration,

    /// GPUs published as vGPUs too: `all` (every GPU whose model the vGPU table knows), or a
    /// comma list of PCI addresses. Each gets a counter set and, besides its passthrough device,
    /// one device per vGPU type, shared by that type's vGPUs (Kubernetes 1.36: consumable
    /// capacity; the scheduler keeps one size per GPU); the others stay passthrough only. While
    /// the API server drops what that needs (the feature off), the GPUs are published whole
    /// only and the log, an Event and /readyz say why. sandbox-dra
    /// owns these GPUs (`run/gpu-vm-node/dra-pool`): vgpu-device-manager leaves them alone.
    /// An entry that is not a PCI address names an mdev parent that is not a PCI function
    /// (`mtty`, under `class/mdev_bus/`; lowercase letters, digits and `-`, as it names devices):
    /// its types are published as devices, made into mdevs at prepare.
    #[arg(long, env = "VGPU", value_name = "all|BDF|PARENT,...", value_parser = sandbox_dra::vgpu::parse_selector, global = true)]
    vgpu: Option<sandbox_dra::vgpu::Selector>,

    /// The vGPU types the GPUs of --vgpu publish: `all` (every type the driver knows for the
    /// GPU's model: 21 on an A10, 22 devices with its passthrough device), or a comma list
    /// of type names (`A10-4Q,A10-8Q`) and patterns (`A10-*Q`, `*-8Q`), case ignored. Fewer
    /// types are fewer devices for the scheduler to search and the API server to hold. An
    /// entry that is no vGPU type is refused at start (exit 2, the GPUs' own types named);
    /// another model's type matches nothing here, so one list serves several models. mdev
    /// parents that are not GPUs (`mtty`) publish all their types.
    #[arg(
        long,
        env = "VGPU_TYPES",
        value_name = "all|TYPE,...",
        default_value = "all",
        value_parser = sandbox_dra::vgpu_types::parse,
        requires = "vgpu",
        global = true
    )]
    vgpu_types: sandbox_dra::vgpu_types::Types,

    /// The effect of the taint on a device that cannot serve a VM (a group that cannot go to
    /// VFIO, a missing /dev/vfio group node, VFs that could not be enabled, a GPU gone under a
    /// prepared claim): NoSchedule (no new claim is placed on it) or NoExecute (the pods of
    /// claims that have it are evicted too, unless they tolerate it). The taint's key is
    /// <driver>/unusable, its value the reason.
    #[arg(
        long,
        env = "TAINT_EFFECT",
        value_enum,
        default_value = "NoSchedule",
        global = true
    )]
    taint_effect: sandbox_dra::slices::TaintEffect,

    /// Publish each GPU of the vGPU pool (--vgpu) as a ResourceSlice pool of its own
    /// (<node>/gpu-0000-41-00-0) instead of in the node's pool. kube-scheduler 1.37 and later:
    /// its counter check walks one GPU's devices, not the node's, so a vGPU pod costs it less
    /// the more vGPUs run in the cluster. kube-scheduler 1.36 takes every counter-set slice of
    /// the cluster into each node's filter: there, several times more CPU per vGPU pod. A GPU
    /// holding claims allocated from the other layout stays in the pool they came from until
    /// they are gone.
    #[arg(long, env = "POOL_PER_GPU", requires = "vgpu", global = true)]
    pool_per_gpu: bool,

    /// The most one request to the API server may take (connecting, sending, waiting for the
    /// answer): a claim whose allocation cannot be read in that time fails and kubelet calls
    /// again; a ResourceSlice pass fails and is retried (500ms, 10s, 1m; a bare number is
    /// seconds).
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "10s",
        value_parser = duration::parse,
        global = true
    )]
    api_timeout: Duration,

    /// How long the ResourceSlice publisher's loop may go without coming round before /healthz
    /// answers 503 (default: three --resync-interval, at least 2m). Waiting on the API server
    /// counts as coming round. For tests that show a stuck loop, or a hung API server that is
    /// not one, without waiting minutes.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, hide = true, global = true)]
    liveness_window: Option<Duration>,

    #[command(flatten)]
    events: EventsArgs,

    #[command(flatten)]
    metrics: MetricsArgs,

    #[command(flatten)]
    log: LogArgs,
}

/// `--node-name`: what the node is for here.
const NODE_NAME_HELP: &str = "This node's name: the pool its devices are published in (with \
    --pool-per-gpu each GPU of the vGPU pool in a pool of its own, <node>/gpu-0000-41-00-0), and \
    the Node its changes are recorded on as Events. Needed by daemon";

/// The exit-status table, shown after `--help`.
const EXIT_STATUS: &str = "\
Exit status:
  0  done (daemon: stopped by SIGTERM/SIGINT)
  1  failed: a socket cannot be served, --pci-ids cannot be read (the error is logged)
  2  usage error (a bad flag or value, a --vgpu-types entry that is no vGPU type)";

#[derive(Debug, Subcommand)]
enum Command {
    /// Publish the node's GPUs, serve the driver and register it with kubelet (the default).
    #[command(visible_alias = SERVE_ALIAS)]
    Daemon,
    /// Print the DeviceClasses that serve the device plugin's resource names through this
    /// driver (`extendedResourceName`: a pod asking for `nvidia.com/NVIDIA_A10-4Q` in its
    /// limits gets a claim the driver prepares): for the GPUs of this node (with --vgpu and
    /// --vgpu-types, their vGPU types too), or with --catalogue for every GPU model the vGPU
    /// model table knows (what the Helm chart installs). Writes nothing.
    DeviceClasses {
        /// Every model the vGPU model table knows, not this node's GPUs.
        #[arg(long)]
        catalogue: bool,
    },
    /// Print KubeVirt's permittedHostDevices block for the same names
    /// (`externalResourceProvider: true`), as `device-classes` chooses them. Writes nothing.
    PermittedDevices {
        /// Every model the vGPU model table knows, not this node's GPUs.
        #[arg(long)]
        catalogue: bool,
    },
}

fn main() -> ExitCode {
    if let Some(code) = daemon_kit::manual::generate_if_asked::<Cli>() {
        return code;
    }
    let cli = Cli::parse();
    cli.log.init(false);
    exit::finish(run(cli), Report::Log)
}

fn run(cli: Cli) -> exit::Result {
    let mut paths = cli.host.paths();
    for (flag, dir) in [
        ("--kubelet-root", &cli.kubelet_root),
        ("--cdi-root", &cli.cdi_root),
    ] {
        if !dir.is_absolute() {
            return Err(exit::Failure::new(
                exit::USAGE,
                anyhow::anyhow!(
                    "{flag} {} is not an absolute path (it is the host's view of that directory)",
                    dir.display()
                ),
            ));
        }
    }
    if cli.host.kubelet_dir.is_none() {
        let root = cli
            .kubelet_root
            .strip_prefix("/")
            .unwrap_or(&cli.kubelet_root);
        let device_plugins = paths.root().join(root).join("device-plugins");
        paths = paths.with_kubelet_dir(Some(device_plugins));
    }
    let command = cli.command.unwrap_or(Command::Daemon);
    if let Command::DeviceClasses { catalogue } | Command::PermittedDevices { catalogue } = command
    {
        let pci_ids = match &cli.pci_ids {
            Some(p) => PciIds::from_file(p)
                .with_context(|| format!("reading --pci-ids {}", p.display()))?,
            None => PciIds::embedded(),
        };
        let (resources, problems) = if catalogue {
            sandbox_dra::extended::catalogue(&pci_ids, cli.vgpu.is_some(), &cli.vgpu_types)
        } else {
            let devices = sandbox_dra::node_devices(
                &paths,
                cli.vendor,
                &pci_ids,
                cli.vgpu.as_ref(),
                &cli.vgpu_types,
            )
            .context("reading the node")?;
            sandbox_dra::extended::of_node(&devices, &pci_ids)
        };
        for p in &problems {
            eprintln!("warning: {p}");
        }
        match command {
            Command::DeviceClasses { .. } => print!(
                "{}",
                sandbox_dra::extended::device_classes_yaml(&resources, &cli.driver_name)
            ),
            _ => print!("{}", sandbox_dra::extended::permitted_devices(&resources)),
        }
        return Ok(());
    }
    match command {
        Command::DeviceClasses { .. } | Command::PermittedDevices { .. } => Ok(()),
        Command::Daemon => {
            let node_name = cli.events.need_node_name("daemon")?;
            let pci_ids = match &cli.pci_ids {
                Some(p) => PciIds::from_file(p)
                    .with_context(|| format!("reading --pci-ids {}", p.display()))?,
                None => PciIds::embedded(),
            };
            let config = Config {
                driver: cli.driver_name,
                kubelet_root: cli.kubelet_root,
                node_name,
                kubeconfig: cli.events.kubeconfig,
                vendor: cli.vendor,
                cdi_root: cli.cdi_root,
                on_unprepare: cli.on_unprepare,
                timeout: cli.timeout,
                pci_ids,
                resync_interval: cli.resync_interval,
                metrics_addr: cli.metrics.metrics_addr,
                vgpu: cli.vgpu,
                vgpu_types: cli.vgpu_types,
                api_timeout: cli.api_timeout,
                liveness_window: cli.liveness_window,
                taint_effect: cli.taint_effect,
                pool_per_gpu: cli.pool_per_gpu,
            };
            daemon_kit::daemon::run(Threads::Current, |shutdown| {
                sandbox_dra::run(config, paths, shutdown)
            })
        }
    }
}
