//! Writes that change the node: driver binding, mdev creation and removal, SR-IOV VFs and
//! vendor-path vGPU types. Each write is logged at debug level, runs under a timeout and, when
//! it fails, names the device and the file.
//!
//! Writes open the file write-only without truncating or creating it, and write the whole
//! value in one call, as the kernel expects of sysfs attributes.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::inventory::link_name;
use crate::paths::HostPaths;
use crate::pci::PciAddress;

/// Default time a single write may take (a GPU driver's probe or remove can take seconds).
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The node's sysfs, for writing. Clones share their writer threads ([`Writers`]): keep one
/// for the writes of a daemon's life rather than one per write.
#[derive(Clone, Debug)]
pub struct Sysfs {
    paths: HostPaths,
    timeout: Duration,
    writers: Writers,
}

impl Sysfs {
    /// Writes under `paths`, each under [`DEFAULT_WRITE_TIMEOUT`].
    pub fn new(paths: HostPaths) -> Self {
        Sysfs {
            paths,
            timeout: DEFAULT_WRITE_TIMEOUT,
            writers: Writers::default(),
        }
    }

    /// The same, with another per-write timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The paths this writes under.
    pub fn paths(&self) -> &HostPaths {
        &self.paths
    }

    fn device_dir(&self, a: &PciAddress) -> Result<PathBuf> {
        let dir = self.paths.pci_device(a);
        if std::fs::symlink_metadata(&dir).is_err() {
            return Err(Error::NotFound {
                device: a.to_string(),
                path: dir,
            });
        }
        Ok(dir)
    }

    /// Writes `value` to `path` on a writer thread and waits at most the timeout.
    fn write(&self, device: &str, path: PathBuf, value: &str) -> Result<()> {
        tracing::debug!(device, path = %path.display(), value, "sysfs write");
        let (tx, rx) = mpsc::channel();
        let job = Job {
            path: path.clone(),
            value: value.to_string(),
            reply: tx,
            again: None,
        };
        let result = match self.writers.run(job) {
            Ok(()) => match rx.recv_timeout(self.timeout) {
                Ok(r) => r,
                Err(_) => {
                    return Err(Error::Timeout {
                        device: device.to_string(),
                        path,
                        value: value.trim_end().to_string(),
                        after: self.timeout,
                    });
                }
            },
            // No thread to be had: write inline, without the timeout.
            Err(_) => write_now(&path, value),
        };
        result.map_err(|source| Error::Write {
            device: device.to_string(),
            path,
            value: value.trim_end().to_string(),
            source,
        })
    }

    /// Sets `driver_override` to `driver`, or clears it (`None` writes a newline, which the
    /// kernel reads back as `(null)`).
    pub fn set_driver_override(&self, a: &PciAddress, driver: Option<&str>) -> Result<()> {
        let path = self.device_dir(a)?.join("driver_override");
        self.write(&a.to_string(), path, driver.unwrap_or("\n"))
    }

    /// The driver `a` is bound to now.
    pub fn current_driver(&self, a: &PciAddress) -> Result<Option<String>> {
        let dir = self.device_dir(a)?;
        link_name(&dir.join("driver"))
    }

    /// Unbinds `a` from its current driver; returns that driver, or `None` when it had none
    /// (nothing is written then).
    pub fn unbind(&self, a: &PciAddress) -> Result<Option<String>> {
        let Some(driver) = self.current_driver(a)? else {
            return Ok(None);
        };
        let path = self.paths.pci_drivers().join(&driver).join("unbind");
        self.write(&a.to_string(), path, &a.to_string())?;
        Ok(Some(driver))
    }

    /// Whether the kernel has a PCI driver named `driver` (`drivers/<driver>` exists): a
    /// module that is not loaded has none, and a device overridden to it would be left with no
    /// driver at all.
    pub fn driver_registered(&self, driver: &str) -> bool {
        !driver.is_empty()
            && !driver.contains('/')
            && self.paths.pci_drivers().join(driver).is_dir()
    }

    /// Binds `a` to `driver` (`drivers/<driver>/bind`).
    pub fn bind(&self, a: &PciAddress, driver: &str) -> Result<()> {
        let path = self.paths.pci_drivers().join(driver).join("bind");
        if std::fs::symlink_metadata(&path).is_err() {
            return Err(Error::NotFound {
                device: format!("driver {driver}"),
                path,
            });
        }
        self.write(&a.to_string(), path, &a.to_string())
    }

    /// Asks the kernel to probe drivers for `a` (`drivers_probe`): it binds the
    /// `driver_override` driver when one is set, else the best match.
    pub fn drivers_probe(&self, a: &PciAddress) -> Result<()> {
        self.device_dir(a)?;
        self.write(&a.to_string(), self.paths.drivers_probe(), &a.to_string())
    }

