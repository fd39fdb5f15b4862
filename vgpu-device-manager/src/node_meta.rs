//! Labels and annotations on the daemon's own Node, under either RBAC.
//!
//! Our ClusterRole grants `patch` on nodes, and a JSON merge patch changes only the keys it
//! names. The GPU Operator's ClusterRole for its vgpu-device-manager grants `update` instead:
//! there a patch is refused (403 Forbidden), and the change is made by reading the Node and
//! replacing it with the `resourceVersion` read, read again and retried when someone changed the
//! Node in between (409 Conflict). Once refused, later changes go straight to the replace,
//! until the replace is refused too: then neither is allowed, and the next change tries the
//! patch first again (a role fixed either way is found).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};

/// A change to one Node's metadata: each key set to a value, or removed (`None`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaChange {
    /// Labels to set or remove.
    pub labels: BTreeMap<String, Option<String>>,
    /// Annotations to set or remove.
    pub annotations: BTreeMap<String, Option<String>>,
}

/// How many times a replace is tried against a Node that keeps changing under it.
const CONFLICT_RETRIES: usize = 5;

/// Writes [`MetaChange`]s to one Node, by patch or, where patch is forbidden, by update.
#[derive(Debug)]
pub struct NodeMeta {
    api: Api<Node>,
    node: String,
    patch_forbidden: AtomicBool,
}

impl NodeMeta {
    /// Changes to node `node` through `api`.
    pub fn new(api: Api<Node>, node: String) -> NodeMeta {
        NodeMeta {
            api,
            node,
            patch_forbidden: AtomicBool::new(false),
        }
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Makes `change` on the node.
    pub async fn apply(&self, change: &MetaChange) -> Result<(), kube::Error> {
        if !self.patch_forbidden.load(Ordering::Relaxed) {
            match self.patch(change).await {
                Err(kube::Error::Api(e)) if e.code == 403 => {
                    tracing::info!(
                        node = self.node,
                        "patching the node is forbidden ({}); updating it instead",
                        e.message
                    );
                    self.patch_forbidden.store(true, Ordering::Relaxed);
                }
                other => return other,
            }
        }
        let r = self.update(change).await;
        if matches!(&r, Err(kube::Error::Api(e)) if e.code == 403) {
            self.patch_forbidden.store(false, Ordering::Relaxed);
        }
        r
    }

    async fn patch(&self, change: &MetaChange) -> Result<(), kube::Error> {
        let patch = serde_json::json!({
            "metadata": {
                "labels": change.labels,
                "annotations": change.annotations,
            }
        });
        self.api
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
    }

    async fn update(&self, change: &MetaChange) -> Result<(), kube::Error> {
        let mut attempt = 0;
        loop {
            let mut node = self.api.get(&self.node).await?;
            apply_to(&mut node.metadata.labels, &change.labels);
            apply_to(&mut node.metadata.annotations, &change.annotations);
            // `node` carries the resourceVersion it was read at: a replace over a newer Node
            // is refused with 409 and read again.
            match self
                .api
                .replace(&self.node, &PostParams::default(), &node)
                .await
            {
                Err(kube::Error::Api(e)) if e.code == 409 && attempt < CONFLICT_RETRIES => {
                    attempt += 1;
                    tracing::debug!(node = self.node, attempt, "node changed meanwhile; again");
                }
                r => return r.map(drop),
            }
        }
    }
}

fn apply_to(map: &mut Option<BTreeMap<String, String>>, change: &BTreeMap<String, Option<String>>) {
    if change.is_empty() {
        return;
    }
    let map = map.get_or_insert_with(BTreeMap::new);
    for (k, v) in change {
        match v {
            Some(v) => map.insert(k.clone(), v.clone()),
            None => map.remove(k),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_sets_and_removes_keys_and_keeps_the_rest() {
        let mut m = Some(BTreeMap::from([
            ("keep".to_string(), "1".to_string()),
            ("gone".to_string(), "2".to_string()),
        ]));
        let change = BTreeMap::from([
            ("gone".to_string(), None),
            ("new".to_string(), Some("3".to_string())),
        ]);
        apply_to(&mut m, &change);
        let want = BTreeMap::from([
            ("keep".to_string(), "1".to_string()),
            ("new".to_string(), "3".to_string()),
        ]);
        assert_eq!(m, Some(want));
        let mut none = None;
        apply_to(&mut none, &BTreeMap::new());
        assert_eq!(none, None, "an empty change adds no empty map");
    }
}
