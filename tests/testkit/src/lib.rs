//! Shared test fakes.
/// The fake kubelet (its own crate, so that node-sim's demo can use it too).
pub use fake_kubelet as kubelet;
pub mod allocator;
pub mod apiserver;
/// The raw HTTP/2 gRPC client (in the fake kubelet, which dials with it as kubelet does).
pub use fake_kubelet::h2raw;
pub mod sim;
pub mod sysfs;
pub mod tree;
pub mod uevent;
