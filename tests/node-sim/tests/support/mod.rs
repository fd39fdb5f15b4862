//! Helpers for node-sim's tests: a mount in a tempdir, shell-style writes.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub use node_sim::Sim;

pub struct Mounted {
    pub sim: Sim,
    _dir: tempfile::TempDir,
}

impl Mounted {
    pub fn root(&self) -> &Path {
        self.sim.root()
    }

    pub fn p(&self, rel: &str) -> PathBuf {
        self.root().join(rel)
    }

    /// `echo value > rel`: Ok or the errno.
    pub fn w(&self, rel: &str, value: &str) -> Result<(), i32> {
        std::fs::write(self.p(rel), format!("{value}\n"))
            .map_err(|e| e.raw_os_error().unwrap_or(-1))
    }

    /// `cat rel`, trimmed.
    pub fn r(&self, rel: &str) -> String {
        std::fs::read_to_string(self.p(rel))
            .unwrap_or_else(|e| panic!("reading {rel}: {e}"))
            .trim_end()
            .to_string()
    }

    pub fn exists(&self, rel: &str) -> bool {
        std::fs::symlink_metadata(self.p(rel)).is_ok()
    }

    /// `readlink rel`.
    pub fn link(&self, rel: &str) -> String {
        std::fs::read_link(self.p(rel))
            .unwrap_or_else(|e| panic!("readlink {rel}: {e}"))
            .to_string_lossy()
            .into_owned()
    }

    /// The name of the driver a device is bound to (`driver` link's last component).
    pub fn driver(&self, bdf: &str) -> Option<String> {
        std::fs::read_link(self.p(&format!("sys/bus/pci/devices/{bdf}/driver")))
            .ok()
            .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()))
    }

    pub fn ls(&self, rel: &str) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.p(rel))
            .unwrap_or_else(|e| panic!("ls {rel}: {e}"))
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    pub fn ctl(&self, cmd: &str) {
        self.sim
            .control(cmd)
            .unwrap_or_else(|e| panic!("control {cmd:?}: {e}"));
    }
}

/// Mounts a topology, or prints `skipped:` and returns None without root or /dev/fuse.
pub fn mount(topology: &str) -> Option<Mounted> {
    if let Some(why) = node_sim::unavailable() {
        node_sim::skip_test(&format!("node-sim {topology}"), why);
        return None;
    }
    let dir = tempfile::Builder::new()
        .prefix("node-sim-test-")
        .tempdir()
        .unwrap();
    let topo = node_sim::topology(topology).unwrap();
    let sim = node_sim::mount(&topo, dir.path()).unwrap();
    Some(Mounted { sim, _dir: dir })
}

pub const ENODEV: i32 = libc::ENODEV;
pub const EBUSY: i32 = libc::EBUSY;
pub const EINVAL: i32 = libc::EINVAL;
pub const EEXIST: i32 = libc::EEXIST;
pub const ENOSPC: i32 = libc::ENOSPC;
pub const EACCES: i32 = libc::EACCES;
