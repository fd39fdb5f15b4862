//! What the tier runs, as `tests/cluster/prepare.sh` found or built it
//! (`target/cluster-tier/assets.env`).

use std::path::{Path, PathBuf};

/// The binaries and images of the tier.
#[derive(Debug, Clone)]
pub struct Assets {
    /// kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, containerd,
    /// containerd-shim-runc-v2, ctr.
    pub k8s_bin: PathBuf,
    /// helm.
    pub helm: PathBuf,
    /// kubectl.
    pub kubectl: PathBuf,
    /// The project's image (OCI archive).
    pub image: PathBuf,
    /// Its reference, as the chart names it by default (`gpu-vm-node:<version>`).
    pub image_ref: String,
    /// The pod sandbox image (OCI archive, `registry.k8s.io/pause:3.10`).
    pub pause: PathBuf,
}

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

impl Assets {
    /// The assets `prepare.sh` recorded; `Err(why)` when it did not run or could not prepare
    /// them.
    pub fn load() -> Result<Assets, String> {
        let env = repo().join("target/cluster-tier/assets.env");
        let text = std::fs::read_to_string(&env).map_err(|e| {
            format!(
                "{}: {e} (tests/cluster/prepare.sh prepares the tier; tests/run-tests.sh runs it)",
                env.display()
            )
        })?;
        let get = |k: &str| -> Result<String, String> {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .map(str::to_string)
                .ok_or_else(|| format!("{}: no {k}", env.display()))
        };
        let a = Assets {
            k8s_bin: get("K8S_BIN")?.into(),
            helm: get("HELM")?.into(),
            kubectl: get("KUBECTL")?.into(),
            image: get("IMAGE")?.into(),
            image_ref: get("IMAGE_REF")?,
            pause: get("PAUSE_IMAGE")?.into(),
        };
        for p in [
            &a.helm,
            &a.kubectl,
            &a.image,
            &a.pause,
            &a.k8s_bin.join("kubelet"),
        ] {
            if !p.exists() {
                return Err(format!(
                    "{} does not exist (run tests/cluster/prepare.sh)",
                    p.display()
                ));
            }
        }
        Ok(a)
    }
}

/// Why the tier cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    if let Some(why) = node_sim::unavailable() {
        return Some(why.into());
    }
    Assets::load().err()
}

/// Reports that the tier cannot run: `skipped: …` on stderr, or a panic with
/// `CLUSTER_TIER=required` (CI).
pub fn skip(what: &str, why: &str) {
    let line = format!("skipped: {what}: {why}");
    if std::env::var("CLUSTER_TIER").is_ok_and(|v| v == "required") {
        panic!("CLUSTER_TIER=required but {line}");
    }
    eprintln!("{line}");
}
