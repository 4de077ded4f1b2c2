//! What a caller sends, as the rest of the proxy sees it: its request body
//! and, for a request that asks to upgrade, its side of the connection.
//! The listener makes them; the request path and the upstream side use them.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::oneshot;

/// Told when a caller's request body has been read to its end: on an
/// HTTP/1.1 connection, only then may the connection go on to the next
/// request.
pub trait BodyEnd: Send + Sync {
    fn read_to_end(&self);

    /// The body was let go, read to its end or not: what is left of it
    /// is hyper's to read past, or the connection's end.
    fn let_go(&self);
}

/// Byte streams an upgraded connection can run over.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The caller's side of a connection the proxy upgraded.
pub type Upgraded = Box<dyn Io>;

/// In a request that asks to upgrade: the caller's side of the connection,
/// once the answer switching protocols has been written. (Shared only
/// because request extensions must be `Clone`: one clone gets it.)
#[derive(Clone)]
pub struct CallerUpgrade(Arc<Mutex<Option<oneshot::Receiver<Upgraded>>>>);

impl CallerUpgrade {
    /// The caller's side, once it arrives on `rx`.
    pub fn new(rx: oneshot::Receiver<Upgraded>) -> Self {
        Self(Arc::new(Mutex::new(Some(rx))))
    }

    pub async fn upgraded(self) -> io::Result<Upgraded> {
        let gone = || {
            io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the caller's connection closed before it switched protocols",
            )
        };
        let rx = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(gone)?;
        rx.await.map_err(|_| gone())
    }
}

impl std::fmt::Debug for CallerUpgrade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallerUpgrade")
    }
}

pin_project! {
    /// A caller's request body. On an HTTP/1.1 connection it notes when it
    /// has been read to its end: only then may the connection go on to the
    /// next request.
    pub struct CallerBody {
        #[pin]
        inner: Incoming,
        end: Option<Arc<dyn BodyEnd>>,
        // Bytes its `Content-Length` still promises.
        promised: Option<u64>,
    }

    impl PinnedDrop for CallerBody {
        fn drop(this: Pin<&mut Self>) {
            if let Some(end) = this.project().end.take() {
                end.let_go();
            }
        }
    }
}

/// Why a caller's body could not be read.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

impl CallerBody {
    pub fn new(inner: Incoming) -> Self {
        let promised = inner.size_hint().exact();
        Self {
            inner,
            end: None,
            promised,
        }
    }

    /// A body that tells `end` once it has been read to its end.
    pub fn noting_end(inner: Incoming, end: Arc<dyn BodyEnd>) -> Self {
        let promised = inner.size_hint().exact();
        Self {
            inner,
            end: Some(end),
            promised,
        }
    }

    fn ended(&self) {
        if let Some(end) = &self.end {
            end.read_to_end();
        }
    }
}

impl std::fmt::Debug for CallerBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallerBody").finish_non_exhaustive()
    }
}

/// An HTTP/2 caller that cancels its stream (`RST_STREAM` with `CANCEL` or
/// `NO_ERROR`) ends its body as if it were complete, as hyper reads it: a
/// body that ends before its `Content-Length` is the caller's doing, and
/// must not reach the upstream as a short body the upstream is then blamed
/// for breaking off.
impl Body for CallerBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        let polled = match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(None) if this.promised.is_some_and(|left| left > 0) => {
                let left = this.promised.unwrap_or_default();
                return Poll::Ready(Some(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the caller's body ended {left} bytes short of its Content-Length"),
                )
                .into())));
            }
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(left), Some(data)) = (this.promised.as_mut(), frame.data_ref()) {
                    *left = left.saturating_sub(data.len() as u64);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        };
        if let Some(end) = this.end {
            let ended = match &polled {
                Poll::Ready(None) => true,
                Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
                _ => false,
            };
            if ended {
                end.read_to_end();
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        // Not while its length promises more: polled, it says why not.
        let end = self.inner.is_end_stream() && self.promised.is_none_or(|left| left == 0);
        if end {
            self.ended();
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
