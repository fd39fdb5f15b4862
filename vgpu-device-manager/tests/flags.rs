//! The shared flags as a user meets them: JSON logs, durations in the new and the old spelling,
//! the exit status and message of an error (no node needed).

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_vgpu-device-manager");

const CONFIG: &str = "version: v1\nvgpu-configs:\n  A10-4Q:\n    - devices: all\n      vgpu-devices: {\"A10-4Q\": 6}\n";

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("HOST_ROOT")
        .env_remove("LOG_FORMAT")
        .env_remove("RUST_LOG")
        .env_remove("VGPU_DM_CONFIG_FILE")
        .env_remove("VGPU_DM_SELECTED_CONFIG")
        .env_remove("NODE_NAME")
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    stderr(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn config() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, CONFIG).unwrap();
    let f = file.to_str().unwrap().to_string();
    (dir, f)
}

#[test]
fn a_daemon_that_cannot_go_on_logs_json_and_exits_1() {
    // The config file's directory does not exist: it cannot be watched, so the daemon stops.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gone/config.yaml");
    let f = file.to_str().unwrap();
    let root = dir.path().to_str().unwrap();
    let o = run(&[
        "--log-format",
        "json",
        "--host-root",
        root,
        "daemon",
        "-f",
        f,
        "-c",
        "A10-4Q",
        "--retry-min",
        "500ms",
        "--retry-max-ms",
        "60000",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let lines = json_lines(&o);
    let warn = lines.iter().find(|v| v["level"] == "WARN").unwrap();
    assert_eq!(
        warn["fields"]["message"],
        "--retry-max-ms is deprecated: write --retry-max 1m"
    );
    let err = lines.iter().find(|v| v["level"] == "ERROR").unwrap();
    let msg = err["fields"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!(
            "cannot watch {}",
            dir.path().join("gone").display()
        )),
        "{msg}"
    );
}

#[test]
fn durations_take_units_bare_seconds_and_the_old_milliseconds() {
    let (_d, f) = config();
    for t in ["500ms", "30s", "2m", "1.5", "30"] {
        let o = run(&["--write-timeout", t, "assert", "-a", "-f", &f]);
        assert_eq!(o.status.code(), Some(0), "{t}: {}", stderr(&o));
    }
    for t in ["0", "5parsecs", "31days"] {
        let o = run(&["--write-timeout", t, "assert", "-a", "-f", &f]);
        assert_eq!(o.status.code(), Some(2), "{t}");
        assert!(
            stderr(&o).contains(&format!("'{t}' for '--write-timeout")),
            "{}",
            stderr(&o)
        );
    }
    // Old and new spelling of one delay at once is a usage error.
    let o = run(&[
        "daemon",
        "-f",
        &f,
        "-c",
        "A10-4Q",
        "--retry-min",
        "1s",
        "--retry-min-ms",
        "500",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--retry-min-ms"), "{}", stderr(&o));
    let o = run(&["daemon", "-f", &f, "-c", "A10-4Q", "--retry-max-ms", "2s"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("not a whole number of milliseconds"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn the_help_shows_the_new_delays_the_deprecated_ones_and_the_exit_table() {
    let h = String::from_utf8_lossy(&run(&["daemon", "--help"]).stdout).into_owned();
    let words = h.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        words.contains("--retry-min <DURATION> First retry delay"),
        "{h}"
    );
    assert!(
        words.contains("[default: 2s]") && words.contains("[default: 5m]"),
        "{h}"
    );
    for old in ["--retry-min-ms", "--retry-max-ms"] {
        let note = format!("deprecated {old} N (milliseconds) is still accepted");
        assert!(words.contains(&note), "{note}: {h}");
        assert!(!words.contains(&format!("{old} <")), "{old} is hidden: {h}");
    }
    let h = String::from_utf8_lossy(&run(&["--help"]).stdout).into_owned();
    let table = &h[h.find("Exit status:").unwrap_or_else(|| panic!("{h}"))..];
    assert!(
        table.contains("2  usage error, or the config or profile is invalid"),
        "{table}"
    );
}

#[test]
fn commands_report_errors_on_stderr_with_their_status() {
    let (_d, f) = config();
    // Not a profile of the file: a configuration error, exit 2, named.
    let o = run(&[
        "--log-format",
        "json",
        "assert",
        "-a",
        "-f",
        &f,
        "-c",
        "nope",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).starts_with("error: "), "{}", stderr(&o));
    assert!(stderr(&o).contains("nope"), "{}", stderr(&o));
    // A config file that cannot be read: exit 1, naming it.
    let o = run(&["assert", "-a", "-f", "/nonexistent/config.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot read config file /nonexistent/config.yaml"),
        "{}",
        stderr(&o)
    );
    // Not a valid config: exit 2.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "version: v2\n").unwrap();
    let o = run(&["assert", "-a", "-f", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}
