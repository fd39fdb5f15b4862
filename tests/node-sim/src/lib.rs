//! node-sim: a simulated GPU node.
//!
//! [`mount`] makes a directory a host root: `DIR/sys`, `DIR/dev` and `DIR/proc` are three FUSE
//! mounts over one shared state whose writes have the kernel's effects (driver binding, VFIO
//! group nodes, SR-IOV VFs, mdevs, NVIDIA's vendor vGPU path), `DIR/run`,
//! `DIR/var/lib/kubelet/device-plugins` and `DIR/lib/modules/<release>/` are plain
//! directories. Unmodified programs pointed at `DIR` (`--host-root DIR`) see a GPU node.
//!
//! Control and observation, outside the simulated kernel: `DIR/sys/kernel/node-sim/control`
//! (fault injection, synthetic VFIO group holders, hot-plug) and `DIR/sys/kernel/node-sim/ops`
//! (every write, in order). See `tests/node-sim/README.md`.

pub mod catalogue;
pub mod configmap;
mod control;
mod errno;
mod faults;
mod fs;
mod holders;
mod ops;
mod render;
mod state;
pub mod topology;
mod tree;
mod uevent;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

pub use catalogue::{Catalogue, GpuModel, VgpuTypeDef, catalogue};
pub use ops::Op;
pub use topology::{Topology, topology};
pub use uevent::{UDEV_GROUP, udev_message};

use fs::{Inner, Shared, SimFs};

/// node-sim's errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or directory operation failed.
    #[error("{path}: I/O error")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A topology is unknown or malformed.
    #[error("topology {name}: {reason}")]
    Topology {
        /// Its name or file.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// Mounting a FUSE filesystem failed.
    #[error("mounting node-sim at {path} failed")]
    Mount {
        /// The mount point.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A control command was refused.
    #[error("control command refused: {0}")]
    Control(String),
}

/// node-sim's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A mounted simulated node. Dropping it unmounts.
#[derive(Debug)]
pub struct Sim {
    root: PathBuf,
    shared: Arc<Shared>,
    sessions: Mutex<Vec<(PathBuf, fuser::BackgroundSession)>>,
}

const MOUNTS: [&str; 3] = ["sys", "dev", "proc"];

/// Why node-sim cannot run on this machine, if it cannot: it needs root and `/dev/fuse`.
pub fn unavailable() -> Option<&'static str> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root");
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse");
    }
    None
}

/// For tests that need node-sim: reports a missing prerequisite as `skipped: <what>: <why>`
/// on stderr, past the test harness's capture so a plain `cargo test` shows it, or panics when
/// `NODE_SIM=required` (CI, where a skip would hide the end-to-end tests).
pub fn skip_test(what: &str, why: &str) {
    let line = format!("skipped: {what}: {why} (node-sim needs root and /dev/fuse)");
    if std::env::var("NODE_SIM").is_ok_and(|v| v == "required") {
        panic!("NODE_SIM=required but {line}");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Mounts `topology` at `dir` (created if missing; stale node-sim mounts under it are removed
/// first). Returns once the mounts answer: each mount's FUSE handshake is done when it is made.
///
/// node-sim itself never makes a request to its own mounts: a thread of a killed node-sim
/// waiting for its own (dead) server would keep the process, and its mounts, alive for ever.
pub fn mount(topology: &Topology, dir: &Path) -> Result<Sim> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let root = dir.canonicalize().map_err(io_err(dir))?;
    remove_stale_mounts(&root);
    for sub in [
        "sys",
        "dev",
        "proc",
        "run",
        "var/lib/kubelet/device-plugins",
    ] {
        let p = root.join(sub);
        std::fs::create_dir_all(&p).map_err(io_err(&p))?;
    }
    let modules = root.join("lib/modules").join(&topology.release);
    std::fs::create_dir_all(&modules).map_err(io_err(&modules))?;
    let alias = modules.join("modules.alias");
    let mut text = String::new();
    for l in &topology.modules_alias {
        text.push_str(l);
        text.push('\n');
    }
    std::fs::write(&alias, text).map_err(io_err(&alias))?;

    let shared = Arc::new(Shared::new(
        Inner::new(state::State::new(topology, &root)),
        uevent::UeventSender::new(),
    ));
    let sim = Sim {
        root: root.clone(),
        shared: shared.clone(),
        sessions: Mutex::new(Vec::new()),
    };
    let now = SystemTime::now();
    for m in MOUNTS {
        let mp = root.join(m);
        let fs = SimFs {
            shared: shared.clone(),
            root: m.to_string(),
            mounted_at: now,
        };
        let mut cfg = fuser::Config::default();
        cfg.mount_options = vec![
            fuser::MountOption::FSName("node-sim".into()),
            fuser::MountOption::Subtype(format!("node-sim-{m}")),
            fuser::MountOption::NoDev,
            fuser::MountOption::NoSuid,
        ];
        cfg.acl = fuser::SessionACL::All;
        cfg.n_threads = Some(threads(m));
        let session = fuser::spawn_mount(fs, &mp, &cfg).map_err(|source| Error::Mount {
            path: mp.clone(),
            source,
        })?;
        shared.add_notifier(m, session.notifier());
        sim.sessions_lock().push((mp, session));
    }
    Ok(sim)
}

/// The mounts of this mount namespace: mount point and the superblock's minor device number
/// (a FUSE connection's number under `/sys/fs/fuse/connections`).
fn mounts() -> Vec<(PathBuf, u32)> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    info.lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let dev = f.nth(2)?;
            let mp = f.nth(1)?;
            let minor = dev.split_once(':')?.1.parse().ok()?;
            Some((PathBuf::from(unescape_mountinfo(mp)), minor))
        })
        .collect()
}

