//! Whether the node's container runtime reads CDI, from the runtime kubelet reports in its Node
//! (`status.nodeInfo.containerRuntimeVersion`, e.g. `containerd://1.6.20`).
//!
//! The driver hands a VM's pod its `/dev/vfio` nodes and its device metadata only through CDI.
//! A runtime that ignores CDI starts the pod without them, and the VM fails later with an error
//! that does not point here. So:
//!
//! - containerd before 1.7 has no CDI: prepare refuses every claim, naming the runtime and the
//!   fix, and the operator is told once (log, Warning Event on the Node);
//! - containerd 1.7 reads CDI only with `enable_cdi = true` in its CRI configuration, which the
//!   node does not report: the operator is warned once, prepare goes ahead;
//! - containerd 2.0 or later and CRI-O 1.23 or later read CDI (on by default);
//! - any other runtime is unknown: a warning once, prepare goes ahead.

use std::sync::RwLock;

/// What the node's runtime means for CDI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cdi {
    /// It reads CDI.
    Read,
    /// It may not read CDI: the warning to give.
    Maybe(String),
    /// It ignores CDI: why, and what to do.
    Ignored(String),
}

/// `(major, minor)` of a version like `1.6.20`, `v2.0.0-rc.1` or `1.7.27-1`.
fn major_minor(v: &str) -> Option<(u32, u32)> {
    let v = v.trim().trim_start_matches('v');
    let mut parts = v.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Judges `containerRuntimeVersion` as kubelet reports it (`<runtime>://<version>`).
pub fn judge(runtime_version: &str) -> Cdi {
    let (name, version) = runtime_version
        .split_once("://")
        .unwrap_or((runtime_version, ""));
    let fix = "containerd 2.0 or later (or CRI-O) reads the CDI specs that carry the VM's \
               /dev/vfio nodes and device metadata (docs/dra.md, \"Install\")";
    match (name, major_minor(version)) {
        ("containerd", Some((1, minor))) if minor < 7 => Cdi::Ignored(format!(
            "the node's container runtime {runtime_version} ignores CDI: a pod would start \
             without its GPU's /dev/vfio nodes and device metadata; {fix}"
        )),
        ("containerd", Some((1, _))) => Cdi::Maybe(format!(
            "the node's container runtime {runtime_version} reads CDI only with \
             enable_cdi = true in its CRI plugin configuration (the default is off); without it \
             pods start without their GPUs"
        )),
        ("containerd", Some(_)) => Cdi::Read,
        ("cri-o", Some((1, minor))) if minor < 23 => Cdi::Ignored(format!(
            "the node's container runtime {runtime_version} predates CDI (CRI-O 1.23): a pod \
             would start without its GPU's /dev/vfio nodes and device metadata; {fix}"
        )),
        ("cri-o", Some(_)) => Cdi::Read,
        _ => Cdi::Maybe(format!(
            "the node's container runtime {runtime_version:?} is not one this driver knows \
             reads CDI; {fix}"
        )),
    }
}

/// The node's runtime as last read ([`crate::node`]), shared by the publisher and the plugin
/// (which refuses claims the runtime could not hand to a pod).
#[derive(Debug, Default)]
pub struct RuntimeCheck {
    state: RwLock<Option<(String, Cdi)>>,
}

impl RuntimeCheck {
    /// Records the runtime the Node reports; `Some(judgement)` when it changed, for the caller
    /// to tell.
    pub fn observe(&self, runtime_version: &str) -> Option<Cdi> {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        if state.as_ref().is_some_and(|(v, _)| v == runtime_version) {
            return None;
        }
        let cdi = judge(runtime_version);
        *state = Some((runtime_version.to_string(), cdi.clone()));
        Some(cdi)
    }

    /// Why prepare must refuse, when the node's runtime ignores CDI.
    pub fn refusal(&self) -> Option<String> {
        match &*self.state.read().unwrap_or_else(|p| p.into_inner()) {
            Some((_, Cdi::Ignored(why))) => Some(why.clone()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containerd_before_1_7_ignores_cdi() {
        for v in [
            "containerd://1.6.20",
            "containerd://1.6.20-1",
            "containerd://v1.5.9",
        ] {
            assert!(matches!(judge(v), Cdi::Ignored(m) if m.contains(v)), "{v}");
        }
    }

    #[test]
    fn containerd_1_7_needs_enable_cdi() {
        assert!(matches!(judge("containerd://1.7.27"), Cdi::Maybe(m) if m.contains("enable_cdi")));
    }

    #[test]
    fn containerd_2_and_crio_read_cdi() {
        for v in [
            "containerd://2.0.0",
            "containerd://2.4.0-beta.0+70",
            "containerd://v2.1.3",
            "cri-o://1.31.2",
        ] {
            assert_eq!(judge(v), Cdi::Read, "{v}");
        }
        assert!(matches!(judge("cri-o://1.22.0"), Cdi::Ignored(_)));
    }

    #[test]
    fn other_runtimes_are_unknown() {
        for v in ["docker://24.0.7", "", "containerd://", "something"] {
            assert!(matches!(judge(v), Cdi::Maybe(_)), "{v}");
        }
    }

    #[test]
    fn a_change_is_told_once_and_refusal_follows_the_runtime() {
        let r = RuntimeCheck::default();
        assert_eq!(r.refusal(), None, "nothing read yet: no refusal");
        assert!(matches!(
            r.observe("containerd://1.6.20"),
            Some(Cdi::Ignored(_))
        ));
        assert_eq!(r.observe("containerd://1.6.20"), None);
        assert!(r.refusal().is_some_and(|m| m.contains("1.6.20")));
        assert_eq!(r.observe("containerd://2.0.0"), Some(Cdi::Read));
        assert_eq!(r.refusal(), None);
        assert!(matches!(r.observe("docker://24.0.7"), Some(Cdi::Maybe(_))));
        assert_eq!(r.refusal(), None, "a warning is not a refusal");
    }
}
