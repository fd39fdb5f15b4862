//! The daemons' own node state: the files they keep on the host, and the one way they are
//! written.
//!
//! [`FILES`] lists every one of them, where it lives, its format and who writes and reads it;
//! docs/architecture.md shows the same table ([`markdown_table`], kept equal by a test).
//!
//! Every file is replaced whole by [`write_atomic`]: a reader, or the next run after a crash,
//! sees the old content or the new, never part of either. The temporary file has a random
//! name, so a daemon that is PID 1 in its container after a crash never meets its own leftover.
//! A file written on the path a VM start waits on, whose subject a reboot undoes (the on-demand
//! vGPUs' record; sandbox-dra's claim records, device metadata and CDI specs, and the record of
//! original drivers its prepare keeps), is replaced the same way but not flushed to disk
//! ([`write_atomic_until_reboot`], [`Flush::No`]): a crash of the machine takes the vGPUs and
//! the bindings it describes with it, and kubelet prepares its claims again after the reboot.
//!
//! Every record carries its format's version: a `# gpu-vm-node <kind> v<N>` first line in the
//! line-oriented files ([`header`], [`text_version`]), a `version` field in the JSON ones
//! ([`json_version`]). A file without one is version 0, the format written before records
//! carried versions: it is read, and the next write migrates it. A file of a newer version, or
//! one that cannot be parsed, is an error naming the file ([`crate::Error::Newer`],
//! [`crate::Error::Parse`]); a daemon that can go on without it moves it aside
//! ([`set_aside`]), keeping it for an operator, and says so.

pub mod originals;
pub mod pool;
pub mod readiness;
pub mod vgpu_names;

mod files;

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};

pub use files::{FILES, StateFile, markdown_table};

/// Replaces `path` with `contents`, creating its directory when missing. The bytes go to a
/// hidden temporary file in the same directory, are flushed to disk, and the file is renamed
/// over `path`, so `path` holds the old content or the new at every moment, across a crash too.
/// On failure the temporary file is removed and `path` is left as it was.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    write_atomic_with(path, Flush::ToDisk, |f| f.write_all(contents))
}

/// [`write_atomic`] for a file whose subject a reboot undoes (vGPUs, drivers bound, claims
/// kubelet prepares again after a reboot): replaced the same way, whole or not at all for a
/// reader and across a crash of the process, but not flushed to disk ([`Flush::No`]).
pub fn write_atomic_until_reboot(path: &Path, contents: &[u8]) -> Result<()> {
    write_atomic_with(path, Flush::No, |f| f.write_all(contents))
}

/// [`write_atomic`] or [`write_atomic_until_reboot`] by `flush`, the file's permission bits
/// `mode` whatever the process's umask (a file another user must read: sandbox-dra's device
/// metadata, read by virt-launcher as `qemu`).
pub fn write_atomic_mode(path: &Path, contents: &[u8], mode: u32, flush: Flush) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    write_atomic_with(path, flush, |f| {
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(contents)
    })
}

/// Whether a replaced file is flushed to disk before the write returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flush {
    /// The file and the rename, so that the new content survives a power loss.
    ToDisk,
    /// Neither: the content survives a crash of the process, not of the machine. For a file
    /// whose subject a reboot undoes: the flush (an `fsync` of the file and one of its
    /// directory, milliseconds each on a busy disk, on the path a VM start waits on) would
    /// only keep the file across a crash of the machine, which takes its subject with it.
    No,
}

/// [`write_atomic`] with the content written by `fill`.
fn write_atomic_with(
    path: &Path,
    flush: Flush,
    fill: impl FnOnce(&mut File) -> io::Result<()>,
) -> Result<()> {
    let save = |source| Error::Save {
        path: path.to_path_buf(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(save)?;
    let tmp = temp_path(path);
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| {
            fill(&mut f)?;
            match flush {
                Flush::ToDisk => f.sync_all(),
                Flush::No => Ok(()),
            }
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        // Best effort: the temporary file may not even exist.
        let _ = std::fs::remove_file(&tmp);
        return Err(save(e));
    }
    if flush == Flush::No {
        return Ok(());
    }
    // The rename itself survives a power loss only once the directory is flushed.
    File::open(dir).and_then(|d| d.sync_all()).map_err(save)
}

/// `<dir>/.<name>.<random>.tmp`: hidden, and distinct per write and across restarts, so two
/// writers never share a temporary file and a daemon that is PID 1 in its container after a
/// crash does not meet the leftover of its previous life.
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tag = uuid::Uuid::new_v4().simple();
    path.with_file_name(format!(".{name}.{tag}.tmp"))
}

/// The first line of a line-oriented record of `kind` at `version`:
/// `# gpu-vm-node <kind> v<version>`. Readers of these files skip `#` lines.
pub fn header(kind: &str, version: u32) -> String {
    format!("# gpu-vm-node {kind} v{version}\n")
}

/// The version a line-oriented record declares in its first line, and the text after that
/// line: 0 and the whole text when it has no header (the format before records carried
/// versions). A header of another kind, or a version above `current`, is an error naming the
/// file.
pub fn text_version<'a>(
    path: &Path,
    kind: &str,
    current: u32,
    text: &'a str,
) -> Result<(u32, &'a str)> {
    let (first, rest) = text.split_once('\n').unwrap_or((text, ""));
    let Some(declared) = first.trim().strip_prefix("# gpu-vm-node ") else {
        return Ok((0, text));
    };
    let parsed = declared
        .rsplit_once(" v")
        .filter(|(k, _)| *k == kind)
        .and_then(|(_, v)| v.parse::<u32>().ok());
    let Some(version) = parsed else {
        return Err(Error::Parse {
            path: path.to_path_buf(),
            reason: format!("line 1: {first:?} is not a header of a {kind} record"),
        });
    };
    check_version(path, version, current)?;
    Ok((version, rest))
}

