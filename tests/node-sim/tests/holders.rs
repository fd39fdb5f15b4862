//! Holders of device nodes as the kernel keeps them: a VFIO group stays held until the last
//! descriptor of its open file description closes (dup, dup2, fork and exec share it), and
//! `proc` lists the processes that hold it now, with their real descriptor numbers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use support::{EBUSY, Mounted, mount};

const GPU: &str = "0000:41:00.0";
const NODE: &str = "dev/vfio/21";

/// 2xA10 with the first A10 on vfio-pci: `dev/vfio/21` exists.
fn vfio_node() -> Option<Mounted> {
    let m = mount("2xA10")?;
    m.w(
        &format!("sys/bus/pci/devices/{GPU}/driver_override"),
        "vfio-pci",
    )
    .unwrap();
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    assert!(m.exists(NODE));
    Some(m)
}

/// `proc/<pid>/fd` as node-sim lists it: descriptor → link target. Empty when `proc/<pid>`
/// is absent.
fn fds(m: &Mounted, pid: u32) -> Vec<(String, String)> {
    let Ok(rd) = std::fs::read_dir(m.p(&format!("proc/{pid}/fd"))) else {
        return Vec::new();
    };
    // A descriptor listed and closed before its link is read (another test's thread in this
    // process) is left out, as it would be from a listing taken a moment later.
    let mut v: Vec<(String, String)> = rd
        .filter_map(|e| {
            let e = e.unwrap();
            let target = match std::fs::read_link(e.path()) {
                Ok(t) => t,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => return None,
                Err(err) => panic!("{}: {err}", e.path().display()),
            };
            Some((
                e.file_name().to_string_lossy().into_owned(),
                target.to_string_lossy().into_owned(),
            ))
        })
        .collect();
    v.sort();
    v
}

fn fd(n: &str, target: &str) -> Vec<(String, String)> {
    vec![(n.to_string(), target.to_string())]
}

/// A second open of the node: Ok or the errno.
fn second_open(m: &Mounted, node: &str) -> Result<(), i32> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.p(node))
        .map(drop)
        .map_err(|e| e.raw_os_error().unwrap_or(-1))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether host process `pid` has ended (gone, or a zombie: its files are closed).
fn ended(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("State:") && l.contains('Z'))
        })
        .unwrap_or(true)
}

