//! The plain tree: the read-only figures measured on a copy of the simulated node on tmpfs
//! (reads at the cost of real sysfs), each beside its limit: the same reads replayed by a bare
//! loop ([`crate::harness::limit`]), plus what the figure costs however little the daemon does,
//! the cheapest process start or a bare ListAndWatch list ([`crate::harness::baseline`]).
//!
//! Nodes are prepared on node-sim (GPUs bound, vGPUs created), copied, and the simulator
//! unmounted. Figures: vfio-manager `status`, vgpu-device-manager `assert` and `plan` and their
//! peak RSS, sandbox-dp `list`, and sandbox-dp as a daemon ([`super::plain_dp`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};

use crate::Cli;
use crate::harness::baseline;
use crate::harness::bins::{Bins, linkage};
use crate::harness::limit::{Limit, limit};
use crate::harness::process::{Invocation, ok, peak_rss_kib, run};
use crate::harness::report::{Report, mib, need};
use crate::harness::stats::{Summary, fmt_duration, fmt_summary, summarize};
use crate::harness::strace;
use crate::harness::topology::{builtin, generated, mount};
use crate::harness::tree::PlainTree;
use crate::sections::dp::{Prepare, biggest, dp_list, prep_a10_4q, prep_l40s_1q, prep_passthrough};
use crate::sections::plain_dp::{self, LIST_RUNS, Removal};
use crate::sections::vgpu::{config_file, vgpu};

/// Replays per limit (after one to warm the caches).
pub const REPLAYS: usize = 10;

/// Runs of the cheapest process start.
const START_RUNS: usize = 100;

/// The most × limit a read-only figure may be.
const LIMIT_GOAL: f64 = 3.0;

/// Timed runs of each one-shot command per `--runs`: a run takes milliseconds, and a median of
/// three is at the mercy of one slow spell.
const CLI_RUNS_PER: usize = 5;

/// Timed runs of each one-shot command: `--plain-runs`, or [`CLI_RUNS_PER`] × `--runs`.
fn cli_runs(cli: &Cli) -> usize {
    cli.plain_runs.unwrap_or(cli.runs * CLI_RUNS_PER)
}

/// One node on the plain tree and what is measured on it.
pub struct PlainNode {
    pub label: String,
    pub tree: PlainTree,
    /// vfio-manager `status` (its GPUs are on vfio-pci).
    pub vfio: bool,
    /// vgpu-device-manager: the profile applied, and the one `plan` switches to.
    pub vgpu: Option<(&'static str, &'static str)>,
    /// sandbox-dp.
    pub dp: bool,
    /// A vGPU VF's removal as node-sim made it (vendor-path nodes).
    pub removal: Option<Removal>,
}

struct NodeSpec {
    topo: node_sim::Topology,
    label: &'static str,
    prepare: Prepare,
    vfio: bool,
    vgpu: Option<(&'static str, &'static str)>,
    dp: bool,
    removal: bool,
}

fn specs() -> Result<Vec<NodeSpec>> {
    let passthrough = |topo, label| NodeSpec {
        topo,
        label,
        prepare: Box::new(prep_passthrough),
        vfio: true,
        vgpu: None,
        dp: true,
        removal: false,
    };
    Ok(vec![
        passthrough(builtin("2xA10")?, "2xA10 passthrough"),
        passthrough(builtin("8xA100")?, "8xA100 passthrough"),
        passthrough(generated("A10", 16)?, "16xA10 passthrough"),
        NodeSpec {
            topo: builtin("2xA10")?,
            label: "2xA10 A10-4Q (12 mdevs)",
            prepare: Box::new(prep_a10_4q),
            vfio: false,
            vgpu: Some(("A10-4Q", "A10-8Q")),
            dp: true,
            removal: false,
        },
        NodeSpec {
            topo: builtin("8xA100")?,
            label: "8xA100 A100DX-4C (160 mdevs)",
            prepare: Box::new(|b: &Bins, root: &Path, cfg: &Path| {
                ok(vgpu(b, root, cfg, "apply", "A100DX-4C")?, "apply A100DX-4C").map(|_| ())
            }),
            vfio: false,
            vgpu: Some(("A100DX-4C", "A100DX-8C")),
            dp: false,
            removal: false,
        },
        NodeSpec {
            topo: generated("L40S", 16)?,
            label: "16xL40S L40S-1Q (512 VF vGPUs)",
            prepare: Box::new(prep_l40s_1q),
            vfio: false,
            vgpu: Some(("L40S-1Q", "L40S-2Q")),
            dp: true,
            removal: true,
        },
    ])
}

