//! Names the driver gives things in the API: a device's name in its pool is derived from its
//! PCI address (DNS label: lowercase, digits and `-`, at most 63 characters), so that prepare
//! finds the function a claim's allocation names without asking anyone.

use common::PciAddress;

/// The device name of the GPU at `addr`: `gpu-0000-3b-00-0` for `0000:3b:00.0`.
pub fn gpu_device(addr: &PciAddress) -> String {
    format!(
        "gpu-{:04x}-{:02x}-{:02x}-{:x}",
        addr.domain, addr.bus, addr.device, addr.function
    )
}

/// The PCI address a [`gpu_device`] name stands for; `None` for any other name.
pub fn parse_gpu_device(name: &str) -> Option<PciAddress> {
    let rest = name.strip_prefix("gpu-")?;
    let mut parts = rest.split('-');
    let (Some(d), Some(b), Some(s), Some(f), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    let addr: PciAddress = format!("{d}:{b}:{s}.{f}").parse().ok()?;
    // Only the canonical (lowercase, zero-padded) spelling names a device.
    (gpu_device(&addr) == name).then_some(addr)
}

/// The longest pool name the API accepts.
const MAX_POOL_NAME: usize = 253;

/// The pool of a GPU of the vGPU pool on node `node`: `<node>/gpu-0000-41-00-0`, its counter
/// set and every device consuming it (its whole-GPU device, its vGPU devices) alone, so that the
/// scheduler's counter check walks that GPU's devices only. The node's own pool (`node`) when
/// that name would be longer than the API takes.
pub fn gpu_pool(node: &str, gpu: &PciAddress) -> String {
    let name = format!("{node}/{}", gpu_device(gpu));
    if name.len() > MAX_POOL_NAME {
        return node.to_string();
    }
    name
}

/// Whether `pool` is one of node `node`'s pools: the node's own, or one of its GPUs'
/// ([`gpu_pool`]).
pub fn is_node_pool(node: &str, pool: &str) -> bool {
    pool == node
        || pool
            .strip_prefix(node)
            .and_then(|rest| rest.strip_prefix('/'))
            .and_then(parse_gpu_device)
            .is_some()
}

/// The part of a vGPU type name a device name carries: `a10-4q` for `NVIDIA A10-4Q`.
pub fn type_key(type_name: &str) -> String {
    type_name
        .split_whitespace()
        .last()
        .unwrap_or_default()
        .to_ascii_lowercase()
}

/// The device name of the vGPUs of type `type_name` on the GPU at `gpu`, one shared device
/// for all of them: `vgpu-0000-41-00-0-a10-4q`.
pub fn vgpu_device(gpu: &PciAddress, type_name: &str) -> String {
    format!("v{}-{}", gpu_device(gpu), type_key(type_name))
}

/// The GPU and type key a [`vgpu_device`] name stands for; `None` for any other name.
///
/// The name of one vGPU *instance* that earlier versions published
/// (`vgpu-0000-41-00-0-a10-4q-5`: a slot number after the type) is read too, as its GPU and
/// type: claims prepared from such a pool are prepared again and unprepared after an upgrade.
/// No vGPU type name ends in `-<digits>`, so the two cannot be confused.
pub fn parse_vgpu_device(name: &str) -> Option<(PciAddress, String)> {
    let rest = name.strip_prefix('v')?;
    let mut parts = rest.splitn(6, '-');
    let gpu: Vec<&str> = parts.by_ref().take(5).collect();
    let tail = parts.next()?;
    let addr = parse_gpu_device(&gpu.join("-"))?;
    let key = match tail.rsplit_once('-') {
        Some((key, slot)) if !slot.is_empty() && slot.bytes().all(|b| b.is_ascii_digit()) => {
            // A slot, written as the per-instance pool wrote it (no leading zero).
            slot.parse::<u32>().ok().filter(|n| n.to_string() == slot)?;
            key
        }
        _ => tail,
    };
    (!key.is_empty()
        && is_name_part(key)
        && !key.starts_with('-')
        && !key.ends_with('-')
        && name.starts_with(&vgpu_device(&addr, key)))
    .then(|| (addr, key.to_string()))
}

/// The device name of the `slot`-th mdev of type `type_id` the non-PCI mdev parent `parent`
/// (`mtty`) could host: `mdev-mtty-mtty-2-0`.
pub fn mdev_device(parent: &str, type_id: &str, slot: u32) -> String {
    format!("mdev-{parent}-{type_id}-{slot}")
}

/// The parent (one of `parents`), type id and slot an [`mdev_device`] name stands for; `None`
/// for any other name.
pub fn parse_mdev_device<'a>(
    name: &str,
    parents: impl IntoIterator<Item = &'a String>,
) -> Option<(String, String, u32)> {
    let rest = name.strip_prefix("mdev-")?;
    parents.into_iter().find_map(|p| {
        let (type_id, slot) = rest
            .strip_prefix(p.as_str())?
            .strip_prefix('-')?
            .rsplit_once('-')?;
        let slot: u32 = slot.parse().ok()?;
        (!type_id.is_empty() && mdev_device(p, type_id, slot) == name)
            .then(|| (p.clone(), type_id.to_string(), slot))
    })
}

