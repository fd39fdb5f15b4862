//! Moving selected functions onto their VFIO driver and back, one worker per IOMMU group.
//!
//! Within a group the functions are handled in address order (the GPU before its audio
//! function); different groups run in parallel, so a node's bind takes about as long as its
//! slowest GPU. A function already on its target driver is not written to at all. The writes
//! go through the caller's [`Sysfs`], so a daemon's binds reuse its writer threads.

use std::time::{Duration, Instant};

use super::select::{Selection, Target};
use super::{DeviceResult, Outcome};
use crate::state::originals::Originals;
use crate::{Sysfs, error_chain, is_vfio_driver};

/// How the writes are made.
#[derive(Clone, Debug)]
pub struct OpOptions {
    /// The most one function may take, all its writes and waits together.
    pub timeout: Duration,
    /// Unbind a group even when it is in use: a process holds it, kubelet gave it to a pod, or
    /// that cannot be known.
    pub force: bool,
}

impl Default for OpOptions {
    fn default() -> Self {
        OpOptions {
            timeout: Duration::from_secs(30),
            force: false,
        }
    }
}

/// Runs `per_group` on each group of `sel` in parallel (one thread per group) and returns every
/// result, refusals included, in address order.
fn for_each_group<F>(sel: &Selection, per_group: F) -> Vec<DeviceResult>
where
    F: Fn(&[Target]) -> Vec<DeviceResult> + Sync,
{
    let mut results: Vec<DeviceResult> = sel
        .refused
        .iter()
        .map(|r| DeviceResult {
            address: r.address,
            group: r.group,
            outcome: Outcome::Refused {
                reason: r.reason.clone(),
            },
        })
        .collect();
    let per_group = &per_group;
    // One group: on this thread (starting one costs milliseconds on a busy machine).
    if sel.groups.len() == 1 {
        for targets in sel.groups.values() {
            results.extend(per_group(targets));
        }
        results.sort_by_key(|r| r.address);
        return results;
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = sel
            .groups
            .iter()
            .map(|(g, targets)| {
                let spawned = std::thread::Builder::new()
                    .name(format!("group-{g}"))
                    .spawn_scoped(scope, move || per_group(targets));
                (targets, spawned)
            })
            .collect();
        for (targets, h) in handles {
            let joined = match h {
                Ok(h) => h.join().ok(),
                // No thread to be had: do the group here.
                Err(_) => Some(per_group(targets)),
            };
            match joined {
                Some(r) => results.extend(r),
                None => results.extend(targets.iter().map(|t| DeviceResult {
                    address: t.address,
                    group: Some(t.group),
                    outcome: Outcome::Failed {
                        error: format!("the worker of IOMMU group {} panicked", t.group),
                    },
                })),
            }
        }
    });
    results.sort_by_key(|r| r.address);
    results
}

/// Who uses a target that is to leave its driver (see [`super::bind_blockers`]), one sentence
/// each; empty when nobody does.
pub type InUse<'a> = &'a (dyn Fn(&Target) -> Vec<String> + Sync);

/// Binds every target of `sel` to its VFIO driver. A target that is on another driver and in
/// use (`in_use`) is refused and not written to.
pub fn bind_all(
    sysfs: &Sysfs,
    sel: &Selection,
    opts: &OpOptions,
    in_use: InUse<'_>,
) -> Vec<DeviceResult> {
    for_each_group(sel, |targets| {
        let mut out = Vec::with_capacity(targets.len());
        let mut failed: Option<String> = None;
        for t in targets {
            let span = tracing::info_span!("bind", device = %t.address, group = t.group);
            let _g = span.enter();
            let outcome = match &failed {
                Some(first) => Outcome::Failed {
                    error: format!(
                        "not attempted: {first} in the same IOMMU group {} was not bound",
                        t.group
                    ),
                },
                None => bind_one(sysfs, t, opts, in_use),
            };
            match &outcome {
                Outcome::Failed { error } => tracing::warn!(%error, "bind failed"),
                Outcome::Refused { reason } => tracing::warn!(%reason, "bind refused"),
                _ => {}
            }
            if outcome_is_failure(&outcome) && failed.is_none() {
                failed = Some(t.address.to_string());
            }
            out.push(DeviceResult {
                address: t.address,
                group: Some(t.group),
                outcome,
            });
        }
        out
    })
}

fn outcome_is_failure(o: &Outcome) -> bool {
    matches!(o, Outcome::Failed { .. } | Outcome::Refused { .. })
}

fn fail(e: impl std::fmt::Display) -> Outcome {
    Outcome::Failed {
        error: e.to_string(),
    }
}

