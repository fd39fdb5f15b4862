//! `cluster_tier::ApiServer` (etcd and kube-apiserver on a free port of `127.0.0.1`, no root
//! needed) on every Kubernetes release `prepare.sh` prepared: the daemons' tests of API
//! semantics run on it.

use cluster_tier::{ApiServer, Assets, assets};

#[test]
fn the_api_server_alone_serves_on_loopback_on_every_prepared_release() {
    let assets = match Assets::load() {
        Ok(a) => a,
        Err(why) => {
            assets::skip("ApiServer on every release", &why);
            return;
        }
    };
    for a in [Some(assets.clone()), assets.newest()]
        .into_iter()
        .flatten()
    {
        let api = ApiServer::start_with(&a, false)
            .unwrap_or_else(|e| panic!("ApiServer on {}: {e:#}", a.k8s_version));
        assert!(
            api.server().starts_with("https://127.0.0.1:"),
            "{}",
            api.server()
        );
        api.create_node("node-a", &[("example.com/release", "any")])
            .unwrap_or_else(|e| panic!("creating a Node on {}: {e:#}", a.k8s_version));
        assert_eq!(
            api.label("node-a", "example.com/release").as_deref(),
            Some("any"),
            "{}",
            a.k8s_version
        );
    }
}
