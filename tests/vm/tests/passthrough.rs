//! Scenario 1: passthrough on a real kernel. The emulated VGA device (1234:1111, class 0x0300)
//! moves from bochs-drm to vfio-pci and back, first by plain sysfs writes, then by vfio-manager.

use vm_tier::{Job, require_or_skip, run};

#[test]
fn rebind_by_plain_sysfs_writes() {
    let Some(p) = require_or_skip() else { return };
    let outcome = run(
        &p,
        &Job::scenario("passthrough-shell", "1-passthrough-shell.sh"),
    )
    .unwrap();
    outcome.assert_all_passed();
}

#[test]
fn vfio_manager_binds_and_unbinds() {
    let Some(p) = require_or_skip() else { return };
    if let Err(e) = vm_tier::build_binaries("vfio-manager") {
        panic!("VM tier: {e}");
    }
    let outcome = run(&p, &Job::scenario("passthrough", "1-passthrough.sh")).unwrap();
    outcome.assert_all_passed();
}
