//! A request body that can be sent again.
//!
//! The first attempt streams the caller's body upstream as it arrives, and
//! keeps a copy of what passed, up to `max_replay_body` and within what is
//! left of the process's [`BodyMemory`] (`listen.max_body_memory`): a body
//! declared whole takes its length from it before anything is read, one of
//! unknown length takes each chunk as it comes. A retry replays the
//! copy, then goes on reading the caller's body where the first attempt left
//! off. A body larger than the limit stops being copied (the copy is freed)
//! and can no longer be replayed — unless nothing of it was read yet, as when
//! the connection was refused. A caller's body that fails (malformed, or the
//! caller went away) can never be replayed either.
//!
//! All clones share one state; only one clone holds it at a time. A clone
//! that is dropped (its attempt is over) hands the state back; a clone that
//! wants it meanwhile waits. This follows linkerd2-proxy's `ReplayBody`.
//!
//! Why [`ReplayBody::replayable`] answers `Option<bool>`: while an earlier
//! attempt's connection still holds the state (its task has not dropped the
//! body yet), what is left of the body is not known. Saying "yes" then would
//! resend only the rest of the body: with chunked framing, a well-formed but
//! truncated request. So it says `None`, unless the body is known to be
//! capped already, and [`ReplayBody::poll_released`] waits for the state.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use super::body::BoxError;

/// Bodies (or their rest) that found no room in the [`BodyMemory`].
pub const BODY_MEMORY_REFUSED: &str = "herdguard_body_memory_refused_total";

/// The bytes the [`BodyMemory`] holds, as last reported.
pub const BODY_MEMORY_HELD: &str = "herdguard_body_memory_bytes";

/// The bytes of request bodies held for replay by all requests together,
/// and the most they may be: a body that does not fit is sent once, not
/// queued for memory (a flood of stalled uploads cannot grow the process).
pub struct BodyMemory {
    held: AtomicU64,
    limit: AtomicU64,
    /// Bodies (or their rest) that found no room: `herdguard_body_memory_refused_total`.
    refused: metrics::Counter,
}

impl BodyMemory {
    pub fn new(limit: u64, refused: metrics::Counter) -> Self {
        Self {
            held: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
            refused,
        }
    }

    /// A new limit (a reload): what is held stays, new bodies see it.
    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Bytes held now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Takes `bytes` if they fit under the limit; counts a refusal if not.
    fn take(&self, bytes: u64) -> bool {
        let taken = self.fits(bytes);
        if !taken {
            self.refused.increment(1);
        }
        taken
    }

    /// Takes `bytes` if they fit under the limit.
    fn fits(&self, bytes: u64) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&after| after <= limit)
            })
            .is_ok()
    }

    /// Room for a body of `bytes` sent once and read whole before it is
    /// sent, held until the [`Held`] is dropped (once the body is written);
    /// `None` if it does not fit (the body then streams: nothing is
    /// refused).
    pub(crate) fn hold(self: &Arc<Self>, bytes: u64) -> Option<Held> {
        self.fits(bytes).then(|| Held {
            memory: Some(self.clone()),
            bytes,
        })
    }

    fn give(&self, bytes: u64) {
        if bytes > 0 {
            self.held.fetch_sub(bytes, Ordering::AcqRel);
        }
    }
}

/// Room taken from the [`BodyMemory`] for one body read whole, given back
/// when dropped.
pub(crate) struct Held {
    /// `None`: the room is taken elsewhere (a replay's copy).
    memory: Option<Arc<BodyMemory>>,
    bytes: u64,
}

impl Held {
    /// A body of `bytes` whose room was taken by what holds it already.
    pub(crate) fn counted_elsewhere(bytes: u64) -> Self {
        Self {
            memory: None,
            bytes,
        }
    }

    /// The body's length.
    pub(crate) fn len(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(memory) = &self.memory {
            memory.give(self.bytes);
        }
    }
}

pub struct ReplayBody<B = crate::wire::CallerBody> {
    shared: Arc<Shared<B>>,
    /// The state, while this clone holds it.
    state: Option<State<B>>,
    /// How many buffered chunks this clone has sent.
    position: usize,
    trailers_sent: bool,
    /// Exact length of the whole body, when the caller declared one.
    exact_len: Option<u64>,
    /// Data bytes this clone has sent.
    sent: u64,
}

