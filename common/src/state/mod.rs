//! The daemons' own node state: the files they keep on the host, and the one way they are
//! written.
//!
//! | File under the host root | Written by | Read by |
//! |---|---|---|
//! | `run/nvidia/validations/vfio-pci-ready` | vfio-manager `daemon`, through [`readiness`] (daemon-kit writes it again when someone removes it); also the GPU Operator's validator | the deployment's init containers, the operator's |
//! | `run/nvidia/validations/vgpu-devices-ready` | vgpu-device-manager `daemon`, through [`readiness`] (daemon-kit writes it again when someone removes it); also the GPU Operator's validator | the deployment's init containers, the operator's |
//! | `run/gpu-vm-node/vgpu-type-names` | vgpu-device-manager `apply` only ([`vgpu_names::record`]) | [`crate::Inventory`] ([`vgpu_names::load`]) |
//! | `run/gpu-vm-node/on-demand-pool` | sandbox-dp `--on-demand` ([`pool::write`]) | vgpu-device-manager ([`pool::load_owned`]) |
//! | `run/gpu-vm-node/dra-pool` | sandbox-dra `--vgpu` ([`pool::write_dra`]) | vgpu-device-manager ([`pool::load_owned`]) |
//! | `run/gpu-vm-node/on-demand-vgpus.json` | sandbox-dp `--on-demand` ([`write_atomic`]), before and after each vGPU it creates or removes | sandbox-dp, at start and after a crash |
//! | `run/vfio-manager/original-drivers` | vfio-manager `bind`/`unbind`, sandbox-dra's prepare and unprepare ([`originals::update`]) | vfio-manager `unbind`, sandbox-dra's unprepare |
//! | `<kubelet-root>/plugins/<driver>/claims/<uid>.json`, `…/metadata/`, `<cdi-root>/<driver>_<uid>.json` | sandbox-dra's prepare ([`write_atomic`]; the metadata and CDI spec with mode 0644, [`write_atomic_mode`]); removed by its unprepare | sandbox-dra; the container runtime (CDI spec, metadata); virt-launcher (metadata) |
//! | sandbox-dp's sockets in kubelet's device-plugin directory | sandbox-dp (bound by its servers; [`remove_if_present`]; [`file_identity`] tells one replaced, as for `kubelet.sock`) | kubelet |
//!
//! All but sandbox-dra's live in `/run`, emptied at boot with the bindings and vGPUs they
//! describe; sandbox-dra's claim records follow kubelet's own record of prepared claims.
//! Every file is replaced whole by [`write_atomic`]: a reader, or the next run after a crash,
//! sees the old content or the new, never part of either.

pub mod originals;
pub mod pool;
pub mod readiness;
pub mod vgpu_names;

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::{Error, Result};

/// Replaces `path` with `contents`, creating its directory when missing. The bytes go to a
/// hidden temporary file in the same directory, are flushed to disk, and the file is renamed
/// over `path`, so `path` holds the old content or the new at every moment, across a crash too.
/// On failure the temporary file is removed and `path` is left as it was.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| f.write_all(contents))
}

/// [`write_atomic`], the file's permission bits `mode` whatever the process's umask (a file
/// another user must read: sandbox-dra's device metadata, read by virt-launcher as `qemu`).
pub fn write_atomic_mode(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    write_atomic_with(path, |f| {
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(contents)
    })
}

/// [`write_atomic`] with the content written by `fill`.
fn write_atomic_with(path: &Path, fill: impl FnOnce(&mut File) -> io::Result<()>) -> Result<()> {
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
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        // Best effort: the temporary file may not even exist.
        let _ = std::fs::remove_file(&tmp);
        return Err(save(e));
    }
    // The rename itself survives a power loss only once the directory is flushed.
    File::open(dir).and_then(|d| d.sync_all()).map_err(save)
}

/// `<dir>/.<name>.<pid>.<n>.tmp`: hidden, and distinct per process and per write, so two
/// writers never share a temporary file.
fn temp_path(path: &Path) -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()))
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
        write_atomic_mode(&path, b"{}", 0o644).unwrap();
        assert_eq!(mode(&path), 0o644);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_atomic_mode(&path, b"{}", 0o644).unwrap();
        assert_eq!(mode(&path), 0o644);
        assert_eq!(names(dir.path()), ["metadata.json"]);
    }

    #[test]
    fn a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        write_atomic(&path, b"old content\n").unwrap();
        let err = write_atomic_with(&path, |f| {
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
                    write_atomic(&path, if i % 2 == 0 { &b } else { &a }).unwrap();
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
