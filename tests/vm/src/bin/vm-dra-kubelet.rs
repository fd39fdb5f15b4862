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
//! on the driver it had. Prints `PASS <check>` / `FAIL <check>: <detail>` lines on stdout (the
//! VM tier's results format); exit status 0 when every check passed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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
    device: String,
    log: PathBuf,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut driver_bin = None;
    let mut scratch = None;
    let mut device = None;
    let mut log = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let v = it.next().with_context(|| format!("{a} needs a value"))?;
        match a.as_str() {
            "--driver" => driver_bin = Some(PathBuf::from(v)),
            "--scratch" => scratch = Some(PathBuf::from(v)),
            "--device" => device = Some(v),
            "--log" => log = Some(PathBuf::from(v)),
            other => bail!("unknown argument {other}"),
        }
    }
    match (driver_bin, scratch, device, log) {
        (Some(driver_bin), Some(scratch), Some(device), Some(log)) => Ok(Args {
            driver_bin,
            scratch,
            device,
            log,
        }),
        _ => bail!("usage: vm-dra-kubelet --driver BIN --scratch DIR --device BDF --log FILE"),
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
    let mut report = Checks::default();
    let bdf = args.device.as_str();
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
    let mut child = Command::new(&args.driver_bin)
        .args([
            "--host-root",
            "/",
            "--node-name",
            NODE,
            "--unprepare",
            "restore",
        ])
        .arg("--kubelet-root")
        .arg(&kubelet_root)
        .arg("--cdi-root")
        .arg(&cdi_root)
        .arg("--kubeconfig")
        .arg(api.kubeconfig())
        .arg("serve")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&args.log)?)
        .spawn()
        .context("starting sandbox-dra")?;

    let result = async {
        let start = Instant::now();
        let socks = loop {
            let s = dra::registration_sockets(Path::new("/"), &kubelet_root);
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
        let drv = drv?;
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
                    let nodes: Vec<&str> = s["devices"][0]["containerEdits"]["deviceNodes"]
                        .as_array()
                        .map(|a| a.iter().filter_map(|n| n["path"].as_str()).collect())
                        .unwrap_or_default();
                    ensure!(nodes.contains(&node.as_str()), "{node} not in {nodes:?}");
                    std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(&node)
                        .with_context(|| format!("opening {node}"))?;
                    Ok(())
                })
        });
        report.check("metadata-has-the-pci-bus-id", {
            spec.as_ref()
                .map_err(|e| anyhow::anyhow!("{e:#}"))
                .and_then(|s| {
                    let host = s["devices"][1]["containerEdits"]["mounts"][0]["hostPath"]
                        .as_str()
                        .context("no metadata mount in the spec")?;
                    let m = read_json(Path::new(host))?;
                    let id = &m["requests"][0]["devices"][0]["attributes"]
                        ["resource.kubernetes.io/pciBusID"]["string"];
                    ensure!(id == bdf, "pciBusID {id}");
                    Ok(())
                })
        });
        let un = drv.unprepare(Version::V1, std::slice::from_ref(&c)).await?;
        report.check(
            "unprepare-ok",
            match un.first() {
                Some((_, Ok(()))) => Ok(()),
                other => Err(anyhow::anyhow!("{other:?}")),
            },
        );
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
    let _ = child.kill();
    let _ = child.wait();
    result?;
    Ok(report.failed)
}
