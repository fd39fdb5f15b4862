//! The VM tier proves itself: the guest boots, sees the emulated devices and the sample mdev
//! parents, and its checks come back to this test.

use vm_tier::{Job, require_or_skip, run};

#[test]
fn guest_boots_and_reports_checks() {
    let Some(p) = require_or_skip() else { return };
    let job = Job::scenario("boot", "0-boot.sh");
    let outcome = run(&p, &job).unwrap();
    outcome.assert_all_passed();
}
