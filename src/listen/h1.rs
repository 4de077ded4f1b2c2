//! HTTP/1.1 caller connections served one exchange at a time, so that an
//! idle keep-alive connection holds its socket and little else.
//!
//! hyper gives each HTTP/1 connection an 8 KiB write buffer when it starts
//! and an 8 KiB read buffer on its first read, and keeps both, with the
//! connection's state, for as long as the connection lives: 16 KiB and more
//! for each idle connection of a caller's pool. nginx frees its buffers when
//! a connection goes idle (`ngx_http_set_keepalive`). Here hyper's
//! connection is ended once it is idle after an answer; the socket, and any
//! bytes of the next request already read, are taken back; and a new one is
//! started when the caller sends again.
//!
//! A connection is taken back once it has been idle for [`PARK_AFTER`]: one
//! that is busy (its next request comes sooner) keeps its hyper connection,
//! so that the buffers are not made again for each request (taking every
//! connection back after each answer costs instructions on every request).
//! A connection not yet seen busy (a new one, or one whose request came
//! after a quiet spell of at least `PARK_AFTER`) is taken back as soon as
//! it answers: a caller's pool that opens a thousand connections at once,
//! sends one request on each and lets them sit, would otherwise hold a
//! thousand sets of buffers for a second, and the small objects each
//! connection keeps for its life, made between them, would pin a page of
//! that burst each once they were freed (docs/memory.md has the figures).
//!
//! Only a connection hyper would have kept open is taken back. hyper is
//! asked to end it only when the answer is written out, the request's body
//! was read to its end and no other request has begun; and only an end that
//! follows at once counts. Anything else (the caller asked to close, an
//! HTTP/1.0 caller, a body left unread, an error) closes the connection as
//! hyper would have.
//!
//! Upgrades (WebSocket) are handed over here too: the proxy gets the
//! caller's side of an upgraded connection through [`CallerUpgrade`].

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf as _, Bytes};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::sync::oneshot;

use crate::listen::drain::{Drain, Signal};
use crate::listen::stall::{CallerSocket, WriteStall, Writes};
use crate::wire::caller::{BodyEnd, CallerBody, CallerUpgrade, Upgraded};

/// A stream whose first bytes were read ahead: they are read again first.
pub struct Rewind<S> {
    prefix: Bytes,
    inner: S,
}

impl<S: CallerSocket> CallerSocket for Rewind<S> {
    fn abort_on_close(&self) {
        self.inner.abort_on_close();
    }

    fn send_queue(&self) -> Option<usize> {
        self.inner.send_queue()
    }

    fn bound_close(&self, within: Duration) {
        self.inner.bound_close(within);
    }

    fn second(&self) -> Option<std::os::fd::OwnedFd> {
        self.inner.second()
    }
}

impl<S> Rewind<S> {
    pub fn new(prefix: Bytes, inner: S) -> Self {
        Self { prefix, inner }
    }

    /// The bytes still to be read again.
    pub fn prefix(&self) -> &[u8] {
        &self.prefix
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(out.remaining());
            out.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, out)
    }
}

crate::wire::write_through!(Rewind);

/// A caller's stream that can wait for the caller's next bytes without a
/// buffer of its own.
pub trait Readable:
    AsyncRead + AsyncWrite + crate::listen::stall::CallerSocket + Unpin + Send + 'static
{
    /// Ready once the caller sends again or closes. Bytes read to find out
    /// are returned, to be read again. Polled, not async: a connection
    /// waiting keeps no future's state for it.
    fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Bytes>>;
}

impl Readable for tokio::net::TcpStream {
    fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Bytes>> {
        self.poll_read_ready(cx).map_ok(|()| Bytes::new())
    }
}

