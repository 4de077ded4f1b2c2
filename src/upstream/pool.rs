//! HTTP/1.1 connections to one plain-HTTP endpoint, over hyper's connection
//! API: the hot path of most sidecars, without the general client's pool
//! keys, checkout futures and per-request URI rewriting.
//!
//! Idle connections wait in one list. A request takes the most recently
//! returned one that is ready, or opens a new one when none is, and holds it
//! until its response body is done with (finished, failed or dropped): then
//! it goes back to the list. So a connection carries one request at a time,
//! and a checkout looks only at idle connections, however many are busy.
//! Closed connections, and connections idle for longer than
//! `pool_idle_timeout`, are dropped when a checkout or the once-a-second
//! upkeep passes by.
//!
//! A connection idle for [`PARK_AFTER`] is parked: hyper's connection (its
//! task and its 16 KiB of buffers) ends, and only the socket stays in the
//! list, out of the reactor; the next request on it starts a new hyper
//! connection over the same socket. A burst's leftover connections then cost
//! a descriptor each and nothing on the heap (not 30 KiB, nor a small object
//! left among the burst's freed memory, keeping its pages resident), while
//! a busy connection is never parked.
//!
//! Nothing here retries: a request that could not be written comes back as
//! an error like any other, and the retry loop decides.
//!
//! Reuse is learnt: an upstream that closes idle connections without
//! saying so (Node's and many frameworks' keep-alive timeouts) loses a
//! request now and then in the close. Once one was lost so (`Stale`), for
//! [`STALE_MEMORY`] a careful request (one that cannot be retried, or a
//! retry) goes only on a connection idle for less than half the shortest
//! idle time seen to fail, or on a new one; as HAProxy's `http-reuse safe`
//! does, and unlike it only where the upstream has shown the need.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::units::clock;
use http::uri::{Authority, PathAndQuery};
use http::{Request, Response};
use hyper::client::conn::{http1, TrySendError};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tracing::debug;

use super::body::{BoxError, RequestBody, UpstreamBody, Whole};
use super::heads::{HeadWait, Metered};
use super::outgoing::Outgoing;
use super::plain::{self, Raw};
use super::replay::Held;

/// The most hyper keeps queued to write to an upstream, or read from it
/// at once (its default is about 400 KB): an upstream that answers without
/// reading the request's body would otherwise have each connection hold
/// that much of it (300 uploads to one took the process past 200 MiB).
pub(crate) const UPSTREAM_BUFFER: usize = 16 * 1024;

/// Why a request got no response from the pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("connect to {authority} failed")]
    Connect {
        authority: Authority,
        #[source]
        source: std::io::Error,
    },
    #[error("connect to {authority} timed out after {timeout:?}")]
    ConnectTimeout {
        authority: Authority,
        timeout: Duration,
    },
    #[error("HTTP/1.1 handshake with {authority} failed")]
    Handshake {
        authority: Authority,
        #[source]
        source: hyper::Error,
    },
    #[error("request to {authority} failed")]
    Request {
        authority: Authority,
        #[source]
        source: BoxError,
    },
    /// A reused connection closed before any byte of the answer came.
    #[error("request to {authority} failed: the reused connection closed before an answer")]
    Stale {
        authority: Authority,
        #[source]
        source: BoxError,
    },
    /// The connection gave the request back unwritten: it never left.
    #[error("request to {authority} was not sent: the connection closed first")]
    Unsent {
        authority: Authority,
        #[source]
        source: BoxError,
    },
}

impl PoolError {
    /// No connection was made: nothing reached the upstream.
    pub fn is_connect(&self) -> bool {
        !matches!(self, PoolError::Request { .. } | PoolError::Stale { .. })
    }
}

/// An attempt's end as the pool gives it: the answer, and hyper's connection
/// it came on (none for herdguard's own exchange, whose body holds it).
pub type Sent = Result<(Response<UpstreamBody>, Option<Pooled>), PoolError>;

/// How long a connection stays idle with hyper's connection up before it
/// is parked (see the module's documentation).
pub const PARK_AFTER: Duration = Duration::from_secs(1);

