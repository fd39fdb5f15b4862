//! What tests of the daemons' operational side need: a plain HTTP GET of `/metrics`,
//! `/healthz` and `/readyz`; a real Prometheus text parser (Python's `prometheus_client`,
//! installed from PyPI into a virtualenv, independent of the encoder the daemons use); and a
//! `$NOTIFY_SOCKET` datagram socket that collects what a daemon tells systemd.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A free `127.0.0.1:PORT` (free when asked; the daemon binds it right after).
pub fn free_addr() -> String {
    let addr = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr());
    match addr {
        Ok(a) => a.to_string(),
        Err(e) => panic!("no free port on 127.0.0.1: {e}"),
    }
}

/// `GET path` on `addr`: the status code and the body; `None` when nothing answers.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Some((code, body))
}

/// Polls `GET path` until it answers `code`, for at most `timeout`; whether it did.
pub fn wait_for_status(addr: &str, path: &str, code: u16, timeout: Duration) -> bool {
    let start = Instant::now();
    loop {
        if http_get(addr, path).is_some_and(|(c, _)| c == code) {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sample `sample` (a name, with its labels as the text shows them: `x_total{result="failed"}`)
/// read from `addr`'s `/metrics` as plain text; `None` when it is not there. For a test that
/// only follows a counter (the parser below checks the format).
pub fn metric(addr: &str, sample: &str) -> Option<f64> {
    let (_, body) = http_get(addr, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// How long a test counting a daemon's API requests at rest keeps it at rest besides the
/// passes it waits for: `AT_REST_SECS` (the figures in BENCHMARKS.md: 600), else nothing more.
pub fn at_rest() -> Duration {
    let secs = std::env::var("AT_REST_SECS")
        .ok()
        .and_then(|s| s.parse().ok());
    Duration::from_secs(secs.unwrap_or(0))
}

/// One line for the figures: `requests` (audit entries) made by `daemon` in `took` at rest,
/// by verb, and per hour.
pub fn report_at_rest(daemon: &str, requests: &[Value], took: Duration) {
    let mut verbs = std::collections::BTreeMap::<String, usize>::new();
    for r in requests {
        *verbs
            .entry(r["verb"].as_str().unwrap_or("?").to_string())
            .or_default() += 1;
    }
    let per_hour = requests.len() as f64 * 3600.0 / took.as_secs_f64().max(0.001);
    eprintln!(
        "at rest: {daemon}: {} requests in {:.0} s ({verbs:?}): {per_hour:.1} per hour",
        requests.len(),
        took.as_secs_f64()
    );
}

/// The `prometheus_client` release the parser is pinned to.
const PARSER_VERSION: &str = "prometheus_client==0.26.0";

/// Parses OpenMetrics text with `prometheus_client.openmetrics.parser` (strict: names,
/// types, suffixes, `# EOF`) and prints every sample as JSON.
const PARSE_SCRIPT: &str = r#"
import sys, json
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = []
for f in text_string_to_metric_families(sys.stdin.read()):
    for s in f.samples:
        out.append({"family": f.name, "type": f.type, "name": s.name,
                    "labels": s.labels, "value": s.value})
print(json.dumps(out))
"#;

/// The python of a virtualenv `<dir>/<name>-venv` with `requirement` (`pkg==version`) installed
/// from PyPI, made once (a stamp names what it holds; concurrent callers wait for the one that
/// installs). `Err` says why it cannot be had: no python3, no venv, no PyPI.
pub fn python_venv(dir: &Path, name: &str, requirement: &str) -> Result<PathBuf, String> {
    let venv = dir.join(format!("{name}-venv"));
    let python = venv.join("bin/python");
    let stamp = venv.join("stamp");
    let lock = std::fs::File::create(dir.join(format!("{name}.lock")))
        .map_err(|e| format!("cannot create {name}.lock in {}: {e}", dir.display()))?;
    let _guard = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| format!("cannot lock {name}.lock: {e}"))?;
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == requirement) {
        return Ok(python);
    }
    let _ = std::fs::remove_dir_all(&venv);
    match Command::new("python3")
        .arg("-m")
        .arg("venv")
        .arg(&venv)
        .output()
    {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Err(format!(
                "python3 -m venv failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Err(e) => return Err(format!("no python3: {e}")),
    }
    let pip = Command::new(venv.join("bin/pip"))
        .args([
            "install",
            "-q",
            "--disable-pip-version-check",
            "--retries",
            "1",
        ])
        .args(["--timeout", "20", requirement])
        .output();
    match pip {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Err(format!(
                "cannot install {requirement} from PyPI: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Err(e) => return Err(format!("no pip: {e}")),
    }
    std::fs::write(&stamp, requirement).map_err(|e| format!("{}: {e}", stamp.display()))?;
    Ok(python)
}

/// A Python with `prometheus_client`, in a virtualenv under `dir`.
#[derive(Debug)]
pub struct MetricsParser {
    python: PathBuf,
}

/// One sample of a parsed exposition.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The family's name (a counter's without `_total`).
    pub family: String,
    /// The family's type: counter, gauge, histogram…
    pub kind: String,
    /// The sample's name.
    pub name: String,
    /// Its labels.
    pub labels: Vec<(String, String)>,
    /// Its value.
    pub value: f64,
}

fn skip(why: &str) {
    let line = format!("skipped: Prometheus parser test: {why}");
    if std::env::var("PROM_PARSER").is_ok_and(|v| v == "required") {
        panic!("PROM_PARSER=required but {line}");
    }
    eprintln!("{line} (set PROM_PARSER=required to fail instead)");
}

impl MetricsParser {
    /// Installs (once) the parser under `dir` (a test's `CARGO_TARGET_TMPDIR`); `None`, after
    /// a skip message, when python3, venv or PyPI cannot be had.
    pub fn install(dir: &Path) -> Option<MetricsParser> {
        match python_venv(dir, "prometheus-parser", PARSER_VERSION) {
            Ok(python) => Some(MetricsParser { python }),
            Err(why) => {
                skip(&why);
                None
            }
        }
    }

    /// Parses `text`; `Err` with the parser's complaint when it refuses it.
    pub fn parse(&self, text: &str) -> Result<Vec<Sample>, String> {
        let mut child = Command::new(&self.python)
            .arg("-c")
            .arg(PARSE_SCRIPT)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.python.display()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(text.as_bytes())
                .map_err(|e| format!("cannot write to the parser: {e}"))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| format!("parser: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
        let samples = v.as_array().cloned().unwrap_or_default();
        Ok(samples
            .iter()
            .map(|s| Sample {
                family: s["family"].as_str().unwrap_or_default().into(),
                kind: s["type"].as_str().unwrap_or_default().into(),
                name: s["name"].as_str().unwrap_or_default().into(),
                labels: s["labels"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().into()))
                            .collect()
                    })
                    .unwrap_or_default(),
                value: s["value"].as_f64().unwrap_or(f64::NAN),
            })
            .collect())
    }
}

/// The value of sample `name` with exactly `labels`, if present.
pub fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && s.labels.len() == labels.len()
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|(sk, sv)| sk == k && sv == v))
        })
        .map(|s| s.value)
}

/// A `$NOTIFY_SOCKET` for a daemon: a datagram socket in a temporary directory.
#[derive(Debug)]
pub struct NotifySocket {
    sock: UnixDatagram,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl NotifySocket {
    /// Binds a new socket.
    pub fn new() -> std::io::Result<NotifySocket> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("notify.sock");
        let sock = UnixDatagram::bind(&path)?;
        Ok(NotifySocket {
            sock,
            path,
            _dir: dir,
        })
    }

    /// Its path, for `$NOTIFY_SOCKET`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads messages until one has a line `line` (returned with every line read so far), or
    /// `timeout` passes (`Err` with the lines read).
    pub fn wait_for_line(&self, line: &str, timeout: Duration) -> Result<Vec<String>, Vec<String>> {
        let start = Instant::now();
        let mut lines = Vec::new();
        let mut buf = vec![0u8; 4096];
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(lines);
            }
            let _ = self.sock.set_read_timeout(Some(left));
            let Ok(n) = self.sock.recv(&mut buf) else {
                return Err(lines);
            };
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            let found = msg.lines().any(|l| l == line);
            lines.extend(msg.lines().map(String::from));
            if found {
                return Ok(lines);
            }
        }
    }
}
