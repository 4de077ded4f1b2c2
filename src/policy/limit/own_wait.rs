//! The proxy's own wait for a CPU, which is not the upstream's latency.
//!
//! An attempt's latency, as the limit measures it, runs from its send to
//! its answer's head, and takes in any time the proxy's own threads were
//! ready to run but had no CPU: a node whose cores are busy (a sidecar
//! asks little CPU), or a CPU limit whose quota ran out before its period
//! ended, which stops every thread of the process for the rest of the
//! period (tens of milliseconds). Held against the upstream, that wait
//! made a starved sidecar shrink its limit and shed its callers for its
//! own stall, most of all in front of a fast upstream: a few milliseconds
//! is twice a path that takes five.
//!
//! So when a window closes above the calm band (where it could shrink the
//! limit), the limiter reads how long the process's threads have waited
//! for a CPU in all (the kernel's `run_delay`, see
//! `observe::cpu_wait`), and takes what they waited since the window
//! before closed off each of the window's samples: no answer waited on the
//! proxy longer than the proxy's threads waited in all. A window that was
//! slow by no more than that does not shrink the limit. A proxy starved
//! that much is the bottleneck itself: the limit neither shrinks nor grows
//! (its answers are slow), and timeouts still halve it.
//! The first such window after calm ones has no reading at its start: it
//! is not held against the upstream (a window is not a trend), and an
//! upstream that queues has its limit shrunk from the next window on, one
//! window (100 ms) later than it would be without the reading.
//!
//! The reading costs a look at each thread's `schedstat` (a few
//! syscalls), ten times a second at most, and only while windows close
//! above the calm band; where the kernel does not say (not Linux), the
//! limit is as it was without it.

use std::time::Duration;

use tokio::time::Instant;

/// What reads the time this process's threads have waited for a CPU in
/// all (`None` where it cannot be known).
pub type Reader = fn() -> Option<Duration>;

/// A reader for where the wait is not known: the limiter of unit tests.
pub fn not_known() -> Option<Duration> {
    None
}

#[derive(Debug, Clone)]
pub struct OwnWait {
    read: Reader,
    /// The reading at a window's close, and when.
    mark: Option<(Instant, Duration)>,
    /// When the last window closed.
    closed_at: Option<Instant>,
    /// Windows whose slowness the proxy's own wait explained.
    excused: u64,
}

/// The proxy's own wait over the window that just closed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Since {
    /// Not read: the window is calm, or the wait cannot be known.
    Unread,
    /// Read now, but not when the window began.
    Unknown,
    /// This long (seconds), the process's threads added up.
    Waited(f64),
}

impl OwnWait {
    pub fn new(read: Reader) -> Self {
        Self {
            read,
            mark: None,
            closed_at: None,
            excused: 0,
        }
    }

    /// A window closes at `now`; `warm`: above the calm band (only then is
    /// the wait read).
    pub fn at_close(&mut self, warm: bool, now: Instant) -> Since {
        let began = self.closed_at.replace(now);
        if !warm {
            return Since::Unread;
        }
        let Some(reading) = (self.read)() else {
            return Since::Unread;
        };
        match self.mark.replace((now, reading)) {
            Some((at, before)) if Some(at) == began => {
                Since::Waited(reading.saturating_sub(before).as_secs_f64())
            }
            _ => Since::Unknown,
        }
    }

    /// A window's slowness was the proxy's own wait.
    pub fn excuse(&mut self) {
        self.excused += 1;
    }

