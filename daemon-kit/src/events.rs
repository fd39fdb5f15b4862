//! Kubernetes Events (`events.k8s.io/v1`) on this node's Node object: every change a daemon
//! makes and every refusal, for `kubectl describe node` and `kubectl events`.
//!
//! # One Event per thing said, with a count
//!
//! Events aggregate as client-go's recorder aggregates identical events: the same type, reason,
//! action and note (about the same Node, from the same daemon) are **one** Event whose count
//! (its `series`: `kubectl describe node` shows `(x5 over 10m)`, `kubectl get events` the last
//! time seen) rises with every repeat. A different note is an Event of its own, even under the
//! same reason: relabelling a node from A10-4Q to A10-8Q shows two `ProfileApplied` Events, each
//! with its own note, count and times, and an operator never reads the A10-4Q note counted for
//! the A10-8Q apply. The older Events stay as they were, as history, until the API server
//! expires them (`--event-ttl`, an hour after their last write by default); a repeat after that
//! makes a new Event carrying the whole count.
//!
//! kube-runtime's `Recorder` (kube 5) keys its series on reason, action, type and object but not
//! the note, and writes every repeat; hence this module keeps its own series.
//!
//! # What the API server sees
//!
//! An Event is created at its first occurrence; repeats are counted and written as one patch
//! of the count, at most once every [`Tuning::write_gap`] per Event (30 s): a refusal repeated
//! at every pass is one Event whose count is at most that late, not a stream of requests.
//!
//! # Never in the daemon's way, bounded when the API server is away
//!
//! [`NodeEvents::normal`] and [`NodeEvents::warning`] only note the Event (a short lock, no
//! await); a task of its own writes them, oldest first. While the API server cannot be reached
//! (or answers 5xx or 429), Events wait and are tried again with backoff, 1 s doubling to
//! 1 minute; repeats meanwhile only raise a count. At most [`Tuning::capacity`] distinct Events
//! (256) are held: beyond, the least recently said that is already written is forgotten (its
//! next repeat starts a new Event), else the least recently said unsent one is dropped, and the
//! number dropped is logged before the next write is tried. An Event the API server refuses as
//! invalid (another 4xx) is logged and dropped.
//!
//! When RBAC forbids Events (403: a service account whose roles do not grant them, as the GPU
//! Operator's do not), that is said once, with what to grant, and nothing is written for
//! [`FORBIDDEN_RETRY`], then the next Event is tried in case the grant came since.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long Events are not written after the API server forbade one.
pub const FORBIDDEN_RETRY: Duration = Duration::from_secs(600);

/// Where cluster-scoped objects' Events go, as kubelet's for its Node do.
const NAMESPACE: &str = "default";

/// The API server refuses a note over 1 kB.
const MAX_NOTE: usize = 1024;

/// How the recorder paces its writes and how much it holds; [`Tuning::default`] is what the
/// daemons use.
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    /// The most distinct Events held, written or not.
    pub capacity: usize,
    /// The least time between two writes of one Event: repeats within it are written together.
    pub write_gap: Duration,
    /// The first wait after a write could not reach the API server; it doubles up to
    /// `retry_max`.
    pub retry_min: Duration,
    /// The longest wait between tries while the API server cannot be reached.
    pub retry_max: Duration,
    /// The most one write may take.
    pub timeout: Duration,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            capacity: 256,
            write_gap: Duration::from_secs(30),
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            timeout: Duration::from_secs(10),
        }
    }
}

/// What the recorder holds now, and what it dropped so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Distinct Events held (at most [`Tuning::capacity`]).
    pub held: usize,
    /// Occurrences noted and not yet written (a new Event, or a repeat not yet counted).
    pub unsent: u64,
    /// Occurrences dropped unsent since the start, because more distinct Events waited than
    /// are held.
    pub dropped: u64,
}

/// Where a daemon sends its Node events; [`NodeEvents::disabled`] without Kubernetes.
#[derive(Clone, Debug)]
pub struct NodeEvents {
    inner: Option<Arc<Handle>>,
}

impl NodeEvents {
    /// Events go nowhere.
    pub fn disabled() -> NodeEvents {
        NodeEvents { inner: None }
    }

    /// Sends events about Node `node` as `controller` (`gpu-vm-node/<daemon>`). Call inside a
    /// tokio runtime: the sending task runs on it until every clone is dropped.
    pub fn start(client: kube::Client, node: &str, daemon: &str) -> NodeEvents {
        NodeEvents::start_tuned(client, node, daemon, Tuning::default())
    }

