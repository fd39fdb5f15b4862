//! The command line itself: help text and usage errors (no node needed).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on setup failures

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_vfio-manager");

fn run(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env_remove("HOST_ROOT")
        .output()
        .unwrap()
}

#[test]
fn help_explains_every_subcommand_and_selector() {
    let o = run(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let h = String::from_utf8_lossy(&o.stdout);
    for word in ["bind", "unbind", "status", "daemon"] {
        assert!(h.contains(word), "{word} missing from:\n{h}");
    }
    let o = run(&["daemon", "--help"]);
    let h = String::from_utf8_lossy(&o.stdout);
    for word in [
        "--vendor",
        "--device",
        "--address",
        "--exclude",
        "--driver",
        "--timeout",
        "--allow-foreign-in-group",
        "--resync-interval",
        "--unbind-on-exit",
        "vfio-pci-ready",
        "--all",
        "--device-id",
    ] {
        assert!(h.contains(word), "{word} missing from:\n{h}");
    }
}

#[test]
fn usage_and_configuration_errors_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    for args in [
        vec!["bind", "--device", "nonsense"],
        vec!["bind", "--address", "41:00.0"],
        vec!["bind", "--timeout", "-1"],
        // --all is every GPU: naming some as well is a contradiction.
        vec!["bind", "--all", "--address", "0000:41:00.0"],
        vec!["unbind", "-a", "--device", "10de:2236"],
    ] {
        let o = run(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
    // A host root without sys/ is a configuration error, named.
    let o = run(&["--host-root", root, "bind"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("sys"));
}

/// stderr's lines, each parsed as JSON (a line that is not JSON fails the test).
fn json_lines(o: &std::process::Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[test]
fn the_daemon_logs_json_and_exits_2_naming_a_bad_host_root() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    for (args, env) in [
        (
            vec!["--log-format", "json", "--host-root", root, "daemon"],
            None,
        ),
        (vec!["--host-root", root, "daemon"], Some("json")),
    ] {
        let mut cmd = Command::new(BIN);
        cmd.args(&args)
            .env_remove("HOST_ROOT")
            .env_remove("LOG_FORMAT");
        if let Some(f) = env {
            cmd.env("LOG_FORMAT", f);
        }
        let o = cmd.output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?} {env:?}");
        let lines = json_lines(&o);
        let err = lines.iter().find(|v| v["level"] == "ERROR").unwrap();
        let msg = err["fields"]["message"].as_str().unwrap();
        assert!(
            msg.contains(&format!("{root}/sys is not a directory")),
            "{msg}"
        );
    }
}

#[test]
fn durations_take_units_and_bare_seconds() {
    // A host root without sys/ fails after the flags are parsed (exit 2, naming sys): a value
    // the parser refused would be named instead.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    for t in ["500ms", "30s", "2m", "1.5", "30"] {
        let o = run(&["--host-root", root, "bind", "--timeout", t]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{t}: {err}");
        assert!(err.contains("sys is not a directory"), "{t}: {err}");
        let o = run(&["--host-root", root, "daemon", "--resync-interval", t]);
        assert!(String::from_utf8_lossy(&o.stderr).contains("sys is not a directory"));
    }
    for t in ["0", "0s", "5parsecs", "31days"] {
        let o = run(&["--host-root", root, "bind", "--timeout", t]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{t}: {err}");
        assert!(err.contains(&format!("'{t}' for '--timeout")), "{t}: {err}");
    }
}
