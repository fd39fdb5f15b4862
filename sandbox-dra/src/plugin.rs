//! The `DRAPlugin` service kubelet calls on `<kubelet-root>/plugins/<driver>/dra.sock`, in both
//! versions kubelet may choose (`v1`, `v1beta1`: the same messages), answered by one
//! [`Preparer`].
//!
//! Every claim of a request gets an entry in the response: its devices, or the error that
//! kept it from being prepared (kubelet reports it on the pod and calls again).

use std::collections::HashMap;
use std::sync::Arc;

use kubelet_api::dra::{v1, v1beta1};
use tonic::{Request, Response, Status};

use crate::node::NodeReader;
use crate::prepare::{ClaimRef, PrepareError, PreparedDevice, Preparer};
use crate::telemetry::Telemetry;

/// The `DRAPlugin` service, both versions.
#[derive(Clone, Debug)]
pub struct Plugin {
    preparer: Arc<Preparer>,
    telemetry: Arc<Telemetry>,
    node: NodeReader,
}

impl Plugin {
    /// The service answering with `preparer`, counting in `telemetry`, refusing every claim
    /// while the node's container runtime (read through `node`) ignores CDI.
    pub fn new(preparer: Arc<Preparer>, telemetry: Arc<Telemetry>, node: NodeReader) -> Self {
        Plugin {
            preparer,
            telemetry,
            node,
        }
    }

    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> HashMap<String, Result<Vec<PreparedDevice>, PrepareError>> {
        // The runtime known would have the claims refused: read it again (an upgrade since
        // lifts that). A failed read leaves the last one known.
        if self.node.runtime().refusal().is_some()
            && let Err(e) = self.node.read().await
        {
            tracing::warn!(error = %common::error_chain(&e), "cannot read the node's container runtime; judging by the last one read");
        }
        let mut out = HashMap::new();
        for claim in claims {
            let result = match self.node.runtime().refusal() {
                Some(reason) => Err(PrepareError::Refused {
                    claim: claim.clone(),
                    reason,
                }),
                None => self.preparer.prepare(&claim).await,
            };
            match &result {
                Ok(devices) => {
                    let names: Vec<&str> = devices.iter().map(|d| d.device.as_str()).collect();
                    self.telemetry.prepared(&claim, Ok(&names));
                }
                Err(e) => {
                    let msg = common::error_chain(e);
                    tracing::warn!(claim = %claim, error = %msg, "claim not prepared");
                    self.telemetry.prepared(&claim, Err(&msg));
                }
            }
            out.insert(claim.uid.clone(), result);
        }
        out
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, Result<(), PrepareError>> {
        let mut out = HashMap::new();
        for claim in claims {
            let result = self.preparer.unprepare(&claim).await;
            match &result {
                Ok(()) => self.telemetry.unprepared(Ok(())),
                Err(e) => {
                    let msg = common::error_chain(e);
                    tracing::warn!(claim = %claim, error = %msg, "claim not unprepared");
                    self.telemetry.unprepared(Err(&msg));
                }
            }
            out.insert(claim.uid.clone(), result);
        }
        out
    }
}

/// The request names kubelet matches against its containers' claims: each device's top-level
/// request, a `firstAvailable` subrequest (`gpu/a10`) answered as its request (`gpu`). kubelet
/// hands a container a device's CDI devices only when the container's request is listed; the
/// full name stays in the device metadata file.
fn kubelet_request_names(requests: Vec<String>) -> Vec<String> {
    let mut names: Vec<String> = Vec::with_capacity(requests.len());
    for r in requests {
        let base = match r.split_once('/') {
            Some((base, _)) => base.to_string(),
            None => r,
        };
        if !names.contains(&base) {
            names.push(base);
        }
    }
    names
}

/// Converts one version's messages to and from the shared types.
macro_rules! dra_version {
    ($v:ident) => {
        #[tonic::async_trait]
        impl $v::dra_plugin_server::DraPlugin for Plugin {
            async fn node_prepare_resources(
                &self,
                request: Request<$v::NodePrepareResourcesRequest>,
            ) -> Result<Response<$v::NodePrepareResourcesResponse>, Status> {
                let claims = request.into_inner().claims.into_iter().map(|c| ClaimRef {
                    namespace: c.namespace,
                    name: c.name,
                    uid: c.uid,
                });
                let claims = self
                    .prepare(claims.collect())
                    .await
                    .into_iter()
                    .map(|(uid, result)| {
                        let response = match result {
                            Ok(devices) => $v::NodePrepareResourceResponse {
                                devices: devices
                                    .into_iter()
                                    .map(|d| $v::Device {
                                        request_names: kubelet_request_names(d.requests),
                                        pool_name: d.pool,
                                        device_name: d.device,
                                        cdi_device_ids: d.cdi_ids,
                                        share_id: d.share_id,
                                    })
                                    .collect(),
                                error: String::new(),
                            },
                            Err(e) => $v::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error: common::error_chain(&e),
                            },
                        };
                        (uid, response)
                    })
                    .collect();
                Ok(Response::new($v::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$v::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$v::NodeUnprepareResourcesResponse>, Status> {
                let claims = request.into_inner().claims.into_iter().map(|c| ClaimRef {
                    namespace: c.namespace,
                    name: c.name,
                    uid: c.uid,
                });
                let claims = self
                    .unprepare(claims.collect())
                    .await
                    .into_iter()
                    .map(|(uid, result)| {
                        let error = result
                            .err()
                            .map(|e| common::error_chain(&e))
                            .unwrap_or_default();
                        (uid, $v::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($v::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_version!(v1);
dra_version!(v1beta1);

#[cfg(test)]
mod tests {
    use super::kubelet_request_names;

    #[test]
    fn subrequests_are_answered_as_their_request() {
        let names = |v: &[&str]| kubelet_request_names(v.iter().map(|s| s.to_string()).collect());
        assert_eq!(names(&["gpu/a10"]), ["gpu"]);
        assert_eq!(names(&["gpu/a10", "gpu/t4", "nic"]), ["gpu", "nic"]);
        assert_eq!(names(&["gpu"]), ["gpu"]);
    }
}
