//! The simulated nodes measured: node-sim's built-in topologies and generated ones.

use std::fmt::Write as _;

use anyhow::{Result, anyhow};
use node_sim::Topology;
use testkit::sim::SimDir;

/// `n` GPUs of a catalogue model, each behind its own root port, split over two NUMA nodes.
pub fn generated(model: &str, n: usize) -> Result<Topology> {
    let mut s = format!("name = \"{n}x{model}-gen\"\ndescription = \"generated for benchmarks\"\n");
    for i in 0..n {
        let bus = 0x10 + 2 * i;
        let numa = i * 2 / n;
        let _ = write!(
            s,
            "[[bridge]]\naddress = \"0000:{bus:02x}:01.0\"\nnuma = {numa}\n\n\
             [[device]]\naddress = \"0000:{:02x}:00.0\"\nmodel = \"{model}\"\nbridge = \"0000:{bus:02x}:01.0\"\n\n",
            bus + 1
        );
    }
    Topology::parse(&s, &format!("{n}x{model}-gen")).map_err(|e| anyhow!("generated topology: {e}"))
}

/// A node-sim built-in topology.
pub fn builtin(name: &str) -> Result<Topology> {
    node_sim::topology(name).map_err(|e| anyhow!("topology {name}: {e}"))
}

/// A fresh mount of the topology.
pub fn mount(t: &Topology) -> SimDir {
    testkit::sim::mount_topology(t)
}

/// NVIDIA display functions.
pub fn gpu_count(t: &Topology) -> usize {
    t.devices
        .iter()
        .filter(|d| d.vendor == 0x10de && d.class >> 16 == 0x03)
        .count()
}
