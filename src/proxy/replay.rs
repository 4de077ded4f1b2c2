//! A request body that can be sent again.
//!
//! The first attempt streams the caller's body upstream as it arrives, and
//! keeps a copy of what passed, up to `max_replay_body`. A retry replays the
//! copy, then goes on reading the caller's body where the first attempt left
//! off. A body larger than the limit stops being copied (the copy is freed)
//! and can no longer be replayed — unless nothing of it was read yet, as when
//! the connection was refused.
//!
//! All clones share one state; only one clone holds it at a time. A clone
//! that is dropped (its attempt is over) hands the state back; a clone that
//! wants it meanwhile waits. This follows linkerd2-proxy's `ReplayBody`.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

pub struct ReplayBody {
    shared: Arc<Shared>,
    /// The state, while this clone holds it.
    state: Option<State>,
    /// How many buffered chunks this clone has sent.
    position: usize,
    trailers_sent: bool,
    /// Exact length of the whole body, when the caller declared one.
    exact_len: Option<u64>,
    /// Data bytes this clone has sent.
    sent: u64,
}

struct Shared {
    slot: Mutex<Slot>,
    max_bytes: u64,
}

struct Slot {
    state: Option<State>,
    waiting: Option<Waker>,
    /// Mirrors `State::replayable` while a clone holds the state.
    replayable: bool,
}

struct State {
    /// Everything read from `rest` so far, while `buffering`.
    buffer: Vec<Bytes>,
    buffered: u64,
    buffering: bool,
    /// Whether any data was read from the caller's body at all.
    consumed: bool,
    trailers: Option<HeaderMap>,
    /// The caller's body, until it ends.
    rest: Option<Incoming>,
}

impl State {
    fn replayable(&self) -> bool {
        self.buffering || !self.consumed
    }
}

impl ReplayBody {
    /// The source of every attempt's body: it holds none of the body itself,
    /// each [`replay`](Self::replay) takes the shared state in turn.
    pub fn new(body: Incoming, max_bytes: u64) -> Self {
        let exact_len = body.size_hint().exact();
        // A body declared larger than the limit is never copied at all.
        let buffering = exact_len.is_none_or(|len| len <= max_bytes);
        let state = State {
            buffer: Vec::new(),
            buffered: 0,
            buffering,
            consumed: false,
            trailers: None,
            rest: Some(body),
        };
        Self {
            shared: Arc::new(Shared {
                slot: Mutex::new(Slot {
                    state: Some(state),
                    waiting: None,
                    replayable: true,
                }),
                max_bytes,
            }),
            state: None,
            position: 0,
            trailers_sent: false,
            exact_len,
            sent: 0,
        }
    }

    /// Whether a clone could send the whole body again.
    pub fn is_replayable(&self) -> bool {
        match &self.state {
            Some(state) => state.replayable(),
            None => {
                let slot = self.shared.slot.lock().unwrap_or_else(|e| e.into_inner());
                match &slot.state {
                    Some(state) => state.replayable(),
                    None => slot.replayable,
                }
            }
        }
    }

    /// Another handle on the same body, starting from its first byte.
    pub fn replay(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            state: None,
            position: 0,
            trailers_sent: false,
            exact_len: self.exact_len,
            sent: 0,
        }
    }

    fn acquire(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.state.is_some() {
            return Poll::Ready(());
        }
        let mut slot = self.shared.slot.lock().unwrap_or_else(|e| e.into_inner());
        match slot.state.take() {
            Some(state) => {
                self.state = Some(state);
                Poll::Ready(())
            }
            None => {
                slot.waiting = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl Drop for ReplayBody {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            let mut slot = self.shared.slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.replayable = state.replayable();
            slot.state = Some(state);
            if let Some(waker) = slot.waiting.take() {
                waker.wake();
            }
        }
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if this.acquire(cx).is_pending() {
            return Poll::Pending;
        }
        let max_bytes = this.shared.max_bytes;
        let state = this.state.as_mut().expect("acquired");

        // First what earlier attempts already read.
        if this.position < state.buffer.len() {
            let chunk = state.buffer[this.position].clone();
            this.position += 1;
            this.sent += chunk.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        // Then the rest of the caller's body.
        if let Some(rest) = state.rest.as_mut() {
            return match Pin::new(rest).poll_frame(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(None) => {
                    state.rest = None;
                    this.trailers_sent = true;
                    Poll::Ready(None)
                }
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        state.consumed = true;
                        this.sent += data.len() as u64;
                        if state.buffering {
                            state.buffered += data.len() as u64;
                            if state.buffered > max_bytes {
                                state.buffering = false;
                                state.buffer = Vec::new();
                                this.position = 0;
                            } else {
                                state.buffer.push(data.clone());
                                this.position += 1;
                            }
                        }
                        Poll::Ready(Some(Ok(Frame::data(data))))
                    }
                    Err(frame) => {
                        if let Some(trailers) = frame.trailers_ref() {
                            state.trailers = Some(trailers.clone());
                            this.trailers_sent = true;
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                },
            };
        }
        // The caller's body has ended: replay its trailers once.
        if !this.trailers_sent {
            this.trailers_sent = true;
            if let Some(trailers) = state.trailers.clone() {
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            }
        }
        Poll::Ready(None)
    }

    /// With a declared length, the body ends once that many bytes were sent,
    /// so the connection need not poll once more to learn it. (A body with a
    /// declared length and trailers, possible only over HTTP/2, loses its
    /// trailers on a replay; gRPC declares no length.)
    fn is_end_stream(&self) -> bool {
        self.exact_len == Some(self.sent)
    }

    fn size_hint(&self) -> SizeHint {
        match self.exact_len {
            Some(len) => SizeHint::with_exact(len),
            None => SizeHint::default(),
        }
    }
}