impl<S> Readable for tokio_rustls::server::TlsStream<S>
where
    S: AsyncRead + AsyncWrite + crate::listen::stall::CallerSocket + Unpin + Send + 'static,
{
    fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Bytes>> {
        // Decrypted bytes may wait in the TLS session, where the socket's
        // readiness does not show them: read some.
        let mut buf = [0u8; 512];
        let mut read = ReadBuf::new(&mut buf);
        std::task::ready!(Pin::new(self).poll_read(cx, &mut read))?;
        Poll::Ready(Ok(Bytes::copy_from_slice(read.filled())))
    }
}

/// Where one connection's current exchange stands.
pub struct Cycle {
    /// The connection's writes, and whether bytes came in since the latest
    /// request's head (or its body's end): the next head under way.
    writes: Arc<Writes>,
    /// The answer to the latest request is written out (hyper is done with
    /// its body).
    answered: AtomicBool,
    /// The latest request's body has not been read to its end.
    unread: AtomicBool,
    /// The latest answer switched protocols.
    switched: AtomicBool,
    /// The latest request is a CONNECT: a 2xx answer hands the connection over.
    connect: AtomicBool,
    /// The latest request's body was let go unread (see [`Cycle::let_go`]).
    let_go: AtomicBool,
    /// Where the caller's side goes if the latest request is upgraded.
    upgrade: Mutex<Option<oneshot::Sender<Upgraded>>>,
}

impl std::fmt::Debug for Cycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cycle")
            .field("answered", &self.answered)
            .field("unread", &self.unread)
            .field("switched", &self.switched)
            .finish_non_exhaustive()
    }
}

impl Cycle {
    /// A new connection's, over `writes`. Made as the connection is
    /// accepted, with the rest of what it keeps for its life: made at its
    /// first request, as it used to be, it sat among other connections'
    /// requests and kept a page of theirs resident once they were freed.
    pub fn new(writes: Arc<Writes>) -> Arc<Self> {
        Arc::new(Self {
            writes,
            answered: AtomicBool::new(false),
            unread: AtomicBool::new(false),
            switched: AtomicBool::new(false),
            connect: AtomicBool::new(false),
            let_go: AtomicBool::new(false),
            upgrade: Mutex::new(None),
        })
    }

    /// Whether hyper, pending, can only be waiting for the next request.
    fn idle(&self) -> bool {
        self.answered.load(Ordering::Relaxed)
            && !self.unread.load(Ordering::Acquire)
            && !self.switched.load(Ordering::Relaxed)
            && !self.writes.blocked()
            && !self.writes.heard()
    }

    /// The latest request is read: bytes from here on are the next one's.
    fn read(&self) {
        self.set_unread(false);
        self.writes.unhear();
        if self.answered.load(Ordering::SeqCst) {
            self.writes.await_head(true);
        }
    }

    /// The latest answer is written out: once its request is read too, what
    /// comes next is a head.
    fn answered(&self) {
        self.answered.store(true, Ordering::SeqCst);
        if !self.unread.load(Ordering::SeqCst) {
            self.writes.await_head(true);
        } else if self.let_go.load(Ordering::SeqCst) {
            self.writes.await_rest();
        }
    }

    /// Whether the latest request's body is still to be read: while it
    /// is, the caller's socket may hold a receive buffer of it in the
    /// kernel, which the memory bound counts.
    fn set_unread(&self, unread: bool) {
        if self.unread.load(Ordering::Acquire) != unread
            && self.unread.swap(unread, Ordering::SeqCst) != unread
        {
            crate::listen::pressure::uploading(unread);
        }
    }
}

impl Drop for Cycle {
    fn drop(&mut self) {
        self.set_unread(false);
    }
}

impl BodyEnd for Cycle {
    fn read_to_end(&self) {
        self.read();
    }

    /// A body the proxy let go unread (an answer made without it: a 404, a
    /// refusal): hyper reads past what is left of it once the answer is out,
    /// and the connection stays unfit to be taken back until it has (what
    /// is left must never be read as a request). That wait is timed as a
    /// head is, whether the caller sends or not: a caller that sends
    /// nothing more is not waited for.
    fn let_go(&self) {
        if self.unread.load(Ordering::SeqCst) {
            self.let_go.store(true, Ordering::SeqCst);
            if self.answered.load(Ordering::SeqCst) {
                self.writes.await_rest();
            }
        }
    }
}