/// Prepares each node on node-sim and copies it onto a tmpfs.
fn nodes(b: &Bins, cfg: &Path) -> Result<Vec<PlainNode>> {
    let mut out = Vec::new();
    for s in specs()? {
        let sim = mount(&s.topo);
        (s.prepare)(b, sim.root(), cfg).with_context(|| format!("preparing {}", s.label))?;
        let tree = PlainTree::copy_of(sim.root())?;
        let removal = if s.removal {
            let list = dp_list(b, sim.root())?;
            let dev = &biggest(&list)?.devices[0].id;
            Some(Removal::record(sim.root(), dev)?)
        } else {
            None
        };
        let st = tree.stats();
        eprintln!(
            "plain tree {}: {} directories, {} files, {} links, {} device nodes",
            s.label, st.dirs, st.files, st.links, st.nodes
        );
        out.push(PlainNode {
            label: s.label.to_string(),
            tree,
            vfio: s.vfio,
            vgpu: s.vgpu,
            dp: s.dp,
            removal,
        });
    }
    Ok(out)
}

/// What the figures' reads may touch: the node, and the files named on the command line.
#[derive(Clone)]
pub struct Inputs {
    pub root: PathBuf,
    pub files: Vec<PathBuf>,
}

impl Inputs {
    /// The node's tree and `files`.
    pub fn new(n: &PlainNode, files: &[PathBuf]) -> Inputs {
        Inputs {
            root: n.tree.root().to_path_buf(),
            files: files.to_vec(),
        }
    }

    /// Whether a read of `p` belongs to the limit.
    pub fn keep(&self, p: &Path) -> bool {
        p.starts_with(&self.root) || self.files.iter().any(|f| f == p)
    }
}

/// Where the strace logs of the limits go: `--traces DIR` (kept), a temporary directory, or
/// nowhere when strace is missing.
pub struct Tracer {
    dir: Option<PathBuf>,
    _tmp: Option<tempfile::TempDir>,
}

impl Tracer {
    fn new(keep: Option<&Path>) -> Result<Tracer> {
        if !strace::available() {
            return Ok(Tracer {
                dir: None,
                _tmp: None,
            });
        }
        if let Some(d) = keep {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            return Ok(Tracer {
                dir: Some(d.to_path_buf()),
                _tmp: None,
            });
        }
        let tmp = tempfile::tempdir()?;
        Ok(Tracer {
            dir: Some(tmp.path().to_path_buf()),
            _tmp: Some(tmp),
        })
    }

    /// A fresh log path named after the node and the figure, or `None` without strace.
    pub fn log(&self, node: &str, figure: &str) -> Option<PathBuf> {
        let name: String = format!("{node} {figure}")
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let p = self.dir.as_ref()?.join(format!("{name}.strace"));
        let _ = std::fs::remove_file(&p);
        Some(p)
    }
}

/// The limit of what a log recorded, all of it or between two times.
pub fn limit_of(log: &Path, inputs: &Inputs, window: Option<(u64, u64)>) -> Result<Limit> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    let trace = strace::parse(&text, &|p| inputs.keep(p));
    let calls = match window {
        Some((a, b)) => trace.window(a, b),
        None => trace.all(),
    };
    Ok(limit(&calls, REPLAYS))
}

/// A one-shot command: `runs` timed runs, and its limit from one traced run.
fn cli_figure(
    inv: &Invocation,
    runs: usize,
    tracer: &Tracer,
    inputs: &Inputs,
    node: &str,
    what: &str,
) -> Result<(Summary, Option<Limit>)> {
    let mut walls = Vec::with_capacity(runs);
    for _ in 0..runs {
        walls.push(ok(run(&mut inv.command())?, what)?.wall);
    }
    let limit = match tracer.log(node, what) {
        Some(log) => {
            ok(run(&mut inv.traced(&log))?, what)?;
            Some(limit_of(&log, inputs, None)?)
        }
        None => None,
    };
    Ok((need(summarize(&walls))?, limit))
}

