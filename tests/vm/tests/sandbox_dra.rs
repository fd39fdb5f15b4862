//! Scenario 5: sandbox-dra prepares and unprepares a claim for the emulated VGA device on a real
//! kernel, driven by the test kubelet and API server (`vm-dra-kubelet`, built on testkit's).

use vm_tier::{Job, build_binaries, require_or_skip, run};

#[test]
fn sandbox_dra_prepares_a_claim_for_a_real_device() {
    let Some(p) = require_or_skip() else { return };
    build_binaries("sandbox-dra").unwrap_or_else(|e| panic!("VM tier: {e}"));
    let job = Job::scenario("sandbox-dra", "5-sandbox-dra.sh")
        .env("VMTIER_DRA_KUBELET", env!("CARGO_BIN_EXE_vm-dra-kubelet"));
    let outcome = run(&p, &job).unwrap();
    outcome.assert_all_passed();
}
