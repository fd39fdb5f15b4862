//! The cluster's network namespace: the node's address, the pod network and every process that
//! listens or routes there live in a namespace the run creates, so that nothing of the cluster's
//! network (its `10.x` addresses and routes, the bridge, the pods' veths) appears in the
//! machine's own.
//!
//! [`NetNs::create`] unshares a new namespace on a thread of its own and keeps it open (a file
//! descriptor), bind-mounted on a file of the run's scratch directory as well
//! (`nsenter --net=<dir>/netns ip addr` shows it; a later run finds what a killed one left
//! there by it: [`kill_pinned`]). Processes are started in it from a thread that entered
//! it ([`NetNs::spawn`]): a child is born in its parent thread's namespace. The kernel removes
//! the namespace, its interfaces and routes with them, once no process, descriptor or mount holds
//! it.
//!
//! The host reaches a server inside through [`Forward`]: a port on the host's `127.0.0.1`
//! whose connections are made again from inside the namespace.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use nix::sched::{CloneFlags, setns, unshare};

use crate::proc;

/// A network namespace of the run's.
#[derive(Debug)]
pub struct NetNs {
    fd: std::fs::File,
    pin: PathBuf,
}

impl NetNs {
    /// Creates a namespace with `lo` up, pinned (bind-mounted) at `pin`.
    pub fn create(pin: &Path) -> Result<NetNs> {
        std::fs::write(pin, b"").with_context(|| format!("creating {}", pin.display()))?;
        let fd = std::thread::scope(|s| {
            s.spawn(|| -> Result<std::fs::File> {
                unshare(CloneFlags::CLONE_NEWNET).context("unshare(CLONE_NEWNET)")?;
                let own = "/proc/thread-self/ns/net";
                let f = std::fs::File::open(own).with_context(|| format!("opening {own}"))?;
                nix::mount::mount(
                    Some(own),
                    pin,
                    None::<&str>,
                    nix::mount::MsFlags::MS_BIND,
                    None::<&str>,
                )
                .with_context(|| format!("bind-mounting {own} at {}", pin.display()))?;
                Ok(f)
            })
            .join()
            .map_err(|_| anyhow!("the thread creating a network namespace panicked"))?
        })
        .context("creating a network namespace")?;
        let ns = NetNs {
            fd,
            pin: pin.to_path_buf(),
        };
        ns.run(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Where it is pinned.
    pub fn pin(&self) -> &Path {
        &self.pin
    }

    /// Runs `f` on a thread that entered the namespace: what it connects, binds or starts is
    /// there.
    pub fn within<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        std::thread::scope(|s| {
            s.spawn(|| {
                setns(&self.fd, CloneFlags::CLONE_NEWNET)
                    .context("entering the cluster's network namespace")?;
                f()
            })
            .join()
            .map_err(|_| anyhow!("a thread in the cluster's network namespace panicked"))?
        })
    }

    /// Starts `cmd` in the namespace.
    pub fn spawn(&self, cmd: &mut Command) -> Result<Child> {
        self.within(|| Ok(cmd.spawn()?))
    }

    /// Runs `ip ARGS` in the namespace.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        self.within(|| proc::run(Command::new("ip").args(args)))
            .with_context(|| format!("ip {} in the cluster's network namespace", args.join(" ")))
    }

    /// Kills (SIGKILL) every process in the namespace and what descends from them.
    pub fn kill_all(&self) {
        if let Ok(m) = self.fd.metadata() {
            kill_in(m.dev(), m.ino());
        }
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.pin, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Kills every process in the namespace pinned at `pin` (a killed run's) and what descends from
/// them; nothing when no namespace is pinned there.
pub fn kill_pinned(pin: &Path) {
    let (Ok(m), Ok(parent)) = (
        std::fs::metadata(pin),
        std::fs::metadata(pin.parent().unwrap_or(Path::new("/"))),
    ) else {
        return;
    };
    // A file of the scratch directory's own file system: nothing is mounted on it.
    if m.dev() != parent.dev() {
        kill_in(m.dev(), m.ino());
    }
}

fn kill_in(dev: u64, ino: u64) {
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Ok(m) = std::fs::metadata(e.path().join("ns/net"))
            && m.dev() == dev
            && m.ino() == ino
        {
            proc::kill_tree(pid);
        }
    }
}

/// A port on the host's `127.0.0.1` forwarded to an address inside a [`NetNs`]: each connection
/// accepted is made again from inside the namespace and the bytes copied both ways. Stops
/// accepting when dropped.
#[derive(Debug)]
pub struct Forward {
    port: u16,
    stop: Arc<AtomicBool>,
}

impl Forward {
    /// Listens on a free port of `127.0.0.1` and forwards to `to` in `ns`.
    pub fn start(ns: Arc<NetNs>, to: SocketAddr) -> Result<Forward> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding a port on 127.0.0.1")?;
        let port = listener
            .local_addr()
            .context("the forwarded port's address")?
            .port();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name(format!("forward-{port}"))
            .spawn(move || {
                for conn in listener.incoming() {
                    if stopped.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = conn else { continue };
                    let ns = ns.clone();
                    let _ = std::thread::Builder::new()
                        .name(format!("forward-{port}-conn"))
                        .spawn(move || forward(&ns, client, to));
                }
            })
            .context("starting the forwarding thread")?;
        Ok(Forward { port, stop })
    }

    /// The port on `127.0.0.1`.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accepting thread, which then sees it should stop.
        let _ = TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], self.port)),
            Duration::from_secs(1),
        );
    }
}

/// Connects to `to` from inside `ns` and copies `client`'s bytes there and back until both
/// sides are done; a server that is not there (stopped, say) closes the client's connection.
fn forward(ns: &NetNs, client: TcpStream, to: SocketAddr) {
    let Ok(server) = ns.within(|| {
        TcpStream::connect_timeout(&to, Duration::from_secs(5))
            .with_context(|| format!("connecting to {to}"))
    }) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let back = std::thread::spawn(move || copy(server2, client2));
    copy(client, server);
    let _ = back.join();
}

/// Copies `from` to `to` until `from` ends, then ends `to`'s writing; on an error both
/// connections are ended, so that the other direction's copy ends too.
fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) => {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
