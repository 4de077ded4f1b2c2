//! Body types of the proxy: what is sent upstream and what goes back to the
//! caller. Both stream; neither buffers a whole body.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use pin_project_lite::pin_project;

use super::replay::ReplayBody;
use super::upstream::InFlight;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// A request body sent upstream.
    #[project = RequestBodyProj]
    pub enum RequestBody {
        Empty,
        Stream { #[pin] body: Incoming },
        // Boxed: every request is moved through hyper's dispatch queue, and a
        // replay buffer inline would make each of them four times the size.
        Replay { body: Pin<Box<ReplayBody>> },
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.project() {
            RequestBodyProj::Empty => Poll::Ready(None),
            RequestBodyProj::Stream { body } => body.poll_frame(cx),
            RequestBodyProj::Replay { body } => body.as_mut().poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Empty => true,
            RequestBody::Stream { body } => body.is_end_stream(),
            RequestBody::Replay { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Empty => SizeHint::with_exact(0),
            RequestBody::Stream { body } => body.size_hint(),
            RequestBody::Replay { body } => body.size_hint(),
        }
    }
}

pin_project! {
    /// A response body sent to the caller: the upstream's, streamed, or one
    /// the proxy made. An upstream body holds the upstream's in-flight slot
    /// until it is finished or dropped.
    #[project = ResponseBodyProj]
    pub enum ResponseBody {
        Upstream { #[pin] body: Incoming, slot: Option<InFlight> },
        Local { #[pin] body: Full<Bytes> },
    }
}

impl ResponseBody {
    pub fn upstream(body: Incoming, slot: InFlight) -> Self {
        ResponseBody::Upstream {
            body,
            slot: Some(slot),
        }
    }

    pub fn local(text: impl Into<Bytes>) -> Self {
        ResponseBody::Local {
            body: Full::new(text.into()),
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
            ResponseBodyProj::Upstream { body, slot } => {
                let polled = body.poll_frame(cx);
                if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
                    slot.take();
                }
                polled.map_err(Into::into)
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
