//! kubelet's side of a DRA driver: plugin discovery and the `DRAPlugin` calls, dialled the way
//! kubelet 1.36 dials them.
//!
//! kubelet's plugin watcher finds `<kubelet-root>/plugins_registry/*-reg.sock`, calls
//! `GetInfo` on it and answers with `NotifyRegistrationStatus`; then it dials the endpoint the
//! plugin named and calls `NodePrepareResources` / `NodeUnprepareResources` in the newest
//! version both support. Its gRPC client (grpc-go) sends the socket path, percent-encoded, as
//! `:authority` (`%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fx-reg.sock`), which tonic's
//! client cannot send: every call here goes through [`RawGrpc`] with exactly that header.
//!
//! Paths: kubelet names host paths; a test's host is a directory (`root`), so every host path
//! is reached under it, while the authority carries the host path as kubelet would.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, anyhow, bail};
use kubelet_api::dra::{v1, v1beta1};
use kubelet_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use prost::Message;

use crate::h2raw::{RawGrpc, Reply};

const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";

/// `s` percent-encoded as grpc-go puts a Unix socket path in `:authority`: every byte but
/// letters, digits and `-._~` as `%XX`.
pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// `host` (a host path) under `root`.
fn under(root: &Path, host: &Path) -> PathBuf {
    root.join(host.strip_prefix("/").unwrap_or(host))
}

/// Registration sockets in `<kubelet_root>/plugins_registry/` (a host path, reached under
/// `root`), as host paths, in name order.
pub fn registration_sockets(root: &Path, kubelet_root: &Path) -> Vec<PathBuf> {
    let dir = kubelet_root.join("plugins_registry");
    let Ok(entries) = std::fs::read_dir(under(root, &dir)) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.ends_with("-reg.sock").then(|| dir.join(name))
        })
        .collect();
    out.sort();
    out
}

/// Dials the socket at host path `host` under `root`, with its percent-encoded host path as
/// `:authority`.
pub async fn dial(root: &Path, host: &Path) -> anyhow::Result<RawGrpc> {
    let authority = percent_encode(&host.to_string_lossy());
    let path = under(root, host);
    // A socket file exists from its bind, an instant before it listens: a dial in between is
    // refused. kubelet's plugin watcher tries again; so does this, for up to a second.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        match RawGrpc::connect(&path, Some(&authority)).await {
            Err(e) if refused(&e) && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            other => return other,
        }
    }
}

/// Whether `e` is a connection refused (a socket file nobody listens on yet).
fn refused(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
}

/// One unary call; its answer decoded, or the gRPC status as an error.
async fn call<T: Message + Default>(
    conn: &mut RawGrpc,
    method: &str,
    request: &impl Message,
) -> anyhow::Result<T> {
    let reply: Reply = conn.unary(method, &request.encode_to_vec()).await?;
    if let Some(code) = reply.reset {
        bail!("{method}: the server reset the stream (HTTP/2 error {code})");
    }
    match reply.grpc_status() {
        Some("0") => {}
        other => bail!(
            "{method}: grpc-status {other:?}: {}",
            reply.field("grpc-message").unwrap_or_default()
        ),
    }
    let msg = reply
        .messages
        .first()
        .ok_or_else(|| anyhow!("{method}: no message in the answer"))?;
    T::decode(msg.as_slice()).with_context(|| format!("{method}: decoding the answer"))
}

/// The `DRAPlugin` version kubelet chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    /// `v1.DRAPlugin`.
    V1,
    /// `v1beta1.DRAPlugin`.
    V1beta1,
}

impl Version {
    fn service(self) -> &'static str {
        match self {
            Version::V1 => "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
            Version::V1beta1 => "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
        }
    }
}

/// A registered DRA driver, as kubelet holds it.
#[derive(Debug)]
pub struct DraDriver {
    root: PathBuf,
    /// What the driver said in `GetInfo`.
    pub info: PluginInfo,
    /// The connection every call goes on after [`DraDriver::keep_connection`]; without it,
    /// each call dials its own.
    kept: Option<tokio::sync::Mutex<RawGrpc>>,
}

/// One claim of a prepare or unprepare call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
}

/// A device of a prepared claim, whichever version answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The requests it serves.
    pub request_names: Vec<String>,
    /// Its pool.
    pub pool_name: String,
    /// Its name.
    pub device_name: String,
    /// CDI device ids.
    pub cdi_device_ids: Vec<String>,
    /// The share of a shared device.
    pub share_id: Option<String>,
}

/// Registers the driver whose registration socket is `socket` (a host path under `root`):
/// `GetInfo`, then `NotifyRegistrationStatus` with `error` (`None`: registered). Refuses a
/// plugin that is not a `DRAPlugin`, as kubelet does.
pub async fn register(
    root: &Path,
    socket: &Path,
    error: Option<&str>,
) -> anyhow::Result<DraDriver> {
    let mut conn = dial(root, socket).await?;
    let info: PluginInfo = call(&mut conn, GET_INFO, &InfoRequest {}).await?;
    let refusal = match error {
        Some(e) => Some(e.to_string()),
        None if info.r#type != "DRAPlugin" => Some(format!("unknown plugin type {}", info.r#type)),
        None => None,
    };
    let _: RegistrationStatusResponse = call(
        &mut conn,
        NOTIFY,
        &RegistrationStatus {
            plugin_registered: refusal.is_none(),
            error: refusal.clone().unwrap_or_default(),
        },
    )
    .await?;
    if let Some(e) = refusal {
        bail!("{}: not registered: {e}", socket.display());
    }
    Ok(DraDriver {
        root: root.to_path_buf(),
        info,
        kept: None,
    })
}