    /// [`NodeEvents::start`], paced and bounded by `tuning`.
    pub fn start_tuned(
        client: kube::Client,
        node: &str,
        daemon: &str,
        tuning: Tuning,
    ) -> NodeEvents {
        let shared = Arc::new(Shared {
            book: Mutex::new(Book::new(tuning.capacity)),
            wake: Notify::new(),
        });
        let closed = CancellationToken::new();
        let sink = Sink {
            api: Api::namespaced(client, NAMESPACE),
            node: node.to_string(),
            controller: format!("gpu-vm-node/{daemon}"),
            instance: format!("{daemon}-{node}"),
            // Like kubelet's: a Node's events name it by name, also as its UID.
            regarding: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(node.to_string()),
                uid: Some(node.to_string()),
                ..Default::default()
            },
        };
        tokio::spawn(send_loop(shared.clone(), sink, tuning, closed.clone()));
        NodeEvents {
            inner: Some(Arc::new(Handle { shared, closed })),
        }
    }

    /// Whether events are sent anywhere.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// A change: `reason` (CamelCase, e.g. `GpuBound`), `action` (what was done, e.g. `Bind`),
    /// `note` (for people, naming the devices).
    pub fn normal(&self, reason: &str, action: &str, note: impl Into<String>) {
        self.send(Type::Normal, reason, action, note.into());
    }

    /// A refusal or failure.
    pub fn warning(&self, reason: &str, action: &str, note: impl Into<String>) {
        self.send(Type::Warning, reason, action, note.into());
    }

    /// What is held and what was dropped (all zero when disabled).
    pub fn backlog(&self) -> Backlog {
        match &self.inner {
            Some(h) => h.shared.book().backlog(),
            None => Backlog::default(),
        }
    }

    fn send(&self, type_: Type, reason: &str, action: &str, mut note: String) {
        let Some(h) = &self.inner else { return };
        if note.len() > MAX_NOTE {
            let mut end = 1000;
            while !note.is_char_boundary(end) {
                end -= 1;
            }
            note.truncate(end);
            note.push_str(" …");
        }
        let key = Key {
            type_,
            reason: reason.into(),
            action: action.into(),
            note,
        };
        h.shared.book().record(key, Timestamp::now());
        h.shared.wake.notify_one();
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

/// Held by every clone of a [`NodeEvents`]; the last one dropped ends the sending task.
#[derive(Debug)]
struct Handle {
    shared: Arc<Shared>,
    closed: CancellationToken,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.closed.cancel();
    }
}

#[derive(Debug)]
struct Shared {
    book: Mutex<Book>,
    /// Told after every Event noted.
    wake: Notify,
}

impl Shared {
    fn book(&self) -> MutexGuard<'_, Book> {
        // Nothing in the book is left half-changed by a panic: go on with it.
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Type {
    Normal,
    Warning,
}

impl Type {
    fn as_str(self) -> &'static str {
        match self {
            Type::Normal => "Normal",
            Type::Warning => "Warning",
        }
    }
}

/// What makes two Events the same one (the object and the reporter are the recorder's own).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    type_: Type,
    reason: String,
    action: String,
    note: String,
}

/// One Event as the recorder knows it: how often it was said, and how much of that the API
/// server has.
#[derive(Debug)]
struct Series {
    /// Told apart from a later series of the same key (after this one was forgotten).
    id: u64,
    /// The Event's name once created.
    name: Option<String>,
    count: u64,
    /// The count the API server has (0: not created).
    written: u64,
    first: Timestamp,
    last: Timestamp,
    /// When last said, as a sequence number: the least recent goes first when full.
    seen: u64,
    /// When its oldest unwritten occurrence was said: the oldest is written first.
    waiting_since: u64,
    written_at: Option<Instant>,
}

impl Series {
    fn unsent(&self) -> u64 {
        self.count.saturating_sub(self.written)
    }
}

/// A write to make: one Event's state when it was taken.
#[derive(Clone, Debug)]
struct Job {
    key: Key,
    id: u64,
    name: Option<String>,
    count: u64,
    first: Timestamp,
    last: Timestamp,
}

#[derive(Debug)]
enum Next {
    Write(Job),
    /// Nothing due before this instant.
    At(Instant),
    /// Nothing to write.
    Idle,
}

