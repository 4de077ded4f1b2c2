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

use crate::config::AdaptiveConfig;

#[derive(Debug, Clone)]
pub struct Limiter {
    limit: f64,
    min_limit: f64,
    max_limit: f64,
    tolerance: f64,
    smoothing: f64,
    /// Long-run average latency, in seconds (exponentially weighted).
    long_rtt: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidLimiter {
    #[error("need 1 <= min_limit <= initial_limit, and max_in_flight >= 1")]
    Limits,
    #[error("tolerance must be at least 1.0, smoothing in (0, 1]")]
    Factors,
}

/// How an attempt went, as the limiter sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sample {
    /// Response headers after this long.
    Latency(Duration),
    /// Timed out or failed in a way that says the upstream is struggling.
    Dropped,
}

/// Samples over which the long-run average mostly forms.
const LONG_WINDOW: f64 = 500.0;

impl Limiter {
    /// The initial and minimum limits are taken down to `max_in_flight` when above it.
    pub fn try_new(c: &AdaptiveConfig, max_in_flight: usize) -> Result<Self, InvalidLimiter> {
        let max = max_in_flight as f64;
        if !(1 <= c.min_limit && c.min_limit <= c.initial_limit && max_in_flight >= 1) {
            return Err(InvalidLimiter::Limits);
        }
        if !(c.tolerance >= 1.0 && c.smoothing > 0.0 && c.smoothing <= 1.0) {
            return Err(InvalidLimiter::Factors);
        }
        Ok(Self {
            limit: (c.initial_limit as f64).min(max),
            min_limit: (c.min_limit as f64).min(max),
            max_limit: max,
            tolerance: c.tolerance,
            smoothing: c.smoothing,
            long_rtt: None,
        })
    }

    /// Requests allowed in flight now.
    pub fn limit(&self) -> usize {
        self.limit as usize
    }

    /// Updates the limit after an attempt; `in_flight` counts it too.
    pub fn update(&mut self, sample: Sample, in_flight: usize) {
        let new = match sample {
            // A timeout says the upstream is struggling now: back off at once.
            Sample::Dropped => {
                self.limit = (self.limit * 0.9).clamp(self.min_limit, self.max_limit);
                return;
            }
            Sample::Latency(rtt) => {
                let short = rtt.as_secs_f64().max(1e-6);
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
                // Grow only when the limit is what holds requests back.
                if (in_flight as f64) < self.limit / 2.0 {
                    new = new.min(self.limit);
                }
                new
            }
        };
        let smoothed = self.limit * (1.0 - self.smoothing) + new * self.smoothing;
        self.limit = smoothed.clamp(self.min_limit, self.max_limit);
    }
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

    #[test]
    fn grows_under_steady_latency_when_in_use() {
        let mut l = limiter();
        for _ in 0..200 {
            l.update(ms(10), l.limit());
        }
        assert!(l.limit() > 200, "{}", l.limit());
        let before = l.limit();
        for _ in 0..200 {
            l.update(ms(10), 3);
        }
        assert_eq!(l.limit(), before, "an idle limit does not grow");
    }

    #[test]
    fn falls_as_latency_rises_and_recovers_when_it_drops() {
        let mut l = limiter();
        for _ in 0..300 {
            l.update(ms(10), l.limit());
        }
        let healthy = l.limit();
        for _ in 0..100 {
            l.update(ms(200), l.limit());
        }
        let slow = l.limit();
        assert!(slow < healthy / 4, "{slow} vs {healthy}");
        for _ in 0..400 {
            l.update(ms(10), l.limit());
        }
        assert!(
            l.limit() > slow * 4,
            "recovered to {} from {slow}",
            l.limit()
        );
    }

    #[test]
    fn timeouts_shrink_it_to_the_floor_and_no_further() {
        let mut l = limiter();
        for _ in 0..100 {
            l.update(Sample::Dropped, 0);
        }
        assert_eq!(l.limit(), 5);
    }

    #[test]
    fn never_above_max_in_flight() {
        let mut l = limiter();
        for _ in 0..10_000 {
            l.update(ms(1), l.limit());
        }
        assert_eq!(l.limit(), 1000);
    }
}