/// How long a lost request makes careful requests avoid old connections.
pub const STALE_MEMORY: Duration = Duration::from_secs(60);

/// What the pool learnt of the upstream closing idle connections: when a
/// request was last lost in such a close, and the shortest idle time of a
/// connection that was, in nanoseconds (0: none yet).
#[derive(Default)]
struct Staleness {
    at: std::sync::atomic::AtomicU64,
    shortest: std::sync::atomic::AtomicU64,
}

struct Conn {
    state: Idle,
    /// When it was returned.
    last_used: Instant,
}

/// The idle connections of a pool, shared with what returns them: hyper's
/// connection tasks as they park, and answers' bodies as they end.
pub(crate) struct Shelf {
    idle: Mutex<Vec<Conn>>,
    /// Idle connections kept at most.
    max_idle: usize,
    /// Its pool is gone (a reload replaced the upstream): what comes back
    /// is closed. The connections on it hold the shelf themselves, so it
    /// would otherwise keep them open for ever.
    closed: std::sync::atomic::AtomicBool,
}

impl Shelf {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps an idle connection, unless `max_idle` are kept already.
    fn put(&self, state: Idle, last_used: Instant) {
        let mut idle = self.lock();
        if idle.len() < self.max_idle && !self.closed.load(std::sync::atomic::Ordering::Relaxed) {
            idle.push(Conn { state, last_used });
        }
    }

    /// Takes back a socket whose answer was read whole.
    pub(crate) fn put_plain(&self, raw: Box<Raw>) {
        self.put(Idle::Plain(raw), clock::now());
    }

    /// A shelf of no pool, keeping nothing.
    #[cfg(test)]
    pub(crate) fn none() -> Arc<Self> {
        Arc::new(Self {
            idle: Mutex::default(),
            max_idle: 0,
            closed: Default::default(),
        })
    }
}

enum Idle {
    /// hyper's connection is up, ready for the next request.
    Live(Pooled),
    /// A socket of herdguard's own exchange (see `plain.rs`), in the
    /// reactor, with its read buffer.
    Plain(Box<Raw>),
    /// Only the socket is kept, out of the reactor: a descriptor and
    /// nothing on the heap, so a burst's leftovers pin none of its pages.
    Parked(std::net::TcpStream),
}

/// A connection taken from the list.
enum Taken {
    Live(Pooled),
    Plain(Box<Raw>),
    Parked(std::net::TcpStream),
}

/// How long the connection a request went on had been idle (`None`: new).
type Idled = Option<Duration>;

/// A connection checked out of the pool, with a request or its response
/// body on it.
pub struct Pooled {
    sender: http1::SendRequest<RequestBody>,
    /// The same socket (a second descriptor of it), to look at while the
    /// connection is idle: hyper learns that the upstream closed it only
    /// when its connection task next runs, which may be after a checkout.
    probe: std::net::TcpStream,
    /// The task that drives the connection.
    task: Option<tokio::task::AbortHandle>,
    /// Tells the connection when a response's head is awaited.
    head: HeadWait,
    /// Tells the task to put the socket back in the list once hyper's
    /// connection has ended (`None`: an upgradable connection, never parked).
    park: Option<tokio::sync::oneshot::Sender<Instant>>,
}

/// A connection dropped anywhere but back into the pool (its attempt timed
/// out or its caller went away mid-request, or the pool threw it out) is
/// closed at once: an upstream is not left working on a request nobody
/// waits for, nor a half-sent body holding the connection open.
impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl Pooled {
    /// Whether an idle connection is still open and quiet: no end of stream
    /// and no stray bytes from the upstream. Never blocks.
    fn is_quiet(&self) -> bool {
        is_quiet(socket2::SockRef::from(&self.probe))
    }

    /// Ends hyper's connection, idle since `since`, for its task to park the
    /// socket. `false`: it cannot be parked, and is closed.
    fn park(mut self, since: Instant) -> bool {
        let Some(park) = self.park.take() else {
            return false;
        };
        if park.send(since).is_err() {
            return false;
        }
        // Dropping the sender ends an idle connection cleanly; the task is
        // left to finish.
        self.task = None;
        true
    }
}