/// `bin ARGS --host-root ROOT`.
fn on_node(bin: &Path, args: &[&dyn AsRef<std::ffi::OsStr>], n: &PlainNode) -> Invocation {
    let mut inv = Invocation::new(bin, args);
    inv.args.push("--host-root".into());
    inv.args.push(n.tree.root().into());
    inv
}

/// A one-shot command's row on a node: `args` then `--host-root`, with `files` (named on the
/// command line) counted in its limit.
fn cli_row(
    cli: &Cli,
    tracer: &Tracer,
    n: &PlainNode,
    bin: &Path,
    args: &[&dyn AsRef<std::ffi::OsStr>],
    files: &[PathBuf],
    figure: String,
) -> Result<Row> {
    let inv = on_node(bin, args, n);
    let (s, l) = cli_figure(
        &inv,
        cli_runs(cli),
        tracer,
        &Inputs::new(n, files),
        &n.label,
        &figure,
    )?;
    Ok(Row::time(&n.label, figure, s, l))
}

/// One row of a plain-tree table.
pub struct Row {
    pub node: String,
    pub figure: String,
    pub value: Value,
    pub limit: Option<Limit>,
    /// What the figure costs beyond its reads however little the daemon does, added to its
    /// limit.
    pub base: Option<Base>,
    pub goal: String,
}

/// A cost added to a limit that is not a read ([`crate::harness::baseline`]).
#[derive(Clone, Copy, Debug)]
pub struct Base {
    /// `start`: the cheapest process start; for sandbox-dp, the same step taken by a bare
    /// device plugin process (`bare plugin: file removed → list`, `… created → list`,
    /// `bare plugin's connect + list`, `start + bare plugin's dial + Register`).
    pub what: &'static str,
    pub time: Duration,
    /// The part of `time` that is the cheapest process start (zero for a base with no start).
    pub start: Duration,
}

/// A row's figure.
pub enum Value {
    Time(Summary),
    Memory(u64),
    Skipped(String),
}

impl Row {
    pub fn time(node: &str, figure: impl Into<String>, s: Summary, limit: Option<Limit>) -> Row {
        Row {
            node: node.to_string(),
            figure: figure.into(),
            value: Value::Time(s),
            limit,
            base: None,
            goal: String::new(),
        }
    }

    pub fn memory(node: &str, figure: impl Into<String>, kib: u64) -> Row {
        Row {
            node: node.to_string(),
            figure: figure.into(),
            value: Value::Memory(kib),
            limit: None,
            base: None,
            goal: String::new(),
        }
    }

    /// Adds `base` to the limit.
    pub fn plus(mut self, base: Option<Base>) -> Row {
        self.base = base;
        self
    }

    pub fn goal(mut self, g: impl Into<String>) -> Row {
        self.goal = g.into();
        self
    }

    /// The whole limit: the reads replayed, and the base.
    fn limit_time(&self) -> Option<Duration> {
        let l = self.limit.as_ref()?;
        Some(l.time + self.base.map(|b| b.time).unwrap_or_default())
    }

    /// The limit with the base's process start replaced by `noop`; `None` when the base has no
    /// process start. (`start` is part of the base's time, so the difference cannot go below
    /// zero; it saturates rather than panic if a base were ever built otherwise.)
    fn floor(&self, noop: Duration) -> Option<Duration> {
        let base = self.base.filter(|b| !b.start.is_zero())?;
        Some(self.limit_time()?.saturating_sub(base.start) + noop)
    }

    fn times_limit(&self) -> Option<f64> {
        let Value::Time(s) = &self.value else {
            return None;
        };
        let t = self.limit_time().filter(|t| !t.is_zero())?;
        Some(s.median.as_secs_f64() / t.as_secs_f64())
    }
}

/// `≤ 0.5 ms: met` (or `missed`) for a median; `text` is the goal as written.
pub fn at_most(median: Duration, goal: Duration, text: &str) -> String {
    format!(
        "≤ {text}: {}",
        if median <= goal { "met" } else { "missed" }
    )
}

