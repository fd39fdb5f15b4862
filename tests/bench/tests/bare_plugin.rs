//! `gpu-vm-bare-plugin` does what the plain tree's sandbox-dp bases say it does: it prints its
//! dial, registers the resources asked with the kubelet, serves a list of the size asked, and
//! flips the first device's health as its watched file goes and comes back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::kubelet::{FakeKubelet, PluginClient};

const BIN: &str = env!("CARGO_BIN_EXE_gpu-vm-bare-plugin");
const WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn it_registers_serves_and_follows_its_watched_file() {
    let dir = tempfile::tempdir().unwrap();
    let node = dir.path().join("vfio/100");
    std::fs::create_dir_all(node.parent().unwrap()).unwrap();
    std::fs::write(&node, "").unwrap();
    let sock = dir.path().join("bare.sock");
    let mut kubelet = FakeKubelet::start(&dir.path().join("kubelet"))
        .await
        .unwrap();
    let mut child = Command::new(BIN)
        .arg("--socket")
        .arg(&sock)
        .arg("--watch")
        .arg(&node)
        .args(["--devices", "12", "--resources", "3"])
        .arg("--kubelet")
        .arg(kubelet.socket())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ns: i128 = line.strip_prefix("dial ").unwrap().trim().parse().unwrap();
    assert!(ns > 0, "{line}");

    let mut names = BTreeSet::new();
    for _ in 0..3 {
        let r = kubelet.next_registration(WAIT).await.unwrap();
        assert_eq!(r.endpoint, "bare.sock");
        names.insert(r.resource_name);
    }
    let want: BTreeSet<String> = (0..3).map(|r| format!("bench.example/r{r}")).collect();
    assert_eq!(names, want);

    let mut client = PluginClient::connect(&sock).await.unwrap();
    let mut lw = client.list_and_watch().await.unwrap();
    let first = lw.next(WAIT).await.unwrap();
    assert_eq!(first.len(), 12);
    assert!(first.iter().all(|d| d.health == "Healthy"));
    let id = first[0].id.clone();
    let health = |l: &[testkit::kubelet::api::Device], id: &str| {
        l.iter().find(|d| d.id == id).map(|d| d.health.clone())
    };

    std::fs::remove_file(&node).unwrap();
    let l = lw
        .wait_until(WAIT, |l| health(l, &id).as_deref() == Some("Unhealthy"))
        .await
        .unwrap();
    assert_eq!(l.len(), 12);
    assert_eq!(l.iter().filter(|d| d.health == "Healthy").count(), 11);

    std::fs::write(&node, "").unwrap();
    let l = lw
        .wait_until(WAIT, |l| health(l, &id).as_deref() == Some("Healthy"))
        .await
        .unwrap();
    assert!(l.iter().all(|d| d.health == "Healthy"));

    child.kill().unwrap();
    child.wait().unwrap();
    kubelet.stop().await;
}

#[test]
fn a_bad_device_count_is_refused_with_exit_2() {
    let o = Command::new(BIN)
        .args(["--socket", "/nonexistent/s", "--watch", "/nonexistent/f"])
        .args(["--devices", "many"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--devices"));
}