pin_project! {
    /// An answer's body that tells its connection when hyper is done with
    /// it: hyper drops a body once its end is written into the buffer.
    pub struct Ending<B> {
        #[pin]
        inner: B,
        cycle: Option<Arc<Cycle>>,
    }

    impl<B> PinnedDrop for Ending<B> {
        fn drop(this: Pin<&mut Self>) {
            if let Some(cycle) = this.project().cycle.take() {
                cycle.answered();
            }
        }
    }
}

impl<B: Body> Body for Ending<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The service hyper calls on an HTTP/1.1 connection: the proxy's (or the
/// admin listener's), with each exchange noted in the connection's
/// [`Cycle`].
pub struct Cycled<S> {
    inner: S,
    cycle: Arc<Cycle>,
}

impl<S, B> hyper::service::Service<Request<Incoming>> for Cycled<S>
where
    S: hyper::service::Service<Request<CallerBody>, Response = Response<B>>,
{
    type Response = Response<Ending<B>>;
    type Error = S::Error;
    type Future = Answering<S::Future>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        let cycle = &self.cycle;
        cycle.answered.store(false, Ordering::Relaxed);
        let unread = !req.body().is_end_stream();
        cycle.set_unread(unread);
        cycle.writes.unhear();
        cycle.writes.await_head(false);
        cycle.let_go.store(false, Ordering::SeqCst);
        let held = match HeadHeld::take(detach_head(&mut req)) {
            Ok(held) => held,
            Err(()) => {
                req.extensions_mut().insert(crate::wire::Crowded::Held);
                None
            }
        };
        if crate::listen::pressure::under_pressure() {
            req.extensions_mut().insert(crate::wire::Crowded::Memory);
        }
        let connect =
            req.method() == http::Method::CONNECT && req.version() == http::Version::HTTP_11;
        cycle.connect.store(connect, Ordering::Relaxed);
        // One look-up first: most requests ask for no upgrade, and a pass
        // over every name costs more.
        let upgrade = || {
            use crate::wire::headers::{requested_upgrade_found, Present};
            req.headers().contains_key(http::header::UPGRADE)
                && requested_upgrade_found(req.version(), req.headers(), Present::of(req.headers()))
        };
        if connect || upgrade() {
            let (tx, rx) = oneshot::channel();
            *cycle.upgrade.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
            req.extensions_mut().insert(CallerUpgrade::new(rx));
        }
        let req = req.map(|inner| match unread {
            true => CallerBody::noting_end(inner, cycle.clone()),
            false => CallerBody::new(inner),
        });
        Answering {
            inner: self.inner.call(req),
            cycle: Some(cycle.clone()),
            _head: held,
        }
    }
}

/// hyper parses a request's target and header values as slices of the
/// connection's read buffer (8 KiB). Kept while the request is proxied
/// (and for its retries), they would make hyper take a second buffer for
/// the connection's next read, for every request in flight (64 busy
/// connections held 1 MiB of caller read buffers where 512 KiB do). Copied
/// here into one buffer of their own size, before hyper reads on; a target
/// or value that would not parse again (it did once) is left as it is.
///
/// Returns the bytes copied.
fn detach_head<B>(req: &mut Request<B>) -> usize {
    let uri = req.uri();
    let origin_form = uri.scheme().is_none() && uri.authority().is_none();
    let target = match (origin_form, uri.path_and_query()) {
        (true, Some(pq)) => std::borrow::Cow::Borrowed(pq.as_str()),
        _ => std::borrow::Cow::Owned(uri.to_string()),
    };
    let values: usize = req.headers().values().map(|v| v.len()).sum();
    let mut copy = bytes::BytesMut::with_capacity(target.len().saturating_add(values));
    copy.extend_from_slice(target.as_bytes());
    for value in req.headers().values() {
        copy.extend_from_slice(value.as_bytes());
    }
    let copy = copy.freeze();
    let size = copy.len();
    let mut at = target.len();
    if let Ok(uri) = http::Uri::from_maybe_shared(copy.slice(..at)) {
        *req.uri_mut() = uri;
    }
    for value in req.headers_mut().values_mut() {
        let end = at.saturating_add(value.len());
        if let Some(bytes) = copy.get(at..end) {
            if let Ok(mut detached) = http::HeaderValue::from_maybe_shared(copy.slice_ref(bytes)) {
                detached.set_sensitive(value.is_sensitive());
                *value = detached;
            }
        }
        at = end;
    }
    size
}

