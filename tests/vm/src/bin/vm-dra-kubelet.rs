//! `vm-dra-kubelet`: the test kubelet and API server scenario 5 runs in the VM guest, around
//! sandbox-dra.
//!
//! Starts testkit's fake API server holding one ResourceClaim allocated `--device` (a PCI
//! address; its DRA device name is derived as the driver derives it), starts `--driver`
//! (`sandbox-dra serve`, host root `/`, kubelet root and CDI root under `--scratch`,
//! `--unprepare restore`), registers it as kubelet 1.36 does (the percent-encoded socket path as
//! `:authority`), prepares the claim and checks what a VM's pod would get: the device on
//! vfio-pci, a CDI spec naming the device's real `/dev/vfio/<group>`, which opens, and the
//! device-metadata file with its PCI address; then unprepares it and checks the device is back
//! on the driver it had.
//!
//! With `--mdev-parent NAME` instead of `--device` (scenario 8): starts the driver with
//! `--vgpu NAME`, waits for the parent's devices in its published slices, allocates the claim
//! one of them, prepares it and checks that an mdev of that type exists on the parent, that
//! its real `/dev/vfio/<group>` is in the CDI spec and opens and that the device metadata
//! carries its UUID; then unprepares it and checks the mdev is gone.
//!
//! Prints `PASS <check>` / `FAIL <check>: <detail>` lines on stdout (the VM tier's results
//! format); exit status 0 when every check passed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};
use testkit::apiserver::FakeApiServer;
use testkit::kubelet::dra::{self, Claim, Version};
use vm_tier::Checks;

const DRIVER: &str = "gpu.gpu-vm-node.io";
const NODE: &str = "vm";

#[derive(Debug)]
struct Args {
    driver_bin: PathBuf,
    scratch: PathBuf,
    target: Target,
    log: PathBuf,
}

/// What the claim is allocated.
#[derive(Debug)]
enum Target {
    /// A PCI function, for passthrough.
    Device(String),
    /// A device of this mdev parent (not a PCI function), for an mdev.
    MdevParent(String),
}

fn parse_args() -> anyhow::Result<Args> {
    let mut driver_bin = None;
    let mut scratch = None;
    let mut device = None;
    let mut parent = None;
    let mut log = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let v = it.next().with_context(|| format!("{a} needs a value"))?;
        match a.as_str() {
            "--driver" => driver_bin = Some(PathBuf::from(v)),
            "--scratch" => scratch = Some(PathBuf::from(v)),
            "--device" => device = Some(Target::Device(v)),
            "--mdev-parent" => parent = Some(Target::MdevParent(v)),
            "--log" => log = Some(PathBuf::from(v)),
            other => bail!("unknown argument {other}"),
        }
    }
    match (driver_bin, scratch, device.xor(parent), log) {
        (Some(driver_bin), Some(scratch), Some(target), Some(log)) => Ok(Args {
            driver_bin,
            scratch,
            target,
            log,
        }),
        _ => bail!(
            "usage: vm-dra-kubelet --driver BIN --scratch DIR (--device BDF | --mdev-parent NAME) \
             --log FILE"
        ),
    }
}

fn link_name(p: &Path) -> anyhow::Result<String> {
    let t = std::fs::read_link(p).with_context(|| p.display().to_string())?;
    Ok(t.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default())
}

fn driver_of(bdf: &str) -> String {
    link_name(&Path::new("/sys/bus/pci/devices").join(bdf).join("driver")).unwrap_or_default()
}

fn read_json(p: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(p).with_context(|| p.display().to_string())?;
    serde_json::from_str(&text).with_context(|| p.display().to_string())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(0) => std::process::ExitCode::SUCCESS,
        Ok(_) => std::process::ExitCode::from(1),
        Err(e) => {
            println!(
                "FAIL vm-dra-kubelet: {}",
                format!("{e:#}").replace('\n', " ")
            );
            std::process::ExitCode::from(2)
        }
    }
}

async fn run() -> anyhow::Result<usize> {
    let args = parse_args()?;
    match &args.target {
        Target::Device(bdf) => run_passthrough(&args, bdf).await,
        Target::MdevParent(parent) => run_mdev(&args, parent).await,
    }
}

