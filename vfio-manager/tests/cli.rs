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
    for word in [
        "bind",
        "unbind",
        "status",
        "daemon",
        "--host-root",
        "--log-format",
    ] {
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
        vec!["bind", "--vendor", "xyz"],
        vec!["bind", "--timeout", "-1"],
        vec!["frobnicate"],
    ] {
        let o = run(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
    // A host root without sys/ is a configuration error, named.
    let o = run(&["--host-root", root, "bind"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("sys"));
}
