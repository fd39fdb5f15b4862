//! A fake Kubernetes API server holding one Node, for the tests that need a fault the real one
//! cannot be made to produce, and for the runs that have no real one.
//!
//! It validates nothing and has no server-side apply: tests of Kubernetes API semantics
//! (ResourceSlices and their limits, server-side apply, generations, label updates under the
//! GPU Operator's RBAC, Events as `kubectl get events` shows them) run against the real
//! kube-apiserver and etcd (`cluster_tier::ApiServer`). What still uses this fake, and why:
//!
//! - `vgpu-device-manager/tests/daemon.rs`, `state_is_written_by_update_where_patch_is_forbidden`:
//!   another client's write between the daemon's read and its replace, four times in a row
//!   ([`FakeApiServer::race_puts`]) — a conflict at an exact moment, which a real API server
//!   cannot be made to produce on cue;
//! - `sandbox-dra/tests/node_sim.rs`,
//!   `an_api_server_that_never_answers_fails_a_claim_in_time_and_holds_up_no_other` and
//!   `a_hung_api_server_leaves_the_driver_alive_and_answering`: an API server that accepts and
//!   never answers ([`FakeApiServer::hang`], below);
//! - tests not moved yet, which check a daemon's behaviour rather than the API's: the other
//!   tests of `vgpu-device-manager/tests/daemon.rs` (a label followed), and sandbox-dra's
//!   `node_sim.rs`, `vgpu.rs`, `in_use.rs` and `health.rs` (ResourceClaims the tests put, and
//!   `node_sim.rs`'s ClaimPrepared and ClaimNotPrepared Events);
//! - programs that run without a cluster: node-sim's demo, `tests/vm`'s `vm-dra-kubelet` and the
//!   bench's DRA and vGPU sections.
//!
//! Plain HTTP/1.1 on `127.0.0.1`, a thread per connection. It serves what kube-rs's metadata
//! watch of one node and a merge patch need:
//!
//! - `GET /api/v1/nodes[?fieldSelector=…]` — a `NodeList` with the node (`resourceVersion` set);
//! - `GET /api/v1/nodes?watch=true&resourceVersion=RV` — a chunked stream of `MODIFIED` events,
//!   one for every change after `RV`, until the server stops;
//! - `GET /api/v1/nodes/NAME`;
//! - `PATCH /api/v1/nodes/NAME` — a JSON merge patch of `metadata.labels` and
//!   `metadata.annotations` (`null` deletes), or 403 after [`FakeApiServer::forbid_patch`];
//! - `PUT /api/v1/nodes/NAME` — a replace of its labels and annotations, refused with 409 when
//!   the body's `resourceVersion` is not the current one.
//!
//! and ResourceSlices (`resource.k8s.io/v1`), as a DRA driver publishes them with kube-rs
//! (see [`serve_slices`]): list and watch (with a `fieldSelector` on `spec.nodeName` /
//! `spec.driver`; a watch streams `ADDED`, `MODIFIED` and `DELETED` for every change after its
//! `resourceVersion`), get, create, replace, server-side apply (the applied object replaces the
//! stored one) and delete.
//!
//! Tests change labels with [`FakeApiServer::set_label`] and read what the daemon wrote with
//! [`FakeApiServer::label`], [`FakeApiServer::annotation`] and
//! [`FakeApiServer::label_history`]. [`FakeApiServer::kubeconfig`] is a file pointing at it.
//!
//! It also holds ResourceClaims, put by tests with [`FakeApiServer::put_claim`], and takes
//! Events (`events.k8s.io/v1`: create, and the merge patch that counts a repeat), which tests
//! read with [`FakeApiServer::events`].
//!
//! [`FakeApiServer::hang`] makes it accept connections and read requests but never answer, until
//! [`FakeApiServer::answer`]: the fault a daemon must survive when the API server (or the network
//! to it) stalls. The real kube-apiserver cannot be made to do that (stopped, it refuses
//! connections; frozen with SIGSTOP, the kernel still completes TCP handshakes but the test
//! cannot tell a request read from one queued), so tests of that fault use this fake.