fn table(r: &mut Report, rows: &[Row]) {
    r.table(&[
        "node",
        "figure",
        "median (min–max)",
        "limit: reads (calls replayed) + base",
        "× limit",
        "goal",
    ]);
    for row in rows {
        let value = match &row.value {
            Value::Time(s) => fmt_summary(s),
            Value::Memory(kib) => mib(*kib),
            Value::Skipped(why) => format!("skipped: {why}"),
        };
        let limit = match (&row.value, &row.limit) {
            (Value::Time(_), Some(l)) => {
                let mut s = if l.calls == 0 {
                    "no reads".to_string()
                } else {
                    format!("{} ({} calls)", fmt_duration(l.time), l.calls)
                };
                if l.differed > 0 {
                    s.push_str(&format!("; {} opens differed", l.differed));
                }
                if let (Some(b), Some(t)) = (row.base, row.limit_time()) {
                    s = format!(
                        "{} = {s} + {} {}",
                        fmt_duration(t),
                        fmt_duration(b.time),
                        b.what
                    );
                }
                s
            }
            (Value::Time(_), None) => "– (no strace)".into(),
            _ => String::new(),
        };
        let times = row
            .times_limit()
            .map(|x| format!("{x:.1}×"))
            .unwrap_or_else(|| "–".into());
        r.row(&[
            row.node.clone(),
            row.figure.clone(),
            value,
            limit,
            times,
            row.goal.clone(),
        ]);
    }
    r.line("");
}

