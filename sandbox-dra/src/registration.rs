//! kubelet's plugin registration: the socket `<kubelet-root>/plugins_registry/<driver>-reg.sock`
//! that kubelet's plugin watcher finds, asks [`GetInfo`](Registration::get_info) on, and tells
//! the outcome through [`NotifyRegistrationStatus`](Registration::notify_registration_status).
//!
//! kubelet 1.36 dials this socket with the percent-encoded socket path as `:authority`; it is
//! served through `daemon_kit::grpc`, which answers any authority.

use std::path::PathBuf;

use kubelet_api::pluginregistration::registration_server::Registration;
use kubelet_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

/// The plugin type kubelet dispatches DRA drivers by.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// The gRPC services served on the plugin socket, as kubelet names them: the `DRAPlugin`
/// versions newest first (kubelet takes the first it knows), then the device-health service
/// (kubelet 1.36 opens its stream whatever is listed; later kubelets only when it is listed).
pub const SUPPORTED_VERSIONS: [&str; 3] =
    ["v1.DRAPlugin", "v1beta1.DRAPlugin", crate::health::SERVICE];

/// What kubelet last said about the registration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Registered {
    /// kubelet has not said yet.
    #[default]
    Pending,
    /// kubelet registered the driver.
    Yes,
    /// kubelet refused it, with its reason.
    Refused(String),
}

/// The `Registration` service of one driver.
#[derive(Debug)]
pub struct Registrar {
    driver: String,
    endpoint: PathBuf,
    status: watch::Sender<Registered>,
}

impl Registrar {
    /// The service for `driver`, whose `DRAPlugin` socket is `endpoint` (the path kubelet dials,
    /// as the host sees it).
    pub fn new(driver: String, endpoint: PathBuf) -> Self {
        Registrar {
            driver,
            endpoint,
            status: watch::Sender::new(Registered::Pending),
        }
    }

    /// Follows what kubelet says about the registration.
    pub fn subscribe(&self) -> watch::Receiver<Registered> {
        self.status.subscribe()
    }
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        tracing::debug!(driver = %self.driver, "kubelet asked for the plugin's info");
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_string(),
            name: self.driver.clone(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let s = request.into_inner();
        let now = if s.plugin_registered {
            tracing::info!(driver = %self.driver, "kubelet registered the driver");
            Registered::Yes
        } else {
            tracing::error!(driver = %self.driver, error = %s.error, "kubelet refused to register the driver");
            Registered::Refused(s.error)
        };
        self.status.send_replace(now);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
