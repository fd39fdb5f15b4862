//! Shared test fakes.
/// The fake kubelet (its own crate, so that node-sim's demo can use it too).
pub use fake_kubelet as kubelet;
pub mod apiserver;
pub mod h2raw;
pub mod sim;
pub mod sysfs;
pub mod tree;
pub mod uevent;