/// Binds one function: `driver_override`, unbind, `drivers_probe`, verify the driver link and
/// `/dev/vfio/<group>`; all within `opts.timeout`. A function on another driver is first asked
/// about (`in_use`): one in use is refused, with nothing written.
pub fn bind_one(sysfs: &Sysfs, t: &Target, opts: &OpOptions, in_use: InUse<'_>) -> Outcome {
    let deadline = Instant::now() + opts.timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let paths = sysfs.paths();
    let base = sysfs;
    let sysfs = || {
        base.clone()
            .with_timeout(left().max(Duration::from_millis(1)))
    };
    let a = &t.address;

    let current = match sysfs().current_driver(a) {
        Ok(c) => c,
        Err(e) => return fail(error_chain(&e)),
    };
    if current.as_deref() == Some(t.target.as_str()) {
        tracing::debug!(driver = %t.target, "already bound");
        return Outcome::Unchanged { driver: current };
    }
    if let Some(d) = current.as_deref() {
        let users = in_use(t);
        if !users.is_empty() {
            let consequence = if d == "nvidia" {
                "unbinding it from nvidia would hang until its processes exit, and destroy its \
                 vGPUs and VFs"
                    .to_string()
            } else {
                format!("moving it from {d} to {} would take it from them", t.target)
            };
            return Outcome::Refused {
                reason: format!(
                    "{a} is in use ({}); {consequence}, so it is left on {d}",
                    users.join("; ")
                ),
            };
        }
    }

    // Without the target driver the probe binds nothing and the device would be left with no
    // driver at all: check before the first write.
    if !sysfs().driver_registered(&t.target) {
        return fail(format!(
            "{a}: driver {} is not loaded (no {}); nothing was changed",
            t.target,
            paths.pci_drivers().join(&t.target).display()
        ));
    }

    if let Err(e) = sysfs().set_driver_override(a, Some(&t.target)) {
        return fail(error_chain(&e));
    }
    let from = match sysfs().unbind(a) {
        Ok(from) => from,
        Err(e) => {
            // Still on its old driver: put the override back so nothing is half-changed.
            if let Err(e2) = sysfs().set_driver_override(a, t.driver_override.as_deref()) {
                tracing::warn!(error = %error_chain(&e2), "could not restore driver_override");
            }
            return fail(error_chain(&e));
        }
    };
    if let Err(e) = sysfs()
        .drivers_probe(a)
        .and_then(|()| sysfs().wait_for_driver(a, &t.target, left()))
    {
        return fail(give_back(base, t, from.as_deref(), &error_chain(&e)));
    }
    let node = paths.vfio_group_node(t.group);
    loop {
        if node.exists() {
            break;
        }
        if left().is_zero() {
            return fail(format!(
                "{a} is on {} but {} did not appear within {:?}",
                t.target,
                node.display(),
                opts.timeout
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    tracing::info!(from = from.as_deref().unwrap_or("none"), to = %t.target, "bound");
    Outcome::Changed {
        from,
        to: Some(t.target.clone()),
    }
}

/// After a failed probe onto the target: restore the original `driver_override` and, if the
/// device was left with no driver, probe again so its old driver takes it back. Returns the
/// failure to report, with what became of the device.
fn give_back(sysfs: &Sysfs, t: &Target, from: Option<&str>, error: &str) -> String {
    let sysfs = sysfs.clone().with_timeout(Duration::from_secs(10));
    let a = &t.address;
    if let Err(e) = sysfs.set_driver_override(a, t.driver_override.as_deref()) {
        return format!(
            "{error}; restoring driver_override failed too: {}",
            error_chain(&e)
        );
    }
    match sysfs.current_driver(a) {
        Ok(Some(d)) if d == t.target => return error.to_string(),
        Ok(Some(d)) => return format!("{error}; the device is on {d}"),
        _ => {}
    }
    let Some(old) = from else {
        return format!("{error}; the device has no driver, as before");
    };
    let back = sysfs
        .drivers_probe(a)
        .and_then(|()| sysfs.wait_for_driver(a, old, Duration::from_secs(10)));
    match back {
        Ok(()) => {
            tracing::info!(driver = old, "given back to its driver after the failure");
            format!("{error}; the device is back on {old}")
        }
        Err(e) => format!(
            "{error}; giving it back to {old} failed too ({}): it has no driver now; run bind again, or write its address to drivers_probe",
            error_chain(&e)
        ),
    }
}

/// Gives every target of `sel` that is on a VFIO driver back to its default driver. A group in
/// use (`in_use`: one sentence per user of the group, unknown sources included) is refused
/// unless `opts.force`.
pub fn unbind_all(
    sysfs: &Sysfs,
    sel: &Selection,
    opts: &OpOptions,
    in_use: &(dyn Fn(u32) -> Vec<String> + Sync),
    originals: &Originals,
) -> Vec<DeviceResult> {
    for_each_group(sel, |targets| {
        let Some(first) = targets.first() else {
            return Vec::new();
        };
        let group = first.group;
        let on_vfio = targets
            .iter()
            .any(|t| t.driver.as_deref().is_some_and(is_vfio_driver));
        let users = if on_vfio { in_use(group) } else { Vec::new() };
        if !users.is_empty() {
            let users = users.join("; ");
            if !opts.force {
                let reason = format!(
                    "IOMMU group {group} is in use ({users}); not unbinding (--force overrides)"
                );
                return targets
                    .iter()
                    .map(|t| DeviceResult {
                        address: t.address,
                        group: Some(group),
                        outcome: Outcome::Refused {
                            reason: reason.clone(),
                        },
                    })
                    .collect();
            }
            tracing::warn!(group, users = %users, "unbinding a group in use (--force)");
        }
        targets
            .iter()
            .map(|t| {
                let span = tracing::info_span!("unbind", device = %t.address, group);
                let _g = span.enter();
                DeviceResult {
                    address: t.address,
                    group: Some(group),
                    outcome: unbind_one(sysfs, t, opts, originals.get(&t.address)),
                }
            })
            .collect()
    })
}

/// Gives one function back: unbinds it from its VFIO driver and lets the driver it had before
/// `bind` take it again (`original`: `Some(Some(d))` that driver, `Some(None)` no driver, `None`
/// unknown: whichever driver probes, the default). `driver_override` ends cleared. A function
/// not on a VFIO driver is not written to, unless a bind or unbind was cut off after its
/// unbind (no driver, `driver_override` set).
pub fn unbind_one(
    sysfs: &Sysfs,
    t: &Target,
    opts: &OpOptions,
    original: Option<&Option<String>>,
) -> Outcome {
    let deadline = Instant::now() + opts.timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let base = sysfs;
    let sysfs = || {
        base.clone()
            .with_timeout(left().max(Duration::from_millis(1)))
    };
    let a = &t.address;
    let current = match sysfs().current_driver(a) {
        Ok(c) => c,
        Err(e) => return fail(error_chain(&e)),
    };
    let on_vfio = current
        .as_deref()
        .is_some_and(|d| is_vfio_driver(d) || d == t.target);
    // A bind or an unbind cut off between its unbind and its probe left the function with no
    // driver and an override (the VFIO driver, or the original one): giving it back finishes
    // either.
    let cut_off = current.is_none() && t.driver_override.is_some();
    if !on_vfio && !cut_off {
        return Outcome::Unchanged { driver: current };
    }
    let back_to = original
        .cloned()
        .flatten()
        .filter(|d| !is_vfio_driver(d) && *d != t.target);
    let leave_unbound = matches!(original, Some(None));
    // With the original driver in driver_override, the probe binds exactly that driver.
    if let Err(e) = sysfs().set_driver_override(a, back_to.as_deref()) {
        return fail(error_chain(&e));
    }
    let from = match sysfs().unbind(a) {
        Ok(f) => f,
        Err(e) => return fail(error_chain(&e)),
    };
    if !leave_unbound {
        if let Err(e) = sysfs().drivers_probe(a) {
            return fail(error_chain(&e));
        }
        if let Some(d) = &back_to {
            if let Err(e) = sysfs().wait_for_driver(a, d, left()) {
                tracing::warn!(error = %error_chain(&e), "original driver did not take the device; using the default");
            }
            if let Err(e) = sysfs().set_driver_override(a, None) {
                return fail(error_chain(&e));
            }
            if let Ok(None) = sysfs().current_driver(a)
                && let Err(e) = sysfs().drivers_probe(a)
            {
                return fail(error_chain(&e));
            }
        }
    }
    let to = match sysfs().current_driver(a) {
        Ok(d) => d,
        Err(e) => return fail(error_chain(&e)),
    };
    if to.as_deref().is_some_and(is_vfio_driver) {
        return fail(format!(
            "{a}: still on {} after clearing driver_override and reprobing",
            to.as_deref().unwrap_or_default()
        ));
    }
    tracing::info!(to = to.as_deref().unwrap_or("none"), "released");
    Outcome::Changed { from, to }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostPaths;
    use std::fs;
    use testkit::sysfs::{A10, SysfsTree};

    /// A plain tree with one GPU on nvidia: enough to see whether anything is written.
    fn tree() -> (SysfsTree, HostPaths, Target) {
        let dir = SysfsTree::new();
        dir.device("pci0000:00", "0000:41:00.0", A10, Some("nvidia"), 21);
        fs::write(dir.root().join("sys/bus/pci/drivers/nvidia/unbind"), "").unwrap();
        // vfio-pci is not loaded.
        fs::remove_dir(dir.root().join("sys/bus/pci/drivers/vfio-pci")).unwrap();
        let t = Target {
            address: "0000:41:00.0".parse().unwrap(),
            id: "10de:2236".into(),
            group: 21,
            driver: Some("nvidia".into()),
            driver_override: None,
            target: "vfio-pci".into(),
            primary: true,
            vfio_cdev: None,
        };
        let p = HostPaths::new(dir.root());
        (dir, p, t)
    }

    /// The GPU's `driver_override` reads as never set.
    fn assert_override_clear(root: &std::path::Path) {
        let ov = root.join("sys/devices/pci0000:00/0000:41:00.0/driver_override");
        assert_eq!(
            fs::read_to_string(ov).unwrap(),
            "(null)\n",
            "nothing written"
        );
    }

    /// Nothing was written: no override, no unbind.
    fn assert_untouched(root: &std::path::Path) {
        assert_override_clear(root);
        let unbind = root.join("sys/bus/pci/drivers/nvidia/unbind");
        assert_eq!(fs::read_to_string(unbind).unwrap(), "");
    }

    /// Nobody uses anything.
    fn free(_: &Target) -> Vec<String> {
        Vec::new()
    }

    #[test]
    fn a_gpu_in_use_on_nvidia_is_left_alone_and_its_users_named() {
        let (dir, p, t) = tree();
        let users = |_: &Target| {
            vec!["0000:41:00.0: pid 77 (nvidia-persiste) holds /dev/nvidia0".to_string()]
        };
        let out = bind_one(&Sysfs::new(p.clone()), &t, &OpOptions::default(), &users);
        let Outcome::Refused { reason } = out else {
            panic!("{out:?}")
        };
        assert!(reason.starts_with("0000:41:00.0 is in use ("), "{reason}");
        assert!(reason.contains("pid 77 (nvidia-persiste)"), "{reason}");
        assert!(reason.contains("destroy its vGPUs"), "{reason}");
        assert!(reason.ends_with("so it is left on nvidia"), "{reason}");
        assert_untouched(dir.root());
    }

    #[test]
    fn a_device_already_on_its_target_is_not_written() {
        let (dir, p, mut t) = tree();
        t.target = "nvidia".into();
        let out = bind_one(&Sysfs::new(p.clone()), &t, &OpOptions::default(), &free);
        assert_eq!(
            out,
            Outcome::Unchanged {
                driver: Some("nvidia".into())
            }
        );
        assert_override_clear(dir.root());
    }

    #[test]
    fn a_target_driver_that_is_not_loaded_is_refused_before_any_write() {
        let (dir, p, t) = tree();
        let out = bind_one(&Sysfs::new(p.clone()), &t, &OpOptions::default(), &free);
        let Outcome::Failed { error } = out else {
            panic!("{out:?}")
        };
        assert!(error.contains("driver vfio-pci is not loaded"), "{error}");
        assert_untouched(dir.root());
    }

    #[test]
    fn unbind_is_refused_when_who_uses_the_group_is_unknown() {
        let (dir, p, mut t) = tree();
        t.driver = Some("vfio-pci".into());
        let sel = Selection {
            groups: [(t.group, vec![t.clone()])].into(),
            refused: vec![],
        };
        let unknown = |_: u32| vec!["unknown: cannot read the processes' open files".to_string()];
        let out = unbind_all(
            &Sysfs::new(p.clone()),
            &sel,
            &OpOptions::default(),
            &unknown,
            &Originals::new(),
        );
        let Outcome::Refused { reason } = &out[0].outcome else {
            panic!("{out:?}")
        };
        assert!(
            reason.contains("IOMMU group 21 is in use (unknown: cannot read the processes"),
            "{reason}"
        );
        assert!(reason.contains("--force overrides"), "{reason}");
        assert_override_clear(dir.root());
    }

    #[test]
    fn a_missing_device_is_a_named_failure() {
        let (_dir, p, mut t) = tree();
        t.address = "0000:99:00.0".parse().unwrap();
        let out = bind_one(&Sysfs::new(p.clone()), &t, &OpOptions::default(), &free);
        let Outcome::Failed { error } = out else {
            panic!("{out:?}")
        };
        assert!(error.contains("0000:99:00.0"), "{error}");
    }
}
