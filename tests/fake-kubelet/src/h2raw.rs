//! A gRPC client over a Unix socket that writes its own HTTP/2 frames, so that it can send any
//! `:authority` (the percent-encoded socket path kubelet's plugin-registration client and grpcio
//! send, a raw path, none): tonic's client only sends what `http::Uri` accepts. It also sends
//! raw bytes, for tests of malformed input.
//!
//! Requests are HPACK-encoded with incremental indexing, as real clients do, so that a second
//! request on a connection refers to the first one's fields through the dynamic table.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// How long any one call waits for the server.
const TIMEOUT: Duration = Duration::from_secs(10);

/// What the server answered on one stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// Response headers (`:status`, `content-type`, …).
    pub headers: Vec<(String, String)>,
    /// The gRPC messages received, in order.
    pub messages: Vec<Vec<u8>>,
    /// Trailers (`grpc-status`, `grpc-message`).
    pub trailers: Vec<(String, String)>,
    /// The error code of an `RST_STREAM`, if the server reset the stream.
    pub reset: Option<u32>,
    /// The stream ended (END_STREAM or RST_STREAM).
    pub ended: bool,
    data: Vec<u8>,
}

impl Reply {
    /// `grpc-status`, from the trailers (or the headers of a trailers-only answer).
    pub fn grpc_status(&self) -> Option<&str> {
        self.field("grpc-status")
    }

    /// A field of the trailers, else of the headers.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.trailers
            .iter()
            .chain(&self.headers)
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/2 connection.
pub struct RawGrpc {
    conn: UnixStream,
    authority: Option<String>,
    encoder: loona_hpack::Encoder<'static>,
    decoder: loona_hpack::Decoder<'static>,
    next_stream: u32,
    streams: HashMap<u32, Reply>,
    buf: Vec<u8>,
}

impl std::fmt::Debug for RawGrpc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawGrpc")
            .field("authority", &self.authority)
            .field("next_stream", &self.next_stream)
            .finish_non_exhaustive()
    }
}

impl RawGrpc {
    /// Connects, sends the preface and an empty SETTINGS frame. Each request will carry
    /// `:authority: <authority>`, or no `:authority` when `None`.
    pub async fn connect(path: &Path, authority: Option<&str>) -> anyhow::Result<RawGrpc> {
        let conn = UnixStream::connect(path)
            .await
            .with_context(|| format!("connecting to {}", path.display()))?;
        let mut c = RawGrpc {
            conn,
            authority: authority.map(str::to_string),
            encoder: loona_hpack::Encoder::new(),
            decoder: loona_hpack::Decoder::new(),
            next_stream: 1,
            streams: HashMap::new(),
            buf: Vec::new(),
        };
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        c.send_raw(&hello).await?;
        Ok(c)
    }