/// Whether a socket is open and has nothing to read: no end of stream and no
/// stray bytes. Never blocks (the socket is non-blocking).
pub(super) fn is_quiet(socket: socket2::SockRef<'_>) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    matches!(socket.peek(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// An upstream's `receive_buffer`, if it is not left to the kernel.
pub(crate) fn receive_buffer(config: &crate::config::UpstreamConfig) -> Option<usize> {
    match config.receive_buffer {
        0 => None,
        size => Some(usize::try_from(size).unwrap_or(usize::MAX)),
    }
}

pub struct H1Pool {
    authority: Authority,
    connect_timeout: Duration,
    /// Each connection's `SO_RCVBUF` (`None`: the kernel's autotuning).
    receive_buffer: Option<usize>,
    idle_timeout: Duration,
    shelf: Arc<Shelf>,
    staleness: Staleness,
    /// The clock `staleness` counts from.
    epoch: Instant,
}

/// The idle connections close with the pool; those still carrying an
/// answer close when it is done.
impl Drop for H1Pool {
    fn drop(&mut self) {
        let idle = {
            let mut idle = self.shelf.lock();
            self.shelf
                .closed
                .store(true, std::sync::atomic::Ordering::Relaxed);
            std::mem::take(&mut *idle)
        };
        drop(idle);
    }
}

impl H1Pool {
    pub fn new(authority: Authority, config: &crate::config::UpstreamConfig) -> Self {
        Self {
            authority,
            connect_timeout: config.connect_timeout,
            receive_buffer: receive_buffer(config),
            idle_timeout: config.pool_idle_timeout,
            shelf: Arc::new(Shelf {
                idle: Mutex::default(),
                max_idle: config.pool_max_idle,
                closed: Default::default(),
            }),
            staleness: Staleness::default(),
            epoch: Instant::now(),
        }
    }

    /// The longest a `careful` request's connection may have been idle
    /// now: any, unless a request was lost in a close lately.
    fn max_idle_for(&self, careful: bool) -> Option<Duration> {
        use std::sync::atomic::Ordering::Relaxed;
        let shortest = self.staleness.shortest.load(Relaxed);
        if !careful || shortest == 0 {
            return None;
        }
        let at = Duration::from_nanos(self.staleness.at.load(Relaxed));
        let now = clock::now().saturating_duration_since(self.epoch);
        if now.saturating_sub(at) > STALE_MEMORY {
            return None;
        }
        Some(Duration::from_nanos(shortest / 2))
    }

    /// A request was lost in the close of a connection idle for `idled`.
    fn lost(&self, idled: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = clock::now().saturating_duration_since(self.epoch);
        let remembered = self.max_idle_for(true).is_some();
        let idled = u64::try_from(idled.as_nanos()).unwrap_or(u64::MAX).max(1);
        let shortest = self.staleness.shortest.load(Relaxed);
        let shortest = if remembered && shortest != 0 {
            shortest.min(idled)
        } else {
            idled
        };
        self.staleness.shortest.store(shortest, Relaxed);
        self.staleness
            .at
            .store(u64::try_from(now.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    /// Sends `req` (`Host` set) for `path_and_query` on an idle connection,
    /// or on a new one. A connection of hyper's comes back with the
    /// response: hand it to [`H1Pool::put_back`] once the response body is
    /// done with. A request with no body, or with one of at most 16 KiB
    /// read whole (see [`Whole`]: a body sent once is read before the
    /// first attempt, a replay of a kept one here), and no upgrade goes by
    /// herdguard's own exchange (see `plain.rs`) when `own` allows: its
    /// answer's body takes the connection back itself.
    ///
    /// A request that a pooled connection gives back unwritten (it found the
    /// connection closed by the upstream first) is sent again on a fresh
    /// connection: the upstream never saw it, so this is the same attempt,
    /// not a retry behind the retry loop's back.
    ///
    /// Not an `async fn`: one would keep the request twice, as its argument
    /// and as a local, for as long as the attempt lasts.
    pub fn send<'a>(
        &'a self,
        req: Outgoing,
        path_and_query: Option<std::borrow::Cow<'a, PathAndQuery>>,
        careful: bool,
        own: bool,
    ) -> impl Future<Output = Sent> + 'a {
        // An upgrade takes a connection of its own, driven by hyper until
        // it is handed over: never pooled before, never parked after.
        let upgrade = req.upgrade;
        if own && !upgrade && req.method != http::Method::CONNECT {
            if req.body.is_empty() || req.body.is_whole() {
                return Either::Plain {
                    send: self.send_plain(req, path_and_query, careful),
                };
            }
            if let Some(held) = req.body.replay_whole() {
                // On the heap: the future of every request with no body
                // keeps no room for one.
                return Either::Whole {
                    send: Box::pin(self.send_whole(req, path_and_query, careful, held)),
                };
            }
        }
        let mut req = req.into_request();
        *req.uri_mut() = origin_form(path_and_query.as_deref());
        Either::Hyper {
            send: self.send_hyper(req, upgrade, careful),
        }
    }

    /// A request with no body, or with one read whole, by herdguard's own
    /// exchange.
    #[allow(clippy::manual_async_fn)] // on purpose: see [`H1Pool::send`]
    fn send_plain<'a>(
        &'a self,
        mut req: Outgoing,
        path_and_query: Option<std::borrow::Cow<'a, PathAndQuery>>,
        careful: bool,
    ) -> impl Future<Output = Result<Response<plain::PlainBody>, PoolError>> + 'a {
        async move {
            let target = path_and_query.as_deref().map_or("/", PathAndQuery::as_str);
            let (raw, idled) = match self.checkout(self.max_idle_for(careful), true) {
                Some((Taken::Plain(raw), idled)) => (raw, Some(idled)),
                Some((Taken::Parked(stream), idled)) => (self.plain_of(stream)?, Some(idled)),
                Some((Taken::Live(_), _)) | None => (self.connect_plain().await?, None),
            };
            // Handed on: let go once written.
            let body = req.body.take_whole();
            let (method, fields) = (&req.method, &req.fields);
            match plain::exchange(raw, method, target, fields, body).await {
                Ok(resp) => Ok(resp),
                Err(mut failed) if idled.is_some() && !failed.written => {
                    debug!(upstream = %self.authority, error = %failed.error, "pooled connection closed before the request was written; sending it on a new one");
                    let body = failed.unsent.take();
                    let raw = self.connect_plain().await?;
                    // On the heap: rare.
                    Box::pin(plain::exchange(raw, method, target, fields, body))
                        .await
                        .map_err(|failed| self.plain_error(failed, None))
                }
                Err(failed) => Err(self.plain_error(failed, idled)),
            }
        }
    }

    /// A request with a replay of a body its copy holds whole, by
    /// herdguard's own exchange: the replay is read whole (its chunks, or
    /// one copy of them), then sent with the head.
    async fn send_whole(
        &self,
        mut req: Outgoing,
        path_and_query: Option<std::borrow::Cow<'_, PathAndQuery>>,
        careful: bool,
        held: Held,
    ) -> Result<Response<plain::PlainBody>, PoolError> {
        match Whole::read(&mut req.body, held).await {
            Ok(whole) => req.body = RequestBody::whole(whole),
            Err(source) => {
                let authority = self.authority.clone();
                return Err(PoolError::Request { authority, source });
            }
        }
        self.send_plain(req, path_and_query, careful).await
    }

    /// Why an exchange on a connection idle for `idled` (if reused) failed.
    fn plain_error(&self, failed: plain::Failed, idled: Idled) -> PoolError {
        let authority = self.authority.clone();
        let lost = failed.error.is_close() && !failed.heard;
        let source = Box::new(failed.error);
        match (failed.written, idled) {
            (false, _) => PoolError::Unsent { authority, source },
            (true, Some(idled)) if lost => {
                self.lost(idled);
                PoolError::Stale { authority, source }
            }
            (true, _) => PoolError::Request { authority, source },
        }
    }

    /// A request by hyper's connection.
    /// (Not an `async fn`: see [`H1Pool::send`].)
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn send_hyper(
        &self,
        req: Request<RequestBody>,
        upgrade: bool,
        careful: bool,
    ) -> impl Future<Output = Result<(Response<hyper::body::Incoming>, Pooled), PoolError>> + '_
    {
        async move {
            let taken = match upgrade {
                true => None,
                false => self.checkout(self.max_idle_for(careful), false),
            };
            let (mut conn, idled) = match taken {
                Some((Taken::Live(conn), idled)) => (conn, Some(idled)),
                Some((Taken::Parked(stream), idled)) => {
                    (Box::pin(self.handshake(stream, false)).await?, Some(idled))
                }
                Some((Taken::Plain(_), _)) | None => (self.connect(upgrade).await?, None),
            };
            conn.head.begin();
            let sent = conn.sender.try_send_request(req).await;
            conn.head.end();
            match sent {
                Ok(resp) => Ok((resp, conn)),
                // On the heap: rare, and the request's future would
                // otherwise keep room for it.
                Err(failed) if idled.is_some() => Box::pin(self.resend(failed, idled)).await,
                Err(mut failed) => {
                    let unsent = failed.take_message().is_some();
                    Err(self.request_error(failed.into_error(), unsent, None))
                }
            }
        }
    }

    /// After a request on a pooled connection failed: sends it on a new
    /// connection if the connection gave it back unwritten.
    async fn resend(
        &self,
        mut failed: TrySendError<Request<RequestBody>>,
        idled: Idled,
    ) -> Result<(Response<hyper::body::Incoming>, Pooled), PoolError> {
        let Some(req) = failed.take_message() else {
            return Err(self.request_error(failed.into_error(), false, idled));
        };
        let source = failed.into_error();
        debug!(upstream = %self.authority, error = %source, "pooled connection closed before the request was written; sending it on a new one");
        let mut conn = self.connect(false).await?;
        conn.head.begin();
        let sent = conn.sender.send_request(req).await;
        conn.head.end();
        let resp = sent.map_err(|source| self.request_error(source, false, None))?;
        Ok((resp, conn))
    }

    /// `idled`: how long the connection had been idle, if it was reused.
    fn request_error(&self, source: hyper::Error, unsent: bool, idled: Idled) -> PoolError {
        let authority = self.authority.clone();
        match (unsent, idled) {
            (true, _) => PoolError::Unsent {
                authority,
                source: Box::new(source),
            },
            // Closed with nothing of an answer, on a connection that had
            // served before: the upstream closed it as the request went out
            // (an end of stream; or a reset, when our bytes reached a
            // socket it had already closed).
            (false, Some(idled)) if source.is_incomplete_message() || reset_by_peer(&source) => {
                self.lost(idled);
                PoolError::Stale {
                    authority,
                    source: Box::new(source),
                }
            }
            (false, _) => PoolError::Request {
                authority,
                source: Box::new(source),
            },
        }
    }

    /// Takes the most recently returned connection that is ready, dropping
    /// the closed and the long idle ones on the way. A connection whose last
    /// response was read a moment ago may not be ready yet: it stays.
    /// Only a connection idle for less than `max_idle_for` is taken, if set.
    /// `plain`: for herdguard's own exchange, which leaves hyper's live
    /// connections be; hyper's takes a plain socket as a parked one.
    fn checkout(&self, max_idle_for: Option<Duration>, plain: bool) -> Option<(Taken, Duration)> {
        let now = clock::now();
        let mut idle = self.shelf.lock();
        let mut i = idle.len();
        while i > 0 {
            i -= 1;
            let conn = &idle[i];
            let idled = now.saturating_duration_since(conn.last_used);
            if idled > self.idle_timeout {
                idle.swap_remove(i);
                continue;
            }
            if max_idle_for.is_some_and(|max| idled >= max) {
                continue;
            }
            let taken = match &conn.state {
                Idle::Live(pooled) if pooled.sender.is_closed() => {
                    idle.swap_remove(i);
                    continue;
                }
                Idle::Live(pooled) if !plain && pooled.sender.is_ready() => {
                    idle.swap_remove(i).state
                }
                Idle::Live(_) => continue,
                Idle::Plain(_) | Idle::Parked(_) => idle.swap_remove(i).state,
            };
            // The upstream may have closed it unseen: a request written now
            // would be lost in the close.
            let taken = match taken {
                Idle::Live(pooled) if pooled.is_quiet() => Taken::Live(pooled),
                Idle::Plain(raw) if raw.is_quiet() => match plain {
                    true => Taken::Plain(raw),
                    false => match raw.into_std() {
                        Ok(stream) => Taken::Parked(stream),
                        Err(_) => continue,
                    },
                },
                Idle::Parked(stream) if is_quiet(socket2::SockRef::from(&stream)) => {
                    Taken::Parked(stream)
                }
                _ => continue,
            };
            return Some((taken, idled));
        }
        None
    }

    /// Returns a connection whose response is finished with; closes it
    /// instead when `max_idle` are idle already (a burst's connections do
    /// not all stay, each holding its buffers).
    pub fn put_back(&self, pooled: Pooled) {
        if !pooled.sender.is_closed() && pooled.park.is_some() {
            self.shelf.put(Idle::Live(pooled), clock::now());
        }
    }

    fn expired(&self, conn: &Conn, now: Instant) -> bool {
        now.saturating_duration_since(conn.last_used) > self.idle_timeout
    }

    /// Drops closed connections and those idle for longer than the timeout;
    /// parks those idle for [`PARK_AFTER`].
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut parking = Vec::new();
        {
            let mut idle = self.shelf.lock();
            let mut i = idle.len();
            while i > 0 {
                i -= 1;
                let conn = &idle[i];
                let closed = matches!(&conn.state, Idle::Live(p) if p.sender.is_closed());
                if closed || self.expired(conn, now) {
                    idle.swap_remove(i);
                } else if !matches!(conn.state, Idle::Parked(_))
                    && now.saturating_duration_since(conn.last_used) >= PARK_AFTER
                {
                    parking.push(idle.swap_remove(i));
                }
            }
        }
        // Outside the lock: the tasks take it to park what they are given.
        for conn in parking {
            match conn.state {
                Idle::Live(pooled) => {
                    pooled.park(conn.last_used);
                }
                // Out of the reactor, its buffer freed.
                Idle::Plain(raw) => {
                    if let Ok(stream) = raw.into_std() {
                        self.shelf.put(Idle::Parked(stream), conn.last_used);
                    }
                }
                Idle::Parked(_) => {}
            }
        }
    }

    /// A new connection, open, with its socket options set. (Its future is
    /// large, and made once per connection: it goes on the heap, and the
    /// request's future keeps no room for it.)
    fn open(&self) -> Pin<Box<dyn Future<Output = Result<TcpStream, PoolError>> + Send + '_>> {
        Box::pin(self.open_now())
    }

    async fn open_now(&self) -> Result<TcpStream, PoolError> {
        let host = self.authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let port = self.authority.port_u16().unwrap_or(80);
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect((host, port)))
            .await
            .map_err(|_| PoolError::ConnectTimeout {
                authority: self.authority.clone(),
                timeout: self.connect_timeout,
            })?
            .map_err(|source| PoolError::Connect {
                authority: self.authority.clone(),
                source,
            })?;
        let _ = stream.set_nodelay(true);
        if let Some(size) = self.receive_buffer {
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&stream, size);
        }
        let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
        Ok(stream)
    }

    /// A new connection for herdguard's own exchange.
    async fn connect_plain(&self) -> Result<Box<Raw>, PoolError> {
        let stream = self.open().await?;
        Ok(Raw::new(stream, self.shelf.clone()))
    }

    /// A parked socket, back in the reactor for herdguard's own exchange.
    fn plain_of(&self, stream: std::net::TcpStream) -> Result<Box<Raw>, PoolError> {
        let stream = TcpStream::from_std(stream).map_err(|source| PoolError::Connect {
            authority: self.authority.clone(),
            source,
        })?;
        Ok(Raw::new(stream, self.shelf.clone()))
    }

    /// A new connection for hyper; one for an `upgrade` is driven so that
    /// hyper can hand it over, and is never parked.
    async fn connect(&self, upgrade: bool) -> Result<Pooled, PoolError> {
        let stream = self.open().await?;
        let stream = stream.into_std().map_err(|source| PoolError::Connect {
            authority: self.authority.clone(),
            source,
        })?;
        Box::pin(self.handshake(stream, upgrade)).await
    }

    /// Starts hyper's connection over `stream` (non-blocking), new or parked.
    async fn handshake(
        &self,
        stream: std::net::TcpStream,
        upgrade: bool,
    ) -> Result<Pooled, PoolError> {
        let (stream, probe) = probe_of(stream).map_err(|source| PoolError::Connect {
            authority: self.authority.clone(),
            source,
        })?;
        let (stream, head) = Metered::new(stream);
        let (sender, conn) = http1::Builder::new()
            .max_buf_size(UPSTREAM_BUFFER)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|source| PoolError::Handshake {
                authority: self.authority.clone(),
                source,
            })?;
        let authority = self.authority.clone();
        if upgrade {
            let task = tokio::spawn(async move {
                if let Err(e) = conn.with_upgrades().await {
                    debug!(upstream = %authority, error = %e, "upstream connection ended with an error");
                }
            })
            .abort_handle();
            return Ok(Pooled {
                sender,
                probe,
                task: Some(task),
                head,
                park: None,
            });
        }
        let (park, parked) = tokio::sync::oneshot::channel();
        let shelf = self.shelf.clone();
        let task = tokio::spawn(async move {
            let parts = match conn.without_shutdown().await {
                Ok(parts) => parts,
                Err(e) => {
                    debug!(upstream = %authority, error = %e, "upstream connection ended with an error");
                    return;
                }
            };
            // Ended because the pool parked it, at a message boundary, and
            // nothing has come from the upstream since: keep the socket.
            let mut parked = parked;
            let Ok(last_used) = parked.try_recv() else {
                return;
            };
            let Ok(stream) = parts.io.into_inner().into_inner().into_std() else {
                return;
            };
            if !parts.read_buf.is_empty() || !is_quiet(socket2::SockRef::from(&stream)) {
                return;
            }
            shelf.put(Idle::Parked(stream), last_used);
        })
        .abort_handle();
        Ok(Pooled {
            sender,
            probe,
            task: Some(task),
            head,
            park: Some(park),
        })
    }
}