/// Starts the driver (`extra` before `serve`) against `api`, kubelet root and CDI root under
/// the scratch directory, its log in `--log`.
fn start_driver(args: &Args, api: &FakeApiServer, extra: &[&str]) -> anyhow::Result<Child> {
    Command::new(&args.driver_bin)
        .args(["--host-root", "/", "--node-name", NODE])
        .args(extra)
        .arg("--kubelet-root")
        .arg(args.scratch.join("kubelet"))
        .arg("--cdi-root")
        .arg(args.scratch.join("cdi"))
        .arg("--kubeconfig")
        .arg(api.kubeconfig())
        .arg("serve")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&args.log)?)
        .spawn()
        .context("starting sandbox-dra")
}

/// Waits for the driver's registration socket and registers it as kubelet does.
async fn register(
    child: &mut Child,
    kubelet_root: &Path,
    report: &mut Checks,
) -> anyhow::Result<dra::DraDriver> {
    let start = Instant::now();
    let socks = loop {
        let s = dra::registration_sockets(Path::new("/"), kubelet_root);
        if !s.is_empty() {
            break s;
        }
        if let Some(status) = child.try_wait()? {
            bail!("sandbox-dra exited ({status}) before serving");
        }
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "no registration socket"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let drv = dra::register(Path::new("/"), &socks[0], None).await;
    report.check(
        "registers-through-the-percent-encoded-authority",
        drv.as_ref()
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("{e:#}")),
    );
    drv
}

