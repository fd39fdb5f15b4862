//! The on-demand pool: the GPUs and non-PCI mdev parents (`mtty`) sandbox-dp creates vGPUs on
//! when pods ask for them, written by sandbox-dp (`--on-demand`) as
//! `<root>/run/gpu-vm-node/on-demand-pool`, one member a line after the header
//! `# gpu-vm-node on-demand-pool v1`: a GPU by its PCI address, a parent by its name under
//! `class/mdev_bus/`. A file without the header (the format before it) reads the same.
//! vgpu-device-manager reads it and leaves those members, and their vGPUs, alone: one owner per GPU or parent. The file lives in `/run`, so
//! after a reboot nothing is pooled until sandbox-dp starts again.
//!
//! sandbox-dra keeps its own pool the same way, `<root>/run/gpu-vm-node/dra-pool`: the members
//! it creates vGPUs on at claim time. [`load_owned`] is every member some daemon owns.
//!
//! Each owner holds its pool ([`hold`], [`hold_dra`]: a `flock` on `<pool file>.lock`) while it
//! runs; [`owner_running`] tells a live pool from one left over (a node relabelled, the owner's
//! DaemonSet gone). A writer refuses a member the other pool holds while its owner runs
//! ([`write`], [`write_dra`]); a left-over pool takes nothing from a running owner.
//!
//! That check and the write are one step for the node: each writer takes an exclusive `flock`
//! on `<root>/run/gpu-vm-node/pools.lock` ([`writers_lock_path`]) around its read of the other pool
//! and its own write, so two owners starting together cannot both take a GPU (the second
//! reads what the first wrote, and refuses).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::paths::{HostPaths, is_parent_name};
use crate::pci::PciAddress;

/// What a pool holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Members {
    /// GPUs, by PCI address.
    pub gpus: BTreeSet<PciAddress>,
    /// mdev parents that are not PCI functions, by name (`mtty`).
    pub parents: BTreeSet<String>,
}

impl Members {
    /// Nothing pooled.
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty() && self.parents.is_empty()
    }

    /// A member both pools hold, for messages.
    fn shared_with(&self, other: &Members) -> Option<String> {
        let gpu = self.gpus.intersection(&other.gpus).next();
        let parent = self.parents.intersection(&other.parents).next();
        gpu.map(|a| format!("GPU {a}"))
            .or_else(|| parent.map(|p| format!("mdev parent {p}")))
    }

    /// The file's text: its header, then addresses and parents, one a line.
    fn text(&self, kind: &str) -> String {
        let gpus = self.gpus.iter().map(ToString::to_string);
        let lines: String = gpus
            .chain(self.parents.iter().cloned())
            .map(|l| l + "\n")
            .collect();
        super::header(kind, VERSION) + &lines
    }
}

impl From<BTreeSet<PciAddress>> for Members {
    fn from(gpus: BTreeSet<PciAddress>) -> Members {
        Members {
            gpus,
            parents: BTreeSet::new(),
        }
    }
}

/// The format version the pool files are written in.
pub const VERSION: u32 = 1;

/// The record kind of the on-demand pool, as its header names it.
const ON_DEMAND_KIND: &str = "on-demand-pool";

/// The record kind of sandbox-dra's pool, as its header names it.
const DRA_KIND: &str = "dra-pool";

/// Who owns what the on-demand pool holds, for messages.
pub const ON_DEMAND_OWNER: &str = "sandbox-dp's on-demand pool";

/// Who owns what sandbox-dra's pool holds, for messages.
pub const DRA_OWNER: &str = "sandbox-dra's vGPU pool";

/// `<root>/run/gpu-vm-node/on-demand-pool`.
pub fn path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/on-demand-pool")
}

/// `<root>/run/gpu-vm-node/dra-pool`.
pub fn dra_path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/dra-pool")
}

