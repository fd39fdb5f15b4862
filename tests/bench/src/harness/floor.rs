//! The floor: a daemon's writes replayed in order by a bare loop: its successful sysfs writes,
//! and the files it replaced (sandbox-dra's claim record, device metadata and CDI spec), each
//! written as the daemons replace their files.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};
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

/// The regular files under `dirs` (relative to `root`), by path relative to `root`, with
/// their contents.
pub type Files = BTreeMap<PathBuf, Vec<u8>>;

/// Reads the regular files under each of `dirs` (relative to `root`; one that is missing has
/// none).
pub fn files(root: &Path, dirs: &[&str]) -> Files {
    fn walk(root: &Path, dir: &Path, out: &mut Files) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(root, &p, out),
                Ok(t) if t.is_file() => {
                    if let (Ok(rel), Ok(bytes)) = (p.strip_prefix(root), std::fs::read(&p)) {
                        out.insert(rel.to_path_buf(), bytes);
                    }
                }
                _ => {}
            }
        }
    }
    let mut out = Files::new();
    for d in dirs {
        walk(root, &root.join(d), &mut out);
    }
    out
}

/// The files `after` has that `before` had not, or had with other contents.
pub fn changed(before: &Files, after: &Files) -> Files {
    after
        .iter()
        .filter(|(p, b)| before.get(*p) != Some(*b))
        .map(|(p, b)| (p.clone(), b.clone()))
        .collect()
}

/// Writes `files` under `root` as the daemons replace theirs (a temporary file renamed over
/// the file, its directory made when missing; not flushed to disk, as the daemons do not flush
/// these), in order; how long it took.
pub fn replace_files<'a>(
    root: &Path,
    files: impl IntoIterator<Item = (&'a PathBuf, &'a Vec<u8>)>,
) -> Result<Duration> {
    let start = Instant::now();
    for (rel, bytes) in files {
        common::state::write_atomic_until_reboot(&root.join(rel), bytes)
            .with_context(|| format!("replay: writing {}", rel.display()))?;
    }
    Ok(start.elapsed())
}
