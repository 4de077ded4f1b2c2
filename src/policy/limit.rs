//! The adaptive concurrency limit of an upstream, in the spirit of Netflix's
//! concurrency-limits (Gradient2) and Envoy's adaptive concurrency filter.
//!
//! Why: a static `max_in_flight` is either too high to protect a slow
//! upstream or too low for a fast one. This limit follows the upstream: it
//! compares each request's latency with the long-run average latency; while
//! they agree the limit may grow (by about its square root, and only while
//! the limit is actually in use), and when latency climbs above `tolerance`
//! times the average, or attempts time out or fail, it shrinks. An upstream
//! that slows down thus gets fewer requests at once, by itself.
//!
//! Pure: latencies come in as numbers; the upstream keeps it behind a mutex
//! taken once per completed attempt.

use std::time::Duration;

use tokio::time::Instant;

use crate::policy::settings::AdaptiveConfig;

use super::outcome::{Outcome, UpstreamFault};

#[derive(Debug, Clone)]
pub struct Limiter {
    limit: f64,
    /// Where the limit starts, and where it comes back to when the upstream
    /// is healthy, however light the traffic.
    initial: f64,
    min_limit: f64,
    max_limit: f64,
    tolerance: f64,
    smoothing: f64,
    /// Long-run average latency, in seconds (exponentially weighted).
    long_rtt: Option<f64>,
    window: Option<Window>,
    /// When a timeout last cut the limit: it is cut at most once per window.
    last_cut: Option<Instant>,
    /// When an attempt last timed out at all.
    last_drop: Option<Instant>,
    /// When a sample last came: a limit left low by a past spell comes back
    /// once the upstream has been quiet for [`QUIET`].
    last_sample: Option<Instant>,
}

/// Why a limiter could not be built; [`key`](InvalidLimiter::key) names
/// the key of `adaptive_concurrency` at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidLimiter {
    #[error("must be at least 1")]
    MinLimit,
    #[error("must not be below min_limit")]
    InitialLimit,
    #[error("{0} must be at least 1.0")]
    Tolerance(f64),
    #[error("{0} is out of range (0.0, 1.0]")]
    Smoothing(f64),
}

impl InvalidLimiter {
    pub fn key(&self) -> &'static str {
        match self {
            InvalidLimiter::MinLimit => "min_limit",
            InvalidLimiter::InitialLimit => "initial_limit",
            InvalidLimiter::Tolerance(_) => "tolerance",
            InvalidLimiter::Smoothing(_) => "smoothing",
        }
    }
}

/// How an attempt went, as the limiter sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sample {
    /// Response headers after this long.
    Latency(Duration),
    /// Timed out or failed in a way that says the upstream is struggling.
    Dropped,
}

impl Sample {
    /// What an attempt that ended in `outcome` after `elapsed` teaches the
    /// limit: the one mapping from an outcome to the limiter.
    ///
    /// An answer is a latency. A per-try timeout is a drop: the upstream is
    /// struggling now. Nothing else is a sample: a caller that hung up, sent
    /// a bad body or stalled, and a request cut short by its own deadline,
    /// say nothing about the upstream, so callers who give up cannot move
    /// the limit. Neither do connection failures, which the breaker counts.
    pub fn of(outcome: Outcome, elapsed: Duration) -> Option<Sample> {
        match outcome {
            Outcome::Response(_) | Outcome::Grpc(_) => Some(Sample::Latency(elapsed)),
            Outcome::Upstream(UpstreamFault::Timeout) => Some(Sample::Dropped),
            _ => None,
        }
    }
}

/// With no samples this long, a limit that fell comes back to its initial value.
const QUIET: Duration = Duration::from_secs(5);

/// Samples over which the long-run average mostly forms.
const LONG_WINDOW: f64 = 500.0;
/// The limit moves at most once per window of samples this long ...
const WINDOW: Duration = Duration::from_millis(100);
/// ... holding at least this many samples (or a timeout).
const MIN_SAMPLES: u32 = 10;

impl Limiter {
    /// The initial and minimum limits are taken down to `max_in_flight` when
    /// above it (and `max_in_flight` up to 1, its least).
    pub fn try_new(c: &AdaptiveConfig, max_in_flight: usize) -> Result<Self, InvalidLimiter> {
        let max = max_in_flight.max(1) as f64;
        if c.min_limit == 0 {
            return Err(InvalidLimiter::MinLimit);
        }
        if c.initial_limit < c.min_limit {
            return Err(InvalidLimiter::InitialLimit);
        }
        if !(c.tolerance.is_finite() && c.tolerance >= 1.0) {
            return Err(InvalidLimiter::Tolerance(c.tolerance));
        }
        if !(c.smoothing > 0.0 && c.smoothing <= 1.0) {
            return Err(InvalidLimiter::Smoothing(c.smoothing));
        }
        Ok(Self {
            limit: (c.initial_limit as f64).min(max),
            initial: (c.initial_limit as f64).min(max),
            last_cut: None,
            last_drop: None,
            last_sample: None,
            min_limit: (c.min_limit as f64).min(max),
            max_limit: max,
            tolerance: c.tolerance,
            smoothing: c.smoothing,
            long_rtt: None,
            window: None,
        })
    }

