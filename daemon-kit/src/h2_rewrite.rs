//! The client→server half of an HTTP/2 connection, with every header block re-encoded so that
//! an `:authority` tonic's HTTP/2 server (h2) would refuse is left out.
//!
//! h2 parses `:authority` as an [`http::uri::Authority`] and resets the stream with
//! `PROTOCOL_ERROR` when that fails, before any handler runs: a `%` in the host (the
//! percent-encoded socket path kubelet's plugin-registration client and grpcio send for a
//! `unix:` target), a `/` (the raw socket path other clients send), an empty value. On a Unix
//! socket the authority names nothing, so such a value is dropped, exactly when h2 would
//! refuse it (the same parser decides); a request without `:authority` is valid HTTP/2.
//!
//! What the rewriter does to the byte stream:
//! - the connection preface passes; a stream that does not start with it is passed on verbatim
//!   (the server refuses it as it would have);
//! - every frame other than HEADERS and CONTINUATION passes as it arrives, payload included,
//!   without waiting for the frame to be complete;
//! - a header block (HEADERS and its CONTINUATIONs) is collected, HPACK-decoded with a decoder
//!   that follows the client's dynamic table, and sent on as one HEADERS frame (plus
//!   CONTINUATIONs when it exceeds 16 KiB, the frame size every HTTP/2 peer accepts) holding the
//!   same fields in the same order as literals without indexing: the server's dynamic table
//!   stays empty, so it can never disagree with the client's. END_STREAM and the priority
//!   fields are kept; padding is dropped.
//!
//! Anything malformed (a CONTINUATION out of place, a frame inside a header block, bad
//! padding, undecodable HPACK, a block over [`MAX_HEADER_BLOCK`]) is an [`Error`]: the caller
//! ends that connection, as the server would have.

use bytes::{BufMut as _, BytesMut};
use loona_hpack::Decoder;
use loona_hpack::encoder::encode_integer_into;

/// The HTTP/2 client connection preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Length of a frame header.
pub const FRAME_HEADER_LEN: usize = 9;
/// Frame type HEADERS.
pub const HEADERS: u8 = 0x1;
/// Frame type CONTINUATION.
pub const CONTINUATION: u8 = 0x9;
/// HEADERS flag END_STREAM.
pub const END_STREAM: u8 = 0x1;
/// HEADERS / CONTINUATION flag END_HEADERS.
pub const END_HEADERS: u8 = 0x4;
/// HEADERS flag PADDED.
pub const PADDED: u8 = 0x8;
/// HEADERS flag PRIORITY.
pub const PRIORITY: u8 = 0x20;
/// The frame size every HTTP/2 peer accepts (the floor of SETTINGS_MAX_FRAME_SIZE).
pub const MAX_FRAME: usize = 16_384;
/// HTTP/2's default SETTINGS_HEADER_TABLE_SIZE. tonic's server never advertises another, so
/// the client's HPACK encoder may not use a larger dynamic table.
const HEADER_TABLE_SIZE: usize = 4_096;
/// The largest header block accepted, encoded (all its frames) and decoded (the HPACK size of
/// its fields, name + value + 32 each): far above any gRPC request, low enough that a client
/// cannot make the rewriter hold much memory.
pub const MAX_HEADER_BLOCK: usize = 1 << 20;

/// Why a connection's byte stream cannot be passed on.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A CONTINUATION frame without a header block in progress.
    #[error("CONTINUATION frame on stream {0} without a header block")]
    StrayContinuation(u32),
    /// Another frame where the header block's CONTINUATION must come.
    #[error("frame of type {ty} on stream {stream} inside the header block of stream {block}")]
    InterruptedBlock {
        /// The frame's type.
        ty: u8,
        /// The frame's stream.
        stream: u32,
        /// The stream whose header block is open.
        block: u32,
    },
    /// Padding or priority fields longer than the HEADERS frame.
    #[error("HEADERS frame on stream {0} shorter than its padding and priority fields")]
    BadPadding(u32),
    /// A header block (encoded or decoded) over [`MAX_HEADER_BLOCK`].
    #[error("header block on stream {0} over {MAX_HEADER_BLOCK} bytes")]
    TooLarge(u32),
    /// The block does not decode.
    #[error("header block on stream {stream} does not decode: {reason}")]
    Hpack {
        /// The stream.
        stream: u32,
        /// The decoder's word.
        reason: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// This many bytes of the preface seen.
    Preface(usize),
    /// At a frame header.
    FrameHeader,
    /// Inside the payload of a frame passed through; this many bytes to go.
    Forward(usize),
    /// Not HTTP/2: everything passes.
    Verbatim,
}

