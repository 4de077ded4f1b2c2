//! Graceful shutdown for served connections: all of them on a drain, and
//! one at a time when a connection's [`Conduct`] says it abuses the proxy.
//!
//! On [`Drain::start`], every watched connection is asked to finish the
//! request it is on and close. hyper-util's `GracefulShutdown` does the same,
//! but polls a channel receiver on every poll of every connection, which takes
//! a lock each time. Here a connection reads one flag per poll, and registers
//! for the wake-up only when it is polled with a waker it has not registered.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::units::clock;
use hyper_util::server::graceful::GracefulConnection;
use pin_project_lite::pin_project;
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::wire::stamp::Stamp;

/// The signal that connections should close once idle.
#[derive(Clone, Default)]
pub struct Drain {
    started: Arc<AtomicBool>,
    notify: Arc<Notify>,
}

impl Drain {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks every watched connection, now and later, to finish and close.
    pub fn start(&self) {
        self.started.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// Completes once the drain has started.
    pub async fn started(&self) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        // Registered before the flag is read: a drain that starts after
        // this line completes it.
        notified.as_mut().enable();
        if self.started.load(Ordering::Acquire) {
            return;
        }
        notified.await;
    }

    /// Whether the drain has started, for a future to ask on each poll.
    pub fn signal(&self) -> Signal {
        Signal {
            notified: self.notify.clone().notified_owned(),
            registered: None,
            started: self.started.clone(),
        }
    }

    /// `conn`, shut down gracefully once the drain starts, or once its
    /// `conduct` gets it expelled.
    pub fn watch<C: GracefulConnection>(&self, conn: C, conduct: &Arc<Conduct>) -> Watched<C> {
        Watched {
            conn,
            // Made before the flag is first read: a drain that starts after
            // this line completes it, whenever it is polled.
            notified: self.notify.clone().notified_owned(),
            registered: None,
            asked: false,
            started: self.started.clone(),
            conduct: conduct.clone(),
            expel: conduct.expel.clone().notified_owned(),
            idle: tokio::time::sleep(conduct.idle_timeout),
            linger: tokio::time::sleep(conduct.write_timeout),
            lingering: false,
        }
    }
}

pin_project! {
    /// Whether the drain has started: one flag read per poll, and the
    /// wake-up registered again only when the polling task changes.
    pub struct Signal {
        #[pin]
        notified: OwnedNotified,
        registered: Option<Waker>,
        started: Arc<AtomicBool>,
    }
}

impl Signal {
    pub fn poll_started(self: Pin<&mut Self>, cx: &mut Context<'_>) -> bool {
        let this = self.project();
        if this.started.load(Ordering::Acquire) {
            return true;
        }
        if this
            .registered
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            return false;
        }
        let started = this.notified.poll(cx).is_ready();
        *this.registered = Some(cx.waker().clone());
        started
    }
}

/// Requests a caller connection abandoned before their answer, against
/// those answered: one that keeps opening requests and resetting them (the
/// HTTP/2 "rapid reset" attack, CVE-2023-44487) makes the proxy start
/// upstream work it throws away. hyper's own limit counts only streams reset
/// before they were accepted; this counts the accepted ones too.
///
/// Once a connection has abandoned [`Conduct::TOLERATED`] requests and more
/// than twice as many as were answered, it is asked to close (HTTP/2 GOAWAY):
/// callers that cancel now and then are never near it.
#[derive(Debug)]
pub struct Conduct {
    abandoned: std::sync::atomic::AtomicU32,
    answered: std::sync::atomic::AtomicU32,
    expelled: AtomicBool,
    expel: Arc<Notify>,
    /// A whole request head came (a request began): the connection can no
    /// longer be evicted for a new caller.
    spoke: AtomicBool,
    /// Evicted for a new caller before it finished its first request head:
    /// closed outright.
    evicted: AtomicBool,
    /// Its first bytes came: a head (or a TLS handshake) is being read,
    /// into a buffer that grows with it.
    began: AtomicBool,
    /// Requests begun and not yet answered or abandoned.
    open: std::sync::atomic::AtomicU32,
    /// It speaks HTTP/2.
    h2: AtomicBool,
    /// Answers whose bodies are still being sent (see
    /// `listen::pressure::Streaming`).
    streaming: std::sync::atomic::AtomicU32,
    /// Of those, the ones whose body waits on its upstream for more (none
    /// of it held here for the caller).
    awaiting_upstream: std::sync::atomic::AtomicU32,
    /// When a request last began or ended.
    last: Stamp,
    /// The connection closes after this long with no request open.
    pub idle_timeout: Duration,
    /// When bytes last went out to the caller (kept by the write side).
    pub written: Arc<crate::listen::stall::Writes>,
    /// Where its current HTTP/1.1 exchange stands (see
    /// [`crate::listen::h1::Cycle::new`]): made here, as the connection is accepted.
    pub cycle: Arc<crate::listen::h1::Cycle>,
    /// Once asked to close, the connection is closed outright after this
    /// long with no byte going out.
    write_timeout: Duration,
    /// The listener's list of open connections it is in, under this key:
    /// it leaves it when dropped.
    listed: Option<(Open, u64)>,
}

