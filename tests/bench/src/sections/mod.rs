//! One module per section of the report.

pub mod curve;
pub mod dp;
pub mod vfio;
pub mod vgpu;
