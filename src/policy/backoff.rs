//! Exponential backoff with jitter.
//!
//! Why jitter: callers that fail together and back off by the same formula
//! retry together, again and again — they stay phase-locked, and every retry
//! wave hits the upstream at once. Drawing each delay at random from a range
//! spreads the waves out (see the "Exponential Backoff And Jitter" analysis;
//! `herdguard lab` reproduces it).
//!
//! For retry n (n = 1 for the first retry), `ceiling = min(cap, base * multiplier^(n-1))`:
//! - `none`: the ceiling itself (kept for comparison; not recommended),
//! - `full`: uniform in `[0, ceiling)`,
//! - `equal`: `ceiling/2` plus uniform in `[0, ceiling/2)`,
//! - `decorrelated`: `min(cap, uniform in [base, prev * 3))`, where `prev` is the previous delay.

use std::time::Duration;

use rand::Rng;

use crate::policy::settings::{BackoffConfig, Jitter};
use crate::units::format_duration;

/// A backoff that exists is valid: base > 0, cap >= base, multiplier in [1, 100].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    multiplier: f64,
    jitter: Jitter,
}

/// Why a backoff could not be built; [`key`](InvalidBackoff::key) names
/// the config key at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidBackoff {
    #[error("must be longer than zero")]
    ZeroBase,
    #[error("{} is below base ({})", format_duration(*cap), format_duration(*base))]
    CapBelowBase { cap: Duration, base: Duration },
    #[error("{0} is out of range 1.0..=100.0")]
    Multiplier(f64),
}

impl InvalidBackoff {
    pub fn key(&self) -> &'static str {
        match self {
            InvalidBackoff::ZeroBase => "base",
            InvalidBackoff::CapBelowBase { .. } => "cap",
            InvalidBackoff::Multiplier(_) => "multiplier",
        }
    }
}

/// What one request remembers between its retries.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackoffState {
    /// Retries made so far.
    retries: u32,
    /// The last delay drawn, for decorrelated jitter.
    prev: Option<Duration>,
}

impl Backoff {
    pub fn try_new(
        base: Duration,
        cap: Duration,
        multiplier: f64,
        jitter: Jitter,
    ) -> Result<Self, InvalidBackoff> {
        if base.is_zero() {
            return Err(InvalidBackoff::ZeroBase);
        }
        if cap < base {
            return Err(InvalidBackoff::CapBelowBase { cap, base });
        }
        if !(multiplier.is_finite() && (1.0..=100.0).contains(&multiplier)) {
            return Err(InvalidBackoff::Multiplier(multiplier));
        }
        Ok(Self {
            base,
            cap,
            multiplier,
            jitter,
        })
    }

    pub fn from_config(c: &BackoffConfig) -> Result<Self, InvalidBackoff> {
        Self::try_new(c.base, c.cap, c.multiplier, c.jitter)
    }

    pub fn base(&self) -> Duration {
        self.base
    }

    pub fn cap(&self) -> Duration {
        self.cap
    }

    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// `min(cap, base * multiplier^(n-1))` for retry `n >= 1`; never overflows.
    pub fn ceiling(&self, n: u32) -> Duration {
        let exp = n.saturating_sub(1).min(i32::MAX as u32) as i32;
        let factor = self.multiplier.powi(exp);
        let secs = self.base.as_secs_f64() * factor;
        if !secs.is_finite() || secs >= self.cap.as_secs_f64() {
            self.cap
        } else {
            Duration::from_secs_f64(secs).min(self.cap)
        }
    }

    /// The delay before the next retry; advances `state`.
    pub fn next_delay<R: Rng + ?Sized>(&self, state: &mut BackoffState, rng: &mut R) -> Duration {
        state.retries = state.retries.saturating_add(1);
        let ceiling = self.ceiling(state.retries);
        let delay = match self.jitter {
            Jitter::None => ceiling,
            Jitter::Full => uniform(rng, Duration::ZERO, ceiling),
            Jitter::Equal => {
                let half = ceiling / 2;
                half + uniform(rng, Duration::ZERO, ceiling - half)
            }
            Jitter::Decorrelated => {
                let prev = state.prev.unwrap_or(self.base);
                let upper = prev.saturating_mul(3).min(self.cap.saturating_mul(3));
                uniform(rng, self.base, upper.max(self.base)).min(self.cap)
            }
        };
        state.prev = Some(delay);
        delay
    }
}

/// Uniform in `[low, high)`; `low` when the range is empty.
fn uniform<R: Rng + ?Sized>(rng: &mut R, low: Duration, high: Duration) -> Duration {
    if high <= low {
        return low;
    }
    let span = (high - low).as_nanos().min(u64::MAX as u128) as u64;
    low + Duration::from_nanos(rng.random_range(0..span))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn backoff(jitter: Jitter) -> Backoff {
        Backoff::try_new(
            Duration::from_millis(100),
            Duration::from_secs(10),
            2.0,
            jitter,
        )
        .unwrap()
    }

    #[test]
    fn rejects_invalid_parameters() {
        let ms = Duration::from_millis;
        assert_eq!(
            Backoff::try_new(ms(0), ms(1), 2.0, Jitter::Full),
            Err(InvalidBackoff::ZeroBase)
        );
        assert_eq!(
            Backoff::try_new(ms(2), ms(1), 2.0, Jitter::Full),
            Err(InvalidBackoff::CapBelowBase {
                cap: ms(1),
                base: ms(2)
            })
        );
        assert_eq!(
            Backoff::try_new(ms(1), ms(2), 0.5, Jitter::Full),
            Err(InvalidBackoff::Multiplier(0.5))
        );
        assert!(matches!(
            Backoff::try_new(ms(1), ms(2), f64::NAN, Jitter::Full),
            Err(InvalidBackoff::Multiplier(_))
        ));
    }

    #[test]
    fn ceiling_grows_then_caps() {
        let b = backoff(Jitter::None);
        let ms = |n| b.ceiling(n).as_millis();
        assert_eq!([ms(1), ms(2), ms(3), ms(4)], [100, 200, 400, 800]);
        assert_eq!(ms(8), 10_000, "12.8s capped at 10s");
        assert_eq!(ms(10_000), 10_000);
        assert_eq!(ms(u32::MAX), 10_000);
    }

    #[test]
    fn none_is_the_ceiling() {
        let b = backoff(Jitter::None);
        let mut s = BackoffState::default();
        let mut rng = SmallRng::seed_from_u64(1);
        let delays: Vec<u128> = (0..4)
            .map(|_| b.next_delay(&mut s, &mut rng).as_millis())
            .collect();
        assert_eq!(delays, [100, 200, 400, 800]);
    }
}
