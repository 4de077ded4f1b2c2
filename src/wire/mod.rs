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

/// Vectored writes of at most this many bytes go out as one plain write of
/// a copy. A small answer or request is hyper's head and its body, two slices: on
/// Linux `writev` costs about 370 ns more a call than a `send` of the same
/// 600 bytes (the file layer's path, a segment per slice), the copy about
/// 20; at 8 KiB the two are within 130 ns, at 16 KiB level.
const GATHER: usize = 4 * 1024;

thread_local! {
    /// Where [`gathered`] copies to: one per thread, never above
    /// [`GATHER`].
    static FLAT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `write` of `bufs` copied into one slice, when they are more than one
/// and at most [`GATHER`] bytes together, or when only one is not empty
/// (written as it is); `None` otherwise, for a vectored write.
pub(crate) fn gathered<R>(
    bufs: &[std::io::IoSlice<'_>],
    write: impl FnOnce(&[u8]) -> R,
) -> Option<R> {
    let mut full = bufs.iter().filter(|b| !b.is_empty());
    let first = full.next()?;
    if full.next().is_none() {
        return Some(write(first));
    }
    let total = bufs.iter().try_fold(0usize, |sum, b| {
        Some(sum.saturating_add(b.len())).filter(|&s| s <= GATHER)
    })?;
    // Gone with its thread (a write from a thread-local's destructor), or
    // taken (a write is never made from inside another): vectored.
    FLAT.try_with(|flat| {
        let mut flat = flat.try_borrow_mut().ok()?;
        flat.clear();
        flat.reserve_exact(total);
        for b in bufs {
            flat.extend_from_slice(b);
        }
        Some(write(&flat))
    })
    .ok()
    .flatten()
}

/// Implements `AsyncWrite` for a wrapper `$ty<S>` of a stream `S` (its
/// field `inner`) by writing through to it, small vectored writes as one
/// write of a copy ([`gathered`]).
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
                let inner = &mut self.inner;
                let write = |flat: &[u8]| std::pin::Pin::new(&mut *inner).poll_write(cx, flat);
                if let Some(polled) = $crate::wire::gathered(bufs, write) {
                    return polled;
                }
                std::pin::Pin::new(inner).poll_write_vectored(cx, bufs)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_slices_are_written_as_one_copy_and_large_ones_left_vectored() {
        let head = vec![b'h'; 200];
        let body = vec![b'b'; 400];
        let two = [std::io::IoSlice::new(&head), std::io::IoSlice::new(&body)];
        let copy = gathered(&two, <[u8]>::to_vec).expect("gathered");
        assert_eq!(copy, [head.clone(), body.clone()].concat());

        // One slice with bytes, among empty ones: written as it is.
        let one = [
            std::io::IoSlice::new(&[]),
            std::io::IoSlice::new(&body),
            std::io::IoSlice::new(&[]),
        ];
        let same = gathered(&one, |b| b.as_ptr()).expect("the one slice");
        assert_eq!(same, body.as_ptr());

        // Nothing to write, or more than GATHER together: vectored.
        assert!(gathered(&[std::io::IoSlice::new(&[])], |_| ()).is_none());
        let big = vec![b'x'; GATHER];
        let over = [std::io::IoSlice::new(&head), std::io::IoSlice::new(&big)];
        assert!(gathered(&over, |_| ()).is_none());

        // The copy never keeps more than GATHER.
        let at_most = vec![b'y'; GATHER - 200];
        let full = [
            std::io::IoSlice::new(&head),
            std::io::IoSlice::new(&at_most),
        ];
        assert_eq!(gathered(&full, <[u8]>::len), Some(GATHER));
        assert!(FLAT.with(|f| f.borrow().capacity()) <= GATHER);
    }
}