pin_project_lite::pin_project! {
    /// A request on its way by one exchange or the other.
    #[project = EitherProj]
    enum Either<P, W, H> {
        Plain { #[pin] send: P },
        Whole { send: Pin<Box<W>> },
        Hyper { #[pin] send: H },
    }
}

impl<P, W, H> Future for Either<P, W, H>
where
    P: Future<Output = Result<Response<plain::PlainBody>, PoolError>>,
    W: Future<Output = Result<Response<plain::PlainBody>, PoolError>>,
    H: Future<Output = Result<(Response<hyper::body::Incoming>, Pooled), PoolError>>,
{
    type Output = Sent;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Sent> {
        match self.project() {
            EitherProj::Plain { send } => send
                .poll(cx)
                .map(|sent| sent.map(|resp| (resp.map(UpstreamBody::plain), None))),
            EitherProj::Whole { send } => send
                .as_mut()
                .poll(cx)
                .map(|sent| sent.map(|resp| (resp.map(UpstreamBody::plain), None))),
            EitherProj::Hyper { send } => send
                .poll(cx)
                .map(|sent| sent.map(|(resp, conn)| (resp.map(UpstreamBody::hyper), Some(conn)))),
        }
    }
}

/// Splits a connected socket (non-blocking) into the stream hyper drives
/// and a second descriptor of the same socket for [`Pooled::is_quiet`].
fn probe_of(stream: std::net::TcpStream) -> std::io::Result<(TcpStream, std::net::TcpStream)> {
    let probe = stream.try_clone()?;
    Ok((TcpStream::from_std(stream)?, probe))
}

/// The origin-form target of a request sent on a connection of the pool.
pub fn origin_form(path_and_query: Option<&PathAndQuery>) -> http::Uri {
    match path_and_query {
        Some(pq) => http::Uri::from(pq.clone()),
        None => http::Uri::from_static("/"),
    }
}

/// Whether the connection was reset (or its pipe broken) under `e`.
fn reset_by_peer(e: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionAborted
            );
        }
        source = s.source();
    }
    false
}
