//! Scenario 2: vgpu-device-manager drives real mdevs (the kernel's mtty and mbochs samples).

use vm_tier::{Job, build_binaries, require_or_skip, run};

#[test]
fn vgpu_device_manager_applies_profiles_to_real_mdevs() {
    let Some(p) = require_or_skip() else { return };
    build_binaries("vgpu-device-manager").unwrap_or_else(|e| panic!("VM tier: {e}"));
    let outcome = run(&p, &Job::scenario("vgpu", "2-vgpu.sh")).unwrap();
    outcome.assert_all_passed();
}