/// The `/dev/vfio/<g>` nodes of the CDI spec's first device.
fn spec_nodes(spec: &Value) -> Vec<String> {
    spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| n["path"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The attributes of the first device of the metadata file the CDI spec mounts: a stream of
/// `DeviceMetadata` objects, newest API version first (`v1beta1`, then `v1alpha1`), each
/// naming the same device.
fn metadata_attributes(spec: &Value) -> anyhow::Result<Value> {
    let host = spec["devices"][1]["containerEdits"]["mounts"][0]["hostPath"]
        .as_str()
        .context("no metadata mount in the spec")?;
    let text = std::fs::read_to_string(host).with_context(|| format!("reading {host}"))?;
    let objects = serde_json::Deserializer::from_str(&text)
        .into_iter::<Value>()
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{host}: not a stream of JSON objects"))?;
    let versions: Vec<&str> = objects
        .iter()
        .map(|o| o["apiVersion"].as_str().unwrap_or(""))
        .collect();
    ensure!(
        versions
            == [
                "metadata.resource.k8s.io/v1beta1",
                "metadata.resource.k8s.io/v1alpha1"
            ],
        "{host}: API versions {versions:?}"
    );
    let attributes = |o: &Value| o["requests"][0]["devices"][0]["attributes"].clone();
    ensure!(
        attributes(&objects[0]) == attributes(&objects[1]),
        "{host}: its versions name different devices"
    );
    Ok(attributes(&objects[0]))
}

/// Unprepares `c` and checks kubelet is answered without an error.
async fn unprepare_checks(
    drv: &dra::DraDriver,
    c: &Claim,
    report: &mut Checks,
) -> anyhow::Result<()> {
    let un = drv.unprepare(Version::V1, std::slice::from_ref(c)).await?;
    report.check(
        "unprepare-ok",
        match un.first() {
            Some((_, Ok(()))) => Ok(()),
            other => Err(anyhow::anyhow!("{other:?}")),
        },
    );
    Ok(())
}

/// Stops the driver; how many checks failed, or why the run could not go on.
fn stop(mut child: Child, result: anyhow::Result<()>, report: &Checks) -> anyhow::Result<usize> {
    let _ = child.kill();
    let _ = child.wait();
    result?;
    Ok(report.failed)
}

/// Opens `node` read-write, as QEMU does.
fn opens(node: &str) -> anyhow::Result<()> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(node)
        .with_context(|| format!("opening {node}"))?;
    Ok(())
}

/// The UUIDs of the mdevs of `parent`'s type `type_id`.
fn mdevs_of(parent: &str, type_id: &str) -> Vec<String> {
    let dir = Path::new("/sys/class/mdev_bus")
        .join(parent)
        .join("mdev_supported_types")
        .join(type_id)
        .join("devices");
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

async fn run_mdev(args: &Args, parent: &str) -> anyhow::Result<usize> {
    let mut report = Checks::default();
    let api = FakeApiServer::start(NODE, &[])?;
    let kubelet_root = args.scratch.join("kubelet");
    let cdi_root = args.scratch.join("cdi");
    let mut child = start_driver(args, &api, &["--vgpu", parent])?;
    let result = async {
        let drv = register(&mut child, &kubelet_root, &mut report).await?;
        // The parent's devices and, for mtty, its counter set (slices of their own, written
        // one after the other), as the scheduler would see them.
        let start = Instant::now();
        let (device, type_id, counters) = loop {
            let slices = api.slices();
            let found = slices.iter().find_map(|s| {
                s["spec"]["devices"].as_array()?.iter().find_map(|d| {
                    let attrs = &d["attributes"];
                    (attrs["mdevParent"]["string"] == parent)
                        .then(|| {
                            Some((
                                d["name"].as_str()?.to_string(),
                                attrs["typeID"]["string"].as_str()?.to_string(),
                                d["consumesCounters"].clone(),
                            ))
                        })
                        .flatten()
                })
            });
            let set = slices
                .iter()
                .filter_map(|s| s["spec"]["sharedCounters"].as_array().cloned())
                .flatten()
                .find(|c| c["name"] == format!("mdev-{parent}").as_str());
            if let Some((device, type_id, consumes)) = found
                && (set.is_some() || parent != "mtty")
            {
                break (device, type_id, (set, consumes));
            }
            ensure!(
                start.elapsed() < Duration::from_secs(30),
                "no device of {parent} (or its counter set) published in {slices:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        report.check("publishes-the-parents-devices-and-its-ports", {
            let (set, consumes) = &counters;
            let ports = set
                .as_ref()
                .map(|s| s["counters"]["ports"]["value"].clone());
            let takes = &consumes[0]["counters"]["ports"]["value"];
            // The sample driver has 24 ports; mtty-1 takes one, mtty-2 two.
            let want = if type_id == "mtty-2" { "2" } else { "1" };
            if parent != "mtty" || (ports == Some(json!("24")) && *takes == want) {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "{device} ({type_id}) takes {takes} of the counter set {set:?}"
                ))
            }
        });
        let before = mdevs_of(parent, &type_id);
        api.put_claim(json!({
            "metadata": {"namespace": "vms", "name": "vm-mdev", "uid": "uid-mdev"},
            "spec": {"devices": {"requests": [
                {"name": "tty", "exactly": {"deviceClassName": "vgpu.gpu-vm-node.io"}}
            ]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "tty", "driver": DRIVER, "pool": NODE, "device": device}
            ]}}},
        }));
        let c = Claim {
            namespace: "vms".into(),
            name: "vm-mdev".into(),
            uid: "uid-mdev".into(),
        };
        let prepared = drv.prepare(Version::V1, std::slice::from_ref(&c)).await?;
        match prepared.first() {
            Some((_, Ok(d))) if d.len() == 1 && d[0].device_name == device => {}
            other => bail!("prepare of {device}: {other:?}"),
        }
        let made: Vec<String> = mdevs_of(parent, &type_id)
            .into_iter()
            .filter(|u| !before.contains(u))
            .collect();
        report.check(
            "prepare-creates-one-mdev-of-the-type-on-the-parent",
            match &made[..] {
                [_] => Ok(()),
                _ => Err(anyhow::anyhow!("new {type_id} mdevs on {parent}: {made:?}")),
            },
        );
        let uuid = made.first().cloned().unwrap_or_default();
        let group = link_name(
            &Path::new("/sys/bus/mdev/devices")
                .join(&uuid)
                .join("iommu_group"),
        )
        .unwrap_or_default();
        let spec_path = cdi_root.join(format!("{DRIVER}_uid-mdev.json"));
        let spec = read_json(&spec_path);
        report.check("cdi-spec-names-the-mdevs-group-node-which-opens", {
            let node = format!("/dev/vfio/{group}");
            spec.as_ref()
                .map_err(|e| anyhow::anyhow!("{e:#}"))
                .and_then(|s| {
                    let nodes = spec_nodes(s);
                    ensure!(!group.is_empty(), "mdev {uuid:?} has no IOMMU group");
                    ensure!(nodes.contains(&node), "{node} not in {nodes:?}");
                    opens(&node)
                })
        });
        report.check("metadata-has-the-mdev-uuid", {
            spec.as_ref()
                .map_err(|e| anyhow::anyhow!("{e:#}"))
                .and_then(metadata_attributes)
                .and_then(|a| {
                    let id = &a["mdevUUID"]["string"];
                    ensure!(*id == uuid.as_str(), "mdevUUID {id}, made {uuid:?}");
                    Ok(())
                })
        });
        unprepare_checks(&drv, &c, &mut report).await?;
        report.check("unprepare-removes-the-mdev", {
            let dir = Path::new("/sys/bus/mdev/devices").join(&uuid);
            let left = mdevs_of(parent, &type_id);
            if !uuid.is_empty() && !dir.exists() && left == before {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "{parent} {type_id} mdevs: {left:?}, before {before:?}"
                ))
            }
        });
        report.check(
            "unprepare-removes-the-cdi-spec",
            if spec_path.exists() {
                Err(anyhow::anyhow!("{} still there", spec_path.display()))
            } else {
                Ok(())
            },
        );
        Ok(())
    }
    .await;
    stop(child, result, &report)
}

