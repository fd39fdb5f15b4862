//! `vfio-manager`: bind a node's GPUs (and their IOMMU-group companions) to vfio-pci.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use common::PciAddress;
use daemon_kit::cli::{
    self, EventsArgs, HostArgs, LogArgs, MetricsArgs, PodResourcesArgs, SERVE_ALIAS,
};
use daemon_kit::daemon::Threads;
use daemon_kit::duration;
use daemon_kit::exit::{self, Failure, OrExit, Report};
use vfio_manager::daemon::print_report;
use vfio_manager::{Config, DaemonConfig, DeviceId, Selector};

/// Bind selected GPUs, and every other function of their IOMMU groups, to vfio-pci for PCI
/// passthrough; give them back; show their state; or keep them bound as a daemon.
///
/// By default every NVIDIA display-class function (VGA 0x0300, 3D 0x0302) is selected together
/// with the other endpoint functions of its IOMMU group (HDMI audio, USB-C). Bridges are never
/// touched. A group that also holds another vendor's device is refused, naming that device.
///
/// A device in use is never taken: one a process holds open (/dev/vfio/<group>, its VFIO cdev,
/// /dev/nvidia<N>), one kubelet gave to a pod (its PodResources API; its checkpoint while
/// kubelet is down), or one for which either cannot be read (unknown counts as in use). A GPU
/// is in use when any of its functions, VFs or vGPUs is.
#[derive(Debug, Parser)]
#[command(name = "vfio-manager", version, after_help = EXIT_STATUS)]
struct Cli {
    #[command(flatten)]
    host: HostArgs,
    #[command(flatten)]
    pod_resources: PodResourcesArgs,
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

/// The exit-status table, shown after `--help`.
const EXIT_STATUS: &str = "\
Exit status:
  0  every selected device is bound (unbind: released; status: every selected function is
     bound; daemon: stopped by SIGTERM/SIGINT)
  1  some failed or were refused (each is named; the others are still done), or the node
     could not be read; daemon: --unbind-on-exit could not give every device back
  2  usage or configuration error (a bad flag, a --host-root without sys/); nothing changed";

#[derive(Debug, Subcommand)]
enum Command {
    /// Put every selected function on its VFIO driver: set driver_override, unbind from the
    /// current driver, drivers_probe, then check the driver link and /dev/vfio/<group>.
    /// Functions already on it are not written to. IOMMU groups are done in parallel. Prints
    /// one line per device changed and a summary with the elapsed time. A GPU in use is
    /// refused, naming who uses it, and not written to: a process holding its /dev/nvidia<N>
    /// (the unbind would hang), or anyone using its VFs or vGPUs (the unbind destroys them). A
    /// pod kubelet gave the GPU itself to (passthrough) does not stop it: it needs it on VFIO.
    Bind(BindArgs),
    /// Give every selected function on a VFIO driver back: unbind, reprobe, clear
    /// driver_override. It returns to the driver it had before `bind` (remembered under
    /// <host-root>/run/vfio-manager), or else to whichever driver the kernel probes. A group in
    /// use (a VM holds its /dev/vfio/<group>, kubelet gave a member to a pod, or that cannot be
    /// read) is refused, naming who uses it, and nothing in it is written, unless --force.
    Unbind(UnbindArgs),
    /// Show each selected function: driver, IOMMU group, group members, whether the group is
    /// viable for a VM (all endpoints on VFIO, /dev/vfio/<group> present) and who uses it (for
    /// a bound function its group's users, for another what would stop a bind). Writes
    /// nothing. Exits 0 only when every selected function is bound.
    Status(StatusArgs),
    /// Bind, write <host-root>/run/nvidia/validations/vfio-pci-ready once every selected
    /// function is bound, then keep binding GPUs that appear later (udev events, plus a slow
    /// resync). The readiness file is removed whenever a selected function is not bound.
    /// SIGTERM/SIGINT exit 0 leaving the devices bound, unless --unbind-on-exit.
    #[command(visible_alias = SERVE_ALIAS)]
    Daemon(DaemonArgs),
}

#[derive(Debug, Args)]
struct SelectArgs {
    /// Select display functions of this PCI vendor (hex, e.g. 10de). Repeatable. `any` is
    /// refused: every vendor's display functions would include the host's own console GPU.
    #[arg(long = "vendor", value_name = "HEX", value_parser = cli::pci_vendor, default_value = "10de")]
    vendors: Vec<u16>,
    /// Select functions with this vendor:device id instead (e.g. 10de:2236). Repeatable.
    #[arg(long = "device", value_name = "VVVV:DDDD")]
    devices: Vec<DeviceId>,
    /// Select exactly this function (e.g. 0000:65:00.0), whatever its class. Repeatable.
    /// `-d`/`--device-id` is the spelling of NVIDIA's vfio-manage.
    #[arg(
        long = "address",
        short = 'd',
        visible_alias = "device-id",
        value_name = "BDF"
    )]
    addresses: Vec<PciAddress>,
    /// Every display function of --vendor and its group, which is also what no selector
    /// selects: `vfio-manage bind --all` as the GPU Operator runs it.
    #[arg(short = 'a', long, conflicts_with_all = ["addresses", "devices"])]
    all: bool,
    /// Never select this function. Repeatable. Excluding one member of a group leaves the whole
    /// group alone.
    #[arg(long = "exclude", value_name = "BDF")]
    exclude: Vec<PciAddress>,
    /// Bind a group even when it holds another vendor's device (that device is bound too).
    #[arg(long)]
    allow_foreign_in_group: bool,
    /// Bind to this driver instead of vfio-pci or the variant VFIO driver that the kernel's
    /// modules.alias names for the device.
    #[arg(long, value_name = "NAME")]
    driver: Option<String>,
    /// The most one function may take, every write and wait together (500ms, 30s, 2m; a bare
    /// number is seconds).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = duration::parse)]
    timeout: Duration,
}

