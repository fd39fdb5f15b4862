//! How long each step of one prepare took, logged with the claim once it is prepared, so that
//! an operator sees where a slow VM start waited: the API server, another claim's prepare, the
//! kernel's writes, the vGPU's group node, or the driver's own files.

use std::fmt;
use std::time::{Duration, Instant};

/// A step of a prepare, as the log names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// The claim's record read, and saved before and after the writes (the crash contract).
    Record,
    /// The claim read from the API server.
    Api,
    /// Waiting for another claim's prepare or unprepare, and for a worker thread.
    Queue,
    /// The node read and checked: the devices, their groups, what is in place.
    Node,
    /// Who holds the devices that are to move: processes, pods, other claims (whole GPUs).
    InUse,
    /// The sysfs writes that make the devices: binds, VFs, vGPUs and mdevs made.
    Write,
    /// Waiting for a new vGPU's or mdev's /dev/vfio group node.
    Ready,
    /// The device metadata and the CDI spec.
    Files,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Step::Record => "record",
            Step::Api => "api",
            Step::Queue => "queue",
            Step::Node => "node",
            Step::InUse => "in-use",
            Step::Write => "write",
            Step::Ready => "ready",
            Step::Files => "files",
        }
    }
}

/// The time of each step of one prepare so far: each [`Steps::mark`] counts the time since the
/// last one to its step. Shown as `record 0.21ms, node 0.40ms, …` in the order the steps first
/// came, in milliseconds.
#[derive(Debug)]
pub(crate) struct Steps {
    start: Instant,
    last: Instant,
    took: Vec<(Step, Duration)>,
}

impl Steps {
    /// Counting from now.
    pub(crate) fn start() -> Steps {
        let now = Instant::now();
        Steps {
            start: now,
            last: now,
            took: Vec::new(),
        }
    }

    /// Counts the time since the last mark (or the start) to `step`.
    pub(crate) fn mark(&mut self, step: Step) {
        let now = Instant::now();
        let d = now - self.last;
        self.last = now;
        match self.took.iter_mut().find(|(s, _)| *s == step) {
            Some((_, t)) => *t += d,
            None => self.took.push((step, d)),
        }
    }

    /// From the start to the last mark.
    pub(crate) fn total(&self) -> Duration {
        self.last - self.start
    }
}

impl fmt::Display for Steps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (step, d)) in self.took.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{} {:.2}ms", step.name(), d.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_marked_twice_is_counted_once_in_the_order_it_first_came() {
        let mut s = Steps::start();
        s.mark(Step::Record);
        std::thread::sleep(Duration::from_millis(2));
        s.mark(Step::Write);
        s.mark(Step::Record);
        let shown = s.to_string();
        let names: Vec<&str> = shown
            .split(", ")
            .filter_map(|p| p.split(' ').next())
            .collect();
        assert_eq!(names, ["record", "write"], "{shown}");
        let write: f64 = shown
            .split(", ")
            .find_map(|p| p.strip_prefix("write "))
            .and_then(|v| v.strip_suffix("ms"))
            .and_then(|v| v.parse().ok())
            .unwrap_or_default();
        assert!(write >= 2.0, "the write's 2 ms sleep is counted: {shown}");
        assert!(s.total() >= Duration::from_millis(2));
    }
}