impl DraDriver {
    /// Whether the driver offers `version`.
    pub fn supports(&self, version: Version) -> bool {
        let name = match version {
            Version::V1 => "v1.DRAPlugin",
            Version::V1beta1 => "v1beta1.DRAPlugin",
        };
        self.info.supported_versions.iter().any(|v| v == name)
    }

    async fn endpoint(&self) -> anyhow::Result<RawGrpc> {
        dial(&self.root, Path::new(&self.info.endpoint)).await
    }

    /// Dials the driver's endpoint once and makes every later call on that connection, as
    /// kubelet does (one client connection per plugin). A call on a connection the driver
    /// closed fails; it is not dialled again.
    pub async fn keep_connection(&mut self) -> anyhow::Result<()> {
        self.kept = Some(tokio::sync::Mutex::new(self.endpoint().await?));
        Ok(())
    }

    /// The kept connection, or a new one.
    async fn connection(&self) -> anyhow::Result<Conn<'_>> {
        Ok(match &self.kept {
            Some(kept) => Conn::Kept(kept.lock().await),
            None => Conn::Own(Box::new(self.endpoint().await?)),
        })
    }

    /// `NodePrepareResources` for `claims`: each claim's UID → its devices, or the error the
    /// driver gave for it.
    pub async fn prepare(
        &self,
        version: Version,
        claims: &[Claim],
    ) -> anyhow::Result<Vec<(String, Result<Vec<PreparedDevice>, String>)>> {
        let mut conn = self.connection().await?;
        let conn = conn.get();
        let method = format!("{}/NodePrepareResources", version.service());
        let mut out = match version {
            Version::V1 => v1_calls::prepare(conn, &method, claims).await?,
            Version::V1beta1 => v1beta1_calls::prepare(conn, &method, claims).await?,
        };
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// `NodeUnprepareResources` for `claims`: each claim's UID → the driver's error, if any.
    pub async fn unprepare(
        &self,
        version: Version,
        claims: &[Claim],
    ) -> anyhow::Result<Vec<(String, Result<(), String>)>> {
        let mut conn = self.connection().await?;
        let conn = conn.get();
        let method = format!("{}/NodeUnprepareResources", version.service());
        let errors = match version {
            Version::V1 => v1_calls::unprepare(conn, &method, claims).await?,
            Version::V1beta1 => v1beta1_calls::unprepare(conn, &method, claims).await?,
        };
        let mut out: Vec<(String, Result<(), String>)> = errors
            .into_iter()
            .map(|(u, e)| (u, if e.is_empty() { Ok(()) } else { Err(e) }))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

/// A connection for one call: the driver's kept one, or one dialled for it.
enum Conn<'a> {
    Kept(tokio::sync::MutexGuard<'a, RawGrpc>),
    Own(Box<RawGrpc>),
}

impl Conn<'_> {
    fn get(&mut self) -> &mut RawGrpc {
        match self {
            Conn::Kept(c) => c,
            Conn::Own(c) => c,
        }
    }
}

/// The calls in one version's messages (`v1` and `v1beta1` have the same ones).
macro_rules! version_calls {
    ($calls:ident, $v:ident) => {
        mod $calls {
            use super::*;

            fn claims_of(claims: &[Claim]) -> Vec<$v::Claim> {
                claims
                    .iter()
                    .map(|c| $v::Claim {
                        namespace: c.namespace.clone(),
                        name: c.name.clone(),
                        uid: c.uid.clone(),
                    })
                    .collect()
            }

            pub(super) async fn prepare(
                conn: &mut RawGrpc,
                method: &str,
                claims: &[Claim],
            ) -> anyhow::Result<Vec<(String, Result<Vec<PreparedDevice>, String>)>> {
                let req = $v::NodePrepareResourcesRequest {
                    claims: claims_of(claims),
                };
                let resp: $v::NodePrepareResourcesResponse = call(conn, method, &req).await?;
                Ok(resp
                    .claims
                    .into_iter()
                    .map(|(uid, r)| {
                        let res = if r.error.is_empty() {
                            Ok(r.devices
                                .into_iter()
                                .map(|d| PreparedDevice {
                                    request_names: d.request_names,
                                    pool_name: d.pool_name,
                                    device_name: d.device_name,
                                    cdi_device_ids: d.cdi_device_ids,
                                    share_id: d.share_id,
                                })
                                .collect())
                        } else {
                            Err(r.error)
                        };
                        (uid, res)
                    })
                    .collect())
            }

            pub(super) async fn unprepare(
                conn: &mut RawGrpc,
                method: &str,
                claims: &[Claim],
            ) -> anyhow::Result<Vec<(String, String)>> {
                let req = $v::NodeUnprepareResourcesRequest {
                    claims: claims_of(claims),
                };
                let resp: $v::NodeUnprepareResourcesResponse = call(conn, method, &req).await?;
                Ok(resp.claims.into_iter().map(|(u, r)| (u, r.error)).collect())
            }
        }
    };
}

version_calls!(v1_calls, v1);
version_calls!(v1beta1_calls, v1beta1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_paths_are_encoded_as_grpc_go_sends_them() {
        assert_eq!(
            percent_encode("/var/lib/kubelet/plugins_registry/gpu.example.io-reg.sock"),
            "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.example.io-reg.sock"
        );
    }
}
