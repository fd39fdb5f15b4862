//! What a figure costs beyond its reads however little the daemon did: the cheapest process
//! start, and the registration, first list and health reactions of a bare device plugin, a
//! process of its own (`gpu-vm-bare-plugin`). Both are measured in the same run as the figures
//! they belong to, and added to their limits ([`crate::sections::plain`]).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use testkit::kubelet::api::Device;
use testkit::kubelet::{FakeKubelet, PluginClient};

use super::process::run;
use super::stats::{Summary, summarize};

/// A static x86-64 ELF executable of 129 bytes whose only instructions are `exit(0)`: no
/// dynamic loader, no libc, one page mapped. Its spawn → `waitpid` is the least any process
/// start costs on this machine, measured as the daemons' commands are ([`run`]).
#[cfg(target_arch = "x86_64")]
pub(crate) fn no_op_elf() -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    const HEADERS: u64 = 64 + 56;
    // mov eax, 60 (exit); xor edi, edi; syscall
    const CODE: [u8; 9] = [0xb8, 0x3c, 0, 0, 0, 0x31, 0xff, 0x0f, 0x05];
    let size = HEADERS + CODE.len() as u64;
    let mut e = Vec::with_capacity(size as usize);
    // ELF header: 64-bit, little-endian, version 1, System V.
    e.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&(BASE + HEADERS).to_le_bytes()); // entry
    e.extend_from_slice(&64u64.to_le_bytes()); // program headers
    e.extend_from_slice(&0u64.to_le_bytes()); // no section headers
    e.extend_from_slice(&0u32.to_le_bytes());
    for h in [64u16, 56, 1, 0, 0, 0] {
        e.extend_from_slice(&h.to_le_bytes());
    }
    // One PT_LOAD, read + execute, the whole file at BASE.
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&5u32.to_le_bytes());
    for v in [0, BASE, BASE, size, size, 0x1000] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&CODE);
    e
}

/// A process started and run to its exit, `runs` times: its wall times, and the median of its
/// minor page faults.
#[derive(Clone, Copy, Debug)]
pub struct Started {
    pub time: Summary,
    pub faults: u64,
}

/// The median of page-fault counts (0 for none).
pub fn median_faults(mut faults: Vec<u64>) -> u64 {
    faults.sort_unstable();
    faults.get(faults.len() / 2).copied().unwrap_or(0)
}

/// How many batches [`process_start`] splits its runs into, and the pause between two.
const START_BATCHES: usize = 5;
const START_BATCH_GAP: Duration = Duration::from_millis(100);

/// Spawn → `waitpid` of the no-op executable: `runs` runs after one warm-up, in
/// [`START_BATCHES`] batches [`START_BATCH_GAP`] apart, summed up by the batch with the lowest
/// median ([`quietest`]). A base measured in one burst takes whatever the machine was doing at
/// that moment: a spell of noise (another process, the host's neighbours) raised it threefold
/// and more in runs on a VM, and so lowered every × limit figure beyond it. The quietest batch
/// is the least a start costs here, which errs on the side of a higher × limit. `None` on
/// machines it is not written for.
pub fn process_start(runs: usize) -> Result<Option<Started>> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir()?;
        let exe = dir.path().join("no-op");
        std::fs::write(&exe, no_op_elf())?;
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755))?;
        quietest(&exe, runs)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = runs;
        Ok(None)
    }
}

/// Spawn → `waitpid` of `exe` (no arguments; it must exit 0): `runs` runs after one warm-up, in
/// [`START_BATCHES`] batches [`START_BATCH_GAP`] apart, the batch with the lowest median.
pub fn quietest(exe: &std::path::Path, runs: usize) -> Result<Option<Started>> {
    let once = || -> Result<super::process::Finished> {
        let f = run(&mut std::process::Command::new(exe))?;
        if f.code != 0 {
            return Err(anyhow!("{} exited with {}", exe.display(), f.code));
        }
        Ok(f)
    };
    once()?;
    let batches = START_BATCHES.min(runs.max(1));
    let mut best: Option<Started> = None;
    for b in 0..batches {
        if b > 0 {
            std::thread::sleep(START_BATCH_GAP);
        }
        // The runs shared out, the first batches taking one more when they do not divide.
        let n = runs / batches + usize::from(b < runs % batches);
        let mut walls = Vec::with_capacity(n);
        let mut faults = Vec::with_capacity(n);
        for _ in 0..n {
            let f = once()?;
            walls.push(f.wall);
            faults.push(f.minor_faults);
        }
        let Some(time) = summarize(&walls) else {
            continue;
        };
        if best.is_none_or(|s| time.median < s.time.median) {
            best = Some(Started {
                time,
                faults: median_faults(faults),
            });
        }
    }
    Ok(best)
}

/// What `gpu-vm-bare-plugin` took for each step sandbox-dp's figures end with, medians.
#[derive(Clone, Copy, Debug)]
pub struct BarePlugin {
    /// From its first dial to the kubelet holding every registration.
    pub register: Duration,
    /// Connect, open the stream, the first list.
    pub first: Duration,
    /// Its watched file removed → the first device Unhealthy in ListAndWatch.
    pub unhealthy: Duration,
    /// The file created again → Healthy.
    pub healthy: Duration,
}

