//! `vgpu-device-manager`: make the node's vGPU devices match a named profile.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use common::HostPaths;
use tokio_util::sync::CancellationToken;
use vgpu_device_manager::apply::{ApplyError, Options};
use vgpu_device_manager::daemon::{DaemonConfig, Source};
use vgpu_device_manager::plan::VendorSel;

/// Make the node's NVIDIA vGPU devices (mdevs and SR-IOV vGPU VFs) match a named profile of a
/// `version: v1` / `vgpu-configs` file, the format of NVIDIA's vgpu-device-manager.
///
/// A vGPU in use is never removed: one a process holds open (its /dev/vfio/<group> or VFIO
/// cdev: a running VM), one kubelet gave to a pod (its PodResources API; its checkpoint while
/// kubelet is down), or one for which either cannot be read (unknown counts as in use: a
/// truncated checkpoint removes nothing). Its GPU is left as it is and the rest is applied.
///
/// Exit status: 0 done (assert: the profile is applied); 1 not applied (a vGPU in use, a write
/// failed, assert found differences, the node cannot be read); 2 the config or profile is
/// invalid for this node (nothing was changed).
#[derive(Parser, Debug)]
#[command(name = "vgpu-device-manager", version)]
struct Cli {
    /// The config file (`-` reads stdin).
    #[arg(
        short = 'f',
        long = "config-file",
        env = "VGPU_DM_CONFIG_FILE",
        global = true
    )]
    config_file: Option<PathBuf>,
    /// The profile (a key under `vgpu-configs`); may be left out when the file has only one.
    /// For `daemon`, a fixed profile instead of the node label: the daemon then runs without
    /// Kubernetes (systemd).
    #[arg(
        short = 'c',
        long = "selected-config",
        env = "VGPU_DM_SELECTED_CONFIG",
        global = true
    )]
    selected_config: Option<String>,
    /// Directory the host's `/` is at: `sys`, `proc`, `run/nvidia/validations` are found under it.
    #[arg(long, env = "HOST_ROOT", default_value = "/", global = true)]
    host_root: PathBuf,
    /// kubelet's device-plugin directory, where its checkpoint (kubelet_internal_checkpoint)
    /// says which vGPUs it gave to pods while kubelet is not running.
    /// Default: <host-root>/var/lib/kubelet/device-plugins.
    #[arg(long, env = "KUBELET_DIR", value_name = "DIR", global = true)]
    kubelet_dir: Option<PathBuf>,
    /// kubelet's PodResources socket, asked which pods hold which vGPUs.
    /// Default: pod-resources/kubelet.sock beside the kubelet directory.
    #[arg(long, env = "POD_RESOURCES_SOCKET", value_name = "PATH", global = true)]
    pod_resources_socket: Option<PathBuf>,
    /// PCI vendor (hex) whose display functions `devices:` counts, or `any`: any vendor's
    /// vGPU-capable functions, then non-PCI mdev parents (mtty, mbochs) by name.
    #[arg(long, default_value = "10de", global = true)]
    vendor: VendorSel,
    /// Log format on stderr (level from RUST_LOG, default info).
    #[arg(long, value_enum, default_value = "text", global = true)]
    log_format: LogFormat,
    /// Debug-level logging: every sysfs write is logged (RUST_LOG sets finer filters).
    #[arg(
        short = 'd',
        long,
        env = "VGPU_DM_DEBUG",
        global = true,
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::SetTrue
    )]
    debug: bool,
    /// Longest a single sysfs write may take, in seconds.
    #[arg(long, default_value = "30", global = true)]
    write_timeout: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create and remove vGPUs so the node matches the profile. A GPU whose change would remove
    /// a vGPU in use is left as it is (exit 1), naming who uses it; the rest is applied.
    Apply,
    /// Exit 0 if the node matches the profile, 1 if not (the differences go to stderr). Writes
    /// nothing.
    Assert {
        /// Only check that the config file is valid and has the profile; the node is not read.
        #[arg(
            short = 'a',
            long,
            env = "VGPU_DM_VALID_CONFIG",
            value_parser = clap::builder::BoolishValueParser::new(),
            action = clap::ArgAction::SetTrue
        )]
        valid_config: bool,
    },
    /// Print what `apply` would change, and which vGPUs in use block it (and who uses them);
    /// writes nothing.
    Plan {
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the node's current vGPUs as a config file (profile name from -c, else `current`),
    /// with the vGPUs in use and who uses them as comments. Writes nothing.
    Export,
    /// Keep the node on the profile named by the node label `nvidia.com/vgpu.config` (or by
    /// -c, without Kubernetes); re-apply when the label or the config file changes.
    Daemon {
        /// This node's name.
        #[arg(long, env = "NODE_NAME")]
        node_name: Option<String>,
        /// A kubeconfig file; in-cluster config (or $KUBECONFIG) when absent.
        #[arg(long, env = "KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
        /// The profile when the node has no `nvidia.com/vgpu.config` label.
        #[arg(long, default_value = "default")]
        default_config: String,
        /// First retry delay (ms) after a failed or blocked apply; doubles up to --retry-max-ms.
        #[arg(long, default_value = "2000")]
        retry_min_ms: u64,
        /// Longest retry delay (ms).
        #[arg(long, default_value = "300000")]
        retry_max_ms: u64,
    },
}