/// The longest DNS label (RFC 1123) the API accepts.
pub const DNS_LABEL_MAX: usize = 63;

/// The longest DNS subdomain (RFC 1123) the API accepts.
pub const DNS_SUBDOMAIN_MAX: usize = 253;

/// Whether `s` is a DNS label as the API defines it (RFC 1123): 1 to 63 lowercase letters,
/// digits and `-`, starting and ending with a letter or digit. Namespaces, a pod's names for
/// its claims, requests and device names are such labels; none holds `/`, `.` or NUL, so none
/// can leave the directory it is joined to.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= DNS_LABEL_MAX
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Whether `s` is a DNS subdomain as the API defines it (RFC 1123): at most 253 characters,
/// DNS labels joined by `.`. Object names (a ResourceClaim's) are such subdomains: no `/`, no
/// NUL, no empty label (so neither `.` nor `..`).
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= DNS_SUBDOMAIN_MAX
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

/// Whether `s` is a request reference as an allocation names it: a request (a DNS label), or
/// `<request>/<subrequest>` for a `firstAvailable` request's choice.
pub fn is_request_ref(s: &str) -> bool {
    match s.split_once('/') {
        Some((request, sub)) => is_dns_label(request) && is_dns_label(sub),
        None => is_dns_label(s),
    }
}

/// `s` as a message quotes a name from the API: escaped, and cut after 80 characters.
pub fn quoted(s: &str) -> String {
    let cut: String = s.chars().take(80).collect();
    if cut.len() < s.len() {
        format!("{cut:?}… ({} bytes)", s.len())
    } else {
        format!("{cut:?}")
    }
}

