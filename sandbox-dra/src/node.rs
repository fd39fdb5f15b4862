//! The driver's own Node, read (one GET) when what it says matters, never watched. The driver
//! needs two things from it, and both change rarely:
//!
//! - its UID, which the slices' owner reference names (so that the garbage collector deletes
//!   them with the Node): it changes only when the Node is deleted and registered again, and
//!   then the garbage collector deletes the slices the old UID owns;
//! - its container runtime (`status.nodeInfo.containerRuntimeVersion`), which
//!   [`crate::runtime`] judges: it changes when the node's runtime is upgraded.
//!
//! So the publisher reads it at start and when its watch of the node's slices shows what a new
//! UID brings (a slice another client deleted: the garbage collector, or kubelet's wipe when it
//! starts; a slice owned by another UID; the slices listed anew), and prepare reads it before it
//! refuses a claim for the runtime last read ([`RuntimeCheck::refusal`]): an upgrade since lifts
//! the refusal. Each read records the runtime, and says so when it changed
//! ([`Telemetry::runtime`]).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;

use crate::runtime::RuntimeCheck;
use crate::telemetry::Telemetry;

/// What the driver takes from its Node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// The UID the slices' owner reference names.
    pub uid: Option<String>,
    /// `status.nodeInfo.containerRuntimeVersion`; empty until kubelet reports it.
    pub runtime: String,
}

impl NodeFacts {
    /// What `node` says.
    pub fn of(node: &Node) -> NodeFacts {
        let runtime = node
            .status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .map(|i| i.container_runtime_version.clone())
            .unwrap_or_default();
        NodeFacts {
            uid: node.metadata.uid.clone(),
            runtime,
        }
    }
}

/// Why the Node could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server has no such Node.
    #[error("Node {node} is not in the API server (the node's slices name it as their owner)")]
    Missing { node: String },
    /// The read failed.
    #[error("cannot read Node {node}")]
    Api {
        node: String,
        #[source]
        source: kube::Error,
    },
    /// No answer in time.
    #[error("the API server did not answer the read of Node {node} within {after:?}")]
    Timeout { node: String, after: Duration },
}

impl Error {
    /// Whether the API server answered (no such Node, a refusal): asking again at once would
    /// get the same answer.
    pub fn answered(&self) -> bool {
        match self {
            Error::Missing { .. } => true,
            Error::Api { source, .. } => matches!(source, kube::Error::Api(_)),
            Error::Timeout { .. } => false,
        }
    }
}

/// Reads the Node; see the [module](self).
#[derive(Clone, Debug)]
pub struct NodeReader {
    nodes: Api<Node>,
    name: String,
    timeout: Duration,
    runtime: Arc<RuntimeCheck>,
    telemetry: Arc<Telemetry>,
}

impl NodeReader {
    /// Reads Node `name` through `client`, each read bounded by `timeout`; the runtime it
    /// reports goes to `runtime`, and a change of it to `telemetry`.
    pub fn new(
        client: kube::Client,
        name: &str,
        timeout: Duration,
        runtime: Arc<RuntimeCheck>,
        telemetry: Arc<Telemetry>,
    ) -> NodeReader {
        NodeReader {
            nodes: Api::all(client),
            name: name.to_string(),
            timeout,
            runtime,
            telemetry,
        }
    }

    /// The Node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The runtime check the reads feed.
    pub fn runtime(&self) -> &RuntimeCheck {
        &self.runtime
    }

    /// Reads the Node; records the container runtime it reports (told when it changed).
    pub async fn read(&self) -> Result<NodeFacts, Error> {
        let got = tokio::time::timeout(self.timeout, self.nodes.get_opt(&self.name))
            .await
            .map_err(|_| Error::Timeout {
                node: self.name.clone(),
                after: self.timeout,
            })?;
        let node = match got {
            Ok(Some(node)) => node,
            Ok(None) => {
                return Err(Error::Missing {
                    node: self.name.clone(),
                });
            }
            Err(source) => {
                return Err(Error::Api {
                    node: self.name.clone(),
                    source,
                });
            }
        };
        let facts = NodeFacts::of(&node);
        tracing::debug!(node = %self.name, uid = ?facts.uid, runtime = %facts.runtime, "read the Node");
        if !facts.runtime.is_empty()
            && let Some(cdi) = self.runtime.observe(&facts.runtime)
        {
            self.telemetry.runtime(&cdi);
        }
        Ok(facts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_gives_its_uid_and_runtime() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-a", "uid": "u1"},
            "status": {"nodeInfo": {
                "containerRuntimeVersion": "containerd://2.1.0",
                "architecture": "", "bootID": "", "kernelVersion": "", "kubeProxyVersion": "",
                "kubeletVersion": "", "machineID": "", "operatingSystem": "", "osImage": "",
                "systemUUID": ""
            }}
        }))
        .unwrap();
        assert_eq!(
            NodeFacts::of(&node),
            NodeFacts {
                uid: Some("u1".into()),
                runtime: "containerd://2.1.0".into()
            }
        );
        let bare: Node =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "node-a"}})).unwrap();
        assert_eq!(NodeFacts::of(&bare), NodeFacts::default());
    }

    #[test]
    fn no_such_node_and_a_refusal_are_answers_a_timeout_is_not() {
        let node = "node-a".to_string();
        assert!(Error::Missing { node: node.clone() }.answered());
        let forbidden = kube::Error::Api(
            kube::core::Status::failure("forbidden", "Forbidden")
                .with_code(403)
                .boxed(),
        );
        assert!(
            Error::Api {
                node: node.clone(),
                source: forbidden
            }
            .answered()
        );
        assert!(
            !Error::Timeout {
                node,
                after: Duration::from_secs(1)
            }
            .answered()
        );
    }
}
