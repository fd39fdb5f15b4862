//! The VM tier's boot harness.
//!
//! A scenario is a shell script under `tests/vm/scenarios/`. [`run`] boots the cached kernel
//! (built by `tests/vm/prepare.sh`) under QEMU with emulated PCI devices (`VGA`, `bochs-display`,
//! `edu`) behind an emulated Intel IOMMU; the guest's init loads vfio, vfio-pci, mdev and the
//! kernel's sample mdev drivers, mounts the host's `/` read-only over 9p, chroots into it and runs
//! the scenario with `tests/vm/guest/lib.sh` sourced. The scenario reports each check as a line
//! `PASS <check>` or `FAIL <check>: <detail>` in a results directory that is shared writable with
//! the guest at its host path. [`Outcome::assert_all_passed`] prints every check and fails the
//! test on any failure, with the tail of the guest's console.
//!
//! [`prerequisites`] finds QEMU and the assets; [`require_or_skip`] turns a missing prerequisite
//! into a visible skip, or into a failure when `VM_TIER=required`.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failures of the harness itself (not of a scenario's checks).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or directory of the harness could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// QEMU or cargo could not be started.
    #[error("cannot start {program}: {source}")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A path QEMU's option parser cannot take.
    #[error("{0}: QEMU options cannot carry a path with a comma")]
    Comma(PathBuf),
    /// Building a binary the scenario runs failed.
    #[error("cargo build -p {package} failed:\n{output}")]
    Build {
        /// The package.
        package: String,
        /// The tail of cargo's output.
        output: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The checks an in-guest test tool (`vm-kubelet`, `vm-dra-kubelet`) makes, each printed on
/// stdout as the scenarios' results lines: `PASS <check>` or `FAIL <check>: <detail>`.
#[derive(Debug, Default)]
pub struct Checks {
    /// How many failed.
    pub failed: usize,
}

impl Checks {
    /// Prints one check's line.
    pub fn check(&mut self, name: &str, result: anyhow::Result<()>) {
        match result {
            Ok(()) => println!("PASS {name}"),
            Err(e) => {
                self.failed += 1;
                let detail = format!("{e:#}").replace('\n', " ");
                println!("FAIL {name}: {detail}");
            }
        }
    }
}

/// What [`run`] needs from the machine: QEMU and the cached kernel assets.
#[derive(Debug, Clone)]
pub struct Prereqs {
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// The kernel image.
    pub kernel: PathBuf,
    /// The initramfs with busybox, the guest init and the modules.
    pub initrd: PathBuf,
    /// The kernel release, e.g. `6.1.0-56-amd64`.
    pub release: String,
}

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(Path::parent)
        .map_or_else(|| manifest.to_path_buf(), Path::to_path_buf)
}

/// The cargo target directory (`CARGO_TARGET_DIR`, or `target/` in the repository).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                repo_root().join(dir)
            }
        }
        None => repo_root().join("target"),
    }
}

/// The directory holding the workspace's binaries for the profile this test was built with
/// (`target/debug` for `cargo test`).
pub fn bin_dir() -> PathBuf {
    // The test executable lives in <target>/<profile>/deps/.
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent()?.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| target_dir().join("debug"))
}

/// The asset cache: `VM_ASSETS`, or `target/vm-assets` (what `prepare.sh` writes by default).
pub fn assets_dir() -> PathBuf {
    std::env::var_os("VM_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target").join("vm-assets"))
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Finds QEMU and the assets; the error says what is missing.
pub fn prerequisites() -> Result<Prereqs, String> {
    let qemu = find_in_path("qemu-system-x86_64")
        .ok_or_else(|| "qemu-system-x86_64 not found in PATH".to_string())?;
    let dir = assets_dir();
    let env_file = dir.join("assets.env");
    let text = fs::read_to_string(&env_file)
        .map_err(|e| format!("no kernel assets: {}: {e}", env_file.display()))?;
    if !dir.join("stamp").is_file() {
        return Err(format!(
            "kernel assets in {} are incomplete (no stamp)",
            dir.display()
        ));
    }
    // The stamp records the hash of the guest init baked into the initramfs.
    let stamp = fs::read_to_string(dir.join("stamp")).unwrap_or_default();
    let init = repo_root().join("tests/vm/guest/init");
    if let Ok(out) = Command::new("sha256sum").arg(&init).output()
        && out.status.success()
    {
        let text = String::from_utf8_lossy(&out.stdout);
        let hash = text.split_whitespace().next().unwrap_or_default();
        if !stamp.lines().any(|l| l == format!("init={hash}")) {
            return Err(format!(
                "kernel assets in {} are stale: {} changed since they were built",
                dir.display(),
                init.display()
            ));
        }
    }
    let vars: BTreeMap<&str, &str> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim(), v.trim()))
        .collect();
    let kernel = dir.join("vmlinuz");
    let initrd = dir.join("initramfs.cpio.gz");
    for f in [&kernel, &initrd] {
        if !f.is_file() {
            return Err(format!("kernel asset {} missing", f.display()));
        }
    }
    Ok(Prereqs {
        qemu,
        kernel,
        initrd,
        release: vars.get("KERNEL_RELEASE").unwrap_or(&"unknown").to_string(),
    })
}

