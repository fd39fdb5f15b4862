//! The driver each function was on before `bind` moved it, so `unbind` can give it back to
//! that driver (`nouveau`, or none at all) rather than to whichever driver probes first.
//!
//! Kept in `<host-root>/run/vfio-manager/original-drivers`: the header
//! `# gpu-vm-node original-drivers v1`, then one `BDF DRIVER` line per function (`-` for no
//! driver); a file without the header (the format before it) reads the same. It is written
//! before the bind that moves a function (the intent), so a crash between the two loses
//! nothing; a function whose bind did not happen is forgotten again once it is back on that
//! driver. `/run` is emptied at boot, as are the bindings it describes.
//!
//! A line that cannot be read is skipped, and a file that cannot be read at all (a newer
//! format, not text) is set aside ([`super::set_aside`]): each is a sentence in
//! [`Loaded::problems`] for the caller to report; unbind then gives those functions to their
//! default driver.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::{HostPaths, PciAddress, Result, error_chain, state};

/// The format version the file is written in.
pub const VERSION: u32 = 1;

/// The record kind, as its header names it.
const KIND: &str = "original-drivers";

/// The file's path.
pub fn path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/vfio-manager/original-drivers")
}

/// Function → the driver it had before bind (`None`: no driver).
pub type Originals = BTreeMap<PciAddress, Option<String>>;

/// What the file says, and what of it could not be read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    /// The drivers it names.
    pub drivers: Originals,
    /// One sentence, naming the file, for each part that could not be read.
    pub problems: Vec<String>,
}

/// Reads the file; empty when absent. Each problem is logged as well as returned.
pub fn load(paths: &HostPaths) -> Loaded {
    let p = path(paths);
    let loaded = match state::read_if_present(&p) {
        Ok(Some(text)) => parse(&text, &p),
        Ok(None) => Loaded::default(),
        Err(e) => unreadable(&p, &e),
    };
    for problem in &loaded.problems {
        tracing::warn!("{problem}");
    }
    loaded
}

/// A file that cannot be read at all: set aside, so that the next write starts afresh
/// without losing it.
fn unreadable(p: &Path, e: &crate::Error) -> Loaded {
    let what = match state::set_aside(p) {
        Ok(aside) => format!("set aside as {}", aside.display()),
        Err(e2) => format!("and cannot be set aside: {}", error_chain(&e2)),
    };
    Loaded {
        drivers: Originals::new(),
        problems: vec![format!(
            "the record of original drivers cannot be read ({}), {what}; unbind gives those \
             functions to their default driver",
            error_chain(e)
        )],
    }
}

fn parse(text: &str, p: &Path) -> Loaded {
    let body = match state::text_version(p, KIND, VERSION, text) {
        Ok((_, body)) => body,
        Err(e) => return unreadable(p, &e),
    };
    let mut out = Loaded::default();
    for line in body.lines().filter(|l| !l.trim().is_empty()) {
        if line.starts_with('#') {
            continue;
        }
        let mut w = line.split_whitespace();
        match (w.next().map(str::parse::<PciAddress>), w.next(), w.next()) {
            (Some(Ok(a)), Some(d), None) => {
                out.drivers.insert(a, (d != "-").then(|| d.to_string()));
            }
            _ => out.problems.push(format!(
                "{}: skipping {line:?}, which is not `BDF DRIVER`; unbind gives that function \
                 to its default driver",
                p.display()
            )),
        }
    }
    out
}

fn render(o: &Originals) -> String {
    let lines: String = o
        .iter()
        .map(|(a, d)| format!("{a} {}\n", d.as_deref().unwrap_or("-")))
        .collect();
    state::header(KIND, VERSION) + &lines
}

