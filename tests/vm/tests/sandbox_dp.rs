//! Scenario 3: sandbox-dp advertises and allocates real vfio-pci devices and mdevs to the test
//! kubelet (`vm-kubelet`, built on testkit's fake kubelet) inside the guest.

use vm_tier::{Job, build_binaries, require_or_skip, run};

#[test]
fn sandbox_dp_serves_real_devices_to_the_test_kubelet() {
    let Some(p) = require_or_skip() else { return };
    build_binaries("sandbox-dp").unwrap_or_else(|e| panic!("VM tier: {e}"));
    build_binaries("vm-tier").unwrap_or_else(|e| panic!("VM tier: {e}"));
    let outcome = run(&p, &Job::scenario("sandbox-dp", "3-sandbox-dp.sh")).unwrap();
    outcome.assert_all_passed();
}
