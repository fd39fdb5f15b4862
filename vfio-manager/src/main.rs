//! `vfio-manager`: bind a node's GPUs (and their IOMMU-group companions) to vfio-pci.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use common::{HostPaths, PciAddress, error_chain};
use tokio_util::sync::CancellationToken;
use vfio_manager::daemon::print_report;
use vfio_manager::select::parse_hex16;
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
///
/// Exit status: 0 every selected device is bound (or, for unbind, released); 1 some failed or
/// were refused (each is named; the others are still done); 2 usage or configuration error.
#[derive(Debug, Parser)]
#[command(name = "vfio-manager", version)]
struct Cli {
    /// The host's root filesystem: sys, dev, proc, run and lib/modules are found under it.
    #[arg(long, env = "HOST_ROOT", default_value = "/", global = true)]
    host_root: std::path::PathBuf,

    /// kubelet's device-plugin directory, where its checkpoint (kubelet_internal_checkpoint)
    /// says which devices it gave to pods while kubelet is not running.
    /// Default: <host-root>/var/lib/kubelet/device-plugins.
    #[arg(long, env = "KUBELET_DIR", value_name = "DIR", global = true)]
    kubelet_dir: Option<std::path::PathBuf>,

    /// kubelet's PodResources socket, asked which pods hold which devices.
    /// Default: pod-resources/kubelet.sock beside the kubelet directory.
    #[arg(long, env = "POD_RESOURCES_SOCKET", value_name = "PATH", global = true)]
    pod_resources_socket: Option<std::path::PathBuf>,

    /// Log format on stderr. The level comes from RUST_LOG (default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

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
    Daemon(DaemonArgs),
}

#[derive(Debug, Args)]
struct SelectArgs {
    /// Select display functions of this PCI vendor (hex, e.g. 10de). Repeatable.
    #[arg(long = "vendor", value_name = "HEX", value_parser = parse_vendor, default_value = "10de")]
    vendors: Vec<u16>,
    /// Select functions with this vendor:device id instead (e.g. 10de:2236). Repeatable.
    #[arg(long = "device", value_name = "VVVV:DDDD")]
    devices: Vec<DeviceId>,
    /// Select exactly this function (e.g. 0000:65:00.0), whatever its class. Repeatable.
    #[arg(long = "address", value_name = "BDF")]
    addresses: Vec<PciAddress>,
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
    /// The most one function may take (every write and wait together), in seconds.
    #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = parse_secs)]
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
    /// Reconcile this often even without udev events, in seconds (a safety net).
    #[arg(long, value_name = "SECONDS", default_value = "60", value_parser = parse_secs)]
    resync_interval: Duration,
    /// On SIGTERM/SIGINT give the devices back to their default drivers before exiting.
    #[arg(long)]
    unbind_on_exit: bool,
}

fn parse_vendor(s: &str) -> Result<u16, String> {
    parse_hex16(s).ok_or_else(|| format!("not a hex vendor id: {s:?}"))
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("not a number of seconds: {s:?}"))?;
    if !v.is_finite() || v <= 0.0 || v > 86_400.0 {
        return Err(format!("must be between 0 and 86400 seconds: {s:?}"));
    }
    Ok(Duration::from_secs_f64(v))
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

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn code(c: i32) -> ExitCode {
    ExitCode::from(u8::try_from(c).unwrap_or(1))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let paths = HostPaths::new(&cli.host_root)
        .with_kubelet_dir(cli.kubelet_dir)
        .with_pod_resources_socket(cli.pod_resources_socket);
    if !paths.sys().is_dir() {
        eprintln!(
            "error: {} is not a directory; is --host-root ({}) the host's root?",
            paths.sys().display(),
            cli.host_root.display()
        );
        return ExitCode::from(2);
    }
    match cli.command {
        Command::Bind(a) => match vfio_manager::run_bind(&a.select.config(false), &paths) {
            Ok(r) => {
                print_report(&r, false);
                code(r.exit_code())
            }
            Err(e) => {
                eprintln!("error: {}", error_chain(&e));
                ExitCode::from(1)
            }
        },
        Command::Unbind(a) => match vfio_manager::run_unbind(&a.select.config(a.force), &paths) {
            Ok(r) => {
                print_report(&r, false);
                code(r.exit_code())
            }
            Err(e) => {
                eprintln!("error: {}", error_chain(&e));
                ExitCode::from(1)
            }
        },
        Command::Status(a) => match vfio_manager::run_status(&a.select.config(false), &paths) {
            Ok(st) => {
                if a.json {
                    match serde_json::to_string_pretty(&st) {
                        Ok(s) => println!("{s}"),
                        Err(e) => {
                            eprintln!("error: cannot format the status: {e}");
                            return ExitCode::from(1);
                        }
                    }
                } else {
                    print!("{}", st.to_text());
                }
                code(st.exit_code())
            }
            Err(e) => {
                eprintln!("error: {}", error_chain(&e));
                ExitCode::from(1)
            }
        },
        Command::Daemon(a) => {
            let cfg = DaemonConfig {
                config: a.select.config(false),
                resync_interval: a.resync_interval,
                unbind_on_exit: a.unbind_on_exit,
                udev: true,
            };
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the async runtime: {e}");
                    return ExitCode::from(1);
                }
            };
            let shutdown = CancellationToken::new();
            let status = rt.block_on(async {
                let s = shutdown.clone();
                tokio::spawn(async move {
                    wait_for_signal().await;
                    s.cancel();
                });
                vfio_manager::run_daemon(cfg, paths, shutdown).await
            });
            code(status)
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            tracing::error!("cannot install signal handlers; only Ctrl-C stops the daemon");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
}
