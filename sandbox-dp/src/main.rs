//! `sandbox-dp`: the kubelet device plugin for passthrough GPUs and vGPUs.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use common::{HostPaths, PciIds};
use sandbox_dp::discovery::{DiscoverConfig, parse_alias, parse_vendor};
use sandbox_dp::{Config, report};
use tokio_util::sync::CancellationToken;

/// Kubelet device plugin for NVIDIA GPUs given to KubeVirt VMs: whole GPUs on vfio-pci, mdev
/// vGPUs and SR-IOV vGPU VFs. Resource names and env vars match NVIDIA's
/// kubevirt-gpu-device-plugin, so existing VM specs keep working.
#[derive(Debug, Parser)]
#[command(name = "sandbox-dp", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    /// The host's root directory; /sys, /dev and the kubelet directory are found under it. In a
    /// pod the host's / is usually mounted at /host.
    #[arg(long, env = "HOST_ROOT", default_value = "/", global = true)]
    host_root: PathBuf,

    /// The kubelet device-plugin directory (holds kubelet.sock and our sockets).
    /// Default: <host-root>/var/lib/kubelet/device-plugins.
    #[arg(long, env = "KUBELET_DIR", value_name = "DIR", global = true)]
    kubelet_dir: Option<PathBuf>,

    /// PCI vendor id (hex) whose devices are advertised, or "any" (also admits mdevs on
    /// non-PCI parents such as the kernel's mtty sample).
    #[arg(long, default_value = "10de", value_parser = parse_vendor_arg, global = true)]
    vendor: Vendor,

    /// A pci.ids file to name passthrough resources from, instead of the embedded NVIDIA list.
    #[arg(long, value_name = "FILE", global = true)]
    pci_ids: Option<PathBuf>,

    /// Rename a resource: OLD is a resource name (nvidia.com/GA102GL_A10) or a device id
    /// (10de:2236); NEW is a name, with nvidia.com/ added when it has no prefix. Repeatable.
    #[arg(long, value_name = "OLD=NEW", value_parser = parse_alias, global = true)]
    resource_alias: Vec<(String, String)>,

    /// Serve Prometheus metrics on this address (for example 0.0.0.0:9400), at /metrics.
    #[arg(long, value_name = "ADDR", global = true)]
    metrics_addr: Option<SocketAddr>,

    /// Re-read the node this often even without events (a safety net; events drive updates).
    #[arg(long, default_value = "30s", value_parser = parse_duration, global = true)]
    resync_interval: Duration,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the device plugin (the default).
    Serve,
    /// Print the resources and devices that would be advertised: health, NUMA node, IOMMU group.
    /// Writes nothing.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print KubeVirt's permittedHostDevices block for what this node has. Writes nothing.
    PermittedDevices,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// `--vendor`: a PCI vendor id, or `None` for any.
#[derive(Clone, Copy, Debug)]
struct Vendor(Option<u16>);

fn parse_vendor_arg(s: &str) -> Result<Vendor, String> {
    parse_vendor(s).map(Vendor)
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("not a duration (like 30s, 500ms, 5m): {s:?}"))?;
    if !(v > 0.0 && v.is_finite()) {
        return Err(format!("duration must be positive: {s:?}"));
    }
    Ok(Duration::from_secs_f64(v * mult))
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let serving = matches!(cli.command, None | Some(Command::Serve));
    match real_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The daemon reports through its log (text or JSON); the one-shot commands plainly.
            if serving {
                tracing::error!("{e:#}");
            } else {
                eprintln!("sandbox-dp: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<()> {
    let paths = HostPaths::new(&cli.host_root).with_kubelet_dir(cli.kubelet_dir);
    let pci_ids = match &cli.pci_ids {
        Some(p) => {
            PciIds::from_file(p).with_context(|| format!("reading --pci-ids {}", p.display()))?
        }
        None => PciIds::embedded(),
    };
    let discover = DiscoverConfig {
        vendor: cli.vendor.0,
        pci_ids,
        aliases: cli
            .resource_alias
            .iter()
            .cloned()
            .collect::<BTreeMap<_, _>>(),
    };
    match cli.command.unwrap_or(Command::Serve) {
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
        Command::Serve => {
            let config = Config {
                kubelet_dir: paths.kubelet_dir().to_path_buf(),
                discover,
                metrics_addr: cli.metrics_addr,
                resync_interval: cli.resync_interval,
                debounce: Duration::from_millis(20),
            };
            // One thread serves every resource: a device plugin answers a few calls a minute,
            // and each worker thread costs memory (its stack, its allocator arena). Node reads
            // run on the blocking pool, whose threads exit when idle.
            let rt = tokio::runtime::Builder::new_current_thread()
                .thread_keep_alive(Duration::from_secs(1))
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            rt.block_on(serve(config, paths))
        }
    }
}

async fn serve(config: Config, paths: HostPaths) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        }
        stop.cancel();
    });
    tracing::info!(
        host_root = %paths.root().display(),
        kubelet_dir = %config.kubelet_dir.display(),
        "starting"
    );
    sandbox_dp::run(config, paths, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("abc").is_err());
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
