//! vgpu-device-manager: make the node's vGPUs match a named profile of a
//! `version: v1` / `vgpu-configs` file (NVIDIA vgpu-device-manager's format).
//!
//! - [`config`] parses and checks the file.
//! - [`models`] (common's [`common::vgpu::models`]) knows what NVIDIA's GPU models make, for
//!   what sysfs does not show yet.
//! - [`gpu`] turns the node's inventory into per-GPU state: backend, types, vGPUs and users.
//! - [`plan`] plans a profile against that state (a pure function).
//! - [`apply`] reads, plans and executes, GPUs in parallel.
//! - [`daemon`] keeps the node on the profile named by a node label or a flag.
//! - [`node_meta`] writes the daemon's label and annotation on its Node, by patch or update.

pub mod apply;
pub mod config;
pub mod daemon;
pub mod gpu;
pub mod node_meta;
pub mod plan;

/// The model table lives in [`common::vgpu`], shared with sandbox-dp's on-demand pool.
pub use common::vgpu::models;

use std::io::Read;
use std::path::Path;

pub use apply::{Options, Report, apply, export, make_plan};
pub use config::Config;

/// Reads the config file (`-` is stdin): one that cannot be read fails with exit status 1, one
/// that is not a valid config with 2.
pub fn read_config(path: &Path) -> daemon_kit::Result<Config> {
    use anyhow::Context;
    use daemon_kit::exit::{self, OrExit};
    let text = if path == Path::new("-") {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("cannot read the config from stdin")?;
        s
    } else {
        std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?
    };
    Config::parse(&text)
        .with_context(|| format!("config file {}", path.display()))
        .or_exit(exit::USAGE)
}