#[derive(Debug)]
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// Rewrites the client→server bytes of one connection. Feed it what arrives with
/// [`Rewriter::process`]; send on what it appends to `out`.
pub struct Rewriter {
    state: State,
    /// Follows the client's encoder: its dynamic table is the one the client believes the
    /// server has.
    decoder: Decoder<'static>,
    block: Option<Block>,
    /// Authorities left out so far, for the log.
    dropped: u64,
}

impl std::fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rewriter")
            .field("state", &self.state)
            .field("block", &self.block)
            .field("dropped", &self.dropped)
            .finish_non_exhaustive()
    }
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl Rewriter {
    /// A rewriter for a new connection.
    pub fn new() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        Rewriter {
            state: State::Preface(0),
            decoder,
            block: None,
            dropped: 0,
        }
    }

    /// How many `:authority` fields were left out so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Consumes what it can of `input` (complete frames, and the arrived part of a frame that
    /// is passed through) and appends the bytes to send on to `out`. What it leaves in `input`
    /// is an incomplete frame header or header-block frame: call again when more arrived.
    pub fn process(&mut self, input: &mut BytesMut, out: &mut BytesMut) -> Result<(), Error> {
        loop {
            match self.state {
                State::Verbatim => {
                    out.extend_from_slice(&input.split());
                    return Ok(());
                }
                State::Preface(seen) => {
                    let n = (PREFACE.len() - seen).min(input.len());
                    if input[..n] != PREFACE[seen..seen + n] {
                        self.state = State::Verbatim;
                        continue;
                    }
                    out.extend_from_slice(&input.split_to(n));
                    if seen + n < PREFACE.len() {
                        self.state = State::Preface(seen + n);
                        return Ok(());
                    }
                    self.state = State::FrameHeader;
                }
                State::Forward(0) => self.state = State::FrameHeader,
                State::Forward(left) => {
                    if input.is_empty() {
                        return Ok(());
                    }
                    let n = left.min(input.len());
                    out.extend_from_slice(&input.split_to(n));
                    self.state = State::Forward(left - n);
                }
                State::FrameHeader => {
                    if input.len() < FRAME_HEADER_LEN {
                        return Ok(());
                    }
                    let len = usize::from(input[0]) << 16
                        | usize::from(input[1]) << 8
                        | usize::from(input[2]);
                    let (ty, flags) = (input[3], input[4]);
                    let stream =
                        u32::from_be_bytes([input[5], input[6], input[7], input[8]]) & 0x7fff_ffff;
                    if let Some(b) = &self.block
                        && (ty != CONTINUATION || stream != b.stream)
                    {
                        return Err(Error::InterruptedBlock {
                            ty,
                            stream,
                            block: b.stream,
                        });
                    }
                    if ty != HEADERS && ty != CONTINUATION {
                        out.extend_from_slice(&input.split_to(FRAME_HEADER_LEN));
                        self.state = State::Forward(len);
                        continue;
                    }
                    if ty == CONTINUATION && self.block.is_none() {
                        return Err(Error::StrayContinuation(stream));
                    }
                    let held = self.block.as_ref().map_or(0, |b| b.fragment.len());
                    if held + len > MAX_HEADER_BLOCK {
                        return Err(Error::TooLarge(stream));
                    }
                    if input.len() < FRAME_HEADER_LEN + len {
                        input.reserve(FRAME_HEADER_LEN + len - input.len());
                        return Ok(());
                    }
                    let frame = input.split_to(FRAME_HEADER_LEN + len);
                    let payload = &frame[FRAME_HEADER_LEN..];
                    match &mut self.block {
                        Some(b) => b.fragment.extend_from_slice(payload),
                        None => self.block = Some(open_block(stream, flags, payload)?),
                    }
                    if flags & END_HEADERS != 0 {
                        self.finish_block(out)?;
                    }
                }
            }
        }
    }

    /// Decodes the collected block and appends it, re-encoded, as HEADERS (+ CONTINUATION).
    fn finish_block(&mut self, out: &mut BytesMut) -> Result<(), Error> {
        let Some(block) = self.block.take() else {
            return Ok(());
        };
        let stream = block.stream;
        let mut encoded = Vec::with_capacity(block.fragment.len() + 64);
        let mut size = 0usize;
        let mut dropped = Vec::new();
        let mut failed: Option<Error> = None;
        let decoded = self.decoder.decode_with_cb(&block.fragment, |name, value| {
            size += name.len() + value.len() + 32;
            if failed.is_some() {
                return;
            }
            if size > MAX_HEADER_BLOCK {
                failed = Some(Error::TooLarge(stream));
                return;
            }
            if &*name == b":authority" && http::uri::Authority::try_from(&*value).is_err() {
                dropped.push(String::from_utf8_lossy(&value).into_owned());
                return;
            }
            if let Err(e) = encode_literal(&mut encoded, &name, &value) {
                failed = Some(Error::Hpack {
                    stream,
                    reason: e.to_string(),
                });
            }
        });
        decoded.map_err(|e| Error::Hpack {
            stream,
            reason: e.to_string(),
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        for a in dropped {
            if self.dropped == 0 {
                tracing::debug!(authority = %a, stream, "leaving out an :authority the HTTP/2 server would refuse");
            }
            self.dropped += 1;
        }
        write_block(out, &block, &encoded);
        Ok(())
    }
}

/// The header block a HEADERS frame opens: its fragment without padding, its priority fields.
fn open_block(stream: u32, flags: u8, payload: &[u8]) -> Result<Block, Error> {
    let mut start = 0;
    let mut pad = 0;
    if flags & PADDED != 0 {
        pad = usize::from(*payload.first().ok_or(Error::BadPadding(stream))?);
        start = 1;
    }
    let priority = if flags & PRIORITY != 0 {
        let p: [u8; 5] = payload
            .get(start..start + 5)
            .and_then(|s| s.try_into().ok())
            .ok_or(Error::BadPadding(stream))?;
        start += 5;
        Some(p)
    } else {
        None
    };
    let end = payload
        .len()
        .checked_sub(pad)
        .filter(|e| *e >= start)
        .ok_or(Error::BadPadding(stream))?;
    Ok(Block {
        stream,
        end_stream: flags & END_STREAM != 0,
        priority,
        fragment: payload[start..end].to_vec(),
    })
}

/// A field as a literal without indexing, with a literal name (RFC 7541 6.2.2).
fn encode_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) -> std::io::Result<()> {
    out.push(0x00);
    for s in [name, value] {
        encode_integer_into(s.len(), 7, 0, out)?;
        out.extend_from_slice(s);
    }
    Ok(())
}

