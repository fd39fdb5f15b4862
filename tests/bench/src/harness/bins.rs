//! The daemons' binaries, found beside this one (a release build of the workspace).

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// Paths of the daemons.
pub struct Bins {
    pub vfio: PathBuf,
    pub vgpu: PathBuf,
    pub dp: PathBuf,
    pub dra: PathBuf,
}

/// The daemons beside this binary (see [`Bins::check`]).
pub fn bins() -> Bins {
    let dir = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    Bins {
        vfio: dir.join("vfio-manager"),
        vgpu: dir.join("vgpu-device-manager"),
        dp: dir.join("sandbox-dp"),
        dra: dir.join("sandbox-dra"),
    }
}

impl Bins {
    /// Whether every daemon is there.
    pub fn check(&self) -> Result<()> {
        for p in [&self.vfio, &self.vgpu, &self.dp, &self.dra] {
            need(p)?;
        }
        Ok(())
    }
}

/// Whether `p` is there; the error says how to build it.
pub fn need(p: &Path) -> Result<()> {
    if !p.exists() {
        bail!(
            "{} not found: build the daemons beside this binary first (cargo build --release --bins)",
            p.display()
        );
    }
    Ok(())
}
