//! tonic on a Unix socket, answering every client whatever `:authority` it sends.
//!
//! Clients of a Unix-socket gRPC server name the socket in `:authority` in different ways:
//! kubelet's device-plugin client sends `localhost`; kubelet's plugin-registration client (the
//! first contact of every DRA driver) and grpcio send the percent-encoded socket path
//! (`%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2F<name>-reg.sock`); grpc-java and some tools
//! send the raw path; some send none. tonic's HTTP/2 server (h2) refuses the percent-encoded
//! and raw paths with `RST_STREAM PROTOCOL_ERROR` before any handler runs, and has no switch
//! for it. [`serve_unix`] puts [`AuthorityTolerant`] in front of each accepted connection: it
//! re-encodes the client's header blocks, leaving out an `:authority` h2 would refuse (see
//! [`crate::h2_rewrite`]). A malformed byte stream ends that connection only.
//!
//! ```ignore
//! let listener = tokio::net::UnixListener::bind(&socket)?;
//! let router = tonic::transport::Server::builder().add_service(DevicePluginServer::new(plugin));
//! daemon_kit::grpc::serve_unix(router, listener, shutdown.cancelled_owned()).await?;
//! ```

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt as _};
use tonic::transport::server::{Connected, Router};

use crate::h2_rewrite::Rewriter;

/// How much is read from the socket at a time.
const READ_CHUNK: usize = 8192;

/// Serves `router` on `listener` until `shutdown` completes, every connection wrapped in
/// [`AuthorityTolerant`]; then waits for the open connections to finish, as tonic does.
pub async fn serve_unix(
    router: Router,
    listener: UnixListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    router
        .serve_with_incoming_shutdown(incoming(listener), shutdown)
        .await
}

/// The connections `listener` accepts, each wrapped in [`AuthorityTolerant`]: for
/// `serve_with_incoming_shutdown` of a router with layers.
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<AuthorityTolerant<UnixStream>>> {
    UnixListenerStream::new(listener).map(|conn| conn.map(AuthorityTolerant::new))
}

/// A server-side connection whose incoming HTTP/2 header blocks are re-encoded without an
/// `:authority` the HTTP/2 server would refuse. Writes pass straight through.
#[derive(Debug)]
pub struct AuthorityTolerant<S> {
    inner: S,
    rewriter: Rewriter,
    /// Arrived from the client, not yet rewritten (an incomplete frame).
    input: BytesMut,
    /// Rewritten, not yet handed to the server.
    output: BytesMut,
    eof: bool,
}

impl<S> AuthorityTolerant<S> {
    /// Wraps a freshly accepted connection (nothing read from it yet).
    pub fn new(inner: S) -> Self {
        AuthorityTolerant {
            inner,
            rewriter: Rewriter::new(),
            input: BytesMut::new(),
            output: BytesMut::new(),
            eof: false,
        }
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityTolerant<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // What is left is an incomplete frame: the connection ends there.
                return Poll::Ready(Ok(()));
            }
            this.input.reserve(READ_CHUNK);
            let n = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut this.inner),
                cx,
                &mut this.input
            ))?;
            if n == 0 {
                this.eof = true;
                continue;
            }
            if let Err(e) = this.rewriter.process(&mut this.input, &mut this.output) {
                tracing::debug!(error = %e, "ending a gRPC connection: malformed HTTP/2");
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityTolerant<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: Connected> Connected for AuthorityTolerant<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