/// CLOCK_MONOTONIC now, in nanoseconds: the clock `gpu-vm-bare-plugin` prints its dial on.
fn monotonic_ns() -> Result<i128> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)?;
    Ok(i128::from(t.tv_sec()) * 1_000_000_000 + i128::from(t.tv_nsec()))
}

/// Runs `gpu-vm-bare-plugin` (`bin`) `runs` times after one warm-up, each a fresh process with
/// a fresh test kubelet under `dir` (on the plain tree's tmpfs), in the order and with the
/// same steps between as the daemon's figures ([`crate::sections::plain_dp`]): it registers
/// `resources` resources; a client connects and takes the first list of `devices` devices;
/// the process's memory is sampled; its watched file is removed, then created again. Medians.
pub async fn bare_plugin(
    bin: &Path,
    dir: &Path,
    devices: usize,
    resources: usize,
    runs: usize,
) -> Result<BarePlugin> {
    use std::os::unix::fs::PermissionsExt as _;
    use tokio::io::AsyncBufReadExt as _;
    let (mut reg, mut first, mut down, mut up) = (vec![], vec![], vec![], vec![]);
    let wait = Duration::from_secs(10);
    let vfio = dir.join("vfio");
    std::fs::create_dir_all(&vfio)?;
    let node = vfio.join("100");
    let sock = dir.join("bare-plugin.sock");
    for i in 0..=runs {
        std::fs::write(&node, "")?;
        std::fs::set_permissions(&node, std::fs::Permissions::from_mode(0o600))?;
        let mut kubelet = FakeKubelet::start(&dir.join("kubelet")).await?;
        let mut child = tokio::process::Command::new(bin)
            .arg("--socket")
            .arg(&sock)
            .arg("--watch")
            .arg(&node)
            .args(["--devices", &devices.to_string()])
            .arg("--kubelet")
            .arg(kubelet.socket())
            .args(["--resources", &resources.to_string()])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| anyhow!("no stdout from {}", bin.display()))?;
        let mut line = String::new();
        tokio::time::timeout(wait, tokio::io::BufReader::new(out).read_line(&mut line))
            .await
            .map_err(|_| anyhow!("{} never dialled the kubelet", bin.display()))??;
        let dialled: i128 = line
            .strip_prefix("dial ")
            .and_then(|n| n.trim().parse().ok())
            .ok_or_else(|| anyhow!("{}: expected `dial <ns>`, got {line:?}", bin.display()))?;
        for _ in 0..resources {
            kubelet.next_registration(wait).await?;
        }
        let took = monotonic_ns()? - dialled;
        let t = Instant::now();
        let mut client = PluginClient::connect(&sock).await?;
        let mut lw = client.list_and_watch().await?;
        let got = lw.next(wait).await?;
        let first_list = t.elapsed();
        if got.len() != devices {
            bail!("the bare plugin sent {} devices, not {devices}", got.len());
        }
        let id = got.first().map(|d| d.id.clone()).unwrap_or_default();
        let health = |l: &[Device]| l.iter().find(|d| d.id == id).map(|d| d.health.clone());
        if let Some(pid) = child.id() {
            let _ = super::procstat::sample(pid);
        }
        let t = Instant::now();
        std::fs::remove_file(&node)?;
        lw.wait_until(wait, |l| health(l).as_deref() == Some("Unhealthy"))
            .await?;
        let unhealthy = t.elapsed();
        let t = Instant::now();
        std::fs::write(&node, "")?;
        std::fs::set_permissions(&node, std::fs::Permissions::from_mode(0o600))?;
        lw.wait_until(wait, |l| health(l).as_deref() == Some("Healthy"))
            .await?;
        let healthy = t.elapsed();
        drop((lw, client));
        let _ = child.kill().await;
        kubelet.stop().await;
        // The first run warms the caches, as the daemon's figures come after earlier runs.
        if i > 0 {
            reg.push(Duration::from_nanos(
                u64::try_from(took.max(0)).unwrap_or(0),
            ));
            first.push(first_list);
            down.push(unhealthy);
            up.push(healthy);
        }
    }
    let med = |v: &[Duration]| summarize(v).map(|s| s.median).unwrap_or_default();
    Ok(BarePlugin {
        register: med(&reg),
        first: med(&first),
        unhealthy: med(&down),
        healthy: med(&up),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_no_op_executable_runs_and_exits_zero() {
        let s = process_start(2).unwrap();
        if cfg!(target_arch = "x86_64") {
            // Two runs make two batches of one.
            assert_eq!(s.map(|s| s.time.n), Some(1));
            let s12 = process_start(12).unwrap();
            // Twelve make five batches, of three (the first two) and two: one of them.
            assert!(s12.is_some_and(|s| [2, 3].contains(&s.time.n)), "{s12:?}");
            // Its one page of code faulted in, and little else: counted, and a handful at most.
            assert!(s.is_some_and(|s| (1..16).contains(&s.faults)), "{s:?}");
        }
    }
}
