//! Scenario 3: sandbox-dp advertises and allocates real vfio-pci devices and mdevs to the test
//! kubelet (`vm-kubelet`, built on testkit's fake kubelet) inside the guest.

use vm_tier::{Job, build_binaries, require_or_skip, run};

#[test]
fn sandbox_dp_serves_real_devices_to_the_test_kubelet() {
    let Some(p) = require_or_skip() else { return };
    build_binaries("sandbox-dp").unwrap_or_else(|e| panic!("VM tier: {e}"));
    let job = Job::scenario("sandbox-dp", "3-sandbox-dp.sh")
        .env("VMTIER_KUBELET", env!("CARGO_BIN_EXE_vm-kubelet"));
    let outcome = run(&p, &job).unwrap();
    outcome.assert_all_passed();
}

/// Scenario 7: `sandbox-dp --on-demand mtty` creates a real mdev in Allocate and removes it once
/// the test kubelet's PodResources no longer lists its pod.
#[test]
fn sandbox_dp_creates_an_mtty_mdev_on_demand_and_removes_it_on_release() {
    let Some(p) = require_or_skip() else { return };
    build_binaries("sandbox-dp").unwrap_or_else(|e| panic!("VM tier: {e}"));
    let job = Job::scenario("sandbox-dp-on-demand", "7-sandbox-dp-on-demand.sh")
        .env("VMTIER_KUBELET", env!("CARGO_BIN_EXE_vm-kubelet"));
    let outcome = run(&p, &job).unwrap();
    outcome.assert_all_passed();
}
