//! The report: Markdown printed as it is made and collected for `--out`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};

use super::stats::Summary;

/// The Markdown report.
#[derive(Default)]
pub struct Report {
    text: String,
    /// Each daemon's memory as the sections read it: daemon, when, KiB.
    memory: Vec<(&'static str, String, u64)>,
}

impl Report {
    /// Everything written so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Prints and keeps one line.
    pub fn line(&mut self, s: impl AsRef<str>) {
        println!("{}", s.as_ref());
        self.text.push_str(s.as_ref());
        self.text.push('\n');
    }

    /// A table's header and separator.
    pub fn table(&mut self, header: &[&str]) {
        self.line(format!("| {} |", header.join(" | ")));
        self.line(format!(
            "|{}|",
            header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
        ));
    }

    /// A table row.
    pub fn row(&mut self, cells: &[String]) {
        self.line(format!("| {} |", cells.join(" | ")));
    }

    /// Notes a daemon's memory for the closing table: `daemon`, `when` it was read (the node
    /// and the moment: "bind, 16xA10-gen"), resident KiB.
    pub fn memory(&mut self, daemon: &'static str, when: impl Into<String>, kib: u64) {
        self.memory.push((daemon, when.into(), kib));
    }

    /// The memory every section noted, one row per daemon and moment, in the order noted.
    pub fn memory_table(&mut self) {
        if self.memory.is_empty() {
            return;
        }
        let rows = std::mem::take(&mut self.memory);
        self.line("## Memory");
        self.line("");
        self.line("Each daemon's resident memory as the sections above read it: a one-shot command's peak (`VmHWM`, sampled every 2 ms until it exits), a long-running daemon's `VmRSS` (and peak where the row says so) at the moment named; the largest over the runs.");
        self.line("");
        self.table(&["daemon", "when", "RSS"]);
        for (daemon, when, kib) in rows {
            self.row(&[daemon.to_string(), when, mib(kib)]);
        }
        self.line("");
    }
}

/// `a / b` as `1.23×`.
pub fn ratio(a: Duration, b: Duration) -> String {
    if b.is_zero() {
        return "–".into();
    }
    format!("{:.2}×", a.as_secs_f64() / b.as_secs_f64())
}

/// KiB as `6.2 MiB`.
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// A summary that must exist.
pub fn need(s: Option<Summary>) -> Result<Summary> {
    s.ok_or_else(|| anyhow!("no samples"))
}

/// Replaces the generated part of BENCHMARKS.md (between the markers) or writes it whole.
pub fn write_out(path: &Path, body: &str) -> Result<()> {
    const BEGIN: &str = "<!-- gpu-vm-bench: begin -->";
    const END: &str = "<!-- gpu-vm-bench: end -->";
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let new = match (old.find(BEGIN), old.find(END)) {
        (Some(a), Some(z)) if a < z => format!("{}{BEGIN}\n{body}{}", &old[..a], &old[z..]),
        _ => format!("{old}{BEGIN}\n{body}{END}\n"),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}