pub async fn bench(cli: &Cli, b: &Bins, r: &mut Report) -> Result<()> {
    let (_dir, cfg) = config_file()?;
    let cfg = cfg.canonicalize()?;
    let tracer = Tracer::new(cli.traces.as_deref())?;
    let pci_ids = cli.pci_ids.canonicalize().ok().filter(|p| p.is_file());
    r.line("## Plain tree");
    r.line("");
    r.line(format!("Each node prepared on node-sim, then copied onto a tmpfs as plain files, directories and symlinks (device nodes as empty files), and the daemons run with `--host-root` at the copy: reads cost what real sysfs reads cost, not a FUSE round trip. Read-only figures only, each the median (min–max) of {} timed runs of a one-shot command or {} runs of the daemon ({}). **limit**: the reads the daemon made for that figure (recorded once under strace: opens, reads, directory listings, stats, link reads, of the node's files and of the files named on its command line), replayed in order by a bare loop, median of {REPLAYS}, plus a **base** where the figure has a cost no daemon can avoid: **start**, for a figure that starts a process, the median spawn → exit of a static executable that only exits (measured here: {START_RUNS} runs in 5 batches 0.1 s apart, the quietest batch's median, so that a spell of noise does not raise the base); for sandbox-dp's figures that end with a registration or a ListAndWatch message, the same step taken by a **bare plugin** (`gpu-vm-bare-plugin`, built as the daemons are): a process of its own on a current-thread runtime, as the daemon, that registers as many resources with the same test kubelet (each on a new connection, all at once; timed from its first dial to the kubelet holding them, and added to **start** for start → registered), serves a prebuilt list of the biggest resource's size (**connect + list**: the first ListAndWatch on a new connection), and sends it again with one device's health flipped when inotify tells it a watched file was removed or created (**file removed → list**, **file created → list**: the health reactions, and the vGPU removed / restored reactions), with nothing read, checked or logged; each of its {LIST_RUNS} runs a fresh process taking the steps in the daemon's order, so that each is taken first in a new process or after the same idle, as the daemon's are. **× limit** = median / (reads + base); goal ≤ {LIMIT_GOAL}×, judged on every row with a limit. What start-up costs beyond the base is the daemon's (each binary's `--version`, table below, beside a Rust executable of the same build that only exits: what any Rust program costs to start here).", cli_runs(cli), plain_dp::daemon_runs(cli), match cli.plain_runs {
        None => format!("{CLI_RUNS_PER} and {} × `--runs`", plain_dp::DAEMON_RUNS_PER),
        Some(_) => "`--plain-runs`".into(),
    }));
    r.line("");
    if !strace::available() {
        r.line("skipped: limits: no strace on this machine (tests/setup.sh installs it).");
        r.line("");
    }
    let Startup { base: start, noop } = startup(cli, b, r)?;
    let nodes = nodes(b, &cfg)?;
    let mut rows = Vec::new();
    r.line("### vfio-manager");
    r.line("");
    for n in nodes.iter().filter(|n| n.vfio) {
        rows.push(
            cli_row(
                cli,
                &tracer,
                n,
                &b.vfio,
                &[&"status"],
                &[],
                "`status`".into(),
            )?
            .plus(start),
        );
    }
    table(r, &rows);
    let mut all = std::mem::take(&mut rows);

    r.line("### vgpu-device-manager");
    r.line("");
    for n in &nodes {
        let Some((p1, p2)) = n.vgpu else { continue };
        let mut rss = 0;
        for (sub, profile, figure) in [
            ("assert", p1, format!("`assert` {p1}")),
            ("plan", p2, format!("`plan` → {p2}")),
        ] {
            let args: [&dyn AsRef<std::ffi::OsStr>; 5] = [&sub, &"-f", &cfg, &"-c", &profile];
            rows.push(
                cli_row(
                    cli,
                    &tracer,
                    n,
                    &b.vgpu,
                    &args,
                    std::slice::from_ref(&cfg),
                    figure,
                )?
                .plus(start),
            );
            rss = rss.max(peak_rss_kib(&mut on_node(&b.vgpu, &args, n).command())?);
        }
        rows.push(Row {
            node: n.label.clone(),
            figure: "peak RSS (`assert`, `plan`)".into(),
            value: Value::Memory(rss),
            limit: None,
            base: None,
            goal: format!(
                "≤ 8 MB: {}",
                if rss * 1024 <= 8_000_000 {
                    "met"
                } else {
                    "missed"
                }
            ),
        });
    }
    table(r, &rows);
    all.append(&mut rows);

    r.line("### sandbox-dp");
    r.line("");
    r.line(format!("`list`; start → every resource registered with the test kubelet, without and with the host's pci.ids (`--pci-ids {}`); the first ListAndWatch answer; a device's `/dev/vfio/<group>` file removed → that device Unhealthy in ListAndWatch, and created again → Healthy (inotify alone: no uevent is sent); on the vendor-path node, a vGPU removed → update and restored → update: the files node-sim changes for `current_vgpu_type` ← 0 (and back) written to the copy, the group's device file removed (created), and the `change` uevent the kernel would send, synthesized by the bench on udev's netlink group; update = the device Unhealthy or gone. RSS after registration. Goals: register with pci.ids ≤ 1.5× without, health reaction ≤ 0.5 ms, removal → update on the 512-VF node ≤ 10 ms.", cli.pci_ids.display()));
    r.line("");
    if pci_ids.is_none() {
        r.line(format!(
            "skipped: register with pci.ids: no pci.ids at {} (Debian package `pci.ids`; tests/setup.sh installs it).",
            cli.pci_ids.display()
        ));
        r.line("");
    }
    let ids: Vec<PathBuf> = pci_ids.iter().cloned().collect();
    for n in nodes.iter().filter(|n| n.dp) {
        let list = [&"list" as &dyn AsRef<std::ffi::OsStr>, &"--json"];
        rows.push(cli_row(cli, &tracer, n, &b.dp, &list, &[], "`list`".into())?.plus(start));
        let inputs = Inputs::new(n, &ids);
        match plain_dp::figures(cli, b, n, pci_ids.as_deref(), &tracer, &inputs, start).await {
            Ok(mut x) => rows.append(&mut x),
            Err(e) => {
                let why = format!("{e:#}").replace('|', "/").replace('\n', " ");
                eprintln!("{}: {why}", n.label);
                rows.push(Row {
                    node: n.label.clone(),
                    figure: "daemon".into(),
                    value: Value::Skipped(format!("failed: {why}")),
                    limit: None,
                    base: None,
                    goal: String::new(),
                });
            }
        }
    }
    table(r, &rows);
    all.append(&mut rows);

    let worst = all
        .iter()
        .filter_map(|row| row.times_limit().map(|x| (x, row)))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((x, row)) = worst {
        r.line(format!(
            "Largest × limit: {x:.1}× ({}, {}); goal ≤ {LIMIT_GOAL}×: {}.",
            row.figure,
            row.node,
            if x <= LIMIT_GOAL { "met" } else { "missed" }
        ));
        r.line("");
    }
    if let Some(noop) = noop {
        floors(r, &all, noop);
    }
    Ok(())
}

