//! `node-sim`: mount a simulated GPU node at a directory.

use std::path::PathBuf;

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
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,fuser=error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
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
