//! Scenario 8: sandbox-dra publishes the sample mdev driver mtty (`--vgpu mtty`) and prepares
//! and unprepares a claim of one of its devices on a real kernel, driven by the test kubelet and
//! API server (`vm-dra-kubelet --mdev-parent mtty`).

use vm_tier::{Job, build_binaries, require_or_skip, run};

#[test]
fn sandbox_dra_prepares_an_mtty_mdev_on_a_real_kernel() {
    let Some(p) = require_or_skip() else { return };
    build_binaries("sandbox-dra").unwrap_or_else(|e| panic!("VM tier: {e}"));
    let job = Job::scenario("sandbox-dra-mdev", "8-sandbox-dra-mdev.sh")
        .env("VMTIER_DRA_KUBELET", env!("CARGO_BIN_EXE_vm-dra-kubelet"));
    let outcome = run(&p, &job).unwrap();
    outcome.assert_all_passed();
}
