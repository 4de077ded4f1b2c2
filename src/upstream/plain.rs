//! herdguard's own HTTP/1.1 exchange with an upstream, for plain requests:
//! no body or a small one read whole first, no upgrade, a plain-HTTP
//! endpoint. The attempt's own future writes the head (and the body, in
//! the same write) on a pooled socket and reads the answer's head; the
//! answer's body is read off the same socket by whoever polls it (the
//! caller's side, as it forwards it), and the socket goes back to the pool
//! when the body ends whole. No connection task, no queue, no channels
//! between them. Everything else (bodies to send, upgrades) goes through
//! hyper's connection, as before.
//!
//! What is read is bounded: a head at most
//! [`MAX_HEAD`](super::framing::MAX_HEAD), at most
//! [`BEFORE_HEAD`] before the final head (informational answers), body
//! framing lines and trailers by [`framing`](super::framing)'s limits;
//! body data is handed on as it comes, a read at a time.

use std::future::{poll_fn, Future as _};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{Method, Response};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::body::{BoxError, Whole};
use super::framing::{parse_head, Decoded, Decoder, Head, Malformed, Parsed, MAX_HEAD};
use super::heads::{EndlessInformational, BEFORE_HEAD};
use super::outgoing::Fields;
use super::pool::Shelf;

/// What one read asks room for.
const READ_SIZE: usize = 8 * 1024;

/// A socket to an upstream, with what was read off it and not yet used.
pub(crate) struct Raw {
    pub(super) stream: TcpStream,
    buf: BytesMut,
    /// The pool it goes back to.
    shelf: Arc<Shelf>,
}

impl Raw {
    pub(crate) fn new(stream: TcpStream, shelf: Arc<Shelf>) -> Box<Self> {
        Box::new(Self {
            stream,
            buf: BytesMut::new(),
            shelf,
        })
    }

    /// Reads what the socket has into the buffer: how much (0: its end).
    ///
    /// By tokio's `poll_read`, which takes a read that left room in the
    /// buffer as the socket drained (epoll is edge-triggered): the next
    /// read, the next request's answer, waits for the reactor rather than
    /// trying the socket first and hearing `EAGAIN` (a system call per
    /// request; `try_read_buf` keeps the readiness).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_SIZE / 2 {
            self.buf.reserve(READ_SIZE);
        }
        // A read in progress holds nothing: dropped when pending, made
        // again at the next poll.
        std::pin::pin!(self.stream.read_buf(&mut self.buf)).poll(cx)
    }

    /// Whether the socket is open and has nothing to read: asked of the
    /// socket itself (a `MSG_PEEK`), not of the reactor, which hears of a
    /// close or of bytes sent unasked only at its next turn (see
    /// docs/request-path.md, "Tried and not kept").
    pub(super) fn is_quiet(&self) -> bool {
        self.buf.is_empty() && super::pool::is_quiet(socket2::SockRef::from(&self.stream))
    }

    /// The socket alone, out of the reactor.
    pub(super) fn into_std(self) -> io::Result<std::net::TcpStream> {
        self.stream.into_std()
    }
}

