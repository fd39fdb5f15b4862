//! What a bind or unbind did, device by device, and how it is shown to an operator.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

pub use common::vfio::{DeviceResult, Outcome};

/// Which way devices were moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Onto a VFIO driver.
    Bind,
    /// Back to the default driver.
    Unbind,
}

/// The result of one bind or unbind run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Bind or unbind.
    pub action: Action,
    /// Every selected function, in address order.
    pub results: Vec<DeviceResult>,
    /// Wall time of the run.
    #[serde(serialize_with = "secs")]
    pub elapsed: Duration,
    /// What went wrong besides the functions themselves (the record of original drivers could
    /// not be read or written), one sentence each.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// `nvidia`, or `(no driver)`.
pub fn driver_label(d: Option<&str>) -> &str {
    d.unwrap_or("(no driver)")
}

impl Report {
    /// 0 when every selected function ended where it should, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        if self.results.iter().any(DeviceResult::is_failure) {
            1
        } else {
            0
        }
    }

    /// The functions that failed or were refused.
    pub fn failures(&self) -> impl Iterator<Item = &DeviceResult> {
        self.results.iter().filter(|r| r.is_failure())
    }

    /// One line per changed function: `0000:65:00.0 nvidia → vfio-pci (group 42)`.
    pub fn change_lines(&self) -> Vec<String> {
        self.results
            .iter()
            .filter_map(|r| match &r.outcome {
                Outcome::Changed { from, to } => Some(format!(
                    "{} {} → {}{}",
                    r.address,
                    driver_label(from.as_deref()),
                    driver_label(to.as_deref()),
                    group_suffix(r.group)
                )),
                _ => None,
            })
            .collect()
    }

    /// One line per failed or refused function, naming it.
    pub fn failure_lines(&self) -> Vec<String> {
        self.failures()
            .map(|r| match &r.outcome {
                Outcome::Failed { error } => format!("{} failed: {error}", r.address),
                Outcome::Refused { reason } => format!("{} refused: {reason}", r.address),
                _ => String::new(),
            })
            .collect()
    }

    /// `bind: 3 selected, 2 changed, 1 already bound, 0 failed in 0.31 s`.
    pub fn summary(&self) -> String {
        let changed = self
            .results
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Changed { .. }))
            .count();
        let unchanged = self
            .results
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Unchanged { .. }))
            .count();
        let failed = self.failures().count();
        let (verb, same) = match self.action {
            Action::Bind => ("bind", "already bound"),
            Action::Unbind => ("unbind", "not on a VFIO driver"),
        };
        let mut s = format!(
            "{verb}: {} selected, {changed} changed, {unchanged} {same}, {failed} failed",
            self.results.len()
        );
        let _ = write!(s, " in {:.2} s", self.elapsed.as_secs_f64());
        s
    }
}

fn group_suffix(group: Option<u32>) -> String {
    match group {
        Some(g) => format!(" (group {g})"),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(addr: &str, group: Option<u32>, outcome: Outcome) -> DeviceResult {
        DeviceResult {
            address: addr.parse().unwrap(),
            group,
            outcome,
        }
    }

    #[test]
    fn lines_and_summary_read_as_documented() {
        let rep = Report {
            action: Action::Bind,
            results: vec![
                r(
                    "0000:65:00.0",
                    Some(42),
                    Outcome::Changed {
                        from: Some("nvidia".into()),
                        to: Some("vfio-pci".into()),
                    },
                ),
                r(
                    "0000:65:00.1",
                    Some(42),
                    Outcome::Changed {
                        from: None,
                        to: Some("vfio-pci".into()),
                    },
                ),
                r(
                    "0000:81:00.0",
                    Some(43),
                    Outcome::Unchanged {
                        driver: Some("vfio-pci".into()),
                    },
                ),
                r(
                    "0000:c1:00.0",
                    Some(44),
                    Outcome::Failed {
                        error: "writing \"0000:c1:00.0\" to /sys/bus/pci/drivers/nvidia/unbind failed: Device or resource busy".into(),
                    },
                ),
            ],
            elapsed: Duration::from_millis(1234),
            warnings: Vec::new(),
        };
        assert_eq!(
            rep.change_lines(),
            [
                "0000:65:00.0 nvidia → vfio-pci (group 42)",
                "0000:65:00.1 (no driver) → vfio-pci (group 42)"
            ]
        );
        assert_eq!(
            rep.summary(),
            "bind: 4 selected, 2 changed, 1 already bound, 1 failed in 1.23 s"
        );
        assert_eq!(rep.failure_lines().len(), 1);
        assert!(rep.failure_lines()[0].starts_with("0000:c1:00.0 failed: "));
        assert_eq!(rep.exit_code(), 1);
        let json = serde_json::to_value(&rep).unwrap();
        assert_eq!(json["results"][0]["result"], "changed");
        assert_eq!(json["results"][0]["address"], "0000:65:00.0");
        assert_eq!(json["results"][3]["result"], "failed");
    }

    #[test]
    fn a_clean_run_exits_zero_and_refusals_do_not() {
        let mut rep = Report {
            action: Action::Unbind,
            results: vec![r(
                "0000:65:00.0",
                Some(42),
                Outcome::Unchanged { driver: None },
            )],
            elapsed: Duration::ZERO,
            warnings: Vec::new(),
        };
        assert_eq!(rep.exit_code(), 0);
        assert_eq!(
            rep.summary(),
            "unbind: 1 selected, 0 changed, 1 not on a VFIO driver, 0 failed in 0.00 s"
        );
        rep.results.push(r(
            "0000:66:00.0",
            Some(43),
            Outcome::Refused {
                reason: "in use".into(),
            },
        ));
        assert_eq!(rep.exit_code(), 1);
        assert_eq!(rep.failure_lines(), ["0000:66:00.0 refused: in use"]);
    }
}
