//! ResourceClaims (`resource.k8s.io/v1`) on the fake API server, for DRA drivers that read the
//! claim kubelet asks them to prepare:
//!
//! - `GET /apis/resource.k8s.io/v1/namespaces/NS/resourceclaims/NAME` — the claim a test put,
//!   or a 404 `Status`.
//!
//! Tests put claims with [`FakeApiServer::put_claim`] (a whole object, as the scheduler left
//! it: `metadata.uid`, `status.allocation`) and take them away with
//! [`FakeApiServer::delete_claim`].

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde_json::{Value, json};

use super::{FakeApiServer, Request, Shared};

const PREFIX: &str = "/apis/resource.k8s.io/v1/namespaces/";

/// The claims, by (namespace, name).
pub(super) type Claims = Mutex<BTreeMap<(String, String), Value>>;

impl FakeApiServer {
    /// Stores `claim` (its `metadata.namespace` and `metadata.name` say where), replacing one of
    /// the same name.
    pub fn put_claim(&self, claim: Value) {
        let ns = claim["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let name = claim["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut claim = claim;
        claim["apiVersion"] = json!("resource.k8s.io/v1");
        claim["kind"] = json!("ResourceClaim");
        lock(&self.shared.claims).insert((ns, name), claim);
    }

    /// Removes a claim; it is then answered with 404.
    pub fn delete_claim(&self, namespace: &str, name: &str) {
        lock(&self.shared.claims).remove(&(namespace.to_string(), name.to_string()));
    }
}

fn lock(c: &Claims) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), Value>> {
    c.lock().unwrap_or_else(|e| e.into_inner())
}

/// Answers a request for a claim; `None` when the request is not about claims.
pub(super) fn route(s: &Shared, req: &Request) -> Option<(u16, Value)> {
    let rest = req.path.strip_prefix(PREFIX)?;
    let mut parts = rest.split('/');
    let (Some(ns), Some("resourceclaims"), Some(name), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    if req.method != "GET" {
        return Some((405, super::status(405, "only GET is served for claims")));
    }
    let found = lock(&s.claims)
        .get(&(ns.to_string(), name.to_string()))
        .cloned();
    Some(match found {
        Some(c) => (200, c),
        None => (
            404,
            json!({
                "kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": format!("resourceclaims.resource.k8s.io \"{name}\" not found"),
                "reason": "NotFound",
                "details": {"name": name, "group": "resource.k8s.io", "kind": "resourceclaims"},
                "code": 404,
            }),
        ),
    })
}
