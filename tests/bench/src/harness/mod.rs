//! What every section shares: the binaries, the simulated nodes, running and sampling
//! processes, the floor, summaries and the report.

pub mod bins;
pub mod floor;
pub mod process;
pub mod procstat;
pub mod report;
pub mod stats;
pub mod topology;
