//! Shared test fakes.
pub mod sim;