mod claims;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

#[derive(Debug)]
struct Inner {
    name: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    version: u64,
    /// Every (key, value) a PATCH set, in order (`None` = deleted).
    patched: Vec<(String, Option<String>)>,
    requests: Vec<String>,
    /// ResourceSlices by name.
    slices: BTreeMap<String, Value>,
    /// The last resourceVersion given to a ResourceSlice.
    slice_version: u64,
    /// Every change to a ResourceSlice, in order: its resourceVersion, the watch event's type
    /// and the object.
    slice_events: Vec<(u64, &'static str, Value)>,
    /// Whether a PATCH of the Node is refused with 403, as under a ClusterRole granting
    /// `update` on nodes but not `patch` (the GPU Operator's).
    patch_forbidden: bool,
    /// How many more PUTs of the Node another client beats by a write of its own.
    puts_raced: u32,
    /// Events, in the order they were created.
    events: Vec<Value>,
    /// Whether requests are read and never answered ([`FakeApiServer::hang`]).
    hang: bool,
    /// Requests read while hanging.
    hung: usize,
}

/// The Node's UID when the server starts.
pub const NODE_UID: &str = "00000000-0000-4000-8000-000000000001";

/// Where Events are served (in any namespace).
const EVENTS_PREFIX: &str = "/apis/events.k8s.io/v1/namespaces/";

/// Where ResourceSlices are served.
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

impl Inner {
    fn node(&self) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "uid": NODE_UID,
                "resourceVersion": self.version.to_string(),
                "labels": self.labels,
                "annotations": self.annotations,
            },
            "spec": {},
            "status": {},
        })
    }
}

