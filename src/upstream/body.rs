//! Body types of the proxy: what is sent upstream and what goes back to the
//! caller. Both stream; only a request body of at most [`READ_WHOLE_MAX`]
//! is read whole before it is sent ([`Whole`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::Notify;

use crate::policy::CallerFault;

use super::replay::{Held, ReplayBody};

/// The largest body sent once that is read whole before the first attempt
/// (as nginx buffers a small request body), and the largest sent by
/// herdguard's own exchange (see `plain.rs`), in one write with its head.
/// Larger ones stream, by hyper's client.
pub const READ_WHOLE_MAX: u64 = 16 * 1024;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// A request body sent upstream. One with content tells its attempt's
    /// [`Progress`] how the upload goes.
    pub struct RequestBody {
        #[pin]
        inner: Inner,
        progress: Option<Arc<Progress>>,
    }
}

pin_project! {
    #[project = InnerProj]
    enum Inner {
        Empty,
        // Both boxed: every request is moved through hyper's dispatch queue,
        // whose blocks hold 32 requests each, two blocks per upstream
        // connection; a replay buffer inline would make each request four
        // times the size, the caller's body a quarter more.
        Stream { body: Pin<Box<crate::wire::CallerBody>> },
        Replay { body: Pin<Box<ReplayBody>> },
        // Read whole (see [`Whole`]); `None` once handed on.
        Whole { body: Option<Box<Whole>> },
    }
}

/// A body read whole before it is sent, and the room it is held in (see
/// [`BodyMemory::hold`]): both let go once it is written.
pub(crate) struct Whole {
    data: Bytes,
    _held: Held,
}

impl std::fmt::Debug for Whole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Whole")
            .field("len", &self.data.len())
            .finish()
    }
}

impl Whole {
    /// Reads `body` whole, of the length `held` has room for. One piece
    /// (as a body that came with its head is) is kept as it is; more are
    /// copied together.
    pub(crate) async fn read<B>(body: &mut B, held: Held) -> Result<Box<Self>, BoxError>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        use http_body_util::BodyExt as _;
        let len = usize::try_from(held.len()).map_err(|_| "a body too long to hold")?;
        let mut first = Bytes::new();
        let mut more = bytes::BytesMut::new();
        while !body.is_end_stream() {
            let Some(frame) = body.frame().await else {
                break;
            };
            let Ok(data) = frame.map_err(Into::into)?.into_data() else {
                // Trailers: a body of a declared length cannot carry them.
                continue;
            };
            if first.len() + more.len() + data.len() > len {
                return Err("the request body is longer than its Content-Length".into());
            }
            if first.is_empty() && more.is_empty() {
                first = data;
            } else {
                if more.is_empty() {
                    more.reserve(len);
                    more.extend_from_slice(&std::mem::take(&mut first));
                }
                more.extend_from_slice(&data);
            }
        }
        let data = if more.is_empty() {
            first
        } else {
            more.freeze()
        };
        if data.len() != len {
            return Err("the request body ended before its Content-Length".into());
        }
        Ok(Box::new(Whole { data, _held: held }))
    }

    pub(crate) fn data(&self) -> &Bytes {
        &self.data
    }
}

impl RequestBody {
    pub fn empty() -> Self {
        Self {
            inner: Inner::Empty,
            progress: None,
        }
    }

    /// The caller's body, streamed once.
    pub fn stream(body: crate::wire::CallerBody, progress: Arc<Progress>) -> Self {
        Self {
            inner: Inner::Stream {
                body: Box::pin(body),
            },
            progress: Some(progress),
        }
    }

    /// One replay of the caller's body.
    pub fn replay(body: ReplayBody, progress: Arc<Progress>) -> Self {
        Self {
            inner: Inner::Replay {
                body: Box::pin(body),
            },
            progress: Some(progress),
        }
    }

    /// A body read whole: nothing left to wait for.
    pub(crate) fn whole(body: Box<Whole>) -> Self {
        Self {
            inner: Inner::Whole { body: Some(body) },
            progress: None,
        }
    }

    /// A request with no body at all (not one that ends up empty).
    pub fn is_empty(&self) -> bool {
        matches!(self.inner, Inner::Empty)
    }

    /// A body read whole, not yet handed on.
    pub(crate) fn is_whole(&self) -> bool {
        matches!(self.inner, Inner::Whole { body: Some(_) })
    }