/// Every Event held, by key; bounded.
#[derive(Debug)]
struct Book {
    series: HashMap<Key, Series>,
    capacity: usize,
    seq: u64,
    dropped: u64,
    /// Dropped since the last log line said so.
    untold: u64,
}

impl Book {
    fn new(capacity: usize) -> Book {
        Book {
            series: HashMap::new(),
            capacity: capacity.max(1),
            seq: 0,
            dropped: 0,
            untold: 0,
        }
    }

    /// One occurrence of `key`, said at `at`.
    fn record(&mut self, key: Key, at: Timestamp) {
        self.seq += 1;
        let seq = self.seq;
        if let Some(s) = self.series.get_mut(&key) {
            if s.unsent() == 0 {
                s.waiting_since = seq;
            }
            s.count += 1;
            s.last = at;
            s.seen = seq;
            return;
        }
        if self.series.len() >= self.capacity {
            self.forget_one();
        }
        self.series.insert(
            key,
            Series {
                id: seq,
                name: None,
                count: 1,
                written: 0,
                first: at,
                last: at,
                seen: seq,
                waiting_since: seq,
                written_at: None,
            },
        );
    }

    /// Makes room: the least recently said of the written Events (only its aggregation is
    /// lost), else the least recently said of all, its unsent occurrences dropped.
    fn forget_one(&mut self) {
        let victim = self
            .series
            .iter()
            .filter(|(_, s)| s.unsent() == 0)
            .min_by_key(|(_, s)| s.seen)
            .or_else(|| self.series.iter().min_by_key(|(_, s)| s.seen))
            .map(|(k, _)| k.clone());
        if let Some(s) = victim.and_then(|k| self.series.remove(&k)) {
            self.dropped += s.unsent();
            self.untold += s.unsent();
        }
    }

    /// The write due first at `now`, each Event written at most once every `gap`.
    fn next(&self, now: Instant, gap: Duration) -> Next {
        let mut due: Option<(&Key, &Series)> = None;
        let mut soonest: Option<Instant> = None;
        for (k, s) in &self.series {
            if s.unsent() == 0 {
                continue;
            }
            let at = s.written_at.map_or(now, |t| t + gap);
            if at <= now {
                if due.is_none_or(|(_, d)| s.waiting_since < d.waiting_since) {
                    due = Some((k, s));
                }
            } else if soonest.is_none_or(|t| at < t) {
                soonest = Some(at);
            }
        }
        match (due, soonest) {
            (Some((k, s)), _) => Next::Write(Job {
                key: k.clone(),
                id: s.id,
                name: s.name.clone(),
                count: s.count,
                first: s.first,
                last: s.last,
            }),
            (None, Some(t)) => Next::At(t),
            (None, None) => Next::Idle,
        }
    }

    fn get(&mut self, job: &Job) -> Option<&mut Series> {
        self.series.get_mut(&job.key).filter(|s| s.id == job.id)
    }

    /// `job` was written as Event `name`.
    fn written(&mut self, job: &Job, name: String, now: Instant) {
        if let Some(s) = self.get(job) {
            s.name = Some(name);
            s.written = s.written.max(job.count);
            s.written_at = Some(now);
        }
    }

    /// The Event of `job` is gone from the API server (expired): the next write creates it.
    fn gone(&mut self, job: &Job) {
        if let Some(s) = self.get(job) {
            s.name = None;
            s.written = 0;
        }
    }

    /// `job` cannot be written: what it carried is given up.
    fn give_up(&mut self, job: &Job) {
        if let Some(s) = self.get(job) {
            s.written = s.written.max(job.count);
        }
    }

    /// The number dropped since the last call.
    fn take_untold(&mut self) -> u64 {
        std::mem::take(&mut self.untold)
    }

    fn backlog(&self) -> Backlog {
        Backlog {
            held: self.series.len(),
            unsent: self.series.values().map(Series::unsent).sum(),
            dropped: self.dropped,
        }
    }
}

/// The API side: who reports, about what, where.
struct Sink {
    api: Api<K8sEvent>,
    node: String,
    controller: String,
    instance: String,
    regarding: ObjectReference,
}

fn count_i32(n: u64) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

