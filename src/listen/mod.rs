//! What talks to callers: the accept loop and its limits, HTTP/1.1 and
//! HTTP/2 serving, TLS, eviction of silent connections and the drain.

pub(crate) mod closing;
pub(crate) mod drain;
pub mod h1;
pub mod pressure;
mod sniff;
pub(crate) mod stall;
pub use stall::send_queue_with;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::{http1, http2};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

use crate::listen::drain::{Conduct, Drain};
use crate::listen::h1::{Readable, Rewind};
use crate::wire::CallerBody;

/// HTTP/2 streams one caller connection may have open at once.
const MAX_STREAMS: u32 = 100;
/// HTTP/2 streams all connections of a listener may have open at once
/// (each request waiting for an upstream slot holds about 4 KiB): past
/// 20 connections each is offered its share (at least 8), and a stream
/// past the bound is answered 503 `overloaded` at once. 200 connections
/// of 100 streams each held 94 MiB before the bound.
const H2_STREAMS: usize = 2048;
const H2_MIN_STREAMS: u32 = 8;
/// What one HTTP/2 stream's answer may have queued for its caller.
const H2_SEND_BUFFER: usize = 64 * 1024;

/// What a caller may send on an HTTP/2 stream, and on all of a
/// connection's streams together, before the proxy reads it: HTTP/2's own
/// initial window for both, which a caller may fill before it has read the
/// proxy's settings anyway. At 128 KiB a connection, 250 connections of
/// uploads stalled behind busy upstream slots held 5 MiB more.
const H2_STREAM_WINDOW: u32 = 64 * 1024;
const H2_CONNECTION_WINDOW: u32 = 64 * 1024;
/// What all HTTP/2 connections of a listener may hold together: past 128
/// of them, each new one gets its share, down to [`H2_MIN_WINDOW`] (once
/// its first 64 KiB is read: HTTP/2 lets a connection's window only grow).
const H2_WINDOWS: u32 = 8 << 20;
const H2_MIN_WINDOW: u32 = 8 * 1024;

/// The most of an unfinished HTTP/1 request head (its request line and
/// header fields) a caller connection may have buffered: past it, hyper
/// answers 431 and the request is never forwarded. hyper checks when a read
/// leaves the head unfinished, so a head read in large pieces may reach
/// twice this. hyper's default (about 400 KB) let each caller connection
/// hold that much while its head arrived, for up to `header_read_timeout`:
/// 400 connections sending 390 KB heads held 158 MiB. Envoy allows 60 KiB,
/// nginx 32 KiB (4 lines of 8 KiB), HAProxy 16 KiB. Also the most hyper
/// reads at once from a caller.
const MAX_REQUEST_HEAD: usize = 64 * 1024;

/// The service a listener serves its connections with (the proxy's, or
/// the admin listener's).
pub trait CallerService<B: AnswerBody>:
    hyper::service::Service<
        Request<CallerBody>,
        Response = http::Response<B>,
        Error = Infallible,
        Future: Unpin + Send + 'static,
    > + Unpin
    + Send
    + 'static
{
}

impl<S, B> CallerService<B> for S
where
    B: AnswerBody,
    S: hyper::service::Service<
            Request<CallerBody>,
            Response = http::Response<B>,
            Error = Infallible,
            Future: Unpin + Send + 'static,
        > + Unpin
        + Send
        + 'static,
{
}

/// The body of an answer a listener writes.
pub trait AnswerBody:
    http_body::Body<Data: Send, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + 'static
{
}

impl<B> AnswerBody for B where
    B: http_body::Body<Data: Send, Error: Into<Box<dyn std::error::Error + Send + Sync>>>
        + Send
        + 'static
{
}

/// Resolves once `stop` turns true (or its sender is gone).
pub async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A request being answered: tells its connection's [`Conduct`] whether it
/// was answered or abandoned (dropped before its answer).
pub(crate) struct Abandoned(pub(crate) Option<Arc<Conduct>>);

impl Abandoned {
    /// The request got its answer. One the proxy shed at once (its limits
    /// or its breaker) does not count as answered: a connection that opens
    /// and resets streams faster than the upstream can take them would
    /// otherwise earn, from its own shed streams, the credit that keeps it
    /// from being expelled.
    /// Gives the connection's conduct back.
    pub(crate) fn answered<B>(mut self, resp: &http::Response<B>) -> Option<Arc<Conduct>> {
        let conduct = self.0.take()?;
        let shed = resp
            .headers()
            .get(&crate::wire::headers::X_HERDGUARD_ERROR)
            .is_some_and(|e| e == "overloaded" || e == "circuit-open");
        match shed {
            true => conduct.shed(),
            false => conduct.answered(),
        }
        Some(conduct)
    }
}