async fn run_passthrough(args: &Args, bdf: &str) -> anyhow::Result<usize> {
    let mut report = Checks::default();
    // 0000:00:02.0 → gpu-0000-00-02-0, as the driver names devices.
    let device_name = format!("gpu-{}", bdf.replace([':', '.'], "-"));
    let group = link_name(
        &Path::new("/sys/bus/pci/devices")
            .join(bdf)
            .join("iommu_group"),
    )?;
    let original = driver_of(bdf);

    let api = FakeApiServer::start(NODE, &[])?;
    api.put_claim(json!({
        "metadata": {"namespace": "vms", "name": "vm-gpu", "uid": "uid-vm"},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "vfio.gpu.gpu-vm-node.io"}}
        ]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device_name}
        ]}}},
    }));
    let kubelet_root = args.scratch.join("kubelet");
    let cdi_root = args.scratch.join("cdi");
    let mut child = start_driver(args, &api, &["--unprepare", "restore"])?;

    let result = async {
        let drv = register(&mut child, &kubelet_root, &mut report).await?;
        let c = Claim {
            namespace: "vms".into(),
            name: "vm-gpu".into(),
            uid: "uid-vm".into(),
        };
        let prepared = drv.prepare(Version::V1, std::slice::from_ref(&c)).await?;
        let devices = match prepared.first() {
            Some((_, Ok(d))) => d.clone(),
            Some((_, Err(e))) => bail!("prepare: {e}"),
            None => bail!("prepare: no answer for the claim"),
        };
        report.check("prepare-answers-the-device", {
            let ok = devices.len() == 1 && devices[0].device_name == device_name;
            if ok {
                Ok(())
            } else {
                Err(anyhow::anyhow!("{devices:?}"))
            }
        });
        report.check("prepare-binds-vfio-pci", {
            let d = driver_of(bdf);
            if d == "vfio-pci" {
                Ok(())
            } else {
                Err(anyhow::anyhow!("{bdf} is on {d:?}"))
            }
        });
        let spec_path = cdi_root.join(format!("{DRIVER}_uid-vm.json"));
        let spec = read_json(&spec_path);
        report.check("cdi-spec-names-the-group-node-which-opens", {
            let node = format!("/dev/vfio/{group}");
            spec.as_ref()
                .map_err(|e| anyhow::anyhow!("{e:#}"))
                .and_then(|s| {
                    let nodes = spec_nodes(s);
                    ensure!(nodes.contains(&node), "{node} not in {nodes:?}");
                    opens(&node)
                })
        });
        report.check("metadata-has-the-pci-bus-id", {
            spec.as_ref()
                .map_err(|e| anyhow::anyhow!("{e:#}"))
                .and_then(metadata_attributes)
                .and_then(|a| {
                    let id = &a["resource.kubernetes.io/pciBusID"]["string"];
                    ensure!(id == bdf, "pciBusID {id}");
                    Ok(())
                })
        });
        unprepare_checks(&drv, &c, &mut report).await?;
        report.check("unprepare-restores-the-original-driver", {
            let d = driver_of(bdf);
            if d == original {
                Ok(())
            } else {
                Err(anyhow::anyhow!("{bdf} is on {d:?}, was on {original:?}"))
            }
        });
        report.check(
            "unprepare-removes-the-cdi-spec",
            if spec_path.exists() {
                Err(anyhow::anyhow!("{} still there", spec_path.display()))
            } else {
                Ok(())
            },
        );
        Ok(())
    }
    .await;
    stop(child, result, &report)
}
