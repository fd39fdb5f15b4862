//! The shared flags as a user meets them: JSON logs, durations in the new and the old spelling,
//! the exit status and message of an error (no node needed).
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_sandbox-dp");

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let kdir = tempfile::tempdir().unwrap();
    Command::new(BIN)
        .args(args)
        .arg("--kubelet-dir")
        .arg(kdir.path())
        .env_remove("HOST_ROOT")
        .env_remove("LOG_FORMAT")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const MISSING: &str = "/nonexistent-root/sys/bus/pci/devices";

#[test]
fn the_daemon_logs_its_fatal_error_as_json_and_exits_1() {
    for (args, env) in [
        (vec!["--log-format", "json"], vec![]),
        (vec![], vec![("LOG_FORMAT", "json")]),
    ] {
        let mut args = args;
        args.extend([
            "daemon",
            "--host-root",
            "/nonexistent-root",
            "--resync-interval",
            "30",
        ]);
        let o = run(&args, &env);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        let lines: Vec<serde_json::Value> = stderr(&o)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect();
        let err = lines.iter().find(|v| v["level"] == "ERROR").unwrap();
        let msg = err["fields"]["message"].as_str().unwrap();
        assert!(msg.contains(MISSING), "{msg}");
    }
}

#[test]
fn text_logs_on_a_pipe_are_plain_lines() {
    // What `kubectl logs` and the journal show: no terminal colour codes around the level or
    // the fields.
    let o = run(
        &[
            "daemon",
            "--host-root",
            "/nonexistent-root",
            "--resync-interval",
            "30",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let log = stderr(&o);
    assert!(!log.contains('\x1b'), "colour codes in {log:?}");
    let line = log.lines().find(|l| l.contains(" ERROR ")).unwrap();
    assert!(line.contains(MISSING), "{line}");
    let start = log.lines().find(|l| l.contains(" INFO ")).unwrap();
    assert!(
        start.contains("sandbox_dp: starting host_root=/nonexistent-root"),
        "{start}"
    );
}

#[test]
fn durations_take_units_and_bare_seconds() {
    // `list` on a host root that does not exist fails reading it (exit 1, naming the path) once
    // the flags are parsed; a refused value exits 2 naming the value.
    for t in ["500ms", "30s", "2m", "1.5", "30"] {
        let o = run(
            &[
                "list",
                "--host-root",
                "/nonexistent-root",
                "--resync-interval",
                t,
            ],
            &[],
        );
        assert_eq!(o.status.code(), Some(1), "{t}: {}", stderr(&o));
        assert!(stderr(&o).starts_with("error: "), "{}", stderr(&o));
        assert!(stderr(&o).contains(MISSING), "{}", stderr(&o));
    }
    for t in ["0", "5parsecs", "31days"] {
        let o = run(&["list", "--resync-interval", t], &[]);
        assert_eq!(o.status.code(), Some(2), "{t}");
        assert!(
            stderr(&o).contains(&format!("'{t}' for '--resync-interval")),
            "{}",
            stderr(&o)
        );
    }
}