/// A request head larger than this counts against [`BIG_HEADS`].
const BIG_HEAD: usize = 8 * 1024;
/// Bytes of large request heads (over [`BIG_HEAD`]) being answered at
/// once, all connections together: each also keeps its connection's read
/// buffer grown to its size, and the upstream connection it went out on
/// (about three times the head in all). Past it, a large head is answered
/// 503 at once: 3,400 callers each sending a 60 KiB head to a frozen
/// upstream held 177 MiB while they waited for a slot.
const BIG_HEADS: usize = 8 << 20;
static BIG_HEADS_HELD: AtomicUsize = AtomicUsize::new(0);

/// A large head's bytes, counted held until dropped.
pub(crate) struct HeadHeld(usize);

impl HeadHeld {
    /// `Ok(None)` for a small head; `Err` when the large heads held are at
    /// their bound.
    fn take(size: usize) -> Result<Option<Self>, ()> {
        if size <= BIG_HEAD {
            return Ok(None);
        }
        let before = BIG_HEADS_HELD.fetch_add(size, Ordering::Relaxed);
        if before.saturating_add(size) > BIG_HEADS {
            BIG_HEADS_HELD.fetch_sub(size, Ordering::Relaxed);
            return Err(());
        }
        Ok(Some(Self(size)))
    }
}

impl Drop for HeadHeld {
    fn drop(&mut self) {
        BIG_HEADS_HELD.fetch_sub(self.0, Ordering::Relaxed);
    }
}

pin_project! {
    pub struct Answering<F> {
        #[pin]
        inner: F,
        cycle: Option<Arc<Cycle>>,
        // A large head counted held until its answer.
        _head: Option<HeadHeld>,
    }
}

impl<F, B, E> Future for Answering<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<Ending<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let resp = match std::task::ready!(this.inner.poll(cx)) {
            Ok(resp) => resp,
            Err(e) => return Poll::Ready(Err(e)),
        };
        let cycle = this.cycle.take();
        if let Some(cycle) = &cycle {
            // hyper hands the connection over after a 101, and after a 2xx
            // to a CONNECT.
            let tunnel = cycle.connect.load(Ordering::Relaxed) && resp.status().is_success();
            if resp.status() == StatusCode::SWITCHING_PROTOCOLS || tunnel {
                cycle.switched.store(true, Ordering::Relaxed);
            }
        }
        Poll::Ready(Ok(resp.map(|inner| Ending { inner, cycle })))
    }
}

/// How long an HTTP/1.1 connection stays idle with its hyper connection up
/// before it is taken back.
pub const PARK_AFTER: Duration = Duration::from_secs(1);

type Stream<I> = WriteStall<Rewind<I>>;
type Conn<I, S> = http1::Connection<TokioIo<Stream<I>>, Cycled<S>>;
type Parts<I, S> = http1::Parts<TokioIo<Stream<I>>, Cycled<S>>;