/// FUSE threads serving mount `m`. A write to `sys` holds its thread while a `delay` fault
/// lasts and while the kernel's caches forget what it changed, which waits for lookups in
/// flight: `sys` keeps threads to spare for them even with one delayed write per GPU of a
/// large node in parallel.
fn threads(m: &str) -> usize {
    match m {
        "sys" => 64,
        _ => 16,
    }
}

/// Unmounts (lazily) every mount at or under `root`: left-overs of a killed node-sim.
fn remove_stale_mounts(root: &Path) {
    let mut stale: Vec<PathBuf> = mounts()
        .into_iter()
        .map(|(mp, _)| mp)
        .filter(|mp| mp.starts_with(root) && mp != root)
        .collect();
    // Deepest first.
    stale.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for mp in stale {
        tracing::info!(mount = %mp.display(), "removing a stale mount");
        if let Err(e) = nix::mount::umount2(&mp, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(mount = %mp.display(), "cannot remove a stale mount: {e}");
        }
    }
}

fn unescape_mountinfo(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let oct: String = chars.by_ref().take(3).collect();
            if let Ok(v) = u8::from_str_radix(&oct, 8) {
                out.push(char::from(v));
                continue;
            }
            out.push('\\');
            out.push_str(&oct);
        } else {
            out.push(c);
        }
    }
    out
}

impl Sim {
    fn sessions_lock(&self) -> std::sync::MutexGuard<'_, Vec<(PathBuf, fuser::BackgroundSession)>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The host root (`DIR`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Runs a control command, as a write to `sys/kernel/node-sim/control` would.
    pub fn control(&self, cmd: &str) -> Result<()> {
        self.shared
            .change(|st| st.control(cmd))
            .map_err(Error::Control)
    }

    /// The op log: every write to a simulated kernel file, in order.
    pub fn ops(&self) -> Vec<Op> {
        self.shared.lock().state.ops.all().to_vec()
    }

    /// Empties the op log.
    pub fn clear_ops(&self) {
        self.shared.lock().state.ops.clear();
    }

    /// Unmounts the three mounts.
    pub fn unmount(self) -> Result<()> {
        self.unmount_all()
    }

    fn unmount_all(&self) -> Result<()> {
        let sessions = std::mem::take(&mut *self.sessions_lock());
        let mut first_err = None;
        for (mp, session) in sessions.into_iter().rev() {
            let connection = mounts()
                .into_iter()
                .rev()
                .find(|(p, _)| *p == mp)
                .map(|(_, minor)| minor);
            match session.umount_and_join() {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    // A process still has a file open: detach now and abort the connection
                    // so that the session thread ends.
                    let _ = nix::mount::umount2(&mp, nix::mount::MntFlags::MNT_DETACH);
                    if let Some(c) = connection {
                        let _ = std::fs::write(format!("/sys/fs/fuse/connections/{c}/abort"), "1");
                    }
                }
                Err(source) => {
                    first_err.get_or_insert(Error::Mount {
                        path: mp.clone(),
                        source,
                    });
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_all() {
            tracing::warn!("unmounting node-sim: {e}");
        }
    }
}
