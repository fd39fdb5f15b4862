//! The report: Markdown printed as it is made and collected for `--out`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};

use super::stats::Summary;

/// One reading of a daemon's memory.
struct Memory {
    daemon: &'static str,
    /// What was read ("peak of bind, bind again, unbind").
    what: &'static str,
    node: String,
    rss_kib: u64,
    anon_kib: u64,
}

/// The Markdown report.
#[derive(Default)]
pub struct Report {
    text: String,
    /// Each daemon's memory as the sections read it.
    memory: Vec<Memory>,
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

    /// Notes a daemon's memory for the closing table: `daemon`, `what` was read ("peak of
    /// bind, bind again, unbind"), on which `node`: its resident and its anonymous memory, KiB.
    pub fn memory(
        &mut self,
        daemon: &'static str,
        what: &'static str,
        node: &str,
        rss_kib: u64,
        anon_kib: u64,
    ) {
        self.memory.push(Memory {
            daemon,
            what,
            node: node.to_string(),
            rss_kib,
            anon_kib,
        });
    }

    /// The memory every section noted: one row per daemon and reading, its smallest and
    /// largest over the nodes.
    pub fn memory_table(&mut self) {
        let mut rows: Vec<Vec<Memory>> = Vec::new();
        for m in std::mem::take(&mut self.memory) {
            match rows
                .iter_mut()
                .find(|r| r[0].daemon == m.daemon && r[0].what == m.what)
            {
                Some(r) => r.push(m),
                None => rows.push(vec![m]),
            }
        }
        if rows.is_empty() {
            return;
        }
        self.line("## Memory");
        self.line("");
        self.line("Each daemon's resident memory (RSS) as the sections above read it, the largest over the runs, smallest and largest over the nodes measured; and how much of it is anonymous (heap and stacks: what only that process holds; the rest is pages of its binary and of the C library, which the kernel can drop and read again).");
        self.line("");
        self.table(&["daemon", "reading", "RSS", "anonymous"]);
        for r in rows {
            let range = |f: fn(&Memory) -> u64, named: bool| {
                let lo = r.iter().min_by_key(|m| f(m));
                let hi = r.iter().max_by_key(|m| f(m));
                match (lo, hi) {
                    (Some(lo), Some(hi)) if f(lo) == f(hi) || r.len() == 1 => {
                        if named {
                            format!("{} ({})", mib(f(hi)), hi.node)
                        } else {
                            mib(f(hi))
                        }
                    }
                    (Some(lo), Some(hi)) if named => format!(
                        "{} ({}) – {} ({})",
                        mib(f(lo)),
                        lo.node,
                        mib(f(hi)),
                        hi.node
                    ),
                    (Some(lo), Some(hi)) => format!("{} – {}", mib(f(lo)), mib(f(hi))),
                    _ => String::new(),
                }
            };
            let cells = [
                r[0].daemon.to_string(),
                r[0].what.to_string(),
                range(|m| m.rss_kib, true),
                range(|m| m.anon_kib, false),
            ];
            self.row(&cells);
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

/// The markers of the default sections' report.
pub const MAIN: &str = "gpu-vm-bench";

/// Replaces the generated part of BENCHMARKS.md between the markers named `markers`
/// (`<!-- gpu-vm-bench: begin -->` for [`MAIN`], `<!-- scheduler: begin -->` for the
/// scheduler section) or appends it with them.
pub fn write_out(path: &Path, markers: &str, body: &str) -> Result<()> {
    let begin = format!("<!-- {markers}: begin -->");
    let end = format!("<!-- {markers}: end -->");
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let new = match (old.find(&begin), old.find(&end)) {
        (Some(a), Some(z)) if a < z => format!("{}{begin}\n{body}{}", &old[..a], &old[z..]),
        _ => format!("{old}{begin}\n{body}{end}\n"),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_one_row_per_daemon_and_reading_with_its_extremes() {
        let mut r = Report::default();
        r.memory("vfio-manager", "peak", "2xA10", 2048, 512);
        r.memory("sandbox-dp", "idle", "2xA10", 4096, 1024);
        r.memory("vfio-manager", "peak", "16xA10", 3072, 1024);
        r.memory("vfio-manager", "peak", "8xA100", 1024, 256);
        r.memory_table();
        let rows: Vec<&str> = r.text().lines().filter(|l| l.starts_with("| ")).collect();
        assert_eq!(
            rows,
            [
                "| daemon | reading | RSS | anonymous |",
                "| vfio-manager | peak | 1.0 MiB (8xA100) – 3.0 MiB (16xA10) | 0.2 MiB – 1.0 MiB |",
                "| sandbox-dp | idle | 4.0 MiB (2xA10) | 1.0 MiB |",
            ]
        );
        let mut empty = Report::default();
        empty.memory_table();
        assert_eq!(empty.text(), "");
    }
}