    /// Requests allowed in flight now.
    pub fn limit(&self) -> usize {
        self.limit as usize
    }

    /// Records an attempt's outcome at `now`; `in_flight` counts it too.
    ///
    /// Samples are gathered over a window (100 ms, and at least 10 samples,
    /// as Netflix's `WindowedLimit` does) and the limit moves once per window
    /// on the window's average latency: a burst of slow answers caused by a
    /// hiccup of the proxy itself does not collapse the limit.
    pub fn update(&mut self, sample: Sample, in_flight: usize, now: Instant) {
        self.last_sample = Some(now);
        if sample == Sample::Dropped {
            self.last_drop = Some(now);
            // A timeout says the upstream is struggling now: halve at once,
            // but once per window, however many time out together.
            let cut_lately = self
                .last_cut
                .is_some_and(|at| now.saturating_duration_since(at) < WINDOW);
            if !cut_lately {
                self.limit = (self.limit * 0.5).clamp(self.min_limit, self.max_limit);
                self.last_cut = Some(now);
            }
            self.window = None;
            return;
        }
        let w = self.window.get_or_insert(Window {
            start: now,
            sum: 0.0,
            count: 0,
            max_in_flight: 0,
        });
        if let Sample::Latency(rtt) = sample {
            w.sum += rtt.as_secs_f64();
            w.count += 1;
        }
        w.max_in_flight = w.max_in_flight.max(in_flight);
        let age = now.saturating_duration_since(w.start);
        // Light traffic fills no window of MIN_SAMPLES: after ten windows'
        // time, what came is enough.
        let ripe = age >= WINDOW && (w.count >= MIN_SAMPLES || age >= WINDOW * 10);
        if !ripe {
            return;
        }
        let Some(w) = self.window.take() else {
            return;
        };
        self.apply(
            (w.sum / f64::from(w.count.max(1))).max(1e-6),
            w.max_in_flight,
        );
    }

    /// A limit left below its initial value by a past spell comes back to it
    /// once the upstream has had no traffic for `QUIET` and no timeout for
    /// six times that: with nothing bad learnt since, the first burst after
    /// a quiet time is not shed for what happened before it. An upstream
    /// that still times out now and then (breaker probes into an outage)
    /// keeps its low limit, so the burst when the breaker closes is held.
    /// Called once a second.
    pub fn relax(&mut self, now: Instant) {
        let since = |at: Option<Instant>| at.map(|at| now.saturating_duration_since(at));
        let quiet = since(self.last_sample).is_none_or(|d| d >= QUIET);
        let calm = since(self.last_drop).is_none_or(|d| d >= QUIET * 6);
        if quiet && calm && self.limit < self.initial {
            self.limit = self.initial;
            self.window = None;
        }
    }

    fn apply(&mut self, short: f64, in_flight: usize) {
        let long = match self.long_rtt {
            None => short,
            Some(long) => {
                let mut long = long + (short - long) / LONG_WINDOW;
                // After a slow spell, let the average come back down quickly.
                if long > 2.0 * short {
                    long *= 0.95;
                }
                long
            }
        };
        self.long_rtt = Some(long);
        let gradient = (self.tolerance * long / short).clamp(0.5, 1.0);
        let mut new = self.limit * gradient + self.limit.sqrt();
        // Grow only when the limit is what holds requests back; but a limit
        // below where it started grows back toward it while latency is
        // normal, however light the traffic (by its square root per window,
        // as when in use: not in one leap that would flood an upstream that
        // has just recovered).
        if (in_flight as f64) < self.limit / 2.0 {
            let ceiling = if gradient >= 1.0 {
                self.limit.max(self.initial)
            } else {
                self.limit
            };
            new = new.min(ceiling);
        }
        // Shrink smoothly (one slow window is not a trend), grow at once:
        // a recovered upstream gets its traffic back within a second or so.
        let next = if new < self.limit {
            self.limit * (1.0 - self.smoothing) + new * self.smoothing
        } else {
            new
        };
        self.limit = next.clamp(self.min_limit, self.max_limit);
    }
}

/// Samples gathered since the limit last moved.
#[derive(Debug, Clone)]
struct Window {
    start: Instant,
    sum: f64,
    count: u32,
    max_in_flight: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter() -> Limiter {
        let c = AdaptiveConfig {
            enabled: true,
            min_limit: 5,
            initial_limit: 50,
            tolerance: 2.0,
            smoothing: 0.2,
        };
        Limiter::try_new(&c, 1000).unwrap()
    }

