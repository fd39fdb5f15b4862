//! One command-line shape for the four binaries (docs/conventions.md, "One command line"),
//! checked on the built binaries as a user runs them: one table, not a copy per binary.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on setup failures

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// What differs between the binaries, each for a reason docs/conventions.md gives.
struct Shape {
    name: &'static str,
    /// Runs its daemon when given no command (the GPU Operator runs sandbox-dp without
    /// arguments); the others need one, as their other commands change the node.
    daemon_by_default: bool,
    /// Its daemon cannot run without `--node-name`; these arguments take it to that check.
    needs_node_name: Option<&'static [&'static str]>,
    /// Refuses `--vendor any`: it binds whole GPUs to VFIO.
    refuses_any_vendor: bool,
    /// A duration flag of its daemon.
    duration_flag: &'static str,
}

const SHAPES: [Shape; 4] = [
    Shape {
        name: "vfio-manager",
        daemon_by_default: false,
        needs_node_name: None,
        refuses_any_vendor: true,
        duration_flag: "--resync-interval",
    },
    Shape {
        name: "vgpu-device-manager",
        daemon_by_default: false,
        needs_node_name: Some(&["-f", "/nonexistent/config.yaml"]),
        refuses_any_vendor: false,
        duration_flag: "--retry-min",
    },
    Shape {
        name: "sandbox-dp",
        daemon_by_default: true,
        needs_node_name: None,
        refuses_any_vendor: false,
        duration_flag: "--resync-interval",
    },
    Shape {
        name: "sandbox-dra",
        daemon_by_default: true,
        needs_node_name: Some(&[]),
        refuses_any_vendor: true,
        duration_flag: "--resync-interval",
    },
];

/// The flags every daemon takes, and the environment variables they read.
const DAEMON_FLAGS: [&str; 6] = [
    "--host-root",
    "--log-format",
    "--vendor",
    "--node-name",
    "--kubeconfig",
    "--metrics-addr",
];
const DAEMON_ENV: [&str; 4] = ["HOST_ROOT", "LOG_FORMAT", "NODE_NAME", "METRICS_ADDR"];

fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| cli_shape::binaries().unwrap_or_else(|e| panic!("{e}")))
}

