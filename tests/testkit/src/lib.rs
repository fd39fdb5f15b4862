//! Shared test fakes.
/// The fake kubelet (its own crate, so that node-sim's demo can use it too).
pub use fake_kubelet as kubelet;
/// The fake API server (in the fake kubelet's crate, so that node-sim's demo can use it too).
pub use fake_kubelet::apiserver;
/// The raw HTTP/2 gRPC client (in the fake kubelet, which dials with it as kubelet does).
pub use fake_kubelet::h2raw;
pub mod ops;
pub mod sim;
pub mod sysfs;
pub mod tree;
pub mod uevent;

/// Sends SIGTERM to `child` and waits for it: its exit code (`None`: killed by a signal).
pub fn sigterm_and_wait(child: &mut std::process::Child) -> Option<i32> {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    child.wait().ok()?.code()
}

/// A daemon under test, killed (SIGKILL) and reaped when dropped: a test that fails halfway
/// leaves no daemon behind. [`sigterm_and_wait`] on `.0` ends it as systemd would.
#[derive(Debug)]
pub struct Reaped(pub std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
