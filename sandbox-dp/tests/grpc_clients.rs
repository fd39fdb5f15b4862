//! Every gRPC client is answered on every resource socket, whatever `:authority` it sends:
//! the percent-encoded socket path (kubelet's plugin-registration client, grpcio), the raw
//! path (grpc-java, tools), `localhost` (kubelet's device-plugin client), none. tonic's own
//! client cannot send the first two, so a client that writes its own HTTP/2 frames
//! (`testkit::h2raw`) calls each RPC; then Python's grpcio, installed from PyPI into a
//! virtualenv under the target directory (skipped when that cannot be done, unless
//! `GRPCIO=required`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use prost::Message as _;
use support::tree::*;
use support::*;
use testkit::h2raw::{self, RawGrpc, Reply};
use testkit::kubelet::FakeKubelet;
use testkit::kubelet::api::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest,
    ContainerPreferredAllocationRequest, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreferredAllocationRequest, PreferredAllocationResponse,
};

/// What kubelet v1.36's plugin-registration client sends for `example-reg.sock`.
const REGISTRATION_AUTHORITY: &str = "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fexample-reg.sock";

const SERVICE: &str = "/v1beta1.DevicePlugin/";

/// One resource as the tests call it: its socket, a device and its env var.
struct Served {
    socket: PathBuf,
    device: &'static str,
    env: &'static str,
}

/// A passthrough A10 and an SR-IOV vGPU VF: two resources, two sockets.
async fn two_resources() -> (Tree, tempfile::TempDir, Daemon, Vec<Served>) {
    let t = one_a10();
    t.add_h100_with_vgpu();
    let (k, kdir) = kubelet_dir();
    let mut kubelet = FakeKubelet::start(&kdir).await.unwrap();
    let d = Daemon::start(&t.root, &kdir, &[]);
    let (a10, vgpu) = ("nvidia.com/GA102GL_A10", "nvidia.com/NVIDIA_H100XM-4C");
    let regs = kubelet.wait_for(&[a10, vgpu], DEADLINE).await.unwrap();
    let served = vec![
        Served {
            socket: kdir.join(&regs[a10].endpoint),
            device: "0000:01:00.0",
            env: "PCI_RESOURCE_NVIDIA_COM_GA102GL_A10",
        },
        Served {
            socket: kdir.join(&regs[vgpu].endpoint),
            device: "0000:13:00.4",
            env: "PCI_RESOURCE_NVIDIA_COM_NVIDIA_H100XM-4C",
        },
    ];
    (t, k, d, served)
}

/// A unary call that must be answered with status 0 and one message.
async fn call<T: prost::Message + Default>(
    c: &mut RawGrpc,
    method: &str,
    request: &impl prost::Message,
    what: &str,
) -> T {
    let r: Reply = c
        .unary(&format!("{SERVICE}{method}"), &request.encode_to_vec())
        .await
        .unwrap();
    assert_eq!(r.reset, None, "{what}: {method}: stream reset: {r:?}");
    assert_eq!(r.grpc_status(), Some("0"), "{what}: {method}: {r:?}");
    assert_eq!(r.messages.len(), 1, "{what}: {method}: {r:?}");
    T::decode(&r.messages[0][..]).unwrap()
}

fn allocate_request(id: &str) -> AllocateRequest {
    AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: vec![id.to_string()],
        }],
    }
}

fn preferred_request(id: &str) -> PreferredAllocationRequest {
    PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: vec![id.to_string()],
            must_include_device_i_ds: Vec::new(),
            allocation_size: 1,
        }],
    }
}