impl Drop for Abandoned {
    fn drop(&mut self) {
        if let Some(conduct) = self.0.take() {
            conduct.abandoned();
        }
    }
}

/// Connections still sending their first request head, per listener, at
/// most: callers send a head in one write; only an attack holds many.
const MAX_UNHEARD: usize = 256;
/// How long a connection may take to send its first head before, past
/// [`MAX_UNHEARD`], it is closed for a newer one: a caller sends its head
/// as it connects, or just after its pool has opened its connections;
/// only a slow head takes this long. (Short: heads sent fast and left one
/// byte short pile up for this long before the oldest go.)
const SLOW_HEAD: Duration = Duration::from_millis(250);

/// The connections of a listener that have not finished a request head
/// yet, oldest first: when the listener is full, the oldest is closed for
/// a caller waiting to connect, so that connections that say nothing, or
/// send their head a byte at a time, cannot starve those that would make
/// a request (the kubelet's probes on the admin listener first).
#[derive(Default)]
struct Silent {
    waiting: std::sync::Mutex<std::collections::VecDeque<std::sync::Weak<Conduct>>>,
    /// Every connection of the listener open now, oldest first (each
    /// leaves as it closes, see [`Conduct`]'s drop): when it is full and
    /// none is unheard, the oldest one idle between requests is asked to
    /// close for a new caller.
    every: crate::listen::drain::Open,
    next: std::sync::atomic::AtomicU64,
}

/// Whether the connection of `conduct` is still open and has not spoken.
fn unheard(conduct: &std::sync::Weak<Conduct>) -> bool {
    conduct.upgrade().is_some_and(|c| !c.has_spoken())
}

impl Silent {
    /// A listener's lists, its connections watched by `pressure` if given.
    fn watched(pressure: Option<&pressure::Pressure>) -> Self {
        let silent = Silent::default();
        if let Some(pressure) = pressure {
            pressure.watch(&silent.every);
        }
        silent
    }

    /// Registers a new connection. Entries closed or spoken are dropped
    /// from the front as new ones come, and all of them once the list is
    /// twice `max`: a connection that stays unheard at the front cannot
    /// make the list grow with every connection accepted behind it (at most
    /// `max` are open, each holding a slot), so it stays within `2 * max`.
    ///
    /// Past [`MAX_UNHEARD`] connections still sending their first head,
    /// the oldest of them that has begun its head is closed whether the
    /// listener is full or not, if it has been at it for [`SLOW_HEAD`]: a
    /// head may hold up to 64 KiB of buffer, and thousands of heads left
    /// one byte short would otherwise hold hundreds of MiB. A burst of
    /// callers that connect together and then send their heads (a client
    /// pool starting) is not cut: those that have sent nothing hold no
    /// buffer.
    fn push(&self, max: usize, conduct: &Arc<Conduct>) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        while waiting.front().is_some_and(|w| !unheard(w)) {
            waiting.pop_front();
        }
        if waiting.len() >= max.min(MAX_UNHEARD).saturating_mul(2) {
            waiting.retain(unheard);
        }
        waiting.push_back(Arc::downgrade(conduct));
        if waiting.len() > MAX_UNHEARD {
            waiting.retain(unheard);
        }
        if waiting.len() > MAX_UNHEARD {
            // One that has sent nothing holds no buffer yet: only a head
            // begun and slow to finish is worth a slot's memory.
            let slow = waiting.iter().position(|w| {
                w.upgrade()
                    .is_some_and(|c| c.has_begun() && !c.has_spoken() && c.quiet_for() >= SLOW_HEAD)
            });
            if let Some(c) = slow
                .and_then(|i| waiting.remove(i))
                .and_then(|w| w.upgrade())
            {
                c.evict();
            }
        }
    }

    /// A new connection's conduct, listed among the open ones and the
    /// unheard ones.
    fn open(&self, limits: &Limits) -> Arc<Conduct> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let conduct = Conduct::new(
            limits.idle_timeout,
            limits.write_timeout,
            limits.traffic.clone(),
        )
        .listed_in(&self.every, id);
        self.push(limits.max_connections, &conduct);
        conduct
    }

    /// Asks the oldest connection idle between requests to close; false
    /// if there is none. Those passed over (busy) stay where they are.
    fn expel_oldest_idle(&self) -> bool {
        let every = self.every.lock().unwrap_or_else(|e| e.into_inner());
        every
            .values()
            .filter_map(std::sync::Weak::upgrade)
            .any(|c| c.expel_idle())
    }

    /// Closes the oldest connection still unheard; false if there is none.
    fn evict_oldest(&self) -> bool {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(oldest) = waiting.pop_front() {
            if let Some(conduct) = oldest.upgrade().filter(|c| !c.has_spoken()) {
                conduct.evict();
                return true;
            }
        }
        false
    }
}

