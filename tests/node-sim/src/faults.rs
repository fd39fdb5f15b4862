//! Fault injection (`fault <op> <target> <ERRNO|delay=MS|after=MS> [count=N]`): writes that fail
//! with an errno, take effect only after a delay, or take effect at once but return only after a
//! delay (the kernel has done the write; the writer has not yet heard: a crash test's window
//! between a write and what the writer records after it).

use std::time::Duration;

use crate::errno::{Errno, errno_from_name};
use crate::tree::WriteTarget;

#[derive(Clone, Debug)]
enum FaultAction {
    Errno(Errno),
    Delay(Duration),
    After(Duration),
}

#[derive(Clone, Debug)]
struct Fault {
    op: String,
    target: String,
    action: FaultAction,
    remaining: Option<u32>,
}

/// The ops a fault may name.
const FAULT_OPS: &[&str] = &[
    "bind",
    "unbind",
    "probe",
    "driver_override",
    "create",
    "remove",
    "sriov_numvfs",
    "current_vgpu_type",
];

/// What the faults matching one write do to it.
#[derive(Debug, Default)]
pub(crate) struct Taken {
    /// Waited before the write takes effect.
    pub delay: Duration,
    /// The write fails with it (and has no effect).
    pub errno: Option<Errno>,
    /// Waited after the write took effect, before the writer is answered.
    pub after: Duration,
}

/// The faults in force.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    list: Vec<Fault>,
}

impl Faults {
    /// Adds a fault: `args` are the positional words after `fault` (`op target [ERRNO]`),
    /// `delay`, `after` and `count` the options. The error says what is wrong.
    pub fn add(
        &mut self,
        args: &[&str],
        delay: Option<&str>,
        after: Option<&str>,
        count: Option<&str>,
    ) -> Result<(), String> {
        let [op, target, rest @ ..] = args else {
            return Err(
                "usage: fault <op> <BDF|uuid|*> <ERRNO|delay=MS|after=MS> [count=N]".into(),
            );
        };
        if !FAULT_OPS.contains(op) {
            return Err(format!("unknown op; one of {}", FAULT_OPS.join(", ")));
        }
        let ms = |v: &str, what: &str| {
            v.parse()
                .map(Duration::from_millis)
                .map_err(|_| format!("{what} is not a number of ms"))
        };
        let action = match (rest, delay, after) {
            ([e], None, None) => {
                FaultAction::Errno(errno_from_name(e).ok_or_else(|| format!("unknown errno {e}"))?)
            }
            ([], Some(d), None) => FaultAction::Delay(ms(d, "delay")?),
            ([], None, Some(a)) => FaultAction::After(ms(a, "after")?),
            _ => return Err("give one errno name, delay=MS or after=MS".into()),
        };
        let remaining = count
            .map(|c| c.parse::<u32>().map_err(|_| "count is not a number"))
            .transpose()?;
        let target = if *target == "*" {
            "*".to_string()
        } else {
            target.to_ascii_lowercase()
        };
        self.list.push(Fault {
            op: op.to_string(),
            target,
            action,
            remaining,
        });
        Ok(())
    }

    /// `clear-faults`.
    pub fn clear(&mut self) {
        self.list.clear();
    }

    /// Consumes the faults matching a write: the delay to wait before it, the errno to fail
    /// with, and the delay to wait after it before answering.
    pub fn take(&mut self, op: &str, keys: &[String]) -> Taken {
        let mut delay = Duration::ZERO;
        let mut after = Duration::ZERO;
        let mut errno = None;
        for f in &mut self.list {
            if f.op != op || !(f.target == "*" || keys.contains(&f.target)) {
                continue;
            }
            if f.remaining == Some(0) {
                continue;
            }
            if let Some(n) = &mut f.remaining {
                *n -= 1;
            }
            match f.action {
                FaultAction::Delay(d) => delay += d,
                FaultAction::After(d) => after += d,
                FaultAction::Errno(e) => {
                    errno.get_or_insert(e);
                }
            }
        }
        self.list.retain(|f| f.remaining != Some(0));
        Taken {
            delay,
            errno,
            after,
        }
    }

    /// The fault op name and the keys a fault target may name, for a write.
    pub fn keys(target: &WriteTarget, value: &str) -> Option<(&'static str, Vec<String>)> {
        let v = value.trim().to_ascii_lowercase();
        Some(match target {
            WriteTarget::DriverOverride(a) => ("driver_override", vec![a.clone()]),
            WriteTarget::Bind(_) => ("bind", vec![v]),
            WriteTarget::Unbind(_) => ("unbind", vec![v]),
            WriteTarget::Probe => ("probe", vec![v]),
            WriteTarget::SriovNumvfs(a) => ("sriov_numvfs", vec![a.clone()]),
            WriteTarget::Create { parent, .. } => ("create", vec![parent.clone(), v]),
            WriteTarget::Remove(u) => ("remove", vec![u.clone()]),
            WriteTarget::CurrentVgpu(a) => ("current_vgpu_type", vec![a.clone()]),
            WriteTarget::Control | WriteTarget::Ignore => return None,
        })
    }
}
