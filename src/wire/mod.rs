//! What goes over the wire on both sides of the proxy: the header rules,
//! the caller's body and upgraded connection as the listener hands them
//! over, and streams that note when they were last active.

pub(crate) mod caller;
pub mod headers;
pub mod identity;
pub(crate) mod stamp;

pub use caller::{BodyEnd, CallerBody, CallerUpgrade, Io, Upgraded};

/// Marks a request the proxy answers 503 at once, before any other work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crowded {
    /// It came on an HTTP/2 stream past its listener's bound on open
    /// streams, or with a large head past the bound on large heads held.
    Held,
    /// The process's memory is past `listen.max_memory`.
    Memory,
}

/// An error and its causes on one line.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let message = s.to_string();
        if !text.contains(&message) {
            text.push_str(": ");
            text.push_str(&message);
        }
        source = s.source();
    }
    text
}

/// Implements `AsyncWrite` for a wrapper `$ty<S>` of a stream `S` (its
/// field `inner`) by writing through to it, vectored writes included.
macro_rules! write_through {
    ($ty:ident) => {
        impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $ty<S> {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
            }

            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.inner.is_write_vectored()
            }

            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.inner).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
            }
        }
    };
}
pub(crate) use write_through;