/// The `version` field of a JSON record (0 without one: the format before records carried
/// versions); an error naming the file when it is above `current` or not a number.
pub fn json_version(path: &Path, record: &serde_json::Value, current: u32) -> Result<u32> {
    let version = match record.get("version") {
        None => 0,
        Some(v) => v
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| Error::Parse {
                path: path.to_path_buf(),
                reason: format!("its version {v} is not a number"),
            })?,
    };
    check_version(path, version, current)?;
    Ok(version)
}

fn check_version(path: &Path, version: u32, current: u32) -> Result<()> {
    if version > current {
        return Err(Error::Newer {
            path: path.to_path_buf(),
            version,
            current,
        });
    }
    Ok(())
}

/// Moves a record that cannot be used out of the way, to `<name>.unreadable-<seconds since the
/// epoch>` beside it: the daemon goes on without it, and an operator can still look at it.
/// Returns where it went.
pub fn set_aside(path: &Path) -> Result<PathBuf> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let aside = path.with_file_name(format!("{name}.unreadable-{secs}"));
    std::fs::rename(path, &aside).map_err(|source| Error::Save {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(aside)
}

/// The file's text; `None` when it does not exist.
pub fn read_if_present(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Creates the directory and its parents when missing (a daemon's socket directory).
pub fn ensure_dir(path: &Path) -> Result<()> {
    std::fs::create_dir_all(path).map_err(|source| Error::Save {
        path: path.to_path_buf(),
        source,
    })
}

/// Removes the file; `Ok(false)` when there was none.
pub fn remove_if_present(path: &Path) -> Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(Error::Save {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Which file a path names now: device, inode and change time. A file replaced by another of
/// the same name (a socket removed and bound again) has another identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    dev: u64,
    ino: u64,
    ctime: (i64, i64),
}

/// The identity of the file at `path`; `None` when there is none (or it cannot be looked at).
pub fn file_identity(path: &Path) -> Option<FileIdentity> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path).ok().map(|m| FileIdentity {
        dev: m.dev(),
        ino: m.ino(),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn temporary_files_are_named_at_random_and_a_leftover_does_not_block_a_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        let (a, b) = (temp_path(&path), temp_path(&path));
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        let tag = name
            .strip_prefix(".state.")
            .and_then(|n| n.strip_suffix(".tmp"))
            .unwrap();
        assert!(
            tag.len() == 32 && tag.bytes().all(|c| c.is_ascii_hexdigit()),
            "{name}"
        );
        // What a daemon that was PID 1 in its container left when it crashed mid-write.
        std::fs::write(dir.path().join(".state.1.0.tmp"), "half").unwrap();
        write_atomic(&path, b"whole").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "whole");
    }

    #[test]
    fn versions_are_read_from_a_header_or_a_field_and_none_is_version_0() {
        let p = Path::new("/run/x/pool");
        let h = header("pool", 1);
        assert_eq!(h, "# gpu-vm-node pool v1\n");
        assert_eq!(
            text_version(p, "pool", 1, &(h + "a\n")).unwrap(),
            (1, "a\n")
        );
        assert_eq!(text_version(p, "pool", 1, "a\nb\n").unwrap(), (0, "a\nb\n"));
        assert_eq!(text_version(p, "pool", 1, "").unwrap(), (0, ""));
        let newer = text_version(p, "pool", 1, "# gpu-vm-node pool v3\n").unwrap_err();
        assert!(matches!(
            newer,
            Error::Newer {
                version: 3,
                current: 1,
                ..
            }
        ));
        assert_eq!(
            newer.to_string(),
            "/run/x/pool was written in format v3; this version reads up to v1"
        );
        let other = text_version(p, "pool", 1, "# gpu-vm-node other v1\n").unwrap_err();
        assert!(other.to_string().contains("/run/x/pool: line 1"), "{other}");

        let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
        assert_eq!(json_version(p, &json(r#"{"a": 1}"#), 1).unwrap(), 0);
        assert_eq!(json_version(p, &json(r#"{"version": 1}"#), 1).unwrap(), 1);
        assert!(json_version(p, &json(r#"{"version": 2}"#), 1).is_err());
        assert!(json_version(p, &json(r#"{"version": "1"}"#), 1).is_err());
    }

    #[test]
    fn a_record_set_aside_keeps_its_content_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("claim.json");
        std::fs::write(&path, "garbage").unwrap();
        let aside = set_aside(&path).unwrap();
        assert!(!path.exists());
        assert_eq!(std::fs::read_to_string(&aside).unwrap(), "garbage");
        let name = aside.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("claim.json.unreadable-"), "{name}");
        let e = set_aside(&path).unwrap_err();
        assert!(e.to_string().contains("claim.json"), "{e}");
    }

    #[test]
    fn ensure_dir_creates_parents_and_names_what_blocks_it() {
        let d = tempfile::tempdir().unwrap();
        let nested = d.path().join("var/lib/kubelet/device-plugins");
        ensure_dir(&nested).unwrap();
        assert!(nested.is_dir());
        ensure_dir(&nested).unwrap();
        let file = d.path().join("a-file");
        std::fs::write(&file, "").unwrap();
        let e = ensure_dir(&file.join("sub")).unwrap_err().to_string();
        assert!(e.contains("a-file/sub"), "{e}");
    }

    #[test]
    fn creates_the_directory_and_replaces_the_file_leaving_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/state");
        write_atomic(&path, b"one\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\n");
        write_atomic(&path, b"two\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two\n");
        assert_eq!(names(&dir.path().join("a/b")), ["state"]);
    }

    #[test]
    fn write_atomic_mode_sets_the_mode_whatever_the_file_had() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metadata.json");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        write_atomic_mode(&path, b"{}", 0o644, Flush::ToDisk).unwrap();
        assert_eq!(mode(&path), 0o644);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_atomic_mode(&path, b"{}", 0o644, Flush::No).unwrap();
        assert_eq!(mode(&path), 0o644);
        assert_eq!(names(dir.path()), ["metadata.json"]);
    }

    #[test]
    fn a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        write_atomic(&path, b"old content\n").unwrap();
        let err = write_atomic_with(&path, Flush::ToDisk, |f| {
            f.write_all(b"new con")?;
            Err(io::Error::other("interrupted"))
        })
        .unwrap_err();
        assert!(matches!(err, Error::Save { ref path, .. } if path.ends_with("state")));
        assert_eq!(err.to_string(), format!("cannot write {}", path.display()));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old content\n");
        assert_eq!(names(dir.path()), ["state"]);
    }

    #[test]
    fn a_reader_sees_the_old_file_or_the_new_never_part_of_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        // Large enough that a plain write would be seen half done.
        let a = vec![b'a'; 1 << 20];
        let b = vec![b'b'; 1 << 20];
        write_atomic(&path, &a).unwrap();
        let writer = {
            let (path, a, b) = (path.clone(), a.clone(), b.clone());
            std::thread::spawn(move || {
                for i in 0..50 {
                    let next = if i % 2 == 0 { &b } else { &a };
                    // Flushed to disk or not, the replacement is whole.
                    if i % 4 < 2 {
                        write_atomic(&path, next).unwrap();
                    } else {
                        write_atomic_until_reboot(&path, next).unwrap();
                    }
                }
            })
        };
        let mut reads = 0;
        while !writer.is_finished() || reads == 0 {
            let seen = std::fs::read(&path).unwrap();
            assert!(seen == a || seen == b, "saw {} bytes of a mix", seen.len());
            reads += 1;
        }
        writer.join().unwrap();
        assert_eq!(names(dir.path()), ["state"]);
    }

    #[test]
    fn a_file_replaced_under_the_same_name_has_another_identity() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plugin.sock");
        assert_eq!(file_identity(&path), None);
        std::fs::write(&path, "").unwrap();
        let first = file_identity(&path);
        assert!(first.is_some());
        assert_eq!(file_identity(&path), first);
        // Keep the old inode alive so the new file cannot reuse its number.
        let kept = dir.path().join("kept");
        std::fs::rename(&path, &kept).unwrap();
        std::fs::write(&path, "").unwrap();
        assert_ne!(file_identity(&path), first);
    }

    #[test]
    fn read_and_remove_treat_a_missing_file_as_absent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        assert_eq!(read_if_present(&path).unwrap(), None);
        assert!(!remove_if_present(&path).unwrap());
        write_atomic(&path, b"x").unwrap();
        assert!(remove_if_present(&path).unwrap());
        assert!(!path.exists());
        // A directory where the file should be is an error, naming it.
        std::fs::create_dir(&path).unwrap();
        let err = read_if_present(&path).unwrap_err();
        assert!(err.to_string().contains("state"), "{err}");
    }
}