/// Why an exchange failed, and how far it got.
#[derive(Debug)]
pub(crate) struct Failed {
    pub error: ExchangeError,
    /// Some of the request was written.
    pub written: bool,
    /// Some of an answer was read.
    pub heard: bool,
    /// The body, when none of the request was written: for sending again.
    pub unsent: Option<Box<Whole>>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("writing the request failed")]
    Write(#[source] io::Error),
    #[error("reading the answer failed")]
    Read(#[source] io::Error),
    #[error("the connection closed before a whole answer's head")]
    Closed,
    #[error(transparent)]
    Malformed(#[from] Malformed),
    #[error(transparent)]
    Endless(#[from] EndlessInformational),
}

impl ExchangeError {
    /// The answer broke HTTP: it would only break again.
    pub(crate) fn broke_http(&self) -> bool {
        matches!(
            self,
            ExchangeError::Malformed(_) | ExchangeError::Endless(_)
        )
    }

    /// The connection was closed or reset under the exchange.
    pub(crate) fn is_close(&self) -> bool {
        use io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
        match self {
            ExchangeError::Closed => true,
            ExchangeError::Write(e) | ExchangeError::Read(e) => {
                matches!(e.kind(), ConnectionReset | BrokenPipe | ConnectionAborted)
            }
            _ => false,
        }
    }
}

/// Sends a request (`method`, origin-form `target`, `fields`, and `body`
/// read whole, if it has one, let go once written) on `raw`, and reads its
/// answer's head.
pub(crate) async fn exchange(
    mut raw: Box<Raw>,
    method: &Method,
    target: &str,
    fields: &Fields,
    body: Option<Box<Whole>>,
) -> Result<Response<PlainBody>, Failed> {
    let len = body.as_ref().map(|b| b.data().len());
    encode(&mut raw.buf, method, target, fields, len);
    let data: &[u8] = body.as_ref().map_or(&[], |b| b.data());
    let mut written = 0;
    while written < raw.buf.len() + data.len() {
        let head = raw.buf.get(written..).unwrap_or_default();
        let wrote = if data.is_empty() {
            raw.stream.write(head).await
        } else {
            // The head and the body in one write (`writev`).
            let data = data.get(written.saturating_sub(raw.buf.len())..);
            let parts = [
                io::IoSlice::new(head),
                io::IoSlice::new(data.unwrap_or_default()),
            ];
            raw.stream.write_vectored(&parts).await
        };
        let error = match wrote {
            Ok(0) => io::ErrorKind::WriteZero.into(),
            Ok(n) => {
                written += n;
                continue;
            }
            Err(e) => e,
        };
        return Err(Failed {
            error: ExchangeError::Write(error),
            written: written > 0,
            heard: false,
            unsent: body.filter(|_| written == 0),
        });
    }
    drop(body);
    raw.buf.clear();
    let head = read_head(&mut raw, method)
        .await
        .map_err(|(error, heard)| Failed {
            error,
            written: true,
            heard,
            unsent: None,
        })?;
    Ok(response(head, raw))
}

/// The request's head, as hyper writes one: the fields as they are, but a
/// `Transfer-Encoding` (there is nothing to code) and, with a body of
/// `body` bytes, the caller's `Content-Length`: the length of the body
/// read takes its place, last. (Inlined: its one caller is per request.)
#[inline(always)]
fn encode(buf: &mut BytesMut, method: &Method, target: &str, fields: &Fields, body: Option<usize>) {
    buf.clear();
    buf.reserve(256 + (fields.kept.map.len() + 6) * 32);
    buf.extend_from_slice(method.as_str().as_bytes());
    buf.extend_from_slice(b" ");
    buf.extend_from_slice(target.as_bytes());
    buf.extend_from_slice(b" HTTP/1.1\r\n");
    // Folded, not stepped: each part of the chained fields in a loop of
    // its own.
    fields.iter().for_each(|(name, value)| {
        if name != http::header::TRANSFER_ENCODING
            && (body.is_none() || name != http::header::CONTENT_LENGTH)
        {
            buf.extend_from_slice(name.as_str().as_bytes());
            buf.extend_from_slice(b": ");
            buf.extend_from_slice(value);
            buf.extend_from_slice(b"\r\n");
        }
    });
    if let Some(len) = body {
        buf.extend_from_slice(b"content-length: ");
        buf.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
        buf.extend_from_slice(b"\r\n");
    }
    buf.extend_from_slice(b"\r\n");
}

/// Reads up to the final answer's head, past informational ones. The
/// error says whether any of an answer was read.
///
/// The head is parsed again only once a read brings a line's end: an
/// upstream sending a byte at a time costs a parse per line, not per byte.
async fn read_head(raw: &mut Raw, method: &Method) -> Result<Head, (ExchangeError, bool)> {
    let mut heard = 0usize;
    let mut parse = false;
    loop {
        while parse {
            match parse_head(&mut raw.buf, method) {
                Ok(Parsed::Final(head)) => return Ok(head),
                Ok(Parsed::Informational) => parse = !raw.buf.is_empty(),
                Ok(Parsed::Partial) => parse = false,
                Err(e) => return Err((e.into(), true)),
            }
        }
        if heard > BEFORE_HEAD {
            return Err((EndlessInformational.into(), true));
        }
        let before = raw.buf.len();
        match poll_fn(|cx| raw.poll_fill(cx)).await {
            Ok(0) => return Err((ExchangeError::Closed, heard > 0)),
            Ok(n) => heard += n,
            Err(e) => return Err((ExchangeError::Read(e), heard > 0)),
        }
        parse = raw.buf[before..].contains(&b'\n') || raw.buf.len() >= MAX_HEAD;
    }
}

/// The answer of `head`, its body to be read off `raw`.
fn response(head: Head, raw: Box<Raw>) -> Response<PlainBody> {
    let Head {
        status,
        version,
        headers,
        reason,
        framing,
        keep_alive,
    } = head;
    let decoder = Decoder::new(framing);
    let mut body = PlainBody {
        raw: Some(raw),
        decoder,
        keep_alive,
        broken: None,
        // The head is yet to go out.
        fresh: true,
    };
    if body.decoder.is_done() {
        body.settle();
    }
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    *resp.headers_mut() = headers;
    if let Some(reason) = reason.and_then(|r| hyper::ext::ReasonPhrase::try_from(r).ok()) {
        resp.extensions_mut().insert(reason);
    }
    resp
}

/// An answer's body, read off its connection as it is polled. Dropped
/// before its end, it closes the connection (the upstream is not left
/// sending what nobody reads).
pub struct PlainBody {
    /// `None` once the body is over.
    raw: Option<Box<Raw>>,
    decoder: Decoder,
    keep_alive: bool,
    /// The error the body broke off with, held back for a poll (see
    /// [`PlainBody::fail`]): what follows a reset or a malformed section
    /// may read as a clean end.
    broken: Option<BoxError>,
    /// A frame (or the head) went out since the body last waited.
    fresh: bool,
}

impl PlainBody {
    /// Once the body is over, the connection goes back to its pool, if it
    /// may carry another request and nothing more came on it.
    fn settle(&mut self) {
        if !self.decoder.is_done() {
            return;
        }
        if let Some(raw) = self.raw.take() {
            if self.keep_alive && raw.buf.is_empty() {
                raw.shelf.clone().put_plain(raw);
            }
        }
    }

    /// The body breaks off with `e`. Right after a frame, once the caller's
    /// connection has had a turn: it writes out what it has (the head, the
    /// last data) when the body waits, and an error first would leave the
    /// caller with nothing, not with a body cut short. The connection is
    /// closed at once either way.
    fn fail(
        &mut self,
        e: impl Into<BoxError>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.raw = None;
        if std::mem::take(&mut self.fresh) {
            self.broken = Some(e.into());
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        Poll::Ready(Some(Err(e.into())))
    }
}

/// A body let go before its end: what of it already came is read through
/// (no waiting), so that a connection whose answer was whole but not
/// forwarded (a 503 the retry loop tries again, say) is used again rather
/// than closed, and a retry costs the upstream no new connection.
impl Drop for PlainBody {
    fn drop(&mut self) {
        let Some(raw) = self.raw.as_mut() else {
            return;
        };
        loop {
            match self.decoder.decode(&mut raw.buf) {
                Ok(Decoded::Data(_) | Decoded::Trailers(_)) => {}
                Ok(Decoded::End) => break,
                Ok(Decoded::More) | Err(_) => return,
            }
        }
        self.settle();
    }
}

impl Body for PlainBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            let Some(raw) = this.raw.as_mut() else {
                return Poll::Ready(this.broken.take().map(Err));
            };
            let frame = match this.decoder.decode(&mut raw.buf) {
                Ok(Decoded::Data(data)) => Frame::data(data),
                Ok(Decoded::Trailers(trailers)) => Frame::trailers(trailers),
                Ok(Decoded::End) => {
                    this.settle();
                    return Poll::Ready(None);
                }
                Ok(Decoded::More) => {
                    let read = raw.poll_fill(cx);
                    if read.is_pending() {
                        this.fresh = false;
                    }
                    match ready!(read) {
                        Ok(0) => match this.decoder.eof() {
                            Ok(_) => {
                                this.raw = None;
                                return Poll::Ready(None);
                            }
                            Err(e) => return this.fail(e, cx),
                        },
                        Ok(_) => continue,
                        Err(e) => return this.fail(e, cx),
                    }
                }
                Err(e) => return this.fail(e, cx),
            };
            this.fresh = true;
            this.settle();
            return Poll::Ready(Some(Ok(frame)));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.decoder.is_done() && self.broken.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder.remaining() {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A socket to an upstream that has answered one request, read as the
    /// exchange reads it (the read that ended the answer drained the
    /// socket), and the upstream's end.
    async fn answered() -> (Box<Raw>, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut upstream, _) = listener.accept().await.unwrap();
        let mut raw = Raw::new(stream, Shelf::none());
        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        upstream.write_all(answer).await.unwrap();
        while raw.buf.len() < answer.len() {
            let read = poll_fn(|cx| raw.poll_fill(cx)).await.unwrap();
            assert!(read > 0);
        }
        raw.buf.clear();
        (raw, upstream)
    }

    /// Waits until the reactor has seen the socket readable.
    async fn seen_readable(raw: &Raw) {
        poll_fn(|cx| raw.stream.poll_read_ready(cx)).await.unwrap();
    }

    #[tokio::test]
    async fn a_drained_socket_is_quiet_until_its_upstream_closes_it() {
        let (raw, upstream) = answered().await;
        assert!(raw.is_quiet());
        assert!(raw.is_quiet(), "asking does not change the answer");
        drop(upstream);
        seen_readable(&raw).await;
        assert!(!raw.is_quiet());
    }

    /// Fields as a caller's request may bring them, with framing of its own.
    fn fields() -> Fields {
        let mut map = http::HeaderMap::new();
        map.append("content-length", http::HeaderValue::from_static("999"));
        map.append(
            "transfer-encoding",
            http::HeaderValue::from_static("chunked"),
        );
        map.append("x-a", http::HeaderValue::from_static("b"));
        Fields {
            host: http::HeaderValue::from_static("up:80"),
            attempt: None,
            extra: http::HeaderMap::new(),
            kept: std::sync::Arc::new(super::super::outgoing::Kept { map, hop: None }),
        }
    }

    #[test]
    fn a_head_is_framed_by_the_body_read_not_by_the_callers_fields() {
        let mut buf = BytesMut::new();
        encode(&mut buf, &Method::POST, "/p", &fields(), Some(12));
        assert_eq!(
            &buf[..],
            b"POST /p HTTP/1.1\r\nhost: up:80\r\nx-a: b\r\ncontent-length: 12\r\n\r\n"
        );
        // With no body, a length (of 0, say) is passed on as it came.
        encode(&mut buf, &Method::GET, "/g", &fields(), None);
        assert_eq!(
            &buf[..],
            b"GET /g HTTP/1.1\r\nhost: up:80\r\ncontent-length: 999\r\nx-a: b\r\n\r\n"
        );
    }

    #[tokio::test]
    async fn a_head_and_its_body_go_whole_however_the_socket_takes_them() {
        let (raw, mut upstream) = answered().await;
        // Larger than the socket takes at once while the upstream reads
        // nothing: written as the upstream reads.
        let mut body = http_body_util::Full::new(Bytes::from(vec![b'x'; 4 << 20]));
        let held = super::super::replay::Held::counted_elsewhere(4 << 20);
        let body = Whole::read(&mut body, held).await.unwrap();
        let send = tokio::spawn(async move {
            let fields = fields();
            exchange(raw, &Method::PUT, "/big", &fields, Some(body))
                .await
                .map(|resp| resp.status())
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        let head_end = loop {
            let n = upstream.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request broke off");
            got.extend_from_slice(&buf[..n]);
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                if got.len() >= end + 4 + (4 << 20) {
                    break end + 4;
                }
            }
        };
        assert_eq!(
            got.len(),
            head_end + (4 << 20),
            "nothing more, nothing less"
        );
        assert!(got[head_end..].iter().all(|&b| b == b'x'));
        assert!(String::from_utf8_lossy(&got[..head_end]).contains("content-length: 4194304\r\n"));
        upstream
            .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(send.await.unwrap().unwrap(), http::StatusCode::CREATED);
    }

    #[tokio::test]
    async fn stray_bytes_make_a_socket_unfit() {
        let (raw, mut upstream) = answered().await;
        upstream.write_all(b"HTTP/1.1 200 OK\r\n").await.unwrap();
        seen_readable(&raw).await;
        assert!(!raw.is_quiet());
    }
}