/// How one hyper connection (one exchange, or a run of pipelined ones)
/// ended.
enum Ended<I: CallerSocket, S> {
    /// Idle after its answer: the stream can serve the next request.
    Idle(Parts<I, S>),
    /// The answer switched protocols: the stream goes to the proxy.
    Switched(Parts<I, S>),
    /// Done as hyper would close it.
    Close(Parts<I, S>),
    Failed(hyper::Error),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Asked {
    No,
    /// Asked to end as idle: it must end at once to be taken back.
    ToEnd,
    /// Asked to end and close (a drain, or it was not idle after all).
    ToClose,
}

pin_project! {
    struct Exchange<I, S, B>
    where
        I: Readable,
        S: hyper::service::Service<Request<CallerBody>, Response = Response<B>, Error = std::convert::Infallible>,
        B: Body,
        B: 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        conn: Option<Conn<I, S>>,
        cycle: Arc<Cycle>,
        #[pin]
        drain: Signal,
        asked: Asked,
        // Runs while hyper is idle after an answer; at `park_after` the
        // connection is taken back (at once when it is zero).
        #[pin]
        parking: tokio::time::Sleep,
        park_after: Duration,
        armed: bool,
    }
}

impl<I, S, B> Future for Exchange<I, S, B>
where
    I: Readable,
    S: hyper::service::Service<
            Request<CallerBody>,
            Response = Response<B>,
            Error = std::convert::Infallible,
        > + Unpin,
    S::Future: Unpin,
    B: Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Output = Ended<I, S>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let Some(conn) = this.conn.as_mut() else {
                // Polled after it ended: it has nothing more to say.
                return Poll::Pending;
            };
            match conn.poll_without_shutdown(cx) {
                Poll::Ready(Ok(())) => {
                    let Some(conn) = this.conn.take() else {
                        return Poll::Pending;
                    };
                    let parts = conn.into_parts();
                    return Poll::Ready(if this.cycle.switched.load(Ordering::Relaxed) {
                        Ended::Switched(parts)
                    } else if *this.asked == Asked::ToEnd {
                        Ended::Idle(parts)
                    } else {
                        Ended::Close(parts)
                    });
                }
                Poll::Ready(Err(e)) => {
                    this.conn.take();
                    return Poll::Ready(Ended::Failed(e));
                }
                Poll::Pending => {}
            }
            match *this.asked {
                Asked::No => {
                    if this.drain.as_mut().poll_started(cx) {
                        // The answer not yet begun says `Connection: close`.
                        *this.asked = Asked::ToClose;
                    } else if !this.cycle.idle() {
                        *this.armed = false;
                        return Poll::Pending;
                    } else if this.park_after.is_zero() {
                        *this.asked = Asked::ToEnd;
                    } else if !*this.armed {
                        *this.armed = true;
                        let at = tokio::time::Instant::now() + *this.park_after;
                        this.parking.as_mut().reset(at);
                        if this.parking.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        *this.asked = Asked::ToEnd;
                    } else if this.parking.as_mut().poll(cx).is_ready() {
                        *this.asked = Asked::ToEnd;
                    } else {
                        return Poll::Pending;
                    }
                    Pin::new(conn).graceful_shutdown();
                }
                Asked::ToEnd => {
                    // Not idle after all: it finishes what it is on, and
                    // then the connection closes.
                    *this.asked = Asked::ToClose;
                    return Poll::Pending;
                }
                Asked::ToClose => return Poll::Pending,
            }
        }
    }
}

/// What an HTTP/1.1 connection is served with.
pub struct Serving<'a> {
    pub builder: &'a http1::Builder,
    pub drain: &'a Drain,
    /// The connection's, made as it was accepted ([`Cycle::new`]).
    pub cycle: &'a Arc<Cycle>,
    /// Asked to close while idle (a new caller needs its slot).
    pub conduct: &'a Arc<crate::listen::drain::Conduct>,
    pub write_timeout: Duration,
    pub idle_timeout: Duration,
    /// How long a request's head may take to come whole, once it began.
    pub header_read_timeout: Duration,
}

