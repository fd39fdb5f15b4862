//! One module per section of the report.

pub mod curve;
pub mod dp;
pub mod dra;
pub mod ondemand;
pub mod plain;
pub mod plain_dp;
pub mod sim;
pub mod vfio;
pub mod vgpu;