/// Whether `s` may stand in a device name (lowercase letters, digits and `-`).
pub fn is_name_part(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// What the tests of every name from the API try: a way out of a directory, a separator,
    /// a NUL, and a value one past the API's length limit.
    pub(crate) fn hostile(limit: usize) -> Vec<String> {
        vec![
            "../x".into(),
            "..".into(),
            "a/b".into(),
            "a\0b".into(),
            "a".repeat(limit + 1),
        ]
    }

    #[test]
    fn a_pooled_gpu_has_a_pool_of_its_own_under_the_nodes_name() {
        let gpu: PciAddress = "0000:41:00.0".parse().unwrap();
        assert_eq!(gpu_pool("node-a", &gpu), "node-a/gpu-0000-41-00-0");
        assert!(is_node_pool("node-a", "node-a"));
        assert!(is_node_pool("node-a", "node-a/gpu-0000-41-00-0"));
        for other in [
            "node-b",
            "node-ab",
            "node-a/",
            "node-a/gpu-0000-41-00-0/x",
            "node-a/../node-b",
            "node-ab/gpu-0000-41-00-0",
        ] {
            assert!(!is_node_pool("node-a", other), "{other}");
        }
        // A name the API would refuse: the node's own pool.
        let long = "n".repeat(240);
        assert_eq!(gpu_pool(&long, &gpu), long);
    }

    #[test]
    fn labels_subdomains_and_request_references_are_as_the_api_defines_them() {
        for ok in ["gpu", "vm-1", "0", &"a".repeat(63)] {
            assert!(is_dns_label(ok), "{ok}");
            assert!(is_dns_subdomain(ok), "{ok}");
            assert!(is_request_ref(ok), "{ok}");
        }
        for ok in [
            "vm1.gpu-x7k",
            &format!("{}.{}", "a".repeat(63), "b".repeat(63)),
        ] {
            assert!(is_dns_subdomain(ok), "{ok}");
            assert!(!is_dns_label(ok), "{ok}");
        }
        assert!(is_request_ref("gpu/a10"));
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", "a b"] {
            assert!(!is_dns_label(bad), "{bad:?}");
        }
        for bad in hostile(DNS_LABEL_MAX) {
            assert!(!is_dns_label(&bad), "{bad:?}");
            // `a/b` is a request and its subrequest: the path takes `a` only.
            assert_eq!(is_request_ref(&bad), bad == "a/b", "{bad:?}");
        }
        for bad in
            hostile(DNS_SUBDOMAIN_MAX)
                .into_iter()
                .chain([".".into(), "a..b".into(), ".a".into()])
        {
            assert!(!is_dns_subdomain(&bad), "{bad:?}");
        }
        for bad in ["gpu/", "/a10", "gpu/a10/x", "gpu/../x"] {
            assert!(!is_request_ref(bad), "{bad:?}");
        }
        assert_eq!(quoted("a\0b"), "\"a\\0b\"");
        assert!(quoted(&"a".repeat(300)).ends_with("(300 bytes)"));
    }

    #[test]
    fn mdev_names_round_trip() {
        let parents = ["mtty".to_string()];
        let n = mdev_device("mtty", "mtty-2", 3);
        assert_eq!(n, "mdev-mtty-mtty-2-3");
        assert_eq!(
            parse_mdev_device(&n, &parents),
            Some(("mtty".into(), "mtty-2".into(), 3))
        );
        for not in [
            "mdev-mtty-3",
            "mdev-other-mtty-2-0",
            "mdev-mtty-mtty-2-x",
            "mdev-mtty",
        ] {
            assert_eq!(parse_mdev_device(not, &parents), None, "{not}");
        }
    }

    #[test]
    fn vgpu_names_round_trip() {
        let a: PciAddress = "0000:41:00.0".parse().unwrap();
        let n = vgpu_device(&a, "NVIDIA A10-4Q");
        assert_eq!(n, "vgpu-0000-41-00-0-a10-4q");
        assert_eq!(parse_vgpu_device(&n), Some((a, "a10-4q".into())));
        let m = vgpu_device(&a, "GRID A100DX-1-10C");
        assert_eq!(parse_vgpu_device(&m), Some((a, "a100dx-1-10c".into())));
        let b = vgpu_device(&a, "GRID T4-2B4");
        assert_eq!(parse_vgpu_device(&b), Some((a, "t4-2b4".into())));
        // One instance of the per-instance pool of earlier versions: its GPU and type.
        assert_eq!(
            parse_vgpu_device("vgpu-0000-41-00-0-a10-4q-5"),
            Some((a, "a10-4q".into()))
        );
        assert_eq!(
            parse_vgpu_device("vgpu-0000-41-00-0-t4-2b4-0"),
            Some((a, "t4-2b4".into()))
        );
        for not in [
            "gpu-0000-41-00-0",
            "vgpu-0000-41-00-0",
            "vgpu-0000-41-00-0-",
            "vgpu-0000-41-00-0-a10-4q-",
            "vgpu-0000-41-00-0-a10_4q",
            "vgpu-0000-41-00-0-A10-4Q",
            "vgpu-0000-41-00-0-a10-4q-05",
            "vgpu-0000-41-00-0--4",
        ] {
            assert_eq!(parse_vgpu_device(not), None, "{not}");
        }
        assert_eq!(parse_gpu_device(&n), None);
    }

    #[test]
    fn device_names_round_trip_and_are_dns_labels() {
        let addr: PciAddress = "0000:3B:00.0".parse().unwrap();
        let name = gpu_device(&addr);
        assert_eq!(name, "gpu-0000-3b-00-0");
        assert!(name.len() <= 63);
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
        assert_eq!(parse_gpu_device(&name), Some(addr));
    }

    #[test]
    fn other_names_are_not_gpus() {
        for n in [
            "gpu-0000-3B-00-0",
            "gpu-0000-3b-00",
            "vgpu-0000-3b-00-0",
            "gpu-0000-3b-00-0-1",
            "gpu-0-3b-0-0",
        ] {
            assert_eq!(parse_gpu_device(n), None, "{n}");
        }
    }
}