    /// Windows whose slowness the proxy's own wait explained, since the
    /// start.
    pub fn excused(&self) -> u64 {
        self.excused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    static WAITED_MS: AtomicU64 = AtomicU64::new(0);

    fn fake() -> Option<Duration> {
        Some(Duration::from_millis(WAITED_MS.load(Ordering::Relaxed)))
    }

    #[test]
    fn the_wait_is_of_the_window_that_closed_and_read_only_when_warm() {
        let mut own = OwnWait::new(fake);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        WAITED_MS.store(100, Ordering::Relaxed);
        assert_eq!(own.at_close(false, at(100)), Since::Unread);
        // Read, but nothing was read when this window began.
        assert_eq!(own.at_close(true, at(200)), Since::Unknown);
        WAITED_MS.store(130, Ordering::Relaxed);
        assert_eq!(own.at_close(true, at(300)), Since::Waited(0.03));
        // A calm window between: the next warm one's start was not read.
        assert_eq!(own.at_close(false, at(400)), Since::Unread);
        WAITED_MS.store(500, Ordering::Relaxed);
        assert_eq!(own.at_close(true, at(500)), Since::Unknown);
        // Threads that ended take their wait with them: never below zero.
        WAITED_MS.store(20, Ordering::Relaxed);
        assert_eq!(own.at_close(true, at(600)), Since::Waited(0.0));
    }

    mod limiter {
        use std::cell::Cell;
        use std::time::Duration;

        use tokio::time::Instant;

        use crate::policy::limit::{Limiter, Sample};
        use crate::policy::paths::PathKey;
        use crate::policy::settings::AdaptiveConfig;

        thread_local! {
            /// The proxy's own wait so far, as the fake reader says.
            static WAITED: Cell<Duration> = const { Cell::new(Duration::ZERO) };
        }

        fn fake() -> Option<Duration> {
            Some(WAITED.with(Cell::get))
        }

        fn limiter(read: fn() -> Option<Duration>) -> Limiter {
            let config = AdaptiveConfig {
                enabled: true,
                min_limit: 1,
                initial_limit: 16,
                tolerance: 2.0,
                smoothing: 0.2,
            };
            Limiter::try_new(&config, 1000).unwrap().with_own_wait(read)
        }

        /// Sixteen callers, every one in flight, each
        /// answer after `latency` ms, for `samples` samples 10 ms apart;
        /// the proxy waits `waits` ms for a CPU each 10 ms.
        fn run(l: &mut Limiter, clock: &mut Instant, samples: usize, latency: u64, waits: u64) {
            for _ in 0..samples {
                *clock += Duration::from_millis(10);
                WAITED.with(|w| w.set(w.get() + Duration::from_millis(waits)));
                let answer = Sample::Latency(Duration::from_millis(latency));
                l.update(answer, PathKey::NONE, l.limit().min(16), 0, *clock);
            }
        }

        /// A path of 5 ms whose answers take 12 while the proxy waits for
        /// a CPU a tenth of the time (a busy node): slow by no more than
        /// the proxy's own wait, which is not held against the upstream.
        /// Where the wait is not known, the same answers shrink the limit.
        #[test]
        fn answers_slow_by_the_proxys_own_wait_do_not_shrink_the_limit() {
            let mut clock = Instant::now();
            let mut l = limiter(fake);
            run(&mut l, &mut clock, 400, 5, 0);
            assert_eq!(l.limit(), 16, "calm");
            run(&mut l, &mut clock, 400, 12, 1);
            assert_eq!(l.limit(), 16, "held for the upstream");
            assert!(l.excused() >= 30, "{} windows excused", l.excused());

            let mut clock = Instant::now();
            let mut l = limiter(super::super::not_known);
            run(&mut l, &mut clock, 400, 5, 0);
            run(&mut l, &mut clock, 400, 12, 1);
            assert!(l.limit() < 8, "not known, shrunk to {}", l.limit());
            assert_eq!(l.excused(), 0);
        }

        /// An upstream that queues (answers six and forty times its 5 ms)
        /// while the proxy waits for a CPU too: the limit shrinks, one
        /// window later than where the wait is not known.
        #[test]
        fn an_upstream_that_queues_is_held_back_while_the_proxy_waits() {
            for (latency, waits) in [(30, 1), (200, 5)] {
                let mut clock = Instant::now();
                let mut l = limiter(fake);
                run(&mut l, &mut clock, 400, 5, 0);
                run(&mut l, &mut clock, 11, latency, waits);
                assert_eq!(l.limit(), 16, "the first slow window is not a trend");
                run(&mut l, &mut clock, 11, latency, waits);
                assert!(l.limit() < 16, "the next shrinks: {}", l.limit());
                run(&mut l, &mut clock, 100, latency, waits);
                assert!(l.limit() < 8, "{latency} ms: shrunk to {}", l.limit());
                assert_eq!(l.excused(), 0);
            }
        }
    }

    #[test]
    fn where_the_wait_is_not_known_nothing_is_read() {
        let mut own = OwnWait::new(not_known);
        let t0 = Instant::now();
        for i in 1..5 {
            let now = t0 + Duration::from_millis(100 * i);
            assert_eq!(own.at_close(true, now), Since::Unread);
        }
    }
}