/// What the on-demand pool holds; nothing when the file does not exist. A line that is neither
/// a PCI address nor an mdev parent's name is an error naming the file and the line: a reader
/// must not take a GPU it cannot tell is pooled.
pub fn load(paths: &HostPaths) -> Result<Members> {
    load_file(path(paths), ON_DEMAND_KIND)
}

/// sandbox-dra's pool, read as [`load`] reads the on-demand pool.
pub fn load_dra(paths: &HostPaths) -> Result<Members> {
    load_file(dra_path(paths), DRA_KIND)
}

/// Everything a daemon creates vGPUs on by itself, with its owner ([`ON_DEMAND_OWNER`],
/// [`DRA_OWNER`]): what no profile may touch.
pub fn load_owned(paths: &HostPaths) -> Result<Vec<(&'static str, Members)>> {
    Ok(vec![
        (ON_DEMAND_OWNER, load(paths)?),
        (DRA_OWNER, load_dra(paths)?),
    ])
}

/// A pool owner's hold on its pool while it runs: an exclusive `flock` on `<pool file>.lock`,
/// which the kernel drops when the process ends however it ends (a crash, `kill -9`, its
/// DaemonSet removed by a relabel). A pool file whose lock nobody holds is left over from an
/// owner that is not running ([`owner_running`]).
#[derive(Debug)]
pub struct Hold {
    _lock: nix::fcntl::Flock<std::fs::File>,
}

fn lock_path(pool_file: PathBuf) -> PathBuf {
    let mut s = pool_file.into_os_string();
    s.push(".lock");
    PathBuf::from(s)
}

fn take_lock(pool_file: PathBuf, arg: nix::fcntl::FlockArg) -> Result<Option<Hold>> {
    let p = lock_path(pool_file);
    if let Some(dir) = p.parent()
        && matches!(arg, nix::fcntl::FlockArg::LockExclusiveNonblock)
    {
        super::ensure_dir(dir)?;
    }
    // The owner creates the lock file; a reader only opens it (a read-only mount will do).
    let owner = matches!(arg, nix::fcntl::FlockArg::LockExclusiveNonblock);
    let file = std::fs::OpenOptions::new()
        .create(owner)
        .truncate(false)
        .write(owner)
        .read(!owner)
        .open(&p)
        .map_err(|source| Error::Io {
            path: p.clone(),
            source,
        })?;
    match nix::fcntl::Flock::lock(file, arg) {
        Ok(lock) => Ok(Some(Hold { _lock: lock })),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(Error::Io {
            path: p,
            source: e.into(),
        }),
    }
}

/// Takes the on-demand pool's hold for as long as the returned value lives; `Ok(None)` when
/// another process holds it (another sandbox-dp `--on-demand` runs on this node).
pub fn hold(paths: &HostPaths) -> Result<Option<Hold>> {
    take_lock(path(paths), nix::fcntl::FlockArg::LockExclusiveNonblock)
}

/// [`hold`] for sandbox-dra's pool.
pub fn hold_dra(paths: &HostPaths) -> Result<Option<Hold>> {
    take_lock(dra_path(paths), nix::fcntl::FlockArg::LockExclusiveNonblock)
}

/// Whether the owner of the pool `owner` names ([`ON_DEMAND_OWNER`], [`DRA_OWNER`]) runs: it
/// holds the pool's lock. Unknown (the lock file cannot be opened) counts as running.
pub fn owner_running(paths: &HostPaths, owner: &str) -> bool {
    let file = if owner == DRA_OWNER {
        dra_path(paths)
    } else {
        path(paths)
    };
    if !lock_path(file.clone()).exists() {
        return false;
    }
    // A shared lock taken (and dropped at once) means no owner holds the exclusive one.
    !matches!(
        take_lock(file, nix::fcntl::FlockArg::LockSharedNonblock),
        Ok(Some(_))
    )
}