    /// Waits until `a` is bound to `driver`, polling its `driver` link.
    pub fn wait_for_driver(&self, a: &PciAddress, driver: &str, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            let current = self.current_driver(a)?;
            if current.as_deref() == Some(driver) {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(Error::BindTimeout {
                    device: a.to_string(),
                    driver: driver.to_string(),
                    after: timeout,
                    current: current.unwrap_or_else(|| "none".into()),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Creates an mdev of `type_id` on `parent` (`mdev_supported_types/<type>/create`).
    pub fn mdev_create(&self, parent: &str, type_id: &str, uuid: &str) -> Result<()> {
        let type_dir = self
            .paths
            .mdev_bus()
            .join(parent)
            .join("mdev_supported_types")
            .join(type_id);
        if std::fs::symlink_metadata(&type_dir).is_err() {
            return Err(Error::NotFound {
                device: format!("{parent} type {type_id}"),
                path: type_dir,
            });
        }
        self.write(parent, type_dir.join("create"), uuid)
    }

    /// Removes the mdev `uuid` (`/sys/bus/mdev/devices/<uuid>/remove`).
    pub fn mdev_remove(&self, uuid: &str) -> Result<()> {
        let dir = self.paths.mdev_devices().join(uuid);
        if std::fs::symlink_metadata(&dir).is_err() {
            return Err(Error::NotFound {
                device: uuid.to_string(),
                path: dir,
            });
        }
        self.write(uuid, dir.join("remove"), "1")
    }

    /// Sets the number of VFs of a PF (`sriov_numvfs`). The kernel refuses a change between two
    /// non-zero counts; set 0 first.
    pub fn set_sriov_numvfs(&self, a: &PciAddress, n: u32) -> Result<()> {
        let path = self.device_dir(a)?.join("sriov_numvfs");
        self.write(&a.to_string(), path, &n.to_string())
    }

    /// Sets a VF's vendor-path vGPU type (`nvidia/current_vgpu_type`); 0 deletes the vGPU.
    ///
    /// Once set, sysfs no longer names the type: a caller that needs the name later records it
    /// first ([`crate::state::vgpu_names::record`]).
    pub fn set_current_vgpu_type(&self, vf: &PciAddress, type_id: u32) -> Result<()> {
        let dir = self.device_dir(vf)?;
        self.write(
            &vf.to_string(),
            dir.join("nvidia/current_vgpu_type"),
            &type_id.to_string(),
        )
    }
}

/// One write for a writer thread, and where its result goes.
#[derive(Debug)]
struct Job {
    path: PathBuf,
    value: String,
    reply: mpsc::Sender<std::io::Result<()>>,
    /// How to reach the thread again, for the idle list: a waiting thread holds none, so that
    /// it ends when the list is dropped.
    again: Option<mpsc::Sender<Job>>,
}

/// The threads [`Sysfs`] writes on, so that a write that hangs in the kernel (a driver's
/// probe) leaves its caller free after the timeout. A thread that finished its write waits
/// for the next one, [`IDLE_WRITERS`] at most: a write wakes a waiting thread (microseconds)
/// rather than starting one, which on a busy machine waits for a CPU for milliseconds. A thread
/// still in a hung write is not waited for: the next write gets another. Idle threads end when
/// the last clone of the [`Sysfs`] is dropped.
#[derive(Clone, Debug, Default)]
struct Writers {
    idle: Arc<Mutex<Vec<mpsc::Sender<Job>>>>,
}

/// How many writer threads wait for work at most.
const IDLE_WRITERS: usize = 2;

impl Writers {
    /// Hands `job` to an idle thread, or to a new one. Gives the job back when no thread can
    /// be started: the caller writes it itself.
    fn run(&self, mut job: Job) -> std::result::Result<(), Job> {
        loop {
            let next = lock(&self.idle).pop();
            let Some(worker) = next else { break };
            job.again = Some(worker.clone());
            match worker.send(job) {
                Ok(()) => return Ok(()),
                // That thread is gone: the job comes back.
                Err(mpsc::SendError(j)) => job = j,
            }
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let idle = Arc::downgrade(&self.idle);
        let spawned = std::thread::Builder::new()
            .name("sysfs-write".into())
            .spawn(move || {
                while let Ok(mut job) = rx.recv() {
                    let done = write_now(&job.path, &job.value);
                    // Back in the idle list before the caller hears, so that its next write
                    // finds this thread; the list gone (the Sysfs dropped) or full ends it.
                    if let (Some(again), Some(idle)) = (job.again.take(), idle.upgrade()) {
                        let mut idle = lock(&idle);
                        if idle.len() < IDLE_WRITERS {
                            idle.push(again);
                        }
                    }
                    let _ = job.reply.send(done);
                }
            });
        match spawned {
            Ok(_) => {
                job.again = Some(tx.clone());
                tx.send(job).map_err(|mpsc::SendError(j)| j)
            }
            Err(_) => Err(job),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A list of senders is whole whatever a panicking holder did.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn write_now(path: &Path, value: &str) -> std::io::Result<()> {
    let mut f = OpenOptions::new().write(true).open(path)?;
    f.write_all(value.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use testkit::sysfs::{A10, SysfsTree};

    fn tree() -> (SysfsTree, HostPaths, PciAddress) {
        let dir = SysfsTree::new();
        dir.device("pci0000:00", "0000:41:00.0", A10, Some("nvidia"), 21);
        fs::write(dir.root().join("sys/bus/pci/drivers/nvidia/unbind"), "").unwrap();
        fs::write(dir.root().join("sys/bus/pci/drivers_probe"), "").unwrap();
        let p = HostPaths::new(dir.root());
        (dir, p, "0000:41:00.0".parse().unwrap())
    }

    #[test]
    fn a_writer_thread_serves_the_next_write_and_a_hung_one_holds_up_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let s = Sysfs::new(HostPaths::new(dir.path())).with_timeout(Duration::from_millis(200));
        let file = dir.path().join("attr");
        fs::write(&file, "").unwrap();
        s.write("dev", file.clone(), "1").unwrap();
        s.write("dev", file.clone(), "2").unwrap();
        assert_eq!(fs::read_to_string(&file).unwrap(), "2");
        assert_eq!(
            lock(&s.writers.idle).len(),
            1,
            "one thread served both writes"
        );

        // A write that blocks (a FIFO nobody reads: as a driver's probe that never returns)
        // times out; the next write gets a thread of its own.
        let fifo = dir.path().join("hung");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = s.write("gpu", fifo.clone(), "1").unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        s.write("dev", file.clone(), "3").unwrap();
        assert_eq!(fs::read_to_string(&file).unwrap(), "3");
        // Let the hung write finish.
        let reader = std::thread::spawn(move || fs::read_to_string(&fifo).unwrap());
        assert_eq!(reader.join().unwrap(), "1");
    }

    #[test]
    fn writes_land_in_the_named_files() {
        let (dir, p, a) = tree();
        let s = Sysfs::new(p);
        s.set_driver_override(&a, Some("vfio-pci")).unwrap();
        assert_eq!(
            fs::read_to_string(
                dir.root()
                    .join("sys/bus/pci/devices/0000:41:00.0/driver_override")
            )
            .unwrap(),
            "vfio-pci"
        );
        assert_eq!(s.unbind(&a).unwrap().as_deref(), Some("nvidia"));
        assert_eq!(
            fs::read_to_string(dir.root().join("sys/bus/pci/drivers/nvidia/unbind")).unwrap(),
            "0000:41:00.0"
        );
        s.drivers_probe(&a).unwrap();
        assert_eq!(
            fs::read_to_string(dir.root().join("sys/bus/pci/drivers_probe")).unwrap(),
            "0000:41:00.0"
        );
    }

    #[test]
    fn a_missing_device_is_named() {
        let (_dir, p, _) = tree();
        let s = Sysfs::new(p);
        let gone: PciAddress = "0000:99:00.0".parse().unwrap();
        let e = s.set_driver_override(&gone, Some("vfio-pci")).unwrap_err();
        assert!(e.to_string().contains("0000:99:00.0"), "{e}");
        assert!(matches!(e, Error::NotFound { .. }));
    }

    #[test]
    fn a_refused_write_names_device_file_and_errno() {
        let (_dir, p, a) = tree();
        let s = Sysfs::new(p);
        // No bind file for vfio-pci: the driver is not loaded.
        let e = s.bind(&a, "vfio-pci").unwrap_err();
        assert!(e.to_string().contains("vfio-pci"), "{e}");
        // A write to a file that cannot be opened for writing.
        let e = s.set_sriov_numvfs(&a, 4).unwrap_err();
        assert!(e.to_string().contains("sriov_numvfs"), "{e}");
        assert_eq!(e.errno(), Some(libc::ENOENT));
    }

    #[test]
    fn wait_for_driver_times_out_with_the_current_driver() {
        let (_dir, p, a) = tree();
        let s = Sysfs::new(p);
        let e = s
            .wait_for_driver(&a, "vfio-pci", Duration::from_millis(20))
            .unwrap_err();
        assert!(e.to_string().contains("driver now: nvidia"), "{e}");
    }
}
