//! The plain tree: a simulated node's `sys`, `dev`, `proc` (and the plain directories beside
//! them) copied onto a tmpfs as regular files, directories and symlinks, so that a read costs
//! what a read of real sysfs costs instead of a FUSE round trip.
//!
//! Symlinks keep their targets as node-sim renders them (the same relative links the kernel
//! uses), device nodes (`/dev/vfio/<g>`, `/dev/nvidia<N>`) become empty regular files with the
//! node's mode, write-only attributes (`unbind`, `create`, `remove`) empty files with their mode.
//! Sockets are left out (the kubelet directory starts empty) and so is node-sim's own control
//! directory (`sys/kernel/node-sim`), which a real node does not have.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use nix::mount::{MntFlags, MsFlags};

/// What a copy made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyStats {
    /// Directories.
    pub dirs: usize,
    /// Regular files with their contents.
    pub files: usize,
    /// Symlinks.
    pub links: usize,
    /// Device nodes and FIFOs, now empty regular files.
    pub nodes: usize,
    /// Files whose read failed (write-only attributes), now empty regular files.
    pub unreadable: usize,
}

/// Copies the tree at `src` into `dst` (created), never following a symlink. `skip` is asked
/// for each entry's path relative to `src`; skipped directories are not entered.
pub fn copy_tree(src: &Path, dst: &Path, skip: &dyn Fn(&Path) -> bool) -> io::Result<CopyStats> {
    let mut stats = CopyStats::default();
    let mode = fs::symlink_metadata(src)?.permissions().mode();
    make_dir(dst, mode)?;
    stats.dirs += 1;
    copy_dir(src, dst, Path::new(""), skip, &mut stats)?;
    Ok(stats)
}

fn make_dir(p: &Path, mode: u32) -> io::Result<()> {
    match fs::DirBuilder::new().mode(mode & 0o7777).create(p) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && p.is_dir() => Ok(()),
        r => r,
    }?;
    // The umask narrowed the mode given to mkdir.
    fs::set_permissions(p, fs::Permissions::from_mode(mode & 0o7777))
}

fn copy_dir(
    src: &Path,
    dst: &Path,
    rel: &Path,
    skip: &dyn Fn(&Path) -> bool,
    stats: &mut CopyStats,
) -> io::Result<()> {
    let mut entries: Vec<_> = fs::read_dir(src)?.collect::<io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let rel = rel.join(&name);
        if skip(&rel) {
            continue;
        }
        let (from, to) = (e.path(), dst.join(&name));
        let meta = fs::symlink_metadata(&from)?;
        let ft = meta.file_type();
        let mode = meta.permissions().mode();
        if ft.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(&from)?, &to)?;
            stats.links += 1;
        } else if ft.is_dir() {
            make_dir(&to, mode)?;
            stats.dirs += 1;
            copy_dir(&from, &to, &rel, skip, stats)?;
        } else if ft.is_socket() {
            continue;
        } else if ft.is_file() {
            let content = match fs::read(&from) {
                Ok(c) => c,
                Err(_) => {
                    stats.unreadable += 1;
                    Vec::new()
                }
            };
            write_file(&to, &content, mode)?;
            stats.files += 1;
        } else {
            // Character and block devices, FIFOs.
            write_file(&to, b"", mode)?;
            stats.nodes += 1;
        }
    }
    Ok(())
}

fn write_file(p: &Path, content: &[u8], mode: u32) -> io::Result<()> {
    fs::write(p, content)?;
    fs::set_permissions(p, fs::Permissions::from_mode(mode & 0o7777))
}

/// node-sim's own control and op log: not part of the node.
pub fn not_on_a_real_node(rel: &Path) -> bool {
    rel == Path::new("sys/kernel/node-sim")
}

/// A plain copy of a node on a tmpfs mounted for it. Dropping it unmounts the tmpfs and removes
/// the directory.
#[derive(Debug)]
pub struct PlainTree {
    root: PathBuf,
    stats: CopyStats,
    // Field order: unmounted (in `drop`) before the directory goes.
    dir: tempfile::TempDir,
}

impl PlainTree {
    /// Copies the node at `sim_root` (a node-sim host root) onto a new tmpfs. Needs root.
    pub fn copy_of(sim_root: &Path) -> Result<PlainTree> {
        let dir = tempfile::Builder::new()
            .prefix("plain-tree-")
            .tempdir()
            .context("creating the plain tree's mount point")?;
        // Canonical, as strace names the files the daemons open.
        let root = dir
            .path()
            .canonicalize()
            .context("resolving the plain tree's mount point")?
            .join("root");
        nix::mount::mount(
            Some("tmpfs"),
            dir.path(),
            Some("tmpfs"),
            MsFlags::MS_NOSUID,
            Some("mode=0755"),
        )
        .with_context(|| format!("mounting a tmpfs at {}", dir.path().display()))?;
        // From here on, dropping `tree` unmounts.
        let mut tree = PlainTree {
            root,
            stats: CopyStats::default(),
            dir,
        };
        tree.stats = copy_tree(sim_root, &tree.root, &not_on_a_real_node).with_context(|| {
            format!("copying {} to {}", sim_root.display(), tree.root.display())
        })?;
        Ok(tree)
    }