/// A listener's open connections, by the order they came in.
pub(crate) type Open =
    Arc<std::sync::Mutex<std::collections::BTreeMap<u64, std::sync::Weak<Conduct>>>>;

impl Drop for Conduct {
    fn drop(&mut self) {
        self.written.traffic.closed();
        if let Some((open, id)) = &self.listed {
            open.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        }
    }
}

impl Conduct {
    pub const TOLERATED: u32 = 100;

    /// How long since a request last began or ended; for a connection
    /// that has not spoken, since it was accepted.
    pub fn quiet_for(&self) -> Duration {
        clock::now().saturating_duration_since(self.last.last())
    }

    /// A connection's conduct, counted open in `traffic` until dropped.
    pub fn new(
        idle_timeout: Duration,
        write_timeout: Duration,
        traffic: Arc<crate::observe::metrics::Traffic>,
    ) -> Self {
        traffic.accepted();
        let written = Arc::new(crate::listen::stall::Writes::new(traffic));
        Self {
            abandoned: Default::default(),
            answered: Default::default(),
            expelled: AtomicBool::new(false),
            expel: Arc::new(Notify::new()),
            spoke: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            began: AtomicBool::new(false),
            open: Default::default(),
            h2: AtomicBool::new(false),
            streaming: Default::default(),
            awaiting_upstream: Default::default(),
            last: Stamp::new(),
            idle_timeout,
            cycle: crate::listen::h1::Cycle::new(written.clone()),
            written,
            write_timeout,
            listed: None,
        }
    }