/// A bash running `script` with `$N` the node's path; it talks in lines: each `echo` of the
/// script is read with [`Shell::line`], each `read -r _` waits for [`Shell::next`].
struct Shell {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Shell {
    fn start(m: &Mounted, node: &str, script: &str) -> Shell {
        let mut child = Command::new("bash")
            .arg("-c")
            .arg(script)
            .env("N", m.p(node))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Shell {
            child,
            stdin,
            stdout,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.stdout.read_line(&mut l).unwrap();
        l.trim_end().to_string()
    }

    /// Lets the script go on past its next `read -r _`, and returns the next line it prints.
    fn next(&mut self) -> String {
        writeln!(self.stdin.as_mut().unwrap()).unwrap();
        self.line()
    }

    /// Ends the script (its last `read -r _` sees end of input) and waits for it.
    fn finish(mut self) {
        drop(self.stdin.take());
        self.child.wait().unwrap();
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_shells_exec_redirection_holds_the_group_until_the_shell_closes_it() {
    let Some(m) = vfio_node() else { return };
    // bash opens the node, dup2s it to 7 and closes the original: the kernel keeps the group
    // held through 7.
    let mut sh = Shell::start(
        &m,
        NODE,
        r#"exec 7<>"$N"; echo held; read -r _; exec 7>&-; echo closed; read -r _"#,
    );
    assert_eq!(sh.line(), "held");
    let pid = sh.pid();
    assert_eq!(fds(&m, pid), fd("7", "/dev/vfio/21"));
    assert_eq!(m.r(&format!("proc/{pid}/comm")), "bash");
    assert_eq!(second_open(&m, NODE), Err(EBUSY));
    // The last close releases it.
    assert_eq!(sh.next(), "closed");
    assert!(!m.exists(&format!("proc/{pid}")));
    assert_eq!(second_open(&m, NODE), Ok(()));
    sh.finish();
}

#[test]
fn a_dup_keeps_the_group_held_after_the_original_is_closed() {
    let Some(m) = vfio_node() else { return };
    let mut sh = Shell::start(
        &m,
        NODE,
        r#"exec 7<>"$N"; exec 8>&7; exec 7>&-; echo dup; read -r _; exec 8>&-; echo closed; read -r _"#,
    );
    assert_eq!(sh.line(), "dup");
    assert_eq!(fds(&m, sh.pid()), fd("8", "/dev/vfio/21"));
    assert_eq!(second_open(&m, NODE), Err(EBUSY));
    assert_eq!(sh.next(), "closed");
    assert!(fds(&m, sh.pid()).is_empty());
    assert_eq!(second_open(&m, NODE), Ok(()));
    sh.finish();

    // The same from this process: a dup (`try_clone`), then the original closed.
    let f = std::fs::File::open(m.p(NODE)).unwrap();
    let copy = f.try_clone().unwrap();
    let me = std::process::id();
    assert_eq!(fds(&m, me).len(), 2, "both descriptors listed");
    drop(f);
    assert_eq!(
        fds(&m, me),
        fd(&copy.as_raw_fd().to_string(), "/dev/vfio/21")
    );
    assert_eq!(second_open(&m, NODE), Err(EBUSY));
    drop(copy);
    assert!(fds(&m, me).is_empty());
    assert_eq!(second_open(&m, NODE), Ok(()));
}

#[test]
fn a_forked_child_holds_the_group_after_its_parent_exits() {
    let Some(m) = vfio_node() else { return };
    // The shell opens the node, starts a child that inherits 7, prints its pid and exits.
    let mut sh = Shell::start(
        &m,
        NODE,
        r#"exec 7<>"$N"; sleep 600 >/dev/null </dev/null & echo $!"#,
    );
    let child: u32 = sh.line().parse().unwrap();
    let parent = sh.pid();
    sh.finish();
    assert_eq!(fds(&m, parent), Vec::new(), "the parent is gone");
    assert_eq!(fds(&m, child), fd("7", "/dev/vfio/21"));
    assert_eq!(m.r(&format!("proc/{child}/comm")), "sleep");
    assert_eq!(
        m.ls("proc")
            .iter()
            .filter(|p| **p == child.to_string())
            .count(),
        1
    );
    assert_eq!(second_open(&m, NODE), Err(EBUSY));
    kill(Pid::from_raw(child as i32), Signal::SIGKILL).unwrap();
    wait_until("the child's end", || ended(child));
    assert!(!m.exists(&format!("proc/{child}")));
    assert_eq!(second_open(&m, NODE), Ok(()));
}

#[test]
fn an_execd_program_holds_the_group_it_inherited() {
    let Some(m) = vfio_node() else { return };
    let mut sh = Shell::start(&m, NODE, r#"exec 7<>"$N"; exec sleep 600"#);
    let pid = sh.pid();
    wait_until("the exec", || {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c == "sleep\n")
    });
    assert_eq!(m.r(&format!("proc/{pid}/comm")), "sleep");
    assert_eq!(fds(&m, pid), fd("7", "/dev/vfio/21"));
    assert_eq!(second_open(&m, NODE), Err(EBUSY));
    sh.child.kill().unwrap();
    sh.child.wait().unwrap();
    assert!(!m.exists(&format!("proc/{pid}")));
    assert_eq!(second_open(&m, NODE), Ok(()));
}

#[test]
fn an_open_survives_a_child_closing_its_copy_and_ends_at_the_holders_close() {
    let Some(m) = mount("2xA10") else { return };
    let me = std::process::id();
    let info = m.r("proc/driver/nvidia/gpus/0000:41:00.0/information");
    assert!(info.contains("Device Minor:"), "{info}");
    let held = std::fs::File::open(m.p("dev/nvidia0")).unwrap();
    let mine = fd(&held.as_raw_fd().to_string(), "/dev/nvidia0");
    assert_eq!(fds(&m, me), mine);
    // A program started now inherits the descriptor and closes it at exec (O_CLOEXEC): the
    // kernel sees a close from the child, but this process still holds the device.
    let st = Command::new("true").status().unwrap();
    assert!(st.success());
    assert_eq!(fds(&m, me), mine, "the holder is still listed");
    drop(held);
    assert!(fds(&m, me).is_empty(), "closed by its holder: gone");
}

#[test]
fn nvidia_and_vfio_cdev_holders_are_the_processes_holding_them_now() {
    let Some(m) = mount("2xA10") else { return };
    let mut sh = Shell::start(
        &m,
        "dev/nvidia1",
        r#"exec 7<>"$N"; exec 9>&7; exec 7>&-; echo held; read -r _; exec 9>&-; echo closed; read -r _"#,
    );
    assert_eq!(sh.line(), "held");
    assert_eq!(fds(&m, sh.pid()), fd("9", "/dev/nvidia1"));
    // Not exclusive: a second opener is listed beside it.
    let other = std::fs::File::open(m.p("dev/nvidia1")).unwrap();
    assert_eq!(
        fds(&m, std::process::id()),
        fd(&other.as_raw_fd().to_string(), "/dev/nvidia1")
    );
    assert_eq!(sh.next(), "closed");
    assert!(fds(&m, sh.pid()).is_empty());
    sh.finish();
    drop(other);

    // A VFIO cdev (iommufd) of a device on vfio-pci.
    let dir = tempfile::tempdir().unwrap();
    let topo = node_sim::Topology::parse(
        "iommufd = true\n[[device]]\naddress = \"0000:41:00.0\"\nmodel = \"A10\"\ndriver = \"vfio-pci\"\ngroup = 21\n",
        "cdev",
    )
    .unwrap();
    let sim = node_sim::mount(&topo, dir.path()).unwrap();
    let cdev = sim.root().join("dev/vfio/devices/vfio0");
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(r#"exec 5<>"$N"; exec sleep 600"#)
        .env("N", &cdev)
        .spawn()
        .unwrap();
    let pid = child.id();
    let link = sim.root().join(format!("proc/{pid}/fd/5"));
    wait_until("the cdev holder", || std::fs::read_link(&link).is_ok());
    assert_eq!(
        std::fs::read_link(&link).unwrap().to_string_lossy(),
        "/dev/vfio/devices/vfio0"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!sim.root().join(format!("proc/{pid}")).exists());
}

#[test]
fn a_holders_link_reads_deleted_once_the_node_is_gone() {
    let Some(m) = vfio_node() else { return };
    let f = std::fs::File::open(m.p(NODE)).unwrap();
    let n = f.as_raw_fd().to_string();
    // Unbinding from vfio-pci while the group is open: the node goes, the holder stays.
    m.w("sys/bus/pci/drivers/vfio-pci/unbind", GPU).unwrap();
    assert!(!m.exists(NODE));
    assert_eq!(
        fds(&m, std::process::id()),
        fd(&n, "/dev/vfio/21 (deleted)")
    );
    drop(f);
    assert!(fds(&m, std::process::id()).is_empty());
}