/// `<root>/run/gpu-vm-node/pools.lock`: held by a pool's writer from its read of the other
/// pool to its own write.
pub fn writers_lock_path(paths: &HostPaths) -> PathBuf {
    paths.root().join("run/gpu-vm-node/pools.lock")
}

/// The longest a writer waits for the other to finish its check and write (a read and a write
/// of two small files: milliseconds).
const CLAIM_WAIT: Duration = Duration::from_secs(30);

/// Runs `f` holding the writers' lock ([`writers_lock_path`]), released when it returns. An error
/// naming the lock file when it cannot be taken within [`CLAIM_WAIT`].
fn claiming<T>(paths: &HostPaths, f: impl FnOnce() -> Result<T>) -> Result<T> {
    use nix::fcntl::{Flock, FlockArg};
    let p = writers_lock_path(paths);
    if let Some(dir) = p.parent() {
        super::ensure_dir(dir)?;
    }
    let io = |source: std::io::Error| Error::Io {
        path: p.clone(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .map_err(io)?;
    let start = Instant::now();
    let _lock = loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(l) => break l,
            Err((f, nix::errno::Errno::EWOULDBLOCK)) if start.elapsed() < CLAIM_WAIT => {
                file = f;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                return Err(io(std::io::Error::other(format!(
                    "another pool's writer held it for more than {CLAIM_WAIT:?}"
                ))));
            }
            Err((_, e)) => return Err(io(e.into())),
        }
    };
    f()
}

/// Replaces sandbox-dra's pool with `members`. Refused, writing nothing, when the on-demand
/// pool holds one of them and sandbox-dp runs: the error names it, the owner and the file. A
/// pool left over by an owner that is not running takes nothing from the new one. The check
/// and the write are made under the writers' lock ([`writers_lock_path`]).
pub fn write_dra(paths: &HostPaths, members: &Members) -> Result<()> {
    // An empty pool shares nothing: written without reading the on-demand pool, which may be
    // unreadable.
    if members.is_empty() {
        return write_file(dra_path(paths), DRA_KIND, members);
    }
    claiming(paths, || {
        one_owner(paths, members, ON_DEMAND_OWNER, path(paths), load(paths)?)?;
        write_file(dra_path(paths), DRA_KIND, members)
    })
}

fn one_owner(
    paths: &HostPaths,
    members: &Members,
    other: &str,
    other_file: PathBuf,
    theirs: Members,
) -> Result<()> {
    let Some(m) = members.shared_with(&theirs) else {
        return Ok(());
    };
    if owner_running(paths, other) {
        return Err(Error::Parse {
            path: other_file,
            reason: format!("{m} is in {other}, which is running; a GPU has one owner"),
        });
    }
    tracing::warn!(
        member = %m,
        file = %other_file.display(),
        "taken over from {other}, which is not running (its pool file is left over)"
    );
    Ok(())
}

/// Replaces the on-demand pool with `members` ([`super::write_atomic`]); an empty pool removes
/// the file. Refused as [`write_dra`] is when sandbox-dra's pool holds one of them and
/// sandbox-dra runs, under the same lock.
pub fn write(paths: &HostPaths, members: &Members) -> Result<()> {
    if members.is_empty() {
        return write_file(path(paths), ON_DEMAND_KIND, members);
    }
    claiming(paths, || {
        one_owner(paths, members, DRA_OWNER, dra_path(paths), load_dra(paths)?)?;
        write_file(path(paths), ON_DEMAND_KIND, members)
    })
}

fn write_file(p: PathBuf, kind: &str, members: &Members) -> Result<()> {
    if members.is_empty() {
        super::remove_if_present(&p)?;
        return Ok(());
    }
    super::write_atomic(&p, members.text(kind).as_bytes())
}

