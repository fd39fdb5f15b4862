//! The committed default vGPU ConfigMap (`deploy/helm/gpu-vm-node/files/vgpu-config.yaml`) is
//! the generator's output for the catalogue. After changing `catalogue.toml` or the generator,
//! regenerate it and the manifests rendered from the chart with `deploy/generate.sh`, which runs
//!
//! ```sh
//! UPDATE_CONFIGMAP=1 cargo test -p node-sim --test configmap
//! ```

use std::path::PathBuf;

use node_sim::catalogue;
use node_sim::configmap::default_vgpu_configmap;

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/helm/gpu-vm-node/files/vgpu-config.yaml")
}

#[test]
fn committed_configmap_matches_the_catalogue() {
    let path = committed_path();
    let generated = default_vgpu_configmap(catalogue());
    if std::env::var_os("UPDATE_CONFIGMAP").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    let committed = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    if committed != generated {
        let first = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map_or_else(
                || committed.lines().count().min(generated.lines().count()) + 1,
                |i| i + 1,
            );
        panic!(
            "{} is not the generator's output (first difference at line {first}); regenerate \
             with: deploy/generate.sh",
            path.display()
        );
    }
}
