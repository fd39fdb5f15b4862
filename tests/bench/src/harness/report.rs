//! The report: Markdown printed as it is made and collected for `--out`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};

use super::stats::Summary;

/// The Markdown report.
#[derive(Default)]
pub struct Report {
    text: String,
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
