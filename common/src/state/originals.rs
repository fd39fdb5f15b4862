//! The driver each function was on before `bind` moved it, so `unbind` can give it back to
//! that driver (`nouveau`, or none at all) rather than to whichever driver probes first.
//!
//! Kept in `<host-root>/run/vfio-manager/original-drivers`, one `BDF DRIVER` line per function
//! (`-` for no driver). `/run` is emptied at boot, as are the bindings it describes.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::{HostPaths, PciAddress, error_chain, state};

/// The file's path.
pub fn path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/vfio-manager/original-drivers")
}

/// Function → the driver it had before bind (`None`: no driver).
pub type Originals = BTreeMap<PciAddress, Option<String>>;

/// Reads the file; empty when absent. Unparsable lines are skipped with a warning.
pub fn load(paths: &HostPaths) -> Originals {
    let p = path(paths);
    match state::read_if_present(&p) {
        Ok(Some(text)) => parse(&text, &p),
        Ok(None) => Originals::new(),
        Err(e) => {
            tracing::warn!(error = %error_chain(&e), "cannot read original drivers");
            Originals::new()
        }
    }
}

fn parse(text: &str, p: &std::path::Path) -> Originals {
    let mut out = Originals::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut w = line.split_whitespace();
        match (w.next().map(str::parse::<PciAddress>), w.next(), w.next()) {
            (Some(Ok(a)), Some(d), None) => {
                out.insert(a, (d != "-").then(|| d.to_string()));
            }
            _ => {
                tracing::warn!(path = %p.display(), line, "skipping a line that is not `BDF DRIVER`")
            }
        }
    }
    out
}

fn render(o: &Originals) -> String {
    o.iter()
        .map(|(a, d)| format!("{a} {}\n", d.as_deref().unwrap_or("-")))
        .collect()
}

/// Applies `add` and `remove` to the file (read, change, write atomically).
pub fn update(paths: &HostPaths, add: &[(PciAddress, Option<String>)], remove: &[PciAddress]) {
    if add.is_empty() && remove.is_empty() {
        return;
    }
    let mut o = load(paths);
    for (a, d) in add {
        // The first record wins: a rerun must not overwrite it with `vfio-pci`.
        o.entry(*a).or_insert_with(|| d.clone());
    }
    for a in remove {
        o.remove(a);
    }
    if let Err(e) = state::write_atomic(&path(paths), render(&o).as_bytes()) {
        tracing::warn!(error = %error_chain(&e), "cannot record original drivers; unbind will use the default driver");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_a_round_trip_and_the_first_record_wins() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        let a: PciAddress = "0000:1b:00.0".parse().unwrap();
        let b: PciAddress = "0000:1d:00.0".parse().unwrap();
        update(&p, &[(a, Some("nouveau".into())), (b, None)], &[]);
        update(&p, &[(a, Some("vfio-pci".into()))], &[]);
        let o = load(&p);
        assert_eq!(o.get(&a), Some(&Some("nouveau".to_string())));
        assert_eq!(o.get(&b), Some(&None));
        assert_eq!(
            state::read_if_present(&path(&p)).unwrap().unwrap(),
            "0000:1b:00.0 nouveau\n0000:1d:00.0 -\n"
        );
        update(&p, &[], &[a]);
        assert_eq!(load(&p).len(), 1);
    }

    #[test]
    fn garbage_lines_are_skipped() {
        let o = parse(
            "0000:1b:00.0 nouveau\nnonsense\n0000:1c:00.0 a b\n",
            std::path::Path::new("x"),
        );
        assert_eq!(o.len(), 1);
    }
}
