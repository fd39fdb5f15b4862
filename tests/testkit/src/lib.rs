//! Shared test fakes.
pub mod kubelet;
pub mod apiserver;
pub mod sim;
