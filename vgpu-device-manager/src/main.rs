//! `vgpu-device-manager`: make the node's vGPU devices match a named profile.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use common::VendorSelector;
use daemon_kit::cli::{EventsArgs, HostArgs, LogArgs, MetricsArgs, PodResourcesArgs, SERVE_ALIAS};
use daemon_kit::daemon::Threads;
use daemon_kit::duration;
use daemon_kit::exit::{self, Failure, Report};
use vgpu_device_manager::apply::Options;
use vgpu_device_manager::daemon::{DaemonConfig, Source};

/// Make the node's NVIDIA vGPU devices (mdevs and SR-IOV vGPU VFs) match a named profile of a
/// `version: v1` / `vgpu-configs` file, the format of NVIDIA's vgpu-device-manager.
///
/// A vGPU in use is never removed: one a process holds open (its /dev/vfio/<group> or VFIO
/// cdev: a running VM), one kubelet gave to a pod (its PodResources API; its checkpoint while
/// kubelet is down), or one for which either cannot be read (unknown counts as in use: a
/// truncated checkpoint removes nothing). Its GPU is left as it is and the rest is applied.
#[derive(Parser, Debug)]
#[command(name = "vgpu-device-manager", version, after_help = EXIT_STATUS)]
struct Cli {
    /// The config file (`-` reads stdin).
    #[arg(
        short = 'f',
        long = "config-file",
        env = "VGPU_DM_CONFIG_FILE",
        global = true
    )]
    config_file: Option<PathBuf>,
    /// The config file when neither -f nor VGPU_DM_CONFIG_FILE names one: the variable the GPU
    /// Operator's vgpu-device-manager DaemonSet sets.
    #[arg(
        long = "operator-config-file",
        env = "CONFIG_FILE",
        hide = true,
        global = true
    )]
    operator_config_file: Option<PathBuf>,
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
    #[command(flatten)]
    host: HostArgs,
    #[command(flatten)]
    pod_resources: PodResourcesArgs,
    /// PCI vendor (hex) whose display functions `devices:` counts, or `any`: any vendor's
    /// vGPU-capable functions, then non-PCI mdev parents (mtty, mbochs) by name.
    #[arg(long, default_value = "10de", global = true)]
    vendor: VendorSelector,
    #[command(flatten)]
    log: LogArgs,
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
    /// Longest a single sysfs write may take (500ms, 30s, 2m; a bare number is seconds).
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "30s",
        value_parser = duration::parse,
        global = true
    )]
    write_timeout: Duration,
    #[command(subcommand)]
    command: Command,
}

/// The exit-status table, shown after `--help`.
const EXIT_STATUS: &str = "\
Exit status:
  0  done (assert: the profile is applied; daemon: stopped by SIGTERM/SIGINT)
  1  not applied: a vGPU in use, a write failed, assert found differences, the node or the
     config file cannot be read; daemon: it cannot go on (its watch of the node ended)
  2  usage error, or the config or profile is invalid for this node; nothing was changed";

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
    #[command(
        visible_alias = SERVE_ALIAS,
        mut_arg("node_name", |a| a.help(NODE_NAME_HELP))
    )]
    Daemon {
        #[command(flatten)]
        events: EventsArgs,
        /// The profile when the node has no `nvidia.com/vgpu.config` label, or an empty one
        /// (DEFAULT_VGPU_CONFIG and --default-vgpu-config are the GPU Operator's names).
        #[arg(
            long,
            visible_alias = "default-vgpu-config",
            env = "DEFAULT_VGPU_CONFIG",
            default_value = "default",
            value_parser = clap::builder::NonEmptyStringValueParser::new()
        )]
        default_config: String,
        #[command(flatten)]
        retry: RetryArgs,
        #[command(flatten)]
        metrics: MetricsArgs,
    },
}

/// `daemon --node-name`: what the node is for here.
const NODE_NAME_HELP: &str = "This node's name: its label nvidia.com/vgpu.config names the \
    profile, its label nvidia.com/vgpu.config.state tells how applying it went, and the changes \
    made and refused are recorded as Events on it. Needed unless -c names a fixed profile";

/// The daemon's retry delays after a failed or blocked apply.
#[derive(Args, Debug)]
struct RetryArgs {
    /// First retry delay after a failed or blocked apply; doubles up to --retry-max. The
    /// deprecated --retry-min-ms N (milliseconds) is still accepted.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = duration::parse)]
    retry_min: Duration,
    /// Deprecated: --retry-min in milliseconds.
    #[arg(long, value_name = "MS", hide = true, value_parser = duration::parse_millis, conflicts_with = "retry_min")]
    retry_min_ms: Option<Duration>,
    /// Longest retry delay before jitter (each delay is lengthened by a random part of itself).
    /// The deprecated --retry-max-ms N (milliseconds) is still accepted.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = duration::parse)]
    retry_max: Duration,
    /// Deprecated: --retry-max in milliseconds.
    #[arg(long, value_name = "MS", hide = true, value_parser = duration::parse_millis, conflicts_with = "retry_max")]
    retry_max_ms: Option<Duration>,
}