    /// The host root (`--host-root`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// What the copy made.
    pub fn stats(&self) -> CopyStats {
        self.stats
    }
}

impl Drop for PlainTree {
    fn drop(&mut self) {
        if let Err(e) = nix::mount::umount2(self.dir.path(), MntFlags::MNT_DETACH) {
            eprintln!(
                "gpu-vm-bench: unmounting the tmpfs at {}: {e}",
                self.dir.path().display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// A small sysfs-like tree: a device directory reached through a relative bus link, a
    /// driver link pointing back up (a cycle if followed), a write-only attribute, a FIFO
    /// standing for a device node, and a skipped directory.
    fn sample(src: &Path) {
        let dev = src.join("sys/devices/pci0000:00/0000:00:01.0");
        fs::create_dir_all(&dev).unwrap();
        fs::write(dev.join("vendor"), "0x10de\n").unwrap();
        fs::create_dir_all(src.join("sys/bus/pci/devices")).unwrap();
        fs::create_dir_all(src.join("sys/bus/pci/drivers/vfio-pci")).unwrap();
        symlink(
            "../../../devices/pci0000:00/0000:00:01.0",
            src.join("sys/bus/pci/devices/0000:00:01.0"),
        )
        .unwrap();
        symlink("../../../bus/pci/drivers/vfio-pci", dev.join("driver")).unwrap();
        symlink(
            "../../../../devices",
            src.join("sys/bus/pci/drivers/vfio-pci/up"),
        )
        .unwrap();
        let unbind = src.join("sys/bus/pci/drivers/vfio-pci/unbind");
        fs::write(&unbind, "").unwrap();
        fs::set_permissions(&unbind, fs::Permissions::from_mode(0o200)).unwrap();
        fs::create_dir_all(src.join("dev/vfio")).unwrap();
        nix::unistd::mkfifo(
            &src.join("dev/vfio/42"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        fs::create_dir_all(src.join("sys/kernel/node-sim")).unwrap();
        fs::write(src.join("sys/kernel/node-sim/ops"), "x").unwrap();
    }

    #[test]
    fn copies_files_links_and_nodes_without_following_links() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        sample(&src);
        let stats = copy_tree(&src, &dst, &not_on_a_real_node).unwrap();

        // Contents through the copied relative link, as a reader of the node sees them.
        assert_eq!(
            fs::read_to_string(dst.join("sys/bus/pci/devices/0000:00:01.0/vendor")).unwrap(),
            "0x10de\n"
        );
        assert_eq!(
            fs::read_link(dst.join("sys/bus/pci/devices/0000:00:01.0")).unwrap(),
            Path::new("../../../devices/pci0000:00/0000:00:01.0")
        );
        let driver = dst.join("sys/devices/pci0000:00/0000:00:01.0/driver");
        assert_eq!(
            fs::read_link(&driver).unwrap(),
            Path::new("../../../bus/pci/drivers/vfio-pci")
        );
        assert_eq!(
            fs::canonicalize(&driver).unwrap(),
            fs::canonicalize(dst.join("sys/bus/pci/drivers/vfio-pci")).unwrap()
        );
        // The FIFO (a device node's stand-in) is a regular, empty file with its mode.
        let node = dst.join("dev/vfio/42");
        let meta = fs::symlink_metadata(&node).unwrap();
        assert!(meta.file_type().is_file() && meta.len() == 0);
        assert_eq!(mode(&node), 0o600);
        assert_eq!(
            mode(&dst.join("sys/bus/pci/drivers/vfio-pci/unbind")),
            0o200
        );
        assert!(!dst.join("sys/kernel/node-sim").exists());
        assert!(dst.join("sys/kernel").is_dir());
        assert_eq!(
            stats,
            CopyStats {
                // dst, sys, devices, pci0000:00, 0000:00:01.0, bus, pci, devices, drivers,
                // vfio-pci, kernel, dev, vfio
                dirs: 13,
                files: 2,
                links: 3,
                nodes: 1,
                unreadable: 0,
            }
        );
    }

    #[test]
    fn skip_leaves_out_whole_directories() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        sample(&src);
        copy_tree(&src, &dst, &|rel| rel.starts_with("sys/bus")).unwrap();
        assert!(!dst.join("sys/bus").exists());
        assert!(dst.join("sys/kernel/node-sim/ops").is_file());
        assert!(
            dst.join("sys/devices/pci0000:00/0000:00:01.0/vendor")
                .is_file()
        );
    }
}
