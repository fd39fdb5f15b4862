//! The chart's extended resources (`deploy/helm/gpu-vm-node/files/extended-resources.yaml`) are
//! what `sandbox_dra::extended::chart_data` makes of the vGPU model table and the embedded
//! `pci.ids`: this test fails when they differ; `UPDATE_EXTENDED_RESOURCES=1` (as
//! `deploy/generate.sh` runs it) writes the file instead.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::path::Path;

#[test]
fn the_charts_extended_resources_are_the_catalogues() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/helm/gpu-vm-node/files/extended-resources.yaml");
    let want = sandbox_dra::extended::chart_data(&common::PciIds::embedded());
    if std::env::var_os("UPDATE_EXTENDED_RESOURCES").is_some() {
        std::fs::write(&file, &want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        have == want,
        "{} is not what the catalogue makes: run deploy/generate.sh and commit it",
        file.display()
    );
}
