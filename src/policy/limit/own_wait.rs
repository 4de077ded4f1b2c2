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
//! So when a window closes above the calm band with the limit above its
//! floor (where it could shrink the limit), the limiter reads how long
//! each of the process's threads has waited for a CPU (the kernel's
//! `run_delay`, see `observe::cpu_wait`), and takes what the thread that
//! waited most waited since the window before closed off each of the
//! window's samples: the most, not the sum, as a spent quota stops every
//! thread at once and an answer waits once. A window that was slow by no
//! more than that neither shrinks the limit nor counts as calm. A proxy
//! starved that much is the bottleneck itself: the limit neither shrinks
//! nor grows (its answers are slow), and timeouts still halve it.
//! A slow window with no reading in the second before it (the first of a
//! slow spell) is not held against the upstream (a window is not a
//! trend): an upstream that queues has its limit shrunk from the next
//! window on, 100 ms later than it would be without the reading. One
//! whose last reading came before a calm window takes the wait since,
//! spread evenly over the time since.
//!
//! The reading costs a directory listing and a read of each thread's
//! `schedstat`, at most once per 20 ms for the whole process (shared by
//! every upstream's limit), and only while windows close slow; where the
//! kernel does not say (not Linux), the limit is as it was without it.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// Each thread's wait for a CPU so far, by thread id, as read at one
/// moment.
#[derive(Debug, Default, PartialEq)]
pub struct Waits(Vec<(u32, u64)>);

impl Waits {
    /// From (thread id, nanoseconds waited) pairs.
    pub fn new(mut threads: Vec<(u32, u64)>) -> Self {
        threads.sort_unstable();
        Self(threads)
    }

    /// The most any one thread waited since `before` (a thread new since
    /// then, all it waited). The most, not the sum: a CPU quota that runs
    /// out stops every thread for the same time, which an answer waits
    /// once, not once per thread.
    pub fn most_since(&self, before: &Waits) -> Duration {
        let most = self.0.iter().fold(0u64, |most, &(tid, ns)| {
            let was = match before.0.binary_search_by_key(&tid, |&(t, _)| t) {
                Ok(i) => before.0.get(i).map_or(0, |&(_, ns)| ns),
                Err(_) => 0,
            };
            most.max(ns.saturating_sub(was))
        });
        Duration::from_nanos(most)
    }
}

/// What reads each thread's wait for a CPU so far (`None` where it cannot
/// be known).
pub type Reader = fn() -> Option<Arc<Waits>>;

/// A reader for where the wait is not known: the limiter of unit tests.
pub fn not_known() -> Option<Arc<Waits>> {
    None
}

/// A reading older than this at a window's close is not a start for it.
const MARK_AGE: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct OwnWait {
    read: Reader,
    /// The reading at a window's close, and when.
    mark: Option<(Instant, Arc<Waits>)>,
    /// When the last window closed.
    closed_at: Option<Instant>,
    /// Windows whose slowness the proxy's own wait explained.
    excused: u64,
}

/// The proxy's own wait over the window that just closed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Since {
    /// Not read: the window is calm or cannot shrink the limit, or the
    /// wait cannot be known.
    Unread,
    /// Read now, but not within a second before.
    Unknown,
    /// This long (seconds) for the thread that waited most.
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

    /// A window closes at `now`; `warm`: above the calm band, with room to
    /// shrink (only then is the wait read). Read at a close before the
    /// window's start (a calm window between), the wait since is taken as
    /// spread evenly over the time since.
    pub fn at_close(&mut self, warm: bool, now: Instant) -> Since {
        let began = self.closed_at.replace(now);
        if !warm {
            return Since::Unread;
        }
        let Some(reading) = (self.read)() else {
            return Since::Unread;
        };
        let since = match (&self.mark, began) {
            (Some((at, before)), Some(began)) if now.saturating_duration_since(*at) <= MARK_AGE => {
                let most = reading.most_since(before).as_secs_f64();
                let span = now.saturating_duration_since(*at).as_secs_f64();
                let window = now.saturating_duration_since(began).as_secs_f64();
                match span > window {
                    true => Since::Waited(most * window / span),
                    false => Since::Waited(most),
                }
            }
            _ => Since::Unknown,
        };
        self.mark = Some((now, reading));
        since
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

    /// Two threads: one waits as the test says, the other never.
    fn fake() -> Option<Arc<Waits>> {
        let ms = WAITED_MS.load(Ordering::Relaxed);
        Some(Arc::new(Waits::new(vec![(7, ms * 1_000_000), (3, 0)])))
    }

    #[test]
    fn the_wait_is_of_the_window_that_closed_and_read_only_when_warm() {
        let mut own = OwnWait::new(fake);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        WAITED_MS.store(100, Ordering::Relaxed);
        assert_eq!(own.at_close(false, at(100)), Since::Unread);
        // Read, but nothing was read before.
        assert_eq!(own.at_close(true, at(200)), Since::Unknown);
        WAITED_MS.store(130, Ordering::Relaxed);
        assert_eq!(own.at_close(true, at(300)), Since::Waited(0.03));
        // A calm window between: the wait since the last reading, spread
        // over the two windows.
        assert_eq!(own.at_close(false, at(400)), Since::Unread);
        WAITED_MS.store(330, Ordering::Relaxed);
        match own.at_close(true, at(500)) {
            Since::Waited(w) => assert!((w - 0.1).abs() < 1e-9, "{w}"),
            other => panic!("{other:?}"),
        }
        // Threads that ended take their wait with them: never below zero.
        WAITED_MS.store(20, Ordering::Relaxed);
        assert_eq!(own.at_close(true, at(600)), Since::Waited(0.0));
        // Past a second since the last reading: not known.
        assert_eq!(own.at_close(false, at(1000)), Since::Unread);
        assert_eq!(own.at_close(true, at(1700)), Since::Unknown);
    }

    #[test]
    fn the_most_one_thread_waited_not_the_sum() {
        let before = Waits::new(vec![(1, 100), (2, 50), (9, 10)]);
        // 2 waited 70 more, 1 waited 30; 4 is new (40 since it began); 9
        // ended; a thread id used again with less is nothing.
        let now = Waits::new(vec![(4, 40), (2, 120), (1, 130)]);
        assert_eq!(now.most_since(&before), Duration::from_nanos(70));
        let reused = Waits::new(vec![(1, 5)]);
        assert_eq!(reused.most_since(&before), Duration::ZERO);
        assert_eq!(Waits::default().most_since(&before), Duration::ZERO);
    }

    mod limiter {
        use std::cell::Cell;
        use std::time::Duration;

        use tokio::time::Instant;

        use super::super::{Reader, Waits};
        use crate::policy::limit::{Limiter, Sample};
        use crate::policy::paths::PathKey;
        use crate::policy::settings::AdaptiveConfig;
        use std::sync::Arc;

        thread_local! {
            /// The proxy's own wait so far, as the fake reader says.
            static WAITED: Cell<Duration> = const { Cell::new(Duration::ZERO) };
        }

        fn fake() -> Option<Arc<Waits>> {
            let ns = WAITED.with(Cell::get).as_nanos() as u64;
            Some(Arc::new(Waits::new(vec![(1, ns), (2, ns / 2)])))
        }

        fn limiter(read: Reader) -> Limiter {
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