/// True when `VM_TIER=required`: a missing prerequisite fails instead of skipping.
pub fn required() -> bool {
    std::env::var("VM_TIER").is_ok_and(|v| v == "required")
}

/// Reports a prerequisite that is missing: prints
/// `skipped: VM tier: <why> (run tests/vm/prepare.sh)` and returns, or panics when
/// `VM_TIER=required`.
pub fn skip(why: &str) {
    let line = format!("skipped: VM tier: {why} (run tests/vm/prepare.sh)");
    if required() {
        panic!("VM_TIER=required but {line}");
    }
    println!("{line}");
    visible(&line);
}

/// Writes a line to stderr past the test harness's output capture, so a skip or a summary shows
/// in a plain `cargo test` run.
pub fn visible(line: &str) {
    use std::io::Write;
    let _ = writeln!(io::stderr(), "{line}");
}

/// [`prerequisites`], or `None` after [`skip`] said why.
pub fn require_or_skip() -> Option<Prereqs> {
    match prerequisites() {
        Ok(p) => Some(p),
        Err(why) => {
            skip(&why);
            None
        }
    }
}

/// One check a scenario reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// `PASS <name>`.
    Pass(String),
    /// `FAIL <name>: <detail>`.
    Fail(String, String),
}

impl Check {
    /// The check's name.
    pub fn name(&self) -> &str {
        match self {
            Check::Pass(n) | Check::Fail(n, _) => n,
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Check::Pass(n) => write!(f, "PASS {n}"),
            Check::Fail(n, d) => write!(f, "FAIL {n}: {d}"),
        }
    }
}

/// Parses the results file: `PASS <name>` / `FAIL <name>: <detail>` lines; other lines are
/// reported as failures so a scenario cannot hide output there.
pub fn parse_results(text: &str) -> Vec<Check> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            if let Some(name) = l.strip_prefix("PASS ") {
                Check::Pass(name.trim().to_string())
            } else if let Some(rest) = l.strip_prefix("FAIL ") {
                match rest.split_once(": ") {
                    Some((n, d)) => Check::Fail(n.trim().to_string(), d.to_string()),
                    None => Check::Fail(rest.trim().to_string(), String::new()),
                }
            } else {
                Check::Fail("results".into(), format!("unparsable line {l:?}"))
            }
        })
        .collect()
}

/// A scenario to run in one boot.
#[derive(Debug, Clone)]
pub struct Job {
    /// Short name; the run directory is `target/vm-runs/<name>`.
    pub name: String,
    /// The scenario script (host path), run with bash in the guest.
    pub script: PathBuf,
    /// Extra environment for the script.
    pub env: Vec<(String, String)>,
    /// The whole boot-run-poweroff cycle is killed after this long.
    pub timeout: Duration,
}

impl Job {
    /// A job for `tests/vm/scenarios/<file>` with a 180 s limit.
    pub fn scenario(name: &str, file: &str) -> Job {
        Job {
            name: name.to_string(),
            script: repo_root().join("tests/vm/scenarios").join(file),
            env: Vec::new(),
            timeout: Duration::from_secs(180),
        }
    }

    /// Adds an environment variable for the script.
    pub fn env(mut self, key: &str, value: impl Into<String>) -> Job {
        self.env.push((key.to_string(), value.into()));
        self
    }
}

/// What one boot produced.
#[derive(Debug)]
pub struct Outcome {
    /// The job's name.
    pub name: String,
    /// The scenario's checks, in order.
    pub checks: Vec<Check>,
    /// The job's exit status as the guest init recorded it (`None`: the guest never got there).
    pub status: Option<String>,
    /// The serial console log.
    pub console: String,
    /// The run directory (results share) on the host.
    pub run_dir: PathBuf,
    /// Whether QEMU had to be killed at the time limit.
    pub timed_out: bool,
    /// How long the cycle took.
    pub elapsed: Duration,
}