impl RetryArgs {
    /// The first and the longest delay (never shorter than the first), warning about a
    /// deprecated spelling.
    fn delays(&self) -> (Duration, Duration) {
        for (old, new, used) in [
            ("--retry-min-ms", "--retry-min", self.retry_min_ms),
            ("--retry-max-ms", "--retry-max", self.retry_max_ms),
        ] {
            if let Some(d) = used {
                tracing::warn!("{old} is deprecated: write {new} {}", duration::format(d));
            }
        }
        let min = self.retry_min_ms.unwrap_or(self.retry_min);
        (min, self.retry_max_ms.unwrap_or(self.retry_max).max(min))
    }
}

fn main() -> ExitCode {
    if let Some(code) = daemon_kit::manual::generate_if_asked::<Cli>() {
        return code;
    }
    let cli = Cli::parse();
    cli.log.init(cli.debug);
    let report = match cli.command {
        Command::Daemon { .. } => Report::Log,
        _ => Report::Stderr,
    };
    exit::finish(run(cli), report)
}

/// A flag the command cannot do without: its absence is a usage error (exit 2).
fn need<T: Clone>(v: &Option<T>, what: &str) -> exit::Result<T> {
    v.clone()
        .ok_or_else(|| Failure::new(exit::USAGE, anyhow::anyhow!("{what} is required")))
}

fn run(mut cli: Cli) -> exit::Result {
    if cli.config_file.is_none() {
        cli.config_file = cli.operator_config_file.take();
    }
    let paths = cli.pod_resources.apply(cli.host.paths());
    let vendor = cli.vendor;
    let opts = Options {
        vendor,
        write_timeout: cli.write_timeout,
        ..Options::new(paths.clone())
    };
    match cli.command {
        Command::Apply => {
            let file = need(&cli.config_file, "-f/--config-file")?;
            let config = vgpu_device_manager::read_config(&file)?;
            let profile = config.select(cli.selected_config.as_deref())?;
            let report = vgpu_device_manager::apply(&opts, &config, &profile)?;
            print!("{}", report.render());
            exit::status(if report.success() { 0 } else { 1 })
        }
        Command::Assert { valid_config } => {
            let file = need(&cli.config_file, "-f/--config-file")?;
            let config = vgpu_device_manager::read_config(&file)?;
            let profile = config.select(cli.selected_config.as_deref())?;
            if valid_config {
                println!("profile {profile:?} is in a valid config file");
                return Ok(());
            }
            let plan = vgpu_device_manager::make_plan(&opts, &config, &profile)?;
            if plan.is_applied() {
                println!("profile {profile:?} is applied");
                Ok(())
            } else {
                eprint!("{}", plan.render());
                println!("profile {profile:?} is not applied");
                exit::status(1)
            }
        }
        Command::Plan { json } => {
            let file = need(&cli.config_file, "-f/--config-file")?;
            let config = vgpu_device_manager::read_config(&file)?;
            let profile = config.select(cli.selected_config.as_deref())?;
            let plan = vgpu_device_manager::make_plan(&opts, &config, &profile)?;
            if json {
                let json = serde_json::to_string_pretty(&plan).context("formatting the plan")?;
                println!("{json}");
            } else {
                print!("{}", plan.render());
            }
            Ok(())
        }
        Command::Export => {
            let name = cli.selected_config.unwrap_or_else(|| "current".into());
            let exported = vgpu_device_manager::export(&opts, &name)?;
            print!("{}", exported.to_yaml());
            Ok(())
        }
        Command::Daemon {
            events,
            default_config,
            retry,
            metrics,
        } => {
            let config_file = need(&cli.config_file, "-f/--config-file")?;
            let source = match cli.selected_config {
                Some(p) => Source::Fixed(p),
                None => Source::Kube {
                    node_name: events.node_name.filter(|n| !n.is_empty()).ok_or_else(|| {
                        Failure::new(
                            exit::USAGE,
                            anyhow::anyhow!(
                                "daemon needs --node-name (or NODE_NAME), or -c for a fixed profile"
                            ),
                        )
                    })?,
                    kubeconfig: events.kubeconfig,
                    default_config,
                },
            };
            let (retry_min, retry_max) = retry.delays();
            let cfg = DaemonConfig {
                vendor,
                write_timeout: cli.write_timeout,
                config_file,
                source,
                retry_min,
                retry_max,
                metrics_addr: metrics.metrics_addr,
            };
            daemon_kit::daemon::run(Threads::Workers(2), |shutdown| {
                vgpu_device_manager::daemon::run(cfg, paths, shutdown)
            })
        }
    }
}