    /// The connection, in `open` under `id` until it is dropped.
    pub(crate) fn listed_in(mut self, open: &Open, id: u64) -> Arc<Self> {
        self.listed = Some((open.clone(), id));
        let conduct = Arc::new(self);
        open.lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, Arc::downgrade(&conduct));
        conduct
    }

    /// A whole request head came (on a listener that does not count its
    /// requests with [`begun`](Self::begun)).
    pub fn heard(&self) {
        if !self.spoke.load(Ordering::Relaxed) {
            self.spoke.store(true, Ordering::Relaxed);
        }
    }

    /// Its first bytes came.
    pub fn began(&self) {
        self.began.store(true, Ordering::Relaxed);
    }

    /// Whether its first bytes came.
    pub fn has_begun(&self) -> bool {
        self.began.load(Ordering::Relaxed)
    }

    /// Whether a whole request head ever came.
    pub fn has_spoken(&self) -> bool {
        self.spoke.load(Ordering::Relaxed)
    }

    /// Closes the connection outright, unless it has spoken: a new caller
    /// needs its slot (see `listen::Silent`).
    pub fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.wake();
    }

    /// Closes the connection if it is idle between requests (it has spoken,
    /// and no request is open): a new caller needs its slot, and a
    /// keep-alive connection waiting for its next request is the cheapest
    /// to give up (nginx closes its idle keep-alive connections likewise
    /// when it runs out). HTTP/2 gets GOAWAY. False if it is not idle.
    pub fn expel_idle(&self) -> bool {
        if !self.has_spoken() || self.open.load(Ordering::Relaxed) > 0 {
            return false;
        }
        if self.expelled.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.wake();
        true
    }

    /// Wakes whoever waits on the connection's flags: every waiter (the
    /// serving loop and the eviction watch wait side by side, each for its
    /// own flag), and the next to wait if none does now.
    fn wake(&self) {
        self.expel.notify_waiters();
        self.expel.notify_one();
    }

    /// Ready once the connection was asked to close (expelled, for abuse or
    /// for a new caller while idle).
    pub async fn until_expelled(&self) {
        while !self.expelled.load(Ordering::Acquire) {
            self.expel.notified().await;
        }
    }

    /// Ready once [`evict`](Self::evict) was called.
    pub async fn until_evicted(&self) {
        // A wake-up given before this waits is kept as a permit: none is lost.
        while !self.evicted.load(Ordering::Acquire) {
            self.expel.notified().await;
        }
    }

    /// Ready once evicted before a whole head came; never after one came.
    /// Once one came it is not looked at again: the connection's task polls
    /// it beside the connection at each wake-up, and the eviction's wait
    /// took a lock on each (about 400 instructions a GET).
    pub async fn until_evicted_unheard(&self) {
        let mut evicted = std::pin::pin!(self.until_evicted());
        std::future::poll_fn(|cx| match self.has_spoken() {
            true => Poll::Pending,
            false => evicted.as_mut().poll(cx),
        })
        .await;
    }

    /// Closes the connection outright, whatever it is doing: memory runs
    /// short and it holds answers its caller does not read (see
    /// `listen::pressure`).
    pub fn cut(&self) {
        self.written.cut();
        self.wake();
    }

    /// Requests begun and not yet answered or abandoned.
    pub fn requests_open(&self) -> u32 {
        self.open.load(Ordering::Relaxed)
    }

    /// It speaks HTTP/2.
    pub fn speaks_h2(&self) -> bool {
        self.h2.load(Ordering::Relaxed)
    }

    pub(crate) fn spoken_in_h2(&self) {
        self.h2.store(true, Ordering::Relaxed);
    }

    /// Answers whose bodies are still being sent.
    pub fn streaming(&self) -> u32 {
        self.streaming.load(Ordering::Relaxed)
    }

    pub(crate) fn streams(&self, more: bool) {
        match more {
            true => self.streaming.fetch_add(1, Ordering::Relaxed),
            false => self.streaming.fetch_sub(1, Ordering::Relaxed),
        };
    }

    /// Of the answers streaming, those waiting on their upstream for more.
    pub fn awaiting_upstream(&self) -> u32 {
        self.awaiting_upstream.load(Ordering::Relaxed)
    }

    pub(crate) fn awaits_upstream(&self, more: bool) {
        match more {
            true => self.awaiting_upstream.fetch_add(1, Ordering::Relaxed),
            false => self.awaiting_upstream.fetch_sub(1, Ordering::Relaxed),
        };
    }

    fn evicted_unheard(&self) -> bool {
        self.evicted.load(Ordering::Acquire) && !self.has_spoken()
    }

    #[cfg(test)]
    pub fn evicted_unheard_for_test(&self) -> bool {
        self.evicted_unheard()
    }

    /// A request began on the connection.
    pub fn begun(&self) {
        self.heard();
        self.open.fetch_add(1, Ordering::Relaxed);
        self.last.touch();
    }

    pub fn answered(&self) {
        self.answered.fetch_add(1, Ordering::Relaxed);
        self.ended();
    }

    /// A request the proxy refused at once (shed): neither answered nor
    /// abandoned.
    pub fn shed(&self) {
        self.ended();
    }

    pub fn abandoned(&self) {
        self.ended();
        let abandoned = self
            .abandoned
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        let answered = self.answered.load(Ordering::Relaxed);
        if abandoned >= Self::TOLERATED
            && abandoned > answered.saturating_mul(2)
            && !self.expelled.swap(true, Ordering::AcqRel)
        {
            // Stored as a permit if the connection is not being polled now.
            self.wake();
        }
    }

    fn ended(&self) {
        // Saturating: the admin listener's requests are not counted in.
        let _ = self
            .open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        self.last.touch();
    }

    /// When the connection may be closed as idle, if no request opens
    /// before; `None` while a request is open.
    fn idle_at(&self) -> Option<Instant> {
        if self.open.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let last = self.last.last();
        Some(last + self.idle_timeout)
    }
}

pin_project! {
    /// A connection that shuts down gracefully when its [`Drain`] starts.
    pub struct Watched<C> {
        #[pin]
        conn: C,
        #[pin]
        notified: OwnedNotified,
        // The waker the drain will wake; registered again only if it changes.
        registered: Option<Waker>,
        asked: bool,
        started: Arc<AtomicBool>,
        // The flag and the wake-up that this connection's conduct gets it closed.
        conduct: Arc<Conduct>,
        #[pin]
        expel: OwnedNotified,
        // Fires when the connection may have been idle for `idle_timeout`.
        #[pin]
        idle: tokio::time::Sleep,
        // Once asked to close: fires when nothing may have gone out for
        // `write_timeout`. A graceful close waits for every stream, and an
        // HTTP/2 stream whose caller gives it no window never ends.
        #[pin]
        linger: tokio::time::Sleep,
        // Asked to close as idle or expelled (not by a drain).
        lingering: bool,
    }
}

