//! Which devices the pods kubelet runs hold: `List` on kubelet's PodResources socket, or, where
//! nothing answers there, kubelet's device-manager checkpoint.
//!
//! Device IDs are what the device plugin advertised: PCI addresses (passthrough GPUs, SR-IOV
//! vGPU VFs) and mdev UUIDs. They are matched in lower case, whatever resource lists them.
//!
//! The checkpoint (`<kubelet-dir>/kubelet_internal_checkpoint`) is only a fallback: kubelet
//! keeps a deleted pod's entry until it next admits a pod, so a device it lists may be free.
//! When the PodResources API answers, it alone says which pods hold what.
//!
//! `List` also names the ResourceClaims (DRA) each container has: per claim, each allocated
//! device as `<driver>/<pool>/<device>` with the CDI devices the driver answered prepare with.
//! kubelet 1.36 lists a claim from the moment it starts preparing it, with no devices until
//! the driver's prepare returned, and only for the containers whose `resources.claims` name it.
//! Those are kept here with the CDI device IDs that say which device nodes they hold
//! ([`ListedClaim`]); the checkpoint has no claims.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use kubelet_api::podresources::v1::ListPodResourcesRequest;
use kubelet_api::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use serde::Deserialize;

use crate::error::error_chain;
use crate::paths::HostPaths;
use crate::usage::{Claim, Pod, PodSource, Unreadable};

/// Device ID (lower case) → the pods' containers that hold it.
pub(crate) type Allocations = BTreeMap<String, Vec<Pod>>;

/// The largest `List` answer accepted; kubelet's own client allows as much.
const MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// One device of a ResourceClaim a pod's container has, as `List` names it: the pod (with the
/// claim) and the CDI devices the container got for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ListedClaim {
    /// The pod, its container and the claim's device.
    pub pod: Pod,
    /// Fully qualified CDI device names (`gpu.gpu-vm-node.io/vfio=<uid>-gpu-0000-41-00-0`).
    pub cdi_devices: Vec<String>,
}

/// What was learnt about the pods, and from where.
#[derive(Debug)]
pub(crate) struct PodsRead {
    /// The allocations, or why they cannot be known.
    pub allocations: Result<Allocations, Unreadable>,
    /// The claims' devices the pods have (none from the checkpoint).
    pub claims: Vec<ListedClaim>,
    /// Where they come from, for logs and reports.
    pub source: String,
}

/// Reads which devices pods hold: the PodResources API at `paths.pod_resources_socket()`, or
/// kubelet's checkpoint when nothing listens on that socket (kubelet is not running).
pub(crate) fn read(paths: &HostPaths, timeout: Duration) -> PodsRead {
    let socket = paths.pod_resources_socket();
    match list(&socket, timeout) {
        Ok(listed) => PodsRead {
            allocations: Ok(listed.devices),
            claims: listed.claims,
            source: format!("kubelet's PodResources API ({})", socket.display()),
        },
        Err(ListError::Failed(why)) => PodsRead {
            allocations: Err(Unreadable::PodResources {
                socket: socket.clone(),
                reason: why,
            }),
            claims: Vec::new(),
            source: format!("kubelet's PodResources API ({})", socket.display()),
        },
        Err(ListError::Unreachable(why)) => {
            let path = paths.kubelet_checkpoint();
            PodsRead {
                allocations: checkpoint(&path),
                claims: Vec::new(),
                source: format!(
                    "kubelet's checkpoint {} (nothing listens on {}: {why})",
                    path.display(),
                    socket.display()
                ),
            }
        }
    }
}

/// The devices the pods kubelet runs now hold, from `List` on the PodResources socket alone:
/// unlike [`read`], a kubelet that is down is an error here, never its checkpoint (which keeps
/// a deleted pod's entry until kubelet next admits a pod).
pub(crate) fn active(paths: &HostPaths, timeout: Duration) -> Result<Allocations, Unreadable> {
    let socket = paths.pod_resources_socket();
    list(&socket, timeout).map(|l| l.devices).map_err(|e| {
        let reason = match e {
            ListError::Unreachable(w) => format!("nothing listens ({w})"),
            ListError::Failed(w) => w,
        };
        Unreadable::PodResources { socket, reason }
    })
}

