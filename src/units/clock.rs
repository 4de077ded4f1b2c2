//! The time a task's poll began, read once for all the poll does.
//!
//! A plain GET looked at the clock about fifteen times (the attempt's start
//! and end, the pool's idle times, the budget's and breaker's windows, the
//! request's duration, the write timer), each a `clock_gettime` of about
//! 20 ns on a virtual machine's TSC. A caller connection's task is
//! [`Clocked`]: the clock is read as each of its polls begins, and [`now`]
//! inside the poll gives that reading. A poll is short (one request's head,
//! an answer's head, a body's read), so the times it gives are the poll's
//! start to within microseconds. Outside a clocked poll, [`now`] reads the
//! clock.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::Instant;

thread_local! {
    /// The reading of the clocked poll running on this thread, if any.
    static POLLED_AT: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The time: the start of the clocked poll running, or the clock's reading.
#[inline]
pub fn now() -> Instant {
    POLLED_AT.with(Cell::get).unwrap_or_else(Instant::now)
}

pin_project_lite::pin_project! {
    /// A future whose every poll reads the clock once, for [`now`].
    pub struct Clocked<F> {
        #[pin]
        inner: F,
    }
}

impl<F> Clocked<F> {
    pub fn new(inner: F) -> Self {
        Self { inner }
    }
}

impl<F: Future> Future for Clocked<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let outer = POLLED_AT.with(|at| at.replace(Some(Instant::now())));
        let polled = self.project().inner.poll(cx);
        POLLED_AT.with(|at| at.set(outer));
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn within_a_clocked_poll_the_time_stands() {
        Clocked::new(async {
            let first = now();
            // The clock moves on (a bounded spin of a millisecond)...
            let moved = first + Duration::from_millis(1);
            while Instant::now() < moved {
                std::hint::spin_loop();
            }
            // ...the poll's time does not.
            assert_eq!(now(), first);
        })
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn each_clocked_poll_reads_the_clock_again() {
        let (first, second) = Clocked::new(async {
            let first = now();
            // `advance` yields: what follows is the next poll.
            tokio::time::advance(Duration::from_millis(5)).await;
            (first, now())
        })
        .await;
        assert_eq!(second, first + Duration::from_millis(5));
    }

    #[tokio::test(start_paused = true)]
    async fn outside_a_clocked_poll_the_clock_is_read() {
        let before = now();
        tokio::time::advance(Duration::from_millis(3)).await;
        assert_eq!(now(), before + Duration::from_millis(3));
        // A clocked poll restores what was there when it ends.
        Clocked::new(async {}).await;
        tokio::time::advance(Duration::from_millis(2)).await;
        assert_eq!(now(), before + Duration::from_millis(5));
    }
}
