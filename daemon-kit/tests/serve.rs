//! A tonic server through `serve_unix`, called by a client that writes its own HTTP/2 frames:
//! each kind of `:authority` is answered, a malformed stream ends only its own connection.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::convert::Infallible;
use std::future::Ready;
use std::path::Path;
use std::task::{Context, Poll};

use testkit::h2raw::{self, RawGrpc};
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

/// Answers every call trailers-only with `grpc-status: 0`, echoing the path and authority the
/// handler saw.
#[derive(Clone)]
struct Echo;

impl tonic::server::NamedService for Echo {
    const NAME: &'static str = "test.Echo";
}

impl tower::Service<http::Request<tonic::body::Body>> for Echo {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let authority = req
            .uri()
            .authority()
            .map_or("none".to_string(), |a| a.to_string());
        let resp = http::Response::builder()
            .header("content-type", "application/grpc")
            .header("x-path", req.uri().path())
            .header("x-authority", authority)
            .header("grpc-status", "0")
            .body(tonic::body::Body::empty())
            .unwrap();
        std::future::ready(Ok(resp))
    }
}

struct Server {
    _dir: tempfile::TempDir,
    sock: std::path::PathBuf,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

fn serve() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("echo.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let stop = CancellationToken::new();
    let router = tonic::transport::Server::builder().add_service(Echo);
    let task = tokio::spawn(daemon_kit::grpc::serve_unix(
        router,
        listener,
        stop.clone().cancelled_owned(),
    ));
    Server {
        _dir: dir,
        sock,
        stop,
        task,
    }
}

async fn call_twice(sock: &Path, authority: Option<&str>, seen: &str) {
    let mut c = RawGrpc::connect(sock, authority).await.unwrap();
    // Twice: the second request refers to the first one's fields by dynamic-table index.
    for method in ["/test.Echo/One", "/test.Echo/Two"] {
        let r = c.unary(method, b"").await.unwrap();
        assert_eq!(r.reset, None, "{authority:?}: {r:?}");
        assert_eq!(r.grpc_status(), Some("0"), "{authority:?}: {r:?}");
        assert_eq!(r.field("x-path"), Some(method), "{r:?}");
        assert_eq!(r.field("x-authority"), Some(seen), "{authority:?}: {r:?}");
    }
}

#[tokio::test]
async fn every_authority_is_answered() {
    let s = serve();
    let reg = "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fexample-reg.sock";
    let raw = s.sock.to_str().unwrap().to_string();
    call_twice(&s.sock, Some(reg), "none").await;
    call_twice(&s.sock, Some(&raw), "none").await;
    call_twice(&s.sock, Some("localhost"), "localhost").await;
    call_twice(&s.sock, None, "none").await;
    s.stop.cancel();
    s.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_malformed_connection_ends_alone() {
    let s = serve();
    let mut good = RawGrpc::connect(&s.sock, Some("localhost")).await.unwrap();
    good.unary("/test.Echo/One", b"").await.unwrap();
    for g in h2raw::malformed_streams() {
        let mut bad = RawGrpc::connect(&s.sock, None).await.unwrap();
        bad.send_raw(&g).await.unwrap();
        assert!(bad.closed_by_server().await, "{g:02x?} left open");
        // The server and its other connections go on.
        good.unary("/test.Echo/Two", b"").await.unwrap();
        assert!(!s.task.is_finished());
    }
    call_twice(&s.sock, Some("localhost"), "localhost").await;
}