#[derive(Debug)]
struct Shared {
    inner: Mutex<Inner>,
    claims: claims::Claims,
    changed: Condvar,
    stop: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The server. Dropping it stops it (open watches end).
#[derive(Debug)]
pub struct FakeApiServer {
    shared: Arc<Shared>,
    addr: std::net::SocketAddr,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

impl FakeApiServer {
    /// Starts a server with one node named `name` carrying `labels`.
    pub fn start(name: &str, labels: &[(&str, &str)]) -> anyhow::Result<FakeApiServer> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let dir = tempfile::tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\n\
                 contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
                 current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
            ),
        )?;
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                name: name.to_string(),
                labels: labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                annotations: BTreeMap::new(),
                version: 1,
                patched: Vec::new(),
                requests: Vec::new(),
                slices: BTreeMap::new(),
                slice_version: 0,
                slice_events: Vec::new(),
                patch_forbidden: false,
                puts_raced: 0,
                events: Vec::new(),
                hang: false,
                hung: 0,
            }),
            claims: Default::default(),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("fake-apiserver".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s.stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let s = s.clone();
                    let _ = std::thread::Builder::new()
                        .name("fake-apiserver-conn".into())
                        .spawn(move || {
                            let _ = serve(&s, conn);
                        });
                }
            })?;
        Ok(FakeApiServer {
            shared,
            addr,
            kubeconfig,
            _dir: dir,
        })
    }

    /// Refuses every later PATCH of the Node with 403 Forbidden, as the API server does for a
    /// service account whose ClusterRole grants `update` on nodes but not `patch`.
    pub fn forbid_patch(&self) {
        self.shared.lock().patch_forbidden = true;
    }

    /// Has another client write the Node (label `raced-by-N`) just before each of the next `n`
    /// PUTs arrives, so that each of them carries a stale `resourceVersion` and gets a 409.
    pub fn race_puts(&self, n: u32) {
        self.shared.lock().puts_raced = n;
    }

    /// From now on every request is read and never answered (on connections open already too)
    /// until [`FakeApiServer::answer`].
    pub fn hang(&self) {
        self.shared.lock().hang = true;
    }

    /// Answers requests again; those read while hanging stay unanswered (their clients gave up).
    pub fn answer(&self) {
        self.shared.lock().hang = false;
        self.shared.changed.notify_all();
    }

    /// How many requests were read and left unanswered while hanging.
    pub fn hung_requests(&self) -> usize {
        self.shared.lock().hung
    }

    /// A kubeconfig file for this server.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sets (`Some`) or removes (`None`) a label, as `kubectl label` would.
    pub fn set_label(&self, key: &str, value: Option<&str>) {
        let mut i = self.shared.lock();
        match value {
            Some(v) => i.labels.insert(key.into(), v.into()),
            None => i.labels.remove(key),
        };
        i.version += 1;
        self.shared.changed.notify_all();
    }

    /// A label's value now.
    pub fn label(&self, key: &str) -> Option<String> {
        self.shared.lock().labels.get(key).cloned()
    }

    /// An annotation's value now.
    pub fn annotation(&self, key: &str) -> Option<String> {
        self.shared.lock().annotations.get(key).cloned()
    }

    /// Every value PATCH requests gave `key`, in order (`None` = deleted).
    pub fn label_history(&self, key: &str) -> Vec<Option<String>> {
        self.shared
            .lock()
            .patched
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Forgets the PATCH history.
    pub fn clear_history(&self) {
        self.shared.lock().patched.clear();
    }

    /// The Events created so far, in order (a repeat patched into one shows its `series`).
    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().events.clone()
    }

    /// Waits up to `timeout` for an Event with `reason`; the first one, if it came.
    pub fn wait_for_event(&self, reason: &str, timeout: Duration) -> Option<Value> {
        let deadline = Instant::now() + timeout;
        let mut i = self.shared.lock();
        loop {
            if let Some(e) = i
                .events
                .iter()
                .find(|e| e["reason"].as_str() == Some(reason))
            {
                return Some(e.clone());
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            i = self
                .shared
                .changed
                .wait_timeout(i, left.min(Duration::from_millis(200)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Request lines received (`GET /api/v1/nodes?…`), in order.
    pub fn requests(&self) -> Vec<String> {
        self.shared.lock().requests.clone()
    }

    /// Waits until `f` holds for the label `key` (polling), up to `timeout`. Returns whether it
    /// did.
    pub fn wait_for(&self, key: &str, timeout: Duration, f: impl Fn(Option<&str>) -> bool) -> bool {
        let start = Instant::now();
        loop {
            if f(self.label(key).as_deref()) {
                return true;
            }
            if start.elapsed() >= timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// ResourceSlices.
impl FakeApiServer {
    /// The ResourceSlices held, in name order.
    pub fn slices(&self) -> Vec<Value> {
        self.shared.lock().slices.values().cloned().collect()
    }

    /// The ResourceSlice `name`.
    pub fn slice(&self, name: &str) -> Option<Value> {
        self.shared.lock().slices.get(name).cloned()
    }

    /// Stores `slice` as if someone had created it (a stale slice for a test).
    pub fn put_slice(&self, mut slice: Value) {
        let mut i = self.shared.lock();
        i.slice_version += 1;
        let name = slice["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        slice["metadata"]["resourceVersion"] = json!(i.slice_version.to_string());
        let kind = if i.slices.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let rv = i.slice_version;
        i.slice_events.push((rv, kind, slice.clone()));
        i.slices.insert(name, slice);
        drop(i);
        self.shared.changed.notify_all();
    }

    /// Waits until `f` holds for the slices (polling), up to `timeout`; the slices then, or
    /// `None` when it never did.
    pub fn wait_for_slices(
        &self,
        timeout: Duration,
        f: impl Fn(&[Value]) -> bool,
    ) -> Option<Vec<Value>> {
        let start = Instant::now();
        loop {
            let now = self.slices();
            if f(&now) {
                return Some(now);
            }
            if start.elapsed() >= timeout {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        let _ = TcpStream::connect(self.addr);
    }
}

struct Request {
    method: String,
    path: String,
    query: BTreeMap<String, String>,
    body: Vec<u8>,
}

fn read_request(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<Request>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let target = parts.next().unwrap_or_default().to_string();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 {
            return Ok(None);
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body)?;
    let (path, q) = target.split_once('?').unwrap_or((target.as_str(), ""));
    let query = q
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), unescape(v)))
        .collect();
    Ok(Some(Request {
        method,
        path: path.to_string(),
        query,
        body,
    }))
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
        } else {
            out.push(if b[i] == b'+' { b' ' } else { b[i] });
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn respond(w: &mut TcpStream, code: u16, body: &Value) -> std::io::Result<()> {
    let text = body.to_string();
    let reason = match code {
        200 => "OK",
        201 => "Created",
        403 => "Forbidden",
        404 => "Not Found",
        409 => "Conflict",
        _ => "Error",
    };
    write!(
        w,
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    )?;
    w.flush()
}

/// A failure `Status`, with the `reason` clients match on (kube-rs's `get_opt` takes a 404
/// as absent only with reason `NotFound`).
fn status(code: u16, msg: &str) -> Value {
    let reason = match code {
        404 => "NotFound",
        403 => "Forbidden",
        409 => "Conflict",
        422 => "Invalid",
        405 => "MethodNotAllowed",
        _ => "BadRequest",
    };
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": msg,
           "reason": reason, "code": code})
}

fn serve(s: &Shared, conn: TcpStream) -> std::io::Result<()> {
    // As kube-apiserver (Go sets TCP_NODELAY on every connection): an answer written in pieces
    // is sent at once, not held by Nagle's algorithm until the client's delayed ACK (40 ms).
    conn.set_nodelay(true)?;
    let mut w = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    while let Some(req) = read_request(&mut r)? {
        {
            let mut i = s.lock();
            if i.hang {
                i.hung += 1;
                while i.hang && !s.stop.load(Ordering::SeqCst) {
                    i = s
                        .changed
                        .wait_timeout(i, Duration::from_millis(200))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                // The client gave up long ago: this connection says nothing more.
                return Ok(());
            }
        }
        let name = s.lock().name.clone();
        s.lock()
            .requests
            .push(format!("{} {}?{:?}", req.method, req.path, req.query));
        if let Some((code, body)) = claims::route(s, &req) {
            respond(&mut w, code, &body)?;
            continue;
        }
        let node_path = format!("/api/v1/nodes/{name}");
        match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/api/v1/nodes") => {
                let watch = req
                    .query
                    .get("watch")
                    .is_some_and(|v| v == "true" || v == "1");
                let selected = req
                    .query
                    .get("fieldSelector")
                    .is_none_or(|f| *f == format!("metadata.name={name}"));
                if watch {
                    let from: u64 = req
                        .query
                        .get("resourceVersion")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    return stream_watch(s, &mut w, from, selected);
                }
                let i = s.lock();
                let items = if selected { vec![i.node()] } else { vec![] };
                let list = json!({
                    "kind": "NodeList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": i.version.to_string()},
                    "items": items,
                });
                drop(i);
                respond(&mut w, 200, &list)?;
            }
            ("GET", p) if p == node_path => {
                let node = s.lock().node();
                respond(&mut w, 200, &node)?;
            }
            (_, p) if p.starts_with(EVENTS_PREFIX) && p.contains("/events") => {
                let (code, body) = serve_events(s, &req);
                respond(&mut w, code, &body)?;
            }
            ("GET", SLICES)
                if req
                    .query
                    .get("watch")
                    .is_some_and(|v| v == "true" || v == "1") =>
            {
                let from: u64 = req
                    .query
                    .get("resourceVersion")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                return stream_slices(s, &mut w, from, req.query.get("fieldSelector"));
            }
            (_, p) if p == SLICES || p.starts_with(&format!("{SLICES}/")) => {
                let (code, body) = serve_slices(s, &req);
                s.changed.notify_all();
                respond(&mut w, code, &body)?;
            }
            ("PATCH", p) if p == node_path && s.lock().patch_forbidden => {
                let msg = format!(
                    "nodes \"{name}\" is forbidden: User \"system:serviceaccount:gpu-operator:nvidia-vgpu-device-manager\" cannot patch resource \"nodes\" in API group \"\" at the cluster scope"
                );
                respond(&mut w, 403, &status(403, &msg))?;
            }
            ("PUT", p) if p == node_path => {
                let (code, body) = replace_node(s, &req.body);
                respond(&mut w, code, &body)?;
            }
            ("PATCH", p) if p == node_path => {
                let patch: Value = match serde_json::from_slice(&req.body) {
                    Ok(v) => v,
                    Err(e) => {
                        respond(&mut w, 400, &status(400, &format!("bad patch: {e}")))?;
                        continue;
                    }
                };
                let mut i = s.lock();
                let meta = patch.get("metadata").cloned().unwrap_or(Value::Null);
                let mut changes = Vec::new();
                for (field, is_label) in [("labels", true), ("annotations", false)] {
                    if let Some(Value::Object(m)) = meta.get(field) {
                        for (k, v) in m {
                            let target = if is_label {
                                &mut i.labels
                            } else {
                                &mut i.annotations
                            };
                            let v = match v {
                                Value::String(v) => {
                                    target.insert(k.clone(), v.clone());
                                    Some(v.clone())
                                }
                                _ => {
                                    target.remove(k);
                                    None
                                }
                            };
                            changes.push((k.clone(), v));
                        }
                    }
                }
                i.patched.extend(changes);
                i.version += 1;
                let n = i.node();
                drop(i);
                s.changed.notify_all();
                respond(&mut w, 200, &n)?;
            }
            _ => respond(&mut w, 404, &status(404, "not found"))?,
        }
    }
    Ok(())
}

/// `PUT` of the Node: its labels and annotations become the body's, recorded in the history
/// as a PATCH's are; a stale `resourceVersion` is a 409 and changes nothing.
fn replace_node(s: &Shared, body: &[u8]) -> (u16, Value) {
    let obj: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return (400, status(400, &format!("bad body: {e}"))),
    };
    let mut i = s.lock();
    if i.puts_raced > 0 {
        i.puts_raced -= 1;
        let key = format!("raced-by-{}", i.puts_raced);
        i.labels.insert(key.clone(), "another-client".into());
        i.patched.push((key, Some("another-client".into())));
        i.version += 1;
    }
    let rv = obj["metadata"]["resourceVersion"].as_str().unwrap_or("");
    if rv != i.version.to_string() {
        return (
            409,
            status(
                409,
                &format!(
                    "Operation cannot be fulfilled on nodes \"{}\": the object has been modified",
                    i.name
                ),
            ),
        );
    }
    let read = |field: &str| -> BTreeMap<String, String> {
        obj["metadata"][field]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (labels, annotations) = (read("labels"), read("annotations"));
    let mut changes = Vec::new();
    for (old, new) in [(&i.labels, &labels), (&i.annotations, &annotations)] {
        for (k, v) in new {
            if old.get(k) != Some(v) {
                changes.push((k.clone(), Some(v.clone())));
            }
        }
        for k in old.keys().filter(|k| !new.contains_key(*k)) {
            changes.push((k.clone(), None));
        }
    }
    i.labels = labels;
    i.annotations = annotations;
    i.patched.extend(changes);
    i.version += 1;
    let n = i.node();
    drop(i);
    s.changed.notify_all();
    (200, n)
}

/// `POST …/namespaces/NS/events` creates an Event; `PATCH …/events/NAME` merges into it (a
/// recorder's repeat: its `series`); `GET …/events` lists them.
fn serve_events(s: &Shared, req: &Request) -> (u16, Value) {
    let Some((ns, rest)) = req.path[EVENTS_PREFIX.len()..].split_once('/') else {
        return (404, status(404, "not found"));
    };
    let name = rest
        .strip_prefix("events")
        .map(|r| r.trim_start_matches('/'));
    let body: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
    let mut i = s.lock();
    let (code, out) = match (req.method.as_str(), name) {
        ("POST", Some("")) => {
            let mut ev = body;
            ev["metadata"]["namespace"] = json!(ns);
            i.events.push(ev.clone());
            (201, ev)
        }
        ("PATCH", Some(n)) if !n.is_empty() => {
            match i
                .events
                .iter_mut()
                .find(|e| e["metadata"]["name"].as_str() == Some(n))
            {
                Some(ev) => {
                    if let (Some(ev), Some(patch)) = (ev.as_object_mut(), body.as_object()) {
                        for (k, v) in patch {
                            ev.insert(k.clone(), v.clone());
                        }
                    }
                    (200, ev.clone())
                }
                None => (404, status(404, &format!("events \"{n}\" not found"))),
            }
        }
        ("GET", Some("")) => (
            200,
            json!({"kind": "EventList", "apiVersion": "events.k8s.io/v1",
                   "metadata": {}, "items": i.events}),
        ),
        _ => (405, status(405, "method not allowed")),
    };
    drop(i);
    s.changed.notify_all();
    (code, out)
}

/// Whether `slice` matches a `fieldSelector` of `spec.nodeName=…` / `spec.driver=…` terms.
fn slice_selected(slice: &Value, selector: Option<&String>) -> bool {
    let Some(sel) = selector else { return true };
    sel.split(',').filter(|t| !t.is_empty()).all(|term| {
        let Some((field, want)) = term.split_once('=') else {
            return false;
        };
        let have = match field {
            "spec.nodeName" => slice["spec"]["nodeName"].as_str(),
            "spec.driver" => slice["spec"]["driver"].as_str(),
            "metadata.name" => slice["metadata"]["name"].as_str(),
            _ => return false,
        };
        have.unwrap_or_default() == want
    })
}

/// One ResourceSlice request: the status code and the body.
fn serve_slices(s: &Shared, req: &Request) -> (u16, Value) {
    let name = req
        .path
        .strip_prefix(SLICES)
        .and_then(|r| r.strip_prefix('/'))
        .filter(|n| !n.is_empty());
    let not_found = |n: &str| {
        status(
            404,
            &format!("resourceslices.resource.k8s.io \"{n}\" not found"),
        )
    };
    let body = || serde_json::from_slice::<Value>(&req.body);
    let mut i = s.lock();
    match (req.method.as_str(), name) {
        ("GET", None) => {
            let items: Vec<Value> = i
                .slices
                .values()
                .filter(|v| slice_selected(v, req.query.get("fieldSelector")))
                .cloned()
                .collect();
            let list = json!({
                "kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                "metadata": {"resourceVersion": i.slice_version.to_string()},
                "items": items,
            });
            (200, list)
        }
        ("GET", Some(n)) => match i.slices.get(n) {
            Some(v) => (200, v.clone()),
            None => (404, not_found(n)),
        },
        ("DELETE", Some(n)) => match i.slices.remove(n) {
            Some(mut v) => {
                i.slice_version += 1;
                let rv = i.slice_version;
                v["metadata"]["resourceVersion"] = json!(rv.to_string());
                i.slice_events.push((rv, "DELETED", v.clone()));
                (200, v)
            }
            None => (404, not_found(n)),
        },
        (method @ ("POST" | "PUT" | "PATCH"), n) => {
            let mut obj = match body() {
                Ok(v) => v,
                Err(e) => return (400, status(400, &format!("bad body: {e}"))),
            };
            let Some(obj_name) = obj["metadata"]["name"].as_str().map(str::to_string) else {
                return (422, status(422, "metadata.name is required"));
            };
            if n.is_some_and(|n| n != obj_name) {
                return (
                    400,
                    status(400, "the name in the body does not match the URL"),
                );
            }
            let existing = i.slices.get(&obj_name).cloned();
            match (method, &existing) {
                ("POST", Some(_)) => {
                    return (
                        409,
                        status(
                            409,
                            &format!("resourceslices \"{obj_name}\" already exists"),
                        ),
                    );
                }
                ("PUT", None) => return (404, not_found(&obj_name)),
                ("PUT", Some(old)) => {
                    let rv = &obj["metadata"]["resourceVersion"];
                    if !rv.is_null() && *rv != old["metadata"]["resourceVersion"] {
                        return (409, status(409, "the object has been modified"));
                    }
                }
                _ => {}
            }
            i.slice_version += 1;
            let uid = existing
                .as_ref()
                .map(|o| o["metadata"]["uid"].clone())
                .unwrap_or_else(|| json!(format!("slice-{}", i.slice_version)));
            obj["metadata"]["uid"] = uid;
            obj["metadata"]["resourceVersion"] = json!(i.slice_version.to_string());
            obj["apiVersion"] = json!("resource.k8s.io/v1");
            obj["kind"] = json!("ResourceSlice");
            let kind = if existing.is_some() {
                "MODIFIED"
            } else {
                "ADDED"
            };
            let rv = i.slice_version;
            i.slice_events.push((rv, kind, obj.clone()));
            i.slices.insert(obj_name, obj.clone());
            (if existing.is_some() { 200 } else { 201 }, obj)
        }
        _ => (405, status(405, "method not allowed")),
    }
}

fn chunk(w: &mut TcpStream, data: &str) -> std::io::Result<()> {
    write!(w, "{:x}\r\n{data}\r\n", data.len())?;
    w.flush()
}

/// A watch of ResourceSlices: every change after `from` that `selector` selects, as it comes,
/// until the server stops.
fn stream_slices(
    s: &Shared,
    w: &mut TcpStream,
    from: u64,
    selector: Option<&String>,
) -> std::io::Result<()> {
    write!(
        w,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )?;
    w.flush()?;
    let mut sent = from;
    let mut i = s.lock();
    loop {
        if s.stop.load(Ordering::SeqCst) {
            break;
        }
        let due: Vec<(u64, &'static str, Value)> = i
            .slice_events
            .iter()
            .filter(|(rv, _, obj)| *rv > sent && slice_selected(obj, selector))
            .cloned()
            .collect();
        if let Some(last) = i.slice_events.last() {
            sent = sent.max(last.0);
        }
        if !due.is_empty() {
            drop(i);
            for (_, kind, obj) in due {
                let mut line = json!({"type": kind, "object": obj}).to_string();
                line.push('\n');
                chunk(w, &line)?;
            }
            i = s.lock();
            continue;
        }
        i = s
            .changed
            .wait_timeout(i, Duration::from_millis(200))
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
    }
    drop(i);
    let _ = w.write_all(b"0\r\n\r\n");
    let _ = w.shutdown(Shutdown::Both);
    Ok(())
}

fn stream_watch(s: &Shared, w: &mut TcpStream, from: u64, selected: bool) -> std::io::Result<()> {
    write!(
        w,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )?;
    w.flush()?;
    let mut sent = from;
    let mut i = s.lock();
    loop {
        if s.stop.load(Ordering::SeqCst) {
            break;
        }
        if i.version > sent {
            sent = i.version;
            if selected {
                let ev = json!({"type": "MODIFIED", "object": i.node()});
                let mut line = ev.to_string();
                line.push('\n');
                drop(i);
                chunk(w, &line)?;
                i = s.lock();
            }
            continue;
        }
        i = s
            .changed
            .wait_timeout(i, Duration::from_millis(200))
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
    }
    drop(i);
    let _ = w.write_all(b"0\r\n\r\n");
    let _ = w.shutdown(Shutdown::Both);
    Ok(())
}
