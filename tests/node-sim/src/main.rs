//! `node-sim`: mount a simulated GPU node at a directory.

use std::path::PathBuf;

mod demo;

use anyhow::Context;
use clap::{Parser, Subcommand};
use nix::sys::signal::{SigSet, Signal};

#[derive(Parser, Debug)]
#[command(
    name = "node-sim",
    version,
    about = "A simulated GPU node: sysfs, /dev and /proc with the kernel's effects"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Make DIR a host root for the topology and serve it until SIGTERM or SIGINT.
    Mount {
        /// A built-in topology name or a TOML topology file.
        #[arg(long, short)]
        topology: String,
        /// The directory to make a host root.
        dir: PathBuf,
    },
    /// List the built-in topologies.
    Topologies,
    /// Print the vGPU type catalogue.
    Catalogue,
    /// Simulated nodes with the real daemons run against them: a passthrough node
    /// (vfio-manager, then sandbox-dp), a vGPU node (vgpu-device-manager, then sandbox-dp), a
    /// node with vGPUs made on demand (sandbox-dp --on-demand) and a DRA node (sandbox-dra),
    /// each with a test kubelet (and API server). Prints what `kubectl describe node` would show
    /// under Capacity/Allocatable, what a VM's virt-launcher receives (Allocate's env, a
    /// claim's device metadata), and KubeVirt's permittedHostDevices block. Cleans up after
    /// itself, also on Ctrl-C. The daemons are looked for beside this binary (build them with
    /// `cargo build --release --bins`).
    Demo {
        /// The topology of every node: a built-in name or a TOML file.
        #[arg(long, short, default_value = "2xA10")]
        topology: String,
        /// The vGPU profile of the second node [default: A10-4Q on A10 nodes, else `default`].
        #[arg(long)]
        profile: Option<String>,
        /// Where the daemons' binaries are [default: beside node-sim].
        #[arg(long)]
        bin_dir: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The demo speaks for itself on stdout; only problems go to the log.
    let default_filter = if matches!(cli.cmd, Cmd::Demo { .. }) {
        "warn,fuser=error"
    } else {
        "info,fuser=error"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.cmd {
        Cmd::Mount { topology, dir } => {
            let topo = node_sim::topology(&topology)?;
            // Block the signals before the FUSE threads start so that only this thread takes
            // them.
            let mut set = SigSet::empty();
            set.add(Signal::SIGTERM);
            set.add(Signal::SIGINT);
            set.thread_block().context("blocking SIGTERM/SIGINT")?;
            let sim = node_sim::mount(&topo, &dir)?;
            tracing::info!(topology = %topo.name, root = %sim.root().display(), "node-sim mounted");
            let sig = set.wait().context("waiting for a signal")?;
            tracing::info!("{sig:?}: unmounting");
            sim.unmount()?;
        }
        Cmd::Demo {
            topology,
            profile,
            bin_dir,
        } => {
            if let Err(e) = demo::run(demo::DemoArgs {
                topology,
                profile,
                bin_dir,
            }) {
                if e.downcast_ref::<demo::Interrupted>().is_some() {
                    eprintln!("{e}");
                    std::process::exit(130);
                }
                return Err(e);
            }
        }
        Cmd::Topologies => {
            for name in node_sim::topology::BUILTINS {
                let t = node_sim::topology(name)?;
                println!("{name:<16} {}", t.description);
            }
        }
        Cmd::Catalogue => {
            for g in &node_sim::catalogue().gpus {
                println!(
                    "{} 10de:{:04x} {:?} {:?} totalvfs={}",
                    g.model, g.device, g.pci_name, g.attach, g.sriov_totalvfs
                );
                for t in &g.types {
                    println!(
                        "  nvidia-{:<5} {:<22} max={:<3} fb={}M{}",
                        t.id,
                        t.full_name,
                        t.max,
                        t.framebuffer_mb,
                        if t.mig { " (MIG)" } else { "" }
                    );
                }
            }
        }
    }
    Ok(())
}