/// The four RPCs kubelet makes, on one connection, each answered with what a kubelet needs.
async fn every_rpc(s: &Served, authority: Option<&str>) {
    let what = format!("{} with :authority {authority:?}", s.socket.display());
    let mut c = RawGrpc::connect(&s.socket, authority).await.unwrap();

    let opts: DevicePluginOptions = call(&mut c, "GetDevicePluginOptions", &Empty {}, &what).await;
    assert!(opts.get_preferred_allocation_available, "{what}");

    let stream = c
        .send(&format!("{SERVICE}ListAndWatch"), &Empty {}.encode_to_vec())
        .await
        .unwrap();
    let list = ListAndWatchResponse::decode(&c.next_message(stream).await.unwrap()[..]).unwrap();
    let ids: Vec<&str> = list.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, [s.device], "{what}");
    assert_eq!(list.devices[0].health, "Healthy", "{what}");

    // With ListAndWatch still open on the same connection.
    let resp: AllocateResponse = call(&mut c, "Allocate", &allocate_request(s.device), &what).await;
    assert_eq!(
        resp.container_responses[0]
            .envs
            .get(s.env)
            .map(String::as_str),
        Some(s.device),
        "{what}"
    );

    let resp: PreferredAllocationResponse = call(
        &mut c,
        "GetPreferredAllocation",
        &preferred_request(s.device),
        &what,
    )
    .await;
    assert_eq!(
        resp.container_responses[0].device_i_ds,
        [s.device],
        "{what}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_is_answered_whatever_the_authority() {
    let (_t, _k, _d, served) = two_resources().await;
    for s in &served {
        let raw = s.socket.to_str().unwrap().to_string();
        for authority in [
            Some(REGISTRATION_AUTHORITY),
            Some(&raw),
            Some("localhost"),
            None,
        ] {
            every_rpc(s, authority).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_http2_ends_the_connection_not_the_daemon() {
    let (_t, k, mut d, served) = two_resources().await;
    let s = &served[0];
    for g in &h2raw::malformed_streams() {
        let mut bad = RawGrpc::connect(&s.socket, None).await.unwrap();
        bad.send_raw(g).await.unwrap();
        assert!(bad.closed_by_server().await, "{g:02x?} left open");
        assert!(
            d.wait(std::time::Duration::ZERO).is_none(),
            "sandbox-dp exited"
        );
    }
    // A connection that never sends the preface.
    let mut bad = RawGrpc::connect(&s.socket, None).await.unwrap();
    drop(bad.send_raw(b"GET / HTTP/1.1\r\n\r\n").await);
    assert!(bad.closed_by_server().await);
    // Everything still answers, kubelet's client too.
    every_rpc(s, Some(REGISTRATION_AUTHORITY)).await;
    let kubelet_client = testkit::kubelet::PluginClient::connect(&s.socket).await;
    kubelet_client.unwrap().options().await.unwrap();
    drop(k);
}

// ------------------------------------------------------------------------------------- grpcio

const GRPCIO_VERSION: &str = "1.85.1";

/// Calls each `METHOD=HEX` argument on the target with raw bytes in and out (no generated
/// code): unary, or the first message of a server stream for ListAndWatch. Prints one line
/// per call: the answer in hex, or `ERROR <code> <details>`.
const GRPCIO_SCRIPT: &str = r#"
import sys, grpc
target, authority = sys.argv[1], sys.argv[2]
opts = [("grpc.default_authority", authority)] if authority else []
with grpc.insecure_channel(target, options=opts) as ch:
    for call in sys.argv[3:]:
        method, req = call.split("=")
        try:
            if method.endswith("/ListAndWatch"):
                it = ch.unary_stream(method)(bytes.fromhex(req), timeout=10)
                out = next(it)
                it.cancel()
            else:
                out = ch.unary_unary(method)(bytes.fromhex(req), timeout=10)
            print(out.hex())
        except grpc.RpcError as e:
            print("ERROR", e.code(), e.details())
"#;

fn skip_grpcio(why: &str) {
    let line = format!("skipped: grpcio client test: {why}");
    if std::env::var("GRPCIO").is_ok_and(|v| v == "required") {
        panic!("GRPCIO=required but {line}");
    }
    eprintln!("{line} (set GRPCIO=required to fail instead)");
}

/// The virtualenv's python with grpcio, installed once under the target directory; `None`
/// (after a skip message) when python3, venv or PyPI cannot be had.
fn grpcio_python() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    testkit::ops::python_venv(dir, "grpcio", &format!("grpcio=={GRPCIO_VERSION}"))
        .inspect_err(|why| skip_grpcio(why))
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_is_answered_on_every_socket() {
    let Some(python) = tokio::task::spawn_blocking(grpcio_python).await.unwrap() else {
        return;
    };
    let (_t, _k, _d, served) = two_resources().await;
    for s in &served {
        let target = format!("unix:{}", s.socket.display());
        let raw = s.socket.to_str().unwrap();
        // grpcio's own default for a `unix:` target (the percent-encoded path), then the
        // registration client's and a raw path set explicitly.
        for authority in ["", REGISTRATION_AUTHORITY, raw] {
            let what = format!("grpcio on {target} with authority {authority:?}");
            let calls = [
                format!("{SERVICE}GetDevicePluginOptions="),
                format!("{SERVICE}ListAndWatch="),
                format!(
                    "{SERVICE}Allocate={}",
                    hex(&allocate_request(s.device).encode_to_vec())
                ),
                format!(
                    "{SERVICE}GetPreferredAllocation={}",
                    hex(&preferred_request(s.device).encode_to_vec())
                ),
            ];
            let (py, target, authority2) = (python.clone(), target.clone(), authority.to_string());
            let out = tokio::task::spawn_blocking(move || {
                Command::new(py)
                    .arg("-c")
                    .arg(GRPCIO_SCRIPT)
                    .arg(&target)
                    .arg(&authority2)
                    .args(&calls)
                    .output()
                    .unwrap()
            })
            .await
            .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{what}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let lines: Vec<&str> = stdout.lines().collect();
            assert_eq!(lines.len(), 4, "{what}: {stdout}");
            assert!(!stdout.contains("ERROR"), "{what}: {stdout}");
            let opts = DevicePluginOptions::decode(&unhex(lines[0])[..]).unwrap();
            assert!(opts.get_preferred_allocation_available, "{what}");
            let list = ListAndWatchResponse::decode(&unhex(lines[1])[..]).unwrap();
            assert_eq!(list.devices.len(), 1, "{what}");
            assert_eq!(list.devices[0].id, s.device, "{what}");
            let resp = AllocateResponse::decode(&unhex(lines[2])[..]).unwrap();
            assert_eq!(
                resp.container_responses[0]
                    .envs
                    .get(s.env)
                    .map(String::as_str),
                Some(s.device),
                "{what}"
            );
            let resp = PreferredAllocationResponse::decode(&unhex(lines[3])[..]).unwrap();
            assert_eq!(
                resp.container_responses[0].device_i_ds,
                [s.device],
                "{what}"
            );
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}