/// What a new connection's first bytes say.
#[derive(Debug, PartialEq, Eq)]
enum Opening {
    /// Enough to tell its protocol: serve it, with HTTP/2 if `h2`.
    Speaks { h2: bool },
    /// Nothing (or part of an HTTP/2 preface) within `header_read_timeout`,
    /// or closed; or evicted or drained before it said anything.
    Silent,
    /// `PRI ` and then not the HTTP/2 preface (RFC 9113 §3.4: a connection
    /// error, answered with GOAWAY `PROTOCOL_ERROR`).
    BadPreface,
}

/// Whether the caller sends enough to tell its protocol within `wait`: a
/// first byte, and all of the HTTP/2 preface when it starts like one.
async fn opening(stream: &tokio::net::TcpStream, wait: Duration) -> Opening {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let told = async {
        let mut buf = [0u8; PREFACE.len()];
        loop {
            match stream.peek(&mut buf).await {
                Ok(0) | Err(_) => return Opening::Silent,
                Ok(n) if buf[..n] == PREFACE[..n] && n == PREFACE.len() => {
                    return Opening::Speaks { h2: true }
                }
                Ok(n) if buf[..n] != PREFACE[..n] => {
                    return match n >= 4 && buf[..4] == PREFACE[..4] {
                        true => Opening::BadPreface,
                        false => Opening::Speaks { h2: false },
                    };
                }
                // Part of a preface: peeking again at once would spin on the
                // same bytes, so look again shortly.
                Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    };
    tokio::time::timeout(wait, told)
        .await
        .unwrap_or(Opening::Silent)
}

/// Answers an invalid HTTP/2 preface with GOAWAY `PROTOCOL_ERROR` (last
/// stream 0) and closes.
async fn refuse_preface(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt as _;
    const GOAWAY: [u8; 17] = [
        0, 0, 8, // length
        0x7, 0, // GOAWAY, no flags
        0, 0, 0, 0, // stream 0
        0, 0, 0, 0, // last stream id
        0, 0, 0, 1, // PROTOCOL_ERROR
    ];
    let write = async {
        let _ = stream.write_all(&GOAWAY).await;
        let _ = stream.shutdown().await;
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

pub(crate) fn local_addr(listener: &TcpListener) -> SocketAddr {
    listener
        .local_addr()
        .expect("a bound listener has an address")
}

/// The connection builders of one listener, shared by its connections.
struct Builders {
    h1: http1::Builder,
    h2: http2::Builder<TokioExecutor>,
    /// HTTP/2 connections open now.
    h2_open: Arc<std::sync::atomic::AtomicUsize>,
    /// HTTP/2 streams being answered now, over all connections.
    h2_streams: Arc<std::sync::atomic::AtomicUsize>,
}

/// The service on an HTTP/2 connection: each stream's body as a
/// [`CallerBody`] that notes nothing (streams have their own ends), each
/// stream counted open while its request is answered, and one past
/// [`H2_STREAMS`] marked [`Crowded`](crate::wire::Crowded).
struct Streams<S> {
    service: S,
    open: Arc<std::sync::atomic::AtomicUsize>,
}

impl<S> hyper::service::Service<Request<hyper::body::Incoming>> for Streams<S>
where
    S: hyper::service::Service<Request<CallerBody>>,
    S::Future: Unpin,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = OpenStream<S::Future>;

    fn call(&self, req: Request<hyper::body::Incoming>) -> Self::Future {
        let open = self.open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut req = req.map(CallerBody::new);
        if open >= H2_STREAMS {
            req.extensions_mut().insert(crate::wire::Crowded::Held);
        } else if pressure::under_pressure() {
            req.extensions_mut().insert(crate::wire::Crowded::Memory);
        }
        OpenStream {
            answer: self.service.call(req),
            open: self.open.clone(),
        }
    }
}

/// A stream's answer, the stream counted open until it is done or dropped.
struct OpenStream<F> {
    answer: F,
    open: Arc<std::sync::atomic::AtomicUsize>,
}

impl<F: Future + Unpin> Future for OpenStream<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        std::pin::Pin::new(&mut self.answer).poll(cx)
    }
}

impl<F> Drop for OpenStream<F> {
    fn drop(&mut self) {
        self.open.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One HTTP/2 connection counted open while this lives.
struct H2Open(Arc<std::sync::atomic::AtomicUsize>);

impl H2Open {
    fn new(open: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self(open.clone())
    }

    /// Connections open, this one included.
    fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for H2Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Builders {
    fn new() -> Self {
        let mut h1 = http1::Builder::new();
        // Heads are timed by the connection's stream (`WriteStall`), which
        // arms a timer only for a head that does not come whole at once.
        h1.header_read_timeout(None)
            .max_buf_size(MAX_REQUEST_HEAD)
            .keep_alive(true);
        let mut h2 = http2::Builder::new(TokioExecutor::new());
        // One connection's streams may each hold an upstream slot: at most
        // 100 at once (nginx allows 128; h2's default is no limit).
        // Flow-control windows bound what a caller can make one connection
        // hold of bodies not yet read: 64 KiB for a stream and for the
        // connection (hyper's default is 1 MiB for each stream and the
        // connection: 100 MiB over 100 stalled connections).
        // What a stream may have queued for a caller that does not read
        // (hyper's default is about 400 KB: 20 connections of GETs for
        // large bodies, never read, held 150-210 MiB).
        h2.timer(TokioTimer::new())
            .max_send_buf_size(H2_SEND_BUFFER)
            .max_concurrent_streams(MAX_STREAMS)
            .initial_stream_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(H2_CONNECTION_WINDOW);
        Self {
            h1,
            h2,
            h2_open: Arc::default(),
            h2_streams: Arc::default(),
        }
    }
}

/// What serves one accepted connection, plain or TLS.
struct Serve<'a> {
    builders: &'a Builders,
    drain: &'a Drain,
    conduct: &'a Arc<Conduct>,
    write_timeout: Duration,
    /// For a TLS caller's handshake, and then for its first bytes.
    header_read_timeout: Duration,
}

type ServeError = Box<dyn std::error::Error + Send + Sync>;

impl Serve<'_> {
    /// HTTP/1.1 (see [`crate::h1`]) or, if `h2`, HTTP/2 over `stream`, its
    /// writes watched for stalls, the connection watched for the drain,
    /// idleness and expulsion. `None`: closed outright (see
    /// [`crate::listen::drain::Watched`]).
    async fn connection<I, S, B>(
        &self,
        stream: Rewind<I>,
        h2: bool,
        service: S,
    ) -> Option<Result<(), ServeError>>
    where
        I: Readable,
        S: CallerService<B>,
        B: AnswerBody,
    {
        if h2 {
            self.conduct.spoken_in_h2();
            let io = TokioIo::new(crate::listen::stall::WriteStall::new(
                stream,
                self.write_timeout,
                self.conduct.written.clone(),
            ));
            return self
                .h2(io, service)
                .await
                .map(|ended| ended.map_err(Into::into));
        }
        let serving = crate::listen::h1::Serving {
            builder: &self.builders.h1,
            drain: self.drain,
            cycle: &self.conduct.cycle,
            conduct: self.conduct,
            write_timeout: self.write_timeout,
            idle_timeout: self.conduct.idle_timeout,
            header_read_timeout: self.header_read_timeout,
        };
        Some(serving.serve(stream, service).await.map_err(Into::into))
    }

    /// An HTTP/2 connection, watched, on the heap: its state is large, and
    /// an HTTP/1.1 connection's task would otherwise keep room for it.
    fn h2<I, S, B>(
        &self,
        io: TokioIo<crate::listen::stall::WriteStall<Rewind<I>>>,
        service: S,
    ) -> std::pin::Pin<Box<impl Future<Output = Option<Result<(), hyper::Error>>> + '_>>
    where
        I: Readable,
        S: CallerService<B>,
        B: AnswerBody,
    {
        // The windows shrink as HTTP/2 connections add up: together they
        // may hold at most H2_WINDOWS of bodies not yet read.
        let open = H2Open::new(&self.builders.h2_open);
        let connections = open.count().max(1);
        let window = H2_CONNECTION_WINDOW
            .min(H2_WINDOWS / connections as u32)
            .max(H2_MIN_WINDOW);
        let streams = u32::try_from(H2_STREAMS / connections)
            .unwrap_or(MAX_STREAMS)
            .clamp(H2_MIN_STREAMS, MAX_STREAMS);
        let mut h2 = self.builders.h2.clone();
        h2.initial_connection_window_size(window)
            .initial_stream_window_size(window.min(H2_STREAM_WINDOW))
            .max_concurrent_streams(streams);
        let streams = Streams {
            service,
            open: self.builders.h2_streams.clone(),
        };
        let conn = h2.serve_connection(io, streams);
        Box::pin(async move {
            let served = self.drain.watch(conn, self.conduct).await;
            drop(open);
            served
        })
    }

    /// [`connection`](Self::connection) inside TLS: the handshake, and the
    /// first bytes after it, each within `wait`.
    async fn tls<S, B>(
        &self,
        acceptor: tokio_rustls::TlsAcceptor,
        stream: tokio::net::TcpStream,
        service: S,
        what: &'static str,
        peer: SocketAddr,
    ) -> Option<Result<(), ServeError>>
    where
        S: CallerService<B>,
        B: AnswerBody,
    {
        let wait = self.header_read_timeout;
        let opened = async {
            let stream = match tokio::time::timeout(wait, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    debug!(listener = what, %peer, error = %e, "TLS handshake failed");
                    return None;
                }
                Err(_) => {
                    debug!(listener = what, %peer, "TLS handshake not done within header_read_timeout");
                    return None;
                }
            };
            // The protocol the handshake agreed is the one spoken: an
            // HTTP/2 preface after `http/1.1`, or anything else after `h2`,
            // is refused.
            let agreed = match stream.get_ref().1.alpn_protocol() {
                Some(b"h2") => Some(true),
                Some(b"http/1.1") => Some(false),
                _ => None,
            };
            let first = sniff::first_bytes(stream, tokio::time::Instant::now() + wait).await;
            if first.is_none() {
                debug!(listener = what, %peer, "connection closed: nothing sent after the TLS handshake within header_read_timeout");
            }
            first.map(|stream| (agreed, stream))
        };
        // Until its first bytes inside TLS, the connection has asked for
        // nothing: a new caller at max_connections or the drain closes it,
        // its handshake included (or a caller could hold its slot with one).
        let opened = tokio::select! {
            biased;
            opened = opened => opened,
            () = self.conduct.until_evicted() => {
                debug!(listener = what, %peer, "connection closed before it sent anything inside TLS: a new caller needed its slot");
                None
            }
            () = self.drain.started() => {
                debug!(listener = what, %peer, "connection closed before it sent anything inside TLS: the drain started");
                None
            }
        };
        let Some((agreed, stream)) = opened else {
            return Some(Ok(()));
        };
        let h2 = sniff::speaks_h2(stream.prefix()).unwrap_or(false);
        if agreed.is_some_and(|agreed| agreed != h2) {
            debug!(listener = what, %peer, "connection closed: the caller does not speak the protocol ALPN agreed");
            return Some(Ok(()));
        }
        // Evictable until its first whole head, as a plain connection is.
        // Awaited in place (see `connection_task`).
        tokio::select! {
            biased;
            served = self.connection(stream, h2, service) => served,
            () = self.conduct.until_evicted_unheard() => evicted_unheard(what, peer),
        }
    }
}

pub(crate) struct Limits {
    /// Callers speak TLS first.
    pub(crate) tls: Option<tokio_rustls::TlsAcceptor>,
    pub(crate) max_connections: usize,
    pub(crate) header_read_timeout: Duration,
    pub(crate) write_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) drain_timeout: Duration,
    /// Read each connection's original destination (`SO_ORIGINAL_DST`).
    pub(crate) transparent: bool,
    /// Where the listener's connections and bytes are counted.
    pub(crate) traffic: Arc<crate::observe::metrics::Traffic>,
    /// The memory bound that may cut the listener's connections.
    pub(crate) pressure: Option<Arc<pressure::Pressure>>,
    /// Each connection's `SO_SNDBUF`; none: the kernel's autotuning.
    pub(crate) send_buffer: Option<usize>,
}

