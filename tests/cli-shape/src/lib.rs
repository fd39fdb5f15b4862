//! The four binaries as a user runs them: where they are, built by the cargo running the tests.
//! The checks are in `tests/shape.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(Path::parent)
        .map_or_else(|| manifest.to_path_buf(), Path::to_path_buf)
}

/// Builds the four binaries with the cargo running the tests (nothing to do when they are
/// current) and returns the directory holding them: the one this test executable's profile
/// builds into (`target/debug` for `cargo test`).
pub fn binaries() -> Result<PathBuf, String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args(["build", "--quiet", "--bins"]);
    for p in BINARIES {
        cmd.args(["-p", p]);
    }
    let out = cmd
        .current_dir(repo_root())
        .output()
        .map_err(|e| format!("running {}: {e}", Path::new(&cargo).display()))?;
    if !out.status.success() {
        return Err(format!(
            "building the binaries failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    // The test executable lives in <target>/<profile>/deps/.
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent()?.parent().map(Path::to_path_buf))
        .ok_or_else(|| "cannot tell where the binaries are".to_string())
}

/// The binaries whose command line is checked.
pub const BINARIES: [&str; 4] = [
    "vfio-manager",
    "vgpu-device-manager",
    "sandbox-dp",
    "sandbox-dra",
];
