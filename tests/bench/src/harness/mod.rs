//! What every section shares: the binaries, the nodes (simulated, and their plain copies),
//! running and sampling processes, the floor and the limit and what is added to it, summaries and the report.

pub mod baseline;
pub mod bins;
pub mod floor;
pub mod limit;
pub mod process;
pub mod procstat;
pub mod report;
pub mod stats;
pub mod strace;
pub mod topology;
pub mod tree;
pub mod uevent;