fn load_file(p: PathBuf, kind: &str) -> Result<Members> {
    let Some(text) = super::read_if_present(&p)? else {
        return Ok(Members::default());
    };
    // The header is checked (a newer format is refused); a file without one is the same list.
    super::text_version(&p, kind, VERSION, &text)?;
    let mut out = Members::default();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Ok(a) = line.parse() {
            out.gpus.insert(a);
        } else if is_parent_name(line) {
            out.parents.insert(line.to_string());
        } else {
            return Err(Error::Parse {
                path: p.clone(),
                reason: format!(
                    "line {}: {line:?} is neither a PCI address nor an mdev parent's name",
                    i + 1
                ),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(s: &str) -> PciAddress {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e:?}"))
    }

    fn members(gpus: &[&str], parents: &[&str]) -> Members {
        Members {
            gpus: gpus.iter().map(|s| gpu(s)).collect(),
            parents: parents.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn written_then_read_and_a_bad_line_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        assert!(load(&paths).unwrap().is_empty());
        let m = members(&["0000:41:00.0"], &["mtty"]);
        write(&paths, &m).unwrap();
        assert_eq!(
            std::fs::read_to_string(path(&paths)).unwrap(),
            "# gpu-vm-node on-demand-pool v1\n0000:41:00.0\nmtty\n"
        );
        assert_eq!(load(&paths).unwrap(), m);
        // The format before the header reads the same.
        std::fs::write(path(&paths), "0000:41:00.0\nmtty\n").unwrap();
        assert_eq!(load(&paths).unwrap(), m);
        // A newer format is refused, naming the file: a reader must not take a GPU it cannot
        // tell is pooled.
        std::fs::write(
            path(&paths),
            "# gpu-vm-node on-demand-pool v2\n0000:41:00.0\n",
        )
        .unwrap();
        let e = load(&paths).unwrap_err().to_string();
        assert!(e.contains("on-demand-pool") && e.contains("v2"), "{e}");
        // sandbox-dra's header in sandbox-dp's file is no header of it.
        std::fs::write(path(&paths), "# gpu-vm-node dra-pool v1\n").unwrap();
        let e = load(&paths).unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
        std::fs::write(path(&paths), "0000:41:00.0\n0000:61:00\n").unwrap();
        let e = load(&paths).unwrap_err().to_string();
        assert!(
            e.contains("on-demand-pool") && e.contains("line 2") && e.contains("0000:61:00"),
            "{e}"
        );
        write(&paths, &Members::default()).unwrap();
        assert!(!path(&paths).exists());
    }

    #[test]
    fn a_gpu_or_a_parent_has_one_owner() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        let on_demand = hold(&paths).unwrap().expect("the on-demand pool's hold");
        assert!(hold(&paths).unwrap().is_none(), "a second holder");
        assert!(owner_running(&paths, ON_DEMAND_OWNER));
        assert!(!owner_running(&paths, DRA_OWNER));
        write(&paths, &members(&["0000:41:00.0"], &["mtty"])).unwrap();
        for (clash, named) in [
            (
                members(&["0000:41:00.0", "0000:61:00.0"], &[]),
                "0000:41:00.0",
            ),
            (members(&["0000:61:00.0"], &["mtty"]), "mdev parent mtty"),
        ] {
            let e = write_dra(&paths, &clash).unwrap_err().to_string();
            assert!(e.contains(named) && e.contains("on-demand-pool"), "{e}");
            assert!(!dra_path(&paths).exists(), "nothing written");
        }
        let dra = members(&["0000:61:00.0"], &["mtty-2"]);
        write_dra(&paths, &dra).unwrap();
        assert_eq!(load_dra(&paths).unwrap(), dra);
        let dra = load_dra(&paths).unwrap();
        assert_eq!(
            load_owned(&paths).unwrap(),
            [
                (ON_DEMAND_OWNER, members(&["0000:41:00.0"], &["mtty"])),
                (DRA_OWNER, dra)
            ]
        );
        // Both ways: the on-demand pool cannot take what a running sandbox-dra holds.
        let dra_hold = hold_dra(&paths)
            .unwrap()
            .expect("sandbox-dra's pool's hold");
        let e = write(&paths, &members(&["0000:61:00.0"], &[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("0000:61:00.0") && e.contains("dra-pool"), "{e}");
        assert_eq!(load(&paths).unwrap(), members(&["0000:41:00.0"], &["mtty"]));
        // A pool left over by an owner that is not running takes nothing from the new one.
        drop(dra_hold);
        assert!(!owner_running(&paths, DRA_OWNER));
        write(&paths, &members(&["0000:61:00.0"], &[])).unwrap();
        drop(on_demand);
        write_dra(&paths, &members(&["0000:61:00.0"], &[])).unwrap();
        write_dra(&paths, &Members::default()).unwrap();
        assert!(!dra_path(&paths).exists());
    }

    #[test]
    fn two_owners_starting_together_never_both_take_a_gpu() {
        let one = members(&["0000:41:00.0"], &[]);
        for round in 0..200 {
            let dir = tempfile::tempdir().unwrap();
            let paths = HostPaths::new(dir.path());
            let start = std::sync::Barrier::new(2);
            let (on_demand, dra) = std::thread::scope(|s| {
                let a = s.spawn(|| {
                    let hold = hold(&paths).unwrap().unwrap();
                    start.wait();
                    (write(&paths, &one).is_ok(), hold)
                });
                let b = s.spawn(|| {
                    let hold = hold_dra(&paths).unwrap().unwrap();
                    start.wait();
                    (write_dra(&paths, &one).is_ok(), hold)
                });
                (a.join().unwrap(), b.join().unwrap())
            });
            assert!(
                on_demand.0 != dra.0,
                "round {round}: one owner takes the GPU, the other is refused \
                 (on-demand: {}, dra: {})",
                on_demand.0,
                dra.0
            );
            let taken = [load(&paths).unwrap(), load_dra(&paths).unwrap()];
            assert_eq!(
                taken
                    .iter()
                    .filter(|m| m.gpus.contains(&gpu("0000:41:00.0")))
                    .count(),
                1,
                "round {round}: {taken:?}"
            );
        }
    }

    #[test]
    fn sandbox_dras_pool_is_versioned_and_an_unreadable_on_demand_pool_is_never_guessed_at() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        let dra = members(&["0000:61:00.0"], &[]);
        write_dra(&paths, &dra).unwrap();
        assert_eq!(
            std::fs::read_to_string(dra_path(&paths)).unwrap(),
            "# gpu-vm-node dra-pool v1\n0000:61:00.0\n"
        );
        // The format before the header reads the same; a newer one is refused, naming the file.
        std::fs::write(dra_path(&paths), "0000:61:00.0\n").unwrap();
        assert_eq!(load_dra(&paths).unwrap(), dra);
        std::fs::write(dra_path(&paths), "# gpu-vm-node dra-pool v5\n").unwrap();
        let e = load_owned(&paths).unwrap_err().to_string();
        assert!(e.contains("dra-pool") && e.contains("v5"), "{e}");

        // An on-demand pool that cannot be read: sandbox-dra cannot tell which GPUs are
        // sandbox-dp's, so it is refused a pool (nothing written), naming the file...
        std::fs::write(path(&paths), "# gpu-vm-node on-demand-pool v2\n").unwrap();
        std::fs::remove_file(dra_path(&paths)).unwrap();
        let e = write_dra(&paths, &dra).unwrap_err().to_string();
        assert!(e.contains("on-demand-pool") && e.contains("v2"), "{e}");
        assert!(!dra_path(&paths).exists(), "nothing written");
        // ...but one without vGPUs shares nothing and is not held up by it.
        std::fs::write(dra_path(&paths), "0000:61:00.0\n").unwrap();
        write_dra(&paths, &Members::default()).unwrap();
        assert!(!dra_path(&paths).exists());
    }
}