/// `List`'s answer: the device plugins' devices and the claims' devices.
#[derive(Debug, Default)]
struct Listed {
    devices: Allocations,
    claims: Vec<ListedClaim>,
}

/// Why `List` gave no answer.
#[derive(Debug)]
enum ListError {
    /// Nothing listens on the socket (no file, or a stale one): kubelet is not running.
    Unreachable(String),
    /// Something is there but did not answer.
    Failed(String),
}

/// `List` on `socket`, blocking for at most about `timeout`. The socket is dialled here
/// (non-blocking): when nothing listens, that is known without a runtime. The client then runs
/// on a runtime of its own, on this thread when it is not a runtime's, otherwise on a thread
/// of its own, so that this may be called from anywhere, async code included.
fn list(socket: &Path, timeout: Duration) -> Result<Listed, ListError> {
    let stream = dial(socket)?;
    let client = move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ListError::Failed(format!("cannot start a runtime: {e}")))?;
        rt.block_on(async {
            let stream = tokio::net::UnixStream::from_std(stream)
                .map_err(|e| ListError::Failed(format!("cannot use the connection: {e}")))?;
            tokio::time::timeout(timeout, list_async(stream))
                .await
                .unwrap_or_else(|_| Err(ListError::Failed(format!("no answer within {timeout:?}"))))
        })
    };
    if tokio::runtime::Handle::try_current().is_err() {
        return client();
    }
    std::thread::scope(|s| {
        let worker = std::thread::Builder::new()
            .name("pod-resources".into())
            .spawn_scoped(s, client)
            .map_err(|e| ListError::Failed(format!("cannot start a thread: {e}")))?;
        worker
            .join()
            .unwrap_or_else(|_| Err(ListError::Failed("the client panicked".into())))
    })
}

/// Connects to `socket` without blocking: a listener whose backlog is full is an error, not a
/// wait.
fn dial(socket: &Path) -> Result<std::os::unix::net::UnixStream, ListError> {
    use nix::errno::Errno;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket as open};
    let failed =
        |e: Errno| ListError::Failed(format!("cannot connect: {}", std::io::Error::from(e)));
    let addr = UnixAddr::new(socket).map_err(failed)?;
    let fd = open(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(failed)?;
    match connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr) {
        Ok(()) => Ok(std::os::unix::net::UnixStream::from(fd)),
        Err(e @ (Errno::ENOENT | Errno::ECONNREFUSED)) => {
            Err(ListError::Unreachable(std::io::Error::from(e).to_string()))
        }
        Err(e) => Err(failed(e)),
    }
}

