//! Uevents reach a listener in a network namespace of its own (`unshare -n`), on a real kernel:
//! pods that listen for them need no `hostNetwork`.

use vm_tier::{Job, require_or_skip, run};

#[test]
fn a_listener_in_its_own_network_namespace_hears_a_bind() {
    let Some(p) = require_or_skip() else { return };
    let job = Job::scenario("netns-uevents", "6-netns-uevents.sh");
    let outcome = run(&p, &job).unwrap();
    outcome.assert_all_passed();
}
