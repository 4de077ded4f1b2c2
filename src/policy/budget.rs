//! The retry budget of a route.
//!
//! Why a budget and not only a maximum number of attempts: with `attempts = 3`
//! alone, an upstream that fails every request receives three times its
//! normal load exactly when it can least take it — and every layer that
//! retries multiplies that again. A budget caps retries as a share of
//! requests: each request deposits `ratio` tokens, each retry withdraws one,
//! over a sliding window; `min_per_second` lets a quiet route still retry.
//! Under total failure, attempts stay at most `requests * (1 + ratio) + floor`.
//!
//! The window is a ring of slots (one tenth of the window each). A deposit is
//! one atomic add to the current slot; a withdrawal sums the ring. No locks:
//! a slot that rolls over is reset by whoever first sees it stale, and the few
//! counts that race with a reset are lost, which only makes the budget
//! stricter or looser by a token or two.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::policy::settings::BudgetConfig;

const SLOTS: usize = 10;

#[derive(Debug)]
pub struct Budget {
    ratio: f64,
    /// Retries allowed per window whatever the traffic: `min_per_second * window`.
    floor: f64,
    slot_width: Duration,
    start: Instant,
    slots: [Slot; SLOTS],
}

#[derive(Debug, Default)]
struct Slot {
    /// Which slot index (since `start`) this slot currently counts.
    epoch: AtomicU64,
    deposits: AtomicU64,
    withdrawals: AtomicU64,
    /// Tokens given back by retries refused after they were taken.
    refunds: AtomicU64,
}

/// Why a budget could not be built; [`key`](InvalidBudget::key) names the
/// config key at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidBudget {
    #[error("{0} is out of range 0.0..=1.0")]
    Ratio(f64),
    #[error("must be between 1s and 1h")]
    Window,
}

impl InvalidBudget {
    pub fn key(&self) -> &'static str {
        match self {
            InvalidBudget::Ratio(_) => "ratio",
            InvalidBudget::Window => "window",
        }
    }
}

impl Budget {
    pub fn try_new(
        ratio: f64,
        min_per_second: u32,
        window: Duration,
        now: Instant,
    ) -> Result<Self, InvalidBudget> {
        if !(0.0..=1.0).contains(&ratio) {
            return Err(InvalidBudget::Ratio(ratio));
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&window) {
            return Err(InvalidBudget::Window);
        }
        Ok(Self {
            ratio,
            floor: f64::from(min_per_second) * window.as_secs_f64(),
            slot_width: window / SLOTS as u32,
            start: now,
            slots: Default::default(),
        })
    }

    pub fn from_config(c: &BudgetConfig, now: Instant) -> Result<Self, InvalidBudget> {
        Self::try_new(c.ratio, c.min_per_second, c.window, now)
    }

    /// Records a request. Call once per request, before its first attempt.
    pub fn deposit(&self, now: Instant) {
        self.slot(now).deposits.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes a token for one retry; `false` when the budget is spent.
    pub fn withdraw(&self, now: Instant) -> bool {
        if !self.has_token(now) {
            return false;
        }
        self.slot(now).withdrawals.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Gives back a token taken by [`withdraw`](Self::withdraw) for a retry
    /// that was then not sent (the breaker or the upstream's limit refused it).
    /// Whether a token could be taken now (another request may take it
    /// first: [`Budget::withdraw`] says).
    pub fn has_token(&self, now: Instant) -> bool {
        self.available(now) >= 1.0
    }

    pub fn refund(&self, now: Instant) {
        self.slot(now).refunds.fetch_add(1, Ordering::Relaxed);
    }

    /// Retries the budget would allow now.
    pub fn available(&self, now: Instant) -> f64 {
        self.levels(now).0
    }

    /// Retries the budget would allow now, and all it allowed over its
    /// window (its floor and its share of the requests), spent or not.
    pub fn levels(&self, now: Instant) -> (f64, f64) {
        let current = self.index(now);
        let (mut deposits, mut withdrawals, mut refunds) = (0u64, 0u64, 0u64);
        for slot in &self.slots {
            let epoch = slot.epoch.load(Ordering::Acquire);
            if epoch + (SLOTS as u64) > current && epoch <= current {
                deposits += slot.deposits.load(Ordering::Relaxed);
                withdrawals += slot.withdrawals.load(Ordering::Relaxed);
                refunds += slot.refunds.load(Ordering::Relaxed);
            }
        }
        let spent = withdrawals.saturating_sub(refunds);
        let capacity = self.floor + self.ratio * deposits as f64;
        ((capacity - spent as f64).max(0.0), capacity)
    }

    fn index(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.start).as_nanos() / self.slot_width.as_nanos()) as u64
    }

    /// The slot for `now`, reset first if it still counts an older period.
    fn slot(&self, now: Instant) -> &Slot {
        let index = self.index(now);
        let slot = &self.slots[(index % SLOTS as u64) as usize];
        let epoch = slot.epoch.load(Ordering::Acquire);
        if epoch != index
            && slot
                .epoch
                .compare_exchange(epoch, index, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            slot.deposits.store(0, Ordering::Relaxed);
            slot.withdrawals.store(0, Ordering::Relaxed);
            slot.refunds.store(0, Ordering::Relaxed);
        }
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn floor_then_ratio() {
        let now = Instant::now();
        let b = Budget::try_new(0.2, 1, Duration::from_secs(10), now).unwrap();
        // The floor: 1/s over 10 s.
        let granted = (0..100).filter(|_| b.withdraw(now)).count();
        assert_eq!(granted, 10);
        // 100 requests add 20 more.
        for _ in 0..100 {
            b.deposit(now);
        }
        let granted = (0..100).filter(|_| b.withdraw(now)).count();
        assert_eq!(granted, 20);
        assert!(!b.withdraw(now));
    }

    #[tokio::test(start_paused = true)]
    async fn old_slots_slide_out_of_the_window() {
        let t0 = Instant::now();
        let b = Budget::try_new(0.5, 0, Duration::from_secs(10), t0).unwrap();
        for _ in 0..10 {
            b.deposit(t0);
        }
        assert_eq!(b.available(t0), 5.0);
        assert!(b.withdraw(t0));
        assert_eq!(
            b.available(t0 + Duration::from_secs(9)),
            4.0,
            "still inside the window"
        );
        assert_eq!(b.available(t0 + Duration::from_secs(10)), 0.0, "slid out");
        // A stale slot is reset on reuse, not summed.
        let later = t0 + Duration::from_secs(20);
        b.deposit(later);
        b.deposit(later);
        assert_eq!(b.available(later), 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refund_gives_the_token_back() {
        let now = Instant::now();
        let b = Budget::try_new(0.0, 1, Duration::from_secs(1), now).unwrap();
        assert!(b.withdraw(now));
        assert!(!b.withdraw(now));
        b.refund(now);
        assert_eq!(b.available(now), 1.0);
        assert!(b.withdraw(now));
        // More refunds than withdrawals never mint tokens.
        b.refund(now);
        b.refund(now);
        b.refund(now);
        assert_eq!(b.available(now), 1.0);
    }

    #[test]
    fn rejects_invalid_parameters() {
        let now = Instant::now();
        assert_eq!(
            Budget::try_new(1.5, 0, Duration::from_secs(1), now).unwrap_err(),
            InvalidBudget::Ratio(1.5)
        );
        assert_eq!(
            Budget::try_new(0.1, 0, Duration::from_millis(10), now).unwrap_err(),
            InvalidBudget::Window
        );
    }
}