async fn list_async(stream: tokio::net::UnixStream) -> Result<Listed, ListError> {
    let channel = kubelet_api::channel_over(stream)
        .await
        .map_err(|e| ListError::Failed(error_chain(&e)))?;
    let answer = PodResourcesListerClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .list(ListPodResourcesRequest {})
        .await
        .map_err(|s| ListError::Failed(format!("{} ({:?})", s.message(), s.code())))?
        .into_inner();
    let mut out = Listed::default();
    for p in answer.pod_resources {
        for c in &p.containers {
            let pod = |resource: &str, claim: Option<Claim>| Pod {
                namespace: Some(p.namespace.clone()),
                name: Some(p.name.clone()),
                uid: None,
                container: c.name.clone(),
                resource: resource.to_string(),
                claim,
                source: PodSource::PodResources,
            };
            for d in &c.devices {
                for id in &d.device_ids {
                    out.devices
                        .entry(id.to_ascii_lowercase())
                        .or_default()
                        .push(pod(&d.resource_name, None));
                }
            }
            for dr in &c.dynamic_resources {
                // kubelet 1.36 hands each device of a driver the CDI devices of the devices
                // before it too (one list grows across them): a device's own are those not
                // named before it in this claim. A kubelet that lists them apart reads the same.
                let mut seen = std::collections::BTreeSet::new();
                for r in &dr.claim_resources {
                    let claim = Claim {
                        namespace: dr.claim_namespace.clone(),
                        name: dr.claim_name.clone(),
                        driver: r.driver_name.clone(),
                        pool: r.pool_name.clone(),
                        device: r.device_name.clone(),
                    };
                    let cdi_devices = r
                        .cdi_devices
                        .iter()
                        .filter(|d| seen.insert(d.name.clone()))
                        .map(|d| d.name.clone())
                        .collect();
                    out.claims.push(ListedClaim {
                        pod: pod(&r.driver_name, Some(claim)),
                        cdi_devices,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// kubelet's device-manager checkpoint, as kubelet writes it (`checkpoint.Data`). Its
/// `Checksum` is a hash of Go's printing of `Data`, which cannot be recomputed here: a file
/// that parses is trusted.
#[derive(Debug, Deserialize)]
struct Checkpoint {
    #[serde(rename = "Data")]
    data: CheckpointData,
}

#[derive(Debug, Deserialize)]
struct CheckpointData {
    /// `null` when kubelet has allocated nothing (Go's nil slice).
    #[serde(rename = "PodDeviceEntries")]
    entries: Option<Vec<Entry>>,
}

#[derive(Debug, Deserialize)]
struct Entry {
    #[serde(rename = "PodUID")]
    pod_uid: String,
    #[serde(rename = "ContainerName")]
    container: String,
    #[serde(rename = "ResourceName")]
    resource: String,
    #[serde(rename = "DeviceIDs")]
    device_ids: Option<DeviceIds>,
}

/// `DeviceIDs` in both shapes kubelet has written.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum DeviceIds {
    /// NUMA node → IDs (`{"0": [...]}`; `"-1"` for devices without topology).
    PerNuma(BTreeMap<String, Option<Vec<String>>>),
    /// A plain list (checkpoints from before per-NUMA IDs).
    Plain(Vec<String>),
}

impl DeviceIds {
    fn ids(&self) -> Vec<&str> {
        match self {
            DeviceIds::PerNuma(m) => m.values().flatten().flatten().map(String::as_str).collect(),
            DeviceIds::Plain(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

/// The allocations in the checkpoint at `path`. No file: kubelet has allocated nothing (it has
/// never run, or runs no device plugin). A file that cannot be read or understood (truncated,
/// corrupt) says nothing about which devices are free: that is an error.
fn checkpoint(path: &Path) -> Result<Allocations, Unreadable> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Allocations::new()),
        Err(e) => {
            return Err(Unreadable::CheckpointRead {
                path: path.to_path_buf(),
                reason: e.to_string(),
            });
        }
    };
    let cp: Checkpoint =
        serde_json::from_slice(&text).map_err(|e| Unreadable::CheckpointCorrupt {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    let mut out = Allocations::new();
    for e in cp.data.entries.unwrap_or_default() {
        for id in e
            .device_ids
            .as_ref()
            .map(DeviceIds::ids)
            .unwrap_or_default()
        {
            out.entry(id.to_ascii_lowercase()).or_default().push(Pod {
                namespace: None,
                name: None,
                uid: Some(e.pod_uid.clone()),
                container: e.container.clone(),
                resource: e.resource.clone(),
                claim: None,
                source: PodSource::Checkpoint,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) -> std::path::PathBuf {
        let p = dir.join("kubelet_internal_checkpoint");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn both_device_id_shapes_and_a_plain_list_are_read() {
        let dir = tempfile::tempdir().unwrap();
        // As kubelet writes it: IDs keyed by NUMA node ("-1" without topology), AllocResp as
        // base64, RegisteredDevices, the checksum; null where Go has nil.
        let p = write(
            dir.path(),
            r#"{"Data":{"PodDeviceEntries":[
                {"PodUID":"a1","ContainerName":"compute","ResourceName":"nvidia.com/NVIDIA_A10-4Q",
                 "DeviceIDs":{"0":["5A3B2C1D-0000-4000-8000-00000000ABCD"]},"AllocResp":"CgQKAkFCEgA="},
                {"PodUID":"b2","ContainerName":"compute","ResourceName":"nvidia.com/GA102GL_A10",
                 "DeviceIDs":{"-1":["0000:41:00.0"],"1":null},"AllocResp":null},
                {"PodUID":"c3","ContainerName":"old","ResourceName":"nvidia.com/X",
                 "DeviceIDs":["0000:61:00.4"],"AllocResp":""},
                {"PodUID":"d4","ContainerName":"none","ResourceName":"nvidia.com/X","DeviceIDs":null}
              ],"RegisteredDevices":{"nvidia.com/GA102GL_A10":["0000:41:00.0"]}},
              "Checksum":2939453716}"#,
        );
        let a = checkpoint(&p).unwrap();
        assert_eq!(
            a.keys().collect::<Vec<_>>(),
            vec![
                "0000:41:00.0",
                "0000:61:00.4",
                "5a3b2c1d-0000-4000-8000-00000000abcd"
            ]
        );
        let pod = &a["5a3b2c1d-0000-4000-8000-00000000abcd"][0];
        assert_eq!(pod.uid.as_deref(), Some("a1"));
        assert_eq!(pod.source, PodSource::Checkpoint);
        assert_eq!(
            pod.to_string(),
            "pod a1 (container compute, nvidia.com/NVIDIA_A10-4Q; kubelet's checkpoint)"
        );
        assert_eq!(a["0000:61:00.4"][0].container, "old");
    }

    #[test]
    fn no_checkpoint_is_no_allocation_and_a_broken_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubelet_internal_checkpoint");
        assert!(checkpoint(&path).unwrap().is_empty());
        write(
            dir.path(),
            r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":null},"Checksum":1}"#,
        );
        assert!(checkpoint(&path).unwrap().is_empty());
        for broken in [
            r#"{"Data":{"PodDeviceEntries":[{"PodUID":"a1","Contai"#,
            "",
            r#"{"Checksum":1}"#,
            r#"{"Data":{"PodDeviceEntries":[{"PodUID":"a1"}]}}"#,
        ] {
            write(dir.path(), broken);
            let e = checkpoint(&path).unwrap_err();
            assert!(matches!(e, Unreadable::CheckpointCorrupt { .. }), "{e:?}");
            let e = e.to_string();
            assert!(e.contains("truncated or corrupt"), "{broken}: {e}");
            assert!(e.contains(&path.display().to_string()), "{e}");
        }
    }

    #[test]
    fn a_missing_socket_falls_back_to_the_checkpoint_a_silent_one_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let paths = HostPaths::new(dir.path());
        std::fs::create_dir_all(paths.kubelet_dir()).unwrap();
        write(paths.kubelet_dir(), "{");
        let r = read(&paths, Duration::from_secs(5));
        assert!(r.source.contains("kubelet's checkpoint"), "{}", r.source);
        assert!(
            r.allocations
                .unwrap_err()
                .to_string()
                .contains("truncated or corrupt")
        );

        // A socket file nobody listens on (kubelet killed): refused, so the checkpoint again.
        let sock = paths.pod_resources_socket();
        std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        write(
            paths.kubelet_dir(),
            r#"{"Data":{"PodDeviceEntries":[]},"Checksum":0}"#,
        );
        let r = read(&paths, Duration::from_secs(5));
        assert!(r.source.contains("nothing listens on"), "{}", r.source);
        assert!(r.allocations.unwrap().is_empty());

        // Something listens but never answers: unknown, whatever the checkpoint says.
        std::fs::remove_file(&sock).unwrap();
        let _silent = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let r = read(&paths, Duration::from_millis(300));
        let e = r.allocations.unwrap_err();
        assert!(matches!(e, Unreadable::PodResources { .. }), "{e:?}");
        assert!(e.to_string().contains("does not answer List"), "{e}");
    }
}
