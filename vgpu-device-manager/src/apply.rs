//! Apply = read the node, plan, execute. Independent GPUs are changed in parallel; each GPU's
//! changes run in order (removals first). Nothing is remembered between runs except learnt
//! vendor-path type names: the plan is always derived from sysfs, so a run killed at any point
//! is repaired by the next one.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{HostPaths, Inventory, PciAddress, ReadOptions, Sysfs, error_chain};
use serde::Serialize;

use crate::config::{Config, ConfigError, Count, Devices, Entry, TypeKey};
use crate::plan::{self, Action, Gpu, Plan, PlanError, VendorSel};

/// Where and how to work.
#[derive(Clone, Debug)]
pub struct Options {
    /// The host root.
    pub paths: HostPaths,
    /// Which devices `devices:` counts.
    pub vendor: VendorSel,
    /// Longest a single sysfs write may take.
    pub write_timeout: Duration,
    /// Longest to wait for newly enabled VFs to offer vGPU types.
    pub vf_wait: Duration,
}

impl Options {
    /// Defaults for a host root.
    pub fn new(paths: HostPaths) -> Self {
        Options {
            paths,
            vendor: VendorSel::Pci(0x10de),
            write_timeout: Duration::from_secs(30),
            vf_wait: Duration::from_secs(20),
        }
    }
}

/// Why an apply did not start, or could not finish reading the node.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The config file is wrong or does not have the profile.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The profile does not fit this node; nothing was changed (VFs enabled to read a GPU's
    /// types are disabled again).
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<PlanError>),
    /// The node could not be read.
    #[error("cannot read the node")]
    Read(#[source] common::Error),
}

impl ApplyError {
    /// The exit status for this error: 2 for a config or profile that does not fit, 1 for a
    /// node that cannot be read.
    pub fn exit_code(&self) -> i32 {
        match self {
            ApplyError::Config(_) | ApplyError::Invalid(_) => 2,
            ApplyError::Read(_) => 1,
        }
    }
}

/// What happened to one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "result")]
pub enum Outcome {
    /// Matches the profile now.
    Applied {
        /// vGPUs created.
        created: usize,
        /// vGPUs removed.
        removed: usize,
        /// vGPUs kept.
        kept: usize,
    },
    /// Left as it was: a vGPU that must go is in use.
    Blocked {
        /// Which vGPUs and who holds them.
        reasons: Vec<String>,
    },
    /// A write failed; the GPU may be part-way (a rerun repairs it).
    Failed {
        /// The error.
        error: String,
        /// Writes done before it.
        done: usize,
    },
}

/// The result of an apply.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The profile.
    pub profile: String,
    /// Per selected GPU: its label and what happened.
    pub gpus: Vec<(String, Outcome)>,
    /// Sysfs writes made.
    pub writes: usize,
}

impl Report {
    /// Every selected GPU matches the profile.
    pub fn success(&self) -> bool {
        self.gpus
            .iter()
            .all(|(_, o)| matches!(o, Outcome::Applied { .. }))
    }

