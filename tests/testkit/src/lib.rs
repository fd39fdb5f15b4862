//! Shared test fakes.
pub mod kubelet;
pub mod sim;