struct Shared<B> {
    slot: Mutex<Slot<B>>,
    max_bytes: u64,
    memory: Arc<BodyMemory>,
    /// The declared length was taken from [`BodyMemory`] at the start.
    fits: bool,
    /// Set, once and for good, when the body can no longer be replayed: part
    /// of it was sent and the copy was not kept, or the caller's body failed.
    /// Readable while another clone holds the state.
    capped: AtomicBool,
}

struct Slot<B> {
    state: Option<State<B>>,
    /// Clones waiting for the state, and watchers waiting for its release.
    waiting: Vec<Waker>,
}

/// Chunks smaller than this are copied into the copy rather than kept as
/// the slices of the caller's read buffers they are: a body sent a byte
/// per chunk would otherwise keep a buffer per byte (260 uploads of 64 KB
/// in 1-byte chunks took the process past 200 MiB, counted as 16 MiB).
const COALESCE: usize = 4 * 1024;
/// The size of the pieces small chunks are copied into.
const TAIL: usize = 16 * 1024;

struct State<B> {
    /// Everything read from `rest` so far, while `buffering` (but `tail`).
    buffer: Vec<Bytes>,
    /// Small chunks read last, copied together (see [`COALESCE`]); moved
    /// into `buffer` when it fills, and when the state is handed on.
    tail: Option<Box<BytesMut>>,
    buffered: u64,
    buffering: bool,
    /// Bytes taken from [`BodyMemory`]: at least `buffered` while
    /// buffering, given back when the copy is dropped.
    reserved: u64,
    /// Whether any data was read from the caller's body at all.
    consumed: bool,
    /// The caller's body failed: what is left of it is lost.
    failed: bool,
    trailers: Option<HeaderMap>,
    /// The caller's body, until it ends.
    rest: Option<B>,
}

impl<B> State<B> {
    /// Moves the small chunks copied together into `buffer`.
    fn flush_tail(&mut self) {
        if let Some(tail) = self.tail.as_mut().filter(|t| !t.is_empty()) {
            self.buffer.push(tail.split().freeze());
        }
    }

    fn replayable(&self) -> bool {
        !self.failed && (self.buffering || !self.consumed)
    }

    /// Drops the copy (and gives its memory back): the body is sent once.
    fn stop_buffering(&mut self, memory: &BodyMemory) {
        self.buffering = false;
        self.buffer = Vec::new();
        self.tail = None;
        memory.give(std::mem::take(&mut self.reserved));
    }

    /// Keeps `data` in the copy if it fits `max_bytes` and the memory left.
    fn keep(&mut self, data: &Bytes, max_bytes: u64, memory: &BodyMemory) -> bool {
        self.buffered = self.buffered.saturating_add(data.len() as u64);
        let fits = self.buffered <= max_bytes
            && (self.buffered <= self.reserved || {
                let more = self.buffered - self.reserved;
                memory.take(more) && {
                    self.reserved += more;
                    true
                }
            });
        if fits && data.len() < COALESCE {
            // A small chunk is a slice of the caller's read buffer, which
            // it would keep whole: copied instead, beside the others.
            let tail = self.tail.get_or_insert_default();
            tail.extend_from_slice(data);
            if tail.len() >= TAIL {
                self.buffer.push(tail.split().freeze());
            }
        } else if fits {
            self.flush_tail();
            self.buffer.push(data.clone());
        } else {
            self.stop_buffering(memory);
        }
        fits
    }
}

impl<B> ReplayBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    /// The source of every attempt's body: it holds none of the body itself,
    /// each [`replay`](Self::replay) takes the shared state in turn.
    pub fn new(body: B, max_bytes: u64, memory: &Arc<BodyMemory>) -> Self {
        let exact_len = body.size_hint().exact();
        // A body declared larger than the limit is never copied at all; one
        // declared within it takes its whole length from the memory now.
        let (buffering, reserved) = match exact_len {
            None => (true, 0),
            Some(len) if len <= max_bytes && memory.take(len) => (true, len),
            Some(_) => (false, 0),
        };
        let state = State {
            buffer: Vec::new(),
            tail: None,
            buffered: 0,
            buffering,
            reserved,
            consumed: false,
            failed: false,
            trailers: None,
            rest: Some(body),
        };
        Self {
            shared: Arc::new(Shared {
                slot: Mutex::new(Slot {
                    state: Some(state),
                    waiting: Vec::new(),
                }),
                max_bytes,
                memory: memory.clone(),
                fits: reserved > 0,
                capped: AtomicBool::new(false),
            }),
            state: None,
            position: 0,
            trailers_sent: false,
            exact_len,
            sent: 0,
        }
    }
}

