//! When something last happened, kept in an atomic: written on hot paths
//! (each frame, each request) without a lock, read by the timer that acts
//! on it (idle tunnels, stalled responses, idle connections).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::units::clock;
use tokio::time::Instant;

#[derive(Debug)]
pub struct Stamp {
    start: Instant,
    /// Nanoseconds from `start` to the last [`touch`](Stamp::touch).
    nanos: AtomicU64,
}

impl Stamp {
    /// A stamp that reads as now.
    pub fn new() -> Self {
        Self {
            start: clock::now(),
            nanos: AtomicU64::new(0),
        }
    }

    /// Now is the last time. Never moves back, whatever the threads' order.
    pub fn touch(&self) {
        let since = clock::now().saturating_duration_since(self.start);
        let nanos = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_max(nanos, Ordering::Relaxed);
    }

    /// The last time it was touched (its making, if never).
    pub fn last(&self) -> Instant {
        self.start + Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }
}

impl Default for Stamp {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn it_reads_the_last_touch() {
        let stamp = Stamp::new();
        let made = stamp.last();
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(stamp.last(), made, "untouched: its making");
        stamp.touch();
        assert_eq!(stamp.last(), made + Duration::from_millis(40));
    }
}