    /// One line per GPU that is not applied, for a label annotation or a log.
    pub fn failure_reason(&self) -> String {
        self.gpus
            .iter()
            .filter_map(|(g, o)| match o {
                Outcome::Applied { .. } => None,
                Outcome::Blocked { reasons } => Some(format!("{g}: {}", reasons.join("; "))),
                Outcome::Failed { error, .. } => Some(format!("{g}: {error}")),
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Human-readable summary.
    pub fn render(&self) -> String {
        let mut s = String::new();
        if self.gpus.is_empty() {
            s.push_str(&format!(
                "profile {:?} selects no GPU on this node\n",
                self.profile
            ));
        }
        for (g, o) in &self.gpus {
            match o {
                Outcome::Applied {
                    created,
                    removed,
                    kept,
                } => s.push_str(&format!(
                    "{g}: applied (kept {kept}, removed {removed}, created {created})\n"
                )),
                Outcome::Blocked { reasons } => {
                    s.push_str(&format!("{g}: left unchanged, in use\n"));
                    for r in reasons {
                        s.push_str(&format!("  {r}\n"));
                    }
                }
                Outcome::Failed { error, done } => {
                    s.push_str(&format!("{g}: FAILED after {done} change(s): {error}\n"))
                }
            }
        }
        s
    }
}

/// Records the vendor-path type names the node shows now: a VF stops listing its own type, and
/// a full card lists none, so names seen earlier are kept ([`common::vgpu_names`]).
fn remember_names(paths: &HostPaths, inv: &Inventory) {
    let seen = inv
        .devices
        .values()
        .filter_map(|d| d.nvidia_vgpu.as_ref())
        .flat_map(|nv| nv.creatable.iter().map(|t| (t.id, t.name.clone())));
    if let Err(e) = common::vgpu_names::remember_all(paths, seen) {
        tracing::warn!("cannot record vGPU type names: {}", common::error_chain(&e));
    }
}

fn read_types_of_one_parent_per_gpu(paths: &HostPaths, inv: &mut Inventory) {
    let mut wanted: Vec<PciAddress> = Vec::new();
    for d in inv
        .devices
        .values()
        .filter(|d| d.is_display() && !d.is_vf())
    {
        if d.mdev_parent {
            wanted.push(d.address);
        } else if let Some(vf) = d
            .virtfns
            .iter()
            .find(|v| inv.device(v).is_some_and(|v| v.mdev_parent))
        {
            wanted.push(*vf);
        }
    }
    for a in wanted {
        match common::inventory::read_parent_mdev_type_summaries(paths, &a.to_string()) {
            Ok(types) => {
                if let Some(p) = inv.mdev_parents.get_mut(&a.to_string()) {
                    p.types = types.clone();
                }
                if let Some(d) = inv.devices.get_mut(&a) {
                    d.mdev_types = types;
                }
            }
            Err(e) => {
                tracing::warn!(parent = %a, "cannot read its mdev types: {}", error_chain(&e))
            }
        }
    }
    // Non-PCI parents (mtty): few, read them all.
    let virtual_parents: Vec<String> = inv
        .mdev_parents
        .values()
        .filter(|p| p.pci.is_none())
        .map(|p| p.name.clone())
        .collect();
    for name in virtual_parents {
        match common::inventory::read_parent_mdev_type_summaries(paths, &name) {
            Ok(types) => {
                if let Some(p) = inv.mdev_parents.get_mut(&name) {
                    p.types = types;
                }
            }
            Err(e) => tracing::warn!(
                parent = name,
                "cannot read its mdev types: {}",
                error_chain(&e)
            ),
        }
    }
    // Instances read without types carry no type name when the driver has no `name` link
    // target; fill it from the types read.
    for m in inv.mdevs.values_mut() {
        if m.type_name.is_none() {
            m.type_name = inv
                .mdev_parents
                .values()
                .flat_map(|p| &p.types)
                .find(|t| t.id == m.type_id)
                .and_then(|t| t.name.clone());
        }
    }
}

/// Reads the node's candidate GPUs.
pub fn snapshot(opts: &Options) -> Result<Vec<Gpu>, ApplyError> {
    // Types are read for one parent per GPU: every VF of a GPU lists the same types, and a
    // GPU has up to 32 VFs of ~25 types each. A VF's identity is its PF's for planning.
    let read = ReadOptions {
        mdev_types: false,
        vf_identity: false,
    };
    let mut inv = Inventory::read_with(&opts.paths, &read).map_err(ApplyError::Read)?;
    read_types_of_one_parent_per_gpu(&opts.paths, &mut inv);
    for u in &inv.unreadable {
        tracing::warn!(path = %u.path.display(), "skipped: {}", u.reason);
    }
    let scan = common::inuse::holders(&opts.paths).map_err(|e| {
        let e = error_chain(&e);
        tracing::warn!("cannot scan processes for open vGPUs: {e}");
        e
    });
    remember_names(&opts.paths, &inv);
    let names = common::vgpu_names::load(&opts.paths);
    let mut gpus = plan::discover(
        &inv,
        opts.vendor,
        scan.as_ref().unwrap_or(&BTreeMap::new()),
        &names,
    );
    if let Err(e) = &scan {
        // Not knowing whether a VM uses a vGPU is not knowing it is free: every existing vGPU
        // counts as in use, so nothing is removed; missing ones are still created.
        for v in gpus.iter_mut().flat_map(|g| g.vgpus.iter_mut()) {
            v.holders.push(common::Holder {
                pid: 0,
                comm: format!("unknown: cannot read the processes: {e}"),
                path: opts.paths.proc().display().to_string(),
            });
        }
    }
    let allocated = kubelet_allocations(&opts.paths);
    for v in gpus.iter_mut().flat_map(|g| g.vgpus.iter_mut()) {
        v.allocated = allocated
            .get(&v.handle.to_string().to_ascii_lowercase())
            .cloned();
    }
    for g in &gpus {
        tracing::debug!(
            gpu = %g.label(),
            backend = ?g.backend,
            types = g.types.len(),
            slots = g.slots.len(),
            vgpus = g.vgpus.len(),
            in_use = g.vgpus.iter().filter(|v| v.in_use()).count(),
            "read"
        );
    }
    Ok(gpus)
}

/// Device IDs kubelet has allocated to pods (`<kubelet-dir>/kubelet_internal_checkpoint`):
/// mdev UUIDs and VF addresses, the IDs sandbox-dp advertises → `pod <uid> container <name>`.
/// A missing or unreadable checkpoint means no allocations.
pub fn kubelet_allocations(paths: &HostPaths) -> BTreeMap<String, String> {
    let path = paths.kubelet_dir().join("kubelet_internal_checkpoint");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return BTreeMap::new();
    };
    let v: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(path = %path.display(), "cannot parse kubelet's checkpoint: {e}");
            return BTreeMap::new();
        }
    };
    fn ids(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::String(s) => out.push(s.to_ascii_lowercase()),
            serde_json::Value::Array(a) => a.iter().for_each(|x| ids(x, out)),
            // Newer kubelets key the IDs by NUMA node.
            serde_json::Value::Object(m) => m.values().for_each(|x| ids(x, out)),
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    let entries = v["Data"]["PodDeviceEntries"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for e in entries {
        let who = format!(
            "pod {} container {}",
            e["PodUID"].as_str().unwrap_or("?"),
            e["ContainerName"].as_str().unwrap_or("?")
        );
        let mut list = Vec::new();
        ids(&e["DeviceIDs"], &mut list);
        for id in list {
            out.insert(id, who.clone());
        }
    }
    out
}

/// Plans `profile` of `config` against the node as it is now. Writes nothing.
pub fn make_plan(opts: &Options, config: &Config, profile: &str) -> Result<Plan, ApplyError> {
    let entries = config.profile(profile)?;
    let gpus = snapshot(opts)?;
    plan::plan(&gpus, profile, entries).map_err(ApplyError::Invalid)
}

/// Makes the node match `profile`.
pub fn apply(opts: &Options, config: &Config, profile: &str) -> Result<Report, ApplyError> {
    let entries = config.profile(profile)?;
    let sysfs = Sysfs::new(opts.paths.clone()).with_timeout(opts.write_timeout);
    let mut writes = 0;
    let mut p = plan::plan(&snapshot(opts)?, profile, entries).map_err(ApplyError::Invalid)?;
    let mut failed: BTreeMap<usize, Outcome> = BTreeMap::new();
    if p.gpus.iter().any(|g| g.after_vfs) {
        let mut enabled = Vec::new();
        for g in p.gpus.iter().filter(|g| g.after_vfs) {
            for a in &g.actions {
                if let Action::EnableVfs { pf, count } = a {
                    tracing::info!(gpu = %g.gpu, "enabling {count} VFs to read its vGPU types");
                    writes += 1;
                    match sysfs.set_sriov_numvfs(pf, *count) {
                        Ok(()) => enabled.push(*pf),
                        Err(e) => {
                            failed.insert(
                                g.index,
                                Outcome::Failed {
                                    error: error_chain(&e),
                                    done: 0,
                                },
                            );
                        }
                    }
                }
            }
        }
        // A VF's driver may probe after `sriov_numvfs` returns: read until every new VF shows
        // its vGPU types (mdev types or the vendor `nvidia/` directory), or until `vf_wait`.
        let start = Instant::now();
        let gpus = loop {
            let gpus = snapshot(opts)?;
            let ready = enabled.iter().all(|pf| {
                gpus.iter().any(|g| {
                    g.pci == Some(*pf)
                        && !matches!(
                            g.backend,
                            plan::Backend::NeedsVfs { .. } | plan::Backend::Unsupported { .. }
                        )
                })
            });
            if ready || start.elapsed() >= opts.vf_wait {
                break gpus;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        p = match plan::plan(&gpus, profile, entries) {
            Ok(p) => p,
            Err(e) => {
                // The types showed the profile does not fit: leave the node as it was found.
                for pf in &enabled {
                    match sysfs.set_sriov_numvfs(pf, 0) {
                        Ok(()) => {
                            tracing::info!(gpu = %pf, "VFs disabled again: the profile does not fit")
                        }
                        Err(re) => {
                            tracing::warn!(gpu = %pf, "cannot disable the VFs enabled to read types: {}", error_chain(&re))
                        }
                    }
                }
                return Err(ApplyError::Invalid(e));
            }
        };
    }
    let results: Vec<(String, Outcome, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = p
            .gpus
            .iter()
            .map(|g| {
                let sysfs = &sysfs;
                let pre = failed.get(&g.index).cloned();
                s.spawn(move || {
                    if let Some(o) = pre {
                        return (g.gpu.clone(), o, 0);
                    }
                    run_gpu(sysfs, g)
                })
            })
            .collect();
        handles
            .into_iter()
            .zip(&p.gpus)
            .map(|(h, g)| {
                h.join().unwrap_or_else(|_| {
                    (
                        g.gpu.clone(),
                        Outcome::Failed {
                            error: "the worker for this GPU panicked".into(),
                            done: 0,
                        },
                        0,
                    )
                })
            })
            .collect()
    });
    let mut report = Report {
        profile: profile.to_string(),
        gpus: Vec::new(),
        writes,
    };
    for (g, o, w) in results {
        report.writes += w;
        report.gpus.push((g, o));
    }
    Ok(report)
}

fn run_gpu(sysfs: &Sysfs, g: &plan::GpuPlan) -> (String, Outcome, usize) {
    let span = tracing::info_span!("gpu", gpu = %g.gpu);
    let _e = span.enter();
    if !g.blocked.is_empty() {
        for b in &g.blocked {
            tracing::warn!("left unchanged: {b}");
        }
        return (
            g.gpu.clone(),
            Outcome::Blocked {
                reasons: g.blocked.clone(),
            },
            0,
        );
    }
    if g.after_vfs {
        return (
            g.gpu.clone(),
            Outcome::Failed {
                error: "its VFs were enabled but offer no vGPU types".into(),
                done: 0,
            },
            0,
        );
    }
    let (mut created, mut removed) = (0, 0);
    for (i, a) in g.actions.iter().enumerate() {
        let r = match a {
            Action::EnableVfs { pf, count } => sysfs.set_sriov_numvfs(pf, *count),
            Action::RemoveMdev { uuid, .. } => sysfs.mdev_remove(uuid),
            Action::ClearVf { vf, .. } => sysfs.set_current_vgpu_type(vf, 0),
            Action::CreateMdev {
                parent, type_id, ..
            } => sysfs.mdev_create(parent, type_id, &uuid::Uuid::new_v4().to_string()),
            Action::SetVf { vf, type_id, .. } => sysfs.set_current_vgpu_type(vf, *type_id),
        };
        match r {
            Ok(()) => {
                if a.is_removal() {
                    removed += 1;
                } else {
                    created += 1;
                }
            }
            Err(e) => {
                let error = format!("{a}: {}", error_chain(&e));
                tracing::error!("{error}");
                return (g.gpu.clone(), Outcome::Failed { error, done: i }, i + 1);
            }
        }
    }
    if created + removed > 0 {
        tracing::info!(created, removed, kept = g.keep.len(), "applied");
    }
    (
        g.gpu.clone(),
        Outcome::Applied {
            created,
            removed,
            kept: g.keep.len(),
        },
        g.actions.len(),
    )
}

/// The node's current vGPUs as a config with one profile, `name`.
pub fn export(opts: &Options, name: &str) -> Result<Config, ApplyError> {
    let gpus = snapshot(opts)?;
    let mut groups: Vec<(BTreeMap<TypeKey, Count>, Vec<usize>)> = Vec::new();
    for g in &gpus {
        if matches!(g.backend, plan::Backend::Unsupported { .. }) && g.vgpus.is_empty() {
            continue;
        }
        let mut m: BTreeMap<TypeKey, Count> = BTreeMap::new();
        for v in &g.vgpus {
            // The name's last word is the usual key (`A10-4Q`), unless another type this GPU
            // offers ends in the same word (the mtty sample's "Single/Dual port serial"):
            // then the type id, which the parser reads back unambiguously.
            let by_name = plan::type_key_of(v.type_name.as_deref(), &v.type_id);
            let ambiguous = g
                .types
                .iter()
                .filter(|t| t.id != v.type_id && t.key().eq_ignore_ascii_case(&by_name))
                .count()
                > 0;
            let key = TypeKey(if ambiguous {
                v.type_id.clone()
            } else {
                by_name
            });
            m.entry(key).or_insert(Count(0)).0 += 1;
        }
        match groups.iter_mut().find(|(k, _)| *k == m) {
            Some((_, ix)) => ix.push(g.index),
            None => groups.push((m, vec![g.index])),
        }
    }
    let all = groups.len() == 1 && groups[0].1.len() == gpus.len();
    if groups.is_empty() {
        groups.push((BTreeMap::new(), Vec::new()));
    }
    let entries: Vec<Entry> = groups
        .into_iter()
        .map(|(m, ix)| Entry {
            devices: if all || ix.is_empty() {
                Devices::All
            } else {
                Devices::Indices(ix)
            },
            device_filter: None,
            vgpu_devices: m,
        })
        .collect();
    let mut vgpu_configs = BTreeMap::new();
    vgpu_configs.insert(name.to_string(), entries);
    Ok(Config {
        version: "v1".into(),
        vgpu_configs,
    })
}
