//! Kubernetes Events (`events.k8s.io/v1`) on this node's Node object: every change a daemon
//! makes and every refusal, for `kubectl describe node` and `kubectl events`.
//!
//! Best effort: events are sent in order by a task of their own, and one the API server
//! refuses (a network error) is logged and dropped; the daemon never waits for one. When RBAC
//! forbids Events (403: a service account whose roles do not grant them, as the GPU Operator's
//! do not), that is said once, with what to grant, and Events are dropped unsent, one tried
//! again every [`FORBIDDEN_RETRY`] in case the grant came since.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;

/// How long Events are dropped unsent after the API server forbade one.
pub const FORBIDDEN_RETRY: std::time::Duration = std::time::Duration::from_secs(600);

/// Where a daemon sends its Node events; [`NodeEvents::disabled`] without Kubernetes.
#[derive(Clone, Debug)]
pub struct NodeEvents {
    tx: Option<mpsc::UnboundedSender<Event>>,
}

impl NodeEvents {
    /// Events go nowhere.
    pub fn disabled() -> NodeEvents {
        NodeEvents { tx: None }
    }

    /// Sends events about Node `node` as `controller` (`gpu-vm-node/<daemon>`). Call inside a
    /// tokio runtime: the sending task runs on it until every clone is dropped.
    pub fn start(client: kube::Client, node: &str, daemon: &str) -> NodeEvents {
        let controller = format!("gpu-vm-node/{daemon}");
        let reporter = Reporter {
            controller: controller.clone(),
            instance: Some(format!("{daemon}-{node}")),
        };
        let recorder = Recorder::new(client, reporter);
        // Like kubelet's: a Node's events name it by name, also as its UID, in "default".
        let regarding = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.to_string()),
            uid: Some(node.to_string()),
            ..Default::default()
        };
        let (tx, mut rx) = mpsc::unbounded_channel::<Event>();
        let node = node.to_string();
        tokio::spawn(async move {
            // After a 403, Events are dropped until this instant, then one is tried again (RBAC
            // may have been granted since); the refusal is logged the first time only.
            let mut forbidden_until: Option<tokio::time::Instant> = None;
            let mut told = false;
            while let Some(ev) = rx.recv().await {
                if forbidden_until.is_some_and(|t| tokio::time::Instant::now() < t) {
                    continue;
                }
                match recorder.publish(&ev, &regarding).await {
                    Ok(()) => {
                        if forbidden_until.take().is_some() {
                            tracing::info!(node, "Events are allowed again: recording them");
                        }
                    }
                    Err(kube::Error::Api(ae)) if ae.code == 403 => {
                        if !told {
                            tracing::warn!(
                                node,
                                reason = ev.reason,
                                error = %ae.message,
                                "Events are forbidden to this daemon's service account: none are recorded \
                                 (grant create and patch on events, in events.k8s.io and the core group; under \
                                 the GPU Operator: deploy/operator/events-rbac.yaml); trying again every 10 minutes"
                            );
                            told = true;
                        }
                        forbidden_until = Some(tokio::time::Instant::now() + FORBIDDEN_RETRY);
                    }
                    Err(e) => {
                        tracing::warn!(node, reason = ev.reason, error = %e, "cannot record an event on the node")
                    }
                }
            }
        });
        NodeEvents { tx: Some(tx) }
    }

    /// Whether events are sent anywhere.
    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// A change: `reason` (CamelCase, e.g. `GpuBound`), `action` (what was done, e.g. `Bind`),
    /// `note` (for people, naming the devices).
    pub fn normal(&self, reason: &str, action: &str, note: impl Into<String>) {
        self.send(EventType::Normal, reason, action, note.into());
    }

    /// A refusal or failure.
    pub fn warning(&self, reason: &str, action: &str, note: impl Into<String>) {
        self.send(EventType::Warning, reason, action, note.into());
    }

    fn send(&self, type_: EventType, reason: &str, action: &str, mut note: String) {
        let Some(tx) = &self.tx else { return };
        // The API server refuses a note over 1 kB.
        if note.len() > 1024 {
            let mut end = 1000;
            while !note.is_char_boundary(end) {
                end -= 1;
            }
            note.truncate(end);
            note.push_str(" …");
        }
        let _ = tx.send(Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        });
    }
}

/// Events about Node `node` through a client from `kubeconfig` (in-cluster without one);
/// disabled without a node name, or (logged) when no client can be made.
pub async fn for_node(
    node: Option<&str>,
    kubeconfig: Option<&std::path::Path>,
    daemon: &str,
) -> NodeEvents {
    let Some(node) = node else {
        return NodeEvents::disabled();
    };
    match crate::kube::client(kubeconfig).await {
        Ok(client) => NodeEvents::start(client, node, daemon),
        Err(e) => {
            tracing::warn!(
                node,
                error = format!("{e:#}"),
                "no Kubernetes client: no events on the node"
            );
            NodeEvents::disabled()
        }
    }
}