    /// The body read whole, handed on (to be written).
    pub(crate) fn take_whole(&mut self) -> Option<Box<Whole>> {
        match &mut self.inner {
            Inner::Whole { body } => body.take(),
            _ => None,
        }
    }

    /// For a replay of a copy that holds the body whole, of a declared
    /// length of at most [`READ_WHOLE_MAX`]: its length, to be read whole
    /// (the copy's room is taken already, so nothing more is). `None` for
    /// any other body.
    pub(crate) fn replay_whole(&self) -> Option<Held> {
        let Inner::Replay { body } = &self.inner else {
            return None;
        };
        let len = body.exact_len().filter(|&len| len <= READ_WHOLE_MAX)?;
        body.whole().then(|| Held::counted_elsewhere(len))
    }

    fn inner_end(inner: &Inner) -> bool {
        match inner {
            Inner::Empty => true,
            Inner::Stream { body } => body.is_end_stream(),
            Inner::Replay { body } => body.is_end_stream(),
            Inner::Whole { body } => body.is_none(),
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let polled = match this.inner.as_mut().project() {
            InnerProj::Empty => Poll::Ready(None),
            InnerProj::Stream { body } => body.as_mut().poll_frame(cx).map_err(BoxError::from),
            InnerProj::Replay { body } => body.as_mut().poll_frame(cx),
            // Its room is let go as the data goes to the writer.
            InnerProj::Whole { body } => Poll::Ready(body.take().map(|w| Ok(Frame::data(w.data)))),
        };
        let polled = polled.map(|frame| frame.map(|f| f.map(clean)));
        if let Some(progress) = this.progress {
            match &polled {
                Poll::Pending => progress.set(WAITING),
                Poll::Ready(None) => progress.set(SENT),
                Poll::Ready(Some(Ok(_))) => {
                    if Self::inner_end(&this.inner.as_ref()) {
                        progress.set(SENT);
                    } else {
                        progress.clear(WAITING);
                    }
                }
                Poll::Ready(Some(Err(e))) => progress.fail(caller_fault(&**e)),
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let end = Self::inner_end(&self.inner);
        if end {
            if let Some(progress) = &self.progress {
                progress.set(SENT);
            }
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Empty => SizeHint::with_exact(0),
            Inner::Stream { body } => body.size_hint(),
            Inner::Replay { body } => body.size_hint(),
            Inner::Whole { body } => {
                SizeHint::with_exact(body.as_ref().map_or(0, |w| w.data.len() as u64))
            }
        }
    }
}

pin_project! {
    /// An upstream's answer's body: read by hyper's connection, or by
    /// herdguard's own exchange (see `plain.rs`).
    #[project = UpstreamBodyProj]
    pub enum UpstreamBody {
        Hyper { #[pin] body: hyper::body::Incoming },
        Plain { #[pin] body: super::plain::PlainBody },
    }
}

impl UpstreamBody {
    pub fn hyper(body: hyper::body::Incoming) -> Self {
        UpstreamBody::Hyper { body }
    }

    pub fn plain(body: super::plain::PlainBody) -> Self {
        UpstreamBody::Plain { body }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project() {
            UpstreamBodyProj::Hyper { body } => body.poll_frame(cx).map_err(BoxError::from),
            UpstreamBodyProj::Plain { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Hyper { body } => body.is_end_stream(),
            UpstreamBody::Plain { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Hyper { body } => body.size_hint(),
            UpstreamBody::Plain { body } => body.size_hint(),
        }
    }
}

/// A frame as it may be passed on: a trailer section cleaned of what may
/// not be in one.
pub(crate) fn clean(mut frame: Frame<Bytes>) -> Frame<Bytes> {
    if let Some(trailers) = frame.trailers_mut() {
        crate::wire::headers::clean_trailers(trailers);
    }
    frame
}

pub(super) const SENT: u8 = 1;
pub(super) const WAITING: u8 = 2;
const GONE: u8 = 4;
const MALFORMED: u8 = 8;

/// How one attempt's upload goes, as its body sees it: whether the body was
/// sent whole, whether it is waiting on the caller, and how the caller's
/// body failed, if it did. The attempt's timers read it: per-try time starts
/// once the body is sent; a request still waiting on its caller when the
/// deadline comes is the caller's stall.
#[derive(Debug, Default)]
pub struct Progress {
    flags: AtomicU8,
    sent: Notify,
}

impl Progress {
    /// The body was read to its end and handed to the connection.
    pub fn is_sent(&self) -> bool {
        self.flags.load(Ordering::Acquire) & SENT != 0
    }

    /// Waits until [`is_sent`](Self::is_sent).
    pub async fn sent(&self) {
        loop {
            let notified = self.sent.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_sent() {
                return;
            }
            notified.await;
        }
    }

    /// The body's last poll found no data from the caller yet.
    pub fn waiting_on_caller(&self) -> bool {
        self.flags.load(Ordering::Acquire) & (WAITING | SENT) == WAITING
    }

    /// How the caller's body failed, if it did.
    pub fn caller_fault(&self) -> Option<CallerFault> {
        let flags = self.flags.load(Ordering::Acquire);
        if flags & MALFORMED != 0 {
            Some(CallerFault::MalformedBody)
        } else if flags & GONE != 0 {
            Some(CallerFault::Gone)
        } else {
            None
        }
    }

    pub(super) fn set(&self, flag: u8) {
        let before = self.flags.fetch_or(flag, Ordering::AcqRel);
        if flag & SENT != 0 && before & SENT == 0 {
            self.sent.notify_waiters();
        }
    }

    pub(super) fn clear(&self, flag: u8) {
        self.flags.fetch_and(!flag, Ordering::AcqRel);
    }

    fn fail(&self, fault: CallerFault) {
        self.clear(WAITING);
        self.set(match fault {
            CallerFault::MalformedBody => MALFORMED,
            CallerFault::Gone | CallerFault::StalledBody => GONE,
        });
    }
}

/// Whose fault a failed read of the caller's body was, from its error: a
/// body that broke the protocol is malformed; one that ended early, or
/// whose connection or stream went away, is a caller gone.
pub fn caller_fault(e: &(dyn std::error::Error + 'static)) -> CallerFault {
    let mut source = Some(e);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput => {
                    CallerFault::MalformedBody
                }
                _ => CallerFault::Gone,
            };
        }
        if let Some(h) = e.downcast_ref::<hyper::Error>() {
            if h.is_parse() {
                return CallerFault::MalformedBody;
            }
        }
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            let broken = h2.reason().is_some_and(|r| {
                r == h2::Reason::PROTOCOL_ERROR
                    || r == h2::Reason::FLOW_CONTROL_ERROR
                    || r == h2::Reason::FRAME_SIZE_ERROR
            });
            return if broken {
                CallerFault::MalformedBody
            } else {
                CallerFault::Gone
            };
        }
        source = e.source();
    }
    CallerFault::Gone
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;
    use std::convert::Infallible;

    type Frames = std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>;

    /// A body of the pieces given, each a frame.
    fn pieces(parts: &[&'static [u8]]) -> StreamBody<futures_util::stream::Iter<Frames>> {
        let frames: Vec<_> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    fn held(len: u64) -> Held {
        Held::counted_elsewhere(len)
    }

    #[tokio::test]
    async fn a_body_is_read_whole_only_at_its_declared_length() {
        let whole = Whole::read(&mut pieces(&[b"hello"]), held(5))
            .await
            .unwrap();
        assert_eq!(whole.data(), "hello");
        let whole = Whole::read(&mut pieces(&[b"he", b"", b"llo", b" you"]), held(9))
            .await
            .unwrap();
        assert_eq!(whole.data(), "hello you", "pieces copied together");
        let short = Whole::read(&mut pieces(&[b"hel"]), held(5))
            .await
            .unwrap_err();
        assert!(short.to_string().contains("ended before"), "{short}");
        let long = Whole::read(&mut pieces(&[b"hel", b"lo!"]), held(5))
            .await
            .unwrap_err();
        assert!(long.to_string().contains("longer than"), "{long}");
    }

    #[tokio::test]
    async fn a_whole_body_is_one_frame_then_its_end() {
        use http_body_util::BodyExt as _;
        let whole = Whole::read(&mut pieces(&[b"ab", b"cd"]), held(4))
            .await
            .unwrap();
        let mut body = RequestBody::whole(whole);
        assert!(body.is_whole());
        assert_eq!(body.size_hint().exact(), Some(4));
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "abcd");
        assert!(body.is_end_stream());
        assert!(body.frame().await.is_none());
        assert!(body.take_whole().is_none(), "handed on once");
    }
}
