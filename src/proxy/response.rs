//! The upstream's answer streamed back to the caller.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::units::clock;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;
use tokio::sync::Notify;
use tokio::time::Sleep;

use crate::policy::paths::PathKey;
use crate::upstream::{BoxError, InFlight, UpstreamBody};
use crate::wire::stamp::Stamp;

pin_project! {
    /// A response body sent to the caller: the upstream's, streamed, or one
    /// the proxy made. An upstream body holds the upstream's in-flight slot
    /// until it is finished or dropped.
    #[project = ResponseBodyProj]
    pub enum ResponseBody {
        Upstream {
            #[pin] body: UpstreamBody,
            // On the heap: a response is moved half a dozen times on its
            // way to the caller, and each move copies it whole.
            held: Box<Held>,
        },
        Local { #[pin] body: Full<Bytes> },
    }
}

/// What an upstream's body holds beside the body itself.
struct Held {
    slot: Slot,
    // Told when the upstream breaks the body off: a failure of the
    // route, for its breaker, though the attempt had answered.
    route: Pending,
    // How long the upstream may send nothing more (`write_timeout`),
    // and the timer that runs while it does.
    idle: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    waiting: bool,
}

impl ResponseBody {
    fn held(body: UpstreamBody, slot: Slot, route: Pending, idle: Duration) -> Self {
        ResponseBody::Upstream {
            body,
            held: Box::new(Held {
                slot,
                route,
                idle,
                timer: None,
                waiting: false,
            }),
        }
    }

    /// The upstream's body, cut with an error should the upstream send
    /// nothing more of it for `idle`.
    pub fn upstream(
        body: UpstreamBody,
        slot: InFlight,
        idle: Duration,
        route: Option<(Arc<super::Route>, PathKey)>,
    ) -> Self {
        Self::held(body, Slot::Own(Some(slot)), Pending(route), idle)
    }

    /// Like [`upstream`](Self::upstream), for a caller whose connection
    /// carries many streams (HTTP/2): a stream the caller gives no flow
    /// control window is never polled, so no timer inside the body can run.
    /// A watchdog task frees the slot (and closes the upstream connection)
    /// when no frame went out for `idle`, however the body is polled.
    pub fn watched(
        body: UpstreamBody,
        slot: InFlight,
        idle: Duration,
        route: Option<(Arc<super::Route>, PathKey)>,
    ) -> Self {
        if body.is_end_stream() {
            return Self::upstream(body, slot, idle, route);
        }
        let watch = Arc::new(Watch {
            last: Stamp::new(),
            waiting: AtomicBool::new(false),
            caller_stalled: AtomicBool::new(false),
            slot: std::sync::Mutex::new(Some(slot)),
            done: Arc::new(Notify::new()),
        });
        tokio::spawn(watchdog(Arc::downgrade(&watch), watch.done.clone(), idle));
        Self::held(body, Slot::Watched(watch), Pending(route), idle)
    }

    /// A passed-through host's body: no slot, no route to tell.
    pub fn passthrough(body: hyper::body::Incoming, idle: Duration) -> Self {
        Self::held(
            UpstreamBody::hyper(body),
            Slot::Own(None),
            Pending(None),
            idle,
        )
    }

    /// Whether it is an upstream's body, not one the proxy made.
    pub fn is_upstream(&self) -> bool {
        matches!(self, ResponseBody::Upstream { .. })
    }

    pub fn local(text: impl Into<Bytes>) -> Self {
        ResponseBody::Local {
            body: Full::new(text.into()),
        }
    }
}

/// The breaker's verdict on a request, when the retry loop left it to the
/// answer's body: a body broken off by the upstream is a failure; one that
/// came whole, or that the caller stopped reading, a success (the upstream
/// answered well as far as anyone saw).
struct Pending(Option<(Arc<super::Route>, PathKey)>);

impl Pending {
    fn end(&mut self, whole: bool) {
        if let Some((route, path)) = self.0.take() {
            let outcome = match whole {
                true => crate::policy::breaker::Outcome::Success,
                false => {
                    tracing::debug!(route = %route.name, "the upstream broke its response body off");
                    crate::policy::breaker::Outcome::Failure
                }
            };
            route
                .guards
                .record(crate::retry::Probe::NONE, outcome, path);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.end(true);
    }
}

/// The upstream slot a response body holds.
enum Slot {
    Own(Option<InFlight>),
    /// Shared with a watchdog that may let it go first.
    Watched(Arc<Watch>),
}

impl Slot {
    /// The body is done with the upstream: the slot goes back, the
    /// connection to its pool.
    fn release(&mut self) {
        match self {
            Slot::Own(slot) => drop(slot.take()),
            Slot::Watched(watch) => {
                drop(watch.take());
                watch.done.notify_one();
            }
        }
    }

    /// The upstream broke the body off (`whole` false) or sent it whole:
    /// the verdict on the endpoint that sent it.
    fn ended(&mut self, whole: bool) {
        let settle = |slot: &mut InFlight| match whole {
            true => slot.body_done(),
            false => slot.broken(),
        };
        match self {
            Slot::Own(slot) => {
                if let Some(slot) = slot {
                    settle(slot);
                }
            }
            Slot::Watched(watch) => {
                if let Some(slot) = &mut *watch.slot.lock().unwrap_or_else(|e| e.into_inner()) {
                    settle(slot);
                }
            }
        }
    }

    /// The watchdog let the slot go because the caller took nothing.
    fn caller_stalled(&self) -> bool {
        matches!(self, Slot::Watched(watch) if watch.caller_stalled.load(Ordering::Relaxed))
    }

    /// A frame went out toward the caller.
    fn progress(&self) {
        if let Slot::Watched(watch) = self {
            watch.last.touch();
            watch.waiting.store(false, Ordering::Relaxed);
        }
    }

    /// Polled, and the upstream had nothing more yet.
    fn waiting(&self) {
        if let Slot::Watched(watch) = self {
            watch.waiting.store(true, Ordering::Relaxed);
        }
    }
}

/// What a response body and its watchdog share.
struct Watch {
    /// When the last frame went out.
    last: Stamp,
    /// The body was polled and the upstream had nothing: a stall then is
    /// the upstream's, not the caller's.
    waiting: AtomicBool,
    /// The watchdog let the slot go for the caller's stall: the body's
    /// end that follows (its upstream connection closed) is no verdict on
    /// the upstream.
    caller_stalled: AtomicBool,
    slot: std::sync::Mutex<Option<InFlight>>,
    /// Wakes the watchdog when the body is done or dropped.
    done: Arc<Notify>,
}

impl Watch {
    fn take(&self) -> Option<InFlight> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.done.notify_one();
    }
}

/// Frees a stalled response's slot: when no frame went out toward the
/// caller for `idle`, the slot goes back and the upstream connection is
/// closed (its response is half read); the caller's stream then ends with
/// an error as soon as it is polled again.
async fn watchdog(watch: std::sync::Weak<Watch>, done: Arc<Notify>, idle: Duration) {
    loop {
        let deadline = match watch.upgrade() {
            Some(w) if w.slot.lock().unwrap_or_else(|e| e.into_inner()).is_some() => {
                w.last.last() + idle
            }
            _ => return,
        };
        if tokio::time::Instant::now() >= deadline {
            let Some(w) = watch.upgrade() else {
                return;
            };
            if let Some(mut slot) = w.take() {
                // Waiting on the upstream: its stall. Otherwise the caller
                // stopped taking frames, and the upstream answered well.
                if w.waiting.load(Ordering::Relaxed) {
                    slot.broken();
                } else {
                    w.caller_stalled.store(true, Ordering::Relaxed);
                }
                slot.abandon();
                tracing::debug!(idle = ?idle, "a response made no progress toward its caller; its upstream slot is freed");
            }
            return;
        }
        tokio::select! {
            () = done.notified() => {}
            () = tokio::time::sleep_until(deadline) => {}
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project() {
            ResponseBodyProj::Upstream { body, held } => {
                let Held {
                    slot,
                    route,
                    idle,
                    timer,
                    waiting,
                } = &mut **held;
                let mut body = body;
                let polled = body.as_mut().poll_frame(cx);
                if polled.is_pending() {
                    slot.waiting();
                    // Made on the first wait, pushed back at the start of each later one.
                    let deadline = clock::now() + *idle;
                    let timer =
                        timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                    if !std::mem::replace(waiting, true) {
                        timer.as_mut().reset(deadline);
                    }
                    if timer.as_mut().poll(cx).is_ready() {
                        // Polled and pending: the upstream, not the caller,
                        // has sent nothing more.
                        slot.ended(false);
                        route.end(false);
                        slot.release();
                        return Poll::Ready(Some(Err(
                            "the upstream sent nothing more of its body for write_timeout".into(),
                        )));
                    }
                    return Poll::Pending;
                }
                *waiting = false;
                // hyper stops polling a body whose length it knows once
                // that much came: the last frame may be its end.
                let whole = match &polled {
                    Poll::Ready(None) => Some(true),
                    Poll::Ready(Some(Err(_))) => Some(false),
                    Poll::Ready(Some(Ok(_))) if body.is_end_stream() => Some(true),
                    _ => None,
                };
                match whole {
                    Some(whole) => {
                        // The request's verdict waited for its body: the
                        // endpoint's, and the route's breaker's when the
                        // retry loop left it to the body.
                        slot.ended(whole);
                        route.end(whole || slot.caller_stalled());
                        slot.release();
                    }
                    None => slot.progress(),
                }
                polled
                    .map_err(Into::into)
                    .map(|frame| frame.map(|f| f.map(crate::upstream::body::clean)))
            }
            ResponseBodyProj::Local { body } => body.poll_frame(cx).map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Upstream { body, .. } => body.is_end_stream(),
            ResponseBody::Local { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Upstream { body, .. } => body.size_hint(),
            ResponseBody::Local { body } => body.size_hint(),
        }
    }
}