/// Where a connection redirected by iptables (`REDIRECT`) was going, read
/// from the kernel's NAT table (`SO_ORIGINAL_DST`); `None` when it was not
/// redirected (it came to the listener's own address).
pub(crate) fn original_destination(stream: &tokio::net::TcpStream) -> Option<SocketAddr> {
    use rustix::net::sockopt;
    let local = stream.local_addr().ok()?;
    let original = match local {
        SocketAddr::V4(_) => sockopt::ip_original_dst(stream).map(SocketAddr::V4),
        SocketAddr::V6(_) => sockopt::ipv6_original_dst(stream)
            .map(SocketAddr::V6)
            .or_else(|_| sockopt::ip_original_dst(stream).map(SocketAddr::V4)),
    };
    original.ok().filter(|o| *o != local)
}

/// Accepts connections until `stop`, serving each with HTTP/1.1 or h2c
/// (upgrades allowed), then waits up to `drain_timeout` for them to finish.
pub(crate) async fn accept_loop<M, S, B>(
    what: &'static str,
    listener: TcpListener,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
    make_service: M,
) where
    M: Fn(SocketAddr, Option<SocketAddr>, &Arc<Conduct>) -> S,
    S: CallerService<B>,
    B: AnswerBody,
{
    let builders = Arc::new(Builders::new());
    let drain = Drain::new();
    // A connection holds a permit until it closes: when all are back, all
    // connections are closed.
    let permits = Arc::new(Semaphore::new(limits.max_connections));

    let silent = Silent::watched(limits.pressure.as_deref());

    loop {
        let (stream, peer) = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off briefly, then go on.
                    warn!(listener = what, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(permit) = admit(&permits, &silent, &mut stop, what, peer).await else {
            break;
        };
        let original = tune(&stream, &limits);
        let conduct = silent.open(&limits);
        let service = make_service(peer, original, &conduct);
        tokio::spawn(connection_task(Accepted {
            stream,
            peer,
            permit,
            conduct,
            service,
            builders: builders.clone(),
            drain: drain.clone(),
            what,
            wait: limits.header_read_timeout,
            write_timeout: limits.write_timeout,
            tls: limits.tls.clone(),
            pressured: limits.pressure.is_some(),
        }));
    }
    drop(listener);
    drain.start();
    drain_connections(&permits, what, limits.max_connections, limits.drain_timeout).await;
}

/// An accepted connection, and what its task needs.
struct Accepted<S> {
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    /// Its slot, given back as the task ends.
    permit: OwnedSemaphorePermit,
    conduct: Arc<Conduct>,
    service: S,
    builders: Arc<Builders>,
    drain: Drain,
    what: &'static str,
    /// `header_read_timeout`.
    wait: Duration,
    write_timeout: Duration,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// The listener has a memory bound.
    pressured: bool,
}

/// The task of one connection. Its future is what every connection keeps
/// for its life, in a tokio task cell aligned to 128 bytes: a few bytes
/// more can cost a whole 128 for each connection (docs/memory.md). What a
/// connection needs besides goes in `conduct`. A future handed by value to
/// an `async fn` that awaits it is kept twice (once here, once in the
/// callee's): the connection's future is awaited in place. Its size is
/// held by a test.
fn connection_task<S, B>(accepted: Accepted<S>) -> impl Future<Output = ()> + Send + 'static
where
    S: CallerService<B>,
    B: AnswerBody,
{
    // Taken apart here, outside the future: the future then keeps each
    // part once (kept whole as the future's argument, the parts moved out
    // of it were kept beside it: 1,432 bytes against 1,224).
    let Accepted {
        stream,
        peer,
        permit,
        conduct,
        service,
        builders,
        drain,
        what,
        wait,
        write_timeout,
        tls,
        pressured,
    } = accepted;
    // Each poll reads the clock once, for all the request path does in it.
    crate::units::clock::Clocked::new(async move {
        // A connection that says nothing must not hold its slot: the
        // head's timer starts only once the protocol is known, and that
        // is learnt from the first bytes.
        // Nor its slot past a drain: with no request, there is nothing
        // to finish (bytes already there are served first).
        let opened = tokio::select! {
            biased;
            opened = opening(&stream, wait) => opened,
            () = conduct.until_evicted() => Opening::Silent,
            () = drain.started() => Opening::Silent,
        };
        let h2 = match opened {
            // Memory is short: what a connection builds costs more than
            // its refusal, so it is refused at the door.
            Opening::Speaks { h2 } if pressured && pressure::under_pressure() => {
                return pressure::refuse_at_the_door(stream, h2, tls.is_some()).await;
            }
            Opening::Speaks { h2 } => {
                conduct.began();
                h2
            }
            Opening::Silent => {
                // Its slot (`permit`) goes back as the task ends.
                debug!(listener = what, %peer, "connection closed: it sent nothing within header_read_timeout, before a new caller needed its slot, or before the drain");
                return;
            }
            Opening::BadPreface => {
                debug!(listener = what, %peer, "connection closed: invalid HTTP/2 preface");
                return refuse_preface(stream).await;
            }
        };
        let serve = Serve {
            builders: &builders,
            drain: &drain,
            conduct: &conduct,
            write_timeout,
            header_read_timeout: wait,
        };
        let served = match tls {
            // Evictable (closed outright) until its first whole head:
            // a head sent a byte at a time holds no slot a new caller
            // needs.
            None => tokio::select! {
                biased;
                served = serve.connection(Rewind::new(bytes::Bytes::new(), stream), h2, service) => served,
                () = conduct.until_evicted_unheard() => evicted_unheard(what, peer),
            },
            // The handshake must be done within the time the request
            // head has: a caller that starts one and stalls holds nothing.
            // And the first bytes inside it too, or it could sit silent
            // after its handshake for as long as it liked.
            // On the heap: a TLS connection's state is large, and a
            // plain connection's task would otherwise keep room for it.
            Some(acceptor) => Box::pin(serve.tls(acceptor, stream, service, what, peer)).await,
        };
        log_end(what, peer, served);
        drop(permit);
    })
}

/// Sets a new connection's socket options (no Nagle; the send buffer the
/// listener asks for, before anything is written: the kernel then never
/// grows it; `TCP_USER_TIMEOUT` at twice `write_timeout`), and reads where
/// it was going if it was redirected.
///
/// The user timeout is the kernel's backstop for what no pending write
/// shows: an answer that fit the socket whole, to a caller that reads
/// nothing and keeps its connection, sat queued until `idle_timeout`; a
/// caller gone without a word kept what was sent to it retransmitted for
/// about 15 minutes. Twice `write_timeout`, as the kernel's count restarts
/// only when the caller's window opens by a whole segment, where the
/// proxy's own look at the send queue counts any of it taken (see
/// `stall`); a close with data queued sets it to `write_timeout`.
fn tune(stream: &tokio::net::TcpStream, limits: &Limits) -> Option<SocketAddr> {
    let _ = stream.set_nodelay(true);
    let backstop = limits.write_timeout.saturating_mul(2).as_millis();
    let backstop = u32::try_from(backstop).unwrap_or(u32::MAX).max(1);
    let _ = rustix::net::sockopt::set_tcp_user_timeout(stream, backstop);
    if let Some(size) = limits.send_buffer {
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(stream, size);
    }
    limits
        .transparent
        .then(|| original_destination(stream))
        .flatten()
}

/// A connection closed outright, evicted for a new caller before a whole
/// request head came.
fn evicted_unheard(what: &'static str, peer: SocketAddr) -> Option<Result<(), ServeError>> {
    debug!(listener = what, %peer, "connection closed before it finished a request head: a new caller needed its slot");
    None
}

/// How a connection ended, for the debug log.
fn log_end(what: &'static str, peer: SocketAddr, served: Option<Result<(), ServeError>>) {
    match served {
        Some(Ok(())) => {}
        Some(Err(e)) => {
            debug!(listener = what, %peer, error = %e, "connection ended with an error")
        }
        None => debug!(
            listener = what,
            %peer,
            "connection closed: asked to close, it sent nothing for write_timeout"
        ),
    }
}

/// A connection slot for a new caller. When all are taken, the new caller
/// takes the slot of the oldest connection that has sent nothing yet, if
/// any, so connections that make no request cannot starve those that would
/// (the kubelet's probes on the admin listener first); else it waits for one
/// to close. `None` once `stop` turns true.
async fn admit(
    permits: &Arc<Semaphore>,
    silent: &Silent,
    stop: &mut watch::Receiver<bool>,
    what: &'static str,
    peer: SocketAddr,
) -> Option<OwnedSemaphorePermit> {
    if let Ok(permit) = permits.clone().try_acquire_owned() {
        return Some(permit);
    }
    if silent.evict_oldest() {
        debug!(listener = what, %peer, "at max_connections: the oldest connection that has not finished a request head is closed for a new one");
    } else if silent.expel_oldest_idle() {
        debug!(listener = what, %peer, "at max_connections: the oldest connection idle between requests is closed for a new one");
    }
    tokio::select! {
        biased;
        _ = stopped(stop) => None,
        // Never closed; were it, no more connections.
        permit = permits.clone().acquire_owned() => permit.ok(),
    }
}

/// Waits up to `timeout` for every connection's slot to come back, that is
/// for every connection to close.
async fn drain_connections(
    permits: &Semaphore,
    what: &'static str,
    max_connections: usize,
    timeout: Duration,
) {
    let open = max_connections - permits.available_permits();
    if open > 0 {
        info!(listener = what, connections = open, timeout = ?timeout, "draining");
    }
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(timeout, permits.acquire_many(all))
        .await
        .is_err()
    {
        let left = max_connections - permits.available_permits();
        warn!(
            listener = what,
            connections = left,
            timeout = ?timeout,
            "drain timeout passed with connections still open; closing them"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conduct() -> Arc<Conduct> {
        Arc::new(Conduct::new(
            Duration::from_secs(60),
            Duration::from_secs(30),
            Arc::default(),
        ))
    }

    /// What every connection keeps for its life. The proxy's own task, in
    /// the release build: 2,160 bytes when the connection's future was
    /// handed to an `async fn` that awaited it (kept twice), 1,432 with the
    /// task's parts taken apart inside its future, 1,224 now. This one, with
    /// a service of the simplest types, in the debug build the tests run:
    /// 2,256, 1,352 and 1,176.
    #[tokio::test]
    async fn a_connection_task_keeps_little() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let caller = tokio::net::TcpStream::connect(listener.local_addr().unwrap());
        let (_caller, accepted) = tokio::join!(caller, listener.accept());
        let (stream, peer) = accepted.unwrap();
        let service = hyper::service::service_fn(|_: Request<CallerBody>| {
            Box::pin(async {
                let body = http_body_util::Empty::<bytes::Bytes>::new();
                Ok::<_, Infallible>(http::Response::new(body))
            })
        });
        let task = connection_task(Accepted {
            stream,
            peer,
            permit: Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap(),
            conduct: conduct(),
            service,
            builders: Arc::new(Builders::new()),
            drain: Drain::new(),
            what: "test",
            wait: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
            tls: None,
            pressured: false,
        });
        let size = std::mem::size_of_val(&task);
        assert!(size <= 1_280, "a connection's task is {size} bytes");
    }

    #[test]
    fn a_silent_connection_held_at_the_front_does_not_grow_the_list() {
        let silent = Silent::default();
        let oldest = conduct();
        silent.push(4, &oldest);
        // Thousands accepted behind it, each closed or speaking at once.
        let mut spoken = Vec::new();
        for i in 0..10_000 {
            let c = conduct();
            silent.push(4, &c);
            if i % 2 == 0 {
                c.heard();
                spoken.push(c);
            }
        }
        let len = silent.waiting.lock().unwrap().len();
        assert!(len <= 8, "{len} entries");
        // The one still unheard is evicted, then none is left.
        assert!(silent.evict_oldest());
        assert!(!silent.evict_oldest());
        assert!(oldest.evicted_unheard_for_test());
    }

    #[tokio::test]
    async fn the_oldest_still_unheard_is_evicted_first() {
        let silent = Silent::default();
        let (first, second, third) = (conduct(), conduct(), conduct());
        silent.push(8, &first);
        silent.push(8, &second);
        silent.push(8, &third);
        first.heard(); // its head came whole
        assert!(silent.evict_oldest());
        // The second is evicted (its wake is kept for it), the third is not.
        second.until_evicted().await;
        let woken = tokio::time::timeout(Duration::ZERO, third.until_evicted()).await;
        assert!(woken.is_err(), "the newer one stays");
        assert!(!first.evicted_unheard_for_test());
    }
}