impl Serving<'_> {
    /// Serves `stream` until the caller closes, it stays idle for
    /// `idle_timeout`, the drain starts, or an exchange ends in a way that
    /// leaves it unfit for another.
    pub async fn serve<I, S, B>(&self, stream: Rewind<I>, service: S) -> Result<(), hyper::Error>
    where
        I: Readable,
        S: crate::listen::CallerService<B>,
        B: crate::listen::AnswerBody,
    {
        let cycle = self.cycle.clone();
        let mut stream = WriteStall::new(stream, self.write_timeout, cycle.writes.clone())
            .timing_heads(self.header_read_timeout);
        let mut service = Cycled {
            inner: service,
            cycle: cycle.clone(),
        };
        // What is held across the waits below is what an idle connection
        // costs: the stream, the service and the wait itself. What an
        // exchange ends with is taken apart before the next wait.
        // Not yet seen busy: taken back as soon as it answers.
        let mut park_after = Duration::ZERO;
        let stream = loop {
            // Kept idle with hyper's connection up for at most the idle
            // timeout: that time counts toward it (below).
            let kept = park_after.min(self.idle_timeout);
            (stream, service) = match self.exchange(stream, service, &cycle, kept).await {
                Ended::Idle(parts) => resumed(parts),
                Ended::Switched(parts) => match switched(parts, &cycle) {
                    Some(stream) => break stream,
                    None => return Ok(()),
                },
                Ended::Close(parts) => break parts.io.into_inner(),
                Ended::Failed(e) => return Err(e),
            };
            if !stream.get_mut().prefix.is_empty() {
                // Pipelined: the next request is already here.
                park_after = PARK_AFTER;
                continue;
            }
            let quiet = tokio::time::Instant::now();
            let next = tokio::select! {
                biased;
                () = self.drain.started() => None,
                () = self.conduct.until_expelled() => None,
                // Not `kept`: a future keeps room for what lives across
                // its waits, and a task's room for its connection's life.
                () = tokio::time::sleep(self.idle_timeout.saturating_sub(park_after)) => None,
                read = std::future::poll_fn(|cx| stream.get_mut().inner.poll_readable(cx)) => read.ok(),
            };
            match next {
                Some(read) => stream.get_mut().prefix = read,
                None => break stream,
            }
            // Busy when the request came within PARK_AFTER of the last
            // answer (an exchange that waited PARK_AFTER to be taken back
            // has been quiet that long already).
            park_after = if park_after.is_zero() && quiet.elapsed() < PARK_AFTER {
                PARK_AFTER
            } else {
                Duration::ZERO
            };
        };
        close(stream, self.write_timeout).await;
        Ok(())
    }
}

/// The stream and service of a connection whose exchange ended idle, with
/// what hyper read ahead put back.
fn resumed<I: CallerSocket, S>(parts: Parts<I, S>) -> (Stream<I>, Cycled<S>) {
    let mut stream = parts.io.into_inner();
    rewind(&mut stream, &parts.read_buf);
    (stream, parts.service)
}

/// Hands a connection whose answer switched protocols to the proxy; the
/// stream back if no one takes it (to be closed).
fn switched<I: Readable, S>(parts: Parts<I, S>, cycle: &Cycle) -> Option<Stream<I>> {
    let mut stream = parts.io.into_inner();
    // What comes now is the new protocol's: no heads to time.
    stream.untimed_heads();
    rewind(&mut stream, &parts.read_buf);
    let to = cycle
        .upgrade
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    match to {
        Some(to) => {
            drop(to.send(Box::new(stream)));
            None
        }
        None => Some(stream),
    }
}

