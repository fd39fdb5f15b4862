//! What the tier runs, as `tests/cluster/prepare.sh` found or built it
//! (`target/cluster-tier/assets.env`).

use std::path::{Path, PathBuf};

/// The binaries and images of the tier.
#[derive(Debug, Clone)]
pub struct Assets {
    /// kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, containerd,
    /// containerd-shim-runc-v2, ctr.
    pub k8s_bin: PathBuf,
    /// Their Kubernetes release (`v1.36.3`).
    pub k8s_version: String,
    /// The newest release too, when prepared (its binaries and version): the DRA scenarios run
    /// again on it.
    pub newest: Option<(PathBuf, String)>,
    /// KubeVirt's virt-launcher code as programs, one per KubeVirt version
    /// (`kubevirt-check-v1.9.0`, …): `tests/kubevirt-check`.
    pub kubevirt_checkers: Vec<PathBuf>,
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
        let newest_bin = get("K8S_NEWEST_BIN")?;
        let a = Assets {
            k8s_bin: get("K8S_BIN")?.into(),
            k8s_version: get("K8S_VERSION")?,
            newest: (!newest_bin.is_empty())
                .then(|| get("K8S_NEWEST_VERSION").map(|v| (newest_bin.into(), v)))
                .transpose()?,
            kubevirt_checkers: get("KUBEVIRT_CHECKERS")?
                .split_whitespace()
                .map(PathBuf::from)
                .collect(),
            helm: get("HELM")?.into(),
            kubectl: get("KUBECTL")?.into(),
            image: get("IMAGE")?.into(),
            image_ref: get("IMAGE_REF")?,
            pause: get("PAUSE_IMAGE")?.into(),
        };
        let kubelet = a.k8s_bin.join("kubelet");
        for p in [&a.helm, &a.kubectl, &a.image, &a.pause, &kubelet]
            .into_iter()
            .chain(&a.kubevirt_checkers)
        {
            if !p.exists() {
                return Err(format!(
                    "{} does not exist (run tests/cluster/prepare.sh)",
                    p.display()
                ));
            }
        }
        Ok(a)
    }

    /// The same assets with the newest release's Kubernetes instead, if it was prepared.
    pub fn newest(&self) -> Option<Assets> {
        let (bin, version) = self.newest.clone()?;
        Some(Assets {
            k8s_bin: bin,
            k8s_version: version,
            newest: None,
            ..self.clone()
        })
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
