//! The op log: every write to a simulated kernel file, in completion order
//! (`sys/kernel/node-sim/ops`, `Sim::ops`).

use crate::errno::{Errno, errno_name};

/// One line of the op log: a write to a simulated kernel file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    /// Sequence number, from 1, in completion order.
    pub seq: u64,
    /// The file, relative to the sim's root (`sys/bus/pci/drivers/nvidia/unbind`).
    pub path: String,
    /// The value written, one trailing newline removed.
    pub value: String,
    /// `ok`, or the errno's name (`EBUSY`).
    pub result: String,
}

impl Op {
    /// Whether the write succeeded.
    pub fn is_ok(&self) -> bool {
        self.result == "ok"
    }

    /// The log line: `<seq> <path> <value> <result>`; an empty value or one with whitespace
    /// is written quoted.
    pub fn line(&self) -> String {
        let v = if self.value.is_empty()
            || self
                .value
                .chars()
                .any(|c| c.is_whitespace() || c == '"' || c.is_control())
        {
            format!("{:?}", self.value)
        } else {
            self.value.clone()
        };
        format!("{} {} {} {}", self.seq, self.path, v, self.result)
    }
}

/// The log.
#[derive(Debug, Default)]
pub(crate) struct OpLog {
    ops: Vec<Op>,
    seq: u64,
}

impl OpLog {
    /// Records a write and its result.
    pub fn log(&mut self, path: &str, value: &str, result: Result<(), Errno>) {
        self.seq += 1;
        self.ops.push(Op {
            seq: self.seq,
            path: path.to_string(),
            value: value.strip_suffix('\n').unwrap_or(value).to_string(),
            result: match result {
                Ok(()) => "ok".into(),
                Err(e) => errno_name(e),
            },
        });
    }

    /// Every write so far.
    pub fn all(&self) -> &[Op] {
        &self.ops
    }

    /// Empties the log (sequence numbers go on).
    pub fn clear(&mut self) {
        self.ops.clear();
    }

    /// The log as `sys/kernel/node-sim/ops` shows it: one line per write.
    pub fn text(&self) -> String {
        let mut s = String::new();
        for op in &self.ops {
            s.push_str(&op.line());
            s.push('\n');
        }
        s
    }
}