    fn ms(n: u64) -> Sample {
        Sample::Latency(Duration::from_millis(n))
    }

    /// Feeds `n` windows of `sample`, each window 10 samples over 100 ms.
    fn feed(
        l: &mut Limiter,
        clock: &mut Instant,
        n: usize,
        sample: Sample,
        in_flight: impl Fn(&Limiter) -> usize,
    ) {
        for _ in 0..n {
            for _ in 0..10 {
                *clock += Duration::from_millis(10);
                let busy = in_flight(l);
                l.update(sample, busy, *clock);
            }
        }
    }

    #[test]
    fn grows_under_steady_latency_when_in_use() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 150, ms(10), Limiter::limit);
        assert!(l.limit() > 200, "{}", l.limit());
        feed(&mut l, &mut clock, 2, ms(10), |_| 3); // let the busy window close
        let before = l.limit();
        feed(&mut l, &mut clock, 50, ms(10), |_| 3);
        assert_eq!(l.limit(), before, "an idle limit does not grow");
    }

    #[test]
    fn falls_as_latency_rises_and_recovers_when_it_drops() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 60, ms(10), Limiter::limit);
        let healthy = l.limit();
        feed(&mut l, &mut clock, 30, ms(200), Limiter::limit);
        let slow = l.limit();
        assert!(slow < healthy / 4, "{slow} vs {healthy}");
        feed(&mut l, &mut clock, 100, ms(10), Limiter::limit);
        assert!(
            l.limit() > slow * 4,
            "recovered to {} from {slow}",
            l.limit()
        );
    }

    #[test]
    fn a_single_slow_window_is_not_a_collapse() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 60, ms(1), Limiter::limit);
        let healthy = l.limit();
        // One hiccup: a whole window of answers five times slower.
        feed(&mut l, &mut clock, 1, ms(5), Limiter::limit);
        assert!(
            l.limit() as f64 > healthy as f64 * 0.85,
            "{} after a hiccup from {healthy}",
            l.limit()
        );
    }

    #[test]
    fn timeouts_shrink_it_to_the_floor_and_no_further() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        for _ in 0..100 {
            clock += Duration::from_millis(100);
            l.update(Sample::Dropped, 0, clock);
        }
        assert_eq!(l.limit(), 5);
    }

    #[test]
    fn only_answers_and_timeouts_are_samples() {
        use crate::policy::outcome::{CallerFault, Refusal};
        let second = Duration::from_secs(1);
        let ok = Outcome::Response(http::StatusCode::OK);
        assert_eq!(Sample::of(ok, second), Some(Sample::Latency(second)));
        let timeout = Outcome::Upstream(UpstreamFault::Timeout);
        assert_eq!(Sample::of(timeout, second), Some(Sample::Dropped));
        for o in [
            Outcome::Caller(CallerFault::Gone),
            Outcome::Caller(CallerFault::MalformedBody),
            Outcome::Caller(CallerFault::StalledBody),
            Outcome::Deadline,
            Outcome::Upstream(UpstreamFault::ConnectFailure),
            Outcome::Refused(Refusal::Overloaded),
        ] {
            assert_eq!(Sample::of(o, second), None, "{o:?}");
        }
    }

    #[test]
    fn timeouts_together_cut_it_once_and_healthy_light_traffic_brings_it_back() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        // 30 attempts time out together.
        for _ in 0..30 {
            l.update(Sample::Dropped, 30, clock);
        }
        assert_eq!(l.limit(), 25, "one cut by half from 50");
        // A spell of timeouts over seconds takes it to the floor.
        for _ in 0..100 {
            clock += Duration::from_millis(100);
            l.update(Sample::Dropped, 1, clock);
        }
        assert_eq!(l.limit(), 5);
        // Then two healthy answers a second, one in flight at a time.
        for _ in 0..60 {
            clock += Duration::from_millis(500);
            l.update(ms(10), 1, clock);
        }
        assert_eq!(l.limit(), 50, "back to where it started within 30 s");
    }

    #[test]
    fn a_quiet_upstream_gets_its_initial_limit_back() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        for _ in 0..100 {
            clock += Duration::from_millis(100);
            l.update(Sample::Dropped, 1, clock);
        }
        assert_eq!(l.limit(), 5);
        l.relax(clock + Duration::from_secs(1));
        assert_eq!(l.limit(), 5, "not quiet yet");
        l.relax(clock + QUIET);
        assert_eq!(l.limit(), 5, "a timeout 5 s ago: not calm yet");
        l.relax(clock + QUIET * 6);
        assert_eq!(l.limit(), 50);
    }

    #[test]
    fn never_above_max_in_flight() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 2000, ms(1), Limiter::limit);
        assert_eq!(l.limit(), 1000);
    }
}