impl<C: GracefulConnection> Future for Watched<C> {
    /// `None` when the connection was closed outright: asked to close, it
    /// sent nothing for `write_timeout`.
    type Output = Option<C::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // Evicted before a whole head came (nothing to finish), or cut:
        // close now.
        if this.conduct.evicted_unheard() || this.conduct.written.is_cut() {
            return Poll::Ready(None);
        }
        if !*this.asked {
            let mut started = this.started.load(Ordering::Acquire);
            let mut expelled = this.conduct.expelled.load(Ordering::Acquire);
            let registered = this
                .registered
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()));
            if !started && !expelled && !registered {
                started = this.notified.as_mut().poll(cx).is_ready();
                expelled = this.expel.as_mut().poll(cx).is_ready();
                *this.registered = Some(cx.waker().clone());
            }
            // Idle: closed like a drain closes it (HTTP/2: GOAWAY, and the
            // streams still answering finish first). The timer is pushed
            // back while requests come.
            let idle = loop {
                if this.idle.as_mut().poll(cx).is_pending() {
                    break false;
                }
                // Read fresh: the timer fired by a clock read after this
                // poll began; the poll's time could be before its deadline,
                // and a timer set again to a time passed fires at once.
                let now = Instant::now();
                match this.conduct.idle_at() {
                    Some(at) if at <= now => break true,
                    Some(at) => this.idle.as_mut().reset(at),
                    None => this.idle.as_mut().reset(now + this.conduct.idle_timeout),
                }
            };
            if started || expelled || idle {
                *this.asked = true;
                this.conn.as_mut().graceful_shutdown();
                // A drain has its own time (drain_timeout), in which a slow
                // answer may rightly send nothing for a while.
                *this.lingering = !started;
                let at = clock::now() + this.conduct.write_timeout;
                this.linger.as_mut().reset(at);
            }
        }
        if let Poll::Ready(out) = this.conn.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        if *this.lingering {
            while this.linger.as_mut().poll(cx).is_ready() {
                let at = this.conduct.written.last() + this.conduct.write_timeout;
                if at <= Instant::now() {
                    return Poll::Ready(None);
                }
                this.linger.as_mut().reset(at);
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::AtomicUsize;

    use futures_util::task::{waker, ArcWake};
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;

    use super::*;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl ArcWake for Count {
        fn wake_by_ref(arc_self: &Arc<Self>) {
            arc_self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// How a watched connection ended: `None` if closed outright.
    type Ended = Option<Result<(), hyper::Error>>;

    /// An idle HTTP/1.1 server connection over an in-memory pipe.
    fn idle_connection(
        drain: &Drain,
    ) -> (
        Pin<Box<impl Future<Output = Ended>>>,
        tokio::io::DuplexStream,
    ) {
        let (ours, theirs) = tokio::io::duplex(1024);
        let conn = hyper::server::conn::http1::Builder::new().serve_connection(
            TokioIo::new(ours),
            service_fn(|_req| async {
                Ok::<_, Infallible>(http::Response::new(
                    http_body_util::Empty::<bytes::Bytes>::new(),
                ))
            }),
        );
        (
            Box::pin(drain.watch(
                conn,
                &Arc::new(Conduct::new(
                    std::time::Duration::from_secs(3600),
                    std::time::Duration::from_secs(3600),
                    Arc::default(),
                )),
            )),
            theirs,
        )
    }

    #[tokio::test]
    async fn the_drain_wakes_the_waker_of_the_latest_poll() {
        let drain = Drain::new();
        let (mut conn, _peer) = idle_connection(&drain);
        let (a, b) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let (wa, wb) = (waker(a.clone()), waker(b.clone()));
        assert!(conn
            .as_mut()
            .poll(&mut Context::from_waker(&wa))
            .is_pending());
        // Moved to another task: the drain must wake that one.
        assert!(conn
            .as_mut()
            .poll(&mut Context::from_waker(&wb))
            .is_pending());
        assert!(conn
            .as_mut()
            .poll(&mut Context::from_waker(&wb))
            .is_pending());
        assert_eq!(b.0.load(Ordering::SeqCst), 0);

        drain.start();
        assert_eq!(b.0.load(Ordering::SeqCst), 1, "the latest waker is woken");
        let done = conn.as_mut().poll(&mut Context::from_waker(&wb));
        assert!(
            matches!(done, Poll::Ready(Some(Ok(())))),
            "an idle connection closes"
        );
    }

    #[tokio::test]
    async fn a_connection_watched_after_the_drain_started_closes_at_once() {
        let drain = Drain::new();
        drain.start();
        let (conn, _peer) = idle_connection(&drain);
        conn.await.expect("ended by itself").unwrap();
    }
}
