//! The floor: a daemon's successful sysfs writes replayed in order by a bare loop.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use node_sim::Op;
/// Replays the successful writes of an op log on another node, sequentially: the floor.
pub fn replay(root: &Path, ops: &[Op]) -> Result<Duration> {
    let start = Instant::now();
    for op in ops.iter().filter(|o| o.is_ok()) {
        let value = if op.value.is_empty() {
            "\n"
        } else {
            op.value.as_str()
        };
        let p = root.join(&op.path);
        let mut f = OpenOptions::new()
            .write(true)
            .open(&p)
            .with_context(|| format!("replay: opening {}", p.display()))?;
        f.write_all(value.as_bytes())
            .with_context(|| format!("replay: writing {value:?} to {}", p.display()))?;
    }
    Ok(start.elapsed())
}

/// The successful writes of an op log.
pub fn writes(ops: &[Op]) -> Vec<Op> {
    ops.iter().filter(|o| o.is_ok()).cloned().collect()
}
