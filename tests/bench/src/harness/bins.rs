//! The daemons' binaries, found beside this one (a release build of the workspace).

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};

/// Paths of the daemons.
pub struct Bins {
    pub vfio: PathBuf,
    pub vgpu: PathBuf,
    pub dp: PathBuf,
    pub dra: PathBuf,
}

/// Finds the daemons beside this binary.
pub fn bins() -> Result<Bins> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow!("{} has no directory", exe.display()))?;
    let b = Bins {
        vfio: dir.join("vfio-manager"),
        vgpu: dir.join("vgpu-device-manager"),
        dp: dir.join("sandbox-dp"),
        dra: dir.join("sandbox-dra"),
    };
    for p in [&b.vfio, &b.vgpu, &b.dp, &b.dra] {
        if !p.exists() {
            bail!(
                "{} not found: build the daemons beside this binary first (cargo build --release --bins)",
                p.display()
            );
        }
    }
    Ok(b)
}