impl Serving<'_> {
    /// A hyper connection over `stream`, on the heap: an idle connection
    /// keeps no room for a busy one. Made outside `serve`'s future, which
    /// would otherwise keep room for the connection it moved out.
    fn exchange<I, S, B>(
        &self,
        stream: Stream<I>,
        service: Cycled<S>,
        cycle: &Arc<Cycle>,
        park_after: Duration,
    ) -> Pin<Box<Exchange<I, S, B>>>
    where
        I: Readable,
        S: hyper::service::Service<
                Request<CallerBody>,
                Response = Response<B>,
                Error = std::convert::Infallible,
            > + Unpin,
        S::Future: Unpin,
        B: Body + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        // A new hyper connection is idle only once it has answered: a head
        // that arrives in pieces is a request under way, and timed as one.
        cycle.answered.store(false, Ordering::Relaxed);
        cycle.writes.await_head(true);
        Box::pin(Exchange {
            conn: Some(self.builder.serve_connection(TokioIo::new(stream), service)),
            cycle: cycle.clone(),
            drain: self.drain.signal(),
            asked: Asked::No,
            parking: tokio::time::sleep(park_after),
            park_after,
            armed: false,
        })
    }
}

/// Puts bytes hyper read ahead back in front of the stream, in a buffer
/// of their own size: hyper's is 8 KiB.
fn rewind<I: CallerSocket>(stream: &mut Stream<I>, read: &Bytes) {
    if !read.is_empty() {
        let rewind = stream.get_mut();
        let mut prefix = Vec::with_capacity(read.len() + rewind.prefix.len());
        prefix.extend_from_slice(read);
        prefix.extend_from_slice(&rewind.prefix);
        rewind.prefix = prefix.into();
    }
}

/// Closes the caller's stream as hyper would: flushed and shut down, within
/// the stream's write timeout.
async fn close<I: Readable>(mut stream: Stream<I>, within: Duration) {
    let _ = tokio::time::timeout(within, stream.shutdown()).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request as hyper makes one: its target and header values slices
    /// of one buffer (the connection's), which is returned too.
    fn parsed(target: &str, headers: &[(&str, &[u8])]) -> (Request<()>, Bytes) {
        let mut text = target.as_bytes().to_vec();
        for (_, value) in headers {
            text.extend_from_slice(value);
        }
        let buffer = Bytes::from(text);
        let mut req = Request::new(());
        *req.uri_mut() = http::Uri::from_maybe_shared(buffer.slice(..target.len())).unwrap();
        let mut at = target.len();
        for (name, value) in headers {
            let end = at + value.len();
            let value = http::HeaderValue::from_maybe_shared(buffer.slice(at..end)).unwrap();
            let name = http::HeaderName::from_bytes(name.as_bytes()).unwrap();
            req.headers_mut().append(name, value);
            at = end;
        }
        (req, buffer)
    }

    fn within(buffer: &Bytes, bytes: &[u8]) -> bool {
        let range = buffer.as_ptr_range();
        !bytes.is_empty() && range.contains(&bytes.as_ptr())
    }

    #[test]
    fn a_detached_head_says_the_same_from_a_buffer_of_its_own() {
        let headers: &[(&str, &[u8])] = &[
            ("host", b"api.internal"),
            ("accept", b"*/*"),
            ("accept", b"text/plain"),
            ("authorization", b"Bearer t\xe9st"),
            ("x-empty", b""),
        ];
        for target in [
            "/a/b?c=d&e",
            "*",
            "http://api.internal:8080/x?y",
            "api.internal:443",
        ] {
            let (mut req, buffer) = parsed(target, headers);
            req.headers_mut()
                .get_mut("authorization")
                .unwrap()
                .set_sensitive(true);
            let before = req.headers().clone();
            let uri = req.uri().clone();
            detach_head(&mut req);
            assert_eq!(req.uri(), &uri);
            assert_eq!(req.headers(), &before, "{target}");
            assert!(req.headers()["authorization"].is_sensitive());
            assert!(!req.headers()["accept"].is_sensitive());
            let path = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("");
            assert!(
                !within(&buffer, path.as_bytes()),
                "{target}: the target still in the connection's buffer"
            );
            for value in req.headers().values() {
                assert!(
                    !within(&buffer, value.as_bytes()),
                    "{target}: {value:?} still in the connection's buffer"
                );
            }
        }
    }
}
