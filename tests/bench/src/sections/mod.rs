//! One module per section of the report, each `bench(cli, bins, report)` (see `section` in
//! main.rs for adding one).

pub mod apiload;
pub mod dp;
pub mod dra;
pub mod ondemand;
pub mod scheduler;
pub mod vfio;
pub mod vgpu;