/// The rows above the goal, each beside its floor: its limit with the cheapest process start
/// replaced by `noop`'s (a Rust executable of the same build that only exits), i.e. what the
/// figure would cost if the daemon's own work cost nothing. A row whose floor is above the goal
/// cannot meet it here in a program built as the daemons are.
fn floors(r: &mut Report, rows: &[Row], noop: Duration) {
    let over: Vec<(f64, &Row)> = rows
        .iter()
        .filter_map(|row| row.times_limit().map(|x| (x, row)))
        .filter(|(x, _)| *x > LIMIT_GOAL)
        .collect();
    if over.is_empty() {
        return;
    }
    r.line(format!(
        "The rows above {LIMIT_GOAL}×, each beside its **floor**: its limit with the base's process start replaced by `gpu-vm-noop`'s ({}), what the figure would cost if the daemon's own start and work cost nothing more than a Rust program of the same build that only exits.",
        fmt_duration(noop)
    ));
    r.line("");
    r.table(&[
        "node",
        "figure",
        "median",
        "× limit",
        "floor: reads + base − start + no-op",
        "floor × limit",
    ]);
    let mut beyond = 0;
    for (x, row) in &over {
        let Value::Time(s) = &row.value else {
            continue;
        };
        let floor = row
            .floor(noop)
            .zip(row.limit_time())
            .filter(|(_, l)| !l.is_zero());
        let (floor_text, floor_x) = match floor {
            Some((f, l)) => {
                let fx = f.as_secs_f64() / l.as_secs_f64();
                if fx > LIMIT_GOAL {
                    beyond += 1;
                }
                // Two decimals: a floor just above the goal must not read as the goal.
                (fmt_duration(f), format!("{fx:.2}×"))
            }
            None => ("– (no process start in its base)".into(), "–".into()),
        };
        r.row(&[
            row.node.clone(),
            row.figure.clone(),
            fmt_duration(s.median),
            format!("{x:.1}×"),
            floor_text,
            floor_x,
        ]);
    }
    r.line("");
    r.line(match beyond {
        0 => format!(
            "Every row above {LIMIT_GOAL}× is within it at its floor: what puts it above is the daemons' own start and work."
        ),
        1 => format!(
            "1 of the {} rows above {LIMIT_GOAL}× is above it at its floor: on this host no program built as the daemons are could bring it within {LIMIT_GOAL}× of its limit; the others are above it by the daemons' own start and work.",
            over.len()
        ),
        k => format!(
            "{k} of the {} rows above {LIMIT_GOAL}× are above it at their floor: on this host no program built as the daemons are could bring them within {LIMIT_GOAL}× of their limits; the others are above it by the daemons' own start and work.",
            over.len()
        ),
    });
    r.line("");
}

/// What [`startup`] measured that the rows are judged with.
struct Startup {
    /// The cheapest process start, the base of the limits of figures that start a process.
    base: Option<Base>,
    /// The median start and exit of a Rust executable of the same build that does nothing
    /// (`gpu-vm-noop`): the least any program built as the daemons are costs to start here.
    noop: Option<Duration>,
}