impl Sink {
    /// Creates `job`'s Event, or patches its count; the Event's name.
    async fn write(&self, job: &Job) -> Result<String, kube::Error> {
        let series = (job.count >= 2).then(|| EventSeries {
            count: count_i32(job.count),
            last_observed_time: MicroTime(job.last),
        });
        if let Some(name) = &job.name {
            let patch = K8sEvent {
                series,
                ..Default::default()
            };
            self.api
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            return Ok(name.clone());
        }
        let name = format!(
            "{}.{:x}",
            self.node,
            Timestamp::now().as_nanosecond().unsigned_abs()
        );
        let ev = K8sEvent {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(NAMESPACE.into()),
                ..Default::default()
            },
            event_time: Some(MicroTime(job.first)),
            series,
            action: Some(job.key.action.clone()),
            reason: Some(job.key.reason.clone()),
            note: Some(job.key.note.clone()),
            type_: Some(job.key.type_.as_str().into()),
            regarding: Some(self.regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            ..Default::default()
        };
        self.api.create(&PostParams::default(), &ev).await?;
        Ok(name)
    }
}

/// Writes what the book holds, oldest first, until the last [`NodeEvents`] clone is dropped.
async fn send_loop(shared: Arc<Shared>, sink: Sink, tuning: Tuning, closed: CancellationToken) {
    let node = sink.node.as_str();
    // No write before this instant: backing off, or forbidden.
    let mut hold: Option<Instant> = None;
    let mut backoff = tuning.retry_min;
    // Told once per outage, and once per refusal by RBAC.
    let mut unreachable = false;
    let mut forbidden = false;
    loop {
        if let Some(h) = hold.take() {
            tokio::select! {
                _ = closed.cancelled() => return,
                _ = tokio::time::sleep_until(h) => {}
            }
        }
        let next = shared.book().next(Instant::now(), tuning.write_gap);
        let job = match next {
            Next::Write(job) => job,
            Next::At(t) => {
                tokio::select! {
                    _ = closed.cancelled() => return,
                    _ = shared.wake.notified() => {}
                    _ = tokio::time::sleep_until(t) => {}
                }
                continue;
            }
            Next::Idle => {
                tokio::select! {
                    _ = closed.cancelled() => return,
                    _ = shared.wake.notified() => {}
                }
                continue;
            }
        };
        let dropped = shared.book().take_untold();
        if dropped > 0 {
            tracing::warn!(
                node,
                dropped,
                "{dropped} Events dropped unsent: more than {} distinct Events waited for the API server (the least recent go first)",
                tuning.capacity
            );
        }
        let result = tokio::time::timeout(tuning.timeout, sink.write(&job)).await;
        let now = Instant::now();
        let transient = match result {
            Ok(Ok(name)) => {
                shared.book().written(&job, name, now);
                backoff = tuning.retry_min;
                if std::mem::take(&mut unreachable) {
                    tracing::info!(node, "the API server answers again: recording Events");
                }
                if std::mem::take(&mut forbidden) {
                    tracing::info!(node, "Events are allowed again: recording them");
                }
                continue;
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 404 && job.name.is_some() => {
                shared.book().gone(&job);
                continue;
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 403 => {
                if !forbidden {
                    tracing::warn!(
                        node,
                        reason = job.key.reason,
                        error = %s.message,
                        "Events are forbidden to this daemon's service account: none are recorded \
                         (grant create and patch on events, in events.k8s.io and the core group; under \
                         the GPU Operator: deploy/operator/events-rbac.yaml); trying again every 10 minutes"
                    );
                    forbidden = true;
                }
                hold = Some(now + FORBIDDEN_RETRY);
                continue;
            }
            // A name taken (two creates in one nanosecond): the next try makes another.
            Ok(Err(kube::Error::Api(s))) if s.code == 409 && job.name.is_none() => {
                hold = Some(now + tuning.retry_min);
                continue;
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 429 || s.code >= 500 => {
                format!("{} ({})", s.message, s.code)
            }
            Ok(Err(kube::Error::Api(s))) => {
                tracing::warn!(
                    node,
                    reason = job.key.reason,
                    code = s.code,
                    error = %s.message,
                    "the API server refused an Event on the node; dropped"
                );
                shared.book().give_up(&job);
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", tuning.timeout),
        };
        if !unreachable {
            tracing::warn!(
                node,
                reason = job.key.reason,
                error = transient,
                "cannot record Events on the node: they wait (up to {} distinct) and are tried again",
                tuning.capacity
            );
            unreachable = true;
        }
        hold = Some(now + backoff);
        backoff = (backoff * 2).min(tuning.retry_max);
    }
}

#[cfg(test)]
mod tests;