/// Applies `add` and `remove` to the file (read, change, write atomically); the first record
/// of a function wins, so a rerun never records `vfio-pci` over the driver it had. Returns the
/// problems met reading it (see [`load`]); an error when it cannot be written.
pub fn update(
    paths: &HostPaths,
    add: &[(PciAddress, Option<String>)],
    remove: &[PciAddress],
) -> Result<Vec<String>> {
    if add.is_empty() && remove.is_empty() {
        return Ok(Vec::new());
    }
    let Loaded {
        drivers: mut o,
        problems,
    } = load(paths);
    let before = o.clone();
    for (a, d) in add {
        o.entry(*a).or_insert_with(|| d.clone());
    }
    for a in remove {
        o.remove(a);
    }
    if o != before || !problems.is_empty() {
        // Bindings do not outlive a boot: not flushed to disk (a VM start waits on it).
        state::write_atomic_until_reboot(&path(paths), render(&o).as_bytes())?;
    }
    Ok(problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn records_survive_a_round_trip_and_the_first_record_wins() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        let (x, y) = (a("0000:1b:00.0"), a("0000:1d:00.0"));
        update(&p, &[(x, Some("nouveau".into())), (y, None)], &[]).unwrap();
        update(&p, &[(x, Some("vfio-pci".into()))], &[]).unwrap();
        let o = load(&p);
        assert!(o.problems.is_empty(), "{o:?}");
        assert_eq!(o.drivers.get(&x), Some(&Some("nouveau".to_string())));
        assert_eq!(o.drivers.get(&y), Some(&None));
        assert_eq!(
            state::read_if_present(&path(&p)).unwrap().unwrap(),
            "# gpu-vm-node original-drivers v1\n0000:1b:00.0 nouveau\n0000:1d:00.0 -\n"
        );
        update(&p, &[], &[x]).unwrap();
        assert_eq!(load(&p).drivers.len(), 1);
    }

    #[test]
    fn the_format_before_the_header_is_read_and_migrated_by_the_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        std::fs::create_dir_all(path(&p).parent().unwrap()).unwrap();
        std::fs::write(path(&p), "0000:1b:00.0 nouveau\n").unwrap();
        let o = load(&p);
        assert_eq!(o.problems, Vec::<String>::new());
        assert_eq!(o.drivers[&a("0000:1b:00.0")], Some("nouveau".into()));
        update(&p, &[(a("0000:1d:00.0"), None)], &[]).unwrap();
        assert_eq!(
            std::fs::read_to_string(path(&p)).unwrap(),
            "# gpu-vm-node original-drivers v1\n0000:1b:00.0 nouveau\n0000:1d:00.0 -\n"
        );
    }

    #[test]
    fn garbage_lines_are_skipped_and_named() {
        let o = parse(
            "0000:1b:00.0 nouveau\nnonsense\n0000:1c:00.0 a b\n",
            Path::new("x"),
        );
        assert_eq!(o.drivers.len(), 1);
        assert_eq!(o.problems.len(), 2);
        assert!(o.problems[0].contains("x: skipping \"nonsense\""), "{o:?}");
    }

    #[test]
    fn a_file_of_a_newer_format_is_set_aside_and_said_so_and_the_next_write_starts_afresh() {
        let dir = tempfile::tempdir().unwrap();
        let p = HostPaths::new(dir.path());
        let file = path(&p);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, "# gpu-vm-node original-drivers v7\n{\"x\": 1}\n").unwrap();
        let o = load(&p);
        assert!(o.drivers.is_empty());
        assert_eq!(o.problems.len(), 1);
        assert!(
            o.problems[0].contains("v7") && o.problems[0].contains("set aside as"),
            "{o:?}"
        );
        assert!(!file.exists());
        let kept: Vec<_> = std::fs::read_dir(file.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            kept.iter()
                .any(|n| n.starts_with("original-drivers.unreadable-")),
            "{kept:?}"
        );
        let problems = update(&p, &[(a("0000:1b:00.0"), None)], &[]).unwrap();
        assert!(problems.is_empty(), "set aside already: {problems:?}");
        assert_eq!(load(&p).drivers.len(), 1);
    }
}
