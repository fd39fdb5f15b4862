//! Apply = read the node, plan, execute. Independent GPUs are changed in parallel; each GPU's
//! changes run in order (removals first). Nothing is remembered between runs except learnt
//! vendor-path type names, which only apply records: the plan is always derived from sysfs, so a
//! run killed at any point is repaired by the next one. `plan`, `assert` and `export` write
//! nothing.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{HostPaths, Inventory, PciAddress, ReadOptions, Sysfs, Usage, error_chain};
use serde::Serialize;

use crate::config::{Config, ConfigError, Count, Devices, Entry, TypeKey};
use crate::gpu::{self, Gpu, VendorSel};
use crate::plan::{self, Action, Plan, PlanError};

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
    pub fn exit_code(&self) -> u8 {
        match self {
            ApplyError::Config(_) | ApplyError::Invalid(_) => daemon_kit::exit::USAGE,
            ApplyError::Read(_) => daemon_kit::exit::FAILED,
        }
    }
}

impl From<ApplyError> for daemon_kit::Failure {
    fn from(e: ApplyError) -> Self {
        daemon_kit::Failure::new(e.exit_code(), e)
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

/// The vendor-path type names the node's creatable lists show now. A VF stops listing its own
/// type, and a full card lists none, so `apply` records them ([`common::state::vgpu_names`]) for later
/// reads.
fn names_shown(inv: &Inventory) -> Vec<(u32, String)> {
    inv.devices
        .values()
        .filter_map(|d| d.nvidia_vgpu.as_ref())
        .flat_map(|nv| nv.creatable.iter().map(|t| (t.id, t.name.clone())))
        .collect()
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
        match common::inventory::read_parent_mdev_types(paths, &a.to_string()) {
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
        match common::inventory::read_parent_mdev_types(paths, &name) {
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

/// Reads the node's candidate GPUs and who uses their vGPUs. Writes nothing.
pub fn snapshot(opts: &Options) -> Result<Vec<Gpu>, ApplyError> {
    read_gpus(opts, false)
}

/// [`snapshot`]; with `record_names` (apply only) the vendor-path type names the node shows
/// are recorded first ([`common::state::vgpu_names`]).
fn read_gpus(opts: &Options, record_names: bool) -> Result<Vec<Gpu>, ApplyError> {
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
    // One reading of who uses what for the whole node. A source that cannot be read makes
    // every vGPU's user unknown, so nothing is removed; missing vGPUs are still created.
    let usage = Usage::read(&opts.paths);
    let shown = names_shown(&inv);
    if record_names
        && let Err(e) = common::state::vgpu_names::record(&opts.paths, shown.iter().cloned())
    {
        tracing::warn!("cannot record vGPU type names: {}", error_chain(&e));
    }
    let mut names = common::state::vgpu_names::load(&opts.paths);
    names.extend(shown);
    let mut gpus = gpu::discover(&inv, opts.vendor, &usage, &names);
    // sandbox-dp's on-demand pool and sandbox-dra's own their GPUs and mdev parents: a pool
    // file that cannot be read stops here, since any of them might be in it.
    // A pool whose owner is not running (its file left over, e.g. after a relabel) keeps only
    // what has vGPUs, which are its pods'; its other members are the profile's again.
    let pool = common::state::pool::load_owned(&opts.paths).map_err(ApplyError::Read)?;
    let running: Vec<bool> = pool
        .iter()
        .map(|(owner, _)| common::state::pool::owner_running(&opts.paths, owner))
        .collect();
    for g in &mut gpus {
        let found = pool.iter().zip(&running).find(|((_, m), _)| match g.pci {
            Some(a) => m.gpus.contains(&a),
            None => m.parents.contains(&g.name),
        });
        g.pooled = match found {
            Some(((owner, _), true)) => Some(*owner),
            Some(((owner, _), false)) if !g.vgpus.is_empty() => {
                tracing::warn!(gpu = %g.label(), "in {owner}, which is not running; its vGPUs are left alone");
                Some(*owner)
            }
            Some(((owner, _), false)) => {
                tracing::warn!(gpu = %g.label(), "listed in {owner}, which is not running (its pool file is left over): the profile applies to it");
                None
            }
            None => None,
        };
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
    let mut p =
        plan::plan(&read_gpus(opts, true)?, profile, entries).map_err(ApplyError::Invalid)?;
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
            let gpus = read_gpus(opts, true)?;
            let ready = enabled.iter().all(|pf| {
                gpus.iter().any(|g| {
                    g.pci == Some(*pf)
                        && !matches!(
                            g.backend,
                            gpu::Backend::NeedsVfs { .. } | gpu::Backend::Unsupported { .. }
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
    let progress = Progress::new(
        p.gpus
            .iter()
            .filter(|g| g.blocked.is_empty() && !g.after_vfs && !failed.contains_key(&g.index))
            .flat_map(|g| &g.actions)
            .filter(|a| !a.is_removal() && !matches!(a, Action::EnableVfs { .. }))
            .count(),
    );
    let results: Vec<(String, Outcome, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = p
            .gpus
            .iter()
            .map(|g| {
                let sysfs = &sysfs;
                let pre = failed.get(&g.index).cloned();
                let progress = &progress;
                s.spawn(move || {
                    if let Some(o) = pre {
                        return (g.gpu.clone(), o, 0);
                    }
                    run_gpu(sysfs, g, progress)
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

/// Progress lines during a long apply: `created 128/512 vGPUs` every [`Progress::STEP`]
/// creations, and at least every [`Progress::EVERY`] while creations go on. An apply of at
/// most one step prints none.
#[derive(Debug)]
struct Progress {
    total: usize,
    done: std::sync::atomic::AtomicUsize,
    last: std::sync::Mutex<Instant>,
}

impl Progress {
    const STEP: usize = 64;
    const EVERY: Duration = Duration::from_secs(2);

    fn new(total: usize) -> Progress {
        Progress {
            total,
            done: Default::default(),
            last: std::sync::Mutex::new(Instant::now()),
        }
    }

    /// One more vGPU created (by any GPU's worker).
    fn created(&self) {
        let done = self.done.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if self.total <= Self::STEP || done >= self.total {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if done.is_multiple_of(Self::STEP) || last.elapsed() >= Self::EVERY {
            *last = Instant::now();
            tracing::info!("created {done}/{} vGPUs", self.total);
        }
    }
}

fn run_gpu(sysfs: &Sysfs, g: &plan::GpuPlan, progress: &Progress) -> (String, Outcome, usize) {
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
                    if !matches!(a, Action::EnableVfs { .. }) {
                        progress.created();
                    }
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

/// What `export` prints: the node's vGPUs as a config, and who uses which of them.
#[derive(Clone, Debug)]
pub struct Exported {
    /// The node's current vGPUs as a config with one profile.
    pub config: Config,
    /// One line per vGPU in use: the GPU, the vGPU and who uses it.
    pub in_use: Vec<String>,
}

impl Exported {
    /// The config file, the vGPUs in use as comments before it (a parser skips them).
    pub fn to_yaml(&self) -> String {
        let mut s = String::new();
        if !self.in_use.is_empty() {
            s.push_str("# vGPUs in use (apply keeps them until they are free):\n");
            for l in &self.in_use {
                s.push_str(&format!("#   {l}\n"));
            }
        }
        s.push_str(&self.config.to_yaml());
        s
    }
}

/// The node's current vGPUs as a config with one profile, `name`, and who uses them.
pub fn export(opts: &Options, name: &str) -> Result<Exported, ApplyError> {
    let gpus = snapshot(opts)?;
    let in_use = gpus
        .iter()
        .flat_map(|g| {
            g.vgpus.iter().filter(|v| v.in_use()).map(move |v| {
                format!(
                    "{}: {} {}: {}",
                    g.label(),
                    v.label(),
                    v.handle,
                    common::usage::describe(&v.users)
                )
            })
        })
        .collect();
    let mut groups: Vec<(BTreeMap<TypeKey, Count>, Vec<usize>)> = Vec::new();
    for g in &gpus {
        if matches!(g.backend, gpu::Backend::Unsupported { .. }) && g.vgpus.is_empty() {
            continue;
        }
        let mut m: BTreeMap<TypeKey, Count> = BTreeMap::new();
        for v in &g.vgpus {
            // The name's last word is the usual key (`A10-4Q`), unless another type this GPU
            // offers ends in the same word (the mtty sample's "Single/Dual port serial"):
            // then the type id, which the parser reads back unambiguously.
            let by_name = gpu::type_key_of(v.type_name.as_deref(), &v.type_id);
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
    Ok(Exported {
        config: Config {
            version: "v1".into(),
            vgpu_configs,
        },
        in_use,
    })
}