#[derive(Debug, Args)]
struct BindArgs {
    #[command(flatten)]
    select: SelectArgs,
}

#[derive(Debug, Args)]
struct UnbindArgs {
    #[command(flatten)]
    select: SelectArgs,
    /// Unbind even a group in use: held open by a process (a VM loses its device), given to a
    /// pod by kubelet, or whose users cannot be read.
    #[arg(long)]
    force: bool,
}

#[derive(Debug, Args)]
struct StatusArgs {
    #[command(flatten)]
    select: SelectArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct DaemonArgs {
    #[command(flatten)]
    select: SelectArgs,
    /// Reconcile this often even without udev events, a safety net (30s, 5m; a bare number is
    /// seconds).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = duration::parse)]
    resync_interval: Duration,
    /// On SIGTERM/SIGINT give the devices back to their default drivers before exiting.
    #[arg(long)]
    unbind_on_exit: bool,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    events: EventsArgs,
}

impl SelectArgs {
    fn config(&self, force: bool) -> Config {
        Config {
            selector: Selector {
                vendors: self.vendors.clone(),
                devices: self.devices.clone(),
                addresses: self.addresses.clone(),
                exclude: self.exclude.clone(),
                allow_foreign_in_group: self.allow_foreign_in_group,
            },
            driver: self.driver.clone(),
            timeout: self.timeout,
            force,
        }
    }
}

fn main() -> ExitCode {
    if let Some(code) = daemon_kit::manual::generate_if_asked::<Cli>() {
        return code;
    }
    let cli = Cli::parse();
    cli.log.init(false);
    let report = match cli.command {
        Command::Daemon(_) => Report::Log,
        _ => Report::Stderr,
    };
    exit::finish(run(cli), report)
}

fn run(cli: Cli) -> exit::Result {
    let paths = cli.pod_resources.apply(cli.host.paths());
    if !paths.sys().is_dir() {
        return Err(Failure::new(
            exit::USAGE,
            anyhow::anyhow!(
                "{} is not a directory; is --host-root ({}) the host's root?",
                paths.sys().display(),
                cli.host.host_root.display()
            ),
        ));
    }
    match cli.command {
        Command::Bind(a) => {
            let r =
                vfio_manager::run_bind(&a.select.config(false), &paths).or_exit(exit::FAILED)?;
            print_report(&r, false);
            exit::status(r.exit_code())
        }
        Command::Unbind(a) => {
            let r = vfio_manager::run_unbind(&a.select.config(a.force), &paths)
                .or_exit(exit::FAILED)?;
            print_report(&r, false);
            exit::status(r.exit_code())
        }
        Command::Status(a) => {
            let st =
                vfio_manager::run_status(&a.select.config(false), &paths).or_exit(exit::FAILED)?;
            if a.json {
                let json = serde_json::to_string_pretty(&st)
                    .map_err(|e| anyhow::anyhow!("cannot format the status: {e}"))?;
                println!("{json}");
            } else {
                print!("{}", st.to_text());
            }
            exit::status(st.exit_code())
        }
        Command::Daemon(a) => {
            let cfg = DaemonConfig {
                config: a.select.config(false),
                resync_interval: a.resync_interval,
                unbind_on_exit: a.unbind_on_exit,
                udev: true,
                metrics_addr: a.metrics.metrics_addr,
                node_name: a.events.node_name,
                kubeconfig: a.events.kubeconfig,
            };
            daemon_kit::daemon::run(Threads::Workers(2), |shutdown| {
                vfio_manager::daemon::run(cfg, paths, shutdown)
            })
        }
    }
}