fn frame_header(out: &mut BytesMut, len: usize, ty: u8, flags: u8, stream: u32) {
    // `len` is at most MAX_FRAME: it fits the 24-bit length field.
    out.put_uint(len as u64, 3);
    out.put_u8(ty);
    out.put_u8(flags);
    out.put_u32(stream);
}

/// The re-encoded block as one HEADERS frame and as many CONTINUATIONs as it needs.
fn write_block(out: &mut BytesMut, block: &Block, encoded: &[u8]) {
    let prio_len = if block.priority.is_some() { 5 } else { 0 };
    let (first, mut rest) = encoded.split_at(encoded.len().min(MAX_FRAME - prio_len));
    let mut flags = if block.end_stream { END_STREAM } else { 0 };
    if block.priority.is_some() {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    frame_header(out, prio_len + first.len(), HEADERS, flags, block.stream);
    if let Some(p) = &block.priority {
        out.put_slice(p);
    }
    out.put_slice(first);
    while !rest.is_empty() {
        let (chunk, r) = rest.split_at(rest.len().min(MAX_FRAME));
        rest = r;
        let flags = if rest.is_empty() { END_HEADERS } else { 0 };
        frame_header(out, chunk.len(), CONTINUATION, flags, block.stream);
        out.put_slice(chunk);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use proptest::prelude::*;

    const BAD_AUTHORITY: &str = "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fexample-reg.sock";

    fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut b = BytesMut::new();
        frame_header(&mut b, payload.len(), ty, flags, stream);
        b.put_slice(payload);
        b.to_vec()
    }

    fn request(authority: Option<&str>) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut h: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (
                b":path".to_vec(),
                b"/v1beta1.DevicePlugin/Allocate".to_vec(),
            ),
        ];
        if let Some(a) = authority {
            h.push((b":authority".to_vec(), a.as_bytes().to_vec()));
        }
        h.push((b"content-type".to_vec(), b"application/grpc".to_vec()));
        h.push((b"te".to_vec(), b"trailers".to_vec()));
        h
    }

    fn encode(enc: &mut loona_hpack::Encoder<'static>, h: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        enc.encode(h.iter().map(|(n, v)| (&n[..], &v[..])))
    }

    /// Runs the rewriter over `input` fed in pieces of `step` bytes.
    fn rewrite(input: &[u8], step: usize) -> Result<Vec<u8>, Error> {
        let mut r = Rewriter::new();
        let mut buf = BytesMut::new();
        let mut out = BytesMut::new();
        for chunk in input.chunks(step.max(1)) {
            buf.extend_from_slice(chunk);
            r.process(&mut buf, &mut out)?;
        }
        Ok(out.to_vec())
    }

    #[derive(Debug, PartialEq)]
    struct Frame {
        ty: u8,
        flags: u8,
        stream: u32,
        payload: Vec<u8>,
    }

    /// Splits the server-side bytes (after the preface) into frames.
    fn frames(mut b: &[u8]) -> Vec<Frame> {
        assert!(b.starts_with(PREFACE));
        b = &b[PREFACE.len()..];
        let mut v = Vec::new();
        while !b.is_empty() {
            let len = usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
            v.push(Frame {
                ty: b[3],
                flags: b[4],
                stream: u32::from_be_bytes([b[5], b[6], b[7], b[8]]),
                payload: b[9..9 + len].to_vec(),
            });
            b = &b[9 + len..];
        }
        v
    }

    /// Decodes the header blocks the server receives, with a fresh decoder (the server's).
    fn server_blocks(out: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut dec = Decoder::new();
        let mut blocks = Vec::new();
        let mut cur = Vec::new();
        for f in frames(out) {
            match f.ty {
                HEADERS => {
                    let start = if f.flags & PRIORITY != 0 { 5 } else { 0 };
                    assert_eq!(f.flags & PADDED, 0);
                    cur.extend_from_slice(&f.payload[start..]);
                }
                CONTINUATION => cur.extend_from_slice(&f.payload),
                _ => continue,
            }
            assert!(f.payload.len() <= MAX_FRAME);
            if f.flags & END_HEADERS != 0 {
                blocks.push(dec.decode(&cur).unwrap());
                cur.clear();
            }
        }
        blocks
    }

    fn settings() -> Vec<u8> {
        frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])
    }

    #[test]
    fn refused_authorities_are_left_out_and_the_rest_kept() {
        for (authority, kept) in [
            (Some(BAD_AUTHORITY), false),
            (
                Some("/var/lib/kubelet/plugins_registry/example-reg.sock"),
                false,
            ),
            (Some(""), false),
            (Some("localhost"), true),
            (Some("[::1]:50051"), true),
            (None, false),
        ] {
            let mut enc = loona_hpack::Encoder::new();
            let h = request(authority);
            let mut input = PREFACE.to_vec();
            input.extend(settings());
            input.extend(frame(HEADERS, END_HEADERS, 1, &encode(&mut enc, &h)));
            input.extend(frame(0x0, END_STREAM, 1, b"\0\0\0\0\0"));
            let out = rewrite(&input, usize::MAX).unwrap();
            let want: Vec<_> = h
                .iter()
                .filter(|(n, _)| kept || n != b":authority")
                .cloned()
                .collect();
            assert_eq!(server_blocks(&out), [want], "{authority:?}");
            let f = frames(&out);
            assert_eq!(f[0].payload, settings()[9..]);
            assert_eq!(f[2].ty, 0x0);
            assert_eq!(f[2].flags, END_STREAM);
            assert_eq!(f[2].payload, b"\0\0\0\0\0");
        }
    }

    #[test]
    fn the_clients_dynamic_table_is_followed_across_blocks() {
        // The client indexes its authority in the first request and refers to the entry in
        // the next ones: each must lose it, and the other fields must still decode.
        let mut enc = loona_hpack::Encoder::new();
        let h = request(Some(BAD_AUTHORITY));
        let mut input = PREFACE.to_vec();
        for stream in [1, 3, 5] {
            input.extend(frame(
                HEADERS,
                END_HEADERS | END_STREAM,
                stream,
                &encode(&mut enc, &h),
            ));
        }
        let out = rewrite(&input, 7).unwrap();
        let want: Vec<_> = h
            .iter()
            .filter(|(n, _)| n != b":authority")
            .cloned()
            .collect();
        assert_eq!(server_blocks(&out), [want.clone(), want.clone(), want]);
        assert_eq!(
            frames(&out).iter().map(|f| f.stream).collect::<Vec<_>>(),
            [1, 3, 5]
        );
    }

    #[test]
    fn huffman_and_indexed_fields_of_rfc_7541_decode() {
        // RFC 7541 C.4.1 and C.4.2: Huffman-coded, the second block refers to the first's
        // dynamic entries.
        let b1 = [
            0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab,
            0x90, 0xf4, 0xff,
        ];
        let b2 = [
            0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf,
        ];
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &b1));
        input.extend(frame(HEADERS, END_HEADERS, 3, &b2));
        let blocks = server_blocks(&rewrite(&input, 3).unwrap());
        let s = |v: &[(Vec<u8>, Vec<u8>)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(n, v)| {
                    (
                        String::from_utf8(n.clone()).unwrap(),
                        String::from_utf8(v.clone()).unwrap(),
                    )
                })
                .collect()
        };
        let pairs = |p: &[(&str, &str)]| -> Vec<(String, String)> {
            p.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        assert_eq!(
            s(&blocks[0]),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
            ])
        );
        assert_eq!(
            s(&blocks[1]),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache"),
            ])
        );
    }

    #[test]
    fn padding_priority_and_continuation_are_handled() {
        let mut enc = loona_hpack::Encoder::new();
        let h = request(Some(BAD_AUTHORITY));
        let block = encode(&mut enc, &h);
        // HEADERS padded (3 bytes) with priority fields, then two CONTINUATIONs.
        let prio = [0x80, 0, 0, 0x03, 0x10];
        let (a, rest) = block.split_at(10);
        let (b, c) = rest.split_at(20);
        let mut payload = vec![3];
        payload.extend_from_slice(&prio);
        payload.extend_from_slice(a);
        payload.extend_from_slice(&[0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 5, &payload));
        input.extend(frame(CONTINUATION, 0, 5, b));
        input.extend(frame(CONTINUATION, END_HEADERS, 5, c));
        let out = rewrite(&input, 1).unwrap();
        let f = frames(&out);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].ty, HEADERS);
        assert_eq!(f[0].flags, PRIORITY | END_STREAM | END_HEADERS);
        assert_eq!(f[0].payload[..5], prio);
        let want: Vec<_> = h
            .iter()
            .filter(|(n, _)| n != b":authority")
            .cloned()
            .collect();
        assert_eq!(server_blocks(&out), [want]);
    }

    #[test]
    fn a_large_block_is_split_into_frames_the_server_accepts() {
        let mut enc = loona_hpack::Encoder::new();
        let mut h = request(Some("localhost"));
        for i in 0..6 {
            h.push((format!("x-big-{i}").into_bytes(), vec![b'v'; 9000]));
        }
        let block = encode(&mut enc, &h);
        let mut input = PREFACE.to_vec();
        let (a, b) = block.split_at(MAX_FRAME);
        let (b, c) = b.split_at(MAX_FRAME);
        input.extend(frame(HEADERS, 0, 1, a));
        input.extend(frame(CONTINUATION, 0, 1, b));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, c));
        let out = rewrite(&input, 4096).unwrap();
        let f = frames(&out);
        assert!(f.len() >= 4, "{}", f.len());
        assert_eq!(f[0].ty, HEADERS);
        assert!(f[1..].iter().all(|f| f.ty == CONTINUATION));
        assert!(f[..f.len() - 1].iter().all(|f| f.flags & END_HEADERS == 0));
        assert_eq!(f[f.len() - 1].flags, END_HEADERS);
        assert_eq!(server_blocks(&out), [h]);
    }

    #[test]
    fn other_frames_pass_as_they_arrive() {
        let mut r = Rewriter::new();
        let mut input = BytesMut::from(PREFACE);
        let mut out = BytesMut::new();
        // A DATA frame announced at 100 bytes, 10 arrived: those 10 go on at once.
        input.extend_from_slice(&frame(0x0, 0, 1, &[7; 100])[..19]);
        r.process(&mut input, &mut out).unwrap();
        assert!(input.is_empty());
        assert_eq!(out.len(), PREFACE.len() + 19);
    }

    #[test]
    fn a_stream_that_is_not_http2_passes_verbatim() {
        let input = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(rewrite(input, 5).unwrap(), input);
    }

    #[test]
    fn malformed_streams_are_errors() {
        let mut enc = loona_hpack::Encoder::new();
        let block = encode(&mut enc, &request(Some("localhost")));
        let with = |frames: &[Vec<u8>]| {
            let mut v = PREFACE.to_vec();
            for f in frames {
                v.extend_from_slice(f);
            }
            v
        };
        let cases: Vec<(Vec<u8>, Error)> = vec![
            (
                with(&[frame(CONTINUATION, END_HEADERS, 1, &block)]),
                Error::StrayContinuation(1),
            ),
            (
                with(&[frame(HEADERS, 0, 1, &block), frame(0x0, 0, 1, b"x")]),
                Error::InterruptedBlock {
                    ty: 0,
                    stream: 1,
                    block: 1,
                },
            ),
            (
                with(&[
                    frame(HEADERS, 0, 1, &block),
                    frame(CONTINUATION, END_HEADERS, 3, b""),
                ]),
                Error::InterruptedBlock {
                    ty: CONTINUATION,
                    stream: 3,
                    block: 1,
                },
            ),
            (
                with(&[frame(HEADERS, PADDED | END_HEADERS, 1, &[200, 0x82])]),
                Error::BadPadding(1),
            ),
            (
                with(&[frame(HEADERS, PRIORITY | END_HEADERS, 1, &[0, 0])]),
                Error::BadPadding(1),
            ),
            (
                with(&[frame(HEADERS, PADDED, 1, &[])]),
                Error::BadPadding(1),
            ),
        ];
        for (input, want) in cases {
            assert_eq!(rewrite(&input, 1), Err(want));
        }
        // Undecodable HPACK: an index past both tables.
        let bad = with(&[frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f])]);
        assert!(matches!(
            rewrite(&bad, 100),
            Err(Error::Hpack { stream: 1, .. })
        ));
        // A dynamic table larger than the server allows.
        let bad = with(&[frame(HEADERS, END_HEADERS, 1, &[0x3f, 0xe2, 0x1f, 0x82])]);
        assert!(matches!(rewrite(&bad, 100), Err(Error::Hpack { .. })));
        // A block that never ends, over the limit.
        let mut v = with(&[frame(HEADERS, 0, 1, &[0x82])]);
        for _ in 0..(MAX_HEADER_BLOCK / MAX_FRAME + 1) {
            v.extend(frame(CONTINUATION, 0, 1, &[0x82; MAX_FRAME]));
        }
        assert_eq!(rewrite(&v, 65536), Err(Error::TooLarge(1)));
        // A frame header announcing a block over the limit fails before its payload arrives.
        let mut v = PREFACE.to_vec();
        v.extend_from_slice(&[0xff, 0xff, 0xff, HEADERS, 0, 0, 0, 0, 1]);
        assert_eq!(rewrite(&v, 100), Err(Error::TooLarge(1)));
        // Decoded size over the limit: one indexed 4 KiB entry repeated.
        let mut enc = loona_hpack::Encoder::new();
        let big = vec![(b"x-big".to_vec(), vec![b'v'; 4000])];
        let first = encode(&mut enc, &big);
        let again = encode(&mut enc, &big);
        assert_eq!(again.len(), 1);
        let mut v = with(&[frame(HEADERS, END_HEADERS, 1, &first)]);
        v.extend(frame(HEADERS, END_HEADERS, 3, &again.repeat(300)));
        assert_eq!(rewrite(&v, 65536), Err(Error::TooLarge(3)));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512), step in 1usize..64) {
            let mut input = PREFACE.to_vec();
            input.extend(bytes);
            let _ = rewrite(&input, step);
        }

        #[test]
        fn mutated_requests_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
            let mut enc = loona_hpack::Encoder::new();
            let mut input = PREFACE.to_vec();
            input.extend(settings());
            input.extend(frame(HEADERS, END_HEADERS, 1, &encode(&mut enc, &request(Some(BAD_AUTHORITY)))));
            input.extend(frame(0x0, END_STREAM, 1, b"\0\0\0\0\0"));
            input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &encode(&mut enc, &request(Some(BAD_AUTHORITY)))));
            for (at, x) in flips {
                let i = PREFACE.len() + at % (input.len() - PREFACE.len());
                input[i] ^= x;
            }
            let _ = rewrite(&input, 5);
        }

        #[test]
        fn feeding_in_pieces_gives_the_same_bytes(step in 1usize..200) {
            let mut enc = loona_hpack::Encoder::new();
            let mut input = PREFACE.to_vec();
            input.extend(settings());
            for s in [1u32, 3] {
                input.extend(frame(HEADERS, END_HEADERS, s, &encode(&mut enc, &request(Some(BAD_AUTHORITY)))));
                input.extend(frame(0x0, END_STREAM, s, &[1; 300]));
            }
            prop_assert_eq!(rewrite(&input, step).unwrap(), rewrite(&input, usize::MAX).unwrap());
        }
    }
}
