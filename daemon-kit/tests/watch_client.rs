//! `daemon_kit::kube::watch_client` against a real API server (etcd and kube-apiserver): it
//! talks to it as kube's own client does (TLS, the kubeconfig's credentials); a quiet watch
//! lasts until the API server ends it at its `timeoutSeconds`, whatever read timeout the
//! configuration carries; and its connection has TCP keepalive (`ss` shows the timer), which is
//! what ends one whose API server vanished without a word. Skipped without the cluster tier's
//! assets, a failure with `CLUSTER_TIER=required`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use cluster_tier::{Assets, ControlPlane, ControlPlaneOpts};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio_stream::StreamExt as _;

/// How long the API server keeps the test's watch open.
const TIMEOUT_SECS: u32 = 6;

/// The established TCP connections of this process to `port`, as `ss` shows them with their
/// timers.
fn connections_to(port: &str) -> Vec<String> {
    let out = std::process::Command::new("ss")
        .args(["-tnopH", "state", "established"])
        .output()
        .unwrap();
    let me = format!("pid={},", std::process::id());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&me))
        .filter(|l| {
            l.split_whitespace()
                .nth(3)
                .is_some_and(|peer| peer.ends_with(&format!(":{port}")))
        })
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_watch_lasts_its_timeout_on_a_connection_with_keepalive() {
    let assets = match Assets::load() {
        Ok(a) => a,
        Err(why) => {
            cluster_tier::assets::skip("the watch client against a real API server", &why);
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let cp = tokio::task::block_in_place(|| {
        ControlPlane::start(dir.path(), &assets, ControlPlaneOpts::default())
    })
    .unwrap();
    let mut config = daemon_kit::kube::config(Some(cp.admin_kubeconfig()))
        .await
        .unwrap();
    // What a daemon sets for its other requests: the watch client leaves it out.
    config.read_timeout = Some(Duration::from_secs(1));
    let client = daemon_kit::kube::watch_client(&config).unwrap();
    let namespaces: Api<Namespace> = Api::all(client);
    let fields = "metadata.name=no-such-namespace";
    let list = namespaces
        .list(&ListParams::default().fields(fields))
        .await
        .unwrap();
    let rv = list.metadata.resource_version.unwrap();

    let started = Instant::now();
    let watch = namespaces
        .watch(
            &WatchParams::default().fields(fields).timeout(TIMEOUT_SECS),
            &rv,
        )
        .await
        .unwrap();
    let mut watch = std::pin::pin!(watch);
    // The watch is open: its connection, and the keepalive timer on it.
    let port = cp.server().rsplit(':').next().unwrap().to_string();
    let conns = connections_to(&port);
    assert!(
        !conns.is_empty() && conns.iter().all(|c| c.contains("timer:(keepalive")),
        "the watch client's connections to the API server (port {port}) without keepalive: {conns:#?}"
    );
    while let Some(ev) = watch.next().await {
        match ev {
            Ok(WatchEvent::Bookmark(_)) => {}
            other => panic!("the quiet watch said {other:?}"),
        }
    }
    let lasted = started.elapsed();
    assert!(
        lasted >= Duration::from_secs(u64::from(TIMEOUT_SECS) - 1),
        "the watch ended after {lasted:?}, before its timeout of {TIMEOUT_SECS} s"
    );
}
