//! What an upstream may send before a response's head. hyper reads and
//! drops informational answers (`103 Early Hints`, `100 Continue`) one
//! after the other, with no end: an upstream that sent them without end
//! kept a core busy until the attempt's timeout (three million heads). A
//! connection of the pool counts what it reads while a request waits for
//! its head; past [`BEFORE_HEAD`] the read fails, the attempt is the
//! upstream's fault (`bad-response`), and the connection is closed.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

/// The most an upstream may send while a request waits for its head:
/// four times the largest head hyper takes (16 KiB), with room for the
/// first piece of the body read with it; a few thousand informational
/// answers.
pub(crate) const BEFORE_HEAD: usize = 64 * 1024;

/// No request waits for its head: reads are not counted.
const OPEN: usize = usize::MAX;

/// The upstream sent more than [`BEFORE_HEAD`] before a response's head.
#[derive(Debug, thiserror::Error)]
#[error(
    "the upstream sent more than {BEFORE_HEAD} bytes of informational answers before a response"
)]
pub struct EndlessInformational;

impl EndlessInformational {
    /// Whether `e` (an error from hyper's connection) is this one.
    pub fn is(e: &(dyn std::error::Error + 'static)) -> bool {
        e.downcast_ref::<io::Error>()
            .and_then(io::Error::get_ref)
            .is_some_and(|inner| inner.is::<Self>())
    }
}

/// A connection's count of what may still come before the head awaited.
#[derive(Clone)]
pub(crate) struct HeadWait(Arc<AtomicUsize>);

impl HeadWait {
    /// A request goes out: its head is awaited.
    pub(crate) fn begin(&self) {
        self.0.store(BEFORE_HEAD, Ordering::Relaxed);
    }

    /// Its head came (or the attempt ended).
    pub(crate) fn end(&self) {
        self.0.store(OPEN, Ordering::Relaxed);
    }

    /// Counts `n` bytes read: whether they were past what may come.
    fn read(&self, n: usize) -> bool {
        if n == 0 || self.0.load(Ordering::Relaxed) == OPEN {
            return false;
        }
        // One reader (the connection's task); `end` may race with it and
        // then only leaves a count too large to matter.
        let left = self.0.fetch_sub(n, Ordering::Relaxed);
        if left > n {
            return false;
        }
        self.0.store(0, Ordering::Relaxed);
        true
    }
}

/// A connection's stream, its reads counted while a head is awaited.
pub(crate) struct Metered<S> {
    inner: S,
    wait: HeadWait,
}

impl<S> Metered<S> {
    /// `inner`, and the handle its requests tell when a head is awaited.
    pub(crate) fn new(inner: S) -> (Self, HeadWait) {
        let wait = HeadWait(Arc::new(AtomicUsize::new(OPEN)));
        (
            Self {
                inner,
                wait: wait.clone(),
            },
            wait,
        )
    }

    pub(crate) fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Metered<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        match self.wait.read(buf.filled().len() - before) {
            true => Poll::Ready(Err(io::Error::other(EndlessInformational))),
            false => Poll::Ready(Ok(())),
        }
    }
}

crate::wire::write_through!(Metered);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[tokio::test]
    async fn reads_are_counted_only_while_a_head_is_awaited() {
        let (mut upstream, ours) = tokio::io::duplex(1 << 20);
        let (mut ours, wait) = Metered::new(ours);
        let chunk = vec![b'x'; 16 * 1024];
        let mut buf = vec![0u8; 16 * 1024];
        // Idle and after the head: anything goes.
        for _ in 0..8 {
            upstream.write_all(&chunk).await.unwrap();
            ours.read_exact(&mut buf).await.unwrap();
        }
        wait.begin();
        let mut read = 0;
        let error = loop {
            upstream.write_all(&chunk).await.unwrap();
            match ours.read(&mut buf).await {
                Ok(n) => read += n,
                Err(e) => break e,
            }
        };
        assert_eq!(read, BEFORE_HEAD - chunk.len());
        assert!(EndlessInformational::is(&error));
        wait.end();
        upstream.write_all(&chunk).await.unwrap();
        assert_eq!(ours.read(&mut buf).await.unwrap(), chunk.len());
    }
}