    /// Writes bytes as they are.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.conn.write_all(bytes).await.context("writing")
    }

    /// Sends a request with one message on a new stream; returns the stream id.
    pub async fn send(&mut self, method: &str, message: &[u8]) -> anyhow::Result<u32> {
        let stream = self.next_stream;
        self.next_stream += 2;
        let mut fields: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", method.as_bytes()),
        ];
        if let Some(a) = &self.authority {
            fields.push((b":authority", a.as_bytes()));
        }
        fields.push((b"content-type", b"application/grpc"));
        fields.push((b"te", b"trailers"));
        let block = self.encoder.encode(fields);
        let mut body = vec![0];
        body.extend((message.len() as u32).to_be_bytes());
        body.extend_from_slice(message);
        let mut out = frame(HEADERS, END_HEADERS, stream, &block);
        out.extend(frame(DATA, END_STREAM, stream, &body));
        self.send_raw(&out).await?;
        self.streams.insert(stream, Reply::default());
        Ok(stream)
    }

    /// A unary call: the stream's whole answer.
    pub async fn unary(&mut self, method: &str, message: &[u8]) -> anyhow::Result<Reply> {
        let stream = self.send(method, message).await?;
        while !self.reply(stream)?.ended {
            self.read_frame().await?;
        }
        self.streams
            .remove(&stream)
            .ok_or_else(|| anyhow!("stream {stream} lost"))
    }

    /// Waits for the stream's next gRPC message (a server stream such as ListAndWatch).
    pub async fn next_message(&mut self, stream: u32) -> anyhow::Result<Vec<u8>> {
        loop {
            let r = self.reply(stream)?;
            if !r.messages.is_empty() {
                let r = self
                    .streams
                    .get_mut(&stream)
                    .ok_or_else(|| anyhow!("stream {stream} lost"))?;
                return Ok(r.messages.remove(0));
            }
            if r.ended {
                bail!("stream {stream} ended without a message: {r:?}");
            }
            self.read_frame().await?;
        }
    }

    /// Whether the server closes the connection (end of file or a reset) within the timeout,
    /// reading and discarding whatever it sends first.
    pub async fn closed_by_server(&mut self) -> bool {
        let mut scratch = [0u8; 4096];
        loop {
            match tokio::time::timeout(TIMEOUT, self.conn.read(&mut scratch)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => {}
                Err(_) => return false,
            }
        }
    }

    fn reply(&self, stream: u32) -> anyhow::Result<&Reply> {
        self.streams
            .get(&stream)
            .ok_or_else(|| anyhow!("no stream {stream}"))
    }

    async fn fill(&mut self, n: usize) -> anyhow::Result<()> {
        let mut scratch = [0u8; 8192];
        while self.buf.len() < n {
            let got = tokio::time::timeout(TIMEOUT, self.conn.read(&mut scratch))
                .await
                .context("the server sent nothing in time")?
                .context("reading")?;
            if got == 0 {
                bail!("the server closed the connection");
            }
            self.buf.extend_from_slice(&scratch[..got]);
        }
        Ok(())
    }

    async fn next_frame(&mut self) -> anyhow::Result<(u8, u8, u32, Vec<u8>)> {
        self.fill(9).await?;
        let len = usize::from(self.buf[0]) << 16
            | usize::from(self.buf[1]) << 8
            | usize::from(self.buf[2]);
        self.fill(9 + len).await?;
        let head: Vec<u8> = self.buf.drain(..9).collect();
        let payload: Vec<u8> = self.buf.drain(..len).collect();
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        Ok((head[3], head[4], stream, payload))
    }

    /// Reads and handles one frame (a header block with its CONTINUATIONs counts as one).
    async fn read_frame(&mut self) -> anyhow::Result<()> {
        let (ty, flags, stream, payload) = self.next_frame().await?;
        match ty {
            SETTINGS if flags & ACK == 0 => self.send_raw(&frame(SETTINGS, ACK, 0, &[])).await?,
            PING if flags & ACK == 0 => self.send_raw(&frame(PING, ACK, 0, &payload)).await?,
            GOAWAY => {
                let code = payload
                    .get(4..8)
                    .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                bail!("the server sent GOAWAY (error code {code:?})");
            }
            RST_STREAM => {
                let r = self.streams.entry(stream).or_default();
                r.reset = payload
                    .get(..4)
                    .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                r.ended = true;
            }
            HEADERS => {
                let mut block = unpadded(flags, &payload)?;
                if flags & PRIORITY != 0 {
                    block.drain(..5.min(block.len()));
                }
                let mut last = flags;
                while last & END_HEADERS == 0 {
                    let (t, f, _, p) = self.next_frame().await?;
                    if t != CONTINUATION {
                        bail!("frame type {t} inside a header block");
                    }
                    block.extend(p);
                    last = f;
                }
                let fields: Vec<(String, String)> = self
                    .decoder
                    .decode(&block)
                    .map_err(|e| anyhow!("response headers do not decode: {e}"))?
                    .into_iter()
                    .map(|(n, v)| {
                        (
                            String::from_utf8_lossy(&n).into_owned(),
                            String::from_utf8_lossy(&v).into_owned(),
                        )
                    })
                    .collect();
                let r = self.streams.entry(stream).or_default();
                if r.headers.is_empty() {
                    r.headers = fields;
                } else {
                    r.trailers = fields;
                }
                if flags & END_STREAM != 0 {
                    r.ended = true;
                }
            }
            DATA => {
                let data = unpadded(flags, &payload)?;
                let r = self.streams.entry(stream).or_default();
                r.data.extend_from_slice(&data);
                while r.data.len() >= 5 {
                    let len =
                        u32::from_be_bytes([r.data[1], r.data[2], r.data[3], r.data[4]]) as usize;
                    if r.data.len() < 5 + len {
                        break;
                    }
                    let msg: Vec<u8> = r.data.drain(..5 + len).skip(5).collect();
                    r.messages.push(msg);
                }
                if flags & END_STREAM != 0 {
                    r.ended = true;
                }
                if !payload.is_empty() {
                    // Give the window back, for the connection and the stream.
                    let inc = (payload.len() as u32).to_be_bytes();
                    let mut out = frame(WINDOW_UPDATE, 0, 0, &inc);
                    out.extend(frame(WINDOW_UPDATE, 0, stream, &inc));
                    self.send_raw(&out).await?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// A HEADERS or DATA payload without its padding.
fn unpadded(flags: u8, payload: &[u8]) -> anyhow::Result<Vec<u8>> {
    if flags & PADDED == 0 {
        return Ok(payload.to_vec());
    }
    let pad = usize::from(
        *payload
            .first()
            .ok_or_else(|| anyhow!("empty padded frame"))?,
    );
    payload
        .get(1..payload.len().saturating_sub(pad))
        .map(<[u8]>::to_vec)
        .ok_or_else(|| anyhow!("padding longer than the frame"))
}

/// Byte streams a server must refuse by ending the connection, each after the preface:
/// a CONTINUATION without HEADERS, undecodable HPACK (an index past both tables), a header
/// block interrupted by DATA, padding longer than its frame, a header block announced at
/// 16 MiB, a Huffman string with invalid padding.
pub fn malformed_streams() -> Vec<Vec<u8>> {
    vec![
        frame(CONTINUATION, END_HEADERS, 1, &[0x82]),
        frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f]),
        [frame(HEADERS, 0, 1, &[0x83]), frame(DATA, 0, 1, b"x")].concat(),
        frame(HEADERS, PADDED | END_HEADERS, 1, &[200, 0x82]),
        vec![0xff, 0xff, 0xff, HEADERS, 0, 0, 0, 0, 1],
        frame(HEADERS, END_HEADERS, 1, &[0x00, 0x81, 0x00, 0x81, 0x00]),
    ]
}

/// One HTTP/2 frame.
pub fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.push(ty);
    f.push(flags);
    f.extend(stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The HTTP/2 client preface.
pub fn preface() -> &'static [u8] {
    PREFACE
}