/// Runs `name` with `args`, none of the environment the binaries read.
fn run(name: &str, args: &[&str]) -> Output {
    let mut cmd = Command::new(bin_dir().join(name));
    cmd.args(args);
    for var in [
        "HOST_ROOT",
        "KUBELET_DIR",
        "POD_RESOURCES_SOCKET",
        "LOG_FORMAT",
        "RUST_LOG",
        "NODE_NAME",
        "KUBECONFIG",
        "METRICS_ADDR",
        "VGPU_DM_CONFIG_FILE",
        "VGPU_DM_SELECTED_CONFIG",
        "CONFIG_FILE",
        "DEFAULT_VGPU_CONFIG",
        "DRIVER_NAME",
        "KUBELET_ROOT",
        "CDI_ROOT",
        "VGPU",
        "UNPREPARE",
    ] {
        cmd.env_remove(var);
    }
    cmd.output()
        .unwrap_or_else(|e| panic!("running {name}: {e}"))
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The subcommands `--help` lists (not `help`), each with its aliases.
fn commands(help: &str) -> Vec<(String, Vec<String>)> {
    // Each entry: its first line names it, indented lines continue its description.
    let mut entries: Vec<String> = Vec::new();
    let mut inside = false;
    for line in help.lines() {
        if line.starts_with("Commands:") {
            inside = true;
        } else if inside && !line.is_empty() && !line.starts_with(' ') {
            break;
        } else if inside && line.starts_with("  ") && !line.starts_with("   ") {
            entries.push(line.trim().to_string());
        } else if let (true, Some(last)) = (inside, entries.last_mut()) {
            last.push(' ');
            last.push_str(line.trim());
        }
    }
    entries
        .iter()
        .filter_map(|e| {
            let name = e.split_whitespace().next()?.to_string();
            let aliases = e
                .find("[alias")
                .and_then(|at| {
                    let list = &e[at..];
                    Some(list[list.find(':')? + 1..list.find(']')?].to_string())
                })
                .map(|l| l.split(',').map(|a| a.trim().to_string()).collect())
                .unwrap_or_default();
            (name != "help").then_some((name, aliases))
        })
        .collect()
}

/// The long flags a help text lists.
fn flags(help: &str) -> Vec<String> {
    let mut out: Vec<String> = help
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("-").filter(|_| l.starts_with("-"))?;
            let l = if l.starts_with('-') {
                l
            } else {
                l.split_once(", ")?.1.strip_prefix('-')?
            };
            let flag = l.split([' ', '=']).next()?;
            Some(format!("-{flag}"))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[test]
fn every_binary_has_a_daemon_command_also_called_serve() {
    for s in &SHAPES {
        let top = run(s.name, &["--help"]);
        assert_eq!(top.status.code(), Some(0), "{}", s.name);
        let cmds = commands(&stdout(&top));
        let daemon = cmds.iter().find(|(c, _)| c == "daemon");
        let (_, aliases) = daemon.unwrap_or_else(|| panic!("{}: no daemon in {cmds:?}", s.name));
        assert_eq!(aliases, &["serve"], "{}", s.name);
        // clap wraps the help text: a line may break inside the words.
        let one_line = stdout(&top)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(
            one_line.contains("(the default)"),
            s.daemon_by_default,
            "{}: whether the daemon is the default command",
            s.name
        );

        let help = stdout(&run(s.name, &["daemon", "--help"]));
        let listed = flags(&help);
        for f in DAEMON_FLAGS {
            assert!(
                listed.iter().any(|l| l == f),
                "{} daemon: no {f} in {listed:?}",
                s.name
            );
        }
        for var in DAEMON_ENV {
            assert!(
                help.contains(&format!("[env: {var}=")),
                "{} daemon: no {var}",
                s.name
            );
        }
        let serve = stdout(&run(s.name, &["serve", "--help"]));
        assert_eq!(flags(&serve), listed, "{}: serve is daemon", s.name);
    }
}

#[test]
fn usage_errors_exit_2_and_name_what_is_wrong() {
    for s in &SHAPES {
        let cases: [(&[&str], &str); 5] = [
            (&["frobnicate"], "frobnicate"),
            (&["daemon", "--metrics-addr", "nowhere"], "nowhere"),
            (&["daemon", "--log-format", "xml"], "xml"),
            (
                &["daemon", "--vendor", "nvidia"],
                "\"nvidia\" is not a PCI vendor id",
            ),
            (
                &["daemon", s.duration_flag, "5parsecs"],
                &format!("'5parsecs' for '{}", s.duration_flag),
            ),
        ];
        for (args, named) in cases {
            let o = run(s.name, args);
            assert_eq!(
                o.status.code(),
                Some(2),
                "{} {args:?}: {}",
                s.name,
                stderr(&o)
            );
            assert!(
                stderr(&o).contains(named),
                "{} {args:?}: {}",
                s.name,
                stderr(&o)
            );
        }
    }
}

#[test]
fn a_daemon_that_needs_the_node_name_exits_2_without_it() {
    for s in &SHAPES {
        let Some(args) = s.needs_node_name else {
            continue;
        };
        for command in ["daemon", "serve"] {
            let mut all = vec![command];
            all.extend_from_slice(args);
            let o = run(s.name, &all);
            assert_eq!(
                o.status.code(),
                Some(2),
                "{} {all:?}: {}",
                s.name,
                stderr(&o)
            );
            assert!(
                stderr(&o).contains("--node-name"),
                "{}: {}",
                s.name,
                stderr(&o)
            );
        }
    }
}

#[test]
fn vendor_takes_one_syntax_and_any_only_where_nothing_is_bound() {
    for s in &SHAPES {
        // A value the parser takes lets `--help` after it print the help.
        for v in ["10de", "0x10DE"] {
            let o = run(s.name, &["daemon", "--vendor", v, "--help"]);
            assert_eq!(
                o.status.code(),
                Some(0),
                "{} --vendor {v}: {}",
                s.name,
                stderr(&o)
            );
        }
        let o = run(s.name, &["daemon", "--vendor", "any", "--help"]);
        if s.refuses_any_vendor {
            assert_eq!(o.status.code(), Some(2), "{}", s.name);
            assert!(
                stderr(&o).contains("console GPU"),
                "{}: {}",
                s.name,
                stderr(&o)
            );
        } else {
            assert_eq!(o.status.code(), Some(0), "{}: {}", s.name, stderr(&o));
        }
    }
}

#[test]
fn help_ends_with_the_exit_status_table() {
    for s in &SHAPES {
        let h = stdout(&run(s.name, &["--help"]));
        let table = &h[h
            .find("Exit status:")
            .unwrap_or_else(|| panic!("{}: {h}", s.name))..];
        for code in ["  0  ", "  1  ", "  2  "] {
            assert!(table.contains(code), "{}: {table}", s.name);
        }
    }
}

#[test]
fn a_daemon_reports_its_error_in_its_json_log() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    for s in &SHAPES {
        // A run that fails at once: a host root without sys/ (vfio-manager, sandbox-dp), or no
        // node name (vgpu-device-manager, sandbox-dra).
        let mut args = vec!["--log-format", "json", "daemon", "--host-root", root];
        args.extend_from_slice(s.needs_node_name.unwrap_or(&["--kubelet-dir", root]));
        let o = run(s.name, &args);
        assert!(
            matches!(o.status.code(), Some(1 | 2)),
            "{} {args:?}: {o:?}",
            s.name
        );
        let lines: Vec<serde_json::Value> = stderr(&o)
            .lines()
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {l}", s.name))
            })
            .collect();
        let err = lines.iter().find(|v| v["level"] == "ERROR");
        let err = err.unwrap_or_else(|| panic!("{}: no ERROR in {lines:?}", s.name));
        assert!(err["fields"]["message"].is_string(), "{}: {err}", s.name);
    }
}

#[test]
fn completions_and_man_pages_cover_every_command() {
    for s in &SHAPES {
        let cmds = commands(&stdout(&run(s.name, &["--help"])));
        let man = run(s.name, &["--generate", "man"]);
        assert!(man.status.success(), "{}: {man:?}", s.name);
        let page = stdout(&man);
        assert!(page.contains(&format!(".TH {} 8", s.name)), "{}", s.name);
        for shell in ["bash", "zsh", "fish"] {
            let o = run(s.name, &["--generate", "completions", shell]);
            assert!(o.status.success(), "{} {shell}: {o:?}", s.name);
            for (c, _) in &cmds {
                assert!(
                    stdout(&o).contains(c.as_str()),
                    "{} {shell}: no {c}",
                    s.name
                );
                // roff escapes the hyphens.
                let roff = c.replace('-', "\\-");
                assert!(page.contains(&roff), "{} man: no {c}", s.name);
            }
        }
        let o = run(s.name, &["--generate", "completions", "tcsh"]);
        assert_eq!(o.status.code(), Some(2), "{}", s.name);
        assert!(stderr(&o).contains("tcsh"), "{}", s.name);
    }
}