/// Process start-up: each binary's `--version`, which reads nothing of the node, beside the
/// cheapest process start ([`baseline::process_start`]) and a Rust executable that only exits,
/// each of those two taken from its quietest batch.
fn startup(cli: &Cli, b: &Bins, r: &mut Report) -> Result<Startup> {
    r.table(&["process start-up", "median (min–max)", "page faults"]);
    let least = baseline::process_start(START_RUNS)?;
    match &least {
        Some(s) => r.row(&[
            "a static executable that only exits (129 bytes): the base (its quietest batch)".into(),
            fmt_summary(&s.time),
            s.faults.to_string(),
        ]),
        None => r.row(&[
            "a static executable that only exits".into(),
            "skipped: built for x86-64 only".into(),
            String::new(),
        ]),
    }
    // Measured as the base is, its quietest batch: the floors it gives err low, never claiming
    // a row out of reach because of a slow spell.
    let mut noop = None;
    if let Some(bin) = &b.noop
        && let Some(s) = baseline::quietest(bin, START_RUNS)?
    {
        r.row(&[
            format!(
                "a Rust executable built as the daemons are that only exits (`gpu-vm-noop`, {}): the loader's relocations, glibc's and Rust's set-up (its quietest batch)",
                linkage(bin)
            ),
            fmt_summary(&s.time),
            s.faults.to_string(),
        ]);
        noop = Some(s.time.median);
    }
    let mut timed = |what: String, cmd: &mut dyn FnMut() -> Command| -> Result<()> {
        let mut walls = Vec::new();
        let mut faults = Vec::new();
        for _ in 0..cli_runs(cli).max(5) {
            let f = ok(run(&mut cmd())?, &what)?;
            walls.push(f.wall);
            faults.push(f.minor_faults);
        }
        r.row(&[
            what,
            fmt_summary(&summarize(&walls).ok_or_else(|| anyhow!("no runs"))?),
            baseline::median_faults(faults).to_string(),
        ]);
        Ok(())
    };
    for (name, bin) in [
        ("vfio-manager", &b.vfio),
        ("vgpu-device-manager", &b.vgpu),
        ("sandbox-dp", &b.dp),
    ] {
        timed(
            format!("{name} `--version` ({})", linkage(bin)),
            &mut || {
                let mut c = Command::new(bin);
                c.arg("--version");
                c
            },
        )?;
    }
    r.line("");
    Ok(Startup {
        base: least.map(|s| Base {
            what: "start",
            time: s.time.median,
            start: s.time.median,
        }),
        noop,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: f64) -> Duration {
        Duration::from_secs_f64(x / 1000.0)
    }

    /// A row of median `median` whose limit is `reads` plus a base of `base`, `start` of it the
    /// process start.
    fn row(median: f64, reads: f64, base: f64, start: f64) -> Row {
        let s = Summary {
            median: ms(median),
            min: ms(median),
            max: ms(median),
            p99: ms(median),
            n: 1,
        };
        let limit = Limit {
            time: ms(reads),
            calls: 10,
            differed: 0,
        };
        Row::time("node", "figure", s, Some(limit)).plus(Some(Base {
            what: "start",
            time: ms(base),
            start: ms(start),
        }))
    }

    #[test]
    fn a_floor_swaps_the_start_for_the_no_op_and_counts_the_rows_out_of_reach() {
        // 1.4 / (0.1 + 0.2) = 4.7×; floor 0.1 + 0.8 = 0.9 ms, exactly 3×: within reach.
        let within = row(1.4, 0.1, 0.2, 0.2);
        assert_eq!(within.floor(ms(0.8)), Some(ms(0.9)));
        // 2.0 / (0.05 + 0.2) = 8×; floor 0.05 + 0.8 = 0.85 ms, 3.4×: out of reach.
        let beyond = row(2.0, 0.05, 0.2, 0.2);
        // A base with no process start (the bare plugin's steps alone) has no floor.
        let no_start = row(2.0, 0.05, 0.2, 0.0);
        assert_eq!(no_start.floor(ms(0.8)), None);
        // Within the goal: not listed.
        let fine = row(0.5, 0.1, 0.2, 0.2);

        let mut r = Report::default();
        floors(&mut r, &[within, beyond, no_start, fine], ms(0.8));
        let text = r.text();
        assert!(text.contains("| 0.900 ms | 3.00× |"), "{text}");
        assert!(text.contains("| 0.850 ms | 3.40× |"), "{text}");
        assert!(text.contains("– (no process start in its base)"), "{text}");
        assert!(!text.contains("| 0.500 ms |"), "{text}");
        assert!(
            text.contains("1 of the 3 rows above 3× is above it at its floor"),
            "{text}"
        );

        let mut r = Report::default();
        floors(&mut r, &[row(1.4, 0.1, 0.2, 0.2)], ms(0.8));
        assert!(
            r.text()
                .contains("Every row above 3× is within it at its floor"),
            "{}",
            r.text()
        );
    }
}