impl Outcome {
    /// The last `n` lines of the console.
    pub fn console_tail(&self, n: usize) -> String {
        let lines: Vec<&str> = self.console.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// A file the scenario wrote into its results directory.
    pub fn file(&self, name: &str) -> Result<String, Error> {
        let path = self.run_dir.join(name);
        fs::read_to_string(&path).map_err(io_err(&path))
    }

    /// Prints every check; panics if any failed, none were reported, the guest timed out or the
    /// job did not exit 0.
    pub fn assert_all_passed(&self) {
        let passed = self
            .checks
            .iter()
            .filter(|c| matches!(c, Check::Pass(_)))
            .count();
        visible(&format!(
            "VM tier: {}: {passed}/{} checks passed in {:.1} s",
            self.name,
            self.checks.len(),
            self.elapsed.as_secs_f64()
        ));
        println!(
            "VM tier: {} checks in {:.1} s ({})",
            self.checks.len(),
            self.elapsed.as_secs_f64(),
            self.run_dir.display()
        );
        for c in &self.checks {
            println!("  {c}");
        }
        let failed: Vec<String> = self
            .checks
            .iter()
            .filter(|c| matches!(c, Check::Fail(..)))
            .map(ToString::to_string)
            .collect();
        let mut problems = Vec::new();
        if self.timed_out {
            problems.push("the guest did not power off in time and was killed".to_string());
        }
        match self.status.as_deref() {
            Some("exit 0") => {}
            Some(s) => problems.push(format!("scenario ended with {s}")),
            None => problems.push("the guest never recorded the scenario's status".to_string()),
        }
        if self.checks.is_empty() {
            problems.push("the scenario reported no checks".to_string());
        }
        if !failed.is_empty() {
            problems.push(format!("failed checks:\n  {}", failed.join("\n  ")));
        }
        if !problems.is_empty() {
            panic!(
                "VM tier: {}\n--- console (last 40 lines) ---\n{}",
                problems.join("\n"),
                self.console_tail(40)
            );
        }
    }
}

/// Boots are serialised: two TCG guests on a 2-core machine only slow each other down.
static BOOT_LOCK: Mutex<()> = Mutex::new(());

fn real_kvm() -> bool {
    // A stock kernel does not boot under PVM (`kvm_pvm`); only Intel/AMD KVM is used.
    let forced = std::env::var("VM_TIER_ACCEL").ok();
    match forced.as_deref() {
        Some("tcg") => return false,
        Some("kvm") => return true,
        _ => {}
    }
    (Path::new("/sys/module/kvm_intel").exists() || Path::new("/sys/module/kvm_amd").exists())
        && fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok()
}

fn no_comma(p: &Path) -> Result<String, Error> {
    let s = p.display().to_string();
    if s.contains(',') {
        return Err(Error::Comma(p.to_path_buf()));
    }
    Ok(s)
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The QEMU command line for one boot with `run_dir` as the results share.
pub fn qemu_command(p: &Prereqs, run_dir: &Path) -> Result<Command, Error> {
    let run = no_comma(run_dir)?;
    let mut cmd = Command::new(&p.qemu);
    if real_kvm() {
        cmd.args([
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-machine",
            "q35,kernel-irqchip=split",
        ]);
    } else {
        cmd.args(["-accel", "tcg", "-cpu", "max", "-machine", "q35"]);
    }
    cmd.args(["-smp", "2", "-m", "1024"])
        .args(["-device", "intel-iommu,intremap=on"])
        .args(["-nographic", "-no-reboot", "-nic", "none"])
        .arg("-kernel")
        .arg(&p.kernel)
        .arg("-initrd")
        .arg(&p.initrd)
        .arg("-append")
        // no_timer_check: under TCG on a loaded machine the kernel's early check that the timer
        // interrupt arrives through the remapped IO-APIC can time out, and it panics
        // ("timer doesn't work through Interrupt-remapped IO-APIC") before the guest runs.
        .arg(format!(
            "console=ttyS0 intel_iommu=on no_timer_check panic=-1 quiet vmtier.results={run}"
        ))
        // Fixed slots, so scenarios and the node-sim topology can name the devices.
        .args([
            "-device",
            "VGA,addr=02.0",
            "-device",
            "bochs-display,addr=03.0",
        ])
        .args(["-device", "edu,addr=04.0"])
        .args([
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        ])
        .arg("-virtfs")
        .arg(format!(
            "local,path={run},mount_tag=results,security_model=none,multidevs=remap"
        ));
    Ok(cmd)
}

/// Boots the guest once, runs `job` in it and collects the outcome. A guest that outlives
/// `job.timeout` is killed (the outcome says so).
pub fn run(p: &Prereqs, job: &Job) -> Result<Outcome, Error> {
    let _guard = BOOT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let run_dir = target_dir().join("vm-runs").join(&job.name);
    if run_dir.exists() {
        fs::remove_dir_all(&run_dir).map_err(io_err(&run_dir))?;
    }
    fs::create_dir_all(&run_dir).map_err(io_err(&run_dir))?;

    let repo = repo_root();
    let mut job_sh = String::from("# written by the vm-tier harness\nset -u\n");
    let mut vars = vec![
        ("VMTIER_RESULTS".to_string(), run_dir.display().to_string()),
        ("VMTIER_REPO".to_string(), repo.display().to_string()),
        ("VMTIER_BIN".to_string(), bin_dir().display().to_string()),
        ("VMTIER_KERNEL".to_string(), p.release.clone()),
        (
            "PATH".to_string(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        ),
        // A tmpfs in the guest (the guest init mounts one on /run): sockets work there.
        ("VMTIER_SCRATCH".to_string(), "/run/vmtier".to_string()),
        ("HOME".to_string(), "/run/vmtier".to_string()),
        // Temporary files too: the guest's /tmp is the host's, read-only, when the checkout
        // lives under /tmp.
        ("TMPDIR".to_string(), "/run/vmtier".to_string()),
    ];
    vars.extend(job.env.iter().cloned());
    for (k, v) in &vars {
        job_sh.push_str(&format!("export {k}={}\n", shell_quote(v)));
    }
    job_sh.push_str(&format!(
        "mkdir -p \"$VMTIER_SCRATCH\"\n: >\"$VMTIER_RESULTS/results\"\nexec /bin/bash -c '. \"$VMTIER_REPO/tests/vm/guest/lib.sh\" && . \"$0\"' {} >\"$VMTIER_RESULTS/output\" 2>&1\n",
        shell_quote(&job.script.display().to_string())
    ));
    let job_path = run_dir.join("job.sh");
    fs::write(&job_path, job_sh).map_err(io_err(&job_path))?;

    let console_path = run_dir.join("console.log");
    let console = fs::File::create(&console_path).map_err(io_err(&console_path))?;
    let console_err = console.try_clone().map_err(io_err(&console_path))?;
    let mut cmd = qemu_command(p, &run_dir)?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(console))
        .stderr(Stdio::from(console_err));
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|source| Error::Spawn {
        program: p.qemu.clone(),
        source,
    })?;
    let mut timed_out = false;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if started.elapsed() >= job.timeout => {
                timed_out = true;
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(source) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Io {
                    path: p.qemu.clone(),
                    source,
                });
            }
        }
    }
    let elapsed = started.elapsed();
    let read = |name: &str| fs::read_to_string(run_dir.join(name)).ok();
    let mut console =
        String::from_utf8_lossy(&fs::read(&console_path).unwrap_or_default()).replace('\r', "");
    if let Some(out) = read("output") {
        console.push_str("\n--- scenario output ---\n");
        console.push_str(&out);
    }
    Ok(Outcome {
        name: job.name.clone(),
        checks: read("results")
            .map(|t| parse_results(&t))
            .unwrap_or_default(),
        status: read("status").map(|s| s.trim().to_string()),
        console,
        run_dir,
        timed_out,
        elapsed,
    })
}

/// Builds `package`'s binaries with the cargo running the tests (a no-op when they are current)
/// and returns the directory holding them.
pub fn build_binaries(package: &str) -> Result<PathBuf, Error> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(&cargo)
        .args(["build", "--quiet", "-p", package, "--bins"])
        .current_dir(repo_root())
        .output()
        .map_err(|source| Error::Spawn {
            program: PathBuf::from(&cargo),
            source,
        })?;
    if !out.status.success() {
        let text = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = text.lines().collect();
        return Err(Error::Build {
            package: package.to_string(),
            output: lines[lines.len().saturating_sub(30)..].join("\n"),
        });
    }
    Ok(bin_dir())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_lines_parse() {
        let checks = parse_results("PASS a\nFAIL b: got 1, want 2\n\nnoise\n");
        assert_eq!(
            checks,
            vec![
                Check::Pass("a".into()),
                Check::Fail("b".into(), "got 1, want 2".into()),
                Check::Fail("results".into(), "unparsable line \"noise\"".into()),
            ]
        );
    }

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(shell_quote("a'b"), "'a'\\''b'");
    }
}
