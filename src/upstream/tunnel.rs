//! Upgraded connections (WebSocket and other HTTP/1.1 upgrades): bytes both
//! ways after a 101, counted apart from requests and closed when idle.
//!
//! Why apart: a tunnel can live for hours. Held as one of the upstream's
//! in-flight slots, 100 idle WebSockets would shed every plain request with
//! 503 `overloaded`. So a 101 gives its request slot back, and tunnels are
//! counted under `max_tunnels` instead; one that carries no byte either way
//! for `tunnel_idle_timeout` is closed (HAProxy's `timeout tunnel`).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;
use tracing::debug;

use super::InFlight;
use crate::wire::stamp::Stamp;

/// Open tunnels of one upstream, and how many it may have.
#[derive(Debug)]
pub struct Tunnels {
    open: AtomicUsize,
    max: usize,
    pub idle_timeout: Duration,
}

impl Tunnels {
    pub fn new(max: usize, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            open: AtomicUsize::new(0),
            max,
            idle_timeout,
        })
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Takes a place for a tunnel, or `None` when `max_tunnels` are open.
    /// Taken when a request asks to upgrade, let go if it is not upgraded.
    pub fn try_reserve(self: &Arc<Self>) -> Option<TunnelSlot> {
        let prior = self.open.fetch_add(1, Ordering::AcqRel);
        if prior >= self.max {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(TunnelSlot(self.clone()))
    }
}

/// Every tunnel a proxy has open, whatever upstream or config it began
/// under: a drain waits for them as for connections, since an upgraded
/// connection has left hyper's hands and no connection count holds it.
#[derive(Debug, Default)]
pub struct OpenTunnels {
    open: AtomicUsize,
    closed: tokio::sync::Notify,
}

impl OpenTunnels {
    pub fn count(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Counts one more until the guard is dropped.
    pub fn track(self: &Arc<Self>) -> Tracked {
        self.open.fetch_add(1, Ordering::AcqRel);
        Tracked(self.clone())
    }

    /// Waits until none is open, or `limit` passes: whether none is.
    pub async fn closed_within(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let closed = self.closed.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            if self.count() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, closed).await.is_err() {
                return self.count() == 0;
            }
        }
    }
}

/// One open tunnel, counted in [`OpenTunnels`] until dropped.
#[derive(Debug)]
pub struct Tracked(Arc<OpenTunnels>);

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.closed.notify_waiters();
        }
    }
}

/// One place among an upstream's tunnels, given back on drop.
#[derive(Debug)]
pub struct TunnelSlot(Arc<Tunnels>);

impl Drop for TunnelSlot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Relays bytes both ways after a 101 Switching Protocols, until either side
/// closes or nothing moves for the idle timeout. The request's slot stops
/// counting as in flight at once.
pub async fn relay(
    caller: crate::wire::CallerUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    mut slot: InFlight,
    place: TunnelSlot,
    tracked: Tracked,
) {
    slot.park();
    let idle = place.0.idle_timeout;
    let upstream = async { upstream.await.map_err(io::Error::other) };
    let (caller, upstream) = match tokio::try_join!(caller.upgraded(), upstream) {
        Ok(pair) => pair,
        Err(e) => {
            debug!(error = %e, "upgrade failed");
            return;
        }
    };
    copy_until_idle(caller, TokioIo::new(upstream), idle).await;
    drop(slot);
    drop(place);
    drop(tracked);
}

/// Relays bytes both ways between a caller whose CONNECT was answered 2xx
/// and the connection made for it, until either side closes or nothing
/// moves for the idle timeout.
pub async fn relay_connect(
    caller: crate::wire::CallerUpgrade,
    upstream: tokio::net::TcpStream,
    place: TunnelSlot,
    tracked: Tracked,
) {
    match caller.upgraded().await {
        Ok(caller) => copy_until_idle(caller, upstream, place.0.idle_timeout).await,
        Err(e) => debug!(error = %e, "CONNECT tunnel not taken up"),
    }
    drop(place);
    drop(tracked);
}

/// Copies both ways until either side closes or nothing moves for `idle`.
async fn copy_until_idle<A, B>(caller: A, upstream: B, idle: Duration)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Arc::new(Stamp::new());
    let mut caller = Watched::new(caller, activity.clone());
    let mut upstream = Watched::new(upstream, activity.clone());
    let copy = tokio::io::copy_bidirectional(&mut caller, &mut upstream);
    tokio::pin!(copy);
    loop {
        let quiet_until = activity.last() + idle;
        tokio::select! {
            done = &mut copy => {
                if let Err(e) = done {
                    debug!(error = %e, "upgraded connection ended with an error");
                }
                break;
            }
            () = tokio::time::sleep_until(quiet_until) => {
                if activity.last() + idle <= Instant::now() {
                    debug!(idle = ?idle, "upgraded connection idle; closed");
                    break;
                }
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// An upgraded stream that notes when bytes move through it.
    struct Watched<T> {
        #[pin]
        inner: T,
        activity: Arc<Stamp>,
    }
}

impl<T> Watched<T> {
    fn new(inner: T, activity: Arc<Stamp>) -> Self {
        Self { inner, activity }
    }
}

impl<T: AsyncRead> AsyncRead for Watched<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let polled = this.inner.poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.touch();
        }
        polled
    }
}

impl<T: AsyncWrite> AsyncWrite for Watched<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        let polled = this.inner.poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        polled
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}