impl<B> ReplayBody<B> {
    /// Whether a clone could send the whole body again: `Some(false)` once
    /// that is known to be impossible, `None` while another clone holds the
    /// state and it is not known yet.
    pub fn replayable(&self) -> Option<bool> {
        if self.shared.capped.load(Ordering::Acquire) {
            return Some(false);
        }
        match &self.state {
            Some(state) => Some(state.replayable()),
            None => self.shared.lock().state.as_ref().map(State::replayable),
        }
    }

    /// Whether the whole body has been read and is held: a new clone can
    /// send it at once, beside another attempt. `false` while another
    /// clone holds the state.
    pub fn whole(&self) -> bool {
        if self.shared.capped.load(Ordering::Acquire) {
            return false;
        }
        // A declared length read whole ends the body even if the caller's
        // end of stream was never polled.
        let read = |s: &State<B>| s.rest.is_none() || self.exact_len == Some(s.buffered);
        let whole = |s: &State<B>| s.buffering && s.replayable() && read(s);
        match &self.state {
            Some(state) => whole(state),
            None => self.shared.lock().state.as_ref().is_some_and(whole),
        }
    }

    /// Ready once no clone holds the state (or the body is capped, which is
    /// final): then [`replayable`](Self::replayable) answers.
    pub fn poll_released(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.state.is_some() || self.shared.capped.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        let mut slot = self.shared.lock();
        if slot.state.is_some() {
            return Poll::Ready(());
        }
        park(&mut slot.waiting, cx.waker());
        Poll::Pending
    }

    /// Whether the caller declared a length that the copy holds room for
    /// whole (within `max_replay_body`, and taken from the memory).
    pub fn fits(&self) -> bool {
        self.shared.fits
    }

    /// The length the caller declared, if it did.
    pub(crate) fn exact_len(&self) -> Option<u64> {
        self.exact_len
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
        let mut slot = self.shared.lock();
        match slot.state.take() {
            Some(state) => {
                self.state = Some(state);
                Poll::Ready(())
            }
            None => {
                park(&mut slot.waiting, cx.waker());
                Poll::Pending
            }
        }
    }
}

impl<B> Shared<B> {
    fn lock(&self) -> MutexGuard<'_, Slot<B>> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<B> Drop for Shared<B> {
    /// The last clone is gone (each gave the state back first): the copy's
    /// memory goes back.
    fn drop(&mut self) {
        let slot = self.slot.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = &mut slot.state {
            self.memory.give(std::mem::take(&mut state.reserved));
        }
    }
}

/// Adds `waker` to `waiting` unless it is there already.
fn park(waiting: &mut Vec<Waker>, waker: &Waker) {
    if !waiting.iter().any(|w| w.will_wake(waker)) {
        waiting.push(waker.clone());
    }
}