fn init_logging(format: LogFormat, debug: bool) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if debug {
        filter = filter.add_directive(tracing::level_filters::LevelFilter::DEBUG.into());
    }
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
    init_logging(cli.log_format, cli.debug);
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            let code = e
                .downcast_ref::<ApplyError>()
                .map_or(1, |a| a.exit_code() as u8);
            let code = if e
                .downcast_ref::<vgpu_device_manager::config::ConfigError>()
                .is_some()
            {
                2
            } else {
                code
            };
            eprintln!("error: {e:#}");
            ExitCode::from(code)
        }
    }
}

fn need<T: Clone>(v: &Option<T>, what: &str) -> anyhow::Result<T> {
    v.clone().with_context(|| format!("{what} is required"))
}

fn run(cli: Cli) -> anyhow::Result<u8> {
    let mut opts = Options::new(
        HostPaths::new(&cli.host_root)
            .with_kubelet_dir(cli.kubelet_dir)
            .with_pod_resources_socket(cli.pod_resources_socket),
    );
    opts.vendor = cli.vendor;
    opts.write_timeout = Duration::from_secs(cli.write_timeout);
    match cli.command {
        Command::Apply => {
            let file = need(&cli.config_file, "-f/--config-file")?;
            let config = vgpu_device_manager::read_config(&file)?;
            let profile = config.select(cli.selected_config.as_deref())?;
            let report = vgpu_device_manager::apply(&opts, &config, &profile)?;
            print!("{}", report.render());
            Ok(if report.success() { 0 } else { 1 })
        }
        Command::Assert { valid_config } => {
            let file = need(&cli.config_file, "-f/--config-file")?;
            let config = vgpu_device_manager::read_config(&file)?;
            let profile = config.select(cli.selected_config.as_deref())?;
            if valid_config {
                println!("profile {profile:?} is in a valid config file");
                return Ok(0);
            }
            let plan = vgpu_device_manager::make_plan(&opts, &config, &profile)?;
            if plan.is_applied() {
                println!("profile {profile:?} is applied");
                Ok(0)
            } else {
                eprint!("{}", plan.render());
                println!("profile {profile:?} is not applied");
                Ok(1)
            }
        }
        Command::Plan { json } => {
            let file = need(&cli.config_file, "-f/--config-file")?;
            let config = vgpu_device_manager::read_config(&file)?;
            let profile = config.select(cli.selected_config.as_deref())?;
            let plan = vgpu_device_manager::make_plan(&opts, &config, &profile)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&plan)?);
            } else {
                print!("{}", plan.render());
            }
            Ok(0)
        }
        Command::Export => {
            let name = cli.selected_config.unwrap_or_else(|| "current".into());
            let exported = vgpu_device_manager::export(&opts, &name)?;
            print!("{}", exported.to_yaml());
            Ok(0)
        }
        Command::Daemon {
            node_name,
            kubeconfig,
            default_config,
            retry_min_ms,
            retry_max_ms,
        } => {
            let config_file = need(&cli.config_file, "-f/--config-file")?;
            let source = match (cli.selected_config, node_name) {
                (Some(p), _) => Source::Fixed(p),
                (None, Some(node_name)) => Source::Kube {
                    node_name,
                    kubeconfig,
                    default_config,
                },
                (None, None) => {
                    anyhow::bail!(
                        "daemon needs --node-name (or NODE_NAME), or -c for a fixed profile"
                    )
                }
            };
            let cfg = DaemonConfig {
                opts,
                config_file,
                source,
                retry_min: Duration::from_millis(retry_min_ms),
                retry_max: Duration::from_millis(retry_max_ms.max(retry_min_ms)),
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("cannot start the async runtime")?;
            rt.block_on(async move {
                let shutdown = CancellationToken::new();
                let s = shutdown.clone();
                tokio::spawn(async move {
                    wait_for_signal().await;
                    tracing::info!("stopping");
                    s.cancel();
                });
                vgpu_device_manager::daemon::run(cfg, shutdown).await
            })?;
            Ok(0)
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
