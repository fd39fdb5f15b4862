//! kubelet's gRPC APIs, compiled once from the published protos under `proto/`:
//!
//! - [`deviceplugin::v1beta1`]: `Registration` (kubelet's `kubelet.sock` in the device-plugin
//!   directory) and `DevicePlugin` (each plugin's socket there);
//! - [`podresources::v1`]: `PodResourcesLister` (kubelet's
//!   `<kubelet-root>/pod-resources/kubelet.sock`): which devices the pods kubelet runs hold;
//! - [`dra::v1`] and [`dra::v1beta1`]: `DRAPlugin` (a DRA driver's socket under
//!   `<kubelet-root>/plugins/<driver>/`), `NodePrepareResources` / `NodeUnprepareResources`;
//! - [`dra_health::v1alpha1`]: `DRAResourceHealth` (on the same socket as `DRAPlugin`),
//!   `NodeWatchResources`, the stream of device health kubelet shows in pod status;
//! - [`pluginregistration`]: `Registration` (a plugin's socket in
//!   `<kubelet-root>/plugins_registry/`), how kubelet discovers DRA drivers.
//!
//! Clients and servers are both generated. [`unix_channel`] and [`channel_over`] make a tonic
//! channel over a Unix socket the way kubelet's own clients dial (`:authority` `localhost`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;

/// The device-plugin API.
pub mod deviceplugin {
    /// Version `v1beta1`, the one kubelet serves.
    #[allow(missing_docs, missing_debug_implementations, clippy::all)]
    pub mod v1beta1 {
        tonic::include_proto!("v1beta1");
    }
}

/// The PodResources API.
pub mod podresources {
    /// Version `v1`.
    #[allow(missing_docs, missing_debug_implementations, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}

/// kubelet's DRA plugin API.
pub mod dra {
    /// Version `v1` (Kubernetes 1.34+).
    #[allow(missing_docs, missing_debug_implementations, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// Version `v1beta1` (Kubernetes 1.32+), the same messages.
    #[allow(missing_docs, missing_debug_implementations, clippy::all)]
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

/// kubelet's DRA device-health API.
pub mod dra_health {
    /// Version `v1alpha1`, the one kubelet 1.34-1.36 dials (wire service
    /// `v1alpha1.DRAResourceHealth`).
    #[allow(missing_docs, missing_debug_implementations, clippy::all)]
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");
    }
}

/// kubelet's plugin-registration API (`pluginregistration/v1`; the wire package is
/// `pluginregistration`).
#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// The URI every channel is made with: the connector ignores it, and its host is the
/// `:authority` sent, `localhost`, as gRPC's Go clients (kubelet's) send for a `unix:` target.
const URI: &str = "http://localhost";

/// How long dialling a socket may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A channel to the Unix socket at `path`, dialled again whenever the connection is lost.
pub async fn unix_channel(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    Endpoint::from_static(URI)
        .connect_timeout(CONNECT_TIMEOUT)
        .connect_with_connector(service_fn(move |_: Uri| {
            let p = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?)) }
        }))
        .await
}

/// A channel over one Unix stream the caller has connected (so that it can tell "nothing
/// listens there" from other failures). It does not reconnect: once the stream is closed,
/// calls fail.
pub async fn channel_over(stream: UnixStream) -> Result<Channel, tonic::transport::Error> {
    let slot = Arc::new(Mutex::new(Some(stream)));
    Endpoint::from_static(URI)
        .connect_with_connector(service_fn(move |_: Uri| {
            let stream = slot.lock().ok().and_then(|mut s| s.take());
            async move {
                stream.map(TokioIo::new).ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        "the connection is closed and is not dialled again",
                    )
                })
            }
        }))
        .await
}