impl<B> Drop for ReplayBody<B> {
    fn drop(&mut self) {
        if let Some(mut state) = self.state.take() {
            // The next clone replays the tail from `buffer`.
            state.flush_tail();
            let waiting = {
                let mut slot = self.shared.lock();
                slot.state = Some(state);
                std::mem::take(&mut slot.waiting)
            };
            for waker in waiting {
                waker.wake();
            }
        }
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.acquire(cx).is_pending() {
            return Poll::Pending;
        }
        let shared = &*this.shared;
        let Some(state) = this.state.as_mut() else {
            return Poll::Pending;
        };
        if state.failed {
            return Poll::Ready(Some(Err(
                "the caller's body failed in an earlier attempt".into()
            )));
        }

        // First what earlier attempts already read.
        if let Some(chunk) = state.buffer.get(this.position).cloned() {
            this.position += 1;
            this.sent = this.sent.saturating_add(chunk.len() as u64);
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
                Poll::Ready(Some(Err(e))) => {
                    // What is left of the body is lost: never replay it.
                    state.failed = true;
                    state.rest = None;
                    state.stop_buffering(&shared.memory);
                    shared.capped.store(true, Ordering::Release);
                    Poll::Ready(Some(Err(e.into())))
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let len = data.len() as u64;
                        state.consumed = true;
                        this.sent = this.sent.saturating_add(len);
                        if state.buffering {
                            if state.keep(&data, shared.max_bytes, &shared.memory) {
                                // All of it sent by this clone, the tail too.
                                this.position = state.buffer.len();
                            } else {
                                this.position = 0;
                            }
                        }
                        if !state.buffering {
                            shared.capped.store(true, Ordering::Release);
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

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::collections::VecDeque;

    /// A caller's body: these frames, then an end, an error, or a stall.
    struct Script {
        frames: VecDeque<Result<Bytes, &'static str>>,
        /// After the frames: `true` stalls forever, `false` ends.
        stall: bool,
    }

    impl Body for Script {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            match self.frames.pop_front() {
                Some(Ok(data)) => Poll::Ready(Some(Ok(Frame::data(data)))),
                Some(Err(e)) => Poll::Ready(Some(Err(e.into()))),
                None if self.stall => Poll::Pending,
                None => Poll::Ready(None),
            }
        }
    }

    fn script(chunks: &[&'static str], tail: Option<&'static str>) -> Script {
        let mut frames: VecDeque<_> = chunks
            .iter()
            .map(|c| Ok(Bytes::from_static(c.as_bytes())))
            .collect();
        if let Some(e) = tail {
            frames.push_back(Err(e));
        }
        Script {
            frames,
            stall: false,
        }
    }

    fn roomy() -> Arc<BodyMemory> {
        memory(u64::MAX)
    }

    fn memory(limit: u64) -> Arc<BodyMemory> {
        Arc::new(BodyMemory::new(limit, metrics::Counter::noop()))
    }

    /// A body of `len` bytes in one chunk, its length declared or not.
    struct Sized {
        data: Option<Bytes>,
        declared: bool,
    }

    impl Body for Sized {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.data.take().map(|d| Ok(Frame::data(d))))
        }
        fn size_hint(&self) -> SizeHint {
            match (&self.data, self.declared) {
                (Some(d), true) => SizeHint::with_exact(d.len() as u64),
                (None, true) => SizeHint::with_exact(0),
                _ => SizeHint::default(),
            }
        }
    }

    fn sized(len: usize, declared: bool) -> Sized {
        Sized {
            data: Some(Bytes::from(vec![b'x'; len])),
            declared,
        }
    }

    #[tokio::test]
    async fn bodies_held_for_replay_share_one_bound_in_bytes() {
        let memory = memory(10);
        // Declared: the whole length is taken before anything is read.
        let first = ReplayBody::new(sized(6, true), 64, &memory);
        assert!(first.fits());
        assert_eq!(memory.held(), 6);
        // The next does not fit what is left: sent once, never replayed.
        let second = ReplayBody::new(sized(6, true), 64, &memory);
        assert!(!second.fits());
        assert_eq!(collect(second.replay()).await.unwrap().len(), 6);
        assert_eq!(second.replayable(), Some(false));
        // Unknown length: taken chunk by chunk; past the room, the copy goes.
        let third = ReplayBody::new(sized(5, false), 64, &memory);
        assert_eq!(collect(third.replay()).await.unwrap().len(), 5);
        assert_eq!(third.replayable(), Some(false));
        assert_eq!(memory.held(), 6, "the refused copy took nothing");
        let fourth = ReplayBody::new(sized(4, false), 64, &memory);
        assert_eq!(collect(fourth.replay()).await.unwrap().len(), 4);
        assert_eq!(fourth.replayable(), Some(true));
        assert_eq!(memory.held(), 10);
        // Every byte comes back when the requests are over.
        drop((first, second, third, fourth));
        assert_eq!(memory.held(), 0);
        // A body whose copy failed gives its bytes back at once.
        let failing = ReplayBody::new(script(&["ab", "cd"], Some("bad")), 64, &memory);
        assert!(collect(failing.replay()).await.is_err());
        assert_eq!(memory.held(), 0);
    }

    async fn collect<B>(body: ReplayBody<B>) -> Result<Bytes, BoxError>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        Ok(body.collect().await?.to_bytes())
    }

    #[tokio::test]
    async fn a_small_body_is_replayed_whole() {
        let source = ReplayBody::new(script(&["ab", "cd"], None), 10, &roomy());
        assert_eq!(source.replayable(), Some(true));
        assert_eq!(collect(source.replay()).await.unwrap(), "abcd");
        assert_eq!(source.replayable(), Some(true));
        assert_eq!(collect(source.replay()).await.unwrap(), "abcd");
    }

    /// A body sent a byte per chunk, each chunk a slice of a read buffer
    /// of its own: the copy holds the bytes together, not the buffers.
    #[tokio::test]
    async fn small_chunks_are_kept_together_not_as_their_buffers() {
        let frames: VecDeque<_> = (0..1000)
            .map(|_| Ok(Bytes::from(vec![b'x'; 8192]).slice(..1)))
            .collect();
        let source = ReplayBody::new(
            Script {
                frames,
                stall: false,
            },
            4096,
            &roomy(),
        );
        assert_eq!(collect(source.replay()).await.unwrap().len(), 1000);
        let mut again = source.replay();
        let mut pieces = 0;
        let mut bytes = 0;
        while let Some(frame) = again.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            bytes += data.len();
            pieces += 1;
        }
        assert_eq!(bytes, 1000);
        assert_eq!(
            pieces, 1,
            "one piece, not a thousand slices of 8 KiB buffers"
        );
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_not_replayable_once_read() {
        let source = ReplayBody::new(script(&["abcd", "efgh"], None), 6, &roomy());
        assert_eq!(collect(source.replay()).await.unwrap(), "abcdefgh");
        assert_eq!(source.replayable(), Some(false));
    }

    #[tokio::test]
    async fn unknown_while_another_clone_holds_it_unless_capped() {
        let mut source = ReplayBody::new(
            Script {
                frames: [Ok(Bytes::from_static(b"abc"))].into(),
                stall: true,
            },
            10,
            &roomy(),
        );
        let mut first = source.replay();
        // The first attempt reads what came and waits for more: it holds the state.
        let frame = first.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "abc");
        assert_eq!(source.replayable(), None, "held by the first attempt");
        let released = std::future::poll_fn(|cx| Poll::Ready(source.poll_released(cx))).await;
        assert!(released.is_pending());
        drop(first);
        assert_eq!(source.replayable(), Some(true));
        let released = std::future::poll_fn(|cx| Poll::Ready(source.poll_released(cx))).await;
        assert!(released.is_ready());

        // Over the limit: known at once, even while a clone holds the state.
        source = ReplayBody::new(
            Script {
                frames: [Ok(Bytes::from_static(b"abcdef"))].into(),
                stall: true,
            },
            4,
            &roomy(),
        );
        let mut first = source.replay();
        first.frame().await.unwrap().unwrap();
        assert_eq!(source.replayable(), Some(false), "capped while held");
        drop(first);
    }

    #[tokio::test]
    async fn a_failure_mid_upload_is_never_replayed() {
        let source = ReplayBody::new(script(&["ab", "cd"], Some("bad chunk")), 1024, &roomy());
        let err = collect(source.replay()).await.unwrap_err();
        assert_eq!(err.to_string(), "bad chunk");
        assert_eq!(source.replayable(), Some(false));
        // A replay polled anyway fails; it never ends early as if complete.
        let err = collect(source.replay()).await.unwrap_err();
        assert!(
            err.to_string().contains("failed in an earlier attempt"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn nothing_read_yet_is_replayable_even_over_the_limit() {
        let body = script(&["abcdef"], None);
        let source = ReplayBody::new(body, 4, &roomy());
        // An attempt that never polled the body (its connection was refused).
        drop(source.replay());
        assert_eq!(source.replayable(), Some(true));
        assert_eq!(collect(source.replay()).await.unwrap(), "abcdef");
    }
}
